//! Attempt: one try of one target, as the fallback walk in
//! [`pipeline`](crate::gateway::pipeline) makes it.
//!
//! Runs once per target tried, after admission. [`send`] takes the target and the walk's state
//! ([`Walk`]): it picks the target's [`Translation`], checks the target's provider limits (a
//! key pool's other credential may have room) and its breaker's half-open probe slot, builds the
//! request, forwards it and judges what came back ([`fallback`]), recording the backend's health
//! as far as the judgement knows it. It returns a [`Tried`]: passed over without being sent,
//! refused as the client's to fix (400), or [`Sent`]. The walk then either moves on
//! ([`Walk::retry_target`], [`Sent::abandon`]) or answers with it: [`Sent::into_relay`] gives
//! the error to answer with (the upstream's failure, nothing having reached the client) or a
//! [`Relaying`]: the response, how it goes through the translation, and the record the relay's
//! outcome goes into ([`AttemptRecord::relayed`]).

use crate::gateway::admit;
use crate::gateway::context::{PerCore, Request};
use crate::gateway::error::GatewayError;
use crate::gateway::fallback::{self, FallbackReason, Judgement};
use crate::gateway::forward::{self, UpstreamResponse};
use crate::gateway::observe;
use crate::gateway::record::{Observation, RelayEnd};
use crate::gateway::relay::{ClientSide, Relayed};
use crate::gateway::route::{Candidates, Target};
use crate::gateway::translation::{self, RelayWith, Translation};
use crate::limits::shard::Permit;
use crate::openai::endpoint::Endpoint;
use crate::openai::inspect::Inspection;
use crate::sys::client::ClientSocket;
use crate::upstream::health::{AttemptGuard, AttemptResult};

/// What the walk over a request's candidates carries from one attempt to the next.
#[derive(Debug)]
pub(crate) struct Walk {
    /// Attempts sent so far, this one included (bounded by `routing.max_attempts`).
    pub(crate) attempts: u32,
    /// The request's token estimate as admission makes it, computed once when a provider's
    /// limits first ask.
    estimate: Option<u64>,
    /// The soonest a provider passed over for its limits takes requests again (seconds).
    over_limits: Option<u64>,
}

impl Default for Walk {
    fn default() -> Walk {
        Walk {
            attempts: 1,
            estimate: None,
            over_limits: None,
        }
    }
}

/// What one attempt came to.
#[allow(clippy::large_enum_variant)] // `Sent` is the common case: boxing it would allocate per request
pub(crate) enum Tried<'s> {
    /// Not sent: the walk moves on to the next candidate (`reason` labels that fallback), or
    /// answers `last` when none is left.
    PassedOver {
        reason: Option<&'static str>,
        last: GatewayError,
    },
    /// The request cannot be said in the target's dialect: the client's to fix, wherever it
    /// goes.
    Refused(GatewayError),
    /// Sent, answered or failed, and judged.
    Sent(Sent<'s>),
}

/// A sent attempt, judged.
pub(crate) struct Sent<'s> {
    /// The target it went to (another credential of a key pool than the walk's, maybe).
    pub(crate) target: Target<'s>,
    translation: Translation<'s>,
    strip_usage: bool,
    response: Result<UpstreamResponse<'s>, GatewayError>,
    judgement: Judgement,
    /// When the judgement was made (ms, monotonic): health, benches and retries go by it.
    judged_at: u64,
    /// The backend's count of this attempt, which records its outcome exactly once.
    guard: Option<AttemptGuard<'s>>,
}

