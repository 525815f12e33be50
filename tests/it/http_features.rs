//! HTTP/1.1 features (issue point 3): chunked uploads, Expect: 100-continue, HEAD, methods.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

#[test]
fn chunked_upload_reaches_upstream_intact() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let body = json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "x".repeat(5000)}],
        "temperature": 0.25
    })
    .to_string();
    let b = body.as_bytes();
    let mut c = gw.conn();
    c.send(
        &Req::post("/v1/chat/completions", "")
            .no_length()
            .header("Transfer-Encoding", "chunked")
            .build_head(),
    );
    // Uneven chunks, sent with pauses so they arrive in separate reads.
    let cuts = [0, 1, 17, 1000, 4096, b.len()];
    for w in cuts.windows(2) {
        c.send(&format!("{:x}\r\n", w[1] - w[0]).into_bytes());
        c.send(&b[w[0]..w[1]]);
        c.send(b"\r\n");
        std::thread::sleep(Duration::from_millis(10));
    }
    c.send(b"0\r\n\r\n");
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(echo["body"].as_str().unwrap(), body);
    // The connection stays usable.
    c.send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build());
    assert_eq!(c.read_response().status, 200);
}

#[test]
fn chunked_upload_with_trailer_section_is_accepted() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let body = chat_body("gpt-4o");
    let mut c = gw.conn();
    let mut raw = Req::post("/v1/chat/completions", "")
        .no_length()
        .header("Transfer-Encoding", "chunked")
        .build_head();
    raw.extend(format!("{:x}\r\n{body}\r\n0\r\nX-Trailer: t\r\n\r\n", body.len()).into_bytes());
    c.send(&raw);
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(echo_of(&r)["body"].as_str().unwrap(), body);
}

#[test]
fn expect_100_continue() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let body = chat_body("gpt-4o");
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    c.send(
        &Req::post("/v1/chat/completions", &body)
            .header("Expect", "100-continue")
            .build_head(),
    );
    let interim = c
        .read_head()
        .expect("no 100 Continue before the body was sent");
    assert_eq!(interim.status, 100, "{interim:?}");
    assert_eq!(interim.version, "HTTP/1.1");
    c.send(body.as_bytes());
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(echo_of(&r)["body"].as_str().unwrap(), body);
}

#[test]
fn expect_100_continue_with_too_large_body_is_413_without_continue() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).http("max_body_bytes", 1024));
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    c.send(
        &Req::post("/v1/chat/completions", "")
            .no_length()
            .header("Content-Length", "100000")
            .header("Expect", "100-continue")
            .build_head(),
    );
    let head = c.read_head().expect("no answer");
    assert_eq!(
        head.status, 413,
        "expected 413 instead of 100 Continue: {head:?}"
    );
    let r = c.read_body(head, "POST");
    assert_openai_error(&r, 413);
}

#[test]
fn head_models_has_headers_only() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let get = gw.get("/v1/models");
    assert_eq!(get.status, 200);
    let mut c = gw.conn();
    c.send(&Req::new("HEAD", "/v1/models").build());
    let r = c.read_response_to("HEAD");
    assert_eq!(r.status, 200, "{}", r.dump());
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .starts_with("application/json"));
    if let Some(cl) = r.header("content-length") {
        assert_eq!(
            cl,
            get.body.len().to_string(),
            "HEAD Content-Length differs from GET's"
        );
    }
    // No body bytes may follow: the next response on the connection must parse cleanly.
    c.send(&Req::get("/v1/models").build());
    let next = c.read_response();
    assert_eq!(next.status, 200, "{}", next.dump());
    assert_eq!(next.body, get.body);
}

#[test]
fn wrong_method_on_proxied_path_is_405() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut counter = mock.request_counter();
    for (method, path) in [
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/completions"),
        ("DELETE", "/v1/embeddings"),
        ("GET", "/v1/responses"),
        ("POST", "/v1/models"),
    ] {
        let req = if method == "POST" {
            Req::post(path, &chat_body("gpt-4o"))
        } else {
            Req::new(method, path)
        };
        let r = gw.request(&req);
        assert_openai_error(&r, 405);
    }
    assert_eq!(counter.delta(), 0);
}

#[test]
fn status_405_carries_allow_header() {
    // RFC 9110 15.5.6: a 405 response MUST carry Allow.
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let r = gw.get("/v1/chat/completions");
    assert_eq!(r.status, 405, "{}", r.dump());
    let allow = r
        .header("allow")
        .unwrap_or_else(|| panic!("no Allow header:\n{}", r.dump()));
    assert!(allow.to_ascii_uppercase().contains("POST"), "{allow}");
}

