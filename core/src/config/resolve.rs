//! The resolvers: raw sections checked and turned into resolved types, every error collected
//! with its key path. [`validate`] runs them all in order (clusters in
//! [`resolve_clusters`](super::resolve_clusters), routes in
//! [`resolve_routes`](super::resolve_routes)) and builds the [`Snapshot`](super::Snapshot).

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use super::raw::{
    RawAccessLog, RawAdmin, RawConfig, RawHttp, RawPrice, RawServer, RawTimeouts, RawUpstream,
};
use super::reader::key_segment;
use super::resolve_clusters::resolve_clusters;
use super::resolve_routes::resolve_routes;
use super::snapshot::{
    AccessLogSettings, Price, RealIp, ServerConfig, Snapshot, Timeouts, UpstreamLimits,
};
use super::{limits, routing, saturation, sticky, tls, ConfigError, HttpLimits};

/// Check what was read and build the snapshot (`None` when something needed is missing; every
/// problem is in `errors`). Each section has its resolver, run in file order so that errors at
/// the same place keep the order they were found in.
pub(super) fn validate(
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
        saturation,
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
    let client_connections = server.as_ref().map_or_else(
        || default_connections(workers),
        |s| s.max_connections_per_worker,
    );
    let upstream = resolve_upstream(&upstream, client_connections, &mut err);
    // A section that could not be read, or was misspelled (`[cluster.x]`: see the reader), is
    // reported once, by its own error: the checks that need it say nothing of its absence.
    // Only when nothing of the section was read: one bad entry beside good ones keeps every
    // check (a route naming a cluster that is nowhere is still reported).
    let clusters_read = !failed.contains("clusters") || !clusters.is_empty();
    let routes_read = !failed.contains("routes") || !routes.is_empty();
    let echo = move |path: &str, message: &str| {
        (!clusters_read && (path == "clusters" || message.starts_with("no cluster named")))
            || (!routes_read && path == "routes")
    };
    let clusters = resolve_clusters(
        &clusters,
        env,
        &mut |path, message| {
            if !echo(&path, &message) {
                err(path, message);
            }
        },
        warnings,
    );
    // Keys before routes: a route may be a key's or an entity's own.
    let limits_read = !failed.contains("limits");
    // Route scopes are checked against the keys only when every key could be read.
    let keys_read =
        limits_read && keys.iter().all(Option::is_some) && policies.iter().all(Option::is_some);
    let limits = resolve_limits(keys, policies, &limits, limits_read, workers, env, &mut err);
    key_warnings(&limits.keys, crate::sys::time::unix_secs(), warnings);
    let mut routes = resolve_routes(
        &routes,
        &clusters.by_name,
        timeouts.upstream_first_byte,
        keys_read.then_some(&limits),
        &mut |path, message| {
            if !echo(&path, &message) {
                err(path, message);
            }
        },
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
    if let Some(listen) = admin_listen.filter(|a| !a.ip().is_loopback()) {
        warnings.push(ConfigError::new(
            "admin.listen".into(),
            format!(
                "`{listen}` is reachable from other hosts: /metrics (keys, entities and models by \
                 name) and /admin/reload answer anyone who reaches it; bind 127.0.0.1 unless a \
                 firewall or the scraper's network needs otherwise"
            ),
        ));
    }
    let admin_token_digest = admin
        .as_ref()
        .and_then(|a| resolve_admin_token(a, env, &mut err));
    let now_unix = crate::sys::time::unix_secs();
    let tls = tls
        .as_ref()
        .and_then(|t| tls::resolve_tls(t, now_unix, &mut err, warnings));
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

    let saturation = resolve_saturation_against(saturation.as_ref(), &limits, &routes, &mut err);

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
        saturation,
    })
}

/// `[saturation]`, with the classes keys and routes name; a class named with no
/// `[saturation]` to define it is an error.
fn resolve_saturation_against(
    raw: Option<&saturation::RawSaturation>,
    limits: &limits::LimitsConfig,
    routes: &[super::snapshot::Route],
    err: &mut dyn FnMut(String, String),
) -> Option<Arc<saturation::Saturation>> {
    let keys: Vec<_> = limits
        .keys
        .iter()
        .map(|k| (k.id.as_str(), k.class.as_deref(), k.queue_weight))
        .collect();
    let route_classes: Vec<_> = routes
        .iter()
        .map(|r| (r.pattern.source(), r.class.as_deref()))
        .collect();
    let Some(raw) = raw else {
        if let Some(i) = keys.iter().position(|k| k.1.is_some()) {
            err(
                format!("keys[{i}].class"),
                "priority classes are defined in [saturation], which is missing".into(),
            );
        }
        if let Some(i) = limits.policies.iter().position(|p| p.queue_wait.is_some()) {
            err(
                format!("policies[{i}].on_limit"),
                "\"queue\" waits in a priority class: it needs [saturation]".into(),
            );
        }
        if let Some((pattern, _)) = route_classes.iter().find(|r| r.1.is_some()) {
            err(
                "routes".into(),
                format!(
                    "the route for `{pattern}` names a class: priority classes are defined \
                     in [saturation], which is missing"
                ),
            );
        }
        return None;
    };
    Some(Arc::new(saturation::resolve_saturation(
        raw,
        &keys,
        &limits.entities,
        &route_classes,
        err,
    )))
}

