//! What one lease costs the engines, with many windows in use.
//!
//! A steady-state loop over an `Owner` and a `Reader` joined by an ideal
//! NIC and wire: every iteration grants one buffer (BIND_MW + grant SEND),
//! the reader READs it, and the release that arrives at the owner is the one
//! of a lease granted `windows - 2` iterations earlier (READ completions and
//! releases are delayed in FIFOs), so almost every window of the pool is
//! leased all the time and the reader has half as many READs outstanding.
//! Each iteration is one *call*: one grant, one grant-SEND completion, one
//! release, one LOCAL_INV completion, one buffer returned at the owner; one
//! grant, one READ completion, one release sent at the reader; and on each
//! side the driver's `poll_timeout` after every batch.
//!
//! ```text
//! cargo run --release -p mwcap-mw --example lease_cost -- [windows] [calls]
//! ```
//! prints calls/s for 16 and 1024 windows (or only `windows`). Instructions
//! per call: run it under callgrind with `--collect-atstart=no
//! --toggle-collect='lease_cost::owner_side*'` (or `reader_side`), which counts
//! only the engine calls of that side (and the few harness instructions
//! that route their outputs); see `docs/protocol-mw.md`, "Cost per call".

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use mwcap_mw::{
    Buffer, Grant, Owner, OwnerAction, OwnerEvent, Reader, ReaderAction, ReaderConfig, ReaderEvent, Release,
    ReleaseMode, Status, Token, Window,
};

/// The wires and completion queues between the two engines.
struct Net {
    /// Grants on their way to the reader.
    grants: VecDeque<Grant>,
    /// Releases on their way to the owner: a delay line.
    releases: VecDeque<Release>,
    release_delay: usize,
    /// The owner's completions (grant SENDs, LOCAL_INVs).
    owner_cq: VecDeque<Token>,
    /// The reader's READ completions: a delay line.
    reader_cq: VecDeque<Token>,
    read_delay: usize,
    /// Buffers back at the owner and destinations back at the reader.
    returned: u64,
    reads_done: u64,
}

const LEASE: Duration = Duration::from_secs(1);

fn buffer(i: u32) -> Buffer {
    Buffer { mr: 1, offset: u64::from(i) * 4096, len: 4096, addr: 0x10_0000 + u64::from(i) * 4096 }
}

fn dest() -> Buffer {
    Buffer { mr: 2, offset: 0, len: 4096, addr: 0 }
}

/// The owner's driver for one iteration: the user grants a buffer, then
/// the inputs that arrived are handed in, the actions carried out, the
/// events drained and the timer re-armed.
#[inline(never)]
fn owner_side(owner: &mut Owner, net: &mut Net, now: Duration, buf: u32) -> Option<Duration> {
    owner.grant(now, buffer(buf), LEASE).expect("a window is free");
    if net.releases.len() > net.release_delay {
        if let Some(r) = net.releases.pop_front() {
            owner.handle_release(now, r);
        }
    }
    while let Some(t) = net.owner_cq.pop_front() {
        owner.handle_completion(now, t, Status::Success);
        // The LOCAL_INV just posted completes in the same batch.
        drain_owner(owner, net);
    }
    drain_owner(owner, net);
    if owner.poll_timeout().is_some_and(|t| t <= now) {
        owner.handle_timeout(now);
        drain_owner(owner, net);
    }
    owner.poll_timeout()
}

