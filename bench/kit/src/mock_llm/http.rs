//! HTTP/1.1 request-side parsing for mock-llm: the request head (httparse), the body framing
//! (Content-Length or chunked) and a small JSON string escaper used by the response builders.
//!
//! Everything works on offsets into the connection's read buffer, so parsing a request does not
//! allocate (the header range list is reused per connection).

use std::ops::Range;

/// Most header fields a request may carry.
pub const MAX_HEADERS: usize = 128;
/// Largest request head accepted (431 beyond).
pub const MAX_HEAD: usize = 64 * 1024;
/// Largest request body accepted (413 beyond).
pub const MAX_BODY: usize = 64 * 1024 * 1024;

/// A parsed request head; all ranges index the buffer it was parsed from.
#[derive(Debug, Clone)]
pub struct Head {
    pub method: Range<usize>,
    pub path: Range<usize>,
    /// HTTP minor version (0 for HTTP/1.0, 1 for HTTP/1.1).
    pub minor: u8,
    /// Length of the head, including the blank line.
    pub len: usize,
    pub content_length: Option<usize>,
    pub chunked: bool,
    pub expect_continue: bool,
    /// The client asked to close (`Connection: close`, or HTTP/1.0 without keep-alive).
    pub wants_close: bool,
}

pub enum HeadParse {
    Done(Head),
    Partial,
    /// Status to answer with (then close), and a reason for the error body.
    Bad(u16, &'static str),
}

fn range_in(buf: &[u8], s: &[u8]) -> Range<usize> {
    let base = buf.as_ptr() as usize;
    match (s.as_ptr() as usize).checked_sub(base) {
        Some(a) if a + s.len() <= buf.len() => a..a + s.len(),
        _ => 0..0,
    }
}

fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

fn parse_usize(v: &[u8]) -> Option<usize> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        v.iter()
            .fold(0usize, |n, &d| n * 10 + usize::from(d - b'0')),
    )
}

/// Parses a request head at the start of `buf`; header (name, value) ranges go to `hdrs`.
pub fn parse_head(buf: &[u8], hdrs: &mut Vec<(Range<usize>, Range<usize>)>) -> HeadParse {
    let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut storage);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return if buf.len() > MAX_HEAD {
                HeadParse::Bad(431, "request head too large")
            } else {
                HeadParse::Partial
            };
        }
        Err(httparse::Error::TooManyHeaders) => {
            return HeadParse::Bad(431, "too many request header fields")
        }
        Err(_) => return HeadParse::Bad(400, "malformed request head"),
    };
    let (Some(method), Some(path), Some(minor)) = (req.method, req.path, req.version) else {
        return HeadParse::Bad(400, "malformed request line");
    };
    let mut head = Head {
        method: range_in(buf, method.as_bytes()),
        path: range_in(buf, path.as_bytes()),
        minor,
        len,
        content_length: None,
        chunked: false,
        expect_continue: false,
        wants_close: minor == 0,
    };
    hdrs.clear();
    let mut te_present = false;
    for h in req.headers.iter() {
        hdrs.push((range_in(buf, h.name.as_bytes()), range_in(buf, h.value)));
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            let Some(n) = parse_usize(h.value) else {
                return HeadParse::Bad(400, "invalid content-length");
            };
            if head.content_length.is_some_and(|m| m != n) {
                return HeadParse::Bad(400, "conflicting content-length");
            }
            head.content_length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            te_present = true;
            head.chunked |= has_token(h.value, "chunked");
        } else if name.eq_ignore_ascii_case(b"expect") {
            head.expect_continue |= h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        } else if name.eq_ignore_ascii_case(b"connection") {
            if has_token(h.value, "close") {
                head.wants_close = true;
            } else if has_token(h.value, "keep-alive") {
                head.wants_close = false;
            }
        }
    }
    if te_present && !head.chunked {
        return HeadParse::Bad(400, "unsupported transfer-encoding");
    }
    if head.content_length.is_some_and(|n| n > MAX_BODY) {
        return HeadParse::Bad(413, "request body too large");
    }
    HeadParse::Done(head)
}

