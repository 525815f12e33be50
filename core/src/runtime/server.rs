//! Startup: listeners, worker threads and their runtimes.
//!
//! Runs on the main thread once. Takes a validated [`Snapshot`]; binds one SO_REUSEPORT
//! listener per worker (after checking that no other process holds the port — SO_REUSEPORT
//! would otherwise silently share it), starts one thread per worker pinned to a core, each with
//! its own monoio runtime (io_uring, or epoll when io_uring is unavailable or
//! `MONOIO_FORCE_LEGACY_DRIVER=1`), logs the address and the driver, and then becomes the control
//! thread: it waits for signals (a thread of its own takes them with `sigwait`; every other
//! thread has them blocked) and admin requests, and hands workers their commands
//! (`runtime::control`). Returns an error when the port is taken or a runtime cannot start.
//!
//! Stopping (SIGTERM, SIGINT): `/readyz` turns 503 at once and every worker drains — its accept
//! loop ends (the listener closes, so new connections are refused), idle connections close, and
//! requests in flight run for up to `server.shutdown_grace_ms`. Then the worker shuts its
//! upstream connections down, which ends what still runs (streams with an SSE error event,
//! through the relay's usual path, billed and logged), waits up to [`AFTER_GRACE`] more for those
//! requests to finish, makes a last limiter exchange, closes its access log and ends its thread.
//! `run` returns once every worker has reported, so the process exits 0. A second signal while
//! draining exits at once, with status 1.

use std::fmt::Write as _;
use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::rc::Rc;
use std::sync::mpsc;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::config::Snapshot;
use crate::runtime::takeover;
use crate::runtime::worker::Worker;
use crate::telemetry::accesslog::{AccessLog, AccessLogConfig};
use crate::telemetry::admin::spawn_admin;
use crate::telemetry::metrics::MetricsHub;

/// The worker's limits sync task (see [`crate::limits::run_sync`]), holding the worker alive;
/// it ends after its last exchange, once the worker's stop asks for it.
async fn sync_task<B: crate::limits::sync::SyncBackend>(worker: Rc<Worker>, backend: B) {
    let settings = worker.snapshot().limits.sync.clone();
    let metrics = &worker.metrics;
    crate::limits::run_sync(
        &worker.limiter,
        &settings,
        worker.id,
        |took, ok| metrics.sync_flush(took, ok),
        backend,
        worker.stop.last_sync.wait(),
    )
    .await;
}

/// Which I/O driver a worker's runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Driver {
    IoUring,
    Legacy,
}

impl Driver {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Driver::IoUring => "io_uring",
            Driver::Legacy => "legacy",
        }
    }
}

/// What the control thread is told.
pub(crate) enum ControlEvent {
    /// SIGTERM or SIGINT.
    Stop,
    /// SIGHUP (`None`), or `POST /admin/reload` (where to send the outcome).
    Reload(Option<mpsc::Sender<crate::telemetry::admin::ReloadReply>>),
    /// A worker finished draining; its thread is ending.
    Stopped(StopReport),
    /// A successor took the listening sockets over and serves on them: drain, leaving them
    /// listening.
    HandedOver,
}

/// How one worker's drain went.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StopReport {
    /// Requests that ended while it drained, on their own.
    finished: u64,
    /// Requests the end of the grace ended (an SSE error event, or a closed connection).
    ended_at_deadline: u64,
    /// Requests still running [`AFTER_GRACE`] after the grace: dropped, neither billed nor
    /// logged (a client that stopped reading, say).
    abandoned: usize,
}

