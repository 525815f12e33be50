//! Every error Sluice answers itself, and its one mapping to an HTTP response.
//!
//! Raised by any phase; turned into bytes only here, by [`GatewayError::write_response`], as an
//! OpenAI-shaped body `{"error":{"message","type","param","code"}}` with the status and headers
//! that OpenAI SDKs map to the right exception — or, for a client of Anthropic's Messages API
//! ([`ClientDialect::Anthropic`]), Anthropic's `{"type":"error","error":{"type","message"}}`
//! with the same status and headers, the type picked by the status as Anthropic's SDKs read it. Messages never carry upstream credentials or
//! request bodies.

use std::fmt;

use crate::openai::endpoint::ClientDialect;
use crate::openai::json::{truncate, write_json_string};
pub(crate) use crate::upstream::UpstreamFault;

/// Where a fault came from, which decides the status class and the access log's
/// `error_class`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The client sent something we refuse.
    Client,
    /// The upstream failed or misbehaved.
    Upstream,
    /// Sluice itself is overloaded or misconfigured.
    Gateway,
}

/// Every kind of answer Sluice gives itself. What a kind means on the wire — status, OpenAI
/// `type` and `code`, whether the connection is kept, whether another backend may succeed — is
/// declared once, in [`ErrorKind::spec`]; call sites only pick the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ErrorKind {
    /// Not well-formed HTTP/1.1, or the client left inside a request.
    MalformedHttp,
    /// The request line is longer than `max_request_line_bytes`.
    UriTooLong,
    /// The head is larger than `max_header_bytes`, or has too many fields.
    HeadTooLarge,
    /// The body is larger than `max_body_bytes`.
    BodyTooLarge,
    /// An `Expect` other than `100-continue`.
    ExpectationFailed,
    /// The head or body did not arrive in time.
    RequestTimeout,
    /// Well-framed, but the content is refused (bad JSON, a missing model, two keys).
    InvalidRequest,
    MissingApiKey,
    /// No key has this digest. The three kinds of a key that does not open answer alike (the
    /// client learns nothing); the access log tells them apart.
    InvalidApiKey,
    /// A key with `enabled = false`.
    DisabledApiKey,
    /// A key past its `expires`.
    ExpiredApiKey,
    /// The key may not be used from the client's address.
    SourceNotAllowed,
    /// The key may not use the requested model.
    ModelNotAllowed,
    /// No cluster serves the model.
    ModelNotFound,
    /// An unknown path.
    NotFound,
    MethodNotAllowed,
    /// A limit policy refused (rpm, tpm, concurrency).
    RateLimited,
    /// No quota plan of the key has enough left.
    InsufficientQuota,
    /// The shared limit ledger is unreachable and the worker's share does not cover the request.
    LimitsUnavailable,
    /// The worker is at its connection cap.
    Overloaded,
    /// This worker already holds `max_connections_per_backend` to the chosen backend.
    UpstreamPoolFull,
    /// TCP to the upstream failed (refused, unreachable).
    UpstreamConnect,
    /// The TLS handshake with the upstream failed.
    UpstreamTls,
    /// Connecting, the first byte or a stream went past its timeout.
    UpstreamTimeout,
    /// The upstream connection failed or closed early.
    UpstreamIo,
    /// The upstream broke HTTP framing.
    UpstreamProtocol,
    /// Sluice is stopping and the request's shutdown grace ran out.
    ShuttingDown,
    /// Every backend of the route is out (breaker open, cooling down), or every attempt the
    /// retry budget allowed failed.
    UpstreamUnavailable,
    /// No target of the route has a context window that holds the prompt and the output asked
    /// for.
    ContextLengthExceeded,
    /// The client left while an attempt waited for its answer: the attempt is cut, nothing is
    /// written (499, as nginx logs a client that closed its request).
    ClientLeft,
    /// Every backend that could take the request is at its cap (`[saturation]`) and the
    /// request may not wait (its wait is 0).
    BackendsFull,
    /// The wait queue is at its bound and holds nothing of a lower class to shed.
    QueueFull,
    /// The request waited its class's (or its header's) longest and no backend had room.
    QueueTimeout,
    /// Shed: dropped from the queue for a higher class's request, or refused while a higher
    /// class waits.
    Shed,
    /// Over an `on_limit = "queue"` policy, the request waited as long as it could and the
    /// limit still had no room.
    LimitWaitTimeout,
}

/// What one [`ErrorKind`] is on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spec {
    pub(crate) status: u16,
    /// OpenAI's `type`: `invalid_request_error`, `permission_error`, `upstream_error`, …
    pub(crate) error_type: &'static str,
    /// OpenAI's `code`, when there is a stable one (`model_not_found`).
    pub(crate) code: Option<&'static str>,
    pub(crate) origin: Origin,
    /// Close the client connection after answering: the rest of the request was not read, or
    /// the stream can't be trusted.
    pub(crate) close: bool,
    /// Another backend may succeed where this one failed (a fallback may try it).
    pub(crate) retry_elsewhere: bool,
}

