//! One client connection: read a request (head, then body), dispatch it, repeat while the
//! connection is kept alive.
//!
//! Runs as one task per accepted connection on its worker. Takes the socket; returns when the
//! client closes, a keep-alive idle or read timeout fires, or a request leaves the connection
//! unusable. Raises, as responses: the HTTP layer's 400 / 413 / 414 / 417 / 431 (then closes),
//! 408 when a head or body is not received in time (then closes) — in Anthropic's error shape on
//! `/v1/messages` paths ([`ClientDialect`]). What a request's path and head mean (404, 405,
//! refusals, local answers, the proxy) is the gateway's front door's
//! ([`crate::gateway::front_door`]): this loop carries its decisions out — reads the body it
//! lets in, writes the answers it gives, closes where the body was left unread.
//!
//! While the worker drains for a stop, a connection closes instead of waiting for another
//! request (unless one is already on its way), and the responses written here say
//! `connection: close`. The connection is in the worker's client set for its life, marked while
//! it waits for a request, so the drain's start closes the waiting ones at once.

use std::borrow::Cow;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::time::Duration;

use monoio::net::TcpStream;

use crate::config::Timeouts;
use crate::gateway::auth::KeyDigestMemo;
use crate::gateway::client_addr::client_address;
use crate::gateway::context::Request;
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::gateway::front_door::{self, HeadDecision, Local, Ticket};
use crate::gateway::pipeline;
use crate::http::chunked::ChunkedDecoder;
use crate::http::request::{parse_request_head, HeadScan, HeadStatus, Method, RequestHead};
use crate::http::BodyFraming;
use crate::openai::endpoint::ClientDialect;
use crate::openai::inspect::Inspection;
use crate::runtime::worker::{Generation, Worker, MIN_READ_BUF};
use crate::sys::client::ClientSocket;
use crate::sys::clock;
use crate::sys::clock::Mono;
use crate::sys::spare::SpareBox;
use crate::sys::stream::{self, ReadOutcome};

/// A read buffer larger than this after a request is replaced by a small one.
const KEEP_READ_BUF: usize = 64 * 1024;

/// Per-connection buffers and parse state, reused from one request to the next.
#[derive(Default)]
struct ConnState {
    peer: Option<std::net::SocketAddr>,
    rbuf: Vec<u8>,
    head: RequestHead,
    inspection: Inspection,
    chunked_body: Vec<u8>,
    /// The key this connection presented last and its digest.
    key_memo: KeyDigestMemo,
}

/// Serve one client connection until it ends.
///
/// Between requests the connection waits on a readiness poll holding no read buffer, and the
/// work of a request runs in a boxed future. So an idle keep-alive connection costs only this
/// small future: the request's state machines (the proxy's above all) are several KB, and
/// 10,000 idle connections would otherwise hold tens of MB. The box's cell and the read buffer
/// are the worker's, taken for the request and given back after it ([`SpareBox`], the worker's
/// `read_bufs`), so a busy connection allocates neither. A poll, unlike a read, can be
/// cancelled by the idle timeout without losing bytes.
pub async fn serve(worker: Rc<Worker>, stream: TcpStream, peer: std::net::SocketAddr) {
    let _ = stream.set_nodelay(true);
    serve_client(worker, ClientSocket::new(stream), peer).await;
}

/// The first byte of a TLS connection: a handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Serve one connection accepted on the TLS listener: the handshake on the worker's current
/// certificates within `tls.handshake_timeout_ms`, then requests as on a plain connection. A
/// client that speaks plain HTTP to this port gets a plain-text 400 saying so, and the
/// connection closes; a failed or slow handshake closes it.
pub(crate) async fn serve_tls(worker: Rc<Worker>, stream: TcpStream, peer: std::net::SocketAddr) {
    use std::os::fd::AsRawFd;
    let _ = stream.set_nodelay(true);
    let snapshot = worker.snapshot();
    let Some(tls) = &snapshot.tls else {
        return;
    };
    let deadline = clock::recent() + tls.handshake_timeout;
    match clock::timeout(tls.handshake_timeout, stream.readable(false)).await {
        Ok(Ok(())) => {}
        _ => return,
    }
    let fd = stream.as_raw_fd();
    match crate::sys::sock::peek_byte(fd) {
        Some(TLS_HANDSHAKE_RECORD) => {}
        Some(_) => {
            let mut client = ClientSocket::new(stream);
            let e = GatewayError::bad_http(
                "This port speaks TLS: send the request over HTTPS (or to the plain listener).",
            );
            // The request is unread.
            let mut rbuf = Vec::new();
            answer_unread(
                &worker,
                &mut client,
                &snapshot.timeouts,
                &e,
                ClientDialect::OpenAi,
                &mut rbuf,
            )
            .await;
            return;
        }
        None => return,
    }
    // The session will own the socket; a duplicate descriptor watches it.
    let watch = match crate::sys::sock::duplicate(fd)
        .map(std::net::TcpStream::from)
        .and_then(TcpStream::from_std)
    {
        Ok(watch) => watch,
        Err(_) => return,
    };
    let acceptor = monoio_rustls::TlsAcceptor::from(std::sync::Arc::clone(&tls.server_config));
    let left = deadline.saturating_duration_since(clock::recent());
    let session = match clock::timeout(left, acceptor.accept(stream)).await {
        Ok(Ok(session)) => session,
        _ => return,
    };
    drop(snapshot);
    serve_client(worker, ClientSocket::tls(session, watch), peer).await;
}

