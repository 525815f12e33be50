//! The lines of an HTTP/1.x head — request line, status line, field lines — read sixteen
//! bytes at a time.
//!
//! Runs inside [`request`](super::request) on a request head that came whole (its line endings
//! checked as it reads, [`Lines::crlf_only`]) or once the line-ending scan has checked them,
//! and inside [`response`](super::response) on an upstream answer's bytes so far. Takes the head's
//! bytes; returns the start line's parts and each field as a [`HeaderPos`], `None` while the
//! blank line that ends the head has not arrived, or a [`LineError`] naming what is malformed.
//!
//! The rules are httparse's defaults (1.10), which these functions replaced and which the tests
//! and the fuzz targets hold them to, input by input: empty lines before the start line are
//! skipped; a line ends at LF, after an optional CR; a field name is one or more token
//! characters right before its colon (no space before it, no leading whitespace: no obs-fold);
//! a value is HTAB, SP, visible ASCII and obs-text (0x80–0xFF), its surrounding whitespace
//! trimmed; a request target is visible ASCII and obs-text forming UTF-8; the version is
//! `HTTP/1.0` or `HTTP/1.1`.
//!
//! Why not httparse: with the heads real traffic carries (openai-python's seventeen request
//! fields, a provider's twenty-three answer fields) it was a third of the plain path's
//! user-space instructions, ~260 a field (`HEADS=provider bench/callgrind_proxy.sh`): it reads a
//! name a byte at a time, and each step pays a bounds check and a slice. Here a name of up to
//! thirty-two bytes is found and checked with a load or two and a few SSE2 compares, and a value
//! is read sixteen bytes a step to its first control byte, which must be its line's end.

use super::HeaderPos;

/// What is malformed, as httparse names it (its `Display` texts, which error answers carry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LineError {
    /// The method or the request target.
    Token,
    /// The HTTP version.
    Version,
    /// The status code or reason phrase.
    Status,
    /// A field name (or a field line without a colon).
    HeaderName,
    /// A field value.
    HeaderValue,
    /// A CR not followed by LF where a line may end.
    NewLine,
    /// More fields than the caller takes.
    TooManyHeaders,
    /// A field value with a byte outside ASCII (obs-text), where the reader refuses them
    /// ([`Lines::request`]).
    ObsText,
}

impl LineError {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LineError::Token => "invalid token",
            LineError::Version => "invalid HTTP version",
            LineError::Status => "invalid response status",
            LineError::HeaderName => "invalid header name",
            LineError::HeaderValue => "invalid header value",
            LineError::NewLine => "invalid new line",
            LineError::TooManyHeaders => "too many headers",
            LineError::ObsText => "a header value holds a byte outside ASCII",
        }
    }
}

/// A request line's parts, as ranges of the head's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RequestLine {
    pub(crate) method: (usize, usize),
    pub(crate) target: (usize, usize),
    pub(crate) minor_version: u8,
    /// Where the first field line starts.
    pub(crate) fields_at: usize,
}

/// A status line's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StatusLine {
    pub(crate) code: u16,
    pub(crate) minor_version: u8,
    /// The reason phrase; empty when it holds obs-text (as httparse leaves it).
    pub(crate) reason: (usize, usize),
    /// Where the first field line starts.
    pub(crate) fields_at: usize,
}

/// A head's bytes (and maybe what follows them: a body already read). `CRLF_ONLY`: refuse a
/// line that ends in a lone LF ([`Lines::crlf_only`]); `ASCII`: refuse a field value holding
/// obs-text ([`Lines::request`]). Parameters of the type, not fields, so that the answers'
/// reader carries no test of them.
pub(crate) struct Lines<'a, const CRLF_ONLY: bool = false, const ASCII: bool = false> {
    buf: &'a [u8],
}

impl<'a> Lines<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Lines<'a> {
        Lines { buf }
    }
}

