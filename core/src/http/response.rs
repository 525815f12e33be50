//! Upstream response heads.
//!
//! Called by the forward phase as bytes of an upstream response arrive. Takes the bytes read so
//! far and whether the request was HEAD; returns `None` until the head is complete, then a
//! [`ResponseHead`] whose framing follows RFC 9112 §6.3 (HEAD, 1xx, 204 and 304 carry no body;
//! a final `chunked` wins; then Content-Length; else the body runs to the connection's close).
//! Raises [`ResponseError`] for a malformed or oversized head or an invalid Content-Length — a
//! bad upstream, answered 502 to the client.

use super::lines::{LineError, Lines, StatusLine};
use super::{has_token, parse_content_length, BodyFraming, HeaderPos};
use super::{Name, CHUNKED, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};

const CONTENT_TYPE: Name = Name::new(b"content-type");
const EVENT_STREAM: Name = Name::new(b"text/event-stream");

/// Largest upstream response head accepted.
pub(crate) const MAX_RESPONSE_HEAD_BYTES: usize = 64 * 1024;
const MAX_RESPONSE_HEADERS: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResponseError(pub &'static str);

#[derive(Debug, Default)]
pub(crate) struct ResponseHead {
    pub(crate) status: u16,
    pub(crate) minor_version: u8,
    /// Reason phrase range.
    pub(crate) reason: (usize, usize),
    pub(crate) head_len: usize,
    pub(crate) headers: Vec<HeaderPos>,
    pub(crate) body: Option<BodyFraming>,
    /// The upstream will keep the connection open after this response.
    pub(crate) keep_alive: bool,
    /// `Content-Type: text/event-stream`.
    pub(crate) event_stream: bool,
    /// A `Connection` field names headers for this hop only ([`super::names_options`]).
    pub(crate) connection_options: bool,
}

impl ResponseHead {
    pub(crate) fn framing(&self) -> BodyFraming {
        self.body.unwrap_or(BodyFraming::UntilClose)
    }
}

/// Parse a response head from `buf`. `Ok(false)` means more bytes are needed.
pub(crate) fn parse_response_head(
    buf: &[u8],
    request_was_head: bool,
    head: &mut ResponseHead,
) -> Result<bool, ResponseError> {
    let (line, head_len) = match read_lines(buf, &mut head.headers) {
        Ok(Some(done)) => done,
        Ok(None) => {
            if buf.len() > MAX_RESPONSE_HEAD_BYTES {
                return Err(ResponseError("upstream response head too large"));
            }
            return Ok(false);
        }
        Err(LineError::TooManyHeaders) => {
            return Err(ResponseError("upstream response has too many headers"))
        }
        Err(_) => return Err(ResponseError("malformed upstream response head")),
    };
    if head_len > MAX_RESPONSE_HEAD_BYTES {
        return Err(ResponseError("upstream response head too large"));
    }
    let (status, minor) = (line.code, line.minor_version);
    head.status = status;
    head.minor_version = minor;
    head.reason = line.reason;
    head.head_len = head_len;
    head.keep_alive = minor == 1;
    head.event_stream = false;
    head.connection_options = false;

    let mut content_length: Option<u64> = None;
    let mut transfer_encoding: Option<&[u8]> = None;
    for field in head.headers.iter() {
        let name = field.name(buf);
        let value = field.value(buf);
        if CONTENT_LENGTH.matches(name) {
            let n = parse_content_length(value)
                .ok_or(ResponseError("invalid Content-Length from upstream"))?;
            if content_length.is_some_and(|prev| prev != n) {
                return Err(ResponseError("conflicting Content-Length from upstream"));
            }
            content_length = Some(n);
        } else if TRANSFER_ENCODING.matches(name) {
            transfer_encoding = Some(value);
        } else if CONNECTION.matches(name) {
            if has_token(value, b"close") {
                head.keep_alive = false;
            } else if minor == 0 && has_token(value, b"keep-alive") {
                head.keep_alive = true;
            }
            head.connection_options |= super::names_options(value);
        } else if CONTENT_TYPE.matches(name) {
            head.event_stream = value.get(..17).is_some_and(|v| EVENT_STREAM.matches(v));
        }
    }
    head.body = Some(
        if request_was_head || (100..200).contains(&status) || status == 204 || status == 304 {
            BodyFraming::None
        } else if let Some(te) = transfer_encoding {
            let last = te.rsplit(|&b| b == b',').next().unwrap_or(b"");
            if CHUNKED.matches(super::trim_ows(last)) {
                BodyFraming::Chunked
            } else {
                BodyFraming::UntilClose
            }
        } else {
            match content_length {
                Some(0) => BodyFraming::None,
                Some(n) => BodyFraming::Length(n),
                None => BodyFraming::UntilClose,
            }
        },
    );
    if head.framing() == BodyFraming::UntilClose {
        head.keep_alive = false;
    }
    Ok(true)
}

/// The status line, and the fields into `fields`, with the head's length; `None` while the
/// blank line has not arrived.
fn read_lines(
    buf: &[u8],
    fields: &mut Vec<HeaderPos>,
) -> Result<Option<(StatusLine, usize)>, LineError> {
    let lines = Lines::new(buf);
    let Some(line) = lines.status_line()? else {
        return Ok(None);
    };
    fields.clear();
    // A provider's answer has two dozen fields: one allocation for them (a head is new for each
    // answer), not a doubling every few.
    if fields.capacity() == 0 {
        fields.reserve(32);
    }
    let len = lines.fields(line.fields_at, MAX_RESPONSE_HEADERS, fields)?;
    Ok(len.map(|len| (line, len)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn parse(raw: &[u8], was_head: bool) -> ResponseHead {
        let mut h = ResponseHead::default();
        assert!(parse_response_head(raw, was_head, &mut h).unwrap());
        h
    }

    #[test]
    fn framing_rules() {
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", false).framing(),
            BodyFraming::Length(5)
        );
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", true).framing(),
            BodyFraming::None
        );
        assert_eq!(
            parse(b"HTTP/1.1 204 No Content\r\n\r\n", false).framing(),
            BodyFraming::None
        );
        let h = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream; charset=utf-8\r\n\r\n", false);
        assert_eq!(h.framing(), BodyFraming::Chunked);
        assert!(h.event_stream && h.keep_alive);
        let h = parse(b"HTTP/1.1 200 OK\r\n\r\n", false);
        assert_eq!(h.framing(), BodyFraming::UntilClose);
        assert!(!h.keep_alive);
        let mut h = ResponseHead::default();
        assert!(!parse_response_head(b"HTTP/1.1 200 OK\r\n", false, &mut h).unwrap());
        assert!(parse_response_head(
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            false,
            &mut h
        )
        .is_err());
    }
}
