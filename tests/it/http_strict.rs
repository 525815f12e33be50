//! RFC 9112 strictness and request limits (issue point 3): each malformed or oversized request
//! gets its own status, an OpenAI-shaped error body, and the connection closed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

const MAX_LINE: usize = 1024;
const MAX_HEADER_BYTES: usize = 4096;
const MAX_HEADERS: usize = 20;
const MAX_BODY: usize = 1024;

fn setup() -> (Mock, Sluice) {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .http("max_request_line_bytes", MAX_LINE as u64)
            .http("max_header_bytes", MAX_HEADER_BYTES as u64)
            .http("max_headers", MAX_HEADERS as u64)
            .http("max_body_bytes", MAX_BODY as u64),
    );
    (mock, gw)
}

fn body() -> String {
    chat_body("gpt-4o")
}

/// Send `raw` on a fresh connection; expect `status`, an OpenAI error, and a close.
fn expect_reject(raw: &[u8], status: u16) {
    let (_mock, gw) = setup();
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    // The server may answer and close before reading everything; a failed write is fine as
    // long as the answer arrives.
    let _ = c.try_send(raw);
    assert_error_and_close(&mut c, status);
}

/// A POST head to /v1/chat/completions with the given extra header lines (each without CRLF).
fn head_with(lines: &[&str]) -> String {
    let mut s = String::from("POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\r\n");
    s.push_str("Content-Type: application/json\r\n");
    for l in lines {
        s.push_str(l);
        s.push_str("\r\n");
    }
    s.push_str("\r\n");
    s
}

fn with_cl_value(cl: &str) -> Vec<u8> {
    let b = body();
    let mut raw = head_with(&[&format!("Content-Length: {cl}")]).into_bytes();
    raw.extend_from_slice(b.as_bytes());
    raw
}

fn chunked_with_size_line(size_line: &str) -> Vec<u8> {
    let mut raw = head_with(&["Transfer-Encoding: chunked"]).into_bytes();
    raw.extend_from_slice(format!("{size_line}\r\nhello\r\n0\r\n\r\n").as_bytes());
    raw
}

// ----- positive controls: the same server accepts well-formed requests -----

#[test]
fn well_formed_request_is_accepted() {
    let (_mock, gw) = setup();
    let r = gw.chat(&body());
    assert_eq!(r.status, 200, "{}", r.dump());
}

#[test]
fn content_length_list_of_same_value_is_accepted() {
    let (_mock, gw) = setup();
    let b = body();
    let raw = with_cl_value(&format!("{}, {}", b.len(), b.len()));
    let mut c = gw.conn();
    c.send(&raw);
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(echo_of(&r)["body"].as_str(), Some(b.as_str()));
}

// ----- Content-Length / Transfer-Encoding -----

#[test]
fn content_length_with_transfer_encoding_is_400() {
    let b = body();
    let mut raw = head_with(&[
        &format!("Content-Length: {}", b.len()),
        "Transfer-Encoding: chunked",
    ])
    .into_bytes();
    raw.extend_from_slice(&chunked(&[b.as_bytes()]));
    expect_reject(&raw, 400);
}

#[test]
fn content_length_plus_sign_is_400() {
    let n = body().len();
    expect_reject(&with_cl_value(&format!("+{n}")), 400);
}

#[test]
fn content_length_negative_is_400() {
    expect_reject(&with_cl_value("-1"), 400);
}

#[test]
fn content_length_empty_is_400() {
    expect_reject(&with_cl_value(""), 400);
}

#[test]
fn content_length_list_of_different_values_is_400() {
    let n = body().len();
    expect_reject(&with_cl_value(&format!("{n},{}", n + 1)), 400);
}

#[test]
fn two_content_length_headers_with_different_values_is_400() {
    let b = body();
    let mut raw = head_with(&[
        &format!("Content-Length: {}", b.len()),
        &format!("Content-Length: {}", b.len() + 1),
    ])
    .into_bytes();
    raw.extend_from_slice(b.as_bytes());
    raw.push(b' ');
    expect_reject(&raw, 400);
}

#[test]
fn content_length_overflow_is_400() {
    expect_reject(&with_cl_value("99999999999999999999999"), 400);
}

#[test]
fn transfer_encoding_gzip_is_400() {
    let b = body();
    let mut raw = head_with(&["Transfer-Encoding: gzip"]).into_bytes();
    raw.extend_from_slice(b.as_bytes());
    expect_reject(&raw, 400);
}

