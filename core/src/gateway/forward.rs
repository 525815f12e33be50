//! Forward: write the request to the chosen backend and wait for its response head.
//!
//! Runs after routing. Takes the client's request, the inspection and the [`Target`]; builds the
//! upstream request (the mapped model spliced into an otherwise byte-identical body, for a
//! streamed chat completion or completion `stream_options.include_usage: true` spliced in when
//! configured and the client did not ask, the cluster's credential in place of the client's,
//! hop-by-hop headers dropped), sends it on a
//! pooled or new connection and reads the response head within `upstream_first_byte`. A long
//! unedited end of the body (16 KB or more after the last edit) is not copied into the upstream
//! request: it goes from the client's buffer, straight to the socket behind it. Returns an
//! [`UpstreamResponse`]: the connection, the head, and any body bytes read with it. A pooled
//! connection that turns out dead before answering a single byte is retried once on a fresh one.
//! Raises 502 (refused, reset, TLS failure, malformed or missing response), 504 (connect or
//! first-byte timeout) and 503 (backend connection cap, or `server_shutting_down` once a stop's
//! grace is over: then nothing more is sent, and a failure of the exchange — the runtime shut the
//! upstream connections down — is neither retried nor blamed on the upstream).

use crate::config::dialect::AnthropicSettings;
use crate::gateway::auth::{AUTHORIZATION, X_API_KEY};
use crate::gateway::context::{Io, Request};
use crate::gateway::error::{ErrorKind, GatewayError, UpstreamFault};
use crate::gateway::record::ForwardTimings;
use crate::gateway::route::Target;
use crate::http::response::{parse_response_head, ResponseHead};
use crate::http::{is_hop_by_hop, named_by_connection, push_decimal, Name, NameSet};
use crate::openai::anthropic::upstream::{chat_to_messages, RequestOptions};
use crate::openai::inspect::{Inspection, StreamOptionsAt};
use crate::sys::client::ClientSocket;
use crate::sys::clock::{self, Mono};
use crate::sys::stream::{self, ReadOutcome, Watched};
use crate::telemetry::metrics::InFlight;
use crate::upstream::{connect, ConnectError, UpstreamConn};

/// Client headers never forwarded: the client's credentials (the upstream gets the cluster's),
/// headers this hop sets itself, the client's own claims of where it is (`forwarded`,
/// `x-forwarded-*`, `x-real-ip`: Sluice is the edge and trusts no proxy before it, so an
/// upstream that reads them must not be told a client's unchecked word), and those the
/// client's `Connection` names (for this hop only, RFC 9110 §7.6.1; looked for only when it
/// names any).
fn is_withheld(request: &Request<'_>, name: &[u8], credential_header: Option<&str>) -> bool {
    // `accept-encoding`: a compressed answer could not be metered (usage, TTFT) nor relayed as
    // events; the client gets identity, which every HTTP client accepts.
    const WITHHELD: NameSet = NameSet::new(&[
        Name::new(b"host"),
        AUTHORIZATION,
        X_API_KEY,
        Name::new(b"api-key"),
        Name::new(b"expect"),
        Name::new(b"openai-organization"),
        Name::new(b"openai-project"),
        Name::new(b"accept-encoding"),
        Name::new(b"forwarded"),
        Name::new(b"x-forwarded-for"),
        Name::new(b"x-forwarded-host"),
        Name::new(b"x-forwarded-proto"),
        Name::new(b"x-real-ip"),
    ]);
    let head = request.head;
    is_hop_by_hop(name)
        || WITHHELD.contains(name)
        || credential_header.is_some_and(|c| c.as_bytes().eq_ignore_ascii_case(name))
        || (head.connection_options && named_by_connection(&head.headers, request.buf, name))
}

/// How every upstream request begins: `POST {base path}{path} HTTP/1.1`, `host`, and the
/// target's credential line. Returns the credential's header name, which the client's own
/// headers must not repeat (see [`is_withheld`]).
fn start_request<'t>(out: &mut Vec<u8>, target: &Target<'t>, path: &[u8]) -> Option<&'t str> {
    let backend = target.backend;
    out.clear();
    out.extend_from_slice(b"POST ");
    out.extend_from_slice(backend.base_path.as_bytes());
    push_target(out, path);
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(backend.host_header.as_bytes());
    out.extend_from_slice(b"\r\n");
    let (_, credential) = target.credential?;
    out.extend_from_slice(&credential.header_line);
    Some(credential.header_name.as_str())
}

