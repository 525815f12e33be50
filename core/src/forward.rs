//! Forward: write the request to the chosen backend and wait for its response head.
//!
//! Runs after routing. Takes the client's request, the inspection and the [`Target`]; builds the
//! upstream request (the mapped model spliced into an otherwise byte-identical body, the
//! cluster's credential in place of the client's, hop-by-hop headers dropped), sends it on a
//! pooled or new connection and reads the response head within `upstream_first_byte`. Returns an
//! [`UpstreamResponse`]: the connection, the head, and any body bytes read with it. A pooled
//! connection that turns out dead before answering a single byte is retried once on a fresh one.
//! Raises 502 (refused, reset, TLS failure, malformed or missing response), 504 (connect or
//! first-byte timeout) and 503 (backend connection cap).

use std::io::Write as _;
use std::time::Instant;

use crate::conn::Request;
use crate::error::{GatewayError, UpstreamFault};
use crate::http::is_hop_by_hop;
use crate::http::response::{parse_response_head, ResponseHead};
use crate::inspect::Inspection;
use crate::observe::Observation;
use crate::route::Target;
use crate::upstream::{connect, UpstreamConn};
use crate::worker::Worker;

/// Client headers never forwarded: the client's credentials (the upstream gets the cluster's),
/// and headers this hop sets itself.
fn is_withheld(name: &[u8], credential_header: Option<&str>) -> bool {
    const WITHHELD: [&[u8]; 7] = [
        b"host",
        b"authorization",
        b"x-api-key",
        b"api-key",
        b"expect",
        b"openai-organization",
        b"openai-project",
    ];
    is_hop_by_hop(name)
        || WITHHELD.iter().any(|h| h.eq_ignore_ascii_case(name))
        || credential_header.is_some_and(|c| c.as_bytes().eq_ignore_ascii_case(name))
}

/// Build the upstream request into `out`.
pub fn build_request(
    out: &mut Vec<u8>,
    request: &Request<'_>,
    inspection: &Inspection,
    target: &Target<'_>,
) {
    let buf = request.buf;
    let head = request.head;
    let backend = target.backend;
    // The client's path after `/v1` goes after the backend's base path.
    let target_path = head.target(buf);
    let suffix = target_path.strip_prefix(b"/v1").unwrap_or(target_path);

    let body = request.body;
    let (model_start, model_end) = inspection.model_span;
    let mut mapped_literal = String::new();
    let body_len = match target.mapped_model {
        Some(model) => {
            crate::error::push_json_string(&mut mapped_literal, model);
            body.len() - (model_end - model_start) + mapped_literal.len()
        }
        None => body.len(),
    };

    out.clear();
    out.extend_from_slice(b"POST ");
    out.extend_from_slice(backend.base_path.as_bytes());
    out.extend_from_slice(suffix);
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(backend.host_header.as_bytes());
    out.extend_from_slice(b"\r\n");
    let credential = target.cluster.credential.as_ref();
    if let Some(c) = credential {
        out.extend_from_slice(&c.header_line);
    }
    let credential_name = credential.map(|c| c.header_name.as_str());
    for h in &head.headers {
        let name = h.name(buf);
        if is_withheld(name, credential_name) {
            continue;
        }
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value(buf));
        out.extend_from_slice(b"\r\n");
    }
    let _ = write!(out, "content-length: {body_len}\r\n\r\n");
    match target.mapped_model {
        Some(_) => {
            out.extend_from_slice(&body[..model_start]);
            out.extend_from_slice(mapped_literal.as_bytes());
            out.extend_from_slice(&body[model_end..]);
        }
        None => out.extend_from_slice(body),
    }
}

/// An upstream's answer, head parsed, body not yet relayed.
pub struct UpstreamResponse {
    pub conn: UpstreamConn,
    pub head: ResponseHead,
    /// The head's bytes followed by whatever body bytes arrived with it.
    pub buf: Vec<u8>,
}

/// Why an attempt failed, and whether it may be retried on a fresh connection.
struct AttemptError {
    error: GatewayError,
    /// The connection came from the pool and died before a byte of response.
    stale: bool,
}

