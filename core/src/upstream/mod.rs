//! Upstream connections: per-worker keep-alive pools, connecting (TCP, then TLS for https
//! backends), and the I/O type both kinds share.
//!
//! Used by the forward phase. [`Pools::checkout`] returns an idle connection to a backend or
//! `None`; [`connect`] opens a new one within `timeouts.upstream_connect` (raising 504 on expiry,
//! 502 when refused or when the TLS handshake fails, 503 when the backend's connection cap on
//! this worker is reached); [`Pools::wait_for_room`] waits, bounded by `pool_wait`, for a capped
//! backend to free a connection; [`Pools::checkin`] keeps a connection whose last response ended
//! cleanly, up to `max_idle_per_backend` or, when more, as many as were busy at once in the last
//! interval (`idle_timeout`): steady load reuses its connections instead of reopening them.
//! Pools are `!Send`, one per worker: no locks.
//! [`Pools::shut_down_all`] ends every connection the worker holds, idle or busy, for a stop
//! whose grace ran out.

pub(crate) mod affinity;
pub(crate) mod board;
pub(crate) mod health;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use rustls_pki_types::ServerName;

use crate::config::{Backend, Cluster, Snapshot, Timeouts, UpstreamLimits};
use crate::sys::clock::Elapsed;
use crate::sys::clock::Mono;

/// A plain or TLS connection to a backend.
pub(crate) enum UpstreamIo {
    Plain(TcpStream),
    Tls(Box<monoio_rustls::ClientTlsStream<TcpStream>>),
}

impl UpstreamIo {
    pub(crate) async fn read<B: IoBufMut>(&mut self, buf: B) -> monoio::BufResult<usize, B> {
        match self {
            UpstreamIo::Plain(s) => s.read(buf).await,
            UpstreamIo::Tls(s) => s.read(buf).await,
        }
    }

    /// Write all of `buf` within `limit`. With `direct`, a plain connection first tries
    /// straight to the socket (the gateway decides: few requests in flight favour latency, many
    /// favour the ring). `Err(Elapsed)`: `limit` passed, and the buffer went with the write.
    pub(crate) async fn write_all(
        &mut self,
        buf: Vec<u8>,
        direct: bool,
        limit: Duration,
    ) -> Result<(io::Result<()>, Vec<u8>), Elapsed> {
        match self {
            UpstreamIo::Plain(s) => crate::sys::stream::write_all(s, buf, direct, limit).await,
            UpstreamIo::Tls(s) => {
                let (res, buf) = crate::sys::clock::timeout(limit, s.write_all(buf)).await?;
                Ok((res.map(|_| ()), buf))
            }
        }
    }

    /// [`Self::write_all`] of `buf` followed by `tail`, which is borrowed: on a plain socket
    /// both go straight to it at once, whatever `direct` says ([`stream::write_with_tail`]);
    /// TLS encrypts from one buffer, so there `tail` is copied behind `buf`. `buf` comes back
    /// as it went.
    ///
    /// [`stream::write_with_tail`]: crate::sys::stream::write_with_tail
    pub(crate) async fn write_with_tail(
        &mut self,
        mut buf: Vec<u8>,
        tail: &[u8],
        direct: bool,
        limit: Duration,
    ) -> Result<(io::Result<()>, Vec<u8>), Elapsed> {
        match self {
            _ if tail.is_empty() => self.write_all(buf, direct, limit).await,
            UpstreamIo::Plain(s) => crate::sys::stream::write_with_tail(s, buf, tail, limit).await,
            UpstreamIo::Tls(_) => {
                let len = buf.len();
                buf.extend_from_slice(tail);
                let (res, mut buf) = self.write_all(buf, direct, limit).await?;
                buf.truncate(len);
                Ok((res, buf))
            }
        }
    }
}

