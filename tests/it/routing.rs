//! OpenAI surface (point 4), routing / model mapping / credentials (point 6) as seen by
//! mock-llm, and `sluice check`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

const SECRET: &str = "sk-upstream-secret-7f3a9c";

fn names(echo: &serde_json::Value, name: &str) -> Vec<String> {
    echo_headers(echo)
        .into_iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v)
        .collect()
}

// ----- mapping -----

#[test]
fn mapped_model_reaches_upstream_and_rest_of_body_is_byte_identical() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).map("gpt-4o", "mock-small"));
    // Odd spacing, key order, escapes and number formats must all survive untouched.
    let body = "{ \"messages\" : [ {\"role\":\"user\",\"content\":\"h\\u00e9llo \\\"q\\\"\\n\u{4e2d}\"} ],\n\t\"model\" :  \"gpt-4o\" , \"temperature\": 0.50, \"top_p\":1e0, \"max_tokens\":100,\"stop\":null }";
    let r = gw.chat(body);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.header("x-mock-model"), Some("mock-small"));
    let echo = echo_of(&r);
    assert_eq!(echo["model"], "mock-small");
    let expected = body.replace("\"gpt-4o\"", "\"mock-small\"");
    assert_eq!(echo["body"].as_str().unwrap(), expected);
    assert_eq!(echo["path"], "/v1/chat/completions");
    assert_eq!(echo["method"], "POST");
}

#[test]
fn unmapped_model_body_is_forwarded_byte_for_byte() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).route("mock-*", "main"));
    let body =
        "{\"model\":\"mock-large\",  \"messages\":[{\"role\":\"user\",\"content\":\"\\u0041\"}]}";
    let r = gw.chat(body);
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(echo["model"], "mock-large");
    assert_eq!(echo["body"].as_str().unwrap(), body);
}

#[test]
fn mapping_applies_to_streams() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).map("gpt-4o", "mock-small"));
    let body = chat_stream_body("gpt-4o");
    let r = gw.chat(&body);
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(echo["model"], "mock-small");
    // Byte for byte but for the model and the stream usage Sluice asks for by default
    // (`upstream.request_stream_usage`, see stream_usage.rs).
    let mapped = body.replace("\"gpt-4o\"", "\"mock-small\"");
    assert_eq!(
        echo["body"].as_str().unwrap(),
        mapped.replacen('{', "{\"stream_options\":{\"include_usage\":true},", 1)
    );
}

#[test]
fn every_openai_endpoint_is_proxied_by_model() {
    let mock = Mock::start(&["--tokens", "2"]);
    let gw = Sluice::start(&Config::one_cluster(&mock).map("gpt-4o", "mock-small"));
    let cases = [
        (
            "/v1/chat/completions",
            chat_body("gpt-4o"),
            "chat.completion",
        ),
        (
            "/v1/completions",
            json!({"model":"gpt-4o","prompt":"hi"}).to_string(),
            "text_completion",
        ),
        (
            "/v1/embeddings",
            json!({"model":"gpt-4o","input":"hi"}).to_string(),
            "list",
        ),
        (
            "/v1/responses",
            json!({"model":"gpt-4o","input":"hi"}).to_string(),
            "response",
        ),
    ];
    for (path, body, object) in cases {
        let r = gw.post(path, &body);
        assert_eq!(r.status, 200, "{path}: {}", r.dump());
        let v = r.json();
        assert_eq!(v["object"], object, "{path}: {v}");
        assert_eq!(v["echo"]["path"], path);
        assert_eq!(v["echo"]["model"], "mock-small", "{path}");
    }
}

// ----- credentials -----

#[test]
fn a_clients_accept_encoding_never_reaches_the_upstream_so_answers_stay_meterable() {
    // SDKs send `Accept-Encoding: gzip` by default; a compressed answer could be neither metered
    // (usage) nor relayed as events.
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("Accept-Encoding", "gzip, deflate, br"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert!(names(&echo, "accept-encoding").is_empty(), "{echo}");
    assert!(r.header("content-encoding").is_none());
}

#[test]
fn authorization_credential_is_injected_and_client_auth_dropped() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .credential("UP_KEY", "authorization")
            .env("UP_KEY", SECRET),
    );
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("Authorization", "Bearer client-own-key")
            .header("x-api-key", "client-own-x-key"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(
        names(&echo, "authorization"),
        vec![format!("Bearer {SECRET}")]
    );
    assert!(names(&echo, "x-api-key").is_empty(), "{echo}");
    let all = echo["headers"].to_string();
    assert!(
        !all.contains("client-own"),
        "client credential forwarded: {all}"
    );
}

