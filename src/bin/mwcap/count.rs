//! A counting global allocator, for the `allocs_per_call` and
//! `heap_bytes_per_conn` figures of `mwcap bench`: the count of heap
//! allocations (and reallocations) this process makes, and the bytes it
//! has on the heap, read before and after what is measured.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Heap allocations made by this process so far.
static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// Bytes on the heap now.
static LIVE: AtomicI64 = AtomicI64::new(0);

/// The allocations made by this process so far.
pub fn allocs() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

/// The bytes this process has on the heap now.
#[cfg_attr(not(all(feature = "verbs", not(loom))), allow(dead_code))] // the verbs bench's figure
pub fn heap_bytes() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// The system allocator, counting allocations.
pub struct Counting;

// SAFETY: forwards every call unchanged to the system allocator; the count
// is a relaxed atomic that never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract (non-zero size) is passed through unchanged.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as i64, Ordering::Relaxed);
        // SAFETY: `p` came from this allocator, hence from `System`, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(n as i64 - l.size() as i64, Ordering::Relaxed);
        // SAFETY: `p` came from `System` with layout `l`; the caller's contract on `n` holds.
        unsafe { System.realloc(p, l, n) }
    }
}
