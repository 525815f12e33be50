//! Upstream connections: per-worker keep-alive pools, connecting (TCP, then TLS for https
//! backends), and the I/O type both kinds share.
//!
//! Used by the forward phase. [`Pools::checkout`] returns an idle connection to a backend or
//! `None`; [`connect`] opens a new one within `timeouts.upstream_connect` (raising 504 on expiry,
//! 502 when refused or when the TLS handshake fails, 503 when the backend's connection cap on
//! this worker is reached); [`Pools::checkin`] keeps a connection whose last response ended
//! cleanly, up to `max_idle_per_backend`. Pools are `!Send`, one per worker: no locks.

use std::cell::{Cell, RefCell};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use rustls_pki_types::ServerName;

use crate::config::{Backend, Cluster, Timeouts, UpstreamLimits};

/// A plain or TLS connection to a backend.
pub enum UpstreamIo {
    Plain(TcpStream),
    Tls(Box<monoio_rustls::ClientTlsStream<TcpStream>>),
}

impl UpstreamIo {
    pub async fn read<B: IoBufMut>(&mut self, buf: B) -> monoio::BufResult<usize, B> {
        match self {
            UpstreamIo::Plain(s) => s.read(buf).await,
            UpstreamIo::Tls(s) => s.read(buf).await,
        }
    }

    /// Write all of `buf`. With `direct`, a plain connection first tries straight to the socket
    /// (see [`crate::runtime::worker::Worker::direct_writes`]).
    pub async fn write_all(
        &mut self,
        buf: Vec<u8>,
        direct: bool,
    ) -> (std::io::Result<()>, Vec<u8>) {
        match self {
            UpstreamIo::Plain(s) => {
                let sent = if direct {
                    match crate::sys::sock::send_now(s.as_raw_fd(), &buf) {
                        Ok(n) if n == buf.len() => return (Ok(()), buf),
                        Ok(n) => n,
                        Err(e) => return (Err(e), buf),
                    }
                } else {
                    0
                };
                let (res, slice) = s.write_all(buf.slice(sent..)).await;
                (res.map(|_| ()), slice.into_inner())
            }
            UpstreamIo::Tls(s) => {
                let (res, buf) = s.write_all(buf).await;
                (res.map(|_| ()), buf)
            }
        }
    }
}

/// One connection to a backend, counted against the backend's per-worker cap while it lives.
pub struct UpstreamConn {
    pub io: UpstreamIo,
    pub backend: usize,
    /// Came from the pool (so it may have been closed by the backend while idle).
    pub reused: bool,
    idle_since: Instant,
    fd: RawFd,
    open: Rc<Cell<usize>>,
}

impl UpstreamConn {
    /// Tear the connection down now, even while an operation on it is still in flight in the
    /// kernel: the backend sees the close at once (an in-flight io_uring read would otherwise
    /// keep the socket alive until it completes).
    pub fn abort(self) {
        // SAFETY: `fd` is the live socket owned by `self.io`, which is dropped right after;
        // shutdown does not close or invalidate the descriptor.
        unsafe {
            libc::shutdown(self.fd, libc::SHUT_RDWR);
        }
    }
}

impl Drop for UpstreamConn {
    fn drop(&mut self) {
        self.open.set(self.open.get().saturating_sub(1));
    }
}

/// Per-worker pools, one per backend, indexed by backend id.
pub struct Pools {
    idle: RefCell<Vec<Vec<UpstreamConn>>>,
    open: Vec<Rc<Cell<usize>>>,
    limits: UpstreamLimits,
}

impl Pools {
    pub fn new(backends: usize, limits: UpstreamLimits) -> Pools {
        Pools {
            idle: RefCell::new((0..backends).map(|_| Vec::new()).collect()),
            open: (0..backends).map(|_| Rc::new(Cell::new(0))).collect(),
            limits,
        }
    }

    /// The most recently used idle connection to `backend` that has not idled too long.
    pub fn checkout(&self, backend: usize) -> Option<UpstreamConn> {
        let mut idle = self.idle.borrow_mut();
        let list = idle.get_mut(backend)?;
        while let Some(mut conn) = list.pop() {
            if conn.idle_since.elapsed() < self.limits.idle_timeout {
                conn.reused = true;
                return Some(conn);
            }
            // Too old: the backend has likely closed it. Drop it (and everything older below).
            list.clear();
        }
        None
    }

    pub fn checkin(&self, mut conn: UpstreamConn) {
        let mut idle = self.idle.borrow_mut();
        if let Some(list) = idle.get_mut(conn.backend) {
            if list.len() < self.limits.max_idle_per_backend {
                conn.idle_since = Instant::now();
                list.push(conn);
            }
        }
    }

    fn open_counter(&self, backend: usize) -> Option<&Rc<Cell<usize>>> {
        self.open.get(backend)
    }

    /// Idle connections currently held for `backend` (for tests and metrics).
    pub fn idle_count(&self, backend: usize) -> usize {
        self.idle.borrow().get(backend).map_or(0, Vec::len)
    }
}

/// What went wrong with an upstream, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamFault {
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
pub enum ConnectError {
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
pub async fn connect(
    pools: &Pools,
    cluster: &Cluster,
    backend: &Backend,
    timeouts: &Timeouts,
) -> Result<UpstreamConn, ConnectError> {
    let Some(open) = pools.open_counter(backend.id) else {
        return Err(ConnectError::Failed {
            fault: UpstreamFault::Connect,
            message: "unknown backend".into(),
        });
    };
    if open.get() >= pools.limits.max_connections_per_backend {
        return Err(ConnectError::PoolFull);
    }
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
    match monoio::time::timeout(timeouts.upstream_connect, attempt).await {
        Ok(Ok((io, fd))) => {
            open.set(open.get() + 1);
            Ok(UpstreamConn {
                io,
                backend: backend.id,
                reused: false,
                idle_since: Instant::now(),
                fd,
                open: Rc::clone(open),
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