/// Query parameters that carry a credential (a client's gateway key sent as `?key=`, Azure's
/// `api-key`, OAuth's `access_token`): never forwarded, since the provider is not who the
/// client's key is for. Compared without regard to case.
const SECRET_PARAMS: &[&[u8]] = &[
    b"key",
    b"api-key",
    b"api_key",
    b"apikey",
    b"x-api-key",
    b"access_token",
];

/// The client's path and query into `out`, less the query's credential parameters
/// ([`SECRET_PARAMS`]) and empty ones; a query left empty is dropped with its `?`.
fn push_target(out: &mut Vec<u8>, target: &[u8]) {
    let Some(q) = memchr::memchr(b'?', target) else {
        out.extend_from_slice(target);
        return;
    };
    out.extend_from_slice(&target[..q]);
    let mut separator = b'?';
    for param in target[q + 1..].split(|&b| b == b'&') {
        let name = param.split(|&b| b == b'=').next().unwrap_or_default();
        if param.is_empty() || SECRET_PARAMS.iter().any(|s| s.eq_ignore_ascii_case(name)) {
            continue;
        }
        out.push(separator);
        separator = b'&';
        out.extend_from_slice(param);
    }
}

/// The rest of an upstream request whose body Sluice wrote (a translation): the client's
/// headers less the withheld ones and those `replaced` names (which describe the client's body
/// or its API), then a JSON content type, the length and `body`.
fn finish_translated(
    out: &mut Vec<u8>,
    request: &Request<'_>,
    credential_name: Option<&str>,
    replaced: impl Fn(&[u8]) -> bool,
    body: &[u8],
) {
    let buf = request.buf;
    for h in request.head.headers.iter() {
        let name = h.name(buf);
        if !replaced(name) && !is_withheld(request, name, credential_name) {
            copy_header(out, name, h.value(buf));
        }
    }
    out.extend_from_slice(b"content-type: application/json\r\n");
    push_content_length(out, body.len());
    out.extend_from_slice(body);
}

/// The request head's last field, the body's length, and the blank line.
fn push_content_length(out: &mut Vec<u8>, body_len: usize) {
    out.extend_from_slice(b"content-length: ");
    push_decimal(out, body_len);
    out.extend_from_slice(b"\r\n\r\n");
}

