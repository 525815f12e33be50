//! Sticky sessions (issue #12): a session id pinned to a backend, the sealed affinity cookie,
//! and re-pinning when the pinned backend is out or full — black-box, with the access log
//! telling which backend served each request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::json;
use sluice_tests::*;

const KEY_HEX: &str = "8f3c0a1b2c3d4e5f60718293a4b5c6d7e8f90112233445566778899aabbccddeeff";

/// Four mocks in cluster `pool` (queue metrics scraped every 50 ms), `gpt-4o` routed there
/// with `sticky`, the access log flushed every 20 ms.
fn pool(mocks: &[Mock], sticky: &str, log: &TempDir) -> Config {
    let backends: Vec<String> = mocks
        .iter()
        .map(|m| format!("{{ base_url = {} }}", toml_str(&m.base_url())))
        .collect();
    Config::new()
        .access_log(log.path())
        .access_log_opt("flush_interval_ms", 20)
        .env("STICKY_KEY", &KEY_HEX[..64])
        .raw(&format!(
            "[clusters.pool]\nbackends = [{}]\nqueue_metrics = true\n\
             [[routes]]\nmodel = \"gpt-4o\"\ncluster = \"pool\"\nsticky = {sticky}\n\
             [routing]\nscrape_interval_ms = 50\n\
             [sticky]\nkeys = [{{ id = 1, env = \"STICKY_KEY\" }}]\n",
            backends.join(", ")
        ))
}

fn mocks(n: usize) -> Vec<Mock> {
    (0..n).map(|_| Mock::start(&[])).collect()
}

fn turn(gw: &Sluice, headers: &[(&str, &str)]) -> Response {
    let mut req = Req::post("/v1/chat/completions", &chat_body("gpt-4o"));
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let r = gw.request(&req);
    assert_eq!(r.status, 200, "{}", r.dump());
    r
}

/// The access log's records: backend per sticky id hash.
fn backends_by_session(log: &TempDir, n: usize) -> BTreeMap<u64, BTreeSet<String>> {
    let mut by = BTreeMap::<u64, BTreeSet<String>>::new();
    for r in wait_records(log.path(), n, Duration::from_secs(10)) {
        by.entry(r["sticky_id_hash"].as_u64().unwrap())
            .or_default()
            .insert(r["backend"].as_str().unwrap().to_string());
    }
    by
}

#[test]
fn a_session_id_keeps_every_turn_on_one_backend() {
    let m = mocks(4);
    let log = TempDir::new("sticky-id");
    let gw = Sluice::start(&pool(
        &m,
        "{ from = [\"header:x-session-id\", \"query:session\"] }",
        &log,
    ));
    for turn_no in 0..10 {
        for s in 0..20 {
            let id = format!("conversation-{s}");
            // Half the sessions say who they are in the query string instead.
            if s % 2 == 0 {
                turn(&gw, &[("x-session-id", &id)]);
            } else {
                let body = chat_body("gpt-4o");
                let r = gw.request(&Req::post(
                    &format!("/v1/chat/completions?session={id}"),
                    &body,
                ));
                assert_eq!(r.status, 200, "turn {turn_no}: {}", r.dump());
            }
        }
    }
    let by = backends_by_session(&log, 200);
    assert_eq!(by.len(), 20, "one hash per session: {by:?}");
    assert!(!by.contains_key(&0));
    for (hash, backends) in &by {
        assert_eq!(backends.len(), 1, "session {hash} moved: {backends:?}");
    }
    // And the sessions are spread, not all on one backend.
    let used: BTreeSet<&String> = by.values().flatten().collect();
    assert!(used.len() >= 3, "{used:?}");
}

#[test]
fn a_session_moves_when_its_backend_is_down_or_full_and_stays_there() {
    let m = mocks(2);
    let log = TempDir::new("sticky-move");
    let gw = Sluice::start(&pool(&m, "{ from = [\"header:x-session-id\"] }", &log));
    turn(&gw, &[("x-session-id", "s1")]);
    let first = wait_records(log.path(), 1, Duration::from_secs(10))[0]["backend"]
        .as_str()
        .unwrap()
        .to_string();
    let (pinned, other) = if m[0].base_url().contains(&first) {
        (&m[0], &m[1])
    } else {
        (&m[1], &m[0])
    };
    // The pinned backend fills up (it queues requests): the session moves, and stays moved
    // once the queue is gone.
    pinned.set_queue(json!({ "waiting": 12, "running": 30, "kv_cache_usage": 0.99 }));
    std::thread::sleep(Duration::from_millis(300));
    let before = other.stat("requests");
    for _ in 0..5 {
        turn(&gw, &[("x-session-id", "s1")]);
    }
    assert_eq!(other.stat("requests"), before + 5);
    pinned.set_queue(json!({ "waiting": null, "running": null, "kv_cache_usage": null }));
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..5 {
        turn(&gw, &[("x-session-id", "s1")]);
    }
    assert_eq!(
        other.stat("requests"),
        before + 10,
        "re-pinned to the backend that served"
    );
}

