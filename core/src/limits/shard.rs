//! One worker's limiter: local budgets decided without locks or round trips, reconciled with
//! every other core by the sync task.
//!
//! [`LimiterShard::try_admit`] runs on the request path (from the admit phase): it takes the
//! caller (key, model, token reservation inputs) and either records a [`Permit`] — a
//! reservation on every budget that applies — or returns a [`Refusal`] saying which budget
//! refused and whether waiting for the next sync could help. [`LimiterShard::settle`] runs
//! exactly once per permit when the request ends and turns reservations into spend.
//! [`LimiterShard::prepare`] / [`LimiterShard::apply`] run on the worker's sync task once per
//! sync interval: deltas and lease wishes out, grants and global totals back.
//!
//! ## Budgets and leases
//! Every limit is a budget in the shared ledger (see [`super::sync`]): a policy's requests or
//! tokens in the current window (`window` = wall-clock time / window length, so all nodes agree
//! on windows within their clock skew), a policy's concurrent slots, a key's quota plan in its
//! current period. A core admits against the lease it holds: `free = granted − spent since the
//! grant − reserved`. Quotas and concurrency are strict — no lease, no admission (the request
//! may wait one sync for a lease). Rate budgets (requests, tokens per window) slide: a window's
//! limit is the policy's less the previous window's total (spend and live leases, as the ledger
//! holds them) weighted by the part of it a window ending now still covers (see
//! [`super::sync::Slide`]). They may also admit one request *on credit* per sync interval when
//! the last global view still showed headroom; that is their only overshoot, bounded by
//! 2 × (cores across all nodes) × (largest single reservation) per window, and across an edge
//! any span of D ≤ W admits at most L × (1 + D / W) + 5 × C × R — see docs/limits.md.
//!
//! ## Outages
//! While the ledger is unreachable a core spends what it holds, and with `on_backend_down =
//! "allow"` rate budgets go on within the core's share (limit / cores). Concurrency takes the
//! held lease and the share as one allowance ([`LimiterShard::outage_slots`]): within both
//! while the lease is live in the ledger, the share alone after. Back from any outage (the
//! ledger may have restarted empty, or lost the leases of cores serving on shares), a
//! concurrency budget asks no more than its share for twice the time every core needs to find
//! the ledger (`rejoined_at`), and [`LimiterShard::apply`] keeps no more of a grant than the
//! ledger can back (a floor it had to accept past the limit admits nothing new).

use std::collections::HashMap;
use std::task::Waker;
use std::time::Duration;

use crate::sys::clock::Mono;
use crate::sys::time::unix_ms;

use super::sync::{slid_limit, BudgetState, BudgetSync, Slide};
use crate::config::limits::{
    civil_year_month, days_from_civil, ApiKey, DownPolicy, KeyIdx, LimitDimension, LimitsConfig,
    Per, Period, Plan, Policy, ProviderLimits, RateLimit, StableIds,
};

const KIND_REQUESTS: u8 = 0;
const KIND_TOKENS: u8 = 1;
const KIND_CONCURRENCY: u8 = 2;
const KIND_PLAN: u8 = 3;

/// The high bit of a provider budget's [`BudgetId::shape`] (a policy's never has it).
const PROVIDER_SHAPE: u64 = 1 << 63;

/// A subject id for requests without one (no key, or a key without an entity).
const NO_SUBJECT: u32 = u32::MAX;

/// Quiet exchanges (≈ 5 s at the default 50 ms interval) after which a budget's minimum
/// slice goes back to the ledger.
const KEEP_QUIET_SYNCS: u32 = 100;

/// Distinct model names a `per = "model"` policy tracks per worker; beyond this they share one
/// overflow counter (bounded memory, documented).
const MAX_MODEL_SUBJECTS: usize = 4096;

/// A cheap hasher for [`BudgetId`]s: they are small integers we make ourselves (no adversary
/// picks them), so SipHash's flood resistance buys nothing on this per-request lookup.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        // Fx-style mixing: rotate, xor, multiply by an odd constant.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type IdMap<V> = HashMap<BudgetId, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Which budget: kind, owner (policy or key), subject (key / entity / model / plan), window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct BudgetId {
    kind: u8,
    owner: u32,
    subject: u32,
    window: u64,
    /// What the window number counts in: the policy's `per` and window length, or the plan's
    /// period.
    shape: u64,
}

/// A policy's `per` as a number, for [`BudgetId::shape`].
fn per_code(per: Per) -> u64 {
    match per {
        Per::Global => 0,
        Per::Key => 1,
        Per::Entity => 2,
        Per::Model => 3,
    }
}

#[derive(Debug)]
struct Budget {
    /// The ledger key.
    key: String,
    limit: u64,
    strict: bool,
    /// Rate windows: the rate and the window's start (unix ms). The limit is a sliding
    /// window's: the allowance (growing with the window's age when paced), less the previous
    /// window's use weighted by its remaining overlap.
    rate: Option<(RateLimit, u64)>,
    /// Rate windows: the previous window's ledger key (same hash tag).
    prev_key: Option<String>,
    /// Rate windows: the previous window's Σ spend + Σ leases, as the last exchange saw it
    /// (before the first, this core's own view of that window).
    prev_total: u64,
    key_ttl_ms: u64,
    /// When the window or period ends (unix ms); 0: never.
    ends_at_ms: u64,
    /// This core's cumulative spend.
    spent: u64,
    /// Spend the ledger has acknowledged.
    flushed: u64,
    granted: u64,
    spent_at_grant: u64,
    reserved: u64,
    /// Admitted on credit since the last successful exchange.
    credit: bool,
    view: Option<BudgetState>,
    used_since_sync: u64,
    /// Use per sync interval, smoothed: the last exchange's use scaled to a whole interval
    /// (an exchange hurried by a waiting request covers less time), decaying by half per
    /// exchange when quieter, so one short gap can't shrink the lease to nothing.
    recent_use: u64,
    demand: u64,
    idle_syncs: u32,
}

/// A rate window's limit at `now_ms`: the allowance as of `allowance_at_ms` (a lease is sized
/// for the interval ahead), at most the rate's max less the previous window's `prev_total`
/// weighted by how much of it a window ending at `now_ms` covers. Returns it with the overlap.
fn sliding(
    rate: &RateLimit,
    start: u64,
    allowance_at_ms: u64,
    now_ms: u64,
    prev_total: u64,
) -> (u64, u64) {
    let window_ms = rate.window_ms();
    let overlap_ms = start
        .saturating_add(window_ms)
        .saturating_sub(now_ms)
        .min(window_ms);
    let allowance = rate.allowance(start, allowance_at_ms);
    (
        slid_limit(allowance, rate.max, prev_total, overlap_ms, window_ms),
        overlap_ms,
    )
}

impl Budget {
    /// What this core knows the window admitted: the others' spend and leases at the last
    /// exchange, plus its own spend and reservations (for the sliding window after it).
    fn window_total(&self) -> u64 {
        let others = self.view.map_or(0, |v| {
            v.spent_total.saturating_sub(self.flushed) + v.leased_others
        });
        others + self.spent + self.reserved + self.free(true).max(0) as u64
    }

    /// This core's part of the limit while the ledger is away: the limit over `down_share`
    /// cores, rounded up, at least 1.
    fn outage_share(&self, down_share: u64) -> u64 {
        self.limit.div_ceil(down_share).max(1)
    }

    fn free(&self, lease_valid: bool) -> i64 {
        if !lease_valid {
            return 0;
        }
        self.granted as i64 - (self.spent - self.spent_at_grant) as i64 - self.reserved as i64
    }

    /// Left of the limit as far as this core knows (exact on one core; across cores as of the
    /// last exchange plus this core's own use since).
    fn remaining(&self) -> u64 {
        let others = self.view.map_or(0, |v| {
            v.spent_total.saturating_sub(self.flushed) + v.leased_others
        });
        self.limit
            .saturating_sub(others)
            .saturating_sub(self.spent)
            .saturating_sub(self.reserved)
    }

    /// What the ledger had left beyond every lease, this core's included, at the last
    /// exchange (None: no exchange yet).
    fn ledger_room(&self) -> Option<u64> {
        self.view.map(|v| {
            self.limit
                .saturating_sub(v.spent_total + v.leased_others + v.granted)
        })
    }

    /// Left of the limit counting spend and this core's in-flight reservations but not the
    /// others' leases, which are slack that comes back when this core asks (see
    /// `wanted_others` in [`super::sync`]). Zero means the limit is truly used up.
    fn hard_room(&self) -> u64 {
        let others = self
            .view
            .map_or(0, |v| v.spent_total.saturating_sub(self.flushed));
        self.limit
            .saturating_sub(others)
            .saturating_sub(self.spent)
            .saturating_sub(self.reserved)
    }

    fn busy(&self) -> bool {
        self.reserved > 0 || self.spent != self.flushed || self.granted > 0
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefusalKind {
    /// The limit is used up (as far as anyone knows).
    Exhausted,
    /// This core holds too little but the ledger may have more: wait for the next sync.
    NeedLease,
    /// The ledger is unreachable and what this core holds does not cover the request.
    BackendDown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) kind: RefusalKind,
    /// The refusing policy (None: a quota plan).
    pub(crate) policy: Option<usize>,
    pub(crate) dimension: LimitDimension,
    /// Seconds until it may work again, when known.
    pub(crate) retry_after: Option<u32>,
    pub(crate) limit: u64,
}

/// The `x-ratelimit-*` numbers of the tightest requests and tokens budgets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RateHeaders {
    /// (limit, remaining, reset ms)
    pub(crate) requests: Option<(u64, u64, u64)>,
    pub(crate) tokens: Option<(u64, u64, u64)>,
}

impl RateHeaders {
    /// Append OpenAI's header lines.
    pub(crate) fn write(&self, out: &mut impl std::fmt::Write) {
        // Whole names and itoa: `write!` with its arguments cost ~150 ns a request here, and
        // names pieced together a push for each piece.
        const REQUESTS: [&str; 3] = [
            "x-ratelimit-limit-requests: ",
            "\r\nx-ratelimit-remaining-requests: ",
            "\r\nx-ratelimit-reset-requests: ",
        ];
        const TOKENS: [&str; 3] = [
            "x-ratelimit-limit-tokens: ",
            "\r\nx-ratelimit-remaining-tokens: ",
            "\r\nx-ratelimit-reset-tokens: ",
        ];
        // One digit buffer, and each kind's lines by reference: an array of (names, numbers)
        // pairs to loop over was copied whole first.
        let mut num = itoa::Buffer::new();
        if let Some(numbers) = &self.requests {
            write_lines(out, &mut num, &REQUESTS, numbers);
        }
        if let Some(numbers) = &self.tokens {
            write_lines(out, &mut num, &TOKENS, numbers);
        }
    }

    /// Keep the tightest requests and tokens budgets' numbers (`(limit, remaining, reset ms)`);
    /// other kinds have no header.
    fn keep_tightest(&mut self, kind: u8, numbers: (u64, u64, u64)) {
        let slot = match kind {
            KIND_REQUESTS => &mut self.requests,
            KIND_TOKENS => &mut self.tokens,
            _ => return,
        };
        if slot.is_none_or(|(_, remaining, _)| numbers.1 < remaining) {
            *slot = Some(numbers);
        }
    }
}

/// One kind's three header lines: `names` then `(limit, remaining, reset ms)`.
fn write_lines(
    out: &mut impl std::fmt::Write,
    num: &mut itoa::Buffer,
    names: &[&str; 3],
    &(limit, remaining, reset_ms): &(u64, u64, u64),
) {
    let [limit_name, remaining_name, reset_name] = names;
    let _ = out.write_str(limit_name);
    let _ = out.write_str(num.format(limit));
    let _ = out.write_str(remaining_name);
    let _ = out.write_str(num.format(remaining));
    let _ = out.write_str(reset_name);
    write_duration(out, num, reset_ms);
    let _ = out.write_str("\r\n");
}

