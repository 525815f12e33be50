//! Inspect: read the request body's top-level fields that routing, limits and metering act on.
//!
//! Runs after the body is read, before routing. Takes the raw body; returns an [`Inspection`]
//! with the top-level `model` (decoded, so `"\u006dodel"` is `model`), `stream`,
//! `stream_options.include_usage`, the token cap (`max_tokens`, `max_completion_tokens` or
//! `max_output_tokens`), `n`, and the byte span of the model's string literal so the forward phase
//! can splice a mapped name in without touching any other byte; for a streaming request also
//! where `stream_options` sits ([`StreamOptionsAt`]), so the forward phase can ask for usage the
//! same way. The whole document is validated (UTF-8, then RFC 8259's grammar in one forward
//! pass over the body where it lies: [`scan`]). Raises 400 `invalid_request_error` for invalid
//! JSON or UTF-8, a body that is not an object, a duplicate top-level key or a duplicate
//! `stream_options.include_usage` (the upstream might read the other copy), a missing or
//! non-string `model`, or a wrongly typed field above. A body that is not valid JSON is refused
//! for that alone, whatever else is wrong with it; otherwise the first wrong top-level member,
//! in the body's order, names the error.
//!
//! Only top-level keys count: the members of the top-level object are read one by one and
//! every value below them is skipped whole, so a `"model"` inside messages or nested objects is
//! never taken, in whatever order it appears.
//!
//! What sticky routing asks of the body, only when some route asks ([`Wants`]), is read as the
//! pass goes by: the value at each dotted path of object keys (`metadata.conversation_id`: a
//! string or an integer, else nothing — never an error; the first of duplicate nested keys;
//! below the top level, found by a second look into the member's value alone), and the byte
//! span of the start of the prompt (`messages`, else `input`, else `prompt`) for prefix
//! affinity. Nothing is copied but the ids' text, into a buffer the [`Inspection`] keeps, and
//! the text of keys written with escapes.

pub(in crate::openai) mod scan;

#[cfg(test)]
mod differential;
#[cfg(test)]
mod oracle;

use scan::{Fault, Kind, Scanner, Value};

use crate::openai::json::truncate;

/// What the pipeline needs from a request body.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Inspection {
    pub(crate) model: String,
    /// Byte range of the model's JSON string literal (quotes included) in the body.
    pub(crate) model_span: (usize, usize),
    pub(crate) stream: bool,
    pub(crate) include_usage: Option<bool>,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) n: Option<u64>,
    /// Where `stream_options` is, for splicing in `include_usage`. Found for streaming requests
    /// only (nothing else needs it); otherwise left at its default.
    pub(crate) stream_options: StreamOptionsAt,
    /// The values at the paths [`Wants::paths`] lists, by slot.
    pub(crate) body_ids: BodyIds,
    /// The first (at most) [`Wants::prefix_bytes`] bytes of the prompt's JSON text — the
    /// `messages` array, else `input`, else `prompt` — as a byte range of the body.
    pub(crate) prompt_prefix: Option<(usize, usize)>,
}

/// What routing wants read from bodies besides the fixed fields: built once per config
/// snapshot from the routes' sticky rules; empty (the default) costs nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Wants {
    /// Dotted paths of object keys from the top level, each split into its keys; a path's
    /// place in the list is its slot in [`BodyIds`].
    pub(crate) paths: Vec<Vec<String>>,
    /// How many bytes of the prompt's start prefix affinity hashes (0: none wanted).
    pub(crate) prefix_bytes: usize,
}

/// The longest body value taken as a session id, in bytes.
pub(crate) const MAX_BODY_ID: usize = 256;

/// The session ids found in a body, by slot: their text in one buffer, reused across requests
/// (an integer id is its decimal text, so `42` and `"42"` are one id).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BodyIds {
    text: String,
    spans: Vec<Option<(u32, u32)>>,
}

impl BodyIds {
    /// The value found for `slot`, if any.
    pub(crate) fn get(&self, slot: usize) -> Option<&str> {
        let (start, end) = (*self.spans.get(slot)?)?;
        self.text.get(start as usize..end as usize)
    }

    fn reset(&mut self, slots: usize) {
        self.text.clear();
        self.spans.clear();
        self.spans.resize(slots, None);
    }

    /// Keep `value` (a string or an integer; anything else is no id) for `slot`.
    fn set(&mut self, slot: usize, text: &str, value: Value, scratch: &mut String) {
        let start = self.text.len();
        match value.kind {
            Kind::String { escaped } => {
                let raw = text.get(value.start + 1..value.end - 1).unwrap_or_default();
                // A session id is short; a longer value is not one, and is not kept (the
                // buffer lives as long as the connection). An escape is at most six bytes for
                // one, so a longer text is too long however it decodes.
                if (!escaped && raw.len() > MAX_BODY_ID) || raw.len() > 6 * MAX_BODY_ID {
                    return;
                }
                if escaped {
                    scratch.clear();
                    scan::unescape(raw, scratch);
                    if scratch.len() > MAX_BODY_ID {
                        return;
                    }
                    self.text.push_str(scratch);
                } else {
                    self.text.push_str(raw);
                }
            }
            // The number's text is its decimal form (no `+`, no leading zeros), but for `-0`,
            // which is the integer 0.
            Kind::Int { magnitude: 0, .. } => self.text.push('0'),
            Kind::Int { .. } => self
                .text
                .push_str(text.get(value.start..value.end).unwrap_or_default()),
            _ => return,
        }
        if let (Some(span), Ok(start), Ok(end)) = (
            self.spans.get_mut(slot),
            u32::try_from(start),
            u32::try_from(self.text.len()),
        ) {
            *span = Some((start, end));
        }
    }
}

