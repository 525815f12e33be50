//! mock-llm: an OpenAI- and Anthropic-compatible upstream for tests, the demo and benchmarks,
//! which can misbehave on demand. Contract: `bench/MOCK_LLM.md`.
//!
//! One monoio thread, HTTP/1.1 keep-alive on raw `TcpStream`s (or TLS over them), httparse for
//! requests, preformatted bytes for responses.

#[path = "mock_llm/anthropic.rs"]
mod anthropic;
#[path = "mock_llm/anthropic_wire.rs"]
mod anthropic_wire;
#[path = "mock_llm/body.rs"]
mod body;
#[path = "mock_llm/chat_tools.rs"]
mod chat_tools;
#[path = "mock_llm/conn.rs"]
mod conn;
#[path = "mock_llm/control.rs"]
mod control;
#[path = "mock_llm/http.rs"]
mod http;
#[path = "mock_llm/queue.rs"]
mod queue;

use std::cell::Cell;
use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use monoio::net::{ListenerOpts, TcpListener};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const HELP: &str = "\
mock-llm: an OpenAI- and Anthropic-compatible mock upstream (see bench/MOCK_LLM.md)

USAGE:
    mock-llm [OPTIONS]

OPTIONS:
    --listen ADDR            address to bind [default: 127.0.0.1:0]
    --ttft-ms N              delay before the first streamed content event [default: 0]
    --inter-token-ms N       delay between streamed content events [default: 0]
    --tokens N               output tokens per answer [default: 16]
    --fault SPEC             misbehave on every request (see FAULTS); POST /_mock/fault changes
                             it at run time
    --retry-after S          Retry-After value on 429, 503 and 529 answers; `none` omits the
                             header [default: 1]
    --error-code CODE        error.code of injected error bodies (as x-mock-error-code)
                             [default: by status]
    --reject-key KEY         answer 401 invalid_api_key to requests carrying KEY (as
                             `Authorization: Bearer KEY`, `x-api-key` or `api-key`; on
                             /v1/messages Anthropic's 401); repeatable
    --max-running N          answer at most N requests at once; the others wait in a FIFO
                             queue (vllm:num_requests_waiting) [default: 0, unlimited]
    --idle-close-ms N        silently close a connection that sends no request bytes for N ms
                             after its last response (or after it was accepted), like a
                             server's keep-alive timeout [default: never]
    --tls-cert FILE          PEM certificate chain; with --tls-key, serve HTTPS
    --tls-key FILE           PEM private key
    --exit-on-stdin-eof      exit when stdin is closed
    --legacy-driver          use epoll instead of io_uring (default: io_uring when available)
    -h, --help               print this help

On start it prints `mock-llm listening on IP:PORT` to stdout.

FAULTS (SPEC):
    status=N                 answer status N with an OpenAI-shaped error (429, 503 and 529
                             carry Retry-After; 529 is an overload error); on /v1/messages
                             Anthropic's shape, its type by status (rate_limit_error,
                             overloaded_error, api_error, authentication_error, ...)
    quota                    429 insufficient_quota (a spend limit, not a rate limit); on
                             /v1/messages Anthropic's 400 \"credit balance is too low\"
    drop-before-response     read the request, then close without sending a byte
    stall                    never send the response head; hold the connection until the
                             client closes it
    die-after=N              stream N content events, then close (no terminating chunk)
    end-after=N              stream N content events, then end the body properly framed but
                             with no finish chunk and no [DONE] (a truncated stream that looks
                             complete on the wire)
    drop-mid-stream          stream half the content events, then close
    error-event[=N]          stream N content events (default 0), then an SSE error event
                             (on /v1/messages: event: error, overloaded_error)
    malformed-chunk          after the first content event, an invalid chunk size, then close
    chunk-ext                chunk extensions and a trailer on streams
    close-delimited          no Content-Length or chunked framing; close to end the body
    close-after              answer with Connection: close, then close
    none                     no fault (x-mock-fault: none overrides the process fault)

