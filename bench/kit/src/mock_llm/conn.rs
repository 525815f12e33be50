//! One HTTP/1.1 keep-alive connection of the mock upstream, generic over plain TCP and TLS.

use std::cell::UnsafeCell;
use std::future::Future;
use std::io::Write as _;
use std::ops::Range;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use monoio::time::Instant;
use monoio::BufResult;

use super::anthropic::{self, Answer, Block, Reject};
use super::anthropic_wire::{self, Msg};
use super::body::{self, Gen};
use super::chat_tools::{self, Offer};
use super::control::{self, Endpoint};
use super::http::{self, Chunked, Head, HeadParse};
use super::{Fault, State, Stats};

/// Sleeps at least this long race a readiness check on the socket, so a client that goes away
/// while the mock waits is noticed at once. Shorter sleeps rely on the next writes failing
/// (the second write after a peer close fails), which costs nothing extra per event.
const WATCH_MIN: Duration = Duration::from_millis(50);
/// TLS handshakes that take longer are dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP stream shared between the connection's I/O object (plain, or under TLS) and the
/// peer-close watcher, which only needs `&TcpStream` for a readiness wait.
///
/// Same scheme as monoio's own `OwnedReadHalf`/`OwnedWriteHalf`: everything runs on one thread
/// and the connection task never has an I/O operation in flight while it waits for
/// readiness (see [`Conn::pause_until`]), so the `&mut` and `&` views never overlap.
pub struct SharedTcp(Rc<UnsafeCell<TcpStream>>);

impl SharedTcp {
    fn inner(&mut self) -> &mut TcpStream {
        // SAFETY: see the type's comment: no other reference is alive while this one is used.
        unsafe { &mut *self.0.get() }
    }
}

impl AsyncReadRent for SharedTcp {
    fn read<T: IoBufMut>(&mut self, buf: T) -> impl Future<Output = BufResult<usize, T>> {
        self.inner().read(buf)
    }

    fn readv<T: IoVecBufMut>(&mut self, buf: T) -> impl Future<Output = BufResult<usize, T>> {
        self.inner().readv(buf)
    }
}

impl AsyncWriteRent for SharedTcp {
    fn write<T: IoBuf>(&mut self, buf: T) -> impl Future<Output = BufResult<usize, T>> {
        self.inner().write(buf)
    }

    fn writev<T: IoVecBuf>(&mut self, buf: T) -> impl Future<Output = BufResult<usize, T>> {
        self.inner().writev(buf)
    }

    fn flush(&mut self) -> impl Future<Output = std::io::Result<()>> {
        self.inner().flush()
    }

    fn shutdown(&mut self) -> impl Future<Output = std::io::Result<()>> {
        self.inner().shutdown()
    }
}