/// Where a streaming request's `stream_options` sits in the body, as byte offsets: enough for
/// the forward phase to make `include_usage` true while touching no other byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamOptionsAt {
    /// No `stream_options` key; a new top-level key can go at `insert_at` (just past the
    /// body's opening `{`, which always has `model` after it, so a comma can follow).
    Absent { insert_at: usize },
    /// `"stream_options": null`: the span of the `null`.
    Null { span: (usize, usize) },
    /// An object: the offset just past its `{`, whether it has no keys, and the span of
    /// `include_usage`'s value when that key is present.
    Object {
        inside: usize,
        empty: bool,
        include_usage: Option<(usize, usize)>,
    },
}

impl Default for StreamOptionsAt {
    fn default() -> Self {
        StreamOptionsAt::Absent { insert_at: 0 }
    }
}

/// Why a body can't be served, as the client should read it: the message and the field it
/// concerns. The gateway answers it as a 400 `invalid_request_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InspectError {
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
}

impl Inspection {
    /// Empty again for the next body, its buffers (the model's, the ids') kept: no allocation
    /// per request once they have grown.
    fn clear(&mut self, slots: usize) {
        let mut body_ids = std::mem::take(&mut self.body_ids);
        body_ids.reset(slots);
        let mut model = std::mem::take(&mut self.model);
        model.clear();
        *self = Inspection {
            model,
            body_ids,
            ..Inspection::default()
        };
    }
}

impl InspectError {
    fn new(message: impl Into<String>, param: Option<&'static str>) -> InspectError {
        InspectError {
            message: message.into(),
            param,
        }
    }
}

/// Per-worker scratch space, reused across requests so inspection allocates nothing in the
/// steady state.
#[derive(Default)]
pub(crate) struct Inspector {
    /// The body's top-level keys in order, for the duplicate check.
    keys: Vec<KeyText>,
    /// The text of the top-level keys written with escapes, decoded.
    decoded: String,
    /// Hashes of the keys, once a body has more than a few (see [`repeats`]).
    hashed: std::collections::HashSet<u64>,
    /// A nested key or a session id being decoded.
    scratch: String,
}

/// Where a top-level key's text is: in the body between its quotes, or (a key written with
/// escapes) decoded in [`Inspector::decoded`].
#[derive(Debug, Clone, Copy)]
struct KeyText {
    decoded: bool,
    start: usize,
    end: usize,
}

impl Inspector {
    /// Inspect `body` for the fixed fields only (tests, fuzzing and benchmarks; the gateway
    /// calls [`Inspector::inspect_for`] with its snapshot's wants).
    #[cfg(any(test, feature = "fuzz", feature = "bench"))]
    pub(crate) fn inspect(
        &mut self,
        body: &[u8],
        out: &mut Inspection,
    ) -> Result<(), InspectError> {
        self.inspect_for(body, &Wants::default(), out)
    }

    /// Inspect `body`, also reading what `wants` asks.
    pub(crate) fn inspect_for(
        &mut self,
        body: &[u8],
        wants: &Wants,
        out: &mut Inspection,
    ) -> Result<(), InspectError> {
        // UTF-8 first, the whole body in one vectorized check: the scan then reads text, and
        // any value it hands on is a `&str` already.
        out.clear(wants.paths.len());
        let Ok(text) = simdutf8::basic::from_utf8(body) else {
            return Err(syntax_error(body, Fault::Syntax { at: 0 }));
        };
        match self.read(text, wants, out) {
            Ok(verdict) => verdict,
            Err(fault) => {
                // A body that is not JSON says nothing: no field of it is kept (logs and
                // metrics read `out` whatever the verdict).
                out.clear(wants.paths.len());
                Err(syntax_error(body, fault))
            }
        }
    }

    /// The scan: a [`Fault`] when `text` is not JSON the gateway takes; else the verdict on
    /// its fields. `out` (empty on entry) takes the members in order up to the first wrong
    /// one, so a refused request is still logged with what it asked for before that.
    fn read(
        &mut self,
        text: &str,
        wants: &Wants,
        out: &mut Inspection,
    ) -> Result<Result<(), InspectError>, Fault> {
        let Inspector {
            keys,
            decoded,
            hashed,
            scratch,
        } = self;
        let mut s = Scanner::new(text);
        let Some(first) = s.skip_ws() else {
            return Err(s.syntax());
        };
        if first != b'{' {
            return not_an_object(&mut s);
        }
        s.pos += 1;
        let insert_at = s.pos;
        keys.clear();
        decoded.clear();
        hashed.clear();
        let mut found = Found::default();
        // The first wrong member (a duplicate key, or a wrong value): the error unless the body
        // turns out not to be JSON. The members after it are only scanned.
        let mut wrong: Option<InspectError> = None;
        let mut more = s.skip_ws() != Some(b'}');
        if !more {
            s.pos += 1;
        }
        while more {
            let key = s.key()?;
            let name = match wrong {
                Some(_) => None,
                None => match new_key(text, key, decoded, keys, hashed) {
                    Ok(name) => Some(name),
                    Err(e) => {
                        wrong = Some(e);
                        None
                    }
                },
            };
            let field = name.map_or(Field::Other, Field::of);
            // `stream_options`' own members are read as it is scanned; any other value is
            // scanned whole and read afterwards, if at all.
            let (value, options) = if field == Field::StreamOptions && s.skip_ws() == Some(b'{') {
                let (value, options) = stream_options(&mut s, text, scratch)?;
                (value, Some(options))
            } else {
                (s.value(1)?, None)
            };
            s.skip_ws();
            let after = s.pos;
            more = s.next_or_close(b'}')?;
            if let Some(name) = name {
                let member = Member {
                    name,
                    field,
                    value,
                    options,
                    after,
                };
                if let Err(e) = member.read(text, wants, scratch, out, &mut found) {
                    wrong = Some(e);
                }
            }
        }
        s.end()?;
        if let Some(e) = wrong {
            return Ok(Err(e));
        }
        Ok(found.complete(wants, insert_at, out))
    }
}

