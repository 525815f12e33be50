//! Self-checks of the test harness against mock-llm alone (no gateway): the client's framing,
//! SSE timing and stats helpers must be right before the gateway tests can mean anything. They
//! double as checks of mock-llm's contract (bench/MOCK_LLM.md).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::*;

#[test]
fn mock_echoes_request_and_keeps_alive() {
    let mock = Mock::start(&["--tokens", "3"]);
    let mut c = Conn::open(mock.addr);
    let body = chat_body("mock-small");
    for _ in 0..3 {
        c.send(
            &Req::post("/v1/chat/completions", &body)
                .header("X-Probe", "1")
                .build(),
        );
        let r = c.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
        assert!(matches!(r.framing, Framing::Length(_)));
        assert_eq!(r.header("x-mock-model"), Some("mock-small"));
        let echo = echo_of(&r);
        assert_eq!(echo["body"].as_str().unwrap(), body);
        assert_eq!(echo["model"], "mock-small");
        assert!(echo_headers(&echo)
            .iter()
            .any(|(k, v)| k == "x-probe" && v == "1"));
        assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    }
}

#[test]
fn stats_probe_and_request_counter() {
    let mock = Mock::start(&[]);
    let mut probe = mock.stats_probe();
    let before = probe.stat("connections_accepted");
    let mut counter = mock.request_counter();
    assert_eq!(counter.delta(), 0);
    let mut c = Conn::open(mock.addr);
    for _ in 0..2 {
        c.send(&Req::post("/v1/chat/completions", &chat_body("m")).build());
        assert_eq!(c.read_response().status, 200);
    }
    assert_eq!(counter.delta(), 2);
    // The counter's own probe connection + the client's.
    assert_eq!(probe.stat("connections_accepted") - before, 2);
}

#[test]
fn chunked_sse_is_timestamped_per_event() {
    let mock = Mock::start(&["--inter-token-ms", "100", "--tokens", "4"]);
    let mut c = Conn::open(mock.addr);
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("m")).build());
    let r = c.read_response();
    assert_eq!(r.status, 200);
    assert_eq!(r.framing, Framing::Chunked);
    assert_eq!(r.end, BodyEnd::Complete);
    let ev = r.sse_events();
    let content: Vec<_> = ev.iter().filter(|e| e.content().is_some()).collect();
    assert_eq!(content.len(), 4, "{}", r.dump());
    for w in content.windows(2) {
        let gap = w[1].at.duration_since(w[0].at);
        assert!(gap >= Duration::from_millis(80), "{gap:?}");
    }
    assert!(ev.last().unwrap().is_done());
    assert!(ev[0].comments.iter().any(|c| c.starts_with("echo ")));
    assert_eq!(echo_of(&r)["model"], "m");
}

#[test]
fn chunk_extensions_and_trailers_parse() {
    let mock = Mock::start(&["--tokens", "2"]);
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_stream_body("m"))
            .header("x-mock-fault", "chunk-ext")
            .build(),
    );
    let r = c.read_response();
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    assert!(!r.trailers.is_empty(), "mock sent no trailer");
    assert!(r.sse_events().last().unwrap().is_done());
}

#[test]
fn close_delimited_reads_to_eof() {
    let mock = Mock::start(&[]);
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("m"))
            .header("x-mock-fault", "close-delimited")
            .build(),
    );
    let r = c.read_response();
    assert_eq!(r.framing, Framing::Close);
    assert_eq!(r.end, BodyEnd::Complete);
    assert_eq!(r.json()["object"], "chat.completion");
}

#[test]
fn malformed_chunk_is_detected() {
    let mock = Mock::start(&["--tokens", "4"]);
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_stream_body("m"))
            .header("x-mock-fault", "malformed-chunk")
            .build(),
    );
    let r = c.read_response();
    assert!(matches!(r.end, BodyEnd::Malformed(_)), "{:?}", r.end);
}

#[test]
fn drop_mid_stream_is_truncated() {
    let mock = Mock::start(&["--tokens", "4"]);
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_stream_body("m"))
            .header("x-mock-fault", "drop-mid-stream")
            .build(),
    );
    let r = c.read_response();
    assert!(
        matches!(r.end, BodyEnd::Truncated | BodyEnd::Reset),
        "{:?}",
        r.end
    );
}

#[test]
fn delay_and_status_controls() {
    let mock = Mock::start(&[]);
    let start = std::time::Instant::now();
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("m"))
            .header("x-mock-delay-ms", "300")
            .header("x-mock-status", "429")
            .build(),
    );
    let r = c.read_response();
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert_openai_error(&r, 429);
    assert!(r.header("retry-after").is_some());
}

#[test]
fn abort_is_counted() {
    let mock = Mock::start(&["--inter-token-ms", "30", "--tokens", "100"]);
    let mut c = Conn::open(mock.addr);
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("m")).build());
    assert_eq!(c.read_head().unwrap().status, 200);
    assert!(wait_until(Duration::from_secs(2), || mock
        .stat("active_streams")
        == 1));
    drop(c);
    assert!(wait_until(Duration::from_secs(2), || {
        let s = mock.stats();
        s["active_streams"] == 0 && s["streams_aborted"] == 1
    }));
}

#[test]
fn close_detection() {
    let mock = Mock::start(&[]);
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("m"))
            .header("Connection", "close")
            .build(),
    );
    assert_eq!(c.read_response().status, 200);
    c.assert_closed(Duration::from_secs(2));
    let mut open = Conn::open(mock.addr);
    assert_eq!(
        open.wait_close(Duration::from_millis(200)),
        CloseState::Open
    );
}

#[test]
fn config_toml_shape() {
    let mock = Mock::start(&[]);
    let toml = Config::one_cluster(&mock)
        .map("gpt-4o", "mock-small")
        .credential("UP_KEY", "authorization")
        .timeout("header_read_ms", 300)
        .http("max_headers", 20)
        .to_toml();
    for needle in [
        "[server]",
        "listen = \"127.0.0.1:0\"",
        "[timeouts]\nheader_read_ms = 300",
        "[http]\nmax_headers = 20",
        "[clusters.main]",
        &format!("base_url = \"http://{}/v1\"", mock.addr),
        "model_map = { \"gpt-4o\" = \"mock-small\" }",
        "credential = { env = \"UP_KEY\", header = \"authorization\" }",
        "[[routes]]\nmodel = \"gpt-4o\"\ncluster = \"main\"",
    ] {
        assert!(toml.contains(needle), "{needle:?} not in:\n{toml}");
    }
    let s =
        Startup::parse("sluice: listening on 127.0.0.1:4242 (workers=3, driver=legacy)").unwrap();
    assert_eq!(s.addr.port(), 4242);
    assert_eq!(s.workers, 3);
    assert_eq!(s.driver, "legacy");
}

#[test]
fn mock_204_and_304_carry_no_body() {
    let mock = Mock::start(&[]);
    let mut c = Conn::open(mock.addr);
    for status in ["204", "304"] {
        c.send(
            &Req::post("/v1/chat/completions", &chat_body("m"))
                .header("x-mock-status", status)
                .build(),
        );
        let head = c.read_head().unwrap();
        assert_eq!(head.status.to_string(), status, "{head:?}");
        assert!(head.header("transfer-encoding").is_none(), "{head:?}");
        assert!(head.header("connection").is_none(), "{head:?}");
        match status {
            // 204: no Content-Length at all.
            "204" => assert!(head.header("content-length").is_none(), "{head:?}"),
            // 304: the replaced body's length, but none of its bytes.
            _ => assert!(
                head.header("content-length")
                    .is_some_and(|v| v.parse::<u64>().unwrap() > 0),
                "{head:?}"
            ),
        }
        assert_eq!(
            c.wait_close(Duration::from_millis(200)),
            CloseState::Open,
            "bytes or a close followed the {status} head"
        );
    }
    // The connection is still in step.
    c.send(&Req::post("/v1/chat/completions", &chat_body("m")).build());
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.json()["object"], "chat.completion");
}

