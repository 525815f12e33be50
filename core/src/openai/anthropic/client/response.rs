//! Whole answers for an Anthropic client: a chat completion as a `message`, any error as
//! Anthropic's error shape, the `count_tokens` answer; and the pieces the stream shares (stop
//! reasons, usage, error types).

use std::io::Write as _;

use serde_json::{json, Map, Value};

use super::TranslateError;

/// A 2xx chat completion (`body`) as an Anthropic `message` body for a client that asked for
/// `model_for_client`, appended to `out`. The first choice is the message: Anthropic has no `n`.
///
/// Content blocks in Anthropic's order: `thinking` (from `reasoning_content`, or `reasoning` as
/// newer vLLM names it, with an empty `signature`), `text` (the content, then a refusal),
/// `tool_use` (each call's `arguments` parsed into `input`; empty arguments are `{}`). Raises
/// [`TranslateError`] when the body is not a JSON object or a tool call's arguments are not a
/// JSON object: an upstream fault, to answer as 502.
pub(crate) fn chat_to_message(
    body: &[u8],
    model_for_client: &str,
    out: &mut Vec<u8>,
) -> Result<(), TranslateError> {
    let Ok(Value::Object(mut completion)) = serde_json::from_slice::<Value>(body) else {
        return Err(TranslateError::new(
            "The upstream's answer is not a JSON object.",
        ));
    };
    let id = message_id(completion.get("id").and_then(Value::as_str));
    let usage = completion
        .get("usage")
        .map(ChatUsage::from_value)
        .unwrap_or_default();
    let choice = match completion.remove("choices") {
        Some(Value::Array(choices)) => choices.into_iter().find(|c| {
            c.get("index")
                .and_then(Value::as_u64)
                .is_none_or(|i| i == 0)
        }),
        _ => None,
    };

    let mut content = Vec::new();
    let mut finish = None;
    let mut stop_sequence = None;
    let mut refused = false;
    let mut tool_calls = false;
    if let Some(Value::Object(mut choice)) = choice {
        if let Some(Value::String(f)) = choice.remove("finish_reason") {
            finish = Some(f);
        }
        stop_sequence = matched_stop(choice.get("stop_reason"));
        if let Some(Value::Object(mut message)) = choice.remove("message") {
            if let Some(thinking) = reasoning(&mut message) {
                content.push(json!({ "type": "thinking", "thinking": thinking, "signature": "" }));
            }
            let text = match message.remove("content") {
                Some(Value::String(s)) => s,
                // Content parts (rare in answers): their text, in order.
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect(),
                _ => String::new(),
            };
            if !text.is_empty() {
                content.push(json!({ "type": "text", "text": text }));
            }
            if let Some(Value::String(refusal)) = message.remove("refusal") {
                if !refusal.is_empty() {
                    refused = true;
                    content.push(json!({ "type": "text", "text": refusal }));
                }
            }
            let mut calls = match message.remove("tool_calls") {
                Some(Value::Array(calls)) => calls,
                _ => Vec::new(),
            };
            // The legacy single `function_call`.
            if let Some(f @ Value::Object(_)) = message.remove("function_call") {
                calls.push(json!({ "function": f }));
            }
            for (k, call) in calls.into_iter().enumerate() {
                tool_calls = true;
                content.push(tool_use(call, k, &id)?);
            }
        }
    }
    let stop_reason = stop_reason(
        finish.as_deref(),
        tool_calls,
        refused,
        stop_sequence.is_some(),
    );
    let mut message = Map::new();
    message.insert("id".into(), Value::String(id));
    message.insert("type".into(), "message".into());
    message.insert("role".into(), "assistant".into());
    message.insert("model".into(), model_for_client.into());
    message.insert("content".into(), Value::Array(content));
    message.insert("stop_reason".into(), stop_reason.into());
    message.insert(
        "stop_sequence".into(),
        stop_sequence.map_or(Value::Null, Value::String),
    );
    message.insert("usage".into(), usage.to_json());
    serde_json::to_writer(&mut *out, &message)
        .map_err(|e| TranslateError::new(format!("The answer could not be written: {e}.")))
}

