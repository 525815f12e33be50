//! The published wire shapes in `../testdata` replayed through the translators (issue #14,
//! item 5). `openai_*` are OpenAI-dialect answers (streams as the bytes of an SSE body, as the
//! relay's splitter sees them; whole bodies; error bodies), `anthropic_request_*` Anthropic
//! Messages requests; each file says (SSE comments) or this module says where its shape comes
//! from. `openai_stream_tools_interleaved.sse` alone is synthetic: no provider is known to
//! interleave parallel calls, but the format allows it.
//!
//! Where the JSON files' shapes come from: `openai_chat_completion_tools.json`, OpenAI's API
//! reference (the chat completion object, tool calls, `prompt_tokens_details`);
//! `openai_chat_completion_reasoning.json`, DeepSeek's reasoning-model guide
//! (`reasoning_content`, `prompt_cache_hit_tokens`); `openai_error_*.json`, OpenAI's error
//! codes (`context_length_exceeded`, `rate_limit_exceeded` with type `tokens`) and vLLM's
//! `ErrorResponse` (`"object": "error"`, a numeric `code`); `anthropic_request_*.json`,
//! Anthropic's Messages API reference and guides (prompt caching's system blocks with
//! `cache_control`, vision's `base64` and `url` sources, tool use's `tool_use` /
//! `tool_result` turns with content blocks and `is_error`, `tool_choice` with
//! `disable_parallel_tool_use`, `custom` tools) and the shape Claude Code sends (text blocks
//! of `<system-reminder>`, `thinking` blocks with signatures in the history).
//!
//! Every translated stream is checked the way the Anthropic SDKs' stream accumulators need it
//! ([`accumulate`]): `message_start` first; content block indexes counting up from 0; each
//! block's start, deltas (of its own kind) and stop before the next block starts;
//! `message_delta` with no block open, then `message_stop`, then nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};

use super::*;
use crate::openai::meter::{event_data, SseMeter, SseSplitter};

const STREAM_TEXT: &str = include_str!("../testdata/openai_stream_text.sse");
const STREAM_TOOLS: &str = include_str!("../testdata/openai_stream_parallel_tools.sse");
const STREAM_DEEPSEEK: &str = include_str!("../testdata/openai_stream_reasoning_deepseek.sse");
const STREAM_VLLM: &str = include_str!("../testdata/openai_stream_reasoning_vllm_tool.sse");
const STREAM_ERROR: &str = include_str!("../testdata/openai_stream_error.sse");
const STREAM_INTERLEAVED: &str = include_str!("../testdata/openai_stream_tools_interleaved.sse");
const STREAMS: [(&str, &str); 6] = [
    ("text", STREAM_TEXT),
    ("parallel_tools", STREAM_TOOLS),
    ("deepseek", STREAM_DEEPSEEK),
    ("vllm", STREAM_VLLM),
    ("error", STREAM_ERROR),
    ("interleaved", STREAM_INTERLEAVED),
];

/// The data of each event of an SSE body, split the way the relay splits it.
fn sse_data(body: &str) -> Vec<Vec<u8>> {
    let mut splitter = SseSplitter::new();
    let mut buf = Vec::new();
    let mut events = Vec::new();
    splitter.feed(body.as_bytes(), |event| {
        if let Some(data) = event_data(event, &mut buf) {
            events.push(data.to_vec());
        }
    });
    events
}

/// Feed every event; the output, and its length after each event.
fn translate(body: &str) -> (Vec<u8>, Vec<usize>) {
    let mut t = ChatStreamToMessages::new("claude-sonnet-4-5");
    let mut out = Vec::new();
    let mut lengths = Vec::new();
    for data in sse_data(body) {
        t.event(&data, &mut out);
        lengths.push(out.len());
    }
    (out, lengths)
}

/// Anthropic SSE text as (event name, data), checking the framing: `event:` then one `data:`
/// line whose `type` is the event's name, a blank line after each.
fn anthropic_events(out: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(out).unwrap();
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text}");
    text.split_terminator("\n\n")
        .map(|event| {
            let (name, data) = event.split_once('\n').expect(event);
            let name = name.strip_prefix("event: ").expect(event);
            let data = data.strip_prefix("data: ").expect(event);
            assert!(!data.contains('\n'), "{event}");
            let data: Value = serde_json::from_str(data).expect(event);
            assert_eq!(data["type"], name, "{event}");
            (name.to_owned(), data)
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq)]
enum Block {
    Text(String),
    Thinking(String),
    ToolUse {
        id: String,
        name: String,
        /// The `partial_json` fragments joined, as sent.
        json: String,
        input: Value,
    },
}