/// Copy one of the client's header lines into the upstream request.
fn copy_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Build the upstream request into `out`, all but a long unedited end of the body (see
/// [`splice`]), which is sent from where it lies: returns where that end starts in the body.
/// With `request_usage` (`upstream.request_stream_usage`), a streamed `/v1/chat/completions`
/// or `/v1/completions` request whose client did not set `stream_options.include_usage: true`
/// gets it spliced in; returns whether that happened (the relay then withholds the usage chunk
/// from this client).
#[must_use = "the body's end it left out must be sent behind the request"]
pub(crate) fn build_request(
    out: &mut Vec<u8>,
    request: &Request<'_>,
    inspection: &Inspection,
    target: &Target<'_>,
    request_usage: bool,
) -> (usize, bool) {
    let buf = request.buf;
    let head = request.head;
    // The client's path after `/v1` goes after the backend's base path.
    let target_path = head.target(buf);
    let suffix = target_path.strip_prefix(b"/v1").unwrap_or(target_path);

    let body = request.body;
    let request_usage = request_usage
        && crate::openai::endpoint::Endpoint::from_path(head.path(buf))
            .is_some_and(|e| e.usage_on_request());
    let mut mapped_literal = String::new();
    let (edits, body_len) =
        target_body_edits(body, inspection, target, &mut mapped_literal, request_usage);

    let credential_name = start_request(out, target, suffix);
    for h in &head.headers {
        let name = h.name(buf);
        if !is_withheld(request, name, credential_name) {
            copy_header(out, name, h.value(buf));
        }
    }
    push_content_length(out, body_len);
    let tail_from = splice(out, body, edits.iter().flatten().copied());
    (tail_from, edits.iter().flatten().any(|e| e.3))
}

/// Build the upstream request for an Anthropic-dialect cluster into `out`: the chat completion
/// translated into a Messages request (`POST {base path}/messages`) for the target's model,
/// with the cluster's credential, `anthropic-version` and `anthropic-beta` (the cluster's, else
/// the client's own). The client's other headers go as on the OpenAI path, less those that
/// describe the old body or another API (`content-type`, `accept-encoding` — the translators
/// read plain JSON — and `openai-*`). A request the Messages API cannot express is the
/// client's to fix: 400.
pub(crate) fn build_anthropic_request(
    out: &mut Vec<u8>,
    request: &Request<'_>,
    inspection: &Inspection,
    target: &Target<'_>,
    settings: &AnthropicSettings,
) -> Result<(), GatewayError> {
    let options = RequestOptions {
        model: target.mapped_model.unwrap_or(&inspection.model),
        default_max_tokens: settings.default_max_tokens,
    };
    let mut body = Vec::with_capacity(request.body.len() + 256);
    chat_to_messages(request.body, &options, &mut body).map_err(|e| {
        let mut error = GatewayError::new(ErrorKind::InvalidRequest, e.message);
        error.param = e.param;
        error
    })?;
    let credential_name = start_request(out, target, b"/messages");
    out.extend_from_slice(&settings.version_line);
    if let Some(line) = &settings.beta_line {
        out.extend_from_slice(line);
    }
    let replaced = |name: &[u8]| {
        [&b"content-type"[..], b"anthropic-version"]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
            || (settings.beta_line.is_some() && name.eq_ignore_ascii_case(b"anthropic-beta"))
            || name.len() >= 7 && name[..7].eq_ignore_ascii_case(b"openai-")
    };
    finish_translated(out, request, credential_name, replaced, &body);
    Ok(())
}

/// Build the upstream request for an Anthropic client's Messages request to an
/// Anthropic-dialect cluster into `out`: passed through byte for byte but for the mapped model
/// (spliced in as [`build_request`] does; nothing else of the body changes, no `stream_options`),
/// to `{base path}/messages` by the same suffix rule. The client's credentials are withheld and
/// the cluster's sent; `anthropic-version` is the client's (the cluster's when it sent none),
/// `anthropic-beta` the cluster's when configured, else the client's. Returns where the body's
/// end left out of `out` starts, as [`build_request`] does.
#[must_use = "the body's end it left out must be sent behind the request"]
pub(crate) fn build_messages_passthrough(
    out: &mut Vec<u8>,
    request: &Request<'_>,
    inspection: &Inspection,
    target: &Target<'_>,
    settings: &AnthropicSettings,
) -> usize {
    let buf = request.buf;
    let head = request.head;
    let target_path = head.target(buf);
    let suffix = target_path.strip_prefix(b"/v1").unwrap_or(target_path);
    let body = request.body;
    let mut mapped_literal = String::new();
    let (edits, body_len) = target_body_edits(body, inspection, target, &mut mapped_literal, false);

    let credential_name = start_request(out, target, suffix);
    if let Some(line) = &settings.beta_line {
        out.extend_from_slice(line);
    }
    let mut version_sent = false;
    for h in &head.headers {
        let name = h.name(buf);
        if is_withheld(request, name, credential_name)
            || (settings.beta_line.is_some() && name.eq_ignore_ascii_case(b"anthropic-beta"))
        {
            continue;
        }
        version_sent |= name.eq_ignore_ascii_case(b"anthropic-version");
        copy_header(out, name, h.value(buf));
    }
    if !version_sent {
        out.extend_from_slice(&settings.version_line);
    }
    push_content_length(out, body_len);
    splice(out, body, edits.iter().flatten().copied())
}

/// Build the upstream request for an Anthropic client's Messages request to an OpenAI-dialect
/// cluster into `out`: translated into a chat completion (`POST {base path}/chat/completions`,
/// a stream asking for usage) for the target's model, with the cluster's credential. The
/// client's other headers go as on the OpenAI path, less those that describe the old body or
/// another API (`content-type`, `anthropic-*`). A request chat completions cannot express is
/// the client's to fix: 400.
pub(crate) fn build_chat_from_messages(
    out: &mut Vec<u8>,
    request: &Request<'_>,
    inspection: &Inspection,
    target: &Target<'_>,
) -> Result<(), GatewayError> {
    let model = target.mapped_model.unwrap_or(&inspection.model);
    let mut body = Vec::with_capacity(request.body.len() + 128);
    crate::openai::anthropic::client::messages_to_chat(request.body, model, &mut body)
        .map_err(|e| GatewayError::invalid_request(e.message, None))?;
    let credential_name = start_request(out, target, b"/chat/completions");
    let replaced = |name: &[u8]| {
        name.eq_ignore_ascii_case(b"content-type")
            || name.len() >= 10 && name[..10].eq_ignore_ascii_case(b"anthropic-")
    };
    finish_translated(out, request, credential_name, replaced, &body);
    Ok(())
}

/// A replacement of `body[start..end]` (empty for an insertion) by the bytes given, and whether
/// it is the `include_usage` one.
type Edit<'a> = (usize, usize, &'a [u8], bool);

