//! The per-request record: what one proxied request did, written by the phases as it goes and
//! summed up when it ends. A leaf of the gateway: it names no other phase, and every phase may
//! write to it; only [`observe`](crate::gateway::observe) emits it.
//!
//! An [`Observation`] is started when a request's head and body are in, given the forward
//! phase's [`ForwardTimings`] (when the request left, how long connecting and the first byte
//! took), filled in by the relay (status, bytes, the body as the meter saw it, how it ended —
//! [`RelayEnd`] — and Sluice's own time per relayed chunk), and closed by
//! [`Observation::outcome`] into an [`Outcome`]: usage (reported by the upstream, or estimated
//! from what was streamed when it reported none), cost from the price table, time to first
//! token, time per output token, total latency and Sluice's overhead. Raises nothing.
//!
//! ## What is billed
//! The outcome's usage *is* the bill — the limits ledger settles it
//! ([`Outcome::billed_tokens`]), the access log's token and cost fields record it and the
//! metrics count it, so the three always agree. One rule ([`Observation::billable`]), by how the
//! request ended:
//!
//! | ending | billed |
//! | --- | --- |
//! | Sluice answered it itself (refused, no upstream reached, or an upstream failure answered as Sluice's own 502 / 503 / 504, even after a response had begun arriving) | nothing |
//! | the upstream's error status relayed (4xx, 5xx) | nothing, even if its body carries usage |
//! | a 2xx relayed whole | the upstream's usage, else the prompt and answer estimated |
//! | a 2xx cut short — the client left, the upstream broke or sent an error event mid-stream, the shutdown grace ran out | the upstream's usage, else the prompt and what was relayed, estimated |
//! | the client left before the answer's head, the upstream working on it | the upstream's usage, else the prompt, estimated |

use std::time::Duration;

use crate::config::Snapshot;
use crate::gateway::error::UpstreamFault;
use crate::openai::anthropic::client::{message_usage, AnthropicStreamMeter};
use crate::openai::meter::{event_data, event_name, MeterSummary, SseMeter, SseSplitter, Usage};
use crate::sys::clock::Mono;
use crate::telemetry::accesslog::AccessLog;

/// How a relayed response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RelayEnd {
    /// The whole body reached the client.
    Complete,
    /// The client left, or stopped taking bytes, before the end.
    ClientLeft,
    /// The upstream failed, stalled or sent garbage mid-body; the client got an SSE error
    /// event (event streams) or a cut connection.
    UpstreamCut(UpstreamFault),
    /// Sluice is stopping and the shutdown grace ran out mid-body; the client got an SSE error
    /// event (`server_shutting_down`, event streams) or a cut connection.
    Shutdown,
}

/// When the forward phase's steps happened, returned whether it succeeded or not (the
/// observation times a failed exchange too).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ForwardTimings {
    /// When the request started out to the upstream (`None`: it never did).
    pub(crate) started_at: Option<Mono>,
    /// How long opening a new connection took (`None`: a pooled one served).
    pub(crate) connect: Option<Duration>,
    /// When the response head was in.
    pub(crate) head_at: Option<Mono>,
    /// Stale pooled connections retried on a fresh one.
    pub(crate) retries: u32,
}

/// Observation state (meter buffers included) lent to one request at a time and given back, so
/// the steady state allocates none.
#[derive(Default)]
pub(crate) struct ObservationPool {
    // Boxed: an observation is several KB, lent out and given back per request; moving the box
    // moves a pointer, not the observation.
    #[allow(clippy::vec_box)]
    free: std::cell::RefCell<Vec<Box<Observation>>>,
}

impl ObservationPool {
    pub(crate) fn take(&self) -> Box<Observation> {
        self.free.borrow_mut().pop().unwrap_or_default()
    }

    pub(crate) fn give(&self, obs: Box<Observation>) {
        let mut pool = self.free.borrow_mut();
        if pool.len() < 256 {
            pool.push(obs);
        }
    }
}

/// Where a worker's access-log records go: its writer (when one is configured), the string the
/// client's address is written into (kept, so it keeps its capacity), and the worker's number.
pub(crate) struct LogSink {
    pub(crate) writer: std::cell::RefCell<Option<AccessLog>>,
    pub(crate) client_addr: std::cell::RefCell<String>,
    pub(crate) worker_id: usize,
}

