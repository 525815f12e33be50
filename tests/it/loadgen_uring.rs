//! `sluice-load`'s io_uring engine, black-box, against `mock-llm`: the JSON keys it added
//! (under both engines), open-loop pacing whose queueing shows in the latency, timeouts, and
//! more than a thousand concurrent streams on one thread. `tests/it/loadgen.rs` covers what
//! both engines share (run it with `SLUICE_LOAD_ENGINE=threads` for the old engine).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use sluice_tests::*;

/// Run `sluice-load` (its default engine unless `args` say) with `args`; returns (stdout,
/// stderr, parsed JSON).
fn load(url: &str, args: &[&str]) -> (String, String, Value) {
    run_sluice_load(url, args, LoadEngine::Default)
}

fn ms(v: &Value, hist: &str, q: &str) -> f64 {
    v[hist][q]
        .as_f64()
        .unwrap_or_else(|| panic!("{hist}.{q}: {v}"))
}

/// The engine the run used is the one asked for (a failed ring setup would have fallen back
/// to threads, with a note on stderr).
fn assert_engine(v: &Value, engine: &str, stderr: &str) {
    assert_eq!(v["engine"], engine, "stderr: {stderr}");
}

/// A histogram that may hold zeros (queue_wait, send_lag): ordered quantiles, a V2 HDR blob.
fn assert_hist_from_zero(v: &Value, name: &str) {
    let h = &v[name];
    assert!(h["count"].as_u64().unwrap() > 0, "{name}: {h}");
    let qs: Vec<f64> = ["min_ms", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms"]
        .iter()
        .map(|q| h[*q].as_f64().unwrap())
        .collect();
    assert!(qs.windows(2).all(|w| w[0] <= w[1]), "{name}: {h}");
    assert!(qs[0] >= 0.0, "{name}: {h}");
    assert!(h["hdr_v2_base64"].as_str().unwrap().starts_with("HISTEw"));
}

/// Lets this process (and so the mock it spawns) hold as many descriptors as allowed.
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit calls on a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    lim.rlim_cur
}

#[test]
fn new_keys_under_both_engines() {
    let mock = Mock::start(&[]);
    for engine in ["uring", "threads"] {
        let (stdout, stderr, v) = load(
            &mock.chat_url(),
            &[
                "--engine",
                engine,
                "--connections",
                "4",
                "--duration",
                "1s",
                "--warmup",
                "100ms",
            ],
        );
        assert_engine(&v, engine, &stderr);
        let ok = v["ok"].as_u64().unwrap();
        assert!(ok >= 50, "{engine}: {stdout}");
        assert_eq!(v["errors_total"], 0, "{engine}: {v}");
        // Every measured request went out once: one send_lag and one queue_wait sample each.
        for h in ["send_lag", "queue_wait"] {
            assert_hist_from_zero(&v, h);
            assert_eq!(v[h]["count"], ok, "{engine} {h}: {v}");
        }
        // Closed loop: a request is sent by the connection that just got the previous answer,
        // so it never queues; its send lag is the loop's own bookkeeping.
        assert_eq!(ms(&v, "queue_wait", "max_ms"), 0.0, "{engine}: {v}");
        assert!(ms(&v, "send_lag", "p50_ms") < 5.0, "{engine}: {v}");
        let cpu = v["client_cpu_us_per_req"].as_f64().unwrap();
        assert!(cpu > 0.0 && cpu < 100_000.0, "{engine}: cpu {cpu}");
        let max = v["max_in_flight"].as_u64().unwrap();
        assert!((1..=4).contains(&max), "{engine}: max_in_flight {max}");
        // A buffer per connection at least: the ring never ran dry.
        assert_eq!(v["recv_enobufs"], 0, "{engine}: {v}");
        assert!(stdout.contains(&format!("engine {engine}")), "{stdout}");
    }
}

