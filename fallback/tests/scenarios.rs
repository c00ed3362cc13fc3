//! Scripted sequences over the `Pair` harness: both directions, stale reads,
//! timeouts, cancels, dead peers, replays and forged messages.

mod common;

use common::{config, secs, Pair, Side, BUF_LEN};
use mwcap_fallback::{
    BufferId, Client, Event, Generation, Message, MsgId, ReadError, Region, Release, Server, UsageError,
    Verdict,
};

const B0: BufferId = BufferId::from_raw(0);

fn wanted(events: &[Event]) -> Vec<(MsgId, u32)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::ReplyWanted { msg, attempt } => Some((*msg, *attempt)),
            _ => None,
        })
        .collect()
}

/// Server user: write `data` into buffer 0 and offer it for `msg`.
fn serve(p: &mut Pair, msg: MsgId, data: &[u8]) {
    p.write(Side::Server, B0, data);
    p.server.offer(p.now, msg, B0, data.len() as u32).unwrap();
    p.drive();
}

#[test]
fn direction1_reply_is_read_confirmed_and_delivered() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    assert_eq!(wanted(&p.take_server_events()), vec![(msg, 1)]);
    serve(&mut p, msg, b"hello");
    let ev = p.take_client_events();
    let [Event::ReadVerified { msg: m, token, len }] = ev[..] else { panic!("{ev:?}") };
    assert_eq!((m, len), (msg, 5));
    assert_eq!(p.client_dest[&token], b"hello");
    assert_eq!(
        p.take_server_events(),
        vec![Event::BufferFree { buffer: B0, msg, reason: Release::Confirmed }]
    );
    assert_eq!(p.server.buffer_generation(B0), Some(Generation::from_raw(1)));
    assert!(p.client.is_idle() && p.server.is_idle());
    assert_eq!(p.client.poll_timeout(), None);
}

#[test]
fn direction1_stale_read_is_discarded_and_retried() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    p.hold_reads = true;
    serve(&mut p, msg, b"hello");
    // The hold expires while the READ sits at the responder; the server
    // reuses the buffer; the READ then samples the new bytes.
    p.advance(secs(5));
    assert_eq!(p.take_server_events(), vec![Event::BufferFree { buffer: B0, msg, reason: Release::Expired }]);
    p.write(Side::Server, B0, b"JUNK!");
    p.hold_reads = false;
    p.drive();
    let ev = p.take_client_events();
    let [Event::ReadDiscarded { token }] = ev[..] else { panic!("{ev:?}") };
    assert_eq!(p.client_dest[&token], b"JUNK!");
    assert_eq!(wanted(&p.take_server_events()), vec![(msg, 2)]);
    serve(&mut p, msg, b"hello");
    let ev = p.take_client_events();
    let [Event::ReadVerified { msg: m, token, .. }] = ev[..] else { panic!("{ev:?}") };
    assert_eq!(m, msg);
    assert_eq!(p.client_dest[&token], b"hello");
    assert!(p.client.is_idle() && p.server.is_idle());
}

#[test]
fn direction1_late_confirm_after_hold_timeout_gets_reused() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    serve_held_confirm(&mut p, msg);
    p.advance(secs(5)); // hold timeout: buffer back, generation 1
    p.hold_to_server = false;
    p.drive();
    let ev = p.take_client_events();
    assert!(matches!(ev[..], [Event::ReadDiscarded { .. }]), "{ev:?}");
    let sev = p.take_server_events();
    assert_eq!(sev[0], Event::BufferFree { buffer: B0, msg, reason: Release::Expired });
    assert_eq!(wanted(&sev), vec![(msg, 2)]);
}

/// Offers, lets the READ complete, but holds the client's confirm.
fn serve_held_confirm(p: &mut Pair, msg: MsgId) {
    p.write(Side::Server, B0, b"hello");
    p.server.offer(p.now, msg, B0, 5).unwrap();
    p.hold_to_server = true;
    p.drive();
    assert_eq!(p.to_server.len(), 1);
}

