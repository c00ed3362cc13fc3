//! The reader's debug self-check: it must be live in debug builds and fire
//! when an index drifts from the READ slots.
// The self-check runs in debug builds only.
#![cfg(debug_assertions)]

use super::*;

#[test]
#[should_panic(expected = "READ deadlines")]
fn check_indexes_notices_a_lost_read_deadline() {
    let mut r = Reader::new(ReaderConfig {
        safety_margin: Duration::ZERO,
        release: ReleaseMode::Message,
        max_lease: crate::MAX_LEASE_TIME,
    });
    let grant = Grant {
        lease: LeaseId::from_raw(1),
        addr: 0x1000,
        len: 8,
        rkey: 7,
        time_left: Duration::from_millis(5),
    };
    r.handle_grant(Duration::ZERO, grant, Buffer { mr: 2, offset: 0, len: 8, addr: 0 });
    r.check_indexes();
    r.deadlines.remove(0);
    r.check_indexes();
}
