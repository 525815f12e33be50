//! `sluice-probe uring`: what io_uring's receive and send variants cost on this kernel, so that
//! adopting one in Sluice's worker (monoio issues none of them) rests on a measurement.
//!
//! One server thread, pinned to `--server-cpu`, answers `--conns` loopback TCP connections from
//! one client thread pinned to `--client-cpu`: each connection sends `--size` bytes and waits
//! for a reply of the same size, closed loop — a proxy's client side, less the parsing. The
//! figure is the server thread's own CPU time (`CLOCK_THREAD_CPUTIME_ID`; user and system from
//! `getrusage(RUSAGE_THREAD)`) per message answered in the measured window. Its system time
//! holds the kernel's TCP work for its sends and the completion of its receives; the client's
//! sends are processed on the client's core.
//!
//! Variants (`--variants`, comma-separated; each round runs them all, in turn):
//!
//! - `single`: what Sluice's monoio worker does. One `Recv` into the connection's buffer each
//!   time the server wants bytes — issued before they arrive, so the kernel arms its internal
//!   poll for every read — and one `Send` per reply; ring flags `COOP_TASKRUN | SINGLE_ISSUER`.
//! - `multi`: one multishot `RecvMulti` per connection into a provided-buffer ring, armed once
//!   and again only when the kernel ends it.
//! - `single-fixed`, `multi-fixed`: the same with the sockets registered
//!   (`IORING_REGISTER_FILES`), so no file-table lookup per operation.
//! - `defer`: `single` on a ring with `DEFER_TASKRUN` instead of `COOP_TASKRUN`.
//! - `zc`: `single` with `SEND_ZC` replies (the reply buffer never changes, so the loop does
//!   not wait for the notification before the next receive).
//! - `poll`: what Sluice's worker does on a client connection between requests — a readiness
//!   poll (`POLL_ADD`, holding no buffer while the connection is idle), then the bytes read with
//!   a direct non-blocking `recv` syscall — with `SEND` replies.
//! - `select`: one `RECV` per read, as `single`, but with its buffer picked by the kernel from
//!   the provided-buffer ring when the bytes arrive (`IOSQE_BUFFER_SELECT`): no buffer held
//!   while idle, as `poll`, and no extra syscall.
//!
//! One submit-and-wait per loop turn in every variant, as monoio does.

use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::Instant;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::bufring::{BufRing, BGID, BUF_SIZE};
use crate::nofile::raise_nofile;
use crate::{arg, num};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Single,
    Multi,
    SingleFixed,
    MultiFixed,
    Defer,
    Zc,
    Poll,
    Select,
}

const VARIANTS: [(Variant, &str); 8] = [
    (Variant::Single, "single"),
    (Variant::Multi, "multi"),
    (Variant::SingleFixed, "single-fixed"),
    (Variant::MultiFixed, "multi-fixed"),
    (Variant::Defer, "defer"),
    (Variant::Zc, "zc"),
    (Variant::Poll, "poll"),
    (Variant::Select, "select"),
];

impl Variant {
    fn parse(s: &str) -> Option<Variant> {
        VARIANTS.iter().find(|(_, n)| *n == s).map(|(v, _)| *v)
    }

    fn name(self) -> &'static str {
        VARIANTS
            .iter()
            .find(|(v, _)| *v == self)
            .map_or("?", |(_, n)| n)
    }

    fn multishot(self) -> bool {
        matches!(self, Variant::Multi | Variant::MultiFixed)
    }

    /// Receives take their buffer from the provided-buffer ring.
    fn provided(self) -> bool {
        self.multishot() || self == Variant::Select
    }

    fn fixed(self) -> bool {
        matches!(self, Variant::SingleFixed | Variant::MultiFixed)
    }
}

struct Opts {
    size: usize,
    conns: usize,
    warm: u64,
    msgs: u64,
    server_cpu: usize,
    client_cpu: usize,
}

/// One measured run: the server thread's CPU and the wall time over `msgs` answers.
#[derive(Clone, Copy)]
struct Sample {
    cpu_ns: u64,
    user_ns: u64,
    sys_ns: u64,
    wall_ns: u64,
    msgs: u64,
    /// Receive completions that left a multishot receive armed, and zero-copy notifications:
    /// evidence that the variant ran as named (0 where it does not use them).
    multishot_completions: u64,
    zc_notifications: u64,
    /// Direct `recv` calls (`poll`) and receives into a provided buffer (`multi*`, `select`).
    direct_recvs: u64,
    provided_buffers: u64,
}

