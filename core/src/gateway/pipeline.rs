//! The life of one proxied request, top to bottom. Each step is one phase module; the order
//! here is the order in `docs/request-lifecycle.md`.
//!
//! Runs for every POST to an OpenAI endpoint, on a [`PerCore`] loan of the worker's state, in
//! two steps: [`authenticate_head`] as soon as the head is in — an unknown, disabled or expired
//! key is refused before a byte of its body is read — and [`proxy`] once the body is in, with
//! the principal the first step found. Each returns the error to answer with when nothing was
//! sent to the client yet (errors after the response started are the relay's to end); `proxy`
//! otherwise returns whether the client connection can be kept.

use crate::config::saturation::Saturation;
use crate::gateway::admit::{Admission, Caller};
use crate::gateway::attempt::{self, Tried, Walk};
use crate::gateway::auth::Principal;
use crate::gateway::context::{PerCore, Request};
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::gateway::record::{Estimator, Observation, Outcome, RelayEnd};
use crate::gateway::relay::{self, Relayed};
use crate::gateway::route::{Candidates, Target};
use crate::gateway::translation::RelayWith;
use crate::gateway::{admit, auth, observe, queue, route, sticky, translation};
use crate::limits::shard::Permit;
use crate::openai::inspect::Inspection;
use crate::sys::client::ClientSocket;
use crate::upstream::board::QueueBoard;

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
    let outcome = obs.outcome(core.snapshot, "", None, &[], estimator, false);
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
    let (result, mapped, admission) =
        match route_request(core, request, inspection, &mut caller, &mut obs) {
            // Every backend is full: admitted like any request, it then waits for room. Waiting
            // — for room under a limit, or for a backend — is a future of its own, boxed: only a
            // request that waits carries it (held in this one, it made every request's state
            // larger, and its copies dearer).
            Err(e) if e.kind == ErrorKind::BackendsFull => {
                let (c, o, p, who) = (client, &mut obs, &mut provider, &mut caller);
                boxed(|| wait_then_serve(core, c, request, inspection, who, o, p, None)).await
            }
            Err(e) => charge_refused(core, &mut caller, &mut obs, e).await,
            Ok(mut candidates) => {
                match admit_first(core, request, inspection, caller.principal).await {
                    // Forward and relay, on the admission's reservation: to the candidates in
                    // turn while a failure leaves the client untouched and another backend may
                    // do better — at once, or once the request's turn in the queue comes.
                    Ok(admission) => {
                        admitted(core, &admission, &mut obs);
                        let on_full = OnFull::Wait(caller.principal);
                        let (c, o, p) = (client, &mut obs, &mut provider);
                        let (served, mapped) =
                            serve(core, c, request, inspection, &mut candidates, o, p, on_full)
                                .await;
                        (served, mapped, Some(admission))
                    }
                    Err(refused) => {
                        let (c, o, p, who) = (client, &mut obs, &mut provider, &mut caller);
                        let after = Some((refused, &mut candidates));
                        boxed(|| wait_then_serve(core, c, request, inspection, who, o, p, after))
                            .await
                    }
                }
            }
        };
    // A slot this request held is free: the worker's best waiters look for room now.
    core.load.queues.slot_freed();
    let ended = Ended {
        mapped,
        admission,
        provider,
    };
    finish(core, request, inspection, obs, &caller, result, ended)
}

/// What a request's serving left to settle: the model name the last attempt's upstream saw,
/// the admission, the provider's reservation.
struct Ended<'s> {
    mapped: Option<&'s str>,
    admission: Option<Admission>,
    provider: Permit,
}