/// A body that does not open an object: a [`Fault`] when it is not JSON either, else the
/// error that it must be an object.
#[inline]
fn not_an_object(s: &mut Scanner<'_>) -> Result<Result<(), InspectError>, Fault> {
    // Valid JSON first: a body that is neither is refused as not JSON.
    s.value(0)?;
    s.end()?;
    Ok(Err(InspectError::new(
        "The request body must be a JSON object.",
        None,
    )))
}

/// The top-level key `key`, recorded among `keys`: its name, or the error when it repeats
/// one before it.
#[inline(always)]
fn new_key<'a>(
    text: &'a str,
    key: Value,
    decoded: &'a mut String,
    keys: &mut Vec<KeyText>,
    hashed: &mut std::collections::HashSet<u64>,
) -> Result<&'a str, InspectError> {
    let at = push_key(text, key, decoded, keys);
    let decoded: &'a str = decoded;
    let name = resolve(text, decoded, at);
    if repeats(text, decoded, keys, hashed) {
        return Err(InspectError::new(
            format!(
                "Duplicate top-level key `{}` in the request body.",
                truncate(name, 64)
            ),
            None,
        ));
    }
    Ok(name)
}

/// What the top-level members told, for after the scan.
#[derive(Default)]
struct Found {
    /// The model's string literal.
    model: Option<(usize, usize)>,
    /// Where `stream_options` is, when it is there (an object or `null`).
    stream_options: Option<StreamOptionsAt>,
    /// The prompt's rank (`messages` 0, `input` 1, `prompt` 2), value, and where the `,` or
    /// `}` after it is.
    prompt: Option<(u8, Value, usize)>,
}

impl Found {
    /// What the members told, once every one is read and none was wrong, into `out` (a new
    /// top-level key would go at `insert_at`); or the error that `model` is missing.
    #[inline(always)]
    fn complete(
        self,
        wants: &Wants,
        insert_at: usize,
        out: &mut Inspection,
    ) -> Result<(), InspectError> {
        let Some(model_span) = self.model else {
            return Err(invalid("You must provide a model parameter.", "model"));
        };
        out.model_span = model_span;
        if let Some((_, value, after)) = self.prompt {
            out.prompt_prefix = Some(prompt_prefix(value, after, wants.prefix_bytes));
        }
        if out.stream {
            out.stream_options = self
                .stream_options
                .unwrap_or(StreamOptionsAt::Absent { insert_at });
        }
        Ok(())
    }
}

/// The top-level keys the inspector reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Model,
    Stream,
    StreamOptions,
    /// A token cap, by its name.
    MaxTokens(&'static str),
    N,
    Other,
}

impl Field {
    fn of(key: &str) -> Field {
        match key {
            "model" => Field::Model,
            "stream" => Field::Stream,
            "stream_options" => Field::StreamOptions,
            "max_tokens" => Field::MaxTokens("max_tokens"),
            "max_completion_tokens" => Field::MaxTokens("max_completion_tokens"),
            "max_output_tokens" => Field::MaxTokens("max_output_tokens"),
            "n" => Field::N,
            _ => Field::Other,
        }
    }
}

/// One top-level member, scanned.
struct Member<'t> {
    name: &'t str,
    field: Field,
    value: Value,
    /// For `stream_options` as an object: what its members said.
    options: Option<Options>,
    /// Where the `,` or `}` after the value is.
    after: usize,
}

