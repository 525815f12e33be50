//! Non-blocking socket calls made directly, when the kernel can complete them at once: a write
//! to a socket with buffer space, a read right after a readiness poll. Each skips a trip around
//! the event loop (submit, complete, wake) that an io_uring operation would take — most of a
//! small request's latency on a busy core. None of them ever blocks.

use std::io;
use std::os::fd::RawFd;

use super::clock::Mono;
use super::slab::Slab;

/// Send as much of `data` as the socket takes now. `Ok(0)` when it would block.
pub(crate) fn send_now(fd: RawFd, data: &[u8]) -> io::Result<usize> {
    // SAFETY: `data` is a valid slice; MSG_DONTWAIT never blocks, MSG_NOSIGNAL turns a closed
    // peer into EPIPE instead of SIGPIPE.
    let n = unsafe {
        libc::send(
            fd,
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    sent(n)
}

/// A non-blocking send's return value as bytes sent: `Ok(0)` when it would have blocked. Call
/// it right after the send, before anything else can set `errno`.
fn sent(n: isize) -> io::Result<usize> {
    if n >= 0 {
        return Ok(n as usize);
    }
    let err = io::Error::last_os_error();
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
        _ => Err(err),
    }
}

/// Send as much of `first` and then `second` as the socket takes now, in one call. `Ok(0)` when
/// it would block.
pub(crate) fn send_pair_now(fd: RawFd, first: &[u8], second: &[u8]) -> io::Result<usize> {
    let iov = [iovec(first), iovec(second)];
    // SAFETY: an all-zero msghdr is valid (no address, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr().cast_mut();
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: `msg` points at two iovecs over valid slices, alive for the call; sendmsg only
    // reads them. MSG_DONTWAIT never blocks, MSG_NOSIGNAL as in `send_now`.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    sent(n)
}

/// An iovec over `data`, for the kernel to read from.
pub(crate) fn iovec(data: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    }
}

