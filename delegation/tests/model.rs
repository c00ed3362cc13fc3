//! Exhaustive model checking (stateright) of the delegation book.
//!
//! The state is the real [`Book`] beside a model of what the owner's
//! engines have exposed (a window or an offer per live capability, ended
//! only on evidence), three connections authenticated as "h" (the holder of
//! the root), "d" and "e" (would-be delegates, each of which may also try
//! anything), the tokens sealed so far (which every connection may try, as
//! a hostile one would), and a clock. Every interleaving of delegate (legal
//! and widened or longer), redeem (by anyone), release, revoke (by the
//! owner's application and by a holder), the evidence of an ended
//! exposure, peer death and the clock's ticks is explored, and the model
//! checks what the book promises against what it itself remembers.
//!
//! Run with `cargo test --release -p mwcap-delegation --test model --
//! --nocapture` to see the number of states explored.

mod support;

use std::time::Instant;

use stateright::{Checker, Model, Property};
use support::{Config, Step, World};

struct DelegationModel {
    cfg: Config,
}

impl Model for DelegationModel {
    type State = World;
    type Action = Step;

    fn init_states(&self) -> Vec<World> {
        vec![World::new(&self.cfg)]
    }

    fn actions(&self, s: &World, actions: &mut Vec<Step>) {
        s.enabled(&self.cfg, actions);
    }

    fn next_state(&self, last: &World, action: Step) -> Option<World> {
        let mut next = last.clone();
        next.step(&self.cfg, action);
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            // Recorded as they happen: a token redeemed twice, by the wrong
            // identity, after its expiry, under a revoked capability or
            // after the memory came back; a delegation wider or longer than
            // its parent, or from a revoked one; End twice, or for what is
            // not exposed; the memory back while something is exposed; a
            // legal delegation refused.
            Property::always("no violation", |_, s: &World| s.violation.is_none()),
            // Every expiry is at most the root's, where the clock stops.
            Property::always(
                "once every expiry has passed and every exposure ended, the memory is back",
                |m: &DelegationModel, s: &World| {
                    s.now < m.cfg.t_end || !s.exposed.is_empty() || (s.done && s.book.is_empty())
                },
            ),
            Property::sometimes("a delegate redeems after the holder released", |_, s: &World| {
                s.released_with_token_out
            }),
            Property::sometimes("a delegation of a delegation is redeemed", |_, s: &World| s.second_level),
            Property::sometimes("a live delegation is revoked", |_, s: &World| s.revoked_live),
            Property::sometimes("an expired token is refused", |_, s: &World| s.refused_expired),
        ]
    }
}

/// Debug builds (a plain `cargo test`) delegate to one identity and stop
/// the clock a tick earlier, to stay fast; release builds (`.ci/run`)
/// check the full configuration.
#[test]
fn delegation_model() {
    let cfg = if cfg!(debug_assertions) {
        Config { t_end: 2, tokens: 2, to: &["d"], short: false }
    } else {
        Config { t_end: 4, tokens: 2, to: &["d", "e"], short: true }
    };
    let t0 = Instant::now();
    let checker = DelegationModel { cfg: cfg.clone() }.checker().spawn_bfs().join();
    let states = checker.unique_state_count();
    println!("delegation model {cfg:?}: {states} states in {:.1?}", t0.elapsed());
    checker.assert_properties();
}
