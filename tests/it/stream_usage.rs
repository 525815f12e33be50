//! Stream usage end to end: for a streamed chat completion or completion whose client did not
//! ask for `stream_options.include_usage`, Sluice asks the upstream for it (so limits and the
//! access log settle on reported usage) and withholds the usage-only chunk from the client.
//! A client that asked gets the chunk; `upstream.request_stream_usage = false` turns it off;
//! other requests are forwarded byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

/// How long a record may take to reach the files (flush interval 50 ms, debug build).
const LOG_WAIT: Duration = Duration::from_secs(5);
/// How long a metric may take to show (publish every 500 ms).
const METRICS_WAIT: Duration = Duration::from_secs(5);

/// A gateway with the admin listener and an access log flushed every 50 ms.
fn observed(config: Config, log: &TempDir) -> Sluice {
    Sluice::start(
        &config
            .admin()
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 50),
    )
}

fn field<'a>(rec: &'a Value, name: &str) -> &'a Value {
    rec.get(name)
        .unwrap_or_else(|| panic!("record has no {name}: {rec}"))
}

/// The body the mock received, from its `: echo` comment.
fn upstream_body(r: &Response) -> String {
    echo_of(r)["body"].as_str().expect("echo.body").to_string()
}

/// Events whose JSON is a usage-only chunk (`choices: []` and a `usage` object).
fn usage_chunks(r: &Response) -> Vec<Value> {
    r.sse_events()
        .iter()
        .filter_map(SseEvent::json)
        .filter(|v| v["choices"] == json!([]) && v["usage"].is_object())
        .collect()
}

/// `body` as the upstream should get it: `"stream_options":{"include_usage":true}` as the
/// first key, every other byte as the client sent it.
fn with_usage_first(body: &str) -> String {
    let rest = body.strip_prefix('{').expect("a JSON object");
    format!("{{\"stream_options\":{{\"include_usage\":true}},{rest}")
}

fn assert_stream_ends_with_done(r: &Response, content_events: usize) {
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let events = r.sse_events();
    assert!(events.last().is_some_and(SseEvent::is_done), "{}", r.dump());
    let content = events.iter().filter(|e| e.content().is_some()).count();
    assert_eq!(content, content_events, "{}", r.dump());
}

#[test]
fn usage_is_requested_for_a_client_that_did_not_ask_and_withheld_from_it() {
    let mock = Mock::start(&["--tokens", "5", "--inter-token-ms", "5"]);
    let log = TempDir::new("usage-injected");
    let gw = observed(Config::one_cluster(&mock), &log);

    let body = chat_stream_body("gpt-4o");
    let r = gw.chat(&body);
    assert_stream_ends_with_done(&r, 5);
    // The upstream was asked, with no other byte of the body changed.
    assert_eq!(upstream_body(&r), with_usage_first(&body));
    assert_eq!(mock.stat("include_usage_requests"), 1);
    assert_eq!(
        mock.stat("usage_chunks"),
        1,
        "the mock sent its usage chunk"
    );
    // The client never sees it.
    assert!(usage_chunks(&r).is_empty(), "{}", r.dump());
    assert!(
        !r.text().contains("\"usage\""),
        "usage leaked to the client:\n{}",
        r.dump()
    );

    // The meter saw it: usage is the upstream's, not an estimate.
    let prompt = mock.stat("usage_prompt_tokens");
    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(field(rec, "usage_source"), "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(field(rec, "prompt_tokens"), prompt, "{rec}");
    assert_eq!(field(rec, "completion_tokens"), 5, "{rec}");
    assert_eq!(field(rec, "total_tokens"), prompt + 5, "{rec}");
    assert_eq!(field(rec, "stream"), true, "{rec}");
    assert_eq!(field(rec, "error_class"), "", "{rec}");

    let m = gw.wait_metrics(METRICS_WAIT, |m| {
        m.get(
            "sluice_tokens_total",
            &[("model", "gpt-4o"), ("type", "completion")],
        ) == Some(5.0)
    });
    let tokens = |t: &str| m.get("sluice_tokens_total", &[("model", "gpt-4o"), ("type", t)]);
    assert_eq!(tokens("completion"), Some(5.0), "{}", m.text);
    assert_eq!(tokens("prompt"), Some(prompt as f64), "{}", m.text);
}

#[test]
fn completions_false_null_and_empty_stream_options_are_made_true_in_place() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).map("alias", "upstream-model-long"));
    for (path, body, want) in [
        (
            "/v1/completions",
            r#"{"model":"gpt-4o","prompt":"hi","stream":true}"#.to_string(),
            r#"{"stream_options":{"include_usage":true},"model":"gpt-4o","prompt":"hi","stream":true}"#
                .to_string(),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"alias","stream":true,"stream_options":{"include_usage":false},"messages":[]}"#
                .to_string(),
            r#"{"model":"upstream-model-long","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#
                .to_string(),
        ),
        (
            "/v1/chat/completions",
            r#"{"stream":true,"stream_options": null,"model":"alias","messages":[]}"#.to_string(),
            r#"{"stream":true,"stream_options": {"include_usage":true},"model":"upstream-model-long","messages":[]}"#
                .to_string(),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","stream":true,"stream_options":{},"messages":[]}"#.to_string(),
            r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#
                .to_string(),
        ),
    ] {
        let r = gw.post(path, &body);
        assert_stream_ends_with_done(&r, 3);
        assert_eq!(upstream_body(&r), want, "{path} {body}");
        assert!(usage_chunks(&r).is_empty(), "{}", r.dump());
    }
    assert_eq!(mock.stat("usage_chunks"), 4);
}

