//! A worker's timed waits as one list of deadlines, and one task, the sweeper, that wakes them
//! when they come due: what a [`clock::Sleep`](super::clock::Sleep) on a worker thread waits
//! on instead of a runtime timer of its own.
//!
//! Why: every request waits with a limit where the runtime has to park it, at least for its
//! answer's head (`upstream_first_byte_ms`), and a monoio timer for that wait cost ~450
//! instructions a request: made and boxed, its deadline turned into the wheel's ticks (an
//! `Instant` subtraction), put in the wheel, taken out again when the answer comes first (as it
//! nearly always does), and the wheel's bookkeeping at every park. Here a wait is a slot in a
//! vector (its deadline and its task's waker), taken when it parks and given back when it ends,
//! ~200 instructions; the worker's one runtime timer is the sweeper's (perf/history/RESULTS-diary-2026-12.md, #15
//! thirteenth session).
//!
//! How: the list keeps `due`, the earliest deadline among its waits as of the last sweep, or a
//! registration since that came earlier. A wait that ends leaves `due` as it was — early, never
//! late: the sweeper then finds nothing due, and looks for the next. A registration earlier than
//! `due` lowers it and wakes the sweeper to set its timer again. The sweeper sleeps until `due`,
//! wakes every wait whose deadline has passed, and computes the next `due` from those left.
//!
//! What a sweep costs: a look at every slot (a few instructions each; twenty thousand took
//! ~30 µs on the development VM, best of 50). So the list takes only waits that nearly never
//! come due: those with [`SWEPT_FROM`] or more to go — a request's head, the answer's first
//! byte, a stalled read or write, whose limits are seconds to minutes and which end first.
//! Their sweeps are rare: the waits of one kind share a limit, so a new deadline lies after
//! those of its kind before it and lowers `due` only when a shorter kind arrives, and a sweep
//! that finds nothing due comes about once per the shortest limit in use, plus one per real
//! timeout. Shorter waits, which mostly do run out (a relay's 75 ms watch of the client comes
//! due on every quiet stream, ten thousand streams' watches fifty thousand times a second),
//! keep runtime timers: swept, they would have the sweeper look at every slot every
//! millisecond — but for a short wait a request takes once and that nearly never comes due,
//! which asks for a slot ([`register_short`], `clock::sleep_until_swept`): the client's watch
//! while an attempt waits for its answer (75 ms; the answer nearly always comes first, and one
//! that does not has the watch come due once). And sweeps are at least [`SWEEP_GAP`] apart, so
//! even a flood of timeouts (ten thousand slow clients' head waits) costs a bounded share of
//! the core.
//!
//! Precision: a swept wait ends within [`SWEEP_GAP`] after its deadline (the runtime timer's
//! millisecond beside), never before. Threads with no sweeper (tests, the control thread)
//! have no list: [`register`] says so, and their sleeps make runtime timers.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::mono::Mono;
use super::slab::Slab;

/// The least time to go for a wait to be swept: shorter ones keep runtime timers (see the
/// module's doc).
pub(crate) const SWEPT_FROM: Duration = Duration::from_secs(1);

/// The least time between two sweeps: at most 1% of [`SWEPT_FROM`] late.
pub(crate) const SWEEP_GAP: Duration = Duration::from_millis(10);

/// One thread's waits; see the module's doc.
struct Deadlines {
    /// A sweeper runs on this thread (waits may register).
    sweeping: bool,
    /// [`SWEPT_FROM`] and [`SWEEP_GAP`] (tests change them).
    swept_from: Duration,
    gap: Duration,
    /// A slot no wait holds is `State::Free`.
    slots: Slab<Slot>,
    /// No registered wait is due before this (`None`: none is registered, as of the last sweep).
    due: Option<Mono>,
    /// The sweeper's task, while it sleeps.
    sweeper: Option<Waker>,
    /// The wakers a sweep takes out, with their deadlines, woken once the list is no longer
    /// borrowed; kept for the next sweep.
    woken: Vec<(Mono, Waker)>,
}

