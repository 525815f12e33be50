//! Relay: pass the upstream's response to the client as it arrives.
//!
//! Runs once the forward phase has a response head. Takes the client socket, the
//! [`UpstreamResponse`] and how the client asked (HEAD or not, HTTP/1.0 or 1.1, keep-alive);
//! writes the response head together with the first body bytes, then writes every upstream read
//! to the client before issuing the next read — nothing is buffered or coalesced. Content-Length
//! bodies pass through as they are; chunked and close-delimited bodies are decoded and re-framed
//! as clean chunks (extensions and trailers dropped) for HTTP/1.1 clients. Returns whether the
//! client connection can serve another request. While relaying it watches the client socket: if
//! the client leaves, the upstream connection is shut down at once. If the upstream stalls past
//! `stream_idle`, ends early or sends a malformed chunk, an event stream ends with an SSE error
//! event (its framing stays valid), any other body is cut by closing the client connection. The
//! upstream connection goes back to the pool only after a complete, well-framed response.
//!
//! When the forward phase asked the upstream for stream usage on the client's behalf
//! ([`ClientSide::strip_usage`]), the usage-only chunk is metered but not relayed
//! ([`strip::UsageStrip`]): the one exception to relaying each read whole is that the unfinished
//! event at the end of a read is then held until it ends (bounded by the meter's event limit).

use std::io::Write as _;
use std::pin::pin;
use std::time::Instant;

use crate::gateway::context::{ClientSocket, Io};
use crate::gateway::error::{GatewayError, UpstreamFault};
use crate::gateway::forward::UpstreamResponse;
use crate::gateway::observe::Observation;
use crate::http::chunked::{encode_chunk, ChunkedDecoder, LAST_CHUNK};
use crate::http::reason;
use crate::http::{is_hop_by_hop, BodyFraming};
use crate::openai::meter::DEFAULT_MAX_EVENT;

mod strip;

use strip::UsageStrip;

/// How the client asked for the response.
#[derive(Debug, Clone, Copy)]
pub struct ClientSide {
    pub head_only: bool,
    pub minor_version: u8,
    pub keep_alive: bool,
    /// Usage was requested from the upstream for this client, which did not ask for it: an
    /// event stream's usage-only chunk goes to the meter but not to the client.
    pub strip_usage: bool,
}

/// How a relayed response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayEnd {
    /// The whole body reached the client.
    Complete,
    /// The client left, or stopped taking bytes, before the end.
    ClientLeft,
    /// The upstream failed, stalled or sent garbage mid-body; the client got an SSE error
    /// event (event streams) or a cut connection.
    UpstreamCut(UpstreamFault),
}

/// What [`relay`] returns once a response has started to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relayed {
    /// The client connection can serve another request.
    pub keep_alive: bool,
    pub end: RelayEnd,
}

/// How the body reaches the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClientFraming {
    /// Nothing after the head.
    Empty,
    /// Same bytes as the upstream sent, Content-Length framed.
    Passthrough,
    /// Re-framed as chunks.
    Chunked,
    /// Raw bytes, ended by closing the connection (HTTP/1.0 clients).
    Close,
}