/// How long a worker whose grace ran out waits for the requests it ended (its upstream
/// connections shut down) to write their end, settle and log, before it drops what is left.
const AFTER_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Beyond a worker's own bounds (grace, [`AFTER_GRACE`], two limiter exchanges), how long the
/// control thread waits for its report before giving up on it.
const STOP_MARGIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Run the gateway on `snapshot`, read from `config_path` (read again on reload), until it is
/// stopped. With `takeover_from`, the listening sockets are the process's serving on that
/// socket path (which then drains: see [`crate::runtime::takeover`]) instead of new ones.
pub fn run(
    snapshot: Snapshot,
    config_path: std::path::PathBuf,
    takeover_from: Option<std::path::PathBuf>,
) -> io::Result<()> {
    // First, before any thread starts: every thread inherits the mask, so only the signal
    // thread ever takes these signals.
    let signals = block_control_signals()?;
    let (events_tx, events_rx) = mpsc::channel::<ControlEvent>();
    spawn_signal_thread(signals, events_tx.clone())?;
    warn_if_fd_limit_low(crate::sys::sock::raise_open_files_limit(), &snapshot);
    if snapshot.limits.settle_tokenizer == crate::config::limits::SettleTokenizer::Tiktoken {
        // Building the BPE tables takes a while: do it before serving, not on a request.
        for encoding in [
            crate::openai::tokens::Encoding::Cl100k,
            crate::openai::tokens::Encoding::O200k,
        ] {
            if !crate::openai::tokens::warm_up(encoding) {
                eprintln!(
                    "sluice: tiktoken {} unavailable; settling with the estimate",
                    encoding.name()
                );
            }
        }
    }
    // The previous process's listening sockets, in a takeover; else this process binds its own.
    let (inherited, successor_link) = match &takeover_from {
        Some(path) => {
            let (inherited, link) = takeover::request(path)?;
            (Some(inherited), Some(link))
        }
        None => (None, None),
    };
    let inherited_addr = |list: Option<&Vec<StdListener>>| {
        list.and_then(|l| l.first())
            .map(StdListener::local_addr)
            .transpose()
    };
    let addr = match inherited_addr(inherited.as_ref().map(|i| &i.plain))? {
        Some(addr) => addr,
        None => claim_port(snapshot.server.listen)?,
    };
    let tls_addr = match (
        &snapshot.tls,
        inherited_addr(inherited.as_ref().map(|i| &i.tls))?,
    ) {
        (Some(_), Some(inherited)) => Some(inherited),
        (Some(tls), None) => Some(claim_port(tls.listen)?),
        (None, _) => None,
    };
    let hub = MetricsHub::for_snapshot(&snapshot);
    hub.set_tls_expiry(snapshot.tls.as_ref().map_or(0, |t| t.earliest_expiry));
    let ready = Arc::new(AtomicBool::new(false));
    let admin = match snapshot.admin_listen {
        // Its error names the address.
        Some(admin_addr) => {
            let events = events_tx.clone();
            let reload: crate::telemetry::admin::ReloadHook = Box::new(move |reply| {
                let _ = events.send(ControlEvent::Reload(Some(reply)));
            });
            Some(spawn_admin(
                admin_addr,
                Arc::clone(&hub),
                Arc::clone(&ready),
                Some(crate::telemetry::admin::AdminControl {
                    reload,
                    token_digest: snapshot.admin_token_digest,
                }),
                // In a takeover the previous process still holds the port while it drains.
                takeover_from.is_some(),
            )?)
        }
        None => None,
    };
    let workers = snapshot.server.workers;
    // One health table for every worker: what one learns of a backend, all act on.
    let health = Arc::new(crate::upstream::health::HealthTable::build(&snapshot, None));
    set_queue_metrics(&hub, &snapshot, &health);
    let scraper = crate::runtime::scrape::Scraper::start(&snapshot, &health)?;
    let fleet = crate::runtime::fleet::Fleet::start(&snapshot, &health)?;
    let listeners = worker_listeners(workers, addr, tls_addr, inherited)?;
    // Duplicates of every listening socket, for a successor to take over.
    let handover = match &snapshot.server.takeover_socket {
        Some(path) => Some((path.clone(), duplicates(&listeners)?)),
        None => None,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The in-process ledger the workers share when limits are not kept in Redis.
    let ledger = crate::limits::ledger::InProcessLedger::new();
    let (ready_tx, ready_rx) = mpsc::channel::<io::Result<Driver>>();
    let mut handles = Vec::with_capacity(workers);
    let mut controls = Vec::with_capacity(workers);
    for (id, (listeners, tls_listeners)) in listeners.into_iter().enumerate() {
        let (control_tx, control) = crate::runtime::control::channel()?;
        controls.push(control_tx);
        let ready = ready_tx.clone();
        let pin = snapshot.server.pin_workers.then_some(id % cores);
        let own = snapshot.clone();
        let hub = Arc::clone(&hub);
        // Opened here, on the main thread: a bad log directory stops startup with a clear error.
        let access_log = match &snapshot.access_log {
            Some(settings) => Some(
                AccessLog::open(&AccessLogConfig::from(settings), id as u32).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("access log in {}: {e}", settings.dir.display()),
                    )
                })?,
            ),
            None => None,
        };
        let ledger = ledger.clone();
        let shared_health = Arc::clone(&health);
        let events = events_tx.clone();
        let handle = std::thread::Builder::new()
            .name(format!("sluice-worker-{id}"))
            .spawn(move || {
                worker_thread(
                    WorkerSetup {
                        id,
                        pin,
                        listeners,
                        tls_listeners,
                        snapshot: own,
                        health: shared_health,
                        hub,
                        access_log,
                        ledger,
                        control,
                        events,
                    },
                    ready,
                )
            })?;
        handles.push(handle);
    }
    drop(ready_tx);
    let mut driver = Driver::IoUring;
    for _ in 0..workers {
        match ready_rx.recv() {
            Ok(Ok(d)) => driver = d,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(io::Error::other("a worker failed to start")),
        }
    }
    if driver == Driver::Legacy {
        if std::env::var_os("MONOIO_FORCE_LEGACY_DRIVER").is_some() {
            eprintln!(
                "sluice: running on the epoll (legacy) driver, as MONOIO_FORCE_LEGACY_DRIVER asks"
            );
        } else {
            eprintln!(
                "sluice: io_uring is unavailable (kernel older than 5.x, or blocked by seccomp or \
                 io_uring_disabled); running on the epoll (legacy) driver"
            );
        }
    }
    ready.store(true, Ordering::Release);
    // Written whole, with one call: `eprintln!` with arguments writes each piece with a syscall
    // of its own, and the scripts that wait for these lines in a file could read "listening on"
    // before the address.
    let mut listening = String::new();
    if let Some(tls_addr) = tls_addr {
        let _ = writeln!(listening, "sluice: tls listening on {tls_addr}");
    }
    let _ = writeln!(
        listening,
        "sluice: listening on {addr} (workers={workers}, driver={})",
        driver.name()
    );
    if let Some(admin) = admin {
        let _ = writeln!(
            listening,
            "sluice: admin listening on {admin} (/metrics, /healthz, /readyz, /admin/reload)"
        );
    }
    let _ = io::Write::write_all(&mut io::stderr(), listening.as_bytes());
    // Offer the sockets to a successor in turn — before telling the previous process to drain,
    // so that nothing after that can fail and leave nobody serving.
    let handover_state = Arc::new(takeover::Handover::default());
    if let Some((path, sockets)) = handover {
        let events = events_tx.clone();
        let drain = Box::new(move || {
            let _ = events.send(ControlEvent::HandedOver);
        });
        takeover::serve(path, sockets, Arc::clone(&handover_state), drain)?;
    }
    // Serving on the inherited sockets: the previous process may drain now. If it cannot be
    // told, it goes on serving on the same sockets, and this process ends (its workers'
    // connections with it) rather than serve beside it unannounced.
    if let Some(link) = successor_link {
        takeover::ready(&link)?;
        eprintln!("sluice: took over the listening sockets; the previous process drains");
    }
    drop(events_tx);
    let control = Control {
        config_path,
        snapshot,
        health,
        scraper,
        fleet,
        workers: controls,
        ready,
        hub,
        stopping: None,
        handover: handover_state,
    };
    // Every worker reported: their threads are ending; join them. Otherwise the process ends
    // with them still running.
    control.run(events_rx)?;
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

