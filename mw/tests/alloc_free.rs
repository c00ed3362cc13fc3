//! The engines allocate nothing once made (`Owner::new`, `Reader::with_reads`):
//! their tables and queues are sized for every window and READ at once, so
//! a connection's first burst of calls allocates no more than its
//! thousandth (found on rxe, where a benchmark's short warm-up left the
//! first growth of each table inside the measured calls). The process's
//! allocator counts allocations (`stats_alloc`); this binary is a plain
//! program (no libtest thread), so nothing else allocates meanwhile.

use std::alloc::System;
use std::time::Duration;

use mwcap_mw::{
    Buffer, Owner, OwnerAction, OwnerEvent, Reader, ReaderAction, ReaderConfig, ReaderEvent, ReleaseMode,
    Status, Window,
};
use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn allocs() -> usize {
    let s = GLOBAL.stats();
    s.allocations + s.reallocations
}

const WINDOWS: u32 = 16;

fn buffer(i: u32) -> Buffer {
    Buffer { mr: 1, offset: u64::from(i) * 4096, len: 4096, addr: 0x1000 + u64::from(i) * 4096 }
}

/// `rounds` rounds of `WINDOWS` leases at once, each granted, read,
/// released, invalidated and returned, between a new owner and `reader`.
/// Returns the allocations made meanwhile (the owner's making not counted).
fn burst(reader: &mut Reader, rounds: u32) -> usize {
    let mut owner = Owner::new(7, (0..WINDOWS).map(|i| Window { handle: i, rkey: (i + 1) << 8 }));
    let ms = Duration::from_millis;
    let before = allocs();
    for round in 0..rounds {
        let now = ms(u64::from(round) * 10);
        // Every window granted at once: the grants reach the reader.
        for i in 0..WINDOWS {
            owner.grant(now, buffer(i), ms(5000)).expect("a free window");
        }
        let mut reads = [None; WINDOWS as usize];
        for i in 0..WINDOWS {
            let Some(OwnerAction::BindAndGrant(b)) = owner.poll_action() else { panic!("a grant") };
            owner.handle_completion(now, b.send_token, Status::Success);
            reader.handle_grant(now, b.grant, buffer(100 + i));
            let Some(ReaderAction::Read { token, .. }) = reader.poll_action() else { panic!("a READ") };
            reads[i as usize] = Some(token);
        }
        // Every READ completes; every release reaches the owner.
        for token in reads.into_iter().flatten() {
            reader.handle_completion(now, token, Status::Success);
        }
        while let Some(a) = reader.poll_action() {
            let ReaderAction::SendRelease(r) = a else { panic!("a release, got {a:?}") };
            owner.handle_release(now, r);
        }
        while let Some(e) = reader.poll_event() {
            assert!(matches!(e, ReaderEvent::ReadDone { .. }), "{e:?}");
        }
        // Every invalidation completes; every buffer comes back.
        while let Some(a) = owner.poll_action() {
            let OwnerAction::Invalidate { token, .. } = a else { panic!("an invalidation, got {a:?}") };
            owner.handle_completion(now, token, Status::Success);
        }
        let mut back = 0;
        while let Some(e) = owner.poll_event() {
            back += u32::from(matches!(e, OwnerEvent::BufferReturned { .. }));
        }
        assert_eq!(back, WINDOWS, "round {round}: every buffer back");
        assert_eq!(owner.poll_timeout(), None);
    }
    let made = allocs() - before;
    drop(owner);
    made
}

/// Run as a plain program (`harness = false` in `Cargo.toml`): no other
/// thread runs, so every allocation counted is the engines'.
fn main() {
    a_burst_of_leases_allocates_nothing_once_the_engines_are_made();
    println!("alloc_free: ok");
}

fn a_burst_of_leases_allocates_nothing_once_the_engines_are_made() {
    let config = ReaderConfig {
        safety_margin: Duration::from_millis(1),
        release: ReleaseMode::Message,
        max_lease: mwcap_mw::MAX_LEASE_TIME,
    };
    // A reader sized for them, and the owner: nothing, from the first round.
    let mut sized = Reader::with_reads(config, WINDOWS as usize);
    assert_eq!(burst(&mut sized, 3), 0, "the owner or a sized reader allocated");
    // A reader made empty grows its tables with the first burst (which
    // is what the sized one saves), and not after.
    let mut lazy = Reader::new(config);
    assert!(burst(&mut lazy, 1) > 0, "the test would not see a growth");
    assert_eq!(burst(&mut lazy, 3), 0, "grown once, it allocates no more");
}
