//! `[tls]`: the TLS listener beside the plain one — its address, its certificates (one chosen
//! per handshake by the name the client asks for, SNI) and the handshake timeout — resolved once
//! per snapshot into a rustls `ServerConfig`, so a reload picks up renewed certificates for the
//! handshakes that follow. TLS 1.2 and 1.3 only; ALPN offers `http/1.1` (room for `h2` later).

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    listen: String,
    #[serde(default = "default_handshake_timeout_ms")]
    handshake_timeout_ms: u64,
    /// At least one (checked when resolving, with the section's other errors).
    #[serde(default)]
    certificates: Vec<RawCertificate>,
}

fn default_handshake_timeout_ms() -> u64 {
    10_000
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawCertificate {
    /// PEM: the certificate, then its chain.
    cert: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    key: PathBuf,
}

/// The TLS listener of a snapshot.
#[derive(Clone)]
pub(crate) struct TlsListener {
    pub(crate) listen: SocketAddr,
    /// From accepting the connection to the end of the handshake.
    pub(crate) handshake_timeout: Duration,
    pub(crate) server_config: Arc<rustls::ServerConfig>,
}

impl fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsListener")
            .field("listen", &self.listen)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

/// Read `[tls]`: every certificate file loaded and checked against its key. `None` when
/// something is wrong (each problem reported through `err`).
pub(super) fn resolve_tls(
    raw: &RawTls,
    err: &mut dyn FnMut(String, String),
) -> Option<TlsListener> {
    let listen = match raw.listen.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(addr)) => Some(addr),
        _ => {
            err(
                "tls.listen".into(),
                format!("`{}` is not an address like 0.0.0.0:8443", raw.listen),
            );
            None
        }
    };
    if raw.handshake_timeout_ms == 0 {
        err(
            "tls.handshake_timeout_ms".into(),
            "must be at least 1 ms".into(),
        );
    }
    if raw.certificates.is_empty() {
        err(
            "tls.certificates".into(),
            "at least one certificate is required".into(),
        );
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut keys = Vec::with_capacity(raw.certificates.len());
    for (i, c) in raw.certificates.iter().enumerate() {
        match load_certified_key(c, &provider) {
            Ok(key) => keys.push(Arc::new(key)),
            Err(message) => err(format!("tls.certificates[{i}]"), message),
        }
    }
    if keys.len() != raw.certificates.len() || keys.is_empty() {
        return None;
    }
    let server_config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map(|b| {
            b.with_no_client_auth()
                .with_cert_resolver(Arc::new(BySni { keys }))
        });
    let mut server_config = match server_config {
        Ok(c) => c,
        Err(e) => {
            err("tls".into(), format!("TLS setup failed: {e}"));
            return None;
        }
    };
    server_config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Some(TlsListener {
        listen: listen?,
        handshake_timeout: Duration::from_millis(raw.handshake_timeout_ms),
        server_config: Arc::new(server_config),
    })
}

fn load_certified_key(
    c: &RawCertificate,
    provider: &rustls::crypto::CryptoProvider,
) -> Result<CertifiedKey, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&c.cert)
        .map_err(|e| format!("cannot read `{}`: {e}", c.cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad PEM in `{}`: {e}", c.cert.display()))?;
    let Some(leaf) = chain.first() else {
        return Err(format!("no certificate in `{}`", c.cert.display()));
    };
    webpki::EndEntityCert::try_from(leaf)
        .map_err(|e| format!("`{}` is not a usable certificate: {e}", c.cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(&c.key)
        .map_err(|e| format!("no private key read from `{}`: {e}", c.key.display()))?;
    let key = CertifiedKey::from_der(chain, key, provider)
        .map_err(|e| format!("`{}` and `{}`: {e}", c.cert.display(), c.key.display()))?;
    Ok(key)
}

/// Picks the certificate valid for the name the client asked for (its SNI), in config order;
/// the first one when it asked for none, or for a name none covers (the client's own name
/// check then decides).
#[derive(Debug)]
struct BySni {
    keys: Vec<Arc<CertifiedKey>>,
}

impl BySni {
    fn covers(key: &CertifiedKey, name: &ServerName<'_>) -> bool {
        key.end_entity_cert()
            .ok()
            .and_then(|leaf| webpki::EndEntityCert::try_from(leaf).ok())
            .is_some_and(|cert| cert.verify_is_valid_for_subject_name(name).is_ok())
    }
}

impl ResolvesServerCert for BySni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let wanted = hello
            .server_name()
            .and_then(|n| ServerName::try_from(n).ok());
        let chosen = wanted.and_then(|name| self.keys.iter().find(|k| Self::covers(k, &name)));
        chosen.or(self.keys.first()).cloned()
    }
}
