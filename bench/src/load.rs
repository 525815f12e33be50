//! `sluice-load`: an HTTP/1.1 load generator for OpenAI-style chat completions.
//!
//! ```text
//! sluice-load --url http://127.0.0.1:8080/v1/chat/completions [--connections 10]
//!     [--duration 10s] [--warmup 0s] [--rate R] [--stream] [--body-bytes N]
//!     [--models a,b,c] [--keys k1,k2] [--header 'Name: value']... [--timeout 10s] [--json FILE]
//! ```
//!
//! One std thread per keep-alive connection, blocking sockets, a read timeout on every socket.
//! Closed loop by default (each connection sends its next request when the previous one is
//! answered). With `--rate R` (requests/s in total) it runs open loop: each connection has a
//! fixed schedule, and latency is measured from each request's *intended* send time, so a
//! stalled server cannot hide behind coordinated omission. Only requests whose intended send
//! time falls inside the measurement window (after the warmup) are recorded.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::serialization::{Serializer, V2Serializer};
use hdrhistogram::Histogram;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: sluice-load --url http://HOST:PORT/PATH [--connections N] \
[--duration 10s] [--warmup 0s] [--rate R] [--stream] [--body-bytes N] [--models a,b] \
[--keys k1,k2] [--header 'Name: value']... [--timeout 10s] [--json FILE]";

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

struct Opts {
    host: String,
    addr: SocketAddr,
    path: String,
    connections: usize,
    duration: Duration,
    warmup: Duration,
    rate: Option<f64>,
    stream: bool,
    body_bytes: usize,
    models: Vec<String>,
    keys: Vec<String>,
    /// Extra request header lines (`Name: value`), sent on every request in the order given.
    headers: Vec<String>,
    timeout: Duration,
    json: Option<String>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("bad duration {s:?} (use e.g. 10s, 500ms, 1.5s)");
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(v * mult))
}

fn list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(String::from)
        .collect()
}

fn parse_opts() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    let mut url = None;
    let mut connections = 10usize;
    let mut duration = Duration::from_secs(10);
    let mut warmup = Duration::ZERO;
    let mut rate = None;
    let mut stream = false;
    let mut body_bytes = 0usize;
    let mut models = vec!["mock-model".to_string()];
    let mut keys = Vec::new();
    let mut headers = Vec::new();
    let mut timeout = Duration::from_secs(10);
    let mut json = None;
    while let Some(a) = args.next() {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        if name == "--stream" {
            stream = true;
            continue;
        }
        if name == "--help" || name == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        const VALUED: [&str; 13] = [
            "--url",
            "--connections",
            "-c",
            "--duration",
            "-d",
            "--warmup",
            "--rate",
            "--body-bytes",
            "--models",
            "--keys",
            "--header",
            "--timeout",
            "--json",
        ];
        if !VALUED.contains(&name.as_str()) {
            return Err(format!("unknown option {name}\n{USAGE}"));
        }
        let v = match inline {
            Some(v) => v,
            None => args.next().ok_or_else(|| format!("{name} needs a value"))?,
        };
        let int = |v: &str| v.parse::<usize>().map_err(|_| format!("bad {name}: {v:?}"));
        match name.as_str() {
            "--url" => url = Some(v),
            "--connections" | "-c" => connections = int(&v)?,
            "--duration" | "-d" => duration = parse_duration(&v)?,
            "--warmup" => warmup = parse_duration(&v)?,
            "--rate" => {
                let r: f64 = v.parse().map_err(|_| format!("bad --rate: {v:?}"))?;
                if !(r.is_finite() && r > 0.0) {
                    return Err(format!("bad --rate: {v:?}"));
                }
                rate = Some(r);
            }
            "--body-bytes" => body_bytes = int(&v)?,
            "--models" => models = list(&v),
            "--keys" => keys = list(&v),
            "--header" => headers.push(header_line(&v)?),
            "--timeout" => timeout = parse_duration(&v)?,
            "--json" => json = Some(v),
            _ => return Err(format!("unknown option {name}\n{USAGE}")),
        }
    }
    let url = url.ok_or_else(|| format!("--url is required\n{USAGE}"))?;
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let hostport = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| format!("resolve {hostport}: {e}"))?
        .next()
        .ok_or_else(|| format!("resolve {hostport}: no address"))?;
    if connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    if models.is_empty() {
        return Err("--models is empty".into());
    }
    if timeout.is_zero() {
        return Err("--timeout must be positive".into());
    }
    Ok(Opts {
        host: host.to_string(),
        addr,
        path: path.to_string(),
        connections,
        duration,
        warmup,
        rate,
        stream,
        body_bytes,
        models,
        keys,
        headers,
        timeout,
        json,
    })
}

