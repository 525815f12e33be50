//! Limits shared through a real `redis-server` by several Sluice processes (issue #3, points 4–6):
//! a strict quota under 1,000 concurrent requests, an RPM limit under a burst, a concurrency
//! limit, Redis killed and restarted mid-load, and a client abort billed in the ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_tests::*;

const KEY: &str = "sk-redis-shared-1";

/// `n` Sluice processes with `workers` each, sharing limits through `redis`.
fn gateways(mock: &Mock, redis: &Redis, n: usize, workers: u32, extra: &str) -> Vec<Sluice> {
    let toml = format!(
        r#"
[limits]
backend = "redis"
nodes = {n}
lease_ttl_ms = 2000
{extra_limits}

[limits.redis]
address = "{}"
key_prefix = "t"

[[keys]]
id = "shared"
sha256 = "{}"
{plans}
{policies}
"#,
        redis.addr,
        key_hash(KEY),
        extra_limits = section(extra, "limits"),
        plans = section(extra, "plans"),
        policies = section(extra, "policies"),
    );
    (0..n)
        .map(|_| Sluice::start(&Config::one_cluster(mock).workers(workers).raw(&toml)))
        .collect()
}

/// The part of `extra` after the line `#<name>` up to the next `#…` marker line.
fn section(extra: &str, name: &str) -> String {
    let mut out = String::new();
    let mut on = false;
    for line in extra.lines() {
        if let Some(tag) = line.trim().strip_prefix('#') {
            on = tag == name;
            continue;
        }
        if on {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn request(addr: SocketAddr, body: &str, headers: &[(&str, &str)]) -> Response {
    let mut req = Req::post("/v1/chat/completions", body).header("x-api-key", KEY);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let mut c = Conn::open(addr);
    c.set_timeout(Duration::from_secs(30));
    c.send(&req.build());
    c.read_response()
}

fn usage_total(r: &Response) -> u64 {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["usage"]["total_tokens"].as_u64().unwrap()
}

/// Σ of every worker's cumulative spend in a budget hash (fields `s:<node>`).
fn ledger_spent(redis: &Redis, pattern: &str) -> u64 {
    redis
        .keys(pattern)
        .iter()
        .flat_map(|k| redis.hgetall(k))
        .filter(|(f, _)| f.starts_with("s:"))
        .map(|(_, v)| v.parse::<u64>().unwrap())
        .sum()
}

fn body(max_tokens: u64) -> String {
    serde_json::json!({"model": "gpt-4o", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string()
}

#[test]
fn quota_holds_under_1000_concurrent_requests_from_3_processes() {
    let redis = Redis::start();
    let mock = Mock::start(&["--tokens", "8"]);
    let gws = gateways(
        &mock,
        &redis,
        3,
        2,
        // A generous exchange deadline: 1,000 client threads, six gateway workers and Redis
        // share two cores here, and a round trip past the default 100 ms counts as a ledger
        // outage, whose 503 (quotas spend only held leases) is tested elsewhere. Seen once in
        // a loaded full-suite run: `limits_unavailable` on one request.
        "#limits\nsync_timeout_ms = 1000\n#plans\nplans = [{ id = \"prepaid\", tokens = 10000 }]",
    );
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let start = Arc::new(std::sync::Barrier::new(1000));
    let handles: Vec<_> = (0..1000)
        .map(|i| {
            let addr = addrs[i % 3];
            let start = Arc::clone(&start);
            std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || {
                    start.wait();
                    // Long enough that every admitted request is still in flight when the
                    // last one is decided: then their reservations are outstanding together.
                    request(addr, &body(100), &[("x-mock-delay-ms", "3000")])
                })
                .unwrap()
        })
        .collect();
    let responses: Vec<Response> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let admitted: Vec<&Response> = responses.iter().filter(|r| r.status == 200).collect();
    for r in &responses {
        assert!(
            r.status == 200 || r.status == 429,
            "unexpected answer: {}",
            r.dump()
        );
        if r.status == 429 {
            let e: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(e["error"]["type"], "insufficient_quota", "{}", r.dump());
        }
    }
    // Each admitted request reserved at least 100 + 1 tokens, all at once: their sum fits the
    // balance.
    assert!(
        admitted.len() * 101 <= 10_000,
        "{} admitted: reservations exceed the quota",
        admitted.len()
    );
    assert!(admitted.len() >= 30, "only {} admitted", admitted.len());
    // The ledger settles to exactly what the upstream reported.
    let reported: u64 = admitted.iter().map(|r| usage_total(r)).sum();
    let settled = wait_until(Duration::from_secs(5), || {
        ledger_spent(&redis, "{t:q:shared:prepaid}") == reported
    });
    assert!(
        settled,
        "ledger {} != reported usage {reported}",
        ledger_spent(&redis, "{t:q:shared:prepaid}")
    );
    assert_eq!(
        mock.stat("usage_prompt_tokens") + mock.stat("usage_completion_tokens"),
        reported
    );
}

#[test]
fn rpm_600_under_a_5000_request_burst_from_3_processes() {
    let redis = Redis::start();
    let mock = Mock::start(&["--tokens", "1"]);
    let gws = gateways(
        &mock,
        &redis,
        3,
        2,
        "#limits\nsync_timeout_ms = 1000\n#policies\n[[policies]]\nid = \"rpm\"\nmax_requests = 600\nrequests_window_secs = 60",
    );
    wait_out_window_edge(60, 20);
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..50)
        .map(|t| {
            let addr = addrs[t % 3];
            let (admitted, refused) = (Arc::clone(&admitted), Arc::clone(&refused));
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                let req = Req::post("/v1/chat/completions", &body(1)).header("x-api-key", KEY);
                for _ in 0..100 {
                    c.send(&req.build());
                    let r = c.read_response();
                    match r.status {
                        200 => admitted.fetch_add(1, Ordering::Relaxed),
                        429 => refused.fetch_add(1, Ordering::Relaxed),
                        _ => panic!("unexpected: {}", r.dump()),
                    };
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let admitted = admitted.load(Ordering::Relaxed);
    assert_eq!(admitted + refused.load(Ordering::Relaxed), 5000);
    // The documented bound: at most 2 × cores (3 processes × 2 workers) × 1 request over.
    assert!(admitted <= 600 + 2 * 6, "{admitted} admitted");
    assert!(
        admitted >= 590,
        "{admitted} admitted: leases were left unused"
    );
    assert_eq!(mock.stat("requests"), admitted);
}

/// Issue #12 item 7: a burst that straddles a window edge. Fixed windows admitted the limit
/// just before the edge and the limit again just after it (measured: 1,200 for an RPM of 600).
/// Three processes share a limit of 60 per 4 s window; twelve clients send as fast as they can
/// from 300 ms before an edge to 300 ms after it. The sliding window's documented bound (docs/limits.md) for a span of D ms: 60 × (1 + D / 4000) + 5 × 3 cores × 1 request.
#[test]
fn a_burst_across_a_window_edge_stays_within_the_sliding_bound_across_3_processes() {
    const LIMIT: u64 = 60;
    const WINDOW_MS: u64 = 4000;
    const CORES: u64 = 3;
    let redis = Redis::start();
    let mock = Mock::start(&["--tokens", "1"]);
    let gws = gateways(
        &mock,
        &redis,
        3,
        1,
        "#limits\nsync_timeout_ms = 1000\n#policies\n[[policies]]\nid = \"rpm\"\nmax_requests = 60\nrequests_window_secs = 4",
    );
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let unix_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    // The next edge with at least 1.5 s before it (the gateways start with nothing spent in
    // this window or the one before).
    let mut edge = unix_ms().div_ceil(WINDOW_MS) * WINDOW_MS;
    if edge - unix_ms() < 1500 {
        edge += WINDOW_MS;
    }
    let (from, until) = (edge - 300, edge + 300);
    std::thread::sleep(Duration::from_millis(from.saturating_sub(unix_ms())));
    // Per client: (sent, answered) in unix ms of every admitted request.
    let handles: Vec<_> = (0..12)
        .map(|t| {
            let addr = addrs[t % 3];
            std::thread::spawn(move || {
                let now = || {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap()
                        .as_millis() as u64
                };
                let mut c = Conn::open(addr);
                let req = Req::post("/v1/chat/completions", &body(1)).header("x-api-key", KEY);
                let mut admitted = Vec::new();
                while now() < until {
                    let sent = now();
                    c.send(&req.build());
                    let r = c.read_response();
                    match r.status {
                        200 => admitted.push((sent, now())),
                        429 => {}
                        _ => panic!("unexpected: {}", r.dump()),
                    }
                }
                admitted
            })
        })
        .collect();
    let admitted: Vec<(u64, u64)> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let total = admitted.len() as u64;
    // Answered before the edge: admitted in the window before it.
    let before = admitted.iter().filter(|(_, done)| *done < edge).count() as u64;
    // Every admission happened between the first request sent and the last answer.
    let first = admitted.iter().map(|(sent, _)| *sent).min().unwrap();
    let last = admitted.iter().map(|(_, done)| *done).max().unwrap();
    let span = last - first;
    let bound = LIMIT + (LIMIT * span).div_ceil(WINDOW_MS) + 5 * CORES;
    // The test means something only if the first window was (nearly) used up before the edge:
    // fixed windows would then admit `before` + 60 in all, well past the bound.
    assert!(
        before + LIMIT > bound,
        "only {before} admitted before the edge: the burst did not test the edge"
    );
    assert!(
        total <= bound,
        "{total} admitted ({before} before the edge) within {span} ms: past the bound {bound}"
    );
    assert!(total < 2 * LIMIT, "{total} admitted: a double burst");
    assert_eq!(mock.stat("requests"), total);
}

#[test]
fn concurrency_5_across_processes() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let gws = gateways(
        &mock,
        &redis,
        3,
        2,
        // As in the quota test: an exchange slower than the default 100 ms deadline on this
        // loaded machine would be an outage, served on local shares (up to 6 here, the
        // documented outage bound), which is not what this test is about.
        "#limits\nsync_timeout_ms = 1000\n#policies\n[[policies]]\nid = \"five\"\nmax_concurrency = 5",
    );
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..30)
        .map(|t| {
            let addr = addrs[t % 3];
            let (stop, ok) = (Arc::clone(&stop), Arc::clone(&ok));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = request(addr, &body(1), &[("x-mock-delay-ms", "50")]);
                    match r.status {
                        200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => std::thread::sleep(Duration::from_millis(5)),
                        _ => panic!("unexpected: {}", r.dump()),
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let peak = mock.stat("max_active_requests");
    let outages: Vec<String> = gws
        .iter()
        .map(|g| g.stderr_text())
        .filter(|e| e.contains("ledger unreachable"))
        .collect();
    assert!(
        peak <= 5,
        "{peak} requests in flight at mock-llm; gateways that saw a ledger outage: {outages:?}"
    );
    assert!(peak >= 2, "peak {peak}: slots never shared");
    assert!(
        ok.load(Ordering::Relaxed) >= 20,
        "{} served",
        ok.load(Ordering::Relaxed)
    );
}

/// A caller with fewer requests in flight than the limit is admitted on any worker of any
/// process: two processes × two pinned workers on a busy machine, a concurrency limit of 2, and
/// one request at a time, alternating between the processes, each on a new connection.
#[test]
fn concurrency_limit_admits_sequential_callers_across_processes() {
    let redis = Redis::start();
    let mock = Mock::start(&[]);
    let toml = format!(
        r#"
[limits]
backend = "redis"
nodes = 2

[limits.redis]
address = "{}"
key_prefix = "seq"

[[keys]]
id = "shared"
sha256 = "{}"

[[policies]]
id = "two"
per = "key"
max_concurrency = 2
"#,
        redis.addr,
        key_hash(KEY),
    );
    let gws: Vec<Sluice> = (0..2)
        .map(|_| {
            Sluice::start(
                &Config::one_cluster(&mock)
                    .workers(2)
                    .set("server", "pin_workers", "true")
                    .raw(&toml),
            )
        })
        .collect();
    let _load = BusyLoops::start(3);
    let mut refused = Vec::new();
    for i in 0..200usize {
        let r = request(gws[i % 2].addr, &body(1), &[]);
        match r.status {
            200 => {}
            429 => refused.push((i, r.dump())),
            _ => panic!("request {i}: {}", r.dump()),
        }
        std::thread::sleep(Duration::from_millis(5 + (i as u64 % 4) * 5));
    }
    assert!(
        refused.is_empty(),
        "{} of 200 sequential requests refused under a limit of 2; the first: {:?}",
        refused.len(),
        refused.first()
    );
    assert!(mock.stat("max_active_requests") <= 2);
}

/// Each answer of a load run: when, its status, the tokens it used.
type AnswerLog = Arc<std::sync::Mutex<Vec<(Instant, u16, u64)>>>;

/// Continuous load from `threads` threads, logging every answer, until `stop` is set.
fn load(
    addrs: &[SocketAddr],
    threads: usize,
    stop: &Arc<AtomicBool>,
    log: &AnswerLog,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..threads)
        .map(|t| {
            let addr = addrs[t % addrs.len()];
            let (stop, log) = (Arc::clone(stop), Arc::clone(log));
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                let req = Req::post("/v1/chat/completions", &body(5)).header("x-api-key", KEY);
                while !stop.load(Ordering::Relaxed) {
                    c.send(&req.build());
                    let r = c.read_response();
                    let used = if r.status == 200 { usage_total(&r) } else { 0 };
                    if r.status != 200 {
                        assert!(
                            r.status == 503 || r.status == 429,
                            "unexpected: {}",
                            r.dump()
                        );
                    }
                    log.lock().unwrap().push((Instant::now(), r.status, used));
                    if r.header("connection") == Some("close") {
                        c = Conn::open(addr);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        })
        .collect()
}

#[test]
fn redis_killed_and_restarted_allow_policy_serves_and_reconciles() {
    let mut redis = Redis::start();
    let mock = Mock::start(&["--tokens", "2"]);
    let mut gws = gateways(
        &mock,
        &redis,
        3,
        2,
        "#policies\n[[policies]]\nid = \"big-rpm\"\nmax_requests = 1000000\nrequests_window_secs = 3600",
    );
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handles = load(&addrs, 6, &stop, &log);
    std::thread::sleep(Duration::from_millis(500));
    redis.kill();
    let killed_at = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    // Restarted empty (no persistence): the workers' absolute counts refill it.
    redis.restart();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    for g in gws.iter_mut() {
        assert!(g.is_running(), "sluice died: {}", g.stderr_text());
    }
    let log = log.lock().unwrap();
    let during: Vec<u16> = log
        .iter()
        .filter(|(t, _, _)| *t > killed_at && *t < killed_at + Duration::from_millis(1400))
        .map(|(_, s, _)| *s)
        .collect();
    assert!(
        during.len() > 50,
        "only {} requests while Redis was down",
        during.len()
    );
    assert!(
        during.iter().all(|s| *s == 200),
        "allow: served on local shares while Redis was down"
    );
    let admitted = log.iter().filter(|(_, s, _)| *s == 200).count() as u64;
    let ok = wait_until(Duration::from_secs(5), || {
        ledger_spent(&redis, "{t:p:big-rpm:all}:r:*") == admitted
    });
    assert!(
        ok,
        "ledger {} != {admitted} admitted",
        ledger_spent(&redis, "{t:p:big-rpm:all}:r:*")
    );
}

#[test]
fn redis_down_deny_policy_answers_503_then_recovers() {
    let mut redis = Redis::start();
    let mock = Mock::start(&["--tokens", "2"]);
    let gws = gateways(
        &mock,
        &redis,
        1,
        2,
        "#limits\non_backend_down = \"deny\"\n#policies\n[[policies]]\nid = \"rpm\"\nmax_requests = 1000000\nrequests_window_secs = 3600",
    );
    let addr = gws[0].addr;
    assert_eq!(request(addr, &body(5), &[]).status, 200);
    redis.kill();
    // Leases held are spent first; then 503 with Retry-After.
    let mut refused = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while refused.is_none() && Instant::now() < deadline {
        let r = request(addr, &body(5), &[]);
        if r.status == 503 {
            refused = Some(r);
        } else {
            assert_eq!(r.status, 200, "{}", r.dump());
        }
    }
    let r = refused.expect("never refused while Redis was down");
    assert_eq!(r.header("retry-after"), Some("1"));
    let e: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["code"], "limits_unavailable");
    redis.restart();
    assert!(wait_until(Duration::from_secs(10), || request(
        addr,
        &body(5),
        &[]
    )
    .status
        == 200));
}

#[test]
fn quota_spends_only_held_leases_while_redis_is_down() {
    let mut redis = Redis::start();
    let mock = Mock::start(&["--tokens", "2"]);
    let mut gws = gateways(
        &mock,
        &redis,
        2,
        2,
        "#plans\nplans = [{ id = \"pre\", tokens = 100000000 }]",
    );
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handles = load(&addrs, 4, &stop, &log);
    std::thread::sleep(Duration::from_millis(400));
    redis.kill();
    // Leases (valid 2 s) run out, then 503s; a restart serves again.
    std::thread::sleep(Duration::from_millis(3000));
    redis.restart();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    for g in gws.iter_mut() {
        assert!(g.is_running(), "sluice died: {}", g.stderr_text());
    }
    let log = log.lock().unwrap();
    assert!(log.iter().any(|(_, s, _)| *s == 503), "never refused");
    let last = log
        .iter()
        .rev()
        .take(20)
        .filter(|(_, s, _)| *s == 200)
        .count();
    assert!(last > 0, "not serving again after Redis came back");
    let used: u64 = log.iter().map(|(_, _, u)| *u).sum();
    let ok = wait_until(Duration::from_secs(5), || {
        ledger_spent(&redis, "{t:q:shared:pre}") == used
    });
    assert!(
        ok,
        "ledger {} != {used} used",
        ledger_spent(&redis, "{t:q:shared:pre}")
    );
}

#[test]
fn client_abort_mid_stream_is_billed_in_the_ledger() {
    let redis = Redis::start();
    let mock = Mock::start(&["--tokens", "40", "--inter-token-ms", "25"]);
    let gws = gateways(
        &mock,
        &redis,
        1,
        1,
        "#plans\nplans = [{ id = \"pre\", tokens = 100000 }]",
    );
    let stream = serde_json::json!({"model": "gpt-4o", "stream": true, "max_tokens": 40,
        "messages": [{"role": "user", "content": "tell me a long story"}]})
    .to_string();
    let mut conn = gws[0].conn();
    conn.send(
        &Req::post("/v1/chat/completions", &stream)
            .header("x-api-key", KEY)
            .build(),
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !conn.buffered().windows(4).any(|w| w == b"tok2") {
        assert!(Instant::now() < deadline, "no content arrived");
        assert!(
            conn.read_more().expect("read stream") > 0,
            "stream ended early"
        );
    }
    drop(conn);
    assert!(wait_until(Duration::from_secs(5), || mock
        .stat("streams_aborted")
        == 1));
    let billed = |r: &Redis| ledger_spent(r, "{t:q:shared:pre}");
    assert!(
        wait_until(Duration::from_secs(5), || billed(&redis) > 0),
        "the aborted stream was not billed"
    );
    std::thread::sleep(Duration::from_millis(200));
    let b = billed(&redis);
    // The prompt estimate plus the few tokens streamed: more than nothing, less than the
    // whole 40-token answer plus prompt.
    assert!((3..60).contains(&b), "billed {b}");
}

/// `[limits.redis] address` as a URL (issue #13, point 8): an ACL user, a password with
/// characters that must be percent-encoded, and database 5. Redis refuses anyone else (its
/// default user gets a password Sluice is not told), so every exchange went in as that user; the
/// budgets are in database 5 and nowhere else; the quota holds, and the ledger's spend is what
/// the answers used; the password is in none of Sluice's output.
#[test]
fn limits_run_on_redis_addressed_by_a_url_with_user_password_and_db() {
    const PASSWORD: &str = "p@ss:w/rd%?#é";
    const ENCODED: &str = "p%40ss%3Aw%2Frd%25%3F%23%C3%A9";
    let redis = Redis::start();
    redis
        .cmd(&[
            "ACL",
            "SETUSER",
            "sluice",
            "on",
            &format!(">{PASSWORD}"),
            "~*",
            "+@all",
        ])
        .assert_ok();
    // The kept connection stays logged in; a new one must AUTH.
    redis
        .cmd(&["CONFIG", "SET", "requirepass", "only-the-test-knows"])
        .assert_ok();
    let in_db = |db: &str| {
        let mut c = redis.client();
        c.cmd(&["AUTH", "only-the-test-knows"]).unwrap().assert_ok();
        c.cmd(&["SELECT", db]).unwrap().assert_ok();
        c
    };
    let mock = Mock::start(&["--tokens", "8"]);
    let toml = format!(
        r#"
[limits]
backend = "redis"

[limits.redis]
address = "redis://sluice:{ENCODED}@127.0.0.1:{}/5"
key_prefix = "url"

[[keys]]
id = "shared"
sha256 = "{}"
plans = [{{ id = "pre", tokens = 300 }}]
"#,
        redis.port,
        key_hash(KEY),
    );
    let gw = Sluice::start(&Config::one_cluster(&mock).raw(&toml));
    let mut used = 0;
    let mut refused = None;
    for _ in 0..60 {
        let r = request(gw.addr, &body(8), &[]);
        match r.status {
            200 => used += usage_total(&r),
            429 => {
                refused = Some(r);
                break;
            }
            _ => panic!("unexpected answer: {}\n{}", r.dump(), gw.stderr_text()),
        }
    }
    let refused = refused.expect("a quota of 300 tokens never ran out");
    let e: serde_json::Value = serde_json::from_slice(&refused.body).unwrap();
    assert_eq!(
        e["error"]["type"],
        "insufficient_quota",
        "{}",
        refused.dump()
    );
    assert!((1..=300).contains(&used), "used {used}");
    let spent = |db: &str| {
        let mut c = in_db(db);
        c.keys("{url:q:shared:pre}")
            .unwrap()
            .iter()
            .flat_map(|k| c.hgetall(k).unwrap())
            .filter(|(f, _)| f.starts_with("s:"))
            .map(|(_, v)| v.parse::<u64>().unwrap())
            .sum::<u64>()
    };
    assert!(
        wait_until(Duration::from_secs(5), || spent("5") == used),
        "database 5 holds {} spent, the answers used {used}",
        spent("5")
    );
    for db in ["0", "1"] {
        assert_eq!(
            in_db(db).keys("*").unwrap(),
            Vec::<String>::new(),
            "db {db}"
        );
    }
    assert!(
        !gw.stderr_text().contains("p@ss") && !gw.stderr_text().contains(ENCODED),
        "{}",
        gw.stderr_text()
    );
}

/// Issue #12 item 6: a provider's TPM budget on the first target of a route, shared by three
/// processes through Redis, is never passed at that provider, and the requests it would not
/// take go to the next target — no client sees an error.
#[test]
fn a_provider_tpm_budget_shared_by_3_processes_is_never_exceeded_and_traffic_moves_on() {
    const BUDGET: u64 = 400;
    let redis = Redis::start();
    // 8 completion tokens; the prompt is counted as the body's length / 4 (about 20 here),
    // within what a request reserves (its prompt estimate plus max_tokens = 16).
    let a = Mock::start(&["--tokens", "8"]);
    let b = Mock::start(&["--tokens", "8"]);
    let toml = format!(
        r#"
[clusters.a]
backends = [{{ base_url = "{}" }}]
provider_limits = {{ max_tokens = {BUDGET}, window_secs = 60 }}

[clusters.b]
backends = [{{ base_url = "{}" }}]

[[routes]]
model = "gpt-4o"
groups = [{{ targets = [{{ cluster = "a" }}] }}, {{ targets = [{{ cluster = "b" }}] }}]

[limits]
backend = "redis"
nodes = 3
lease_ttl_ms = 2000
sync_timeout_ms = 1000

[limits.redis]
address = "{}"
key_prefix = "prov"
"#,
        a.base_url(),
        b.base_url(),
        redis.addr,
    );
    // The whole burst within one sliding window's first part, with no window before it.
    wait_out_window_edge(60, 20);
    let gws: Vec<Sluice> = (0..3)
        .map(|_| Sluice::start(&Config::new().workers(1).admin().raw(&toml)))
        .collect();
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let handles: Vec<_> = (0..9)
        .map(|t| {
            let addr = addrs[t % 3];
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                let req = Req::post("/v1/chat/completions", &body(16));
                for _ in 0..10 {
                    c.send(&req.build());
                    let r = c.read_response();
                    assert_eq!(r.status, 200, "{}", r.dump());
                    // Spread over a few sync intervals: a worker without a lease passes the
                    // target over until its next exchange.
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let used_at_a = a.stat("usage_prompt_tokens") + a.stat("usage_completion_tokens");
    let (at_a, at_b) = (a.stat("requests"), b.stat("requests"));
    assert!(
        used_at_a <= BUDGET,
        "provider a was sent {used_at_a} tokens ({at_a} requests) on a budget of {BUDGET}"
    );
    let stderr: Vec<String> = gws.iter().map(|g| g.stderr_text()).collect();
    assert!(
        at_a >= 3,
        "provider a served only {at_a}: its budget went unused; {stderr:?}; {:?}",
        redis.keys("*")
    );
    assert_eq!(
        at_a + at_b,
        90,
        "a served {at_a}, b {at_b}: retried or lost"
    );
    assert!(at_b >= 90 - BUDGET / 20, "b served only {at_b}");
    // Each request b served is one skip of a, counted where operators look.
    let skips = || {
        gws.iter()
            .map(|g| {
                g.metrics().sum(
                    "sluice_upstream_errors_total",
                    &[("kind", "provider_limit")],
                )
            })
            .sum::<f64>()
    };
    assert!(
        wait_until(Duration::from_secs(5), || skips() == at_b as f64),
        "provider_limit skips {} for {at_b} requests served by b",
        skips()
    );
}

/// Issue #48, item 1: a concurrency limit of 4 saturated from both workers of one process
/// (8 clients, each request held 40 ms by mock-llm) while Redis goes away twice — once for
/// less than the lease (leases and outage shares were two allowances: 5 in flight) and once
/// for longer, restarted empty (the first worker back took slots the other still used) — never
/// has more than 4 in flight at mock-llm, and is served throughout (`allow`: on local shares
/// while Redis is away; 429 past them, never 503: the key has no quota plan).
#[test]
fn a_concurrency_limit_holds_through_redis_loss_and_return_on_two_workers() {
    let mut redis = Redis::start();
    let mock = Mock::start(&[]);
    let gws = gateways(
        &mock,
        &redis,
        1,
        2,
        "#limits\nsync_timeout_ms = 1000\n#policies\n[[policies]]\nid = \"four\"\nmax_concurrency = 4",
    );
    let addr = gws[0].addr;
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let (stop, served) = (Arc::clone(&stop), Arc::clone(&served));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // A new connection each time: both workers take their turns.
                    let r = request(addr, &body(1), &[("x-mock-delay-ms", "40")]);
                    match r.status {
                        200 => {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => std::thread::sleep(Duration::from_millis(2)),
                        _ => panic!("unexpected: {}", r.dump()),
                    }
                }
            })
        })
        .collect();
    let count = || served.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(800));
    // Shorter than the 2 s lease.
    redis.kill();
    let before = count();
    std::thread::sleep(Duration::from_millis(1000));
    let during_short = count() - before;
    redis.restart();
    std::thread::sleep(Duration::from_millis(1000));
    // Longer than the lease; back empty (no persistence).
    redis.kill();
    let before = count();
    std::thread::sleep(Duration::from_millis(3000));
    let during_long = count() - before;
    redis.restart();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let peak = mock.stat("max_active_requests");
    assert!(peak <= 4, "{peak} requests in flight at mock-llm");
    assert!(peak >= 3, "peak {peak}: the slots were never used");
    assert!(
        during_short >= 10 && during_long >= 30,
        "served while Redis was away: {during_short} (1 s), {during_long} (3 s)"
    );
    // A worker with budgets to exchange finds Redis back (one with nothing to exchange does
    // not look): after each outage at least one did.
    let stderr = gws[0].stderr_text();
    assert!(
        stderr.matches("limit ledger reachable again").count() >= 2,
        "Redis found back after each outage: {stderr}"
    );
}