/// The control thread's state: what it needs to reload and to stop.
struct Control {
    config_path: std::path::PathBuf,
    /// The snapshot the workers were last given, and its health table.
    snapshot: Snapshot,
    health: Arc<crate::upstream::health::HealthTable>,
    /// Reads the queue of backends whose cluster asks for it (`queue_metrics`).
    scraper: crate::runtime::scrape::Scraper,
    fleet: crate::runtime::fleet::Fleet,
    workers: Vec<crate::runtime::control::ControlSender>,
    ready: Arc<AtomicBool>,
    hub: Arc<MetricsHub>,
    /// Set once a stop began.
    stopping: Option<Stopping>,
    /// Whether the listening sockets are (being) handed to a successor.
    handover: Arc<takeover::Handover>,
}

/// A stop in progress: the workers' reports so far.
struct Stopping {
    started: std::time::Instant,
    /// When to stop waiting for the reports still missing.
    give_up_at: std::time::Instant,
    /// Workers that have not reported yet.
    waiting: usize,
    total: StopReport,
}

/// How long a reload waits for every worker to take the new snapshot (a worker takes it
/// between two of its tasks' steps, so this is a wedged worker's bound, not a normal wait).
const SWAP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl Control {
    /// Handle events until the workers are stopped: `Ok` once every worker has drained and
    /// reported, an error when some did not within their bounds.
    fn run(mut self, events: mpsc::Receiver<ControlEvent>) -> io::Result<()> {
        loop {
            let event = match &self.stopping {
                None => events.recv().ok(),
                Some(stopping) => {
                    let left = stopping
                        .give_up_at
                        .saturating_duration_since(std::time::Instant::now());
                    match events.recv_timeout(left) {
                        Ok(event) => Some(event),
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            let message = format!(
                                "{} of {} workers did not stop in time",
                                stopping.waiting,
                                self.workers.len()
                            );
                            return Err(io::Error::other(message));
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => None,
                    }
                }
            };
            // The signal thread keeps a sender for the life of the process: no more events
            // means nothing can stop the workers any more.
            let Some(event) = event else {
                return Ok(());
            };
            match event {
                ControlEvent::Reload(reply) if self.stopping.is_some() => {
                    eprintln!("sluice: reload ignored: shutting down");
                    if let Some(reply) = reply {
                        let body = serde_json::json!({
                            "status": "rejected",
                            "errors": ["shutting down"],
                        });
                        let _ = reply.send(crate::telemetry::admin::ReloadReply {
                            status: 503,
                            body: body.to_string(),
                        });
                    }
                }
                ControlEvent::Reload(reply) => self.reload(reply),
                ControlEvent::Stop if self.stopping.is_some() => {
                    // The operator insists: no more waiting. Requests still running are cut
                    // and neither billed nor logged; the exit status says so.
                    eprintln!(
                        "sluice: second stop signal; exiting now without finishing the drain"
                    );
                    std::process::exit(1);
                }
                ControlEvent::Stop => self.stop(false),
                ControlEvent::HandedOver => self.stop(true),
                ControlEvent::Stopped(report) => {
                    if let Some(stopping) = &mut self.stopping {
                        stopping.waiting = stopping.waiting.saturating_sub(1);
                        stopping.total.finished += report.finished;
                        stopping.total.ended_at_deadline += report.ended_at_deadline;
                        stopping.total.abandoned += report.abandoned;
                    }
                }
            }
            if let Some(stopping) = self.stopping.as_ref().filter(|s| s.waiting == 0) {
                let StopReport {
                    finished,
                    ended_at_deadline,
                    abandoned,
                } = stopping.total;
                let dropped = if abandoned > 0 {
                    format!(", {abandoned} dropped unfinished")
                } else {
                    String::new()
                };
                eprintln!(
                    "sluice: stopped ({finished} requests finished, {ended_at_deadline} ended at the deadline{dropped}; {} ms)",
                    stopping.started.elapsed().as_millis()
                );
                return Ok(());
            }
        }
    }

    /// Begin a stop: not ready any more, and every worker drains for the configured grace
    /// (the running config's: a reload may have changed it).
    fn stop(&mut self, handed_over: bool) {
        if self.stopping.is_some() {
            return;
        }
        // A hand-over under way (or done) keeps the sockets listening: they are the successor's.
        let handed_over = self.handover.stop_begins() || handed_over;
        self.ready.store(false, Ordering::Release);
        let grace = self.snapshot.server.shutdown_grace;
        eprintln!("sluice: draining (grace {} ms)", grace.as_millis());
        let mut sent = 0;
        for worker in &self.workers {
            let command = crate::runtime::control::Command::Drain {
                grace,
                keep_listening: handed_over,
            };
            if worker.send(command).is_ok() {
                sent += 1;
            }
        }
        let started = std::time::Instant::now();
        let sync_bound = 2 * self.snapshot.limits.sync.timeout;
        self.stopping = Some(Stopping {
            started,
            give_up_at: started + grace + AFTER_GRACE + sync_bound + STOP_MARGIN,
            waiting: sent,
            total: StopReport::default(),
        });
    }

    /// Read the config file again, validate all of it, and hand every worker the new snapshot;
    /// an invalid file changes nothing. Logs one line and counts the outcome, and answers
    /// `reply` (the admin request) with a JSON report.
    fn reload(&mut self, reply: Option<mpsc::Sender<crate::telemetry::admin::ReloadReply>>) {
        let started = std::time::Instant::now();
        let outcome = self.try_reload();
        let took_ms = started.elapsed().as_millis();
        let now_s = crate::sys::time::unix_ms() / 1000;
        let (status, body) = match outcome {
            Ok(applied) => {
                self.hub.record_reload(true, now_s);
                let restart = if applied.restart_only.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; not applied until a restart: {}",
                        applied.restart_only.join(", ")
                    )
                };
                eprintln!(
                    "sluice: reload applied (config sha256 {}, {} workers, {took_ms} ms){restart}",
                    applied.sha256, applied.workers
                );
                for w in &applied.warnings {
                    eprintln!("sluice: reload warning: {w}");
                }
                let body = serde_json::json!({
                    "status": "applied",
                    "config_sha256": applied.sha256,
                    "workers": applied.workers,
                    "restart_required": applied.restart_only,
                    "warnings": applied.warnings,
                });
                (200, body)
            }
            Err(rejected) => {
                self.hub.record_reload(false, now_s);
                // A file that could not be read has no digest to name.
                let which = if rejected.sha256.is_empty() {
                    "config file unreadable".to_owned()
                } else {
                    format!("config sha256 {}", rejected.sha256)
                };
                eprintln!(
                    "sluice: reload rejected ({which}): {} error(s); the running config stays",
                    rejected.errors.len()
                );
                for e in &rejected.errors {
                    eprintln!("sluice: reload error: {e}");
                }
                let body = serde_json::json!({
                    "status": "rejected",
                    "config_sha256": (!rejected.sha256.is_empty()).then_some(&rejected.sha256),
                    "errors": rejected.errors,
                });
                (rejected.status, body)
            }
        };
        if let Some(reply) = reply {
            let _ = reply.send(crate::telemetry::admin::ReloadReply {
                status,
                body: body.to_string(),
            });
        }
    }

    fn try_reload(&mut self) -> Result<Applied, Rejected> {
        let text = std::fs::read_to_string(&self.config_path).map_err(|e| Rejected {
            status: 500,
            sha256: String::new(),
            errors: vec![format!("cannot read {}: {e}", self.config_path.display())],
        })?;
        let sha256 = crate::config::limits::hex(&crate::config::limits::digest(text.as_bytes()));
        let loaded = crate::config::load_with_warnings(&text, &|k| std::env::var(k).ok());
        let warnings: Vec<String> = loaded.warnings.iter().map(ToString::to_string).collect();
        let mut snapshot = loaded.snapshot.map_err(|errors| Rejected {
            status: 422,
            sha256: sha256.clone(),
            errors: errors.iter().map(ToString::to_string).collect(),
        })?;
        let restart_only = snapshot.keep_restart_only(&self.snapshot);
        // Log files are opened here, off the workers; a directory that cannot be used rejects
        // the whole reload (the old writers keep writing).
        let access_logs = if snapshot.access_log != self.snapshot.access_log {
            let mut logs = Vec::with_capacity(self.workers.len());
            for id in 0..self.workers.len() {
                logs.push(match &snapshot.access_log {
                    Some(settings) => Some(
                        AccessLog::open(&AccessLogConfig::from(settings), id as u32).map_err(
                            |e| Rejected {
                                status: 422,
                                sha256: sha256.clone(),
                                errors: vec![format!(
                                    "access_log: cannot open {}: {e}",
                                    settings.dir.display()
                                )],
                            },
                        )?,
                    ),
                    None => None,
                });
            }
            Some(logs)
        } else {
            None
        };
        let health = Arc::new(crate::upstream::health::HealthTable::build(
            &snapshot,
            Some(&self.health),
        ));
        set_queue_metrics(&self.hub, &snapshot, &health);
        let (done_tx, done_rx) = mpsc::channel();
        let mut sent = 0;
        let mut logs = access_logs.map(Vec::into_iter);
        for worker in &self.workers {
            let to = crate::runtime::control::SwapTo {
                snapshot: snapshot.clone(),
                health: Arc::clone(&health),
                access_log: logs.as_mut().map(|l| l.next().flatten()),
                done: done_tx.clone(),
            };
            if worker
                .send(crate::runtime::control::Command::Swap(Box::new(to)))
                .is_ok()
            {
                sent += 1;
            }
        }
        let deadline = std::time::Instant::now() + SWAP_DEADLINE;
        let mut swapped = 0;
        while swapped < sent {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match done_rx.recv_timeout(left) {
                Ok(_) => swapped += 1,
                Err(_) => break,
            }
        }
        self.scraper.replan(&snapshot, &health);
        self.fleet.replan(&snapshot, &health);
        let tls_expiry = snapshot.tls.as_ref().map_or(0, |t| t.earliest_expiry);
        self.hub.set_tls_expiry(tls_expiry);
        self.snapshot = snapshot;
        self.health = health;
        if swapped < self.workers.len() {
            eprintln!(
                "sluice: reload: {swapped} of {} workers confirmed the new config in time",
                self.workers.len()
            );
        }
        Ok(Applied {
            sha256,
            workers: swapped,
            restart_only,
            warnings,
        })
    }
}

