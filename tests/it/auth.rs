//! API keys (issue #3, point 1): how keys are presented, who gets 401 / 403 / 400, the
//! filtered model list, and what the access log and metrics say about the caller.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

const ALICE: &str = "sk-alice-3c7e1f";
const BOB: &str = "sk-bob-9a0d22";
const OLD: &str = "sk-old-key-77";
const OFF: &str = "sk-disabled-55";

fn keys_toml() -> String {
    format!(
        r#"
[[keys]]
id = "alice"
sha256 = "{}"
entity = "team-a"
tags = ["prod", "gold"]
models_allow = ["mock-*", "gpt-4o"]
models_block = ["mock-secret*"]

[[keys]]
id = "bob"
sha256 = "{}"
entity = "team-b"
source_subnets = ["10.0.0.0/8", "2001:db8::/32"]

[[keys]]
id = "old"
sha256 = "{}"
expires = 2020-01-01T00:00:00Z

[[keys]]
id = "off"
sha256 = "{}"
enabled = false
"#,
        key_hash(ALICE),
        key_hash(BOB),
        key_hash(OLD),
        key_hash(OFF)
    )
}

fn gateway(mock: &Mock) -> Sluice {
    Sluice::start(
        &Config::one_cluster(mock)
            .route("mock-*", "main")
            .raw(&keys_toml()),
    )
}

fn chat_as(gw: &Sluice, headers: &[(&str, &str)], model: &str) -> Response {
    let mut req = Req::post("/v1/chat/completions", &chat_body(model));
    for (k, v) in headers {
        req = req.header(k, v);
    }
    gw.request(&req)
}

fn error_code(r: &Response) -> String {
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["error"]["code"].as_str().unwrap_or("").to_string()
}

