//! The server's defensive checks, driven directly with hand-made client
//! messages (no `Pair`): a verdict it never asked for, READ completions out
//! of order or unknown, what `is_idle` counts, and the message-id rules at
//! their edges.

use std::time::Duration;

use mwcap_fallback::{
    Action, BufferId, Config, Event, Generation, Message, MsgId, ReadError, ReadToken, Region, Release,
    Server, UsageError, Verdict,
};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn msg(n: u64) -> MsgId {
    MsgId::from_raw(n)
}

fn buf(n: u32) -> BufferId {
    BufferId::from_raw(n)
}

fn generation(n: u64) -> Generation {
    Generation::from_raw(n)
}

fn server() -> Server {
    let mut s = Server::new(Config::default());
    s.add_buffer(Region::new(0x8000, 64, 0x5e));
    s
}

fn actions(s: &mut Server) -> Vec<Action> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

fn events(s: &mut Server) -> Vec<Event> {
    std::iter::from_fn(|| s.poll_event()).collect()
}

/// The client exposes its buffer `b` at generation `g` for `m`; the READ
/// token the server posts.
fn expose(s: &mut Server, now: Duration, m: u64, b: u32, g: u64) -> ReadToken {
    let region = Region::new(0x1000 + u64::from(b) * 64, 16, 0xc1);
    s.handle_message(now, Message::Expose { msg: msg(m), buffer: buf(b), generation: generation(g), region });
    match actions(s)[..] {
        [Action::Read(r)] => {
            assert_eq!(r.remote(), region);
            r.token()
        }
        ref other => panic!("expected one READ, got {other:?}"),
    }
}

fn confirm(m: u64, b: u32, g: u64) -> Action {
    Action::Send(Message::Confirm { msg: msg(m), buffer: buf(b), generation: generation(g) })
}

fn refuse(m: u64) -> Action {
    Action::Send(Message::Refuse { msg: msg(m) })
}

fn reply(m: u64, b: u32, g: u64, verdict: Verdict) -> Message {
    Message::ConfirmReply { msg: msg(m), buffer: buf(b), generation: generation(g), verdict }
}

#[test]
fn a_verdict_before_the_confirm_was_sent_is_ignored() {
    let mut s = server();
    let t = expose(&mut s, secs(0), 1, 0, 4);
    assert!(!s.is_idle(), "a request is being read");
    // The READ has not completed, so the server has not asked anything: an
    // `Intact` now would vouch for bytes that have not landed.
    s.handle_message(secs(0), reply(1, 0, 4, Verdict::Intact));
    assert_eq!(events(&mut s), vec![], "never verified before the READ completed");
    assert_eq!(s.peer_violations(), 1);
    s.handle_read_completion(secs(1), t, true);
    assert_eq!(actions(&mut s), vec![confirm(1, 0, 4)]);
    s.handle_message(secs(1), reply(1, 0, 4, Verdict::Intact));
    assert_eq!(events(&mut s), vec![Event::ReadVerified { msg: msg(1), token: t, len: 16 }]);
    assert_eq!(s.peer_violations(), 1);
    assert!(s.is_idle());
}

#[test]
fn a_verdict_for_another_exposure_is_ignored() {
    let mut s = server();
    let t = expose(&mut s, secs(0), 1, 0, 4);
    s.handle_read_completion(secs(0), t, true);
    assert_eq!(actions(&mut s), vec![confirm(1, 0, 4)]);
    for wrong in
        [reply(1, 0, 3, Verdict::Intact), reply(1, 1, 4, Verdict::Intact), reply(2, 0, 4, Verdict::Intact)]
    {
        s.handle_message(secs(0), wrong);
    }
    assert_eq!(events(&mut s), vec![]);
    assert_eq!(s.peer_violations(), 3);
    s.handle_message(secs(0), reply(1, 0, 4, Verdict::Reused));
    assert_eq!(
        events(&mut s),
        vec![
            Event::ReadDiscarded { token: t },
            Event::ReadFailed { msg: msg(1), error: ReadError::Withdrawn }
        ]
    );
    // The request is over: its verdict again is unasked for.
    s.handle_message(secs(0), reply(1, 0, 4, Verdict::Intact));
    assert_eq!(events(&mut s), vec![]);
    assert_eq!(s.peer_violations(), 4);
}

