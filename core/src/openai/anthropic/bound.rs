//! What translating a request may cost, known before any of it is built.
//!
//! Runs when an attempt is about to translate a client's request for an upstream of the other
//! dialect. [`Shape::of`] takes the client's body and counts, without building anything, the
//! JSON values the translators would build a tree of — with, for a chat completion request,
//! the values inside each tool call's `arguments` string, which the translation parses too.
//! [`Shape::working_memory`] turns that into the most the translation can hold at once
//! (the parsed tree, the body it writes, the request around it). The caller refuses a shape of
//! more values than it allows and holds the working memory from the worker's body budget while
//! the translation runs; nothing here raises an error.
//!
//! Why: the translators parse into `serde_json::Value`, where a 27-byte text block becomes a
//! map node of several hundred bytes. A body of a quarter of a million tiny blocks made a
//! worker hold 47 times the body and spend a second on it (Hostile clients II, item 4).

use memchr::{memchr, memchr2};

/// Bytes a parsed object or array may take besides its members (a map's node is ~630 bytes).
const PER_CONTAINER: usize = 1536;
/// Bytes any parsed value may take: its slot in its parent, a string's allocation rounded up,
/// what the written body spends on it.
const PER_VALUE: usize = 128;
/// Times the body: the strings parsed out of it, the translated body, and that body copied
/// into the upstream request behind its head.
const BODY_TIMES: usize = 3;

/// The JSON values of a body the translation would build, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Objects and arrays.
    pub(crate) containers: usize,
    /// Every value: objects, arrays, strings (object keys too), numbers, `true`, `false`,
    /// `null`.
    pub(crate) values: usize,
}

impl Shape {
    /// The shape of `body`, counted until it has more than `at_most` values (a body refused
    /// for its count is not read to its end); with `arguments`, the values inside each string
    /// under an `"arguments"` key are counted too (a chat request's tool calls carry their
    /// input as a JSON text there). Invalid JSON is counted as far as it goes: the
    /// translation's own parse refuses it.
    pub(crate) fn of(body: &[u8], arguments: bool, at_most: usize) -> Shape {
        let mut scan = Scan {
            shape: Shape::default(),
            after_separator: true,
            arguments,
            arguments_key: false,
            arguments_value: false,
            at_most,
        };
        scan.run(body);
        scan.shape
    }

    /// The most memory translating a body of `body_len` bytes and this shape holds at once.
    /// A unit test checks it against what the translators allocate for shapes chosen to cost
    /// the most per byte.
    pub(crate) fn working_memory(self, body_len: usize) -> usize {
        BODY_TIMES
            .saturating_mul(body_len)
            .saturating_add(self.containers.saturating_mul(PER_CONTAINER))
            .saturating_add(self.values.saturating_mul(PER_VALUE))
    }
}

/// The counting state across the body.
struct Scan {
    shape: Shape,
    /// The last byte outside strings and whitespace opened a value's place (`[`, `{`, `,`,
    /// `:`, or the start): a number or literal starting here is a value.
    after_separator: bool,
    /// Count inside `"arguments"` strings.
    arguments: bool,
    /// The last thing seen was the string `"arguments"` (a key, if a `:` follows).
    arguments_key: bool,
    /// The last things seen were the key `"arguments"` and its `:`: a string here is its value.
    arguments_value: bool,
    /// Stop once more values than this are counted.
    at_most: usize,
}

impl Scan {
    fn run(&mut self, json: &[u8]) {
        let mut at = 0;
        while at < json.len() && self.shape.values <= self.at_most {
            let rest = json.get(at..).unwrap_or_default();
            let Some(quote) = memchr(b'"', rest) else {
                self.structure(rest);
                return;
            };
            self.structure(rest.get(..quote).unwrap_or_default());
            if self.shape.values > self.at_most {
                return;
            }
            let start = at + quote;
            let end = string_end(json, start + 1);
            self.string(json.get(start..end).unwrap_or_default());
            at = end;
        }
    }

    /// Bytes outside strings.
    fn structure(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                continue;
            }
            if self.shape.values > self.at_most {
                return;
            }
            self.arguments_value = b == b':' && self.arguments_key;
            self.arguments_key = false;
            match b {
                b'{' | b'[' => {
                    self.shape.containers += 1;
                    self.shape.values += 1;
                    self.after_separator = true;
                }
                b',' | b':' => self.after_separator = true,
                b'}' | b']' => self.after_separator = false,
                _ => {
                    if self.after_separator {
                        self.shape.values += 1;
                    }
                    self.after_separator = false;
                }
            }
        }
    }

    /// One string literal, quotes included (the closing one missing at the body's end).
    fn string(&mut self, literal: &[u8]) {
        self.shape.values += 1;
        if self.arguments_value && self.shape.values <= self.at_most {
            // The arguments' own values: counted in the decoded text, which the translation
            // parses.
            if let Ok(text) = serde_json::from_slice::<String>(literal) {
                let left = self.at_most.saturating_sub(self.shape.values);
                let inner = Shape::of(text.as_bytes(), false, left);
                self.shape.containers += inner.containers;
                self.shape.values += inner.values;
            }
        }
        self.arguments_value = false;
        // The key as the translator sees it, decoded: `"argu\u006dents"` is `arguments` too.
        self.arguments_key = self.arguments
            && (literal == b"\"arguments\""
                || (memchr(b'\\', literal).is_some()
                    && serde_json::from_slice::<String>(literal).is_ok_and(|k| k == "arguments")));
        self.after_separator = false;
    }
}

