//! One read and one whole write on a monoio stream, with owned buffers: the I/O steps the
//! client and upstream sides share. The whole write comes in three forms: one buffer, two
//! owned buffers in one vectored write ([`write_pair`]), and an owned buffer followed by a
//! borrowed one ([`write_with_tail`]). Each side keeps its own policy (how much room a read
//! needs, how long it may take) and its own meaning for each outcome: those stay with the
//! caller, which only hands over the numbers and a way to read or the stream to write.

use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use monoio::buf::{IoBuf, IoBufMut, SliceMut};
use monoio::io::{AsyncWriteRent, AsyncWriteRentExt, CancelableAsyncWriteRent, Canceller};
use monoio::BufResult;

use crate::sys::clock::{self, Elapsed};
use crate::sys::sock;

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

/// Append one read's worth of bytes to `buf`, reading into its spare capacity (at most
/// `max_read` bytes of it) within `limit`. When less than `min_spare` bytes are free, `grow`
/// more are reserved first. `read` is the stream's owned-buffer read (`|b| stream.read(b)`).
/// `min_spare`, `grow` and `max_read` must be at least 1: a read of no room reads nothing,
/// which looks like the peer's close.
///
/// While the read is in flight `buf` is empty (the read owns the bytes): dropping the returned
/// future drops them with it.
pub(crate) async fn read_spare<R, F>(
    buf: &mut Vec<u8>,
    min_spare: usize,
    grow: usize,
    max_read: usize,
    limit: Duration,
    read: R,
) -> ReadOutcome
where
    R: FnOnce(SliceMut<Vec<u8>>) -> F,
    F: Future<Output = BufResult<usize, SliceMut<Vec<u8>>>>,
{
    match clock::timeout(limit, read(spare(buf, min_spare, grow, max_read))).await {
        Ok((res, slice)) => {
            *buf = slice.into_inner();
            outcome(res)
        }
        Err(_) => ReadOutcome::TimedOut,
    }
}

/// `buf`'s spare capacity (at least `min_spare`, growing it by `grow` when short, at most
/// `max_read`), taken out of it for one read: the read gives the buffer back.
fn spare(buf: &mut Vec<u8>, min_spare: usize, grow: usize, max_read: usize) -> SliceMut<Vec<u8>> {
    if buf.capacity() - buf.len() < min_spare {
        buf.reserve(grow);
    }
    let owned = std::mem::take(buf);
    let len = owned.len();
    let end = owned.capacity().min(len.saturating_add(max_read));
    owned.slice_mut(len..end)
}

/// A finished read's result as a [`ReadOutcome`].
fn outcome(res: io::Result<usize>) -> ReadOutcome {
    match res {
        Ok(0) => ReadOutcome::Closed,
        Ok(n) => ReadOutcome::Data(n),
        Err(e) => ReadOutcome::Failed(e),
    }
}

/// What [`read_spare_watched`] ended with.
pub(crate) enum Watched {
    /// The read's outcome (its data, a close, a failure, or `deadline` passing).
    Read(ReadOutcome),
    /// The watch started at the checkpoint finished first; the read was dropped, and its buffer
    /// with it.
    Then,
}