/// Try `target`: see the module's doc. `candidates` is read (not walked) to know whether a
/// fallback is possible, which decides whether a stream's first event is read to judge it.
#[allow(clippy::too_many_arguments)] // one attempt's inputs, each used once
pub(crate) async fn send<'s>(
    core: PerCore<'s>,
    client: &ClientSocket,
    request: &Request<'_>,
    inspection: &Inspection,
    target: Target<'s>,
    candidates: &Candidates<'s>,
    walk: &mut Walk,
    obs: &mut Observation,
    provider: &mut Permit,
) -> Tried<'s> {
    let model = inspection.model.as_str();
    let endpoint = Endpoint::from_path(request.head.path(request.buf));
    let request_usage = core.snapshot.upstream.request_stream_usage;
    let Some(translation) = Translation::plan(endpoint, target.cluster, request_usage) else {
        return Tried::PassedOver {
            reason: None,
            last: translation::unservable(model),
        };
    };
    // Most targets have no provider limits: no reservation, and no future made for one.
    let reserved = if target.provider_limits().iter().any(Option::is_some) {
        reserve_provider(core, request, inspection, target, walk, provider).await
    } else {
        Ok(target)
    };
    let target = match reserved {
        Ok(target) => target,
        Err(retry) => {
            obs.fallback_reason = "provider_limit";
            return Tried::PassedOver {
                reason: Some("provider_limit"),
                last: GatewayError::upstream_unavailable(model, retry),
            };
        }
    };
    // A provider whose limits count tokens settles on what this attempt used.
    if provider.spends_tokens() {
        obs.usage_wanted = true;
    }
    let settings = &core.snapshot.routing;
    let Some(guard) = begin(core, &target) else {
        return not_begun(core, &target, model, provider);
    };
    let mut upstream_request = core.bufs.take();
    let built = match translation.build(&mut upstream_request, core, request, inspection, &target) {
        Ok(built) => built,
        Err(e) => {
            core.bufs.give(upstream_request);
            core.limiter.borrow_mut().release(provider);
            return Tried::Refused(e);
        }
    };
    let tail = request.body.get(built.tail_from..).unwrap_or_default();
    let watch = watch_for(request, client);
    let (mut response, timings) = forward::send(
        core.io(),
        &target,
        upstream_request,
        tail,
        inspection.stream,
        watch,
    )
    .await;
    obs.forward = timings;
    let may_retry = || {
        walk.attempts < settings.max_attempts
            && candidates.clone().next_fallback(model, None).is_some()
    };
    // Fallback's judgement, before a byte reaches the client: may another backend (or
    // credential) do better? Reading on (a 429's body, a stream's first event) only when
    // another could take the request. Not a function: its future would be one more copy.
    let judgement = match &mut response {
        Err(e) => fallback::judge_error(e),
        Ok(response) => {
            let key_pool = target.cluster.credentials.len() > 1;
            let deadline = crate::sys::clock::recent() + target.first_byte_timeout;
            fallback::judge_response(response, may_retry, key_pool, deadline, core.bufs, watch)
                .await
        }
    };
    let mut sent = Sent {
        target,
        translation,
        strip_usage: built.strip_usage,
        response,
        judgement,
        // Read again: judging may have waited.
        judged_at: crate::sys::time::mono_ms(),
        guard,
    };
    sent.record_judgement(core);
    Tried::Sent(sent)
}

/// An attempt its backend would not take (another request holds its half-open probe, or it is
/// at its cap): passed over, its provider reservation given back untouched. At its cap
/// (another request took the last place first), the request may wait for room.
fn not_begun<'s>(
    core: PerCore<'s>,
    target: &Target<'s>,
    model: &str,
    provider: &mut Permit,
) -> Tried<'s> {
    core.limiter.borrow_mut().release(provider);
    let full = target
        .cap
        .zip(target.health)
        .is_some_and(|(cap, h)| h.load.in_flight() >= cap);
    let last = if full {
        GatewayError::saturated()
    } else {
        GatewayError::upstream_unavailable(model, 1)
    };
    Tried::PassedOver { reason: None, last }
}

/// Whose leaving cuts the attempt while it waits for its answer: the client, unless it
/// pipelined its next request (bytes past this one already read) — such a client may half-close
/// and still wait for its answers, so its FIN says nothing, and it is not watched.
fn watch_for<'c>(request: &Request<'_>, client: &'c ClientSocket) -> Option<forward::Watch<'c>> {
    let pipelined = request.buf.len() > request.head.head_len + request.body.len();
    (!pipelined).then(|| forward::Watch::from_now(client))
}

