//! The client's debug self-check: the model checker and the scripted tests
//! rely on it to notice an index that drifted from the fetches, so it must
//! be live in debug builds and must fire.
// The self-check runs in debug builds only.
#![cfg(debug_assertions)]

use super::*;

fn reading_client() -> (Client, MsgId) {
    let mut c = Client::new(Config::default());
    let msg = c.fetch(Duration::ZERO, 64).unwrap();
    let offer = Message::Offer {
        msg,
        buffer: BufferId::from_raw(0),
        generation: Generation::from_raw(0),
        region: Region::new(0x8000, 16, 0x5e),
    };
    c.handle_message(Duration::ZERO, offer);
    c.check_indexes();
    (c, msg)
}

#[test]
#[should_panic(expected = "fetch deadlines")]
fn check_indexes_notices_a_lost_fetch_deadline() {
    let (mut c, msg) = reading_client();
    c.deadlines.remove(&(Duration::from_secs(10), msg));
    c.check_indexes();
}

#[test]
#[should_panic(expected = "READs by token")]
fn check_indexes_notices_a_read_no_fetch_waits_for() {
    let (mut c, msg) = reading_client();
    c.reading.insert(ReadToken::from_raw(99), msg);
    c.check_indexes();
}