/// Serves one accepted connection until it closes.
pub async fn run(tcp: TcpStream, st: Rc<State>, tls: Option<monoio_rustls::TlsAcceptor>) {
    let raw = Rc::new(UnsafeCell::new(tcp));
    let io = SharedTcp(raw.clone());
    match tls {
        None => Conn::new(io, raw, st).serve().await,
        Some(acceptor) => {
            // A failed or stalled handshake just drops the connection.
            let handshake = monoio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await;
            if let Ok(Ok(s)) = handshake {
                Conn::new(s, raw, st).serve().await;
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    Completions,
    Responses,
    Embeddings,
    Models,
    /// Anthropic's Messages API.
    Messages,
    /// `/_mock/*` and `/metrics`: the mock's own endpoints, which ignore faults and controls,
    /// are not counted and never queue.
    Control(Endpoint),
    NotFound,
}

impl Route {
    fn is_control(self) -> bool {
        matches!(self, Route::Control(_))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    Chunked,
    ChunkedExt,
    /// Close-delimited: no framing at all.
    Raw,
}

/// How a response body is delimited.
enum Len {
    /// No framing header at all (204: no body, and no Content-Length either).
    Omitted,
    Content(usize),
    Chunked,
    /// By closing the connection.
    Unframed,
}

/// How a response ended.
enum Next {
    KeepAlive,
    /// Close gracefully (TLS close_notify, TCP FIN).
    Close,
    /// Drop the socket at once (fault, or the peer is gone).
    Drop,
}

/// The peer went away.
struct Gone;

/// Where a stream's fault strikes, in content events sent before it.
#[derive(Clone, Copy)]
struct FaultPoints {
    /// `die-after`, `drop-mid-stream`: drop the connection.
    cut_at: Option<u64>,
    /// `error-event`: an error event in place of the next content event.
    error_at: Option<u64>,
    /// `end-after`: end the body, properly framed, there.
    end_at: Option<u64>,
}

/// One event of a `/v1/messages` stream after `message_start` (block index, block, delta).
#[derive(Clone, Copy)]
enum Step {
    Start(usize, Block),
    Ping,
    /// A content delta: what the timing and the faults count.
    Delta(usize, Block, u64),
    Signature(usize),
    Stop(usize),
}

/// A content event of a chat / completions / Responses stream: what the timing and the faults
/// count.
#[derive(Clone, Copy)]
enum Content {
    /// Token `i` (chat delta, completion text, Responses text delta).
    Token(u64),
    /// Arguments fragment `j` of chat tool call `i`; fragment 0 goes out right after the call's
    /// first chunk (index, id, name, empty arguments), which is not a content event of its own.
    ToolArgs(u64, u64),
}

/// The fields OpenAI's API sends with an answer besides its framing and type (values made up,
/// names and sizes as sent, twenty of them): with `x-mock-headers: provider`, so that what a
/// proxy spends reading and relaying an answer's head is what it spends on a provider's, not on
/// mock-llm's three fields.
const PROVIDER_FIELDS: &[u8] = include!("provider_fields.rs");

/// Everything a response needs, taken out of the request before any I/O.
struct Plan {
    route: Route,
    stream: bool,
    include_usage: bool,
    seq: u64,
    created: u64,
    /// Response `model` field as a JSON literal.
    model_json: Vec<u8>,
    /// `x-mock-model` header value (sanitized).
    model_header: Vec<u8>,
    prompt_tokens: u64,
    tokens: u64,
    ttft_ms: u64,
    itl_ms: u64,
    /// `/v1/messages` streams: a `ping` event this often while a delta is not yet due (0: none).
    ping_ms: u64,
    delay_ms: u64,
    /// `x-mock-echo: none`: the answer carries no echo, as a provider's does not.
    no_echo: bool,
    /// `x-mock-connection-option: NAME`: the head lists NAME in `Connection` and carries a
    /// field of that name (for one hop only: a proxy must drop both).
    connection_option: Option<Vec<u8>>,
    /// `x-mock-headers: provider`: the head carries the fields a provider's does
    /// ([`PROVIDER_FIELDS`]).
    provider_fields: bool,
    fault: Option<Fault>,
    status: Option<u16>,
    /// `error.code` of an injected error (and of an `error-event`); None: by status.
    error_code: Option<String>,
    /// `Retry-After` of a 429 / 503 / 529; None: no header.
    retry_after: Option<Vec<u8>>,
    /// A control endpoint's answer (computed when the request is read, since it needs the
    /// request body): status, content type; the body is in `control_body`.
    control: Option<control::Answer>,
    control_body: Vec<u8>,
    close: bool,
    http10: bool,
    /// `METHOD path` for the 404 message.
    what: String,
    /// `/v1/messages`: the answer to a request that passed its checks.
    messages: Option<Box<Answer>>,
    /// `/v1/messages`: why its checks refused the request.
    reject: Option<Reject>,
    /// `x-mock-tool-calls`, `x-mock-cache-read`, `x-mock-cache-write` (`/v1/messages` and
    /// `/v1/chat/completions`).
    tool_calls: u64,
    cache_read: u64,
    cache_write: u64,
    /// `x-mock-cache-read` or `x-mock-cache-write` was sent: chat completions then report
    /// `usage.prompt_tokens_details`.
    cache_headers: bool,
    /// `/v1/chat/completions`: the names its tool calls go to, in turn (from the request's
    /// `tools`, see [`Offer`]).
    chat_tool_names: Vec<String>,
    /// `/v1/chat/completions`: tool calls answered instead of text (0: a text answer).
    chat_tool_calls: u64,
    /// `/v1/chat/completions`: each call's arguments as `x-mock-tool-calls-json` scripts them
    /// (empty: made up).
    chat_tool_args: Vec<String>,
    /// `x-mock-tool-calls-json`: the calls to answer with, by name and arguments (empty: none
    /// scripted).
    tool_script: Vec<chat_tools::Scripted>,
}

impl Plan {
    /// The cache usage an OpenAI chat answer reports, when asked for (`x-mock-cache-read`,
    /// `x-mock-cache-write`): (read, write). `/v1/messages` reports its own, always.
    fn chat_cache(&self) -> Option<(u64, u64)> {
        (self.route == Route::Chat && self.cache_headers)
            .then_some((self.cache_read, self.cache_write))
    }

    /// `usage.prompt_tokens` of an OpenAI-dialect answer: on chat completions the prompt
    /// includes the cache reads and writes, as OpenAI's does (and as `/v1/messages` sums its
    /// `input_tokens` and cache fields in the stats).
    fn openai_prompt_tokens(&self) -> u64 {
        match self.chat_cache() {
            Some((read, write)) => self
                .prompt_tokens
                .saturating_add(read)
                .saturating_add(write),
            None => self.prompt_tokens,
        }
    }
}

struct Conn<S> {
    io: S,
    raw: Rc<UnsafeCell<TcpStream>>,
    st: Rc<State>,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    /// Decoded chunked request body, then reused for response bodies.
    body: Vec<u8>,
    /// Echo object of the current request.
    echo: Vec<u8>,
    /// The SSE event being built.
    ev: Vec<u8>,
    hdrs: Vec<(Range<usize>, Range<usize>)>,
    /// The peer sent bytes while a response was being produced: stop watching for readiness.
    peer_data: bool,
    /// When the current request's head arrived.
    request_at: Instant,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn parse_num(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        529 => "Overloaded",
        _ => "Mock Status",
    }
}

/// Header-safe copy of a value: control characters become `?`.
fn header_safe(out: &mut Vec<u8>, v: &[u8]) {
    out.extend(
        v.iter()
            .map(|&b| if b < 0x20 || b == 0x7f { b'?' } else { b }),
    );
}

fn frame_into(out: &mut Vec<u8>, ev: &[u8], framing: Framing) {
    match framing {
        Framing::Raw => out.extend_from_slice(ev),
        Framing::Chunked => {
            let _ = write!(out, "{:x}\r\n", ev.len());
            out.extend_from_slice(ev);
            out.extend_from_slice(b"\r\n");
        }
        Framing::ChunkedExt => {
            let _ = write!(out, "{:x};ext=1\r\n", ev.len());
            out.extend_from_slice(ev);
            out.extend_from_slice(b"\r\n");
        }
    }
}

fn terminator(framing: Framing) -> &'static [u8] {
    match framing {
        Framing::Chunked => b"0\r\n\r\n",
        Framing::ChunkedExt => b"0\r\nx-trailer: 1\r\n\r\n",
        Framing::Raw => b"",
    }
}

impl<S: AsyncReadRent + AsyncWriteRent> Conn<S> {
    fn new(io: S, raw: Rc<UnsafeCell<TcpStream>>, st: Rc<State>) -> Self {
        Conn {
            io,
            raw,
            st,
            rbuf: Vec::with_capacity(8192),
            wbuf: Vec::with_capacity(4096),
            body: Vec::new(),
            echo: Vec::with_capacity(1024),
            ev: Vec::with_capacity(512),
            hdrs: Vec::with_capacity(16),
            peer_data: false,
            request_at: Instant::now(),
        }
    }

    async fn serve(mut self) {
        loop {
            match self.one_request().await {
                Next::KeepAlive => {}
                Next::Close => {
                    let _ = self.io.shutdown().await;
                    return;
                }
                Next::Drop => return,
            }
        }
    }

    /// Appends whatever the socket has to `rbuf`; Ok(0) is EOF.
    async fn read_more(&mut self) -> std::io::Result<usize> {
        if self.rbuf.capacity() - self.rbuf.len() < 4096 {
            self.rbuf.reserve(self.rbuf.len().max(8192));
        }
        let len = self.rbuf.len();
        let buf = std::mem::take(&mut self.rbuf);
        let (res, slice) = self.io.read(buf.slice_mut(len..)).await;
        self.rbuf = slice.into_inner();
        res
    }

    /// Writes all of `wbuf`.
    async fn flush_wbuf(&mut self) -> Result<(), Gone> {
        let buf = std::mem::take(&mut self.wbuf);
        let (res, buf) = self.io.write_all(buf).await;
        self.wbuf = buf;
        match res {
            Ok(_) => Ok(()),
            Err(_) => Err(Gone),
        }
    }

    /// Sends `self.ev` as one chunk (plus `tail` in the same write).
    async fn send_ev(&mut self, framing: Framing, tail: &[u8]) -> Result<(), Gone> {
        self.wbuf.clear();
        frame_into(&mut self.wbuf, &self.ev, framing);
        self.wbuf.extend_from_slice(tail);
        self.flush_wbuf().await
    }

    /// Waits until `deadline`; errors if the peer closed the connection meanwhile (checked when
    /// the wait is long enough to be worth a readiness wait, see [`WATCH_MIN`]).
    async fn pause_until(&mut self, deadline: Instant) -> Result<(), Gone> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        if self.peer_data || left < WATCH_MIN {
            monoio::time::sleep_until(deadline).await;
            return Ok(());
        }
        self.or_gone(monoio::time::sleep_until(deadline)).await
    }

    /// Runs `fut` to its end, or errors as soon as the peer closes the connection. Pipelined
    /// bytes that arrive meanwhile are kept for the next request, and watching stops (the
    /// socket stays readable from then on).
    async fn or_gone<F: Future>(&mut self, fut: F) -> Result<F::Output, Gone> {
        let mut fut = std::pin::pin!(fut);
        if !self.peer_data {
            {
                // SAFETY: no operation on `self.io` is in flight here (it is only used after
                // this block ends), so this shared view does not overlap a mutable one; see
                // `SharedTcp`.
                let tcp: &TcpStream = unsafe { &*self.raw.get() };
                monoio::select! {
                    out = &mut fut => return Ok(out),
                    _ = tcp.readable(false) => {}
                }
            }
            match self.read_more().await {
                Ok(0) | Err(_) => return Err(Gone),
                Ok(_) => self.peer_data = true,
            }
        }
        Ok(fut.await)
    }

    /// The client closed the connection before this request's answer was complete: counted,
    /// with how long after the request's head it was noticed.
    fn abandoned(&self) {
        let stats = &self.st.stats;
        Stats::bump(&stats.requests_abandoned);
        let after = self.request_at.elapsed().as_millis();
        stats
            .last_abandoned_after_ms
            .set(u64::try_from(after).unwrap_or(u64::MAX));
    }

    /// `stall`: no answer at all; the connection stays open until the client closes it.
    async fn stall(&mut self) -> Next {
        Stats::bump(&self.st.stats.stalled);
        loop {
            match self.read_more().await {
                Ok(0) | Err(_) => return Next::Drop,
                // Pipelined requests go unanswered too; their bytes are dropped so that a
                // client that keeps sending cannot grow the buffer.
                Ok(_) => self.rbuf.clear(),
            }
        }
    }

    /// `drop-before-response`: after `x-mock-delay-ms`, close without a byte of answer.
    async fn drop_before_response(&mut self, p: &Plan) -> Next {
        if p.delay_ms > 0 {
            let deadline = Instant::now() + Duration::from_millis(p.delay_ms);
            if self.pause_until(deadline).await.is_err() {
                return Next::Drop;
            }
        }
        Stats::bump(&self.st.stats.dropped_before_response);
        Next::Drop
    }

    /// Answers an unparseable request and closes.
    async fn bad_request(&mut self, status: u16, why: &str) -> Next {
        self.body.clear();
        body::error(&mut self.body, status, why, None);
        self.wbuf.clear();
        let _ = write!(
            self.wbuf,
            "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             x-mock-model: \r\nconnection: close\r\n\r\n",
            reason(status),
            self.body.len()
        );
        self.wbuf.extend_from_slice(&self.body);
        match self.flush_wbuf().await {
            Ok(()) => Next::Close,
            Err(Gone) => Next::Drop,
        }
    }

    async fn one_request(&mut self) -> Next {
        // Keep-alive timeout (`--idle-close-ms`): counted from the end of the last response (or
        // the accept), and only while no byte of the next request has arrived.
        let idle_deadline = self.st.cfg.idle_close.map(|d| Instant::now() + d);
        // Head.
        let head = loop {
            if !self.rbuf.is_empty() {
                match http::parse_head(&self.rbuf, &mut self.hdrs) {
                    HeadParse::Done(h) => {
                        self.request_at = Instant::now();
                        break h;
                    }
                    HeadParse::Partial => {}
                    HeadParse::Bad(status, why) => return self.bad_request(status, why).await,
                }
            }
            let read = match idle_deadline {
                Some(deadline) if self.rbuf.is_empty() => {
                    match monoio::time::timeout_at(deadline, self.read_more()).await {
                        Ok(r) => r,
                        Err(_) => {
                            // Idle too long: close without a word, as a server's keep-alive
                            // timeout does. Dropping the socket (the cancelled read included)
                            // sends a FIN; the connection is abandoned, so the cancelled read's
                            // buffer (and any TLS state) no longer matters.
                            let stats = &self.st.stats;
                            stats.idle_closed.set(stats.idle_closed.get() + 1);
                            return Next::Drop;
                        }
                    }
                }
                _ => self.read_more().await,
            };
            match read {
                Ok(0) | Err(_) => return Next::Drop,
                Ok(_) => {}
            }
        };
        // Body.
        let mut sent_continue = false;
        let (body_range, total) = loop {
            let avail = &self.rbuf[head.len..];
            let done = if head.chunked {
                match http::decode_chunked(avail, &mut self.body) {
                    Chunked::Done(n) => Some((None, head.len + n)),
                    Chunked::Partial => None,
                    Chunked::Bad(status, why) => return self.bad_request(status, why).await,
                }
            } else {
                let n = head.content_length.unwrap_or(0);
                (avail.len() >= n).then(|| (Some(head.len..head.len + n), head.len + n))
            };
            if let Some(d) = done {
                break d;
            }
            if head.expect_continue && !sent_continue {
                sent_continue = true;
                self.wbuf.clear();
                self.wbuf
                    .extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
                if self.flush_wbuf().await.is_err() {
                    return Next::Drop;
                }
            }
            match self.read_more().await {
                Ok(0) | Err(_) => return Next::Drop,
                Ok(_) => {}
            }
        };
        let plan = self.plan(&head, body_range);
        // The request is consumed; pipelined bytes stay.
        self.rbuf.drain(..total);
        if self.rbuf.capacity() > 1 << 20 && self.rbuf.len() < 8192 {
            self.rbuf.shrink_to(8192);
        }
        self.peer_data = false;
        // In flight from here until its answer ends, whichever way it ends (both paths below
        // return, the client going away included).
        let counted = !plan.route.is_control();
        if counted {
            self.st.stats.request_began();
        }
        let next = self.answer(&plan).await;
        if counted {
            self.st.stats.request_ended();
        }
        if self.body.capacity() > 1 << 20 {
            self.body = Vec::new();
        }
        next
    }

    /// Answers a read request: waits for a `--max-running` slot (the mock's own endpoints
    /// don't), then answers as the plan says.
    async fn answer(&mut self, plan: &Plan) -> Next {
        let _slot = if plan.route.is_control() {
            None
        } else {
            let mut slot = self.st.slots.acquire();
            match slot.now() {
                Some(permit) => Some(permit),
                // Queued: a client that goes away meanwhile leaves the queue.
                None => match self.or_gone(slot).await {
                    Ok(permit) => Some(permit),
                    Err(Gone) => return Next::Drop,
                },
            }
        };
        match plan.fault {
            Some(Fault::Stall) => self.stall().await,
            Some(Fault::DropBeforeResponse) => self.drop_before_response(plan).await,
            _ if plan.stream && plan.status.is_none() && plan.reject.is_none() => {
                self.stream(plan).await
            }
            _ => self.plain(plan).await,
        }
    }

    /// Builds the echo object into `self.echo` and the response plan.
    fn plan(&mut self, head: &Head, body_range: Option<Range<usize>>) -> Plan {
        let st = &self.st;
        let rbuf = &self.rbuf;
        let body: &[u8] = match &body_range {
            Some(r) => &rbuf[r.clone()],
            None => &self.body,
        };
        let method = &rbuf[head.method.clone()];
        let full_path = &rbuf[head.path.clone()];
        let path = match memchr::memchr(b'?', full_path) {
            Some(i) => &full_path[..i],
            None => full_path,
        };
        let route = match (method, path) {
            (b"POST", b"/v1/chat/completions") => Route::Chat,
            (b"POST", b"/v1/completions") => Route::Completions,
            (b"POST", b"/v1/responses") => Route::Responses,
            (b"POST", b"/v1/embeddings") => Route::Embeddings,
            (b"GET", b"/v1/models") => Route::Models,
            (b"POST", b"/v1/messages") => Route::Messages,
            _ => match Endpoint::route(method, path) {
                Some(ep) => Route::Control(ep),
                None => Route::NotFound,
            },
        };
        let cfg = &st.cfg;
        let mut plan = Plan {
            route,
            stream: false,
            include_usage: false,
            seq: 0,
            created: 0,
            model_json: Vec::new(),
            model_header: Vec::new(),
            prompt_tokens: (body.len() as u64 / 4).max(1),
            tokens: cfg.tokens,
            ttft_ms: cfg.ttft_ms,
            itl_ms: cfg.inter_token_ms,
            ping_ms: 0,
            delay_ms: 0,
            no_echo: false,
            provider_fields: false,
            connection_option: None,
            fault: st.fault.get(),
            status: None,
            error_code: cfg.error_code.clone(),
            retry_after: cfg.retry_after.as_ref().map(|v| v.as_bytes().to_vec()),
            control: None,
            control_body: Vec::new(),
            close: head.wants_close,
            http10: head.minor == 0,
            what: String::new(),
            messages: None,
            reject: None,
            tool_calls: 0,
            cache_read: 0,
            cache_write: 0,
            cache_headers: false,
            chat_tool_names: Vec::new(),
            chat_tool_calls: 0,
            chat_tool_args: Vec::new(),
            tool_script: Vec::new(),
        };
        if let Route::Control(ep) = route {
            // The control endpoints ignore faults and controls.
            plan.fault = None;
            plan.control = Some(control::answer(ep, body, st, &mut plan.control_body));
            return plan;
        }
        st.stats.requests.set(st.stats.requests.get() + 1);
        st.seq.set(st.seq.get() + 1);
        plan.seq = st.seq.get();
        plan.created = unix_now();

        // Top-level fields of a JSON body.
        let mut model: Option<String> = None;
        let mut offer = Offer::default();
        if !body.is_empty() {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
                model = v.get("model").and_then(|m| m.as_str()).map(str::to_owned);
                plan.stream = v.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
                plan.include_usage = v
                    .pointer("/stream_options/include_usage")
                    .and_then(|s| s.as_bool())
                    .unwrap_or(false);
                if route == Route::Chat {
                    offer = Offer::read(&v);
                }
            }
        }
        if !matches!(
            route,
            Route::Chat | Route::Completions | Route::Responses | Route::Messages
        ) {
            plan.stream = false;
        }
        if route == Route::Messages {
            Stats::bump(&st.stats.messages_requests);
        }
        if route == Route::Chat {
            Stats::bump(&st.stats.chat_requests);
        }
        if plan.stream && plan.include_usage && matches!(route, Route::Chat | Route::Completions) {
            let n = &st.stats.include_usage_requests;
            n.set(n.get() + 1);
        }

        // Per-request controls, and the echo object.
        let mut anthropic_headers = anthropic::Headers::default();
        let echo = &mut self.echo;
        echo.clear();
        echo.extend_from_slice(b"{\"method\":");
        http::json_bytes(echo, method);
        echo.extend_from_slice(b",\"path\":");
        http::json_bytes(echo, full_path);
        echo.extend_from_slice(b",\"headers\":[");
        for (i, (n, v)) in self.hdrs.iter().enumerate() {
            let (name, value) = (&rbuf[n.clone()], &rbuf[v.clone()]);
            if i > 0 {
                echo.push(b',');
            }
            echo.push(b'[');
            http::json_bytes(echo, name);
            echo.push(b',');
            http::json_bytes(echo, value);
            echo.push(b']');
            if name.eq_ignore_ascii_case(b"x-api-key") {
                anthropic_headers.api_key = Some(value);
            } else if name.eq_ignore_ascii_case(b"anthropic-version") {
                anthropic_headers.version = Some(value);
            } else if name.eq_ignore_ascii_case(b"anthropic-beta") {
                anthropic_headers.beta.push(value);
            } else if name.eq_ignore_ascii_case(b"authorization") {
                let v = value.trim_ascii();
                if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
                    anthropic_headers.bearer = Some(&v[7..]);
                }
            }
            if name.len() < 7 || !name[..7].eq_ignore_ascii_case(b"x-mock-") {
                continue;
            }
            let ctl = &name[7..];
            if ctl.eq_ignore_ascii_case(b"status") {
                plan.status = parse_num(value)
                    .filter(|s| (200..=599).contains(s))
                    .map(|s| s as u16);
            } else if ctl.eq_ignore_ascii_case(b"retry-after") {
                let v = value.trim_ascii();
                if v.eq_ignore_ascii_case(b"none") {
                    plan.retry_after = None;
                } else if !v.is_empty() {
                    let mut out = Vec::with_capacity(v.len());
                    header_safe(&mut out, v);
                    plan.retry_after = Some(out);
                }
            } else if ctl.eq_ignore_ascii_case(b"error-code") {
                let v = String::from_utf8_lossy(value.trim_ascii());
                plan.error_code = (!v.is_empty()).then(|| v.into_owned());
            } else if ctl.eq_ignore_ascii_case(b"ttft-ms") {
                plan.ttft_ms = parse_num(value).unwrap_or(plan.ttft_ms);
            } else if ctl.eq_ignore_ascii_case(b"inter-token-ms") {
                plan.itl_ms = parse_num(value).unwrap_or(plan.itl_ms);
            } else if ctl.eq_ignore_ascii_case(b"ping-ms") {
                plan.ping_ms = parse_num(value).unwrap_or(plan.ping_ms);
            } else if ctl.eq_ignore_ascii_case(b"tokens") {
                plan.tokens = parse_num(value).unwrap_or(plan.tokens);
            } else if ctl.eq_ignore_ascii_case(b"prompt-tokens") {
                // The uncached prompt (Anthropic's `input_tokens`), instead of body length / 4:
                // two dialects' requests then report the same counts.
                plan.prompt_tokens = parse_num(value).unwrap_or(plan.prompt_tokens);
            } else if ctl.eq_ignore_ascii_case(b"delay-ms") {
                plan.delay_ms = parse_num(value).unwrap_or(0);
            } else if ctl.eq_ignore_ascii_case(b"echo") {
                plan.no_echo = value.eq_ignore_ascii_case(b"none");
            } else if ctl.eq_ignore_ascii_case(b"headers") {
                plan.provider_fields = value.eq_ignore_ascii_case(b"provider");
            } else if ctl.eq_ignore_ascii_case(b"connection-option") {
                // A token only (letters, digits, `-`), so it is safe in the head.
                let token = !value.is_empty()
                    && value.len() <= 64
                    && value
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || *b == b'-');
                plan.connection_option = token.then(|| value.to_vec());
            } else if ctl.eq_ignore_ascii_case(b"tool-calls") {
                plan.tool_calls = parse_num(value).unwrap_or(0);
            } else if ctl.eq_ignore_ascii_case(b"tool-calls-json") {
                plan.tool_script = chat_tools::read_script(value).unwrap_or_default();
            } else if ctl.eq_ignore_ascii_case(b"cache-read") {
                plan.cache_read = parse_num(value).unwrap_or(0);
                plan.cache_headers = true;
            } else if ctl.eq_ignore_ascii_case(b"cache-write") {
                plan.cache_write = parse_num(value).unwrap_or(0);
                plan.cache_headers = true;
            } else if ctl.eq_ignore_ascii_case(b"fault") {
                // An unknown SPEC leaves the process fault in place.
                if let Some(f) = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| Fault::parse_spec(v).ok())
                {
                    plan.fault = f;
                }
            }
        }
        if route == Route::Chat && plan.tool_script.is_empty() {
            plan.chat_tool_calls = offer.calls(plan.tool_calls);
            plan.chat_tool_names = offer.names;
        } else if route == Route::Chat {
            // Scripted: exactly these calls, whatever the request offers.
            let script = &plan.tool_script;
            plan.chat_tool_calls = script.len() as u64;
            plan.chat_tool_names = script.iter().map(|c| c.name.clone()).collect();
            plan.chat_tool_args = script.iter().map(|c| c.arguments.clone()).collect();
        }
        echo.extend_from_slice(b"],\"body\":");
        http::json_bytes(echo, body);
        echo.extend_from_slice(b",\"model\":");
        match &model {
            Some(m) => http::json_str(echo, m),
            None => echo.extend_from_slice(b"null"),
        }
        echo.push(b'}');
        // Built all the same (the control headers are read while building it), then dropped:
        // an empty echo is left out of the answer.
        if plan.no_echo {
            echo.clear();
        }

        match plan.fault {
            Some(Fault::Status(s)) => {
                plan.status = plan.status.or(Some(s));
            }
            Some(Fault::Quota) => {
                // Anthropic answers an account out of credit with a 400, OpenAI with a 429.
                let status = if route == Route::Messages {
                    anthropic_wire::CREDIT_STATUS
                } else {
                    429
                };
                plan.status = plan.status.or(Some(status));
                plan.error_code = Some(body::QUOTA_CODE.to_owned());
            }
            _ => {}
        }
        if route == Route::Messages {
            // An injected status wins over the checks, as it wins over `--reject-key`.
            if plan.status.is_none() {
                let checked = anthropic::check_headers(&anthropic_headers, &cfg.reject_keys)
                    .and_then(|()| anthropic::validate(body));
                match checked {
                    Ok(req) => {
                        plan.stream = req.stream;
                        let sizes = anthropic::Sizes {
                            tokens: plan.tokens,
                            tool_calls: plan.tool_calls,
                            script: plan.tool_script.clone(),
                            input_tokens: plan.prompt_tokens,
                            cache_read: plan.cache_read,
                            cache_write: plan.cache_write,
                        };
                        plan.messages = Some(Box::new(Answer::plan(&req, &sizes)));
                    }
                    Err(reject) => plan.reject = Some(reject),
                }
            }
        } else if !cfg.reject_keys.is_empty() && plan.status.is_none() {
            // A revoked key (`--reject-key`): 401, as a provider answers it.
            let rejected = self.hdrs.iter().any(|(n, v)| {
                let (name, value) = (&rbuf[n.clone()], rbuf[v.clone()].trim_ascii());
                let key = if name.eq_ignore_ascii_case(b"authorization") {
                    value.strip_prefix(b"Bearer ").unwrap_or(value)
                } else if name.eq_ignore_ascii_case(b"x-api-key")
                    || name.eq_ignore_ascii_case(b"api-key")
                {
                    value
                } else {
                    return false;
                };
                cfg.reject_keys.iter().any(|k| k.as_bytes() == key)
            });
            if rejected {
                plan.status = Some(401);
                plan.error_code = Some("invalid_api_key".to_owned());
            }
        }
        let m = model.as_deref().unwrap_or("");
        header_safe(&mut plan.model_header, m.as_bytes());
        http::json_str(
            &mut plan.model_json,
            if m.is_empty() { "mock-model" } else { m },
        );
        if route == Route::NotFound {
            plan.what = format!(
                "{} {}",
                String::from_utf8_lossy(method),
                String::from_utf8_lossy(full_path)
            );
        }
        plan
    }

    fn gen<'a>(&self, p: &'a Plan) -> Gen<'a> {
        Gen {
            seq: p.seq,
            created: p.created,
            model_json: &p.model_json,
            prompt_tokens: p.openai_prompt_tokens(),
            tokens: p.tokens,
            cache: p.chat_cache(),
            tool_names: &p.chat_tool_names,
            tool_args: &p.chat_tool_args,
            tool_calls: p.chat_tool_calls,
        }
    }

    /// Writes a response head into `wbuf` (cleared first).
    fn head(&mut self, p: &Plan, status: u16, ctype: &str, len: Len, close: bool) {
        let w = &mut self.wbuf;
        w.clear();
        let _ = write!(
            w,
            "HTTP/1.1 {status} {}\r\ncontent-type: {ctype}\r\n",
            reason(status)
        );
        match len {
            Len::Omitted => {}
            Len::Content(n) => {
                let _ = write!(w, "content-length: {n}\r\n");
            }
            Len::Chunked => {
                w.extend_from_slice(b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n")
            }
            Len::Unframed => w.extend_from_slice(b"cache-control: no-cache\r\n"),
        }
        if !p.route.is_control() {
            w.extend_from_slice(b"x-mock-model: ");
            w.extend_from_slice(&p.model_header);
            w.extend_from_slice(b"\r\n");
        }
        if p.provider_fields {
            w.extend_from_slice(PROVIDER_FIELDS);
        }
        if let Some(option) = &p.connection_option {
            w.extend_from_slice(b"connection: ");
            w.extend_from_slice(option);
            w.extend_from_slice(b"\r\n");
            w.extend_from_slice(option);
            w.extend_from_slice(b": for-one-hop\r\n");
        }
        if p.route == Route::Messages {
            // Anthropic names each request; error bodies carry the same id.
            let _ = write!(w, "request-id: req_mock_{}\r\n", p.seq);
        }
        if let (429 | 503 | 529, Some(after)) = (status, &p.retry_after) {
            w.extend_from_slice(b"retry-after: ");
            w.extend_from_slice(after);
            w.extend_from_slice(b"\r\n");
        }
        if close {
            w.extend_from_slice(b"connection: close\r\n");
        } else if p.http10 {
            w.extend_from_slice(b"connection: keep-alive\r\n");
        }
        w.extend_from_slice(b"\r\n");
    }

    /// A non-streaming response (including errors, 404 and the stats endpoint).
    async fn plain(&mut self, p: &Plan) -> Next {
        if p.delay_ms > 0 {
            let deadline = Instant::now() + Duration::from_millis(p.delay_ms);
            if self.pause_until(deadline).await.is_err() {
                self.abandoned();
                return Next::Drop;
            }
        }
        let mut body = std::mem::take(&mut self.body);
        body.clear();
        let g = self.gen(p);
        let echo = &self.echo;
        // The usage this body reports, counted once it is sent.
        let usage = match (p.status, p.route) {
            (None, Route::Chat | Route::Completions | Route::Responses) => {
                Some((p.openai_prompt_tokens(), p.tokens))
            }
            (None, Route::Embeddings) => Some((p.prompt_tokens, 0)),
            (None, Route::Messages) => p
                .messages
                .as_ref()
                .map(|a| (a.prompt_tokens(), a.output_tokens())),
            _ => None,
        };
        let mut ctype = "application/json";
        let status = match (p.status, p.route) {
            (_, Route::Control(_)) => {
                let Some(answer) = &p.control else {
                    // plan() answers every control request.
                    return Next::Drop;
                };
                body.extend_from_slice(&p.control_body);
                ctype = answer.ctype;
                answer.status
            }
            (Some(s), Route::Messages) => {
                anthropic_wire::injected_error(&mut body, s, p.error_code.as_deref(), p.seq);
                Stats::bump(&self.st.stats.errors_injected);
                s
            }
            (Some(s), _) => {
                // Like a real provider, an injected error echoes nothing (no request headers).
                body::injected_error(&mut body, s, p.error_code.as_deref());
                Stats::bump(&self.st.stats.errors_injected);
                s
            }
            (None, Route::Messages) => match (&p.reject, &p.messages) {
                (Some(r), _) => {
                    // Refused by the checks: Anthropic's error, with the echo (what was sent
                    // is what a test wants to see next to why it was refused).
                    anthropic_wire::error(&mut body, r.kind, &r.message, p.seq, Some(echo));
                    Stats::bump(&self.st.stats.invalid_requests);
                    r.status
                }
                (None, Some(answer)) => {
                    let m = Msg {
                        seq: p.seq,
                        model_json: &p.model_json,
                        answer,
                    };
                    anthropic_wire::message(&mut body, &m, echo);
                    200
                }
                // plan() sets one of the two for every Messages request it does not fail.
                (None, None) => return Next::Drop,
            },
            (None, Route::NotFound) => {
                let msg = format!("Unknown request URL: {}", p.what);
                body::error(&mut body, 404, &msg, Some(echo));
                404
            }
            (None, Route::Chat) => {
                body::chat_completion(&mut body, &g, echo);
                200
            }
            (None, Route::Completions) => {
                body::text_completion(&mut body, &g, echo);
                200
            }
            (None, Route::Responses) => {
                body::response(&mut body, &g, echo);
                200
            }
            (None, Route::Embeddings) => {
                body::embeddings(&mut body, &g, echo);
                200
            }
            (None, Route::Models) => {
                body::models(&mut body, echo);
                200
            }
        };
        let close_delimited = p.fault == Some(Fault::CloseDelimited);
        let close = p.close || close_delimited || p.fault == Some(Fault::CloseAfter);
        // RFC 9110 §15.3.5, §15.4.5: 204 and 304 never carry content. A 204 gets no
        // Content-Length either; a 304 keeps the one of the body it replaces (§8.6 allows that),
        // so a recipient must know 304 framing rather than trust the header.
        let no_body = status == 204 || status == 304;
        let len = if status == 204 {
            Len::Omitted
        } else if close_delimited && !no_body {
            Len::Unframed
        } else {
            Len::Content(body.len())
        };
        self.head(p, status, ctype, len, close);
        if !no_body {
            self.wbuf.extend_from_slice(&body);
        }
        self.body = body;
        let sent = self.flush_wbuf().await;
        if let (Ok(()), Some((prompt, completion)), false) = (&sent, usage, no_body) {
            self.st.stats.reported_usage(prompt, completion);
            if let Some(a) = &p.messages {
                self.st.stats.reported_cache(a.cache_read, a.cache_write);
            } else if let Some((read, write)) = p.chat_cache() {
                self.st.stats.reported_cache(read, write);
            }
        }
        match sent {
            Ok(()) if close => Next::Close,
            Ok(()) => Next::KeepAlive,
            Err(Gone) => Next::Drop,
        }
    }

    /// A streaming (SSE) response; keeps the stream counters.
    async fn stream(&mut self, p: &Plan) -> Next {
        let stats = &self.st.stats;
        stats.streams_started.set(stats.streams_started.get() + 1);
        let next = self.stream_inner(p).await;
        let stats = &self.st.stats;
        match next {
            Err(Gone) => {
                stats.streams_aborted.set(stats.streams_aborted.get() + 1);
                self.abandoned();
                Next::Drop
            }
            Ok(next) => {
                stats
                    .streams_completed
                    .set(stats.streams_completed.get() + 1);
                next
            }
        }
    }

    async fn stream_inner(&mut self, p: &Plan) -> Result<Next, Gone> {
        let fault = p.fault;
        let framing = match fault {
            _ if p.http10 => Framing::Raw,
            Some(Fault::CloseDelimited) => Framing::Raw,
            Some(Fault::ChunkExt) => Framing::ChunkedExt,
            _ => Framing::Chunked,
        };
        let close = p.close || framing == Framing::Raw || fault == Some(Fault::CloseAfter);
        if p.delay_ms > 0 {
            self.pause_until(Instant::now() + Duration::from_millis(p.delay_ms))
                .await?;
        }
        let g = self.gen(p);

        // Head and the echo comment, then the prelude event.
        let len = if framing == Framing::Raw {
            Len::Unframed
        } else {
            Len::Chunked
        };
        self.head(p, 200, "text/event-stream", len, close);
        self.ev.clear();
        body::ev_echo(&mut self.ev, &self.echo);
        // No echo (`x-mock-echo: none`): nothing to frame — an empty chunk would end the body.
        if !self.ev.is_empty() {
            frame_into(&mut self.wbuf, &self.ev, framing);
        }
        self.flush_wbuf().await?;
        // Content events: one per token; on /v1/messages one per content delta (thinking,
        // text and tool input alike); for chat tool calls one per arguments fragment.
        let content_total = match &p.messages {
            Some(a) => a.output_tokens(),
            None if g.tool_calls > 0 => g.tool_calls.saturating_mul(chat_tools::ARG_PIECES),
            None => p.tokens,
        };
        // Cut the stream (drop the connection) before content event N, or put an error event
        // in its place.
        let cut_at = match fault {
            Some(Fault::DropMidStream) => Some(content_total.div_ceil(2)),
            Some(Fault::DieAfter(n)) => Some(n),
            _ => None,
        };
        let error_at = match fault {
            Some(Fault::ErrorEvent(n)) => Some(n),
            _ => None,
        };
        let end_at = match fault {
            Some(Fault::EndAfter(n)) => Some(n),
            _ => None,
        };
        if let Some(answer) = &p.messages {
            let at = FaultPoints {
                cut_at,
                error_at,
                end_at,
            };
            return self.messages_events(p, answer, framing, close, at).await;
        }
        let prelude = match p.route {
            Route::Chat => Some(body::ev_chat_role as fn(&mut Vec<u8>, &Gen)),
            Route::Responses => Some(body::ev_response_created as fn(&mut Vec<u8>, &Gen)),
            _ => None,
        };
        // An error before any content is the first data event: no role delta or
        // `response.created` before it, as when a provider fails a request at once.
        if let (Some(f), false) = (prelude, error_at == Some(0)) {
            self.ev.clear();
            f(&mut self.ev, &g);
            self.send_ev(framing, b"").await?;
        }

        // Content events: the tokens, or the chat tool calls' arguments fragments (each call's
        // first chunk goes out, at the same time, just before its fragment 0: so a cut, an
        // error event or an end in place of that fragment leaves the call out whole).
        let contents: Box<dyn Iterator<Item = Content>> =
            if g.tool_calls > 0 {
                Box::new((0..g.tool_calls).flat_map(|i| {
                    (0..chat_tools::ARG_PIECES).map(move |j| Content::ToolArgs(i, j))
                }))
            } else {
                Box::new((0..p.tokens).map(Content::Token))
            };
        let t0 = Instant::now();
        let mut sent = 0u64;
        for content in contents {
            if cut_at == Some(sent) {
                Stats::bump(&self.st.stats.streams_cut);
                return Ok(Next::Drop);
            }
            if end_at == Some(sent) {
                return self.end_without_finish(framing, close).await;
            }
            let at = p.ttft_ms.saturating_add(sent.saturating_mul(p.itl_ms));
            self.pause_until(t0 + Duration::from_millis(at)).await?;
            if error_at == Some(sent) {
                return self.error_event(p, framing, sent, close).await;
            }
            if let Content::ToolArgs(i, 0) = content {
                self.ev.clear();
                body::ev_chat_tool_start(&mut self.ev, &g, i);
                self.send_ev(framing, b"").await?;
            }
            self.ev.clear();
            match (content, p.route) {
                (Content::ToolArgs(i, j), _) => body::ev_chat_tool_args(&mut self.ev, &g, i, j),
                (Content::Token(i), Route::Chat) => body::ev_chat_content(&mut self.ev, &g, i),
                (Content::Token(i), Route::Completions) => {
                    body::ev_completion_content(&mut self.ev, &g, i)
                }
                (Content::Token(i), _) => body::ev_response_delta(&mut self.ev, &g, i),
            }
            self.send_ev(framing, b"").await?;
            sent += 1;
            if fault == Some(Fault::MalformedChunk) {
                break;
            }
        }
        // A cut or an error event set past the last content event comes before the finish.
        if cut_at.is_some() {
            Stats::bump(&self.st.stats.streams_cut);
            return Ok(Next::Drop);
        }
        if error_at.is_some() {
            return self.error_event(p, framing, sent, close).await;
        }
        if end_at.is_some() {
            return self.end_without_finish(framing, close).await;
        }
        if fault == Some(Fault::MalformedChunk) {
            self.wbuf.clear();
            self.wbuf.extend_from_slice(b"zz\r\ngarbage\r\n");
            self.flush_wbuf().await?;
            Stats::bump(&self.st.stats.streams_cut);
            return Ok(Next::Drop);
        }

        // Finish, usage, [DONE] (the Responses API ends with response.completed instead).
        self.ev.clear();
        match p.route {
            Route::Chat => body::ev_chat_finish(&mut self.ev, &g),
            Route::Completions => body::ev_completion_finish(&mut self.ev, &g),
            _ => body::ev_response_completed(&mut self.ev, &g),
        }
        let st = Rc::clone(&self.st);
        let stats = &st.stats;
        if p.route == Route::Responses {
            self.send_ev(framing, terminator(framing)).await?;
            // `response.completed` carries the usage.
            stats.reported_usage(g.prompt_tokens, p.tokens);
        } else {
            self.send_ev(framing, b"").await?;
            if p.include_usage {
                self.ev.clear();
                if p.route == Route::Chat {
                    body::ev_chat_usage(&mut self.ev, &g);
                } else {
                    body::ev_completion_usage(&mut self.ev, &g);
                }
                self.send_ev(framing, b"").await?;
                stats.reported_usage(g.prompt_tokens, p.tokens);
                if let Some((read, write)) = g.cache {
                    stats.reported_cache(read, write);
                }
                stats.usage_chunks.set(stats.usage_chunks.get() + 1);
            }
            self.ev.clear();
            body::ev_done(&mut self.ev);
            self.send_ev(framing, terminator(framing)).await?;
        }
        Ok(if close { Next::Close } else { Next::KeepAlive })
    }

    /// The events of a `/v1/messages` stream after its head and `: echo` comment (see
    /// [`anthropic_wire`]): `message_start`, the blocks with their deltas, `message_delta`,
    /// `message_stop`. The content deltas are the content events the timing and the faults
    /// count; the other events go out at once, each in a chunk of its own, before the delta that
    /// follows them (or, after the last delta, before the cut or the end a fault makes).
    async fn messages_events(
        &mut self,
        p: &Plan,
        answer: &Answer,
        framing: Framing,
        close: bool,
        at: FaultPoints,
    ) -> Result<Next, Gone> {
        let m = Msg {
            seq: p.seq,
            model_json: &p.model_json,
            answer,
        };
        // `error-event` with N = 0: the error is the first data event (no `message_start`).
        let quiet = at.error_at == Some(0);
        let mut steps = Vec::new();
        for (i, block) in answer.blocks().into_iter().enumerate() {
            steps.push(Step::Start(i, block));
            if i == 0 {
                steps.push(Step::Ping);
            }
            steps.extend((0..answer.deltas(block)).map(|j| Step::Delta(i, block, j)));
            if block == Block::Thinking {
                steps.push(Step::Signature(i));
            }
            steps.push(Step::Stop(i));
        }
        if !quiet {
            self.ev.clear();
            anthropic_wire::ev_message_start(&mut self.ev, &m);
            self.send_ev(framing, b"").await?;
        }
        let t0 = Instant::now();
        let mut sent = 0u64;
        for step in steps {
            self.ev.clear();
            match step {
                Step::Delta(i, block, j) => {
                    if at.cut_at == Some(sent) {
                        Stats::bump(&self.st.stats.streams_cut);
                        return Ok(Next::Drop);
                    }
                    if at.end_at == Some(sent) {
                        return self.end_without_finish(framing, close).await;
                    }
                    let due = t0
                        + Duration::from_millis(
                            p.ttft_ms.saturating_add(sent.saturating_mul(p.itl_ms)),
                        );
                    // Pings while the delta is not due (x-mock-ping-ms): bytes on the wire
                    // that carry no content.
                    let ping_every = Duration::from_millis(p.ping_ms);
                    let mut ping_at = Instant::now() + ping_every;
                    while p.ping_ms > 0 && ping_at < due {
                        self.pause_until(ping_at).await?;
                        self.ev.clear();
                        anthropic_wire::ev_ping(&mut self.ev);
                        self.send_ev(framing, b"").await?;
                        ping_at = Instant::now() + ping_every;
                    }
                    self.ev.clear();
                    self.pause_until(due).await?;
                    if at.error_at == Some(sent) {
                        return self.error_event(p, framing, sent, close).await;
                    }
                    anthropic_wire::ev_delta(&mut self.ev, answer, i, block, j);
                    self.send_ev(framing, b"").await?;
                    sent += 1;
                    if p.fault == Some(Fault::MalformedChunk) {
                        break;
                    }
                    continue;
                }
                _ if quiet => continue,
                Step::Start(i, block) => anthropic_wire::ev_block_start(&mut self.ev, &m, i, block),
                Step::Ping => anthropic_wire::ev_ping(&mut self.ev),
                Step::Signature(i) => anthropic_wire::ev_signature(&mut self.ev, &m, i),
                Step::Stop(i) => anthropic_wire::ev_block_stop(&mut self.ev, i),
            }
            self.send_ev(framing, b"").await?;
        }
        // A cut or an error event set past the last content delta comes before the
        // `message_delta`.
        if at.cut_at.is_some() {
            Stats::bump(&self.st.stats.streams_cut);
            return Ok(Next::Drop);
        }
        if at.error_at.is_some() {
            return self.error_event(p, framing, sent, close).await;
        }
        if at.end_at.is_some() {
            return self.end_without_finish(framing, close).await;
        }
        if p.fault == Some(Fault::MalformedChunk) {
            self.wbuf.clear();
            self.wbuf.extend_from_slice(b"zz\r\ngarbage\r\n");
            self.flush_wbuf().await?;
            Stats::bump(&self.st.stats.streams_cut);
            return Ok(Next::Drop);
        }
        // `message_delta` carries the whole usage: counted once it is sent.
        self.ev.clear();
        anthropic_wire::ev_message_delta(&mut self.ev, &m);
        self.send_ev(framing, b"").await?;
        let stats = &self.st.stats;
        stats.reported_usage(answer.prompt_tokens(), answer.output_tokens());
        stats.reported_cache(answer.cache_read, answer.cache_write);
        self.ev.clear();
        anthropic_wire::ev_message_stop(&mut self.ev);
        self.send_ev(framing, terminator(framing)).await?;
        Ok(if close { Next::Close } else { Next::KeepAlive })
    }

    /// Ends a stream's body as a complete one would end on the wire (the terminating chunk, or
    /// the close of an unframed body) but with no finish chunk, usage or `[DONE]` before it:
    /// the `end-after` fault, a truncation only the event content shows.
    async fn end_without_finish(&mut self, framing: Framing, close: bool) -> Result<Next, Gone> {
        Stats::bump(&self.st.stats.streams_cut);
        self.wbuf.clear();
        self.wbuf.extend_from_slice(terminator(framing));
        self.flush_wbuf().await?;
        Ok(if close || framing == Framing::Raw {
            Next::Close
        } else {
            Next::KeepAlive
        })
    }

    /// Ends a stream, after `sent` content events, with the error event of its API: a
    /// `data: {"error":…}` event and `[DONE]` (chat, completions), or an `event: error` (the
    /// Responses API, whose streams have no `[DONE]`); then the stream's normal end.
    async fn error_event(
        &mut self,
        p: &Plan,
        framing: Framing,
        sent: u64,
        close: bool,
    ) -> Result<Next, Gone> {
        Stats::bump(&self.st.stats.error_events);
        let code = p.error_code.as_deref();
        self.ev.clear();
        if p.route == Route::Messages {
            // Anthropic's streams have no `[DONE]` either.
            anthropic_wire::ev_error(&mut self.ev, code);
            self.send_ev(framing, terminator(framing)).await?;
        } else if p.route == Route::Responses {
            // `response.created` was event 0 and the deltas 1..=sent (none when sent is 0:
            // then the error is the first event).
            let seq = if sent == 0 { 0 } else { sent + 1 };
            body::ev_response_error(&mut self.ev, code, seq);
            self.send_ev(framing, terminator(framing)).await?;
        } else {
            body::ev_error(&mut self.ev, code);
            self.send_ev(framing, b"").await?;
            self.ev.clear();
            body::ev_done(&mut self.ev);
            self.send_ev(framing, terminator(framing)).await?;
        }
        Ok(if close { Next::Close } else { Next::KeepAlive })
    }
}

