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
