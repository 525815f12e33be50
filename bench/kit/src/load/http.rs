//! Reading one HTTP/1.1 response: head, Content-Length or chunked body, SSE events.
//!
//! Both engines feed [`Response`] the bytes of each read as they arrive (borrowed slices: the
//! thread engine's read buffer, the io_uring engine's provided buffer), with the time of that
//! read. "One read" is the unit the SSE coalescing count is about, so both engines must call
//! [`Response::feed`] exactly once per read.

use std::io;

/// Error kinds, in the order of [`KINDS`].
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Connect = 0,
    Status3xx = 1,
    Status4xx = 2,
    Status5xx = 3,
    Timeout = 4,
    Protocol = 5,
    Io = 6,
}

/// The JSON names of the error kinds, indexed by [`Kind`].
pub(crate) const KINDS: [&str; 7] = [
    "connect",
    "status_3xx",
    "status_4xx",
    "status_5xx",
    "timeout",
    "protocol",
    "io",
];

pub(crate) struct Fail(pub(crate) Kind, pub(crate) String);

pub(crate) fn io_fail(e: io::Error) -> Fail {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Fail(Kind::Timeout, e.to_string()),
        _ => Fail(Kind::Io, e.to_string()),
    }
}

pub(crate) fn proto(msg: impl Into<String>) -> Fail {
    Fail(Kind::Protocol, msg.into())
}

/// A response head larger than this is a protocol error.
const MAX_HEAD: usize = 64 * 1024;

/// Incremental chunked-body decoder. The size and trailer lines are gathered in `line`, which
/// keeps its capacity from one response to the next.
#[derive(Default)]
struct Chunked {
    st: ChunkState,
    line: Vec<u8>,
}

#[derive(Default, PartialEq)]
enum ChunkState {
    #[default]
    Size,
    Data(u64),
    DataEnd(u8),
    Trailer,
    Done,
}

impl Chunked {
    fn reset(&mut self) {
        self.st = ChunkState::Size;
        self.line.clear();
    }

    /// Feed raw bytes; decoded data goes to `out`. Returns how many input bytes were consumed
    /// (less than `input.len()` only once the body is complete).
    fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, Fail> {
        let mut i = 0;
        while i < input.len() {
            match &mut self.st {
                ChunkState::Done => return Ok(i),
                ChunkState::Size => {
                    let b = input[i];
                    i += 1;
                    if b == b'\n' {
                        let line = &self.line;
                        let l = line.strip_suffix(b"\r").unwrap_or(line);
                        let hex = l.split(|&c| c == b';').next().unwrap_or(b"");
                        let hex = std::str::from_utf8(hex)
                            .map_err(|_| proto("bad chunk size"))?
                            .trim();
                        let n = u64::from_str_radix(hex, 16)
                            .map_err(|_| proto(format!("bad chunk size {hex:?}")))?;
                        self.line.clear();
                        self.st = if n == 0 {
                            ChunkState::Trailer
                        } else {
                            ChunkState::Data(n)
                        };
                    } else {
                        if self.line.len() > 1024 {
                            return Err(proto("chunk size line too long"));
                        }
                        self.line.push(b);
                    }
                }
                ChunkState::Data(rem) => {
                    let avail = (input.len() - i) as u64;
                    let take = avail.min(*rem) as usize;
                    out.extend_from_slice(&input[i..i + take]);
                    i += take;
                    *rem -= take as u64;
                    if *rem == 0 {
                        self.st = ChunkState::DataEnd(0);
                    }
                }
                ChunkState::DataEnd(seen) => {
                    let b = input[i];
                    i += 1;
                    match (*seen, b) {
                        (0, b'\r') => *seen = 1,
                        (_, b'\n') => self.st = ChunkState::Size,
                        _ => return Err(proto("missing CRLF after chunk data")),
                    }
                }
                ChunkState::Trailer => {
                    let b = input[i];
                    i += 1;
                    if b == b'\n' {
                        let empty = self.line.is_empty() || self.line.as_slice() == b"\r";
                        self.line.clear();
                        if empty {
                            self.st = ChunkState::Done;
                        }
                    } else {
                        if self.line.len() > 8192 {
                            return Err(proto("trailer line too long"));
                        }
                        self.line.push(b);
                    }
                }
            }
        }
        Ok(i)
    }
}

