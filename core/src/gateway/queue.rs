//! Queue: where a request waits when every backend that could take it is at its cap
//! (`[saturation]`), and who goes next when a slot frees.
//!
//! Runs after admission, only for a request the route phase found no room for (or that found
//! others already waiting for its route). [`join`] takes the request's route, class, key and
//! cost and returns its [`Place`] — or refuses it: `queue_full` (the worker's queue is at
//! `max_queued_per_worker` with nothing of a lower, sheddable class to drop), `request_shed`
//! (its class is refused while a higher one waits). [`Place::turn`] then resolves when the
//! request is the best waiter of the whole process for its route — the pipeline routes it
//! again and either dispatches it ([`Place::dispatched`]) or, when another took the slot
//! first, waits on — or ends the wait: `queue_timeout` at its deadline (with `Retry-After` from
//! the queue's recent drain rate), `request_shed` when a higher class took its place,
//! `server_shutting_down` when the worker drains, 499 when the client leaves.
//!
//! Each worker keeps its own waiters (a worker's tasks never share them with another thread);
//! the node-wide order is the [`RouteBoard`]'s: each worker publishes its best waiter's rank
//! there, and a waiter takes a slot only while no other worker publishes a better one. The best
//! waiter of each worker looks for room every `saturation.poll_ms`, and at once when a request
//! on its own worker ends ([`WaitQueues::slot_freed`]); the others sleep until they are the
//! best, shed, or out of time. So a slot freed on one worker waits at most `poll_ms` for the
//! best waiter of another, and a lower class takes a slot while a higher one waits elsewhere
//! only when the two decide within the same moment (a rank is read as it was a moment ago).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::config::saturation::Saturation;
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::sys::client::ClientSocket;
use crate::sys::clock::{self, Mono};
use crate::upstream::board::{self, QueueOutcome, RouteBoard, NOBODY};

/// How long a client must be gone before a queued request notices (as the attempt's watch).
const LEFT_POLL: Duration = Duration::from_millis(75);

/// One worker's waiters, per (board, route): requests of a snapshot a reload replaced keep
/// their own queue until it empties.
#[derive(Default)]
pub(crate) struct WaitQueues {
    queues: RefCell<Vec<LocalQueue>>,
    next_id: Cell<u64>,
    /// Waiters on this worker, in every queue (shed ones not counted), and for room under a
    /// key's limits ([`limit`]).
    waiting: Cell<usize>,
    /// Requests waiting for room under an `on_limit = "queue"` policy (see [`limit`]).
    limit: RefCell<Vec<limit::LimitEntry>>,
    /// This worker's index among the process's workers (its slot on the boards).
    worker: Cell<usize>,
}

pub(crate) mod limit;

struct LocalQueue {
    /// The board's address: which snapshot's queue this is.
    board: usize,
    route: usize,
    entries: Vec<Entry>,
    /// The lowest rank of `entries` waiting ([`NOBODY`]: none).
    best: u64,
    /// Moving average of the time between dispatches (s; 0: none yet), for `Retry-After`.
    dispatch_gap: f64,
    last_dispatch: Option<Mono>,
}

struct Entry {
    id: u64,
    rank: u64,
    shed: bool,
    /// Woken: the slot freed, it became the best, it was shed, or the worker drains.
    nudged: bool,
    waker: Option<Waker>,
}

/// Why a wait ended without a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    Expired,
    Shed,
    ClientLeft,
    Shutdown,
}

impl WaitEnd {
    /// As `sluice_queue_total` and the access log count it.
    pub(crate) fn outcome(self) -> QueueOutcome {
        match self {
            WaitEnd::Expired => QueueOutcome::Expired,
            WaitEnd::Shed => QueueOutcome::Shed,
            WaitEnd::ClientLeft => QueueOutcome::ClientLeft,
            WaitEnd::Shutdown => QueueOutcome::Shutdown,
        }
    }

