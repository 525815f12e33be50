//! The queue scraper: one thread per process that reads, every `routing.scrape_interval_ms`,
//! the Prometheus `/metrics` of each backend whose cluster sets `queue_metrics`, and stores the
//! queue it reports in the backend's health, where the load-aware strategies read it.
//!
//! Started by the runtime with the first snapshot's plan; the control thread hands it a new
//! plan on each reload ([`Scraper::replan`]). It runs off the workers, with blocking sockets
//! bounded by timeouts, so a slow or dead metrics endpoint delays only the scrape. What it
//! reads: vLLM's `vllm:num_requests_waiting`, `vllm:num_requests_running` and
//! `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` in older versions), SGLang's
//! `sglang:num_queue_reqs`, `sglang:num_running_reqs` and `sglang:token_usage`; counts are
//! summed over the label sets (one per model), usage is the largest. A backend that does not
//! answer keeps its last reading, which ages out after `routing.queue_stale_ms`.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::config::Snapshot;
use crate::upstream::health::{BackendHealth, HealthTable};

/// One backend to scrape.
struct Target {
    addr: SocketAddr,
    host: String,
    health: Arc<BackendHealth>,
}

#[derive(Default)]
struct Plan {
    targets: Vec<Target>,
    interval: Duration,
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
        // The thread ends with the process; a send cannot fail before that.
        let _ = self.plans.send(Plan {
            targets,
            interval: Duration::from_millis(snapshot.routing.scrape_interval_ms),
        });
    }
}

fn run(plans: &mpsc::Receiver<Plan>) {
    let mut plan = Plan::default();
    let mut next = Instant::now();
    loop {
        // Wait for the next scrape, taking any new plan meanwhile (the latest wins).
        match plans.recv_timeout(next.saturating_duration_since(Instant::now())) {
            Ok(new) => {
                plan = new;
                continue;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        next = Instant::now() + plan.interval.max(Duration::from_millis(10));
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

/// Read the queue from a Prometheus text page; `None` when it has none of the known series.
pub(crate) fn parse_queue(page: &str) -> Option<Queue> {
    let mut q = Queue {
        waiting: 0,
        running: 0,
        kv_usage: 0.0,
    };
    let mut found = false;
    for line in page.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        // The value follows the label set (whose values may hold spaces).
        let rest = match rest.strip_prefix('{') {
            Some(labels) => match labels.rfind('}') {
                Some(end) => &labels[end + 1..],
                None => continue,
            },
            None => rest,
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                q.waiting = q.waiting.saturating_add(value as u32);
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                q.running = q.running.saturating_add(value as u32);
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                q.kv_usage = q.kv_usage.max(value);
            }
            _ => continue,
        }
        found = true;
    }
    found.then_some(q)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
