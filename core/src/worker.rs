//! Per-core state: everything one worker thread owns, shared by its connection tasks through an
//! `Rc` and never touched by another thread — so nothing here locks or uses atomics.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::accesslog::{AccessLog, AccessRecord};
use crate::config::Snapshot;
use crate::inspect::Inspector;
use crate::limits::shard::LimiterShard;
use crate::metrics::{MetricsHub, MetricsShard};
use crate::observe::Observation;
use crate::upstream::Pools;

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

pub struct Worker {
    pub id: usize,
    pub snapshot: Rc<Snapshot>,
    pub pools: Pools,
    pub inspector: RefCell<Inspector>,
    pub rng: Cell<u64>,
    pub bufs: BufPool,
    /// Open client connections on this worker.
    pub connections: Cell<usize>,
    /// Requests being served on this worker right now.
    pub active_requests: Cell<usize>,
    /// Observation state (meter buffers included) lent to one request at a time.
    pub observations: RefCell<Vec<Box<Observation>>>,
    /// This worker's metrics; published to `hub` on a timer, never per request.
    pub metrics: MetricsShard,
    pub hub: std::sync::Arc<MetricsHub>,
    /// This worker's access-log writer, when one is configured.
    pub access_log: RefCell<Option<AccessLog>>,
    /// One record, refilled per request so its strings keep their capacity.
    pub record: RefCell<AccessRecord>,
    /// The `/v1/models` response body, built once per snapshot.
    pub models_body: Vec<u8>,
    /// This worker's limiter: local budgets, reconciled by the sync task.
    pub limiter: RefCell<LimiterShard>,
}

impl Worker {
    /// Is this the only request on the worker? Then writes go straight to the socket
    /// (lowest latency); under load they go through io_uring, where one submission carries
    /// many connections' operations (lowest CPU per request: measured ~3 µs less).
    pub fn direct_writes(&self) -> bool {
        self.active_requests.get() <= 1
    }

    pub fn take_observation(&self) -> Box<Observation> {
        self.observations.borrow_mut().pop().unwrap_or_default()
    }

    pub fn give_observation(&self, obs: Box<Observation>) {
        let mut pool = self.observations.borrow_mut();
        if pool.len() < 256 {
            pool.push(obs);
        }
    }

    pub fn new(
        id: usize,
        snapshot: Rc<Snapshot>,
        hub: std::sync::Arc<MetricsHub>,
        access_log: Option<AccessLog>,
    ) -> Worker {
        let pools = Pools::new(snapshot.backend_count, snapshot.upstream);
        let models_body = crate::models::list_body(&snapshot);
        // Distinct, non-zero seeds per worker and per process.
        let seed = (std::process::id() as u64) << 32 | (id as u64 + 1);
        Worker {
            id,
            pools,
            inspector: RefCell::new(Inspector::default()),
            rng: Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            bufs: BufPool::new(16 * 1024, 256),
            connections: Cell::new(0),
            active_requests: Cell::new(0),
            observations: RefCell::new(Vec::new()),
            metrics: MetricsShard::new(&hub),
            hub,
            access_log: RefCell::new(access_log),
            record: RefCell::new(AccessRecord::default()),
            models_body,
            limiter: RefCell::new(LimiterShard::new(
                &snapshot.limits,
                crate::limits::node_name(id),
            )),
            snapshot,
        }
    }
}
