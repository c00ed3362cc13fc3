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

/// Start async-io's reactor thread, once per process, return once it has
/// run, and settle parking_lot's table ([`parking_lot_settled`]).
///
/// std allocates once as a new thread starts (its name, for the
/// stack-overflow handler), whenever the OS first runs it: on a loaded host
/// that fell inside the first case's measured calls in about one run of
/// five. A timer of async-io's fires only when its reactor is driven, and
/// under `futures`' `block_on` (not async-io's, which drives the reactor
/// itself) only that thread drives it. Call it outside any executor
/// (`executors::run` does, before it starts one). mwcap's alarm thread
/// needs no such wait: the endpoint's start returns once it runs.
#[cfg_attr(loom, allow(dead_code))] // the async bench's
pub fn helper_threads_started() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        futures::executor::block_on(async_io::Timer::after(std::time::Duration::from_millis(1)));
    });
    parking_lot_settled();
}

/// The threads parking_lot's global table is grown for before anything is
/// measured: more than this process ever runs at once (the caller, the
/// server, the drivers, mwcap's alarm thread, async-io's, the executors').
const PARKING_THREADS: usize = 16;

/// Make parking_lot's global table of parked threads, and grow it for
/// [`PARKING_THREADS`] threads, once per process. parking_lot makes that
/// table when a thread first waits on a contended lock (two threads racing
/// to, two allocations each), and grows it when a thread first waits while
/// more threads than a third of its buckets are alive: inside the measured
/// calls, wherever a lock was first contended (the simulator's fabric, a
/// connection's inbox, a server's connection state on verbs): 4 allocations
/// in `.ci/run`'s shared-pool gate under `block_on` in one run of 5 to 25,
/// more often on a loaded host. The table never shrinks, so waiting once on
/// as many threads at once settles it for the process. `mwcap serve` and
/// the verbs benchmark call it as they start (a server's allocations are
/// counted too), the async benchmark through [`helper_threads_started`].
#[cfg_attr(loom, allow(dead_code))] // the benches'
pub fn parking_lot_settled() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(parking_lot_grown);
}

fn parking_lot_grown() {
    let all = std::sync::Arc::new(std::sync::Barrier::new(PARKING_THREADS));
    let threads: Vec<_> = (0..PARKING_THREADS)
        .map(|_| {
            let all = all.clone();
            std::thread::spawn(move || {
                // Every thread's data alive at once, then each waits once.
                all.wait();
                let (lock, cond) = (parking_lot::Mutex::new(()), parking_lot::Condvar::new());
                cond.wait_for(&mut lock.lock(), std::time::Duration::ZERO);
                all.wait();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a thread that waits once on parking_lot");
    }
}
