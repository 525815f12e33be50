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
//!   succeeds (logged once each way); it never fails a request by itself. When the worker stops,
//!   one last exchange carries the spend of the requests that finished since the one before.

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

use crate::sys::clock::Mono;

use shard::LimiterShard;
use sync::{BudgetState, BudgetSync, SyncBackend};

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
/// exchange of all its budgets with the backend. Runs for the life of the worker: when `stop`
/// resolves (the worker is stopping, its requests are done), it makes one final exchange at once
/// — so the spend settled since the last one reaches the ledger — and returns. Takes the
/// worker's limiter shard, the sync settings, the worker's number (for log lines) and what to
/// call after each exchange with its duration and outcome (the worker's metrics).
pub(crate) async fn run_sync<B: SyncBackend>(
    limiter: &RefCell<LimiterShard>,
    settings: &crate::config::limits::SyncSettings,
    worker_id: usize,
    on_exchange: impl Fn(Duration, bool),
    mut backend: B,
    stop: impl Future<Output = ()>,
) {
    let node = limiter.borrow().node().to_string();
    let lease_ttl_ms = settings.lease_ttl.as_millis() as u64;
    let mut batch: Vec<BudgetSync> = Vec::new();
    let mut states: Vec<BudgetState> = Vec::new();
    let mut last_exchange: Option<Mono> = None;
    let mut stop = std::pin::pin!(stop);
    let mut stopping = false;
    monoio::select! {
        () = backend.warm_up(settings.timeout.max(settings.interval)) => {}
        () = &mut stop => stopping = true,
    }
    loop {
        if !stopping {
            let urgent = Urgent { shard: limiter };
            monoio::select! {
                _ = monoio::time::sleep(settings.interval) => {}
                _ = urgent => {}
                () = &mut stop => stopping = true,
            }
        }
        // A hurried exchange still waits a tenth of the interval after the last one, so a
        // storm of waiting requests can't turn into a storm of round trips: at most ten
        // exchanges per interval per worker, whatever the request rate. The final one does not.
        if let (Some(last), false) = (last_exchange, stopping) {
            let gap = settings.interval / 10;
            let since = Mono::now().saturating_duration_since(last);
            if since < gap {
                monoio::select! {
                    _ = monoio::time::sleep(gap - since) => {}
                    () = &mut stop => stopping = true,
                }
            }
        }
        last_exchange = Some(Mono::now());
        let now_ms = crate::sys::time::unix_ms();
        limiter
            .borrow_mut()
            .prepare(now_ms, settings.interval, &mut batch);
        if batch.is_empty() {
            limiter.borrow_mut().tick();
            if stopping {
                return;
            }
            continue;
        }
        let sent_at = Mono::now();
        let result = backend
            .exchange(&node, lease_ttl_ms, &batch, &mut states, settings.timeout)
            .await;
        on_exchange(
            Mono::now().saturating_duration_since(sent_at),
            result.is_ok(),
        );
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
        if stopping {
            return;
        }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::limits::ledger::InProcessLedger;
    use crate::limits::shard::{Ask, Permit, RefusalKind};
    use std::time::Instant;

    /// A stop asks the sync task for its last exchange: it makes it at once (not at the end of
    /// its 10 s interval), the spend settled since the exchange before reaches the ledger, and
    /// the task ends.
    #[test]
    fn a_stop_makes_one_last_exchange_then_the_sync_task_ends() {
        let config = format!(
            r#"
[clusters.main]
backends = [{{ base_url = "http://127.0.0.1:9/v1" }}]
[[routes]]
model = "m"
cluster = "main"
[limits]
sync_interval_ms = 10000
lease_ttl_ms = 60000
[[keys]]
id = "k"
sha256 = "{}"
plans = [{{ id = "q", tokens = 10000 }}]
"#,
            crate::config::limits::hex(&crate::config::limits::digest(b"k")),
        );
        let cfg = crate::config::load(&config, &|_| None).unwrap().limits;
        let shard = RefCell::new(LimiterShard::new(&cfg, "n1".into()));
        let ledger = InProcessLedger::new();
        let ask = Ask {
            key: Some(0),
            model: "m",
            prompt_estimate: 20,
            max_tokens: Some(100),
            n: None,
        };

        // A lease first (a quota admits only from one), then a request spends 42 of it.
        let mut permit = Permit::default();
        let refused = shard
            .borrow_mut()
            .try_admit(&cfg, &ask, &mut permit, &mut |_, _| {})
            .unwrap_err();
        assert_eq!(refused.kind, RefusalKind::NeedLease);
        let (mut batch, mut states) = (Vec::new(), Vec::new());
        shard
            .borrow_mut()
            .prepare(crate::sys::time::unix_ms(), cfg.sync.interval, &mut batch);
        ledger.exchange_at(Instant::now(), "n1", 60_000, &batch, &mut states);
        shard.borrow_mut().apply(Ok(&states), &batch, Mono::now());
        let key = batch[0].key.clone();
        let mut permit = Permit::default();
        shard
            .borrow_mut()
            .try_admit(&cfg, &ask, &mut permit, &mut |_, _| {})
            .unwrap();
        shard.borrow_mut().settle(&mut permit, 42);

        // What another node sees of the budget's spend.
        let spent_total = || {
            let mut out = Vec::new();
            let probe = sync::BudgetSync {
                key: key.clone(),
                limit: 10_000,
                spent: 0,
                lease: 0,
                floor: 0,
                shortfall: 0,
                key_ttl_ms: 0,
                slide: None,
            };
            ledger.exchange_at(Instant::now(), "probe", 60_000, &[probe], &mut out);
            out[0].spent_total
        };
        assert_eq!(spent_total(), 0, "nothing was exchanged since the spend");

        let started = Instant::now();
        crate::limits::ledger::conformance::block_on(run_sync(
            &shard,
            &cfg.sync,
            0,
            |_, ok| assert!(ok),
            ledger.clone(),
            std::future::ready(()),
        ));
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the last exchange waited for the interval: {:?}",
            started.elapsed()
        );
        assert_eq!(spent_total(), 42);
    }
}