impl<'a> Lines<'a, false, true> {
    /// A request head's lines: as [`Lines::new`] reads them, but a field value holding a byte
    /// outside ASCII (obs-text, 0x80–0xFF) is refused ([`LineError::ObsText`]). RFC 9110
    /// §5.5 lets a recipient keep such bytes as opaque data; upstreams read them as Latin-1,
    /// as UTF-8, or refuse them, so a gateway that forwarded them would let one header mean
    /// different things on either side of it.
    pub(crate) fn request(buf: &'a [u8]) -> Lines<'a, false, true> {
        Lines { buf }
    }
}

impl<'a> Lines<'a, true, true> {
    /// A request head's lines ([`Lines::request`]) that end in CR LF only, and no empty line
    /// before the request line: a lone LF ending a line (or making the blank line), or a
    /// request line not at the start, is refused ([`LineError::NewLine`]). With a CR refused
    /// anywhere but before an LF, as it always is here, every CR and LF of a head read so is
    /// part of a CR LF: a request head that has not been through the line-ending scan is read
    /// this way.
    pub(crate) fn crlf_only(buf: &'a [u8]) -> Lines<'a, true, true> {
        Lines { buf }
    }
}

impl<const CRLF_ONLY: bool, const ASCII: bool> Lines<'_, CRLF_ONLY, ASCII> {
    /// The request line, after any empty lines. `None`: its LF has not arrived.
    pub(crate) fn request_line(&self) -> Result<Option<RequestLine>, LineError> {
        let buf = self.buf;
        let Some(start) = skip_empty_lines(buf)? else {
            return Ok(None);
        };
        if CRLF_ONLY && start != 0 {
            return Err(LineError::NewLine);
        }
        let Some((end, next)) = line_at(buf, start) else {
            return Ok(None);
        };
        if CRLF_ONLY && next - end != 2 {
            return Err(LineError::NewLine);
        }
        let line = &buf[start..end];
        // The method: a token, then one SP.
        let method_len = match line {
            [b'G', b'E', b'T', b' ', ..] => 3,
            [b'P', b'O', b'S', b'T', b' ', ..] => 4,
            _ => {
                let n = line.iter().take_while(|&&b| is_token(b)).count();
                if n == 0 || line.get(n) != Some(&b' ') {
                    return Err(LineError::Token);
                }
                n
            }
        };
        // The target: one or more bytes of visible ASCII or obs-text, forming UTF-8, then one SP.
        let target_start = method_len + 1;
        let rest = &line[target_start..];
        let target_len = memchr::memchr(b' ', rest).ok_or(LineError::Token)?;
        let target = &rest[..target_len];
        // Neither a control or DEL nor HTAB (which values may hold).
        if target.is_empty() || target.iter().any(|&b| b <= b' ' || b == 0x7f) {
            return Err(LineError::Token);
        }
        if !target.is_ascii() && std::str::from_utf8(target).is_err() {
            return Err(LineError::Token);
        }
        let minor_version = version(&rest[target_len + 1..]).ok_or(LineError::Version)?;
        let target_at = start + target_start;
        Ok(Some(RequestLine {
            method: (start, start + method_len),
            target: (target_at, target_at + target_len),
            minor_version,
            fields_at: next,
        }))
    }

