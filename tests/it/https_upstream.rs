//! HTTPS upstreams (issue point 12): a CA and server certificate generated in the test; the
//! cluster trusts the CA through `ca_file`, and refuses the backend without it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use sluice_tests::*;

struct Pki {
    _dir: TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// A CA, and a server certificate it signs for `names` (DNS names or IP addresses).
fn pki(names: &[&str]) -> Pki {
    let dir = TempDir::new("pki");
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Sluice test CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key).unwrap();

    let key = KeyPair::generate().unwrap();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(names).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "mock-llm");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();

    Pki {
        ca: dir.write("ca.pem", ca.pem()),
        cert: dir.write("cert.pem", cert.pem()),
        key: dir.write("key.pem", key.serialize_pem()),
        _dir: dir,
    }
}

#[test]
fn https_backend_trusted_via_ca_file_by_name() {
    let pki = pki(&["localhost", "127.0.0.1"]);
    let mock = Mock::start_tls(&pki.cert, &pki.key, &["--tokens", "3"]);
    let base = format!("https://localhost:{}/v1", mock.port());
    let gw = Sluice::start(
        &Config::backend_url(&base)
            .map("gpt-4o", "mock-small")
            .ca_file(&pki.ca),
    );
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(echo_of(&r)["model"], "mock-small");
    // Streams work over TLS too.
    let s = gw.chat(&chat_stream_body("gpt-4o"));
    assert_eq!(s.status, 200, "{}", s.dump());
    let ev = s.sse_events();
    assert_eq!(
        ev.iter().filter(|e| e.content().is_some()).count(),
        3,
        "{}",
        s.dump()
    );
    assert!(ev.last().unwrap().is_done());
}

#[test]
fn https_backend_trusted_via_ca_file_by_ip() {
    let pki = pki(&["localhost", "127.0.0.1"]);
    let mock = Mock::start_tls(&pki.cert, &pki.key, &[]);
    let base = format!("https://127.0.0.1:{}/v1", mock.port());
    let gw = Sluice::start(&Config::backend_url(&base).ca_file(&pki.ca));
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(echo_of(&r)["path"], "/v1/chat/completions");
}

#[test]
fn https_backend_with_unknown_issuer_is_502() {
    let pki = pki(&["localhost", "127.0.0.1"]);
    let mock = Mock::start_tls(&pki.cert, &pki.key, &[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).admin());
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_openai_error(&r, 502);
    // Counted as a TLS failure of that backend, not as a refused connection.
    let errors = |m: &Metrics, kind: &str| -> f64 {
        m.matching("sluice_upstream_errors_total", &[("kind", kind)])
            .map(|s| s.value)
            .sum()
    };
    let m = gw.wait_metrics(Duration::from_secs(5), |m| errors(m, "tls") == 1.0);
    assert_eq!(errors(&m, "tls"), 1.0, "{}", m.text);
    assert_eq!(errors(&m, "connect"), 0.0, "{}", m.text);
}

#[test]
fn https_backend_with_wrong_name_is_502() {
    let pki = pki(&["not-this-host.test"]);
    let mock = Mock::start_tls(&pki.cert, &pki.key, &[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).ca_file(&pki.ca));
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_openai_error(&r, 502);
}
