//! The same tokens count the same in every dialect (issue #14, "Usage, cost and limits
//! identical for the same token counts in both dialects, cache read / write included"): an
//! OpenAI client and an Anthropic client, each against an OpenAI-dialect and an
//! Anthropic-dialect cluster, streamed and not — eight requests whose upstream reports the same
//! counts (40 uncached prompt tokens, 30 cache reads, 20 cache writes, 5 output tokens; one
//! mock-llm serves both dialects) — are answered with those counts in the client's own terms,
//! logged with the same numbers and cost, counted the same in `sluice_tokens_total` and
//! `sluice_cost_total`, and charged the same to a TPM limit. The Anthropic client against the
//! Anthropic cluster is the byte-for-byte passthrough, metered in Anthropic's terms.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::*;

const KEY: &str = "sk-dialects-1";
const UNCACHED: u64 = 40;
const CACHE_READ: u64 = 30;
const CACHE_WRITE: u64 = 20;
const OUTPUT: u64 = 5;
const PROMPT: u64 = UNCACHED + CACHE_READ + CACHE_WRITE;
/// Per million tokens: input 1, output 4, cache reads 0.1, cache writes 1.25.
const COST: f64 = (UNCACHED as f64 * 1.0
    + CACHE_READ as f64 * 0.1
    + CACHE_WRITE as f64 * 1.25
    + OUTPUT as f64 * 4.0)
    / 1e6;

