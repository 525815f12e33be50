//! The life of one proxied request, top to bottom. Each step is one phase module; the order
//! here is the order in `docs/request-lifecycle.md`.
//!
//! Runs for every POST to an OpenAI endpoint, after the connection loop has read the head and
//! body. Returns whether the client connection can be kept, or the error to answer with when
//! nothing was sent to the client yet (errors after the response started are the relay's).

use crate::gateway::admit::Caller;
use crate::gateway::context::{ClientSocket, PerCore, Request};
use crate::gateway::error::GatewayError;
use crate::gateway::observe::{Estimator, Observation};
use crate::gateway::relay::ClientSide;
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
    let mut result = proxy_observed(core, client, request, inspection, &mut obs, &mut caller).await;

    // Observe: usage, cost and timings of what happened, whatever happened.
    let mapped = result.as_ref().ok().and_then(|(_, mapped)| *mapped);
    let estimator =
        Estimator::configured(&core.snapshot.limits, mapped.unwrap_or(&inspection.model));
    let outcome = obs.outcome(
        core.snapshot,
        &inspection.model,
        mapped,
        request.body,
        estimator,
    );

    // Settle: what the request used goes into every budget it reserved from, exactly once —
    // success, upstream error (released), client or upstream abort (billed).
    if caller.admitted {
        let status = result.as_ref().map_or(0, |_| obs.status);
        admit::settle(
            core.limiter,
            &mut caller.permit,
            admit::billable_tokens(status, &outcome),
        );
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
    result.map(|(keep_alive, _)| keep_alive)
}

/// The phases proper. Returns whether the client connection can be kept, and the mapped model.
async fn proxy_observed<'s>(
    core: PerCore<'s>,
    client: &mut ClientSocket,
    request: &Request<'_>,
    inspection: &mut Inspection,
    obs: &mut Observation,
    caller: &mut Caller,
) -> Result<(bool, Option<&'s str>), GatewayError> {
    let limits = &*core.snapshot.limits;

    // Authenticate: which key is calling — before any JSON work is spent on the body.
    caller.key = auth::authenticate(limits, request).inspect_err(|e| caller.auth_failed(e))?;

    // Inspect: the top-level model and friends, exactly as the upstream will read them.
    core.inspector
        .borrow_mut()
        .inspect(request.body, inspection)?;

    // Authorize: may this key use this model, from this address.
    auth::authorize(
        limits,
        caller.key,
        &inspection.model,
        request.peer.map(|p| p.ip()),
    )
    .inspect_err(|e| caller.auth_failed(e))?;

    // Route: cluster, backend and the model name the upstream sees.
    let target = route::route(core.snapshot, &inspection.model, core.rng)?;
    obs.routed = Some((target.cluster_id, target.backend.id));

    // Admit: a reservation under every policy and quota plan that applies (waits at most one
    // sync for a lease).
    if let Err(refusal) = admit::admit(
        core.limiter,
        core.metrics,
        limits,
        caller.key,
        inspection,
        request.body,
        &mut caller.permit,
    )
    .await
    {
        let mut error = admit::refusal_error(limits, &refusal);
        caller.refused(core.metrics, limits, refusal);
        let mut lines = String::new();
        caller.permit.headers.write(&mut lines);
        error.add_headers(&lines);
        return Err(error);
    }
    caller.admitted = true;
    caller.permit.headers.write(&mut obs.rate_headers);

    // Forward: the rewritten request out (with stream usage asked for, so limits settle on
    // reported usage), the response head back (one retry on a stale pooled connection).
    let mut upstream_request = core.bufs.take();
    let usage_requested = forward::build_request(
        &mut upstream_request,
        request,
        inspection,
        &target,
        core.snapshot.upstream.request_stream_usage,
    );
    let response = forward::send(core.io(), &target, upstream_request, obs).await?;

    // Relay: the body to the client as it arrives, metered on the side; a usage chunk the
    // client did not ask for is metered but not relayed.
    let side = ClientSide {
        head_only: false,
        minor_version: request.head.minor_version,
        keep_alive: request.head.keep_alive,
        strip_usage: usage_requested,
    };
    let keep_alive = relay::relay(core.io(), client, response, side, obs).await?;
    Ok((keep_alive, target.mapped_model))
}