    /// The answer to a wait the client ended (499), or the worker's stop (503): the same
    /// whatever the request waited for (a deadline or a shed is each wait's own to answer).
    pub(crate) fn left_error(self) -> GatewayError {
        match self {
            WaitEnd::ClientLeft => GatewayError::new(
                ErrorKind::ClientLeft,
                "The client closed the connection while the request waited.",
            ),
            _ => GatewayError::new(
                ErrorKind::ShuttingDown,
                "The gateway is shutting down; the request waited and was not sent. Retry.",
            ),
        }
    }
}

/// What a request waits with: its rank, and until when.
pub(crate) struct Ask {
    pub(crate) route: usize,
    pub(crate) class: u8,
    /// Its key's flow on the board, and its share's weight.
    pub(crate) flow: usize,
    pub(crate) weight: u32,
    /// 1 (requests), or its tokens (`fair_by = "tokens"`).
    pub(crate) cost: u64,
    pub(crate) max_wait: Duration,
}

/// A request's place in its route's queue. Dropped, it leaves the queue.
pub(crate) struct Place<'q> {
    queues: &'q WaitQueues,
    board: &'q RouteBoard,
    board_addr: usize,
    route: usize,
    worker: usize,
    id: u64,
    pub(crate) rank: u64,
    pub(crate) joined_at: Mono,
    deadline: Mono,
    poll: Duration,
    /// The last turn found no room: the next waits for a nudge or a poll first.
    missed: bool,
    queued: bool,
    class: u8,
    /// How the wait ended, for the metrics (recorded when the place is dropped), and how long
    /// it lasted (set once it ended).
    outcome: QueueOutcome,
    waited: Option<Duration>,
}

impl WaitQueues {
    /// The queues of worker `worker`.
    pub(crate) fn for_worker(worker: usize) -> WaitQueues {
        let queues = WaitQueues::default();
        queues.worker.set(worker);
        queues
    }

    pub(crate) fn worker(&self) -> usize {
        self.worker.get()
    }

    /// A request on this worker ended (its slot, if it held one, is free): each queue's best
    /// waiter looks for room now rather than at its next poll.
    pub(crate) fn slot_freed(&self) {
        if self.waiting.get() == 0 {
            return;
        }
        for q in self.queues.borrow_mut().iter_mut() {
            q.nudge_best();
        }
        limit::nudge_heads(&mut self.limit.borrow_mut());
    }

    /// Wake every waiter (the worker drains: each answers).
    fn nudge_all(&self) {
        for q in self.queues.borrow_mut().iter_mut() {
            for e in &mut q.entries {
                e.nudge();
            }
        }
        for e in self.limit.borrow_mut().iter_mut() {
            e.nudge();
        }
    }
}

impl LocalQueue {
    /// A waiter joins (or rejoins, rank kept).
    fn push(&mut self, id: u64, rank: u64) {
        self.entries.push(Entry {
            id,
            rank,
            shed: false,
            nudged: false,
            waker: None,
        });
        self.refresh_best();
    }

    fn refresh_best(&mut self) {
        self.best = self
            .entries
            .iter()
            .filter(|e| !e.shed)
            .map(|e| e.rank)
            .min()
            .unwrap_or(NOBODY);
    }

    fn nudge_best(&mut self) {
        let best = self.best;
        if let Some(e) = self.entries.iter_mut().find(|e| !e.shed && e.rank == best) {
            e.nudge();
        }
    }

    /// Seconds until a request joining now would likely be served: the waiters ahead over
    /// the recent drain rate; 1 to 60.
    fn retry_after(&self) -> u32 {
        let ahead = self.entries.iter().filter(|e| !e.shed).count().max(1) as f64;
        let secs = if self.dispatch_gap > 0.0 {
            ahead * self.dispatch_gap
        } else {
            1.0
        };
        secs.ceil().clamp(1.0, 60.0) as u32
    }
}

