//! The admin listener: `GET /metrics`, `GET /healthz`, `GET /readyz` and `POST /admin/reload`
//! on their own port.
//!
//! Runs beside the workers, never on them, on plain std threads, so that no number of idle or
//! slow sockets keeps a liveness probe from its answer:
//!
//! - **One admission thread** (`sluice-admin`) accepts every connection and reads its request
//!   head, with non-blocking sockets and one `poll(2)` over them all. At most [`MAX_WAITING`]
//!   connections wait there at once; when one more arrives, the oldest waiting is closed to make
//!   room, so a probe's fresh connection is never the one turned away. A connection that has
//!   sent nothing [`IDLE_DEADLINE`] after accept is closed without an answer; one whose head has
//!   started has until [`HEAD_DEADLINE`] after accept for the whole head, then gets 408. A head
//!   is read into a buffer of its own, allocated at its first byte and bounded by
//!   [`MAX_HEAD_BYTES`] (431 past it), so an idle socket costs a descriptor and a few dozen bytes.
//! - Once a head is whole, `/healthz`, `/readyz` and every refusal (400, 404, 405, 408, 431) are
//!   answered right there, in one non-blocking write of a few hundred bytes: a fresh socket that
//!   cannot take that at once belongs to a client that is not reading, and is closed instead.
//!   The socket is then shut for writing and drained for up to [`LINGER`] (still on the
//!   admission thread, still counted in [`MAX_WAITING`]), so bytes the client still sends (a
//!   body, a pipelined request) do not turn the close into a reset that discards the answer.
//! - `GET /metrics` (rendering and writing every family) and `POST /admin/reload` (which waits
//!   up to [`RELOAD_DEADLINE`] for the reload) go to a thread of their own, at most
//!   [`MAX_SERVING`] at once; past that the request is answered 503 and closed. Those threads'
//!   writes block for at most [`WRITE_TIMEOUT`] each.
//!
//! Takes the [`MetricsHub`] to render and the readiness flag the server sets once every worker
//! listens. Speaks a minimal HTTP/1.1: one request per connection (`Connection: close`).
//!
//! | request | answer |
//! | --- | --- |
//! | `GET /metrics` | 200, `text/plain; version=0.0.4`, every family summed over workers |
//! | `GET /healthz` | 200 `ok` while the process runs |
//! | `GET /readyz` | 200 `ready` once the flag is true, else 503 `not ready` |
//! | `POST /admin/reload` | reload the config file: 200 and a JSON report when the new config is serving, 422 and its errors when it is invalid (the old one keeps serving); 401 without the bearer token `admin.token_env` names, 403 when none is configured |
//! | `HEAD` of the `GET`s | the same head, no body |
//! | another path | 404; another method: 405 with `Allow`; a bad head: 400 |

// The admin listener runs on plain threads of its own, never on a worker: the admission thread
// backs off with a sleep when accept fails, and serving threads block on their sockets.
#![allow(clippy::disallowed_methods)]

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use crate::telemetry::metrics::MetricsHub;

/// Most connections the admission thread holds at once (waiting for their head, or draining
/// after their answer); one more closes the oldest. Each costs a descriptor, an entry of a few
/// dozen bytes and, once it has sent something, a head buffer of at most [`MAX_HEAD_BYTES`]
/// (8 MiB all told); a `poll` round over all of them takes microseconds. That is far more
/// than the probes and scrapes that ever arrive together, and far below the open-file limit
/// Sluice raises at start, so a flood is held to a small, fixed cost.
pub(crate) const MAX_WAITING: usize = 1024;
/// The listener's accept queue, as deep as [`MAX_WAITING`]: a burst of connects while the
/// admission thread is off the CPU waits there instead of having SYNs dropped (a dropped SYN
/// costs a probe a one-second retransmit).
const BACKLOG: i32 = 1024;
/// Time a connection may stay silent after accept before it is closed, without an answer.
/// Probes and scrapers send their head at once; only a socket held open for nothing waits.
pub(crate) const IDLE_DEADLINE: Duration = Duration::from_secs(2);
/// Most `/metrics` and `/admin/reload` requests served at once, each on a thread (503 past it).
pub(crate) const MAX_SERVING: usize = 16;
/// Largest request head accepted (431 past it).
pub(crate) const MAX_HEAD_BYTES: usize = 8192;
/// Time allowed from accept until the whole request head has arrived, once it has started
/// (408 past it).
pub(crate) const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// Longest a single write to the client may block on a serving thread.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answered connection is drained of what its client still sends before closing.
pub(crate) const LINGER: Duration = Duration::from_millis(200);
/// Most bytes drained from an answered connection before closing it anyway.
const LINGER_BYTES: usize = 64 * 1024;

