//! Saturation (issue #42): with `[saturation]`, a target's `max_in_flight` is a cap for the
//! whole process; requests beyond it wait in Sluice — by priority class, keys sharing a class
//! fairly — and are dispatched as slots free, or answered when their wait ends (deadline,
//! shed, client gone, shutdown).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use sluice_tests::*;

const INTERACTIVE: &str = "sk-sat-interactive";
const BATCH: &str = "sk-sat-batch";

/// One backend (the mock) capped at `cap` in flight for the whole process, `workers` workers,
/// two classes; `saturation` holds more `[saturation]` keys.
fn config(mock: &Mock, cap: u32, workers: u32, saturation: &str) -> Config {
    Config::from_text(&format!(
        r#"
[server]
listen = "127.0.0.1:0"
workers = {workers}
pin_workers = false

[admin]
listen = "127.0.0.1:0"

[clusters.vllm]
backends = [{{ base_url = "{base}" }}]

[[routes]]
model = "*"
groups = [{{ targets = [{{ cluster = "vllm", max_in_flight = {cap} }}] }}]

[saturation]
{saturation}
classes = [
  {{ name = "interactive", max_wait_ms = 20000 }},
  {{ name = "batch", max_wait_ms = 20000, sheddable = true }},
]

[[keys]]
id = "interactive"
sha256 = "{i}"
class = "interactive"

[[keys]]
id = "batch"
sha256 = "{b}"
class = "batch"
"#,
        base = mock.base_url(),
        i = key_hash(INTERACTIVE),
        b = key_hash(BATCH),
    ))
}

/// A chat request with `key`, asking the mock to hold its answer `delay_ms`, and more headers.
fn chat(key: &str, delay_ms: u64, extra: &[(&str, &str)]) -> Req {
    let mut req = Req::post("/v1/chat/completions", &chat_body("m"))
        .header("Authorization", &format!("Bearer {key}"))
        .header("x-mock-delay-ms", &delay_ms.to_string());
    for (name, value) in extra {
        req = req.header(name, value);
    }
    req
}

/// Send `req` on its own thread; its response and when it came go to `done` with `tag`.
fn send(
    gw: &Sluice,
    req: Req,
    tag: &'static str,
    done: &mpsc::Sender<(&'static str, Response, Instant)>,
) -> thread::JoinHandle<()> {
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(60));
    let done = done.clone();
    thread::spawn(move || {
        c.send(&req.build());
        let r = c.read_response_to("POST");
        let _ = done.send((tag, r, Instant::now()));
    })
}

/// Wait until the gateway reports `n` requests queued in all (`sluice_queue_depth`).
fn wait_queued(gw: &Sluice, n: f64) {
    let m = gw.wait_metrics(Duration::from_secs(10), |m| {
        m.sum("sluice_queue_depth", &[]) == n
    });
    assert_eq!(m.sum("sluice_queue_depth", &[]), n, "requests queued");
}

#[test]
fn a_route_at_its_cap_queues_instead_of_sending_or_refusing() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&config(&mock, 2, 2, ""));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..6)
        .map(|_| send(&gw, chat(INTERACTIVE, 300, &[]), "r", &tx))
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let answers: Vec<_> = rx.try_iter().collect();
    assert_eq!(answers.len(), 6);
    for (_, r, _) in &answers {
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    // Never more than the cap at the backend, across both workers.
    assert_eq!(mock.stat("max_active_requests"), 2);
    assert_eq!(mock.stat("requests"), 6);
    let m = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_queue_total", &[("outcome", "dispatched")]) >= 4.0
    });
    assert!(m.sum("sluice_queue_total", &[("outcome", "dispatched")]) >= 4.0);
    assert_eq!(m.sum("sluice_queue_depth", &[]), 0.0);
}

