//! A hostile peer against the sans-IO connection, with no NIC: each test
//! hands one `proto::Connection` frames written by hand, as a peer that does
//! not run mwcap's code would send them, and checks that the connection goes
//! down with the reason a program can match on, asks for its QP to be
//! flushed, reports it as an event, never panics, and keeps every buffer.

use std::time::Duration;

use mwcap::backend::{Completion, MrId, MrInfo, MwId, MwInfo, WcOpcode, WcStatus};
use mwcap::conn::frame::{Attach, Attaches, EngineTag, Frame, INITIAL_CREDITS, MAX_FRAME};
use mwcap::conn::proto::{Command, Connection, DataMemory, Resources};
use mwcap::conn::{Config, Event, LossReason, Misbehavior, Policies, Policy, Role};
use mwcap_fallback as fb;

const BUFFERS: u32 = 4;

struct Victim {
    conn: Connection,
    /// Posted receives' work request ids, oldest first.
    recvs: std::collections::VecDeque<u64>,
    qp_errors: usize,
    /// The credit the connection granted its peer: `INITIAL_CREDITS` and
    /// the credit field of every frame it sent.
    granted: u64,
}

impl Victim {
    fn new(role: Role, policy: Policy) -> Victim {
        Victim::with(role, policy, |_| {})
    }

    fn with(role: Role, policy: Policy, tweak: impl FnOnce(&mut Config)) -> Victim {
        let mut cfg = Config::default();
        cfg.buffers = BUFFERS;
        cfg.buffer_size = 4096;
        cfg.region_exposures = 0; // windows for pool buffers only (no user regions here)
        cfg.ctrl_slots = 8;
        tweak(&mut cfg);
        let data = MrInfo { id: MrId::from_raw(2), addr: 0x1000_0000, len: 4 * 4096, lkey: 2, rkey: 0x22 };
        let memory = mwcap::backend::Memory::zeroed(data.len, 8).unwrap();
        let windows = if policy == Policy::Mw {
            (0..BUFFERS).map(|i| MwInfo { id: MwId::from_raw(10 + i), rkey: (0x100 + i) << 8 }).collect()
        } else {
            vec![]
        };
        let mut conn = Connection::new(
            role,
            Policies::both(policy),
            cfg,
            Resources { ctrl: MrId::from_raw(1), data: DataMemory::Region(data, memory), windows },
        );
        conn.start(INITIAL_CREDITS);
        let mut v =
            Victim { conn, recvs: Default::default(), qp_errors: 0, granted: u64::from(INITIAL_CREDITS) };
        v.take_commands();
        v
    }

    fn take_commands(&mut self) {
        let (recvs, qp_errors, granted) = (&mut self.recvs, &mut self.qp_errors, &mut self.granted);
        self.conn.drain_commands(|c, staged| {
            match c {
                Command::PostRecv { wr_id, .. } => recvs.push_back(*wr_id),
                Command::SetQpError => *qp_errors += 1,
                Command::PostSend { frame: Some(_), .. } => {
                    let (_, credit) = Frame::decode_with_credit(staged).expect("a frame");
                    *granted += u64::from(credit);
                }
                Command::PostSend { frame: None, .. } => {}
            }
            Ok(())
        });
    }

    /// The peer's SEND of `bytes` lands in the oldest posted receive, and
    /// the connection's commands are taken.
    fn receive(&mut self, bytes: &[u8], invalidated: Option<u32>) {
        self.receive_unsettled(bytes, invalidated);
        self.take_commands();
    }

    /// As [`Victim::receive`], but the commands the completion queued stay
    /// with the connection (a batch of completions with no settle between).
    fn receive_unsettled(&mut self, bytes: &[u8], invalidated: Option<u32>) {
        let wr_id = self.recvs.pop_front().expect("a receive is posted");
        let c = Completion {
            wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: bytes.len() as u32,
            invalidated_rkey: invalidated,
            qpn: 1,
            vendor_err: 0,
        };
        assert!(self.conn.received_frame(&c).is_some(), "a successful receive carries a frame");
        self.conn.handle_completion(Duration::from_millis(1), &c, bytes);
    }

