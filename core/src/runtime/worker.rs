//! Per-core state: everything one worker thread owns, shared by its connection tasks through an
//! `Rc` and never touched by another thread — so nothing here locks or uses atomics. A request
//! borrows what it uses as a [`PerCore`].

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::config::Snapshot;
use crate::gateway::context::{BufPool, Drain, Load, PerCore};
use crate::gateway::record::{LogSink, ObservationPool};
use crate::limits::shard::LimiterShard;
use crate::openai::inspect::Inspector;
use crate::telemetry::accesslog::AccessLog;
use crate::telemetry::metrics::{
    LabelNames, MetricsHub, MetricsShard, MetricsView, SnapshotLabels,
};
use crate::upstream::health::HealthTable;
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
    /// The backends' health, shared with the process's other workers.
    pub(crate) health: Arc<HealthTable>,
}

impl Generation {
    fn new(
        snapshot: Rc<Snapshot>,
        pools: Pools,
        names: &LabelNames,
        health: Arc<HealthTable>,
    ) -> Generation {
        Generation {
            health,
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
    /// Client read buffers, between a connection's requests (an idle connection holds none).
    pub(crate) read_bufs: BufPool,
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
    /// The worker's side of a stop: its grace, and the signals its tasks wait on.
    pub(crate) stop: Stop,
    /// Open client connections, marked while they wait for a request (so a drain can close
    /// those at once). Registered once per connection; a request only flips its mark.
    pub(crate) clients: RefCell<crate::sys::sock::SocketSet>,
}

/// Smallest read buffer of a connection; grows as a request needs, shrinks back after it.
pub(crate) const MIN_READ_BUF: usize = 2048;

/// A worker's stop, as its tasks see it.
#[derive(Default)]
pub(crate) struct Stop {
    /// How long requests in flight may run once the drain starts.
    pub(crate) grace: Cell<Duration>,
    /// Set when the drain starts: the accept loop ends.
    pub(crate) draining: Signal,
    /// The listening sockets went to a successor (a takeover): the accept loops end without
    /// shutting them down.
    pub(crate) listeners_handed_over: Cell<bool>,
    /// Set when no client connection is left during a drain.
    pub(crate) all_closed: Signal,
    /// Set when the worker is done with requests: the sync task makes its last exchange.
    pub(crate) last_sync: Signal,
}

/// A one-way flag tasks of one thread can wait on: set once, it wakes every waiter. Every
/// connection's first wait selects on `draining`, so a wait that is dropped unfinished (the
/// request came first) leaves the list: a waker kept there holds its task's memory alive, which
/// the soak showed as ~3.6 KB per connection, never freed.
#[derive(Default)]
pub(crate) struct Signal {
    set: Cell<bool>,
    waiters: RefCell<WaiterSlots>,
}

/// Wakers in slots, reused: a wait owns its slot from its first pending poll until it is
/// dropped or the flag is set.
#[derive(Default)]
struct WaiterSlots {
    slots: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Signal {
    pub(crate) fn set(&self) {
        self.set.set(true);
        let waiters = std::mem::take(&mut *self.waiters.borrow_mut());
        for waker in waiters.slots.into_iter().flatten() {
            waker.wake();
        }
    }

    /// Resolves once the flag is set.
    pub(crate) fn wait(&self) -> SignalWait<'_> {
        SignalWait {
            signal: self,
            slot: None,
        }
    }

    /// How many waits are registered.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.waiters.borrow().slots.iter().flatten().count()
    }
}

pub(crate) struct SignalWait<'a> {
    signal: &'a Signal,
    slot: Option<usize>,
}

impl Future for SignalWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let signal = this.signal;
        if signal.set.get() {
            this.slot = None;
            return Poll::Ready(());
        }
        let mut waiters = signal.waiters.borrow_mut();
        let WaiterSlots { slots, free } = &mut *waiters;
        match this.slot.and_then(|slot| slots.get_mut(slot)) {
            Some(Some(waker)) if waker.will_wake(cx.waker()) => {}
            Some(entry) => *entry = Some(cx.waker().clone()),
            None => {
                let slot = match free.pop() {
                    Some(slot) => {
                        if let Some(entry) = slots.get_mut(slot) {
                            *entry = Some(cx.waker().clone());
                        }
                        slot
                    }
                    None => {
                        slots.push(Some(cx.waker().clone()));
                        slots.len() - 1
                    }
                };
                this.slot = Some(slot);
            }
        }
        Poll::Pending
    }
}

impl Drop for SignalWait<'_> {
    fn drop(&mut self) {
        // Once the flag is set the slots are gone (and never handed out again).
        if let Some(slot) = self.slot.take() {
            if self.signal.set.get() {
                return;
            }
            let mut waiters = self.signal.waiters.borrow_mut();
            if let Some(entry) = waiters.slots.get_mut(slot) {
                if entry.take().is_some() {
                    waiters.free.push(slot);
                }
            }
        }
    }
}

