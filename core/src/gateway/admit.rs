//! Admit and settle: reserve what a request may use under every limit that applies, and turn the
//! reservation into spend when it ends.
//!
//! [`admit`] runs after routing, before forwarding. It takes the caller's key (if any) and the
//! inspected request; it estimates the prompt's tokens from the body (a calibrated byte-class
//! estimate, no tokenizer on the request path) and asks the worker's limiter shard for a
//! reservation on every matching policy (requests, tokens, concurrency) and on the key's first
//! quota plan, by priority, that can cover it. When the shard holds too small a lease for a
//! strict budget it waits — once, at most `limits.lease_wait_ms` — for the next sync. Returns an
//! [`Admission`], which must be settled and can be settled only once (settling consumes it);
//! raises, as a [`Rejection`] with the rate headers, 429 `rate_limit_error` (a policy, with its id and dimension in the message
//! and `Retry-After`), 429 `insufficient_quota` (no plan has balance), or 503
//! `limits_unavailable` (the shared ledger is down and what this core holds does not cover the
//! request, per `limits.on_backend_down`).
//!
//! [`Admission::settle`] runs exactly once for every admitted request, whatever happened, with
//! what it is billed ([`record`](crate::gateway::record)'s one rule, which the access log and the
//! metrics record too): the upstream's reported usage, or an estimate of the prompt plus what
//! was relayed when there is none (a client abort is never free), and nothing when the upstream
//! answered an error or Sluice answered itself.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::config::limits::LimitDimension;
use crate::config::limits::LimitsConfig;
use crate::gateway::auth::Principal;
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::limits::shard::{Ask, LimiterShard, Permit, RateHeaders, Refusal, RefusalKind};
use crate::openai::inspect::Inspection;
use crate::telemetry::metrics::MetricsView;

/// Who called and what the limiter said, for metrics and the access log.
#[derive(Debug, Default)]
pub(crate) struct Caller<'s> {
    pub(crate) principal: Option<Principal<'s>>,
    pub(crate) refusal: Option<Refusal>,
    /// Why authentication or authorization failed (the error's code).
    pub(crate) auth_failure: Option<&'static str>,
}

/// An admitted request's reservation under every limit that applied. It must be settled, and
/// settling consumes it, so "exactly once" is the compiler's to check.
#[must_use = "an admitted request's reservation must be settled exactly once"]
#[derive(Debug)]
pub(crate) struct Admission {
    permit: Permit,
}

impl Admission {
    /// The `x-ratelimit-*` numbers to answer with.
    pub(crate) fn rate_headers(&self) -> &RateHeaders {
        &self.permit.headers
    }

    /// Whether settling needs what the request used (a token budget or a quota plan).
    pub(crate) fn spends_tokens(&self) -> bool {
        self.permit.spends_tokens()
    }

    /// Turn the reservations into spend: `tokens` used (0 releases them).
    pub(crate) fn settle(mut self, limiter: &RefCell<LimiterShard>, tokens: u64) {
        limiter.borrow_mut().settle(&mut self.permit, tokens);
    }
}

/// A refused request: why, and the `x-ratelimit-*` numbers to answer with.
#[derive(Debug)]
pub(crate) struct Rejection {
    pub(crate) refusal: Refusal,
    pub(crate) headers: RateHeaders,
}

impl Caller<'_> {
    pub(crate) fn auth_failed(&mut self, error: &GatewayError) {
        self.auth_failure = error.kind.auth_rejection_reason();
    }

    pub(crate) fn refused(&mut self, metrics: MetricsView<'_>, refusal: Refusal) {
        metrics.limiter_hit(metrics.labels.policy(refusal.policy), refusal.dimension);
        self.refusal = Some(refusal);
    }
}

/// Reserve for one request whose body is `body` (its prompt tokens are estimated from it, only
/// when some limit applies). `first`: the request's first try, whose matched policies are
/// counted (`sluice_limiter_matches_total`); a request waiting for room under an
/// `on_limit = "queue"` policy tries again with `false`.
pub(crate) async fn admit(
    limiter: &RefCell<LimiterShard>,
    metrics: MetricsView<'_>,
    cfg: &LimitsConfig,
    principal: Option<Principal<'_>>,
    inspection: &Inspection,
    body: &[u8],
    first: bool,
) -> Result<Admission, Rejection> {
    let mut permit = Permit::default();
    if !limits_apply(cfg, principal) {
        return Ok(Admission { permit });
    }
    let ask = Ask {
        key: principal.map(|p| p.index),
        model: &inspection.model,
        prompt_estimate: crate::openai::tokens::estimate_tokens(body),
        max_tokens: inspection.max_tokens,
        n: inspection.n,
    };
    let result = reserve(limiter, first.then_some(metrics), cfg, &ask, &mut permit).await;
    admitted(result, permit)
}

/// A request refused before admission (a body Sluice cannot read, a model that is not there
/// or not the key's) still counts against its key's limits: one request, no tokens, no model
/// (so only the policies that name no model apply). Without this, a key could send refused
/// requests without end, each one a record in the access log. Settle the admission as any.
pub(crate) async fn charge_refused(
    limiter: &RefCell<LimiterShard>,
    metrics: MetricsView<'_>,
    cfg: &LimitsConfig,
    principal: Principal<'_>,
) -> Result<Admission, Rejection> {
    let mut permit = Permit::default();
    if !limits_apply(cfg, Some(principal)) {
        return Ok(Admission { permit });
    }
    let ask = Ask {
        key: Some(principal.index),
        model: "",
        prompt_estimate: 0,
        max_tokens: Some(0),
        n: None,
    };
    let result = reserve(limiter, Some(metrics), cfg, &ask, &mut permit).await;
    admitted(result, permit)
}