/// How the upstream body is delimited, with progress.
enum UpstreamBody {
    Done,
    Length(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
}

/// Why the body stopped before its end.
enum Cut {
    /// The client left, or stopped taking bytes.
    Client,
    /// The upstream failed, stalled or sent garbage.
    Upstream(GatewayError),
}

pub async fn relay(
    io: Io<'_>,
    client: &mut ClientSocket,
    response: UpstreamResponse<'_>,
    side: ClientSide,
    obs: &mut Observation,
) -> Result<Relayed, GatewayError> {
    let UpstreamResponse {
        mut conn,
        head,
        buf: mut ubuf,
        in_flight: _in_flight, // the exchange counts as in flight until the relay returns
    } = response;
    let timeouts = io.timeouts;
    let framing = head.framing();
    let event_stream = head.event_stream;
    let mut keep_client = side.keep_alive;
    let strip_usage = side.strip_usage && event_stream;
    let client_framing = match framing {
        BodyFraming::None => ClientFraming::Empty,
        _ if side.head_only => ClientFraming::Empty,
        // A stripped body is shorter than the upstream's Content-Length: re-frame it.
        BodyFraming::Length(_) if strip_usage && side.minor_version >= 1 => ClientFraming::Chunked,
        BodyFraming::Length(_) if strip_usage => {
            keep_client = false;
            ClientFraming::Close
        }
        BodyFraming::Length(_) => ClientFraming::Passthrough,
        BodyFraming::Chunked | BodyFraming::UntilClose if side.minor_version >= 1 => {
            ClientFraming::Chunked
        }
        BodyFraming::Chunked | BodyFraming::UntilClose => {
            keep_client = false;
            ClientFraming::Close
        }
    };

    // The head.
    let mut out = io.bufs.take();
    let _ = write!(out, "HTTP/1.1 {} ", head.status);
    let upstream_reason = &ubuf[head.reason.0..head.reason.1];
    if upstream_reason.is_empty() {
        out.extend_from_slice(reason(head.status).as_bytes());
    } else {
        out.extend_from_slice(upstream_reason);
    }
    out.extend_from_slice(b"\r\n");
    for h in &head.headers {
        let name = h.name(&ubuf);
        let keep_length = side.head_only && name.eq_ignore_ascii_case(b"content-length");
        if is_hop_by_hop(name) && !keep_length {
            continue;
        }
        out.extend_from_slice(name);
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value(&ubuf));
        out.extend_from_slice(b"\r\n");
    }
    match (client_framing, framing) {
        (ClientFraming::Passthrough, BodyFraming::Length(n)) => {
            let _ = write!(out, "content-length: {n}\r\n");
        }
        (ClientFraming::Chunked, _) => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        (ClientFraming::Empty, _)
            if !side.head_only && head.status != 204 && head.status != 304 =>
        {
            out.extend_from_slice(b"content-length: 0\r\n");
        }
        _ => {}
    }
    if !keep_client {
        out.extend_from_slice(b"connection: close\r\n");
    }
    obs.response_started(
        head.status,
        event_stream,
        client_framing != ClientFraming::Empty,
    );
    out.extend_from_slice(obs.rate_headers.as_bytes());
    let _ = write!(
        out,
        "x-sluice-overhead-us: {}\r\n\r\n",
        obs.overhead_so_far(Instant::now()).as_micros()
    );

    let mut body = match framing {
        BodyFraming::None => UpstreamBody::Done,
        BodyFraming::Length(n) => UpstreamBody::Length(n),
        BodyFraming::Chunked => UpstreamBody::Chunked(ChunkedDecoder::default()),
        BodyFraming::UntilClose => UpstreamBody::UntilClose,
    };
    // A HEAD response has no body whatever its headers say.
    if side.head_only && !matches!(body, UpstreamBody::Done) && framing != BodyFraming::UntilClose {
        body = UpstreamBody::Done;
    }

    let mut strip = (strip_usage && client_framing != ClientFraming::Empty)
        .then(|| UsageStrip::new(DEFAULT_MAX_EVENT, io.bufs.take()));

    // Body bytes that arrived with the head go out in the same write as the head.
    // `clean`: no bytes beyond the body's end arrived, so the connection may be reused.
    let mut clean;
    let mut cut: Option<Cut> = None;
    let head_read_at = obs.upstream_head_at.unwrap_or_else(Instant::now);
    match feed(
        &mut body,
        &ubuf[head.head_len..],
        client_framing,
        &mut out,
        obs,
        strip.as_mut(),
        head_read_at,
    ) {
        Ok(extra) => clean = !extra,
        Err(e) => {
            // Nothing reached the client yet: it gets a plain 502 instead.
            conn.abort();
            io.bufs.give(out);
            if let Some(strip) = strip {
                io.bufs.give(strip.into_buffer());
            }
            return Err(e);
        }
    }

    if cut.is_none() {
        obs.relay_overhead += head_read_at.elapsed();
        obs.bytes_out += out.len() as u64;
        let (res, returned) = client
            .write_all(out, timeouts.stream_idle, io.load.direct_writes())
            .await;
        out = returned;
        if res.is_err() {
            cut = Some(Cut::Client);
        }
    }