pub enum Chunked {
    /// The whole chunked body (and trailers) took this many bytes.
    Done(usize),
    Partial,
    Bad(u16, &'static str),
}

/// Decodes a chunked body from the start of `buf` into `out` (cleared first).
pub fn decode_chunked(buf: &[u8], out: &mut Vec<u8>) -> Chunked {
    out.clear();
    let mut pos = 0;
    loop {
        let Some(nl) = memchr::memchr(b'\n', &buf[pos..]) else {
            return if buf.len() - pos > 4096 {
                Chunked::Bad(400, "chunk size line too long")
            } else {
                Chunked::Partial
            };
        };
        let line = &buf[pos..pos + nl];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let size_part = match memchr::memchr(b';', line) {
            Some(i) => &line[..i],
            None => line,
        }
        .trim_ascii();
        if size_part.is_empty() || size_part.len() > 15 {
            return Chunked::Bad(400, "invalid chunk size");
        }
        let mut size = 0usize;
        for &c in size_part {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return Chunked::Bad(400, "invalid chunk size"),
            };
            size = size * 16 + usize::from(d);
        }
        pos += nl + 1;
        if size == 0 {
            // Trailer section: header lines up to an empty line.
            loop {
                let Some(nl) = memchr::memchr(b'\n', &buf[pos..]) else {
                    return if buf.len() - pos > MAX_HEAD {
                        Chunked::Bad(431, "trailer section too large")
                    } else {
                        Chunked::Partial
                    };
                };
                let line = &buf[pos..pos + nl];
                pos += nl + 1;
                if line.is_empty() || line == b"\r" {
                    return Chunked::Done(pos);
                }
            }
        }
        if out.len() + size > MAX_BODY {
            return Chunked::Bad(413, "request body too large");
        }
        let avail = buf.len() - pos;
        if avail < size + 1 {
            return Chunked::Partial;
        }
        out.extend_from_slice(&buf[pos..pos + size]);
        pos += size;
        match buf[pos] {
            b'\n' => pos += 1,
            b'\r' => {
                if avail < size + 2 {
                    return Chunked::Partial;
                }
                if buf[pos + 1] != b'\n' {
                    return Chunked::Bad(400, "chunk data not followed by CRLF");
                }
                pos += 2;
            }
            _ => return Chunked::Bad(400, "chunk data not followed by CRLF"),
        }
    }
}

/// Appends `s` as a JSON string literal (quoted, escaped).
pub fn json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f => {
                out.extend_from_slice(&bytes[start..i]);
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(esc);
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// Appends bytes as a JSON string literal, replacing invalid UTF-8 with U+FFFD.
pub fn json_bytes(out: &mut Vec<u8>, b: &[u8]) {
    match std::str::from_utf8(b) {
        Ok(s) => json_str(out, s),
        Err(_) => json_str(out, &String::from_utf8_lossy(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_roundtrip() {
        let mut out = Vec::new();
        let body = b"5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nT: 1\r\n\r\nNEXT";
        match decode_chunked(body, &mut out) {
            Chunked::Done(n) => assert_eq!(&body[n..], b"NEXT"),
            _ => panic!("not done"),
        }
        assert_eq!(out, b"hello world");
        for cut in 0..body.len() - 4 {
            assert!(matches!(
                decode_chunked(&body[..cut], &mut out),
                Chunked::Partial
            ));
        }
        assert!(matches!(
            decode_chunked(b"zz\r\n", &mut out),
            Chunked::Bad(..)
        ));
    }

    #[test]
    fn escapes() {
        let mut out = Vec::new();
        json_str(&mut out, "a\"b\\c\n\u{1}é");
        assert_eq!(out, "\"a\\\"b\\\\c\\n\\u0001é\"".as_bytes());
    }

    #[test]
    fn head() {
        let mut hdrs = Vec::new();
        let req = b"POST /v1/x?q=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc";
        let HeadParse::Done(h) = parse_head(req, &mut hdrs) else {
            panic!("not parsed")
        };
        assert_eq!(&req[h.method], b"POST");
        assert_eq!(&req[h.path], b"/v1/x?q=1");
        assert_eq!(h.content_length, Some(3));
        assert!(h.wants_close);
        assert_eq!(&req[h.len..], b"abc");
        assert_eq!(&req[hdrs[0].0.clone()], b"Host");
        assert!(matches!(
            parse_head(&req[..20], &mut hdrs),
            HeadParse::Partial
        ));
    }
}