    /// The status line, after any empty lines. `None`: its LF has not arrived (and what has
    /// arrived could still begin one).
    pub(crate) fn status_line(&self) -> Result<Option<StatusLine>, LineError> {
        let buf = self.buf;
        let Some(start) = skip_empty_lines(buf)? else {
            return Ok(None);
        };
        let Some((end, next)) = line_at(buf, start) else {
            // Turn a non-HTTP answer away now, not when it has filled the head's limit.
            let so_far = &buf[start..];
            let n = so_far.len().min(7);
            if so_far[..n] != b"HTTP/1."[..n] {
                return Err(LineError::Version);
            }
            return Ok(None);
        };
        let line = &buf[start..end];
        let minor_version = line.get(..8).and_then(version).ok_or(LineError::Version)?;
        if line.get(8) != Some(&b' ') {
            return Err(LineError::Version);
        }
        let code = match line.get(9..12) {
            Some(&[a, b, c]) if a.is_ascii_digit() && b.is_ascii_digit() && c.is_ascii_digit() => {
                u16::from(a - b'0') * 100 + u16::from(b - b'0') * 10 + u16::from(c - b'0')
            }
            _ => return Err(LineError::Status),
        };
        let reason = match line.get(12) {
            None => (end, end),
            Some(b' ') => {
                let from = start + 13;
                let phrase = &buf[from..end];
                if phrase.iter().any(|&b| is_forbidden(b)) {
                    return Err(LineError::Status);
                }
                if phrase.is_ascii() {
                    (from, end)
                } else {
                    (end, end)
                }
            }
            Some(_) => return Err(LineError::Status),
        };
        Ok(Some(StatusLine {
            code,
            minor_version,
            reason,
            fields_at: next,
        }))
    }