const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// How long `POST /admin/reload` waits for the reload's outcome.
pub(crate) const RELOAD_DEADLINE: Duration = Duration::from_secs(30);

/// The outcome of a reload, as the control thread reports it: the status and JSON body to
/// answer with.
pub(crate) struct ReloadReply {
    pub(crate) status: u16,
    pub(crate) body: String,
}

/// Asks the control thread for a reload; the outcome comes back on the sender it is given.
pub(crate) type ReloadHook = Box<dyn Fn(mpsc::Sender<ReloadReply>) + Send + Sync>;

/// What `POST /admin/reload` needs: the hook, and the SHA-256 of the bearer token callers must
/// present (`None`: no token configured, so reloading over HTTP is refused).
pub(crate) struct AdminControl {
    pub(crate) reload: ReloadHook,
    pub(crate) token_digest: Option<[u8; 32]>,
}

/// Bind `addr` (port 0 picks a free port) and serve the admin endpoints on a background thread
/// for the life of the process. Returns the bound address; a bind failure is returned, never
/// logged and ignored. The socket is bound with SO_REUSEPORT so that a successor taking this
/// process over can bind the same port while this one drains; with `shared` false (no
/// takeover) a port another socket holds is refused first, as the main listener's is.
pub(crate) fn spawn_admin(
    addr: SocketAddr,
    hub: Arc<MetricsHub>,
    ready: Arc<AtomicBool>,
    control: Option<AdminControl>,
    shared: bool,
) -> io::Result<SocketAddr> {
    let cannot =
        |e: io::Error| io::Error::new(e.kind(), format!("cannot bind admin listener {addr}: {e}"));
    let addr = if shared {
        addr
    } else {
        // A plain bind fails on any port already bound, SO_REUSEPORT or not.
        TcpListener::bind(addr)
            .and_then(|probe| probe.local_addr())
            .map_err(cannot)?
    };
    let listener = crate::sys::sock::reuseport_listener(addr, BACKLOG).map_err(cannot)?;
    let local = listener.local_addr()?;
    let shared = Shared {
        hub,
        ready,
        control,
    };
    serve_admin(listener, shared, BOUNDS)?;
    Ok(local)
}

/// What every admin connection reads.
struct Shared {
    hub: Arc<MetricsHub>,
    ready: Arc<AtomicBool>,
    control: Option<AdminControl>,
}

/// The admission thread's bounds: [`BOUNDS`] in the process, smaller in tests.
#[derive(Clone, Copy)]
struct Bounds {
    waiting: usize,
    idle: Duration,
    head: Duration,
}

const BOUNDS: Bounds = Bounds {
    waiting: MAX_WAITING,
    idle: IDLE_DEADLINE,
    head: HEAD_DEADLINE,
};

/// Serve `listener` on a new admission thread.
fn serve_admin(listener: TcpListener, shared: Shared, bounds: Bounds) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let admission = Admission {
        listener,
        shared: Arc::new(shared),
        bounds,
        waiting: VecDeque::new(),
        spare: VecDeque::new(),
        fds: Vec::new(),
        scratch: vec![0; MAX_HEAD_BYTES].into_boxed_slice(),
        serving: Arc::new(AtomicUsize::new(0)),
    };
    thread::Builder::new()
        .name("sluice-admin".into())
        .spawn(move || admission.run())?;
    Ok(())
}

/// One connection on the admission thread.
struct Waiting {
    stream: TcpStream,
    accepted: Instant,
    phase: Phase,
}