struct Slot {
    deadline: Mono,
    /// Whom to wake when it comes due; taken when it does.
    waker: Option<Waker>,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Waiting,
    Fired,
    /// Left waiting when the sweeper stopped.
    Orphaned,
}

thread_local! {
    static DEADLINES: RefCell<Deadlines> = const {
        RefCell::new(Deadlines {
            sweeping: false,
            swept_from: SWEPT_FROM,
            gap: SWEEP_GAP,
            slots: Slab::new(),
            due: None,
            sweeper: None,
            woken: Vec::new(),
        })
    };
}

/// A wait registered until its deadline; gives its slot back when dropped. A thread's own
/// (its slot is in the thread's list): not `Send`.
#[derive(Debug)]
pub(crate) struct Wait {
    slot: usize,
    _thread_bound: PhantomData<*const ()>,
}

/// Where a registered wait stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Its deadline has passed.
    Due,
    /// Not yet; the waker polled with is the one the sweeper wakes.
    Waiting,
    /// The thread's sweeper stopped before the deadline came: nothing will wake it, so the
    /// waiter must time itself.
    Orphaned,
}

/// Register a wait until `deadline` (`now` being the time now, to within this poll) for the
/// task `waker` wakes; `None` on a thread with no sweeper, or for a wait shorter than
/// [`SWEPT_FROM`].
pub(crate) fn register(deadline: Mono, now: Mono, waker: &Waker) -> Option<Wait> {
    register_from(deadline, now, waker, None)
}

/// [`register`] a wait of any length (a sweeper still has to run on this thread): for a short
/// wait that nearly never comes due once per task, where a runtime timer would cost more than
/// a slot (the client's watch while an attempt waits for its answer).
pub(crate) fn register_short(deadline: Mono, now: Mono, waker: &Waker) -> Option<Wait> {
    register_from(deadline, now, waker, Some(Duration::ZERO))
}

/// [`register`], with `swept_from` in place of the thread's.
fn register_from(
    deadline: Mono,
    now: Mono,
    waker: &Waker,
    swept_from: Option<Duration>,
) -> Option<Wait> {
    let (slot, sweeper) = DEADLINES
        .try_with(|d| {
            let mut d = d.try_borrow_mut().ok()?;
            let swept_from = swept_from.unwrap_or(d.swept_from);
            if !d.sweeping || deadline.saturating_duration_since(now) < swept_from {
                return None;
            }
            let entry = Slot {
                deadline,
                waker: Some(waker.clone()),
                state: State::Waiting,
            };
            let slot = d.slots.insert(entry);
            let sooner = d.due.is_none_or(|due| deadline < due);
            if sooner {
                d.due = Some(deadline);
            }
            Some((slot, sooner.then(|| d.sweeper.take()).flatten()))
        })
        .ok()
        .flatten()?;
    // Woken outside the borrow: a waker is the runtime's code.
    if let Some(sweeper) = sweeper {
        sweeper.wake();
    }
    Some(Wait {
        slot,
        _thread_bound: PhantomData,
    })
}

impl Wait {
    /// Has the deadline passed? While not, `cx`'s waker is the one to wake.
    pub(crate) fn poll(&self, cx: &Context<'_>) -> Standing {
        let (standing, replaced) = DEADLINES
            .try_with(|d| {
                let mut d = d.try_borrow_mut().ok()?;
                let slot = d.slots.get_mut(self.slot)?;
                Some(match slot.state {
                    State::Fired => (Standing::Due, None),
                    State::Waiting => {
                        let replaced = match &slot.waker {
                            Some(w) if w.will_wake(cx.waker()) => None,
                            _ => slot.waker.replace(cx.waker().clone()),
                        };
                        (Standing::Waiting, replaced)
                    }
                    State::Orphaned | State::Free => (Standing::Orphaned, None),
                })
            })
            .ok()
            .flatten()
            .unwrap_or((Standing::Orphaned, None));
        // Dropped outside the borrow: dropping a task's last waker may drop the task, and with
        // it waits of its own.
        drop(replaced);
        standing
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        let waker = DEADLINES
            .try_with(|d| {
                let mut d = d.try_borrow_mut().ok()?;
                let slot = d.slots.get_mut(self.slot)?;
                slot.state = State::Free;
                let waker = slot.waker.take();
                d.slots.give_back(self.slot);
                waker
            })
            .ok()
            .flatten();
        drop(waker);
    }
}

