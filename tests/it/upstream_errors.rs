//! Upstream failures seen by the client (issue point 12): a dead upstream is a fast 502 in
//! OpenAI's shape.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::*;

#[test]
fn dead_upstream_is_502_openai_shaped() {
    let port = dead_port();
    let gw = Sluice::start(&Config::backend_url(&format!("http://127.0.0.1:{port}/v1")));
    let start = Instant::now();
    let r = gw.chat(&chat_body("gpt-4o"));
    let err = assert_openai_error(&r, 502);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "connection refused took {:?} to report",
        start.elapsed()
    );
    eprintln!("dead upstream error: {err}");
    // The client connection stays usable after an upstream failure.
    let mut c = gw.conn();
    for _ in 0..2 {
        c.send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build());
        let r = c.read_response();
        assert_openai_error(&r, 502);
    }
}

#[test]
fn dead_upstream_stream_request_is_502_not_a_200_stream() {
    let port = dead_port();
    let gw = Sluice::start(&Config::backend_url(&format!("http://127.0.0.1:{port}/v1")));
    let r = gw.chat(&chat_stream_body("gpt-4o"));
    assert_openai_error(&r, 502);
}

#[test]
fn upstream_error_status_is_relayed_openai_shaped() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    for status in ["400", "401", "429", "500"] {
        let r = gw.request(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
                .header("x-mock-status", status),
        );
        assert!(r.status >= 400, "{}", r.dump());
        assert_openai_error(&r, r.status);
        if status == "429" {
            assert_eq!(r.status, 429);
            assert!(
                r.header("retry-after").is_some(),
                "429 lost Retry-After:\n{}",
                r.dump()
            );
        }
    }
}
