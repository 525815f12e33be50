//! A chat completions stream turned into Anthropic Messages events, event by event.
//!
//! [`ChatStreamToMessages::event`] takes the `data` of each OpenAI SSE event as it arrives and
//! appends whole Anthropic events (`event: NAME\ndata: {…}\n\n`) to `out`, which the relay
//! writes to the client before its next upstream read:
//!
//! - `message_start` with the first chunk that has a choice (id `msg_` + the completion id,
//!   role, the model the client asked for, usage so far: zeros unless the upstream reports
//!   usage on every chunk);
//! - one content block per run of reasoning (`thinking`, `thinking_delta`), text (`text`,
//!   `text_delta`) or tool call (`tool_use` with the call's id and name, `input_json_delta`
//!   carrying the upstream's argument fragments byte for byte), indexed from 0 in the order
//!   they open, each closed before the next opens;
//! - at the finish reason every block still open or held closes; at `[DONE]`, `message_delta`
//!   (stop reason as [`super::response::stop_reason`] maps it, and the usage: all four of
//!   Anthropic's counts, since an OpenAI stream reports the prompt only at its end), then
//!   `message_stop`;
//! - an error object (`{"error":…}`, or vLLM's older `{"object":"error",…}`) → `event: error`
//!   with the type [`super::response::anthropic_error`] picks, and the stream is over.
//!
//! Anthropic blocks can't interleave: a block's start, deltas and stop come before the next
//! block starts. OpenAI deltas can: parallel tool calls are sent one after the other by every
//! server we know, but the format lets a delta for call 1 arrive while call 0 is unfinished,
//! and says nowhere when a call is finished. So a tool call's block stays open until its
//! arguments are a complete JSON value (its brackets close, strings and escapes respected) or
//! the choice finishes; content for any other block that arrives meanwhile is held, in arrival
//! order, and goes out the moment the open call completes. With calls sent one after the other
//! nothing is ever held; interleaved calls cost one call's arguments of memory, bounded by
//! [`MAX_HELD`] (beyond it the stream ends with an error event rather than grow).
//!
//! Text that is only whitespace and opens no block yet (the `"\n\n"` some servers send between
//! reasoning and a tool call) is held until text follows, so no block is ever only whitespace.
//! Content of choices other than the first is ignored (Anthropic has no `n`).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;
use std::io::Write as _;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::response::{
    anthropic_error, fallback_tool_id, json_str, matched_stop, message_id, stop_reason, ChatUsage,
    FoundError,
};

/// The most content held back behind an open tool call, in bytes.
pub(crate) const MAX_HELD: usize = 1 << 20;

/// Translates one chat completions stream into Anthropic events. One per response.
pub(crate) struct ChatStreamToMessages {
    model: String,
    /// `msg_` + the upstream's completion id, once a chunk names one.
    id: String,
    started: bool,
    ended: bool,
    /// The index the next block gets.
    next_index: u32,
    /// The block that is open.
    open: Option<Open>,
    /// Blocks with content held back, in the order their content first arrived.
    queue: VecDeque<Slot>,
    held_text: String,
    held_thinking: String,
    /// Whitespace text that opens no block yet.
    held_space: String,
    held_bytes: usize,
    /// Tool calls by order of first appearance.
    calls: Vec<Call>,
    finish: Option<String>,
    stop_sequence: Option<String>,
    refused: bool,
    usage: Option<ChatUsage>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Text,
    Thinking,
    /// A tool call, by its place in `calls`.
    Call(usize),
}

#[derive(Debug, Clone, Copy)]
struct Open {
    slot: Slot,
    index: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallState {
    /// Not opened yet (queued behind another block).
    Waiting,
    Open,
    Closed,
}

struct Call {
    /// The upstream's `index` for it.
    key: u64,
    id: String,
    name: String,
    /// Argument fragments not yet sent.
    held: String,
    json: JsonEnd,
    state: CallState,
}

impl ChatStreamToMessages {
    pub(crate) fn new(model_for_client: &str) -> Self {
        ChatStreamToMessages {
            model: model_for_client.to_owned(),
            id: String::new(),
            started: false,
            ended: false,
            next_index: 0,
            open: None,
            queue: VecDeque::new(),
            held_text: String::new(),
            held_thinking: String::new(),
            held_space: String::new(),
            held_bytes: 0,
            calls: Vec::new(),
            finish: None,
            stop_sequence: None,
            refused: false,
            usage: None,
        }
    }

