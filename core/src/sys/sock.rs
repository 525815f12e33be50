//! Non-blocking socket calls made directly, when the kernel can complete them at once: a write
//! to a socket with buffer space, a read right after a readiness poll. Each skips a trip around
//! the event loop (submit, complete, wake) that an io_uring operation would take — most of a
//! small request's latency on a busy core. None of them ever blocks.

use std::io;
use std::os::fd::RawFd;

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
    if n >= 0 {
        return Ok(n as usize);
    }
    let err = io::Error::last_os_error();
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
        _ => Err(err),
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

/// Has the peer closed (or reset) its side? Peeks without consuming.
pub(crate) fn peer_gone(fd: RawFd) -> bool {
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
    if n == 0 {
        return true;
    }
    if n < 0 {
        let err = io::Error::last_os_error();
        return err.kind() != io::ErrorKind::WouldBlock && err.kind() != io::ErrorKind::Interrupted;
    }
    false
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
