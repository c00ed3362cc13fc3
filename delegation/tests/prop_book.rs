//! Random walks through the delegation model with more than the exhaustive
//! check can hold: up to eight tokens (trees eight deep), twelve ticks, two
//! identities. Each step is one of the steps enabled in the state reached,
//! chosen by proptest (a kind of step by weight, then one of that kind);
//! every step is checked as in `model.rs`, and at the end every exposure
//! left ends and the clock runs out: the memory must then be back and the
//! book empty.

mod support;

use proptest::prelude::*;
use support::{Config, Step, World};

const CFG: Config = Config { t_end: 12, tokens: 8, to: &["d", "e"], short: true };

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_walks_keep_every_promise_and_end_with_the_memory_back(
        choices in proptest::collection::vec((0u32..100, any::<u16>()), 1..300),
    ) {
        let mut seen = Seen::default();
        let mut w = World::new(&CFG);
        let mut steps = Vec::new();
        for c in choices {
            steps.clear();
            w.enabled(&CFG, &mut steps);
            if steps.is_empty() {
                break;
            }
            let (roll, pick) = c;
            let s = choose(&steps, roll, pick);
            w.step(&CFG, s);
            prop_assert!(w.violation.is_none(), "{:?}", w.violation);
        }
        // Every exposure ends on evidence; the clock runs out.
        let live: Vec<_> = w.exposed.keys().copied().collect();
        for cap in live {
            w.step(&CFG, Step::End { cap });
        }
        while w.now < CFG.t_end {
            w.step(&CFG, Step::Tick);
        }
        prop_assert!(w.violation.is_none(), "{:?}", w.violation);
        prop_assert!(w.done && w.book.is_empty(), "not back: {:?}", w.book);
        seen.note(&w);
        SEEN.with(|s| s.borrow_mut().add(seen));
    }
}

/// Weights of the kinds of step, out of 100: mostly delegating and
/// redeeming, so that trees grow deep before they end.
fn choose(steps: &[Step], roll: u32, pick: u16) -> Step {
    let kind = match roll {
        0..=34 => 0,  // delegate
        35..=69 => 1, // redeem
        70..=79 => 2, // end an exposure
        80..=87 => 3, // tick
        88..=93 => 4, // a holder revokes its delegations
        94..=97 => 5, // the owner revokes
        _ => 6,       // a connection dies
    };
    let of_kind: Vec<&Step> = steps
        .iter()
        .filter(|s| {
            kind == match s {
                Step::Delegate { .. } => 0,
                Step::Redeem { .. } => 1,
                Step::End { .. } => 2,
                Step::Tick => 3,
                Step::RevokeDelegations { .. } => 4,
                Step::Revoke { .. } => 5,
                Step::Die { .. } => 6,
            }
        })
        .collect();
    match of_kind.len() {
        0 => steps[pick as usize % steps.len()].clone(),
        n => of_kind[pick as usize % n].clone(),
    }
}

/// What the walks reached, over all cases: the test fails if they never
/// reach the interesting paths (they would check little).
#[derive(Clone, Copy, Default)]
struct Seen {
    cases: u32,
    deep: u32,
    second_level: u32,
    revoked_live: u32,
    refused_expired: u32,
    released_with_token_out: u32,
}

impl Seen {
    fn note(&mut self, w: &World) {
        self.cases = 1;
        self.deep = u32::from(w.tokens.len() >= 4);
        self.second_level = u32::from(w.second_level);
        self.revoked_live = u32::from(w.revoked_live);
        self.refused_expired = u32::from(w.refused_expired);
        self.released_with_token_out = u32::from(w.released_with_token_out);
    }

    fn add(&mut self, o: Seen) {
        self.cases += o.cases;
        self.deep += o.deep;
        self.second_level += o.second_level;
        self.revoked_live += o.revoked_live;
        self.refused_expired += o.refused_expired;
        self.released_with_token_out += o.released_with_token_out;
    }
}

std::thread_local! {
    static SEEN: std::cell::RefCell<Seen> = std::cell::RefCell::new(Seen::default());
}

/// Runs after the walks (the same thread runs the proptest first: this
/// test calls it).
#[test]
fn the_walks_reach_deep_trees_revocations_and_expiries() {
    random_walks_keep_every_promise_and_end_with_the_memory_back();
    let s = SEEN.with(|s| *s.borrow());
    eprintln!(
        "{} walks: {} with 4+ tokens, {} redeemed a delegation of a delegation, {} revoked a live delegation, \
         {} refused an expired token, {} redeemed after the holder released",
        s.cases, s.deep, s.second_level, s.revoked_live, s.refused_expired, s.released_with_token_out
    );
    assert!(s.deep > 0 && s.second_level > 0 && s.revoked_live > 0, "the walks stayed shallow");
    assert!(s.refused_expired > 0 && s.released_with_token_out > 0, "the walks missed expiries or releases");
}
