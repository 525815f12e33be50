//! Meter: read token usage and timing from an upstream response while it is relayed.
//!
//! Runs beside the relay phase, on the body bytes after transfer decoding, and never holds them
//! back: the relay writes each upstream read to the client as it is and then shows it here.
//! [`SseMeter::feed`] takes each read of an event stream with the [`Mono`] the relay saw it
//! (the meter never reads the clock) and splits it into events ([`sse::SseSplitter`], zero-copy
//! for events within one read, bounded memory for events spanning reads); each event's `data`
//! goes to [`usage::StreamMeter`]. A non-streamed JSON body goes to
//! [`StreamMeter::on_json_body`] whole. Returns a [`MeterSummary`]: the upstream's reported
//! [`Usage`], when the first and last generated content arrived, content events and bytes (for
//! an estimate when no usage came), the finish reason, an error the upstream reported in the
//! stream, and whether `[DONE]` arrived.
//!
//! It raises no errors: it only observes. Bytes that are not SSE, data that is not JSON and
//! events longer than the limit are counted in the summary and otherwise skipped; no input
//! makes it panic or grow without bound.

pub(crate) mod sse;
pub(crate) mod usage;

use crate::sys::clock::Mono;

pub(crate) use sse::{event_data, event_name, Framed, SseFraming, SseSplitter, DEFAULT_MAX_EVENT};
pub(crate) use usage::{MeterSummary, StreamMeter, Usage};

/// The bytes a whole JSON body parsed where it lies gets appended for the parse (simd-json's
/// padding): room a caller reserving for the body can add.
pub(crate) const PARSE_PADDING: usize = simd_json::INPUT_PADDING;

/// Splitter and meter together, for one event stream at a time. Keep one and
/// [`reset`](Self::reset) it between responses: its buffers are reused (the JSON parse's are
/// one set per thread, shared by every meter on it).
#[derive(Debug, Default)]
pub struct SseMeter {
    splitter: SseSplitter,
    meter: StreamMeter,
    /// Joined data of a multi-line event.
    data: Vec<u8>,
}

impl SseMeter {
    /// Events up to [`DEFAULT_MAX_EVENT`] bytes are metered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Events up to `max_event` bytes are metered.
    pub fn with_max_event(max_event: usize) -> Self {
        Self {
            splitter: SseSplitter::with_max_event(max_event),
            ..Self::default()
        }
    }

    /// Look at the next decoded body bytes of the stream, seen at `now`.
    pub fn feed(&mut self, chunk: &[u8], now: Mono) {
        let Self {
            splitter,
            meter,
            data,
        } = self;
        splitter.feed(chunk, |event| {
            if let Some(d) = event_data(event, data) {
                meter.on_data(d, now);
            }
        });
    }

    /// Whether `event` (one whole event, as [`SseSplitter`] delimits it; line endings around it
    /// are fine) is the usage-only chunk `stream_options.include_usage` adds (see
    /// [`StreamMeter::is_usage_only`]). Records nothing; reuses this meter's parse buffers.
    pub fn is_usage_only_event(&mut self, event: &[u8]) -> bool {
        let Self { meter, data, .. } = self;
        event_data(event, data).is_some_and(|d| meter.is_usage_only(d))
    }

    /// A whole non-streamed JSON body, parsed where it lies (see [`StreamMeter::on_json_body`]).
    pub fn on_json_body(&mut self, body: &mut Vec<u8>, from: usize) {
        self.meter.on_json_body(body, from);
    }

    /// The generated text seen so far (see [`StreamMeter::captured`]).
    pub fn captured(&self) -> &[u8] {
        self.meter.captured()
    }

    /// Whether the stream's events said it ended — `[DONE]`, a finish reason (the Responses
    /// API's terminal event sets one) or an error event — or could have: an event too long to
    /// read may have been the end (a `response.completed` repeats the whole output), so a
    /// stream with one is never called unfinished. Reads without copying.
    pub fn events_ended(&self) -> bool {
        let s = self.meter.summary();
        s.done
            || s.finish_reason.is_some()
            || s.error.is_some()
            || self.splitter.oversized_events() > 0
    }

