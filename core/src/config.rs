//! Configuration: the TOML file, parsed into raw serde types, validated once into a [`Snapshot`].
//!
//! Runs on the control thread at startup (and for `sluice check`), never on a worker's request
//! path. Takes the file's text; returns an immutable [`Snapshot`] that every worker holds as
//! `Rc<Snapshot>`, or every error found at once, each with the key path it concerns. Unknown keys
//! are errors. Backend host names are resolved here, once, so workers never make a blocking DNS
//! call.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

/// One problem found in a config file, with the dotted path of the key it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

// ---------------------------------------------------------------------------------------------
// Raw types: exactly what the file says, defaults filled in, nothing checked yet.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    http: RawHttp,
    #[serde(default)]
    timeouts: RawTimeouts,
    #[serde(default)]
    upstream: RawUpstream,
    #[serde(default)]
    clusters: BTreeMap<String, RawCluster>,
    #[serde(default)]
    routes: Vec<RawRoute>,
    admin: Option<RawAdmin>,
    access_log: Option<RawAccessLog>,
    #[serde(default)]
    pricing: BTreeMap<String, RawPrice>,
    #[serde(default)]
    keys: Vec<crate::limits::config::RawKey>,
    #[serde(default)]
    policies: Vec<crate::limits::config::RawPolicy>,
    #[serde(default)]
    limits: crate::limits::config::RawLimits,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: String,
}

#[derive(Debug, Deserialize)]
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
#[serde(deny_unknown_fields)]
struct RawPrice {
    input: f64,
    output: f64,
    cached_input: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawServer {
    listen: String,
    workers: usize,
    pin_workers: bool,
    max_connections_per_worker: usize,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "127.0.0.1:8080".into(),
            workers: 0,
            pin_workers: true,
            max_connections_per_worker: 16384,
        }
    }
}