/// Run this thread's sweeper: once it first runs, [`register`] takes waits here (sleeps made
/// before that keep runtime timers). Spawn it once per worker, first; it runs until the runtime
/// drops it. Its waits, if any are left then, time themselves ([`Standing::Orphaned`]).
pub(crate) async fn run_sweeper() {
    let _sweeping = Sweeping::start();
    // The runtime timer and the deadline it was set for.
    let mut timer: Option<(Mono, Pin<Box<monoio::time::Sleep>>)> = None;
    let mut last_sweep: Option<Mono> = None;
    loop {
        // Until `due` (or a registration lowers it), no sooner than the gap after the last
        // sweep; then the time to sweep at: the timer's deadline once it fired, as the runtime
        // counts in whole milliseconds and may fire a moment before a nanosecond reading gets
        // there.
        let now = poll_fn(|cx| {
            let (due, gap) = DEADLINES.with_borrow_mut(|d| {
                match &d.sweeper {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => d.sweeper = Some(cx.waker().clone()),
                }
                (d.due, d.gap)
            });
            let Some(due) = due else {
                timer = None;
                return Poll::Pending;
            };
            let due = last_sweep.map_or(due, |last| due.max(last + gap));
            let now = Mono::now();
            if due <= now {
                return Poll::Ready(now);
            }
            let sleep = match &mut timer {
                Some((set_for, sleep)) if *set_for == due => sleep,
                _ => {
                    let at = monoio::time::Instant::from_std(due.to_instant());
                    &mut timer
                        .insert((due, Box::pin(monoio::time::sleep_until(at))))
                        .1
                }
            };
            sleep.as_mut().poll(cx).map(|()| due.max(now))
        })
        .await;
        last_sweep = Some(now);
        let mut woken = DEADLINES.with_borrow_mut(|d| d.sweep(now));
        for (_, waker) in woken.drain(..) {
            waker.wake();
        }
        // The buffer back, for the next sweep.
        DEADLINES.with_borrow_mut(|d| {
            if d.woken.capacity() < woken.capacity() {
                d.woken = woken;
            }
        });
    }
}

impl Deadlines {
    /// Mark every wait due at `now` fired and take out its waker (returned, to wake once the
    /// list is not borrowed), earliest deadline first: waits a late sweep ends together run in
    /// the order they came due. `due` becomes the earliest deadline of those left.
    fn sweep(&mut self, now: Mono) -> Vec<(Mono, Waker)> {
        let mut woken = std::mem::take(&mut self.woken);
        let mut next: Option<Mono> = None;
        for slot in self.slots.iter_mut() {
            if slot.state != State::Waiting {
                continue;
            }
            if slot.deadline <= now {
                slot.state = State::Fired;
                woken.extend(slot.waker.take().map(|w| (slot.deadline, w)));
            } else if next.is_none_or(|n| slot.deadline < n) {
                next = Some(slot.deadline);
            }
        }
        woken.sort_unstable_by_key(|&(deadline, _)| deadline);
        self.due = next;
        woken
    }
}

/// While the sweeper runs: waits may register. When it is dropped (its runtime ending), the
/// waits left are told so when next polled.
struct Sweeping;

impl Sweeping {
    fn start() -> Sweeping {
        DEADLINES.with_borrow_mut(|d| d.sweeping = true);
        Sweeping
    }
}

