//! Raw types: exactly what the file says, defaults filled in, nothing checked yet — the serde
//! side of the config, read section by section by [`reader`](super::reader) and turned into a
//! [`Snapshot`](super::Snapshot) by [`resolve`](super::resolve).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::Deserialize;

use super::{dialect, limits, routing, saturation, sticky, tls};

/// The whole file, read section by section (see [`read_sections`]) so that every section's errors
/// are reported, not just the first. A key that could not be read is left out (at its default);
/// an entry that could not be read even so is `None`, and its section is named in `failed`:
/// validation then skips what depends on it rather than report errors that are only echoes of
/// the first.
#[derive(Debug, Default)]
pub(super) struct RawConfig {
    pub(super) server: RawServer,
    pub(super) http: RawHttp,
    pub(super) timeouts: RawTimeouts,
    pub(super) upstream: RawUpstream,
    pub(super) clusters: BTreeMap<String, Option<RawCluster>>,
    pub(super) routes: Vec<Option<RawRoute>>,
    pub(super) routing: routing::RawRouting,
    pub(super) sticky: sticky::RawSticky,
    pub(super) saturation: Option<saturation::RawSaturation>,
    pub(super) admin: Option<RawAdmin>,
    pub(super) tls: Option<tls::RawTls>,
    pub(super) access_log: Option<RawAccessLog>,
    pub(super) pricing: BTreeMap<String, Option<RawPrice>>,
    pub(super) keys: Vec<Option<limits::RawKey>>,
    pub(super) policies: Vec<Option<limits::RawPolicy>>,
    pub(super) limits: limits::RawLimits,
    pub(super) failed: BTreeSet<&'static str>,
    /// Sections with a key that could not be read (left out, so at its default).
    pub(super) dirty: BTreeSet<&'static str>,
}

/// The top-level sections, in the order the example config has them.
pub(super) const SECTIONS: [&str; 16] = [
    "server",
    "tls",
    "http",
    "timeouts",
    "upstream",
    "clusters",
    "routes",
    "routing",
    "sticky",
    "saturation",
    "admin",
    "access_log",
    "pricing",
    "keys",
    "policies",
    "limits",
];

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) listen: String,
    /// The environment variable holding the bearer token `POST /admin/reload` requires.
    pub(super) token_env: Option<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawAccessLog {
    pub(super) dir: PathBuf,
    #[serde(default = "default_log_file_bytes")]
    pub(super) max_file_bytes: u64,
    #[serde(default = "default_log_file_age")]
    pub(super) max_file_age_secs: u64,
    #[serde(default = "default_log_batch_bytes")]
    pub(super) batch_bytes: usize,
    #[serde(default = "default_log_queue_batches")]
    pub(super) queue_batches: usize,
    #[serde(default = "default_log_flush_ms")]
    pub(super) flush_interval_ms: u64,
}