#[derive(Debug, Deserialize)]
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
#[serde(deny_unknown_fields, default)]
struct RawTimeouts {
    header_read_ms: u64,
    body_read_ms: u64,
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
            keepalive_idle_ms: 60_000,
            upstream_connect_ms: 3_000,
            upstream_first_byte_ms: 120_000,
            stream_idle_ms: 60_000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawUpstream {
    max_idle_per_backend: usize,
    max_connections_per_backend: usize,
    idle_timeout_ms: u64,
    request_stream_usage: bool,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            max_idle_per_backend: 64,
            max_connections_per_backend: 1024,
            idle_timeout_ms: 30_000,
            request_stream_usage: true,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    backends: Vec<RawBackend>,
    #[serde(default)]
    model_map: BTreeMap<String, String>,
    credential: Option<RawCredential>,
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
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
#[serde(deny_unknown_fields)]
struct RawCredential {
    env: String,
    #[serde(default = "default_credential_header")]
    header: String,
}

fn default_credential_header() -> String {
    "authorization".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    model: String,
    cluster: String,
    /// For a glob route: the concrete names it serves, listed by `GET /v1/models` (a glob
    /// can't be enumerated).
    #[serde(default)]
    models: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// Resolved types: what workers use.
// ---------------------------------------------------------------------------------------------

/// The validated, immutable configuration every worker runs on. Each worker gets its own
/// copy (`Rc<Snapshot>`), so reading it never touches a cache line another core writes.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub server: ServerConfig,
    pub http: HttpLimits,
    pub timeouts: Timeouts,
    pub upstream: UpstreamLimits,
    /// Clusters, indexed by [`ClusterId`].
    pub clusters: Vec<Cluster>,
    /// Routes, ordered most specific first (see [`crate::route`]).
    pub routes: Vec<Route>,
    /// Every backend of every cluster, indexed by [`BackendId`] (pools are per backend).
    pub backend_count: usize,
    /// Where the admin listener (metrics, health) binds, if anywhere.
    pub admin_listen: Option<SocketAddr>,
    pub access_log: Option<AccessLogSettings>,
    /// Prices per model name, per million tokens.
    pub prices: BTreeMap<String, Price>,
    /// API keys, quota plans, limit policies and the sync backend. Shared, not copied, by the
    /// workers: a key table can be large.
    pub limits: Arc<crate::limits::config::LimitsConfig>,
}

#[derive(Debug, Clone)]
pub struct AccessLogSettings {
    pub dir: PathBuf,
    pub max_file_bytes: u64,
    pub max_file_age: Duration,
    pub batch_bytes: usize,
    pub queue_batches: usize,
    pub flush_interval: Duration,
}

/// A model's price, in currency units per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    /// For prompt tokens served from the provider's cache (defaults to `input`).
    pub cached_input: f64,
}

impl Price {
    /// Cost of one request. Cached tokens are part of `prompt_tokens` and priced apart.
    pub fn cost(&self, prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> f64 {
        let cached = cached_tokens.min(prompt_tokens);
        let uncached = prompt_tokens - cached;
        (uncached as f64 * self.input
            + cached as f64 * self.cached_input
            + completion_tokens as f64 * self.output)
            / 1_000_000.0
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub workers: usize,
    pub pin_workers: bool,
    pub max_connections_per_worker: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_request_line_bytes: usize,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub header_read: Duration,
    pub body_read: Duration,
    pub keepalive_idle: Duration,
    pub upstream_connect: Duration,
    pub upstream_first_byte: Duration,
    pub stream_idle: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct UpstreamLimits {
    pub max_idle_per_backend: usize,
    pub max_connections_per_backend: usize,
    pub idle_timeout: Duration,
    /// Ask the upstream for usage on streamed chat completions and completions
    /// (`stream_options.include_usage`) even when the client did not, so limits settle on
    /// reported usage; that client never sees the extra usage chunk.
    pub request_stream_usage: bool,
}

pub type ClusterId = usize;
pub type BackendId = usize;

#[derive(Debug, Clone)]
pub struct Cluster {
    pub name: String,
    pub backends: Vec<Backend>,
    /// Sum of backend weights (> 0).
    pub total_weight: u64,
    pub model_map: BTreeMap<String, String>,
    pub credential: Option<Credential>,
    /// TLS client config for https backends (system roots + the cluster's CA file).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// An upstream credential header, ready to write: `name: value\r\n`. Never logged.
#[derive(Clone)]
pub struct Credential {
    /// The whole header line, e.g. `authorization: Bearer sk-…\r\n`.
    pub header_line: Vec<u8>,
    /// Lower-case header name, so the client's own copy of it is never forwarded.
    pub header_name: String,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credential({}: <redacted>)", self.header_name)
    }
}

#[derive(Debug, Clone)]
pub struct Backend {
    pub id: BackendId,
    pub weight: u32,
    pub addrs: Vec<SocketAddr>,
    pub tls: bool,
    /// Host header value (`host` or `host:port` when the port is not the scheme's default).
    pub host_header: String,
    /// Host name used for TLS SNI and certificate checks.
    pub server_name: String,
    /// Path prefix from `base_url`, without a trailing slash (may be empty).
    pub base_path: String,
}

#[derive(Debug, Clone)]
pub struct Route {
    pub pattern: ModelPattern,
    pub cluster: ClusterId,
    /// Concrete names a glob route declares it serves (each matches the glob), for
    /// `GET /v1/models`; empty for exact routes.
    pub models: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelPattern {
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
    pub fn parse(s: &str) -> ModelPattern {
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

    /// Literal (non-`*`) characters: the measure of specificity among globs.
    pub fn literal_len(&self) -> usize {
        match self {
            ModelPattern::Exact(s) => s.len(),
            ModelPattern::Glob { parts, .. } => parts.iter().map(String::len).sum(),
        }
    }

    pub fn matches(&self, model: &str) -> bool {
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
/// so tests can pass their own instead of touching the process environment.
pub fn load(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Snapshot, Vec<ConfigError>> {
    let raw: RawConfig = match toml::from_str(text) {
        Ok(raw) => raw,
        Err(e) => {
            return Err(vec![ConfigError {
                path: toml_error_path(&e),
                message: e.message().to_string(),
            }])
        }
    };
    let mut errors = Vec::new();
    let mut err = |path: String, message: String| errors.push(ConfigError { path, message });

    let listen = match raw.server.listen.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(addr)) => Some(addr),
        _ => {
            err(
                "server.listen".into(),
                format!(
                    "`{}` is not an address like 127.0.0.1:8080",
                    raw.server.listen
                ),
            );
            None
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = if raw.server.workers == 0 {
        cores
    } else {
        raw.server.workers
    };
    if raw.server.workers > 1024 {
        err("server.workers".into(), "must be at most 1024".into());
    }
    if raw.server.max_connections_per_worker == 0 {
        err(
            "server.max_connections_per_worker".into(),
            "must be at least 1".into(),
        );
    }

    let h = &raw.http;
    for (key, v, min) in [
        ("http.max_request_line_bytes", h.max_request_line_bytes, 64),
        ("http.max_header_bytes", h.max_header_bytes, 256),
        ("http.max_headers", h.max_headers, 8),
        ("http.max_body_bytes", h.max_body_bytes, 1),
    ] {
        if v < min {
            err(key.into(), format!("must be at least {min}"));
        }
    }
    if h.max_request_line_bytes > h.max_header_bytes {
        err(
            "http.max_request_line_bytes".into(),
            "must not exceed http.max_header_bytes".into(),
        );
    }

    let t = &raw.timeouts;
    for (key, v) in [
        ("timeouts.header_read_ms", t.header_read_ms),
        ("timeouts.body_read_ms", t.body_read_ms),
        ("timeouts.keepalive_idle_ms", t.keepalive_idle_ms),
        ("timeouts.upstream_connect_ms", t.upstream_connect_ms),
        ("timeouts.upstream_first_byte_ms", t.upstream_first_byte_ms),
        ("timeouts.stream_idle_ms", t.stream_idle_ms),
        ("upstream.idle_timeout_ms", raw.upstream.idle_timeout_ms),
    ] {
        if v == 0 {
            err(key.into(), "must be at least 1 ms".into());
        }
    }
    if raw.upstream.max_connections_per_backend == 0 {
        err(
            "upstream.max_connections_per_backend".into(),
            "must be at least 1".into(),
        );
    }

    // Clusters.
    let mut clusters = Vec::new();
    let mut cluster_ids = BTreeMap::new();
    let mut next_backend = 0usize;
    if raw.clusters.is_empty() {
        err("clusters".into(), "at least one cluster is required".into());
    }
    for (name, rc) in &raw.clusters {
        let path = format!("clusters.{name}");
        if rc.backends.is_empty() {
            err(
                format!("{path}.backends"),
                "at least one backend is required".into(),
            );
        }
        let mut backends = Vec::new();
        let mut any_tls = false;
        for (i, rb) in rc.backends.iter().enumerate() {
            let bpath = format!("{path}.backends[{i}]");
            if rb.weight == 0 {
                err(format!("{bpath}.weight"), "must be at least 1".into());
            }
            match parse_base_url(&rb.base_url) {
                Ok(url) => {
                    any_tls |= url.tls;
                    let addrs: Vec<SocketAddr> =
                        match (url.host.as_str(), url.port).to_socket_addrs() {
                            Ok(a) => a.collect(),
                            Err(e) => {
                                err(
                                    format!("{bpath}.base_url"),
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
                    backends.push(Backend {
                        id: next_backend,
                        weight: rb.weight,
                        addrs,
                        tls: url.tls,
                        host_header,
                        server_name: url.host,
                        base_path: url.path,
                    });
                    next_backend += 1;
                }
                Err(msg) => err(format!("{bpath}.base_url"), msg),
            }
        }
        for (from, to) in &rc.model_map {
            if to.is_empty() {
                err(
                    format!("{path}.model_map.\"{from}\""),
                    "mapped model must not be empty".into(),
                );
            }
        }
        let credential = match &rc.credential {
            None => None,
            Some(c) => {
                let header = c.header.to_ascii_lowercase();
                let valid_name = !header.is_empty()
                    && header
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                if !valid_name {
                    err(
                        format!("{path}.credential.header"),
                        format!("`{}` is not a valid header name", c.header),
                    );
                }
                match env(&c.env) {
                    Some(value) if !value.is_empty() => {
                        if value.bytes().any(|b| b < 0x20 || b == 0x7f) {
                            err(
                                format!("{path}.credential.env"),
                                format!(
                                    "environment variable `{}` holds control characters",
                                    c.env
                                ),
                            );
                        }
                        let value = if header == "authorization" {
                            format!("Bearer {value}")
                        } else {
                            value
                        };
                        Some(Credential {
                            header_line: format!("{header}: {value}\r\n").into_bytes(),
                            header_name: header,
                        })
                    }
                    _ => {
                        err(
                            format!("{path}.credential.env"),
                            format!("environment variable `{}` is not set or empty", c.env),
                        );
                        None
                    }
                }
            }
        };
        let tls = if any_tls || rc.ca_file.is_some() {
            match build_tls(rc.ca_file.as_deref()) {
                Ok(cfg) => Some(cfg),
                Err(msg) => {
                    err(format!("{path}.ca_file"), msg);
                    None
                }
            }
        } else {
            None
        };
        let total_weight = backends.iter().map(|b| u64::from(b.weight)).sum();
        cluster_ids.insert(name.clone(), clusters.len());
        clusters.push(Cluster {
            name: name.clone(),
            backends,
            total_weight,
            model_map: rc.model_map.clone(),
            credential,
            tls,
        });
    }

    // Routes.
    let mut routes = Vec::new();
    if raw.routes.is_empty() {
        err("routes".into(), "at least one route is required".into());
    }
    let mut seen = BTreeMap::new();
    for (i, rr) in raw.routes.iter().enumerate() {
        let path = format!("routes[{i}]");
        if rr.model.is_empty() {
            err(format!("{path}.model"), "must not be empty".into());
        }
        if let Some(prev) = seen.insert(rr.model.clone(), i) {
            err(
                format!("{path}.model"),
                format!("`{}` is already routed by routes[{prev}]", rr.model),
            );
        }
        let pattern = ModelPattern::parse(&rr.model);
        if !rr.models.is_empty() && matches!(pattern, ModelPattern::Exact(_)) {
            err(
                format!("{path}.models"),
                "only a glob route (a `model` with `*`) declares models; an exact route is listed by its name".into(),
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
        match cluster_ids.get(&rr.cluster) {
            Some(&cluster) => routes.push(Route {
                pattern,
                cluster,
                models: rr.models.clone(),
            }),
            None => err(
                format!("{path}.cluster"),
                format!("no cluster named `{}`", rr.cluster),
            ),
        }
    }
    // Most specific first: exact names, then globs by literal length; stable keeps file order
    // for ties.
    routes.sort_by_key(|r| match &r.pattern {
        ModelPattern::Exact(_) => (0, 0),
        ModelPattern::Glob { .. } => (1, usize::MAX - r.pattern.literal_len()),
    });

    let admin_listen = match &raw.admin {
        None => None,
        Some(a) => match a.listen.to_socket_addrs().map(|mut i| i.next()) {
            Ok(Some(addr)) => Some(addr),
            _ => {
                err(
                    "admin.listen".into(),
                    format!("`{}` is not an address like 127.0.0.1:9090", a.listen),
                );
                None
            }
        },
    };
    let access_log = raw.access_log.as_ref().map(|l| {
        if l.max_file_bytes < 4096 {
            err(
                "access_log.max_file_bytes".into(),
                "must be at least 4096".into(),
            );
        }
        if l.max_file_age_secs == 0 {
            err(
                "access_log.max_file_age_secs".into(),
                "must be at least 1".into(),
            );
        }
        if l.batch_bytes == 0 || l.queue_batches == 0 || l.flush_interval_ms == 0 {
            err(
                "access_log".into(),
                "batch_bytes, queue_batches and flush_interval_ms must be at least 1".into(),
            );
        }
        AccessLogSettings {
            dir: l.dir.clone(),
            max_file_bytes: l.max_file_bytes,
            max_file_age: Duration::from_secs(l.max_file_age_secs),
            batch_bytes: l.batch_bytes,
            queue_batches: l.queue_batches,
            flush_interval: Duration::from_millis(l.flush_interval_ms),
        }
    });
    let mut prices = BTreeMap::new();
    for (model, p) in &raw.pricing {
        let cached_input = p.cached_input.unwrap_or(p.input);
        if [p.input, p.output, cached_input]
            .iter()
            .any(|v| !v.is_finite() || *v < 0.0)
        {
            err(
                format!("pricing.\"{model}\""),
                "prices must be finite and non-negative".into(),
            );
        }
        prices.insert(
            model.clone(),
            Price {
                input: p.input,
                output: p.output,
                cached_input,
            },
        );
    }

    let limits = crate::limits::config::resolve(
        &raw.keys,
        &raw.policies,
        &raw.limits,
        workers,
        env,
        &mut err,
    );

    if !errors.is_empty() {
        return Err(errors);
    }
    let Some(listen) = listen else {
        return Err(errors);
    };
    Ok(Snapshot {
        server: ServerConfig {
            listen,
            workers,
            pin_workers: raw.server.pin_workers,
            max_connections_per_worker: raw.server.max_connections_per_worker,
        },
        http: HttpLimits {
            max_request_line_bytes: h.max_request_line_bytes,
            max_header_bytes: h.max_header_bytes,
            max_headers: h.max_headers,
            max_body_bytes: h.max_body_bytes,
        },
        timeouts: Timeouts {
            header_read: Duration::from_millis(t.header_read_ms),
            body_read: Duration::from_millis(t.body_read_ms),
            keepalive_idle: Duration::from_millis(t.keepalive_idle_ms),
            upstream_connect: Duration::from_millis(t.upstream_connect_ms),
            upstream_first_byte: Duration::from_millis(t.upstream_first_byte_ms),
            stream_idle: Duration::from_millis(t.stream_idle_ms),
        },
        upstream: UpstreamLimits {
            max_idle_per_backend: raw.upstream.max_idle_per_backend,
            max_connections_per_backend: raw.upstream.max_connections_per_backend,
            idle_timeout: Duration::from_millis(raw.upstream.idle_timeout_ms),
            request_stream_usage: raw.upstream.request_stream_usage,
        },
        clusters,
        routes,
        backend_count: next_backend,
        admin_listen,
        access_log,
        prices,
        limits: Arc::new(limits),
    })
}

fn toml_error_path(e: &toml::de::Error) -> String {
    // toml reports the position, not the key path; give line/column so the operator finds it.
    match e.span() {
        Some(span) => format!("(at byte {})", span.start),
        None => "(file)".into(),
    }
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
    fn unknown_keys_rejected() {
        let errs = load("[server]\nlisten_typo = 1\n", &|_| None).unwrap_err();
        assert!(errs[0].message.contains("listen_typo"), "{errs:?}");
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