impl Drop for Sweeping {
    fn drop(&mut self) {
        let wakers: Vec<Waker> = DEADLINES
            .try_with(|d| {
                let mut d = d.try_borrow_mut().ok()?;
                d.sweeping = false;
                d.due = None;
                d.sweeper = None;
                let mut wakers = Vec::new();
                for slot in d.slots.iter_mut().filter(|s| s.state == State::Waiting) {
                    slot.state = State::Orphaned;
                    wakers.extend(slot.waker.take());
                }
                Some(wakers)
            })
            .ok()
            .flatten()
            .unwrap_or_default();
        // Woken to find themselves orphaned, and time themselves.
        for waker in wakers {
            waker.wake();
        }
    }
}

/// How many waits are registered on this thread, and how many slots it has made.
#[cfg(test)]
fn registered() -> (usize, usize) {
    DEADLINES.with_borrow(|d| d.slots.counts())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::sys::clock::{self, Elapsed};
    use crate::sys::testing::block_on;
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::time::{Duration, Instant};

    /// Swept from `from` to go, sweeps at least `gap` apart, on this test's thread.
    fn sweep_with(from: Duration, gap: Duration) {
        DEADLINES.with_borrow_mut(|d| {
            d.swept_from = from;
            d.gap = gap;
        });
    }

    /// Spawn the sweeper and let it run once, as a worker does before its connections; every
    /// wait is swept, with no gap between sweeps, unless the test says otherwise.
    async fn start_sweeper() {
        sweep_with(Duration::ZERO, Duration::ZERO);
        monoio::spawn(run_sweeper());
        // Parked, so the runtime runs its other tasks.
        monoio::time::sleep(Duration::from_millis(1)).await;
        assert!(DEADLINES.with_borrow(|d| d.sweeping), "the sweeper runs");
    }

    /// Poll `f` once, in the calling task.
    async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
    }

    #[test]
    fn a_parked_wait_takes_a_slot_and_ends_at_its_deadline_not_before() {
        block_on(async {
            start_sweeper().await;
            let started = Instant::now();
            let mut cut = Box::pin(clock::timeout(
                Duration::from_millis(30),
                std::future::pending::<()>(),
            ));
            assert_eq!(poll_once(&mut cut).await, Poll::Pending);
            assert_eq!(
                registered(),
                (1, 1),
                "parked on the list, not a runtime timer"
            );
            assert_eq!(cut.await, Err(Elapsed));
            let waited = started.elapsed();
            assert!(waited >= Duration::from_millis(30), "{waited:?}");
            assert!(waited < Duration::from_secs(5), "{waited:?}");
            assert_eq!(registered(), (0, 1), "its slot given back");
        });
    }

    #[test]
    fn deadlines_come_due_in_their_order_whatever_the_order_they_came_in() {
        block_on(async {
            start_sweeper().await;
            let ended = Rc::new(RefCell::new(Vec::new()));
            let started = Instant::now();
            let tasks: Vec<_> = [60u64, 10, 35]
                .into_iter()
                .map(|ms| {
                    let ended = Rc::clone(&ended);
                    monoio::spawn(async move {
                        clock::sleep(Duration::from_millis(ms)).await;
                        ended.borrow_mut().push((ms, started.elapsed()));
                    })
                })
                .collect();
            for task in tasks {
                task.await;
            }
            let ended = ended.borrow();
            let order: Vec<u64> = ended.iter().map(|&(ms, _)| ms).collect();
            assert_eq!(order, [10, 35, 60]);
            for &(ms, at) in ended.iter() {
                assert!(at >= Duration::from_millis(ms), "{ms} ms ended at {at:?}");
            }
            assert_eq!(registered().0, 0);
        });
    }

    #[test]
    fn a_deadline_sooner_than_any_registered_wakes_the_sweeper_to_time_it() {
        block_on(async {
            start_sweeper().await;
            // The sweeper sleeps towards the long wait's deadline...
            let mut long = Box::pin(clock::sleep(Duration::from_secs(10)));
            assert_eq!(poll_once(&mut long).await, Poll::Pending);
            // ...and a shorter one registered after it still ends on time.
            let started = Instant::now();
            clock::sleep(Duration::from_millis(20)).await;
            let waited = started.elapsed();
            assert!(waited >= Duration::from_millis(20), "{waited:?}");
            assert!(waited < Duration::from_secs(5), "{waited:?}");
            assert_eq!(registered().0, 1, "the long wait is still registered");
            drop(long);
            assert_eq!(registered().0, 0);
        });
    }

    #[test]
    fn waits_that_end_first_give_their_slots_back_for_the_next() {
        block_on(async {
            start_sweeper().await;
            for _ in 0..100 {
                // Parks once (on the runtime's own timer), well within its limit.
                let quick = monoio::time::sleep(Duration::from_micros(100));
                assert_eq!(clock::timeout(Duration::from_secs(60), quick).await, Ok(()));
            }
            assert_eq!(
                registered(),
                (0, 1),
                "one slot, reused by each wait in turn"
            );
        });
    }

    #[test]
    fn only_waits_with_long_enough_to_go_are_swept() {
        block_on(async {
            start_sweeper().await;
            sweep_with(Duration::from_millis(500), Duration::ZERO);
            let mut short = Box::pin(clock::sleep(Duration::from_millis(100)));
            assert_eq!(poll_once(&mut short).await, Poll::Pending);
            assert_eq!(registered().0, 0, "a runtime timer");
            let mut long = Box::pin(clock::sleep(Duration::from_secs(5)));
            assert_eq!(poll_once(&mut long).await, Poll::Pending);
            assert_eq!(registered().0, 1, "swept");
            // A short wait asked for as swept is swept, and still ends at its deadline.
            let started = Instant::now();
            let deadline = clock::recent() + Duration::from_millis(20);
            let mut asked = Box::pin(clock::sleep_until_swept(deadline));
            assert_eq!(poll_once(&mut asked).await, Poll::Pending);
            assert_eq!(registered().0, 2, "swept however short");
            asked.await;
            assert!(started.elapsed() >= Duration::from_millis(15));
            short.await;
        });
    }

    #[test]
    fn sweeps_are_at_least_the_gap_apart() {
        block_on(async {
            start_sweeper().await;
            sweep_with(Duration::ZERO, Duration::from_millis(60));
            let started = Instant::now();
            // A sweep ends the first wait, at its deadline or after...
            clock::sleep(Duration::from_millis(10)).await;
            // ...so a wait registered after it comes due after that sweep, and its own sweep
            // waits out the gap: not before 10 + 60 ms from the start (5 ms later without it).
            clock::sleep(Duration::from_millis(5)).await;
            let waited = started.elapsed();
            assert!(waited >= Duration::from_millis(70), "{waited:?}");
        });
    }

    #[test]
    fn a_deadline_already_past_takes_no_slot() {
        block_on(async {
            start_sweeper().await;
            let mut past = Box::pin(clock::sleep(Duration::ZERO));
            assert_eq!(poll_once(&mut past).await, Poll::Ready(()));
            assert_eq!(registered(), (0, 0));
        });
    }

    #[test]
    fn waits_left_when_the_sweeper_stops_time_themselves() {
        block_on(async {
            sweep_with(Duration::ZERO, Duration::ZERO);
            let mut sweeper = Box::pin(run_sweeper());
            assert_eq!(poll_once(&mut sweeper).await, Poll::Pending);
            let started = Instant::now();
            let mut cut = Box::pin(clock::timeout(
                Duration::from_millis(30),
                std::future::pending::<()>(),
            ));
            assert_eq!(poll_once(&mut cut).await, Poll::Pending);
            assert_eq!(registered().0, 1);
            drop(sweeper);
            assert!(!DEADLINES.with_borrow(|d| d.sweeping));
            // Nothing sweeps now: the wait makes a runtime timer, and still ends on time.
            assert_eq!(cut.await, Err(Elapsed));
            let waited = started.elapsed();
            assert!(waited >= Duration::from_millis(30), "{waited:?}");
            assert!(waited < Duration::from_secs(5), "{waited:?}");
            assert_eq!(registered().0, 0);
        });
    }
}
