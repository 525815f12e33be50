//! The in-process sync backend: one ledger shared by the worker threads of one process.
//!
//! The default backend: with no Redis configured, the cores of one node still share their
//! budgets through it. Runs off the request path, once per sync interval per worker (and when a
//! request is waiting for a lease). [`InProcessLedger::exchange`](SyncBackend::exchange) takes a
//! worker's batch of [`BudgetSync`]s and returns one [`BudgetState`] per budget, applying the
//! ledger semantics of [`super::sync`] to each budget under one lock held for the whole batch
//! (the batch is small and the call rare, so the lock is never contended on the request path).
//! It never fails: there is no I/O, so the deadline can't pass and nothing can be unreachable.
//!
//! Time is `std::time::Instant`: leases expire `lease_ttl_ms` after the exchange that granted
//! them, and a budget with `key_ttl_ms > 0` disappears `key_ttl_ms` after its last exchange.
//! Expired budgets are dropped lazily, in sweeps that run when the map has doubled since the
//! last sweep or when [`SWEEP_INTERVAL`] has passed, so the map stays within about twice the
//! live budgets at an amortized O(1) cost per exchange.

// The in-process ledger is what the workers of one process share: each worker's sync task
// locks it once per exchange (off the request path) for microseconds, the Redis ledger's
// stand-in when there is no Redis.
#![allow(clippy::disallowed_types)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::sync::{slid_limit, BudgetState, BudgetSync, SyncBackend, SyncError};

/// The longest an expired budget stays in the map when the map does not grow.
pub(crate) const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// A sweep never runs for fewer stored budgets than this: small maps aren't worth scanning.
const MIN_SWEEP_LEN: usize = 64;

/// A cheap, clonable handle to one process-wide ledger; every worker holds a clone.
#[derive(Clone, Default)]
pub(crate) struct InProcessLedger {
    inner: Arc<Mutex<Ledger>>,
}

/// All budgets, by key.
struct Ledger {
    budgets: HashMap<String, Budget>,
    /// Sweep when `budgets.len()` reaches this (twice the size after the last sweep).
    sweep_at_len: usize,
    /// Sweep at the first exchange after this, whatever the size.
    sweep_at: Option<Instant>,
}

impl Default for Ledger {
    fn default() -> Ledger {
        Ledger {
            budgets: HashMap::new(),
            sweep_at_len: MIN_SWEEP_LEN,
            sweep_at: None,
        }
    }
}

/// One budget: every node's share, and when the whole budget lapses (`None`: never).
#[derive(Default)]
struct Budget {
    nodes: HashMap<String, NodeShare>,
    expires: Option<Instant>,
}

impl Budget {
    fn expired(&self, now: Instant) -> bool {
        self.expires.is_some_and(|e| e <= now)
    }
}

/// One node's share of one budget.
struct NodeShare {
    /// The largest cumulative spend the node has reported.
    spent: u64,
    /// The lease it holds (0: none) until `lease_expires`.
    lease: u64,
    lease_expires: Instant,
    /// What its waiting requests lack (0: none) until `shortfall_expires`.
    shortfall: u64,
    shortfall_expires: Instant,
}

impl InProcessLedger {
    /// An empty ledger.
    pub(crate) fn new() -> InProcessLedger {
        InProcessLedger::default()
    }

    /// Budgets stored, expired ones not yet swept included (for metrics and tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().budgets.len()
    }

    /// Whether no budget is stored.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // A panic while the lock was held can only have come from a bug outside the ledger's
        // arithmetic (which does not panic); the map is still consistent, so keep using it.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`SyncBackend::exchange`] at a given time, without a runtime (tests drive the clock
    /// through it; the benchmark fixture, outside the crate, primes its leases with it).
    pub(crate) fn exchange_at(
        &self,
        now: Instant,
        node: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
        out: &mut Vec<BudgetState>,
    ) {
        out.clear();
        out.reserve(batch.len());
        let expiries = Expiries {
            lease: now + Duration::from_millis(lease_ttl_ms),
            shortfall: now + Duration::from_millis(shortfall_ttl_ms(lease_ttl_ms)),
        };
        let mut ledger = self.lock();
        ledger.maybe_sweep(now);
        for sync in batch {
            out.push(ledger.exchange_one(now, node, expiries, sync));
        }
    }
}

