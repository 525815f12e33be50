//! Every error Sluice answers itself, and its one mapping to an HTTP response.
//!
//! Raised by any phase; turned into bytes only here, by [`GatewayError::write_response`], as an
//! OpenAI-shaped body `{"error":{"message","type","param","code"}}` with the status and headers
//! that OpenAI SDKs map to the right exception. Messages never carry upstream credentials or
//! request bodies.

use std::fmt::Write as _;

use crate::openai::json::{push_json_string, truncate};
pub use crate::upstream::UpstreamFault;

/// Where a fault came from, which decides the status class and whether the client connection
/// can be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client sent something we refuse.
    Client,
    /// The upstream failed or misbehaved.
    Upstream,
    /// Sluice itself is overloaded or misconfigured.
    Gateway,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub status: u16,
    /// OpenAI's `type`: `invalid_request_error`, `not_found_error`, `upstream_error`, …
    pub kind: &'static str,
    /// OpenAI's `code`, when there is a stable one (`model_not_found`).
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    pub message: String,
    pub origin: Origin,
    /// Close the client connection after answering (framing errors: the stream can't be trusted).
    pub close: bool,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u32>,
    /// Methods for an `Allow` header (405).
    pub allow: Option<&'static str>,
    /// For upstream failures: which kind.
    pub upstream_fault: Option<UpstreamFault>,
    /// Extra header lines (each ending in CRLF), e.g. the `x-ratelimit-*` set. Boxed: errors
    /// travel in `Result`s everywhere and should stay small.
    pub extra_headers: Option<Box<String>>,
}

impl GatewayError {
    fn new(status: u16, kind: &'static str, origin: Origin, message: impl Into<String>) -> Self {
        GatewayError {
            status,
            kind,
            code: None,
            param: None,
            message: message.into(),
            origin,
            close: false,
            retry_after: None,
            allow: None,
            upstream_fault: None,
            extra_headers: None,
        }
    }

    /// 401: no key, or one that is unknown, disabled or expired (those three answer alike).
    pub fn unauthorized(message: impl Into<String>, code: &'static str) -> Self {
        let mut e = Self::new(401, "invalid_request_error", Origin::Client, message);
        e.code = Some(code);
        e
    }

    /// 403: the key may not use this model, or not from this address.
    pub fn permission_denied(message: impl Into<String>, code: &'static str) -> Self {
        let mut e = Self::new(403, "permission_error", Origin::Client, message);
        e.code = Some(code);
        e
    }

    /// 429 from a limit policy (`rate_limit_error`) or an exhausted quota
    /// (`insufficient_quota`).
    pub fn rate_limited(
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
        retry_after: Option<u32>,
    ) -> Self {
        let mut e = Self::new(429, kind, Origin::Client, message);
        e.code = Some(code);
        e.retry_after = retry_after;
        e
    }