/// The end of every proxied request, whatever happened: observe its outcome, feed its
/// backend's latency, settle its reservations exactly once, emit its metrics and access-log
/// record, and give its observation state back. Returns whether the connection is kept (or the
/// error to answer with, its rate headers added).
fn finish<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    mut obs: Box<Observation>,
    caller: &Caller<'s>,
    mut result: Result<Relayed, GatewayError>,
    ended: Ended<'s>,
) -> Result<bool, GatewayError> {
    let Ended {
        mapped,
        admission,
        mut provider,
    } = ended;
    // Observe: usage, cost and timings of what happened, whatever happened.
    let model = &inspection.model;
    let estimator = Estimator::configured(&core.snapshot.limits, mapped.unwrap_or(model));
    let ok = result.is_ok();
    let outcome = obs.outcome(core.snapshot, model, mapped, request.body, estimator, ok);

    // The backend's latency, for the strategies that weigh it.
    let answered = (200..300).contains(&obs.status) && result.is_ok();
    if answered {
        backend_latency(core, request, &obs, &outcome);
    }

    // Settle: what the request used goes into every budget it reserved from (the admission's
    // and the serving provider's) — exactly once, whatever happened.
    if let Some(admission) = admission {
        settle(core, admission, &mut provider, &outcome);
    }
    if let Err(e) = &mut result {
        if e.extra_headers.is_none() {
            e.add_headers(&obs.rate_headers);
        }
    }

    // Metrics and the access-log record.
    let error = result.as_ref().err();
    observe::emit(
        core.snapshot,
        core.metrics,
        core.log,
        request,
        inspection,
        &obs,
        &outcome,
        error,
        caller,
    );
    give_back(core, obs);
    result.map(|relayed| relayed.keep_alive)
}

/// A request's observation state, and the read buffer it kept, back to the worker's pools.
fn give_back(core: PerCore<'_>, mut obs: Box<Observation>) {
    if let Some(read) = obs.take_kept_read() {
        core.bufs.give(read);
    }
    core.observations.give(obs);
}

/// Settle a request's reservations on what it is billed (the outcome's usage: see
/// [`record`](crate::gateway::record)'s billing rule, which the log and the metrics record
/// too): the admission (consumed: exactly once) and the limits of the provider that served,
/// if any. Nothing billed: the reservations are released.
fn settle(core: PerCore<'_>, admission: Admission, provider: &mut Permit, outcome: &Outcome) {
    let tokens = outcome.billed_tokens();
    admission.settle(core.limiter, tokens);
    core.limiter.borrow_mut().settle(provider, tokens);
}

/// An answered request's latency into its backend's load signals: the time to the first token
/// of a stream (its head comes at once, before the model has done anything), else to the
/// response head (which, unstreamed, comes with the whole answer). Measured from the last
/// attempt's start (the time lost on backends before it is not this one's); only answers are
/// measured (a fast error says nothing of how fast the model is).
fn backend_latency(core: PerCore<'_>, request: &Request<'_>, obs: &Observation, outcome: &Outcome) {
    let health = obs.routed.and_then(|(_, b)| core.health.get(b));
    let (Some(health), Some(started)) = (health, obs.forward.started_at) else {
        return;
    };
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
    translation::read_client_request(request, inspection)?;

    // Authorize: may this key use this model, from this address.
    auth::authorize(principal, &inspection.model, request.peer.map(|p| p.ip()))
        .inspect_err(|e| caller.auth_failed(e))?;

    // Route: the targets to try in order — cluster, backend and the model name the upstream
    // sees — among the backends available now (a fast 503 when none is; `backends_full` when
    // they are only full, and the request may wait).
    let candidates = candidates(core, request, inspection, principal)?;
    let primary = candidates.primary();
    obs.routed = Some((primary.cluster_id, primary.backend.id));
    // Requests already wait for these backends: this one takes its turn behind them rather
    // than a slot that frees under them.
    if others_wait(core, &candidates) {
        return Err(GatewayError::saturated());
    }
    Ok(candidates)
}

/// The route phase for an inspected, authorized request: its [`Candidates`], or the error.
#[inline]
fn candidates<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    principal: Option<Principal<'s>>,
) -> Result<Candidates<'s>, GatewayError> {
    // For a target's context window: the admission's own prompt estimate plus the cap.
    let needed_tokens = || {
        crate::openai::tokens::estimate_tokens(request.body)
            .saturating_add(inspection.max_tokens.unwrap_or(0))
    };
    // For a sticky route: the session id, the affinity cookie and the prompt prefix's hash.
    let session_of = |rule: &crate::config::sticky::StickyRule, route: &str| {
        sticky::session(
            rule,
            route,
            &core.snapshot.sticky_keys,
            request,
            inspection,
            crate::sys::time::unix_secs(),
        )
    };
    route::route(
        core.snapshot,
        core.health,
        &inspection.model,
        principal.map(|p| (p.index, p.key.entity)),
        &needed_tokens,
        &session_of,
        core.rng,
    )
}