/// Receive what the socket already holds into `buf`'s spare capacity. `Some(0)` is end of
/// stream; `None` means nothing was there (or an error, which the next regular read reports).
pub(crate) fn recv_now(fd: RawFd, buf: &mut Vec<u8>) -> Option<usize> {
    let spare = buf.spare_capacity_mut();
    // SAFETY: recv writes at most `spare.len()` bytes into the vector's spare capacity.
    let n = unsafe {
        libc::recv(
            fd,
            spare.as_mut_ptr().cast(),
            spare.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return None;
    }
    let n = n as usize;
    // SAFETY: recv initialized the first `n` spare bytes.
    unsafe { buf.set_len(buf.len() + n) };
    Some(n)
}

/// Peek at the first waiting byte without consuming it or blocking: `recv`'s answer (1: a byte
/// is there, 0: the peer closed, -1: nothing or an error, in `errno`) and the byte.
fn peek_one(fd: RawFd) -> (isize, u8) {
    let mut byte = 0u8;
    // SAFETY: a one-byte peek into a local; MSG_DONTWAIT never blocks.
    let n = unsafe {
        libc::recv(
            fd,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    (n, byte)
}

/// Has the peer closed (or reset) its side? Peeks without consuming.
pub(crate) fn peer_gone(fd: RawFd) -> bool {
    match peek_one(fd).0 {
        0 => true,
        n if n < 0 => {
            let err = io::Error::last_os_error();
            err.kind() != io::ErrorKind::WouldBlock && err.kind() != io::ErrorKind::Interrupted
        }
        _ => false,
    }
}

/// Are bytes waiting to be read? Peeks without consuming; never blocks. `false` also when the
/// peer closed or the socket failed.
pub(crate) fn has_bytes(fd: RawFd) -> bool {
    peek_one(fd).0 > 0
}

/// Shut a socket down both ways: the peer sees the close at once, and every read or poll on it
/// (one in flight in the kernel included) ends. The descriptor stays open for its owner to
/// close.
pub(crate) fn shutdown(fd: RawFd) {
    // SAFETY: shutdown takes a descriptor and touches no memory; on a descriptor that is not a
    // connected socket it fails harmlessly.
    unsafe {
        libc::shutdown(fd, libc::SHUT_RDWR);
    }
}

/// Sockets one thread holds open, each with a mark (what it means is the holder's: "waiting
/// for a request", say) and maybe a deadline for it, so they can be shut down together, or
/// those whose deadline has passed. Adding one returns its slot, which marks and removes it;
/// slots are reused. One thread's: the holder keeps it in a `RefCell`.
#[derive(Debug, Default)]
pub(crate) struct SocketSet {
    /// A free slot has fd -1.
    slots: Slab<Slot>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    fd: RawFd,
    marked: bool,
    /// When a marked socket is to be shut down ([`SocketSet::shut_down_expired`]).
    deadline: Option<Mono>,
}

impl SocketSet {
    /// Add `fd` (with `marked`); returns its slot.
    pub(crate) fn insert(&mut self, fd: RawFd, marked: bool) -> usize {
        let entry = Slot {
            fd,
            marked,
            deadline: None,
        };
        self.slots.insert(entry)
    }

    /// Forget the socket in `slot` (before it is closed: its number may be reused).
    pub(crate) fn remove(&mut self, slot: usize) {
        if let Some(entry) = self.slots.get_mut(slot) {
            if entry.fd >= 0 {
                entry.fd = -1;
                entry.marked = false;
                entry.deadline = None;
                self.slots.give_back(slot);
            }
        }
    }

    /// Mark or unmark the socket in `slot`, with no deadline.
    pub(crate) fn mark(&mut self, slot: usize, marked: bool) {
        if let Some(entry) = self.slots.get_mut(slot) {
            entry.marked = marked;
            entry.deadline = None;
        }
    }

    /// Mark the socket in `slot` until `deadline`: past it, [`Self::shut_down_expired`] shuts
    /// it down.
    pub(crate) fn mark_until(&mut self, slot: usize, deadline: Mono) {
        if let Some(entry) = self.slots.get_mut(slot) {
            entry.marked = true;
            entry.deadline = Some(deadline);
        }
    }

    /// Shut down the marked sockets whose deadline is before `now` and that have no bytes
    /// waiting to be read (those are about to be read); returns how many. Each is shut down
    /// once: its deadline goes with it.
    pub(crate) fn shut_down_expired(&mut self, now: Mono) -> usize {
        self.shut_down_quiet_marked_where(|entry| entry.deadline.is_some_and(|d| d <= now))
    }

    /// How many sockets are in the set.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.counts().0
    }

    /// Shut down (see [`shutdown`]) every socket in the set; returns how many.
    pub(crate) fn shut_down_all(&self) -> usize {
        let mut n = 0;
        for &Slot { fd, .. } in self.slots.iter() {
            if fd >= 0 {
                shutdown(fd);
                n += 1;
            }
        }
        n
    }

    /// Shut down the marked sockets that have no bytes waiting to be read; returns how many.
    pub(crate) fn shut_down_quiet_marked(&mut self) -> usize {
        self.shut_down_quiet_marked_where(|_| true)
    }

    /// Shut down the marked sockets that `due` picks and that have no bytes waiting to be
    /// read, dropping their deadlines (so none is shut down twice); returns how many.
    fn shut_down_quiet_marked_where(&mut self, due: impl Fn(&Slot) -> bool) -> usize {
        let mut n = 0;
        for entry in self.slots.iter_mut() {
            if entry.fd >= 0 && entry.marked && due(entry) && !has_bytes(entry.fd) {
                shutdown(entry.fd);
                entry.deadline = None;
                n += 1;
            }
        }
        n
    }
}

/// Half-close: no more sends on `fd` (the peer reads end-of-stream after what was sent).
/// Errors (the peer already gone) are of no interest to a closing connection.
pub(crate) fn shutdown_write(fd: RawFd) {
    // SAFETY: shutdown(2) on a socket descriptor the caller owns; it touches no memory.
    unsafe {
        libc::shutdown(fd, libc::SHUT_WR);
    }
}

/// The first byte waiting on the socket, without consuming it (`None`: nothing there yet, the
/// peer closed, or an error).
pub(crate) fn peek_byte(fd: RawFd) -> Option<u8> {
    let (n, byte) = peek_one(fd);
    (n == 1).then_some(byte)
}

/// A second descriptor of the same socket (its readiness and bytes are the socket's), closed
/// on drop.
pub(crate) fn duplicate(fd: RawFd) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a descriptor the caller holds open; it returns a new
    // descriptor or -1, and touches no memory.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is a freshly created descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(new) })
}

/// Has the peer closed its sending side (FIN), whether or not bytes it sent before are still
/// waiting to be read? Polls without blocking or consuming.
pub(crate) fn peer_hung_up(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: poll on one local pollfd with a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// A listening socket on `addr` with SO_REUSEPORT (and SO_REUSEADDR), blocking: several
/// sockets — a process's workers, or a process and the successor taking it over — share the
/// port, the kernel spreading connections among them.
pub(crate) fn reuseport_listener(
    addr: std::net::SocketAddr,
    backlog: i32,
) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(backlog)?;
    Ok(socket.into())
}

/// The descriptors this process may hold: `RLIMIT_NOFILE`'s hard limit (the gateway raises its
/// soft limit to it at start); `None` when it cannot be read, or is unlimited.
pub(crate) fn open_files_limit() -> Option<u64> {
    let lim = nofile()?;
    (lim.rlim_max != libc::RLIM_INFINITY).then_some(lim.rlim_max)
}

/// Each connection is a file descriptor: lift the soft open-file limit to the hard one.
/// Returns the limit in force (`None`: unknown).
pub(crate) fn raise_open_files_limit() -> Option<u64> {
    let lim = nofile()?;
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct it is given, a local one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Some(raised.rlim_cur);
        }
    }
    Some(lim.rlim_cur)
}

