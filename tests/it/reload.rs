//! Hot reload (issue #13, point 2): `SIGHUP` and `POST /admin/reload` read the config file
//! again; a valid one serves the next requests while those in flight finish on theirs, an
//! invalid one changes nothing and says why, limiter state survives, and each reload is logged
//! and counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

const TOKEN: &str = "reload-token-0123456789abcdef";
const ALICE: &str = "sk-alice-reload-1";
const BOB: &str = "sk-bob-reload-2";

fn key_toml(id: &str, key: &str) -> String {
    format!("[[keys]]\nid = \"{id}\"\nsha256 = \"{}\"\n", key_hash(key))
}

/// The admin listener with its reload token, one cluster on `mock`, `gpt-4o` routed to it.
fn base(mock: &Mock) -> Config {
    Config::one_cluster(mock)
        .admin()
        .set("admin", "token_env", &toml_str("SLUICE_ADMIN_TOKEN"))
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
}

fn chat_as(gw: &Sluice, key: &str, model: &str) -> Response {
    gw.request(
        &Req::post("/v1/chat/completions", &chat_body(model))
            .header("Authorization", &format!("Bearer {key}")),
    )
}

fn reloads(m: &Metrics, outcome: &str) -> f64 {
    m.get("sluice_config_reloads_total", &[("outcome", outcome)])
        .unwrap_or(-1.0)
}

#[test]
fn sighup_under_500_live_streams_cuts_none_and_the_new_config_takes_effect() {
    const STREAMS: usize = 500;
    let mock = Mock::start(&["--inter-token-ms", "100", "--tokens", "20"]);
    let old = base(&mock).workers(2).raw(&key_toml("alice", ALICE));
    let gw = Sluice::start(&old);
    assert_eq!(chat_as(&gw, ALICE, "gpt-4o").status, 200);
    assert_eq!(chat_as(&gw, BOB, "gpt-4o").status, 401);

    // 500 streams of 2 s each, started on the old config.
    let addr = gw.addr;
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                c.set_timeout(Duration::from_secs(30));
                c.send(
                    &Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
                        .header("Authorization", &format!("Bearer {ALICE}"))
                        .build(),
                );
                c.read_response()
            })
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || mock.stat("active_streams")
            >= STREAMS as u64),
        "only {} streams running",
        mock.stat("active_streams")
    );

    // The new file: bob instead of alice, and a new model mapped onto the same cluster.
    let new = base(&mock)
        .workers(2)
        .map("gpt-5", "mock-five")
        .raw(&key_toml("bob", BOB));
    gw.rewrite_config(&new);
    gw.signal(libc::SIGHUP);
    let m = gw.wait_metrics(Duration::from_secs(10), |m| reloads(m, "applied") == 1.0);
    assert_eq!(reloads(&m, "applied"), 1.0, "{}", gw.stderr_text());
    assert_eq!(
        m.get("sluice_config_last_reload_successful", &[]),
        Some(1.0)
    );
    assert!(
        m.get("sluice_config_last_reload_success_timestamp_seconds", &[])
            .unwrap_or(0.0)
            > 1.7e9
    );
    // The reload happened while the streams ran.
    assert!(
        mock.stat("active_streams") > 0,
        "the streams ended before the reload"
    );

    // New requests run on the new config: bob in, alice out, gpt-5 routed and mapped.
    assert_eq!(chat_as(&gw, ALICE, "gpt-4o").status, 401);
    let r = chat_as(&gw, BOB, "gpt-5");
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.json()["model"], "mock-five", "{}", r.dump());

    // Every stream started on the old config finished whole.
    for (i, s) in streams.into_iter().enumerate() {
        let r = s.join().expect("stream thread");
        assert_eq!(r.status, 200, "stream {i}: {}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "stream {i}: {}", r.dump());
        let events = r.sse_events();
        let content = events.iter().filter(|e| e.content().is_some()).count();
        assert_eq!(content, 20, "stream {i}: {}", r.dump());
        assert!(events.last().is_some_and(SseEvent::is_done), "stream {i}");
    }
    let log = gw.stderr_text();
    assert!(
        log.contains("sluice: reload applied (config sha256 "),
        "no reload log line:\n{log}"
    );
}

