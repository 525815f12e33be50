//! Client request heads, parsed strictly (RFC 9112).
//!
//! Called by the connection loop each time bytes arrive until a head is complete. Takes the
//! connection's read buffer and a [`HeadScan`] that remembers how far the line-ending check got
//! (so a byte-at-a-time slowloris costs linear, not quadratic, work). Returns
//! [`HeadStatus::Partial`] or fills a [`RequestHead`]. Raises 400 (malformed, smuggling
//! ingredients: CL with TE, bad or conflicting CL, codings other than `chunked`, bare CR / LF,
//! obs-fold, NUL / CR / LF in values, whitespace before a colon, missing Host), 414 (request line
//! too long), 431 (head too large, too many fields) and 417 (an `Expect` other than
//! `100-continue`). Every one of these closes the connection.

use super::lines::{LineError, Lines, RequestLine};
use super::{has_token, parse_content_length, trim_ows, BodyFraming, HeaderPos};
use super::{HttpError, HttpLimits};
use super::{Name, CHUNKED, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};

const HOST: Name = Name::new(b"host");
const EXPECT: Name = Name::new(b"expect");
const HUNDRED_CONTINUE: Name = Name::new(b"100-continue");

/// Hard ceiling on header fields parsed at once; `http.max_headers` is checked against the
/// count below it.
pub(crate) const MAX_HEADERS_CEILING: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    Get,
    Head,
    Post,
    Other,
}

/// A parsed request head. Ranges point into the connection's read buffer.
#[derive(Debug)]
pub(crate) struct RequestHead {
    pub(crate) method: Method,
    /// Request target (path and query).
    pub(crate) target: (usize, usize),
    /// Where the target's path ends (its `?`, or the target's end): found once here, since a
    /// request asks for its path about seven times (routing, dialect, forwarding, the log).
    path_end: usize,
    pub(crate) minor_version: u8,
    /// Bytes of the head including the final CRLF CRLF.
    pub(crate) head_len: usize,
    pub(crate) headers: Vec<HeaderPos>,
    pub(crate) body: BodyFraming,
    pub(crate) keep_alive: bool,
    pub(crate) expect_continue: bool,
    /// A `Connection` field names headers for this hop only ([`super::names_options`]).
    pub(crate) connection_options: bool,
}

impl Default for RequestHead {
    fn default() -> Self {
        RequestHead {
            method: Method::Other,
            target: (0, 0),
            path_end: 0,
            minor_version: 1,
            head_len: 0,
            headers: Vec::new(),
            body: BodyFraming::None,
            keep_alive: true,
            expect_continue: false,
            connection_options: false,
        }
    }
}

impl RequestHead {
    pub(crate) fn target<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.target.0..self.target.1]
    }
    /// The path without the query string.
    pub(crate) fn path<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.target.0..self.path_end]
    }
}

/// Progress of the line-ending scan over a head that has not fully arrived.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HeadScan {
    scanned: usize,
    request_line_end: Option<usize>,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeadStatus {
    Partial,
    Complete,
}

/// Scan `buf` (which starts at the first byte of a request) for a complete, valid head.
pub(crate) fn parse_request_head(
    buf: &[u8],
    scan: &mut HeadScan,
    limits: &HttpLimits,
    head: &mut RequestHead,
) -> Result<HeadStatus, HttpError> {
    parse_head(buf, scan, limits, head, true)
}

/// [`parse_request_head`]; `read_whole: false` takes the scan's way for every head (the
/// tests hold the two ways to the same answers).
fn parse_head(
    buf: &[u8],
    scan: &mut HeadScan,
    limits: &HttpLimits,
    head: &mut RequestHead,
    read_whole: bool,
) -> Result<HeadStatus, HttpError> {
    let Some((line, head_len)) = read_lines(buf, scan, limits, head, read_whole)? else {
        return Ok(HeadStatus::Partial);
    };
    if head.headers.len() > limits.max_headers {
        return Err(HttpError::limit(431, "too many header fields"));
    }
    read_request_line(buf, &line, head_len, head)?;
    let fields = read_fields(buf, head)?;
    head.body = fields.body(line.minor_version)?;
    if let BodyFraming::Length(n) = head.body {
        if n > limits.max_body_bytes as u64 {
            return Err(HttpError::limit(413, "request body too large"));
        }
    }
    Ok(HeadStatus::Complete)
}

