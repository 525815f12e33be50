//! A whole (non-streamed) Messages response → a `chat.completion`.
//!
//! Text blocks are joined into `content` (null when the answer is only tool calls), `tool_use`
//! blocks become `tool_calls` (their `input` written out as the `arguments` string), thinking
//! blocks are joined into `reasoning_content`; other blocks (redacted thinking, server tools'
//! blocks) are left out. `stop_reason` becomes `finish_reason` ([`super::finish_reason`]) and
//! the usage is reported in OpenAI's terms ([`super::AnthropicUsage::write_openai`]). The id is
//! `chatcmpl-` + the message id and the model the one the upstream reports, as a passed-through
//! OpenAI answer would have it.

use std::borrow::Cow;

use serde_json::Value;

use super::{finish_reason, push_str_literal, push_u64, AnthropicUsage, TranslateError};

/// A Messages response, or the `message` of a `message_start` event.
#[derive(Debug, serde::Deserialize)]
pub(super) struct Message<'a> {
    #[serde(rename = "type", borrow, default)]
    pub(super) kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) content: Option<Vec<Block<'a>>>,
    #[serde(borrow, default)]
    pub(super) stop_reason: Option<Cow<'a, str>>,
    #[serde(default)]
    pub(super) usage: Option<AnthropicUsage>,
}

/// A content block (whole, or as `content_block_start` opens it).
#[derive(Debug, serde::Deserialize)]
pub(super) struct Block<'a> {
    #[serde(rename = "type", borrow)]
    pub(super) kind: Cow<'a, str>,
    #[serde(borrow, default)]
    pub(super) text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) name: Option<Cow<'a, str>>,
    #[serde(default)]
    pub(super) input: Option<Value>,
}

/// A 2xx non-streamed Messages response → an OpenAI `chat.completion` body (appended to
/// `out`), `created` now.
pub(crate) fn message_to_chat(body: &[u8], out: &mut Vec<u8>) -> Result<(), TranslateError> {
    message_to_chat_at(body, crate::sys::time::unix_secs(), out)
}

/// [`message_to_chat`] with the `created` time given (Unix seconds).
pub(crate) fn message_to_chat_at(
    body: &[u8],
    created_unix: u64,
    out: &mut Vec<u8>,
) -> Result<(), TranslateError> {
    // Serde would also read a struct from an array.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(TranslateError::body(
            "the upstream's answer is not a message",
        ));
    }
    let message: Message<'_> = serde_json::from_slice(body).map_err(|e| {
        TranslateError::body(format!("the upstream's answer is not a message: {e}"))
    })?;
    if message.kind.as_deref().is_some_and(|k| k != "message") {
        return Err(TranslateError::body(
            "the upstream's answer is not a message",
        ));
    }
    let blocks = message.content.as_deref().unwrap_or_default();
    let mut text = String::new();
    let mut thinking = String::new();
    let mut tool_calls = 0usize;
    for block in blocks {
        match &*block.kind {
            "text" => text.push_str(block.text.as_deref().unwrap_or_default()),
            "thinking" => thinking.push_str(block.thinking.as_deref().unwrap_or_default()),
            "tool_use" => tool_calls += 1,
            _ => {}
        }
    }
    let has_text = blocks.iter().any(|b| b.kind == "text");

    out.extend_from_slice(b"{\"id\":");
    push_str_literal(
        out,
        &format!("chatcmpl-{}", message.id.as_deref().unwrap_or_default()),
    );
    out.extend_from_slice(b",\"object\":\"chat.completion\",\"created\":");
    push_u64(out, created_unix);
    out.extend_from_slice(b",\"model\":");
    push_str_literal(out, message.model.as_deref().unwrap_or_default());
    out.extend_from_slice(
        b",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":",
    );
    if has_text || tool_calls == 0 {
        // An answer cut before any text (say, all thinking) is "", not null.
        push_str_literal(out, &text);
    } else {
        out.extend_from_slice(b"null");
    }
    if !thinking.is_empty() {
        out.extend_from_slice(b",\"reasoning_content\":");
        push_str_literal(out, &thinking);
    }
    if tool_calls > 0 {
        out.extend_from_slice(b",\"tool_calls\":[");
        let mut first = true;
        for block in blocks.iter().filter(|b| b.kind == "tool_use") {
            if !first {
                out.push(b',');
            }
            first = false;
            // `Value`'s Display is its compact JSON text.
            let arguments = match &block.input {
                Some(input) => input.to_string(),
                None => "{}".to_owned(),
            };
            write_tool_call(
                out,
                None,
                block.id.as_deref().unwrap_or_default(),
                block.name.as_deref().unwrap_or_default(),
                &arguments,
            );
        }
        out.push(b']');
    }
    out.extend_from_slice(b",\"refusal\":null},\"logprobs\":null,\"finish_reason\":");
    push_str_literal(out, finish_reason(message.stop_reason.as_deref()));
    out.extend_from_slice(b"}],\"usage\":");
    message.usage.unwrap_or_default().write_openai(out);
    out.push(b'}');
    Ok(())
}

