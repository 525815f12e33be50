//! The resolved types: the validated, immutable [`Snapshot`] every worker runs on, and what it
//! is made of (clusters, backends, credentials, routes, model patterns, prices, timeouts).
//! Built only by [`resolve`](super::resolve).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{dialect, limits, routing, saturation, sticky, tls, HttpLimits};
use crate::openai::meter::Usage;

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
    /// `[saturation]`: caps and the wait queue (`None`: `max_in_flight` is only a load
    /// signal, and nothing waits).
    pub(crate) saturation: Option<Arc<saturation::Saturation>>,
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
    pub(crate) real_ip: RealIp,
}

/// Whose word on a client's address Sluice takes (`server.trusted_proxies`,
/// `server.real_ip_header`; see `gateway::client_addr`).
#[derive(Debug, Clone, Default)]
pub(crate) struct RealIp {
    /// The proxies whose `header` is believed; none: the TCP peer is the client.
    pub(crate) trusted: Vec<limits::Cidr>,
    /// The header they name the address they got the request from in, lower case.
    pub(crate) header: String,
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
    /// The upstream response headers a client sees (`pass_response_headers`).
    pub(crate) pass_response_headers: crate::http::pass::HeaderPass,
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
    /// The priority class it names (resolved in [`Snapshot::saturation`]).
    pub(crate) class: Option<String>,
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
    pub(super) fn rank(&self) -> u8 {
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
    /// With `[saturation]`: the backend is full while its scraped queue holds this many.
    pub(crate) max_waiting: Option<u32>,
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

pub(super) fn glob_match(parts: &[String], starts_open: bool, ends_open: bool, text: &str) -> bool {
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
