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

/// Cluster `pool` of `mocks`, `gpt-4o` routed there with `sticky`, plus `extra` TOML.
fn pool_with(mocks: &[Mock], sticky: &str, extra: &str) -> Config {
    let backends: Vec<String> = mocks
        .iter()
        .map(|m| format!("{{ base_url = {} }}", toml_str(&m.base_url())))
        .collect();
    Config::new().raw(&format!(
        "[clusters.pool]\nbackends = [{}]\n\
         [[routes]]\nmodel = \"gpt-4o\"\ncluster = \"pool\"\nsticky = {sticky}\n{extra}",
        backends.join(", ")
    ))
}

/// Which mock served the one request `send` makes (requests are sent one at a time).
fn served_by(m: &[Mock], send: impl FnOnce() -> Response) -> usize {
    let before: Vec<u64> = m.iter().map(|m| m.stat("requests")).collect();
    let r = send();
    assert_eq!(r.status, 200, "{}", r.dump());
    let moved: Vec<usize> = (0..m.len())
        .filter(|&i| m[i].stat("requests") > before[i])
        .collect();
    assert_eq!(moved.len(), 1, "one backend served it: {moved:?}");
    moved[0]
}

/// A chat body whose `metadata.conversation_id` is `id` (a JSON value), with `messages`.
fn body_with_id(id: serde_json::Value, messages: serde_json::Value) -> String {
    json!({ "model": "gpt-4o", "metadata": { "conversation_id": id, "tag": "x" },
            "messages": messages })
    .to_string()
}

fn hello() -> serde_json::Value {
    json!([{ "role": "user", "content": "hello" }])
}

#[test]
fn a_conversation_id_in_the_body_pins_and_a_header_before_it_wins() {
    let m = mocks(4);
    let gw = Sluice::start(&pool_with(
        &m,
        "{ from = [\"header:x-session-id\", \"body:metadata.conversation_id\"] }",
        "",
    ));
    let post = |body: &str, header: Option<&str>| {
        let mut req = Req::post("/v1/chat/completions", body);
        if let Some(h) = header {
            req = req.header("x-session-id", h);
        }
        gw.request(&req)
    };
    // Twenty conversations, five turns each, the id in the body only: each keeps one backend
    // (whatever the later turns say), and they spread over the backends.
    let mut home = Vec::new();
    for c in 0..20 {
        let id = json!(format!("conv-{c}"));
        let first = served_by(&m, || post(&body_with_id(id.clone(), hello()), None));
        for turn in 1..5 {
            let messages = json!([{ "role": "user", "content": "hello" },
                                  { "role": "assistant", "content": "hi" },
                                  { "role": "user", "content": format!("turn {turn}") }]);
            let at = served_by(&m, || post(&body_with_id(id.clone(), messages), None));
            assert_eq!(at, first, "conversation {c} turn {turn} moved");
        }
        home.push(first);
    }
    let used: BTreeSet<usize> = home.iter().copied().collect();
    assert!(
        used.len() >= 2,
        "different ids may land elsewhere: {home:?}"
    );

    // An integer id is its decimal text: 42 and "42" are one conversation.
    let at = served_by(&m, || post(&body_with_id(json!(42), hello()), None));
    for _ in 0..3 {
        assert_eq!(
            served_by(&m, || post(&body_with_id(json!("42"), hello()), None)),
            at
        );
    }

    // The header is first in `from`: a request carrying both follows the header's session.
    // Find a header session pinned away from conv-0's backend, then send both.
    let body_home = home[0];
    let header_id = (0..100)
        .map(|i| format!("hdr-{i}"))
        .find(|h| served_by(&m, || post(&chat_body("gpt-4o"), Some(h))) != body_home)
        .expect("a header session on another backend");
    let header_home = served_by(&m, || post(&chat_body("gpt-4o"), Some(&header_id)));
    assert_ne!(header_home, body_home);
    for _ in 0..5 {
        let both = body_with_id(json!("conv-0"), hello());
        assert_eq!(served_by(&m, || post(&both, Some(&header_id))), header_home);
    }
    // And the body alone still goes where conv-0 lives.
    let alone = body_with_id(json!("conv-0"), hello());
    assert_eq!(served_by(&m, || post(&alone, None)), body_home);
}

/// A system prompt longer than the hashed prefix, shared by a group of conversations.
fn system_prompt(tag: &str) -> String {
    format!("{tag}: you are a careful assistant. ").repeat(12)
}

fn conversation(system: &str, turn: usize) -> serde_json::Value {
    let mut messages = vec![json!({ "role": "system", "content": system })];
    for t in 0..=turn {
        messages.push(json!({ "role": "user", "content": format!("question {t}") }));
        if t < turn {
            messages.push(json!({ "role": "assistant", "content": format!("answer {t}") }));
        }
    }
    json!(messages)
}

