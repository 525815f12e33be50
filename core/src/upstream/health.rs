//! Passive health of each backend, shared by every worker of the process: a circuit breaker,
//! a cool-down after a 429 / 529, and the retry budget.
//!
//! Read by the route phase (is a backend available now?) and written by the pipeline after each
//! attempt ([`BackendHealth::record`]). One [`HealthTable`] is built per config snapshot by the
//! runtime, keeping the state of every backend the previous snapshot had (same cluster name,
//! same URL), so a reload neither forgets an outage nor resets a breaker. Everything is atomics
//! with relaxed ordering: workers never lock, and a decision made on a value a moment old is
//! fine (at worst one more request reaches a backend that just failed).
//!
//! The breaker: `breaker.failures` consecutive failures open it for `breaker.open_ms`; once
//! that passes it is half-open — one request at a time is let through as a probe; a failed
//! probe opens it again for twice as long (up to `breaker.max_open_ms`), and
//! `breaker.successes` successful probes close it. A 429, 529, or 503 with `Retry-After` cools
//! the backend down for the time asked (or `cooldown_ms`): it is not called dead, its
//! consecutive-failure count is untouched, it is only left out of routing until then.
//! A 401 / 403, a 400 and friends are answers: the backend is up (they count as success).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crate::config::routing::{BreakerSettings, RoutingSettings};
use crate::config::{BackendId, Snapshot};
use crate::upstream::affinity::PinTable;
use crate::upstream::board::QueueBoard;

/// What one attempt tells of its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AttemptResult {
    /// The backend answered (whatever the status, short of the ones below).
    Answered,
    /// Connect error, timeout, reset, broken framing, a 5xx, a stream cut or an error event.
    Failed,
    /// A 429, 529 or a 503 with `Retry-After`: out for `ms` (capped by `max_cooldown_ms`);
    /// `None`: `cooldown_ms`. A 503 also counts as a failure.
    Cool { ms: Option<u64>, failed: bool },
    /// Nothing learned (the client left first, the gateway is stopping): a probe is released.
    Unknown,
}

/// Whether a backend may be sent a request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Availability {
    Available,
    /// Half-open and no probe is out: available to the one request that takes the probe.
    Probe,
    /// Open or cooling down until this [`mono_ms`](crate::sys::time::mono_ms) time.
    Out {
        until: u64,
    },
}

/// One backend's state. See the module doc.
#[derive(Debug, Default)]
pub(crate) struct BackendHealth {
    consecutive_failures: AtomicU32,
    /// Times the breaker opened since it last closed (the back-off's exponent).
    trips: AtomicU32,
    /// Open until this time; 0: closed. Past it (and non-zero): half-open.
    open_until: AtomicU64,
    /// Half-open: a probe is out.
    probe_out: AtomicBool,
    /// Half-open: successful probes so far.
    probe_successes: AtomicU32,
    /// Active probes: passed ones in a row while open, failed ones in a row while closed.
    probe_passes: AtomicU32,
    probe_failures: AtomicU32,
    /// Cooling down until this time (0: not).
    cool_until: AtomicU64,
    /// The retry budget's window: its start, and the requests and retries in it.
    window_start: AtomicU64,
    window_requests: AtomicU32,
    window_retries: AtomicU32,
    /// Live load, for the load-aware strategies.
    pub(crate) load: LoadSignals,
}

/// What the load-aware strategies read of a backend: requests this process has in flight to
/// it, moving averages of its latency and time to first token, and the queue its own metrics
/// endpoint reports (scraped; aged out when stale).
#[derive(Debug, Default)]
pub(crate) struct LoadSignals {
    in_flight: AtomicU32,
    /// Peak-EWMA of the latency (time to first token of a stream, else to the response head),
    /// µs (f64 bits); 0 bits: no sample yet.
    latency_us: AtomicU64,
    latency_at: AtomicU64,
    /// EWMA of streams' time to first token, µs (f64 bits), and its last sample's time.
    ttft_us: AtomicU64,
    ttft_at: AtomicU64,
    /// From the backend's metrics endpoint: requests waiting and running, KV-cache use
    /// (per mille), and when they were read ([`mono_ms`](crate::sys::time::mono_ms); 0: never).
    waiting: AtomicU32,
    running: AtomicU32,
    kv_permille: AtomicU32,
    scraped_at: AtomicU64,
}

