//! Configuration: the TOML file, parsed into raw serde types, validated once into a [`Snapshot`].
//!
//! Runs on the control thread at startup (and for `sluice check`), never on a worker's request
//! path. Takes the file's text; returns an immutable [`Snapshot`] that every worker holds as
//! `Rc<Snapshot>`, or every error found at once, each with the key path it concerns and that
//! key's line and column; warnings (valid but probably not meant) either way. Unknown keys are
//! errors. Backend host names are resolved here, once, so workers never make a blocking DNS call.
//!
//! The text is parsed once into a `toml_edit` document, which keeps spans; each section (each
//! entry of a map or array section) is deserialized on its own with `serde_path_to_error`, so one
//! bad section does not hide the others' errors, and every error's key path is looked up in the
//! document for its position.

// The config loader resolves backend and listener names here, once, on the control thread.
#![allow(clippy::disallowed_methods)]

pub(crate) mod dialect;
pub(crate) mod limits;
mod redis_url;
#[cfg(test)]
mod reference;
pub(crate) mod routing;
pub(crate) mod sticky;
pub(crate) mod tls;

pub(crate) use crate::http::HttpLimits;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::openai::meter::Usage;
use serde::Deserialize;

/// One problem found in a config file, with the dotted path of the key it concerns (`server.listen`,
/// `clusters.a.backends[0].weight`, `pricing."gpt-4.1"`) and, where that key is in the file, its
/// line and column. Warnings use the same type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Empty for a TOML syntax error, which has a position but no key.
    pub(crate) path: String,
    pub(crate) message: String,
    pub(crate) position: Option<Position>,
}

impl ConfigError {
    fn new(path: String, message: String) -> ConfigError {
        ConfigError {
            path,
            message,
            position: None,
        }
    }
}