#[derive(Debug, Default)]
struct Accumulated {
    id: String,
    model: String,
    blocks: Vec<Block>,
    stop_reason: Option<String>,
    stop_sequence: Value,
    usage: Value,
    stopped: bool,
    error: Option<Value>,
}

/// Rebuild the message as the Anthropic SDKs' accumulators do, asserting the order they need.
fn accumulate(events: &[(String, Value)]) -> Accumulated {
    let mut acc = Accumulated::default();
    let mut started = false;
    let mut delta_seen = false;
    let mut open: Option<usize> = None;
    for (i, (name, data)) in events.iter().enumerate() {
        assert!(
            acc.error.is_none() && !acc.stopped,
            "event {i} ({name}) after the stream ended"
        );
        let index = data["index"].as_u64().map(|n| n as usize);
        let in_content = || assert!(started && !delta_seen, "event {i} ({name}) out of place");
        match name.as_str() {
            "message_start" => {
                assert_eq!(i, 0, "message_start comes first");
                let m = &data["message"];
                assert_eq!(
                    (&m["type"], &m["role"], &m["content"]),
                    (&json!("message"), &json!("assistant"), &json!([]))
                );
                assert!(m["stop_reason"].is_null());
                acc.id = m["id"].as_str().unwrap().to_owned();
                acc.model = m["model"].as_str().unwrap().to_owned();
                acc.usage = m["usage"].clone();
                started = true;
            }
            "content_block_start" => {
                in_content();
                assert_eq!(open, None, "block {index:?} starts while {open:?} is open");
                assert_eq!(index, Some(acc.blocks.len()), "indexes count up from 0");
                let b = &data["content_block"];
                acc.blocks.push(match b["type"].as_str().unwrap() {
                    "text" => {
                        assert_eq!(b["text"], "");
                        Block::Text(String::new())
                    }
                    "thinking" => {
                        assert_eq!((&b["thinking"], &b["signature"]), (&json!(""), &json!("")));
                        Block::Thinking(String::new())
                    }
                    "tool_use" => {
                        assert_eq!(b["input"], json!({}));
                        Block::ToolUse {
                            id: b["id"].as_str().unwrap().to_owned(),
                            name: b["name"].as_str().unwrap().to_owned(),
                            json: String::new(),
                            input: Value::Null,
                        }
                    }
                    other => panic!("block type {other}"),
                });
                open = index;
            }
            "content_block_delta" => {
                in_content();
                assert_eq!(index, open, "delta for a block that is not open");
                let d = &data["delta"];
                match (acc.blocks.last_mut().unwrap(), d["type"].as_str().unwrap()) {
                    (Block::Text(t), "text_delta") => t.push_str(d["text"].as_str().unwrap()),
                    (Block::Thinking(t), "thinking_delta") => {
                        t.push_str(d["thinking"].as_str().unwrap());
                    }
                    (Block::ToolUse { json, .. }, "input_json_delta") => {
                        json.push_str(d["partial_json"].as_str().unwrap());
                    }
                    (block, kind) => panic!("{kind} for {block:?}"),
                }
            }
            "content_block_stop" => {
                in_content();
                assert_eq!(index, open, "stop for a block that is not open");
                if let Some(Block::ToolUse { json, input, .. }) = acc.blocks.last_mut() {
                    *input = if json.is_empty() {
                        json!({})
                    } else {
                        serde_json::from_str(json).expect("tool input is JSON")
                    };
                    assert!(input.is_object(), "tool input is an object: {json}");
                }
                open = None;
            }
            "message_delta" => {
                in_content();
                assert_eq!(open, None, "message_delta with block {open:?} open");
                delta_seen = true;
                acc.stop_reason = Some(data["delta"]["stop_reason"].as_str().unwrap().to_owned());
                acc.stop_sequence = data["delta"]["stop_sequence"].clone();
                // The SDKs take output_tokens, and the other counts when present.
                for (k, v) in data["usage"].as_object().unwrap() {
                    if !v.is_null() {
                        acc.usage[k] = v.clone();
                    }
                }
            }
            "message_stop" => {
                assert!(delta_seen, "message_delta before message_stop");
                acc.stopped = true;
            }
            "error" => acc.error = Some(data["error"].clone()),
            other => panic!("event {other}"),
        }
    }
    if acc.error.is_none() && !events.is_empty() {
        assert!(
            acc.stopped,
            "a stream without an error ends with message_stop"
        );
    }
    acc
}

fn replay(body: &str) -> Accumulated {
    accumulate(&anthropic_events(&translate(body).0))
}