#[test]
fn mock_idle_close_ms_closes_idle_keep_alive_connections_silently() {
    let mock = Mock::start(&["--idle-close-ms", "150"]);
    // A connection used more often than every 150 ms stays open past it.
    let mut busy = Conn::open(mock.addr);
    let start = std::time::Instant::now();
    let mut last = None;
    for _ in 0..6 {
        busy.send(&Req::post("/v1/chat/completions", &chat_body("m")).build());
        let r = busy.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
        assert!(!r.header_has_token("connection", "close"), "{}", r.dump());
        last = Some(std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(start.elapsed() >= Duration::from_millis(300));
    // Then, left idle, it is closed without a word (no `Connection: close` was sent), roughly
    // 150 ms after its last response.
    busy.assert_closed(Duration::from_secs(2));
    let idle = last.unwrap().elapsed();
    assert!(idle >= Duration::from_millis(140), "closed after {idle:?}");
    // So is a connection that never sends a request.
    let mut silent = Conn::open(mock.addr);
    silent.assert_closed(Duration::from_secs(2));
    let s = mock.stats();
    assert_eq!(s["idle_closed"], 2, "{s}");
    assert_eq!(s["requests"], 6, "{s}");
}

#[test]
fn prometheus_parser_reads_labels_escapes_and_rejects_malformed_lines() {
    let text = "# HELP a_total Things.\n# TYPE a_total counter\n\
                a_total{x=\"1\",y=\"q\\\"\\\\\\n\"} 3\n\
                h_bucket{le=\"+Inf\"} 2\nh_sum 0.25\ng -1.5e-3 1700000000\nempty{} 0\n";
    let m = Metrics::parse(text).expect("valid exposition");
    assert_eq!(m.type_of("a_total"), Some("counter"));
    assert_eq!(m.get("a_total", &[("x", "1")]), Some(3.0));
    assert_eq!(m.samples[0].label("y"), Some("q\"\\\n"));
    assert_eq!(m.get("h_bucket", &[("le", "+Inf")]), Some(2.0));
    assert_eq!(m.get("h_sum", &[]), Some(0.25));
    assert_eq!(m.get("g", &[]), Some(-1.5e-3));
    assert_eq!(m.get("empty", &[]), Some(0.0));
    assert_eq!(m.sum("a_total", &[]), 3.0);
    assert_eq!(m.get("a_total", &[("x", "2")]), None);
    for bad in [
        "a 1",                    // no final newline
        "a{x=1} 1\n",             // unquoted label value
        "a{x=\"1\" 1\n",          // unterminated label set
        "a{x=\"1\",x=\"2\"} 1\n", // duplicate label
        "a{x=\"\\t\"} 1\n",       // bad escape
        "a{1x=\"1\"} 1\n",        // bad label name
        "1a 1\n",                 // bad metric name
        "a one\n",                // bad value
        "a 1 2 3\n",              // trailing field
        "a\n",                    // no value
        "# TYPE a countr\n",      // unknown type
    ] {
        assert!(Metrics::parse(bad).is_err(), "accepted {bad:?}");
    }
}

#[test]
fn admin_startup_line_is_parsed() {
    assert_eq!(
        parse_admin_line("sluice: admin listening on 127.0.0.1:9464 (/metrics, /healthz, /readyz)"),
        Some("127.0.0.1:9464".parse().unwrap())
    );
    assert_eq!(
        parse_admin_line("sluice: listening on 127.0.0.1:1 (workers=1, driver=legacy)"),
        None
    );
}

#[test]
fn redis_starts_answers_and_comes_back_on_the_same_port() {
    let mut redis = Redis::start();
    redis.cmd(&["SET", "k", "v"]).assert_ok();
    assert_eq!(redis.cmd(&["GET", "k"]).as_str().as_deref(), Some("v"));
    assert_eq!(
        redis.cmd(&["HSET", "h", "a", "1", "b", "2"]).as_int(),
        Some(2)
    );
    let owned = |p: &[(&str, &str)]| -> Vec<(String, String)> {
        p.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    assert_eq!(redis.hgetall("h"), owned(&[("a", "1"), ("b", "2")]));
    assert_eq!(redis.keys("*"), ["h", "k"]);
    assert!(matches!(redis.cmd(&["NOSUCHCOMMAND"]), RespValue::Error(_)));
    assert!(redis.cmd(&["GET", "missing"]).is_nil());
    let before = redis.commands_processed();
    redis.cmd(&["PING"]);
    // The PING and the second INFO.
    assert_eq!(redis.commands_processed() - before, 2);
    assert_eq!(
        redis.info_field("persistence", "aof_enabled").as_deref(),
        Some("0")
    );

    let (port, pid) = (redis.port, redis.pid().unwrap());
    redis.kill();
    assert!(!redis.is_running());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert!(redis.try_cmd(&["PING"]).is_err(), "killed redis answered");
    redis.restart();
    assert_eq!(redis.port, port);
    assert_ne!(redis.pid(), Some(pid));
    // Not persisted: the data went with the process.
    assert!(redis.cmd(&["GET", "k"]).is_nil());
    redis.cmd(&["SET", "k", "again"]).assert_ok();
    // A pipelined batch on a connection of its own.
    let mut c = redis.client();
    let replies = c
        .pipeline(&[&["INCRBY", "n", "2"], &["INCRBY", "n", "3"], &["GET", "k"]])
        .unwrap();
    assert_eq!(replies[1].as_int(), Some(5));
    assert_eq!(replies[2].as_str().as_deref(), Some("again"));
}

#[test]
fn redis_with_aof_keeps_acknowledged_writes_across_a_crash() {
    let mut redis = Redis::start_with_aof();
    assert_eq!(
        redis.info_field("persistence", "aof_enabled").as_deref(),
        Some("1")
    );
    redis.cmd(&["SET", "k", "kept"]).assert_ok();
    redis.cmd(&["HINCRBY", "h", "f", "7"]);
    redis.kill();
    redis.restart();
    assert_eq!(redis.cmd(&["GET", "k"]).as_str().as_deref(), Some("kept"));
    assert_eq!(redis.hgetall("h"), [("f".to_string(), "7".to_string())]);
    let pid = redis.pid().unwrap();
    drop(redis);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "redis outlived its guard"
    );
}

#[test]
fn mock_counts_requests_in_flight_and_the_usage_it_reported() {
    let mock = Mock::start(&["--tokens", "3"]);
    // Three requests held 300 ms at once.
    let mut conns: Vec<Conn> = (0..3).map(|_| Conn::open(mock.addr)).collect();
    for c in &mut conns {
        c.send(
            &Req::post("/v1/chat/completions", &chat_body("m"))
                .header("x-mock-delay-ms", "300")
                .build(),
        );
    }
    assert!(wait_until(Duration::from_secs(2), || mock
        .stat("active_requests")
        == 3));
    let mut prompt = 0;
    for c in &mut conns {
        let r = c.read_response();
        assert_eq!(r.status, 200, "{}", r.dump());
        prompt += r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    let s = mock.stats();
    assert_eq!(s["active_requests"], 0, "{s}");
    assert_eq!(s["max_active_requests"], 3, "{s}");
    assert_eq!(s["usage_prompt_tokens"], prompt, "{s}");
    assert_eq!(s["usage_completion_tokens"], 9, "{s}");
    let s = mock.reset_peak();
    assert_eq!(s["max_active_requests"], 0, "{s}");

    // A stream reports usage only when asked; errors report none.
    let mut c = Conn::open(mock.addr);
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("m")).build());
    assert_eq!(c.read_response().status, 200);
    let asked =
        json!({"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[]});
    c.send(&Req::post("/v1/completions", &asked.to_string()).build());
    let r = c.read_response();
    let usage = r
        .sse_events()
        .iter()
        .filter_map(|e| e.json())
        .find(|v| v["choices"] == json!([]))
        .expect("usage chunk")["usage"]
        .clone();
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("m"))
            .header("x-mock-status", "500")
            .build(),
    );
    assert_eq!(c.read_response().status, 500);
    let s = mock.stats();
    assert_eq!(s["include_usage_requests"], 1, "{s}");
    assert_eq!(s["usage_chunks"], 1, "{s}");
    assert_eq!(
        s["usage_prompt_tokens"].as_u64().unwrap(),
        prompt + usage["prompt_tokens"].as_u64().unwrap(),
        "{s}"
    );
    assert_eq!(s["usage_completion_tokens"], 12, "{s}");
    assert_eq!(s["max_active_requests"], 1, "{s}");
}

/// A request to `path` with `body` and `headers`, on a fresh connection to `mock`.
fn ask(mock: &Mock, path: &str, body: &str, headers: &[(&str, &str)]) -> Response {
    let mut req = Req::post(path, body);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let mut c = Conn::open(mock.addr);
    c.send(&req.build());
    c.read_response()
}

/// The events of a stream that carry data (not the `: echo` comment).
fn data_events(r: &Response) -> Vec<SseEvent> {
    r.sse_events()
        .into_iter()
        .filter(|e| !e.data.is_empty())
        .collect()
}

fn is_finish(e: &SseEvent) -> bool {
    e.json()
        .is_some_and(|v| v["choices"][0]["finish_reason"] == "stop")
}

#[test]
fn mock_drop_before_response_reads_the_request_then_closes_without_a_byte() {
    let mock = Mock::start(&[]);
    for body in [chat_body("m"), chat_stream_body("m")] {
        let mut c = Conn::open(mock.addr);
        c.send(
            &Req::post("/v1/chat/completions", &body)
                .header("x-mock-fault", "drop-before-response")
                .build(),
        );
        let got = c.read_head();
        assert!(
            matches!(got, Err(ReadError::Closed | ReadError::Reset)),
            "expected a close without a byte, got {got:?}"
        );
    }
    // After x-mock-delay-ms, not before.
    let start = std::time::Instant::now();
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_body("m"))
            .header("x-mock-fault", "drop-before-response")
            .header("x-mock-delay-ms", "300")
            .build(),
    );
    let got = c.read_head();
    assert!(
        matches!(got, Err(ReadError::Closed | ReadError::Reset)),
        "{got:?}"
    );
    assert!(start.elapsed() >= Duration::from_millis(290));
    let s = mock.stats();
    assert_eq!(s["dropped_before_response"], 3, "{s}");
    assert_eq!(s["requests"], 3, "{s}");
    // No head was sent, so no stream began.
    assert_eq!(s["streams_started"], 0, "{s}");
    assert_eq!(s["active_requests"], 0, "{s}");
}

