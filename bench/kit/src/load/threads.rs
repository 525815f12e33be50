//! The first engine (`--engine threads`): one std thread per keep-alive connection, blocking
//! sockets with a timeout on every call. In open loop each connection keeps its own fixed
//! schedule (connections staggered across one interval), as sluice-load always did; it stays
//! so that new numbers can be checked against old ones.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::http::{io_fail, Fail, Fed, Kind, Response};
use crate::stats::Stats;
use crate::{join_measured, mono_ns, sleep_until, Plan, Window};

struct Conn {
    sock: TcpStream,
    buf: Vec<u8>,
    resp: Response,
    /// `--timeout`, and the read/write timeout the socket has now (shorter near `grace`).
    timeout: Duration,
    set: Duration,
    /// The run's grace deadline ([`Window`]): no call blocks past it.
    grace: u64,
}

/// The error of a request cut off by the grace deadline.
fn past_grace() -> Fail {
    Fail(
        Kind::Timeout,
        "still unanswered --timeout after the window ended".into(),
    )
}

impl Conn {
    fn open(addr: SocketAddr, timeout: Duration, grace: u64) -> Result<Conn, Fail> {
        let left = grace.saturating_sub(mono_ns());
        if left == 0 {
            return Err(past_grace());
        }
        let connect_timeout = timeout.min(Duration::from_nanos(left));
        let sock = TcpStream::connect_timeout(&addr, connect_timeout).map_err(|e| {
            let kind = if e.kind() == io::ErrorKind::TimedOut {
                Kind::Timeout
            } else {
                Kind::Connect
            };
            Fail(kind, format!("connect {addr}: {e}"))
        })?;
        let setup = |s: &TcpStream| -> io::Result<()> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))
        };
        setup(&sock).map_err(|e| Fail(Kind::Connect, format!("socket options: {e}")))?;
        Ok(Conn {
            sock,
            buf: vec![0; 16 * 1024],
            resp: Response::default(),
            timeout,
            set: timeout,
            grace,
        })
    }

    /// Before each blocking call: past the grace deadline it fails; closer to it than
    /// `--timeout`, the socket's timeouts shrink to what is left (so a server that trickles
    /// bytes cannot hold the run either). In the window itself this costs nothing.
    fn limit(&mut self) -> Result<(), Fail> {
        let left = self.grace.saturating_sub(mono_ns());
        if left == 0 {
            return Err(past_grace());
        }
        let want = self.timeout.min(Duration::from_nanos(left));
        if want < self.set {
            let set = |s: &TcpStream| -> io::Result<()> {
                s.set_read_timeout(Some(want))?;
                s.set_write_timeout(Some(want))
            };
            set(&self.sock).map_err(|e| Fail(Kind::Io, format!("socket options: {e}")))?;
            self.set = want;
        }
        Ok(())
    }

    /// One read() into the buffer; returns the byte count (0 = EOF).
    fn fill(&mut self) -> Result<usize, Fail> {
        self.limit()?;
        loop {
            match self.sock.read(&mut self.buf) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => return r.map_err(io_fail),
            }
        }
    }

    /// Send one request and read the whole response into `self.resp`, timing it from `start`.
    fn exchange(&mut self, req: &[u8], start: u64, stream: bool) -> Result<(), Fail> {
        self.limit()?;
        self.sock.write_all(req).map_err(io_fail)?;
        self.resp.begin(stream);
        loop {
            let n = self.fill()?;
            if n == 0 {
                return Err(self.resp.eof_fail());
            }
            if self.resp.feed(&self.buf[..n], mono_ns(), start)? == Fed::Done {
                return Ok(());
            }
        }
    }
}

/// Counts requests on connections across all threads, and the most at once.
#[derive(Default)]
struct InFlight {
    now: AtomicU64,
    max: AtomicU64,
}

/// Runs the whole test: one thread per connection, the schedule starting 10 ms from now.
/// Returns the merged numbers and the process CPU time over the measurement window.
pub(crate) fn run(plan: &Arc<Plan>) -> Result<(Stats, u64), String> {
    let win = Window::starting(mono_ns() + 10_000_000, &plan.opts);
    let in_flight = Arc::new(InFlight::default());
    let mut handles = Vec::new();
    for id in 0..plan.opts.connections {
        let p = Arc::clone(plan);
        let f = Arc::clone(&in_flight);
        let h = std::thread::Builder::new()
            .name(format!("load-{id}"))
            .spawn(move || worker(&p, win, id, &f))
            .map_err(|e| format!("spawn thread: {e}"))?;
        handles.push(h);
    }
    let (mut total, cpu) = join_measured(handles, win.measure_from)?;
    total.max_in_flight = in_flight.max.load(Ordering::Relaxed);
    Ok((total, cpu))
}

fn worker(plan: &Plan, win: Window, id: usize, in_flight: &InFlight) -> Result<Stats, String> {
    let o = &plan.opts;
    let mut st = Stats::new()?;
    let mut conn: Option<Conn> = None;
    // Open loop: per-connection interval, connections staggered across one interval.
    let interval = o
        .rate
        .map(|r| Duration::from_secs_f64(o.connections as f64 / r));
    let mut k: u64 = 0;
    let mut seq = id;
    let mut reported = false;
    // When the previous exchange ended: the connection was busy until then.
    let mut free_since = win.t0;
    loop {
        let intended = match interval {
            Some(iv) => {
                let off = iv.mul_f64((k as f64 + id as f64 / o.connections as f64).max(0.0));
                win.t0 + u64::try_from(off.as_nanos()).unwrap_or(u64::MAX)
            }
            None => mono_ns().max(win.t0),
        };
        k += 1;
        if intended >= win.end {
            break;
        }
        sleep_until(intended);
        let record = intended >= win.measure_from;
        // Request number `seq` (counted over all connections) uses models[seq % m] and
        // keys[seq % k]: both lists rotate independently.
        let req = plan.request(seq);
        seq += o.connections;
        if mono_ns() >= win.grace {
            // Open loop, far behind schedule: what is still due is counted, not sent.
            if record {
                st.abandon();
            }
            continue;
        }

        if record {
            let n = in_flight.now.fetch_add(1, Ordering::Relaxed) + 1;
            in_flight.max.fetch_max(n, Ordering::Relaxed);
        }
        let c = match conn.as_mut() {
            Some(c) => Ok(c),
            None => Conn::open(o.addr, o.timeout, win.grace).map(|c| conn.insert(c)),
        };
        let res = c.and_then(|c| {
            if record {
                // Behind schedule, the wait for this connection to be free is queueing.
                st.sent(
                    free_since.saturating_sub(intended),
                    mono_ns().saturating_sub(intended),
                );
            }
            c.exchange(req, intended, o.stream).map(|()| c)
        });
        let done = mono_ns();
        free_since = done;
        if record {
            in_flight.now.fetch_sub(1, Ordering::Relaxed);
        }
        match res {
            Ok(c) => {
                if record {
                    st.response(&c.resp, done.saturating_sub(intended));
                }
                if !c.resp.keep_alive {
                    conn = None;
                }
            }
            Err(Fail(kind, msg)) => {
                conn = None;
                if record {
                    if matches!(kind, Kind::Timeout) && done >= win.grace {
                        st.abandon();
                    } else {
                        st.errors[kind as usize] += 1;
                    }
                }
                if !reported {
                    eprintln!("sluice-load: connection {id}: {msg} (further errors only counted)");
                    reported = true;
                }
                if matches!(kind, Kind::Connect) {
                    // Don't spin on a refused port.
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
    Ok(st)
}