/// When what one exchange stores lapses.
#[derive(Clone, Copy)]
struct Expiries {
    lease: Instant,
    shortfall: Instant,
}

/// A core's shortfall is renewed by every exchange while its requests wait (several per
/// interval), so it lapses sooner than a lease: a waiter that gave up stops asking others to
/// shed within a quarter of the lease TTL (config keeps that at least one sync interval).
pub(crate) fn shortfall_ttl_ms(lease_ttl_ms: u64) -> u64 {
    (lease_ttl_ms / 4).max(1)
}

impl Ledger {
    /// Drop expired budgets when the map has doubled or the sweep interval has passed.
    fn maybe_sweep(&mut self, now: Instant) {
        let due_by_time = self.sweep_at.is_some_and(|at| at <= now);
        if !due_by_time && self.budgets.len() < self.sweep_at_len {
            if self.sweep_at.is_none() {
                self.sweep_at = Some(now + SWEEP_INTERVAL);
            }
            return;
        }
        self.budgets.retain(|_, b| !b.expired(now));
        self.sweep_at_len = (self.budgets.len() * 2).max(MIN_SWEEP_LEN);
        self.sweep_at = Some(now + SWEEP_INTERVAL);
    }

    /// One budget's exchange: steps 1–6 of the ledger semantics in [`super::sync`].
    fn exchange_one(
        &mut self,
        now: Instant,
        node: &str,
        expiries: Expiries,
        sync: &BudgetSync,
    ) -> BudgetState {
        // A rate window's limit less the previous window's weighted use (read-only).
        let (limit, prev_total) = match &sync.slide {
            Some(slide) => {
                let prev = self.window_total(&slide.prev_key, now);
                let limit = slid_limit(
                    sync.limit,
                    slide.max,
                    prev,
                    slide.overlap_ms,
                    slide.window_ms,
                );
                (limit, prev)
            }
            None => (sync.limit, 0),
        };
        let budget = match self.budgets.get_mut(sync.key.as_str()) {
            Some(b) => b,
            None => self.budgets.entry(sync.key.clone()).or_default(),
        };
        // A lapsed budget is gone, exactly as an expired Redis key would be.
        if budget.expired(now) {
            *budget = Budget::default();
        }

        // 1. Monotonic spend: keep the largest value seen.
        let share = match budget.nodes.get_mut(node) {
            Some(s) => s,
            None => budget.nodes.entry(node.to_owned()).or_insert(NodeShare {
                spent: 0,
                lease: 0,
                lease_expires: now,
                shortfall: 0,
                shortfall_expires: now,
            }),
        };
        share.spent = share.spent.max(sync.spent);

        // 2 and 3. Totals, dropping the other nodes' expired leases on the way.
        let mut spent_total: u64 = 0;
        let mut leased_others: u64 = 0;
        let mut wanted_others: u64 = 0;
        for (name, share) in budget.nodes.iter_mut() {
            spent_total = spent_total.saturating_add(share.spent);
            if name == node {
                continue;
            }
            if share.lease > 0 && share.lease_expires <= now {
                share.lease = 0;
            }
            if share.shortfall > 0 && share.shortfall_expires <= now {
                share.shortfall = 0;
            }
            leased_others = leased_others.saturating_add(share.lease);
            wanted_others = wanted_others.saturating_add(share.shortfall);
        }
        let available = limit
            .saturating_sub(spent_total)
            .saturating_sub(leased_others);

        // 4. What was asked as far as it fits, never below what in-flight requests hold.
        let granted = sync.lease.min(available).max(sync.floor);

        // 5. Store this node's lease, renewed, and what its waiting requests still lack.
        if let Some(share) = budget.nodes.get_mut(node) {
            share.lease = granted;
            share.lease_expires = expiries.lease;
            share.shortfall = sync.shortfall.min(sync.lease.saturating_sub(granted));
            share.shortfall_expires = expiries.shortfall;
        }

        // 6. The whole budget's lifetime (0: forever, like PERSIST).
        budget.expires =
            (sync.key_ttl_ms > 0).then(|| now + Duration::from_millis(sync.key_ttl_ms));

        BudgetState {
            granted,
            spent_total,
            leased_others,
            wanted_others,
            prev_total,
        }
    }