    /// The connection is down for `want`, said so once in an event, and
    /// asked for its QP to go to ERR; every buffer is still in the pool.
    fn assert_down(&mut self, want: impl Fn(&Misbehavior) -> bool) {
        match self.conn.is_down() {
            Some(LossReason::PeerMisbehaved(m)) if want(m) => {}
            other => panic!("unexpected state: {other:?}"),
        }
        let mut lost = 0;
        while let Some(e) = self.conn.poll_event() {
            if let Event::ConnectionLost(LossReason::PeerMisbehaved(m)) = e {
                assert!(want(&m));
                lost += 1;
            }
        }
        assert_eq!(lost, 1, "one ConnectionLost event");
        assert_eq!(self.qp_errors, 1, "the QP is moved to ERR once");
        assert_eq!(self.conn.free_buffers(), BUFFERS as usize, "no buffer lost");
    }
}

fn request(msg_id: u64, attach: &[Attach]) -> Vec<u8> {
    Frame::Request {
        msg_id,
        trace: None,
        header: b"h",
        inline: b"",
        attach: Attaches::from_slice(attach).unwrap(),
    }
    .encode()
    .unwrap()
}

fn confirm_attach(m: fb::Message) -> Attach {
    Attach::new(EngineTag::Confirm, &m.to_bytes()).unwrap()
}

fn expose(msg: u64) -> Attach {
    confirm_attach(fb::Message::Expose {
        msg: fb::MsgId::from_raw(msg),
        buffer: fb::BufferId::from_raw(0),
        generation: fb::Generation::from_raw(1),
        region: fb::Region::new(0x2000_0000, 64, 0x33),
    })
}

#[test]
fn bytes_that_are_no_frame_close_the_connection() {
    for garbage in [&[][..], &[0xff; 7][..], &[1, 9, 9, 9][..], &[0u8; MAX_FRAME][..]] {
        let mut v = Victim::new(Role::Server, Policy::Mw);
        v.receive(garbage, None);
        v.assert_down(|m| matches!(m, Misbehavior::MalformedFrame(_)));
    }
}

#[test]
fn a_replayed_request_id_closes_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Mw);
    v.receive(&request(5, &[]), None);
    assert!(v.conn.is_down().is_none(), "the first request is fine");
    assert!(matches!(v.conn.poll_event(), Some(Event::Request { .. })));
    v.receive(&request(5, &[]), None);
    v.assert_down(|m| *m == Misbehavior::RequestIdReused { msg: 5, last: 5 });
}

#[test]
fn frames_after_a_violation_are_not_carried_out() {
    // A bad frame, then valid ones that land before the QP is in ERR (the
    // same poll batch): the condemned peer's later frames are dropped, not
    // handed to the application after the connection said it was lost.
    for policy in [Policy::Mw, Policy::Confirm] {
        let mut v = Victim::new(Role::Server, policy);
        v.receive(&[0xff; 7], None);
        v.receive(&request(1, &[]), None);
        let ask = Frame::Ask { msg_id: 2, body: b"token", attach: Attaches::new() }.encode().unwrap();
        v.receive(&ask, None);
        let events: Vec<Event> = std::iter::from_fn(|| v.conn.poll_event()).collect();
        assert!(
            events.iter().all(|e| matches!(e, Event::ConnectionLost(_))),
            "{policy:?}: only the loss is reported, got {events:?}"
        );
        assert_eq!(events.len(), 1);
        assert!(matches!(v.conn.is_down(), Some(LossReason::PeerMisbehaved(Misbehavior::MalformedFrame(_)))));
        assert_eq!(v.conn.free_buffers(), BUFFERS as usize, "no buffer lost");
    }
}

/// A confirm client asks for a reply "again" (a fetch retry) of a request
/// the server has not answered yet: nothing of the live request is lost
/// or replaced, and no "reply again" reaches the application. (Before, the
/// retry replaced the live request with an empty one and emitted
/// `ReplyAgain` for it.)
#[test]
fn a_fetch_retry_for_a_request_not_yet_answered_replaces_nothing() {
    let fetch = |msg, attempt| confirm_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(msg), attempt });
    for (first, stale) in [(0, false), (1, false), (1, true)] {
        let mut v = Victim::new(Role::Server, Policy::Confirm);
        if stale {
            // Fetch 7 used and answered (refused: no payload) by request 1.
            v.receive(&request(1, &[fetch(7, 1)]), None);
            let Some(Event::Request { req, .. }) = v.conn.poll_event() else { panic!("the request") };
            v.conn.reply(Duration::from_millis(1), req, 0, b"done", None).unwrap();
            v.take_commands();
            while v.conn.poll_event().is_some() {}
        }
        v.receive(&request(2, &[fetch(7, first)]), None);
        let Some(Event::Request { req, .. }) = v.conn.poll_event() else { panic!("the request") };
        let retry = Frame::Engine(fetch(7, 2)).encode().unwrap();
        v.receive(&retry, None);
        let events: Vec<Event> = std::iter::from_fn(|| v.conn.poll_event()).collect();
        assert!(
            !events.iter().any(|e| matches!(e, Event::ReplyAgain { .. })),
            "first attempt {first}: no reply again for a live request: {events:?}"
        );
        // The live request is still the one to answer, header and all.
        if v.conn.is_down().is_none() {
            v.conn.reply(Duration::from_millis(2), req, 0, b"answer", None).expect("the request is live");
        }
        assert_eq!(v.conn.free_buffers(), BUFFERS as usize, "no buffer lost");
    }
}

