//! Front door: everything the gateway decides about a request from its head, and the answers it
//! gives itself.
//!
//! Runs for every request the connection loop has read a head of. [`on_head`] takes the head
//! (`request.body` empty) and decides, before a byte of the body is read: the path and method's
//! fate (404, 405, and `/v1/models`, which needs no body, answered at once), then for a POST to a
//! proxied endpoint or `/v1/messages/count_tokens` the worker's request cap (503), the caller's
//! key (400 / 401) and only then, for a caller that passed, the body's share of the worker's
//! body memory (503) — so nobody unauthenticated can hold that budget. It returns a
//! [`HeadDecision`]: refuse (answered, the body unread, the connection closed), answer locally,
//! or read the body under a [`Ticket`]: the proxy pipeline (which writes its own answer) or
//! Sluice's own token count ([`answer_count_tokens`]). Local answers are [`Local`] values the
//! connection loop writes; it knows sockets, TLS, keep-alive and deadlines, not paths.

use std::borrow::Cow;

use crate::gateway::context::{BodyHold, PerCore, Request};
use crate::gateway::error::GatewayError;
use crate::gateway::pipeline::{self, Authenticated};
use crate::gateway::{auth, models};
use crate::http::request::Method;
use crate::http::BodyFraming;
use crate::openai::anthropic::client as anthropic_client;
use crate::openai::endpoint::{Endpoint, COUNT_TOKENS_PATH};

/// What the front door decided from a request's head.
pub(crate) enum HeadDecision<'s> {
    /// Refused: answer this, leave the body unread and close the connection.
    Refuse(GatewayError),
    /// Answered from the head: write this; the connection stays open only when the request
    /// declared no body (the body stays unread).
    Answer(Local<'s>),
    /// Read the body, holding its bytes in `hold`, then serve it as `ticket` says.
    ReadBody {
        ticket: Ticket<'s>,
        hold: BodyHold<'s>,
    },
}

/// What a request whose body is being read was admitted to, from its head.
#[derive(Clone, Copy)]
pub(crate) enum Ticket<'s> {
    /// A POST to a proxied endpoint: the pipeline.
    Proxy(Authenticated<'s>),
    /// Anthropic's token count, answered from Sluice's own estimate.
    CountTokens(Authenticated<'s>),
}

/// An answer Sluice gives itself, for the connection loop to write.
pub(crate) enum Local<'s> {
    /// A JSON body with its status (a body from the worker's buffers is `Owned`: give it back).
    Json(u16, Cow<'s, [u8]>),
    /// An error, in the client's dialect.
    Error(GatewayError),
}

/// The doors a path can lead to.
enum Door {
    Proxy,
    CountTokens,
    Models,
    NotFound,
}

fn door(path: &[u8]) -> Door {
    match path {
        COUNT_TOKENS_PATH => Door::CountTokens,
        b"/v1/models" => Door::Models,
        _ if Endpoint::from_path(path).is_some() => Door::Proxy,
        _ => Door::NotFound,
    }
}

/// Decide a request from its head (see the module's doc). `memo` is the connection's memory of
/// its last key's digest.
pub(crate) fn on_head<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    memo: &mut auth::KeyDigestMemo,
) -> HeadDecision<'s> {
    let head = request.head;
    let path = head.path(request.buf);
    let post = head.method == Method::Post;
    let proxied = match door(path) {
        Door::Proxy if post => true,
        Door::CountTokens if post => false,
        Door::Proxy | Door::CountTokens => {
            let message = format!("{} only accepts POST", String::from_utf8_lossy(path));
            let e = GatewayError::method_not_allowed(message, "POST");
            return HeadDecision::Answer(Local::Error(e));
        }
        Door::Models => return HeadDecision::Answer(list_models(core, request)),
        Door::NotFound => {
            let e = GatewayError::not_found(format!(
                "Unknown request URL: {}. Please check the URL for typos.",
                String::from_utf8_lossy(&path[..path.len().min(256)])
            ));
            return HeadDecision::Answer(Local::Error(e));
        }
    };
    match admit_head(core, request, memo) {
        Ok((authenticated, hold)) => HeadDecision::ReadBody {
            ticket: if proxied {
                Ticket::Proxy(authenticated)
            } else {
                Ticket::CountTokens(authenticated)
            },
            hold,
        },
        Err(e) => HeadDecision::Refuse(e),
    }
}

/// A POST's head through the worker's request cap, authentication, and then the body's hold on
/// the worker's body memory. A refusal is observed (counted and logged) here.
fn admit_head<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    memo: &mut auth::KeyDigestMemo,
) -> Result<(Authenticated<'s>, BodyHold<'s>), GatewayError> {
    let server = &core.snapshot.server;
    if core.load.active() > server.max_requests_per_worker {
        let e = GatewayError::overloaded(format!(
            "This server is serving its maximum of {} requests per worker; retry shortly.",
            server.max_requests_per_worker
        ));
        pipeline::refused_before_body(core, request, &e);
        return Err(e);
    }
    let authenticated = pipeline::authenticate_head(core, request, memo)?;
    let mut hold = core.load.hold_body(server.max_body_memory_per_worker);
    if let BodyFraming::Length(n) = request.head.body {
        if !hold.grow_to(n as usize) {
            let e = GatewayError::body_memory_full();
            pipeline::refused_before_body(core, request, &e);
            return Err(e);
        }
    }
    Ok((authenticated, hold))
}

/// Sluice's own token count for a request whose body is in (see [`count_tokens`]), as the
/// answer to write. (A [`Ticket::Proxy`] goes to [`pipeline::proxy`] instead, awaited by the
/// connection loop itself: a future wrapped around the pipeline's would be one more copy of
/// it per request.)
pub(crate) fn answer_count_tokens<'s>(
    core: PerCore<'s>,
    request: &Request<'_>,
    authenticated: Authenticated<'_>,
) -> Local<'s> {
    match count_tokens(request, authenticated) {
        Ok(tokens) => {
            let mut body = core.bufs.take();
            anthropic_client::count_tokens_body(tokens, &mut body);
            Local::Json(200, Cow::Owned(body))
        }
        Err(e) => Local::Error(e),
    }
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

/// `GET /v1/models`: the key checked (not memoized: a listing is rare); a key with model lists
/// sees only what it may use, one with routes of its own (or its entity's) sees those too.
fn list_models<'s>(core: PerCore<'s>, request: &Request<'_>) -> Local<'s> {
    let head = request.head;
    if !matches!(head.method, Method::Get | Method::Head) {
        let e = GatewayError::method_not_allowed("/v1/models only accepts GET", "GET, HEAD");
        return Local::Error(e);
    }
    match auth::authenticate(&core.snapshot.limits, request, None) {
        Ok(Some(p)) if models::own_list(core.snapshot, p.key) => {
            let body = models::list_body_for(core.snapshot, p.index, p.key);
            Local::Json(200, Cow::Owned(body))
        }
        Ok(_) => Local::Json(200, Cow::Borrowed(core.models_body)),
        Err(e) => Local::Error(e),
    }
}
