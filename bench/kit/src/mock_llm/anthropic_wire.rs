//! The bytes of mock-llm's Anthropic answers: the `message` object, the streaming events
//! (Anthropic's published "Streaming Messages" sequence) and the error bodies, appended to
//! reusable buffers with plain formatting, like [`super::body`] does for the OpenAI routes.
//!
//! A stream is `message_start` (usage: the input, cache reads / writes, `output_tokens: 1`),
//! then per content block `content_block_start`, its deltas (`thinking_delta` then one
//! `signature_delta`; `text_delta`; `input_json_delta`), `content_block_stop`; a `ping` after
//! the first `content_block_start`; then `message_delta` (stop reason, cumulative usage) and
//! `message_stop`. Every event is `event: TYPE` + `data: {"type": TYPE, …}`.

use std::io::Write as _;

use super::anthropic::{Answer, Block};
use super::http::json_str;

/// What a Messages answer is about.
pub struct Msg<'a> {
    pub seq: u64,
    /// The model as a JSON string literal.
    pub model_json: &'a [u8],
    pub answer: &'a Answer,
}

/// The text of thinking delta `i` (`think0`, ` think1`, …), unquoted.
fn thinking_piece(out: &mut Vec<u8>, i: u64) {
    if i > 0 {
        out.push(b' ');
    }
    let _ = write!(out, "think{i}");
}

/// The opaque signature of a thinking block.
fn signature(out: &mut Vec<u8>, seq: u64) {
    let _ = write!(out, "\"bW9jay1zaWduYXR1cmU{seq}\"");
}

fn tool_use_id(out: &mut Vec<u8>, seq: u64, n: usize) {
    let _ = write!(out, "\"toolu_mock_{seq}_{n}\"");
}

/// The made-up input of tool call `n`, as JSON text: `{"location":"city{n}","unit":"celsius"}`.
pub fn tool_input(n: usize) -> String {
    format!("{{\"location\":\"city{n}\",\"unit\":\"celsius\"}}")
}

/// Piece `j` of a tool call's `input` (JSON text), as sent in its `input_json_delta` events: the
/// first is empty (as the API's first one is), then four pieces cut mid-key and mid-value (at
/// char boundaries), so a client must join them before parsing.
pub fn tool_input_piece(input: &str, j: u64) -> String {
    let len = input.len();
    let cut = |at| super::chat_tools::char_cut(input, at);
    let cuts = [0, 0, cut(len / 4), cut(len / 2), cut(len * 3 / 4), len];
    let j = (j as usize).min(cuts.len() - 2);
    input[cuts[j]..cuts[j + 1]].to_owned()
}

/// `{"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens"}`.
fn usage(out: &mut Vec<u8>, a: &Answer, output_tokens: u64) {
    let _ = write!(
        out,
        "{{\"input_tokens\":{},\"cache_creation_input_tokens\":{},\
         \"cache_read_input_tokens\":{},\"output_tokens\":{}}}",
        a.input_tokens, a.cache_write, a.cache_read, output_tokens
    );
}

/// The `message` object up to its `content` (exclusive).
fn message_head(out: &mut Vec<u8>, m: &Msg) {
    let _ = write!(
        out,
        "{{\"id\":\"msg_mock_{}\",\"type\":\"message\",\"role\":\"assistant\",\"model\":",
        m.seq
    );
    out.extend_from_slice(m.model_json);
}

/// A whole block, as the non-streamed `content` holds it.
fn block_whole(out: &mut Vec<u8>, m: &Msg, block: Block) {
    let a = m.answer;
    match block {
        Block::Thinking => {
            out.extend_from_slice(b"{\"type\":\"thinking\",\"thinking\":\"");
            for i in 0..a.deltas(block) {
                thinking_piece(out, i);
            }
            out.extend_from_slice(b"\",\"signature\":");
            signature(out, m.seq);
            out.push(b'}');
        }
        Block::Text => {
            out.extend_from_slice(b"{\"type\":\"text\",\"text\":\"");
            for i in 0..a.text_tokens {
                if i > 0 {
                    out.push(b' ');
                }
                let _ = write!(out, "tok{i}");
            }
            out.extend_from_slice(b"\"}");
        }
        Block::Tool(n) => {
            out.extend_from_slice(b"{\"type\":\"tool_use\",\"id\":");
            tool_use_id(out, m.seq, n);
            out.extend_from_slice(b",\"name\":");
            json_str(out, &a.tool_calls[n]);
            out.extend_from_slice(b",\"input\":");
            out.extend_from_slice(a.tool_inputs[n].as_bytes());
            out.push(b'}');
        }
    }
}

