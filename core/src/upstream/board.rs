//! The node-wide side of the wait queue (`[saturation]`): what the workers' queues tell each
//! other so that a freed slot goes to the best waiter of the whole process, and the fair-share
//! clocks that make a waiter's rank comparable across workers.
//!
//! Each worker keeps its own waiters (`gateway::queue`); per route it publishes here the rank
//! of its best one ([`RouteBoard::publish`]). A waiter takes a slot only while no other worker
//! publishes a better rank ([`RouteBoard::best_elsewhere`]), so a slot freed on a worker whose
//! waiters are worse is left for the better one, whose worker looks for it every
//! `saturation.poll_ms`.
//!
//! A rank is `class << 56 | start tag`: lower goes first, so any waiter of a higher class goes
//! before every waiter of a lower one. Within a class the start tag is start-time fair queueing
//! (Goyal et al., 1996): a key's (flow's) next request starts at the later of the class's
//! virtual time and the key's previous finish, and finishes `cost / weight` after it; the
//! virtual time is the start tag of the last request dispatched. Backlogged keys then take
//! turns in proportion to their weights whatever their offered rates, a key with no backlog
//! builds no credit, and one key's requests keep their order (FIFO). All relaxed atomics: a
//! rank a moment old only reorders waiters that arrived within that moment.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// A rank no waiter has: published by a worker with nobody waiting.
pub(crate) const NOBODY: u64 = u64::MAX;
/// Start tags live in the rank's low 56 bits.
const TAG_BITS: u32 = 56;
const TAG_MAX: u64 = (1 << TAG_BITS) - 1;
/// A cost of 1 (one request, or one token) at weight 1 advances a tag by this much.
pub(crate) const TAG_UNIT: u64 = 1 << 16;
/// The most one request may cost (a million tokens, past any context window): a client's
/// `max_tokens` is its own to choose, and an unbounded cost would push the class's clock to the
/// end of its range at once, after which every rank in the class ties.
const MAX_COST: u64 = 1 << 20;

/// One route's queue, node-wide.
#[derive(Debug)]
pub(crate) struct RouteBoard {
    /// Per worker: the rank of its best waiter ([`NOBODY`]: none).
    best: Box<[AtomicU64]>,
    /// Per class: the start tag of the last request dispatched.
    virtual_time: Box<[AtomicU64]>,
    /// Per (flow, class): the finish tag of the flow's last request.
    finish: Box<[AtomicU64]>,
    classes: usize,
    /// What the queue did, per class: kept across reloads for a route of the same pattern.
    pub(crate) stats: Arc<QueueStats>,
}

/// How a wait ended, for `sluice_queue_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueOutcome {
    /// Its turn came and it went to a backend.
    Dispatched,
    /// Its class's (or header's) longest wait passed.
    Expired,
    /// Dropped for a higher class, or refused while one waits.
    Shed,
    /// Refused: the worker's queue was full, with nothing lower to shed.
    Full,
    /// The client closed its connection while it waited.
    ClientLeft,
    /// The worker stopped.
    Shutdown,
}

impl QueueOutcome {
    pub(crate) const ALL: [QueueOutcome; 6] = [
        QueueOutcome::Dispatched,
        QueueOutcome::Expired,
        QueueOutcome::Shed,
        QueueOutcome::Full,
        QueueOutcome::ClientLeft,
        QueueOutcome::Shutdown,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            QueueOutcome::Dispatched => "dispatched",
            QueueOutcome::Expired => "expired",
            QueueOutcome::Shed => "shed",
            QueueOutcome::Full => "queue_full",
            QueueOutcome::ClientLeft => "client_left",
            QueueOutcome::Shutdown => "shutdown",
        }
    }
}

/// Upper bounds of `sluice_queue_wait_seconds`' buckets, in ms.
pub(crate) const WAIT_BUCKETS_MS: [u64; 14] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000,
];

