//! Random schedules over larger worlds than the model checker can exhaust:
//! more windows, buffers and grants, cancels, revocations, peer death, a
//! hostile peer.
//! Each schedule picks one enabled step at a time; the world's ghost checks
//! (no LOCAL_INV of an unbound window, no buffer back while a READ can reach
//! it, no stale read accepted, ...) must stay clean, and once the schedule
//! runs out the world is settled and everything must be home.

mod support;

use mwcap_mw::ReleaseMode;
use proptest::prelude::*;
use support::{Config, World};

fn configs() -> impl Strategy<Value = Config> {
    (
        1u32..4,
        prop_oneof![Just(ReleaseMode::Message), Just(ReleaseMode::Piggyback)],
        0u8..3,
        proptest::option::of(0u32..20),
        any::<bool>(),
        0u8..3,
        2u32..6,
        any::<u64>(),
        0u8..3,
        proptest::bool::weighted(0.2),
    )
        .prop_map(
            |(windows, mode, cancels, peer_death, hostile, foreign, lease, seed, revokes, takes_down)| {
                Config {
                    windows,
                    buffers: windows + 1,
                    dests: windows,
                    grants: 8,
                    grant_until: 20,
                    t_end: 30,
                    lease,
                    margin: 1,
                    mode,
                    cancels,
                    revokes,
                    peer_death,
                    hostile,
                    foreign,
                    seed,
                    lend: None,
                    takes_down,
                }
            },
        )
}

/// `configs()` with the windows lent per grant from a pool of one to one
/// more than the lease slots.
fn lending_configs() -> impl Strategy<Value = Config> {
    (configs(), 0u32..5).prop_map(|(cfg, extra)| {
        let lend = 1 + extra % (cfg.windows + 1);
        Config { lend: Some(lend), ..cfg }
    })
}

/// Choices among the enabled steps (index modulo how many are enabled).
fn schedules() -> impl Strategy<Value = Vec<u16>> {
    proptest::collection::vec(any::<u16>(), 0..400)
}

/// Run `choices` over a world of `cfg`, checking the invariants after
/// every step and once everything has settled.
fn run(cfg: &Config, choices: Vec<u16>) -> Result<(), TestCaseError> {
    let mut w = World::new(cfg);
    let mut steps = Vec::new();
    for c in choices {
        steps.clear();
        w.enabled(cfg, &mut steps);
        if steps.is_empty() {
            break;
        }
        let s = steps[usize::from(c) % steps.len()];
        w.step(cfg, s);
        prop_assert_eq!(&w.violation, &None);
        prop_assert!(w.never_over_invalidated());
        prop_assert!(
            w.windows_accounted(cfg),
            "windows lost or doubled: {:?} {:?} {:?}",
            w.pool,
            w.lent,
            w.retired
        );
        for b in 0..cfg.buffers {
            prop_assert!(!w.bufs[b as usize].home || !w.remote_access_possible(b));
        }
    }
    // Let time run out with every non-fault step taken.
    for _ in 0..200 {
        w.settle(cfg);
        if w.now > cfg.t_end.max(cfg.peer_death.unwrap_or(0)) + cfg.lease {
            break;
        }
        w.now += 1;
    }
    w.settle(cfg);
    prop_assert_eq!(&w.violation, &None);
    prop_assert!(w.all_buffers_home(), "buffers not home: {:?}", w.bufs);
    prop_assert!(w.binds_all_invalidated());
    prop_assert!(w.peer_dead || w.dests.iter().all(|d| d.free));
    prop_assert!(w.windows_accounted(cfg));
    // Lent windows are all back, unless the QP died (then they are retired).
    prop_assert!(w.a_err || w.lent.is_empty(), "windows still lent: {:?}", w.lent);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn random_schedules_keep_the_invariants(cfg in configs(), choices in schedules()) {
        run(&cfg, choices)?;
    }

    #[test]
    fn random_schedules_with_lent_windows_keep_the_invariants(cfg in lending_configs(), choices in schedules()) {
        run(&cfg, choices)?;
    }
}
