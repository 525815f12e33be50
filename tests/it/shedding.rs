//! Overload shedding and slow clients (issue #13, point 5): a refused key is answered from the
//! head, before its body is read, and the connection closed; a body must arrive whole within
//! its total deadline; past the per-worker request cap or request-body memory cap a request
//! gets a fast 503 with Retry-After while everything else keeps answering.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::*;

const KEY: &str = "sk-shedding-test-1";

fn keyed(mock: &Mock) -> Config {
    Config::one_cluster(mock)
        .admin()
        .timeout("body_read_ms", 20_000)
        .raw(&format!(
            "[[keys]]\nid = \"k\"\nsha256 = \"{}\"\n",
            key_hash(KEY)
        ))
}

fn head(key: &str, content_length: usize, extra: &str) -> Vec<u8> {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {content_length}\r\n{extra}\r\n"
    )
    .into_bytes()
}

#[test]
fn an_unknown_key_is_refused_from_the_head_without_waiting_for_the_body() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&keyed(&mock));
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(10));
    let started = Instant::now();
    // A megabyte announced, not a byte of it sent.
    c.send(&head("sk-wrong", 1_000_000, ""));
    let r = c.read_response_to("POST");
    assert_eq!(r.status, 401, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered after {:?}: it waited for the body",
        started.elapsed()
    );
    assert!(r.header_has_token("connection", "close"), "{}", r.dump());
    c.assert_closed(Duration::from_secs(5));
    assert_eq!(mock.stat("requests"), 0);
    // Counted like any refused request.
    let m = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_requests_total", &[("status_class", "4xx")]) >= 1.0
    });
    assert_eq!(
        m.sum("sluice_requests_total", &[("status_class", "4xx")]),
        1.0
    );
}

#[test]
fn a_refused_requests_unread_body_is_never_parsed_as_the_next_request() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&keyed(&mock));
    // The "body" is a whole second request, smuggled.
    let smuggled = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 2\r\n\r\n{{}}");
    let mut bytes = head("sk-wrong", smuggled.len(), "");
    bytes.extend_from_slice(smuggled.as_bytes());
    let mut c = gw.conn();
    c.send(&bytes);
    let r = c.read_response_to("POST");
    assert_eq!(r.status, 401, "{}", r.dump());
    // Nothing more: no second response, the connection ends.
    c.assert_closed(Duration::from_secs(5));
    assert_eq!(mock.stat("requests"), 0);
}

#[test]
fn expect_100_continue_with_a_bad_key_gets_401_instead_of_100() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&keyed(&mock));
    let mut c = gw.conn();
    c.send(&head("sk-wrong", 10_000, "Expect: 100-continue\r\n"));
    let first = c.read_head().expect("a response head");
    assert_eq!(first.status, 401, "the first thing sent back");

    // A good key gets its 100 Continue, then the answer.
    let body = chat_body("gpt-4o");
    let mut c = gw.conn();
    c.send(&head(KEY, body.len(), "Expect: 100-continue\r\n"));
    let first = c.read_head().expect("a response head");
    assert_eq!(first.status, 100);
    c.send(body.as_bytes());
    assert_eq!(c.read_response_to("POST").status, 200);
}

#[test]
fn a_body_that_trickles_past_its_total_deadline_gets_408() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .timeout("body_read_ms", 1_000)
            .timeout("body_total_ms", 1_500),
    );
    let body = chat_body("gpt-4o");
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(10));
    c.send(&head("none", body.len(), ""));
    let started = Instant::now();
    // One byte every 200 ms, from another thread: never slower than the per-read timeout,
    // never done in time.
    let mut writer = c.try_clone_stream();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = std::sync::Arc::clone(&done);
    let bytes = body.clone().into_bytes();
    let trickle = std::thread::spawn(move || {
        use std::io::Write;
        let mut sent = 0;
        while sent < bytes.len() - 1 && !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if writer.write_all(&bytes[sent..sent + 1]).is_err() {
                break;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        sent
    });
    let r = c.read_response_to("POST");
    let took = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = trickle.join().unwrap();
    assert_eq!(r.status, 408, "{}", r.dump());
    assert!(
        r.text().contains("body_total_ms"),
        "says which deadline: {}",
        r.text()
    );
    assert!(
        took >= Duration::from_millis(1_400) && took < Duration::from_secs(5),
        "408 after {took:?}"
    );
    assert!(sent < body.len() - 1, "the whole body went through");
}