#[cfg(test)]
mod tests {
    //! Whole requests against a connection task, over a real socket: a client thread sends one
    //! request (`Connection: close`) and reads the answer to EOF, noting when each read came.

    use std::io::{Read as _, Write as _};
    use std::time::Instant as StdInstant;

    use serde_json::{json, Value};

    use super::*;
    use crate::{queue, Config};

    fn config() -> Config {
        Config {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens: 4,
            fault: None,
            retry_after: Some("1".to_owned()),
            error_code: None,
            reject_keys: Vec::new(),
            max_running: None,
            idle_close: None,
        }
    }

    /// An answer as the client saw it.
    struct Got {
        head: String,
        /// The body, de-chunked.
        body: Vec<u8>,
        /// The chunked body ended with its terminating chunk.
        complete: bool,
        /// (time since the request was sent, bytes) per read.
        reads: Vec<(Duration, Vec<u8>)>,
        stats: Value,
    }

    impl Got {
        fn json(&self) -> Value {
            match serde_json::from_slice(&self.body) {
                Ok(v) => v,
                Err(e) => panic!("{e}: {}", String::from_utf8_lossy(&self.body)),
            }
        }

        /// The `data:` payloads of the SSE events (comments left out).
        fn data(&self) -> Vec<String> {
            String::from_utf8_lossy(&self.body)
                .split("\n\n")
                .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")))
                .map(str::to_owned)
                .collect()
        }