impl LogSink {
    pub(crate) fn new(writer: Option<AccessLog>, worker_id: usize) -> LogSink {
        LogSink {
            writer: std::cell::RefCell::new(writer),
            client_addr: std::cell::RefCell::new(String::new()),
            worker_id,
        }
    }
}

/// Largest non-streamed body kept aside for metering its `usage`.
const MAX_METERED_JSON: usize = 4 << 20;

/// How the body is metered.
enum Metering {
    /// Not yet known, or nothing to meter (a HEAD, a 204).
    Off,
    /// An event stream, split into events as it passes.
    Stream,
    /// A JSON body, copied aside (bounded) and read whole at the end.
    Json { truncated: bool },
    /// A JSON body whose usage nothing reads ([`Observation::usage_wanted`] is false): passed
    /// on unread, and the request's usage is unknown rather than estimated.
    Unread,
    /// An Anthropic event stream passed through ([`Observation::meter_anthropic`]).
    AnthropicStream,
}

/// An Anthropic Messages stream's metering: its events split as they pass, usage and the end
/// read by [`AnthropicStreamMeter`], content deltas timed (TTFT, TPOT) and counted (the
/// estimate when no usage came).
#[derive(Default)]
struct AnthropicMetering {
    splitter: SseSplitter,
    data: Vec<u8>,
    meter: AnthropicStreamMeter,
    first_content_at: Option<Mono>,
    last_content_at: Option<Mono>,
    content_bytes: u64,
}

impl AnthropicMetering {
    fn reset(&mut self) {
        self.splitter.reset();
        self.data.clear();
        self.meter.reset();
        self.first_content_at = None;
        self.last_content_at = None;
        self.content_bytes = 0;
    }

    fn feed(&mut self, input: &[u8], now: Mono) {
        let AnthropicMetering {
            splitter,
            data,
            meter,
            first_content_at,
            last_content_at,
            content_bytes,
        } = self;
        splitter.feed(input, |event| {
            let name = event_name(event).unwrap_or_default();
            let Some(payload) = event_data(event, data) else {
                return;
            };
            if name.trim_ascii() == b"content_block_delta" {
                first_content_at.get_or_insert(now);
                *last_content_at = Some(now);
                *content_bytes += payload.len() as u64;
            }
            meter.on_event(name, payload);
        });
    }

    /// Ended as Anthropic streams end (`message_stop`), or with the upstream's error event.
    fn ended(&self) -> bool {
        self.meter.stopped() || self.meter.error().is_some()
    }
}

/// One request's observations. Reused per connection; [`Observation::start`] resets it.
pub(crate) struct Observation {
    pub(crate) received_at: Mono,
    /// When the forward phase's steps happened (default: it never ran).
    pub(crate) forward: ForwardTimings,
    pub(crate) finished_at: Option<Mono>,
    /// Sluice's own time while relaying: from each upstream read to handing its bytes to the
    /// client, summed.
    pub(crate) relay_overhead: Duration,
    pub(crate) status: u16,
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
    /// How the relayed response ended (`None`: no response was relayed).
    pub(crate) end: Option<RelayEnd>,
    /// The cluster and backend of the last attempt, once routed.
    pub(crate) routed: Option<(usize, usize)>,
    /// With `[saturation]`, for a request that waited: its priority class, and how long it
    /// was queued (so far).
    pub(crate) queue_class: Option<u8>,
    pub(crate) queued: Option<Duration>,
    /// How the wait ended (a `sluice_queue_total` outcome label; "" when it did not wait).
    pub(crate) queue_outcome: &'static str,
    /// Attempts that moved on to another backend, and why the last one did.
    pub(crate) fallbacks: u32,
    pub(crate) fallback_reason: &'static str,
    /// The session id's hash, on a sticky route (0: none).
    pub(crate) sticky_id_hash: u64,
    /// Header lines Sluice adds to the client's response: the `x-ratelimit-*` set once
    /// admitted, and a sticky route's affinity cookie.
    pub(crate) rate_headers: String,
    /// Whether anything reads this request's usage: exported metrics, the access log, or a
    /// budget that settles on tokens. When nothing does, a non-streamed answer's body is not
    /// kept and read for it (a stream's still is: the relay needs its end and its usage-only
    /// event). Each request starts with it set; the pipeline clears it.
    pub(crate) usage_wanted: bool,
    metering: Metering,
    meter: SseMeter,
    /// A non-streamed body kept whole for the meter: `json[json_from..]` (a body the relay kept
    /// where it read it starts behind the response head).
    json: Vec<u8>,
    json_from: usize,
    /// This observation's own `json` buffer while `json` is a read buffer the relay handed
    /// over ([`Self::keep_body_read`]), until [`Self::take_kept_read`] swaps them back.
    own_json: Option<Vec<u8>>,
    /// The response is Anthropic's own (passed through to an Anthropic client): metered in
    /// Anthropic's terms.
    anthropic: bool,
    anthropic_meter: AnthropicMetering,
}