const INVALID: &str = "invalid_request_error";
const PERMISSION: &str = "permission_error";
const SERVER: &str = "server_error";
const UPSTREAM: &str = "upstream_error";
const RATE_LIMIT: &str = "rate_limit_error";
const QUOTA: &str = "insufficient_quota";

const fn spec(
    status: u16,
    error_type: &'static str,
    code: Option<&'static str>,
    origin: Origin,
    close: bool,
    retry_elsewhere: bool,
) -> Spec {
    Spec {
        status,
        error_type,
        code,
        origin,
        close,
        retry_elsewhere,
    }
}

impl ErrorKind {
    /// Every kind, in declaration order.
    #[cfg(test)]
    pub(crate) const ALL: [ErrorKind; 35] = {
        use ErrorKind::*;
        [
            MalformedHttp,
            UriTooLong,
            HeadTooLarge,
            BodyTooLarge,
            ExpectationFailed,
            RequestTimeout,
            InvalidRequest,
            MissingApiKey,
            InvalidApiKey,
            DisabledApiKey,
            ExpiredApiKey,
            SourceNotAllowed,
            ModelNotAllowed,
            ModelNotFound,
            NotFound,
            MethodNotAllowed,
            RateLimited,
            InsufficientQuota,
            LimitsUnavailable,
            Overloaded,
            UpstreamPoolFull,
            UpstreamConnect,
            UpstreamTls,
            UpstreamTimeout,
            UpstreamIo,
            UpstreamProtocol,
            ShuttingDown,
            UpstreamUnavailable,
            ContextLengthExceeded,
            ClientLeft,
            BackendsFull,
            QueueFull,
            QueueTimeout,
            Shed,
            LimitWaitTimeout,
        ]
    };

    /// The catalogue: one row per kind.
    pub(crate) const fn spec(self) -> Spec {
        use ErrorKind::*;
        use Origin::{Client, Gateway, Upstream};
        const CLOSE: bool = true;
        const KEEP: bool = false;
        const ELSEWHERE: bool = true;
        const NOWHERE: bool = false;
        #[rustfmt::skip]
        let row = match self {
            // kind => spec(status, OpenAI type, OpenAI code, origin, connection, another backend)
            MalformedHttp     => spec(400, INVALID,    None,                        Client,   CLOSE, NOWHERE),
            UriTooLong        => spec(414, INVALID,    None,                        Client,   CLOSE, NOWHERE),
            HeadTooLarge      => spec(431, INVALID,    None,                        Client,   CLOSE, NOWHERE),
            BodyTooLarge      => spec(413, INVALID,    None,                        Client,   CLOSE, NOWHERE),
            ExpectationFailed => spec(417, INVALID,    None,                        Client,   CLOSE, NOWHERE),
            RequestTimeout    => spec(408, INVALID,    None,                        Client,   CLOSE, NOWHERE),
            InvalidRequest    => spec(400, INVALID,    None,                        Client,   KEEP,  NOWHERE),
            MissingApiKey     => spec(401, INVALID,    Some("missing_api_key"),     Client,   KEEP,  NOWHERE),
            InvalidApiKey     => spec(401, INVALID,    Some("invalid_api_key"),     Client,   KEEP,  NOWHERE),
            DisabledApiKey    => spec(401, INVALID,    Some("invalid_api_key"),     Client,   KEEP,  NOWHERE),
            ExpiredApiKey     => spec(401, INVALID,    Some("invalid_api_key"),     Client,   KEEP,  NOWHERE),
            SourceNotAllowed  => spec(403, PERMISSION, Some("source_not_allowed"),  Client,   KEEP,  NOWHERE),
            ModelNotAllowed   => spec(403, PERMISSION, Some("model_not_allowed"),   Client,   KEEP,  NOWHERE),
            ModelNotFound     => spec(404, INVALID,    Some("model_not_found"),     Client,   KEEP,  NOWHERE),
            NotFound          => spec(404, INVALID,    None,                        Client,   KEEP,  NOWHERE),
            MethodNotAllowed  => spec(405, INVALID,    None,                        Client,   KEEP,  NOWHERE),
            RateLimited       => spec(429, RATE_LIMIT, Some("rate_limit_exceeded"), Client,   KEEP,  NOWHERE),
            InsufficientQuota => spec(429, QUOTA,      Some("insufficient_quota"),  Client,   KEEP,  NOWHERE),
            LimitsUnavailable => spec(503, SERVER,     Some("limits_unavailable"),  Gateway,  KEEP,  NOWHERE),
            Overloaded        => spec(503, SERVER,     None,                        Gateway,  CLOSE, NOWHERE),
            UpstreamPoolFull  => spec(503, SERVER,     None,                        Gateway,  KEEP,  ELSEWHERE),
            UpstreamConnect   => spec(502, UPSTREAM,   None,                        Upstream, KEEP,  ELSEWHERE),
            UpstreamTls       => spec(502, UPSTREAM,   None,                        Upstream, KEEP,  ELSEWHERE),
            UpstreamTimeout   => spec(504, UPSTREAM,   None,                        Upstream, KEEP,  ELSEWHERE),
            UpstreamIo        => spec(502, UPSTREAM,   None,                        Upstream, KEEP,  ELSEWHERE),
            UpstreamProtocol  => spec(502, UPSTREAM,   None,                        Upstream, KEEP,  ELSEWHERE),
            ShuttingDown      => spec(503, SERVER,     Some("server_shutting_down"),Gateway,  CLOSE, NOWHERE),
            UpstreamUnavailable => spec(503, SERVER,   Some("upstream_unavailable"),Gateway,  KEEP,  NOWHERE),
            ContextLengthExceeded => spec(400, INVALID, Some("context_length_exceeded"), Client, KEEP, NOWHERE),
            ClientLeft        => spec(499, INVALID,    Some("client_closed_request"), Client,  CLOSE, NOWHERE),
            BackendsFull      => spec(503, SERVER,     Some("backends_full"),       Gateway,  KEEP,  NOWHERE),
            QueueFull         => spec(503, SERVER,     Some("queue_full"),          Gateway,  KEEP,  NOWHERE),
            QueueTimeout      => spec(503, SERVER,     Some("queue_timeout"),       Gateway,  KEEP,  NOWHERE),
            Shed              => spec(503, SERVER,     Some("request_shed"),        Gateway,  KEEP,  NOWHERE),
            LimitWaitTimeout  => spec(429, RATE_LIMIT, Some("rate_limit_queue_timeout"), Client, KEEP, NOWHERE),
        };
        row
    }

