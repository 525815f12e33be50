//! Fallback: whether a failed attempt lets the request move on to the next candidate, and what
//! the attempt says of its backend's health.
//!
//! Runs in the pipeline after each attempt's forward phase, before anything reached the client.
//! [`judge_error`] takes the forward phase's error; [`judge_response`] takes the upstream's
//! response head (reading a little more of the body when the head alone can't tell: a 429's
//! body, to tell a spend limit from a rate limit, and an event stream's first event, which may be
//! an error). Each returns a [`Judgement`]: retry elsewhere (with the reason, for the access log
//! and metrics) or not, and the [`AttemptResult`] for the backend's health.
//!
//! Moves on: connect errors, timeouts, resets and broken framing; 429 (not
//! `insufficient_quota`), 500, 502, 503, 504, 529; a stream whose first event is an error. Never
//! on another status: a 400, 401, 403, 404, 413 or 422 is the request's or the credential's
//! fault, and another backend would answer the same. Raises nothing itself: a response it reads
//! more of and cannot finish reading is judged an upstream failure.

use crate::sys::clock::Mono;

use crate::gateway::context::BufPool;
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::gateway::forward::{read_answer, UpstreamResponse, Watch};
use crate::http::chunked::ChunkedDecoder;
use crate::http::BodyFraming;
use crate::sys::stream::ReadOutcome;
use crate::upstream::health::AttemptResult;

/// Why a request moved on from a backend: the access log's `fallback_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FallbackReason {
    Connect,
    Timeout,
    /// Reset, closed early, broken framing or TLS.
    Io,
    Status429,
    Status5xx,
    /// 529: the provider is overloaded.
    Overloaded,
    /// A 200 event stream whose first event was an error.
    FirstEventError,
    /// This worker's connection cap to the backend was reached.
    PoolFull,
    /// A 401 / 403: the credential's fault (a key pool tries its next credential).
    Credential,
}

impl FallbackReason {
    pub(crate) fn label(self) -> &'static str {
        match self {
            FallbackReason::Connect => "connect",
            FallbackReason::Timeout => "timeout",
            FallbackReason::Io => "io",
            FallbackReason::Status429 => "status_429",
            FallbackReason::Status5xx => "status_5xx",
            FallbackReason::Overloaded => "status_529",
            FallbackReason::FirstEventError => "first_event_error",
            FallbackReason::PoolFull => "pool_full",
            FallbackReason::Credential => "credential",
        }
    }
}

/// What one attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Judgement {
    /// `Some`: another backend may succeed (nothing reached the client yet).
    pub(crate) retry: Option<FallbackReason>,
    /// For the backend's health; `None`: known only once the response is relayed.
    pub(crate) health: Option<AttemptResult>,
    /// Reading on to judge failed or ran out of time: the response can no longer be relayed
    /// (bytes may be lost), and this is the error to answer with if no retry is made. Boxed:
    /// it is rare, and a judgement travels with every attempt's response.
    pub(crate) broken: Option<Box<GatewayError>>,
}

impl Judgement {
    fn relay() -> Judgement {
        Judgement {
            retry: None,
            health: None,
            broken: None,
        }
    }
}

/// The forward phase failed with `error` (nothing came back, or nothing usable).
pub(crate) fn judge_error(error: &GatewayError) -> Judgement {
    // The catalogue says which kinds another backend may do better on.
    let reason = error.kind.retry_elsewhere().then_some(match error.kind {
        ErrorKind::UpstreamConnect => FallbackReason::Connect,
        ErrorKind::UpstreamTimeout => FallbackReason::Timeout,
        ErrorKind::UpstreamPoolFull => FallbackReason::PoolFull,
        _ => FallbackReason::Io,
    });
    let health = match error.kind {
        // The cap is this worker's, not the backend's fault.
        ErrorKind::UpstreamPoolFull => AttemptResult::Unknown,
        kind if kind.upstream_fault().is_some() => AttemptResult::Failed,
        // Shutting down: nothing learned.
        _ => AttemptResult::Unknown,
    };
    Judgement {
        retry: reason,
        health: Some(health),
        broken: None,
    }
}