/// A reload that is serving.
struct Applied {
    sha256: String,
    /// Workers that confirmed the swap.
    workers: usize,
    /// Settings whose new values wait for a restart.
    restart_only: Vec<&'static str>,
    warnings: Vec<String>,
}

/// A reload that changed nothing, and why.
struct Rejected {
    status: u16,
    sha256: String,
    errors: Vec<String>,
}

/// Block SIGTERM, SIGINT and SIGHUP in this thread (and so in every thread it starts); returns
/// the set, for [`spawn_signal_thread`].
fn block_control_signals() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data that sigemptyset initialises; pthread_sigmask only reads
    // the set and changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(set)
    }
}

/// A thread that takes the blocked signals one at a time and tells the control thread.
fn spawn_signal_thread(set: libc::sigset_t, events: mpsc::Sender<ControlEvent>) -> io::Result<()> {
    std::thread::Builder::new()
        .name("sluice-signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialised signal set; sigwait writes the signal taken.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            if rc != 0 {
                continue;
            }
            let event = match sig {
                libc::SIGHUP => ControlEvent::Reload(None),
                _ => ControlEvent::Stop,
            };
            if events.send(event).is_err() {
                return;
            }
        })?;
    Ok(())
}

/// Each worker's listening sockets, plain and TLS: the inherited ones shared out (a worker may
/// get several when the previous process had more workers), and new ones bound with
/// SO_REUSEPORT for every worker still without one.
#[allow(clippy::type_complexity)] // (plain, tls) per worker
fn worker_listeners(
    workers: usize,
    addr: SocketAddr,
    tls_addr: Option<SocketAddr>,
    inherited: Option<takeover::Inherited>,
) -> io::Result<Vec<(Vec<StdListener>, Vec<StdListener>)>> {
    let mut lists: Vec<(Vec<StdListener>, Vec<StdListener>)> =
        (0..workers).map(|_| (Vec::new(), Vec::new())).collect();
    if let Some(inherited) = inherited {
        for (i, l) in inherited.plain.into_iter().enumerate() {
            l.set_nonblocking(true)?;
            lists[i % workers].0.push(l);
        }
        // Without a TLS listener in this config, inherited TLS sockets close here.
        if tls_addr.is_some() {
            for (i, l) in inherited.tls.into_iter().enumerate() {
                l.set_nonblocking(true)?;
                lists[i % workers].1.push(l);
            }
        }
    }
    for (plain, tls) in &mut lists {
        if plain.is_empty() {
            plain.push(reuseport_listener(addr)?);
        }
        if let (Some(tls_addr), true) = (tls_addr, tls.is_empty()) {
            tls.push(reuseport_listener(tls_addr)?);
        }
    }
    Ok(lists)
}

