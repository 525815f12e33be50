//! The sync-backend contract: how a worker's budgets meet the budgets of every other core.
//!
//! Runs off the request path, once per sync interval per worker (and when a request is waiting
//! for a lease). Takes the worker's batch of [`BudgetSync`]s — for each budget this core touched,
//! its cumulative spend and the lease it wants to hold — and returns one [`BudgetState`] per
//! budget, in order, in a single round trip. Raises [`SyncError`] when the backend can't be
//! reached or answers nonsense within the deadline; the caller then keeps its local view.
//!
//! ## The ledger, one budget at a time
//!
//! A budget has a `limit` (requests, tokens or concurrent slots). Each core (`node`: one worker of
//! one process, named uniquely per process start) holds in the ledger:
//! - `spent`: its cumulative spend on this budget, an absolute and monotonic number. The ledger
//!   keeps the largest value it has seen, so a repeated or reordered exchange never counts twice,
//!   and a ledger that lost its data (a Redis restart without persistence) is refilled by the
//!   next exchange of every live core.
//! - `lease`: the part of the budget the core has claimed but not yet spent, with an expiry
//!   (`lease_ttl`) that every exchange renews. A dead core's lease lapses; its spend stays.
//!
//! One exchange for one budget, atomically:
//! 1. `spent[node] = max(spent[node], batch.spent)`.
//! 2. Drop other nodes' leases whose expiry has passed.
//! 3. `spent_total = Σ spent[*]`, `leased_others = Σ live lease[other]`,
//!    `available = limit − spent_total − leased_others` (saturating at 0),
//!    `wanted_others = Σ live shortfall[other]`.
//! 4. `granted = max(floor, min(lease, available))`: what the core asked for as far as it fits,
//!    never below `floor` (the part already reserved by admitted, in-flight requests, which
//!    can't be taken back).
//! 5. Store `lease[node] = granted` with expiry `now + lease_ttl` (delete it when 0), and
//!    `shortfall[node]` (what this core's waiting requests still lack: `batch.shortfall` less
//!    what the grant added) with the same expiry (delete it when 0).
//! 6. When `key_ttl_ms > 0`, (re)set the whole budget's expiry to `key_ttl_ms` (window budgets
//!    live two windows).
//!
//! A rate window's budget also carries a [`Slide`]: the key of the window before it and how much
//! of that window a window ending now still covers. Then, before step 3, the ledger reads the
//! previous window's `prev_total = Σ spent[*] + Σ live lease[*]` (every node's, the caller's
//! included; 0 when that budget is gone) and uses the limit
//! `min(limit, max − ⌈prev_total × overlap_ms / window_ms⌉)` ([`slid_limit`]): a sliding window,
//! the previous window's use weighted by its remaining overlap. Leases count because they cover
//! what is admitted but not yet settled (a request's spend is reported when it ends); each core
//! gives its lease of a window back (down to its in-flight reservations) at its first exchange
//! after the window ends. Reading it is read-only. The answer carries `prev_total`.
//!
//! So as long as every core admits only from its granted lease, `Σ spent + Σ leases ≤ limit`:
//! the sum of admitted reservations never passes the limit, on one core or across nodes.
//!
//! `wanted_others` is how a core learns that another one waits: a core holding idle slack of a
//! strict budget gives it back at its next exchange when anyone else is short, so a request on a
//! core without a lease waits about one interval, never until the holder goes quiet (a
//! concurrency limit of N then admits a caller with fewer than N in flight on any core).

use std::fmt;

/// What one core reports and asks for, for one budget, in one exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BudgetSync {
    /// The budget's ledger key. For Redis it is the key itself and carries a hash tag
    /// (`{…}`), so a budget lives in one Redis Cluster slot.
    pub(crate) key: String,
    /// The budget's size.
    pub(crate) limit: u64,
    /// This core's cumulative spend on the budget (absolute, never decreasing).
    pub(crate) spent: u64,
    /// The lease this core wants to hold after the exchange (absolute, not a delta).
    pub(crate) lease: u64,
    /// The part of the lease in use by in-flight requests: the grant is never below it.
    pub(crate) floor: u64,
    /// What requests waiting on this core for a lease need beyond what it holds (0: none wait).
    /// Other cores see the sum as [`BudgetState::wanted_others`] and give back idle slack.
    pub(crate) shortfall: u64,
    /// Expiry of the whole budget in ms after this exchange; 0 keeps it forever.
    pub(crate) key_ttl_ms: u64,
    /// A rate window: the previous window's use lowers this one's limit (see the module doc).
    pub(crate) slide: Option<Slide>,
}

