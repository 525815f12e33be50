//! The one-pass inspector against the simd-json one it replaced ([`super::oracle`]) and against
//! serde_json, on bodies picked by hand, generated, mutated, and the fuzz corpus: the same
//! verdict, fields and message as before, and the same validity as serde_json's but for the
//! limits the gateway has always set (below).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::oracle::Oracle;
use super::{Inspection, Inspector, Wants};

/// What the sticky rules of a config might ask: nothing, ids at paths (escaped keys, numbers,
/// nested objects, keys that are also fixed fields) and a prompt prefix of a few lengths.
fn wants() -> Vec<Wants> {
    let paths = |ps: &[&str]| -> Vec<Vec<String>> {
        ps.iter()
            .map(|p| p.split('.').map(str::to_string).collect())
            .collect()
    };
    vec![
        Wants::default(),
        Wants {
            paths: paths(&[
                "metadata.conversation_id",
                "user",
                "metadata.a.b",
                "model",
                "n",
                "stream_options.include_usage",
                "stream_options.x",
                "metadata.n",
                "messages",
            ]),
            prefix_bytes: 1,
        },
        Wants {
            paths: paths(&["metadata.conversation_id", "user"]),
            prefix_bytes: 16,
        },
        Wants {
            paths: Vec::new(),
            prefix_bytes: 4096,
        },
    ]
}

/// Messages that the one-pass inspector words better than simd-json did: the old one leaked
/// simd-json's error names, and for half a surrogate pair gave a byte counted from the string's
/// start instead of the body's.
fn reworded(old: &str, new: &str) -> bool {
    (old.contains("(InvalidUnicodeCodepoint)") && new.contains("unpaired UTF-16 surrogate"))
        || (old.contains("(DepthLimitExceeded)") && new.contains("nest more than 1024 deep"))
}

struct Checker {
    wants: Vec<Wants>,
    reused: Inspector,
    oracle: Oracle,
    checked: usize,
    valid: usize,
}

impl Checker {
    fn new() -> Checker {
        Checker {
            wants: wants(),
            reused: Inspector::default(),
            oracle: Oracle::default(),
            checked: 0,
            valid: 0,
        }
    }

    fn check(&mut self, body: &[u8]) {
        self.checked += 1;
        let mut first_verdict = None;
        for (i, wants) in self.wants.iter().enumerate() {
            let mut old = Inspection::default();
            let old_verdict = self.oracle.inspect_for(body, wants, &mut old);
            // A fresh inspector and one reused across every body checked so far agree.
            let mut new = Inspection::default();
            let new_verdict = Inspector::default().inspect_for(body, wants, &mut new);
            let mut again = Inspection {
                model: "left over".into(),
                n: Some(9),
                ..Inspection::default()
            };
            let again_verdict = self.reused.inspect_for(body, wants, &mut again);
            let shown = String::from_utf8_lossy(body);
            assert_eq!(
                new_verdict, again_verdict,
                "reuse changed the verdict: {shown:?}"
            );
            match (&old_verdict, &new_verdict) {
                (Ok(()), Ok(())) => {
                    assert_eq!(old, new, "fields differ, wants {i}: {shown:?}");
                    assert_eq!(new, again, "reuse changed the fields: {shown:?}");
                }
                (Err(o), Err(n)) => assert!(
                    o == n || (o.param == n.param && reworded(&o.message, &n.message)),
                    "errors differ, wants {i}: {shown:?}\n old: {o:?}\n new: {n:?}"
                ),
                _ => panic!(
                    "verdicts differ, wants {i}: {shown:?}\n old: {old_verdict:?}\n new: {new_verdict:?}"
                ),
            }
            // Refused, the fields read before the first wrong member are kept (the access log
            // and metrics show them): as before for a body that is JSON; none for one that is
            // not (before, whatever the last request on the connection had left).
            let slots = wants.paths.len();
            assert_eq!(
                view(&old, slots),
                view(&new, slots),
                "fields differ, wants {i}: {shown:?}"
            );
            assert_eq!(
                view(&new, slots),
                view(&again, slots),
                "reuse changed the fields: {shown:?}"
            );
            first_verdict.get_or_insert(new_verdict);
        }
        let Some(verdict) = first_verdict else {
            return;
        };
        // Validity against serde_json: a body is JSON to the inspector unless it says it could
        // not parse it.
        let ours = match &verdict {
            Ok(()) => true,
            Err(e) => !e.message.starts_with(super::PREFIX),
        };
        self.valid += usize::from(ours);
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(_) if !ours => {
                // The gateway refuses integers beyond 64 bits (serde_json makes them floats).
                let message = verdict.err().map(|e| e.message).unwrap_or_default();
                assert!(
                    message.contains("a number is malformed or out of range"),
                    "serde_json takes what we refuse: {:?}: {message}",
                    String::from_utf8_lossy(body)
                );
            }
            // serde_json stops at 128 levels; the gateway, as before, at 1024. And serde_json
            // (without its `float_roundtrip`) finds floats within an ulp of f64::MAX out of
            // range, which round to it.
            Err(e) if ours => assert!(
                e.to_string().starts_with("recursion limit exceeded")
                    || (e.to_string().starts_with("number out of range")
                        && rounds_to_finite(body, e.line(), e.column())),
                "serde_json refuses what we take ({e}): {:?}",
                String::from_utf8_lossy(body)
            ),
            _ => {}
        }
    }
}

