//! OpenAI client → Anthropic upstream: see the parent module.
//!
//! Pure functions over bodies and events, no I/O; the pipeline calls them around the forward and
//! relay phases when a candidate's cluster speaks the `anthropic` dialect:
//! - before forwarding, [`chat_to_messages`] turns the chat completion request into a Messages
//!   request for the model the upstream is sent, or answers a [`TranslateError`] (an OpenAI 400
//!   for the client, nothing sent);
//! - a 2xx non-streamed answer goes through [`message_to_chat`], a non-2xx one through
//!   [`error_to_openai`] (status and body for the client); [`is_spend_limit`] tells a spend or
//!   billing limit from a rate limit, for the fallback decision;
//! - a streamed answer is fed event by event (as the SSE splitter yields them) to a
//!   [`StreamTranslator`], which writes OpenAI `chat.completion.chunk` events, always a
//!   usage-only chunk at the end (the relay strips it when the client did not ask for usage),
//!   then `data: [DONE]`.
//!
//! Usage is reported in OpenAI's terms: `prompt_tokens` = `input_tokens` + cache reads + cache
//! writes, `prompt_tokens_details.cached_tokens` = the cache reads, and the cache writes again
//! as `prompt_tokens_details.cache_write_tokens` (OpenAI's name, in its current SDK) and
//! `cache_creation_tokens` (the name Sluice's cost accounting asked for), for cost.

mod error;
mod request;
mod response;
mod stream;

// The surface the pipeline uses; the tests reach the other items through their modules.
pub(crate) use self::{
    error::{error_to_openai, is_spend_limit},
    request::{chat_to_messages, RequestOptions},
    response::message_to_chat,
    stream::StreamTranslator,
};

/// A request this translation cannot carry to the Messages API, as an OpenAI-style 400 for the
/// client (`invalid_request_error`, with `param` when one field is at fault).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TranslateError {
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
}

impl TranslateError {
    fn new(param: &'static str, message: impl Into<String>) -> Self {
        TranslateError {
            message: message.into(),
            param: Some(param),
        }
    }

    fn body(message: impl Into<String>) -> Self {
        TranslateError {
            message: message.into(),
            param: None,
        }
    }
}

impl std::fmt::Display for TranslateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.param {
            Some(p) => write!(f, "{} (param {p})", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for TranslateError {}

/// Appends JSON text to a byte buffer through [`std::fmt::Write`], so the crate's JSON string
/// writer ([`crate::openai::json::write_json_string`]) can target the output buffers here.
struct Bytes<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for Bytes<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// Append `s` to `out` as a JSON string literal.
fn push_str_literal(out: &mut Vec<u8>, s: &str) {
    // Writing to a Vec never fails.
    let _ = crate::openai::json::write_json_string(&mut Bytes(out), s);
}

/// Append `n` in decimal.
fn push_u64(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    let mut n = n;
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// Anthropic's token counts, as `message_start`, `message_delta` or a whole message report
/// them; a field the upstream left out (or sent as null) is `None`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
struct AnthropicUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
}

impl AnthropicUsage {
    /// Take the fields `newer` reports; keep the others (`message_delta` counts are cumulative
    /// and may leave fields out).
    fn overwrite_with(&mut self, newer: &AnthropicUsage) {
        let keep = |old: &mut Option<u64>, new: Option<u64>| {
            if new.is_some() {
                *old = new;
            }
        };
        keep(&mut self.input_tokens, newer.input_tokens);
        keep(&mut self.output_tokens, newer.output_tokens);
        keep(
            &mut self.cache_read_input_tokens,
            newer.cache_read_input_tokens,
        );
        keep(
            &mut self.cache_creation_input_tokens,
            newer.cache_creation_input_tokens,
        );
    }

    /// Append the OpenAI `usage` object these counts make.
    fn write_openai(&self, out: &mut Vec<u8>) {
        let input = self.input_tokens.unwrap_or(0);
        let read = self.cache_read_input_tokens.unwrap_or(0);
        let write = self.cache_creation_input_tokens.unwrap_or(0);
        let prompt = input.saturating_add(read).saturating_add(write);
        let completion = self.output_tokens.unwrap_or(0);
        out.extend_from_slice(b"{\"prompt_tokens\":");
        push_u64(out, prompt);
        out.extend_from_slice(b",\"completion_tokens\":");
        push_u64(out, completion);
        out.extend_from_slice(b",\"total_tokens\":");
        push_u64(out, prompt.saturating_add(completion));
        out.extend_from_slice(b",\"prompt_tokens_details\":{\"cached_tokens\":");
        push_u64(out, read);
        // The cache writes under both names: OpenAI's own (`cache_write_tokens`, in its SDK's
        // `PromptTokensDetails`) and the one Sluice's cost accounting was first given.
        out.extend_from_slice(b",\"cache_write_tokens\":");
        push_u64(out, write);
        out.extend_from_slice(b",\"cache_creation_tokens\":");
        push_u64(out, write);
        out.extend_from_slice(b"}}");
    }
}

/// OpenAI's `finish_reason` for an Anthropic `stop_reason` (an unknown or missing one is
/// `stop`: a new reason must not fail a finished answer).
fn finish_reason(stop_reason: Option<&str>) -> &'static str {
    match stop_reason {
        Some("max_tokens") | Some("model_context_window_exceeded") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        // end_turn, stop_sequence, pause_turn and anything new.
        _ => "stop",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_usage_in_openai_terms() {
        let u = AnthropicUsage {
            input_tokens: Some(10),
            output_tokens: Some(7),
            cache_read_input_tokens: Some(100),
            cache_creation_input_tokens: Some(1000),
        };
        let mut out = Vec::new();
        u.write_openai(&mut out);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["prompt_tokens"], 1110);
        assert_eq!(v["completion_tokens"], 7);
        assert_eq!(v["total_tokens"], 1117);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 100);
        assert_eq!(v["prompt_tokens_details"]["cache_creation_tokens"], 1000);
        assert_eq!(v["prompt_tokens_details"]["cache_write_tokens"], 1000);

        let mut out = Vec::new();
        AnthropicUsage::default().write_openai(&mut out);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["total_tokens"], 0);
    }

    #[test]
    fn anthropic_usage_overwrites_present_fields_only() {
        let mut u = AnthropicUsage {
            input_tokens: Some(25),
            output_tokens: Some(1),
            cache_read_input_tokens: Some(3),
            cache_creation_input_tokens: None,
        };
        let delta: AnthropicUsage =
            serde_json::from_str(r#"{"output_tokens":15,"cache_read_input_tokens":null}"#).unwrap();
        u.overwrite_with(&delta);
        assert_eq!(u.input_tokens, Some(25));
        assert_eq!(u.output_tokens, Some(15));
        assert_eq!(u.cache_read_input_tokens, Some(3), "null does not erase");
    }

    #[test]
    fn anthropic_finish_reasons() {
        for (stop, want) in [
            (Some("end_turn"), "stop"),
            (Some("stop_sequence"), "stop"),
            (Some("pause_turn"), "stop"),
            (Some("max_tokens"), "length"),
            (Some("tool_use"), "tool_calls"),
            (Some("refusal"), "content_filter"),
            (Some("something_new"), "stop"),
            (None, "stop"),
        ] {
            assert_eq!(finish_reason(stop), want, "{stop:?}");
        }
    }

    #[test]
    fn anthropic_numbers_in_decimal() {
        for n in [0, 7, 10, 12345, u64::MAX] {
            let mut out = Vec::new();
            push_u64(&mut out, n);
            assert_eq!(out, n.to_string().as_bytes());
        }
    }
}
