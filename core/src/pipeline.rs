//! The life of one proxied request, top to bottom. Each step is one phase module; the order
//! here is the order in `docs/request-lifecycle.md`.
//!
//! Runs for every POST to an OpenAI endpoint, after the connection loop has read the head and
//! body. Returns whether the client connection can be kept, or the error to answer with when
//! nothing was sent to the client yet (errors after the response started are the relay's).

use crate::conn::{ClientSocket, Request};
use crate::error::GatewayError;
use crate::inspect::Inspection;
use crate::relay::ClientSide;
use crate::worker::Worker;
use crate::{forward, relay, route};

pub async fn proxy(
    worker: &Worker,
    client: &ClientSocket,
    request: &Request<'_>,
    inspection: &mut Inspection,
) -> Result<bool, GatewayError> {
    // Inspect: the top-level model and friends, exactly as the upstream will read them.
    worker
        .inspector
        .borrow_mut()
        .inspect(request.body, inspection)?;

    // Route: cluster, backend and the model name the upstream sees.
    let target = route::route(&worker.snapshot, &inspection.model, &worker.rng)?;

    // Forward: the rewritten request out, the response head back (one retry on a stale
    // pooled connection).
    let mut upstream_request = worker.bufs.take();
    forward::build_request(&mut upstream_request, request, inspection, &target);
    let response = forward::send(worker, &target, upstream_request).await?;

    // Relay: the body to the client as it arrives.
    let side = ClientSide {
        head_only: false,
        minor_version: request.head.minor_version,
        keep_alive: request.head.keep_alive,
    };
    relay::relay(worker, client, response, side).await
}
