//! `[routing]`: how a request moves on when a backend fails — how many attempts, the retry
//! budget that keeps an outage from turning into a retry storm, the circuit breaker and the
//! cool-down after a 429 / 529. Read here, validated once; used by the route phase (which
//! backends are available) and the pipeline (whether to try the next one).

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawRouting {
    max_attempts: u32,
    retry_budget_ratio: f64,
    retry_budget_min: u32,
    retry_budget_window_ms: u64,
    breaker_failures: u32,
    breaker_open_ms: u64,
    breaker_max_open_ms: u64,
    breaker_successes: u32,
    cooldown_ms: u64,
    max_cooldown_ms: u64,
    scrape_interval_ms: u64,
    queue_stale_ms: u64,
    credential_bench_ms: u64,
    share_breakers: bool,
}

impl Default for RawRouting {
    fn default() -> Self {
        RawRouting {
            max_attempts: 3,
            retry_budget_ratio: 0.2,
            retry_budget_min: 10,
            retry_budget_window_ms: 10_000,
            breaker_failures: 5,
            breaker_open_ms: 5_000,
            breaker_max_open_ms: 60_000,
            breaker_successes: 2,
            cooldown_ms: 5_000,
            max_cooldown_ms: 300_000,
            scrape_interval_ms: 1_000,
            queue_stale_ms: 5_000,
            credential_bench_ms: 60_000,
            share_breakers: false,
        }
    }
}

/// The validated `[routing]` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RoutingSettings {
    /// Attempts one request may make, the first included (1: no fallback).
    pub(crate) max_attempts: u32,
    /// Retries a backend's failures may cause, per window: at most this share of the requests
    /// it was sent in the window, or `retry_budget_min`, whichever is larger.
    pub(crate) retry_budget_ratio: f64,
    pub(crate) retry_budget_min: u32,
    pub(crate) retry_budget_window_ms: u64,
    pub(crate) breaker: BreakerSettings,
    /// How long a 429 / 529 (or a 503 with `Retry-After`) takes a backend out when the answer
    /// has no `Retry-After`.
    pub(crate) cooldown_ms: u64,
    /// The longest cool-down a `Retry-After` may ask for.
    pub(crate) max_cooldown_ms: u64,
    /// How often backends with `queue_metrics` are scraped, and how old a scrape may be before
    /// it is ignored.
    pub(crate) scrape_interval_ms: u64,
    pub(crate) queue_stale_ms: u64,
    /// How long a credential of a key pool that drew a 401 / 403 is left out.
    pub(crate) credential_bench_ms: u64,
    /// Open breakers are shared with the other nodes through the limits Redis.
    pub(crate) share_breakers: bool,
}

/// How a target group picks among its available backends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub(crate) enum Strategy {
    /// By weight, at random.
    #[default]
    Weighted,
    /// Of two picked by weight, the one with fewer requests in flight from this process.
    LeastInFlight,
    /// Of two picked by weight, the lower peak-EWMA latency (time to first token of a stream,
    /// else to the response head) × (in flight + 1).
    PeakEwma,
    /// The lowest time-to-first-token EWMA (untried backends first).
    LowestTtft,
    /// The cheapest target by the price table, unless it is loaded ≥ 90%.
    CostFirst,
    /// The lowest effective latency: EWMA latency / (1 − load).
    LatencyFirst,
    /// The largest context window.
    QualityFirst,
    /// Of two picked by weight, the shorter queue (the backend's scraped metrics, else this
    /// process's requests in flight).
    QueueAware,
}

/// When a backend's circuit breaker opens and closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BreakerSettings {
    /// Consecutive failures that open it.
    pub(crate) failures: u32,
    /// How long it stays open the first time; doubled each time the probe fails, up to
    /// `max_open_ms`.
    pub(crate) open_ms: u64,
    pub(crate) max_open_ms: u64,
    /// Successful probes (one at a time, half-open) that close it.
    pub(crate) successes: u32,
}

impl Default for RoutingSettings {
    fn default() -> Self {
        let mut errors = Vec::new();
        resolve_routing(&RawRouting::default(), &mut |p, m| errors.push((p, m)))
    }
}