/// `reasoning_content` (DeepSeek, vLLM up to 0.10), else `reasoning` (vLLM since, OpenRouter),
/// when a non-empty string.
fn reasoning(message: &mut Map<String, Value>) -> Option<String> {
    for key in ["reasoning_content", "reasoning"] {
        if let Some(Value::String(r)) = message.remove(key) {
            if !r.is_empty() {
                return Some(r);
            }
        }
    }
    None
}

fn tool_use(call: Value, k: usize, message_id: &str) -> Result<Value, TranslateError> {
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .filter(|id| !id.is_empty())
        .map_or_else(|| fallback_tool_id(message_id, k), str::to_owned);
    let function = call.get("function");
    let name = function
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    let input = match function.and_then(|f| f.get("arguments")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(args)) if args.trim().is_empty() => json!({}),
        Some(Value::String(args)) => match serde_json::from_str::<Value>(args) {
            Ok(input @ Value::Object(_)) => input,
            _ => {
                return Err(TranslateError::new(format!(
                    "The upstream's call of tool `{}` has arguments that are not a JSON object.",
                    crate::openai::json::truncate(name, 64)
                )))
            }
        },
        // Some servers send the arguments as an object already.
        Some(input @ Value::Object(_)) => input.clone(),
        Some(_) => {
            return Err(TranslateError::new(format!(
                "The upstream's call of tool `{}` has arguments that are not a JSON object.",
                crate::openai::json::truncate(name, 64)
            )))
        }
    };
    Ok(json!({ "type": "tool_use", "id": id, "name": name, "input": input }))
}

/// The Anthropic message id for an upstream completion id.
pub(super) fn message_id(upstream: Option<&str>) -> String {
    match upstream {
        Some(id) if !id.is_empty() => format!("msg_{id}"),
        _ => "msg_sluice".to_owned(),
    }
}

/// A tool-use id for a call the upstream sent without one: unique within the message, and
/// across messages as far as the upstream's completion ids are.
pub(super) fn fallback_tool_id(message_id: &str, k: usize) -> String {
    let base = message_id.strip_prefix("msg_").unwrap_or(message_id);
    format!("toolu_{base}_{k}")
}

/// vLLM's `stop_reason`: the stop string that ended the completion (a token id otherwise).
pub(super) fn matched_stop(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// Anthropic's `stop_reason` for a chat `finish_reason`: `stop` → `end_turn` (or
/// `stop_sequence` when the upstream names the stop string, or `tool_use` when the message
/// holds tool calls, as some servers say `stop` then), `length` → `max_tokens`, `tool_calls`
/// (and the legacy `function_call`) → `tool_use`, `content_filter` (or a refusal) → `refusal`;
/// anything new, or none, → `end_turn`.
pub(super) fn stop_reason(
    finish: Option<&str>,
    tool_calls: bool,
    refused: bool,
    stop_sequence: bool,
) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("content_filter") => "refusal",
        Some("tool_calls" | "function_call") => "tool_use",
        _ if refused => "refusal",
        _ if tool_calls => "tool_use",
        _ if stop_sequence => "stop_sequence",
        _ => "end_turn",
    }
}

/// A chat completion's usage, as Anthropic counts it: `prompt_tokens` includes the cache hits
/// and writes, which Anthropic reports apart (`input_tokens` = prompt − cached − written).
/// OpenAI itself reports no cache writes; an OpenAI-compatible upstream that does (Sluice in
/// front of Claude, among others) names them `prompt_tokens_details.cache_write_tokens`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct ChatUsage {
    pub(super) prompt: u64,
    pub(super) completion: u64,
    pub(super) cached: u64,
    pub(super) written: u64,
}