#[test]
fn direction1_gives_up_after_max_attempts_stale_reads() {
    let mut c = config();
    c.max_attempts = 2;
    let mut p = Pair::new(c, 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    for attempt in 1..=2 {
        assert_eq!(wanted(&p.take_server_events()), vec![(msg, attempt)]);
        serve_held_confirm(&mut p, msg);
        p.advance(secs(5));
        p.hold_to_server = false;
        p.drive();
    }
    let ev = p.take_client_events();
    assert!(!ev.iter().any(|e| matches!(e, Event::ReadVerified { .. })), "{ev:?}");
    assert_eq!(ev.iter().filter(|e| matches!(e, Event::ReadDiscarded { .. })).count(), 2);
    assert_eq!(
        *ev.last().unwrap(),
        Event::ReadFailed { msg, error: ReadError::StaleRetriesExhausted { attempts: 2 } }
    );
    assert!(p.client.is_idle());
    assert!(ReadError::StaleRetriesExhausted { attempts: 2 }.to_string().contains("raise hold_timeout"));
}

#[test]
fn direction1_dead_server_fails_the_fetch_at_its_deadline() {
    let mut p = Pair::new(config(), 1);
    p.server_dead = true;
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    assert_eq!(p.client.poll_timeout(), Some(secs(20)));
    p.advance(secs(19));
    assert!(p.take_client_events().is_empty());
    p.advance(secs(1));
    assert_eq!(p.take_client_events(), vec![Event::ReadFailed { msg, error: ReadError::TimedOut }]);
    assert!(p.client.is_idle());
}

#[test]
fn direction1_dead_client_buffer_returns_via_hold_timeout() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    p.client_dead = true;
    serve(&mut p, msg, b"hello");
    assert!(!p.server.is_buffer_free(B0));
    assert_eq!(p.server.offer(p.now, msg, B0, 1), Err(UsageError::NotWanted(msg)));
    p.advance(secs(5));
    assert_eq!(p.take_server_events(), vec![Event::BufferFree { buffer: B0, msg, reason: Release::Expired }]);
    assert!(p.server.is_idle());
}

#[test]
fn direction1_cancel_with_read_in_flight_frees_the_destination_only_on_completion() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    p.hold_reads = true;
    serve(&mut p, msg, b"hello");
    assert!(p.client.cancel(p.now, msg));
    assert!(!p.client.cancel(p.now, msg));
    p.drive();
    assert_eq!(p.take_client_events(), vec![Event::ReadFailed { msg, error: ReadError::Cancelled }]);
    assert!(!p.client.is_idle(), "the READ still owns its destination");
    p.hold_reads = false;
    p.drive();
    let ev = p.take_client_events();
    assert!(matches!(ev[..], [Event::ReadDiscarded { .. }]), "{ev:?}");
    assert!(p.client.is_idle());
    // No confirm was sent, but the cancel's Refuse released the server's
    // buffer at once, without waiting for its hold timeout.
    assert_eq!(p.take_server_events(), vec![Event::BufferFree { buffer: B0, msg, reason: Release::Refused }]);
    assert!(p.server.is_idle());
    assert_eq!(p.server.peer_violations(), 0);
}

#[test]
fn direction1_cancel_before_the_offer_withdraws_the_wanted_reply() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    assert_eq!(wanted(&p.take_server_events()), vec![(msg, 1)]);
    assert!(p.client.cancel(p.now, msg));
    p.drive();
    // The server user's offer now finds nothing to answer; the buffer stays free.
    assert_eq!(p.server.offer(p.now, msg, B0, 1), Err(UsageError::NotWanted(msg)));
    assert!(p.server.is_buffer_free(B0));
    assert!(p.server.is_idle());
    assert_eq!((p.server.peer_violations(), p.client.peer_violations()), (0, 0));
}

#[test]
fn direction1_a_refuse_never_asked_for_is_a_violation() {
    let mut p = Pair::new(config(), 1);
    p.server.handle_message(p.now, Message::Refuse { msg: MsgId::from_raw(99) });
    assert_eq!(p.server.peer_violations(), 1);
}

#[test]
fn direction1_refuse_and_too_long_offer_fail_the_fetch() {
    let mut p = Pair::new(config(), 1);
    let m1 = p.client.fetch(p.now, BUF_LEN).unwrap();
    let m2 = p.client.fetch(p.now, 4).unwrap();
    p.drive();
    assert_eq!(wanted(&p.take_server_events()), vec![(m1, 1), (m2, 1)]);
    p.server.refuse(p.now, m1).unwrap();
    assert_eq!(p.server.refuse(p.now, m1), Err(UsageError::NotWanted(m1)));
    serve(&mut p, m2, b"hello");
    assert_eq!(
        p.take_client_events(),
        vec![
            Event::ReadFailed { msg: m1, error: ReadError::Refused },
            Event::ReadFailed { msg: m2, error: ReadError::TooLong { offered: 5, limit: 4 } },
        ]
    );
    assert!(p.client.is_idle());
}