#[test]
fn read_completions_are_matched_by_token_not_by_order() {
    let mut s = server();
    let t1 = expose(&mut s, secs(0), 1, 0, 0);
    let t2 = expose(&mut s, secs(0), 2, 1, 0);
    let t3 = expose(&mut s, secs(0), 3, 2, 0);
    assert!(t1 != t2 && t2 != t3 && t1 != t3);
    // The second READ completes first, then the third fails, then the first.
    s.handle_read_completion(secs(1), t2, true);
    assert_eq!(actions(&mut s), vec![confirm(2, 1, 0)]);
    s.handle_read_completion(secs(1), t3, false);
    assert_eq!(actions(&mut s), vec![]);
    assert_eq!(
        events(&mut s),
        vec![
            Event::ReadDiscarded { token: t3 },
            Event::ReadFailed { msg: msg(3), error: ReadError::ReadFailed }
        ]
    );
    // A completion of no READ of this server, and a second one of t2.
    s.handle_read_completion(secs(1), ReadToken::from_raw(99), true);
    s.handle_read_completion(secs(1), t2, true);
    assert_eq!(actions(&mut s), vec![]);
    assert_eq!(events(&mut s), vec![]);
    s.handle_read_completion(secs(2), t1, true);
    assert_eq!(actions(&mut s), vec![confirm(1, 0, 0)]);
    s.handle_message(secs(2), reply(2, 1, 0, Verdict::Intact));
    s.handle_message(secs(2), reply(1, 0, 0, Verdict::Intact));
    assert_eq!(
        events(&mut s),
        vec![
            Event::ReadVerified { msg: msg(2), token: t2, len: 16 },
            Event::ReadVerified { msg: msg(1), token: t1, len: 16 },
        ]
    );
    assert!(s.is_idle());
}

#[test]
fn an_exposure_is_read_and_confirmed_within_confirm_timeout_of_its_arrival() {
    // Issue 19, finding 3: the confirm's deadline started when its READ
    // completed, so exposures whose READs waited for a destination held one
    // `confirm_timeout` each, round after round (a burst of 1,024 on 16
    // buffers: 64 rounds of 5 s). Now each is due `confirm_timeout` (5 s)
    // after it arrived, however long its READ waited.
    let mut s = server();
    let t1 = expose(&mut s, secs(0), 1, 0, 0);
    let t2 = expose(&mut s, secs(1), 2, 1, 0);
    let t3 = expose(&mut s, secs(1), 3, 2, 0);
    assert_eq!(s.poll_timeout(), Some(secs(5)), "msg 1's, while its READ is in flight");
    // msg 2's READ lands at 3 s: its confirm is due at 6 s, not 8 s.
    s.handle_read_completion(secs(3), t2, true);
    assert_eq!(actions(&mut s), vec![confirm(2, 1, 0)]);
    // msg 1's READ has not landed by 5 s: the request ends (the client is
    // told, so that its buffer comes back at once), and the READ's
    // destination comes back with its completion, unconfirmed.
    s.handle_timeout(secs(5));
    assert_eq!(events(&mut s), vec![Event::ReadFailed { msg: msg(1), error: ReadError::ConfirmTimedOut }]);
    assert_eq!(actions(&mut s), vec![refuse(1)]);
    s.handle_read_completion(secs(5), t1, true);
    assert_eq!(actions(&mut s), vec![], "no confirm for a request that is over");
    assert_eq!(events(&mut s), vec![Event::ReadDiscarded { token: t1 }]);
    // msg 2 is never answered, and msg 3's READ never lands: both end at
    // 6 s, msg 2's destination free at once.
    assert_eq!(s.poll_timeout(), Some(secs(6)));
    s.handle_timeout(secs(6));
    assert_eq!(
        events(&mut s),
        vec![
            Event::ReadDiscarded { token: t2 },
            Event::ReadFailed { msg: msg(2), error: ReadError::ConfirmTimedOut },
            Event::ReadFailed { msg: msg(3), error: ReadError::ConfirmTimedOut },
        ]
    );
    assert_eq!(actions(&mut s), vec![refuse(2), refuse(3)]);
    s.handle_read_completion(secs(7), t3, false);
    assert_eq!(events(&mut s), vec![Event::ReadDiscarded { token: t3 }]);
    assert!(s.is_idle());
}

