//! The fuzz targets' bodies: each takes arbitrary bytes, runs one parser the way the gateway
//! does on untrusted input, and checks what must hold whatever the input (no panic, bounded
//! output, consistent answers). `fuzz/` (cargo-fuzz, nightly) drives them through libFuzzer with
//! the `fuzz` feature; the test suite replays every committed corpus file through them on
//! stable (the tests below), so a crash once found stays fixed.

use std::mem::MaybeUninit;

use crate::sys::clock::Mono;

use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{parse_request_head, HeadScan, HeadStatus, RequestHead};
use crate::http::response::{parse_response_head, ResponseHead};
use crate::http::{HeaderPos, HttpLimits};
use crate::openai::inspect::{Inspection, Inspector};
use crate::openai::meter::SseMeter;

/// A fuzz target: its name (its files under `fuzz/fuzz_targets/` and `fuzz/seeds/`) and body.
pub type Target = (&'static str, fn(&[u8]));

/// The fuzz targets.
pub const TARGETS: [Target; 7] = [
    ("request_head", request_head),
    ("chunked", chunked),
    ("response_head", response_head),
    ("sse", sse),
    ("json_inspect", json_inspect),
    ("config", config),
    ("translate", translate),
];

const LIMITS: HttpLimits = HttpLimits {
    max_request_line_bytes: 8192,
    max_header_bytes: 32 * 1024,
    max_headers: 100,
    max_body_bytes: 8 * 1024 * 1024,
    max_translated_json_values: 50_000,
};

/// A request head, whole and fed a byte at a time: the same answer either way, and a complete
/// head's ranges within the buffer.
pub fn request_head(data: &[u8]) {
    let mut head = RequestHead::default();
    let whole = parse_request_head(data, &mut HeadScan::default(), &LIMITS, &mut head);
    if let Ok(HeadStatus::Complete) = whole {
        assert!(head.head_len <= data.len());
        let _ = head.path(data);
        let _ = head.target(data);
        // What httparse, which this head reader replaced, makes of the same head.
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; 256];
        let mut req = httparse::Request::new(&mut []);
        let parsed = req.parse_with_uninit_headers(&data[..head.head_len], &mut fields);
        assert_eq!(parsed, Ok(httparse::Status::Complete(head.head_len)));
        assert_eq!(req.path.map(str::as_bytes), Some(head.target(data)));
        assert_eq!(req.version, Some(head.minor_version));
        assert_same_fields(req.headers, &head.headers, data);
    }
    // Incrementally, as bytes trickle in (the scan state carries over between calls).
    let mut scan = HeadScan::default();
    let mut trickled = RequestHead::default();
    let mut last = None;
    for end in 1..=data.len().min(4096) {
        let r = parse_request_head(&data[..end], &mut scan, &LIMITS, &mut trickled);
        let stop = !matches!(r, Ok(HeadStatus::Partial));
        last = Some(r);
        if stop {
            break;
        }
    }
    if data.len() <= 4096 {
        if let (Some(Ok(HeadStatus::Complete)), Ok(HeadStatus::Complete)) = (&last, &whole) {
            assert_eq!(
                trickled.head_len, head.head_len,
                "trickled and whole differ"
            );
        }
    }
}

/// A chunked body, split where the first byte says: decoded bytes never outnumber the input,
/// and the split does not change the result.
pub fn chunked(data: &[u8]) {
    let Some((&split, body)) = data.split_first() else {
        return;
    };
    let step = usize::from(split).max(1);
    let decode = |step: usize| {
        let mut decoder = ChunkedDecoder::default();
        let mut out = Vec::new();
        let mut used_total = 0;
        for piece in body.chunks(step) {
            match decoder.decode(piece, |d| out.extend_from_slice(d)) {
                Ok(used) => {
                    used_total += used;
                    if decoder.is_done() {
                        break;
                    }
                }
                Err(_) => return None,
            }
        }
        assert!(out.len() <= body.len());
        Some((out, used_total, decoder.is_done()))
    };
    let split_result = decode(step);
    let whole = decode(body.len().max(1));
    if let (Some(a), Some(b)) = (&split_result, &whole) {
        if a.2 && b.2 {
            assert_eq!(a.0, b.0, "the split changed the decoded body");
        }
    }
}

