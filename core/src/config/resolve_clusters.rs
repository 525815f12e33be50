//! Clusters resolved: backends (base URLs parsed, names resolved once), credentials, TLS, the
//! cluster table routes are checked against.

use crate::http::pass::HeaderPass;
use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use super::raw::{RawBackend, RawCluster, RawCredential, KNOWN_CREDENTIAL_HEADERS};
use super::reader::key_segment;
use super::snapshot::{Backend, BackendId, Cluster, ClusterId, Credential};
use super::{dialect, limits, routing, ConfigError};

/// The clusters, each backend numbered across all of them (a [`BackendId`]).
pub(super) struct ClusterTable {
    /// Indexed by [`ClusterId`].
    pub(super) clusters: Vec<Cluster>,
    /// Every cluster named in the file; `None` for one that could not be read (it exists, and
    /// its own error says what is wrong with it).
    pub(super) by_name: BTreeMap<String, Option<ClusterId>>,
    pub(super) backend_count: usize,
}

pub(super) fn resolve_clusters(
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
pub(super) fn resolve_cluster(
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
    let pass_response_headers = HeaderPass::from_entries(&rc.pass_response_headers)
        .map_err(|msg| err(format!("{path}.pass_response_headers"), msg))
        .unwrap_or_default();
    Cluster {
        name: name.to_string(),
        backends,
        model_map: rc.model_map.clone(),
        credentials,
        tls,
        queue_metrics: rc.queue_metrics,
        pass_response_headers,
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
pub(super) fn resolve_backend(
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
pub(super) fn resolve_credential(
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

pub(super) struct BaseUrl {
    tls: bool,
    host: String,
    host_for_header: String,
    port: u16,
    path: String,
}

pub(super) fn parse_base_url(url: &str) -> Result<BaseUrl, String> {
    // Every message names the URL without a password it may carry: config errors reach the
    // terminal, the reload's 422 body and the log.
    let shown = redact_userinfo(url);
    let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else {
        return Err(format!("`{shown}` must start with http:// or https://"));
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.contains('@') {
        return Err(format!(
            "`{shown}` carries credentials in the URL: put the upstream's key in the cluster's `credential` (read from the environment) instead"
        ));
    }
    if authority.is_empty() {
        return Err(format!("`{shown}` has no valid host"));
    }
    if path.contains(['?', '#', ' ']) {
        return Err(format!(
            "`{shown}` must not carry a query, fragment or space"
        ));
    }
    let default_port = if tls { 443 } else { 80 };
    let (host, host_for_header, port) = if let Some(v6) = authority.strip_prefix('[') {
        let Some(end) = v6.find(']') else {
            return Err(format!("`{shown}` has an unterminated IPv6 address"));
        };
        let host = &v6[..end];
        let port = match &v6[end + 1..] {
            "" => default_port,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("`{shown}` has an invalid port"))?,
        };
        (host.to_string(), format!("[{host}]"), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => {
                let port = p
                    .parse()
                    .map_err(|_| format!("`{shown}` has an invalid port"))?;
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

/// `url` with whatever stands before an `@` in its authority (a user, a password) replaced by
/// `***`, for messages.
pub(super) fn redact_userinfo(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    match url[start..end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_string(),
    }
}

pub(super) fn build_tls(
    ca_file: Option<&std::path::Path>,
) -> Result<Arc<rustls::ClientConfig>, String> {
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
