//! The strict HTTP/1.1 layer: request heads from clients, response heads from upstreams, and the
//! chunked transfer coding in both directions.
//!
//! Runs on workers, on bytes already read; it does no I/O. Request heads are checked per RFC 9112
//! with no leniency that request smuggling could use (see [`request`]); response heads from
//! upstreams are parsed tolerantly but framed exactly (see [`response`]). A refused request head
//! is an [`HttpError`] carrying the status the client must see; this layer knows nothing of the
//! gateway that answers it.

pub(crate) mod chunked;
mod lines;
pub(crate) mod pass;
pub(crate) mod request;
pub(crate) mod response;
#[cfg(test)]
mod testing;

/// The reason phrase of a status Sluice answers with (or relays without one of its own).
pub(crate) fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        414 => "URI Too Long",
        417 => "Expectation Failed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        // nginx's, for a client that closed its request (never written: the client is gone).
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// The start of a response head Sluice writes itself: status line, content type and length.
/// The caller adds its own fields and the blank line.
pub(crate) fn write_head_start<W: std::fmt::Write>(
    out: &mut W,
    status: u16,
    content_type: &str,
    content_length: usize,
) -> std::fmt::Result {
    write!(
        out,
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {content_length}\r\n",
        reason(status)
    )
}

/// `n` in decimal at the end of `out`: a head's status, length or overhead figure. `write!`
/// would do it through the formatting machinery, ~250 instructions a number on every request.
pub(crate) fn push_decimal(out: &mut Vec<u8>, n: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// A byte buffer written as text (`fmt::Write`), for heads laid out with `write!`.
pub(crate) struct VecText<'a>(pub &'a mut Vec<u8>);

impl std::fmt::Write for VecText<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// Bounds on what a client may send, checked while the head and body are read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HttpLimits {
    pub(crate) max_request_line_bytes: usize,
    pub(crate) max_header_bytes: usize,
    pub(crate) max_headers: usize,
    pub(crate) max_body_bytes: usize,
    /// Most JSON values in a body translated between dialects (see
    /// [`Shape`](crate::openai::anthropic::bound::Shape)).
    pub(crate) max_translated_json_values: usize,
}

/// Why a request head (or its declared body) is refused. Each kind says its status; after any
/// of them the connection is closed, since the rest of the request can't be trusted or was not
/// read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HttpError {
    /// A bound was passed: 414 (request line), 431 (head size, field count), 413 (body).
    Limit { status: u16, message: &'static str },
    /// Not well-formed HTTP/1.1 (or framing smuggling could use): 400.
    Malformed(String),
    /// An `Expect` other than `100-continue`: 417.
    ExpectationFailed,
}

impl HttpError {
    fn limit(status: u16, message: &'static str) -> HttpError {
        HttpError::Limit { status, message }
    }

    fn malformed(message: impl Into<String>) -> HttpError {
        HttpError::Malformed(message.into())
    }

    /// The status the client gets.
    #[cfg(test)]
    pub(crate) fn status(&self) -> u16 {
        match self {
            HttpError::Limit { status, .. } => *status,
            HttpError::Malformed(_) => 400,
            HttpError::ExpectationFailed => 417,
        }
    }
}

/// A header's name and value as byte ranges into the buffer the head was parsed from, so
/// parsing allocates nothing per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeaderPos {
    pub(crate) name: (u32, u32),
    pub(crate) value: (u32, u32),
}

impl HeaderPos {
    pub(crate) fn name<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.name.0 as usize..self.name.1 as usize]
    }
    pub(crate) fn value<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.value.0 as usize..self.value.1 as usize]
    }
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    /// No body at all.
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// Transfer-Encoding: chunked.
    Chunked,
    /// Until the connection closes (responses only).
    UntilClose,
}