    /// A budget's Σ spend + Σ live leases, every node's (0 when it is gone): what a window
    /// admitted, settled or not, for the sliding window after it.
    fn window_total(&self, key: &str, now: Instant) -> u64 {
        let Some(budget) = self.budgets.get(key) else {
            return 0;
        };
        if budget.expired(now) {
            return 0;
        }
        budget.nodes.values().fold(0u64, |total, share| {
            let lease = if share.lease_expires > now {
                share.lease
            } else {
                0
            };
            total.saturating_add(share.spent).saturating_add(lease)
        })
    }
}

impl SyncBackend for InProcessLedger {
    async fn exchange(
        &mut self,
        node: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
        out: &mut Vec<BudgetState>,
        _deadline: Duration,
    ) -> Result<(), SyncError> {
        self.exchange_at(Instant::now(), node, lease_ttl_ms, batch, out);
        Ok(())
    }
}

/// One scenario of exchanges, written once and run against every backend, so all backends are
/// held to the same answers (the Redis tests compare theirs with the in-process ledger's).
#[cfg(test)]
pub(crate) mod conformance {
    use std::time::Duration;

    use super::super::sync::{BudgetState, BudgetSync, Slide, SyncBackend, SyncError};

    /// Deadline for each exchange in the scenario.
    const DEADLINE: Duration = Duration::from_secs(2);
    /// Lease TTL for the steps that don't test expiry: long enough never to lapse in a test.
    const LONG_TTL: u64 = 60_000;

    pub(crate) fn budget(key: &str, limit: u64, spent: u64, lease: u64, floor: u64) -> BudgetSync {
        BudgetSync {
            key: key.to_owned(),
            limit,
            spent,
            lease,
            floor,
            key_ttl_ms: 0,
            shortfall: 0,
            slide: None,
        }
    }

    pub(crate) fn state(granted: u64, spent_total: u64, leased_others: u64) -> BudgetState {
        BudgetState {
            granted,
            spent_total,
            leased_others,
            wanted_others: 0,
            prev_total: 0,
        }
    }

    pub(crate) fn with_prev(state: BudgetState, prev_total: u64) -> BudgetState {
        BudgetState {
            prev_total,
            ..state
        }
    }

    /// One step: who exchanges what, and the answer expected.
    async fn step<B: SyncBackend>(
        backend: &mut B,
        log: &mut Vec<(String, Vec<BudgetState>)>,
        node: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
    ) -> Result<Vec<BudgetState>, SyncError> {
        let mut out = Vec::new();
        backend
            .exchange(node, lease_ttl_ms, batch, &mut out, DEADLINE)
            .await?;
        log.push((node.to_owned(), out.clone()));
        Ok(out)
    }

