//! The inspector as it was before #15 (item 2): simd-json's tape over a padded copy of the body,
//! walked at depth one. Kept for tests only, as the oracle the one-pass scanner is compared
//! against (`super::differential`): same verdicts, same fields, same messages.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use simd_json::{Buffers, Node, StaticNode};

use super::{
    invalid, position, BodyIds, InspectError, Inspection, StreamOptionsAt, Wants, MAX_BODY_ID,
    PREFIX,
};
use crate::openai::json::truncate;

/// Per-worker scratch space, reused across requests so inspection allocates nothing in the
/// steady state.
#[derive(Default)]
pub(super) struct Oracle {
    scratch: Vec<u8>,
    buffers: Option<Buffers>,
    tape: Option<simd_json::Tape<'static>>,
}

impl Oracle {
    /// Inspect `body`, also reading what `wants` asks.
    pub(super) fn inspect_for(
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

fn simd_reason(kind: &simd_json::ErrorType) -> String {
    use simd_json::ErrorType as E;
    match kind {
        E::InvalidNumber | E::InvalidExponent => "a number is malformed or out of range".into(),
        other => format!("the JSON parser refused it ({other:?})"),
    }
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
                    set(&mut out.body_ids, slot, found);
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

fn set(ids: &mut BodyIds, slot: usize, value: Node<'_>) {
    use std::fmt::Write as _;
    let start = ids.text.len();
    match value {
        // A session id is short; a longer value is not one, and is not kept (the buffer
        // lives as long as the connection).
        Node::String(s) if s.len() > MAX_BODY_ID => return,
        Node::String(s) => ids.text.push_str(s),
        Node::Static(StaticNode::U64(v)) => {
            let _ = write!(ids.text, "{v}");
        }
        Node::Static(StaticNode::I64(v)) => {
            let _ = write!(ids.text, "{v}");
        }
        _ => return,
    }
    if let (Some(span), Ok(start), Ok(end)) = (
        ids.spans.get_mut(slot),
        u32::try_from(start),
        u32::try_from(ids.text.len()),
    ) {
        *span = Some((start, end));
    }
}
