//! Metrics: per-worker counters and histograms, merged across workers for a Prometheus scrape.
//!
//! Runs on every request (observations), on a per-worker timer (publish) and on each scrape
//! (render). Takes label *indexes* — never raw key values or user strings — and raises no errors.
//!
//! # Shape
//!
//! - [`LabelNames`] holds the name tables fixed at startup: API routes (`chat_completions`,
//!   `embeddings`, …), models, entities (key tags / tenants), backends and limiter policies. Each
//!   table ends with one `"other"` slot; an unknown name, an out-of-range position and the
//!   `*::OTHER` constants all land there, so label cardinality is bounded by construction.
//!   Duplicate names share one slot; a configured name that is literally `other` is the other slot.
//! - [`MetricsShard`] is one worker's store: flat `Cell` arrays sized once from the tables. Every
//!   observation is a bounds-checked index computation and one or two `Cell` updates — no lock,
//!   no atomic, no allocation. It is `!Sync` (it holds `Cell`s): each worker owns its own.
//! - [`MetricsHub`] (shared as `Arc`) holds one slot per registered shard, each behind its own
//!   mutex. A worker calls [`MetricsShard::publish`] from a timer (every 500 ms, say): it
//!   `try_lock`s its own slot and copies its arrays in. [`MetricsHub::render`] locks the slots one
//!   at a time, sums them and writes Prometheus text exposition 0.0.4. A slot's lock is only ever
//!   contended by a scrape reading that slot, and publish never waits for it: the worker thread
//!   never blocks on metrics.
//! - [`FAMILIES`] declares every family once: name, type, help, labels and where its values sit
//!   in the arrays. The scrape walks it; nothing else names a family. A new family is one entry
//!   there, its offsets in `Layout` and the shard method that records it (a unit test checks
//!   that the table's families cover the layout exactly).
//!
//! # Staleness
//!
//! A scrape sees each worker's values as of that worker's last publish, so every series lags the
//! truth by at most the publish interval (plus the time a busy worker takes to reach its timer).
//! In the rare case a publish coincides with a scrape reading that worker's slot (microseconds),
//! the publish is skipped and the next one carries the values: one more interval at worst.
//! A worker that has not published yet contributes zeros; `sluice_metrics_publish_age_seconds`
//! exposes the oldest shard's age so a stuck worker shows up. Counters never decrease: a shard
//! only ever publishes larger values into its own slot.
//!
//! # Memory
//!
//! Each shard (and its hub slot) holds 8 bytes per series and histogram bucket; the largest
//! family is `sluice_requests_total` at routes × models × entities × 5 status classes (e.g. 8 ×
//! 20 × 100 × 5 = 80,000 counters = 640 KB). [`MetricsHub::shard_bytes`] gives the exact figure,
//! worth logging at startup. A publish copies that much; a scrape sums it once per worker.
//!
//! # What is emitted
//!
//! Families keyed by `model` or `entity` (whose size is a product of configured lists) omit
//! series that are still zero (`Family::sparse`); the others — per backend, per policy, per route, unlabelled —
//! always show every series, so an alert on a first error (`increase(...) > 0`) sees the step
//! from 0. Counters and histograms only grow, so a series that appeared never disappears.
//!
//! Histogram boundaries follow the OpenTelemetry GenAI semantic conventions (see the `*_BUCKETS`
//! constants); times are kept in integer nanoseconds and exposed in seconds, exactly.
//!
//! # Wiring sketch
//!
//! ```ignore
//! let hub = MetricsHub::new(LabelLists { routes: &routes, models: &models, entities: &tags,
//!                                        backends: &backends, policies: &policies });
//! // per worker, at start (off the request path):
//! let shard = MetricsShard::new(&hub);
//! let model = shard.names().model(&inspection.model); // or a table built once per snapshot
//! // per request:
//! shard.request_done(route, model, entity, StatusClass::from_status(200));
//! // per worker, from a 500 ms timer:
//! shard.publish(&hub);
//! ```

// The hub and each shard's published slot are the one place cores meet for metrics: a worker
// locks its own slot once per publish interval (a timer, never a request), a scrape locks
// each slot briefly; `try_lock` keeps a worker from ever waiting on a scrape.
#![allow(clippy::disallowed_types)]

pub(crate) use crate::config::limits::LimitDimension;
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

/// The label value of every table's catch-all slot.
pub(crate) const OTHER: &str = "other";

// ---------------------------------------------------------------------------------------------
// Histogram boundaries
// ---------------------------------------------------------------------------------------------

/// The unit a histogram stores, and how it is exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    /// Stored in nanoseconds, exposed in seconds.
    Nanos,
    /// Stored and exposed as a plain count (tokens).
    Count,
}

impl Unit {
    /// Decimal digits between the stored integer and the exposed number.
    fn scale_digits(self) -> u32 {
        match self {
            Unit::Nanos => 9,
            Unit::Count => 0,
        }
    }
}

/// Fixed, ascending upper bounds (inclusive: `le`) of one histogram, in its stored unit. The
/// `+Inf` bucket is implicit.
#[derive(Debug)]
pub(crate) struct Buckets {
    pub(crate) bounds: &'static [u64],
    pub(crate) unit: Unit,
}

const MS: u64 = 1_000_000;
const US: u64 = 1_000;

/// Time to first token, seconds (OpenTelemetry `gen_ai.server.time_to_first_token`).
pub(crate) const TTFT_BUCKETS: Buckets = Buckets {
    bounds: &[
        MS,
        5 * MS,
        10 * MS,
        20 * MS,
        40 * MS,
        60 * MS,
        80 * MS,
        100 * MS,
        250 * MS,
        500 * MS,
        750 * MS,
        1000 * MS,
        2500 * MS,
        5000 * MS,
        7500 * MS,
        10_000 * MS,
    ],
    unit: Unit::Nanos,
};

/// Time per output token, seconds (OpenTelemetry `gen_ai.server.time_per_output_token`).
pub(crate) const TPOT_BUCKETS: Buckets = Buckets {
    bounds: &[
        10 * MS,
        25 * MS,
        50 * MS,
        75 * MS,
        100 * MS,
        150 * MS,
        200 * MS,
        300 * MS,
        400 * MS,
        500 * MS,
        750 * MS,
        1000 * MS,
        2500 * MS,
    ],
    unit: Unit::Nanos,
};

/// Request duration, seconds: 0.01 doubling to 81.92 (OpenTelemetry
/// `gen_ai.client.operation.duration`).
pub(crate) const LATENCY_BUCKETS: Buckets = Buckets {
    bounds: &[
        10 * MS,
        20 * MS,
        40 * MS,
        80 * MS,
        160 * MS,
        320 * MS,
        640 * MS,
        1280 * MS,
        2560 * MS,
        5120 * MS,
        10_240 * MS,
        20_480 * MS,
        40_960 * MS,
        81_920 * MS,
    ],
    unit: Unit::Nanos,
};

/// Tokens per request: 1, 4, 16, … ×4 … 67108864 (OpenTelemetry `gen_ai.client.token.usage`).
pub(crate) const TOKEN_BUCKETS: Buckets = Buckets {
    bounds: &[
        1, 4, 16, 64, 256, 1024, 4096, 16_384, 65_536, 262_144, 1_048_576, 4_194_304, 16_777_216,
        67_108_864,
    ],
    unit: Unit::Count,
};

/// Sluice's own overhead per request: 1 µs … 5 ms, exposed in seconds.
pub(crate) const OVERHEAD_BUCKETS: Buckets = Buckets {
    bounds: &[
        US,
        2 * US,
        5 * US,
        10 * US,
        20 * US,
        50 * US,
        100 * US,
        200 * US,
        500 * US,
        1000 * US,
        2000 * US,
        5000 * US,
    ],
    unit: Unit::Nanos,
};

/// One sync-backend flush round trip (deltas out, totals back): 0.5 ms … 2.5 s.
pub(crate) const SYNC_FLUSH_BUCKETS: Buckets = Buckets {
    bounds: &[
        MS / 2,
        MS,
        5 * MS / 2,
        5 * MS,
        10 * MS,
        25 * MS,
        50 * MS,
        100 * MS,
        250 * MS,
        500 * MS,
        1000 * MS,
        2500 * MS,
    ],
    unit: Unit::Nanos,
};

// ---------------------------------------------------------------------------------------------
// Label tables and typed indexes
// ---------------------------------------------------------------------------------------------

/// The names given at startup, one list per label. Positions in these lists are what
/// [`LabelNames::model_at`] and friends take (e.g. a config's backend id).
#[derive(Debug, Clone, Copy, Default)]
pub struct LabelLists<'a> {
    /// API routes (endpoints), e.g. `chat_completions`, `completions`, `embeddings`.
    pub(crate) routes: &'a [String],
    /// Model names as clients request them.
    pub(crate) models: &'a [String],
    /// Entities: key tags, tenants, projects — configured names, never key values.
    pub(crate) entities: &'a [String],
    /// Upstream backends, e.g. `cluster/host:port`.
    pub(crate) backends: &'a [String],
    /// Limiter policy names.
    pub(crate) policies: &'a [String],
}

/// One label's names: the distinct configured names, then `"other"`, always last.
#[derive(Debug)]
struct NameTable {
    slots: Vec<String>,
    /// Seeded per process: looked up with names clients send (see Cargo.toml on foldhash).
    by_name: HashMap<String, u32, foldhash::fast::RandomState>,
    by_position: Vec<u32>,
}

impl NameTable {
    fn new(list: &[String]) -> NameTable {
        let mut slots: Vec<String> = Vec::with_capacity(list.len() + 1);
        let mut by_name: HashMap<String, u32, foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(list.len(), Default::default());
        let mut pending_other = Vec::new();
        let mut by_position = Vec::with_capacity(list.len());
        for (position, name) in list.iter().enumerate() {
            if name == OTHER {
                pending_other.push(position);
                by_position.push(0);
                continue;
            }
            let slot = match by_name.get(name.as_str()) {
                Some(&slot) => slot,
                None => {
                    let slot = slots.len() as u32;
                    slots.push(name.clone());
                    by_name.insert(name.clone(), slot);
                    slot
                }
            };
            by_position.push(slot);
        }
        let other = slots.len() as u32;
        slots.push(OTHER.to_string());
        for position in pending_other {
            if let Some(p) = by_position.get_mut(position) {
                *p = other;
            }
        }
        NameTable {
            slots,
            by_name,
            by_position,
        }
    }

    fn other(&self) -> u32 {
        (self.slots.len() - 1) as u32
    }

    fn lookup(&self, name: &str) -> u32 {
        self.by_name.get(name).copied().unwrap_or(self.other())
    }

    fn at(&self, position: usize) -> u32 {
        self.by_position
            .get(position)
            .copied()
            .unwrap_or(self.other())
    }

    /// Slots, including the other slot.
    fn len(&self) -> usize {
        self.slots.len()
    }

    /// A slot index, clamped into the table (anything past the end is the other slot).
    fn clamp(&self, idx: u32) -> usize {
        (idx as usize).min(self.slots.len() - 1)
    }

    fn name(&self, slot: usize) -> &str {
        self.slots.get(slot).map(String::as_str).unwrap_or(OTHER)
    }
}

macro_rules! label_index {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(u32);

        impl $name {
            /// The `"other"` slot, whatever the table's size.
            pub const OTHER: $name = $name(u32::MAX);
        }
    };
}

label_index!(
    /// An API route's slot in [`LabelNames`].
    RouteLabel
);
label_index!(
    /// A model's slot in [`LabelNames`].
    ModelIdx
);
label_index!(
    /// An entity's (key tag's) slot in [`LabelNames`].
    EntityIdx
);
label_index!(
    /// A backend's slot in [`LabelNames`].
    BackendIdx
);
label_index!(
    /// A limiter policy's slot in [`LabelNames`].
    PolicyIdx
);

/// All label tables, fixed at startup and shared (read-only) by the hub and every shard.
///
/// Resolve names to indexes off the hot path where you can (e.g. one `Vec<ModelIdx>` per config
/// snapshot); [`LabelNames::model`] and friends are hash lookups that never allocate.
#[derive(Debug)]
pub struct LabelNames {
    routes: NameTable,
    models: NameTable,
    entities: NameTable,
    backends: NameTable,
    policies: NameTable,
}

impl LabelNames {
    pub fn new(lists: LabelLists<'_>) -> LabelNames {
        LabelNames {
            routes: NameTable::new(lists.routes),
            models: NameTable::new(lists.models),
            entities: NameTable::new(lists.entities),
            backends: NameTable::new(lists.backends),
            policies: NameTable::new(lists.policies),
        }
    }

    pub fn route(&self, name: &str) -> RouteLabel {
        RouteLabel(self.routes.lookup(name))
    }
    pub fn model(&self, name: &str) -> ModelIdx {
        ModelIdx(self.models.lookup(name))
    }
    pub fn model_at(&self, position: usize) -> ModelIdx {
        ModelIdx(self.models.at(position))
    }
    pub fn entity(&self, name: &str) -> EntityIdx {
        EntityIdx(self.entities.lookup(name))
    }
    pub fn entity_at(&self, position: usize) -> EntityIdx {
        EntityIdx(self.entities.at(position))
    }
    pub fn backend(&self, name: &str) -> BackendIdx {
        BackendIdx(self.backends.lookup(name))
    }
    pub fn backend_at(&self, position: usize) -> BackendIdx {
        BackendIdx(self.backends.at(position))
    }
    pub fn policy(&self, name: &str) -> PolicyIdx {
        PolicyIdx(self.policies.lookup(name))
    }
    pub fn policy_at(&self, position: usize) -> PolicyIdx {
        PolicyIdx(self.policies.at(position))
    }
}

