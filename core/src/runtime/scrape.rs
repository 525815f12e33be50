//! The health thread: one per process that reads, every `routing.scrape_interval_ms`, the
//! Prometheus `/metrics` of each backend whose cluster sets `queue_metrics`, and stores the
//! queue it reports in the backend's health, where the load-aware strategies read it; and that
//! runs the active probes of clusters with a `probe`, every probe's `interval_ms`, feeding each
//! verdict to the backend's breaker ([`BackendHealth::probed`]).
//!
//! Started by the runtime with the first snapshot's plan; the control thread hands it a new
//! plan on each reload ([`Scraper::replan`]). It runs off the workers, with blocking sockets
//! bounded by timeouts, so a slow or dead endpoint delays only the scrapes and probes after it
//! (by its timeout at most). What it reads: vLLM's `vllm:num_requests_waiting`,
//! `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` in
//! older versions), SGLang's `sglang:num_queue_reqs`, `sglang:num_running_reqs` and
//! `sglang:token_usage`; counts are summed over the label sets (one per model) of each family,
//! the larger family taken when a page has both (one engine, two names), usage is the
//! largest. A backend that does not answer keeps its last reading, which ages out after
//! `routing.queue_stale_ms`. A probe is `GET path` over plain HTTP/1.0 whose status must be the
//! expected one, or a TCP connect, within the probe's `timeout_ms`; with `when = "open"` only
//! backends whose breaker is open are probed.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::config::routing::{Probe, ProbeCheck, RoutingSettings};
use crate::config::Snapshot;
use crate::upstream::health::{BackendHealth, HealthTable};

/// One backend to scrape.
struct Target {
    addr: SocketAddr,
    host: String,
    health: Arc<BackendHealth>,
}

/// One backend to probe, and when next.
struct ProbeTarget {
    addr: SocketAddr,
    host: String,
    health: Arc<BackendHealth>,
    probe: Probe,
    due: Instant,
}

#[derive(Default)]
struct Plan {
    targets: Vec<Target>,
    interval: Duration,
    probes: Vec<ProbeTarget>,
    routing: RoutingSettings,
}

/// The handle the control thread keeps: new plans go to the thread over a channel, which is
/// also what the thread waits on between scrapes.
pub(crate) struct Scraper {
    plans: mpsc::Sender<Plan>,
}

/// The most of a metrics page read.
const MAX_PAGE: usize = 1 << 20;
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// The most one backend's scrape may take, connect included.
const FETCH_DEADLINE: Duration = Duration::from_millis(1500);

impl Scraper {
    /// Start the thread (only when some cluster asks for queue metrics, now or after a reload:
    /// it idles on an empty plan).
    pub(crate) fn start(snapshot: &Snapshot, health: &HealthTable) -> std::io::Result<Scraper> {
        let (plans, receiver) = mpsc::channel();
        let scraper = Scraper { plans };
        scraper.replan(snapshot, health);
        std::thread::Builder::new()
            .name("sluice-scrape".into())
            .spawn(move || run(&receiver))?;
        Ok(scraper)
    }

    /// Scrape what `snapshot` asks for, into `health`.
    pub(crate) fn replan(&self, snapshot: &Snapshot, health: &HealthTable) {
        let mut targets = Vec::new();
        for cluster in snapshot.clusters.iter().filter(|c| c.queue_metrics) {
            // Plain HTTP only: a TLS backend's metrics are not read (documented).
            for backend in cluster.backends.iter().filter(|b| !b.tls) {
                let (Some(&addr), Some(h)) = (backend.addrs.first(), health.shared(backend.id))
                else {
                    continue;
                };
                targets.push(Target {
                    addr,
                    host: backend.host_header.clone(),
                    health: h,
                });
            }
        }
        let now = Instant::now();
        let mut probes = Vec::new();
        for cluster in &snapshot.clusters {
            let Some(probe) = &cluster.probe else {
                continue;
            };
            for backend in &cluster.backends {
                let (Some(&addr), Some(h)) = (backend.addrs.first(), health.shared(backend.id))
                else {
                    continue;
                };
                probes.push(ProbeTarget {
                    addr,
                    host: backend.host_header.clone(),
                    health: h,
                    probe: probe.clone(),
                    due: now,
                });
            }
        }
        // The thread ends with the process; a send cannot fail before that.
        let _ = self.plans.send(Plan {
            targets,
            interval: Duration::from_millis(snapshot.routing.scrape_interval_ms),
            probes,
            routing: snapshot.routing,
        });
    }
}