impl Entry {
    fn nudge(&mut self) {
        self.nudged = true;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// Join the queue of `ask.route` on `board`: see the module doc. `worker` is this worker's
/// index.
pub(crate) fn join<'q>(
    queues: &'q WaitQueues,
    board: &'q RouteBoard,
    board_addr: usize,
    worker: usize,
    saturation: &Saturation,
    ask: &Ask,
) -> Result<Place<'q>, GatewayError> {
    let class = saturation.classes.get(usize::from(ask.class));
    if class.is_some_and(|c| c.refuse_while_higher_waits)
        && board::class_of(board.best()) < ask.class
    {
        board
            .stats
            .ended(ask.class, QueueOutcome::Shed, Duration::ZERO);
        return Err(GatewayError::new(
            ErrorKind::Shed,
            "A request of a higher priority class is waiting; this one's class is not queued \
             meanwhile. Retry later.",
        )
        .with_retry_after(Some(1)));
    }
    let rank = board.rank(ask.flow, ask.class, ask.cost, ask.weight);
    if queues.waiting.get() >= saturation.max_queued_per_worker
        && !shed_one_below(queues, saturation, rank)
    {
        let retry = queue_of(queues, board_addr, ask.route, |q| q.retry_after());
        board
            .stats
            .ended(ask.class, QueueOutcome::Full, Duration::ZERO);
        return Err(GatewayError::new(
            ErrorKind::QueueFull,
            "Every upstream for this model is at capacity and the wait queue is full; retry \
             later.",
        )
        .with_retry_after(Some(retry.unwrap_or(1))));
    }
    let id = queues.next_id.get();
    queues.next_id.set(id + 1);
    queues.waiting.set(queues.waiting.get() + 1);
    let mut all = queues.queues.borrow_mut();
    // A reload's old queues go once empty.
    all.retain(|q| q.board == board_addr || !q.entries.is_empty());
    let at = match all
        .iter()
        .position(|q| q.board == board_addr && q.route == ask.route)
    {
        Some(at) => at,
        None => {
            all.push(LocalQueue {
                board: board_addr,
                route: ask.route,
                entries: Vec::new(),
                best: NOBODY,
                dispatch_gap: 0.0,
                last_dispatch: None,
            });
            all.len() - 1
        }
    };
    let q = &mut all[at];
    q.push(id, rank);
    board.publish(worker, q.best);
    board.stats.joined(ask.class);
    let joined_at = Mono::now();
    Ok(Place {
        queues,
        board,
        board_addr,
        route: ask.route,
        worker,
        id,
        rank,
        joined_at,
        deadline: joined_at + ask.max_wait,
        poll: saturation.poll,
        missed: false,
        queued: true,
        class: ask.class,
        outcome: QueueOutcome::Dispatched,
        waited: None,
    })
}

/// The `sluice_queue_total` outcome of a request [`join`] refused.
pub(crate) fn refusal_outcome(e: &GatewayError) -> &'static str {
    match e.kind {
        ErrorKind::Shed => QueueOutcome::Shed.label(),
        _ => QueueOutcome::Full.label(),
    }
}

/// The worker's queue is full: shed the worst waiter of a sheddable class below `rank`'s
/// (any route). `false`: there is none.
fn shed_one_below(queues: &WaitQueues, saturation: &Saturation, rank: u64) -> bool {
    let sheddable = |r: u64| {
        saturation
            .classes
            .get(usize::from(board::class_of(r)))
            .is_some_and(|c| c.sheddable)
    };
    let mut all = queues.queues.borrow_mut();
    let worst = all
        .iter()
        .enumerate()
        .flat_map(|(qi, q)| q.entries.iter().enumerate().map(move |(ei, e)| (qi, ei, e)))
        .filter(|(_, _, e)| {
            !e.shed && board::class_of(e.rank) > board::class_of(rank) && sheddable(e.rank)
        })
        .max_by_key(|(_, _, e)| e.rank)
        .map(|(qi, ei, _)| (qi, ei));
    let Some((qi, ei)) = worst else {
        return false;
    };
    let q = &mut all[qi];
    q.entries[ei].shed = true;
    q.entries[ei].nudge();
    q.refresh_best();
    queues.waiting.set(queues.waiting.get().saturating_sub(1));
    true
}

