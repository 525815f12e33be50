//! OpenAI clients and Anthropic-dialect clusters (issue #14): a chat completion sent to a
//! cluster with `dialect = "anthropic"` goes out as a Messages request (mock-llm checks it as
//! strictly as the real API) and comes back — whole, streamed, or as an error — in OpenAI's
//! shapes, with usage in OpenAI's terms; a route fails over between the dialects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::*;

/// `claude` on an Anthropic-dialect cluster (the mock, keyed by `x-api-key`), as `claude-mock`
/// upstream; `gpt-4o` on an OpenAI-dialect cluster first and the Anthropic one second.
fn config(anthropic: &Mock, openai: &Mock, log: &TempDir) -> Config {
    Config::new()
        .env("ANTHROPIC_KEY", "sk-ant-test")
        .access_log(log.path())
        .access_log_opt("flush_interval_ms", 20)
        .raw(&format!(
            r#"
[clusters.claude]
backends = [{{ base_url = {} }}]
dialect = "anthropic"
credential = {{ env = "ANTHROPIC_KEY", header = "x-api-key" }}

[clusters.openai]
backends = [{{ base_url = {} }}]

[[routes]]
model = "claude"
groups = [{{ targets = [{{ cluster = "claude", model = "claude-mock" }}] }}]

[[routes]]
model = "gpt-4o"
groups = [{{ targets = [{{ cluster = "openai" }}] }}, {{ targets = [{{ cluster = "claude", model = "claude-mock" }}] }}]

[routing]
breaker_failures = 1000
cooldown_ms = 1
"#,
            toml_str(&anthropic.base_url()),
            toml_str(&openai.base_url())
        ))
}

fn records(log: &TempDir, n: usize) -> Vec<Value> {
    let mut r = wait_records(log.path(), n, Duration::from_secs(10));
    r.sort_by_key(|r| r["time_unix_us"].as_u64());
    r
}

#[test]
fn a_chat_completion_is_answered_by_claude_in_openai_shape_with_usage_in_openai_terms() {
    let claude = Mock::start(&["--tokens", "5"]);
    let openai = Mock::start(&[]);
    let log = TempDir::new("anthropic-whole");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let body = json!({
        "model": "claude",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hello"}
        ],
        "max_tokens": 64,
        "stream_options": {"include_usage": true},
        "frequency_penalty": 0.5
    });
    let r = gw.request(
        &Req::post("/v1/chat/completions", &body.to_string())
            .header("x-mock-cache-read", "7")
            .header("x-mock-cache-write", "3"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion", "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(
        !choice["message"]["content"].as_str().unwrap().is_empty(),
        "{v}"
    );
    assert_eq!(choice["finish_reason"], "stop");
    // prompt = input + cache reads + cache writes (the mock's sum); cached = the reads.
    let usage = &v["usage"];
    let prompt = claude.stat("usage_prompt_tokens");
    assert_eq!(claude.stat("usage_cache_read_tokens"), 7);
    assert_eq!(claude.stat("usage_cache_creation_tokens"), 3);
    assert!(prompt > 10, "input tokens besides the cache: {prompt}");
    assert_eq!(usage["completion_tokens"], 5, "{v}");
    assert_eq!(usage["prompt_tokens"].as_u64().unwrap(), prompt, "{v}");
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 7, "{v}");
    assert_eq!(claude.stat("messages_requests"), 1);
    assert_eq!(
        claude.stat("invalid_requests"),
        0,
        "the mock refused the Messages request"
    );

    // The access log and limits see the same numbers.
    let rec = &records(&log, 1)[0];
    assert_eq!(rec["cluster"], "claude", "{rec}");
    assert_eq!(rec["mapped_model"], "claude-mock");
    assert_eq!(rec["usage_source"], "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(rec["prompt_tokens"].as_u64().unwrap(), prompt, "{rec}");
    assert_eq!(rec["completion_tokens"], 5);
    assert_eq!(rec["cached_tokens"], 7);
}

#[test]
fn a_streamed_chat_completion_is_translated_event_by_event() {
    let claude = Mock::start(&["--tokens", "4", "--inter-token-ms", "30"]);
    let openai = Mock::start(&[]);
    let log = TempDir::new("anthropic-stream");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    for include_usage in [false, true] {
        let mut body = json!({
            "model": "claude",
            "stream": true,
            "messages": [{"role": "user", "content": "hello"}]
        });
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = gw.request(&Req::post("/v1/chat/completions", &body.to_string()));
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
        let events = r.sse_events();
        assert!(events.last().unwrap().is_done(), "{}", r.dump());
        let chunks: Vec<Value> = events.iter().filter_map(SseEvent::json).collect();
        assert_eq!(
            chunks[0]["choices"][0]["delta"]["role"],
            "assistant",
            "{}",
            r.dump()
        );
        for c in &chunks {
            assert_eq!(c["object"], "chat.completion.chunk", "{c}");
            assert_eq!(c["model"], "claude", "{c}");
        }
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let deltas = events.iter().filter(|e| e.content().is_some()).count();
        assert!(deltas >= 4, "{}", r.dump());
        assert!(!text.is_empty());
        // Relayed as they came, not gathered.
        let content: Vec<&SseEvent> = events.iter().filter(|e| e.content().is_some()).collect();
        let span = content.last().unwrap().at.duration_since(content[0].at);
        assert!(span >= Duration::from_millis(50), "{span:?}");
        let finish: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0).map(|ch| &ch["finish_reason"]))
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, [&json!("stop")], "{}", r.dump());
        let usage_chunks: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"].as_array().is_some_and(|a| a.is_empty()))
            .collect();
        assert_eq!(
            usage_chunks.len(),
            usize::from(include_usage),
            "the usage chunk goes only to a client that asked: {}",
            r.dump()
        );
    }
    // Billed on the reported usage either way.
    for rec in records(&log, 2) {
        assert_eq!(rec["usage_source"], "USAGE_SOURCE_REPORTED", "{rec}");
        assert_eq!(rec["completion_tokens"], 4, "{rec}");
        assert!(rec["ttft_us"].as_u64().unwrap() > 0, "{rec}");
    }
}

