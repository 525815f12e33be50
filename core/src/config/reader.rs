//! The reader: the file's text as a `toml_edit` document that keeps spans, each section read
//! on its own (one bad section does not hide the others' errors), and every error's dotted key
//! path looked up in the document for its line and column.

use std::collections::BTreeMap;

use super::raw::{RawConfig, SECTIONS};
use super::{ConfigError, Position};

/// Read each top-level section, each entry of `clusters` and `pricing` and each element of
/// `routes`, `keys` and `policies` on its own, so that one bad entry does not hide the errors of
/// the others. Unknown keys at every level are errors (`deny_unknown_fields`).
pub(super) fn read_sections(
    table: toml_edit::Table,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> RawConfig {
    let mut raw = RawConfig::default();
    let present: Vec<String> = table.iter().map(|(name, _)| name.to_string()).collect();
    for (name, item) in table {
        let name = name.to_string();
        // A `[table]` as an inline table, an `[[array]]` as an array: one kind of value to read.
        let Ok(value) = item.into_value() else {
            continue;
        };
        let before = errors.len();
        let ok = match name.as_str() {
            "server" => read(value, "server", src, errors).map(|v| raw.server = v),
            "http" => read(value, "http", src, errors).map(|v| raw.http = v),
            "timeouts" => read(value, "timeouts", src, errors).map(|v| raw.timeouts = v),
            "upstream" => read(value, "upstream", src, errors).map(|v| raw.upstream = v),
            "limits" => read(value, "limits", src, errors).map(|v| raw.limits = v),
            "routing" => read(value, "routing", src, errors).map(|v| raw.routing = v),
            "sticky" => read(value, "sticky", src, errors).map(|v| raw.sticky = v),
            "admin" => read(value, "admin", src, errors).map(|v| raw.admin = Some(v)),
            "saturation" => {
                read(value, "saturation", src, errors).map(|v| raw.saturation = Some(v))
            }
            "tls" => read(value, "tls", src, errors).map(|v| raw.tls = Some(v)),
            "access_log" => {
                read(value, "access_log", src, errors).map(|v| raw.access_log = Some(v))
            }
            "clusters" => read_map(value, "clusters", src, errors).map(|v| raw.clusters = v),
            "pricing" => read_map(value, "pricing", src, errors).map(|v| raw.pricing = v),
            "routes" => read_list(value, "routes", src, errors).map(|v| raw.routes = v),
            "keys" => read_list(value, "keys", src, errors).map(|v| raw.keys = v),
            "policies" => read_list(value, "policies", src, errors).map(|v| raw.policies = v),
            _ => {
                let path = key_segment(&name);
                // A misspelled `[clusters]` or `[[routes]]` the file lacks (`[cluster.x]`): the
                // one meant counts as not read, so its absence ("at least one cluster", routes
                // naming its clusters) is not reported as well — one error for one typo. Only
                // those two: marking another section unread would skip checks it still gets.
                if let Some(meant) = nearest(&name, ["clusters", "routes"].into_iter())
                    .filter(|meant| !present.iter().any(|p| p == meant))
                {
                    raw.failed.insert(meant);
                }
                let expected = SECTIONS.map(|s| format!("`{s}`")).join(", ");
                errors.push(ConfigError {
                    position: src.position(&path, Anchor::Key),
                    message: did_you_mean(format!(
                        "unknown field `{name}`, expected one of {expected}"
                    )),
                    path,
                });
                Some(())
            }
        };
        let entries_ok = match name.as_str() {
            "clusters" => raw.clusters.values().all(Option::is_some),
            "pricing" => raw.pricing.values().all(Option::is_some),
            "routes" => raw.routes.iter().all(Option::is_some),
            "keys" => raw.keys.iter().all(Option::is_some),
            "policies" => raw.policies.iter().all(Option::is_some),
            _ => true,
        };
        if let Some(section) = SECTIONS.iter().find(|s| **s == name) {
            if ok.is_none() || !entries_ok {
                raw.failed.insert(*section);
            }
            if errors.len() > before {
                raw.dirty.insert(*section);
            }
        }
    }
    raw
}

/// Deserialize one value, reporting each failure with the full key path of the key at fault.
/// A key that cannot be read is reported and left out, and the rest read again (up to a bound),
/// so a section with a typo still has its other keys read and checked: a left-out key takes its
/// default. `None` when the value cannot be read even so (a required key missing or wrong).
/// (From toml_edit's value, not `toml::Value`: that one hands datetimes over as strings.)
/// A serde message with Rust's type names said plainly: "expected usize" → "expected a whole
/// number ≥ 0", "expected f64" → "expected a number", and so on.
fn plain_types(message: &str) -> String {
    let mut out = message.to_string();
    for (rust, plain) in [
        ("expected usize", "expected a whole number ≥ 0"),
        ("expected u64", "expected a whole number ≥ 0"),
        ("expected u32", "expected a whole number ≥ 0"),
        ("expected u16", "expected a whole number ≥ 0"),
        ("expected u8", "expected a whole number ≥ 0"),
        ("expected i64", "expected a whole number"),
        ("expected i32", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
    ] {
        if let Some(at) = out.find(rust) {
            // Whole words only: `expected u8` must not match `expected u80…`.
            let end = at + rust.len();
            if !out[end..].starts_with(|c: char| c.is_ascii_alphanumeric()) {
                out.replace_range(at..end, plain);
                break;
            }
        }
    }
    out
}

/// serde's "unknown field `limit`, expected one of `…`, `limits`" with the nearest allowed name
/// said: "…; did you mean `limits`?" (one at most two edits away, or one the name starts or ends).
fn did_you_mean(message: String) -> String {
    let Some(rest) = message.strip_prefix("unknown field `") else {
        return message;
    };
    let Some((unknown, allowed)) = rest.split_once('`') else {
        return message;
    };
    match nearest(unknown, allowed.split('`').skip(1).step_by(2)) {
        Some(name) => format!("{message}; did you mean `{name}`?"),
        None => message,
    }
}

/// The allowed name nearest `unknown`: at most two edits away, or one it starts or ends.
fn nearest<'a>(unknown: &str, allowed: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    allowed
        .map(|name| (edits(unknown, name), name))
        .filter(|&(d, name)| d <= 2 || name.starts_with(unknown) || unknown.starts_with(name))
        .min()
        .map(|(_, name)| name)
}

/// Levenshtein distance between two short names.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

pub(super) fn read<T: serde::de::DeserializeOwned>(
    mut value: toml_edit::Value,
    path: &str,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<T> {
    use serde::de::IntoDeserializer as _;
    for _ in 0..64 {
        let e = match serde_path_to_error::deserialize::<_, T>(value.clone().into_deserializer()) {
            Ok(v) => return Some(v),
            Err(e) => e,
        };
        let at: Vec<Segment> = e
            .path()
            .iter()
            .filter_map(|segment| match segment {
                serde_path_to_error::Segment::Seq { index } => Some(Segment::Index(*index)),
                serde_path_to_error::Segment::Map { key }
                | serde_path_to_error::Segment::Enum { variant: key } => {
                    Some(Segment::Key(key.clone()))
                }
                serde_path_to_error::Segment::Unknown => None,
            })
            .collect();
        let mut full = path.to_string();
        for segment in &at {
            match segment {
                Segment::Index(i) => full.push_str(&format!("[{i}]")),
                Segment::Key(k) => {
                    full.push('.');
                    full.push_str(&key_segment(k));
                }
            }
        }
        let message = did_you_mean(plain_types(e.into_inner().message()));
        // An unknown key is pointed at itself; anything else at its value.
        let anchor = if message.starts_with("unknown field") {
            Anchor::Key
        } else {
            Anchor::Value
        };
        let missing = message.starts_with("missing field");
        errors.push(ConfigError {
            position: src.position(&full, anchor),
            path: full,
            message,
        });
        if missing || !leave_out(&mut value, &at) {
            return None;
        }
    }
    None
}

/// Remove the deepest key named in `at` from `value` (for `backends[0].weight`, `weight`; for
/// `seeds[1]`, all of `seeds`, so no index after it shifts). False when there is none.
pub(super) fn leave_out(value: &mut toml_edit::Value, at: &[Segment]) -> bool {
    let Some(last) = at.iter().rposition(|s| matches!(s, Segment::Key(_))) else {
        return false;
    };
    let mut node = value;
    for segment in &at[..last] {
        let next = match (segment, node) {
            (Segment::Key(k), toml_edit::Value::InlineTable(t)) => t.get_mut(k),
            (Segment::Index(i), toml_edit::Value::Array(a)) => a.get_mut(*i),
            _ => None,
        };
        let Some(next) = next else {
            return false;
        };
        node = next;
    }
    match (&at[last], node) {
        (Segment::Key(k), toml_edit::Value::InlineTable(t)) => t.remove(k).is_some(),
        _ => false,
    }
}

/// A table of entries, each read on its own (`None` where it failed).
pub(super) fn read_map<T: serde::de::DeserializeOwned>(
    value: toml_edit::Value,
    path: &str,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<BTreeMap<String, Option<T>>> {
    let toml_edit::Value::InlineTable(entries) = value else {
        // Not a table: let serde say so, in its words.
        read::<BTreeMap<String, serde::de::IgnoredAny>>(value, path, src, errors);
        return None;
    };
    Some(
        entries
            .into_iter()
            .map(|(name, v)| {
                let entry = read(v, &format!("{path}.{}", key_segment(&name)), src, errors);
                (name.to_string(), entry)
            })
            .collect(),
    )
}

/// An array of entries, each read on its own (`None` where it failed), indexes kept.
pub(super) fn read_list<T: serde::de::DeserializeOwned>(
    value: toml_edit::Value,
    path: &str,
    src: &Source,
    errors: &mut Vec<ConfigError>,
) -> Option<Vec<Option<T>>> {
    let toml_edit::Value::Array(elements) = value else {
        read::<Vec<serde::de::IgnoredAny>>(value, path, src, errors);
        return None;
    };
    Some(
        elements
            .into_iter()
            .enumerate()
            .map(|(i, v)| read(v, &format!("{path}[{i}]"), src, errors))
            .collect(),
    )
}

/// A key as one segment of a dotted path: bare when TOML allows it bare, else quoted.
pub(super) fn key_segment(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if bare {
        key.to_string()
    } else {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Segment {
    Key(String),
    Index(usize),
}

/// Split a path as [`key_segment`] and the validators write it: `a.b[0]."c.d"`.
pub(super) fn parse_path(path: &str) -> Vec<Segment> {
    let mut segments = Vec::new();
    let mut chars = path.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '.' => {}
            '[' => {
                let digits: String = chars.by_ref().take_while(|c| *c != ']').collect();
                match digits.parse() {
                    Ok(i) => segments.push(Segment::Index(i)),
                    Err(_) => break,
                }
            }
            '"' => {
                let mut key = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => key.extend(chars.next()),
                        c => key.push(c),
                    }
                }
                segments.push(Segment::Key(key));
            }
            c => {
                let mut key = String::from(c);
                while let Some(&c) = chars.peek() {
                    if c == '.' || c == '[' {
                        break;
                    }
                    key.push(c);
                    chars.next();
                }
                segments.push(Segment::Key(key));
            }
        }
    }
    segments
}

/// `path` is `parent` or a key inside it.
pub(super) fn is_under(path: &str, parent: &str) -> bool {
    path.strip_prefix(parent)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// What an error points at: the key itself (an unknown key) or its value (a wrong value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Anchor {
    Key,
    Value,
}

/// The file's text and its parsed document, which keeps every key's and value's span.
pub(super) struct Source<'a> {
    pub(super) text: &'a str,
    pub(super) doc: toml_edit::ImDocument<&'a str>,
}