/// One connection to a backend, counted against the backend's per-worker cap while it lives.
pub(crate) struct UpstreamConn {
    pub(crate) io: UpstreamIo,
    /// The pool of the backend it leads to: it goes back there whatever snapshot the worker
    /// serves by then.
    pool: Rc<BackendPool>,
    /// Came from the pool (so it may have been closed by the backend while idle).
    pub(crate) reused: bool,
    idle_since: Mono,
    fd: RawFd,
    /// Its slot in the worker's [`OpenConns`].
    slot: usize,
}

impl UpstreamConn {
    /// Tear the connection down now, even while an operation on it is still in flight in the
    /// kernel: the backend sees the close at once (an in-flight io_uring read would otherwise
    /// keep the socket alive until it completes).
    pub(crate) fn abort(self) {
        // SAFETY: `fd` is the live socket owned by `self.io`, which is dropped right after;
        // shutdown does not close or invalidate the descriptor.
        unsafe {
            libc::shutdown(self.fd, libc::SHUT_RDWR);
        }
    }
}

impl Drop for UpstreamConn {
    fn drop(&mut self) {
        self.pool.open.set(self.pool.open.get().saturating_sub(1));
        // Before the descriptor closes (the fields drop after this), so no closed number stays
        // in the set.
        self.pool.conns.remove(self.slot);
        // Room under the cap: a request waiting for it may connect.
        self.pool.waiters.wake_one();
    }
}

/// Requests waiting for room on one capped backend, oldest first. Each waits under its own
/// number, so one that gives up takes its entry out and a wake-up never goes to a request that
/// left.
#[derive(Default)]
struct Waiters {
    queue: RefCell<VecDeque<(u64, Waker)>>,
    next: Cell<u64>,
}

impl Waiters {
    fn wake_one(&self) {
        // Popped before waking: the woken task may register again at once.
        let first = self.queue.borrow_mut().pop_front();
        if let Some((_, waker)) = first {
            waker.wake();
        }
    }
}

/// One request's place in [`Waiters`]; leaving it (done or timed out) gives up the place, and a
/// wake-up it was handed but did not use goes on to the next in line.
struct WaitTicket<'p> {
    pool: &'p BackendPool,
    id: u64,
    /// Woken and not yet polled: the wake-up is this ticket's to use or pass on.
    woken: bool,
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        let mut queue = self.pool.waiters.queue.borrow_mut();
        match queue.iter().position(|(id, _)| *id == self.id) {
            Some(at) => {
                queue.remove(at);
            }
            None if self.woken => {
                drop(queue);
                self.pool.waiters.wake_one();
            }
            None => {}
        }
    }
}

/// Every upstream connection open on one worker, whichever snapshot's pools it belongs to: what
/// [`Pools::shut_down_all`] ends. Counted per connection (connect and close), never per request.
#[derive(Default)]
struct OpenConns {
    sockets: RefCell<crate::sys::sock::SocketSet>,
    /// Shut down already: a connection opened since is shut down as it arrives.
    shut: Cell<bool>,
}

impl OpenConns {
    fn add(&self, fd: RawFd) -> usize {
        if self.shut.get() {
            crate::sys::sock::shutdown(fd);
        }
        self.sockets.borrow_mut().insert(fd, false)
    }

    fn remove(&self, slot: usize) {
        self.sockets.borrow_mut().remove(slot);
    }
}

/// What makes two backends the same for pooling: where it connects and how (TLS, server name,
/// Host). A snapshot swap that keeps a backend keeps its pool and its connections.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BackendIdentity {
    addrs: Vec<SocketAddr>,
    tls: bool,
    server_name: String,
    host_header: String,
}

impl BackendIdentity {
    fn of(b: &Backend) -> BackendIdentity {
        BackendIdentity {
            addrs: b.addrs.clone(),
            tls: b.tls,
            server_name: b.server_name.clone(),
            host_header: b.host_header.clone(),
        }
    }
}