    /// `message_stop` or an `error` event has been written: nothing more will be.
    #[cfg(test)]
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// The data of one upstream SSE event: a chunk, the usage chunk, `[DONE]` or an error
    /// object. Data that is none of these is ignored.
    pub(crate) fn event(&mut self, data: &[u8], out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done(out);
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return;
        };
        if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
            let found = FoundError::from_value(&serde_json::json!({ "error": error }));
            self.error(found, out);
            return;
        }
        if chunk.object.0.as_deref() == Some("error") {
            let found = FoundError {
                message: chunk.message.0.map(Cow::into_owned),
                kind: chunk.kind.0.map(Cow::into_owned),
                code: chunk.code.as_ref().and_then(|c| match c {
                    Value::String(s) => Some(s.clone()),
                    Value::Number(n) => Some(n.to_string()),
                    _ => None,
                }),
            };
            self.error(found, out);
            return;
        }
        if self.id.is_empty() {
            if let Some(id) = chunk.id.0.as_deref().filter(|id| !id.is_empty()) {
                self.id = message_id(Some(id));
            }
        }
        if let Some(usage) = chunk.usage.filter(Value::is_object) {
            self.usage = Some(ChatUsage::from_value(&usage));
        }
        for choice in chunk.choices.into_iter().flatten() {
            if choice.index.unwrap_or(0) != 0 {
                continue;
            }
            self.start(out);
            if let Some(delta) = choice.delta {
                self.delta(delta, out);
                if self.ended {
                    return;
                }
            }
            if let Some(finish) = choice.finish_reason.0 {
                self.finish = Some(finish.into_owned());
                self.stop_sequence = matched_stop(choice.stop_reason.as_ref());
                self.flush(out);
            }
        }
    }

    /// The upstream's stream ended (its body is over) without `[DONE]`: a stream that had
    /// finished is completed as `[DONE]` would; one cut short ends with an error event, so
    /// the client never takes a truncated answer for a whole one.
    pub(crate) fn upstream_closed(&mut self, out: &mut Vec<u8>) {
        if self.ended {
            return;
        }
        if self.finish.is_some() {
            self.done(out);
        } else {
            self.fail(
                "api_error",
                "The upstream closed the stream before the response was complete.",
                out,
            );
        }
    }

    fn delta(&mut self, delta: Delta<'_>, out: &mut Vec<u8>) {
        // `reasoning_content` (DeepSeek, vLLM up to 0.10), else `reasoning` (newer vLLM):
        // never both, which some servers send with the same text.
        if let Some(r) = delta.reasoning_content.0.or(delta.reasoning.0) {
            if !r.is_empty() {
                self.deliver(Slot::Thinking, &r, out);
            }
        }
        if let Some(text) = delta.content.0 {
            self.text(&text, out);
        }
        if let Some(refusal) = delta.refusal.0 {
            if !refusal.is_empty() {
                self.refused = true;
                self.text(&refusal, out);
            }
        }
        for (position, call) in delta.tool_calls.into_iter().flatten().enumerate() {
            if self.ended {
                return;
            }
            let key = call.index.unwrap_or(position as u64);
            self.tool_delta(key, call, out);
        }
    }

    fn text(&mut self, text: &str, out: &mut Vec<u8>) {
        if text.is_empty() {
            return;
        }
        let in_text =
            self.open.is_some_and(|o| o.slot == Slot::Text) || self.queue.contains(&Slot::Text);
        if !in_text && text.trim().is_empty() {
            self.held_space.push_str(text);
            self.held_bytes += text.len();
            self.check_held(out);
            return;
        }
        if self.held_space.is_empty() {
            self.deliver(Slot::Text, text, out);
        } else {
            let mut joined = std::mem::take(&mut self.held_space);
            self.held_bytes -= joined.len();
            joined.push_str(text);
            self.deliver(Slot::Text, &joined, out);
        }
    }

    fn tool_delta(&mut self, key: u64, call: ToolCallDelta<'_>, out: &mut Vec<u8>) {
        let (i, new) = match self.calls.iter().position(|c| c.key == key) {
            Some(i) => (i, false),
            None => {
                self.calls.push(Call {
                    key,
                    id: String::new(),
                    name: String::new(),
                    held: String::new(),
                    json: JsonEnd::default(),
                    state: CallState::Waiting,
                });
                (self.calls.len() - 1, true)
            }
        };
        let mut arguments = None;
        if let Some(c) = self.calls.get_mut(i) {
            if let Some(id) = call.id.0.filter(|id| !id.is_empty()) {
                if c.id.is_empty() {
                    c.id = id.into_owned();
                }
            }
            if let Some(f) = call.function {
                if let Some(name) = f.name.0.filter(|n| !n.is_empty()) {
                    if c.name.is_empty() {
                        c.name = name.into_owned();
                    }
                }
                arguments = f.arguments.0.filter(|a| !a.is_empty());
            }
            if c.state == CallState::Closed {
                // Its block is closed: the arguments were a whole JSON value already, so
                // what follows can only be whitespace (or would make them invalid).
                return;
            }
            if let Some(a) = &arguments {
                c.json.feed(a);
            }
        }
        match arguments {
            Some(a) => self.deliver(Slot::Call(i), &a, out),
            // A new call opens its block as soon as it may, arguments or not, so the client
            // sees the tool's name early.
            None if new => {
                self.queue.push_back(Slot::Call(i));
                self.pump(out);
            }
            None => {}
        }
    }

    /// A fragment for `slot`: straight out when its block is open, else held (behind the
    /// open block, or behind content held before it) and the queue moved on if it can.
    fn deliver(&mut self, slot: Slot, fragment: &str, out: &mut Vec<u8>) {
        if let Some(open) = self.open.filter(|o| o.slot == slot) {
            self.write_delta(open.index, slot, fragment, out);
            if matches!(slot, Slot::Call(_)) {
                // The call may have just completed: held blocks can follow.
                self.pump(out);
            }
            return;
        }
        match slot {
            Slot::Text => self.held_text.push_str(fragment),
            Slot::Thinking => self.held_thinking.push_str(fragment),
            Slot::Call(i) => {
                if let Some(c) = self.calls.get_mut(i) {
                    c.held.push_str(fragment);
                }
            }
        }
        self.held_bytes += fragment.len();
        if !self.queue.contains(&slot) {
            self.queue.push_back(slot);
        }
        if self.check_held(out) {
            self.pump(out);
        }
    }

    /// Whether the held content is within bounds; ends the stream with an error if not.
    fn check_held(&mut self, out: &mut Vec<u8>) -> bool {
        if self.held_bytes <= MAX_HELD {
            return true;
        }
        self.fail(
            "api_error",
            "The upstream interleaved its output beyond what the gateway holds to keep content blocks in order.",
            out,
        );
        false
    }

    /// Open held blocks in order while the open one may close.
    fn pump(&mut self, out: &mut Vec<u8>) {
        while let Some(&next) = self.queue.front() {
            if let Some(open) = self.open {
                if !self.closable(open.slot) {
                    return;
                }
                self.close(out);
            }
            self.queue.pop_front();
            self.open_block(next, out);
        }
    }

    /// The choice is finished: every held block goes out, and all close.
    fn flush(&mut self, out: &mut Vec<u8>) {
        self.close(out);
        while let Some(slot) = self.queue.pop_front() {
            self.open_block(slot, out);
            self.close(out);
        }
        self.held_bytes = 0;
        self.held_space.clear();
    }

    fn closable(&self, slot: Slot) -> bool {
        match slot {
            Slot::Text | Slot::Thinking => true,
            Slot::Call(i) => self.calls.get(i).is_none_or(|c| c.json.done),
        }
    }

    fn open_block(&mut self, slot: Slot, out: &mut Vec<u8>) {
        let index = self.next_index;
        self.next_index += 1;
        let held = match slot {
            Slot::Text => {
                event(out, "content_block_start", |out| {
                    let _ = write!(out, "{{\"type\":\"content_block_start\",\"index\":{index},\"content_block\":{{\"type\":\"text\",\"text\":\"\"}}}}");
                });
                std::mem::take(&mut self.held_text)
            }
            Slot::Thinking => {
                event(out, "content_block_start", |out| {
                    let _ = write!(out, "{{\"type\":\"content_block_start\",\"index\":{index},\"content_block\":{{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}}}}");
                });
                std::mem::take(&mut self.held_thinking)
            }
            Slot::Call(i) => {
                let fallback = fallback_tool_id(self.message_id(), i);
                let Some(c) = self.calls.get_mut(i) else {
                    return;
                };
                c.state = CallState::Open;
                let id = if c.id.is_empty() { &fallback } else { &c.id };
                let name = &c.name;
                event(out, "content_block_start", |out| {
                    let _ = write!(out, "{{\"type\":\"content_block_start\",\"index\":{index},\"content_block\":{{\"type\":\"tool_use\",\"id\":");
                    json_str(out, id);
                    out.extend_from_slice(b",\"name\":");
                    json_str(out, name);
                    out.extend_from_slice(b",\"input\":{}}}");
                });
                std::mem::take(&mut c.held)
            }
        };
        self.held_bytes = self.held_bytes.saturating_sub(held.len());
        self.open = Some(Open { slot, index });
        if !held.is_empty() {
            self.write_delta(index, slot, &held, out);
        }
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        let Some(open) = self.open.take() else {
            return;
        };
        if let Slot::Call(i) = open.slot {
            if let Some(c) = self.calls.get_mut(i) {
                c.state = CallState::Closed;
            }
        }
        event(out, "content_block_stop", |out| {
            let _ = write!(
                out,
                "{{\"type\":\"content_block_stop\",\"index\":{}}}",
                open.index
            );
        });
    }

    fn write_delta(&self, index: u32, slot: Slot, fragment: &str, out: &mut Vec<u8>) {
        let (kind, field) = match slot {
            Slot::Text => ("text_delta", "text"),
            Slot::Thinking => ("thinking_delta", "thinking"),
            Slot::Call(_) => ("input_json_delta", "partial_json"),
        };
        event(out, "content_block_delta", |out| {
            let _ = write!(out, "{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{{\"type\":\"{kind}\",\"{field}\":");
            json_str(out, fragment);
            out.extend_from_slice(b"}}");
        });
    }

    fn message_id(&self) -> &str {
        if self.id.is_empty() {
            "msg_sluice"
        } else {
            &self.id
        }
    }

    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let usage = self.usage.unwrap_or_default();
        let (id, model) = (self.message_id(), &self.model);
        event(out, "message_start", |out| {
            out.extend_from_slice(b"{\"type\":\"message_start\",\"message\":{\"id\":");
            json_str(out, id);
            out.extend_from_slice(b",\"type\":\"message\",\"role\":\"assistant\",\"model\":");
            json_str(out, model);
            out.extend_from_slice(
                b",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":",
            );
            usage.write_json(out);
            out.extend_from_slice(b"}}");
        });
    }

    /// `[DONE]`: close what is open, then `message_delta` and `message_stop`.
    fn done(&mut self, out: &mut Vec<u8>) {
        self.start(out);
        self.flush(out);
        let tool_calls = self.calls.iter().any(|c| c.state == CallState::Closed);
        let reason = stop_reason(
            self.finish.as_deref(),
            tool_calls,
            self.refused,
            self.stop_sequence.is_some(),
        );
        let usage = self.usage.unwrap_or_default();
        let stop_sequence = self.stop_sequence.as_deref();
        event(out, "message_delta", |out| {
            let _ = write!(
                out,
                "{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"{reason}\",\"stop_sequence\":"
            );
            match stop_sequence {
                Some(s) => json_str(out, s),
                None => out.extend_from_slice(b"null"),
            }
            out.extend_from_slice(b"},\"usage\":");
            usage.write_json(out);
            out.push(b'}');
        });
        event(out, "message_stop", |out| {
            out.extend_from_slice(b"{\"type\":\"message_stop\"}");
        });
        self.ended = true;
    }

    fn error(&mut self, found: FoundError, out: &mut Vec<u8>) {
        let (_, kind) = anthropic_error(None, found.kind.as_deref(), found.code.as_deref());
        let message = found
            .message
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "The upstream reported an error mid-stream.".to_owned());
        self.fail(kind, &message, out);
    }

    fn fail(&mut self, kind: &str, message: &str, out: &mut Vec<u8>) {
        event(out, "error", |out| {
            super::response::write_error_body(kind, message, out);
        });
        self.ended = true;
    }
}