impl Default for Observation {
    fn default() -> Self {
        Observation {
            received_at: Mono::now(),
            forward: ForwardTimings::default(),
            finished_at: None,
            relay_overhead: Duration::ZERO,
            status: 0,
            bytes_in: 0,
            bytes_out: 0,
            end: None,
            routed: None,
            queue_class: None,
            queued: None,
            queue_outcome: "",
            fallbacks: 0,
            fallback_reason: "",
            sticky_id_hash: 0,
            rate_headers: String::new(),
            usage_wanted: true,
            metering: Metering::Off,
            meter: SseMeter::new(),
            json: Vec::new(),
            json_from: 0,
            own_json: None,
            anthropic: false,
            anthropic_meter: AnthropicMetering::default(),
        }
    }
}

/// How usage was known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UsageSource {
    Reported,
    Estimated,
    None,
}

/// What [`Observation::outcome`] reads of a response's metering: the usage reported, and the
/// generated content's timing and size.
#[derive(Debug, Default, Clone, Copy)]
struct Metered {
    usage: Option<Usage>,
    first_content_at: Option<Mono>,
    last_content_at: Option<Mono>,
    content_bytes: u64,
}

impl Metered {
    fn of(summary: &MeterSummary) -> Metered {
        Metered {
            usage: summary.usage,
            first_content_at: summary.first_content_at,
            last_content_at: summary.last_content_at,
            content_bytes: summary.content_bytes,
        }
    }
}

/// A finished request, summed up.
#[derive(Debug, Clone)]
pub(crate) struct Outcome<'m> {
    /// The model name the upstream was sent (the requested one when not mapped).
    pub(crate) mapped_model: &'m str,
    pub(crate) usage: Usage,
    pub(crate) usage_source: UsageSource,
    pub(crate) cost: Option<f64>,
    pub(crate) ttft: Option<Duration>,
    pub(crate) tpot: Option<Duration>,
    pub(crate) latency: Duration,
    pub(crate) overhead: Duration,
    pub(crate) upstream_header: Option<Duration>,
}

impl Outcome<'_> {
    /// The tokens the limits ledger settles: the bill (see the module docs), 0 when nothing is
    /// billed.
    pub(crate) fn billed_tokens(&self) -> u64 {
        match self.usage_source {
            UsageSource::None => 0,
            _ => self.usage.total_tokens,
        }
    }
}

impl Observation {
    /// Whether the request is billed at all — the one rule of the module docs' table. A 2xx
    /// relayed (whole or cut short) is; so is a client that left while the upstream worked on
    /// its request, before the answer's head (`status` 0); an error status relayed is not, nor
    /// is anything Sluice answered itself (`relayed` false: refused, failed before or while the
    /// response began, answered as Sluice's own 5xx).
    pub(crate) fn billable(&self, relayed: bool) -> bool {
        relayed
            && match self.status {
                200..=299 => true,
                0 => self.end == Some(RelayEnd::ClientLeft),
                _ => false,
            }
    }

    /// The upstream's stream carried an error event of its own (an OpenAI chunk's `error`
    /// object, Anthropic's `event: error`): the answer ended in an error its client saw, however
    /// cleanly the stream then closed.
    pub(crate) fn upstream_error_event(&self) -> bool {
        match self.metering {
            Metering::Stream => self.meter.recorded().error.is_some(),
            Metering::AnthropicStream => self.anthropic_meter.meter.error().is_some(),
            _ => false,
        }
    }