/// Whether the number serde_json stopped in (at its line and column) is finite, correctly
/// rounded.
fn rounds_to_finite(body: &[u8], line: usize, column: usize) -> bool {
    let (_, _, at) = super::position(body, line, column);
    let is_number = |c: &u8| c.is_ascii_digit() || b".eE+-".contains(c);
    let start = body[..at]
        .iter()
        .rposition(|c| !is_number(c))
        .map_or(0, |i| i + 1);
    let end = at + body[at..].iter().take_while(|c| is_number(c)).count();
    let literal = std::str::from_utf8(&body[start..end]).unwrap();
    literal.parse::<f64>().unwrap().is_finite()
}

/// Everything an inspection holds, the ids by slot (an unread inspection has no slots).
fn view(i: &Inspection, slots: usize) -> String {
    let ids: Vec<Option<&str>> = (0..slots).map(|slot| i.body_ids.get(slot)).collect();
    format!(
        "{:?} {:?} {} {:?} {:?} {:?} {:?} {:?} {ids:?}",
        i.model,
        i.model_span,
        i.stream,
        i.include_usage,
        i.max_tokens,
        i.n,
        i.stream_options,
        i.prompt_prefix
    )
}

/// Bodies that probe one rule each: RFC 8259's grammar, the ranges, the fields' types.
fn hand_picked() -> Vec<Vec<u8>> {
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    let mut add = |b: &[u8]| bodies.push(b.to_vec());
    let fixed: &[&[u8]] = &[
        b"",
        b" ",
        b"\t\r\n ",
        b"\x0c",
        b"{}",
        b"[]",
        b"null",
        b"\"model\"",
        b"12",
        b"-",
        b"{",
        b"}",
        b"{\"model\"",
        b"{\"model\":",
        b"{\"model\":\"m\"",
        b"{\"model\":\"m\",",
        b"{\"model\":\"m\"}",
        b"{\"model\":\"m\"} ",
        b"{\"model\":\"m\"}x",
        b"{\"model\":\"m\"}{}",
        b"{\"model\":\"m\"}\x00",
        b"\xef\xbb\xbf{\"model\":\"m\"}",
        b"{\"model\":\"m\",}",
        b"{\"model\":\"m\",,\"n\":1}",
        b"{,\"model\":\"m\"}",
        b"{\"model\" \"m\"}",
        b"{\"model\"::\"m\"}",
        b"{model:\"m\"}",
        b"{'model':'m'}",
        b"{\"model\":\"m\"\"n\":1}",
        b"{\"model\":\"m\" \"n\":1}",
        b"{\"model\":\"m\",\"x\":[1,]}",
        b"{\"model\":\"m\",\"x\":[,1]}",
        b"{\"model\":\"m\",\"x\":[1 2]}",
        b"{\"model\":\"m\",\"x\":{\"a\"}}",
        b"{\"model\":\"m\",\"x\":{\"a\":1,}}",
        b"{\"model\":\"m\",\"x\":[}",
        b"{\"model\":\"m\",\"x\":{]}",
        b"{\"model\":\"m\",\"x\":tru}",
        b"{\"model\":\"m\",\"x\":truex}",
        b"{\"model\":\"m\",\"x\":nul}",
        b"{\"model\":\"m\",\"x\":nulll}",
        b"{\"model\":\"m\",\"x\":False}",
        b"{\"model\":\"m\",\"x\":NaN}",
        b"{\"model\":\"m\",\"x\":Infinity}",
        b"{\"model\":\"m\",\"x\":undefined}",
        // Whitespace: only space, tab, line feed and carriage return.
        b" \t\r\n{ \t\r\n\"model\" \t\r\n: \t\r\n\"m\" \t\r\n, \"n\" : 1 \t\r\n} \t\r\n",
        b"{\"model\":\"m\",\x0c\"n\":1}",
        b"{\"model\":\"m\",\x0b\"n\":1}",
        b"{\"model\":\"m\",\xc2\xa0\"n\":1}",
        b"{\"model\":\"m\",\x00\"n\":1}",
        // Strings: control characters, escapes, UTF-8.
        b"{\"model\":\"a\nb\"}",
        b"{\"model\":\"a\tb\"}",
        b"{\"model\":\"a\x00b\"}",
        b"{\"model\":\"a\x1fb\"}",
        b"{\"model\":\"a\x7fb\"}",
        b"{\"model\":\"a\\nb\\t\\r\\b\\f\\/\\\\\\\"\"}",
        b"{\"model\":\"a\\x\"}",
        b"{\"model\":\"a\\'\"}",
        b"{\"model\":\"a\\\"}",
        b"{\"model\":\"a\\",
        b"{\"model\":\"\\u0041\\u00e9\\u4e2d\\uFFFF\\u0000\"}",
        b"{\"model\":\"\\u004\"}",
        b"{\"model\":\"\\u00G1\"}",
        b"{\"model\":\"\\U0041\"}",
        b"{\"model\":\"\\u\"}",
        b"{\"model\":\"\\ud83d\\ude00\"}",
        b"{\"model\":\"\\uD83D\\uDE00\"}",
        b"{\"model\":\"\\ud83d\"}",
        b"{\"model\":\"\\ud83dx\"}",
        b"{\"model\":\"\\ude00\"}",
        b"{\"model\":\"\\ude00\\ud83d\"}",
        b"{\"model\":\"\\ud83d\\ud83d\"}",
        b"{\"model\":\"\\ud83d\\u0041\"}",
        b"{\"model\":\"\\ud83d\\n\"}",
        b"{\"model\":\"\\ud83d\\\\ude00\"}",
        b"{\"model\":\"\\ud83d\\uZZZZ\"}",
        b"{\"model\":\"\\ud83d\\ude0\"}",
        b"{\"model\":\"m\",\"x\":\"\\udfff\"}",
        b"{\"model\":\"m\",\"x\":[\"ok\",\"\\udbff\\udfff\",\"\\ud800\"]}",
        b"{\"model\":\"m\",\"\\ud800\":1}",
        b"{\"model\":\"\xff\"}",
        b"{\"model\":\"\xc3\"}",
        b"{\"model\":\"\xc3\xa9\"}",
        b"{\"model\":\"\xe4\xb8\xad\"}",
        b"{\"model\":\"\xf0\x9f\x98\x80\"}",
        b"{\"model\":\"\xed\xa0\x80\"}",
        b"{\"model\":\"\xc0\xaf\"}",
        b"{\"model\":\"\xf4\x90\x80\x80\"}",
        b"{\"model\":\"m\"}\xff",
        // Keys: escapes decode before they are compared.
        b"{\"\\u006dodel\":\"m1\"}",
        b"{\"mod\\u0065l\":\"m1\",\"model\":\"m2\"}",
        b"{\"model\":\"m\",\"\\u006e\":2}",
        b"{\"model\":\"m\",\"\\\"\":1,\"\\u0022\":2}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include\\u005fusage\":true}}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\":true,\"include\\u005fusage\":false}}",
        b"{\"model\":\"m\",\"\\u0073tream_options\":{\"include_usage\":false},\"stream\":true}",
        // Duplicates against wrong values: the first wrong member names the error.
        b"{\"model\":\"a\",\"model\":\"b\"}",
        b"{\"model\":5,\"model\":\"b\"}",
        b"{\"model\":\"a\",\"model\":5}",
        b"{\"n\":-1,\"model\":\"a\",\"model\":\"b\"}",
        b"{\"model\":\"a\",\"n\":1,\"n\":-1}",
        b"{\"model\":\"a\",\"n\":-1,\"n\":1}",
        b"{\"stream\":1,\"x\":1,\"x\":2}",
        b"{\"x\":1,\"x\":2,\"stream\":1}",
        b"{\"x\":1,\"x\":2,\"model\":\"m\",\"y\":[1,}",
        b"{\"model\":\"m\",\"stream_options\":{\"include_usage\":1,\"include_usage\":true}}",
        b"{\"model\":\"m\",\"stream_options\":{\"include_usage\":true,\"include_usage\":1}}",
        b"{\"model\":\"m\",\"stream_options\":{\"include_usage\":true},\"stream_options\":{\"include_usage\":true,\"include_usage\":true}}",
        b"{\"stream_options\":{\"include_usage\":\"yes\"},\"model\":1}",
        b"{\"messages\":[]}",
        b"{\"model\":null}",
        b"{\"model\":[\"m\"]}",
        b"{\"model\":{\"x\":1}}",
        b"{\"model\":\"\"}",
        // Fields' types.
        b"{\"model\":\"m\",\"stream\":null}",
        b"{\"model\":\"m\",\"stream\":false}",
        b"{\"model\":\"m\",\"stream\":0}",
        b"{\"model\":\"m\",\"stream\":\"true\"}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":null}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\" : null }",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{}}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{ \n }}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"a\":{\"include_usage\":1},\"include_usage\":null}}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\" : true  }}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":[]}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":false}",
        b"{\"model\":\"m\",\"stream\":false,\"stream_options\":{\"include_usage\":true}}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\":true,}}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\":tru}}",
        b"{\"model\":\"m\",\"stream\":true,\"stream_options\":{\"include_usage\":true}",
        // Numbers: the grammar, the range, and what counts as an integer.
        b"{\"model\":\"m\",\"n\":1.}",
        b"{\"model\":\"m\",\"n\":.5}",
        b"{\"model\":\"m\",\"n\":01}",
        b"{\"model\":\"m\",\"n\":-01}",
        b"{\"model\":\"m\",\"n\":00}",
        b"{\"model\":\"m\",\"n\":+1}",
        b"{\"model\":\"m\",\"n\":-}",
        b"{\"model\":\"m\",\"n\":--1}",
        b"{\"model\":\"m\",\"n\":1e}",
        b"{\"model\":\"m\",\"n\":1e+}",
        b"{\"model\":\"m\",\"n\":1E-}",
        b"{\"model\":\"m\",\"n\":1.e5}",
        b"{\"model\":\"m\",\"n\":1.5.5}",
        b"{\"model\":\"m\",\"n\":1e5e5}",
        b"{\"model\":\"m\",\"n\":0x10}",
        b"{\"model\":\"m\",\"n\":1_000}",
        b"{\"model\":\"m\",\"n\":1x}",
        b"{\"model\":\"m\",\"n\":0}",
        b"{\"model\":\"m\",\"n\":-0}",
        b"{\"model\":\"m\",\"n\":-0.0}",
        b"{\"model\":\"m\",\"n\":0.0}",
        b"{\"model\":\"m\",\"n\":0e0}",
        b"{\"model\":\"m\",\"n\":-0e-0}",
        b"{\"model\":\"m\",\"n\":1e2}",
        b"{\"model\":\"m\",\"n\":1E+2}",
        b"{\"model\":\"m\",\"n\":100.0}",
        b"{\"model\":\"m\",\"n\":100.5}",
        b"{\"model\":\"m\",\"n\":1.5e1}",
        b"{\"model\":\"m\",\"n\":-1}",
        b"{\"model\":\"m\",\"n\":-1.0}",
        b"{\"model\":\"m\",\"n\":1e17}",
        b"{\"model\":\"m\",\"n\":1e18}",
        b"{\"model\":\"m\",\"n\":999999999999999999.0}",
        b"{\"model\":\"m\",\"n\":999999999999999999.4}",
        b"{\"model\":\"m\",\"n\":99999999999999999.9}",
        b"{\"model\":\"m\",\"n\":0.99999999999999999999}",
        b"{\"model\":\"m\",\"n\":123456789012345678}",
        b"{\"model\":\"m\",\"n\":1234567890123456789}",
        b"{\"model\":\"m\",\"n\":18446744073709551615}",
        b"{\"model\":\"m\",\"n\":18446744073709551616}",
        b"{\"model\":\"m\",\"n\":99999999999999999999}",
        b"{\"model\":\"m\",\"n\":184467440737095516150}",
        b"{\"model\":\"m\",\"n\":-9223372036854775807}",
        b"{\"model\":\"m\",\"n\":-9223372036854775808}",
        b"{\"model\":\"m\",\"n\":-9223372036854775809}",
        b"{\"model\":\"m\",\"n\":-18446744073709551615}",
        b"{\"model\":\"m\",\"n\":-18446744073709551616}",
        b"{\"model\":\"m\",\"n\":-99999999999999999999}",
        b"{\"model\":\"m\",\"x\":[1e308,1.7976931348623157e308,-1.7976931348623157e308]}",
        b"{\"model\":\"m\",\"x\":1.7976931348623158e308}",
        b"{\"model\":\"m\",\"x\":1.7976931348623159e308}",
        b"{\"model\":\"m\",\"x\":1.797693134862315807e308}",
        b"{\"model\":\"m\",\"x\":1.797693134862315808e308}",
        b"{\"model\":\"m\",\"x\":17976931348623158e292}",
        b"{\"model\":\"m\",\"x\":17976931348623159e292}",
        b"{\"model\":\"m\",\"x\":0.17976931348623159e309}",
        b"{\"model\":\"m\",\"x\":1e309}",
        b"{\"model\":\"m\",\"x\":-1e309}",
        b"{\"model\":\"m\",\"x\":1e400}",
        b"{\"model\":\"m\",\"x\":-1e400}",
        b"{\"model\":\"m\",\"x\":1e-400}",
        b"{\"model\":\"m\",\"x\":2.4703282292062327e-324}",
        b"{\"model\":\"m\",\"x\":4.9e-324}",
        b"{\"model\":\"m\",\"x\":0e99999999999999999999}",
        b"{\"model\":\"m\",\"x\":0.000e400}",
        b"{\"model\":\"m\",\"x\":1e99999999999999999999}",
        b"{\"model\":\"m\",\"x\":1e-99999999999999999999}",
        b"{\"model\":\"m\",\"x\":0.0000000001e318}",
        b"{\"model\":\"m\",\"x\":0.0000000001e319}",
        b"{\"model\":\"m\",\"x\":0.0000000001e320}",
        b"{\"model\":\"m\",\"x\":100000000000000000000000000000e280}",
        b"{\"model\":\"m\",\"x\":100000000000000000000000000000e279}",
        b"{\"model\":\"m\",\"x\":12345678901234567890123.5}",
        b"{\"model\":\"m\",\"x\":[18446744073709551616, 1e400]}",
        b"{\"model\":\"m\",\"x\":[1e400, 18446744073709551616]}",
        b"{\"model\":\"m\",\"x\":[1e400, \"\\ud800\"]}",
        b"{\"model\":\"m\",\"x\":[\"\\ud800\", 1e400]}",
        b"{\"model\":\"m\",\"x\":[1e400, 1 2]}",
        b"{\"model\":\"m\",\"max_tokens\":10,\"max_completion_tokens\":5,\"max_output_tokens\":7}",
        b"{\"model\":\"m\",\"max_tokens\":null,\"max_completion_tokens\":5}",
        b"{\"model\":\"m\",\"max_output_tokens\":\"5\"}",
        b"{\"model\":\"m\",\"max_completion_tokens\":-5}",
        b"{\"model\":\"m\",\"max_tokens\":2.5e1}",
        // Sticky ids and the prompt.
        b"{\"model\":\"m\",\"user\":\"u\",\"metadata\":{\"conversation_id\":\"c\",\"conversation_id\":\"d\"}}",
        b"{\"model\":\"m\",\"user\":42,\"metadata\":{\"conversation_id\":-0,\"n\":-42,\"a\":{\"b\":\"\\u00e9\\n\"}}}",
        b"{\"model\":\"m\",\"user\":1.5,\"metadata\":{\"conversation_id\":true,\"a\":[{\"b\":1}]}}",
        b"{\"model\":\"m\",\"user\":null,\"metadata\":[],\"messages\":[1 , 2]  ,\"prompt\":\"p\"}",
        b"{\"model\":\"m\",\"metadata\":{\"con\\u0076ersation_id\":\"esc\"},\"input\":\"i\"   }",
        b"{\"model\":\"m\",\"metadata\":{\"conversation_id\":{\"x\":1}},\"prompt\":[1,2,3]}",
        b"{\"model\":\"m\",\"metadata\":{ },\"messages\" : \"abc\"\n}",
        b"{\"model\":\"m\",\"metadata\":null,\"input\":{}, \"messages\":[] }",
    ];
    for b in fixed {
        add(b);
    }
    // Ids at the length limit, plain and escaped.
    for len in [255, 256, 257] {
        let plain = "x".repeat(len);
        add(format!(r#"{{"model":"m","user":"{plain}"}}"#).as_bytes());
        let escaped = "\\u0078".repeat(len);
        add(format!(r#"{{"model":"m","user":"{escaped}"}}"#).as_bytes());
        let mixed = format!("{}\\n", "x".repeat(len - 1));
        add(format!(r#"{{"model":"m","metadata":{{"conversation_id":"{mixed}"}}}}"#).as_bytes());
    }
    // Nesting around serde_json's limit and the gateway's, at the root and in a member.
    for depth in [127, 128, 129, 1022, 1023, 1024, 1025, 1100] {
        for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
            let nest = |d: usize| format!("{}1{}", open.repeat(d), close.repeat(d));
            add(nest(depth).as_bytes());
            add(format!(r#"{{"model":"m","x":{}}}"#, nest(depth - 1)).as_bytes());
            add(format!(r#"{{"model":"m","x":{},"y":1e400}}"#, nest(depth - 1)).as_bytes());
            add(format!(
                r#"{{"model":"m","x":{}}}"#,
                nest(depth - 1).replace('1', "\"\\ud800\"")
            )
            .as_bytes());
            add(format!(
                r#"{{"model":"m","stream_options":{{"x":{}}}}}"#,
                nest(depth - 2)
            )
            .as_bytes());
            add(format!(r#"{{"model":"m","x":{}"#, open.repeat(depth)).as_bytes());
        }
    }
    // Many top-level keys, past the pairwise duplicate check.
    for n in [31, 32, 33, 40, 100] {
        let mut keys: Vec<String> = (0..n).map(|i| format!("\"k{i}\":{i}")).collect();
        keys.push("\"model\":\"m\"".into());
        add(format!("{{{}}}", keys.join(",")).as_bytes());
        keys.push("\"k\\u0030\":0".into());
        add(format!("{{{}}}", keys.join(",")).as_bytes());
        keys.insert(n / 2, "\"n\":-1".into());
        add(format!("{{{}}}", keys.join(",")).as_bytes());
        keys.remove(n / 2);
        keys.push("\"n\":-1".into());
        add(format!("{{{}}}", keys.join(",")).as_bytes());
    }
    bodies
}

/// A small deterministic generator (xorshift64*), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        crate::sys::rand::xorshift64star(&mut self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

const KEYS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "include_usage",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "messages",
    "input",
    "prompt",
    "metadata",
    "conversation_id",
    "user",
    "a",
    "b",
    "x",
    "\\u006dodel",
    "inc\\u006cude_usage",
    "",
    "\\\"",
];

const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "7",
    "42",
    "256",
    "0.5",
    "-0.0",
    "100.0",
    "1e2",
    "1E2",
    "1e+2",
    "1e-2",
    "2.5e1",
    "1e18",
    "9e17",
    "123456789012345678",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "1e308",
    "1e309",
    "1.7976931348623157e308",
    "1.7976931348623159e308",
    "1e-400",
    "0e500",
];

const STRINGS: &[&str] = &[
    "",
    "gpt-4o",
    "m",
    "hello world",
    "a\\nb",
    "\\\"q\\\"",
    "\\\\",
    "\\/",
    "\\b\\f\\r\\t",
    "\\u0041",
    "\\u00e9",
    "\\ud83d\\ude00",
    "\\ud83d",
    "\\ude00",
    "é中😀",
    "{\\\"model\\\":\\\"evil\\\"}",
];

/// A random JSON value, `depth` levels at most, built of what request bodies hold.
fn value(rng: &mut Rng, depth: usize, out: &mut String) {
    let ws = |rng: &mut Rng, out: &mut String| {
        if rng.chance(20) {
            out.push_str(rng.pick(&[" ", "\n", "\t", "\r\n", "  "]));
        }
    };
    match rng.below(if depth == 0 { 6 } else { 8 }) {
        0 | 1 => {
            out.push('"');
            out.push_str(rng.pick(STRINGS));
            if rng.chance(30) {
                out.push_str(rng.pick(STRINGS));
            }
            out.push('"');
        }
        2 => out.push_str(rng.pick(NUMBERS)),
        3 => {
            let n = rng.next() % 1_000_000;
            out.push_str(&n.to_string());
        }
        4 => out.push_str(rng.pick(&["true", "false", "null"])),
        5 => {
            // A float of random digits: its value must come out as simd-json's.
            let digits = 1 + rng.below(25);
            for i in 0..digits {
                let d = rng.below(10);
                let d = if i == 0 { d.max(1) } else { d };
                out.push(char::from(b'0' + d as u8));
                if i == 0 && rng.chance(50) {
                    out.push('.');
                    out.push(char::from(b'0' + rng.below(10) as u8));
                }
            }
            if rng.chance(40) {
                out.push('e');
                out.push_str(rng.pick(&["", "-", "+"]));
                out.push_str(&rng.below(330).to_string());
            }
        }
        6 => {
            out.push('[');
            let n = rng.below(4);
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                value(rng, depth - 1, out);
                ws(rng, out);
            }
            out.push(']');
        }
        _ => {
            out.push('{');
            let n = rng.below(4);
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                ws(rng, out);
                out.push('"');
                out.push_str(rng.pick(KEYS));
                out.push('"');
                ws(rng, out);
                out.push(':');
                ws(rng, out);
                value(rng, depth - 1, out);
            }
            out.push('}');
        }
    }
}

/// A request-like body: a top-level object of the inspector's keys (and others), some of
/// them repeated, with values of every kind.
fn body(rng: &mut Rng) -> String {
    let mut out = String::new();
    if rng.chance(10) {
        out.push(' ');
    }
    out.push('{');
    let n = rng.below(8);
    for i in 0..n {
        if i > 0 {
            out.push(',');
        }
        if rng.chance(10) {
            out.push(' ');
        }
        let key = rng.pick(KEYS);
        out.push('"');
        out.push_str(key);
        out.push('"');
        out.push_str(rng.pick(&[":", ": ", " : "]));
        match key {
            "model" if rng.chance(70) => {
                out.push('"');
                out.push_str(rng.pick(STRINGS));
                out.push('"');
            }
            "stream" if rng.chance(70) => out.push_str(rng.pick(&["true", "false", "null"])),
            "stream_options" if rng.chance(70) => {
                out.push('{');
                let members = rng.below(3);
                for j in 0..members {
                    if j > 0 {
                        out.push(',');
                    }
                    out.push_str(rng.pick(&[
                        "\"include_usage\":true",
                        "\"include_usage\":false",
                        "\"include_usage\":null",
                        "\"include_usage\" : 1",
                        "\"x\":{\"include_usage\":2}",
                        "\"inc\\u006cude_usage\":true",
                    ]));
                }
                out.push('}');
            }
            _ => value(rng, 3, &mut out),
        }
    }
    out.push('}');
    if rng.chance(10) {
        out.push('\n');
    }
    out
}

/// `body` with one random fault: a byte cut, added, replaced or the end cut off.
fn mutate(rng: &mut Rng, body: &[u8]) -> Vec<u8> {
    const BYTES: &[u8] =
        b"{}[]:,\"\\ \t\n\r\x00\x01\x0c\x1f\x7f0123456789.-+eEtrufalsn\xc3\xa9\xff\xed";
    let mut b = body.to_vec();
    let at = rng.below(b.len() + 1);
    match rng.below(4) {
        0 if at < b.len() => {
            b.remove(at);
        }
        1 => b.insert(at, rng.pick(BYTES)),
        2 if at < b.len() => b[at] = rng.pick(BYTES),
        _ => b.truncate(at),
    }
    b
}

/// Tokens strung at random: mostly not JSON, so the grammar's every corner is tried.
fn soup(rng: &mut Rng) -> Vec<u8> {
    const TOKENS: &[&[u8]] = &[
        b"{",
        b"}",
        b"[",
        b"]",
        b":",
        b",",
        b"\"",
        b"\\",
        b" ",
        b"\n",
        b"\"model\"",
        b"\"x\"",
        b"\"m\"",
        b"\"stream_options\"",
        b"\"include_usage\"",
        b"\"\\ud800\"",
        b"\"\\u00e9\"",
        b"\"\\n\"",
        b"1",
        b"-",
        b"0",
        b"-0",
        b".5",
        b"e5",
        b"1e400",
        b"18446744073709551616",
        b"true",
        b"false",
        b"null",
        b"nul",
        b"\x01",
        b"\xc3\xa9",
        b"\xff",
    ];
    let mut out = if rng.chance(70) {
        b"{\"model\":\"m\",".to_vec()
    } else {
        Vec::new()
    };
    for _ in 0..rng.below(12) {
        out.extend_from_slice(rng.pick(TOKENS));
    }
    out
}

#[test]
fn hand_picked_bodies_agree() {
    let mut c = Checker::new();
    for body in hand_picked() {
        c.check(&body);
    }
    assert!(
        c.valid > 50 && c.valid < c.checked,
        "{} of {}",
        c.valid,
        c.checked
    );
}

#[test]
fn every_prefix_of_a_body_agrees() {
    let mut c = Checker::new();
    let body = br#" {"model" : "gpt-\u00e9\"4o" , "stream":true,"stream_options":{"include_usage":null, "x":[1,2.5e-3,{"y":null}]},"max_tokens":1e2,"n":-0,"metadata":{"conversation_id":"c\ud83d\ude00","n":-12},"user":18446744073709551615,"messages":[{"role":"user","content":"a\nb\"c\"\\d"}],"input":[true,false,null]}"#;
    for end in 0..=body.len() {
        c.check(&body[..end]);
    }
}

#[test]
fn generated_and_mutated_bodies_agree() {
    let mut c = Checker::new();
    let mut rng = Rng(0x5eed_1e55_0f00_d15c);
    for _ in 0..4000 {
        let b = body(&mut rng);
        c.check(b.as_bytes());
        for _ in 0..3 {
            let m = mutate(&mut rng, b.as_bytes());
            c.check(&m);
        }
    }
    // Both kinds well represented.
    assert!(
        c.valid > c.checked / 5 && c.valid < c.checked * 4 / 5,
        "{} of {}",
        c.valid,
        c.checked
    );
}

#[test]
fn token_soup_agrees() {
    let mut c = Checker::new();
    let mut rng = Rng(0x0dd_ba11_cafe_f00d);
    for _ in 0..20_000 {
        c.check(&soup(&mut rng));
    }
    assert!(c.valid > 100, "{} of {}", c.valid, c.checked);
}

#[test]
fn the_fuzz_seeds_agree() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/json_inspect");
    let mut c = Checker::new();
    for f in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(f.unwrap().path()).unwrap();
        c.check(&data);
    }
    // The minimised seeds: one input per coverage edge set (392 when they were cut).
    assert!(c.checked > 300, "{}", c.checked);
}