#[test]
fn mock_stall_never_answers_and_holds_the_connection_until_the_client_leaves() {
    let mock = Mock::start(&[]);
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_stream_body("m"))
            .header("x-mock-fault", "stall")
            .build(),
    );
    assert_eq!(c.wait_close(Duration::from_millis(500)), CloseState::Open);
    // A request pipelined behind it is not answered either.
    c.send(&Req::post("/v1/chat/completions", &chat_body("m")).build());
    assert_eq!(c.wait_close(Duration::from_millis(300)), CloseState::Open);
    let s = mock.stats();
    assert_eq!(s["stalled"], 1, "{s}");
    assert_eq!(s["active_requests"], 1, "{s}");
    assert_eq!(s["requests"], 1, "{s}");
    assert_eq!(s["streams_started"], 0, "{s}");
    // The client gives up: the mock lets go of the request and the connection.
    drop(c);
    assert!(wait_until(Duration::from_secs(2), || {
        let s = mock.stats();
        // The stats request's own connection is the one left open.
        s["active_requests"] == 0 && s["connections_open"] == 1
    }));
}

#[test]
fn mock_error_statuses_carry_retry_after_and_tell_a_quota_429_from_a_rate_limit() {
    let mock = Mock::start(&[]);
    let chat =
        |headers: &[(&str, &str)]| ask(&mock, "/v1/chat/completions", &chat_body("m"), headers);
    // A rate limit, worded as OpenAI words it.
    let r = chat(&[("x-mock-status", "429")]);
    let e = assert_openai_error(&r, 429);
    assert_eq!(e["code"], "rate_limit_exceeded", "{}", r.dump());
    assert_eq!(e["type"], "requests", "{}", r.dump());
    assert_eq!(r.header("retry-after"), Some("1"));
    // A spend limit: the same status, told apart by the body alone.
    for headers in [
        &[("x-mock-fault", "quota")][..],
        &[
            ("x-mock-status", "429"),
            ("x-mock-error-code", "insufficient_quota"),
        ],
    ] {
        let r = chat(headers);
        let e = assert_openai_error(&r, 429);
        assert_eq!(e["code"], "insufficient_quota", "{}", r.dump());
        assert_eq!(e["type"], "insufficient_quota", "{}", r.dump());
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .starts_with("You exceeded your current quota"),
            "{}",
            r.dump()
        );
    }
    // 503 and 529 carry Retry-After too; a 529 is an overload error.
    let r = chat(&[("x-mock-status", "503"), ("x-mock-retry-after", "7")]);
    assert_openai_error(&r, 503);
    assert_eq!(r.header("retry-after"), Some("7"));
    let r = chat(&[("x-mock-fault", "status=529")]);
    let e = assert_openai_error(&r, 529);
    assert_eq!(e["type"], "overloaded_error", "{}", r.dump());
    assert_eq!(r.json()["type"], "error", "{}", r.dump());
    assert_eq!(r.header("retry-after"), Some("1"));
    // `none` leaves the header out.
    let r = chat(&[("x-mock-status", "503"), ("x-mock-retry-after", "none")]);
    assert_openai_error(&r, 503);
    assert!(r.header("retry-after").is_none(), "{}", r.dump());
    // Other statuses have none; x-mock-error-code sets any error's code.
    let r = chat(&[
        ("x-mock-status", "500"),
        ("x-mock-error-code", "engine_dead"),
    ]);
    assert_eq!(assert_openai_error(&r, 500)["code"], "engine_dead");
    assert!(r.header("retry-after").is_none(), "{}", r.dump());
    // A streaming request gets the error as a JSON answer, not a stream.
    let r = ask(
        &mock,
        "/v1/chat/completions",
        &chat_stream_body("m"),
        &[("x-mock-fault", "quota")],
    );
    assert_eq!(assert_openai_error(&r, 429)["code"], "insufficient_quota");
    let s = mock.stats();
    assert_eq!(s["errors_injected"], 8, "{s}");
    assert_eq!(s["streams_started"], 0, "{s}");

    // The same per process.
    let quota = Mock::start(&["--fault", "quota", "--retry-after", "30"]);
    let r = ask(&quota, "/v1/chat/completions", &chat_body("m"), &[]);
    assert_eq!(assert_openai_error(&r, 429)["code"], "insufficient_quota");
    assert_eq!(r.header("retry-after"), Some("30"));
    let busy = Mock::start(&[
        "--fault",
        "status=503",
        "--retry-after",
        "none",
        "--error-code",
        "busy",
    ]);
    let r = ask(&busy, "/v1/embeddings", "{}", &[]);
    assert_eq!(assert_openai_error(&r, 503)["code"], "busy");
    assert!(r.header("retry-after").is_none(), "{}", r.dump());
}