    /// The field lines from `at` to the blank line, appended to `fields` (at most `most` of
    /// them). Returns the head's length, through the blank line's LF; `None` if the blank line
    /// has not arrived.
    pub(crate) fn fields(
        &self,
        mut at: usize,
        most: usize,
        fields: &mut Vec<HeaderPos>,
    ) -> Result<Option<usize>, LineError> {
        let buf = self.buf;
        loop {
            match buf.get(at) {
                None => return Ok(None),
                Some(b'\n') if CRLF_ONLY => return Err(LineError::NewLine),
                Some(b'\n') => return Ok(Some(at + 1)),
                Some(b'\r') => {
                    return match buf.get(at + 1) {
                        None => Ok(None),
                        Some(b'\n') => Ok(Some(at + 2)),
                        // httparse's word for it.
                        Some(_) => Err(LineError::NewLine),
                    };
                }
                Some(_) => {}
            }
            let colon = match name_end(buf, at) {
                Ok(colon) => colon,
                Err(None) => return Ok(None),
                Err(Some(e)) => return Err(e),
            };
            // The value runs to the first forbidden byte, which must be the line's end.
            let Some(stop) = first_forbidden::<ASCII>(buf, colon + 1) else {
                return Ok(None);
            };
            let (end, next) = match buf.get(stop..stop + 2) {
                _ if ASCII && buf[stop] >= 0x80 => return Err(LineError::ObsText),
                _ if CRLF_ONLY && buf[stop] == b'\n' => return Err(LineError::NewLine),
                _ if buf[stop] == b'\n' => (stop, stop + 1),
                Some(b"\r\n") => (stop, stop + 2),
                // A CR with its LF still to come.
                None if buf[stop] == b'\r' => return Ok(None),
                _ => return Err(LineError::HeaderValue),
            };
            // Whitespace around the value is not part of it (most values have one SP before
            // them and none after).
            let mut from = colon + 1;
            while from < end && matches!(buf[from], b' ' | b'\t') {
                from += 1;
            }
            let mut to = end;
            while to > from && matches!(buf[to - 1], b' ' | b'\t') {
                to -= 1;
            }
            if from == to {
                // An empty value sits right after the name, as it always has.
                (from, to) = (colon, colon);
            }
            if fields.len() == most {
                return Err(LineError::TooManyHeaders);
            }
            fields.push(HeaderPos {
                name: (at as u32, colon as u32),
                value: (from as u32, to as u32),
            });
            at = next;
        }
    }
}

/// The line starting at `at`: where its content ends (before its CR LF or lone LF) and where
/// the next line starts; `None` before its LF.
fn line_at(buf: &[u8], at: usize) -> Option<(usize, usize)> {
    let lf = at + memchr::memchr(b'\n', buf.get(at..)?)?;
    let end = if lf > at && buf[lf - 1] == b'\r' {
        lf - 1
    } else {
        lf
    };
    Some((end, lf + 1))
}

/// Where the field name starting at `at` (not a line's end) ends: its colon. `Err(None)`: the
/// buffer ends first; `Err(Some(HeaderName))`: a byte that is not a token's comes first (a
/// space, a line's end), or the name is empty.
#[inline]
fn name_end(buf: &[u8], at: usize) -> Result<usize, Option<LineError>> {
    // Most names are letters, digits and `-`, and most are shorter than thirty-two bytes (the
    // longest common ones, `x-ratelimit-remaining-requests` and `x-stainless-*`, are 24–30):
    // a load or two finds the colon and checks the bytes before it.
    let mut checked = 0;
    while checked < 32 {
        let from = at + checked;
        let Some(block) = buf
            .get(from..from + 16)
            .and_then(|b| <&[u8; 16]>::try_from(b).ok())
        else {
            break;
        };
        let (colon, common) = name16(block);
        if colon != 0 {
            let len = colon.trailing_zeros();
            let before = (1u32 << len) - 1;
            if common & before == before && checked + len as usize > 0 {
                return Ok(from + len as usize);
            }
            break;
        }
        if common != 0xffff {
            break;
        }
        checked += 16;
    }
    // A longer name, one with rarer token characters, or a refusal: byte by byte.
    let len = buf
        .get(at..)
        .unwrap_or_default()
        .iter()
        .take_while(|&&b| is_token(b))
        .count();
    match buf.get(at + len) {
        None => Err(None),
        Some(b':') if len > 0 => Ok(at + len),
        Some(_) => Err(Some(LineError::HeaderName)),
    }
}

/// The first byte from `from` on that no value may hold: a control other than HTAB (so CR and
/// LF), or DEL; with `ASCII`, a byte of obs-text too.
#[inline]
fn first_forbidden<const ASCII: bool>(buf: &[u8], mut from: usize) -> Option<usize> {
    while let Some(block) = buf
        .get(from..from + 16)
        .and_then(|b| <&[u8; 16]>::try_from(b).ok())
    {
        let mut bits = forbidden16(block);
        if ASCII {
            bits |= high16(block);
        }
        if bits != 0 {
            return Some(from + bits.trailing_zeros() as usize);
        }
        from += 16;
    }
    let tail = buf.get(from..)?;
    tail.iter()
        .position(|&b| is_forbidden(b) || (ASCII && b >= 0x80))
        .map(|i| from + i)
}

/// The bytes of sixteen at 0x80 and above (bit `i` for byte `i`): SSE2's sign-bit mask.
#[cfg(target_arch = "x86_64")]
#[inline]
fn high16(block: &[u8; 16]) -> u32 {
    use std::arch::x86_64::{_mm_loadu_si128, _mm_movemask_epi8};
    // SAFETY: SSE2 is in every x86_64 target; the load reads the sixteen bytes `block`
    // borrows, and `loadu` asks no alignment of them.
    let mask = unsafe { _mm_movemask_epi8(_mm_loadu_si128(block.as_ptr().cast())) };
    u32::from(mask as u16)
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn high16(block: &[u8; 16]) -> u32 {
    block
        .iter()
        .enumerate()
        .fold(0, |bits, (i, &b)| bits | (u32::from(b >= 0x80) << i))
}

/// A byte no value, reason phrase or target may hold.
#[inline]
fn is_forbidden(b: u8) -> bool {
    (b < 0x20 && b != b'\t') || b == 0x7f
}

/// The forbidden bytes among sixteen (bit `i` for byte `i`), with SSE2 (in every x86_64
/// target).
#[cfg(target_arch = "x86_64")]
#[inline]
fn forbidden16(block: &[u8; 16]) -> u32 {
    use std::arch::x86_64::{
        _mm_andnot_si128, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8,
        _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is in every x86_64 target; the load reads the sixteen bytes `block`
    // borrows, and `loadu` asks no alignment of them.
    let mask = unsafe {
        let v = _mm_loadu_si128(block.as_ptr().cast());
        // Unsigned v <= 0x1f: the controls.
        let ctl = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(0x1f)), v);
        let tab = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\t' as i8));
        let del = _mm_cmpeq_epi8(v, _mm_set1_epi8(0x7f));
        _mm_movemask_epi8(_mm_or_si128(_mm_andnot_si128(tab, ctl), del))
    };
    // Sixteen bits, one per byte.
    u32::from(mask as u16)
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn forbidden16(block: &[u8; 16]) -> u32 {
    forbidden16_bytewise(block)
}

#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn forbidden16_bytewise(block: &[u8; 16]) -> u32 {
    block
        .iter()
        .enumerate()
        .fold(0, |bits, (i, &b)| bits | (u32::from(is_forbidden(b)) << i))
}

/// Among sixteen bytes: the colons, and the ASCII letters, digits, `-` and `_` (bit `i` for
/// byte `i`), with SSE2.
#[cfg(target_arch = "x86_64")]
#[inline]
fn name16(block: &[u8; 16]) -> (u32, u32) {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8, _mm_sub_epi8,
    };
    // SAFETY: SSE2 is in every x86_64 target; the load reads the sixteen bytes `block`
    // borrows, and `loadu` asks no alignment of them.
    let (colon, common) = unsafe {
        let v = _mm_loadu_si128(block.as_ptr().cast());
        // `x - lo <= hi - lo` unsigned, as `min(x - lo, hi - lo) == x - lo`.
        let within = |lo: u8, hi: u8, x| {
            let d = _mm_sub_epi8(x, _mm_set1_epi8(lo as i8));
            _mm_cmpeq_epi8(_mm_min_epu8(d, _mm_set1_epi8((hi - lo) as i8)), d)
        };
        // Setting bit 5 maps A–Z onto a–z and moves no other byte into a–z.
        let letter = within(b'a', b'z', _mm_or_si128(v, _mm_set1_epi8(0x20)));
        let digit = within(b'0', b'9', v);
        let dash = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'-' as i8));
        let underscore = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'_' as i8));
        let colon = _mm_cmpeq_epi8(v, _mm_set1_epi8(b':' as i8));
        (
            _mm_movemask_epi8(colon),
            _mm_movemask_epi8(_mm_or_si128(
                _mm_or_si128(letter, digit),
                _mm_or_si128(dash, underscore),
            )),
        )
    };
    // Sixteen bits each, one per byte.
    (u32::from(colon as u16), u32::from(common as u16))
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn name16(block: &[u8; 16]) -> (u32, u32) {
    name16_bytewise(block)
}