/// Serve a connection's requests until it ends (see [`serve`]).
async fn serve_client(worker: Rc<Worker>, mut client: ClientSocket, peer: std::net::SocketAddr) {
    // Dropped before `client`: the slot is freed before the descriptor closes.
    let slot = ClientSlot::new(&worker.clients, client.fd());
    let mut state = ConnState {
        peer: Some(peer),
        ..ConnState::default()
    };
    let mut first_request = true;
    loop {
        if state.rbuf.is_empty() {
            // A drain takes no new request on a kept-alive connection, unless the client
            // already sent one. A connection that has not sent its first request yet is given
            // a moment (below): a client sends right after connecting, and its request may be
            // on its way — closing would fail it (in a takeover, it was accepted just before
            // the hand-over).
            if worker.drain.draining() && !client.has_bytes() && !first_request {
                return;
            }
            // Between requests no generation is held: this wait belongs to the connection, not
            // to a request, so it follows the worker's current snapshot (a swap changes the next
            // wait, never a running request's limits). The request that follows takes its own
            // generation in `serve_request` and keeps it to its end.
            let timeouts = worker.snapshot().timeouts;
            let idle_limit = if first_request {
                timeouts.header_read
            } else {
                timeouts.keepalive_idle
            };
            // The read buffer waits in the worker's pool, not with the connection.
            worker.read_bufs.give(std::mem::take(&mut state.rbuf));
            // Only kept-alive connections are marked: a drain shuts those at once.
            slot.waiting(!first_request);
            let idle_limit = if first_request && worker.drain.draining() {
                idle_limit.min(FIRST_REQUEST_IN_DRAIN)
            } else {
                idle_limit
            };
            let waited = if client.is_tls() {
                // The session may already hold the next request, decrypted, where readiness
                // cannot show it: read (a TLS connection keeps a small buffer while idle).
                matches!(
                    read_more(&mut client, &mut state.rbuf, idle_limit).await,
                    ReadOutcome::Data(_)
                )
            } else if first_request {
                // A drain starting meanwhile cuts the wait to FIRST_REQUEST_IN_DRAIN.
                let wait = clock::timeout(idle_limit, client.readable());
                monoio::select! {
                    waited = wait => matches!(waited, Ok(Ok(()))),
                    () = worker.stop.draining.wait() => {
                        let wait = clock::timeout(FIRST_REQUEST_IN_DRAIN, client.readable());
                        matches!(wait.await, Ok(Ok(())))
                    }
                }
            } else {
                // No timer of its own: the worker's idle sweep shuts the socket down once the
                // limit has passed (see `runtime::server::sweep_idle_connections`), which ends
                // this wait with the end of the stream. A timer here was made and cancelled
                // for every request of a busy connection.
                slot.waiting_until(clock::deadline(idle_limit));
                matches!(client.readable().await, Ok(()))
            };
            slot.waiting(false);
            if !waited {
                return;
            }
            if !client.is_tls() {
                // The bytes are there: take them now rather than with one more trip around
                // the event loop (this is most of a keep-alive request's wake-up latency).
                state.rbuf = worker.read_bufs.take();
                if client.read_ready(&mut state.rbuf) == Some(0) {
                    return;
                }
            }
        }
        first_request = false;
        if !SpareBox::new(serve_request(&worker, &mut client, &mut state)).await {
            return;
        }
    }
}

