//! The life of one proxied request, top to bottom. Each step is one phase module; the order
//! here is the order in `docs/request-lifecycle.md`.
//!
//! Runs for every POST to an OpenAI endpoint, on a [`PerCore`] loan of the worker's state, in
//! two steps: [`authenticate_head`] as soon as the head is in — an unknown, disabled or expired
//! key is refused before a byte of its body is read — and [`proxy`] once the body is in, with
//! the principal the first step found. Each returns the error to answer with when nothing was
//! sent to the client yet (errors after the response started are the relay's to end); `proxy`
//! otherwise returns whether the client connection can be kept.

use crate::config::dialect::Dialect;
use crate::gateway::admit::{Admission, Caller};
use crate::gateway::auth::Principal;
use crate::gateway::context::{ClientSocket, PerCore, Request};
use crate::gateway::error::GatewayError;
use crate::gateway::error::{ErrorKind, UpstreamFault};
use crate::gateway::observe::{Estimator, Observation};
use crate::gateway::relay::translate::StreamTranslate;
use crate::gateway::relay::{ClientSide, RelayEnd, Relayed};
use crate::gateway::route::Candidates;
use crate::gateway::{admit, auth, fallback, forward, observe, relay, route, sticky};
use crate::limits::shard::Permit;
use crate::openai::anthropic::client as anthropic_client;
use crate::openai::anthropic::upstream as anthropic_upstream;
use crate::openai::endpoint::{ClientDialect, Endpoint};
use crate::openai::inspect::Inspection;
use crate::upstream::health::AttemptResult;

/// Proof that a request's head was authenticated: only [`authenticate_head`] makes one, and
/// [`proxy`] takes one, so no path can proxy a request nobody authenticated.
#[derive(Clone, Copy)]
pub(crate) struct Authenticated<'s> {
    /// The caller's key (`None`: no keys are configured, so nobody is asked).
    pub(crate) principal: Option<Principal<'s>>,
}

/// Authenticate: which key is calling, from the head alone (`request.body` is empty). A refusal
/// is observed here — counted and logged like any request — and returned to be answered; the
/// connection is then closed without reading the body.
pub(crate) fn authenticate_head<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    memo: &mut auth::KeyDigestMemo,
) -> Result<Authenticated<'s>, GatewayError> {
    let error = match auth::authenticate(&core.snapshot.limits, request, Some(memo)) {
        Ok(principal) => return Ok(Authenticated { principal }),
        Err(e) => e,
    };
    refused_before_body(core, request, &error);
    Err(error)
}

/// Observe a request answered with `error` from its head alone (refused or shed before its
/// body was read): counted and logged like any other.
pub(crate) fn refused_before_body(core: PerCore<'_>, request: &Request<'_>, error: &GatewayError) {
    let mut caller = Caller::default();
    caller.auth_failed(error);
    let mut obs = core.observations.take();
    obs.start(request.received_at, request.head.head_len as u64);
    // Nothing of the body was read: no model, no usage.
    let inspection = Inspection::default();
    let estimator = Estimator::configured(&core.snapshot.limits, "");
    let outcome = obs.outcome(core.snapshot, "", None, &[], estimator);
    observe::emit(
        core.snapshot,
        core.metrics,
        core.log,
        request,
        &inspection,
        &obs,
        &outcome,
        Some(error),
        &caller,
    );
    core.observations.give(obs);
}

/// Answer `/v1/messages/count_tokens` for a caller whose head was authenticated: the body read
/// (strictly, as a Messages request without `max_tokens`), the model authorized for the key,
/// and the prompt's tokens estimated as admission estimates them — nothing goes upstream.
pub(crate) fn count_tokens(
    request: &Request<'_>,
    authenticated: Authenticated<'_>,
) -> Result<u64, GatewayError> {
    let read = anthropic_client::inspect_count_tokens(request.body)
        .map_err(|e| GatewayError::invalid_request(e.message, None))?;
    auth::authorize(
        authenticated.principal,
        &read.model,
        request.peer.map(|p| p.ip()),
    )?;
    Ok(crate::openai::tokens::estimate_tokens(request.body))
}