/// One backend's connections on this worker: the idle ones, and how many are open (idle and
/// busy), which the per-backend cap counts.
struct BackendPool {
    identity: BackendIdentity,
    idle: RefCell<Vec<UpstreamConn>>,
    open: Cell<usize>,
    /// Most connections busy at once in the current interval and the one before: what the
    /// idle pool keeps room for.
    busy_peak: Cell<usize>,
    busy_peak_before: Cell<usize>,
    /// When the current interval began (intervals are `idle_timeout` long, turned over when a
    /// connection is checked in).
    interval_began: Cell<Mono>,
    /// Requests waiting for room under the cap.
    waiters: Waiters,
    /// How many [`Pools`] (one per live snapshot) include it. At 0 no request can check a
    /// connection out of it again: its idle connections are closed and none are kept.
    views: Cell<usize>,
    /// The worker's open connections, this pool's among them.
    conns: Rc<OpenConns>,
}

/// Per-worker pools for one snapshot's backends, indexed by its backend ids. The pools
/// themselves are shared with the next snapshot's view for every backend it keeps
/// ([`Pools::carry_over`]), so a swap does not drop their connections.
pub(crate) struct Pools {
    backends: Vec<Rc<BackendPool>>,
    limits: UpstreamLimits,
    /// The worker's open connections: shared by every snapshot's pools.
    conns: Rc<OpenConns>,
}

impl Pools {
    /// Empty pools for `snapshot`'s backends.
    pub(crate) fn new(snapshot: &Snapshot) -> Pools {
        Pools::build(snapshot, &[], Rc::default())
    }

    /// Pools for `snapshot` that keep the pool (and the connections) of every backend it
    /// shares with these. The pools of backends it drops live on while requests of the old
    /// snapshot use them, and close their connections when the old snapshot's pools go.
    pub(crate) fn carry_over(&self, snapshot: &Snapshot) -> Pools {
        Pools::build(snapshot, &self.backends, Rc::clone(&self.conns))
    }

    /// Shut down every upstream connection of the worker, idle or busy, in any snapshot's pools,
    /// and any opened from now on: a read waiting on one ends at once, as if the upstream had
    /// closed it. For a stop whose grace ran out. Returns how many were open.
    pub(crate) fn shut_down_all(&self) -> usize {
        self.conns.shut.set(true);
        self.conns.sockets.borrow().shut_down_all()
    }

    fn build(snapshot: &Snapshot, previous: &[Rc<BackendPool>], conns: Rc<OpenConns>) -> Pools {
        let mut backends: Vec<&Backend> = snapshot
            .clusters
            .iter()
            .flat_map(|c| c.backends.iter())
            .collect();
        backends.sort_by_key(|b| b.id);
        let backends = backends
            .into_iter()
            .map(|b| {
                let identity = BackendIdentity::of(b);
                let pool = match previous.iter().find(|p| p.identity == identity) {
                    Some(kept) => Rc::clone(kept),
                    None => Rc::new(BackendPool {
                        identity,
                        idle: RefCell::new(Vec::new()),
                        open: Cell::new(0),
                        busy_peak: Cell::new(0),
                        busy_peak_before: Cell::new(0),
                        interval_began: Cell::new(Mono::now()),
                        waiters: Waiters::default(),
                        views: Cell::new(0),
                        conns: Rc::clone(&conns),
                    }),
                };
                pool.views.set(pool.views.get() + 1);
                pool
            })
            .collect();
        Pools {
            backends,
            limits: snapshot.upstream,
            conns,
        }
    }

    /// The most recently used idle connection to `backend` that has not idled too long.
    pub(crate) fn checkout(&self, backend: usize) -> Option<UpstreamConn> {
        let pool = self.backends.get(backend)?;
        let mut idle = pool.idle.borrow_mut();
        while let Some(mut conn) = idle.pop() {
            if crate::sys::clock::recent().saturating_duration_since(conn.idle_since)
                < self.limits.idle_timeout
            {
                conn.reused = true;
                let busy = pool.open.get().saturating_sub(idle.len());
                drop(idle);
                pool.note_busy(busy);
                return Some(conn);
            }
            // Too old: the backend has likely closed it. Drop it (and everything older below).
            idle.clear();
        }
        None
    }

