//! Observability end to end: what the access log records, what `/metrics` exposes and the
//! `x-sluice-overhead-us` header, for real requests through the gateway to mock-llm.
//!
//! Every wait is a poll with a deadline: workers publish metrics every 500 ms and hand log
//! records to their writer every `flush_interval_ms` (50 ms here).
//!
//! The metrics exposition test parses `/metrics` with Python's `prometheus_client` as a
//! reference parser (`scripts/test.sh` installs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_tests::*;

/// How long a record may take to reach the files (flush interval 50 ms, debug build).
const LOG_WAIT: Duration = Duration::from_secs(5);
/// How long a metric may take to show (publish every 500 ms).
const METRICS_WAIT: Duration = Duration::from_secs(5);

/// A gateway with the admin listener and an access log flushed every 50 ms.
fn observed(config: Config, log: &TempDir) -> Sluice {
    Sluice::start(
        &config
            .admin()
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 50),
    )
}

/// A streaming chat body that asks for the usage chunk.
fn stream_usage_body(model: &str) -> String {
    json!({
        "model": model,
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hello"}],
    })
    .to_string()
}

fn u(rec: &Value, field: &str) -> u64 {
    rec[field]
        .as_u64()
        .unwrap_or_else(|| panic!("record field {field} is not an unsigned integer: {rec}"))
}

fn s<'a>(rec: &'a Value, field: &str) -> &'a str {
    rec[field]
        .as_str()
        .unwrap_or_else(|| panic!("record field {field} is not a string: {rec}"))
}

/// The `usage` object of a stream's usage chunk (`choices: []`).
fn stream_usage(r: &Response) -> Value {
    r.sse_events()
        .iter()
        .filter_map(SseEvent::json)
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .unwrap_or_else(|| panic!("stream carries no usage chunk:\n{}", r.dump()))
}

fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

// ---------------------------------------------------------------------------------------------
// 1. Time to first token, time per output token
// ---------------------------------------------------------------------------------------------