/// Serve one request whose head was authenticated and whose body is in.
pub(crate) async fn proxy<'s>(
    core: PerCore<'s>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &mut Inspection,
    authenticated: Authenticated<'s>,
) -> Result<bool, GatewayError> {
    let mut obs = core.observations.take();
    obs.start(
        request.received_at,
        (request.head.head_len + request.body.len()) as u64,
    );
    let mut caller = Caller {
        principal: authenticated.principal,
        ..Caller::default()
    };

    // Inspect, authorize, route, then admit: decided before anything goes upstream. The
    // targets stay where routing made them (a `Candidates` is ~550 bytes: passed on through
    // the admission's future and a tuple, it was copied five times).
    let mut provider = Permit::default();
    let (mut result, mapped, admission) =
        match route_request(core, request, inspection, &mut caller, &mut obs) {
            Err(e) => (Err(e), None, None),
            Ok(mut candidates) => {
                match admit_routed(core, request, inspection, &mut caller).await {
                    Err(e) => (Err(e), None, None),
                    // Forward and relay, on the admission's reservation: to the candidates in
                    // turn while a failure leaves the client untouched and another backend may
                    // do better.
                    Ok(admission) => {
                        admission.rate_headers().write(&mut obs.rate_headers);
                        // An answer's usage is read only for something that uses it (a
                        // provider's token limits may still ask, in `serve`).
                        obs.usage_wanted =
                            core.snapshot.usage_observed() || admission.spends_tokens();
                        let (served, mapped) = serve(
                            core,
                            client,
                            request,
                            inspection,
                            &mut candidates,
                            &mut obs,
                            &mut provider,
                        )
                        .await;
                        (served, mapped, Some(admission))
                    }
                }
            }
        };

    // Observe: usage, cost and timings of what happened, whatever happened.
    let estimator =
        Estimator::configured(&core.snapshot.limits, mapped.unwrap_or(&inspection.model));
    let outcome = obs.outcome(
        core.snapshot,
        &inspection.model,
        mapped,
        request.body,
        estimator,
    );

    // The backend's latency for the strategies that weigh it: the time to the first token of
    // a stream (its head comes at once, before the model has done anything), else to the
    // response head (which, unstreamed, comes with the whole answer).
    // Measured from the last attempt's start (the time lost on backends before it is not this
    // one's), on answers only (a fast error says nothing of how fast the model is).
    let answered = (200..300).contains(&obs.status) && result.is_ok();
    let health = obs.routed.and_then(|(_, b)| core.health.get(b));
    if let (Some(health), Some(started), true) = (health, obs.forward.started_at, answered) {
        let now = crate::sys::time::mono_ms();
        let since_start = |after_receipt: std::time::Duration| {
            (request.received_at + after_receipt).saturating_duration_since(started)
        };
        if let Some(ttft) = outcome.ttft.map(since_start) {
            health.load.observe_ttft(ttft.as_micros() as f64, now);
        }
        let latency = outcome.ttft.map(since_start).or(outcome.upstream_header);
        if let Some(latency) = latency {
            health.load.observe_latency(latency.as_micros() as f64, now);
        }
    }

    // Settle: what the request used goes into every budget it reserved from — success,
    // upstream error (released), client or upstream abort (billed). Settling consumes the
    // admission: exactly once.
    // The provider's limits of the target that served (if any) likewise.
    if let Some(admission) = admission {
        let status = result.as_ref().map_or(0, |_| obs.status);
        let tokens = admit::billable_tokens(status, obs.end, &outcome);
        admission.settle(core.limiter, tokens);
        core.limiter.borrow_mut().settle(&mut provider, tokens);
    }
    if let Err(e) = &mut result {
        if e.extra_headers.is_none() {
            e.add_headers(&obs.rate_headers);
        }
    }

    // Metrics and the access-log record.
    observe::emit(
        core.snapshot,
        core.metrics,
        core.log,
        request,
        inspection,
        &obs,
        &outcome,
        result.as_ref().err(),
        &caller,
    );
    if let Some(read) = obs.take_kept_read() {
        core.bufs.give(read);
    }
    core.observations.give(obs);
    result.map(|relayed| relayed.keep_alive)
}

/// Inspect, authorize and route, for the caller's principal (authenticated from the head): the
/// targets to try, or the error to answer with. [`admit_routed`] follows.
pub(crate) fn route_request<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &mut Inspection,
    caller: &mut Caller<'s>,
    obs: &mut Observation,
) -> Result<Candidates<'s>, GatewayError> {
    let principal = caller.principal;

    // Inspect: the top-level model and friends, exactly as the upstream will read them. A
    // Messages request is read by Anthropic's rules too (`max_tokens` required), which decide
    // model, stream and cap.
    core.inspector
        .borrow_mut()
        .inspect_for(request.body, &core.snapshot.body_wants, inspection)?;
    if request.dialect() == ClientDialect::Anthropic {
        inspect_messages(request.body, inspection)?;
    }

    // Authorize: may this key use this model, from this address.
    auth::authorize(principal, &inspection.model, request.peer.map(|p| p.ip()))
        .inspect_err(|e| caller.auth_failed(e))?;

    // Route: the targets to try in order — cluster, backend and the model name the upstream
    // sees — among the backends available now (a fast 503 when none is).
    // For a target's context window: the admission's own prompt estimate plus the cap.
    let needed_tokens = || {
        crate::openai::tokens::estimate_tokens(request.body) + inspection.max_tokens.unwrap_or(0)
    };
    // For a sticky route: the session id, the affinity cookie and the prompt prefix's hash.
    let inspected = &*inspection;
    let session_of = |rule: &crate::config::sticky::StickyRule, route: &str| {
        sticky::session(
            rule,
            route,
            &core.snapshot.sticky_keys,
            request,
            inspected,
            crate::sys::time::unix_secs(),
        )
    };
    let candidates = route::route(
        core.snapshot,
        core.health,
        &inspection.model,
        principal.map(|p| (p.index, p.key.entity)),
        &needed_tokens,
        &session_of,
        core.rng,
    )?;
    let primary = candidates.primary();
    obs.routed = Some((primary.cluster_id, primary.backend.id));
    Ok(candidates)
}