enum Phase {
    /// Reading the head; empty, with nothing allocated, until the first byte.
    Head(Vec<u8>),
    /// Answered and shut for writing: what the client still sends is read and dropped until it
    /// closes, `until` passes or [`LINGER_BYTES`] have come.
    Linger { until: Instant, drained: usize },
}

impl Waiting {
    fn deadline(&self, bounds: &Bounds) -> Instant {
        match &self.phase {
            Phase::Head(head) if head.is_empty() => self.accepted + bounds.idle,
            Phase::Head(_) => self.accepted + bounds.head,
            Phase::Linger { until, .. } => *until,
        }
    }
}

/// The admission thread: the listener and every connection not yet answered or handed on.
struct Admission {
    listener: TcpListener,
    shared: Arc<Shared>,
    bounds: Bounds,
    /// Oldest first.
    waiting: VecDeque<Waiting>,
    /// `waiting`'s other half during a round, kept for its allocation.
    spare: VecDeque<Waiting>,
    /// The listener, then each of `waiting` in order, as the last `poll` saw them.
    fds: Vec<libc::pollfd>,
    /// Where every read lands first: a head is copied on into its own buffer.
    scratch: Box<[u8]>,
    /// Requests on serving threads now.
    serving: Arc<AtomicUsize>,
}

/// What a finished head asks of the admission thread.
enum Plan {
    /// Answer these bytes now.
    Answer(Vec<u8>),
    /// Serve it on a thread.
    Serve(Job),
}

/// The requests that are served on a thread.
enum Job {
    Metrics { head_only: bool },
    Reload { authorization: Option<String> },
}

impl Admission {
    fn run(mut self) {
        loop {
            self.wait();
            let now = Instant::now();
            self.step_all(now);
            if self.fds.first().is_some_and(|l| l.revents != 0) {
                self.accept_all(now);
            }
        }
    }