/// `server.workers`, with 0 meaning one per core.
pub(super) fn worker_count(raw: &RawServer) -> usize {
    match raw.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// The longest `server.shutdown_grace_ms`: a stop that waits longer than an hour is a stuck
/// stop (a second SIGTERM ends it at once anyway).
pub(super) const MAX_SHUTDOWN_GRACE_MS: u64 = 3_600_000;

/// Descriptors kept beside the client and upstream connections: listeners, Redis, log files.
pub(crate) const RESERVED_DESCRIPTORS: u64 = 256;

/// The client connections per worker an open-file `limit` holds for `workers` workers: each
/// proxied connection holds a client and an upstream socket, beside
/// [`RESERVED_DESCRIPTORS`]. At least 1.
pub(crate) fn connections_fitting(limit: u64, workers: usize) -> u64 {
    (limit.saturating_sub(RESERVED_DESCRIPTORS) / (2 * workers.max(1) as u64)).max(1)
}

/// `server.max_connections_per_worker` when the file sets none: what this process's open-file
/// limit holds ([`connections_fitting`]), at most 16,384. (`sluice check` sizes it with its own
/// limit, which may not be the service's.)
pub(super) fn default_connections(workers: usize) -> usize {
    const MOST: u64 = 16_384;
    crate::sys::sock::open_files_limit()
        .map_or(MOST, |limit| connections_fitting(limit, workers))
        .min(MOST) as usize
}

/// `[server]`; `None` when `listen` is not an address.
pub(super) fn resolve_server(
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
    let max_connections_per_worker = raw
        .max_connections_per_worker
        .unwrap_or_else(|| default_connections(workers));
    let max_requests_per_worker = raw
        .max_requests_per_worker
        .unwrap_or(max_connections_per_worker);
    for (key, v) in [
        (
            "server.max_connections_per_worker",
            max_connections_per_worker,
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
    let real_ip = resolve_real_ip(raw, err);
    Some(ServerConfig {
        real_ip,
        listen: listen?,
        workers,
        pin_workers: raw.pin_workers,
        max_connections_per_worker,
        max_requests_per_worker,
        max_body_memory_per_worker: raw.max_body_memory_per_worker,
        shutdown_grace: Duration::from_millis(raw.shutdown_grace_ms),
        takeover_socket: raw.takeover_socket.clone(),
    })
}

/// `server.trusted_proxies` (networks) and `server.real_ip_header` (a header name).
fn resolve_real_ip(raw: &RawServer, err: &mut dyn FnMut(String, String)) -> RealIp {
    let mut trusted = Vec::new();
    for (i, s) in raw.trusted_proxies.iter().enumerate() {
        match limits::Cidr::parse(s) {
            Ok(c) => trusted.push(c),
            Err(m) => err(format!("server.trusted_proxies[{i}]"), m),
        }
    }
    let header = raw.real_ip_header.to_ascii_lowercase();
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if header.is_empty() || !header.bytes().all(token) {
        err(
            "server.real_ip_header".into(),
            format!("`{}` is not a header name", raw.real_ip_header),
        );
    }
    RealIp { trusted, header }
}

pub(super) fn resolve_http(raw: &RawHttp, err: &mut dyn FnMut(String, String)) -> HttpLimits {
    for (key, v, min) in [
        (
            "http.max_request_line_bytes",
            raw.max_request_line_bytes,
            64,
        ),
        ("http.max_header_bytes", raw.max_header_bytes, 256),
        ("http.max_headers", raw.max_headers, 8),
        ("http.max_body_bytes", raw.max_body_bytes, 1),
        (
            "http.max_translated_json_values",
            raw.max_translated_json_values,
            100,
        ),
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
        max_translated_json_values: raw.max_translated_json_values,
    }
}

pub(super) fn resolve_timeouts(raw: &RawTimeouts, err: &mut dyn FnMut(String, String)) -> Timeouts {
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
pub(super) fn resolve_upstream(
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

/// `[admin]`'s address; `None` when it is not one. `server_listen` is server.listen where it is
/// the one the file meant, which the admin listener must not share a port with.
pub(super) fn resolve_admin(
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
pub(super) fn resolve_admin_token(
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

pub(super) fn resolve_access_log(
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
pub(super) fn resolve_pricing(
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
pub(super) fn resolve_limits(
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

/// Keys that load but cannot be what was meant: one already expired (every request with it gets
/// 401), or one whose digest is a placeholder (a single repeated hex digit, like all zeros: the
/// SHA-256 of no key anyone holds).
fn key_warnings(keys: &[limits::ApiKey], now_unix: u64, warnings: &mut Vec<ConfigError>) {
    for (i, key) in keys.iter().enumerate() {
        if let Some(expires) = key.expires.filter(|&e| e <= now_unix) {
            let days = (expires / 86_400) as i64;
            let (y, m) = limits::civil_year_month(days);
            let d = days - limits::days_from_civil(y, m, 1) + 1;
            warnings.push(ConfigError::new(
                format!("keys[{i}].expires"),
                format!(
                    "key `{}` expired on {y:04}-{m:02}-{d:02}: every request with it gets 401",
                    key.id
                ),
            ));
        }
        let first = key.digest[0];
        if key.digest.iter().all(|&b| b == first) && (first >> 4) == (first & 0x0f) {
            warnings.push(ConfigError::new(
                format!("keys[{i}].sha256"),
                format!(
                    "key `{}` has a placeholder digest (one hex digit repeated): no key hashes to \
                     it; put the sha256 of `sluice key new` here",
                    key.id
                ),
            ));
        }
    }
}

/// Whether binding both addresses would fail (or, with SO_REUSEPORT, share one port): the same
/// port on the same address, or on a wildcard address that covers the other one — `0.0.0.0`
/// covers every IPv4 address and `[::]` (dual-stack, Linux's default) every address. Port 0 asks
/// for a free port, so it never clashes.
pub(super) fn listeners_clash(a: SocketAddr, b: SocketAddr) -> bool {
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