#[test]
fn direction2_request_is_read_confirmed_and_processed() {
    let mut p = Pair::new(config(), 1);
    p.write(Side::Client, B0, b"request");
    let msg = p.client.send_request(p.now, B0, 7).unwrap();
    assert_eq!(p.client.send_request(p.now, B0, 7), Err(UsageError::BufferBusy(B0)));
    p.drive();
    let ev = p.take_server_events();
    let [Event::ReadVerified { msg: m, token, len: 7 }] = ev[..] else { panic!("{ev:?}") };
    assert_eq!(m, msg);
    assert_eq!(p.server_dest[&token], b"request");
    assert_eq!(
        p.take_client_events(),
        vec![Event::BufferFree { buffer: B0, msg, reason: Release::Confirmed }]
    );
    assert!(p.client.is_idle() && p.server.is_idle());
}

#[test]
fn direction2_cancel_during_read_is_never_processed() {
    let mut p = Pair::new(config(), 1);
    p.write(Side::Client, B0, b"request");
    let msg = p.client.send_request(p.now, B0, 7).unwrap();
    p.hold_reads = true;
    p.drive();
    assert!(p.client.cancel(p.now, msg));
    p.drive();
    assert_eq!(
        p.take_client_events(),
        vec![Event::BufferFree { buffer: B0, msg, reason: Release::Cancelled }]
    );
    p.write(Side::Client, B0, b"another");
    p.hold_reads = false;
    p.drive();
    let ev = p.take_server_events();
    let [Event::ReadDiscarded { token }, Event::ReadFailed { msg: m, error: ReadError::Withdrawn }] = ev[..]
    else {
        panic!("{ev:?}")
    };
    assert_eq!(m, msg);
    assert_eq!(p.server_dest[&token], b"another");
    assert!(p.client.is_idle() && p.server.is_idle());
}

#[test]
fn direction2_unanswered_confirm_and_request_both_time_out() {
    let mut p = Pair::new(config(), 1);
    p.write(Side::Client, B0, b"request");
    let msg = p.client.send_request(p.now, B0, 7).unwrap();
    p.hold_to_client = true; // the server's confirm is slow
    p.drive();
    p.advance(secs(4));
    assert!(p.take_server_events().is_empty());
    p.advance(secs(1)); // the server's confirm_timeout (5 s)
    let sev = p.take_server_events();
    assert!(matches!(sev[..], [_, Event::ReadFailed { error: ReadError::ConfirmTimedOut, .. }]), "{sev:?}");
    assert!(p.take_client_events().is_empty());
    p.advance(secs(15)); // the client's request_timeout (20 s)
    assert_eq!(p.take_client_events(), vec![Event::BufferFree { buffer: B0, msg, reason: Release::Expired }]);
    // The confirm finally arrives: the client has forgotten the request.
    p.hold_to_client = false;
    p.drive();
    assert!(p.client.is_idle() && p.server.is_idle());
    assert_eq!(p.server.peer_violations(), 1, "a verdict nobody waits for is ignored");
}

#[test]
fn direction2_dead_client_request_ends_by_confirm_timeout() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.send_request(p.now, B0, 3).unwrap();
    p.client_dead = true;
    p.drive();
    assert_eq!(p.server.poll_timeout(), Some(secs(5)));
    p.advance(secs(5));
    let ev = p.take_server_events();
    assert!(
        matches!(ev[..], [Event::ReadDiscarded { .. }, Event::ReadFailed { error: ReadError::ConfirmTimedOut, msg: m }] if m == msg)
    );
    assert!(p.server.is_idle());
}