impl Sample {
    fn per_msg(&self, ns: u64) -> f64 {
        ns as f64 / self.msgs.max(1) as f64
    }
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let allowed = allowed_cpus();
    let o = Opts {
        size: num(args, "--size", 1024) as usize,
        conns: num(args, "--conns", 32) as usize,
        warm: num(args, "--warm", 20_000),
        msgs: num(args, "--msgs", 200_000),
        server_cpu: num(
            args,
            "--server-cpu",
            allowed.first().copied().unwrap_or(0) as u64,
        ) as usize,
        client_cpu: num(
            args,
            "--client-cpu",
            allowed.get(1).or(allowed.first()).copied().unwrap_or(0) as u64,
        ) as usize,
    };
    // Each connection is two descriptors: its client's end and its server's.
    if let Some(limit) = raise_nofile(o.conns * 2 + 64) {
        eprintln!(
            "sluice-probe: note: the open-file limit ({limit}) is too low for {} connections",
            o.conns
        );
    }
    let rounds = num(args, "--rounds", 5) as usize;
    let variants = arg(
        args,
        "--variants",
        "single,multi,single-fixed,multi-fixed,defer,zc",
    )
    .split(',')
    .map(|s| Variant::parse(s.trim()).ok_or_else(|| format!("unknown variant {s:?}")))
    .collect::<Result<Vec<_>, _>>()?;
    if o.size == 0 || o.conns == 0 || o.msgs == 0 || rounds == 0 || variants.is_empty() {
        return Err("--size, --conns, --msgs, --rounds and --variants must be non-zero".into());
    }
    println!(
        "# uring probe: {} B messages, {} connections, {} measured answers after {} warm-up; \
         server on CPU {}, client on CPU {}",
        o.size, o.conns, o.msgs, o.warm, o.server_cpu, o.client_cpu
    );
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); variants.len()];
    for round in 1..=rounds {
        for (k, v) in variants.iter().enumerate() {
            let s = run_once(*v, &o)?;
            println!(
                "round {round} {:<12} {:>7.0} ns/msg (user {:>5.0}, sys {:>6.0}), {:>8.0} msg/s, \
                 {} multishot completions, {} zero-copy notifications, {} direct receives, \
                 {} provided buffers",
                v.name(),
                s.per_msg(s.cpu_ns),
                s.per_msg(s.user_ns),
                s.per_msg(s.sys_ns),
                s.msgs as f64 * 1e9 / s.wall_ns.max(1) as f64,
                s.multishot_completions,
                s.zc_notifications,
                s.direct_recvs,
                s.provided_buffers
            );
            samples[k].push(s);
        }
    }
    println!();
    println!(
        "| variant | server CPU ns/msg, median (min–max) | user | sys | msg/s | against `{}`, median of the rounds' ratios (min–max) |",
        variants[0].name()
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let median = |mut xs: Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        (xs[xs.len() / 2], xs[0], xs[xs.len() - 1])
    };
    for (k, v) in variants.iter().enumerate() {
        let of = |f: &dyn Fn(&Sample) -> f64| median(samples[k].iter().map(f).collect());
        let (cpu, lo, hi) = of(&|s| s.per_msg(s.cpu_ns));
        let (user, _, _) = of(&|s| s.per_msg(s.user_ns));
        let (sys, _, _) = of(&|s| s.per_msg(s.sys_ns));
        let (rate, _, _) = of(&|s| s.msgs as f64 * 1e9 / s.wall_ns.max(1) as f64);
        // Paired by round, so a machine that speeds up or slows down between rounds moves
        // both sides of each ratio.
        let ratios = samples[k]
            .iter()
            .zip(&samples[0])
            .map(|(s, b)| s.per_msg(s.cpu_ns) / b.per_msg(b.cpu_ns) - 1.0)
            .collect();
        let (r, rlo, rhi) = median(ratios);
        println!(
            "| {} | {cpu:.0} ({lo:.0}–{hi:.0}) | {user:.0} | {sys:.0} | {rate:.0} | {:+.1}% ({:+.1}…{:+.1}%) |",
            v.name(),
            r * 100.0,
            rlo * 100.0,
            rhi * 100.0
        );
    }
    Ok(())
}

