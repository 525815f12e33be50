//! Per-core state: everything one worker thread owns, shared by its connection tasks through an
//! `Rc` and never touched by another thread — so nothing here locks or uses atomics. A request
//! borrows what it uses as a [`PerCore`].

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::config::Snapshot;
use crate::gateway::context::{BufPool, Drain, Load, PerCore};
use crate::gateway::observe::{LogSink, ObservationPool};
use crate::limits::shard::LimiterShard;
use crate::openai::inspect::Inspector;
use crate::telemetry::accesslog::AccessLog;
use crate::telemetry::metrics::{
    LabelNames, MetricsHub, MetricsShard, MetricsView, SnapshotLabels,
};
use crate::upstream::Pools;

/// What a worker serves new requests on: a config snapshot and what is built from it. A request
/// holds the generation it started on until it ends; [`Worker::swap_snapshot`] makes a new one.
pub struct Generation {
    pub(crate) snapshot: Rc<Snapshot>,
    /// The snapshot's view of the worker's upstream pools (shared with the previous
    /// generation for every backend both have).
    pub(crate) pools: Pools,
    /// The `/v1/models` response body.
    pub(crate) models_body: Vec<u8>,
    /// The snapshot's positions mapped to the metrics hub's label slots.
    pub(crate) labels: SnapshotLabels,
}

impl Generation {
    fn new(snapshot: Rc<Snapshot>, pools: Pools, names: &LabelNames) -> Generation {
        Generation {
            models_body: crate::gateway::models::list_body(&snapshot),
            labels: SnapshotLabels::new(names, &snapshot),
            snapshot,
            pools,
        }
    }
}

pub struct Worker {
    pub(crate) id: usize,
    current: RefCell<Rc<Generation>>,
    pub(crate) inspector: RefCell<Inspector>,
    pub(crate) rng: Cell<u64>,
    pub(crate) bufs: BufPool,
    /// Open client connections on this worker.
    pub(crate) connections: Cell<usize>,
    /// Requests being served on this worker right now.
    pub(crate) load: Load,
    /// Observation state (meter buffers included) lent to one request at a time.
    pub(crate) observations: ObservationPool,
    /// This worker's metrics; published to `hub` on a timer, never per request.
    pub(crate) metrics: MetricsShard,
    pub(crate) hub: std::sync::Arc<MetricsHub>,
    /// This worker's access-log writer (when one is configured) and its reused record.
    pub(crate) log: LogSink,
    /// This worker's limiter: local budgets, reconciled by the sync task.
    pub(crate) limiter: RefCell<LimiterShard>,
    /// Where the worker stands in a stop; lent to every request.
    pub(crate) drain: Drain,
}

impl Worker {
    pub fn new(
        id: usize,
        snapshot: Rc<Snapshot>,
        hub: std::sync::Arc<MetricsHub>,
        access_log: Option<AccessLog>,
    ) -> Worker {
        let limiter = LimiterShard::new(&snapshot.limits, crate::limits::node_name(id));
        let pools = Pools::new(&snapshot);
        // Distinct, non-zero seeds per worker and per process.
        let seed = (std::process::id() as u64) << 32 | (id as u64 + 1);
        Worker {
            id,
            current: RefCell::new(Rc::new(Generation::new(snapshot, pools, hub.names()))),
            inspector: RefCell::new(Inspector::default()),
            rng: Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            bufs: BufPool::new(16 * 1024, 256),
            connections: Cell::new(0),
            load: Load::default(),
            observations: ObservationPool::default(),
            metrics: MetricsShard::new(&hub),
            hub,
            log: LogSink::new(access_log, id),
            limiter: RefCell::new(limiter),
            drain: Drain::default(),
        }
    }

    /// The generation new requests start on.
    pub fn current(&self) -> Rc<Generation> {
        Rc::clone(&self.current.borrow())
    }

    /// The snapshot new requests start on.
    pub fn snapshot(&self) -> Rc<Snapshot> {
        Rc::clone(&self.current.borrow().snapshot)
    }

    /// Serve new requests on `snapshot`; requests already running finish on theirs. Upstream
    /// pools of backends both snapshots have are kept, with their connections. The limiter
    /// shard is kept as it is: its budgets are keyed by the policies' and keys' positions, so a
    /// snapshot that reorders or changes policies needs them re-keyed first (left to reload).
    pub fn swap_snapshot(&self, snapshot: Rc<Snapshot>) {
        let pools = self.current.borrow().pools.carry_over(&snapshot);
        *self.current.borrow_mut() = Rc::new(Generation::new(snapshot, pools, self.hub.names()));
    }

    /// What one request borrows of this worker, on `generation` (the one it started on).
    pub fn per_core<'w>(&'w self, generation: &'w Generation) -> PerCore<'w> {
        PerCore {
            snapshot: &generation.snapshot,
            pools: &generation.pools,
            limiter: &self.limiter,
            metrics: MetricsView {
                shard: &self.metrics,
                labels: &generation.labels,
            },
            bufs: &self.bufs,
            load: &self.load,
            inspector: &self.inspector,
            rng: &self.rng,
            observations: &self.observations,
            log: &self.log,
            drain: &self.drain,
        }
    }
}
