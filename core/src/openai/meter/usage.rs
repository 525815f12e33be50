//! Usage and timing read from an OpenAI-compatible response, event by event or from a whole body.
//!
//! [`StreamMeter::on_data`] takes the data of each SSE event of a streamed response (chat
//! completions, completions or the Responses API) with the time the caller saw it, and records
//! when generated content first and last arrived, how much of it came, the upstream's reported
//! usage, the finish reason, an error the upstream reported in the stream, and `[DONE]`.
//! [`StreamMeter::on_json_body`] reads the same from a non-streamed JSON body. Nothing here reads
//! the clock, and nothing fails: input that is not JSON, or not shaped as expected, is counted
//! and otherwise ignored.
//!
//! Each document is parsed with simd-json into a tape kept between calls (simd-json unescapes in
//! place, so the data is first copied into a reused scratch buffer with the padding simd-json
//! needs), then the few fields that matter are read off the tape.

use crate::openai::json::truncate;
use std::time::Instant;

use simd_json::{Buffers, Node, StaticNode, Tape, INPUT_PADDING};

/// Token counts as the upstream reported them. `cached_tokens` (prompt-cache reads) and
/// `cache_write_tokens` (prompt tokens written to the cache, which Anthropic bills above plain
/// input) are parts of `prompt_tokens`, and `reasoning_tokens` part of `completion_tokens`; a
/// count the upstream left out is 0 (an embeddings response has no completion tokens), except
/// `total_tokens`, which is then the sum.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) total_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) cache_write_tokens: u64,
    pub(crate) reasoning_tokens: u64,
}

/// An error the upstream reported inside a 2xx response (an error event mid-stream).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct UpstreamError {
    /// `message`, cut to [`MAX_ERROR_MESSAGE`] bytes.
    pub(crate) message: String,
    /// `type`, when given.
    pub(crate) kind: Option<String>,
    /// `code`, when given (a number is written out in decimal).
    pub(crate) code: Option<String>,
}

/// Longest error message kept, in bytes.
pub(crate) const MAX_ERROR_MESSAGE: usize = 1024;

/// Longest finish reason, error type or code kept, in bytes.
const MAX_SHORT_FIELD: usize = 128;

/// What a response carried, for billing, limits, logs and metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MeterSummary {
    /// The last usage the upstream reported (some send it on every chunk, cumulatively).
    pub usage: Option<Usage>,
    /// When the first event (of any kind) arrived.
    pub(crate) first_event_at: Option<Instant>,
    /// When the first event carrying generated content arrived: time to first token.
    pub(crate) first_content_at: Option<Instant>,
    /// When the last event carrying generated content arrived.
    pub(crate) last_content_at: Option<Instant>,
    /// Events that carried generated content.
    pub(crate) content_events: u64,
    /// Bytes of generated content (text, reasoning, tool-call arguments), as decoded UTF-8: the
    /// basis of an estimate when the upstream reports no usage.
    pub(crate) content_bytes: u64,
    /// The last non-null `finish_reason`; for the Responses API, `incomplete_details.reason` or
    /// else the final `status` (`completed`, `incomplete`, `failed`, `cancelled`).
    pub(crate) finish_reason: Option<String>,
    /// The last error the upstream reported in the response.
    pub(crate) error: Option<UpstreamError>,
    /// A `data: [DONE]` event arrived.
    pub(crate) done: bool,
    /// Events with data.
    pub events: u64,
    /// Events whose data was neither JSON nor `[DONE]` (or a body that was not JSON).
    pub(crate) unparsed_events: u64,
    /// Events skipped because they were too long (filled in by [`super::SseMeter`]).
    pub(crate) oversized_events: u64,
    /// The stream ended inside an event (filled in by [`super::SseMeter`]).
    pub(crate) partial_event: bool,
}

/// Reads usage and timing from one response. Keep one per worker and [`reset`](Self::reset) it
/// between responses: its parse buffers are reused.
#[derive(Default)]
pub(crate) struct StreamMeter {
    summary: MeterSummary,
    json: JsonScratch,
    /// The generated text itself, up to [`MAX_CAPTURE`] bytes: what a settlement estimate
    /// counts when the upstream reports no usage.
    captured: Vec<u8>,
}

/// Generated text kept per response for settlement estimates; beyond it, the estimate scales
/// by the byte count.
pub(crate) const MAX_CAPTURE: usize = 64 * 1024;

impl std::fmt::Debug for StreamMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamMeter")
            .field("summary", &self.summary)
            .finish_non_exhaustive()
    }
}

