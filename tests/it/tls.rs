//! TLS termination (issue #13, point 4): a TLS listener beside the plain one, certificates chosen
//! by SNI, renewed certificates picked up by a reload, a clear answer to plain HTTP on the TLS
//! port, and a handshake timeout. The client is rustls over a plain socket, trusting the
//! certificates generated here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose};
use rustls_pki_types::{CertificateDer, ServerName};
use sluice_tests::*;

/// A self-signed certificate for `name`, written to `dir`; returns (cert path, key path, DER).
fn cert_for(dir: &TempDir, name: &str, tag: &str) -> (PathBuf, PathBuf, Vec<u8>) {
    cert_dated(dir, name, tag, None)
}

/// A day: (year, month, day).
type Ymd = (i32, u8, u8);

/// As [`cert_for`], valid from and until the given days when `dates` says.
fn cert_dated(
    dir: &TempDir,
    name: &str,
    tag: &str,
    dates: Option<(Ymd, Ymd)>,
) -> (PathBuf, PathBuf, Vec<u8>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
    if let Some(((y1, m1, d1), (y2, m2, d2))) = dates {
        params.not_before = rcgen::date_time_ymd(y1, m1, d1);
        params.not_after = rcgen::date_time_ymd(y2, m2, d2);
    }
    params.distinguished_name.push(DnType::CommonName, name);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key).unwrap();
    (
        dir.write(&format!("{tag}.pem"), cert.pem()),
        dir.write(&format!("{tag}.key"), key.serialize_pem()),
        cert.der().to_vec(),
    )
}

fn tls_config(certs: &[(&PathBuf, &PathBuf)]) -> String {
    let list: Vec<String> = certs
        .iter()
        .map(|(c, k)| {
            format!(
                "{{ cert = {}, key = {} }}",
                toml_str(c.to_str().unwrap()),
                toml_str(k.to_str().unwrap())
            )
        })
        .collect();
    format!(
        "[tls]\nlisten = \"127.0.0.1:0\"\nhandshake_timeout_ms = 500\ncertificates = [{}]\n",
        list.join(", ")
    )
}

type TlsClient = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A TLS client connection to `addr` asking for `sni`, trusting `roots` (the handshake runs on
/// the first write).
fn tls_client(addr: SocketAddr, sni: &str, roots: &[&[u8]]) -> TlsClient {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(CertificateDer::from(r.to_vec())).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store)
        .with_no_client_auth();
    let name = ServerName::try_from(sni.to_string()).unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    rustls::StreamOwned::new(conn, sock)
}

/// One request over TLS to `addr`, asking for `sni`, trusting `roots`; returns the raw response
/// (read to the end: the request says `Connection: close`) and the certificate the server sent.
fn over_tls(addr: SocketAddr, sni: &str, roots: &[&[u8]], req: &Req) -> (String, Vec<u8>) {
    let mut tls = tls_client(addr, sni, roots);
    let req = req.clone().header("Connection", "close");
    tls.write_all(&req.build())
        .expect("TLS handshake and write");
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out);
    let cert = tls
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    (String::from_utf8_lossy(&out).into_owned(), cert)
}

fn status_of(raw: &str) -> u16 {
    raw.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[test]
fn sni_picks_the_certificate_and_requests_and_streams_work_over_tls() {
    let dir = TempDir::new("tls");
    let (a_cert, a_key, a_der) = cert_for(&dir, "a.example", "a");
    let (b_cert, b_key, b_der) = cert_for(&dir, "b.example", "b");
    let mock = Mock::start(&["--tokens", "5"]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock).raw(&tls_config(&[(&a_cert, &a_key), (&b_cert, &b_key)])),
    );
    let tls = gw.tls_addr();
    let roots: [&[u8]; 2] = [&a_der, &b_der];
    let chat = Req::post("/v1/chat/completions", &chat_body("gpt-4o"));
    let (raw, cert) = over_tls(tls, "b.example", &roots, &chat);
    assert_eq!(status_of(&raw), 200, "{raw}");
    assert_eq!(cert, b_der, "SNI b.example gets b's certificate");
    let (raw, cert) = over_tls(tls, "a.example", &roots, &chat);
    assert_eq!(status_of(&raw), 200, "{raw}");
    assert_eq!(cert, a_der, "SNI a.example gets a's certificate");
    // A stream, whole.
    let stream = Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"));
    let (raw, _) = over_tls(tls, "a.example", &roots, &stream);
    assert_eq!(status_of(&raw), 200, "{raw}");
    assert_eq!(raw.matches("\"content\"").count(), 5, "{raw}");
    assert!(raw.contains("data: [DONE]"), "{raw}");
    // The plain listener still serves, side by side.
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
}