pub(super) fn default_log_file_bytes() -> u64 {
    256 << 20
}
pub(super) fn default_log_file_age() -> u64 {
    3600
}
pub(super) fn default_log_batch_bytes() -> usize {
    64 << 10
}
pub(super) fn default_log_queue_batches() -> usize {
    64
}
pub(super) fn default_log_flush_ms() -> u64 {
    200
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrice {
    pub(super) input: f64,
    pub(super) output: f64,
    pub(super) cached_input: Option<f64>,
    pub(super) cache_write_input: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawServer {
    pub(super) listen: String,
    pub(super) workers: usize,
    pub(super) pin_workers: bool,
    /// `None`: what the open-file limit holds ([`super::resolve::default_connections`]).
    pub(super) max_connections_per_worker: Option<usize>,
    /// `None`: `max_connections_per_worker` (an HTTP/1.1 connection carries one request at a
    /// time, so that many can be in flight anyway).
    pub(super) max_requests_per_worker: Option<usize>,
    pub(super) max_body_memory_per_worker: usize,
    pub(super) shutdown_grace_ms: u64,
    /// Where this process offers its listening sockets to a successor (`--takeover PATH`).
    pub(super) takeover_socket: Option<PathBuf>,
    pub(super) trusted_proxies: Vec<String>,
    pub(super) real_ip_header: String,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "127.0.0.1:8080".into(),
            workers: 0,
            pin_workers: true,
            max_connections_per_worker: None,
            max_requests_per_worker: None,
            max_body_memory_per_worker: 256 * 1024 * 1024,
            shutdown_grace_ms: 30_000,
            takeover_socket: None,
            trusted_proxies: Vec::new(),
            real_ip_header: "x-forwarded-for".into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawHttp {
    pub(super) max_request_line_bytes: usize,
    pub(super) max_header_bytes: usize,
    pub(super) max_headers: usize,
    pub(super) max_body_bytes: usize,
    pub(super) max_translated_json_values: usize,
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp {
            max_request_line_bytes: 8192,
            max_header_bytes: 32768,
            max_headers: 100,
            max_body_bytes: 8 << 20,
            max_translated_json_values: 50_000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawTimeouts {
    pub(super) header_read_ms: u64,
    pub(super) body_read_ms: u64,
    pub(super) body_total_ms: u64,
    pub(super) keepalive_idle_ms: u64,
    pub(super) upstream_connect_ms: u64,
    pub(super) upstream_first_byte_ms: u64,
    pub(super) stream_idle_ms: u64,
}

impl Default for RawTimeouts {
    fn default() -> Self {
        RawTimeouts {
            header_read_ms: 10_000,
            body_read_ms: 30_000,
            body_total_ms: 60_000,
            keepalive_idle_ms: 60_000,
            upstream_connect_ms: 3_000,
            upstream_first_byte_ms: 120_000,
            stream_idle_ms: 60_000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawUpstream {
    pub(super) max_idle_per_backend: usize,
    /// `None`: `server.max_connections_per_worker` (each client connection has at most one
    /// request upstream, so the cap never binds before the client side's own).
    pub(super) max_connections_per_backend: Option<usize>,
    pub(super) pool_wait_ms: u64,
    pub(super) idle_timeout_ms: u64,
    pub(super) request_stream_usage: bool,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            max_idle_per_backend: 64,
            max_connections_per_backend: None,
            pool_wait_ms: 100,
            idle_timeout_ms: 30_000,
            request_stream_usage: true,
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    #[serde(default)]
    pub(super) backends: Vec<RawBackend>,
    #[serde(default)]
    pub(super) model_map: BTreeMap<String, String>,
    pub(super) credential: Option<RawCredential>,
    /// A key pool: several credentials, picked by weight; a 401 / 403 benches only the one
    /// that drew it.
    #[serde(default)]
    pub(super) credentials: Vec<RawCredential>,
    pub(super) ca_file: Option<PathBuf>,
    /// Scrape each backend's `/metrics` (vLLM, SGLang) for its queue.
    #[serde(default)]
    pub(super) queue_metrics: bool,
    /// The upstream response headers a client sees (names, `prefix-*`, or `*`).
    #[serde(default = "default_pass_response_headers")]
    pub(super) pass_response_headers: Vec<String>,
    /// An active health check of each backend.
    pub(super) probe: Option<routing::RawProbe>,
    /// The provider's own limits on the whole cluster (every credential together).
    pub(super) provider_limits: Option<limits::RawProviderLimits>,
    /// The API the backends speak.
    #[serde(default)]
    pub(super) dialect: dialect::DialectName,
    /// An Anthropic-dialect cluster's settings.
    pub(super) anthropic: Option<dialect::RawAnthropic>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackend {
    pub(super) base_url: String,
    #[serde(default = "default_weight")]
    pub(super) weight: u32,
}

pub(super) fn default_pass_response_headers() -> Vec<String> {
    vec!["default".into()]
}

pub(super) fn default_weight() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawCredential {
    pub(super) env: String,
    #[serde(default = "default_credential_header")]
    pub(super) header: String,
    /// Share of the requests this credential carries, in a key pool (`credentials`).
    #[serde(default = "default_weight")]
    pub(super) weight: u32,
    /// Send the secret under a header that is not a known credential header without a warning.
    #[serde(default)]
    pub(super) allow_custom_header: bool,
    /// The provider's own limits on this credential alone.
    pub(super) provider_limits: Option<limits::RawProviderLimits>,
}

/// Header names upstream APIs take a key under; any other `credential.header` is likely a typo
/// and draws a warning unless `allow_custom_header` is set.
pub(super) const KNOWN_CREDENTIAL_HEADERS: [&str; 4] =
    ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

pub(super) fn default_credential_header() -> String {
    "authorization".into()
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) model: String,
    /// One cluster: the shorthand for `groups = [{ targets = [{ cluster = "…" }] }]`.
    pub(super) cluster: Option<String>,
    /// Target groups in fallback order.
    #[serde(default)]
    pub(super) groups: Vec<RawGroup>,
    /// Keep a session on one backend.
    pub(super) sticky: Option<sticky::RawStickyRule>,
    /// For a glob route: the concrete names it serves, listed by `GET /v1/models` (a glob
    /// can't be enumerated).
    #[serde(default)]
    pub(super) models: Vec<String>,
    /// Only for these keys (by `id`): their own route for the model, ahead of any other.
    #[serde(default)]
    pub(super) keys: Vec<String>,
    /// Only for the keys of these entities: ahead of the global routes, after a key's own.
    #[serde(default)]
    pub(super) entities: Vec<String>,
    /// The priority class of this route's requests (`[saturation]`), unless their key names one.
    pub(super) class: Option<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawGroup {
    #[serde(default)]
    pub(super) targets: Vec<RawTarget>,
    #[serde(default)]
    pub(super) strategy: routing::Strategy,
    /// The failures of an attempt in an earlier group that move the request on to this one
    /// (labels as the access log's `fallback_reason`); absent: any failure that may move on.
    pub(super) when: Option<Vec<String>>,
    /// How long an attempt on this group's targets waits for the response head (and a stream's
    /// first event) before it counts as a timeout; default `timeouts.upstream_first_byte_ms`.
    pub(super) first_byte_timeout_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawTarget {
    pub(super) cluster: String,
    /// The model name this target's upstream is sent (default: the cluster's `model_map`, or
    /// the requested name).
    pub(super) model: Option<String>,
    #[serde(default = "default_weight")]
    pub(super) weight: u32,
    /// The model's context window in tokens: a request whose prompt estimate plus requested
    /// output does not fit skips this target.
    pub(super) context_window: Option<u64>,
    /// Requests this process sends the target's backends at once before each counts as fully
    /// loaded (for the load-aware strategies).
    pub(super) max_in_flight: Option<u32>,
    /// With `[saturation]`: a backend whose scraped waiting queue holds this many is full.
    pub(super) max_waiting: Option<u32>,
}
