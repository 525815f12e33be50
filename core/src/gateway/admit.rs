//! Admit and settle: reserve what a request may use under every limit that applies, and turn the
//! reservation into spend when it ends.
//!
//! [`admit`] runs after routing, before forwarding. It takes the caller's key (if any) and the
//! inspected request; it estimates the prompt's tokens from the body (a calibrated byte-class
//! estimate, no tokenizer on the request path) and asks the worker's limiter shard for a
//! reservation on every matching policy (requests, tokens, concurrency) and on the key's first
//! quota plan, by priority, that can cover it. When the shard holds too small a lease for a
//! strict budget it waits — once, at most `limits.lease_wait_ms` — for the next sync. Returns the
//! [`Permit`]; raises 429 `rate_limit_error` (a policy, with its id and dimension in the message
//! and `Retry-After`), 429 `insufficient_quota` (no plan has balance), or 503
//! `limits_unavailable` (the shared ledger is down and what this core holds does not cover the
//! request, per `limits.on_backend_down`).
//!
//! [`settle`] runs exactly once for every admitted request, whatever happened: it bills the
//! upstream's reported usage, or an estimate of the prompt plus what was streamed when there is
//! none (a client abort is never free), and releases the reservation when the upstream failed.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::config::limits::KeyIdx;
use crate::config::limits::LimitDimension;
use crate::config::limits::LimitsConfig;
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::gateway::observe::{Outcome, UsageSource};
use crate::limits::shard::{Ask, LimiterShard, Permit, Refusal, RefusalKind};
use crate::openai::inspect::Inspection;
use crate::telemetry::metrics::MetricsShard;

/// Who called and what the limiter said, for settlement, metrics and the access log.
#[derive(Debug, Default)]
pub struct Caller {
    pub key: Option<KeyIdx>,
    pub permit: Permit,
    /// A permit was granted: settle it.
    pub admitted: bool,
    pub refusal: Option<Refusal>,
    /// Why authentication or authorization failed (the error's code).
    pub auth_failure: Option<&'static str>,
}

impl Caller {
    pub fn auth_failed(&mut self, error: &GatewayError) {
        if matches!(error.status(), 401 | 403) {
            self.auth_failure = error.code();
        }
    }

    pub fn refused(&mut self, metrics: &MetricsShard, cfg: &LimitsConfig, refusal: Refusal) {
        let names = metrics.names();
        let policy = match refusal.policy {
            Some(p) => names.policy_at(p),
            // Quota refusals count under the last label, `quota`.
            None => names.policy_at(cfg.policies.len()),
        };
        metrics.limiter_hit(policy, refusal.dimension);
        self.refusal = Some(refusal);
    }
}

/// Reserve for one request whose body is `body` (its prompt tokens are estimated from it, only
/// when some limit applies).
pub async fn admit(
    limiter: &RefCell<LimiterShard>,
    metrics: &MetricsShard,
    cfg: &LimitsConfig,
    key: Option<KeyIdx>,
    inspection: &Inspection,
    body: &[u8],
    permit: &mut Permit,
) -> Result<(), Refusal> {
    if cfg.policies.is_empty()
        && key.is_none_or(|k| cfg.keys.get(k).is_none_or(|k| k.plans.is_empty()))
    {
        return Ok(());
    }
    let ask = Ask {
        key,
        model: &inspection.model,
        prompt_estimate: crate::openai::tokens::estimate_tokens(body),
        max_tokens: inspection.max_tokens,
        n: inspection.n,
    };
    let names = metrics.names();
    let mut matched = |policy: usize, dimension: LimitDimension| {
        metrics.limiter_match(names.policy_at(policy), dimension);
    };
    let first = limiter
        .borrow_mut()
        .try_admit(cfg, &ask, permit, &mut matched);
    let refusal = match first {
        Ok(()) => return Ok(()),
        Err(r) if r.kind == RefusalKind::NeedLease => r,
        Err(r) => return Err(r),
    };
    // Too small a lease here, maybe room in the ledger: wait for exchanges — until the lease
    // comes or `lease_wait` is up (other requests may take a fresh lease first).
    let deadline = std::time::Instant::now() + cfg.sync.lease_wait;
    let mut last = refusal;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let target = limiter.borrow().lease_epoch();
        let wait = SyncWait {
            shard: limiter,
            target,
        };
        if left.is_zero() || monoio::time::timeout(left, wait).await.is_err() {
            // Still short when the wait is up: as good as exhausted for this request.
            return Err(Refusal {
                kind: RefusalKind::Exhausted,
                ..last
            });
        }
        let mut no_count = |_: usize, _: LimitDimension| {};
        match limiter
            .borrow_mut()
            .try_admit(cfg, &ask, permit, &mut no_count)
        {
            Ok(()) => return Ok(()),
            Err(r) if r.kind == RefusalKind::NeedLease => last = r,
            Err(r) => return Err(r),
        }
    }
}

/// The error a refusal is answered with.
pub fn refusal_error(cfg: &LimitsConfig, refusal: &Refusal) -> GatewayError {
    let policy = refusal
        .policy
        .and_then(|p| cfg.policies.get(p))
        .map_or("quota", |p| p.id.as_str());
    let what = match refusal.dimension {
        LimitDimension::Rpm => "requests",
        LimitDimension::Tpm => "tokens",
        LimitDimension::Concurrency => "concurrent requests",
        LimitDimension::Quota => "quota",
    };
    match (refusal.kind, refusal.dimension) {
        (RefusalKind::BackendDown, _) => GatewayError::limits_unavailable(format!(
            "The limit ledger is unreachable and policy `{policy}` ({what}) cannot be checked; \
             try again shortly."
        )),
        (_, LimitDimension::Quota) => GatewayError::new(
            ErrorKind::InsufficientQuota,
            "You exceeded your current quota: no quota plan of this API key has enough \
             balance left for this request.",
        )
        .with_retry_after(refusal.retry_after),
        _ => GatewayError::new(
            ErrorKind::RateLimited,
            format!(
                "Rate limit reached: policy `{policy}` allows {} {what}{}; please try again \
                 later.",
                refusal.limit,
                match refusal.dimension {
                    LimitDimension::Concurrency => " at once",
                    _ => " per window",
                }
            ),
        )
        .with_retry_after(refusal.retry_after),
    }
}

/// The tokens a finished request is billed: the upstream's usage, or the estimate of what it
/// streamed (the outcome fills it in), or nothing when the upstream failed before answering
/// with success.
pub fn billable_tokens(status: u16, outcome: &Outcome) -> u64 {
    match outcome.usage_source {
        UsageSource::None => 0,
        _ if !(200..300).contains(&status) => 0,
        _ => outcome.usage.total_tokens,
    }
}

/// Turn the permit's reservations into spend (once).
pub fn settle(limiter: &RefCell<LimiterShard>, permit: &mut Permit, tokens: u64) {
    limiter.borrow_mut().settle(permit, tokens);
}

/// Resolves when the shard has completed the exchange numbered `target`.
struct SyncWait<'a> {
    shard: &'a RefCell<LimiterShard>,
    target: u64,
}

impl Future for SyncWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut shard = self.shard.borrow_mut();
        if shard.epoch >= self.target {
            return Poll::Ready(());
        }
        shard.wait_for_sync(cx.waker());
        Poll::Pending
    }
}
