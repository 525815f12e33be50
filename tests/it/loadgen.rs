//! `sluice-load` black-box: runs the real binary for about a second against `mock-llm` directly
//! (closed loop, open loop at a fixed rate, streaming, error accounting) and checks the summary
//! and the `--json` output.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use sluice_tests::*;

/// Run `sluice-load` (the engine `SLUICE_LOAD_ENGINE` names, if set) with `args`; returns
/// (stdout, parsed JSON).
fn load(url: &str, args: &[&str]) -> (String, Value) {
    let (stdout, _, v) = run_sluice_load(url, args, LoadEngine::FromEnv);
    (stdout, v)
}

fn assert_hist(v: &Value, name: &str) {
    let h = &v[name];
    assert!(h["count"].as_u64().unwrap() > 0, "{name}: {h}");
    for q in ["p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms"] {
        assert!(h[q].as_f64().unwrap() > 0.0, "{name}.{q}: {h}");
    }
    assert!(h["p50_ms"].as_f64() <= h["p99_ms"].as_f64(), "{name}: {h}");
    assert!(h["p99_ms"].as_f64() <= h["max_ms"].as_f64(), "{name}: {h}");
    // hdrhistogram V2 serialization, base64: starts with the V2 cookie 0x1c849313 ("HISTEw").
    let b64 = h["hdr_v2_base64"].as_str().unwrap();
    assert!(b64.starts_with("HISTEw"), "{name}: {b64}");
    assert_eq!(b64.len() % 4, 0);
}

fn zero_errors(v: &Value) {
    assert_eq!(v["errors_total"], 0, "{v}");
    for k in [
        "connect",
        "status_3xx",
        "status_4xx",
        "status_5xx",
        "timeout",
        "protocol",
        "io",
    ] {
        assert_eq!(v["errors"][k], 0, "{k}: {v}");
    }
}

#[test]
fn closed_loop() {
    let mock = Mock::start(&[]);
    let (stdout, v) = load(
        &mock.chat_url(),
        &[
            "--connections",
            "4",
            "--duration",
            "1s",
            "--warmup",
            "200ms",
            "--body-bytes",
            "2048",
            "--models",
            "a,b,c",
            "--keys",
            "k1,k2",
        ],
    );
    assert_eq!(v["mode"], "closed");
    assert_eq!(v["connections"], 4);
    let ok = v["ok"].as_u64().unwrap();
    assert!(ok >= 50, "only {ok} requests in 1 s: {stdout}");
    assert_eq!(v["statuses"]["200"], ok);
    assert!(v["rps"].as_f64().unwrap() > 0.0);
    zero_errors(&v);
    assert_hist(&v, "latency");
    assert_eq!(v["latency"]["count"], ok);
    assert!(v.get("event_gap").is_none(), "{v}");
    assert!(
        stdout.contains("req/s") && stdout.contains("p99.9"),
        "{stdout}"
    );
    // Keep-alive: 4 connections (plus the stats probe) for every request, warmup included.
    assert!(mock.stat("connections_accepted") <= 5, "{}", mock.stats());
    assert!(mock.stat("requests") >= ok);
}

#[test]
fn open_loop_rate() {
    let mock = Mock::start(&[]);
    let (stdout, v) = load(
        &mock.chat_url(),
        &["--connections", "4", "--duration", "1s", "--rate", "200"],
    );
    assert_eq!(v["mode"], "open");
    let n = v["requests"].as_u64().unwrap();
    assert!(
        (170..=230).contains(&n),
        "{n} requests at 200/s for 1 s: {stdout}"
    );
    zero_errors(&v);
    assert_hist(&v, "latency");
}

#[test]
fn open_loop_counts_stalls_from_intended_time() {
    // Each stream takes >= 100 ms (TTFT) on one connection, but 20 req/s are scheduled: the
    // connection falls behind, and latency measured from the intended send times grows with
    // the lag instead of staying at 100 ms (no coordinated omission).
    let mock = Mock::start(&["--ttft-ms", "100", "--tokens", "1"]);
    let (stdout, v) = load(
        &mock.chat_url(),
        &[
            "--connections",
            "1",
            "--duration",
            "500ms",
            "--rate",
            "20",
            "--stream",
        ],
    );
    assert_eq!(v["ok"], 10, "{stdout}");
    let min = v["latency"]["min_ms"].as_f64().unwrap();
    let max = v["latency"]["max_ms"].as_f64().unwrap();
    assert!(min >= 95.0, "min latency {min} ms: {stdout}");
    assert!(
        max > 400.0,
        "max latency {max} ms should include the schedule lag: {stdout}"
    );
}