/// OpenAI's reset format: `20ms`, `1s`, `6m0s`, `1h2m3s`.
fn write_duration(out: &mut impl std::fmt::Write, num: &mut itoa::Buffer, ms: u64) {
    let mut part = |n: u64, unit: &str| {
        let _ = out.write_str(num.format(n));
        let _ = out.write_str(unit);
    };
    if ms < 1000 {
        part(ms, "ms");
        return;
    }
    let s = ms.div_ceil(1000);
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    if h > 0 {
        part(h, "h");
    }
    if h > 0 || m > 0 {
        part(m, "m");
    }
    part(s, "s");
}

/// What a request asks of the limiter.
pub(crate) struct Ask<'a> {
    pub(crate) key: Option<KeyIdx>,
    pub(crate) model: &'a str,
    pub(crate) prompt_estimate: u64,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) n: Option<u64>,
}

/// Reservations held by one admitted request; give it back to [`LimiterShard::settle`].
#[derive(Debug, Default)]
pub(crate) struct Permit {
    entries: Vec<(BudgetId, u64)>,
    pub(crate) headers: RateHeaders,
    settled: bool,
}

impl Permit {
    /// Whether settling it spends the request's tokens: it holds a token budget or a quota
    /// plan (a permit of request counts and concurrency slots only settles the same whatever
    /// the request used).
    pub(crate) fn spends_tokens(&self) -> bool {
        self.entries
            .iter()
            .any(|(id, _)| !matches!(id.kind, KIND_REQUESTS | KIND_CONCURRENCY))
    }
}

pub(crate) struct LimiterShard {
    node: String,
    prefix: String,
    budgets: IdMap<Budget>,
    /// Seeded per process: the names come from clients (see Cargo.toml on foldhash).
    models: HashMap<Box<str>, u32, foldhash::fast::RandomState>,
    spare_entries: Vec<Vec<(BudgetId, u64)>>,
    /// The last exchange succeeded.
    backend_ok: bool,
    /// When the last successful exchange was sent: leases are valid for `lease_ttl` from it.
    last_ok_sent: Option<Mono>,
    lease_ttl: Duration,
    /// Completed exchanges (ok or not): requests waiting for a lease wait for this to move.
    pub(crate) epoch: u64,
    waiters: Vec<Waker>,
    /// A request is waiting: sync now rather than at the end of the interval.
    urgent: bool,
    sync_waker: Option<Waker>,
    /// Cores sharing a budget while the backend is down: nodes × workers.
    down_share: u64,
    down_allow: bool,
    /// Budgets in the last prepared batch, in order.
    in_flight: Vec<BudgetId>,
    /// An exchange was prepared and has not been applied yet.
    exchanging: bool,
    /// When the last exchange was prepared (unix ms), to scale use to a whole interval.
    last_prepare_ms: u64,
    /// When the first exchange after an outage succeeded: for `rejoin_window` after it, a
    /// strict budget asks no more than its outage share (the other cores may not have found
    /// the ledger yet, and the ledger has forgotten the slots they hold if their leases lapsed).
    rejoined_at: Option<Mono>,
    /// Twice [`SyncSettings::rejoin_within`](crate::config::limits::SyncSettings::rejoin_within).
    rejoin_window: Duration,
}

impl LimiterShard {
    pub(crate) fn new(cfg: &LimitsConfig, node: String) -> LimiterShard {
        LimiterShard {
            node,
            prefix: cfg.sync.prefix().to_string(),
            budgets: IdMap::default(),
            models: HashMap::default(),
            spare_entries: Vec::new(),
            backend_ok: true,
            last_ok_sent: None,
            lease_ttl: cfg.sync.lease_ttl,
            epoch: 0,
            waiters: Vec::new(),
            urgent: false,
            sync_waker: None,
            down_share: u64::from(cfg.sync.nodes.max(1)) * u64::from(cfg.sync.workers.max(1)),
            down_allow: cfg.sync.on_down == DownPolicy::Allow,
            in_flight: Vec::new(),
            exchanging: false,
            last_prepare_ms: 0,
            rejoined_at: None,
            rejoin_window: 2 * cfg.sync.rejoin_within(),
        }
    }

    /// Follow a reloaded config: its positions map to the same budgets by name, budgets already
    /// met take its limits at once, and the sync settings a shard applies (lease TTL, what to
    /// do while the backend is down) are its. Budgets of policies, keys or plans it no longer
    /// has are kept for the requests that reserved from them and for their spend to reach the
    /// ledger; nothing admits against them again. (Ledger key prefix, sync backend and
    /// interval are not reloadable: the reload reports them.)
    pub(crate) fn reconfigure(&mut self, cfg: &LimitsConfig, now_ms: u64) {
        self.lease_ttl = cfg.sync.lease_ttl;
        self.rejoin_window = 2 * cfg.sync.rejoin_within();
        self.down_share = u64::from(cfg.sync.nodes.max(1)) * u64::from(cfg.sync.workers.max(1));
        self.down_allow = cfg.sync.on_down == DownPolicy::Allow;
        let ids = &cfg.ids;
        let policies: HashMap<u32, &Policy> =
            ids.policies.iter().copied().zip(&cfg.policies).collect();
        let mut plans: HashMap<(u32, u32), &Plan> = HashMap::new();
        for (k, key) in cfg.keys.iter().enumerate() {
            for (i, plan) in key.plans.iter().enumerate() {
                plans.insert((ids.key(k), ids.plan(k, i)), plan);
            }
        }
        for (id, budget) in &mut self.budgets {
            // A provider's budgets take a reloaded limit when they are next created (a new
            // window; a concurrency budget once idle).
            if id.shape & PROVIDER_SHAPE != 0 {
                continue;
            }
            match id.kind {
                KIND_PLAN => {
                    if let Some(tokens) = plans.get(&(id.owner, id.subject)).and_then(|p| p.tokens)
                    {
                        budget.limit = tokens;
                    }
                }
                KIND_CONCURRENCY => {
                    if let Some(max) = policies.get(&id.owner).and_then(|p| p.concurrency) {
                        budget.limit = max;
                    }
                }
                kind => {
                    let policy = policies.get(&id.owner);
                    let rate = if kind == KIND_REQUESTS {
                        policy.and_then(|p| p.requests)
                    } else {
                        policy.and_then(|p| p.tokens)
                    };
                    // Only within the same window length: a budget of another length is an
                    // old window, ending on its own.
                    if let (Some(new), Some((old, start))) = (rate, budget.rate) {
                        if new.window == old.window {
                            budget.rate = Some((new, start));
                            budget.limit =
                                sliding(&new, start, now_ms, now_ms, budget.prev_total).0;
                        }
                    }
                }
            }
        }
    }

    /// The epoch a request that needs a lease now must wait for: an exchange already on its
    /// way was prepared before the request's demand, so it takes the one after.
    pub(crate) fn lease_epoch(&self) -> u64 {
        self.epoch + 1 + u64::from(self.exchanging)
    }

    pub(crate) fn node(&self) -> &str {
        &self.node
    }

    pub(crate) fn backend_ok(&self) -> bool {
        self.backend_ok
    }

    fn lease_valid(&self, now: Mono) -> bool {
        // Before the first exchange nothing is held, so validity does not matter.
        self.last_ok_sent
            .is_none_or(|t| now.saturating_duration_since(t) < self.lease_ttl)
    }

    fn model_subject(&mut self, model: &str) -> u32 {
        if let Some(&id) = self.models.get(model) {
            return id;
        }
        if self.models.len() >= MAX_MODEL_SUBJECTS {
            return NO_SUBJECT - 1;
        }
        let id = self.models.len() as u32;
        self.models.insert(model.into(), id);
        id
    }

    /// Try to reserve everything `ask` needs. On success the permit holds the reservations.
    pub(crate) fn try_admit(
        &mut self,
        cfg: &LimitsConfig,
        ask: &Ask<'_>,
        permit: &mut Permit,
        matched: &mut dyn FnMut(usize, LimitDimension),
    ) -> Result<(), Refusal> {
        self.try_admit_at(cfg, ask, permit, matched, unix_ms())
    }

    /// [`Self::try_admit`] at a given wall-clock time (unix ms): the windows are those of
    /// `now_ms` (tests drive window edges through it).
    pub(crate) fn try_admit_at(
        &mut self,
        cfg: &LimitsConfig,
        ask: &Ask<'_>,
        permit: &mut Permit,
        matched: &mut dyn FnMut(usize, LimitDimension),
        now_ms: u64,
    ) -> Result<(), Refusal> {
        let now = crate::sys::clock::recent();
        let a = Admission {
            cfg,
            ask,
            key: ask.key.and_then(|k| cfg.keys.get(k)),
            now_ms,
            lease_valid: self.lease_valid(now),
        };
        let mut passed = self.spare_entries.pop().unwrap_or_default();
        passed.clear();
        // Budgets short of a lease: demand is registered on all of them, so one exchange can
        // cure every shortfall of this request.
        let mut short: Vec<(BudgetId, u64)> = Vec::new();
        // Check every budget first (creating it if new); reserve only if all pass.
        let policies = self.check_policies(a, &mut passed, &mut short, matched);
        // Plans matter unless a policy refused for good.
        let plans_matter = policies
            .refusal
            .is_none_or(|r| r.kind == RefusalKind::NeedLease);
        let plan = match (a.key, ask.key) {
            (Some(key), Some(key_idx)) if plans_matter && !key.plans.is_empty() => {
                self.choose_plan(a, key, key_idx, &mut short).map(Some)
            }
            _ => Ok(None),
        };
        // The policies' refusal stands over the plans'.
        let plan = match (policies.refusal, plan) {
            (Some(refusal), _) | (None, Err(refusal)) => {
                self.refuse(&refusal, &short, passed);
                permit.headers = policies.headers;
                return Err(refusal);
            }
            (None, Ok(plan)) => plan,
        };
        passed.extend(plan.and_then(|p| p.entry));
        self.reserve(&passed, a.lease_valid);
        *permit = Permit {
            entries: passed,
            headers: policies.headers,
            settled: false,
        };
        Ok(())
    }

    /// Check every budget of every policy that applies to the request, creating those met for
    /// the first time: those that can take it go to `passed`, those short of a lease to `short`.
    fn check_policies(
        &mut self,
        a: Admission<'_>,
        passed: &mut Vec<(BudgetId, u64)>,
        short: &mut Vec<(BudgetId, u64)>,
        matched: &mut dyn FnMut(usize, LimitDimension),
    ) -> PolicyCheck {
        let mut out = PolicyCheck::default();
        let policies = match a.key {
            Some(k) => k.policies.as_slice(),
            None => a.cfg.anonymous_policies.as_slice(),
        };
        for &p in policies {
            let Some(policy) = a.cfg.policies.get(p) else {
                continue;
            };
            if !policy.enabled || !policy.applies_to_model(a.ask.model) {
                continue;
            }
            let subject = self.subject(policy.per, a);
            for limit in PolicyLimit::all(policy, a.ask) {
                let Some(limit) = limit else {
                    continue;
                };
                matched(p, limit.dimension);
                let id = self.policy_budget(a, p, policy, subject, &limit);
                let Some(budget) = self.budgets.get(&id) else {
                    continue;
                };
                let reset_ms = budget.ends_at_ms.saturating_sub(a.now_ms);
                let remaining = budget.remaining().saturating_sub(limit.cost);
                out.headers
                    .keep_tightest(limit.kind, (limit.limit, remaining, reset_ms));
                // The budget just read, not looked up again.
                match self.check_budget(budget, id.kind, limit.cost, a.lease_valid) {
                    Ok(()) => passed.push((id, limit.cost)),
                    Err(kind) => {
                        if kind == RefusalKind::NeedLease {
                            short.push((id, limit.cost));
                        }
                        let retry_after = match limit.dimension {
                            LimitDimension::Concurrency => Some(1),
                            _ => Some(reset_ms.div_ceil(1000).max(1) as u32),
                        };
                        out.keep_worst(Refusal {
                            kind,
                            policy: Some(p),
                            dimension: limit.dimension,
                            retry_after,
                            limit: limit.limit,
                        });
                    }
                }
            }
        }
        out
    }

