//! Limits and records under faults (issue #48, items 2 and 3): one rule for what a request is
//! billed, applied alike by the Redis ledger, the access log and the metrics, whatever way the
//! request ended; every record's status and error class what its client got; and a client that
//! leaves is cut from the upstream within 100 ms in every phase, by mock-llm's own timing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::*;

const KEY: &str = "sk-outcomes-1";

fn gateway(mock: &Mock, redis: &Redis, log: &TempDir) -> Sluice {
    Sluice::start(
        &Config::one_cluster(mock)
            .admin()
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 50)
            .raw(&format!(
                r#"
[limits]
backend = "redis"
sync_timeout_ms = 1000

[limits.redis]
address = "{}"
key_prefix = "o"

[[keys]]
id = "k"
sha256 = "{}"
plans = [{{ id = "big", tokens = 100000000 }}]
"#,
                redis.addr,
                key_hash(KEY)
            )),
    )
}

fn body(stream: bool) -> String {
    serde_json::json!({"model": "gpt-4o", "max_tokens": 16, "stream": stream,
        "messages": [{"role": "user", "content": "tell me about gateways and their faults"}]})
    .to_string()
}

fn request(stream: bool, headers: &[(&str, &str)]) -> Req {
    let mut req = Req::post("/v1/chat/completions", &body(stream)).header("x-api-key", KEY);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    req
}

/// What a client got: its status, and for a stream whether it ended in an error event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Got {
    status: u16,
    error_event: bool,
}

fn got(r: &Response) -> Got {
    Got {
        status: r.status,
        error_event: r.sse_events().iter().any(|e| e.is_error()),
    }
}

/// A request whose client leaves `after` it was sent: before the answer's head (mock-llm
/// delays it), or mid-stream (after `events` content events). Returns how long after the send
/// the client closed.
fn leave(gw: &Sluice, req: Req, after: Duration, events: usize) -> Duration {
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(10));
    let sent = Instant::now();
    c.send(&req.build());
    if events > 0 {
        let head = c.read_head().unwrap();
        assert_eq!(head.status, 200);
        c.read_until_content_events(events);
    } else {
        std::thread::sleep(after);
    }
    let left = sent.elapsed();
    drop(c);
    left
}

/// mock-llm saw its request abandoned within 100 ms of the client leaving `left` after sending
/// it (the mock counts from the request's arrival, a little after the send).
fn assert_cut_promptly(mock: &Mock, abandoned_before: u64, left: Duration, what: &str) {
    let ok = wait_until(Duration::from_secs(5), || {
        mock.stat("requests_abandoned") > abandoned_before
    });
    assert!(ok, "{what}: mock-llm never saw its request abandoned");
    let after = Duration::from_millis(mock.stat("last_abandoned_after_ms"));
    assert!(
        after <= left + Duration::from_millis(100),
        "{what}: the upstream was cut {after:?} after the request, the client left at {left:?}"
    );
}

/// Σ `s:*` of the key's quota budget: what the ledger charged it.
fn ledger_spent(redis: &Redis) -> u64 {
    redis
        .hgetall("{o:q:k:big}")
        .iter()
        .filter(|(f, _)| f.starts_with("s:"))
        .map(|(_, v)| v.parse::<u64>().unwrap())
        .sum()
}