#[test]
fn replayed_and_forged_confirms_never_get_intact() {
    let mut p = Pair::new(config(), 1);
    p.write(Side::Client, B0, b"req");
    let msg = p.client.send_request(p.now, B0, 3).unwrap();
    p.drive();
    let (buffer, generation) = (B0, Generation::from_raw(0));
    let confirm = Message::Confirm { msg, buffer, generation };
    let answer = |c: &mut Client, m: Message| {
        c.handle_message(secs(0), m);
        let a = c.poll_action();
        match a {
            Some(mwcap_fallback::Action::Send(Message::ConfirmReply { verdict, .. })) => verdict,
            other => panic!("{other:?}"),
        }
    };
    // Already answered Intact (buffer released): a replay gets Reused.
    assert_eq!(answer(&mut p.client, confirm), Verdict::Reused);
    // Re-expose the same buffer (generation 1) for a new request.
    let msg2 = p.client.send_request(p.now, B0, 3).unwrap();
    let _ = p.client.poll_action();
    let g1 = Generation::from_raw(1);
    // Wrong msg at the live generation, future generation, unknown buffer.
    assert_eq!(answer(&mut p.client, Message::Confirm { msg, buffer, generation: g1 }), Verdict::Unknown);
    let g2 = Generation::from_raw(2);
    assert_eq!(
        answer(&mut p.client, Message::Confirm { msg: msg2, buffer, generation: g2 }),
        Verdict::Unknown
    );
    let b9 = BufferId::from_raw(9);
    assert_eq!(
        answer(&mut p.client, Message::Confirm { msg: msg2, buffer: b9, generation: g1 }),
        Verdict::Unknown
    );
    // The same ids on another connection match nothing there.
    let mut other = Client::new(config());
    other.add_buffer(Region::new(0, 16, 1));
    assert_eq!(answer(&mut other, Message::Confirm { msg: msg2, buffer, generation: g1 }), Verdict::Unknown);
    // The live request is untouched by all that and still confirms once.
    assert!(!p.client.is_buffer_free(B0));
    assert_eq!(
        answer(&mut p.client, Message::Confirm { msg: msg2, buffer, generation: g1 }),
        Verdict::Intact
    );
    assert_eq!(
        answer(&mut p.client, Message::Confirm { msg: msg2, buffer, generation: g1 }),
        Verdict::Reused
    );
}

#[test]
fn forged_verdicts_and_offers_are_ignored() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    p.hold_to_server = true;
    serve(&mut p, msg, b"hello"); // READ done, confirm held
    let g = Generation::from_raw(0);
    // An Intact verdict for the wrong generation or buffer is not the answer.
    for (buffer, generation) in [(B0, Generation::from_raw(1)), (BufferId::from_raw(1), g)] {
        p.client.handle_message(
            p.now,
            Message::ConfirmReply { msg, buffer, generation, verdict: Verdict::Intact },
        );
    }
    // A second offer for a fetch that already has one.
    let region = Region::new(0x8000, 5, 0x5e);
    p.client.handle_message(p.now, Message::Offer { msg, buffer: B0, generation: g, region });
    p.drive();
    assert!(p.take_client_events().is_empty());
    assert_eq!(p.client.peer_violations(), 3);
    p.hold_to_server = false;
    p.drive();
    assert!(matches!(p.take_client_events()[..], [Event::ReadVerified { .. }]));
}

#[test]
fn server_enforces_message_id_rules() {
    let mut s = Server::new(config());
    let fetch = |msg, attempt| Message::Fetch { msg: MsgId::from_raw(msg), attempt };
    s.handle_message(secs(0), fetch(5, 1));
    assert_eq!(s.poll_event(), Some(Event::ReplyWanted { msg: MsgId::from_raw(5), attempt: 1 }));
    for bad in [fetch(5, 1), fetch(4, 1), fetch(5, 2), fetch(6, 2), fetch(3, 4), fetch(0, 2), fetch(7, 0)] {
        s.handle_message(secs(0), bad);
    }
    let region = Region::new(0, 4, 1);
    let (buffer, generation) = (B0, Generation::from_raw(0));
    s.handle_message(secs(0), Message::Expose { msg: MsgId::from_raw(5), buffer, generation, region });
    assert_eq!(s.poll_event(), None);
    assert_eq!(s.poll_action(), None);
    assert_eq!(s.peer_violations(), 8);
    // A retry of a known id, once its earlier round is over, is accepted.
    s.handle_message(secs(0), fetch(3, 2));
    assert_eq!(s.poll_event(), Some(Event::ReplyWanted { msg: MsgId::from_raw(3), attempt: 2 }));
}

#[test]
fn server_refuses_beyond_its_limits() {
    let mut c = config();
    c.max_outstanding = 1;
    c.max_read_len = 8;
    let mut s = Server::new(c);
    let region = Region::new(0, 9, 1);
    let (buffer, generation) = (B0, Generation::from_raw(0));
    s.handle_message(secs(0), Message::Expose { msg: MsgId::from_raw(1), buffer, generation, region });
    assert_eq!(
        s.poll_action(),
        Some(mwcap_fallback::Action::Send(Message::Refuse { msg: MsgId::from_raw(1) }))
    );
    s.handle_message(secs(0), Message::Fetch { msg: MsgId::from_raw(2), attempt: 1 });
    s.handle_message(secs(0), Message::Fetch { msg: MsgId::from_raw(3), attempt: 1 });
    assert_eq!(
        s.poll_action(),
        Some(mwcap_fallback::Action::Send(Message::Refuse { msg: MsgId::from_raw(3) }))
    );
}

