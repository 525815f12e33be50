//! The HTTP/1.1 client: strict, timed, able to send anything and read what came back piece by piece.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Default timeout for any single socket read or write done by the client.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A request builder producing raw bytes. Adds `Host` and `Content-Length` unless told not to.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    auto_host: bool,
    auto_length: bool,
}

impl Req {
    pub fn new(method: &str, target: &str) -> Req {
        Req {
            method: method.to_string(),
            target: target.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
            auto_host: true,
            auto_length: true,
        }
    }

    pub fn get(target: &str) -> Req {
        Req::new("GET", target)
    }

    /// A POST with a JSON body.
    pub fn post(target: &str, body: &str) -> Req {
        Req::new("POST", target)
            .header("Content-Type", "application/json")
            .body(body.as_bytes())
    }

    pub fn header(mut self, name: &str, value: &str) -> Req {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn body(mut self, body: &[u8]) -> Req {
        self.body = body.to_vec();
        self
    }

    /// Do not add a `Host` header.
    pub fn no_host(mut self) -> Req {
        self.auto_host = false;
        self
    }

    /// Do not add a `Content-Length` header (set framing headers yourself).
    pub fn no_length(mut self) -> Req {
        self.auto_length = false;
        self
    }

    /// The request head only (ends with the blank line).
    pub fn build_head(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(format!("{} {} HTTP/1.1\r\n", self.method, self.target).as_bytes());
        if self.auto_host {
            out.extend_from_slice(b"Host: sluice.test\r\n");
        }
        for (k, v) in &self.headers {
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        if self.auto_length && (!self.body.is_empty() || self.method == "POST") {
            out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    /// Head and body.
    pub fn build(&self) -> Vec<u8> {
        let mut out = self.build_head();
        out.extend_from_slice(&self.body);
        out
    }
}

/// Encode `parts` as a chunked body, including the last chunk and final CRLF.
pub fn chunked(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(format!("{:x}\r\n", p.len()).as_bytes());
        out.extend_from_slice(p);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// A response head.
#[derive(Clone, Debug)]
pub struct Head {
    pub version: String,
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
    /// When the end of the head arrived.
    pub at: Instant,
}

impl Head {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    /// All values of header `name`.
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

pub(crate) fn header_in<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// How a response body was delimited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Framing {
    /// No body by definition (HEAD, 1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
    /// Read until the connection closed.
    Close,
}

/// How reading the body ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyEnd {
    /// The framing said the body was complete (or a close-delimited body reached EOF).
    Complete,
    /// The connection closed (EOF) before the framing said the body was complete.
    Truncated,
    /// The connection was reset before the body was complete.
    Reset,
    /// A read timed out before the body was complete.
    Timeout,
    /// The body's framing was invalid (the string says how).
    Malformed(String),
}

/// A piece of body data (a chunk's data, or one read's worth for non-chunked bodies) and when
/// its last byte arrived.
#[derive(Clone, Debug)]
pub struct Piece {
    pub at: Instant,
    pub data: Vec<u8>,
}

/// A full response.
#[derive(Clone, Debug)]
pub struct Response {
    pub version: String,
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
    pub head_at: Instant,
    pub framing: Framing,
    pub body: Vec<u8>,
    pub pieces: Vec<Piece>,
    pub trailers: Vec<(String, String)>,
    pub end: BodyEnd,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    /// Whether header `name` holds the comma-separated token `token` (case-insensitive).
    pub fn header_has_token(&self, name: &str, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .any(|(_, v)| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}); status {}; body: {:?}",
                self.status,
                self.text()
            )
        })
    }

    /// The raw head + body as text, for assertion messages and secret scans.
    pub fn dump(&self) -> String {
        let mut s = format!("{} {} {}\n", self.version, self.status, self.reason);
        for (k, v) in &self.headers {
            let _ = writeln!(s, "{k}: {v}");
        }
        s.push('\n');
        s.push_str(&self.text());
        for (k, v) in &self.trailers {
            let _ = write!(s, "\n{k}: {v}");
        }
        s
    }
}

/// Outcome of waiting for the peer to close.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseState {
    /// Orderly close (read returned 0).
    Eof,
    /// Connection reset.
    Reset,
    /// Nothing arrived and the connection stayed open until the deadline.
    Open,
    /// The peer sent more bytes (shown lossily).
    Data(String),
}

impl CloseState {
    pub fn is_closed(&self) -> bool {
        matches!(self, CloseState::Eof | CloseState::Reset)
    }
}