/// `RLIMIT_NOFILE`, soft and hard.
fn nofile() -> Option<libc::rlimit> {
    // SAFETY: getrlimit writes the struct it is given, a local one.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        (libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0).then_some(lim)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_socket_set_reuses_slots_and_shuts_down_what_it_is_asked_to() {
        let (idle, idle_peer) = UnixStream::pair().unwrap();
        let (busy, _busy_peer) = UnixStream::pair().unwrap();
        let (waiting, mut waiting_peer) = UnixStream::pair().unwrap();
        let mut set = SocketSet::default();
        let a = set.insert(idle.as_raw_fd(), true);
        let b = set.insert(busy.as_raw_fd(), true);
        let c = set.insert(waiting.as_raw_fd(), true);
        assert_eq!((a, b, c, set.len()), (0, 1, 2, 3));
        set.mark(b, false);
        // Bytes wait on `waiting`: marked, but not quiet.
        waiting_peer.write_all(b"GET").unwrap();
        assert!(has_bytes(waiting.as_raw_fd()));
        assert!(!has_bytes(idle.as_raw_fd()));

        assert_eq!(set.shut_down_quiet_marked(), 1);
        // The idle one's peer sees the close; the others stay open.
        let mut buf = [0u8; 4];
        assert_eq!((&idle_peer).read(&mut buf).unwrap(), 0);
        assert!(peer_gone(idle.as_raw_fd()));
        assert!(!peer_gone(busy.as_raw_fd()));
        assert!(!peer_gone(waiting.as_raw_fd()));

        // A removed slot is reused, and removing twice frees it once.
        set.remove(a);
        set.remove(a);
        assert_eq!(set.len(), 2);
        assert_eq!(set.insert(idle.as_raw_fd(), false), a);
        assert_eq!(set.insert(idle.as_raw_fd(), false), 3);
        set.remove(3);

        assert_eq!(set.shut_down_all(), 3);
        assert!(peer_gone(busy.as_raw_fd()));
        assert_eq!(waiting_peer.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn only_marked_sockets_past_their_deadline_and_quiet_are_shut_down_and_once() {
        let pairs: Vec<_> = (0..5).map(|_| UnixStream::pair().unwrap()).collect();
        let fd = |i: usize| pairs[i].0.as_raw_fd();
        let past = Mono::now();
        let now = past + std::time::Duration::from_millis(1);
        let mut set = SocketSet::default();
        let slots: Vec<usize> = (0..5).map(|i| set.insert(fd(i), false)).collect();
        // Expired: shut down.
        set.mark_until(slots[0], past);
        // Not yet due.
        set.mark_until(slots[1], now + std::time::Duration::from_secs(60));
        // Marked again without a deadline: only a drain shuts it.
        set.mark_until(slots[2], past);
        set.mark(slots[2], true);
        // Expired, but a request is on its way: left to be read.
        set.mark_until(slots[3], past);
        (&pairs[3].1).write_all(b"GET").unwrap();
        // slots[4] is never marked.

        assert_eq!(set.shut_down_expired(now), 1);
        assert!(peer_gone(fd(0)));
        for i in 1..5 {
            assert!(!peer_gone(fd(i)), "socket {i} was shut down");
        }
        // Its deadline went with it: the next sweep does not shut it again.
        assert_eq!(set.shut_down_expired(now), 0);
        // The one not yet due is shut down once its deadline has passed.
        assert_eq!(
            set.shut_down_expired(now + std::time::Duration::from_secs(61)),
            1
        );
        assert!(peer_gone(fd(1)));
    }
}