/// The pseudo-policy quota refusals count under.
const QUOTA_POLICY: &str = "quota";

/// A backend's `backend` label: `cluster/host[:port]`.
pub(crate) fn backend_label(
    cluster: &crate::config::Cluster,
    backend: &crate::config::Backend,
) -> String {
    format!("{}/{}", cluster.name, backend.host_header)
}

/// One config snapshot's positions — backend ids, policy and entity indexes — mapped to the
/// hub's label slots by name, built once per snapshot (off the request path). The hub's tables
/// are fixed at startup (bounded cardinality), so a name a reload adds counts under `other`
/// until the next restart; a name that moved keeps its series.
#[derive(Debug)]
pub(crate) struct SnapshotLabels {
    backends: Vec<BackendIdx>,
    policies: Vec<PolicyIdx>,
    entities: Vec<EntityIdx>,
    quota: PolicyIdx,
}

impl SnapshotLabels {
    pub(crate) fn new(names: &LabelNames, snapshot: &crate::config::Snapshot) -> SnapshotLabels {
        let mut backends = vec![BackendIdx::OTHER; snapshot.backend_count];
        for cluster in &snapshot.clusters {
            for b in &cluster.backends {
                if let Some(slot) = backends.get_mut(b.id) {
                    *slot = names.backend(&backend_label(cluster, b));
                }
            }
        }
        let limits = &snapshot.limits;
        SnapshotLabels {
            backends,
            policies: limits
                .policies
                .iter()
                .map(|p| names.policy(&p.id))
                .collect(),
            entities: limits.entities.iter().map(|e| names.entity(e)).collect(),
            quota: names.policy(QUOTA_POLICY),
        }
    }

    pub(crate) fn backend(&self, id: usize) -> BackendIdx {
        self.backends.get(id).copied().unwrap_or(BackendIdx::OTHER)
    }

    /// A policy's slot; `None` (a quota refusal) is the `quota` slot.
    pub(crate) fn policy(&self, index: Option<usize>) -> PolicyIdx {
        match index {
            Some(p) => self.policies.get(p).copied().unwrap_or(PolicyIdx::OTHER),
            None => self.quota,
        }
    }

    pub(crate) fn entity(&self, index: usize) -> EntityIdx {
        self.entities
            .get(index)
            .copied()
            .unwrap_or(EntityIdx::OTHER)
    }
}

/// A worker's metrics shard with the label map of the snapshot a request runs on: what the
/// request path records through. Derefs to the shard.
#[derive(Clone, Copy)]
pub(crate) struct MetricsView<'w> {
    pub(crate) shard: &'w MetricsShard,
    pub(crate) labels: &'w SnapshotLabels,
}

impl std::ops::Deref for MetricsView<'_> {
    type Target = MetricsShard;

    fn deref(&self) -> &MetricsShard {
        self.shard
    }
}

// ---------------------------------------------------------------------------------------------
// Fixed enumerations
// ---------------------------------------------------------------------------------------------

/// The class of the status the client got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatusClass {
    Informational,
    Success,
    Redirect,
    ClientError,
    ServerError,
}

impl StatusClass {
    const ALL: [StatusClass; 5] = [
        StatusClass::Informational,
        StatusClass::Success,
        StatusClass::Redirect,
        StatusClass::ClientError,
        StatusClass::ServerError,
    ];

    /// 1xx … 5xx; anything outside 100..=599 counts as 5xx (a status we could not make sense of).
    pub(crate) fn from_status(status: u16) -> StatusClass {
        match status {
            100..=199 => StatusClass::Informational,
            200..=299 => StatusClass::Success,
            300..=399 => StatusClass::Redirect,
            400..=499 => StatusClass::ClientError,
            _ => StatusClass::ServerError,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            StatusClass::Informational => "1xx",
            StatusClass::Success => "2xx",
            StatusClass::Redirect => "3xx",
            StatusClass::ClientError => "4xx",
            StatusClass::ServerError => "5xx",
        }
    }
}

/// Why a request was sent to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// The first try.
    First,
    /// Again, same cluster (stale pooled connection, retryable failure).
    Retry,
    /// To a fallback cluster after the primary failed.
    Fallback,
}

impl Attempt {
    const ALL: [Attempt; 3] = [Attempt::First, Attempt::Retry, Attempt::Fallback];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Attempt::First => "first",
            Attempt::Retry => "retry",
            Attempt::Fallback => "fallback",
        }
    }
}

/// What went wrong with one upstream attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpstreamErrorKind {
    /// TCP connect failed or was refused.
    Connect,
    /// TLS handshake or certificate failure.
    Tls,
    /// Connect, first-byte or stream-idle timeout.
    Timeout,
    /// Reset or EOF while talking to the backend.
    Io,
    /// The backend sent something that is not valid HTTP/1.1.
    Protocol,
    /// The backend answered 429 (rate limited).
    Status429,
    /// The backend answered 5xx.
    Status5xx,
    /// No connection could be had: the per-backend connection cap was reached.
    PoolExhausted,
    /// The backend refused a key pool's credential (401 / 403); another was tried.
    CredentialRefused,
    /// Not sent: the provider's own limits (`provider_limits`) had no room; skipped.
    ProviderLimit,
    /// The backend's stream carried an error event of its own (after a 200 head).
    ErrorEvent,
}

impl UpstreamErrorKind {
    const ALL: [UpstreamErrorKind; 11] = [
        UpstreamErrorKind::Connect,
        UpstreamErrorKind::Tls,
        UpstreamErrorKind::Timeout,
        UpstreamErrorKind::Io,
        UpstreamErrorKind::Protocol,
        UpstreamErrorKind::Status429,
        UpstreamErrorKind::Status5xx,
        UpstreamErrorKind::PoolExhausted,
        UpstreamErrorKind::CredentialRefused,
        UpstreamErrorKind::ProviderLimit,
        UpstreamErrorKind::ErrorEvent,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            UpstreamErrorKind::Connect => "connect",
            UpstreamErrorKind::Tls => "tls",
            UpstreamErrorKind::Timeout => "timeout",
            UpstreamErrorKind::Io => "io",
            UpstreamErrorKind::Protocol => "protocol",
            UpstreamErrorKind::Status429 => "status_429",
            UpstreamErrorKind::Status5xx => "status_5xx",
            UpstreamErrorKind::CredentialRefused => "credential_refused",
            UpstreamErrorKind::ProviderLimit => "provider_limit",
            UpstreamErrorKind::PoolExhausted => "pool_exhausted",
            UpstreamErrorKind::ErrorEvent => "error_event",
        }
    }
}

const TOKEN_TYPES: [&str; 4] = ["prompt", "completion", "cached", "cache_write"];
const HIST_TOKEN_TYPES: [&str; 2] = ["prompt", "completion"];
const SYNC_RESULTS: [&str; 2] = ["ok", "error"];
/// `outcome` of a config reload.
const RELOAD_OUTCOMES: [&str; 2] = ["applied", "rejected"];

// ---------------------------------------------------------------------------------------------
// Layout: where each family lives in the flat arrays
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Hist {
    buckets: &'static Buckets,
    /// First bucket counter (counts are per bucket, not cumulative; the last is `+Inf`).
    counts_at: usize,
    /// First sum.
    sums_at: usize,
}

impl Hist {
    fn stride(&self) -> usize {
        self.buckets.bounds.len() + 1
    }
}

/// Offsets into the counter, sum and gauge arrays; identical for the hub and every shard built
/// from the same [`LabelNames`].
#[derive(Debug, Clone)]
struct Layout {
    /// Table sizes the shard's index arithmetic needs.
    models: usize,
    entities: usize,

    requests: usize,
    tokens: usize,
    cost: usize,
    limiter_matches: usize,
    limiter_hits: usize,
    upstream_requests: usize,
    upstream_errors: usize,
    sync_flushes: usize,
    counters: usize,

    ttft: Hist,
    tpot: Hist,
    latency: Hist,
    overhead: Hist,
    request_tokens: Hist,
    sync_flush: Hist,
    sums: usize,

    in_flight: usize,
    connections: usize,
    gauges: usize,
}

impl Layout {
    fn new(names: &LabelNames) -> Layout {
        let (r, m, e, b, p) = (
            names.routes.len(),
            names.models.len(),
            names.entities.len(),
            names.backends.len(),
            names.policies.len(),
        );
        let mut counters = 0;
        let mut take = |n: usize| {
            let at = counters;
            counters += n;
            at
        };
        let requests = take(r * m * e * StatusClass::ALL.len());
        let tokens = take(m * e * TOKEN_TYPES.len());
        let cost = take(m * e);
        let limiter_matches = take(p * LimitDimension::ALL.len());
        let limiter_hits = take(p * LimitDimension::ALL.len());
        let upstream_requests = take(b * Attempt::ALL.len());
        let upstream_errors = take(b * UpstreamErrorKind::ALL.len());
        let sync_flushes = take(SYNC_RESULTS.len());

        let mut sums = 0;
        let mut hist = |buckets: &'static Buckets, series: usize| {
            let h = Hist {
                buckets,
                counts_at: counters,
                sums_at: sums,
            };
            counters += series * h.stride();
            sums += series;
            h
        };
        let ttft = hist(&TTFT_BUCKETS, m);
        let tpot = hist(&TPOT_BUCKETS, m);
        let latency = hist(&LATENCY_BUCKETS, r * m);
        let overhead = hist(&OVERHEAD_BUCKETS, r);
        let request_tokens = hist(&TOKEN_BUCKETS, m * HIST_TOKEN_TYPES.len());
        let sync_flush = hist(&SYNC_FLUSH_BUCKETS, 1);