    /// Begin observing a request whose head and body arrived at `received_at`.
    pub(crate) fn start(&mut self, received_at: Mono, bytes_in: u64) {
        self.received_at = received_at;
        self.forward = ForwardTimings::default();
        self.finished_at = None;
        self.relay_overhead = Duration::ZERO;
        self.status = 0;
        self.bytes_in = bytes_in;
        self.bytes_out = 0;
        self.end = None;
        self.routed = None;
        self.queue_class = None;
        self.queued = None;
        self.queue_outcome = "";
        self.fallbacks = 0;
        self.fallback_reason = "";
        self.sticky_id_hash = 0;
        self.rate_headers.clear();
        self.usage_wanted = true;
        self.metering = Metering::Off;
        if std::mem::take(&mut self.anthropic) {
            self.anthropic_meter.reset();
        }
        self.meter.reset();
        // A read buffer not given back (a path that never asked) is dropped here.
        let _ = self.take_kept_read();
        self.json.clear();
        self.json_from = 0;
        if self.json.capacity() > 64 * 1024 {
            self.json = Vec::new();
        }
    }

    /// The response to come is an Anthropic answer passed through as it is (`on`): its usage,
    /// first token and end are read in Anthropic's terms.
    pub(crate) fn meter_anthropic(&mut self, on: bool) {
        if self.anthropic && !on {
            self.anthropic_meter.reset();
        }
        self.anthropic = on;
    }

    /// The response head arrived: decide how its body is metered.
    pub(crate) fn response_started(&mut self, status: u16, event_stream: bool, has_body: bool) {
        self.status = status;
        self.metering = match (has_body, event_stream) {
            (false, _) => Metering::Off,
            (true, true) if self.anthropic => Metering::AnthropicStream,
            (true, true) => Metering::Stream,
            (true, false) if !self.usage_wanted => Metering::Unread,
            (true, false) => Metering::Json { truncated: false },
        };
    }

    /// Whether a body of `len` bytes (its Content-Length) is to be kept whole for the meter —
    /// a non-streamed answer or an error body, within the most that is metered — so the relay
    /// may keep it where it reads it and hand it over at the end ([`Self::keep_body_read`])
    /// instead of passing it through [`Self::body`], which copies it.
    pub(crate) fn keeps_whole_body(&self, len: u64) -> bool {
        matches!(self.metering, Metering::Json { truncated: false })
            && len <= MAX_METERED_JSON as u64
    }

    /// The relay kept the body where it read it: `buf[from..]` is all of it that arrived, and
    /// becomes the metered body without a copy. The buffer goes back to the relay's pool with
    /// [`Self::take_kept_read`] once the request is settled and logged.
    pub(crate) fn keep_body_read(&mut self, buf: Vec<u8>, from: usize) {
        let own = std::mem::replace(&mut self.json, buf);
        // Twice in one request (never done): the first read buffer is dropped.
        self.own_json.get_or_insert(own);
        self.json_from = from.min(self.json.len());
    }

    /// The request has waited since `joined` (`[saturation]`), its wait now `outcome` (a
    /// `sluice_queue_total` outcome label).
    pub(crate) fn waited(&mut self, joined: Mono, outcome: &'static str) {
        self.queued = Some(Mono::now().saturating_duration_since(joined));
        self.queue_outcome = outcome;
    }

    /// The read buffer [`Self::keep_body_read`] took, for the pool it came from (`None`: the
    /// body, if any, was copied into this observation's own buffer). A pooled observation so
    /// holds no read buffer, and the pool lends it again.
    pub(crate) fn take_kept_read(&mut self) -> Option<Vec<u8>> {
        let own = self.own_json.take()?;
        self.json_from = 0;
        Some(std::mem::replace(&mut self.json, own))
    }