/// A place in the config file: 1-based line, and 1-based column counted in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) line: usize,
    pub(crate) column: usize,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.path.is_empty(), self.position) {
            (false, Some(p)) => write!(
                f,
                "{} (line {}, column {}): {}",
                self.path, p.line, p.column, self.message
            ),
            (false, None) => write!(f, "{}: {}", self.path, self.message),
            (true, Some(p)) => write!(f, "line {}, column {}: {}", p.line, p.column, self.message),
            (true, None) => f.write_str(&self.message),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Raw types: exactly what the file says, defaults filled in, nothing checked yet.
// ---------------------------------------------------------------------------------------------

/// The whole file, read section by section (see [`read_sections`]) so that every section's errors
/// are reported, not just the first. A key that could not be read is left out (at its default);
/// an entry that could not be read even so is `None`, and its section is named in `failed`:
/// validation then skips what depends on it rather than report errors that are only echoes of
/// the first.
#[derive(Debug, Default)]
struct RawConfig {
    server: RawServer,
    http: RawHttp,
    timeouts: RawTimeouts,
    upstream: RawUpstream,
    clusters: BTreeMap<String, Option<RawCluster>>,
    routes: Vec<Option<RawRoute>>,
    routing: routing::RawRouting,
    sticky: sticky::RawSticky,
    admin: Option<RawAdmin>,
    tls: Option<tls::RawTls>,
    access_log: Option<RawAccessLog>,
    pricing: BTreeMap<String, Option<RawPrice>>,
    keys: Vec<Option<limits::RawKey>>,
    policies: Vec<Option<limits::RawPolicy>>,
    limits: limits::RawLimits,
    failed: BTreeSet<&'static str>,
    /// Sections with a key that could not be read (left out, so at its default).
    dirty: BTreeSet<&'static str>,
}

/// The top-level sections, in the order the example config has them.
const SECTIONS: [&str; 15] = [
    "server",
    "tls",
    "http",
    "timeouts",
    "upstream",
    "clusters",
    "routes",
    "routing",
    "sticky",
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
struct RawAdmin {
    listen: String,
    /// The environment variable holding the bearer token `POST /admin/reload` requires.
    token_env: Option<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawAccessLog {
    dir: PathBuf,
    #[serde(default = "default_log_file_bytes")]
    max_file_bytes: u64,
    #[serde(default = "default_log_file_age")]
    max_file_age_secs: u64,
    #[serde(default = "default_log_batch_bytes")]
    batch_bytes: usize,
    #[serde(default = "default_log_queue_batches")]
    queue_batches: usize,
    #[serde(default = "default_log_flush_ms")]
    flush_interval_ms: u64,
}

fn default_log_file_bytes() -> u64 {
    256 << 20
}
fn default_log_file_age() -> u64 {
    3600
}
fn default_log_batch_bytes() -> usize {
    64 << 10
}
fn default_log_queue_batches() -> usize {
    64
}
fn default_log_flush_ms() -> u64 {
    200
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawPrice {
    input: f64,
    output: f64,
    cached_input: Option<f64>,
    cache_write_input: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
struct RawServer {
    listen: String,
    workers: usize,
    pin_workers: bool,
    max_connections_per_worker: usize,
    /// `None`: `max_connections_per_worker` (an HTTP/1.1 connection carries one request at a
    /// time, so that many can be in flight anyway).
    max_requests_per_worker: Option<usize>,
    max_body_memory_per_worker: usize,
    shutdown_grace_ms: u64,
    /// Where this process offers its listening sockets to a successor (`--takeover PATH`).
    takeover_socket: Option<PathBuf>,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "127.0.0.1:8080".into(),
            workers: 0,
            pin_workers: true,
            max_connections_per_worker: 16384,
            max_requests_per_worker: None,
            max_body_memory_per_worker: 256 * 1024 * 1024,
            shutdown_grace_ms: 30_000,
            takeover_socket: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
struct RawHttp {
    max_request_line_bytes: usize,
    max_header_bytes: usize,
    max_headers: usize,
    max_body_bytes: usize,
}

impl Default for RawHttp {
    fn default() -> Self {
        RawHttp {
            max_request_line_bytes: 8192,
            max_header_bytes: 32768,
            max_headers: 100,
            max_body_bytes: 8 << 20,
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
struct RawTimeouts {
    header_read_ms: u64,
    body_read_ms: u64,
    body_total_ms: u64,
    keepalive_idle_ms: u64,
    upstream_connect_ms: u64,
    upstream_first_byte_ms: u64,
    stream_idle_ms: u64,
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
struct RawUpstream {
    max_idle_per_backend: usize,
    /// `None`: `server.max_connections_per_worker` (each client connection has at most one
    /// request upstream, so the cap never binds before the client side's own).
    max_connections_per_backend: Option<usize>,
    pool_wait_ms: u64,
    idle_timeout_ms: u64,
    request_stream_usage: bool,
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
struct RawCluster {
    #[serde(default)]
    backends: Vec<RawBackend>,
    #[serde(default)]
    model_map: BTreeMap<String, String>,
    credential: Option<RawCredential>,
    /// A key pool: several credentials, picked by weight; a 401 / 403 benches only the one
    /// that drew it.
    #[serde(default)]
    credentials: Vec<RawCredential>,
    ca_file: Option<PathBuf>,
    /// Scrape each backend's `/metrics` (vLLM, SGLang) for its queue.
    #[serde(default)]
    queue_metrics: bool,
    /// An active health check of each backend.
    probe: Option<routing::RawProbe>,
    /// The provider's own limits on the whole cluster (every credential together).
    provider_limits: Option<limits::RawProviderLimits>,
    /// The API the backends speak.
    #[serde(default)]
    dialect: dialect::DialectName,
    /// An Anthropic-dialect cluster's settings.
    anthropic: Option<dialect::RawAnthropic>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawBackend {
    base_url: String,
    #[serde(default = "default_weight")]
    weight: u32,
}

fn default_weight() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawCredential {
    env: String,
    #[serde(default = "default_credential_header")]
    header: String,
    /// Share of the requests this credential carries, in a key pool (`credentials`).
    #[serde(default = "default_weight")]
    weight: u32,
    /// Send the secret under a header that is not a known credential header without a warning.
    #[serde(default)]
    allow_custom_header: bool,
    /// The provider's own limits on this credential alone.
    provider_limits: Option<limits::RawProviderLimits>,
}

/// Header names upstream APIs take a key under; any other `credential.header` is likely a typo
/// and draws a warning unless `allow_custom_header` is set.
const KNOWN_CREDENTIAL_HEADERS: [&str; 4] =
    ["authorization", "x-api-key", "api-key", "x-goog-api-key"];

fn default_credential_header() -> String {
    "authorization".into()
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawRoute {
    model: String,
    /// One cluster: the shorthand for `groups = [{ targets = [{ cluster = "…" }] }]`.
    cluster: Option<String>,
    /// Target groups in fallback order.
    #[serde(default)]
    groups: Vec<RawGroup>,
    /// Keep a session on one backend.
    sticky: Option<sticky::RawStickyRule>,
    /// For a glob route: the concrete names it serves, listed by `GET /v1/models` (a glob
    /// can't be enumerated).
    #[serde(default)]
    models: Vec<String>,
    /// Only for these keys (by `id`): their own route for the model, ahead of any other.
    #[serde(default)]
    keys: Vec<String>,
    /// Only for the keys of these entities: ahead of the global routes, after a key's own.
    #[serde(default)]
    entities: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawGroup {
    #[serde(default)]
    targets: Vec<RawTarget>,
    #[serde(default)]
    strategy: routing::Strategy,
    /// The failures of an attempt in an earlier group that move the request on to this one
    /// (labels as the access log's `fallback_reason`); absent: any failure that may move on.
    when: Option<Vec<String>>,
    /// How long an attempt on this group's targets waits for the response head (and a stream's
    /// first event) before it counts as a timeout; default `timeouts.upstream_first_byte_ms`.
    first_byte_timeout_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct RawTarget {
    cluster: String,
    /// The model name this target's upstream is sent (default: the cluster's `model_map`, or
    /// the requested name).
    model: Option<String>,
    #[serde(default = "default_weight")]
    weight: u32,
    /// The model's context window in tokens: a request whose prompt estimate plus requested
    /// output does not fit skips this target.
    context_window: Option<u64>,
    /// Requests this process sends the target's backends at once before each counts as fully
    /// loaded (for the load-aware strategies).
    max_in_flight: Option<u32>,
}

// ---------------------------------------------------------------------------------------------
// Resolved types: what workers use.
// ---------------------------------------------------------------------------------------------

/// The validated, immutable configuration every worker runs on. Each worker gets its own
/// copy (`Rc<Snapshot>`), so reading it never touches a cache line another core writes.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub(crate) server: ServerConfig,
    pub(crate) http: HttpLimits,
    pub(crate) timeouts: Timeouts,
    pub(crate) upstream: UpstreamLimits,
    /// Clusters, indexed by [`ClusterId`].
    pub(crate) clusters: Vec<Cluster>,
    /// Routes, ordered most specific first (see [`crate::gateway::route`]).
    pub(crate) routes: Vec<Route>,
    /// Attempts, retry budget, breaker and cool-down (`[routing]`).
    pub(crate) routing: routing::RoutingSettings,
    /// The keys affinity cookies are sealed with (`[sticky]`).
    pub(crate) sticky_keys: sticky::StickyKeys,
    /// What inspection reads of request bodies for the routes' sticky rules.
    pub(crate) body_wants: crate::openai::inspect::Wants,
    /// Every backend of every cluster, indexed by [`BackendId`] (pools are per backend).
    pub(crate) backend_count: usize,
    /// Where the admin listener (metrics, health) binds, if anywhere.
    pub(crate) admin_listen: Option<SocketAddr>,
    /// SHA-256 of the bearer token `POST /admin/reload` requires (`None`: no reload over HTTP).
    pub(crate) admin_token_digest: Option<[u8; 32]>,
    /// The TLS listener, when there is one (its certificates reload; its address does not).
    pub(crate) tls: Option<tls::TlsListener>,
    pub(crate) access_log: Option<AccessLogSettings>,
    /// Prices per model name, per million tokens.
    pub(crate) prices: BTreeMap<String, Price>,
    /// API keys, quota plans, limit policies and the sync backend. Shared, not copied, by the
    /// workers: a key table can be large.
    pub(crate) limits: Arc<limits::LimitsConfig>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AccessLogSettings {
    pub(crate) dir: PathBuf,
    pub(crate) max_file_bytes: u64,
    pub(crate) max_file_age: Duration,
    pub(crate) batch_bytes: usize,
    pub(crate) queue_batches: usize,
    pub(crate) flush_interval: Duration,
}

/// A model's price, in currency units per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Price {
    pub(crate) input: f64,
    pub(crate) output: f64,
    /// For prompt tokens served from the provider's cache (defaults to `input`).
    pub(crate) cached_input: f64,
    /// For prompt tokens written to the provider's cache (defaults to `input`): Anthropic bills
    /// them at 1.25× input (5-minute cache) or 2× (1-hour).
    pub(crate) cache_write_input: f64,
}

impl Price {
    /// Cost of one request. Cache reads and writes are parts of `prompt_tokens`, priced apart;
    /// whatever the dialect the usage came in, it is in these terms by now.
    pub(crate) fn cost(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_tokens.min(usage.prompt_tokens);
        let written = usage.cache_write_tokens.min(usage.prompt_tokens - cached);
        let plain = usage.prompt_tokens - cached - written;
        (plain as f64 * self.input
            + cached as f64 * self.cached_input
            + written as f64 * self.cache_write_input
            + usage.completion_tokens as f64 * self.output)
            / 1_000_000.0
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ServerConfig {
    pub(crate) listen: SocketAddr,
    pub(crate) workers: usize,
    pub(crate) pin_workers: bool,
    pub(crate) max_connections_per_worker: usize,
    /// Requests being read or served at once on one worker; past it, new ones get a fast 503.
    pub(crate) max_requests_per_worker: usize,
    /// Request-body bytes one worker holds at once; past it, new bodies get a fast 503.
    pub(crate) max_body_memory_per_worker: usize,
    /// The Unix socket path a successor takes the listening sockets over from.
    pub(crate) takeover_socket: Option<PathBuf>,
    /// How long a stop (SIGTERM, SIGINT) lets requests and streams in flight run before it
    /// ends them.
    pub(crate) shutdown_grace: Duration,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    pub(crate) header_read: Duration,
    pub(crate) body_read: Duration,
    /// The whole body, however it trickles in (`body_read` bounds each read).
    pub(crate) body_total: Duration,
    pub(crate) keepalive_idle: Duration,
    pub(crate) upstream_connect: Duration,
    pub(crate) upstream_first_byte: Duration,
    pub(crate) stream_idle: Duration,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct UpstreamLimits {
    /// Idle connections always kept per backend per worker; more while the last interval
    /// (`idle_timeout`) had more busy at once, so steady load reuses instead of reconnecting.
    pub(crate) max_idle_per_backend: usize,
    pub(crate) max_connections_per_backend: usize,
    /// How long a request waits for a connection when its backend is at the cap, before it
    /// moves on to the next candidate (or gets the 503).
    pub(crate) pool_wait: Duration,
    pub(crate) idle_timeout: Duration,
    /// Ask the upstream for usage on streamed chat completions and completions
    /// (`stream_options.include_usage`) even when the client did not, so limits settle on
    /// reported usage; that client never sees the extra usage chunk.
    pub(crate) request_stream_usage: bool,
}

pub(crate) type ClusterId = usize;
pub(crate) type BackendId = usize;

#[derive(Debug, Clone)]
pub(crate) struct Cluster {
    pub(crate) name: String,
    pub(crate) backends: Vec<Backend>,
    pub(crate) model_map: BTreeMap<String, String>,
    /// The upstream credentials (none, one, or a key pool picked by weight).
    pub(crate) credentials: Vec<Credential>,
    /// TLS client config for https backends (system roots + the cluster's CA file).
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    /// Each backend's `/metrics` is scraped for its queue (`[clusters.x] queue_metrics`).
    pub(crate) queue_metrics: bool,
    /// Each backend is checked actively (`[clusters.x] probe`).
    pub(crate) probe: Option<routing::Probe>,
    /// The provider's limits on the whole cluster (`provider_limits`).
    pub(crate) provider_limits: Option<limits::ProviderLimits>,
    /// The API the backends speak (`dialect`, `anthropic`).
    pub(crate) dialect: dialect::Dialect,
}

/// An upstream credential header, ready to write: `name: value\r\n`. Never logged.
#[derive(Clone)]
pub(crate) struct Credential {
    /// The whole header line, e.g. `authorization: Bearer sk-…\r\n`.
    pub(crate) header_line: Vec<u8>,
    /// Lower-case header name, so the client's own copy of it is never forwarded.
    pub(crate) header_name: String,
    /// The environment variable it came from: its name in logs (never the secret).
    pub(crate) label: String,
    pub(crate) weight: u32,
    /// The provider's limits on this credential alone (`provider_limits`).
    pub(crate) provider_limits: Option<limits::ProviderLimits>,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credential({}: <redacted>)", self.header_name)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Backend {
    pub(crate) id: BackendId,
    pub(crate) weight: u32,
    pub(crate) addrs: Vec<SocketAddr>,
    pub(crate) tls: bool,
    /// Host header value (`host` or `host:port` when the port is not the scheme's default).
    pub(crate) host_header: String,
    /// Host name used for TLS SNI and certificate checks.
    pub(crate) server_name: String,
    /// Path prefix from `base_url`, without a trailing slash (may be empty).
    pub(crate) base_path: String,
}

#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) pattern: ModelPattern,
    /// Target groups in fallback order (at least one, each with at least one target).
    pub(crate) groups: Vec<TargetGroup>,
    /// Keep a session on one backend (`sticky`).
    pub(crate) sticky: Option<sticky::StickyRule>,
    /// Concrete names a glob route declares it serves (each matches the glob), for
    /// `GET /v1/models`; empty for exact routes.
    pub(crate) models: Vec<String>,
    /// Whose requests it serves.
    pub(crate) scope: RouteScope,
}

/// Whose requests a route serves: a key's own routes come first, then its entity's, then the
/// global ones (each most specific first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RouteScope {
    Keys(Vec<limits::KeyIdx>),
    /// Entity indexes ([`limits::LimitsConfig::entities`]).
    Entities(Vec<usize>),
    Global,
}

impl RouteScope {
    /// Whether the route serves a request from key `key` (index, entity); `None`: no key.
    pub(crate) fn serves(&self, key: Option<(limits::KeyIdx, Option<usize>)>) -> bool {
        match (self, key) {
            (RouteScope::Global, _) => true,
            (RouteScope::Keys(keys), Some((k, _))) => keys.contains(&k),
            (RouteScope::Entities(entities), Some((_, Some(e)))) => entities.contains(&e),
            _ => false,
        }
    }

    /// Keys first, then entities, then global: the order routes are looked up in.
    fn rank(&self) -> u8 {
        match self {
            RouteScope::Keys(_) => 0,
            RouteScope::Entities(_) => 1,
            RouteScope::Global => 2,
        }
    }
}

/// Targets one of which serves a request (picked by the group's strategy among the available
/// ones); the group after it is the fallback when none of them can.
#[derive(Debug, Clone)]
pub(crate) struct TargetGroup {
    pub(crate) targets: Vec<RouteTarget>,
    pub(crate) strategy: routing::Strategy,
    /// The failures in an earlier group that lead here (`None`: any that may move on).
    pub(crate) when: Option<routing::FallbackOn>,
    /// The wait for a response head on this group's targets.
    pub(crate) first_byte_timeout: Duration,
}

/// A cluster, and the model name its upstream is sent.
#[derive(Debug, Clone)]
pub(crate) struct RouteTarget {
    pub(crate) cluster: ClusterId,
    /// Overrides the cluster's `model_map` for this route.
    pub(crate) model: Option<String>,
    pub(crate) weight: u32,
    pub(crate) context_window: Option<u64>,
    pub(crate) max_in_flight: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ModelPattern {
    Exact(String),
    /// A glob: the parts between `*`s, in order. `starts_open`/`ends_open` say whether the
    /// pattern starts / ends with `*`.
    Glob {
        source: String,
        parts: Vec<String>,
        starts_open: bool,
        ends_open: bool,
    },
}

impl ModelPattern {
    pub(crate) fn parse(s: &str) -> ModelPattern {
        if !s.contains('*') {
            return ModelPattern::Exact(s.to_string());
        }
        ModelPattern::Glob {
            source: s.to_string(),
            parts: s
                .split('*')
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect(),
            starts_open: s.starts_with('*'),
            ends_open: s.ends_with('*'),
        }
    }

    /// The pattern as written.
    pub(crate) fn source(&self) -> &str {
        match self {
            ModelPattern::Exact(s) | ModelPattern::Glob { source: s, .. } => s,
        }
    }

    /// Literal (non-`*`) characters: the measure of specificity among globs.
    pub(crate) fn literal_len(&self) -> usize {
        match self {
            ModelPattern::Exact(s) => s.len(),
            ModelPattern::Glob { parts, .. } => parts.iter().map(String::len).sum(),
        }
    }

    pub(crate) fn matches(&self, model: &str) -> bool {
        match self {
            ModelPattern::Exact(s) => s == model,
            ModelPattern::Glob {
                parts,
                starts_open,
                ends_open,
                ..
            } => glob_match(parts, *starts_open, *ends_open, model),
        }
    }
}

fn glob_match(parts: &[String], starts_open: bool, ends_open: bool, text: &str) -> bool {
    let mut rest = text;
    for (i, part) in parts.iter().enumerate() {
        let first = i == 0;
        let last = i + 1 == parts.len();
        if first && !starts_open {
            match rest.strip_prefix(part.as_str()) {
                Some(r) => rest = r,
                None => return false,
            }
            if last && !ends_open {
                return rest.is_empty();
            }
            continue;
        }
        if last && !ends_open {
            return rest.len() >= part.len() && rest.ends_with(part.as_str());
        }
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

/// Parse and validate a config file's text. `env` looks up environment variables (credentials),
/// so tests can pass their own instead of touching the process environment. Warnings are dropped;
/// [`load_with_warnings`] returns them too.
pub fn load(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Snapshot, Vec<ConfigError>> {
    load_with_warnings(text, env).snapshot
}

/// What [`load_with_warnings`] found: the snapshot or every error, and every warning (which do not
/// stop the load) either way.
#[derive(Debug)]
pub struct Loaded {
    pub snapshot: Result<Snapshot, Vec<ConfigError>>,
    pub warnings: Vec<ConfigError>,
}

/// [`load`], also returning the warnings: things that are valid but probably not meant, such as
/// a credential header no API knows. Errors and warnings are in file order, each with its line and
/// column where its key is in the file.
pub fn load_with_warnings(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Loaded {
    // A syntax error stops the parse: it is the only error there can be.
    let doc = match toml_edit::ImDocument::parse(text) {
        Ok(doc) => doc,
        Err(e) => {
            let position = e.span().map(|span| position_at(text, span.start));
            return Loaded {
                snapshot: Err(vec![syntax_error(e.message(), position)]),
                warnings: Vec::new(),
            };
        }
    };
    let source = Source { text, doc };
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let raw = read_sections(source.doc.as_table().clone(), &source, &mut errors);
    let read_errors = errors.len();
    let snapshot = validate(raw, env, &mut errors, &mut warnings);
    drop_echoes(&mut errors, read_errors);
    in_file_order(&mut errors, &source);
    in_file_order(&mut warnings, &source);
    Loaded {
        snapshot: match snapshot {
            Some(s) if errors.is_empty() => Ok(s),
            _ => Err(errors),
        },
        warnings,
    }
}

/// A key that could not be read is not checked again at its default: one error per key. The
/// first `read_errors` errors are the reading's; any after them about one of those keys (or a key
/// inside one) goes.
fn drop_echoes(errors: &mut Vec<ConfigError>, read_errors: usize) {
    let checked = errors.split_off(read_errors);
    let kept: Vec<ConfigError> = checked
        .into_iter()
        .filter(|e| !errors.iter().any(|u| is_under(&e.path, &u.path)))
        .collect();
    errors.extend(kept);
}

/// Give each problem its key's position and sort them in file order; those about keys that are
/// not in the file (a missing section) come last, in the order they were found.
fn in_file_order(problems: &mut [ConfigError], source: &Source) {
    for e in problems.iter_mut() {
        if e.position.is_none() {
            e.position = source.position(&e.path, Anchor::Value);
        }
    }
    problems.sort_by_key(|e| e.position.map_or((usize::MAX, 0), |p| (p.line, p.column)));
}

fn syntax_error(message: &str, position: Option<Position>) -> ConfigError {
    // toml's messages may run over lines ("invalid string\nexpected `\"`"); keep one line each.
    let message = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    ConfigError {
        path: String::new(),
        message: format!("invalid TOML: {message}"),
        position,
    }
}

/// Read each top-level section, each entry of `clusters` and `pricing` and each element of
/// `routes`, `keys` and `policies` on its own, so that one bad entry does not hide the errors of
/// the others. Unknown keys at every level are errors (`deny_unknown_fields`).
fn read_sections(
    table: toml_edit::Table,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> RawConfig {
    let mut raw = RawConfig::default();
    for (name, item) in table {
        let name = name.to_string();
        // A `[table]` as an inline table, an `[[array]]` as an array: one kind of value to read.
        let Ok(value) = item.into_value() else {
            continue;
        };
        let before = errors.len();
        let ok = match name.as_str() {
            "server" => read(value, "server", src, errors).map(|v| raw.server = v),
            "http" => read(value, "http", src, errors).map(|v| raw.http = v),
            "timeouts" => read(value, "timeouts", src, errors).map(|v| raw.timeouts = v),
            "upstream" => read(value, "upstream", src, errors).map(|v| raw.upstream = v),
            "limits" => read(value, "limits", src, errors).map(|v| raw.limits = v),
            "routing" => read(value, "routing", src, errors).map(|v| raw.routing = v),
            "sticky" => read(value, "sticky", src, errors).map(|v| raw.sticky = v),
            "admin" => read(value, "admin", src, errors).map(|v| raw.admin = Some(v)),
            "tls" => read(value, "tls", src, errors).map(|v| raw.tls = Some(v)),
            "access_log" => {
                read(value, "access_log", src, errors).map(|v| raw.access_log = Some(v))
            }
            "clusters" => read_map(value, "clusters", src, errors).map(|v| raw.clusters = v),
            "pricing" => read_map(value, "pricing", src, errors).map(|v| raw.pricing = v),
            "routes" => read_list(value, "routes", src, errors).map(|v| raw.routes = v),
            "keys" => read_list(value, "keys", src, errors).map(|v| raw.keys = v),
            "policies" => read_list(value, "policies", src, errors).map(|v| raw.policies = v),
            _ => {
                let path = key_segment(&name);
                let expected = SECTIONS.map(|s| format!("`{s}`")).join(", ");
                errors.push(ConfigError {
                    position: src.position(&path, Anchor::Key),
                    message: format!("unknown field `{name}`, expected one of {expected}"),
                    path,
                });
                Some(())
            }
        };
        let entries_ok = match name.as_str() {
            "clusters" => raw.clusters.values().all(Option::is_some),
            "pricing" => raw.pricing.values().all(Option::is_some),
            "routes" => raw.routes.iter().all(Option::is_some),
            "keys" => raw.keys.iter().all(Option::is_some),
            "policies" => raw.policies.iter().all(Option::is_some),
            _ => true,
        };
        if let Some(section) = SECTIONS.iter().find(|s| **s == name) {
            if ok.is_none() || !entries_ok {
                raw.failed.insert(*section);
            }
            if errors.len() > before {
                raw.dirty.insert(*section);
            }
        }
    }
    raw
}

/// Deserialize one value, reporting each failure with the full key path of the key at fault.
/// A key that cannot be read is reported and left out, and the rest read again (up to a bound),
/// so a section with a typo still has its other keys read and checked: a left-out key takes its
/// default. `None` when the value cannot be read even so (a required key missing or wrong).
/// (From toml_edit's value, not `toml::Value`: that one hands datetimes over as strings.)
fn read<T: serde::de::DeserializeOwned>(
    mut value: toml_edit::Value,
    path: &str,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<T> {
    use serde::de::IntoDeserializer as _;
    for _ in 0..64 {
        let e = match serde_path_to_error::deserialize::<_, T>(value.clone().into_deserializer()) {
            Ok(v) => return Some(v),
            Err(e) => e,
        };
        let at: Vec<Segment> = e
            .path()
            .iter()
            .filter_map(|segment| match segment {
                serde_path_to_error::Segment::Seq { index } => Some(Segment::Index(*index)),
                serde_path_to_error::Segment::Map { key }
                | serde_path_to_error::Segment::Enum { variant: key } => {
                    Some(Segment::Key(key.clone()))
                }
                serde_path_to_error::Segment::Unknown => None,
            })
            .collect();
        let mut full = path.to_string();
        for segment in &at {
            match segment {
                Segment::Index(i) => full.push_str(&format!("[{i}]")),
                Segment::Key(k) => {
                    full.push('.');
                    full.push_str(&key_segment(k));
                }
            }
        }
        let message = e.into_inner().message().to_string();
        // An unknown key is pointed at itself; anything else at its value.
        let anchor = if message.starts_with("unknown field") {
            Anchor::Key
        } else {
            Anchor::Value
        };
        let missing = message.starts_with("missing field");
        errors.push(ConfigError {
            position: src.position(&full, anchor),
            path: full,
            message,
        });
        if missing || !leave_out(&mut value, &at) {
            return None;
        }
    }
    None
}

/// Remove the deepest key named in `at` from `value` (for `backends[0].weight`, `weight`; for
/// `seeds[1]`, all of `seeds`, so no index after it shifts). False when there is none.
fn leave_out(value: &mut toml_edit::Value, at: &[Segment]) -> bool {
    let Some(last) = at.iter().rposition(|s| matches!(s, Segment::Key(_))) else {
        return false;
    };
    let mut node = value;
    for segment in &at[..last] {
        let next = match (segment, node) {
            (Segment::Key(k), toml_edit::Value::InlineTable(t)) => t.get_mut(k),
            (Segment::Index(i), toml_edit::Value::Array(a)) => a.get_mut(*i),
            _ => None,
        };
        let Some(next) = next else {
            return false;
        };
        node = next;
    }
    match (&at[last], node) {
        (Segment::Key(k), toml_edit::Value::InlineTable(t)) => t.remove(k).is_some(),
        _ => false,
    }
}

/// A table of entries, each read on its own (`None` where it failed).
fn read_map<T: serde::de::DeserializeOwned>(
    value: toml_edit::Value,
    path: &str,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<BTreeMap<String, Option<T>>> {
    let toml_edit::Value::InlineTable(entries) = value else {
        // Not a table: let serde say so, in its words.
        read::<BTreeMap<String, serde::de::IgnoredAny>>(value, path, src, errors);
        return None;
    };
    Some(
        entries
            .into_iter()
            .map(|(name, v)| {
                let entry = read(v, &format!("{path}.{}", key_segment(&name)), src, errors);
                (name.to_string(), entry)
            })
            .collect(),
    )
}

/// An array of entries, each read on its own (`None` where it failed), indexes kept.
fn read_list<T: serde::de::DeserializeOwned>(
    value: toml_edit::Value,
    path: &str,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<Vec<Option<T>>> {
    let toml_edit::Value::Array(elements) = value else {
        read::<Vec<serde::de::IgnoredAny>>(value, path, src, errors);
        return None;
    };
    Some(
        elements
            .into_iter()
            .enumerate()
            .map(|(i, v)| read(v, &format!("{path}[{i}]"), src, errors))
            .collect(),
    )
}

/// Check what was read and build the snapshot (`None` when something needed is missing; every
/// problem is in `errors`). Each section has its resolver, run in file order so that errors at
/// the same place keep the order they were found in.
fn validate(
    raw: RawConfig,
    env: &dyn Fn(&str) -> Option<String>,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<ConfigError>,
) -> Option<Snapshot> {
    let RawConfig {
        server,
        http,
        timeouts,
        upstream,
        clusters,
        routes,
        routing,
        sticky,
        admin,
        tls,
        access_log,
        pricing,
        keys,
        policies,
        limits,
        failed,
        dirty,
    } = raw;
    let mut err = |path: String, message: String| errors.push(ConfigError::new(path, message));
    let workers = worker_count(&server);
    let server = resolve_server(&server, workers, &mut err);
    let http = resolve_http(&http, &mut err);
    if let Some(s) = &server {
        if s.max_body_memory_per_worker < http.max_body_bytes {
            err(
                "server.max_body_memory_per_worker".into(),
                format!(
                    "must be at least http.max_body_bytes ({}): a body that size could never be \
                     held, and would be answered 503 forever",
                    http.max_body_bytes
                ),
            );
        }
    }
    let timeouts = resolve_timeouts(&timeouts, &mut err);
    let client_connections = server
        .as_ref()
        .map_or(RawServer::default().max_connections_per_worker, |s| {
            s.max_connections_per_worker
        });
    let upstream = resolve_upstream(&upstream, client_connections, &mut err);
    let clusters = resolve_clusters(&clusters, env, &mut err, warnings);
    // Keys before routes: a route may be a key's or an entity's own.
    let limits_read = !failed.contains("limits");
    // Route scopes are checked against the keys only when every key could be read.
    let keys_read =
        limits_read && keys.iter().all(Option::is_some) && policies.iter().all(Option::is_some);
    let limits = resolve_limits(keys, policies, &limits, limits_read, workers, env, &mut err);
    let mut routes = resolve_routes(
        &routes,
        &clusters.by_name,
        timeouts.upstream_first_byte,
        keys_read.then_some(&limits),
        &mut err,
    );
    let body_wants = sticky::body_wants(routes.iter_mut().filter_map(|r| r.sticky.as_mut()));
    let routing = routing::resolve_routing(&routing, &mut err);
    let sticky_keys = sticky::resolve_keys(&sticky, env, &mut err);
    if sticky_keys.keys.is_empty() {
        if let Some(i) = routes
            .iter()
            .position(|r| r.sticky.as_ref().is_some_and(|s| s.cookie.is_some()))
        {
            err(
                "sticky.keys".into(),
                format!(
                    "a route (`{}`) sets an affinity cookie: at least one key is needed to seal it",
                    routes[i].pattern.source()
                ),
            );
        }
    }
    // A server.listen left out for an error is not the one the file meant.
    let server_listen = server
        .as_ref()
        .filter(|_| !dirty.contains("server"))
        .map(|s| s.listen);
    let admin_listen = admin
        .as_ref()
        .and_then(|a| resolve_admin(a, server_listen, &mut err));
    let admin_token_digest = admin
        .as_ref()
        .and_then(|a| resolve_admin_token(a, env, &mut err));
    let tls = tls.as_ref().and_then(|t| tls::resolve_tls(t, &mut err));
    if let (Some(t), Some(server)) = (&tls, server_listen) {
        if listeners_clash(t.listen, server) {
            err(
                "tls.listen".into(),
                format!("`{}` takes the port of server.listen `{server}`", t.listen),
            );
        }
    }
    if let (Some(t), Some(admin)) = (&tls, admin_listen) {
        if listeners_clash(t.listen, admin) {
            err(
                "tls.listen".into(),
                format!("`{}` takes the port of admin.listen `{admin}`", t.listen),
            );
        }
    }
    let access_log = access_log.as_ref().map(|l| resolve_access_log(l, &mut err));
    let prices = resolve_pricing(&pricing, &mut err);

    if routing.share_breakers && limits_read && limits.sync.redis.is_none() {
        err(
            "routing.share_breakers".into(),
            "breakers are shared through the limits Redis: set [limits] backend = \"redis\"".into(),
        );
    }

    if !errors.is_empty() || !failed.is_empty() {
        return None;
    }
    Some(Snapshot {
        server: server?,
        http,
        timeouts,
        upstream,
        clusters: clusters.clusters,
        routes,
        routing,
        sticky_keys,
        body_wants,
        backend_count: clusters.backend_count,
        admin_listen,
        admin_token_digest,
        tls,
        access_log,
        prices,
        limits: Arc::new(limits),
    })
}

impl Snapshot {
    /// Whether anything outside a request reads its usage: the metrics the admin listener
    /// exports, or the access log. (A budget that settles on tokens is the request's own
    /// matter: [`crate::gateway::admit::Admission::spends_tokens`].)
    pub(crate) fn usage_observed(&self) -> bool {
        self.admin_listen.is_some() || self.access_log.is_some()
    }

    /// For a reload: keep `running`'s values of the settings a running process cannot change
    /// (the listeners, the worker threads, the admin token, the limits sync backend and its
    /// cadence), so every worker sees one coherent config; returns the keys whose new values
    /// wait for a restart. Everything else — keys, policies, plans, routes, clusters, prices,
    /// timeouts, limits, the access log — is the new file's.
    pub(crate) fn keep_restart_only(&mut self, running: &Snapshot) -> Vec<&'static str> {
        let mut kept = Vec::new();
        let server = &running.server;
        if self.server.listen != server.listen {
            kept.push("server.listen");
        }
        if self.server.workers != server.workers {
            kept.push("server.workers");
        }
        if self.server.pin_workers != server.pin_workers {
            kept.push("server.pin_workers");
        }
        if self.server.takeover_socket != server.takeover_socket {
            kept.push("server.takeover_socket");
        }
        self.server.listen = server.listen;
        self.server.workers = server.workers;
        self.server.pin_workers = server.pin_workers;
        self.server.takeover_socket = server.takeover_socket.clone();
        if self.admin_listen != running.admin_listen {
            kept.push("admin.listen");
        }
        if self.admin_token_digest != running.admin_token_digest {
            kept.push("admin.token_env");
        }
        self.admin_listen = running.admin_listen;
        self.admin_token_digest = running.admin_token_digest;
        // The listener's address (or whether there is one) is fixed; its certificates reload.
        match (&mut self.tls, &running.tls) {
            (Some(new), Some(old)) if new.listen != old.listen => {
                kept.push("tls.listen");
                new.listen = old.listen;
            }
            (Some(_), None) | (None, Some(_)) => {
                kept.push("tls");
                self.tls = running.tls.clone();
            }
            _ => {}
        }
        let (new, old) = (&self.limits.sync, &running.limits.sync);
        let sync_changed = new.redis != old.redis
            || new.interval != old.interval
            || new.timeout != old.timeout
            || new.nodes != old.nodes;
        if sync_changed {
            kept.push(
                "limits.redis / limits.sync_interval_ms / limits.sync_timeout_ms / limits.nodes",
            );
            let limits = Arc::make_mut(&mut self.limits);
            limits.sync.redis = old.redis.clone();
            limits.sync.interval = old.interval;
            limits.sync.timeout = old.timeout;
            limits.sync.nodes = old.nodes;
        }
        if self.limits.sync.workers != old.workers {
            Arc::make_mut(&mut self.limits).sync.workers = old.workers;
        }
        kept
    }
}

/// `server.workers`, with 0 meaning one per core.
fn worker_count(raw: &RawServer) -> usize {
    match raw.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// The longest `server.shutdown_grace_ms`: a stop that waits longer than an hour is a stuck
/// stop (a second SIGTERM ends it at once anyway).
const MAX_SHUTDOWN_GRACE_MS: u64 = 3_600_000;

/// `[server]`; `None` when `listen` is not an address.
fn resolve_server(
    raw: &RawServer,
    workers: usize,
    err: &mut dyn FnMut(String, String),
) -> Option<ServerConfig> {
    let listen = match raw.listen.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(addr)) => Some(addr),
        _ => {
            err(
                "server.listen".into(),
                format!("`{}` is not an address like 127.0.0.1:8080", raw.listen),
            );
            None
        }
    };
    if raw.workers > 1024 {
        err("server.workers".into(), "must be at most 1024".into());
    }
    let max_requests_per_worker = raw
        .max_requests_per_worker
        .unwrap_or(raw.max_connections_per_worker);
    for (key, v) in [
        (
            "server.max_connections_per_worker",
            raw.max_connections_per_worker,
        ),
        ("server.max_requests_per_worker", max_requests_per_worker),
    ] {
        if v == 0 {
            err(key.into(), "must be at least 1".into());
        }
    }
    if raw.max_body_memory_per_worker < 64 * 1024 {
        err(
            "server.max_body_memory_per_worker".into(),
            "must be at least 65536 (bytes)".into(),
        );
    }
    if raw.shutdown_grace_ms > MAX_SHUTDOWN_GRACE_MS {
        err(
            "server.shutdown_grace_ms".into(),
            format!("must be at most {MAX_SHUTDOWN_GRACE_MS} (one hour)"),
        );
    }
    Some(ServerConfig {
        listen: listen?,
        workers,
        pin_workers: raw.pin_workers,
        max_connections_per_worker: raw.max_connections_per_worker,
        max_requests_per_worker,
        max_body_memory_per_worker: raw.max_body_memory_per_worker,
        shutdown_grace: Duration::from_millis(raw.shutdown_grace_ms),
        takeover_socket: raw.takeover_socket.clone(),
    })
}

fn resolve_http(raw: &RawHttp, err: &mut dyn FnMut(String, String)) -> HttpLimits {
    for (key, v, min) in [
        (
            "http.max_request_line_bytes",
            raw.max_request_line_bytes,
            64,
        ),
        ("http.max_header_bytes", raw.max_header_bytes, 256),
        ("http.max_headers", raw.max_headers, 8),
        ("http.max_body_bytes", raw.max_body_bytes, 1),
    ] {
        if v < min {
            err(key.into(), format!("must be at least {min}"));
        }
    }
    if raw.max_request_line_bytes > raw.max_header_bytes {
        err(
            "http.max_request_line_bytes".into(),
            "must not exceed http.max_header_bytes".into(),
        );
    }
    HttpLimits {
        max_request_line_bytes: raw.max_request_line_bytes,
        max_header_bytes: raw.max_header_bytes,
        max_headers: raw.max_headers,
        max_body_bytes: raw.max_body_bytes,
    }
}

fn resolve_timeouts(raw: &RawTimeouts, err: &mut dyn FnMut(String, String)) -> Timeouts {
    for (key, v) in [
        ("timeouts.header_read_ms", raw.header_read_ms),
        ("timeouts.body_read_ms", raw.body_read_ms),
        ("timeouts.body_total_ms", raw.body_total_ms),
        ("timeouts.keepalive_idle_ms", raw.keepalive_idle_ms),
        ("timeouts.upstream_connect_ms", raw.upstream_connect_ms),
        (
            "timeouts.upstream_first_byte_ms",
            raw.upstream_first_byte_ms,
        ),
        ("timeouts.stream_idle_ms", raw.stream_idle_ms),
    ] {
        if v == 0 {
            err(key.into(), "must be at least 1 ms".into());
        }
    }
    Timeouts {
        header_read: Duration::from_millis(raw.header_read_ms),
        body_read: Duration::from_millis(raw.body_read_ms),
        body_total: Duration::from_millis(raw.body_total_ms),
        keepalive_idle: Duration::from_millis(raw.keepalive_idle_ms),
        upstream_connect: Duration::from_millis(raw.upstream_connect_ms),
        upstream_first_byte: Duration::from_millis(raw.upstream_first_byte_ms),
        stream_idle: Duration::from_millis(raw.stream_idle_ms),
    }
}

/// `[upstream]`; `client_connections` is `server.max_connections_per_worker`, the default cap.
fn resolve_upstream(
    raw: &RawUpstream,
    client_connections: usize,
    err: &mut dyn FnMut(String, String),
) -> UpstreamLimits {
    if raw.idle_timeout_ms == 0 {
        err(
            "upstream.idle_timeout_ms".into(),
            "must be at least 1 ms".into(),
        );
    }
    if raw.max_connections_per_backend == Some(0) {
        err(
            "upstream.max_connections_per_backend".into(),
            "must be at least 1".into(),
        );
    }
    if raw.pool_wait_ms > 60_000 {
        err(
            "upstream.pool_wait_ms".into(),
            "at most 60000 ms: a request waiting longer for a connection should be told".into(),
        );
    }
    UpstreamLimits {
        max_idle_per_backend: raw.max_idle_per_backend,
        max_connections_per_backend: raw
            .max_connections_per_backend
            .unwrap_or(client_connections),
        pool_wait: Duration::from_millis(raw.pool_wait_ms),
        idle_timeout: Duration::from_millis(raw.idle_timeout_ms),
        request_stream_usage: raw.request_stream_usage,
    }
}

/// The clusters, each backend numbered across all of them (a [`BackendId`]).
struct ClusterTable {
    /// Indexed by [`ClusterId`].
    clusters: Vec<Cluster>,
    /// Every cluster named in the file; `None` for one that could not be read (it exists, and
    /// its own error says what is wrong with it).
    by_name: BTreeMap<String, Option<ClusterId>>,
    backend_count: usize,
}

fn resolve_clusters(
    raw: &BTreeMap<String, Option<RawCluster>>,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
    warnings: &mut Vec<ConfigError>,
) -> ClusterTable {
    if raw.is_empty() {
        err("clusters".into(), "at least one cluster is required".into());
    }
    let mut table = ClusterTable {
        clusters: Vec::new(),
        by_name: BTreeMap::new(),
        backend_count: 0,
    };
    for (name, rc) in raw {
        // One that could not be read has its error reported.
        let id = rc.as_ref().map(|rc| {
            let cluster = resolve_cluster(name, rc, table.backend_count, env, err, warnings);
            table.backend_count += cluster.backends.len();
            table.clusters.push(cluster);
            table.clusters.len() - 1
        });
        table.by_name.insert(name.clone(), id);
    }
    table
}

/// One cluster; its backends are numbered from `first_backend`.
fn resolve_cluster(
    name: &str,
    rc: &RawCluster,
    first_backend: BackendId,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
    warnings: &mut Vec<ConfigError>,
) -> Cluster {
    let path = format!("clusters.{}", key_segment(name));
    if rc.backends.is_empty() {
        err(
            format!("{path}.backends"),
            "at least one backend is required".into(),
        );
    }
    let mut backends: Vec<Backend> = Vec::new();
    for (i, rb) in rc.backends.iter().enumerate() {
        let id = first_backend + backends.len();
        let path = format!("{path}.backends[{i}]");
        backends.extend(resolve_backend(rb, id, &path, err));
    }
    for (from, to) in &rc.model_map {
        if to.is_empty() {
            err(
                format!("{path}.model_map.{}", key_segment(from)),
                "mapped model must not be empty".into(),
            );
        }
    }
    if rc.credential.is_some() && !rc.credentials.is_empty() {
        err(
            format!("{path}.credentials"),
            "a cluster has either `credential` or a `credentials` pool, not both".into(),
        );
    }
    let credentials: Vec<Credential> = match &rc.credential {
        Some(c) => resolve_credential(c, name, &format!("{path}.credential"), env, err, warnings)
            .into_iter()
            .collect(),
        None => rc
            .credentials
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let path = format!("{path}.credentials[{i}]");
                resolve_credential(c, name, &path, env, err, warnings)
            })
            .collect(),
    };
    let provider_limits = rc.provider_limits.as_ref().and_then(|p| {
        let path = format!("{path}.provider_limits");
        limits::resolve_provider_limits(p, name.to_string(), &path, err)
    });
    let any_tls = backends.iter().any(|b| b.tls);
    let tls = if any_tls || rc.ca_file.is_some() {
        build_tls(rc.ca_file.as_deref())
            .map_err(|msg| err(format!("{path}.ca_file"), msg))
            .ok()
    } else {
        None
    };
    Cluster {
        name: name.to_string(),
        backends,
        model_map: rc.model_map.clone(),
        credentials,
        tls,
        queue_metrics: rc.queue_metrics,
        probe: rc
            .probe
            .as_ref()
            .map(|p| routing::resolve_probe(p, any_tls, &format!("{path}.probe"), err)),
        provider_limits,
        dialect: dialect::resolve_dialect(rc.dialect, rc.anthropic.as_ref(), &path, err),
    }
}

/// One backend, its host resolved here, once (workers never make a blocking DNS call); `None`
/// when its URL is not one. A host that does not resolve is reported, and the backend kept
/// without addresses.
fn resolve_backend(
    rb: &RawBackend,
    id: BackendId,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Option<Backend> {
    if rb.weight == 0 {
        err(format!("{path}.weight"), "must be at least 1".into());
    }
    let url = parse_base_url(&rb.base_url)
        .map_err(|msg| err(format!("{path}.base_url"), msg))
        .ok()?;
    let addrs: Vec<SocketAddr> = match (url.host.as_str(), url.port).to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => {
            err(
                format!("{path}.base_url"),
                format!("cannot resolve `{}`: {e}", url.host),
            );
            Vec::new()
        }
    };
    let default_port = if url.tls { 443 } else { 80 };
    let host_header = if url.port == default_port {
        url.host_for_header.clone()
    } else {
        format!("{}:{}", url.host_for_header, url.port)
    };
    Some(Backend {
        id,
        weight: rb.weight,
        addrs,
        tls: url.tls,
        host_header,
        server_name: url.host,
        base_path: url.path,
    })
}

/// A cluster's upstream credential, its secret read from the environment; `None` when it is not
/// set. A header no API knows draws a warning unless `allow_custom_header` says it is meant.
fn resolve_credential(
    c: &RawCredential,
    cluster: &str,
    path: &str,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
    warnings: &mut Vec<ConfigError>,
) -> Option<Credential> {
    if c.weight == 0 {
        err(format!("{path}.weight"), "must be at least 1".into());
    }
    let header = c.header.to_ascii_lowercase();
    let valid_name = !header.is_empty()
        && header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !valid_name {
        err(
            format!("{path}.header"),
            format!("`{}` is not a valid header name", c.header),
        );
    } else if !c.allow_custom_header && !KNOWN_CREDENTIAL_HEADERS.contains(&header.as_str()) {
        warnings.push(ConfigError::new(
            format!("{path}.header"),
            format!(
                "`{}` is not a known credential header ({}); the secret will be sent under it \
                 — set credential.allow_custom_header = true if that is intended",
                c.header,
                KNOWN_CREDENTIAL_HEADERS.join(", ")
            ),
        ));
    }
    let Some(value) = env(&c.env).filter(|v| !v.is_empty()) else {
        err(
            format!("{path}.env"),
            format!("environment variable `{}` is not set or empty", c.env),
        );
        return None;
    };
    if value.bytes().any(|b| b < 0x20 || b == 0x7f) {
        err(
            format!("{path}.env"),
            format!("environment variable `{}` holds control characters", c.env),
        );
    }
    let value = if header == "authorization" {
        format!("Bearer {value}")
    } else {
        value
    };
    let provider_limits = c.provider_limits.as_ref().and_then(|p| {
        let path = format!("{path}.provider_limits");
        limits::resolve_provider_limits(p, format!("{cluster}/{}", c.env), &path, err)
    });
    Some(Credential {
        header_line: format!("{header}: {value}\r\n").into_bytes(),
        header_name: header,
        label: c.env.clone(),
        weight: c.weight.max(1),
        provider_limits,
    })
}

/// The routes, most specific first: exact names, then globs by literal length (file order among
/// equals).
fn resolve_routes(
    raw: &[Option<RawRoute>],
    clusters: &BTreeMap<String, Option<ClusterId>>,
    first_byte_default: Duration,
    limits: Option<&limits::LimitsConfig>,
    err: &mut dyn FnMut(String, String),
) -> Vec<Route> {
    if raw.is_empty() {
        err("routes".into(), "at least one route is required".into());
    }
    let mut routes = Vec::new();
    // (model, whose) → the route that has it: a key (or entity) with two routes for one model
    // name would have its choice made by file order.
    let mut seen = BTreeMap::new();
    for (i, rr) in raw.iter().enumerate() {
        let Some(rr) = rr else {
            continue; // Not readable: its error is reported.
        };
        let path = format!("routes[{i}]");
        if rr.model.is_empty() {
            err(format!("{path}.model"), "must not be empty".into());
        }
        let whose: Vec<String> = match (rr.keys.is_empty(), rr.entities.is_empty()) {
            (true, true) => vec![String::new()],
            (false, true) => rr.keys.iter().map(|k| format!("key `{k}`")).collect(),
            (true, false) => rr
                .entities
                .iter()
                .map(|e| format!("entity `{e}`"))
                .collect(),
            (false, false) => {
                err(
                    format!("{path}.entities"),
                    "a route is for `keys` or for `entities`, not both (give each its own route)"
                        .into(),
                );
                Vec::new()
            }
        };
        for who in whose {
            if let Some(prev) = seen.insert((rr.model.clone(), who.clone()), i) {
                let whom = if who.is_empty() {
                    String::new()
                } else {
                    format!(" for {who}")
                };
                err(
                    format!("{path}.model"),
                    format!("`{}` is already routed{whom} by routes[{prev}]", rr.model),
                );
            }
        }
        let scope = resolve_scope(rr, limits, &path, err);
        routes.extend(
            resolve_route(rr, clusters, first_byte_default, &path, err).map(|mut route| {
                route.scope = scope;
                route
            }),
        );
    }
    routes.sort_by_key(|r| match &r.pattern {
        ModelPattern::Exact(_) => (r.scope.rank(), 0, 0),
        ModelPattern::Glob { .. } => (r.scope.rank(), 1, usize::MAX - r.pattern.literal_len()),
    });
    routes
}

/// A route's `keys` / `entities`, by index; each must name one that exists (`limits` is `None`
/// when the keys could not be read: their errors are reported, and these are not checked).
fn resolve_scope(
    rr: &RawRoute,
    limits: Option<&limits::LimitsConfig>,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> RouteScope {
    let Some(limits) = limits else {
        return RouteScope::Global;
    };
    if !rr.keys.is_empty() {
        let mut keys = Vec::new();
        for (j, id) in rr.keys.iter().enumerate() {
            match limits.keys.iter().position(|k| &k.id == id) {
                Some(index) => keys.push(index),
                None => err(format!("{path}.keys[{j}]"), format!("no key has id `{id}`")),
            }
        }
        return RouteScope::Keys(keys);
    }
    if !rr.entities.is_empty() {
        let mut entities = Vec::new();
        for (j, name) in rr.entities.iter().enumerate() {
            match limits.entities.iter().position(|e| e == name) {
                Some(index) => entities.push(index),
                None => err(
                    format!("{path}.entities[{j}]"),
                    format!("no key has entity `{name}`"),
                ),
            }
        }
        return RouteScope::Entities(entities);
    }
    RouteScope::Global
}

/// One route, its model name already checked; `None` when its cluster is not one that could be
/// read.
fn resolve_route(
    rr: &RawRoute,
    clusters: &BTreeMap<String, Option<ClusterId>>,
    first_byte_default: Duration,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Option<Route> {
    let pattern = ModelPattern::parse(&rr.model);
    if !rr.models.is_empty() && matches!(pattern, ModelPattern::Exact(_)) {
        err(
            format!("{path}.models"),
            "only a glob route (a `model` with `*`) declares models; an exact route is listed \
             by its name"
                .into(),
        );
    }
    for (j, m) in rr.models.iter().enumerate() {
        if !pattern.matches(m) {
            err(
                format!("{path}.models[{j}]"),
                format!("`{m}` does not match the route's pattern `{}`", rr.model),
            );
        }
    }
    let shorthand;
    let raw_groups: &[RawGroup] = match (&rr.cluster, rr.groups.is_empty()) {
        (Some(cluster), true) => {
            shorthand = [RawGroup {
                targets: vec![RawTarget {
                    cluster: cluster.clone(),
                    model: None,
                    weight: 1,
                    context_window: None,
                    max_in_flight: None,
                }],
                strategy: routing::Strategy::default(),
                when: None,
                first_byte_timeout_ms: None,
            }];
            &shorthand
        }
        (None, false) => &rr.groups,
        (Some(_), false) => {
            err(
                format!("{path}.groups"),
                "a route has either `cluster` or `groups`, not both".into(),
            );
            return None;
        }
        (None, true) => {
            err(
                path.to_string(),
                "a route needs `cluster` (one cluster) or `groups` (target groups in fallback \
                 order)"
                    .into(),
            );
            return None;
        }
    };
    let mut groups = Vec::new();
    let mut complete = true;
    for (g, raw_group) in raw_groups.iter().enumerate() {
        let group_path = format!("{path}.groups[{g}]");
        if raw_group.targets.is_empty() {
            err(
                format!("{group_path}.targets"),
                "at least one target is required".into(),
            );
        }
        let when = raw_group.when.as_ref().map(|labels| {
            if g == 0 {
                err(
                    format!("{group_path}.when"),
                    "the first group is where every request starts: only a later group has a \
                     condition"
                        .into(),
                );
            }
            routing::FallbackOn::parse(labels, &format!("{group_path}.when"), err)
        });
        if raw_group.first_byte_timeout_ms == Some(0) {
            err(
                format!("{group_path}.first_byte_timeout_ms"),
                "must be at least 1 ms".into(),
            );
        }
        let first_byte_timeout = raw_group
            .first_byte_timeout_ms
            .map_or(first_byte_default, |ms| Duration::from_millis(ms.max(1)));
        let mut targets = Vec::new();
        for (t, rt) in raw_group.targets.iter().enumerate() {
            // The shorthand's errors are the route's own key.
            let target_path = if rr.cluster.is_some() {
                path.to_string()
            } else {
                format!("{group_path}.targets[{t}]")
            };
            if rt.weight == 0 {
                err(format!("{target_path}.weight"), "must be at least 1".into());
            }
            if rt.model.as_deref() == Some("") {
                err(format!("{target_path}.model"), "must not be empty".into());
            }
            if rt.context_window == Some(0) {
                err(
                    format!("{target_path}.context_window"),
                    "must be at least 1".into(),
                );
            }
            if rt.max_in_flight == Some(0) {
                err(
                    format!("{target_path}.max_in_flight"),
                    "must be at least 1".into(),
                );
            }
            match clusters.get(&rt.cluster) {
                Some(Some(id)) => targets.push(RouteTarget {
                    cluster: *id,
                    model: rt.model.clone(),
                    weight: rt.weight.max(1),
                    context_window: rt.context_window,
                    max_in_flight: rt.max_in_flight,
                }),
                // Not readable: its error is reported.
                Some(None) => complete = false,
                None => {
                    err(
                        format!("{target_path}.cluster"),
                        format!("no cluster named `{}`", rt.cluster),
                    );
                    complete = false;
                }
            }
        }
        groups.push(TargetGroup {
            targets,
            strategy: raw_group.strategy,
            when,
            first_byte_timeout,
        });
    }
    if !complete {
        return None;
    }
    let sticky = rr
        .sticky
        .as_ref()
        .map(|raw| sticky::resolve_rule(raw, path, err));
    Some(Route {
        pattern,
        groups,
        sticky,
        models: rr.models.clone(),
        scope: RouteScope::Global,
    })
}

/// `[admin]`'s address; `None` when it is not one. `server_listen` is server.listen where it is
/// the one the file meant, which the admin listener must not share a port with.
fn resolve_admin(
    raw: &RawAdmin,
    server_listen: Option<SocketAddr>,
    err: &mut dyn FnMut(String, String),
) -> Option<SocketAddr> {
    let Ok(Some(listen)) = raw.listen.to_socket_addrs().map(|mut i| i.next()) else {
        err(
            "admin.listen".into(),
            format!("`{}` is not an address like 127.0.0.1:9090", raw.listen),
        );
        return None;
    };
    if let Some(server) = server_listen.filter(|s| listeners_clash(*s, listen)) {
        err(
            "admin.listen".into(),
            format!(
                "`{listen}` takes the port of server.listen `{server}`; the admin listener needs \
                 a port of its own"
            ),
        );
    }
    Some(listen)
}

/// The digest of the admin bearer token, read from the variable `admin.token_env` names: a
/// variable that is unset, empty or shorter than 16 characters is an error (a guessable token
/// would let anyone who reaches the port change the config).
fn resolve_admin_token(
    raw: &RawAdmin,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> Option<[u8; 32]> {
    let var = raw.token_env.as_deref()?;
    match env(var) {
        Some(token) if token.trim().len() >= 16 => Some(limits::digest(token.trim().as_bytes())),
        Some(_) => {
            err(
                "admin.token_env".into(),
                format!("`{var}` holds fewer than 16 characters; use a long random token"),
            );
            None
        }
        None => {
            err(
                "admin.token_env".into(),
                format!("the environment variable `{var}` is not set"),
            );
            None
        }
    }
}

fn resolve_access_log(
    raw: &RawAccessLog,
    err: &mut dyn FnMut(String, String),
) -> AccessLogSettings {
    if raw.max_file_bytes < 4096 {
        err(
            "access_log.max_file_bytes".into(),
            "must be at least 4096".into(),
        );
    }
    if raw.max_file_age_secs == 0 {
        err(
            "access_log.max_file_age_secs".into(),
            "must be at least 1".into(),
        );
    }
    if raw.batch_bytes == 0 || raw.queue_batches == 0 || raw.flush_interval_ms == 0 {
        err(
            "access_log".into(),
            "batch_bytes, queue_batches and flush_interval_ms must be at least 1".into(),
        );
    }
    AccessLogSettings {
        dir: raw.dir.clone(),
        max_file_bytes: raw.max_file_bytes,
        max_file_age: Duration::from_secs(raw.max_file_age_secs),
        batch_bytes: raw.batch_bytes,
        queue_batches: raw.queue_batches,
        flush_interval: Duration::from_millis(raw.flush_interval_ms),
    }
}

/// `[pricing]`, by model name; a price that could not be read is left out.
fn resolve_pricing(
    raw: &BTreeMap<String, Option<RawPrice>>,
    err: &mut dyn FnMut(String, String),
) -> BTreeMap<String, Price> {
    let mut prices = BTreeMap::new();
    for (model, p) in raw {
        let Some(p) = p else {
            continue;
        };
        let cached_input = p.cached_input.unwrap_or(p.input);
        let cache_write_input = p.cache_write_input.unwrap_or(p.input);
        if [p.input, p.output, cached_input, cache_write_input]
            .iter()
            .any(|v| !v.is_finite() || *v < 0.0)
        {
            err(
                format!("pricing.{}", key_segment(model)),
                "prices must be finite and non-negative".into(),
            );
        }
        let price = Price {
            input: p.input,
            output: p.output,
            cached_input,
            cache_write_input,
        };
        prices.insert(model.clone(), price);
    }
    prices
}

/// `[[keys]]`, `[[policies]]` and `[limits]` (see [`limits::resolve`]). Keys and policies refer
/// to each other by id and are reported by index: when one could not be read, checking the rest
/// would report echoes of its error, so that waits for a fix (as does all of it when `[limits]`
/// could not be read).
fn resolve_limits(
    keys: Vec<Option<limits::RawKey>>,
    policies: Vec<Option<limits::RawPolicy>>,
    raw: &limits::RawLimits,
    limits_read: bool,
    workers: usize,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> limits::LimitsConfig {
    let keys = keys.into_iter().collect::<Option<Vec<_>>>();
    let policies = policies.into_iter().collect::<Option<Vec<_>>>();
    match (keys, policies) {
        (Some(keys), Some(policies)) if limits_read => {
            limits::resolve(&keys, &policies, raw, workers, env, err)
        }
        _ => limits::LimitsConfig::default(),
    }
}

// ---------------------------------------------------------------------------------------------
// Key paths and where they are in the file
// ---------------------------------------------------------------------------------------------

/// A key as one segment of a dotted path: bare when TOML allows it bare, else quoted.
fn key_segment(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if bare {
        key.to_string()
    } else {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Split a path as [`key_segment`] and the validators write it: `a.b[0]."c.d"`.
fn parse_path(path: &str) -> Vec<Segment> {
    let mut segments = Vec::new();
    let mut chars = path.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '.' => {}
            '[' => {
                let digits: String = chars.by_ref().take_while(|c| *c != ']').collect();
                match digits.parse() {
                    Ok(i) => segments.push(Segment::Index(i)),
                    Err(_) => break,
                }
            }
            '"' => {
                let mut key = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => key.extend(chars.next()),
                        c => key.push(c),
                    }
                }
                segments.push(Segment::Key(key));
            }
            c => {
                let mut key = String::from(c);
                while let Some(&c) = chars.peek() {
                    if c == '.' || c == '[' {
                        break;
                    }
                    key.push(c);
                    chars.next();
                }
                segments.push(Segment::Key(key));
            }
        }
    }
    segments
}

/// `path` is `parent` or a key inside it.
fn is_under(path: &str, parent: &str) -> bool {
    path.strip_prefix(parent)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// What an error points at: the key itself (an unknown key) or its value (a wrong value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Anchor {
    Key,
    Value,
}

/// The file's text and its parsed document, which keeps every key's and value's span.
struct Source<'a> {
    text: &'a str,
    doc: toml_edit::ImDocument<&'a str>,
}

/// A step of a walk through the document: tables, arrays of tables, inline tables and arrays.
#[derive(Clone, Copy)]
enum Node<'a> {
    Item(&'a toml_edit::Item),
    Table(&'a toml_edit::Table),
    Value(&'a toml_edit::Value),
}

impl<'a> Node<'a> {
    fn child(self, key: &str) -> Option<(&'a toml_edit::Key, Node<'a>)> {
        let table: &dyn toml_edit::TableLike = match self {
            Node::Item(item) => item.as_table_like()?,
            Node::Table(table) => table,
            Node::Value(value) => value.as_inline_table()?,
        };
        let (key, item) = table.get_key_value(key)?;
        Some((key, Node::Item(item)))
    }

    fn element(self, index: usize) -> Option<Node<'a>> {
        match self {
            Node::Item(toml_edit::Item::ArrayOfTables(tables)) => {
                tables.get(index).map(Node::Table)
            }
            Node::Item(toml_edit::Item::Value(value)) | Node::Value(value) => {
                value.as_array()?.get(index).map(Node::Value)
            }
            _ => None,
        }
    }

    /// A value written after `=` (or in an array); `None` for a `[table]` or `[[array]]`.
    fn value_span(self) -> Option<std::ops::Range<usize>> {
        match self {
            Node::Item(toml_edit::Item::Value(value)) | Node::Value(value) => value.span(),
            _ => None,
        }
    }

    fn span(self) -> Option<std::ops::Range<usize>> {
        match self {
            Node::Item(item) => item.span(),
            Node::Table(table) => table.span(),
            Node::Value(value) => value.span(),
        }
    }
}

impl Source<'_> {
    /// Where `path` is in the file: its value, or its key for [`Anchor::Key`]; for a path that
    /// is not all there (a missing key), the deepest part of it that is.
    fn position(&self, path: &str, anchor: Anchor) -> Option<Position> {
        let mut node = Node::Item(self.doc.as_item());
        let mut key_span = None;
        let mut whole = true;
        let mut found = false;
        for segment in parse_path(path) {
            let next = match &segment {
                Segment::Key(k) => node.child(k).map(|(key, child)| {
                    key_span = key.span();
                    child
                }),
                Segment::Index(i) => node.element(*i).inspect(|_| key_span = None),
            };
            match next {
                Some(next) => {
                    node = next;
                    found = true;
                }
                None => {
                    whole = false;
                    break;
                }
            }
        }
        if !found {
            return None; // Not in the file at all (a section left out).
        }
        let value_span = if whole && anchor == Anchor::Value {
            node.value_span()
        } else {
            None
        };
        let span = value_span.or(key_span).or_else(|| node.span())?;
        Some(position_at(self.text, span.start))
    }
}

/// The line and column of a byte offset in `text`.
fn position_at(text: &str, offset: usize) -> Position {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Position {
        line: before.matches('\n').count() + 1,
        column: before[line_start..].chars().count() + 1,
    }
}

/// Whether binding both addresses would fail (or, with SO_REUSEPORT, share one port): the same
/// port on the same address, or on a wildcard address that covers the other one — `0.0.0.0`
/// covers every IPv4 address and `[::]` (dual-stack, Linux's default) every address. Port 0 asks
/// for a free port, so it never clashes.
fn listeners_clash(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() || a.port() == 0 {
        return false;
    }
    let (a, b) = (a.ip().to_canonical(), b.ip().to_canonical());
    let v6_wildcard = |ip: std::net::IpAddr| ip.is_ipv6() && ip.is_unspecified();
    let v4_wildcard = |ip: std::net::IpAddr| ip.is_ipv4() && ip.is_unspecified();
    a == b
        || v6_wildcard(a)
        || v6_wildcard(b)
        || (v4_wildcard(a) && b.is_ipv4())
        || (v4_wildcard(b) && a.is_ipv4())
}

struct BaseUrl {
    tls: bool,
    host: String,
    host_for_header: String,
    port: u16,
    path: String,
}

fn parse_base_url(url: &str) -> Result<BaseUrl, String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(format!("`{url}` must start with http:// or https://"));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(format!("`{url}` has no valid host"));
    }
    if path.contains(['?', '#', ' ']) {
        return Err(format!("`{url}` must not carry a query, fragment or space"));
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, host_for_header, port) = if let Some(v6) = authority.strip_prefix('[') {
        let Some(end) = v6.find(']') else {
            return Err(format!("`{url}` has an unterminated IPv6 address"));
        };
        let host = &v6[..end];
        let port = match &v6[end + 1..] {
            "" => default_port,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("`{url}` has an invalid port"))?,
        };
        (host.to_string(), format!("[{host}]"), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => {
                let port = p
                    .parse()
                    .map_err(|_| format!("`{url}` has an invalid port"))?;
                (h.to_string(), h.to_string(), port)
            }
            None => (authority.to_string(), authority.to_string(), default_port),
        }
    };
    Ok(BaseUrl {
        tls,
        host,
        host_for_header,
        port,
        path: path.trim_end_matches('/').to_string(),
    })
}

fn build_tls(ca_file: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;

    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A system root rustls cannot parse is skipped, as browsers do.
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        let mut added = 0;
        for cert in certs {
            let cert = cert.map_err(|e| format!("bad PEM in `{}`: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("bad certificate in `{}`: {e}", path.display()))?;
            added += 1;
        }
        if added == 0 {
            return Err(format!("no certificate found in `{}`", path.display()));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn globs_match() {
        let p = ModelPattern::parse("gpt-4*");
        assert!(p.matches("gpt-4o"));
        assert!(p.matches("gpt-4"));
        assert!(!p.matches("gpt-3.5"));
        let p = ModelPattern::parse("*-mini");
        assert!(p.matches("gpt-4o-mini"));
        assert!(!p.matches("gpt-4o-mini-2"));
        let p = ModelPattern::parse("a*b*c");
        assert!(p.matches("abc"));
        assert!(p.matches("aXbYc"));
        assert!(!p.matches("aXbY"));
        assert!(!p.matches("ac"));
        let p = ModelPattern::parse("*");
        assert!(p.matches("anything"));
        let p = ModelPattern::parse("ab*ab");
        assert!(!p.matches("ab"));
        assert!(p.matches("abab"));
    }

    #[test]
    fn collects_all_errors_with_paths() {
        let text = r#"
            [server]
            listen = "nope"
            [clusters.a]
            backends = [{ base_url = "ftp://x", weight = 0 }]
            credential = { env = "MISSING_VAR" }
            [[routes]]
            model = "m"
            cluster = "b"
        "#;
        let errs = load(text, &|_| None).unwrap_err();
        let paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
        assert!(paths.contains(&"server.listen"), "{paths:?}");
        assert!(
            paths.contains(&"clusters.a.backends[0].weight"),
            "{paths:?}"
        );
        assert!(
            paths.contains(&"clusters.a.backends[0].base_url"),
            "{paths:?}"
        );
        assert!(paths.contains(&"clusters.a.credential.env"), "{paths:?}");
        assert!(paths.contains(&"routes[0].cluster"), "{paths:?}");
    }

    #[test]
    fn request_stream_usage_defaults_on() {
        let cluster = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                       [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";
        let s = load(cluster, &|_| None).unwrap();
        assert!(s.upstream.request_stream_usage);
        let off = format!("[upstream]\nrequest_stream_usage = false\n{cluster}");
        assert!(!load(&off, &|_| None).unwrap().upstream.request_stream_usage);
        let errs = load("[upstream]\nrequest_stream_usage = 1\n", &|_| None).unwrap_err();
        assert!(
            errs.iter()
                .any(|e| e.message.contains("expected a boolean")),
            "{errs:?}"
        );
    }

    #[test]
    fn the_upstream_cap_follows_the_client_side_and_the_pool_wait_is_bounded() {
        let cluster = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                       [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";
        let upstream = |text: &str| load(&format!("{text}\n{cluster}"), &|_| None);
        let s = upstream("").unwrap();
        assert_eq!(
            s.upstream.max_connections_per_backend,
            s.server.max_connections_per_worker
        );
        assert_eq!(s.upstream.pool_wait, Duration::from_millis(100));
        assert_eq!(
            s.server.max_requests_per_worker,
            s.server.max_connections_per_worker
        );
        let s = upstream("[server]\nmax_connections_per_worker = 5000").unwrap();
        assert_eq!(s.upstream.max_connections_per_backend, 5000);
        assert_eq!(s.server.max_requests_per_worker, 5000);
        let s = upstream("[server]\nmax_requests_per_worker = 7").unwrap();
        assert_eq!(s.server.max_requests_per_worker, 7);
        let s = upstream("[upstream]\nmax_connections_per_backend = 7\npool_wait_ms = 0").unwrap();
        assert_eq!(s.upstream.max_connections_per_backend, 7);
        assert_eq!(s.upstream.pool_wait, Duration::ZERO);
        let errs = upstream("[upstream]\nmax_connections_per_backend = 0\npool_wait_ms = 60001")
            .unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "upstream.max_connections_per_backend",
                "upstream.pool_wait_ms"
            ],
            "{errs:?}"
        );
    }

    #[test]
    fn shutdown_grace_defaults_to_30_s_and_is_bounded() {
        let cluster = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                       [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";
        let grace = |server: &str| {
            load(&format!("[server]\n{server}\n{cluster}"), &|_| None)
                .map(|s| s.server.shutdown_grace)
        };
        assert_eq!(grace("").unwrap(), Duration::from_secs(30));
        assert_eq!(grace("shutdown_grace_ms = 0").unwrap(), Duration::ZERO);
        assert_eq!(
            grace("shutdown_grace_ms = 3600000").unwrap(),
            Duration::from_secs(3600)
        );
        let errs = grace("shutdown_grace_ms = 3600001").unwrap_err();
        assert_eq!(
            errs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["server.shutdown_grace_ms (line 2, column 21): must be at most 3600000 (one hour)"]
        );
        let errs = grace("shutdown_grace_ms = -1").unwrap_err();
        assert_eq!(errs[0].path, "server.shutdown_grace_ms", "{errs:?}");
    }

    #[test]
    fn unknown_keys_rejected() {
        let errs = load("[server]\nlisten_typo = 1\n", &|_| None).unwrap_err();
        assert!(errs[0].message.contains("listen_typo"), "{errs:?}");
    }

    /// A valid cluster and route, for tests that care about other sections.
    const CLUSTER: &str = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                           [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";

    fn at(line: usize, column: usize) -> Option<Position> {
        Some(Position { line, column })
    }

    fn find<'a>(errs: &'a [ConfigError], path: &str) -> &'a ConfigError {
        errs.iter()
            .find(|e| e.path == path)
            .unwrap_or_else(|| panic!("no error at {path}: {errs:#?}"))
    }

    #[test]
    fn group_conditions_and_timeouts_are_checked() {
        let text = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                    [[routes]]\nmodel = \"m\"\ngroups = [\n\
                    { when = [\"timeout\"], targets = [{ cluster = \"a\" }] },\n\
                    { when = [], targets = [{ cluster = \"a\" }] },\n\
                    { when = [\"status_5xx\", \"5xx\", \"status_5xx\"], first_byte_timeout_ms = 0, \
                      targets = [{ cluster = \"a\" }] },\n]\n";
        let errs = load(text, &|_| None).unwrap_err();
        let msg = |path| find(&errs, path).message.clone();
        assert!(msg("routes[0].groups[0].when").contains("only a later group"));
        assert!(msg("routes[0].groups[1].when").contains("at least one failure"));
        assert!(msg("routes[0].groups[2].when[1]").contains("one of connect, timeout"));
        assert!(msg("routes[0].groups[2].when[2]").contains("listed twice"));
        assert!(msg("routes[0].groups[2].first_byte_timeout_ms").contains("at least 1 ms"));
        assert_eq!(errs.len(), 5, "{errs:#?}");

        let text = "[timeouts]\nupstream_first_byte_ms = 9000\n\
                    [clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                    [[routes]]\nmodel = \"m\"\ngroups = [\n\
                    { targets = [{ cluster = \"a\" }], first_byte_timeout_ms = 250 },\n\
                    { when = [\"status_429\", \"timeout\"], targets = [{ cluster = \"a\" }] },\n]\n";
        let snapshot = load(text, &|_| None).unwrap();
        let groups = &snapshot.routes[0].groups;
        assert_eq!(groups[0].first_byte_timeout, Duration::from_millis(250));
        assert_eq!(groups[1].first_byte_timeout, Duration::from_millis(9000));
        assert_eq!(groups[0].when, None);
        let when = groups[1].when.unwrap();
        assert!(when.contains("status_429") && when.contains("timeout"));
        assert!(!when.contains("status_5xx") && !when.contains("connect"));
    }

    #[test]
    fn dialects_are_checked() {
        let cluster = |extra: &str| {
            format!(
                "[clusters.a]\nbackends = [{{ base_url = \"http://127.0.0.1:1/v1\" }}]\n{extra}\n\
                 [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n"
            )
        };
        let errs = |extra: &str| load(&cluster(extra), &|_| None).unwrap_err();
        let e = errs("anthropic = { version = \"2023-06-01\" }");
        assert!(find(&e, "clusters.a.anthropic")
            .message
            .contains("dialect = \"anthropic\""));
        let e = errs("dialect = \"anthropic\"\nanthropic = { version = \"\", beta = \"a\\nb\", default_max_tokens = 0 }");
        assert!(find(&e, "clusters.a.anthropic.version")
            .message
            .contains("header value"));
        assert!(find(&e, "clusters.a.anthropic.beta")
            .message
            .contains("header value"));
        assert!(find(&e, "clusters.a.anthropic.default_max_tokens")
            .message
            .contains("at least 1"));
        let e = errs("dialect = \"gemini\"");
        assert!(e[0].path.starts_with("clusters.a.dialect"), "{e:?}");

        let ok = load(&cluster("dialect = \"anthropic\""), &|_| None).unwrap();
        let dialect::Dialect::Anthropic(a) = &ok.clusters[0].dialect else {
            panic!("not anthropic");
        };
        assert_eq!(a.version_line, b"anthropic-version: 2023-06-01\r\n");
        assert_eq!(a.beta_line, None);
        assert_eq!(a.default_max_tokens, 4096);
        let ok = load(&cluster(""), &|_| None).unwrap();
        assert_eq!(ok.clusters[0].dialect, dialect::Dialect::OpenAi);
    }

    #[test]
    fn probes_are_checked() {
        let cluster = |url: &str, probe: &str| {
            format!(
                "[clusters.a]\nbackends = [{{ base_url = \"{url}\" }}]\nprobe = {probe}\n\
                 [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n"
            )
        };
        let errs = |text: String| load(&text, &|_| None).unwrap_err();
        let e = errs(cluster(
            "https://127.0.0.1:1/v1",
            "{ path = \"health\", expect_status = 99, interval_ms = 5, timeout_ms = 6, when = \"sometimes\" }",
        ));
        let msg = |path| find(&e, path).message.clone();
        assert!(msg("clusters.a.probe.path").contains("absolute path"));
        assert!(msg("clusters.a.probe.expect_status").contains("100 to 599"));
        assert!(msg("clusters.a.probe.type").contains("use type = \"tcp\""));
        assert!(msg("clusters.a.probe.interval_ms").contains("at least 10"));
        assert!(msg("clusters.a.probe.timeout_ms").contains("interval_ms"));
        assert!(msg("clusters.a.probe.when").contains("\"open\" or \"always\""));
        let e = errs(cluster(
            "http://127.0.0.1:1/v1",
            "{ type = \"tcp\", path = \"/health\" }",
        ));
        assert!(find(&e, "clusters.a.probe.path")
            .message
            .contains("only an http probe"));
        let e = errs(cluster("http://127.0.0.1:1/v1", "{ type = \"icmp\" }"));
        assert!(find(&e, "clusters.a.probe.type").message.contains("`icmp`"));

        let ok = load(
            &cluster(
                "https://127.0.0.1:1/v1",
                "{ type = \"tcp\", when = \"always\" }",
            ),
            &|_| None,
        )
        .unwrap();
        let probe = ok.clusters[0].probe.clone().unwrap();
        assert_eq!(probe.check, routing::ProbeCheck::Tcp);
        assert!(probe.always);
        let ok = load(&cluster("http://127.0.0.1:1/v1", "{}"), &|_| None).unwrap();
        let probe = ok.clusters[0].probe.clone().unwrap();
        assert_eq!(
            probe.check,
            routing::ProbeCheck::Http {
                path: "/health".into(),
                expect_status: 200
            }
        );
        assert_eq!(probe.interval, Duration::from_millis(2000));
        assert_eq!(probe.timeout, Duration::from_millis(1000));
        assert!(!probe.always);
    }

    #[test]
    fn unknown_field_names_the_key_with_line_and_column() {
        let text = format!("[server]\nlisten = \"127.0.0.1:0\"\nlistn = 1\n{CLUSTER}");
        let errs = load(&text, &|_| None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        let e = &errs[0];
        assert_eq!(e.path, "server.listn");
        assert_eq!(e.position, at(3, 1));
        assert!(
            e.to_string().starts_with(
                "server.listn (line 3, column 1): unknown field `listn`, expected one of `listen`"
            ),
            "{e}"
        );
    }

    #[test]
    fn type_error_names_the_key_and_points_at_the_value() {
        let text = format!("[server]\nworkers = \"two\"\n{CLUSTER}");
        let errs = load(&text, &|_| None).unwrap_err();
        assert_eq!(
            errs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [r#"server.workers (line 2, column 11): invalid type: string "two", expected usize"#]
        );
    }

    #[test]
    fn semantic_errors_get_line_and_column_too() {
        let text = format!("# comment\n[server]\n  listen = \"nope\"\n{CLUSTER}");
        let errs = load(&text, &|_| None).unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "server.listen (line 3, column 12): `nope` is not an address like 127.0.0.1:8080"
        );
        // A key that is not in the file points at the nearest part of its path that is.
        let errs = load(
            "[clusters.a]\n[[routes]]\nmodel = \"*\"\ncluster = \"a\"\n",
            &|_| None,
        )
        .unwrap_err();
        assert_eq!(find(&errs, "clusters.a.backends").position, at(1, 11));
        // One about a key that is nowhere in the file has no position, and comes last.
        let errs = load("[server]\nworkers = 1\n", &|_| None).unwrap_err();
        assert_eq!(find(&errs, "clusters").position, None);
        assert_eq!(errs.last().unwrap().position, None);
        assert_eq!(
            find(&errs, "routes").to_string(),
            "routes: at least one route is required"
        );
    }

    #[test]
    fn errors_in_every_section_are_reported_at_once() {
        let text = r#"
[server]
listen = "nope"
workerz = 2

[timeouts]
header_read_ms = 0

[http]
max_headers = "many"

[clusters.a]
backends = [{ base_url = "http://127.0.0.1:1/v1", weight = "heavy" }]

[clusters.b]
backends = [{ base_url = "ftp://x" }]

[clusters.c]
backends = 5

[[routes]]
model = "*"
cluster = "a"

[[routes]]
model = "m"

[pricing."gpt-4.1"]
input = -1.0
output = 1.0

[[keys]]
id = "k"
sha256 = "00"
colour = "red"

[bogus]
"#;
        let errs = load(text, &|_| None).unwrap_err();
        let shown: Vec<String> = errs.iter().map(ToString::to_string).collect();
        let expect = [
            ("server.listen", 3, 10),
            ("server.workerz", 4, 1),
            ("timeouts.header_read_ms", 7, 18),
            ("http.max_headers", 10, 15),
            ("clusters.a.backends[0].weight", 13, 60),
            ("clusters.b.backends[0].base_url", 16, 26),
            ("clusters.c.backends", 19, 12),
            ("routes[1]", 25, 1),
            ("pricing.\"gpt-4.1\"", 28, 10),
            ("keys[0].sha256", 34, 10),
            ("keys[0].colour", 35, 1),
            ("bogus", 37, 2),
        ];
        for (path, line, column) in expect {
            assert_eq!(find(&errs, path).position, at(line, column), "{shown:#?}");
        }
        // File order, and nothing else: a key left out for an error is not checked again at its
        // default (no "at least one backend" for clusters.c), and a route to cluster `a`, whose
        // bad weight was left out, is fine.
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, expect.map(|(p, _, _)| p), "{shown:#?}");
        assert!(find(&errs, "routes[1]")
            .message
            .contains("a route needs `cluster`"));
        assert!(find(&errs, "bogus")
            .message
            .contains("unknown field `bogus`"));
    }

    #[test]
    fn syntax_error_has_line_and_column() {
        let errs = load("[server]\nworkers = 2\nlisten = \"127.0.0.1:0\n", &|_| None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert_eq!(errs[0].path, "");
        assert_eq!(errs[0].position.map(|p| p.line), Some(3), "{errs:#?}");
        let shown = errs[0].to_string();
        assert!(shown.starts_with("line 3, column "), "{shown}");
        assert!(shown.contains("invalid TOML: "), "{shown}");
        assert!(!shown.contains('\n'), "{shown}");
    }

    #[test]
    fn admin_listen_must_not_take_the_server_port() {
        let errs = load(
            &format!("[server]\nlisten = \"127.0.0.1:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n{CLUSTER}"),
            &|_| None,
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert_eq!(errs[0].path, "admin.listen");
        assert_eq!(errs[0].position, at(4, 10));
        // A wildcard covers the other address.
        let errs = load(
            &format!("[server]\nlisten = \"0.0.0.0:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n{CLUSTER}"),
            &|_| None,
        )
        .unwrap_err();
        assert_eq!(errs[0].path, "admin.listen");
        // Another port is fine.
        let s = load(
            &format!("[server]\nlisten = \"0.0.0.0:8080\"\n[admin]\nlisten = \"127.0.0.1:9090\"\n{CLUSTER}"),
            &|_| None,
        )
        .unwrap();
        assert_eq!(s.admin_listen.map(|a| a.port()), Some(9090));

        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(listeners_clash(addr("[::]:80"), addr("127.0.0.1:80")));
        assert!(listeners_clash(addr("[::1]:80"), addr("[::]:80")));
        assert!(listeners_clash(
            addr("[::ffff:127.0.0.1]:80"),
            addr("127.0.0.1:80")
        ));
        assert!(!listeners_clash(addr("0.0.0.0:80"), addr("[::1]:80")));
        assert!(!listeners_clash(addr("127.0.0.1:80"), addr("127.0.0.2:80")));
        assert!(!listeners_clash(addr("127.0.0.1:0"), addr("127.0.0.1:0")));
    }

    #[test]
    fn unknown_credential_header_is_a_warning_unless_allowed() {
        let env = |_: &str| Some("sk-test".to_string());
        let text = "[clusters.openai]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                    credential = { env = \"KEY\", header = \"authorisation\" }\n\
                    [[routes]]\nmodel = \"*\"\ncluster = \"openai\"\n";
        let loaded = load_with_warnings(text, &env);
        let snapshot = loaded.snapshot.unwrap();
        // Still sent as configured: a warning, not an error.
        let credential = &snapshot.clusters[0].credentials[0];
        assert_eq!(credential.header_name, "authorisation");
        assert_eq!(loaded.warnings.len(), 1);
        assert_eq!(
            loaded.warnings[0].to_string(),
            "clusters.openai.credential.header (line 3, column 38): `authorisation` is not a \
             known credential header (authorization, x-api-key, api-key, x-goog-api-key); the \
             secret will be sent under it — set credential.allow_custom_header = true if that is \
             intended"
        );
        let allowed = text.replace(
            "header = \"authorisation\"",
            "header = \"authorisation\", allow_custom_header = true",
        );
        let loaded = load_with_warnings(&allowed, &env);
        assert!(loaded.snapshot.is_ok());
        assert_eq!(loaded.warnings, []);
        for known in ["X-Api-Key", "api-key", "x-goog-api-key", "authorization"] {
            let text = text.replace("authorisation", known);
            assert_eq!(load_with_warnings(&text, &env).warnings, [], "{known}");
        }
    }

    #[test]
    fn datetimes_read_through_the_path_tracking() {
        let sha = "ab".repeat(32);
        let text = format!(
            "{CLUSTER}[[keys]]\nid = \"k\"\nsha256 = \"{sha}\"\nexpires = 2030-01-01T00:00:00Z\n\
             plans = [{{ id = \"p\", tokens = 10, anchor = 2024-01-01T00:00:00Z }}]\n"
        );
        let s = load(&text, &|_| None).unwrap();
        assert_eq!(s.limits.keys[0].expires, Some(1_893_456_000));
        let errs = load(&text.replace("2030-01-01T00:00:00Z", "\"soon\""), &|_| None).unwrap_err();
        assert_eq!(errs[0].path, "keys[0].expires", "{errs:#?}");
        assert_eq!(errs[0].position, at(9, 11), "{errs:#?}");
    }

    #[test]
    fn key_paths_round_trip() {
        for (key, shown) in [
            ("a", "a"),
            ("gpt-4o", "gpt-4o"),
            ("gpt-4.1", "\"gpt-4.1\""),
            ("", "\"\""),
            ("a\"b\\c", r#""a\"b\\c""#),
        ] {
            assert_eq!(key_segment(key), shown);
            let path = format!("x.{shown}[3].y");
            assert_eq!(
                parse_path(&path),
                [
                    Segment::Key("x".into()),
                    Segment::Key(key.into()),
                    Segment::Index(3),
                    Segment::Key("y".into())
                ]
            );
        }
        assert_eq!(position_at("ab\nçd", 5), Position { line: 2, column: 2 });
    }

    #[test]
    fn routes_sorted_most_specific_first() {
        let text = r#"
            [clusters.a]
            backends = [{ base_url = "http://127.0.0.1:1/v1" }]
            [[routes]]
            model = "*"
            cluster = "a"
            [[routes]]
            model = "gpt-4o*"
            cluster = "a"
            [[routes]]
            model = "gpt-4o"
            cluster = "a"
        "#;
        let s = load(text, &|_| None).unwrap();
        let order: Vec<_> = s
            .routes
            .iter()
            .map(|r| match &r.pattern {
                ModelPattern::Exact(m) => m.clone(),
                ModelPattern::Glob { source, .. } => source.clone(),
            })
            .collect();
        assert_eq!(order, ["gpt-4o", "gpt-4o*", "*"]);
        assert_eq!(s.clusters[0].backends[0].base_path, "/v1");
        assert_eq!(s.clusters[0].backends[0].host_header, "127.0.0.1:1");
    }
}
