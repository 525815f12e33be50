//! `POST /v1/messages` for Anthropic SDK clients (issue #14, item 3), served by an
//! OpenAI-dialect upstream (today's mock-llm): answers, streams and every error in Anthropic's
//! shapes, `/v1/messages/count_tokens` from Sluice's estimate, usage metered as on the OpenAI
//! endpoints, a fallback from an Anthropic-dialect primary to an OpenAI-dialect cluster, and the
//! official `anthropic` Python SDK through Sluice (`scripts/test.sh` installs it).
//!
//! Passthrough to an Anthropic-dialect upstream waits for mock-llm to speak Anthropic.
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
        "[[policies]]\nid = \"one-rpm\"\nper = \"key\"\nmax_requests = 2\nrequests_window_secs = 60\n",
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
    // Limits: the second request used the key's two; the third is a 429 with its headers.
    assert_eq!(send(&gw, "/v1/messages", Some(KEY), &body, &[]).status, 200);
    let r = send(&gw, "/v1/messages", Some(KEY), &body, &[]);
    assert_anthropic_error(&r, 429, "rate_limit_error");
    assert!(r.header("retry-after").is_some(), "{}", r.dump());
    assert_eq!(
        r.header("x-ratelimit-limit-requests"),
        Some("2"),
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

/// The official `anthropic` SDK, unchanged, against Sluice: `messages.create` and
/// `messages.stream` (which accumulates the events into a final message).
#[test]
fn the_anthropic_python_sdk_reads_every_answer() {
    let mock = Mock::start(&["--tokens", "4"]);
    let log = TempDir::new("anthropic-sdk");
    let gw = gateway(&mock, "", &log);
    let script = format!(
        r#"
import json, anthropic
client = anthropic.Anthropic(base_url="http://{addr}", api_key="{key}", max_retries=0)
m = client.messages.create(model="gpt-4o", max_tokens=32, system="Be brief.",
    messages=[{{"role": "user", "content": "hi"}}])
assert m.type == "message" and m.role == "assistant", m
assert m.content[0].type == "text" and m.content[0].text, m
with client.messages.stream(model="gpt-4o", max_tokens=32,
        messages=[{{"role": "user", "content": "hi"}}]) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert text and final.content[0].text == text, (text, final)
assert final.stop_reason == "end_turn", final
count = client.messages.count_tokens(model="gpt-4o", messages=[{{"role": "user", "content": "hi"}}])
try:
    anthropic.Anthropic(base_url="http://{addr}", api_key="sk-nope", max_retries=0).messages.create(
        model="gpt-4o", max_tokens=8, messages=[{{"role": "user", "content": "hi"}}])
    raise SystemExit("a bad key was accepted")
except anthropic.AuthenticationError as e:
    kind = e.body["error"]["type"]
print(json.dumps({{"whole": m.usage.output_tokens, "streamed": final.usage.output_tokens,
    "input": final.usage.input_tokens, "count": count.input_tokens, "kind": kind}}))
"#,
        addr = gw.addr,
        key = KEY
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the `anthropic` package must be installed (scripts/test.sh does):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["whole"], 4, "{v}");
    assert_eq!(v["streamed"], 4, "{v}");
    assert!(v["input"].as_u64().unwrap() > 0, "{v}");
    assert!(v["count"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["kind"], "authentication_error", "{v}");
}