/// What the OpenAI stream said, gathered independently of the translator: text, reasoning,
/// each call's (id, name, arguments joined).
fn openai_content(body: &str) -> (String, String, Vec<(String, String, String)>) {
    let (mut text, mut reasoning) = (String::new(), String::new());
    let mut calls: Vec<(u64, String, String, String)> = Vec::new();
    for data in sse_data(body) {
        let Ok(v) = serde_json::from_slice::<Value>(&data) else {
            continue;
        };
        for choice in v["choices"].as_array().into_iter().flatten() {
            let d = &choice["delta"];
            text.push_str(d["content"].as_str().unwrap_or_default());
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or_default());
            for c in d["tool_calls"].as_array().into_iter().flatten() {
                let key = c["index"].as_u64().unwrap();
                let at = match calls.iter().position(|x| x.0 == key) {
                    Some(at) => at,
                    None => {
                        calls.push((key, String::new(), String::new(), String::new()));
                        calls.len() - 1
                    }
                };
                let call = &mut calls[at];
                call.1.push_str(c["id"].as_str().unwrap_or_default());
                call.2
                    .push_str(c["function"]["name"].as_str().unwrap_or_default());
                call.3
                    .push_str(c["function"]["arguments"].as_str().unwrap_or_default());
            }
        }
    }
    let calls = calls.into_iter().map(|(_, id, n, a)| (id, n, a)).collect();
    (text, reasoning, calls)
}

fn tool_uses(acc: &Accumulated) -> Vec<(String, String, String)> {
    acc.blocks
        .iter()
        .filter_map(|b| match b {
            Block::ToolUse { id, name, json, .. } => Some((id.clone(), name.clone(), json.clone())),
            _ => None,
        })
        .collect()
}

fn usage(input: u64, cache_read: u64, output: u64) -> Value {
    json!({
        "input_tokens": input,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cache_read,
        "output_tokens": output,
    })
}