#[test]
fn a_freed_slot_goes_to_the_oldest_waiter_of_the_highest_class_and_a_header_cannot_raise_one() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&config(&mock, 1, 2, ""));
    let (tx, rx) = mpsc::channel();
    let mut threads = vec![send(&gw, chat(INTERACTIVE, 1_500, &[]), "holder", &tx)];
    wait_until(|| mock.stat("active_requests") == 1);
    // Batch first (one of them asking, in vain, to be interactive), then interactive ones.
    const RAISE: &[(&str, &str)] = &[("x-sluice-priority", "interactive")];
    let order: [Queued; 4] = [
        (BATCH, "batch-1", &[]),
        (BATCH, "batch-2-asks-interactive", RAISE),
        (INTERACTIVE, "interactive-1", &[]),
        (INTERACTIVE, "interactive-2", &[]),
    ];
    for (i, (key, tag, extra)) in order.iter().enumerate() {
        threads.push(send(&gw, chat(key, 200, extra), tag, &tx));
        wait_queued(&gw, (i + 1) as f64);
    }
    for t in threads {
        t.join().unwrap();
    }
    let mut answers: Vec<_> = rx.try_iter().collect();
    answers.sort_by_key(|(_, r, _)| arrival(r));
    let tags: Vec<_> = answers.iter().map(|(t, _, _)| *t).collect();
    assert_eq!(
        tags,
        [
            "holder",
            "interactive-1",
            "interactive-2",
            "batch-1",
            "batch-2-asks-interactive"
        ]
    );
    for (tag, r, _) in &answers {
        assert_eq!(r.status, 200, "{tag}: {}", r.dump());
    }
    assert_eq!(mock.stat("max_active_requests"), 1);
}

/// Where the mock counted the request that this answers (its id is `chatcmpl-mock-N`): the
/// order requests reached the backend in, whenever their clients got to read the answers.
fn arrival(r: &Response) -> u64 {
    let id = r.json()["id"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_default();
    id.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(u64::MAX)
}

/// A request to queue: its key, its tag, its extra headers.
type Queued = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// Poll `cond` every 10 ms for up to 10 s.
fn wait_until(mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "condition not met in 10 s");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_wait_past_its_deadline_is_answered_503_queue_timeout_with_retry_after() {
    let mock = Mock::start(&[]);
    let log = TempDir::new("saturation-expiry");
    let gw = Sluice::start(
        &config(&mock, 1, 2, "")
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 50),
    );
    let (tx, rx) = mpsc::channel();
    let holder = send(&gw, chat(INTERACTIVE, 3_000, &[]), "holder", &tx);
    wait_until(|| mock.stat("active_requests") == 1);
    let started = Instant::now();
    let r = gw.request(&chat(INTERACTIVE, 0, &[("x-sluice-max-wait-ms", "300")]));
    assert_eq!(r.status, 503, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "queue_timeout");
    assert_eq!(r.json()["error"]["type"], "server_error");
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    // It never reached the backend.
    assert_eq!(mock.stat("requests"), 1);
    // A wait of 0 is no wait: answered at once.
    let r = gw.request(&chat(INTERACTIVE, 0, &[("x-sluice-max-wait-ms", "0")]));
    assert_eq!(r.status, 503, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "backends_full");
    // A header naming no class, or a wait that is not a number: the client's to fix.
    let r = gw.request(&chat(INTERACTIVE, 0, &[("x-sluice-priority", "urgent")]));
    assert_eq!(r.status, 400, "{}", r.dump());
    let r = gw.request(&chat(INTERACTIVE, 0, &[("x-sluice-max-wait-ms", "soon")]));
    assert_eq!(r.status, 400, "{}", r.dump());
    holder.join().unwrap();
    assert_eq!(rx.recv().unwrap().1.status, 200);
    assert_eq!(mock.stat("requests"), 1);
    let m = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_queue_total", &[("outcome", "expired")]) >= 1.0
    });
    assert_eq!(m.sum("sluice_queue_total", &[("outcome", "expired")]), 1.0);
    // The access log: the expired wait (its class, how long, how it ended), the holder that
    // never waited.
    let records = wait_records(log.path(), 5, Duration::from_secs(10));
    let expired: Vec<_> = records.iter().filter(|r| r["status"] == 503).collect();
    let waited = expired
        .iter()
        .find(|r| r["queue_outcome"] == "expired")
        .expect("the expired wait is logged");
    assert_eq!(waited["priority_class"], "interactive", "{waited}");
    let queued_us = waited["queued_us"].as_u64().unwrap();
    assert!((300_000..10_000_000).contains(&queued_us), "{waited}");
    let holder = records.iter().find(|r| r["status"] == 200).unwrap();
    assert_eq!(holder["queue_outcome"], "", "{holder}");
    assert_eq!(holder["queued_us"], 0, "{holder}");
}