/// Splits decoded SSE bytes into lines and counts `data:` events.
#[derive(Default)]
struct Sse {
    line: Vec<u8>,
}

impl Sse {
    /// Returns (data events, content-carrying data events) completed in `bytes`.
    fn feed(&mut self, bytes: &[u8]) -> (u32, u32) {
        let (mut data, mut content) = (0, 0);
        for &b in bytes {
            if b == b'\n' {
                if let Some(rest) = self.line.strip_prefix(b"data:") {
                    data += 1;
                    if has_content(rest) {
                        content += 1;
                    }
                }
                self.line.clear();
            } else if self.line.len() < 64 * 1024 {
                self.line.push(b);
            }
        }
        (data, content)
    }
}

/// Whether an SSE data payload carries generated text: a non-empty `"content"` or `"text"`
/// string (chat / completions), or a `"delta"` string (Responses API).
fn has_content(data: &[u8]) -> bool {
    for key in [&b"\"content\":\""[..], b"\"text\":\"", b"\"delta\":\""] {
        if let Some(p) = memchr::memmem::find(data, key) {
            if data.get(p + key.len()).is_some_and(|&c| c != b'"') {
                return true;
            }
        }
    }
    false
}

/// Whether `hay` contains `needle` (lower case ASCII), ignoring ASCII case.
fn contains_ci(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

enum Framing {
    Length(u64),
    Chunked,
}

enum Head {
    Partial,
    /// A 1xx interim response of this many bytes, to be skipped.
    Interim(usize),
    Complete {
        status: u16,
        keep_alive: bool,
        framing: Framing,
        len: usize,
    },
}

fn parse_head(buf: &[u8]) -> Result<Head, Fail> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(buf) {
        Ok(httparse::Status::Partial) => return Ok(Head::Partial),
        Err(e) => return Err(proto(format!("bad response head: {e}"))),
        Ok(httparse::Status::Complete(n)) => n,
    };
    let status = resp.code.unwrap_or(0);
    if (100..200).contains(&status) {
        // Interim response (100 Continue): skip it.
        return Ok(Head::Interim(head_len));
    }
    let mut keep_alive = resp.version == Some(1);
    let mut len = None;
    let mut chunked = false;
    for h in resp.headers.iter() {
        let v = String::from_utf8_lossy(h.value);
        if h.name.eq_ignore_ascii_case("content-length") {
            len = Some(
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| proto("bad Content-Length"))?,
            );
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.trim().eq_ignore_ascii_case("chunked");
            if !chunked {
                return Err(proto(format!("unsupported transfer coding {v}")));
            }
        } else if h.name.eq_ignore_ascii_case("connection") {
            if contains_ci(h.value, b"close") {
                keep_alive = false;
            } else if contains_ci(h.value, b"keep-alive") {
                keep_alive = true;
            }
        }
    }
    let framing = if status == 204 || status == 304 {
        Framing::Length(0)
    } else if chunked {
        Framing::Chunked
    } else if let Some(l) = len {
        Framing::Length(l)
    } else {
        return Err(proto("response without Content-Length or chunked framing"));
    };
    Ok(Head::Complete {
        status,
        keep_alive,
        framing,
        len: head_len,
    })
}

/// Whether a fed read completed the response.
#[derive(PartialEq)]
pub(crate) enum Fed {
    More,
    Done,
}