/// `event: NAME\ndata: …\n\n`, the data written by `data`.
fn event(out: &mut Vec<u8>, name: &str, data: impl FnOnce(&mut Vec<u8>)) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    data(out);
    out.extend_from_slice(b"\n\n");
}

/// Whether a stream of JSON text has completed its first value (an object or array: a scalar
/// never counts, so a call whose arguments aren't an object stays open to the end).
#[derive(Debug, Default, Clone, Copy)]
struct JsonEnd {
    depth: u32,
    in_string: bool,
    escaped: bool,
    done: bool,
}

impl JsonEnd {
    fn feed(&mut self, text: &str) {
        for &b in text.as_bytes() {
            if self.done {
                return;
            }
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    self.done = self.depth == 0;
                }
                _ => {}
            }
        }
    }
}

// What is read of a chunk. Strings borrow from the data when they hold no escapes; a field of
// an unexpected type reads as absent rather than failing the chunk.

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    id: Text<'a>,
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default)]
    usage: Option<Value>,
    #[serde(default)]
    error: Option<Value>,
    #[serde(borrow, default)]
    object: Text<'a>,
    #[serde(borrow, default)]
    message: Text<'a>,
    #[serde(borrow, default, rename = "type")]
    kind: Text<'a>,
    #[serde(default)]
    code: Option<Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    finish_reason: Text<'a>,
    /// vLLM's: the stop string matched, or a token id.
    #[serde(default)]
    stop_reason: Option<Value>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow, default)]
    content: Text<'a>,
    #[serde(borrow, default)]
    reasoning_content: Text<'a>,
    #[serde(borrow, default)]
    reasoning: Text<'a>,
    #[serde(borrow, default)]
    refusal: Text<'a>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