    /// Decoded body bytes on their way to the client, read at `now`.
    pub(crate) fn body(&mut self, data: &[u8], now: Mono) {
        match &mut self.metering {
            Metering::Off | Metering::Unread => {}
            Metering::Stream => self.meter.feed(data, now),
            Metering::AnthropicStream => self.anthropic_meter.feed(data, now),
            Metering::Json { truncated } => {
                if self.json.len() + data.len() <= MAX_METERED_JSON {
                    self.json.extend_from_slice(data);
                } else {
                    *truncated = true;
                }
            }
        }
    }

    /// A 2xx event stream whose events have not ended: no `[DONE]`, no finish reason (the
    /// Responses API's terminal event sets one), no error event of the upstream's, and no event
    /// too long to read that might have been the end ([`SseMeter::events_ended`]).
    pub(crate) fn stream_unfinished(&self) -> bool {
        let ended = match self.metering {
            Metering::Stream => self.meter.events_ended(),
            // Anthropic's streams end with `message_stop` (or an error event).
            Metering::AnthropicStream => self.anthropic_meter.ended(),
            Metering::Off | Metering::Json { .. } | Metering::Unread => return false,
        };
        (200..300).contains(&self.status) && !ended
    }

    /// Whether `event` (one whole SSE event of the response) is the usage-only chunk that
    /// `stream_options.include_usage` adds; for the relay, which withholds it from clients that
    /// did not ask for it. The meter's parse buffers are reused; nothing is recorded.
    pub(crate) fn is_usage_only_event(&mut self, event: &[u8]) -> bool {
        self.meter.is_usage_only_event(event)
    }

    /// Sluice's time before the request left for the upstream, plus the response head's own
    /// handling so far: the `x-sluice-overhead-us` a client sees.
    pub(crate) fn overhead_so_far(&self, now: Mono) -> Duration {
        let before = self.forward.started_at.map_or(Duration::ZERO, |f| {
            f.saturating_duration_since(self.received_at)
        });
        let head = self
            .forward
            .head_at
            .map_or(Duration::ZERO, |h| now.saturating_duration_since(h));
        before + head + self.relay_overhead
    }

    /// Sum the request up. `estimate` counts text when the upstream reported no usage: the
    /// prompt (`prompt_body`, the request body) and the generated text the meter kept.
    /// `relayed`: the upstream's response (or the client's leaving while it worked) is how the
    /// request ended, not an answer Sluice made itself (see [`Observation::billable`]).
    pub(crate) fn outcome<'m>(
        &mut self,
        snapshot: &Snapshot,
        requested_model: &'m str,
        mapped_model: Option<&'m str>,
        prompt_body: &[u8],
        estimate: Estimator,
        relayed: bool,
    ) -> Outcome<'m> {
        let finished = self.finished_at.unwrap_or_else(Mono::now);
        // The numbers only: the meter's summary is read in place (a copy would clone its
        // finish reason, an allocation per request).
        let (summary, captured) = match (&self.metering, self.anthropic) {
            (Metering::Json { truncated: false }, false) => {
                self.meter.on_json_body(&mut self.json, self.json_from);
                (Metered::of(self.meter.recorded()), self.meter.captured())
            }
            (Metering::Json { truncated: false }, true) => {
                let usage = message_usage(self.json.get(self.json_from..).unwrap_or_default());
                (
                    Metered {
                        usage,
                        ..Metered::default()
                    },
                    &[][..],
                )
            }
            (Metering::AnthropicStream, _) => {
                let a = &self.anthropic_meter;
                let summary = Metered {
                    usage: a.meter.usage(),
                    first_content_at: a.first_content_at,
                    last_content_at: a.last_content_at,
                    content_bytes: a.content_bytes,
                };
                (summary, &[][..])
            }
            (Metering::Unread, _) => (Metered::default(), &[][..]),
            _ => (Metered::of(self.meter.recorded()), self.meter.captured()),
        };
        let unread = matches!(self.metering, Metering::Unread);
        let (usage, usage_source) = match summary.usage {
            _ if !self.billable(relayed) => (Usage::default(), UsageSource::None),
            Some(u) => (u, UsageSource::Reported),
            // An answer whose usage nothing asked for (no limit spends tokens, nothing
            // observes usage) was not metered: nothing to bill it by, nothing that would.
            None if unread && self.status != 0 => (Usage::default(), UsageSource::None),
            None => (
                estimated_usage(estimate, prompt_body, captured, summary.content_bytes),
                UsageSource::Estimated,
            ),
        };
        let price = mapped_model
            .and_then(|m| snapshot.prices.get(m))
            .or_else(|| snapshot.prices.get(requested_model));
        let cost = price.map(|p| p.cost(&usage));
        let ttft = summary
            .first_content_at
            .map(|t| t.saturating_duration_since(self.received_at));
        let tpot = match (summary.first_content_at, summary.last_content_at) {
            (Some(first), Some(last)) if usage.completion_tokens > 1 => {
                u32::try_from(usage.completion_tokens - 1)
                    .ok()
                    .map(|gaps| last.saturating_duration_since(first) / gaps)
            }
            _ => None,
        };
        let before = self.forward.started_at.map_or(Duration::ZERO, |f| {
            f.saturating_duration_since(self.received_at)
        });
        let upstream_header = match (self.forward.started_at, self.forward.head_at) {
            (Some(f), Some(h)) => Some(h.saturating_duration_since(f)),
            _ => None,
        };
        Outcome {
            mapped_model: mapped_model.unwrap_or(requested_model),
            usage,
            usage_source,
            cost,
            ttft,
            tpot,
            latency: finished.saturating_duration_since(self.received_at),
            overhead: before + self.relay_overhead,
            upstream_header,
        }
    }
}