impl ChatUsage {
    /// A `usage` object; zeros for what it lacks. The cache hits are
    /// `prompt_tokens_details.cached_tokens`, else DeepSeek's `prompt_cache_hit_tokens`.
    pub(super) fn from_value(v: &Value) -> ChatUsage {
        let details = v.get("prompt_tokens_details");
        let detail = |name: &str| details.and_then(|d| d.get(name)).and_then(count);
        let cached = detail("cached_tokens")
            .or_else(|| v.get("prompt_cache_hit_tokens").and_then(count))
            .unwrap_or(0);
        let written = detail("cache_write_tokens")
            .or_else(|| detail("cache_creation_tokens"))
            .unwrap_or(0);
        let prompt = v.get("prompt_tokens").and_then(count).unwrap_or(0);
        let cached = cached.min(prompt);
        ChatUsage {
            prompt,
            completion: v.get("completion_tokens").and_then(count).unwrap_or(0),
            cached,
            written: written.min(prompt.saturating_sub(cached)),
        }
    }

    fn input(&self) -> u64 {
        self.prompt
            .saturating_sub(self.cached)
            .saturating_sub(self.written)
    }

    fn to_json(self) -> Value {
        json!({
            "input_tokens": self.input(),
            "cache_creation_input_tokens": self.written,
            "cache_read_input_tokens": self.cached,
            "output_tokens": self.completion,
        })
    }

    /// The same object, written straight into an event.
    pub(super) fn write_json(&self, out: &mut Vec<u8>) {
        let _ = write!(
            out,
            "{{\"input_tokens\":{},\"cache_creation_input_tokens\":{},\"cache_read_input_tokens\":{},\"output_tokens\":{}}}",
            self.input(),
            self.written,
            self.cached,
            self.completion
        );
    }
}

/// A token count: a non-negative integer (`12`, or `12.0` as some servers write it).
pub(super) fn count(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 1e18)
            .map(|f| f as u64)
    })
}

/// Any non-2xx answer (`status`, `openai_error_body`), or an error Sluice raises in OpenAI's
/// shape, as Anthropic's error body `{"type":"error","error":{"type":…,"message":…}}` appended
/// to `out`; returns the status to answer with.
///
/// The status stays as it is (clients retry, back off and honour `Retry-After` by it); it
/// picks the type: 400 `invalid_request_error`, 401 `authentication_error`, 402
/// `billing_error`, 403 `permission_error`, 404 `not_found_error`, 408 / 504 `timeout_error`,
/// 413 `request_too_large`, 429 `rate_limit_error`, 503 / 529 `overloaded_error`, another 4xx
/// `invalid_request_error`, another 5xx `api_error`. A status below 400 (an error inside a 2xx
/// body) is read from the error's own `code` and `type` instead, 500 `api_error` when they say
/// nothing known. The message is the error's `message` (OpenAI's and vLLM's shapes, a bare
/// string `error`, FastAPI's `detail`); a body with none gets one that names the status.
pub(crate) fn error_to_anthropic(status: u16, openai_error_body: &[u8], out: &mut Vec<u8>) -> u16 {
    let found = FoundError::read(openai_error_body);
    let (status, kind) = anthropic_error(
        (status >= 400).then_some(status),
        found.kind.as_deref(),
        found.code.as_deref(),
    );
    match found.message.as_deref().filter(|m| !m.is_empty()) {
        Some(message) => write_error_body(kind, message, out),
        None => write_error_body(
            kind,
            &format!("The upstream answered HTTP {status} without an error message."),
            out,
        ),
    }
    status
}

/// `{"type":"error","error":{"type":kind,"message":message}}`.
pub(super) fn write_error_body(kind: &str, message: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"type\":\"error\",\"error\":{\"type\":");
    json_str(out, kind);
    out.extend_from_slice(b",\"message\":");
    json_str(out, message);
    out.extend_from_slice(b"}}");
}

