//! The client's connection, plain or TLS: the one type the connection loop and the phases that
//! write to the client (the relay, the local answers) share. Reads and writes are the
//! owned-buffer steps of [`stream`], each within a limit; watching for the client to leave
//! peeks at the socket ([`sock`]).

use std::io;
use std::time::Duration;

use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;

use crate::sys::{sock, stream};

/// The client connection, plain or TLS. It has one owner (the connection loop), which lends it
/// to the request being served: reading and writing take `&mut self`, while watching for the
/// client to leave takes `&self` — so the compiler guarantees no write runs while a watch is
/// alive (the relay drops its watch before each write), and no `unsafe` is needed.
pub(crate) struct ClientSocket {
    io: ClientIo,
}

enum ClientIo {
    Plain(TcpStream),
    /// The TLS session owns the socket; `watch` is a second descriptor of the same socket
    /// (`dup`), to wait for readiness and peek at its raw bytes without touching the session.
    Tls {
        stream: Box<monoio_rustls::ServerTlsStream<TcpStream>>,
        watch: TcpStream,
        /// A read / a write of the session is under way, or was and never finished: its future
        /// was dropped (a timeout). That operation's buffer is then not where the session
        /// expects it, and using it again would panic inside it: a cut read makes every later
        /// read fail, a cut write every later operation (reads may write alerts), and the
        /// connection closes.
        reading: bool,
        writing: bool,
    },
}

fn client_write_timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "client write timed out")
}

/// The answer to any operation on a TLS session that an earlier one left unusable.
fn tls_unusable() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "the TLS session was left unusable by a cancelled operation",
    )
}

impl ClientSocket {
    pub(crate) fn new(stream: TcpStream) -> ClientSocket {
        ClientSocket {
            io: ClientIo::Plain(stream),
        }
    }

    /// A TLS session (after its handshake) over a socket, watched through `watch`, a
    /// duplicate descriptor of the same socket.
    pub(crate) fn tls(
        stream: monoio_rustls::ServerTlsStream<TcpStream>,
        watch: TcpStream,
    ) -> ClientSocket {
        ClientSocket {
            io: ClientIo::Tls {
                stream: Box::new(stream),
                watch,
                reading: false,
                writing: false,
            },
        }
    }

