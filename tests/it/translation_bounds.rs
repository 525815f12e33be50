//! Hostile clients II, item 4: translating a request between dialects must not amplify it. A
//! body whose shape would make the translation's working memory more than its stated bound
//! (docs/config.md, "Translation bounds") is refused with a 400 before any of it is built,
//! the process's peak memory stays within that bound of the body, and the worker keeps
//! answering its other connections meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_tests::*;

const KEY: &str = "sk-translation-bounds-1";

fn gateway(mock: &Mock, body_memory: u64) -> Sluice {
    Sluice::start(
        &Config::one_cluster(mock)
            .http("max_body_bytes", 8 << 20)
            .set(
                "server",
                "max_body_memory_per_worker",
                &body_memory.to_string(),
            )
            .timeout("body_read_ms", 20_000)
            .raw(&format!(
                "[[keys]]\nid = \"k\"\nsha256 = \"{}\"\nmodels_allow = [\"gpt-*\"]\n",
                key_hash(KEY)
            )),
    )
}

/// A Messages request whose one user turn is `blocks` text blocks of `text` each.
fn many_blocks(blocks: usize, text: &str) -> Vec<u8> {
    let block = format!("{{\"type\":\"text\",\"text\":\"{text}\"}}");
    let mut body = String::with_capacity(blocks * (block.len() + 1) + 128);
    body.push_str(
        "{\"model\":\"gpt-4o\",\"max_tokens\":16,\"messages\":[{\"role\":\"user\",\"content\":[",
    );
    for i in 0..blocks {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&block);
    }
    body.push_str("]}]}");
    body.into_bytes()
}

fn messages(gw: &Sluice, body: &[u8]) -> Response {
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(30));
    c.send(
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: {KEY}\r\n\
             anthropic-version: 2023-06-01\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    c.send(body);
    c.read_response_to("POST")
}

/// `VmRSS` or `VmHWM` of a process, in bytes.
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb * 1024
}

/// While `busy` is set, ask the same (only) worker for `/v1/models` every 5 ms; how many
/// answers (each a 200) and the slowest.
fn neighbour(gw: &Sluice, busy: Arc<AtomicBool>) -> std::thread::JoinHandle<(u32, Duration)> {
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(10));
    std::thread::spawn(move || {
        let (mut answers, mut slowest) = (0, Duration::ZERO);
        while busy.load(Ordering::Relaxed) {
            let asked = Instant::now();
            c.send(
                format!(
                    "GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n\r\n"
                )
                .as_bytes(),
            );
            let r = c.read_response_to("GET");
            assert_eq!(r.status, 200, "{}", r.dump());
            slowest = slowest.max(asked.elapsed());
            answers += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        (answers, slowest)
    })
}

/// The issue's case: 250,000 text blocks (7.4 MB) from an Anthropic client for an OpenAI
/// upstream. Refused with a 400 that says why, the peak memory within the bound, the
/// neighbour on the same worker answered throughout, nothing sent upstream. How long the
/// neighbour waits at most is a figure of the release build, measured by
/// `bench/translation_bounds.py` (perf/RESULTS.md), not timed here: this debug build's token
/// estimator alone takes ~170 ms over 7 MB.
#[test]
fn a_messages_body_of_250000_blocks_is_refused_within_its_bound_and_the_worker_stays_responsive() {
    let mock = Mock::start(&[]);
    let gw = gateway(&mock, 256 << 20);
    let body = many_blocks(250_000, "hello");
    assert!(body.len() > 7_000_000, "{}", body.len());
    let pid = gw.pid();
    let rss_before = proc_status_bytes(pid, "VmRSS");
    let busy = Arc::new(AtomicBool::new(true));
    let watcher = neighbour(&gw, busy.clone());
    std::thread::sleep(Duration::from_millis(50));
    let r = messages(&gw, &body);
    std::thread::sleep(Duration::from_millis(50));
    busy.store(false, Ordering::Relaxed);
    let (answers, slowest) = watcher.join().unwrap();
    assert!(answers >= 2, "the neighbour was answered {answers} times");
    let grown = proc_status_bytes(pid, "VmHWM").saturating_sub(rss_before);
    eprintln!("peak grew {grown} bytes; the neighbour's slowest answer took {slowest:?}");
    assert_eq!(r.status, 400, "{}", r.dump());
    let e = r.json();
    assert_eq!(e["type"], "error", "{}", r.dump());
    assert_eq!(e["error"]["type"], "invalid_request_error", "{}", r.dump());
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("JSON values"), "{message}");
    assert_eq!(mock.stat("requests"), 0);
    // The body itself is held once (read into the worker's buffer) and its refusal builds
    // nothing: the peak stays within twice the body (it was 47 times).
    let bound = 2 * body.len() as u64;
    assert!(
        grown <= bound,
        "peak grew {grown} bytes for a {}-byte body (bound {bound})",
        body.len()
    );
}

/// A large body of few, large blocks is translated and served: the bound refuses shapes, not
/// sizes. Its translation's memory (3 × 4 MB + 1,536 B per block + 128 B per value, ~14.2 MB)
/// is held from the worker's body memory while it is built: with 24 MiB, one body and its
/// translation fit, and the hold is given back (a second fits afterwards); with 16 MiB they do
/// not, and the answer is the body cap's 503.
#[test]
fn a_translations_memory_is_held_from_the_workers_body_memory_and_given_back() {
    let mock = Mock::start(&[]);
    let body = many_blocks(1_000, &"a".repeat(4_000));
    let gw = gateway(&mock, 24 << 20);
    for _ in 0..3 {
        let r = messages(&gw, &body);
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_eq!(r.json()["type"], "message", "{}", r.dump());
    }
    assert_eq!(mock.stat("requests"), 3);
    drop(gw);

    let gw = gateway(&mock, 16 << 20);
    let r = messages(&gw, &body);
    assert_eq!(r.status, 503, "{}", r.dump());
    assert!(r.header("retry-after").is_some(), "{}", r.dump());
    assert_eq!(
        r.json()["error"]["type"],
        "overloaded_error",
        "{}",
        r.dump()
    );
    assert_eq!(mock.stat("requests"), 3, "the refused one went nowhere");
    // A body of the same size that needs no translation has room.
    let chat = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a".repeat(4_000_000)
    );
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat).header("authorization", &format!("Bearer {KEY}")),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
}
