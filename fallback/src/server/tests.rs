//! The server's debug self-check: it must be live in debug builds and fire
//! when an index drifts from the incoming requests.
// The self-check runs in debug builds only.
#![cfg(debug_assertions)]

use super::*;

fn reading_server() -> (Server, MsgId) {
    let mut s = Server::new(Config::default());
    let msg = MsgId::from_raw(1);
    let expose = Message::Expose {
        msg,
        buffer: BufferId::from_raw(0),
        generation: Generation::from_raw(0),
        region: Region::new(0x1000, 16, 0xc1),
    };
    s.handle_message(Duration::ZERO, expose);
    s.check_indexes();
    (s, msg)
}

#[test]
#[should_panic(expected = "READs by token")]
fn check_indexes_notices_a_read_no_request_waits_for() {
    let (mut s, msg) = reading_server();
    s.reading.insert(ReadToken::from_raw(99), msg);
    s.check_indexes();
}

#[test]
#[should_panic(expected = "deadlines")]
fn check_indexes_notices_a_deadline_of_no_request() {
    let (mut s, msg) = reading_server();
    // Its own deadline is 5 s (confirm_timeout after its arrival at 0).
    s.deadlines.insert((Duration::from_secs(7), msg), ());
    s.check_indexes();
}
