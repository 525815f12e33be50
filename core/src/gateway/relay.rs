//! Relay: pass the upstream's response to the client as it arrives.
//!
//! Runs once the forward phase has a response head. Takes the client socket, the
//! [`UpstreamResponse`] and how the client asked (HEAD or not, HTTP/1.0 or 1.1, keep-alive);
//! writes the response head together with the first body bytes, then writes every upstream read
//! to the client before issuing the next read — nothing is buffered or coalesced. Content-Length
//! bodies pass through as they are; chunked and close-delimited bodies are decoded and re-framed
//! as clean chunks (extensions and trailers dropped) for HTTP/1.1 clients. A non-streamed
//! Content-Length answer (up to the 4 MiB the meter reads) is not copied at all: its reads
//! accumulate in the read buffer behind the response head, go to the client from there (the
//! head and the first bytes in one vectored write), and the buffer becomes the meter's
//! ([`KeptBody`]). Returns whether the client connection can serve another request. While
//! relaying it watches the client socket: if the client leaves, the upstream connection is shut
//! down at once (noticed by the next write, or by the watch, armed once [`WATCH_AFTER`] passed
//! without output to the client). If the upstream stalls past `stream_idle`, ends early or
//! sends a malformed chunk, an event stream ends with an SSE error event (its framing stays
//! valid), any other body is cut by closing the client connection. The upstream connection goes
//! back to the pool only after a complete, well-framed response.
//!
//! Stopping (see [`Drain`](crate::gateway::context::Drain)): a response head written while the
//! worker drains says `connection: close`. When the shutdown grace runs out the runtime shuts
//! the upstream connections down; the relay sees that as an upstream cut and, the grace being
//! over, ends the response the same way but as a shutdown ([`RelayEnd::Shutdown`]: the SSE error
//! event carries `server_shutting_down`). Nothing is checked per event.
//!
//! When the forward phase asked the upstream for stream usage on the client's behalf
//! ([`ClientSide::strip_usage`]), the usage-only chunk is metered but not relayed
//! ([`strip::UsageStrip`]): the one exception to relaying each read whole is that the unfinished
//! event at the end of a read is then held until it ends (bounded by the meter's event limit).

use std::pin::pin;

use crate::gateway::context::Io;
use crate::gateway::error::{GatewayError, UpstreamFault};
use crate::gateway::forward::{UpstreamResponse, WATCH_AFTER};
use crate::gateway::record::{Observation, RelayEnd};
use crate::http::chunked::{encode_chunk, ChunkedDecoder, LAST_CHUNK};
use crate::http::pass::{starts_with_ignore_case, HeaderPass};
use crate::http::reason;
use crate::http::response::ResponseHead;
use crate::http::{is_hop_by_hop, named_by_connection, push_decimal, BodyFraming};
use crate::openai::endpoint::ClientDialect;
use crate::openai::meter::DEFAULT_MAX_EVENT;
use crate::sys::client::ClientSocket;
use crate::sys::clock::{self, Mono};
use crate::sys::stream::{self, ReadOutcome};
use crate::upstream::UpstreamConn;

mod strip;
pub(crate) mod translate;

use strip::UsageStrip;
use translate::StreamTranslate;

/// How often a TLS client whose watch woke on bytes of its session (an alert, say) is checked
/// for a hang-up, while the relay waits on the upstream: within `WATCH_AFTER`, the promise.
const TLS_HANGUP_CHECK: std::time::Duration = WATCH_AFTER;

/// How the client asked for the response.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientSide<'p> {
    pub(crate) head_only: bool,
    pub(crate) minor_version: u8,
    pub(crate) keep_alive: bool,
    /// Usage was requested from the upstream for this client, which did not ask for it: an
    /// event stream's usage-only chunk goes to the meter but not to the client.
    pub(crate) strip_usage: bool,
    /// The API the client speaks: the shape of an error event that ends its stream early.
    pub(crate) dialect: ClientDialect,
    /// The upstream response headers the client may see (the cluster's).
    pub(crate) pass: &'p HeaderPass,
}

/// What [`relay`] returns once a response has started to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Relayed {
    /// The client connection can serve another request.
    pub(crate) keep_alive: bool,
    pub(crate) end: RelayEnd,
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
    /// The shutdown grace ran out (the runtime shut the upstream connection down).
    Shutdown,
}