fn drain_owner(owner: &mut Owner, net: &mut Net) {
    while let Some(a) = owner.poll_action() {
        match a {
            OwnerAction::BindAndGrant(b) => {
                net.grants.push_back(b.grant);
                net.owner_cq.push_back(b.send_token);
            }
            OwnerAction::Invalidate { token, .. } => net.owner_cq.push_back(token),
            OwnerAction::FlushQp => panic!("the pair is healthy"),
        }
    }
    while let Some(e) = owner.poll_event() {
        match e {
            OwnerEvent::BufferReturned { .. } => net.returned += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// The reader's driver for one iteration.
#[inline(never)]
fn reader_side(reader: &mut Reader, net: &mut Net, now: Duration) -> Option<Duration> {
    while let Some(g) = net.grants.pop_front() {
        reader.handle_grant(now, g, dest());
    }
    drain_reader(reader, net);
    if net.reader_cq.len() > net.read_delay {
        if let Some(t) = net.reader_cq.pop_front() {
            reader.handle_completion(now, t, Status::Success);
        }
    }
    drain_reader(reader, net);
    if reader.poll_timeout().is_some_and(|t| t <= now) {
        reader.handle_timeout(now);
        drain_reader(reader, net);
    }
    reader.poll_timeout()
}

fn drain_reader(reader: &mut Reader, net: &mut Net) {
    while let Some(a) = reader.poll_action() {
        match a {
            ReaderAction::Read { token, .. } => net.reader_cq.push_back(token),
            ReaderAction::SendRelease(r) => net.releases.push_back(r),
            ReaderAction::FlushQp => panic!("the pair is healthy"),
        }
    }
    while let Some(e) = reader.poll_event() {
        match e {
            ReaderEvent::ReadDone { .. } => net.reads_done += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Runs `calls` iterations over a pool of `windows`; returns the elapsed time.
fn run(windows: u32, calls: u64) -> Duration {
    assert!(windows >= 4, "the pipeline needs a few windows");
    let pool = (0..windows).map(|i| Window { handle: i, rkey: i << 8 });
    let mut owner = Owner::new(7, pool);
    let mut reader = Reader::new(ReaderConfig {
        safety_margin: Duration::from_millis(1),
        release: ReleaseMode::Message,
        max_lease: mwcap_mw::MAX_LEASE_TIME,
    });
    // A lease lives from its grant (iteration i) to the LOCAL_INV completion
    // of its release: READ done at i + read_delay, release handed in at
    // i + read_delay + release_delay + 1. The next grant comes before that,
    // so at most windows - 1 of them may overlap.
    let read_delay = (windows / 2) as usize;
    let release_delay = windows as usize - read_delay - 3;
    let mut net = Net {
        grants: VecDeque::with_capacity(4),
        releases: VecDeque::with_capacity(windows as usize),
        release_delay,
        owner_cq: VecDeque::with_capacity(4),
        reader_cq: VecDeque::with_capacity(windows as usize),
        read_delay,
        returned: 0,
        reads_done: 0,
    };
    let mut now = Duration::ZERO;
    let start = Instant::now();
    for i in 0..calls {
        now += Duration::from_micros(1);
        let next_owner = owner_side(&mut owner, &mut net, now, (i % u64::from(windows)) as u32);
        let next_reader = reader_side(&mut reader, &mut net, now);
        std::hint::black_box((next_owner, next_reader));
    }
    let elapsed = start.elapsed();
    let lag = (read_delay + release_delay + 2) as u64;
    assert!(net.reads_done + read_delay as u64 + 1 >= calls, "reads kept up");
    assert!(net.returned + lag >= calls, "buffers kept up: {} of {calls}", net.returned);
    assert!(owner.outstanding_buffers() < windows as usize);
    elapsed
}

fn main() {
    let mut args = std::env::args().skip(1);
    let windows: Option<u32> = args.next().map(|a| a.parse().expect("windows: a number"));
    let calls: u64 = args.next().map_or(1_000_000, |a| a.parse().expect("calls: a number"));
    let pools = match windows {
        Some(w) => vec![w],
        None => vec![16, 1024],
    };
    for windows in pools {
        let elapsed = run(windows, calls);
        let per_s = calls as f64 / elapsed.as_secs_f64();
        println!(
            "mw windows={windows} calls={calls} elapsed_ms={} calls_per_s={per_s:.0} ns_per_call={:.0}",
            elapsed.as_millis(),
            elapsed.as_nanos() as f64 / calls as f64
        );
    }
}