impl Member<'_> {
    /// Take what this member says into `out` and `found`, or say why its value is wrong.
    fn read(
        self,
        text: &str,
        wants: &Wants,
        scratch: &mut String,
        out: &mut Inspection,
        found: &mut Found,
    ) -> Result<(), InspectError> {
        let Member {
            name,
            field,
            value,
            options,
            after,
        } = self;
        for (slot, path) in wants.paths.iter().enumerate() {
            if let Some((first, rest)) = path.split_first() {
                if first == name {
                    if let Some(id) = find_path(text, value, rest, scratch) {
                        out.body_ids.set(slot, text, id, scratch);
                    }
                }
            }
        }
        if wants.prefix_bytes > 0 {
            let rank = match name {
                "messages" => 0,
                "input" => 1,
                "prompt" => 2,
                _ => u8::MAX,
            };
            if rank != u8::MAX && found.prompt.is_none_or(|(r, _, _)| rank < r) {
                found.prompt = Some((rank, value, after));
            }
        }
        match field {
            Field::Model => match value.kind {
                Kind::String { escaped } => {
                    let raw = text.get(value.start + 1..value.end - 1).unwrap_or_default();
                    if escaped {
                        scan::unescape(raw, &mut out.model);
                    } else {
                        out.model.push_str(raw);
                    }
                    found.model = Some(value.span());
                }
                _ => return Err(invalid("`model` must be a string.", "model")),
            },
            Field::Stream => {
                out.stream = match value.kind {
                    Kind::True => true,
                    Kind::False | Kind::Null => false,
                    _ => return Err(invalid("`stream` must be a boolean.", "stream")),
                }
            }
            Field::StreamOptions => match (options, value.kind) {
                (Some(options), _) => {
                    if let Some(e) = options.wrong {
                        return Err(e);
                    }
                    out.include_usage = options.include_usage;
                    found.stream_options = Some(StreamOptionsAt::Object {
                        inside: value.start + 1,
                        empty: options.members == 0,
                        include_usage: options.usage,
                    });
                }
                (None, Kind::Null) => {
                    found.stream_options = Some(StreamOptionsAt::Null { span: value.span() })
                }
                _ => {
                    return Err(invalid(
                        "`stream_options` must be an object.",
                        "stream_options",
                    ))
                }
            },
            Field::MaxTokens(param) => {
                if let Some(v) = non_negative_int(text, value, param)? {
                    // When several are given, the tightest cap is the one that binds.
                    out.max_tokens = Some(out.max_tokens.map_or(v, |m| m.min(v)));
                }
            }
            Field::N => out.n = non_negative_int(text, value, "n")?,
            Field::Other => {}
        }
        Ok(())
    }
}

/// What a `stream_options` object's members said.
#[derive(Default)]
struct Options {
    members: usize,
    include_usage: Option<bool>,
    /// `include_usage`'s value's span.
    usage: Option<(usize, usize)>,
    /// A second `include_usage` (upstreams differ on which copy they read, and whether the
    /// client asked for usage decides what it is shown), or one that is not a boolean.
    wrong: Option<InspectError>,
}

/// The `stream_options` object at `s.pos` (a top-level member's value), scanned and read.
fn stream_options(
    s: &mut Scanner<'_>,
    text: &str,
    scratch: &mut String,
) -> Result<(Value, Options), Fault> {
    let start = s.pos;
    s.pos += 1;
    let mut options = Options::default();
    let mut more = s.skip_ws() != Some(b'}');
    if !more {
        s.pos += 1;
    }
    while more {
        let key = s.key()?;
        // Inside the body's object and this one.
        let value = s.value(2)?;
        if options.wrong.is_none() && key_is(text, key, "include_usage", scratch) {
            if options.usage.replace(value.span()).is_some() {
                options.wrong = Some(invalid(
                    "Duplicate key `include_usage` in `stream_options`.",
                    "stream_options",
                ));
            }
            options.include_usage = match value.kind {
                Kind::True => Some(true),
                Kind::False => Some(false),
                Kind::Null => None,
                _ => {
                    options.wrong.get_or_insert_with(|| {
                        invalid(
                            "`stream_options.include_usage` must be a boolean.",
                            "stream_options",
                        )
                    });
                    None
                }
            };
        }
        options.members += 1;
        more = s.next_or_close(b'}')?;
    }
    let value = Value {
        start,
        end: s.pos,
        kind: Kind::Object,
    };
    Ok((value, options))
}

/// Record the key `key` (a top-level member's) in `keys`, decoding it into `decoded` when it
/// is written with escapes.
fn push_key(text: &str, key: Value, decoded: &mut String, keys: &mut Vec<KeyText>) -> KeyText {
    let (start, end) = (key.start + 1, key.end - 1);
    let at = match key.kind {
        Kind::String { escaped: true } => {
            let from = decoded.len();
            scan::unescape(text.get(start..end).unwrap_or_default(), decoded);
            KeyText {
                decoded: true,
                start: from,
                end: decoded.len(),
            }
        }
        _ => KeyText {
            decoded: false,
            start,
            end,
        },
    };
    keys.push(at);
    at
}

fn resolve<'a>(text: &'a str, decoded: &'a str, key: KeyText) -> &'a str {
    let within = if key.decoded { decoded } else { text };
    within.get(key.start..key.end).unwrap_or_default()
}

/// Whether the last of `keys` repeats an earlier one. A few keys compare pairwise, lengths
/// first (most differ there); past [`PAIRWISE`], each key's hash goes into `hashed` (kept
/// across requests, so nothing is allocated once it has grown) and only a hash seen before is
/// compared, lest a body of many keys cost their square.
fn repeats(
    text: &str,
    decoded: &str,
    keys: &[KeyText],
    hashed: &mut std::collections::HashSet<u64>,
) -> bool {
    use std::hash::BuildHasher as _;
    let Some((last, before)) = keys.split_last() else {
        return false;
    };
    let name = resolve(text, decoded, *last);
    let equal = |k: &KeyText| {
        k.end - k.start == last.end - last.start && resolve(text, decoded, *k) == name
    };
    if before.len() < PAIRWISE {
        return before.iter().any(equal);
    }
    if before.len() == PAIRWISE {
        for k in before {
            let h = hashed.hasher().hash_one(resolve(text, decoded, *k));
            hashed.insert(h);
        }
    }
    let h = hashed.hasher().hash_one(name);
    !hashed.insert(h) && before.iter().any(equal)
}