/// Admit a routed request: a reservation under every policy and quota plan that applies (waits
/// at most one sync for a lease), or the refusal to answer with (nothing was sent upstream).
pub(crate) async fn admit_routed<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    caller: &mut Caller<'s>,
) -> Result<Admission, GatewayError> {
    let limits = &*core.snapshot.limits;
    let admitted = admit::admit(
        core.limiter,
        core.metrics,
        limits,
        caller.principal,
        inspection,
        request.body,
    )
    .await;
    match admitted {
        Ok(admission) => Ok(admission),
        Err(rejection) => {
            let mut error = admit::refusal_error(limits, &rejection.refusal);
            caller.refused(core.metrics, rejection.refusal);
            let mut lines = String::new();
            rejection.headers.write(&mut lines);
            error.add_headers(&lines);
            Err(error)
        }
    }
}

/// A Messages request read by Anthropic's rules over what the inspector found: model (and its
/// span), stream and the required `max_tokens`; 400 when they are broken. Out of line: the
/// OpenAI endpoints' path never runs it.
#[inline(never)]
fn inspect_messages(body: &[u8], inspection: &mut Inspection) -> Result<(), GatewayError> {
    let m = anthropic_client::inspect_messages(body)
        .map_err(|e| GatewayError::invalid_request(e.message, None))?;
    inspection.model.clear();
    inspection.model.push_str(&m.model);
    inspection.model_span = m.model_span;
    inspection.stream = m.stream;
    inspection.max_tokens = Some(m.max_tokens);
    Ok(())
}