pub(crate) async fn relay(
    io: Io<'_>,
    client: &mut ClientSocket,
    response: UpstreamResponse<'_>,
    side: ClientSide<'_>,
    obs: &mut Observation,
    translate: Option<Box<StreamTranslate>>,
) -> Result<Relayed, GatewayError> {
    let UpstreamResponse {
        conn,
        head,
        buf: ubuf,
        in_flight: _in_flight, // the exchange counts as in flight until the relay returns
        read_at,
    } = response;
    // A translated body's length is not the upstream's: it goes out re-framed.
    let translate = translate.filter(|_| head.event_stream);
    let head_read_at = read_at
        .or(obs.forward.head_at)
        .unwrap_or_else(clock::recent);
    let mut plan = Plan::new(&head, side, translate.is_some());
    if io.drain.draining() {
        // Stopping: this response is the connection's last.
        plan.keep_client = false;
    }
    let mut relay = Relay {
        io,
        client,
        obs,
        conn,
        out: io.bufs.take(),
        ubuf,
        kept: None,
        strip: (plan.strip_usage && plan.framing != ClientFraming::Empty)
            .then(|| UsageStrip::new(DEFAULT_MAX_EVENT, io.bufs.take())),
        body: plan.upstream_body(&head, side),
        translate,
        plan,
        clean: true,
        terminated: false,
        last_output: head_read_at,
        head_sent: false,
    };

    // The head, and the body bytes that came with it, in one write (an upstream fault in
    // those bytes is answered as a plain 502: nothing reached the client yet).
    relay.write_head(&head, side);
    if let Err(e) = relay.feed_first_read(head.head_len, head_read_at) {
        relay.close(false);
        return Err(e);
    }
    let mut cut = relay.send_out(head_read_at).await;

    // The rest of the body, one upstream read at a time.
    if cut.is_none() {
        cut = relay.pump().await.map(|c| relay.past_grace(c));
    }
    // A body that ended where its framing says, but whose events never finished, was cut all
    // the same.
    if cut.is_none() && relay.truncated() {
        cut = Some(relay.cut_short());
    }

    // The end: the last chunk (or an SSE error event), the upstream connection back to the pool
    // or closed.
    let end = match &cut {
        None => RelayEnd::Complete,
        Some(Cut::Client) => RelayEnd::ClientLeft,
        Some(Cut::Upstream(e)) => {
            RelayEnd::UpstreamCut(e.upstream_fault().unwrap_or(UpstreamFault::Io))
        }
        Some(Cut::Shutdown) => RelayEnd::Shutdown,
    };
    relay.obs.end = Some(end);
    let (keep_alive, reusable) = relay.finish(cut, head.keep_alive).await;
    relay.close(reusable);
    Ok(Relayed { keep_alive, end })
}

/// The most of a non-streamed answer read to be translated (a chat completion is kilobytes).
const MAX_TRANSLATED_BODY: usize = 16 << 20;

/// Relay a non-streamed answer (or any error) of an upstream that speaks another dialect: the
/// whole body is read (within `timeouts.stream_idle` per read, at most 16 MiB), translated —
/// `translate(status, body, out)` returns the status for the client — and sent with its own
/// `Content-Length`, metered like a non-streamed OpenAI answer: the translated body, or with
/// `meter_upstream` (the upstream speaks OpenAI, the client not) the upstream's. A body that
/// cannot be read whole, or a 2xx the translator cannot read, is a 502 (nothing was sent yet).
pub(crate) async fn relay_translated_whole(
    io: Io<'_>,
    client: &mut ClientSocket,
    response: UpstreamResponse<'_>,
    side: ClientSide<'_>,
    obs: &mut Observation,
    meter_upstream: bool,
    translate: impl FnOnce(u16, &[u8], &mut Vec<u8>) -> Result<u16, GatewayError>,
) -> Result<Relayed, GatewayError> {
    let UpstreamResponse {
        mut conn,
        head,
        buf: mut ubuf,
        in_flight: _in_flight,
        read_at: _,
    } = response;
    let plan = Plan::new(&head, side, false);
    let mut upstream = plan.upstream_body(&head, side);
    let mut body = io.bufs.take();
    let mut clean = true;
    let mut ended = emit_body(&mut upstream, &ubuf[head.head_len..], |d| {
        body.extend_from_slice(d)
    })
    .map(|extra| clean &= !extra);
    while ended.is_ok() && !matches!(upstream, UpstreamBody::Done) {
        if body.len() > MAX_TRANSLATED_BODY {
            ended = Err(GatewayError::bad_gateway(
                UpstreamFault::Protocol,
                "the upstream's answer is too large to translate",
            ));
            break;
        }
        ubuf.clear();
        let read = stream::read_spare(
            &mut ubuf,
            16 * 1024,
            16 * 1024,
            usize::MAX,
            io.timeouts.stream_idle,
            |b| conn.io.read(b),
        )
        .await;
        ended = take_read(read, &mut upstream, &ubuf, &mut body, &mut clean);
    }
    let mut translated = io.bufs.take();
    let status = ended.and_then(|()| translate(head.status, &body, &mut translated));
    io.bufs.give(ubuf);
    let status = match status {
        Ok(status) => status,
        Err(e) => {
            conn.abort();
            io.bufs.give(body);
            io.bufs.give(translated);
            return Err(e);
        }
    };
    if clean && head.keep_alive {
        io.pools.checkin(conn);
    } else {
        conn.abort();
    }
    let keep_client = side.keep_alive && !io.drain.draining();
    let mut out = io.bufs.take();
    let len = if side.head_only { 0 } else { translated.len() };
    write_whole_head(&mut out, side, status, len, keep_client, obs);
    if !side.head_only {
        let now = clock::recent();
        obs.body(if meter_upstream { &body } else { &translated }, now);
        out.extend_from_slice(&translated);
    }
    io.bufs.give(body);
    io.bufs.give(translated);
    obs.bytes_out += out.len() as u64;
    let (res, returned) = client
        .write_all(out, io.timeouts.stream_idle, io.load.direct_writes())
        .await;
    io.bufs.give(returned);
    // Read afresh: the last write may have finished without a wait.
    obs.finished_at = Some(clock::now());
    let end = if res.is_ok() {
        RelayEnd::Complete
    } else {
        RelayEnd::ClientLeft
    };
    obs.end = Some(end);
    Ok(Relayed {
        keep_alive: keep_client && res.is_ok(),
        end,
    })
}