fn run(plans: &mpsc::Receiver<Plan>) {
    let mut plan = Plan::default();
    let mut next_scrape = Instant::now();
    loop {
        // Wait for the next scrape or probe, taking any new plan meanwhile (the latest wins).
        let idle = Instant::now() + Duration::from_secs(3600);
        let scrape_at = if plan.targets.is_empty() {
            idle
        } else {
            next_scrape
        };
        let wake = plan
            .probes
            .iter()
            .map(|p| p.due)
            .fold(scrape_at, Instant::min);
        match plans.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok(new) => {
                plan = new;
                continue;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        let started = Instant::now();
        if started >= scrape_at {
            next_scrape = started + plan.interval.max(Duration::from_millis(10));
            for target in &plan.targets {
                if let Some(q) = fetch(target.addr, &target.host).and_then(|p| parse_queue(&p)) {
                    let now = crate::sys::time::mono_ms();
                    target
                        .health
                        .load
                        .scraped(q.waiting, q.running, q.kv_usage, now);
                }
            }
        }
        let routing = plan.routing;
        for target in plan.probes.iter_mut().filter(|p| p.due <= started) {
            target.due = started + target.probe.interval;
            if !target.probe.always && !target.health.breaker_open() {
                continue;
            }
            let ok = probe(target.addr, &target.host, &target.probe);
            // Held open until the next verdict can come (with an interval to spare: this
            // thread may be late on a busy machine).
            let hold = 2 * target.probe.interval + target.probe.timeout;
            let now = crate::sys::time::mono_ms();
            target
                .health
                .probed(ok, now, &routing, hold.as_millis() as u64);
        }
    }
}

/// One probe of the backend at `addr`: whether it passed, within the probe's timeout.
fn probe(addr: SocketAddr, host: &str, probe: &Probe) -> bool {
    let deadline = Instant::now() + probe.timeout;
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, probe.timeout) else {
        return false;
    };
    let (path, expect_status) = match &probe.check {
        ProbeCheck::Tcp => return true,
        ProbeCheck::Http {
            path,
            expect_status,
        } => (path, *expect_status),
    };
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
    };
    let Some(timeout) = left() else {
        return false;
    };
    if stream.set_write_timeout(Some(timeout)).is_err()
        || write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").is_err()
    {
        return false;
    }
    // The status line is all a verdict needs.
    let mut head = [0u8; 64];
    let mut len = 0;
    while len < head.len() {
        let Some(timeout) = left() else {
            return false;
        };
        if stream.set_read_timeout(Some(timeout)).is_err() {
            return false;
        }
        match stream.read(&mut head[len..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
        if head[..len].contains(&b'\n') {
            break;
        }
    }
    status_of(&head[..len]) == Some(expect_status)
}

/// The status of an HTTP/1.x status line at the start of `head`.
fn status_of(head: &[u8]) -> Option<u16> {
    let rest = head
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| head.strip_prefix(b"HTTP/1.0 "))?;
    let digits = rest.get(..3)?;
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// `GET /metrics` over HTTP/1.0 (so the body is not chunked), the body of a 200; all of it
/// within [`FETCH_DEADLINE`], however slowly the endpoint drips.
fn fetch(addr: SocketAddr, host: &str) -> Option<String> {
    let deadline = Instant::now() + FETCH_DEADLINE;
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).ok()?;
    stream.set_write_timeout(Some(IO_TIMEOUT)).ok()?;
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n"
    )
    .ok()?;
    let mut page = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        stream.set_read_timeout(Some(left.min(IO_TIMEOUT))).ok()?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) if page.len() + n <= MAX_PAGE => page.extend_from_slice(&chunk[..n]),
            Ok(_) | Err(_) => return None,
        }
    }
    let text = String::from_utf8_lossy(&page);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?;
    (status == "200").then(|| body.to_string())
}