#[test]
fn anthropic_every_fixture_stream_is_well_formed_and_loses_nothing() {
    for (name, body) in STREAMS {
        let acc = replay(body);
        let (text, reasoning, calls) = openai_content(body);
        let ours_text: String = acc
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        let ours_thinking: String = acc
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Thinking(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        // Whitespace alone opens no block (the vLLM fixture's "\n\n" before its tool call).
        assert_eq!(ours_text, text.trim_end(), "{name}: text");
        assert_eq!(ours_thinking, reasoning, "{name}: thinking");
        // Tool inputs reassemble to the upstream's arguments, byte for byte.
        assert_eq!(tool_uses(&acc), calls, "{name}: tool calls");
        for block in &acc.blocks {
            if let Block::ToolUse { json, input, .. } = block {
                assert_eq!(input, &serde_json::from_str::<Value>(json).unwrap());
            }
        }
        assert_eq!(acc.model, "claude-sonnet-4-5", "{name}");
        assert!(acc.id.starts_with("msg_"), "{name}");
    }
}

#[test]
fn anthropic_stream_text_fixture() {
    let acc = replay(STREAM_TEXT);
    assert_eq!(acc.id, "msg_chatcmpl-CEJ3JMCJhslNkat6pptAsx4vc7A4O");
    assert_eq!(
        acc.blocks,
        [Block::Text(
            "It's raining in San Francisco \u{2014} \"wet\".\nStay dry! ☔".into()
        )]
    );
    assert_eq!(acc.stop_reason.as_deref(), Some("end_turn"));
    assert_eq!(acc.stop_sequence, Value::Null);
    // prompt 1262 of which 1152 cached; 14 out.
    assert_eq!(acc.usage, usage(110, 1152, 14));
    assert!(acc.stopped);
}

#[test]
fn anthropic_stream_text_goes_out_as_it_arrives() {
    let events = sse_data(STREAM_TEXT);
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    t.event(&events[0], &mut out);
    let names: Vec<String> = anthropic_events(&out).into_iter().map(|e| e.0).collect();
    assert_eq!(
        names,
        ["message_start"],
        "the first chunk starts the message"
    );
    for data in &events[1..7] {
        let before = out.len();
        t.event(data, &mut out);
        let new = anthropic_events(&out[before..]);
        let text: String = serde_json::from_slice::<Value>(data).unwrap()["choices"][0]["delta"]
            ["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(
            new.last().unwrap().1["delta"]["text"],
            text,
            "each chunk's text at once"
        );
    }
    assert!(!t.ended());
    // The finish chunk closes the block; the usage chunk writes nothing; [DONE] ends it.
    let before = out.len();
    t.event(&events[7], &mut out);
    let names: Vec<String> = anthropic_events(&out[before..])
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(names, ["content_block_stop"]);
    let before = out.len();
    t.event(&events[8], &mut out);
    assert_eq!(out.len(), before);
    t.event(&events[9], &mut out);
    assert!(t.ended());
    let before = out.len();
    t.event(b"[DONE]", &mut out);
    t.event(&events[1], &mut out);
    t.upstream_closed(&mut out);
    assert_eq!(out.len(), before, "nothing after the end");
}

#[test]
fn anthropic_stream_parallel_tools_fixture() {
    let acc = replay(STREAM_TOOLS);
    let inputs: Vec<&Value> = acc
        .blocks
        .iter()
        .map(|b| match b {
            Block::ToolUse { input, .. } => input,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        inputs,
        [
            &json!({"location": "San Francisco, USA"}),
            &json!({"location": "Los Angeles, USA"})
        ]
    );
    assert_eq!(
        tool_uses(&acc)
            .iter()
            .map(|(id, name, _)| (id.as_str(), name.as_str()))
            .collect::<Vec<_>>(),
        [
            ("call_DrAmcQ25jYywGzd5JG1CZJ0y", "get_weather"),
            ("call_Vt5XyUH8g0wV2BBuBwQpS6uK", "get_weather")
        ]
    );
    assert_eq!(acc.stop_reason.as_deref(), Some("tool_use"));
    assert_eq!(acc.usage, usage(84, 0, 46));
}

#[test]
fn anthropic_stream_sequential_tool_calls_are_not_held() {
    // Call 0's arguments close with its last fragment, so call 1's block starts with call 1's
    // first delta, and every fragment goes out with the chunk that brought it.
    let events = sse_data(STREAM_TOOLS);
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    for (k, data) in events.iter().enumerate() {
        let before = out.len();
        t.event(data, &mut out);
        let new = anthropic_events(&out[before..]);
        let names: Vec<&str> = new.iter().map(|e| e.0.as_str()).collect();
        let v: Value = serde_json::from_slice(data).unwrap_or(Value::Null);
        let call = &v["choices"][0]["delta"]["tool_calls"][0];
        match k {
            0 => assert_eq!(names, ["message_start", "content_block_start"]),
            8 => {
                assert_eq!(names, ["content_block_stop", "content_block_start"]);
                assert_eq!(
                    new[1].1["content_block"]["id"],
                    "call_Vt5XyUH8g0wV2BBuBwQpS6uK"
                );
            }
            _ if call.is_object() => {
                assert_eq!(names, ["content_block_delta"], "chunk {k}");
                assert_eq!(
                    new[0].1["delta"]["partial_json"],
                    call["function"]["arguments"]
                );
            }
            _ => {}
        }
    }
}

#[test]
fn anthropic_stream_deepseek_reasoning_fixture() {
    let acc = replay(STREAM_DEEPSEEK);
    assert_eq!(
        acc.blocks,
        [
            Block::Thinking(
                "Okay, the user asks which is greater: 9.11 or 9.8.\n\nCompare the tenths: 8 > 1."
                    .into()
            ),
            Block::Text("9.8 is greater than 9.11.".into()),
        ]
    );
    assert_eq!(acc.stop_reason.as_deref(), Some("end_turn"));
    // Usage on the finish chunk: prompt 84 with 64 cache hits, 57 out.
    assert_eq!(acc.usage, usage(20, 64, 57));
}

#[test]
fn anthropic_stream_vllm_reasoning_then_tool_fixture() {
    let acc = replay(STREAM_VLLM);
    assert_eq!(acc.blocks.len(), 2, "{:?}", acc.blocks);
    assert_eq!(
        acc.blocks[0],
        Block::Thinking("The user wants the time in Tokyo; call get_time.".into())
    );
    let Block::ToolUse {
        id, name, input, ..
    } = &acc.blocks[1]
    else {
        panic!("{:?}", acc.blocks[1]);
    };
    assert_eq!(
        (id.as_str(), name.as_str(), input),
        (
            "chatcmpl-tool-8f0e2d4c6b1a4e3f",
            "get_time",
            &json!({"timezone": "Asia/Tokyo"})
        )
    );
    assert_eq!(acc.stop_reason.as_deref(), Some("tool_use"));
    assert_eq!(acc.usage, usage(231, 0, 52));
}

#[test]
fn anthropic_stream_error_fixture() {
    let (out, _) = translate(STREAM_ERROR);
    let events = anthropic_events(&out);
    let acc = accumulate(&events);
    assert_eq!(acc.blocks, [Block::Text("Once upon a time".into())]);
    assert!(!acc.stopped);
    assert_eq!(
        acc.error,
        Some(
            json!({"type": "api_error", "message": "The server had an error while processing your request. Sorry about that!"})
        )
    );
    assert_eq!(
        events.last().unwrap().0,
        "error",
        "the error ends it; [DONE] after is ignored"
    );
    // vLLM's older shape, and an overload, mid-stream.
    for (data, kind) in [
        (
            r#"{"object":"error","message":"m","type":"BadRequestError","param":null,"code":400}"#,
            "invalid_request_error",
        ),
        (
            r#"{"error":{"message":"m","type":"overloaded_error"}}"#,
            "overloaded_error",
        ),
        (r#"{"error":"m"}"#, "api_error"),
    ] {
        let mut t = ChatStreamToMessages::new("c");
        let mut out = Vec::new();
        t.event(data.as_bytes(), &mut out);
        assert!(t.ended());
        let events = anthropic_events(&out);
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].1,
            json!({"type": "error", "error": {"type": kind, "message": "m"}})
        );
    }
}

#[test]
fn anthropic_stream_interleaved_tool_calls_fixture() {
    let (out, lengths) = translate(STREAM_INTERLEAVED);
    let acc = accumulate(&anthropic_events(&out));
    assert_eq!(acc.blocks[0], Block::Text("Checking both cities.".into()));
    let inputs: Vec<(&str, &Value)> = acc.blocks[1..]
        .iter()
        .map(|b| match b {
            Block::ToolUse { id, input, .. } => (id.as_str(), input),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        inputs,
        [
            ("call_a", &json!({"city": "Paris, {x}", "units": "c"})),
            (
                "call_b",
                &json!({"tz": "Europe/Paris", "fmt": [1, {"a": "}"}]})
            ),
        ]
    );
    assert_eq!(acc.stop_reason.as_deref(), Some("tool_use"));
    assert_eq!(acc.usage, usage(120, 0, 40));
    // Call 0 streamed as it came; call 1 was held until call 0's arguments closed (the
    // chunk before the finish), then sent whole.
    let events = sse_data(STREAM_INTERLEAVED);
    let last_call_chunk = events.len() - 3;
    let before = lengths[last_call_chunk - 1];
    let new = anthropic_events(&out[before..lengths[last_call_chunk]]);
    let names: Vec<&str> = new.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta"
        ]
    );
    assert_eq!(
        new[3].1["delta"]["partial_json"],
        r#"{"tz": "Europe/Paris", "fmt": [1, {"a": "}"}]}"#
    );
}

