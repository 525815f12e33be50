//! What a request's phases are handed: the client connection, the request as read, and the
//! parts of its worker's per-core state they use.
//!
//! The runtime owns the per-core state (`runtime::worker::Worker`) and lends it to one request
//! at a time as a [`PerCore`] of plain borrows; the pipeline passes each phase only the fields
//! it uses ([`Io`] for the two phases that talk to sockets). Nothing here locks: it is all one
//! thread's.

use std::cell::{Cell, RefCell};

use crate::config::{Snapshot, Timeouts};
use crate::gateway::record::{LogSink, ObservationPool};
use crate::http::request::RequestHead;
use crate::limits::shard::LimiterShard;
use crate::openai::inspect::Inspector;
use crate::sys::clock::Mono;
use crate::telemetry::metrics::MetricsView;
#[cfg(test)]
use crate::telemetry::metrics::{MetricsShard, SnapshotLabels};
use crate::upstream::Pools;

/// A request whose head and body have been read.
pub(crate) struct Request<'a> {
    /// The read buffer; `head`'s ranges point into it.
    pub(crate) buf: &'a [u8],
    /// When the head and body were in.
    pub(crate) received_at: Mono,
    pub(crate) peer: Option<std::net::SocketAddr>,
    pub(crate) head: &'a RequestHead,
    pub(crate) body: &'a [u8],
}

impl Request<'_> {
    /// The API the client speaks, by the path it called.
    pub(crate) fn dialect(&self) -> crate::openai::endpoint::ClientDialect {
        crate::openai::endpoint::ClientDialect::of_path(self.head.path(self.buf))
    }
}

/// Buffers handed out for one request and given back after, so the steady state allocates
/// nothing per request and idle connections hold no large buffers.
pub(crate) struct BufPool {
    free: RefCell<Vec<Vec<u8>>>,
    capacity: usize,
    /// Buffers that grew past this are freed rather than kept.
    max_kept_capacity: usize,
    max_free: usize,
}

impl BufPool {
    pub(crate) fn new(capacity: usize, max_free: usize) -> BufPool {
        BufPool {
            free: RefCell::new(Vec::new()),
            capacity,
            max_kept_capacity: capacity * 16,
            max_free,
        }
    }

    pub(crate) fn take(&self) -> Vec<u8> {
        self.free
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.capacity))
    }

    pub(crate) fn give(&self, mut buf: Vec<u8>) {
        let mut free = self.free.borrow_mut();
        // An empty shell (a buffer taken for a write that never gave it back) is not worth
        // keeping: the next take would have to allocate anyway.
        if free.len() < self.max_free
            && (self.capacity..=self.max_kept_capacity).contains(&buf.capacity())
        {
            buf.clear();
            free.push(buf);
        }
    }
}

/// Requests being served on this worker right now, which decides how writes go out and when new
/// ones are shed, and the request-body bytes they hold.
#[derive(Default)]
pub(crate) struct Load {
    active_requests: Cell<usize>,
    body_bytes: Cell<usize>,
    /// Requests waiting for room (`[saturation]`): here, not in [`PerCore`], which every phase
    /// is handed by value (each field there is copied into every phase's call and future).
    pub(crate) queues: crate::gateway::queue::WaitQueues,
}

impl Load {
    /// Is this the only request on the worker? Then writes go straight to the socket
    /// (lowest latency); under load they go through io_uring, where one submission carries
    /// many connections' operations (lowest CPU per request: measured ~3 µs less). Two
    /// exceptions whatever this says: the writes a stream's first token waits on
    /// ([`Self::direct_writes_for`]), and a long prompt's end, which goes straight to the
    /// socket from the client's buffer (`UpstreamIo::write_with_tail`), since the ring would
    /// need it copied.
    pub(crate) fn direct_writes(&self) -> bool {
        self.active_requests.get() <= 1
    }

    /// Does a write go straight to the socket? When [`Self::direct_writes`] says so, and always
    /// when it lies on a stream's way to its first token (`first_token`): a streamed request
    /// to the upstream, and the stream's head with the events read with it to the client.
    /// Through io_uring a write goes out only once the loop turn's every ready task has run,
    /// and the task learns it went a turn later; on a worker near its full CPU those turns are
    /// what a new stream's first token waits on. Both writes straight roughly halved the time
    /// to first byte at 1,000–1,150 streams on one worker (perf/RESULTS.md, "The first token at
    /// 1,000 streams"); either one alone was within the noise. A stream is one request and
    /// dozens of writes, so the two syscalls cost it nothing measurable; a short answer keeps
    /// the ring's batching.
    pub(crate) fn direct_writes_for(&self, first_token: bool) -> bool {
        first_token || self.direct_writes()
    }

    /// Requests being read or served now.
    pub(crate) fn active(&self) -> usize {
        self.active_requests.get()
    }