#[test]
fn key_hash_prints_sha256() {
    // FIPS 180-2 test vector.
    assert_eq!(
        key_hash("abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn bearer_and_x_api_key_are_both_accepted() {
    let mock = Mock::start(&[]);
    let gw = gateway(&mock);
    let bearer = format!("Bearer {ALICE}");
    let r = chat_as(&gw, &[("authorization", &bearer)], "gpt-4o");
    assert_eq!(r.status, 200, "{}", r.dump());
    let r = chat_as(&gw, &[("x-api-key", ALICE)], "gpt-4o");
    assert_eq!(r.status, 200, "{}", r.dump());
    // The same key twice is one key.
    let r = chat_as(
        &gw,
        &[("authorization", &bearer), ("x-api-key", ALICE)],
        "gpt-4o",
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    // The client's key never reaches the upstream.
    let echo = echo_of(&r);
    let seen: Vec<String> = echo_headers(&echo).into_iter().map(|(k, _)| k).collect();
    assert!(!seen
        .iter()
        .any(|k| k.eq_ignore_ascii_case("authorization") || k.eq_ignore_ascii_case("x-api-key")));
}

#[test]
fn two_different_keys_are_a_bad_request() {
    let mock = Mock::start(&[]);
    let gw = gateway(&mock);
    let before = mock.stat("requests");
    let r = chat_as(
        &gw,
        &[
            ("authorization", &format!("Bearer {ALICE}")),
            ("x-api-key", BOB),
        ],
        "gpt-4o",
    );
    assert_eq!(r.status, 400, "{}", r.dump());
    let r = chat_as(
        &gw,
        &[("x-api-key", ALICE), ("x-api-key", "sk-other")],
        "gpt-4o",
    );
    assert_eq!(r.status, 400, "{}", r.dump());
    assert_eq!(mock.stat("requests"), before, "nothing was forwarded");
}

#[test]
fn unknown_disabled_and_expired_keys_get_the_same_401() {
    let mock = Mock::start(&[]);
    let gw = gateway(&mock);
    let mut bodies = Vec::new();
    for key in ["sk-nobody-123", OLD, OFF] {
        let r = chat_as(
            &gw,
            &[("authorization", &format!("Bearer {key}"))],
            "gpt-4o",
        );
        assert_eq!(r.status, 401, "{}", r.dump());
        assert_eq!(error_code(&r), "invalid_api_key");
        bodies.push((
            r.body.clone(),
            r.header("content-length").map(str::to_string),
        ));
    }
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "bodies differ: {bodies:?}"
    );
    // No key at all says so.
    let r = chat_as(&gw, &[], "gpt-4o");
    assert_eq!(r.status, 401);
    assert_eq!(error_code(&r), "missing_api_key");
    // A non-Bearer scheme carries no key.
    let r = chat_as(&gw, &[("authorization", "Basic YWxpY2U6eA==")], "gpt-4o");
    assert_eq!(r.status, 401);
    assert_eq!(error_code(&r), "missing_api_key");
    assert_eq!(mock.stat("requests"), 0, "nothing was forwarded");
}

/// One kept-alive connection presenting different keys in turn (as a proxy in front pooling
/// its connections does): each request is its own key's, though a connection remembers the
/// digest of the key it presented last.
#[test]
fn keys_taking_turns_on_one_connection_are_each_their_own() {
    let mock = Mock::start(&[]);
    let gw = gateway(&mock);
    let mut c = gw.conn();
    let mut chat = |key: &str, model: &str| {
        c.send(
            &Req::post("/v1/chat/completions", &chat_body(model))
                .header("authorization", &format!("Bearer {key}"))
                .build(),
        );
        c.read_response()
    };
    for round in 0..2 {
        // Alice may use gpt-4o from here; bob only from 10/8, so not from loopback.
        let r = chat(ALICE, "gpt-4o");
        assert_eq!(r.status, 200, "round {round}, alice: {}", r.dump());
        let r = chat(BOB, "gpt-4o");
        assert_eq!(r.status, 403, "round {round}, bob: {}", r.dump());
        assert_eq!(error_code(&r), "source_not_allowed");
        // Alice again, and her own block list: bob's turn left nothing of his behind.
        let r = chat(ALICE, "mock-secret");
        assert_eq!(r.status, 403, "round {round}: {}", r.dump());
        assert_eq!(error_code(&r), "model_not_allowed");
    }
    // A key as long as the last one (bob's) but not it, and a key one byte short of the last
    // one (alice's), are nobody's. A refused key closes its connection: one each.
    assert_eq!(OLD.len(), BOB.len());
    assert_eq!(chat(BOB, "gpt-4o").status, 403);
    let r = chat(OLD, "gpt-4o");
    assert_eq!(r.status, 401, "{}", r.dump());
    assert_eq!(error_code(&r), "invalid_api_key");
    let mut c = gw.conn();
    for (key, status) in [(ALICE, 200), (&ALICE[..ALICE.len() - 1], 401)] {
        c.send(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
                .header("authorization", &format!("Bearer {key}"))
                .build(),
        );
        let r = c.read_response();
        assert_eq!(r.status, status, "{key}: {}", r.dump());
    }
    assert_eq!(
        mock.stat("requests"),
        3,
        "only alice's gpt-4o requests went upstream"
    );
}

#[test]
fn model_lists_decide_403_and_block_wins() {
    let mock = Mock::start(&[]);
    let gw = gateway(&mock);
    let alice = [("x-api-key", ALICE)];
    assert_eq!(chat_as(&gw, &alice, "mock-small").status, 200);
    // Matches the allow glob but also the block glob.
    let r = chat_as(&gw, &alice, "mock-secret-1");
    assert_eq!(r.status, 403, "{}", r.dump());
    assert_eq!(error_code(&r), "model_not_allowed");
    // Routed, but outside the allow list.
    let gw2 = Sluice::start(
        &Config::one_cluster(&mock)
            .route("other-*", "main")
            .raw(&keys_toml()),
    );
    let r = chat_as(&gw2, &alice, "other-model");
    assert_eq!(r.status, 403, "{}", r.dump());
    // A key without lists may use anything routed.
    let r = chat_as(&gw2, &[("x-api-key", BOB)], "other-model");
    assert_eq!(
        r.status,
        403,
        "bob is refused by subnet, not model: {}",
        r.dump()
    );
    assert_eq!(error_code(&r), "source_not_allowed");
}

#[test]
fn source_subnets_are_enforced() {
    let mock = Mock::start(&[]);
    // bob may only come from 10/8 or 2001:db8::/32; the test connects from 127.0.0.1.
    let gw = gateway(&mock);
    let r = chat_as(&gw, &[("x-api-key", BOB)], "gpt-4o");
    assert_eq!(r.status, 403, "{}", r.dump());
    assert_eq!(error_code(&r), "source_not_allowed");
    // Same key, subnets that include loopback (v4 and v6 listeners).
    let toml = keys_toml().replace(
        r#"source_subnets = ["10.0.0.0/8", "2001:db8::/32"]"#,
        r#"source_subnets = ["127.0.0.0/8", "::1/128"]"#,
    );
    let gw = Sluice::start(&Config::one_cluster(&mock).raw(&toml));
    let r = chat_as(&gw, &[("x-api-key", BOB)], "gpt-4o");
    assert_eq!(r.status, 200, "{}", r.dump());
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        let gw6 = Sluice::start(&Config::one_cluster(&mock).listen("[::1]:0").raw(&toml));
        let r = chat_as(&gw6, &[("x-api-key", BOB)], "gpt-4o");
        assert_eq!(r.status, 200, "{}", r.dump());
        let only_v4 = keys_toml().replace(
            r#"source_subnets = ["10.0.0.0/8", "2001:db8::/32"]"#,
            r#"source_subnets = ["127.0.0.0/8"]"#,
        );
        let gw6 = Sluice::start(&Config::one_cluster(&mock).listen("[::1]:0").raw(&only_v4));
        let r = chat_as(&gw6, &[("x-api-key", BOB)], "gpt-4o");
        assert_eq!(r.status, 403, "{}", r.dump());
    }
}

#[test]
fn models_list_shows_what_the_key_may_use() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .route("mock-small", "main")
            .route("mock-secret-x", "main")
            .route("other", "main")
            .raw(&keys_toml()),
    );
    let ids = |r: &Response| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    let r = gw.request(&Req::get("/v1/models").header("x-api-key", ALICE));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(ids(&r), ["gpt-4o", "mock-small"]);
    let r = gw.request(&Req::get("/v1/models"));
    assert_eq!(r.status, 401);
    let toml = keys_toml().replace(r#"source_subnets = ["10.0.0.0/8", "2001:db8::/32"]"#, "");
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .route("mock-small", "main")
            .route("other", "main")
            .raw(&toml),
    );
    let r = gw.request(&Req::get("/v1/models").header("x-api-key", BOB));
    assert_eq!(ids(&r), ["gpt-4o", "mock-small", "other"]);
}