#[test]
fn a_read_never_posted_is_withdrawn_once_its_request_is_over() {
    // A driver with no destination free keeps the READ; once its request
    // ended it asks to forget it rather than READ for nobody.
    let mut s = server();
    let t = expose(&mut s, secs(0), 1, 0, 0);
    assert!(!s.withdraw_read(t), "still wanted");
    assert_eq!(s.read_deadline(t), Some(secs(5)), "its request is due 5 s after it came");
    s.handle_timeout(secs(5));
    assert_eq!(s.read_deadline(t), None);
    assert_eq!(events(&mut s), vec![Event::ReadFailed { msg: msg(1), error: ReadError::ConfirmTimedOut }]);
    assert!(!s.is_idle(), "its READ may be in flight");
    assert!(s.withdraw_read(t));
    assert!(!s.withdraw_read(t), "once");
    assert!(s.is_idle());
}

#[test]
fn a_read_that_lands_past_its_deadline_is_discarded_without_a_confirm() {
    // A driver that hands in the completion before the timeout that was
    // due: the request ends there, nobody is asked.
    let mut s = server();
    let t = expose(&mut s, secs(0), 1, 0, 0);
    s.handle_read_completion(secs(5), t, true);
    assert_eq!(actions(&mut s), vec![refuse(1)], "no confirm: the client is told it is over");
    assert_eq!(
        events(&mut s),
        vec![
            Event::ReadDiscarded { token: t },
            Event::ReadFailed { msg: msg(1), error: ReadError::ConfirmTimedOut }
        ]
    );
    assert!(s.is_idle());
}

#[test]
fn a_held_buffer_keeps_the_server_busy() {
    let mut s = server();
    assert!(s.is_idle());
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    assert_eq!(events(&mut s), vec![Event::ReplyWanted { msg: msg(1), attempt: 1 }]);
    assert!(!s.is_idle(), "a reply is wanted");
    s.offer(secs(0), msg(1), buf(0), 8).unwrap();
    let _ = actions(&mut s);
    assert!(!s.is_buffer_free(buf(0)));
    assert!(!s.is_idle(), "the offered buffer is held for the client's READ");
    assert_eq!(s.poll_timeout(), Some(secs(5)));
    s.handle_timeout(secs(5));
    assert_eq!(
        events(&mut s),
        vec![Event::BufferFree { buffer: buf(0), msg: msg(1), reason: Release::Expired }]
    );
    assert!(s.is_idle());
}

#[test]
fn an_abandoned_read_keeps_the_server_busy_until_its_completion() {
    let mut s = server();
    let t = expose(&mut s, secs(0), 1, 0, 0);
    s.handle_connection_lost(secs(1));
    assert!(s.is_connection_lost());
    assert_eq!(events(&mut s), vec![Event::ReadFailed { msg: msg(1), error: ReadError::ConnectionLost }]);
    assert!(!s.is_idle(), "the READ's destination is still the NIC's");
    s.handle_read_completion(secs(2), t, false);
    assert_eq!(events(&mut s), vec![Event::ReadDiscarded { token: t }]);
    assert!(s.is_idle());
}