    /// Account for a request body while the returned guard lives; it grows with
    /// [`BodyHold::grow_to`], within `cap` bytes for the whole worker.
    pub(crate) fn hold_body(&self, cap: usize) -> BodyHold<'_> {
        BodyHold {
            load: self,
            held: 0,
            cap,
        }
    }

    /// The load of worker `worker` (its index among the process's workers).
    pub(crate) fn for_worker(worker: usize) -> Load {
        Load {
            queues: crate::gateway::queue::WaitQueues::for_worker(worker),
            ..Load::default()
        }
    }

    /// Count a request while the returned guard lives.
    pub(crate) fn enter(&self) -> ActiveRequest<'_> {
        self.active_requests.set(self.active_requests.get() + 1);
        ActiveRequest(self)
    }
}

/// One request's body bytes, counted in [`Load`] until dropped.
pub(crate) struct BodyHold<'a> {
    load: &'a Load,
    held: usize,
    cap: usize,
}

impl BodyHold<'_> {
    /// Hold `bytes` for this body in all (not more). `false`: the worker's bodies would pass
    /// the cap, and nothing more is held.
    pub(crate) fn grow_to(&mut self, bytes: usize) -> bool {
        let total = &self.load.body_bytes;
        let more = bytes.saturating_sub(self.held);
        if total.get() + more > self.cap {
            return false;
        }
        total.set(total.get() + more);
        self.held += more;
        true
    }
}

impl Drop for BodyHold<'_> {
    fn drop(&mut self) {
        let total = &self.load.body_bytes;
        total.set(total.get().saturating_sub(self.held));
    }
}

/// One request counted in [`Load`]; uncounted on drop.
pub(crate) struct ActiveRequest<'a>(&'a Load);

impl Drop for ActiveRequest<'_> {
    fn drop(&mut self) {
        let active = &self.0.active_requests;
        active.set(active.get().saturating_sub(1));
    }
}

/// Where the worker stands in a stop (SIGTERM): serving; draining — requests and streams in
/// flight finish, responses say `connection: close`, nothing new is taken; or past the grace —
/// what still runs is ended (the runtime shuts the upstream connections, and the relay and the
/// forward phase, seeing an upstream cut at this stage, end the request as a shutdown). The
/// runtime sets it; the phases read it at most once per request (when a response head is
/// written) and on the paths that end a request early, never per event.
#[derive(Default)]
pub(crate) struct Drain {
    phase: Cell<DrainPhase>,
    /// Requests that ended while the worker drained.
    finished: Cell<u64>,
    /// Of those, the ones the end of the grace ended.
    cut: Cell<u64>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum DrainPhase {
    #[default]
    Serving,
    Draining,
    PastGrace,
}

impl Drain {
    /// Stop taking new work; let what runs finish.
    pub(crate) fn start(&self) {
        if self.phase.get() == DrainPhase::Serving {
            self.phase.set(DrainPhase::Draining);
        }
    }

    /// The grace ran out: what still runs is ended.
    pub(crate) fn end_grace(&self) {
        self.phase.set(DrainPhase::PastGrace);
    }

    /// Draining (or past the grace): take nothing new, close connections after their response.
    pub(crate) fn draining(&self) -> bool {
        self.phase.get() != DrainPhase::Serving
    }

    /// The grace ran out: an upstream cut now is the shutdown's doing.
    pub(crate) fn past_grace(&self) -> bool {
        self.phase.get() == DrainPhase::PastGrace
    }

    /// A request ended (counted only while draining).
    pub(crate) fn request_ended(&self) {
        if self.draining() {
            self.finished.set(self.finished.get() + 1);
        }
    }

    /// A request was ended by the end of the grace (it is also counted by
    /// [`Self::request_ended`]).
    pub(crate) fn ended_by_shutdown(&self) {
        self.cut.set(self.cut.get() + 1);
    }

    /// Requests that ended while draining: (finished on their own, ended at the deadline).
    pub(crate) fn counts(&self) -> (u64, u64) {
        let cut = self.cut.get();
        (self.finished.get().saturating_sub(cut), cut)
    }
}

/// What the phases that talk to sockets (forward, relay) use: upstream pools, buffers, how to
/// write, the timeouts, the metrics shard (for counting upstream exchanges in flight), and
/// whether the worker is stopping.
#[derive(Clone, Copy)]
pub(crate) struct Io<'w> {
    pub(crate) pools: &'w Pools,
    pub(crate) bufs: &'w BufPool,
    pub(crate) load: &'w Load,
    pub(crate) timeouts: &'w Timeouts,
    pub(crate) metrics: MetricsView<'w>,
    pub(crate) drain: &'w Drain,
}