/// Take one read of a whole answer into `body` (decoded), or say why the answer cannot be
/// read whole; `clean` turns false when the connection cannot be reused after it.
fn take_read(
    read: ReadOutcome,
    upstream: &mut UpstreamBody,
    ubuf: &[u8],
    body: &mut Vec<u8>,
    clean: &mut bool,
) -> Result<(), GatewayError> {
    match read {
        ReadOutcome::Data(n) => emit_body(upstream, &ubuf[..n], |d| body.extend_from_slice(d))
            .map(|extra| *clean &= !extra),
        ReadOutcome::Closed if matches!(upstream, UpstreamBody::UntilClose) => {
            *upstream = UpstreamBody::Done;
            *clean = false;
            Ok(())
        }
        ReadOutcome::Closed => Err(GatewayError::bad_gateway(
            UpstreamFault::Io,
            "the upstream closed the connection mid-response",
        )),
        ReadOutcome::TimedOut => Err(GatewayError::gateway_timeout(
            "the upstream's answer stalled",
        )),
        ReadOutcome::Failed(e) => Err(GatewayError::bad_gateway(
            UpstreamFault::Io,
            format!("upstream connection failed mid-response: {e}"),
        )),
    }
}

/// The head of a translated whole answer: its status, JSON of `len` bytes, the rate headers
/// and the overhead so far; the response counts as started.
fn write_whole_head(
    out: &mut Vec<u8>,
    side: ClientSide<'_>,
    status: u16,
    len: usize,
    keep_client: bool,
    obs: &mut Observation,
) {
    out.extend_from_slice(b"HTTP/1.");
    push_decimal(out, side.minor_version);
    out.push(b' ');
    push_decimal(out, status);
    out.push(b' ');
    out.extend_from_slice(reason(status).as_bytes());
    out.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
    push_decimal(out, len);
    out.extend_from_slice(b"\r\n");
    if !keep_client {
        out.extend_from_slice(b"connection: close\r\n");
    }
    obs.response_started(status, false, !side.head_only);
    out.extend_from_slice(obs.rate_headers.as_bytes());
    push_overhead(out, obs.overhead_so_far(clock::now()));
}

/// What the response's head decides for the whole relay.
#[derive(Debug, Clone, Copy)]
struct Plan {
    framing: ClientFraming,
    event_stream: bool,
    strip_usage: bool,
    /// The client connection may serve another request (as far as framing allows).
    keep_client: bool,
    dialect: ClientDialect,
}