    pub(crate) const fn status(self) -> u16 {
        self.spec().status
    }

    /// OpenAI's `type`.
    pub(crate) const fn error_type(self) -> &'static str {
        self.spec().error_type
    }

    /// OpenAI's `code`.
    pub(crate) const fn code(self) -> Option<&'static str> {
        self.spec().code
    }

    pub(crate) const fn origin(self) -> Origin {
        self.spec().origin
    }

    /// The client connection is closed after this answer, whatever the client asked.
    pub(crate) const fn close(self) -> bool {
        self.spec().close
    }

    /// Another backend may succeed: the failure was this backend's (or this worker's way to
    /// it), not the request's or the caller's. Meaningful before the response started.
    pub(crate) const fn retry_elsewhere(self) -> bool {
        self.spec().retry_elsewhere
    }

    /// Why authentication or authorization refused, for the access log's
    /// `auth_rejection_reason` (the client's answer may not tell them apart); `None` for any
    /// other kind. [`ErrorKind::AUTH_REJECTION_REASONS`] lists every value.
    pub(crate) const fn auth_rejection_reason(self) -> Option<&'static str> {
        match self {
            ErrorKind::MissingApiKey => Some("missing_key"),
            ErrorKind::InvalidApiKey => Some("unknown_key"),
            ErrorKind::DisabledApiKey => Some("disabled_key"),
            ErrorKind::ExpiredApiKey => Some("expired_key"),
            ErrorKind::SourceNotAllowed => Some("source_not_allowed"),
            ErrorKind::ModelNotAllowed => Some("model_not_allowed"),
            _ => None,
        }
    }

    /// Every `auth_rejection_reason` (docs/accesslog.md and proto/accesslog.proto list exactly
    /// these: a test holds them to it).
    #[cfg(test)]
    pub(crate) const AUTH_REJECTION_REASONS: [&'static str; 6] = [
        "missing_key",
        "unknown_key",
        "disabled_key",
        "expired_key",
        "source_not_allowed",
        "model_not_allowed",
    ];

    /// The kind of an upstream failure, for metrics and the access log.
    pub(crate) const fn upstream_fault(self) -> Option<UpstreamFault> {
        match self {
            ErrorKind::UpstreamConnect => Some(UpstreamFault::Connect),
            ErrorKind::UpstreamTls => Some(UpstreamFault::Tls),
            ErrorKind::UpstreamTimeout => Some(UpstreamFault::Timeout),
            ErrorKind::UpstreamIo => Some(UpstreamFault::Io),
            ErrorKind::UpstreamProtocol => Some(UpstreamFault::Protocol),
            _ => None,
        }
    }

    /// The kind an upstream fault is answered as.
    pub(crate) const fn of_fault(fault: UpstreamFault) -> ErrorKind {
        match fault {
            UpstreamFault::Connect => ErrorKind::UpstreamConnect,
            UpstreamFault::Tls => ErrorKind::UpstreamTls,
            UpstreamFault::Timeout => ErrorKind::UpstreamTimeout,
            UpstreamFault::Io => ErrorKind::UpstreamIo,
            UpstreamFault::Protocol => ErrorKind::UpstreamProtocol,
        }
    }
}