/// The edits to the client's body for `target` — its mapped model's name spliced over the
/// model literal (written into `literal`), and with `request_usage` the usage request — and the
/// body's length once they are made.
fn target_body_edits<'a>(
    body: &[u8],
    inspection: &Inspection,
    target: &Target<'_>,
    literal: &'a mut String,
    request_usage: bool,
) -> ([Option<Edit<'a>>; 2], usize) {
    if let Some(model) = target.mapped_model {
        crate::openai::json::push_json_string(literal, model);
    }
    let mapped = target.mapped_model.map(|_| literal.as_bytes());
    let edits = body_edits(inspection, mapped, request_usage);
    let len = edits
        .iter()
        .flatten()
        .fold(body.len(), |len, (start, end, with, _)| {
            len - (end - start) + with.len()
        });
    (edits, len)
}

/// The body's edits, in body order: the mapped model's literal in place of the client's, and
/// (with `request_usage`) `include_usage` made true. They touch disjoint top-level values.
fn body_edits<'a>(
    inspection: &Inspection,
    mapped_literal: Option<&'a [u8]>,
    request_usage: bool,
) -> [Option<Edit<'a>>; 2] {
    let (start, end) = inspection.model_span;
    let model = mapped_literal.map(|m| (start, end, m, false));
    let usage = request_usage
        .then(|| include_usage_edit(inspection))
        .flatten();
    match (model, usage) {
        (Some(m), Some(u)) if u.0 < m.0 => [usage, model],
        _ => [model, usage],
    }
}

/// The edit that makes a streaming request's `stream_options.include_usage` true, or `None`
/// when the client asked for usage itself (or the request does not stream). Only the value or
/// key concerned is touched, so the body stays byte-identical around it.
fn include_usage_edit(inspection: &Inspection) -> Option<Edit<'static>> {
    if !inspection.stream || inspection.include_usage == Some(true) {
        return None;
    }
    let (start, end, with): (usize, usize, &'static [u8]) = match inspection.stream_options {
        // The body always has `model` after its `{`, so a comma can follow.
        StreamOptionsAt::Absent { insert_at } => (
            insert_at,
            insert_at,
            b"\"stream_options\":{\"include_usage\":true},",
        ),
        StreamOptionsAt::Null { span: (start, end) } => (start, end, b"{\"include_usage\":true}"),
        StreamOptionsAt::Object {
            inside,
            empty,
            include_usage: None,
        } => {
            let with: &[u8] = if empty {
                b"\"include_usage\":true"
            } else {
                b"\"include_usage\":true,"
            };
            (inside, inside, with)
        }
        // `false` or `null`.
        StreamOptionsAt::Object {
            include_usage: Some((start, end)),
            ..
        } => (start, end, b"true"),
    };
    Some((start, end, with, true))
}

/// A client body whose unedited end is at least this long does not have that end copied into
/// the upstream request: it goes from the client's buffer, straight to the socket behind the
/// request ([`UpstreamIo::write_with_tail`]). A shorter one is copied, which costs less than a
/// send of its own outside the ring (a 64 KB prompt's copy was 3–5% of its CPU).
const SEND_TAIL_FROM: usize = 16 * 1024;

/// Append `body` to `out` with `edits` (in body order, not overlapping) applied — all of it,
/// or only up to the end of the last edit when at least [`SEND_TAIL_FROM`] bytes follow it.
/// Returns where in `body` the part left out starts (`body.len()` when none was).
fn splice<'a>(out: &mut Vec<u8>, body: &[u8], edits: impl Iterator<Item = Edit<'a>>) -> usize {
    let mut at = 0;
    for (start, end, with, _) in edits {
        out.extend_from_slice(&body[at..start]);
        out.extend_from_slice(with);
        at = end;
    }
    if body.len() - at >= SEND_TAIL_FROM {
        return at;
    }
    out.extend_from_slice(&body[at..]);
    body.len()
}

/// An upstream's answer, head parsed, body not yet relayed.
pub(crate) struct UpstreamResponse<'w> {
    pub(crate) conn: UpstreamConn,
    pub(crate) head: ResponseHead,
    /// The head's bytes followed by whatever body bytes arrived with it.
    pub(crate) buf: Vec<u8>,
    /// Counts the exchange in `sluice_upstream_in_flight` (from the request's write on) until
    /// dropped: keep it as long as `conn` serves this request.
    pub(crate) in_flight: InFlight<'w>,
    /// When the last bytes in `buf` were read, if after the head (the fallback phase read on
    /// to judge the response).
    pub(crate) read_at: Option<Mono>,
}