#[test]
fn ttft_is_stamped_at_the_first_content_chunk_not_at_the_response_head() {
    let mock = Mock::start(&["--ttft-ms", "300", "--tokens", "3"]);
    let log = TempDir::new("obs-ttft");
    let gw = observed(Config::one_cluster(&mock), &log);

    let r = gw.chat(&chat_stream_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    // The premise: the head (and the role delta) came at once, the content 300 ms later.
    let events = r.sse_events();
    let first_content = events
        .iter()
        .find(|e| e.content().is_some())
        .expect("a content event");
    assert!(
        first_content.at.duration_since(r.head_at) >= Duration::from_millis(250),
        "the head did not arrive well before the first content ({:?} apart)",
        first_content.at.duration_since(r.head_at)
    );

    let recs = wait_records(log.path(), 1, LOG_WAIT);
    assert_eq!(recs.len(), 1, "{recs:?}");
    let rec = &recs[0];
    let ttft = u(rec, "ttft_us");
    let latency = u(rec, "latency_us");
    assert!(
        ttft >= 300_000,
        "ttft_us {ttft} < 300 ms: stamped before the first content chunk: {rec}"
    );
    assert!(
        ttft < latency,
        "ttft_us {ttft} >= latency_us {latency}: {rec}"
    );
    assert!(
        u(rec, "upstream_header_us") < 250_000,
        "the upstream head came at once, yet upstream_header_us is {}: {rec}",
        u(rec, "upstream_header_us")
    );

    let count = "sluice_time_to_first_token_seconds_count";
    let gpt = [("model", "gpt-4o")];
    let m = gw.wait_metrics(METRICS_WAIT, |m| m.get(count, &gpt) == Some(1.0));
    assert_eq!(m.get(count, &gpt), Some(1.0), "{}", m.text);
    let sum = m
        .get("sluice_time_to_first_token_seconds_sum", &gpt)
        .unwrap();
    assert!(sum >= 0.3, "TTFT histogram sum {sum} < 0.3 s:\n{}", m.text);
    // The histogram and the log record measure the same interval (ns there, µs here).
    assert!(
        (sum - ttft as f64 / 1e6).abs() < 2e-6,
        "TTFT histogram sum {sum} s vs record ttft_us {ttft}"
    );
    let bucket = |le: &str| {
        m.get(
            "sluice_time_to_first_token_seconds_bucket",
            &[("model", "gpt-4o"), ("le", le)],
        )
    };
    assert_eq!(bucket("0.25"), Some(0.0), "{}", m.text);
    assert_eq!(bucket("+Inf"), Some(1.0), "{}", m.text);
}

#[test]
fn tpot_is_the_mean_gap_between_output_tokens() {
    let mock = Mock::start(&["--inter-token-ms", "50", "--tokens", "5"]);
    let log = TempDir::new("obs-tpot");
    let gw = observed(Config::one_cluster(&mock), &log);

    let r = gw.chat(&stream_usage_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    assert_eq!(stream_usage(&r)["completion_tokens"], 5, "{}", r.dump());

    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(u(rec, "completion_tokens"), 5, "{rec}");
    let tpot = u(rec, "tpot_us");
    assert!(
        (40_000..=120_000).contains(&tpot),
        "tokens came 50 ms apart, yet tpot_us is {tpot}: {rec}"
    );

    let gpt = [("model", "gpt-4o")];
    let count = "sluice_time_per_output_token_seconds_count";
    let m = gw.wait_metrics(METRICS_WAIT, |m| m.get(count, &gpt) == Some(1.0));
    assert_eq!(m.get(count, &gpt), Some(1.0), "{}", m.text);
    let sum = m
        .get("sluice_time_per_output_token_seconds_sum", &gpt)
        .unwrap();
    assert!(
        (0.04..=0.12).contains(&sum),
        "TPOT histogram sum {sum}:\n{}",
        m.text
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Usage and cost
// ---------------------------------------------------------------------------------------------

#[test]
fn reported_usage_is_logged_and_priced_at_the_mapped_models_price() {
    let mock = Mock::start(&["--tokens", "7"]);
    let log = TempDir::new("obs-usage");
    // The requested alias and the model it maps to have very different prices.
    let (alias_in, alias_out) = (1.0, 2.0);
    let (mapped_in, mapped_out) = (3000.0, 7000.0);
    let gw = observed(
        Config::one_cluster(&mock)
            .map("alias", "upstream-model")
            .price("alias", alias_in, alias_out)
            .price("upstream-model", mapped_in, mapped_out),
        &log,
    );

    let r = gw.chat(&stream_usage_body("alias"));
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    let echo = echo_of(&r);
    assert_eq!(echo["model"], "upstream-model", "mapping not applied");
    let usage = stream_usage(&r);
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let completion = usage["completion_tokens"].as_u64().unwrap();
    // mock-llm: prompt = the body it received / 4 (at least 1), completion = --tokens.
    let upstream_body_len = echo["body"].as_str().unwrap().len() as u64;
    assert_eq!(prompt, (upstream_body_len / 4).max(1), "{usage}");
    assert_eq!(completion, 7, "{usage}");

    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(s(rec, "usage_source"), "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(u(rec, "prompt_tokens"), prompt, "{rec}");
    assert_eq!(u(rec, "completion_tokens"), completion, "{rec}");
    assert_eq!(u(rec, "total_tokens"), prompt + completion, "{rec}");
    assert_eq!(s(rec, "requested_model"), "alias", "{rec}");
    assert_eq!(s(rec, "mapped_model"), "upstream-model", "{rec}");
    let cost = rec["cost"].as_f64().unwrap();
    let want = (prompt as f64 * mapped_in + completion as f64 * mapped_out) / 1e6;
    let at_alias_price = (prompt as f64 * alias_in + completion as f64 * alias_out) / 1e6;
    assert!(
        ((cost - want) / want).abs() <= 1e-12,
        "cost {cost}, want {want} at the mapped model's price (the alias's price gives \
         {at_alias_price}): {rec}"
    );

    // The metrics settle the same usage and cost (cost in whole micro-units).
    let alias = [("model", "alias")];
    let m = gw.wait_metrics(METRICS_WAIT, |m| {
        m.get(
            "sluice_tokens_total",
            &[("model", "alias"), ("type", "completion")],
        ) == Some(completion as f64)
    });
    let tokens = |t: &str| m.get("sluice_tokens_total", &[("model", "alias"), ("type", t)]);
    assert_eq!(tokens("completion"), Some(completion as f64), "{}", m.text);
    assert_eq!(tokens("prompt"), Some(prompt as f64), "{}", m.text);
    let metric_cost = m.get("sluice_cost_total", &alias).unwrap_or(0.0);
    assert!(
        (metric_cost - want).abs() <= 1e-6,
        "sluice_cost_total {metric_cost}, want {want}:\n{}",
        m.text
    );
}

#[test]
fn non_streamed_usage_is_reported_too() {
    let mock = Mock::start(&["--tokens", "9"]);
    let log = TempDir::new("obs-usage-json");
    let gw = observed(Config::one_cluster(&mock).price("gpt-4o", 2.5, 10.0), &log);
    let r = gw.chat(&chat_body("gpt-4o"));
    assert_eq!(r.status, 200, "{}", r.dump());
    let usage = r.json()["usage"].clone();
    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    assert_eq!(s(rec, "usage_source"), "USAGE_SOURCE_REPORTED", "{rec}");
    assert_eq!(rec["prompt_tokens"], usage["prompt_tokens"], "{rec}");
    assert_eq!(rec["completion_tokens"], 9, "{rec}");
    assert_eq!(rec["stream"], false, "{rec}");
    // No token timing for a body that arrives whole.
    assert_eq!(u(rec, "tpot_us"), 0, "{rec}");
    let prompt = usage["prompt_tokens"].as_u64().unwrap() as f64;
    let want = (prompt * 2.5 + 9.0 * 10.0) / 1e6;
    let cost = rec["cost"].as_f64().unwrap();
    assert!(
        ((cost - want) / want).abs() <= 1e-12,
        "cost {cost} != {want}"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Client abort
// ---------------------------------------------------------------------------------------------

#[test]
fn client_abort_mid_stream_still_writes_a_record_with_estimated_usage() {
    let tokens = 100u64;
    let mock = Mock::start(&["--inter-token-ms", "30", "--tokens", "100"]);
    let log = TempDir::new("obs-abort");
    let gw = observed(Config::one_cluster(&mock), &log);

    let mut c = gw.conn();
    c.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
    let head = c.read_head().expect("stream head");
    assert_eq!(head.status, 200);
    c.read_until_content_events(3);
    drop(c);

    let recs = wait_records(log.path(), 1, Duration::from_secs(3));
    assert_eq!(recs.len(), 1, "{recs:?}");
    let rec = &recs[0];
    assert_eq!(s(rec, "error_class"), "client_abort", "{rec}");
    assert_eq!(u(rec, "status"), 200, "{rec}");
    assert_eq!(s(rec, "usage_source"), "USAGE_SOURCE_ESTIMATED", "{rec}");
    let completion = u(rec, "completion_tokens");
    // The whole text, had it all been streamed: "tok0 tok1 … tok99", ~4 bytes a token.
    let full_text: usize = (0..tokens)
        .map(|i| format!("tok{i}").len() + usize::from(i > 0))
        .sum();
    assert!(
        completion > 0 && completion < full_text.div_ceil(4) as u64,
        "completion_tokens {completion} is not an estimate of a part of the stream: {rec}"
    );
    assert!(u(rec, "prompt_tokens") > 0, "{rec}");
    assert!(u(rec, "ttft_us") > 0, "{rec}");
    assert_eq!(rec["stream"], true, "{rec}");
}

// ---------------------------------------------------------------------------------------------
// 4. The metrics exposition
// ---------------------------------------------------------------------------------------------

/// Parses stdin with `prometheus_client`'s reference parser and prints the families as JSON.
const PY_PARSE: &str = r#"
import json, math, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for fam in text_string_to_metric_families(sys.stdin.read()):
    samples = []
    for s in fam.samples:
        v = s.value
        samples.append({"name": s.name, "labels": s.labels,
                        "value": v if math.isfinite(v) else str(v)})
    out.append({"name": fam.name, "type": fam.type, "help": fam.documentation,
                "samples": samples})
print(json.dumps(out))
"#;

fn python_parse(text: &str) -> Vec<Value> {
    use std::io::Write as _;
    let mut child = Command::new("python3")
        .args(["-c", PY_PARSE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run python3 (with prometheus_client; scripts/test.sh installs it)");
    let mut stdin = child.stdin.take().unwrap();
    let input = text.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("python3 did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().expect("feed python3");
    assert!(
        out.status.success(),
        "prometheus_client rejected the exposition: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .expect("python JSON")
        .as_array()
        .unwrap()
        .clone()
}

/// `name` with the labels `labels` (exactly that set) in the Python-parsed families.
fn py_value(families: &[Value], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for fam in families {
        for smp in fam["samples"].as_array().unwrap() {
            if smp["name"] != name {
                continue;
            }
            let l = smp["labels"].as_object().unwrap();
            if l.len() == labels.len() && labels.iter().all(|(k, v)| l.get(*k) == Some(&json!(v))) {
                assert!(found.is_none(), "{name}{labels:?} appears twice");
                found = Some(smp["value"].as_f64().expect("finite value"));
            }
        }
    }
    found
}

#[test]
fn metrics_count_requests_tokens_and_upstream_errors() {
    let mock = Mock::start(&["--tokens", "6"]);
    let dead = dead_port();
    let dead_url = format!("http://127.0.0.1:{dead}/v1");
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .cluster(Cluster::new("dead", &[&dead_url]))
            .route("dead-model", "dead")
            .admin(),
    );
    // Before any traffic: alive, ready.
    let h = gw.admin_get("/healthz");
    assert_eq!(h.status, 200, "{}", h.dump());
    let ready = gw.admin_get("/readyz");
    assert_eq!(ready.status, 200, "{}", ready.dump());

    let mut prompt = 0;
    for _ in 0..3 {
        let r = gw.chat(&chat_body("gpt-4o"));
        assert_eq!(r.status, 200, "{}", r.dump());
        prompt += r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    let e = assert_openai_error(&gw.chat(&chat_body("no-such-model")), 404);
    assert_eq!(e["code"], "model_not_found");
    assert_openai_error(&gw.chat(&chat_body("dead-model")), 502);
    // An upstream answering 503 is an upstream error of its backend too.
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-status", "503"),
    );
    assert_eq!(r.status, 503, "{}", r.dump());

    let requests = "sluice_requests_total";
    gw.wait_metrics(METRICS_WAIT, |m| m.sum(requests, &[]) >= 6.0);
    let resp = gw.admin_get("/metrics");
    assert_eq!(resp.status, 200, "{}", resp.dump());
    let ct = resp.header("content-type").unwrap_or("");
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let text = resp.text();
    let fams = python_parse(&text);

    // Every declared family is there with its declared type.
    for family in sluice::FAMILIES {
        let (name, kind) = (family.name, family.kind.as_str());
        let py_name = if kind == "counter" {
            name.strip_suffix("_total").unwrap_or(name)
        } else {
            name
        };
        let fam = fams
            .iter()
            .find(|f| f["name"] == py_name)
            .unwrap_or_else(|| panic!("family {name} missing:\n{text}"));
        assert_eq!(fam["type"], kind, "{name}");
        assert!(
            !fam["help"].as_str().unwrap_or("").is_empty(),
            "{name} has no HELP"
        );
    }

    let req = |model: &str, class: &str| {
        py_value(
            &fams,
            requests,
            &[
                ("route", "chat_completions"),
                ("model", model),
                ("entity", "other"),
                ("status_class", class),
            ],
        )
    };
    assert_eq!(req("gpt-4o", "2xx"), Some(3.0), "{text}");
    // An unknown model is counted under `other`, never under its own name.
    assert_eq!(req("other", "4xx"), Some(1.0), "{text}");
    assert!(!text.contains("no-such-model"), "{text}");
    assert_eq!(req("dead-model", "5xx"), Some(1.0), "{text}");
    assert_eq!(req("gpt-4o", "5xx"), Some(1.0), "{text}");
    let total: f64 = fams
        .iter()
        .flat_map(|f| f["samples"].as_array().unwrap().iter())
        .filter(|s| s["name"] == requests)
        .map(|s| s["value"].as_f64().unwrap())
        .sum();
    assert_eq!(total, 6.0, "{text}");

    let tokens = |t: &str| {
        py_value(
            &fams,
            "sluice_tokens_total",
            &[("model", "gpt-4o"), ("entity", "other"), ("type", t)],
        )
    };
    assert_eq!(tokens("completion"), Some(18.0), "{text}");
    assert_eq!(tokens("prompt"), Some(prompt as f64), "{text}");

    let main_backend = format!("main/{}", mock.addr);
    let dead_backend = format!("dead/127.0.0.1:{dead}");
    let upstream_err = |backend: &str, kind: &str| {
        py_value(
            &fams,
            "sluice_upstream_errors_total",
            &[("backend", backend), ("kind", kind)],
        )
    };
    assert_eq!(upstream_err(&dead_backend, "connect"), Some(1.0), "{text}");
    let errors_of = |backend: &str| -> f64 {
        fams.iter()
            .flat_map(|f| f["samples"].as_array().unwrap().iter())
            .filter(|s| {
                s["name"] == "sluice_upstream_errors_total" && s["labels"]["backend"] == backend
            })
            .map(|s| s["value"].as_f64().unwrap())
            .sum()
    };
    assert_eq!(
        upstream_err(&main_backend, "status_5xx"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(errors_of(&dead_backend), 1.0, "{text}");
    assert_eq!(errors_of(&main_backend), 1.0, "{text}");
    let attempts = |backend: &str| {
        py_value(
            &fams,
            "sluice_upstream_requests_total",
            &[("backend", backend), ("attempt", "first")],
        )
    };
    assert_eq!(attempts(&main_backend), Some(4.0), "{text}");
    assert_eq!(attempts(&dead_backend), Some(1.0), "{text}");
    assert_eq!(
        py_value(
            &fams,
            "sluice_request_duration_seconds_count",
            &[("route", "chat_completions"), ("model", "gpt-4o")]
        ),
        Some(4.0),
        "{text}"
    );
    assert_eq!(
        py_value(&fams, "sluice_metrics_shards", &[]),
        Some(1.0),
        "{text}"
    );

    // The harness's own parser reads the same numbers.
    let ours = Metrics::parse(&text).unwrap();
    let py_samples: usize = fams
        .iter()
        .map(|f| f["samples"].as_array().unwrap().len())
        .sum();
    assert_eq!(ours.samples.len(), py_samples);

    let h = gw.admin_get("/healthz");
    assert_eq!(h.status, 200, "{}", h.dump());
    let ready = gw.admin_get("/readyz");
    assert_eq!(ready.status, 200, "{}", ready.dump());
}

/// `sluice_upstream_in_flight` of `backend` in a scrape.
fn in_flight(m: &Metrics, backend: &str) -> Option<f64> {
    m.get("sluice_upstream_in_flight", &[("backend", backend)])
}

/// A streamed chat request whose tokens come every `gap_ms`, `tokens` of them.
fn slow_stream(tokens: u32, gap_ms: u32) -> Req {
    Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o"))
        .header("x-mock-tokens", &tokens.to_string())
        .header("x-mock-inter-token-ms", &gap_ms.to_string())
}

#[test]
fn upstream_in_flight_counts_an_exchange_until_it_ends_however_it_ends() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).admin());
    let backend = format!("main/{}", mock.addr);
    let settles_at = |want: f64, when: &str| {
        let m = gw.wait_metrics(METRICS_WAIT, |m| in_flight(m, &backend) == Some(want));
        assert_eq!(in_flight(&m, &backend), Some(want), "{when}");
    };
    settles_at(0.0, "before any request");

    // A stream held open (~5 s) is in flight while it streams, and no longer once it ended.
    let mut c = gw.conn();
    c.send(&slow_stream(25, 200).build());
    let head = c.read_head().expect("stream head");
    assert_eq!(head.status, 200);
    settles_at(1.0, "while a stream is relayed");
    let r = c.read_body(head, "POST");
    assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
    assert!(r.text().contains("[DONE]"), "{}", r.dump());
    settles_at(0.0, "after the stream ended");

    // The client leaves mid-stream: the relay cuts the upstream and the count goes back.
    let mut c = gw.conn();
    c.send(&slow_stream(100, 100).build());
    let head = c.read_head().expect("stream head");
    assert_eq!(head.status, 200);
    settles_at(1.0, "while the second stream is relayed");
    drop(c);
    settles_at(0.0, "after the client left mid-stream");
    assert!(
        wait_until(METRICS_WAIT, || mock.stat("streams_aborted") == 1),
        "the upstream stream was not cut: {}",
        mock.stats()
    );

    // The upstream cuts the stream, or answers an error: counted, then uncounted.
    let r = gw.request(&slow_stream(6, 0).header("x-mock-fault", "drop-mid-stream"));
    assert_eq!(r.status, 200, "{}", r.dump());
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-status", "503"),
    );
    assert_eq!(r.status, 503, "{}", r.dump());
    let m = gw.wait_metrics(METRICS_WAIT, |m| {
        m.get(
            "sluice_upstream_requests_total",
            &[("backend", &backend), ("attempt", "first")],
        ) == Some(4.0)
    });
    assert_eq!(
        in_flight(&m, &backend),
        Some(0.0),
        "after an upstream cut and a 503"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. The log under load
// ---------------------------------------------------------------------------------------------

#[test]
fn access_log_written_under_load_decodes_completely() {
    const CONNS: usize = 8;
    const PER_CONN: usize = 250;
    let mock = Mock::start(&["--tokens", "4"]);
    let log = TempDir::new("obs-load");
    // Small files, so the writers rotate while under load.
    let gw = observed(
        Config::one_cluster(&mock)
            .workers(2)
            .access_log_opt("max_file_bytes", 64 * 1024),
        &log,
    );

    let addr = gw.addr;
    let threads: Vec<_> = (0..CONNS)
        .map(|t| {
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                let mut streamed = 0usize;
                for i in 0..PER_CONN {
                    let stream = (t + i) % 2 == 0;
                    let body = if stream {
                        stream_usage_body("gpt-4o")
                    } else {
                        chat_body("gpt-4o")
                    };
                    c.send(&Req::post("/v1/chat/completions", &body).build());
                    let r = c.read_response();
                    assert_eq!(r.status, 200, "request {i} on conn {t}:\n{}", r.dump());
                    assert_eq!(r.end, BodyEnd::Complete, "request {i} on conn {t}");
                    assert!(
                        !r.header_has_token("connection", "close"),
                        "keep-alive lost at request {i} on conn {t}"
                    );
                    streamed += usize::from(stream);
                }
                streamed
            })
        })
        .collect();
    let streamed: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let sent = CONNS * PER_CONN;

    let d = wait_access_log(log.path(), Duration::from_secs(20), |d| {
        d.ok && d.records.len() >= sent
    });
    assert!(d.ok, "sluice logs failed: {}", d.describe());
    assert_eq!(d.records.len(), sent, "{}", d.describe());
    assert!(d.files.len() > 2, "no rotation: {:?}", d.files);
    for f in &d.files {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("access-w0-") || name.starts_with("access-w1-"),
            "unexpected file {name}"
        );
    }
    let mut stream_recs = 0;
    for (i, rec) in d.records.iter().enumerate() {
        assert_eq!(u(rec, "status"), 200, "record {i}: {rec}");
        assert!(u(rec, "latency_us") > 0, "record {i}: {rec}");
        assert_eq!(s(rec, "requested_model"), "gpt-4o", "record {i}: {rec}");
        assert_eq!(s(rec, "error_class"), "", "record {i}: {rec}");
        assert_eq!(
            s(rec, "usage_source"),
            "USAGE_SOURCE_REPORTED",
            "record {i}: {rec}"
        );
        assert_eq!(u(rec, "completion_tokens"), 4, "record {i}: {rec}");
        assert!(u(rec, "worker_id") < 2, "record {i}: {rec}");
        stream_recs += usize::from(rec["stream"] == true);
    }
    assert_eq!(stream_recs, streamed);
}

// ---------------------------------------------------------------------------------------------
// 6. x-sluice-overhead-us
// ---------------------------------------------------------------------------------------------

fn overhead_header(r: &Response) -> u64 {
    let v = r
        .header("x-sluice-overhead-us")
        .unwrap_or_else(|| panic!("no x-sluice-overhead-us:\n{}", r.dump()));
    v.parse()
        .unwrap_or_else(|e| panic!("x-sluice-overhead-us {v:?} is not an integer: {e}"))
}

#[test]
fn overhead_header_is_on_proxied_responses_and_excludes_upstream_time() {
    let mock = Mock::start(&["--tokens", "3"]);
    let gw = Sluice::start(&Config::one_cluster(&mock));
    let delay = Duration::from_millis(300);
    for stream in [false, true] {
        let body = if stream {
            chat_stream_body("gpt-4o")
        } else {
            chat_body("gpt-4o")
        };
        for delayed in [false, true] {
            let mut req = Req::post("/v1/chat/completions", &body);
            if delayed {
                req = req.header("x-mock-delay-ms", &delay.as_millis().to_string());
            }
            let mut c = gw.conn();
            let sent = Instant::now();
            c.send(&req.build());
            let r = c.read_response();
            assert_eq!(r.status, 200, "{}", r.dump());
            assert_eq!(r.end, BodyEnd::Complete, "{}", r.dump());
            let end = r.pieces.last().map_or(r.head_at, |p| p.at);
            let total = end.duration_since(sent);
            let overhead = overhead_header(&r);
            assert!(
                u128::from(overhead) < total.as_micros(),
                "stream={stream} delayed={delayed}: overhead {overhead} µs >= total {total:?}"
            );
            if delayed {
                // The 300 ms the upstream took before its head is not Sluice's time.
                assert!(
                    u128::from(overhead) + 250_000 < total.as_micros(),
                    "stream={stream}: overhead {overhead} µs counts the upstream's {delay:?} \
                     (total {total:?})"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The record's fields, as proto/accesslog.proto defines them
// ---------------------------------------------------------------------------------------------

/// Send `req` with `Connection: close` and read every byte until the gateway closes; returns
/// the client's address, the bytes sent and the bytes received.
fn exchange_raw(gw: &Sluice, req: &Req) -> (std::net::SocketAddr, usize, usize) {
    let (local, sent, received) = exchange_raw_bytes(gw, req);
    (local, sent, received.len())
}

/// [`exchange_raw`], returning the bytes received.
fn exchange_raw_bytes(gw: &Sluice, req: &Req) -> (std::net::SocketAddr, usize, Vec<u8>) {
    let req = req.clone().header("Connection", "close");
    let bytes = req.build();
    let mut c = gw.conn();
    let local = c.stream().local_addr().unwrap();
    c.send(&bytes);
    while c.read_more().expect("read until close") > 0 {}
    (local, bytes.len(), c.buffered().to_vec())
}

/// One exchange as the client saw it.
struct Exchange {
    stream: bool,
    local: std::net::SocketAddr,
    sent: usize,
}

/// A non-streamed and a streamed request (each on its own `Connection: close` connection)
/// through a gateway with an access log; returns the exchanges and their records, in order.
fn two_exchanges(tag: &str) -> (Mock, Vec<(Exchange, Value)>) {
    let mock = Mock::start(&["--tokens", "3"]);
    let log = TempDir::new(tag);
    let gw = observed(Config::one_cluster(&mock), &log);
    let mut seen = Vec::new();
    for stream in [false, true] {
        let body = if stream {
            stream_usage_body("gpt-4o")
        } else {
            chat_body("gpt-4o")
        };
        let (local, sent, _) = exchange_raw(&gw, &Req::post("/v1/chat/completions", &body));
        seen.push(Exchange {
            stream,
            local,
            sent,
        });
        // One record per exchange before the next, so records and exchanges pair up.
        wait_records(log.path(), seen.len(), LOG_WAIT);
    }
    let recs = wait_records(log.path(), 2, LOG_WAIT);
    assert_eq!(recs.len(), 2);
    (mock, seen.into_iter().zip(recs).collect())
}

fn what(x: &Exchange) -> &'static str {
    if x.stream {
        "streamed"
    } else {
        "non-streamed"
    }
}

#[test]
fn record_fields_describe_the_exchange() {
    let (mock, pairs) = two_exchanges("obs-fields");
    for (x, rec) in &pairs {
        let what = what(x);
        assert_eq!(s(rec, "client_addr"), x.local.to_string(), "{what}: {rec}");
        assert_eq!(s(rec, "method"), "POST", "{what}: {rec}");
        assert_eq!(s(rec, "path"), "/v1/chat/completions", "{what}: {rec}");
        assert_eq!(u(rec, "status"), 200, "{what}: {rec}");
        assert_eq!(s(rec, "requested_model"), "gpt-4o", "{what}: {rec}");
        assert_eq!(s(rec, "cluster"), "main", "{what}: {rec}");
        assert_eq!(s(rec, "backend"), mock.addr.to_string(), "{what}: {rec}");
        assert_eq!(rec["stream"], x.stream, "{what}: {rec}");
        assert_eq!(s(rec, "error_class"), "", "{what}: {rec}");
        assert_eq!(u(rec, "fallback_attempts"), 0, "{what}: {rec}");
        assert_eq!(u(rec, "worker_id"), 0, "{what}: {rec}");
        assert_eq!(u(rec, "bytes_in"), x.sent as u64, "{what}: {rec}");
        assert!(
            u(rec, "overhead_us") < u(rec, "latency_us"),
            "{what}: {rec}"
        );
    }
}

/// proto: mapped_model "equals `requested_model` when no mapping applied".
#[test]
fn record_mapped_model_equals_the_requested_one_without_a_mapping() {
    let (_mock, pairs) = two_exchanges("obs-mapped");
    for (x, rec) in &pairs {
        assert_eq!(s(rec, "mapped_model"), "gpt-4o", "{}: {rec}", what(x));
    }
}

/// proto: bytes_out is "Bytes sent to the client (response head + body)": for a relayed
/// body of either framing, and for an answer Sluice wrote itself.
#[test]
fn record_bytes_out_counts_every_byte_sent_to_the_client() {
    let mock = Mock::start(&["--tokens", "3"]);
    let log = TempDir::new("obs-bytes-out");
    let gw = observed(Config::one_cluster(&mock), &log);
    let cases = [
        ("non-streamed", chat_body("gpt-4o")),
        ("streamed", stream_usage_body("gpt-4o")),
        ("model_not_found", chat_body("no-such-model")),
    ];
    let mut got = Vec::new();
    for (n, (what, body)) in cases.iter().enumerate() {
        let (_, _, received) = exchange_raw(&gw, &Req::post("/v1/chat/completions", body));
        let recs = wait_records(log.path(), n + 1, LOG_WAIT);
        got.push((*what, u(&recs[n], "bytes_out"), received as u64));
    }
    for (what, logged, received) in &got {
        assert_eq!(
            logged, received,
            "{what}: bytes_out {logged}, the client received {received} \
             (all as (case, bytes_out, received): {got:?})"
        );
    }
}

#[test]
fn record_time_is_when_the_request_arrived() {
    let mock = Mock::start(&["--tokens", "2"]);
    let log = TempDir::new("obs-time");
    let gw = observed(Config::one_cluster(&mock), &log);
    let before = now_unix_us();
    let r = gw.request(
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o")).header("x-mock-delay-ms", "400"),
    );
    let after = now_unix_us();
    assert_eq!(r.status, 200, "{}", r.dump());
    let recs = wait_records(log.path(), 1, LOG_WAIT);
    let rec = &recs[0];
    let t = u(rec, "time_unix_us");
    let latency = u(rec, "latency_us");
    assert!(latency >= 400_000, "{rec}");
    // "When the request arrived", not when the record was written (which is after the 400 ms
    // upstream delay). The gateway stamps the end of `latency_us` after its last write, which a
    // busy scheduler can delay past the client's own clock read, so the end is checked with
    // room for that; the start must fall before the upstream delay could have passed.
    assert!(
        t >= before && t < before + 100_000,
        "time_unix_us {t} is not the arrival: request sent at {before}, answered by {after} \
         ({} µs after sending), latency_us {latency}: {rec}",
        t.saturating_sub(before)
    );
    assert!(
        t + latency <= after + 50_000,
        "latency_us {latency} ends after the answer: {rec}"
    );
}

// ---------------------------------------------------------------------------------------------
// Non-streamed answers kept where they are read (relay `KeptBody`)
// ---------------------------------------------------------------------------------------------

/// One scripted answer: its bytes as written, a pause between pieces, and whether the upstream
/// then closes the connection.
struct Answer {
    pieces: Vec<Vec<u8>>,
    then_close: bool,
}

/// An upstream that counts its connections and answers each request it reads whole (head and
/// Content-Length body) with the next scripted answer; with none left it closes.
fn scripted_upstream(
    answers: Vec<Answer>,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let conns = Arc::new(AtomicUsize::new(0));
    let answers = Arc::new(Mutex::new(std::collections::VecDeque::from(answers)));
    let counted = conns.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            let answers = answers.clone();
            std::thread::spawn(move || loop {
                // The request: its head, then as many body bytes as it says.
                let mut got = Vec::new();
                let mut buf = [0u8; 8192];
                let head_end = loop {
                    if let Some(end) = head_end(&got) {
                        break end;
                    }
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                while got.len() < head_end + len {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let Some(answer) = answers.lock().unwrap().pop_front() else {
                    return;
                };
                for (i, piece) in answer.pieces.iter().enumerate() {
                    if i > 0 {
                        #[allow(clippy::disallowed_methods)]
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if stream.write_all(piece).is_err() {
                        return;
                    }
                }
                if answer.then_close {
                    return;
                }
            });
        }
    });
    (port, conns)
}

/// Where the HTTP head at the start of `bytes` ends (after its blank line), once it is all there.
fn head_end(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
}

/// A chat completion of about `size` bytes reporting 11 prompt and 22 completion tokens, its
/// content dense with escapes (as the meter's scanner must get through), and its response head.
fn large_answer(size: usize) -> (Vec<u8>, Vec<u8>) {
    let text = "tok \\\"q\\\" \\n ".repeat(size / 14);
    let body = format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":11,"completion_tokens":22,"total_tokens":33}}}}"#
    )
    .into_bytes();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    (head, body)
}

fn joined(a: &[u8], b: &[u8]) -> Vec<u8> {
    [a, b].concat()
}

#[test]
fn a_large_answer_reaches_the_client_whole_and_is_metered_where_it_was_read() {
    let (head, body) = large_answer(300_000);
    let answer = |pieces: Vec<Vec<u8>>| Answer {
        pieces,
        then_close: false,
    };
    let answers = vec![
        // A few body bytes with the head (copied behind it), the rest in two reads.
        answer(vec![
            joined(&head, &body[..1000]),
            body[1000..70_000].to_vec(),
            body[70_000..].to_vec(),
        ]),
        // Many body bytes with the head (the head and them in one vectored write).
        answer(vec![
            joined(&head, &body[..20_000]),
            body[20_000..].to_vec(),
        ]),
        // The head alone, then the whole body.
        answer(vec![head.clone(), body.clone()]),
    ];
    let n = answers.len();
    let (port, conns) = scripted_upstream(answers);
    let log = TempDir::new("obs-kept-body");
    let gw = observed(
        Config::backend_url(&format!("http://127.0.0.1:{port}/v1")).workers(1),
        &log,
    );
    for i in 0..n {
        let req = Req::post("/v1/chat/completions", &chat_body("gpt-4o"));
        let (_, _, received) = exchange_raw_bytes(&gw, &req);
        let at = head_end(&received).expect("a response head");
        assert!(
            received[..at].starts_with(b"HTTP/1.1 200"),
            "answer {i}: {}",
            String::from_utf8_lossy(&received[..at])
        );
        assert!(
            received[at..] == body[..],
            "answer {i}: the body differs ({} bytes arrived, {} sent)",
            received.len() - at,
            body.len()
        );
        let recs = wait_records(log.path(), i + 1, LOG_WAIT);
        let rec = &recs[i];
        assert_eq!(
            s(rec, "usage_source"),
            "USAGE_SOURCE_REPORTED",
            "answer {i}: {rec}"
        );
        assert_eq!(
            (u(rec, "prompt_tokens"), u(rec, "completion_tokens")),
            (11, 22),
            "answer {i}: {rec}"
        );
        assert_eq!(
            u(rec, "bytes_out"),
            received.len() as u64,
            "answer {i}: {rec}"
        );
        assert_eq!(s(rec, "error_class"), "", "answer {i}: {rec}");
    }
    // Each body ended where its length said: the one upstream connection served them all.
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn bytes_past_an_answers_length_are_not_relayed_and_its_connection_is_not_reused() {
    let (head, body) = large_answer(50_000);
    let mut overrun = joined(&head, &body);
    overrun.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
    let answers = vec![
        // The body, then bytes that belong to no request, in one write.
        Answer {
            pieces: vec![overrun[..10_000].to_vec(), overrun[10_000..].to_vec()],
            then_close: false,
        },
        Answer {
            pieces: vec![joined(&head, &body)],
            then_close: false,
        },
    ];
    let (port, conns) = scripted_upstream(answers);
    let log = TempDir::new("obs-kept-overrun");
    let gw = observed(
        Config::backend_url(&format!("http://127.0.0.1:{port}/v1")).workers(1),
        &log,
    );
    for i in 0..2 {
        let r = gw.chat(&chat_body("gpt-4o"));
        assert_eq!(r.status, 200, "answer {i}: {}", r.dump());
        assert!(r.body == body, "answer {i}: {} body bytes", r.body.len());
        let recs = wait_records(log.path(), i + 1, LOG_WAIT);
        assert_eq!(
            u(&recs[i], "completion_tokens"),
            22,
            "answer {i}: {}",
            recs[i]
        );
    }
    // The first connection was left with bytes of no request on it: the second answer came
    // on a new one.
    assert_eq!(conns.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[test]
fn an_answer_cut_mid_body_is_cut_for_the_client_and_logged_as_the_upstreams_abort() {
    let (head, body) = large_answer(200_000);
    let answers = vec![Answer {
        pieces: vec![
            joined(&head, &body[..30_000]),
            body[30_000..120_000].to_vec(),
        ],
        then_close: true,
    }];
    let (port, _) = scripted_upstream(answers);
    let log = TempDir::new("obs-kept-cut");
    let mut gw = observed(
        Config::backend_url(&format!("http://127.0.0.1:{port}/v1")).workers(1),
        &log,
    );
    let (_, _, received) = exchange_raw_bytes(
        &gw,
        &Req::post("/v1/chat/completions", &chat_body("gpt-4o")),
    );
    let at = head_end(&received).expect("a response head");
    // What arrived is the body's start, not all of it: the client can tell it was cut.
    assert_eq!(&received[at..], &body[..120_000]);
    let rec = &wait_records(log.path(), 1, LOG_WAIT)[0];
    assert_eq!(s(rec, "error_class"), "upstream_abort", "{rec}");
    assert_eq!(u(rec, "bytes_out"), received.len() as u64, "{rec}");
    // A cut answer reports no usage: the request is billed by estimate.
    assert_eq!(s(rec, "usage_source"), "USAGE_SOURCE_ESTIMATED", "{rec}");
    // The gateway is fine after it.
    assert!(gw.is_running());
}

/// Hostile clients II, item 2 (the record's bound): a client's `model` is the one field of an
/// access record it writes freely. Five requests naming a 1 MB model write records of a few
/// hundred bytes each, the model cut to its first 256 bytes, and the 404's message to 128.
#[test]
fn a_record_stays_small_whatever_model_the_client_names() {
    let mock = Mock::start(&[]);
    let log = TempDir::new("record-bound");
    let gw = Sluice::start(
        &Config::one_cluster(&mock)
            .access_log(log.path())
            .access_log_opt("flush_interval_ms", 20),
    );
    let model = "é".repeat(500_000); // 1 MB, two bytes a character
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    for _ in 0..5 {
        let r = gw.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 404, "{}", r.dump());
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.len() < 300, "{} bytes of message", message.len());
    }
    let records = wait_records(log.path(), 5, Duration::from_secs(10));
    for record in &records {
        let logged = record["requested_model"].as_str().unwrap();
        assert_eq!(logged, "é".repeat(128), "cut at a character boundary");
    }
    let on_disk: u64 = std::fs::read_dir(log.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(on_disk < 5 * 1024, "{on_disk} bytes of log for 5 records");
    assert_eq!(mock.stat("requests"), 0);
}

/// Has the admin listener closed `s` (non-blocking)? An idle socket is never answered.
fn admin_closed(s: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    match s.read(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => panic!("the admin listener wrote to a socket that sent nothing"),
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// Issue #40 item 3: a thousand sockets that connect to the admin port and send nothing, kept
/// open, and reopened as the listener closes them, never take `/healthz` or `/metrics` down
/// (before, 16 of them made every probe a 503 for as long as they stayed).
#[test]
fn healthz_and_metrics_answer_while_a_thousand_idle_sockets_hold_the_admin_port() {
    let dead = dead_port();
    let gw = Sluice::start(&Config::backend_url(&format!("http://127.0.0.1:{dead}/v1")).admin());
    let addr = gw.admin_addr();
    let connect = || {
        let s = std::net::TcpStream::connect_timeout(&addr, IO_TIMEOUT).expect("connect");
        s.set_nonblocking(true).expect("non-blocking");
        s
    };
    let mut idle: Vec<_> = (0..1000).map(|_| connect()).collect();

    let h = gw.admin_get("/healthz");
    assert_eq!((h.status, h.text().as_str()), (200, "ok"), "{}", h.dump());
    let m = gw.admin_get("/metrics");
    assert_eq!(m.status, 200, "{}", m.dump());
    assert_eq!(m.end, BodyEnd::Complete, "{}", m.dump());
    let r = gw.admin_get("/readyz");
    assert_eq!(r.status, 200, "{}", r.dump());

    // Past the idle deadline (2 s) the silent sockets are closed; for a second the attacker
    // reopens each as it goes, while the probes go on.
    std::thread::sleep(Duration::from_millis(2500));
    let until = Instant::now() + Duration::from_secs(1);
    let mut reopened = 0;
    while Instant::now() < until {
        for s in idle.iter_mut() {
            if admin_closed(s) {
                *s = connect();
                reopened += 1;
            }
        }
        let h = gw.admin_get("/healthz");
        assert_eq!(h.status, 200, "while reconnecting: {}", h.dump());
    }
    assert!(
        reopened >= idle.len(),
        "every idle socket is closed at the idle deadline; {reopened} were"
    );
    let h = gw.admin_get("/healthz");
    assert_eq!((h.status, h.text().as_str()), (200, "ok"), "{}", h.dump());
    assert_eq!(gw.admin_get("/metrics").status, 200);
}