#[test]
fn a_client_that_asked_for_usage_gets_the_chunk() {
    let mock = Mock::start(&["--tokens", "4"]);
    let log = TempDir::new("usage-asked");
    let gw = observed(Config::one_cluster(&mock), &log);
    let body = json!({
        "model": "gpt-4o",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hello"}],
    })
    .to_string();
    let r = gw.chat(&body);
    assert_stream_ends_with_done(&r, 4);
    assert_eq!(upstream_body(&r), body, "the body must pass unchanged");
    let chunks = usage_chunks(&r);
    assert_eq!(chunks.len(), 1, "{}", r.dump());
    assert_eq!(chunks[0]["usage"]["completion_tokens"], 4);
    // Just before [DONE], as the upstream sent it.
    let events = r.sse_events();
    let usage_at = events.len() - 2;
    assert_eq!(events[usage_at].json().unwrap(), chunks[0]);

    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(field(rec, "usage_source"), "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(
        field(rec, "prompt_tokens"),
        &chunks[0]["usage"]["prompt_tokens"],
        "{rec}"
    );
}

#[test]
fn knob_off_forwards_the_stream_request_unchanged() {
    let mock = Mock::start(&["--tokens", "3"]);
    let log = TempDir::new("usage-off");
    let gw = observed(
        Config::one_cluster(&mock).set("upstream", "request_stream_usage", "false"),
        &log,
    );
    let body = chat_stream_body("gpt-4o");
    let r = gw.chat(&body);
    assert_stream_ends_with_done(&r, 3);
    assert_eq!(upstream_body(&r), body);
    assert_eq!(mock.stat("include_usage_requests"), 0);
    assert_eq!(mock.stat("usage_chunks"), 0);
    // No usage came, so it is estimated.
    let recs = wait_records(log.path(), 1, LOG_WAIT);
    assert_eq!(
        field(&recs[0], "usage_source"),
        "USAGE_SOURCE_ESTIMATED",
        "{}",
        recs[0]
    );
}

