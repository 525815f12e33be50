//! Usage read from Anthropic's own answers (a request passed through to an Anthropic
//! cluster), in OpenAI's terms, so limits, quotas, cost and the access log see the same numbers
//! whatever the dialect: `prompt_tokens` = `input_tokens` + `cache_read_input_tokens` +
//! `cache_creation_input_tokens`, `cached_tokens` = `cache_read_input_tokens`,
//! `cache_write_tokens` = `cache_creation_input_tokens` (priced apart), `completion_tokens` =
//! `output_tokens`.
//!
//! Nothing here fails: what is not JSON or not shaped as expected is skipped.

use serde_json::Value;

use super::response::count;
use crate::openai::json::truncate;
use crate::openai::meter::usage::{UpstreamError, MAX_ERROR_MESSAGE};
use crate::openai::meter::Usage;

/// The usage of a whole Messages response body; `None` when it reports none (an error body).
pub(crate) fn message_usage(body: &[u8]) -> Option<Usage> {
    let v: Value = serde_json::from_slice(body).ok()?;
    Counts::read(v.get("usage")?).metered()
}

/// Anthropic's four counts, each as last reported (`None`: never reported).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    input: Option<u64>,
    output: Option<u64>,
    cache_read: Option<u64>,
    cache_creation: Option<u64>,
}

impl Counts {
    fn read(usage: &Value) -> Counts {
        let get = |key: &str| usage.get(key).and_then(count);
        Counts {
            input: get("input_tokens"),
            output: get("output_tokens"),
            cache_read: get("cache_read_input_tokens"),
            cache_creation: get("cache_creation_input_tokens"),
        }
    }

    /// Take the counts `newer` reports; keep the others (a later event never erases one).
    fn merge(&mut self, newer: Counts) {
        let keep = |old: &mut Option<u64>, new: Option<u64>| {
            if new.is_some() {
                *old = new;
            }
        };
        keep(&mut self.input, newer.input);
        keep(&mut self.output, newer.output);
        keep(&mut self.cache_read, newer.cache_read);
        keep(&mut self.cache_creation, newer.cache_creation);
    }

    fn metered(&self) -> Option<Usage> {
        if *self == Counts::default() {
            return None;
        }
        let cache_read = self.cache_read.unwrap_or(0);
        let cache_creation = self.cache_creation.unwrap_or(0);
        let prompt = self
            .input
            .unwrap_or(0)
            .saturating_add(cache_read)
            .saturating_add(cache_creation);
        let completion = self.output.unwrap_or(0);
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
            cached_tokens: cache_read,
            cache_write_tokens: cache_creation,
            reasoning_tokens: 0,
        })
    }
}

/// Reads an Anthropic event stream as it is relayed: `message_start`'s usage, each
/// `message_delta`'s cumulative usage over it, the stop reason, whether `message_stop` came,
/// and an `error` event. Keep one per worker and [`reset`](Self::reset) it between responses.
#[derive(Debug, Default)]
pub(crate) struct AnthropicStreamMeter {
    counts: Counts,
    stop_reason: Option<String>,
    stopped: bool,
    error: Option<UpstreamError>,
}

/// Longest stop reason kept, in bytes.
const MAX_STOP_REASON: usize = 128;