    /// Keep `conn` for reuse, in its backend's pool, if that pool is still in use and has room:
    /// `max_idle_per_backend`, or as many as were busy at once lately when that was more.
    pub(crate) fn checkin(&self, mut conn: UpstreamConn) {
        let pool = Rc::clone(&conn.pool);
        let now = crate::sys::clock::recent();
        if now.saturating_duration_since(pool.interval_began.get()) >= self.limits.idle_timeout {
            pool.busy_peak_before.set(pool.busy_peak.get());
            pool.busy_peak
                .set(pool.open.get().saturating_sub(pool.idle.borrow().len()));
            pool.interval_began.set(now);
        }
        let keep = self
            .limits
            .max_idle_per_backend
            .max(pool.busy_peak.get())
            .max(pool.busy_peak_before.get());
        let mut idle = pool.idle.borrow_mut();
        if pool.views.get() > 0 && idle.len() < keep {
            conn.idle_since = now;
            idle.push(conn);
            drop(idle);
            // An idle connection: a request waiting on the cap may take it.
            pool.waiters.wake_one();
        }
        // Else `conn` drops here, which wakes a waiter itself.
    }

    /// How long a request may wait for room on a capped backend (`upstream.pool_wait_ms`).
    pub(crate) fn pool_wait(&self) -> Duration {
        self.limits.pool_wait
    }

    /// Wait, at most `limit`, until `backend` has an idle connection or room under its cap (a
    /// connection checked in or closed); false when the wait ran out. For a request whose
    /// [`connect`] found the cap reached; waiters are woken oldest first.
    pub(crate) async fn wait_for_room(&self, backend: usize, limit: Duration) -> bool {
        let Some(pool) = self.backends.get(backend) else {
            return false;
        };
        let cap = self.limits.max_connections_per_backend;
        let room = || pool.open.get() < cap || !pool.idle.borrow().is_empty();
        if room() {
            return true;
        }
        let id = pool.waiters.next.get();
        pool.waiters.next.set(id.wrapping_add(1));
        let mut ticket = WaitTicket {
            pool,
            id,
            woken: false,
        };
        let queued = || pool.waiters.queue.borrow().iter().any(|(i, _)| *i == id);
        let waited = std::future::poll_fn(|cx| {
            if room() {
                return Poll::Ready(());
            }
            if !queued() {
                // First poll, or woken and beaten to the room: back in line.
                pool.waiters
                    .queue
                    .borrow_mut()
                    .push_back((id, cx.waker().clone()));
            }
            Poll::Pending
        });
        let ok = crate::sys::clock::timeout(limit, waited).await.is_ok();
        // Out of line without having used the room: a wake-up that came as the wait ran out,
        // which the ticket passes on.
        ticket.woken = !ok && !queued();
        ok
    }
}

impl BackendPool {
    /// `busy` connections are in use right now (one just taken or opened).
    fn note_busy(&self, busy: usize) {
        if busy > self.busy_peak.get() {
            self.busy_peak.set(busy);
        }
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        for pool in &self.backends {
            pool.views.set(pool.views.get().saturating_sub(1));
            if pool.views.get() == 0 {
                // Idle connections point back at their pool: closing them frees both.
                let idle = std::mem::take(&mut *pool.idle.borrow_mut());
                drop(idle);
            }
        }
    }
}

/// What went wrong with an upstream, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpstreamFault {
    /// The TCP connection could not be made (refused, unreachable).
    Connect,
    /// The TLS handshake failed (unknown issuer, wrong name, …).
    Tls,
    /// Connecting, the first byte or a stream went past its timeout.
    Timeout,
    /// The connection failed or closed early.
    Io,
    /// The upstream broke HTTP framing (malformed head or chunk, a protocol switch).
    Protocol,
}