#[test]
fn refuses_and_offers_from_the_client_follow_the_message_id_rules() {
    let mut s = server();
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    s.handle_message(secs(0), Message::Fetch { msg: msg(2), attempt: 1 });
    s.handle_message(secs(0), Message::Fetch { msg: msg(3), attempt: 1 });
    let _ = events(&mut s);
    s.offer(secs(0), msg(2), buf(0), 8).unwrap();
    let _ = actions(&mut s);
    // A wanted reply and an offered buffer are given up without complaint.
    s.handle_message(secs(1), Message::Refuse { msg: msg(1) });
    s.handle_message(secs(1), Message::Refuse { msg: msg(2) });
    assert_eq!(
        events(&mut s),
        vec![Event::BufferFree { buffer: buf(0), msg: msg(2), reason: Release::Refused }]
    );
    assert_eq!(s.offer(secs(1), msg(1), buf(0), 8), Err(mwcap_fallback::UsageError::NotWanted(msg(1))));
    // So is a request that is over already (the Refuse crossed its end),
    // up to the newest id seen.
    s.handle_message(secs(1), Message::Refuse { msg: msg(1) });
    assert!(s.refuse(secs(1), msg(3)).is_ok());
    s.handle_message(secs(1), Message::Refuse { msg: msg(3) });
    assert_eq!(s.peer_violations(), 0);
    // Ids never used, and a message only a server sends.
    s.handle_message(secs(1), Message::Refuse { msg: msg(0) });
    s.handle_message(secs(1), Message::Refuse { msg: msg(4) });
    assert_eq!(s.peer_violations(), 2);
    s.handle_message(
        secs(1),
        Message::Offer {
            msg: msg(5),
            buffer: buf(0),
            generation: generation(0),
            region: Region::new(0, 8, 1),
        },
    );
    assert_eq!(s.peer_violations(), 3);
    assert_eq!(events(&mut s), vec![]);
    assert!(s.is_idle());
}

#[test]
fn a_request_of_exactly_max_read_len_is_read() {
    let mut config = Config::default();
    config.max_read_len = 16;
    let mut s = Server::new(config);
    let region = Region::new(0x1000, 16, 0xc1);
    s.handle_message(
        secs(0),
        Message::Expose { msg: msg(1), buffer: buf(0), generation: generation(0), region },
    );
    assert!(matches!(actions(&mut s)[..], [Action::Read(r)] if r.remote() == region));
    let region = Region::new(0x1000, 17, 0xc1);
    s.handle_message(
        secs(0),
        Message::Expose { msg: msg(2), buffer: buf(1), generation: generation(0), region },
    );
    assert_eq!(actions(&mut s), vec![Action::Send(Message::Refuse { msg: msg(2) })]);
}

#[test]
fn is_reading_names_exactly_the_requests_taken() {
    let mut config = Config::default();
    config.max_read_len = 16;
    let mut s = Server::new(config);
    let t = expose(&mut s, secs(0), 5, 0, 0);
    assert!(s.is_reading(msg(5)), "taken: being read");
    // Refused (too long), ignored (an id not above the last), never seen.
    let long = Region::new(0x1000, 17, 0xc1);
    s.handle_message(
        secs(0),
        Message::Expose { msg: msg(6), buffer: buf(1), generation: generation(0), region: long },
    );
    let short = Region::new(0x1000, 8, 0xc1);
    s.handle_message(
        secs(0),
        Message::Expose { msg: msg(4), buffer: buf(1), generation: generation(0), region: short },
    );
    assert!(!s.is_reading(msg(6)) && !s.is_reading(msg(4)) && !s.is_reading(msg(7)));
    // Still taken while its confirm waits for the answer; over after it.
    s.handle_read_completion(secs(0), t, true);
    assert!(s.is_reading(msg(5)));
    s.handle_message(secs(0), reply(5, 0, 0, Verdict::Intact));
    assert!(!s.is_reading(msg(5)));
}

#[test]
fn a_lost_connection_is_reported_and_refuses_new_work() {
    let mut s = server();
    assert!(!s.is_connection_lost());
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    let _ = events(&mut s);
    s.handle_connection_lost(secs(1));
    assert!(s.is_connection_lost());
    assert_eq!(s.offer(secs(1), msg(1), buf(0), 8), Err(mwcap_fallback::UsageError::ConnectionLost));
    s.handle_message(secs(1), Message::Fetch { msg: msg(2), attempt: 1 });
    assert_eq!(events(&mut s), vec![]);
    assert_eq!(actions(&mut s), vec![]);
    assert!(s.is_idle());
}