/// The non-streamed answer: a `message` object, plus the mock's `echo` (unless it is empty).
pub fn message(out: &mut Vec<u8>, m: &Msg, echo: &[u8]) {
    let a = m.answer;
    message_head(out, m);
    out.extend_from_slice(b",\"content\":[");
    for (i, b) in a.blocks().into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        block_whole(out, m, b);
    }
    let _ = write!(
        out,
        "],\"stop_reason\":\"{}\",\"stop_sequence\":null,\"usage\":",
        a.stop_reason
    );
    usage(out, a, a.output_tokens());
    if !echo.is_empty() {
        out.extend_from_slice(b",\"echo\":");
        out.extend_from_slice(echo);
    }
    out.push(b'}');
}

fn event(out: &mut Vec<u8>, kind: &str) {
    let _ = write!(out, "event: {kind}\ndata: {{\"type\":\"{kind}\"");
}

pub fn ev_message_start(out: &mut Vec<u8>, m: &Msg) {
    event(out, "message_start");
    out.extend_from_slice(b",\"message\":");
    message_head(out, m);
    out.extend_from_slice(
        b",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":",
    );
    usage(out, m.answer, 1);
    out.extend_from_slice(b"}}\n\n");
}

pub fn ev_ping(out: &mut Vec<u8>) {
    event(out, "ping");
    out.extend_from_slice(b"}\n\n");
}

/// `content_block_start` of block `index`, empty as the API starts each.
pub fn ev_block_start(out: &mut Vec<u8>, m: &Msg, index: usize, block: Block) {
    event(out, "content_block_start");
    let _ = write!(out, ",\"index\":{index},\"content_block\":");
    match block {
        Block::Thinking => {
            out.extend_from_slice(b"{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}")
        }
        Block::Text => out.extend_from_slice(b"{\"type\":\"text\",\"text\":\"\"}"),
        Block::Tool(n) => {
            out.extend_from_slice(b"{\"type\":\"tool_use\",\"id\":");
            tool_use_id(out, m.seq, n);
            out.extend_from_slice(b",\"name\":");
            json_str(out, &m.answer.tool_calls[n]);
            out.extend_from_slice(b",\"input\":{}}");
        }
    }
    out.extend_from_slice(b"}\n\n");
}

/// Content delta `j` of block `index` of answer `a`.
pub fn ev_delta(out: &mut Vec<u8>, a: &Answer, index: usize, block: Block, j: u64) {
    event(out, "content_block_delta");
    let _ = write!(out, ",\"index\":{index},\"delta\":");
    match block {
        Block::Thinking => {
            out.extend_from_slice(b"{\"type\":\"thinking_delta\",\"thinking\":\"");
            thinking_piece(out, j);
            out.extend_from_slice(b"\"}");
        }
        Block::Text => {
            out.extend_from_slice(b"{\"type\":\"text_delta\",\"text\":");
            super::body::token_json(out, j);
            out.push(b'}');
        }
        Block::Tool(n) => {
            out.extend_from_slice(b"{\"type\":\"input_json_delta\",\"partial_json\":");
            json_str(out, &tool_input_piece(&a.tool_inputs[n], j));
            out.push(b'}');
        }
    }
    out.extend_from_slice(b"}\n\n");
}

/// The `signature_delta` that ends a thinking block's deltas.
pub fn ev_signature(out: &mut Vec<u8>, m: &Msg, index: usize) {
    event(out, "content_block_delta");
    let _ = write!(
        out,
        ",\"index\":{index},\"delta\":{{\"type\":\"signature_delta\",\"signature\":"
    );
    signature(out, m.seq);
    out.extend_from_slice(b"}}\n\n");
}

pub fn ev_block_stop(out: &mut Vec<u8>, index: usize) {
    event(out, "content_block_stop");
    let _ = write!(out, ",\"index\":{index}}}\n\n");
}

/// `message_delta`: the stop reason and the usage so far (cumulative: the whole output).
pub fn ev_message_delta(out: &mut Vec<u8>, m: &Msg) {
    let a = m.answer;
    event(out, "message_delta");
    let _ = write!(
        out,
        ",\"delta\":{{\"stop_reason\":\"{}\",\"stop_sequence\":null}},\"usage\":",
        a.stop_reason
    );
    usage(out, a, a.output_tokens());
    out.extend_from_slice(b"}\n\n");
}

pub fn ev_message_stop(out: &mut Vec<u8>) {
    event(out, "message_stop");
    out.extend_from_slice(b"}\n\n");
}

