//! The engines' deadline sets and lookup indexes, driven directly: the cases
//! where an index could go wrong where the old scans could not — a deadline
//! left behind by a hold or request that ended, several deadlines due at
//! once, a completion looked up by token after its request moved on.

use std::time::Duration;

use mwcap_fallback::{
    Action, BufferId, Client, Config, Event, Message, MsgId, ReadError, ReadToken, Region, Release, Server,
    Verdict,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config() -> Config {
    let mut c = Config::default();
    c.hold_timeout = ms(50);
    c.request_timeout = ms(100);
    c.confirm_timeout = ms(20);
    c
}

fn msg(n: u64) -> MsgId {
    MsgId::from_raw(n)
}

fn sends(actions: Vec<Action>) -> Vec<Message> {
    actions
        .into_iter()
        .map(|a| match a {
            Action::Send(m) => m,
            Action::Read(r) => panic!("unexpected READ {r:?}"),
        })
        .collect()
}

fn actions_of_server(s: &mut Server) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

fn events_of_server(s: &mut Server) -> Vec<Event> {
    std::iter::from_fn(|| s.poll_event()).collect()
}

fn events_of_client(c: &mut Client) -> Vec<Event> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

/// A server with `n` buffers that has been asked for the replies of
/// messages `1..=wanted`.
fn server(n: u32, wanted: u64) -> Server {
    let mut s = Server::new(config());
    for i in 0..n {
        s.add_buffer(Region::new(0x1000 + u64::from(i) * 64, 64, 5));
    }
    for m in 1..=wanted {
        s.handle_message(ms(0), Message::Fetch { msg: msg(m), attempt: 1 });
    }
    let _ = events_of_server(&mut s);
    s
}

/// The (buffer, generation) the server offered for `m`.
fn offered(s: &mut Server, m: MsgId) -> (BufferId, mwcap_fallback::Generation) {
    match sends(actions_of_server(s))[..] {
        [Message::Offer { msg, buffer, generation, .. }] if msg == m => (buffer, generation),
        ref other => panic!("expected one offer for {m:?}, got {other:?}"),
    }
}

/// An offer held for less than `hold_timeout` (a delegation's token ends
/// sooner) ends at its own deadline, and a confirm after it is answered
/// `Reused`; a longer `hold` is cut to `hold_timeout`.
#[test]
fn an_offer_within_a_shorter_hold_ends_with_it() {
    let b = BufferId::from_raw(0);
    let mut s = server(1, 2);
    s.offer_within(ms(0), msg(1), b, 8, ms(20)).unwrap();
    let (_, g) = offered(&mut s, msg(1));
    assert_eq!(s.poll_timeout(), Some(ms(20)));
    s.handle_timeout(ms(20));
    assert_eq!(
        events_of_server(&mut s),
        vec![Event::BufferFree { buffer: b, msg: msg(1), reason: Release::Expired }]
    );
    s.handle_message(ms(21), Message::Confirm { msg: msg(1), buffer: b, generation: g });
    assert!(
        matches!(
            sends(actions_of_server(&mut s))[..],
            [Message::ConfirmReply { verdict: Verdict::Reused, .. }]
        ),
        "a read confirmed after the hold ended is stale"
    );
    s.offer_within(ms(30), msg(2), b, 8, ms(1000)).unwrap();
    let _ = offered(&mut s, msg(2));
    assert_eq!(s.poll_timeout(), Some(ms(80)), "at most hold_timeout (50 ms here)");
}

#[test]
fn a_reoffered_buffer_does_not_inherit_its_old_hold_deadline() {
    let b = BufferId::from_raw(0);
    let mut s = server(1, 2);
    s.offer(ms(0), msg(1), b, 8).unwrap();
    let (_, g) = offered(&mut s, msg(1));
    assert_eq!(s.poll_timeout(), Some(ms(50)));
    s.handle_message(ms(1), Message::Confirm { msg: msg(1), buffer: b, generation: g });
    assert!(matches!(
        sends(actions_of_server(&mut s))[..],
        [Message::ConfirmReply { verdict: Verdict::Intact, .. }]
    ));
    assert_eq!(
        events_of_server(&mut s),
        vec![Event::BufferFree { buffer: b, msg: msg(1), reason: Release::Confirmed }]
    );
    assert_eq!(s.poll_timeout(), None, "a confirmed hold leaves no timer behind");
    // The same buffer, held again later.
    s.offer(ms(30), msg(2), b, 8).unwrap();
    let _ = offered(&mut s, msg(2));
    assert_eq!(s.poll_timeout(), Some(ms(80)));
    s.handle_timeout(ms(50));
    assert!(events_of_server(&mut s).is_empty(), "the first hold's deadline must not free the second");
    assert!(!s.is_buffer_free(b));
    s.handle_timeout(ms(80));
    assert_eq!(
        events_of_server(&mut s),
        vec![Event::BufferFree { buffer: b, msg: msg(2), reason: Release::Expired }]
    );
    assert_eq!(s.poll_timeout(), None);
}

#[test]
fn holds_due_together_expire_in_buffer_order() {
    let mut s = server(4, 4);
    // Buffers 3, 0, 2, 1 offered at 0, 1, 2, 3 ms: deadlines 50..53.
    for (t, (m, b)) in [(1, 3), (2, 0), (3, 2), (4, 1)].into_iter().enumerate() {
        s.offer(ms(t as u64), msg(m), BufferId::from_raw(b), 8).unwrap();
    }
    let _ = actions_of_server(&mut s);
    assert_eq!(s.poll_timeout(), Some(ms(50)));
    // A refusal releases exactly its message's buffer, and its deadline.
    s.handle_message(ms(10), Message::Refuse { msg: msg(1) });
    assert_eq!(
        events_of_server(&mut s),
        vec![Event::BufferFree { buffer: BufferId::from_raw(3), msg: msg(1), reason: Release::Refused }]
    );
    assert_eq!(s.poll_timeout(), Some(ms(51)));
    s.handle_timeout(ms(52));
    let freed: Vec<u32> = events_of_server(&mut s)
        .into_iter()
        .map(|e| match e {
            Event::BufferFree { buffer, reason: Release::Expired, .. } => buffer.raw(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(freed, vec![0, 2], "both due, in buffer order");
    assert_eq!(s.poll_timeout(), Some(ms(53)));
    assert_eq!(s.peer_violations(), 0);
}

/// Direction 2 on the server: `n` requests exposed, message `m` at `m - 1`
/// ms, READs posted; returns their tokens in message order.
fn exposed(s: &mut Server, n: u64) -> Vec<ReadToken> {
    for m in 1..=n {
        s.handle_message(
            ms(m - 1),
            Message::Expose {
                msg: msg(m),
                buffer: BufferId::from_raw(m as u32),
                generation: mwcap_fallback::Generation::from_raw(0),
                region: Region::new(0x9000, 8, 9),
            },
        );
    }
    actions_of_server(s)
        .into_iter()
        .map(|a| match a {
            Action::Read(r) => r.token(),
            Action::Send(m) => panic!("unexpected {m:?}"),
        })
        .collect()
}

#[test]
fn incoming_deadlines_follow_arrivals_and_leave_with_their_requests() {
    let mut s = Server::new(config());
    let tokens = exposed(&mut s, 3);
    // Each is due `confirm_timeout` (20 ms) after it arrived (0, 1 and 2
    // ms), its READ in flight or not.
    assert_eq!(s.poll_timeout(), Some(ms(20)), "msg 1's, while the READs are in flight");
    // Completions out of order: msg 3 at 1 ms, msg 1 at 2 ms, msg 2 at 3 ms.
    for (t, i) in [(1, 2), (2, 0), (3, 1)] {
        s.handle_read_completion(ms(t), tokens[i], true);
    }
    // A repeated completion of a READ that already completed is ignored.
    s.handle_read_completion(ms(4), tokens[0], true);
    let confirms: Vec<u64> = sends(actions_of_server(&mut s))
        .into_iter()
        .map(|m| match m {
            Message::Confirm { msg, .. } => msg.raw(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(confirms, vec![3, 1, 2], "one confirm per READ, as they completed");
    assert_eq!(s.poll_timeout(), Some(ms(20)), "completions move no deadline");
    // msg 1 is answered: its deadline goes with it.
    s.handle_message(
        ms(5),
        Message::ConfirmReply {
            msg: msg(1),
            buffer: BufferId::from_raw(1),
            generation: mwcap_fallback::Generation::from_raw(0),
            verdict: Verdict::Intact,
        },
    );
    assert!(matches!(events_of_server(&mut s)[..], [Event::ReadVerified { .. }]));
    assert_eq!(s.poll_timeout(), Some(ms(21)));
    s.handle_timeout(ms(20));
    assert!(events_of_server(&mut s).is_empty(), "nothing is due before 21 ms");
    // msg 2 (deadline 21) and msg 3 (22) time out in one call, in order.
    s.handle_timeout(ms(30));
    let failed: Vec<u64> = events_of_server(&mut s)
        .into_iter()
        .filter_map(|e| match e {
            Event::ReadFailed { msg, error: ReadError::ConfirmTimedOut } => Some(msg.raw()),
            Event::ReadDiscarded { .. } => None,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(failed, vec![2, 3]);
    assert_eq!(s.poll_timeout(), None);
    assert!(s.is_idle());
}

#[test]
fn client_fetch_deadlines_leave_with_their_fetches() {
    let mut c = Client::new(config());
    let m1 = c.fetch(ms(0), 64).unwrap();
    let m2 = c.fetch(ms(10), 64).unwrap();
    let m3 = c.fetch(ms(20), 64).unwrap();
    let _: Vec<Action> = std::iter::from_fn(|| c.poll_action()).collect();
    assert_eq!(c.poll_timeout(), Some(ms(100)));
    // m1 is offered, read and confirmed; m2 is cancelled while its READ is
    // in flight.
    let region = Region::new(0x1000, 8, 5);
    let g = mwcap_fallback::Generation::from_raw(0);
    for (m, b) in [(m1, 0), (m2, 1)] {
        c.handle_message(
            ms(21),
            Message::Offer { msg: m, buffer: BufferId::from_raw(b), generation: g, region },
        );
    }
    let reads: Vec<ReadToken> = std::iter::from_fn(|| c.poll_action())
        .map(|a| match a {
            Action::Read(r) => r.token(),
            Action::Send(m) => panic!("unexpected {m:?}"),
        })
        .collect();
    c.handle_read_completion(ms(22), reads[0], true);
    let reply = Message::ConfirmReply {
        msg: m1,
        buffer: BufferId::from_raw(0),
        generation: g,
        verdict: Verdict::Intact,
    };
    c.handle_message(ms(23), reply);
    assert!(c.cancel(ms(24), m2));
    assert_eq!(c.poll_timeout(), Some(ms(120)), "only m3's deadline is left");
    // m2's READ completes after the cancel: its destination comes back, and
    // the completion is not taken for another fetch's.
    c.handle_read_completion(ms(25), reads[1], true);
    let ev = events_of_client(&mut c);
    assert!(ev.contains(&Event::ReadDiscarded { token: reads[1] }), "{ev:?}");
    assert!(ev.contains(&Event::ReadFailed { msg: m2, error: ReadError::Cancelled }), "{ev:?}");
    c.handle_timeout(ms(100));
    assert!(events_of_client(&mut c).is_empty(), "m1's old deadline must not fire");
    c.handle_timeout(ms(120));
    assert_eq!(events_of_client(&mut c), vec![Event::ReadFailed { msg: m3, error: ReadError::TimedOut }]);
    assert_eq!(c.poll_timeout(), None);
    assert!(c.is_idle());
    assert_eq!(c.peer_violations(), 0);
}

#[test]
fn client_request_holds_expire_in_buffer_order_after_fetches() {
    let mut c = Client::new(config());
    let b: Vec<BufferId> = (0..3).map(|i| c.add_buffer(Region::new(0x1000 + i * 64, 64, 5))).collect();
    let f = c.fetch(ms(0), 64).unwrap();
    let r2 = c.send_request(ms(1), b[2], 8).unwrap();
    let r0 = c.send_request(ms(2), b[0], 8).unwrap();
    let _: Vec<Action> = std::iter::from_fn(|| c.poll_action()).collect();
    assert_eq!(c.buffer_generation(b[2]), Some(mwcap_fallback::Generation::from_raw(0)));
    c.handle_timeout(ms(150));
    assert_eq!(
        events_of_client(&mut c),
        vec![
            Event::ReadFailed { msg: f, error: ReadError::TimedOut },
            Event::BufferFree { buffer: b[0], msg: r0, reason: Release::Expired },
            Event::BufferFree { buffer: b[2], msg: r2, reason: Release::Expired },
        ]
    );
    assert_eq!(c.poll_timeout(), None);
    assert!(c.is_buffer_free(b[0]) && c.is_buffer_free(b[2]));
}