#[test]
fn requests_sharing_a_prompt_prefix_go_to_one_backend_and_move_when_it_fails() {
    let m = mocks(3);
    let gw = Sluice::start(&pool_with(
        &m,
        "{ prefix = { bytes = 200, load_factor = 1.25 } }",
        "[routing]\nbreaker_failures = 2\nbreaker_open_ms = 60000\n",
    ));
    let chat = |system: &str, turn: usize| {
        let body = json!({ "model": "gpt-4o", "messages": conversation(system, turn) });
        gw.request(&Req::post("/v1/chat/completions", &body.to_string()))
    };
    let shared = system_prompt("support-bot");
    // Low load (one request at a time): turns of many conversations that share the system
    // prompt all go to one backend.
    let mut count = [0usize; 3];
    for turn in 0..40 {
        count[served_by(&m, || chat(&shared, turn % 7))] += 1;
    }
    let hot = (0..3).max_by_key(|&i| count[i]).unwrap();
    assert!(count[hot] >= 38, "{count:?}");
    // Other prefixes spread.
    let mut homes = BTreeSet::new();
    for p in 0..30 {
        homes.insert(served_by(&m, || {
            chat(&system_prompt(&format!("bot-{p}")), 0)
        }));
    }
    assert!(homes.len() >= 2, "{homes:?}");

    // The hot backend fails: its requests fall back, its breaker opens, and the prefix moves
    // — to one backend again.
    m[hot].set_fault(Some("status=500"));
    for turn in 0..4 {
        assert_eq!(chat(&shared, turn).status, 200);
    }
    let failed_before = m[hot].stat("requests");
    let mut count = [0usize; 3];
    for turn in 0..40 {
        count[served_by(&m, || chat(&shared, turn % 7))] += 1;
    }
    assert_eq!(m[hot].stat("requests"), failed_before, "{count:?}");
    let next = (0..3).max_by_key(|&i| count[i]).unwrap();
    assert!(next != hot && count[next] >= 38, "{count:?}");
}

#[test]
fn a_conversation_keeps_95_percent_of_its_turns_on_one_backend_under_load_and_the_cap_holds() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let m = mocks(3);
    let log = TempDir::new("sticky-under-load");
    let c = 1.25;
    let gw = Sluice::start(
        &pool_with(
            &m,
            &format!(
                "{{ from = [\"header:x-session-id\", \"body:metadata.conversation_id\"], \
                 prefix = {{ bytes = 256, load_factor = {c} }} }}"
            ),
            "",
        )
        .access_log(log.path())
        .access_log_opt("flush_interval_ms", 20),
    );
    // Nine other conversations, no session id, all with the same system prompt (so the same
    // prefix: without the load cap every one of them would go to one backend), each request
    // held 40 ms by its backend, sent until the watched conversation is done.
    let shared = system_prompt("support-bot");
    let others = 9;
    let stop = AtomicBool::new(false);
    let observed: Vec<Response> = std::thread::scope(|s| {
        for o in 0..others {
            let (gw, shared, stop) = (&gw, &shared, &stop);
            s.spawn(move || {
                let mut turn = o;
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({ "model": "gpt-4o",
                                       "messages": conversation(shared, turn % 5) });
                    let r = gw.request(
                        &Req::post("/v1/chat/completions", &body.to_string())
                            .header("x-mock-delay-ms", "40"),
                    );
                    assert_eq!(r.status, 200, "{}", r.dump());
                    turn += 1;
                }
            });
        }
        // Let the others get going, then forget the peaks so far.
        std::thread::sleep(Duration::from_millis(300));
        for mock in &m {
            mock.reset_peak();
        }
        // The watched conversation: 40 turns, its id in the body, the same system prompt.
        let turns = (0..40)
            .map(|turn| {
                let body = body_with_id(json!("the-watched-one"), conversation(&shared, turn));
                gw.request(
                    &Req::post("/v1/chat/completions", &body).header("x-mock-delay-ms", "40"),
                )
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        turns
    });
    for r in &observed {
        assert_eq!(r.status, 200, "{}", r.dump());
    }
    // The cap: a placement puts at most ceil(c × (requests in flight + 1) / 3) on a backend;
    // ten clients are at most ten in flight (eleven while one's last answer is being wrapped
    // up), so at most ceil(1.25 × 11 / 3) = 5 placed ones, plus the watched conversation's pin
    // (pins are not held to the cap), plus one for a decision racing another's start. Without
    // the cap the shared prefix would put all nine others on one backend.
    let bound = (c * (others as f64 + 2.0) / 3.0).ceil() as u64 + 2;
    let peaks: Vec<u64> = m.iter().map(|m| m.stat("max_active_requests")).collect();
    assert!(
        peaks.iter().all(|&p| p <= bound),
        "peaks {peaks:?} > {bound}"
    );
    assert!(peaks.iter().filter(|&&p| p > 0).count() >= 2, "{peaks:?}");
    // The watched conversation: ≥ 95% of its turns on one backend (the access log's records
    // with its session hash; the others have none).
    let total: u64 = m.iter().map(|m| m.stat("requests")).sum();
    let records = wait_records(log.path(), total as usize, Duration::from_secs(10));
    let mut watched = BTreeMap::<String, usize>::new();
    let has_session = |r: &&serde_json::Value| r["sticky_id_hash"].as_u64().is_some_and(|h| h != 0);
    for r in records.iter().filter(has_session) {
        *watched
            .entry(r["backend"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    assert_eq!(watched.values().sum::<usize>(), 40, "{watched:?}");
    let most = watched.values().copied().max().unwrap();
    assert!(most >= 38, "{watched:?}");
}