impl Plan {
    fn new(head: &ResponseHead, side: ClientSide<'_>, translated: bool) -> Plan {
        let mut keep_client = side.keep_alive;
        let strip_usage = side.strip_usage && head.event_stream;
        let reframed = strip_usage || translated;
        let framing = match head.framing() {
            BodyFraming::None => ClientFraming::Empty,
            _ if side.head_only => ClientFraming::Empty,
            // A stripped or translated body is not the upstream's Content-Length: re-frame it.
            BodyFraming::Length(_) if reframed && side.minor_version >= 1 => ClientFraming::Chunked,
            BodyFraming::Length(_) if reframed => {
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
        Plan {
            framing,
            event_stream: head.event_stream,
            strip_usage,
            keep_client,
            dialect: side.dialect,
        }
    }

    /// How the upstream's body is delimited. A HEAD response has no body whatever its headers
    /// say (unless it is close-delimited: then the close ends it).
    fn upstream_body(&self, head: &ResponseHead, side: ClientSide<'_>) -> UpstreamBody {
        let framing = head.framing();
        match framing {
            BodyFraming::None => UpstreamBody::Done,
            _ if side.head_only && framing != BodyFraming::UntilClose => UpstreamBody::Done,
            BodyFraming::Length(n) => UpstreamBody::Length(n),
            BodyFraming::Chunked => UpstreamBody::Chunked(ChunkedDecoder::default()),
            BodyFraming::UntilClose => UpstreamBody::UntilClose,
        }
    }
}

/// One relay in progress: the two connections, the buffers, and where the body stands.
struct Relay<'r, 'w> {
    io: Io<'w>,
    client: &'r mut ClientSocket,
    obs: &'r mut Observation,
    conn: UpstreamConn,
    /// What goes to the client next.
    out: Vec<u8>,
    /// What came from the upstream last (or, with `kept`, all of the body so far).
    ubuf: Vec<u8>,
    /// The body is kept whole in `ubuf` for the meter, and goes to the client from there.
    kept: Option<KeptBody>,
    strip: Option<UsageStrip>,
    body: UpstreamBody,
    /// The upstream speaks another dialect: its events are translated on the way in.
    translate: Option<Box<StreamTranslate>>,
    plan: Plan,
    /// No bytes beyond the body's end arrived, so the upstream connection may be reused.
    clean: bool,
    /// The chunked framing's last chunk has been sent.
    terminated: bool,
    /// When the upstream read behind the last bytes written to the client arrived (the
    /// response head's, to begin with): the client watch counts its delay from here.
    last_output: Mono,
    /// The head has gone to the client (with the body bytes read with it).
    head_sent: bool,
}

/// A Content-Length body passed through unchanged and kept whole for the meter
/// ([`Observation::keeps_whole_body`]) where it is read: each upstream read lands in `ubuf`
/// behind the ones before (the first behind the response head), goes to the client from there
/// (the first together with the head, in one vectored write), and at the end `ubuf` becomes the
/// metered body. Not a byte of the body is copied — a non-streamed answer was copied twice
/// before, into the client's buffer and into the meter's (#15: a tenth of a 64 KB request's
/// CPU).
#[derive(Debug, Clone, Copy)]
struct KeptBody {
    /// Where the body starts in `ubuf`.
    from: usize,
    /// Where the bytes not yet written to the client start in `ubuf`.
    unsent: usize,
}

/// The head's last field, Sluice's own time on the request so far, and the blank line.
fn push_overhead(out: &mut Vec<u8>, overhead: std::time::Duration) {
    out.extend_from_slice(b"x-sluice-overhead-us: ");
    push_decimal(out, overhead.as_micros());
    out.extend_from_slice(b"\r\n\r\n");
}

/// Body bytes fewer than this that came with the response head are copied behind it for one
/// plain write: the copy costs less than a second buffer for the kernel to gather.
const GATHER_FROM: usize = 4096;

/// The most one upstream read of a kept body takes (the room reserved may be megabytes): each
/// read goes to the client in one write, which must end within `stream_idle`, so a slow client
/// gets it in pieces it can take.
const MAX_KEPT_READ: usize = 64 * 1024;

impl Relay<'_, '_> {
    /// The client's response head into `out`: the upstream's status and headers less the
    /// hop-by-hop ones (and those its `Connection` names), the client's framing, the rate-limit headers and Sluice's overhead.
    fn write_head(&mut self, head: &ResponseHead, side: ClientSide<'_>) {
        let (out, ubuf, plan) = (&mut self.out, &self.ubuf, self.plan);
        out.extend_from_slice(b"HTTP/1.1 ");
        push_decimal(out, head.status);
        out.push(b' ');
        let upstream_reason = &ubuf[head.reason.0..head.reason.1];
        if upstream_reason.is_empty() {
            out.extend_from_slice(reason(head.status).as_bytes());
        } else {
            out.extend_from_slice(upstream_reason);
        }
        out.extend_from_slice(b"\r\n");
        for h in &head.headers {
            let name = h.name(ubuf);
            let keep_length = side.head_only && name.eq_ignore_ascii_case(b"content-length");
            if is_hop_by_hop(name) && !keep_length {
                continue;
            }
            // Named by the upstream's `Connection`: for that hop only (RFC 9110 §7.6.1).
            if head.connection_options && named_by_connection(&head.headers, ubuf, name) {
                continue;
            }
            // The provider's account and site are not the client's business; the client's
            // limits are Sluice's own, when it writes them.
            if !keep_length
                && (!side.pass.passes(name)
                    || !self.obs.rate_headers.is_empty()
                        && starts_with_ignore_case(name, b"x-ratelimit-"))
            {
                continue;
            }
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(h.value(ubuf));
            out.extend_from_slice(b"\r\n");
        }
        match (plan.framing, head.framing()) {
            (ClientFraming::Passthrough, BodyFraming::Length(n)) => {
                out.extend_from_slice(b"content-length: ");
                push_decimal(out, n);
                out.extend_from_slice(b"\r\n");
            }
            (ClientFraming::Chunked, _) => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
            (ClientFraming::Empty, _)
                if !side.head_only && head.status != 204 && head.status != 304 =>
            {
                out.extend_from_slice(b"content-length: 0\r\n");
            }
            _ => {}
        }
        if !plan.keep_client {
            out.extend_from_slice(b"connection: close\r\n");
        }
        self.obs.response_started(
            head.status,
            plan.event_stream,
            plan.framing != ClientFraming::Empty,
        );
        out.extend_from_slice(self.obs.rate_headers.as_bytes());
        push_overhead(out, self.obs.overhead_so_far(clock::now()));
    }

    /// The body bytes that came with the response head (`ubuf[head_len..]`): kept where they
    /// are when the whole body is ([`KeptBody`]), else fed into `out` as any read. An upstream
    /// framing fault is returned.
    fn feed_first_read(&mut self, head_len: usize, read_at: Mono) -> Result<(), GatewayError> {
        let unchanged = self.plan.framing == ClientFraming::Passthrough
            && self.strip.is_none()
            && self.translate.is_none();
        match self.body {
            UpstreamBody::Length(len) if unchanged && self.obs.keeps_whole_body(len) => {
                // Room for the whole body (a larger claim than 1 MiB grows it as bytes really
                // arrive) and the meter's parse padding: no regrowth, so no copy.
                let room = head_len
                    + usize::try_from(len).map_or(1 << 20, |len| len.min(1 << 20))
                    + crate::openai::meter::PARSE_PADDING;
                self.ubuf.reserve(room.saturating_sub(self.ubuf.len()));
                let kept = KeptBody {
                    from: head_len,
                    unsent: head_len,
                };
                self.kept = Some(kept);
                self.count_kept_read(kept);
                Ok(())
            }
            _ => self.feed_read(head_len.., read_at),
        }
    }

    /// The bytes read into `ubuf` behind `kept.unsent` are counted down from the body's length;
    /// any beyond its end are dropped (and the upstream connection is not reused).
    fn count_kept_read(&mut self, kept: KeptBody) {
        let read = self.ubuf.get(kept.unsent..).unwrap_or_default();
        let mut taken = 0;
        // A Length body never fails to decode.
        let extra = emit_body(&mut self.body, read, |body| taken = body.len()).unwrap_or(true);
        self.ubuf.truncate(kept.unsent + taken);
        self.clean &= !extra;
    }

    /// Bytes waiting to go to the client: `out`, then a kept body's unsent bytes.
    fn pending_output(&self) -> usize {
        let kept = self
            .kept
            .map_or(0, |k| self.ubuf.len().saturating_sub(k.unsent));
        self.out.len() + kept
    }

    /// Move the upstream bytes `ubuf[range]`, read at `read_at`, into `out` in the client's
    /// framing (metered on the way). An upstream framing fault is returned.
    fn feed_read(
        &mut self,
        range: impl std::slice::SliceIndex<[u8], Output = [u8]>,
        read_at: Mono,
    ) -> Result<(), GatewayError> {
        let extra = feed(
            &mut self.body,
            &self.ubuf[range],
            self.plan.framing,
            &mut self.out,
            self.obs,
            Filters {
                translate: self.translate.as_deref_mut(),
                strip: self.strip.as_mut(),
            },
            read_at,
        )?;
        self.clean &= !extra;
        Ok(())
    }

    /// Write `out` to the client (if it holds anything), the gateway's work since the upstream
    /// read at `read_at` counted as overhead; `Some(Cut::Client)` if it is gone.
    async fn send_out(&mut self, read_at: Mono) -> Option<Cut> {
        // Read afresh: this is the gateway's work on the read so far.
        self.obs.relay_overhead += clock::now().saturating_duration_since(read_at);
        // Only output counts: a read that produced none (pings) leaves the client unwatched
        // no longer than WATCH_AFTER.
        if self.pending_output() > 0 {
            self.last_output = read_at;
        }
        self.send_tail().await
    }

    /// Write `out` to the client (if it holds anything) with no upstream read behind it (the
    /// body's end): nothing to count, no clock to read. `Some(Cut::Client)` if it is gone.
    async fn send_tail(&mut self) -> Option<Cut> {
        let pending = self.pending_output();
        if pending == 0 {
            return None;
        }
        self.obs.bytes_out += pending as u64;
        // An event stream's head and first events are what its client waits on most.
        let first_token = self.plan.event_stream && !self.head_sent;
        self.head_sent = true;
        let limit = self.io.timeouts.stream_idle;
        let direct = self.io.load.direct_writes_for(first_token);
        let res = match self.kept {
            // The kept body's new bytes go from where they were read, behind `out` (the head,
            // on the first write) in one vectored write.
            Some(kept) if pending - self.out.len() >= GATHER_FROM || self.out.is_empty() => {
                let (res, out, ubuf) = self
                    .client
                    .write_pair(
                        std::mem::take(&mut self.out),
                        std::mem::take(&mut self.ubuf),
                        kept.unsent,
                        limit,
                        direct,
                    )
                    .await;
                (self.out, self.ubuf) = (out, ubuf);
                res
            }
            kept => {
                if let Some(kept) = kept {
                    // A few bytes behind the head: copied, for one plain write.
                    let unsent = self.ubuf.get(kept.unsent..).unwrap_or_default();
                    self.out.extend_from_slice(unsent);
                }
                let (res, out) = self
                    .client
                    .write_all(std::mem::take(&mut self.out), limit, direct)
                    .await;
                self.out = out;
                res
            }
        };
        if let Some(kept) = &mut self.kept {
            kept.unsent = self.ubuf.len();
        }
        res.is_err().then_some(Cut::Client)
    }

    /// Relay the rest of the body, one upstream read at a time, each written before the next
    /// read. Returns why it stopped early, if it did.
    async fn pump(&mut self) -> Option<Cut> {
        let mut watching = true;
        while !matches!(self.body, UpstreamBody::Done) {
            // The client's buffer goes back to the worker's pool while the upstream is awaited
            // (a stream spends nearly all its life there): ten thousand idle streams then hold
            // ten thousand read buffers, not twice that.
            self.io.bufs.give(std::mem::take(&mut self.out));
            let read = self.read_upstream(&mut watching).await;
            self.out = self.io.bufs.take();
            let n = match read {
                // The close that ends this body may be the shutdown's (see `past_grace`).
                Ok(0)
                    if matches!(self.body, UpstreamBody::UntilClose)
                        && self.io.drain.past_grace() =>
                {
                    return Some(Cut::Shutdown);
                }
                Ok(0) if matches!(self.body, UpstreamBody::UntilClose) => {
                    self.body = UpstreamBody::Done;
                    self.clean = false;
                    return None;
                }
                Ok(0) => {
                    return Some(Cut::Upstream(GatewayError::bad_gateway(
                        UpstreamFault::Io,
                        "the upstream closed the connection mid-response",
                    )))
                }
                Ok(n) => n,
                Err(cut) => return Some(cut),
            };
            // Read afresh (the read may have finished without a wait, see forward::send).
            let read_at = clock::now();
            if let Some(kept) = self.kept {
                // Read behind the body so far; goes out from there.
                self.count_kept_read(kept);
                if let Some(cut) = self.send_out(read_at).await {
                    return Some(cut);
                }
                continue;
            }
            let whole_read_passes_through = self.plan.framing == ClientFraming::Passthrough
                && self.strip.is_none()
                && self.translate.is_none()
                && matches!(self.body, UpstreamBody::Length(remaining) if remaining >= n as u64);
            if whole_read_passes_through {
                // The whole read is body the client gets unchanged: hand the read buffer itself
                // to the client write instead of copying it into `out` (one copy less of every
                // read after the first; the first, which carries the head, is still copied). The
                // body is counted down and metered as `feed` would; a Length body can't fail or
                // overrun.
                let obs = &mut *self.obs;
                let _ = emit_body(&mut self.body, &self.ubuf[..n], |data| {
                    obs.body(data, read_at)
                });
                self.ubuf.truncate(n);
                std::mem::swap(&mut self.out, &mut self.ubuf);
            } else if let Err(e) = self.feed_read(..n, read_at) {
                return Some(Cut::Upstream(e));
            }
            if self.plan.framing == ClientFraming::Chunked
                && matches!(self.body, UpstreamBody::Done)
            {
                if self.truncated() {
                    // Not ended with a last chunk: `finish` adds the error event first.
                    if let Some(gone) = self.send_out(read_at).await {
                        return Some(gone);
                    }
                    return Some(self.cut_short());
                }
                // The body ended in this read: its last chunk goes out in the same write.
                self.out.extend_from_slice(LAST_CHUNK);
                self.terminated = true;
            }
            if let Some(cut) = self.send_out(read_at).await {
                return Some(cut);
            }
        }
        None
    }

    /// An event stream whose body ended but whose events did not (no `[DONE]`, no finish
    /// reason, no error event of the upstream's own): a truncation, counted and answered as an
    /// upstream cut — never shown to the client as a normal end.
    fn truncated(&self) -> bool {
        self.plan.event_stream && self.obs.stream_unfinished()
    }

    /// The cut a [truncated](Self::truncated) stream ends with, once everything decoded was
    /// sent (`out` still holds the bytes of the last write: they must not go out again).
    fn cut_short(&mut self) -> Cut {
        self.out.clear();
        Cut::Upstream(GatewayError::bad_gateway(
            UpstreamFault::Io,
            "the upstream ended the stream without a finish reason or [DONE]",
        ))
    }

    /// One upstream read into `ubuf`, watching the client meanwhile once [`WATCH_AFTER`] has
    /// passed since the last output to it (until it sends its next request early: then
    /// `watching` turns off). The read is never dropped unless the client is gone, so no
    /// upstream bytes can be lost to a cancelled read. The watch borrows the client socket only
    /// while this waits, never across a write.
    async fn read_upstream(&mut self, watching: &mut bool) -> Result<usize, Cut> {
        // A kept body is read behind what came before, into the room reserved for all of it;
        // when less than the rest of it (or 16 KB) is free, room for all the rest is reserved
        // at once (regrowing a step at a time would copy it over and over). A read takes at
        // most MAX_KEPT_READ: it goes to the client in one write, within `stream_idle`.
        let (min_spare, grow, max_read) = match self.kept {
            Some(_) => {
                let left = match self.body {
                    UpstreamBody::Length(left) => usize::try_from(left).unwrap_or(usize::MAX),
                    _ => 0,
                };
                let grow = left.saturating_add(crate::openai::meter::PARSE_PADDING);
                (left.clamp(1, 16 * 1024), grow, MAX_KEPT_READ)
            }
            None => {
                self.ubuf.clear();
                (16 * 1024, 16 * 1024, usize::MAX)
            }
        };
        let mut read = pin!(stream::read_spare(
            &mut self.ubuf,
            min_spare,
            grow,
            max_read,
            self.io.timeouts.stream_idle,
            |b| self.conn.io.read(b),
        ));
        let client = &*self.client;
        // Armed only once `WATCH_AFTER` has passed without output to the client: a readiness
        // wait armed and cancelled on every upstream read (every event of a stream) cost two
        // submissions, and the kernel finds the wait to cancel by a search of all those armed
        // on the ring, which grows with the streams a worker holds (8% of its CPU at 3,000
        // streams; perf/history/RESULTS-diary-2026-12.md, #15 item 3). Counted from the last output, not from this
        // read: upstream bytes that produce none (events a translation drops, an event held
        // whole) must not keep the watch from ever arming. A client that leaves is noticed by
        // the next write, or within `WATCH_AFTER` of its last output.
        let watch_from = self.last_output + WATCH_AFTER;
        let mut watch = pin!(async {
            clock::sleep_until(watch_from).await;
            client.readable().await
        });
        let read_result = loop {
            if !*watching {
                if !client.is_tls() {
                    break (&mut read).await;
                }
                // TLS: the bytes that woke the watch are the session's (a close_notify alert,
                // its FIN maybe a moment behind), so readiness can't be waited on again; look
                // for the hang-up now and then instead.
                monoio::select! {
                    biased;
                    r = &mut read => break r,
                    () = clock::sleep(TLS_HANGUP_CHECK) => {
                        if client.peer_gone() {
                            return Err(Cut::Client);
                        }
                        continue;
                    }
                }
            }
            monoio::select! {
                biased;
                r = &mut read => break r,
                _ = &mut watch => {
                    if client.peer_gone() {
                        return Err(Cut::Client);
                    }
                    // The client sent its next request early (or, on TLS, an alert): stop
                    // waiting for readiness for this one.
                    *watching = false;
                }
            }
        };
        match read_result {
            ReadOutcome::Data(n) => Ok(n),
            ReadOutcome::Closed => Ok(0),
            ReadOutcome::TimedOut => Err(Cut::Upstream(GatewayError::gateway_timeout(
                "the upstream stream stalled",
            ))),
            ReadOutcome::Failed(e) => Err(Cut::Upstream(GatewayError::bad_gateway(
                UpstreamFault::Io,
                format!("upstream connection failed mid-response: {e}"),
            ))),
        }
    }

    /// An upstream cut once the shutdown grace is over is the runtime's doing (it shut the
    /// upstream connections down): the response ends as a shutdown. Checked only when the body
    /// stopped early.
    fn past_grace(&self, cut: Cut) -> Cut {
        match cut {
            Cut::Upstream(_) if self.io.drain.past_grace() => Cut::Shutdown,
            cut => cut,
        }
    }

    /// End the response as `cut` says: a complete body gets its last chunk; a client that left
    /// gets nothing more; an upstream fault or the end of the shutdown grace ends an event
    /// stream with an SSE error event and a proper end, and cuts any other body. Returns whether
    /// the client connection may be kept, and whether the upstream connection may go back to
    /// the pool, for [`Self::close`]. Borrows the relay rather than taking it: a future holding
    /// the 640-byte relay (twice: argument and local) was the largest state of `relay`'s, and
    /// every level above it is copied into its parent when awaited.
    async fn finish(&mut self, cut: Option<Cut>, upstream_keep_alive: bool) -> (bool, bool) {
        let plan = self.plan;
        let (keep_alive, reusable) = match cut {
            None => {
                self.out.clear();
                // A close-delimited body ended: an unfinished event held back goes out as it
                // came.
                self.flush_strip();
                if plan.framing == ClientFraming::Chunked && !self.terminated {
                    self.out.extend_from_slice(LAST_CHUNK);
                }
                let sent = self.send_tail().await.is_none();
                let reusable =
                    self.clean && upstream_keep_alive && matches!(self.body, UpstreamBody::Done);
                (plan.keep_client && sent, reusable)
            }
            Some(Cut::Client) => (false, false),
            Some(Cut::Upstream(error)) => (self.end_early(&error).await, false),
            Some(Cut::Shutdown) => {
                self.io.drain.ended_by_shutdown();
                (self.end_early(&GatewayError::shutting_down()).await, false)
            }
        };
        // Read afresh: the last write may have finished without a wait.
        self.obs.finished_at = Some(clock::now());
        (keep_alive, reusable)
    }

    /// End a body that stopped before its end for `error`: an event stream learns why through an
    /// error event and a proper end; any other body can only be cut, so the client sees it
    /// incomplete. `out` still holds the well-formed data decoded before the fault. Returns
    /// whether the client connection may be kept.
    async fn end_early(&mut self, error: &GatewayError) -> bool {
        let plan = self.plan;
        if plan.event_stream && plan.framing == ClientFraming::Chunked {
            // What was held back goes first, as it would have without stripping.
            self.flush_strip();
            encode_chunk(error.sse_event(plan.dialect).as_bytes(), &mut self.out);
            self.out.extend_from_slice(LAST_CHUNK);
            let sent = self.send_tail().await.is_none();
            plan.keep_client && sent
        } else {
            false
        }
    }

    /// An unfinished event the usage strip held back goes out as it came.
    fn flush_strip(&mut self) {
        let framing = self.plan.framing;
        let out = &mut self.out;
        if let Some(strip) = self.strip.as_mut() {
            strip.finish(|data| frame(framing, data, out));
        }
    }

    /// The upstream connection back to the pool (`reusable`) or torn down, and the buffers
    /// back to theirs.
    fn close(self, reusable: bool) {
        let Relay {
            io,
            obs,
            conn,
            out,
            ubuf,
            kept,
            strip,
            ..
        } = self;
        if reusable {
            io.pools.checkin(conn);
        } else {
            conn.abort();
        }
        io.bufs.give(out);
        // A kept body becomes the meter's (its buffer comes back to the pool once metered).
        match kept {
            Some(kept) => obs.keep_body_read(ubuf, kept.from),
            None => io.bufs.give(ubuf),
        }
        if let Some(strip) = strip {
            io.bufs.give(strip.into_buffer());
        }
    }
}

/// Append decoded body bytes to `out` in the client's framing.
fn frame(framing: ClientFraming, data: &[u8], out: &mut Vec<u8>) {
    match framing {
        ClientFraming::Chunked => encode_chunk(data, out),
        ClientFraming::Passthrough | ClientFraming::Close => out.extend_from_slice(data),
        ClientFraming::Empty => {}
    }
}

/// What the decoded upstream bytes go through before the client's framing: a translation
/// from another dialect, then the usage strip.
struct Filters<'f> {
    translate: Option<&'f mut StreamTranslate>,
    strip: Option<&'f mut UsageStrip>,
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
    filters: Filters<'_>,
    now: Mono,
) -> Result<bool, GatewayError> {
    let Filters {
        translate,
        mut strip,
    } = filters;
    // A translation into the client's dialect comes after the meter (which reads the
    // upstream's); one from the upstream's dialect before it.
    let (mut before, mut after) = match translate {
        Some(t) if t.after_meter() => (None, Some(t)),
        t => (t, None),
    };
    let mut pass = |data: &[u8]| {
        // The meter looks at the decoded (and translated) bytes, all of them; it never holds
        // them back.
        obs.body(data, now);
        match (after.as_deref_mut(), strip.as_deref_mut()) {
            (Some(after), _) => after.feed(data, |data| frame(framing, data, out)),
            (None, Some(strip)) => strip.feed(
                data,
                |event| obs.is_usage_only_event(event),
                |data| frame(framing, data, out),
            ),
            (None, None) => frame(framing, data, out),
        }
    };
    let mut emit = |data: &[u8]| match before.as_deref_mut() {
        Some(translate) => translate.feed(data, &mut pass),
        None => pass(data),
    };
    let extra = emit_body(body, input, &mut emit)?;
    if matches!(body, UpstreamBody::Done) {
        if let Some(strip) = strip {
            // The body ended: an unfinished event held back goes out as it came.
            strip.finish(|data| frame(framing, data, out));
        }
        if let Some(after) = after.filter(|_| !obs.stream_unfinished()) {
            // Ended whole: the translated stream gets its own end (a cut one gets the relay's
            // error event instead).
            after.finish(|data| frame(framing, data, out));
        }
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