/// A backend's queue as its metrics page reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Queue {
    pub(crate) waiting: u32,
    pub(crate) running: u32,
    pub(crate) kv_usage: f64,
}

/// The engine families whose queue series Sluice reads.
#[derive(Clone, Copy)]
enum Family {
    Vllm = 0,
    Sglang = 1,
}

/// Read the queue from a Prometheus text page; `None` when it has none of the known series.
/// Counts are summed over each family's label sets; a page that carries both families (an
/// engine exporting both names, as mock-llm does) describes one queue, so the larger family's
/// count is taken, never their sum.
pub(crate) fn parse_queue(page: &str) -> Option<Queue> {
    let mut waiting = [0u32; 2];
    let mut running = [0u32; 2];
    let mut kv_usage: f64 = 0.0;
    let mut found = false;
    for line in page.lines() {
        let Some((name, value)) = sample(line) else {
            continue;
        };
        match name {
            "vllm:num_requests_waiting" => add(&mut waiting, Family::Vllm, value),
            "sglang:num_queue_reqs" => add(&mut waiting, Family::Sglang, value),
            "vllm:num_requests_running" => add(&mut running, Family::Vllm, value),
            "sglang:num_running_reqs" => add(&mut running, Family::Sglang, value),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                kv_usage = kv_usage.max(value);
            }
            _ => continue,
        }
        found = true;
    }
    found.then_some(Queue {
        waiting: waiting[0].max(waiting[1]),
        running: running[0].max(running[1]),
        kv_usage,
    })
}

fn add(counts: &mut [u32; 2], family: Family, value: f64) {
    let count = &mut counts[family as usize];
    *count = count.saturating_add(value as u32);
}

/// One sample line's metric name and value (finite, not negative); `None` for comments, blank
/// lines and anything unreadable.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = line.split_at(line.find(['{', ' '])?);
    // The value follows the label set (whose values may hold spaces).
    let rest = match rest.strip_prefix('{') {
        Some(labels) => &labels[labels.rfind('}')? + 1..],
        None => rest,
    };
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    (value.is_finite() && value >= 0.0).then_some((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_line() {
        assert_eq!(status_of(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(status_of(b"HTTP/1.0 503 Service Unavailable"), Some(503));
        assert_eq!(status_of(b"HTTP/1.1 20"), None);
        assert_eq!(status_of(b"SSH-2.0-OpenSSH"), None);
        assert_eq!(status_of(b"HTTP/1.1 2x0 OK"), None);
    }

    #[test]
    fn reads_vllm_and_sglang_pages() {
        let vllm = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B\"} 7.0\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"a b}c\"} 2.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B\"} 12.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.42\n\
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.61\n\
vllm:prompt_tokens_total{model_name=\"m\"} 1234.0\n";
        assert_eq!(
            parse_queue(vllm),
            Some(Queue {
                waiting: 9,
                running: 12,
                kv_usage: 0.61
            })
        );
        let sglang = "sglang:num_queue_reqs{model_name=\"qwen\"} 3\nsglang:num_running_reqs{model_name=\"qwen\"} 5\nsglang:token_usage{model_name=\"qwen\"} 0.25\n";
        assert_eq!(
            parse_queue(sglang),
            Some(Queue {
                waiting: 3,
                running: 5,
                kv_usage: 0.25
            })
        );
        assert_eq!(parse_queue("process_cpu_seconds_total 12.5\n"), None);
        assert_eq!(
            parse_queue("vllm:num_requests_waiting{x=\"1\"} NaN\n"),
            None
        );
    }

    #[test]
    fn a_page_with_both_families_is_one_queue_not_two() {
        // mock-llm, and an engine exporting both names, report the same queue twice.
        let both = "vllm:num_requests_waiting{model_name=\"m\"} 4\n\
vllm:num_requests_running{model_name=\"m\"} 6\n\
sglang:num_queue_reqs{model_name=\"m\"} 4\n\
sglang:num_running_reqs{model_name=\"m\"} 6\n\
sglang:num_running_reqs{model_name=\"n\"} 1\n";
        assert_eq!(
            parse_queue(both),
            Some(Queue {
                waiting: 4,
                running: 7,
                kv_usage: 0.0
            })
        );
    }
}