/// A stream's tool calls reassembled as the OpenAI SDK does, by index: (id, name, arguments),
/// each delta's pieces joined. Indexes must be dense from 0.
fn streamed_tool_calls(chunks: &[Value]) -> Vec<(String, String, String)> {
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for c in chunks {
        for tc in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i = tc["index"].as_u64().unwrap() as usize;
            if calls.len() <= i {
                assert_eq!(calls.len(), i, "indexes are dense from 0: {c}");
                calls.push((String::new(), String::new(), String::new()));
            }
            if let Some(id) = tc["id"].as_str() {
                calls[i].0 = id.to_string();
            }
            if let Some(name) = tc["function"]["name"].as_str() {
                calls[i].1.push_str(name);
            }
            if let Some(args) = tc["function"]["arguments"].as_str() {
                calls[i].2.push_str(args);
            }
        }
    }
    calls
}

#[test]
fn parallel_tool_calls_stream_under_openai_indexes_with_whole_arguments() {
    let claude = Mock::start(&["--tokens", "2"]);
    let openai = Mock::start(&[]);
    let log = TempDir::new("anthropic-tools");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let body = json!({
        "model": "claude",
        "stream": true,
        "messages": [{"role": "user", "content": "weather in two cities?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
        }}],
        "tool_choice": "auto"
    });
    let r = gw.request(
        &Req::post("/v1/chat/completions", &body.to_string()).header("x-mock-tool-calls", "2"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(claude.stat("invalid_requests"), 0);
    let chunks: Vec<Value> = r.sse_events().iter().filter_map(SseEvent::json).collect();
    let calls = streamed_tool_calls(&chunks);
    assert_eq!(calls.len(), 2, "{}", r.dump());
    for (id, name, args) in &calls {
        assert!(!id.is_empty());
        assert_eq!(name, "get_weather");
        let parsed: Value = serde_json::from_str(args).expect("arguments are whole JSON");
        assert!(parsed.is_object(), "{args}");
    }
    let finish = chunks.iter().rev().find_map(|c| {
        c["choices"]
            .get(0)
            .and_then(|ch| ch["finish_reason"].as_str())
    });
    assert_eq!(finish, Some("tool_calls"));
}

#[test]
fn anthropic_errors_are_answered_in_openai_shape_and_an_overload_is_a_503() {
    // No Retry-After, and a 1 ms cool-down: each request meets the backend.
    let claude = Mock::start(&["--retry-after", "none"]);
    let openai = Mock::start(&[]);
    let log = TempDir::new("anthropic-errors");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let chat = |status: &str| {
        let r = gw.request(
            &Req::post("/v1/chat/completions", &chat_body("claude"))
                .header("x-mock-status", status),
        );
        // A 429 / 529 cools the backend for the 1 ms cool-down: past it before the next.
        std::thread::sleep(Duration::from_millis(20));
        r
    };
    let e = assert_openai_error(&chat("529"), 503);
    assert!(!e["message"].as_str().unwrap().is_empty(), "{e}");
    assert_openai_error(&chat("400"), 400);
    let e = assert_openai_error(&chat("429"), 429);
    assert_eq!(e["type"], "rate_limit_error", "{e}");
    // A request the Messages API cannot carry is refused before it goes anywhere.
    let before = claude.stat("requests");
    let r = gw.request(&Req::post(
        "/v1/chat/completions",
        &json!({"model": "claude", "n": 2, "messages": [{"role": "user", "content": "x"}]})
            .to_string(),
    ));
    assert_openai_error(&r, 400);
    assert_eq!(claude.stat("requests"), before);
    // Another endpoint has nowhere to go on this route.
    let r = gw.request(&Req::post(
        "/v1/embeddings",
        &json!({"model": "claude", "input": "x"}).to_string(),
    ));
    assert_openai_error(&r, 400);
}

#[test]
fn an_openai_primary_answering_503_fails_over_to_claude_and_the_client_gets_openai_shapes() {
    let claude = Mock::start(&["--tokens", "3"]);
    let openai = Mock::start(&["--fault", "status=503", "--retry-after", "none"]);
    let log = TempDir::new("anthropic-failover");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    let r = gw.chat(&chat_stream_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    let events = r.sse_events();
    assert!(events.last().unwrap().is_done(), "{}", r.dump());
    assert!(events.iter().filter(|e| e.content().is_some()).count() >= 3);
    assert_eq!(openai.stat("requests"), 2);
    assert_eq!(claude.stat("messages_requests"), 2);
    for rec in records(&log, 2) {
        assert_eq!(rec["cluster"], "claude", "{rec}");
        assert_eq!(rec["fallback_reason"], "status_5xx", "{rec}");
    }
}

/// The official `openai` SDK, unchanged, against Sluice, once on `claude` (translated to the
/// Anthropic-dialect mock, which checks each Messages request as strictly as the real API) and
/// once on `gpt-4o` (the OpenAI-dialect mock, passed through): system prompt and image, whole
/// and streamed, parallel tool calls whole and streamed (arguments in many deltas, assembled by
/// the SDK's own stream helper), and the turn that answers them with tool results.
#[test]
fn the_openai_python_sdk_reads_every_answer_from_either_dialect() {
    let claude = Mock::start(&["--tokens", "6"]);
    let openai = Mock::start(&["--tokens", "6"]);
    let log = TempDir::new("anthropic-sdk");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let script = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
model = sys.argv[2]
image = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
messages = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                 {"type": "image_url", "image_url": {"url": image}}]},
]
whole = client.chat.completions.create(model=model, messages=messages, max_tokens=50)
assert whole.choices[0].message.content, whole
assert whole.usage.completion_tokens == 6, whole.usage
text = ""
with client.chat.completions.create(model=model, messages=messages, stream=True,
                                    stream_options={"include_usage": True}) as stream:
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
assert text, "no streamed text"
assert usage and usage.completion_tokens == 6, usage
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ask = [{"role": "user", "content": "weather?"}]
calls = client.chat.completions.create(
    model=model, tools=tools, messages=ask, extra_headers={"x-mock-tool-calls": "2"})
