//! The monotonic clock as a worker reads it: at most once per wake-up of a connection's task.
//!
//! A request used to read the clock about 27 times (deadlines, timeouts, pool ages, health
//! windows, timings), each a vDSO call of ~25 ns: 0.7 µs of a 1 KB request. Nearly all of those
//! readings are taken within microseconds of each other, in one synchronous run of the task
//! between two waits, where any of them would do. So a task wrapped in [`Stamped`] reads the
//! clock lazily, the first time something asks for it in a poll, and every later [`recent`] in
//! that poll gets the same reading; the next poll (the task woke: an I/O or a timer fired)
//! starts fresh. Outside a stamped poll (other tasks, tests) [`recent`] is simply a fresh read,
//! so a stale reading can never leak from one wake-up to the next.
//!
//! What measures a span within one poll calls [`now`], which reads afresh and becomes the
//! poll's reading from then on: the gateway's own work (the overhead figures), and the moment
//! an I/O finished (an upstream head, a stream's read). An await is not always a wake-up: on
//! epoll a read can finish without the task waiting, so the poll's reading may predate it. The wall clock
//! ([`since_epoch`]: key expiry, limit windows, the access log's timestamps) is read the same
//! way, once per stamped poll.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use super::deadlines::{self, Standing, Wait};
pub use super::mono::Mono;
use super::spare::SpareBox;

/// Whether a stamped poll is running, and the readings it has taken (`Some`): the monotonic
/// clock's and the wall clock's.
struct PollClock {
    stamped: Cell<bool>,
    reading: Cell<Option<Mono>>,
    wall: Cell<Option<Duration>>,
}

thread_local! {
    static POLL: PollClock = const {
        PollClock {
            stamped: Cell::new(false),
            reading: Cell::new(None),
            wall: Cell::new(None),
        }
    };
}

/// The time now, to within this poll's run: the reading already taken in this poll of a
/// [`Stamped`] task, or a fresh one (kept for the rest of the poll when stamped).
pub(crate) fn recent() -> Mono {
    once_per_poll(|p| &p.reading, Mono::now)
}

/// What `slot` holds in this stamped poll, or a fresh reading from `read`, kept in `slot` for
/// the rest of the poll when stamped.
fn once_per_poll<T: Copy>(
    slot: impl Fn(&PollClock) -> &Cell<Option<T>>,
    read: impl FnOnce() -> T,
) -> T {
    POLL.with(|p| {
        let cell = slot(p);
        if let Some(t) = cell.get() {
            return t;
        }
        let t = read();
        if p.stamped.get() {
            cell.set(Some(t));
        }
        t
    })
}

/// A fresh reading, for a measurement that must include the work done so far in this poll;
/// it is also what [`recent`] returns from now on in this poll. The poll's wall-clock reading
/// is dropped with it, so the two never drift apart (the access log puts one against the
/// other).
pub(crate) fn now() -> Mono {
    let t = Mono::now();
    POLL.with(|p| {
        if p.stamped.get() {
            p.reading.set(Some(t));
            p.wall.set(None);
        }
    });
    t
}

/// The wall clock's time since the Unix epoch (zero for a clock set before 1970), read once per
/// stamped poll like [`recent`].
pub(crate) fn since_epoch() -> Duration {
    once_per_poll(
        |p| &p.wall,
        || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or(Duration::ZERO)
        },
    )
}

/// `future`, cut off `limit` after [`recent`]: monoio's own `timeout` reads the clock for
/// every wait. The timer is made only if `future` has to wait (see [`Sleep`]).
pub(crate) fn timeout<F: Future>(limit: Duration, future: F) -> Timeout<F> {
    timeout_until(deadline(limit), future)
}

/// `future`, cut off at `deadline` (see [`timeout`]).
pub(crate) fn timeout_until<F: Future>(deadline: Mono, future: F) -> Timeout<F> {
    Timeout {
        inner: future,
        expiry: sleep_until(deadline),
    }
}

/// Resolves `limit` after [`recent`]; see [`Sleep`].
pub(crate) fn sleep(limit: Duration) -> Sleep {
    sleep_until(deadline(limit))
}

/// Resolves at `deadline`; see [`Sleep`].
pub(crate) fn sleep_until(deadline: Mono) -> Sleep {
    Sleep {
        deadline,
        timer: Timer::Unset,
    }
}

/// Resolves at `deadline`, within the sweeper's precision ([`SWEEP_GAP`](super::deadlines::
/// SWEEP_GAP) late at most) however near it is: a slot in the worker's list of deadlines, not
/// a runtime timer. For a short wait a task takes once and that nearly never comes due (the
/// client's watch while an attempt waits for its answer); see [`deadlines`](super::deadlines).
pub(crate) fn sleep_until_swept(deadline: Mono) -> Sleep {
    Sleep {
        deadline,
        timer: Timer::UnsetShort,
    }
}