#[derive(Deserialize)]
struct ToolCallDelta<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(borrow, default)]
    id: Text<'a>,
    #[serde(borrow, default)]
    function: Option<FunctionDelta<'a>>,
}

#[derive(Deserialize)]
struct FunctionDelta<'a> {
    #[serde(borrow, default)]
    name: Text<'a>,
    #[serde(borrow, default)]
    arguments: Text<'a>,
}

/// A string field: borrowed when it can be, absent when null or not a string.
#[derive(Default)]
struct Text<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Option<Cow<'de, str>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(Some(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Some(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Some(Cow::Owned(v)))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(None)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(None)
            }
        }
        d.deserialize_any(V).map(Text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_json_end_respects_strings_and_escapes() {
        let cases: &[(&[&str], bool)] = &[
            (&["{\"a\": 1}"], true),
            (&["{\"a\": \"}\"", "}"], true),
            (&["{\"a\": \"\\\"}\""], false),
            (&["{\"a\": \"\\\\\"}"], true),
            (&["[1, {\"b\": []}", "]"], true),
            (&["\"just a string\""], false),
            (&[""], false),
            (&["{", "\"x\":", "[", "]", "}"], true),
        ];
        for (fragments, want) in cases {
            let mut j = JsonEnd::default();
            for f in *fragments {
                j.feed(f);
            }
            assert_eq!(j.done, *want, "{fragments:?}");
        }
    }

    #[test]
    fn anthropic_chunk_fields_of_odd_types_read_as_absent() {
        let chunk: Chunk<'_> = serde_json::from_str(
            r#"{"id":7,"choices":[{"index":0,"delta":{"content":{"x":[1]},"reasoning":["r"],"refusal":false,"tool_calls":[{"index":0,"id":null,"function":{"name":"f","arguments":"{\"a\":1}"}}]},"finish_reason":1}]}"#,
        )
        .unwrap();
        assert!(chunk.id.0.is_none());
        let choice = &chunk.choices.as_ref().unwrap()[0];
        assert!(choice.finish_reason.0.is_none());
        let delta = choice.delta.as_ref().unwrap();
        assert!(delta.content.0.is_none() && delta.reasoning.0.is_none());
        let call = &delta.tool_calls.as_ref().unwrap()[0];
        assert!(call.id.0.is_none());
        let args = call
            .function
            .as_ref()
            .unwrap()
            .arguments
            .0
            .as_ref()
            .unwrap();
        assert!(matches!(args, Cow::Owned(_)), "escaped text is decoded");
        let name = call.function.as_ref().unwrap().name.0.as_ref().unwrap();
        assert!(matches!(name, Cow::Borrowed("f")));
    }
}
