//! Heap cells a worker thread reuses for what it boxes and drops by the thousand: each request's
//! future (several KB, boxed so an idle connection holds only its small loop) and each parked
//! wait's runtime timer (640 bytes aligned to 128, see `clock::Sleep`).
//!
//! A value that large, or that aligned, misses mimalloc's small-object fast path (up to 1 KB):
//! a `Box` of a request's future measured ~220 instructions to allocate and ~100 to free, once
//! per request (perf/history/RESULTS-diary-2026-12.md, #15 twelfth session). A [`SpareBox`] takes its cell from a
//! per-thread shelf of cells of the same layout that earlier boxes left, and leaves its own
//! there when dropped: a pop and a push. A shelf keeps at most [`KEPT_BYTES_PER_LAYOUT`] (and at
//! most 256 cells); a wave of ten thousand requests ending frees the rest.

use std::alloc::Layout;
use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// How much memory one layout's shelf keeps on a thread: 512 KB is ~70 request futures, or the
/// 256 timers that bound a shelf of small cells.
const KEPT_BYTES_PER_LAYOUT: usize = 512 * 1024;

/// Cells of one layout, empty (their values dropped), for the next box of that layout.
struct Shelf {
    layout: Layout,
    cells: Vec<NonNull<u8>>,
    kept: usize,
}

impl Drop for Shelf {
    fn drop(&mut self) {
        for cell in self.cells.drain(..) {
            // SAFETY: every shelved cell was allocated by `std::alloc::alloc` with this layout
            // (`SpareBox::new`) and is owned by the shelf alone once shelved.
            unsafe { std::alloc::dealloc(cell.as_ptr(), self.layout) };
        }
    }
}

thread_local! {
    /// A thread boxes two or three layouts this way, so a short list searched in order.
    static SHELVES: RefCell<Vec<Shelf>> = const { RefCell::new(Vec::new()) };
}

/// A cell of `layout` left by an earlier box on this thread, if one is shelved.
fn take_cell(layout: Layout) -> Option<NonNull<u8>> {
    SHELVES
        .try_with(|shelves| {
            let mut shelves = shelves.try_borrow_mut().ok()?;
            shelves.iter_mut().find(|s| s.layout == layout)?.cells.pop()
        })
        .ok()
        .flatten()
}

/// Shelve `cell` (of `layout`, its value dropped) for the next box, or give it back when the
/// shelf is full (or the thread is exiting): then `false`, and the caller frees it.
fn shelve_cell(layout: Layout, cell: NonNull<u8>) -> bool {
    SHELVES
        .try_with(|shelves| {
            let Ok(mut shelves) = shelves.try_borrow_mut() else {
                return false;
            };
            let at = match shelves.iter().position(|s| s.layout == layout) {
                Some(at) => at,
                None => {
                    shelves.push(Shelf {
                        layout,
                        cells: Vec::new(),
                        kept: (KEPT_BYTES_PER_LAYOUT / layout.size().max(1)).clamp(4, 256),
                    });
                    shelves.len() - 1
                }
            };
            let shelf = &mut shelves[at];
            if shelf.cells.len() < shelf.kept {
                shelf.cells.push(cell);
                true
            } else {
                false
            }
        })
        .unwrap_or(false)
}

/// A value on the heap, in a cell reused from this thread's shelf when one of its layout is
/// there. It never moves once made, so a future in it is polled in place (this is `Pin<Box<F>>`
/// with a recycled allocation). Only futures and plain values go in: it offers no `&mut T`, so
/// nothing can move a pinned value out of its cell.
pub(crate) struct SpareBox<T> {
    cell: NonNull<T>,
    /// Owns a `T` (for the drop checker).
    _owns: PhantomData<T>,
}

impl<T> SpareBox<T> {
    pub(crate) fn new(value: T) -> SpareBox<T> {
        // A zero-sized value needs no cell, and the allocator takes no zero-sized layout.
        const { assert!(size_of::<T>() > 0) };
        let layout = Layout::new::<T>();
        let cell = take_cell(layout).unwrap_or_else(|| {
            // SAFETY: the layout's size is not zero (above).
            let fresh = unsafe { std::alloc::alloc(layout) };
            NonNull::new(fresh).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        });
        let cell = cell.cast::<T>();
        // SAFETY: the cell is `T`'s layout, allocated and owned by this box alone, and holds no
        // value (a shelved cell's was dropped): a write without dropping anything.
        unsafe { cell.as_ptr().write(value) };
        SpareBox {
            cell,
            _owns: PhantomData,
        }
    }

    /// Where the value lies (tests check a cell is reused).
    #[cfg(test)]
    pub(crate) fn cell(&self) -> *const T {
        self.cell.as_ptr()
    }
}