    /// Block until the listener or a waiting connection is ready, or the nearest deadline.
    fn wait(&mut self) {
        self.fds.clear();
        self.fds.push(pollfd(self.listener.as_raw_fd()));
        let mut next: Option<Instant> = None;
        for w in &self.waiting {
            self.fds.push(pollfd(w.stream.as_raw_fd()));
            let deadline = w.deadline(&self.bounds);
            next = Some(next.map_or(deadline, |n| n.min(deadline)));
        }
        let timeout = next.map_or(-1, |at| {
            let left = at.saturating_duration_since(Instant::now());
            // Rounded up, so the round after the wake-up finds the deadline passed.
            i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        });
        let count = libc::nfds_t::try_from(self.fds.len()).unwrap_or(libc::nfds_t::MAX);
        // SAFETY: `fds` is a live, initialised array of `count` pollfds that poll may write the
        // `revents` of; nothing else touches it during the call.
        let n = unsafe { libc::poll(self.fds.as_mut_ptr(), count, timeout) };
        if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // Out of memory in the kernel: back off instead of spinning.
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Read what the last poll found ready, and act on deadlines passed.
    fn step_all(&mut self, now: Instant) {
        let mut waiting = std::mem::take(&mut self.waiting);
        let mut kept = std::mem::take(&mut self.spare);
        for (i, w) in waiting.drain(..).enumerate() {
            let ready = self.fds.get(i + 1).is_some_and(|p| p.revents != 0);
            if let Some(w) = self.step(w, ready, now) {
                kept.push_back(w);
            }
        }
        self.waiting = kept;
        self.spare = waiting;
    }

    /// One connection's turn: `Some` keeps it waiting; `None` closes it (dropping the socket)
    /// or has handed it to a serving thread.
    fn step(&mut self, mut w: Waiting, ready: bool, now: Instant) -> Option<Waiting> {
        if ready {
            w = match w.phase {
                Phase::Head(_) => self.read_head(w, now)?,
                Phase::Linger { .. } => self.drain(w)?,
            };
        }
        if now < w.deadline(&self.bounds) {
            return Some(w);
        }
        match &w.phase {
            // Nothing was asked: nothing is answered.
            Phase::Head(head) if head.is_empty() => None,
            Phase::Head(_) => answer_now(w, &refusal(408), now),
            Phase::Linger { .. } => None,
        }
    }

    /// Read more of `w`'s head and act on it once it is whole (or wrong).
    fn read_head(&mut self, mut w: Waiting, now: Instant) -> Option<Waiting> {
        let Phase::Head(head) = &mut w.phase else {
            return Some(w);
        };
        let room = MAX_HEAD_BYTES.saturating_sub(head.len());
        let into = self.scratch.get_mut(..room)?;
        let n = match w.stream.read(into) {
            Ok(0) => return None, // closed before a whole head
            Ok(n) => n,
            Err(e) if would_block(&e) => return Some(w),
            Err(_) => return None,
        };
        head.extend_from_slice(self.scratch.get(..n)?);
        match parse_head(head) {
            Ok(None) if head.len() < MAX_HEAD_BYTES => Some(w),
            Ok(None) => answer_now(w, &refusal(431), now),
            Ok(Some(request)) => match plan(request, &self.shared) {
                Plan::Answer(bytes) => answer_now(w, &bytes, now),
                Plan::Serve(job) => self.hand_on(w, job, now),
            },
            Err(status) => answer_now(w, &refusal(status), now),
        }
    }

    /// Read and drop what an answered client still sends.
    fn drain(&mut self, mut w: Waiting) -> Option<Waiting> {
        let Phase::Linger { drained, .. } = &mut w.phase else {
            return Some(w);
        };
        match w.stream.read(&mut self.scratch) {
            Ok(0) => None,
            Ok(n) => {
                *drained += n;
                (*drained < LINGER_BYTES).then_some(w)
            }
            Err(e) if would_block(&e) => Some(w),
            Err(_) => None,
        }
    }

    /// Serve `job` on a thread of its own, or answer 503 when [`MAX_SERVING`] are busy.
    fn hand_on(&mut self, w: Waiting, job: Job, now: Instant) -> Option<Waiting> {
        if self.serving.fetch_add(1, Ordering::AcqRel) >= MAX_SERVING {
            self.serving.fetch_sub(1, Ordering::AcqRel);
            let busy = answer(503, TEXT, "", b"too many admin connections\n", false);
            return answer_now(w, &busy, now);
        }
        let place = Place(Arc::clone(&self.serving));
        let shared = Arc::clone(&self.shared);
        let stream = w.stream;
        let spawned = thread::Builder::new()
            .name("sluice-admin-conn".into())
            .spawn(move || {
                let _place = place;
                serve(stream, job, &shared);
            });
        if let Err(e) = spawned {
            eprintln!("sluice: admin connection thread failed to start: {e}");
        }
        None
    }

    /// Take every connection the listener holds (at most a bound's worth a round, so a flood
    /// does not starve the waiting), closing the oldest waiting to make room.
    fn accept_all(&mut self, now: Instant) {
        for _ in 0..self.bounds.waiting {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if would_block(&e) => return,
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    // Out of descriptors or memory: back off instead of spinning.
                    eprintln!("sluice: admin accept failed: {e}");
                    thread::sleep(Duration::from_millis(50));
                    return;
                }
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            if self.waiting.len() >= self.bounds.waiting {
                self.waiting.pop_front();
            }
            self.waiting.push_back(Waiting {
                stream,
                accepted: now,
                phase: Phase::Head(Vec::new()),
            });
        }
    }
}

fn pollfd(fd: i32) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Write `bytes` to `w` at once and linger; a socket that cannot take them all now is closed.
fn answer_now(mut w: Waiting, bytes: &[u8], now: Instant) -> Option<Waiting> {
    let sent = crate::sys::sock::send_now(w.stream.as_raw_fd(), bytes).ok()?;
    if sent < bytes.len() {
        return None;
    }
    w.stream.shutdown(Shutdown::Write).ok()?;
    w.phase = Phase::Linger {
        until: now + LINGER,
        drained: 0,
    };
    Some(w)
}

/// Releases a serving thread's place when it ends (or fails to start).
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A whole request head.
struct Request {
    method: Method,
    path: String,
    /// The `Authorization` header's value, when there is one.
    authorization: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    Get,
    Head,
    Post,
    Other,
}