/// The limit of a [`timeout`] passed before its future finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// A wait until a deadline, which takes its timer the first time it is polled: on a worker,
/// for a wait with [`SWEPT_FROM`](super::deadlines::SWEPT_FROM) or more to go, a slot in the
/// worker's list of deadlines ([`deadlines`](super::deadlines), woken by the worker's sweeper);
/// otherwise (a shorter wait, tests, the control thread), a runtime timer on the heap.
///
/// Either way the future itself is 24 bytes. monoio's `Sleep` is 640 bytes aligned to 128: its
/// timer entry is cache-padded, for the threads tokio's design (which it comes from) shares
/// entries between, which a monoio worker never does. Held inline, one per timed wait, it made
/// every future around a wait that large and that aligned: a request's future grew past 10 KB,
/// mostly timers and padding, and each level of it is copied into its parent when awaited. A
/// [`Timeout`] polls its `Sleep` only once its future has to wait, so the reads and writes that
/// finish at once (most of them, on a busy connection) take no timer at all; a deadline already
/// past when first polled takes none either. A runtime timer's cell is reused ([`SpareBox`]):
/// an allocation aligned to 128 takes mimalloc's slow path, ~300 instructions. Dropping the
/// sleep gives its slot back, or takes its timer out of the runtime's wheel.
#[must_use = "futures do nothing unless you .await or poll them"]
pub(crate) struct Sleep {
    /// As the worker reads the clock; made the runtime's `Instant` only for a runtime timer.
    deadline: Mono,
    timer: Timer,
}

#[cfg(test)]
impl Sleep {
    /// The cell of its runtime timer, if it made one.
    fn runtime_cell(&self) -> Option<*const monoio::time::Sleep> {
        match &self.timer {
            Timer::Runtime(timer) => Some(timer.cell()),
            _ => None,
        }
    }
}

/// What a [`Sleep`] waits on.
enum Timer {
    /// Nothing yet: not polled.
    Unset,
    /// Nothing yet, and swept however short ([`sleep_until_swept`]).
    UnsetShort,
    /// A slot in this worker's list of deadlines.
    Swept(Wait),
    /// The runtime's own timer: a short wait, or no sweeper runs on this thread (or it
    /// stopped).
    Runtime(SpareBox<monoio::time::Sleep>),
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.deadline;
        loop {
            match &mut self.timer {
                Timer::Swept(wait) => match wait.poll(cx) {
                    Standing::Due => return Poll::Ready(()),
                    Standing::Waiting => return Poll::Pending,
                    Standing::Orphaned => self.timer = Timer::Unset,
                },
                Timer::Runtime(timer) => return Pin::new(timer).poll(cx),
                Timer::Unset | Timer::UnsetShort => {
                    let now = recent();
                    if deadline <= now {
                        return Poll::Ready(());
                    }
                    let registered = match self.timer {
                        Timer::UnsetShort => deadlines::register_short(deadline, now, cx.waker()),
                        _ => deadlines::register(deadline, now, cx.waker()),
                    };
                    self.timer = match registered {
                        Some(wait) => Timer::Swept(wait),
                        None => {
                            let at = monoio::time::Instant::from_std(deadline.to_instant());
                            Timer::Runtime(SpareBox::new(monoio::time::sleep_until(at)))
                        }
                    };
                }
            }
        }
    }
}

/// [`timeout`]'s future: `inner`'s output, or [`Elapsed`].
#[must_use = "futures do nothing unless you .await or poll them"]
pub(crate) struct Timeout<F> {
    inner: F,
    expiry: Sleep,
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // SAFETY: only `inner` is used as pinned, and it is never moved out of `self`;
        // `expiry` is `Unpin` (its timer is pinned in its own box).
        let this = unsafe { self.get_unchecked_mut() };
        // SAFETY: `inner` is pinned with `self` (above).
        let inner = unsafe { Pin::new_unchecked(&mut this.inner) };
        if let Poll::Ready(out) = inner.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        match Pin::new(&mut this.expiry).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// When a wait of `limit` from this poll's reading ends (a limit too large to add — a
/// configured "never" — ends at the end of the clock's range, centuries ahead).
pub(crate) fn deadline(limit: Duration) -> Mono {
    recent() + limit
}

/// A task whose polls share one clock reading each (see the module comment).
pub(crate) struct Stamped<F> {
    inner: F,
}

impl<F> Stamped<F> {
    pub(crate) fn new(inner: F) -> Self {
        Stamped { inner }
    }
}

impl<F: Future> Future for Stamped<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `inner` is pinned with `self` and never moved out of it.
        let inner = unsafe { self.map_unchecked_mut(|s| &mut s.inner) };
        // A stamped poll inside another (not done today) gets its own reading and gives the
        // outer one back.
        let _restore =
            Restore(POLL.with(|p| (p.stamped.replace(true), p.reading.take(), p.wall.take())));
        inner.poll(cx)
    }
}