fn queue_of<T>(
    queues: &WaitQueues,
    board: usize,
    route: usize,
    f: impl FnOnce(&mut LocalQueue) -> T,
) -> Option<T> {
    let mut all = queues.queues.borrow_mut();
    all.iter_mut()
        .find(|q| q.board == board && q.route == route)
        .map(f)
}

impl<'q> Place<'q> {
    /// Wait for this request's turn: see the module doc. `draining` says whether the worker
    /// stops.
    pub(crate) async fn turn(
        &mut self,
        client: &ClientSocket,
        draining: &dyn Fn() -> bool,
    ) -> Result<(), WaitEnd> {
        let turn = self.wait_turn(client, draining).await;
        if let Err(why) = turn {
            self.outcome = why.outcome();
            self.waited = Some(Mono::now().saturating_duration_since(self.joined_at));
            self.leave();
        }
        turn
    }

    async fn wait_turn(
        &mut self,
        client: &ClientSocket,
        draining: &dyn Fn() -> bool,
    ) -> Result<(), WaitEnd> {
        let left = client.left(LEFT_POLL);
        let mut left = std::pin::pin!(left);
        loop {
            if draining() {
                self.queues.nudge_all();
                return Err(WaitEnd::Shutdown);
            }
            let (shed, local_best) = self.look();
            if shed {
                return Err(WaitEnd::Shed);
            }
            let now = Mono::now();
            if now >= self.deadline {
                return Err(WaitEnd::Expired);
            }
            if local_best && !self.missed && self.rank <= self.board.best_elsewhere(self.worker) {
                return Ok(());
            }
            self.missed = false;
            // The best waiter of this worker polls for slots freed elsewhere; the others sleep
            // until nudged (they become the best, are shed, or the worker drains).
            let until = if local_best {
                self.deadline.min(now + self.poll)
            } else {
                self.deadline
            };
            monoio::select! {
                () = Nudged { place: self } => {}
                () = clock::sleep_until(until) => {}
                () = &mut left => return Err(WaitEnd::ClientLeft),
            }
        }
    }

    /// (shed, this is the worker's best waiter of its route).
    fn look(&self) -> (bool, bool) {
        queue_of(self.queues, self.board_addr, self.route, |q| {
            let shed = q.entries.iter().any(|e| e.id == self.id && e.shed);
            (shed, q.best == self.rank)
        })
        .unwrap_or((true, false))
    }

