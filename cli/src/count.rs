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

/// Wait, once per process and for at most a second, until mwcap's alarm
/// thread runs. A driver spawns it when it first sleeps (in the warm-up),
/// and std allocates once as a new thread starts (its name, for the
/// stack-overflow handler), whenever the OS first runs it: on a loaded host
/// that can fall inside the first case's measured calls (1 allocation in
/// about one run of five). The thread runs once `/proc` lists it by its
/// name, which std gives it after that allocation.
#[cfg_attr(loom, allow(dead_code))] // the async bench's
pub fn alarm_thread_started() {
    static DONE: std::sync::Once = std::sync::Once::new();
    DONE.call_once(|| {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while !thread_named("mwcap-alarm") && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
}

/// Whether a thread of this process is named `name` (true where `/proc`
/// cannot tell).
fn thread_named(name: &str) -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return true };
    tasks
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name))
}