/// What was there before a stamped poll, put back when it ends, even by a panic (which would
/// otherwise leave the thread with a frozen reading).
struct Restore((bool, Option<Mono>, Option<Duration>));

impl Drop for Restore {
    fn drop(&mut self) {
        let (stamped, reading, wall) = self.0;
        POLL.with(|p| {
            p.stamped.set(stamped);
            p.reading.set(reading);
            p.wall.set(wall);
        });
    }
}

#[cfg(test)]
// Plain unit tests on the test thread, no worker: sleeping is how time passes between polls.
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::task::Waker;
    use std::time::Instant;

    /// Poll `f` once in a stamped poll.
    fn poll_stamped<T>(f: impl Future<Output = T>) -> Poll<T> {
        let mut task = std::pin::pin!(Stamped::new(f));
        task.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn a_mono_reading_is_the_instant_read_at_the_same_moment() {
        let before = Instant::now();
        let reading = Mono::now();
        let after = Instant::now();
        // The anchor pair was read back to back, at most a preemption apart.
        let slack = Duration::from_millis(100);
        let at = reading.to_instant();
        assert!(
            at + slack >= before && at <= after + slack,
            "{before:?} {at:?} {after:?}"
        );
        // A span is the same span on both: the runtime's timers see the deadlines we compute.
        let later = reading + Duration::from_millis(1500);
        assert_eq!(
            later.to_instant().saturating_duration_since(at),
            Duration::from_millis(1500)
        );
        let earlier = Mono::from_nanos(reading.as_nanos() - 2_000_000);
        assert_eq!(
            at.saturating_duration_since(earlier.to_instant()),
            Duration::from_millis(2)
        );
        // Both move with the one clock.
        std::thread::sleep(Duration::from_millis(3));
        let (i, m) = (Instant::now(), Mono::now());
        let by_instant = i.saturating_duration_since(before);
        let by_mono = m.saturating_duration_since(reading);
        assert!(by_mono >= Duration::from_millis(3));
        assert!(
            by_mono.abs_diff(by_instant) < slack,
            "{by_mono:?} {by_instant:?}"
        );
    }

    #[test]
    fn mono_arithmetic_is_exact_and_saturates_where_instant_would_panic() {
        let t = Mono::from_nanos(1_234_567_891);
        assert_eq!(t + Duration::new(2, 5), Mono::from_nanos(3_234_567_896));
        assert_eq!(
            Mono::from_nanos(3_234_567_896).saturating_duration_since(t),
            Duration::new(2, 5)
        );
        assert_eq!(
            t.saturating_duration_since(Mono::from_nanos(1_234_567_892)),
            Duration::ZERO
        );
        assert_eq!(t.checked_add(Duration::MAX), None);
        assert_eq!(
            Mono::from_nanos(u64::MAX - 1).checked_add(Duration::from_nanos(2)),
            None
        );
        assert_eq!(t + Duration::MAX, Mono::from_nanos(u64::MAX));
        // Zero is not a reading: it is taken as the first nanosecond, so `None` has room.
        assert_eq!(Mono::from_nanos(0), Mono::from_nanos(1));
        assert_eq!(std::mem::size_of::<Option<Mono>>(), 8);
        // A configured "never" still makes a deadline the timers can take.
        let far = (Mono::now() + Duration::MAX).to_instant();
        assert!(far > Instant::now() + Duration::from_secs(86_400 * 365));
    }

    #[test]
    fn a_stamped_poll_reads_the_clock_once_and_now_moves_it_on() {
        let Poll::Ready((first, second, fresh, after)) = poll_stamped(async {
            let first = recent();
            std::thread::sleep(Duration::from_millis(2));
            let second = recent();
            let fresh = now();
            (first, second, fresh, recent())
        }) else {
            panic!("the future is ready at once");
        };
        assert_eq!(first, second, "one reading per poll");
        assert!(
            fresh >= first + Duration::from_millis(2),
            "now() reads afresh"
        );
        assert_eq!(after, fresh, "and becomes the poll's reading");
    }

    #[test]
    fn no_reading_outlives_its_poll() {
        let Poll::Ready((inside, wall)) = poll_stamped(async {
            let first = (recent(), since_epoch());
            std::thread::sleep(Duration::from_millis(2));
            assert_eq!(since_epoch(), first.1, "one wall reading per poll");
            first
        }) else {
            panic!("ready at once");
        };
        std::thread::sleep(Duration::from_millis(2));
        // Outside any stamped poll: fresh.
        assert!(recent() >= inside + Duration::from_millis(4));
        assert!(since_epoch() >= wall + Duration::from_millis(4));
        // The next stamped poll starts without a reading.
        let Poll::Ready((next, next_wall)) = poll_stamped(async { (recent(), since_epoch()) })
        else {
            panic!("ready at once");
        };
        assert!(next >= inside + Duration::from_millis(4));
        assert!(next_wall >= wall + Duration::from_millis(4));
    }

    #[test]
    fn now_takes_a_new_wall_reading_with_it() {
        let Poll::Ready((before, after)) = poll_stamped(async {
            let before = since_epoch();
            std::thread::sleep(Duration::from_millis(2));
            now();
            (before, since_epoch())
        }) else {
            panic!("ready at once");
        };
        assert!(after >= before + Duration::from_millis(2));
    }

    #[test]
    fn a_timeout_whose_future_is_ready_makes_no_timer() {
        // No runtime here: making monoio's timer outside one would panic, so this also shows
        // the timer is not made.
        let mut wait = std::pin::pin!(timeout(Duration::ZERO, async { 7 }));
        let polled = wait.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        assert_eq!(polled, Poll::Ready(Ok(7)));
        assert!(matches!(wait.expiry.timer, Timer::Unset));
    }

    #[test]
    fn a_timeout_ends_a_waiting_future_at_its_deadline_and_not_before() {
        crate::sys::testing::block_on(async {
            let started = Instant::now();
            let cut = timeout(Duration::from_millis(30), std::future::pending::<()>()).await;
            let waited = started.elapsed();
            assert_eq!(cut, Err(Elapsed));
            assert!(waited >= Duration::from_millis(30), "{waited:?}");
            assert!(waited < Duration::from_secs(5), "{waited:?}");

            // A future that finishes after waiting, before the limit: its output, and the
            // timer it made goes with the timeout.
            let quick = async {
                sleep(Duration::from_millis(5)).await;
                "done"
            };
            assert_eq!(timeout(Duration::from_secs(5), quick).await, Ok("done"));
        });
    }

    #[test]
    fn a_timer_box_is_emptied_and_reused_by_the_next_wait() {
        crate::sys::testing::block_on(async {
            let spare = crate::sys::spare::shelved::<monoio::time::Sleep>;
            let before = spare();
            // A wait that parks makes its timer; ending it early empties the box into the
            // spare list, where the next wait finds it.
            let made = {
                let mut parked = std::pin::pin!(timeout(
                    Duration::from_secs(60),
                    std::future::pending::<()>()
                ));
                let polled = std::future::poll_fn(|cx| Poll::Ready(parked.as_mut().poll(cx))).await;
                assert_eq!(polled, Poll::Pending);
                parked.expiry.runtime_cell()
            };
            assert!(made.is_some());
            assert_eq!(spare(), before + 1);

            // Reused, the box times the new wait: 60 s was taken out of the wheel with the
            // old timer, so this ends at its own 10 ms.
            let started = Instant::now();
            let mut next = std::pin::pin!(timeout(
                Duration::from_millis(10),
                std::future::pending::<()>()
            ));
            let first = std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await;
            assert_eq!(first, Poll::Pending);
            assert_eq!(next.expiry.runtime_cell(), made);
            assert_eq!(spare(), before);
            assert_eq!(next.await, Err(Elapsed));
            assert!(started.elapsed() >= Duration::from_millis(10));
        });
    }

    #[test]
    fn a_poll_that_panics_leaves_no_reading_behind() {
        let panicked = std::panic::catch_unwind(|| {
            poll_stamped(async {
                recent();
                panic!("in the poll");
            })
        });
        assert!(panicked.is_err());
        let after_panic = recent();
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            recent() >= after_panic + Duration::from_millis(2),
            "the thread is unstamped"
        );
    }

    #[test]
    fn a_task_that_waits_gets_a_new_reading_when_it_wakes() {
        let mut pending_once = false;
        let mut task = std::pin::pin!(Stamped::new(std::future::poll_fn(|_| {
            let t = recent();
            if pending_once {
                Poll::Ready(t)
            } else {
                pending_once = true;
                Poll::Pending
            }
        })));
        let mut cx = Context::from_waker(Waker::noop());
        let started = Mono::now();
        assert!(task.as_mut().poll(&mut cx).is_pending());
        std::thread::sleep(Duration::from_millis(2));
        let Poll::Ready(woke) = task.as_mut().poll(&mut cx) else {
            panic!("ready on the second poll");
        };
        assert!(woke >= started + Duration::from_millis(2));
    }
}