#[test]
fn non_streaming_and_responses_requests_are_untouched() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let body = chat_body("gpt-4o");
    let r = gw.chat(&body);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(upstream_body(&r), body);
    assert!(r.json()["usage"].is_object(), "{}", r.dump());

    // `stream: false` with stream_options: forwarded as is.
    let body = r#"{"model":"gpt-4o","stream":false,"stream_options":{"include_usage":false},"messages":[]}"#;
    let r = gw.chat(body);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(upstream_body(&r), body);

    // The Responses API reports usage in `response.completed` anyway.
    let body = json!({"model": "gpt-4o", "input": "hi", "stream": true}).to_string();
    let r = gw.post("/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(upstream_body(&r), body);
    let last = r.sse_events().last().unwrap().json().unwrap();
    assert_eq!(last["type"], "response.completed", "{last}");
    assert_eq!(mock.stat("include_usage_requests"), 0);
}

#[test]
fn non_object_stream_options_is_rejected_before_forwarding() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut counter = mock.request_counter();
    for body in [
        r#"{"model":"gpt-4o","stream":true,"stream_options":true,"messages":[]}"#,
        r#"{"model":"gpt-4o","stream":true,"stream_options":[],"messages":[]}"#,
        r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":"yes"}}"#,
        r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":false,"include_usage":true}}"#,
    ] {
        let err = assert_openai_error(&gw.chat(body), 400);
        assert_eq!(err["param"], "stream_options", "{body}: {err}");
    }
    assert_eq!(
        counter.delta(),
        0,
        "a rejected request reached the upstream"
    );
}