/// Why an attempt failed, and whether it may be retried on a fresh connection.
struct AttemptError {
    error: GatewayError,
    /// The connection came from the pool and died before a byte of response.
    stale: bool,
}

/// Send `request` (as built by [`build_request`]), then `tail` (the end of the client's body it
/// left out), and read the response head: the response or the error to answer with, and when
/// each step happened. `streamed`: the client asked for a stream, whose first token waits on
/// this write ([`Load::direct_writes_for`](crate::gateway::context::Load::direct_writes_for)).
pub(crate) async fn send<'w>(
    io: Io<'w>,
    target: &Target<'_>,
    mut request: Vec<u8>,
    tail: &[u8],
    streamed: bool,
    watch: Option<Watch<'_>>,
) -> (Result<UpstreamResponse<'w>, GatewayError>, ForwardTimings) {
    let timeouts = io.timeouts;
    let backend = io.metrics.labels.backend(target.backend.id);
    let mut fresh_only = false;
    // When a wait for room on a capped backend must end (set by the first wait).
    let mut pool_wait_until: Option<Mono> = None;
    // Read afresh: the gateway's work on the request so far (its overhead) ends here.
    let mut timings = ForwardTimings {
        started_at: Some(clock::now()),
        ..ForwardTimings::default()
    };
    loop {
        if io.drain.past_grace() {
            io.bufs.give(request);
            io.drain.ended_by_shutdown();
            return (Err(GatewayError::shutting_down()), timings);
        }
        let conn = match (!fresh_only)
            .then(|| io.pools.checkout(target.backend.id))
            .flatten()
        {
            Some(conn) => conn,
            None => {
                // Read afresh: a stale connection's failed attempt may have gone before, within
                // this poll.
                let started = clock::now();
                match connect(io.pools, target.cluster, target.backend, timeouts).await {
                    Ok(conn) => {
                        timings.connect = Some(clock::recent().saturating_duration_since(started));
                        conn
                    }
                    // The backend is at its cap on this worker: wait a little for one of its
                    // connections to come back or close (`pool_wait`, in all), then try again;
                    // past that, the next candidate or the 503.
                    Err(ConnectError::PoolFull) => {
                        let waited =
                            *pool_wait_until.get_or_insert_with(|| started + io.pools.pool_wait());
                        // Read afresh: room can show (an idle connection this retry may not
                        // use) without a wait, and a frozen reading would never run out.
                        let left = waited.saturating_duration_since(clock::now());
                        if !left.is_zero() && io.pools.wait_for_room(target.backend.id, left).await
                        {
                            continue;
                        }
                        io.bufs.give(request);
                        return (Err(ConnectError::PoolFull.into()), timings);
                    }
                    Err(e) => {
                        io.bufs.give(request);
                        return (Err(e.into()), timings);
                    }
                }
            }
        };
        let deadline = clock::recent() + target.first_byte_timeout;
        let in_flight = io.metrics.shard.upstream_in_flight(backend);
        let (result, returned) = attempt(
            io, conn, in_flight, request, tail, streamed, deadline, watch,
        )
        .await;
        request = returned;
        match result {
            Ok(response) => {
                // Read afresh: on epoll a read may finish without the task waiting, so this
                // poll's reading may be from before the request went out.
                timings.head_at = Some(clock::now());
                io.bufs.give(request);
                return (Ok(response), timings);
            }
            // The loop's top ends it: the runtime shut the connection down.
            Err(_) if io.drain.past_grace() => {}
            Err(AttemptError { stale: true, .. }) if !fresh_only => {
                timings.retries += 1;
                fresh_only = true;
            }
            Err(AttemptError { error, .. }) => {
                io.bufs.give(request);
                return (Err(error), timings);
            }
        }
    }
}

/// How long Sluice waits on the upstream without a word to the client before it watches the
/// client for leaving — an attempt's wait for its answer ([`Watch`]), a relay's between
/// outputs: longer than the gap between most streams' events, short for a person, and short
/// enough that a client that leaves is cut from the upstream within the 100 ms the README
/// promises, with room for the scheduling around it.
pub(crate) const WATCH_AFTER: std::time::Duration = std::time::Duration::from_millis(75);