/// `via-openai` → the mock as an OpenAI-dialect cluster, `via-anthropic` → the same mock as an
/// Anthropic-dialect one, both as upstream model `m` (priced); `probe` → the OpenAI one as `p`
/// (unpriced). One key, under an hour-long TPM limit.
fn config(mock: &Mock, log: &TempDir) -> Config {
    Config::new()
        .admin()
        .env("ANTHROPIC_KEY", "sk-ant-dialects")
        .access_log(log.path())
        .access_log_opt("flush_interval_ms", 20)
        .raw(&format!(
            r#"
[clusters.oa]
backends = [{{ base_url = {url} }}]

[clusters.an]
backends = [{{ base_url = {url} }}]
dialect = "anthropic"
credential = {{ env = "ANTHROPIC_KEY", header = "x-api-key" }}

[[routes]]
model = "via-openai"
groups = [{{ targets = [{{ cluster = "oa", model = "m" }}] }}]

[[routes]]
model = "via-anthropic"
groups = [{{ targets = [{{ cluster = "an", model = "m" }}] }}]

[[routes]]
model = "probe"
groups = [{{ targets = [{{ cluster = "oa", model = "p" }}] }}]

[pricing."m"]
input = 1.0
output = 4.0
cached_input = 0.1
cache_write_input = 1.25

[[keys]]
id = "dialects"
sha256 = "{hash}"

[[policies]]
id = "tpm"
per = "key"
max_tokens = 1000000
tokens_window_secs = 3600
"#,
            url = toml_str(&mock.base_url()),
            hash = key_hash(KEY),
        ))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Client {
    OpenAi,
    Anthropic,
}

/// One request with the counts above; returns the response.
fn send(gw: &Sluice, client: Client, model: &str, stream: bool) -> Response {
    let counts = [
        ("x-mock-prompt-tokens", UNCACHED),
        ("x-mock-cache-read", CACHE_READ),
        ("x-mock-cache-write", CACHE_WRITE),
    ];
    let messages = json!([{"role": "user", "content": "hello"}]);
    let mut req = match client {
        Client::OpenAi => {
            let mut body = json!({"model": model, "max_tokens": 16, "messages": messages,
                                  "stream": stream});
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            Req::post("/v1/chat/completions", &body.to_string())
        }
        Client::Anthropic => {
            let body = json!({"model": model, "max_tokens": 16, "messages": messages,
                              "stream": stream});
            Req::post("/v1/messages", &body.to_string()).header("anthropic-version", "2023-06-01")
        }
    };
    req = req.header("x-api-key", KEY);
    for (name, n) in counts {
        req = req.header(name, &n.to_string());
    }
    gw.request(&req)
}

/// The usage the client was given, in its own dialect's terms: a whole body's `usage`; a
/// stream's last usage chunk (OpenAI), or `message_start`'s usage overwritten field by field by
/// `message_delta`'s (Anthropic, as its SDK accumulates them).
fn client_usage(client: Client, stream: bool, r: &Response) -> Value {
    if !stream {
        return r.json()["usage"].clone();
    }
    let events = r.sse_events();
    match client {
        Client::OpenAi => {
            assert!(events.last().is_some_and(|e| e.is_done()), "{}", r.dump());
            events
                .iter()
                .rev()
                .filter_map(|e| e.json())
                .find(|v| v["usage"].is_object())
                .map(|v| v["usage"].clone())
                .unwrap_or_else(|| panic!("no usage chunk: {}", r.dump()))
        }
        Client::Anthropic => {
            let mut usage = json!({});
            for e in &events {
                let Some(v) = e.json() else { continue };
                let part = match e.event.as_deref() {
                    Some("message_start") => &v["message"]["usage"],
                    Some("message_delta") => &v["usage"],
                    _ => continue,
                };
                for (k, n) in part.as_object().unwrap() {
                    usage[k] = n.clone();
                }
            }
            assert_eq!(
                events.last().and_then(|e| e.event.clone()).as_deref(),
                Some("message_stop"),
                "{}",
                r.dump()
            );
            usage
        }
    }
}

fn header_num(r: &Response, name: &str) -> u64 {
    r.header(name)
        .unwrap_or_else(|| panic!("no {name}: {}", r.dump()))
        .parse()
        .unwrap()
}

#[test]
fn the_same_token_counts_bill_the_same_in_every_dialect() {
    let mock = Mock::start(&["--tokens", &OUTPUT.to_string()]);
    let log = TempDir::new("dialects");
    let gw = Sluice::start(&config(&mock, &log));
    // Remaining tokens are comparable only within one window.
    wait_out_window_edge(3600, 30);

    // Between two identical probes, the TPM remaining drops by the first probe's usage plus
    // what the request between them was charged (the probes' reservations cancel out).
    let mut done = 0.0;
    let probe = || {
        let r = gw.request(
            &Req::post(
                "/v1/chat/completions",
                &json!({"model": "probe", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "probe"}]})
                .to_string(),
            )
            .header("x-api-key", KEY)
            .header("x-mock-prompt-tokens", "3"),
        );
        assert_eq!(r.status, 200, "{}", r.dump());
        let used = r.json()["usage"]["total_tokens"].as_u64().unwrap();
        (header_num(&r, "x-ratelimit-remaining-tokens"), used)
    };
    let mut settled = |n: f64| {
        // A request is settled before it is counted: once the metrics show it, the limiter
        // has charged it.
        done += n;
        let want = done;
        gw.wait_metrics(Duration::from_secs(10), |m| {
            m.sum("sluice_requests_total", &[]) >= want
        });
    };

    let mut cases = Vec::new();
    for client in [Client::OpenAi, Client::Anthropic] {
        for model in ["via-openai", "via-anthropic"] {
            for stream in [false, true] {
                cases.push((client, model, stream));
            }
        }
    }
    let (mut remaining, mut probe_used) = probe();
    settled(1.0);
    for &(client, model, stream) in &cases {
        let case = format!("{client:?} client, {model}, stream={stream}");
        let r = send(&gw, client, model, stream);
        assert_eq!(r.status, 200, "{case}: {}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "{case}: {}", r.dump());
        let usage = client_usage(client, stream, &r);
        match client {
            Client::OpenAi => {
                assert_eq!(usage["prompt_tokens"], PROMPT, "{case}: {usage}");
                assert_eq!(usage["completion_tokens"], OUTPUT, "{case}: {usage}");
                assert_eq!(usage["total_tokens"], PROMPT + OUTPUT, "{case}: {usage}");
                let details = &usage["prompt_tokens_details"];
                assert_eq!(details["cached_tokens"], CACHE_READ, "{case}: {usage}");
                assert_eq!(
                    details["cache_write_tokens"], CACHE_WRITE,
                    "{case}: {usage}"
                );
            }
            Client::Anthropic => {
                assert_eq!(usage["input_tokens"], UNCACHED, "{case}: {usage}");
                assert_eq!(
                    usage["cache_read_input_tokens"], CACHE_READ,
                    "{case}: {usage}"
                );
                assert_eq!(
                    usage["cache_creation_input_tokens"], CACHE_WRITE,
                    "{case}: {usage}"
                );
                assert_eq!(usage["output_tokens"], OUTPUT, "{case}: {usage}");
            }
        }
        settled(1.0);
        let (after, used) = probe();
        settled(1.0);
        let charged = remaining
            .checked_sub(after)
            .and_then(|d| d.checked_sub(probe_used))
            .unwrap_or_else(|| panic!("{case}: remaining went {remaining} -> {after}"));
        assert_eq!(charged, PROMPT + OUTPUT, "{case}: charged to the TPM limit");
        (remaining, probe_used) = (after, used);
    }
    assert_eq!(
        mock.stat("invalid_requests"),
        0,
        "the mock refused a request"
    );

    // The access log: the same numbers and cost for all eight.
    let recs = wait_records(log.path(), 2 * cases.len() + 1, Duration::from_secs(10));
    let recs: Vec<&Value> = recs
        .iter()
        .filter(|r| r["requested_model"] != "probe")
        .collect();
    assert_eq!(recs.len(), cases.len());
    for rec in &recs {
        assert_eq!(rec["status"], 200, "{rec}");
        assert_eq!(rec["mapped_model"], "m", "{rec}");
        assert_eq!(rec["usage_source"], "USAGE_SOURCE_REPORTED", "{rec}");
        assert_eq!(rec["prompt_tokens"], PROMPT, "{rec}");
        assert_eq!(rec["completion_tokens"], OUTPUT, "{rec}");
        assert_eq!(rec["total_tokens"], PROMPT + OUTPUT, "{rec}");
        assert_eq!(rec["cached_tokens"], CACHE_READ, "{rec}");
        assert_eq!(rec["cache_write_tokens"], CACHE_WRITE, "{rec}");
        let cost = rec["cost"].as_f64().unwrap();
        assert!(
            (cost - COST).abs() < 1e-12,
            "cost {cost}, want {COST}: {rec}"
        );
    }
    let paths = |p: &str| recs.iter().filter(|r| r["path"] == p).count();
    assert_eq!(paths("/v1/messages"), 4);
    assert_eq!(paths("/v1/chat/completions"), 4);

    // Metrics: per requested model, four requests' worth of each token type and of cost.
    let m = gw.metrics();
    for model in ["via-openai", "via-anthropic"] {
        let tokens = |t: &str| m.sum("sluice_tokens_total", &[("model", model), ("type", t)]);
        assert_eq!(tokens("prompt"), 4.0 * PROMPT as f64, "{model}\n{}", m.text);
        assert_eq!(tokens("completion"), 4.0 * OUTPUT as f64, "{model}");
        assert_eq!(tokens("cached"), 4.0 * CACHE_READ as f64, "{model}");
        assert_eq!(tokens("cache_write"), 4.0 * CACHE_WRITE as f64, "{model}");
        let cost = m.sum("sluice_cost_total", &[("model", model)]);
        assert!((cost - 4.0 * COST).abs() < 1e-9, "{model}: cost {cost}");
    }
}
