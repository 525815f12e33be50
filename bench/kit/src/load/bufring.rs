//! A provided-buffer ring (`IORING_REGISTER_PBUF_RING`): receive buffers the kernel picks from
//! for multishot receives. Shared by sluice-load's io_uring engine and `sluice-probe uring`.

use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::IoUring;

pub(crate) const BUF_SIZE: usize = 16 * 1024;
pub(crate) const BGID: u16 = 0;

/// One entry of a provided-buffer ring, laid out as the kernel's `struct io_uring_buf`. The
/// ring's tail is the `resv` field of entry 0.
#[repr(C)]
struct BufEntry {
    addr: u64,
    len: u32,
    bid: u16,
    resv: u16,
}

/// Anonymous memory that the kernel reads and writes on its own (ring entries, receive
/// buffers): held as a raw pointer, never as a Rust reference to the whole.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Result<Mapping, String> {
        // SAFETY: an anonymous private mapping with no address hint touches no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "mmap {len} bytes: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and nothing uses them after this
        // (the ring that could write into them is dropped first: its owner declares the ring
        // before this, as sluice-load's `Engine` and the probe's `Io` do).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub(crate) struct BufRing {
    entries: Mapping,
    data: Mapping,
    count: u16,
    /// Our copy of the tail: buffers handed back but not yet published.
    tail: u16,
}

impl BufRing {
    pub(crate) fn new(ring: &IoUring, count: u16) -> Result<BufRing, String> {
        let entries = Mapping::new(usize::from(count) * std::mem::size_of::<BufEntry>())?;
        let data = Mapping::new(usize::from(count) * BUF_SIZE)?;
        // SAFETY: `entries` is page-aligned memory of `count` entries that lives as long as the
        // ring (dropped after it), as register_buf_ring requires.
        unsafe {
            ring.submitter()
                .register_buf_ring(entries.ptr as u64, count, BGID)
        }
        .map_err(|e| format!("register buffer ring: {e}"))?;
        let mut b = BufRing {
            entries,
            data,
            count,
            tail: 0,
        };
        for bid in 0..count {
            b.give_back(bid);
        }
        b.publish();
        Ok(b)
    }

    /// Puts buffer `bid` back at the tail (seen by the kernel at the next [`Self::publish`]).
    pub(crate) fn give_back(&mut self, bid: u16) {
        if bid >= self.count {
            return;
        }
        let idx = usize::from(self.tail & (self.count - 1));
        // SAFETY: idx < count, so the entry lies in the mapping. The kernel does not read
        // entries past the published tail, and only the fields are written, never entry 0's
        // `resv` (the tail), so nothing it reads is torn.
        unsafe {
            let e = self.entries.ptr.cast::<BufEntry>().add(idx);
            std::ptr::addr_of_mut!((*e).addr)
                .write(self.data.ptr as u64 + u64::from(bid) * BUF_SIZE as u64);
            std::ptr::addr_of_mut!((*e).len).write(BUF_SIZE as u32);
            std::ptr::addr_of_mut!((*e).bid).write(bid);
        }
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the buffers given back so far available to the kernel.
    pub(crate) fn publish(&self) {
        // SAFETY: entry 0's `resv` (offset 14, 2-aligned) is the ring tail, which the kernel
        // reads with an acquire load; this release store orders the entry writes before it.
        let tail = unsafe {
            &*(self
                .entries
                .ptr
                .add(std::mem::offset_of!(BufEntry, resv))
                .cast::<AtomicU16>())
        };
        tail.store(self.tail, Ordering::Release);
    }

    /// The first `len` bytes of buffer `bid`, which the kernel filled and handed to us.
    pub(crate) fn get(&self, bid: u16, len: usize) -> &[u8] {
        if bid >= self.count {
            return &[];
        }
        // SAFETY: the buffer lies inside `data`; the kernel wrote `len` <= BUF_SIZE bytes into
        // it and will not touch it again until it is given back (after this slice's last use).
        unsafe {
            std::slice::from_raw_parts(
                self.data.ptr.add(usize::from(bid) * BUF_SIZE),
                len.min(BUF_SIZE),
            )
        }
    }
}