/// Parse what has come of a head. `Ok(None)`: not whole yet. `Err(status)`: answer that status
/// (400 a bad head, 431 too many headers).
fn parse_head(buf: &[u8]) -> Result<Option<Request>, u16> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(431),
        Err(_) => return Err(400),
    }
    let method = match req.method {
        Some("GET") => Method::Get,
        Some("HEAD") => Method::Head,
        Some("POST") => Method::Post,
        _ => Method::Other,
    };
    let authorization = req
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("authorization"))
        .and_then(|h| std::str::from_utf8(h.value).ok())
        .map(str::to_string);
    let target = req.path.ok_or(400_u16)?;
    let path = target.split(['?', '#']).next().unwrap_or("");
    Ok(Some(Request {
        method,
        path: path.to_string(),
        authorization,
    }))
}

/// What to do with a whole request: answer it now, or serve it on a thread.
fn plan(request: Request, shared: &Shared) -> Plan {
    let Request {
        method,
        path,
        authorization,
    } = request;
    let head_only = method == Method::Head;
    if path == "/admin/reload" {
        return match method {
            Method::Post => Plan::Serve(Job::Reload { authorization }),
            _ => Plan::Answer(answer_405("POST")),
        };
    }
    if !matches!(path.as_str(), "/metrics" | "/healthz" | "/readyz") {
        return Plan::Answer(answer(404, TEXT, "", b"not found\n", head_only));
    }
    if !matches!(method, Method::Get | Method::Head) {
        return Plan::Answer(answer_405("GET, HEAD"));
    }
    Plan::Answer(match path.as_str() {
        "/metrics" => return Plan::Serve(Job::Metrics { head_only }),
        "/healthz" => answer(200, TEXT, "", b"ok", head_only),
        _ if shared.ready.load(Ordering::Acquire) => answer(200, TEXT, "", b"ready", head_only),
        _ => answer(503, TEXT, "", b"not ready", head_only),
    })
}

/// A serving thread: answer `job` on the (now blocking) socket. Errors just close it.
fn serve(mut stream: TcpStream, job: Job, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    if stream.set_nonblocking(false).is_err()
        || stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err()
    {
        return;
    }
    let result = match job {
        Job::Metrics { head_only } => {
            let mut body = String::with_capacity(64 * 1024);
            shared.hub.render(&mut body);
            respond(
                &mut stream,
                200,
                METRICS_CONTENT_TYPE,
                body.as_bytes(),
                head_only,
            )
        }
        Job::Reload { authorization } => reload(
            &mut stream,
            shared.control.as_ref(),
            authorization.as_deref(),
        ),
    };
    if result.is_ok() {
        linger_close(stream);
    }
}

/// A refusal's answer: `status` and its reason as the body.
fn refusal(status: u16) -> Vec<u8> {
    let body = format!("{}\n", crate::http::reason(status).to_ascii_lowercase());
    answer(status, TEXT, "", body.as_bytes(), false)
}

fn answer_405(allow: &str) -> Vec<u8> {
    answer(
        405,
        TEXT,
        &format!("Allow: {allow}\r\n"),
        b"method not allowed\n",
        false,
    )
}

fn respond(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    body: &[u8],
    head_only: bool,
) -> io::Result<()> {
    respond_with(stream, status, content_type, "", body, head_only)
}

const JSON: &str = "application/json";

/// `POST /admin/reload`: check the bearer token, ask the control thread, answer its report.
fn reload(
    stream: &mut TcpStream,
    control: Option<&AdminControl>,
    authorization: Option<&str>,
) -> io::Result<()> {
    let Some(control) = control else {
        return respond(stream, 404, TEXT, b"not found\n", false);
    };
    let Some(expected) = control.token_digest else {
        let body = br#"{"error":"reloading over HTTP is off: set admin.token_env to the environment variable holding its bearer token"}"#;
        return respond(stream, 403, JSON, body, false);
    };
    let presented = authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| crate::config::limits::digest(t.trim().as_bytes()));
    // Digests of equal length, compared in constant time.
    let authorized =
        presented.is_some_and(|p| crate::config::limits::constant_time_eq(&p, &expected));
    if !authorized {
        return respond_with(
            stream,
            401,
            JSON,
            "www-authenticate: Bearer\r\n",
            br#"{"error":"a valid admin bearer token is required"}"#,
            false,
        );
    }
    let (tx, rx) = mpsc::channel();
    (control.reload)(tx);
    match rx.recv_timeout(RELOAD_DEADLINE) {
        Ok(reply) => respond(stream, reply.status, JSON, reply.body.as_bytes(), false),
        Err(_) => respond(
            stream,
            503,
            JSON,
            br#"{"error":"the reload did not finish in time; see the log"}"#,
            false,
        ),
    }
}

