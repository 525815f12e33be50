//! What a run measured, per engine thread, merged at the end; and its JSON / text forms.

use std::collections::BTreeMap;

use hdrhistogram::serialization::{Serializer, V2Serializer};
use hdrhistogram::Histogram;

use crate::http::{Kind, Response, KINDS};

pub(crate) struct Stats {
    pub(crate) latency: Histogram<u64>,
    pub(crate) ttfb: Histogram<u64>,
    pub(crate) first_event: Histogram<u64>,
    pub(crate) gap: Histogram<u64>,
    /// Actual submission of the request's first byte − its intended send time.
    pub(crate) send_lag: Histogram<u64>,
    /// Time a due request waited for a free connection (the io_uring engine: in its FIFO;
    /// the thread engine: for its connection's previous exchange to end).
    pub(crate) queue_wait: Histogram<u64>,
    pub(crate) ok: u64,
    pub(crate) errors: [u64; KINDS.len()],
    pub(crate) content_events: u64,
    pub(crate) coalesced_events: u64,
    pub(crate) coalesced_reads: u64,
    pub(crate) statuses: BTreeMap<u16, u64>,
    /// Most requests on connections at once, from the start of the measurement window.
    pub(crate) max_in_flight: u64,
    /// Measured requests still queued or unanswered at the grace deadline (also counted as
    /// timeouts).
    pub(crate) abandoned: u64,
    /// io_uring engine: receives that found the provided-buffer ring empty and were armed
    /// again (the thread engine has no such thing: 0).
    pub(crate) recv_enobufs: u64,
}

fn hist() -> Result<Histogram<u64>, String> {
    // Microseconds, 1 µs .. 1 hour, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| format!("histogram: {e}"))
}

/// Nanoseconds as whole microseconds, at least 1 (the latency histograms' floor, as ever).
pub(crate) fn us(ns: u64) -> u64 {
    (ns / 1000).max(1)
}

impl Stats {
    pub(crate) fn new() -> Result<Stats, String> {
        Ok(Stats {
            latency: hist()?,
            ttfb: hist()?,
            first_event: hist()?,
            gap: hist()?,
            send_lag: hist()?,
            queue_wait: hist()?,
            ok: 0,
            errors: [0; KINDS.len()],
            content_events: 0,
            coalesced_events: 0,
            coalesced_reads: 0,
            statuses: BTreeMap::new(),
            max_in_flight: 0,
            abandoned: 0,
            recv_enobufs: 0,
        })
    }

    /// Adds another thread's numbers. `max_in_flight` adds up too: the threads' peaks may
    /// not have coincided, so with several threads it is an upper bound.
    pub(crate) fn merge(&mut self, o: &Stats) {
        for (a, b) in [
            (&mut self.latency, &o.latency),
            (&mut self.ttfb, &o.ttfb),
            (&mut self.first_event, &o.first_event),
            (&mut self.gap, &o.gap),
            (&mut self.send_lag, &o.send_lag),
            (&mut self.queue_wait, &o.queue_wait),
        ] {
            let _ = a.add(b);
        }
        self.ok += o.ok;
        for (a, b) in self.errors.iter_mut().zip(o.errors) {
            *a += b;
        }
        self.content_events += o.content_events;
        self.coalesced_events += o.coalesced_events;
        self.coalesced_reads += o.coalesced_reads;
        for (s, n) in &o.statuses {
            *self.statuses.entry(*s).or_default() += n;
        }
        self.max_in_flight += o.max_in_flight;
        self.abandoned += o.abandoned;
        self.recv_enobufs += o.recv_enobufs;
    }

    /// A complete response to a measured request, `latency_ns` after its start.
    pub(crate) fn response(&mut self, r: &Response, latency_ns: u64) {
        *self.statuses.entry(r.status).or_default() += 1;
        if (200..300).contains(&r.status) {
            self.ok += 1;
            let _ = self.latency.record(us(latency_ns));
            let _ = self.ttfb.record(us(r.ttfb));
            if let Some(fe) = r.first_event {
                let _ = self.first_event.record(us(fe));
            }
            for g in &r.gaps {
                let _ = self.gap.record(us(*g));
            }
            self.content_events += r.content_events;
            self.coalesced_events += r.coalesced_events;
            self.coalesced_reads += r.coalesced_reads;
        } else {
            // (1xx heads are interim and skipped by the reader, so never end up here.)
            let kind = match r.status {
                300..=399 => Kind::Status3xx,
                400..=499 => Kind::Status4xx,
                _ => Kind::Status5xx,
            };
            self.errors[kind as usize] += 1;
        }
    }

    /// A measured request still queued or unanswered at the grace deadline: a timeout.
    pub(crate) fn abandon(&mut self) {
        self.errors[Kind::Timeout as usize] += 1;
        self.abandoned += 1;
    }

    /// When a measured request went out: `queue_ns` waiting for a free connection, `lag_ns`
    /// from its intended time to the submission of its bytes (queueing included). Zero is a value here (most requests
    /// never queue), so unlike the latency histograms these are not floored at 1 µs.
    pub(crate) fn sent(&mut self, queue_ns: u64, lag_ns: u64) {
        let _ = self.queue_wait.record(queue_ns / 1000);
        let _ = self.send_lag.record(lag_ns / 1000);
    }
}

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= c.len() {
                s.push(char::from(T[((n >> shift) & 63) as usize]));
            } else {
                s.push('=');
            }
        }
    }
    s
}

fn ms(v: u64) -> f64 {
    v as f64 / 1000.0
}

pub(crate) fn hist_json(h: &Histogram<u64>) -> serde_json::Value {
    let mut bytes = Vec::new();
    let encoded = match V2Serializer::new().serialize(h, &mut bytes) {
        Ok(_) => serde_json::Value::String(base64(&bytes)),
        Err(_) => serde_json::Value::Null,
    };
    let q = |p: f64| ms(h.value_at_quantile(p));
    serde_json::json!({
        "count": h.len(),
        "min_ms": ms(h.min()),
        "mean_ms": h.mean() / 1000.0,
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "p999_ms": q(0.999),
        "max_ms": ms(h.max()),
        "hdr_unit": "us",
        "hdr_v2_base64": encoded,
    })
}

pub(crate) fn hist_line(name: &str, h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return format!("  {name:<12} (no samples)");
    }
    let q = |p: f64| ms(h.value_at_quantile(p));
    format!(
        "  {name:<12} p50 {:>9.3}  p90 {:>9.3}  p99 {:>9.3}  p99.9 {:>9.3}  max {:>9.3} ms  (n={})",
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        ms(h.max()),
        h.len()
    )
}
