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
    /// A certificate outside its validity dates is an error, not a warning.
    #[serde(default)]
    refuse_expired: bool,
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
    /// The earliest `notAfter` of its certificates (unix seconds; 0 when one could not be
    /// read), for `sluice_tls_certificate_expiry_timestamp_seconds`.
    pub(crate) earliest_expiry: u64,
}

impl fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsListener")
            .field("listen", &self.listen)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

/// Read `[tls]`: every certificate file loaded and checked against its key, and its dates
/// against `now_unix` (a certificate expired, not yet valid or expiring within
/// [`EXPIRY_WARNING_DAYS`] is a warning, or an error with `refuse_expired`). `None` when
/// something is wrong (each problem reported through `err`).
pub(super) fn resolve_tls(
    raw: &RawTls,
    now_unix: u64,
    err: &mut dyn FnMut(String, String),
    warnings: &mut Vec<super::ConfigError>,
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
    let mut earliest_expiry = u64::MAX;
    for (i, c) in raw.certificates.iter().enumerate() {
        let path = format!("tls.certificates[{i}]");
        match load_certified_key(c, &provider) {
            Ok(key) => {
                let dates = key.cert.first().and_then(|leaf| validity(leaf));
                earliest_expiry = earliest_expiry.min(dates.map_or(0, |(_, end)| end));
                match (dates_problem(dates, now_unix), raw.refuse_expired) {
                    (Some((message, true)), true) => err(path, message),
                    (Some((message, _)), _) => {
                        warnings.push(super::ConfigError::new(path, message));
                    }
                    (None, _) => {}
                }
                keys.push(Arc::new(key));
            }
            Err(message) => err(path, message),
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
        earliest_expiry,
    })
}

/// A certificate this close to its end is warned of at every load.
pub(crate) const EXPIRY_WARNING_DAYS: u64 = 14;

/// What is wrong with a certificate's dates at `now` (and whether `refuse_expired` makes it an
/// error: outside its dates, not merely close to the end); `None` when nothing is.
fn dates_problem(dates: Option<(u64, u64)>, now: u64) -> Option<(String, bool)> {
    let Some((not_before, not_after)) = dates else {
        return Some(("its validity dates could not be read".into(), false));
    };
    if now < not_before {
        return Some((format!("not valid until {}", utc(not_before)), true));
    }
    if now > not_after {
        return Some((format!("expired on {}", utc(not_after)), true));
    }
    let left = (not_after - now) / 86_400;
    (left < EXPIRY_WARNING_DAYS).then(|| {
        (
            format!("expires on {} (in {left} days)", utc(not_after)),
            false,
        )
    })
}

/// `2026-12-07T10:00:00Z`.
fn utc(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let (year, month) = super::limits::civil_year_month(days);
    let day = days - super::limits::days_from_civil(year, month, 1) + 1;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// A certificate's validity (`notBefore`, `notAfter`) in Unix seconds, read from its DER:
/// `Certificate` → `tbsCertificate` → past the version, serial, signature algorithm and issuer
/// → `validity`. `None` when the DER is not shaped so.
pub(crate) fn validity(der: &[u8]) -> Option<(u64, u64)> {
    let (cert, _) = der_tlv(der, 0x30)?;
    let (mut tbs, _) = der_tlv(cert, 0x30)?;
    if tbs.first() == Some(&0xa0) {
        tbs = der_tlv(tbs, 0xa0)?.1;
    }
    for tag in [0x02, 0x30, 0x30] {
        tbs = der_tlv(tbs, tag)?.1;
    }
    let (validity, _) = der_tlv(tbs, 0x30)?;
    let (not_before, rest) = der_time(validity)?;
    let (not_after, _) = der_time(rest)?;
    Some((not_before, not_after))
}

/// The contents of the DER element at the start of `der` if its tag is `tag`, and what follows
/// it.
fn der_tlv(der: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&t, rest) = der.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    if t != tag {
        return None;
    }
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |l, &b| (l << 8) | usize::from(b));
        rest = &rest[n..];
        len
    };
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// A UTCTime (`YYMMDDHHMMSSZ`, years 1950–2049) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) in
/// Unix seconds, and what follows it.
fn der_time(der: &[u8]) -> Option<(u64, &[u8])> {
    let (text, rest, year) = if let Some((t, rest)) = der_tlv(der, 0x17) {
        let yy = digits(t.get(..2)?)? as i64;
        (
            t.get(2..)?,
            rest,
            if yy < 50 { 2000 + yy } else { 1900 + yy },
        )
    } else {
        let (t, rest) = der_tlv(der, 0x18)?;
        (t.get(4..)?, rest, digits(t.get(..4)?)? as i64)
    };
    if text.len() != 11 || text[10] != b'Z' {
        return None;
    }
    let field = |i: usize| digits(&text[i..i + 2]);
    let (month, day) = (field(0)? as u32, field(2)? as i64);
    let (hour, minute, second) = (field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) {
        return None;
    }
    let days = super::limits::days_from_civil(year, month, 1) + day - 1;
    let unix = u64::try_from(days).ok()? * 86_400 + hour * 3600 + minute * 60 + second;
    Some((unix, rest))
}

/// ASCII digits as a number.
fn digits(s: &[u8]) -> Option<u64> {
    s.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
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
    let key = CertifiedKey::from_der(chain, key, provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => format!(
            "the key in `{}` is not the certificate's in `{}` (they were not made together: \
             check that the files are a pair)",
            c.key.display(),
            c.cert.display()
        ),
        e => format!("`{}` and `{}`: {e}", c.cert.display(), c.key.display()),
    })?;
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