#[test]
fn plain_http_on_the_tls_port_gets_a_clear_400() {
    let dir = TempDir::new("tls");
    let (cert, key, _) = cert_for(&dir, "a.example", "a");
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).raw(&tls_config(&[(&cert, &key)])));
    let mut c = Conn::open(gw.tls_addr());
    c.send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build());
    let r = c.read_response_to("POST");
    assert_eq!(r.status, 400, "{}", r.dump());
    assert!(r.text().contains("speaks TLS"), "{}", r.text());
    c.assert_closed(Duration::from_secs(5));
}

#[test]
fn a_stalled_handshake_is_closed_at_the_timeout() {
    let dir = TempDir::new("tls");
    let (cert, key, _) = cert_for(&dir, "a.example", "a");
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).raw(&tls_config(&[(&cert, &key)])));
    // Silent, then the first byte of a handshake record and nothing more.
    for first in [None, Some(0x16u8)] {
        let mut c = Conn::open(gw.tls_addr());
        let started = Instant::now();
        if let Some(b) = first {
            c.send(&[b]);
        }
        c.assert_closed(Duration::from_secs(5));
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_secs(3),
            "closed after {took:?} (handshake_timeout_ms = 500)"
        );
    }
}

#[test]
fn a_reload_picks_up_a_renewed_certificate() {
    let dir = TempDir::new("tls");
    let (cert, key, old_der) = cert_for(&dir, "a.example", "a");
    let mock = Mock::start(&[]);
    let config = Config::one_cluster(&mock).raw(&tls_config(&[(&cert, &key)]));
    let gw = Sluice::start(&config);
    let chat = Req::post("/v1/chat/completions", &chat_body("gpt-4o"));
    let (_, seen) = over_tls(gw.tls_addr(), "a.example", &[&old_der], &chat);
    assert_eq!(seen, old_der);
    // Renewed in place (same paths, a new key and certificate), then SIGHUP.
    let renewed = TempDir::new("tls-renewed");
    let (new_cert, new_key, new_der) = cert_for(&renewed, "a.example", "a");
    std::fs::copy(&new_cert, &cert).unwrap();
    std::fs::copy(&new_key, &key).unwrap();
    gw.signal(libc::SIGHUP);
    let applied = wait_until(Duration::from_secs(10), || {
        gw.stderr_text().contains("sluice: reload applied")
    });
    assert!(applied, "{}", gw.stderr_text());
    let (raw, seen) = over_tls(gw.tls_addr(), "a.example", &[&new_der], &chat);
    assert_eq!(status_of(&raw), 200, "{raw}");
    assert_eq!(
        seen, new_der,
        "the renewed certificate serves new handshakes"
    );
}

#[test]
fn bad_certificate_files_are_config_errors() {
    let dir = TempDir::new("tls");
    let (a_cert, _a_key, _) = cert_for(&dir, "a.example", "a");
    let (_b_cert, b_key, _) = cert_for(&dir, "b.example", "b");
    let mock = Mock::start(&[]);
    let missing = dir.path().join("missing.pem");
    for (certs, expect) in [
        (vec![(&missing, &b_key)], "cannot read"),
        (vec![(&a_cert, &b_key)], "tls.certificates[0]"),
        // Said plainly, not as rustls's `KeyMismatch`.
        (vec![(&a_cert, &b_key)], "is not the certificate's"),
    ] {
        let out = Sluice::check(&Config::one_cluster(&mock).raw(&tls_config(&certs)));
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{text}");
        assert!(text.contains(expect), "{expect}: {text}");
    }
}

#[test]
fn a_tls_client_too_slow_with_its_head_gets_408_and_the_server_carries_on() {
    let dir = TempDir::new("tls");
    let (cert, key, der) = cert_for(&dir, "a.example", "a");
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .timeout("header_read_ms", 300)
            .raw(&tls_config(&[(&cert, &key)])),
    );
    // Half a head over TLS, then silence: the session's read is cut by the head timeout.
    let mut tls = tls_client(gw.tls_addr(), "a.example", &[&der]);
    tls.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n")
        .unwrap();
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    assert_eq!(status_of(&text), 408, "{text}");
    // The process is fine and serves the next TLS client.
    let chat = Req::post("/v1/chat/completions", &chat_body("gpt-4o"));
    let (raw, _) = over_tls(gw.tls_addr(), "a.example", &[&der], &chat);
    assert_eq!(status_of(&raw), 200, "{raw}");
}