/// With `[saturation]`: requests already wait for the route's backends somewhere in the
/// process, so a new one takes its turn in the queue rather than a slot that frees under them.
fn others_wait(core: PerCore<'_>, candidates: &Candidates<'_>) -> bool {
    core.snapshot.saturation.is_some()
        && core
            .health
            .board()
            .and_then(|b| b.route(candidates.route_index))
            .is_some_and(|r| r.best() != crate::upstream::board::NOBODY)
}

/// Wait in the route's queue for room, then serve as [`serve`] does: see
/// [`queue`](crate::gateway::queue). The request is answered `backends_full` when it may not
/// wait (a wait of 0), and the queue's own errors when the wait ends without a turn.
async fn queued<'s>(
    core: PerCore<'s>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &Inspection,
    principal: Option<Principal<'s>>,
    obs: &mut Observation,
    provider: &mut Permit,
) -> (Result<Relayed, GatewayError>, Option<&'s str>) {
    let (ask, saturation, board) = match wait_ask(core, request, inspection, principal) {
        Ok(Some(ask)) => ask,
        Ok(None) => return (Err(GatewayError::saturated()), None),
        Err(e) => return (Err(e), None),
    };
    obs.queue_class = Some(ask.class);
    let addr = std::ptr::from_ref(board) as usize;
    let route = board.route(ask.route);
    let Some(route) = route else {
        return (Err(GatewayError::saturated()), None);
    };
    let queues = &core.load.queues;
    let joined = queue::join(queues, route, addr, queues.worker(), saturation, &ask);
    let mut place = match joined {
        Ok(place) => place,
        Err(e) => {
            obs.queue_outcome = queue::refusal_outcome(&e);
            return (Err(e), None);
        }
    };
    loop {
        let turn = place.turn(client, &|| core.drain.draining()).await;
        obs.waited(place.joined_at, place.outcome());
        if let Err(why) = turn {
            return (Err(place.error(why)), None);
        }
        let mut candidates = match candidates(core, request, inspection, principal) {
            Ok(c) => c,
            Err(e) if e.kind == ErrorKind::BackendsFull => {
                place.missed();
                continue;
            }
            Err(e) => return (Err(e), None),
        };
        place.step_out();
        let primary = candidates.primary();
        obs.routed = Some((primary.cluster_id, primary.backend.id));
        let served = serve(
            core,
            client,
            request,
            inspection,
            &mut candidates,
            obs,
            provider,
            OnFull::Answer,
        )
        .await;
        match served {
            // Another worker's request took the last place first: back in line, rank kept.
            (Err(e), _) if e.kind == ErrorKind::BackendsFull => place.step_back(),
            served => return served,
        }
    }
}