/// Forward the request to the candidates in turn and relay the first response that is not a
/// failure another backend could do better than: how the relay ended, or the error to answer
/// with when nothing reached the client; and the model name the last attempt's upstream saw.
/// Each attempt's outcome goes into its backend's health; a retry is charged to the failed
/// backend's retry budget and bounded by `routing.max_attempts`. A target whose provider
/// limits (its cluster's, its credential's) would not take the request now is passed over
/// without being sent anything; `provider` holds the reservation on the limits of the target
/// that was sent the request last (settled by the caller with the usage).
async fn serve<'s>(
    core: PerCore<'s>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &Inspection,
    // Borrowed, not moved in: an argument of an async fn is held twice in its future (as
    // passed, and as the local it becomes), and this one is 544 bytes.
    candidates: &mut Candidates<'s>,
    obs: &mut Observation,
    provider: &mut Permit,
) -> (Result<Relayed, GatewayError>, Option<&'s str>) {
    let settings = &core.snapshot.routing;
    let model = inspection.model.as_str();
    let mut target = candidates.primary();
    let mut attempts = 1;
    // The attempt's token estimate, as admission makes it (computed once, when needed), and
    // the soonest a provider over its limits takes requests again.
    let mut estimate: Option<u64> = None;
    let mut over_limits: Option<u64> = None;
    // An Anthropic-dialect cluster answers chat completions (translated) and Messages
    // (passed through) only.
    let endpoint = Endpoint::from_path(request.head.path(request.buf));
    let translatable = matches!(
        endpoint,
        Some(Endpoint::ChatCompletions | Endpoint::Messages)
    );
    let dialect = request.dialect();
    loop {
        obs.routed = Some((target.cluster_id, target.backend.id));
        if !translatable && matches!(target.cluster.dialect, Dialect::Anthropic(_)) {
            match candidates.next_fallback(model, None) {
                Some(next) => {
                    target = next;
                    continue;
                }
                None => {
                    let message = format!(
                        "`{model}` is served by Anthropic's Messages API here, which answers \
                         /v1/chat/completions only"
                    );
                    return (
                        Err(GatewayError::new(ErrorKind::InvalidRequest, message)),
                        None,
                    );
                }
            }
        }
        // Provider limits: would this target take the request now? When it would not, the
        // next candidate is tried; when none is left, the fast 503 of a route whose every
        // backend is out, with `Retry-After` when the first provider has room again.
        let mut tokens = || {
            *estimate.get_or_insert_with(|| {
                let reserve = &core.snapshot.limits.reserve;
                let prompt = crate::openai::tokens::estimate_tokens(request.body);
                reserve.tokens(prompt, inspection.max_tokens, inspection.n)
            })
        };
        let limits = &core.snapshot.limits;
        let mut reserved =
            admit::reserve_provider(core.limiter, limits, &target, &mut tokens, provider).await;
        if reserved.is_err() {
            // A key pool: the full limit may be this credential's own; another may have room.
            let now = crate::sys::time::mono_ms();
            if let Some(other) = target.with_other_credential(core.health, core.rng, now) {
                let again =
                    admit::reserve_provider(core.limiter, limits, &other, &mut tokens, provider)
                        .await;
                if again.is_ok() {
                    target = other;
                    reserved = again;
                }
            }
        }
        if let Err(retry) = reserved {
            observe::provider_skipped(core.metrics, target.backend.id);
            obs.fallback_reason = "provider_limit";
            over_limits = Some(over_limits.map_or(retry, |r| r.min(retry)));
            match candidates.next_fallback(model, Some("provider_limit")) {
                Some(next) => {
                    target = next;
                    continue;
                }
                None => {
                    let retry = over_limits.unwrap_or(1);
                    return (Err(GatewayError::upstream_unavailable(model, retry)), None);
                }
            }
        }
        // A provider whose limits count tokens settles on what this attempt used.
        if provider.spends_tokens() {
            obs.usage_wanted = true;
        }
        // A half-open backend takes one probe at a time: one that lost the race is passed over.
        // The guard counts the attempt in flight, and records its outcome exactly once.
        let mut attempt = match target.health {
            Some(h) => match h.begin(crate::sys::time::mono_ms(), settings) {
                Some(guard) => Some(guard),
                None => {
                    // Never sent: its provider reservation goes back untouched.
                    core.limiter.borrow_mut().release(provider);
                    match candidates.next_fallback(model, None) {
                        Some(next) => {
                            target = next;
                            continue;
                        }
                        None => return (Err(GatewayError::upstream_unavailable(model, 1)), None),
                    }
                }
            },
            None => None,
        };

        // Forward: the rewritten request out (with stream usage asked for, so limits settle on
        // reported usage), the response head back (one retry on a stale pooled connection). An
        // Anthropic-dialect cluster gets the chat completion as a Messages request; its stream
        // always ends with usage, withheld unless the client asked.
        let mut upstream_request = core.bufs.take();
        let anthropic = match &target.cluster.dialect {
            Dialect::Anthropic(settings) => Some(settings),
            Dialect::OpenAi => None,
        };
        // Where the end of the client's body that goes from where it lies starts (a long one
        // is not copied into the upstream request).
        let mut tail_from = request.body.len();
        let usage_requested = match (dialect, anthropic) {
            (ClientDialect::Anthropic, Some(settings)) => {
                tail_from = forward::build_messages_passthrough(
                    &mut upstream_request,
                    request,
                    inspection,
                    &target,
                    settings,
                );
                false
            }
            (ClientDialect::Anthropic, None) => {
                let built = forward::build_chat_from_messages(
                    &mut upstream_request,
                    request,
                    inspection,
                    &target,
                );
                if let Err(e) = built {
                    // Never sent: the request is the client's to fix, wherever it goes.
                    core.bufs.give(upstream_request);
                    core.limiter.borrow_mut().release(provider);
                    return (Err(e), target.mapped_model);
                }
                false
            }
            (ClientDialect::OpenAi, Some(settings)) => {
                let built = forward::build_anthropic_request(
                    &mut upstream_request,
                    request,
                    inspection,
                    &target,
                    settings,
                );
                if let Err(e) = built {
                    // Never sent: the request is the client's to fix, wherever it goes.
                    core.bufs.give(upstream_request);
                    core.limiter.borrow_mut().release(provider);
                    return (Err(e), target.mapped_model);
                }
                inspection.include_usage != Some(true)
            }
            (ClientDialect::OpenAi, None) => {
                let (from, usage_requested) = forward::build_request(
                    &mut upstream_request,
                    request,
                    inspection,
                    &target,
                    core.snapshot.upstream.request_stream_usage,
                );
                tail_from = from;
                usage_requested
            }
        };
        let tail = request.body.get(tail_from..).unwrap_or_default();
        let (mut sent, timings) = forward::send(
            core.io(),
            &target,
            upstream_request,
            tail,
            inspection.stream,
        )
        .await;
        obs.forward = timings;

        // Fallback: may another backend (or credential) do better? Decided before a byte
        // reaches the client. Reading on to judge (a 429's body, a stream's first event) is
        // worth it only when another backend could take the request.
        let may_retry = || {
            attempts < settings.max_attempts
                && candidates.clone().next_fallback(model, None).is_some()
        };
        let key_pool = target.cluster.credentials.len() > 1;
        let judgement = match &mut sent {
            Err(e) => fallback::judge_error(e),
            Ok(response) => {
                let deadline = crate::sys::clock::recent() + target.first_byte_timeout;
                fallback::judge_response(response, may_retry, key_pool, deadline, core.bufs).await
            }
        };
        // Read again: judging may have waited.
        let now = crate::sys::time::mono_ms();
        if let (Some(attempt), Some(result)) = (attempt.as_mut(), judgement.health) {
            attempt.record(result, now, settings);
        }
        if judgement.retry == Some(fallback::FallbackReason::Credential) {
            // Only the credential is benched: the backend answered.
            if let Some((index, _)) = target.credential {
                let until = now + settings.credential_bench_ms;
                core.health
                    .bench_credential(target.cluster_id, index, until);
            }
        }
        if let Some(reason) = judgement.retry.filter(|_| attempts < settings.max_attempts) {
            let next = match reason {
                fallback::FallbackReason::Credential => {
                    target.with_other_credential(core.health, core.rng, now)
                }
                _ => None,
            }
            .or_else(|| candidates.next_fallback(model, Some(reason.label())));
            // Charged only when there is somewhere to go.
            let next = next.filter(|_| target.health.is_none_or(|h| h.allow_retry(now, settings)));
            if let Some(next) = next {
                observe::failed_attempt(core.metrics, obs, target.backend.id, reason);
                obs.fallbacks += 1;
                obs.fallback_reason = reason.label();
                if let Ok(response) = sent {
                    // Not relayed: the connection's state is unknown, so it is not reused.
                    response.conn.abort();
                }
                // The provider was sent a request that used nothing.
                core.limiter.borrow_mut().settle(provider, 0);
                target = next;
                attempts += 1;
                continue;
            }
        }

        // Relay: the body to the client as it arrives, metered on the side; a usage chunk the
        // client did not ask for is metered but not relayed.
        let response = match sent {
            Ok(response) => response,
            Err(e) => return (Err(e), target.mapped_model),
        };
        if let Some(broken) = judgement.broken {
            // Judging lost the response (a read timed out or failed), and nowhere else to go:
            // answered as the upstream failure it is.
            response.conn.abort();
            return (Err(broken), target.mapped_model);
        }
        // Sticky: the session stays with the backend that answered (a fallback re-pins it),
        // and an affinity cookie names it.
        if let Some((rule, session)) = candidates.sticky {
            keep_session(
                core,
                candidates.route_pattern(),
                rule,
                session,
                &target,
                obs,
            );
        }
        let side = ClientSide {
            head_only: false,
            minor_version: request.head.minor_version,
            keep_alive: request.head.keep_alive,
            strip_usage: usage_requested,
            dialect,
        };
        // An Anthropic answer passed through is metered in Anthropic's terms.
        obs.meter_anthropic(dialect == ClientDialect::Anthropic && anthropic.is_some());
        let client_stream =
            response.head.event_stream && (200..300).contains(&response.head.status);
        let relayed = match (dialect, anthropic) {
            (ClientDialect::Anthropic, Some(_)) => {
                relay::relay(core.io(), client, response, side, obs, None).await
            }
            // An OpenAI-dialect answer for an Anthropic client: metered as the upstream sent
            // it, translated on the way out.
            (ClientDialect::Anthropic, None) if client_stream => {
                let translate = StreamTranslate::to_messages(model);
                relay::relay(core.io(), client, response, side, obs, Some(translate)).await
            }
            (ClientDialect::Anthropic, None) => {
                let translate = |status: u16, body: &[u8], out: &mut Vec<u8>| {
                    if (200..300).contains(&status) {
                        anthropic_client::chat_to_message(body, model, out).map_err(|e| {
                            GatewayError::bad_gateway(
                                UpstreamFault::Protocol,
                                format!("the upstream's answer could not be read: {}", e.message),
                            )
                        })?;
                        Ok(status)
                    } else {
                        Ok(anthropic_client::error_to_anthropic(status, body, out))
                    }
                };
                relay::relay_translated_whole(
                    core.io(),
                    client,
                    response,
                    side,
                    obs,
                    true,
                    translate,
                )
                .await
            }
            // Streamed: translated event by event. Anything else (an answer, an error): read
            // whole and translated.
            (ClientDialect::OpenAi, Some(_)) if client_stream => {
                let translate = StreamTranslate::anthropic(model);
                relay::relay(core.io(), client, response, side, obs, Some(translate)).await
            }
            (ClientDialect::OpenAi, Some(_)) => {
                let translate = |status: u16, body: &[u8], out: &mut Vec<u8>| {
                    if (200..300).contains(&status) {
                        anthropic_upstream::message_to_chat(body, out).map_err(|e| {
                            GatewayError::bad_gateway(
                                UpstreamFault::Protocol,
                                format!(
                                    "the Anthropic upstream's answer could not be read: {}",
                                    e.message
                                ),
                            )
                        })?;
                        Ok(status)
                    } else {
                        Ok(anthropic_upstream::error_to_openai(status, body, out))
                    }
                };
                relay::relay_translated_whole(
                    core.io(),
                    client,
                    response,
                    side,
                    obs,
                    false,
                    translate,
                )
                .await
            }
            (ClientDialect::OpenAi, None) => {
                relay::relay(core.io(), client, response, side, obs, None).await
            }
        };
        if let Some(attempt) = attempt.as_mut().filter(|a| !a.recorded()) {
            let result = match &relayed {
                Ok(r) => match r.end {
                    RelayEnd::UpstreamCut(_) => AttemptResult::Failed,
                    RelayEnd::Complete => AttemptResult::Answered,
                    RelayEnd::ClientLeft | RelayEnd::Shutdown => AttemptResult::Unknown,
                },
                Err(_) => AttemptResult::Failed,
            };
            attempt.record(result, crate::sys::time::mono_ms(), settings);
        }
        return (relayed, target.mapped_model);
    }
}

