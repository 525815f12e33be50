//! The chunked transfer coding (RFC 9112 §7.1): a streaming decoder and the encoder's framing.
//!
//! Used on workers for chunked request bodies (decoded into the body buffer) and chunked upstream
//! responses (decoded as they arrive, re-framed for the client). The decoder keeps its position
//! between calls, so chunk-size lines, CRLFs and trailers may be split across reads anywhere; it
//! never holds data back. Raises [`ChunkError`] for a malformed size (no hex digits, more than 15
//! of them, a sign, `0x`, whitespace), a bare CR or LF, control bytes in an extension or trailer,
//! or an extension / trailer section over its bound. Extensions and trailers are accepted and
//! dropped.

/// Bounds on metadata the decoder skips over.
const MAX_EXTENSION_BYTES: usize = 4096;
const MAX_TRAILER_BYTES: usize = 16384;
/// 15 hex digits: up to 2^60 - 1 bytes, far above any body limit, and no overflow.
const MAX_SIZE_DIGITS: u32 = 15;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkError(pub &'static str);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Size { value: u64, digits: u32 },
    Extension { value: u64, len: usize },
    SizeLf { value: u64 },
    Data { remaining: u64 },
    DataCr,
    DataLf,
    TrailerLineStart,
    TrailerLine,
    TrailerLf,
    FinalLf,
    Done,
}

#[derive(Debug, Clone)]
pub(crate) struct ChunkedDecoder {
    state: State,
    trailer_bytes: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        ChunkedDecoder {
            state: State::Size {
                value: 0,
                digits: 0,
            },
            trailer_bytes: 0,
        }
    }
}

impl ChunkedDecoder {
    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Decode as much of `input` as forms the message; data pieces go to `on_data` in order.
    /// Returns how many bytes of `input` belonged to the message: all of it unless the message
    /// ended inside `input` (then the rest is the next message's, or garbage).
    pub(crate) fn decode(
        &mut self,
        input: &[u8],
        mut on_data: impl FnMut(&[u8]),
    ) -> Result<usize, ChunkError> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                State::Size { value, digits } => {
                    self.size_byte(b, value, digits)?;
                    i += 1;
                }
                State::Extension { value, len } => i += self.extension(&input[i..], value, len)?,
                State::SizeLf { value } => {
                    expect_byte(b, b'\n', "bare CR after chunk size")?;
                    i += 1;
                    self.state = if value == 0 {
                        State::TrailerLineStart
                    } else {
                        State::Data { remaining: value }
                    };
                }
                State::Data { remaining } => i += self.data(&input[i..], remaining, &mut on_data),
                State::DataCr => {
                    expect_byte(b, b'\r', "missing CRLF after chunk data")?;
                    i += 1;
                    self.state = State::DataLf;
                }
                State::DataLf => {
                    expect_byte(b, b'\n', "missing CRLF after chunk data")?;
                    i += 1;
                    self.state = State::Size {
                        value: 0,
                        digits: 0,
                    };
                }
                State::TrailerLineStart => {
                    self.trailer_line_start(b)?;
                    i += 1;
                }
                State::TrailerLine => i += self.trailer_line(&input[i..])?,
                State::TrailerLf => {
                    expect_byte(b, b'\n', "bare CR in trailer")?;
                    i += 1;
                    self.state = State::TrailerLineStart;
                }
                State::FinalLf => {
                    expect_byte(b, b'\n', "bare CR at end of chunked body")?;
                    self.state = State::Done;
                    return Ok(i + 1);
                }
                State::Done => return Ok(i),
            }
        }
        Ok(i)
    }

    /// One byte `b` of a chunk-size line, `value` read from its `digits` hex digits so far:
    /// another digit, or the `;` of an extension or the CR that ends the size.
    #[inline(always)]
    fn size_byte(&mut self, b: u8, value: u64, digits: u32) -> Result<(), ChunkError> {
        let digit = match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        };
        match digit {
            Some(d) => {
                if digits >= MAX_SIZE_DIGITS {
                    return Err(ChunkError("chunk size too large"));
                }
                self.state = State::Size {
                    value: value * 16 + u64::from(d),
                    digits: digits + 1,
                };
            }
            None if digits == 0 => return Err(ChunkError("malformed chunk size")),
            None if b == b';' => self.state = State::Extension { value, len: 0 },
            None if b == b'\r' => self.state = State::SizeLf { value },
            None => return Err(ChunkError("malformed chunk size")),
        }
        Ok(())
    }

    /// A chunk extension, `len` bytes of it before `rest`: skipped quickly up to and through
    /// its CR, its bytes checked to be visible text. Takes what it skipped.
    #[inline(always)]
    fn extension(&mut self, rest: &[u8], value: u64, len: usize) -> Result<usize, ChunkError> {
        let end = memchr::memchr(b'\r', rest).unwrap_or(rest.len());
        if rest[..end]
            .iter()
            .any(|&c| c == b'\n' || (c < 0x20 && c != b'\t'))
        {
            return Err(ChunkError("control character in chunk extension"));
        }
        let len = len + end;
        if len > MAX_EXTENSION_BYTES {
            return Err(ChunkError("chunk extension too long"));
        }
        if end < rest.len() {
            self.state = State::SizeLf { value };
            Ok(end + 1)
        } else {
            self.state = State::Extension { value, len };
            Ok(end)
        }
    }

    /// Chunk data, `remaining` bytes of it still to come: what `rest` has of it to `on_data`.
    /// Takes what it passed on.
    #[inline(always)]
    fn data(&mut self, rest: &[u8], remaining: u64, on_data: &mut impl FnMut(&[u8])) -> usize {
        let avail = rest.len() as u64;
        let take = remaining.min(avail) as usize;
        on_data(&rest[..take]);
        let left = remaining - take as u64;
        self.state = if left == 0 {
            State::DataCr
        } else {
            State::Data { remaining: left }
        };
        take
    }

    /// The first byte `b` of a trailer line: the CR of the blank line that ends the body, or
    /// the start of a trailer field.
    #[inline(always)]
    fn trailer_line_start(&mut self, b: u8) -> Result<(), ChunkError> {
        self.state = match b {
            b'\r' => State::FinalLf,
            b'\n' => return Err(ChunkError("bare LF in trailer")),
            _ => {
                self.trailer_bytes += 1;
                State::TrailerLine
            }
        };
        Ok(())
    }

    /// A trailer field line: skipped up to and through its CR, within the trailer section's
    /// bound and with no LF or NUL. Takes what it skipped.
    #[inline(always)]
    fn trailer_line(&mut self, rest: &[u8]) -> Result<usize, ChunkError> {
        let end = memchr::memchr(b'\r', rest).unwrap_or(rest.len());
        if rest[..end].iter().any(|&c| c == b'\n' || c == 0) {
            return Err(ChunkError("bare LF or NUL in trailer"));
        }
        self.trailer_bytes += end;
        if self.trailer_bytes > MAX_TRAILER_BYTES {
            return Err(ChunkError("trailer section too large"));
        }
        if end < rest.len() {
            self.state = State::TrailerLf;
            Ok(end + 1)
        } else {
            Ok(end)
        }
    }
}