/// A step of a walk through the document: tables, arrays of tables, inline tables and arrays.
#[derive(Clone, Copy)]
pub(super) enum Node<'a> {
    Item(&'a toml_edit::Item),
    Table(&'a toml_edit::Table),
    Value(&'a toml_edit::Value),
}

impl<'a> Node<'a> {
    pub(super) fn child(self, key: &str) -> Option<(&'a toml_edit::Key, Node<'a>)> {
        let table: &dyn toml_edit::TableLike = match self {
            Node::Item(item) => item.as_table_like()?,
            Node::Table(table) => table,
            Node::Value(value) => value.as_inline_table()?,
        };
        let (key, item) = table.get_key_value(key)?;
        Some((key, Node::Item(item)))
    }

    pub(super) fn element(self, index: usize) -> Option<Node<'a>> {
        match self {
            Node::Item(toml_edit::Item::ArrayOfTables(tables)) => {
                tables.get(index).map(Node::Table)
            }
            Node::Item(toml_edit::Item::Value(value)) | Node::Value(value) => {
                value.as_array()?.get(index).map(Node::Value)
            }
            _ => None,
        }
    }

    /// A value written after `=` (or in an array); `None` for a `[table]` or `[[array]]`.
    pub(super) fn value_span(self) -> Option<std::ops::Range<usize>> {
        match self {
            Node::Item(toml_edit::Item::Value(value)) | Node::Value(value) => value.span(),
            _ => None,
        }
    }

    pub(super) fn span(self) -> Option<std::ops::Range<usize>> {
        match self {
            Node::Item(item) => item.span(),
            Node::Table(table) => table.span(),
            Node::Value(value) => value.span(),
        }
    }
}

impl Source<'_> {
    /// Where `path` is in the file: its value, or its key for [`Anchor::Key`]; for a path that
    /// is not all there (a missing key), the deepest part of it that is.
    pub(super) fn position(&self, path: &str, anchor: Anchor) -> Option<Position> {
        let mut node = Node::Item(self.doc.as_item());
        let mut key_span = None;
        let mut whole = true;
        let mut found = false;
        for segment in parse_path(path) {
            let next = match &segment {
                Segment::Key(k) => node.child(k).map(|(key, child)| {
                    key_span = key.span();
                    child
                }),
                Segment::Index(i) => node.element(*i).inspect(|_| key_span = None),
            };
            match next {
                Some(next) => {
                    node = next;
                    found = true;
                }
                None => {
                    whole = false;
                    break;
                }
            }
        }
        if !found {
            return None; // Not in the file at all (a section left out).
        }
        let value_span = if whole && anchor == Anchor::Value {
            node.value_span()
        } else {
            None
        };
        let span = value_span.or(key_span).or_else(|| node.span())?;
        Some(position_at(self.text, span.start))
    }
}

/// The line and column of a byte offset in `text`.
pub(super) fn position_at(text: &str, offset: usize) -> Position {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    Position {
        line: before.matches('\n').count() + 1,
        column: before[line_start..].chars().count() + 1,
    }
}
