//! Graceful shutdown (issue #13, point 1): SIGTERM / SIGINT turn `/readyz` 503, stop accepting,
//! close idle connections and let requests and streams in flight finish within
//! `server.shutdown_grace_ms`; what runs past it ends with an SSE error event (billed and
//! logged); the limiter's spend reaches the ledger and the access log is flushed before the
//! process exits 0; a second signal exits at once with status 1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{SocketAddr, TcpStream};
use std::process::ExitStatus;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::*;

const KEY: &str = "sk-shutdown-test-1";

/// One streamed chat completion on its own connection, read to its end on a thread.
fn stream(addr: SocketAddr, headers: &[(&str, &str)]) -> JoinHandle<Response> {
    let mut req = Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"));
    for (k, v) in headers {
        req = req.header(k, v);
    }
    std::thread::spawn(move || {
        let mut c = Conn::open(addr);
        c.set_timeout(Duration::from_secs(60));
        c.send(&req.build());
        c.read_response()
    })
}

/// Wait until the mock runs `n` streams at once.
fn wait_streams(mock: &Mock, n: u64) {
    assert!(
        wait_until(Duration::from_secs(30), || mock.stat("active_streams") >= n),
        "only {} of {n} streams running",
        mock.stat("active_streams")
    );
}

/// The exit status, once the process has exited (within `within`).
fn exited(gw: &mut Sluice, within: Duration) -> ExitStatus {
    match gw.wait_exit(within) {
        Some(status) => status,
        None => panic!(
            "sluice still runs {within:?} after the signal; stderr:\n{}",
            gw.stderr_text()
        ),
    }
}

fn u(rec: &Value, field: &str) -> u64 {
    rec[field]
        .as_u64()
        .unwrap_or_else(|| panic!("record field {field} is not an unsigned integer: {rec}"))
}

fn s<'a>(rec: &'a Value, field: &str) -> &'a str {
    rec[field]
        .as_str()
        .unwrap_or_else(|| panic!("record field {field} is not a string: {rec}"))
}

/// Only the final flush writes the access log: its interval is longer than any test here, and
/// a batch holds every record these tests make.
fn log_on_close_only(config: Config, dir: &std::path::Path) -> Config {
    config
        .access_log(dir)
        .access_log_opt("flush_interval_ms", 600_000)
        .access_log_opt("batch_bytes", 1 << 20)
}

/// Limits in a real Redis: one key with a large quota plan, exchanged with the ledger only when
/// a request waits for a lease and every 10 s otherwise (so in these tests the spend of a
/// request finished after the first lease reaches Redis only through the stop's last exchange).
fn limited(mock: &Mock, redis: &Redis) -> Config {
    Config::one_cluster(mock).workers(2).raw(&format!(
        r#"
[limits]
backend = "redis"
sync_interval_ms = 10000
lease_ttl_ms = 40000
lease_wait_ms = 5000
sync_timeout_ms = 1000

[limits.redis]
address = "{}"
key_prefix = "t"

[[keys]]
id = "shared"
sha256 = "{}"
plans = [{{ id = "pre", tokens = 10000000 }}]
"#,
        redis.addr,
        key_hash(KEY),
    ))
}

/// Σ of every worker's cumulative spend on the key's plan in Redis (fields `s:<node>`).
fn ledger_spent(redis: &Redis) -> u64 {
    redis
        .keys("{t:q:shared:pre}")
        .iter()
        .flat_map(|k| redis.hgetall(k))
        .filter(|(f, _)| f.starts_with("s:"))
        .map(|(_, v)| v.parse::<u64>().unwrap())
        .sum()
}