/// The most of a body read to judge it: an error body is small, and a stream's first event
/// comes early (a stream whose first event is not in this much is relayed as it is).
const MAX_JUDGED: usize = 64 * 1024;

/// Judge a response whose head is in. `may_retry`: whether a fallback is possible, so reading
/// more of the body to decide is worth it (asked only of a stream, whose first event would be
/// read; it walks the candidates). `key_pool`: the
/// attempt carried one credential of several, so a 401 / 403 is that credential's (the backend
/// answered; another credential may do). Reads go into `response.buf` (the relay sends them
/// on) until `deadline`.
pub(crate) async fn judge_response(
    response: &mut UpstreamResponse<'_>,
    may_retry: impl FnOnce() -> bool,
    key_pool: bool,
    deadline: Mono,
    bufs: &BufPool,
    watch: Option<Watch<'_>>,
) -> Judgement {
    let head = &response.head;
    let status = head.status;
    if key_pool && (status == 401 || status == 403) {
        return Judgement {
            retry: Some(FallbackReason::Credential),
            health: Some(AttemptResult::Answered),
            broken: None,
        };
    }
    let (reason, health) = match status_verdict(status, || retry_after_ms(response)) {
        Some(verdict) => verdict,
        None if status == 200 && head.event_stream && may_retry() => {
            // A chunked body is decoded into a pooled buffer to be judged.
            let mut decoded = bufs.take();
            let first = first_event(response, deadline, &mut decoded, watch).await;
            bufs.give(decoded);
            return match first {
                // Nothing learned of the backend, nothing to retry: the request is over.
                FirstEvent::Failed(_, error) if error.kind == ErrorKind::ClientLeft => Judgement {
                    retry: None,
                    health: Some(AttemptResult::Unknown),
                    broken: Some(Box::new(error)),
                },
                FirstEvent::Data { error: false } | FirstEvent::Unknown => Judgement::relay(),
                FirstEvent::Data { error: true } => Judgement {
                    retry: Some(FallbackReason::FirstEventError),
                    health: Some(AttemptResult::Failed),
                    broken: None,
                },
                FirstEvent::Failed(reason, error) => Judgement {
                    retry: Some(reason),
                    health: Some(AttemptResult::Failed),
                    broken: Some(Box::new(error)),
                },
            };
        }
        None => return Judgement::relay(),
    };
    // Read whether or not a fallback is possible: a spend limit must not cool the backend.
    match spend_limit(response, status, deadline).await {
        Ok(true) => {
            // The account's money ran out: every backend on the same account says the same,
            // and the client must be told, not kept waiting.
            Judgement {
                retry: None,
                health: Some(AttemptResult::Answered),
                broken: None,
            }
        }
        Ok(false) => Judgement {
            retry: Some(reason),
            health: Some(health),
            broken: None,
        },
        Err(error) => Judgement {
            retry: Some(reason),
            health: Some(health),
            broken: Some(Box::new(error)),
        },
    }
}

/// The statuses another backend may do better on, with what each says of the backend: a 429
/// or 529 cools it down (it is busy, not dead), a 503 with `Retry-After` too and counts as a
/// failure, 500 / 502 / 503 / 504 are failures. Any other status is the answer.
///
/// `retry_after_ms` is called only for the statuses that cool a backend: looking for two names
/// among every answer's headers, 200s too, cost ~150 instructions a request.
fn status_verdict(
    status: u16,
    retry_after_ms: impl FnOnce() -> Option<u64>,
) -> Option<(FallbackReason, AttemptResult)> {
    let cool = |ms, failed| AttemptResult::Cool { ms, failed };
    Some(match status {
        429 => (FallbackReason::Status429, cool(retry_after_ms(), false)),
        529 => (FallbackReason::Overloaded, cool(retry_after_ms(), false)),
        503 => match retry_after_ms() {
            Some(ms) => (FallbackReason::Status5xx, cool(Some(ms), true)),
            None => (FallbackReason::Status5xx, AttemptResult::Failed),
        },
        500 | 502 | 504 => (FallbackReason::Status5xx, AttemptResult::Failed),
        _ => return None,
    })
}