/// A stream's `error` event: `overloaded_error` unless `kind` says otherwise
/// (`x-mock-error-code`).
pub fn ev_error(out: &mut Vec<u8>, kind: Option<&str>) {
    let kind = kind.unwrap_or("overloaded_error");
    event(out, "error");
    out.extend_from_slice(b",\"error\":{\"type\":");
    json_str(out, kind);
    out.extend_from_slice(b",\"message\":");
    json_str(
        out,
        if kind == "overloaded_error" {
            "Overloaded"
        } else {
            "mock error event"
        },
    );
    out.extend_from_slice(b"}}\n\n");
}

/// Anthropic's error `type` for a status, as its error reference lists them.
pub fn error_kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        _ if status >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// What the API answers an account out of credit (a 400 `invalid_request_error`, not a 429:
/// retrying won't cure it), word for word as clients receive it.
pub const CREDIT_MESSAGE: &str = "Your credit balance is too low to access the Anthropic API. \
     Please go to Plans & Billing to upgrade or purchase credits.";
/// The status of that answer.
pub const CREDIT_STATUS: u16 = 400;

/// `{"type":"error","error":{"type","message"},"request_id"}`, with the mock's `echo` when given.
pub fn error(out: &mut Vec<u8>, kind: &str, message: &str, seq: u64, echo: Option<&[u8]>) {
    out.extend_from_slice(b"{\"type\":\"error\",\"error\":{\"type\":");
    json_str(out, kind);
    out.extend_from_slice(b",\"message\":");
    json_str(out, message);
    let _ = write!(out, "}},\"request_id\":\"req_mock_{seq}\"");
    if let Some(echo) = echo.filter(|e| !e.is_empty()) {
        out.extend_from_slice(b",\"echo\":");
        out.extend_from_slice(echo);
    }
    out.push(b'}');
}