#[test]
fn mock_die_after_cuts_a_stream_after_n_content_events() {
    let mock = Mock::start(&["--tokens", "6"]);
    // More than --tokens: all the content, then the cut, before the finish.
    for (n, content) in [(0, 0), (2, 2), (9, 6)] {
        let spec = format!("die-after={n}");
        let r = ask(
            &mock,
            "/v1/chat/completions",
            &chat_stream_body("m"),
            &[("x-mock-fault", &spec)],
        );
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_eq!(r.framing, Framing::Chunked);
        assert!(
            matches!(r.end, BodyEnd::Truncated | BodyEnd::Reset),
            "{spec}: {:?}",
            r.end
        );
        let ev = data_events(&r);
        let got = ev.iter().filter(|e| e.content().is_some()).count();
        assert_eq!(got, content, "{spec}: {}", r.dump());
        assert!(
            !ev.iter().any(|e| e.is_done() || is_finish(e)),
            "{spec}: {}",
            r.dump()
        );
    }
    // A non-streaming request is answered as usual.
    let r = ask(
        &mock,
        "/v1/chat/completions",
        &chat_body("m"),
        &[("x-mock-fault", "die-after=1")],
    );
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete);
    let s = mock.stats();
    assert_eq!(s["streams_cut"], 3, "{s}");
    // Cut on purpose: completed, not aborted by the client.
    assert_eq!(s["streams_completed"], 3, "{s}");

    // Per process, on the Responses API too.
    let mock = Mock::start(&["--tokens", "4", "--fault", "die-after=1"]);
    let body = json!({"model": "m", "stream": true, "input": "hi"}).to_string();
    let r = ask(&mock, "/v1/responses", &body, &[]);
    assert!(
        matches!(r.end, BodyEnd::Truncated | BodyEnd::Reset),
        "{:?}",
        r.end
    );
    let ev = data_events(&r);
    assert_eq!(ev.iter().filter(|e| e.content().is_some()).count(), 1);
    assert!(!ev
        .iter()
        .any(|e| e.event.as_deref() == Some("response.completed")));
}

#[test]
fn mock_error_event_is_the_first_data_event_or_follows_n_content_events() {
    let mock = Mock::start(&["--tokens", "4"]);
    // Chat and completions: the first data event is the error, then [DONE].
    let completions = json!({"model": "m", "stream": true, "prompt": "hi"}).to_string();
    for (path, body) in [
        ("/v1/chat/completions", chat_stream_body("m")),
        ("/v1/completions", completions),
    ] {
        let r = ask(&mock, path, &body, &[("x-mock-fault", "error-event")]);
        assert_eq!(r.status, 200, "{}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
        let ev = data_events(&r);
        assert_eq!(ev.len(), 2, "{path}: {}", r.dump());
        assert!(ev[0].is_error(), "{path}: {}", r.dump());
        assert_eq!(ev[0].json().unwrap()["error"]["code"], "mock_error_event");
        assert!(ev[1].is_done());
    }
    // After N content events, with the code asked for.
    let r = ask(
        &mock,
        "/v1/chat/completions",
        &chat_stream_body("m"),
        &[
            ("x-mock-fault", "error-event=2"),
            ("x-mock-error-code", "engine_overloaded"),
        ],
    );
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let ev = data_events(&r);
    let error_at = ev.iter().position(SseEvent::is_error).expect("error event");
    let content_before = ev[..error_at]
        .iter()
        .filter(|e| e.content().is_some())
        .count();
    assert_eq!(content_before, 2, "{}", r.dump());
    assert_eq!(
        ev[error_at].json().unwrap()["error"]["code"],
        "engine_overloaded"
    );
    assert!(ev.last().unwrap().is_done());
    assert!(!ev.iter().any(is_finish), "{}", r.dump());
    // The Responses API's own error event, and no [DONE] (its streams have none).
    let body = json!({"model": "m", "stream": true, "input": "hi"}).to_string();
    for (spec, content) in [("error-event", 0), ("error-event=1", 1)] {
        let r = ask(&mock, "/v1/responses", &body, &[("x-mock-fault", spec)]);
        assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
        let ev = data_events(&r);
        let last = ev.last().unwrap();
        assert_eq!(last.event.as_deref(), Some("error"), "{}", r.dump());
        let v = last.json().unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["code"], "server_error");
        let got = ev.iter().filter(|e| e.content().is_some()).count();
        assert_eq!(got, content, "{spec}: {}", r.dump());
        assert!(!ev.iter().any(SseEvent::is_done), "{}", r.dump());
    }
    assert_eq!(mock.stat("error_events"), 5);
}

#[test]
fn mock_process_fault_switches_at_run_time_and_spares_the_mock_endpoints() {
    let mock = Mock::start(&["--fault", "status=503"]);
    let chat =
        |headers: &[(&str, &str)]| ask(&mock, "/v1/chat/completions", &chat_body("m"), headers);
    assert_eq!(mock.fault(), json!({"fault": "status=503"}));
    assert_eq!(chat(&[]).status, 503);
    // One request can opt out of the process fault.
    assert_eq!(chat(&[("x-mock-fault", "none")]).status, 200);
    // The backend recovers...
    assert_eq!(mock.set_fault(None), json!({"fault": null}));
    assert_eq!(chat(&[]).status, 200);
    // ...and fails again, another way.
    assert_eq!(
        mock.set_fault(Some("drop-before-response")),
        json!({"fault": "drop-before-response"})
    );
    let mut c = Conn::open(mock.addr);
    c.send(&Req::post("/v1/chat/completions", &chat_body("m")).build());
    let got = c.read_head();
    assert!(
        matches!(got, Err(ReadError::Closed | ReadError::Reset)),
        "{got:?}"
    );
    // A request still stalled keeps stalling after the fault is cleared; new ones are answered.
    mock.set_fault(Some("stall"));
    let mut stalled = Conn::open(mock.addr);
    stalled.send(&Req::post("/v1/chat/completions", &chat_body("m")).build());
    assert!(wait_until(Duration::from_secs(2), || mock.stat("stalled") == 1));
    mock.set_fault(None);
    assert_eq!(chat(&[]).status, 200);
    assert_eq!(
        stalled.wait_close(Duration::from_millis(200)),
        CloseState::Open
    );

    // The mock's own endpoints answer whatever the fault, keep-alive included.
    let mut probe = mock.stats_probe();
    for spec in [
        "stall",
        "drop-before-response",
        "status=500",
        "close-delimited",
        "close-after",
        "die-after=0",
    ] {
        assert_eq!(mock.set_fault(Some(spec))["fault"], spec);
        assert_eq!(mock.fault()["fault"], spec);
        probe.stats();
        mock.metrics();
        mock.queue();
    }
    // A SPEC it doesn't know is refused and changes nothing.
    for bad in [r#"{"fault":"sometimes"}"#, r#"{"falt":null}"#, "not json"] {
        let r = mock.control(Req::post("/_mock/fault", bad));
        assert_openai_error(&r, 400);
    }
    assert_eq!(mock.fault()["fault"], "die-after=0");
    // An unknown mock endpoint is a 404, not a fault.
    assert_openai_error(&mock.control(Req::get("/_mock/nope")), 404);
    let s = mock.stats();
    // Only the provider requests count.
    assert_eq!(s["requests"], 6, "{s}");
    assert_eq!(s["dropped_before_response"], 1, "{s}");
    assert_eq!(s["errors_injected"], 1, "{s}");
}