/// What a request waits with — its class (its key's, else its entity's, else its route's, else
/// the default; a header may lower it), its longest wait (the class's; a header may shorten
/// it), its key's flow and weight and its cost — with the `[saturation]` settings and the board. `None`: it
/// may not wait (0 ms). A header naming no class, or a wait that is not a number, is a 400.
#[allow(clippy::type_complexity)] // the ask and the two things it was read against
fn wait_ask<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    principal: Option<Principal<'s>>,
) -> Result<Option<(queue::Ask, &'s Saturation, &'s QueueBoard)>, GatewayError> {
    let model = inspection.model.as_str();
    let (Some(saturation), Some(board)) =
        (core.snapshot.saturation.as_deref(), core.health.board())
    else {
        return Err(GatewayError::saturated());
    };
    let key = principal.map(|p| p.index);
    let route = route::route_index(
        core.snapshot,
        model,
        principal.map(|p| (p.index, p.key.entity)),
    )?;
    let entity = principal.and_then(|p| p.key.entity);
    let mut class = saturation.class_of(key, entity, route);
    if let Some(name) = sticky::header(request, &saturation.priority_header) {
        let asked = saturation.class_named(name).ok_or_else(|| {
            GatewayError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "The {} header names no priority class this gateway has.",
                    saturation.priority_header
                ),
            )
        })?;
        // Lower only: a client cannot raise its own class.
        class = class.max(asked);
    }
    let class_wait = saturation
        .classes
        .get(usize::from(class))
        .map(|c| c.max_wait);
    let mut max_wait = class_wait.unwrap_or_default();
    if let Some(ms) = sticky::header(request, &saturation.max_wait_header) {
        let ms: u64 = ms.parse().map_err(|_| {
            GatewayError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "The {} header is a whole number of milliseconds.",
                    saturation.max_wait_header
                ),
            )
        })?;
        max_wait = max_wait.min(std::time::Duration::from_millis(ms));
    }
    if max_wait.is_zero() {
        return Ok(None);
    }
    let cost = if saturation.fair_by_tokens {
        crate::openai::tokens::estimate_tokens(request.body)
            .saturating_add(inspection.max_tokens.unwrap_or(0))
    } else {
        1
    };
    let ask = queue::Ask {
        route,
        class,
        flow: board.flow(key),
        weight: key.map_or(1, |k| saturation.key_weight.get(k).copied().unwrap_or(1)),
        cost,
        max_wait,
    };
    Ok(Some((ask, saturation, board)))
}

/// What [`serve`] does when every candidate turns out full as it claims one.
#[derive(Clone, Copy)]
enum OnFull<'s> {
    /// Wait in the route's queue ([`queued`]), as this principal.
    Wait(Option<Principal<'s>>),
    /// Answer `backends_full`: the caller is the queue, and waits on itself.
    Answer,
}

/// [`queued`] as a boxed trait object: [`serve`] awaits it and it awaits `serve`, so one of
/// the two must not hold the other's future in its own.
#[allow(clippy::type_complexity)] // the future's output is serve's
fn queued_dyn<'a, 's: 'a>(
    core: PerCore<'s>,
    client: &'a mut ClientSocket,
    request: &'a Request<'a>,
    inspection: &'a Inspection,
    principal: Option<Principal<'s>>,
    obs: &'a mut Observation,
    provider: &'a mut Permit,
) -> std::pin::Pin<
    Box<dyn std::future::Future<Output = (Result<Relayed, GatewayError>, Option<&'s str>)> + 'a>,
> {
    Box::pin(queued(
        core, client, request, inspection, principal, obs, provider,
    ))
}

/// The future `make` makes, on the heap. Made here, not in the caller: a future built in an
/// async fn's body is a local of it, and the compiler keeps room for it in that fn's own future
/// (and copies it) even when it is only moved into a box.
fn boxed<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::pin(make())
}

/// An admitted request's rate headers go into its answer, and its answer's usage is read only
/// for something that uses it (a provider's token limits may still ask, in `serve`).
fn admitted(core: PerCore<'_>, admission: &Admission, obs: &mut Observation) {
    admission.rate_headers().write(&mut obs.rate_headers);
    obs.usage_wanted = core.snapshot.usage_observed() || admission.spends_tokens();
}