/// An error Sluice answers itself: its kind, and what this instance adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GatewayError {
    pub(crate) kind: ErrorKind,
    pub(crate) message: String,
    /// OpenAI's `param`: the request field at fault.
    pub(crate) param: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub(crate) retry_after: Option<u32>,
    /// Methods for an `Allow` header (405).
    pub(crate) allow: Option<&'static str>,
    /// Extra header lines (each ending in CRLF), e.g. the `x-ratelimit-*` set. Boxed: errors
    /// travel in `Result`s everywhere and should stay small.
    #[allow(
        clippy::box_collection,
        reason = "one pointer instead of three in every Result that carries an error"
    )]
    pub(crate) extra_headers: Option<Box<String>>,
}

impl GatewayError {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        GatewayError {
            kind,
            message: message.into(),
            param: None,
            retry_after: None,
            allow: None,
            extra_headers: None,
        }
    }

    pub(crate) fn with_param(mut self, param: Option<&'static str>) -> Self {
        self.param = param;
        self
    }

    pub(crate) fn with_retry_after(mut self, seconds: Option<u32>) -> Self {
        self.retry_after = seconds;
        self
    }

    /// 503: the shared limit ledger is unreachable and the request is not covered by what this
    /// worker holds.
    pub(crate) fn limits_unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::LimitsUnavailable, message).with_retry_after(Some(1))
    }

    /// A malformed request at the HTTP layer: 400 and close.
    pub(crate) fn bad_http(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::MalformedHttp, message)
    }

    /// A well-framed request whose content is refused (bad JSON, missing model): 400, the
    /// connection stays usable.
    pub(crate) fn invalid_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message).with_param(param)
    }

    pub(crate) fn timeout_client(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RequestTimeout, message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    pub(crate) fn method_not_allowed(message: impl Into<String>, allow: &'static str) -> Self {
        let mut e = Self::new(ErrorKind::MethodNotAllowed, message);
        e.allow = Some(allow);
        e
    }

    pub(crate) fn expectation_failed() -> Self {
        Self::new(
            ErrorKind::ExpectationFailed,
            "only `Expect: 100-continue` is supported",
        )
    }

    pub(crate) fn model_not_found(model: &str) -> Self {
        Self::new(
            ErrorKind::ModelNotFound,
            format!(
                "The model `{}` does not exist or you do not have access to it.",
                truncate(model, 128)
            ),
        )
        .with_param(Some("model"))
    }

    /// No backend of the route for `model` can be tried before `retry_after_secs`.
    pub(crate) fn upstream_unavailable(model: &str, retry_after_secs: u64) -> Self {
        let mut e = Self::new(
            ErrorKind::UpstreamUnavailable,
            format!(
                "Every upstream for the model `{}` is failing or rate limited; retry after {} s.",
                truncate(model, 128),
                retry_after_secs
            ),
        );
        e.retry_after = Some(u32::try_from(retry_after_secs).unwrap_or(u32::MAX));
        e
    }

    /// Every backend that could take a request for `model` is at its cap. Only the route
    /// phase makes one: the pipeline queues the request ([`crate::gateway::queue`]) and
    /// answers it only when the request may not wait.
    /// No model name in the message: a waiting request's turn may find every backend full
    /// again, and each try makes one of these (most never reach a client).
    pub(crate) fn saturated() -> Self {
        Self::new(
            ErrorKind::BackendsFull,
            "Every upstream for this model is at capacity; retry shortly.",
        )
        .with_retry_after(Some(1))
    }

    /// The request needs `needed` tokens of context; the largest window routed to holds
    /// `largest`.
    pub(crate) fn context_length_exceeded(needed: u64, largest: u64) -> Self {
        Self::new(
            ErrorKind::ContextLengthExceeded,
            format!(
                "This request needs about {needed} tokens (prompt and max_tokens); the largest \
                 context window this model is routed to holds {largest}."
            ),
        )
        .with_param(Some("messages"))
    }

    /// The upstream failed (`fault` says how, and so which kind).
    pub(crate) fn bad_gateway(fault: UpstreamFault, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::of_fault(fault), message)
    }

    /// 504: the upstream did not answer in time.
    pub(crate) fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::UpstreamTimeout, message)
    }

    /// 503: this worker can take no more connections.
    pub(crate) fn overloaded(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Overloaded, message).with_retry_after(Some(1))
    }

    /// The client left while an attempt waited for its answer (see [`ErrorKind::ClientLeft`]).
    pub(crate) fn client_left() -> Self {
        Self::new(
            ErrorKind::ClientLeft,
            "the client closed the connection before the answer began",
        )
    }

    /// 503: the request bodies this worker holds (and the translations it is building) would
    /// pass `server.max_body_memory_per_worker`.
    pub(crate) fn body_memory_full() -> Self {
        Self::overloaded(
            "This server holds as many request bodies as it has memory for; retry shortly.",
        )
    }

    /// 503: Sluice is stopping and the grace it gives running requests is over. As an SSE
    /// error event, it ends a stream that was still running then.
    pub(crate) fn shutting_down() -> Self {
        Self::new(
            ErrorKind::ShuttingDown,
            "the gateway is shutting down and this request ran past its shutdown grace period; retry it",
        )
        .with_retry_after(Some(1))
    }

    pub(crate) fn status(&self) -> u16 {
        self.kind.status()
    }

    /// OpenAI's `type`.
    pub(crate) fn error_type(&self) -> &'static str {
        self.kind.error_type()
    }

    /// OpenAI's `code`.
    pub(crate) fn code(&self) -> Option<&'static str> {
        self.kind.code()
    }

    pub(crate) fn origin(&self) -> Origin {
        self.kind.origin()
    }

    pub(crate) fn upstream_fault(&self) -> Option<UpstreamFault> {
        self.kind.upstream_fault()
    }

    /// Whether the client connection stays open after this answer, when the client asked to
    /// keep it (`keep_alive`).
    pub(crate) fn keeps_connection(&self, keep_alive: bool) -> bool {
        keep_alive && !self.kind.close()
    }

    /// The error object as JSON: `{"error":{…}}` (OpenAI), or `{"type":"error","error":{…}}`
    /// (Anthropic).
    pub(crate) fn body(&self, dialect: ClientDialect) -> String {
        let mut s = String::with_capacity(self.body_len(dialect));
        let _ = self.write_body(&mut s, dialect);
        s
    }

    fn body_len(&self, dialect: ClientDialect) -> usize {
        let mut n = Count(0);
        let _ = self.write_body(&mut n, dialect);
        n.0
    }

    fn write_body<W: fmt::Write>(&self, out: &mut W, dialect: ClientDialect) -> fmt::Result {
        if dialect == ClientDialect::Anthropic {
            out.write_str("{\"type\":\"error\",\"error\":{\"type\":")?;
            let kind = crate::openai::anthropic::client::error_type_for_status(self.status());
            write_json_string(out, kind)?;
            out.write_str(",\"message\":")?;
            write_json_string(out, &self.message)?;
            return out.write_str("}}");
        }
        out.write_str("{\"error\":{\"message\":")?;
        write_json_string(out, &self.message)?;
        out.write_str(",\"type\":")?;
        write_json_string(out, self.error_type())?;
        out.write_str(",\"param\":")?;
        match self.param {
            Some(p) => write_json_string(out, p)?,
            None => out.write_str("null")?,
        }
        out.write_str(",\"code\":")?;
        match self.code() {
            Some(c) => write_json_string(out, c)?,
            None => out.write_str("null")?,
        }
        out.write_str("}}")
    }

    /// The whole HTTP response (head and body); `head_only` for HEAD requests. The one place
    /// the response is laid out: [`Self::write_response`] writes it, [`Self::response_len`]
    /// counts it.
    fn render<W: fmt::Write>(
        &self,
        out: &mut W,
        keep_alive: bool,
        head_only: bool,
        dialect: ClientDialect,
    ) -> fmt::Result {
        let status = self.status();
        crate::http::write_head_start(out, status, "application/json", self.body_len(dialect))?;
        if let Some(methods) = self.allow {
            write!(out, "allow: {methods}\r\n")?;
        }
        if let Some(secs) = self.retry_after {
            write!(out, "retry-after: {secs}\r\n")?;
        }
        if let Some(extra) = &self.extra_headers {
            out.write_str(extra)?;
        }
        if !self.keeps_connection(keep_alive) {
            out.write_str("connection: close\r\n")?;
        }
        out.write_str("\r\n")?;
        if !head_only {
            self.write_body(out, dialect)?;
        }
        Ok(())
    }

    /// Append the whole HTTP response (head and body, in the client's `dialect`) to `out`.
    /// `head_only` for HEAD requests. Returns the bytes appended.
    pub(crate) fn write_response(
        &self,
        out: &mut Vec<u8>,
        keep_alive: bool,
        head_only: bool,
        dialect: ClientDialect,
    ) -> usize {
        let before = out.len();
        let _ = self.render(
            &mut crate::http::VecText(out),
            keep_alive,
            head_only,
            dialect,
        );
        out.len() - before
    }

    /// How many bytes [`Self::write_response`] appends, counted without writing them.
    pub(crate) fn response_len(
        &self,
        keep_alive: bool,
        head_only: bool,
        dialect: ClientDialect,
    ) -> usize {
        let mut n = Count(0);
        let _ = self.render(&mut n, keep_alive, head_only, dialect);
        n.0
    }

    /// Header lines to add to the response (written as given).
    pub(crate) fn add_headers(&mut self, lines: &str) {
        if !lines.is_empty() {
            self.extra_headers
                .get_or_insert_with(Default::default)
                .push_str(lines);
        }
    }

    /// The error as one SSE event, for a stream that already started: a `data:` event
    /// (OpenAI), or Anthropic's `event: error`.
    pub(crate) fn sse_event(&self, dialect: ClientDialect) -> String {
        match dialect {
            ClientDialect::OpenAi => format!("data: {}\n\n", self.body(dialect)),
            ClientDialect::Anthropic => format!("event: error\ndata: {}\n\n", self.body(dialect)),
        }
    }
}