/// The head's lines, once it is all there: its request line and length, its fields in
/// `head.headers`, its size checked against `limits`. `None` while it is partial.
#[inline(always)]
fn read_lines(
    buf: &[u8],
    scan: &mut HeadScan,
    limits: &HttpLimits,
    head: &mut RequestHead,
    read_whole: bool,
) -> Result<Option<(RequestLine, usize)>, HttpError> {
    // A head that is whole the first time it is looked at (nearly every request's, in one
    // read) is read once, its line endings checked by the reader as it goes. Any other —
    // partial, or with something the reader in that mode refuses — is scanned for its line
    // endings first: the scan keeps a trickled head at linear cost, and it and the checks that
    // follow it word every refusal. Both ways give a head the same reading.
    let whole = match scan.scanned {
        0 if read_whole => read_whole_head(buf, head),
        _ => None,
    };
    match whole {
        Some((line, head_len)) => {
            scan.request_line_end = Some(line.fields_at - 2);
            scan.scanned = head_len;
            check_head_size(scan, head_len, limits)?;
            Ok(Some((line, head_len)))
        }
        None => scan_and_read_head(buf, scan, limits, head),
    }
}

/// The request line `line` (of a head `head_len` bytes long) into `head`: its method, its
/// target (origin form only, else 400) and version; the flags its fields set start over.
#[inline(always)]
fn read_request_line(
    buf: &[u8],
    line: &RequestLine,
    head_len: usize,
    head: &mut RequestHead,
) -> Result<(), HttpError> {
    let (target_start, target_end) = line.target;
    if buf[target_start] != b'/' {
        return Err(HttpError::malformed(
            "request target must be in origin form",
        ));
    }
    head.method = match &buf[line.method.0..line.method.1] {
        b"GET" => Method::Get,
        b"HEAD" => Method::Head,
        b"POST" => Method::Post,
        _ => Method::Other,
    };
    head.target = (target_start, target_end);
    head.path_end = target_start
        + memchr::memchr(b'?', &buf[target_start..target_end]).unwrap_or(target_end - target_start);
    head.minor_version = line.minor_version;
    head.head_len = head_len;
    head.expect_continue = false;
    head.connection_options = false;
    head.keep_alive = line.minor_version == 1;
    Ok(())
}

/// The fields in `head.headers`, in order: what they say of the body and the Host gathered in
/// the result, their `Connection` and `Expect` set on `head` (its request line already read).
#[inline(always)]
fn read_fields(buf: &[u8], head: &mut RequestHead) -> Result<Fields, HttpError> {
    let minor = head.minor_version;
    let mut fields = Fields::default();
    for field in head.headers.iter() {
        let name = field.name(buf);
        let value = field.value(buf);
        if CONTENT_LENGTH.matches(name) {
            fields.content_length(value)?;
        } else if TRANSFER_ENCODING.matches(name) {
            fields.transfer_encoding(value)?;
        } else if HOST.matches(name) {
            fields.hosts += 1;
        } else if CONNECTION.matches(name) {
            if has_token(value, b"close") {
                head.keep_alive = false;
            } else if minor == 0 && has_token(value, b"keep-alive") {
                head.keep_alive = true;
            }
            head.connection_options |= super::names_options(value);
        } else if EXPECT.matches(name) {
            if HUNDRED_CONTINUE.matches(trim_ows(value)) {
                head.expect_continue = true;
            } else {
                return Err(HttpError::ExpectationFailed);
            }
        }
    }
    Ok(fields)
}

/// What a head's fields say of its body and its Host, gathered as they are read.
#[derive(Debug, Default)]
struct Fields {
    content_length: Option<u64>,
    /// A `Transfer-Encoding` (a lone `chunked`: any other is refused as it is read).
    chunked: bool,
    hosts: usize,
}