    /// Whose counter a policy's budgets are: everyone's, the request's key's, its entity's or
    /// its model's.
    fn subject(&mut self, per: Per, a: Admission<'_>) -> u32 {
        match per {
            Per::Global => 0,
            Per::Key => a.ask.key.map_or(NO_SUBJECT, |k| a.cfg.ids.key(k)),
            Per::Entity => a
                .key
                .and_then(|k| k.entity)
                .map_or(NO_SUBJECT, |e| a.cfg.ids.entity(e)),
            Per::Model => self.model_subject(a.ask.model),
        }
    }

    /// The budget of one policy limit for `subject` in the current window, created when first
    /// met.
    fn policy_budget(
        &mut self,
        a: Admission<'_>,
        p: usize,
        policy: &Policy,
        subject: u32,
        limit: &PolicyLimit,
    ) -> BudgetId {
        let window_ms = limit.window_ms;
        let window = a.now_ms.checked_div(window_ms).unwrap_or(0);
        let id = BudgetId {
            kind: limit.kind,
            owner: a.cfg.ids.policy(p),
            subject,
            window,
            // A reload that changes whose budgets they are, or the window's length, makes them
            // other budgets (their subjects and window numbers mean other things).
            shape: (per_code(policy.per) << 56) | window_ms,
        };
        if !self.budgets.contains_key(&id) {
            let mut k = String::with_capacity(64);
            k.push('{');
            k.push_str(&self.prefix);
            k.push_str(":p:");
            k.push_str(&policy.id);
            k.push(':');
            k.push_str(&subject_name(policy.per, subject, a));
            k.push('}');
            self.insert_limit_budget(id, k, limit, limit.kind == KIND_CONCURRENCY, a.now_ms);
        }
        id
    }

    /// Create the budget `id` of one limit (a policy's or a provider's), its ledger key `k`
    /// (the hash-tagged base) followed by the kind and, for a window, the window's number.
    fn insert_limit_budget(
        &mut self,
        id: BudgetId,
        mut k: String,
        limit: &PolicyLimit,
        strict: bool,
        now_ms: u64,
    ) {
        let window_ms = limit.window_ms;
        let window = id.window;
        {
            let kind_name = ["r", "t", "c"][limit.kind as usize];
            k.push(':');
            k.push_str(kind_name);
            if window_ms > 0 {
                k.push(':');
                k.push_str(&window.to_string());
            }
            let start = window * window_ms;
            // A rate window slides over the one before it: until the ledger says how much that
            // one admitted, this core's own view of it stands in.
            let (prev_key, prev_total) = match (limit.rate, window.checked_sub(1)) {
                (Some(_), Some(prev)) => {
                    let mut prev_key = String::with_capacity(k.len());
                    prev_key.push_str(k.rsplit_once(':').map_or(k.as_str(), |(base, _)| base));
                    prev_key.push(':');
                    prev_key.push_str(&prev.to_string());
                    let prev_id = BudgetId { window: prev, ..id };
                    let seen = self.budgets.get(&prev_id).map_or(0, Budget::window_total);
                    (Some(prev_key), seen)
                }
                _ => (None, 0),
            };
            let mut budget = new_budget(
                k,
                limit.rate.map_or(limit.limit, |r| {
                    sliding(&r, start, now_ms, now_ms, prev_total).0
                }),
                strict,
                limit.rate.map(|r| (r, start)),
                if window_ms > 0 { 2 * window_ms } else { 0 },
                if window_ms > 0 { start + window_ms } else { 0 },
            );
            budget.prev_key = prev_key;
            budget.prev_total = prev_total;
            self.budgets.insert(id, budget);
        }
    }

    /// Reserve `tokens` (and a request, and a slot) for one attempt on a provider's limits —
    /// a cluster's and its credential's, those given — without waiting: on success `permit`
    /// holds the reservations (settle it with the attempt's usage, or [`Self::release`] it if
    /// the attempt was never sent). A refusal (the limit used up, or this core holding too
    /// small a lease: it asks for one at the next exchange) says the provider would not take
    /// the attempt now.
    pub(crate) fn try_reserve_provider(
        &mut self,
        limits: [Option<&ProviderLimits>; 2],
        tokens: u64,
        permit: &mut Permit,
    ) -> Result<(), Refusal> {
        let now_ms = unix_ms();
        let lease_valid = self.lease_valid(crate::sys::clock::recent());
        let mut passed = self.spare_entries.pop().unwrap_or_default();
        passed.clear();
        let mut short: Vec<(BudgetId, u64)> = Vec::new();
        let mut refusal: Option<Refusal> = None;
        for provider in limits.into_iter().flatten() {
            // Owner and subject: a 64-bit hash of the name (a reload keeps a name's budgets;
            // the high bit of the shape keeps them apart from every policy's).
            let hash = {
                use std::hash::Hasher;
                let mut h = IdHasher::default();
                h.write(provider.name.as_bytes());
                h.finish()
            };
            for limit in PolicyLimit::provider(provider, tokens)
                .into_iter()
                .flatten()
            {
                let window = now_ms.checked_div(limit.window_ms).unwrap_or(0);
                let id = BudgetId {
                    kind: limit.kind,
                    owner: hash as u32,
                    subject: (hash >> 32) as u32,
                    window,
                    shape: PROVIDER_SHAPE | limit.window_ms,
                };
                if !self.budgets.contains_key(&id) {
                    let mut k = String::with_capacity(64);
                    k.push('{');
                    k.push_str(&self.prefix);
                    k.push_str(":v:");
                    k.push_str(&provider.name);
                    k.push('}');
                    // Strict, every limit: a provider's limit is one never to pass (past it
                    // come its 429s), so no admission on credit.
                    self.insert_limit_budget(id, k, &limit, true, now_ms);
                }
                match self.check(&id, limit.cost, lease_valid) {
                    Ok(()) => passed.push((id, limit.cost)),
                    Err(kind) => {
                        if kind == RefusalKind::NeedLease {
                            short.push((id, limit.cost));
                        }
                        let reset_ms = self
                            .budgets
                            .get(&id)
                            .map_or(0, |b| b.ends_at_ms.saturating_sub(now_ms));
                        let found = Refusal {
                            kind,
                            policy: None,
                            dimension: limit.dimension,
                            retry_after: Some(reset_ms.div_ceil(1000).clamp(1, 60) as u32),
                            limit: limit.limit,
                        };
                        if refusal.is_none_or(|r| {
                            r.kind == RefusalKind::NeedLease && kind != RefusalKind::NeedLease
                        }) {
                            refusal = Some(found);
                        }
                    }
                }
            }
        }
        if let Some(refusal) = refusal {
            self.refuse(&refusal, &short, passed);
            if refusal.kind == RefusalKind::NeedLease {
                // Nobody waits for it (the attempt goes elsewhere), but the lease should come
                // at once, not at the end of the interval.
                self.hurry();
            }
            return Err(refusal);
        }
        self.reserve(&passed, lease_valid);
        *permit = Permit {
            entries: passed,
            headers: RateHeaders::default(),
            settled: false,
        };
        Ok(())
    }

    /// Give a permit's reservations back without any spend (an attempt that was never sent).
    pub(crate) fn release(&mut self, permit: &mut Permit) {
        if permit.settled {
            return;
        }
        permit.settled = true;
        for (id, reserved) in permit.entries.drain(..) {
            if let Some(b) = self.budgets.get_mut(&id) {
                b.reserved = b.reserved.saturating_sub(reserved);
            }
        }
        let spare = std::mem::take(&mut permit.entries);
        // Only a buffer worth reusing: an empty permit's (a target with no provider limits)
        // would hand the next admission a buffer it must allocate anyway.
        if spare.capacity() > 0 && self.spare_entries.len() < 1024 {
            self.spare_entries.push(spare);
        }
    }

    /// The key's quota plan to charge: the first, by priority, that can cover the reservation.
    /// The first plan short of a lease goes to `short`.
    fn choose_plan(
        &mut self,
        a: Admission<'_>,
        key: &ApiKey,
        key_idx: KeyIdx,
        short: &mut Vec<(BudgetId, u64)>,
    ) -> Result<ChosenPlan, Refusal> {
        let cost = a
            .cfg
            .reserve
            .tokens(a.ask.prompt_estimate, a.ask.max_tokens, a.ask.n);
        let now_s = a.now_ms / 1000;
        let mut hope = false;
        let mut any_down = false;
        let mut soonest_reset: Option<u64> = None;
        for (index, plan) in key.plans.iter().enumerate() {
            if plan.expires.is_some_and(|e| now_s >= e) {
                continue;
            }
            let Some(tokens) = plan.tokens else {
                return Ok(ChosenPlan { entry: None });
            };
            let (id, end_s) =
                self.plan_budget(&a.cfg.ids, key, key_idx, index, plan, tokens, now_s);
            if plan.period != Period::Once {
                let reset = end_s.saturating_sub(now_s);
                soonest_reset = Some(soonest_reset.map_or(reset, |r| r.min(reset)));
            }
            match self.check(&id, cost, a.lease_valid) {
                Ok(()) => {
                    return Ok(ChosenPlan {
                        entry: Some((id, cost)),
                    })
                }
                Err(RefusalKind::NeedLease) => {
                    if !hope {
                        hope = true;
                        short.push((id, cost));
                    }
                }
                Err(RefusalKind::BackendDown) => any_down = true,
                Err(RefusalKind::Exhausted) => {}
            }
        }
        let kind = if hope {
            RefusalKind::NeedLease
        } else if any_down {
            RefusalKind::BackendDown
        } else {
            RefusalKind::Exhausted
        };
        Err(Refusal {
            kind,
            policy: None,
            dimension: LimitDimension::Quota,
            retry_after: soonest_reset.map(|s| s.clamp(1, u32::MAX as u64) as u32),
            limit: 0,
        })
    }

    /// The budget of a key's quota plan (`index` into its plans) in the period containing
    /// `now_s`, created when first met; and when that period ends (unix seconds).
    #[allow(clippy::too_many_arguments)] // the plan, where it sits, and the moment
    fn plan_budget(
        &mut self,
        ids: &StableIds,
        key: &ApiKey,
        key_idx: KeyIdx,
        index: usize,
        plan: &Plan,
        tokens: u64,
        now_s: u64,
    ) -> (BudgetId, u64) {
        let (period, start_s, end_s) = period_of(plan, now_s);
        let id = BudgetId {
            kind: KIND_PLAN,
            owner: ids.key(key_idx),
            subject: ids.plan(key_idx, index),
            window: period,
            shape: match plan.period {
                Period::Once => 0,
                Period::Days(n) => u64::from(n),
                Period::Monthly => u64::MAX,
            },
        };
        if !self.budgets.contains_key(&id) {
            let mut name = format!("{{{}:q:{}:{}}}", self.prefix, key.id, plan.id);
            let ttl = match plan.period {
                Period::Once => 0,
                _ => {
                    name.push_str(&format!(":{period}"));
                    (end_s - start_s + 86_400) * 1000
                }
            };
            self.budgets.insert(
                id,
                new_budget(name, tokens, true, None, ttl, end_s.saturating_mul(1000)),
            );
        }
        (id, end_s)
    }

