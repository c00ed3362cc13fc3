//! The heap figures of `mwcap bench` (`allocs_per_call`, `allocs` and
//! `heap_bytes_per_conn`): this process's global allocator is `stats_alloc`'s
//! instrumented system allocator, whose counters are read before and after
//! what is measured. (The crate holds the `unsafe impl GlobalAlloc`, so
//! `unsafe` stays in mwcap's one verbs module.)

use std::alloc::System;

use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};

/// The system allocator, counting allocations and bytes.
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The heap allocations (and reallocations) made by this process so far.
pub fn allocs() -> u64 {
    let s = GLOBAL.stats();
    (s.allocations + s.reallocations) as u64
}

/// The bytes this process has on the heap now.
#[cfg_attr(not(all(feature = "verbs", not(loom))), allow(dead_code))] // the verbs bench's figure
pub fn heap_bytes() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}