impl Worker {
    /// A worker with its own health table (the runtime's workers share one: see
    /// [`with_health`](Self::with_health)).
    pub fn new(
        id: usize,
        snapshot: Rc<Snapshot>,
        hub: std::sync::Arc<MetricsHub>,
        access_log: Option<AccessLog>,
    ) -> Worker {
        let health = Arc::new(HealthTable::build(&snapshot, None));
        Worker::with_health(id, snapshot, health, hub, access_log)
    }

    pub(crate) fn with_health(
        id: usize,
        snapshot: Rc<Snapshot>,
        health: Arc<HealthTable>,
        hub: std::sync::Arc<MetricsHub>,
        access_log: Option<AccessLog>,
    ) -> Worker {
        let limiter = LimiterShard::new(&snapshot.limits, crate::limits::node_name(id));
        let pools = Pools::new(&snapshot);
        // Distinct, non-zero seeds per worker and per process.
        let seed = (std::process::id() as u64) << 32 | (id as u64 + 1);
        Worker {
            id,
            current: RefCell::new(Rc::new(Generation::new(
                snapshot,
                pools,
                hub.names(),
                health,
            ))),
            inspector: RefCell::new(Inspector::default()),
            rng: Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            bufs: BufPool::new(16 * 1024, 256),
            read_bufs: BufPool::new(MIN_READ_BUF, 128),
            connections: Cell::new(0),
            load: Load::for_worker(id),
            observations: ObservationPool::default(),
            metrics: MetricsShard::new(&hub),
            hub,
            log: LogSink::new(access_log, id),
            limiter: RefCell::new(limiter),
            drain: Drain::default(),
            stop: Stop::default(),
            clients: RefCell::default(),
        }
    }

    /// Start a stop: take nothing new (the accept loop ends), close the client connections that
    /// wait for a request with nothing sent, and let requests in flight run for `grace`.
    pub(crate) fn start_drain(&self, grace: Duration) {
        self.stop.grace.set(grace);
        self.drain.start();
        self.stop.draining.set();
        // Each one's task wakes to a closed socket and ends; one that has bytes waiting (a
        // request on its way) is served, with `connection: close`.
        self.clients.borrow_mut().shut_down_quiet_marked();
        if self.connections.get() == 0 {
            self.stop.all_closed.set();
        }
    }

    /// A client connection was opened.
    pub(crate) fn connection_opened(&self) {
        self.connections.set(self.connections.get() + 1);
    }

    /// A client connection closed: the last one of a drain says so.
    pub(crate) fn connection_closed(&self) {
        let open = self.connections.get().saturating_sub(1);
        self.connections.set(open);
        if open == 0 && self.drain.draining() {
            self.stop.all_closed.set();
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
        let health = HealthTable::build(&snapshot, Some(&self.current.borrow().health));
        self.swap_generation(snapshot, Arc::new(health));
    }

    /// [`swap_snapshot`](Self::swap_snapshot), with the health table the control thread built
    /// for every worker.
    pub(crate) fn swap_generation(&self, snapshot: Rc<Snapshot>, health: Arc<HealthTable>) {
        let pools = self.current.borrow().pools.carry_over(&snapshot);
        let generation = Generation::new(snapshot, pools, self.hub.names(), health);
        *self.current.borrow_mut() = Rc::new(generation);
    }

    /// What one request borrows of this worker, on `generation` (the one it started on).
    pub fn per_core<'w>(&'w self, generation: &'w Generation) -> PerCore<'w> {
        PerCore {
            snapshot: &generation.snapshot,
            pools: &generation.pools,
            health: &generation.health,
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
            models_body: &generation.models_body,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn poll(wait: &mut SignalWait<'_>, waker: &Waker) -> Poll<()> {
        Pin::new(wait).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn a_dropped_wait_leaves_the_signal_and_its_slot_is_reused() {
        let signal = Signal::default();
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&counter));
        // A connection per iteration: its first wait pends, then the request wins the select.
        for _ in 0..1000 {
            let mut wait = signal.wait();
            assert_eq!(poll(&mut wait, &waker), Poll::Pending);
            assert_eq!(signal.waiting(), 1);
        }
        assert_eq!(signal.waiting(), 0);
        assert_eq!(
            signal.waiters.borrow().slots.len(),
            1,
            "the one slot is reused"
        );

        // A wait polled again keeps one slot; the ones still waiting are woken once by `set`.
        let mut kept = signal.wait();
        let mut other = signal.wait();
        assert_eq!(poll(&mut kept, &waker), Poll::Pending);
        assert_eq!(poll(&mut kept, &waker), Poll::Pending);
        assert_eq!(poll(&mut other, &waker), Poll::Pending);
        assert_eq!(signal.waiting(), 2);
        drop(other);
        signal.set();
        assert_eq!(counter.0.load(Ordering::Relaxed), 1);
        assert_eq!(poll(&mut kept, &waker), Poll::Ready(()));
        drop(kept);
        assert_eq!(poll(&mut signal.wait(), &waker), Poll::Ready(()));
        assert_eq!(signal.waiting(), 0);
    }
}