/// Append one entry of `tool_calls`: `{"index"?,"id","type":"function","function":{"name",
/// "arguments"}}` (`index` only in a stream).
pub(super) fn write_tool_call(
    out: &mut Vec<u8>,
    index: Option<u32>,
    id: &str,
    name: &str,
    arguments: &str,
) {
    out.push(b'{');
    if let Some(index) = index {
        out.extend_from_slice(b"\"index\":");
        push_u64(out, u64::from(index));
        out.push(b',');
    }
    out.extend_from_slice(b"\"id\":");
    push_str_literal(out, id);
    out.extend_from_slice(b",\"type\":\"function\",\"function\":{\"name\":");
    push_str_literal(out, name);
    out.extend_from_slice(b",\"arguments\":");
    push_str_literal(out, arguments);
    out.extend_from_slice(b"}}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TOOL_USE: &[u8] = include_bytes!("../testdata/anthropic_message_tool_use.json");

    fn translate(body: &[u8]) -> Value {
        let mut out = b"prefix:".to_vec();
        message_to_chat_at(body, 1_700_000_000, &mut out).unwrap();
        let rest = out.strip_prefix(b"prefix:").unwrap();
        let v: Value = serde_json::from_slice(rest).unwrap();
        check_chat_completion(&v);
        v
    }

    /// The fields OpenAI's SDKs read from a `chat.completion`, with their types.
    fn check_chat_completion(v: &Value) {
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(v["object"], "chat.completion");
        assert!(v["created"].is_u64());
        assert!(v["model"].is_string());
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1);
        let choice = &choices[0];
        assert_eq!(choice["index"], 0);
        assert!(["stop", "length", "tool_calls", "content_filter"]
            .contains(&choice["finish_reason"].as_str().unwrap()));
        let message = &choice["message"];
        assert_eq!(message["role"], "assistant");
        assert!(message["content"].is_string() || message["content"].is_null());
        if let Some(calls) = message.get("tool_calls") {
            for call in calls.as_array().unwrap() {
                assert!(call["id"].is_string());
                assert_eq!(call["type"], "function");
                assert!(call["function"]["name"].is_string());
                let args = call["function"]["arguments"].as_str().unwrap();
                serde_json::from_str::<Value>(args).unwrap();
            }
        }
        let usage = &v["usage"];
        let (p, c, t) = (
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["completion_tokens"].as_u64().unwrap(),
            usage["total_tokens"].as_u64().unwrap(),
        );
        assert_eq!(p + c, t);
        assert!(
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                <= p
        );
    }

    #[test]
    fn anthropic_response_tool_use_fixture() {
        let v = translate(TOOL_USE);
        assert_eq!(v["id"], "chatcmpl-msg_01Aq9w938a90dw8q");
        assert_eq!(v["created"], 1_700_000_000);
        assert_eq!(v["model"], "claude-sonnet-4-5-20250929");
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(
            choice["message"]["content"],
            "I'll check the current weather in both cities for you."
        );
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["id"], "toolu_01A09q90qw90lq917835lq9");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        // The arguments are the JSON of the input.
        let fixture: Value = serde_json::from_slice(TOOL_USE).unwrap();
        for (i, call) in calls.iter().enumerate() {
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(args, fixture["content"][i + 2]["input"]);
        }
        assert!(call_has_no_index(calls));
        assert_eq!(
            v["usage"],
            json!({
                "prompt_tokens": 2095 + 4096 + 2048,
                "completion_tokens": 503,
                "total_tokens": 2095 + 4096 + 2048 + 503,
                "prompt_tokens_details": {"cached_tokens": 4096, "cache_write_tokens": 2048, "cache_creation_tokens": 2048},
            })
        );
    }

    fn call_has_no_index(calls: &[Value]) -> bool {
        calls.iter().all(|c| c.get("index").is_none())
    }

    #[test]
    fn anthropic_response_text_thinking_and_finish_reasons() {
        let body = |stop: &str| {
            json!({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
                "content": [
                    {"type": "thinking", "thinking": "Let me think.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Hello \"you\"\n"},
                    {"type": "text", "text": "中文"},
                ],
                "stop_reason": stop, "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 20},
            })
            .to_string()
        };
        for (stop, want) in [
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("pause_turn", "stop"),
            ("max_tokens", "length"),
            ("refusal", "content_filter"),
            ("a_new_reason", "stop"),
        ] {
            let v = translate(body(stop).as_bytes());
            assert_eq!(v["choices"][0]["finish_reason"], want, "{stop}");
            let m = &v["choices"][0]["message"];
            assert_eq!(m["content"], "Hello \"you\"\n中文");
            assert_eq!(m["reasoning_content"], "Let me think.");
            assert!(m.get("tool_calls").is_none());
            assert_eq!(
                v["usage"],
                json!({"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30,
                       "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "cache_creation_tokens": 0}})
            );
        }
    }

    #[test]
    fn anthropic_response_without_text() {
        // Only a tool call: content null.
        let v = translate(
            br#"{"id":"msg_2","type":"message","role":"assistant","model":"m","content":[{"type":"tool_use","id":"t","name":"f","input":{}}],"stop_reason":"tool_use","usage":{"input_tokens":1,"output_tokens":2}}"#,
        );
        let m = &v["choices"][0]["message"];
        assert!(m["content"].is_null());
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{}");
        // Nothing at all (cut while thinking): content "".
        let v = translate(
            br#"{"id":"msg_3","type":"message","content":[],"stop_reason":"max_tokens","usage":null}"#,
        );
        assert_eq!(v["choices"][0]["message"]["content"], "");
        assert_eq!(v["usage"]["total_tokens"], 0);
    }

    #[test]
    fn anthropic_response_not_a_message_is_an_error() {
        let mut out = Vec::new();
        for body in [
            &b"not json"[..],
            b"[]",
            br#"{"type":"error","error":{"type":"api_error","message":"x"}}"#,
            br#"{"type":"message","content":[{"text":"no type"}]}"#,
        ] {
            assert!(message_to_chat(body, &mut out).is_err());
        }
        assert!(out.is_empty());
        message_to_chat(br#"{"type":"message","content":[]}"#, &mut out).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v["created"].as_u64().unwrap() > 1_700_000_000);
    }
}
