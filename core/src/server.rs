//! Startup: listeners, worker threads and their runtimes.
//!
//! Runs on the main thread once. Takes a validated [`Snapshot`]; binds one SO_REUSEPORT
//! listener per worker (after checking that no other process holds the port — SO_REUSEPORT
//! would otherwise silently share it), starts one thread per worker pinned to a core, each with
//! its own monoio runtime (io_uring, or epoll when io_uring is unavailable or
//! `MONOIO_FORCE_LEGACY_DRIVER=1`), logs the address and the driver, and serves until the process
//! is stopped. Returns an error when the port is taken or a runtime cannot start.

use std::io;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::rc::Rc;
use std::sync::mpsc;

use socket2::{Domain, Protocol, Socket, Type};

use crate::config::Snapshot;
use crate::worker::Worker;

/// Which I/O driver a worker's runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    IoUring,
    Legacy,
}

impl Driver {
    pub fn name(self) -> &'static str {
        match self {
            Driver::IoUring => "io_uring",
            Driver::Legacy => "legacy",
        }
    }
}

/// Run the gateway until the process is stopped.
pub fn run(snapshot: Snapshot) -> io::Result<()> {
    raise_fd_limit();
    let addr = claim_port(snapshot.server.listen)?;
    let workers = snapshot.server.workers;
    let mut listeners = Vec::with_capacity(workers);
    for _ in 0..workers {
        listeners.push(reuseport_listener(addr)?);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (ready_tx, ready_rx) = mpsc::channel::<io::Result<Driver>>();
    let mut handles = Vec::with_capacity(workers);
    for (id, listener) in listeners.into_iter().enumerate() {
        let ready = ready_tx.clone();
        let pin = snapshot.server.pin_workers.then_some(id % cores);
        let own = snapshot.clone();
        let handle = std::thread::Builder::new()
            .name(format!("sluice-worker-{id}"))
            .spawn(move || worker_thread(id, pin, listener, own, ready))?;
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
        eprintln!("sluice: io_uring unavailable or disabled; running on the epoll (legacy) driver");
    }
    eprintln!(
        "sluice: listening on {addr} (workers={workers}, driver={})",
        driver.name()
    );
    for h in handles {
        let _ = h.join();
    }
    Ok(())
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

fn reuseport_listener(addr: SocketAddr) -> io::Result<StdListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nodelay(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

fn worker_thread(
    id: usize,
    pin: Option<usize>,
    listener: StdListener,
    snapshot: Snapshot,
    ready: mpsc::Sender<io::Result<Driver>>,
) {
    if let Some(core) = pin {
        pin_to_core(core);
    }
    let snapshot = Rc::new(snapshot);
    let builder = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .with_entries(4096);
    let runtime = match builder.build() {
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
    runtime.block_on(async move {
        let listener = match monoio::net::TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let worker = Rc::new(Worker::new(id, snapshot));
        let _ = ready.send(Ok(driver));
        accept_loop(worker, listener).await;
    });
}

async fn accept_loop(worker: Rc<Worker>, listener: monoio::net::TcpListener) {
    let max = worker.snapshot.server.max_connections_per_worker;
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                // EMFILE and friends: back off briefly instead of spinning.
                monoio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        if worker.connections.get() >= max {
            monoio::spawn(crate::conn::refuse_overloaded(Rc::clone(&worker), stream));
            continue;
        }
        worker.connections.set(worker.connections.get() + 1);
        let w = Rc::clone(&worker);
        monoio::spawn(async move {
            crate::conn::serve(Rc::clone(&w), stream).await;
            w.connections.set(w.connections.get() - 1);
        });
    }
}

fn pin_to_core(core: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0) applies to the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Each connection is a file descriptor: lift the soft limit to the hard one.
fn raise_fd_limit() {
    // SAFETY: plain getrlimit / setrlimit on a local struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}