        Layout {
            models: m,
            entities: e,
            requests,
            tokens,
            cost,
            limiter_matches,
            limiter_hits,
            upstream_requests,
            upstream_errors,
            sync_flushes,
            counters,
            ttft,
            tpot,
            latency,
            overhead,
            request_tokens,
            sync_flush,
            sums,
            in_flight: 0,
            connections: b,
            gauges: b + 1,
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------------------------
// The per-worker shard
// ---------------------------------------------------------------------------------------------

/// One worker's metrics. Every method is a few index computations and `Cell` updates.
///
/// Indexes from another [`LabelNames`] or past a table's end count as that table's other slot;
/// nothing here can panic.
#[derive(Debug)]
pub(crate) struct MetricsShard {
    names: Arc<LabelNames>,
    layout: Layout,
    /// This shard's slot in the hub.
    slot: Arc<Mutex<Slot>>,
    counters: Box<[Cell<u64>]>,
    sums: Box<[Cell<u128>]>,
    gauges: Box<[Cell<i64>]>,
}

impl MetricsShard {
    /// A new, zeroed shard with its own slot in `hub` (call once per worker, at start).
    pub(crate) fn new(hub: &MetricsHub) -> MetricsShard {
        let layout = hub.layout.clone();
        let slot = Arc::new(Mutex::new(Slot::zeroed(&layout)));
        hub.lock_slots().push(Arc::clone(&slot));
        MetricsShard {
            names: Arc::clone(&hub.names),
            counters: (0..layout.counters).map(|_| Cell::new(0)).collect(),
            sums: (0..layout.sums).map(|_| Cell::new(0)).collect(),
            gauges: (0..layout.gauges).map(|_| Cell::new(0)).collect(),
            layout,
            slot,
        }
    }

    /// The label tables, for resolving names to indexes.
    pub(crate) fn names(&self) -> &LabelNames {
        &self.names
    }

    fn add(&self, at: usize, n: u64) {
        if let Some(c) = self.counters.get(at) {
            c.set(c.get().wrapping_add(n));
        }
    }

    fn observe(&self, h: &Hist, series: usize, value: u64) {
        let bucket = h.buckets.bounds.partition_point(|&b| b < value);
        self.add(h.counts_at + series * h.stride() + bucket, 1);
        if let Some(s) = self.sums.get(h.sums_at + series) {
            s.set(s.get().wrapping_add(u128::from(value)));
        }
    }

    fn gauge_add(&self, at: usize, n: i64) {
        if let Some(g) = self.gauges.get(at) {
            g.set(g.get().wrapping_add(n));
        }
    }

    fn model_entity(&self, model: ModelIdx, entity: EntityIdx) -> usize {
        self.names.models.clamp(model.0) * self.layout.entities
            + self.names.entities.clamp(entity.0)
    }

    /// One client request finished (any outcome): `sluice_requests_total`.
    pub(crate) fn request_done(
        &self,
        route: RouteLabel,
        model: ModelIdx,
        entity: EntityIdx,
        status: StatusClass,
    ) {
        let r = self.names.routes.clamp(route.0);
        let series = (r * self.layout.models * self.layout.entities
            + self.model_entity(model, entity))
            * StatusClass::ALL.len()
            + status as usize;
        self.add(self.layout.requests + series, 1);
    }

    /// One request's settled usage: `sluice_tokens_total` and the `sluice_request_tokens`
    /// histogram. Call once per request with its totals. `cached` is the part of `prompt` served
    /// from the upstream's prompt cache (OpenAI's `prompt_tokens_details.cached_tokens`) and
    /// `cache_write` the part written to it (Anthropic's `cache_creation_input_tokens`), so both
    /// are subsets of `prompt`, not additions to it.
    pub(crate) fn tokens(
        &self,
        model: ModelIdx,
        entity: EntityIdx,
        prompt: u64,
        completion: u64,
        cached: u64,
        cache_write: u64,
    ) {
        let at = self.layout.tokens + self.model_entity(model, entity) * TOKEN_TYPES.len();
        self.add(at, prompt);
        self.add(at + 1, completion);
        self.add(at + 2, cached);
        self.add(at + 3, cache_write);
        let m = self.names.models.clamp(model.0);
        let h = self.layout.request_tokens;
        self.observe(&h, m * HIST_TOKEN_TYPES.len(), prompt);
        self.observe(&h, m * HIST_TOKEN_TYPES.len() + 1, completion);
    }

    /// One request's cost, in millionths of the configured currency unit (integer, so sums are
    /// exact): `sluice_cost_total`, exposed in whole units.
    pub(crate) fn cost(&self, model: ModelIdx, entity: EntityIdx, amount_micros: u64) {
        self.add(
            self.layout.cost + self.model_entity(model, entity),
            amount_micros,
        );
    }

    fn policy_dim(&self, policy: PolicyIdx, dimension: LimitDimension) -> usize {
        self.names.policies.clamp(policy.0) * LimitDimension::ALL.len() + dimension as usize
    }

    /// A limiter policy applied to a request (it was checked): `sluice_limiter_matches_total`.
    pub(crate) fn limiter_match(&self, policy: PolicyIdx, dimension: LimitDimension) {
        self.add(
            self.layout.limiter_matches + self.policy_dim(policy, dimension),
            1,
        );
    }

    /// A limiter policy rejected a request: `sluice_limiter_hits_total`.
    pub(crate) fn limiter_hit(&self, policy: PolicyIdx, dimension: LimitDimension) {
        self.add(
            self.layout.limiter_hits + self.policy_dim(policy, dimension),
            1,
        );
    }

    /// Time from the request arriving to the first content chunk sent to the client (not the
    /// response head): `sluice_time_to_first_token_seconds`.
    pub(crate) fn observe_ttft(&self, model: ModelIdx, ttft: Duration) {
        let m = self.names.models.clamp(model.0);
        self.observe(&self.layout.ttft, m, nanos(ttft));
    }

    /// Mean time per output token after the first, for one streamed request
    /// (`(total − ttft) / (completion_tokens − 1)`): `sluice_time_per_output_token_seconds`.
    pub(crate) fn observe_tpot(&self, model: ModelIdx, tpot: Duration) {
        let m = self.names.models.clamp(model.0);
        self.observe(&self.layout.tpot, m, nanos(tpot));
    }

    /// Whole request duration, head read to last byte written:
    /// `sluice_request_duration_seconds`.
    pub(crate) fn observe_latency(&self, route: RouteLabel, model: ModelIdx, latency: Duration) {
        let series = self.names.routes.clamp(route.0) * self.layout.models
            + self.names.models.clamp(model.0);
        self.observe(&self.layout.latency, series, nanos(latency));
    }

    /// Time Sluice itself spent on a request (everything but waiting on the client and the
    /// upstream): `sluice_overhead_seconds`.
    pub(crate) fn observe_overhead(&self, route: RouteLabel, overhead: Duration) {
        let r = self.names.routes.clamp(route.0);
        self.observe(&self.layout.overhead, r, nanos(overhead));
    }

    /// One attempt sent to a backend: `sluice_upstream_requests_total`.
    pub(crate) fn upstream_request(&self, backend: BackendIdx, attempt: Attempt) {
        let b = self.names.backends.clamp(backend.0);
        self.add(
            self.layout.upstream_requests + b * Attempt::ALL.len() + attempt as usize,
            1,
        );
    }

    /// One failed attempt: `sluice_upstream_errors_total`.
    pub(crate) fn upstream_error(&self, backend: BackendIdx, kind: UpstreamErrorKind) {
        let b = self.names.backends.clamp(backend.0);
        self.add(
            self.layout.upstream_errors + b * UpstreamErrorKind::ALL.len() + kind as usize,
            1,
        );
    }

    /// An exchange with `backend` starts: it counts in `sluice_upstream_in_flight` until the
    /// returned guard is dropped, so it is uncounted exactly once however the exchange ends.
    pub(crate) fn upstream_in_flight(&self, backend: BackendIdx) -> InFlight<'_> {
        let at = self.layout.in_flight + self.names.backends.clamp(backend.0);
        self.gauge_add(at, 1);
        InFlight { shard: self, at }
    }

    /// For tests that need a gauge value without holding guards.
    #[cfg(test)]
    fn upstream_in_flight_add(&self, backend: BackendIdx, n: i64) {
        let b = self.names.backends.clamp(backend.0);
        self.gauge_add(self.layout.in_flight + b, n);
    }

    /// One sync-backend flush: `sluice_sync_flush_duration_seconds` and
    /// `sluice_sync_flushes_total{result="ok"|"error"}`.
    pub(crate) fn sync_flush(&self, latency: Duration, ok: bool) {
        self.observe(&self.layout.sync_flush, 0, nanos(latency));
        self.add(self.layout.sync_flushes + usize::from(!ok), 1);
    }

    /// The worker's open client connections now: `sluice_connections_open` (summed over
    /// workers).
    pub(crate) fn connections_open(&self, n: usize) {
        if let Some(g) = self.gauges.get(self.layout.connections) {
            g.set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Copy this shard into its hub slot. Call from a per-worker timer, not per request: it
    /// copies the arrays (no allocation) and never blocks — when a scrape is reading this slot
    /// right now it returns `false` and the next publish carries the values. A hub other than the
    /// one this shard was made from is left untouched (`false`).
    pub(crate) fn publish(&self, hub: &MetricsHub) -> bool {
        if !Arc::ptr_eq(&self.names, &hub.names) {
            return false;
        }
        let mut slot = match self.slot.try_lock() {
            Ok(slot) => slot,
            // Plain numbers cannot be left half-valid in a way that matters: use them as is.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        for (dst, src) in slot.counters.iter_mut().zip(self.counters.iter()) {
            *dst = src.get();
        }
        for (dst, src) in slot.sums.iter_mut().zip(self.sums.iter()) {
            *dst = src.get();
        }
        for (dst, src) in slot.gauges.iter_mut().zip(self.gauges.iter()) {
            *dst = src.get();
        }
        slot.published = Instant::now();
        true
    }
}

/// One exchange with a backend, counted in `sluice_upstream_in_flight` while this lives (see
/// [`MetricsShard::upstream_in_flight`]). Hold it for as long as the upstream connection is in
/// use for the request.
#[must_use = "the exchange is uncounted when this is dropped"]
#[derive(Debug)]
pub(crate) struct InFlight<'s> {
    shard: &'s MetricsShard,
    /// The backend's gauge.
    at: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.shard.gauge_add(self.at, -1);
    }
}

// ---------------------------------------------------------------------------------------------
// The hub and the scrape
// ---------------------------------------------------------------------------------------------

/// One shard's last published values.
#[derive(Debug)]
struct Slot {
    counters: Vec<u64>,
    sums: Vec<u128>,
    gauges: Vec<i64>,
    /// Last publish, or registration until the first one.
    published: Instant,
}

impl Slot {
    fn zeroed(layout: &Layout) -> Slot {
        Slot {
            counters: vec![0; layout.counters],
            sums: vec![0; layout.sums],
            gauges: vec![0; layout.gauges],
            published: Instant::now(),
        }
    }

    /// The per-bucket (not cumulative) counts of one histogram series, `+Inf` last.
    fn bucket_counts(&self, h: &Hist, series: usize) -> &[u64] {
        let start = h.counts_at + series * h.stride();
        self.counters.get(start..start + h.stride()).unwrap_or(&[])
    }
}

/// Where shards publish and scrapes read. Shared as `Arc` between workers and the admin
/// listener; its mutex is only taken by publishes (per worker per interval) and scrapes.
#[derive(Debug)]
pub struct MetricsHub {
    names: Arc<LabelNames>,
    layout: Layout,
    /// Config reloads, recorded by the control thread (never by a worker).
    reloads: ReloadStats,
    /// Registered shards' slots; the outer lock is taken only to register and to list them.
    slots: Mutex<Vec<Arc<Mutex<Slot>>>>,
    /// Families another layer keeps (the wait queue's node-wide counters), written after the
    /// hub's own; replaced by the control thread on a reload, read by a scrape.
    appendix: Mutex<Option<Arc<dyn Appendix>>>,
}

/// The families the wait queue's appendix writes (`gateway::queue::QueueMetrics`, with
/// `[saturation]`): named here so the dashboard and alert checks know them; a gateway test holds
/// the appendix's output to this list.
#[cfg(test)]
pub(crate) const QUEUE_FAMILIES: [(&str, Kind); 6] = [
    ("sluice_queue_depth", Kind::Gauge),
    ("sluice_queue_total", Kind::Counter),
    ("sluice_queue_inversions_total", Kind::Counter),
    ("sluice_queue_wait_seconds", Kind::Histogram),
    ("sluice_backend_in_flight", Kind::Gauge),
    ("sluice_backend_in_flight_cap", Kind::Gauge),
];

/// Families whose values live outside the shards (in atomics shared by the workers), written
/// whole — `# HELP`, `# TYPE` and samples — at the end of a scrape.
pub(crate) trait Appendix: Send + Sync + std::fmt::Debug {
    fn render(&self, out: &mut String);
}

impl MetricsHub {
    /// The process-wide metrics hub. Its label tables are fixed at startup from the config: label
    /// values only ever come from configured names, so cardinality is bounded.
    pub fn for_snapshot(snapshot: &crate::config::Snapshot) -> Arc<MetricsHub> {
        let routes: Vec<String> = crate::openai::endpoint::Endpoint::ALL
            .iter()
            .map(|e| e.label().to_string())
            .collect();
        let mut models: Vec<String> = Vec::new();
        for route in &snapshot.routes {
            if let crate::config::ModelPattern::Exact(m) = &route.pattern {
                models.push(m.clone());
            }
        }
        for cluster in &snapshot.clusters {
            models.extend(cluster.model_map.keys().cloned());
        }
        models.extend(snapshot.prices.keys().cloned());
        models.sort();
        models.dedup();
        let mut backends = vec![String::new(); snapshot.backend_count];
        for cluster in &snapshot.clusters {
            for b in &cluster.backends {
                if let Some(slot) = backends.get_mut(b.id) {
                    *slot = backend_label(cluster, b);
                }
            }
        }
        // Quota refusals count under a last pseudo-policy, `quota`.
        let mut policies: Vec<String> = snapshot
            .limits
            .policies
            .iter()
            .map(|p| p.id.clone())
            .collect();
        policies.push(QUOTA_POLICY.into());
        Self::new(LabelLists {
            routes: &routes,
            models: &models,
            entities: &snapshot.limits.entities,
            backends: &backends,
            policies: &policies,
        })
    }

    pub fn new(lists: LabelLists<'_>) -> Arc<MetricsHub> {
        let names = LabelNames::new(lists);
        let layout = Layout::new(&names);
        Arc::new(MetricsHub {
            names: Arc::new(names),
            layout,
            reloads: ReloadStats::default(),
            slots: Mutex::new(Vec::new()),
            appendix: Mutex::new(None),
        })
    }

    pub fn names(&self) -> &LabelNames {
        &self.names
    }

    /// Shards registered so far.
    pub fn shard_count(&self) -> usize {
        self.lock_slots().len()
    }

    /// Bytes one shard's arrays take (its hub slot takes as much again).
    pub fn shard_bytes(&self) -> usize {
        self.layout.counters * std::mem::size_of::<u64>()
            + self.layout.sums * std::mem::size_of::<u128>()
            + self.layout.gauges * std::mem::size_of::<i64>()
    }

    fn lock_slots(&self) -> MutexGuard<'_, Vec<Arc<Mutex<Slot>>>> {
        // A panic while holding the lock cannot leave the list or a slot half-valid in a way
        // that matters (values are plain numbers), so a poisoned lock is used as is.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sum of all slots, plus (shard count, age of the oldest publish).
    fn merged(&self) -> (Slot, usize, Duration) {
        let mut total = Slot::zeroed(&self.layout);
        let slots: Vec<Arc<Mutex<Slot>>> = self.lock_slots().clone();
        let now = Instant::now();
        let mut oldest = Duration::ZERO;
        for slot in &slots {
            // Held only while this one slot is summed; its worker skips a publish meanwhile.
            let slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            for (t, v) in total.counters.iter_mut().zip(&slot.counters) {
                *t = t.wrapping_add(*v);
            }
            for (t, v) in total.sums.iter_mut().zip(&slot.sums) {
                *t = t.wrapping_add(*v);
            }
            for (t, v) in total.gauges.iter_mut().zip(&slot.gauges) {
                *t = t.wrapping_add(*v);
            }
            oldest = oldest.max(now.saturating_duration_since(slot.published));
        }
        (total, slots.len(), oldest)
    }