/// `retry-after-ms` (Azure, OpenAI), else `retry-after` in seconds; `None` when absent or an
/// HTTP date (then the configured cool-down applies).
fn retry_after_ms(response: &UpstreamResponse<'_>) -> Option<u64> {
    let buf = &response.buf;
    let value = |name: &[u8]| {
        response
            .head
            .headers
            .iter()
            .find(|h| h.name(buf).eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value(buf)).ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    value(b"retry-after-ms")
        .map(|ms| ms as u64)
        .or_else(|| value(b"retry-after").map(|s| (s * 1000.0) as u64))
}

/// Whether a 429's body says a spend or billing limit was reached (`insufficient_quota`).
/// A Content-Length body (what providers send with an error) is read to its end if it is
/// small; a body of another framing is judged on the bytes already in, since its end could
/// not be told without decoding it. `Err`: the read failed or timed out, and the response can
/// no longer be relayed.
async fn spend_limit(
    response: &mut UpstreamResponse<'_>,
    status: u16,
    deadline: Mono,
) -> Result<bool, GatewayError> {
    if status != 429 {
        return Ok(false);
    }
    let wanted = match response.head.framing() {
        crate::http::BodyFraming::Length(n) if n as usize <= MAX_JUDGED => n as usize,
        _ => 0,
    };
    loop {
        let body = &response.buf[response.head.head_len..];
        // OpenAI's code, or an Anthropic billing / spend-limit error.
        if memchr::memmem::find(body, b"insufficient_quota").is_some()
            || crate::openai::anthropic::upstream::is_spend_limit(body)
        {
            return Ok(true);
        }
        if body.len() >= wanted {
            return Ok(false);
        }
        read_more(response, deadline, None).await?;
    }
}

enum FirstEvent {
    Data {
        error: bool,
    },
    /// Not found within [`MAX_JUDGED`] bytes.
    Unknown,
    /// The upstream failed, closed or stalled before its first event: why, and the error to
    /// answer with (the response can no longer be relayed).
    Failed(FallbackReason, GatewayError),
}

/// Read until the stream's first `data:` line is in, and tell whether it is an error.
async fn first_event(
    response: &mut UpstreamResponse<'_>,
    deadline: Mono,
    decoded: &mut Vec<u8>,
    watch: Option<Watch<'_>>,
) -> FirstEvent {
    let chunked = response.head.framing() == BodyFraming::Chunked;
    // A chunked body is judged on its decoded bytes: a chunk boundary may fall inside an event.
    loop {
        let raw = &response.buf[response.head.head_len..];
        if let Some(error) = first_data_is_error(body_of(raw, chunked, decoded)) {
            return FirstEvent::Data { error };
        }
        if response.buf.len() - response.head.head_len >= MAX_JUDGED {
            return FirstEvent::Unknown;
        }
        if let Err(error) = read_more(response, deadline, watch).await {
            let reason = match error.kind {
                ErrorKind::UpstreamTimeout => FallbackReason::Timeout,
                _ => FallbackReason::Io,
            };
            return FirstEvent::Failed(reason, error);
        }
    }
}

/// One more read into `response.buf` before `deadline`. `Err` (a timeout, a failed read, the
/// upstream closing): the error to answer with; a timed-out read takes the buffer with it.
async fn read_more(
    response: &mut UpstreamResponse<'_>,
    deadline: Mono,
    watch: Option<Watch<'_>>,
) -> Result<(), GatewayError> {
    use crate::gateway::error::UpstreamFault;
    let read = read_answer(&mut response.buf, deadline, &mut response.conn, watch).await;
    let Some(outcome) = read else {
        return Err(GatewayError::client_left());
    };
    // Read afresh (the read may have finished without a wait, see forward::send).
    response.read_at = Some(crate::sys::clock::now());
    match outcome {
        ReadOutcome::Data(_) => Ok(()),
        ReadOutcome::TimedOut => Err(GatewayError::gateway_timeout(
            "the upstream answered but sent nothing more in time",
        )),
        ReadOutcome::Closed => Err(GatewayError::bad_gateway(
            UpstreamFault::Io,
            "the upstream closed the connection mid-response",
        )),
        ReadOutcome::Failed(e) => Err(GatewayError::bad_gateway(
            UpstreamFault::Io,
            format!("upstream connection failed: {e}"),
        )),
    }
}

/// The body bytes of `raw` (what came after the head so far): decoded into `decoded` when the
/// body is `chunked` (a framing error is the relay's to report: what decoded before it is
/// returned).
fn body_of<'b>(raw: &'b [u8], chunked: bool, decoded: &'b mut Vec<u8>) -> &'b [u8] {
    if !chunked {
        return raw;
    }
    decoded.clear();
    let _ = ChunkedDecoder::default().decode(raw, |d| decoded.extend_from_slice(d));
    decoded
}

/// Whether the first `data:` line of a raw event-stream body (chunk-size lines of a chunked
/// body skipped, like comments) is an error: `None` until enough of it is in to tell. A chat
/// stream's opening role-only delta is not its first event here: providers send it before an
/// error as well as before content, and the client has been told nothing by it.
pub(crate) fn first_data_is_error(body: &[u8]) -> Option<bool> {
    let mut rest = body;
    loop {
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(payload) = line.strip_prefix(b"data:") {
            let payload = payload.trim_ascii_start();
            if next.is_none() {
                // Not whole yet: enough to see the first key, unless it may be the preamble.
                if payload.len() < 24 || !is_error_payload(payload) {
                    return None;
                }
                return Some(true);
            }
            if !is_role_preamble(payload) {
                return Some(is_error_payload(payload));
            }
        }
        rest = next?;
    }
}

/// A chat chunk whose only delta is the assistant role (OpenAI, vLLM and SGLang open with one).
/// Anthropic's stream opens with `message_start` (and may `ping`) before content or an error:
/// a preamble too.
fn is_role_preamble(payload: &[u8]) -> bool {
    let find = |needle: &[u8]| memchr::memmem::find(payload, needle).is_some();
    if first_type_is(payload, b"message_start") || first_type_is(payload, b"ping") {
        return true;
    }
    (find(b"\"delta\":{\"role\":\"assistant\"}")
        || find(b"\"delta\":{\"role\":\"assistant\",\"content\":\"\"}"))
        && !find(b"\"finish_reason\":\"")
}

/// `{"error": …}` (OpenAI, mock-llm), `{"object": "error", …}` (vLLM) or
/// `{"type": "error", …}` (Anthropic).
fn is_error_payload(payload: &[u8]) -> bool {
    let Some(inner) = payload.strip_prefix(b"{") else {
        return false;
    };
    let inner = inner.trim_ascii_start();
    if inner.starts_with(b"\"error\"") {
        return true;
    }
    let prefix = &payload[..payload.len().min(64)];
    let find = |needle: &[u8]| memchr::memmem::find(prefix, needle).is_some();
    find(b"\"object\":\"error\"")
        || find(b"\"object\": \"error\"")
        || first_type_is(payload, b"error")
}

/// Whether a JSON object's first member is `"type": "<name>"` (Anthropic's events lead with it).
fn first_type_is(payload: &[u8], name: &[u8]) -> bool {
    let rest = payload.trim_ascii_start();
    let Some(rest) = rest.strip_prefix(b"{") else {
        return false;
    };
    let Some(rest) = rest.trim_ascii_start().strip_prefix(b"\"type\"") else {
        return false;
    };
    let Some(rest) = rest.trim_ascii_start().strip_prefix(b":") else {
        return false;
    };
    let Some(rest) = rest.trim_ascii_start().strip_prefix(b"\"") else {
        return false;
    };
    rest.strip_prefix(name)
        .is_some_and(|r| r.starts_with(b"\""))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn anthropic_streams_open_with_a_preamble_and_fail_with_a_type_error() {
        let start = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":5}}}\n\n";
        let ping = b"event: ping\ndata: {\"type\": \"ping\"}\n\n";
        let error = b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        let text = b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n";
        assert_eq!(
            first_data_is_error(start),
            None,
            "a preamble alone tells nothing"
        );
        assert_eq!(
            first_data_is_error(&[&start[..], ping, error].concat()),
            Some(true)
        );
        assert_eq!(
            first_data_is_error(&[&start[..], text].concat()),
            Some(false)
        );
    }

    #[test]
    fn a_chunk_boundary_inside_the_first_event_does_not_hide_an_error() {
        // `data: {"err` in one chunk, the rest of the event in the next.
        let raw =
            b"b\r\ndata: {\"err\r\n2f\r\nor\":{\"message\":\"overloaded\",\"type\":\"x\"}}\n\n\r\n";
        let mut scratch = Vec::new();
        assert_eq!(
            first_data_is_error(body_of(raw, true, &mut scratch)),
            Some(true)
        );
        // Only part of the second chunk in: not enough to tell yet.
        let partial = &raw[..24];
        assert_eq!(
            first_data_is_error(body_of(partial, true, &mut scratch)),
            None
        );
    }

    #[test]
    fn the_first_data_line_decides() {
        let error = b"data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\"}}\n\n";
        assert_eq!(first_data_is_error(error), Some(true));
        let content = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\"}\n\n";
        assert_eq!(first_data_is_error(content), Some(false));
        // Comments (mock-llm's echo may quote `data: {"error"` from the prompt) are skipped.
        let comment = b": echo {\"body\":\"data: {\\\"error\\\"\"}\n\ndata: {\"id\":\"x\",\"object\":\"y\"}\n\n";
        assert_eq!(first_data_is_error(comment), Some(false));
        // Chunked framing: the size lines are skipped like any line that is not `data:`.
        let chunked = b"3a\r\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n\r\n";
        assert_eq!(first_data_is_error(chunked), Some(true));
        // A role-only opening delta is passed over; what follows decides.
        let role = b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"},\"finish_reason\":null}]}\n\n";
        let then_error = [&role[..], &error[..]].concat();
        assert_eq!(first_data_is_error(&then_error), Some(true));
        let then_content = [&role[..], &content[..]].concat();
        assert_eq!(first_data_is_error(&then_content), Some(false));
        assert_eq!(first_data_is_error(role), None);
        // vLLM's shape.
        let vllm = b"data: {\"object\":\"error\",\"message\":\"x\"}\n\n";
        assert_eq!(first_data_is_error(vllm), Some(true));
        // Not enough yet.
        assert_eq!(first_data_is_error(b": echo"), None);
        assert_eq!(first_data_is_error(b"data: {\"err"), None);
        assert_eq!(first_data_is_error(b""), None);
        // `[DONE]` first: not an error.
        assert_eq!(first_data_is_error(b"data: [DONE]\n\n"), Some(false));
    }

    #[test]
    fn statuses_that_move_on_and_statuses_that_do_not() {
        for status in [429, 500, 502, 503, 504, 529] {
            assert!(status_verdict(status, || None).is_some(), "{status}");
        }
        for status in [200, 400, 401, 403, 404, 408, 413, 422, 501] {
            let verdict = status_verdict(status, || panic!("{status} read Retry-After"));
            assert!(verdict.is_none(), "{status}");
        }
        // Failures that do not cool the backend do not read Retry-After either.
        for status in [500, 502, 504] {
            let verdict = status_verdict(status, || panic!("{status} read Retry-After"));
            assert_eq!(verdict.unwrap().1, AttemptResult::Failed);
        }
        let cool = |ms, failed| AttemptResult::Cool { ms, failed };
        assert_eq!(
            status_verdict(429, || Some(2_000)).unwrap().1,
            cool(Some(2_000), false)
        );
        assert_eq!(status_verdict(529, || None).unwrap().1, cool(None, false));
        assert_eq!(
            status_verdict(503, || Some(1_000)).unwrap().1,
            cool(Some(1_000), true)
        );
        assert_eq!(
            status_verdict(503, || None).unwrap().1,
            AttemptResult::Failed
        );
    }

    #[test]
    fn errors_that_move_on_and_errors_that_do_not() {
        use crate::gateway::error::UpstreamFault;
        let connect = GatewayError::bad_gateway(UpstreamFault::Connect, "refused");
        assert_eq!(judge_error(&connect).retry, Some(FallbackReason::Connect));
        assert_eq!(judge_error(&connect).health, Some(AttemptResult::Failed));
        let timeout = GatewayError::gateway_timeout("slow");
        assert_eq!(judge_error(&timeout).retry, Some(FallbackReason::Timeout));
        let stopping = GatewayError::shutting_down();
        assert_eq!(judge_error(&stopping).retry, None);
        assert_eq!(judge_error(&stopping).health, Some(AttemptResult::Unknown));
    }
}