    // Whether the chunked framing's last chunk has been sent.
    let mut terminated = false;
    // The rest of the body, one upstream read at a time.
    let mut watching = true;
    while cut.is_none() && !matches!(body, UpstreamBody::Done) {
        out.clear();
        ubuf.clear();
        if ubuf.capacity() < 16 * 1024 {
            ubuf.reserve(16 * 1024);
        }
        let cap = ubuf.capacity();
        let mut read = pin!(monoio::time::timeout(
            timeouts.stream_idle,
            conn.io.read(monoio::buf::IoBufMut::slice_mut(
                std::mem::take(&mut ubuf),
                0..cap
            )),
        ));
        // Wait for the upstream, watching the client meanwhile. The read is never dropped
        // unless the client is gone, so no upstream bytes can be lost to a cancelled read. The
        // watch borrows the client socket and ends with this block, before the write below
        // takes it mutably.
        let read_result = {
            let mut watch = pin!(client.readable());
            loop {
                if !watching {
                    break Some((&mut read).await);
                }
                monoio::select! {
                    biased;
                    r = &mut read => break Some(r),
                    _ = &mut watch => {
                        if client.peer_gone() {
                            break None;
                        }
                        // The client sent its next request early: stop watching for this one.
                        watching = false;
                    }
                }
            }
        };
        let Some(read_result) = read_result else {
            cut = Some(Cut::Client);
            break;
        };
        let n = match read_result {
            Err(_) => {
                cut = Some(Cut::Upstream(GatewayError::gateway_timeout(
                    "the upstream stream stalled",
                )));
                break;
            }
            Ok((res, slice)) => {
                ubuf = slice.into_inner();
                match res {
                    Ok(n) => n,
                    Err(e) => {
                        cut = Some(Cut::Upstream(GatewayError::bad_gateway(
                            UpstreamFault::Io,
                            format!("upstream connection failed mid-response: {e}"),
                        )));
                        break;
                    }
                }
            }
        };
        if n == 0 {
            if matches!(body, UpstreamBody::UntilClose) {
                body = UpstreamBody::Done;
                clean = false;
                break;
            }
            cut = Some(Cut::Upstream(GatewayError::bad_gateway(
                UpstreamFault::Io,
                "the upstream closed the connection mid-response",
            )));
            break;
        }
        let read_at = Instant::now();
        let whole_read_passes_through = client_framing == ClientFraming::Passthrough
            && strip.is_none()
            && matches!(body, UpstreamBody::Length(remaining) if remaining >= n as u64);
        if whole_read_passes_through {
            // The whole read is body the client gets unchanged: hand the read buffer itself to
            // the client write instead of copying it into `out` (one copy less of every read
            // after the first; the first, which carries the head, is still copied). The body
            // is counted down and metered as `feed` would; a Length body can't fail or overrun.
            let _ = emit_body(&mut body, &ubuf[..n], |data| obs.body(data, read_at));
            ubuf.truncate(n);
            std::mem::swap(&mut out, &mut ubuf);
        } else {
            match feed(
                &mut body,
                &ubuf[..n],
                client_framing,
                &mut out,
                obs,
                strip.as_mut(),
                read_at,
            ) {
                Ok(extra) => clean &= !extra,
                Err(e) => {
                    cut = Some(Cut::Upstream(e));
                    break;
                }
            }
        }
        if client_framing == ClientFraming::Chunked && matches!(body, UpstreamBody::Done) {
            // The body ended in this read: its last chunk goes out in the same write.
            out.extend_from_slice(LAST_CHUNK);
            terminated = true;
        }
        obs.relay_overhead += read_at.elapsed();
        if !out.is_empty() {
            obs.bytes_out += out.len() as u64;
            let (res, returned) = client
                .write_all(
                    std::mem::take(&mut out),
                    timeouts.stream_idle,
                    io.load.direct_writes(),
                )
                .await;
            out = returned;
            if res.is_err() {
                cut = Some(Cut::Client);
            }
        }
    }

