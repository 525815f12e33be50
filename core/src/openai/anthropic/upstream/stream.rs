//! A streamed Messages response → OpenAI `chat.completion.chunk` events, event by event.
//!
//! Fed each whole SSE event as the caller's splitter yields it, a [`StreamTranslator`] writes
//! what that event means to an OpenAI client at once (nothing is held back for later events):
//! - `message_start`: remembers the message id (chunk ids are `chatcmpl-` + it) and the usage
//!   so far; writes the first chunk, `delta: {"role":"assistant","content":""}`.
//! - `content_block_start`: a `tool_use` block writes a tool-call chunk with its `id`, `type`,
//!   `function.name` and `arguments: ""` under Sluice's own tool-call index (0, 1, 2… in the
//!   order tool blocks start, not Anthropic's block index, which counts text and thinking
//!   blocks too); text and thinking blocks write only text they already carry.
//! - `content_block_delta`: `text_delta` → `content`, `thinking_delta` → `reasoning_content`,
//!   `input_json_delta` → that tool call's `arguments` fragment; `signature_delta`,
//!   `citations_delta` and deltas of server tools' blocks are left out.
//! - `message_delta`: remembers the stop reason and the cumulative usage (fields present
//!   overwrite, fields absent keep their value).
//! - `message_stop`: the final chunk (`delta: {}`, the `finish_reason`), a usage-only chunk
//!   (`choices: []`, the usage in OpenAI's terms), then `data: [DONE]`.
//! - `error`: an OpenAI error event, `data: {"error":{…}}`, and the stream's end: no `[DONE]`
//!   (OpenAI's SDKs raise on it).
//! - `ping`, `content_block_stop` (beyond forgetting the block) and any new event type: nothing.
//!
//! Events after the end are ignored, and so is an event whose data is not JSON (unless it is an
//! `error` event: then a generic error ends the stream). Memory is bounded: the open blocks
//! (normally one) are kept, at most [`MAX_OPEN_BLOCKS`], and nothing of the text.

use std::borrow::Cow;

use super::error::{openai_type, write_error, ErrorObject};
use super::response::{write_tool_call, Block, Message};
use super::{finish_reason, push_str_literal, push_u64, AnthropicUsage};

/// The most content blocks remembered as open at once; past it the oldest is forgotten (and
/// its deltas are then left out). The Messages API streams one block at a time.
const MAX_OPEN_BLOCKS: usize = 64;

/// Turns one Anthropic event stream into one OpenAI chunk stream.
#[derive(Debug)]
pub(crate) struct StreamTranslator {
    model: String,
    created: u64,
    /// `{"id":…,"object":"chat.completion.chunk","created":…,"model":…` — every chunk's start,
    /// written again when `message_start` gives the id.
    head: Vec<u8>,
    usage: AnthropicUsage,
    stop_reason: Option<String>,
    /// Open content blocks: (Anthropic's block index, what it is).
    open: Vec<(u64, Open)>,
    /// Tool calls started so far: the next one's index.
    tools: u32,
    /// The first chunk (the one with the role) is written.
    started: bool,
    ended: bool,
}

/// What an open content block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    Thinking,
    /// A client tool call, with Sluice's tool-call index.
    Tool(u32),
    /// Anything else (server tool use and results, redacted thinking): its deltas are left out.
    Other,
}

/// One event's data. Every field is optional: which are present depends on `type`.
#[derive(Debug, serde::Deserialize)]
struct Event<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    message: Option<Message<'a>>,
    #[serde(borrow, default)]
    content_block: Option<Block<'a>>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(default)]
    usage: Option<AnthropicUsage>,
    #[serde(borrow, default)]
    error: Option<ErrorObject<'a>>,
}

/// A `content_block_delta`'s or a `message_delta`'s `delta`.
#[derive(Debug, serde::Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    partial_json: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    stop_reason: Option<Cow<'a, str>>,
}

impl StreamTranslator {
    /// A translator whose chunks name `model_for_client` and were `created_unix` (seconds).
    pub(crate) fn new(model_for_client: &str, created_unix: u64) -> Self {
        let mut t = StreamTranslator {
            model: model_for_client.to_owned(),
            created: created_unix,
            head: Vec::new(),
            usage: AnthropicUsage::default(),
            stop_reason: None,
            open: Vec::new(),
            tools: 0,
            started: false,
            ended: false,
        };
        t.write_head("");
        t
    }