#[test]
fn the_log_and_metrics_name_the_caller() {
    let mock = Mock::start(&[]);
    let dir = TempDir::new("auth-log");
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .admin()
            .access_log(dir.path())
            .access_log_opt("flush_interval_ms", 20)
            .raw(&keys_toml()),
    );
    assert_eq!(chat_as(&gw, &[("x-api-key", ALICE)], "gpt-4o").status, 200);
    // A disabled, an expired and an unknown key: one answer for the three, and the log tells
    // them apart.
    let disabled = chat_as(&gw, &[("x-api-key", OFF)], "gpt-4o");
    let expired = chat_as(&gw, &[("x-api-key", OLD)], "gpt-4o");
    let unknown = chat_as(&gw, &[("x-api-key", "sk-nobody-has-this")], "gpt-4o");
    let missing = chat_as(&gw, &[], "gpt-4o");
    for r in [&disabled, &expired, &unknown, &missing] {
        assert_eq!(r.status, 401, "{}", r.dump());
    }
    assert_eq!(disabled.body, expired.body);
    assert_eq!(disabled.body, unknown.body);
    assert_eq!(
        chat_as(&gw, &[("x-api-key", ALICE)], "mock-secret").status,
        403
    );
    let records = wait_records(dir.path(), 6, Duration::from_secs(10));
    let ok = records.iter().find(|r| r["status"] == 200).unwrap();
    assert_eq!(ok["key_id"], "alice");
    assert_eq!(ok["entity"], "team-a");
    assert_eq!(ok["tags"], serde_json::json!(["prod", "gold"]));
    let reasons: Vec<&str> = records
        .iter()
        .filter(|r| r["status"] == 401)
        .map(|r| r["auth_rejection_reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["disabled_key", "expired_key", "unknown_key", "missing_key"]
    );
    let denied = records.iter().find(|r| r["status"] == 401).unwrap();
    assert_eq!(denied["key_id"], "");
    let forbidden = records.iter().find(|r| r["status"] == 403).unwrap();
    assert_eq!(forbidden["auth_rejection_reason"], "model_not_allowed");
    let m = gw.wait_metrics(Duration::from_secs(5), |m| {
        m.sum("sluice_requests_total", &[("entity", "team-a")]) >= 2.0
    });
    assert_eq!(
        m.sum("sluice_requests_total", &[("entity", "team-a")]),
        2.0,
        "alice's 200 and 403 count under her entity"
    );
}