#[test]
fn sigterm_lets_100_live_streams_finish_and_logs_every_request() {
    const STREAMS: usize = 100;
    const QUICK: usize = 10;
    const TOKENS: usize = 20;
    let mock = Mock::start(&["--tokens", "20", "--inter-token-ms", "100"]);
    let log = TempDir::new("shutdown-drain");
    // The default grace (30 s): far longer than the streams' 2 s.
    let mut gw = Sluice::start(&log_on_close_only(
        Config::one_cluster(&mock).workers(2).admin(),
        log.path(),
    ));
    let admin = gw.admin_addr();
    assert_eq!(admin_get(admin, "/readyz").status, 200);

    // Answered before the signal.
    for i in 0..QUICK {
        let r = gw.chat(&chat_body("gpt-4o"));
        assert_eq!(r.status, 200, "quick request {i}: {}", r.dump());
    }
    let streams: Vec<_> = (0..STREAMS).map(|_| stream(gw.addr, &[])).collect();
    wait_streams(&mock, STREAMS as u64);

    gw.signal(libc::SIGTERM);
    // Not ready at once, while the streams still run.
    assert!(
        wait_until(Duration::from_secs(5), || admin_get(admin, "/readyz")
            .status
            == 503),
        "/readyz did not turn 503; stderr:\n{}",
        gw.stderr_text()
    );
    let running = mock.stat("active_streams");
    assert!(
        running > 0,
        "the streams were over before /readyz was probed: not a probe during the drain"
    );
    assert!(gw.wait_stderr(Duration::from_secs(5), "sluice: draining (grace 30000 ms)"));

    let status = exited(&mut gw, Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{status}; {}", gw.stderr_text());

    // Every stream ended whole.
    for (i, s) in streams.into_iter().enumerate() {
        let r = s.join().expect("stream thread");
        assert_eq!(r.status, 200, "stream {i}: {}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "stream {i}: {}", r.dump());
        let events = r.sse_events();
        let content = events.iter().filter(|e| e.content().is_some()).count();
        assert_eq!(content, TOKENS, "stream {i}: {}", r.dump());
        assert!(!events.iter().any(SseEvent::is_error), "stream {i}");
        assert!(events.last().is_some_and(SseEvent::is_done), "stream {i}");
    }

    // One record per request answered, written by the final flush.
    let dump = read_access_log(log.path());
    assert!(dump.ok, "{}", dump.describe());
    assert_eq!(dump.records.len(), QUICK + STREAMS, "{}", dump.describe());
    let streamed: Vec<&Value> = dump
        .records
        .iter()
        .filter(|r| r["stream"] == true)
        .collect();
    assert_eq!(streamed.len(), STREAMS, "{}", dump.describe());
    for rec in &dump.records {
        assert_eq!(u(rec, "status"), 200, "{rec}");
        assert_eq!(s(rec, "error_class"), "", "{rec}");
        assert_eq!(s(rec, "usage_source"), "USAGE_SOURCE_REPORTED", "{rec}");
    }
    for rec in streamed {
        assert_eq!(u(rec, "completion_tokens"), TOKENS as u64, "{rec}");
    }

    let stderr = gw.stderr_text();
    assert!(
        stderr.contains(&format!(
            "sluice: stopped ({STREAMS} requests finished, 0 ended at the deadline"
        )),
        "{stderr}"
    );
}

#[test]
fn streams_past_the_grace_end_with_an_sse_error_event_and_are_billed_and_logged() {
    const STREAMS: usize = 20;
    let redis = Redis::start();
    // 10 s streams against a 1 s grace.
    let mock = Mock::start(&["--tokens", "100", "--inter-token-ms", "100"]);
    let log = TempDir::new("shutdown-grace");
    let config = log_on_close_only(limited(&mock, &redis), log.path()).set(
        "server",
        "shutdown_grace_ms",
        "1000",
    );
    let mut gw = Sluice::start(&config);
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| stream(gw.addr, &[("x-api-key", KEY)]))
        .collect();
    wait_streams(&mock, STREAMS as u64);

    gw.signal(libc::SIGTERM);
    let status = exited(&mut gw, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{status}; {}", gw.stderr_text());

    // Each stream: what was streamed, then the error event, then a proper end of the body.
    for (i, s) in streams.into_iter().enumerate() {
        let r = s.join().expect("stream thread");
        assert_eq!(r.status, 200, "stream {i}: {}", r.dump());
        assert_eq!(
            r.end,
            BodyEnd::Complete,
            "stream {i} was truncated, not ended: {}",
            r.dump()
        );
        let events = r.sse_events();
        let content = events.iter().filter(|e| e.content().is_some()).count();
        assert!((1..100).contains(&content), "stream {i}: {}", r.dump());
        assert!(!events.iter().any(SseEvent::is_done), "stream {i}");
        let last = events.last().and_then(SseEvent::json).unwrap_or_default();
        let error = &last["error"];
        assert_eq!(error["code"], "server_shutting_down", "stream {i}: {last}");
        assert_eq!(error["type"], "server_error", "stream {i}: {last}");
        assert_error_value(&last).unwrap_or_else(|e| panic!("stream {i}: {e}: {last}"));
    }

    // Each is logged as ended by the shutdown, with what it streamed as its usage…
    let dump = read_access_log(log.path());
    assert!(dump.ok, "{}", dump.describe());
    assert_eq!(dump.records.len(), STREAMS, "{}", dump.describe());
    let mut logged = 0;
    for rec in &dump.records {
        assert_eq!(u(rec, "status"), 200, "{rec}");
        assert_eq!(s(rec, "error_class"), "server_shutdown", "{rec}");
        assert_eq!(s(rec, "usage_source"), "USAGE_SOURCE_ESTIMATED", "{rec}");
        assert!(u(rec, "completion_tokens") > 0, "{rec}");
        assert_eq!(
            u(rec, "total_tokens"),
            u(rec, "prompt_tokens") + u(rec, "completion_tokens"),
            "{rec}"
        );
        logged += u(rec, "total_tokens");
    }
    // …and billed exactly that, in the ledger.
    assert_eq!(ledger_spent(&redis), logged, "{}", gw.stderr_text());

    let stderr = gw.stderr_text();
    assert!(
        stderr.contains(&format!(
            "sluice: stopped (0 requests finished, {STREAMS} ended at the deadline"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("shutdown grace over"), "{stderr}");
}

#[test]
fn the_last_limiter_exchange_carries_the_spend_to_redis() {
    const STREAMS: usize = 10;
    let redis = Redis::start();
    let mock = Mock::start(&["--tokens", "20", "--inter-token-ms", "100"]);
    let mut gw = Sluice::start(&limited(&mock, &redis));
    // Requests finished before the signal, and streams that finish during the drain.
    for i in 0..3 {
        let r = gw.request(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-api-key", KEY),
        );
        assert_eq!(r.status, 200, "request {i}: {}", r.dump());
    }
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| stream(gw.addr, &[("x-api-key", KEY)]))
        .collect();
    wait_streams(&mock, STREAMS as u64);
    gw.signal(libc::SIGTERM);
    let status = exited(&mut gw, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{status}; {}", gw.stderr_text());
    for (i, s) in streams.into_iter().enumerate() {
        let r = s.join().expect("stream thread");
        assert_eq!(r.end, BodyEnd::Complete, "stream {i}: {}", r.dump());
        assert!(r.sse_events().last().is_some_and(SseEvent::is_done));
    }

    // What the upstream reported for every request (the mock's own sums) is the spend in Redis.
    let used = mock.stat("usage_prompt_tokens") + mock.stat("usage_completion_tokens");
    assert!(used > 0);
    assert_eq!(ledger_spent(&redis), used, "{}", gw.stderr_text());
}

#[test]
fn a_second_sigterm_exits_at_once() {
    // One 10 s stream against a 60 s grace.
    let mock = Mock::start(&["--tokens", "100", "--inter-token-ms", "100"]);
    let mut gw =
        Sluice::start(&Config::one_cluster(&mock).set("server", "shutdown_grace_ms", "60000"));
    let running = stream(gw.addr, &[]);
    wait_streams(&mock, 1);
    gw.signal(libc::SIGTERM);
    assert!(gw.wait_stderr(Duration::from_secs(10), "sluice: draining (grace 60000 ms)"));
    assert!(gw.is_running(), "the first signal ended the drain early");

    let second = Instant::now();
    gw.signal(libc::SIGTERM);
    let status = exited(&mut gw, Duration::from_secs(5));
    assert_eq!(status.code(), Some(1), "{status}; {}", gw.stderr_text());
    assert!(
        second.elapsed() < Duration::from_secs(5),
        "{:?}",
        second.elapsed()
    );
    assert!(
        gw.stderr_text().contains("second stop signal"),
        "{}",
        gw.stderr_text()
    );
    // The stream was cut, not finished.
    let r = running.join().expect("stream thread");
    assert_ne!(r.end, BodyEnd::Complete, "{}", r.dump());
}

#[test]
fn after_sigint_new_connections_are_refused_idle_ones_closed_and_answers_say_close() {
    // A 6 s stream keeps the drain going; a request whose answer comes 3 s after it was sent
    // is answered while draining. Three workers and two busy connections: at least one worker
    // has nothing to finish, and ends at once (its listener must not outlive it).
    let mock = Mock::start(&["--tokens", "60", "--inter-token-ms", "100"]);
    let mut gw = Sluice::start(&Config::one_cluster(&mock).workers(3));
    let addr = gw.addr;

    // Idle: a keep-alive connection after its request, and one that never sent a byte.
    let mut idle = gw.conn();
    idle.send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build());
    let r = idle.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert!(!r.header_has_token("connection", "close"), "{}", r.dump());
    let mut silent = gw.conn();

    let running = stream(addr, &[]);
    let mut slow = gw.conn();
    slow.set_timeout(Duration::from_secs(30));
    slow.send(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("x-mock-delay-ms", "3000")
            .build(),
    );
    assert!(
        wait_until(Duration::from_secs(30), || mock.stat("active_requests")
            >= 2),
        "the stream and the slow request are not both at the mock"
    );

    gw.signal(libc::SIGINT);
    assert!(gw.wait_stderr(Duration::from_secs(10), "sluice: draining"));

    // The idle connections close at once, while the stream still runs.
    idle.assert_closed(Duration::from_secs(5));
    silent.assert_closed(Duration::from_secs(5));
    assert_eq!(
        mock.stat("active_streams"),
        1,
        "the stream ended before the idle connections were seen closed"
    );

    // New connections are refused while the drain runs: every attempt, whichever worker's
    // listener the port would have picked (ten in a row, once every worker has begun).
    let mut in_a_row = 0;
    let refused = wait_until(Duration::from_secs(10), || {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => in_a_row += 1,
            // One accepted just as its worker began draining is closed unanswered.
            _ => in_a_row = 0,
        }
        in_a_row == 10
    });
    assert!(refused, "new connections are still accepted");
    assert!(
        gw.is_running(),
        "refused only because the process had exited"
    );

    // The answer written while draining says the connection closes, and it does, at once (not
    // when the process exits).
    let r = slow.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert!(r.header_has_token("connection", "close"), "{}", r.dump());
    slow.assert_closed(Duration::from_secs(5));
    assert_eq!(
        mock.stat("active_streams"),
        1,
        "the stream ended before the answered connection was seen closed"
    );

    let r = running.join().expect("stream thread");
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    assert!(r.sse_events().last().is_some_and(SseEvent::is_done));
    let status = exited(&mut gw, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{status}; {}", gw.stderr_text());
}