        /// The data events before `[DONE]`, parsed (each must be JSON).
        fn chunks(&self) -> Vec<Value> {
            self.data()
                .iter()
                .filter(|d| d.as_str() != "[DONE]")
                .map(|d| match serde_json::from_str(d) {
                    Ok(v) => v,
                    Err(e) => panic!("{e}: {d}"),
                })
                .collect()
        }

        /// When the client first had `needle` in what it had read.
        fn first_seen(&self, needle: &str) -> Option<Duration> {
            let mut seen = Vec::new();
            for (at, bytes) in &self.reads {
                seen.extend_from_slice(bytes);
                if memchr::memmem::find(&seen, needle.as_bytes()).is_some() {
                    return Some(*at);
                }
            }
            None
        }
    }

    /// A lenient chunked decoder: what arrived, and whether the terminating chunk did.
    fn dechunk(mut b: &[u8]) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        loop {
            let Some(eol) = memchr::memmem::find(b, b"\r\n") else {
                return (out, false);
            };
            let size = std::str::from_utf8(&b[..eol])
                .ok()
                .and_then(|l| usize::from_str_radix(l.split(';').next()?.trim(), 16).ok());
            let Some(size) = size else {
                return (out, false);
            };
            if size == 0 {
                return (out, true);
            }
            let data = &b[eol + 2..];
            if data.len() < size + 2 {
                out.extend_from_slice(&data[..size.min(data.len())]);
                return (out, false);
            }
            out.extend_from_slice(&data[..size]);
            b = &data[size + 2..];
        }
    }

    fn exchange(path: &str, headers: &[(&str, &str)], body: &Value) -> Got {
        exchange_with(config(), path, headers, body)
    }

    fn exchange_with(cfg: Config, path: &str, headers: &[(&str, &str)], body: &Value) -> Got {
        let body = body.to_string();
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n",
            body.len()
        );
        for (n, v) in headers {
            req.push_str(&format!("{n}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(&body);
        let st = Rc::new(State {
            fault: std::cell::Cell::new(cfg.fault),
            slots: queue::Slots::new(cfg.max_running),
            cfg,
            stats: Stats::default(),
            seq: std::cell::Cell::new(0),
        });
        let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap();
        let client = rt.block_on({
            let st = st.clone();
            async move {
                let listener = monoio::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = listener.local_addr().unwrap();
                let client = std::thread::spawn(move || {
                    let mut c = std::net::TcpStream::connect(addr).unwrap();
                    c.write_all(req.as_bytes()).unwrap();
                    let t0 = StdInstant::now();
                    let mut reads = Vec::new();
                    let mut buf = [0u8; 16384];
                    loop {
                        match c.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => reads.push((t0.elapsed(), buf[..n].to_vec())),
                        }
                    }
                    reads
                });
                let (tcp, _) = listener.accept().await.unwrap();
                run(tcp, st, None).await;
                client
            }
        });
        let reads = client.join().unwrap();
        let all: Vec<u8> = reads.iter().flat_map(|(_, b)| b.iter().copied()).collect();
        let split = memchr::memmem::find(&all, b"\r\n\r\n").unwrap() + 4;
        let head = String::from_utf8_lossy(&all[..split]).into_owned();
        let (body, complete) = if head.contains("transfer-encoding: chunked") {
            dechunk(&all[split..])
        } else {
            (all[split..].to_vec(), true)
        };
        let mut stats = Vec::new();
        st.stats.write_json(&mut stats, st.slots.counts());
        Got {
            head,
            body,
            complete,
            reads,
            stats: serde_json::from_slice(&stats).unwrap(),
        }
    }

    fn chat(stream: bool) -> Value {
        json!({
            "model": "gpt-mock",
            "stream": stream,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
            ]
        })
    }

    /// What the mock counts as the request's own prompt: the body length / 4.
    fn base_prompt(body: &Value) -> u64 {
        (body.to_string().len() as u64 / 4).max(1)
    }

    /// The calls of a streamed chat answer, reassembled by index as the OpenAI SDK does:
    /// (id, name, arguments, argument chunks). Checks each chunk's shape on the way.
    fn reassemble(chunks: &[Value]) -> Vec<(String, String, String, usize)> {
        let mut calls: Vec<(String, String, String, usize)> = Vec::new();
        for c in chunks {
            let Some(tcs) = c["choices"][0]["delta"]["tool_calls"].as_array() else {
                continue;
            };
            assert_eq!(tcs.len(), 1, "{c}");
            let tc = &tcs[0];
            let i = tc["index"].as_u64().unwrap() as usize;
            if let Some(id) = tc["id"].as_str() {
                // A call's first chunk: the next index, with its id, type and name.
                assert_eq!(i, calls.len(), "indexes are dense from 0: {c}");
                assert_eq!(tc["type"], "function", "{c}");
                assert_eq!(tc["function"]["arguments"], "", "{c}");
                let name = tc["function"]["name"].as_str().unwrap();
                calls.push((id.to_owned(), name.to_owned(), String::new(), 0));
            } else {
                // Then its fragments: the same index, no id, type or name.
                assert_eq!(
                    i + 1,
                    calls.len(),
                    "fragments follow their call's start: {c}"
                );
                assert!(tc.get("type").is_none(), "{c}");
                assert!(tc["function"].get("name").is_none(), "{c}");
                calls[i]
                    .2
                    .push_str(tc["function"]["arguments"].as_str().unwrap());
                calls[i].3 += 1;
            }
        }
        calls
    }

    #[test]
    fn streamed_tool_calls_are_shaped_as_openai_streams_them() {
        let body = chat(true);
        let got = exchange(
            "/v1/chat/completions",
            &[
                ("x-mock-tool-calls", "3"),
                ("x-mock-tokens", "5"),
                ("x-mock-cache-read", "7"),
                ("x-mock-cache-write", "3"),
            ],
            &body,
        );
        assert!(got.head.starts_with("HTTP/1.1 200"), "{}", got.head);
        assert!(got.complete);
        let data = got.data();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        let chunks = got.chunks();
        assert_eq!(chunks.len() + 1, data.len(), "one [DONE], at the end");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let calls = reassemble(&chunks);
        assert_eq!(calls.len(), 3);
        let mut ids = Vec::new();
        for (i, (id, name, args, pieces)) in calls.iter().enumerate() {
            assert!(id.starts_with("call_"), "{id}");
            ids.push(id.clone());
            assert_eq!(name, ["get_weather", "get_time"][i % 2]);
            assert!(*pieces >= 3, "call {i}: {pieces} argument chunks");
            let args: Value = serde_json::from_str(args).unwrap();
            assert_eq!(args, json!({"city": "Paris", "n": i}));
        }
        ids.dedup();
        assert_eq!(ids.len(), 3, "ids differ");
        // No text anywhere; then the finish, the usage, [DONE].
        assert!(chunks
            .iter()
            .all(|c| c["choices"][0]["delta"].get("content").is_none()));
        let n = chunks.len();
        let finish = &chunks[n - 2];
        assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(finish["choices"][0]["delta"], json!({}));
        assert!(chunks[..n - 2]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        let usage = &chunks[n - 1];
        assert_eq!(usage["choices"], json!([]));
        let u = &usage["usage"];
        let prompt = base_prompt(&body) + 7 + 3;
        assert_eq!(u["prompt_tokens"], prompt);
        assert_eq!(u["completion_tokens"], 5);
        assert_eq!(u["total_tokens"], prompt + 5);
        assert_eq!(
            u["prompt_tokens_details"],
            json!({"cached_tokens": 7, "cache_write_tokens": 3})
        );
        // The stats count what was reported, as for /v1/messages.
        let s = &got.stats;
        assert_eq!(s["usage_prompt_tokens"], prompt);
        assert_eq!(s["usage_completion_tokens"], 5);
        assert_eq!(s["usage_cache_read_tokens"], 7);
        assert_eq!(s["usage_cache_creation_tokens"], 3);
        assert_eq!(
            (&s["usage_chunks"], &s["streams_completed"]),
            (&json!(1), &json!(1))
        );
    }

    #[test]
    fn whole_tool_calls_answer() {
        let body = chat(false);
        let got = exchange(
            "/v1/chat/completions",
            &[("x-mock-tool-calls", "2"), ("x-mock-cache-read", "4")],
            &body,
        );
        let v = got.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], Value::Null);
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        let names: Vec<_> = calls.iter().map(|c| &c["function"]["name"]).collect();
        assert_eq!(names, ["get_weather", "get_time"]);
        assert_eq!(calls[1]["id"], "call_mock_1_1");
        let args: Value =
            serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris", "n": 1}));
        let u = &v["usage"];
        let prompt = base_prompt(&body) + 4;
        assert_eq!(u["prompt_tokens"], prompt);
        assert_eq!(u["completion_tokens"], 4, "--tokens, as a text answer");
        assert_eq!(u["total_tokens"], prompt + 4);
        assert_eq!(
            u["prompt_tokens_details"],
            json!({"cached_tokens": 4, "cache_write_tokens": 0})
        );
        let s = &got.stats;
        assert_eq!(s["usage_prompt_tokens"], prompt);
        assert_eq!(s["usage_cache_read_tokens"], 4);
        assert_eq!(s["usage_cache_creation_tokens"], 0);
    }

    #[test]
    fn without_tools_the_header_is_ignored() {
        let mut plain = chat(false);
        plain.as_object_mut().unwrap().remove("tools");
        let mut empty = chat(true);
        empty["tools"] = json!([]);
        let mut none = chat(false);
        none["tool_choice"] = json!("none");
        for body in [plain, none] {
            let got = exchange("/v1/chat/completions", &[("x-mock-tool-calls", "2")], &body);
            let v = got.json();
            assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2 tok3");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            assert!(v["choices"][0]["message"].get("tool_calls").is_none());
            // No cache headers: usage as before, no details.
            assert_eq!(v["usage"]["prompt_tokens"], base_prompt(&body));
            assert!(v["usage"].get("prompt_tokens_details").is_none());
            assert_eq!(got.stats["usage_cache_read_tokens"], 0);
        }
        let got = exchange(
            "/v1/chat/completions",
            &[("x-mock-tool-calls", "2")],
            &empty,
        );
        let chunks = got.chunks();
        assert!(reassemble(&chunks).is_empty());
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "tok0 tok1 tok2 tok3");
        assert_eq!(
            chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
            "stop"
        );
        // The header is for chat only: a text completion stays text.
        let got = exchange(
            "/v1/completions",
            &[("x-mock-tool-calls", "2"), ("x-mock-cache-read", "5")],
            &json!({"prompt": "x", "tools": chat(false)["tools"]}),
        );
        let v = got.json();
        assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 tok3");
        assert!(v["usage"].get("prompt_tokens_details").is_none());
        assert_eq!(got.stats["usage_cache_read_tokens"], 0);
    }

    #[test]
    fn faults_count_argument_chunks_as_content_events() {
        let body = chat(true);
        let stream = |fault: &str| {
            exchange(
                "/v1/chat/completions",
                &[("x-mock-tool-calls", "2"), ("x-mock-fault", fault)],
                &body,
            )
        };
        // Four fragments per call: die-after=5 cuts after call 1's first fragment.
        let got = stream("die-after=5");
        assert!(!got.complete);
        let calls = reassemble(&got.chunks());
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].3, calls[1].3), (4, 1));
        assert!(!got.data().iter().any(|d| d == "[DONE]"));
        assert_eq!(got.stats["streams_cut"], 1);
        // A cut in place of a call's first fragment leaves the call out whole.
        let calls = reassemble(&stream("die-after=4").chunks());
        assert_eq!(calls.len(), 1);
        // end-after: the body ends framed, with no finish and no [DONE].
        let got = stream("end-after=6");
        assert!(got.complete);
        let chunks = got.chunks();
        assert_eq!(reassemble(&chunks)[1].3, 2);
        assert!(chunks
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        assert!(!got.data().iter().any(|d| d == "[DONE]"));
        // error-event=0: the error is the first data event.
        let data = stream("error-event").data();
        assert_eq!(data.len(), 2, "{data:?}");
        assert!(data[0].starts_with("{\"error\":"), "{data:?}");
        assert_eq!(data[1], "[DONE]");
        // error-event=N: after N fragments, in place of the next.
        let got = stream("error-event=4");
        let chunks = got.chunks();
        assert_eq!(reassemble(&chunks).len(), 1);
        assert!(chunks.last().unwrap().get("error").is_some());
        assert_eq!(got.stats["error_events"], 1);
        // drop-mid-stream: half the fragments.
        let calls = reassemble(&stream("drop-mid-stream").chunks());
        assert_eq!((calls.len(), calls[0].3), (1, 4));
        // malformed-chunk: after the first fragment.
        let got = stream("malformed-chunk");
        assert!(!got.complete);
        let calls = reassemble(&got.chunks());
        assert_eq!((calls.len(), calls[0].3), (1, 1));
    }

    #[test]
    fn timing_applies_to_tool_call_chunks() {
        let body = chat(true);
        let got = exchange(
            "/v1/chat/completions",
            &[
                ("x-mock-tool-calls", "2"),
                ("x-mock-ttft-ms", "80"),
                ("x-mock-inter-token-ms", "20"),
            ],
            &body,
        );
        assert!(got.complete);
        // The role chunk at once; the first call's first chunk with its first fragment, after
        // the TTFT; then one fragment every inter-token delay: 8 fragments in all.
        let role = got.first_seen("\"role\":\"assistant\"").unwrap();
        let first_call = got.first_seen("\"tool_calls\"").unwrap();
        let done = got.first_seen("[DONE]").unwrap();
        assert!(role <= first_call, "{role:?} {first_call:?}");
        assert!(first_call >= Duration::from_millis(80), "{first_call:?}");
        assert!(done >= Duration::from_millis(80 + 7 * 20), "{done:?}");
        // The last fragment of the last call, 7 inter-token delays after the first.
        let last = got.first_seen("\"index\":1,\"function\":{\"arguments\":\"\\\"n\\\":1}\"");
        assert!(
            last.is_some_and(|t| t >= Duration::from_millis(80 + 7 * 20)),
            "{last:?}"
        );
    }

    #[test]
    fn cache_counters_match_the_messages_dialect() {
        let cache = [("x-mock-cache-read", "7"), ("x-mock-cache-write", "3")];
        let chat_body = chat(false);
        let chat = exchange("/v1/chat/completions", &cache, &chat_body);
        let messages_body = json!({
            "model": "claude-mock",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "weather?"}]
        });
        let mut headers = cache.to_vec();
        headers.extend([("x-api-key", "k"), ("anthropic-version", "2023-06-01")]);
        let messages = exchange("/v1/messages", &headers, &messages_body);
        assert_eq!(messages.json()["type"], "message", "{}", messages.json());
        for (got, body) in [(&chat, &chat_body), (&messages, &messages_body)] {
            let s = &got.stats;
            assert_eq!(s["usage_cache_read_tokens"], 7);
            assert_eq!(s["usage_cache_creation_tokens"], 3);
            assert_eq!(s["usage_prompt_tokens"], base_prompt(body) + 10);
        }
    }

    #[test]
    fn streamed_cache_usage_is_counted_once_sent() {
        let body = chat(true);
        let cache = [("x-mock-cache-read", "2"), ("x-mock-cache-write", "1")];
        // Without include_usage no usage chunk, so nothing is counted.
        let mut quiet = body.clone();
        quiet["stream_options"] = json!({"include_usage": false});
        let got = exchange("/v1/chat/completions", &cache, &quiet);
        assert!(got.chunks().iter().all(|c| c.get("usage").is_none()));
        assert_eq!(got.stats["usage_cache_read_tokens"], 0);
        let got = exchange("/v1/chat/completions", &cache, &body);
        let chunks = got.chunks();
        let u = &chunks.last().unwrap()["usage"];
        assert_eq!(u["prompt_tokens"], base_prompt(&body) + 3);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(got.stats["usage_cache_read_tokens"], 2);
        assert_eq!(got.stats["usage_prompt_tokens"], base_prompt(&body) + 3);
    }
}