impl StreamMeter {
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Forget the response, keeping the parse buffers.
    pub(crate) fn reset(&mut self) {
        self.summary = MeterSummary::default();
        self.captured.clear();
    }

    /// The generated text seen so far (UTF-8 pieces as decoded; at most [`MAX_CAPTURE`] bytes,
    /// so it may be a prefix of `summary().content_bytes`).
    pub(crate) fn captured(&self) -> &[u8] {
        &self.captured
    }

    /// What has been recorded so far.
    pub(crate) fn summary(&self) -> &MeterSummary {
        &self.summary
    }

    /// Take what has been recorded and start over (the parse buffers stay).
    #[cfg(test)]
    pub(crate) fn take_summary(&mut self) -> MeterSummary {
        std::mem::take(&mut self.summary)
    }

    /// The data of one SSE event (see [`super::sse::event_data`]), seen at `now`.
    pub(crate) fn on_data(&mut self, data: &[u8], now: Instant) {
        let s = &mut self.summary;
        s.events += 1;
        s.first_event_at.get_or_insert(now);
        let doc = data.trim_ascii();
        if doc == b"[DONE]" {
            s.done = true;
            return;
        }
        // Only an object can carry anything we read.
        if doc.first() != Some(&b'{') {
            s.unparsed_events += 1;
            return;
        }
        let Some(content) = self.json.parse(doc, |nodes| {
            read_document(nodes, &mut self.summary, &mut self.captured)
        }) else {
            self.summary.unparsed_events += 1;
            return;
        };
        if content.present {
            let s = &mut self.summary;
            s.content_events += 1;
            s.content_bytes = s.content_bytes.saturating_add(content.bytes);
            s.first_content_at.get_or_insert(now);
            s.last_content_at = Some(now);
        }
    }

    /// A whole non-streamed JSON response body: chat completion, completion, embeddings,
    /// Responses API response, or an error body. Records usage, finish reason, error and the
    /// content bytes (no timing and no content events).
    pub(crate) fn on_json_body(&mut self, body: &[u8]) {
        let parsed = self.json.parse(body, |nodes| {
            let content = read_document(nodes, &mut self.summary, &mut self.captured);
            let s = &mut self.summary;
            s.content_bytes = s.content_bytes.saturating_add(content.bytes);
        });
        if parsed.is_none() {
            self.summary.unparsed_events += 1;
        }
    }
}

impl StreamMeter {
    /// Whether `data` (one SSE event's data) is the extra chunk `stream_options.include_usage`
    /// adds at the end of a chat or completions stream: a JSON object whose top-level `choices`
    /// is an empty array and whose `usage` is an object. Records nothing. A byte screen comes
    /// first, so ordinary chunks (`"usage":null` or no usage at all) are never parsed twice; a
    /// key written with escapes (`"\u0075sage"`) fails the screen, and the chunk is then simply
    /// not recognized.
    pub(crate) fn is_usage_only(&mut self, data: &[u8]) -> bool {
        let doc = data.trim_ascii();
        let empty_array = |v: &[u8]| {
            v.strip_prefix(b"[")
                .is_some_and(|r| r.trim_ascii_start().starts_with(b"]"))
        };
        if doc.first() != Some(&b'{')
            || !key_followed_by(doc, b"\"choices\"", empty_array)
            || !key_followed_by(doc, b"\"usage\"", |v| v.starts_with(b"{"))
        {
            return false;
        }
        self.json
            .parse(doc, |nodes| {
                let (mut no_choices, mut usage) = (false, false);
                for (key, v) in entries(nodes, 0) {
                    match key {
                        "choices" => {
                            no_choices = matches!(nodes.get(v), Some(Node::Array { len: 0, .. }));
                        }
                        "usage" => usage = matches!(nodes.get(v), Some(Node::Object { .. })),
                        _ => {}
                    }
                }
                no_choices && usage
            })
            .unwrap_or(false)
    }
}

/// Whether `key` (quotes included) occurs in `doc` followed by a colon and a value (whitespace
/// skipped) that `value` accepts.
fn key_followed_by(doc: &[u8], key: &[u8], value: impl Fn(&[u8]) -> bool) -> bool {
    memchr::memmem::find_iter(doc, key).any(|at| {
        doc.get(at + key.len()..)
            .map(<[u8]>::trim_ascii_start)
            .and_then(|rest| rest.strip_prefix(b":"))
            .is_some_and(|rest| value(rest.trim_ascii_start()))
    })
}

