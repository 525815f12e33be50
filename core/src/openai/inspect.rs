//! Inspect: read the request body's top-level fields that routing, limits and metering act on.
//!
//! Runs after the body is read, before routing. Takes the raw body; returns an [`Inspection`]
//! with the top-level `model` (decoded, so `"\u006dodel"` is `model`), `stream`,
//! `stream_options.include_usage`, the token cap (`max_tokens`, `max_completion_tokens` or
//! `max_output_tokens`), `n`, and the byte span of the model's string literal so the forward phase
//! can splice a mapped name in without touching any other byte; for a streaming request also
//! where `stream_options` sits ([`StreamOptionsAt`]), so the forward phase can ask for usage the
//! same way. The whole document is validated by simd-json (grammar and UTF-8). Raises 400
//! `invalid_request_error` for invalid JSON or UTF-8, a body that is not an object, a duplicate
//! top-level key or a duplicate `stream_options.include_usage` (the upstream might read the other
//! copy), a missing or non-string `model`, or a wrongly typed field above.
//!
//! Only top-level keys count: the tape is walked at depth one, so a `"model"` inside messages or
//! nested objects is never taken, in whatever order it appears.
//!
//! What sticky routing asks of the body, only when some route asks ([`Wants`]), is read in the
//! same pass: the value at each dotted path of object keys (`metadata.conversation_id`: a string
//! or an integer, else nothing — never an error; the first of duplicate nested keys), and the
//! byte span of the start of the prompt (`messages`, else `input`, else `prompt`) for prefix
//! affinity. Nothing is copied but the ids' text, into a buffer the [`Inspection`] keeps.

use simd_json::{Buffers, Node, StaticNode};

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

    fn set(&mut self, slot: usize, value: Node<'_>) {
        use std::fmt::Write as _;
        let start = self.text.len();
        match value {
            // A session id is short; a longer value is not one, and is not kept (the buffer
            // lives as long as the connection).
            Node::String(s) if s.len() > MAX_BODY_ID => return,
            Node::String(s) => self.text.push_str(s),
            Node::Static(StaticNode::U64(v)) => {
                let _ = write!(self.text, "{v}");
            }
            Node::Static(StaticNode::I64(v)) => {
                let _ = write!(self.text, "{v}");
            }
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
    scratch: Vec<u8>,
    buffers: Option<Buffers>,
    tape: Option<simd_json::Tape<'static>>,
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
        // simd-json parses in place (it unescapes strings into its input), so it gets a copy.
        self.scratch.clear();
        self.scratch.extend_from_slice(body);
        let buffers = self
            .buffers
            .get_or_insert_with(|| Buffers::new(body.len().max(4096)));
        let mut tape = match self.tape.take() {
            Some(t) => t.reset(),
            None => simd_json::Tape(Vec::with_capacity(256)),
        };
        let result = match simd_json::fill_tape(&mut self.scratch, buffers, &mut tape) {
            Ok(()) => read_top_level(&tape.0, body, buffers.structural_indexes(), wants, out),
            Err(e) => Err(InspectError::new(json_syntax_message(body, &e), None)),
        };
        self.tape = Some(tape.reset());
        result
    }
}