    /// What the events recorded so far, borrowed: [`Self::summary`] without the splitter's
    /// counts (`oversized_events`, `partial_event`, left at zero) and without cloning the
    /// finish reason, for a caller that reads the numbers.
    pub(crate) fn recorded(&self) -> &MeterSummary {
        self.meter.summary()
    }

    /// What has been recorded so far.
    pub fn summary(&self) -> MeterSummary {
        let mut s = self.meter.summary().clone();
        s.oversized_events = self.splitter.oversized_events();
        s.partial_event = self.splitter.has_partial();
        s
    }

    /// Forget the response, keeping the buffers.
    pub fn reset(&mut self) {
        self.splitter.reset();
        self.meter.reset();
        if self.data.capacity() > DEFAULT_MAX_EVENT {
            self.data = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::usage::UpstreamError;
    use super::*;
    use std::time::Duration;

    /// A chat completion stream as OpenAI sends it with `stream_options.include_usage`.
    const CHAT_STREAM: &str = concat!(
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        ": keep-alive\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"你好，\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"中文 \\ud83d\\ude00 ok\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" 🎉\\n\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":10,\"total_tokens\":29,\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}\n\n",
        "data: [DONE]\n\n",
    );

    /// Bytes of generated content in [`CHAT_STREAM`]: "你好，", "中文 😀 ok", " 🎉\n".
    const CHAT_CONTENT_BYTES: u64 = 9 + 14 + 6;

    fn t(ms: u64) -> Mono {
        // A fixed base keeps summaries comparable across meters.
        static BASE: std::sync::OnceLock<Mono> = std::sync::OnceLock::new();
        *BASE.get_or_init(Mono::now) + Duration::from_millis(ms)
    }

    #[test]
    fn a_stream_has_ended_by_done_finish_error_or_an_unreadable_event() {
        let ended = |body: &[u8]| {
            let mut m = SseMeter::new();
            m.feed(body, t(0));
            m.events_ended()
        };
        assert!(ended(CHAT_STREAM.as_bytes()));
        let cut = CHAT_STREAM.split("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{},").next().unwrap();
        assert!(!ended(cut.as_bytes()), "content only: not ended");
        let finished_no_done =
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
        assert!(ended(finished_no_done));
        let error = b"data: {\"error\":{\"message\":\"x\",\"type\":\"server_error\"}}\n\n";
        assert!(ended(error));
        // A `response.completed` too long to read may have been the end.
        let huge = format!(
            "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"output\":\"{}\"}}}}\n\n",
            "x".repeat(DEFAULT_MAX_EVENT + 1)
        );
        let created = "event: response.created\ndata: {\"type\":\"response.created\"}\n\n";
        assert!(!ended(created.as_bytes()));
        assert!(ended(format!("{created}{huge}").as_bytes()));
    }

    /// Feed `chunks`, the i-th at time `i` ms.
    fn meter(chunks: &[&[u8]]) -> MeterSummary {
        let mut m = SseMeter::new();
        for (i, c) in chunks.iter().enumerate() {
            m.feed(c, t(i as u64));
        }
        m.summary()
    }

    /// Feed `chunks` all at one time, so the summary does not depend on the split.
    fn meter_at_once(chunks: &[&[u8]]) -> MeterSummary {
        let mut m = SseMeter::new();
        for c in chunks {
            m.feed(c, t(0));
        }
        m.summary()
    }

    fn events(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut s = SseSplitter::new();
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c, |e| out.push(e.to_vec()));
        }
        out
    }