/// The attempt counted in its backend's health (`Some(None)`: the backend is untracked), or
/// `None` when a half-open backend's one probe is already out: this one is passed over.
fn begin<'s>(core: PerCore<'s>, target: &Target<'s>) -> Option<Option<AttemptGuard<'s>>> {
    match target.health {
        Some(h) => h
            .begin(
                crate::sys::time::mono_ms(),
                &core.snapshot.routing,
                target.cap,
            )
            .map(Some),
        None => Some(None),
    }
}

/// Provider limits: would `target` take the request now (a key pool's other credential, when
/// its own is full)? The target to send to, or the seconds until the soonest provider passed
/// over on this walk has room (for `Retry-After` when no candidate is left).
async fn reserve_provider<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    target: Target<'s>,
    walk: &mut Walk,
    provider: &mut Permit,
) -> Result<Target<'s>, u64> {
    let limits = &core.snapshot.limits;
    let estimate = &mut walk.estimate;
    let mut tokens = || {
        *estimate.get_or_insert_with(|| {
            let prompt = crate::openai::tokens::estimate_tokens(request.body);
            limits
                .reserve
                .tokens(prompt, inspection.max_tokens, inspection.n)
        })
    };
    let mut reserved =
        admit::reserve_provider(core.limiter, limits, &target, &mut tokens, provider).await;
    let mut target = target;
    if reserved.is_err() {
        // A key pool: the full limit may be this credential's own; another may have room.
        let now = crate::sys::time::mono_ms();
        if let Some(other) = target.with_other_credential(core.health, core.rng, now) {
            let again =
                admit::reserve_provider(core.limiter, limits, &other, &mut tokens, provider).await;
            if again.is_ok() {
                target = other;
                reserved = again;
            }
        }
    }
    match reserved {
        Ok(()) => Ok(target),
        Err(retry) => {
            observe::provider_skipped(core.metrics, target.backend.id);
            let soonest = walk.over_limits.map_or(retry, |r| r.min(retry));
            walk.over_limits = Some(soonest);
            Err(soonest)
        }
    }
}

impl Walk {
    /// Where a failed attempt's request goes next, if anywhere: another credential of a key
    /// pool when only the credential failed, else the next candidate — within
    /// `routing.max_attempts` and the failed backend's retry budget (charged only when there
    /// is somewhere to go). `None`: the attempt's answer (or error) is the client's.
    pub(crate) fn retry_target<'s>(
        &self,
        core: PerCore<'s>,
        sent: &Sent<'s>,
        candidates: &mut Candidates<'s>,
        model: &str,
    ) -> Option<(Target<'s>, FallbackReason)> {
        let settings = &core.snapshot.routing;
        let reason = sent
            .judgement
            .retry
            .filter(|_| self.attempts < settings.max_attempts)?;
        let now = sent.judged_at;
        let next = match reason {
            FallbackReason::Credential => {
                sent.target
                    .with_other_credential(core.health, core.rng, now)
            }
            _ => None,
        }
        .or_else(|| candidates.next_fallback(model, Some(reason.label())))?;
        let budget = |h: &crate::upstream::health::BackendHealth| h.allow_retry(now, settings);
        sent.target
            .health
            .is_none_or(budget)
            .then_some((next, reason))
    }
}

impl<'s> Sent<'s> {
    /// The judgement's health result into the backend's record, and a credential the backend
    /// refused benched (only the credential: the backend answered).
    fn record_judgement(&mut self, core: PerCore<'s>) {
        let settings = &core.snapshot.routing;
        let now = self.judged_at;
        if let (Some(guard), Some(result)) = (self.guard.as_mut(), self.judgement.health) {
            guard.record(result, now, settings);
        }
        if self.judgement.retry == Some(FallbackReason::Credential) {
            if let Some((index, _)) = self.target.credential {
                let until = now + settings.credential_bench_ms;
                core.health
                    .bench_credential(self.target.cluster_id, index, until);
            }
        }
    }

    /// The client left while this attempt waited for its answer (the forward's wait, or
    /// judging's read of a stream's first event): the attempt was cut.
    pub(crate) fn client_left(&self) -> bool {
        let left = |e: &GatewayError| e.kind == crate::gateway::error::ErrorKind::ClientLeft;
        self.response.as_ref().err().is_some_and(left)
            || self.judgement.broken.as_deref().is_some_and(left)
    }