/// Why no connection to a backend could be had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConnectError {
    /// TCP or TLS failed (`fault` says which), with what the client may be told.
    Failed {
        fault: UpstreamFault,
        message: String,
    },
    /// This worker already holds `max_connections_per_backend` to it.
    PoolFull,
    /// The connect (and handshake) took longer than `upstream_connect`.
    Timeout,
}

/// Open a new connection to `backend` (TCP, plus TLS for https), trying its addresses in order.
pub(crate) async fn connect(
    pools: &Pools,
    cluster: &Cluster,
    backend: &Backend,
    timeouts: &Timeouts,
) -> Result<UpstreamConn, ConnectError> {
    let Some(pool) = pools.backends.get(backend.id) else {
        return Err(ConnectError::Failed {
            fault: UpstreamFault::Connect,
            message: "unknown backend".into(),
        });
    };
    if pool.open.get() >= pools.limits.max_connections_per_backend {
        return Err(ConnectError::PoolFull);
    }
    // Counted from now, not from when the connect succeeds: requests connecting at once must
    // not all pass the cap. Given back if the connect fails.
    let slot = ConnectSlot::take(pool);
    // Errors carry which step failed: TCP (`Connect`) or the TLS handshake (`Tls`).
    let attempt = async {
        let stream = connect_tcp(&backend.addrs)
            .await
            .map_err(|e| (UpstreamFault::Connect, e))?;
        let fd = stream.as_raw_fd();
        let _ = stream.set_nodelay(true);
        let io = if backend.tls {
            let tls_error = |e: io::Error| (UpstreamFault::Tls, e);
            let Some(tls) = &cluster.tls else {
                return Err(tls_error(io::Error::other(
                    "no TLS configuration for an https backend",
                )));
            };
            let name = ServerName::try_from(backend.server_name.clone())
                .map_err(|_| tls_error(io::Error::other("invalid TLS server name")))?;
            let connector = monoio_rustls::TlsConnector::from(Arc::clone(tls));
            let tls_stream = connector
                .connect(name, stream)
                .await
                .map_err(|e| tls_error(io::Error::other(format!("TLS handshake failed: {e}"))))?;
            UpstreamIo::Tls(Box::new(tls_stream))
        } else {
            UpstreamIo::Plain(stream)
        };
        Ok((io, fd))
    };
    match crate::sys::clock::timeout(timeouts.upstream_connect, attempt).await {
        Ok(Ok((io, fd))) => {
            // The connection now holds the slot (its drop gives it back).
            std::mem::forget(slot);
            pool.note_busy(pool.open.get().saturating_sub(pool.idle.borrow().len()));
            Ok(UpstreamConn {
                io,
                pool: Rc::clone(pool),
                reused: false,
                idle_since: crate::sys::clock::recent(),
                fd,
                slot: pool.conns.add(fd),
            })
        }
        Ok(Err((fault, e))) => Err(ConnectError::Failed {
            fault,
            message: format!(
                "could not connect to the upstream: {}",
                connect_error_text(&e)
            ),
        }),
        Err(_) => Err(ConnectError::Timeout),
    }
}

/// A place under a backend's cap, held while a connection is being opened: dropped (the
/// connect failed or was abandoned), it gives the place back and wakes a waiter.
struct ConnectSlot<'p> {
    pool: &'p BackendPool,
}

impl<'p> ConnectSlot<'p> {
    fn take(pool: &'p BackendPool) -> ConnectSlot<'p> {
        pool.open.set(pool.open.get() + 1);
        ConnectSlot { pool }
    }
}

impl Drop for ConnectSlot<'_> {
    fn drop(&mut self) {
        self.pool.open.set(self.pool.open.get().saturating_sub(1));
        self.pool.waiters.wake_one();
    }
}

async fn connect_tcp(addrs: &[SocketAddr]) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address for backend");
    for &addr in addrs {
        match TcpStream::connect_addr(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn connect_error_text(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".into(),
        io::ErrorKind::ConnectionReset => "connection reset".into(),
        _ => e.to_string(),
    }
}
