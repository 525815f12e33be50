//! Zero-downtime upgrade: the listening sockets handed from the running process to its
//! successor over a Unix socket, so no connection is refused and no queued one is lost.
//!
//! The running process (when `server.takeover_socket` is set) listens on that path from a
//! thread of its own. A successor started with `--takeover PATH` connects and asks; the running
//! process sends every listening socket it has (the plain and TLS listeners of each worker, as
//! file descriptors with `SCM_RIGHTS`); the successor serves on them, says it is ready, and the
//! running process drains as on `SIGTERM` — its in-flight requests and streams finish, while
//! new connections, queued on the very same sockets, are the successor's. Plain blocking
//! sockets on plain threads: none of this runs on a worker.
//!
//! The exchange, one line each way (then the descriptors with the second line):
//! successor → `TAKEOVER 1\n`; running → `LISTENERS <plain> <tls>\n` + the descriptors;
//! successor → `READY\n`; running → `DRAINING\n`.

// Control-plane threads with blocking sockets, never a worker.
#![allow(clippy::disallowed_methods)]

use std::io::{self, BufRead, BufReader, Write};
use std::net::TcpListener as StdListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Whether the process at the other end of `conn` runs as this process's user.
fn same_user(conn: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(SO_PEERCRED) writes at most `len` bytes into the local `cred`.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no preconditions.
    rc == 0 && cred.uid == unsafe { libc::geteuid() }
}

/// The most listening sockets one exchange carries: the kernel's limit of descriptors per
/// message (`SCM_MAX_FD`), i.e. up to 126 workers with a TLS listener.
const MAX_FDS: usize = 253;

/// Where a process stands with handing its sockets over, shared by the takeover thread and the
/// control thread so that a stop and a hand-over that race never both act: a stop that began
/// first refuses the hand-over; a hand-over that began first makes the stop leave the sockets
/// listening (they are the successor's too).
#[derive(Debug, Default)]
pub(crate) struct Handover {
    stopping: AtomicBool,
    handing: AtomicBool,
}

impl Handover {
    /// A stop begins: whether the sockets are (being) handed over, so must stay listening.
    pub(crate) fn stop_begins(&self) -> bool {
        self.stopping.store(true, Ordering::SeqCst);
        self.handing.load(Ordering::SeqCst)
    }

    /// A hand-over may begin: `false` when a stop already began.
    fn hand_over_begins(&self) -> bool {
        self.handing.store(true, Ordering::SeqCst);
        if self.stopping.load(Ordering::SeqCst) {
            self.handing.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The hand-over failed before the successor said it serves: the sockets are ours alone.
    fn hand_over_failed(&self) {
        self.handing.store(false, Ordering::SeqCst);
    }
}
/// How long either side waits for the other's next line.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// The listening sockets a process serves on: one plain (and one TLS, when configured) per
/// worker, all bound to the same addresses with SO_REUSEPORT.
pub(crate) struct Inherited {
    pub(crate) plain: Vec<StdListener>,
    pub(crate) tls: Vec<StdListener>,
}

/// Successor side: take the listening sockets from the process serving on `path`. Returns
/// them and the connection to say `READY` on ([`ready`]).
pub(crate) fn request(path: &Path) -> io::Result<(Inherited, UnixStream)> {
    let stream = UnixStream::connect(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("takeover: cannot reach {}: {e}", path.display()),
        )
    })?;
    stream.set_read_timeout(Some(STEP_TIMEOUT))?;
    stream.set_write_timeout(Some(STEP_TIMEOUT))?;
    (&stream).write_all(b"TAKEOVER 1\n")?;
    let (line, fds) = recv_line_with_fds(&stream)?;
    let counts: Vec<usize> = line
        .strip_prefix("LISTENERS ")
        .map(|r| r.split(' ').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default();
    let [plain, tls] = counts[..] else {
        return Err(io::Error::other(format!(
            "takeover: unexpected answer `{line}`"
        )));
    };
    if fds.len() != plain + tls || plain == 0 {
        return Err(io::Error::other(format!(
            "takeover: announced {plain} + {tls} sockets, received {}",
            fds.len()
        )));
    }
    let mut listeners: Vec<StdListener> = fds.into_iter().map(StdListener::from).collect();
    let tls = listeners.split_off(plain);
    Ok((
        Inherited {
            plain: listeners,
            tls,
        },
        stream,
    ))
}

/// Successor side: tell the previous process it may drain; returns once it says it does.
pub(crate) fn ready(stream: &UnixStream) -> io::Result<()> {
    let mut stream = stream;
    stream.write_all(b"READY\n")?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if line.trim_end() != "DRAINING" {
        return Err(io::Error::other(format!(
            "takeover: the previous process answered `{}`",
            line.trim_end()
        )));
    }
    Ok(())
}

/// Running side: listen on `path` (replacing a stale socket file there) and hand `listeners`
/// (duplicates of the workers' sockets) to the one successor that asks; once it is ready, call
/// `drain`. Runs on a thread of its own for the life of the process.
pub(crate) fn serve(
    path: PathBuf,
    listeners: Inherited,
    state: Arc<Handover>,
    drain: Box<dyn Fn() + Send>,
) -> io::Result<()> {
    // A socket file left by a previous process (or the one this process took over from).
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| {
        io::Error::new(e.kind(), format!("takeover socket {}: {e}", path.display()))
    })?;
    // Whoever connects gets the listening sockets: this user only.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    std::thread::Builder::new()
        .name("sluice-takeover".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else {
                    // Out of descriptors and the like: back off instead of spinning.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                };
                if !same_user(&conn) {
                    eprintln!("sluice: takeover refused: the peer runs as another user");
                    continue;
                }
                if !state.hand_over_begins() {
                    let _ = (&conn).write_all(b"STOPPING\n");
                    continue;
                }
                match hand_over(&conn, &listeners) {
                    Ok(()) => {
                        eprintln!("sluice: takeover: the successor serves; draining");
                        drain();
                        let _ = (&conn).write_all(b"DRAINING\n");
                        return;
                    }
                    Err(e) => {
                        state.hand_over_failed();
                        eprintln!("sluice: takeover attempt failed: {e}");
                    }
                }
            }
        })?;
    Ok(())
}

