//! The life of one proxied request, top to bottom. Each step is one phase module; the order
//! here is the order in `docs/request-lifecycle.md`.
//!
//! Runs for every POST to an OpenAI endpoint, after the connection loop has read the head and
//! body. Returns whether the client connection can be kept, or the error to answer with when
//! nothing was sent to the client yet (errors after the response started are the relay's).

use crate::admit::Caller;
use crate::conn::{ClientSocket, Request};
use crate::error::GatewayError;
use crate::inspect::Inspection;
use crate::observe::{Estimator, Observation};
use crate::relay::ClientSide;
use crate::worker::Worker;
use crate::{admit, auth, forward, observe, relay, route};

pub async fn proxy(
    worker: &Worker,
    client: &ClientSocket,
    request: &Request<'_>,
    inspection: &mut Inspection,
) -> Result<bool, GatewayError> {
    let mut obs = worker.take_observation();
    obs.start(
        request.received_at,
        (request.head.head_len + request.body.len()) as u64,
    );
    let mut caller = Caller::default();
    let mut result =
        proxy_observed(worker, client, request, inspection, &mut obs, &mut caller).await;

    // Observe: usage, cost and timings of what happened, whatever happened.
    let mapped = result.as_ref().ok().and_then(|(_, mapped)| *mapped);
    let estimator =
        Estimator::configured(&worker.snapshot.limits, mapped.unwrap_or(&inspection.model));
    let outcome = obs.outcome(
        &worker.snapshot,
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
            worker,
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
        worker,
        request,
        inspection,
        &obs,
        &outcome,
        result.as_ref().err(),
        &caller,
    );
    worker.give_observation(obs);
    result.map(|(keep_alive, _)| keep_alive)
}

/// The phases proper. Returns whether the client connection can be kept, and the mapped model.
async fn proxy_observed<'s>(
    worker: &'s Worker,
    client: &ClientSocket,
    request: &Request<'_>,
    inspection: &mut Inspection,
    obs: &mut Observation,
    caller: &mut Caller,
) -> Result<(bool, Option<&'s str>), GatewayError> {
    let limits = &*worker.snapshot.limits;

    // Authenticate: which key is calling — before any JSON work is spent on the body.
    caller.key = auth::authenticate(limits, request).inspect_err(|e| caller.auth_failed(e))?;

    // Inspect: the top-level model and friends, exactly as the upstream will read them.
    worker
        .inspector
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
    let target = route::route(&worker.snapshot, &inspection.model, &worker.rng)?;
    obs.routed = Some((target.cluster_id, target.backend.id));

    // Admit: a reservation under every policy and quota plan that applies (waits at most one
    // sync for a lease).
    if let Err(refusal) = admit::admit(
        worker,
        caller.key,
        inspection,
        request.body,
        &mut caller.permit,
    )
    .await
    {
        let mut error = admit::refusal_error(worker, &refusal);
        caller.refused(worker, refusal);
        let mut lines = String::new();
        caller.permit.headers.write(&mut lines);
        error.add_headers(&lines);
        return Err(error);
    }
    caller.admitted = true;
    caller.permit.headers.write(&mut obs.rate_headers);

    // Forward: the rewritten request out (with stream usage asked for, so limits settle on
    // reported usage), the response head back (one retry on a stale pooled connection).
    let mut upstream_request = worker.bufs.take();
    let usage_requested = forward::build_request(
        &mut upstream_request,
        request,
        inspection,
        &target,
        worker.snapshot.upstream.request_stream_usage,
    );
    let response = forward::send(worker, &target, upstream_request, obs).await?;

    // Relay: the body to the client as it arrives, metered on the side; a usage chunk the
    // client did not ask for is metered but not relayed.
    let side = ClientSide {
        head_only: false,
        minor_version: request.head.minor_version,
        keep_alive: request.head.keep_alive,
        strip_usage: usage_requested,
    };
    let keep_alive = relay::relay(worker, client, response, side, obs).await?;
    Ok((keep_alive, target.mapped_model))
}
