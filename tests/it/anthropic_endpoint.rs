//! `POST /v1/messages` for Anthropic SDK clients (issue #14, item 3), served by an
//! OpenAI-dialect upstream (translated) or an Anthropic-dialect one (passed through; mock-llm's
//! `/v1/messages` checks each request as strictly as the real API): answers, streams and every
//! error in Anthropic's shapes, `/v1/messages/count_tokens` from Sluice's estimate, usage
//! metered as on the OpenAI endpoints, fallbacks across the dialects both ways, and the official
//! `anthropic` Python SDK through Sluice against both (`scripts/test.sh` installs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::Duration;

use sluice_tests::*;

const KEY: &str = "sk-anthropic-client-1";
const LOG_WAIT: Duration = Duration::from_secs(5);

fn keys() -> String {
    format!(
        "[[keys]]\nid = \"claude-user\"\nsha256 = \"{}\"\nmodels_allow = [\"gpt-*\"]\n",
        key_hash(KEY)
    )
}

fn gateway(mock: &Mock, extra: &str, log: &TempDir) -> Sluice {
    Sluice::start(
        &Config::one_cluster(mock)
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 50)
            .raw(&keys())
            .raw(extra),
    )
}

fn messages_body(model: &str, stream: bool) -> String {
    json!({
        "model": model,
        "max_tokens": 64,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hello."}],
        "stream": stream,
    })
    .to_string()
}

fn send(
    gw: &Sluice,
    path: &str,
    key: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> Response {
    let mut req = Req::post(path, body).header("anthropic-version", "2023-06-01");
    if let Some(k) = key {
        req = req.header("x-api-key", k);
    }
    for (k, v) in extra {
        req = req.header(k, v);
    }
    gw.request(&req)
}

/// The response is Anthropic's error shape with `status` and `kind`: returns the message.
fn assert_anthropic_error(r: &Response, status: u16, kind: &str) -> String {
    assert_eq!(r.status, status, "{}", r.dump());
    let v = r.json();
    assert_eq!(v["type"], "error", "{}", r.dump());
    assert_eq!(v["error"]["type"], kind, "{}", r.dump());
    assert!(
        v.get("code").is_none() && v["error"].get("code").is_none(),
        "{v}"
    );
    v["error"]["message"]
        .as_str()
        .expect("a message")
        .to_string()
}

#[test]
fn every_error_sluice_answers_is_anthropic_shaped() {
    let mock = Mock::start(&[]);
    let log = TempDir::new("anthropic-errors");
    let gw = gateway(
        &mock,
        "[[policies]]\nid = \"one-rpm\"\nper = \"key\"\nmax_requests = 5\nrequests_window_secs = 60\n",
        &log,
    );
    let body = messages_body("gpt-4o", false);

    // No key, a wrong key: 401 before the body is read.
    assert_anthropic_error(
        &send(&gw, "/v1/messages", None, &body, &[]),
        401,
        "authentication_error",
    );
    let r = send(&gw, "/v1/messages", Some("sk-wrong"), &body, &[]);
    assert_anthropic_error(&r, 401, "authentication_error");
    // A model the key may not use, a model nobody routes.
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("claude-x", false),
        &[],
    );
    assert_anthropic_error(&r, 403, "permission_error");
    let gw_any = Sluice::start(&Config::one_cluster(&mock));
    let r = send(
        &gw_any,
        "/v1/messages",
        None,
        &messages_body("nobody-routes-me", false),
        &[],
    );
    assert_anthropic_error(&r, 404, "not_found_error");
    // Anthropic requires max_tokens; a body that is not JSON.
    let no_max = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
    let m = assert_anthropic_error(
        &send(&gw, "/v1/messages", Some(KEY), no_max, &[]),
        400,
        "invalid_request_error",
    );
    assert!(m.contains("max_tokens"), "{m}");
    let r = send(&gw, "/v1/messages", Some(KEY), "{\"model\":", &[]);
    assert_anthropic_error(&r, 400, "invalid_request_error");
    // Wrong method.
    let r = gw.request(&Req::get("/v1/messages").header("x-api-key", KEY));
    assert_anthropic_error(&r, 405, "invalid_request_error");
    assert_eq!(r.header("allow"), Some("POST"));
    assert_eq!(
        mock.stat("requests"),
        0,
        "nothing above reached the upstream"
    );

    // The upstream's own error, translated (its status kept).
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &body,
        &[("x-mock-status", "400")],
    );
    assert_anthropic_error(&r, 400, "invalid_request_error");
    // Limits: the key's five requests went to the three refused above (a refused request
    // counts as one), the upstream's 400 and the next one; the one after is a 429.
    assert_eq!(send(&gw, "/v1/messages", Some(KEY), &body, &[]).status, 200);
    let r = send(&gw, "/v1/messages", Some(KEY), &body, &[]);
    assert_anthropic_error(&r, 429, "rate_limit_error");
    assert!(r.header("retry-after").is_some(), "{}", r.dump());
    assert_eq!(
        r.header("x-ratelimit-limit-requests"),
        Some("5"),
        "{}",
        r.dump()
    );
}