#[test]
fn anthropic_stream_held_content_is_bounded() {
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    let chunk = |call: &str| {
        format!(r#"{{"id":"x","choices":[{{"index":0,"delta":{{"tool_calls":[{call}]}}}}]}}"#)
    };
    t.event(
        chunk(r#"{"index":0,"id":"a","function":{"name":"f","arguments":"{\"k\": \""}}"#)
            .as_bytes(),
        &mut out,
    );
    let piece = "x".repeat(64 * 1024);
    for _ in 0..(super::stream::MAX_HELD / piece.len() + 1) {
        assert!(!t.ended());
        let call =
            format!(r#"{{"index":1,"id":"b","function":{{"name":"g","arguments":"{piece}"}}}}"#);
        t.event(chunk(&call).as_bytes(), &mut out);
    }
    assert!(t.ended());
    let events = anthropic_events(&out);
    assert_eq!(events.last().unwrap().1["error"]["type"], "api_error");
    accumulate(&events);
}

#[test]
fn anthropic_stream_cut_short_or_without_done() {
    // Finished but no [DONE]: completed as [DONE] would.
    let events = sse_data(STREAM_TEXT);
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    for data in &events[..events.len() - 1] {
        t.event(data, &mut out);
    }
    t.upstream_closed(&mut out);
    let acc = accumulate(&anthropic_events(&out));
    assert!(acc.stopped && acc.stop_reason.as_deref() == Some("end_turn"));
    // Cut before the finish: an error event, so the client can't take it for whole.
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    for data in &events[..4] {
        t.event(data, &mut out);
    }
    t.upstream_closed(&mut out);
    let acc = accumulate(&anthropic_events(&out));
    assert!(!acc.stopped);
    assert_eq!(acc.error.unwrap()["type"], "api_error");
    // An empty stream that says [DONE] is still a whole (empty) message.
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    t.event(b"[DONE]", &mut out);
    let acc = accumulate(&anthropic_events(&out));
    assert!(acc.stopped && acc.blocks.is_empty() && acc.id == "msg_sluice");
}

#[test]
fn anthropic_stream_odd_chunks() {
    let mut t = ChatStreamToMessages::new("c");
    let mut out = Vec::new();
    for data in [
        // Azure's prompt-filter chunk: no id, no choices.
        r#"{"id":"","choices":[],"created":0,"model":"","object":"","prompt_filter_results":[{"prompt_index":0,"content_filter_results":{}}]}"#,
        "not json",
        ": comment",
        r#"{"id":"c1","choices":[{"index":1,"delta":{"content":"other choice"}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":"  "}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"Hi","reasoning":"r","reasoning_content":"r"}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"refusal":" no."}}]}"#,
        // A call without id or index; whitespace after its arguments closed still goes out
        // (its block is open), so the input stays byte for byte.
        r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":" "}}]}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":"\n\nHuman:"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
        "[DONE]",
    ] {
        t.event(data.as_bytes(), &mut out);
    }
    let acc = accumulate(&anthropic_events(&out));
    assert_eq!(acc.id, "msg_c1");
    assert_eq!(
        acc.blocks,
        [
            Block::Thinking("r".into()),
            Block::Text("  Hi no.".into()),
            Block::ToolUse {
                id: "toolu_c1_0".into(),
                name: "f".into(),
                json: "{} ".into(),
                input: json!({})
            },
        ]
    );
    // A refusal is a refusal whatever the finish reason.
    assert_eq!(acc.stop_reason.as_deref(), Some("refusal"));
    assert_eq!(acc.stop_sequence, "\n\nHuman:");
    assert_eq!(acc.usage, usage(3, 0, 4));
}

#[test]
fn anthropic_stream_usage_matches_the_openai_meter() {
    // Metering the translated stream the Anthropic way gives the numbers the OpenAI meter
    // reads from the upstream's stream: limits and cost see one count whatever the dialect.
    for (name, body) in STREAMS {
        let mut openai = SseMeter::new();
        openai.feed(body.as_bytes(), crate::sys::clock::Mono::now());
        let want = openai.summary().usage;
        let (out, _) = translate(body);
        let mut anthropic = AnthropicStreamMeter::new();
        for (event, data) in anthropic_events(&out) {
            anthropic.on_event(event.as_bytes(), data.to_string().as_bytes());
        }
        let got = anthropic.usage();
        match want {
            None => assert!(
                got.is_none_or(|g| g.prompt_tokens == 0 && g.completion_tokens == 0),
                "{name}: {got:?}"
            ),
            Some(w) => {
                let g = got.unwrap();
                assert_eq!(
                    (
                        g.prompt_tokens,
                        g.completion_tokens,
                        g.cached_tokens,
                        g.cache_write_tokens
                    ),
                    (
                        w.prompt_tokens,
                        w.completion_tokens,
                        w.cached_tokens,
                        w.cache_write_tokens
                    ),
                    "{name}"
                );
            }
        }
    }
}

// Whole bodies.

fn message(body: &str) -> Value {
    let mut out = Vec::new();
    chat_to_message(body.as_bytes(), "claude-sonnet-4-5", &mut out).unwrap();
    serde_json::from_slice(&out).unwrap()
}

#[test]
fn anthropic_chat_completion_tools_fixture() {
    let m = message(include_str!(
        "../testdata/openai_chat_completion_tools.json"
    ));
    assert_eq!(
        m,
        json!({
            "id": "msg_chatcmpl-CEMqK1mVYdp8qfGd3e1w0dMzX7rTb",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [
                {"type": "text", "text": "Let me look both up."},
                {"type": "tool_use", "id": "call_DrAmcQ25jYywGzd5JG1CZJ0y", "name": "get_weather",
                 "input": {"location": "San Francisco, USA", "units": ["c", "f"]}},
                {"type": "tool_use", "id": "call_Vt5XyUH8g0wV2BBuBwQpS6uK", "name": "get_time", "input": {}},
            ],
            "stop_reason": "tool_use",
            "stop_sequence": null,
            "usage": usage(86, 1920, 300),
        })
    );
}

#[test]
fn anthropic_chat_completion_reasoning_fixture() {
    let m = message(include_str!(
        "../testdata/openai_chat_completion_reasoning.json"
    ));
    assert_eq!(
        m["content"],
        json!([
            {"type": "thinking", "thinking": "Compare the tenths: 8 > 1, so 9.8 is larger.", "signature": ""},
            {"type": "text", "text": "9.8 is greater than 9.11."},
        ])
    );
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(m["usage"], usage(20, 64, 57));
}

#[test]
fn anthropic_error_fixtures() {
    for (status, body, kind, message) in [
        (
            400,
            include_str!("../testdata/openai_error_context_length.json"),
            "invalid_request_error",
            "This model's maximum context length is 128000 tokens.",
        ),
        (
            429,
            include_str!("../testdata/openai_error_rate_limit.json"),
            "rate_limit_error",
            "Rate limit reached for gpt-4o",
        ),
        (
            404,
            include_str!("../testdata/openai_error_vllm_not_found.json"),
            "not_found_error",
            "The model `gpt-5` does not exist.",
        ),
    ] {
        let mut out = Vec::new();
        assert_eq!(
            error_to_anthropic(status, body.as_bytes(), &mut out),
            status
        );
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], kind);
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(message),
            "{v}"
        );
    }
}