/// One response being read, and what was measured about it. All times are nanoseconds of
/// [`crate::mono_ns`]; durations are measured from the `start` each feed is given (the
/// intended send time in open loop). One per connection, reused: its buffers keep their
/// capacity, so a warm connection allocates nothing per request.
#[derive(Default)]
pub(crate) struct Response {
    stream: bool,
    in_head: bool,
    done: bool,
    /// The head so far, when it spans reads (a head within one read is parsed where it lies).
    head: Vec<u8>,
    framing_chunked: bool,
    length_left: u64,
    chunked: Chunked,
    sse: Sse,
    sse_on: bool,
    decoded: Vec<u8>,
    last_event: Option<u64>,
    pub(crate) status: u16,
    pub(crate) keep_alive: bool,
    pub(crate) ttfb: u64,
    pub(crate) first_event: Option<u64>,
    /// Gaps between reads that delivered content events.
    pub(crate) gaps: Vec<u64>,
    pub(crate) content_events: u64,
    pub(crate) coalesced_events: u64,
    pub(crate) coalesced_reads: u64,
}

impl Response {
    /// Get ready for the response to a new request (`stream`: SSE is parsed if it is 2xx).
    pub(crate) fn begin(&mut self, stream: bool) {
        self.stream = stream;
        self.in_head = true;
        self.done = false;
        self.head.clear();
        self.framing_chunked = false;
        self.length_left = 0;
        self.chunked.reset();
        self.sse.line.clear();
        self.sse_on = false;
        self.last_event = None;
        self.status = 0;
        self.keep_alive = false;
        self.ttfb = 0;
        self.first_event = None;
        self.gaps.clear();
        self.content_events = 0;
        self.coalesced_events = 0;
        self.coalesced_reads = 0;
    }

    /// What an end of stream before the response was complete means, as an error.
    pub(crate) fn eof_fail(&self) -> Fail {
        if self.in_head {
            Fail(Kind::Io, "connection closed before the response".into())
        } else {
            Fail(Kind::Io, "connection closed mid-body".into())
        }
    }

    /// Feed the bytes of one read (not empty), made at `now`, for a request timed from `start`.
    /// Bytes past the end of the response make the connection unfit for another request
    /// (`keep_alive` becomes false).
    pub(crate) fn feed(&mut self, bytes: &[u8], now: u64, start: u64) -> Result<Fed, Fail> {
        if self.done {
            // More bytes after a complete response: nothing to read them as.
            self.keep_alive = false;
            return Ok(Fed::Done);
        }
        if self.ttfb == 0 {
            self.ttfb = now.saturating_sub(start).max(1);
        }
        let mut off = 0;
        if self.in_head {
            match self.read_head(bytes)? {
                None => return Ok(Fed::More),
                Some(o) => off = o,
            }
        }
        self.read_body(&bytes[off..], now, start)
    }

    /// Parse the head from this read (and what earlier reads left in `head`). Returns where the
    /// body starts in `bytes`, or None while the head is incomplete.
    fn read_head(&mut self, bytes: &[u8]) -> Result<Option<usize>, Fail> {
        let mut off = 0;
        loop {
            let spanning = !self.head.is_empty();
            if spanning {
                self.head.extend_from_slice(&bytes[off..]);
                off = bytes.len();
            }
            let buf = if spanning {
                &self.head[..]
            } else {
                &bytes[off..]
            };
            // Where, in `bytes`, the byte after a head of `n` bytes lies: all earlier reads
            // were head, so what follows it in `head` is the tail of this read.
            let after = |n: usize| bytes.len() - (buf.len() - n);
            match parse_head(buf)? {
                Head::Partial => {
                    if buf.len() > MAX_HEAD {
                        return Err(proto("response head too large"));
                    }
                    if !spanning {
                        self.head.extend_from_slice(&bytes[off..]);
                    }
                    return Ok(None);
                }
                Head::Interim(n) => {
                    off = after(n);
                    self.head.clear();
                    if off == bytes.len() {
                        return Ok(None);
                    }
                }
                Head::Complete {
                    status,
                    keep_alive,
                    framing,
                    len,
                } => {
                    off = after(len);
                    self.head.clear();
                    self.in_head = false;
                    self.status = status;
                    self.keep_alive = keep_alive;
                    match framing {
                        Framing::Length(n) => self.length_left = n,
                        Framing::Chunked => self.framing_chunked = true,
                    }
                    self.sse_on = self.stream && (200..300).contains(&status);
                    return Ok(Some(off));
                }
            }
        }
    }