/// Buffers that stay between parses. Past `KEEP_BYTES` of input they are freed after use, so a
/// single large body does not pin memory for the life of the worker.
#[derive(Default)]
struct JsonScratch {
    input: Vec<u8>,
    buffers: Option<Buffers>,
    tape: Option<Tape<'static>>,
}

const KEEP_BYTES: usize = 1 << 20;

impl JsonScratch {
    /// Parse `doc` and run `f` on its tape; `None` when it is not valid JSON.
    fn parse<R>(&mut self, doc: &[u8], f: impl FnOnce(&[Node<'_>]) -> R) -> Option<R> {
        self.input.clear();
        self.input.reserve(doc.len() + INPUT_PADDING);
        self.input.extend_from_slice(doc);
        self.input.resize(doc.len() + INPUT_PADDING, b' ');
        let buffers = self
            .buffers
            .get_or_insert_with(|| Buffers::new(doc.len().max(4096)));
        let mut tape = match self.tape.take() {
            Some(t) => t.reset(),
            None => Tape(Vec::with_capacity(128)),
        };
        let result =
            match simd_json::fill_tape_padded(&mut self.input, doc.len(), buffers, &mut tape) {
                Ok(()) => Some(f(&tape.0)),
                Err(_) => None,
            };
        let tape = tape.reset();
        if doc.len() > KEEP_BYTES {
            *self = Self::default();
        } else {
            self.tape = Some(tape);
        }
        result
    }
}

/// Generated content found in one document; its text is appended to the capture buffer.
struct Content<'c> {
    present: bool,
    bytes: u64,
    capture: &'c mut Vec<u8>,
}

impl Content<'_> {
    fn add_str(&mut self, s: &str) {
        if !s.is_empty() {
            self.present = true;
            self.bytes = self.bytes.saturating_add(s.len() as u64);
            let room = MAX_CAPTURE.saturating_sub(self.capture.len());
            // Whole pieces only, so the capture stays valid UTF-8.
            if s.len() <= room {
                self.capture.extend_from_slice(s.as_bytes());
            }
        }
    }
}

