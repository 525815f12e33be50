//! JSON text helpers shared by everything that writes or quotes JSON by hand (error bodies, the
//! model list, a mapped model name spliced into a request): no parsing here, see
//! [`super::inspect`] for that.

use std::fmt::Write;

/// `s` cut to at most `max` bytes, at a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Append `v` as a JSON string literal.
pub(crate) fn push_json_string(out: &mut String, v: &str) {
    let _ = write_json_string(out, v);
}

/// Write `v` as a JSON string literal to any text sink — a buffer, or a counter that only
/// adds up lengths. Runs of characters that need no escape go out as one slice.
pub(crate) fn write_json_string<W: Write>(out: &mut W, v: &str) -> std::fmt::Result {
    out.write_char('"')?;
    let mut run = 0;
    // Every character that needs an escape is ASCII, so byte positions are char boundaries.
    for (i, b) in v.bytes().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            b if b < 0x20 => "",
            _ => continue,
        };
        out.write_str(&v[run..i])?;
        if escape.is_empty() {
            write!(out, "\\u{:04x}", b)?;
        } else {
            out.write_str(escape)?;
        }
        run = i + 1;
    }
    out.write_str(&v[run..])?;
    out.write_char('"')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_are_escaped_and_parse_back() {
        let cases = [
            "",
            "plain",
            "a\"b\\c",
            "line\nfeed\r\t",
            "\u{1}\u{1f}x",
            "héllo ✓ \u{7f}",
        ];
        for v in cases {
            let mut s = String::new();
            push_json_string(&mut s, v);
            let back: String = serde_json::from_str(&s).unwrap_or_default();
            assert_eq!(back, v, "{s}");
        }
        let mut s = String::new();
        push_json_string(&mut s, "q\"\u{2}");
        assert_eq!(s, r#""q\"\u0002""#);
    }
}