pub(crate) const CONTENT_LENGTH: Name = Name::new(b"content-length");
pub(crate) const TRANSFER_ENCODING: Name = Name::new(b"transfer-encoding");
pub(crate) const CONNECTION: Name = Name::new(b"connection");
pub(crate) const CHUNKED: Name = Name::new(b"chunked");

/// Hop-by-hop headers (RFC 9110 §7.6.1) and framing headers: never forwarded as received,
/// since each hop sets its own.
pub(crate) fn is_hop_by_hop(name: &[u8]) -> bool {
    const HOP: NameSet = NameSet::new(&[
        CONNECTION,
        Name::new(b"keep-alive"),
        Name::new(b"proxy-connection"),
        Name::new(b"proxy-authenticate"),
        Name::new(b"proxy-authorization"),
        Name::new(b"te"),
        Name::new(b"trailer"),
        TRANSFER_ENCODING,
        Name::new(b"upgrade"),
        CONTENT_LENGTH,
    ]);
    HOP.contains(name)
}

/// Whether a `Connection` field's value lists an option besides `close` and `keep-alive`: a
/// header the sender meant for this hop only, which must not be forwarded (RFC 9110 §7.6.1).
/// Read while parsing, so a message without one never looks again.
pub(crate) fn names_options(connection: &[u8]) -> bool {
    connection.split(|&b| b == b',').any(|t| {
        let t = trim_ows(t);
        !t.is_empty() && !t.eq_ignore_ascii_case(b"close") && !t.eq_ignore_ascii_case(b"keep-alive")
    })
}

/// Whether `name` is one of the options the `Connection` fields of `headers` list (see
/// [`names_options`]): a header for this hop only.
pub(crate) fn named_by_connection(headers: &[HeaderPos], buf: &[u8], name: &[u8]) -> bool {
    headers
        .iter()
        .filter(|h| CONNECTION.matches(h.name(buf)))
        .any(|h| has_token(h.value(buf), name))
}