// Requests.

fn chat(body: &str) -> Value {
    let r = inspect_messages(body.as_bytes()).unwrap();
    assert_eq!(
        &body[r.model_span.0..r.model_span.1],
        format!("\"{}\"", r.model)
    );
    let mut out = Vec::new();
    messages_to_chat(body.as_bytes(), "mapped", &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(!text.contains("cache_control"), "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], "mapped");
    assert_eq!(v["max_tokens"], r.max_tokens);
    assert_eq!(v.get("stream").is_some(), r.stream);
    v
}

#[test]
fn anthropic_request_system_string_fixture() {
    let body = include_str!("../testdata/anthropic_request_system_string.json");
    let r = inspect_messages(body.as_bytes()).unwrap();
    assert_eq!(
        (r.model.as_str(), r.stream, r.max_tokens),
        ("claude-sonnet-4-5", false, 1024)
    );
    assert_eq!(
        chat(body),
        json!({
            "model": "mapped",
            "max_tokens": 1024,
            "messages": [
                {"role": "system", "content": "You are a seasoned data scientist at a Fortune 500 company."},
                {"role": "user", "content": "Hello, Claude"},
                {"role": "assistant", "content": "Hi! How can I help?"},
                {"role": "user", "content": "Analyze this dataset for anomalies."},
            ],
            "temperature": 0.2,
            "top_p": 0.9,
            "stop": ["\n\nHuman:", "END"],
            "user": "13803d75-b4b5-4c3e-b2a2-6f21399b021b",
        }),
        "top_k, service_tier and the rest of metadata are dropped"
    );
}

#[test]
fn anthropic_request_system_blocks_with_cache_control_fixture() {
    let c = chat(include_str!(
        "../testdata/anthropic_request_system_blocks_cache.json"
    ));
    assert_eq!(
        c["messages"],
        json!([
            {"role": "system", "content": "You are an AI assistant tasked with analyzing literary works. Your goal is to provide insightful commentary on themes, characters, and writing style.\n\n\n<the entire contents of 'Pride and Prejudice'>"},
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                {"type": "text", "text": "Analyze the major themes in 'Pride and Prejudice'."},
            ]},
        ])
    );
    assert_eq!(c["stream"], true);
    assert_eq!(c["stream_options"], json!({"include_usage": true}));
    assert!(c.get("thinking").is_none());
}