/// The rest of a request that waits — for room under an `on_limit = "queue"` policy
/// ([`admit_waiting`]), for a backend with room ([`queued`]), or both — as [`serve`] would have
/// served it: admitted (`refused`: its first admission's refusal, with the candidates routing
/// found; `None`: every backend was full, and it is admitted here), then sent at once when its
/// candidates have room and nobody waits for them, else queued. Returns what [`proxy`]'s
/// serving does: the result, the model the upstream saw, the admission to settle.
#[allow(clippy::too_many_arguments)] // proxy's serving, each argument as it passes them
async fn wait_then_serve<'s>(
    core: PerCore<'s>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &Inspection,
    caller: &mut Caller<'s>,
    obs: &mut Observation,
    provider: &mut Permit,
    refused: Option<(admit::Rejection, &mut Candidates<'s>)>,
) -> (
    Result<Relayed, GatewayError>,
    Option<&'s str>,
    Option<Admission>,
) {
    let (refusal, candidates) = match refused {
        Some((rejection, candidates)) => (Some(rejection), Some(candidates)),
        None => (None, None),
    };
    let first = match refusal {
        Some(rejection) => Err(rejection),
        None => admit_first(core, request, inspection, caller.principal).await,
    };
    let admission = match first {
        Ok(admission) => admission,
        Err(rejection) => {
            match admit_waiting(core, client, request, inspection, caller, obs, rejection).await {
                Ok(admission) => admission,
                Err(e) => return (Err(e), None, None),
            }
        }
    };
    admitted(core, &admission, obs);
    let served = match candidates {
        Some(candidates) if !others_wait(core, candidates) => {
            let on_full = OnFull::Answer;
            serve(
                core, client, request, inspection, candidates, obs, provider, on_full,
            )
            .await
        }
        _ => (Err(GatewayError::saturated()), None),
    };
    let (served, mapped) = match served {
        (Err(e), _) if e.kind == ErrorKind::BackendsFull => {
            let who = caller.principal;
            queued(core, client, request, inspection, who, obs, provider).await
        }
        served => served,
    };
    (served, mapped, Some(admission))
}

/// Admit a routed request: a reservation under every policy and quota plan that applies (waits
/// at most one sync for a lease), or the refusal to answer with (nothing was sent upstream).
/// What [`admit_waiting`] does first; without the wait an `on_limit = "queue"` policy adds (the
/// unit tests' and the benchmark fixture's way in).
#[cfg(any(test, feature = "bench"))]
pub(crate) async fn admit_routed<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    caller: &mut Caller<'s>,
) -> Result<Admission, GatewayError> {
    let admitted = admit_first(core, request, inspection, caller.principal).await;
    admitted.map_err(|rejection| limit_error(core, caller, rejection))
}

/// The first admission of a request (see [`admit_routed`]).
async fn admit_first<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    principal: Option<Principal<'s>>,
) -> Result<Admission, admit::Rejection> {
    let limits = &*core.snapshot.limits;
    admit::admit(
        core.limiter,
        core.metrics,
        limits,
        principal,
        inspection,
        request.body,
        true,
    )
    .await
}

/// After [`admit_first`] refused: the refusal's answer, or — when an `on_limit = "queue"` policy
/// refused — a wait for room ([`queue::limit`]) with admission tried again, up to the wait.
/// Answers the policy's 429 with code `rate_limit_queue_timeout` when the wait ends without
/// room, 499 when the client leaves, 503 when the worker stops.
async fn admit_waiting<'s>(
    core: PerCore<'s>,
    client: &ClientSocket,
    request: &Request<'_>,
    inspection: &Inspection,
    caller: &mut Caller<'s>,
    obs: &mut Observation,
    refused: admit::Rejection,
) -> Result<Admission, GatewayError> {
    let (limits, body, principal) = (&*core.snapshot.limits, request.body, caller.principal);
    let mut last = refused;
    let Some(mut place) = limit_place(core, request, inspection, principal, &last)? else {
        return Err(limit_error(core, caller, last));
    };
    loop {
        let turn = place.turn(client, &|| core.drain.draining()).await;
        obs.waited(place.joined_at, place.outcome());
        if let Err(why) = turn {
            return Err(match why {
                // The policy's 429, rate headers and all, as the wait's own kind.
                queue::WaitEnd::Expired => GatewayError {
                    kind: ErrorKind::LimitWaitTimeout,
                    ..limit_error(core, caller, last)
                },
                _ => why.left_error(),
            });
        }
        let again = admit::admit(
            core.limiter,
            core.metrics,
            limits,
            principal,
            inspection,
            body,
            false,
        );
        match again.await {
            Ok(admission) => {
                place.admitted();
                return Ok(admission);
            }
            Err(rejection) if queue_wait(limits, &rejection).is_some() => {
                last = rejection;
                place.missed();
            }
            Err(rejection) => return Err(limit_error(core, caller, rejection)),
        }
    }
}

/// The `on_limit = "queue"` wait of the policy that refused, if it has one.
fn queue_wait(
    limits: &crate::config::limits::LimitsConfig,
    rejection: &admit::Rejection,
) -> Option<std::time::Duration> {
    limits.policies.get(rejection.refusal.policy?)?.queue_wait
}