#[test]
fn an_invalid_config_is_rejected_with_its_errors_and_the_old_one_keeps_serving() {
    let mock = Mock::start(&[]);
    let config = base(&mock).raw(&key_toml("alice", ALICE));
    let gw = Sluice::start(&config);
    // Two errors, both reported: an unknown cluster and a bad timeout.
    let mut broken = config.clone().route("gpt-x", "nowhere");
    broken = broken.timeout("header_read_ms", 0);
    gw.rewrite_config(&broken);
    let r = gw.admin_reload(Some(TOKEN));
    assert_eq!(r.status, 422, "{}", r.dump());
    let body = r.json();
    assert_eq!(body["status"], "rejected", "{body}");
    let errors: Vec<String> = body["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    assert!(
        errors.iter().any(|e| e.contains("routes[1].cluster")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("timeouts.header_read_ms")),
        "{errors:?}"
    );
    assert_eq!(body["config_sha256"].as_str().unwrap().len(), 64);
    // A config file that is gone: rejected as unreadable, with no digest to name.
    std::fs::remove_file(&gw.config_path).unwrap();
    let r = gw.admin_reload(Some(TOKEN));
    assert_eq!(r.status, 500, "{}", r.dump());
    assert!(r.json()["config_sha256"].is_null(), "{}", r.dump());
    assert!(
        gw.wait_stderr(
            Duration::from_secs(5),
            "reload rejected (config file unreadable)"
        ),
        "{}",
        gw.stderr_text()
    );
    gw.rewrite_config(&broken);
    // Service unchanged.
    assert_eq!(chat_as(&gw, ALICE, "gpt-4o").status, 200);
    assert_eq!(chat_as(&gw, ALICE, "gpt-x").status, 404);
    let m = gw.metrics();
    assert_eq!(reloads(&m, "rejected"), 2.0);
    assert_eq!(reloads(&m, "applied"), 0.0);
    assert_eq!(
        m.get("sluice_config_last_reload_successful", &[]),
        Some(0.0)
    );
    assert!(gw.stderr_text().contains("sluice: reload rejected"));

    // Fixed, it applies; the answer says what needs a restart.
    gw.rewrite_config(&config.clone().workers(3).route("gpt-x", "main"));
    let r = gw.admin_reload(Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.dump());
    let body = r.json();
    assert_eq!(body["status"], "applied", "{body}");
    assert_eq!(body["workers"], 1, "{body}");
    assert_eq!(
        body["restart_required"],
        serde_json::json!(["server.workers"])
    );
    assert_eq!(chat_as(&gw, ALICE, "gpt-x").status, 200);
    let m = gw.metrics();
    assert_eq!(
        m.get("sluice_config_last_reload_successful", &[]),
        Some(1.0)
    );
}

#[test]
fn admin_reload_needs_the_bearer_token() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&base(&mock));
    for token in [None, Some("wrong-token-0123456789"), Some("")] {
        let r = gw.admin_reload(token);
        assert_eq!(r.status, 401, "{token:?}: {}", r.dump());
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    assert_eq!(gw.admin_reload(Some(TOKEN)).status, 200);
    assert_eq!(reloads(&gw.metrics(), "applied"), 1.0);
    // GET is not a reload.
    assert_eq!(gw.admin_get("/admin/reload").status, 405);

    // Without admin.token_env there is no reloading over HTTP (SIGHUP still works).
    let gw = Sluice::start(&Config::one_cluster(&mock).admin());
    let r = gw.admin_reload(Some(TOKEN));
    assert_eq!(r.status, 403, "{}", r.dump());
    gw.signal(libc::SIGHUP);
    let m = gw.wait_metrics(Duration::from_secs(10), |m| reloads(m, "applied") == 1.0);
    assert_eq!(reloads(&m, "applied"), 1.0);
}