/// A second descriptor of every listening socket, to hand over.
fn duplicates(lists: &[(Vec<StdListener>, Vec<StdListener>)]) -> io::Result<takeover::Inherited> {
    let mut all = takeover::Inherited {
        plain: Vec::new(),
        tls: Vec::new(),
    };
    for (plain, tls) in lists {
        for l in plain {
            all.plain.push(l.try_clone()?);
        }
        for l in tls {
            all.tls.push(l.try_clone()?);
        }
    }
    Ok(all)
}

/// Refuse a port another socket already holds, then return the concrete address (port 0
/// resolved). A plain bind without SO_REUSEPORT fails on any port already bound, with or
/// without SO_REUSEPORT, by any process.
fn claim_port(addr: SocketAddr) -> io::Result<SocketAddr> {
    match StdListener::bind(addr) {
        Ok(probe) => probe.local_addr(),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{addr} is already in use by another process; refusing to share it"),
        )),
        Err(e) => Err(io::Error::new(e.kind(), format!("cannot bind {addr}: {e}"))),
    }
}

/// A worker's listener; its error names the address.
fn reuseport_listener(addr: SocketAddr) -> io::Result<StdListener> {
    reuseport_bind(addr).map_err(|e| io::Error::new(e.kind(), format!("cannot bind {addr}: {e}")))
}