    /// Write every family of [`FAMILIES`], in its order, summed over all shards' last
    /// publishes, as Prometheus text exposition format 0.0.4 (`Content-Type: text/plain;
    /// version=0.0.4`). Appends to `out`.
    pub fn render(&self, out: &mut String) {
        let (totals, shards, oldest) = self.merged();
        let scrape = Scrape {
            totals: &totals,
            layout: &self.layout,
            names: &self.names,
            shards,
            oldest,
            reloads: &self.reloads,
        };
        let mut w = Writer { out };
        for family in FAMILIES {
            w.header(family.name, family.kind.as_str(), family.help);
            scrape.write_family(&mut w, family);
        }
        let appendix = self
            .appendix
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(a) = appendix {
            a.render(out);
        }
    }

    /// Write `appendix`'s families at the end of every scrape from now on (`None`: none).
    pub(crate) fn set_appendix(&self, appendix: Option<Arc<dyn Appendix>>) {
        *self.appendix.lock().unwrap_or_else(PoisonError::into_inner) = appendix;
    }
}

// ---------------------------------------------------------------------------------------------
// The families: each declared once, here; the scrape walks this table
// ---------------------------------------------------------------------------------------------

/// A family's Prometheus type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    /// Samples `_bucket` (cumulative, ending in `le="+Inf"`), `_sum` and `_count`.
    Histogram,
}

impl Kind {
    /// As written in `# TYPE` lines.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One label of a family: its key, and the values it takes, in exposition order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Label {
    /// `route`: the route table, then `other`.
    Route,
    /// `model`: the model table, then `other`.
    Model,
    /// `entity`: the entity table, then `other`.
    Entity,
    /// `backend`: the backend table, then `other`.
    Backend,
    /// `policy`: the policy table, then `other`.
    Policy,
    /// `status_class`: [`StatusClass`], `1xx` … `5xx`.
    StatusClass,
    /// `type` of `sluice_tokens_total`: prompt, completion, cached, cache_write.
    TokenType,
    /// `type` of `sluice_request_tokens`: prompt, completion.
    HistTokenType,
    /// `dimension`: [`LimitDimension`].
    Dimension,
    /// `attempt`: [`Attempt`].
    Attempt,
    /// `kind`: [`UpstreamErrorKind`].
    ErrorKind,
    /// `result` of a sync flush: ok, error.
    SyncResult,
    /// `outcome` of a config reload: applied, rejected.
    ReloadOutcome,
}

/// The most labels a family has (buckets add `le` on their own).
const MAX_LABELS: usize = 4;

impl Label {
    fn key(self) -> &'static str {
        match self {
            Label::Route => "route",
            Label::Model => "model",
            Label::Entity => "entity",
            Label::Backend => "backend",
            Label::Policy => "policy",
            Label::StatusClass => "status_class",
            Label::TokenType | Label::HistTokenType => "type",
            Label::Dimension => "dimension",
            Label::Attempt => "attempt",
            Label::ErrorKind => "kind",
            Label::SyncResult => "result",
            Label::ReloadOutcome => "outcome",
        }
    }

    /// How many values: never 0 (every table has its other slot).
    fn len(self, names: &LabelNames) -> usize {
        match self {
            Label::Route => names.routes.len(),
            Label::Model => names.models.len(),
            Label::Entity => names.entities.len(),
            Label::Backend => names.backends.len(),
            Label::Policy => names.policies.len(),
            Label::StatusClass => StatusClass::ALL.len(),
            Label::TokenType => TOKEN_TYPES.len(),
            Label::HistTokenType => HIST_TOKEN_TYPES.len(),
            Label::Dimension => LimitDimension::ALL.len(),
            Label::Attempt => Attempt::ALL.len(),
            Label::ErrorKind => UpstreamErrorKind::ALL.len(),
            Label::SyncResult => SYNC_RESULTS.len(),
            Label::ReloadOutcome => RELOAD_OUTCOMES.len(),
        }
    }

    /// The `i`th value (`other` past the end).
    fn value(self, names: &LabelNames, i: usize) -> &str {
        let listed = |list: &[&'static str]| list.get(i).copied().unwrap_or(OTHER);
        match self {
            Label::Route => names.routes.name(i),
            Label::Model => names.models.name(i),
            Label::Entity => names.entities.name(i),
            Label::Backend => names.backends.name(i),
            Label::Policy => names.policies.name(i),
            Label::StatusClass => StatusClass::ALL.get(i).map_or(OTHER, |c| c.label()),
            Label::TokenType => listed(&TOKEN_TYPES),
            Label::HistTokenType => listed(&HIST_TOKEN_TYPES),
            Label::Dimension => LimitDimension::ALL.get(i).map_or(OTHER, |d| d.label()),
            Label::Attempt => Attempt::ALL.get(i).map_or(OTHER, |a| a.label()),
            Label::ErrorKind => UpstreamErrorKind::ALL.get(i).map_or(OTHER, |k| k.label()),
            Label::SyncResult => listed(&SYNC_RESULTS),
            Label::ReloadOutcome => listed(&RELOAD_OUTCOMES),
        }
    }
}

/// Where a family's values are. A family's series are numbered row-major over its labels (the
/// last label varies fastest) — the order the shard stores them in and the order they are
/// written.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// `counters[first + series]`.
    Counter(fn(&Layout) -> usize),
    /// `counters[first + series]`, kept in units of `10^-digits` and exposed exactly.
    ScaledCounter(fn(&Layout) -> usize, u32),
    /// `gauges[first + series]`.
    Gauge(fn(&Layout) -> usize),
    /// Series `series` of this histogram.
    Histogram(fn(&Layout) -> Hist),
    /// The shards registered with the hub.
    ShardCount,
    /// The age of the oldest shard's last publish, in seconds.
    PublishAge,
    /// Config reloads by outcome (series: [`RELOAD_OUTCOMES`]).
    Reloads,
    /// Whether the last reload was applied (1) or rejected (0); 1 before any.
    LastReloadOk,
    /// When a reload was last applied (unix seconds); 0 before any.
    LastReloadAt,
    /// The earliest end of the TLS listener's certificates (unix seconds); 0 without one.
    TlsExpiry,
}

/// One metric family: all the exposition says about it. [`FAMILIES`] lists them.
#[derive(Debug)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    /// The `# HELP` text.
    pub(crate) help: &'static str,
    labels: &'static [Label],
    source: Source,
}

impl Family {
    /// Series still zero are left out of families keyed by model or entity, whose size is a
    /// product of configured lists; the others show every series (see the module docs).
    fn sparse(&self) -> bool {
        self.labels
            .iter()
            .any(|l| matches!(l, Label::Model | Label::Entity))
    }
}

/// Every metric family [`MetricsHub::render`] writes, in order: the only place a family's
/// name, type, help, labels and values are given.
pub const FAMILIES: &[Family] = &[
    // Requests and what they used.
    Family {
        name: "sluice_requests_total",
        kind: Kind::Counter,
        help: "Client requests finished, by API route, model, entity and status class.",
        labels: &[Label::Route, Label::Model, Label::Entity, Label::StatusClass],
        source: Source::Counter(|l| l.requests),
    },
    Family {
        name: "sluice_tokens_total",
        kind: Kind::Counter,
        help: "Tokens settled, by model, entity and type (cached and cache_write are the parts of prompt read from and written to the provider's cache).",
        labels: &[Label::Model, Label::Entity, Label::TokenType],
        source: Source::Counter(|l| l.tokens),
    },
    Family {
        name: "sluice_cost_total",
        kind: Kind::Counter,
        help: "Cost settled, in the configured currency unit, by model and entity.",
        labels: &[Label::Model, Label::Entity],
        // Kept in millionths (see `MetricsShard::cost`).
        source: Source::ScaledCounter(|l| l.cost, 6),
    },
    // Limiter.
    Family {
        name: "sluice_limiter_matches_total",
        kind: Kind::Counter,
        help: "Requests a limiter policy checked, by policy and dimension.",
        labels: &[Label::Policy, Label::Dimension],
        source: Source::Counter(|l| l.limiter_matches),
    },
    Family {
        name: "sluice_limiter_hits_total",
        kind: Kind::Counter,
        help: "Requests a limiter policy rejected, by policy and dimension.",
        labels: &[Label::Policy, Label::Dimension],
        source: Source::Counter(|l| l.limiter_hits),
    },
    // Upstream.
    Family {
        name: "sluice_upstream_requests_total",
        kind: Kind::Counter,
        help: "Attempts sent to upstream backends, by backend and attempt (first, retry, fallback).",
        labels: &[Label::Backend, Label::Attempt],
        source: Source::Counter(|l| l.upstream_requests),
    },
    Family {
        name: "sluice_upstream_errors_total",
        kind: Kind::Counter,
        help: "Failed upstream attempts, by backend and kind.",
        labels: &[Label::Backend, Label::ErrorKind],
        source: Source::Counter(|l| l.upstream_errors),
    },
    Family {
        name: "sluice_upstream_in_flight",
        kind: Kind::Gauge,
        help: "Requests in flight to each upstream backend.",
        labels: &[Label::Backend],
        source: Source::Gauge(|l| l.in_flight),
    },
    // Latency histograms.
    Family {
        name: "sluice_time_to_first_token_seconds",
        kind: Kind::Histogram,
        help: "Time from request arrival to the first content chunk sent to the client, by model.",
        labels: &[Label::Model],
        source: Source::Histogram(|l| l.ttft),
    },
    Family {
        name: "sluice_time_per_output_token_seconds",
        kind: Kind::Histogram,
        help: "Mean time per output token after the first, per streamed request, by model.",
        labels: &[Label::Model],
        source: Source::Histogram(|l| l.tpot),
    },
    Family {
        name: "sluice_request_duration_seconds",
        kind: Kind::Histogram,
        help: "Whole request duration, head read to last byte written, by API route and model.",
        labels: &[Label::Route, Label::Model],
        source: Source::Histogram(|l| l.latency),
    },
    Family {
        name: "sluice_overhead_seconds",
        kind: Kind::Histogram,
        help: "Time Sluice itself spent on a request (not waiting on client or upstream), by API route.",
        labels: &[Label::Route],
        source: Source::Histogram(|l| l.overhead),
    },
    Family {
        name: "sluice_request_tokens",
        kind: Kind::Histogram,
        help: "Tokens per request, by model and type (prompt, completion).",
        labels: &[Label::Model, Label::HistTokenType],
        source: Source::Histogram(|l| l.request_tokens),
    },
    // Sync backend.
    Family {
        name: "sluice_sync_flushes_total",
        kind: Kind::Counter,
        help: "Sync-backend flushes (deltas out, totals back), by result.",
        labels: &[Label::SyncResult],
        source: Source::Counter(|l| l.sync_flushes),
    },
    Family {
        name: "sluice_sync_flush_duration_seconds",
        kind: Kind::Histogram,
        help: "Duration of one sync-backend flush round trip.",
        labels: &[],
        source: Source::Histogram(|l| l.sync_flush),
    },
    // Process-level.
    Family {
        name: "sluice_connections_open",
        kind: Kind::Gauge,
        help: "Open client connections, all workers.",
        labels: &[],
        source: Source::Gauge(|l| l.connections),
    },
    Family {
        name: "sluice_metrics_shards",
        kind: Kind::Gauge,
        help: "Worker metrics shards registered with the hub.",
        labels: &[],
        source: Source::ShardCount,
    },
    Family {
        name: "sluice_metrics_publish_age_seconds",
        kind: Kind::Gauge,
        help: "Age of the oldest shard's last publish: how stale this scrape can be.",
        labels: &[],
        source: Source::PublishAge,
    },
    Family {
        name: "sluice_config_reloads_total",
        kind: Kind::Counter,
        help: "Config reloads (SIGHUP or POST /admin/reload): applied, or rejected with the old config still serving.",
        labels: &[Label::ReloadOutcome],
        source: Source::Reloads,
    },
    Family {
        name: "sluice_config_last_reload_successful",
        kind: Kind::Gauge,
        help: "1 when the last reload was applied (or none happened), 0 when it was rejected.",
        labels: &[],
        source: Source::LastReloadOk,
    },
    Family {
        name: "sluice_config_last_reload_success_timestamp_seconds",
        kind: Kind::Gauge,
        help: "When a reload was last applied, in unix seconds (0: never since start).",
        labels: &[],
        source: Source::LastReloadAt,
    },
    Family {
        name: "sluice_tls_certificate_expiry_timestamp_seconds",
        kind: Kind::Gauge,
        help: "The earliest notAfter of the serving config's TLS certificates, in unix seconds (0: no TLS listener).",
        labels: &[],
        source: Source::TlsExpiry,
    },
];

/// Config reload counts and the last outcome: written by the control thread, read by scrapes.
#[derive(Debug, Default)]
struct ReloadStats {
    applied: AtomicU64,
    rejected: AtomicU64,
    last_rejected: AtomicBool,
    last_applied_at: AtomicU64,
    /// The serving config's earliest certificate end (unix seconds), 0 without TLS.
    tls_expiry: AtomicU64,
}