/// The usage of an answer that reported none (or was cut before it did): bill what is known —
/// the prompt, and the generated text the meter kept (`captured`), scaled up by bytes when
/// there was more (`content_bytes`) than it keeps.
fn estimated_usage(
    estimate: Estimator,
    prompt_body: &[u8],
    captured: &[u8],
    content_bytes: u64,
) -> Usage {
    let prompt = estimate.count(prompt_body).max(1);
    let mut completion = estimate.count(captured);
    if content_bytes > captured.len() as u64 && !captured.is_empty() {
        completion = (completion as u128 * content_bytes as u128 / captured.len() as u128) as u64;
    } else if captured.is_empty() {
        completion = content_bytes.div_ceil(4);
    }
    Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        cached_tokens: 0,
        cache_write_tokens: 0,
        reasoning_tokens: 0,
    }
}

/// How text is counted when an upstream reports no usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Estimator {
    /// The calibrated byte-class estimate ([`crate::openai::tokens::estimate_tokens`]).
    Bytes,
    /// Exact counts with the model's tiktoken encoding (`limits.settle_tokenizer =
    /// "tiktoken"`); slower, used only at settlement.
    Tiktoken(crate::openai::tokens::Encoding),
}

impl Estimator {
    /// The one `limits.settle_tokenizer` asks for; tiktoken's encoding follows the model the
    /// upstream saw.
    pub(crate) fn configured(
        limits: &crate::config::limits::LimitsConfig,
        model: &str,
    ) -> Estimator {
        match limits.settle_tokenizer {
            crate::config::limits::SettleTokenizer::Estimate => Estimator::Bytes,
            crate::config::limits::SettleTokenizer::Tiktoken => {
                Estimator::Tiktoken(crate::openai::tokens::Encoding::for_model(model))
            }
        }
    }

    pub(crate) fn count(self, text: &[u8]) -> u64 {
        match self {
            Estimator::Bytes => crate::openai::tokens::estimate_tokens(text),
            Estimator::Tiktoken(encoding) => match std::str::from_utf8(text) {
                Ok(t) => crate::openai::tokens::count_tokens(encoding, t) as u64,
                Err(_) => crate::openai::tokens::estimate_tokens(text),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    //! Metering by dialect: an Anthropic answer passed through is read by Anthropic's rules.
    use super::*;
    use crate::gateway::context::testing::OwnedCore;
    use crate::upstream::UpstreamFault;

    const PROMPT: &[u8] = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"tell me a story about a gateway"}]}"#;

    fn snapshot() -> crate::config::Snapshot {
        crate::config::load(
            "[clusters.c]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
             [[routes]]\nmodel = \"m\"\ncluster = \"c\"\n",
            &|_| None,
        )
        .unwrap()
    }