#[derive(Debug)]
pub enum ReadError {
    /// EOF before any byte of a head.
    Closed,
    /// EOF in the middle of a head.
    Truncated(Vec<u8>),
    Reset,
    Timeout,
    Malformed(String),
    Io(io::Error),
}

pub(crate) fn classify(e: io::Error) -> ReadError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ReadError::Timeout,
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => ReadError::Reset,
        _ => ReadError::Io(e),
    }
}

/// A blocking client connection with read/write timeouts always set. Unconsumed bytes are kept
/// between responses, so keep-alive reuse works. Each read is stamped, so callers can tell when
/// any byte arrived.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Absolute stream offset of `buf[0]`.
    base: u64,
    /// (absolute end offset, arrival instant) of each read, oldest first.
    reads: Vec<(u64, Instant)>,
    timeout: Duration,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        Self::from_stream(stream)
    }

    /// A connection over a socket the caller connected (to handle a connect error itself).
    pub fn from_stream(stream: TcpStream) -> Conn {
        stream.set_nodelay(true).expect("nodelay");
        let mut c = Conn {
            stream,
            buf: Vec::new(),
            base: 0,
            reads: Vec::new(),
            timeout: IO_TIMEOUT,
        };
        c.set_timeout(IO_TIMEOUT);
        c
    }

    /// Set the read and write timeout for subsequent operations (must be non-zero).
    pub fn set_timeout(&mut self, d: Duration) {
        self.timeout = d;
        self.stream.set_read_timeout(Some(d)).expect("read timeout");
        self.stream
            .set_write_timeout(Some(d))
            .expect("write timeout");
    }

    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// A second handle to the socket (e.g. for a writer thread).
    pub fn try_clone_stream(&self) -> TcpStream {
        self.stream.try_clone().expect("clone stream")
    }

    /// Write all bytes; panics on error.
    pub fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes)
            .unwrap_or_else(|e| panic!("send {} bytes: {e}", bytes.len()));
    }

    /// Write all bytes.
    pub fn try_send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Half-close the write side.
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Bytes received but not consumed by a response parser yet.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Read once more from the socket into the buffer; returns the count (0 = EOF).
    pub fn read_more(&mut self) -> io::Result<usize> {
        self.fill()
    }

    /// Read more bytes into the buffer; returns the count (0 = EOF).
    fn fill(&mut self) -> io::Result<usize> {
        let mut tmp = [0u8; 16384];
        let n = loop {
            match self.stream.read(&mut tmp) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        if n > 0 {
            self.buf.extend_from_slice(&tmp[..n]);
            let end = self.base + self.buf.len() as u64;
            self.reads.push((end, Instant::now()));
        }
        Ok(n)
    }

    /// Arrival instant of the byte at absolute offset `off`.
    fn arrival(&self, off: u64) -> Instant {
        self.reads
            .iter()
            .find(|(end, _)| *end > off)
            .or(self.reads.last())
            .map(|(_, t)| *t)
            .unwrap_or_else(Instant::now)
    }

    fn consume(&mut self, n: usize) -> Vec<u8> {
        let out: Vec<u8> = self.buf.drain(..n).collect();
        self.base += n as u64;
        // Forget reads entirely before the new base, keeping the one spanning it.
        let base = self.base;
        let keep_from = self
            .reads
            .iter()
            .position(|(end, _)| *end > base)
            .unwrap_or(self.reads.len());
        self.reads.drain(..keep_from);
        out
    }

    /// Read one response head (which may be a 1xx interim response).
    pub fn read_head(&mut self) -> Result<Head, ReadError> {
        loop {
            if let Some(pos) = find(&self.buf, b"\r\n\r\n") {
                let at = self.arrival(self.base + pos as u64 + 3);
                let raw = self.consume(pos + 4);
                return parse_head(&raw[..pos], at);
            }
            if self.buf.len() > 1 << 20 {
                return Err(ReadError::Malformed("response head over 1 MiB".into()));
            }
            match self.fill() {
                Ok(0) if self.buf.is_empty() => return Err(ReadError::Closed),
                Ok(0) => return Err(ReadError::Truncated(self.buf.clone())),
                Ok(_) => {}
                Err(e) => return Err(classify(e)),
            }
        }
    }

    /// Read a response to a non-HEAD request, skipping interim 1xx responses; panics if no
    /// head arrives.
    pub fn read_response(&mut self) -> Response {
        self.read_response_to("GET")
    }

    /// Like [`Conn::read_response`], for a request with `method` (HEAD responses have no body).
    pub fn read_response_to(&mut self, method: &str) -> Response {
        self.try_read_response(method)
            .unwrap_or_else(|e| panic!("no response head: {e:?}"))
    }

    pub fn try_read_response(&mut self, method: &str) -> Result<Response, ReadError> {
        let head = loop {
            let h = self.read_head()?;
            if (100..200).contains(&h.status) && h.status != 101 {
                continue;
            }
            break h;
        };
        Ok(self.read_body(head, method))
    }

    /// Read the body that follows `head` (a response to `method`).
    pub fn read_body(&mut self, head: Head, method: &str) -> Response {
        let mut resp = Response {
            version: head.version.clone(),
            status: head.status,
            reason: head.reason.clone(),
            headers: head.headers.clone(),
            head_at: head.at,
            framing: Framing::None,
            body: Vec::new(),
            pieces: Vec::new(),
            trailers: Vec::new(),
            end: BodyEnd::Complete,
        };
        let no_body = method.eq_ignore_ascii_case("HEAD")
            || (100..200).contains(&head.status)
            || head.status == 204
            || head.status == 304;
        if no_body {
            return resp;
        }
        let te = head.headers_named("transfer-encoding");
        let cls = head.headers_named("content-length");
        if !te.is_empty() {
            if !cls.is_empty() {
                resp.end = BodyEnd::Malformed(
                    "response has both Transfer-Encoding and Content-Length".into(),
                );
                return resp;
            }
            let codings: Vec<String> = te
                .iter()
                .flat_map(|v| v.split(','))
                .map(|t| t.trim().to_ascii_lowercase())
                .collect();
            if codings.last().map(String::as_str) != Some("chunked") {
                resp.framing = Framing::Close;
                resp.end = BodyEnd::Malformed(format!("unexpected transfer-encoding {codings:?}"));
                return resp;
            }
            resp.framing = Framing::Chunked;
            self.read_chunked(&mut resp);
        } else if !cls.is_empty() {
            let vals: Vec<&str> = cls
                .iter()
                .flat_map(|v| v.split(','))
                .map(str::trim)
                .collect();
            let first = vals[0];
            if vals.iter().any(|v| *v != first)
                || first.is_empty()
                || !first.bytes().all(|b| b.is_ascii_digit())
            {
                resp.end = BodyEnd::Malformed(format!("bad response Content-Length {cls:?}"));
                return resp;
            }
            let n: u64 = first.parse().unwrap_or(u64::MAX);
            resp.framing = Framing::Length(n);
            self.read_exact_body(&mut resp, n);
        } else {
            resp.framing = Framing::Close;
            self.read_to_close(&mut resp);
        }
        resp
    }

    fn push_piece(&mut self, resp: &mut Response, n: usize) {
        let at = self.arrival(self.base + n as u64 - 1);
        let data = self.consume(n);
        resp.body.extend_from_slice(&data);
        resp.pieces.push(Piece { at, data });
    }

    fn read_exact_body(&mut self, resp: &mut Response, len: u64) {
        let mut left = len;
        while left > 0 {
            if self.buf.is_empty() {
                match self.fill() {
                    Ok(0) => {
                        resp.end = BodyEnd::Truncated;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        resp.end = end_from(classify(e));
                        return;
                    }
                }
            }
            let take = (self.buf.len() as u64).min(left) as usize;
            self.push_piece(resp, take);
            left -= take as u64;
        }
    }

    fn read_to_close(&mut self, resp: &mut Response) {
        loop {
            if !self.buf.is_empty() {
                let n = self.buf.len();
                self.push_piece(resp, n);
            }
            match self.fill() {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    resp.end = end_from(classify(e));
                    return;
                }
            }
        }
    }

    /// Read until `buf` holds a CRLF-terminated line; returns the line without CRLF.
    fn read_line(&mut self, limit: usize) -> Result<Vec<u8>, BodyEnd> {
        loop {
            if let Some(pos) = find(&self.buf, b"\r\n") {
                let line = self.consume(pos + 2);
                return Ok(line[..pos].to_vec());
            }
            if self.buf.len() > limit {
                return Err(BodyEnd::Malformed("line too long".into()));
            }
            match self.fill() {
                Ok(0) => return Err(BodyEnd::Truncated),
                Ok(_) => {}
                Err(e) => return Err(end_from(classify(e))),
            }
        }
    }

    fn read_chunked(&mut self, resp: &mut Response) {
        loop {
            let line = match self.read_line(4096) {
                Ok(l) => l,
                Err(e) => {
                    resp.end = e;
                    return;
                }
            };
            let size_part = line.split(|b| *b == b';').next().unwrap_or(&[]);
            let size_str = String::from_utf8_lossy(size_part)
                .trim_end_matches([' ', '\t'])
                .to_string();
            if size_str.is_empty()
                || size_str.len() > 16
                || !size_str.bytes().all(|b| b.is_ascii_hexdigit())
            {
                resp.end = BodyEnd::Malformed(format!(
                    "bad chunk size line {:?}",
                    String::from_utf8_lossy(&line)
                ));
                return;
            }
            let size = u64::from_str_radix(&size_str, 16).unwrap_or(u64::MAX);
            if size == 0 {
                // Trailer section.
                loop {
                    match self.read_line(65536) {
                        Ok(l) if l.is_empty() => return,
                        Ok(l) => {
                            let s = String::from_utf8_lossy(&l).into_owned();
                            match s.split_once(':') {
                                Some((k, v)) => {
                                    resp.trailers.push((k.to_string(), v.trim().to_string()))
                                }
                                None => {
                                    resp.end = BodyEnd::Malformed(format!("bad trailer {s:?}"));
                                    return;
                                }
                            }
                        }
                        Err(e) => {
                            resp.end = e;
                            return;
                        }
                    }
                }
            }
            // Chunk data + CRLF.
            let need = size as usize + 2;
            while self.buf.len() < need {
                match self.fill() {
                    Ok(0) => {
                        resp.end = BodyEnd::Truncated;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        resp.end = end_from(classify(e));
                        return;
                    }
                }
            }
            if &self.buf[size as usize..need] != b"\r\n" {
                resp.end = BodyEnd::Malformed("chunk data not followed by CRLF".into());
                return;
            }
            self.push_piece(resp, size as usize);
            self.consume(2);
        }
    }

    /// Wait up to `within` for the peer to close the connection (extra bytes count as
    /// [`CloseState::Data`]). Restores the normal timeout afterwards.
    pub fn wait_close(&mut self, within: Duration) -> CloseState {
        if !self.buf.is_empty() {
            return CloseState::Data(String::from_utf8_lossy(&self.buf).into_owned());
        }
        let saved = self.timeout;
        let _ = self
            .stream
            .set_read_timeout(Some(within.max(Duration::from_millis(1))));
        let result = match self.fill() {
            Ok(0) => CloseState::Eof,
            Ok(_) => CloseState::Data(String::from_utf8_lossy(&self.buf).into_owned()),
            Err(e) => match classify(e) {
                ReadError::Reset => CloseState::Reset,
                ReadError::Timeout => CloseState::Open,
                other => panic!("waiting for close: {other:?}"),
            },
        };
        self.set_timeout(saved);
        result
    }

    /// Assert that the server closes this connection within `within` without sending more.
    pub fn assert_closed(&mut self, within: Duration) {
        let st = self.wait_close(within);
        assert!(
            st.is_closed(),
            "expected the server to close the connection within {within:?}, got {st:?}"
        );
    }
}

