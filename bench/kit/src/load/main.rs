//! `sluice-load`: an HTTP/1.1 load generator for OpenAI-style chat completions.
//!
//! ```text
//! sluice-load --url http://127.0.0.1:8080/v1/chat/completions [--connections 10]
//!     [--duration 10s] [--warmup 0s] [--rate R] [--stream] [--body-bytes N]
//!     [--models a,b,c] [--keys k1,k2] [--header 'Name: value']... [--timeout 10s] [--json FILE]
//!     [--engine uring|threads] [--threads N]
//! ```
//!
//! Closed loop by default (each connection sends its next request when the previous one is
//! answered). With `--rate R` (requests/s in total) it runs open loop, and latency is measured
//! from each request's *intended* send time, so a stalled server cannot hide behind coordinated
//! omission. Only requests whose intended send time falls inside the measurement window (after
//! the warmup) are recorded.
//!
//! Two engines share the response reading ([`http`]) and the numbers ([`stats`]):
//! - [`uring`] (the default): one io_uring event loop per `--threads` thread, every connection
//!   a state machine in one slab; open loop on one exact schedule for all connections.
//! - [`threads`]: one std thread per connection with blocking sockets, as sluice-load began;
//!   used when io_uring cannot be set up, or with `--engine threads`.

mod bufring;
mod http;
mod nofile;
mod stats;
mod threads;
mod uring;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use http::KINDS;
use stats::{hist_json, hist_line, Stats};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: sluice-load --url http://HOST:PORT/PATH [--connections N] \
[--duration 10s] [--warmup 0s] [--rate R] [--stream] [--body-bytes N] [--models a,b] \
[--keys k1,k2] [--header 'Name: value']... [--timeout 10s] [--json FILE] \
[--engine uring|threads] [--threads N]";

/// The environment variable that picks the engine when `--engine` is not given (so a test
/// suite can run under either engine without changing its command lines).
const ENGINE_ENV: &str = "SLUICE_LOAD_ENGINE";

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

struct Opts {
    host: String,
    addr: SocketAddr,
    path: String,
    connections: usize,
    duration: Duration,
    warmup: Duration,
    rate: Option<f64>,
    stream: bool,
    body_bytes: usize,
    models: Vec<String>,
    keys: Vec<String>,
    /// Extra request header lines (`Name: value`), sent on every request in the order given.
    headers: Vec<String>,
    timeout: Duration,
    json: Option<String>,
    engine: Engine,
    /// io_uring engine threads (one ring each); the connections are split among them.
    threads: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Engine {
    Uring,
    Threads,
}

impl Engine {
    fn parse(v: &str) -> Result<Engine, String> {
        match v {
            "uring" => Ok(Engine::Uring),
            "threads" => Ok(Engine::Threads),
            _ => Err(format!("bad engine {v:?} (uring or threads)")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Engine::Uring => "uring",
            Engine::Threads => "threads",
        }
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("bad duration {s:?} (use e.g. 10s, 500ms, 1.5s)");
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num.parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(v * mult))
}

fn list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(String::from)
        .collect()
}

fn parse_opts() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    let mut url = None;
    let mut connections = 10usize;
    let mut duration = Duration::from_secs(10);
    let mut warmup = Duration::ZERO;
    let mut rate = None;
    let mut stream = false;
    let mut body_bytes = 0usize;
    let mut models = vec!["mock-model".to_string()];
    let mut keys = Vec::new();
    let mut headers = Vec::new();
    let mut timeout = Duration::from_secs(10);
    let mut json = None;
    let mut engine = match std::env::var(ENGINE_ENV) {
        Ok(v) if !v.is_empty() => Engine::parse(&v).map_err(|e| format!("{ENGINE_ENV}: {e}"))?,
        _ => Engine::Uring,
    };
    let mut threads = 1usize;
    while let Some(a) = args.next() {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        if name == "--stream" {
            stream = true;
            continue;
        }
        if name == "--help" || name == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        const VALUED: [&str; 15] = [
            "--url",
            "--connections",
            "-c",
            "--duration",
            "-d",
            "--warmup",
            "--rate",
            "--body-bytes",
            "--models",
            "--keys",
            "--header",
            "--timeout",
            "--json",
            "--engine",
            "--threads",
        ];
        if !VALUED.contains(&name.as_str()) {
            return Err(format!("unknown option {name}\n{USAGE}"));
        }
        let v = match inline {
            Some(v) => v,
            None => args.next().ok_or_else(|| format!("{name} needs a value"))?,
        };
        let int = |v: &str| v.parse::<usize>().map_err(|_| format!("bad {name}: {v:?}"));
        match name.as_str() {
            "--url" => url = Some(v),
            "--connections" | "-c" => connections = int(&v)?,
            "--duration" | "-d" => duration = parse_duration(&v)?,
            "--warmup" => warmup = parse_duration(&v)?,
            "--rate" => {
                let r: f64 = v.parse().map_err(|_| format!("bad --rate: {v:?}"))?;
                if !(r.is_finite() && r > 0.0) {
                    return Err(format!("bad --rate: {v:?}"));
                }
                rate = Some(r);
            }
            "--body-bytes" => body_bytes = int(&v)?,
            "--models" => models = list(&v),
            "--keys" => keys = list(&v),
            "--header" => headers.push(header_line(&v)?),
            "--timeout" => timeout = parse_duration(&v)?,
            "--json" => json = Some(v),
            "--engine" => engine = Engine::parse(&v)?,
            "--threads" => threads = int(&v)?,
            _ => return Err(format!("unknown option {name}\n{USAGE}")),
        }
    }
    let url = url.ok_or_else(|| format!("--url is required\n{USAGE}"))?;
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let hostport = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    let addr = hostport
        .to_socket_addrs()
        .map_err(|e| format!("resolve {hostport}: {e}"))?
        .next()
        .ok_or_else(|| format!("resolve {hostport}: no address"))?;
    if connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    if models.is_empty() {
        return Err("--models is empty".into());
    }
    if timeout.is_zero() {
        return Err("--timeout must be positive".into());
    }
    if threads == 0 {
        return Err("--threads must be at least 1".into());
    }
    Ok(Opts {
        host: host.to_string(),
        addr,
        path: path.to_string(),
        connections,
        duration,
        warmup,
        rate,
        stream,
        body_bytes,
        models,
        keys,
        headers,
        timeout,
        json,
        engine,
        // More threads than connections would leave rings with nothing to do.
        threads: threads.min(connections),
    })
}

