//! The owner's debug self-check: the model checker and the scripted tests
//! rely on it to notice an index that drifted from the slots, so it must be
//! live in debug builds and must fire.
// The self-check runs in debug builds only.
#![cfg(debug_assertions)]

use super::*;

fn leased_owner() -> Owner {
    let mut o = Owner::new(3, (0..2).map(|i| Window { handle: i, rkey: i << 8 }));
    let buffer = Buffer { mr: 1, offset: 0, len: 8, addr: 0x1000 };
    o.grant(Duration::ZERO, buffer, Duration::from_millis(5)).expect("a free window");
    o.check_indexes();
    o
}

#[test]
#[should_panic(expected = "free list")]
fn check_indexes_notices_a_leased_window_on_the_free_list() {
    let mut o = leased_owner();
    o.free.insert(0);
    o.check_indexes();
}

#[test]
#[should_panic(expected = "expiry timers")]
fn check_indexes_notices_a_lost_expiry_timer() {
    let mut o = leased_owner();
    o.expiries.remove(0);
    o.check_indexes();
}
