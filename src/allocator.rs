//! The heap allocator: mimalloc, asked for a plain block wherever a plain
//! block is aligned enough.
//!
//! Every mimalloc block is a whole number of machine words from an aligned
//! page start, so a plain block (`mi_malloc`) is aligned for any type whose
//! alignment is at most a word. mimalloc's aligned entry points, which the
//! `mimalloc` crate calls for every allocation, give a block larger than
//! 1 KiB whose size class is not a power of two (a request's future, a
//! connection's buffer) by over-allocating and aligning by hand: several
//! times the instructions of a plain block, and more memory. Only larger
//! alignments take that path here.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The largest alignment every plain mimalloc block has.
const WORD: usize = std::mem::size_of::<usize>();

/// mimalloc as the global allocator.
pub(crate) struct MiMalloc;

// SAFETY: every block comes from mimalloc, aligned as its layout asks (a
// plain block for a word's alignment or less, as argued above, else an
// aligned one), and goes back to it through `mi_free`, which takes blocks
// of either kind; a reallocation keeps the original alignment the same way.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for MiMalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's allocation functions take any size.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_malloc(layout.size()).cast()
            } else {
                mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_zalloc(layout.size()).cast()
            } else {
                mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator, so from mimalloc.
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`'s alignment,
        // which the new block keeps.
        unsafe {
            if layout.align() <= WORD {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
            }
        }
    }
}