#[test]
fn x_api_key_credential_is_injected_raw_and_client_auth_dropped() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .credential("UP_KEY", "x-api-key")
            .env("UP_KEY", SECRET),
    );
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("Authorization", "Bearer client-own-key")
            .header("X-Api-Key", "client-own-x-key"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(names(&echo, "x-api-key"), vec![SECRET.to_string()]);
    assert!(names(&echo, "authorization").is_empty(), "{echo}");
    assert!(!echo["headers"].to_string().contains("client-own"));
}

#[test]
fn without_credential_client_auth_is_not_forwarded() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
            .header("Authorization", "Bearer client-own-key")
            .header("x-api-key", "client-own-x-key"),
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    let echo = echo_of(&r);
    assert!(names(&echo, "authorization").is_empty(), "{echo}");
    assert!(names(&echo, "x-api-key").is_empty(), "{echo}");
}

#[test]
fn credential_never_appears_in_sluice_responses_or_logs() {
    let mock = Mock::start(&[]);
    let mut dead = Cluster::new("dead", &[&format!("http://127.0.0.1:{}/v1", dead_port())]);
    dead.credential = Some(("UP_KEY".into(), "authorization".into()));
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .credential("UP_KEY", "authorization")
            .env("UP_KEY", SECRET)
            .cluster(dead)
            .route("dead-model", "dead")
            .timeout("upstream_first_byte_ms", 300),
    );
    let responses = vec![
        gw.chat(&chat_body("no-such-model")),
        gw.chat("{not json"),
        gw.get("/v1/nothing-here"),
        gw.get("/v1/chat/completions"),
        gw.chat(&chat_body("dead-model")),
        gw.request(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o"))
                .header("x-mock-delay-ms", "2000"),
        ),
        gw.get("/v1/models"),
    ];
    for r in &responses {
        assert!(r.status >= 200, "{}", r.dump());
        assert!(
            !r.dump().contains(SECRET),
            "credential leaked:\n{}",
            r.dump()
        );
    }
    // Proxied answers: the mock echoes the request headers, credential included, in its body
    // (the upstream's doing, relayed verbatim), but nothing Sluice adds -- the head -- may
    // carry it.
    let proxied = [
        gw.chat(&chat_body("gpt-4o")),
        gw.chat(&chat_stream_body("gpt-4o")),
        gw.request(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-status", "500"),
        ),
        gw.request(
            &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-status", "401"),
        ),
    ];
    assert_eq!(proxied[0].status, 200);
    for r in &proxied {
        for (k, v) in &r.headers {
            assert!(
                !v.contains(SECRET) && !k.contains(SECRET),
                "credential in header {k}: {v}"
            );
        }
    }
    assert!(
        !gw.stderr_text().contains(SECRET),
        "credential in sluice's log output"
    );
}

// ----- routes -----

fn tokens_of(r: &Response) -> u64 {
    assert_eq!(r.status, 200, "{}", r.dump());
    r.json()["usage"]["completion_tokens"].as_u64().unwrap()
}

#[test]
fn glob_routes_most_specific_wins() {
    // Each cluster's mock answers with a different number of tokens, identifying it.
    let a = Mock::start(&["--tokens", "1"]);
    let b = Mock::start(&["--tokens", "2"]);
    let c = Mock::start(&["--tokens", "3"]);
    let cfg = Config::new()
        .cluster(Cluster::new("a", &[&a.base_url()]))
        .cluster(Cluster::new("b", &[&b.base_url()]))
        .cluster(Cluster::new("c", &[&c.base_url()]))
        // Less specific first: order must not decide, specificity must.
        .route("gpt-*", "a")
        .route("gpt-4o*", "b")
        .route("gpt-4o-mini*", "b")
        .route("claude-*", "a")
        .route("*-sonnet", "b")
        .route("gpt-4o-mini", "c");
    let gw = Sluice::start(&cfg);
    let cases = [
        ("gpt-4o-mini", 3),    // exact beats every glob
        ("gpt-4o-mini-2", 2),  // gpt-4o-mini* (11 literals) over gpt-4o* and gpt-*
        ("gpt-4o-2024", 2),    // gpt-4o* over gpt-*
        ("gpt-3.5-turbo", 1),  // only gpt-*
        ("claude-sonnet", 1),  // tie claude-* / *-sonnet (7 literals each): first listed
        ("mistral-sonnet", 2), // only *-sonnet
    ];
    for (model, tokens) in cases {
        let r = gw.chat(&chat_body(model));
        assert_eq!(
            tokens_of(&r),
            tokens,
            "model {model} went to the wrong cluster"
        );
        assert_eq!(r.header("x-mock-model"), Some(model));
    }
    let r = gw.chat(&chat_body("mistral"));
    let err = assert_openai_error(&r, 404);
    assert_eq!(err["code"], "model_not_found");
}