#[test]
fn a_client_that_leaves_while_queued_is_gone_from_the_queue_and_never_reaches_the_backend() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&config(&mock, 1, 2, ""));
    let (tx, rx) = mpsc::channel();
    let holder = send(&gw, chat(INTERACTIVE, 1_500, &[]), "holder", &tx);
    wait_until(|| mock.stat("active_requests") == 1);
    let mut quitter = gw.conn();
    quitter.send(&chat(INTERACTIVE, 0, &[]).build());
    wait_queued(&gw, 1.0);
    drop(quitter);
    wait_queued(&gw, 0.0);
    holder.join().unwrap();
    assert_eq!(rx.recv().unwrap().1.status, 200);
    // The next request is served at once (no ghost ahead of it), and the quitter never went.
    let r = gw.request(&chat(INTERACTIVE, 0, &[]));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(mock.stat("requests"), 2);
    let m = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_queue_total", &[("outcome", "client_left")]) >= 1.0
    });
    assert_eq!(
        m.sum("sluice_queue_total", &[("outcome", "client_left")]),
        1.0
    );
}

#[test]
fn a_full_queue_sheds_the_lower_sheddable_class_first() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&config(&mock, 1, 1, "max_queued_per_worker = 2"));
    let (tx, rx) = mpsc::channel();
    let mut threads = vec![send(&gw, chat(INTERACTIVE, 1_000, &[]), "holder", &tx)];
    wait_until(|| mock.stat("active_requests") == 1);
    threads.push(send(&gw, chat(BATCH, 0, &[]), "batch-1", &tx));
    wait_queued(&gw, 1.0);
    threads.push(send(&gw, chat(BATCH, 0, &[]), "batch-2", &tx));
    wait_queued(&gw, 2.0);
    // Full: an interactive request takes the place of the latest batch one, the next one the
    // place of the other; a third finds only interactive ones, none to shed.
    for (interactive, shed_tag) in [("interactive-1", "batch-2"), ("interactive-2", "batch-1")] {
        threads.push(send(&gw, chat(INTERACTIVE, 0, &[]), interactive, &tx));
        let (tag, shed, _) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(tag, shed_tag);
        assert_eq!(shed.status, 503, "{}", shed.dump());
        assert_eq!(shed.json()["error"]["code"], "request_shed");
        assert!(shed.header("retry-after").is_some());
    }
    let r = gw.request(&chat(INTERACTIVE, 0, &[]));
    assert_eq!(r.status, 503, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "queue_full");
    for t in threads {
        t.join().unwrap();
    }
    let mut rest: Vec<_> = rx.try_iter().collect();
    rest.sort_by_key(|(_, r, _)| arrival(r));
    let tags: Vec<_> = rest.iter().map(|(t, r, _)| (*t, r.status)).collect();
    assert_eq!(mock.stat("max_active_requests"), 1, "{tags:?}");
    let tags: Vec<_> = rest.iter().map(|(t, _, _)| *t).collect();
    assert_eq!(tags, ["holder", "interactive-1", "interactive-2"]);
    assert_eq!(mock.stat("requests"), 3);
    let m = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_queue_total", &[("outcome", "shed")]) >= 2.0
    });
    assert_eq!(
        m.sum(
            "sluice_queue_total",
            &[("outcome", "shed"), ("class", "batch")]
        ),
        2.0
    );
    assert_eq!(
        m.sum("sluice_queue_total", &[("outcome", "queue_full")]),
        1.0
    );
}

#[test]
fn a_stop_answers_queued_requests_at_once_while_the_one_in_flight_finishes() {
    let mock = Mock::start(&[]);
    let config = config(&mock, 1, 2, "").raw("");
    let text = config.to_toml().replace(
        "pin_workers = false",
        "pin_workers = false\nshutdown_grace_ms = 10000",
    );
    let mut gw = Sluice::start(&Config::from_text(&text));
    let (tx, rx) = mpsc::channel();
    let holder = send(&gw, chat(INTERACTIVE, 1_500, &[]), "holder", &tx);
    wait_until(|| mock.stat("active_requests") == 1);
    let queued = send(&gw, chat(INTERACTIVE, 0, &[]), "queued", &tx);
    wait_queued(&gw, 1.0);
    gw.signal(libc::SIGTERM);
    let (tag, r, _) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(tag, "queued", "answered before the one in flight ended");
    assert_eq!(r.status, 503, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "server_shutting_down");
    let (tag, r, _) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((tag, r.status), ("holder", 200), "{}", r.dump());
    holder.join().unwrap();
    queued.join().unwrap();
    assert!(gw.wait_exit(Duration::from_secs(10)).is_some());
    assert_eq!(mock.stat("requests"), 1);
}