/// `set_buffer_region` points a free buffer at other memory: the next
/// offer exposes the new range at a new generation. A buffer that is
/// offered, or that does not exist, is refused.
#[test]
fn a_buffer_pointed_at_another_region_offers_that_region() {
    let mut s = server();
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    s.handle_message(secs(0), Message::Fetch { msg: msg(2), attempt: 1 });
    let _ = events(&mut s);
    s.offer(secs(0), msg(1), buf(0), 8).unwrap();
    let old = match actions(&mut s)[..] {
        [Action::Send(Message::Offer { generation, region, .. })] => {
            assert_eq!(region, Region::new(0x8000, 8, 0x5e));
            generation
        }
        ref other => panic!("expected one Offer, got {other:?}"),
    };
    let elsewhere = Region::new(0xa000, 32, 0x6f);
    assert_eq!(s.set_buffer_region(buf(0), elsewhere), Err(UsageError::BufferBusy(buf(0))));
    s.handle_message(secs(1), Message::Refuse { msg: msg(1) });
    let _ = events(&mut s);
    assert!(s.is_buffer_free(buf(0)));
    s.set_buffer_region(buf(0), elsewhere).unwrap();
    s.offer(secs(1), msg(2), buf(0), 8).unwrap();
    match actions(&mut s)[..] {
        [Action::Send(Message::Offer { msg: m, buffer, generation, region })] => {
            assert_eq!((m, buffer), (msg(2), buf(0)));
            assert_eq!(region, Region::new(0xa000, 8, 0x6f), "the new region, not the old one");
            assert_ne!(generation, old, "a confirm of the old region cannot match");
        }
        ref other => panic!("expected one Offer, got {other:?}"),
    }
    assert_eq!(s.set_buffer_region(buf(7), elsewhere), Err(UsageError::UnknownBuffer(buf(7))));
}

/// `has_output` says whether an action or an event waits to be polled,
/// each on its own.
#[test]
fn has_output_counts_actions_and_events_each() {
    let mut s = server();
    assert!(!s.has_output());
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    assert!(s.has_output(), "the ReplyWanted event alone");
    let _ = events(&mut s);
    assert!(!s.has_output());
    s.offer(secs(0), msg(1), buf(0), 8).unwrap();
    assert!(s.has_output(), "an Offer to send");
    let _ = actions(&mut s);
    assert!(!s.has_output());
}

#[test]
fn a_withdrawn_offer_is_free_at_once_and_its_confirm_is_answered_reused() {
    let mut s = server();
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    let _ = events(&mut s);
    assert!(!s.withdraw(secs(0), msg(1)), "wanted, but nothing offered yet");
    s.offer(secs(0), msg(1), buf(0), 8).unwrap();
    let _ = actions(&mut s);
    assert!(s.withdraw_buffer(secs(1), buf(0)));
    assert_eq!(
        events(&mut s),
        vec![Event::BufferFree { buffer: buf(0), msg: msg(1), reason: Release::Withdrawn }]
    );
    assert!(s.is_buffer_free(buf(0)) && s.buffer_generation(buf(0)) == Some(generation(1)));
    assert!(!s.withdraw(secs(1), msg(1)) && !s.withdraw_buffer(secs(1), buf(0)), "once");
    // The client confirms what it read at the offer's generation: reused.
    s.handle_message(secs(1), Message::Confirm { msg: msg(1), buffer: buf(0), generation: generation(0) });
    assert_eq!(actions(&mut s), vec![Action::Send(reply(1, 0, 0, Verdict::Reused))]);
    // It asks again: wanted again, and the buffer may be offered again.
    s.handle_message(secs(1), Message::Fetch { msg: msg(1), attempt: 2 });
    assert_eq!(events(&mut s), vec![Event::ReplyWanted { msg: msg(1), attempt: 2 }]);
    s.offer(secs(1), msg(1), buf(0), 8).unwrap();
}

/// A wanted reply the driver refused by its own means is dropped without a
/// message to the client; it is wanted no more.
#[test]
fn a_wanted_reply_forgotten_sends_nothing_and_is_gone() {
    let mut s = server();
    s.handle_message(secs(0), Message::Fetch { msg: msg(1), attempt: 1 });
    assert_eq!(events(&mut s), vec![Event::ReplyWanted { msg: msg(1), attempt: 1 }]);
    s.forget_wanted(secs(0), msg(1)).unwrap();
    assert_eq!(actions(&mut s), vec![]);
    assert!(s.is_idle());
    assert_eq!(s.forget_wanted(secs(0), msg(1)), Err(UsageError::NotWanted(msg(1))));
    assert!(s.offer(secs(0), msg(1), buf(0), 8).is_err(), "an offer for it is refused");
    assert_eq!(s.peer_violations(), 0);
}
