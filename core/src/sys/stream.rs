//! One read and one whole write on a monoio stream, with owned buffers: the two I/O steps the
//! client and upstream sides share. Each side keeps its own policy (how much room a read
//! needs, how long it may take) and its own meaning for each outcome: those stay with the
//! caller, which only hands over the numbers and a way to read or the stream to write.

use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use monoio::buf::{IoBuf, IoBufMut, SliceMut};
use monoio::io::{AsyncWriteRent, AsyncWriteRentExt};
use monoio::time::error::Elapsed;
use monoio::BufResult;

use crate::sys::{clock, sock};

/// How one [`read_spare`] ended.
#[derive(Debug)]
pub(crate) enum ReadOutcome {
    /// This many bytes (never 0) were appended.
    Data(usize),
    /// End of stream: the peer closed its side.
    Closed,
    Failed(io::Error),
    /// `limit` passed first. The buffer went with the cancelled read: `buf` is left empty.
    TimedOut,
}

/// Append one read's worth of bytes to `buf`, reading into its spare capacity within `limit`.
/// When less than `min_spare` bytes are free, `grow` more are reserved first. `read` is the
/// stream's owned-buffer read (`|b| stream.read(b)`).
///
/// While the read is in flight `buf` is empty (the read owns the bytes): dropping the returned
/// future drops them with it.
pub(crate) async fn read_spare<R, F>(
    buf: &mut Vec<u8>,
    min_spare: usize,
    grow: usize,
    limit: Duration,
    read: R,
) -> ReadOutcome
where
    R: FnOnce(SliceMut<Vec<u8>>) -> F,
    F: Future<Output = BufResult<usize, SliceMut<Vec<u8>>>>,
{
    if buf.capacity() - buf.len() < min_spare {
        buf.reserve(grow);
    }
    let owned = std::mem::take(buf);
    let len = owned.len();
    let cap = owned.capacity();
    match clock::timeout(limit, read(owned.slice_mut(len..cap))).await {
        Ok((res, slice)) => {
            *buf = slice.into_inner();
            match res {
                Ok(0) => ReadOutcome::Closed,
                Ok(n) => ReadOutcome::Data(n),
                Err(e) => ReadOutcome::Failed(e),
            }
        }
        Err(_) => ReadOutcome::TimedOut,
    }
}

/// Write all of `buf` to `stream` within `limit`. With `direct`, first straight to the socket
/// ([`sock::send_now`]): when the kernel takes it all, as it does a small write, that is the
/// whole write — no trip around the event loop, and no timer armed. Whatever it does not take
/// goes through the runtime, timed. `Err(Elapsed)`: `limit` passed, and the buffer went with
/// the cancelled write.
pub(crate) async fn write_all<S: AsyncWriteRent + AsRawFd>(
    stream: &mut S,
    buf: Vec<u8>,
    direct: bool,
    limit: Duration,
) -> Result<(io::Result<()>, Vec<u8>), Elapsed> {
    let sent = if direct {
        match sock::send_now(stream.as_raw_fd(), &buf) {
            Ok(n) if n == buf.len() => return Ok((Ok(()), buf)),
            Ok(n) => n,
            Err(e) => return Ok((Err(e), buf)),
        }
    } else {
        0
    };
    let (res, slice) = clock::timeout(limit, stream.write_all(buf.slice(sent..))).await?;
    Ok((res.map(|_| ()), slice.into_inner()))
}