/// What a sliding rate window needs of the window before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slide {
    /// The previous window's budget key. It has the same hash tag as the budget's key, so both
    /// live in one Redis Cluster slot and one script may read them.
    pub(crate) prev_key: String,
    /// The window's full size (a paced window's `limit` is its allowance so far, at most this).
    pub(crate) max: u64,
    /// How much of the previous window a window ending now still covers (ms, ≤ `window_ms`).
    pub(crate) overlap_ms: u64,
    /// The window's length (ms, ≥ 1).
    pub(crate) window_ms: u64,
}

/// A sliding window's limit: `limit`, and at most `max` less the previous window's total
/// weighted by the part of it still overlapping (rounded up, so never generous).
pub(crate) fn slid_limit(
    limit: u64,
    max: u64,
    prev_total: u64,
    overlap_ms: u64,
    window_ms: u64,
) -> u64 {
    let weighted = (u128::from(prev_total) * u128::from(overlap_ms.min(window_ms)))
        .div_ceil(u128::from(window_ms.max(1)));
    limit.min(max.saturating_sub(u64::try_from(weighted).unwrap_or(u64::MAX)))
}

/// The ledger's answer for one budget.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BudgetState {
    /// The lease now held by this core (`floor ≤ granted`, and `granted ≤ lease` unless the floor
    /// forced more).
    pub(crate) granted: u64,
    /// Σ spend of all cores.
    pub(crate) spent_total: u64,
    /// Σ live leases of the other cores.
    pub(crate) leased_others: u64,
    /// Σ live shortfalls of the other cores: requests elsewhere wait for this much.
    pub(crate) wanted_others: u64,
    /// With a [`Slide`]: the previous window's Σ spend + Σ live leases (0 without one).
    pub(crate) prev_total: u64,
}

/// Why an exchange failed; the caller keeps serving from what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SyncError {
    /// No connection (refused, reset, not yet reconnected: in backoff).
    Unavailable(String),
    /// The round trip passed its deadline.
    Timeout,
    /// The backend answered something unexpected (an error reply, a wrong shape).
    Protocol(String),
}

impl fmt::Display for SyncError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncError::Unavailable(m) => write!(f, "sync backend unavailable: {m}"),
            SyncError::Timeout => write!(f, "sync backend timed out"),
            SyncError::Protocol(m) => write!(f, "sync backend protocol error: {m}"),
        }
    }
}

/// A shared ledger: the in-process one (the cores of one node) or Redis (every node).
#[allow(async_fn_in_trait)]
pub(crate) trait SyncBackend {
    /// Run one exchange for every budget in `batch` (see the module doc), in one round trip,
    /// within `deadline`. On success `out` holds one state per budget, in order.
    async fn exchange(
        &mut self,
        node: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
        out: &mut Vec<BudgetState>,
        deadline: std::time::Duration,
    ) -> Result<(), SyncError>;

    /// Get ready before the first request needs the ledger (e.g. connect and load scripts), so
    /// the first lease a request waits for costs one round trip, not a connect. Best effort.
    async fn warm_up(&mut self, _deadline: std::time::Duration) {}
}

#[cfg(test)]
mod tests {
    use super::slid_limit;

    #[test]
    fn the_previous_window_weighs_by_its_overlap_rounded_up() {
        // At the edge the whole previous window counts; at the window's end none of it.
        assert_eq!(slid_limit(600, 600, 600, 60_000, 60_000), 0);
        assert_eq!(slid_limit(600, 600, 600, 0, 60_000), 600);
        // A quarter of the window still overlaps: a quarter of the previous total counts.
        assert_eq!(slid_limit(600, 600, 400, 15_000, 60_000), 500);
        // Rounded up: 7 × 1/1000 still takes one.
        assert_eq!(slid_limit(100, 100, 7, 1, 1_000), 99);
        // A paced allowance below the slid limit is the limit; a previous window over the
        // limit (it overshot) leaves nothing, never a wrap-around.
        assert_eq!(slid_limit(50, 100, 70, 300, 1_000), 50);
        assert_eq!(slid_limit(100, 100, 1_000, 1_000, 1_000), 0);
        // No overflow at the extremes.
        assert_eq!(slid_limit(u64::MAX, u64::MAX, u64::MAX, u64::MAX, 1), 0);
    }
}
