//! Exhaustive model checking (stateright) of the MW lease protocol.
//!
//! The state is `support::World`: the real `Owner` and `Reader` engines as
//! the two actors' state, a NIC model per host (windows unbound / bound(rkey)
//! / invalid, send and completion queues, the READ responder, READs in
//! flight), an RC channel with delay per direction, and a virtual clock whose
//! ticks interleave freely with every other step (so every timer fires
//! nondeterministically, but never before its deadline). Every interleaving of
//! the enabled steps is explored, for both directions:
//!
//! - server-owned reply data: the reader releases with a message;
//! - client-owned request data: the reader's response carries the release.
//!
//! Run with `cargo test --release -p mwcap-mw --test model -- --nocapture`
//! to see the number of states explored.

mod support;

use std::time::Instant;

use mwcap_mw::ReleaseMode;
use stateright::{Checker, Model, Property};
use support::{Config, Step, World};

struct LeaseModel {
    cfg: Config,
}

impl LeaseModel {
    fn quiescent(&self, s: &World) -> bool {
        let mut steps = Vec::new();
        s.enabled(&self.cfg, &mut steps);
        steps.is_empty()
    }
}

impl Model for LeaseModel {
    type State = World;
    type Action = Step;

    fn init_states(&self) -> Vec<World> {
        vec![World::new(&self.cfg)]
    }

    fn actions(&self, state: &World, actions: &mut Vec<Step>) {
        // A violation ends the path: the checker reports it.
        if state.violation.is_none() {
            state.enabled(&self.cfg, actions);
        }
    }

    fn next_state(&self, last: &World, action: Step) -> Option<World> {
        let mut next = last.clone();
        next.step(&self.cfg, action);
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            // Recorded by the NIC model and the drivers as they happen:
            // LOCAL_INV of an unbound or already invalid window, a rebind of a
            // bound window, a buffer returned while a READ can reach it, a
            // destination handed back while a READ can write it, a stale read
            // accepted.
            Property::always("no protocol violation", |_, s: &World| s.violation.is_none()),
            Property::always("no buffer reused while remote access is possible", |_, s: &World| {
                s.bufs.iter().enumerate().all(|(b, buf)| !buf.home || !s.remote_access_possible(b as u32))
            }),
            Property::always("no window invalidated more often than bound", |_, s: &World| {
                s.never_over_invalidated()
            }),
            Property::always(
                "at rest every bind was invalidated once, or its QP died",
                |m: &LeaseModel, s| !m.quiescent(s) || s.binds_all_invalidated(),
            ),
            Property::always("at rest every buffer and destination is home", |m: &LeaseModel, s| {
                !m.quiescent(s) || (s.all_buffers_home() && (s.peer_dead || s.dests.iter().all(|d| d.free)))
            }),
            Property::eventually("every buffer returns", |m: &LeaseModel, s: &World| {
                let done_granting = s.grants_left == 0 || s.now > m.cfg.grant_until;
                done_granting && s.all_buffers_home()
            }),
            // Lending (`Config::lend`): the checks of `World::window_back`
            // (a window goes back unbound, invalidated once, unused by this
            // QP) are violations above; here, no window is lost or doubled,
            // and at rest every one is back unless the QP died.
            Property::always("every window is in the pool, lent or retired", |m: &LeaseModel, s: &World| {
                s.windows_accounted(&m.cfg)
            }),
            Property::always("at rest every lent window is back, or its QP died", |m: &LeaseModel, s| {
                !m.quiescent(s) || s.a_err || s.lent.is_empty()
            }),
            // Sanity: the interesting paths are reachable.
            Property::sometimes("a read completes", |_, s: &World| s.reader.stats().reads_done > 0),
            // With revocations (`Config::revokes`; trivially met without):
            // one that finds its lease live, and so invalidates it, happens.
            Property::sometimes("a revocation ends a live lease", |m: &LeaseModel, s: &World| {
                m.cfg.revokes == 0 || s.owner.stats().revoked > 0
            }),
            // With a foreign invalidation (`Config::foreign`; trivially met
            // without): the owner is told of it, and the race rxe leaves
            // open is reachable (see `invalidation_from_another_connection`).
            Property::sometimes(
                "the owner is told of a foreign invalidation",
                |m: &LeaseModel, s: &World| m.cfg.foreign == 0 || s.foreign_told > 0,
            ),
            Property::sometimes(
                "a LOCAL_INV posted before the owner was told meets the invalidated window",
                |m: &LeaseModel, s: &World| m.cfg.foreign == 0 || s.peer_caused_double_inv > 0,
            ),
        ]
    }
}

/// Debug builds (a plain `cargo test`) check each configuration with one
/// tick less of clock and one grant fewer where it has two, to stay fast;
/// release builds (`.ci/run`) check them in full.
fn shrink_in_debug(mut cfg: Config) -> Config {
    if cfg!(debug_assertions) {
        cfg.t_end -= 1;
        cfg.grant_until = cfg.grant_until.min(cfg.t_end);
        if cfg.grants > 1 && cfg.windows > 1 {
            cfg.grants -= 1;
        }
    }
    cfg
}