/// A sticky session's pin and affinity cookie follow the backend that answered: re-pinned when
/// a fallback served it, and a `Set-Cookie` (in the response's extra header lines) unless the
/// request's cookie already names it. Both slide: renewed once less than half their time is
/// left, so an active conversation is never moved just because its pin aged.
fn keep_session(
    core: PerCore<'_>,
    route: &str,
    rule: &crate::config::sticky::StickyRule,
    session: sticky::Session,
    target: &crate::gateway::route::Target<'_>,
    obs: &mut Observation,
) {
    let identity = core.health.identity(target.backend.id);
    let now = crate::sys::time::unix_secs();
    let fresh = |until: u64| until.saturating_sub(now) > rule.ttl_secs / 2;
    obs.sticky_id_hash = session.id.unwrap_or(0);
    if let (Some(id), Some(pins)) = (session.id, core.health.pins()) {
        let current = pins.get_until(id, now);
        if !current.is_some_and(|(backend, until)| backend == identity && fresh(until)) {
            pins.pin(id, identity, now + rule.ttl_secs, now);
        }
    }
    if let Some(name) = &rule.cookie {
        let current = session.cookie_backend;
        if !current.is_some_and(|(backend, until)| backend == identity && fresh(until)) {
            let aad = sticky::aad(name, route);
            let keys = &core.snapshot.sticky_keys;
            if let Some(line) = sticky::seal(keys, name, &aad, identity, rule.ttl_secs, now) {
                obs.rate_headers.push_str(&line);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    //! The pipeline's decisions without a socket: [`authenticate_head`], [`route_request`] and
    //! [`admit_routed`] on a per-core state built
    //! from a config (`context::testing`), with the real limiter shard exchanging with the
    //! in-process ledger through the real sync task.
    use super::*;
    use crate::config::limits::{digest, hex};
    use crate::gateway::context::testing::{request, OwnedCore};
    use crate::limits::ledger::InProcessLedger;

    const KEY: &str = "sk-pipeline-test";

    fn core() -> OwnedCore {
        OwnedCore::new(&format!(
            r#"
            [clusters.main]
            backends = [{{ base_url = "http://127.0.0.1:9/v1", weight = 1 }},
                        {{ base_url = "http://127.0.0.2:9/v1", weight = 1 }}]
            model_map = {{ "gpt-4o" = "gpt-4o-2024-08-06" }}
            [[routes]]
            model = "gpt-*"
            cluster = "main"
            [[routes]]
            model = "o1"
            cluster = "main"
            [[keys]]
            id = "team-key"
            sha256 = "{}"
            models_allow = ["gpt-*", "o1-preview"]
            source_subnets = ["10.0.0.0/8"]
            [[policies]]
            id = "one-rpm"
            per = "key"
            max_requests = 1
            "#,
            hex(&digest(KEY.as_bytes()))
        ))
    }

    fn raw(key: Option<&str>, body: &str) -> Vec<u8> {
        let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n{auth}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    /// The primary target's cluster, backend and mapped model, and how many fallbacks follow.
    #[derive(Debug)]
    struct Chosen {
        cluster: usize,
        backend: usize,
        mapped: Option<String>,
        fallbacks: usize,
    }

    /// What the pipeline decided for one request: the primary target's (cluster, backend,
    /// mapped model) and whether there is a fallback, or the error's (status, code); plus what
    /// the observation and the caller recorded.
    struct Decided {
        result: Result<Chosen, (u16, Option<&'static str>)>,
        routed: Option<(usize, usize)>,
        auth_failure: Option<&'static str>,
        refused: bool,
        error_headers: Option<String>,
        retry_after: Option<u32>,
    }

    fn decide(core: &OwnedCore, raw: &[u8]) -> Decided {
        let head = core.head(raw);
        let request = request(raw, &head);
        let per_core = core.per_core();
        let mut inspection = Inspection::default();
        let mut caller = Caller::default();
        let mut obs = Observation::default();
        let mut runtime = runtime();
        // Authenticated from the head first, as the connection loop does.
        let head_only = Request {
            body: &[],
            ..request
        };
        let decided = match authenticate_head(per_core, &head_only, &mut Default::default()) {
            Ok(authenticated) => {
                caller.principal = authenticated.principal;
                Ok(())
            }
            Err(e) => {
                caller.auth_failed(&e);
                Err(e)
            }
        };
        let decided = decided.and_then(|()| {
            runtime.block_on(async {
                admit_beside_sync(per_core, &request, &mut inspection, &mut caller, &mut obs).await
            })
        });
        let mut retry_after = None;
        let (result, error_headers) = match decided {
            Ok((candidates, admission)) => {
                let primary = candidates.primary();
                let mut walk = candidates.clone();
                let fallbacks = std::iter::from_fn(|| walk.next_fallback("gpt-4o", None)).count();
                admission.settle(per_core.limiter, 10);
                let mapped = primary.mapped_model.map(str::to_string);
                let chosen = Chosen {
                    cluster: primary.cluster_id,
                    backend: primary.backend.id,
                    mapped,
                    fallbacks,
                };
                (Ok(chosen), None)
            }
            Err(e) => {
                let headers = e.extra_headers.as_deref().cloned();
                retry_after = e.retry_after;
                (Err((e.status(), e.code())), headers)
            }
        };
        Decided {
            result,
            routed: obs.routed,
            auth_failure: caller.auth_failure,
            refused: caller.refusal.is_some(),
            error_headers,
            retry_after,
        }
    }

    /// Route, then admit, as [`proxy`] does, with the limiter's sync task (on an in-process
    /// ledger) running beside the admission, as on a worker: it may wait for a lease the sync
    /// brings.
    async fn admit_beside_sync<'s>(
        per_core: PerCore<'s>,
        request: &Request<'_>,
        inspection: &mut Inspection,
        caller: &mut Caller<'s>,
        obs: &mut Observation,
    ) -> Result<(Candidates<'s>, Admission), GatewayError> {
        let sync = crate::limits::run_sync(
            per_core.limiter,
            &per_core.snapshot.limits.sync,
            0,
            |_, _| {},
            InProcessLedger::new(),
            std::future::pending(),
        );
        let candidates = route_request(per_core, request, inspection, caller, obs)?;
        let decide = admit_routed(per_core, request, inspection, caller);
        monoio::select! {
            decided = decide => decided.map(|admission| (candidates, admission)),
            () = sync => unreachable!("the sync task runs for the worker's life"),
        }
    }

    /// A runtime with timers (admission may wait for a lease), no I/O.
    fn runtime() -> monoio::Runtime<monoio::time::TimeDriver<monoio::LegacyDriver>> {
        monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .unwrap()
    }

    const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;

    #[test]
    fn an_admitted_request_gets_its_targets_and_a_reservation_that_counts() {
        let core = core();
        let d = decide(&core, &raw(Some(KEY), CHAT));
        let Chosen {
            cluster,
            backend,
            mapped,
            fallbacks,
        } = d.result.unwrap();
        assert_eq!(cluster, 0);
        assert_eq!(mapped.as_deref(), Some("gpt-4o-2024-08-06"));
        assert_eq!(fallbacks, 1, "the cluster's other backend is the fallback");
        assert_eq!(d.routed, Some((cluster, backend)));
        assert_eq!((d.auth_failure, d.refused), (None, false));

        // The policy allows one request a minute per key: the settled first one counted.
        let d = decide(&core, &raw(Some(KEY), CHAT));
        assert_eq!(d.result.unwrap_err(), (429, Some("rate_limit_exceeded")));
        assert!(d.refused);
        let headers = d.error_headers.unwrap_or_default();
        assert!(
            d.retry_after.is_some_and(|s| (1..=60).contains(&s)),
            "{:?}",
            d.retry_after
        );
        assert!(
            headers.contains("x-ratelimit-limit-requests: 1"),
            "{headers}"
        );
    }

    #[test]
    fn refusals_before_admission_reserve_nothing() {
        let core = core();
        // In the order the pipeline checks: key, body, model permission, route.
        let cases: [(Option<&str>, &str, u16, Option<&str>); 5] = [
            (None, CHAT, 401, Some("missing_api_key")),
            (Some("sk-wrong"), CHAT, 401, Some("invalid_api_key")),
            (Some(KEY), r#"{"model":"gpt-4o","#, 400, None),
            (
                Some(KEY),
                r#"{"model":"claude-3","messages":[]}"#,
                403,
                Some("model_not_allowed"),
            ),
            // Allowed for the key, routed by nobody.
            (
                Some(KEY),
                r#"{"model":"o1-preview","messages":[]}"#,
                404,
                Some("model_not_found"),
            ),
        ];
        for (key, body, status, code) in cases {
            let d = decide(&core, &raw(key, body));
            assert_eq!(d.result.unwrap_err(), (status, code), "{key:?} {body}");
            assert_eq!(d.routed, None, "{body}");
            assert!(!d.refused);
            let auth_failed = matches!(status, 401 | 403);
            assert_eq!(d.auth_failure.is_some(), auth_failed, "{body}");
        }
        // None of them used the key's one request.
        assert!(decide(&core, &raw(Some(KEY), CHAT)).result.is_ok());
    }

    /// The request the primary target of a `/v1/messages` request would be sent.
    fn built_for_messages(core: &OwnedCore, headers: &str, body: &str) -> String {
        let raw = format!(
            "POST /v1/messages HTTP/1.1\r\nHost: gw\r\n{headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let raw = raw.as_bytes();
        let head = core.head(raw);
        let request = request(raw, &head);
        let per_core = core.per_core();
        let mut inspection = Inspection::default();
        let mut caller = Caller::default();
        let mut obs = Observation::default();
        let (candidates, admission) = runtime()
            .block_on(async {
                admit_beside_sync(per_core, &request, &mut inspection, &mut caller, &mut obs).await
            })
            .unwrap();
        let target = candidates.primary();
        let mut out = Vec::new();
        match &target.cluster.dialect {
            Dialect::Anthropic(settings) => {
                let tail_from = forward::build_messages_passthrough(
                    &mut out,
                    &request,
                    &inspection,
                    &target,
                    settings,
                );
                // What the upstream gets: the request, then the body's end it left out.
                out.extend_from_slice(&request.body[tail_from..]);
            }
            Dialect::OpenAi => {
                forward::build_chat_from_messages(&mut out, &request, &inspection, &target)
                    .unwrap();
            }
        }
        admission.settle(per_core.limiter, 0);
        String::from_utf8(out).unwrap()
    }

    fn messages_core() -> OwnedCore {
        OwnedCore::new(
            r#"
            [clusters.claude]
            dialect = "anthropic"
            backends = [{ base_url = "http://127.0.0.1:9/v1" }]
            model_map = { "claude" = "claude-sonnet-4-5" }
            anthropic = { beta = "cluster-beta" }
            [clusters.gpt]
            backends = [{ base_url = "http://127.0.0.1:9/api/v1" }]
            model_map = { "gpt" = "gpt-4o" }
            [[routes]]
            model = "claude*"
            cluster = "claude"
            [[routes]]
            model = "gpt"
            cluster = "gpt"
            "#,
        )
    }

    #[test]
    fn messages_pass_through_to_an_anthropic_cluster_with_only_the_model_changed() {
        let core = messages_core();
        let body = r#"{"model":"claude","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hi"}],"top_k":3}"#;
        let sent = built_for_messages(
            &core,
            "x-api-key: sk-client\r\nanthropic-beta: client-beta\r\nanthropic-version: 2024-01-01\r\n",
            body,
        );
        let (head, upstream_body) = sent.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("POST /v1/messages HTTP/1.1\r\n"), "{head}");
        assert_eq!(
            upstream_body,
            body.replace("\"claude\"", "\"claude-sonnet-4-5\""),
            "byte for byte but the model; no stream_options"
        );
        assert!(
            head.contains(&format!("content-length: {}", upstream_body.len())),
            "{head}"
        );
        assert!(
            !head.contains("sk-client"),
            "the client's key is withheld: {head}"
        );
        assert!(head.contains("anthropic-beta: cluster-beta"), "{head}");
        assert!(!head.contains("client-beta"), "{head}");
        assert!(
            head.contains("anthropic-version: 2024-01-01"),
            "the client's: {head}"
        );
        assert_eq!(head.matches("anthropic-version").count(), 1, "{head}");

        // No version from the client: the cluster's.
        let sent = built_for_messages(&core, "", body);
        assert!(sent.contains("anthropic-version: 2023-06-01\r\n"), "{sent}");
    }

    #[test]
    fn messages_to_an_openai_cluster_become_a_chat_completion_asking_for_usage() {
        let core = messages_core();
        let body = r#"{"model":"gpt","max_tokens":8,"stream":true,"system":"be brief","messages":[{"role":"user","content":"hi"}]}"#;
        let sent = built_for_messages(
            &core,
            "x-api-key: sk-client\r\nanthropic-version: 2023-06-01\r\ncontent-type: application/json\r\n",
            body,
        );
        let (head, upstream_body) = sent.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("POST /api/v1/chat/completions HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(
            !head.contains("sk-client") && !head.contains("anthropic-"),
            "{head}"
        );
        assert_eq!(head.matches("content-type").count(), 1, "{head}");
        let chat: serde_json::Value = serde_json::from_str(upstream_body).unwrap();
        assert_eq!(chat["model"], "gpt-4o");
        assert_eq!(chat["max_tokens"], 8);
        assert_eq!(chat["stream_options"]["include_usage"], true);
        assert_eq!(chat["messages"][0]["role"], "system");
    }

    #[test]
    fn a_messages_request_without_max_tokens_is_refused_before_routing() {
        let core = messages_core();
        let raw = b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nContent-Length: 46\r\n\r\n{\"model\":\"claude\",\"messages\":[],\"stream\":true}";
        let d = decide(&core, raw);
        assert_eq!(d.result.unwrap_err(), (400, None));
        assert_eq!(d.routed, None);
    }

    #[test]
    fn a_source_outside_the_keys_subnets_is_refused() {
        let core = core();
        let raw = raw(Some(KEY), CHAT);
        let head = core.head(&raw);
        let mut request = request(&raw, &head);
        request.peer = Some(([192, 168, 1, 1], 40_000).into());
        let mut inspection = Inspection::default();
        let mut caller = Caller {
            principal: authenticate_head(core.per_core(), &request, &mut Default::default())
                .unwrap()
                .principal,
            ..Caller::default()
        };
        let mut obs = Observation::default();
        // Refused by the route phase (authorize), before any admission.
        let routed = route_request(
            core.per_core(),
            &request,
            &mut inspection,
            &mut caller,
            &mut obs,
        );
        let e = routed.expect_err("refused");
        assert_eq!((e.status(), e.code()), (403, Some("source_not_allowed")));
        assert_eq!(caller.auth_failure, Some("source_not_allowed"));
    }
}