#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn name16_bytewise(block: &[u8; 16]) -> (u32, u32) {
    block
        .iter()
        .enumerate()
        .fold((0, 0), |(colon, common), (i, &b)| {
            (
                colon | (u32::from(b == b':') << i),
                common | (u32::from(b.is_ascii_alphanumeric() || b == b'-' || b == b'_') << i),
            )
        })
}

/// Where the start line begins, past empty lines (CR LF or lone LF). `None`: only empty lines
/// so far.
fn skip_empty_lines(buf: &[u8]) -> Result<Option<usize>, LineError> {
    let mut at = 0;
    loop {
        match buf.get(at) {
            Some(b'\n') => at += 1,
            Some(b'\r') => match buf.get(at + 1) {
                Some(b'\n') => at += 2,
                Some(_) => return Err(LineError::NewLine),
                None => return Ok(None),
            },
            Some(_) => return Ok(Some(at)),
            None => return Ok(None),
        }
    }
}

/// `HTTP/1.0` or `HTTP/1.1`, exactly: the minor version.
fn version(bytes: &[u8]) -> Option<u8> {
    match bytes {
        b"HTTP/1.1" => Some(1),
        b"HTTP/1.0" => Some(0),
        _ => None,
    }
}

/// A token character (RFC 9110 §5.6.2): what a method and a field name are made of.
#[inline]
fn is_token(b: u8) -> bool {
    TOKEN[b as usize]
}