impl Fields {
    /// A `Content-Length` field's value: a valid length, the same as any before it.
    #[inline(always)]
    fn content_length(&mut self, value: &[u8]) -> Result<(), HttpError> {
        let Some(n) = parse_content_length(value) else {
            return Err(HttpError::malformed("invalid Content-Length"));
        };
        if self.content_length.is_some_and(|prev| prev != n) {
            return Err(HttpError::malformed("conflicting Content-Length headers"));
        }
        self.content_length = Some(n);
        Ok(())
    }

    /// A `Transfer-Encoding` field's value: `chunked`, in the head's only such field.
    #[inline(always)]
    fn transfer_encoding(&mut self, value: &[u8]) -> Result<(), HttpError> {
        // Only a lone `chunked` is accepted: any other coding (or chunked twice, or not
        // last) is something we cannot decode, and a classic smuggling ingredient.
        if self.chunked || !CHUNKED.matches(trim_ows(value)) {
            return Err(HttpError::malformed(
                "unsupported Transfer-Encoding: only `chunked` is accepted",
            ));
        }
        self.chunked = true;
        Ok(())
    }

    /// The body's framing for a request of HTTP/1.`minor`, once all fields are read; 400 for
    /// both framings at once, chunked in HTTP/1.0, or an HTTP/1.1 head without one Host.
    #[inline(always)]
    fn body(self, minor: u8) -> Result<BodyFraming, HttpError> {
        if self.chunked && self.content_length.is_some() {
            return Err(HttpError::malformed(
                "Content-Length and Transfer-Encoding together",
            ));
        }
        if self.chunked && minor == 0 {
            return Err(HttpError::malformed(
                "Transfer-Encoding in an HTTP/1.0 request",
            ));
        }
        if minor == 1 && self.hosts != 1 {
            return Err(HttpError::malformed("exactly one Host header is required"));
        }
        Ok(if self.chunked {
            BodyFraming::Chunked
        } else {
            match self.content_length {
                Some(0) | None => BodyFraming::None,
                Some(n) => BodyFraming::Length(n),
            }
        })
    }
}

/// The head at the start of `buf`, read in one pass by the line reader allowing CR LF line
/// endings only: its request line and length, its fields in `head.headers`. `None` when it is
/// not all there or the reader refuses it (the scan's way then reads it, and words why).
fn read_whole_head(buf: &[u8], head: &mut RequestHead) -> Option<(RequestLine, usize)> {
    let lines = Lines::crlf_only(buf);
    let line = lines.request_line().ok()??;
    head.headers.clear();
    let head_len = lines
        .fields(line.fields_at, MAX_HEADERS_CEILING, &mut head.headers)
        .ok()??;
    Some((line, head_len))
}

/// The head at the start of `buf` the careful way: its line endings scanned from where
/// `scan` stopped, its size checked against `limits`, then its lines read. `None` while it is
/// not all there.
fn scan_and_read_head(
    buf: &[u8],
    scan: &mut HeadScan,
    limits: &HttpLimits,
    head: &mut RequestHead,
) -> Result<Option<(RequestLine, usize)>, HttpError> {
    let Some(head_len) = scan_line_endings(buf, scan)? else {
        return match scan.request_line_end {
            None if buf.len() > limits.max_request_line_bytes => {
                Err(HttpError::limit(414, "request line too long"))
            }
            _ if buf.len() > limits.max_header_bytes => {
                Err(HttpError::limit(431, "request header fields too large"))
            }
            _ => Ok(None),
        };
    };
    // Before the lines are read: a head too large is refused as such, whatever its lines hold.
    check_head_size(scan, head_len, limits)?;
    // The head and up to sixteen bytes after it, where the buffer has them: the last lines are
    // then read with whole sixteen-byte loads too. The blank line ends the reading either way.
    let lines = Lines::request(&buf[..buf.len().min(head_len + 16)]);
    let line = match lines.request_line() {
        Ok(Some(line)) => line,
        // Only empty lines before the blank one.
        Ok(None) => return Err(HttpError::malformed("malformed request head")),
        Err(e) => return Err(malformed_head(e)),
    };
    head.headers.clear();
    match lines.fields(line.fields_at, MAX_HEADERS_CEILING, &mut head.headers) {
        Ok(Some(n)) if n == head_len => {}
        Ok(_) => return Err(HttpError::malformed("malformed request head")),
        Err(e) => return Err(malformed_head(e)),
    }
    Ok(Some((line, head_len)))
}