/// [`read_spare`] until `deadline`, with a checkpoint: until `checkpoint` the read is all it
/// waits on, with one timer at the checkpoint that is a slot in the worker's list of deadlines
/// ([`clock::sleep_until_swept`]) — the only timer it takes when the data comes first; from
/// the checkpoint on it races `then()` (made there: a watch of the client) and the deadline.
/// The read is the same one throughout: its buffer is not lost at the checkpoint.
#[allow(clippy::too_many_arguments)] // read_spare's, a deadline and the watch
pub(crate) async fn read_spare_watched<R, F, T, TF>(
    buf: &mut Vec<u8>,
    min_spare: usize,
    grow: usize,
    max_read: usize,
    deadline: clock::Mono,
    checkpoint: clock::Mono,
    read: R,
    then: T,
) -> Watched
where
    R: FnOnce(SliceMut<Vec<u8>>) -> F,
    F: Future<Output = BufResult<usize, SliceMut<Vec<u8>>>>,
    T: FnOnce() -> TF,
    TF: Future<Output = ()>,
{
    let mut op = std::pin::pin!(read(spare(buf, min_spare, grow, max_read)));
    let mut early = None;
    if checkpoint < deadline {
        let mut until = clock::sleep_until_swept(checkpoint);
        early = std::future::poll_fn(|cx| match op.as_mut().poll(cx) {
            std::task::Poll::Ready(done) => std::task::Poll::Ready(Some(done)),
            std::task::Poll::Pending => std::pin::Pin::new(&mut until).poll(cx).map(|()| None),
        })
        .await;
    }
    let done = match early {
        Some(done) => Some(done),
        None => {
            let watch = then();
            monoio::select! {
                biased;
                done = clock::timeout_until(deadline, &mut op) => done.ok(),
                () = watch => return Watched::Then,
            }
        }
    };
    let Some((res, slice)) = done else {
        return Watched::Read(ReadOutcome::TimedOut);
    };
    *buf = slice.into_inner();
    Watched::Read(outcome(res))
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

/// Write all of `first` and then `second[from..]` to `stream` within `limit`, both in one
/// vectored write (as far as the kernel takes them at once): a response head and the body bytes
/// that came with it go out together without being copied into one buffer. `direct` as in
/// [`write_all`].
///
/// Both buffers always come back, also when `limit` passes: the write in flight is then
/// cancelled and awaited (an error of kind `TimedOut`; part of the bytes may have reached the
/// peer). The relay keeps a non-streamed answer in `second` for the meter, and a client too
/// slow to take it must not cost the record.
pub(crate) async fn write_pair<S: CancelableAsyncWriteRent + AsRawFd>(
    stream: &mut S,
    first: Vec<u8>,
    second: Vec<u8>,
    from: usize,
    direct: bool,
    limit: Duration,
) -> (io::Result<()>, Vec<u8>, Vec<u8>) {
    let from = from.min(second.len());
    let total = first.len() + second.len() - from;
    let mut sent = if direct {
        match sock::send_pair_now(stream.as_raw_fd(), &first, &second[from..]) {
            Ok(n) if n == total => return (Ok(()), first, second),
            Ok(n) => n,
            Err(e) => return (Err(e), first, second),
        }
    } else {
        0
    };
    let mut expired = clock::sleep(limit);
    let canceller = Canceller::new();
    let (mut first, mut second) = (first, second);
    // Short writes: again from where the kernel stopped.
    while sent < total {
        let (first_from, second_from) = match sent.checked_sub(first.len()) {
            None => (sent, from),
            Some(past) => (first.len(), from + past),
        };
        let pair = Pair::new(first, first_from, second, second_from);
        let mut write = std::pin::pin!(stream.cancelable_writev(pair, canceller.handle()));
        let (res, pair) = monoio::select! {
            biased;
            written = &mut write => written,
            () = &mut expired => {
                // Cancelled, the write still ends (at once) and hands the buffers back. On
                // io_uring it may have finished before the cancel reached it: if that was the
                // rest, the write is whole after all.
                let _ = canceller.cancel();
                let (res, pair) = (&mut write).await;
                if res.is_ok_and(|n| sent + n == total) {
                    return (Ok(()), pair.first, pair.second);
                }
                let timed_out = io::Error::new(io::ErrorKind::TimedOut, "write timed out");
                return (Err(timed_out), pair.first, pair.second);
            }
        };
        (first, second) = (pair.first, pair.second);
        match res {
            Ok(0) => return (Err(io::ErrorKind::WriteZero.into()), first, second),
            Ok(n) => sent += n,
            Err(e) => return (Err(e), first, second),
        }
    }
    (Ok(()), first, second)
}

/// Write all of `first` and then `tail` to `stream` within `limit`. `tail` is borrowed, and
/// what the runtime writes it must own until the kernel is done (even when the caller stops
/// waiting), so both go straight to the socket in one call ([`sock::send_pair_now`]); only what
/// the socket does not take then is copied behind `first` and written through the runtime.
/// `first` comes back as it went (its length restored); `Err(Elapsed)`: `limit` passed, and it
/// went with the cancelled write.
pub(crate) async fn write_with_tail<S: AsyncWriteRent + AsRawFd>(
    stream: &mut S,
    first: Vec<u8>,
    tail: &[u8],
    limit: Duration,
) -> Result<(io::Result<()>, Vec<u8>), Elapsed> {
    let len = first.len();
    let sent = match sock::send_pair_now(stream.as_raw_fd(), &first, tail) {
        Ok(n) if n == len + tail.len() => return Ok((Ok(()), first)),
        Ok(n) => n,
        Err(e) => return Ok((Err(e), first)),
    };
    // The rest, in one buffer: what is left of `first` stays where it is, the tail's unsent
    // bytes go behind it.
    let mut rest = first;
    rest.extend_from_slice(tail.get(sent.saturating_sub(len)..).unwrap_or_default());
    let skip = sent.min(len);
    let (res, slice) = clock::timeout(limit, stream.write_all(rest.slice(skip..))).await?;
    let mut first = slice.into_inner();
    first.truncate(len);
    Ok((res.map(|_| ()), first))
}

/// `first[first_from..]` and `second[second_from..]` as one vectored write's buffers, owned by
/// it while the kernel reads them.
struct Pair {
    /// On the heap: the runtime moves the value after the kernel has been given this address.
    iov: Box<[libc::iovec; 2]>,
    first: Vec<u8>,
    second: Vec<u8>,
}

impl Pair {
    fn new(first: Vec<u8>, first_from: usize, second: Vec<u8>, second_from: usize) -> Pair {
        let iov = Box::new([
            sock::iovec(first.get(first_from..).unwrap_or_default()),
            sock::iovec(second.get(second_from..).unwrap_or_default()),
        ]);
        Pair { iov, first, second }
    }
}

// SAFETY: the iovecs point into the two vectors' heap storage, which neither moves nor changes
// while the runtime owns the `Pair` (nothing can reach the vectors then), and into a boxed
// array, which does not move either.
unsafe impl monoio::buf::IoVecBuf for Pair {
    fn read_iovec_ptr(&self) -> *const libc::iovec {
        self.iov.as_ptr()
    }

    fn read_iovec_len(&self) -> usize {
        self.iov.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::sys::testing::{block_on, block_on_legacy};
    use std::io::Read as _;

    /// `len` bytes of a pattern that differs with `seed`.
    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    /// A peer on a loopback port that reads everything sent to it, starting `after` its
    /// connection is accepted; what it read comes from the handle once the writer closes.
    fn peer(after: Duration) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(after);
            let mut got = Vec::new();
            peer.read_to_end(&mut got).unwrap();
            got
        });
        (addr, reader)
    }

    /// What a peer reads when `write_pair` sends `first` and `second[from..]`, large enough that
    /// the kernel takes them in several short writes while the peer reads.
    fn received(first: Vec<u8>, second: Vec<u8>, from: usize, direct: bool) -> Vec<u8> {
        let (addr, reader) = peer(Duration::ZERO);
        let (sent_first, sent_second) = (first.clone(), second.clone());
        block_on(async move {
            let mut stream = monoio::net::TcpStream::connect(addr).await.unwrap();
            // No limit (a configured "never": too large to add to a reading) is allowed too.
            let (res, first, second) =
                write_pair(&mut stream, first, second, from, direct, Duration::MAX).await;
            res.unwrap();
            // Both buffers come back as they went.
            assert_eq!((first, second), (sent_first, sent_second));
        });
        reader.join().unwrap()
    }

    /// What a peer reads when `write_with_tail` sends `first` and `tail`.
    fn received_with_tail(first: Vec<u8>, tail: Vec<u8>) -> Vec<u8> {
        // Late, so the socket fills and the direct send stops short.
        let (addr, reader) = peer(Duration::from_millis(50));
        let sent_first = first.clone();
        block_on(async move {
            let mut stream = monoio::net::TcpStream::connect(addr).await.unwrap();
            let (res, first) = write_with_tail(&mut stream, first, &tail, Duration::from_secs(10))
                .await
                .unwrap();
            res.unwrap();
            // `first` comes back as it went, whatever was copied behind it.
            assert_eq!(first, sent_first);
        });
        reader.join().unwrap()
    }

    #[test]
    fn a_borrowed_tail_arrives_whole_behind_its_buffer() {
        // Taken by the socket at once; and more than it takes at once, the cut in the tail or
        // in `first` (then the tail goes whole through the runtime).
        for (first_len, tail_len) in [(300, 20_000), (200, 16 << 20), (16 << 20, 100_000)] {
            let (first, tail) = (pattern(first_len, 1), pattern(tail_len, 2));
            let mut expected = first.clone();
            expected.extend_from_slice(&tail);
            let got = received_with_tail(first, tail);
            assert!(
                got == expected,
                "{first_len} + {tail_len}: {} bytes arrived",
                got.len()
            );
        }
    }

    #[test]
    fn a_pair_that_times_out_comes_back_whole() {
        // A peer that takes nothing: the write can't finish within the limit, on either driver.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (first, second) = (vec![1u8; 100], vec![2u8; 32 << 20]);
        let check = |first: Vec<u8>, second: Vec<u8>| async move {
            let mut stream = monoio::net::TcpStream::connect(addr).await.unwrap();
            let started = std::time::Instant::now();
            let (res, back_first, back_second) = write_pair(
                &mut stream,
                first.clone(),
                second.clone(),
                7,
                false,
                Duration::from_millis(200),
            )
            .await;
            assert_eq!(res.unwrap_err().kind(), io::ErrorKind::TimedOut);
            assert!(started.elapsed() >= Duration::from_millis(200));
            assert!(
                back_first == first && back_second == second,
                "the buffers came back"
            );
        };
        block_on(check(first.clone(), second.clone()));
        block_on_legacy(check(first, second));
        drop(listener);
    }

    #[test]
    fn a_pair_arrives_whole_and_in_order() {
        // Small (one write), and several MB each (many short writes, the cut falling in either
        // buffer); from the start of `second` or from inside it; an empty `first`.
        for (first_len, second_len, from) in [
            (100, 200, 0),
            (100, 200, 50),
            (0, 5000, 1000),
            (3 << 20, 3 << 20, 0),
            (64, 5 << 20, 17),
        ] {
            for direct in [false, true] {
                let (first, second) = (pattern(first_len, 1), pattern(second_len, 2));
                let mut expected = first.clone();
                expected.extend_from_slice(&second[from..]);
                let got = received(first, second, from, direct);
                assert!(
                    got == expected,
                    "{first_len} + {second_len} from {from}, direct {direct}: {} bytes arrived",
                    got.len()
                );
            }
        }
    }
}