made = calls.choices[0].message.tool_calls
assert calls.choices[0].finish_reason == "tool_calls", calls
assert len(made) == 2 and all(isinstance(json.loads(c.function.arguments), dict) for c in made), made
assert len({c.id for c in made}) == 2, made
# Streamed parallel calls, put together by the SDK's own stream helper.
fragments = 0
with client.beta.chat.completions.stream(
        model=model, tools=tools, messages=ask,
        extra_headers={"x-mock-tool-calls": "2"}) as stream:
    for event in stream:
        if event.type == "tool_calls.function.arguments.delta":
            fragments += 1
    final = stream.get_final_completion()
streamed = final.choices[0].message.tool_calls
assert final.choices[0].finish_reason == "tool_calls", final
assert len(streamed) == 2, final
for call in streamed:
    assert isinstance(json.loads(call.function.arguments), dict), call
assert fragments >= 4, f"arguments came in {fragments} deltas"
# The next turn: the calls and their results go back (to Claude as tool_use / tool_result).
turn = ask + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in made]},
] + [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in made]
answer = client.chat.completions.create(model=model, tools=tools, messages=turn)
assert answer.choices[0].message.content and answer.choices[0].finish_reason == "stop", answer
print("ok")
"#;
    for (model, mock) in [("claude", &claude), ("gpt-4o", &openai)] {
        let out = std::process::Command::new("python3")
            .args(["-c", script, &format!("http://{}/v1", gw.addr), model])
            .output()
            .expect("python3");
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
            "{model}: stdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(mock.stat("invalid_requests"), 0, "{model}");
    }
    assert_eq!(claude.stat("messages_requests"), 5);
    assert_eq!(openai.stat("messages_requests"), 0);
}