/// One route's queue counters, node-wide, per class (all relaxed atomics, on the queued path
/// only).
#[derive(Debug)]
pub(crate) struct QueueStats {
    classes: usize,
    /// Per class: requests waiting now.
    depth: Box<[AtomicU64]>,
    /// Per (class, outcome).
    outcomes: Box<[AtomicU64]>,
    /// Per (class, bucket; the last is +Inf): waits ended (any outcome) by their length.
    wait_buckets: Box<[AtomicU64]>,
    /// Per class: the waits' total, ns.
    wait_sum_ns: Box<[AtomicU64]>,
    /// Per class: requests dispatched while another worker published a better waiter (the
    /// two decided within the same moment; see the module doc).
    inversions: Box<[AtomicU64]>,
}

impl QueueStats {
    fn new(classes: usize) -> QueueStats {
        let atomics = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        QueueStats {
            classes,
            depth: atomics(classes),
            outcomes: atomics(classes * QueueOutcome::ALL.len()),
            wait_buckets: atomics(classes * (WAIT_BUCKETS_MS.len() + 1)),
            wait_sum_ns: atomics(classes),
            inversions: atomics(classes),
        }
    }

    /// A request of `class` joined the queue.
    pub(crate) fn joined(&self, class: u8) {
        if let Some(d) = self.depth.get(usize::from(class)) {
            d.fetch_add(1, Relaxed);
        }
    }

    /// A request of `class` left the queue (for good, or for a slot it may yet lose).
    pub(crate) fn left(&self, class: u8) {
        if let Some(d) = self.depth.get(usize::from(class)) {
            let _ = d.fetch_update(Relaxed, Relaxed, |n| Some(n.saturating_sub(1)));
        }
    }

    /// A request of `class` is done with the queue: how, after waiting `waited`.
    pub(crate) fn ended(&self, class: u8, outcome: QueueOutcome, waited: Duration) {
        let c = usize::from(class);
        let o = QueueOutcome::ALL
            .iter()
            .position(|x| *x == outcome)
            .unwrap_or(0);
        if let Some(n) = self.outcomes.get(c * QueueOutcome::ALL.len() + o) {
            n.fetch_add(1, Relaxed);
        }
        let ms = waited.as_millis() as u64;
        let b = WAIT_BUCKETS_MS
            .iter()
            .position(|le| ms <= *le)
            .unwrap_or(WAIT_BUCKETS_MS.len());
        if let Some(n) = self.wait_buckets.get(c * (WAIT_BUCKETS_MS.len() + 1) + b) {
            n.fetch_add(1, Relaxed);
        }
        if let Some(n) = self.wait_sum_ns.get(c) {
            n.fetch_add(waited.as_nanos() as u64, Relaxed);
        }
    }