/// The decay time of the peak-EWMA latency (Finagle's default).
const LATENCY_DECAY_MS: f64 = 10_000.0;
/// The weight of a new time-to-first-token sample.
const TTFT_ALPHA: f64 = 0.3;
/// How long a latency reading takes to fade by a factor e with no new sample.
const FADE_MS: f64 = 30_000.0;

fn fade(elapsed_ms: u64) -> f64 {
    (-(elapsed_ms as f64) / FADE_MS).exp()
}

impl LoadSignals {
    pub(crate) fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// Peak-EWMA latency in µs (`None`: no sample yet): a slower sample is taken at once, a
    /// faster one pulls the average down over [`LATENCY_DECAY_MS`].
    fn latency_sample(&self) -> Option<f64> {
        let bits = self.latency_us.load(Relaxed);
        (bits != 0).then(|| f64::from_bits(bits))
    }

    /// The latency as of `now`: it fades while no sample comes, so a backend that once looked
    /// slow is tried again after a while (a strategy that always takes the lowest would
    /// otherwise never send it the request that would show it recovered).
    pub(crate) fn latency_us(&self, now: u64) -> Option<f64> {
        let at = self.latency_at.load(Relaxed);
        self.latency_sample()
            .map(|v| v * fade(now.saturating_sub(at)))
    }

    /// The time-to-first-token EWMA as of `now`, fading like [`latency_us`](Self::latency_us).
    pub(crate) fn ttft_us(&self, now: u64) -> Option<f64> {
        let bits = self.ttft_us.load(Relaxed);
        let at = self.ttft_at.load(Relaxed);
        (bits != 0).then(|| f64::from_bits(bits) * fade(now.saturating_sub(at)))
    }

    /// The first useful byte (a stream's first token, else the response head) came `us` after
    /// the request went out.
    pub(crate) fn observe_latency(&self, us: f64, now: u64) {
        let us = us.max(1.0);
        let next = match self.latency_sample() {
            None => us,
            Some(old) if us > old => us,
            Some(old) => {
                let elapsed = now.saturating_sub(self.latency_at.load(Relaxed)) as f64;
                let w = (-elapsed / LATENCY_DECAY_MS).exp();
                old * w + us * (1.0 - w)
            }
        };
        self.latency_us.store(next.to_bits(), Relaxed);
        self.latency_at.store(now, Relaxed);
    }

    pub(crate) fn observe_ttft(&self, us: f64, now: u64) {
        let us = us.max(1.0);
        let bits = self.ttft_us.load(Relaxed);
        let next = if bits == 0 {
            us
        } else {
            f64::from_bits(bits) * (1.0 - TTFT_ALPHA) + us * TTFT_ALPHA
        };
        self.ttft_us.store(next.to_bits(), Relaxed);
        self.ttft_at.store(now, Relaxed);
    }

    /// What the backend's metrics endpoint said just now.
    pub(crate) fn scraped(&self, waiting: u32, running: u32, kv_usage: f64, now: u64) {
        self.waiting.store(waiting, Relaxed);
        self.running.store(running, Relaxed);
        self.kv_permille
            .store((kv_usage.clamp(0.0, 1.0) * 1000.0) as u32, Relaxed);
        self.scraped_at.store(now, Relaxed);
    }

    /// `(waiting, running, kv_usage)` when scraped within `stale_ms`.
    pub(crate) fn queue(&self, now: u64, stale_ms: u64) -> Option<(u32, u32, f64)> {
        let at = self.scraped_at.load(Relaxed);
        (at != 0 && now.saturating_sub(at) <= stale_ms).then(|| {
            (
                self.waiting.load(Relaxed),
                self.running.load(Relaxed),
                f64::from(self.kv_permille.load(Relaxed)) / 1000.0,
            )
        })
    }

    /// How full the backend is, 0 to 1: its fresh KV-cache use, 1 when it queues requests,
    /// and this process's requests in flight over `max_in_flight` (when configured).
    pub(crate) fn load(&self, now: u64, stale_ms: u64, max_in_flight: Option<u32>) -> f64 {
        let mut load = 0.0_f64;
        if let Some(cap) = max_in_flight.filter(|c| *c > 0) {
            load = f64::from(self.in_flight()) / f64::from(cap);
        }
        if let Some((waiting, _, kv)) = self.queue(now, stale_ms) {
            load = load.max(kv);
            if waiting > 0 {
                load = 1.0;
            }
        }
        load.min(1.0)
    }