#[test]
fn mock_max_running_queues_requests_first_come_first_served_and_metrics_count_them() {
    let mock = Mock::start(&["--max-running", "1"]);
    let send = |delay: &str| {
        let mut c = Conn::open(mock.addr);
        c.send(
            &Req::post("/v1/chat/completions", &chat_body("m"))
                .header("x-mock-delay-ms", delay)
                .build(),
        );
        c
    };
    let start = std::time::Instant::now();
    let mut a = send("400");
    assert!(wait_until(Duration::from_secs(2), || mock.queue()
        ["running"]
        == 1));
    let mut b = send("300");
    assert!(wait_until(Duration::from_secs(2), || mock.queue()
        ["waiting"]
        == 1));
    let mut c = send("0");
    assert!(wait_until(Duration::from_secs(2), || mock.queue()
        ["waiting"]
        == 2));
    let m = mock.metrics();
    let model = [("model_name", "mock-model")];
    assert_eq!(m.get("vllm:num_requests_running", &model), Some(1.0));
    assert_eq!(m.get("vllm:num_requests_waiting", &model), Some(2.0));
    assert_eq!(m.get("vllm:kv_cache_usage_perc", &model), Some(1.0));
    assert_eq!(m.get("sglang:num_running_reqs", &model), Some(1.0));
    assert_eq!(m.get("sglang:num_queue_reqs", &model), Some(2.0));
    let s = mock.stats();
    assert_eq!(s["active_requests"], 3, "{s}");
    assert_eq!(
        (&s["requests_running"], &s["requests_waiting"]),
        (&json!(1), &json!(2)),
        "{s}"
    );
    // First come, first served: c, which needs no time itself, waits for a and then b.
    let rc = c.read_response();
    assert_eq!(rc.status, 200, "{}", rc.dump());
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(650),
        "c answered after {waited:?}"
    );
    assert_eq!(a.read_response().status, 200);
    assert_eq!(b.read_response().status, 200);
    let q = mock.queue();
    assert_eq!(
        (&q["running"], &q["waiting"], &q["queued"]),
        (&json!(0), &json!(0), &json!(2)),
        "{q}"
    );
    assert_eq!(mock.stat("max_active_requests"), 3);

    // A client that gives up while queued leaves the queue.
    let mut a = send("500");
    assert!(wait_until(Duration::from_secs(2), || mock.queue()
        ["running"]
        == 1));
    let d = send("0");
    assert!(wait_until(Duration::from_secs(2), || mock.queue()
        ["waiting"]
        == 1));
    drop(d);
    assert!(wait_until(Duration::from_secs(2), || mock.queue()
        ["waiting"]
        == 0));
    assert_eq!(a.read_response().status, 200);
    assert!(wait_until(Duration::from_secs(2), || mock
        .stat("active_requests")
        == 0));
}

#[test]
fn mock_metrics_report_the_real_queue_or_the_one_a_test_sets() {
    let mock = Mock::start(&[]);
    let model = [("model_name", "mock-model")];
    let m = mock.metrics();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
    ] {
        assert_eq!(m.type_of(name), Some("gauge"), "{name}:\n{}", m.text);
        assert_eq!(m.get(name, &model), Some(0.0), "{name}:\n{}", m.text);
    }
    // vLLM labels its engine core too.
    assert_eq!(
        m.get("vllm:num_requests_waiting", &[("engine", "0")]),
        Some(0.0)
    );
    // Real counts: a request being answered is running (unlimited: none wait, no usage).
    let mut c = Conn::open(mock.addr);
    c.send(
        &Req::post("/v1/chat/completions", &chat_stream_body("m"))
            .header("x-mock-delay-ms", "400")
            .build(),
    );
    assert!(wait_until(Duration::from_secs(2), || mock
        .metrics()
        .get("vllm:num_requests_running", &model)
        == Some(1.0)));
    assert_eq!(
        mock.metrics().get("vllm:kv_cache_usage_perc", &model),
        Some(0.0)
    );
    assert_eq!(c.read_response().status, 200);

    // Values a test sets.
    let q = mock.set_queue(json!({"waiting": 5, "running": 3}));
    assert_eq!(
        q["reported"],
        json!({"running": 3, "waiting": 5, "kv_cache_usage": 0.0}),
        "{q}"
    );
    let m = mock.metrics();
    assert_eq!(m.get("vllm:num_requests_running", &model), Some(3.0));
    assert_eq!(m.get("vllm:num_requests_waiting", &model), Some(5.0));
    assert_eq!(m.get("sglang:num_queue_reqs", &model), Some(5.0));
    // Each value separately: the others go back to the real ones.
    mock.set_queue(json!({"kv_cache_usage": 0.75}));
    let m = mock.metrics();
    assert_eq!(m.get("vllm:kv_cache_usage_perc", &model), Some(0.75));
    assert_eq!(m.get("sglang:token_usage", &model), Some(0.75));
    assert_eq!(m.get("vllm:num_requests_waiting", &model), Some(0.0));
    for bad in [
        r#"{"waiting": -1}"#,
        r#"{"waits": 1}"#,
        r#"{"kv_cache_usage": 2}"#,
    ] {
        assert_openai_error(&mock.control(Req::post("/_mock/queue", bad)), 400);
    }
    mock.set_queue(Value::Null);
    let m = mock.metrics();
    assert_eq!(m.get("vllm:kv_cache_usage_perc", &model), Some(0.0));
    // /metrics is the mock's own: not counted as a provider request.
    assert_eq!(mock.stat("requests"), 1);
}

#[test]
fn mock_help_and_contract_name_every_fault_flag_and_endpoint() {
    let out = std::process::Command::new(bin("mock-llm"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let contract = std::fs::read_to_string(workspace_root().join("bench/MOCK_LLM.md")).unwrap();
    for name in [
        "drop-before-response",
        "stall",
        "die-after=N",
        "end-after=N",
        "error-event",
        "quota",
        "status=N",
        "drop-mid-stream",
        "malformed-chunk",
        "chunk-ext",
        "close-delimited",
        "close-after",
        "--retry-after",
        "--error-code",
        "--max-running",
        "--fault",
        "x-mock-error-code",
        "x-mock-retry-after",
        "x-mock-fault",
        "/_mock/fault",
        "/_mock/queue",
        "/_mock/stats",
        "/metrics",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "sglang:num_queue_reqs",
        "/v1/messages",
        "x-mock-tool-calls",
        "x-mock-cache-read",
        "x-mock-cache-write",
        "x-mock-echo",
    ] {
        assert!(help.contains(name), "--help does not mention {name}");
        assert!(
            contract.contains(name),
            "MOCK_LLM.md does not mention {name}"
        );
    }
    for counter in [
        "errors_injected",
        "dropped_before_response",
        "stalled",
        "streams_cut",
        "error_events",
        "requests_running",
        "requests_waiting",
        "requests_queued",
        "messages_requests",
        "invalid_requests",
        "usage_cache_read_tokens",
        "usage_cache_creation_tokens",
    ] {
        assert!(
            contract.contains(counter),
            "MOCK_LLM.md does not mention {counter}"
        );
    }
}

// ---- Anthropic's Messages API (`POST /v1/messages`) ----

/// The headers every Messages request needs.
const ANTHROPIC: [(&str, &str); 2] = [
    ("x-api-key", "sk-ant-mock"),
    ("anthropic-version", "2023-06-01"),
];

/// A valid Messages body with `extra`'s fields added (or replaced).
fn messages_body(extra: Value) -> String {
    let mut v = json!({
        "model": "claude-mock",
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "hello"}]
    });
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v.to_string()
}