fn set_cookie(r: &Response) -> Option<String> {
    let v = r.header("set-cookie")?;
    Some(v.split(';').next().unwrap().to_string())
}

#[test]
fn the_affinity_cookie_pins_and_a_forged_or_altered_one_is_ignored() {
    let m = mocks(4);
    let log = TempDir::new("sticky-cookie");
    let gw = Sluice::start(&pool(
        &m,
        "{ cookie = \"sluice_aff\", ttl_secs = 600 }",
        &log,
    ));
    let r = turn(&gw, &[]);
    let cookie = set_cookie(&r).expect("an affinity cookie");
    assert!(cookie.starts_with("sluice_aff=1."), "{cookie}");
    let attrs = r.header("set-cookie").unwrap();
    assert!(
        attrs.contains("HttpOnly") && attrs.contains("Max-Age=600"),
        "{attrs}"
    );
    // With the cookie: the same backend every time, and no new cookie.
    for _ in 0..15 {
        let r = turn(&gw, &[("cookie", &format!("theme=dark; {cookie}"))]);
        assert_eq!(set_cookie(&r), None);
    }
    let recs = wait_records(log.path(), 16, Duration::from_secs(10));
    let backends: BTreeSet<&str> = recs
        .iter()
        .map(|r| r["backend"].as_str().unwrap())
        .collect();
    assert_eq!(backends.len(), 1, "{backends:?}");

    // Altered (one hex digit flipped), forged (another key), garbage: served, and a fresh
    // cookie issued, never an error.
    let mut altered = cookie.clone().into_bytes();
    let last = altered.len() - 1;
    altered[last] = if altered[last] == b'a' { b'b' } else { b'a' };
    let altered = String::from_utf8(altered).unwrap();
    let forged = format!("sluice_aff=1.{}", "00".repeat(44));
    for bad in [
        altered.as_str(),
        forged.as_str(),
        "sluice_aff=zzz",
        "sluice_aff=9.abcd",
    ] {
        let r = turn(&gw, &[("cookie", bad)]);
        let fresh = set_cookie(&r).unwrap_or_else(|| panic!("{bad}: no fresh cookie"));
        assert_ne!(fresh, bad);
    }
}

#[test]
fn a_cookie_route_without_a_key_is_refused_at_load() {
    let out = Sluice::check(&Config::new().raw(
        "[clusters.c]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
         [[routes]]\nmodel = \"m\"\ncluster = \"c\"\nsticky = { cookie = \"aff\" }\n",
    ));
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("sticky.keys"), "{text}");
}

#[test]
fn one_session_id_on_two_sticky_routes_is_two_sessions() {
    // `gpt-4o` on cluster `pool` (mocks 0-1), `small` on cluster `other` (mocks 2-3), both sticky
    // by the same header: each route keeps the session on one of its own backends, rather than
    // the two routes taking the pin from each other on every request.
    let m = mocks(4);
    let log = TempDir::new("sticky-two-routes");
    let url = |i: usize| toml_str(&m[i].base_url());
    let gw = Sluice::start(
        &Config::new()
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 20)
            .raw(&format!(
                "[clusters.pool]\nbackends = [{{ base_url = {} }}, {{ base_url = {} }}]\n\
                 [clusters.other]\nbackends = [{{ base_url = {} }}, {{ base_url = {} }}]\n\
                 [[routes]]\nmodel = \"gpt-4o\"\ncluster = \"pool\"\n\
                 sticky = {{ from = [\"header:x-session-id\"] }}\n\
                 [[routes]]\nmodel = \"small\"\ncluster = \"other\"\n\
                 sticky = {{ from = [\"header:x-session-id\"] }}\n",
                url(0),
                url(1),
                url(2),
                url(3)
            )),
    );
    for _ in 0..10 {
        for model in ["gpt-4o", "small"] {
            let r = gw.request(
                &Req::post("/v1/chat/completions", &chat_body(model))
                    .header("x-session-id", "shared-id"),
            );
            assert_eq!(r.status, 200, "{}", r.dump());
        }
    }
    let mut by_route = BTreeMap::<String, BTreeSet<String>>::new();
    for r in wait_records(log.path(), 20, Duration::from_secs(10)) {
        by_route
            .entry(r["requested_model"].as_str().unwrap().to_string())
            .or_default()
            .insert(r["backend"].as_str().unwrap().to_string());
    }
    assert_eq!(by_route.len(), 2);
    for (route, backends) in &by_route {
        assert_eq!(backends.len(), 1, "{route} moved: {backends:?}");
    }
}