static TOKEN: [bool; 256] = {
    let mut map = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        map[b] = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        b += 1;
    }
    map
};

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::mem::MaybeUninit;

    #[test]
    fn the_vector_checks_are_the_bytewise_checks() {
        // Every byte value in every lane.
        for lane in 0..16 {
            for b in 0..=255u8 {
                let mut block = [b'a'; 16];
                block[lane] = b;
                assert_eq!(
                    forbidden16(&block),
                    forbidden16_bytewise(&block),
                    "{b:#x} at {lane}"
                );
                assert_eq!(name16(&block), name16_bytewise(&block), "{b:#x} at {lane}");
                assert_eq!(
                    high16(&block),
                    u32::from(b >= 0x80) << lane,
                    "{b:#x} at {lane}"
                );
            }
        }
        // The first forbidden byte, in a block, past one, and in a short tail.
        let line = b"abcdefghijklmnopqrstuvwxyz0123456789\r\n";
        assert_eq!(first_forbidden::<false>(line, 0), Some(36));
        assert_eq!(first_forbidden::<false>(line, 30), Some(36));
        assert_eq!(first_forbidden::<false>(b"a\x7fb", 0), Some(1));
        assert_eq!(first_forbidden::<false>(b"a\tb", 0), None);
        // Obs-text, only where it is refused: in a block and in a tail.
        let line = b"abcdefghijklmnopqrstuvwxyz\xc3\xa9\r\n";
        assert_eq!(first_forbidden::<false>(line, 0), Some(28));
        assert_eq!(first_forbidden::<true>(line, 0), Some(26));
        assert_eq!(first_forbidden::<true>(line, 20), Some(26));
        assert_eq!(first_forbidden::<true>(b"a\xffb", 0), Some(1));
    }

    #[test]
    fn a_request_head_in_parts() {
        let head = b"\r\nPOST /v1/chat?x=1 HTTP/1.1\r\nHost: a\r\nX-Empty: \t \r\nX-Pad:  b c \t\r\n\r\nbody";
        let lines = Lines::new(head);
        let line = lines.request_line().unwrap().unwrap();
        assert_eq!(&head[line.method.0..line.method.1], b"POST");
        assert_eq!(&head[line.target.0..line.target.1], b"/v1/chat?x=1");
        assert_eq!(line.minor_version, 1);
        let mut fields = Vec::new();
        let len = lines
            .fields(line.fields_at, 8, &mut fields)
            .unwrap()
            .unwrap();
        assert_eq!(&head[len..], b"body");
        let got: Vec<(&[u8], &[u8])> = fields
            .iter()
            .map(|f| (f.name(head), f.value(head)))
            .collect();
        let want: Vec<(&[u8], &[u8])> =
            vec![(b"Host", b"a"), (b"X-Empty", b""), (b"X-Pad", b"b c")];
        assert_eq!(got, want);
        // The empty value sits right after its name.
        assert_eq!(fields[1].value.0, fields[1].name.1);
        // One field too many.
        let mut fields = Vec::new();
        assert_eq!(
            Lines::new(head).fields(line.fields_at, 2, &mut fields),
            Err(LineError::TooManyHeaders)
        );
    }

    #[test]
    fn a_status_line_in_parts() {
        let head = b"HTTP/1.0 404 Not Here\nA:b\n\n";
        let lines = Lines::new(head);
        let line = lines.status_line().unwrap().unwrap();
        assert_eq!((line.code, line.minor_version), (404, 0));
        assert_eq!(&head[line.reason.0..line.reason.1], b"Not Here");
        let mut fields = Vec::new();
        assert_eq!(
            lines.fields(line.fields_at, 8, &mut fields),
            Ok(Some(head.len()))
        );
        // Not HTTP: turned away before a line ends.
        assert_eq!(
            Lines::new(b"SSH-2.0").status_line(),
            Err(LineError::Version)
        );
        assert_eq!(Lines::new(b"HTTP/1.").status_line(), Ok(None));
        // Obs-text in the reason: kept out of it, as httparse does.
        let head = b"HTTP/1.1 200 \xc3\xa9\r\n\r\n";
        let line = Lines::new(head).status_line().unwrap().unwrap();
        assert_eq!(line.reason.0, line.reason.1);
    }

    /// What a reader makes of a head: its start line's three parts, its fields, its length; or
    /// that it refuses it (or waits for more).
    type Parsed = Option<(Vec<u8>, Vec<u8>, u8, Fields, usize)>;
    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn httparse_fields(headers: &[httparse::Header<'_>]) -> Fields {
        headers
            .iter()
            .map(|h| (h.name.as_bytes().to_vec(), h.value.to_vec()))
            .collect()
    }

    /// The fields and the length the line reader finds from `at`, with the limit the httparse
    /// readers below are given.
    fn our_fields(lines: &Lines<'_>, head: &[u8], at: usize) -> Option<(Fields, usize)> {
        let mut fields = Vec::new();
        let n = lines.fields(at, 16, &mut fields).ok()??;
        let owned = fields
            .iter()
            .map(|f| (f.name(head).to_vec(), f.value(head).to_vec()))
            .collect();
        Some((owned, n))
    }

    fn by_httparse_request(head: &[u8]) -> Parsed {
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; 16];
        let mut req = httparse::Request::new(&mut []);
        match req.parse_with_uninit_headers(head, &mut fields) {
            Ok(httparse::Status::Complete(n)) => Some((
                req.method?.as_bytes().to_vec(),
                req.path?.as_bytes().to_vec(),
                req.version?,
                httparse_fields(req.headers),
                n,
            )),
            _ => None,
        }
    }

    fn by_lines_request(head: &[u8]) -> Parsed {
        let lines = Lines::new(head);
        let line = lines.request_line().ok()??;
        let (fields, n) = our_fields(&lines, head, line.fields_at)?;
        Some((
            head[line.method.0..line.method.1].to_vec(),
            head[line.target.0..line.target.1].to_vec(),
            line.minor_version,
            fields,
            n,
        ))
    }

    /// The request reader's answer ([`Lines::request`]): refusals kept apart.
    fn by_request_reader(head: &[u8]) -> Result<Parsed, LineError> {
        let lines = Lines::request(head);
        let Some(line) = lines.request_line()? else {
            return Ok(None);
        };
        let mut fields = Vec::new();
        let Some(n) = lines.fields(line.fields_at, 16, &mut fields)? else {
            return Ok(None);
        };
        let owned = fields
            .iter()
            .map(|f| (f.name(head).to_vec(), f.value(head).to_vec()))
            .collect();
        Ok(Some((
            head[line.method.0..line.method.1].to_vec(),
            head[line.target.0..line.target.1].to_vec(),
            line.minor_version,
            owned,
            n,
        )))
    }

    fn by_httparse_response(head: &[u8]) -> Parsed {
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; 16];
        let mut resp = httparse::Response::new(&mut []);
        match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut resp,
            head,
            &mut fields,
        ) {
            Ok(httparse::Status::Complete(n)) => Some((
                resp.code?.to_string().into_bytes(),
                resp.reason?.as_bytes().to_vec(),
                resp.version?,
                httparse_fields(resp.headers),
                n,
            )),
            _ => None,
        }
    }

    fn by_lines_response(head: &[u8]) -> Parsed {
        let lines = Lines::new(head);
        let line = lines.status_line().ok()??;
        let (fields, n) = our_fields(&lines, head, line.fields_at)?;
        Some((
            line.code.to_string().into_bytes(),
            head[line.reason.0..line.reason.1].to_vec(),
            line.minor_version,
            fields,
            n,
        ))
    }

    /// Heads built from likely and unlikely pieces, then a few bytes changed: every accept and
    /// every refusal must be httparse's, and an accepted head's parts the same.
    #[test]
    fn heads_are_read_as_httparse_reads_them() {
        let mut next = crate::http::testing::numbers(0x2545_f491_4f6c_dd1d);
        const STARTS: [&[u8]; 12] = [
            b"GET / HTTP/1.1",
            b"POST /v1/chat/completions HTTP/1.1",
            b"PUT /a%20b?c=d HTTP/1.0",
            b"M-SEARCH * HTTP/1.1",
            b"GET /\xc3\xa9 HTTP/1.1",
            b"HTTP/1.1 200 OK",
            b"HTTP/1.0 404 Not Found",
            b"HTTP/1.1 204",
            b"HTTP/1.1 500 \xff",
            b"HTTP/1.1 302 Moved\tthere",
            b"",
            b"\r\n",
        ];
        const NAMES: [&[u8]; 10] = [
            b"Host",
            b"content-encoding",
            b"a-name-of-forty-bytes-made-of-letters-xx",
            b"content-length",
            b"X-A_b.c~d",
            b"openai-processing-ms",
            b"x-ratelimit-remaining-requests",
            b"A",
            b"Set-Cookie",
            b"cf-ray",
        ];
        const VALUES: [&[u8]; 10] = [
            b"x",
            b"",
            b" \t ",
            b"application/json; charset=utf-8",
            b"a b",
            b"\xc3\xa9\x80\xff",
            b"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef-long",
            b"\"quoted\", list",
            b"  padded  ",
            b"1024",
        ];
        const NOISE: [u8; 14] = [
            b'\r', b'\n', b' ', b'\t', b':', 0, 0x7f, 0x01, 0x80, b'(', b'"', b'/', b'1', b'H',
        ];
        let (mut requests, mut responses, mut obs_text_refused) = (0, 0, 0);
        for round in 0..60_000 {
            let mut head = Vec::new();
            for _ in 0..next(2) {
                head.extend_from_slice([&b"\r\n"[..], b"\n"][next(2)]);
            }
            head.extend_from_slice(STARTS[next(STARTS.len())]);
            let lf_only = next(8) == 0;
            let eol: &[u8] = if lf_only { b"\n" } else { b"\r\n" };
            head.extend_from_slice(eol);
            for _ in 0..next(10) {
                head.extend_from_slice(NAMES[next(NAMES.len())]);
                head.push(b':');
                let spaces = next(3);
                head.extend(std::iter::repeat_n(b' ', spaces));
                head.extend_from_slice(VALUES[next(VALUES.len())]);
                head.extend_from_slice(eol);
            }
            head.extend_from_slice(eol);
            // Most heads stay whole; the rest get up to three bytes changed or dropped.
            if round % 2 == 1 {
                crate::http::testing::damage(&mut head, &mut next, &NOISE);
            }
            if next(4) == 0 {
                head.extend_from_slice(b"trailing body bytes");
            }
            let want = by_httparse_request(&head);
            assert_eq!(
                by_lines_request(&head),
                want,
                "{:?}",
                String::from_utf8_lossy(&head)
            );
            requests += usize::from(want.is_some());
            // The request reader: the same, but a head httparse takes with obs-text in a value
            // is refused for it.
            let obs_text = want
                .as_ref()
                .is_some_and(|w| w.3.iter().any(|(_, v)| !v.is_ascii()));
            let ours = by_request_reader(&head);
            if obs_text {
                assert_eq!(ours, Err(LineError::ObsText));
                obs_text_refused += 1;
            } else {
                assert_eq!(ours.unwrap_or(None), want);
            }
            let want = by_httparse_response(&head);
            assert_eq!(
                by_lines_response(&head),
                want,
                "{:?}",
                String::from_utf8_lossy(&head)
            );
            responses += usize::from(want.is_some());
        }
        // Both kinds of head were accepted often, not only refused.
        assert!(
            requests > 5_000 && responses > 5_000 && obs_text_refused > 1_000,
            "{requests} {responses} {obs_text_refused}"
        );
    }
}