/// Send `request` (as built by [`build_request`]) and read the response head.
pub async fn send(
    worker: &Worker,
    target: &Target<'_>,
    mut request: Vec<u8>,
    obs: &mut Observation,
) -> Result<UpstreamResponse, GatewayError> {
    let timeouts = &worker.snapshot.timeouts;
    let mut fresh_only = false;
    obs.forwarded_at = Some(Instant::now());
    loop {
        let conn = match (!fresh_only)
            .then(|| worker.pools.checkout(target.backend.id))
            .flatten()
        {
            Some(conn) => conn,
            None => {
                let started = Instant::now();
                let conn = connect(&worker.pools, target.cluster, target.backend, timeouts).await?;
                obs.upstream_connect = Some(started.elapsed());
                conn
            }
        };
        let deadline = Instant::now() + timeouts.upstream_first_byte;
        let (result, returned) = attempt(worker, conn, request, deadline).await;
        request = returned;
        match result {
            Ok(response) => {
                obs.upstream_head_at = Some(Instant::now());
                worker.bufs.give(request);
                return Ok(response);
            }
            Err(AttemptError { stale: true, .. }) if !fresh_only => {
                obs.retries += 1;
                fresh_only = true;
            }
            Err(AttemptError { error, .. }) => {
                worker.bufs.give(request);
                return Err(error);
            }
        }
    }
}

async fn attempt(
    worker: &Worker,
    mut conn: UpstreamConn,
    request: Vec<u8>,
    deadline: Instant,
) -> (Result<UpstreamResponse, AttemptError>, Vec<u8>) {
    let reused = conn.reused;
    let timed_out = || AttemptError {
        error: GatewayError::gateway_timeout("the upstream did not answer in time"),
        stale: false,
    };
    let limit = deadline.saturating_duration_since(Instant::now());
    let request = match monoio::time::timeout(
        limit,
        conn.io.write_all(request, worker.direct_writes()),
    )
    .await
    {
        Ok((Ok(_), request)) => request,
        Ok((Err(e), request)) => {
            conn.abort();
            let error = GatewayError::bad_gateway(
                UpstreamFault::Io,
                format!("could not send to the upstream: {e}"),
            );
            return (
                Err(AttemptError {
                    error,
                    stale: reused,
                }),
                request,
            );
        }
        Err(_) => {
            conn.abort();
            return (Err(timed_out()), Vec::new());
        }
    };

    let mut buf = worker.bufs.take();
    let mut head = ResponseHead::default();
    loop {
        if !buf.is_empty() {
            match parse_response_head(&buf, false, &mut head) {
                Ok(false) => {}
                Ok(true) if (100..200).contains(&head.status) && head.status != 101 => {
                    // Interim responses (103 Early Hints, a stray 100) are not relayed.
                    buf.drain(..head.head_len);
                    continue;
                }
                Ok(true) if head.status == 101 => {
                    conn.abort();
                    let error = GatewayError::bad_gateway(
                        UpstreamFault::Protocol,
                        "the upstream tried to switch protocols",
                    );
                    return (
                        Err(AttemptError {
                            error,
                            stale: false,
                        }),
                        request,
                    );
                }
                Ok(true) => return (Ok(UpstreamResponse { conn, head, buf }), request),
                Err(e) => {
                    conn.abort();
                    let error = GatewayError::bad_gateway(UpstreamFault::Protocol, e.0);
                    return (
                        Err(AttemptError {
                            error,
                            stale: false,
                        }),
                        request,
                    );
                }
            }
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
        let len = buf.len();
        let cap = buf.capacity();
        let limit = deadline.saturating_duration_since(Instant::now());
        let read = conn
            .io
            .read(monoio::buf::IoBufMut::slice_mut(buf, len..cap));
        let (res, slice) = match monoio::time::timeout(limit, read).await {
            Ok(r) => r,
            Err(_) => {
                conn.abort();
                return (Err(timed_out()), request);
            }
        };
        buf = slice.into_inner();
        let n = match res {
            Ok(n) => n,
            Err(e) => {
                conn.abort();
                let error = GatewayError::bad_gateway(
                    UpstreamFault::Io,
                    format!("upstream connection failed: {e}"),
                );
                return (
                    Err(AttemptError {
                        error,
                        stale: reused && len == 0,
                    }),
                    request,
                );
            }
        };
        if n == 0 {
            conn.abort();
            let error = GatewayError::bad_gateway(
                UpstreamFault::Io,
                "the upstream closed the connection without a response",
            );
            return (
                Err(AttemptError {
                    error,
                    stale: reused && len == 0,
                }),
                request,
            );
        }
    }
}