#[test]
fn an_unavailable_upstream_is_an_anthropic_overloaded_error() {
    let gw = Sluice::start(&Config::backend_url(&format!(
        "http://127.0.0.1:{}/v1",
        dead_port()
    )));
    let r = send(
        &gw,
        "/v1/messages",
        None,
        &messages_body("gpt-4o", false),
        &[],
    );
    assert!(matches!(r.status, 502 | 503), "{}", r.dump());
    let v = r.json();
    assert_eq!(v["type"], "error", "{}", r.dump());
    assert!(
        ["api_error", "overloaded_error"].contains(&v["error"]["type"].as_str().unwrap()),
        "{v}"
    );
}

#[test]
fn a_whole_answer_from_an_openai_upstream_is_a_message_metered_as_reported() {
    let mock = Mock::start(&["--tokens", "4"]);
    let log = TempDir::new("anthropic-whole");
    let gw = gateway(&mock, "", &log);
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("gpt-4o", false),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let v = r.json();
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(v["role"], "assistant", "{v}");
    assert_eq!(v["model"], "gpt-4o", "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    assert!(!v["content"][0]["text"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["stop_reason"], "end_turn", "{v}");
    let prompt = mock.stat("usage_prompt_tokens");
    assert_eq!(v["usage"]["input_tokens"], prompt, "{v}");
    assert_eq!(v["usage"]["output_tokens"], 4, "{v}");

    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(rec["usage_source"], "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(rec["prompt_tokens"], prompt, "{rec}");
    assert_eq!(rec["completion_tokens"], 4, "{rec}");
    assert_eq!(rec["path"], "/v1/messages", "{rec}");
}

/// Events' names, in order.
fn names(events: &[SseEvent]) -> Vec<String> {
    events.iter().filter_map(|e| e.event.clone()).collect()
}

#[test]
fn a_stream_from_an_openai_upstream_is_messages_events_in_order() {
    let mock = Mock::start(&["--tokens", "5", "--inter-token-ms", "2"]);
    let log = TempDir::new("anthropic-stream");
    let gw = gateway(&mock, "", &log);
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("gpt-4o", true),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.sse_events();
    let names = names(&events);
    let deltas = names.iter().filter(|n| *n == "content_block_delta").count();
    let mut want = vec!["message_start", "content_block_start"];
    want.extend(std::iter::repeat_n("content_block_delta", deltas));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want, "{}", r.dump());
    assert!(deltas >= 1, "{}", r.dump());
    // Nothing OpenAI-shaped leaks: no bare data events, no [DONE].
    assert!(
        events
            .iter()
            .all(|e| e.event.is_some() || e.data.is_empty()),
        "{}",
        r.dump()
    );
    let delta = events
        .iter()
        .find(|e| e.event.as_deref() == Some("message_delta"))
        .unwrap()
        .json()
        .unwrap();
    let prompt = mock.stat("usage_prompt_tokens");
    assert_eq!(delta["delta"]["stop_reason"], "end_turn", "{delta}");
    assert_eq!(delta["usage"]["output_tokens"], 5, "{delta}");
    assert_eq!(delta["usage"]["input_tokens"], prompt, "{delta}");

    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(rec["usage_source"], "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(rec["prompt_tokens"], prompt, "{rec}");
    assert_eq!(rec["completion_tokens"], 5, "{rec}");
    assert_eq!(rec["stream"], true, "{rec}");
    assert_eq!(rec["error_class"], "", "{rec}");
    assert!(rec["ttft_us"].as_u64().unwrap() > 0, "{rec}");
}

#[test]
fn streams_that_fail_midway_end_with_an_anthropic_error_event() {
    let mock = Mock::start(&["--tokens", "6"]);
    let log = TempDir::new("anthropic-midstream");
    let gw = gateway(&mock, "", &log);
    for fault in ["error-event=2", "end-after=2", "die-after=2"] {
        let r = send(
            &gw,
            "/v1/messages",
            Some(KEY),
            &messages_body("gpt-4o", true),
            &[("x-mock-fault", fault)],
        );
        assert_eq!(r.status, 200, "{fault}: {}", r.dump());
        let events = r.sse_events();
        let last = events
            .last()
            .unwrap_or_else(|| panic!("{fault}: {}", r.dump()));
        assert_eq!(
            last.event.as_deref(),
            Some("error"),
            "{fault}: {}",
            r.dump()
        );
        let v = last.json().unwrap();
        assert_eq!(v["type"], "error", "{fault}: {v}");
        assert!(v["error"]["type"].is_string(), "{fault}: {v}");
        assert!(
            !names(&events).iter().any(|n| n == "message_stop"),
            "{fault}: a cut stream must not look whole: {}",
            r.dump()
        );
    }
}

#[test]
fn count_tokens_is_answered_from_the_estimate_after_the_key_and_model_checks() {
    let mock = Mock::start(&[]);
    let log = TempDir::new("anthropic-count");
    let gw = gateway(&mock, "", &log);
    let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Count the tokens of this sentence, please."}]}"#;
    let r = send(&gw, "/v1/messages/count_tokens", Some(KEY), body, &[]);
    assert_eq!(r.status, 200, "{}", r.dump());
    let n = r.json()["input_tokens"].as_u64().expect("input_tokens");
    assert!((5..200).contains(&n), "{}", r.dump());
    assert_eq!(mock.stat("requests"), 0, "answered by Sluice");

    let r = send(
        &gw,
        "/v1/messages/count_tokens",
        Some("sk-wrong"),
        body,
        &[],
    );
    assert_anthropic_error(&r, 401, "authentication_error");
    let other = body.replace("gpt-4o", "claude-x");
    let r = send(&gw, "/v1/messages/count_tokens", Some(KEY), &other, &[]);
    assert_anthropic_error(&r, 403, "permission_error");
    let r = send(&gw, "/v1/messages/count_tokens", Some(KEY), "[]", &[]);
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = gw.request(&Req::get("/v1/messages/count_tokens").header("x-api-key", KEY));
    assert_anthropic_error(&r, 405, "invalid_request_error");
}

#[test]
fn an_anthropic_dialect_primary_falls_back_to_an_openai_cluster_in_the_clients_dialect() {
    let mock = Mock::start(&["--tokens", "3"]);
    let log = TempDir::new("anthropic-fallback");
    let gw = Sluice::start(
        &Config::new()
            .cluster(Cluster::new("openai", &[&mock.base_url()]))
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 20)
            .env("CLAUDE_KEY", "sk-ant-test")
            .raw(&format!(
                "[clusters.claude]\ndialect = \"anthropic\"\n\
                 backends = [{{ base_url = \"http://127.0.0.1:{}/v1\" }}]\n\
                 credential = {{ env = \"CLAUDE_KEY\", header = \"x-api-key\" }}\n\
                 [[routes]]\nmodel = \"claude-sonnet\"\n\
                 groups = [{{ targets = [{{ cluster = \"claude\" }}] }}, \
                           {{ targets = [{{ cluster = \"openai\", model = \"gpt-4o\" }}] }}]\n",
                dead_port()
            )),
    );
    for stream in [false, true] {
        let r = send(
            &gw,
            "/v1/messages",
            None,
            &messages_body("claude-sonnet", stream),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.dump());
        if stream {
            let names = names(&r.sse_events());
            assert_eq!(
                names.first().map(String::as_str),
                Some("message_start"),
                "{}",
                r.dump()
            );
            assert_eq!(
                names.last().map(String::as_str),
                Some("message_stop"),
                "{}",
                r.dump()
            );
        } else {
            let v = r.json();
            assert_eq!(v["type"], "message", "{v}");
            assert_eq!(
                v["model"], "claude-sonnet",
                "the model the client asked for: {v}"
            );
        }
    }
    let recs = wait_records(log.path(), 2, Duration::from_secs(10));
    for rec in &recs {
        assert_eq!(rec["fallback_attempts"], 1, "{rec}");
        assert_eq!(rec["completion_tokens"], 3, "{rec}");
    }
}

/// `gpt-4o` on the mock as an OpenAI-dialect cluster (as [`gateway`]), and `gpt-claude` on the
/// same mock as an Anthropic-dialect one (`claude-mock` upstream); `gpt-failover` tries
/// `failing` (an OpenAI-dialect cluster answering 503) before that Anthropic-dialect one.
fn two_dialects(mock: &Mock, failing: &Mock, log: &TempDir) -> Sluice {
    Sluice::start(
        &Config::one_cluster(mock)
            .env("CLAUDE_KEY", "sk-ant-test")
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 20)
            .raw(&keys())
            .raw(&format!(
                r#"
[clusters.claude]
backends = [{{ base_url = {url} }}]
dialect = "anthropic"
credential = {{ env = "CLAUDE_KEY", header = "x-api-key" }}

[clusters.failing]
backends = [{{ base_url = {failing} }}]

[[routes]]
model = "gpt-claude"
groups = [{{ targets = [{{ cluster = "claude", model = "claude-mock" }}] }}]

[[routes]]
model = "gpt-failover"
groups = [{{ targets = [{{ cluster = "failing" }}] }}, {{ targets = [{{ cluster = "claude", model = "claude-mock" }}] }}]

[pricing."claude-mock"]
input = 3.0
output = 15.0
cached_input = 0.3
cache_write_input = 3.75
"#,
                url = toml_str(&mock.base_url()),
                failing = toml_str(&failing.base_url()),
            )),
    )
}