#[test]
fn a_request_id_below_the_last_one_closes_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Mw);
    v.receive(&request(5, &[]), None);
    assert!(matches!(v.conn.poll_event(), Some(Event::Request { .. })));
    // Ids only go up: an older id is a replay too, not only the same one.
    v.receive(&request(4, &[]), None);
    v.assert_down(|m| *m == Misbehavior::RequestIdReused { msg: 4, last: 5 });
}

#[test]
fn a_frame_of_the_other_role_closes_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Mw);
    let reply = Frame::Reply { msg_id: 1, status: 0, header: b"", inline: b"", attach: Attaches::new() }
        .encode()
        .unwrap();
    v.receive(&reply, None);
    v.assert_down(|m| *m == Misbehavior::WrongFrame { role: Role::Server, got: "reply" });

    let mut v = Victim::new(Role::Client, Policy::Mw);
    v.receive(&request(1, &[]), None);
    v.assert_down(|m| *m == Misbehavior::WrongFrame { role: Role::Client, got: "request" });
}

#[test]
fn a_send_with_invalidate_closes_the_connection() {
    // Only the owner invalidates its windows; a peer that does, whether we
    // bind windows or not, has broken the protocol.
    for policy in [Policy::Mw, Policy::Confirm] {
        let mut v = Victim::new(Role::Server, policy);
        v.receive(&request(1, &[]), Some(0x1234_5601));
        v.assert_down(|m| *m == Misbehavior::SendWithInvalidate { rkey: 0x1234_5601 });
    }
}

#[test]
fn a_message_of_an_unused_policy_closes_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Mw);
    v.receive(&request(1, &[expose(1)]), None);
    v.assert_down(|m| *m == Misbehavior::WrongPolicy { what: "confirm message" });
}

#[test]
fn two_payloads_on_one_request_close_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Confirm);
    v.receive(&request(1, &[expose(1), expose(2)]), None);
    v.assert_down(|m| *m == Misbehavior::TooManyPayloads { msg: 1, count: 2 });
}

#[test]
fn an_inline_payload_and_an_exposure_on_one_request_close_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Confirm);
    let f = Frame::Request {
        msg_id: 1,
        trace: None,
        header: b"h",
        inline: b"inline bytes",
        attach: Attaches::from_slice(&[expose(1)]).unwrap(),
    };
    v.receive(&f.encode().unwrap(), None);
    v.assert_down(|m| *m == Misbehavior::TooManyPayloads { msg: 1, count: 2 });
}

#[test]
fn an_inline_payload_is_delivered_in_a_buffer_of_the_pool() {
    let mut v = Victim::new(Role::Server, Policy::Mw);
    let f = Frame::Request {
        msg_id: 1,
        trace: None,
        header: b"h",
        inline: b"inline bytes",
        attach: Attaches::new(),
    };
    v.receive(&f.encode().unwrap(), None);
    // The connection wrote the bytes into the buffer, which the handle lends.
    let Some(Event::Request { data: Some(b), .. }) = v.conn.poll_event() else { panic!("no request") };
    assert_eq!(&b[..], b"inline bytes");
    assert_eq!(b.capacity(), 4096);
    v.conn.free(b);
}

#[test]
fn a_frame_past_the_credit_granted_closes_the_connection() {
    // Issue 19, finding 1: on a receive queue of its own a peer past its
    // credit went unnoticed (the NIC's RNR retries let its frames in as
    // receives were reposted). The peer here grants nothing, so the
    // connection's own grants stop once its credit is spent.
    for role in [Role::Server, Role::Client] {
        for policy in [Policy::Mw, Policy::Confirm] {
            let mut v = Victim::new(role, policy);
            let mut sent = 0;
            while sent < v.granted {
                v.receive(&Frame::Credit.encode().unwrap(), None);
                sent += 1;
                assert!(v.conn.is_down().is_none(), "{role:?} {policy:?}: frame {sent} is within the credit");
            }
            assert!(sent > u64::from(INITIAL_CREDITS), "{role:?} {policy:?}: the connection granted more");
            v.receive(&Frame::Credit.encode().unwrap(), None);
            v.assert_down(|m| *m == Misbehavior::ExceedsCredit { granted: sent, received: sent + 1 });
        }
    }
}