ENDPOINTS:
    POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings
    POST /v1/messages        Anthropic's Messages API (streamed or not): needs x-api-key (or
                             Authorization: Bearer with an anthropic-version after 2023-06-01,
                             as the SDKs 2.x send it; else 401) and anthropic-version; the
                             body is checked as strictly as the real API checks it (400
                             invalid_request_error); errors in Anthropic's shape
    GET  /v1/models
    GET  /metrics            vllm:num_requests_running, vllm:num_requests_waiting,
                             vllm:kv_cache_usage_perc, sglang:num_running_reqs,
                             sglang:num_queue_reqs, sglang:token_usage
    GET  /_mock/stats        counters (JSON)
    POST /_mock/reset_peak   max_active_requests starts over
    GET  /_mock/fault        the process fault: {\"fault\": SPEC or null}
    POST /_mock/fault        set it: {\"fault\": \"SPEC\"}, or {\"fault\": null} to clear
    GET  /_mock/queue        real and reported queue counts
    POST /_mock/queue        report {\"waiting\": W, \"running\": R, \"kv_cache_usage\": F}
                             (each optional) in /metrics instead of the real counts; null
                             goes back to the real counts
    /metrics and /_mock/* ignore faults and request controls and are not queued.

REQUEST HEADERS:
    x-mock-fault: SPEC (replaces --fault), x-mock-status: N, x-mock-error-code: CODE,
    x-mock-retry-after: S, x-mock-ttft-ms: N, x-mock-inter-token-ms: N, x-mock-tokens: N,
    x-mock-delay-ms: N, x-mock-echo: none (no echo object in the answer, no `: echo` comment
    in a stream), x-mock-headers: provider (the twenty fields OpenAI's API adds to a head:
    date, openai-*, x-ratelimit-*, set-cookie, ...), x-mock-prompt-tokens: N (the uncached
    prompt count reported, instead of the body's length / 4; on /v1/messages its input_tokens)
    /v1/messages and /v1/chat/completions only:
    x-mock-tool-calls: N     when the request has tools, answer with N tool calls: on
                             /v1/messages N tool_use blocks; on /v1/chat/completions
                             message.tool_calls (content null, finish_reason tool_calls; each
                             call to the next of tools[].function.name, arguments
                             {\"city\":\"Paris\",\"n\":I}), streamed as OpenAI streams them
                             (a first chunk with index, id and name, then the arguments in 4
                             chunks, each a content event); completion_tokens stay --tokens
    x-mock-tool-calls-json: [{\"name\":N,\"arguments\":A},...]
                             exactly these calls, in order, whatever the request offers (A a
                             JSON value, or its JSON text as a string; absent: {}); on
                             /v1/messages A is the tool_use block's input
    x-mock-connection-option: NAME
                             the head lists NAME in Connection and carries NAME: for-one-hop
                             (a field a proxy must drop)
    x-mock-cache-read: R, x-mock-cache-write: W
                             cache usage: on /v1/messages cache_read_input_tokens and
                             cache_creation_input_tokens; on /v1/chat/completions
                             prompt_tokens + R + W, with prompt_tokens_details
                             {\"cached_tokens\": R, \"cache_write_tokens\": W}
";

/// A misbehaviour, per request (`x-mock-fault`) or per process (`--fault`, `POST /_mock/fault`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fault {
    DropMidStream,
    MalformedChunk,
    /// An SSE error event after this many content events (0: before any).
    ErrorEvent(u64),
    CloseDelimited,
    ChunkExt,
    CloseAfter,
    Status(u16),
    /// 429 with OpenAI's `insufficient_quota` body: a spend limit, which retrying won't cure
    /// (on `/v1/messages`: Anthropic's 400 "credit balance is too low").
    Quota,
    /// Read the request, then close without a byte of answer.
    DropBeforeResponse,
    /// Never answer; hold the connection until the client leaves.
    Stall,
    /// Stream this many content events, then drop the connection.
    DieAfter(u64),
    /// Stream this many content events, then end the body cleanly (terminating chunk) with no
    /// finish chunk and no `[DONE]`.
    EndAfter(u64),
}

impl Fault {
    pub fn parse(s: &str) -> Option<Fault> {
        let s = s.trim();
        let num = |prefix: &str| -> Option<u64> { s.strip_prefix(prefix)?.trim().parse().ok() };
        Some(match s {
            "drop-mid-stream" => Fault::DropMidStream,
            "malformed-chunk" => Fault::MalformedChunk,
            "error-event" => Fault::ErrorEvent(0),
            "close-delimited" => Fault::CloseDelimited,
            "chunk-ext" => Fault::ChunkExt,
            "close-after" => Fault::CloseAfter,
            "quota" => Fault::Quota,
            "drop-before-response" => Fault::DropBeforeResponse,
            "stall" => Fault::Stall,
            _ if s.starts_with("die-after=") => Fault::DieAfter(num("die-after=")?),
            _ if s.starts_with("end-after=") => Fault::EndAfter(num("end-after=")?),
            _ if s.starts_with("error-event=") => Fault::ErrorEvent(num("error-event=")?),
            _ => {
                let n = num("status=")?;
                if !(200..=599).contains(&n) {
                    return None;
                }
                Fault::Status(n as u16)
            }
        })
    }

    /// A fault, or `none` (Ok(None)): what `--fault`, `x-mock-fault` and `POST /_mock/fault`
    /// accept. `none` lets one request opt out of the process fault.
    pub fn parse_spec(s: &str) -> Result<Option<Fault>, String> {
        if s.trim() == "none" {
            return Ok(None);
        }
        Fault::parse(s)
            .map(Some)
            .ok_or_else(|| format!("unknown fault {s:?}"))
    }

    /// Only change streamed answers (a non-streaming request is answered normally).
    pub fn streams_only(self) -> bool {
        matches!(
            self,
            Fault::DropMidStream
                | Fault::MalformedChunk
                | Fault::ErrorEvent(_)
                | Fault::ChunkExt
                | Fault::DieAfter(_)
                | Fault::EndAfter(_)
        )
    }
}

/// The SPEC that parses back to the same fault (`GET /_mock/fault` answers with it).
impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::DropMidStream => f.write_str("drop-mid-stream"),
            Fault::MalformedChunk => f.write_str("malformed-chunk"),
            Fault::ErrorEvent(0) => f.write_str("error-event"),
            Fault::ErrorEvent(n) => write!(f, "error-event={n}"),
            Fault::CloseDelimited => f.write_str("close-delimited"),
            Fault::ChunkExt => f.write_str("chunk-ext"),
            Fault::CloseAfter => f.write_str("close-after"),
            Fault::Status(n) => write!(f, "status={n}"),
            Fault::Quota => f.write_str("quota"),
            Fault::DropBeforeResponse => f.write_str("drop-before-response"),
            Fault::Stall => f.write_str("stall"),
            Fault::DieAfter(n) => write!(f, "die-after={n}"),
            Fault::EndAfter(n) => write!(f, "end-after={n}"),
        }
    }
}

/// Per-instance defaults.
#[derive(Clone, Debug)]
pub struct Config {
    pub ttft_ms: u64,
    pub inter_token_ms: u64,
    pub tokens: u64,
    /// The process fault at start (`POST /_mock/fault` changes [`State::fault`]).
    pub fault: Option<Fault>,
    /// `Retry-After` of 429 / 503 / 529 answers; None: no header.
    pub retry_after: Option<String>,
    /// `error.code` of injected error bodies; None: the status's usual code.
    pub error_code: Option<String>,
    /// `--reject-key`: credentials answered 401, like a provider's revoked key.
    pub reject_keys: Vec<String>,
    /// `--max-running`: requests answered at once; None: unlimited.
    pub max_running: Option<u64>,
    /// Keep-alive timeout: close a connection idle this long between requests.
    pub idle_close: Option<Duration>,
}

/// Counters served at `/_mock/stats`.
#[derive(Default)]
pub struct Stats {
    pub connections_accepted: Cell<u64>,
    pub connections_open: Cell<u64>,
    pub requests: Cell<u64>,
    pub streams_started: Cell<u64>,
    pub streams_completed: Cell<u64>,
    pub streams_aborted: Cell<u64>,
    /// Connections closed by `--idle-close-ms`.
    pub idle_closed: Cell<u64>,
    /// Requests (not `/_mock/*`) read and not yet answered in full.
    pub active_requests: Cell<u64>,
    /// Peak of `active_requests` since start or the last `POST /_mock/reset_peak`.
    pub max_active_requests: Cell<u64>,
    /// Sums of the `usage` the mock reported, in bodies and streams, as sent.
    pub usage_prompt_tokens: Cell<u64>,
    pub usage_completion_tokens: Cell<u64>,
    /// Streaming requests that asked for `stream_options.include_usage: true`.
    pub include_usage_requests: Cell<u64>,
    /// Usage-only chunks (`choices: []`) sent at the end of chat / completions streams.
    pub usage_chunks: Cell<u64>,
    /// Answers that were an injected error status (`status=N`, `quota`, `x-mock-status`).
    pub errors_injected: Cell<u64>,
    /// Connections closed by `drop-before-response`.
    pub dropped_before_response: Cell<u64>,
    /// Requests `stall` held (counted when the stall begins).
    pub stalled: Cell<u64>,
    /// Streams cut on purpose before their end (`drop-mid-stream`, `die-after`,
    /// `malformed-chunk`).
    pub streams_cut: Cell<u64>,
    /// Streams that carried an injected SSE error event (`error-event`).
    pub error_events: Cell<u64>,
    /// Requests to `POST /v1/messages` (also counted in `requests`).
    pub messages_requests: Cell<u64>,
    /// Requests to `POST /v1/chat/completions` (also counted in `requests`): told apart from
    /// a gateway's health probes (`GET /v1/models`), which a process fault answers too.
    pub chat_requests: Cell<u64>,
    /// `/v1/messages` requests refused by its own checks (credentials 401, version and body 400).
    pub invalid_requests: Cell<u64>,
    /// Sums of the cache usage the mock reported on `/v1/messages` and `/v1/chat/completions`
    /// (also counted in `usage_prompt_tokens`).
    pub usage_cache_read_tokens: Cell<u64>,
    pub usage_cache_creation_tokens: Cell<u64>,
    /// Requests whose client (the gateway) closed the connection before their answer was
    /// complete: during `x-mock-delay-ms`, or mid-stream.
    pub requests_abandoned: Cell<u64>,
    /// For the latest of those: milliseconds from the request's head arriving to the close
    /// being noticed (the mock watches the socket while it delays and streams).
    pub last_abandoned_after_ms: Cell<u64>,
}

impl Stats {
    /// `queue`: the real counts of `--max-running`'s slots.
    pub fn write_json(&self, out: &mut Vec<u8>, queue: queue::Counts) {
        let active = self
            .streams_started
            .get()
            .saturating_sub(self.streams_completed.get() + self.streams_aborted.get());
        let _ = write!(
            out,
            "{{\"connections_accepted\":{},\"connections_open\":{},\"requests\":{},\
             \"streams_started\":{},\"streams_completed\":{},\"streams_aborted\":{},\
             \"active_streams\":{},\"idle_closed\":{},\"active_requests\":{},\
             \"max_active_requests\":{},\"usage_prompt_tokens\":{},\
             \"usage_completion_tokens\":{},\"include_usage_requests\":{},\
             \"usage_chunks\":{},\"errors_injected\":{},\"dropped_before_response\":{},\
             \"stalled\":{},\"streams_cut\":{},\"error_events\":{},\
             \"messages_requests\":{},\"chat_requests\":{},\"invalid_requests\":{},\
             \"usage_cache_read_tokens\":{},\"usage_cache_creation_tokens\":{},\
             \"requests_abandoned\":{},\"last_abandoned_after_ms\":{},\
             \"requests_running\":{},\"requests_waiting\":{},\"requests_queued\":{}}}",
            self.connections_accepted.get(),
            self.connections_open.get(),
            self.requests.get(),
            self.streams_started.get(),
            self.streams_completed.get(),
            self.streams_aborted.get(),
            active,
            self.idle_closed.get(),
            self.active_requests.get(),
            self.max_active_requests.get(),
            self.usage_prompt_tokens.get(),
            self.usage_completion_tokens.get(),
            self.include_usage_requests.get(),
            self.usage_chunks.get(),
            self.errors_injected.get(),
            self.dropped_before_response.get(),
            self.stalled.get(),
            self.streams_cut.get(),
            self.error_events.get(),
            self.messages_requests.get(),
            self.chat_requests.get(),
            self.invalid_requests.get(),
            self.usage_cache_read_tokens.get(),
            self.usage_cache_creation_tokens.get(),
            self.requests_abandoned.get(),
            self.last_abandoned_after_ms.get(),
            queue.running,
            queue.waiting,
            queue.queued
        );
    }

    /// A request starts being answered.
    pub fn request_began(&self) {
        let active = self.active_requests.get() + 1;
        self.active_requests.set(active);
        self.max_active_requests
            .set(self.max_active_requests.get().max(active));
    }

    /// A request's answer ended (sent in full, cut on purpose, or the client left).
    pub fn request_ended(&self) {
        self.active_requests
            .set(self.active_requests.get().saturating_sub(1));
    }

    /// Usage the mock put in a body or event it sent.
    pub fn reported_usage(&self, prompt: u64, completion: u64) {
        let p = &self.usage_prompt_tokens;
        p.set(p.get().saturating_add(prompt));
        let c = &self.usage_completion_tokens;
        c.set(c.get().saturating_add(completion));
    }

    /// Cache usage the mock put in a Messages or chat completion body or stream (its prompt
    /// part is counted by [`Stats::reported_usage`]).
    pub fn reported_cache(&self, read: u64, write: u64) {
        let r = &self.usage_cache_read_tokens;
        r.set(r.get().saturating_add(read));
        let w = &self.usage_cache_creation_tokens;
        w.set(w.get().saturating_add(write));
    }

    /// One more of a per-fault counter.
    pub fn bump(counter: &Cell<u64>) {
        counter.set(counter.get().saturating_add(1));
    }

    /// `POST /_mock/reset_peak`: the peak starts over from the requests in flight now.
    pub fn reset_peak(&self) {
        self.max_active_requests.set(self.active_requests.get());
    }
}

/// State shared by all connections (single thread).
pub struct State {
    pub cfg: Config,
    pub stats: Stats,
    /// The process fault: `--fault`, then whatever `POST /_mock/fault` set.
    pub fault: Cell<Option<Fault>>,
    /// `--max-running`'s slots, and the counts `/metrics` reports.
    pub slots: queue::Slots,
    /// Request sequence number, for ids.
    pub seq: Cell<u64>,
}

struct Args {
    listen: String,
    cfg: Config,
    tls: Option<(PathBuf, PathBuf)>,
    exit_on_stdin_eof: bool,
    legacy_driver: bool,
}

/// Ok(None): help was asked for.
fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        listen: "127.0.0.1:0".to_owned(),
        cfg: Config {
            ttft_ms: 0,
            inter_token_ms: 0,
            tokens: 16,
            fault: None,
            retry_after: Some("1".to_owned()),
            error_code: None,
            reject_keys: Vec::new(),
            max_running: None,
            idle_close: None,
        },
        tls: None,
        exit_on_stdin_eof: false,
        legacy_driver: false,
    };
    let (mut cert, mut key) = (None, None);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let mut value = || -> Result<String, String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it.next().ok_or_else(|| format!("{flag} needs a value")),
            }
        };
        let num = |v: String| -> Result<u64, String> {
            v.trim()
                .parse()
                .map_err(|_| format!("{flag}: not a number: {v:?}"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--listen" => a.listen = value()?,
            "--ttft-ms" => a.cfg.ttft_ms = num(value()?)?,
            "--inter-token-ms" => a.cfg.inter_token_ms = num(value()?)?,
            "--tokens" => a.cfg.tokens = num(value()?)?,
            "--idle-close-ms" => {
                // 0: never (the default).
                let ms = num(value()?)?;
                a.cfg.idle_close = (ms > 0).then(|| Duration::from_millis(ms));
            }
            "--fault" => a.cfg.fault = Fault::parse_spec(&value()?)?,
            "--retry-after" => {
                let v = value()?;
                let v = v.trim();
                // Sent verbatim in a header: no control characters (CR/LF would split it).
                if v.is_empty() || v.bytes().any(|b| b < 0x20 || b == 0x7f) {
                    return Err(format!("{flag}: not a header value: {v:?}"));
                }
                a.cfg.retry_after = (v != "none").then(|| v.to_owned());
            }
            "--error-code" => {
                let v = value()?;
                a.cfg.error_code = Some(v.trim().to_owned()).filter(|v| !v.is_empty());
            }
            "--reject-key" => {
                let v = value()?;
                a.cfg.reject_keys.push(v.trim().to_owned());
            }
            "--max-running" => {
                // 0: unlimited (the default), as for --idle-close-ms.
                let n = num(value()?)?;
                a.cfg.max_running = (n > 0).then_some(n);
            }
            "--tls-cert" => cert = Some(PathBuf::from(value()?)),
            "--tls-key" => key = Some(PathBuf::from(value()?)),
            "--exit-on-stdin-eof" if inline.is_none() => a.exit_on_stdin_eof = true,
            "--legacy-driver" if inline.is_none() => a.legacy_driver = true,
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    a.tls = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => return Err("--tls-cert and --tls-key go together".to_owned()),
    };
    Ok(Some(a))
}

fn load_tls(cert: &PathBuf, key: &PathBuf) -> Result<monoio_rustls::TlsAcceptor, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("reading certificates from {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("reading the private key from {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("TLS certificate/key: {e}"))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(monoio_rustls::TlsAcceptor::from(Arc::new(cfg)))
}

fn fail(msg: &str) -> ! {
    eprintln!("mock-llm: {msg}");
    std::process::exit(1)
}

/// Decrements `connections_open` when a connection task ends.
struct OpenGuard(Rc<State>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        let open = &self.0.stats.connections_open;
        open.set(open.get().saturating_sub(1));
    }
}

async fn serve(listen: String, st: Rc<State>, tls: Option<monoio_rustls::TlsAcceptor>) {
    let opts = ListenerOpts::default().reuse_port(false).backlog(4096);
    let listener = match TcpListener::bind_with_config(listen.as_str(), &opts) {
        Ok(l) => l,
        Err(e) => fail(&format!("cannot listen on {listen}: {e}")),
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => fail(&format!("local address: {e}")),
    };
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "mock-llm listening on {addr}");
        let _ = out.flush();
    }
    loop {
        match listener.accept().await {
            Ok((tcp, _peer)) => {
                let _ = tcp.set_nodelay(true);
                let stats = &st.stats;
                stats
                    .connections_accepted
                    .set(stats.connections_accepted.get() + 1);
                stats.connections_open.set(stats.connections_open.get() + 1);
                let guard = OpenGuard(st.clone());
                let st = st.clone();
                let tls = tls.clone();
                monoio::spawn(async move {
                    conn::run(tcp, st, tls).await;
                    drop(guard);
                });
            }
            Err(e) => {
                eprintln!("mock-llm: accept: {e}");
                // Out of descriptors or similar: back off instead of spinning.
                monoio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{HELP}");
            return;
        }
        Err(e) => {
            eprintln!("mock-llm: {e} (see --help)");
            std::process::exit(2);
        }
    };
    if args.exit_on_stdin_eof {
        std::thread::spawn(|| {
            let mut stdin = std::io::stdin().lock();
            let mut sink = [0u8; 1024];
            loop {
                match stdin.read(&mut sink) {
                    Ok(0) => std::process::exit(0),
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => std::process::exit(0),
                }
            }
        });
    }
    let tls = args
        .tls
        .as_ref()
        .map(|(cert, key)| load_tls(cert, key).unwrap_or_else(|e| fail(&e)));
    let st = Rc::new(State {
        fault: Cell::new(args.cfg.fault),
        slots: queue::Slots::new(args.cfg.max_running),
        cfg: args.cfg,
        stats: Stats::default(),
        seq: Cell::new(0),
    });
    let started = if args.legacy_driver {
        monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .map(|mut rt| rt.block_on(serve(args.listen, st, tls)))
    } else {
        monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .map(|mut rt| rt.block_on(serve(args.listen, st, tls)))
    };
    if let Err(e) = started {
        fail(&format!("cannot start the runtime: {e}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Option<Args>, String> {
        parse_args(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn faults() {
        assert_eq!(Fault::parse("status=503"), Some(Fault::Status(503)));
        assert_eq!(Fault::parse("chunk-ext"), Some(Fault::ChunkExt));
        assert_eq!(Fault::parse(" die-after=3 "), Some(Fault::DieAfter(3)));
        assert_eq!(Fault::parse("end-after=2"), Some(Fault::EndAfter(2)));
        assert_eq!(Fault::parse("error-event"), Some(Fault::ErrorEvent(0)));
        assert_eq!(Fault::parse("error-event=2"), Some(Fault::ErrorEvent(2)));
        for bad in [
            "status=abc",
            "status=600",
            "nope",
            "die-after=",
            "die-after=-1",
            "stall=1",
        ] {
            assert_eq!(Fault::parse(bad), None, "{bad}");
        }
        assert_eq!(Fault::parse_spec("none"), Ok(None));
        assert!(Fault::parse_spec("nope").is_err());
        // What GET /_mock/fault shows parses back to the same fault.
        for f in [
            Fault::DropMidStream,
            Fault::MalformedChunk,
            Fault::ErrorEvent(0),
            Fault::ErrorEvent(4),
            Fault::CloseDelimited,
            Fault::ChunkExt,
            Fault::CloseAfter,
            Fault::Status(529),
            Fault::Quota,
            Fault::DropBeforeResponse,
            Fault::Stall,
            Fault::DieAfter(0),
            Fault::EndAfter(5),
        ] {
            assert_eq!(Fault::parse(&f.to_string()), Some(f), "{f}");
        }
    }

    #[test]
    fn peak_and_usage_counters() {
        let s = Stats::default();
        s.request_began();
        s.request_began();
        s.request_ended();
        s.request_began();
        assert_eq!(
            (s.active_requests.get(), s.max_active_requests.get()),
            (2, 2)
        );
        s.request_ended();
        s.reset_peak();
        assert_eq!(s.max_active_requests.get(), 1);
        s.request_ended();
        s.request_ended();
        assert_eq!(s.active_requests.get(), 0);
        s.reported_usage(3, 4);
        s.reported_usage(1, 0);
        let mut out = Vec::new();
        let queue = queue::Counts {
            running: 2,
            waiting: 1,
            queued: 5,
        };
        s.write_json(&mut out, queue);
        let v: serde_json::Value = match serde_json::from_slice(&out) {
            Ok(v) => v,
            Err(e) => panic!("{e}: {}", String::from_utf8_lossy(&out)),
        };
        assert_eq!(v["usage_prompt_tokens"], 4);
        assert_eq!(v["usage_completion_tokens"], 4);
        assert_eq!(v["max_active_requests"], 1);
        assert_eq!(v["active_requests"], 0);
        assert_eq!(v["requests_waiting"], 1);
        assert_eq!(v["requests_queued"], 5);
        assert_eq!(v["dropped_before_response"], 0);
    }

    #[test]
    fn arguments() {
        let Ok(Some(a)) = args(&["--tokens", "3", "--ttft-ms=5", "--fault", "close-after"]) else {
            panic!("not parsed")
        };
        assert_eq!(a.cfg.tokens, 3);
        assert_eq!(a.cfg.ttft_ms, 5);
        assert_eq!(a.cfg.fault, Some(Fault::CloseAfter));
        assert_eq!(a.cfg.idle_close, None);
        let Ok(Some(a)) = args(&["--idle-close-ms", "100"]) else {
            panic!("not parsed")
        };
        assert_eq!(a.cfg.idle_close, Some(Duration::from_millis(100)));
        let Ok(Some(a)) = args(&["--idle-close-ms=0"]) else {
            panic!("not parsed")
        };
        assert_eq!(a.cfg.idle_close, None);
        assert!(args(&["--idle-close-ms=x"]).is_err());
        let Ok(Some(a)) = args(&[]) else {
            panic!("not parsed")
        };
        assert_eq!(a.cfg.retry_after.as_deref(), Some("1"));
        assert_eq!((a.cfg.max_running, a.cfg.error_code), (None, None));
        let Ok(Some(a)) = args(&[
            "--retry-after=none",
            "--max-running",
            "2",
            "--error-code",
            "c",
            "--fault",
            "none",
        ]) else {
            panic!("not parsed")
        };
        assert_eq!(a.cfg.retry_after, None);
        assert_eq!(a.cfg.max_running, Some(2));
        assert_eq!(a.cfg.error_code.as_deref(), Some("c"));
        assert_eq!(a.cfg.fault, None);
        let Ok(Some(a)) = args(&["--retry-after", "30", "--max-running=0"]) else {
            panic!("not parsed")
        };
        assert_eq!(a.cfg.retry_after.as_deref(), Some("30"));
        assert_eq!(a.cfg.max_running, None);
        assert!(args(&["--retry-after", ""]).is_err());
        assert!(args(&["--fault", "stall=2"]).is_err());
        assert!(matches!(args(&["--help"]), Ok(None)));
        assert!(args(&["--tls-cert", "x"]).is_err());
        assert!(args(&["--bogus"]).is_err());
        assert!(args(&["--tokens"]).is_err());
    }
}