/// One request's loan of its worker's per-core state: the config snapshot the request runs on
/// (kept for the request's whole life, whatever the worker swaps in meanwhile) and the worker's
/// pools, limiter shard, metrics shard, buffers and log.
#[derive(Clone, Copy)]
pub struct PerCore<'w> {
    pub(crate) snapshot: &'w Snapshot,
    pub(crate) pools: &'w Pools,
    /// The backends' health, shared by the process's workers.
    pub(crate) health: &'w crate::upstream::health::HealthTable,
    pub(crate) limiter: &'w RefCell<LimiterShard>,
    /// The worker's metrics shard, with the request's snapshot's label map.
    pub(crate) metrics: MetricsView<'w>,
    pub(crate) bufs: &'w BufPool,
    pub(crate) load: &'w Load,
    pub(crate) inspector: &'w RefCell<Inspector>,
    pub(crate) rng: &'w Cell<u64>,
    pub(crate) observations: &'w ObservationPool,
    pub(crate) log: &'w LogSink,
    pub(crate) drain: &'w Drain,
    /// The `/v1/models` body of the request's snapshot, for keys without lists of their own.
    pub(crate) models_body: &'w [u8],
}

impl<'w> PerCore<'w> {
    pub(crate) fn io(&self) -> Io<'w> {
        Io {
            pools: self.pools,
            bufs: self.bufs,
            load: self.load,
            timeouts: &self.snapshot.timeouts,
            metrics: self.metrics,
            drain: self.drain,
        }
    }
}

/// A worker's per-core state without a worker thread or a socket, for the phases' and the
/// pipeline's unit tests: the same parts a worker owns, built from one snapshot.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::http::request::{parse_request_head, HeadScan, HeadStatus};

    pub(crate) struct OwnedCore {
        pub(crate) snapshot: Snapshot,
        pools: Pools,
        pub(crate) health: crate::upstream::health::HealthTable,
        pub(crate) limiter: RefCell<LimiterShard>,
        pub(crate) metrics: MetricsShard,
        labels: SnapshotLabels,
        bufs: BufPool,
        load: Load,
        inspector: RefCell<Inspector>,
        rng: Cell<u64>,
        observations: ObservationPool,
        log: LogSink,
        drain: Drain,
    }

    impl OwnedCore {
        pub(crate) fn new(config: &str) -> OwnedCore {
            let snapshot = crate::config::load(config, &|_| None).unwrap();
            let hub = crate::telemetry::metrics::MetricsHub::for_snapshot(&snapshot);
            OwnedCore {
                labels: SnapshotLabels::new(hub.names(), &snapshot),
                pools: Pools::new(&snapshot),
                health: crate::upstream::health::HealthTable::build(&snapshot, None),
                limiter: RefCell::new(LimiterShard::new(&snapshot.limits, "test-0".into())),
                metrics: MetricsShard::new(&hub),
                bufs: BufPool::new(1024, 4),
                load: Load::default(),
                inspector: RefCell::new(Inspector::default()),
                rng: Cell::new(0x9e37_79b9_7f4a_7c15),
                observations: ObservationPool::default(),
                log: LogSink::new(None, 0),
                drain: Drain::default(),
                snapshot,
            }
        }

        pub(crate) fn per_core(&self) -> PerCore<'_> {
            PerCore {
                snapshot: &self.snapshot,
                pools: &self.pools,
                health: &self.health,
                limiter: &self.limiter,
                metrics: MetricsView {
                    shard: &self.metrics,
                    labels: &self.labels,
                },
                bufs: &self.bufs,
                load: &self.load,
                inspector: &self.inspector,
                rng: &self.rng,
                observations: &self.observations,
                log: &self.log,
                drain: &self.drain,
                models_body: b"",
            }
        }

        /// Parse `raw` (a whole request, head and body) as the connection loop would.
        pub(crate) fn head(&self, raw: &[u8]) -> RequestHead {
            let mut head = RequestHead::default();
            let status = parse_request_head(
                raw,
                &mut HeadScan::default(),
                &self.snapshot.http,
                &mut head,
            )
            .unwrap();
            assert_eq!(status, HeadStatus::Complete);
            head
        }
    }

    /// The request the connection loop would hand the pipeline for `raw` parsed as `head`.
    pub(crate) fn request<'a>(raw: &'a [u8], head: &'a RequestHead) -> Request<'a> {
        Request {
            buf: raw,
            received_at: Mono::now(),
            peer: Some(([10, 0, 0, 1], 40_000).into()),
            head,
            body: &raw[head.head_len..],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Load;

    #[test]
    fn a_streams_first_token_path_writes_straight_even_under_load() {
        let load = Load::default();
        let _only = load.enter();
        assert!(load.direct_writes() && load.direct_writes_for(false));
        let _second = load.enter();
        assert!(
            !load.direct_writes(),
            "two requests: writes go through the ring"
        );
        assert!(
            !load.direct_writes_for(false),
            "a short answer keeps the batching"
        );
        assert!(
            load.direct_writes_for(true),
            "a first token does not wait on the ring"
        );
    }
}