#[test]
fn transfer_encoding_chunked_then_gzip_is_400() {
    let b = body();
    let mut raw = head_with(&["Transfer-Encoding: chunked, gzip"]).into_bytes();
    raw.extend_from_slice(&chunked(&[b.as_bytes()]));
    expect_reject(&raw, 400);
}

#[test]
fn transfer_encoding_gzip_then_chunked_is_400() {
    let b = body();
    let mut raw = head_with(&["Transfer-Encoding: gzip, chunked"]).into_bytes();
    raw.extend_from_slice(&chunked(&[b.as_bytes()]));
    expect_reject(&raw, 400);
}

// ----- chunk sizes -----

#[test]
fn chunk_size_not_hex_is_400() {
    expect_reject(&chunked_with_size_line("zz"), 400);
}

#[test]
fn chunk_size_negative_is_400() {
    expect_reject(&chunked_with_size_line("-1"), 400);
}

#[test]
fn chunk_size_leading_space_is_400() {
    expect_reject(&chunked_with_size_line(" 5"), 400);
}

#[test]
fn chunk_size_0x_prefix_is_400() {
    expect_reject(&chunked_with_size_line("0x5"), 400);
}

#[test]
fn chunk_size_too_many_hex_digits_is_400() {
    // 21 hex digits: more than any 64-bit size; must not wrap around to a small number.
    expect_reject(&chunked_with_size_line("fffffffffffffffffffff"), 400);
}

// ----- line endings, folding, bad bytes -----

#[test]
fn bare_lf_after_request_line_is_400() {
    let b = body();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\nHost: sluice.test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    expect_reject(raw.as_bytes(), 400);
}

#[test]
fn bare_lf_after_header_line_is_400() {
    let b = body();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    expect_reject(raw.as_bytes(), 400);
}

#[test]
fn bare_cr_in_head_is_400() {
    let b = body();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\r\nX-A: one\rX-B: two\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    expect_reject(raw.as_bytes(), 400);
}

#[test]
fn obs_fold_is_400() {
    let b = body();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sluice.test\r\nX-Folded: first\r\n  second\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    expect_reject(raw.as_bytes(), 400);
}

#[test]
fn nul_in_header_value_is_400() {
    let b = body();
    let mut raw = head_with(&[&format!("Content-Length: {}", b.len()), "X-Nul: a\0b"]).into_bytes();
    raw.extend_from_slice(b.as_bytes());
    expect_reject(&raw, 400);
}

#[test]
fn whitespace_before_colon_is_400() {
    let b = body();
    let mut raw = head_with(&[&format!("Content-Length : {}", b.len())]).into_bytes();
    raw.extend_from_slice(b.as_bytes());
    expect_reject(&raw, 400);
}

#[test]
fn missing_host_is_400() {
    let b = body();
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    );
    expect_reject(raw.as_bytes(), 400);
}

#[test]
fn two_host_headers_is_400() {
    let b = body();
    let mut raw =
        head_with(&["Host: other.test", &format!("Content-Length: {}", b.len())]).into_bytes();
    raw.extend_from_slice(b.as_bytes());
    expect_reject(&raw, 400);
}

// ----- limits -----

fn padded_models_target(line_len: usize) -> String {
    // "GET " + target + " HTTP/1.1" == line_len
    let fixed = "GET ".len() + " HTTP/1.1".len() + "/v1/models?pad=".len();
    format!("/v1/models?pad={}", "a".repeat(line_len - fixed))
}

#[test]
fn request_line_below_limit_is_accepted() {
    let (_mock, gw) = setup();
    let r = gw.get(&padded_models_target(MAX_LINE - 100));
    assert_eq!(r.status, 200, "{}", r.dump());
}

#[test]
fn request_line_too_long_is_414() {
    let target = padded_models_target(MAX_LINE + 200);
    expect_reject(&Req::get(&target).build(), 414);
}

#[test]
fn headers_below_byte_limit_are_accepted() {
    let (_mock, gw) = setup();
    let big = "v".repeat(1000);
    let req = Req::post("/v1/chat/completions", &body())
        .header("X-Pad-1", &big)
        .header("X-Pad-2", &big)
        .header("X-Pad-3", &big);
    assert!(req.build_head().len() < MAX_HEADER_BYTES - 500);
    let r = gw.request(&req);
    assert_eq!(r.status, 200, "{}", r.dump());
}

