//! The client's defensive checks, driven directly with hand-made server
//! messages (no `Pair`): offers and verdicts it never asked for, which
//! endings tell the server to let go, READ completions out of order, and
//! what `is_idle` counts.

use std::time::Duration;

use mwcap_fallback::{
    Action, BufferId, Client, Config, Event, Generation, Message, MsgId, ReadError, ReadToken, Region,
    Release, UsageError, Verdict,
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

fn client() -> Client {
    let mut c = Client::new(Config::default());
    c.add_buffer(Region::new(0x1000, 64, 0xc1));
    c
}

fn actions(c: &mut Client) -> Vec<Action> {
    std::iter::from_fn(|| c.poll_action()).collect()
}

fn events(c: &mut Client) -> Vec<Event> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

fn fetch(c: &mut Client, now: Duration) -> MsgId {
    let m = c.fetch(now, 64).unwrap();
    assert_eq!(actions(c), vec![Action::Send(Message::Fetch { msg: m, attempt: 1 })]);
    m
}

fn offer(m: MsgId, b: u32, g: u64) -> Message {
    Message::Offer {
        msg: m,
        buffer: buf(b),
        generation: generation(g),
        region: Region::new(0x8000, 16, 0x5e),
    }
}

/// The server offers its buffer `b` at generation `g` for `m`; the READ
/// token the client posts.
fn offered(c: &mut Client, m: MsgId, b: u32, g: u64) -> ReadToken {
    c.handle_message(secs(0), offer(m, b, g));
    match actions(c)[..] {
        [Action::Read(r)] => r.token(),
        ref other => panic!("expected one READ, got {other:?}"),
    }
}

fn confirm(m: MsgId, b: u32, g: u64) -> Action {
    Action::Send(Message::Confirm { msg: m, buffer: buf(b), generation: generation(g) })
}

fn reply(m: MsgId, b: u32, g: u64, verdict: Verdict) -> Message {
    Message::ConfirmReply { msg: m, buffer: buf(b), generation: generation(g), verdict }
}

#[test]
fn verdicts_nobody_asked_for_are_violations() {
    let mut c = client();
    let m = fetch(&mut c, secs(0));
    // No such fetch; the fetch is not confirming yet (no offer, then a READ
    // in flight); the wrong exposure.
    c.handle_message(secs(0), reply(msg(9), 0, 0, Verdict::Intact));
    c.handle_message(secs(0), reply(m, 0, 0, Verdict::Intact));
    let t = offered(&mut c, m, 0, 0);
    c.handle_message(secs(0), reply(m, 0, 0, Verdict::Intact));
    assert_eq!(c.peer_violations(), 3);
    assert_eq!(events(&mut c), vec![], "never verified before the READ completed");
    c.handle_read_completion(secs(1), t, true);
    assert_eq!(actions(&mut c), vec![confirm(m, 0, 0)]);
    c.handle_message(secs(1), reply(m, 0, 1, Verdict::Intact));
    c.handle_message(secs(1), reply(m, 1, 0, Verdict::Intact));
    assert_eq!(c.peer_violations(), 5);
    assert_eq!(events(&mut c), vec![]);
    c.handle_message(secs(1), reply(m, 0, 0, Verdict::Intact));
    assert_eq!(events(&mut c), vec![Event::ReadVerified { msg: m, token: t, len: 16 }]);
    assert_eq!(c.peer_violations(), 5);
    assert!(c.is_idle());
}

#[test]
fn offers_nobody_asked_for_are_violations_but_late_ones_are_not() {
    let mut c = client();
    let m1 = fetch(&mut c, secs(0));
    let m2 = fetch(&mut c, secs(0));
    assert!(c.cancel(secs(0), m1));
    assert!(c.cancel(secs(0), m2));
    let _ = (actions(&mut c), events(&mut c));
    // Offers for fetches that ended here (their Refuse crossed the offer):
    // the server lets go when the Refuse arrives. Nothing to read.
    c.handle_message(secs(1), offer(m1, 0, 0));
    c.handle_message(secs(1), offer(m2, 1, 0));
    assert_eq!(c.peer_violations(), 0);
    // Offers for ids never handed out.
    c.handle_message(secs(1), offer(msg(0), 0, 0));
    c.handle_message(secs(1), offer(msg(3), 0, 0));
    c.handle_message(secs(1), offer(msg(u64::MAX), 0, 0));
    assert_eq!(c.peer_violations(), 3);
    // A second offer for a fetch already reading.
    let m3 = fetch(&mut c, secs(2));
    let _ = offered(&mut c, m3, 0, 0);
    c.handle_message(secs(2), offer(m3, 1, 0));
    assert_eq!(c.peer_violations(), 4);
    assert_eq!(actions(&mut c), vec![]);
    // Messages only a client sends.
    c.handle_message(secs(2), Message::Fetch { msg: m3, attempt: 1 });
    let expose =
        Message::Expose { msg: m3, buffer: buf(0), generation: generation(0), region: Region::new(0, 1, 2) };
    c.handle_message(secs(2), expose);
    assert_eq!(c.peer_violations(), 6);
}

#[test]
fn a_refuse_ends_a_fetch_or_an_exposed_request_and_otherwise_is_a_violation() {
    let mut c = client();
    let m1 = fetch(&mut c, secs(0));
    c.handle_message(secs(0), Message::Refuse { msg: m1 });
    assert_eq!(events(&mut c), vec![Event::ReadFailed { msg: m1, error: ReadError::Refused }]);
    assert_eq!(actions(&mut c), vec![], "no Refuse back: the server holds nothing");
    let m2 = c.send_request(secs(0), buf(0), 8).unwrap();
    let _ = actions(&mut c);
    assert!(!c.is_buffer_free(buf(0)));
    c.handle_message(secs(0), Message::Refuse { msg: m2 });
    assert_eq!(events(&mut c), vec![Event::BufferFree { buffer: buf(0), msg: m2, reason: Release::Refused }]);
    assert_eq!(c.peer_violations(), 0);
    // Over already, or never sent.
    c.handle_message(secs(0), Message::Refuse { msg: m1 });
    c.handle_message(secs(0), Message::Refuse { msg: m2 });
    c.handle_message(secs(0), Message::Refuse { msg: msg(7) });
    assert_eq!(c.peer_violations(), 3);
    assert!(c.is_idle());
}

#[test]
fn only_endings_that_leave_the_server_holding_send_a_refuse() {
    let mut config = Config::default();
    config.max_attempts = 1;
    let mut c = Client::new(config);
    // A failed READ: the QP is in error, there is nobody to tell.
    let m = fetch(&mut c, secs(0));
    let t = offered(&mut c, m, 0, 0);
    c.handle_read_completion(secs(0), t, false);
    assert_eq!(actions(&mut c), vec![]);
    assert_eq!(
        events(&mut c),
        vec![Event::ReadDiscarded { token: t }, Event::ReadFailed { msg: m, error: ReadError::ReadFailed }]
    );
    // A stale read with no attempt left: the server's hold already ended.
    let m = fetch(&mut c, secs(0));
    let t = offered(&mut c, m, 0, 1);
    c.handle_read_completion(secs(0), t, true);
    assert_eq!(actions(&mut c), vec![confirm(m, 0, 1)]);
    c.handle_message(secs(0), reply(m, 0, 1, Verdict::Reused));
    assert_eq!(actions(&mut c), vec![]);
    assert_eq!(
        events(&mut c),
        vec![
            Event::ReadDiscarded { token: t },
            Event::ReadFailed { msg: m, error: ReadError::StaleRetriesExhausted { attempts: 1 } }
        ]
    );
    // A timeout: the server may still hold a buffer for it.
    let m = fetch(&mut c, secs(0));
    let _ = offered(&mut c, m, 0, 2);
    c.handle_timeout(secs(10));
    assert_eq!(actions(&mut c), vec![Action::Send(Message::Refuse { msg: m })]);
    // After the connection is lost nothing is sent.
    let m = fetch(&mut c, secs(20));
    c.handle_connection_lost(secs(20));
    assert_eq!(actions(&mut c), vec![]);
    assert!(!c.cancel(secs(20), m), "already failed with the connection");
}

#[test]
fn read_completions_are_matched_by_token_not_by_order() {
    let mut c = client();
    let m1 = fetch(&mut c, secs(0));
    let m2 = fetch(&mut c, secs(0));
    let t1 = offered(&mut c, m1, 0, 0);
    let t2 = offered(&mut c, m2, 1, 0);
    c.handle_read_completion(secs(1), t2, true);
    assert_eq!(actions(&mut c), vec![confirm(m2, 1, 0)]);
    c.handle_read_completion(secs(1), ReadToken::from_raw(99), true);
    c.handle_read_completion(secs(1), t2, true);
    assert_eq!(actions(&mut c), vec![]);
    c.handle_read_completion(secs(2), t1, true);
    assert_eq!(actions(&mut c), vec![confirm(m1, 0, 0)]);
    c.handle_message(secs(2), reply(m2, 1, 0, Verdict::Intact));
    c.handle_message(secs(2), reply(m1, 0, 0, Verdict::Intact));
    assert_eq!(
        events(&mut c),
        vec![
            Event::ReadVerified { msg: m2, token: t2, len: 16 },
            Event::ReadVerified { msg: m1, token: t1, len: 16 },
        ]
    );
}

#[test]
fn an_exposed_buffer_keeps_the_client_busy() {
    let mut c = client();
    assert!(c.is_idle());
    assert!(!c.is_connection_lost());
    let m = c.send_request(secs(0), buf(0), 8).unwrap();
    let _ = actions(&mut c);
    assert!(!c.is_idle(), "the request buffer is exposed to the server's READ");
    assert_eq!(c.poll_timeout(), Some(secs(10)));
    c.handle_connection_lost(secs(1));
    assert!(c.is_connection_lost());
    assert_eq!(
        events(&mut c),
        vec![Event::BufferFree { buffer: buf(0), msg: m, reason: Release::ConnectionLost }]
    );
    assert!(c.is_idle());
}

#[test]
fn a_read_never_posted_is_withdrawn_once_its_fetch_is_over() {
    // A driver with no destination free holds the READ back; once the
    // fetch ended (here, cancelled) it forgets the READ rather than READ
    // for nobody, and nothing is left to wait for.
    let mut c = client();
    let m = fetch(&mut c, secs(0));
    let t = offered(&mut c, m, 0, 0);
    assert!(!c.withdraw_read(t), "still wanted");
    assert!(c.cancel(secs(1), m));
    let _ = actions(&mut c);
    let _ = events(&mut c);
    assert!(!c.is_idle(), "the READ may be in flight");
    assert!(c.withdraw_read(t));
    assert!(!c.withdraw_read(t), "once");
    assert!(c.is_idle());
}

/// `set_buffer_region` points a free buffer at other memory: the next
/// request exposes the new range at a new generation. A buffer that is
/// exposed, or that does not exist, is refused.
#[test]
fn a_buffer_pointed_at_another_region_exposes_that_region() {
    let mut c = client();
    let before = c.send_request(secs(0), buf(0), 8).unwrap();
    let old = match actions(&mut c)[..] {
        [Action::Send(Message::Expose { generation, region, .. })] => {
            assert_eq!(region, Region::new(0x1000, 8, 0xc1));
            generation
        }
        ref other => panic!("expected one Expose, got {other:?}"),
    };
    let elsewhere = Region::new(0x4000, 32, 0xd2);
    assert_eq!(c.set_buffer_region(buf(0), elsewhere), Err(UsageError::BufferBusy(buf(0))));
    assert!(c.cancel(secs(1), before));
    let _ = (actions(&mut c), events(&mut c));
    c.set_buffer_region(buf(0), elsewhere).unwrap();
    let m = c.send_request(secs(2), buf(0), 8).unwrap();
    match actions(&mut c)[..] {
        [Action::Send(Message::Expose { msg, buffer, generation, region })] => {
            assert_eq!((msg, buffer), (m, buf(0)));
            assert_eq!(region, Region::new(0x4000, 8, 0xd2), "the new region, not the old one");
            assert_ne!(generation, old, "a confirm of the old region cannot match");
        }
        ref other => panic!("expected one Expose, got {other:?}"),
    }
    assert_eq!(c.set_buffer_region(buf(7), elsewhere), Err(UsageError::UnknownBuffer(buf(7))));
}

/// `has_output` says whether an action or an event waits to be polled,
/// each on its own.
#[test]
fn has_output_counts_actions_and_events_each() {
    let mut c = client();
    assert!(!c.has_output());
    let m = c.fetch(secs(0), 64).unwrap();
    assert!(c.has_output(), "a Fetch to send");
    let _ = actions(&mut c);
    assert!(!c.has_output());
    assert!(c.cancel(secs(1), m));
    let _ = actions(&mut c);
    assert!(c.has_output(), "the ReadFailed event alone");
    let _ = events(&mut c);
    assert!(!c.has_output());
}

/// `fetch_of_read` names the fetch a READ belongs to from its action until
/// its completion is handled.
#[test]
fn fetch_of_read_names_the_fetch_until_the_completion() {
    let mut c = client();
    let m = fetch(&mut c, secs(0));
    let t = offered(&mut c, m, 0, 1);
    assert_eq!(c.fetch_of_read(t), Some(m));
    c.handle_read_completion(secs(0), t, true);
    assert_eq!(c.fetch_of_read(t), None, "handled");
}

/// A fetch whose request the driver's flow control refused ends as
/// `Refused`, with nothing sent to the server; a second word of it is no
/// fetch in progress.
#[test]
fn a_fetch_refused_by_the_driver_ends_quietly() {
    let mut c = client();
    let m = fetch(&mut c, secs(0));
    assert!(c.refused(secs(0), m));
    assert_eq!(actions(&mut c), vec![]);
    assert_eq!(events(&mut c), vec![Event::ReadFailed { msg: m, error: ReadError::Refused }]);
    assert!(!c.refused(secs(0), m));
    assert!(c.is_idle());
    assert_eq!(c.peer_violations(), 0);
}