#[test]
fn limiter_spend_survives_a_reload_that_reorders_policies_and_keys() {
    // An hour window: the test never straddles its edge.
    wait_out_window_edge(3600, 30);
    let mock = Mock::start(&[]);
    let policy = |max: u32| {
        format!(
            "[[policies]]\nid = \"per-key\"\nper = \"key\"\nmax_requests = {max}\nrequests_window_secs = 3600\n"
        )
    };
    let keys = format!("{}{}", key_toml("alice", ALICE), key_toml("bob", BOB));
    let gw = Sluice::start(&base(&mock).raw(&keys).raw(&policy(3)));
    for _ in 0..2 {
        assert_eq!(chat_as(&gw, ALICE, "gpt-4o").status, 200);
    }
    // Reordered: another policy first, bob before alice; alice's limit raised to 4.
    let reordered = format!(
        "{}{}\n[[policies]]\nid = \"everyone\"\nper = \"global\"\nmax_requests = 1000\nrequests_window_secs = 3600\n{}",
        key_toml("bob", BOB),
        key_toml("alice", ALICE),
        policy(4)
    );
    gw.rewrite_config(&base(&mock).raw(&reordered));
    let r = gw.admin_reload(Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.dump());
    // Alice has spent 2 of (now) 4: two more, then refused.
    for i in 3..=4 {
        let r = chat_as(&gw, ALICE, "gpt-4o");
        assert_eq!(r.status, 200, "request {i}: {}", r.dump());
    }
    let r = chat_as(&gw, ALICE, "gpt-4o");
    assert_eq!(r.status, 429, "request 5: {}", r.dump());
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("4"));
    // Bob's own budget is untouched.
    assert_eq!(chat_as(&gw, BOB, "gpt-4o").status, 200);
}

/// A key the reload turns off is refused on a connection that has already used it: the
/// connection remembers the key's digest, never the decision.
#[test]
fn a_key_turned_off_by_a_reload_is_refused_on_a_connection_it_used() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&base(&mock).raw(&key_toml("alice", ALICE)));
    let mut c = gw.conn();
    let mut chat = || {
        c.send(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
                .header("Authorization", &format!("Bearer {ALICE}"))
                .build(),
        );
        c.read_response()
    };
    for i in 0..2 {
        let r = chat();
        assert_eq!(r.status, 200, "request {i}: {}", r.dump());
    }
    gw.rewrite_config(&base(&mock).raw(&format!("{}enabled = false\n", key_toml("alice", ALICE))));
    let r = gw.admin_reload(Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.dump());
    let r = chat();
    assert_eq!(r.status, 401, "{}", r.dump());
    assert_eq!(mock.stat("requests"), 2);
}

#[test]
fn a_reload_can_turn_the_access_log_on() {
    let mock = Mock::start(&[]);
    let logs = TempDir::new("reload-log");
    let gw = Sluice::start(&base(&mock));
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
    assert!(access_log_files(logs.path()).is_empty());
    gw.rewrite_config(&base(&mock).access_log(logs.path()));
    assert_eq!(gw.admin_reload(Some(TOKEN)).status, 200);
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
    let records = wait_records(logs.path(), 1, Duration::from_secs(10));
    assert_eq!(records.len(), 1, "the request after the reload is logged");
}

#[test]
fn a_reload_can_add_limits_to_a_gateway_started_without_any() {
    wait_out_window_edge(3600, 30);
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&base(&mock));
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
    let limited = base(&mock).raw(&key_toml("alice", ALICE)).raw(
        "[[policies]]\nid = \"two\"\nper = \"key\"\nmax_requests = 2\nrequests_window_secs = 3600\n",
    );
    gw.rewrite_config(&limited);
    assert_eq!(gw.admin_reload(Some(TOKEN)).status, 200);
    // The limiter's leases come from the sync task, which runs from the start for this.
    for i in 1..=2 {
        let r = chat_as(&gw, ALICE, "gpt-4o");
        assert_eq!(r.status, 200, "request {i}: {}", r.dump());
    }
    let r = chat_as(&gw, ALICE, "gpt-4o");
    assert_eq!(r.status, 429, "{}", r.dump());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
}