/// A whole head (`head_len` bytes, its request line's end in `scan`) within `limits`: else 414
/// for its request line, 431 for the head.
fn check_head_size(scan: &HeadScan, head_len: usize, limits: &HttpLimits) -> Result<(), HttpError> {
    if scan.request_line_end.unwrap_or(0) > limits.max_request_line_bytes {
        return Err(HttpError::limit(414, "request line too long"));
    }
    if head_len > limits.max_header_bytes {
        return Err(HttpError::limit(431, "request header fields too large"));
    }
    Ok(())
}

/// A head the line reader refused: 400 (431 past the ceiling on fields).
fn malformed_head(e: LineError) -> HttpError {
    match e {
        LineError::TooManyHeaders => HttpError::limit(431, "too many header fields"),
        e => HttpError::malformed(format!("malformed request head: {}", e.as_str())),
    }
}

/// Check every CR / LF from `scan.scanned` on: each LF must follow a CR, each CR must precede
/// an LF. Returns the head length once CRLF CRLF is seen.
///
/// The head is read sixteen bytes at a time ([`line_end_bits`]) and each CR or LF in a block
/// taken from its mask: a call to `memchr2` per line cost ~90 instructions a line on heads of
/// short lines, most of it the call and its setup.
fn scan_line_endings(buf: &[u8], scan: &mut HeadScan) -> Result<Option<usize>, HttpError> {
    let mut block = scan.scanned;
    while block < buf.len() {
        let (mut bits, width) = line_end_bits(buf, block);
        while bits != 0 {
            let p = block + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if buf.get(p) == Some(&b'\r') {
                match buf.get(p + 1) {
                    None => {
                        // The LF may still come; look at this CR again next time.
                        scan.scanned = p;
                        return Ok(None);
                    }
                    // The LF is the next stop.
                    Some(b'\n') => continue,
                    Some(_) => return Err(HttpError::malformed("bare CR in request head")),
                }
            }
            // An LF: the CR check above guarantees buf[p-1] is CR unless this LF is bare.
            if p == 0 || buf.get(p - 1) != Some(&b'\r') {
                return Err(HttpError::malformed("bare LF in request head"));
            }
            if scan.request_line_end.is_none() {
                scan.request_line_end = Some(p - 1);
            }
            if p >= 3 && buf.get(p - 3..=p) == Some(b"\r\n\r\n") {
                scan.scanned = p + 1;
                return Ok(Some(p + 1));
            }
        }
        block += width;
    }
    scan.scanned = buf.len();
    Ok(None)
}

/// The CRs and LFs among the sixteen bytes at `at` (bit `i` for `buf[at + i]`), or among the
/// bytes left when fewer are; and how many bytes that was.
#[inline]
fn line_end_bits(buf: &[u8], at: usize) -> (u32, usize) {
    match buf
        .get(at..at + 16)
        .and_then(|b| <&[u8; 16]>::try_from(b).ok())
    {
        Some(block) => (line_end_bits16(block), 16),
        None => {
            let rest = buf.get(at..).unwrap_or_default();
            (bytewise_line_end_bits(rest), rest.len())
        }
    }
}

/// The CRs and LFs among sixteen bytes, with SSE2 (in every x86_64 target).
#[cfg(target_arch = "x86_64")]
#[inline]
fn line_end_bits16(block: &[u8; 16]) -> u32 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is in every x86_64 target, so its intrinsics are always there to call; the
    // load reads the sixteen bytes `block` borrows, and `loadu` asks no alignment of them.
    let mask = unsafe {
        let v = _mm_loadu_si128(block.as_ptr().cast());
        let cr = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\r' as i8));
        let lf = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\n' as i8));
        _mm_movemask_epi8(_mm_or_si128(cr, lf))
    };
    // Sixteen bits, one per byte.
    u32::from(mask as u16)
}

/// The CRs and LFs among sixteen bytes, elsewhere.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn line_end_bits16(block: &[u8; 16]) -> u32 {
    bytewise_line_end_bits(block)
}

