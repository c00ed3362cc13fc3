//! Torture: a long random run on the simulated NIC across many connections
//! at once, with the safety checks of `prop_endpoint.rs` after every step
//! (no stale read accepted, no buffer reused while the peer can reach it,
//! no invalidation of an unbound window, nothing DMA'd into a held buffer,
//! every buffer back after close), plus one more: a connection no fault was
//! injected into is never torn down (timeouts fail calls, not connections).
//!
//! Faults: cancels, clock jumps past leases and call timeouts, link delays,
//! lost packets (the link dropping everything for up to 16 ms), QP errors,
//! and the death of the server. A connection that goes down (or
//! has run its course) is finished (closed, every buffer checked back) and
//! replaced by a fresh one with random policies.
//!
//! CI runs 20,000 delivered calls over 8 connections; for the long run set
//! `MWCAP_TORTURE_CALLS` (e.g. 1000000) and `MWCAP_TORTURE_SEED`, with
//! `--release --nocapture` to see the counts (docs/reliability.md).

mod common;

use common::{Op, World};
use mwcap::conn::{Policies, Policy};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

struct Conn {
    w: World,
    /// A fault was injected: it may go down.
    faulted: bool,
    steps: u32,
}

fn fresh(rng: &mut SmallRng) -> Conn {
    let p = |r: &mut SmallRng| if r.gen_bool(0.5) { Policy::Mw } else { Policy::Confirm };
    let policies = Policies { request: p(rng), reply: p(rng) };
    Conn { w: World::new(policies, rng.gen()), faulted: false, steps: 0 }
}

#[derive(Default, Debug)]
struct Counts {
    steps: u64,
    /// Calls tried, and made (accepted).
    calls: u64,
    made: u64,
    replies: u64,
    failed: u64,
    connections: u64,
    faults: u64,
}

fn op(rng: &mut SmallRng) -> (Op, bool) {
    match rng.gen_range(0..1000) {
        0..=349 => (Op::Call { len: len(rng), payload: rng.gen_bool(0.7) }, false),
        350..=699 => (Op::Reply { pick: rng.gen(), len: len(rng), payload: rng.gen_bool(0.7) }, false),
        700..=729 => (Op::Cancel { pick: rng.gen() }, false),
        730..=969 => (Op::Advance { ms: rng.gen_range(0..40) }, false),
        970..=984 => (Op::Advance { ms: rng.gen_range(500..3000) }, false),
        985..=987 => (Op::LinkDelay { ms: rng.gen_range(0..1500) }, true),
        988..=989 => (Op::LinkLoss { ms: rng.gen_range(0..16) }, true),
        990..=995 => (Op::QpError { client: rng.gen_bool(0.5) }, true),
        _ => (Op::KillServer, true),
    }
}

/// A payload length: inline-sized, standard, or (one in ten) a large class.
fn len(rng: &mut SmallRng) -> u16 {
    match rng.gen_range(0..10) {
        0..=3 => rng.gen_range(1..300),
        4..=8 => rng.gen_range(300..8192),
        _ => rng.gen_range(8192..65535),
    }
}

fn torture(target: u64, conns: usize, seed: u64) -> Counts {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut c = Counts::default();
    let mut live: Vec<Conn> = (0..conns).map(|_| fresh(&mut rng)).collect();
    c.connections = conns as u64;
    while c.replies < target {
        let i = rng.gen_range(0..live.len());
        let (o, fault) = op(&mut rng);
        let conn = &mut live[i];
        if matches!(o, Op::Call { .. }) {
            c.calls += 1;
        }
        conn.faulted |= fault;
        c.faults += u64::from(fault);
        let before = (conn.w.replies, conn.w.failed);
        conn.w.apply(&o);
        conn.w.check();
        conn.steps += 1;
        c.steps += 1;
        c.replies += conn.w.replies - before.0;
        c.failed += conn.w.failed - before.1;
        let down = conn.w.p.client.is_down().or(conn.w.p.server.is_down()).cloned();
        if let Some(reason) = &down {
            assert!(conn.faulted, "a healthy connection went down: {reason}");
        }
        if down.is_some() || conn.w.server_dead || conn.steps >= 400 {
            finish(&mut c, &mut conn.w);
            live[i] = fresh(&mut rng);
            c.connections += 1;
        }
    }
    for conn in &mut live {
        finish(&mut c, &mut conn.w);
    }
    c
}

/// Finish `w` (every call ends: closing fails those still waiting) and
/// count its calls.
fn finish(c: &mut Counts, w: &mut common::World) {
    let before = (w.replies, w.failed);
    w.finish();
    c.replies += w.replies - before.0;
    c.failed += w.failed - before.1;
    c.made += w.made;
}

#[test]
fn many_connections_stay_safe_under_a_long_random_run() {
    let target = std::env::var("MWCAP_TORTURE_CALLS").ok().and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let seed = std::env::var("MWCAP_TORTURE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
    let start = std::time::Instant::now();
    let c = torture(target, 8, seed);
    println!(
        "torture: seed {seed:#x}: {} delivered calls of {} made ({} failed; {} tried), {} steps, {} \
         connections, {} faults injected, in {:?}",
        c.replies,
        c.made,
        c.failed,
        c.calls,
        c.steps,
        c.connections,
        c.faults,
        start.elapsed()
    );
    // Every call made ended, delivered or failed: none was lost.
    assert_eq!(c.replies + c.failed, c.made, "{c:?}");
    assert!(c.faults > 0 && c.connections > 8, "the run injected faults and replaced connections: {c:?}");
}