/// `b`, where the framing has `want`: `error` when it is anything else.
#[inline(always)]
fn expect_byte(b: u8, want: u8, error: &'static str) -> Result<(), ChunkError> {
    if b != want {
        return Err(ChunkError(error));
    }
    Ok(())
}

/// Frame `data` as one chunk into `out`: `{len:x}\r\n{data}\r\n`. Empty data writes nothing
/// (an empty chunk would end the body).
pub(crate) fn encode_chunk(data: &[u8], out: &mut Vec<u8>) {
    if data.is_empty() {
        return;
    }
    let mut size = [0u8; 16];
    let mut n = data.len();
    let mut at = size.len();
    while n > 0 {
        at -= 1;
        size[at] = b"0123456789abcdef"[n & 15];
        n >>= 4;
    }
    out.extend_from_slice(&size[at..]);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The last chunk of a body, with no trailers.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn decode_all(input: &[u8]) -> Result<(Vec<u8>, usize, bool), ChunkError> {
        let mut d = ChunkedDecoder::default();
        let mut out = Vec::new();
        let n = d.decode(input, |b| out.extend_from_slice(b))?;
        Ok((out, n, d.is_done()))
    }

    #[test]
    fn decodes_with_extensions_and_trailers() {
        let body = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-t: 1\r\n\r\nNEXT";
        let (out, n, done) = decode_all(body).unwrap();
        assert_eq!(out, b"hello world");
        assert!(done);
        assert_eq!(&body[n..], b"NEXT");
    }

    #[test]
    fn every_split_point_gives_same_result() {
        let body = b"5;a=b\r\nhello\r\nA\r\n0123456789\r\n0\r\nt: v\r\n\r\n";
        for cut in 0..body.len() {
            let mut d = ChunkedDecoder::default();
            let mut out = Vec::new();
            let a = d
                .decode(&body[..cut], |b| out.extend_from_slice(b))
                .unwrap();
            assert_eq!(a, cut);
            d.decode(&body[cut..], |b| out.extend_from_slice(b))
                .unwrap();
            assert!(d.is_done(), "cut {cut}");
            assert_eq!(out, b"hello0123456789");
        }
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            &b"zz\r\n"[..],
            b"-1\r\n",
            b" 5\r\nhello\r\n",
            b"0x5\r\nhello\r\n",
            b"1000000000000000\r\n",
            b"5\nhello\r\n",
            b"5\r\nhelloXY",
            b"\r\n",
            b"0\r\nbad\ntrailer\r\n\r\n",
        ] {
            assert!(
                decode_all(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn encodes() {
        let mut out = Vec::new();
        encode_chunk(&[b'x'; 26], &mut out);
        assert!(out.starts_with(b"1a\r\nxxxx"));
        assert!(out.ends_with(b"x\r\n"));
    }
}