#[test]
fn streaming_events() {
    let mock = Mock::start(&["--inter-token-ms", "20", "--tokens", "10"]);
    let (stdout, v) = load(
        &mock.chat_url(),
        &["--connections", "2", "--duration", "1s", "--stream"],
    );
    assert_eq!(v["stream"], true);
    zero_errors(&v);
    let ok = v["ok"].as_u64().unwrap();
    assert!(ok >= 4, "{stdout}");
    for h in ["latency", "ttfb", "first_event", "event_gap"] {
        assert_hist(&v, h);
    }
    let p50 = v["event_gap"]["p50_ms"].as_f64().unwrap();
    assert!((15.0..=60.0).contains(&p50), "gap p50 {p50} ms: {stdout}");
    assert_eq!(v["content_events"], ok * 10, "{stdout}");
    // Events 20 ms apart arrive in reads of their own, unless the client was descheduled that
    // long (a busy machine: CI runs this beside builds); a few may share a read then, never
    // most.
    let (coalesced, content) = (v["coalesced_events"].as_u64().unwrap(), ok * 10);
    assert!(
        coalesced * 10 <= content,
        "more than 1 in 10 coalesced: {stdout}"
    );
    // 10 content events 20 ms apart: about 180 ms per stream.
    assert!(
        v["latency"]["p50_ms"].as_f64().unwrap() >= 170.0,
        "{stdout}"
    );
    assert!(
        stdout.contains("event gap") && stdout.contains("coalesced"),
        "{stdout}"
    );
}

#[test]
fn errors_by_kind() {
    let mock = Mock::start(&["--fault", "status=429"]);
    let (_, v) = load(
        &mock.chat_url(),
        &["--connections", "2", "--duration", "300ms"],
    );
    assert_eq!(v["ok"], 0, "{v}");
    let n = v["errors"]["status_4xx"].as_u64().unwrap();
    assert!(n > 0 && v["errors_total"] == n, "{v}");
    assert_eq!(v["statuses"]["429"], n);

    // A 3xx (sluice-load follows no redirects) is an error of its own kind, not a 4xx.
    let mock = Mock::start(&[]);
    let (_, v) = load(
        &mock.chat_url(),
        &[
            "--connections",
            "1",
            "--duration",
            "300ms",
            "--header",
            "x-mock-status: 307",
        ],
    );
    let n = v["errors"]["status_3xx"].as_u64().unwrap();
    assert!(n > 0 && v["errors_total"] == n, "{v}");
    assert_eq!(v["errors"]["status_4xx"], 0, "{v}");
    assert_eq!(v["statuses"]["307"], n);

    let mock = Mock::start(&["--fault", "status=503"]);
    let (_, v) = load(
        &mock.chat_url(),
        &["--connections", "1", "--duration", "300ms"],
    );
    assert!(v["errors"]["status_5xx"].as_u64().unwrap() > 0, "{v}");

    let url = format!("http://127.0.0.1:{}/v1/chat/completions", dead_port());
    let (_, v) = load(&url, &["--connections", "1", "--duration", "300ms"]);
    assert!(v["errors"]["connect"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["ok"], 0);

    let mock = Mock::start(&["--fault", "malformed-chunk"]);
    let (_, v) = load(
        &mock.chat_url(),
        &["--connections", "1", "--duration", "300ms", "--stream"],
    );
    assert!(v["errors"]["protocol"].as_u64().unwrap() > 0, "{v}");
}

/// A one-connection fake server: records (authorization, model, body length) of every request
/// and answers them alternately with a Content-Length body and a chunked body that carries
/// chunk extensions and a trailer.
#[test]
fn rotation_body_size_and_framing() {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        let mut w = sock.try_clone().unwrap();
        let mut r = BufReader::new(sock);
        let mut seen = Vec::new();
        loop {
            let mut len = 0usize;
            let mut auth = String::new();
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            assert!(
                line.starts_with("POST /v1/chat/completions HTTP/1.1"),
                "{line}"
            );
            loop {
                line.clear();
                r.read_line(&mut line).unwrap();
                if line == "\r\n" {
                    break;
                }
                let (name, value) = line.split_once(':').unwrap();
                let value = value.trim().to_string();
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => len = value.parse().unwrap(),
                    "authorization" => auth = value,
                    _ => {}
                }
            }
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            let v: Value = serde_json::from_slice(&body).expect("valid JSON body");
            assert_eq!(v["stream"], false);
            seen.push((auth, v["model"].as_str().unwrap().to_string(), len));
            let resp: &[u8] = if seen.len() % 2 == 1 {
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
            } else {
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;ext=1\r\n{\r\n1\r\n}\r\n0\r\nx-trailer: 1\r\n\r\n"
            };
            if w.write_all(resp).is_err() {
                break;
            }
        }
        seen
    });
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let (_, v) = load(
        &url,
        &[
            "--connections",
            "1",
            "--duration",
            "300ms",
            "--models",
            "a,b,c",
            "--keys",
            "k1,k2",
            "--body-bytes",
            "500",
        ],
    );
    zero_errors(&v);
    let seen = server.join().unwrap();
    assert!(seen.len() >= 12, "{}", seen.len());
    assert_eq!(v["ok"].as_u64().unwrap(), seen.len() as u64);
    for (i, (auth, model, len)) in seen.iter().enumerate() {
        assert_eq!(*len, 500);
        assert_eq!(model, ["a", "b", "c"][i % 3]);
        assert_eq!(auth, ["Bearer k1", "Bearer k2"][i % 2]);
    }
}