#[test]
fn a_cut_stream_still_ends_with_an_error_event_and_is_estimated() {
    let mock = Mock::start(&["--tokens", "6"]);
    let log = TempDir::new("usage-cut");
    let gw = observed(Config::one_cluster(&mock), &log);
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
            .header("x-mock-fault", "drop-mid-stream"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let events = r.sse_events();
    assert_eq!(events.iter().filter(|e| e.content().is_some()).count(), 3);
    assert!(events.last().unwrap().is_error(), "{}", r.dump());
    let recs = wait_records(log.path(), 1, LOG_WAIT);
    assert_eq!(
        field(&recs[0], "usage_source"),
        "USAGE_SOURCE_ESTIMATED",
        "{}",
        recs[0]
    );
}

#[test]
fn many_streams_on_one_connection_keep_the_framing_right() {
    // Keep-alive reuse after a stripped stream: the chunked framing must have ended exactly.
    let mock = Mock::start(&["--tokens", "2"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    for i in 0..5 {
        let body = if i % 2 == 0 {
            chat_stream_body("gpt-4o")
        } else {
            json!({"model":"gpt-4o","prompt":"x","stream":true}).to_string()
        };
        let path = if i % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        c.send(&Req::post(path, &body).build());
        let r = c.read_response();
        assert_stream_ends_with_done(&r, 2);
        assert!(usage_chunks(&r).is_empty(), "{}", r.dump());
    }
    assert_eq!(mock.stat("usage_chunks"), 5);
}

#[test]
fn bytes_out_counts_the_stream_as_the_client_got_it() {
    let mock = Mock::start(&["--tokens", "3"]);
    let log = TempDir::new("usage-bytes");
    let gw = observed(Config::one_cluster(&mock), &log);
    let req = Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
        .header("Connection", "close");
    let mut c = gw.conn();
    c.send(&req.build());
    while c.read_more().expect("read until close") > 0 {}
    let raw = String::from_utf8_lossy(c.buffered()).into_owned();
    assert!(raw.ends_with("data: [DONE]\n\n\r\n0\r\n\r\n"), "{raw}");
    assert!(!raw.contains("\"usage\""), "{raw}");
    assert_eq!(mock.stat("usage_chunks"), 1);
    let recs = wait_records(log.path(), 1, LOG_WAIT);
    assert_eq!(
        field(&recs[0], "bytes_out").as_u64(),
        Some(raw.len() as u64),
        "{}",
        recs[0]
    );
}

#[test]
fn close_delimited_and_chunk_extension_streams_are_stripped_too() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    for fault in ["close-delimited", "chunk-ext"] {
        let r = gw.request(
            &Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
                .header("x-mock-fault", fault),
        );
        assert_stream_ends_with_done(&r, 3);
        assert_eq!(r.framing, Framing::Chunked, "{fault}");
        assert!(usage_chunks(&r).is_empty(), "{fault}: {}", r.dump());
    }
    assert_eq!(mock.stat("usage_chunks"), 2);
}

#[test]
fn a_stream_that_ends_cleanly_without_its_end_is_a_cut_not_a_normal_end() {
    // The upstream ends each body properly framed (the terminating chunk) after two content
    // events, with no finish chunk and no `[DONE]` (no `response.completed` for the Responses
    // API): the client must learn it was cut, and the record must say so.
    let mock = Mock::start(&["--tokens", "6"]);
    let log = TempDir::new("usage-ended-early");
    let gw = observed(Config::one_cluster(&mock), &log);
    let mut c = gw.conn();
    let streams = [
        ("/v1/chat/completions", chat_stream_body("gpt-4o")),
        (
            "/v1/completions",
            json!({"model":"gpt-4o","prompt":"x","stream":true}).to_string(),
        ),
        (
            "/v1/responses",
            json!({"model":"gpt-4o","input":"x","stream":true}).to_string(),
        ),
    ];
    for (path, body) in &streams {
        c.send(
            &Req::post(path, body)
                .header("x-mock-fault", "end-after=2")
                .build(),
        );
        let r = c.read_response();
        assert_eq!(r.status, 200, "{path}: {}", r.dump());
        // Still a well-framed response on a kept connection: only its events tell.
        assert_eq!(r.end, BodyEnd::Complete, "{path}: {}", r.dump());
        let events = r.sse_events();
        assert!(
            !events.iter().any(SseEvent::is_done),
            "{path}: {}",
            r.dump()
        );
        let last = events.last().unwrap();
        assert!(
            last.is_error(),
            "{path}: no error event at the end: {}",
            r.dump()
        );
        assert_error_value(&last.json().unwrap()).unwrap();
    }
    // The same connection serves a complete stream afterwards.
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
    let r = c.read_response();
    assert_stream_ends_with_done(&r, 6);

    let recs = wait_records(log.path(), 4, LOG_WAIT);
    for rec in &recs[..3] {
        assert_eq!(field(rec, "error_class"), "upstream_abort", "{rec}");
        // Billed on what was delivered: the prompt and the two events, estimated.
        assert_eq!(
            field(rec, "usage_source"),
            "USAGE_SOURCE_ESTIMATED",
            "{rec}"
        );
        assert!(
            field(rec, "completion_tokens").as_u64().unwrap() >= 1,
            "{rec}"
        );
    }
    assert_eq!(field(&recs[3], "error_class"), "", "{}", recs[3]);
}

#[test]
fn a_long_prompt_reaches_the_upstream_byte_for_byte_around_its_edits() {
    // Long enough that the body's end after the edits goes from the client's buffer straight
    // to the socket instead of being copied into the upstream request (forward::SEND_TAIL_FROM).
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).map("alias", "upstream-model"));
    let prose = "the quick brown fox \\\"jumps\\\" é ".repeat(4000);
    for (model, stream) in [
        ("alias", true),
        ("alias", false),
        ("gpt-4o", true),
        ("gpt-4o", false),
    ] {
        let body = format!(
            r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"{prose}"}}]}}"#
        );
        let r = gw.chat(&body);
        assert_eq!(r.status, 200, "{model}, stream {stream}: {}", r.dump());
        let mut expected = body.replace(r#""model":"alias""#, r#""model":"upstream-model""#);
        if stream {
            expected = with_usage_first(&expected);
        }
        let got = upstream_body(&r);
        assert!(
            got == expected,
            "{model}, stream {stream}: the upstream got {} bytes, {} expected",
            got.len(),
            expected.len()
        );
        // Its Content-Length said so too (the mock read exactly the body).
        let length = echo_headers(&echo_of(&r))
            .into_iter()
            .find(|(n, _)| n == "content-length")
            .map(|(_, v)| v);
        assert_eq!(
            length,
            Some(expected.len().to_string()),
            "{model}, stream {stream}"
        );
    }
}