/// A place among the requests waiting for room under the policy that refused (`None`: it is
/// not an `on_limit = "queue"` policy, the request may not wait, or the worker's queues are
/// full — answered as the policy would). A priority header naming no class is a 400.
fn limit_place<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &Inspection,
    principal: Option<Principal<'s>>,
    rejection: &admit::Rejection,
) -> Result<Option<queue::limit::LimitPlace<'s>>, GatewayError> {
    let limits = &*core.snapshot.limits;
    let (Some(policy), Some(wait)) = (rejection.refusal.policy, queue_wait(limits, rejection))
    else {
        return Ok(None);
    };
    let Some((ask, saturation, board)) = wait_ask(core, request, inspection, principal)? else {
        return Ok(None);
    };
    use crate::config::limits::Per;
    let Some(per) = limits.policies.get(policy).map(|p| p.per) else {
        return Ok(None);
    };
    let subject = match per {
        Per::Global => 0,
        Per::Key => principal.map_or(0, |p| p.index as u64 + 1),
        Per::Entity => principal
            .and_then(|p| p.key.entity)
            .map_or(0, |e| e as u64 + 1),
        Per::Model => crate::upstream::health::identity_hash(&inspection.model),
    };
    let stats = board.route(ask.route).map(|r| &*r.stats);
    let max_queued = saturation.max_queued_per_worker;
    let max_wait = ask.max_wait.min(wait);
    let place = queue::limit::join(
        &core.load.queues,
        stats,
        max_queued,
        (policy, subject),
        ask.class,
        max_wait,
    );
    Ok(place)
}

/// The answer to a request its limits refused: the limit's error with its rate headers, and
/// the refusal counted for the caller.
fn limit_error<'s>(
    core: PerCore<'s>,
    caller: &mut Caller<'s>,
    rejection: admit::Rejection,
) -> GatewayError {
    let mut error = admit::refusal_error(&core.snapshot.limits, &rejection.refusal);
    caller.refused(core.metrics, rejection.refusal);
    let mut lines = String::new();
    rejection.headers.write(&mut lines);
    error.add_headers(&lines);
    error
}

/// A request refused before admission for the client's own fault (`refused`, a 4xx) still
/// counts against the limits of a caller with a key ([`admit::charge_refused`]); a refusal that
/// is Sluice's or the backends' (no backend up: 503) does not. The error to answer with —
/// `refused`, or the limit's 429 once the key has none left — no model, and the admission to
/// settle, its rate headers in `obs`.
async fn charge_refused<'s>(
    core: PerCore<'s>,
    caller: &mut Caller<'s>,
    obs: &mut Observation,
    refused: GatewayError,
) -> (
    Result<Relayed, GatewayError>,
    Option<&'s str>,
    Option<Admission>,
) {
    let Some(principal) = caller.principal.filter(|_| refused.status() < 500) else {
        return (Err(refused), None, None);
    };
    let limits = &*core.snapshot.limits;
    match admit::charge_refused(core.limiter, core.metrics, limits, principal).await {
        Ok(admission) => {
            admission.rate_headers().write(&mut obs.rate_headers);
            (Err(refused), None, Some(admission))
        }
        Err(rejection) => (Err(limit_error(core, caller, rejection)), None, None),
    }
}