/// `s` as a JSON string literal.
pub(super) fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing to a Vec never fails.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// What an error body says, in whichever of the usual shapes.
#[derive(Debug, Default)]
pub(super) struct FoundError {
    pub(super) message: Option<String>,
    pub(super) kind: Option<String>,
    pub(super) code: Option<String>,
}

impl FoundError {
    fn read(body: &[u8]) -> FoundError {
        match serde_json::from_slice::<Value>(body) {
            Ok(v) => FoundError::from_value(&v),
            Err(_) => FoundError::default(),
        }
    }

    /// `{"error":{…}}`, `{"error":"…"}`, vLLM's older top-level `{"object":"error",…}` or
    /// FastAPI's `{"detail":"…"}`.
    pub(super) fn from_value(v: &Value) -> FoundError {
        let fields = match v.get("error") {
            Some(Value::String(m)) => {
                return FoundError {
                    message: Some(m.clone()),
                    ..FoundError::default()
                }
            }
            Some(e @ Value::Object(_)) => e,
            _ => v,
        };
        let text = |key: &str| match fields.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Number(n)) => Some(n.to_string()),
            _ => None,
        };
        FoundError {
            message: text("message").or_else(|| match v.get("detail") {
                Some(Value::String(d)) => Some(d.clone()),
                _ => None,
            }),
            kind: text("type"),
            code: text("code"),
        }
    }
}

/// The status and Anthropic error type for an error: by `status` when there is one, else by
/// the error's `code` (a status number, as vLLM writes it, or a name) and then its `type`.
pub(super) fn anthropic_error(
    status: Option<u16>,
    kind: Option<&str>,
    code: Option<&str>,
) -> (u16, &'static str) {
    if let Some(status) = status {
        return (status, type_for_status(status));
    }
    for word in [code, kind].into_iter().flatten() {
        if let Ok(n) = word.parse::<u16>() {
            if (400..600).contains(&n) {
                return (n, type_for_status(n));
            }
        }
        if let Some(found) = type_for_word(word) {
            return found;
        }
    }
    (500, "api_error")
}