#[test]
fn queued_bodies_stay_within_the_workers_body_memory() {
    let mock = Mock::start(&[]);
    let text = config(&mock, 1, 1, "").to_toml().replace(
        "pin_workers = false",
        "pin_workers = false\nmax_body_memory_per_worker = 3000000\n\n[http]\nmax_body_bytes = 1000000",
    );
    let gw = Sluice::start(&Config::from_text(&text));
    let (tx, rx) = mpsc::channel();
    let holder = send(&gw, chat(INTERACTIVE, 1_500, &[]), "holder", &tx);
    wait_until(|| mock.stat("active_requests") == 1);
    // Six bodies of ~900 KB for a worker that holds 3 MB of bodies: two fit beside the
    // holder's, the rest are refused at once, never queued.
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(900_000)
    );
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let req = Req::post("/v1/chat/completions", &big)
                .header("Authorization", &format!("Bearer {INTERACTIVE}"));
            let mut c = gw.conn();
            c.set_timeout(Duration::from_secs(30));
            let tx = tx.clone();
            thread::spawn(move || {
                let _ = c.try_send(&req.build());
                if let Ok(r) = c.try_read_response("POST") {
                    let _ = tx.send(("big", r, Instant::now()));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    holder.join().unwrap();
    let answers: Vec<_> = rx.try_iter().filter(|(t, _, _)| *t == "big").collect();
    let served = answers.iter().filter(|(_, r, _)| r.status == 200).count();
    let refused = answers.iter().filter(|(_, r, _)| r.status == 503).count();
    assert!(served <= 3, "{served} bodies held beside the holder's");
    assert!(served >= 1, "some queued and were served");
    assert_eq!(served + refused, answers.len());
    assert!(refused >= 3, "{refused} refused");
    assert_eq!(mock.stat("requests") as usize, 1 + served);
}

#[test]
fn a_reload_keeps_waiting_requests_in_their_queue_and_they_are_served() {
    let mock = Mock::start(&[]);
    let config = config(&mock, 1, 2, "");
    let gw = Sluice::start(&config);
    let (tx, rx) = mpsc::channel();
    let holder = send(&gw, chat(INTERACTIVE, 1_500, &[]), "holder", &tx);
    wait_until(|| mock.stat("active_requests") == 1);
    let waiting = send(&gw, chat(BATCH, 0, &[]), "waiting", &tx);
    wait_queued(&gw, 1.0);
    // The same gateway, the batch class's wait shorter: a new snapshot, a new queue.
    gw.rewrite_config_text(&config.to_toml().replace(
        r#"{ name = "batch", max_wait_ms = 20000"#,
        r#"{ name = "batch", max_wait_ms = 15000"#,
    ));
    gw.signal(libc::SIGHUP);
    let m = gw.wait_metrics(Duration::from_secs(10), |m| {
        m.sum("sluice_config_reloads_total", &[("outcome", "applied")]) >= 1.0
    });
    assert_eq!(
        m.sum("sluice_config_reloads_total", &[("outcome", "applied")]),
        1.0
    );
    // A request of the new snapshot waits in the new snapshot's queue; both are served, one at
    // a time (the cap holds across the two queues: it is the backend's).
    let after = send(&gw, chat(BATCH, 0, &[]), "after", &tx);
    holder.join().unwrap();
    waiting.join().unwrap();
    after.join().unwrap();
    let answers: Vec<_> = rx.try_iter().collect();
    assert_eq!(answers.len(), 3);
    for (tag, r, _) in &answers {
        assert_eq!(r.status, 200, "{tag}: {}", r.dump());
    }
    assert_eq!(mock.stat("max_active_requests"), 1);
    assert_eq!(mock.stat("requests"), 3);
}

/// A key limited to 2 requests at once whose policy queues: `extra` more policy keys.
fn shaped(mock: &Mock, extra: &str) -> Config {
    let text = config(mock, 100, 2, "").to_toml()
        + &format!(
            r#"
[[policies]]
id = "two-at-once"
per = "key"
max_concurrency = 2
{extra}
"#
        );
    Config::from_text(&text)
}

#[test]
fn on_limit_queue_smooths_a_burst_over_a_concurrency_2_key_without_a_429() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&shaped(
        &mock,
        "on_limit = \"queue\"\nmax_queue_wait_ms = 20000",
    ));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..6)
        .map(|_| send(&gw, chat(INTERACTIVE, 300, &[]), "burst", &tx))
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let answers: Vec<_> = rx.try_iter().collect();
    assert_eq!(answers.len(), 6);
    for (_, r, _) in &answers {
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    // The key's limit held across both workers while the burst waited for it.
    assert_eq!(mock.stat("max_active_requests"), 2);
    assert_eq!(mock.stat("requests"), 6);

    // The wait is bounded: with the key's two places held, a request that may wait 200 ms
    // gets the policy's 429, its own code, after waiting.
    let holders: Vec<_> = (0..2)
        .map(|_| send(&gw, chat(INTERACTIVE, 2_000, &[]), "holder", &tx))
        .collect();
    wait_until(|| mock.stat("active_requests") == 2);
    let started = Instant::now();
    let r = gw.request(&chat(INTERACTIVE, 0, &[("x-sluice-max-wait-ms", "200")]));
    assert_eq!(r.status, 429, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "rate_limit_queue_timeout");
    assert!(r.header("retry-after").is_some(), "{}", r.dump());
    assert!(started.elapsed() >= Duration::from_millis(200));
    for t in holders {
        t.join().unwrap();
    }
    assert_eq!(mock.stat("requests"), 8);
}