    /// Whether `message_stop` (or an error event) was seen: the stream ended properly. (The
    /// relay asks the meter, which sees the translated stream's `[DONE]`.)
    #[cfg(test)]
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// Take one event of the Anthropic stream (its `event:` name if any, its `data:`
    /// payload); append the OpenAI events it makes to `out`.
    pub(crate) fn event(&mut self, name: Option<&[u8]>, data: &[u8], out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        let event: Event<'_> = match serde_json::from_slice(data) {
            Ok(event) => event,
            Err(_) => {
                if matches!(name, Some(b"error")) {
                    self.error(None, None, out);
                }
                return;
            }
        };
        // The data's `type` says what the event is; the SSE name only when it is missing.
        let kind = match &event.kind {
            Some(kind) => &**kind,
            None => match name.and_then(|n| std::str::from_utf8(n).ok()) {
                Some(name) => name,
                None => return,
            },
        };
        match kind {
            "message_start" => self.message_start(event.message, out),
            "content_block_start" => {
                if let Some(block) = event.content_block {
                    self.block_start(event.index, &block, out);
                }
            }
            "content_block_delta" => {
                if let Some(delta) = event.delta {
                    self.block_delta(event.index, &delta, out);
                }
            }
            "content_block_stop" => {
                if let Some(index) = event.index {
                    self.open.retain(|(i, _)| *i != index);
                }
            }
            "message_delta" => {
                if let Some(reason) = event.delta.and_then(|d| d.stop_reason) {
                    self.stop_reason = Some(reason.into_owned());
                }
                if let Some(usage) = event.usage {
                    self.usage.overwrite_with(&usage);
                }
            }
            "message_stop" => self.finish(out),
            "error" => {
                let error = event.error.unwrap_or_default();
                self.error(error.kind.as_deref(), error.message.as_deref(), out);
            }
            // "ping", and event types added after this was written.
            _ => {}
        }
    }

    fn write_head(&mut self, message_id: &str) {
        let head = &mut self.head;
        head.clear();
        head.extend_from_slice(b"{\"id\":\"chatcmpl-");
        // The id's text inside the literal: write it quoted, then drop the opening quote.
        let at = head.len();
        push_str_literal(head, message_id);
        head.remove(at);
        head.extend_from_slice(b",\"object\":\"chat.completion.chunk\",\"created\":");
        push_u64(head, self.created);
        head.extend_from_slice(b",\"model\":");
        push_str_literal(head, &self.model);
    }

    fn message_start(&mut self, message: Option<Message<'_>>, out: &mut Vec<u8>) {
        if let Some(message) = message {
            if let Some(id) = message.id.as_deref() {
                if !self.started {
                    self.write_head(id);
                }
            }
            if let Some(usage) = &message.usage {
                self.usage.overwrite_with(usage);
            }
        }
        self.start(out);
    }

    /// Write the first chunk, with the role, unless it is written.
    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        self.chunk(out, |out| {
            out.extend_from_slice(b"\"role\":\"assistant\",\"content\":\"\"")
        });
    }

    fn remember(&mut self, index: Option<u64>, open: Open) {
        let Some(index) = index else { return };
        self.open.retain(|(i, _)| *i != index);
        if self.open.len() >= MAX_OPEN_BLOCKS {
            self.open.remove(0);
        }
        self.open.push((index, open));
    }

    fn block_start(&mut self, index: Option<u64>, block: &Block<'_>, out: &mut Vec<u8>) {
        match &*block.kind {
            "text" => {
                self.remember(index, Open::Text);
                if let Some(text) = block.text.as_deref().filter(|t| !t.is_empty()) {
                    self.text_chunk("content", text, out);
                }
            }
            "thinking" => {
                self.remember(index, Open::Thinking);
                if let Some(text) = block.thinking.as_deref().filter(|t| !t.is_empty()) {
                    self.text_chunk("reasoning_content", text, out);
                }
            }
            "tool_use" => {
                let tool = self.tools;
                self.tools = self.tools.saturating_add(1);
                self.remember(index, Open::Tool(tool));
                let id = block.id.as_deref().unwrap_or_default();
                let name = block.name.as_deref().unwrap_or_default();
                self.chunk(out, |out| {
                    out.extend_from_slice(b"\"tool_calls\":[");
                    write_tool_call(out, Some(tool), id, name, "");
                    out.push(b']');
                });
            }
            _ => self.remember(index, Open::Other),
        }
    }

    fn block_delta(&mut self, index: Option<u64>, delta: &Delta<'_>, out: &mut Vec<u8>) {
        // A delta names its block; without an index, the block opened last.
        let open = match index {
            Some(index) => self
                .open
                .iter()
                .rev()
                .find(|(i, _)| *i == index)
                .map(|(_, o)| *o),
            None => self.open.last().map(|(_, o)| *o),
        };
        match delta.kind.as_deref() {
            Some("text_delta") => {
                if matches!(open, Some(Open::Text) | None) {
                    if let Some(text) = delta.text.as_deref().filter(|t| !t.is_empty()) {
                        self.text_chunk("content", text, out);
                    }
                }
            }
            Some("thinking_delta") => {
                if matches!(open, Some(Open::Thinking) | None) {
                    if let Some(text) = delta.thinking.as_deref().filter(|t| !t.is_empty()) {
                        self.text_chunk("reasoning_content", text, out);
                    }
                }
            }
            Some("input_json_delta") => {
                if let Some(Open::Tool(tool)) = open {
                    if let Some(json) = delta.partial_json.as_deref().filter(|j| !j.is_empty()) {
                        self.chunk(out, |out| {
                            out.extend_from_slice(b"\"tool_calls\":[{\"index\":");
                            push_u64(out, u64::from(tool));
                            out.extend_from_slice(b",\"function\":{\"arguments\":");
                            push_str_literal(out, json);
                            out.extend_from_slice(b"}}]");
                        });
                    }
                }
            }
            // signature_delta, citations_delta, and delta types added later.
            _ => {}
        }
    }

    /// A chunk whose delta is one string field.
    fn text_chunk(&mut self, field: &str, text: &str, out: &mut Vec<u8>) {
        self.chunk(out, |out| {
            out.push(b'"');
            out.extend_from_slice(field.as_bytes());
            out.extend_from_slice(b"\":");
            push_str_literal(out, text);
        });
    }

    /// Append `data: {head,"choices":[{"index":0,"delta":{…},"logprobs":null,
    /// "finish_reason":null}]}` and the blank line, the delta's fields written by `delta`.
    /// The role chunk goes first if it has not.
    fn chunk(&mut self, out: &mut Vec<u8>, delta: impl FnOnce(&mut Vec<u8>)) {
        if !self.started {
            self.start(out);
        }
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&self.head);
        out.extend_from_slice(b",\"choices\":[{\"index\":0,\"delta\":{");
        delta(out);
        out.extend_from_slice(b"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
    }

    fn finish(&mut self, out: &mut Vec<u8>) {
        self.start(out);
        self.ended = true;
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&self.head);
        out.extend_from_slice(
            b",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":",
        );
        push_str_literal(out, finish_reason(self.stop_reason.as_deref()));
        out.extend_from_slice(b"}]}\n\ndata: ");
        out.extend_from_slice(&self.head);
        out.extend_from_slice(b",\"choices\":[],\"usage\":");
        self.usage.write_openai(out);
        out.extend_from_slice(b"}\n\ndata: [DONE]\n\n");
    }

    fn error(&mut self, kind: Option<&str>, message: Option<&str>, out: &mut Vec<u8>) {
        self.ended = true;
        let message = message
            .filter(|m| !m.is_empty())
            .unwrap_or("the upstream reported an error mid-stream");
        // A stream's error carries no status: the one its type implies elsewhere (529 → 503).
        let (kind, code) = openai_type(kind, 500, message);
        out.extend_from_slice(b"data: ");
        write_error(out, message, kind, code);
        out.extend_from_slice(b"\n\n");
    }
}