/// Anthropic's error `type` for an HTTP status (what its SDKs raise by).
pub(crate) fn type_for_status(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

fn type_for_word(word: &str) -> Option<(u16, &'static str)> {
    Some(match word {
        "invalid_request_error"
        | "invalid_request"
        | "BadRequestError"
        | "context_length_exceeded"
        | "invalid_value" => (400, "invalid_request_error"),
        "authentication_error" | "invalid_api_key" | "AuthenticationError" => {
            (401, "authentication_error")
        }
        "billing_error" => (402, "billing_error"),
        "permission_error" | "permission_denied" | "PermissionDeniedError" => {
            (403, "permission_error")
        }
        "not_found_error" | "model_not_found" | "NotFoundError" => (404, "not_found_error"),
        "request_too_large" => (413, "request_too_large"),
        "rate_limit_error"
        | "rate_limit_exceeded"
        | "insufficient_quota"
        | "tokens"
        | "requests"
        | "RateLimitError" => (429, "rate_limit_error"),
        "overloaded_error"
        | "overloaded"
        | "server_overloaded"
        | "service_unavailable"
        | "ServiceUnavailableError" => (529, "overloaded_error"),
        "timeout_error" | "timeout" => (504, "timeout_error"),
        "api_error" | "server_error" | "internal_error" | "InternalServerError" => {
            (500, "api_error")
        }
        _ => return None,
    })
}

/// The `/v1/messages/count_tokens` answer: `{"input_tokens":N}`, appended to `out`.
pub(crate) fn count_tokens_body(input_tokens: u64, out: &mut Vec<u8>) {
    let _ = write!(out, "{{\"input_tokens\":{input_tokens}}}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &str) -> Value {
        let mut out = Vec::new();
        if let Err(e) = chat_to_message(body.as_bytes(), "claude-x", &mut out) {
            panic!("{body}: {}", e.message);
        }
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn anthropic_message_from_a_plain_completion() {
        let m = message(
            r#"{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"Hello!"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12}}"#,
        );
        assert_eq!(
            m,
            json!({
                "id": "msg_chatcmpl-1", "type": "message", "role": "assistant", "model": "claude-x",
                "content": [{"type": "text", "text": "Hello!"}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 2}
            })
        );
    }

    #[test]
    fn anthropic_stop_reasons_map_and_never_fail() {
        for (finish, extra, want) in [
            ("\"stop\"", "", "end_turn"),
            ("\"length\"", "", "max_tokens"),
            ("\"tool_calls\"", "", "tool_use"),
            ("\"function_call\"", "", "tool_use"),
            ("\"content_filter\"", "", "refusal"),
            ("\"something_new\"", "", "end_turn"),
            ("null", "", "end_turn"),
            ("\"stop\"", r#","stop_reason":"END""#, "stop_sequence"),
            ("\"stop\"", r#","stop_reason":128001"#, "end_turn"),
        ] {
            let m = message(&format!(
                r#"{{"id":"c","choices":[{{"index":0,"message":{{"content":"x"}},"finish_reason":{finish}{extra}}}]}}"#
            ));
            assert_eq!(m["stop_reason"], want, "{finish} {extra}");
            let seq = if want == "stop_sequence" {
                json!("END")
            } else {
                Value::Null
            };
            assert_eq!(m["stop_sequence"], seq);
        }
        // Tool calls under `stop` (some servers) are still tool use; a refusal is a refusal.
        let m = message(
            r#"{"id":"c","choices":[{"message":{"content":null,"tool_calls":[{"id":"t","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"stop"}]}"#,
        );
        assert_eq!(m["stop_reason"], "tool_use");
        let m = message(
            r#"{"id":"c","choices":[{"message":{"content":null,"refusal":"I can't help with that."},"finish_reason":"stop"}]}"#,
        );
        assert_eq!(m["stop_reason"], "refusal");
        assert_eq!(
            m["content"],
            json!([{"type":"text","text":"I can't help with that."}])
        );
    }

    #[test]
    fn anthropic_message_tool_inputs_and_their_failures() {
        let m = message(
            r#"{"choices":[{"message":{"tool_calls":[{"function":{"name":"a","arguments":"  "}},{"id":"","function":{"name":"b","arguments":{"k":1}}}],"function_call":{"name":"c","arguments":"{\"z\":[1]}"}},"finish_reason":"tool_calls"}]}"#,
        );
        assert_eq!(
            m["content"],
            json!([
                {"type":"tool_use","id":"toolu_sluice_0","name":"a","input":{}},
                {"type":"tool_use","id":"toolu_sluice_1","name":"b","input":{"k":1}},
                {"type":"tool_use","id":"toolu_sluice_2","name":"c","input":{"z":[1]}},
            ])
        );
        assert_eq!(m["id"], "msg_sluice");
        for bad in [r#""[1,2]""#, r#""{\"a\":""#, "7"] {
            let body = format!(
                r#"{{"id":"c","choices":[{{"message":{{"tool_calls":[{{"id":"t","function":{{"name":"f","arguments":{bad}}}}}]}}}}]}}"#
            );
            let mut out = Vec::new();
            let e = chat_to_message(body.as_bytes(), "m", &mut out).unwrap_err();
            assert!(e.message.contains("tool `f`"), "{bad}: {}", e.message);
        }
        let mut out = Vec::new();
        assert!(chat_to_message(b"[1]", "m", &mut out).is_err());
        assert!(chat_to_message(b"<html>", "m", &mut out).is_err());
    }

    #[test]
    fn anthropic_message_of_an_empty_or_odd_completion() {
        let m = message(r#"{"id":"c","choices":[]}"#);
        assert_eq!(m["content"], json!([]));
        assert_eq!(m["stop_reason"], "end_turn");
        assert_eq!(m["usage"]["input_tokens"], 0);
        // The first choice is index 0 wherever it sits; reasoning under vLLM's newer name;
        // content as parts.
        let m = message(
            r#"{"id":"c","choices":[{"index":1,"message":{"content":"no"}},{"index":0,"message":{"reasoning":"hm","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}}],"usage":{"prompt_tokens":5.0,"completion_tokens":"x","prompt_cache_hit_tokens":9}}"#,
        );
        assert_eq!(
            m["content"],
            json!([{"type":"thinking","thinking":"hm","signature":""},{"type":"text","text":"ab"}])
        );
        // Cache hits never exceed the prompt.
        assert_eq!(
            m["usage"],
            json!({"input_tokens":0,"cache_creation_input_tokens":0,"cache_read_input_tokens":5,"output_tokens":0})
        );
    }

    fn error(status: u16, body: &str) -> (u16, Value) {
        let mut out = Vec::new();
        let status = error_to_anthropic(status, body.as_bytes(), &mut out);
        (status, serde_json::from_slice(&out).unwrap())
    }

    #[test]
    fn anthropic_errors_by_status() {
        let body = r#"{"error":{"message":"m","type":"x","param":null,"code":null}}"#;
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (402, "billing_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (405, "invalid_request_error"),
            (408, "timeout_error"),
            (413, "request_too_large"),
            (422, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ] {
            let (s, v) = error(status, body);
            assert_eq!(s, status);
            assert_eq!(
                v,
                json!({"type":"error","error":{"type":kind,"message":"m"}}),
                "{status}"
            );
        }
    }

    #[test]
    fn anthropic_errors_by_type_when_no_status_says() {
        for (body, status, kind) in [
            (
                r#"{"error":{"message":"m","type":"server_error","code":null}}"#,
                500,
                "api_error",
            ),
            (
                r#"{"error":{"message":"m","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
                400,
                "invalid_request_error",
            ),
            (
                r#"{"error":{"message":"m","type":"tokens","code":"rate_limit_exceeded"}}"#,
                429,
                "rate_limit_error",
            ),
            (
                r#"{"object":"error","message":"m","type":"BadRequestError","param":null,"code":400}"#,
                400,
                "invalid_request_error",
            ),
            (
                r#"{"error":{"message":"m","type":"overloaded_error"}}"#,
                529,
                "overloaded_error",
            ),
            (
                r#"{"type":"error","error":{"type":"not_found_error","message":"m"}}"#,
                404,
                "not_found_error",
            ),
            (
                r#"{"error":{"message":"m","type":"who_knows"}}"#,
                500,
                "api_error",
            ),
        ] {
            let (s, v) = error(200, body);
            assert_eq!(
                (s, v["error"]["type"].as_str()),
                (status, Some(kind)),
                "{body}"
            );
            assert_eq!(v["error"]["message"], "m");
        }
    }

    #[test]
    fn anthropic_error_messages_from_any_shape() {
        assert_eq!(
            error(500, r#"{"error":"boom"}"#).1["error"]["message"],
            "boom"
        );
        assert_eq!(
            error(422, r#"{"detail":"bad field"}"#).1["error"]["message"],
            "bad field"
        );
        let (s, v) = error(502, "<html>Bad Gateway</html>");
        assert_eq!(s, 502);
        assert_eq!(
            v,
            json!({"type":"error","error":{"type":"api_error","message":"The upstream answered HTTP 502 without an error message."}})
        );
        let (_, v) = error(400, r#"{"error":{"message":"quote \" and \n newline"}}"#);
        assert_eq!(v["error"]["message"], "quote \" and \n newline");
    }

    #[test]
    fn anthropic_count_tokens_answer() {
        let mut out = Vec::new();
        count_tokens_body(1234, &mut out);
        assert_eq!(out, br#"{"input_tokens":1234}"#);
    }
}