/// The index just past the string literal whose contents start at `from` (after its opening
/// quote): past its closing quote, or the body's end.
fn string_end(json: &[u8], mut from: usize) -> usize {
    while let Some(i) = json.get(from..).and_then(|rest| memchr2(b'"', b'\\', rest)) {
        if json.get(from + i) == Some(&b'"') {
            return from + i + 1;
        }
        from += i + 2; // an escape: its next byte is never the closing quote
    }
    json.len()
}

#[cfg(test)]
mod tests {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    use super::*;
    use crate::openai::anthropic::{client, upstream};

    /// The unit tests' allocator: the system's, counting each thread's live bytes and their
    /// peak, so a test can see what one call holds at most.
    struct Counting;

    thread_local! {
        static LIVE: Cell<usize> = const { Cell::new(0) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    // SAFETY: every call goes to `System` unchanged; the counters are const-initialized
    // thread-locals without destructors, so touching them never allocates.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let _ = LIVE.try_with(|live| {
                let now = live.get() + layout.size();
                live.set(now);
                let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
            });
            // SAFETY: the caller's contract for `alloc`, passed on.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(layout.size())));
            // SAFETY: the caller's contract for `dealloc`, passed on.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// The most `f` held at once beyond what was live when it started.
    fn peak_of(f: impl FnOnce()) -> usize {
        let start = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(start));
        f();
        PEAK.with(Cell::get) - start
    }

    fn repeat(item: &str, n: usize) -> String {
        vec![item; n].join(",")
    }

    /// An object of `n` members, each a one-member object: a map node per few bytes.
    fn wide_object(n: usize) -> String {
        let members: Vec<String> = (0..n).map(|i| format!(r#""k{i}":{{"a":1}}"#)).collect();
        format!("{{{}}}", members.join(","))
    }

    #[test]
    fn counting_stops_past_the_most_asked_for() {
        let body = format!("[{}]", repeat("1", 1_000));
        // Within one run of structure, and across strings.
        let some = Shape::of(body.as_bytes(), false, 10);
        assert!(some.values > 10 && some.values < 1_000, "{some:?}");
        assert_eq!(Shape::of(body.as_bytes(), false, 2_000).values, 1_001);
        let body = format!("[{}]", repeat(r#""s""#, 1_000));
        let some = Shape::of(body.as_bytes(), false, 10);
        assert!(some.values > 10 && some.values < 1_000, "{some:?}");
        // Inside arguments too.
        let body = format!(r#"{{"arguments": "[{}]"}}"#, repeat("1", 1_000));
        let some = Shape::of(body.as_bytes(), true, 10);
        assert!(some.values > 10 && some.values < 1_000, "{some:?}");
    }

    #[test]
    fn shapes_are_counted_as_the_parser_would_build_them() {
        let cases: &[(&str, bool, usize, usize)] = &[
            ("{}", false, 1, 1),
            ("[1, 2.5, -3, true, false, null]", false, 1, 7),
            (r#"{"a": "x", "b": [1, {"c": null}]}"#, false, 3, 9),
            // Escapes never end a string; structure inside strings is not counted.
            (r#"["a\"b,c:{[", "\\", "d"]"#, false, 1, 4),
            // The arguments' own values, with `arguments` counting only.
            (r#"{"arguments": "{\"x\": [1, 2]}"}"#, false, 1, 3),
            (r#"{"arguments": "{\"x\": [1, 2]}"}"#, true, 3, 8),
            // `"arguments"` as a value, or an arguments value that is not a string.
            (r#"["arguments", "[1, 2]"]"#, true, 1, 3),
            (r#"{"arguments": {"x": 1}}"#, true, 2, 5),
            // An escaped key is the same key to the translator, so it is counted the same.
            (r#"{"argu\u006dents": "{\"x\": [1, 2]}"}"#, true, 3, 8),
            // Cut short, or not JSON: counted as far as it goes, never a panic.
            (r#"{"a": "unterminated \"#, false, 1, 3),
            (r#"{"a": "x\"#, true, 1, 3),
            ("\\\"", false, 0, 2),
        ];
        for &(json, arguments, containers, values) in cases {
            assert_eq!(
                Shape::of(json.as_bytes(), arguments, usize::MAX),
                Shape { containers, values },
                "{json} (arguments: {arguments})"
            );
        }
    }

    /// Messages requests shaped to cost the most per byte: tiny blocks, tiny turns, deep and
    /// wide tool inputs and schemas, many stop sequences.
    fn messages_bodies() -> Vec<String> {
        let turn = |content: &str| format!(r#"{{"role":"user","content":{content}}}"#);
        let wrap = |messages: String, extra: &str| {
            format!(r#"{{"model":"m","max_tokens":8,{extra}"messages":[{messages}]}}"#)
        };
        let tool_use = |input: &str| {
            format!(
                r#"{{"role":"assistant","content":[{{"type":"tool_use","id":"t","name":"f","input":{input}}}]}}"#
            )
        };
        let block = r#"{"type":"text","text":"x"}"#;
        vec![
            wrap(turn(&format!("[{}]", repeat(block, 20_000))), ""),
            wrap(repeat(&turn(r#""x""#), 20_000), ""),
            wrap(tool_use(&wide_object(10_000)), ""),
            wrap(
                tool_use(&format!(r#"{{"a":[{}]}}"#, repeat("0", 40_000))),
                "",
            ),
            wrap(
                turn(r#""x""#),
                &format!(
                    r#""tools":[{}],"#,
                    repeat(
                        r#"{"name":"f","input_schema":{"type":"object","properties":{"a":{"type":"string"}}}}"#,
                        3_000
                    )
                ),
            ),
            wrap(
                turn(r#""x""#),
                &format!(r#""stop_sequences":[{}],"#, repeat(r#""s""#, 40_000)),
            ),
            wrap(
                turn(r#""x""#),
                &format!(r#""system":[{}],"#, repeat(block, 20_000)),
            ),
        ]
    }

    /// Chat requests shaped the same way, and tool-call arguments full of small values.
    fn chat_bodies() -> Vec<String> {
        let wrap = |messages: String, extra: &str| {
            format!(r#"{{"model":"m",{extra}"messages":[{messages}]}}"#)
        };
        let user = |content: &str| format!(r#"{{"role":"user","content":{content}}}"#);
        let call = |arguments: &str| {
            format!(
                r#"{{"role":"assistant","tool_calls":[{{"id":"c","type":"function","function":{{"name":"f","arguments":{}}}}}]}}"#,
                serde_json::Value::String(arguments.to_owned())
            )
        };
        let part = r#"{"type":"text","text":"x"}"#;
        vec![
            wrap(user(&format!("[{}]", repeat(part, 20_000))), ""),
            wrap(repeat(&user(r#""x""#), 20_000), ""),
            wrap(call(&format!(r#"{{"a":[{}]}}"#, repeat("0", 40_000))), ""),
            wrap(call(&wide_object(10_000)), ""),
            wrap(
                user(r#""x""#),
                &format!(
                    r#""tools":[{}],"#,
                    repeat(
                        r#"{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"string"}}}}}"#,
                        3_000
                    )
                ),
            ),
            wrap(
                user(r#""x""#),
                &format!(r#""stop":[{}],"#, repeat(r#""s""#, 40_000)),
            ),
        ]
    }

    /// What each translator holds at most is within [`Shape::working_memory`], with a quarter
    /// to spare for the production allocator's rounding, for every costly shape.
    #[test]
    fn the_working_memory_bound_holds_for_the_costliest_shapes() {
        let check = |body: &str, arguments: bool, translate: &dyn Fn(&[u8], &mut Vec<u8>)| {
            let bound =
                Shape::of(body.as_bytes(), arguments, usize::MAX).working_memory(body.len());
            let started = std::time::Instant::now();
            let held = peak_of(|| {
                let mut out = Vec::new();
                translate(body.as_bytes(), &mut out);
                assert!(!out.is_empty(), "{}", &body[..200.min(body.len())]);
                // The request around it: the body copied behind the head.
                let mut request = Vec::new();
                request.extend_from_slice(&out);
            });
            eprintln!(
                "{held:>10} held, bound {bound:>10}, body {:>8}, {:?}",
                body.len(),
                started.elapsed()
            );
            assert!(
                held + held / 4 <= bound,
                "held {held} for a body of {} bytes, bound {bound}: {}",
                body.len(),
                &body[..200.min(body.len())]
            );
        };
        for body in messages_bodies() {
            check(&body, false, &|b, out| {
                client::messages_to_chat(b, "m", out).unwrap();
            });
        }
        let opts = upstream::RequestOptions {
            model: "m",
            default_max_tokens: 8,
        };
        for body in chat_bodies() {
            check(&body, true, &|b, out| {
                upstream::chat_to_messages(b, &opts, out).unwrap();
            });
        }
    }
}
