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