/// A text sink that only counts bytes.
struct Count(usize);

impl fmt::Write for Count {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0 += s.len();
        Ok(())
    }
}

impl From<crate::upstream::ConnectError> for GatewayError {
    fn from(e: crate::upstream::ConnectError) -> Self {
        use crate::upstream::ConnectError;
        match e {
            ConnectError::Failed { fault, message } => GatewayError::bad_gateway(fault, message),
            ConnectError::PoolFull => GatewayError::new(
                ErrorKind::UpstreamPoolFull,
                "upstream connection limit reached; retry shortly",
            )
            .with_retry_after(Some(1)),
            ConnectError::Timeout => {
                GatewayError::gateway_timeout("timed out connecting to the upstream")
            }
        }
    }
}

impl From<crate::http::HttpError> for GatewayError {
    fn from(e: crate::http::HttpError) -> Self {
        use crate::http::HttpError;
        match e {
            HttpError::Limit { status, message } => {
                let kind = match status {
                    413 => ErrorKind::BodyTooLarge,
                    414 => ErrorKind::UriTooLong,
                    // 431, the only other limit the HTTP layer has.
                    _ => ErrorKind::HeadTooLarge,
                };
                GatewayError::new(kind, message)
            }
            HttpError::Malformed(message) => GatewayError::bad_http(message),
            HttpError::ExpectationFailed => GatewayError::expectation_failed(),
        }
    }
}

