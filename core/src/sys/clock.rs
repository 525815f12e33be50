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
use std::time::{Duration, Instant};

/// Whether a stamped poll is running, and the readings it has taken (`Some`): the monotonic
/// clock's and the wall clock's.
struct PollClock {
    stamped: Cell<bool>,
    reading: Cell<Option<Instant>>,
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
pub(crate) fn recent() -> Instant {
    once_per_poll(|p| &p.reading, Instant::now)
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
pub(crate) fn now() -> Instant {
    let t = Instant::now();
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
/// every wait.
pub(crate) fn timeout<F: Future>(limit: Duration, future: F) -> monoio::time::Timeout<F> {
    monoio::time::timeout_at(deadline(limit), future)
}

/// When a wait of `limit` from this poll's reading ends (a limit too large to add — a
/// configured "never" — ends in the far future), as the runtime's timers take it.
pub(crate) fn deadline(limit: Duration) -> monoio::time::Instant {
    let deadline = recent().checked_add(limit).unwrap_or_else(far_future);
    monoio::time::Instant::from_std(deadline)
}

/// A deadline no wait reaches (about 30 years ahead), for a limit too large to add.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
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
struct Restore((bool, Option<Instant>, Option<Duration>));

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

    /// Poll `f` once in a stamped poll.
    fn poll_stamped<T>(f: impl Future<Output = T>) -> Poll<T> {
        let mut task = std::pin::pin!(Stamped::new(f));
        task.as_mut().poll(&mut Context::from_waker(Waker::noop()))
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
        let started = Instant::now();
        assert!(task.as_mut().poll(&mut cx).is_pending());
        std::thread::sleep(Duration::from_millis(2));
        let Poll::Ready(woke) = task.as_mut().poll(&mut cx) else {
            panic!("ready on the second poll");
        };
        assert!(woke >= started + Duration::from_millis(2));
    }
}