/// How long a drain lets a connection that has not sent its first request yet wait for it.
const FIRST_REQUEST_IN_DRAIN: Duration = Duration::from_secs(1);

/// A connection's place in its worker's client set, for its life; marked while the connection
/// waits for a request.
struct ClientSlot<'w> {
    clients: &'w std::cell::RefCell<crate::sys::sock::SocketSet>,
    slot: usize,
}

impl<'w> ClientSlot<'w> {
    /// Add `fd`, unmarked: a new connection's first request may be on its way (see
    /// `serve_client`).
    fn new(clients: &'w std::cell::RefCell<crate::sys::sock::SocketSet>, fd: RawFd) -> Self {
        let slot = clients.borrow_mut().insert(fd, false);
        ClientSlot { clients, slot }
    }

    fn waiting(&self, waiting: bool) {
        self.clients.borrow_mut().mark(self.slot, waiting);
    }

    /// Marked as waiting, to be shut down by the worker's idle sweep past `deadline`.
    fn waiting_until(&self, deadline: Mono) {
        self.clients.borrow_mut().mark_until(self.slot, deadline);
    }
}

impl Drop for ClientSlot<'_> {
    fn drop(&mut self) {
        self.clients.borrow_mut().remove(self.slot);
    }
}

/// Read one request (head, then body), dispatch it, and keep what the client already sent of
/// its next one. Returns whether the connection stays open.
async fn serve_request(
    worker: &Rc<Worker>,
    client: &mut ClientSocket,
    state: &mut ConnState,
) -> bool {
    // The generation (config snapshot and what is built from it) this request runs on to its
    // end, whatever the worker swaps in meanwhile: taken once, here, and the source of every
    // limit the request uses (reads, its `PerCore`, the responses written here).
    let generation = worker.current();
    let limits = &generation.snapshot.http;
    let timeouts = &generation.snapshot.timeouts;
    let ConnState {
        peer,
        rbuf,
        head,
        inspection,
        chunked_body,
        key_memo,
    } = state;

    match read_head(client, rbuf, head, limits, timeouts.header_read).await {
        Ok(true) => {}
        Ok(false) => return false,
        Err(e) => {
            let _ = write_error(
                worker,
                client,
                timeouts,
                &e,
                ClientDialect::OpenAi,
                false,
                false,
            )
            .await;
            return false;
        }
    }
    // Counted from its whole head on: a head still trickling in takes no request slot (the
    // header timeout bounds it), so slow heads can't make the request cap shed real requests.
    let _active = worker.load.enter();
    let client_addr = client_address(*peer, head, rbuf, &generation.snapshot.server.real_ip);
    let Some(consumed) = read_body_and_dispatch(
        worker,
        &generation,
        client,
        rbuf,
        head,
        chunked_body,
        inspection,
        client_addr,
        key_memo,
    )
    .await
    else {
        return false;
    };

    // Keep whatever the client already sent of its next request; drop the rest.
    rbuf.drain(..consumed);
    if rbuf.capacity() > KEEP_READ_BUF {
        let mut small = Vec::with_capacity(MIN_READ_BUF.max(rbuf.len()));
        small.extend_from_slice(rbuf);
        *rbuf = small;
    }
    if chunked_body.capacity() > KEEP_READ_BUF {
        *chunked_body = Vec::new();
    }
    true
}