/// Passthrough: an Anthropic client's Messages request to an Anthropic-dialect cluster goes out
/// with only the model changed and the cluster's key, comes back untouched (the upstream's own
/// `model`, ids and event names), and is metered from Anthropic's usage — cache reads and writes
/// in the prompt, priced apart; a stream cut midway ends with an Anthropic error event and is
/// billed; an OpenAI-dialect primary's 503 falls over to it.
#[test]
fn messages_pass_through_to_an_anthropic_cluster_metered_in_its_terms() {
    let mock = Mock::start(&["--tokens", "4"]);
    let failing = Mock::start(&["--fault", "status=503"]);
    let log = TempDir::new("anthropic-passthrough");
    let gw = two_dialects(&mock, &failing, &log);
    let cache = [
        ("x-mock-prompt-tokens", "10"),
        ("x-mock-cache-read", "100"),
        ("x-mock-cache-write", "50"),
    ];

    // Whole.
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("gpt-claude", false),
        &cache,
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let v = r.json();
    assert_eq!(v["type"], "message", "{v}");
    assert_eq!(
        v["model"], "claude-mock",
        "the upstream's answer, untouched: {v}"
    );
    assert_eq!(v["usage"]["input_tokens"], 10, "{v}");
    assert_eq!(v["usage"]["cache_read_input_tokens"], 100, "{v}");
    assert_eq!(v["usage"]["cache_creation_input_tokens"], 50, "{v}");
    assert_eq!(v["usage"]["output_tokens"], 4, "{v}");
    assert_eq!(mock.stat("messages_requests"), 1);
    assert_eq!(mock.stat("invalid_requests"), 0);

    // Streamed: Anthropic's events as the upstream sent them.
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("gpt-claude", true),
        &cache,
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let events = r.sse_events();
    let seen = names(&events);
    assert_eq!(
        seen.first().map(String::as_str),
        Some("message_start"),
        "{}",
        r.dump()
    );
    assert_eq!(
        seen.last().map(String::as_str),
        Some("message_stop"),
        "{}",
        r.dump()
    );
    assert!(
        seen.iter().any(|n| n == "content_block_delta"),
        "{}",
        r.dump()
    );
    assert!(!r.text().contains("[DONE]"), "{}", r.dump());

    // Cut midway: an Anthropic error event after what was relayed, never a clean end.
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("gpt-claude", true),
        &[("x-mock-fault", "die-after=2"), ("x-mock-tokens", "6")],
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let events = r.sse_events();
    let last = events.last().expect("events");
    assert_eq!(last.event.as_deref(), Some("error"), "{}", r.dump());
    assert_eq!(last.json().unwrap()["type"], "error", "{}", r.dump());
    assert!(
        !names(&events).iter().any(|n| n == "message_stop"),
        "{}",
        r.dump()
    );

    // An OpenAI-dialect primary answering 503: the Anthropic-dialect fallback's answer, passed
    // through.
    let r = send(
        &gw,
        "/v1/messages",
        Some(KEY),
        &messages_body("gpt-failover", false),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.json()["model"], "claude-mock", "{}", r.dump());
    assert_eq!(failing.stat("requests"), 1);

    let mut recs = wait_records(log.path(), 4, LOG_WAIT);
    recs.sort_by_key(|r| r["time_unix_us"].as_u64());
    // Cost: 10 uncached at 3, 100 reads at 0.3, 50 writes at 3.75, 4 out at 15 (per million).
    let cost = (10.0 * 3.0 + 100.0 * 0.3 + 50.0 * 3.75 + 4.0 * 15.0) / 1e6;
    for (rec, stream) in recs[..2].iter().zip([false, true]) {
        assert_eq!(rec["cluster"], "claude", "{rec}");
        assert_eq!(rec["path"], "/v1/messages", "{rec}");
        assert_eq!(rec["stream"], stream, "{rec}");
        assert_eq!(rec["usage_source"], "USAGE_SOURCE_REPORTED", "{rec}");
        assert_eq!(rec["prompt_tokens"], 160, "{rec}");
        assert_eq!(rec["cached_tokens"], 100, "{rec}");
        assert_eq!(rec["cache_write_tokens"], 50, "{rec}");
        assert_eq!(rec["completion_tokens"], 4, "{rec}");
        assert_eq!(rec["total_tokens"], 164, "{rec}");
        let c = rec["cost"].as_f64().unwrap();
        assert!((c - cost).abs() < 1e-12, "cost {c}, want {cost}: {rec}");
    }
    assert!(recs[1]["ttft_us"].as_u64().unwrap() > 0, "{}", recs[1]);
    let cut = &recs[2];
    assert_eq!(cut["error_class"], "upstream_abort", "{cut}");
    assert!(
        cut["completion_tokens"].as_u64().unwrap() >= 1,
        "billed what was sent: {cut}"
    );
    assert!(cut["prompt_tokens"].as_u64().unwrap() >= 1, "{cut}");
    let failover = &recs[3];
    assert_eq!(failover["fallback_attempts"], 1, "{failover}");
    assert_eq!(failover["fallback_reason"], "status_5xx", "{failover}");
    assert_eq!(failover["cluster"], "claude", "{failover}");
    assert_eq!(mock.stat("invalid_requests"), 0);
}