/// A `/v1/messages` request with the Anthropic headers and `headers`.
fn messages(mock: &Mock, body: &str, headers: &[(&str, &str)]) -> Response {
    let mut all = ANTHROPIC.to_vec();
    all.extend_from_slice(headers);
    ask(mock, "/v1/messages", body, &all)
}

/// Asserts Anthropic's error shape, `{"type":"error","error":{"type","message"},"request_id"}`,
/// with `status` and `kind`; returns the inner error.
fn assert_anthropic_error(r: &Response, status: u16, kind: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{}",
        r.dump()
    );
    let v = r.json();
    assert_eq!(v["type"], "error", "{}", r.dump());
    assert_eq!(v["error"]["type"], kind, "{}", r.dump());
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{}",
        r.dump()
    );
    assert!(
        v["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("req_")),
        "{}",
        r.dump()
    );
    v["error"].clone()
}

/// The data events of an Anthropic stream as (event name, data), checking that each one's
/// `event:` line names its data's `type`.
fn anthropic_events(r: &Response) -> Vec<(String, Value)> {
    data_events(r)
        .iter()
        .map(|e| {
            let v = e.json().unwrap_or_else(|| panic!("not JSON: {e:?}"));
            let name = e.event.clone().expect("an event: line");
            assert_eq!(v["type"], name.as_str(), "{e:?}");
            (name, v)
        })
        .collect()
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// The `delta` objects of an Anthropic stream's `content_block_delta` events for block `index`.
fn deltas_of(events: &[(String, Value)], index: u64) -> Vec<Value> {
    events
        .iter()
        .filter(|(n, v)| n == "content_block_delta" && v["index"] == index)
        .map(|(_, v)| v["delta"].clone())
        .collect()
}

#[test]
fn mock_messages_answers_a_message_with_anthropic_usage() {
    let mock = Mock::start(&["--tokens", "3"]);
    let body = messages_body(json!({}));
    let r = messages(&mock, &body, &[]);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.header("x-mock-model"), Some("claude-mock"));
    assert!(r
        .header("request-id")
        .is_some_and(|id| id.starts_with("req_mock_")));
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(
        (&v["type"], &v["role"], &v["model"]),
        (
            &json!("message"),
            &json!("assistant"),
            &json!("claude-mock")
        )
    );
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "tok0 tok1 tok2"}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    let input = (body.len() as u64 / 4).max(1);
    assert_eq!(
        v["usage"],
        json!({"input_tokens": input, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": 0, "output_tokens": 3})
    );
    assert_eq!(echo_of(&r)["model"], "claude-mock");

    // Cache usage as asked, beside the input; --tokens overridden per request.
    let r = messages(
        &mock,
        &body,
        &[
            ("x-mock-cache-read", "100"),
            ("x-mock-cache-write", "20"),
            ("x-mock-tokens", "2"),
        ],
    );
    let u = &r.json()["usage"];
    assert_eq!(
        (
            &u["input_tokens"],
            &u["cache_read_input_tokens"],
            &u["cache_creation_input_tokens"],
            &u["output_tokens"]
        ),
        (&json!(input), &json!(100), &json!(20), &json!(2)),
        "{}",
        r.dump()
    );

    // Thinking enabled: a thinking block first, its tokens in the output.
    let thinking = messages_body(json!({
        "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}
    }));
    let r = messages(&mock, &thinking, &[]);
    let v = r.json();
    assert_eq!(v["content"][0]["type"], "thinking", "{v}");
    assert_eq!(v["content"][0]["thinking"], "think0 think1 think2");
    assert!(v["content"][0]["signature"]
        .as_str()
        .is_some_and(|s| !s.is_empty()));
    assert_eq!(v["content"][1]["text"], "tok0 tok1 tok2");
    assert_eq!(v["usage"]["output_tokens"], 6);

    // max_tokens cuts the answer.
    let r = messages(&mock, &messages_body(json!({"max_tokens": 2})), &[]);
    let v = r.json();
    assert_eq!(v["content"][0]["text"], "tok0 tok1");
    assert_eq!(v["stop_reason"], "max_tokens");

    let s = mock.stats();
    assert_eq!(s["requests"], 4, "{s}");
    assert_eq!(s["messages_requests"], 4, "{s}");
    let thinking_input = (thinking.len() as u64 / 4).max(1);
    let short_input = (messages_body(json!({"max_tokens": 2})).len() as u64 / 4).max(1);
    assert_eq!(
        s["usage_prompt_tokens"],
        input + (input + 120) + thinking_input + short_input,
        "{s}"
    );
    assert_eq!(s["usage_completion_tokens"], 3 + 2 + 6 + 2, "{s}");
    assert_eq!(s["usage_cache_read_tokens"], 100, "{s}");
    assert_eq!(s["usage_cache_creation_tokens"], 20, "{s}");
    assert_eq!(s["invalid_requests"], 0, "{s}");
}

#[test]
fn mock_messages_refuses_what_the_real_api_refuses() {
    let mock = Mock::start(&["--reject-key", "sk-revoked"]);
    let body = messages_body(json!({}));
    let post = |headers: &[(&str, &str)]| ask(&mock, "/v1/messages", &body, headers);
    // Credentials: Anthropic's header, not OpenAI's.
    let e = assert_anthropic_error(
        &post(&[("anthropic-version", "2023-06-01")]),
        401,
        "authentication_error",
    );
    assert_eq!(e["message"], "x-api-key header is required");
    let e = assert_anthropic_error(
        &post(&[
            ("authorization", "Bearer sk-ant-mock"),
            ("anthropic-version", "2023-06-01"),
        ]),
        401,
        "authentication_error",
    );
    assert_eq!(
        e["message"],
        "OAuth authentication is currently not supported."
    );
    // A later version takes the key as a bearer, as the official SDKs 2.x send it.
    let r = post(&[
        ("authorization", "Bearer sk-ant-mock"),
        ("anthropic-version", "2026-10-21"),
    ]);
    assert_eq!(r.status, 200, "{}", r.dump());
    let e = assert_anthropic_error(
        &post(&[
            ("authorization", "Bearer sk-revoked"),
            ("anthropic-version", "2026-10-21"),
        ]),
        401,
        "authentication_error",
    );
    assert_eq!(e["message"], "Invalid bearer token");
    let e = assert_anthropic_error(
        &post(&[
            ("x-api-key", "sk-revoked"),
            ("anthropic-version", "2023-06-01"),
        ]),
        401,
        "authentication_error",
    );
    assert_eq!(e["message"], "invalid x-api-key");
    let e = assert_anthropic_error(&post(&[("x-api-key", "k")]), 400, "invalid_request_error");
    assert_eq!(e["message"], "anthropic-version: header is required");

    // Bodies, each refused with the field named.
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
    let cases = [
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            "max_tokens: Field required",
        ),
        (
            messages_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
            "stream_options: Extra inputs are not permitted",
        ),
        (
            messages_body(json!({"messages": []})),
            "messages: at least one message is required",
        ),
        (
            messages_body(json!({"messages": [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
            ]})),
            "messages.0.role: Input should be 'user' or 'assistant'",
        ),
        (
            messages_body(json!({"messages": [{"role": "assistant", "content": "hi"}]})),
            "first message must use the \"user\" role",
        ),
        (
            messages_body(json!({"messages": [
                {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
            ]})),
            "roles must alternate",
        ),
        (
            messages_body(json!({"messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}
                ]},
                {"role": "user", "content": "and?"}
            ], "tools": tools})),
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_a",
        ),
        (
            messages_body(json!({"messages": [
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_x", "content": "sunny"}
                ]}
            ]})),
            "unexpected `tool_use_id` found in `tool_result` blocks: toolu_x",
        ),
        (
            messages_body(json!({"tools": tools, "tool_choice": {"type": "required"}})),
            "tool_choice: Input tag 'required'",
        ),
        (
            messages_body(json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png"}}
            ]}]})),
            "messages.0.content.0: Input tag 'image_url'",
        ),
        (
            messages_body(json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}
            ]}]})),
            "Image does not match the provided media type image/png",
        ),
        (
            messages_body(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}})),
            "`max_tokens` must be greater than `thinking.budget_tokens`",
        ),
        ("{not json".to_owned(), "not valid JSON"),
    ];
    for (body, needle) in &cases {
        let r = messages(&mock, body, &[]);
        let e = assert_anthropic_error(&r, 400, "invalid_request_error");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
        // What was refused is echoed beside why.
        assert_eq!(echo_of(&r)["body"].as_str().unwrap(), body.as_str());
    }

    // A full conversation the API takes: system blocks, an image, tools, a tool round trip.
    const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";
    let ok = messages_body(json!({
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": false},
        "metadata": {"user_id": "u-1"},
        "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "what is this, and the weather?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
            ]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "a pixel; checking"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "a"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "b"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "no data"}]}
            ]}
        ]
    }));
    let r = messages(&mock, &ok, &[]);
    assert_eq!(r.status, 200, "{}", r.dump());

    let s = mock.stats();
    assert_eq!(s["invalid_requests"], 5 + cases.len() as u64, "{s}");
    assert_eq!(s["errors_injected"], 0, "{s}");
    assert_eq!(s["messages_requests"], 7 + cases.len() as u64, "{s}");
}