    let end = match &cut {
        None => RelayEnd::Complete,
        Some(Cut::Client) => RelayEnd::ClientLeft,
        Some(Cut::Upstream(e)) => {
            RelayEnd::UpstreamCut(e.upstream_fault().unwrap_or(UpstreamFault::Io))
        }
    };
    let keep_alive = match cut {
        None => {
            out.clear();
            // A close-delimited body ended: an unfinished event held back goes out as it came.
            if let Some(strip) = strip.as_mut() {
                strip.finish(|data| frame(client_framing, data, &mut out));
            }
            if client_framing == ClientFraming::Chunked && !terminated {
                out.extend_from_slice(LAST_CHUNK);
            }
            if !out.is_empty() {
                obs.bytes_out += out.len() as u64;
                let (res, returned) = client
                    .write_all(out, timeouts.stream_idle, io.load.direct_writes())
                    .await;
                out = returned;
                keep_client &= res.is_ok();
            }
            if clean && head.keep_alive && matches!(body, UpstreamBody::Done) {
                io.pools.checkin(conn);
            } else {
                conn.abort();
            }
            keep_client
        }
        Some(Cut::Client) => {
            conn.abort();
            false
        }
        Some(Cut::Upstream(error)) => {
            conn.abort();
            // An event stream learns why through an error event and a proper end; any other
            // body can only be cut, so the client sees it incomplete. `out` still holds the
            // well-formed data decoded before the fault.
            if event_stream && client_framing == ClientFraming::Chunked {
                // What was held back goes first, as it would have without stripping.
                if let Some(strip) = strip.as_mut() {
                    strip.finish(|data| frame(client_framing, data, &mut out));
                }
                encode_chunk(error.sse_event().as_bytes(), &mut out);
                out.extend_from_slice(LAST_CHUNK);
                obs.bytes_out += out.len() as u64;
                let (res, returned) = client
                    .write_all(out, timeouts.stream_idle, io.load.direct_writes())
                    .await;
                out = returned;
                keep_client && res.is_ok()
            } else {
                false
            }
        }
    };
    obs.finished_at = Some(Instant::now());
    obs.end = Some(end);
    io.bufs.give(out);
    io.bufs.give(ubuf);
    if let Some(strip) = strip {
        io.bufs.give(strip.into_buffer());
    }
    Ok(Relayed { keep_alive, end })
}

/// Append decoded body bytes to `out` in the client's framing.
fn frame(framing: ClientFraming, data: &[u8], out: &mut Vec<u8>) {
    match framing {
        ClientFraming::Chunked => encode_chunk(data, out),
        ClientFraming::Passthrough | ClientFraming::Close => out.extend_from_slice(data),
        ClientFraming::Empty => {}
    }
}

/// Move `input` (upstream body bytes) into `out` in the client's framing, through `strip` when
/// the usage chunk is withheld. Returns whether bytes beyond the end of the body arrived (the
/// upstream connection then can't be reused).
fn feed(
    body: &mut UpstreamBody,
    input: &[u8],
    framing: ClientFraming,
    out: &mut Vec<u8>,
    obs: &mut Observation,
    mut strip: Option<&mut UsageStrip>,
    now: Instant,
) -> Result<bool, GatewayError> {
    let mut emit = |data: &[u8]| {
        // The meter looks at the decoded bytes, all of them; it never holds them back.
        obs.body(data, now);
        match strip.as_deref_mut() {
            Some(strip) => strip.feed(
                data,
                |event| obs.is_usage_only_event(event),
                |data| frame(framing, data, out),
            ),
            None => frame(framing, data, out),
        }
    };
    let extra = emit_body(body, input, &mut emit)?;
    if let (UpstreamBody::Done, Some(strip)) = (body, strip) {
        // The body ended: an unfinished event held back goes out as it came.
        strip.finish(|data| frame(framing, data, out));
    }
    Ok(extra)
}

/// Decode `input` per the upstream's framing, passing the body bytes to `emit`. Returns whether
/// bytes beyond the end of the body arrived.
fn emit_body(
    body: &mut UpstreamBody,
    input: &[u8],
    mut emit: impl FnMut(&[u8]),
) -> Result<bool, GatewayError> {
    match body {
        UpstreamBody::Done => Ok(!input.is_empty()),
        UpstreamBody::Length(remaining) => {
            let take = (*remaining).min(input.len() as u64) as usize;
            emit(&input[..take]);
            *remaining -= take as u64;
            let extra = take < input.len();
            if *remaining == 0 {
                *body = UpstreamBody::Done;
            }
            Ok(extra)
        }
        UpstreamBody::Chunked(decoder) => {
            let used = decoder.decode(input, &mut emit).map_err(|e| {
                GatewayError::bad_gateway(
                    UpstreamFault::Protocol,
                    format!("malformed chunked response from the upstream: {}", e.0),
                )
            })?;
            let extra = used < input.len();
            if decoder.is_done() {
                *body = UpstreamBody::Done;
            }
            Ok(extra)
        }
        UpstreamBody::UntilClose => {
            emit(input);
            Ok(false)
        }
    }
}