#[test]
fn upstream_204_is_relayed_without_body_and_connection_stays_usable() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("x-mock-status", "204")
            .build(),
    );
    let r = c.read_response();
    assert_eq!(r.status, 204, "{}", r.dump());
    assert!(r.header("transfer-encoding").is_none(), "{}", r.dump());
    // Nothing may follow the 204 head: the next answer must parse cleanly.
    c.send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build());
    let next = c.read_response();
    assert_eq!(next.status, 200, "{}", next.dump());
    assert_eq!(next.json()["object"], "chat.completion");
}

#[test]
fn upstream_304_is_relayed_without_body_and_both_connections_stay_usable() {
    // The mock's 304 carries the Content-Length of the body it replaces but no body (RFC 9110
    // §8.6, §15.4.5): sluice must frame it by its status and not wait for those bytes.
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).workers(1));
    let mut probe = mock.stats_probe();
    let before = probe.stat("connections_accepted");
    let mut c = gw.conn();
    c.set_timeout(Duration::from_secs(5));
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("x-mock-status", "304")
            .build(),
    );
    let r = c.read_response();
    assert_eq!(r.status, 304, "{}", r.dump());
    assert!(r.header("transfer-encoding").is_none(), "{}", r.dump());
    assert!(!r.header_has_token("connection", "close"), "{}", r.dump());
    // No body bytes may follow the 304 head.
    assert_eq!(
        c.wait_close(Duration::from_millis(200)),
        CloseState::Open,
        "bytes or a close followed the 304 head"
    );
    c.send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build());
    let next = c.read_response();
    assert_eq!(next.status, 200, "{}", next.dump());
    assert_eq!(next.json()["object"], "chat.completion");
    // The 304 ended cleanly upstream too: the second request reused the upstream connection.
    assert_eq!(
        probe.stat("connections_accepted") - before,
        1,
        "the upstream connection was not reused after the 304"
    );
}

/// Hostile clients II, item 5: headers a `Connection` field names are for one hop only (RFC
/// 9110 §7.6.1). The client's are not forwarded upstream, the upstream's are not relayed to the
/// client; headers nobody named go through, and the connection stays alive.
#[test]
fn headers_named_in_connection_stop_at_the_hop_both_ways() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut c = gw.conn();
    for _ in 0..2 {
        let req = Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("connection", "keep-alive, x-hop-secret")
            .header("x-hop-secret", "for-sluice-only")
            .header("x-end-to-end", "for-the-upstream")
            .header("x-mock-connection-option", "x-upstream-hop");
        c.send(&req.build());
        let r = c.read_response_to("POST");
        assert_eq!(r.status, 200, "{}", r.dump());
        let seen: Vec<String> = echo_headers(&echo_of(&r))
            .into_iter()
            .map(|(k, _)| k.to_ascii_lowercase())
            .collect();
        assert!(!seen.contains(&"x-hop-secret".to_string()), "{seen:?}");
        assert!(seen.contains(&"x-end-to-end".to_string()), "{seen:?}");
        assert_eq!(r.header("x-upstream-hop"), None, "{}", r.dump());
        assert!(
            !r.header("connection")
                .unwrap_or("")
                .contains("x-upstream-hop"),
            "{}",
            r.dump()
        );
        assert!(r.header("x-mock-model").is_some(), "{}", r.dump());
    }
}

/// A gateway of one cluster whose `pass_response_headers` is `pass` (`None`: not set, so
/// Sluice's default list).
fn passing(mock: &Mock, pass: Option<&[&str]>, extra: &str) -> Sluice {
    let mut cluster = Cluster::new("main", &[&mock.base_url()]);
    cluster.pass_response_headers = pass.map(|p| p.iter().map(|s| s.to_string()).collect());
    Sluice::start(
        &Config::new()
            .cluster(cluster)
            .route("gpt-4o", "main")
            .raw(extra),
    )
}

fn with_provider_fields(gw: &Sluice, key: Option<&str>) -> Response {
    let mut req = Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
        .header("x-mock-headers", "provider");
    if let Some(key) = key {
        req = req.header("authorization", &format!("Bearer {key}"));
    }
    let r = gw.request(&req);
    assert_eq!(r.status, 200, "{}", r.dump());
    r
}

