//! Limits: API-key quota plans and RPM / TPM / concurrency policies, decided per core and shared
//! through a sync backend.
//!
//! - [`crate::config::limits`]: the `[[keys]]`, `[[policies]]` and `[limits]` sections, validated
//!   once at load (in the config layer) into the `LimitsConfig` read here.
//! - [`shard`]: one worker's budgets; admission and settlement run there, on the request path,
//!   with no lock and no round trip.
//! - [`sync`]: the ledger contract every backend implements; [`ledger`] (in-process, the
//!   default), [`redis`] and [`redis_cluster`] implement it.
//! - [`run_sync`]: the worker's sync task. Runs for the life of a worker when anything is
//!   limited; once per `sync_interval_ms` (sooner, but at most ten times per interval, when a
//!   request waits for a lease) it sends every active budget's spend and lease wish in one
//!   round trip and applies the grants. A failed exchange marks the ledger unreachable until one
//!   succeeds (logged once each way); it never fails a request by itself.

pub(crate) mod ledger;
pub(crate) mod redis;
pub(crate) mod redis_cluster;
pub(crate) mod shard;
pub(crate) mod sync;

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use std::time::Instant;

use shard::LimiterShard;
use sync::{BudgetState, BudgetSync, SyncBackend};

/// Limits need a sync task only when something is limited.
pub(crate) fn any_limits(cfg: &crate::config::limits::LimitsConfig) -> bool {
    !cfg.policies.is_empty() || cfg.keys.iter().any(|k| !k.plans.is_empty())
}

/// A name for this worker in the ledger, unique per process start: `host:pid:nonce:worker`.
pub(crate) fn node_name(worker: usize) -> String {
    let mut host = [0u8; 64];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let ok = unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) } == 0;
    let host = if ok {
        let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
        String::from_utf8_lossy(&host[..end]).into_owned()
    } else {
        "node".into()
    };
    let nonce = crate::sys::time::subsec_nanos();
    format!("{host}:{}:{nonce:08x}:{worker}", std::process::id())
}

/// The worker's sync task: every interval (or sooner when a request waits for a lease), one
/// exchange of all its budgets with the backend. Runs for the life of the worker. Takes the
/// worker's limiter shard, the sync settings, the worker's number (for log lines) and what to
/// call after each exchange with its duration and outcome (the worker's metrics).
pub(crate) async fn run_sync<B: SyncBackend>(
    limiter: &RefCell<LimiterShard>,
    settings: &crate::config::limits::SyncSettings,
    worker_id: usize,
    on_exchange: impl Fn(Duration, bool),
    mut backend: B,
) {
    let node = limiter.borrow().node().to_string();
    let lease_ttl_ms = settings.lease_ttl.as_millis() as u64;
    let mut batch: Vec<BudgetSync> = Vec::new();
    let mut states: Vec<BudgetState> = Vec::new();
    let mut last_exchange: Option<Instant> = None;
    backend
        .warm_up(settings.timeout.max(settings.interval))
        .await;
    loop {
        {
            let urgent = Urgent { shard: limiter };
            monoio::select! {
                _ = monoio::time::sleep(settings.interval) => {}
                _ = urgent => {}
            }
        }
        // A hurried exchange still waits a tenth of the interval after the last one, so a
        // storm of waiting requests can't turn into a storm of round trips: at most ten
        // exchanges per interval per worker, whatever the request rate.
        if let Some(last) = last_exchange {
            let gap = settings.interval / 10;
            let since = last.elapsed();
            if since < gap {
                monoio::time::sleep(gap - since).await;
            }
        }
        last_exchange = Some(Instant::now());
        let now_ms = crate::sys::time::unix_ms();
        limiter
            .borrow_mut()
            .prepare(now_ms, settings.interval, &mut batch);
        if batch.is_empty() {
            limiter.borrow_mut().tick();
            continue;
        }
        let sent_at = Instant::now();
        let result = backend
            .exchange(&node, lease_ttl_ms, &batch, &mut states, settings.timeout)
            .await;
        on_exchange(sent_at.elapsed(), result.is_ok());
        // State changes only, so a flapping backend can't flood stderr: one line each way.
        let was_ok = limiter.borrow().backend_ok();
        match (&result, was_ok) {
            (Err(e), true) => eprintln!(
                "sluice: worker {}: limit ledger unreachable ({e}); serving on held leases{}",
                worker_id,
                match settings.on_down {
                    crate::config::limits::DownPolicy::Allow => " and local shares",
                    crate::config::limits::DownPolicy::Deny => ", refusing beyond them",
                }
            ),
            (Ok(()), false) => {
                eprintln!("sluice: worker {worker_id}: limit ledger reachable again")
            }
            _ => {}
        }
        limiter.borrow_mut().apply(
            result.map(|()| states.as_slice()).map_err(|_| ()),
            &batch,
            sent_at,
        );
    }
}

/// Resolves when a request asks the sync task to hurry.
struct Urgent<'a> {
    shard: &'a RefCell<LimiterShard>,
}

impl Future for Urgent<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.shard.borrow_mut().take_urgent(cx.waker()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}
