//! Waiting for room under a key's limits: a policy with `on_limit = "queue"` makes a request over
//! it wait — like nginx's `limit_req` with a `burst` and no `nodelay` — instead of a 429.
//!
//! Runs in admission, only for a request an `on_limit = "queue"` policy refused. [`join`] takes
//! the policy's lane (its counter: one for a global policy, one per key, entity or model for the
//! others), the request's class and its longest wait, and returns a [`LimitPlace`]; each worker
//! keeps its waiters per lane, highest class first, then in arrival order. Only a lane's head
//! tries admission again — when a request on the worker ends (a concurrency slot may be free)
//! and every [`POLL`] (a window refilled, another worker gave its lease back) — so a lane's
//! requests are admitted in order and a waiting key costs one admission try per poll, not one
//! per waiter. The limits keep every bound they have: a try is an ordinary admission, against
//! the same shard and, when synced, the same Redis ledger. [`LimitPlace::turn`] ends the wait
//! at the deadline (the pipeline answers the policy's 429, code `rate_limit_queue_timeout`),
//! when the client leaves (499) or when the worker stops (503).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::{WaitEnd, WaitQueues, LEFT_POLL};
use crate::sys::client::ClientSocket;
use crate::sys::clock::{self, Mono};
use crate::upstream::board::{self, QueueOutcome, QueueStats};

/// How often a lane's head tries admission again with no nudge.
pub(crate) const POLL: Duration = Duration::from_millis(10);

/// One waiter.
pub(crate) struct LimitEntry {
    id: u64,
    /// The refusing policy and its counter's subject.
    lane: (usize, u64),
    /// `class << 56 | arrival`: lower goes first.
    rank: u64,
    nudged: bool,
    waker: Option<Waker>,
}

impl LimitEntry {
    pub(super) fn nudge(&mut self) {
        self.nudged = true;
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// Nudge each lane's head: room may have freed (a request on this worker ended).
pub(super) fn nudge_heads(entries: &mut [LimitEntry]) {
    for i in 0..entries.len() {
        let (lane, rank) = (entries[i].lane, entries[i].rank);
        if !entries.iter().any(|e| e.lane == lane && e.rank < rank) {
            entries[i].nudge();
        }
    }
}

/// A request's place in its lane. Dropped, it leaves.
pub(crate) struct LimitPlace<'q> {
    queues: &'q WaitQueues,
    stats: Option<&'q QueueStats>,
    id: u64,
    lane: (usize, u64),
    rank: u64,
    class: u8,
    pub(crate) joined_at: Mono,
    deadline: Mono,
    /// The last try found no room: wait for a nudge or a poll first.
    missed: bool,
    queued: bool,
    outcome: QueueOutcome,
}

/// Join `lane`'s waiters with `class`, for at most `max_wait`; `None` when the worker's queues
/// are full (the request is refused as the policy would refuse it). `stats` counts the wait
/// (the route's queue counters).
pub(crate) fn join<'q>(
    queues: &'q WaitQueues,
    stats: Option<&'q QueueStats>,
    max_queued: usize,
    lane: (usize, u64),
    class: u8,
    max_wait: Duration,
) -> Option<LimitPlace<'q>> {
    if queues.waiting.get() >= max_queued {
        if let Some(s) = stats {
            s.ended(class, QueueOutcome::Full, Duration::ZERO);
        }
        return None;
    }
    let id = queues.next_id.get();
    queues.next_id.set(id + 1);
    queues.waiting.set(queues.waiting.get() + 1);
    let rank = board::rank_of(class, id);
    queues.limit.borrow_mut().push(LimitEntry {
        id,
        lane,
        rank,
        nudged: false,
        waker: None,
    });
    if let Some(s) = stats {
        s.joined(class);
    }
    let joined_at = Mono::now();
    Some(LimitPlace {
        queues,
        stats,
        id,
        lane,
        rank,
        class,
        joined_at,
        deadline: joined_at + max_wait,
        missed: true,
        queued: true,
        outcome: QueueOutcome::Dispatched,
    })
}

impl LimitPlace<'_> {
    /// Wait until this request is its lane's head and should try admission again: see the
    /// module doc.
    pub(crate) async fn turn(
        &mut self,
        client: &ClientSocket,
        draining: &dyn Fn() -> bool,
    ) -> Result<(), WaitEnd> {
        let left = client.left(LEFT_POLL);
        let mut left = std::pin::pin!(left);
        let end = loop {
            if draining() {
                self.queues.nudge_all();
                break WaitEnd::Shutdown;
            }
            let now = Mono::now();
            if now >= self.deadline {
                break WaitEnd::Expired;
            }
            let head = self.is_head();
            if head && !self.missed {
                return Ok(());
            }
            self.missed = false;
            let until = if head {
                self.deadline.min(now + POLL)
            } else {
                self.deadline
            };
            monoio::select! {
                () = Nudged { place: self } => {}
                () = clock::sleep_until(until) => {}
                () = &mut left => break WaitEnd::ClientLeft,
            }
        };
        self.outcome = end.outcome();
        Err(end)
    }

    fn is_head(&self) -> bool {
        let entries = self.queues.limit.borrow();
        !entries
            .iter()
            .any(|e| e.lane == self.lane && e.rank < self.rank)
    }

    /// The try found no room: wait for the next nudge or poll.
    pub(crate) fn missed(&mut self) {
        self.missed = true;
    }

    /// How the wait ended, as `sluice_queue_total` and the access log name it.
    pub(crate) fn outcome(&self) -> &'static str {
        self.outcome.label()
    }

    /// Admitted: out of the lane, whose next waiter is its head.
    pub(crate) fn admitted(&mut self) {
        self.leave();
    }

    fn leave(&mut self) {
        if !std::mem::take(&mut self.queued) {
            return;
        }
        let mut entries = self.queues.limit.borrow_mut();
        if let Some(at) = entries.iter().position(|e| e.id == self.id) {
            entries.swap_remove(at);
        }
        nudge_heads(&mut entries);
        self.queues
            .waiting
            .set(self.queues.waiting.get().saturating_sub(1));
        if let Some(s) = self.stats {
            s.left(self.class);
        }
    }
}

impl Drop for LimitPlace<'_> {
    fn drop(&mut self) {
        let waited = Mono::now().saturating_duration_since(self.joined_at);
        self.leave();
        if let Some(s) = self.stats {
            s.ended(self.class, self.outcome, waited);
        }
    }
}

/// Resolves once the place is nudged (and clears the nudge).
struct Nudged<'a, 'q> {
    place: &'a LimitPlace<'q>,
}

impl Future for Nudged<'_, '_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let id = self.place.id;
        let mut entries = self.place.queues.limit.borrow_mut();
        let Some(e) = entries.iter_mut().find(|e| e.id == id) else {
            return Poll::Ready(());
        };
        if std::mem::take(&mut e.nudged) {
            return Poll::Ready(());
        }
        match &e.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => e.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}