/// Whether any limit can apply to a request of `principal`: a policy, or a plan of its key.
fn limits_apply(cfg: &LimitsConfig, principal: Option<Principal<'_>>) -> bool {
    !cfg.policies.is_empty() || principal.is_some_and(|p| !p.key.plans.is_empty())
}

/// What the shard's answer makes of a request: admitted on `permit`, or refused with the rate
/// headers it gathered.
fn admitted(result: Result<(), Refusal>, permit: Permit) -> Result<Admission, Rejection> {
    match result {
        Ok(()) => Ok(Admission { permit }),
        Err(refusal) => Err(Rejection {
            refusal,
            headers: permit.headers,
        }),
    }
}

/// Ask the shard for every reservation `ask` needs, waiting at most `lease_wait` for a lease.
async fn reserve(
    limiter: &RefCell<LimiterShard>,
    metrics: Option<MetricsView<'_>>,
    cfg: &LimitsConfig,
    ask: &Ask<'_>,
    permit: &mut Permit,
) -> Result<(), Refusal> {
    let mut matched = |policy: usize, dimension: LimitDimension| {
        if let Some(metrics) = metrics {
            metrics.limiter_match(metrics.labels.policy(Some(policy)), dimension);
        }
    };
    let first = limiter
        .borrow_mut()
        .try_admit(cfg, ask, permit, &mut matched);
    let refusal = match first {
        Ok(()) => return Ok(()),
        Err(r) if r.kind == RefusalKind::NeedLease => r,
        Err(r) => return Err(r),
    };
    // Too small a lease here, maybe room in the ledger: wait for exchanges — until the lease
    // comes or `lease_wait` is up (other requests may take a fresh lease first).
    let deadline = crate::sys::clock::recent() + cfg.sync.lease_wait;
    let mut last = refusal;
    loop {
        let left = deadline.saturating_duration_since(crate::sys::clock::recent());
        let target = limiter.borrow().lease_epoch();
        let wait = SyncWait {
            shard: limiter,
            target,
        };
        if left.is_zero() || crate::sys::clock::timeout(left, wait).await.is_err() {
            // Still short when the wait is up: as good as exhausted for this request.
            return Err(Refusal {
                kind: RefusalKind::Exhausted,
                ..last
            });
        }
        let mut no_count = |_: usize, _: LimitDimension| {};
        match limiter
            .borrow_mut()
            .try_admit(cfg, ask, permit, &mut no_count)
        {
            Ok(()) => return Ok(()),
            Err(r) if r.kind == RefusalKind::NeedLease => last = r,
            Err(r) => return Err(r),
        }
    }
}

/// The error a refusal is answered with.
pub(crate) fn refusal_error(cfg: &LimitsConfig, refusal: &Refusal) -> GatewayError {
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

/// Provider limits: reserve one attempt's request, slot and `tokens()` on the limits of
/// `target`'s cluster and credential (`limits.provider_limits`), into `provider`. Runs in the
/// forward loop before each attempt is sent. Without waiting when the limit is used up; when
/// this core is only short of a lease (a quiet worker, a new window) it waits once, at most
/// `limits.lease_wait_ms`, as admission does — a provider with room is not passed over for the
/// fallback (or answered 503) because this core had not asked for its share yet. `Ok` also
/// when the target has no provider limits (nothing reserved). `Err`: the provider would not
/// take the attempt now, with the seconds until its window has room (at least 1), for
/// `Retry-After`.
pub(crate) async fn reserve_provider(
    limiter: &RefCell<LimiterShard>,
    cfg: &LimitsConfig,
    target: &crate::gateway::route::Target<'_>,
    mut tokens: impl FnMut() -> u64,
    provider: &mut Permit,
) -> Result<(), u64> {
    let limits = target.provider_limits();
    if limits.iter().all(Option::is_none) {
        return Ok(());
    }
    let tokens = tokens();
    let mut reserved = limiter
        .borrow_mut()
        .try_reserve_provider(limits, tokens, provider);
    let short_of_lease = reserved
        .as_ref()
        .is_err_and(|r| r.kind == RefusalKind::NeedLease);
    if short_of_lease && wait_for_lease(limiter, cfg.sync.lease_wait).await {
        reserved = limiter
            .borrow_mut()
            .try_reserve_provider(limits, tokens, provider);
    }
    reserved.map_err(|refusal| u64::from(refusal.retry_after.unwrap_or(1)).max(1))
}

/// Wait, at most `wait`, for the limiter's next exchange (a lease asked for by a refusal that
/// registered its demand). Whether it came in time.
pub(crate) async fn wait_for_lease(
    limiter: &RefCell<LimiterShard>,
    wait: std::time::Duration,
) -> bool {
    let target = limiter.borrow().lease_epoch();
    let wait_for = SyncWait {
        shard: limiter,
        target,
    };
    crate::sys::clock::timeout(wait, wait_for).await.is_ok()
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
