//! Body inspection (issue point 5) and unknown models (point 6): only the top-level `model` is
//! taken, whatever the byte order; duplicates, bad JSON / UTF-8 and missing or non-string models
//! are refused before anything reaches the upstream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use sluice_tests::*;

/// `gpt-4o` -> mock-small, `evil` -> mock-evil: the mock's parsed model tells which one routed.
fn setup() -> (Mock, Sluice) {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .map("gpt-4o", "mock-small")
            .map("evil", "mock-evil"),
    );
    (mock, gw)
}

fn post(gw: &Sluice, body: &[u8]) -> Response {
    gw.request(
        &Req::new("POST", "/v1/chat/completions")
            .header("Content-Type", "application/json")
            .body(body),
    )
}

/// The body routes by the top-level `gpt-4o`, and the mock sees `mock-small`.
fn assert_routes_to_gpt4o(body: &str) {
    let (_mock, gw) = setup();
    let r = post(&gw, body.as_bytes());
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.header("x-mock-model"), Some("mock-small"), "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(echo["model"], "mock-small");
    // Anything nested is untouched.
    let fwd = echo["body"].as_str().unwrap();
    assert!(
        !fwd.contains("mock-evil"),
        "a nested model was rewritten: {fwd}"
    );
}

/// The body is refused with `status` and nothing reaches the mock.
fn assert_refused(body: &[u8], status: u16) -> serde_json::Value {
    let (mock, gw) = setup();
    let mut counter = mock.request_counter();
    let r = post(&gw, body);
    let err = assert_openai_error(&r, status);
    assert_eq!(counter.delta(), 0, "a refused request reached the upstream");
    err
}

#[test]
fn model_in_message_content_after_top_level_is_ignored() {
    assert_routes_to_gpt4o(
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"{\"model\":\"evil\"}"}]}"#,
    );
}

#[test]
fn model_in_message_content_before_top_level_is_ignored() {
    assert_routes_to_gpt4o(
        r#"{"messages":[{"role":"user","content":"{\"model\":\"evil\"}"}],"model":"gpt-4o"}"#,
    );
}

#[test]
fn model_in_nested_object_before_top_level_is_ignored() {
    assert_routes_to_gpt4o(r#"{"x":{"model":"evil"},"model":"gpt-4o"}"#);
}

#[test]
fn model_in_nested_object_after_top_level_is_ignored() {
    assert_routes_to_gpt4o(r#"{"model":"gpt-4o","x":{"model":"evil"}}"#);
}

#[test]
fn model_in_array_of_objects_is_ignored() {
    assert_routes_to_gpt4o(
        r#"{"messages":[{"model":"evil"},{"x":[{"model":"evil"}]}],"model":"gpt-4o"}"#,
    );
}

#[test]
fn model_as_a_string_value_is_ignored() {
    // `"model"` appearing as a value, followed by something that looks like a value.
    assert_routes_to_gpt4o(r#"{"stop":["model","evil"],"user":"model","model":"gpt-4o"}"#);
}

#[test]
fn escaped_model_key_is_read_as_model() {
    assert_routes_to_gpt4o(r#"{"messages":[],"\u006dodel":"gpt-4o"}"#);
}

#[test]
fn escaped_model_value_is_decoded() {
    assert_routes_to_gpt4o(r#"{"messages":[],"model":"gpt\u002d4o"}"#);
}

#[test]
fn duplicate_model_is_400() {
    assert_refused(br#"{"model":"gpt-4o","messages":[],"model":"evil"}"#, 400);
}

#[test]
fn duplicate_model_same_value_is_400() {
    assert_refused(br#"{"model":"gpt-4o","model":"gpt-4o"}"#, 400);
}

#[test]
fn duplicate_model_via_escaped_key_is_400() {
    assert_refused(br#"{"model":"gpt-4o","\u006dodel":"evil"}"#, 400);
}

#[test]
fn duplicate_other_top_level_key_is_400() {
    assert_refused(
        br#"{"model":"gpt-4o","stream":false,"messages":[],"stream":true}"#,
        400,
    );
}

#[test]
fn duplicate_key_in_nested_object_is_not_a_top_level_duplicate() {
    // Only top-level duplicates are the gateway's business; nested ones are the upstream's.
    // (Accepting or refusing is both defensible for nested keys, but routing must not change.)
    let (_mock, gw) = setup();
    let r = post(
        &gw,
        br#"{"model":"gpt-4o","x":{"model":"evil","model":"evil"}}"#,
    );
    if r.status == 200 {
        assert_eq!(r.header("x-mock-model"), Some("mock-small"));
    } else {
        assert_openai_error(&r, 400);
    }
}

#[test]
fn invalid_json_is_400() {
    assert_refused(br#"{"model":"gpt-4o","messages":["#, 400);
}

#[test]
fn a_json_error_says_what_and_where() {
    let err = assert_refused(
        b"{\"model\":\"gpt-4o\",\n \"messages\":[{\"role\":\"user\" \"content\":\"hi\"}]}",
        400,
    );
    let message = err["message"].as_str().unwrap();
    assert!(
        message.contains("expected `,` or `}` at line 2, column 29 (byte 47)"),
        "{message}"
    );
    let err = assert_refused(b"{\"model\":\"gpt-4o\",\"x\":\"\xff\"}", 400);
    let message = err["message"].as_str().unwrap();
    assert!(
        message.contains("invalid UTF-8 at line 1, column 24 (byte 23)"),
        "{message}"
    );
}

#[test]
fn trailing_garbage_after_json_is_400() {
    assert_refused(br#"{"model":"gpt-4o"} {"model":"evil"}"#, 400);
}

#[test]
fn invalid_utf8_is_400() {
    assert_refused(
        b"{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}",
        400,
    );
}

#[test]
fn invalid_utf8_in_a_key_is_400() {
    assert_refused(b"{\"model\":\"gpt-4o\",\"\xc3\x28\":1}", 400);
}

#[test]
fn missing_model_is_400() {
    assert_refused(br#"{"messages":[{"role":"user","content":"hi"}]}"#, 400);
}

#[test]
fn body_not_an_object_is_400() {
    assert_refused(br#"["model","gpt-4o"]"#, 400);
}

#[test]
fn empty_body_is_400() {
    assert_refused(b"", 400);
}

#[test]
fn numeric_model_is_400() {
    assert_refused(br#"{"model":5,"messages":[]}"#, 400);
}

#[test]
fn null_model_is_400() {
    assert_refused(br#"{"model":null,"messages":[]}"#, 400);
}

#[test]
fn array_model_is_400() {
    assert_refused(br#"{"model":["gpt-4o"],"messages":[]}"#, 400);
}

#[test]
fn object_model_is_400() {
    assert_refused(br#"{"model":{"model":"gpt-4o"},"messages":[]}"#, 400);
}

#[test]
fn unknown_model_is_404_model_not_found() {
    let err = assert_refused(br#"{"model":"no-such-model","messages":[]}"#, 404);
    assert_eq!(err["code"], "model_not_found", "{err}");
}
