//! Streaming (issue points 3, 8, 12): events relayed as sent, client aborts cancel the upstream
//! without leaks, and odd upstream framing (close-delimited, chunk extensions, malformed or
//! dropped chunks) relayed correctly or cut cleanly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::*;

#[test]
fn sse_events_arrive_spaced_as_sent() {
    let mock = Mock::start(&["--inter-token-ms", "100", "--tokens", "5"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let r = gw.chat(&chat_stream_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete);
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let events = r.sse_events();
    let content: Vec<&SseEvent> = events.iter().filter(|e| e.content().is_some()).collect();
    assert_eq!(content.len(), 5, "{}", r.dump());
    for w in content.windows(2) {
        let gap = w[1].at.duration_since(w[0].at);
        assert!(
            gap >= Duration::from_millis(70),
            "events coalesced: {gap:?} between {:?} and {:?}",
            w[0].data,
            w[1].data
        );
    }
    let end = r.pieces.last().unwrap().at;
    assert!(
        end.duration_since(content[0].at) >= Duration::from_millis(300),
        "the first event arrived only {:?} before the end of the stream",
        end.duration_since(content[0].at)
    );
    assert!(events.last().unwrap().is_done());
    // The first event reached the client long before the stream ended: relayed, not buffered.
    assert!(content[0].at.duration_since(r.head_at) < Duration::from_millis(100));
}

#[test]
fn responses_api_stream_is_relayed_without_done() {
    let mock = Mock::start(&["--inter-token-ms", "100", "--tokens", "4"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let body = json!({"model":"gpt-4o","input":"hi","stream":true}).to_string();
    let r = gw.post("/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete);
    let events = r.sse_events();
    let deltas: Vec<&SseEvent> = events.iter().filter(|e| e.content().is_some()).collect();
    assert_eq!(deltas.len(), 4, "{}", r.dump());
    // Relayed as sent (300 ms from the first delta to the last), not held back and sent
    // together. The span, not each gap: one event a scheduling hiccup late on a busy machine
    // shortens the gap after it, never the whole span by that much.
    let span = deltas[3].at.duration_since(deltas[0].at);
    assert!(
        span >= Duration::from_millis(200),
        "deltas coalesced: {span:?}"
    );
    let last = events.last().unwrap().json().unwrap();
    assert_eq!(last["type"], "response.completed", "{last}");
    assert!(!events.iter().any(SseEvent::is_done));
}

#[test]
fn client_abort_mid_stream_cancels_upstream_and_leaks_nothing() {
    let mock = Mock::start(&["--inter-token-ms", "50", "--tokens", "100"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    // Let the workers settle, then take the baseline fd count.
    assert_eq!(gw.get("/v1/models").status, 200);
    let baseline = gw.fd_count();
    let mut c = gw.conn();
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
    let head = c.read_head().expect("stream head");
    assert_eq!(head.status, 200);
    c.read_until_content_events(2);
    assert_eq!(mock.stat("active_streams"), 1);
    drop(c);
    let ok = wait_until(Duration::from_secs(2), || {
        let s = mock.stats();
        s["active_streams"] == 0 && s["streams_aborted"] == 1
    });
    assert!(
        ok,
        "upstream stream not cancelled within 2 s: {}",
        mock.stats()
    );
    let fds_back = wait_until(Duration::from_secs(2), || gw.fd_count() <= baseline);
    assert!(
        fds_back,
        "sluice holds {} fds, {} before the aborted stream (leaked connection)",
        gw.fd_count(),
        baseline
    );
    assert_eq!(mock.stat("streams_completed"), 0);
    // And it still serves.
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
}

/// The client leaves while the upstream is silent between events: only the relay's watch on
/// the client can notice (no write fails, as none is due), and it must — within the silence,
/// not at the next event. The watch is armed only once a read has waited a while (so a stream's
/// quick events arm none): it must still be armed for a long silence.
#[test]
fn a_client_leaving_a_silent_stream_cancels_it_before_the_next_event() {
    let mock = Mock::start(&["--inter-token-ms", "3000", "--tokens", "5"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    assert_eq!(gw.get("/v1/models").status, 200);
    let baseline = gw.fd_count();
    let mut c = gw.conn();
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
    assert_eq!(c.read_head().expect("stream head").status, 200);
    // The first content event comes at once; the next one 3 s later.
    let deadline = Instant::now() + Duration::from_secs(5);
    while parse_sse(&[Piece {
        at: Instant::now(),
        data: c.buffered().to_vec(),
    }])
    .iter()
    .all(|e| e.content().is_none())
    {
        assert!(Instant::now() < deadline, "no first token");
        assert!(
            c.read_more().expect("read stream") > 0,
            "stream ended early"
        );
    }
    let left_at = Instant::now();
    drop(c);
    let cancelled = wait_until(Duration::from_secs(2), || mock.stat("streams_aborted") == 1);
    assert!(
        cancelled && left_at.elapsed() < Duration::from_millis(2500),
        "upstream not cancelled during the silence: {}",
        mock.stats()
    );
    assert!(
        wait_until(Duration::from_secs(2), || gw.fd_count() <= baseline),
        "sluice holds {} fds, {} before (leaked connection)",
        gw.fd_count(),
        baseline
    );
}

fn fault(name: &str, stream: bool) -> Req {
    let body = if stream {
        chat_stream_body("gpt-4o")
    } else {
        chat_body("gpt-4o")
    };
    Req::post("/v1/chat/completions", &body).header("x-mock-fault", name)
}

fn assert_framed(r: &Response) {
    assert!(
        matches!(r.framing, Framing::Length(_) | Framing::Chunked),
        "client response is not self-delimited: {:?}",
        r.framing
    );
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
}

#[test]
fn close_delimited_upstream_response_is_relayed_and_client_connection_kept() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    c.send(&fault("close-delimited", false).build());
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_framed(&r);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion", "{v}");
    c.send(&fault("close-delimited", false).build());
    let r2 = c.read_response();
    assert_eq!(r2.status, 200, "{}", r2.dump());
    assert_framed(&r2);
    assert_eq!(r2.json()["object"], "chat.completion");
}

#[test]
fn close_delimited_upstream_stream_is_relayed_and_client_connection_kept() {
    let mock = Mock::start(&["--tokens", "4"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    for _ in 0..2 {
        c.send(&fault("close-delimited", true).build());
        let r = c.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_framed(&r);
        let ev = r.sse_events();
        assert_eq!(
            ev.iter().filter(|e| e.content().is_some()).count(),
            4,
            "{}",
            r.dump()
        );
        assert!(ev.last().unwrap().is_done());
    }
}

#[test]
fn chunk_extensions_and_trailers_from_upstream_are_tolerated() {
    let mock = Mock::start(&["--tokens", "4", "--inter-token-ms", "10"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    for _ in 0..2 {
        c.send(&fault("chunk-ext", true).build());
        let r = c.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_framed(&r);
        let ev = r.sse_events();
        assert_eq!(
            ev.iter().filter(|e| e.content().is_some()).count(),
            4,
            "{}",
            r.dump()
        );
        assert!(ev.last().unwrap().is_done(), "{}", r.dump());
        assert!(!ev.iter().any(SseEvent::is_error));
    }
}

/// A truncated upstream stream must reach the client as truncated: an SSE error event, or a
/// connection closed without the terminating chunk -- never a clean end. If the upstream broke
/// before Sluice relayed anything, a 502 OpenAI-shaped error is the other clean outcome.
fn assert_truncated_stream(r: &Response) {
    if r.status == 502 {
        assert_openai_error(r, 502);
        return;
    }
    assert_eq!(r.status, 200, "{}", r.dump());
    assert!(
        r.end != BodyEnd::Timeout,
        "client stream hung instead of ending: {}",
        r.dump()
    );
    let events = r.sse_events();
    assert!(
        !events.iter().any(SseEvent::is_done),
        "truncated stream ended with [DONE]:\n{}",
        r.dump()
    );
    let error_event = events.iter().find(|e| e.is_error());
    match error_event {
        Some(e) => assert_error_value(&e.json().unwrap()).unwrap(),
        None => assert!(
            matches!(r.end, BodyEnd::Truncated | BodyEnd::Reset),
            "stream neither carried an error event nor was cut: {:?}\n{}",
            r.end,
            r.dump()
        ),
    }
}

#[test]
fn malformed_upstream_chunk_cuts_client_stream_and_sluice_survives() {
    let mock = Mock::start(&["--tokens", "6", "--inter-token-ms", "20"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    c.send(&fault("malformed-chunk", true).build());
    let r = c.read_response();
    assert_truncated_stream(&r);
    assert!(
        r.sse_events()
            .iter()
            .filter(|e| e.content().is_some())
            .count()
            <= 1,
        "{}",
        r.dump()
    );
    let next = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(next.status, 200, "{}", next.dump());
    let next = gw.chat(&chat_stream_body("gpt-4o"));
    assert_eq!(next.status, 200);
    assert!(next.sse_events().last().unwrap().is_done());
}

#[test]
fn upstream_dropping_mid_stream_cuts_client_stream_and_sluice_survives() {
    let mock = Mock::start(&["--tokens", "6", "--inter-token-ms", "20"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    c.send(&fault("drop-mid-stream", true).build());
    let r = c.read_response();
    assert_truncated_stream(&r);
    let next = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(next.status, 200, "{}", next.dump());
}

#[test]
fn upstream_connection_close_answer_is_relayed_and_client_connection_kept() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    for _ in 0..2 {
        c.send(&fault("close-after", false).build());
        let r = c.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_framed(&r);
        assert!(
            !r.header_has_token("connection", "close"),
            "upstream's Connection: close leaked to the client"
        );
    }
}

#[test]
fn upstream_error_event_is_relayed() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let r = gw.request(&fault("error-event", true));
    assert_eq!(r.status, 200, "{}", r.dump());
    let ev = r.sse_events();
    assert!(ev.iter().any(SseEvent::is_error), "{}", r.dump());
    assert!(ev.last().unwrap().is_done());
}