/// A header name (or a token in a header's value) that received bytes are compared with, ASCII
/// case aside, eight bytes at a time ([`Name::matches`]). Built in constants:
/// [`Name::new`] turns away, at compile time, the bytes the word-wise comparison cannot take.
#[derive(Clone, Copy)]
pub(crate) struct Name(&'static [u8]);

impl Name {
    /// Lower-case letters, and bytes with bit 6 clear (digits, `-`, `/`, `.`, …); not upper
    /// case, nor `@`, `[`, `_` and the other bytes from 0x40 that are not lower-case letters.
    pub(crate) const fn new(name: &'static [u8]) -> Name {
        let mut i = 0;
        while i < name.len() {
            let b = name[i];
            assert!(
                b & 0x40 == 0 || b.is_ascii_lowercase(),
                "a Name is lower-case letters and bytes below 0x40 or from 0x80 to 0xbf"
            );
            i += 1;
        }
        Name(name)
    }

    /// `received` is this name, ASCII case aside.
    #[inline]
    pub(crate) fn matches(self, received: &[u8]) -> bool {
        eq_name(received, self.0)
    }
}

/// `received` equals `name` (a [`Name`]'s bytes), ASCII case aside: eight bytes at a time,
/// where `eq_ignore_ascii_case` lower-cases each byte of both (~7 instructions a byte:
/// `content-length` in every request and answer cost ~200 a request). `name`'s letters are its
/// bytes with bit 6 set; setting bit 5 of the received bytes there, and nowhere else, makes an
/// upper-case letter its lower-case one and nothing else equal to `name`'s byte.
#[inline]
fn eq_name(received: &[u8], name: &[u8]) -> bool {
    const BIT6: u64 = 0x4040_4040_4040_4040;
    let word_eq = |r: u64, n: u64| r | ((n & BIT6) >> 1) == n;
    let len = name.len();
    if received.len() != len {
        return false;
    }
    if len < 8 {
        let (mut r, mut n) = ([0u8; 8], [0u8; 8]);
        r[..len].copy_from_slice(received);
        n[..len].copy_from_slice(name);
        return word_eq(u64::from_le_bytes(r), u64::from_le_bytes(n));
    }
    let word = |b: &[u8], at: usize| {
        b.get(at..at + 8)
            .and_then(|w| <[u8; 8]>::try_from(w).ok())
            .map_or(0, u64::from_le_bytes)
    };
    // Whole words, then the last eight bytes (overlapping the words before when the length is
    // not a multiple of eight).
    (0..len / 8).all(|i| word_eq(word(received, 8 * i), word(name, 8 * i)))
        && word_eq(word(received, len - 8), word(name, len - 8))
}

/// A fixed set of header [`Name`]s. Every header of every request and answer is checked
/// against such a set; most (`content-type`, `user-agent`, `accept`) are in none, and a name
/// whose length no member has is turned away on one bit test instead of a comparison with each
/// member.
pub(crate) struct NameSet {
    names: &'static [Name],
    /// Bit `n` set: some member is `n` bytes long.
    lengths: u64,
}

impl NameSet {
    /// Members longer than 63 bytes do not compile.
    pub(crate) const fn new(names: &'static [Name]) -> NameSet {
        let mut lengths = 0u64;
        let mut i = 0;
        while i < names.len() {
            assert!(
                names[i].0.len() < 64,
                "a NameSet member is at most 63 bytes"
            );
            lengths |= 1 << names[i].0.len();
            i += 1;
        }
        NameSet { names, lengths }
    }

    #[inline]
    pub(crate) fn contains(&self, received: &[u8]) -> bool {
        received.len() < 64
            && self.lengths & (1 << received.len()) != 0
            && self.names.iter().any(|n| n.matches(received))
    }
}

/// Parse a Content-Length value strictly: one or more comma-separated runs of digits that all
/// agree (RFC 9110 §8.6). `+5`, `-1`, empty, differing lists and overflow are errors.
pub(crate) fn parse_content_length(value: &[u8]) -> Option<u64> {
    // Nearly every value is one run of digits: read at once, without the list's splitting and
    // trimming (~80 instructions a value, two values a request). Nineteen digits cannot
    // overflow.
    if (1..=19).contains(&value.len()) && value.iter().all(u8::is_ascii_digit) {
        return Some(
            value
                .iter()
                .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0')),
        );
    }
    let mut result: Option<u64> = None;
    for part in value.split(|&b| b == b',') {
        let part = trim_ows(part);
        if part.is_empty() || part.len() > 19 || !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let mut n: u64 = 0;
        for &d in part {
            n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
        }
        match result {
            Some(prev) if prev != n => return None,
            _ => result = Some(n),
        }
    }
    result
}

/// Trim optional whitespace (SP / HTAB) from both ends.
pub(crate) fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// Does a comma-separated header value contain `token` (case-insensitive)?
pub(crate) fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| trim_ows(t).eq_ignore_ascii_case(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_options_are_the_tokens_besides_close_and_keep_alive() {
        assert!(!names_options(b"close"));
        assert!(!names_options(b" Keep-Alive , close "));
        assert!(!names_options(b""));
        assert!(names_options(b"keep-alive, x-hop"));
        assert!(names_options(b"X-Hop"));
        // `buf` holds two Connection fields and the headers they name, any case.
        let buf = b"Connection: close\r\nconnection: X-One ,x-two\r\nx-one: 1\r\n";
        let field = |name: (u32, u32), value: (u32, u32)| HeaderPos { name, value };
        let headers = [field((0, 10), (12, 17)), field((19, 29), (31, 43))];
        assert!(named_by_connection(&headers, buf, b"x-one"));
        assert!(named_by_connection(&headers, buf, b"X-TWO"));
        assert!(!named_by_connection(&headers, buf, b"x-three"));
        assert!(!named_by_connection(&headers, buf, b"x-on"));
    }

    #[test]
    fn content_length_strict() {
        assert_eq!(parse_content_length(b"5"), Some(5));
        assert_eq!(parse_content_length(b"5, 5"), Some(5));
        assert_eq!(parse_content_length(b"0"), Some(0));
        assert_eq!(parse_content_length(b" 7\t"), Some(7));
        assert_eq!(parse_content_length(b"007"), Some(7));
        // Nineteen digits are read, twenty refused (nineteen hold any length a body can have).
        assert_eq!(
            parse_content_length(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        assert_eq!(parse_content_length(b"18446744073709551615"), None);
        for bad in [
            &b"+5"[..],
            b"-1",
            b"",
            b"5,6",
            b"5,",
            b"99999999999999999999999",
            b"18446744073709551616",
            b"0x5",
            b"5 5",
        ] {
            assert_eq!(
                parse_content_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn hop_by_hop_names_in_any_case_and_nothing_else() {
        const HOP: [&str; 10] = [
            "connection",
            "keep-alive",
            "proxy-connection",
            "proxy-authenticate",
            "proxy-authorization",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "content-length",
        ];
        for name in HOP {
            assert!(is_hop_by_hop(name.as_bytes()), "{name}");
            assert!(
                is_hop_by_hop(name.to_ascii_uppercase().as_bytes()),
                "{name}"
            );
            // Same length, one byte off: must not match.
            let mut off = name.as_bytes().to_vec();
            off[0] ^= 0x01;
            assert!(!is_hop_by_hop(&off), "{name} with its first byte changed");
            let mut longer = name.as_bytes().to_vec();
            longer.push(b's');
            assert!(!is_hop_by_hop(&longer), "{name}s");
            assert!(
                !is_hop_by_hop(&name.as_bytes()[1..]),
                "{name} less its first byte"
            );
        }
        for kept in [
            "host",
            "authorization",
            "content-type",
            "x-request-id",
            "user-agent",
            "",
        ] {
            assert!(!is_hop_by_hop(kept.as_bytes()), "{kept}");
        }
    }

    /// Against `eq_ignore_ascii_case`: every length up to 63 bytes, names of letters and of
    /// the bytes below 0x40 (digits, `-`, `/`, `.`), every byte value in every position.
    #[test]
    fn a_name_compares_as_eq_ignore_ascii_case_does() {
        let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789-/.:";
        for len in 1..64 {
            let name: Vec<u8> = (0..len).map(|i| alphabet[(i * 7 + len) % 40]).collect();
            assert!(eq_name(&name.to_ascii_uppercase(), &name));
            for at in 0..len {
                let mut received = name.clone();
                for b in 0..=255u8 {
                    received[at] = b;
                    assert_eq!(
                        eq_name(&received, &name),
                        received.eq_ignore_ascii_case(&name),
                        "{received:?} against {name:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_name_set_matches_its_members_in_any_case_and_nothing_else() {
        const LONGEST: &[u8] = &[b'x'; 63];
        const SET: NameSet = NameSet::new(&[
            Name::new(b"te"),
            Name::new(b"trailer"),
            Name::new(b"upgrade"),
            Name::new(LONGEST),
        ]);
        for member in [&b"te"[..], b"trailer", b"upgrade", LONGEST] {
            assert!(SET.contains(member));
            assert!(SET.contains(&member.to_ascii_uppercase()));
            // A member's length, other bytes.
            let mut other = member.to_vec();
            other[member.len() - 1] ^= 0x01;
            assert!(!SET.contains(&other), "{other:?}");
        }
        // Lengths no member has, up to and past the mask's 64 bits.
        for len in [0, 1, 3, 6, 8, 62, 64, 65, 1_000] {
            assert!(!SET.contains(&vec![b'x'; len]), "{len} bytes");
        }
    }

    #[test]
    fn tokens() {
        assert!(has_token(b"keep-alive, Close", b"close"));
        assert!(!has_token(b"closed", b"close"));
    }
}