/// Read the body of the request whose head is in `rbuf` when the gateway's front door lets it
/// in, then have the front door answer it. Returns how many bytes of `rbuf` the request took
/// when the connection stays open, `None` when it must close.
#[allow(clippy::too_many_arguments)] // the connection's parts, split so the body can borrow rbuf
async fn read_body_and_dispatch(
    worker: &Rc<Worker>,
    generation: &Generation,
    client: &mut ClientSocket,
    rbuf: &mut Vec<u8>,
    head: &RequestHead,
    chunked_body: &mut Vec<u8>,
    inspection: &mut Inspection,
    peer: Option<std::net::SocketAddr>,
    key_memo: &mut KeyDigestMemo,
) -> Option<usize> {
    let core = worker.per_core(generation);
    let timeouts = &generation.snapshot.timeouts;
    let dialect = ClientDialect::of_path(head.path(rbuf));
    let head_only = Request {
        buf: rbuf,
        received_at: clock::recent(),
        peer,
        head,
        body: &[],
    };
    // Decided from the head, before the body is read — so a refused request never gets to send
    // (or make Sluice hold) its body, and since that body stays unread the connection closes
    // after the answer.
    let (ticket, mut hold) = match front_door::on_head(core, &head_only, key_memo) {
        HeadDecision::ReadBody { ticket, hold } => (ticket, hold),
        HeadDecision::Refuse(e) => {
            answer_unread(worker, client, timeouts, &e, dialect, rbuf).await;
            return None;
        }
        HeadDecision::Answer(local) => {
            let kept = answer_from_head(worker, client, timeouts, local, dialect, head, rbuf).await;
            worker.drain.request_ended();
            return kept.then_some(head.head_len);
        }
    };
    let consumed = match read_body(
        client,
        rbuf,
        head,
        chunked_body,
        &mut hold,
        &generation.snapshot.http,
        timeouts,
    )
    .await
    {
        Ok(consumed) => consumed,
        Err(e) => {
            let head_only = head.method == Method::Head;
            let _ = write_error(worker, client, timeouts, &e, dialect, false, head_only).await;
            return None;
        }
    };
    let body: &[u8] = match head.body {
        BodyFraming::Chunked => chunked_body,
        BodyFraming::Length(n) => &rbuf[head.head_len..head.head_len + n as usize],
        _ => &[],
    };
    let request = Request {
        buf: rbuf,
        received_at: clock::recent(),
        peer,
        head,
        body,
    };
    let local = match ticket {
        Ticket::Proxy(authenticated) => {
            match pipeline::proxy(core, client, &request, inspection, authenticated).await {
                Ok(keep_alive) => Ok(keep_alive && head.keep_alive),
                Err(e) => Err(Local::Error(e)),
            }
        }
        Ticket::CountTokens(authenticated) => Err(front_door::answer_count_tokens(
            core,
            &request,
            authenticated,
        )),
    };
    let keep_alive = match local {
        Ok(keep_alive) => keep_alive,
        Err(local) => {
            write_local(
                worker,
                client,
                timeouts,
                local,
                dialect,
                head,
                head.keep_alive,
            )
            .await
        }
    };
    worker.drain.request_ended();
    keep_alive.then_some(consumed)
}

/// Write an answer the front door gave from the head alone. A request that declared no body is
/// done with; one that declared a body leaves it unread, so the connection closes after the
/// answer (a lingering close). Returns whether the connection stays open.
async fn answer_from_head(
    worker: &Worker,
    client: &mut ClientSocket,
    timeouts: &Timeouts,
    local: Local<'_>,
    dialect: ClientDialect,
    head: &RequestHead,
    rbuf: &mut Vec<u8>,
) -> bool {
    let no_body = matches!(head.body, BodyFraming::None | BodyFraming::Length(0));
    let keep_alive = head.keep_alive && no_body;
    let kept = write_local(worker, client, timeouts, local, dialect, head, keep_alive).await;
    if !no_body {
        linger_close(client, rbuf, timeouts.body_read).await;
    }
    kept
}

/// Write an answer the gateway gave itself. Returns whether the connection may be kept.
async fn write_local(
    worker: &Worker,
    client: &mut ClientSocket,
    timeouts: &Timeouts,
    local: Local<'_>,
    dialect: ClientDialect,
    head: &RequestHead,
    keep_alive: bool,
) -> bool {
    let head_only = head.method == Method::Head;
    match local {
        Local::Json(status, body) => {
            let kept = write_json(
                worker, client, timeouts, status, &body, keep_alive, head_only,
            )
            .await;
            if let Cow::Owned(body) = body {
                worker.bufs.give(body);
            }
            kept
        }
        Local::Error(e) => {
            write_error(worker, client, timeouts, &e, dialect, keep_alive, head_only).await
        }
    }
}

/// Write an error response, within `timeouts.stream_idle` (the request's own timeouts, or the
/// current snapshot's outside a request). Returns whether the connection may be kept (never
/// while draining).
pub(crate) async fn write_error(
    worker: &Worker,
    client: &mut ClientSocket,
    timeouts: &Timeouts,
    error: &GatewayError,
    dialect: ClientDialect,
    keep_alive: bool,
    head_only: bool,
) -> bool {
    let keep_alive = keep_alive && !worker.drain.draining();
    let mut out = worker.bufs.take();
    error.write_response(&mut out, keep_alive, head_only, dialect);
    send_own(worker, client, timeouts, out).await && error.keeps_connection(keep_alive)
}