#[cfg(test)]
mod tests {
    //! The fixtures in `../testdata/` are modelled on the event sequences Anthropic's
    //! "Streaming Messages" documentation publishes (the same fields, order, `ping`s and error
    //! event), with usage that includes the cache fields.

    use super::*;
    use crate::openai::meter::{event_data, event_name, SseMeter, SseSplitter, Usage};
    use crate::sys::clock::Mono;
    use serde_json::{json, Value};

    const TEXT: &[u8] = include_bytes!("../testdata/anthropic_text.sse");
    const TOOLS: &[u8] = include_bytes!("../testdata/anthropic_tools_parallel.sse");
    const THINKING: &[u8] = include_bytes!("../testdata/anthropic_thinking.sse");
    const ERROR: &[u8] = include_bytes!("../testdata/anthropic_error_midstream.sse");

    const MODEL: &str = "my-claude";
    const CREATED: u64 = 1_700_000_123;

    /// Feed an Anthropic stream through the SSE splitter and a translator, one event at a
    /// time; the OpenAI stream it writes.
    fn replay(stream: &[u8]) -> (Vec<u8>, StreamTranslator) {
        let mut t = StreamTranslator::new(MODEL, CREATED);
        let mut out = Vec::new();
        let mut splitter = SseSplitter::new();
        let mut buf = Vec::new();
        splitter.feed(stream, |event| {
            if let Some(data) = event_data(event, &mut buf) {
                t.event(event_name(event), data, &mut out);
            }
        });
        assert!(!splitter.has_partial());
        (out, t)
    }