    /// How the wait ended, as `sluice_queue_total` and the access log name it.
    pub(crate) fn outcome(&self) -> &'static str {
        self.outcome.label()
    }

    /// The turn found no room (another took the slot): wait for the next.
    pub(crate) fn missed(&mut self) {
        self.missed = true;
    }

    /// The request's turn found room: it leaves the queue (the next waiter is the best) and
    /// goes out; the class's fair-share clock moves to its rank.
    pub(crate) fn step_out(&mut self) {
        // A better waiter published elsewhere since this one's turn came: the two decided
        // within the same moment (counted, for the bound the module doc states).
        if self.board.best_elsewhere(self.worker) < self.rank {
            self.board.stats.inverted(self.class);
        }
        self.board.dispatched(self.rank);
        let now = Mono::now();
        queue_of(self.queues, self.board_addr, self.route, |q| {
            if let Some(last) = q.last_dispatch {
                let gap = now.saturating_duration_since(last).as_secs_f64();
                q.dispatch_gap = if q.dispatch_gap == 0.0 {
                    gap
                } else {
                    q.dispatch_gap * 0.9 + gap * 0.1
                };
            }
            q.last_dispatch = Some(now);
        });
        self.waited = Some(now.saturating_duration_since(self.joined_at));
        self.leave();
    }

    /// The room was gone by the time the request claimed it (another worker's request took
    /// it): back in the queue with the rank it had, to wait for the next.
    pub(crate) fn step_back(&mut self) {
        if self.queued {
            return;
        }
        let (id, rank) = (self.id, self.rank);
        let best = queue_of(self.queues, self.board_addr, self.route, |q| {
            q.push(id, rank);
            q.best
        });
        if let Some(best) = best {
            self.board.stats.joined(self.class);
            self.waited = None;
            self.queued = true;
            self.missed = true;
            self.queues.waiting.set(self.queues.waiting.get() + 1);
            self.board.publish(self.worker, best);
        }
    }

    /// The answer to a wait that ended with `why`.
    pub(crate) fn error(&self, why: WaitEnd) -> GatewayError {
        let (kind, message) = match why {
            WaitEnd::Expired => (
                ErrorKind::QueueTimeout,
                "Every upstream for this model stayed at capacity for as long as this request \
                 could wait; retry later.",
            ),
            WaitEnd::Shed => (
                ErrorKind::Shed,
                "This request was dropped from the wait queue for a request of a higher \
                 priority class; retry later.",
            ),
            WaitEnd::ClientLeft | WaitEnd::Shutdown => return why.left_error(),
        };
        let retry = queue_of(self.queues, self.board_addr, self.route, |q| {
            q.retry_after()
        });
        GatewayError::new(kind, message).with_retry_after(Some(retry.unwrap_or(1)))
    }

    fn leave(&mut self) {
        if !std::mem::take(&mut self.queued) {
            return;
        }
        let id = self.id;
        let left = queue_of(self.queues, self.board_addr, self.route, |q| {
            let at = q.entries.iter().position(|e| e.id == id)?;
            let e = q.entries.swap_remove(at);
            q.refresh_best();
            q.nudge_best();
            Some((e.shed, q.best))
        })
        .flatten();
        self.board.stats.left(self.class);
        if let Some((shed, best)) = left {
            if !shed {
                self.queues
                    .waiting
                    .set(self.queues.waiting.get().saturating_sub(1));
            }
            self.board.publish(self.worker, best);
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let waited = self
            .waited
            .unwrap_or_else(|| Mono::now().saturating_duration_since(self.joined_at));
        self.leave();
        self.board.stats.ended(self.class, self.outcome, waited);
    }
}

/// Resolves once the place is nudged (and clears the nudge).
struct Nudged<'a, 'q> {
    place: &'a Place<'q>,
}

impl Future for Nudged<'_, '_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let place = self.place;
        let ready = queue_of(place.queues, place.board_addr, place.route, |q| {
            let e = q.entries.iter_mut().find(|e| e.id == place.id)?;
            if std::mem::take(&mut e.nudged) {
                return Some(true);
            }
            match &e.waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => e.waker = Some(cx.waker().clone()),
            }
            Some(false)
        })
        .flatten();
        match ready {
            Some(false) => Poll::Pending,
            // Nudged, or gone from the queue: either way, look again.
            Some(true) | None => Poll::Ready(()),
        }
    }
}

/// The wait queue's metrics, written at the end of each scrape from the node-wide counters of
/// the current snapshot's board (see [`board::QueueStats`]): `sluice_queue_depth`,
/// `sluice_queue_total`, `sluice_queue_wait_seconds` per route and class, and per capped
/// backend its requests in flight from the process and its cap.
pub(crate) struct QueueMetrics {
    health: std::sync::Arc<crate::upstream::health::HealthTable>,
    classes: Vec<String>,
    /// (label, backend id, cap): the lowest `max_in_flight` of the targets it serves.
    capped: Vec<(String, usize, u32)>,
}