#[test]
fn without_on_limit_queue_the_same_burst_is_refused_at_once() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&shaped(&mock, ""));
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..6)
        .map(|_| send(&gw, chat(INTERACTIVE, 500, &[]), "burst", &tx))
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let answers: Vec<_> = rx.try_iter().collect();
    let refused = answers.iter().filter(|(_, r, _)| r.status == 429).count();
    let served = answers.iter().filter(|(_, r, _)| r.status == 200).count();
    assert_eq!(refused + served, 6);
    assert!(
        refused >= 1,
        "a concurrency-2 key refuses part of a burst of 6"
    );
    for (_, r, _) in answers.iter().filter(|(_, r, _)| r.status == 429) {
        assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    }
}

#[test]
fn on_limit_queue_keeps_a_redis_synced_concurrency_limit_across_two_nodes() {
    let mock = Mock::start(&[]);
    let redis = Redis::start();
    let limits = format!(
        r#"
[limits]
backend = "redis"
nodes = 2
lease_ttl_ms = 2000

[limits.redis]
address = "{}"
key_prefix = "sat"
"#,
        redis.addr
    );
    let config = shaped(&mock, "on_limit = \"queue\"\nmax_queue_wait_ms = 30000").raw(&limits);
    let nodes = [Sluice::start(&config), Sluice::start(&config)];
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..8)
        .map(|i| send(&nodes[i % 2], chat(INTERACTIVE, 300, &[]), "burst", &tx))
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let answers: Vec<_> = rx.try_iter().collect();
    assert_eq!(answers.len(), 8);
    for (_, r, _) in &answers {
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    // Two at once for the key across both processes, however the burst was spread.
    assert!(
        mock.stat("max_active_requests") <= 2,
        "{}",
        mock.stat("max_active_requests")
    );
    assert_eq!(mock.stat("requests"), 8);
}

#[test]
fn a_backend_whose_scraped_queue_is_at_max_waiting_is_full_until_it_drains() {
    let mock = Mock::start(&[]);
    let text = config(&mock, 100, 2, "")
        .to_toml()
        .replace("backends = [{", "queue_metrics = true\nbackends = [{")
        .replace(
            "max_in_flight = 100 }",
            "max_in_flight = 100, max_waiting = 3 }",
        )
        + "\n[routing]\nscrape_interval_ms = 50\nqueue_stale_ms = 2000\n";
    let gw = Sluice::start(&Config::from_text(&text));
    // The backend says 5 requests wait in its own queue: full for this route.
    mock.set_queue(serde_json::json!({"waiting": 5}));
    // Once a scrape has read it, a request that may not wait is answered `backends_full`.
    let no_wait = [("x-sluice-max-wait-ms", "0")];
    let mut served_before = 0;
    wait_until(|| {
        let r = gw.request(&chat(INTERACTIVE, 0, &no_wait));
        served_before += u64::from(r.status == 200);
        r.status == 503 && r.json()["error"]["code"] == "backends_full"
    });
    let (tx, rx) = mpsc::channel();
    let waiter = send(&gw, chat(INTERACTIVE, 0, &[]), "waiter", &tx);
    wait_queued(&gw, 1.0);
    assert_eq!(
        mock.stat("chat_requests"),
        served_before,
        "sent to a backend that said it was full"
    );
    // Its queue drains (back to the real counts: none waiting): the request goes.
    mock.set_queue(serde_json::Value::Null);
    waiter.join().unwrap();
    let (_, r, _) = rx.recv().unwrap();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(mock.stat("chat_requests"), served_before + 1);
}