/// Keys compared pairwise for duplicates, at most.
const PAIRWISE: usize = 32;

/// Whether the object key `key` (a scanned string) says `want`.
fn key_is(text: &str, key: Value, want: &str, scratch: &mut String) -> bool {
    let raw = text.get(key.start + 1..key.end - 1).unwrap_or_default();
    match key.kind {
        Kind::String { escaped: true } => {
            scratch.clear();
            scan::unescape(raw, scratch);
            scratch == want
        }
        _ => raw == want,
    }
}

/// The value at `path` (object keys) below `value`, which the scan has validated; the first
/// of duplicate keys.
fn find_path(text: &str, mut value: Value, path: &[String], scratch: &mut String) -> Option<Value> {
    for want in path {
        if value.kind != Kind::Object {
            return None;
        }
        let mut s = Scanner::at(text, value.start + 1);
        if s.skip_ws() == Some(b'}') {
            return None;
        }
        value = loop {
            let key = s.key().ok()?;
            let member = s.value(0).ok()?;
            if key_is(text, key, want, scratch) {
                break member;
            }
            if !s.next_or_close(b'}').ok()? {
                return None;
            }
        };
    }
    Some(value)
}

/// The first (at most) `max` bytes of the prompt's value, as the structural walk before #15
/// cut them: when the member's `,` or `}` (at `after`) is `max` or more bytes past the value's
/// start, the first `max` bytes (whitespace past a shorter value included), else the value.
fn prompt_prefix(value: Value, after: usize, max: usize) -> (usize, usize) {
    if after - value.start >= max {
        (value.start, value.start + max)
    } else {
        value.span()
    }
}

fn non_negative_int(
    text: &str,
    value: Value,
    param: &'static str,
) -> Result<Option<u64>, InspectError> {
    let wrong = || {
        InspectError::new(
            format!("`{param}` must be a non-negative integer."),
            Some(param),
        )
    };
    match value.kind {
        Kind::Int {
            negative: false,
            magnitude,
        } => Ok(Some(magnitude)),
        // `-0` is 0.
        Kind::Int { magnitude: 0, .. } => Ok(Some(0)),
        // JSON has one number type: `1e2` or `100.0` is the integer 100 to most upstreams.
        Kind::Float => match text.get(value.start..value.end).map(str::parse::<f64>) {
            Some(Ok(v)) if v >= 0.0 && v.fract() == 0.0 && v < 1e18 => Ok(Some(v as u64)),
            _ => Err(wrong()),
        },
        Kind::Null => Ok(None),
        _ => Err(wrong()),
    }
}

fn invalid(message: &str, param: &'static str) -> InspectError {
    InspectError::new(message.to_string(), Some(param))
}

fn syntax_error(body: &[u8], fault: Fault) -> InspectError {
    InspectError::new(json_syntax_message(body, fault), None)
}

const PREFIX: &str = "We could not parse the JSON body of your request";

/// What is wrong with a body the scan refused, and where, in words a client can act on.
///
/// Only on the error path: the body is parsed again by serde_json, whose errors say what was
/// expected at which line and column. The byte offset is added because request bodies are
/// mostly one line. What serde_json takes and the scan does not (a number out of range, half a
/// surrogate pair, too deep a nesting) the scan's [`Fault`] names.
fn json_syntax_message(body: &[u8], fault: Fault) -> String {
    if body.iter().all(u8::is_ascii_whitespace) {
        return format!("{PREFIX}: the body is empty; expected a JSON object.");
    }
    // serde_json skips over strings it ignores without checking their UTF-8: check first.
    if let Err(e) = std::str::from_utf8(body) {
        return located(body, e.valid_up_to(), "invalid UTF-8");
    }
    match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        Err(e) => {
            let what = e.to_string();
            // serde_json appends " at line L column C"; say it our way, with the byte offset.
            let what = what
                .rsplit_once(" at line ")
                .map_or(what.as_str(), |(w, _)| w);
            let (line, column, offset) = position(body, e.line(), e.column());
            format!("{PREFIX}: {what} at line {line}, column {column} (byte {offset}).")
        }
        Ok(_) => match fault {
            // As simd-json (the parser before #15) named it and the byte it gave.
            Fault::Number { at } => {
                format!("{PREFIX}: a number is malformed or out of range near byte {at}.")
            }
            Fault::Surrogate { at } => {
                located(body, at, "a \\u escape is an unpaired UTF-16 surrogate")
            }
            Fault::Depth { at } => located(
                body,
                at,
                &format!("objects and arrays nest more than {} deep", scan::MAX_DEPTH),
            ),
            Fault::Syntax { at } => format!("{PREFIX}: malformed JSON near byte {at}."),
        },
    }
}

/// The message for `what` at byte `offset`, located by line and column.
fn located(body: &[u8], offset: usize, what: &str) -> String {
    let before = body.get(..offset).unwrap_or(body);
    let line = 1 + memchr::memchr_iter(b'\n', before).count();
    let line_start = memchr::memrchr(b'\n', before).map_or(0, |i| i + 1);
    format!(
        "{PREFIX}: {what} at line {line}, column {} (byte {offset}).",
        offset - line_start + 1
    )
}