impl QueueMetrics {
    /// For `snapshot` (`None` without `[saturation]`).
    pub(crate) fn new(
        snapshot: &crate::config::Snapshot,
        health: &std::sync::Arc<crate::upstream::health::HealthTable>,
    ) -> Option<QueueMetrics> {
        let saturation = snapshot.saturation.as_ref()?;
        let mut capped: Vec<(String, usize, u32)> = Vec::new();
        let targets = snapshot
            .routes
            .iter()
            .flat_map(|r| &r.groups)
            .flat_map(|g| &g.targets);
        for t in targets {
            let (Some(cap), cluster) = (t.max_in_flight, &snapshot.clusters[t.cluster]) else {
                continue;
            };
            for b in &cluster.backends {
                match capped.iter_mut().find(|(_, id, _)| *id == b.id) {
                    Some(entry) => entry.2 = entry.2.min(cap),
                    None => capped.push((
                        crate::telemetry::metrics::backend_label(cluster, b),
                        b.id,
                        cap,
                    )),
                }
            }
        }
        Some(QueueMetrics {
            health: std::sync::Arc::clone(health),
            classes: saturation.classes.iter().map(|c| c.name.clone()).collect(),
            capped,
        })
    }
}

impl std::fmt::Debug for QueueMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueMetrics")
            .field("classes", &self.classes)
            .field("capped", &self.capped)
            .finish_non_exhaustive()
    }
}