fn reuseport_bind(addr: SocketAddr) -> io::Result<StdListener> {
    let listener = crate::sys::sock::reuseport_listener(addr, 4096)?;
    // Accepted sockets inherit TCP_NODELAY from the listener.
    socket2::SockRef::from(&listener).set_nodelay(true)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// What one worker thread starts from.
struct WorkerSetup {
    id: usize,
    pin: Option<usize>,
    /// This worker's listening sockets (one, unless it inherited more in a takeover).
    listeners: Vec<StdListener>,
    /// Its TLS listening sockets, when there is a TLS listener.
    tls_listeners: Vec<StdListener>,
    snapshot: Snapshot,
    health: Arc<crate::upstream::health::HealthTable>,
    hub: Arc<MetricsHub>,
    access_log: Option<AccessLog>,
    /// The process's shared in-process ledger (used unless limits live in Redis).
    ledger: crate::limits::ledger::InProcessLedger,
    /// Where the control thread's commands arrive.
    control: crate::runtime::control::ControlReceiver,
    /// Where the worker reports that it stopped.
    events: mpsc::Sender<ControlEvent>,
}

fn worker_thread(setup: WorkerSetup, ready: mpsc::Sender<io::Result<Driver>>) {
    let WorkerSetup {
        id,
        pin,
        listeners,
        tls_listeners,
        snapshot,
        health,
        hub,
        access_log,
        ledger,
        control,
        events,
    } = setup;
    if let Some(core) = pin {
        pin_to_core(core);
    }
    let snapshot = Rc::new(snapshot);
    let runtime = match build_runtime() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(io::Error::other(format!("runtime start failed: {e}"))));
            return;
        }
    };
    let driver = match &runtime {
        monoio::FusionRuntime::Uring(_) => Driver::IoUring,
        monoio::FusionRuntime::Legacy(_) => Driver::Legacy,
    };
    let mut runtime = runtime;
    let report = runtime.block_on(async move {
        let Some(first) = listeners.first().and_then(|l| l.try_clone().ok()) else {
            let _ = ready.send(Err(io::Error::other("a worker has no listening socket")));
            return None;
        };
        // First: every timed wait from here on parks on the worker's list of deadlines.
        monoio::spawn(crate::sys::deadlines::run_sweeper());
        let worker = Rc::new(Worker::with_health(id, snapshot, health, hub, access_log));
        monoio::spawn(publish_metrics(Rc::clone(&worker)));
        monoio::spawn(sweep_idle_connections(Rc::clone(&worker)));
        // Always: a reload may turn the access log on.
        monoio::spawn(flush_access_log(Rc::clone(&worker)));
        let limits = Arc::clone(&worker.snapshot().limits);
        // Always, limits or not: a reload may add them (with nothing to exchange it only ticks).
        let sync = {
            Some(match limits.sync.redis.clone() {
                Some(settings) => match settings.cluster_seeds.clone() {
                    Some(seeds) => {
                        use crate::limits::redis_cluster::{
                            RedisClusterBackend, RedisClusterSettings,
                        };
                        let mut cluster = RedisClusterSettings::new(seeds);
                        cluster.username = settings.username;
                        cluster.password = settings.password;
                        cluster.connect_timeout = settings.connect_timeout;
                        let backend = RedisClusterBackend::new(cluster);
                        monoio::spawn(sync_task(Rc::clone(&worker), backend))
                    }
                    None => {
                        let mut redis = crate::limits::redis::RedisSettings::new(settings.address);
                        redis.username = settings.username;
                        redis.password = settings.password;
                        redis.db = settings.db;
                        redis.connect_timeout = settings.connect_timeout;
                        let backend = crate::limits::redis::RedisBackend::new(redis);
                        monoio::spawn(sync_task(Rc::clone(&worker), backend))
                    }
                },
                None => monoio::spawn(sync_task(Rc::clone(&worker), ledger)),
            })
        };
        let commanded = Rc::clone(&worker);
        monoio::spawn(control.serve(move |command| obey(&commanded, command)));
        let _ = ready.send(Ok(driver));
        for tls in tls_listeners {
            monoio::spawn(accept_loop(Rc::clone(&worker), tls, Listener::Tls));
        }
        for more in listeners.into_iter().skip(1) {
            monoio::spawn(accept_loop(Rc::clone(&worker), more, Listener::Plain));
        }
        // Until a drain starts (the others end with it).
        accept_loop(Rc::clone(&worker), first, Listener::Plain).await;
        let sync_timeout = limits.sync.timeout;
        Some(finish_drain(worker, sync.map(|task| (task, sync_timeout))).await)
    });
    // Every task (and the sockets they hold) goes with the runtime, before the report.
    drop(runtime);
    if let Some(report) = report {
        let _ = events.send(ControlEvent::Stopped(report));
    }
}