    /// Requests ahead of a new one: the fresh queue and running counts, else this process's
    /// own in flight.
    pub(crate) fn queue_depth(&self, now: u64, stale_ms: u64) -> u64 {
        match self.queue(now, stale_ms) {
            Some((waiting, running, _)) => {
                u64::from(waiting) * 4 + u64::from(running).max(u64::from(self.in_flight()))
            }
            None => u64::from(self.in_flight()),
        }
    }
}

/// One attempt claimed by [`BackendHealth::begin`]: counted in the backend's in-flight number
/// until dropped, and recorded once ([`AttemptGuard::record`]). It knows whether it holds the
/// half-open probe, so only the probe's answer moves the breaker; dropped unrecorded (the
/// request went away), a probe is released.
#[derive(Debug)]
pub(crate) struct AttemptGuard<'h> {
    health: &'h BackendHealth,
    probe: bool,
    recorded: bool,
}

impl AttemptGuard<'_> {
    /// What the attempt turned out to be (the first call counts; later ones are ignored).
    pub(crate) fn record(&mut self, result: AttemptResult, now: u64, settings: &RoutingSettings) {
        if !self.recorded {
            self.recorded = true;
            self.health
                .record_attempt(result, now, settings, self.probe);
        }
    }

    pub(crate) fn recorded(&self) -> bool {
        self.recorded
    }
}

impl Drop for AttemptGuard<'_> {
    fn drop(&mut self) {
        self.health.load.in_flight.fetch_sub(1, Relaxed);
        if self.probe && !self.recorded {
            self.health.probe_out.store(false, Relaxed);
        }
    }
}

impl BackendHealth {
    pub(crate) fn availability(&self, now: u64) -> Availability {
        let cool = self.cool_until.load(Relaxed);
        let open = self.open_until.load(Relaxed);
        if open > now || cool > now {
            return Availability::Out {
                until: open.max(cool),
            };
        }
        if open != 0 {
            return if self.probe_out.load(Relaxed) {
                // Another request is probing: out for now (its answer decides).
                Availability::Out { until: now + 1 }
            } else {
                Availability::Probe
            };
        }
        Availability::Available
    }