    fn chunk(content: &str) -> String {
        format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":null}}]}}\n\n"
        )
    }

    /// What is billed for a response with `status` whose body was `events` (streamed, as the
    /// relay feeds them) and that ended as `end` (`None`: nothing was relayed), answered to the
    /// client by the relay (`relayed`) or by Sluice itself: the tokens the ledger settles, and
    /// the same tokens as the log and the metrics read them.
    fn bill(status: u16, events: &[String], end: Option<RelayEnd>, relayed: bool) -> u64 {
        let snapshot = snapshot();
        let mut obs = Observation::default();
        let now = Mono::now();
        obs.start(now, PROMPT.len() as u64);
        if status != 0 {
            obs.response_started(status, true, true);
            for e in events {
                obs.body(e.as_bytes(), Mono::now());
            }
        }
        obs.end = end;
        let outcome = obs.outcome(&snapshot, "m", None, PROMPT, Estimator::Bytes, relayed);
        let logged = match outcome.usage_source {
            UsageSource::None => 0,
            _ => outcome.usage.total_tokens,
        };
        assert_eq!(outcome.billed_tokens(), logged);
        logged
    }

    fn billed(status: u16, events: &[String], end: Option<RelayEnd>) -> u64 {
        bill(status, events, end, true)
    }

    #[test]
    fn settle_bills_by_how_the_relay_ended() {
        let content: Vec<String> = (0..12).map(|i| chunk(&format!(" word{i}"))).collect();
        let mut complete = content.clone();
        complete.push(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":21,\"completion_tokens\":12,\"total_tokens\":33}}\n\n"
                .to_string(),
        );
        complete.push("data: [DONE]\n\n".to_string());

        // Complete, with the upstream's usage: exactly what it reported.
        assert_eq!(billed(200, &complete, Some(RelayEnd::Complete)), 33);

        // The client left after four events: never free — the prompt plus what was streamed,
        // estimated, and less than the whole response would have cost.
        let left = billed(200, &content[..4], Some(RelayEnd::ClientLeft));
        let prompt_only = billed(200, &[], Some(RelayEnd::ClientLeft));
        assert!(prompt_only > 0, "a client abort is billed its prompt");
        assert!(left > prompt_only, "{left}: what was streamed counts");
        assert!(left < 33 + 12, "{left}");

        // The upstream cut the stream after eight events: billed for what was delivered.
        let cut = billed(
            200,
            &content[..8],
            Some(RelayEnd::UpstreamCut(UpstreamFault::Io)),
        );
        assert!(cut > left, "{cut} vs {left}: more was delivered");

        // A stop's grace ran out after the same eight events: billed alike — the prompt and
        // what reached the client, never nothing.
        assert_eq!(billed(200, &content[..8], Some(RelayEnd::Shutdown)), cut);

        // The upstream answered with an error status: nothing billed, the reservation released.
        assert_eq!(billed(500, &content[..2], Some(RelayEnd::Complete)), 0);
        assert_eq!(billed(429, &[], Some(RelayEnd::Complete)), 0);

        // Nothing was relayed (forward failed): nothing billed.
        assert_eq!(billed(0, &[], None), 0);

        // A stream that began (a 200 head, two events in) and then broke in the first read, so
        // Sluice answered a 502 of its own: nothing billed, in the ledger or the log (issue #48:
        // the log billed an estimate the ledger never charged).
        assert_eq!(bill(200, &content[..2], None, false), 0);

        // The client left before the answer's head while the upstream worked: its prompt.
        let before_head = billed(0, &[], Some(RelayEnd::ClientLeft));
        assert_eq!(before_head, prompt_only);
    }

    const TEXT: &[u8] = include_bytes!("../openai/anthropic/testdata/anthropic_text.sse");

    fn core() -> OwnedCore {
        OwnedCore::new(
            r#"
            [clusters.main]
            backends = [{ base_url = "http://127.0.0.1:9/v1" }]
            [[routes]]
            model = "claude-x"
            cluster = "main"
            "#,
        )
    }

    /// An observation of a 200 whose body arrives in `reads`, metered as Anthropic's or not.
    fn observe(anthropic: bool, stream: bool, reads: &[&[u8]]) -> Box<Observation> {
        let mut obs = Box::<Observation>::default();
        obs.start(Mono::now(), 100);
        obs.meter_anthropic(anthropic);
        obs.response_started(200, stream, true);
        for read in reads {
            obs.body(read, Mono::now());
        }
        obs
    }

    #[test]
    fn an_anthropic_stream_is_metered_in_openai_terms_across_any_split() {
        let core = core();
        for split in [1, 7, TEXT.len()] {
            let reads: Vec<&[u8]> = TEXT.chunks(split).collect();
            let mut obs = observe(true, true, &reads);
            assert!(!obs.stream_unfinished(), "message_stop ends it");
            let outcome = obs.outcome(
                &core.snapshot,
                "claude-x",
                None,
                b"{}",
                Estimator::Bytes,
                true,
            );
            assert_eq!(outcome.usage_source, UsageSource::Reported);
            assert_eq!(outcome.usage.prompt_tokens, 25);
            assert_eq!(outcome.usage.completion_tokens, 15);
            assert_eq!(outcome.usage.total_tokens, 40);
            assert!(outcome.ttft.is_some(), "timed at the first content delta");
        }
    }

    #[test]
    fn an_anthropic_stream_without_message_stop_is_unfinished_and_reused_state_is_clean() {
        let cut = &TEXT[..TEXT.len() - 40];
        let obs = observe(true, true, &[cut]);
        assert!(obs.stream_unfinished());
        // The same observation, reused for an OpenAI request, meters OpenAI's way again.
        let mut obs = obs;
        obs.start(Mono::now(), 10);
        obs.meter_anthropic(false);
        obs.response_started(200, true, true);
        obs.body(b"data: [DONE]\n\n", Mono::now());
        assert!(!obs.stream_unfinished());
        // An OpenAI meter never takes Anthropic's end for its own.
        let obs = observe(false, true, &[TEXT]);
        assert!(obs.stream_unfinished());
    }

    #[test]
    fn an_answer_nobody_reads_the_usage_of_is_left_unread_but_a_stream_is_not() {
        let core = core();
        let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}"#;
        let outcome = |wanted: bool, stream: bool, reads: &[&[u8]]| {
            let mut obs = Box::<Observation>::default();
            obs.start(Mono::now(), 100);
            obs.usage_wanted = wanted;
            obs.response_started(200, stream, true);
            for read in reads {
                obs.body(read, Mono::now());
            }
            let unfinished = obs.stream_unfinished();
            let o = obs.outcome(&core.snapshot, "m", None, b"{}", Estimator::Bytes, true);
            (o.usage_source, o.usage.total_tokens, unfinished)
        };
        assert_eq!(
            outcome(true, false, &[body]),
            (UsageSource::Reported, 13, false)
        );
        // Not kept, not read, and not estimated either: nothing would use the figure.
        assert_eq!(
            outcome(false, false, &[body]),
            (UsageSource::None, 0, false)
        );
        // A stream is metered all the same: the relay needs its end.
        let events: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let (_, _, unfinished) = outcome(false, true, &[events]);
        assert!(unfinished, "a stream without its end is seen as cut");
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4,\"total_tokens\":13}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            outcome(false, true, &[events, usage]),
            (UsageSource::Reported, 13, false)
        );
        // Each request starts wanting it again (a pooled observation is reused).
        let mut obs = Box::<Observation>::default();
        obs.usage_wanted = false;
        obs.start(Mono::now(), 1);
        assert!(obs.usage_wanted);
    }

    #[test]
    fn a_whole_anthropic_message_reports_its_usage_cache_included() {
        let core = core();
        let body = br#"{"type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":10,"cache_read_input_tokens":30,"cache_creation_input_tokens":5,"output_tokens":7}}"#;
        let mut obs = observe(true, false, &[body]);
        let outcome = obs.outcome(
            &core.snapshot,
            "claude-x",
            None,
            b"{}",
            Estimator::Bytes,
            true,
        );
        assert_eq!(outcome.usage_source, UsageSource::Reported);
        assert_eq!(outcome.usage.prompt_tokens, 45);
        assert_eq!(outcome.usage.cached_tokens, 30);
        assert_eq!(outcome.usage.completion_tokens, 7);
    }
}