impl AnthropicStreamMeter {
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }

    /// One event: its `event:` name (empty when it had none: then the data's `type` names it)
    /// and its data. Only `message_start`, `message_delta`, `message_stop` and `error` are
    /// read; the content events, the bulk of a stream, are not parsed.
    pub(crate) fn on_event(&mut self, name: &[u8], data: &[u8]) {
        let name = name.trim_ascii();
        match name {
            b"message_stop" => {
                self.stopped = true;
                return;
            }
            b"message_start" | b"message_delta" | b"error" | b"" => {}
            _ => return,
        }
        let Ok(v) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        let kind = if name.is_empty() {
            v.get("type").and_then(Value::as_str).unwrap_or_default()
        } else {
            std::str::from_utf8(name).unwrap_or_default()
        };
        match kind {
            "message_start" => {
                if let Some(u) = v.get("message").and_then(|m| m.get("usage")) {
                    self.counts.merge(Counts::read(u));
                }
            }
            "message_delta" => {
                if let Some(u) = v.get("usage") {
                    self.counts.merge(Counts::read(u));
                }
                if let Some(reason) = v
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.stop_reason = Some(truncate(reason, MAX_STOP_REASON).to_owned());
                }
            }
            "message_stop" => self.stopped = true,
            "error" => {
                let e = v.get("error");
                let text = |key: &str| {
                    e.and_then(|e| e.get(key))
                        .and_then(Value::as_str)
                        .map(|s| truncate(s, MAX_ERROR_MESSAGE).to_owned())
                };
                self.error = Some(UpstreamError {
                    message: text("message").unwrap_or_default(),
                    kind: text("type"),
                    code: None,
                });
            }
            _ => {}
        }
    }

    /// The usage so far; `None` before any was reported.
    pub(crate) fn usage(&self) -> Option<Usage> {
        self.counts.metered()
    }

    /// `message_stop` arrived: the answer is whole.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped
    }

    /// The last `message_delta`'s `stop_reason`.
    #[cfg(test)]
    pub(crate) fn stop_reason(&self) -> Option<&str> {
        self.stop_reason.as_deref()
    }

    /// The `error` event, if one came.
    pub(crate) fn error(&self) -> Option<&UpstreamError> {
        self.error.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u64, completion: u64, cached: u64, written: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            cached_tokens: cached,
            cache_write_tokens: written,
            reasoning_tokens: 0,
        }
    }

    #[test]
    fn anthropic_body_usage_in_openai_terms() {
        let body = br#"{"id":"msg_01","type":"message","role":"assistant","content":[{"type":"text","text":"Hi"}],"stop_reason":"end_turn","usage":{"input_tokens":21,"cache_creation_input_tokens":188086,"cache_read_input_tokens":3000,"cache_creation":{"ephemeral_5m_input_tokens":188086,"ephemeral_1h_input_tokens":0},"output_tokens":393,"service_tier":"standard"}}"#;
        assert_eq!(
            message_usage(body),
            Some(usage(21 + 188_086 + 3000, 393, 3000, 188_086))
        );
        assert_eq!(
            message_usage(br#"{"usage":{"input_tokens":5,"output_tokens":1}}"#),
            Some(usage(5, 1, 0, 0))
        );
        assert_eq!(
            message_usage(
                br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            None
        );
        assert_eq!(message_usage(br#"{"usage":{}}"#), None);
        assert_eq!(message_usage(b"not json"), None);
    }

    #[test]
    fn anthropic_stream_meter_overwrites_present_counts_and_never_erases() {
        let mut m = AnthropicStreamMeter::new();
        let events: &[(&str, &str)] = &[
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":472,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":2}}}"#,
            ),
            ("ping", r#"{"type": "ping"}"#),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
            ),
            // Older API versions: only output_tokens in the delta.
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":null,"stop_sequence":null},"usage":{"output_tokens":10}}"#,
            ),
        ];
        for (name, data) in events {
            m.on_event(name.as_bytes(), data.as_bytes());
        }
        assert_eq!(m.usage(), Some(usage(2572, 10, 2000, 100)));
        assert!(!m.stopped());
        assert_eq!(m.stop_reason(), None);
        // Newer versions repeat every count; null is not a count.
        m.on_event(
            b"message_delta",
            br#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"input_tokens":472,"cache_creation_input_tokens":null,"cache_read_input_tokens":2000,"output_tokens":89}}"#,
        );
        m.on_event(b"message_stop", br#"{"type":"message_stop"}"#);
        assert_eq!(m.usage(), Some(usage(2572, 89, 2000, 100)));
        assert!(m.stopped());
        assert_eq!(m.stop_reason(), Some("tool_use"));
        assert_eq!(m.error(), None);
        m.reset();
        assert_eq!(m.usage(), None);
        assert!(!m.stopped());
    }

    #[test]
    fn anthropic_stream_meter_reads_unnamed_events_and_errors() {
        let mut m = AnthropicStreamMeter::new();
        m.on_event(
            b"",
            br#"{"type":"message_start","message":{"usage":{"input_tokens":7,"output_tokens":1}}}"#,
        );
        m.on_event(
            b"error",
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        m.on_event(b"message_delta", b"{not json");
        assert_eq!(m.usage(), Some(usage(7, 1, 0, 0)));
        let e = m.error().unwrap();
        assert_eq!(
            (e.message.as_str(), e.kind.as_deref()),
            ("Overloaded", Some("overloaded_error"))
        );
        assert!(!m.stopped());
        m.on_event(b"", br#"{"type":"message_stop"}"#);
        assert!(m.stopped());
    }
}
