//! [`Mono`]: a reading of the monotonic clock, the instant every timing and deadline of a worker
//! is. [`clock`](super::clock) reads it once per wake-up; [`deadlines`](super::deadlines) keeps
//! waits until one.

use std::num::NonZeroU64;
use std::ops::Add;
use std::time::{Duration, Instant};

/// A reading of the monotonic clock — the one `Instant` reads on Linux (`CLOCK_MONOTONIC`) —
/// as whole nanoseconds in a `u64`.
///
/// Why not `Instant`: on Linux its difference goes through std's out-of-line
/// `Timespec::sub_timespec` (seconds and nanoseconds apart, borrow, checks), ~37 instructions,
/// and a request took about seventeen (its timings, deadlines, pool ages, `mono_ms`). Here a
/// difference is a subtraction; the change took 3% off a 1 KB request's user-space
/// instructions (perf/history/RESULTS-diary-2026-12.md, #15). A `u64` of nanoseconds holds 584 years of uptime. Only
/// the runtime's timers take an `Instant`: a [`Sleep`] makes one ([`Mono::to_instant`]) when
/// it has to make its timer, so a wait that ends at once converts nothing.
///
/// Never zero (the clock counts from boot, and a zero reading is taken as a nanosecond), so an
/// `Option<Mono>` — most of a request's timings — is eight bytes, as the reading alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mono(NonZeroU64);

impl Mono {
    /// A fresh reading (a vDSO call, as `Instant::now`). On a worker, take the poll's reading
    /// with [`recent`] or [`now`] instead.
    pub fn now() -> Mono {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC exists on every Linux,
        // so the call cannot fail (std's `Instant::now` makes the same call and asserts it).
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        Mono::from_nanos(
            (ts.tv_sec as u64)
                .wrapping_mul(1_000_000_000)
                .wrapping_add(ts.tv_nsec as u64),
        )
    }

    pub(super) fn from_nanos(nanos: u64) -> Mono {
        Mono(NonZeroU64::new(nanos).unwrap_or(NonZeroU64::MIN))
    }

    /// The time from `earlier` to this reading, zero when `earlier` is later.
    #[inline]
    pub(crate) fn saturating_duration_since(self, earlier: Mono) -> Duration {
        Duration::from_nanos(self.0.get().saturating_sub(earlier.0.get()))
    }

    /// This reading `by` later, or `None` past the type's range (584 years of uptime).
    #[inline]
    pub(crate) fn checked_add(self, by: Duration) -> Option<Mono> {
        let by = u64::try_from(by.as_nanos()).ok()?;
        self.0.checked_add(by).map(Mono)
    }

    /// Nanoseconds on the clock (since the machine started).
    pub(crate) fn as_nanos(self) -> u64 {
        self.0.get()
    }

    /// The same moment as an `Instant`, for the runtime's timers: one anchor pair read at the
    /// first call (both clocks back to back, so within a few tens of nanoseconds of each
    /// other), then an addition.
    pub(crate) fn to_instant(self) -> Instant {
        static ANCHOR: std::sync::OnceLock<(Instant, Mono)> = std::sync::OnceLock::new();
        let (instant, mono) = *ANCHOR.get_or_init(|| (Instant::now(), Mono::now()));
        let moved = if self >= mono {
            instant.checked_add(self.saturating_duration_since(mono))
        } else {
            instant.checked_sub(mono.saturating_duration_since(self))
        };
        moved.unwrap_or(instant)
    }
}

impl Add<Duration> for Mono {
    type Output = Mono;

    /// Saturating at the type's end, where `Instant` would panic: a configured "never" added
    /// to a reading is simply the far future.
    #[inline]
    fn add(self, by: Duration) -> Mono {
        self.checked_add(by).unwrap_or(Mono(NonZeroU64::MAX))
    }
}