/// The CRs and LFs among at most 32 bytes, one byte at a time.
fn bytewise_line_end_bits(bytes: &[u8]) -> u32 {
    bytes.iter().take(32).enumerate().fold(0, |bits, (i, &c)| {
        bits | (u32::from(c == b'\r' || c == b'\n') << i)
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn limits() -> HttpLimits {
        HttpLimits {
            max_request_line_bytes: 64,
            max_header_bytes: 256,
            max_headers: 4,
            max_body_bytes: 1000,
            max_translated_json_values: 100,
        }
    }

    fn parse(raw: &[u8]) -> Result<(HeadStatus, RequestHead), u16> {
        let mut head = RequestHead::default();
        let mut scan = HeadScan::default();
        parse_request_head(raw, &mut scan, &limits(), &mut head)
            .map(|s| (s, head))
            .map_err(|e| e.status())
    }

    /// The scan as it was before the block-at-a-time one: a `memchr2` call per stop.
    fn scan_line_endings_by_memchr2(
        buf: &[u8],
        scan: &mut HeadScan,
    ) -> Result<Option<usize>, HttpError> {
        let mut from = scan.scanned;
        while let Some(off) = memchr::memchr2(b'\r', b'\n', &buf[from..]) {
            let p = from + off;
            if buf[p] == b'\r' {
                match buf.get(p + 1) {
                    None => {
                        scan.scanned = p;
                        return Ok(None);
                    }
                    Some(b'\n') => {}
                    Some(_) => return Err(HttpError::malformed("bare CR in request head")),
                }
                from = p + 1;
                continue;
            }
            if p == 0 || buf[p - 1] != b'\r' {
                return Err(HttpError::malformed("bare LF in request head"));
            }
            if scan.request_line_end.is_none() {
                scan.request_line_end = Some(p - 1);
            }
            if p >= 3 && &buf[p - 3..=p] == b"\r\n\r\n" {
                scan.scanned = p + 1;
                return Ok(Some(p + 1));
            }
            from = p + 1;
        }
        scan.scanned = buf.len();
        Ok(None)
    }

    #[test]
    fn the_block_scan_finds_what_a_stop_by_stop_scan_finds() {
        let mut next = crate::http::testing::numbers(0x9e37_79b9_7f4a_7c15);
        let mut heads_ended = 0;
        for _ in 0..20_000 {
            // Lines of text ending CRLF, a blank line after them, then a few bytes turned into
            // CR or LF (or CRLF dropped to one byte) anywhere: heads ending at every offset of a
            // block, and bare CRs and LFs on both sides of block edges.
            let mut head = Vec::new();
            for _ in 0..=next(6) {
                for _ in 0..next(40) {
                    head.push(b'a' + next(26) as u8);
                }
                head.extend_from_slice(b"\r\n");
            }
            head.extend_from_slice(b"\r\n");
            for _ in 0..next(3) {
                let at = next(head.len());
                head[at] = [b'\r', b'\n', b'x'][next(3)];
            }
            // Fed as it might arrive: growing prefixes, each scan resuming where it stopped.
            let (mut blocks, mut stops) = (HeadScan::default(), HeadScan::default());
            let mut end = 0;
            while end < head.len() {
                end = (end + 1 + next(24)).min(head.len());
                let got = scan_line_endings(&head[..end], &mut blocks);
                let want = scan_line_endings_by_memchr2(&head[..end], &mut stops);
                assert_eq!(
                    got,
                    want,
                    "{:?} up to {end}",
                    String::from_utf8_lossy(&head)
                );
                assert_eq!(
                    (blocks.scanned, blocks.request_line_end),
                    (stops.scanned, stops.request_line_end),
                    "{:?} up to {end}",
                    String::from_utf8_lossy(&head)
                );
                match got {
                    Ok(None) => {}
                    Ok(Some(_)) => {
                        heads_ended += 1;
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        // Both ways of ending were exercised, not only refusals.
        assert!(heads_ended > 5_000, "{heads_ended}");
    }

    /// Read whole at first sight or scanned first, a head gets the same answer: the same
    /// refusal (status and words) or the same reading, whole or arriving in pieces.
    #[test]
    fn a_head_read_whole_is_read_as_the_scan_reads_it() {
        let mut next = crate::http::testing::numbers(0x6a09_e667_f3bc_c908);
        // The test limits' longest request line is 64 bytes: one of 64, one of 65.
        const STARTS: [&[u8]; 8] = [
            b"POST /v1/xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx HTTP/1.1",
            b"POST /v1/xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx HTTP/1.1",
            b"POST /v1/chat/completions HTTP/1.1",
            b"GET /v1/models?limit=2 HTTP/1.1",
            b"POST /v1/embeddings HTTP/1.0",
            b"HEAD / HTTP/1.1",
            b"POST /a-request-line-longer-than-sixty-four-bytes/v1/chat/completions HTTP/1.1",
            b"GET /\xc3\xa9 HTTP/1.1",
        ];
        const FIELDS: [&[u8]; 12] = [
            b"Host: 127.0.0.1:8080",
            b"Content-Length: 12",
            b"content-length: 12",
            b"Content-Length: 2000",
            b"Transfer-Encoding: chunked",
            b"Connection: close",
            b"Connection: keep-alive",
            b"Expect: 100-continue",
            b"Authorization: Bearer sk-0123456789abcdef",
            b"x-stainless-package-version: 1.54.4",
            b"X-Empty:",
            b"user-agent: OpenAI/Python 1.54.4",
        ];
        const NOISE: [u8; 10] = [b'\r', b'\n', b' ', b'\t', b':', 0, 0x7f, 0x80, b'a', b'1'];
        let roomy = HttpLimits {
            max_request_line_bytes: 8192,
            max_header_bytes: 65536,
            max_headers: 100,
            max_body_bytes: 1 << 20,
            max_translated_json_values: 100,
        };
        let answer = |buf: &[u8], scan: &mut HeadScan, limits: &HttpLimits, whole: bool| {
            let mut head = RequestHead::default();
            // What a refused head's parse left behind is never read.
            match parse_head(buf, scan, limits, &mut head, whole) {
                Ok(HeadStatus::Complete) => format!("Ok(Complete) {head:?}"),
                status => format!("{status:?}"),
            }
        };
        let mut read_whole = 0;
        for round in 0..40_000 {
            let mut head = Vec::new();
            if next(16) == 0 {
                head.extend_from_slice(b"\r\n");
            }
            head.extend_from_slice(STARTS[next(STARTS.len())]);
            head.extend_from_slice(b"\r\n");
            if next(8) != 0 {
                head.extend_from_slice(b"Host: sluice\r\n");
            }
            for _ in 0..next(8) {
                head.extend_from_slice(FIELDS[next(FIELDS.len())]);
                head.extend_from_slice(b"\r\n");
            }
            head.extend_from_slice(b"\r\n");
            if round % 2 == 1 {
                crate::http::testing::damage(&mut head, &mut next, &NOISE);
            }
            if next(2) == 0 {
                head.extend_from_slice(b"{\"model\":\"x\"}\r\n");
            }
            let limits = if next(4) == 0 { limits() } else { roomy };
            let shown = String::from_utf8_lossy(&head);
            // Whole, at first sight.
            let want = answer(&head, &mut HeadScan::default(), &limits, false);
            let got = answer(&head, &mut HeadScan::default(), &limits, true);
            assert_eq!(got, want, "{shown:?}");
            read_whole += usize::from(got.starts_with("Ok(Complete)"));
            // In pieces, each look resuming where the last stopped.
            let (mut scanned, mut whole) = (HeadScan::default(), HeadScan::default());
            let mut end = 0;
            while end < head.len() {
                end = (end + 1 + next(40)).min(head.len());
                let want = answer(&head[..end], &mut scanned, &limits, false);
                let got = answer(&head[..end], &mut whole, &limits, true);
                assert_eq!(got, want, "{shown:?} up to {end}");
                if !want.starts_with("Ok(Partial)") {
                    break;
                }
            }
        }
        // Heads read to the end both ways, not only refusals.
        assert!(read_whole > 10_000, "{read_whole}");
    }

    #[test]
    fn accepts_plain_post() {
        let (s, h) =
            parse(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
                .unwrap();
        assert_eq!(s, HeadStatus::Complete);
        assert_eq!(h.method, Method::Post);
        assert_eq!(h.body, BodyFraming::Length(5));
        assert!(h.keep_alive);
    }

    #[test]
    fn strictness() {
        let cases: &[(&[u8], u16)] = &[
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            (b"POST / HTTP/1.1\nHost: x\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\rY: z\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nA: b\r\n c\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nA: b\0c\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost : x\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nExpect: magic\r\n\r\n", 417),
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n", 413),
            (b"POST / HTTP/1.1\r\nHost: x\r\nA: 1\r\nB: 1\r\nC: 1\r\nD: 1\r\n\r\n", 431),
            // Obs-text in a value, at its start, inside, at its end.
            (b"POST / HTTP/1.1\r\nHost: x\r\nX-Title: caf\xc3\xa9\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: \x80x\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nHost: x\r\nA: a b \xff\r\n\r\n", 400),
        ];
        for (raw, status) in cases {
            assert_eq!(
                parse(raw).err(),
                Some(*status),
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    /// Obs-text in a value is refused whichever way the head is read (whole, or trickled in
    /// and scanned), and the answer says why.
    #[test]
    fn obs_text_in_a_value_is_refused_saying_so() {
        let raw = b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: caf\xc3\xa9/1.0\r\n\r\n";
        let mut head = RequestHead::default();
        let whole = parse_request_head(raw, &mut HeadScan::default(), &limits(), &mut head);
        let Err(HttpError::Malformed(why)) = &whole else {
            panic!("{whole:?}");
        };
        assert!(why.contains("outside ASCII"), "{why}");
        let mut scan = HeadScan::default();
        let mut last = Ok(HeadStatus::Partial);
        for end in 1..=raw.len() {
            last = parse_request_head(&raw[..end], &mut scan, &limits(), &mut head);
            if !matches!(last, Ok(HeadStatus::Partial)) {
                break;
            }
        }
        assert_eq!(last, whole);
        // The same bytes in the target stay a UTF-8 path, as before.
        let (status, _) = parse(b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(status, HeadStatus::Complete);
    }

    #[test]
    fn limits_on_partial_heads() {
        let long_line = format!("POST /{} HTTP/1.1", "a".repeat(100));
        assert_eq!(parse(long_line.as_bytes()).err(), Some(414));
        let big = format!("POST / HTTP/1.1\r\nHost: x\r\nA: {}", "a".repeat(300));
        assert_eq!(parse(big.as_bytes()).err(), Some(431));
        assert_eq!(
            parse(b"POST / HTTP/1.1\r\nHost: x\r").unwrap().0,
            HeadStatus::Partial
        );
    }

    #[test]
    fn incremental_scan_matches_whole() {
        let raw = b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n";
        let mut head = RequestHead::default();
        let mut scan = HeadScan::default();
        for end in 1..raw.len() {
            assert_eq!(
                parse_request_head(&raw[..end], &mut scan, &limits(), &mut head).unwrap(),
                HeadStatus::Partial
            );
        }
        assert_eq!(
            parse_request_head(raw, &mut scan, &limits(), &mut head).unwrap(),
            HeadStatus::Complete
        );
        assert_eq!(head.target(raw), b"/v1/x");
        assert_eq!(head.path(raw), b"/v1/x");
    }

    #[test]
    fn the_path_is_the_target_up_to_its_query() {
        // One head object reused down a connection, as the connection loop does: each parse
        // sets the path anew.
        let mut head = RequestHead::default();
        for (target, path) in [
            (&b"/v1/models?limit=2"[..], &b"/v1/models"[..]),
            (b"/v1/chat/completions", b"/v1/chat/completions"),
            (b"/?", b"/"),
            (b"/v1/x?a=1?b=2", b"/v1/x"),
        ] {
            let mut raw = b"GET ".to_vec();
            raw.extend_from_slice(target);
            raw.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\n\r\n");
            let mut scan = HeadScan::default();
            let status = parse_request_head(&raw, &mut scan, &limits(), &mut head).unwrap();
            assert_eq!(status, HeadStatus::Complete);
            assert_eq!(head.target(&raw), target);
            assert_eq!(
                head.path(&raw),
                path,
                "{:?}",
                String::from_utf8_lossy(target)
            );
        }
    }
}