#[test]
fn keys_of_one_class_take_turns_instead_of_first_come_first_served() {
    let mock = Mock::start(&[]);
    // The second key is batch by its entity's class (the default class is interactive).
    let saturation = "default_class = \"interactive\"\nentities = { \"evals\" = \"batch\" }";
    let text = config(&mock, 1, 1, saturation).to_toml()
        + &format!(
            "\n[[keys]]\nid = \"other-batch\"\nsha256 = \"{}\"\nentity = \"evals\"\n",
            key_hash(OTHER_BATCH)
        );
    let gw = Sluice::start(&Config::from_text(&text));
    let (tx, rx) = mpsc::channel();
    let mut threads = vec![send(&gw, chat(INTERACTIVE, 1_000, &[]), "holder", &tx)];
    wait_until(|| mock.stat("active_requests") == 1);
    // One batch key queues four, then another batch key one: the second key's request goes
    // second, not fifth.
    let tags = ["a-1", "a-2", "a-3", "a-4"];
    for (i, tag) in tags.iter().enumerate() {
        threads.push(send(&gw, chat(BATCH, 100, &[]), tag, &tx));
        wait_queued(&gw, (i + 1) as f64);
    }
    threads.push(send(&gw, chat(OTHER_BATCH, 100, &[]), "b-1", &tx));
    wait_queued(&gw, 5.0);
    for t in threads {
        t.join().unwrap();
    }
    let mut answers: Vec<_> = rx.try_iter().collect();
    answers.sort_by_key(|(_, r, _)| arrival(r));
    let order: Vec<_> = answers.iter().map(|(t, _, _)| *t).collect();
    assert_eq!(order, ["holder", "a-1", "b-1", "a-2", "a-3", "a-4"]);
}

const OTHER_BATCH: &str = "sk-sat-other-batch";

#[test]
fn a_class_refused_while_a_higher_one_waits_is_answered_at_once() {
    let mock = Mock::start(&[]);
    let text = config(&mock, 1, 2, "").to_toml().replace(
        r#"{ name = "batch", max_wait_ms = 20000, sheddable = true }"#,
        r#"{ name = "batch", max_wait_ms = 20000, refuse_while_higher_waits = true }"#,
    );
    let gw = Sluice::start(&Config::from_text(&text));
    let (tx, rx) = mpsc::channel();
    let holder = send(&gw, chat(INTERACTIVE, 1_500, &[]), "holder", &tx);
    wait_until(|| mock.stat("active_requests") == 1);
    // Nothing higher waits: a batch request queues.
    let batch = send(&gw, chat(BATCH, 0, &[]), "batch", &tx);
    wait_queued(&gw, 1.0);
    let interactive = send(&gw, chat(INTERACTIVE, 0, &[]), "interactive", &tx);
    wait_queued(&gw, 2.0);
    // An interactive one waits now: the next batch request is refused without waiting.
    let started = Instant::now();
    let r = gw.request(&chat(BATCH, 0, &[]));
    assert_eq!(r.status, 503, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "request_shed");
    assert!(started.elapsed() < Duration::from_secs(10), "it waited");
    for t in [holder, batch, interactive] {
        t.join().unwrap();
    }
    let mut answers: Vec<_> = rx.try_iter().collect();
    answers.sort_by_key(|(_, r, _)| arrival(r));
    let order: Vec<_> = answers.iter().map(|(t, r, _)| (*t, r.status)).collect();
    assert_eq!(
        order,
        [("holder", 200), ("interactive", 200), ("batch", 200)]
    );
}