/// What is wrong with a body simd-json refused, and where, in words a client can act on.
///
/// Only on the error path: the body is parsed again by serde_json, whose errors say what was
/// expected at which line and column (simd-json's say neither: `InternalError`, `Syntax`).
/// The byte offset is added because request bodies are mostly one line.
fn json_syntax_message(body: &[u8], simd_error: &simd_json::Error) -> String {
    const PREFIX: &str = "We could not parse the JSON body of your request";
    if body.iter().all(u8::is_ascii_whitespace) {
        return format!("{PREFIX}: the body is empty; expected a JSON object.");
    }
    // serde_json skips over strings it ignores without checking their UTF-8: check first.
    if let Err(e) = std::str::from_utf8(body) {
        let offset = e.valid_up_to();
        let line = 1 + memchr::memchr_iter(b'\n', &body[..offset]).count();
        let line_start = memchr::memrchr(b'\n', &body[..offset]).map_or(0, |i| i + 1);
        return format!(
            "{PREFIX}: invalid UTF-8 at line {line}, column {} (byte {offset}).",
            offset - line_start + 1
        );
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
        // serde_json accepts what simd-json refused (a number simd-json can't hold, say):
        // name simd-json's reason and where it stopped.
        Ok(_) => format!(
            "{PREFIX}: {} near byte {}.",
            simd_reason(simd_error.error()),
            simd_error.index()
        ),
    }
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

fn simd_reason(kind: &simd_json::ErrorType) -> String {
    use simd_json::ErrorType as E;
    match kind {
        E::InvalidNumber | E::InvalidExponent => "a number is malformed or out of range".into(),
        other => format!("the JSON parser refused it ({other:?})"),
    }
}

fn invalid(message: &str, param: &'static str) -> InspectError {
    InspectError::new(message.to_string(), Some(param))
}

fn read_top_level(
    nodes: &[Node<'_>],
    body: &[u8],
    structurals: &[u32],
    wants: &Wants,
    out: &mut Inspection,
) -> Result<(), InspectError> {
    let Some(&Node::Object { len, .. }) = nodes.first() else {
        return Err(InspectError::new(
            "The request body must be a JSON object.",
            None,
        ));
    };
    // The ids' buffer is kept: no allocation per request once it has grown.
    let mut body_ids = std::mem::take(&mut out.body_ids);
    body_ids.reset(wants.paths.len());
    *out = Inspection {
        body_ids,
        ..Inspection::default()
    };
    // The prompt's key index: `messages`, else `input`, else `prompt` (by rank).
    let mut prompt_at: Option<(u8, usize)> = None;
    let mut model_key_index = None;
    // `stream_options`: its key index, how many keys it has, and which of them is
    // `include_usage` (spans are found after the walk, for streaming requests only).
    let mut options_at: Option<(usize, usize, Option<usize>)> = None;
    let mut options_null_at = None;
    // Keys seen so far, for the duplicate check: a stack array covers ordinary requests
    // without allocating; a body with more top-level keys spills to a hash set.
    let mut seen_small: [&str; 32] = [""; 32];
    let mut seen_large: Option<std::collections::HashSet<&str>> = None;
    let mut idx = 1;
    for key_index in 0..len {
        let Some(Node::String(key)) = nodes.get(idx) else {
            return Err(InspectError::new("malformed JSON object", None));
        };
        let key: &str = key;
        let duplicate = match &mut seen_large {
            Some(set) => !set.insert(key),
            None if key_index < seen_small.len() => {
                let dup = seen_small[..key_index].contains(&key);
                seen_small[key_index] = key;
                dup
            }
            None => {
                let mut set: std::collections::HashSet<&str> = seen_small.iter().copied().collect();
                let dup = !set.insert(key);
                seen_large = Some(set);
                dup
            }
        };
        if duplicate {
            return Err(InspectError::new(
                format!(
                    "Duplicate top-level key `{}` in the request body.",
                    truncate(key, 64)
                ),
                None,
            ));
        }
        let value_idx = idx + 1;
        let value = nodes.get(value_idx).copied();
        idx = value_idx + value.map_or(1, node_span);
        for (slot, path) in wants.paths.iter().enumerate() {
            if path.first().is_some_and(|k| k == key) {
                if let Some(found) = find_path(nodes, value_idx, &path[1..]) {
                    out.body_ids.set(slot, found);
                }
            }
        }
        if wants.prefix_bytes > 0 {
            let rank = match key {
                "messages" => 0,
                "input" => 1,
                "prompt" => 2,
                _ => u8::MAX,
            };
            if rank != u8::MAX && prompt_at.is_none_or(|(r, _)| rank < r) {
                prompt_at = Some((rank, key_index));
            }
        }
        match key {
            "model" => match value {
                Some(Node::String(m)) => {
                    out.model.push_str(m);
                    model_key_index = Some(key_index);
                }
                _ => return Err(invalid("`model` must be a string.", "model")),
            },
            "stream" => {
                out.stream = match value {
                    Some(Node::Static(StaticNode::Bool(b))) => b,
                    Some(Node::Static(StaticNode::Null)) => false,
                    _ => return Err(invalid("`stream` must be a boolean.", "stream")),
                }
            }
            "stream_options" => match value {
                Some(Node::Object { len, .. }) => {
                    let (include_usage, usage_key) = find_include_usage(nodes, value_idx + 1, len)?;
                    out.include_usage = include_usage;
                    options_at = Some((key_index, len, usage_key));
                }
                Some(Node::Static(StaticNode::Null)) => options_null_at = Some(key_index),
                _ => {
                    return Err(invalid(
                        "`stream_options` must be an object.",
                        "stream_options",
                    ))
                }
            },
            "max_tokens" | "max_completion_tokens" | "max_output_tokens" => {
                let param = match key {
                    "max_tokens" => "max_tokens",
                    "max_completion_tokens" => "max_completion_tokens",
                    _ => "max_output_tokens",
                };
                if let Some(v) = non_negative_int(value, param)? {
                    // When several are given, the tightest cap is the one that binds.
                    out.max_tokens = Some(out.max_tokens.map_or(v, |m| m.min(v)));
                }
            }
            "n" => out.n = non_negative_int(value, "n")?,
            _ => {}
        }
    }
    let Some(model_key_index) = model_key_index else {
        return Err(invalid("You must provide a model parameter.", "model"));
    };
    let malformed = || InspectError::new("malformed JSON object", None);
    out.model_span = member_value_span(body, structurals, model_key_index).ok_or_else(malformed)?;
    if let Some((_, key_index)) = prompt_at {
        out.prompt_prefix = member_value_prefix(body, structurals, key_index, wants.prefix_bytes);
    }
    if out.stream {
        out.stream_options = match (options_at, options_null_at) {
            (Some((key_index, len, usage_key)), _) => {
                let (start, _) =
                    member_value_span(body, structurals, key_index).ok_or_else(malformed)?;
                let include_usage = match usage_key {
                    Some(k) => {
                        // The object's own structurals start at its `{`.
                        let at = structurals
                            .binary_search(&(start as u32))
                            .map_err(|_| malformed())?;
                        let inner = structurals.get(at..).ok_or_else(malformed)?;
                        Some(member_value_span(body, inner, k).ok_or_else(malformed)?)
                    }
                    None => None,
                };
                StreamOptionsAt::Object {
                    inside: start + 1,
                    empty: len == 0,
                    include_usage,
                }
            }
            (None, Some(key_index)) => StreamOptionsAt::Null {
                span: member_value_span(body, structurals, key_index).ok_or_else(malformed)?,
            },
            (None, None) => StreamOptionsAt::Absent {
                insert_at: *structurals.first().ok_or_else(malformed)? as usize + 1,
            },
        };
    }
    Ok(())
}

/// The value at `path` (object keys) below the node at `nodes[idx]`; the first of duplicate
/// keys.
fn find_path<'t>(nodes: &[Node<'t>], mut idx: usize, path: &[String]) -> Option<Node<'t>> {
    for key in path {
        let Some(&Node::Object { len, .. }) = nodes.get(idx) else {
            return None;
        };
        let mut at = idx + 1;
        let mut found = None;
        for _ in 0..len {
            let value = nodes.get(at + 1).copied()?;
            if matches!(nodes.get(at), Some(Node::String(k)) if *k == key.as_str()) {
                found = Some(at + 1);
                break;
            }
            at += 1 + node_span(value);
        }
        idx = found?;
    }
    nodes.get(idx).copied()
}