#[test]
fn anthropic_request_images_fixture() {
    let c = chat(include_str!("../testdata/anthropic_request_images.json"));
    let parts = c["messages"][0]["content"].as_array().unwrap();
    let kinds: Vec<&str> = parts.iter().map(|p| p["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["text", "image_url", "text", "image_url", "text"]);
    assert!(parts[1]["image_url"]["url"]
        .as_str()
        .unwrap()
        .starts_with("data:image/jpeg;base64,/9j/4AAQSkZJRg"));
    assert_eq!(
        parts[3],
        json!({"type": "image_url", "image_url": {"url": "https://upload.wikimedia.org/wikipedia/commons/b/b5/Iridescent.green.sweat.bee1.jpg"}})
    );
}

#[test]
fn anthropic_request_tool_turns_fixture() {
    let c = chat(include_str!(
        "../testdata/anthropic_request_tool_turns.json"
    ));
    assert_eq!(
        c["tools"],
        json!([
            {"type": "function", "function": {
                "name": "get_weather",
                "description": "Get the current weather in a given location",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["location"],
                },
            }},
            {"type": "function", "function": {
                "name": "get_time",
                "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
            }},
        ])
    );
    assert_eq!(c["tool_choice"], "auto");
    assert_eq!(c["parallel_tool_calls"], false);
    let m = c["messages"].as_array().unwrap();
    let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(
        roles,
        [
            "user",
            "assistant",
            "tool",
            "tool",
            "user",
            "assistant",
            "tool"
        ]
    );
    // The thinking block is dropped; text and tool calls stay.
    assert_eq!(m[1]["content"], "I'll check both for you.");
    let calls = m[1]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (
            &calls[0]["id"],
            &calls[0]["type"],
            &calls[0]["function"]["name"]
        ),
        (
            &json!("toolu_01A09q90qw90lq917835lq9"),
            &json!("function"),
            &json!("get_weather")
        )
    );
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(
        args,
        json!({"location": "San Francisco, CA", "unit": "celsius"})
    );
    assert_eq!(
        m[2],
        json!({"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "15 degrees"})
    );
    assert_eq!(
        m[3],
        json!({"role": "tool", "tool_call_id": "toolu_01B7n3k4m5p6q7r8s9t0u1v2", "content": [
            {"type": "text", "text": "It is 09:41"},
            {"type": "text", "text": " in New York."},
        ]})
    );
    // The tool result's image, then the user's own text, after the tool messages.
    assert_eq!(
        m[4],
        json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "text", "text": "Thanks! Which city is warmer?"},
        ]})
    );
    assert_eq!(m[5]["content"], Value::Null);
    assert_eq!(m[5]["tool_calls"][0]["function"]["arguments"], "{}");
    assert_eq!(
        m[6],
        json!({"role": "tool", "tool_call_id": "toolu_01C0000000000000000000", "content": "location is required"})
    );
}