/// How many cells of `T`'s layout this thread has shelved (tests).
#[cfg(test)]
pub(crate) fn shelved<T>() -> usize {
    let layout = Layout::new::<T>();
    SHELVES.with(|s| {
        s.borrow()
            .iter()
            .find(|s| s.layout == layout)
            .map_or(0, |s| s.cells.len())
    })
}

// The box is a pointer: moving it moves nothing the value's pinning cares about.
impl<T> Unpin for SpareBox<T> {}

impl<F: Future> Future for SpareBox<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: the future stays in its cell, unmoved, until `drop` drops it there: no `&mut
        // F` is handed out anywhere else, so it is pinned for its whole life.
        unsafe { Pin::new_unchecked(&mut *self.cell.as_ptr()) }.poll(cx)
    }
}

impl<T> Drop for SpareBox<T> {
    fn drop(&mut self) {
        // SAFETY: written in `new` and dropped only here, once, in place.
        unsafe { std::ptr::drop_in_place(self.cell.as_ptr()) };
        let layout = Layout::new::<T>();
        let cell = self.cell.cast::<u8>();
        if !shelve_cell(layout, cell) {
            // SAFETY: allocated with this layout (`new`, or the box that shelved it) and owned
            // by this box alone.
            unsafe { std::alloc::dealloc(cell.as_ptr(), layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A value that counts its drops and holds enough bytes to be its own layout.
    struct Counted {
        drops: Rc<Cell<u32>>,
        _bytes: [u8; 3000],
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.drops.set(self.drops.get() + 1);
        }
    }

    fn counted(drops: &Rc<Cell<u32>>) -> Counted {
        Counted {
            drops: Rc::clone(drops),
            _bytes: [7; 3000],
        }
    }

    #[test]
    fn a_dropped_box_drops_its_value_once_and_the_next_box_takes_its_cell() {
        let drops = Rc::new(Cell::new(0));
        let before = shelved::<Counted>();
        let first = SpareBox::new(counted(&drops));
        let cell = first.cell();
        drop(first);
        assert_eq!(drops.get(), 1);
        assert_eq!(shelved::<Counted>(), before + 1);
        let second = SpareBox::new(counted(&drops));
        assert_eq!(second.cell(), cell, "the shelved cell is reused");
        assert_eq!(shelved::<Counted>(), before);
        drop(second);
        assert_eq!(drops.get(), 2);
    }

    #[test]
    fn a_shelf_keeps_its_share_of_memory_and_frees_the_rest() {
        let drops = Rc::new(Cell::new(0));
        // 3,000-byte cells (aligned to 8): 512 KB keeps 174 of them.
        let kept = (KEPT_BYTES_PER_LAYOUT / size_of::<Counted>()).clamp(4, 256);
        let boxes: Vec<_> = (0..kept + 50)
            .map(|_| SpareBox::new(counted(&drops)))
            .collect();
        drop(boxes);
        assert_eq!(drops.get() as usize, kept + 50);
        assert_eq!(shelved::<Counted>(), kept);
    }

    #[test]
    fn cells_of_other_layouts_are_not_mixed() {
        #[repr(align(128))]
        struct Aligned {
            _bytes: [u8; 640],
        }
        let small = SpareBox::new(Aligned { _bytes: [1; 640] });
        drop(small);
        let before = shelved::<Counted>();
        let drops = Rc::new(Cell::new(0));
        let other = SpareBox::new(counted(&drops));
        // The 640-byte cell stays shelved; the 3,000-byte value got a cell of its own.
        assert_eq!(shelved::<Aligned>(), 1);
        assert_eq!(other.cell() as usize % align_of::<Counted>(), 0);
        assert_eq!(shelved::<Counted>(), before.saturating_sub(1));
        let aligned = SpareBox::new(Aligned { _bytes: [2; 640] });
        assert_eq!(aligned.cell() as usize % 128, 0);
        assert_eq!(shelved::<Aligned>(), 0);
    }

    #[test]
    fn a_future_in_a_spare_box_is_polled_in_place_to_its_end() {
        let out = crate::sys::testing::block_on(async {
            let mut waited = 0;
            for n in 0..3u32 {
                // A future that parks once (a yield) before it ends, so it is polled twice in
                // its cell.
                let step = async move {
                    let mut yielded = false;
                    std::future::poll_fn(|cx| {
                        if yielded {
                            Poll::Ready(())
                        } else {
                            yielded = true;
                            cx.waker().wake_by_ref();
                            Poll::Pending
                        }
                    })
                    .await;
                    n + 1
                };
                waited += SpareBox::new(step).await;
            }
            waited
        });
        assert_eq!(out, 6);
    }
}