    /// A request of `class` was dispatched while a better one waited on another worker.
    pub(crate) fn inverted(&self, class: u8) {
        if let Some(n) = self.inversions.get(usize::from(class)) {
            n.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn inversions(&self, class: usize) -> u64 {
        self.inversions.get(class).map_or(0, |d| d.load(Relaxed))
    }

    pub(crate) fn depth(&self, class: usize) -> u64 {
        self.depth.get(class).map_or(0, |d| d.load(Relaxed))
    }

    pub(crate) fn outcome(&self, class: usize, outcome: usize) -> u64 {
        self.outcomes
            .get(class * QueueOutcome::ALL.len() + outcome)
            .map_or(0, |d| d.load(Relaxed))
    }

    /// Class `class`'s wait histogram: per bucket (not cumulative, +Inf last), and the sum in
    /// ns.
    pub(crate) fn waits(&self, class: usize) -> (Vec<u64>, u64) {
        let n = WAIT_BUCKETS_MS.len() + 1;
        let buckets = (0..n)
            .map(|b| {
                self.wait_buckets
                    .get(class * n + b)
                    .map_or(0, |d| d.load(Relaxed))
            })
            .collect();
        let sum = self.wait_sum_ns.get(class).map_or(0, |d| d.load(Relaxed));
        (buckets, sum)
    }
}

impl RouteBoard {
    fn new(
        workers: usize,
        flows: usize,
        classes: usize,
        stats: Option<Arc<QueueStats>>,
    ) -> RouteBoard {
        let atomics = |n: usize, v: u64| (0..n).map(|_| AtomicU64::new(v)).collect();
        RouteBoard {
            best: atomics(workers.max(1), NOBODY),
            virtual_time: atomics(classes, 0),
            finish: atomics(flows * classes, 0),
            classes,
            stats: stats
                .filter(|s| s.classes == classes)
                .unwrap_or_else(|| Arc::new(QueueStats::new(classes))),
        }
    }

    /// Worker `worker`'s best waiter now has `rank` ([`NOBODY`]: it has none).
    pub(crate) fn publish(&self, worker: usize, rank: u64) {
        if let Some(slot) = self.best.get(worker) {
            if slot.load(Relaxed) != rank {
                slot.store(rank, Relaxed);
            }
        }
    }

    /// The best rank any other worker publishes ([`NOBODY`]: none waits there).
    pub(crate) fn best_elsewhere(&self, worker: usize) -> u64 {
        self.best
            .iter()
            .enumerate()
            .filter(|(w, _)| *w != worker)
            .map(|(_, r)| r.load(Relaxed))
            .min()
            .unwrap_or(NOBODY)
    }

    /// The best rank published by any worker.
    pub(crate) fn best(&self) -> u64 {
        self.best
            .iter()
            .map(|r| r.load(Relaxed))
            .min()
            .unwrap_or(NOBODY)
    }

    /// The rank of a request of `flow` in `class` costing `cost` at `weight`: its start tag
    /// under start-time fair queueing (see the module doc), the flow's finish moved past it.
    pub(crate) fn rank(&self, flow: usize, class: u8, cost: u64, weight: u32) -> u64 {
        let c = usize::from(class).min(self.classes.saturating_sub(1));
        let step = cost.clamp(1, MAX_COST) * TAG_UNIT / u64::from(weight.max(1));
        let now = self.virtual_time.get(c).map_or(0, |v| v.load(Relaxed));
        let start = match self.finish.get(flow * self.classes + c) {
            Some(finish) => {
                let mut start = 0;
                let _ = finish.fetch_update(Relaxed, Relaxed, |f| {
                    start = f.max(now);
                    Some(start.saturating_add(step).min(TAG_MAX))
                });
                start
            }
            None => now,
        };
        rank_of(class, start)
    }

    /// A request of `rank` was dispatched: the class's virtual time moves up to its start.
    pub(crate) fn dispatched(&self, rank: u64) {
        let (class, start) = split(rank);
        if let Some(v) = self.virtual_time.get(usize::from(class)) {
            v.fetch_max(start, Relaxed);
        }
    }
}

/// The rank of a start tag in a class.
pub(crate) fn rank_of(class: u8, start: u64) -> u64 {
    (u64::from(class) << TAG_BITS) | start.min(TAG_MAX)
}

/// A rank's class.
pub(crate) fn class_of(rank: u64) -> u8 {
    (rank >> TAG_BITS) as u8
}

fn split(rank: u64) -> (u8, u64) {
    (class_of(rank), rank & TAG_MAX)
}

/// Every route's board, for one config snapshot.
#[derive(Debug)]
pub(crate) struct QueueBoard {
    routes: Box<[RouteBoard]>,
    /// Each route's name (its model pattern), for the metrics and for carrying its counters
    /// across a reload.
    names: Box<[String]>,
    /// A flow per key, and one for requests without a key.
    flows: usize,
}

impl QueueBoard {
    /// Boards for the routes named `routes` (in the snapshot's order) shared by `workers`
    /// workers, with `keys` keys and `classes` classes; a route `previous` had (same name, same
    /// classes) keeps its counters.
    pub(crate) fn new(
        routes: Vec<String>,
        workers: usize,
        keys: usize,
        classes: usize,
        previous: Option<&QueueBoard>,
    ) -> QueueBoard {
        let kept = |name: &str| {
            let p = previous?;
            let at = p.names.iter().position(|n| n == name)?;
            Some(Arc::clone(&p.routes[at].stats))
        };
        QueueBoard {
            routes: routes
                .iter()
                .map(|name| RouteBoard::new(workers, keys + 1, classes, kept(name)))
                .collect(),
            names: routes.into_boxed_slice(),
            flows: keys + 1,
        }
    }

    pub(crate) fn route(&self, index: usize) -> Option<&RouteBoard> {
        self.routes.get(index)
    }

    /// Each route's name and counters.
    pub(crate) fn stats(&self) -> impl Iterator<Item = (&str, &QueueStats)> {
        self.names
            .iter()
            .map(String::as_str)
            .zip(self.routes.iter().map(|r| &*r.stats))
    }

    /// The flow of a request: its key's (index + 1), or 0 for a request with none.
    pub(crate) fn flow(&self, key: Option<usize>) -> usize {
        key.map_or(0, |k| (k + 1).min(self.flows - 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two backlogged keys of one class, one offering four times the other's requests, are
    /// dispatched 1:1 by rank; weights 3:1 give 3:1; a class above goes first whatever its tag.
    #[test]
    fn ranks_share_a_class_by_weight_and_classes_by_order() {
        let board = QueueBoard::new(vec!["*".into()], 2, 2, 2, None);
        let r = board.route(0).unwrap();
        // Key 0 queues 40 requests, key 1 queues 10; dispatch the 20 best.
        let mut ranks: Vec<(u64, usize)> = (0..40)
            .map(|_| (r.rank(1, 1, 1, 1), 0))
            .chain((0..10).map(|_| (r.rank(2, 1, 1, 1), 1)))
            .collect();
        ranks.sort();
        let first: Vec<usize> = ranks[..20].iter().map(|(_, k)| *k).collect();
        assert_eq!(first.iter().filter(|k| **k == 0).count(), 10);
        // Weights 3:1, on a fresh board.
        let board = QueueBoard::new(vec!["*".into()], 2, 2, 2, None);
        let r = board.route(0).unwrap();
        let mut weighted: Vec<(u64, usize)> = (0..40)
            .map(|_| (r.rank(1, 1, 1, 3), 0))
            .chain((0..40).map(|_| (r.rank(2, 1, 1, 1), 1)))
            .collect();
        weighted.sort();
        let heavy = weighted[..40].iter().filter(|(_, k)| *k == 0).count();
        assert_eq!(heavy, 30, "3:1 over 40 dispatches");
        // Dispatching moves the class's clock: a key that was idle starts there, with no
        // credit for the time it queued nothing.
        r.dispatched(weighted[39].0);
        let idle = r.rank(0, 1, 1, 1);
        assert_eq!(idle, weighted[39].0);
        // Class 0 beats any class-1 rank.
        let high = r.rank(2, 0, 1, 1);
        assert!(high < weighted[0].0);
        assert_eq!(class_of(high), 0);
        assert_eq!(class_of(weighted[0].0), 1);
    }

    #[test]
    fn the_best_elsewhere_leaves_out_the_asking_worker() {
        let board = QueueBoard::new(vec!["*".into()], 3, 0, 1, None);
        let r = board.route(0).unwrap();
        assert_eq!(r.best_elsewhere(0), NOBODY);
        r.publish(0, 5);
        r.publish(2, 9);
        assert_eq!(r.best_elsewhere(0), 9);
        assert_eq!(r.best_elsewhere(1), 5);
        assert_eq!(r.best(), 5);
        r.publish(0, NOBODY);
        assert_eq!(r.best(), 9);
    }
}