#[test]
fn models_endpoint_lists_every_name_that_routes_in_openai_format() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .route("gpt-4o-mini", "main")
            .route("mock-*", "main")
            .map("text-embedding-3-small", "mock-embed")
            // Mapped to a name no route matches: the upstream name is not offered.
            .map("gpt-4o-mini", "upstream-only-name")
            .raw(
                r#"
[[routes]]
model = "llama-*"
cluster = "main"
models = ["llama-3.1-8b", "llama-3.1-70b"]
"#,
            ),
    );
    let r = gw.get("/v1/models");
    assert_eq!(r.status, 200, "{}", r.dump());
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "list", "{v}");
    let data = v["data"].as_array().expect("data array");
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    // Exact routes, a glob route's declared models, and model_map names (both sides) that a
    // route matches — `mock-embed` through `mock-*` — sorted, each once.
    assert_eq!(
        ids,
        [
            "gpt-4o",
            "gpt-4o-mini",
            "llama-3.1-70b",
            "llama-3.1-8b",
            "mock-embed",
            "text-embedding-3-small"
        ],
        "{v}"
    );
    for m in data {
        assert_eq!(m["object"], "model", "{m}");
        assert!(m["created"].is_u64(), "created must be an integer: {m}");
        assert!(m["owned_by"].is_string(), "owned_by must be a string: {m}");
    }
    // Every listed name is really served.
    for id in ids {
        let r = gw.post("/v1/chat/completions", &chat_body(id));
        assert_eq!(r.status, 200, "{id}: {}", r.dump());
    }
}

#[test]
fn a_glob_route_declares_only_models_it_matches() {
    let mock = Mock::start(&[]);
    let out = Sluice::check(&Config::one_cluster(&mock).raw(
        r#"
[[routes]]
model = "llama-*"
cluster = "main"
models = ["llama-3", "mistral-7b"]

[[routes]]
model = "exact-name"
cluster = "main"
models = ["exact-name"]
"#,
    ));
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routes[1].models[1]"), "{err}");
    assert!(err.contains("`mistral-7b` does not match"), "{err}");
    assert!(err.contains("routes[2].models"), "{err}");
    assert!(!err.contains("llama-3`"), "{err}");
}

#[test]
fn unknown_paths_are_404() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let mut counter = mock.request_counter();
    let body = chat_body("gpt-4o");
    for req in [
        Req::get("/"),
        Req::get("/v2/models"),
        Req::post("/v1/chat/completion", &body),
        Req::post("/v1/chat/completions/extra", &body),
        Req::post("/v1/images/generations", &body),
        Req::get("/_mock/stats"),
    ] {
        let r = gw.request(&req);
        assert_openai_error(&r, 404);
    }
    assert_eq!(counter.delta(), 0, "an unknown path reached the upstream");
}

// ----- sluice check -----

