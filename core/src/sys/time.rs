//! Wall-clock time as the numbers the gateway stores and compares: milliseconds, seconds and
//! microseconds since the Unix epoch (0 for a clock set before 1970, never a panic). Windows,
//! key expiry and log file names are wall-clock; durations use the monotonic clock
//! ([`crate::sys::clock::Mono`]). Read as [`crate::sys::clock`] reads them: once per wake-up
//! of a connection's task.

use crate::sys::clock::since_epoch;

/// Milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> u64 {
    since_epoch().as_millis() as u64
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_secs() -> u64 {
    since_epoch().as_secs()
}

/// Microseconds since the Unix epoch.
pub(crate) fn unix_us() -> u64 {
    u64::try_from(since_epoch().as_micros()).unwrap_or(u64::MAX)
}

/// The sub-second part of now, in nanoseconds (a cheap per-start nonce).
pub(crate) fn subsec_nanos() -> u32 {
    since_epoch().subsec_nanos()
}

/// Milliseconds on a monotonic clock shared by every thread of the process (since its first
/// read), never 0: for deadlines several workers compare, such as a backend's breaker or
/// cool-down, where 0 means "none". Read as [`crate::sys::clock::recent`]: once per wake-up of
/// a connection's task.
pub(crate) fn mono_ms() -> u64 {
    static BASE: std::sync::OnceLock<crate::sys::clock::Mono> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(crate::sys::clock::Mono::now);
    crate::sys::clock::recent()
        .as_nanos()
        .saturating_sub(base.as_nanos())
        / 1_000_000
        + 1
}