#[test]
fn an_inline_payload_above_inline_max_closes_the_connection() {
    // Issue 19, finding 2: the receiver's own limit (256 by default), not
    // the most a frame carries (MAX_INLINE, 1024), bounds what it takes.
    let mut v = Victim::new(Role::Server, Policy::Mw);
    let max = v.conn.config().inline_max;
    let long = vec![7; max as usize + 1];
    let f = Frame::Request { msg_id: 1, trace: None, header: b"h", inline: &long, attach: Attaches::new() };
    v.receive(&f.encode().unwrap(), None);
    v.assert_down(|m| *m == Misbehavior::InlineTooLong { msg: 1, len: max + 1, max });
}

#[test]
fn more_waiting_request_payloads_than_the_bound_close_the_connection() {
    // Issue 19, finding 1: a server whose user holds every buffer keeps at
    // most `max_waiting_payloads` request payloads waiting for one.
    for policy in [Policy::Mw, Policy::Confirm] {
        let mut v = Victim::with(Role::Server, policy, |c| c.max_waiting_payloads = 3);
        let held: Vec<_> = std::iter::from_fn(|| v.conn.alloc()).collect();
        assert_eq!(held.len(), BUFFERS as usize);
        let payload = |msg: u64| match policy {
            Policy::Mw => Attach::new(
                EngineTag::Mw,
                &mwcap_mw::Message::Grant(mwcap_mw::Grant {
                    lease: mwcap_mw::LeaseId::from_raw(1 << 32 | msg),
                    addr: 0x4000_0000,
                    len: 64,
                    rkey: 0x4401,
                    time_left: Duration::from_secs(5),
                })
                .to_bytes(),
            )
            .unwrap(),
            Policy::Confirm => expose(msg),
        };
        for msg in 1..=3 {
            v.receive(&request(msg, &[payload(msg)]), None);
            assert!(v.conn.is_down().is_none(), "{policy:?}: payload {msg} may wait");
        }
        v.receive(&request(4, &[payload(4)]), None);
        for b in held {
            v.conn.free(b);
        }
        v.assert_down(|m| *m == Misbehavior::TooManyWaitingPayloads { waiting: 3 });
    }
}

#[test]
fn more_waiting_inline_bytes_than_the_bound_close_the_connection() {
    // Issue 19, finding 2: a server whose user holds every buffer keeps at
    // most `max_waiting_inline` bytes of inline payloads waiting for one.
    let mut v = Victim::with(Role::Server, Policy::Mw, |c| c.max_waiting_inline = 512);
    let held: Vec<_> = std::iter::from_fn(|| v.conn.alloc()).collect();
    let inline = [9; 256];
    for msg_id in 1..=3 {
        let f =
            Frame::Request { msg_id, trace: None, header: b"h", inline: &inline, attach: Attaches::new() };
        v.receive(&f.encode().unwrap(), None);
        if msg_id < 3 {
            assert!(v.conn.is_down().is_none(), "payload {msg_id} may wait");
        }
    }
    for b in held {
        v.conn.free(b);
    }
    v.assert_down(|m| *m == Misbehavior::TooMuchWaitingInline { waiting: 512, len: 256, max: 512 });
}

#[test]
fn trailing_bytes_after_a_confirm_message_close_the_connection() {
    let mut v = Victim::new(Role::Server, Policy::Confirm);
    let m = fb::Message::Expose {
        msg: fb::MsgId::from_raw(1),
        buffer: fb::BufferId::from_raw(0),
        generation: fb::Generation::from_raw(1),
        region: fb::Region::new(0x2000_0000, 64, 0x33),
    };
    let mut bytes = m.to_bytes();
    bytes.push(0);
    v.receive(&request(1, &[Attach::new(EngineTag::Confirm, &bytes).unwrap()]), None);
    v.assert_down(|m| *m == Misbehavior::ConfirmTrailingBytes);
}