pub(super) fn resolve_routing(
    raw: &RawRouting,
    err: &mut dyn FnMut(String, String),
) -> RoutingSettings {
    if raw.max_attempts == 0 || raw.max_attempts > 10 {
        err(
            "routing.max_attempts".into(),
            "must be from 1 (no fallback) to 10".into(),
        );
    }
    if !(0.0..=1.0).contains(&raw.retry_budget_ratio) {
        err(
            "routing.retry_budget_ratio".into(),
            "must be from 0 to 1 (a share of the requests)".into(),
        );
    }
    for (key, v) in [
        ("routing.retry_budget_window_ms", raw.retry_budget_window_ms),
        ("routing.breaker_open_ms", raw.breaker_open_ms),
        ("routing.cooldown_ms", raw.cooldown_ms),
        ("routing.scrape_interval_ms", raw.scrape_interval_ms),
        ("routing.queue_stale_ms", raw.queue_stale_ms),
        ("routing.credential_bench_ms", raw.credential_bench_ms),
    ] {
        if v == 0 {
            err(key.into(), "must be at least 1 ms".into());
        }
    }
    if raw.breaker_max_open_ms < raw.breaker_open_ms {
        err(
            "routing.breaker_max_open_ms".into(),
            "must be at least routing.breaker_open_ms".into(),
        );
    }
    if raw.max_cooldown_ms < raw.cooldown_ms {
        err(
            "routing.max_cooldown_ms".into(),
            "must be at least routing.cooldown_ms".into(),
        );
    }
    for (key, v) in [
        ("routing.breaker_failures", raw.breaker_failures),
        ("routing.breaker_successes", raw.breaker_successes),
    ] {
        if v == 0 {
            err(key.into(), "must be at least 1".into());
        }
    }
    RoutingSettings {
        max_attempts: raw.max_attempts.clamp(1, 10),
        retry_budget_ratio: raw.retry_budget_ratio.clamp(0.0, 1.0),
        retry_budget_min: raw.retry_budget_min,
        retry_budget_window_ms: raw.retry_budget_window_ms.max(1),
        breaker: BreakerSettings {
            failures: raw.breaker_failures.max(1),
            open_ms: raw.breaker_open_ms.max(1),
            max_open_ms: raw.breaker_max_open_ms.max(raw.breaker_open_ms).max(1),
            successes: raw.breaker_successes.max(1),
        },
        cooldown_ms: raw.cooldown_ms.max(1),
        max_cooldown_ms: raw.max_cooldown_ms.max(raw.cooldown_ms).max(1),
        scrape_interval_ms: raw.scrape_interval_ms.max(1),
        queue_stale_ms: raw.queue_stale_ms.max(1),
        credential_bench_ms: raw.credential_bench_ms.max(1),
        share_breakers: raw.share_breakers,
    }
}

/// The failures that move a request on to a target group (its `when`): a set of the access
/// log's `fallback_reason` labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FallbackOn(u16);

impl FallbackOn {
    /// Every label a `when` may name, in the order of their bits.
    pub(crate) const LABELS: [&'static str; 10] = [
        "connect",
        "timeout",
        "io",
        "status_429",
        "status_5xx",
        "status_529",
        "first_event_error",
        "pool_full",
        "credential",
        "provider_limit",
    ];

    /// The set of `labels`; an unknown or repeated one is an error at `path`.
    pub(super) fn parse(
        labels: &[String],
        path: &str,
        err: &mut dyn FnMut(String, String),
    ) -> FallbackOn {
        if labels.is_empty() {
            err(
                path.to_string(),
                "names at least one failure (leave `when` out to take any)".into(),
            );
        }
        let mut set = 0u16;
        for (i, label) in labels.iter().enumerate() {
            match Self::LABELS.iter().position(|l| l == label) {
                Some(bit) if set & (1 << bit) != 0 => {
                    err(format!("{path}[{i}]"), format!("`{label}` is listed twice"))
                }
                Some(bit) => set |= 1 << bit,
                None => err(
                    format!("{path}[{i}]"),
                    format!(
                        "`{label}` is not a failure Sluice moves on for; one of {}",
                        Self::LABELS.join(", ")
                    ),
                ),
            }
        }
        FallbackOn(set)
    }

