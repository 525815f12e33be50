//! Load-aware, cost, quality and queue-aware strategies of a target group, and the capability
//! filter (issue #12), black-box against several mock-llm backends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::json;
use sluice_tests::*;

/// Clusters `a` and `b` (one mock each, `queue_metrics` on, scraped every 50 ms) and `gpt-4o`
/// routed to one group of both, with `strategy` and the targets' extra keys.
fn one_group(a: &Mock, b: &Mock, strategy: &str, a_extra: &str, b_extra: &str) -> Config {
    Config::new().raw(&format!(
        "[clusters.a]\nbackends = [{{ base_url = {} }}]\nqueue_metrics = true\n\
             [clusters.b]\nbackends = [{{ base_url = {} }}]\nqueue_metrics = true\n\
             [[routes]]\nmodel = \"gpt-4o\"\n\
             groups = [{{ strategy = \"{strategy}\", targets = [\
               {{ cluster = \"a\"{a_extra} }}, {{ cluster = \"b\"{b_extra} }}] }}]\n\
             [routing]\nscrape_interval_ms = 50\nqueue_stale_ms = 2000\n",
        toml_str(&a.base_url()),
        toml_str(&b.base_url()),
    ))
}

/// Send `n` chat requests (each must succeed); how many each mock got.
fn spread(gw: &Sluice, a: &Mock, b: &Mock, n: u64, body: &str) -> (u64, u64) {
    let before = (a.stat("requests"), b.stat("requests"));
    for _ in 0..n {
        let r = gw.chat(body);
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    (a.stat("requests") - before.0, b.stat("requests") - before.1)
}

#[test]
fn queue_aware_sends_new_requests_to_the_backend_without_a_queue() {
    let a = Mock::start(&[]);
    let b = Mock::start(&[]);
    a.set_queue(json!({ "waiting": 40, "running": 16, "kv_cache_usage": 0.97 }));
    let gw = Sluice::start(&one_group(&a, &b, "queue_aware", "", ""));
    // The first scrapes land within a few intervals.
    std::thread::sleep(Duration::from_millis(400));
    let (to_a, to_b) = spread(&gw, &a, &b, 40, &chat_body("gpt-4o"));
    assert!(to_b * 10 >= (to_a + to_b) * 8, "a {to_a}, b {to_b}");

    // Neither queues, but b runs far more: the shorter queue is picked (weighted random would
    // split evenly).
    a.set_queue(json!({ "waiting": 0, "running": 2, "kv_cache_usage": 0.1 }));
    b.set_queue(json!({ "waiting": 0, "running": 30, "kv_cache_usage": 0.5 }));
    std::thread::sleep(Duration::from_millis(400));
    let (to_a, to_b) = spread(&gw, &a, &b, 40, &chat_body("gpt-4o"));
    assert!(to_a * 10 >= (to_a + to_b) * 8, "a {to_a}, b {to_b}");

    // Stale readings are aged out: with the metrics gone, both serve again.
    a.set_queue(json!({ "waiting": null, "running": null, "kv_cache_usage": null }));
    b.set_queue(json!({ "waiting": null, "running": null, "kv_cache_usage": null }));
    std::thread::sleep(Duration::from_millis(400));
    let (to_a, to_b) = spread(&gw, &a, &b, 40, &chat_body("gpt-4o"));
    assert!(to_a > 0 && to_b > 0, "a {to_a}, b {to_b}");
}

#[test]
fn least_in_flight_keeps_long_streams_even_across_backends() {
    // Streams of 40 events 100 ms apart: each holds its backend for four seconds. Of 24 such
    // streams opened one after the other, an even split is what least-in-flight gives; weighted
    // random would give one in six times.
    let a = Mock::start(&["--inter-token-ms", "100", "--tokens", "40"]);
    let b = Mock::start(&["--inter-token-ms", "100", "--tokens", "40"]);
    let gw = Sluice::start(&one_group(&a, &b, "least_in_flight", "", ""));
    let mut open = Vec::new();
    for _ in 0..24 {
        let mut conn = gw.conn();
        conn.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
        let head = conn.read_head().unwrap();
        assert_eq!(head.status, 200);
        open.push(conn);
    }
    let (at_a, at_b) = (a.stat("active_streams"), b.stat("active_streams"));
    assert_eq!(at_a + at_b, 24);
    assert!(at_a.abs_diff(at_b) <= 1, "a {at_a}, b {at_b}");
}

#[test]
fn cost_first_takes_the_cheapest_until_it_is_loaded() {
    let a = Mock::start(&[]);
    let b = Mock::start(&[]);
    let config = one_group(
        &a,
        &b,
        "cost_first",
        ", model = \"pricey-model\"",
        ", model = \"cheap-model\"",
    )
    .price("pricey-model", 10.0, 30.0)
    .price("cheap-model", 0.5, 1.5);
    let gw = Sluice::start(&config);
    assert_eq!(spread(&gw, &a, &b, 10, &chat_body("gpt-4o")), (0, 10));
    // The cheap one reports 95% of its KV cache in use: the next cheapest serves.
    b.set_queue(json!({ "kv_cache_usage": 0.95 }));
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(spread(&gw, &a, &b, 10, &chat_body("gpt-4o")), (10, 0));
}

#[test]
fn quality_first_takes_the_largest_context_window() {
    let a = Mock::start(&[]);
    let b = Mock::start(&[]);
    let gw = Sluice::start(&one_group(
        &a,
        &b,
        "quality_first",
        ", context_window = 128000",
        ", context_window = 8192",
    ));
    assert_eq!(spread(&gw, &a, &b, 10, &chat_body("gpt-4o")), (10, 0));
}

#[test]
fn a_target_whose_context_window_is_too_small_is_skipped() {
    let a = Mock::start(&[]);
    let b = Mock::start(&[]);
    let gw = Sluice::start(&one_group(&a, &b, "weighted", ", context_window = 100", ""));
    // A short prompt fits both.
    let (to_a, to_b) = spread(&gw, &a, &b, 40, &chat_body("gpt-4o"));
    assert!(to_a > 0 && to_b > 0, "a {to_a}, b {to_b}");
    // Asking for 500 output tokens does not fit a's 100.
    let big = r#"{"model":"gpt-4o","max_tokens":500,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(spread(&gw, &a, &b, 20, big), (0, 20));
    // Nothing fits: the client's to fix, answered as OpenAI does, not sent to be refused.
    let gw2 = Sluice::start(&one_group(
        &a,
        &b,
        "weighted",
        ", context_window = 100",
        ", context_window = 200",
    ));
    let seen = (a.stat("requests"), b.stat("requests"));
    let r = gw2.chat(big);
    let e = assert_openai_error(&r, 400);
    assert_eq!(e["code"], "context_length_exceeded", "{}", r.dump());
    assert_eq!((a.stat("requests"), b.stat("requests")), seen);
}

#[test]
fn a_spend_limit_429_is_answered_not_retried() {
    let a = Mock::start(&["--fault", "quota"]);
    let b = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::new()
            .cluster(Cluster::new("a", &[&a.base_url()]))
            .cluster(Cluster::new("b", &[&b.base_url()]))
            .raw(
                "[[routes]]\nmodel = \"gpt-4o\"\n\
                 groups = [{ targets = [{ cluster = \"a\" }] }, { targets = [{ cluster = \"b\" }] }]\n",
            ),
    );
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r.status, 429, "{}", r.dump());
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(body["error"]["code"], "insufficient_quota", "{}", r.dump());
    assert_eq!(b.stat("requests"), 0);
    // And the backend is not cooled down for it: the next request goes to it again.
    gw.chat(&chat_body("gpt-4o"));
    assert_eq!((a.stat("requests"), b.stat("requests")), (2, 0));
}