    /// Run the scenario on `backend`, with every key under `prefix` (a hash tag keeps each key
    /// in one cluster slot). Returns every answer in order; it also checks the answers itself,
    /// so a backend that disagrees with the semantics fails here with the step that differs.
    pub(crate) async fn scenario<B: SyncBackend>(
        backend: &mut B,
        prefix: &str,
    ) -> Result<Vec<(String, Vec<BudgetState>)>, SyncError> {
        let mut log = Vec::new();
        let a = format!("{{{prefix}:a}}");
        let b = format!("{{{prefix}:b}}");
        let e = format!("{{{prefix}:expiring}}");
        let k = format!("{{{prefix}:keyttl}}");

        // Two budgets in one batch; the first lease fits, the second is capped at the limit.
        let out = step(
            backend,
            &mut log,
            "n1",
            LONG_TTL,
            &[budget(&a, 100, 10, 30, 0), budget(&b, 5, 0, 8, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(30, 10, 0), state(5, 0, 0)]);

        // Another node sees n1's spend and lease and gets what is left.
        let out = step(
            backend,
            &mut log,
            "n2",
            LONG_TTL,
            &[budget(&a, 100, 20, 50, 0), budget(&b, 5, 0, 8, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(40, 30, 30), state(0, 0, 5)]);

        // The floor wins over availability: in-flight requests can't be taken back.
        let out = step(backend, &mut log, "n2", LONG_TTL, &[budget(&b, 5, 0, 8, 3)]).await?;
        assert_eq!(out, vec![state(3, 0, 5)]);

        // Spend is monotonic: a stale (smaller) report counts nothing, a repeat counts once.
        let out = step(
            backend,
            &mut log,
            "n1",
            LONG_TTL,
            &[budget(&a, 100, 5, 30, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(30, 30, 40)]);
        let out = step(
            backend,
            &mut log,
            "n1",
            LONG_TTL,
            &[budget(&a, 100, 25, 10, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(10, 45, 40)]);
        let out = step(
            backend,
            &mut log,
            "n1",
            LONG_TTL,
            &[budget(&a, 100, 25, 10, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(10, 45, 40)]);

        // Giving a lease back (asking 0) frees it for the others.
        let out = step(
            backend,
            &mut log,
            "n2",
            LONG_TTL,
            &[budget(&a, 100, 20, 0, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(0, 45, 10)]);
        let out = step(
            backend,
            &mut log,
            "n3",
            LONG_TTL,
            &[budget(&a, 100, 0, 100, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(45, 45, 10)]);

        // Over-spent (the limit lowered): nothing is available, the floor is still granted.
        let out = step(
            backend,
            &mut log,
            "n2",
            LONG_TTL,
            &[budget(&a, 40, 20, 10, 2)],
        )
        .await?;
        assert_eq!(out, vec![state(2, 45, 55)]);

        // A lease lapses after its TTL: the budget comes back, the spend stays. (The TTL leaves
        // room for a busy machine between the first two steps.)
        let out = step(backend, &mut log, "n1", 400, &[budget(&e, 10, 4, 6, 0)]).await?;
        assert_eq!(out, vec![state(6, 4, 0)]);
        let out = step(
            backend,
            &mut log,
            "n2",
            LONG_TTL,
            &[budget(&e, 10, 0, 10, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(0, 4, 6)]);
        monoio::time::sleep(Duration::from_millis(600)).await;
        let out = step(
            backend,
            &mut log,
            "n2",
            LONG_TTL,
            &[budget(&e, 10, 0, 10, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(6, 4, 0)]);

        // A budget with a key TTL vanishes whole after it (window budgets).
        let mut windowed = budget(&k, 10, 7, 2, 0);
        windowed.key_ttl_ms = 200;
        let out = step(
            backend,
            &mut log,
            "n1",
            LONG_TTL,
            std::slice::from_ref(&windowed),
        )
        .await?;
        assert_eq!(out, vec![state(2, 7, 0)]);
        monoio::time::sleep(Duration::from_millis(400)).await;
        let out = step(
            backend,
            &mut log,
            "n2",
            LONG_TTL,
            &[budget(&k, 10, 1, 3, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(3, 1, 0)]);

        // A sliding window: the previous window's spend and live leases (70 here), weighted by
        // the part of it still overlapping, come off the next window's limit.
        let prev = format!("{{{prefix}:slide}}:1");
        let cur = format!("{{{prefix}:slide}}:2");
        let slid = |limit: u64, lease: u64, overlap_ms: u64| BudgetSync {
            slide: Some(Slide {
                prev_key: prev.clone(),
                max: 100,
                overlap_ms,
                window_ms: 1000,
            }),
            ..budget(&cur, limit, 0, lease, 0)
        };
        let out = step(
            backend,
            &mut log,
            "n1",
            LONG_TTL,
            &[budget(&prev, 100, 50, 20, 0)],
        )
        .await?;
        assert_eq!(out, vec![state(20, 50, 0)]);
        // 30% overlap: 100 − ⌈70 × 0.3⌉ = 79.
        let out = step(backend, &mut log, "n2", LONG_TTL, &[slid(100, 100, 300)]).await?;
        assert_eq!(out, vec![with_prev(state(79, 0, 0), 70)]);
        // A paced allowance below that is the limit.
        let out = step(backend, &mut log, "n2", LONG_TTL, &[slid(50, 100, 300)]).await?;
        assert_eq!(out, vec![with_prev(state(50, 0, 0), 70)]);
        // Rounded up: ⌈70 × 0.001⌉ = 1 comes off; n2's 50 is leased.
        let out = step(backend, &mut log, "n3", LONG_TTL, &[slid(100, 100, 1)]).await?;
        assert_eq!(out, vec![with_prev(state(49, 0, 50), 70)]);
        // A previous window nobody used (its key absent) takes nothing off.
        let mut fresh = slid(100, 100, 1000);
        fresh.key = format!("{{{prefix}:slide}}:9");
        if let Some(s) = fresh.slide.as_mut() {
            s.prev_key = format!("{{{prefix}:slide}}:8");
        }
        let out = step(backend, &mut log, "n1", LONG_TTL, &[fresh]).await?;
        assert_eq!(out, vec![state(100, 0, 0)]);

        // An empty batch is a valid exchange with an empty answer.
        let out = step(backend, &mut log, "n1", LONG_TTL, &[]).await?;
        assert!(out.is_empty());
        Ok(log)
    }

    pub(crate) use crate::sys::testing::block_on;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::conformance::{budget, state};
    use super::*;

    const TTL: u64 = 1_000;

    /// A small deterministic PRNG (xorshift64*): reproducible interleavings without a crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            crate::sys::rand::xorshift64star(&mut self.0)
        }
        fn below(&mut self, n: u64) -> u64 {
            if n == 0 {
                0
            } else {
                self.next() % n
            }
        }
    }

    fn one(
        ledger: &InProcessLedger,
        now: Instant,
        node: &str,
        ttl: u64,
        b: BudgetSync,
    ) -> BudgetState {
        let mut out = Vec::new();
        ledger.exchange_at(now, node, ttl, &[b], &mut out);
        assert_eq!(out.len(), 1);
        out[0]
    }

    #[test]
    fn conformance_scenario() {
        let mut ledger = InProcessLedger::new();
        let log = conformance::block_on(conformance::scenario(&mut ledger, "t")).unwrap();
        assert!(log.len() > 10);
    }

    /// Several nodes exchange in random order, each admitting only from its granted lease,
    /// settling reservations (using at most what was reserved), and sometimes retrying an
    /// exchange or having an old one arrive late. Checked after every exchange:
    /// - what the nodes really spent plus what is in flight never passes the limit;
    /// - the ledger's Σ spent + Σ leases never passes it either;
    /// - the totals are exact: no report counted twice, none lost.
    #[test]
    fn strict_invariant_under_random_interleavings() {
        for seed in 1..=60u64 {
            let ledger = InProcessLedger::new();
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let limit = 50 + rng.below(500);
            let nodes = 2 + rng.below(5) as usize;
            let names: Vec<String> = (0..nodes).map(|i| format!("node{i}")).collect();
            // Per node: the lease the ledger granted it, how much of it was admitted since that
            // exchange, the reservations in flight, what it really spent, and what it reported.
            let mut held = vec![0u64; nodes];
            let mut used = vec![0u64; nodes];
            let mut in_flight = vec![0u64; nodes];
            let mut spent = vec![0u64; nodes];
            let mut reported = vec![0u64; nodes];
            let mut last: Vec<Option<BudgetSync>> = vec![None; nodes];
            let t0 = Instant::now();
            for round in 0..400u64 {
                let now = t0 + Duration::from_millis(round);
                let i = rng.below(nodes as u64) as usize;
                // Local work: admit from what is left of the lease, settle some reservations.
                let admit = rng.below(held[i] - used[i] + 1);
                in_flight[i] += admit;
                used[i] += admit;
                let settle = rng.below(in_flight[i] + 1);
                in_flight[i] -= settle;
                spent[i] += rng.below(settle + 1);
                let real: u64 = spent.iter().sum::<u64>() + in_flight.iter().sum::<u64>();
                assert!(
                    real <= limit,
                    "seed {seed} round {round}: real {real} > {limit}"
                );

                // An old exchange of this node arriving late: its smaller spend counts nothing.
                if let (Some(old), 0) = (&last[i], rng.below(5)) {
                    one(&ledger, now, &names[i], TTL, old.clone());
                }
                let want = rng.below(limit / 2 + 1);
                let b = budget("k", limit, spent[i], want, in_flight[i]);
                let mut got = one(&ledger, now, &names[i], TTL, b.clone());
                // A retry of the same exchange (the first answer was lost) changes nothing.
                if rng.below(4) == 0 {
                    let again = one(&ledger, now, &names[i], TTL, b.clone());
                    assert_eq!(again, got, "seed {seed} round {round}: retry differs");
                    got = again;
                }
                last[i] = Some(b);
                reported[i] = spent[i];
                assert!(
                    got.granted >= in_flight[i],
                    "seed {seed}: grant below floor"
                );
                assert!(
                    got.granted <= want.max(in_flight[i]),
                    "seed {seed}: grant above ask"
                );
                held[i] = got.granted;
                used[i] = in_flight[i];

                let ledger_spent: u64 = reported.iter().sum();
                assert_eq!(got.spent_total, ledger_spent, "seed {seed} round {round}");
                let others: u64 = (0..nodes).filter(|&j| j != i).map(|j| held[j]).sum();
                assert_eq!(got.leased_others, others, "seed {seed} round {round}");
                let booked = ledger_spent + held.iter().sum::<u64>();
                assert!(
                    booked <= limit,
                    "seed {seed} round {round}: {booked} > {limit}"
                );
            }
        }
    }

    #[test]
    fn grant_is_bounded_by_availability_and_floor() {
        let l = InProcessLedger::new();
        let now = Instant::now();
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 10, 0, 4, 0)),
            state(4, 0, 0)
        );
        assert_eq!(
            one(&l, now, "b", TTL, budget("k", 10, 3, 9, 0)),
            state(3, 3, 4)
        );
        // a asks for more than is left: capped at limit − spent − b's lease = 10 − 3 − 3 = 4.
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 10, 0, 9, 0)),
            state(4, 3, 3)
        );
        // a's floor of 8 forces more than is available (and more than it asked).
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 10, 0, 1, 8)),
            state(8, 3, 3)
        );
        // Over-booked: availability saturates at 0, and b keeps only its floor.
        assert_eq!(
            one(&l, now, "b", TTL, budget("k", 10, 3, 9, 1)),
            state(1, 3, 8)
        );
    }

    #[test]
    fn spent_is_monotonic() {
        let l = InProcessLedger::new();
        let now = Instant::now();
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 100, 10, 0, 0)).spent_total,
            10
        );
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 100, 10, 0, 0)).spent_total,
            10
        );
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 100, 3, 0, 0)).spent_total,
            10
        );
        assert_eq!(
            one(&l, now, "b", TTL, budget("k", 100, 4, 0, 0)).spent_total,
            14
        );
        assert_eq!(
            one(&l, now, "a", TTL, budget("k", 100, 12, 0, 0)).spent_total,
            16
        );
    }

    #[test]
    fn expired_lease_frees_budget_but_spend_stays() {
        let l = InProcessLedger::new();
        let t0 = Instant::now();
        assert_eq!(
            one(&l, t0, "a", 100, budget("k", 10, 4, 6, 0)),
            state(6, 4, 0)
        );
        // Just before expiry a's lease still counts.
        let before = t0 + Duration::from_millis(99);
        assert_eq!(
            one(&l, before, "b", TTL, budget("k", 10, 0, 6, 0)),
            state(0, 4, 6)
        );
        // At expiry it lapses; a's spend is still there.
        let at = t0 + Duration::from_millis(100);
        assert_eq!(
            one(&l, at, "b", TTL, budget("k", 10, 0, 6, 0)),
            state(6, 4, 0)
        );
        // a comes back: its lease was dropped, it gets nothing left over.
        assert_eq!(
            one(&l, at, "a", 100, budget("k", 10, 4, 6, 0)),
            state(0, 4, 6)
        );
    }

    #[test]
    fn renewing_keeps_a_lease_alive() {
        let l = InProcessLedger::new();
        let t0 = Instant::now();
        for i in 0..10u64 {
            let now = t0 + Duration::from_millis(80 * i);
            assert_eq!(one(&l, now, "a", 100, budget("k", 10, 0, 6, 0)).granted, 6);
        }
        let now = t0 + Duration::from_millis(80 * 9 + 50);
        assert_eq!(
            one(&l, now, "b", TTL, budget("k", 10, 0, 10, 0)),
            state(4, 0, 6)
        );
    }

    #[test]
    fn key_ttl_expires_the_whole_budget() {
        let l = InProcessLedger::new();
        let t0 = Instant::now();
        let mut b = budget("w", 10, 7, 3, 0);
        b.key_ttl_ms = 1_000;
        assert_eq!(one(&l, t0, "a", 60_000, b.clone()), state(3, 7, 0));
        // Each exchange pushes the expiry out again.
        let t1 = t0 + Duration::from_millis(900);
        assert_eq!(one(&l, t1, "b", 60_000, b.clone()), state(0, 14, 3));
        let t2 = t1 + Duration::from_millis(900);
        let mut fresh = budget("w", 10, 1, 2, 0);
        fresh.key_ttl_ms = 1_000;
        assert_eq!(one(&l, t2, "c", 60_000, fresh.clone()), state(0, 15, 3));
        // Just before a second after the last exchange the budget is still there...
        let t3 = t2 + Duration::from_millis(999);
        assert_eq!(
            one(&l, t3, "d", 60_000, budget("w", 10, 0, 0, 0)),
            state(0, 15, 3)
        );
        // ...and an hour after its last exchange (which made it permanent) it still is. The
        // leases have long lapsed; the spends stay.
        let t4 = t3 + Duration::from_secs(3600);
        assert_eq!(
            one(&l, t4, "d", 60_000, budget("w", 10, 0, 0, 0)),
            state(0, 15, 0)
        );
        // With a TTL again, it lapses a TTL after the last exchange, spends and leases together.
        assert_eq!(one(&l, t4, "c", 60_000, fresh.clone()), state(0, 15, 0));
        let t5 = t4 + Duration::from_millis(1_000);
        assert_eq!(one(&l, t5, "c", 60_000, fresh), state(2, 1, 0));
    }

    #[test]
    fn expired_budgets_are_swept() {
        let l = InProcessLedger::new();
        let t0 = Instant::now();
        let mut out = Vec::new();
        // 10 000 short-lived budgets, created one batch per "window" of 100 ms.
        for w in 0..100u64 {
            let now = t0 + Duration::from_millis(100 * w);
            let batch: Vec<BudgetSync> = (0..100)
                .map(|i| {
                    let mut b = budget(&format!("w{w}:{i}"), 10, 1, 1, 0);
                    b.key_ttl_ms = 150;
                    b
                })
                .collect();
            l.exchange_at(now, "a", TTL, &batch, &mut out);
            assert_eq!(out.len(), 100);
            // At most two windows are live; the map stays within twice that plus the slack.
            assert!(
                l.len() <= 2 * 200 + 100 + MIN_SWEEP_LEN,
                "len {} at window {w}",
                l.len()
            );
        }
        // Without growth, the timed sweep drops the rest.
        let later = t0 + Duration::from_secs(100) + SWEEP_INTERVAL;
        l.exchange_at(later, "a", TTL, &[], &mut out);
        let later = later + SWEEP_INTERVAL;
        l.exchange_at(later, "a", TTL, &[], &mut out);
        assert_eq!(l.len(), 0);
        assert!(l.is_empty());
    }

    #[test]
    fn clones_share_one_ledger_across_threads() {
        let l = InProcessLedger::new();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let node = format!("n{t}");
                    let mut granted = 0;
                    for _ in 0..200 {
                        let mut out = Vec::new();
                        l.exchange_at(
                            Instant::now(),
                            &node,
                            60_000,
                            &[budget("k", 1_000, 0, 100, 0)],
                            &mut out,
                        );
                        granted = out[0].granted;
                    }
                    granted
                })
            })
            .collect();
        let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(total, 400, "each of 4 nodes holds 100 of 1000");
        let mut out = Vec::new();
        l.exchange_at(
            Instant::now(),
            "n5",
            60_000,
            &[budget("k", 1_000, 0, 1_000, 0)],
            &mut out,
        );
        assert_eq!(out[0], state(600, 0, 400));
    }

    #[test]
    fn out_is_replaced_not_appended() {
        let l = InProcessLedger::new();
        let mut out = vec![state(9, 9, 9)];
        l.exchange_at(
            Instant::now(),
            "a",
            TTL,
            &[budget("k", 1, 0, 1, 0)],
            &mut out,
        );
        assert_eq!(out, vec![state(1, 0, 0)]);
    }
}