fn respond_with(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    extra_headers: &str,
    body: &[u8],
    head_only: bool,
) -> io::Result<()> {
    stream.write_all(&answer(
        status,
        content_type,
        extra_headers,
        body,
        head_only,
    ))?;
    stream.flush()
}

/// A whole answer: the head (`extra_headers` are whole lines) and, unless `head_only`, the body.
fn answer(
    status: u16,
    content_type: &str,
    extra_headers: &str,
    body: &[u8],
    head_only: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + if head_only { 0 } else { body.len() });
    let _ = crate::http::write_head_start(
        &mut crate::http::VecText(&mut out),
        status,
        content_type,
        body.len(),
    );
    out.extend_from_slice(b"cache-control: no-store\r\n");
    out.extend_from_slice(extra_headers.as_bytes());
    out.extend_from_slice(b"connection: close\r\n\r\n");
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// Close without resetting: send FIN, then drain briefly so unread bytes from the client (a
/// pipelined request, a body) do not turn the close into an RST that could discard the answer.
fn linger_close(mut stream: TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(LINGER));
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < LINGER_BYTES {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::telemetry::metrics::tests::parse_strict;
    use crate::telemetry::metrics::{LabelLists, MetricsShard, StatusClass};

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    fn exchange(addr: SocketAddr, raw: &[u8]) -> Reply {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(raw).unwrap();
        read_reply(s)
    }

    /// Read to the close and parse the answer.
    fn read_reply(mut s: TcpStream) -> Reply {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut bytes = Vec::new();
        s.read_to_end(&mut bytes).unwrap();
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(n) = resp.parse(&bytes).unwrap() else {
            panic!("partial response: {:?}", String::from_utf8_lossy(&bytes));
        };
        Reply {
            status: resp.code.unwrap(),
            headers: resp
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_string(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect(),
            body: bytes[n..].to_vec(),
        }
    }

    fn get(addr: SocketAddr, path: &str) -> Reply {
        exchange(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n").as_bytes(),
        )
    }

    fn start() -> (SocketAddr, Arc<MetricsHub>, Arc<AtomicBool>) {
        let models = vec!["gpt-4o".to_string()];
        let routes = vec!["chat_completions".to_string()];
        let hub = MetricsHub::new(LabelLists {
            routes: &routes,
            models: &models,
            ..LabelLists::default()
        });
        let ready = Arc::new(AtomicBool::new(false));
        let addr = spawn_admin(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&hub),
            Arc::clone(&ready),
            None,
            false,
        )
        .unwrap();
        (addr, hub, ready)
    }

    #[test]
    fn serves_metrics_healthz_and_readyz() {
        let (addr, hub, ready) = start();
        assert_ne!(addr.port(), 0, "the bound port is returned");

        let shard = MetricsShard::new(&hub);
        let n = hub.names();
        shard.request_done(
            n.route("chat_completions"),
            n.model("gpt-4o"),
            n.entity("anyone"),
            StatusClass::Success,
        );
        shard.publish(&hub);

        let m = get(addr, "/metrics");
        assert_eq!(m.status, 200);
        assert_eq!(
            m.header("content-type"),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        assert_eq!(m.header("connection"), Some("close"));
        assert_eq!(
            m.header("content-length")
                .unwrap()
                .parse::<usize>()
                .unwrap(),
            m.body.len()
        );
        let text = String::from_utf8(m.body).unwrap();
        let e = parse_strict(&text).unwrap_or_else(|err| panic!("{err}\n{text}"));
        assert_eq!(
            e.get(
                "sluice_requests_total",
                &[
                    ("route", "chat_completions"),
                    ("model", "gpt-4o"),
                    ("entity", "other"),
                    ("status_class", "2xx")
                ]
            ),
            Some(1.0)
        );

        let h = get(addr, "/healthz");
        assert_eq!((h.status, h.body.as_slice()), (200, &b"ok"[..]));

        let r = get(addr, "/readyz");
        assert_eq!((r.status, r.body.as_slice()), (503, &b"not ready"[..]));
        ready.store(true, Ordering::Release);
        let r = get(addr, "/readyz");
        assert_eq!((r.status, r.body.as_slice()), (200, &b"ready"[..]));
        // Liveness does not depend on readiness.
        ready.store(false, Ordering::Release);
        assert_eq!(get(addr, "/healthz").status, 200);
        assert_eq!(get(addr, "/readyz").status, 503);
    }

    #[test]
    fn head_query_strings_and_errors() {
        let (addr, _hub, _ready) = start();
        let h = exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n");
        assert_eq!(h.status, 200);
        assert!(h.body.is_empty());
        assert!(
            h.header("content-length")
                .unwrap()
                .parse::<usize>()
                .unwrap()
                > 0
        );

        assert_eq!(get(addr, "/metrics?name[]=x").status, 200);
        assert_eq!(get(addr, "/healthz?probe=1").status, 200);

        let nf = get(addr, "/nope");
        assert_eq!(nf.status, 404);
        let post = exchange(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc",
        );
        assert_eq!(post.status, 405);
        assert_eq!(post.header("allow"), Some("GET, HEAD"));
        assert_eq!(exchange(addr, b"\x01\x02garbage\r\n\r\n").status, 400);
        let huge = format!(
            "GET /metrics HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(exchange(addr, huge.as_bytes()).status, 431);
    }

    #[test]
    fn a_silent_client_does_not_block_probes() {
        let (addr, _hub, _ready) = start();
        let _idle: Vec<TcpStream> = (0..3)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /heal").unwrap();
                s
            })
            .collect();
        let t = Instant::now();
        assert_eq!(get(addr, "/healthz").status, 200);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn bind_failure_is_returned() {
        let (addr, hub, ready) = start();
        let again = spawn_admin(addr, hub, ready, None, false);
        let Err(e) = again else {
            panic!("a second bind of {addr} should fail");
        };
        // The operator is told which listener and address.
        assert!(
            e.to_string()
                .starts_with(&format!("cannot bind admin listener {addr}: ")),
            "{e}"
        );
    }

    /// A listener with `bounds` (and `control`) on a free port; readiness false.
    fn start_with(bounds: Bounds, control: Option<AdminControl>) -> SocketAddr {
        let (_, hub, ready) = start();
        let any = "127.0.0.1:0".parse().unwrap();
        let listener = crate::sys::sock::reuseport_listener(any, BACKLOG).unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Shared {
            hub,
            ready,
            control,
        };
        serve_admin(listener, shared, bounds).unwrap();
        addr
    }

    /// Has the listener closed `s`? Waits up to `within` for it.
    fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        s.set_read_timeout(Some(within)).unwrap();
        match s.read(&mut [0u8; 1]) {
            Ok(0) => true,
            Ok(_) => panic!("an idle socket was sent bytes"),
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
    }

    #[test]
    fn when_full_the_oldest_waiting_connection_is_closed_to_make_room() {
        let addr = start_with(
            Bounds {
                waiting: 3,
                idle: Duration::from_secs(60),
                head: Duration::from_secs(60),
            },
            None,
        );
        let mut idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        // A fourth: the first (oldest) makes room, the others stay.
        let _fourth = TcpStream::connect(addr).unwrap();
        assert!(closed_within(&mut idle[0], Duration::from_secs(5)));
        assert!(!closed_within(&mut idle[1], Duration::from_millis(200)));
        assert!(!closed_within(&mut idle[2], Duration::from_millis(200)));
        // A probe is the newest: it is served, and the next oldest makes room for it.
        let h = get(addr, "/healthz");
        assert_eq!((h.status, h.body.as_slice()), (200, &b"ok"[..]));
        assert!(closed_within(&mut idle[1], Duration::from_secs(5)));
        assert!(!closed_within(&mut idle[2], Duration::from_millis(200)));
    }

    #[test]
    fn a_silent_connection_is_closed_at_its_idle_deadline_without_an_answer() {
        let idle = Duration::from_millis(300);
        let addr = start_with(
            Bounds {
                waiting: 8,
                idle,
                head: Duration::from_secs(60),
            },
            None,
        );
        let t = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut bytes = Vec::new();
        s.read_to_end(&mut bytes).unwrap();
        let took = t.elapsed();
        assert!(bytes.is_empty(), "{:?}", String::from_utf8_lossy(&bytes));
        assert!(took >= idle && took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn a_slow_head_gets_408_at_the_head_deadline_past_the_idle_one() {
        let head = Duration::from_millis(1500);
        let addr = start_with(
            Bounds {
                waiting: 8,
                idle: Duration::from_millis(300),
                head,
            },
            None,
        );
        let t = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
        // Past the idle deadline: a head that has started is not idle.
        thread::sleep(Duration::from_millis(600));
        s.write_all(b"Host: a\r\n").unwrap();
        let r = read_reply(s);
        let took = t.elapsed();
        assert_eq!(
            (r.status, r.body.as_slice()),
            (408, &b"request timeout\n"[..])
        );
        assert!(took >= head && took < Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn more_idle_sockets_than_the_bound_leave_probes_and_scrapes_served() {
        let (addr, _hub, _ready) = start();
        let _idle: Vec<TcpStream> = (0..MAX_WAITING + 100)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // Answered at once, not once the idle ones reach their deadline.
        let t = Instant::now();
        assert_eq!(get(addr, "/healthz").status, 200);
        assert!(t.elapsed() < IDLE_DEADLINE, "{:?}", t.elapsed());
        assert_eq!(get(addr, "/readyz").status, 503);
        assert_eq!(get(addr, "/metrics").status, 200);
    }

    #[test]
    fn probes_are_answered_while_every_serving_thread_is_busy() {
        // Each reload's reply sender comes to the test, which answers when it chooses.
        let (held_tx, held) = mpsc::channel::<mpsc::Sender<ReloadReply>>();
        let control = AdminControl {
            reload: Box::new(move |reply| held_tx.send(reply).unwrap()),
            token_digest: Some(crate::config::limits::digest(b"admin-token")),
        };
        let addr = start_with(BOUNDS, Some(control));
        let reload =
            b"POST /admin/reload HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer admin-token\r\n\r\n";
        let waiting: Vec<TcpStream> = (0..MAX_SERVING)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(reload).unwrap();
                s
            })
            .collect();
        let replies: Vec<_> = (0..MAX_SERVING)
            .map(|_| held.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        // Every serving thread waits on a reload: one more is refused, probes are not.
        let busy = exchange(addr, reload);
        assert_eq!(
            (busy.status, busy.body.as_slice()),
            (503, &b"too many admin connections\n"[..])
        );
        assert_eq!(get(addr, "/metrics").status, 503);
        assert_eq!(get(addr, "/healthz").status, 200);
        assert_eq!(get(addr, "/readyz").status, 503);
        for reply in replies {
            let body = r#"{"reloaded":true}"#.to_string();
            reply.send(ReloadReply { status: 200, body }).unwrap();
        }
        for s in waiting {
            assert_eq!(read_reply(s).status, 200);
        }
        // The places come back as the threads end.
        let deadline = Instant::now() + Duration::from_secs(5);
        while get(addr, "/metrics").status != 200 {
            assert!(Instant::now() < deadline, "/metrics still refused");
            thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_body_after_an_inline_answer_does_not_reset_it() {
        let (addr, _hub, _ready) = start();
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"POST /healthz HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n")
            .unwrap();
        // The body comes after the answer was written: it is drained, not left to reset.
        thread::sleep(Duration::from_millis(50));
        let _ = s.write_all(&[b'x'; 32 * 1024]);
        let r = read_reply(s);
        assert_eq!(r.status, 405);
        assert_eq!(r.header("allow"), Some("GET, HEAD"));
    }
}