/// Record what `nodes` (one JSON document) says in `s`; return the content it carries.
fn read_document<'c>(
    nodes: &[Node<'_>],
    s: &mut MeterSummary,
    capture: &'c mut Vec<u8>,
) -> Content<'c> {
    let mut content = Content {
        present: false,
        bytes: 0,
        capture,
    };
    if !matches!(nodes.first(), Some(Node::Object { .. })) {
        return content;
    }
    let mut choices = None;
    let mut usage = None;
    let mut error = None;
    let mut kind = None;
    let mut delta = None;
    let mut response = None;
    let mut object = None;
    for (key, v) in entries(nodes, 0) {
        match key {
            "choices" => choices = Some(v),
            "usage" => usage = Some(v),
            "error" => error = Some(v),
            "type" => kind = str_at(nodes, v),
            "delta" => delta = Some(v),
            "response" => response = Some(v),
            "object" => object = str_at(nodes, v),
            _ => {}
        }
    }

    // Chat completions and completions.
    if let Some(choices) = choices {
        for choice in elements(nodes, choices) {
            for (key, v) in entries(nodes, choice) {
                match key {
                    "delta" | "message" => message_content(nodes, v, &mut content),
                    "text" => content.add_str(str_at(nodes, v).unwrap_or_default()),
                    "finish_reason" => {
                        if let Some(reason) = str_at(nodes, v) {
                            s.finish_reason = Some(truncate(reason, MAX_SHORT_FIELD).to_owned());
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    if let Some(u) = usage.and_then(|u| read_usage(nodes, u)) {
        s.usage = Some(u);
    }
    if let Some(e) = error.and_then(|e| read_error(nodes, e)) {
        s.error = Some(e);
    }

    match (kind, object) {
        // vLLM's older error shape: `{"object":"error","message":…,"type":…,"code":…}`.
        (_, Some("error")) => {
            if let Some(e) = read_error(nodes, 0) {
                s.error = Some(e);
            }
        }
        // Responses API streaming events.
        (Some(kind), _) => {
            if kind.ends_with(".delta") {
                if let Some(d) = delta.and_then(|d| str_at(nodes, d)) {
                    content.add_str(d);
                }
            } else if kind == "error" {
                // `{"type":"error","code":…,"message":…,"param":…}`
                if let Some(e) = read_error(nodes, 0) {
                    s.error = Some(e);
                }
            }
            if let Some(r) = response {
                read_response(nodes, r, s, None);
            }
        }
        // A whole Responses API response object.
        (None, Some("response")) => read_response(nodes, 0, s, Some(&mut content)),
        _ => {}
    }
    content
}

/// A chat `delta` or `message` object: text, reasoning, refusal and tool calls.
fn message_content(nodes: &[Node<'_>], idx: usize, content: &mut Content<'_>) {
    for (key, v) in entries(nodes, idx) {
        match key {
            "content" | "reasoning_content" | "reasoning" | "refusal" => {
                content.add_str(str_at(nodes, v).unwrap_or_default());
            }
            "tool_calls" => {
                let mut calls = 0;
                for call in elements(nodes, v) {
                    calls += 1;
                    for (key, f) in entries(nodes, call) {
                        if key == "function" {
                            function_content(nodes, f, content);
                        }
                    }
                }
                if calls > 0 {
                    content.present = true;
                }
            }
            "function_call" => {
                if matches!(nodes.get(v), Some(Node::Object { .. })) {
                    content.present = true;
                    function_content(nodes, v, content);
                }
            }
            _ => {}
        }
    }
}

fn function_content(nodes: &[Node<'_>], idx: usize, content: &mut Content) {
    for (key, v) in entries(nodes, idx) {
        if key == "name" || key == "arguments" {
            content.add_str(str_at(nodes, v).unwrap_or_default());
        }
    }
}

/// A Responses API response object: usage, final status, error, and (for a whole body) the
/// output's text.
fn read_response(
    nodes: &[Node<'_>],
    idx: usize,
    s: &mut MeterSummary,
    mut content: Option<&mut Content>,
) {
    let mut status = None;
    let mut reason = None;
    for (key, v) in entries(nodes, idx) {
        match key {
            "usage" => {
                if let Some(u) = read_usage(nodes, v) {
                    s.usage = Some(u);
                }
            }
            "status" => status = str_at(nodes, v),
            "incomplete_details" => {
                reason = entries(nodes, v)
                    .find(|(k, _)| *k == "reason")
                    .and_then(|(_, r)| str_at(nodes, r));
            }
            "error" => {
                if let Some(e) = read_error(nodes, v) {
                    s.error = Some(e);
                }
            }
            "output" => {
                if let Some(content) = content.as_deref_mut() {
                    output_content(nodes, v, content);
                }
            }
            _ => {}
        }
    }
    if let Some(status) = status {
        if matches!(status, "completed" | "incomplete" | "failed" | "cancelled") {
            let r = reason.unwrap_or(status);
            s.finish_reason = Some(truncate(r, MAX_SHORT_FIELD).to_owned());
        }
    }
}

/// Text of a Responses API `output` array: message parts' `text`, function calls' `arguments`.
fn output_content(nodes: &[Node<'_>], idx: usize, content: &mut Content) {
    for item in elements(nodes, idx) {
        for (key, v) in entries(nodes, item) {
            match key {
                "arguments" => content.add_str(str_at(nodes, v).unwrap_or_default()),
                "content" | "summary" => {
                    for part in elements(nodes, v) {
                        for (key, t) in entries(nodes, part) {
                            if key == "text" {
                                content.add_str(str_at(nodes, t).unwrap_or_default());
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

/// A `usage` object in either naming (chat/completions or Responses API); `None` when it is
/// not an object or has no token count.
fn read_usage(nodes: &[Node<'_>], idx: usize) -> Option<Usage> {
    let mut u = Usage::default();
    let mut total = None;
    let mut any = false;
    for (key, v) in entries(nodes, idx) {
        match key {
            "prompt_tokens" | "input_tokens" => {
                if let Some(n) = count_at(nodes, v) {
                    u.prompt_tokens = n;
                    any = true;
                }
            }
            "completion_tokens" | "output_tokens" => {
                if let Some(n) = count_at(nodes, v) {
                    u.completion_tokens = n;
                    any = true;
                }
            }
            "total_tokens" => {
                total = count_at(nodes, v);
                any |= total.is_some();
            }
            "prompt_tokens_details" | "input_tokens_details" => {
                if let Some(n) = detail(nodes, v, "cached_tokens") {
                    u.cached_tokens = n;
                }
                // Cache writes: OpenAI's SDK names them `cache_write_tokens`; Sluice's own
                // translation of an Anthropic answer writes both names.
                if let Some(n) = detail(nodes, v, "cache_write_tokens")
                    .or_else(|| detail(nodes, v, "cache_creation_tokens"))
                {
                    u.cache_write_tokens = n;
                }
            }
            "completion_tokens_details" | "output_tokens_details" => {
                if let Some(n) = detail(nodes, v, "reasoning_tokens") {
                    u.reasoning_tokens = n;
                }
            }
            _ => {}
        }
    }
    if !any {
        return None;
    }
    u.total_tokens = total.unwrap_or(u.prompt_tokens.saturating_add(u.completion_tokens));
    Some(u)
}

fn detail(nodes: &[Node<'_>], idx: usize, name: &str) -> Option<u64> {
    entries(nodes, idx)
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| count_at(nodes, v))
}

/// An error: an object with `message`, `type`, `code`, or a bare string.
fn read_error(nodes: &[Node<'_>], idx: usize) -> Option<UpstreamError> {
    match nodes.get(idx)? {
        Node::String(m) => Some(UpstreamError {
            message: truncate(m, MAX_ERROR_MESSAGE).to_owned(),
            kind: None,
            code: None,
        }),
        Node::Object { .. } => {
            let mut e = UpstreamError::default();
            for (key, v) in entries(nodes, idx) {
                match key {
                    "message" => {
                        if let Some(m) = str_at(nodes, v) {
                            e.message = truncate(m, MAX_ERROR_MESSAGE).to_owned();
                        }
                    }
                    "type" => e.kind = short_text(nodes, v),
                    "code" => e.code = short_text(nodes, v),
                    _ => {}
                }
            }
            Some(e)
        }
        _ => None,
    }
}

/// A string, or a number written out, cut to [`MAX_SHORT_FIELD`] bytes.
fn short_text(nodes: &[Node<'_>], idx: usize) -> Option<String> {
    match nodes.get(idx)? {
        Node::String(s) => Some(truncate(s, MAX_SHORT_FIELD).to_owned()),
        Node::Static(StaticNode::U64(n)) => Some(n.to_string()),
        Node::Static(StaticNode::I64(n)) => Some(n.to_string()),
        _ => None,
    }
}

fn str_at<'a>(nodes: &[Node<'a>], idx: usize) -> Option<&'a str> {
    match nodes.get(idx)? {
        Node::String(s) => Some(s),
        _ => None,
    }
}

/// A token count: a non-negative integer (`12`, `12.0` or `1.2e1`).
fn count_at(nodes: &[Node<'_>], idx: usize) -> Option<u64> {
    match *nodes.get(idx)? {
        Node::Static(StaticNode::U64(n)) => Some(n),
        Node::Static(StaticNode::I64(n)) => u64::try_from(n).ok(),
        Node::Static(StaticNode::F64(f)) if f >= 0.0 && f.fract() == 0.0 && f < 1e18 => {
            Some(f as u64)
        }
        _ => None,
    }
}

/// Nodes taken by the value at this node, itself included.
fn span(node: &Node<'_>) -> usize {
    match node {
        Node::Object { count, .. } | Node::Array { count, .. } => count.saturating_add(1),
        _ => 1,
    }
}

/// The entries of the object at `idx` (none if it is not an object): key and value index.
fn entries<'t, 'a>(nodes: &'t [Node<'a>], idx: usize) -> Entries<'t, 'a> {
    let left = match nodes.get(idx) {
        Some(Node::Object { len, .. }) => *len,
        _ => 0,
    };
    Entries {
        nodes,
        next: idx + 1,
        left,
    }
}

struct Entries<'t, 'a> {
    nodes: &'t [Node<'a>],
    next: usize,
    left: usize,
}

impl<'a> Iterator for Entries<'_, 'a> {
    type Item = (&'a str, usize);

    fn next(&mut self) -> Option<(&'a str, usize)> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let Some(Node::String(key)) = self.nodes.get(self.next) else {
            self.left = 0;
            return None;
        };
        let value = self.next + 1;
        self.next = value.saturating_add(self.nodes.get(value).map_or(1, span));
        Some((key, value))
    }
}

/// The element indexes of the array at `idx` (none if it is not an array).
fn elements<'t, 'a>(nodes: &'t [Node<'a>], idx: usize) -> Elements<'t, 'a> {
    let left = match nodes.get(idx) {
        Some(Node::Array { len, .. }) => *len,
        _ => 0,
    };
    Elements {
        nodes,
        next: idx + 1,
        left,
    }
}

struct Elements<'t, 'a> {
    nodes: &'t [Node<'a>],
    next: usize,
    left: usize,
}

impl Iterator for Elements<'_, '_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let at = self.next;
        let node = self.nodes.get(at)?;
        self.next = at.saturating_add(span(node));
        Some(at)
    }
}