/// The client an attempt is for, watched while the attempt waits for its answer (the head, a
/// stream's first event): from `at` on — an answer that comes sooner costs no timer beyond
/// its own wait's — the client leaving cuts the attempt ([`GatewayError::client_left`]).
#[derive(Clone, Copy)]
pub(crate) struct Watch<'c> {
    pub(crate) client: &'c ClientSocket,
    pub(crate) at: Mono,
}

impl<'c> Watch<'c> {
    /// Watch `client` from [`WATCH_AFTER`] on.
    pub(crate) fn from_now(client: &'c ClientSocket) -> Watch<'c> {
        Watch {
            client,
            at: clock::recent() + WATCH_AFTER,
        }
    }

    /// One read of the upstream's answer into `buf` until `deadline`, the client watched; `None`:
    /// the client left first (the read dropped, and the connection's buffer with it).
    pub(crate) async fn read(
        self,
        buf: &mut Vec<u8>,
        deadline: Mono,
        conn: &mut UpstreamConn,
    ) -> Option<ReadOutcome> {
        let left = || self.client.left(WATCH_AFTER);
        let at = self.at;
        match stream::read_spare_watched(
            buf,
            4096,
            16 * 1024,
            usize::MAX,
            deadline,
            at,
            |b| conn.io.read(b),
            left,
        )
        .await
        {
            Watched::Read(outcome) => Some(outcome),
            Watched::Then => None,
        }
    }
}

/// One read of an upstream's answer into `buf` until `deadline`, its client watched when there
/// is one to watch ([`Watch::read`]); `None`: the client left first.
pub(crate) async fn read_answer(
    buf: &mut Vec<u8>,
    deadline: Mono,
    conn: &mut UpstreamConn,
    watch: Option<Watch<'_>>,
) -> Option<ReadOutcome> {
    match watch {
        Some(watch) => watch.read(buf, deadline, conn).await,
        None => {
            let limit = deadline.saturating_duration_since(clock::recent());
            Some(
                stream::read_spare(buf, 4096, 16 * 1024, usize::MAX, limit, |b| conn.io.read(b))
                    .await,
            )
        }
    }
}

#[allow(clippy::too_many_arguments)] // one exchange's parts, each used once
async fn attempt<'w>(
    io: Io<'w>,
    mut conn: UpstreamConn,
    in_flight: InFlight<'w>,
    request: Vec<u8>,
    tail: &[u8],
    streamed: bool,
    deadline: Mono,
    watch: Option<Watch<'_>>,
) -> (Result<UpstreamResponse<'w>, AttemptError>, Vec<u8>) {
    let reused = conn.reused;
    let timed_out = || AttemptError {
        error: GatewayError::gateway_timeout("the upstream did not answer in time"),
        stale: false,
    };
    let limit = deadline.saturating_duration_since(clock::recent());
    let request = match conn
        .io
        .write_with_tail(request, tail, io.load.direct_writes_for(streamed), limit)
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

    let mut buf = io.bufs.take();
    let mut head = ResponseHead::default();
    loop {
        match next_head(&mut buf, &mut head) {
            Ok(false) => {}
            Ok(true) => {
                let response = UpstreamResponse {
                    conn,
                    head,
                    buf,
                    in_flight,
                    read_at: None,
                };
                return (Ok(response), request);
            }
            Err(error) => {
                conn.abort();
                let stale = false;
                return (Err(AttemptError { error, stale }), request);
            }
        }
        let len = buf.len();
        let Some(outcome) = read_answer(&mut buf, deadline, &mut conn, watch).await else {
            conn.abort();
            let error = GatewayError::client_left();
            return (
                Err(AttemptError {
                    error,
                    stale: false,
                }),
                request,
            );
        };
        let error = match outcome {
            ReadOutcome::Data(_) => continue,
            ReadOutcome::TimedOut => {
                conn.abort();
                return (Err(timed_out()), request);
            }
            ReadOutcome::Failed(e) => GatewayError::bad_gateway(
                UpstreamFault::Io,
                format!("upstream connection failed: {e}"),
            ),
            ReadOutcome::Closed => GatewayError::bad_gateway(
                UpstreamFault::Io,
                "the upstream closed the connection without a response",
            ),
        };
        conn.abort();
        let stale = reused && len == 0;
        return (Err(AttemptError { error, stale }), request);
    }
}