    /// After a refusal: when a lease may cure it, ask for enough at the next sync; keep the
    /// request's (emptied) list of reservations for the next one.
    fn refuse(
        &mut self,
        refusal: &Refusal,
        short: &[(BudgetId, u64)],
        mut passed: Vec<(BudgetId, u64)>,
    ) {
        if refusal.kind == RefusalKind::NeedLease {
            for (id, cost) in short {
                if let Some(b) = self.budgets.get_mut(id) {
                    b.demand += cost;
                }
            }
        }
        passed.clear();
        self.spare_entries.push(passed);
    }

    /// Every budget passed its check: reserve the request's cost on each.
    fn reserve(&mut self, entries: &[(BudgetId, u64)], lease_valid: bool) {
        for (id, cost) in entries {
            if let Some(b) = self.budgets.get_mut(id) {
                if !b.strict && b.free(lease_valid) < *cost as i64 {
                    b.credit = true;
                }
                b.reserved += cost;
                b.used_since_sync += cost;
                b.idle_syncs = 0;
            }
        }
    }

    /// Can `cost` be taken from budget `id` now?
    fn check(&self, id: &BudgetId, cost: u64, lease_valid: bool) -> Result<(), RefusalKind> {
        let Some(b) = self.budgets.get(id) else {
            return Err(RefusalKind::Exhausted);
        };
        self.check_budget(b, id.kind, cost, lease_valid)
    }

    /// [`Self::check`] of a budget already looked up (`kind`: its id's).
    fn check_budget(
        &self,
        b: &Budget,
        kind: u8,
        cost: u64,
        lease_valid: bool,
    ) -> Result<(), RefusalKind> {
        if !self.backend_ok && self.down_allow && kind == KIND_CONCURRENCY {
            return self.outage_slots(b, cost, lease_valid);
        }
        if b.free(lease_valid) >= cost as i64 {
            return Ok(());
        }
        // A lease gone stale while the ledger answers is no outage: this worker simply had
        // nothing to exchange for a while; the next (hurried) exchange renews it.
        if !self.backend_ok {
            // The ledger is unreachable. Rate limits and concurrency may serve on this core's
            // share when so configured; quotas spend only what is held.
            let plan = kind == KIND_PLAN;
            if self.down_allow && !plan {
                // This core's use of the budget (a window's or the slots) within its share.
                let share = b.outage_share(self.down_share);
                if b.spent + b.reserved + cost <= share {
                    return Ok(());
                }
                return Err(RefusalKind::Exhausted);
            }
            return Err(RefusalKind::BackendDown);
        }
        let need = cost - b.free(lease_valid).max(0) as u64;
        let room = b.ledger_room().is_none_or(|room| room >= need);
        if !b.strict && !b.credit && room {
            // One admission on credit per exchange: the rate limits' bounded overshoot.
            return Ok(());
        }
        // A strict budget whose room is held as others' leases is not used up: those leases
        // are idle slack that their holders give back once this core reports its shortfall.
        // Refusing here (as this did) turned one busy holder into a stream of 429s on every
        // other core for a limit that was not reached.
        if room || (b.strict && b.hard_room() >= cost) {
            Err(RefusalKind::NeedLease)
        } else {
            Err(RefusalKind::Exhausted)
        }
    }

    /// A concurrency budget while the ledger is unreachable and the policy is to serve on local
    /// shares. The held lease and the share are one allowance, not two: while this core's
    /// leases are live in the ledger (where every other core counts them), its slots stay
    /// within its lease — nothing, for a budget it holds none of — and within its share, so
    /// that what it admitted meanwhile still fits its share when the leases lapse; after that,
    /// within its share. So the slots in use never pass the limit while leases last, nor the
    /// cores' shares together (`nodes × workers × ⌈limit / (nodes × workers)⌉`) after. Before
    /// any exchange ever succeeded this core holds nothing anywhere: its share. (The price: a
    /// core holding more than its share admits no more than that while an exchange fails.)
    fn outage_slots(&self, b: &Budget, cost: u64, lease_valid: bool) -> Result<(), RefusalKind> {
        let share = b.outage_share(self.down_share);
        let cap = if self.last_ok_sent.is_some() && lease_valid {
            share.min(b.granted)
        } else {
            share
        };
        if b.reserved + cost <= cap {
            Ok(())
        } else {
            Err(RefusalKind::Exhausted)
        }
    }

    /// End a permit: turn its reservations into spend. `tokens`: what the request used (0 to
    /// release, e.g. after an upstream error). Runs once; a second call does nothing.
    pub(crate) fn settle(&mut self, permit: &mut Permit, tokens: u64) {
        if permit.settled {
            return;
        }
        permit.settled = true;
        for (id, reserved) in permit.entries.drain(..) {
            if let Some(b) = self.budgets.get_mut(&id) {
                b.reserved = b.reserved.saturating_sub(reserved);
                b.spent += match id.kind {
                    KIND_REQUESTS => 1,
                    KIND_CONCURRENCY => 0,
                    _ => tokens,
                };
            }
        }
        let spare = std::mem::take(&mut permit.entries);
        // Only a buffer worth reusing: an empty permit's (a target with no provider limits)
        // would hand the next admission a buffer it must allocate anyway.
        if spare.capacity() > 0 && self.spare_entries.len() < 1024 {
            self.spare_entries.push(spare);
        }
    }

    /// Fill `out` with this core's exchange for every budget in use. Leases are lowered
    /// locally to what is guaranteed whatever the exchange's fate (see the module doc).
    pub(crate) fn prepare(&mut self, now_ms: u64, interval: Duration, out: &mut Vec<BudgetSync>) {
        out.clear();
        self.in_flight.clear();
        let now = crate::sys::clock::recent();
        let lease_valid = self.lease_valid(now);
        // An exchange prepared during an outage may be the first to succeed: sized as one
        // within the rejoin window.
        let rejoining = !self.backend_ok
            || self
                .rejoined_at
                .is_some_and(|t| now.saturating_duration_since(t) < self.rejoin_window);
        let ahead = interval.as_millis() as u64;
        let interval_ms = ahead.max(1);
        let elapsed_ms = now_ms.saturating_sub(self.last_prepare_ms).clamp(1, 60_000);
        self.last_prepare_ms = now_ms;
        self.budgets.retain(|id, b| {
            // A budget is dropped only when forgetting it loses nothing: its window or period
            // is over, or it never spends (concurrency) and has been idle a while. Any other
            // budget keeps this core's cumulative spend, which the ledger needs as it is
            // (a recreated budget would restart from 0 and be ignored until it passed it).
            let over = b.ends_at_ms > 0 && now_ms >= b.ends_at_ms;
            let idle_slots = id.kind == KIND_CONCURRENCY && b.idle_syncs >= 200;
            b.busy() || !(over || idle_slots)
        });
        // Budgets whose window is over go first: their leases go back (down to what is in
        // flight) before the ledger weighs them against the windows that follow them.
        let down_share = self.down_share;
        for over_pass in [true, false] {
            for (id, b) in self.budgets.iter_mut() {
                let over = b.ends_at_ms > 0 && now_ms >= b.ends_at_ms;
                if over != over_pass {
                    continue;
                }
                if let Some(sync) = prepare_budget(
                    b,
                    now_ms,
                    ahead,
                    interval_ms,
                    elapsed_ms,
                    lease_valid,
                    down_share,
                    // Slots a core took on its outage share may be unknown to the ledger.
                    rejoining && id.kind == KIND_CONCURRENCY,
                ) {
                    out.push(sync);
                    self.in_flight.push(*id);
                }
            }
        }
        self.exchanging = true;
    }

    /// Take the exchange's result. `sent_at`: when it was sent (leases count from then).
    pub(crate) fn apply(
        &mut self,
        result: Result<&[BudgetState], ()>,
        sent: &[BudgetSync],
        sent_at: Mono,
    ) {
        match result {
            Ok(states) => {
                // Back from an outage: the ledger may not know the slots the other cores hold
                // (it restarted empty, or their leases lapsed while they served on shares).
                if !self.backend_ok {
                    self.rejoined_at = Some(sent_at);
                }
                self.backend_ok = true;
                self.last_ok_sent = Some(sent_at);
                for ((id, state), s) in self.in_flight.iter().zip(states).zip(sent) {
                    if let Some(b) = self.budgets.get_mut(id) {
                        b.granted = state.granted;
                        if b.strict && b.rate.is_none() {
                            // A floor the ledger had to take past the limit (slots taken on an
                            // outage share) is no grant: admit nothing more until what is in
                            // use fits the limit again.
                            let backed = b
                                .limit
                                .saturating_sub(state.spent_total + state.leased_others);
                            b.granted = b.granted.min(backed);
                        }
                        b.view = Some(*state);
                        // The ledger's total of the previous window is the one to slide over.
                        if let Some(slide) = &s.slide {
                            b.prev_total = state.prev_total;
                            b.limit = slid_limit(
                                s.limit,
                                slide.max,
                                state.prev_total,
                                slide.overlap_ms,
                                slide.window_ms,
                            );
                        }
                        b.flushed = b.flushed.max(s.spent);
                        b.credit = false;
                    }
                }
            }
            Err(()) => self.backend_ok = false,
        }
        self.in_flight.clear();
        self.exchanging = false;
        self.epoch += 1;
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }

    /// An interval with nothing to exchange still counts as a completed exchange for waiters.
    pub(crate) fn tick(&mut self) {
        self.exchanging = false;
        self.epoch += 1;
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }

    /// A request waits for the next exchange: register its waker and hurry the sync task.
    pub(crate) fn wait_for_sync(&mut self, waker: &Waker) {
        self.waiters.push(waker.clone());
        self.urgent = true;
        if let Some(w) = self.sync_waker.take() {
            w.wake();
        }
    }

    /// Ask the sync task to exchange now rather than at the end of the interval.
    pub(crate) fn hurry(&mut self) {
        self.urgent = true;
        if let Some(w) = self.sync_waker.take() {
            w.wake();
        }
    }

    /// The sync task asks whether to run now; otherwise it is woken when a request waits.
    pub(crate) fn take_urgent(&mut self, waker: &Waker) -> bool {
        if std::mem::take(&mut self.urgent) {
            return true;
        }
        self.sync_waker = Some(waker.clone());
        false
    }
}