    /// End an attempt the client left ([`Self::client_left`]): an upstream connection it still
    /// holds (judging's read was cut) is shut down at once, not left to close when dropped.
    pub(crate) fn cut(self) {
        if let Ok(response) = self.response {
            response.conn.abort();
        }
    }

    /// The walk moves on from this attempt for `reason`: counted as a failed attempt, its
    /// response (if any) not relayed — the connection's state is unknown, so it is not reused
    /// — and the provider's reservation settled at nothing used.
    pub(crate) fn abandon(
        self,
        core: PerCore<'s>,
        obs: &mut Observation,
        provider: &mut Permit,
        reason: FallbackReason,
    ) {
        observe::failed_attempt(core.metrics, obs, self.target.backend.id, reason);
        obs.fallbacks += 1;
        obs.fallback_reason = reason.label();
        if let Ok(response) = self.response {
            response.conn.abort();
        }
        core.limiter.borrow_mut().settle(provider, 0);
    }

    /// Ready this attempt's response for the relay: how it goes through the translation and
    /// to the client ([`Relaying`]), or the error to answer with instead when there is none to
    /// relay — the forward's, or the one judging met when reading on lost the response (a read
    /// timed out or failed). `relaying` runs once the response is known to go to the client
    /// (a sticky session's pin and cookie). Not async: the caller awaits the relay itself, so
    /// its future is not wrapped in one more (each wrapper is a copy of it per request).
    pub(crate) fn into_relay<'m>(
        self,
        request: &Request<'_>,
        obs: &mut Observation,
        model: &'m str,
        relaying: impl FnOnce(&Target<'s>, &mut Observation),
    ) -> Result<Relaying<'s, 'm>, GatewayError> {
        let Sent {
            target,
            translation,
            strip_usage,
            response,
            judgement,
            judged_at: _,
            guard,
        } = self;
        let response = response?;
        if let Some(broken) = judgement.broken {
            response.conn.abort();
            return Err(*broken);
        }
        relaying(&target, obs);
        // An Anthropic answer passed through is metered in Anthropic's terms.
        obs.meter_anthropic(translation.meters_anthropic());
        let head = &response.head;
        let streamed = head.event_stream && (200..300).contains(&head.status);
        Ok(Relaying {
            side: ClientSide {
                head_only: false,
                minor_version: request.head.minor_version,
                keep_alive: request.head.keep_alive,
                strip_usage,
                dialect: request.dialect(),
                pass: &target.cluster.pass_response_headers,
            },
            with: translation.relay_with(streamed, model),
            response,
            guard: AttemptRecord(guard),
        })
    }
}

/// A response on its way to the client: what [`Sent::into_relay`] made of an attempt.
pub(crate) struct Relaying<'s, 'm> {
    pub(crate) response: UpstreamResponse<'s>,
    /// How the client asked (and whether the usage chunk is withheld from it).
    pub(crate) side: ClientSide<'s>,
    /// Through the translation: as it arrives, or read whole and translated.
    pub(crate) with: RelayWith<'m>,
    /// The backend's count of the attempt, for what the relay learns of it.
    pub(crate) guard: AttemptRecord<'s>,
}

/// A relayed attempt's place in its backend's health.
pub(crate) struct AttemptRecord<'s>(Option<AttemptGuard<'s>>);

impl AttemptRecord<'_> {
    /// Record what the relay learnt of the backend, if judging did not already.
    pub(crate) fn relayed(mut self, core: PerCore<'_>, relayed: &Result<Relayed, GatewayError>) {
        if let Some(guard) = self.0.as_mut().filter(|g| !g.recorded()) {
            let result = match relayed {
                Ok(r) => match r.end {
                    RelayEnd::UpstreamCut(_) => AttemptResult::Failed,
                    RelayEnd::Complete => AttemptResult::Answered,
                    RelayEnd::ClientLeft | RelayEnd::Shutdown => AttemptResult::Unknown,
                },
                Err(_) => AttemptResult::Failed,
            };
            guard.record(result, crate::sys::time::mono_ms(), &core.snapshot.routing);
        }
    }
}