#[test]
fn a_tls_client_that_leaves_cancels_its_upstream_request() {
    let dir = TempDir::new("tls");
    let (cert, key, der) = cert_for(&dir, "a.example", "a");
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).raw(&tls_config(&[(&cert, &key)])));
    let mut tls = tls_client(gw.tls_addr(), "a.example", &[&der]);
    // A stream whose events come 5 s apart: only the client watch can see it leave sooner.
    let req = Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
        .header("x-mock-inter-token-ms", "5000")
        .header("x-mock-tokens", "4");
    tls.write_all(&req.build()).unwrap();
    let mut first = [0u8; 64];
    let _ = tls.read(&mut first).unwrap();
    assert!(wait_until(Duration::from_secs(5), || mock
        .stat("active_requests")
        == 1));
    // The client leaves the way TLS clients do: close_notify, then FIN.
    tls.conn.send_close_notify();
    tls.flush().unwrap();
    let _ = tls.sock.shutdown(std::net::Shutdown::Both);
    drop(tls);
    let started = Instant::now();
    assert!(
        wait_until(Duration::from_secs(10), || mock.stat("active_requests")
            == 0),
        "the upstream request outlived its client"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "seen only after {:?}: at the next event's write, not by the watch",
        started.elapsed()
    );
}

#[test]
fn the_affinity_cookie_is_secure_over_tls_and_only_there() {
    let dir = TempDir::new("tls-cookie");
    let (cert, key, der) = cert_for(&dir, "a.example", "a");
    let mock = Mock::start(&[]);
    let config = Config::new()
        .env("STICKY_KEY", &"ab".repeat(32))
        .raw(&format!(
            "[clusters.pool]\nbackends = [{{ base_url = {} }}]\n\
         [[routes]]\nmodel = \"gpt-4o\"\ncluster = \"pool\"\n\
         sticky = {{ cookie = \"aff\", ttl_secs = 60 }}\n\
         [sticky]\nkeys = [{{ id = 1, env = \"STICKY_KEY\" }}]\n{}",
            toml_str(&mock.base_url()),
            tls_config(&[(&cert, &key)])
        ));
    let gw = Sluice::start(&config);
    let chat = Req::post("/v1/chat/completions", &chat_body("gpt-4o"));
    let (raw, _) = over_tls(gw.tls_addr(), "a.example", &[&der], &chat);
    assert_eq!(status_of(&raw), 200, "{raw}");
    let line = raw
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .unwrap_or_else(|| panic!("no cookie over TLS: {raw}"));
    assert!(
        line.contains("; Secure") && line.contains("HttpOnly") && line.contains("SameSite=Lax"),
        "{line}"
    );
    let r = gw.request(&chat);
    let plain = r.header("set-cookie").expect("a cookie over plain HTTP");
    assert!(!plain.contains("Secure"), "{plain}");
}

#[test]
fn a_certificate_outside_its_dates_is_warned_of_or_refused() {
    let dir = TempDir::new("tls-dates");
    let (old_cert, old_key, _) =
        cert_dated(&dir, "a.example", "old", Some(((2020, 1, 1), (2021, 1, 1))));
    let (new_cert, new_key, _) =
        cert_dated(&dir, "a.example", "new", Some(((2090, 1, 1), (2091, 1, 1))));
    let (good_cert, good_key, _) = cert_for(&dir, "a.example", "good");
    let mock = Mock::start(&[]);
    let config = |cert: &PathBuf, key: &PathBuf, refuse: bool| {
        let mut tls = tls_config(&[(cert, key)]);
        if refuse {
            tls.push_str("refuse_expired = true\n");
        }
        Config::one_cluster(&mock).raw(&tls)
    };
    // Warned of at check (exit 0) and served; refused when the operator asks.
    let out = Sluice::check(&config(&old_cert, &old_key, false));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("tls.certificates[0]")
            && stderr.contains("expired on 2021-01-01T00:00:00Z"),
        "{stderr}"
    );
    let out = Sluice::check(&config(&new_cert, &new_key, false));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("not valid until 2090-01-01T00:00:00Z"),
        "{stderr}"
    );
    for (cert, key) in [(&old_cert, &old_key), (&new_cert, &new_key)] {
        let out = Sluice::check(&config(cert, key, true));
        assert!(
            !out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(Sluice::try_start(&config(cert, key, true)).is_err());
    }
    // Served, with its end on /metrics for the alert rule (SluiceTLSCertificateExpiresSoon).
    let gw = Sluice::start(&config(&old_cert, &old_key, false).admin());
    assert!(gw.tls_addr().port() > 0);
    let expiry = "sluice_tls_certificate_expiry_timestamp_seconds";
    assert_eq!(
        gw.metrics().get(expiry, &[]),
        Some(1_609_459_200.0),
        "2021-01-01"
    );
    drop(gw);
    let gw = Sluice::start(&Config::one_cluster(&mock).admin());
    assert_eq!(gw.metrics().get(expiry, &[]), Some(0.0), "no TLS listener");
    // A certificate well within its dates: not a word.
    let out = Sluice::check(&config(&good_cert, &good_key, true));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("tls.certificates"),
        "{stderr}"
    );
}