#[test]
fn a_providers_account_and_site_headers_stop_at_the_gateway() {
    let mock = Mock::start(&[]);
    // The default list: what describes the answer and what an SDK reads passes; the provider's
    // account, cookies and site policy do not.
    let gw = passing(&mock, None, "");
    for stream in [false, true] {
        let body = if stream {
            chat_stream_body("gpt-4o")
        } else {
            chat_body("gpt-4o")
        };
        let r = gw.request(
            &Req::post("/v1/chat/completions", &body).header("x-mock-headers", "provider"),
        );
        assert_eq!(r.status, 200, "{}", r.dump());
        for kept in [
            "x-request-id",
            "openai-processing-ms",
            "openai-version",
            "date",
            "content-type",
        ] {
            assert!(
                r.header(kept).is_some(),
                "{kept} missing (stream {stream}): {}",
                r.dump()
            );
        }
        for dropped in [
            "set-cookie",
            "openai-organization",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-limit-requests",
            "strict-transport-security",
            "alt-svc",
            "server",
            "cf-ray",
            "access-control-expose-headers",
            "x-mock-model",
        ] {
            assert_eq!(
                r.header(dropped),
                None,
                "{dropped} (stream {stream}): {}",
                r.dump()
            );
        }
    }
    drop(gw);

    // `*` passes them all — but the provider's rate limits never sit beside Sluice's own.
    let key = "sk-pass-everything";
    let keyed = format!(
        "[[keys]]\nid = \"k\"\nsha256 = \"{}\"\n\n[[policies]]\nid = \"rpm\"\nper = \"key\"\nmax_requests = 100\nrequests_window_secs = 60\n",
        key_hash(key)
    );
    let gw = passing(&mock, Some(&["*"]), "");
    let r = with_provider_fields(&gw, None);
    assert!(r.header("set-cookie").is_some(), "{}", r.dump());
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some("29999968"),
        "{}",
        r.dump()
    );
    assert!(r.header("x-mock-model").is_some(), "{}", r.dump());
    drop(gw);
    let gw = passing(&mock, Some(&["*"]), &keyed);
    let r = with_provider_fields(&gw, Some(key));
    assert!(r.header("set-cookie").is_some(), "{}", r.dump());
    assert_eq!(
        r.header("x-ratelimit-limit-requests"),
        Some("100"),
        "Sluice's own: {}",
        r.dump()
    );
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        None,
        "{}",
        r.dump()
    );
    assert_eq!(r.header("x-ratelimit-reset-tokens"), None, "{}", r.dump());
    drop(gw);

    // A list of its own, with `default` and a prefix.
    let gw = passing(&mock, Some(&["default", "X-Ratelimit-*"]), "");
    let r = with_provider_fields(&gw, None);
    assert!(r.header("x-request-id").is_some(), "{}", r.dump());
    assert_eq!(
        r.header("x-ratelimit-reset-requests"),
        Some("6ms"),
        "{}",
        r.dump()
    );
    assert_eq!(r.header("set-cookie"), None, "{}", r.dump());
}

#[test]
fn a_bad_pass_list_is_a_config_error() {
    let mock = Mock::start(&[]);
    let mut cluster = Cluster::new("main", &[&mock.base_url()]);
    cluster.pass_response_headers = Some(vec!["x y".into()]);
    let Err(failure) = Sluice::try_start(&Config::new().cluster(cluster).route("gpt-4o", "main"))
    else {
        panic!("a config with a bad pass list started");
    };
    assert!(
        failure
            .stderr
            .contains("clusters.main.pass_response_headers"),
        "{}",
        failure.stderr
    );
}

#[test]
fn a_key_in_the_query_string_never_reaches_the_provider() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    for (target, forwarded) in [
        (
            "/v1/chat/completions?key=sk-client-secret&api-version=2024-10-21",
            "/v1/chat/completions?api-version=2024-10-21",
        ),
        (
            "/v1/chat/completions?API-KEY=sk-client-secret&access_token=t0k",
            "/v1/chat/completions",
        ),
        ("/v1/chat/completions?x=1&y", "/v1/chat/completions?x=1&y"),
    ] {
        let r = gw.request(&Req::post(target, &chat_body("gpt-4o")));
        assert_eq!(r.status, 200, "{}", r.dump());
        let echo = echo_of(&r);
        assert_eq!(echo["path"], forwarded, "{target}");
        assert!(!echo.to_string().contains("sk-client-secret"), "{echo}");
    }
}

#[test]
fn a_clients_claims_of_where_it_is_are_not_forwarded() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("X-Forwarded-For", "203.0.113.7")
            .header("x-real-ip", "203.0.113.7")
            .header("Forwarded", "for=203.0.113.7;proto=https")
            .header("x-forwarded-proto", "https")
            .header("x-forwarded-host", "bank.example")
            .header("x-kept", "yes"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let seen: Vec<String> = echo_headers(&echo_of(&r))
        .into_iter()
        .map(|(k, _)| k.to_ascii_lowercase())
        .collect();
    assert!(seen.contains(&"x-kept".to_string()), "{seen:?}");
    for claim in [
        "x-forwarded-for",
        "x-real-ip",
        "forwarded",
        "x-forwarded-proto",
        "x-forwarded-host",
    ] {
        assert!(
            !seen.contains(&claim.to_string()),
            "{claim} forwarded: {seen:?}"
        );
    }
}