/// Connects `conns` loopback pairs, runs the server and the client on their threads, and
/// returns the server's sample.
fn run_once(v: Variant, o: &Opts) -> Result<Sample, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let mut server_fds = Vec::with_capacity(o.conns);
    let mut client_fds = Vec::with_capacity(o.conns);
    for _ in 0..o.conns {
        let c = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
        let (s, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        c.set_nodelay(true).map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        client_fds.push(OwnedFd::from(c));
        server_fds.push(s.into_raw_fd());
    }
    let (size, ccpu) = (o.size, o.client_cpu);
    let client = std::thread::spawn(move || client(client_fds, size, ccpu));
    let served = server(v, &server_fds, o);
    for fd in server_fds {
        // SAFETY: the descriptor came from into_raw_fd above and the ring that used it is gone.
        unsafe { libc::close(fd) };
    }
    let client_result = client
        .join()
        .map_err(|_| "client thread panicked".to_string())?;
    // A client's failure first: the server then only saw its connections close.
    client_result?;
    served
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set for sched_getaffinity to fill; CPU_ISSET
    // reads inside it for indices below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

fn pin(cpu: usize) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it (cpu is
    // checked against its size), and sched_setaffinity(0, ..) only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(format!("cpu {cpu} out of range"));
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(format!(
                "pin to cpu {cpu}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// This thread's CPU time: (total, user, system) in ns.
fn thread_cpu() -> (u64, u64, u64) {
    // SAFETY: both calls only write into the zeroed structs passed to them.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts);
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
        let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
        (
            ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64,
            tv(ru.ru_utime),
            tv(ru.ru_stime),
        )
    }
}

const OP_RECV: u64 = 1;
const OP_SEND: u64 = 2;
/// `IORING_CQE_F_NOTIF`: the zero-copy send's second completion (its buffer is released).
const CQE_F_NOTIF: u32 = 1 << 3;

fn ud(conn: usize, op: u64) -> u64 {
    ((conn as u64) << 8) | op
}

/// Submission-queue entries for `conns` connections: room for a receive and a send on each.
fn ring_entries(conns: usize) -> u32 {
    (conns as u32 * 2).next_power_of_two().clamp(64, 4096)
}

fn new_ring(defer: bool, entries: u32) -> Result<IoUring, String> {
    let mut b = IoUring::builder();
    b.setup_cqsize(entries * 4).setup_single_issuer();
    if defer {
        b.setup_defer_taskrun();
    } else {
        b.setup_coop_taskrun();
    }
    b.build(entries).map_err(|e| format!("io_uring setup: {e}"))
}

/// Queues `e`, submitting first if the submission queue is full.
fn push(ring: &mut IoUring, e: &squeue::Entry) -> Result<(), String> {
    loop {
        // SAFETY: every buffer an entry names (connection buffers, the reply, the message)
        // outlives the ring: each is declared before the ring, so dropped after it, and the
        // normal path also waits out every operation before dropping anything.
        if unsafe { ring.submission().push(e) }.is_ok() {
            return Ok(());
        }
        ring.submit().map_err(|e| format!("submit: {e}"))?;
    }
}

/// Drains the completion queue into `out`.
fn reap(ring: &mut IoUring, out: &mut Vec<(u64, i32, u32)>) {
    out.clear();
    out.extend(
        ring.completion()
            .map(|c| (c.user_data(), c.result(), c.flags())),
    );
}

struct Conn {
    /// What operations name it: the descriptor, or its index among the registered files.
    target: Target,
    fd: RawFd,
    got: usize,
    sent: usize,
    buf: Vec<u8>,
}

#[derive(Clone, Copy)]
enum Target {
    Fd(RawFd),
    Fixed(u32),
}

/// A ring and its provided-buffer ring, in this order: the ring is dropped first, so the kernel
/// is done with the buffers before they are unmapped.
struct Io {
    ring: IoUring,
    bufs: Option<BufRing>,
}

fn server(v: Variant, fds: &[RawFd], o: &Opts) -> Result<Sample, String> {
    pin(o.server_cpu)?;
    let entries = ring_entries(o.conns);
    let reply = vec![b'r'; o.size];
    let conns: Vec<Conn> = fds
        .iter()
        .enumerate()
        .map(|(i, &fd)| Conn {
            target: if v.fixed() {
                Target::Fixed(i as u32)
            } else {
                Target::Fd(fd)
            },
            fd,
            got: 0,
            sent: 0,
            buf: if v.provided() {
                Vec::new()
            } else {
                vec![0; o.size.min(BUF_SIZE)]
            },
        })
        .collect();
    // Declared after the buffers the kernel writes into, so an early return drops it first.
    let ring = new_ring(v == Variant::Defer, entries)?;
    if v.fixed() {
        ring.submitter()
            .register_files(fds)
            .map_err(|e| format!("register files: {e}"))?;
    }
    let per_msg = o.size.div_ceil(BUF_SIZE);
    let bufs = if v.provided() {
        let count = (o.conns * per_msg * 2)
            .next_power_of_two()
            .clamp(64, 16_384) as u16;
        Some(BufRing::new(&ring, count)?)
    } else {
        None
    };
    let mut st = Server {
        io: Io { ring, bufs },
        conns,
        reply: &reply,
        v,
        size: o.size,
        in_flight: 0,
        answered: 0,
        multishot_completions: 0,
        zc_notifications: 0,
        direct_recvs: 0,
        provided_buffers: 0,
    };
    let mut start = None;
    if o.warm == 0 {
        start = Some((thread_cpu(), Instant::now()));
    }
    let mut cqes = Vec::with_capacity(entries as usize * 4);
    let mut result = (0..st.conns.len()).try_for_each(|i| st.arm_recv(i));
    while result.is_ok() && st.answered < o.warm + o.msgs {
        if let Err(e) = st.io.ring.submit_and_wait(1) {
            if e.raw_os_error() != Some(libc::EINTR) {
                result = Err(format!("submit_and_wait: {e}"));
            }
            continue;
        }
        reap(&mut st.io.ring, &mut cqes);
        for &(user_data, res, flags) in &cqes {
            let warm_before = st.answered < o.warm;
            // Every completion is accounted for, even after a failure, so the drain below
            // knows what is still in the kernel.
            st.account(user_data, flags);
            if result.is_ok() {
                result = st.on_completion(user_data, res, flags);
            }
            if warm_before && st.answered >= o.warm {
                start = Some((thread_cpu(), Instant::now()));
            }
        }
        if let Some(b) = st.io.bufs.as_ref() {
            b.publish();
        }
    }
    let end = (thread_cpu(), Instant::now());
    // Stop the client (its reads see the shutdown) and wait out every operation still in the
    // kernel before the buffers they name are dropped.
    for c in &st.conns {
        // SAFETY: shutdown on a descriptor this function was lent; it stays open until the
        // caller closes it after we return.
        unsafe { libc::shutdown(c.fd, libc::SHUT_RDWR) };
    }
    while st.in_flight > 0 {
        if let Err(e) = st.io.ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            break;
        }
        reap(&mut st.io.ring, &mut cqes);
        for &(user_data, _, flags) in &cqes {
            st.account(user_data, flags);
        }
    }
    let counts = (
        st.answered,
        st.multishot_completions,
        st.zc_notifications,
        st.direct_recvs,
        st.provided_buffers,
    );
    drop(st);
    result?;
    let (answered, multishot_completions, zc_notifications, direct_recvs, provided_buffers) =
        counts;
    let ((c0, u0, s0), t0) = start.ok_or("the warm-up never ended")?;
    let ((c1, u1, s1), t1) = end;
    Ok(Sample {
        cpu_ns: c1 - c0,
        user_ns: u1.saturating_sub(u0),
        sys_ns: s1.saturating_sub(s0),
        wall_ns: t1.duration_since(t0).as_nanos() as u64,
        msgs: answered.saturating_sub(o.warm),
        multishot_completions,
        zc_notifications,
        direct_recvs,
        provided_buffers,
    })
}

/// The server's state while it answers.
struct Server<'r> {
    io: Io,
    conns: Vec<Conn>,
    reply: &'r [u8],
    v: Variant,
    size: usize,
    /// Operations in the kernel (a multishot receive until its last completion, a zero-copy
    /// send until its notification).
    in_flight: u64,
    answered: u64,
    /// Receive completions that left their multishot armed (0 unless multishot is used).
    multishot_completions: u64,
    /// `SEND_ZC` notifications (0 unless zero-copy sends are used).
    zc_notifications: u64,
    /// Direct `recv` calls (`poll` only).
    direct_recvs: u64,
    /// Receive completions into a provided buffer.
    provided_buffers: u64,
}

impl Server<'_> {
    /// Counts off the operation a completion ends, and gives back its provided buffer.
    fn account(&mut self, user_data: u64, flags: u32) {
        let more = cqueue::more(flags);
        let ends = if user_data & 0xff == OP_SEND {
            // A zero-copy send completes twice: its result (with MORE), then its notification.
            if flags & CQE_F_NOTIF != 0 {
                self.zc_notifications += 1;
            }
            !more
        } else {
            if more {
                self.multishot_completions += 1;
            }
            !more
        };
        if ends {
            self.in_flight -= 1;
        }
        if let (Some(b), Some(bid)) = (self.io.bufs.as_mut(), cqueue::buffer_select(flags)) {
            b.give_back(bid);
            self.provided_buffers += 1;
        }
    }

    /// Acts on a completion: the rest of a reply, the next receive, or a reply to a whole
    /// message. An error ends the run.
    fn on_completion(&mut self, user_data: u64, res: i32, flags: u32) -> Result<(), String> {
        let i = (user_data >> 8) as usize;
        if user_data & 0xff == OP_SEND {
            if flags & CQE_F_NOTIF != 0 {
                return Ok(());
            }
            if res < 0 {
                return Err(format!("send: errno {}", -res));
            }
            let c = &mut self.conns[i];
            c.sent += res as usize;
            if c.sent < self.size {
                let rest = &self.reply[c.sent..];
                let e = send_op(self.v, c.target, rest);
                return self.push(&e.user_data(ud(i, OP_SEND)));
            }
            return if self.v.multishot() {
                Ok(())
            } else {
                self.arm_recv(i)
            };
        }
        if self.v == Variant::Poll {
            return self.on_readable(i, res);
        }
        if res == -libc::ENOBUFS && self.v.provided() {
            // The buffer ring ran dry; buffers go back at the end of this batch.
            return if cqueue::more(flags) {
                Ok(())
            } else {
                self.arm_recv(i)
            };
        }
        if res <= 0 {
            return Err(if res == 0 {
                "receive: peer closed".to_string()
            } else {
                format!("receive: errno {}", -res)
            });
        }
        self.conns[i].got += res as usize;
        if self.v.multishot() && !cqueue::more(flags) {
            self.arm_recv(i)?;
        }
        let c = &mut self.conns[i];
        if c.got < self.size {
            return if self.v.multishot() {
                Ok(())
            } else {
                self.arm_recv(i)
            };
        }
        c.got -= self.size;
        c.sent = 0;
        self.answered += 1;
        let e = send_op(self.v, c.target, self.reply);
        self.push(&e.user_data(ud(i, OP_SEND)))
    }

    /// `poll`: the socket is readable; read what it holds with direct `recv` calls until the
    /// message is whole (then reply) or the socket is drained (then poll again).
    fn on_readable(&mut self, i: usize, res: i32) -> Result<(), String> {
        if res < 0 {
            return Err(format!("poll: errno {}", -res));
        }
        loop {
            let c = &mut self.conns[i];
            let want = (self.size - c.got).min(c.buf.len());
            self.direct_recvs += 1;
            // SAFETY: recv writes at most `want` <= buf.len() bytes into the buffer.
            let n =
                unsafe { libc::recv(c.fd, c.buf.as_mut_ptr().cast(), want, libc::MSG_DONTWAIT) };
            if n == 0 {
                return Err("receive: peer closed".to_string());
            }
            if n < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::WouldBlock {
                    return self.arm_recv(i);
                }
                return Err(format!("receive: {err}"));
            }
            c.got += n as usize;
            if c.got >= self.size {
                c.got -= self.size;
                c.sent = 0;
                self.answered += 1;
                let e = send_op(self.v, c.target, self.reply);
                return self.push(&e.user_data(ud(i, OP_SEND)));
            }
        }
    }

    fn push(&mut self, e: &squeue::Entry) -> Result<(), String> {
        push(&mut self.io.ring, e)?;
        self.in_flight += 1;
        Ok(())
    }

    /// Queues connection `i`'s receive: multishot into the buffer ring, or one `RECV` of what
    /// is left of the message into its own buffer.
    fn arm_recv(&mut self, i: usize) -> Result<(), String> {
        let c = &mut self.conns[i];
        let e = if self.v.multishot() {
            match c.target {
                Target::Fd(fd) => opcode::RecvMulti::new(types::Fd(fd), BGID).build(),
                Target::Fixed(k) => opcode::RecvMulti::new(types::Fixed(k), BGID).build(),
            }
        } else if self.v == Variant::Poll {
            opcode::PollAdd::new(types::Fd(c.fd), libc::POLLIN as u32).build()
        } else if self.v == Variant::Select {
            let len = (self.size - c.got).min(BUF_SIZE) as u32;
            opcode::Recv::new(types::Fd(c.fd), std::ptr::null_mut(), len)
                .buf_group(BGID)
                .build()
                .flags(squeue::Flags::BUFFER_SELECT)
        } else {
            let len = (self.size - c.got).min(c.buf.len()) as u32;
            let ptr = c.buf.as_mut_ptr();
            match c.target {
                Target::Fd(fd) => opcode::Recv::new(types::Fd(fd), ptr, len).build(),
                Target::Fixed(k) => opcode::Recv::new(types::Fixed(k), ptr, len).build(),
            }
        };
        self.push(&e.user_data(ud(i, OP_RECV)))
    }
}

