//! Anthropic's errors in OpenAI's shape.
//!
//! Anthropic answers `{"type":"error","error":{"type","message"},"request_id"}` with the status
//! its `type` implies (400 invalid_request_error, 401 authentication_error, 402 billing_error,
//! 403 permission_error, 404 not_found_error, 413 request_too_large, 429 rate_limit_error, 500
//! api_error, 504 timeout_error, 529 overloaded_error), and the same `error` object inside an
//! `error` event mid-stream. The client gets OpenAI's `{"error":{"message","type","param",
//! "code"}}` with the type and code an OpenAI SDK acts on, the same ones Sluice's own errors
//! use: 529 becomes 503 (OpenAI has no 529; the SDKs retry a 503), every other 4xx / 5xx status
//! is kept, anything else becomes 502. A spend or billing limit ([`is_spend_limit`]) is
//! `insufficient_quota`, whatever status carried it.

use std::borrow::Cow;

use crate::openai::json::truncate;

use super::push_str_literal;

/// The longest upstream message passed on, in bytes.
const MAX_MESSAGE: usize = 1024;

/// The `error` object of an Anthropic error body or event.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct ErrorObject<'a> {
    #[serde(rename = "type", borrow, default)]
    pub(super) kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub(super) message: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct ErrorBody<'a> {
    #[serde(borrow, default)]
    error: Option<ErrorObject<'a>>,
}

fn parse(body: &[u8]) -> Option<ErrorObject<'_>> {
    serde_json::from_slice::<ErrorBody<'_>>(body).ok()?.error
}

/// A non-2xx Anthropic answer → (status for the client, OpenAI error body appended to `out`).
pub(crate) fn error_to_openai(status: u16, body: &[u8], out: &mut Vec<u8>) -> u16 {
    let client_status = match status {
        529 => 503,
        400..=599 => status,
        _ => 502,
    };
    let error = parse(body).unwrap_or_default();
    let fallback;
    let message = match error.message.as_deref() {
        Some(m) if !m.is_empty() => m,
        _ => {
            fallback = format!("the upstream answered status {status}");
            &fallback
        }
    };
    let (kind, code) = openai_type(error.kind.as_deref(), status, message);
    write_error(out, message, kind, code);
    client_status
}

/// Whether an Anthropic 429 / 400 / 402 body says a spend or billing limit (the account's
/// credit, a workspace's spend limit: not over in seconds, so never retried elsewhere), as
/// opposed to a rate limit.
pub(crate) fn is_spend_limit(body: &[u8]) -> bool {
    parse(body).is_some_and(|e| says_spend_limit(e.kind.as_deref(), e.message.as_deref()))
}

fn says_spend_limit(kind: Option<&str>, message: Option<&str>) -> bool {
    if kind == Some("billing_error") {
        return true;
    }
    let Some(message) = message else {
        return false;
    };
    // As Anthropic words them: "Your credit balance is too low …", "You have reached your
    // specified workspace API usage limits …", "You're out of extra usage …", a spend limit.
    const SIGNS: [&str; 7] = [
        "credit balance",
        "purchase credits",
        "spend limit",
        "spending limit",
        "usage limit",
        "extra usage",
        "billing",
    ];
    let lower = message.to_ascii_lowercase();
    SIGNS.iter().any(|s| lower.contains(s))
}

/// OpenAI's `type` and `code` for an Anthropic error type (by the status when the type is
/// missing or new).
pub(super) fn openai_type(
    kind: Option<&str>,
    status: u16,
    message: &str,
) -> (&'static str, Option<&'static str>) {
    const INVALID: &str = "invalid_request_error";
    if says_spend_limit(kind, Some(message)) {
        return ("insufficient_quota", Some("insufficient_quota"));
    }
    match kind {
        Some("invalid_request_error") if is_context_length(message) => {
            (INVALID, Some("context_length_exceeded"))
        }
        Some("invalid_request_error") => (INVALID, None),
        Some("authentication_error") => (INVALID, Some("invalid_api_key")),
        Some("permission_error") => ("permission_error", None),
        Some("not_found_error") if message.contains("model") => (INVALID, Some("model_not_found")),
        Some("not_found_error") => (INVALID, None),
        Some("request_too_large") => (INVALID, Some("request_too_large")),
        Some("rate_limit_error") => ("rate_limit_error", Some("rate_limit_exceeded")),
        Some("api_error") | Some("overloaded_error") | Some("timeout_error") => {
            ("server_error", None)
        }
        _ => match status {
            401 => (INVALID, Some("invalid_api_key")),
            403 => ("permission_error", None),
            429 => ("rate_limit_error", Some("rate_limit_exceeded")),
            400..=499 => (INVALID, None),
            500..=599 => ("server_error", None),
            _ => ("upstream_error", None),
        },
    }
}

/// "prompt is too long: 210000 tokens > 200000 maximum", "input length and `max_tokens` exceed
/// context limit: …".
fn is_context_length(message: &str) -> bool {
    message.contains("prompt is too long") || message.contains("exceed context limit")
}