impl From<crate::openai::inspect::InspectError> for GatewayError {
    fn from(e: crate::openai::inspect::InspectError) -> Self {
        GatewayError::invalid_request(e.message, e.param)
    }
}

impl fmt::Display for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status(),
            self.error_type(),
            self.message
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const OPENAI: ClientDialect = ClientDialect::OpenAi;

    #[test]
    fn catalogue_table() {
        use ErrorKind::*;
        for kind in ErrorKind::ALL {
            // (status, type, code, retry elsewhere, close) — one row per kind, as the API
            // documents it; a new kind does not compile until it has a row here.
            #[rustfmt::skip]
            let expected: (u16, &str, Option<&str>, bool, bool) = match kind {
                MalformedHttp     => (400, "invalid_request_error", None,                        false, true),
                UriTooLong        => (414, "invalid_request_error", None,                        false, true),
                HeadTooLarge      => (431, "invalid_request_error", None,                        false, true),
                BodyTooLarge      => (413, "invalid_request_error", None,                        false, true),
                ExpectationFailed => (417, "invalid_request_error", None,                        false, true),
                RequestTimeout    => (408, "invalid_request_error", None,                        false, true),
                InvalidRequest    => (400, "invalid_request_error", None,                        false, false),
                MissingApiKey     => (401, "invalid_request_error", Some("missing_api_key"),     false, false),
                InvalidApiKey     => (401, "invalid_request_error", Some("invalid_api_key"),     false, false),
                DisabledApiKey    => (401, "invalid_request_error", Some("invalid_api_key"),     false, false),
                ExpiredApiKey     => (401, "invalid_request_error", Some("invalid_api_key"),     false, false),
                SourceNotAllowed  => (403, "permission_error",      Some("source_not_allowed"),  false, false),
                ModelNotAllowed   => (403, "permission_error",      Some("model_not_allowed"),   false, false),
                ModelNotFound     => (404, "invalid_request_error", Some("model_not_found"),     false, false),
                NotFound          => (404, "invalid_request_error", None,                        false, false),
                MethodNotAllowed  => (405, "invalid_request_error", None,                        false, false),
                RateLimited       => (429, "rate_limit_error",      Some("rate_limit_exceeded"), false, false),
                InsufficientQuota => (429, "insufficient_quota",    Some("insufficient_quota"),  false, false),
                LimitsUnavailable => (503, "server_error",          Some("limits_unavailable"),  false, false),
                Overloaded        => (503, "server_error",          None,                        false, true),
                UpstreamPoolFull  => (503, "server_error",          None,                        true,  false),
                UpstreamConnect   => (502, "upstream_error",        None,                        true,  false),
                UpstreamTls       => (502, "upstream_error",        None,                        true,  false),
                UpstreamTimeout   => (504, "upstream_error",        None,                        true,  false),
                UpstreamIo        => (502, "upstream_error",        None,                        true,  false),
                UpstreamProtocol  => (502, "upstream_error",        None,                        true,  false),
                ShuttingDown      => (503, "server_error",          Some("server_shutting_down"),false, true),
                UpstreamUnavailable => (503, "server_error",        Some("upstream_unavailable"),false, false),
                ContextLengthExceeded => (400, "invalid_request_error", Some("context_length_exceeded"), false, false),
                ClientLeft        => (499, "invalid_request_error", Some("client_closed_request"), false, true),
                BackendsFull      => (503, "server_error",          Some("backends_full"),       false, false),
                QueueFull         => (503, "server_error",          Some("queue_full"),          false, false),
                QueueTimeout      => (503, "server_error",          Some("queue_timeout"),       false, false),
                Shed              => (503, "server_error",          Some("request_shed"),        false, false),
                LimitWaitTimeout  => (429, "rate_limit_error",      Some("rate_limit_queue_timeout"), false, false),
            };
            let actual = (
                kind.status(),
                kind.error_type(),
                kind.code(),
                kind.retry_elsewhere(),
                kind.close(),
            );
            assert_eq!(actual, expected, "{kind:?}");
            assert_ne!(crate::http::reason(kind.status()), "Unknown", "{kind:?}");
            // Upstream kinds, and only they, name an upstream fault, which maps back to them.
            match kind.upstream_fault() {
                Some(fault) => assert_eq!(ErrorKind::of_fault(fault), kind),
                None => assert_ne!(kind.origin(), Origin::Upstream, "{kind:?}"),
            }
        }
        // `ALL` holds every kind once, in declaration order.
        assert_eq!(ErrorKind::ALL.len(), LimitWaitTimeout as usize + 1);
        for (i, kind) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(*kind as usize, i);
        }
    }

    /// An instance of `kind` with every optional part set, and a message that needs escaping.
    fn full(kind: ErrorKind) -> GatewayError {
        let mut e = GatewayError::new(kind, "quote \" backslash \\ newline \n ctl \u{1} ünï ✓")
            .with_param(Some("model"))
            .with_retry_after(Some(7));
        e.allow = Some("GET, HEAD");
        e.add_headers("x-ratelimit-limit-requests: 10\r\n");
        e
    }

    #[test]
    fn every_body_is_openai_shaped_json() {
        for kind in ErrorKind::ALL {
            for e in [GatewayError::new(kind, "plain"), full(kind)] {
                let v: serde_json::Value = serde_json::from_str(&e.body(OPENAI)).unwrap();
                let top = v.as_object().unwrap();
                assert_eq!(top.keys().collect::<Vec<_>>(), ["error"], "{kind:?}");
                let inner = top["error"].as_object().unwrap();
                let mut keys: Vec<_> = inner.keys().map(String::as_str).collect();
                keys.sort_unstable();
                assert_eq!(keys, ["code", "message", "param", "type"], "{kind:?}");
                assert_eq!(inner["message"].as_str(), Some(e.message.as_str()));
                assert_eq!(inner["type"].as_str(), Some(kind.error_type()));
                assert_eq!(inner["param"].as_str(), e.param);
                assert_eq!(inner["code"].as_str(), kind.code());
                assert!(inner["param"].is_null() == e.param.is_none());
                assert!(inner["code"].is_null() == kind.code().is_none());
            }
        }
    }

    #[test]
    fn counted_length_is_the_rendered_length() {
        for kind in ErrorKind::ALL {
            for e in [GatewayError::new(kind, ""), full(kind)] {
                for keep_alive in [true, false] {
                    for head_only in [true, false] {
                        for dialect in [OPENAI, ClientDialect::Anthropic] {
                            let mut out = b"already there".to_vec();
                            let written =
                                e.write_response(&mut out, keep_alive, head_only, dialect);
                            assert_eq!(written, out.len() - 13, "{kind:?}");
                            let counted = e.response_len(keep_alive, head_only, dialect);
                            assert_eq!(counted, written, "{kind:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn response_head_and_connection() {
        let e = full(ErrorKind::MethodNotAllowed);
        let mut out = Vec::new();
        e.write_response(&mut out, true, false, OPENAI);
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert_eq!(
            head,
            format!(
                "HTTP/1.1 405 Method Not Allowed\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nallow: GET, HEAD\r\nretry-after: 7\r\n\
                 x-ratelimit-limit-requests: 10",
                body.len()
            )
        );
        assert_eq!(body, e.body(OPENAI));
        assert!(e.keeps_connection(true));
        assert!(!e.keeps_connection(false));

        // A closing kind says so even when the client asked to keep the connection.
        let mut out = Vec::new();
        let e = GatewayError::bad_http("x");
        e.write_response(&mut out, true, true, OPENAI);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"));
        assert!(text.ends_with("connection: close\r\n\r\n"));
        assert!(!e.keeps_connection(true));
    }

    #[test]
    fn body_is_openai_shaped_and_escaped() {
        let e = GatewayError::model_not_found("a\"b");
        assert_eq!(
            e.body(OPENAI),
            r#"{"error":{"message":"The model `a\"b` does not exist or you do not have access to it.","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#
        );
        assert_eq!(e.sse_event(OPENAI), format!("data: {}\n\n", e.body(OPENAI)),);
    }

    #[test]
    fn anthropic_clients_get_anthropic_shapes_with_the_same_status() {
        let anthropic = ClientDialect::Anthropic;
        for kind in ErrorKind::ALL {
            let e = full(kind);
            let v: serde_json::Value = serde_json::from_str(&e.body(anthropic)).unwrap();
            assert_eq!(v["type"], "error", "{kind:?}");
            let inner = v["error"].as_object().unwrap();
            let mut keys: Vec<_> = inner.keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(keys, ["message", "type"], "{kind:?}");
            assert_eq!(inner["message"].as_str(), Some(e.message.as_str()));
        }
        let kind_of = |e: GatewayError| {
            let v: serde_json::Value = serde_json::from_str(&e.body(anthropic)).unwrap();
            v["error"]["type"].as_str().unwrap().to_owned()
        };
        for (e, kind) in [
            (
                GatewayError::new(ErrorKind::InvalidApiKey, "k"),
                "authentication_error",
            ),
            (GatewayError::model_not_found("m"), "not_found_error"),
            (
                GatewayError::new(ErrorKind::RateLimited, "r"),
                "rate_limit_error",
            ),
            (
                GatewayError::upstream_unavailable("m", 1),
                "overloaded_error",
            ),
            (
                GatewayError::new(ErrorKind::BodyTooLarge, "b"),
                "request_too_large",
            ),
            (
                GatewayError::invalid_request("x", None),
                "invalid_request_error",
            ),
            (
                GatewayError::new(ErrorKind::ModelNotAllowed, "p"),
                "permission_error",
            ),
            (GatewayError::gateway_timeout("t"), "timeout_error"),
        ] {
            assert_eq!(kind_of(e), kind);
        }
        // The head is the same as an OpenAI client's: status, Retry-After, rate headers.
        let e = full(ErrorKind::RateLimited);
        let (mut a, mut o) = (Vec::new(), Vec::new());
        e.write_response(&mut a, true, false, anthropic);
        e.write_response(&mut o, true, false, OPENAI);
        let head = |b: &[u8]| {
            let t = String::from_utf8(b.to_vec()).unwrap();
            let h = t.split_once("\r\n\r\n").unwrap().0.to_owned();
            h.lines()
                .filter(|l| !l.starts_with("content-length"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(head(&a), head(&o));
        let event = GatewayError::bad_gateway(UpstreamFault::Io, "cut").sse_event(anthropic);
        assert_eq!(
            event,
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"cut\"}}\n\n"
        );
    }

    #[test]
    fn lower_layer_errors_keep_their_status() {
        use crate::http::HttpError;
        use crate::upstream::ConnectError;
        for (e, kind) in [
            (
                HttpError::Limit {
                    status: 413,
                    message: "m",
                },
                ErrorKind::BodyTooLarge,
            ),
            (
                HttpError::Limit {
                    status: 414,
                    message: "m",
                },
                ErrorKind::UriTooLong,
            ),
            (
                HttpError::Limit {
                    status: 431,
                    message: "m",
                },
                ErrorKind::HeadTooLarge,
            ),
            (HttpError::Malformed("m".into()), ErrorKind::MalformedHttp),
            (HttpError::ExpectationFailed, ErrorKind::ExpectationFailed),
        ] {
            let status = e.status();
            let g = GatewayError::from(e);
            assert_eq!((g.kind, g.status()), (kind, status));
        }
        for (fault, kind) in [
            (UpstreamFault::Connect, ErrorKind::UpstreamConnect),
            (UpstreamFault::Tls, ErrorKind::UpstreamTls),
        ] {
            let g = GatewayError::from(ConnectError::Failed {
                fault,
                message: "m".into(),
            });
            assert_eq!((g.kind, g.upstream_fault()), (kind, Some(fault)));
        }
        let g = GatewayError::from(ConnectError::PoolFull);
        assert_eq!(
            (g.kind, g.retry_after),
            (ErrorKind::UpstreamPoolFull, Some(1))
        );
        let g = GatewayError::from(ConnectError::Timeout);
        assert_eq!(
            (g.status(), g.upstream_fault()),
            (504, Some(UpstreamFault::Timeout))
        );
    }
}