impl MetricsHub {
    /// The serving config's earliest TLS certificate end (unix seconds; 0: no TLS listener),
    /// set at start and by every applied reload.
    pub(crate) fn set_tls_expiry(&self, not_after_unix_s: u64) {
        self.reloads
            .tls_expiry
            .store(not_after_unix_s, Ordering::Relaxed);
    }

    /// Count a reload: applied (at `now_unix_s`) or rejected.
    pub(crate) fn record_reload(&self, applied: bool, now_unix_s: u64) {
        let r = &self.reloads;
        if applied {
            r.applied.fetch_add(1, Ordering::Relaxed);
            r.last_applied_at.store(now_unix_s, Ordering::Relaxed);
        } else {
            r.rejected.fetch_add(1, Ordering::Relaxed);
        }
        r.last_rejected.store(!applied, Ordering::Relaxed);
    }
}

/// One scrape's values (all shards summed) and what names their series.
struct Scrape<'s> {
    totals: &'s Slot,
    layout: &'s Layout,
    names: &'s LabelNames,
    shards: usize,
    oldest: Duration,
    reloads: &'s ReloadStats,
}

impl Scrape<'_> {
    /// Every series of `family` (the sparse ones' zeros left out), in series order.
    fn write_family(&self, w: &mut Writer<'_>, family: &Family) {
        let series_count: usize = family.labels.iter().map(|l| l.len(self.names)).product();
        let sparse = family.sparse();
        let mut pairs = [("", ""); MAX_LABELS];
        let used = family.labels.len().min(MAX_LABELS);
        for series in 0..series_count {
            if sparse && self.is_zero(family.source, series) {
                continue;
            }
            // Row-major: the last label varies fastest.
            let mut rest = series;
            for (label, pair) in family.labels.iter().zip(pairs.iter_mut()).rev() {
                let len = label.len(self.names);
                *pair = (label.key(), label.value(self.names, rest % len));
                rest /= len;
            }
            let labels = pairs.get(..used).unwrap_or_default();
            self.write_series(w, family, labels, series);
        }
    }

    fn counter(&self, first: fn(&Layout) -> usize, series: usize) -> u64 {
        let at = first(self.layout) + series;
        self.totals.counters.get(at).copied().unwrap_or(0)
    }

    /// A counter at 0, or a histogram without observations.
    fn is_zero(&self, source: Source, series: usize) -> bool {
        match source {
            Source::Counter(first) | Source::ScaledCounter(first, _) => {
                self.counter(first, series) == 0
            }
            Source::Histogram(hist) => {
                let counts = self.totals.bucket_counts(&hist(self.layout), series);
                counts.iter().fold(0u64, |a, c| a.wrapping_add(*c)) == 0
            }
            Source::Gauge(_)
            | Source::ShardCount
            | Source::PublishAge
            | Source::Reloads
            | Source::LastReloadOk
            | Source::LastReloadAt
            | Source::TlsExpiry => false,
        }
    }

    fn write_series(
        &self,
        w: &mut Writer<'_>,
        family: &Family,
        labels: &[(&str, &str)],
        series: usize,
    ) {
        let name = family.name;
        match family.source {
            Source::Counter(first) => w.sample_u(name, labels, self.counter(first, series)),
            Source::ScaledCounter(first, digits) => {
                let v = u128::from(self.counter(first, series));
                w.sample_scaled(name, labels, v, digits);
            }
            Source::Gauge(first) => {
                let at = first(self.layout) + series;
                let v = self.totals.gauges.get(at).copied().unwrap_or(0);
                w.sample_i(name, labels, v);
            }
            Source::Histogram(hist) => {
                w.histogram(name, labels, self.totals, &hist(self.layout), series);
            }
            Source::ShardCount => w.sample_u(name, labels, self.shards as u64),
            Source::PublishAge => {
                let micros = u64::try_from(self.oldest.as_micros()).unwrap_or(u64::MAX);
                w.sample_scaled(name, labels, u128::from(micros), 6);
            }
            Source::Reloads => {
                let r = self.reloads;
                let count = if series == 0 { &r.applied } else { &r.rejected };
                w.sample_u(name, labels, count.load(Ordering::Relaxed));
            }
            Source::LastReloadOk => {
                let ok = !self.reloads.last_rejected.load(Ordering::Relaxed);
                w.sample_u(name, labels, u64::from(ok));
            }
            Source::LastReloadAt => {
                let at = self.reloads.last_applied_at.load(Ordering::Relaxed);
                w.sample_u(name, labels, at);
            }
            Source::TlsExpiry => {
                let at = self.reloads.tls_expiry.load(Ordering::Relaxed);
                w.sample_u(name, labels, at);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Text exposition
// ---------------------------------------------------------------------------------------------

struct Writer<'o> {
    out: &'o mut String,
}

impl Writer<'_> {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        self.out.push_str("# HELP ");
        self.out.push_str(name);
        self.out.push(' ');
        for c in help.chars() {
            match c {
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                c => self.out.push(c),
            }
        }
        self.out.push_str("\n# TYPE ");
        self.out.push_str(name);
        self.out.push(' ');
        self.out.push_str(kind);
        self.out.push('\n');
    }

    fn series(&mut self, name: &str, labels: &[(&str, &str)], le: Option<(u64, Unit)>) {
        self.out.push_str(name);
        if labels.is_empty() && le.is_none() {
            return;
        }
        self.out.push('{');
        let mut first = true;
        for (k, v) in labels {
            if !first {
                self.out.push(',');
            }
            first = false;
            self.out.push_str(k);
            self.out.push_str("=\"");
            push_label_value(self.out, v);
            self.out.push('"');
        }
        if let Some((bound, unit)) = le {
            if !first {
                self.out.push(',');
            }
            self.out.push_str("le=\"");
            if bound == u64::MAX {
                self.out.push_str("+Inf");
            } else {
                push_scaled(self.out, u128::from(bound), unit.scale_digits());
            }
            self.out.push('"');
        }
        self.out.push('}');
    }

    fn sample_u(&mut self, name: &str, labels: &[(&str, &str)], v: u64) {
        self.series(name, labels, None);
        let _ = writeln!(self.out, " {v}");
    }

    fn sample_i(&mut self, name: &str, labels: &[(&str, &str)], v: i64) {
        self.series(name, labels, None);
        let _ = writeln!(self.out, " {v}");
    }

    fn sample_scaled(&mut self, name: &str, labels: &[(&str, &str)], v: u128, digits: u32) {
        self.series(name, labels, None);
        self.out.push(' ');
        push_scaled(self.out, v, digits);
        self.out.push('\n');
    }

    /// One histogram series: cumulative `_bucket`s ending in `le="+Inf"`, `_sum`, `_count`.
    fn histogram(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        t: &Slot,
        h: &Hist,
        series: usize,
    ) {
        let counts = t.bucket_counts(h, series);
        let count: u64 = counts.iter().fold(0u64, |a, c| a.wrapping_add(*c));
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (i, c) in counts.iter().enumerate() {
            cumulative = cumulative.wrapping_add(*c);
            let bound = h.buckets.bounds.get(i).copied().unwrap_or(u64::MAX);
            self.series(&bucket, labels, Some((bound, h.buckets.unit)));
            let _ = writeln!(self.out, " {cumulative}");
        }
        let sum = t.sums.get(h.sums_at + series).copied().unwrap_or(0);
        self.series(&format!("{name}_sum"), labels, None);
        self.out.push(' ');
        push_scaled(self.out, sum, h.buckets.unit.scale_digits());
        self.out.push('\n');
        self.sample_u(&format!("{name}_count"), labels, count);
    }
}