    /// Claim the attempt about to be sent: the probe, when half-open (`None`: another request
    /// took it first, try elsewhere), and a place under `cap` requests in flight from the whole
    /// process (`None`: it is full). Counts the request in the retry budget's window, and in
    /// flight while the guard lives.
    pub(crate) fn begin(
        &self,
        now: u64,
        settings: &RoutingSettings,
        cap: Option<u32>,
    ) -> Option<AttemptGuard<'_>> {
        let probe = match self.availability(now) {
            Availability::Available => false,
            Availability::Probe => {
                if self.probe_out.swap(true, Relaxed) {
                    return None;
                }
                true
            }
            Availability::Out { .. } => return None,
        };
        let counted = match cap {
            None => {
                self.load.in_flight.fetch_add(1, Relaxed);
                true
            }
            Some(cap) => self
                .load
                .in_flight
                .fetch_update(Relaxed, Relaxed, |n| (n < cap).then_some(n + 1))
                .is_ok(),
        };
        if !counted {
            if probe {
                self.probe_out.store(false, Relaxed);
            }
            return None;
        }
        self.roll_window(now, settings);
        self.window_requests.fetch_add(1, Relaxed);
        Some(AttemptGuard {
            health: self,
            probe,
            recorded: false,
        })
    }

    /// What an attempt that was not the probe turned out to be (tests, and attempts made
    /// without a guard).
    #[cfg(test)]
    pub(crate) fn record(&self, result: AttemptResult, now: u64, settings: &RoutingSettings) {
        self.record_attempt(result, now, settings, false);
    }

    /// Only the probe's answer moves a half-open breaker: an attempt that started before the
    /// breaker opened and ends now is counted, but neither closes nor re-opens it.
    fn record_attempt(
        &self,
        result: AttemptResult,
        now: u64,
        settings: &RoutingSettings,
        probe: bool,
    ) {
        match result {
            AttemptResult::Answered => {
                self.consecutive_failures.store(0, Relaxed);
                if probe {
                    let successes = self.probe_successes.fetch_add(1, Relaxed) + 1;
                    if successes >= settings.breaker.successes {
                        self.close();
                    }
                    self.probe_out.store(false, Relaxed);
                }
            }
            AttemptResult::Failed => self.failed(now, &settings.breaker, probe),
            AttemptResult::Cool { ms, failed } => {
                let ms = ms
                    .unwrap_or(settings.cooldown_ms)
                    .min(settings.max_cooldown_ms);
                self.cool_until.fetch_max(now + ms, Relaxed);
                if failed {
                    self.failed(now, &settings.breaker, probe);
                } else if probe {
                    // Alive but busy: the probe ends without a verdict.
                    self.probe_out.store(false, Relaxed);
                }
            }
            AttemptResult::Unknown => {
                if probe {
                    self.probe_out.store(false, Relaxed);
                }
            }
        }
    }

    fn failed(&self, now: u64, breaker: &BreakerSettings, probe: bool) {
        let failures = self.consecutive_failures.fetch_add(1, Relaxed) + 1;
        let closed = self.open_until.load(Relaxed) == 0;
        if probe || (closed && failures >= breaker.failures) {
            self.trip(now, breaker);
        }
    }

    /// Open the breaker, for longer each time it opens again before it closes.
    fn trip(&self, now: u64, breaker: &BreakerSettings) {
        let trips = self.trips.fetch_add(1, Relaxed).min(20);
        let open_ms = breaker
            .open_ms
            .saturating_mul(1u64 << trips)
            .min(breaker.max_open_ms);
        self.open_until.store(now + open_ms, Relaxed);
        self.probe_successes.store(0, Relaxed);
        self.probe_out.store(false, Relaxed);
    }

    /// The breaker is open or half-open (not closed).
    pub(crate) fn breaker_open(&self) -> bool {
        self.open_until.load(Relaxed) != 0
    }

    /// When the breaker's open time ends ([`mono_ms`](crate::sys::time::mono_ms)); 0: closed.
    pub(crate) fn open_until(&self) -> u64 {
        self.open_until.load(Relaxed)
    }

    /// Another node found the backend failing: open the breaker until `until` unless it is
    /// open already (its own state, and back-off, then stand). Passing the open time leads to
    /// half-open here as after a local trip. Returns whether it was opened.
    pub(crate) fn open_from_fleet(&self, until: u64) -> bool {
        let opened = self
            .open_until
            .compare_exchange(0, until.max(1), Relaxed, Relaxed)
            .is_ok();
        if opened {
            self.probe_successes.store(0, Relaxed);
            self.probe_out.store(false, Relaxed);
        }
        opened
    }

    /// The fleet no longer holds the backend open: when the breaker is still open only by the
    /// fleet's word (its open time is still `adopted`, the one [`Self::open_from_fleet`] set),
    /// its open time ends now — half-open, so a request decides.
    pub(crate) fn end_fleet_open(&self, adopted: u64, now: u64) {
        let _ = self
            .open_until
            .compare_exchange(adopted, now.clamp(1, adopted), Relaxed, Relaxed);
    }

    /// An active probe's verdict (`ok`), at `now`. While the breaker is open, `breaker.successes`
    /// passed probes in a row end its open time early: it goes half-open, and a real request —
    /// the probe of what clients see — closes it, or opens it again with a longer back-off (a
    /// passed health check, or a TCP connect, says the backend is up, not that it answers
    /// requests, so it never closes the breaker or forgets the back-off itself). A failed probe
    /// starts that count over and keeps the breaker open for `hold_ms` more at least, so no
    /// client request is sent to find out what the probe already knows. While the breaker is
    /// closed, `breaker.failures` failed probes in a row (their own count, apart from the
    /// requests') open it; a passed one starts that count over.
    pub(crate) fn probed(&self, ok: bool, now: u64, settings: &RoutingSettings, hold_ms: u64) {
        match (ok, self.breaker_open()) {
            (true, true) => {
                let passed = self.probe_passes.fetch_add(1, Relaxed) + 1;
                if passed >= settings.breaker.successes {
                    self.probe_passes.store(0, Relaxed);
                    // Half-open from now (a breaker already half-open stays so).
                    self.open_until.fetch_min(now.max(1), Relaxed);
                }
            }
            (true, false) => self.probe_failures.store(0, Relaxed),
            (false, true) => {
                self.probe_passes.store(0, Relaxed);
                self.open_until.fetch_max(now + hold_ms, Relaxed);
            }
            (false, false) => {
                let failures = self.probe_failures.fetch_add(1, Relaxed) + 1;
                if failures >= settings.breaker.failures {
                    self.probe_failures.store(0, Relaxed);
                    self.trip(now, &settings.breaker);
                }
            }
        }
    }

    fn close(&self) {
        self.open_until.store(0, Relaxed);
        self.trips.store(0, Relaxed);
        self.probe_successes.store(0, Relaxed);
        self.consecutive_failures.store(0, Relaxed);
    }

    /// May a failure of this backend be retried elsewhere? Charges the retry when it may: at
    /// most `retry_budget_ratio` of the window's requests, or `retry_budget_min`.
    pub(crate) fn allow_retry(&self, now: u64, settings: &RoutingSettings) -> bool {
        self.roll_window(now, settings);
        let requests = f64::from(self.window_requests.load(Relaxed));
        let allowed =
            ((requests * settings.retry_budget_ratio) as u32).max(settings.retry_budget_min);
        let used = self.window_retries.fetch_add(1, Relaxed);
        if used < allowed {
            return true;
        }
        self.window_retries.fetch_sub(1, Relaxed);
        false
    }

    fn roll_window(&self, now: u64, settings: &RoutingSettings) {
        let start = self.window_start.load(Relaxed);
        if now.saturating_sub(start) >= settings.retry_budget_window_ms
            && self
                .window_start
                .compare_exchange(start, now, Relaxed, Relaxed)
                .is_ok()
        {
            self.window_requests.store(0, Relaxed);
            self.window_retries.store(0, Relaxed);
        }
    }

    /// 0 closed, 1 open, 2 half-open, 3 cooling down.
    #[cfg(test)]
    fn state_code(&self, now: u64) -> u8 {
        let open = self.open_until.load(Relaxed);
        if open > now {
            1
        } else if open != 0 {
            2
        } else if self.cool_until.load(Relaxed) > now {
            3
        } else {
            0
        }
    }
}