/// Read the response head at the start of `buf` into `head`, dropping interim responses (103
/// Early Hints, a stray 100: not relayed): true once a final head is whole, false while more
/// bytes are needed; an unreadable head or a switch of protocols is the upstream's fault.
fn next_head(buf: &mut Vec<u8>, head: &mut ResponseHead) -> Result<bool, GatewayError> {
    while !buf.is_empty() {
        match parse_response_head(buf, false, head) {
            Ok(false) => return Ok(false),
            Ok(true) if (100..200).contains(&head.status) && head.status != 101 => {
                buf.drain(..head.head_len);
            }
            Ok(true) if head.status == 101 => {
                return Err(GatewayError::bad_gateway(
                    UpstreamFault::Protocol,
                    "the upstream tried to switch protocols",
                ));
            }
            Ok(true) => return Ok(true),
            Err(e) => return Err(GatewayError::bad_gateway(UpstreamFault::Protocol, e.0)),
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    #[test]
    fn credentials_in_the_query_stay_at_the_gateway() {
        for (target, want) in [
            ("/chat/completions", "/chat/completions"),
            ("/chat/completions?key=sk-1", "/chat/completions"),
            ("/x?a=1&API-KEY=s&b=2&access_token=t", "/x?a=1&b=2"),
            ("/x?api_key&apikey=1&keys=2&x-api-key=3", "/x?keys=2"),
            ("/x?&&a&", "/x?a"),
            ("/x?", "/x"),
        ] {
            let mut out = Vec::new();
            super::push_target(&mut out, target.as_bytes());
            assert_eq!(String::from_utf8(out).unwrap(), want, "{target}");
        }
    }
    use super::*;
    use crate::openai::inspect::Inspector;

    /// What [`splice`] makes of `body` for `mapped` (the model spliced in, when given) and
    /// `request_usage` (`include_usage` asked for).
    struct Spliced {
        /// The body's part in the upstream request.
        out: Vec<u8>,
        /// Where the part left out starts.
        tail_from: usize,
        /// Where the last edit ends (0: none).
        last_edit_end: usize,
        /// The edited body's length (its Content-Length).
        len: usize,
        /// Usage was asked for.
        injected: bool,
    }

    fn spliced(body: &str, mapped: Option<&str>, request_usage: bool) -> Spliced {
        let mut inspection = Inspection::default();
        Inspector::default()
            .inspect(body.as_bytes(), &mut inspection)
            .unwrap();
        let mut literal = String::new();
        if let Some(m) = mapped {
            crate::openai::json::push_json_string(&mut literal, m);
        }
        let edits = body_edits(
            &inspection,
            mapped.map(|_| literal.as_bytes()),
            request_usage,
        );
        let mut out = Vec::new();
        let tail_from = splice(&mut out, body.as_bytes(), edits.iter().flatten().copied());
        Spliced {
            out,
            tail_from,
            last_edit_end: edits.iter().flatten().map(|e| e.1).max().unwrap_or(0),
            len: edits
                .iter()
                .flatten()
                .fold(body.len(), |len, (s, e, w, _)| len - (e - s) + w.len()),
            injected: edits.iter().flatten().any(|e| e.3),
        }
    }

    /// The body the upstream gets: `mapped` spliced in as the model (when given) and
    /// `include_usage` asked for (when `request_usage`). Also returns whether usage was asked.
    fn rewrite(body: &str, mapped: Option<&str>, request_usage: bool) -> (String, bool) {
        let Spliced {
            mut out,
            tail_from,
            len,
            injected,
            ..
        } = spliced(body, mapped, request_usage);
        out.extend_from_slice(&body.as_bytes()[tail_from..]);
        assert_eq!(out.len(), len, "content-length must match the body");
        (String::from_utf8(out).unwrap(), injected)
    }

    #[test]
    fn a_long_unedited_end_is_left_out_of_the_request_to_go_from_the_clients_buffer() {
        let prose = "x".repeat(SEND_TAIL_FROM);
        let usage_first =
            |body: &str| body.replacen('{', r#"{"stream_options":{"include_usage":true},"#, 1);
        for (body, mapped, usage, copied_whole, want) in [
            // Short: copied whole, edits and all.
            (
                r#"{"model":"m","stream":true,"messages":[]}"#.to_owned(),
                Some("m2"),
                true,
                true,
                usage_first(r#"{"model":"m2","stream":true,"messages":[]}"#),
            ),
            // A long end after the edits: left out, from the end of the last edit.
            (
                format!(r#"{{"model":"m","stream":true,"messages":[{{"content":"{prose}"}}]}}"#),
                Some("mapped-model"),
                true,
                false,
                usage_first(&format!(
                    r#"{{"model":"mapped-model","stream":true,"messages":[{{"content":"{prose}"}}]}}"#
                )),
            ),
            (
                format!(r#"{{"model":"m","messages":[{{"content":"{prose}"}}]}}"#),
                None,
                false,
                false,
                format!(r#"{{"model":"m","messages":[{{"content":"{prose}"}}]}}"#),
            ),
            // The long part before the last edit: copied whole.
            (
                format!(r#"{{"messages":[{{"content":"{prose}"}}],"model":"m"}}"#),
                Some("m2"),
                false,
                true,
                format!(r#"{{"messages":[{{"content":"{prose}"}}],"model":"m2"}}"#),
            ),
        ] {
            let s = spliced(&body, mapped, usage);
            assert_eq!(s.tail_from == body.len(), copied_whole, "{body:.80}");
            if !copied_whole {
                assert_eq!(s.tail_from, s.last_edit_end, "{body:.80}");
            }
            // What the upstream gets is the whole edited body either way.
            let (got, _) = rewrite(&body, mapped, usage);
            assert!(got == want, "{body:.80}");
        }
    }

    #[test]
    fn include_usage_is_spliced_touching_nothing_else() {
        for (body, want) in [
            // Absent: a new first key.
            (
                r#"{"model":"m","stream":true,"messages":[]}"#,
                r#"{"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}"#,
            ),
            (
                " {\n \"stream\":true, \"model\":\"m\" }",
                " {\"stream_options\":{\"include_usage\":true},\n \"stream\":true, \"model\":\"m\" }",
            ),
            // null.
            (
                r#"{"model":"m","stream":true,"stream_options": null }"#,
                r#"{"model":"m","stream":true,"stream_options": {"include_usage":true} }"#,
            ),
            // An empty object, and one with other keys.
            (
                r#"{"model":"m","stream":true,"stream_options":{ }}"#,
                r#"{"model":"m","stream":true,"stream_options":{"include_usage":true }}"#,
            ),
            (
                r#"{"stream_options":{"x":1},"model":"m","stream":true}"#,
                r#"{"stream_options":{"include_usage":true,"x":1},"model":"m","stream":true}"#,
            ),
            // false and null flipped in place.
            (
                r#"{"model":"m","stream":true,"stream_options":{"x":{"include_usage":false},"include_usage" : false}}"#,
                r#"{"model":"m","stream":true,"stream_options":{"x":{"include_usage":false},"include_usage" : true}}"#,
            ),
            (
                r#"{"model":"m","stream":true,"stream_options":{"include_usage":null,"y":2}}"#,
                r#"{"model":"m","stream":true,"stream_options":{"include_usage":true,"y":2}}"#,
            ),
        ] {
            let (got, injected) = rewrite(body, None, true);
            assert_eq!(got, want);
            assert!(injected, "{body}");
            let v: serde_json::Value = serde_json::from_str(&got).unwrap();
            assert_eq!(v["stream_options"]["include_usage"], true, "{got}");
        }
    }

    #[test]
    fn left_alone_when_asked_already_not_streaming_or_off() {
        for (body, request_usage) in [
            (
                r#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#,
                true,
            ),
            (r#"{"model":"m","stream":false}"#, true),
            (
                r#"{"model":"m","stream_options":{"include_usage":false}}"#,
                true,
            ),
            (r#"{"model":"m","stream":true}"#, false),
        ] {
            assert_eq!(rewrite(body, None, request_usage), (body.to_owned(), false));
        }
    }

    #[test]
    fn model_and_usage_splices_together_in_either_order() {
        let (got, injected) = rewrite(r#"{"model":"a","stream":true}"#, Some("bb\"c"), true);
        assert!(injected);
        assert_eq!(
            got,
            r#"{"stream_options":{"include_usage":true},"model":"bb\"c","stream":true}"#
        );
        let body = r#"{"stream":true,"stream_options":{"include_usage":false},"model":"a"}"#;
        let (got, _) = rewrite(body, Some("long-model-name"), true);
        assert_eq!(
            got,
            r#"{"stream":true,"stream_options":{"include_usage":true},"model":"long-model-name"}"#
        );
        let body = r#"{"model":"a","stream":true,"stream_options":{}}"#;
        let (got, _) = rewrite(body, Some("z"), true);
        assert_eq!(
            got,
            r#"{"model":"z","stream":true,"stream_options":{"include_usage":true}}"#
        );
    }
}
