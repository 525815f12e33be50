//! A whole write on a monoio stream, with an owned buffer, and the direct-send fast path in
//! front of it: the step the client and upstream sides share. Each side keeps its own policy
//! (when to go direct, how long a write may take) and its own meaning for each outcome.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use monoio::buf::IoBuf;
use monoio::io::{AsyncWriteRent, AsyncWriteRentExt};
use monoio::time::error::Elapsed;

use crate::sys::sock;

/// Write all of `buf` to `stream` within `limit`. With `direct`, first straight to the socket
/// ([`sock::send_now`]): when the kernel takes it all, as it does a small write, that is the
/// whole write — no trip around the event loop, and no timer armed. Whatever it does not take
/// goes through the runtime, timed. `Err(Elapsed)`: `limit` passed, and the buffer went with
/// the cancelled write.
pub async fn write_all<S: AsyncWriteRent + AsRawFd>(
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
    let (res, slice) = monoio::time::timeout(limit, stream.write_all(buf.slice(sent..))).await?;
    Ok((res.map(|_| ()), slice.into_inner()))
}