#[test]
fn check_reports_every_error_with_key_paths() {
    let dir = TempDir::new("check");
    let path = dir.write(
        "bad.toml",
        r#"
[server]
listen = "not-an-address"
workers = 1

[clusters.main]
backends = [ { base_url = "ftp://127.0.0.1:1/v1", weight = 1 } ]

[[routes]]
model = "gpt-4o"
cluster = "no-such-cluster"
"#,
    );
    let out = Sluice::check_file(&path, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(!stdout.contains("config ok") && !stderr.contains("config ok"));
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert!(
        errors.len() >= 3,
        "expected all three errors at once:\n{stderr}"
    );
    let has = |needles: &[&str]| errors.iter().any(|l| needles.iter().all(|n| l.contains(n)));
    assert!(
        has(&["server.listen"]),
        "no error for server.listen:\n{stderr}"
    );
    assert!(
        has(&["clusters.main.backends", "base_url"]),
        "no error for the backend url:\n{stderr}"
    );
    assert!(
        has(&["routes", "cluster"]),
        "no error for the unknown route cluster:\n{stderr}"
    );
}

#[test]
fn check_rejects_unknown_keys() {
    let dir = TempDir::new("check");
    let path = dir.write(
        "bad.toml",
        "[server]\nlisten = \"127.0.0.1:0\"\nworkerz = 2\n",
    );
    let out = Sluice::check_file(&path, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("error: ") && l.contains("workerz")),
        "{stderr}"
    );
}

#[test]
fn check_reports_errors_of_every_section_with_line_and_column() {
    let dir = TempDir::new("check");
    let path = dir.write(
        "bad.toml",
        r#"[server]
listen = "127.0.0.1:0"
workers = "two"

[clusters.main]
backends = [ { base_url = "ftp://127.0.0.1:1/v1" } ]

[[routes]]
model = "gpt-4o"
cluster = "main"
colour = "red"
"#,
    );
    let out = Sluice::check_file(&path, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    // One parse reports all three, in file order, each with its key path, line and column.
    assert_eq!(
        lines[..3],
        [
            r#"error: server.workers (line 3, column 11): invalid type: string "two", expected a whole number ≥ 0"#,
            "error: clusters.main.backends[0].base_url (line 6, column 27): \
             `ftp://127.0.0.1:1/v1` must start with http:// or https://",
            "error: routes[0].colour (line 11, column 1): unknown field `colour`, expected one of \
             `model`, `cluster`, `groups`, `sticky`, `models`, `keys`, `entities`, `class`",
        ],
        "{stderr}"
    );
    assert!(lines[3].ends_with("bad.toml: 3 error(s)"), "{stderr}");
}

#[test]
fn check_warns_of_an_unknown_credential_header_and_passes() {
    let dir = TempDir::new("check");
    let text = r#"[clusters.main]
backends = [ { base_url = "http://127.0.0.1:9/v1" } ]
credential = { env = "SLUICE_TEST_KEY", header = "authorisation" }

[[routes]]
model = "*"
cluster = "main"
"#;
    let env = [("SLUICE_TEST_KEY".to_string(), "sk-test".to_string())];
    let path = dir.write("warn.toml", text);
    let out = Sluice::check_file(&path, &env);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("config ok"));
    assert!(
        stderr.lines().any(|l| l.starts_with(
            "warning: clusters.main.credential.header (line 3, column 50): `authorisation` is \
             not a known credential header"
        )),
        "{stderr}"
    );
    // Said to be meant: no warning.
    let path = dir.write(
        "meant.toml",
        text.replace(
            r#"header = "authorisation""#,
            r#"header = "authorisation", allow_custom_header = true"#,
        ),
    );
    let out = Sluice::check_file(&path, &env);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
}

#[test]
fn check_accepts_a_valid_config() {
    let cfg = Config::backend_url("http://127.0.0.1:9/v1")
        .map("gpt-4o", "mock-small")
        .route("mock-*", "main")
        .timeout("header_read_ms", 500);
    let out = Sluice::check(&cfg);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{all}\n{}", cfg.to_toml());
    assert!(all.contains("config ok"), "{all}");
}