    fn check_chat_summary(s: &MeterSummary) {
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 19,
                completion_tokens: 10,
                total_tokens: 29,
                cached_tokens: 0,
                cache_write_tokens: 0,
                reasoning_tokens: 0,
            })
        );
        assert_eq!(s.content_events, 3);
        assert_eq!(s.content_bytes, CHAT_CONTENT_BYTES);
        assert_eq!(s.finish_reason.as_deref(), Some("stop"));
        assert_eq!(s.error, None);
        assert!(s.done);
        assert_eq!(s.events, 7);
        assert_eq!(s.unparsed_events, 0);
        assert_eq!(s.oversized_events, 0);
        assert!(!s.partial_event);
    }

    fn check_split_invariant(stream: &[u8]) -> MeterSummary {
        let whole_events = events(&[stream]);
        let whole = meter_at_once(&[stream]);
        for cut in 0..=stream.len() {
            let parts: [&[u8]; 2] = [&stream[..cut], &stream[cut..]];
            assert_eq!(events(&parts), whole_events, "split at {cut}");
            assert_eq!(meter_at_once(&parts), whole, "split at {cut}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(events(&bytes), whole_events, "byte by byte");
        assert_eq!(meter_at_once(&bytes), whole, "byte by byte");
        whole
    }

    #[test]
    fn chat_stream_split_anywhere() {
        let s = check_split_invariant(CHAT_STREAM.as_bytes());
        check_chat_summary(&s);
        assert_eq!(events(&[CHAT_STREAM.as_bytes()]).len(), 8);
    }

    #[test]
    fn chat_stream_with_crlf_and_cr() {
        let crlf = CHAT_STREAM.replace('\n', "\r\n");
        let cr = CHAT_STREAM.replace('\n', "\r");
        let mixed = CHAT_STREAM.replace("\n\n", "\r\n\n");
        let lf = check_split_invariant(CHAT_STREAM.as_bytes());
        for variant in [crlf, cr, mixed] {
            assert_eq!(check_split_invariant(variant.as_bytes()), lf);
        }
    }

    #[test]
    fn content_timing() {
        // One event per read, 1 ms apart: the role chunk (0) and the comment (1) are not
        // content; content arrives in reads 2..=4.
        let stream = CHAT_STREAM.as_bytes();
        let mut chunks = Vec::new();
        let mut rest = stream;
        while !rest.is_empty() {
            let end = memchr::memmem::find(rest, b"\n\n").unwrap() + 2;
            chunks.push(&rest[..end]);
            rest = &rest[end..];
        }
        let s = meter(&chunks);
        check_chat_summary(&s);
        assert_eq!(s.first_event_at, Some(t(0)));
        assert_eq!(s.first_content_at, Some(t(2)));
        assert_eq!(s.last_content_at, Some(t(4)));
    }

    #[test]
    fn usage_on_a_chunk_with_choices_and_tool_calls() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]},\"finish_reason\":null}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":20,\"total_tokens\":70,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
            "data: [DONE]\n\n",
        );
        let s = check_split_invariant(stream.as_bytes());
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 50,
                completion_tokens: 20,
                total_tokens: 70,
                cached_tokens: 32,
                cache_write_tokens: 0,
                reasoning_tokens: 0,
            })
        );
        assert_eq!(s.content_events, 2);
        assert_eq!(s.content_bytes, 11 + 16);
        assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"));
        assert!(s.done);
    }

    #[test]
    fn reasoning_and_cumulative_usage() {
        // vLLM / DeepSeek style: reasoning deltas, usage on every chunk (the last one counts),
        // Python's `json.dumps` spacing and ASCII escapes.
        let stream = concat!(
            "data: {\"choices\": [{\"delta\": {\"reasoning_content\": \"\\u601d\"}, \"finish_reason\": null}], \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 1, \"total_tokens\": 6}}\n\n",
            "data: {\"choices\": [{\"delta\": {\"content\": \"\", \"reasoning_content\": null}, \"finish_reason\": null}], \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 1, \"total_tokens\": 6}}\n\n",
            "data: {\"choices\": [{\"delta\": {\"content\": \"ok\"}, \"finish_reason\": \"length\"}], \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 2, \"total_tokens\": 7, \"completion_tokens_details\": {\"reasoning_tokens\": 1}}}\n\n",
            "data: {\"choices\": [{\"delta\": {}, \"finish_reason\": null}]}\n\n",
            "data: [DONE]\n\n",
        );
        let s = meter(&[stream.as_bytes()]);
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                total_tokens: 7,
                cached_tokens: 0,
                cache_write_tokens: 0,
                reasoning_tokens: 1,
            })
        );
        assert_eq!(s.content_events, 2);
        assert_eq!(s.content_bytes, 3 + 2);
        assert_eq!(s.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn completions_stream() {
        let stream = concat!(
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"text\":\"\",\"index\":0,\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"text\":\" Hello\",\"index\":0,\"finish_reason\":null}]}\n\n",
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"text\":\"!\",\"index\":0,\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n",
            "data: [DONE]\n\n",
        );
        let s = meter(&[stream.as_bytes()]);
        assert_eq!(s.content_events, 2);
        assert_eq!(s.content_bytes, 7);
        assert_eq!(s.usage.unwrap().total_tokens, 5);
        assert_eq!(s.finish_reason.as_deref(), Some("stop"));
    }

    const RESPONSES_STREAM: &str = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[],\"usage\":null}}\n\n",
        "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"sequence_number\":1,\"output_index\":0,\"item\":{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"in_progress\",\"role\":\"assistant\",\"content\":[]}}\n\n",
        "event: response.reasoning_summary_text.delta\ndata: {\"type\":\"response.reasoning_summary_text.delta\",\"sequence_number\":2,\"item_id\":\"rs_1\",\"output_index\":0,\"summary_index\":0,\"delta\":\"Think\"}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":3,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"\"}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi 中文\"}\n\n",
        "event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"sequence_number\":5,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"text\":\"Hi 中文\"}\n\n",
        "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":6,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"error\":null,\"incomplete_details\":null,\"output\":[{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi 中文\",\"annotations\":[]}]}],\"usage\":{\"input_tokens\":36,\"input_tokens_details\":{\"cached_tokens\":4},\"output_tokens\":87,\"output_tokens_details\":{\"reasoning_tokens\":64},\"total_tokens\":123}}}\n\n",
    );

    #[test]
    fn responses_stream() {
        let s = check_split_invariant(RESPONSES_STREAM.as_bytes());
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 36,
                completion_tokens: 87,
                total_tokens: 123,
                cached_tokens: 4,
                cache_write_tokens: 0,
                reasoning_tokens: 64,
            })
        );
        assert_eq!(s.content_events, 2);
        assert_eq!(s.content_bytes, 5 + 9);
        assert_eq!(s.finish_reason.as_deref(), Some("completed"));
        assert!(!s.done);
        assert_eq!(s.events, 7);
        assert_eq!(s.error, None);
    }

    #[test]
    fn responses_incomplete_and_failed() {
        let incomplete = "data: {\"type\":\"response.incomplete\",\"response\":{\"status\":\"incomplete\",\"incomplete_details\":{\"reason\":\"max_output_tokens\"},\"usage\":{\"input_tokens\":1,\"output_tokens\":16,\"total_tokens\":17}}}\n\n";
        let s = meter(&[incomplete.as_bytes()]);
        assert_eq!(s.finish_reason.as_deref(), Some("max_output_tokens"));
        assert_eq!(s.usage.unwrap().completion_tokens, 16);

        let failed = "data: {\"type\":\"response.failed\",\"response\":{\"status\":\"failed\",\"error\":{\"code\":\"server_error\",\"message\":\"The model failed.\"},\"usage\":null}}\n\n";
        let s = meter(&[failed.as_bytes()]);
        assert_eq!(s.finish_reason.as_deref(), Some("failed"));
        assert_eq!(s.usage, None);
        let e = s.error.unwrap();
        assert_eq!(e.message, "The model failed.");
        assert_eq!(e.code.as_deref(), Some("server_error"));

        let error = "event: error\ndata: {\"type\":\"error\",\"code\":\"rate_limit_exceeded\",\"message\":\"Slow down.\",\"param\":null,\"sequence_number\":3}\n\n";
        let e = meter(&[error.as_bytes()]).error.unwrap();
        assert_eq!(e.message, "Slow down.");
        assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
    }

    #[test]
    fn error_events() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"par\"},\"finish_reason\":null}]}\n\n",
            "data: {\"error\":{\"message\":\"The server had an error while processing your request.\",\"type\":\"server_error\",\"param\":null,\"code\":500}}\n\n",
        );
        let s = check_split_invariant(stream.as_bytes());
        assert_eq!(
            s.error,
            Some(UpstreamError {
                message: "The server had an error while processing your request.".into(),
                kind: Some("server_error".into()),
                code: Some("500".into()),
            })
        );
        assert_eq!(s.content_events, 1);
        assert!(!s.done);

        // vLLM's older shape, and a bare string.
        let vllm = "data: {\"object\":\"error\",\"message\":\"boom\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}\n\n";
        let e = meter(&[vllm.as_bytes()]).error.unwrap();
        assert_eq!(
            (e.message.as_str(), e.kind.as_deref(), e.code.as_deref()),
            ("boom", Some("BadRequestError"), Some("400"))
        );
        let bare = "data: {\"error\":\"overloaded\"}\n\n";
        assert_eq!(
            meter(&[bare.as_bytes()]).error.unwrap().message,
            "overloaded"
        );

        // A long message is cut on a character boundary.
        let long = format!(
            "data: {{\"error\":{{\"message\":\"{}\"}}}}\n\n",
            "é".repeat(1000)
        );
        let m = meter(&[long.as_bytes()]).error.unwrap().message;
        assert_eq!(m.len(), usage::MAX_ERROR_MESSAGE);
    }

    #[test]
    fn usage_only_events() {
        let mut m = SseMeter::new();
        let mut is = |e: &str| m.is_usage_only_event(e.as_bytes());
        let usage_chunk = CHAT_STREAM
            .split("\n\n")
            .find(|e| e.contains("\"choices\":[]"))
            .unwrap();
        assert!(is(usage_chunk));
        assert!(is(&format!("{usage_chunk}\r\n\r\n")));
        // Python's spacing, data split over lines, other fields around it.
        assert!(is(
            "id: 1\ndata: {\"choices\" : [ ] ,\ndata: \"usage\":\t{\"prompt_tokens\": 1}}"
        ));
        for not in [
            "data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"prompt_tokens\":1}}",
            "data: {\"choices\":[],\"usage\":null}",
            "data: {\"usage\":{\"prompt_tokens\":1}}",
            "data: {\"choices\":[],\"x\":{\"usage\":{\"prompt_tokens\":1}}}",
            "data: {\"x\":{\"choices\":[]},\"usage\":{\"prompt_tokens\":1}}",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}",
            ": {\"choices\":[],\"usage\":{}}",
            "data: [DONE]",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":1}}}",
        ] {
            assert!(!is(not), "{not}");
        }
        // Asking records nothing.
        assert_eq!(m.summary(), SseMeter::new().summary());
    }

    #[test]
    fn a_body_reporting_usage_keeps_no_copy_of_its_text() {
        // The capture only serves the estimate of an answer that reports no usage.
        let text = "word ".repeat(100);
        let with_usage = format!(
            r#"{{"choices":[{{"message":{{"content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":1,"completion_tokens":100,"total_tokens":101}}}}"#
        );
        let mut body = with_usage.clone().into_bytes();
        let mut m = StreamMeter::new();
        m.on_json_body(&mut body, 0);
        assert_eq!(body.len(), with_usage.len(), "the padding is cut off again");
        assert_eq!(m.summary().usage.map(|u| u.completion_tokens), Some(100));
        assert!(m.captured().is_empty());

        let without = format!(r#"{{"choices":[{{"message":{{"content":"{text}"}}}}]}}"#);
        let mut m = StreamMeter::new();
        m.on_json_body(&mut without.into_bytes(), 0);
        assert_eq!(m.summary().usage, None);
        assert_eq!(m.captured(), text.as_bytes());
    }

    #[test]
    fn a_body_behind_other_bytes_reads_as_it_does_alone() {
        // The relay keeps a passed-through answer behind its response head and meters it there.
        let head = b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n";
        let text = "say \\\"hi\\\" ".repeat(50);
        let bodies = [
            // Reports usage: the scan.
            format!(
                r#"{{"choices":[{{"message":{{"content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}}}"#
            ),
            // Reports none: the whole parse, which unescapes in place.
            format!(
                r#"{{"choices":[{{"message":{{"content":"{text}"}},"finish_reason":"length"}}]}}"#
            ),
            r#"{"error":{"message":"no","type":"invalid_request_error"}}"#.to_owned(),
            "not json".to_owned(),
        ];
        for body in bodies {
            let mut alone = StreamMeter::new();
            alone.on_json_body(&mut body.clone().into_bytes(), 0);
            let mut buf = head.to_vec();
            buf.extend_from_slice(body.as_bytes());
            let mut behind = StreamMeter::new();
            behind.on_json_body(&mut buf, head.len());
            assert_eq!(behind.summary(), alone.summary(), "{body}");
            assert_eq!(behind.captured(), alone.captured(), "{body}");
            assert_eq!(&buf[..head.len()], head, "the bytes before are left alone");
            assert_eq!(
                buf.len(),
                head.len() + body.len(),
                "the padding is cut off again"
            );
        }
    }

    #[test]
    fn non_streaming_bodies() {
        let body = |b: &str| {
            let mut m = StreamMeter::new();
            m.on_json_body(&mut b.as_bytes().to_vec(), 0);
            m.take_summary()
        };
        let chat = body(
            r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"Hello 中文","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":2,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":3,"audio_tokens":0}}}"#,
        );
        assert_eq!(
            chat.usage,
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 12,
                total_tokens: 21,
                cached_tokens: 2,
                cache_write_tokens: 0,
                reasoning_tokens: 3,
            })
        );
        assert_eq!(chat.finish_reason.as_deref(), Some("stop"));
        // Reported usage: the content is only scanned (its byte count serves the estimate of
        // an answer without usage).
        assert_eq!(chat.content_bytes, 0);
        assert_eq!(chat.content_events, 0);
        assert_eq!(chat.first_content_at, None);

        let completion = body(
            r#"{"id":"cmpl-1","object":"text_completion","choices":[{"text":"\n\nThis is","index":0,"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#,
        );
        assert_eq!(completion.usage.unwrap().completion_tokens, 7);
        assert_eq!(completion.finish_reason.as_deref(), Some("length"));
        assert_eq!(completion.content_bytes, 0);

        let embeddings = body(
            r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.0023064255,-0.009327292,1e-3]}],"model":"text-embedding-3-small","usage":{"prompt_tokens":8,"total_tokens":8}}"#,
        );
        assert_eq!(
            embeddings.usage,
            Some(Usage {
                prompt_tokens: 8,
                total_tokens: 8,
                ..Usage::default()
            })
        );
        assert_eq!(embeddings.finish_reason, None);
        assert_eq!(embeddings.content_bytes, 0);

        let responses = body(
            r#"{"id":"resp_1","object":"response","status":"completed","error":null,"incomplete_details":null,"output":[{"type":"reasoning","summary":[]},{"type":"message","content":[{"type":"output_text","text":"Hi"}]},{"type":"function_call","name":"f","arguments":"{}"}],"usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":0},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":15}}"#,
        );
        assert_eq!(responses.usage.unwrap().reasoning_tokens, 2);
        assert_eq!(responses.finish_reason.as_deref(), Some("completed"));
        assert_eq!(responses.content_bytes, 4);

        let error = body(
            r#"{"error":{"message":"Incorrect API key provided.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#,
        );
        assert_eq!(
            error.error.unwrap().code.as_deref(),
            Some("invalid_api_key")
        );
        assert_eq!(error.usage, None);

        let not_json = body("<html>502</html>");
        assert_eq!(not_json.unparsed_events, 1);
        assert_eq!(not_json.usage, None);
    }

    #[test]
    fn odd_values_are_ignored() {
        let stream = concat!(
            "data: {\"usage\":{\"prompt_tokens\":-1,\"completion_tokens\":2.0,\"total_tokens\":\"3\"}}\n\n",
            "data: {\"usage\":{}}\n\n",
            "data: {\"usage\":[1,2]}\n\n",
            "data: {\"choices\":{\"delta\":{\"content\":\"x\"}}}\n\n",
            "data: {\"choices\":[1,null,[],{\"delta\":\"x\",\"finish_reason\":7}]}\n\n",
            "data: {\"type\":5,\"delta\":\"x\"}\n\n",
            "data: {\"usage\":{\"prompt_tokens\":18446744073709551615,\"completion_tokens\":18446744073709551615}}\n\n",
            "data: {\"a\":\n\n",
            "data: [1,2]\n\n",
            "data: hello\n\n",
            "data:\n\n",
            "event: ping\n\n",
        );
        let s = meter(&[stream.as_bytes()]);
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: u64::MAX,
                completion_tokens: u64::MAX,
                total_tokens: u64::MAX,
                ..Usage::default()
            })
        );
        assert_eq!(s.content_events, 0);
        assert_eq!(s.finish_reason, None);
        assert_eq!(s.events, 11);
        assert_eq!(s.unparsed_events, 4);
    }

    #[test]
    fn escapes_are_decoded() {
        // Keys and values are read as JSON means them, as the client's SDK will read them.
        let stream = concat!(
            "data: {\"\\u0063hoices\":[{\"text\":\"\\u00e9\\ud83d\\ude00\\n\",\"logprobs\":{\"token_logprobs\":[-0.31,-1.2e-05]},\"finish_reason\":\"st\\u006fp\"}]}\n\n",
            "data: {\"choices\":[{\"text\":\"a\"}],\"choices\":[{\"text\":\"bc\"}]}\n\n",
        );
        let s = meter(&[stream.as_bytes()]);
        assert_eq!(s.content_events, 2);
        // "é😀\n" is 2 + 4 + 1 bytes; of a duplicated key the last one counts.
        assert_eq!(s.content_bytes, 7 + 2);
        assert_eq!(s.finish_reason.as_deref(), Some("stop"));
        assert_eq!(s.unparsed_events, 0);
    }

    #[test]
    fn oversized_event_is_counted_in_the_summary() {
        let mut m = SseMeter::with_max_event(512);
        let big = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
            "x".repeat(1000)
        );
        for c in big.as_bytes().chunks(100) {
            m.feed(c, t(0));
        }
        m.feed(CHAT_STREAM.as_bytes(), t(1));
        let s = m.summary();
        assert_eq!(s.oversized_events, 1);
        assert_eq!(s.content_events, 3);
        assert_eq!(s.usage.unwrap().total_tokens, 29);
        m.reset();
        m.feed(b"data: {\"choices\":[]", t(2));
        let s = m.summary();
        assert!(s.partial_event);
        assert_eq!(s.oversized_events, 0);
        assert_eq!(s.events, 0);
    }

    /// xorshift64*: deterministic noise without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            crate::sys::rand::xorshift64star(&mut self.0)
        }
    }

    #[test]
    fn garbage_never_panics() {
        // Bytes drawn mostly from what SSE and JSON are made of, so the parsers go deep.
        const ALPHABET: &[u8] =
            b"\r\n\n::data: {}[]\"\",,choices delta content usage error type tokens 0123456789.-e\\u\xff\xc3\x80";
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..200 {
            let mut m = SseMeter::with_max_event(4096);
            let len = (rng.next() % 20_000) as usize;
            let input: Vec<u8> = (0..len)
                .map(|_| {
                    let r = rng.next();
                    if round % 4 == 0 {
                        r as u8
                    } else {
                        ALPHABET[(r % ALPHABET.len() as u64) as usize]
                    }
                })
                .collect();
            let mut rest = &input[..];
            while !rest.is_empty() {
                let n = ((rng.next() % 3000) as usize + 1).min(rest.len());
                m.feed(&rest[..n], t(0));
                rest = &rest[n..];
                assert!(m.splitter.pending_len() <= 4096 + 2);
            }
            m.on_json_body(&mut input.to_vec(), 0);
            let _ = m.summary();
        }
        // Structured garbage: valid JSON in unexpected shapes.
        let docs = [
            r#"{"choices":[{"delta":{"tool_calls":[1,{"function":[]}],"function_call":"x"}}]}"#,
            r#"{"type":"response.completed","response":[]}"#,
            r#"{"type":"response.completed","response":{"usage":{"input_tokens":1e300},"incomplete_details":[]}}"#,
            r#"{"error":{"message":5,"type":[],"code":{}}}"#,
            r#"{"usage":{"prompt_tokens_details":3}}"#,
            r#"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"#,
        ];
        let mut m = StreamMeter::new();
        for d in docs {
            m.on_data(d.as_bytes(), t(0));
            m.on_json_body(&mut d.as_bytes().to_vec(), 0);
        }
        let deep = "[".repeat(100_000);
        m.on_data(format!("{{\"a\":{deep}").as_bytes(), t(0));
        m.on_json_body(&mut deep.as_bytes().to_vec(), 0);
    }
}
