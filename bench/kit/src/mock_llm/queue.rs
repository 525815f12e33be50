//! `--max-running`: at most N requests are answered at once and the others wait their turn in
//! arrival order, as an inference server's scheduler queues them; and the queue the mock
//! reports at `/metrics` in vLLM's and SGLang's names (real, or set by `POST /_mock/queue`).
//!
//! Single-threaded: the slots are plain cells shared by the connection tasks of one runtime.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::io::Write as _;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// The reported values `POST /_mock/queue` sets; None: the real one.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub struct Override {
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub kv_cache_usage: Option<f64>,
}

/// The real counts, for `/_mock/stats` and `/_mock/queue`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    /// Requests holding a slot (being answered).
    pub running: u64,
    /// Requests queued for a slot.
    pub waiting: u64,
    /// Requests that ever had to wait.
    pub queued: u64,
}

/// The values `/metrics` shows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Report {
    pub running: u64,
    pub waiting: u64,
    /// 0..=1: running / max-running (0 when unlimited), unless overridden.
    pub kv_cache_usage: f64,
}

/// A queued request: granted when a slot is handed to it.
struct Waiter {
    granted: Cell<bool>,
    waker: Cell<Option<Waker>>,
}

struct Inner {
    max: Option<u64>,
    running: Cell<u64>,
    waiters: RefCell<VecDeque<Rc<Waiter>>>,
    queued: Cell<u64>,
    over: Cell<Override>,
}

/// The answer slots (cheap to clone: one shared set).
#[derive(Clone)]
pub struct Slots(Rc<Inner>);

/// A held slot; dropping it hands the slot to the first waiter, or frees it.
pub struct Permit(Slots);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.release();
    }
}

enum Stage {
    /// A slot was free at once and is counted for this request, not handed out yet.
    Held,
    Queued(Rc<Waiter>),
    /// The permit was handed out.
    Done,
}

/// Resolves to a [`Permit`] once a slot is this request's. Dropped while queued (the client
/// went away), it leaves the queue; dropped after a slot was handed to it, it passes the slot on.
pub struct Acquire {
    slots: Slots,
    stage: Stage,
}

impl Acquire {
    /// The permit, when a slot was free at once: no waiting, so no need to watch the client
    /// meanwhile (a readiness wait per request would cost a benchmark's mock a syscall).
    pub fn now(&mut self) -> Option<Permit> {
        match self.stage {
            Stage::Held => {
                self.stage = Stage::Done;
                Some(Permit(self.slots.clone()))
            }
            _ => None,
        }
    }
}

impl Future for Acquire {
    type Output = Permit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        if let Stage::Queued(w) = &self.stage {
            if !w.granted.get() {
                w.waker.set(Some(cx.waker().clone()));
                return Poll::Pending;
            }
        }
        self.stage = Stage::Done;
        Poll::Ready(Permit(self.slots.clone()))
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.stage, Stage::Done) {
            Stage::Done => {}
            Stage::Held => self.slots.release(),
            Stage::Queued(w) if w.granted.get() => self.slots.release(),
            Stage::Queued(w) => self
                .slots
                .0
                .waiters
                .borrow_mut()
                .retain(|x| !Rc::ptr_eq(x, &w)),
        }
    }
}

impl Slots {
    /// `max`: slots; None: unlimited (every request runs at once, none ever waits).
    pub fn new(max: Option<u64>) -> Slots {
        Slots(Rc::new(Inner {
            max,
            running: Cell::new(0),
            waiters: RefCell::new(VecDeque::new()),
            queued: Cell::new(0),
            over: Cell::new(Override::default()),
        }))
    }

    /// A slot for one request: at once when one is free and nobody is queued before it
    /// (first come, first served), else after the requests queued before it.
    pub fn acquire(&self) -> Acquire {
        let s = &self.0;
        let free = s.max.is_none_or(|m| s.running.get() < m);
        if free && s.waiters.borrow().is_empty() {
            s.running.set(s.running.get() + 1);
            return Acquire {
                slots: self.clone(),
                stage: Stage::Held,
            };
        }
        let w = Rc::new(Waiter {
            granted: Cell::new(false),
            waker: Cell::new(None),
        });
        s.waiters.borrow_mut().push_back(w.clone());
        s.queued.set(s.queued.get() + 1);
        Acquire {
            slots: self.clone(),
            stage: Stage::Queued(w),
        }
    }

    fn release(&self) {
        let s = &self.0;
        let next = s.waiters.borrow_mut().pop_front();
        match next {
            // The slot passes straight to the next in line, so `running` stays as it is and
            // no later arrival can take it first.
            Some(w) => {
                w.granted.set(true);
                if let Some(waker) = w.waker.take() {
                    waker.wake();
                }
            }
            None => s.running.set(s.running.get().saturating_sub(1)),
        }
    }

    pub fn max(&self) -> Option<u64> {
        self.0.max
    }

    pub fn counts(&self) -> Counts {
        let s = &self.0;
        Counts {
            running: s.running.get(),
            waiting: s.waiters.borrow().len() as u64,
            queued: s.queued.get(),
        }
    }

    pub fn override_(&self) -> Override {
        self.0.over.get()
    }

    pub fn set_override(&self, o: Override) {
        self.0.over.set(o);
    }

