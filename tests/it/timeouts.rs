//! A timeout on every wait (issue point 3): header read, body read, keep-alive idle, upstream
//! connect, upstream first byte, stream idle. Each is configured small and must fire no earlier
//! than configured and well before a generous bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_tests::*;

const T: u64 = 300;
const UPPER: Duration = Duration::from_millis(2500);

fn assert_window(elapsed: Duration, what: &str) {
    assert!(
        elapsed >= Duration::from_millis(T),
        "{what} fired after {elapsed:?}, before the configured {T} ms"
    );
    assert!(
        elapsed < UPPER,
        "{what} fired after {elapsed:?}, configured {T} ms"
    );
}

#[test]
fn header_read_timeout_half_head_is_408_and_close() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("header_read_ms", T));
    let mut c = gw.conn();
    let start = Instant::now();
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\r\nContent-Ty");
    let resp = c.read_response();
    let elapsed = start.elapsed();
    assert_openai_error(&resp, 408);
    assert_window(elapsed, "header read timeout");
    c.assert_closed(Duration::from_secs(2));
}

#[test]
fn header_read_timeout_slowloris_trickle_is_408_and_close() {
    // The head keeps arriving, one byte every 40 ms, but never completes: the timeout covers
    // the whole head, not the gap between reads.
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("header_read_ms", T));
    let mut c = gw.conn();
    let mut writer = c.try_clone_stream();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let start = Instant::now();
    let t = std::thread::spawn(move || {
        let mut head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\r\n".to_vec();
        head.extend(std::iter::repeat_n(b'a', 4096));
        for b in head {
            if stop2.load(Ordering::Relaxed) || writer.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(40));
        }
    });
    let resp = c.read_response();
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    assert_openai_error(&resp, 408);
    assert_window(elapsed, "slowloris header timeout");
    c.assert_closed(Duration::from_secs(2));
    t.join().unwrap();
}

#[test]
fn body_read_timeout_is_408_and_close() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("body_read_ms", T));
    let mut c = gw.conn();
    c.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",
    );
    let start = Instant::now();
    c.send(b"{\"model\":");
    let resp = c.read_response();
    let elapsed = start.elapsed();
    assert_openai_error(&resp, 408);
    assert_window(elapsed, "body read timeout");
    c.assert_closed(Duration::from_secs(2));
}

#[test]
fn keepalive_idle_timeout_closes_connection() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("keepalive_idle_ms", T));
    let mut c = gw.conn();
    c.send(&Req::get("/v1/models").build());
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert!(!r.header_has_token("connection", "close"), "{}", r.dump());
    let idle_from = r.head_at;
    let st = c.wait_close(Duration::from_secs(5));
    let elapsed = idle_from.elapsed();
    assert!(
        st.is_closed(),
        "idle keep-alive connection not closed: {st:?}"
    );
    // The server's idle clock starts when it finished writing, a little before our head_at.
    assert!(
        elapsed >= Duration::from_millis(T - 30),
        "idle connection closed after {elapsed:?}, configured {T} ms"
    );
    assert!(
        elapsed < UPPER,
        "idle connection closed only after {elapsed:?}"
    );
}

#[test]
fn keepalive_connection_survives_shorter_idle() {
    // Control for the test above: a gap well under keepalive_idle_ms keeps the connection.
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("keepalive_idle_ms", 3000));
    let mut c = gw.conn();
    c.send(&Req::get("/v1/models").build());
    assert_eq!(c.read_response().status, 200);
    assert_eq!(c.wait_close(Duration::from_millis(500)), CloseState::Open);
    c.send(&Req::get("/v1/models").build());
    assert_eq!(c.read_response().status, 200);
}

#[test]
fn upstream_connect_timeout_is_504() {
    // Loopback TCP connects never hang, so the blackhole is a TLS backend whose TCP handshake
    // completes (kernel backlog) but which never answers the TLS ClientHello. The connect
    // timeout covers TCP + TLS.
    let blackhole = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = blackhole.local_addr().unwrap().port();
    let gw = Sluice::start(
        &Config::backend_url(&format!("https://127.0.0.1:{port}/v1"))
            .timeout("upstream_connect_ms", T)
            .timeout("upstream_first_byte_ms", 20_000),
    );
    let start = Instant::now();
    let resp = gw.chat(&chat_body("gpt-4o"));
    let elapsed = start.elapsed();
    assert_openai_error(&resp, 504);
    assert_window(elapsed, "upstream connect timeout");
    drop(blackhole);
}

#[test]
fn upstream_first_byte_timeout_is_504() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("upstream_first_byte_ms", T));
    let start = Instant::now();
    let resp = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-delay-ms", "5000"),
    );
    let elapsed = start.elapsed();
    assert_openai_error(&resp, 504);
    assert_window(elapsed, "upstream first-byte timeout");
}

#[test]
fn upstream_first_byte_timeout_not_hit_by_a_quicker_answer() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("upstream_first_byte_ms", 1500));
    let resp = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-delay-ms", "200"),
    );
    assert_eq!(resp.status, 200, "{}", resp.dump());
}

#[test]
fn stream_idle_timeout_cuts_stream_with_error_event() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).timeout("stream_idle_ms", T));
    // First content right away, then the next token only after 3 s: the gap must cut the stream.
    let req = Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
        .header("x-mock-ttft-ms", "0")
        .header("x-mock-inter-token-ms", "3000")
        .header("x-mock-tokens", "5");
    let mut c = gw.conn();
    let start = Instant::now();
    c.send(&req.build());
    let resp = c.read_response();
    let total = start.elapsed();
    assert_eq!(resp.status, 200, "{}", resp.dump());
    assert!(
        resp.header("content-type")
            .unwrap_or("")
            .contains("text/event-stream"),
        "{}",
        resp.dump()
    );
    assert!(
        matches!(
            resp.end,
            BodyEnd::Complete | BodyEnd::Truncated | BodyEnd::Reset
        ),
        "stream did not end (read timed out?): {:?}",
        resp.end
    );
    let events = resp.sse_events();
    let contents: Vec<&SseEvent> = events.iter().filter(|e| e.content().is_some()).collect();
    assert_eq!(
        contents.len(),
        1,
        "expected exactly one token before the cut: {events:?}"
    );
    let err = events
        .iter()
        .find(|e| e.is_error())
        .unwrap_or_else(|| panic!("no SSE error event after the idle cut:\n{}", resp.dump()));
    assert_error_value(&err.json().unwrap()).unwrap();
    assert!(
        !events.iter().any(SseEvent::is_done),
        "a cut stream must not end with [DONE]"
    );
    let gap = err.at.duration_since(contents[0].at);
    assert!(
        gap >= Duration::from_millis(T - 20),
        "stream cut {gap:?} after the last token, configured {T} ms"
    );
    assert!(
        total < Duration::from_millis(2500),
        "stream ended only after {total:?}"
    );
}
