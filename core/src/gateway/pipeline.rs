//! The life of one proxied request, top to bottom. Each step is one phase module; the order
//! here is the order in `docs/request-lifecycle.md`.
//!
//! Runs for every POST to an OpenAI endpoint, after the connection loop has read the head and
//! body, on a [`PerCore`] loan of the worker's state. Returns whether the client connection can
//! be kept, or the error to answer with when nothing was sent to the client yet (errors after
//! the response started are the relay's to end).

use crate::gateway::admit::{Admission, Caller};
use crate::gateway::context::{ClientSocket, PerCore, Request};
use crate::gateway::error::GatewayError;
use crate::gateway::observe::{Estimator, Observation};
use crate::gateway::relay::{ClientSide, Relayed};
use crate::gateway::route::Target;
use crate::gateway::{admit, auth, forward, observe, relay, route};
use crate::openai::inspect::Inspection;

pub async fn proxy(
    core: PerCore<'_>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &mut Inspection,
) -> Result<bool, GatewayError> {
    let mut obs = core.observations.take();
    obs.start(
        request.received_at,
        (request.head.head_len + request.body.len()) as u64,
    );
    let mut caller = Caller::default();

    // Authenticate, inspect, authorize, route, admit: decided before anything goes upstream.
    let admitted = admit_request(core, request, inspection, &mut caller, &mut obs).await;

    // Forward and relay, on the admission's reservation.
    let (mut result, mapped, admission) = match admitted {
        Ok((target, admission)) => {
            admission.rate_headers().write(&mut obs.rate_headers);
            let served = serve(core, client, request, inspection, &target, &mut obs).await;
            (served, target.mapped_model, Some(admission))
        }
        Err(e) => (Err(e), None, None),
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

    // Settle: what the request used goes into every budget it reserved from — success,
    // upstream error (released), client or upstream abort (billed). Settling consumes the
    // admission: exactly once.
    if let Some(admission) = admission {
        let status = result.as_ref().map_or(0, |_| obs.status);
        let tokens = admit::billable_tokens(status, obs.end, &outcome);
        admission.settle(core.limiter, tokens);
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
    core.observations.give(obs);
    result.map(|relayed| relayed.keep_alive)
}

/// Authenticate, inspect, authorize, route and admit: the target to send to and the admission
/// to settle, or the error to answer with (nothing was sent upstream).
async fn admit_request<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    inspection: &mut Inspection,
    caller: &mut Caller<'s>,
    obs: &mut Observation,
) -> Result<(Target<'s>, Admission), GatewayError> {
    let limits = &*core.snapshot.limits;

    // Authenticate: which key is calling — before any JSON work is spent on the body.
    let principal = auth::authenticate(limits, request).inspect_err(|e| caller.auth_failed(e))?;
    caller.principal = principal;

    // Inspect: the top-level model and friends, exactly as the upstream will read them.
    core.inspector
        .borrow_mut()
        .inspect(request.body, inspection)?;

    // Authorize: may this key use this model, from this address.
    auth::authorize(principal, &inspection.model, request.peer.map(|p| p.ip()))
        .inspect_err(|e| caller.auth_failed(e))?;

    // Route: cluster, backend and the model name the upstream sees.
    let target = route::route(core.snapshot, &inspection.model, core.rng)?;
    obs.routed = Some((target.cluster_id, target.backend.id));

    // Admit: a reservation under every policy and quota plan that applies (waits at most one
    // sync for a lease).
    let admitted = admit::admit(
        core.limiter,
        core.metrics,
        limits,
        principal,
        inspection,
        request.body,
    )
    .await;
    match admitted {
        Ok(admission) => Ok((target, admission)),
        Err(rejection) => {
            let mut error = admit::refusal_error(limits, &rejection.refusal);
            caller.refused(core.metrics, limits, rejection.refusal);
            let mut lines = String::new();
            rejection.headers.write(&mut lines);
            error.add_headers(&lines);
            Err(error)
        }
    }
}

/// Forward the request to `target` and relay the response: how the relay ended, or the error
/// to answer with when nothing reached the client.
async fn serve(
    core: PerCore<'_>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &Inspection,
    target: &Target<'_>,
    obs: &mut Observation,
) -> Result<Relayed, GatewayError> {
    // Forward: the rewritten request out (with stream usage asked for, so limits settle on
    // reported usage), the response head back (one retry on a stale pooled connection).
    let mut upstream_request = core.bufs.take();
    let usage_requested = forward::build_request(
        &mut upstream_request,
        request,
        inspection,
        target,
        core.snapshot.upstream.request_stream_usage,
    );
    let response = forward::send(core.io(), target, upstream_request, obs).await?;

    // Relay: the body to the client as it arrives, metered on the side; a usage chunk the
    // client did not ask for is metered but not relayed.
    let side = ClientSide {
        head_only: false,
        minor_version: request.head.minor_version,
        keep_alive: request.head.keep_alive,
        strip_usage: usage_requested,
    };
    relay::relay(core.io(), client, response, side, obs).await
}