#[test]
fn mock_messages_stream_sends_the_published_events_in_order_and_on_time() {
    let mock = Mock::start(&[
        "--tokens",
        "4",
        "--ttft-ms",
        "150",
        "--inter-token-ms",
        "100",
    ]);
    let body = messages_body(json!({
        "stream": true, "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024}
    }));
    let sent = std::time::Instant::now();
    let r = messages(&mock, &body, &[("x-mock-cache-read", "7")]);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.framing, Framing::Chunked);
    assert_eq!(r.end, BodyEnd::Complete);
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    assert_eq!(echo_of(&r)["model"], "claude-mock");
    let ev = anthropic_events(&r);
    let mut want = vec!["message_start", "content_block_start", "ping"];
    want.extend(["content_block_delta"; 4]); // 3 thinking deltas, 1 signature
    want.extend(["content_block_stop", "content_block_start"]);
    want.extend(["content_block_delta"; 4]);
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names(&ev), want, "{}", r.dump());
    assert!(!r.sse_events().iter().any(SseEvent::is_done));

    let start = &ev[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    let input = (body.len() as u64 / 4).max(1);
    assert_eq!(start["usage"]["input_tokens"], input);
    assert_eq!(start["usage"]["cache_read_input_tokens"], 7);
    assert_eq!(start["usage"]["output_tokens"], 1);
    assert_eq!(
        ev[1].1["content_block"],
        json!({"type": "thinking", "thinking": "", "signature": ""})
    );
    let thinking = deltas_of(&ev, 0);
    assert_eq!(
        thinking
            .iter()
            .map(|d| d["type"].as_str().unwrap())
            .collect::<Vec<_>>(),
        [
            "thinking_delta",
            "thinking_delta",
            "thinking_delta",
            "signature_delta"
        ]
    );
    assert_eq!(
        ev[8].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = deltas_of(&ev, 1)
        .iter()
        .map(|d| {
            assert_eq!(d["type"], "text_delta");
            d["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, "tok0 tok1 tok2 tok3");
    let delta = &ev[14].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "end_turn", "stop_sequence": null})
    );
    // Cumulative: the whole output (4 text + 3 thinking), and the input again.
    assert_eq!(delta["usage"]["output_tokens"], 7);
    assert_eq!(delta["usage"]["input_tokens"], input);

    // Timing: the first content delta after ttft, then one every inter-token interval.
    let events = data_events(&r);
    let first = events
        .iter()
        .position(|e| e.data.contains("thinking_delta"))
        .unwrap();
    let ttft = events[first].at.duration_since(sent);
    assert!(ttft >= Duration::from_millis(150), "{ttft:?}");
    let content: Vec<_> = events
        .iter()
        .filter(|e| {
            e.event.as_deref() == Some("content_block_delta") && !e.data.contains("signature_delta")
        })
        .collect();
    assert_eq!(content.len(), 7);
    for w in content.windows(2) {
        let gap = w[1].at.duration_since(w[0].at);
        assert!(gap >= Duration::from_millis(80), "{gap:?}");
    }
    let s = mock.stats();
    assert_eq!(s["streams_completed"], 1, "{s}");
    assert_eq!(s["usage_prompt_tokens"], input + 7, "{s}");
    assert_eq!(s["usage_completion_tokens"], 7, "{s}");
    assert_eq!(s["usage_cache_read_tokens"], 7, "{s}");
}

#[test]
fn mock_messages_answers_tool_use_blocks_for_parallel_calls() {
    let mock = Mock::start(&["--tokens", "2"]);
    let tools = json!([
        {"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}},
        {"name": "get_time", "input_schema": {"type": "object"}}
    ]);
    let ask_tools = |extra: Value, headers: &[(&str, &str)]| {
        let mut fields = json!({"tools": tools});
        if let (Some(o), Value::Object(e)) = (fields.as_object_mut(), extra) {
            o.extend(e);
        }
        messages(&mock, &messages_body(fields), headers)
    };
    let r = ask_tools(json!({}), &[("x-mock-tool-calls", "2")]);
    let v = r.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let content = v["content"].as_array().unwrap();
    assert_eq!(content.len(), 3, "{v}");
    assert_eq!(content[0], json!({"type": "text", "text": "tok0 tok1"}));
    let calls = &content[1..];
    for (call, name) in calls.iter().zip(["get_weather", "get_time"]) {
        assert_eq!(call["type"], "tool_use");
        assert!(call["id"].as_str().unwrap().starts_with("toolu_"), "{call}");
        assert_eq!(call["name"], name);
        assert!(call["input"].is_object(), "{call}");
    }
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(v["usage"]["output_tokens"], 2 + 2 * 5);

    // The mock takes its own answer back with the results: a whole tool round trip.
    let results: Vec<Value> = calls
        .iter()
        .map(|c| json!({"type": "tool_result", "tool_use_id": c["id"], "content": "ok"}))
        .collect();
    let follow = json!({"messages": [
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": results}
    ]});
    let r = ask_tools(follow, &[]);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.json()["stop_reason"], "end_turn");

    // Streamed: each call's input arrives as input_json_delta pieces to be joined.
    let r = ask_tools(json!({"stream": true}), &[("x-mock-tool-calls", "2")]);
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let ev = anthropic_events(&r);
    for (index, call) in [(1u64, &calls[0]), (2, &calls[1])] {
        let start = ev
            .iter()
            .find(|(n, v)| n == "content_block_start" && v["index"] == index)
            .expect("block start");
        let block = &start.1["content_block"];
        assert_eq!(block["type"], "tool_use");
        assert_eq!(block["name"], call["name"]);
        assert_eq!(block["input"], json!({}));
        assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
        let pieces: Vec<String> = deltas_of(&ev, index)
            .iter()
            .map(|d| {
                assert_eq!(d["type"], "input_json_delta");
                d["partial_json"].as_str().unwrap().to_owned()
            })
            .collect();
        assert!(
            pieces.iter().filter(|p| !p.is_empty()).count() >= 3,
            "{pieces:?}"
        );
        let input: Value = serde_json::from_str(&pieces.concat()).unwrap();
        assert_eq!(&input, &call["input"]);
    }
    let delta = ev.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");
    assert_eq!(names(&ev).last(), Some(&"message_stop"));

    // No tools, no calls; `none` forbids them; one at a time when parallel calls are off;
    // `tool` names the tool and forces a call.
    let r = messages(
        &mock,
        &messages_body(json!({})),
        &[("x-mock-tool-calls", "2")],
    );
    assert_eq!(r.json()["stop_reason"], "end_turn");
    let r = ask_tools(
        json!({"tool_choice": {"type": "none"}}),
        &[("x-mock-tool-calls", "2")],
    );
    assert_eq!(r.json()["stop_reason"], "end_turn");
    let r = ask_tools(
        json!({"tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
        &[("x-mock-tool-calls", "3")],
    );
    let kinds = r.json()["content"].as_array().unwrap().len();
    assert_eq!(kinds, 2, "{}", r.dump());
    let r = ask_tools(
        json!({"tool_choice": {"type": "tool", "name": "get_time"}}),
        &[],
    );
    let v = r.json();
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(v["content"][1]["name"], "get_time", "{v}");
}

#[test]
fn mock_messages_faults_answer_in_anthropic_shapes() {
    let mock = Mock::start(&["--tokens", "4"]);
    let body = messages_body(json!({}));
    let stream = messages_body(json!({"stream": true}));
    // Injected statuses, typed as Anthropic types them, streamed requests included.
    for (status, kind) in [
        ("429", "rate_limit_error"),
        ("529", "overloaded_error"),
        ("500", "api_error"),
        ("401", "authentication_error"),
        ("402", "billing_error"),
    ] {
        for b in [&body, &stream] {
            let r = messages(&mock, b, &[("x-mock-status", status)]);
            assert_anthropic_error(&r, status.parse().unwrap(), kind);
        }
    }
    let r = messages(&mock, &body, &[("x-mock-fault", "status=429")]);
    assert_anthropic_error(&r, 429, "rate_limit_error");
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = messages(&mock, &body, &[("x-mock-status", "529")]);
    assert_eq!(r.json()["error"]["message"], "Overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    // An injected status wins over the checks.
    let r = ask(&mock, "/v1/messages", "{}", &[("x-mock-status", "503")]);
    assert_anthropic_error(&r, 503, "api_error");
    // Out of credit: Anthropic's 400, never a retryable 429.
    let r = messages(&mock, &body, &[("x-mock-fault", "quota")]);
    let e = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(e["message"]
        .as_str()
        .unwrap()
        .starts_with("Your credit balance is too low"));
    assert!(r.header("retry-after").is_none(), "{}", r.dump());

    // An error event after N deltas, or as the first data event.
    let r = messages(&mock, &stream, &[("x-mock-fault", "error-event=2")]);
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let ev = anthropic_events(&r);
    assert_eq!(
        names(&ev),
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "error"
        ],
        "{}",
        r.dump()
    );
    assert_eq!(
        ev[5].1["error"],
        json!({"type": "overloaded_error", "message": "Overloaded"})
    );
    let r = messages(
        &mock,
        &stream,
        &[
            ("x-mock-fault", "error-event"),
            ("x-mock-error-code", "api_error"),
        ],
    );
    let ev = anthropic_events(&r);
    assert_eq!(names(&ev), ["error"], "{}", r.dump());
    assert_eq!(ev[0].1["error"]["type"], "api_error");

    // Cut after N deltas: no message_delta, no message_stop.
    let r = messages(&mock, &stream, &[("x-mock-fault", "die-after=2")]);
    assert!(
        matches!(r.end, BodyEnd::Truncated | BodyEnd::Reset),
        "{:?}",
        r.end
    );
    let ev = anthropic_events(&r);
    assert_eq!(deltas_of(&ev, 0).len(), 2, "{}", r.dump());
    assert!(!names(&ev).contains(&"message_delta"));
    // Ended cleanly on the wire, but short.
    let r = messages(&mock, &stream, &[("x-mock-fault", "end-after=1")]);
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let ev = anthropic_events(&r);
    assert_eq!(deltas_of(&ev, 0).len(), 1);
    assert!(!names(&ev).contains(&"message_stop"));
    // Past the last delta: the block is closed, the message is not.
    let r = messages(&mock, &stream, &[("x-mock-fault", "end-after=9")]);
    let ev = anthropic_events(&r);
    assert_eq!(
        names(&ev).last(),
        Some(&"content_block_stop"),
        "{}",
        r.dump()
    );
    // Nothing at all.
    let mut c = Conn::open(mock.addr);
    let mut req = Req::post("/v1/messages", &stream).header("x-mock-fault", "drop-before-response");
    for (k, v) in ANTHROPIC {
        req = req.header(k, v);
    }
    c.send(&req.build());
    let got = c.read_head();
    assert!(
        matches!(got, Err(ReadError::Closed | ReadError::Reset)),
        "{got:?}"
    );

    let s = mock.stats();
    assert_eq!(s["errors_injected"], 10 + 4, "{s}");
    assert_eq!(s["error_events"], 2, "{s}");
    assert_eq!(s["streams_cut"], 3, "{s}");
    assert_eq!(s["dropped_before_response"], 1, "{s}");
    assert_eq!(s["invalid_requests"], 0, "{s}");
}

/// `x-mock-headers: provider` adds a provider's fields to the head, of an answer and of a
/// stream, and leaves the answer as it was; without it the head has mock-llm's few fields.
#[test]
fn provider_headers_add_a_providers_fields() {
    let mock = Mock::start(&["--tokens", "3"]);
    let provider = [("x-mock-headers", "provider")];
    let plain = ask(&mock, "/v1/chat/completions", &chat_body("m"), &[]);
    let r = ask(&mock, "/v1/chat/completions", &chat_body("m"), &provider);
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.headers.len(), plain.headers.len() + 20, "{}", r.dump());
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("9999"));
    let cookies = r
        .headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("set-cookie"));
    assert_eq!(cookies.count(), 2);
    assert!(plain.header("x-ratelimit-remaining-requests").is_none());
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    let s = ask(
        &mock,
        "/v1/chat/completions",
        &chat_stream_body("m"),
        &provider,
    );
    assert_eq!(
        s.header("openai-version"),
        Some("2020-10-01"),
        "{}",
        s.dump()
    );
    assert!(s.text().contains("data: [DONE]"));
}

