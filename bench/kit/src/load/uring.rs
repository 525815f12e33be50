//! The io_uring engine (the default): per thread, one ring and one event loop; every connection
//! a hand-written state machine in one slab (`Vec<Conn>`), so 10,000 streams cost 10,000 slab
//! entries, not 10,000 threads.
//!
//! - Ring: `SUBMIT_ALL | SINGLE_ISSUER | DEFER_TASKRUN` (completions are processed only when the
//!   loop asks, so no interrupting task work), falling back to `COOP_TASKRUN`, then to no
//!   task-work flag; and all of that again without `SUBMIT_ALL` if the kernel refuses it.
//! - Reads: one multishot receive per connection into a provided-buffer ring of 16 KiB
//!   buffers (the thread engine's read size, so "one read" means the same for coalescing); a
//!   buffer goes back to the ring as soon as its bytes are parsed. Writes: one `Send` per
//!   request from the bytes built once per (model, key).
//! - Open loop: intended times `t_k = t0 + k·10⁹/R` over all connections (thread `j` of `N`
//!   takes `k ≡ j mod N`). A due request goes to an idle connection from a free list, else
//!   waits in a FIFO keeping `t_k`, so queueing counts in its latency. One absolute io_uring
//!   timeout wakes the loop for the next `t_k`.
//! - One `submit_and_wait` per loop turn, however many requests the turn carries; the clock is
//!   read once after it, and that stamp times everything the turn reaps.
//! - Timeouts (`--timeout`, per connect, send and read as in the thread engine) are checked by
//!   a sweep over the slab a few times per timeout, not by a timer per operation. At the
//!   grace deadline (`--timeout` after the window) whatever is still queued or unanswered is
//!   counted as a timeout and the loop ends.
//!
//! Descriptors are plain (not registered): a connection that fails or is closed gets a fresh
//! socket, and its stale completions are told apart by a generation number in `user_data`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::mpsc;
use std::sync::Arc;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::bufring::{BufRing, BGID};
use crate::http::{Fail, Fed, Kind};
use crate::stats::Stats;
use crate::{http::Response, join_measured, mono_ns, Plan, Window};

pub(crate) enum Error {
    /// The ring (or its buffer ring) could not be set up: the thread engine can run instead.
    Setup(String),
    Run(String),
}

/// Runs the whole test on `--threads` rings. The connections are opened first; the schedule
/// starts 1 ms after the last thread is ready, so connecting is not part of any latency.
pub(crate) fn run(plan: &Arc<Plan>) -> Result<(Stats, u64), Error> {
    let n = plan.opts.threads;
    let (ready_tx, ready_rx) = mpsc::channel::<Ready>();
    let mut starts = Vec::new();
    let mut handles = Vec::new();
    for j in 0..n {
        let (win_tx, win_rx) = mpsc::channel::<Window>();
        starts.push(win_tx);
        let p = Arc::clone(plan);
        let ready = ready_tx.clone();
        let h = std::thread::Builder::new()
            .name(format!("load-uring-{j}"))
            .spawn(move || thread_main(&p, j, &ready, &win_rx))
            .map_err(|e| Error::Setup(format!("spawn thread: {e}")))?;
        handles.push(h);
    }
    drop(ready_tx);
    let mut failed = None;
    for _ in 0..n {
        match ready_rx.recv() {
            Ok(Ready::Ok) => {}
            Ok(Ready::SetupFailed(e)) => failed = failed.or(Some(Error::Setup(e))),
            Ok(Ready::Failed(e)) => failed = failed.or(Some(Error::Run(e))),
            Err(_) => failed = failed.or(Some(Error::Run("engine thread ended".into()))),
        }
    }
    if let Some(e) = failed {
        // Dropping the senders tells the waiting threads to end without running.
        drop(starts);
        for h in handles {
            let _ = h.join();
        }
        return Err(e);
    }
    let win = Window::starting(mono_ns() + 1_000_000, &plan.opts);
    for s in &starts {
        let _ = s.send(win);
    }
    join_measured(handles, win.measure_from).map_err(Error::Run)
}

enum Ready {
    Ok,
    SetupFailed(String),
    Failed(String),
}