pub(crate) fn end_from(e: ReadError) -> BodyEnd {
    match e {
        ReadError::Reset => BodyEnd::Reset,
        ReadError::Timeout => BodyEnd::Timeout,
        ReadError::Closed | ReadError::Truncated(_) => BodyEnd::Truncated,
        ReadError::Malformed(m) => BodyEnd::Malformed(m),
        ReadError::Io(e) => BodyEnd::Malformed(format!("io: {e}")),
    }
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub(crate) fn parse_head(raw: &[u8], at: Instant) -> Result<Head, ReadError> {
    let text = std::str::from_utf8(raw)
        .map_err(|_| ReadError::Malformed(format!("non-UTF-8 response head: {raw:?}")))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    if status_line.contains('\n') || status_line.contains('\r') {
        return Err(ReadError::Malformed(format!(
            "bare CR/LF in status line {status_line:?}"
        )));
    }
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("").to_string();
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or_else(|| ReadError::Malformed(format!("bad status line {status_line:?}")))?;
    if !version.starts_with("HTTP/1.") {
        return Err(ReadError::Malformed(format!(
            "bad status line {status_line:?}"
        )));
    }
    let reason = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    for line in lines {
        if line.contains('\n') || line.contains('\r') {
            return Err(ReadError::Malformed(format!(
                "bare CR/LF in header {line:?}"
            )));
        }
        let (k, v) = line
            .split_once(':')
            .ok_or_else(|| ReadError::Malformed(format!("bad header line {line:?}")))?;
        if k.is_empty() || k.contains([' ', '\t']) {
            return Err(ReadError::Malformed(format!("bad header name {k:?}")));
        }
        headers.push((k.to_string(), v.trim().to_string()));
    }
    Ok(Head {
        version,
        status,
        reason,
        headers,
        at,
    })
}