    /// An OpenAI stream's events: `Some(json)` per chunk, `None` for `[DONE]`. Checks the
    /// framing: `data: ` lines, each event ended by one blank line.
    fn events(out: &[u8]) -> Vec<Option<Value>> {
        let text = std::str::from_utf8(out).unwrap();
        assert!(text.is_empty() || text.ends_with("\n\n"), "{text}");
        text.split_terminator("\n\n")
            .map(|event| {
                let data = event
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("{event}"));
                assert!(!data.contains('\n'), "one line per event: {event}");
                if data == "[DONE]" {
                    None
                } else {
                    Some(serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}")))
                }
            })
            .collect()
    }

    /// What OpenAI's SDKs read from a `chat.completion.chunk` (the Python SDK's
    /// `ChatCompletionChunk` and its parts), field names and types.
    fn check_chunk(v: &Value, id: &str) {
        let o = v.as_object().unwrap();
        assert_eq!(o["id"], id);
        assert_eq!(o["object"], "chat.completion.chunk");
        assert_eq!(o["created"], CREATED);
        assert_eq!(o["model"], MODEL);
        for key in o.keys() {
            assert!(
                ["id", "object", "created", "model", "choices", "usage"].contains(&key.as_str()),
                "{key}"
            );
        }
        let choices = o["choices"].as_array().unwrap();
        if choices.is_empty() {
            let u = o["usage"].as_object().unwrap();
            for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                assert!(u[key].is_u64(), "{key}");
            }
            assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
            return;
        }
        assert!(o.get("usage").is_none());
        assert_eq!(choices.len(), 1);
        let c = choices[0].as_object().unwrap();
        assert_eq!(c["index"], 0);
        assert!(c["logprobs"].is_null());
        let finish = &c["finish_reason"];
        assert!(
            finish.is_null()
                || ["stop", "length", "tool_calls", "content_filter"]
                    .contains(&finish.as_str().unwrap()),
            "{finish}"
        );
        for (key, value) in c["delta"].as_object().unwrap() {
            match key.as_str() {
                "role" => assert_eq!(value, "assistant"),
                "content" | "reasoning_content" => assert!(value.is_string()),
                "tool_calls" => {
                    for call in value.as_array().unwrap() {
                        let call = call.as_object().unwrap();
                        assert!(call["index"].is_u64());
                        for (key, value) in call {
                            match key.as_str() {
                                "index" => {}
                                "id" => assert!(value.is_string()),
                                "type" => assert_eq!(value, "function"),
                                "function" => {
                                    for (key, value) in value.as_object().unwrap() {
                                        assert!(["name", "arguments"].contains(&key.as_str()));
                                        assert!(value.is_string());
                                    }
                                }
                                other => panic!("tool call field {other}"),
                            }
                        }
                    }
                }
                other => panic!("delta field {other}"),
            }
        }
    }

    /// The checks every complete translated stream passes; returns its chunks (without the
    /// `[DONE]`).
    fn check_complete(out: &[u8], id: &str) -> Vec<Value> {
        let events = events(out);
        assert_eq!(events.last(), Some(&None), "ends with [DONE]");
        assert_eq!(events.iter().filter(|e| e.is_none()).count(), 1);
        let chunks: Vec<Value> = events.into_iter().flatten().collect();
        for chunk in &chunks {
            check_chunk(chunk, id);
        }
        // The first chunk has the role, no other does.
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert!(chunks[1..]
            .iter()
            .all(|c| c["choices"][0]["delta"].get("role").is_none()));
        // Then the finish reason alone, then the usage alone.
        let n = chunks.len();
        assert!(chunks[..n - 2]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        assert_eq!(chunks[n - 2]["choices"][0]["delta"], json!({}));
        assert!(chunks[n - 2]["choices"][0]["finish_reason"].is_string());
        assert_eq!(chunks[n - 1]["choices"], json!([]));
        chunks
    }

    fn delta_text(chunks: &[Value], field: &str) -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][field].as_str())
            .collect()
    }

    /// Each tool call's (id, name, reassembled arguments), by Sluice's tool-call index.
    fn tool_calls(chunks: &[Value]) -> Vec<(String, String, String)> {
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for chunk in chunks {
            let Some(deltas) = chunk["choices"][0]["delta"]["tool_calls"].as_array() else {
                continue;
            };
            for d in deltas {
                let index = d["index"].as_u64().unwrap() as usize;
                if let Some(id) = d["id"].as_str() {
                    assert_eq!(index, calls.len(), "tool calls start in index order");
                    assert_eq!(d["function"]["arguments"], "");
                    calls.push((
                        id.to_owned(),
                        d["function"]["name"].as_str().unwrap().to_owned(),
                        String::new(),
                    ));
                } else {
                    assert!(d.get("type").is_none() && d["function"].get("name").is_none());
                    calls[index].2 += d["function"]["arguments"].as_str().unwrap();
                }
            }
        }
        calls
    }

    fn usage_of(chunks: &[Value]) -> Value {
        chunks.last().unwrap()["usage"].clone()
    }

    /// The same stream read by the gateway's meter: what billing and the access log see.
    fn metered(out: &[u8]) -> crate::openai::meter::MeterSummary {
        let mut meter = SseMeter::new();
        meter.feed(out, Mono::now());
        meter.summary()
    }

    #[test]
    fn anthropic_stream_text_fixture() {
        let (out, t) = replay(TEXT);
        assert!(t.ended());
        let chunks = check_complete(&out, "chatcmpl-msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY");
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(
            delta_text(&chunks, "content"),
            "Hello! \"Quoted\", ünïcode ✓\nand a new line."
        );
        assert_eq!(chunks.len(), 1 + 2 + 2, "role, two deltas, finish, usage");
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            usage_of(&chunks),
            json!({"prompt_tokens": 25, "completion_tokens": 15, "total_tokens": 40,
                   "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "cache_creation_tokens": 0}})
        );
        let s = metered(&out);
        assert!(s.done);
        assert_eq!(s.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 25,
                completion_tokens: 15,
                total_tokens: 40,
                cached_tokens: 0,
                cache_write_tokens: 0,
                reasoning_tokens: 0
            })
        );
    }

    #[test]
    fn anthropic_stream_parallel_tools_fixture() {
        let (out, t) = replay(TOOLS);
        assert!(t.ended());
        let chunks = check_complete(&out, "chatcmpl-msg_014p7gG3wDgGV9EUtLvnow3U");
        assert_eq!(
            delta_text(&chunks, "content"),
            "Okay, let's check the weather in both cities:"
        );
        // Anthropic's blocks 1 and 2 are Sluice's tool calls 0 and 1; the arguments, put back
        // together, are the JSON the fragments spell.
        let calls = tool_calls(&chunks);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].0, "toolu_01T1x1fJ34qAmk2tNTrN7Up6");
        assert_eq!(calls[1].0, "toolu_01Pk3cHq7vGN2zDXH5wRrqJm");
        assert!(calls.iter().all(|c| c.1 == "get_weather"));
        let args: Vec<Value> = calls
            .iter()
            .map(|c| serde_json::from_str(&c.2).unwrap())
            .collect();
        assert_eq!(
            args,
            [
                json!({"location": "San Francisco, CA", "unit": "fahrenheit"}),
                json!({"location": "Paris, France", "unit": "celsius"}),
            ]
        );
        // And they are the fixture's own fragments, joined, byte for byte.
        let mut fragments = [String::new(), String::new()];
        for line in std::str::from_utf8(TOOLS).unwrap().lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            let v: Value = serde_json::from_str(data).unwrap();
            if let Some(p) = v["delta"]["partial_json"].as_str() {
                fragments[v["index"].as_u64().unwrap() as usize - 1] += p;
            }
        }
        assert_eq!([calls[0].2.clone(), calls[1].2.clone()], fragments);
        // The empty first fragment makes no chunk: one chunk per non-empty fragment.
        let argument_chunks = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["delta"]["tool_calls"][0]
                    .get("id")
                    .is_none()
            })
            .filter(|c| c["choices"][0]["delta"].get("tool_calls").is_some())
            .count();
        assert_eq!(argument_chunks, 8 + 5);
        let finish = &chunks[chunks.len() - 2];
        assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(
            usage_of(&chunks),
            json!({"prompt_tokens": 472 + 1500 + 3000, "completion_tokens": 89,
                   "total_tokens": 472 + 1500 + 3000 + 89,
                   "prompt_tokens_details": {"cached_tokens": 3000, "cache_write_tokens": 1500, "cache_creation_tokens": 1500}})
        );
        let s = metered(&out);
        assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(
            s.usage,
            Some(Usage {
                prompt_tokens: 4972,
                completion_tokens: 89,
                total_tokens: 5061,
                cached_tokens: 3000,
                cache_write_tokens: 1500,
                reasoning_tokens: 0
            })
        );
    }

    #[test]
    fn anthropic_stream_thinking_fixture() {
        let (out, t) = replay(THINKING);
        assert!(t.ended());
        let chunks = check_complete(&out, "chatcmpl-msg_01DbuVjm9wSPBZdsRhZQzsTm");
        assert_eq!(
            delta_text(&chunks, "reasoning_content"),
            "I need to find the GCD of 1071 and 462 using the Euclidean algorithm.\n\n\
             1071 = 2 × 462 + 147\n462 = 3 × 147 + 21\n147 = 7 × 21 + 0\n\nSo GCD(1071, 462) = 21"
        );
        assert_eq!(
            delta_text(&chunks, "content"),
            "The greatest common divisor of 1071 and 462 is **21**."
        );
        assert!(!String::from_utf8_lossy(&out).contains("signature"));
        assert!(!String::from_utf8_lossy(&out).contains("EqQBCgIYAhIM"));
        assert_eq!(
            chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
            "length"
        );
        let usage = usage_of(&chunks);
        assert_eq!(usage["prompt_tokens"], 85 + 1024);
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 1024);
        assert_eq!(usage["completion_tokens"], 120);
    }

    #[test]
    fn anthropic_stream_error_midstream_fixture() {
        let (out, t) = replay(ERROR);
        assert!(t.ended(), "an error event ends the stream");
        let events = events(&out);
        assert!(
            events.iter().all(Option::is_some),
            "no [DONE] after an error"
        );
        let chunks: Vec<Value> = events.into_iter().flatten().collect();
        let (error, chunks) = chunks.split_last().unwrap();
        for chunk in chunks {
            check_chunk(chunk, "chatcmpl-msg_01XFDUDYJgAACzvnptvVoYEL");
            assert!(chunk["choices"][0]["finish_reason"].is_null());
        }
        assert_eq!(delta_text(chunks, "content"), "Once upon a time");
        assert_eq!(
            *error,
            json!({"error": {"message": "Overloaded", "type": "server_error", "param": null, "code": null}})
        );
        let s = metered(&out);
        assert!(!s.done);
        let e = s.error.unwrap();
        assert_eq!(e.message, "Overloaded");
        assert_eq!(e.kind.as_deref(), Some("server_error"));
        // Nothing after the end.
        let mut t = t;
        let mut more = Vec::new();
        t.event(
            Some(&b"message_stop"[..]),
            br#"{"type":"message_stop"}"#,
            &mut more,
        );
        assert!(more.is_empty());
    }

    #[test]
    fn anthropic_stream_usage_chunk_is_the_one_the_relay_strips() {
        let (out, _) = replay(TEXT);
        let text = std::str::from_utf8(&out).unwrap();
        let mut meter = SseMeter::new();
        let usage_only: Vec<bool> = text
            .split_inclusive("\n\n")
            .map(|e| meter.is_usage_only_event(e.as_bytes()))
            .collect();
        let n = usage_only.len();
        assert_eq!(usage_only.iter().filter(|u| **u).count(), 1);
        assert!(usage_only[n - 2], "the one before [DONE]");
    }

    #[test]
    fn anthropic_stream_cut_without_message_stop_has_not_ended() {
        let cut = &TOOLS[..TOOLS.len() / 2];
        let cut = &cut[..cut.windows(2).rposition(|w| w == b"\n\n").unwrap() + 2];
        let (out, t) = replay(cut);
        assert!(!t.ended());
        let events = events(&out);
        assert!(events.iter().all(Option::is_some), "no [DONE]");
        assert!(events
            .iter()
            .flatten()
            .all(|c| c["choices"][0]["finish_reason"].is_null() && c.get("usage").is_none()));
        assert!(!metered(&out).done);
    }

    fn feed(t: &mut StreamTranslator, events: &[Value]) -> Vec<Value> {
        let mut out = Vec::new();
        for e in events {
            let name = e["type"].as_str().map(str::as_bytes);
            t.event(name, e.to_string().as_bytes(), &mut out);
        }
        events_of(&out)
    }

    fn events_of(out: &[u8]) -> Vec<Value> {
        events(out)
            .into_iter()
            .map(|e| e.unwrap_or(Value::Null))
            .collect()
    }

    #[test]
    fn anthropic_stream_tool_index_is_not_the_block_index() {
        let mut t = StreamTranslator::new(MODEL, CREATED);
        let start = |index: u64, block: Value| json!({"type": "content_block_start", "index": index, "content_block": block});
        let args = |index: u64, partial: &str| {
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": partial}})
        };
        let stop = |index: u64| json!({"type": "content_block_stop", "index": index});
        let chunks = feed(
            &mut t,
            &[
                json!({"type": "message_start", "message": {"id": "msg_x", "usage": {"input_tokens": 5, "output_tokens": 1}}}),
                start(0, json!({"type": "thinking", "thinking": ""})),
                stop(0),
                start(1, json!({"type": "text", "text": ""})),
                stop(1),
                // A server tool's input is not a client tool call.
                start(
                    2,
                    json!({"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}),
                ),
                args(2, "{\"query\": \"x\"}"),
                stop(2),
                start(
                    3,
                    json!({"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}),
                ),
                stop(3),
                start(
                    4,
                    json!({"type": "tool_use", "id": "toolu_a", "name": "a", "input": {}}),
                ),
                args(4, "{\"x\":"),
                args(4, " 1}"),
                stop(4),
                start(
                    5,
                    json!({"type": "tool_use", "id": "toolu_b", "name": "b", "input": {}}),
                ),
                args(5, "{}"),
                stop(5),
                // A delta for a block already stopped, or never started, is left out.
                args(4, "junk"),
                args(9, "junk"),
                json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 30}}),
                json!({"type": "message_stop"}),
            ],
        );
        assert!(t.ended());
        let chunks: Vec<Value> = chunks.into_iter().filter(|c| !c.is_null()).collect();
        for c in &chunks {
            check_chunk(c, "chatcmpl-msg_x");
        }
        let calls = tool_calls(&chunks);
        assert_eq!(
            calls,
            [
                (
                    "toolu_a".to_owned(),
                    "a".to_owned(),
                    "{\"x\": 1}".to_owned()
                ),
                ("toolu_b".to_owned(), "b".to_owned(), "{}".to_owned()),
            ]
        );
    }

    #[test]
    fn anthropic_stream_message_delta_overwrites_usage_never_erases() {
        let mut t = StreamTranslator::new(MODEL, CREATED);
        let chunks = feed(
            &mut t,
            &[
                json!({"type": "message_start", "message": {"id": "msg_u", "usage": {
                    "input_tokens": 100, "cache_read_input_tokens": 50, "cache_creation_input_tokens": 7, "output_tokens": 1}}}),
                json!({"type": "message_delta", "delta": {"stop_reason": null}, "usage": {"output_tokens": 10}}),
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 20, "input_tokens": 120, "cache_creation_input_tokens": null}}),
                json!({"type": "message_stop"}),
            ],
        );
        let usage = &chunks[chunks.len() - 2]["usage"];
        assert_eq!(
            *usage,
            json!({"prompt_tokens": 120 + 50 + 7, "completion_tokens": 20, "total_tokens": 197,
                   "prompt_tokens_details": {"cached_tokens": 50, "cache_write_tokens": 7, "cache_creation_tokens": 7}})
        );
        assert_eq!(
            chunks[chunks.len() - 3]["choices"][0]["finish_reason"],
            "stop"
        );
    }

    #[test]
    fn anthropic_stream_odd_events() {
        let mut t = StreamTranslator::new(MODEL, CREATED);
        let mut out = Vec::new();
        // Pings, new event types, non-JSON data: nothing.
        t.event(Some(&b"ping"[..]), br#"{"type": "ping"}"#, &mut out);
        t.event(
            Some(&b"something_new"[..]),
            br#"{"type": "something_new", "x": 1}"#,
            &mut out,
        );
        t.event(None, b"not json", &mut out);
        t.event(Some(&b"content_block_delta"[..]), b"{\"type\":", &mut out);
        assert!(out.is_empty());
        assert!(!t.ended());
        // Content before any message_start: the role chunk still comes first.
        t.event(
            None,
            br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
            &mut out,
        );
        let chunks = events_of(&out);
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[1]["choices"][0]["delta"], json!({"content": "Hi"}));
        // The data's type decides; the SSE name only stands in when the type is missing.
        out.clear();
        t.event(Some(&b"ping"[..]), br#"{"type":"message_stop"}"#, &mut out);
        assert!(t.ended());
        assert_eq!(events(&out).last(), Some(&None));

        // An error event whose data is not JSON still ends the stream with an error.
        let mut t = StreamTranslator::new(MODEL, CREATED);
        let mut out = Vec::new();
        t.event(Some(&b"error"[..]), b"upstream exploded", &mut out);
        assert!(t.ended());
        let chunks = events_of(&out);
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0]["error"]["type"], "server_error");
        assert!(!chunks[0]["error"]["message"].as_str().unwrap().is_empty());
        // Known error types keep their meaning mid-stream.
        let mut t = StreamTranslator::new(MODEL, CREATED);
        let mut out = Vec::new();
        t.event(
            None,
            br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
            &mut out,
        );
        assert_eq!(
            events_of(&out)[0],
            json!({"error": {"message": "slow down", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}})
        );
    }

    #[test]
    fn anthropic_stream_escapes_ids_and_model() {
        let mut t = StreamTranslator::new("a\"model\\", 1);
        let mut out = Vec::new();
        t.event(
            None,
            br#"{"type":"message_start","message":{"id":"msg_\"odd\u0001","usage":{}}}"#,
            &mut out,
        );
        let chunks = events_of(&out);
        assert_eq!(chunks[0]["id"], "chatcmpl-msg_\"odd\u{1}");
        assert_eq!(chunks[0]["model"], "a\"model\\");
    }

    /// With `SLUICE_DUMP_TRANSLATED=DIR`, write each fixture's translation there, for a check
    /// with OpenAI's own Python SDK (`scripts/check-anthropic-translation.py`).
    #[test]
    fn anthropic_stream_dump_for_the_sdk_check() {
        let Some(dir) = std::env::var_os("SLUICE_DUMP_TRANSLATED") else {
            return;
        };
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, fixture) in [
            ("text", TEXT),
            ("tools_parallel", TOOLS),
            ("thinking", THINKING),
            ("error_midstream", ERROR),
        ] {
            let (out, _) = replay(fixture);
            std::fs::write(dir.join(format!("{name}.sse")), out).unwrap();
        }
        let mut out = Vec::new();
        super::super::response::message_to_chat_at(
            include_bytes!("../testdata/anthropic_message_tool_use.json"),
            CREATED,
            &mut out,
        )
        .unwrap();
        std::fs::write(dir.join("message_tool_use.json"), out).unwrap();
        let mut out = Vec::new();
        let status = super::super::error_to_openai(
            529,
            include_bytes!("../testdata/anthropic_error_overloaded.json"),
            &mut out,
        );
        std::fs::write(dir.join(format!("error_{status}.json")), out).unwrap();
    }
}