    pub fn report(&self) -> Report {
        let real = self.counts();
        let o = self.0.over.get();
        let running = o.running.unwrap_or(real.running);
        let kv = match (o.kv_cache_usage, self.0.max) {
            (Some(f), _) => f,
            (None, Some(m)) => running as f64 / m as f64,
            (None, None) => 0.0,
        };
        Report {
            running,
            waiting: o.waiting.unwrap_or(real.waiting),
            kv_cache_usage: kv.clamp(0.0, 1.0),
        }
    }
}

/// `GET /metrics`: the reported queue in Prometheus text format (0.0.4), with the names,
/// help texts and labels a vLLM (V1 engine) and an SGLang server use, so a gateway that
/// reads either can be tested against the mock. Values print as floats, as theirs do.
pub fn write_metrics(out: &mut Vec<u8>, r: &Report, model: &str) {
    let mut label = Vec::with_capacity(model.len() + 2);
    prom_label_value(&mut label, model);
    let model = String::from_utf8_lossy(&label);
    let families: [(&str, &str, f64, bool); 6] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            r.running as f64,
            true,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            r.waiting as f64,
            true,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            r.kv_cache_usage,
            true,
        ),
        (
            "sglang:num_running_reqs",
            "The number of running requests.",
            r.running as f64,
            false,
        ),
        (
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            r.waiting as f64,
            false,
        ),
        (
            "sglang:token_usage",
            "The token usage.",
            r.kv_cache_usage,
            false,
        ),
    ];
    for (name, help, value, vllm) in families {
        // vLLM labels each engine core (`engine="0"`); SGLang only the model.
        let engine = if vllm { "engine=\"0\"," } else { "" };
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{engine}model_name=\"{model}\"}} {value:?}\n"
        );
    }
}

/// Escapes a Prometheus label value (backslash, double quote, newline).
fn prom_label_value(out: &mut Vec<u8>, v: &str) {
    for &b in v.as_bytes() {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'"' => out.extend_from_slice(b"\\\""),
            b'\n' => out.extend_from_slice(b"\\n"),
            _ => out.push(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll(a: &mut Acquire) -> Option<Permit> {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(a).poll(&mut cx) {
            Poll::Ready(p) => Some(p),
            Poll::Pending => None,
        }
    }

    #[test]
    fn unlimited_never_queues() {
        let s = Slots::new(None);
        let permits: Vec<_> = (0..5).filter_map(|_| poll(&mut s.acquire())).collect();
        assert_eq!(permits.len(), 5);
        assert_eq!((s.counts().running, s.counts().waiting), (5, 0));
        assert_eq!(s.report().kv_cache_usage, 0.0);
        drop(permits);
        assert_eq!(s.counts().running, 0);
    }

    #[test]
    fn first_come_first_served_and_cancellation() {
        let s = Slots::new(Some(2));
        let p1 = s.acquire().now();
        let p2 = poll(&mut s.acquire());
        assert!(p1.is_some() && p2.is_some());
        assert_eq!(s.report().kv_cache_usage, 1.0);
        let mut a = s.acquire();
        let mut b = s.acquire();
        let mut c = s.acquire();
        assert!(poll(&mut a).is_none() && poll(&mut b).is_none() && poll(&mut c).is_none());
        assert_eq!(
            s.counts(),
            Counts {
                running: 2,
                waiting: 3,
                queued: 3
            }
        );
        // b's client leaves while queued: b leaves the queue.
        drop(b);
        assert_eq!(s.counts().waiting, 2);
        // A slot frees: it goes to a (first in line), not to a newcomer.
        drop(p1);
        let mut late = s.acquire();
        assert!(poll(&mut late).is_none());
        let pa = poll(&mut a);
        assert!(pa.is_some());
        assert_eq!((s.counts().running, s.counts().waiting), (2, 2));
        // c is handed a slot but goes away before taking it: the slot passes to `late`.
        drop(p2);
        drop(c);
        let pl = poll(&mut late);
        assert!(pl.is_some());
        assert_eq!((s.counts().running, s.counts().waiting), (2, 0));
        drop(pa);
        drop(pl);
        assert_eq!(s.counts().running, 0);
    }

    #[test]
    fn override_and_metrics_text() {
        let s = Slots::new(Some(4));
        let _p = poll(&mut s.acquire());
        assert_eq!(
            s.report(),
            Report {
                running: 1,
                waiting: 0,
                kv_cache_usage: 0.25
            }
        );
        s.set_override(Override {
            waiting: Some(7),
            ..Override::default()
        });
        let r = s.report();
        assert_eq!((r.running, r.waiting), (1, 7));
        s.set_override(Override {
            running: Some(9),
            waiting: None,
            kv_cache_usage: None,
        });
        // Over max-running: the usage is capped at 1.
        assert_eq!(s.report().kv_cache_usage, 1.0);
        let mut out = Vec::new();
        write_metrics(&mut out, &s.report(), "m\"x");
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.contains("vllm:num_requests_running{engine=\"0\",model_name=\"m\\\"x\"} 9.0\n"),
            "{text}"
        );
        assert!(text.contains("sglang:num_queue_reqs{model_name=\"m\\\"x\"} 0.0\n"));
        assert!(text.contains("# TYPE vllm:kv_cache_usage_perc gauge\n"));
    }
}