/// Append `{"error":{"message","type","param":null,"code"}}`.
pub(super) fn write_error(out: &mut Vec<u8>, message: &str, kind: &str, code: Option<&str>) {
    out.extend_from_slice(b"{\"error\":{\"message\":");
    push_str_literal(out, truncate(message, MAX_MESSAGE));
    out.extend_from_slice(b",\"type\":");
    push_str_literal(out, kind);
    out.extend_from_slice(b",\"param\":null,\"code\":");
    match code {
        Some(code) => push_str_literal(out, code),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b"}}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const OVERLOADED: &[u8] = include_bytes!("../testdata/anthropic_error_overloaded.json");
    const CREDIT: &[u8] = include_bytes!("../testdata/anthropic_error_credit_balance.json");
    const RATE_LIMIT: &[u8] = include_bytes!("../testdata/anthropic_error_rate_limit.json");

    fn translate(status: u16, body: &[u8]) -> (u16, Value) {
        let mut out = Vec::new();
        let status = error_to_openai(status, body, &mut out);
        let v: Value = serde_json::from_slice(&out).unwrap();
        // OpenAI's shape, exactly these keys.
        let keys: Vec<&String> = v["error"].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["code", "message", "param", "type"]);
        assert_eq!(v.as_object().unwrap().len(), 1);
        (status, v["error"].clone())
    }

    fn body(kind: &str, message: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({"type": "error", "error": {"type": kind, "message": message}}))
            .unwrap()
    }

    #[test]
    fn anthropic_error_overloaded_is_503() {
        let (status, e) = translate(529, OVERLOADED);
        assert_eq!(status, 503);
        assert_eq!(
            e,
            json!({"message": "Overloaded", "type": "server_error", "param": null, "code": null})
        );
    }

    #[test]
    fn anthropic_error_types_and_statuses() {
        for (status, kind, message, want_status, want_type, want_code) in [
            (
                400,
                "invalid_request_error",
                "messages: roles must alternate",
                400,
                "invalid_request_error",
                None,
            ),
            (
                400,
                "invalid_request_error",
                "prompt is too long: 210000 tokens > 200000 maximum",
                400,
                "invalid_request_error",
                Some("context_length_exceeded"),
            ),
            (
                401,
                "authentication_error",
                "invalid x-api-key",
                401,
                "invalid_request_error",
                Some("invalid_api_key"),
            ),
            (
                402,
                "billing_error",
                "Your payment method was declined.",
                402,
                "insufficient_quota",
                Some("insufficient_quota"),
            ),
            (
                403,
                "permission_error",
                "Your API key does not have permission",
                403,
                "permission_error",
                None,
            ),
            (
                404,
                "not_found_error",
                "model: claude-9",
                404,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            (
                404,
                "not_found_error",
                "Not found",
                404,
                "invalid_request_error",
                None,
            ),
            (
                413,
                "request_too_large",
                "Request exceeds the maximum size",
                413,
                "invalid_request_error",
                Some("request_too_large"),
            ),
            (
                429,
                "rate_limit_error",
                "Number of requests has exceeded your rate limit",
                429,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
            ),
            (
                500,
                "api_error",
                "Internal server error",
                500,
                "server_error",
                None,
            ),
            (
                504,
                "timeout_error",
                "Request timed out",
                504,
                "server_error",
                None,
            ),
            (
                529,
                "overloaded_error",
                "Overloaded",
                503,
                "server_error",
                None,
            ),
            (
                409,
                "something_new",
                "Conflict",
                409,
                "invalid_request_error",
                None,
            ),
            (
                503,
                "something_new",
                "Unavailable",
                503,
                "server_error",
                None,
            ),
        ] {
            let (s, e) = translate(status, &body(kind, message));
            assert_eq!(s, want_status, "{kind}");
            assert_eq!(e["type"], want_type, "{kind}");
            assert_eq!(e["code"].as_str(), want_code, "{kind}");
            assert_eq!(e["message"], message, "{kind}");
            assert_eq!(e["param"], Value::Null);
        }
    }

    #[test]
    fn anthropic_error_bodies_that_are_not_anthropic_errors() {
        // An HTML page from a proxy in front, an empty body, a 2xx or 3xx status by mistake.
        let (s, e) = translate(
            413,
            b"<html><body>413 Request Entity Too Large</body></html>",
        );
        assert_eq!(s, 413);
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["message"], "the upstream answered status 413");
        let (s, e) = translate(429, b"");
        assert_eq!((s, e["code"].as_str()), (429, Some("rate_limit_exceeded")));
        let (s, e) = translate(401, b"{}");
        assert_eq!((s, e["code"].as_str()), (401, Some("invalid_api_key")));
        let (s, e) = translate(200, b"{}");
        assert_eq!((s, e["type"].as_str()), (502, Some("upstream_error")));
        let (s, _) = translate(302, b"");
        assert_eq!(s, 502);
        // A long message is cut; escapes survive.
        let long = "x\"".repeat(2000);
        let (_, e) = translate(400, &body("invalid_request_error", &long));
        assert!(e["message"].as_str().unwrap().len() <= MAX_MESSAGE);
    }

    #[test]
    fn anthropic_error_spend_limits_are_not_rate_limits() {
        assert!(is_spend_limit(CREDIT));
        assert!(!is_spend_limit(RATE_LIMIT));
        assert!(!is_spend_limit(OVERLOADED));
        assert!(is_spend_limit(&body("billing_error", "")));
        assert!(is_spend_limit(&body(
            "invalid_request_error",
            "You have reached your specified workspace API usage limits. You will regain access on 2026-06-01 at 00:00 UTC."
        )));
        assert!(is_spend_limit(&body(
            "rate_limit_error",
            "You have reached your monthly spend limit."
        )));
        assert!(!is_spend_limit(&body(
            "rate_limit_error",
            "This request would exceed your organization's rate limit of 50 requests per minute."
        )));
        assert!(!is_spend_limit(b"not json"));
        assert!(!is_spend_limit(b"{}"));

        let (s, e) = translate(400, CREDIT);
        assert_eq!(s, 400);
        assert_eq!(e["type"], "insufficient_quota");
        assert_eq!(e["code"], "insufficient_quota");
        let (s, e) = translate(429, RATE_LIMIT);
        assert_eq!(s, 429);
        assert_eq!(e["type"], "rate_limit_error");
    }
}