/// A reply's send: `SEND_ZC` for the `zc` variant, else `SEND`.
fn send_op(v: Variant, t: Target, bytes: &[u8]) -> squeue::Entry {
    let len = bytes.len() as u32;
    match (v == Variant::Zc, t) {
        (true, Target::Fd(fd)) => opcode::SendZc::new(types::Fd(fd), bytes.as_ptr(), len).build(),
        (true, Target::Fixed(i)) => {
            opcode::SendZc::new(types::Fixed(i), bytes.as_ptr(), len).build()
        }
        (false, Target::Fd(fd)) => opcode::Send::new(types::Fd(fd), bytes.as_ptr(), len).build(),
        (false, Target::Fixed(i)) => {
            opcode::Send::new(types::Fixed(i), bytes.as_ptr(), len).build()
        }
    }
}

/// The client: every connection sends `size` bytes, reads the `size`-byte reply, and sends
/// again, until the server shuts the connections down. Plain single-shot operations, so its
/// behaviour is the same whatever the server's variant.
/// The client owns its sockets: they close on every return, so a client that fails ends the
/// server's run (its reads see the peer close) instead of leaving it waiting.
fn client(owned: Vec<OwnedFd>, size: usize, cpu: usize) -> Result<(), String> {
    let fds: Vec<RawFd> = owned.iter().map(AsRawFd::as_raw_fd).collect();
    pin(cpu)?;
    let entries = ring_entries(fds.len());
    let msg = vec![b'm'; size];
    let mut got = vec![0usize; fds.len()];
    let mut sent = vec![0usize; fds.len()];
    let mut bufs: Vec<Vec<u8>> = fds.iter().map(|_| vec![0; size.min(BUF_SIZE)]).collect();
    // After the buffers it names, so that an early return drops it first.
    let mut ring = new_ring(false, entries)?;
    let mut in_flight = 0u64;
    for (i, &fd) in fds.iter().enumerate() {
        let e = opcode::Send::new(types::Fd(fd), msg.as_ptr(), size as u32).build();
        push(&mut ring, &e.user_data(ud(i, OP_SEND)))?;
        in_flight += 1;
    }
    let mut cqes = Vec::with_capacity(entries as usize * 4);
    while in_flight > 0 {
        if let Err(e) = ring.submit_and_wait(1) {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(format!("client submit_and_wait: {e}"));
        }
        reap(&mut ring, &mut cqes);
        for &(user_data, res, _) in &cqes {
            in_flight -= 1;
            let i = (user_data >> 8) as usize;
            // The server's shutdown ends a connection: a read of 0, or a reset or pipe error.
            if res <= 0 {
                continue;
            }
            let fd = types::Fd(fds[i]);
            let (e, op) = if user_data & 0xff == OP_SEND {
                sent[i] += res as usize;
                if sent[i] < size {
                    let rest = &msg[sent[i]..];
                    let e = opcode::Send::new(fd, rest.as_ptr(), rest.len() as u32);
                    (e.build(), OP_SEND)
                } else {
                    sent[i] = 0;
                    let len = size.min(bufs[i].len()) as u32;
                    (
                        opcode::Recv::new(fd, bufs[i].as_mut_ptr(), len).build(),
                        OP_RECV,
                    )
                }
            } else {
                got[i] += res as usize;
                if got[i] < size {
                    let len = (size - got[i]).min(bufs[i].len()) as u32;
                    (
                        opcode::Recv::new(fd, bufs[i].as_mut_ptr(), len).build(),
                        OP_RECV,
                    )
                } else {
                    got[i] = 0;
                    (
                        opcode::Send::new(fd, msg.as_ptr(), size as u32).build(),
                        OP_SEND,
                    )
                }
            };
            push(&mut ring, &e.user_data(ud(i, op)))?;
            in_flight += 1;
        }
    }
    drop(ring);
    drop(owned);
    Ok(())
}