#[test]
fn bodies_past_the_workers_memory_cap_are_shed_and_the_room_comes_back() {
    let mock = Mock::start(&[]);
    let capped = |cap: u64| {
        Config::one_cluster(&mock)
            .admin()
            .http("max_body_bytes", 100_000)
            .set("server", "max_body_memory_per_worker", &cap.to_string())
    };
    // A cap below the largest body allowed could never hold it: a config error.
    let out = Sluice::check(&capped(65_536));
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("server.max_body_memory_per_worker"), "{text}");

    let gw = Sluice::start(&capped(131_072));
    let padded = |size: usize| {
        let base = chat_body("gpt-4o");
        let pad = size - base.len();
        // Whitespace before the closing brace keeps it valid JSON.
        format!("{}{}}}", &base[..base.len() - 1], " ".repeat(pad))
    };
    // One body of 70 KB held (half sent), a second of 70 KB does not fit beside it.
    let first = padded(70_000);
    let mut holder = gw.conn();
    holder.send(&head("none", first.len(), ""));
    holder.send(&first.as_bytes()[..35_000]);
    let second = padded(70_000);
    let shed = wait_until(Duration::from_secs(5), || {
        let mut c = gw.conn();
        c.send(&head("none", second.len(), ""));
        let r = c.read_response_to("POST");
        r.status == 503 && r.header("retry-after") == Some("1")
    });
    assert!(
        shed,
        "the second body was not shed while the first was held"
    );
    // Health and metrics keep answering.
    assert_eq!(gw.admin_get("/healthz").status, 200);
    // The first completes; its room comes back.
    holder.send(&first.as_bytes()[35_000..]);
    assert_eq!(holder.read_response_to("POST").status, 200);
    let r = gw.post("/v1/chat/completions", &second);
    assert_eq!(r.status, 200, "{}", r.dump());
}

#[test]
fn requests_past_the_workers_cap_get_a_fast_503_and_health_still_answers() {
    let mock = Mock::start(&["--inter-token-ms", "100", "--tokens", "20"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).admin().set(
        "server",
        "max_requests_per_worker",
        "2",
    ));
    let addr = gw.addr;
    let streams: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                c.set_timeout(Duration::from_secs(20));
                c.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
                c.read_response_to("POST")
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(10), || mock
        .stat("active_streams")
        == 2));
    let started = Instant::now();
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r.status, 503, "{}", r.dump());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "not fast: {:?}",
        started.elapsed()
    );
    assert_eq!(gw.admin_get("/healthz").status, 200);
    assert_eq!(gw.admin_get("/readyz").status, 200);
    for s in streams {
        let r = s.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    }
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
}

/// Hostile clients II, item 1: nothing unauthenticated may hold the worker's body memory. Heads
/// that declare the largest body allowed — on a path nobody serves, with a method a path does
/// not take, on `/v1/models` (which takes no body), and on a proxied path without a key or with
/// a wrong one — are answered from the head and closed, and an authenticated request with a
/// body is served beside 200 of them held open.
#[test]
fn anonymous_heads_with_large_declared_bodies_take_no_body_memory() {
    let mock = Mock::start(&[]);
    let max = 1_000_000;
    let gw = Sluice::start(&keyed(&mock).http("max_body_bytes", max).set(
        "server",
        "max_body_memory_per_worker",
        &max.to_string(),
    ));
    let heads = [
        ("POST /x", "", 404),
        ("OPTIONS /", "", 404),
        (
            "GET /v1/models",
            &format!("Authorization: Bearer {KEY}\r\n")[..],
            200,
        ),
        ("GET /v1/chat/completions", "", 405),
        ("POST /v1/chat/completions", "", 401),
        (
            "POST /v1/chat/completions",
            "Authorization: Bearer sk-wrong\r\n",
            401,
        ),
        (
            "POST /v1/messages/count_tokens",
            "x-api-key: sk-wrong\r\n",
            401,
        ),
    ];
    let mut held = Vec::new();
    for i in 0..200 {
        let (line, extra, status) = heads[i % heads.len()];
        let mut c = gw.conn();
        c.set_timeout(Duration::from_secs(10));
        c.send(
            format!("{line} HTTP/1.1\r\nHost: gw\r\n{extra}Content-Length: {max}\r\n\r\n")
                .as_bytes(),
        );
        held.push((c, line, status));
    }
    // Every one is answered from its head, body unsent.
    for (c, line, status) in &mut held {
        let method = line.split(' ').next().unwrap();
        let r = c.read_response_to(method);
        assert_eq!(r.status, *status, "{line}: {}", r.dump());
        assert!(
            r.header_has_token("connection", "close"),
            "{line}: {}",
            r.dump()
        );
    }
    // With all of them still open, a caller with a key sends a body and is served.
    let body = chat_body("gpt-4o");
    for _ in 0..4 {
        let mut c = gw.conn();
        c.set_timeout(Duration::from_secs(10));
        c.send(&head(KEY, body.len(), ""));
        c.send(body.as_bytes());
        let r = c.read_response_to("POST");
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    for (c, _, _) in &mut held {
        c.assert_closed(Duration::from_secs(5));
    }
    assert_eq!(mock.stat("requests"), 4);
}