/// One budget's part of an exchange (see [`LimiterShard::prepare`]); `None` when it has nothing
/// to exchange.
#[allow(clippy::too_many_arguments)] // the budget, and the moment as `prepare` sees it
fn prepare_budget(
    b: &mut Budget,
    now_ms: u64,
    ahead: u64,
    interval_ms: u64,
    elapsed_ms: u64,
    lease_valid: bool,
    down_share: u64,
    // A concurrency budget within the rejoin window (see `LimiterShard::rejoined_at`).
    rejoining: bool,
) -> Option<BudgetSync> {
    let over = b.ends_at_ms > 0 && now_ms >= b.ends_at_ms;
    // Rounded up: a sync that ran late (a busy machine) must not turn one request into
    // no use at all, or the budget is taken for quiet and its lease given back.
    let scaled = (u128::from(b.used_since_sync) * u128::from(interval_ms))
        .div_ceil(u128::from(elapsed_ms)) as u64;
    b.recent_use = scaled.max(b.recent_use / 2);
    if !b.busy() && b.recent_use == 0 && b.demand == 0 {
        b.idle_syncs += 1;
        return None;
    }
    // A rate window's limit: its allowance for the interval ahead (paced windows
    // grow), less the previous window's weighted use as of now (the ledger applies
    // its own, fresher, total of that window; see `apply`).
    let mut slide = None;
    let mut limit = b.limit;
    if let Some((rate, start)) = b.rate {
        limit = rate.allowance(start, now_ms + ahead);
        let overlap_ms;
        (b.limit, overlap_ms) = sliding(&rate, start, now_ms + ahead, now_ms, b.prev_total);
        slide = b.prev_key.as_ref().map(|k| Slide {
            prev_key: k.clone(),
            max: rate.max,
            overlap_ms,
            window_ms: rate.window_ms(),
        });
    }
    let held = if lease_valid {
        b.granted as i64 - (b.spent - b.spent_at_grant) as i64
    } else {
        0
    }
    .max(0) as u64;
    // Enough for twice the last interval's use plus what waiting requests need, and at
    // least 1/64 of the limit, so a busy core rarely runs dry between exchanges while
    // a handful of cores can't hoard a strict budget.
    if b.used_since_sync == 0 {
        b.idle_syncs += 1;
    }
    // A budget gone quiet keeps its minimum slice (1/64 of the limit) for a while, so
    // the next request of a slow caller (one stream every few seconds) doesn't wait a
    // round trip for a lease; after KEEP_QUIET_SYNCS quiet exchanges it goes back.
    let quiet = b.recent_use == 0 && b.demand == 0;
    //
    // A strict budget (quota, concurrency) can't overshoot, so slack one core holds idle
    // is slack another core's waiting request can't have: its slack is capped at this
    // core's fair share, and given up entirely while another core reports a shortfall.
    let others_wait = b.view.is_some_and(|v| v.wanted_others > 0);
    // 1/64 of the limit, and at least one unit: a small limit (2 concurrent requests)
    // has no 1/64th, and without a slice every request of a slow caller waited.
    let min_slice = (b.limit / 64).max(1).min(b.limit);
    let target_free = if over || (quiet && b.idle_syncs >= KEEP_QUIET_SYNCS) {
        0
    } else if b.strict && others_wait {
        b.demand
    } else if quiet {
        min_slice
    } else {
        (2 * b.recent_use + b.demand).max(min_slice).min(b.limit)
    };
    let target_free = if rejoining {
        // Concurrency just back from an outage: the other cores may still be serving on their
        // shares, slots the ledger may have forgotten; this core asks no more than its share.
        target_free.min(b.outage_share(down_share).saturating_sub(b.reserved))
    } else if b.strict {
        target_free.min(b.limit.div_ceil(down_share).max(b.demand))
    } else {
        target_free
    };
    let lease = b.reserved + target_free;
    let floor = lease.min(held).max(b.reserved);
    b.granted = floor;
    b.spent_at_grant = b.spent;
    b.used_since_sync = 0;
    let shortfall = std::mem::take(&mut b.demand);
    Some(BudgetSync {
        key: b.key.clone(),
        limit,
        spent: b.spent,
        lease,
        floor,
        key_ttl_ms: b.key_ttl_ms,
        shortfall,
        slide,
    })
}

/// What one admission is decided on: the config, the request and its key, and when.
#[derive(Clone, Copy)]
struct Admission<'a> {
    cfg: &'a LimitsConfig,
    ask: &'a Ask<'a>,
    key: Option<&'a ApiKey>,
    now_ms: u64,
    /// The leases this core holds are still good (see [`LimiterShard::lease_valid`]).
    lease_valid: bool,
}

/// One limit of a policy, as a budget to check: its kind, size and window, and what the
/// request costs it.
#[derive(Clone, Copy)]
struct PolicyLimit {
    kind: u8,
    dimension: LimitDimension,
    limit: u64,
    /// Requests and tokens: the rate (concurrency has none).
    rate: Option<RateLimit>,
    /// 0: no window (concurrency).
    window_ms: u64,
    cost: u64,
}

impl PolicyLimit {
    /// A provider's requests, tokens and concurrency limits for an attempt using `tokens`.
    fn provider(p: &ProviderLimits, tokens: u64) -> [Option<PolicyLimit>; 3] {
        let rate = |kind, dimension, r: RateLimit, cost| PolicyLimit {
            kind,
            dimension,
            limit: r.max,
            rate: Some(r),
            window_ms: r.window.as_millis() as u64,
            cost,
        };
        [
            p.requests
                .map(|r| rate(KIND_REQUESTS, LimitDimension::Rpm, r, 1)),
            p.tokens
                .map(|r| rate(KIND_TOKENS, LimitDimension::Tpm, r, tokens)),
            p.concurrency.map(|c| PolicyLimit {
                kind: KIND_CONCURRENCY,
                dimension: LimitDimension::Concurrency,
                limit: c,
                rate: None,
                window_ms: 0,
                cost: 1,
            }),
        ]
    }

    /// A policy's requests, tokens and concurrency limits, `None` for those it does not set.
    fn all(policy: &Policy, ask: &Ask<'_>) -> [Option<PolicyLimit>; 3] {
        let rate = |kind, dimension, r: RateLimit, cost| PolicyLimit {
            kind,
            dimension,
            limit: r.max,
            rate: Some(r),
            window_ms: r.window.as_millis() as u64,
            cost,
        };
        [
            policy
                .requests
                .map(|r| rate(KIND_REQUESTS, LimitDimension::Rpm, r, 1)),
            policy.tokens.map(|r| {
                let cost = policy
                    .reserve
                    .tokens(ask.prompt_estimate, ask.max_tokens, ask.n);
                rate(KIND_TOKENS, LimitDimension::Tpm, r, cost)
            }),
            policy.concurrency.map(|c| PolicyLimit {
                kind: KIND_CONCURRENCY,
                dimension: LimitDimension::Concurrency,
                limit: c,
                rate: None,
                window_ms: 0,
                cost: 1,
            }),
        ]
    }
}

/// What checking the policies found, besides the budgets that passed or are short of a lease.
#[derive(Default)]
struct PolicyCheck {
    headers: RateHeaders,
    refusal: Option<Refusal>,
}

impl PolicyCheck {
    /// Keep the refusal that says most: one waiting cannot cure beats one a lease might;
    /// otherwise the first stands.
    fn keep_worst(&mut self, refusal: Refusal) {
        if self.refusal.is_none_or(|r| {
            r.kind == RefusalKind::NeedLease && refusal.kind != RefusalKind::NeedLease
        }) {
            self.refusal = Some(refusal);
        }
    }
}

/// The quota plan a request is charged to.
#[derive(Clone, Copy)]
struct ChosenPlan {
    /// The reservation; `None` for an unlimited plan.
    entry: Option<(BudgetId, u64)>,
}

/// How a policy budget's subject reads in its ledger key.
fn subject_name(per: Per, subject: u32, a: Admission<'_>) -> String {
    match per {
        Per::Global => String::from("all"),
        Per::Key => a.key.map_or_else(|| "-".into(), |k| format!("k:{}", k.id)),
        Per::Entity => a
            .key
            .and_then(|k| k.entity)
            .and_then(|e| a.cfg.entities.get(e))
            .map_or_else(|| "-".into(), |e| format!("e:{e}")),
        Per::Model if subject == NO_SUBJECT - 1 => "m:*overflow*".into(),
        Per::Model => format!("m:{}", a.ask.model),
    }
}

fn new_budget(
    key: String,
    limit: u64,
    strict: bool,
    rate: Option<(RateLimit, u64)>,
    key_ttl_ms: u64,
    ends_at_ms: u64,
) -> Budget {
    Budget {
        key,
        limit,
        strict,
        rate,
        prev_key: None,
        prev_total: 0,
        key_ttl_ms,
        ends_at_ms,
        spent: 0,
        flushed: 0,
        granted: 0,
        spent_at_grant: 0,
        reserved: 0,
        credit: false,
        view: None,
        used_since_sync: 0,
        recent_use: 0,
        demand: 0,
        idle_syncs: 0,
    }
}

/// (period index, start, end) in unix seconds of the plan's period containing `now_s`.
pub(crate) fn period_of(plan: &Plan, now_s: u64) -> (u64, u64, u64) {
    match plan.period {
        Period::Once => (0, plan.anchor, u64::MAX / 2000),
        Period::Days(n) => {
            let len = u64::from(n) * 86_400;
            let since = now_s.saturating_sub(plan.anchor);
            let idx = since / len;
            let start = plan.anchor + idx * len;
            (idx, start, start + len)
        }
        Period::Monthly => {
            // Calendar months from the anchor's day-of-month and time (clamped to short
            // months by counting from the 1st plus the anchor's offset into its month).
            let anchor_days = (plan.anchor / 86_400) as i64;
            let (ay, am) = civil_year_month(anchor_days);
            let anchor_month_start = days_from_civil(ay, am, 1) as u64 * 86_400;
            let offset = plan.anchor - anchor_month_start;
            let (ny, nm) = civil_year_month((now_s / 86_400) as i64);
            let mut months = (ny - ay) * 12 + i64::from(nm) - i64::from(am);
            let start_of = |m: i64| -> u64 {
                let total = i64::from(am) - 1 + m;
                let y = ay + total.div_euclid(12);
                let mo = total.rem_euclid(12) as u32 + 1;
                days_from_civil(y, mo, 1).max(0) as u64 * 86_400 + offset
            };
            if now_s < start_of(months) {
                months -= 1;
            }
            let months = months.max(0);
            (months as u64, start_of(months), start_of(months + 1))
        }
    }
}

#[cfg(test)]
mod tests_support {
    // Tests: unwraps state expectations; sleeps run on the test thread, not on a worker.
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]
    use super::*;
    use crate::config::limits::LimitsConfig;
    use crate::limits::ledger::InProcessLedger;
    use std::sync::Arc;
    use std::time::Instant;

    pub(super) fn limits(extra: &str) -> Arc<LimitsConfig> {
        let text = format!(
            r#"
[clusters.main]
backends = [{{ base_url = "http://127.0.0.1:9/v1" }}]
[[routes]]
model = "m"
cluster = "main"
[limits]
{ttl}
{extra}
[[keys]]
id = "k"
sha256 = "{}"
entity = "e"
plans = [{{ id = "q", tokens = 10000 }}]
"#,
            crate::config::limits::hex(&crate::config::limits::digest(b"k")),
            ttl = if extra.contains("lease_ttl_ms") {
                ""
            } else {
                "lease_ttl_ms = 60000"
            },
        );
        crate::config::load(&text, &|_| None).unwrap().limits
    }

    pub(super) struct Rng(pub u64);
    impl Rng {
        pub(super) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// A request without a key, for model `m`, reserving 1 token.
    pub(super) fn anonymous() -> Ask<'static> {
        Ask {
            key: None,
            model: "m",
            prompt_estimate: 1,
            max_tokens: Some(1),
            n: None,
        }
    }

    pub(super) fn ask(max_tokens: u64) -> Ask<'static> {
        Ask {
            key: Some(0),
            model: "m",
            prompt_estimate: 20,
            max_tokens: Some(max_tokens),
            n: None,
        }
    }

    /// One sync round for every shard, in the given order.
    pub(super) fn sync_all(shards: &mut [LimiterShard], ledger: &InProcessLedger, order: &[usize]) {
        let mut batch = Vec::new();
        let mut states = Vec::new();
        for &i in order {
            let s = &mut shards[i];
            s.prepare(unix_ms(), Duration::from_millis(50), &mut batch);
            let node = s.node().to_string();
            ledger.exchange_at(Instant::now(), &node, 60_000, &batch, &mut states);
            s.apply(Ok(&states), &batch, Mono::now());
        }
    }

    pub(super) fn plan_use(shards: &[LimiterShard]) -> (u64, u64) {
        let mut spent = 0;
        let mut reserved = 0;
        for s in shards {
            for (id, b) in &s.budgets {
                if id.kind == KIND_PLAN {
                    spent += b.spent;
                    reserved += b.reserved;
                }
            }
        }
        (spent, reserved)
    }
}