    /// 503: the shared limit ledger is unreachable and the request is not covered by what this
    /// worker holds.
    pub fn limits_unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(503, "server_error", Origin::Gateway, message);
        e.code = Some("limits_unavailable");
        e.retry_after = Some(1);
        e
    }

    /// A malformed request at the HTTP layer: 400 and close.
    pub fn bad_http(message: impl Into<String>) -> Self {
        let mut e = Self::new(400, "invalid_request_error", Origin::Client, message);
        e.close = true;
        e
    }

    /// A limit of the HTTP layer (414, 431, 413): answered, then the connection is closed
    /// because the rest of the request was not read.
    pub fn limit(status: u16, message: impl Into<String>) -> Self {
        let mut e = Self::new(status, "invalid_request_error", Origin::Client, message);
        e.close = true;
        e
    }

    /// A well-framed request whose content is refused (bad JSON, missing model): 400, the
    /// connection stays usable.
    pub fn invalid_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        let mut e = Self::new(400, "invalid_request_error", Origin::Client, message);
        e.param = param;
        e
    }

    pub fn timeout_client(message: impl Into<String>) -> Self {
        let mut e = Self::new(408, "invalid_request_error", Origin::Client, message);
        e.close = true;
        e
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, "invalid_request_error", Origin::Client, message)
    }

    pub fn method_not_allowed(message: impl Into<String>, allow: &'static str) -> Self {
        let mut e = Self::new(405, "invalid_request_error", Origin::Client, message);
        e.allow = Some(allow);
        e
    }

    pub fn expectation_failed() -> Self {
        let mut e = Self::new(
            417,
            "invalid_request_error",
            Origin::Client,
            "only `Expect: 100-continue` is supported",
        );
        e.close = true;
        e
    }

    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            404,
            "invalid_request_error",
            Origin::Client,
            format!(
                "The model `{}` does not exist or you do not have access to it.",
                truncate(model, 128)
            ),
        );
        e.code = Some("model_not_found");
        e.param = Some("model");
        e
    }

    /// 502: the upstream failed (`fault` says how).
    pub fn bad_gateway(fault: UpstreamFault, message: impl Into<String>) -> Self {
        let mut e = Self::new(502, "upstream_error", Origin::Upstream, message);
        e.upstream_fault = Some(fault);
        e
    }

    /// 504: the upstream did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        let mut e = Self::new(504, "upstream_error", Origin::Upstream, message);
        e.upstream_fault = Some(UpstreamFault::Timeout);
        e
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        let mut e = Self::new(503, "server_error", Origin::Gateway, message);
        e.retry_after = Some(1);
        e
    }

    /// The error object as JSON: `{"error":{…}}`.
    pub fn body(&self) -> String {
        let mut s = String::with_capacity(96 + self.message.len());
        s.push_str("{\"error\":{\"message\":");
        push_json_string(&mut s, &self.message);
        s.push_str(",\"type\":");
        push_json_string(&mut s, self.kind);
        s.push_str(",\"param\":");
        match self.param {
            Some(p) => push_json_string(&mut s, p),
            None => s.push_str("null"),
        }
        s.push_str(",\"code\":");
        match self.code {
            Some(c) => push_json_string(&mut s, c),
            None => s.push_str("null"),
        }
        s.push_str("}}");
        s
    }

    /// Append the whole HTTP response (head and body) to `out`. `head_only` for HEAD requests.
    pub fn write_response(&self, out: &mut Vec<u8>, keep_alive: bool, head_only: bool) {
        let body = self.body();
        let mut head = String::with_capacity(160);
        let _ = write!(
            head,
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            self.status,
            reason(self.status),
            body.len()
        );
        if let Some(methods) = self.allow {
            let _ = write!(head, "allow: {methods}\r\n");
        }
        if let Some(secs) = self.retry_after {
            let _ = write!(head, "retry-after: {secs}\r\n");
        }
        if let Some(extra) = &self.extra_headers {
            head.push_str(extra);
        }
        if !keep_alive || self.close {
            head.push_str("connection: close\r\n");
        }
        head.push_str("\r\n");
        out.extend_from_slice(head.as_bytes());
        if !head_only {
            out.extend_from_slice(body.as_bytes());
        }
    }

    /// Header lines to add to the response (written as given).
    pub fn add_headers(&mut self, lines: &str) {
        if !lines.is_empty() {
            self.extra_headers
                .get_or_insert_with(Default::default)
                .push_str(lines);
        }
    }

    /// The error as one SSE event, for a stream that already started.
    pub fn sse_event(&self) -> String {
        format!("data: {}\n\n", self.body())
    }
}

impl From<crate::upstream::ConnectError> for GatewayError {
    fn from(e: crate::upstream::ConnectError) -> Self {
        use crate::upstream::ConnectError;
        match e {
            ConnectError::Failed { fault, message } => GatewayError::bad_gateway(fault, message),
            ConnectError::PoolFull => {
                GatewayError::overloaded("upstream connection limit reached; retry shortly")
            }
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
            HttpError::Limit { status, message } => GatewayError::limit(status, message),
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

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.kind, self.message)
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        414 => "URI Too Long",
        417 => "Expectation Failed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped_and_escaped() {
        let e = GatewayError::model_not_found("a\"b");
        assert_eq!(
            e.body(),
            r#"{"error":{"message":"The model `a\"b` does not exist or you do not have access to it.","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#
        );
        let mut out = Vec::new();
        GatewayError::bad_http("x").write_response(&mut out, true, false);
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"));
        assert!(text.contains("connection: close\r\n"));
    }
}