#[test]
fn refused_request_returns_the_client_buffer() {
    let mut c = config();
    c.max_read_len = 2;
    let mut p = Pair::new(c, 1);
    let msg = p.client.send_request(p.now, B0, 3).unwrap();
    p.drive();
    assert_eq!(p.take_client_events(), vec![Event::BufferFree { buffer: B0, msg, reason: Release::Refused }]);
    assert!(p.client.is_idle() && p.server.is_idle());
}

#[test]
fn connection_loss_fails_everything_and_waits_for_flushes() {
    let mut p = Pair::new(config(), 2);
    let fetch = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    p.hold_reads = true;
    serve(&mut p, fetch, b"hello");
    let req = p.client.send_request(p.now, BufferId::from_raw(1), 4).unwrap();
    p.drive();
    assert_eq!(p.reads.len(), 2);
    p.client.handle_connection_lost(p.now);
    p.server.handle_connection_lost(p.now);
    p.drive();
    assert_eq!(
        p.take_client_events(),
        vec![
            Event::ReadFailed { msg: fetch, error: ReadError::ConnectionLost },
            Event::BufferFree { buffer: BufferId::from_raw(1), msg: req, reason: Release::ConnectionLost },
        ]
    );
    let sev = p.take_server_events();
    assert_eq!(sev.len(), 2, "{sev:?}");
    assert!(sev.contains(&Event::BufferFree { buffer: B0, msg: fetch, reason: Release::ConnectionLost }));
    assert!(!p.client.is_idle() && !p.server.is_idle(), "READ destinations still belong to the NIC");
    assert_eq!(p.client.fetch(p.now, 1), Err(UsageError::ConnectionLost));
    // The flushes arrive.
    for r in std::mem::take(&mut p.reads) {
        match r.reader {
            Side::Client => p.client.handle_read_completion(p.now, r.token, false),
            Side::Server => p.server.handle_read_completion(p.now, r.token, false),
        }
    }
    p.drive();
    assert!(matches!(p.take_client_events()[..], [Event::ReadDiscarded { .. }]));
    assert!(matches!(p.take_server_events()[..], [Event::ReadDiscarded { .. }]));
    assert!(p.client.is_idle() && p.server.is_idle());
}

#[test]
fn failed_read_completion_fails_the_request_and_frees_the_destination() {
    let mut p = Pair::new(config(), 1);
    let msg = p.client.fetch(p.now, BUF_LEN).unwrap();
    p.drive();
    let _ = p.take_server_events();
    p.hold_reads = true;
    serve(&mut p, msg, b"x");
    let r = p.reads.pop().unwrap();
    p.client.handle_read_completion(p.now, r.token, false);
    p.drive();
    assert_eq!(
        p.take_client_events(),
        vec![
            Event::ReadDiscarded { token: r.token },
            Event::ReadFailed { msg, error: ReadError::ReadFailed }
        ]
    );
}

#[test]
fn usage_errors_are_reported() {
    let mut p = Pair::new(config(), 1);
    let b9 = BufferId::from_raw(9);
    assert_eq!(p.client.send_request(p.now, b9, 1), Err(UsageError::UnknownBuffer(b9)));
    assert_eq!(
        p.client.send_request(p.now, B0, BUF_LEN + 1),
        Err(UsageError::TooLong { len: BUF_LEN + 1, capacity: BUF_LEN })
    );
    // Failed calls consume no message id.
    assert_eq!(p.client.fetch(p.now, 1), Ok(MsgId::from_raw(1)));
    assert!(UsageError::BufferBusy(B0).to_string().contains("wait for its BufferFree"));
}

#[test]
fn direction2_request_timed_out_during_read_answers_reused() {
    let mut c = config();
    c.confirm_timeout = secs(60);
    let mut p = Pair::new(c, 1);
    p.write(Side::Client, B0, b"request");
    let msg = p.client.send_request(p.now, B0, 7).unwrap();
    p.hold_reads = true;
    p.drive();
    p.advance(secs(20));
    assert_eq!(p.take_client_events(), vec![Event::BufferFree { buffer: B0, msg, reason: Release::Expired }]);
    p.hold_reads = false;
    p.drive();
    let ev = p.take_server_events();
    assert!(matches!(
        ev[..],
        [Event::ReadDiscarded { .. }, Event::ReadFailed { error: ReadError::Withdrawn, .. }]
    ));
    assert!(p.client.is_idle() && p.server.is_idle());
}
