//! proptest: pairs of endpoints (and so pairs of engines) over the simulated
//! NIC under random schedules — calls, replies, cancels, clock jumps past
//! lease expiries, link delays, lost packets (a link that drops everything
//! for up to 16 ms: resent within the transport's retries, or the
//! connection lost), QP errors and the death of the server —
//! with the safety invariants checked through the sim's oracle after every
//! step:
//!
//! 1. no buffer is reused while the peer can reach it: every byte of the
//!    owner's data region outside the buffers it has exposed is unreachable
//!    by the peer's QP (mw policy: the oracle's view of windows);
//! 2. no READ is in flight into a buffer the user holds;
//! 3. no invalidation of an unbound or already invalidated window (the rxe
//!    kernel crash), and no DMA into freed memory;
//! 4. no stale read is accepted: every payload delivered holds exactly the
//!    bytes its owner wrote before exposing it, although every buffer is
//!    scribbled over the moment it comes back;
//! 5. liveness: after the connection is closed, every buffer given to the
//!    NIC has come back.
//!
//! The second property runs four connections under one interleaved
//! schedule, checks every connection after every step, and adds:
//!
//! 6. a connection no fault was injected into stays up.

mod common;

use common::{Op, World};
use mwcap::conn::{Policies, Policy};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn ops() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (payload_len(), any::<bool>()).prop_map(|(len, payload)| Op::Call { len, payload }),
        6 => (any::<u8>(), payload_len(), any::<bool>()).prop_map(|(pick, len, payload)| Op::Reply { pick, len, payload }),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
        4 => (0u16..3000).prop_map(|ms| Op::Advance { ms }),
        1 => (0u16..1500).prop_map(|ms| Op::LinkDelay { ms }),
        1 => (0u16..16).prop_map(|ms| Op::LinkLoss { ms }),
        1 => any::<bool>().prop_map(|client| Op::QpError { client }),
        1 => Just(Op::KillServer),
    ]
}

/// A random schedule of operations.
fn schedules() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(ops(), 1..40)
}

fn policies() -> impl Strategy<Value = Policies> {
    let p = || prop_oneof![Just(Policy::Mw), Just(Policy::Confirm)];
    (p(), p()).prop_map(|(request, reply)| Policies { request, reply })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 96,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/prop_endpoint.txt"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn endpoints_stay_safe_under_random_schedules(
        policies in policies(),
        seed in any::<u64>(),
        schedule in schedules(),
    ) {
        let mut w = World::new(policies, seed);
        for op in &schedule {
            w.apply(op);
            w.check();
        }
        // Let leases expire and retries run out, then close: everything returns.
        w.finish();
    }
}

/// Inline-sized, standard and large payloads (the world's classes: 8 KiB
/// buffers and two of 64 KiB).
fn payload_len() -> impl Strategy<Value = u16> {
    prop_oneof![4 => 1u16..300, 4 => 300u16..8192, 1 => 8192u16..65535]
}

/// An operation on one of several connections.
fn multi_ops() -> impl Strategy<Value = (usize, Op)> {
    (0usize..CONNS, ops())
}

const CONNS: usize = 4;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/prop_endpoint.txt"))),
        ..ProptestConfig::default()
    })]

    /// Several connections, each with its own policies, under one random
    /// schedule that interleaves their operations and faults (peer deaths
    /// included): after every step every connection's invariants hold, not
    /// only the one operated on, and a connection no fault was injected
    /// into stays up (timeouts and cancels fail calls, never connections).
    #[test]
    fn many_connections_stay_safe_and_unfaulted_ones_stay_up(
        policies in proptest::collection::vec(policies(), CONNS),
        seed in any::<u64>(),
        schedule in proptest::collection::vec(multi_ops(), 1..120),
    ) {
        let mut worlds: Vec<World> =
            policies.iter().enumerate().map(|(i, p)| World::new(*p, seed.wrapping_add(i as u64))).collect();
        let mut faulted = [false; CONNS];
        for (i, op) in &schedule {
            faulted[*i] |=
                matches!(op, Op::LinkDelay { .. } | Op::LinkLoss { .. } | Op::QpError { .. } | Op::KillServer);
            worlds[*i].apply(op);
            for (k, w) in worlds.iter().enumerate() {
                w.check();
                if !faulted[k] {
                    let down = w.p.client.is_down().or(w.p.server.is_down());
                    prop_assert!(down.is_none(), "connection {k} went down with no fault injected: {down:?}");
                }
            }
        }
        for w in &mut worlds {
            w.finish();
        }
    }
}
