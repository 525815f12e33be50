//! Keep-alive on both sides (issue point 3 / 12): several requests on one client connection,
//! carried over one upstream connection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

#[test]
fn five_requests_one_client_connection_one_upstream_connection() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).workers(1));
    let mut probe = mock.stats_probe();
    let before = probe.stat("connections_accepted");
    let mut c = gw.conn();
    for i in 0..5 {
        // Alternate plain and streamed answers: both framings must leave the connection usable.
        let stream = i % 2 == 1;
        let body = if stream {
            chat_stream_body("gpt-4o")
        } else {
            chat_body("gpt-4o")
        };
        c.send(&Req::post("/v1/chat/completions", &body).build());
        let r = c.read_response();
        assert_eq!(r.status, 200, "request {i}: {}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "request {i}");
        assert!(
            !r.header_has_token("connection", "close"),
            "request {i}: {}",
            r.dump()
        );
        if stream {
            let ev = r.sse_events();
            assert!(
                ev.last().is_some_and(SseEvent::is_done),
                "request {i}: {}",
                r.dump()
            );
        } else {
            assert_eq!(r.json()["object"], "chat.completion");
        }
    }
    let after = probe.stat("connections_accepted");
    assert_eq!(
        after - before,
        1,
        "sluice opened {} upstream connections for 5 sequential requests",
        after - before
    );
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .map("gpt-4o", "mock-small")
            .map("evil", "mock-evil"),
    );
    let mut c = gw.conn();
    let mut raw = Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build();
    raw.extend(Req::post("/v1/chat/completions", &chat_body("evil")).build());
    c.send(&raw);
    let r1 = c.read_response();
    let r2 = c.read_response();
    assert_eq!(r1.status, 200, "{}", r1.dump());
    assert_eq!(r2.status, 200, "{}", r2.dump());
    assert_eq!(r1.header("x-mock-model"), Some("mock-small"));
    assert_eq!(r2.header("x-mock-model"), Some("mock-evil"));
}

#[test]
fn connection_close_from_client_is_honoured() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("Connection", "close")
            .build(),
    );
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    c.assert_closed(std::time::Duration::from_secs(3));
}

#[test]
fn dead_pooled_upstream_connection_is_retried_on_a_fresh_one() {
    // The mock closes a keep-alive connection silently (FIN, no `Connection: close` before it)
    // after 100 ms idle; sluice's pool keeps connections far longer, so it still holds the
    // dead one when the second request comes. Without the one retry on a fresh connection,
    // that request would hit EOF (or a reset) on the dead socket and be answered 502.
    let mock = Mock::start(&["--idle-close-ms", "100", "--tokens", "2"]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .workers(1)
            .upstream("idle_timeout_ms", 60_000),
    );
    let r1 = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r1.status, 200, "{}", r1.dump());
    // Each `mock.stats()` is a fresh connection (a keep-alive probe would be idle-closed too),
    // counted in `connections_open` while it asks. Wait until only it is open: the mock has
    // closed sluice's pooled connection.
    let closed = wait_until(Duration::from_secs(5), || {
        let s = mock.stats();
        s["idle_closed"] == 1 && s["connections_open"] == 1
    });
    assert!(
        closed,
        "the mock did not idle-close sluice's upstream connection: {}",
        mock.stats()
    );
    let before = mock.stat("connections_accepted");
    let r2 = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(
        r2.status,
        200,
        "a dead pooled upstream connection was not retried on a fresh one:\n{}",
        r2.dump()
    );
    assert_eq!(r2.json()["object"], "chat.completion", "{}", r2.dump());
    let s = mock.stats();
    // One new upstream connection for request 2, plus the stats connection just opened.
    let accepted = s["connections_accepted"].as_u64().unwrap();
    assert_eq!(
        accepted - before,
        2,
        "expected exactly one fresh upstream connection for request 2: {s}"
    );
    // The dead connection never delivered a request: the mock saw each request once.
    assert_eq!(s["requests"], 2, "{s}");
}

/// A response far larger than one read (the mock echoes the ~300 KB request body) reaches the
/// client byte for byte, with its Content-Length framing, and the connection then serves the
/// next request: the relay hands whole reads of a Content-Length body to the client write
/// without copying, and must still count them, end the body on the last byte and meter usage.
#[test]
fn a_response_spanning_many_reads_arrives_intact_and_the_connection_is_reused() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).workers(1).admin());
    // Distinct lines, so a dropped, repeated or reordered read changes the text.
    let content: String = (0..12_000)
        .map(|i| format!("line {i:05} of the prompt; "))
        .collect();
    let body = serde_json::json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": content}],
    })
    .to_string();
    assert!(body.len() > 300_000, "{}", body.len());
    let mut c = gw.conn();
    let mut prompt_tokens = 0;
    for i in 0..2 {
        c.send(&Req::post("/v1/chat/completions", &body).build());
        let r = c.read_response();
        assert_eq!(r.status, 200, "request {i}: {}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "request {i}");
        let length: usize = r
            .header("content-length")
            .expect("a Content-Length response")
            .parse()
            .unwrap();
        assert_eq!(length, r.body.len(), "request {i}");
        assert!(r.body.len() > body.len(), "request {i}: {}", r.body.len());
        let json = r.json();
        assert_eq!(json["echo"]["body"], body.as_str(), "request {i}");
        assert_eq!(json["usage"]["completion_tokens"], 3, "request {i}");
        prompt_tokens += json["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    // The meter saw every byte: it settles the usage the response reports (an incomplete JSON
    // body would leave it estimating instead).
    let completion = |m: &Metrics| {
        m.get(
            "sluice_tokens_total",
            &[("model", "gpt-4o"), ("type", "completion")],
        )
    };
    let m = gw.wait_metrics(Duration::from_secs(5), |m| completion(m) == Some(6.0));
    assert_eq!(completion(&m), Some(6.0), "{}", m.text);
    assert_eq!(
        m.get(
            "sluice_tokens_total",
            &[("model", "gpt-4o"), ("type", "prompt")]
        ),
        Some(prompt_tokens as f64),
        "{}",
        m.text
    );
}