/// Claude first, GPT second: Anthropic's 529 (overloaded) and 429 (`rate_limit_error`, with its
/// `Retry-After`) move the request to the fallback, and the 429 cools Claude for that long; an
/// account out of credit (Anthropic's 400 "credit balance is too low", its spend limit) is
/// answered as it is — never retried elsewhere.
#[test]
fn claudes_overload_and_rate_limit_fall_back_and_its_spend_limit_does_not() {
    // No Retry-After unless a request asks for one: the 529 cools Claude for the 1 ms default.
    let claude = Mock::start(&["--retry-after", "none"]);
    let openai = Mock::start(&["--tokens", "2"]);
    let log = TempDir::new("anthropic-claude-first");
    let gw = Sluice::start(&config(&claude, &openai, &log).raw(
        r#"
[[routes]]
model = "claude-first"
groups = [{ targets = [{ cluster = "claude", model = "claude-mock" }] }, { targets = [{ cluster = "openai", model = "gpt-4o" }] }]
"#,
    ));
    let chat = || gw.chat(&chat_body("claude-first"));

    claude.set_fault(Some("status=529"));
    let r = chat();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.json()["object"], "chat.completion", "{}", r.dump());
    assert_eq!(claude.stat("messages_requests"), 1);
    assert_eq!(openai.stat("requests"), 1);

    // A 429 with Retry-After: 30 → the fallback answers, and Claude is left alone after it.
    claude.set_fault(Some("status=429"));
    std::thread::sleep(Duration::from_millis(50)); // past the 529's 1 ms cool-down
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("claude-first"))
            .header("x-mock-retry-after", "30"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(claude.stat("messages_requests"), 2);
    claude.set_fault(None);
    for _ in 0..3 {
        assert_eq!(chat().status, 200);
    }
    assert_eq!(
        claude.stat("messages_requests"),
        2,
        "Claude was asked again inside its Retry-After"
    );
    assert_eq!(openai.stat("requests"), 5);

    // Out of credit: Claude's 400 reaches the client in OpenAI's shape; GPT is never asked.
    let gw2 = Sluice::start(&config(&claude, &openai, &log).raw(
        r#"
[[routes]]
model = "claude-first"
groups = [{ targets = [{ cluster = "claude", model = "claude-mock" }] }, { targets = [{ cluster = "openai", model = "gpt-4o" }] }]
"#,
    ));
    claude.set_fault(Some("quota"));
    let r = gw2.chat(&chat_body("claude-first"));
    let e = assert_openai_error(&r, 400);
    assert!(
        e["message"].as_str().unwrap().contains("credit balance"),
        "{e}"
    );
    assert_eq!(openai.stat("requests"), 5, "a spend limit was retried");

    let recs = records(&log, 6);
    let reasons: Vec<&str> = recs
        .iter()
        .map(|r| r["fallback_reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons[..2], ["status_529", "status_429"], "{reasons:?}");
}

/// A client that leaves while the Anthropic upstream sends only pings (which translate to
/// nothing for an OpenAI client) is noticed: the relay's client watch counts from its last
/// output to the client, not from each upstream read, so reads that keep arriving every 20 ms
/// can't hold it off. The upstream is cancelled long before the next token (4 s).
#[test]
fn a_client_leaving_while_only_pings_arrive_cancels_the_upstream() {
    let claude = Mock::start(&["--tokens", "5", "--inter-token-ms", "4000"]);
    let openai = Mock::start(&[]);
    let log = TempDir::new("anthropic-pings");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let body = json!({
        "model": "claude",
        "stream": true,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string();
    let mut c = gw.conn();
    c.send(
        &Req::post("/v1/chat/completions", &body)
            .header("x-mock-ping-ms", "20")
            .build(),
    );
    assert_eq!(c.read_head().expect("stream head").status, 200);
    c.read_until_content_events(1);
    let left_at = Instant::now();
    drop(c);
    let cancelled = wait_until(Duration::from_secs(2), || {
        claude.stat("streams_aborted") == 1
    });
    assert!(
        cancelled && left_at.elapsed() < Duration::from_millis(3_000),
        "upstream not cancelled while pings arrived: {}",
        claude.stats()
    );
}

/// mock-llm answers exactly the tool calls `x-mock-tool-calls-json` names, so translation is
/// checked on names and arguments, not only on shapes: Claude's calls reach an OpenAI client
/// (whole and streamed) and an OpenAI upstream's calls reach an Anthropic client with the same
/// names and the same arguments, non-ASCII text included.
#[test]
fn scripted_tool_calls_keep_their_names_and_arguments_across_dialects() {
    let claude = Mock::start(&["--tokens", "2"]);
    let openai = Mock::start(&[]);
    let log = TempDir::new("anthropic-scripted-tools");
    let gw = Sluice::start(&config(&claude, &openai, &log));
    let script = json!([
        {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}},
        {"name": "lookup_time", "arguments": {"zone": "Europe/Oslo"}}
    ]);
    let want = [
        ("get_weather", json!({"city": "Zürich", "days": 3})),
        ("lookup_time", json!({"zone": "Europe/Oslo"})),
    ];
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "lookup_time", "parameters": {"type": "object"}}}
    ]);
    for stream in [false, true] {
        let body = json!({
            "model": "claude", "stream": stream, "tools": tools,
            "messages": [{"role": "user", "content": "weather and time?"}]
        });
        // A header value is ASCII (Sluice refuses obs-text): the script's non-ASCII text goes
        // as JSON escapes, which mock-llm's parse turns back into the same characters.
        let script = script.to_string().replace('ü', "\\u00fc");
        let r = gw.request(
            &Req::post("/v1/chat/completions", &body.to_string())
                .header("x-mock-tool-calls-json", &script),
        );
        assert_eq!(r.status, 200, "{}", r.dump());
        let calls: Vec<(String, String)> = if stream {
            let chunks: Vec<Value> = r.sse_events().iter().filter_map(SseEvent::json).collect();
            let calls = streamed_tool_calls(&chunks);
            calls
                .into_iter()
                .map(|(_, name, args)| (name, args))
                .collect()
        } else {
            let calls = r.json()["choices"][0]["message"]["tool_calls"].clone();
            let calls = calls.as_array().unwrap().clone();
            calls
                .iter()
                .map(|tc| {
                    let f = &tc["function"];
                    let name = f["name"].as_str().unwrap().to_string();
                    (name, f["arguments"].as_str().unwrap().to_string())
                })
                .collect()
        };
        let got: Vec<(String, Value)> = calls
            .into_iter()
            .map(|(name, args)| (name, serde_json::from_str(&args).expect("whole JSON")))
            .collect();
        let want: Vec<(String, Value)> = want
            .iter()
            .map(|(n, a)| (n.to_string(), a.clone()))
            .collect();
        assert_eq!(got, want, "stream: {stream}");
    }
    assert_eq!(claude.stat("invalid_requests"), 0);

    // An Anthropic client, an OpenAI upstream.
    let body = json!({
        "model": "gpt-4o", "max_tokens": 100,
        "tools": [
            {"name": "get_weather", "input_schema": {"type": "object"}},
            {"name": "lookup_time", "input_schema": {"type": "object"}}
        ],
        "messages": [{"role": "user", "content": "weather and time?"}]
    });
    let r = gw.request(
        &Req::post("/v1/messages", &body.to_string())
            .header("anthropic-version", "2023-06-01")
            .header(
                "x-mock-tool-calls-json",
                &script.to_string().replace('ü', "\\u00fc"),
            ),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let v = r.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let got: Vec<(String, Value)> = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| (b["name"].as_str().unwrap().to_string(), b["input"].clone()))
        .collect();
    let want: Vec<(String, Value)> = want
        .iter()
        .map(|(n, a)| (n.to_string(), a.clone()))
        .collect();
    assert_eq!(got, want);
}