/// A `--header` value as a header line without its CRLF: `Name: value`, the name a valid token.
fn header_line(v: &str) -> Result<String, String> {
    let bad = || format!("bad --header {v:?} (use 'Name: value')");
    let (name, value) = v.split_once(':').ok_or_else(bad)?;
    let name = name.trim();
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) || value.contains(['\r', '\n']) {
        return Err(bad());
    }
    Ok(format!("{name}: {}", value.trim()))
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// A valid chat body for `model`, padded (inside the user message) to at least `size` bytes.
fn chat_body(model: &str, stream: bool, size: usize) -> Vec<u8> {
    let model_json = serde_json::Value::String(model.to_string()).to_string();
    let head = format!(
        r#"{{"model":{model_json},"stream":{stream},"messages":[{{"role":"user","content":"hello"#
    );
    let tail = r#""}]}"#;
    let mut body = head.into_bytes();
    let pad = size.saturating_sub(body.len() + tail.len());
    body.resize(body.len() + pad, b'x');
    body.extend_from_slice(tail.as_bytes());
    body
}

/// The full request bytes for every (model, key) combination, built once:
/// `out[m][k]` uses `models[m]` and `keys[k]`.
fn build_requests(o: &Opts) -> Vec<Vec<Vec<u8>>> {
    let keys: Vec<Option<&str>> = if o.keys.is_empty() {
        vec![None]
    } else {
        o.keys.iter().map(|k| Some(k.as_str())).collect()
    };
    let mut out = Vec::new();
    for m in &o.models {
        let body = chat_body(m, o.stream, o.body_bytes);
        let mut row = Vec::new();
        for k in &keys {
            let mut r = format!(
                "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
                o.path,
                o.host,
                body.len()
            );
            if o.stream {
                r.push_str("Accept: text/event-stream\r\n");
            }
            if let Some(k) = k {
                r.push_str(&format!("Authorization: Bearer {k}\r\n"));
            }
            for h in &o.headers {
                r.push_str(h);
                r.push_str("\r\n");
            }
            r.push_str("\r\n");
            let mut r = r.into_bytes();
            r.extend_from_slice(&body);
            row.push(r);
        }
        out.push(row);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// What both engines share: the plan, the window, the clock, the CPU meter
// ---------------------------------------------------------------------------------------------

pub(crate) struct Plan {
    opts: Opts,
    /// `requests[m][k]`: the bytes of a request with `models[m]` and `keys[k]`.
    requests: Vec<Vec<Vec<u8>>>,
}

impl Plan {
    /// The bytes of request number `seq` (counted over all connections): it uses
    /// `models[seq % m]` and `keys[seq % k]`, so both lists rotate independently.
    pub(crate) fn request(&self, seq: usize) -> &[u8] {
        let row = &self.requests[seq % self.requests.len()];
        &row[seq % row.len()]
    }
}

/// The run's times, in [`mono_ns`] nanoseconds: the schedule starts at `t0`, requests intended
/// from `measure_from` (after the warmup) up to `end` are recorded, none is started after it.
/// At `grace` (`end` + `--timeout`) the run stops: every request still queued or unanswered
/// then is counted as a timeout (a hung or trickling server cannot keep the run going).
#[derive(Clone, Copy)]
pub(crate) struct Window {
    t0: u64,
    measure_from: u64,
    end: u64,
    grace: u64,
}

impl Window {
    fn starting(t0: u64, o: &Opts) -> Window {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let measure_from = t0.saturating_add(ns(o.warmup));
        let end = measure_from.saturating_add(ns(o.duration));
        Window {
            t0,
            measure_from,
            end,
            grace: end.saturating_add(ns(o.timeout)),
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock `Instant` reads, as a plain number, so that an
/// io_uring absolute timeout (which uses the same clock) can be armed for an intended time.
pub(crate) fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until `t` (a [`mono_ns`] time); returns at once if it has passed.
pub(crate) fn sleep_until(t: u64) {
    let now = mono_ns();
    if t > now {
        std::thread::sleep(Duration::from_nanos(t - now));
    }
}

/// User + system CPU time of the whole process so far, in nanoseconds.
fn cpu_ns() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Waits for the engine threads and merges their numbers. Also measures the process's CPU time
/// from `measure_from` until the last thread ends (the measured requests still in flight at the
/// end of the window are part of the work): that is the client's cost of the recorded requests.
pub(crate) fn join_measured(
    handles: Vec<std::thread::JoinHandle<Result<Stats, String>>>,
    measure_from: u64,
) -> Result<(Stats, u64), String> {
    sleep_until(measure_from);
    let cpu0 = cpu_ns();
    let mut total = Stats::new()?;
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(st)) => total.merge(&st),
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(_) => first_err = first_err.or(Some("engine thread panicked".to_string())),
        }
    }
    let cpu = cpu_ns().saturating_sub(cpu0);
    match first_err {
        Some(e) => Err(e),
        None => Ok((total, cpu)),
    }
}

/// Raises the open-file limit to the hard limit: every connection is a descriptor, and the
/// io_uring engine holds thousands at once on one thread.
fn raise_nofile(connections: usize) {
    if let Some(limit) = nofile::raise_nofile(connections + 64) {
        eprintln!(
            "sluice-load: note: the open-file limit ({limit}) is too low for {connections} connections"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Run and report
// ---------------------------------------------------------------------------------------------

fn run() -> Result<(), String> {
    let opts = parse_opts()?;
    raise_nofile(opts.connections);
    let requests = build_requests(&opts);
    let plan = Arc::new(Plan { opts, requests });
    let (engine, (total, cpu)) = match plan.opts.engine {
        Engine::Threads => (Engine::Threads, threads::run(&plan)?),
        Engine::Uring => match uring::run(&plan) {
            Ok(r) => (Engine::Uring, r),
            Err(uring::Error::Setup(e)) => {
                eprintln!("sluice-load: note: io_uring unavailable ({e}); using --engine threads");
                (Engine::Threads, threads::run(&plan)?)
            }
            Err(uring::Error::Run(e)) => return Err(e),
        },
    };
    let o = &plan.opts;
    if total.abandoned > 0 {
        eprintln!(
            "sluice-load: note: {} requests still queued or unanswered at the grace deadline \
             (--timeout, {:?}, after the window) were counted as timeouts",
            total.abandoned, o.timeout
        );
    }
    let secs = o.duration.as_secs_f64().max(1e-9);
    let err_total: u64 = total.errors.iter().sum();
    let mode = match o.rate {
        Some(r) => format!("open loop, {r} req/s target"),
        None => "closed loop".to_string(),
    };
    let cpu_per_req = (total.ok > 0).then(|| cpu as f64 / 1000.0 / total.ok as f64);

    let mut out = String::new();
    out.push_str(&format!(
        "sluice-load: {} {} connections, {:.1}s (+{:.1}s warmup), {}{}\n",
        o.addr,
        o.connections,
        o.duration.as_secs_f64(),
        o.warmup.as_secs_f64(),
        mode,
        if o.stream { ", streaming" } else { "" }
    ));
    out.push_str(&format!(
        "  requests     {} ok, {} errors, {:.1} req/s (ok)\n",
        total.ok,
        err_total,
        total.ok as f64 / secs
    ));
    out.push_str(&hist_line("latency", &total.latency));
    out.push('\n');
    if o.stream {
        out.push_str(&hist_line("ttfb", &total.ttfb));
        out.push('\n');
        out.push_str(&hist_line("first event", &total.first_event));
        out.push('\n');
        out.push_str(&hist_line("event gap", &total.gap));
        out.push('\n');
        out.push_str(&format!(
            "  events       {} content events, {} coalesced (in {} reads)\n",
            total.content_events, total.coalesced_events, total.coalesced_reads
        ));
    }
    if o.rate.is_some() {
        out.push_str(&hist_line("queue wait", &total.queue_wait));
        out.push('\n');
        out.push_str(&hist_line("send lag", &total.send_lag));
        out.push('\n');
    }
    let errs: Vec<String> = KINDS
        .iter()
        .zip(total.errors)
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k}={n}"))
        .collect();
    out.push_str(&format!(
        "  errors       {}\n",
        if errs.is_empty() {
            "none".to_string()
        } else {
            errs.join(" ")
        }
    ));
    out.push_str(&format!(
        "  client       engine {}{}, {} CPU/ok request, max {} in flight{}\n",
        engine.name(),
        if engine == Engine::Uring {
            format!(
                " ({} thread{})",
                o.threads,
                if o.threads == 1 { "" } else { "s" }
            )
        } else {
            String::new()
        },
        cpu_per_req.map_or("-".to_string(), |c| format!("{c:.2} µs")),
        total.max_in_flight,
        if total.recv_enobufs > 0 {
            format!(
                ", {} receives re-armed for want of buffers",
                total.recv_enobufs
            )
        } else {
            String::new()
        }
    ));
    print!("{out}");

    if let Some(path) = &o.json {
        let errors: serde_json::Map<String, serde_json::Value> = KINDS
            .iter()
            .zip(total.errors)
            .map(|(k, n)| (k.to_string(), n.into()))
            .collect();
        let statuses: serde_json::Map<String, serde_json::Value> = total
            .statuses
            .iter()
            .map(|(s, n)| (s.to_string(), (*n).into()))
            .collect();
        let mut j = serde_json::json!({
            "url": format!("http://{}{}", o.host, o.path),
            "mode": if o.rate.is_some() { "open" } else { "closed" },
            "rate": o.rate,
            "connections": o.connections,
            "duration_s": o.duration.as_secs_f64(),
            "warmup_s": o.warmup.as_secs_f64(),
            "stream": o.stream,
            "body_bytes": o.body_bytes,
            "headers": o.headers,
            "requests": total.ok + err_total,
            "ok": total.ok,
            "rps": total.ok as f64 / secs,
            "errors": errors,
            "errors_total": err_total,
            "statuses": statuses,
            "latency": hist_json(&total.latency),
            "send_lag": hist_json(&total.send_lag),
            "queue_wait": hist_json(&total.queue_wait),
            "client_cpu_us_per_req": cpu_per_req,
            "max_in_flight": total.max_in_flight,
            "recv_enobufs": total.recv_enobufs,
            "engine": engine.name(),
            "threads": if engine == Engine::Uring { o.threads } else { o.connections },
        });
        if o.stream {
            j["ttfb"] = hist_json(&total.ttfb);
            j["first_event"] = hist_json(&total.first_event);
            j["event_gap"] = hist_json(&total.gap);
            j["content_events"] = total.content_events.into();
            j["coalesced_events"] = total.coalesced_events.into();
            j["coalesced_reads"] = total.coalesced_reads.into();
        }
        let text = serde_json::to_string_pretty(&j).map_err(|e| format!("json: {e}"))?;
        std::fs::write(path, text + "\n").map_err(|e| format!("write {path}: {e}"))?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("sluice-load: {e}");
        std::process::exit(2);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::header_line;

    #[test]
    fn header_option() {
        assert_eq!(
            header_line("x-mock-tokens: 64").unwrap(),
            "x-mock-tokens: 64"
        );
        assert_eq!(header_line(" A-B :v w ").unwrap(), "A-B: v w");
        for bad in ["novalue", ": v", "a b: v", "a: v\r\nInjected: 1"] {
            assert!(header_line(bad).is_err(), "{bad:?}");
        }
    }
}