/// A label value, escaped per the text format: `\` → `\\`, `"` → `\"`, newline → `\n`.
pub(crate) fn push_label_value(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// `v / 10^digits` as an exact decimal without trailing zeros (`1500000, 9` → `0.0015`).
fn push_scaled(out: &mut String, v: u128, digits: u32) {
    let div = 10u128.pow(digits);
    let (int, frac) = (v / div, v % div);
    let _ = write!(out, "{int}");
    if frac != 0 {
        let mut s = format!("{frac:0width$}", width = digits as usize);
        while s.ends_with('0') {
            s.pop();
        }
        out.push('.');
        out.push_str(&s);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use std::collections::{BTreeMap, HashSet};
    use std::path::PathBuf;
    use std::process::Command;

    // -----------------------------------------------------------------------------------------
    // A small, strict parser of text exposition 0.0.4 — stricter than Prometheus itself about
    // the things we promise: HELP then TYPE before every family's samples, sample names that
    // belong to the family, well-formed escaped labels, no duplicate series, histograms with
    // ascending `le`, cumulative buckets, a final `+Inf` equal to `_count`, and a `_sum`.
    // -----------------------------------------------------------------------------------------

    #[derive(Debug, Clone, PartialEq)]
    pub(crate) struct Sample {
        pub(crate) name: String,
        pub(crate) labels: Vec<(String, String)>,
        pub(crate) value: f64,
    }

    #[derive(Debug, Default)]
    pub(crate) struct Exposition {
        pub(crate) families: Vec<(String, String)>,
        pub(crate) samples: Vec<Sample>,
    }

    impl Exposition {
        pub(crate) fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
            let mut want: Vec<(String, String)> = labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            want.sort();
            self.samples
                .iter()
                .find(|s| {
                    let mut have = s.labels.clone();
                    have.sort();
                    s.name == name && have == want
                })
                .map(|s| s.value)
        }

        pub(crate) fn count(&self, name: &str) -> usize {
            self.samples.iter().filter(|s| s.name == name).count()
        }
    }

    fn is_name(s: &str) -> bool {
        let mut chars = s.chars();
        matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    type Labels = Vec<(String, String)>;

    fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
        let mut rest = s;
        let mut labels = Vec::new();
        loop {
            if let Some(r) = rest.strip_prefix('}') {
                return Ok((labels, r));
            }
            if !labels.is_empty() {
                rest = rest
                    .strip_prefix(',')
                    .ok_or_else(|| format!("expected , or }} at {rest:?}"))?;
            }
            let eq = rest.find('=').ok_or("label without =")?;
            let name = &rest[..eq];
            if !is_name(name) || name.contains(':') {
                return Err(format!("bad label name {name:?}"));
            }
            rest = rest[eq + 1..]
                .strip_prefix('"')
                .ok_or("label value not quoted")?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next() {
                    None => return Err("unterminated label value".into()),
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        Some((_, 'n')) => value.push('\n'),
                        other => return Err(format!("bad escape {other:?}")),
                    },
                    Some((_, '\n')) => return Err("raw newline in label value".into()),
                    Some((_, c)) => value.push(c),
                }
            };
            rest = &rest[end + 1..];
            if labels.iter().any(|(k, _): &(String, String)| k == name) {
                return Err(format!("duplicate label {name}"));
            }
            labels.push((name.to_string(), value));
        }
    }

    fn parse_value(s: &str) -> Result<f64, String> {
        match s {
            "+Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => s
                .parse::<f64>()
                .map_err(|e| format!("bad value {s:?}: {e}")),
        }
    }

    pub(crate) fn parse_strict(text: &str) -> Result<Exposition, String> {
        let mut exp = Exposition::default();
        if !text.ends_with('\n') {
            return Err("output must end with a newline".into());
        }
        let mut current: Option<(String, String)> = None;
        let mut pending_help: Option<String> = None;
        let mut seen_series = HashSet::new();
        for (lineno, line) in text.lines().enumerate() {
            let ctx = |e: String| format!("line {}: {e}: {line:?}", lineno + 1);
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').ok_or_else(|| ctx("no help".into()))?;
                if !is_name(name) {
                    return Err(ctx("bad family name".into()));
                }
                if help.contains('\\') {
                    let mut it = help.chars();
                    while let Some(c) = it.next() {
                        if c == '\\' && !matches!(it.next(), Some('\\' | 'n')) {
                            return Err(ctx("bad escape in HELP".into()));
                        }
                    }
                }
                if exp.families.iter().any(|(n, _)| n == name) {
                    return Err(ctx("family repeated".into()));
                }
                pending_help = Some(name.to_string());
                current = None;
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').ok_or_else(|| ctx("no type".into()))?;
                if pending_help.as_deref() != Some(name) {
                    return Err(ctx("TYPE without a HELP just before it".into()));
                }
                if !matches!(
                    kind,
                    "counter" | "gauge" | "histogram" | "summary" | "untyped"
                ) {
                    return Err(ctx("unknown type".into()));
                }
                if kind == "counter" && !name.ends_with("_total") {
                    return Err(ctx("counter name must end in _total".into()));
                }
                exp.families.push((name.to_string(), kind.to_string()));
                current = Some((name.to_string(), kind.to_string()));
                pending_help = None;
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                return Err(ctx("unexpected comment or blank line".into()));
            }
            let (family, kind) = current
                .as_ref()
                .ok_or_else(|| ctx("sample before HELP/TYPE".into()))?;
            let name_end = line
                .find(['{', ' '])
                .ok_or_else(|| ctx("no value".into()))?;
            let name = &line[..name_end];
            let (labels, rest) = if line[name_end..].starts_with('{') {
                parse_labels(&line[name_end + 1..]).map_err(ctx)?
            } else {
                (Vec::new(), &line[name_end..])
            };
            let value = rest
                .strip_prefix(' ')
                .ok_or_else(|| ctx("expected one space before the value".into()))?;
            if value.contains(' ') {
                return Err(ctx("timestamps are not emitted".into()));
            }
            let value = parse_value(value).map_err(ctx)?;
            let allowed = if kind == "histogram" {
                [
                    format!("{family}_bucket"),
                    format!("{family}_sum"),
                    format!("{family}_count"),
                ]
                .contains(&name.to_string())
            } else {
                name == family
            };
            if !allowed {
                return Err(ctx(format!("sample does not belong to family {family}")));
            }
            if name.ends_with("_bucket") != labels.iter().any(|(k, _)| k == "le") {
                return Err(ctx(
                    "le on a non-bucket sample, or a bucket without le".into()
                ));
            }
            if kind == "counter" && value < 0.0 {
                return Err(ctx("negative counter".into()));
            }
            let mut key = labels.clone();
            key.sort();
            if !seen_series.insert((name.to_string(), key)) {
                return Err(ctx("duplicate series".into()));
            }
            exp.samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        if pending_help.is_some() {
            return Err("HELP without TYPE at the end".into());
        }
        check_histograms(&exp)?;
        Ok(exp)
    }

    fn check_histograms(exp: &Exposition) -> Result<(), String> {
        for (family, _) in exp.families.iter().filter(|(_, k)| k == "histogram") {
            // Group the buckets by their labels without le, in output order.
            let mut groups: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
            for s in exp
                .samples
                .iter()
                .filter(|s| s.name == format!("{family}_bucket"))
            {
                let mut rest: Vec<_> = s
                    .labels
                    .iter()
                    .filter(|(k, _)| k != "le")
                    .cloned()
                    .collect();
                rest.sort();
                let le = s.labels.iter().find(|(k, _)| k == "le").unwrap();
                groups
                    .entry(rest)
                    .or_default()
                    .push((parse_value(&le.1)?, s.value));
            }
            for (labels, buckets) in &groups {
                let refs: Vec<(&str, &str)> = labels
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                for w in buckets.windows(2) {
                    if w[1].0 <= w[0].0 {
                        return Err(format!("{family}{labels:?}: le not ascending"));
                    }
                    if w[1].1 < w[0].1 {
                        return Err(format!("{family}{labels:?}: buckets not cumulative"));
                    }
                }
                let last = buckets.last().unwrap();
                if last.0 != f64::INFINITY {
                    return Err(format!("{family}{labels:?}: last bucket is not +Inf"));
                }
                let count = exp
                    .get(&format!("{family}_count"), &refs)
                    .ok_or(format!("{family}{labels:?}: no _count"))?;
                if count != last.1 {
                    return Err(format!("{family}{labels:?}: +Inf != _count"));
                }
                exp.get(&format!("{family}_sum"), &refs)
                    .ok_or(format!("{family}{labels:?}: no _sum"))?;
            }
            let counts = exp.count(&format!("{family}_count"));
            if counts != groups.len() || exp.count(&format!("{family}_sum")) != counts {
                return Err(format!("{family}: _sum/_count without buckets"));
            }
        }
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Fixtures
    // -----------------------------------------------------------------------------------------

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    const WEIRD: &str = "we\"ird\\tag\nline2";

    fn hub() -> Arc<MetricsHub> {
        let routes = strings(&["chat_completions", "embeddings"]);
        let models = strings(&["gpt-4o", "llama-3-70b", "gpt-4o"]);
        let entities = strings(&["team-a", WEIRD, "other"]);
        let backends = strings(&["openai/api.openai.com:443", "vllm/10.0.0.5:8000"]);
        let policies = strings(&["default", "team-a-tpm"]);
        MetricsHub::new(LabelLists {
            routes: &routes,
            models: &models,
            entities: &entities,
            backends: &backends,
            policies: &policies,
        })
    }

    fn render(hub: &MetricsHub) -> (String, Exposition) {
        let mut out = String::new();
        hub.render(&mut out);
        match parse_strict(&out) {
            Ok(exp) => (out, exp),
            Err(e) => panic!("invalid exposition: {e}\n{out}"),
        }
    }

    /// Two workers' worth of traffic, published.
    fn two_shards(hub: &Arc<MetricsHub>) -> (MetricsShard, MetricsShard) {
        let a = MetricsShard::new(hub);
        let b = MetricsShard::new(hub);
        let n = hub.names();
        let (chat, gpt, llama, team) = (
            n.route("chat_completions"),
            n.model("gpt-4o"),
            n.model("llama-3-70b"),
            n.entity("team-a"),
        );
        let (openai, vllm) = (n.backend_at(0), n.backend_at(1));
        for _ in 0..3 {
            a.request_done(chat, gpt, team, StatusClass::from_status(200));
        }
        b.request_done(chat, gpt, team, StatusClass::from_status(201));
        b.request_done(chat, llama, n.entity(WEIRD), StatusClass::from_status(503));
        b.request_done(
            n.route("nope"),
            n.model("mystery"),
            n.entity("sk-live-secret"),
            StatusClass::ClientError,
        );

        a.tokens(gpt, team, 100, 20, 64, 16);
        b.tokens(gpt, team, 50, 5000, 0, 0);
        a.cost(gpt, team, 1_500);
        b.cost(gpt, team, 2_000);

        a.limiter_match(n.policy("default"), LimitDimension::Rpm);
        b.limiter_match(n.policy("default"), LimitDimension::Rpm);
        b.limiter_hit(n.policy("default"), LimitDimension::Rpm);
        a.limiter_hit(n.policy("team-a-tpm"), LimitDimension::Tpm);

        a.upstream_request(openai, Attempt::First);
        b.upstream_request(openai, Attempt::First);
        b.upstream_request(vllm, Attempt::Fallback);
        b.upstream_error(openai, UpstreamErrorKind::Status429);
        a.upstream_in_flight_add(openai, 1);
        a.upstream_in_flight_add(openai, 1);
        b.upstream_in_flight_add(openai, 1);
        a.upstream_in_flight_add(openai, -1);
        b.upstream_in_flight_add(vllm, 1);
        b.upstream_in_flight_add(vllm, -1);

        a.observe_ttft(gpt, Duration::from_millis(30));
        b.observe_ttft(gpt, Duration::from_millis(300));
        a.observe_tpot(gpt, Duration::from_millis(20));
        a.observe_latency(chat, gpt, Duration::from_millis(1_500));
        a.observe_overhead(chat, Duration::from_nanos(3_500));
        b.observe_overhead(chat, Duration::from_micros(7));

        a.sync_flush(Duration::from_micros(800), true);
        b.sync_flush(Duration::from_secs(3), false);
        a.connections_open(7);
        b.connections_open(5);

        a.publish(hub);
        b.publish(hub);
        (a, b)
    }

    // -----------------------------------------------------------------------------------------
    // Tests
    // -----------------------------------------------------------------------------------------

    #[test]
    fn two_shards_merge_into_one_scrape() {
        let hub = hub();
        let _shards = two_shards(&hub);
        let (_, e) = render(&hub);
        let req = |route, model, entity, class| {
            e.get(
                "sluice_requests_total",
                &[
                    ("route", route),
                    ("model", model),
                    ("entity", entity),
                    ("status_class", class),
                ],
            )
        };
        assert_eq!(
            req("chat_completions", "gpt-4o", "team-a", "2xx"),
            Some(4.0)
        );
        assert_eq!(
            req("chat_completions", "llama-3-70b", WEIRD, "5xx"),
            Some(1.0)
        );
        assert_eq!(req("other", "other", "other", "4xx"), Some(1.0));
        // Zero series of model/entity families are left out.
        assert_eq!(req("embeddings", "gpt-4o", "team-a", "2xx"), None);
        assert_eq!(e.count("sluice_requests_total"), 3);

        let tok = |t| {
            e.get(
                "sluice_tokens_total",
                &[("model", "gpt-4o"), ("entity", "team-a"), ("type", t)],
            )
        };
        assert_eq!(tok("prompt"), Some(150.0));
        assert_eq!(tok("completion"), Some(5020.0));
        assert_eq!(tok("cached"), Some(64.0));
        assert_eq!(tok("cache_write"), Some(16.0));
        assert_eq!(
            e.get(
                "sluice_cost_total",
                &[("model", "gpt-4o"), ("entity", "team-a")]
            ),
            Some(0.0035)
        );

        let lim = |name, p, d| e.get(name, &[("policy", p), ("dimension", d)]);
        assert_eq!(
            lim("sluice_limiter_matches_total", "default", "rpm"),
            Some(2.0)
        );
        assert_eq!(
            lim("sluice_limiter_hits_total", "default", "rpm"),
            Some(1.0)
        );
        assert_eq!(
            lim("sluice_limiter_hits_total", "team-a-tpm", "tpm"),
            Some(1.0)
        );
        // Policy families are dense: zeros and the other slot are shown.
        assert_eq!(
            lim("sluice_limiter_hits_total", "other", "quota"),
            Some(0.0)
        );
        assert_eq!(e.count("sluice_limiter_hits_total"), 3 * 4);

        let openai = "openai/api.openai.com:443";
        assert_eq!(
            e.get(
                "sluice_upstream_requests_total",
                &[("backend", openai), ("attempt", "first")]
            ),
            Some(2.0)
        );
        assert_eq!(
            e.get(
                "sluice_upstream_requests_total",
                &[("backend", "vllm/10.0.0.5:8000"), ("attempt", "fallback")]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_upstream_errors_total",
                &[("backend", openai), ("kind", "status_429")]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_upstream_errors_total",
                &[("backend", openai), ("kind", "connect")]
            ),
            Some(0.0)
        );
        assert_eq!(
            e.get("sluice_upstream_in_flight", &[("backend", openai)]),
            Some(2.0)
        );
        assert_eq!(
            e.get(
                "sluice_upstream_in_flight",
                &[("backend", "vllm/10.0.0.5:8000")]
            ),
            Some(0.0)
        );

        let gpt = [("model", "gpt-4o")];
        assert_eq!(
            e.get("sluice_time_to_first_token_seconds_count", &gpt),
            Some(2.0)
        );
        assert_eq!(
            e.get("sluice_time_to_first_token_seconds_sum", &gpt),
            Some(0.33)
        );
        assert_eq!(
            e.get(
                "sluice_time_to_first_token_seconds_bucket",
                &[("model", "gpt-4o"), ("le", "0.04")]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_time_to_first_token_seconds_bucket",
                &[("model", "gpt-4o"), ("le", "0.5")]
            ),
            Some(2.0)
        );
        assert_eq!(
            e.get(
                "sluice_time_to_first_token_seconds_count",
                &[("model", "llama-3-70b")]
            ),
            None,
            "histograms by model are sparse"
        );
        assert_eq!(
            e.get("sluice_time_per_output_token_seconds_sum", &gpt),
            Some(0.02)
        );
        assert_eq!(
            e.get(
                "sluice_request_duration_seconds_bucket",
                &[
                    ("route", "chat_completions"),
                    ("model", "gpt-4o"),
                    ("le", "1.28")
                ]
            ),
            Some(0.0)
        );
        assert_eq!(
            e.get(
                "sluice_request_duration_seconds_bucket",
                &[
                    ("route", "chat_completions"),
                    ("model", "gpt-4o"),
                    ("le", "2.56")
                ]
            ),
            Some(1.0)
        );
        let chat = [("route", "chat_completions")];
        assert_eq!(e.get("sluice_overhead_seconds_sum", &chat), Some(0.0000105));
        assert_eq!(
            e.get(
                "sluice_overhead_seconds_bucket",
                &[("route", "chat_completions"), ("le", "0.000005")]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_overhead_seconds_bucket",
                &[("route", "chat_completions"), ("le", "0.00001")]
            ),
            Some(2.0)
        );
        // Route-keyed overhead is dense: the unused route shows a zero histogram.
        assert_eq!(
            e.get("sluice_overhead_seconds_count", &[("route", "embeddings")]),
            Some(0.0)
        );

        let prompt = [("model", "gpt-4o"), ("type", "prompt")];
        assert_eq!(e.get("sluice_request_tokens_count", &prompt), Some(2.0));
        assert_eq!(e.get("sluice_request_tokens_sum", &prompt), Some(150.0));
        assert_eq!(
            e.get(
                "sluice_request_tokens_bucket",
                &[("model", "gpt-4o"), ("type", "completion"), ("le", "16384")]
            ),
            Some(2.0)
        );
        assert_eq!(
            e.get(
                "sluice_request_tokens_bucket",
                &[("model", "gpt-4o"), ("type", "completion"), ("le", "4096")]
            ),
            Some(1.0)
        );

        assert_eq!(
            e.get("sluice_sync_flushes_total", &[("result", "ok")]),
            Some(1.0)
        );
        assert_eq!(
            e.get("sluice_sync_flushes_total", &[("result", "error")]),
            Some(1.0)
        );
        assert_eq!(
            e.get("sluice_sync_flush_duration_seconds_count", &[]),
            Some(2.0)
        );
        assert_eq!(
            e.get("sluice_sync_flush_duration_seconds_sum", &[]),
            Some(3.0008)
        );
        assert_eq!(
            e.get(
                "sluice_sync_flush_duration_seconds_bucket",
                &[("le", "2.5")]
            ),
            Some(1.0),
            "3 s is past the last bound"
        );
        assert_eq!(
            e.get(
                "sluice_sync_flush_duration_seconds_bucket",
                &[("le", "+Inf")]
            ),
            Some(2.0)
        );
        assert_eq!(e.get("sluice_connections_open", &[]), Some(12.0));
        assert_eq!(e.get("sluice_metrics_shards", &[]), Some(2.0));
    }

    /// The scrape with one value changed: the publish age, which depends on the clock.
    fn without_publish_age(text: &str) -> String {
        let age = "sluice_metrics_publish_age_seconds ";
        text.lines()
            .map(|line| match line.strip_prefix(age) {
                Some(_) => format!("{age}AGE\n"),
                None => format!("{line}\n"),
            })
            .collect()
    }

    /// The exposition as the hand-written render of 3411d92 wrote it, for `two_shards` plus
    /// the traffic added in the test below: the byte-for-byte reference for any rework of
    /// render. Change it only together with a deliberate change of the exposition.
    const RECORDED_SCRAPE: &str = include_str!("testdata/metrics_scrape.prom");

    #[test]
    fn render_is_byte_for_byte_the_recorded_exposition() {
        let hub = hub();
        let (a, b) = two_shards(&hub);
        let n = hub.names();
        let (chat, embeddings) = (n.route("chat_completions"), n.route("embeddings"));
        let (gpt, llama, weird) = (n.model("gpt-4o"), n.model("llama-3-70b"), n.entity(WEIRD));
        // More rows of the sparse (model / entity) families, and more than one series each.
        a.request_done(embeddings, llama, weird, StatusClass::from_status(200));
        b.request_done(
            embeddings,
            ModelIdx::OTHER,
            EntityIdx::OTHER,
            StatusClass::Redirect,
        );
        a.tokens(llama, weird, 7, 0, 0, 0);
        b.tokens(ModelIdx::OTHER, EntityIdx::OTHER, 1, 2, 1, 0);
        a.cost(llama, weird, 1);
        b.cost(gpt, EntityIdx::OTHER, 123_456_789);
        b.observe_ttft(llama, Duration::from_secs(12));
        b.observe_tpot(llama, Duration::from_millis(75));
        a.observe_latency(embeddings, llama, Duration::from_millis(10));
        b.observe_latency(chat, ModelIdx::OTHER, Duration::from_secs(100));
        a.observe_overhead(embeddings, Duration::from_millis(6));
        b.limiter_match(PolicyIdx::OTHER, LimitDimension::Quota);
        a.upstream_request(BackendIdx::OTHER, Attempt::Retry);
        a.upstream_error(n.backend_at(1), UpstreamErrorKind::PoolExhausted);
        b.upstream_in_flight_add(n.backend_at(0), -1);
        a.upstream_in_flight_add(BackendIdx::OTHER, 1);
        a.sync_flush(Duration::from_millis(1), true);
        a.publish(&hub);
        b.publish(&hub);
        hub.record_reload(true, 1_700_000_000);
        hub.record_reload(false, 1_700_000_100);

        let (text, _) = render(&hub);
        let text = without_publish_age(&text);
        if text != RECORDED_SCRAPE {
            let path = temp_file("scrape", &text);
            let line = text
                .lines()
                .zip(RECORDED_SCRAPE.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(text.lines().count().min(RECORDED_SCRAPE.lines().count()));
            panic!(
                "the scrape differs from testdata/metrics_scrape.prom from line {}; it is in {}",
                line + 1,
                path.display()
            );
        }
    }

    #[test]
    fn every_family_is_rendered_once_in_declared_order() {
        let hub = hub();
        let _shards = two_shards(&hub);
        let (_, e) = render(&hub);
        let declared: Vec<(String, String)> = FAMILIES
            .iter()
            .map(|f| (f.name.to_string(), f.kind.as_str().to_string()))
            .collect();
        assert_eq!(e.families, declared);
        for f in FAMILIES {
            assert!(f.name.starts_with("sluice_"));
            assert!(f.labels.len() <= MAX_LABELS, "{}", f.name);
        }
    }

    /// Which family owns each counter, sum and gauge of `hub`'s layout.
    fn owners(hub: &MetricsHub) -> [Vec<Vec<&'static str>>; 3] {
        let l = &hub.layout;
        let mut counters = vec![Vec::new(); l.counters];
        let mut sums = vec![Vec::new(); l.sums];
        let mut gauges = vec![Vec::new(); l.gauges];
        fn claim(slots: &mut [Vec<&'static str>], first: usize, n: usize, name: &'static str) {
            let Some(range) = slots.get_mut(first..first + n) else {
                panic!(
                    "{name} reaches past the layout: {first}+{n} > {}",
                    slots.len()
                );
            };
            for slot in range {
                slot.push(name);
            }
        }
        for f in FAMILIES {
            let series: usize = f.labels.iter().map(|x| x.len(hub.names())).product();
            match f.source {
                Source::Counter(first) | Source::ScaledCounter(first, _) => {
                    claim(&mut counters, first(l), series, f.name);
                }
                Source::Gauge(first) => claim(&mut gauges, first(l), series, f.name),
                Source::Histogram(hist) => {
                    let h = hist(l);
                    claim(&mut counters, h.counts_at, series * h.stride(), f.name);
                    claim(&mut sums, h.sums_at, series, f.name);
                }
                Source::ShardCount
                | Source::PublishAge
                | Source::Reloads
                | Source::LastReloadOk
                | Source::LastReloadAt
                | Source::TlsExpiry => {}
            }
        }
        [counters, sums, gauges]
    }

    #[test]
    fn the_family_table_covers_the_layout_exactly_once() {
        // Each family's labels say how many series it has; the layout reserves the same.
        let lists = [hub(), MetricsHub::new(LabelLists::default())];
        for hub in &lists {
            for (what, slots) in ["counter", "sum", "gauge"].iter().zip(owners(hub)) {
                for (i, owners) in slots.iter().enumerate() {
                    assert_eq!(owners.len(), 1, "{what} {i} belongs to {owners:?}");
                }
            }
        }
    }

    #[test]
    fn buckets_are_cumulative_le_is_inclusive_and_inf_counts_all() {
        let hub = hub();
        let s = MetricsShard::new(&hub);
        let gpt = hub.names().model("gpt-4o");
        // Exactly on a bound counts in that bound's bucket (le is inclusive).
        s.observe_ttft(gpt, Duration::from_millis(100));
        s.observe_ttft(gpt, Duration::from_nanos(100_000_001));
        s.observe_ttft(gpt, Duration::ZERO);
        s.observe_ttft(gpt, Duration::from_secs(60));
        s.observe_ttft(gpt, Duration::MAX);
        s.publish(&hub);
        let (text, e) = render(&hub);
        let b = |le| {
            e.get(
                "sluice_time_to_first_token_seconds_bucket",
                &[("model", "gpt-4o"), ("le", le)],
            )
        };
        assert_eq!(b("0.001"), Some(1.0));
        assert_eq!(b("0.08"), Some(1.0));
        assert_eq!(b("0.1"), Some(2.0));
        assert_eq!(b("0.25"), Some(3.0));
        assert_eq!(b("10"), Some(3.0));
        assert_eq!(b("+Inf"), Some(5.0));
        assert_eq!(
            e.get(
                "sluice_time_to_first_token_seconds_count",
                &[("model", "gpt-4o")]
            ),
            Some(5.0)
        );
        // The sum is exact (integer nanoseconds): 0.1 + 0.100000001 + 0 + 60 + u64::MAX ns.
        assert!(
            text.contains(
                "sluice_time_to_first_token_seconds_sum{model=\"gpt-4o\"} 18446744133.909551616\n"
            ),
            "{text}"
        );
        // +Inf is the last bucket, right before _sum.
        let inf = text
            .find("sluice_time_to_first_token_seconds_bucket{model=\"gpt-4o\",le=\"+Inf\"} 5\n")
            .unwrap();
        let sum = text
            .find("sluice_time_to_first_token_seconds_sum{")
            .unwrap();
        assert!(inf < sum);
    }

    #[test]
    fn bucket_boundaries_are_the_documented_ones() {
        let le = |b: &Buckets| -> Vec<String> {
            b.bounds
                .iter()
                .map(|&v| {
                    let mut s = String::new();
                    push_scaled(&mut s, u128::from(v), b.unit.scale_digits());
                    s
                })
                .collect()
        };
        assert_eq!(
            le(&TTFT_BUCKETS),
            [
                "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
                "0.75", "1", "2.5", "5", "7.5", "10"
            ]
        );
        assert_eq!(
            le(&TPOT_BUCKETS),
            [
                "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5",
                "0.75", "1", "2.5"
            ]
        );
        let doubling: Vec<String> = (0..14)
            .map(|i| {
                let mut s = String::new();
                push_scaled(&mut s, 10u128 << i, 3);
                s
            })
            .collect();
        assert_eq!(le(&LATENCY_BUCKETS), doubling);
        assert_eq!(
            le(&LATENCY_BUCKETS).last().map(String::as_str),
            Some("81.92")
        );
        let fours: Vec<String> = (0..14).map(|i| (1u64 << (2 * i)).to_string()).collect();
        assert_eq!(le(&TOKEN_BUCKETS), fours);
        assert_eq!(
            le(&TOKEN_BUCKETS).last().map(String::as_str),
            Some("67108864")
        );
        assert_eq!(
            le(&OVERHEAD_BUCKETS),
            [
                "0.000001", "0.000002", "0.000005", "0.00001", "0.00002", "0.00005", "0.0001",
                "0.0002", "0.0005", "0.001", "0.002", "0.005"
            ]
        );
        for b in [
            &TTFT_BUCKETS,
            &TPOT_BUCKETS,
            &LATENCY_BUCKETS,
            &TOKEN_BUCKETS,
            &OVERHEAD_BUCKETS,
            &SYNC_FLUSH_BUCKETS,
        ] {
            assert!(b.bounds.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let hub = hub();
        let s = MetricsShard::new(&hub);
        let n = hub.names();
        s.request_done(
            n.route("chat_completions"),
            n.model("gpt-4o"),
            n.entity(WEIRD),
            StatusClass::Success,
        );
        s.publish(&hub);
        let (text, e) = render(&hub);
        assert!(
            text.contains(r#"entity="we\"ird\\tag\nline2""#),
            "escaped form missing:\n{text}"
        );
        assert_eq!(
            e.get(
                "sluice_requests_total",
                &[
                    ("route", "chat_completions"),
                    ("model", "gpt-4o"),
                    ("entity", WEIRD),
                    ("status_class", "2xx")
                ]
            ),
            Some(1.0)
        );
        let mut out = String::new();
        push_label_value(&mut out, "a\\b\"c\nd");
        assert_eq!(out, "a\\\\b\\\"c\\nd");
    }

    #[test]
    fn unknown_names_and_positions_land_in_the_other_slot() {
        let hub = hub();
        let n = hub.names();
        // models: ["gpt-4o", "llama-3-70b", "gpt-4o"] → slots gpt-4o, llama-3-70b, other.
        assert_eq!(n.model("gpt-4o"), n.model_at(0));
        assert_eq!(n.model_at(2), n.model_at(0), "duplicates share a slot");
        assert_eq!(n.model("unknown"), n.model_at(99));
        assert_eq!(n.models.len(), 3);
        // entities: ["team-a", WEIRD, "other"] → the configured "other" is the other slot.
        assert_eq!(n.entity_at(2), n.entity("never-configured"));
        assert_eq!(n.entities.len(), 3);

        let s = MetricsShard::new(&hub);
        s.request_done(
            RouteLabel::OTHER,
            ModelIdx::OTHER,
            n.entity("sk-proj-raw-key-value"),
            StatusClass::from_status(404),
        );
        s.tokens(n.model("unlisted"), n.entity_at(2), 3, 4, 0, 0);
        s.upstream_error(BackendIdx::OTHER, UpstreamErrorKind::Timeout);
        s.limiter_hit(PolicyIdx::OTHER, LimitDimension::Concurrency);
        s.observe_ttft(n.model("whatever"), Duration::from_millis(5));
        s.publish(&hub);
        let (text, e) = render(&hub);
        assert!(!text.contains("sk-proj"), "a raw value leaked");
        assert!(!text.contains("unlisted") && !text.contains("whatever"));
        assert_eq!(
            e.get(
                "sluice_requests_total",
                &[
                    ("route", "other"),
                    ("model", "other"),
                    ("entity", "other"),
                    ("status_class", "4xx")
                ]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_tokens_total",
                &[
                    ("model", "other"),
                    ("entity", "other"),
                    ("type", "completion")
                ]
            ),
            Some(4.0)
        );
        assert_eq!(
            e.get(
                "sluice_upstream_errors_total",
                &[("backend", "other"), ("kind", "timeout")]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_limiter_hits_total",
                &[("policy", "other"), ("dimension", "concurrency")]
            ),
            Some(1.0)
        );
        assert_eq!(
            e.get(
                "sluice_time_to_first_token_seconds_count",
                &[("model", "other")]
            ),
            Some(1.0)
        );
        // Exactly one "other" per label, never a duplicate series (the strict parser checks).
        assert_eq!(
            e.samples
                .iter()
                .filter(|s| s.name == "sluice_upstream_in_flight")
                .count(),
            3
        );
    }

    #[test]
    fn empty_tables_still_have_the_other_slot() {
        let hub = MetricsHub::new(LabelLists::default());
        // 136 counters and buckets, 7 sums (u128), 2 gauges.
        assert_eq!(hub.shard_bytes(), 136 * 8 + 7 * 16 + 2 * 8);
        let s = MetricsShard::new(&hub);
        s.request_done(
            hub.names().route("x"),
            ModelIdx::OTHER,
            EntityIdx::OTHER,
            StatusClass::Success,
        );
        s.upstream_in_flight_add(hub.names().backend_at(0), 1);
        s.publish(&hub);
        let (_, e) = render(&hub);
        assert_eq!(
            e.get("sluice_upstream_in_flight", &[("backend", "other")]),
            Some(1.0)
        );
        assert_eq!(e.count("sluice_requests_total"), 1);
    }

    #[test]
    fn an_exchange_is_in_flight_while_its_guard_lives() {
        let hub = hub();
        let s = MetricsShard::new(&hub);
        let n = hub.names();
        let in_flight = |backend| {
            s.publish(&hub);
            render(&hub)
                .1
                .get("sluice_upstream_in_flight", &[("backend", backend)])
        };
        let openai = "openai/api.openai.com:443";
        let first = s.upstream_in_flight(n.backend_at(0));
        let second = s.upstream_in_flight(n.backend_at(0));
        let unknown = s.upstream_in_flight(n.backend_at(7));
        assert_eq!(in_flight(openai), Some(2.0));
        assert_eq!(in_flight("other"), Some(1.0));
        drop(first);
        assert_eq!(in_flight(openai), Some(1.0));
        drop((second, unknown));
        assert_eq!(in_flight(openai), Some(0.0));
        assert_eq!(in_flight("other"), Some(0.0));
    }

    #[test]
    fn scrape_sees_only_published_values() {
        let hub = hub();
        let s = MetricsShard::new(&hub);
        let n = hub.names();
        let q = |e: &Exposition| {
            e.get(
                "sluice_upstream_requests_total",
                &[
                    ("backend", "openai/api.openai.com:443"),
                    ("attempt", "retry"),
                ],
            )
        };
        s.upstream_request(n.backend_at(0), Attempt::Retry);
        assert_eq!(q(&render(&hub).1), Some(0.0), "not published yet");
        s.publish(&hub);
        assert_eq!(q(&render(&hub).1), Some(1.0));
        s.upstream_request(n.backend_at(0), Attempt::Retry);
        assert_eq!(
            q(&render(&hub).1),
            Some(1.0),
            "stale until the next publish"
        );
        s.publish(&hub);
        assert_eq!(q(&render(&hub).1), Some(2.0));

        // A publish never waits: while a scrape holds the slot it is skipped, then catches up.
        s.upstream_request(n.backend_at(0), Attempt::Retry);
        {
            let _scrape = s.slot.lock().unwrap();
            assert!(!s.publish(&hub));
        }
        assert!(s.publish(&hub));
        assert_eq!(q(&render(&hub).1), Some(3.0));

        // A shard never publishes into a hub it was not made from.
        let other = self::hub();
        assert!(!s.publish(&other));
        assert_eq!(q(&render(&other).1), Some(0.0));
        assert_eq!(other.shard_count(), 0);

        let age = render(&hub)
            .1
            .get("sluice_metrics_publish_age_seconds", &[])
            .unwrap();
        assert!((0.0..5.0).contains(&age), "{age}");
    }

    #[test]
    fn enum_discriminants_match_their_tables() {
        for (i, c) in StatusClass::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        for (i, c) in LimitDimension::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        for (i, c) in Attempt::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        for (i, c) in UpstreamErrorKind::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        assert_eq!(StatusClass::from_status(99).label(), "5xx");
        assert_eq!(StatusClass::from_status(101).label(), "1xx");
        assert_eq!(StatusClass::from_status(302).label(), "3xx");
        assert_eq!(StatusClass::from_status(429).label(), "4xx");
        assert_eq!(StatusClass::from_status(600).label(), "5xx");
    }

    #[test]
    fn scaled_decimals_are_exact() {
        let f = |v: u128, d: u32| {
            let mut s = String::new();
            push_scaled(&mut s, v, d);
            s
        };
        assert_eq!(f(0, 9), "0");
        assert_eq!(f(1, 9), "0.000000001");
        assert_eq!(f(1_500_000_000, 9), "1.5");
        assert_eq!(f(3_500, 6), "0.0035");
        assert_eq!(f(42, 0), "42");
    }

    // -----------------------------------------------------------------------------------------
    // Black-box checks with outside tools: Python's prometheus_client parser, promtool, and the
    // dashboards / alert rules in conf/ against the names rendered here.
    // -----------------------------------------------------------------------------------------

    fn repo_root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    fn temp_file(tag: &str, contents: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("sluice-metrics-{}-{tag}.txt", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        path
    }

    const PY_PARSE: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
text = open(sys.argv[1], encoding="utf-8").read()
for fam in text_string_to_metric_families(text):
    print("F\t%s\t%s" % (fam.name, fam.type))
    for s in fam.samples:
        labels = "\x1e".join(
            "%s\x1f%s" % (k, v.encode("unicode_escape").decode("ascii"))
            for k, v in sorted(s.labels.items()))
        print("S\t%s\t%s\t%r" % (s.name, labels, s.value))
"#;

    #[test]
    fn prometheus_client_parses_the_scrape_identically() {
        let hub = hub();
        let _shards = two_shards(&hub);
        let (text, e) = render(&hub);
        let path = temp_file("pyparse", &text);
        let out = Command::new("python3")
            .arg("-c")
            .arg(PY_PARSE)
            .arg(&path)
            .output()
            .expect("python3 must be installed (scripts/test.sh installs prometheus_client)");
        let _ = std::fs::remove_file(&path);
        assert!(
            out.status.success(),
            "prometheus_client failed (install: python3 -m pip install prometheus_client):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let mut py_families = Vec::new();
        let mut py_samples = BTreeMap::new();
        for line in stdout.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            match fields.as_slice() {
                ["F", name, kind] => py_families.push((name.to_string(), kind.to_string())),
                ["S", name, labels, value] => {
                    let value: f64 = value.parse().unwrap();
                    py_samples.insert((name.to_string(), labels.to_string()), value);
                }
                _ => panic!("unexpected line {line:?}"),
            }
        }
        // prometheus_client names a counter family without its _total suffix.
        let ours: Vec<(String, String)> = FAMILIES
            .iter()
            .map(|f| {
                let n = if f.kind == Kind::Counter {
                    f.name.trim_end_matches("_total")
                } else {
                    f.name
                };
                (n.to_string(), f.kind.as_str().to_string())
            })
            .collect();
        assert_eq!(py_families, ours);
        let escape = |s: &str| -> String {
            s.chars()
                .map(|c| match c {
                    '\n' => "\\n".to_string(),
                    '\\' => "\\\\".to_string(),
                    c => c.to_string(),
                })
                .collect()
        };
        let mine: BTreeMap<(String, String), f64> = e
            .samples
            .iter()
            .map(|s| {
                let mut labels = s.labels.clone();
                labels.sort();
                let labels: Vec<String> = labels
                    .iter()
                    .map(|(k, v)| format!("{k}\x1f{}", escape(v)))
                    .collect();
                let labels = labels.join("\x1e");
                ((s.name.clone(), labels), s.value)
            })
            .collect();
        assert_eq!(mine.len(), e.samples.len());
        assert_eq!(py_samples, mine);
    }

    fn promtool() -> Option<PathBuf> {
        let found = Command::new("promtool").arg("--version").output().ok()?;
        found.status.success().then(|| PathBuf::from("promtool"))
    }

    #[test]
    fn promtool_lints_the_scrape_when_installed() {
        let Some(promtool) = promtool() else {
            eprintln!("SKIP: promtool not installed (apt-get install prometheus)");
            return;
        };
        let hub = hub();
        let _shards = two_shards(&hub);
        let (text, _) = render(&hub);
        let mut child = Command::new(promtool)
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        {
            use std::io::Write as _;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(text.as_bytes()).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Every sample name the module can emit.
    fn emitted_names() -> Vec<String> {
        let mut names = Vec::new();
        let all = FAMILIES
            .iter()
            .map(|f| (f.name, f.kind))
            .chain(QUEUE_FAMILIES);
        for (name, kind) in all {
            if kind == Kind::Histogram {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.push(format!("{name}{suffix}"));
                }
            } else {
                names.push(name.to_string());
            }
        }
        names
    }

    /// Metric names (`sluice_…` identifiers) in a PromQL expression.
    fn metric_names_in(expr: &str) -> Vec<String> {
        let mut names = Vec::new();
        let bytes = expr.as_bytes();
        let mut i = 0;
        while let Some(pos) = expr[i..].find("sluice_") {
            let start = i + pos;
            let boundary = start == 0
                || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
            let mut end = start;
            while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
                end += 1;
            }
            if boundary {
                names.push(expr[start..end].to_string());
            }
            i = end;
        }
        names
    }

    const PY_DASHBOARD: &str = r#"
import json, sys
dash = json.load(open(sys.argv[1], encoding="utf-8"))
assert isinstance(dash.get("panels"), list) and dash["panels"], "no panels"
assert dash.get("title") and dash.get("uid"), "title/uid missing"
ids = set()
def walk(panels):
    for p in panels:
        assert "id" in p and p["id"] not in ids, "panel id missing or repeated: %r" % p.get("title")
        ids.add(p["id"])
        assert "gridPos" in p and p.get("title"), "panel without gridPos/title"
        if p.get("type") == "row":
            walk(p.get("panels", []))
            continue
        targets = p.get("targets") or []
        assert targets, "panel without targets: %r" % p["title"]
        for t in targets:
            assert t.get("expr"), "target without expr in %r" % p["title"]
            print("E\t%s\t%s" % (p["title"], t["expr"].replace("\n", " ")))
walk(dash["panels"])
for v in dash.get("templating", {}).get("list", []):
    q = v.get("query")
    if v.get("type") == "query":
        q = q.get("query") if isinstance(q, dict) else q
        assert q, "query variable without a query: %r" % v.get("name")
        print("E\tvariable %s\t%s" % (v["name"], q))
"#;

    #[test]
    fn grafana_dashboard_uses_only_emitted_metrics() {
        let path = repo_root().join("conf/grafana/sluice.json");
        let out = Command::new("python3")
            .arg("-c")
            .arg(PY_DASHBOARD)
            .arg(&path)
            .output()
            .expect("python3 must be installed");
        assert!(
            out.status.success(),
            "dashboard check failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let emitted = emitted_names();
        let mut used = HashSet::new();
        let mut exprs = 0;
        for line in stdout.lines() {
            let (_, rest) = line.split_once('\t').unwrap();
            let (title, expr) = rest.split_once('\t').unwrap();
            exprs += 1;
            let names = metric_names_in(expr);
            assert!(
                !names.is_empty(),
                "panel {title:?}: no sluice metric in {expr:?}"
            );
            for name in names {
                assert!(
                    emitted.contains(&name),
                    "panel {title:?} uses {name}, which metrics.rs does not emit"
                );
                used.insert(name);
            }
        }
        assert!(exprs >= 10, "only {exprs} expressions");
        // The brief's panels: every family except the hub's own bookkeeping is on the dashboard.
        let queue = QUEUE_FAMILIES.iter().map(|(name, _)| *name);
        for family in FAMILIES.iter().map(|f| f.name).chain(queue) {
            if family.starts_with("sluice_metrics_") {
                continue;
            }
            assert!(
                used.iter().any(|u| u.starts_with(family)),
                "no panel shows {family}"
            );
        }
    }

    #[test]
    fn alert_rules_use_only_emitted_metrics() {
        let path = repo_root().join("conf/prometheus/alerts.yml");
        let text = std::fs::read_to_string(&path).unwrap();
        let emitted = emitted_names();
        let mut alerts = 0;
        for line in text.lines() {
            let line = line.trim_start();
            if line.starts_with("- alert:") {
                alerts += 1;
            }
            if line.starts_with('#') {
                continue;
            }
            for name in metric_names_in(line) {
                assert!(
                    emitted.contains(&name),
                    "alerts.yml uses {name}, which metrics.rs does not emit: {line:?}"
                );
            }
        }
        assert!(alerts >= 4, "only {alerts} alerts");
        let Some(promtool) = promtool() else {
            eprintln!("SKIP: promtool not installed; rules syntax not checked");
            return;
        };
        let check = Command::new(&promtool)
            .args(["check", "rules"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "promtool check rules:\n{}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let tests = repo_root().join("conf/prometheus/alerts_test.yml");
        let run = Command::new(&promtool)
            .args(["test", "rules"])
            .arg(&tests)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "promtool test rules:\n{}{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
    }
}