#[cfg(test)]
mod tests {
    // Tests: unwraps state expectations; sleeps run on the test thread, not on a worker.
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]
    use super::tests_support::*;
    use super::*;
    use crate::limits::ledger::InProcessLedger;
    use std::time::Instant;

    #[test]
    fn a_reconfigured_shard_keeps_each_budget_under_its_name() {
        let key = |id: &str| {
            let sha = crate::config::limits::hex(&crate::config::limits::digest(id.as_bytes()));
            format!("[[keys]]\nid = \"{id}\"\nsha256 = \"{sha}\"\n")
        };
        let policy = |id: &str, max: u64| {
            format!("[[policies]]\nid = \"{id}\"\nper = \"key\"\nmax_requests = {max}\nrequests_window_secs = 3600\n")
        };
        let load = |rest: String| {
            let text = format!(
                "[clusters.main]\nbackends = [{{ base_url = \"http://127.0.0.1:9/v1\" }}]\n\
                 [[routes]]\nmodel = \"m\"\ncluster = \"main\"\n{rest}"
            );
            crate::config::load(&text, &|_| None).unwrap().limits
        };
        // Before: alice is key 0, policy `a` is policy 0. After: bob first, `b` before `a`, and
        // `a` raised to 4.
        let old = load(format!("{}{}{}", key("alice"), key("bob"), policy("a", 3)));
        let new = load(format!(
            "{}{}{}{}",
            key("bob"),
            key("alice"),
            policy("b", 100),
            policy("a", 4)
        ));
        let ledger = InProcessLedger::new();
        let mut shards = vec![LimiterShard::new(&old, "n0".into())];
        let admit = |shards: &mut Vec<LimiterShard>, cfg: &LimitsConfig, key: usize| {
            let ask = Ask {
                key: Some(key),
                ..ask(1)
            };
            for _ in 0..10 {
                let mut p = Permit::default();
                match shards[0].try_admit(cfg, &ask, &mut p, &mut |_, _| {}) {
                    Ok(()) => {
                        shards[0].settle(&mut p, 1);
                        return true;
                    }
                    Err(r) if r.kind == RefusalKind::NeedLease => {
                        sync_all(shards, &ledger, &[0]);
                    }
                    Err(_) => return false,
                }
            }
            false
        };
        assert!(admit(&mut shards, &old, 0));
        shards[0].reconfigure(&new, unix_ms());
        // A request that started on the old config (its generation is kept to its end) is
        // still alice's, by the old config's positions, though key 0 is bob's now.
        assert!(admit(&mut shards, &old, 0));
        // Alice (now key 1) once more: counted under `b` and under `a`, each its own budget.
        assert!(admit(&mut shards, &new, 1));
        let mut batch = Vec::new();
        shards[0].prepare(unix_ms(), Duration::from_millis(50), &mut batch);
        let budget = |name: &str| {
            let found: Vec<&BudgetSync> = batch.iter().filter(|b| b.key.contains(name)).collect();
            assert_eq!(found.len(), 1, "{name}: {batch:?}");
            (found[0].spent, found[0].limit)
        };
        assert_eq!(
            budget(":p:a:k:alice}"),
            (3, 4),
            "a's spend kept, its new limit taken"
        );
        assert_eq!(budget(":p:b:k:alice}"), (1, 100));
        assert!(
            !batch.iter().any(|b| b.key.contains("bob")),
            "bob made no request: {batch:?}"
        );
        // One more for alice under `a` (4 of 4), then refused.
        assert!(admit(&mut shards, &new, 1));
        assert!(!admit(&mut shards, &new, 1));
    }

    #[test]
    fn a_permit_spends_tokens_only_with_a_token_budget_or_a_plan() {
        let policy = |limit: &str| format!("[[policies]]\nid = \"p\"\nper = \"key\"\n{limit}\n");
        let admitted = |cfg: &LimitsConfig| {
            let ledger = InProcessLedger::new();
            let mut shards = vec![LimiterShard::new(cfg, "n0".into())];
            for _ in 0..10 {
                let mut p = Permit::default();
                match shards[0].try_admit(cfg, &ask(5), &mut p, &mut |_, _| {}) {
                    Ok(()) => return p,
                    Err(r) if r.kind == RefusalKind::NeedLease => {
                        sync_all(&mut shards, &ledger, &[0]);
                    }
                    Err(r) => panic!("refused: {r:?}"),
                }
            }
            panic!("no lease after 10 rounds");
        };
        // `limits` gives the key a quota plan: settled on tokens.
        assert!(admitted(&limits("")).spends_tokens());
        assert!(admitted(&limits(&policy(
            "max_tokens = 1000\ntokens_window_secs = 60"
        )))
        .spends_tokens());
        // Counts and slots only (a plan-less key): what the request used changes nothing.
        let plain = |extra: &str| {
            let sha = crate::config::limits::hex(&crate::config::limits::digest(b"k"));
            let text = format!(
                "[clusters.main]\nbackends = [{{ base_url = \"http://127.0.0.1:9/v1\" }}]\n\
                 [[routes]]\nmodel = \"m\"\ncluster = \"main\"\n\
                 [[keys]]\nid = \"k\"\nsha256 = \"{sha}\"\n{extra}"
            );
            crate::config::load(&text, &|_| None).unwrap().limits
        };
        let counted = admitted(&plain(&policy(
            "max_requests = 10\nrequests_window_secs = 60\nmax_concurrency = 2",
        )));
        assert!(!counted.spends_tokens(), "{counted:?}");
        assert!(admitted(&plain(&policy("max_requests = 10\nrequests_window_secs = 60\nmax_tokens = 1000\ntokens_window_secs = 60"))).spends_tokens());
    }

    #[test]
    fn quota_reservations_never_pass_the_balance_across_cores() {
        let cfg = limits("");
        let ledger = InProcessLedger::new();
        let mut shards: Vec<LimiterShard> = (0..6)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        // Each admitted permit with the tokens its ask reserved.
        let mut inflight: Vec<Vec<(Permit, u64)>> = (0..6).map(|_| Vec::new()).collect();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut admitted = 0;
        let mut billed = 0;
        for _round in 0..400 {
            for i in 0..6 {
                for _ in 0..rng.next() % 4 {
                    let mut p = Permit::default();
                    let max_tokens = rng.next() % 200;
                    let ask = ask(max_tokens);
                    if shards[i]
                        .try_admit(&cfg, &ask, &mut p, &mut |_, _| {})
                        .is_ok()
                    {
                        admitted += 1;
                        inflight[i].push((p, ask.prompt_estimate + max_tokens));
                    }
                }
                // Settle some, each for at most what it reserved.
                while rng.next().is_multiple_of(3) {
                    let Some((mut p, reserved)) = inflight[i].pop() else {
                        break;
                    };
                    let used = rng.next() % (reserved + 1);
                    billed += used;
                    shards[i].settle(&mut p, used);
                    shards[i].settle(&mut p, used); // a second settle is a no-op
                }
            }
            let (spent, reserved) = plan_use(&shards);
            assert_eq!(spent, billed, "spend is exactly what was settled, once");
            assert!(
                spent + reserved <= 10_000,
                "spent {spent} + reserved {reserved} > balance"
            );
            let mut order: Vec<usize> = (0..6).collect();
            order.rotate_left((rng.next() % 6) as usize);
            sync_all(&mut shards, &ledger, &order);
        }
        assert!(admitted > 50, "only {admitted} admitted");
    }

    #[test]
    fn rate_limit_overshoot_stays_within_the_bound() {
        let cfg =
            limits("[[policies]]\nid = \"rpm\"\nmax_requests = 100\nrequests_window_secs = 3600");
        let ledger = InProcessLedger::new();
        let cores = 6;
        let mut shards: Vec<LimiterShard> = (0..cores)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        let mut rng = Rng(42);
        let mut admitted = 0u64;
        let unlimited = Ask {
            key: None,
            ..ask(0)
        };
        for _round in 0..100 {
            for s in shards.iter_mut() {
                for _ in 0..rng.next() % 8 {
                    let mut p = Permit::default();
                    if s.try_admit(&cfg, &unlimited, &mut p, &mut |_, _| {})
                        .is_ok()
                    {
                        admitted += 1;
                        s.settle(&mut p, 0);
                    }
                }
            }
            let order: Vec<usize> = (0..cores).collect();
            sync_all(&mut shards, &ledger, &order);
        }
        assert!(admitted >= 100, "{admitted}: the limit was never reached");
        assert!(
            admitted <= 100 + 2 * cores as u64,
            "{admitted} admitted: past the documented bound"
        );
    }

    /// One exchange of every shard with the ledger at wall-clock `now_ms`.
    fn sync_at(shards: &mut [LimiterShard], ledger: &InProcessLedger, now_ms: u64) {
        let (mut batch, mut states) = (Vec::new(), Vec::new());
        for s in shards.iter_mut() {
            s.prepare(now_ms, Duration::from_millis(50), &mut batch);
            let node = s.node().to_string();
            ledger.exchange_at(Instant::now(), &node, 60_000, &batch, &mut states);
            s.apply(Ok(&states), &batch, Mono::now());
        }
    }

    /// Issue #12 item 7: a burst that straddles a window edge. Fixed windows admitted the
    /// limit just before the edge and the limit again just after it (2 × L in 300 ms); the
    /// sliding window admits at most L × (1 + D / W) + 5 × C × R in any span of D ≤ W (docs/limits.md). Half the requests admitted before the edge are still in flight
    /// after it: their leases, not yet their spend, must count.
    #[test]
    fn a_burst_across_a_window_edge_stays_within_the_sliding_bound() {
        let cfg =
            limits("[[policies]]\nid = \"rpm\"\nmax_requests = 100\nrequests_window_secs = 10");
        let (limit, window_ms, cores) = (100u64, 10_000u64, 6u64);
        let ledger = InProcessLedger::new();
        let mut shards: Vec<LimiterShard> = (0..cores)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        let anon = Ask {
            key: None,
            ..ask(0)
        };
        let edge = (unix_ms() / window_ms + 2) * window_ms;
        let (first, last) = (edge - 150, edge + 150);
        let mut rng = Rng(12);
        let (mut before, mut after) = (0u64, 0u64);
        let mut in_flight: Vec<(usize, Permit)> = Vec::new();
        let mut t = first;
        while t <= last {
            for (i, s) in shards.iter_mut().enumerate() {
                for _ in 0..rng.next() % 8 {
                    let mut p = Permit::default();
                    if s.try_admit_at(&cfg, &anon, &mut p, &mut |_, _| {}, t)
                        .is_ok()
                    {
                        if t < edge {
                            before += 1;
                        } else {
                            after += 1;
                        }
                        if rng.next().is_multiple_of(2) {
                            in_flight.push((i, p));
                        } else {
                            s.settle(&mut p, 0);
                        }
                    }
                }
            }
            if t >= edge + 50 {
                for (i, mut p) in in_flight.drain(..) {
                    shards[i].settle(&mut p, 0);
                }
            }
            sync_at(&mut shards, &ledger, t);
            t += 10;
        }
        let span = last - first;
        let bound = limit + (limit * span).div_ceil(window_ms) + 5 * cores;
        assert!(
            before >= limit,
            "{before} before the edge: the limit was never reached"
        );
        assert!(
            before + after <= bound,
            "{before} + {after} admitted within {span} ms: past the bound {bound}"
        );
        assert!(before + after < 2 * limit);
    }

    /// The sliding window takes nothing from a caller who keeps under the rate: one request
    /// every 111 ms (90% of 60 per 6 s) over three windows is always admitted, with a plain
    /// window and with a paced one (6 at once, the rest accruing).
    #[test]
    fn a_steady_caller_under_the_rate_is_never_refused_across_edges() {
        for burst in ["", "\nrequests_burst = 6"] {
            let cfg = limits(&format!(
                "[[policies]]\nid = \"rpm\"\nmax_requests = 60\nrequests_window_secs = 6{burst}"
            ));
            let ledger = InProcessLedger::new();
            let mut shards: Vec<LimiterShard> = (0..2)
                .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
                .collect();
            let anon = Ask {
                key: None,
                ..ask(0)
            };
            let start = (unix_ms() / 6_000 + 1) * 6_000;
            let mut next_request = start;
            let mut refused = Vec::new();
            let mut admitted = 0;
            let mut t = start;
            while t < start + 18_000 {
                if t >= next_request {
                    let core = (admitted + refused.len()) % 2;
                    let mut p = Permit::default();
                    match shards[core].try_admit_at(&cfg, &anon, &mut p, &mut |_, _| {}, t) {
                        Ok(()) => {
                            admitted += 1;
                            shards[core].settle(&mut p, 0);
                        }
                        Err(r) => refused.push((t - start, r.kind)),
                    }
                    next_request += 111;
                }
                t += 1;
                if t.is_multiple_of(50) {
                    sync_at(&mut shards, &ledger, t);
                }
            }
            assert!(admitted >= 160, "{burst:?}: {admitted} admitted");
            assert!(refused.is_empty(), "{burst:?}: refused at {refused:?}");
        }
    }

    /// A provider's limits are strict: a worker reserves only from a lease (the first attempt
    /// asks for one and is refused), and the budget is never passed across cores.
    #[test]
    fn provider_budgets_are_strict_and_shared_across_cores() {
        let cfg = limits("");
        let provider = ProviderLimits {
            name: "a".into(),
            requests: None,
            tokens: Some(RateLimit {
                max: 400,
                window: Duration::from_secs(3600),
                burst: 400,
            }),
            concurrency: None,
        };
        let ledger = InProcessLedger::new();
        let mut shards: Vec<LimiterShard> = (0..3)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        let mut used = 0;
        let mut refused_for_lease = 0;
        for _round in 0..40 {
            for s in shards.iter_mut() {
                for _ in 0..3 {
                    let mut p = Permit::default();
                    match s.try_reserve_provider([Some(&provider), None], 36, &mut p) {
                        Ok(()) => {
                            used += 28;
                            s.settle(&mut p, 28);
                        }
                        Err(r) if r.kind == RefusalKind::NeedLease => refused_for_lease += 1,
                        Err(_) => {}
                    }
                }
            }
            sync_all(&mut shards, &ledger, &[0, 1, 2]);
        }
        assert!(
            refused_for_lease >= 3,
            "{refused_for_lease}: reserved without a lease"
        );
        assert!(used <= 400, "{used} tokens on a budget of 400");
        assert!(used >= 300, "{used} tokens: the budget went unused");
    }

    #[test]
    fn backend_down_spends_leases_then_serves_local_shares_or_refuses() {
        let cfg = limits("nodes = 2\n[[policies]]\nid = \"c\"\nmax_concurrency = 8");
        let ledger = InProcessLedger::new();
        let mut s = LimiterShard::new(&cfg, "n0".into());
        let quota_only = Ask {
            key: Some(0),
            ..ask(10)
        };
        // Get leases, then lose the backend.
        let mut p = Permit::default();
        assert!(s
            .try_admit(&cfg, &quota_only, &mut p, &mut |_, _| {})
            .is_err());
        sync_all(std::slice::from_mut(&mut s), &ledger, &[0]);
        assert!(s
            .try_admit(&cfg, &quota_only, &mut p, &mut |_, _| {})
            .is_ok());
        s.settle(&mut p, 30);
        let mut batch = Vec::new();
        s.prepare(unix_ms(), Duration::from_millis(50), &mut batch);
        s.apply(Err(()), &batch, Mono::now());
        assert!(!s.backend_ok());
        // Concurrency now runs on this core's share: 8 / (2 nodes × 1 worker) = 4 slots.
        let mut held = Vec::new();
        let outcome = loop {
            let mut p = Permit::default();
            match s.try_admit(&cfg, &quota_only, &mut p, &mut |_, _| {}) {
                Ok(()) => held.push(p),
                Err(r) => break r,
            }
            assert!(held.len() < 100);
        };
        assert!(
            held.len() <= 4,
            "{} in flight on a 4-slot share",
            held.len()
        );
        // Refused by the share (rate/concurrency) or by the quota lease running out.
        assert!(matches!(
            outcome.kind,
            RefusalKind::Exhausted | RefusalKind::BackendDown
        ));
    }

    #[test]
    fn monthly_periods_follow_the_calendar() {
        let plan = Plan {
            id: "p".into(),
            tokens: Some(1),
            period: Period::Monthly,
            anchor: 1_768_435_200, // 2026-01-15T00:00:00Z
            expires: None,
            priority: 0,
        };
        // 2026-03-01T00:00:00Z: inside the period that began on 2026-02-15.
        let (idx, start, end) = period_of(&plan, 1_772_323_200);
        assert_eq!(idx, 1);
        assert_eq!(start, 1_771_113_600); // 2026-02-15
        assert_eq!(end, 1_773_532_800); // 2026-03-15
        let days = Plan {
            period: Period::Days(30),
            ..plan
        };
        let (idx, start, end) = period_of(&days, 1_768_435_200 + 31 * 86_400);
        assert_eq!((idx, end - start), (1, 30 * 86_400));
    }

    #[test]
    fn reset_durations_in_openai_format() {
        let f = |ms| {
            let mut s = String::new();
            write_duration(&mut s, &mut itoa::Buffer::new(), ms);
            s
        };
        assert_eq!(f(20), "20ms");
        assert_eq!(f(1000), "1s");
        assert_eq!(f(360_000), "6m0s");
        assert_eq!(f(3_723_000), "1h2m3s");
    }

    #[test]
    fn rate_headers_are_whole_lines() {
        let write = |headers: RateHeaders| {
            let mut s = String::new();
            headers.write(&mut s);
            s
        };
        assert_eq!(write(RateHeaders::default()), "");
        let requests = RateHeaders {
            requests: Some((60, 59, 1000)),
            tokens: None,
        };
        assert_eq!(
            write(requests),
            "x-ratelimit-limit-requests: 60\r\nx-ratelimit-remaining-requests: 59\r\n\
             x-ratelimit-reset-requests: 1s\r\n"
        );
        let both = RateHeaders {
            tokens: Some((1000, 0, 20)),
            ..requests
        };
        assert_eq!(
            write(both),
            "x-ratelimit-limit-requests: 60\r\nx-ratelimit-remaining-requests: 59\r\n\
             x-ratelimit-reset-requests: 1s\r\nx-ratelimit-limit-tokens: 1000\r\n\
             x-ratelimit-remaining-tokens: 0\r\nx-ratelimit-reset-tokens: 20ms\r\n"
        );
    }
}