/// The official `anthropic` SDK, unchanged, against Sluice, once on `gpt-4o` (translated to and
/// from the OpenAI-dialect mock) and once on `gpt-claude` (passed through to the
/// Anthropic-dialect mock): system prompt and image, `messages.create` and `messages.stream`
/// (which accumulates the events into a final message), parallel tool calls whole and streamed
/// (input JSON in many deltas), the turn that answers them with `tool_result`, `count_tokens`,
/// and a bad key raised as the SDK's own `AuthenticationError`.
#[test]
fn the_anthropic_python_sdk_reads_every_answer_from_either_dialect() {
    let mock = Mock::start(&["--tokens", "4"]);
    let failing = Mock::start(&["--fault", "status=503"]);
    let log = TempDir::new("anthropic-sdk");
    let gw = two_dialects(&mock, &failing, &log);
    let script = r#"
import json, sys, anthropic
addr, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = anthropic.Anthropic(base_url=addr, api_key=key, max_retries=0)
png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
look = [{"role": "user", "content": [
    {"type": "text", "text": "what is this?"},
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]
m = client.messages.create(model=model, max_tokens=32, system="Be brief.", messages=look)
assert m.type == "message" and m.role == "assistant", m
assert m.content[0].type == "text" and m.content[0].text, m
with client.messages.stream(model=model, max_tokens=32, messages=look,
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert text and final.content[0].text == text, (text, final)
assert final.stop_reason == "end_turn", final
tools = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ask = [{"role": "user", "content": "weather?"}]
calls = client.messages.create(model=model, max_tokens=64, tools=tools, messages=ask,
                               extra_headers={"x-mock-tool-calls": "2"})
uses = [b for b in calls.content if b.type == "tool_use"]
assert calls.stop_reason == "tool_use" and len(uses) == 2, calls
assert all(isinstance(u.input, dict) and u.input for u in uses), uses
assert len({u.id for u in uses}) == 2, uses
fragments = 0
with client.messages.stream(model=model, max_tokens=64, tools=tools, messages=ask,
                            extra_headers={"x-mock-tool-calls": "2"}) as s:
    for event in s:
        if event.type == "input_json":
            fragments += 1
    streamed = s.get_final_message()
su = [b for b in streamed.content if b.type == "tool_use"]
assert streamed.stop_reason == "tool_use" and len(su) == 2, streamed
assert all(isinstance(u.input, dict) and u.input for u in su), su
assert fragments >= 4, f"input JSON came in {fragments} deltas"
turn = ask + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": u.id, "name": u.name, "input": u.input} for u in uses]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]},
]
answer = client.messages.create(model=model, max_tokens=32, tools=tools, messages=turn)
assert answer.content[0].type == "text" and answer.stop_reason == "end_turn", answer
count = client.messages.count_tokens(model=model, messages=ask)
try:
    anthropic.Anthropic(base_url=addr, api_key="sk-nope", max_retries=0).messages.create(
        model=model, max_tokens=8, messages=ask)
    raise SystemExit("a bad key was accepted")
except anthropic.AuthenticationError as e:
    kind = e.body["error"]["type"]
print(json.dumps({"whole": m.usage.output_tokens, "streamed": final.usage.output_tokens,
    "input": final.usage.input_tokens, "count": count.input_tokens, "kind": kind}))
"#;
    let addr = format!("http://{}", gw.addr);
    for (model, messages_requests) in [("gpt-4o", 0), ("gpt-claude", 5)] {
        let out = Command::new("python3")
            .args(["-c", script, &addr, KEY, model])
            .stdin(Stdio::null())
            .output()
            .expect("python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{model}: the `anthropic` package must be installed (scripts/test.sh does):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["whole"], 4, "{model}: {v}");
        assert_eq!(v["streamed"], 4, "{model}: {v}");
        assert!(v["input"].as_u64().unwrap() > 0, "{model}: {v}");
        assert!(v["count"].as_u64().unwrap() > 0, "{model}: {v}");
        assert_eq!(v["kind"], "authentication_error", "{model}: {v}");
        assert_eq!(mock.stat("messages_requests"), messages_requests, "{model}");
        assert_eq!(mock.stat("invalid_requests"), 0, "{model}");
    }
}