/// Forward the request to the candidates in turn and relay the first response that is not a
/// failure another backend could do better than: how the relay ended, or the error to answer
/// with when nothing reached the client; and the model name the last attempt's upstream saw.
/// Each try is one [`attempt`]; a retry is charged to the failed backend's retry budget and
/// bounded by `routing.max_attempts`. `provider` holds the reservation on the limits of the
/// target that was sent the request last (settled by the caller with the usage). `on_full`: what
/// happens when every candidate turns out full as the request claims one.
#[allow(clippy::too_many_arguments)] // the request's parts and where its outcome goes, as proxy has them
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
    on_full: OnFull<'s>,
) -> (Result<Relayed, GatewayError>, Option<&'s str>) {
    let model = inspection.model.as_str();
    let mut walk = Walk::default();
    let mut target = candidates.primary();
    // The walk: an attempt per target until one is to be relayed. A `loop` that breaks with
    // the response, so the attempt's values are gone before the relay's await (in the same
    // scope they would stay in this future, beside the relay's).
    let (relaying, mapped) = loop {
        obs.routed = Some((target.cluster_id, target.backend.id));
        let tried = attempt::send(
            core, client, request, inspection, target, candidates, &mut walk, obs, provider,
        )
        .await;
        let sent = match tried {
            Tried::Sent(sent) => sent,
            Tried::PassedOver { reason, last } => match candidates.next_fallback(model, reason) {
                Some(next) => {
                    target = next;
                    continue;
                }
                // Every candidate full — another worker's request took the last place between
                // routing and the claim — the request waits its turn, when it may.
                None => match on_full {
                    OnFull::Wait(who) if last.kind == ErrorKind::BackendsFull => {
                        let waits =
                            queued_dyn(core, client, request, inspection, who, obs, provider);
                        return waits.await;
                    }
                    _ => return (Err(last), None),
                },
            },
            Tried::Refused(e) => return (Err(e), target.mapped_model),
        };
        // A client that left while the attempt waited for its answer cut it (its upstream
        // connection closed): nothing is written to it, and it is logged as 499.
        if sent.client_left() {
            let mapped = sent.target.mapped_model;
            sent.cut();
            obs.end = Some(RelayEnd::ClientLeft);
            obs.finished_at = Some(crate::sys::clock::Mono::now());
            let left = Relayed {
                keep_alive: false,
                end: RelayEnd::ClientLeft,
            };
            return (Ok(left), mapped);
        }
        if let Some((next, reason)) = walk.retry_target(core, &sent, candidates, model) {
            sent.abandon(core, obs, provider, reason);
            target = next;
            walk.attempts += 1;
            continue;
        }
        let mapped = sent.target.mapped_model;
        // Sticky: the session stays with the backend that answered (a fallback re-pins it),
        // and an affinity cookie names it.
        let sticky = candidates.sticky;
        let route = candidates.route_pattern();
        // Over TLS the cookie is `Secure`: a client never sends it back in the clear.
        let secure = client.is_tls();
        let keep = |target: &Target<'s>, obs: &mut Observation| {
            if let Some((rule, session)) = sticky {
                keep_session(core, route, rule, session, target, secure, obs);
            }
        };
        match sent.into_relay(request, obs, model, keep) {
            Ok(relaying) => break (relaying, mapped),
            Err(e) => return (Err(e), mapped),
        }
    };
    // Relay: the body to the client as it arrives (an event stream translated event by event
    // where the dialects differ), or read whole and translated. Awaited here, not in a helper:
    // each future wrapped around the relay's is one more copy of it per request.
    let io = core.io();
    let side = relaying.side;
    let relayed = match relaying.with {
        RelayWith::AsItArrives(events) => {
            relay::relay(io, client, relaying.response, side, obs, events).await
        }
        RelayWith::Whole(whole) => {
            let translate =
                |status, body: &[u8], out: &mut Vec<u8>| whole.translate(status, body, out);
            let meter = whole.meter_upstream();
            let response = relaying.response;
            relay::relay_translated_whole(io, client, response, side, obs, meter, translate).await
        }
    };
    relaying.guard.relayed(core, &relayed);
    (relayed, mapped)
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
    target: &Target<'_>,
    secure: bool,
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
            if let Some(line) = sticky::seal(keys, name, &aad, identity, rule.ttl_secs, now, secure)
            {
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
    use crate::gateway::translation::Translation;
    use crate::limits::ledger::InProcessLedger;
    use crate::openai::endpoint::Endpoint;

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
        let translation = Translation::plan(Some(Endpoint::Messages), target.cluster, true)
            .expect("either dialect answers Messages");
        let built = translation
            .build(&mut out, per_core, &request, &inspection, &target)
            .unwrap();
        // What the upstream gets: the request, then the body's end it left out.
        out.extend_from_slice(&request.body[built.tail_from..]);
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