/// serde_json's 1-based line and column as (line, column, 0-based byte offset). Its column 0
/// ("before the first character of the line") becomes the line break that ended the line
/// before, so the position always names a byte of the body.
fn position(body: &[u8], line: usize, column: usize) -> (usize, usize, usize) {
    let line_start = |line: usize| {
        if line <= 1 {
            0
        } else {
            memchr::memchr_iter(b'\n', body)
                .nth(line - 2)
                .map_or(body.len(), |i| i + 1)
        }
    };
    if column == 0 && line > 1 {
        let offset = line_start(line) - 1;
        (line - 1, offset - line_start(line - 1) + 1, offset)
    } else {
        let offset = (line_start(line) + column.saturating_sub(1)).min(body.len());
        (line, column.max(1), offset)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn inspect(body: &str) -> Result<Inspection, InspectError> {
        let mut i = Inspector::default();
        let mut out = Inspection::default();
        i.inspect(body.as_bytes(), &mut out).map(|()| out)
    }

    fn span(body: &str) -> &str {
        let r = inspect(body).unwrap();
        &body[r.model_span.0..r.model_span.1]
    }

    fn syntax_message(body: &str) -> String {
        match inspect(body) {
            Ok(_) => panic!("{body:?} was accepted"),
            Err(e) => e.message,
        }
    }

    #[test]
    fn json_errors_say_what_and_where() {
        let m = syntax_message(r#"{"model":"gpt-4o" "stream":true}"#);
        assert!(
            m.contains("expected `,` or `}` at line 1, column 19 (byte 18)"),
            "{m}"
        );
        let m = syntax_message("{\n  \"model\": \"gpt-4o\",\n  \"n\": tru\n}");
        assert!(m.contains("at line 3, column 11 (byte 33)"), "{m}");
        let m = syntax_message(r#"{"model":"gpt-4o""#);
        assert!(
            m.contains("EOF while parsing an object at line 1, column 17 (byte 16)"),
            "{m}"
        );
        let m = syntax_message("   ");
        assert!(m.contains("the body is empty"), "{m}");
        // No parser's internal names reach the client.
        for bad in [r#"{"a":}"#, "[1,2", "{\"a\":\"\\x\"}", "nul"] {
            let m = syntax_message(bad);
            for internal in [
                "InternalError",
                "ExpectedNull",
                "Syntax",
                "Eof",
                "InvalidUtf8",
            ] {
                assert!(!m.contains(internal), "{bad:?} -> {m}");
            }
            assert!(m.contains("line 1, column"), "{bad:?} -> {m}");
        }
    }

    #[test]
    fn refusals_serde_json_would_not_make_are_located() {
        // simd-json's words and byte for a number out of range, as before #15.
        let m = syntax_message(r#"{"model":"m","x":[18446744073709551616]}"#);
        assert!(
            m.ends_with("a number is malformed or out of range near byte 37."),
            "{m}"
        );
        let m = syntax_message(r#"{"model":"m","x":-1e309}"#);
        assert!(m.ends_with("out of range near byte 17."), "{m}");
        // Half a surrogate pair, at its backslash in the body.
        let m = syntax_message(r#"{"model":"m","x":"abc\ud800"}"#);
        assert!(
            m.ends_with(
                "a \\u escape is an unpaired UTF-16 surrogate at line 1, column 22 (byte 21)."
            ),
            "{m}"
        );
        // As deep as simd-json went and no deeper, at the bracket past the limit.
        let nest = |d: usize| format!(r#"{{"model":"m","x":{}{}}}"#, "[".repeat(d), "]".repeat(d));
        assert_eq!(inspect(&nest(scan::MAX_DEPTH - 1)).unwrap().model, "m");
        let m = syntax_message(&nest(scan::MAX_DEPTH));
        assert!(
            m.ends_with(
                "objects and arrays nest more than 1024 deep at line 1, column 1041 (byte 1040)."
            ),
            "{m}"
        );
    }

    #[test]
    fn a_refused_body_keeps_what_came_before_its_fault() {
        let mut i = Inspector::default();
        let mut out = Inspection::default();
        i.inspect(br#"{"model":"first","n":2}"#, &mut out).unwrap();
        // JSON with a wrong member: the members before it are read (the log shows them).
        let body = br#"{"model":"second","stream":true,"n":"2","max_tokens":5}"#;
        assert!(i.inspect(body, &mut out).is_err());
        assert_eq!(
            (out.model.as_str(), out.stream, out.n),
            ("second", true, None)
        );
        assert_eq!(out.max_tokens, None);
        let body = br#"{"model":"third","model":"fourth"}"#;
        assert!(i.inspect(body, &mut out).is_err());
        assert_eq!(out.model, "third");
        // Not JSON: nothing of it, and nothing left of the request before.
        assert!(i.inspect(br#"{"model":"fifth","n":[}"#, &mut out).is_err());
        assert_eq!(out, Inspection::default());
    }

    #[test]
    fn invalid_utf8_is_located() {
        let mut i = Inspector::default();
        let mut out = Inspection::default();
        let e = i.inspect(b"{\"model\":\"gpt\xff\"}", &mut out).unwrap_err();
        assert!(
            e.message
                .contains("invalid UTF-8 at line 1, column 14 (byte 13)"),
            "{}",
            e.message
        );
    }

    #[test]
    fn reads_top_level_fields() {
        let body = r#"{"messages":[{"role":"user","content":"{\"model\":\"evil\"}"}],"x":{"model":"evil2","y":[1,{"model":3}]},"model" : "gpt-4o" ,"stream":true,"stream_options":{"a":[1,2],"include_usage":true},"max_tokens":100,"n":2}"#;
        let r = inspect(body).unwrap();
        assert_eq!(r.model, "gpt-4o");
        assert!(r.stream);
        assert_eq!(r.include_usage, Some(true));
        assert_eq!(r.max_tokens, Some(100));
        assert_eq!(r.n, Some(2));
        assert_eq!(span(body), r#""gpt-4o""#);
    }

    #[test]
    fn model_first_and_nested_after() {
        let body = r#"{"model":"a","x":{"model":"evil"}}"#;
        assert_eq!(inspect(body).unwrap().model, "a");
        assert_eq!(span(body), r#""a""#);
        let body = "{\n  \"model\"\t:\n \"a\\\"b\"\n}";
        assert_eq!(inspect(body).unwrap().model, "a\"b");
        assert_eq!(span(body), r#""a\"b""#);
    }

    #[test]
    fn escaped_key_is_model() {
        let body = r#"{"\u006dodel":"m1"}"#;
        assert_eq!(inspect(body).unwrap().model, "m1");
        assert_eq!(span(body), r#""m1""#);
        // An escaped duplicate is still a duplicate.
        assert!(inspect(r#"{"model":"a","\u006dodel":"b"}"#)
            .unwrap_err()
            .message
            .contains("Duplicate top-level key `model`"));
    }

    #[test]
    fn rejects() {
        for bad in [
            r#"{"model":"a","model":"b"}"#,
            r#"{"model":"a""#,
            r#"["model"]"#,
            r#"{"messages":[]}"#,
            r#"{"model":5}"#,
            r#"{"model":"a","stream":"yes"}"#,
            r#"{"model":"a","max_tokens":-1}"#,
            r#"{"model":"a","stream_options":{"include_usage":1}}"#,
            "",
        ] {
            assert!(inspect(bad).is_err(), "{bad}");
        }
        let mut i = Inspector::default();
        let mut out = Inspection::default();
        assert!(i.inspect(b"{\"model\":\"\xff\"}", &mut out).is_err());
    }

    #[test]
    fn duplicates_found_past_the_stack_array() {
        let mut keys: Vec<String> = (0..40).map(|i| format!("\"k{i}\":{i}")).collect();
        keys.push("\"model\":\"m\"".into());
        let ok = format!("{{{}}}", keys.join(","));
        assert_eq!(inspect(&ok).unwrap().model, "m");
        keys.push("\"k35\":1".into());
        let dup = format!("{{{}}}", keys.join(","));
        assert!(inspect(&dup).is_err());
        keys.pop();
        keys.push("\"k3\":1".into());
        let dup_early = format!("{{{}}}", keys.join(","));
        assert!(inspect(&dup_early).is_err());
    }

    fn options(body: &str) -> StreamOptionsAt {
        inspect(body).unwrap().stream_options
    }

    #[test]
    fn stream_options_absent_null_or_object() {
        let body = " \n{ \"model\":\"m\",\"stream\":true}";
        let StreamOptionsAt::Absent { insert_at } = options(body) else {
            panic!("{:?}", options(body))
        };
        assert_eq!(&body[..insert_at], " \n{");

        let body = r#"{"model":"m","stream_options" : null ,"stream":true}"#;
        let StreamOptionsAt::Null { span: null } = options(body) else {
            panic!("{:?}", options(body))
        };
        assert_eq!(&body[null.0..null.1], "null");

        let body = r#"{"stream":true,"stream_options":{ },"model":"m"}"#;
        let StreamOptionsAt::Object {
            inside,
            empty,
            include_usage,
        } = options(body)
        else {
            panic!("{:?}", options(body))
        };
        assert_eq!(&body[inside..], " },\"model\":\"m\"}");
        assert!(empty);
        assert_eq!(include_usage, None);

        // `include_usage` after a nested object that has its own `include_usage`, before a
        // top-level key of the same name inside `messages`.
        let body = r#"{"model":"m","stream":true,"stream_options":{"x":{"include_usage":true,"y":[1,{}]},"include_usage" :	false },"messages":[{"include_usage":1}]}"#;
        let r = inspect(body).unwrap();
        assert_eq!(r.include_usage, Some(false));
        let StreamOptionsAt::Object {
            inside,
            empty,
            include_usage: Some(value),
        } = r.stream_options
        else {
            panic!("{:?}", r.stream_options)
        };
        assert!(!empty);
        assert_eq!(&body[inside - 1..inside], "{");
        assert_eq!(&body[value.0..value.1], "false");
        assert_eq!(span(body), r#""m""#);

        for (value, want) in [("null", None), ("true", Some(true))] {
            let body = format!(
                r#"{{"model":"m","stream":true,"stream_options":{{"include_usage":{value}}}}}"#
            );
            let r = inspect(&body).unwrap();
            assert_eq!(r.include_usage, want);
            let StreamOptionsAt::Object {
                include_usage: Some(at),
                ..
            } = r.stream_options
            else {
                panic!("{:?}", r.stream_options)
            };
            assert_eq!(&body[at.0..at.1], value);
        }
    }

    #[test]
    fn stream_options_left_alone_when_not_streaming() {
        let body = r#"{"model":"m","stream_options":{"include_usage":false}}"#;
        assert_eq!(options(body), StreamOptionsAt::default());
        assert_eq!(inspect(body).unwrap().include_usage, Some(false));
    }

    #[test]
    fn stream_options_rejects() {
        for bad in [
            r#"{"model":"m","stream":true,"stream_options":[]}"#,
            r#"{"model":"m","stream":true,"stream_options":"x"}"#,
            r#"{"model":"m","stream":true,"stream_options":true}"#,
            r#"{"model":"m","stream_options":{"include_usage":false,"include_usage":true}}"#,
        ] {
            assert!(inspect(bad).is_err(), "{bad}");
        }
    }

    fn inspect_wanting(body: &str, paths: &[&str], prefix_bytes: usize) -> Inspection {
        let wants = Wants {
            paths: paths
                .iter()
                .map(|p| p.split('.').map(str::to_string).collect())
                .collect(),
            prefix_bytes,
        };
        let mut out = Inspection::default();
        Inspector::default()
            .inspect_for(body.as_bytes(), &wants, &mut out)
            .unwrap();
        out
    }

    #[test]
    fn body_ids_are_read_at_their_paths_only() {
        let body = r#"{"messages":[{"metadata":{"conversation_id":"evil"}}],"model":"m","metadata":{"x":{"conversation_id":"deeper"},"conversation_id":"c-1","n":42,"neg":-7,"f":1.5,"o":{}},"user":"u1"}"#;
        let paths = [
            "metadata.conversation_id",
            "metadata.n",
            "metadata.neg",
            "metadata.f",
            "metadata.o",
            "user",
            "metadata.missing",
            "model.x",
            "metadata.x.conversation_id",
        ];
        let r = inspect_wanting(body, &paths, 0);
        let ids: Vec<Option<&str>> = (0..paths.len()).map(|i| r.body_ids.get(i)).collect();
        assert_eq!(
            ids,
            [
                Some("c-1"),
                Some("42"),
                Some("-7"),
                None,
                None,
                Some("u1"),
                None,
                None,
                Some("deeper")
            ]
        );
        assert_eq!(r.model, "m");
        assert_eq!(r.prompt_prefix, None, "not wanted");
        // Reused: the next body's ids replace the last one's, and none is left over.
        let mut i = Inspector::default();
        let wants = Wants {
            paths: vec![vec!["user".into()]],
            prefix_bytes: 0,
        };
        let mut out = Inspection::default();
        i.inspect_for(br#"{"model":"m","user":"a"}"#, &wants, &mut out)
            .unwrap();
        assert_eq!(out.body_ids.get(0), Some("a"));
        i.inspect_for(br#"{"model":"m"}"#, &wants, &mut out)
            .unwrap();
        assert_eq!(out.body_ids.get(0), None);
        // A value longer than an id is not one (and is not kept).
        let long = "x".repeat(MAX_BODY_ID + 1);
        let body = format!(r#"{{"model":"m","user":"{long}"}}"#);
        i.inspect_for(body.as_bytes(), &wants, &mut out).unwrap();
        assert_eq!(out.body_ids.get(0), None);
        let longest = &long[..MAX_BODY_ID];
        let body = format!(r#"{{"model":"m","user":"{longest}"}}"#);
        i.inspect_for(body.as_bytes(), &wants, &mut out).unwrap();
        assert_eq!(out.body_ids.get(0), Some(longest));
    }

    #[test]
    fn the_prompt_prefix_is_the_start_of_the_messages_text() {
        let body = r#"{"model":"m","messages" : [{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}] ,"n":1}"#;
        let span = |n| {
            let (a, b) = inspect_wanting(body, &[], n).prompt_prefix.unwrap();
            &body[a..b]
        };
        assert_eq!(span(10), r#"[{"role":""#);
        assert_eq!(span(30), r#"[{"role":"system","content":"Y"#);
        // Longer than the array: the whole array, nothing after it.
        let whole =
            r#"[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]"#;
        assert_eq!(span(4096), whole);
        // `input` (Responses) or `prompt` (completions) when there is no `messages`.
        let r = inspect_wanting(r#"{"prompt":"once upon","model":"m"}"#, &[], 64);
        let (a, b) = r.prompt_prefix.unwrap();
        assert_eq!((a, b), (10, 21));
        let r = inspect_wanting(r#"{"input":[1],"model":"m","messages":[2]}"#, &[], 64);
        let (a, b) = r.prompt_prefix.unwrap();
        assert_eq!(&r#"{"input":[1],"model":"m","messages":[2]}"#[a..b], "[2]");
        assert_eq!(
            inspect_wanting(r#"{"model":"m"}"#, &[], 64).prompt_prefix,
            None
        );
    }

    #[test]
    fn scratch_is_reused_across_calls() {
        let mut i = Inspector::default();
        let mut out = Inspection::default();
        i.inspect(br#"{"model":"first","n":1}"#, &mut out).unwrap();
        i.inspect(br#"{"model":"second"}"#, &mut out).unwrap();
        assert_eq!(out.model, "second");
        assert_eq!(out.n, None);
    }
}