#[test]
fn check_accepts_the_example_config() {
    let path = workspace_root().join("conf/sluice.toml");
    let out = Sluice::check_file(&path, &[]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(all.contains("config ok"), "{all}");
}

/// The shipped config has no live key, only a commented example with a placeholder: once
/// uncommented and filled in it is valid; uncommented with the placeholder, `check` refuses it.
#[test]
fn the_example_key_is_valid_once_filled_in_and_refused_with_its_placeholder() {
    let text = std::fs::read_to_string(workspace_root().join("conf/sluice.toml")).unwrap();
    assert!(
        !text.lines().any(|l| l.trim_start().starts_with("[[keys]]")),
        "conf/sluice.toml ships a live [[keys]] table"
    );
    let (head, rest) = text
        .split_once("# --- example key: begin ---\n")
        .expect("the example key's begin marker");
    let (block, tail) = rest
        .split_once("# --- example key: end ---\n")
        .expect("the example key's end marker");
    let uncommented: String = block
        .lines()
        .map(|l| l.strip_prefix("# ").unwrap_or(l))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(uncommented.contains("[[keys]]"), "{uncommented}");
    let check = |config: String| {
        let dir = TempDir::new("example-key");
        let out = Sluice::check_file(&dir.write("sluice.toml", config), &[]);
        (
            out.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (code, all) = check(format!("{head}{uncommented}{tail}"));
    assert_eq!(code, Some(1), "the placeholder was accepted:\n{all}");
    assert!(all.contains("keys[0].sha256"), "{all}");
    let filled = uncommented.replace(
        "<the sha256 line of `sluice key new`>",
        &key_hash("sk-example"),
    );
    let (code, all) = check(format!("{head}{filled}{tail}"));
    assert_eq!(code, Some(0), "{all}\n{filled}");
    assert!(all.contains("config ok"), "{all}");
    assert!(!all.contains("warning"), "{all}");

    // Filled in, the example key serves the README's requests (gpt-4o-mini, whole and
    // streamed) through the shipped config, on free ports, with a mock-llm upstream.
    let mock = Mock::start(&[]);
    let shipped = format!("{head}{filled}{tail}")
        .replace("listen = \"127.0.0.1:8080\"", "listen = \"127.0.0.1:0\"")
        .replace("listen = \"127.0.0.1:9090\"", "listen = \"127.0.0.1:0\"")
        .replace("http://127.0.0.1:9000/v1", &mock.base_url());
    let gw = Sluice::start(&Config::from_text(&shipped));
    for stream in [false, true] {
        let body = json!({"model": "gpt-4o-mini", "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]});
        let r = gw.request(
            &Req::post("/v1/chat/completions", &body.to_string())
                .header("authorization", "Bearer sk-example"),
        );
        assert_eq!(r.status, 200, "stream {stream}: {}", r.dump());
    }

    // `check` warns of a key already expired and of a placeholder digest (all zeros).
    let expired = filled.replace(
        "# expires = 2030-01-01T00:00:00Z",
        "expires = 2020-01-01T00:00:00Z #",
    );
    let (code, all) = check(format!("{head}{expired}{tail}"));
    assert_eq!(code, Some(0), "{all}");
    assert!(
        all.contains("keys[0].expires") && all.contains("expired on 2020-01-01"),
        "{all}"
    );
    let zeros = uncommented.replace("<the sha256 line of `sluice key new`>", &"0".repeat(64));
    let (code, all) = check(format!("{head}{zeros}{tail}"));
    assert_eq!(code, Some(0), "{all}");
    assert!(
        all.contains("keys[0].sha256") && all.contains("placeholder digest"),
        "{all}"
    );
}

#[test]
fn invalid_config_refuses_to_start() {
    let cfg = Config::backend_url("http://127.0.0.1:9/v1").route("x", "no-such-cluster");
    let f = Sluice::try_start_within(&cfg, Duration::from_secs(10))
        .err()
        .expect("sluice started with an invalid config");
    assert!(f.exited, "sluice neither started nor exited: {}", f.stderr);
    assert_ne!(f.code, Some(0));
    assert!(f.stderr.contains("routes"), "{}", f.stderr);
}

/// Three deployments: `global` for everyone, `team` for team-a's keys, `own` for carol's own.
fn scoped_routes(global: &Mock, team: &Mock, own: &Mock) -> Config {
    Config::new()
        .cluster(Cluster::new("global", &[&global.base_url()]))
        .cluster(Cluster::new("team", &[&team.base_url()]))
        .cluster(Cluster::new("own", &[&own.base_url()]))
        .raw(&format!(
            r#"
[[routes]]
model = "gpt-4o"
cluster = "global"

[[routes]]
model = "gpt-*"
entities = ["team-a"]
groups = [{{ targets = [{{ cluster = "team", model = "team-model" }}] }}]

[[routes]]
model = "gpt-4o"
keys = ["carol"]
cluster = "own"

[[routes]]
model = "carol-special"
keys = ["carol"]
cluster = "own"

[[keys]]
id = "alice"
sha256 = "{}"
entity = "team-a"

[[keys]]
id = "carol"
sha256 = "{}"
entity = "team-a"

[[keys]]
id = "bob"
sha256 = "{}"
entity = "team-b"
"#,
            key_hash("sk-alice"),
            key_hash("sk-carol"),
            key_hash("sk-bob"),
        ))
}

fn chat_as(gw: &Sluice, key: &str, model: &str) -> Response {
    gw.request(
        &Req::post("/v1/chat/completions", &chat_body(model))
            .header("authorization", &format!("Bearer {key}")),
    )
}

#[test]
fn a_keys_own_route_wins_then_its_entitys_then_the_global_one() {
    let (global, team, own) = (Mock::start(&[]), Mock::start(&[]), Mock::start(&[]));
    let gw = Sluice::start(&scoped_routes(&global, &team, &own));

    // bob (team-b): the global route.
    let r = chat_as(&gw, "sk-bob", "gpt-4o");
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.header("x-mock-model"), Some("gpt-4o"));
    assert_eq!(global.stat("requests"), 1);
    // alice (team-a): her entity's glob route wins over the global exact one.
    let r = chat_as(&gw, "sk-alice", "gpt-4o");
    assert_eq!(r.header("x-mock-model"), Some("team-model"), "{}", r.dump());
    assert_eq!(team.stat("requests"), 1);
    // carol (team-a too): her own route wins over her entity's.
    let r = chat_as(&gw, "sk-carol", "gpt-4o");
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(own.stat("requests"), 1);
    assert_eq!(team.stat("requests"), 1);
    // A model only carol's route knows is not found for anyone else.
    assert_eq!(chat_as(&gw, "sk-carol", "carol-special").status, 200);
    let e = assert_openai_error(&chat_as(&gw, "sk-alice", "carol-special"), 404);
    assert_eq!(e["code"], "model_not_found", "{e}");
    // The entity's glob serves alice's other gpt-* names; bob has no route for them.
    assert_eq!(chat_as(&gw, "sk-alice", "gpt-4.1").status, 200);
    assert_eq!(team.stat("requests"), 2);
    assert_openai_error(&chat_as(&gw, "sk-bob", "gpt-4.1"), 404);
    assert_eq!(global.stat("requests"), 1);

    // /v1/models: each key sees the names that route for it.
    let listed = |key: &str| -> Vec<String> {
        let r =
            gw.request(&Req::get("/v1/models").header("authorization", &format!("Bearer {key}")));
        assert_eq!(r.status, 200, "{}", r.dump());
        let mut ids: Vec<String> = r.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(listed("sk-bob"), ["gpt-4o"]);
    assert_eq!(listed("sk-alice"), ["gpt-4o"]);
    assert_eq!(listed("sk-carol"), ["carol-special", "gpt-4o"]);
}

#[test]
fn check_rejects_route_scopes_naming_nobody_or_both_or_twice() {
    let out = Sluice::check(
        &Config::new()
            .cluster(Cluster::new("a", &["http://127.0.0.1:9/v1"]))
            .raw(&format!(
                r#"
[[routes]]
model = "m"
cluster = "a"

[[routes]]
model = "m"
keys = ["nobody"]
cluster = "a"

[[routes]]
model = "n"
entities = ["no-team"]
cluster = "a"

[[routes]]
model = "o"
keys = ["k"]
entities = ["t"]
cluster = "a"

[[routes]]
model = "p"
keys = ["k"]
cluster = "a"

[[routes]]
model = "p"
keys = ["k"]
cluster = "a"

[[keys]]
id = "k"
sha256 = "{}"
entity = "t"
"#,
                key_hash("sk-k")
            )),
    );
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    for (path, message) in [
        ("routes[1].keys[0] (", "no key has id `nobody`"),
        ("routes[2].entities[0] (", "no key has entity `no-team`"),
        (
            "routes[3].entities (",
            "a route is for `keys` or for `entities`, not both",
        ),
        (
            "routes[5].model (",
            "`p` is already routed for key `k` by routes[4]",
        ),
    ] {
        assert!(
            text.lines()
                .any(|l| l.contains(path) && l.contains(message)),
            "missing {path} {message:?} in:\n{text}"
        );
    }
    assert!(text.contains("4 error(s)"), "{text}");
    // A global route and a key's own route for one model are not a clash.
    assert!(!text.contains("routes[1].model"), "{text}");
}