#[test]
fn headers_too_large_is_431() {
    let big = "v".repeat(1700);
    let req = Req::post("/v1/chat/completions", &body())
        .header("X-Pad-1", &big)
        .header("X-Pad-2", &big)
        .header("X-Pad-3", &big);
    assert!(req.build_head().len() > MAX_HEADER_BYTES + 500);
    expect_reject(&req.build(), 431);
}

/// A request with exactly `n` header fields (Host, Content-Type, Content-Length + padding).
fn request_with_header_count(n: usize) -> Req {
    let mut req = Req::post("/v1/chat/completions", &body());
    for i in 0..n - 3 {
        req = req.header(&format!("X-H{i}"), "x");
    }
    req
}

#[test]
fn header_count_at_limit_is_accepted() {
    let (_mock, gw) = setup();
    let r = gw.request(&request_with_header_count(MAX_HEADERS));
    assert_eq!(r.status, 200, "{}", r.dump());
}

#[test]
fn too_many_headers_is_431() {
    let req = request_with_header_count(MAX_HEADERS + 5);
    assert!(req.build_head().len() < MAX_HEADER_BYTES / 2);
    expect_reject(&req.build(), 431);
}

/// A valid chat body padded with spaces to exactly `len` bytes.
fn body_of_len(len: usize) -> String {
    let b = body();
    let inner = b.strip_suffix('}').unwrap();
    format!("{inner}{}}}", " ".repeat(len - b.len()))
}

#[test]
fn body_at_limit_is_accepted() {
    let (_mock, gw) = setup();
    let b = body_of_len(MAX_BODY);
    assert_eq!(b.len(), MAX_BODY);
    let r = gw.chat(&b);
    assert_eq!(r.status, 200, "{}", r.dump());
}

#[test]
fn body_too_large_by_content_length_is_413_before_the_body() {
    let (_mock, gw) = setup();
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    // Only the head: the answer must come from Content-Length alone, without waiting for the
    // body (body_read_ms is the 30 s default, far longer than this read timeout).
    c.send(&head_with(&[&format!("Content-Length: {}", MAX_BODY + 1)]).into_bytes());
    assert_error_and_close(&mut c, 413);
}

#[test]
fn chunked_body_growing_past_limit_is_413() {
    let (_mock, gw) = setup();
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    c.send(head_with(&["Transfer-Encoding: chunked"]).as_bytes());
    let piece = "a".repeat(300);
    // 5 x 300 bytes > 1024; stop sending as soon as the server stops accepting.
    for _ in 0..5 {
        if c.try_send(format!("{:x}\r\n{piece}\r\n", piece.len()).as_bytes())
            .is_err()
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_error_and_close(&mut c, 413);
}

/// Hostile clients II, item 8: a header value holding obs-text (bytes 0x80–0xFF) is refused
/// with a 400 that says why, and nothing reaches the upstream, which might read the same bytes
/// as Latin-1 or UTF-8 or refuse them. The same bytes in the request target stay a UTF-8 path.
#[test]
fn obs_text_in_a_header_value_is_400_and_never_forwarded() {
    let (mock, gw) = setup();
    let b = body();
    for value in [&b"caf\xc3\xa9"[..], b"\x80", b"a \xff b"] {
        let mut raw = head_with(&[&format!("Content-Length: {}", b.len())]).into_bytes();
        // Spliced in before the blank line.
        let at = raw.len() - 2;
        let mut line = b"X-Title: ".to_vec();
        line.extend_from_slice(value);
        line.extend_from_slice(b"\r\n");
        raw.splice(at..at, line);
        raw.extend_from_slice(b.as_bytes());
        let mut c = gw.conn();
        c.set_timeout(Duration::from_secs(5));
        let _ = c.try_send(&raw);
        let r = c.read_response_to("POST");
        assert_eq!(r.status, 400, "{}", r.dump());
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains("outside ASCII"), "{message}");
        c.assert_closed(Duration::from_secs(5));
    }
    assert_eq!(mock.stat("requests"), 0);
    // Plain ASCII in the same header is forwarded.
    let r = gw.request(&Req::post("/v1/chat/completions", &b).header("x-title", "cafe"));
    assert_eq!(r.status, 200, "{}", r.dump());
}