/// Every backend's health for one snapshot, indexed by [`BackendId`]; shared by the workers.
/// Also the node's session pins, which name backends by identity and so outlive the snapshot.
#[derive(Debug, Default)]
pub(crate) struct HealthTable {
    backends: Vec<Arc<BackendHealth>>,
    /// Each backend's identity across snapshots: cluster name and URL, and its hash.
    keys: Vec<String>,
    identities: Vec<u64>,
    /// Session pins, allocated once a snapshot has a sticky route.
    pins: Option<Arc<PinTable>>,
    /// Per cluster, per credential of its pool: benched until this
    /// [`mono_ms`](crate::sys::time::mono_ms) time (0: not).
    credentials: Vec<Vec<Arc<AtomicU64>>>,
    credential_keys: Vec<Vec<String>>,
    /// The wait queue's node-wide board (with `[saturation]`).
    board: Option<QueueBoard>,
}

impl HealthTable {
    /// The table for `snapshot`, keeping `previous`'s state for every backend both have.
    pub(crate) fn build(snapshot: &Snapshot, previous: Option<&HealthTable>) -> HealthTable {
        let kept: HashMap<&str, &Arc<BackendHealth>> = previous
            .map(|p| {
                p.keys
                    .iter()
                    .map(String::as_str)
                    .zip(p.backends.iter())
                    .collect()
            })
            .unwrap_or_default();
        let sticky = snapshot.routes.iter().any(|r| r.sticky.is_some());
        let pins = previous
            .and_then(|p| p.pins.clone())
            .or_else(|| sticky.then(|| Arc::new(PinTable::default())));
        let mut table = HealthTable {
            backends: Vec::with_capacity(snapshot.backend_count),
            keys: Vec::with_capacity(snapshot.backend_count),
            identities: Vec::with_capacity(snapshot.backend_count),
            pins,
            credentials: Vec::with_capacity(snapshot.clusters.len()),
            credential_keys: Vec::with_capacity(snapshot.clusters.len()),
            board: snapshot.saturation.as_ref().map(|s| {
                QueueBoard::new(
                    snapshot
                        .routes
                        .iter()
                        .map(|r| r.pattern.source().to_string())
                        .collect(),
                    snapshot.server.workers,
                    snapshot.limits.keys.len(),
                    s.classes.len(),
                    previous.and_then(|p| p.board.as_ref()),
                )
            }),
        };
        let kept_credentials: HashMap<&str, &Arc<AtomicU64>> = previous
            .map(|p| {
                p.credential_keys
                    .iter()
                    .flatten()
                    .map(String::as_str)
                    .zip(p.credentials.iter().flatten())
                    .collect()
            })
            .unwrap_or_default();
        for cluster in &snapshot.clusters {
            let keys: Vec<String> = cluster
                .credentials
                .iter()
                .map(|c| format!("{}|{}", cluster.name, c.label))
                .collect();
            let states = keys
                .iter()
                .map(|k| {
                    kept_credentials
                        .get(k.as_str())
                        .map(|s| Arc::clone(s))
                        .unwrap_or_default()
                })
                .collect();
            table.credentials.push(states);
            table.credential_keys.push(keys);
        }
        for cluster in &snapshot.clusters {
            for backend in &cluster.backends {
                let key = format!(
                    "{}|{}://{}{}",
                    cluster.name,
                    if backend.tls { "https" } else { "http" },
                    backend.host_header,
                    backend.base_path
                );
                let health = kept
                    .get(key.as_str())
                    .map(|h| Arc::clone(h))
                    .unwrap_or_default();
                debug_assert_eq!(table.backends.len(), backend.id);
                table.backends.push(health);
                table.identities.push(identity_hash(&key));
                table.keys.push(key);
            }
        }
        table
    }