impl crate::telemetry::metrics::Appendix for QueueMetrics {
    fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let Some(board) = self.health.board() else {
            return;
        };
        let label = |out: &mut String, key: &str, value: &str| {
            out.push_str(key);
            out.push_str("=\"");
            crate::telemetry::metrics::push_label_value(out, value);
            out.push('"');
        };
        let series = |out: &mut String, name: &str, route: &str, class: &str| {
            out.push_str(name);
            out.push('{');
            label(out, "route", route);
            out.push(',');
            label(out, "class", class);
        };
        out.push_str(
            "# HELP sluice_queue_depth Requests waiting for a backend with room, per route and \
             priority class.\n# TYPE sluice_queue_depth gauge\n",
        );
        for (route, stats) in board.stats() {
            for (c, class) in self.classes.iter().enumerate() {
                series(out, "sluice_queue_depth", route, class);
                let _ = writeln!(out, "}} {}", stats.depth(c));
            }
        }
        out.push_str(
            "# HELP sluice_queue_total Waits ended, by outcome: dispatched, expired, shed, \
             queue_full, client_left, shutdown.\n# TYPE sluice_queue_total counter\n",
        );
        for (route, stats) in board.stats() {
            for (c, class) in self.classes.iter().enumerate() {
                for (o, outcome) in QueueOutcome::ALL.iter().enumerate() {
                    series(out, "sluice_queue_total", route, class);
                    out.push(',');
                    label(out, "outcome", outcome.label());
                    let _ = writeln!(out, "}} {}", stats.outcome(c, o));
                }
            }
        }
        out.push_str(
            "# HELP sluice_queue_inversions_total Requests dispatched while a better waiter \
             (a higher class, or ahead in its fair share) waited on another worker.\n\
             # TYPE sluice_queue_inversions_total counter\n",
        );
        for (route, stats) in board.stats() {
            for (c, class) in self.classes.iter().enumerate() {
                series(out, "sluice_queue_inversions_total", route, class);
                let _ = writeln!(out, "}} {}", stats.inversions(c));
            }
        }
        out.push_str(
            "# HELP sluice_queue_wait_seconds How long requests waited in the queue, whatever \
             the outcome.\n# TYPE sluice_queue_wait_seconds histogram\n",
        );
        for (route, stats) in board.stats() {
            for (c, class) in self.classes.iter().enumerate() {
                let (buckets, sum_ns) = stats.waits(c);
                let mut total = 0;
                for (i, n) in buckets.iter().enumerate() {
                    total += n;
                    series(out, "sluice_queue_wait_seconds_bucket", route, class);
                    match board::WAIT_BUCKETS_MS.get(i) {
                        Some(ms) => {
                            let _ = writeln!(out, ",le=\"{}\"}} {total}", *ms as f64 / 1000.0);
                        }
                        None => {
                            let _ = writeln!(out, ",le=\"+Inf\"}} {total}");
                        }
                    }
                }
                series(out, "sluice_queue_wait_seconds_sum", route, class);
                let _ = writeln!(out, "}} {}", sum_ns as f64 / 1e9);
                series(out, "sluice_queue_wait_seconds_count", route, class);
                let _ = writeln!(out, "}} {total}");
            }
        }
        out.push_str(
            "# HELP sluice_backend_in_flight Requests the process has in flight to a capped \
             backend now.\n# TYPE sluice_backend_in_flight gauge\n",
        );
        for (name, id, _) in &self.capped {
            let n = self.health.get(*id).map_or(0, |h| h.load.in_flight());
            out.push_str("sluice_backend_in_flight{");
            label(out, "backend", name);
            let _ = writeln!(out, "}} {n}");
        }
        out.push_str(
            "# HELP sluice_backend_in_flight_cap The most requests the process sends a capped \
             backend at once.\n# TYPE sluice_backend_in_flight_cap gauge\n",
        );
        for (name, _, cap) in &self.capped {
            out.push_str("sluice_backend_in_flight_cap{");
            label(out, "backend", name);
            let _ = writeln!(out, "}} {cap}");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::telemetry::metrics::tests::parse_strict;
    use crate::telemetry::metrics::{Appendix, QUEUE_FAMILIES};

    /// The appendix writes exactly the families `QUEUE_FAMILIES` names (the dashboard and alert
    /// checks go by that list), as valid exposition, with the board's numbers.
    #[test]
    fn the_metrics_appendix_writes_the_listed_families_from_the_board() {
        let snapshot = crate::config::load(
            r#"
            [clusters.vllm]
            backends = [{ base_url = "http://127.0.0.1:9/v1" }]
            [[routes]]
            model = "*"
            groups = [{ targets = [{ cluster = "vllm", max_in_flight = 3 }] }]
            [saturation]
            classes = [{ name = "interactive" }, { name = "batch" }]
            "#,
            &|_| None,
        )
        .unwrap();
        let health =
            std::sync::Arc::new(crate::upstream::health::HealthTable::build(&snapshot, None));
        let stats = &health.board().unwrap().route(0).unwrap().stats;
        stats.joined(1);
        stats.joined(1);
        stats.left(1);
        stats.ended(1, QueueOutcome::Expired, Duration::from_millis(700));
        let _held = health
            .get(0)
            .unwrap()
            .begin(1, &snapshot.routing, Some(3))
            .unwrap();
        let metrics = QueueMetrics::new(&snapshot, &health).unwrap();
        let mut out = String::new();
        metrics.render(&mut out);
        let e = parse_strict(&out).unwrap_or_else(|err| panic!("{err}\n{out}"));
        let families: Vec<(&str, &str)> = e
            .families
            .iter()
            .map(|(n, k)| (n.as_str(), k.as_str()))
            .collect();
        let listed: Vec<(&str, &str)> = QUEUE_FAMILIES
            .iter()
            .map(|(n, k)| (*n, k.as_str()))
            .collect();
        assert_eq!(families, listed);
        let batch = [("route", "*"), ("class", "batch")];
        assert_eq!(e.get("sluice_queue_depth", &batch), Some(1.0));
        let expired = [("route", "*"), ("class", "batch"), ("outcome", "expired")];
        assert_eq!(e.get("sluice_queue_total", &expired), Some(1.0));
        assert_eq!(e.get("sluice_queue_wait_seconds_count", &batch), Some(1.0));
        assert_eq!(e.get("sluice_queue_wait_seconds_sum", &batch), Some(0.7));
        let le = [("route", "*"), ("class", "batch"), ("le", "0.5")];
        assert_eq!(e.get("sluice_queue_wait_seconds_bucket", &le), Some(0.0));
        let backend = [("backend", "vllm/127.0.0.1:9")];
        assert_eq!(e.get("sluice_backend_in_flight", &backend), Some(1.0));
        assert_eq!(e.get("sluice_backend_in_flight_cap", &backend), Some(3.0));
    }
}
