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

/// Start async-io's reactor thread, once per process, and return once it
/// has run. std allocates once as a new thread starts (its name, for the
/// stack-overflow handler), whenever the OS first runs it: on a loaded host
/// that fell inside the first case's measured calls in about one run of
/// five. A timer of async-io's fires only when its reactor is driven, and
/// under `futures`' `block_on` (not async-io's, which drives the reactor
/// itself) only that thread drives it. Call it outside any executor
/// (`executors::run` does, before it starts one). (mwcap's alarm thread
/// needs no such wait: the endpoint's start returns once it runs.)
#[cfg_attr(loom, allow(dead_code))] // the async bench's
pub fn helper_threads_started() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        futures::executor::block_on(async_io::Timer::after(std::time::Duration::from_millis(1)));
    });
}