#[test]
fn every_reason_says_what_happened() {
    // The user-facing text names the offence (it goes to logs and errors).
    let r = LossReason::PeerMisbehaved(Misbehavior::RequestIdReused { msg: 7, last: 9 });
    assert!(r.to_string().contains("request id 7 is not above the last one (9)"), "{r}");
    let r = LossReason::Completion {
        status: WcStatus::RnrRetryExcErr,
        opcode: WcOpcode::Send,
        vendor_err: 0x81,
        wr_id: 0xc1 << 56,
    };
    let s = r.to_string();
    assert!(s.contains("RnrRetryExcErr") && s.contains("0x81") && s.contains("reconnect"), "{s}");
}

/// The seeds of the `wire_decode` fuzz target are frames of this version
/// (a stale seed would only test the version check).
#[test]
fn the_fuzz_seeds_are_frames_of_this_version() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/wire_decode");
    let mut frames = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name().unwrap().to_str().unwrap().starts_with("frame_") {
            let bytes = std::fs::read(&p).unwrap();
            Frame::decode_with_credit(&bytes).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            frames += 1;
        }
    }
    assert!(frames >= 4);
}

/// Engine messages the connection queued from a batch of frames not yet
/// settled (four confirms of buffers never offered: four answers) do not
/// crowd a reply's own exposure out of its frame (a frame carries four):
/// a reply, or a call, first sends what was queued. Before, the offer was
/// dropped (a debug build panicked), and the client got the reply without
/// its payload while the server kept the buffer until `hold_timeout`.
#[test]
fn messages_queued_before_a_reply_leave_room_for_its_payload() {
    let fetch = confirm_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(7), attempt: 1 });
    let mut v = Victim::new(Role::Server, Policy::Confirm);
    v.receive(&request(1, &[fetch]), None);
    let Some(Event::Request { req, .. }) = v.conn.poll_event() else { panic!("the request") };
    // Four confirms in one batch, handed over without a settle between
    // them and the reply.
    for m in 0..4u64 {
        let confirm = confirm_attach(fb::Message::Confirm {
            msg: fb::MsgId::from_raw(100 + m),
            buffer: fb::BufferId::from_raw(0),
            generation: fb::Generation::from_raw(1),
        });
        v.receive_unsettled(&Frame::Engine(confirm).encode().unwrap(), None);
    }
    let mut buf = v.conn.alloc().expect("a buffer");
    buf.copy_from(&[0x5a; 100]).unwrap();
    v.conn.reply(Duration::from_millis(2), req, 0, b"payload", Some(buf)).expect("the reply");
    let mut replies = Vec::new();
    let mut answers = 0;
    v.conn.drain_commands(|c, staged| {
        if let Command::PostSend { frame: Some(_), .. } = c {
            let (f, _) = Frame::decode_with_credit(staged).expect("a frame");
            let list: Vec<Attach> = match &f {
                Frame::Reply { attach, .. } => attach.to_vec(),
                Frame::Engine(a) => vec![*a],
                _ => vec![],
            };
            let attach: Vec<fb::Message> =
                list.iter().map(|a| fb::Message::decode(a.bytes()).expect("a confirm message").0).collect();
            answers += attach.iter().filter(|m| matches!(m, fb::Message::ConfirmReply { .. })).count();
            if let Frame::Reply { msg_id, .. } = f {
                replies.push((msg_id, attach));
            }
        }
        Ok(())
    });
    assert_eq!(answers, 4, "every confirm is answered");
    assert_eq!(replies.len(), 1, "one reply: {replies:?}");
    let (msg_id, attach) = &replies[0];
    assert_eq!(*msg_id, 1);
    assert!(
        attach.iter().any(|m| matches!(m, fb::Message::Offer { msg, .. } if *msg == fb::MsgId::from_raw(7))),
        "the reply carries its payload's offer: {attach:?}"
    );
}

/// The connection's time never goes back: a call started with a clock
/// read before a turn that read a later one (the driver reads it once for
/// a loop of turns) counts from the later time, so no engine sees time go
/// back and no deadline is set in the past of one already seen.
#[test]
fn a_late_clock_reading_does_not_take_the_connections_time_back() {
    let mut v = Victim::new(Role::Client, Policy::Mw);
    let timeout = Config::default().call_timeout;
    v.conn.handle_timeout(Duration::from_millis(100));
    v.conn.call_inline(Duration::from_millis(50), None, b"h", b"").expect("the call");
    assert_eq!(
        v.conn.poll_timeout(),
        Some(Duration::from_millis(100) + timeout),
        "the call's deadline counts from the latest time seen"
    );
}