/// Hostile clients II, item 8: whose word on the client's address Sluice takes. With no
/// `trusted_proxies` a client's `X-Forwarded-For` is a claim nobody reads; with the peer
/// trusted, the header is read from the nearest hop back, and the first untrusted address is
/// the client for the key's subnets and the access log.
#[test]
fn a_trusted_proxys_forwarded_for_names_the_client_and_nobody_elses_does() {
    let mock = Mock::start(&[]);
    let log = TempDir::new("real-ip");
    let bob = |gw: &Sluice, xff: Option<&str>, header: &str| {
        let mut headers = vec![("x-api-key", BOB)];
        if let Some(v) = xff {
            headers.push((header, v));
        }
        chat_as(gw, &headers, "gpt-4o").status
    };
    // The default: 127.0.0.1 is the client whatever it claims (bob may come from 10/8 only).
    let gw = gateway(&mock);
    assert_eq!(bob(&gw, Some("10.1.2.3"), "x-forwarded-for"), 403);
    drop(gw);

    let trusting = Config::one_cluster(&mock)
        .set("server", "trusted_proxies", r#"["127.0.0.0/8", "::1/128"]"#)
        .access_log(log.path())
        .access_log_opt("flush_interval_ms", 50)
        .raw(&keys_toml());
    let gw = Sluice::start(&trusting);
    assert_eq!(bob(&gw, Some("10.1.2.3"), "x-forwarded-for"), 200);
    // The nearest untrusted hop decides, not the client's own claim to its left.
    assert_eq!(
        bob(&gw, Some("10.1.2.3, 192.0.2.1"), "x-forwarded-for"),
        403
    );
    assert_eq!(
        bob(&gw, Some("192.0.2.1, 10.1.2.3"), "x-forwarded-for"),
        200
    );
    // A trusted proxy that names nobody: it is the client.
    assert_eq!(bob(&gw, None, "x-forwarded-for"), 403);
    // Another header than the configured one is not read.
    assert_eq!(bob(&gw, Some("10.1.2.3"), "x-real-ip"), 403);
    let records = wait_records(log.path(), 5, Duration::from_secs(5));
    let addrs: Vec<&str> = records
        .iter()
        .map(|r| r["client_addr"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(addrs[0], "10.1.2.3:0", "{addrs:?}");
    assert_eq!(addrs[1], "192.0.2.1:0", "{addrs:?}");
    assert!(addrs[3].starts_with("127.0.0.1:"), "{addrs:?}");
    drop(gw);

    let gw = Sluice::start(
        &trusting
            .clone()
            .set("server", "real_ip_header", r#""X-Real-IP""#),
    );
    assert_eq!(bob(&gw, Some("10.9.9.9"), "x-real-ip"), 200);
    assert_eq!(bob(&gw, Some("10.9.9.9"), "x-forwarded-for"), 403);
}
