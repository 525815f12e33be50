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
//! Each event's document is parsed with simd-json into a tape kept between calls (simd-json
//! unescapes in place, so the data is first copied into the thread's scratch buffer with the
//! padding simd-json needs), then the few fields that matter are read off the tape. A whole
//! body that reports its usage is only scanned (the inspector's validating scanner), its
//! `usage` read by the same scanner (parsed only in the rare forms the scanner leaves to the
//! tape); any other whole body is parsed where it lies.

use crate::openai::inspect::scan::{unescape, Kind, Scanner, Value};
use crate::openai::json::truncate;
use crate::sys::clock::Mono;

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
    pub(crate) first_event_at: Option<Mono>,
    /// When the first event carrying generated content arrived: time to first token.
    pub(crate) first_content_at: Option<Mono>,
    /// When the last event carrying generated content arrived.
    pub(crate) last_content_at: Option<Mono>,
    /// Events that carried generated content.
    pub(crate) content_events: u64,
    /// Bytes of generated content (text, reasoning, tool-call arguments), as decoded UTF-8: the
    /// basis of an estimate when the upstream reports no usage. Not counted for a whole
    /// (non-streamed) body that reports usage, which needs no estimate.
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

    /// Forget the response, keeping the capture's buffer (the parse buffers are the
    /// thread's, see [`with_scratch`]).
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

    /// Take what has been recorded and start over.
    #[cfg(test)]
    pub(crate) fn take_summary(&mut self) -> MeterSummary {
        std::mem::take(&mut self.summary)
    }

    /// The data of one SSE event (see [`super::sse::event_data`]), seen at `now`.
    pub(crate) fn on_data(&mut self, data: &[u8], now: Mono) {
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
        let Some(content) = parse(doc, |nodes| {
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
    /// Responses API response, or an error body. Records usage, finish reason and error, and
    /// — only when no usage is reported, the one case an estimate needs them — the content's
    /// bytes and text (no timing and no content events). A body reporting usage is scanned
    /// ([`Self::read_reported_usage`]); any other is parsed where it lies: `body` gets padding
    /// appended for the parse and is cut back to its length after. The body is `body[from..]`
    /// (what comes before, a response head say, is left alone).
    pub(crate) fn on_json_body(&mut self, body: &mut Vec<u8>, from: usize) {
        if self.read_reported_usage(body.get(from..).unwrap_or_default()) {
            return;
        }
        let parsed = with_scratch(|scratch| {
            scratch.parse_in_place(body, from, |nodes| {
                let content = read_document(nodes, &mut self.summary, &mut self.captured);
                let s = &mut self.summary;
                s.content_bytes = s.content_bytes.saturating_add(content.bytes);
            })
        });
        if parsed.is_none() {
            self.summary.unparsed_events += 1;
        }
    }
}

impl StreamMeter {
    /// A whole chat completion, completion or embeddings body that reports its usage — nearly
    /// every non-streamed answer — read without building its tape: the inspector's scanner
    /// validates the body (refusing what the parse would) and passes over its members; `usage`
    /// is read as it is scanned (or parsed, in the forms the scanner leaves to the tape), and
    /// each choice's `finish_reason` read. The content, which is most of
    /// a large answer, is only scanned: its text and byte count serve the estimate of an answer
    /// that reports no usage, which this one does. Returns false, having recorded nothing, for
    /// anything else (no usage, an error or Responses API shape, a key written with escapes,
    /// not valid JSON): the whole parse reads those.
    fn read_reported_usage(&mut self, body: &[u8]) -> bool {
        let Ok(text) = simdutf8::basic::from_utf8(body) else {
            return false;
        };
        let Some(Reported {
            usage,
            counts,
            finish_reason,
        }) = reported_usage_members(text)
        else {
            return false;
        };
        // Read where it lies; the few `usage` objects the scanner cannot read exactly as the
        // tape does are parsed.
        let usage = match counts {
            Ok(usage) => usage,
            Err(Unusual) => {
                parse(&body[usage.start..usage.end], |nodes| read_usage(nodes, 0)).flatten()
            }
        };
        let Some(usage) = usage else {
            return false;
        };
        let s = &mut self.summary;
        s.usage = Some(usage);
        if let Some(reason) = finish_reason {
            let mut decoded = String::new();
            let raw = text
                .get(reason.start + 1..reason.end - 1)
                .unwrap_or_default();
            let reason = if matches!(reason.kind, Kind::String { escaped: true }) {
                unescape(raw, &mut decoded);
                &decoded
            } else {
                raw
            };
            s.finish_reason = Some(truncate(reason, MAX_SHORT_FIELD).to_owned());
        }
        true
    }
}

/// What [`reported_usage_members`] found: the top-level `usage` object, its counts (or
/// [`Unusual`]: to be parsed), and the last choice's string `finish_reason`.
struct Reported {
    usage: Value,
    counts: Result<Option<Usage>, Unusual>,
    finish_reason: Option<Value>,
}

/// The top-level `usage` object of a valid JSON object body, read, and the last choice's
/// string `finish_reason`; `None` when the body is not valid JSON, not an object, has no
/// `usage` object, has a member that makes it another shape (`error`, `type`, `response`,
/// `delta`, an `object` of `"error"` or `"response"`), or has a key written with escapes.
/// Duplicate keys: the last one counts, as in the whole parse. One pass: the choices and the
/// usage are walked as they are scanned (a second walk of the usage cost ~400 instructions a
/// response, its keys and counts scanned twice).
fn reported_usage_members(text: &str) -> Option<Reported> {
    let mut sc = Scanner::new(text);
    if sc.skip_ws()? != b'{' {
        return None;
    }
    sc.pos += 1;
    let (mut usage, mut finish_reason) = (None, None);
    let mut more = sc.skip_ws()? != b'}';
    if !more {
        sc.pos += 1;
    }
    while more {
        match plain_key(&mut sc, text)? {
            // A repeated key replaces the earlier one, as in the whole parse.
            "choices" if sc.skip_ws() == Some(b'[') => finish_reason = walk_choices(&mut sc, text)?,
            "choices" => {
                sc.value(1).ok()?;
                finish_reason = None;
            }
            "usage" if sc.skip_ws() == Some(b'{') => usage = Some(walk_usage(&mut sc, text)?),
            "usage" => usage = Some((sc.value(1).ok()?, Ok(None))),
            "error" | "type" | "response" | "delta" => return None,
            "object" => {
                let v = sc.value(1).ok()?;
                let v = text.get(v.start..v.end)?;
                // The usual values are compared first: a search for an escape in them (std's
                // or memchr's) cost 70-110 instructions a response, for a 17-byte value.
                let usual = matches!(v, "\"chat.completion\"" | "\"text_completion\"");
                if !usual
                    && (v == "\"error\"" || v == "\"response\"" || v.bytes().any(|b| b == b'\\'))
                {
                    return None;
                }
            }
            _ => {
                sc.value(1).ok()?;
            }
        }
        more = sc.next_or_close(b'}').ok()?;
    }
    sc.end().ok()?;
    usage
        .filter(|(u, _)| u.kind == Kind::Object)
        .map(|(usage, counts)| Reported {
            usage,
            counts,
            finish_reason,
        })
}

/// The `usage` object at `sc` (on its `{`), validated and passed over, and its counts, read
/// member by member as they are scanned; `None` when it is not JSON.
fn walk_usage(sc: &mut Scanner<'_>, text: &str) -> Option<(Value, Result<Option<Usage>, Unusual>)> {
    let start = sc.pos;
    sc.pos += 1;
    let mut counts = Ok(Counts::default());
    let mut more = sc.skip_ws()? != b'}';
    if !more {
        sc.pos += 1;
    }
    while more {
        let key = sc.key().ok()?;
        let v = sc.value(2).ok()?;
        if let Ok(read) = &mut counts {
            let plain = match key.kind {
                Kind::String { escaped: false } => text.get(key.start + 1..key.end - 1),
                _ => None,
            };
            if plain
                .ok_or(Unusual)
                .and_then(|k| read.member(text, k, v))
                .is_err()
            {
                counts = Err(Unusual);
            }
        }
        more = sc.next_or_close(b'}').ok()?;
    }
    let usage = Value {
        start,
        end: sc.pos,
        kind: Kind::Object,
    };
    Some((usage, counts.map(Counts::finish)))
}

/// A `usage` object holds something the scanner does not read as the tape does: a key
/// written with escapes, or a count written as a float, `-0`, or 10^18 and above (where the
/// tape's number types could differ from the scanner's).
struct Unusual;

/// The counts of the `usage` object `usage` of `text` (validated already), read by a walk of
/// its own: what [`walk_usage`] must agree with.
#[cfg(test)]
fn scan_usage(text: &str, usage: Value) -> Result<Option<Usage>, Unusual> {
    let mut read = Counts::default();
    let mut members = Members::of(text, usage);
    while let Some((key, v)) = members.next()? {
        read.member(text, key, v)?;
    }
    Ok(read.finish())
}

/// The counts of a `usage` object, read member by member.
#[derive(Default)]
struct Counts {
    u: Usage,
    total: Option<u64>,
    any: bool,
}

impl Counts {
    /// Read the member `key`: `v`, in `text`.
    fn member(&mut self, text: &str, key: &str, v: Value) -> Result<(), Unusual> {
        let Counts { u, total, any } = self;
        match key {
            "prompt_tokens" | "input_tokens" => {
                if let Some(n) = scanned_count(v)? {
                    u.prompt_tokens = n;
                    *any = true;
                }
            }
            "completion_tokens" | "output_tokens" => {
                if let Some(n) = scanned_count(v)? {
                    u.completion_tokens = n;
                    *any = true;
                }
            }
            "total_tokens" => {
                *total = scanned_count(v)?;
                *any |= total.is_some();
            }
            "prompt_tokens_details" | "input_tokens_details" => {
                if let Some(n) = scanned_detail(text, v, "cached_tokens")? {
                    u.cached_tokens = n;
                }
                let written = match scanned_detail(text, v, "cache_write_tokens")? {
                    Some(n) => Some(n),
                    None => scanned_detail(text, v, "cache_creation_tokens")?,
                };
                if let Some(n) = written {
                    u.cache_write_tokens = n;
                }
            }
            "completion_tokens_details" | "output_tokens_details" => {
                if let Some(n) = scanned_detail(text, v, "reasoning_tokens")? {
                    u.reasoning_tokens = n;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The usage read, if any count was.
    fn finish(self) -> Option<Usage> {
        let Counts { mut u, total, any } = self;
        if !any {
            return None;
        }
        u.total_tokens = total.unwrap_or(u.prompt_tokens.saturating_add(u.completion_tokens));
        Some(u)
    }
}

/// [`detail`] on the scanner: the count of the first member `name` of the object `v`.
fn scanned_detail(text: &str, v: Value, name: &str) -> Result<Option<u64>, Unusual> {
    let mut members = Members::of(text, v);
    while let Some((key, v)) = members.next()? {
        if key == name {
            return scanned_count(v);
        }
    }
    Ok(None)
}

/// [`count_at`] on a scanned value.
fn scanned_count(v: Value) -> Result<Option<u64>, Unusual> {
    match v.kind {
        Kind::Int {
            negative: false,
            magnitude,
        } if magnitude < 1_000_000_000_000_000_000 => Ok(Some(magnitude)),
        Kind::Int {
            negative: true,
            magnitude,
        } if magnitude > 0 => Ok(None),
        Kind::Int { .. } | Kind::Float => Err(Unusual),
        _ => Ok(None),
    }
}

/// The members of a validated object (none if the value is not an object), key and value.
struct Members<'t> {
    sc: Scanner<'t>,
    text: &'t str,
    more: bool,
}

impl<'t> Members<'t> {
    fn of(text: &'t str, object: Value) -> Members<'t> {
        let mut sc = Scanner::new(text);
        sc.pos = object.start + 1;
        let more = object.kind == Kind::Object && sc.skip_ws() != Some(b'}');
        Members { sc, text, more }
    }

    /// The next member; [`Unusual`] at a key written with escapes (and at a scanner fault,
    /// which the validated object cannot hold, so that the parse decides).
    fn next(&mut self) -> Result<Option<(&'t str, Value)>, Unusual> {
        if !self.more {
            return Ok(None);
        }
        let key = plain_key(&mut self.sc, self.text).ok_or(Unusual)?;
        let v = self.sc.value(2).map_err(|_| Unusual)?;
        self.more = self.sc.next_or_close(b'}').map_err(|_| Unusual)?;
        Ok(Some((key, v)))
    }
}

/// An object key and its colon; `None` for a key written with escapes (or not JSON).
fn plain_key<'t>(sc: &mut Scanner<'_>, text: &'t str) -> Option<&'t str> {
    let key = sc.key().ok()?;
    if key.kind != (Kind::String { escaped: false }) {
        return None;
    }
    text.get(key.start + 1..key.end - 1)
}

/// The `choices` array at `sc` (on its `[`), validated and passed over: the string
/// `finish_reason` of the last choice that has one (`Some(None)`: none has); `None` when it is
/// not JSON or a choice's key is written with escapes.
fn walk_choices(sc: &mut Scanner<'_>, text: &str) -> Option<Option<Value>> {
    sc.pos += 1;
    let mut found = None;
    let mut more = sc.skip_ws()? != b']';
    if !more {
        sc.pos += 1;
    }
    while more {
        if sc.skip_ws()? == b'{' {
            sc.pos += 1;
            let mut members = sc.skip_ws()? != b'}';
            if !members {
                sc.pos += 1;
            }
            while members {
                let is_reason = plain_key(sc, text)? == "finish_reason";
                let value = sc.value(3).ok()?;
                if is_reason && matches!(value.kind, Kind::String { .. }) {
                    found = Some(value);
                }
                members = sc.next_or_close(b'}').ok()?;
            }
        } else {
            sc.value(2).ok()?;
        }
        more = sc.next_or_close(b']').ok()?;
    }
    Some(found)
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
        parse(doc, |nodes| {
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
/// single large body does not pin memory for the life of the worker. One per thread (see
/// [`with_scratch`]), not one per meter: a parse never waits, so a worker's ten thousand
/// streams can share one set instead of holding ~12 KB each.
#[derive(Default)]
struct JsonScratch {
    input: Vec<u8>,
    buffers: Option<Buffers>,
    tape: Option<Tape<'static>>,
}

const KEEP_BYTES: usize = 1 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<JsonScratch> = std::cell::RefCell::default();
}

/// Run `f` with this thread's parse buffers (a fresh set in the never-seen case of a parse
/// inside a parse, rather than a panic).
fn with_scratch<R>(f: impl FnOnce(&mut JsonScratch) -> R) -> R {
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut JsonScratch::default()),
    })
}

/// Parse `doc` with this thread's buffers and run `f` on its tape; `None` when it is not valid
/// JSON.
fn parse<R>(doc: &[u8], f: impl FnOnce(&[Node<'_>]) -> R) -> Option<R> {
    with_scratch(|scratch| scratch.parse(doc, f))
}

impl JsonScratch {
    /// Parse `doc` and run `f` on its tape; `None` when it is not valid JSON.
    fn parse<R>(&mut self, doc: &[u8], f: impl FnOnce(&[Node<'_>]) -> R) -> Option<R> {
        let mut input = std::mem::take(&mut self.input);
        input.clear();
        input.reserve(doc.len() + INPUT_PADDING);
        input.extend_from_slice(doc);
        let result = self.parse_in_place(&mut input, 0, f);
        self.input = input;
        if doc.len() > KEEP_BYTES {
            self.input = Vec::new();
        }
        result
    }

    /// [`parse`](Self::parse) without the copy: `doc` is padded where it lies for the parse
    /// (which may rewrite its bytes: the unescaping works in place), and cut back to its length
    /// after. The document is `doc[from..]`.
    fn parse_in_place<R>(
        &mut self,
        doc: &mut Vec<u8>,
        from: usize,
        f: impl FnOnce(&[Node<'_>]) -> R,
    ) -> Option<R> {
        let len = doc.len();
        let from = from.min(len);
        doc.resize(len + INPUT_PADDING, b' ');
        let buffers = self
            .buffers
            .get_or_insert_with(|| Buffers::new((len - from).max(4096)));
        let mut tape = match self.tape.take() {
            Some(t) => t.reset(),
            None => Tape(Vec::with_capacity(128)),
        };
        let input = &mut doc[from..];
        let result = match simd_json::fill_tape_padded(input, len - from, buffers, &mut tape) {
            Ok(()) => Some(f(&tape.0)),
            Err(_) => None,
        };
        let tape = tape.reset();
        doc.truncate(len);
        if len - from > KEEP_BYTES {
            *self = Self::default();
        } else {
            self.tape = Some(tape);
        }
        result
    }
}

/// Generated content found in one document; its text is appended to the capture buffer while
/// `keep` says so.
struct Content<'c> {
    present: bool,
    bytes: u64,
    capture: &'c mut Vec<u8>,
    keep: bool,
}

impl Content<'_> {
    fn add_str(&mut self, s: &str) {
        if !s.is_empty() {
            self.present = true;
            self.bytes = self.bytes.saturating_add(s.len() as u64);
            let room = MAX_CAPTURE.saturating_sub(self.capture.len());
            // Whole pieces only, so the capture stays valid UTF-8.
            if self.keep && s.len() <= room {
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
        keep: true,
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

    if let Some(u) = usage.and_then(|u| read_usage(nodes, u)) {
        s.usage = Some(u);
    }
    // The capture is for estimating a response that reports no usage: once it has, the text
    // is only counted, not copied (a 64 KB answer saved a 64 KB copy).
    content.keep = s.usage.is_none();

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The bodies the fast path must read as the whole parse does, or leave to it.
    const DOCS: &[&str] = &[
        r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"Hi \"there\"\n\u00e9\ud83d\ude00"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":2}}}"#,
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"choices":[{"finish_reason":"length","text":"x"},{"finish_reason":null},{"finish_reason":"st\u006fp"}]}"#,
        r#" { "object" : "list" , "data" : [ { "embedding" : [ 0.1 , -2e3 ] } ] , "usage" : { "prompt_tokens" : 5 , "total_tokens" : 5 } } "#,
        r#"{"choices":[],"usage":{"prompt_tokens":1},"choices":[{"finish_reason":"stop"}]}"#,
        r#"{"choices":[{"finish_reason":"stop"}],"usage":{"prompt_tokens":1},"choices":[]}"#,
        r#"{"choices":[{"finish_reason":"stop"}],"choices":null,"usage":{"prompt_tokens":1}}"#,
        r#"{"usage":{"prompt_tokens":1},"usage":null}"#,
        r#"{"usage":{"prompt_tokens":1},"usage":{"completion_tokens":7}}"#,
        r#"{"usage":{}}"#,
        r#"{"usage":"many"}"#,
        r#"{"choices":[{"message":{"content":"no usage"},"finish_reason":"stop"}]}"#,
        r#"{"object":"error","message":"bad","type":"BadRequestError","code":400,"usage":{"prompt_tokens":1}}"#,
        r#"{"error":{"message":"bad","type":"invalid_request_error"},"usage":{"prompt_tokens":1}}"#,
        r#"{"object":"response","status":"completed","usage":{"input_tokens":3,"output_tokens":4}}"#,
        r#"{"type":"response.completed","response":{"usage":{"input_tokens":3}}}"#,
        r#"{"\u0075sage":{"prompt_tokens":1}}"#,
        r#"{"choices":[{"finish\u005freason":"stop"}],"usage":{"prompt_tokens":1}}"#,
        r#"{"object":"\u0065rror","usage":{"prompt_tokens":1}}"#,
        r#"{"choices":{"finish_reason":"stop"},"usage":{"prompt_tokens":1}}"#,
        r#"{"choices":[1,"a",[{"finish_reason":"x"}],{}],"usage":{"prompt_tokens":1}}"#,
        r#"{"usage":{"prompt_tokens":1}} x"#,
        r#"{"usage":{"prompt_tokens":1},}"#,
        r#"{"usage":{"prompt_tokens":18446744073709551616}}"#,
        r#"[{"usage":{"prompt_tokens":1}}]"#,
        r#"{}"#,
        // The `usage` object itself, read by the scanner or left to the tape.
        r#"{"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":3,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}"#,
        r#"{"usage":{"input_tokens":4,"output_tokens":5,"input_tokens_details":{"cache_creation_tokens":7,"cached_tokens":2},"output_tokens_details":{"reasoning_tokens":1}}}"#,
        r#"{"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cache_write_tokens":"x","cache_creation_tokens":6,"cached_tokens":1,"cached_tokens":9}}}"#,
        r#"{"usage":{"prompt_tokens":3,"prompt_tokens":"x","total_tokens":8,"total_tokens":null,"completion_tokens":-2}}"#,
        r#"{"usage":{"prompt_tokens":3.0,"completion_tokens":1e1,"total_tokens":-0}}"#,
        r#"{"usage":{"prompt_tokens":999999999999999999,"completion_tokens":1000000000000000000}}"#,
        r#"{"usage":{"prompt_tokens":18446744073709551615,"total_tokens":9223372036854775808}}"#,
        r#"{"usage":{"pr\u006fmpt_tokens":3,"completion_tokens":1}}"#,
        r#"{"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached\u005ftokens":2,"x":{"cached_tokens":5}}}}"#,
        r#"{"usage":{"prompt_tokens_details":[1],"completion_tokens_details":{"reasoning_tokens":[2]},"total_tokens":4}}"#,
        r#"{"usage":{"note":{"prompt_tokens":1},"other":[{"total_tokens":2}]}}"#,
    ];

    fn whole(doc: &[u8]) -> Option<MeterSummary> {
        let mut m = StreamMeter::new();
        let (summary, captured) = (&mut m.summary, &mut m.captured);
        parse(doc, |nodes| {
            read_document(nodes, summary, captured);
        })
        .map(|()| m.summary.clone())
    }

    fn check(doc: &[u8]) -> bool {
        let mut fast = StreamMeter::new();
        if !fast.read_reported_usage(doc) {
            assert_eq!(
                fast.summary,
                MeterSummary::default(),
                "recorded before giving up"
            );
            return false;
        }
        let whole = whole(doc).unwrap_or_else(|| {
            panic!(
                "read a body the parse refuses: {}",
                String::from_utf8_lossy(doc)
            )
        });
        let fast = &fast.summary;
        assert!(whole.usage.is_some());
        assert_eq!(
            (&fast.usage, &fast.finish_reason, &fast.error),
            (&whole.usage, &whole.finish_reason, &whole.error),
            "{}",
            String::from_utf8_lossy(doc)
        );
        true
    }

    /// The scanner reads the `usage` objects of the docs above itself, except those that hold
    /// what only the tape reads exactly (escaped keys, floats, `-0`, counts from 10^18).
    #[test]
    fn usage_is_scanned_unless_unusual() {
        let scanned: Vec<bool> = DOCS[25..]
            .iter()
            .map(|doc| {
                let reported = reported_usage_members(doc).unwrap_or_else(|| panic!("{doc}"));
                // The walk reads as a second look at the object alone does.
                let apart = scan_usage(doc, reported.usage);
                assert_eq!(reported.counts.as_ref().ok(), apart.as_ref().ok(), "{doc}");
                reported.counts.is_ok()
            })
            .collect();
        assert_eq!(
            scanned,
            [true, true, true, true, false, false, false, false, false, true, true]
        );
        let read = reported_usage_members(DOCS[27])
            .and_then(|r| r.counts.ok())
            .flatten();
        let want = Usage {
            prompt_tokens: 3,
            total_tokens: 3,
            cached_tokens: 1,
            cache_write_tokens: 6,
            ..Usage::default()
        };
        assert_eq!(read, Some(want));
    }

    #[test]
    fn reported_usage_is_read_as_the_whole_parse_reads_it() {
        let taken: Vec<bool> = DOCS.iter().map(|d| check(d.as_bytes())).collect();
        assert_eq!(
            taken,
            [
                true, true, true, true, true, true, false, true, false, false, false, false, false,
                false, false, false, false, false, true, true, false, false, false, false, false,
                true, true, true, true, true, true, true, true, true, true, false
            ]
        );
        // Every cut and every one-byte change of them: read the same, or left to the parse.
        let mut taken = 0;
        for doc in DOCS {
            let doc = doc.as_bytes();
            for cut in 0..doc.len() {
                taken += usize::from(check(&doc[..cut]));
            }
            for at in 0..doc.len() {
                for b in [b'"', b'\\', b'}', b']', b',', b' ', b'1', b'x', 0x01, 0xC3] {
                    let mut changed = doc.to_vec();
                    changed[at] = b;
                    taken += usize::from(check(&changed));
                }
            }
        }
        assert!(taken > 1000, "{taken}");
    }
}
