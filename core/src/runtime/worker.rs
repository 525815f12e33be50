//! Per-core state: everything one worker thread owns, shared by its connection tasks through an
//! `Rc` and never touched by another thread — so nothing here locks or uses atomics. A request
//! borrows what it uses as a [`PerCore`].

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::config::Snapshot;
use crate::gateway::context::{BufPool, Load, PerCore};
use crate::gateway::observe::{LogSink, ObservationPool};
use crate::limits::shard::LimiterShard;
use crate::openai::inspect::Inspector;
use crate::telemetry::accesslog::AccessLog;
use crate::telemetry::metrics::{MetricsHub, MetricsShard};
use crate::upstream::Pools;

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
    pub load: Load,
    /// Observation state (meter buffers included) lent to one request at a time.
    pub observations: ObservationPool,
    /// This worker's metrics; published to `hub` on a timer, never per request.
    pub metrics: MetricsShard,
    pub hub: std::sync::Arc<MetricsHub>,
    /// This worker's access-log writer (when one is configured) and its reused record.
    pub log: LogSink,
    /// The `/v1/models` response body, built once per snapshot.
    pub models_body: Vec<u8>,
    /// This worker's limiter: local budgets, reconciled by the sync task.
    pub limiter: RefCell<LimiterShard>,
}

impl Worker {
    pub fn new(
        id: usize,
        snapshot: Rc<Snapshot>,
        hub: std::sync::Arc<MetricsHub>,
        access_log: Option<AccessLog>,
    ) -> Worker {
        let pools = Pools::new(snapshot.backend_count, snapshot.upstream);
        let models_body = crate::gateway::models::list_body(&snapshot);
        // Distinct, non-zero seeds per worker and per process.
        let seed = (std::process::id() as u64) << 32 | (id as u64 + 1);
        Worker {
            id,
            pools,
            inspector: RefCell::new(Inspector::default()),
            rng: Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            bufs: BufPool::new(16 * 1024, 256),
            connections: Cell::new(0),
            load: Load::default(),
            observations: ObservationPool::default(),
            metrics: MetricsShard::new(&hub),
            hub,
            log: LogSink::new(access_log, id),
            models_body,
            limiter: RefCell::new(LimiterShard::new(
                &snapshot.limits,
                crate::limits::node_name(id),
            )),
            snapshot,
        }
    }

    /// What one request borrows of this worker, on `snapshot` (the one the request started on).
    pub fn per_core<'w>(&'w self, snapshot: &'w Snapshot) -> PerCore<'w> {
        PerCore {
            snapshot,
            pools: &self.pools,
            limiter: &self.limiter,
            metrics: &self.metrics,
            bufs: &self.bufs,
            load: &self.load,
            inspector: &self.inspector,
            rng: &self.rng,
            observations: &self.observations,
            log: &self.log,
        }
    }
}