#[cfg(test)]
mod concurrency_tests {
    // Tests: unwraps state expectations; sleeps run on the test thread, not on a worker.
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]
    use super::tests_support::*;
    use super::*;
    use std::time::Instant;

    #[test]
    fn concurrency_slots_never_exceed_the_limit_across_cores() {
        let cfg = limits("nodes = 3\n[[policies]]\nid = \"five\"\nmax_concurrency = 5");
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut shards: Vec<LimiterShard> = (0..6)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        let mut inflight: Vec<Vec<Permit>> = (0..6).map(|_| Vec::new()).collect();
        let mut rng = Rng(7);
        let anon = anonymous();
        for _round in 0..500 {
            for i in 0..6 {
                for _ in 0..rng.next() % 4 {
                    let mut p = Permit::default();
                    if shards[i]
                        .try_admit(&cfg, &anon, &mut p, &mut |_, _| {})
                        .is_ok()
                    {
                        inflight[i].push(p);
                    }
                }
                let total: usize = inflight.iter().map(Vec::len).sum();
                assert!(total <= 5, "{total} in flight");
                while rng.next().is_multiple_of(2) {
                    let Some(mut p) = inflight[i].pop() else {
                        break;
                    };
                    shards[i].settle(&mut p, 0);
                }
            }
            // Exchanges overlap admissions and settlements, as on a worker: prepare, work,
            // the ledger answers, more work, apply.
            let mut batches: Vec<Vec<BudgetSync>> = Vec::new();
            for s in shards.iter_mut() {
                let mut batch = Vec::new();
                s.prepare(unix_ms(), Duration::from_millis(50), &mut batch);
                batches.push(batch);
            }
            let work =
                |shards: &mut Vec<LimiterShard>, inflight: &mut Vec<Vec<Permit>>, rng: &mut Rng| {
                    for i in 0..6 {
                        let mut p = Permit::default();
                        if rng.next().is_multiple_of(2)
                            && shards[i]
                                .try_admit(&cfg, &anon, &mut p, &mut |_, _| {})
                                .is_ok()
                        {
                            inflight[i].push(p);
                        }
                        if rng.next().is_multiple_of(3) {
                            if let Some(mut p) = inflight[i].pop() {
                                shards[i].settle(&mut p, 0);
                            }
                        }
                        let total: usize = inflight.iter().map(Vec::len).sum();
                        assert!(total <= 5, "{total} in flight");
                    }
                };
            work(&mut shards, &mut inflight, &mut rng);
            let mut states: Vec<Vec<BudgetState>> = Vec::new();
            for (i, s) in shards.iter().enumerate() {
                let mut out = Vec::new();
                ledger.exchange_at(Instant::now(), s.node(), 60_000, &batches[i], &mut out);
                states.push(out);
                let _ = i;
            }
            work(&mut shards, &mut inflight, &mut rng);
            for (i, s) in shards.iter_mut().enumerate() {
                s.apply(Ok(&states[i]), &batches[i], Mono::now());
            }
        }
    }

    /// Issue #48, item 1, the moment of loss: core 0 holds three slots' lease, core 1 one. A
    /// held lease and the outage share were two allowances, so core 1 took a second slot on its
    /// share while core 0 refilled its lease: 5 of 4. Now each core's slots stay within its
    /// lease and its share together while the lease lives.
    #[test]
    fn at_the_ledgers_loss_a_held_lease_and_the_share_are_one_allowance() {
        // One node of two workers: a share of 2 slots each while the ledger is away.
        let cfg = limits(
            "nodes = 1\n[server]\nworkers = 2\n[[policies]]\nid = \"four\"\nmax_concurrency = 4",
        );
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut shards: Vec<LimiterShard> = (0..2)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        let anon = anonymous();
        let mut held: Vec<Vec<Permit>> = vec![Vec::new(), Vec::new()];
        let mut now = unix_ms();
        for (i, want) in [(0, 3), (1, 1)] {
            for _ in 0..10 {
                let mut p = Permit::default();
                if held[i].len() < want
                    && shards[i]
                        .try_admit(&cfg, &anon, &mut p, &mut |_, _| {})
                        .is_ok()
                {
                    held[i].push(p);
                }
                now += 50;
                for s in shards.iter_mut() {
                    exchange(s, &ledger, now);
                }
            }
        }
        assert_eq!((held[0].len(), held[1].len()), (3, 1));
        for s in shards.iter_mut() {
            let mut batch = Vec::new();
            s.prepare(now, Duration::from_millis(50), &mut batch);
            s.apply(Err(()), &batch, Mono::now());
        }
        // Core 0 ends a request and refills it; core 1 asks for more.
        let mut ended = held[0].pop().unwrap();
        shards[0].settle(&mut ended, 0);
        for i in [0, 1, 0, 1] {
            let mut p = Permit::default();
            if shards[i]
                .try_admit(&cfg, &anon, &mut p, &mut |_, _| {})
                .is_ok()
            {
                held[i].push(p);
            }
        }
        let total = held[0].len() + held[1].len();
        assert!(
            total <= 4,
            "{total} in flight: {} + {}",
            held[0].len(),
            held[1].len()
        );
    }

    /// Issue #48, item 1: slots in use on two cores through a ledger outage and its return stay
    /// within the limit — an outage shorter than the lease (a core's held lease and its outage
    /// share were two allowances: 5 of 4 in use), and one longer (the ledger restarted empty,
    /// one core back before the other: the first back took slots the other still used).
    /// Requests admitted before the loss end before the leases lapse, the bound's condition.
    #[test]
    fn concurrency_stays_within_the_limit_through_an_outage_and_its_return() {
        let cfg = limits(
            "nodes = 1\nsync_interval_ms = 50\nlease_ttl_ms = 400\n[server]\nworkers = 2\n\
             [[policies]]\nid = \"four\"\nmax_concurrency = 4",
        );
        for (seed, outage_ms) in [(3u64, 100u64), (5, 650), (9, 100), (13, 650)] {
            let mut ledger = crate::limits::ledger::InProcessLedger::new();
            let mut shards: Vec<LimiterShard> = (0..2)
                .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
                .collect();
            // Each core's requests in flight, with when they were admitted.
            let mut inflight: Vec<Vec<(Permit, Duration)>> = vec![Vec::new(), Vec::new()];
            let mut rng = Rng(seed);
            let anon = anonymous();
            let started = Instant::now();
            let lost_at = Duration::from_millis(150);
            let back = [0, 120].map(|later| lost_at + Duration::from_millis(outage_ms + later));
            let mut restarted = false;
            let mut peak = 0;
            while started.elapsed() < back[1] + Duration::from_millis(400) {
                let t = started.elapsed();
                if t >= back[0] && !restarted && outage_ms > 400 {
                    // The ledger came back empty (a Redis restart without persistence).
                    ledger = crate::limits::ledger::InProcessLedger::new();
                    restarted = true;
                }
                for i in 0..2 {
                    // Requests end at random (those from before the loss within 100 ms of it,
                    // well within the lease) and the freed slots are asked for again before
                    // the next exchange.
                    let late = t >= lost_at + Duration::from_millis(100);
                    inflight[i].retain_mut(|(p, at)| {
                        let ends = rng.next().is_multiple_of(4) || (late && *at < lost_at);
                        if ends {
                            shards[i].settle(p, 0);
                        }
                        !ends
                    });
                    // Before the loss core 1 is nearly idle, so core 0 holds most of the
                    // slots; then both ask for more than their share.
                    let asks = if t < lost_at && i == 1 { 1 } else { 3 };
                    for _ in 0..asks {
                        let mut p = Permit::default();
                        if shards[i]
                            .try_admit(&cfg, &anon, &mut p, &mut |_, _| {})
                            .is_ok()
                        {
                            inflight[i].push((p, t));
                        }
                    }
                    let total: usize = inflight.iter().map(Vec::len).sum();
                    peak = peak.max(total);
                    assert!(total <= 4, "seed {seed}: {total} in flight at {t:?}");
                    let mut batch = Vec::new();
                    shards[i].prepare(unix_ms(), Duration::from_millis(50), &mut batch);
                    if t >= lost_at && t < back[i] {
                        shards[i].apply(Err(()), &batch, Mono::now());
                    } else {
                        let mut states = Vec::new();
                        let node = shards[i].node().to_string();
                        ledger.exchange_at(Instant::now(), &node, 400, &batch, &mut states);
                        shards[i].apply(Ok(&states), &batch, Mono::now());
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(
                peak >= 3,
                "seed {seed}: peak {peak}: the slots were never used"
            );
        }
    }

    /// One exchange of one shard with the in-process ledger at `now_ms`.
    fn exchange(
        s: &mut LimiterShard,
        ledger: &crate::limits::ledger::InProcessLedger,
        now_ms: u64,
    ) {
        let mut batch = Vec::new();
        let mut states = Vec::new();
        s.prepare(now_ms, Duration::from_millis(50), &mut batch);
        let node = s.node().to_string();
        ledger.exchange_at(Instant::now(), &node, 60_000, &batch, &mut states);
        s.apply(Ok(&states), &batch, Mono::now());
    }

    /// Issue #11: a concurrency limit of 2 over two cores refused a caller who sent one request
    /// at a time — the core that had served recently held both slots idle, and the other core
    /// answered `Exhausted` from its view of those leases (and kept doing so from a view it no
    /// longer refreshed). Syncs here run late and irregularly, as on a busy machine.
    #[test]
    fn a_caller_below_the_concurrency_limit_is_admitted_on_any_core() {
        let cfg = limits("[[policies]]\nid = \"two\"\nmax_concurrency = 2");
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut shards: Vec<LimiterShard> = (0..2)
            .map(|i| LimiterShard::new(&cfg, format!("n{i}")))
            .collect();
        let anon = anonymous();
        let mut rng = Rng(11);
        let mut now = unix_ms();
        let mut waited = 0;
        for i in 0..400 {
            let w = (rng.next() % 2) as usize;
            let mut p = Permit::default();
            let mut exchanges = 0;
            while let Err(r) = shards[w].try_admit(&cfg, &anon, &mut p, &mut |_, _| {}) {
                assert_eq!(
                    r.kind,
                    RefusalKind::NeedLease,
                    "request {i} on core {w} refused with nothing in flight"
                );
                exchanges += 1;
                assert!(exchanges <= 4, "request {i} waited {exchanges} exchanges");
                // The waiting core hurries its exchange; the other runs its own, late.
                now += 5 + rng.next() % 60;
                exchange(&mut shards[w], &ledger, now);
                exchange(&mut shards[1 - w], &ledger, now);
            }
            waited += exchanges;
            shards[w].settle(&mut p, 0);
            // Between requests each core syncs once, late or not, or skips a turn.
            now += 10 + rng.next() % 120;
            for s in shards.iter_mut() {
                if !rng.next().is_multiple_of(3) {
                    exchange(s, &ledger, now);
                }
            }
        }
        // Waiting is the exception: slack is shared, not hoarded by one core.
        assert!(waited < 100, "{waited} exchanges waited for 400 requests");
    }

    /// The exact sequence of the false 429: core A held both slots (idle) when core B asked.
    #[test]
    fn idle_slots_held_elsewhere_are_waited_for_not_refused() {
        let cfg = limits("[[policies]]\nid = \"two\"\nmax_concurrency = 2");
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let (mut a, mut b) = (
            LimiterShard::new(&cfg, "a".into()),
            LimiterShard::new(&cfg, "b".into()),
        );
        let anon = anonymous();
        let admit = |s: &mut LimiterShard| {
            let mut p = Permit::default();
            s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).map(|()| p)
        };
        let t = unix_ms();
        // A serves two at once, is granted both slots, and both finish: A holds 2 idle slots.
        assert!(admit(&mut a).is_err());
        assert!(admit(&mut a).is_err());
        exchange(&mut a, &ledger, t);
        let mut p1 = admit(&mut a).unwrap();
        let mut p2 = admit(&mut a).unwrap();
        a.settle(&mut p1, 0);
        a.settle(&mut p2, 0);
        // B's caller, with nothing in flight anywhere: B learns that A holds both...
        assert_eq!(admit(&mut b).unwrap_err().kind, RefusalKind::NeedLease);
        exchange(&mut b, &ledger, t + 5);
        // ... and waits for a lease rather than answering 429.
        assert_eq!(admit(&mut b).unwrap_err().kind, RefusalKind::NeedLease);
        exchange(&mut b, &ledger, t + 10);
        // A's next exchanges give slack back (B reported a shortfall); B's request, retrying
        // after each of B's exchanges, gets a slot within two of A's intervals.
        let mut admitted = None;
        for round in 1..=2 {
            exchange(&mut a, &ledger, t + 50 * round);
            match admit(&mut b) {
                Ok(p) => {
                    admitted = Some(p);
                    break;
                }
                Err(r) => assert_eq!(r.kind, RefusalKind::NeedLease, "round {round}"),
            }
            exchange(&mut b, &ledger, t + 50 * round + 5);
            if let Ok(p) = admit(&mut b) {
                admitted = Some(p);
                break;
            }
        }
        let mut p = admitted.expect("B admitted once A gave its idle slots back");
        b.settle(&mut p, 0);
    }

    #[test]
    fn a_hurried_exchange_does_not_shrink_the_lease() {
        let cfg = limits("[[policies]]\nid = \"c\"\nmax_concurrency = 1000");
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut s = LimiterShard::new(&cfg, "n".into());
        let anon = anonymous();
        let mut batch = Vec::new();
        let mut states = Vec::new();
        let mut exchange = |s: &mut LimiterShard, now_ms: u64, batch: &mut Vec<BudgetSync>| {
            s.prepare(now_ms, Duration::from_millis(50), batch);
            ledger.exchange_at(Instant::now(), "n", 60_000, batch, &mut states);
            s.apply(Ok(&states), batch, Mono::now());
        };
        let t = unix_ms();
        // The first request finds no lease and asks for one.
        let mut p = Permit::default();
        assert!(s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).is_err());
        exchange(&mut s, t, &mut batch);
        // 100 requests in one 50 ms interval, each done before the next.
        for _ in 0..100 {
            let mut p = Permit::default();
            assert!(s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).is_ok());
            s.settle(&mut p, 0);
        }
        exchange(&mut s, t + 50, &mut batch);
        let steady = batch[0].lease;
        assert!(
            steady >= 200,
            "lease {steady} for 100 requests per interval"
        );
        // A request hurries the next exchange 1 ms later, with no use in between: the lease
        // asked for stays sized for the rate, not for 1 ms of nothing.
        exchange(&mut s, t + 51, &mut batch);
        assert!(
            batch[0].lease >= steady / 2,
            "lease fell to {}",
            batch[0].lease
        );
    }

    #[test]
    fn a_quiet_budget_keeps_its_minimum_slice_for_a_while() {
        let cfg = limits("[[policies]]\nid = \"c\"\nmax_concurrency = 6400");
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut s = LimiterShard::new(&cfg, "n".into());
        let anon = anonymous();
        let mut batch = Vec::new();
        let mut states = Vec::new();
        let mut p = Permit::default();
        assert!(s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).is_err());
        let t = unix_ms();
        let mut at = |s: &mut LimiterShard, i: u64| {
            s.prepare(t + 50 * i, Duration::from_millis(50), &mut batch);
            ledger.exchange_at(Instant::now(), "n", 60_000, &batch, &mut states);
            s.apply(Ok(&states), &batch, Mono::now());
        };
        at(&mut s, 0);
        assert!(s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).is_ok());
        s.settle(&mut p, 0);
        // A few quiet seconds later a request is admitted without waiting: 100 = 6400 / 64.
        for i in 1..=60 {
            at(&mut s, i);
        }
        let mut p = Permit::default();
        assert!(s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).is_ok());
        s.settle(&mut p, 0);
        // Long quiet: the slice goes back to the ledger.
        for i in 61..=300 {
            at(&mut s, i);
        }
        let mut p = Permit::default();
        assert!(s.try_admit(&cfg, &anon, &mut p, &mut |_, _| {}).is_err());
    }

    #[test]
    fn a_stale_lease_on_an_idle_worker_is_not_an_outage() {
        // Leases lapse 8 ms after the last exchange; a worker with nothing to exchange for
        // longer must wait for a lease, not fall back to its outage share.
        let cfg = limits(
            "sync_interval_ms = 1\nlease_ttl_ms = 8\nnodes = 1\n[[policies]]\nid = \"one\"\nmax_concurrency = 1",
        );
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut shards = vec![
            LimiterShard::new(&cfg, "a".into()),
            LimiterShard::new(&cfg, "b".into()),
        ];
        let anon = anonymous();
        let mut held = Permit::default();
        assert!(shards[0]
            .try_admit(&cfg, &anon, &mut held, &mut |_, _| {})
            .is_err());
        sync_all(&mut shards, &ledger, &[0, 1]);
        assert!(shards[0]
            .try_admit(&cfg, &anon, &mut held, &mut |_, _| {})
            .is_ok());
        sync_all(&mut shards, &ledger, &[0, 1]);
        std::thread::sleep(Duration::from_millis(20));
        let mut p = Permit::default();
        let r = shards[1].try_admit(&cfg, &anon, &mut p, &mut |_, _| {});
        assert_eq!(r.map_err(|r| r.kind), Err(RefusalKind::NeedLease));
    }
}