/// Nodes taken by the value starting at this node (itself included).
fn node_span(node: Node<'_>) -> usize {
    match node {
        Node::Object { count, .. } | Node::Array { count, .. } => count + 1,
        _ => 1,
    }
}

/// `include_usage` among the `len` entries of the object whose first key is at `nodes[idx]`: its
/// value, and which entry it is. A second `include_usage` is an error: upstreams differ on which
/// copy they read, and whether the client asked for usage decides what it is shown.
fn find_include_usage(
    nodes: &[Node<'_>],
    mut idx: usize,
    len: usize,
) -> Result<(Option<bool>, Option<usize>), InspectError> {
    let mut found = None;
    let mut key_index = None;
    for i in 0..len {
        let key = nodes.get(idx).copied();
        let value = nodes.get(idx + 1).copied();
        if let (Some(Node::String("include_usage")), Some(value)) = (key, value) {
            if key_index.replace(i).is_some() {
                return Err(invalid(
                    "Duplicate key `include_usage` in `stream_options`.",
                    "stream_options",
                ));
            }
            found = match value {
                Node::Static(StaticNode::Bool(b)) => Some(b),
                Node::Static(StaticNode::Null) => None,
                _ => {
                    return Err(invalid(
                        "`stream_options.include_usage` must be a boolean.",
                        "stream_options",
                    ))
                }
            };
        }
        idx += 1 + value.map_or(1, node_span);
    }
    Ok((found, key_index))
}

fn non_negative_int(
    value: Option<Node<'_>>,
    param: &'static str,
) -> Result<Option<u64>, InspectError> {
    match value {
        Some(Node::Static(StaticNode::U64(v))) => Ok(Some(v)),
        Some(Node::Static(StaticNode::I64(v))) if v >= 0 => Ok(Some(v as u64)),
        // JSON has one number type: `1e2` or `100.0` is the integer 100 to most upstreams.
        Some(Node::Static(StaticNode::F64(v))) if v >= 0.0 && v.fract() == 0.0 && v < 1e18 => {
            Ok(Some(v as u64))
        }
        Some(Node::Static(StaticNode::Null)) => Ok(None),
        _ => Err(InspectError::new(
            format!("`{param}` must be a non-negative integer."),
            Some(param),
        )),
    }
}

/// Byte span of the value of the `key_index`-th key of the object whose `{` is the first of
/// `structurals` (simd-json's stage-1 structural indexes; the whole list for the top level): at
/// depth one, the structural right after the k-th `:` starts the value, and the next depth-one
/// structural (`,` or `}`) ends it, less trailing whitespace.
fn member_value_span(body: &[u8], structurals: &[u32], key_index: usize) -> Option<(usize, usize)> {
    member_value_prefix(body, structurals, key_index, usize::MAX)
}

/// As [`member_value_span`], cut to the value's first `max_len` bytes: the scan stops there, so
/// a long value costs no more than its prefix.
fn member_value_prefix(
    body: &[u8],
    structurals: &[u32],
    key_index: usize,
    max_len: usize,
) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    let mut colons = 0usize;
    let mut value_next = false;
    let mut start = None;
    for &pos in structurals {
        let pos = pos as usize;
        let c = *body.get(pos)?;
        if value_next {
            value_next = false;
            start = Some(pos);
        } else if let Some(s) = start {
            if pos - s >= max_len {
                return Some((s, s + max_len));
            }
            if depth == 1 && (c == b',' || c == b'}') {
                let mut end = pos;
                while end > s && matches!(body[end - 1], b' ' | b'\t' | b'\n' | b'\r') {
                    end -= 1;
                }
                return Some((s, end));
            }
        }
        match c {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    // Past the object's end: no such key in it.
                    return None;
                }
            }
            b':' if depth == 1 && start.is_none() => {
                value_next = colons == key_index;
                colons += 1;
            }
            _ => {}
        }
    }
    None
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