    /// Whether the failure labelled `label` (one of [`Self::LABELS`]) is in the set.
    pub(crate) fn contains(self, label: &str) -> bool {
        Self::LABELS
            .iter()
            .position(|l| *l == label)
            .is_some_and(|bit| self.0 & (1 << bit) != 0)
    }
}

/// `[clusters.x] probe`: an active health check of each of the cluster's backends.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawProbe {
    #[serde(rename = "type", default = "default_probe_type")]
    kind: String,
    /// `type = "http"`: the path asked for (absolute on the backend's host).
    path: Option<String>,
    /// `type = "http"`: the status a healthy backend answers.
    expect_status: Option<u16>,
    #[serde(default = "default_probe_interval")]
    interval_ms: u64,
    #[serde(default = "default_probe_timeout")]
    timeout_ms: u64,
    /// `"open"`: only while the backend's breaker is open; `"always"`: all the time.
    #[serde(default = "default_probe_when")]
    when: String,
}

fn default_probe_type() -> String {
    "http".into()
}
fn default_probe_interval() -> u64 {
    2_000
}
fn default_probe_timeout() -> u64 {
    1_000
}
fn default_probe_when() -> String {
    "open".into()
}

/// A validated `probe`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Probe {
    pub(crate) check: ProbeCheck,
    pub(crate) interval: std::time::Duration,
    pub(crate) timeout: std::time::Duration,
    /// Probe a backend whose breaker is closed too (its failures then count against it).
    pub(crate) always: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ProbeCheck {
    /// `GET path` over plain HTTP/1.0 must answer `expect_status`.
    Http { path: String, expect_status: u16 },
    /// A TCP connection must open.
    Tcp,
}

/// `probe` of the cluster at `path`; `any_tls`: some of its backends are `https`, which an HTTP
/// probe (plain HTTP only) can't check.
pub(super) fn resolve_probe(
    raw: &RawProbe,
    any_tls: bool,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Probe {
    let check = match raw.kind.as_str() {
        "http" => {
            let probe_path = raw.path.clone().unwrap_or_else(|| "/health".into());
            if !probe_path.starts_with('/') || probe_path.bytes().any(|b| b <= b' ' || b == 0x7f) {
                err(
                    format!("{path}.path"),
                    format!("`{probe_path}` is not an absolute path like /health"),
                );
            }
            let expect_status = raw.expect_status.unwrap_or(200);
            if !(100..=599).contains(&expect_status) {
                err(
                    format!("{path}.expect_status"),
                    "must be an HTTP status (100 to 599)".into(),
                );
            }
            if any_tls {
                err(
                    format!("{path}.type"),
                    "an http probe is sent in plain HTTP, and this cluster has https backends: \
                     use type = \"tcp\""
                        .into(),
                );
            }
            ProbeCheck::Http {
                path: probe_path,
                expect_status,
            }
        }
        "tcp" => {
            for (key, set) in [
                ("path", raw.path.is_some()),
                ("expect_status", raw.expect_status.is_some()),
            ] {
                if set {
                    err(format!("{path}.{key}"), "only an http probe has one".into());
                }
            }
            ProbeCheck::Tcp
        }
        other => {
            err(
                format!("{path}.type"),
                format!("`{other}` is not \"http\" or \"tcp\""),
            );
            ProbeCheck::Tcp
        }
    };
    if raw.interval_ms < 10 {
        err(
            format!("{path}.interval_ms"),
            "must be at least 10 ms".into(),
        );
    }
    if raw.timeout_ms == 0 || raw.timeout_ms > raw.interval_ms {
        err(
            format!("{path}.timeout_ms"),
            "must be from 1 ms to interval_ms".into(),
        );
    }
    let always = match raw.when.as_str() {
        "open" => false,
        "always" => true,
        other => {
            err(
                format!("{path}.when"),
                format!("`{other}` is not \"open\" or \"always\""),
            );
            false
        }
    };
    Probe {
        check,
        interval: std::time::Duration::from_millis(raw.interval_ms.max(10)),
        timeout: std::time::Duration::from_millis(raw.timeout_ms.clamp(1, raw.interval_ms.max(10))),
        always,
    }
}