#[test]
fn engine_env_default_and_bad_values() {
    let mock = Mock::start(&[]);
    let run = |env: Option<&str>, args: &[&str]| {
        let mut cmd = Command::new(bin("sluice-load"));
        cmd.env_remove("SLUICE_LOAD_ENGINE");
        if let Some(e) = env {
            cmd.env("SLUICE_LOAD_ENGINE", e);
        }
        cmd.arg("--url")
            .arg(mock.chat_url())
            .args(["--connections", "1", "--duration", "100ms"])
            .args(args)
            .output()
            .expect("run sluice-load")
    };
    let out = run(None, &[]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("engine uring"));
    let out = run(Some("threads"), &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("engine threads"));
    // The flag wins over the environment.
    let out = run(Some("threads"), &["--engine", "uring"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("engine uring"));
    for (env, args) in [
        (Some("epoll"), &[][..]),
        (None, &["--engine", "fibers"][..]),
        (None, &["--threads", "0"][..]),
    ] {
        let out = run(env, args);
        assert_eq!(out.status.code(), Some(2), "{env:?} {args:?}");
    }
}

#[test]
fn open_loop_pacing_is_exact_when_nothing_queues() {
    let mock = Mock::start(&[]);
    for threads in ["1", "2"] {
        let (stdout, stderr, v) = load(
            &mock.chat_url(),
            &[
                "--engine",
                "uring",
                "--threads",
                threads,
                "--connections",
                "32",
                "--duration",
                "1s",
                "--rate",
                "500",
            ],
        );
        assert_engine(&v, "uring", &stderr);
        assert_eq!(v["threads"].as_u64().unwrap().to_string(), threads);
        // t_k = t0 + k/R for k = 0..: exactly R x duration requests, over all threads.
        assert_eq!(v["requests"], 500, "{stdout}");
        assert_eq!(v["ok"], 500, "{stdout}");
        assert_eq!(v["send_lag"]["count"], 500, "{stdout}");
        assert!(ms(&v, "send_lag", "p50_ms") < 5.0, "{stdout}");
        assert!(stdout.contains("send lag") && stdout.contains("queue wait"));
    }
}

#[test]
fn open_loop_queueing_counts_in_latency() {
    // Every stream takes >= 200 ms (TTFT), so 4 connections serve at most 20 req/s; 50 req/s
    // are scheduled for 1 s. The requests no connection is free for wait in the FIFO with
    // their intended times: the wait shows in queue_wait and in the latency (no coordinated
    // omission), all 50 are still served, and the run lasts until the last one is answered.
    let mock = Mock::start(&["--ttft-ms", "200", "--tokens", "1"]);
    let t = Instant::now();
    let (stdout, stderr, v) = load(
        &mock.chat_url(),
        &[
            "--engine",
            "uring",
            "--connections",
            "4",
            "--duration",
            "1s",
            "--rate",
            "50",
            "--stream",
        ],
    );
    let took = t.elapsed();
    assert_engine(&v, "uring", &stderr);
    assert_eq!(v["ok"], 50, "{stdout}");
    assert_eq!(v["errors_total"], 0, "{stdout}");
    assert_eq!(v["max_in_flight"], 4, "{stdout}");
    assert!(
        took >= Duration::from_millis(2300),
        "ran {took:?}: {stdout}"
    );
    let lat_min = ms(&v, "latency", "min_ms");
    let lat_max = ms(&v, "latency", "max_ms");
    assert!(lat_min >= 195.0, "latency min {lat_min}: {stdout}");
    // The last request, intended at 0.98 s, is answered at about 2.5 s.
    assert!(lat_max > 1200.0, "latency max {lat_max}: {stdout}");
    let qw_max = ms(&v, "queue_wait", "max_ms");
    assert!(qw_max > 1000.0, "queue_wait max {qw_max}: {stdout}");
    assert!(ms(&v, "queue_wait", "p50_ms") > 100.0, "{stdout}");
    assert_eq!(v["queue_wait"]["count"], 50, "{stdout}");
    // Queueing is part of the send lag, and of the latency.
    assert!(ms(&v, "send_lag", "max_ms") >= qw_max, "{stdout}");
    assert!(lat_max >= qw_max + 195.0, "{stdout}");
}

#[test]
fn timeouts_end_stalled_requests() {
    // The mock never answers: each request times out after --timeout, on a fresh connection.
    let mock = Mock::start(&["--fault", "stall"]);
    let t = Instant::now();
    let (_, stderr, v) = load(
        &mock.chat_url(),
        &[
            "--engine",
            "uring",
            "--connections",
            "2",
            "--duration",
            "300ms",
            "--timeout",
            "200ms",
        ],
    );
    assert_engine(&v, "uring", &stderr);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(v["ok"], 0, "{v}");
    let n = v["errors"]["timeout"].as_u64().unwrap();
    // Two per connection: at 0 ms, and at about 220 ms (200 ms plus up to 20 ms of sweep).
    assert!((2..=4).contains(&n), "{n} timeouts: {v}");
    assert_eq!(v["errors_total"], n, "{v}");
    assert!(stderr.contains("timed out"), "{stderr}");
}

#[test]
fn thousand_concurrent_streams() {
    const CONNS: usize = 1200;
    let limit = raise_nofile();
    assert!(
        limit >= 2 * CONNS as u64 + 100,
        "open-file limit {limit} is too low for this test"
    );
    // Each stream lasts about 500 ms (10 events 50 ms apart): in a closed loop all 1,200
    // connections stream at once, twice or more within the second.
    let mock = Mock::start(&["--inter-token-ms", "50", "--tokens", "10"]);
    let conns = CONNS.to_string();
    for threads in ["1", "2"] {
        let (stdout, stderr, v) = load(
            &mock.chat_url(),
            &[
                "--engine",
                "uring",
                "--threads",
                threads,
                "--connections",
                &conns,
                "--duration",
                "1s",
                "--stream",
            ],
        );
        assert_engine(&v, "uring", &stderr);
        assert_eq!(v["errors_total"], 0, "{stdout}\n{stderr}");
        let ok = v["ok"].as_u64().unwrap();
        assert!(ok >= CONNS as u64, "{ok} streams: {stdout}");
        assert_eq!(v["content_events"], ok * 10, "{stdout}");
        assert_eq!(v["max_in_flight"], CONNS as u64, "{stdout}");
        // 10 events 50 ms apart, whoever else is streaming.
        let gap = ms(&v, "event_gap", "p50_ms");
        assert!((40.0..=80.0).contains(&gap), "gap p50 {gap}: {stdout}");
    }
    // Keep-alive: one connection each per run (and the stats probe).
    assert!(
        mock.stat("connections_accepted") <= 2 * CONNS as u64 + 1,
        "{}",
        mock.stats()
    );
}

#[test]
fn queued_requests_take_a_rested_connection_at_once() {
    // A refused port, one connection, 100 requests due in 0.1 s: each connect error rests the
    // connection 10 ms, so the queue drains in about a second, as under the thread engine.
    // (The io_uring engine used to hand out queued requests before the rested connection was
    // back on its free list, so each one waited for the next 100 ms sweep: about 9 s.)
    let url = format!("http://127.0.0.1:{}/v1/chat/completions", dead_port());
    for engine in ["uring", "threads"] {
        let t = Instant::now();
        let (stdout, stderr, v) = load(
            &url,
            &[
                "--engine",
                engine,
                "--connections",
                "1",
                "--duration",
                "100ms",
                "--rate",
                "1000",
            ],
        );
        let took = t.elapsed();
        assert_engine(&v, engine, &stderr);
        assert!(
            took < Duration::from_secs(3),
            "{engine} ran {took:?}: {stdout}"
        );
        assert_eq!(v["requests"], 100, "{engine}: {stdout}");
        assert_eq!(v["errors"]["connect"], 100, "{engine}: {stdout}");
    }
}

#[test]
fn a_hung_server_ends_at_the_grace_deadline() {
    // Every request stalls (no response head, ever). 20 are scheduled over 1 s on 2
    // connections; each stalled one takes --timeout (1 s) to fail, so draining them one after
    // another would take about 10 s. The run stops at the grace deadline instead (the window's
    // end + --timeout), and every request still queued or unanswered then is a timeout.
    let mock = Mock::start(&[]);
    for engine in ["uring", "threads"] {
        let t = Instant::now();
        let (stdout, stderr, v) = load(
            &mock.chat_url(),
            &[
                "--engine",
                engine,
                "--connections",
                "2",
                "--rate",
                "20",
                "--duration",
                "1s",
                "--timeout",
                "1s",
                "--header",
                "x-mock-fault: stall",
            ],
        );
        let took = t.elapsed();
        assert_engine(&v, engine, &stderr);
        assert!(
            took < Duration::from_secs(5),
            "{engine} ran {took:?}: {stdout}"
        );
        assert!(
            took >= Duration::from_millis(1900),
            "{engine} ran {took:?}: {stdout}"
        );
        assert_eq!(v["requests"], 20, "{engine}: {stdout}");
        assert_eq!(v["ok"], 0, "{engine}: {stdout}");
        assert_eq!(v["errors"]["timeout"], 20, "{engine}: {stdout}");
        assert_eq!(v["errors_total"], 20, "{engine}: {stdout}");
        assert!(stderr.contains("grace deadline"), "{engine}: {stderr}");
    }
}

#[test]
fn a_trickling_server_ends_at_the_grace_deadline() {
    // Each stream sends an event every 100 ms for 100 s: every read comes well within
    // --timeout (300 ms), so only the grace deadline (0.5 s + 0.3 s) ends the run.
    let mock = Mock::start(&[]);
    for engine in ["uring", "threads"] {
        let t = Instant::now();
        let (stdout, stderr, v) = load(
            &mock.chat_url(),
            &[
                "--engine",
                engine,
                "--connections",
                "2",
                "--duration",
                "500ms",
                "--timeout",
                "300ms",
                "--stream",
                "--header",
                "x-mock-tokens: 1000",
                "--header",
                "x-mock-inter-token-ms: 100",
            ],
        );
        let took = t.elapsed();
        assert_engine(&v, engine, &stderr);
        assert!(
            took < Duration::from_secs(5),
            "{engine} ran {took:?}: {stdout}"
        );
        assert_eq!(v["ok"], 0, "{engine}: {stdout}");
        assert_eq!(v["errors"]["timeout"], 2, "{engine}: {stdout}");
        assert_eq!(v["errors_total"], 2, "{engine}: {stdout}");
    }
}

/// `sluice-probe uring` runs every variant to the end on messages larger than a receive buffer
/// (40,000 bytes against 16 KiB), so each takes several receives, and reports each one's server
/// CPU per message. Each variant ran as named: multishot receives left armed only under `multi`
/// and `multi-fixed`, zero-copy notifications only under `zc`, direct receives only under
/// `poll`, provided buffers only under `multi*` and `select`.
#[test]
fn uring_probe_measures_every_variant() {
    let mut cmd = Command::new(bin("sluice-probe"));
    cmd.args([
        "uring", "--rounds", "2", "--conns", "3", "--size", "40000", "--warm", "20", "--msgs",
        "300",
    ]);
    let out = output_within(cmd, Duration::from_secs(120), "sluice-probe uring");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for variant in [
        "single",
        "multi",
        "single-fixed",
        "multi-fixed",
        "defer",
        "zc",
    ] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {variant} |")))
            .unwrap_or_else(|| panic!("no row for {variant}:\n{stdout}"));
        let ns: f64 = row
            .split('|')
            .nth(2)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(ns > 0.0, "{row}");
        let rounds: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("round ") && l.split_whitespace().nth(2) == Some(variant))
            .collect();
        assert_eq!(rounds.len(), 2, "{stdout}");
        for line in rounds {
            // "..., N multishot completions, M zero-copy notifications, K direct receives, ..."
            let count = |what: &str| -> u64 {
                let at = line.find(what).unwrap_or_else(|| panic!("{line}"));
                line[..at]
                    .split_whitespace()
                    .last()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            let multishot = variant.starts_with("multi");
            assert_eq!(count(" multishot completions") > 0, multishot, "{line}");
            assert_eq!(
                count(" zero-copy notifications") > 0,
                variant == "zc",
                "{line}"
            );
            assert_eq!(count(" direct receives") > 0, variant == "poll", "{line}");
            let provided = multishot || variant == "select";
            assert_eq!(count(" provided buffers") > 0, provided, "{line}");
        }
    }
}