/// `x-mock-echo: none` leaves the echo out — of a chat answer, a stream and a Messages answer —
/// and nothing else: the answers stay whole JSON with their usage. Without it the echo is there.
#[test]
fn echo_none_leaves_the_echo_out() {
    let mock = Mock::start(&["--tokens", "3"]);
    let none = [("x-mock-echo", "none")];
    let r = ask(&mock, "/v1/chat/completions", &chat_body("m"), &none);
    assert_eq!(r.status, 200, "{}", r.dump());
    let v = r.json();
    assert!(v.get("echo").is_none(), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let with = ask(&mock, "/v1/chat/completions", &chat_body("m"), &[]);
    assert_eq!(with.json()["echo"]["model"], "m");

    let s = ask(&mock, "/v1/chat/completions", &chat_stream_body("m"), &none);
    let text = s.text();
    assert!(!text.contains(": echo"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    let s = ask(&mock, "/v1/chat/completions", &chat_stream_body("m"), &[]);
    assert!(s.text().contains(": echo {"));

    let m = messages(&mock, &messages_body(json!({})), &none);
    assert_eq!(m.status, 200, "{}", m.dump());
    let v = m.json();
    assert!(v.get("echo").is_none(), "{v}");
    assert_eq!(v["usage"]["output_tokens"], 3);
    let m = messages(&mock, &messages_body(json!({"stream": true})), &none);
    let text = m.text();
    assert!(!text.contains(": echo"), "{text}");
    assert!(text.contains("event: message_stop"), "{text}");
}