    pub(crate) fn get(&self, id: BackendId) -> Option<&BackendHealth> {
        self.backends.get(id).map(|h| &**h)
    }

    /// The backend's identity hash (stable across snapshots), for session pins and cookies.
    pub(crate) fn identity(&self, id: BackendId) -> u64 {
        self.identities.get(id).copied().unwrap_or(0)
    }

    /// Whether the cluster's credential `index` is benched at `now`.
    pub(crate) fn credential_benched(&self, cluster: usize, index: usize, now: u64) -> bool {
        self.credential_state(cluster, index)
            .is_some_and(|s| s.load(Relaxed) > now)
    }

    /// Bench the cluster's credential `index` until `until`: the provider refused it (401 /
    /// 403), so requests take the pool's other credentials.
    pub(crate) fn bench_credential(&self, cluster: usize, index: usize, until: u64) {
        if let Some(s) = self.credential_state(cluster, index) {
            s.fetch_max(until, Relaxed);
        }
    }

    fn credential_state(&self, cluster: usize, index: usize) -> Option<&AtomicU64> {
        self.credentials.get(cluster)?.get(index).map(|s| &**s)
    }

    /// The node's session pins (`None` until a snapshot has a sticky route).
    pub(crate) fn pins(&self) -> Option<&PinTable> {
        self.pins.as_deref()
    }

    /// The wait queue's node-wide board (`None` without `[saturation]`).
    pub(crate) fn board(&self) -> Option<&QueueBoard> {
        self.board.as_ref()
    }

    /// The backend's health, to keep beyond the table (the queue scraper's).
    pub(crate) fn shared(&self, id: BackendId) -> Option<Arc<BackendHealth>> {
        self.backends.get(id).map(Arc::clone)
    }
}

/// A 64-bit hash the same in every process and build (FNV-1a): identities travel in cookies
/// and pins.
pub(crate) fn identity_hash(s: &str) -> u64 {
    fnv1a_extend(0xcbf2_9ce4_8422_2325, s.as_bytes())
}