/// An upstream response head: a complete head's length within the buffer.
pub fn response_head(data: &[u8]) {
    for head_only in [false, true] {
        let mut head = ResponseHead::default();
        let ours = parse_response_head(data, head_only, &mut head);
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; 128];
        let mut resp = httparse::Response::new(&mut []);
        let theirs = httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut resp,
            data,
            &mut fields,
        );
        match ours {
            Ok(true) => {
                assert!(head.head_len <= data.len());
                // What httparse, which this head reader replaced, makes of the same head.
                assert_eq!(theirs, Ok(httparse::Status::Complete(head.head_len)));
                assert_eq!(resp.code, Some(head.status));
                assert_same_fields(resp.headers, &head.headers, data);
            }
            // Still waiting only where httparse would wait too.
            Ok(false) => assert!(!matches!(theirs, Ok(httparse::Status::Complete(_)))),
            Err(_) => {}
        }
    }
}

/// The fields httparse found are the ones found here, in order.
fn assert_same_fields(theirs: &[httparse::Header<'_>], ours: &[HeaderPos], buf: &[u8]) {
    assert_eq!(theirs.len(), ours.len());
    for (t, o) in theirs.iter().zip(ours) {
        assert_eq!((t.name.as_bytes(), t.value), (o.name(buf), o.value(buf)));
    }
}

/// A response event stream fed in pieces to the splitter and the meter: no panic, and no
/// unbounded growth (the meter's held partial event stays within its cap).
pub fn sse(data: &[u8]) {
    let mut meter = SseMeter::new();
    let now = Mono::now();
    for piece in data.chunks(97) {
        meter.feed(piece, now);
    }
    let _ = meter.summary();
}

/// A request body through the inspector the gateway runs on every proxied request. Its
/// verdict on whether the body is JSON at all is serde_json's, but for the limits the gateway
/// keeps (integers beyond 64 bits) and serde_json's own (nesting past 128 levels, floats within
/// an ulp of `f64::MAX`, which round to it).
pub fn json_inspect(data: &[u8]) {
    let mut inspector = Inspector::default();
    let mut out = Inspection::default();
    let verdict = inspector.inspect(data, &mut out);
    if verdict.is_ok() {
        assert!(out.model.len() <= data.len());
    }
    let refusal = verdict
        .as_ref()
        .err()
        .map(|e| e.message.as_str())
        .filter(|m| m.starts_with("We could not parse the JSON body"));
    match (serde_json::from_slice::<serde_json::Value>(data), refusal) {
        (Ok(_), Some(m)) => assert!(m.contains("a number is malformed or out of range"), "{m}"),
        (Err(e), None) => {
            let what = e.to_string();
            assert!(
                what.starts_with("recursion limit exceeded")
                    || (what.starts_with("number out of range")
                        && number_at(data, e.line(), e.column()).is_some_and(f64::is_finite)),
                "{what}"
            );
        }
        _ => {}
    }
    // The inspector is reused across requests: a second run on the same bytes agrees.
    let mut again = Inspection::default();
    let first = inspector.inspect(data, &mut again).is_ok();
    let mut third = Inspection::default();
    assert_eq!(first, inspector.inspect(data, &mut third).is_ok());
    // What sticky routes ask of a body (session ids at paths, the prompt's prefix) never
    // changes the verdict, and what it finds is bounded by the body.
    let wants = crate::openai::inspect::Wants {
        paths: vec![
            vec!["metadata".into(), "conversation_id".into()],
            vec!["user".into()],
        ],
        prefix_bytes: 64,
    };
    let mut sticky = Inspection::default();
    assert_eq!(
        first,
        inspector.inspect_for(data, &wants, &mut sticky).is_ok()
    );
    if first {
        assert_eq!(sticky.model, out.model);
        for slot in 0..wants.paths.len() {
            if let Some(id) = sticky.body_ids.get(slot) {
                assert!(id.len() <= data.len());
            }
        }
        if let Some((start, end)) = sticky.prompt_prefix {
            assert!(start <= end && end <= data.len() && end - start <= wants.prefix_bytes);
        }
    }
}

/// The number that ends at serde_json's line and column in `data`, correctly rounded.
fn number_at(data: &[u8], line: usize, column: usize) -> Option<f64> {
    let line_start = match line {
        0 | 1 => 0,
        _ => memchr::memchr_iter(b'\n', data).nth(line - 2)? + 1,
    };
    let at = (line_start + column.saturating_sub(1)).min(data.len());
    let is_number = |c: &u8| c.is_ascii_digit() || b".eE+-".contains(c);
    let start = data
        .get(..at)?
        .iter()
        .rposition(|c| !is_number(c))
        .map_or(0, |i| i + 1);
    let end = at + data.get(at..)?.iter().take_while(|c| is_number(c)).count();
    std::str::from_utf8(data.get(start..end)?)
        .ok()?
        .parse()
        .ok()
}

/// A request body to translate between the dialects; the first byte says which way (even: a
/// Messages request for an OpenAI-dialect upstream, odd: a chat request for an Anthropic one)
/// and, in its other bits, a value limit. The body's [`Shape`] counts at least every value
/// serde_json builds of it (keys included; tool-call arguments' too, for a chat request) and at
/// most one a byte (twice that with arguments); counting to a limit stops within one value of
/// it and agrees with the full count on which side of the limit the body is; a body within the
/// gateway's default limit goes through its translator without a panic, and what comes out of
/// a translation that succeeds is JSON.
pub fn translate(data: &[u8]) {
    use crate::openai::anthropic::{bound::Shape, client, upstream};
    let Some((&way, body)) = data.split_first() else {
        return;
    };
    let chat = way & 1 == 1;
    let full = Shape::of(body, chat, usize::MAX);
    if let Ok(tree) = serde_json::from_slice::<serde_json::Value>(body) {
        let (containers, values) = tree_size(&tree);
        assert!(
            full.containers >= containers && full.values >= values,
            "{full:?}"
        );
    }
    let per_byte = if chat { 2 } else { 1 };
    assert!(full.values <= per_byte * body.len(), "{full:?}");
    let limit = usize::from(way >> 1) * 4;
    let cut = Shape::of(body, chat, limit);
    if full.values > limit {
        assert!(
            cut.values > limit && cut.values <= limit + 1,
            "{cut:?} of {full:?}"
        );
    } else {
        assert_eq!(cut, full);
    }
    if full.values > 50_000 {
        return;
    }
    let mut out = Vec::new();
    let translated = if chat {
        let opts = upstream::RequestOptions {
            model: "m",
            default_max_tokens: 16,
        };
        upstream::chat_to_messages(body, &opts, &mut out).is_ok()
    } else {
        client::messages_to_chat(body, "m", &mut out).is_ok()
    };
    if translated {
        assert!(serde_json::from_slice::<serde_json::Value>(&out).is_ok());
    }
}

/// The objects and arrays of a parsed tree, and all its values (object keys counted).
fn tree_size(v: &serde_json::Value) -> (usize, usize) {
    use serde_json::Value;
    let add = |(c, n): (usize, usize), (c2, n2): (usize, usize)| (c + c2, n + n2);
    match v {
        Value::Object(m) => m.values().map(tree_size).fold((1, 1 + m.len()), add),
        Value::Array(a) => a.iter().map(tree_size).fold((1, 1), add),
        _ => (0, 1),
    }
}

/// A config file: loading never panics, whatever it says (environment variables unset).
pub fn config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = crate::config::load_with_warnings(text, &|_| None);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Every committed seed (the minimised corpus, crashes found included) goes through its
    /// target again: a crash once fixed stays fixed.
    #[test]
    fn every_seed_replays_clean() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds");
        let mut replayed = 0;
        for (name, target) in TARGETS {
            let dir = root.join(name);
            let files =
                std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            let mut n = 0;
            for f in files {
                let path = f.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                let outcome = std::panic::catch_unwind(|| target(&data));
                assert!(outcome.is_ok(), "{name}: {} panics", path.display());
                n += 1;
            }
            assert!(n > 0, "{name} has no seeds");
            replayed += n;
        }
        assert!(replayed >= TARGETS.len());
    }
}