/// One exchange with a successor: its request, the sockets, its `READY`.
fn hand_over(conn: &UnixStream, listeners: &Inherited) -> io::Result<()> {
    conn.set_read_timeout(Some(STEP_TIMEOUT))?;
    conn.set_write_timeout(Some(STEP_TIMEOUT))?;
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if line.trim_end() != "TAKEOVER 1" {
        return Err(io::Error::other(format!(
            "unexpected request `{}`",
            line.trim_end()
        )));
    }
    let fds: Vec<RawFd> = listeners
        .plain
        .iter()
        .chain(&listeners.tls)
        .map(AsRawFd::as_raw_fd)
        .collect();
    let header = format!(
        "LISTENERS {} {}\n",
        listeners.plain.len(),
        listeners.tls.len()
    );
    send_line_with_fds(conn, header.as_bytes(), &fds)?;
    line.clear();
    reader.read_line(&mut line)?;
    if line.trim_end() != "READY" {
        return Err(io::Error::other(format!(
            "the successor answered `{}` instead of READY",
            line.trim_end()
        )));
    }
    Ok(())
}

/// Send `line` with `fds` attached (one `sendmsg`).
fn send_line_with_fds(stream: &UnixStream, line: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::other("too many sockets to hand over"));
    }
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    // u64s: aligned for the cmsghdr laid over it.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: line.as_ptr() as *mut libc::c_void,
        iov_len: line.len(),
    };
    // SAFETY: msghdr is plain data; every pointer set below points into locals that outlive
    // the sendmsg call, with their true lengths.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), payload);
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != line.len() {
        return Err(io::Error::other("short send of the takeover header"));
    }
    Ok(())
}

/// Receive one line (up to its newline, in one message) and the descriptors attached to it.
fn recv_line_with_fds(stream: &UnixStream) -> io::Result<(String, Vec<OwnedFd>)> {
    let mut buf = [0u8; 256];
    let payload = MAX_FDS * std::mem::size_of::<RawFd>();
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    // u64s: aligned for the cmsghdr laid over it.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut fds = Vec::new();
    // SAFETY: msghdr is plain data pointing into locals that outlive recvmsg; the control
    // messages are walked with the CMSG macros within `msg_controllen`, and each descriptor
    // SCM_RIGHTS delivers is new to this process, so owning it is sound.
    let n = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n >= 0 {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg);
                    let len = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                    let count = len / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
            if msg.msg_flags & libc::MSG_CTRUNC != 0 {
                return Err(io::Error::other("takeover: descriptors were truncated"));
            }
        }
        n
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let line = String::from_utf8_lossy(buf.get(..n as usize).unwrap_or_default())
        .trim_end()
        .to_string();
    Ok((line, fds))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn listening_sockets_cross_a_unix_socket_and_keep_their_queues() {
        // Two listeners on one port (SO_REUSEPORT), as two workers would have them.
        let first =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        first.set_reuse_port(true).unwrap();
        first
            .bind(
                &"127.0.0.1:0"
                    .parse::<std::net::SocketAddr>()
                    .unwrap()
                    .into(),
            )
            .unwrap();
        first.listen(16).unwrap();
        let addr = first.local_addr().unwrap().as_socket().unwrap();
        let first: StdListener = first.into();
        // A client queued on the socket before the hand-over.
        let queued = std::net::TcpStream::connect(addr).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let sender = std::thread::spawn(move || {
            send_line_with_fds(&a, b"LISTENERS 1 0\n", &[first.as_raw_fd()]).unwrap();
            drop(first); // the sender's copy closes; the socket lives on in the receiver
        });
        let (line, fds) = recv_line_with_fds(&b).unwrap();
        sender.join().unwrap();
        assert_eq!(line, "LISTENERS 1 0");
        assert_eq!(fds.len(), 1);
        let inherited = StdListener::from(fds.into_iter().next().unwrap());
        assert_eq!(inherited.local_addr().unwrap(), addr);
        // The connection queued before the hand-over is accepted by the new owner.
        let (served, _) = inherited.accept().unwrap();
        assert_eq!(served.peer_addr().unwrap(), queued.local_addr().unwrap());
    }
}