#[test]
fn every_ending_is_billed_by_one_rule_and_logged_as_the_client_got_it() {
    let mut redis = Redis::start();
    let mock = Mock::start(&["--tokens", "12"]);
    let log = TempDir::new("outcomes");
    let gw = gateway(&mock, &redis, &log);
    // (what, what the client got, the record's expected error class)
    let mut runs: Vec<(&str, Got, &str)> = Vec::new();
    let mut run = |what: &'static str, req: Req, class: &'static str| {
        let r = gw.request(&req);
        runs.push((what, got(&r), class));
    };
    run("whole", request(false, &[]), "");
    run("stream", request(true, &[]), "");
    run(
        "upstream 500",
        request(false, &[("x-mock-status", "500")]),
        "upstream_status",
    );
    run(
        "upstream 500, streamed",
        request(true, &[("x-mock-status", "500")]),
        "upstream_status",
    );
    run(
        "malformed chunk",
        request(true, &[("x-mock-fault", "malformed-chunk")]),
        "*",
    );
    run(
        "dropped mid-stream",
        request(true, &[("x-mock-fault", "drop-mid-stream")]),
        "upstream_abort",
    );
    // Redis goes away and comes back (empty: no persistence) mid-run.
    redis.kill();
    run(
        "provider error event",
        request(true, &[("x-mock-fault", "error-event=3")]),
        "upstream_error_event",
    );
    run(
        "dropped before the response",
        request(false, &[("x-mock-fault", "drop-before-response")]),
        "upstream_error",
    );
    redis.restart();
    run(
        "truncated stream",
        request(true, &[("x-mock-fault", "end-after=4")]),
        "upstream_abort",
    );
    // The client leaves: before the head of a whole answer, before a stream's head, mid-stream.
    let slow = [("x-mock-delay-ms", "3000")];
    let before = mock.stat("requests_abandoned");
    let left = leave(&gw, request(false, &slow), Duration::from_millis(300), 0);
    assert_cut_promptly(&mock, before, left, "left before a whole answer's head");
    runs.push((
        "left before the head",
        Got {
            status: 499,
            error_event: false,
        },
        "client_abort",
    ));
    let before = mock.stat("requests_abandoned");
    let left = leave(&gw, request(true, &slow), Duration::from_millis(300), 0);
    assert_cut_promptly(&mock, before, left, "left before a stream's head");
    runs.push((
        "left before a stream's head",
        Got {
            status: 499,
            error_event: false,
        },
        "client_abort",
    ));
    let before = mock.stat("requests_abandoned");
    // Events 150 ms apart: mock-llm watches its socket in pauses that long, so its timing is
    // of Sluice's cut, not of its own next write.
    let paced = request(
        true,
        &[("x-mock-tokens", "60"), ("x-mock-inter-token-ms", "150")],
    );
    let left = leave(&gw, paced, Duration::ZERO, 3);
    assert_cut_promptly(&mock, before, left, "left mid-stream");
    runs.push((
        "left mid-stream",
        Got {
            status: 200,
            error_event: false,
        },
        "client_abort",
    ));

    // Every record: the status the client got, the error class of how it ended.
    let records = wait_records(log.path(), runs.len(), Duration::from_secs(10));
    assert_eq!(records.len(), runs.len(), "{records:?}");
    let mut logged_tokens = 0;
    for ((what, got, class), rec) in runs.iter().zip(&records) {
        assert_eq!(rec["status"], u64::from(got.status), "{what}: {rec}");
        let logged_class = rec["error_class"].as_str().unwrap_or_default();
        let want = match *class {
            // A malformed chunk in the first read is Sluice's 502; later, a cut stream.
            "*" if got.status == 502 => "upstream_error",
            "*" => "upstream_abort",
            c => c,
        };
        assert_eq!(logged_class, want, "{what}: {rec}");
        let total = rec["total_tokens"].as_u64().unwrap_or(0);
        let billed = !matches!(got.status, 500 | 502);
        assert_eq!(total > 0, billed, "{what}: billed {total}: {rec}");
        logged_tokens += total;
    }

    // One bill, three records of it: the ledger, the log, the metrics.
    let metrics = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_tokens_total", &[("type", "prompt")])
            + m.sum("sluice_tokens_total", &[("type", "completion")])
            >= logged_tokens as f64
    });
    let counted = metrics.sum("sluice_tokens_total", &[("type", "prompt")])
        + metrics.sum("sluice_tokens_total", &[("type", "completion")]);
    assert_eq!(counted as u64, logged_tokens);
    let settled = wait_until(Duration::from_secs(5), || {
        ledger_spent(&redis) == logged_tokens
    });
    assert!(
        settled,
        "ledger {} != log {logged_tokens}",
        ledger_spent(&redis)
    );
}

/// A client that pipelines its next request and then half-closes (its FIN after both) is still
/// waiting for its answers: the watch does not take the FIN for leaving, and both are served.
#[test]
fn a_half_closed_client_with_a_pipelined_request_is_served_not_cut() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let log = TempDir::new("outcomes-pipelined");
    let gw = gateway(&mock, &redis, &log);
    let slow = request(false, &[("x-mock-delay-ms", "300")]);
    let quick = request(false, &[]);
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(10));
    let mut both = slow.build();
    both.extend_from_slice(&quick.build());
    c.send(&both);
    c.shutdown_write();
    for _ in 0..2 {
        let r = c.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    assert_eq!(mock.stat("requests_abandoned"), 0);
}