/// Write a response Sluice built itself into a pool buffer, and give the buffer back.
/// Returns whether the write went through.
async fn send_own(
    worker: &Worker,
    client: &mut ClientSocket,
    timeouts: &Timeouts,
    out: Vec<u8>,
) -> bool {
    let (res, out) = client
        .write_all(out, timeouts.stream_idle, worker.load.direct_writes())
        .await;
    worker.bufs.give(out);
    res.is_ok()
}

/// Write a JSON response, within the request's `timeouts.stream_idle`. Returns whether the
/// connection may be kept (never while draining).
async fn write_json(
    worker: &Worker,
    client: &mut ClientSocket,
    timeouts: &Timeouts,
    status: u16,
    body: &[u8],
    keep_alive: bool,
    head_only: bool,
) -> bool {
    let keep_alive = keep_alive && !worker.drain.draining();
    let mut out = worker.bufs.take();
    let _ = crate::http::write_head_start(
        &mut crate::http::VecText(&mut out),
        status,
        "application/json",
        body.len(),
    );
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !head_only {
        out.extend_from_slice(body);
    }
    send_own(worker, client, timeouts, out).await && keep_alive
}

/// Read until a complete head is in `rbuf`; the client has already sent something (or closed).
/// `Ok(false)`: it closed before sending a byte (close quietly). The whole head must arrive
/// within `header_limit`.
async fn read_head(
    client: &mut ClientSocket,
    rbuf: &mut Vec<u8>,
    head: &mut RequestHead,
    limits: &crate::config::HttpLimits,
    header_limit: Duration,
) -> Result<bool, GatewayError> {
    let mut scan = HeadScan::default();
    // Read afresh: each request's times start here, even one that came pipelined behind another
    // within the same wake-up (for the first request of a wake-up this is its one reading).
    let deadline = clock::now() + header_limit;
    loop {
        // Tolerate empty lines before a request line (RFC 9112 §2.2), e.g. after a body.
        while rbuf.starts_with(b"\r\n") {
            rbuf.drain(..2);
        }
        if !rbuf.is_empty()
            && parse_request_head(rbuf, &mut scan, limits, head)? == HeadStatus::Complete
        {
            return Ok(true);
        }
        let had_bytes = !rbuf.is_empty();
        let limit = deadline.saturating_duration_since(clock::recent());
        match read_more(client, rbuf, limit).await {
            ReadOutcome::Data(_) => {}
            ReadOutcome::Closed | ReadOutcome::Failed(_) if !had_bytes => return Ok(false),
            ReadOutcome::Closed | ReadOutcome::Failed(_) => {
                return Err(GatewayError::bad_http(
                    "connection closed inside a request head",
                ))
            }
            ReadOutcome::TimedOut => {
                return Err(GatewayError::timeout_client(
                    "timed out reading the request head",
                ))
            }
        }
    }
}

/// Read the body framed by `head`, each read within `timeouts.body_read` and the whole body
/// within `timeouts.body_total`, holding its bytes in `hold`. Returns how many bytes of `rbuf`
/// the request took (head included). A Content-Length body stays in `rbuf` (and was held
/// whole before this); a chunked one is decoded into `chunked`, held as it grows.
async fn read_body(
    client: &mut ClientSocket,
    rbuf: &mut Vec<u8>,
    head: &RequestHead,
    chunked: &mut Vec<u8>,
    hold: &mut crate::gateway::context::BodyHold<'_>,
    limits: &crate::config::HttpLimits,
    timeouts: &Timeouts,
) -> Result<usize, GatewayError> {
    let max_body = limits.max_body_bytes;
    let body_limit = timeouts.body_read;
    let deadline = clock::recent() + timeouts.body_total;
    let start = head.head_len;
    if head.expect_continue && rbuf.len() == start && head.body != BodyFraming::None {
        let (res, _) = client
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec(), body_limit, false)
            .await;
        if res.is_err() {
            return Err(GatewayError::bad_http("client went away"));
        }
    }
    match head.body {
        BodyFraming::None | BodyFraming::UntilClose => Ok(start),
        BodyFraming::Length(n) => {
            let end = start + n as usize;
            while rbuf.len() < end {
                let want = end - rbuf.len();
                rbuf.reserve(want);
                read_body_bytes(client, rbuf, body_limit, deadline).await?;
            }
            Ok(end)
        }
        BodyFraming::Chunked => {
            chunked.clear();
            let mut decoder = ChunkedDecoder::default();
            let mut pos = start;
            loop {
                if pos < rbuf.len() {
                    let mut over = false;
                    let mut no_memory = false;
                    let used = decoder
                        .decode(&rbuf[pos..], |data| {
                            let len = chunked.len() + data.len();
                            if len > max_body {
                                over = true;
                            } else if !hold.grow_to(len) {
                                no_memory = true;
                            } else {
                                chunked.extend_from_slice(data);
                            }
                        })
                        .map_err(|e| {
                            GatewayError::bad_http(format!("malformed chunked body: {}", e.0))
                        })?;
                    if over {
                        return Err(GatewayError::new(
                            ErrorKind::BodyTooLarge,
                            "request body too large",
                        ));
                    }
                    if no_memory {
                        return Err(GatewayError::body_memory_full());
                    }
                    pos += used;
                    if decoder.is_done() {
                        return Ok(pos);
                    }
                }
                // Decoded bytes are copied out, so the raw chunked bytes need not be kept.
                rbuf.truncate(start);
                pos = start;
                read_body_bytes(client, rbuf, body_limit, deadline).await?;
            }
        }
    }
}