    /// Whether the bytes go through TLS (so raw reads of the socket are never right, and the
    /// session may hold decrypted bytes that readiness cannot show).
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self.io, ClientIo::Tls { .. })
    }

    pub(crate) async fn read<B: IoBufMut>(&mut self, buf: B) -> monoio::BufResult<usize, B> {
        match &mut self.io {
            ClientIo::Plain(stream) => stream.read(buf).await,
            ClientIo::Tls { reading: true, .. } | ClientIo::Tls { writing: true, .. } => {
                (Err(tls_unusable()), buf)
            }
            ClientIo::Tls {
                stream, reading, ..
            } => {
                *reading = true;
                let result = stream.read(buf).await;
                *reading = false;
                result
            }
        }
    }

    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match &self.io {
            ClientIo::Plain(stream) => stream.as_raw_fd(),
            ClientIo::Tls { watch, .. } => watch.as_raw_fd(),
        }
    }

    /// Write all of `buf` within `limit`. With `direct`, first straight to the socket (see
    /// [`Load::direct_writes`]); whatever it does not take goes through the runtime.
    pub(crate) async fn write_all(
        &mut self,
        buf: Vec<u8>,
        limit: Duration,
        direct: bool,
    ) -> (io::Result<()>, Vec<u8>) {
        let written = match &mut self.io {
            ClientIo::Plain(s) => stream::write_all(s, buf, direct, limit).await,
            ClientIo::Tls { writing: true, .. } => return (Err(tls_unusable()), buf),
            // Encrypted by the session on its way out: no direct send past it.
            ClientIo::Tls {
                stream, writing, ..
            } => {
                *writing = true;
                let written = crate::sys::clock::timeout(limit, stream.write_all(buf))
                    .await
                    .map(|(res, buf)| (res.map(|_| ()), buf));
                // A write cut by the timeout leaves `writing` set: the session is done.
                if written.is_ok() {
                    *writing = false;
                }
                written
            }
        };
        match written {
            Ok(written) => written,
            Err(_) => (Err(client_write_timed_out()), Vec::new()),
        }
    }

    /// Write all of `first` and then `second[from..]` within `limit`, in one vectored write
    /// where the socket is plain (see [`stream::write_pair`]: both buffers come back, also when
    /// the write times out); TLS encrypts from one buffer, so there `second`'s bytes are copied
    /// behind `first`'s (taken off again after) and `second` stays here (`first` comes back
    /// empty when the write timed out).
    pub(crate) async fn write_pair(
        &mut self,
        mut first: Vec<u8>,
        second: Vec<u8>,
        from: usize,
        limit: Duration,
        direct: bool,
    ) -> (io::Result<()>, Vec<u8>, Vec<u8>) {
        match &mut self.io {
            ClientIo::Plain(s) => stream::write_pair(s, first, second, from, direct, limit).await,
            ClientIo::Tls { .. } => {
                let len = first.len();
                first.extend_from_slice(second.get(from..).unwrap_or_default());
                let (res, mut first) = self.write_all(first, limit, direct).await;
                first.truncate(len);
                (res, first, second)
            }
        }
    }

    /// Resolves when the client sent something or closed: the caller peeks to tell which.
    pub(crate) async fn readable(&self) -> io::Result<()> {
        match &self.io {
            ClientIo::Plain(stream) => stream.readable(false).await,
            ClientIo::Tls { watch, .. } => watch.readable(false).await,
        }
    }

    /// Read what the socket already holds (see [`sock::recv_now`]): for right after
    /// [`Self::readable`] fired. Never on TLS (`None`): its bytes are the session's to read.
    pub(crate) fn read_ready(&self, buf: &mut Vec<u8>) -> Option<usize> {
        match &self.io {
            ClientIo::Plain(_) => sock::recv_now(self.fd(), buf),
            ClientIo::Tls { .. } => None,
        }
    }

    /// Stop sending: the client sees the end of the stream once it has read what was sent.
    pub(crate) fn shutdown_write(&self) {
        sock::shutdown_write(self.fd());
    }

    /// Has the client closed (or reset) its side? Peeks without consuming; never blocks.
    pub(crate) fn peer_gone(&self) -> bool {
        match &self.io {
            ClientIo::Plain(_) => sock::peer_gone(self.fd()),
            // A TLS client that leaves sends close_notify, then FIN: bytes are waiting (the
            // alert), so only the FIN says it is gone. (A plain client may pipeline requests
            // and then half-close while it waits for the answers: bytes waiting mean it is
            // still there.)
            ClientIo::Tls { .. } => sock::peer_hung_up(self.fd()),
        }
    }

    /// Has the client sent bytes not read yet? Peeks without consuming; never blocks.
    pub(crate) fn has_bytes(&self) -> bool {
        sock::has_bytes(self.fd())
    }

    /// Resolves when the client has left (closed or reset its connection); never while it is
    /// there. Waits for the socket to turn readable — a close is noticed at once — unless bytes
    /// already wait (the next request pipelined, or on TLS an alert ahead of the FIN): then it
    /// looks for the hang-up every `poll_every`.
    pub(crate) async fn left(&self, poll_every: Duration) {
        loop {
            if self.is_tls() || self.has_bytes() {
                // Looked at once at once: a TLS client gone before the watch began is seen now.
                if self.peer_gone() {
                    return;
                }
                crate::sys::clock::sleep(poll_every).await;
            } else if self.readable().await.is_err() {
                return;
            }
            if self.peer_gone() {
                return;
            }
        }
    }
}
