//! What a request's phases are handed: the client connection, the request as read, and the
//! parts of its worker's per-core state they use.
//!
//! The runtime owns the per-core state (`runtime::worker::Worker`) and lends it to one request
//! at a time as a [`PerCore`] of plain borrows; the pipeline passes each phase only the fields
//! it uses ([`Io`] for the two phases that talk to sockets). Nothing here locks: it is all one
//! thread's.

use std::cell::{Cell, RefCell};
use std::io;
use std::time::{Duration, Instant};

use monoio::buf::IoBufMut;
use monoio::io::AsyncReadRent;
use monoio::net::TcpStream;

use crate::config::{Snapshot, Timeouts};
use crate::gateway::observe::{LogSink, ObservationPool};
use crate::http::request::RequestHead;
use crate::limits::shard::LimiterShard;
use crate::openai::inspect::Inspector;
use crate::sys::{sock, stream};
use crate::telemetry::metrics::MetricsShard;
use crate::upstream::Pools;

/// The client connection. It has one owner (the connection loop), which lends it to the
/// request being served: reading and writing take `&mut self`, while watching for the client to
/// leave takes `&self` — so the compiler guarantees no write runs while a watch is alive (the
/// relay drops its watch before each write), and no `unsafe` is needed.
pub struct ClientSocket {
    stream: TcpStream,
}

impl ClientSocket {
    pub fn new(stream: TcpStream) -> ClientSocket {
        ClientSocket { stream }
    }

    pub async fn read<B: IoBufMut>(&mut self, buf: B) -> monoio::BufResult<usize, B> {
        self.stream.read(buf).await
    }

    fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.stream.as_raw_fd()
    }

    /// Write all of `buf` within `limit`. With `direct`, first straight to the socket (see
    /// [`Load::direct_writes`]); whatever it does not take goes through the runtime.
    pub async fn write_all(
        &mut self,
        buf: Vec<u8>,
        limit: Duration,
        direct: bool,
    ) -> (io::Result<()>, Vec<u8>) {
        match stream::write_all(&mut self.stream, buf, direct, limit).await {
            Ok(written) => written,
            Err(_) => (
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "client write timed out",
                )),
                Vec::new(),
            ),
        }
    }

    /// Resolves when the client sent something or closed: the caller peeks to tell which.
    pub async fn readable(&self) -> io::Result<()> {
        self.stream.readable(false).await
    }

    /// Read what the socket already holds (see [`sock::recv_now`]): for right after
    /// [`Self::readable`] fired.
    pub fn read_ready(&self, buf: &mut Vec<u8>) -> Option<usize> {
        sock::recv_now(self.fd(), buf)
    }

    /// Has the client closed (or reset) its side? Peeks without consuming; never blocks.
    pub fn peer_gone(&self) -> bool {
        sock::peer_gone(self.fd())
    }
}

/// A request whose head and body have been read.
pub struct Request<'a> {
    /// The read buffer; `head`'s ranges point into it.
    pub buf: &'a [u8],
    /// When the head and body were in.
    pub received_at: Instant,
    pub peer: Option<std::net::SocketAddr>,
    pub head: &'a RequestHead,
    pub body: &'a [u8],
}

/// Buffers handed out for one request and given back after, so the steady state allocates
/// nothing per request and idle connections hold no large buffers.
pub struct BufPool {
    free: RefCell<Vec<Vec<u8>>>,
    capacity: usize,
    /// Buffers that grew past this are freed rather than kept.
    max_kept_capacity: usize,
    max_free: usize,
}

impl BufPool {
    pub fn new(capacity: usize, max_free: usize) -> BufPool {
        BufPool {
            free: RefCell::new(Vec::new()),
            capacity,
            max_kept_capacity: capacity * 16,
            max_free,
        }
    }

    pub fn take(&self) -> Vec<u8> {
        self.free
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.capacity))
    }

    pub fn give(&self, mut buf: Vec<u8>) {
        let mut free = self.free.borrow_mut();
        if free.len() < self.max_free && buf.capacity() <= self.max_kept_capacity {
            buf.clear();
            free.push(buf);
        }
    }
}

/// Requests being served on this worker right now, which decides how writes go out.
#[derive(Default)]
pub struct Load {
    active_requests: Cell<usize>,
}

impl Load {
    /// Is this the only request on the worker? Then writes go straight to the socket
    /// (lowest latency); under load they go through io_uring, where one submission carries
    /// many connections' operations (lowest CPU per request: measured ~3 µs less).
    pub fn direct_writes(&self) -> bool {
        self.active_requests.get() <= 1
    }

    /// Count a request while the returned guard lives.
    pub fn enter(&self) -> ActiveRequest<'_> {
        self.active_requests.set(self.active_requests.get() + 1);
        ActiveRequest(self)
    }
}

/// One request counted in [`Load`]; uncounted on drop.
pub struct ActiveRequest<'a>(&'a Load);

impl Drop for ActiveRequest<'_> {
    fn drop(&mut self) {
        let active = &self.0.active_requests;
        active.set(active.get().saturating_sub(1));
    }
}

/// What the phases that talk to sockets (forward, relay) use: upstream pools, buffers, how to
/// write, the timeouts, and the metrics shard (for counting upstream exchanges in flight).
#[derive(Clone, Copy)]
pub struct Io<'w> {
    pub pools: &'w Pools,
    pub bufs: &'w BufPool,
    pub load: &'w Load,
    pub timeouts: &'w Timeouts,
    pub metrics: &'w MetricsShard,
}

/// One request's loan of its worker's per-core state: the config snapshot the request runs on
/// (kept for the request's whole life, whatever the worker swaps in meanwhile) and the worker's
/// pools, limiter shard, metrics shard, buffers and log.
#[derive(Clone, Copy)]
pub struct PerCore<'w> {
    pub snapshot: &'w Snapshot,
    pub pools: &'w Pools,
    pub limiter: &'w RefCell<LimiterShard>,
    pub metrics: &'w MetricsShard,
    pub bufs: &'w BufPool,
    pub load: &'w Load,
    pub inspector: &'w RefCell<Inspector>,
    pub rng: &'w Cell<u64>,
    pub observations: &'w ObservationPool,
    pub log: &'w LogSink,
}

impl<'w> PerCore<'w> {
    pub fn io(&self) -> Io<'w> {
        Io {
            pools: self.pools,
            bufs: self.bufs,
            load: self.load,
            timeouts: &self.snapshot.timeouts,
            metrics: self.metrics,
        }
    }
}