/// FNV-1a of `bytes`, continuing from the hash `h`.
pub(crate) fn fnv1a_extend(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> RoutingSettings {
        RoutingSettings {
            breaker: BreakerSettings {
                failures: 3,
                open_ms: 1_000,
                max_open_ms: 3_000,
                successes: 2,
            },
            retry_budget_ratio: 0.25,
            retry_budget_min: 1,
            retry_budget_window_ms: 10_000,
            ..RoutingSettings::default()
        }
    }

    #[test]
    fn breaker_opens_probes_one_at_a_time_backs_off_and_closes() {
        let s = settings();
        let h = BackendHealth::default();
        let t = 100;
        // Two failures, then an answer: the count starts over.
        for _ in 0..2 {
            h.begin(t, &s, None)
                .unwrap()
                .record(AttemptResult::Failed, t, &s);
        }
        h.record(AttemptResult::Answered, t, &s);
        for _ in 0..2 {
            h.record(AttemptResult::Failed, t, &s);
        }
        assert_eq!(h.availability(t), Availability::Available);
        h.record(AttemptResult::Failed, t, &s);
        assert_eq!(h.availability(t), Availability::Out { until: t + 1_000 });
        assert!(h.begin(t + 999, &s, None).is_none());

        // Half-open: one probe; the next request is kept out while it runs.
        assert_eq!(h.availability(t + 1_000), Availability::Probe);
        let mut probe = h.begin(t + 1_000, &s, None).unwrap();
        assert!(matches!(
            h.availability(t + 1_000),
            Availability::Out { .. }
        ));
        assert!(h.begin(t + 1_000, &s, None).is_none());
        // An attempt that started before the breaker opened ends now: counted, but it neither
        // closes nor re-opens the breaker, nor frees the probe.
        h.record(AttemptResult::Answered, t + 1_000, &s);
        h.record(AttemptResult::Failed, t + 1_000, &s);
        assert!(h.begin(t + 1_000, &s, None).is_none());
        assert_eq!(h.state_code(t + 1_000), 2);
        // The probe fails: open twice as long.
        probe.record(AttemptResult::Failed, t + 1_000, &s);
        drop(probe);
        assert_eq!(
            h.availability(t + 1_001),
            Availability::Out { until: t + 3_000 }
        );
        // Then capped at max_open_ms.
        h.begin(t + 3_000, &s, None)
            .unwrap()
            .record(AttemptResult::Failed, t + 3_000, &s);
        assert_eq!(
            h.availability(t + 3_000),
            Availability::Out { until: t + 6_000 }
        );

        // A probe whose request went away (dropped unrecorded) frees the probe.
        drop(h.begin(t + 6_000, &s, None).unwrap());
        // Two successful probes close it.
        h.begin(t + 6_000, &s, None)
            .unwrap()
            .record(AttemptResult::Answered, t + 6_000, &s);
        assert_eq!(h.state_code(t + 6_000), 2, "one success: still half-open");
        h.begin(t + 6_000, &s, None)
            .unwrap()
            .record(AttemptResult::Answered, t + 6_000, &s);
        assert_eq!(h.availability(t + 6_000), Availability::Available);
        assert_eq!(h.state_code(t + 6_000), 0);
        // Closed again: the back-off starts over at open_ms.
        for _ in 0..3 {
            h.record(AttemptResult::Failed, t + 7_000, &s);
        }
        assert_eq!(
            h.availability(t + 7_000),
            Availability::Out { until: t + 8_000 }
        );
    }

    #[test]
    fn active_probes_open_hold_and_shorten_the_breaker_but_never_close_it() {
        let s = settings();
        let h = BackendHealth::default();
        // Closed: failed probes in a row open it; a passed one starts the count over.
        for _ in 0..s.breaker.failures - 1 {
            h.probed(false, 0, &s, 100);
        }
        h.probed(true, 0, &s, 100);
        for _ in 0..s.breaker.failures - 1 {
            h.probed(false, 0, &s, 100);
        }
        assert_eq!(
            h.state_code(0),
            0,
            "failures apart from each other do not open it"
        );
        h.probed(false, 0, &s, 100);
        assert_eq!(h.state_code(0), 1, "enough failed probes in a row open it");
        // Open and still failing: held open past its open time, so no request probes it.
        let open_until = h.open_until.load(Relaxed);
        h.probed(false, open_until - 1, &s, 1_000);
        assert_eq!(h.state_code(open_until + 500), 1);
        // Passed probes end the open time early (half-open), a failure between them starting
        // the count over; they never close it themselves.
        for _ in 0..s.breaker.successes - 1 {
            h.probed(true, 10, &s, 100);
        }
        h.probed(false, 10, &s, 100);
        for _ in 0..s.breaker.successes - 1 {
            h.probed(true, 10, &s, 100);
            assert_eq!(h.state_code(10), 1);
        }
        h.probed(true, 10, &s, 100);
        assert_eq!(h.state_code(10), 2, "half-open: a request decides");
        assert_eq!(h.availability(10), Availability::Probe);
        // The request that probes fails: open again, for twice as long (the back-off stands).
        let mut probe = h.begin(10, &s, None).unwrap();
        probe.record(AttemptResult::Failed, 10, &s);
        drop(probe);
        assert_eq!(h.open_until.load(Relaxed), 10 + 2 * s.breaker.open_ms);
        // Passed probes again, then requests that answer: closed.
        for _ in 0..s.breaker.successes {
            h.probed(true, 20, &s, 100);
        }
        for _ in 0..s.breaker.successes {
            let mut probe = h.begin(20, &s, None).unwrap();
            probe.record(AttemptResult::Answered, 20, &s);
        }
        assert_eq!(h.state_code(20), 0);
    }

    #[test]
    fn a_cool_down_takes_the_backend_out_without_calling_it_dead() {
        let s = settings();
        let h = BackendHealth::default();
        h.record(
            AttemptResult::Cool {
                ms: Some(2_000),
                failed: false,
            },
            10,
            &s,
        );
        assert_eq!(h.availability(10), Availability::Out { until: 2_010 });
        assert_eq!(h.state_code(10), 3);
        assert_eq!(h.availability(2_010), Availability::Available);
        assert_eq!(h.consecutive_failures.load(Relaxed), 0);
        // No Retry-After: cooldown_ms; an absurd one: capped.
        h.record(
            AttemptResult::Cool {
                ms: None,
                failed: false,
            },
            3_000,
            &s,
        );
        assert_eq!(
            h.availability(3_000),
            Availability::Out {
                until: 3_000 + s.cooldown_ms
            }
        );
        h.record(
            AttemptResult::Cool {
                ms: Some(u64::MAX / 4),
                failed: false,
            },
            3_000,
            &s,
        );
        assert_eq!(
            h.availability(3_000),
            Availability::Out {
                until: 3_000 + s.max_cooldown_ms
            }
        );
    }

    #[test]
    fn load_signals_average_age_out_and_count_in_flight() {
        let h = BackendHealth::default();
        let s = settings();
        let l = &h.load;
        assert_eq!((l.latency_us(0), l.ttft_us(0)), (None, None));
        l.observe_latency(1_000.0, 0);
        // A slower sample is taken at once; a faster one pulls it down with time.
        l.observe_latency(5_000.0, 0);
        assert_eq!(l.latency_us(0), Some(5_000.0));
        l.observe_latency(1_000.0, 10_000);
        let after = l.latency_us(10_000).unwrap();
        assert!((2_400.0..2_500.0).contains(&after), "{after}");
        // With no new sample it fades (by e in 30 s), so a slow-looking backend is tried again.
        let faded = l.latency_us(40_000).unwrap();
        assert!((after / 2.8..after / 2.6).contains(&faded), "{faded}");
        l.observe_ttft(100.0, 0);
        l.observe_ttft(200.0, 0);
        assert_eq!(l.ttft_us(0), Some(130.0));

        // In flight while the guards live; load over max_in_flight.
        let a = h.begin(1, &s, None).unwrap();
        let b = h.begin(1, &s, None).unwrap();
        assert_eq!(l.in_flight(), 2);
        assert_eq!(l.load(1, 5_000, Some(4)), 0.5);
        drop((a, b));
        assert_eq!(l.in_flight(), 0);

        // A cap: the third claim under a cap of 2 is refused, and counts nothing; a freed
        // place is taken again.
        let a = h.begin(1, &s, Some(2)).unwrap();
        let b = h.begin(1, &s, Some(2)).unwrap();
        assert!(h.begin(1, &s, Some(2)).is_none());
        assert_eq!(l.in_flight(), 2);
        drop(a);
        let c = h.begin(1, &s, Some(2)).unwrap();
        assert_eq!(l.in_flight(), 2);
        drop((b, c));

        // A fresh scrape: its KV use, and 1 once it queues; stale after stale_ms.
        l.scraped(0, 3, 0.4, 100);
        assert_eq!(l.load(100, 5_000, None), 0.4);
        assert_eq!(l.queue_depth(100, 5_000), 3);
        l.scraped(7, 3, 0.4, 200);
        assert_eq!(l.load(200, 5_000, None), 1.0);
        assert_eq!(l.queue_depth(200, 5_000), 31);
        assert_eq!(l.load(5_201, 5_000, None), 0.0);
        assert_eq!(l.queue_depth(5_201, 5_000), 0);
    }

    #[test]
    fn retries_stay_within_the_budget() {
        let s = settings();
        let h = BackendHealth::default();
        for _ in 0..20 {
            assert!(h.begin(5, &s, None).is_some());
        }
        // 25% of 20 requests.
        let allowed = (0..20).filter(|_| h.allow_retry(5, &s)).count();
        assert_eq!(allowed, 5);
        // A new window starts over (with retry_budget_min as the floor).
        assert!(h.allow_retry(10_005, &s));
        assert!(!h.allow_retry(10_005, &s));
    }
}