/// The body of an injected error status on `/v1/messages`: the `type` by status (or `code`,
/// from `x-mock-error-code`, in its place); `insufficient_quota` gives the credit-balance body.
pub fn injected_error(out: &mut Vec<u8>, status: u16, code: Option<&str>, seq: u64) {
    if code == Some(super::body::QUOTA_CODE) {
        error(out, "invalid_request_error", CREDIT_MESSAGE, seq, None);
        return;
    }
    let kind = code.unwrap_or_else(|| error_kind(status));
    let message = match status {
        429 => "This request would exceed the rate limit for your organization (org-mock) of 50 \
                requests per minute. (mock error status 429)"
            .to_owned(),
        529 => "Overloaded".to_owned(),
        _ => format!("mock error status {status}"),
    };
    error(out, kind, &message, seq, None);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::anthropic::{Request, Sizes, ToolChoice, TOOL_JSON_DELTAS};
    use serde_json::Value;

    fn answer(thinking: bool, tools: u64) -> Answer {
        let req = Request {
            stream: true,
            max_tokens: 4096,
            thinking,
            tools: vec!["get_weather".into(), "get_\"time".into()],
            tool_choice: ToolChoice::Auto,
            disable_parallel: false,
        };
        Answer::plan(
            &req,
            &Sizes {
                tokens: 3,
                tool_calls: tools,
                script: Vec::new(),
                input_tokens: 7,
                cache_read: 5,
                cache_write: 2,
            },
        )
    }

    fn parse(b: &[u8]) -> Value {
        match serde_json::from_slice(b) {
            Ok(v) => v,
            Err(e) => panic!("{e}: {}", String::from_utf8_lossy(b)),
        }
    }

    /// (event name, data) of one event.
    fn ev(b: &[u8]) -> (String, Value) {
        let s = String::from_utf8_lossy(b).into_owned();
        assert!(s.ends_with("\n\n"), "{s}");
        let mut lines = s.lines();
        let name = lines
            .next()
            .and_then(|l| l.strip_prefix("event: "))
            .unwrap()
            .to_owned();
        let data = parse(
            lines
                .next()
                .and_then(|l| l.strip_prefix("data: "))
                .unwrap()
                .as_bytes(),
        );
        assert_eq!(data["type"], name.as_str(), "{s}");
        (name, data)
    }

    #[test]
    fn message_body() {
        let a = answer(true, 2);
        let m = Msg {
            seq: 4,
            model_json: b"\"claude-\\\"x\"",
            answer: &a,
        };
        let mut out = Vec::new();
        message(&mut out, &m, br#"{"e":1}"#);
        let v = parse(&out);
        assert_eq!(v["id"], "msg_mock_4");
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        assert_eq!(v["model"], "claude-\"x");
        assert_eq!(v["stop_reason"], "tool_use");
        assert_eq!(v["stop_sequence"], Value::Null);
        let content = v["content"].as_array().unwrap();
        let kinds: Vec<_> = content
            .iter()
            .map(|b| b["type"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["thinking", "text", "tool_use", "tool_use"]);
        assert_eq!(content[0]["thinking"], "think0 think1 think2");
        assert!(content[0]["signature"]
            .as_str()
            .is_some_and(|s| !s.is_empty()));
        assert_eq!(content[1]["text"], "tok0 tok1 tok2");
        assert_eq!(content[2]["id"], "toolu_mock_4_0");
        assert_eq!(content[3]["name"], "get_\"time");
        assert_eq!(content[3]["input"]["location"], "city1");
        let u = &v["usage"];
        assert_eq!(
            (
                &u["input_tokens"],
                &u["cache_read_input_tokens"],
                &u["cache_creation_input_tokens"]
            ),
            (&Value::from(7), &Value::from(5), &Value::from(2))
        );
        assert_eq!(u["output_tokens"], 3 + 3 + 2 * TOOL_JSON_DELTAS);
        assert_eq!(v["echo"]["e"], 1);
    }

    #[test]
    fn events_are_the_published_shapes() {
        let a = answer(true, 1);
        let m = Msg {
            seq: 9,
            model_json: b"\"c\"",
            answer: &a,
        };
        let mut out = Vec::new();
        ev_message_start(&mut out, &m);
        let (_, v) = ev(&out);
        assert_eq!(v["message"]["content"], Value::Array(vec![]));
        assert_eq!(v["message"]["stop_reason"], Value::Null);
        assert_eq!(v["message"]["usage"]["output_tokens"], 1);
        assert_eq!(v["message"]["usage"]["input_tokens"], 7);
        out.clear();
        ev_ping(&mut out);
        assert_eq!(ev(&out).0, "ping");
        for (i, b) in a.blocks().into_iter().enumerate() {
            out.clear();
            ev_block_start(&mut out, &m, i, b);
            let (_, v) = ev(&out);
            assert_eq!(v["index"], i);
            out.clear();
            ev_delta(&mut out, &a, i, b, 1);
            let (_, v) = ev(&out);
            let want = match b {
                Block::Thinking => "thinking_delta",
                Block::Text => "text_delta",
                Block::Tool(_) => "input_json_delta",
            };
            assert_eq!(v["delta"]["type"], want);
        }
        out.clear();
        ev_signature(&mut out, &m, 0);
        assert_eq!(ev(&out).1["delta"]["type"], "signature_delta");
        out.clear();
        ev_block_stop(&mut out, 2);
        assert_eq!(ev(&out).1["index"], 2);
        out.clear();
        ev_message_delta(&mut out, &m);
        let (_, v) = ev(&out);
        assert_eq!(v["delta"]["stop_reason"], "tool_use");
        assert_eq!(v["usage"]["output_tokens"], a.output_tokens());
        out.clear();
        ev_message_stop(&mut out);
        assert_eq!(ev(&out).0, "message_stop");
        out.clear();
        ev_error(&mut out, None);
        let (_, v) = ev(&out);
        assert_eq!(v["error"]["type"], "overloaded_error");
        assert_eq!(v["error"]["message"], "Overloaded");
    }

    #[test]
    fn tool_input_pieces_join_to_the_input() {
        for n in [0, 7, 12] {
            let joined: String = (0..TOOL_JSON_DELTAS)
                .map(|j| tool_input_piece(&tool_input(n), j))
                .collect();
            assert_eq!(joined, tool_input(n));
            assert_eq!(tool_input_piece(&tool_input(n), 0), "");
            let v: Value = serde_json::from_str(&joined).unwrap();
            assert!(v.is_object());
            for j in 1..TOOL_JSON_DELTAS {
                let piece = tool_input_piece(&tool_input(n), j);
                assert!(!piece.is_empty());
                assert!(
                    serde_json::from_str::<Value>(&piece).is_err(),
                    "{piece} parses alone"
                );
            }
        }
    }

    #[test]
    fn errors_by_status() {
        let mut out = Vec::new();
        let mut body = |status, code| {
            out.clear();
            injected_error(&mut out, status, code, 3);
            parse(&out)
        };
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (402, "billing_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (503, "api_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ] {
            let v = body(status, None);
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], kind, "{status}");
            assert_eq!(v["request_id"], "req_mock_3");
            assert!(v.get("echo").is_none());
        }
        let credit = body(429, Some(crate::body::QUOTA_CODE));
        assert_eq!(credit["error"]["type"], "invalid_request_error");
        assert_eq!(credit["error"]["message"], CREDIT_MESSAGE);
        assert_eq!(body(500, Some("x\"y"))["error"]["type"], "x\"y");
        out.clear();
        error(&mut out, "invalid_request_error", "a\"b", 1, Some(b"{}"));
        let v = parse(&out);
        assert_eq!(v["error"]["message"], "a\"b");
        assert_eq!(v["echo"], serde_json::json!({}));
    }
}