fn thread_main(
    plan: &Plan,
    j: usize,
    ready: &mpsc::Sender<Ready>,
    start: &mpsc::Receiver<Window>,
) -> Result<Stats, String> {
    let mut e = match Engine::new(plan, j) {
        Ok(e) => e,
        Err(msg) => {
            let _ = ready.send(Ready::SetupFailed(msg));
            return Stats::new();
        }
    };
    if let Err(msg) = e.preconnect() {
        let _ = ready.send(Ready::Failed(msg));
        return Stats::new();
    }
    let _ = ready.send(Ready::Ok);
    match start.recv() {
        Ok(win) => e.run(win),
        Err(_) => Stats::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// user_data: conn index (32 bits) | generation (24 bits) | operation (8 bits)
// ---------------------------------------------------------------------------------------------

const OP_CONNECT: u64 = 1;
const OP_SEND: u64 = 2;
const OP_RECV: u64 = 3;
const OP_TIMER: u64 = 4;
const OP_CANCEL: u64 = 5;
/// The multishot receive probe in [`Engine::new`] (no connection).
const OP_PROBE: u64 = 6;
const GEN_MASK: u32 = 0xff_ffff;

fn ud(conn: u32, gen: u32, op: u64) -> u64 {
    (u64::from(conn) << 32) | (u64::from(gen & GEN_MASK) << 8) | op
}

/// Most buffers in a thread's ring (256 MiB), and the count tried when that many cannot be set
/// up. (The kernel takes up to 32,768.)
const BUF_MAX: usize = 16 * 1024;
const BUF_FALLBACK: u16 = 4096;

// ---------------------------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------------------------

/// A request on a connection.
#[derive(Clone, Copy)]
struct Job {
    /// Latency is measured from here: the intended time (open loop) or the dispatch (closed).
    start: u64,
    /// How long it waited in the FIFO for a free connection.
    queued: u64,
    seq: usize,
    record: bool,
    /// Request bytes submitted so far.
    sent: usize,
}

#[derive(Clone, Copy, PartialEq)]
enum Sock {
    None,
    Connecting,
    Open,
}

struct Conn {
    /// Global connection number (closed loop: its requests are `id`, `id + connections`, …).
    id: usize,
    fd: RawFd,
    gen: u32,
    sock: Sock,
    recv_armed: bool,
    send_inflight: bool,
    job: Option<Job>,
    /// When the current operation times out (0: nothing is waited for).
    deadline: u64,
    /// Closed loop: the next request number.
    next_seq: usize,
    /// After a connect error the connection rests until then (0: not resting).
    cool_until: u64,
    /// Closed loop: past the end of the window, it takes no more requests.
    stopped: bool,
    resp: Response,
}

/// A due request waiting for a free connection (open loop).
#[derive(Clone, Copy)]
struct Pending {
    intended: u64,
    /// The loop turn that found it due (and, if it queues, no connection free).
    released: u64,
    seq: usize,
}

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero bytes are a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for any sockaddr type.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in>(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in6>(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn errno_fail(what: &str, res: i32) -> Fail {
    let e = std::io::Error::from_raw_os_error(-res);
    let kind = match -res {
        libc::ETIMEDOUT | libc::EAGAIN => Kind::Timeout,
        _ => Kind::Io,
    };
    Fail(kind, format!("{what}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------------

/// Open-loop schedule of one thread: request numbers `k`, `k + step`, … while `t_k < end`.
struct Schedule {
    k: u64,
    step: u64,
    ns_per_req: f64,
}

impl Schedule {
    fn at(&self, t0: u64) -> u64 {
        // k·10⁹/R from k each time, not by adding up intervals: no drift over a long run.
        t0 + (self.k as f64 * self.ns_per_req) as u64
    }
}

/// How completions' task work runs, from the newest kernels' way to the oldest's.
#[derive(Clone, Copy)]
enum Taskrun {
    /// `SINGLE_ISSUER | DEFER_TASKRUN` (6.1): only when the loop asks for completions.
    Defer,
    /// `COOP_TASKRUN` (5.19): no interrupting the loop to run it.
    Coop,
    Plain,
}

/// A ring of `sq` entries (and 4 × as many completions) with the best flags the kernel takes:
/// `SUBMIT_ALL` (5.18: an SQE that fails prep does not stop the submission of the rest, see
/// `Engine::submit_and_reap`), then the task-work flags, each dropped in turn if refused.
fn new_ring(sq: u32) -> std::io::Result<IoUring> {
    let mut last = None;
    for submit_all in [true, false] {
        for taskrun in [Taskrun::Defer, Taskrun::Coop, Taskrun::Plain] {
            let mut b = IoUring::builder();
            b.setup_cqsize(sq * 4);
            if submit_all {
                b.setup_submit_all();
            }
            match taskrun {
                Taskrun::Defer => {
                    b.setup_single_issuer().setup_defer_taskrun();
                }
                Taskrun::Coop => {
                    b.setup_coop_taskrun();
                }
                Taskrun::Plain => {}
            }
            match b.build(sq) {
                Ok(ring) => return Ok(ring),
                Err(e) => last = Some(e),
            }
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no ring flags to try")))
}

struct Engine<'a> {
    // Dropped first: the kernel must be done with the buffer memory before it is unmapped.
    ring: IoUring,
    bufs: BufRing,
    plan: &'a Plan,
    conns: Vec<Conn>,
    /// Open loop: connections without a request, ready to take one (connected or not).
    free: Vec<u32>,
    queue: VecDeque<Pending>,
    /// Connections resting after a connect error.
    cooling: Vec<u32>,
    sched: Option<Schedule>,
    win: Window,
    addr: (libc::sockaddr_storage, libc::socklen_t),
    timeout_ns: u64,
    sweep_ns: u64,
    next_sweep: u64,
    /// The armed timer: its time and sequence number (only the latest one counts).
    timer: types::Timespec,
    timer_at: Option<u64>,
    timer_seq: u64,
    /// Measured requests whose first bytes were queued for submission this turn:
    /// (intended time, time spent in the FIFO).
    to_stamp: Vec<(u64, u64)>,
    /// Sockets shut down, closed once a submit has left the submission queue empty: their
    /// numbers must not be reused by a new socket while an SQE naming them is unsubmitted.
    to_close: Vec<RawFd>,
    cqes: Vec<(u64, i32, u32)>,
    in_flight: u64,
    /// Closed loop: connections not yet stopped.
    active: usize,
    st: Stats,
    reported: bool,
}

impl<'a> Engine<'a> {
    fn new(plan: &'a Plan, j: usize) -> Result<Engine<'a>, String> {
        let o = &plan.opts;
        let st = Stats::new()?;
        let ids: Vec<usize> = (j..o.connections).step_by(o.threads).collect();
        let n = ids.len().max(1);
        let sq = n.next_power_of_two().clamp(256, 4096) as u32;
        let ring = new_ring(sq).map_err(|e| format!("io_uring setup: {e}"))?;
        // At least one 16 KiB buffer per connection (a power of two, 64 to 16,384: up to
        // 256 MiB, touched only as the kernel fills them): a stream's reads are parsed and
        // handed back within the turn that reaped them, so even a turn in which every
        // connection got bytes has buffers enough. Past 16,384 connections per thread, or
        // where that much memory cannot be mapped (then 4,096), the kernel can run out: a
        // receive ends with ENOBUFS, is armed again, and is counted (`recv_enobufs`).
        let want = n.next_power_of_two().clamp(64, BUF_MAX) as u16;
        let bufs = match BufRing::new(&ring, want) {
            Err(_) if want > BUF_FALLBACK => BufRing::new(&ring, BUF_FALLBACK)?,
            r => r?,
        };
        let conns = ids
            .iter()
            .map(|&id| Conn {
                id,
                fd: -1,
                gen: 0,
                sock: Sock::None,
                recv_armed: false,
                send_inflight: false,
                job: None,
                deadline: 0,
                next_seq: id,
                cool_until: 0,
                stopped: false,
                resp: Response::default(),
            })
            .collect::<Vec<_>>();
        let timeout_ns = u64::try_from(o.timeout.as_nanos()).unwrap_or(u64::MAX);
        let mut e = Engine {
            ring,
            bufs,
            plan,
            free: Vec::with_capacity(conns.len()),
            queue: VecDeque::with_capacity(1024),
            cooling: Vec::new(),
            sched: o.rate.map(|r| Schedule {
                k: j as u64,
                step: o.threads as u64,
                ns_per_req: 1e9 / r,
            }),
            win: Window {
                t0: 0,
                measure_from: 0,
                end: 0,
                grace: 0,
            },
            addr: sockaddr(o.addr),
            timeout_ns,
            // A timeout is noticed within a tenth of it (at most 100 ms late).
            sweep_ns: (timeout_ns / 10).clamp(1_000_000, 100_000_000),
            next_sweep: 0,
            timer: types::Timespec::new(),
            timer_at: None,
            timer_seq: 0,
            to_stamp: Vec::with_capacity(1024),
            to_close: Vec::new(),
            cqes: Vec::with_capacity(4096),
            in_flight: 0,
            active: conns.len(),
            conns,
            st,
            reported: false,
        };
        // On an error the engine is dropped whole: the ring before the buffers it writes into.
        e.probe_recv_multi()?;
        Ok(e)
    }

    /// The loop reads with multishot receives (6.0), but a kernel can have buffer rings (5.19)
    /// without them: one such receive on a socketpair tells, before any connection is made,
    /// and a kernel that fails it gets the thread engine instead (a setup error).
    fn probe_recv_multi(&mut self) -> Result<(), String> {
        let mut sv: [libc::c_int; 2] = [-1, -1];
        // SAFETY: `sv` is room for the two descriptors socketpair writes.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                sv.as_mut_ptr(),
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!("socketpair: {e}"));
        }
        let res = self.probe_on(sv[0], sv[1]);
        for fd in sv {
            // SAFETY: the socketpair is ours. After a good probe no operation names it; after
            // a failed one the engine (and its ring, with whatever it had not submitted) is
            // dropped without submitting again.
            unsafe { libc::close(fd) };
        }
        res.map_err(|e| format!("multishot receive: {e}"))
    }

    /// Receives one byte written to `b` with a multishot receive on `a`, then ends it with a
    /// shutdown (end of stream); waits at most a second for each completion.
    fn probe_on(&mut self, a: RawFd, b: RawFd) -> Result<(), String> {
        let byte = [b'p'];
        // SAFETY: writes one byte from a valid buffer to our own socket.
        if unsafe { libc::write(b, byte.as_ptr().cast(), 1) } != 1 {
            let e = std::io::Error::last_os_error();
            return Err(format!("socketpair write: {e}"));
        }
        let e = opcode::RecvMulti::new(types::Fd(a), BGID)
            .build()
            .user_data(OP_PROBE);
        self.push(&e)?;
        let limit = types::Timespec::new().sec(1);
        let args = types::SubmitArgs::new().timespec(&limit);
        let mut got = false;
        loop {
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {
                    return Err("no completion within 1 s".into());
                }
                Err(e) => return Err(format!("io_uring submit: {e}")),
            }
            let cqes: Vec<(u64, i32, u32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags()))
                .collect();
            for (u, res, flags) in cqes {
                if u != OP_PROBE {
                    continue;
                }
                if let Some(bid) = cqueue::buffer_select(flags) {
                    self.bufs.give_back(bid);
                }
                if res > 0 && !got {
                    got = true;
                    if cqueue::more(flags) {
                        // SAFETY: `a` is our socket; the receive on it ends (end of stream).
                        unsafe { libc::shutdown(a, libc::SHUT_RDWR) };
                    }
                }
                if !cqueue::more(flags) {
                    // The receive is over: after the byte (and the shutdown), or with the
                    // error of a kernel that has no multishot receive.
                    self.bufs.publish();
                    return match (got, res) {
                        (true, _) => Ok(()),
                        (false, 0) => Err("end of stream before the byte".into()),
                        (false, r) => Err(std::io::Error::from_raw_os_error(-r).to_string()),
                    };
                }
            }
            self.bufs.publish();
        }
    }

    // -- submission ------------------------------------------------------------------------

    /// Queues one SQE, submitting what is queued first if the queue is full.
    fn push(&mut self, e: &squeue::Entry) -> Result<(), String> {
        loop {
            // SAFETY: every SQE built here points only at memory that outlives its operation:
            // request bytes in the plan, the engine's socket address and timer (copied by the
            // kernel when submitted, before either changes), and the buffer ring's memory.
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                return Ok(());
            }
            self.ring
                .submit()
                .map_err(|e| format!("io_uring submit: {e}"))?;
        }
    }

    fn arm_recv(&mut self, i: u32) -> Result<(), String> {
        let c = &mut self.conns[i as usize];
        c.recv_armed = true;
        let e = opcode::RecvMulti::new(types::Fd(c.fd), BGID)
            .build()
            .user_data(ud(i, c.gen, OP_RECV));
        self.push(&e)
    }

    fn push_send(&mut self, i: u32) -> Result<(), String> {
        let c = &mut self.conns[i as usize];
        let Some(job) = c.job else {
            return Ok(());
        };
        let req = self.plan.request(job.seq);
        let rest = &req[job.sent.min(req.len())..];
        if job.sent == 0 && job.record {
            self.to_stamp.push((job.start, job.queued));
        }
        c.send_inflight = true;
        let e = opcode::Send::new(types::Fd(c.fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(ud(i, c.gen, OP_SEND));
        self.push(&e)
    }

    /// Opens a socket for connection `i` and queues its connect.
    fn connect(&mut self, i: u32, now: u64) -> Result<(), Fail> {
        let family = match self.plan.opts.addr {
            SocketAddr::V4(_) => libc::AF_INET,
            SocketAddr::V6(_) => libc::AF_INET6,
        };
        // SAFETY: plain socket(2) call.
        let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Fail(Kind::Connect, format!("socket: {e}")));
        }
        let one: libc::c_int = 1;
        // SAFETY: `one` is a valid c_int for the length given. A failure only costs Nagle.
        unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                (&raw const one).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let c = &mut self.conns[i as usize];
        c.fd = fd;
        c.sock = Sock::Connecting;
        c.deadline = now.saturating_add(self.timeout_ns);
        let e = opcode::Connect::new(types::Fd(fd), (&raw const self.addr.0).cast(), self.addr.1)
            .build()
            .user_data(ud(i, c.gen, OP_CONNECT));
        self.push(&e).map_err(|m| Fail(Kind::Connect, m))
    }

    /// Ends connection `i`'s socket (not its request): its pending operations complete with
    /// errors or end of stream, seen as stale by the generation bump.
    fn close(&mut self, i: u32) -> Result<(), String> {
        let c = &mut self.conns[i as usize];
        let (fd, gen, connecting) = (c.fd, c.gen, c.sock == Sock::Connecting);
        c.gen = c.gen.wrapping_add(1) & GEN_MASK;
        c.fd = -1;
        c.sock = Sock::None;
        c.recv_armed = false;
        c.send_inflight = false;
        c.deadline = 0;
        if fd >= 0 {
            // SAFETY: `fd` is this connection's socket; shutdown ends a pending receive (end of
            // stream) or send (error) at once, so their operations let go of the socket.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            self.to_close.push(fd);
            if connecting {
                let e = opcode::AsyncCancel::new(ud(i, gen, OP_CONNECT))
                    .build()
                    .user_data(OP_CANCEL);
                self.push(&e)?;
            }
        }
        Ok(())
    }

    // -- requests --------------------------------------------------------------------------

    /// Gives connection `i` a request: sends it now if connected, else connects first.
    fn dispatch(&mut self, i: u32, job: Job, now: u64) -> Result<(), String> {
        let stream = self.plan.opts.stream;
        let c = &mut self.conns[i as usize];
        c.job = Some(job);
        c.resp.begin(stream);
        self.in_flight += 1;
        if now >= self.win.measure_from {
            self.st.max_in_flight = self.st.max_in_flight.max(self.in_flight);
        }
        match c.sock {
            Sock::Open => {
                c.deadline = now.saturating_add(self.timeout_ns);
                self.push_send(i)
            }
            Sock::Connecting => Ok(()),
            Sock::None => match self.connect(i, now) {
                Ok(()) => Ok(()),
                Err(f) => self.fail(i, f, now),
            },
        }
    }

    /// The request on connection `i` got its whole response.
    fn finish(&mut self, i: u32, now: u64) -> Result<(), String> {
        let c = &mut self.conns[i as usize];
        let Some(job) = c.job.take() else {
            return Ok(());
        };
        self.in_flight -= 1;
        c.deadline = 0;
        if job.record {
            self.st.response(&c.resp, now.saturating_sub(job.start));
        }
        if !c.resp.keep_alive || c.send_inflight {
            self.close(i)?;
        }
        self.next(i, now)
    }

    /// The request on connection `i` failed; the connection starts over with a fresh socket.
    fn fail(&mut self, i: u32, Fail(kind, msg): Fail, now: u64) -> Result<(), String> {
        self.close(i)?;
        let c = &mut self.conns[i as usize];
        let Some(job) = c.job.take() else {
            return Ok(());
        };
        self.in_flight -= 1;
        if job.record {
            self.st.errors[kind as usize] += 1;
        }
        if !self.reported {
            eprintln!(
                "sluice-load: connection {}: {msg} (further errors only counted)",
                c.id
            );
            self.reported = true;
        }
        if matches!(kind, Kind::Connect) {
            // Don't spin on a refused port.
            c.cool_until = now + 10_000_000;
            self.cooling.push(i);
            return Ok(());
        }
        self.next(i, now)
    }

    /// Connection `i` is free: closed loop, it sends its next request (until the window
    /// ends); open loop, it joins the free list.
    fn next(&mut self, i: u32, now: u64) -> Result<(), String> {
        if self.sched.is_some() {
            self.free.push(i);
            return Ok(());
        }
        let c = &mut self.conns[i as usize];
        if now >= self.win.end {
            if !c.stopped {
                c.stopped = true;
                self.active -= 1;
            }
            return Ok(());
        }
        let seq = c.next_seq;
        c.next_seq += self.plan.opts.connections;
        let job = Job {
            start: now,
            queued: 0,
            seq,
            record: now >= self.win.measure_from,
            sent: 0,
        };
        self.dispatch(i, job, now)
    }

    /// Open loop: moves every request due by `now` into the FIFO, then hands queued requests
    /// to free connections, oldest first.
    fn release(&mut self, now: u64) -> Result<(), String> {
        let t0 = self.win.t0;
        if let Some(s) = &mut self.sched {
            loop {
                let t = s.at(t0);
                if t >= self.win.end || t > now {
                    break;
                }
                self.queue.push_back(Pending {
                    intended: t,
                    released: now,
                    seq: s.k as usize,
                });
                s.k += s.step;
            }
        }
        while !self.queue.is_empty() {
            let Some(i) = self.free.pop() else {
                break;
            };
            let Some(p) = self.queue.pop_front() else {
                break;
            };
            let job = Job {
                start: p.intended,
                queued: now - p.released,
                seq: p.seq,
                record: p.intended >= self.win.measure_from,
                sent: 0,
            };
            self.dispatch(i, job, now)?;
        }
        Ok(())
    }

    /// The grace deadline (`--timeout` after the window) has passed: every measured request
    /// still scheduled, queued or on a connection is counted as a timeout, and nothing more
    /// is sent.
    fn abandon(&mut self) -> Result<(), String> {
        let Window {
            t0,
            measure_from,
            end,
            ..
        } = self.win;
        if let Some(s) = &mut self.sched {
            // Released only once due, and all are due by now: normally none is left here.
            loop {
                let t = s.at(t0);
                if t >= end {
                    break;
                }
                if t >= measure_from {
                    self.st.abandon();
                }
                s.k += s.step;
            }
        }
        for p in std::mem::take(&mut self.queue) {
            if p.intended >= measure_from {
                self.st.abandon();
            }
        }
        for i in 0..self.conns.len() as u32 {
            let c = &mut self.conns[i as usize];
            if !c.stopped {
                c.stopped = true;
                self.active -= 1;
            }
            let Some(job) = c.job.take() else {
                continue;
            };
            self.in_flight -= 1;
            if job.record {
                self.st.abandon();
            }
            self.close(i)?;
        }
        Ok(())
    }

    /// Ends the rest of connections whose connect error rest is over.
    fn wake_cooled(&mut self, now: u64) -> Result<(), String> {
        let mut k = 0;
        while k < self.cooling.len() {
            let i = self.cooling[k];
            if self.conns[i as usize].cool_until <= now {
                self.cooling.swap_remove(k);
                self.conns[i as usize].cool_until = 0;
                self.next(i, now)?;
            } else {
                k += 1;
            }
        }
        Ok(())
    }

    /// Fails the operations that have waited longer than `--timeout`.
    fn sweep(&mut self, now: u64) -> Result<(), String> {
        for i in 0..self.conns.len() as u32 {
            let c = &self.conns[i as usize];
            if c.deadline == 0 || c.deadline > now {
                continue;
            }
            if c.job.is_some() {
                let what = if c.sock == Sock::Connecting {
                    "connect timed out"
                } else {
                    "timed out"
                };
                self.fail(i, Fail(Kind::Timeout, what.into()), now)?;
            } else {
                // A connect made ahead of any request: the first request will try again.
                self.close(i)?;
                self.free_if_open_loop(i);
            }
        }
        Ok(())
    }

    fn free_if_open_loop(&mut self, i: u32) {
        if self.sched.is_some() && !self.free.contains(&i) {
            self.free.push(i);
        }
    }

    // -- completions -----------------------------------------------------------------------

    fn on_connect(&mut self, i: u32, res: i32, now: u64) -> Result<(), String> {
        if res < 0 {
            let e = std::io::Error::from_raw_os_error(-res);
            let kind = if res == -libc::ETIMEDOUT {
                Kind::Timeout
            } else {
                Kind::Connect
            };
            let msg = format!("connect {}: {e}", self.plan.opts.addr);
            if self.conns[i as usize].job.is_some() {
                return self.fail(i, Fail(kind, msg), now);
            }
            self.close(i)?;
            return Ok(());
        }
        let c = &mut self.conns[i as usize];
        c.sock = Sock::Open;
        c.deadline = 0;
        self.arm_recv(i)?;
        if self.conns[i as usize].job.is_some() {
            self.conns[i as usize].deadline = now.saturating_add(self.timeout_ns);
            self.push_send(i)?;
        }
        Ok(())
    }

    fn on_send(&mut self, i: u32, res: i32, now: u64) -> Result<(), String> {
        let c = &mut self.conns[i as usize];
        c.send_inflight = false;
        let Some(job) = c.job.as_mut() else {
            return Ok(());
        };
        if res <= 0 {
            let f = if res == 0 {
                Fail(Kind::Io, "send: nothing written".into())
            } else {
                errno_fail("send", res)
            };
            return self.fail(i, f, now);
        }
        job.sent += res as usize;
        c.deadline = now.saturating_add(self.timeout_ns);
        if job.sent < self.plan.request(job.seq).len() {
            self.push_send(i)?;
        }
        Ok(())
    }

    fn on_recv(&mut self, i: u32, res: i32, flags: u32, now: u64) -> Result<(), String> {
        let more = cqueue::more(flags);
        if !more {
            self.conns[i as usize].recv_armed = false;
        }
        if res == -libc::ENOBUFS {
            // The buffer ring ran dry: the data waits in the socket; receive again once the
            // buffers reaped this turn are back. Counted: it costs a turn's latency.
            self.st.recv_enobufs += 1;
            if !more {
                self.arm_recv(i)?;
            }
            return Ok(());
        }
        if res < 0 {
            return match self.conns[i as usize].job {
                Some(_) => self.fail(i, errno_fail("recv", res), now),
                None => {
                    self.close(i)?;
                    Ok(())
                }
            };
        }
        if res == 0 {
            return match self.conns[i as usize].job {
                Some(_) => {
                    let f = self.conns[i as usize].resp.eof_fail();
                    self.fail(i, f, now)
                }
                // An idle connection the server closed (keep-alive timeout): reconnect when
                // it is next needed.
                None => self.close(i),
            };
        }
        let Some(bid) = cqueue::buffer_select(flags) else {
            return self.fail(i, Fail(Kind::Io, "recv: no buffer".into()), now);
        };
        let c = &mut self.conns[i as usize];
        let fed = match c.job {
            Some(job) => {
                c.deadline = now.saturating_add(self.timeout_ns);
                let data = self.bufs.get(bid, res as usize);
                Some(c.resp.feed(data, now, job.start))
            }
            None => None,
        };
        self.bufs.give_back(bid);
        match fed {
            Some(Ok(Fed::More)) => {}
            Some(Ok(Fed::Done)) => self.finish(i, now)?,
            Some(Err(f)) => return self.fail(i, f, now),
            // Bytes nobody asked for, on an idle connection: it cannot be trusted any more.
            None => return self.close(i),
        }
        let c = &self.conns[i as usize];
        if c.sock == Sock::Open && !c.recv_armed {
            self.arm_recv(i)?;
        }
        Ok(())
    }

    fn on_cqe(&mut self, user_data: u64, res: i32, flags: u32, now: u64) -> Result<(), String> {
        let op = user_data & 0xff;
        if op == OP_TIMER {
            if user_data >> 8 == self.timer_seq {
                self.timer_at = None;
            }
            return Ok(());
        }
        if op == OP_CANCEL || op == OP_PROBE {
            // (A probe's completions are all reaped in `probe_recv_multi`; in case one were
            // not, its buffer goes back.)
            if let Some(bid) = cqueue::buffer_select(flags) {
                self.bufs.give_back(bid);
            }
            return Ok(());
        }
        let i = (user_data >> 32) as u32;
        let gen = ((user_data >> 8) as u32) & GEN_MASK;
        let stale = self.conns.get(i as usize).is_none_or(|c| c.gen != gen);
        if stale {
            // An operation of a socket since closed: only its buffer matters.
            if let Some(bid) = cqueue::buffer_select(flags) {
                self.bufs.give_back(bid);
            }
            return Ok(());
        }
        match op {
            OP_CONNECT => self.on_connect(i, res, now),
            OP_SEND => self.on_send(i, res, now),
            OP_RECV => self.on_recv(i, res, flags, now),
            _ => Ok(()),
        }
    }

    // -- the loop --------------------------------------------------------------------------

    /// Arms the timer for `at` unless one already fires earlier.
    fn arm_timer(&mut self, at: u64) -> Result<(), String> {
        if self.timer_at.is_some_and(|t| t <= at) {
            return Ok(());
        }
        self.timer_seq += 1;
        self.timer_at = Some(at);
        self.timer = types::Timespec::new()
            .sec(at / 1_000_000_000)
            .nsec((at % 1_000_000_000) as u32);
        let e = opcode::Timeout::new(&raw const self.timer)
            .flags(types::TimeoutFlags::ABS)
            .build()
            .user_data((self.timer_seq << 8) | OP_TIMER);
        self.push(&e)
    }

    /// Submits what the turn queued and waits for at least one completion; returns the clock
    /// read after the wait, the one stamp for everything reaped in this turn.
    fn submit_and_reap(&mut self) -> Result<u64, String> {
        let submit_at = mono_ns();
        for &(intended, queued) in &self.to_stamp {
            self.st.sent(queued, submit_at.saturating_sub(intended));
        }
        self.to_stamp.clear();
        match self.ring.submit_and_wait(1) {
            Ok(_) => {}
            // Interrupted, or completions to reap first: nothing lost, reap and go on.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                ) => {}
            Err(e) => return Err(format!("io_uring submit: {e}")),
        }
        // A submit may leave SQEs behind: all of them after EAGAIN/EBUSY/EINTR, and without
        // SUBMIT_ALL (kernels before 5.18) those after one that failed prep. They may name a
        // socket in `to_close`, so its number stays taken until a turn submits everything.
        if self.ring.submission().is_empty() {
            for fd in self.to_close.drain(..) {
                // SAFETY: `fd` was this engine's socket, shut down and no longer named by any
                // connection; every SQE naming it has been submitted (the queue is empty).
                unsafe { libc::close(fd) };
            }
        }
        let now = mono_ns();
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        cqes.extend(
            self.ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags())),
        );
        for &(u, r, f) in &cqes {
            if let Err(e) = self.on_cqe(u, r, f, now) {
                self.cqes = cqes;
                return Err(e);
            }
        }
        self.cqes = cqes;
        self.bufs.publish();
        Ok(now)
    }

    /// Opens every connection before the schedule starts (batched connects, not staggered),
    /// so that connecting is not in the first requests' latency. A connect that fails here
    /// is tried again, and counted, by the first request on it.
    fn preconnect(&mut self) -> Result<(), String> {
        let now = mono_ns();
        for i in 0..self.conns.len() as u32 {
            if let Err(Fail(_, msg)) = self.connect(i, now) {
                if !self.reported {
                    eprintln!("sluice-load: {msg}");
                    self.reported = true;
                }
                self.close(i)?;
            }
        }
        self.reported = false;
        let mut now = now;
        while self.conns.iter().any(|c| c.sock == Sock::Connecting) {
            if now >= self.next_sweep {
                self.sweep(now)?;
                self.next_sweep = now + self.sweep_ns;
            }
            self.arm_timer(self.next_sweep)?;
            now = self.submit_and_reap()?;
        }
        self.free.clear();
        Ok(())
    }

    fn run(&mut self, win: Window) -> Result<Stats, String> {
        self.win = win;
        if self.sched.is_some() {
            // The free list is a stack: the first connection is taken first.
            self.free.extend((0..self.conns.len() as u32).rev());
        } else {
            crate::sleep_until(win.t0);
            let now = mono_ns();
            for i in 0..self.conns.len() as u32 {
                self.next(i, now)?;
            }
        }
        loop {
            // One clock read per turn for the schedule (how late a due request is released
            // shows in its send_lag); the completions are timed by the stamp after the wait.
            let now = mono_ns();
            if now >= self.win.grace {
                self.abandon()?;
                break;
            }
            // Connections come back first (rested after a connect error, or freed by a
            // timeout), so that the requests released next can have them in this very turn.
            self.wake_cooled(now)?;
            if now >= self.next_sweep {
                self.sweep(now)?;
                self.next_sweep = now + self.sweep_ns;
            }
            self.release(now)?;
            let sched_next = match &self.sched {
                Some(s) => Some(s.at(self.win.t0)).filter(|&t| t < self.win.end),
                None => None,
            };
            let done = match &self.sched {
                Some(_) => sched_next.is_none() && self.queue.is_empty() && self.in_flight == 0,
                None => self.active == 0,
            };
            if done {
                break;
            }
            let mut wake = self.next_sweep.min(self.win.grace);
            if !self.queue.is_empty() && !self.free.is_empty() {
                // Work and a connection for it (not expected after `release`, which stops
                // only when one of them runs out): don't sleep on it.
                wake = now;
            }
            if let Some(t) = sched_next {
                wake = wake.min(t);
            }
            for &i in &self.cooling {
                wake = wake.min(self.conns[i as usize].cool_until);
            }
            self.arm_timer(wake)?;
            self.submit_and_reap()?;
        }
        // Shut every socket down; the descriptors are released when the engine is dropped.
        for i in 0..self.conns.len() as u32 {
            self.close(i)?;
        }
        let st = std::mem::replace(&mut self.st, Stats::new()?);
        Ok(st)
    }
}

impl Drop for Engine<'_> {
    /// Releases every descriptor still held: sockets shut down but not yet released, and those
    /// of connections still open (an engine that never ran: another thread's setup failed
    /// after this one had connected, and the run goes to the thread engine).
    fn drop(&mut self) {
        let open = self
            .conns
            .iter_mut()
            .map(|c| std::mem::replace(&mut c.fd, -1));
        for fd in open.chain(self.to_close.drain(..)).filter(|&fd| fd >= 0) {
            // SAFETY: `fd` is this engine's socket and nothing else's. The ring is dropped
            // right after this (a field), so no SQE still naming it is ever submitted; the
            // operations already in the kernel hold their own reference to the socket.
            unsafe { libc::close(fd) };
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{Engine as EngineKind, Opts};
    use std::time::Duration;

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    /// An engine that connected but never ran (another thread's setup failed, so the run
    /// falls back to threads) gives its sockets back when dropped.
    #[test]
    fn dropped_engine_closes_its_sockets() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let opts = Opts {
            host: addr.to_string(),
            addr,
            path: "/".into(),
            connections: 16,
            duration: Duration::from_secs(1),
            warmup: Duration::ZERO,
            rate: None,
            stream: false,
            body_bytes: 0,
            models: vec!["m".into()],
            keys: Vec::new(),
            headers: Vec::new(),
            timeout: Duration::from_secs(5),
            json: None,
            engine: EngineKind::Uring,
            threads: 1,
        };
        let requests = crate::build_requests(&opts);
        let plan = Plan { opts, requests };
        let before = open_fds();
        let mut e = match Engine::new(&plan, 0) {
            Ok(e) => e,
            // No io_uring here (the run would use the thread engine): nothing to check.
            Err(msg) => return eprintln!("skipped: {msg}"),
        };
        e.preconnect().unwrap();
        assert!(
            e.conns.iter().all(|c| c.sock == Sock::Open),
            "not all connected"
        );
        // 16 sockets and the ring (its buffer ring is memory, not a descriptor).
        assert!(open_fds() >= before + 17, "{} -> {}", before, open_fds());
        drop(e);
        assert!(open_fds() <= before, "{} -> {}", before, open_fds());
    }
}