    fn read_body(&mut self, avail: &[u8], now: u64, start: u64) -> Result<Fed, Fail> {
        let mut decoded = std::mem::take(&mut self.decoded);
        decoded.clear();
        let (used, done, data): (usize, bool, &[u8]) = if self.framing_chunked {
            let used = self.chunked.feed(avail, &mut decoded);
            let used = match used {
                Ok(u) => u,
                Err(e) => {
                    self.decoded = decoded;
                    return Err(e);
                }
            };
            (used, self.chunked.st == ChunkState::Done, &decoded[..])
        } else {
            let take = (avail.len() as u64).min(self.length_left) as usize;
            self.length_left -= take as u64;
            (take, self.length_left == 0, &avail[..take])
        };
        if self.sse_on && !data.is_empty() {
            let (_, content) = self.sse.feed(data);
            if content > 0 {
                self.content_events += u64::from(content);
                if self.first_event.is_none() {
                    self.first_event = Some(now.saturating_sub(start));
                }
                if let Some(prev) = self.last_event {
                    self.gaps.push(now.saturating_sub(prev));
                }
                self.last_event = Some(now);
                if content > 1 {
                    self.coalesced_reads += 1;
                    self.coalesced_events += u64::from(content - 1);
                }
            }
        }
        self.decoded = decoded;
        if !done {
            return Ok(Fed::More);
        }
        self.done = true;
        if used < avail.len() {
            // Extra bytes after the response: the connection can't be trusted any more.
            self.keep_alive = false;
        }
        Ok(Fed::Done)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(reads: &[&[u8]], stream: bool) -> Response {
        let mut r = Response::default();
        r.begin(stream);
        let mut t = 100;
        for (i, b) in reads.iter().enumerate() {
            t += 1000;
            let fed = r.feed(b, t, 0).ok().unwrap();
            assert_eq!(fed == Fed::Done, i == reads.len() - 1, "read {i}");
        }
        r
    }

    /// `payload` as one chunk.
    fn chunk(payload: &str) -> String {
        format!("{:x}\r\n{payload}\r\n", payload.len())
    }

    #[test]
    fn head_in_pieces_interim_and_chunked_sse() {
        let ev = |c: &str| chunk(&format!("data: {{\"content\":\"{c}\"}}\n\n"));
        let role = chunk("data: {\"role\":\"assistant\",\"content\":\"\"}\n\n");
        let two = ev("a") + &ev("b");
        let last = ev("c") + "0\r\nx: 1\r\n\r\n";
        let r = run(
            &[
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Enc",
                b"oding: chunked\r\n\r\n",
                role.as_bytes(),
                two.as_bytes(),
                last.as_bytes(),
            ],
            true,
        );
        assert_eq!(r.status, 200);
        assert!(r.keep_alive);
        assert_eq!(r.ttfb, 1100);
        assert_eq!(r.content_events, 3);
        assert_eq!((r.coalesced_reads, r.coalesced_events), (1, 1));
        assert_eq!(r.first_event, Some(4100));
        assert_eq!(r.gaps, vec![1000]);
    }

    #[test]
    fn length_body_extra_bytes_and_close() {
        let r = run(&[b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}x"], false);
        assert!(!r.keep_alive);
        let r = run(
            &[b"HTTP/1.1 503 No\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n"],
            false,
        );
        assert_eq!(r.status, 503);
        assert!(!r.keep_alive);
        let mut r = Response::default();
        r.begin(false);
        assert!(r.feed(b"HTTP/1.1 200 OK\r\n\r\n", 1, 0).is_err());
        r.begin(true);
        let bad = r.feed(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            1,
            0,
        );
        assert!(matches!(bad, Err(Fail(Kind::Protocol, _))));
    }
}