#[test]
fn anthropic_request_tool_choice_fixtures() {
    let any = chat(include_str!(
        "../testdata/anthropic_request_tool_choice_any.json"
    ));
    assert_eq!(any["tool_choice"], "required");
    assert!(any.get("parallel_tool_calls").is_none());
    let tool = chat(include_str!(
        "../testdata/anthropic_request_tool_choice_tool.json"
    ));
    assert_eq!(
        tool["tool_choice"],
        json!({"type": "function", "function": {"name": "record_summary"}})
    );
    assert!(
        tool.get("parallel_tool_calls").is_none(),
        "disable_parallel_tool_use: false"
    );
    assert_eq!(tool["tools"].as_array().unwrap().len(), 2);
    assert_eq!(
        tool["tools"][1]["function"],
        json!({"name": "get_weather", "parameters": {"type": "object", "properties": {}}})
    );
    let none = chat(include_str!(
        "../testdata/anthropic_request_tool_choice_none.json"
    ));
    assert_eq!(none["tool_choice"], "none");
}

#[test]
fn anthropic_tool_calls_round_trip_through_the_client() {
    // The answer the client got from the parallel-tools stream, sent back as the next turn
    // with its tool results: the upstream sees its own call ids and arguments again.
    let acc = replay(STREAM_TOOLS);
    let content: Vec<Value> = acc
        .blocks
        .iter()
        .map(|b| match b {
            Block::ToolUse {
                id, name, input, ..
            } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
            other => panic!("{other:?}"),
        })
        .collect();
    let results: Vec<Value> = tool_uses(&acc)
        .iter()
        .map(|(id, _, _)| json!({"type": "tool_result", "tool_use_id": id, "content": "sunny"}))
        .collect();
    let request = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [
            {"role": "user", "content": "Is the weather better in San Francisco or Los Angeles?"},
            {"role": "assistant", "content": content},
            {"role": "user", "content": results},
        ],
    });
    let c = chat(&request.to_string());
    let (_, _, calls) = openai_content(STREAM_TOOLS);
    let sent = c["messages"][1]["tool_calls"].as_array().unwrap();
    assert_eq!(sent.len(), calls.len());
    for (sent, (id, name, arguments)) in sent.iter().zip(&calls) {
        assert_eq!(sent["id"], id.as_str());
        assert_eq!(sent["function"]["name"], name.as_str());
        let back: Value =
            serde_json::from_str(sent["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(arguments).unwrap());
    }
    for (k, (id, _, _)) in calls.iter().enumerate() {
        assert_eq!(c["messages"][2 + k]["tool_call_id"], id.as_str());
    }
}

#[test]
fn anthropic_body_usage_matches_the_openai_meter() {
    // A translated whole body, metered the Anthropic way, gives the OpenAI meter's numbers.
    for body in [
        include_str!("../testdata/openai_chat_completion_tools.json"),
        include_str!("../testdata/openai_chat_completion_reasoning.json"),
    ] {
        let mut openai = SseMeter::new();
        openai.on_json_body(&mut body.as_bytes().to_vec(), 0);
        let want = openai.summary().usage.unwrap();
        let mut out = Vec::new();
        chat_to_message(body.as_bytes(), "c", &mut out).unwrap();
        let got: Usage = message_usage(&out).unwrap();
        assert_eq!(
            (
                got.prompt_tokens,
                got.completion_tokens,
                got.cached_tokens,
                got.cache_write_tokens
            ),
            (
                want.prompt_tokens,
                want.completion_tokens,
                want.cached_tokens,
                want.cache_write_tokens
            )
        );
    }
}

#[test]
fn anthropic_count_tokens_and_rejections_answer_in_anthropic_shapes() {
    let body = br#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hello"}]}"#;
    let r: MessagesRequest = inspect_count_tokens(body).unwrap();
    assert_eq!(
        (r.model.as_str(), r.max_tokens, r.stream),
        ("claude-sonnet-4-5", 0, false)
    );
    let mut out = Vec::new();
    count_tokens_body(14, &mut out);
    assert_eq!(
        serde_json::from_slice::<Value>(&out).unwrap(),
        json!({"input_tokens": 14})
    );
    // The same body on /v1/messages lacks max_tokens: a 400 the Anthropic SDK parses.
    let e = inspect_messages(body).unwrap_err();
    let mut out = Vec::new();
    e.write_body(&mut out);
    assert_eq!(
        serde_json::from_slice::<Value>(&out).unwrap(),
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}})
    );
    assert_eq!(e.to_string(), "max_tokens: Field required");
}
