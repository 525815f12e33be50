//! Assertions and request bodies the tests share: OpenAI-style errors, keys, chat bodies, echoes.

use std::process::Command;
use std::time::Duration;

use crate::client::{BodyEnd, Conn, Response};
use crate::process::bin;
use serde_json::{json, Value};

/// Assert `resp` has `status` and an OpenAI-shaped JSON error body
/// `{"error":{"message","type","param","code"}}`; returns the inner error object.
pub fn assert_openai_error(resp: &Response, status: u16) -> Value {
    assert_eq!(
        resp.status,
        status,
        "expected status {status}, got:\n{}",
        resp.dump()
    );
    assert_eq!(
        resp.end,
        BodyEnd::Complete,
        "error body not completely delivered:\n{}",
        resp.dump()
    );
    let ct = resp.header("content-type").unwrap_or("");
    assert!(
        ct.to_ascii_lowercase().starts_with("application/json"),
        "error content-type should be application/json, got {ct:?}:\n{}",
        resp.dump()
    );
    let v: Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("error body is not JSON ({e}):\n{}", resp.dump()));
    assert_error_value(&v).unwrap_or_else(|m| panic!("{m}:\n{}", resp.dump()));
    v["error"].clone()
}

/// Check a JSON value is `{"error":{"message":str,"type":str,"param":..,"code":..}}`.
pub fn assert_error_value(v: &Value) -> Result<(), String> {
    let err = v
        .get("error")
        .and_then(Value::as_object)
        .ok_or("no top-level \"error\" object")?;
    let msg = err.get("message").and_then(Value::as_str).unwrap_or("");
    if msg.is_empty() {
        return Err("error.message missing or empty".into());
    }
    let ty = err.get("type").and_then(Value::as_str).unwrap_or("");
    if ty.is_empty() {
        return Err("error.type missing or empty".into());
    }
    for key in ["param", "code"] {
        match err.get(key) {
            Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Number(_)) if key == "code" => {}
            Some(other) => return Err(format!("error.{key} has unexpected type: {other}")),
            None => return Err(format!("error.{key} missing")),
        }
    }
    Ok(())
}

/// Assert that a 400/413/414/431/408-class answer is followed by the server closing the
/// connection.
pub fn assert_error_and_close(conn: &mut Conn, status: u16) -> Value {
    let resp = conn.read_response();
    let err = assert_openai_error(&resp, status);
    conn.assert_closed(Duration::from_secs(3));
    err
}

/// A minimal valid chat body for `model`.
/// The SHA-256 of an API key, as `sluice key hash` prints it for `[[keys]] sha256` (the tool
/// operators use, run here for real).
pub fn key_hash(key: &str) -> String {
    let out = Command::new(bin("sluice"))
        .args(["key", "hash", key])
        .output()
        .expect("run sluice key hash");
    assert!(out.status.success(), "sluice key hash failed");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

pub fn chat_body(model: &str) -> String {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}]}).to_string()
}

/// A minimal valid streaming chat body for `model`.
pub fn chat_stream_body(model: &str) -> String {
    json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hello"}]})
        .to_string()
}

/// The mock's `echo` object from a non-streaming response (or from a stream's `: echo` comment).
pub fn echo_of(resp: &Response) -> Value {
    if resp
        .header("content-type")
        .is_some_and(|c| c.contains("text/event-stream"))
    {
        for ev in resp.sse_events() {
            for c in &ev.comments {
                if let Some(j) = c.strip_prefix("echo ") {
                    return serde_json::from_str(j).expect("echo JSON");
                }
            }
        }
        panic!("stream carries no `: echo` comment:\n{}", resp.dump());
    }
    let v = resp.json();
    v.get("echo")
        .cloned()
        .unwrap_or_else(|| panic!("response has no echo:\n{}", resp.dump()))
}

/// The headers in a mock echo, as (lowercased name, value) pairs.
pub fn echo_headers(echo: &Value) -> Vec<(String, String)> {
    echo["headers"]
        .as_array()
        .expect("echo.headers")
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap_or("").to_ascii_lowercase(),
                p[1].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}