fn check(name: &str, cfg: Config) -> usize {
    let cfg = shrink_in_debug(cfg);
    let started = Instant::now();
    let model = LeaseModel { cfg };
    let checker = model.checker().threads(1).spawn_bfs().join();
    checker.assert_properties();
    let states = checker.unique_state_count();
    println!(
        "model {name}: {states} unique states ({} generated) in {:.1?}",
        checker.state_count(),
        started.elapsed()
    );
    assert!(states > 500, "the model explored suspiciously few states ({states})");
    states
}

#[test]
fn server_owned_reply_data() {
    check("server-owned (release message)", Config::small(ReleaseMode::Message));
}

#[test]
fn client_owned_request_data_with_cancel() {
    let cfg = Config { cancels: 1, ..Config::small(ReleaseMode::Piggyback) };
    check("client-owned (release in response, cancel)", cfg);
}

/// The owner's user revokes a lease at any point of its life (a delegated
/// capability taken back, issue 20): its window is invalidated once, now,
/// whatever the peer is doing (reading, releasing, racing the expiry), and
/// its buffer comes back only on the invalidation's completion. Every
/// property above holds; a revocation that finds the lease live is
/// reachable.
#[test]
fn the_owner_revokes_a_lease() {
    for mode in [ReleaseMode::Message, ReleaseMode::Piggyback] {
        let cfg = Config { revokes: 1, ..Config::small(mode) };
        check(&format!("owner revokes ({mode:?})"), cfg);
    }
}

#[test]
fn peer_dies_every_buffer_returns() {
    for mode in [ReleaseMode::Message, ReleaseMode::Piggyback] {
        let cfg = Config { peer_death: Some(5), t_end: 7, ..Config::small(mode) };
        check(&format!("peer dies ({mode:?})"), cfg);
    }
}

#[test]
fn hostile_peer_send_with_invalidate() {
    let cfg = Config { hostile: true, grants: 1, ..Config::small(ReleaseMode::Message) };
    check("hostile peer (SEND_WITH_INV)", cfg);
}

#[test]
fn one_window_rebound_with_late_reads() {
    // One window reused for two leases, with a lease barely above the
    // margin: late READs, expiry racing release, flushes.
    let cfg = Config {
        windows: 1,
        buffers: 2,
        grants: 2,
        grant_until: 4,
        t_end: 9,
        lease: 2,
        margin: 1,
        ..Config::small(ReleaseMode::Message)
    };
    check("one window, short leases", cfg);
}

#[test]
fn lent_windows_come_back_unbound() {
    // Two lease slots sharing one window of a pool: the second grant waits
    // for it to come back and binds it again.
    let cfg = Config { lend: Some(1), grant_until: 3, t_end: 8, ..Config::small(ReleaseMode::Message) };
    check("lent windows, one for two slots", cfg);
}

#[test]
fn lent_windows_retire_with_a_dead_peer() {
    // Two windows lent and swapped between slots; the peer may die (the
    // windows still lent are retired, never handed back) or cancel.
    let cfg =
        Config { lend: Some(2), peer_death: Some(5), cancels: 1, ..Config::small(ReleaseMode::Piggyback) };
    check("lent windows, peer dies", cfg);
}

/// The owner's driver takes the connection down while the QP stays up
/// (its move to ERR failed: `Owner::handle_connection_lost`, no ERR
/// evidence), at any point, and destroys the QP later. No buffer comes
/// back while a window over it is bound on the live QP or a READ of it is
/// being served; once the QP is destroyed every one does.
#[test]
fn the_owner_takes_the_connection_down_without_err_evidence() {
    for mode in [ReleaseMode::Message, ReleaseMode::Piggyback] {
        let cfg = Config { takes_down: true, ..Config::small(mode) };
        check(&format!("owner takes down, its QP up until destroyed ({mode:?})"), cfg);
    }
    // And a window invalidated through another connection meanwhile: the
    // owner asks again for the flush a LOCAL_INV posted before must not
    // outrun.
    let cfg = Config { takes_down: true, foreign: 1, grants: 1, ..Config::small(ReleaseMode::Message) };
    check("owner takes down, then a foreign SEND_WITH_INV (release message)", cfg);
}

/// Issue 19, finding 5: a peer of *another* connection of the device
/// invalidates one of this owner's windows (rxe scopes a SEND_WITH_INV to
/// neither the QP nor the PD), and the endpoint tells the owner only when
/// it polls that other connection's receive. Every property above holds:
/// no buffer is reused while reachable, and once told the owner never
/// posts the window's LOCAL_INV (the connection goes down, its buffers and
/// windows come back at the QP's destroy or are retired). What the model also
/// finds, and why mw on rxe is served only to trusted peers
/// (`ProbeReport::mw_safe_with_untrusted_peers`): a LOCAL_INV the owner
/// posted *before* it was told can meet the window the attacker
/// invalidated, the double invalidation that panics rxe (the two
/// "sometimes" properties that only foreign configurations need).
#[test]
fn invalidation_from_another_connection() {
    // Two windows invalidated (reported in order, each once), then one
    // with lent windows.
    check(
        "foreign SEND_WITH_INV of any bound window, twice (release message)",
        Config { foreign: 2, ..Config::small(ReleaseMode::Message) },
    );
    let lent = Config { foreign: 1, lend: Some(2), ..Config::small(ReleaseMode::Piggyback) };
    check("foreign SEND_WITH_INV (lent windows, piggyback)", lent);
}