/// The rest of a worker's stop, once its accept loop ended: wait for its connections to close
/// (their requests to end) for the grace; past it, shut the upstream connections down (what
/// still streams ends with an SSE error event) and wait [`AFTER_GRACE`] more; then the limiter's
/// last exchange (bounded by twice the sync timeout: one may be under way) and the access log
/// flushed and closed.
async fn finish_drain(
    worker: Rc<Worker>,
    sync: Option<(monoio::task::JoinHandle<()>, std::time::Duration)>,
) -> StopReport {
    let grace = worker.stop.grace.get();
    let mut abandoned = 0;
    let closed = monoio::time::timeout(grace, worker.stop.all_closed.wait()).await;
    if closed.is_err() {
        worker.drain.end_grace();
        let upstream = worker.current().pools.shut_down_all();
        eprintln!(
            "sluice: worker {}: shutdown grace over; ending {} requests still running ({upstream} upstream connections closed)",
            worker.id,
            worker.load.active()
        );
        let settled = monoio::time::timeout(AFTER_GRACE, worker.stop.all_closed.wait()).await;
        if settled.is_err() {
            abandoned = worker.load.active();
        }
    }
    worker.stop.last_sync.set();
    if let Some((task, sync_timeout)) = sync {
        let bound = 2 * sync_timeout + std::time::Duration::from_millis(500);
        if monoio::time::timeout(bound, task).await.is_err() {
            eprintln!(
                "sluice: worker {}: the last limiter exchange did not finish in time",
                worker.id
            );
        }
    }
    worker.metrics.connections_open(worker.connections.get());
    worker.metrics.publish(&worker.hub);
    let writer = worker.log.writer.borrow_mut().take();
    if let Some(log) = writer {
        // Flushes what is buffered and waits for the writer thread to write it.
        log.close();
    }
    // One more turn of the runtime, parked: on io_uring a socket dropped just now (the last
    // connections') is closed by an operation queued to the ring, which goes to the kernel only
    // when the runtime parks; without it the client would see its close only at exit.
    monoio::time::sleep(std::time::Duration::from_millis(1)).await;
    let (finished, ended_at_deadline) = worker.drain.counts();
    StopReport {
        finished,
        ended_at_deadline,
        abandoned,
    }
}

/// Carry out one command from the control thread.
fn obey(worker: &Rc<Worker>, command: crate::runtime::control::Command) {
    use crate::runtime::control::Command;
    match command {
        Command::Swap(to) => {
            let crate::runtime::control::SwapTo {
                snapshot,
                health,
                access_log,
                done,
            } = *to;
            worker
                .limiter
                .borrow_mut()
                .reconfigure(&snapshot.limits, crate::sys::time::unix_ms());
            if let Some(writer) = access_log {
                // The old writer's records are flushed before it closes: none is lost.
                let old = worker.log.writer.replace(writer);
                if let Some(old) = old {
                    old.close();
                }
            }
            worker.swap_generation(Rc::new(snapshot), health);
            let _ = done.send(worker.id);
        }
        Command::Drain {
            grace,
            keep_listening,
        } => {
            worker.stop.listeners_handed_over.set(keep_listening);
            worker.start_drain(grace);
        }
    }
}

/// Which protocol a listener's connections speak.
#[derive(Clone, Copy)]
enum Listener {
    Plain,
    Tls,
}

/// Accept connections until a drain starts. It waits for the listening socket to be readable
/// and then takes what is queued with non-blocking `accept` calls — never with an accept operation
/// in flight in the kernel, which a drain would have to cancel: a connection that operation had
/// just taken would be lost. (That is what lets a successor share these very sockets: see
/// `runtime::takeover`.) When the drain starts, the socket stops listening (shut down, so the
/// port's SO_REUSEPORT group drops it at once) — unless the sockets were handed to a successor,
/// which goes on listening on them.
async fn accept_loop(worker: Rc<Worker>, listener: StdListener, kind: Listener) {
    use std::os::fd::AsRawFd;
    let fd = listener.as_raw_fd();
    let watch = match listener
        .try_clone()
        .and_then(monoio::net::TcpListener::from_std)
    {
        Ok(watch) => watch,
        Err(e) => {
            eprintln!("sluice: worker {}: cannot watch a listener: {e}", worker.id);
            return;
        }
    };
    loop {
        let readable = monoio::select! {
            readable = watch.readable(false) => Some(readable),
            () = worker.stop.draining.wait() => None,
        };
        if readable.is_none() {
            if !worker.stop.listeners_handed_over.get() {
                crate::sys::sock::shutdown(fd);
            }
            return;
        }
        // Everything queued now; `WouldBlock` once it is empty (or another process sharing the
        // socket took the connection first).
        loop {
            let (stream, peer) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    ) =>
                {
                    // Out of descriptors or memory: back off briefly instead of spinning.
                    monoio::time::sleep(std::time::Duration::from_millis(10)).await;
                    break;
                }
                // A connection that died in the queue (ECONNABORTED) and the like: the next.
                Err(_) => continue,
            };
            let stream = match stream
                .set_nonblocking(true)
                .and_then(|()| monoio::net::TcpStream::from_std(stream))
            {
                Ok(stream) => stream,
                Err(_) => continue,
            };
            spawn_connection(&worker, stream, peer, kind);
        }
    }
}

/// Serve one accepted connection on its own task, or refuse it past the worker's cap.
fn spawn_connection(
    worker: &Rc<Worker>,
    stream: monoio::net::TcpStream,
    peer: std::net::SocketAddr,
    kind: Listener,
) {
    // The current snapshot's cap: it reloads.
    let max = worker.snapshot().server.max_connections_per_worker;
    if worker.connections.get() >= max {
        monoio::spawn(crate::runtime::conn::refuse_overloaded(
            Rc::clone(worker),
            stream,
        ));
        return;
    }
    worker.connection_opened();
    let w = Rc::clone(worker);
    // Stamped: each wake-up of the connection reads the clock at most once (see sys::clock).
    monoio::spawn(crate::sys::clock::Stamped::new(async move {
        match kind {
            Listener::Plain => crate::runtime::conn::serve(Rc::clone(&w), stream, peer).await,
            Listener::Tls => crate::runtime::conn::serve_tls(Rc::clone(&w), stream, peer).await,
        }
        w.connection_closed();
    }));
}