/// One read of body bytes, within `limit` and before `deadline` (the whole body's).
async fn read_body_bytes(
    client: &mut ClientSocket,
    rbuf: &mut Vec<u8>,
    limit: Duration,
    deadline: Mono,
) -> Result<(), GatewayError> {
    let left = deadline.saturating_duration_since(clock::recent());
    let whole_body_first = left < limit;
    match read_more(client, rbuf, limit.min(left)).await {
        ReadOutcome::Data(_) => Ok(()),
        ReadOutcome::TimedOut if whole_body_first => Err(GatewayError::timeout_client(
            "the request body did not arrive in time (timeouts.body_total_ms)",
        )),
        ReadOutcome::TimedOut => Err(GatewayError::timeout_client(
            "timed out reading the request body",
        )),
        ReadOutcome::Closed | ReadOutcome::Failed(_) => Err(GatewayError::bad_http(
            "connection closed inside a request body",
        )),
    }
}

/// Append one read's worth of bytes to `rbuf`: with room for at least 1 KB, doubling the
/// buffer when it is short.
async fn read_more(client: &mut ClientSocket, rbuf: &mut Vec<u8>, limit: Duration) -> ReadOutcome {
    let grow = rbuf.capacity().max(MIN_READ_BUF);
    // On a timeout the buffer goes with the cancelled read; the connection is closing anyway.
    stream::read_spare(rbuf, 1024, grow, usize::MAX, limit, |b| client.read(b)).await
}

/// Answer `error` to a request whose rest (a body, or the whole request) stays unread, and
/// close the connection with a lingering close (`rbuf` is scratch for what is drained).
async fn answer_unread(
    worker: &Worker,
    client: &mut ClientSocket,
    timeouts: &Timeouts,
    error: &GatewayError,
    dialect: ClientDialect,
    rbuf: &mut Vec<u8>,
) {
    let _ = write_error(worker, client, timeouts, error, dialect, false, false).await;
    linger_close(client, rbuf, timeouts.body_read).await;
}

/// Close after an answer while the client may still be sending (a body Sluice did not read):
/// stop writing, then read and drop what arrives for a moment, so the close does not turn into a
/// reset that could destroy the answer before the client reads it (what nginx calls a lingering
/// close). Bounded in bytes and time.
async fn linger_close(client: &mut ClientSocket, rbuf: &mut Vec<u8>, limit: Duration) {
    const LINGER_BYTES: usize = 256 * 1024;
    let limit = limit.min(Duration::from_secs(2));
    client.shutdown_write();
    let deadline = clock::recent() + limit;
    let mut drained = 0;
    while drained < LINGER_BYTES {
        rbuf.clear();
        let left = deadline.saturating_duration_since(clock::recent());
        match read_more(client, rbuf, left).await {
            ReadOutcome::Data(n) => drained += n,
            _ => return,
        }
    }
}

/// Answer a connection over the worker's cap with 503 and close it.
pub(crate) async fn refuse_overloaded(worker: Rc<Worker>, stream: TcpStream) {
    let mut client = ClientSocket::new(stream);
    let e = GatewayError::overloaded("too many connections; retry shortly");
    // No request runs here: the answer is written on the current snapshot's limits.
    let timeouts = worker.snapshot().timeouts;
    let _ = write_error(
        &worker,
        &mut client,
        &timeouts,
        &e,
        ClientDialect::OpenAi,
        false,
        false,
    )
    .await;
}