/// A `--header` value as a header line without its CRLF: `Name: value`, the name a valid token.
fn header_line(v: &str) -> Result<String, String> {
    let bad = || format!("bad --header {v:?} (use 'Name: value')");
    let (name, value) = v.split_once(':').ok_or_else(bad)?;
    let name = name.trim();
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) || value.contains(['\r', '\n']) {
        return Err(bad());
    }
    Ok(format!("{name}: {}", value.trim()))
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// A valid chat body for `model`, padded (inside the user message) to at least `size` bytes.
fn chat_body(model: &str, stream: bool, size: usize) -> Vec<u8> {
    let model_json = serde_json::Value::String(model.to_string()).to_string();
    let head = format!(
        r#"{{"model":{model_json},"stream":{stream},"messages":[{{"role":"user","content":"hello"#
    );
    let tail = r#""}]}"#;
    let mut body = head.into_bytes();
    let pad = size.saturating_sub(body.len() + tail.len());
    body.resize(body.len() + pad, b'x');
    body.extend_from_slice(tail.as_bytes());
    body
}

/// The full request bytes for every (model, key) combination, built once:
/// `out[m][k]` uses `models[m]` and `keys[k]`.
fn build_requests(o: &Opts) -> Vec<Vec<Vec<u8>>> {
    let keys: Vec<Option<&str>> = if o.keys.is_empty() {
        vec![None]
    } else {
        o.keys.iter().map(|k| Some(k.as_str())).collect()
    };
    let mut out = Vec::new();
    for m in &o.models {
        let body = chat_body(m, o.stream, o.body_bytes);
        let mut row = Vec::new();
        for k in &keys {
            let mut r = format!(
                "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
                o.path,
                o.host,
                body.len()
            );
            if o.stream {
                r.push_str("Accept: text/event-stream\r\n");
            }
            if let Some(k) = k {
                r.push_str(&format!("Authorization: Bearer {k}\r\n"));
            }
            for h in &o.headers {
                r.push_str(h);
                r.push_str("\r\n");
            }
            r.push_str("\r\n");
            let mut r = r.into_bytes();
            r.extend_from_slice(&body);
            row.push(r);
        }
        out.push(row);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------------

const KINDS: [&str; 6] = [
    "connect",
    "status_4xx",
    "status_5xx",
    "timeout",
    "protocol",
    "io",
];

struct Stats {
    latency: Histogram<u64>,
    ttfb: Histogram<u64>,
    first_event: Histogram<u64>,
    gap: Histogram<u64>,
    ok: u64,
    errors: [u64; 6],
    content_events: u64,
    coalesced_events: u64,
    coalesced_reads: u64,
    statuses: BTreeMap<u16, u64>,
}

fn hist() -> Result<Histogram<u64>, String> {
    // Microseconds, 1 µs .. 1 hour, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| format!("histogram: {e}"))
}

impl Stats {
    fn new() -> Result<Stats, String> {
        Ok(Stats {
            latency: hist()?,
            ttfb: hist()?,
            first_event: hist()?,
            gap: hist()?,
            ok: 0,
            errors: [0; 6],
            content_events: 0,
            coalesced_events: 0,
            coalesced_reads: 0,
            statuses: BTreeMap::new(),
        })
    }

    fn merge(&mut self, o: &Stats) {
        let _ = self.latency.add(&o.latency);
        let _ = self.ttfb.add(&o.ttfb);
        let _ = self.first_event.add(&o.first_event);
        let _ = self.gap.add(&o.gap);
        self.ok += o.ok;
        for (a, b) in self.errors.iter_mut().zip(o.errors) {
            *a += b;
        }
        self.content_events += o.content_events;
        self.coalesced_events += o.coalesced_events;
        self.coalesced_reads += o.coalesced_reads;
        for (s, n) in &o.statuses {
            *self.statuses.entry(*s).or_default() += n;
        }
    }
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

#[derive(Clone, Copy)]
enum Kind {
    Connect = 0,
    Status4xx = 1,
    Status5xx = 2,
    Timeout = 3,
    Protocol = 4,
    Io = 5,
}

struct Fail(Kind, String);

fn io_fail(e: io::Error) -> Fail {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Fail(Kind::Timeout, e.to_string()),
        _ => Fail(Kind::Io, e.to_string()),
    }
}

fn proto(msg: impl Into<String>) -> Fail {
    Fail(Kind::Protocol, msg.into())
}

// ---------------------------------------------------------------------------------------------
// Response reading: head, Content-Length / chunked body, SSE events
// ---------------------------------------------------------------------------------------------

/// Incremental chunked-body decoder.
enum Chunked {
    Size(Vec<u8>),
    Data(u64),
    DataEnd(u8),
    Trailer(Vec<u8>),
    Done,
}

impl Chunked {
    /// Feed raw bytes; decoded data goes to `out`. Returns how many input bytes were consumed
    /// (less than `input.len()` only once the body is complete).
    fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, Fail> {
        let mut i = 0;
        while i < input.len() {
            match self {
                Chunked::Done => return Ok(i),
                Chunked::Size(line) => {
                    let b = input[i];
                    i += 1;
                    if b == b'\n' {
                        let l = line.strip_suffix(b"\r").unwrap_or(line);
                        let hex = l.split(|&c| c == b';').next().unwrap_or(b"");
                        let hex = std::str::from_utf8(hex)
                            .map_err(|_| proto("bad chunk size"))?
                            .trim();
                        let n = u64::from_str_radix(hex, 16)
                            .map_err(|_| proto(format!("bad chunk size {hex:?}")))?;
                        *self = if n == 0 {
                            Chunked::Trailer(Vec::new())
                        } else {
                            Chunked::Data(n)
                        };
                    } else {
                        if line.len() > 1024 {
                            return Err(proto("chunk size line too long"));
                        }
                        line.push(b);
                    }
                }
                Chunked::Data(rem) => {
                    let avail = (input.len() - i) as u64;
                    let take = avail.min(*rem) as usize;
                    out.extend_from_slice(&input[i..i + take]);
                    i += take;
                    *rem -= take as u64;
                    if *rem == 0 {
                        *self = Chunked::DataEnd(0);
                    }
                }
                Chunked::DataEnd(seen) => {
                    let b = input[i];
                    i += 1;
                    match (*seen, b) {
                        (0, b'\r') => *seen = 1,
                        (_, b'\n') => *self = Chunked::Size(Vec::new()),
                        _ => return Err(proto("missing CRLF after chunk data")),
                    }
                }
                Chunked::Trailer(line) => {
                    let b = input[i];
                    i += 1;
                    if b == b'\n' {
                        let empty = line.is_empty() || line.as_slice() == b"\r";
                        line.clear();
                        if empty {
                            *self = Chunked::Done;
                        }
                    } else {
                        if line.len() > 8192 {
                            return Err(proto("trailer line too long"));
                        }
                        line.push(b);
                    }
                }
            }
        }
        Ok(i)
    }
}

enum Body {
    Length(u64),
    Chunked(Chunked),
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

struct Conn {
    sock: TcpStream,
    buf: Vec<u8>,
    /// Bytes read from the socket but not yet consumed (start offset into `buf`).
    start: usize,
}

struct Outcome {
    status: u16,
    keep_alive: bool,
    ttfb: Duration,
    first_event: Option<Duration>,
    gaps: Vec<Duration>,
    content_events: u64,
    coalesced_events: u64,
    coalesced_reads: u64,
}

impl Conn {
    fn open(addr: SocketAddr, timeout: Duration) -> Result<Conn, Fail> {
        let sock = TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
            let kind = if e.kind() == io::ErrorKind::TimedOut {
                Kind::Timeout
            } else {
                Kind::Connect
            };
            Fail(kind, format!("connect {addr}: {e}"))
        })?;
        let setup = |s: &TcpStream| -> io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))
        };
        setup(&sock).map_err(|e| Fail(Kind::Connect, format!("socket options: {e}")))?;
        Ok(Conn {
            sock,
            buf: Vec::with_capacity(16 * 1024),
            start: 0,
        })
    }

    /// One read() into the buffer; returns the byte count (0 = EOF).
    fn fill(&mut self) -> Result<usize, Fail> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let len = self.buf.len();
        self.buf.resize(len + 16 * 1024, 0);
        let r = loop {
            match self.sock.read(&mut self.buf[len..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r,
            }
        };
        let n = match r {
            Ok(n) => n,
            Err(e) => {
                self.buf.truncate(len);
                return Err(io_fail(e));
            }
        };
        self.buf.truncate(len + n);
        Ok(n)
    }

    /// Send one request and read the whole response, timing it from `sent`.
    fn exchange(&mut self, req: &[u8], sent: Instant, stream: bool) -> Result<Outcome, Fail> {
        if self.start < self.buf.len() {
            return Err(proto("unexpected bytes before the response"));
        }
        self.buf.clear();
        self.start = 0;
        self.sock.write_all(req).map_err(io_fail)?;

        // Head.
        let mut ttfb = None;
        let (status, keep_alive, mut body, head_len) = loop {
            let n = self.fill()?;
            if n == 0 {
                return Err(Fail(
                    Kind::Io,
                    "connection closed before the response".into(),
                ));
            }
            if ttfb.is_none() {
                ttfb = Some(sent.elapsed());
            }
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&self.buf) {
                Ok(httparse::Status::Partial) => {
                    if self.buf.len() > 64 * 1024 {
                        return Err(proto("response head too large"));
                    }
                }
                Err(e) => return Err(proto(format!("bad response head: {e}"))),
                Ok(httparse::Status::Complete(head_len)) => {
                    let status = resp.code.unwrap_or(0);
                    if (100..200).contains(&status) {
                        // Interim response (100 Continue): skip it.
                        self.buf.drain(..head_len);
                        continue;
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
                            if v.to_ascii_lowercase().contains("close") {
                                keep_alive = false;
                            } else if v.to_ascii_lowercase().contains("keep-alive") {
                                keep_alive = true;
                            }
                        }
                    }
                    let body = if status == 204 || status == 304 {
                        Body::Length(0)
                    } else if chunked {
                        Body::Chunked(Chunked::Size(Vec::new()))
                    } else if let Some(l) = len {
                        Body::Length(l)
                    } else {
                        return Err(proto("response without Content-Length or chunked framing"));
                    };
                    break (status, keep_alive, body, head_len);
                }
            }
        };
        self.start = head_len;

        // Body.
        let mut out = Outcome {
            status,
            keep_alive,
            ttfb: ttfb.unwrap_or_default(),
            first_event: None,
            gaps: Vec::new(),
            content_events: 0,
            coalesced_events: 0,
            coalesced_reads: 0,
        };
        let mut sse = Sse::default();
        let mut decoded = Vec::new();
        let mut last_event: Option<Instant> = None;
        let sse_on = stream && (200..300).contains(&status);
        loop {
            let now = Instant::now();
            let avail = &self.buf[self.start..];
            decoded.clear();
            let done = match &mut body {
                Body::Length(rem) => {
                    let take = (avail.len() as u64).min(*rem) as usize;
                    decoded.extend_from_slice(&avail[..take]);
                    self.start += take;
                    *rem -= take as u64;
                    *rem == 0
                }
                Body::Chunked(c) => {
                    let used = c.feed(avail, &mut decoded)?;
                    self.start += used;
                    matches!(c, Chunked::Done)
                }
            };
            if sse_on && !decoded.is_empty() {
                let (_, content) = sse.feed(&decoded);
                if content > 0 {
                    out.content_events += u64::from(content);
                    if out.first_event.is_none() {
                        out.first_event = Some(now - sent);
                    }
                    if let Some(prev) = last_event {
                        out.gaps.push(now - prev);
                    }
                    last_event = Some(now);
                    if content > 1 {
                        out.coalesced_reads += 1;
                        out.coalesced_events += u64::from(content - 1);
                    }
                }
            }
            if done {
                break;
            }
            if self.fill()? == 0 {
                return Err(Fail(Kind::Io, "connection closed mid-body".into()));
            }
        }
        if self.start < self.buf.len() {
            // Extra bytes after the response: the connection can't be trusted any more.
            out.keep_alive = false;
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------------------------

struct Plan {
    opts: Opts,
    requests: Vec<Vec<Vec<u8>>>,
    t0: Instant,
    measure_from: Instant,
    end: Instant,
}

fn worker(plan: &Plan, id: usize) -> Result<Stats, String> {
    let o = &plan.opts;
    let mut st = Stats::new()?;
    let mut conn: Option<Conn> = None;
    // Open loop: per-connection interval, connections staggered across one interval.
    let interval = o
        .rate
        .map(|r| Duration::from_secs_f64(o.connections as f64 / r));
    let mut k: u64 = 0;
    let mut seq = id;
    let mut reported = false;
    loop {
        let intended = match interval {
            Some(iv) => {
                let off = iv.mul_f64((k as f64 + id as f64 / o.connections as f64).max(0.0));
                plan.t0 + off
            }
            None => Instant::now().max(plan.t0),
        };
        k += 1;
        if intended >= plan.end {
            break;
        }
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        let record = intended >= plan.measure_from;
        // Request number `seq` (counted over all connections) uses models[seq % m] and
        // keys[seq % k]: both lists rotate independently.
        let row = &plan.requests[seq % plan.requests.len()];
        let req = &row[seq % row.len()];
        seq += o.connections;

        let c = match conn.as_mut() {
            Some(c) => Ok(c),
            None => Conn::open(o.addr, o.timeout).map(|c| conn.insert(c)),
        };
        let res = c.and_then(|c| c.exchange(req, intended, o.stream));
        let done = Instant::now();
        match res {
            Ok(out) => {
                if !out.keep_alive {
                    conn = None;
                }
                if !record {
                    continue;
                }
                *st.statuses.entry(out.status).or_default() += 1;
                if (200..300).contains(&out.status) {
                    st.ok += 1;
                    let _ = st.latency.record(us(done - intended));
                    let _ = st.ttfb.record(us(out.ttfb));
                    if let Some(fe) = out.first_event {
                        let _ = st.first_event.record(us(fe));
                    }
                    for g in &out.gaps {
                        let _ = st.gap.record(us(*g));
                    }
                    st.content_events += out.content_events;
                    st.coalesced_events += out.coalesced_events;
                    st.coalesced_reads += out.coalesced_reads;
                } else if out.status >= 500 {
                    st.errors[Kind::Status5xx as usize] += 1;
                } else {
                    st.errors[Kind::Status4xx as usize] += 1;
                }
            }
            Err(Fail(kind, msg)) => {
                conn = None;
                if record {
                    st.errors[kind as usize] += 1;
                }
                if !reported {
                    eprintln!("sluice-load: connection {id}: {msg} (further errors only counted)");
                    reported = true;
                }
                if matches!(kind, Kind::Connect) {
                    // Don't spin on a refused port.
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
    Ok(st)
}

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= c.len() {
                s.push(char::from(T[((n >> shift) & 63) as usize]));
            } else {
                s.push('=');
            }
        }
    }
    s
}

fn ms(v: u64) -> f64 {
    v as f64 / 1000.0
}

fn hist_json(h: &Histogram<u64>) -> serde_json::Value {
    let mut bytes = Vec::new();
    let encoded = match V2Serializer::new().serialize(h, &mut bytes) {
        Ok(_) => serde_json::Value::String(base64(&bytes)),
        Err(_) => serde_json::Value::Null,
    };
    let q = |p: f64| ms(h.value_at_quantile(p));
    serde_json::json!({
        "count": h.len(),
        "min_ms": ms(h.min()),
        "mean_ms": h.mean() / 1000.0,
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "p999_ms": q(0.999),
        "max_ms": ms(h.max()),
        "hdr_unit": "us",
        "hdr_v2_base64": encoded,
    })
}

fn hist_line(name: &str, h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return format!("  {name:<12} (no samples)");
    }
    let q = |p: f64| ms(h.value_at_quantile(p));
    format!(
        "  {name:<12} p50 {:>9.3}  p90 {:>9.3}  p99 {:>9.3}  p99.9 {:>9.3}  max {:>9.3} ms  (n={})",
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        ms(h.max()),
        h.len()
    )
}

fn run() -> Result<(), String> {
    let opts = parse_opts()?;
    let requests = build_requests(&opts);
    let t0 = Instant::now() + Duration::from_millis(10);
    let measure_from = t0 + opts.warmup;
    let end = measure_from + opts.duration;
    let plan = Arc::new(Plan {
        opts,
        requests,
        t0,
        measure_from,
        end,
    });
    let mut handles = Vec::new();
    for id in 0..plan.opts.connections {
        let p = Arc::clone(&plan);
        let h = std::thread::Builder::new()
            .name(format!("load-{id}"))
            .spawn(move || worker(&p, id))
            .map_err(|e| format!("spawn thread: {e}"))?;
        handles.push(h);
    }
    let mut total = Stats::new()?;
    for h in handles {
        let st = h
            .join()
            .map_err(|_| "worker thread panicked".to_string())??;
        total.merge(&st);
    }
    let o = &plan.opts;
    let secs = o.duration.as_secs_f64().max(1e-9);
    let err_total: u64 = total.errors.iter().sum();
    let mode = match o.rate {
        Some(r) => format!("open loop, {r} req/s target"),
        None => "closed loop".to_string(),
    };

    let mut out = String::new();
    out.push_str(&format!(
        "sluice-load: {} {} connections, {:.1}s (+{:.1}s warmup), {}{}\n",
        o.addr,
        o.connections,
        o.duration.as_secs_f64(),
        o.warmup.as_secs_f64(),
        mode,
        if o.stream { ", streaming" } else { "" }
    ));
    out.push_str(&format!(
        "  requests     {} ok, {} errors, {:.1} req/s (ok)\n",
        total.ok,
        err_total,
        total.ok as f64 / secs
    ));
    out.push_str(&hist_line("latency", &total.latency));
    out.push('\n');
    if o.stream {
        out.push_str(&hist_line("ttfb", &total.ttfb));
        out.push('\n');
        out.push_str(&hist_line("first event", &total.first_event));
        out.push('\n');
        out.push_str(&hist_line("event gap", &total.gap));
        out.push('\n');
        out.push_str(&format!(
            "  events       {} content events, {} coalesced (in {} reads)\n",
            total.content_events, total.coalesced_events, total.coalesced_reads
        ));
    }
    let errs: Vec<String> = KINDS
        .iter()
        .zip(total.errors)
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    out.push_str(&format!(
        "  errors       {}\n",
        if errs.is_empty() {
            "none".to_string()
        } else {
            errs.join(" ")
        }
    ));
    print!("{out}");

    if let Some(path) = &o.json {
        let errors: serde_json::Map<String, serde_json::Value> = KINDS
            .iter()
            .zip(total.errors)
            .map(|(k, n)| (k.to_string(), n.into()))
            .collect();
        let statuses: serde_json::Map<String, serde_json::Value> = total
            .statuses
            .iter()
            .map(|(s, n)| (s.to_string(), (*n).into()))
            .collect();
        let mut j = serde_json::json!({
            "url": format!("http://{}{}", o.host, o.path),
            "mode": if o.rate.is_some() { "open" } else { "closed" },
            "rate": o.rate,
            "connections": o.connections,
            "duration_s": o.duration.as_secs_f64(),
            "warmup_s": o.warmup.as_secs_f64(),
            "stream": o.stream,
            "body_bytes": o.body_bytes,
            "headers": o.headers,
            "requests": total.ok + err_total,
            "ok": total.ok,
            "rps": total.ok as f64 / secs,
            "errors": errors,
            "errors_total": err_total,
            "statuses": statuses,
            "latency": hist_json(&total.latency),
        });
        if o.stream {
            j["ttfb"] = hist_json(&total.ttfb);
            j["first_event"] = hist_json(&total.first_event);
            j["event_gap"] = hist_json(&total.gap);
            j["content_events"] = total.content_events.into();
            j["coalesced_events"] = total.coalesced_events.into();
            j["coalesced_reads"] = total.coalesced_reads.into();
        }
        let text = serde_json::to_string_pretty(&j).map_err(|e| format!("json: {e}"))?;
        std::fs::write(path, text + "\n").map_err(|e| format!("write {path}: {e}"))?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("sluice-load: {e}");
        std::process::exit(2);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::header_line;

    #[test]
    fn header_option() {
        assert_eq!(
            header_line("x-mock-tokens: 64").unwrap(),
            "x-mock-tokens: 64"
        );
        assert_eq!(header_line(" A-B :v w ").unwrap(), "A-B: v w");
        for bad in ["novalue", ": v", "a b: v", "a: v\r\nInjected: 1"] {
            assert!(header_line(bad).is_err(), "{bad:?}");
        }
    }
}