/// How often a worker copies its metrics shard to the hub a scrape reads.
const METRICS_PUBLISH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

async fn publish_metrics(worker: Rc<Worker>) {
    loop {
        monoio::time::sleep(METRICS_PUBLISH_INTERVAL).await;
        worker.metrics.connections_open(worker.connections.get());
        worker.metrics.publish(&worker.hub);
    }
}

/// Close the kept-alive connections that waited for their next request past
/// `timeouts.keepalive_idle_ms`: one timer for the worker instead of one made and cancelled per
/// request. Each sweep shuts down the expired ones' sockets (`conn::serve_client` marks each
/// wait with its deadline), which ends their waits; a connection closes within an eighth of the
/// limit after it (at most a second, at least 5 ms).
async fn sweep_idle_connections(worker: Rc<Worker>) {
    loop {
        // The current snapshot's limit: a reload may change it.
        let every = idle_sweep_interval(worker.snapshot().timeouts.keepalive_idle);
        monoio::time::sleep(every).await;
        worker
            .clients
            .borrow_mut()
            .shut_down_expired(crate::sys::clock::Mono::now());
    }
}

/// How often [`sweep_idle_connections`] looks: an eighth of the limit, 5 ms to 1 s.
fn idle_sweep_interval(limit: std::time::Duration) -> std::time::Duration {
    (limit / 8).clamp(
        std::time::Duration::from_millis(5),
        std::time::Duration::from_secs(1),
    )
}

async fn flush_access_log(worker: Rc<Worker>) {
    loop {
        // The current writer's interval: a reload may change it, or turn logging on or off.
        let interval = worker
            .log
            .writer
            .borrow()
            .as_ref()
            .map_or(METRICS_PUBLISH_INTERVAL, AccessLog::flush_interval);
        monoio::time::sleep(interval).await;
        if let Some(log) = worker.log.writer.borrow_mut().as_mut() {
            log.flush_if_due(std::time::Instant::now());
        }
    }
}

type WorkerRuntime = monoio::FusionRuntime<
    monoio::time::TimeDriver<monoio::IoUringDriver>,
    monoio::time::TimeDriver<monoio::LegacyDriver>,
>;

/// A worker's runtime: io_uring when the kernel has it (else epoll), 4,096 entries, timers on.
///
/// The ring is set up `COOP_TASKRUN | SINGLE_ISSUER` (Linux 6.0+): when a peer on another core
/// writes to one of our sockets, the kernel queues the completion without an IPI to interrupt
/// the worker; the worker picks it up at its next syscall, and it makes one for nearly every
/// step. Without the flag those IPIs were 13% of the worker's CPU in the latency rig (proxy on
/// its own core); with it the worker spends ~7% less CPU per request there (perf/RESULTS.md).
/// Only the worker thread that built the ring submits to it, as `SINGLE_ISSUER` requires. Older
/// kernels reject the flags and get a plain ring; `SLUICE_IO_URING_PLAIN=1` asks for the plain
/// ring anyway (for comparisons).
fn build_runtime() -> io::Result<WorkerRuntime> {
    let builder = || {
        monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .with_entries(4096)
    };
    if std::env::var_os("SLUICE_IO_URING_PLAIN").is_none() {
        let mut ring = io_uring::IoUring::builder();
        ring.setup_coop_taskrun().setup_single_issuer();
        if let Ok(runtime) = builder().uring_builder(ring).build() {
            return Ok(runtime);
        }
    }
    builder().build()
}

fn pin_to_core(core: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0) applies to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Tell the operator, once at start, when the open-file limit is below what the configured
/// connections need: each proxied request holds a client and an upstream socket, so a full
/// worker needs about twice `max_connections_per_worker` (plus listeners, Redis, log files).
/// Past the limit, accepts and connects fail with EMFILE (503s), which is hard to trace back.
fn warn_if_fd_limit_low(limit: Option<u64>, snapshot: &Snapshot) {
    let Some(limit) = limit else { return };
    let server = &snapshot.server;
    let per_worker = server.max_connections_per_worker as u64
        + (snapshot.upstream.max_connections_per_backend as u64)
            .min(server.max_connections_per_worker as u64);
    let needed = (server.workers as u64) * per_worker + crate::config::RESERVED_DESCRIPTORS;
    if limit < needed {
        let fits = crate::config::connections_fitting(limit, server.workers);
        eprintln!(
            "sluice: warning: the open-file limit ({limit}) is below the {needed} descriptors \
             that {} workers x {} client connections and their upstream connections can hold; \
             past it new connections fail. Fix: LimitNOFILE={needed} in the unit (or ulimit -n \
             {needed}), or server.max_connections_per_worker = {fits} (or leave it out: it then \
             fits the limit)",
            server.workers, server.max_connections_per_worker
        );
    }
}

/// The wait queue's families in every scrape from now on, from `health`'s board (none without
/// `[saturation]`).
fn set_queue_metrics(
    hub: &MetricsHub,
    snapshot: &Snapshot,
    health: &Arc<crate::upstream::health::HealthTable>,
) {
    let metrics = crate::gateway::queue::QueueMetrics::new(snapshot, health);
    hub.set_appendix(metrics.map(|m| Arc::new(m) as Arc<dyn crate::telemetry::metrics::Appendix>));
}
