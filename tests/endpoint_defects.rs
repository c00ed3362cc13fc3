//! Defects found by trying the connection layer as a hostile peer and as a
//! new user would (issue 7, section 5). Each test failed before its fix.

use mwcap::backend::NicOps;
use std::time::Duration;

use mwcap::backend::{Access, CqId, QpConfig, QpEndpoint, SendWr, Sge, SgeList, WcStatus};
use mwcap::conn::frame::{Attach, Attaches, EngineTag, Frame};
use mwcap::conn::{
    Buf, CallError, Config, Event, Link, LossReason, Misbehavior, Policies, Policy, Role, SimPair, UseError,
};
use mwcap::sim::{DeviceConfig, Fabric, FabricConfig, Progress, SimNic};

fn pair(p: Policies) -> SimPair {
    SimPair::spec(11, p, Config::default(), Config::default()).expect("pair")
}

/// Fail on any hazard the simulator's oracle recorded on `fabric`: no DMA
/// into a buffer a user holds or into freed memory, no READ of a held mw
/// buffer, no invalidation that would crash rxe.
fn assert_no_hazards(fabric: &Fabric) {
    let hazards = fabric.hazards();
    assert!(hazards.is_empty(), "the oracle saw {hazards:?}");
}

fn filled(ep: &mut Link<SimNic>, bytes: &[u8]) -> Buf {
    let mut b = ep.alloc().expect("free buffer");
    b.copy_from(bytes).unwrap();
    b
}

fn take_request(p: &mut SimPair) -> (mwcap::conn::RequestId, Option<Buf>) {
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .server_events
        .iter()
        .any(|e| matches!(e, Event::Request { .. }))));
    let pos = p.server_events.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
    match p.server_events.remove(pos) {
        Event::Request { req, data, .. } => (req, data),
        _ => unreachable!(),
    }
}

// ---- 1. a refused call or reply hands its buffer back ----

#[test]
fn a_refused_call_hands_its_buffer_back_in_the_error() {
    let mut p = pair(Policies::both(Policy::Mw));
    let total = p.client.free_buffers();
    let b = filled(&mut p.client, b"payload");
    let now = p.now();
    let refused = p.client.call(now, &[7; 3000], Some(b)).expect_err("a 3,000-byte header is refused");
    assert!(matches!(refused.error, UseError::HeaderTooLong(3000)), "{refused}");
    let b = refused.data.expect("the buffer comes back with the refusal");
    assert_eq!(b.to_vec(), b"payload", "untouched");
    p.client.free(b);
    assert_eq!(p.client.free_buffers(), total, "no buffer lost");
}

#[test]
fn a_refused_reply_hands_its_buffer_back() {
    let mut p = pair(Policies::both(Policy::Mw));
    let total = p.server.free_buffers();
    let now = p.now();
    p.client.call(now, b"q", None).unwrap();
    let (req, _) = take_request(&mut p);
    let b = filled(&mut p.server, b"reply");
    let now = p.now();
    let refused = p.server.reply(now, req, 0, &[1; 3000], Some(b)).expect_err("header too long");
    assert!(matches!(refused.error, UseError::HeaderTooLong(3000)), "{refused}");
    p.server.free(refused.data.expect("buffer back"));
    assert_eq!(p.server.free_buffers(), total);
    // The request is still waiting: a valid reply goes through.
    let b = filled(&mut p.server, b"reply");
    p.server.reply(now, req, 0, b"ok", Some(b)).unwrap();
}

#[test]
fn the_async_call_reports_a_refusal_as_such_and_returns_the_buffer() {
    let fabric = Fabric::with_seed(5);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let endpoint =
        |nic| mwcap::conn::Endpoint::builder(nic, mwcap::bootstrap::Auth::Unauthenticated).build().unwrap();
    let ((ce, _cdrv), (se, _sdrv)) = (endpoint(cn), endpoint(sn));
    let (client, s) = ce.connect_local(&se, p).unwrap();
    let total = 16;
    let mut b = client.try_alloc().unwrap();
    b.copy_from(b"x").unwrap();
    let err = futures::executor::block_on(client.call(&[0; 3000], Some(b))).expect_err("refused");
    let msg = err.to_string();
    assert!(msg.contains("header") && !msg.contains("could not be read intact"), "{msg}");
    match err {
        CallError::Refused(mwcap::conn::Refused { error: UseError::HeaderTooLong(3000), data: Some(b) }) => {
            client.free(b)
        }
        other => panic!("{other:?}"),
    }
    let mut all = Vec::new();
    while let Some(b) = client.try_alloc() {
        all.push(b);
    }
    assert_eq!(all.len(), total, "no buffer lost");
    drop(s);
}

// ---- 2. flushed receives take the victim's connection down ----

#[test]
fn a_victim_whose_qp_was_flushed_reports_the_connection_down() {
    let mut p = pair(Policies::both(Policy::Mw));
    // The server's NIC (a hostile server) READs the client's data region with a
    // guessed key: both QPs go to ERR. The client has no work request of its own
    // outstanding, only receives.
    let region = p.client.data_region();
    let dst = p.server.data_region();
    let qp = p.server.local().id;
    p.server
        .nic()
        .post_send(
            qp,
            &[SendWr::Read {
                wr_id: 0x77,
                signaled: true,
                local: SgeList::from([Sge { mr: dst.id, offset: 0, len: 64 }]),
                remote_addr: region.addr,
                rkey: region.rkey ^ 0x5a5a_0000,
            }],
        )
        .unwrap();
    assert!(
        p.drive_until(Duration::from_secs(1), |p| p.client.is_down().is_some()),
        "the victim must notice its QP was flushed"
    );
    assert!(
        p.client_events.iter().any(|e| matches!(e, Event::ConnectionLost(LossReason::Completion { .. }))),
        "{:?}",
        p.client_events
    );
    // A later call fails at once instead of timing out.
    let now = p.now();
    assert!(matches!(p.client.call(now, b"x", None).map_err(|r| r.error), Err(UseError::Down(_))));
    assert_no_hazards(&p.fabric);
}

// ---- 3. two payload attachments in one request ----

/// A raw peer on its own device: a QP connected to `peer`, a region it can
/// bind windows over, and a control region for frames.
struct RawPeer {
    nic: SimNic,
    cq: CqId,
    local: QpEndpoint,
}

impl RawPeer {
    fn new(fabric: &Fabric) -> RawPeer {
        let nic = fabric.add_device(DeviceConfig::spec().named("raw"));
        let cq = nic.create_cq(64).unwrap();
        let local = nic.create_qp(QpConfig::new(cq, cq)).unwrap();
        RawPeer { nic, cq, local }
    }
}

fn grant_bytes(lease: u64, addr: u64, len: u32, rkey: u32) -> Vec<u8> {
    let mut b = vec![1u8, 1];
    b.extend_from_slice(&lease.to_le_bytes());
    b.extend_from_slice(&addr.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&rkey.to_le_bytes());
    b.extend_from_slice(&5_000_000u32.to_le_bytes());
    b
}

#[test]
fn a_request_with_two_payloads_is_refused_and_holds_no_buffer() {
    let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(4) });
    let raw = RawPeer::new(&fabric);
    let p = Policies::both(Policy::Mw);
    let sn = fabric.add_device(DeviceConfig::spec().named("server"));
    let mut server = Link::new(sn, Role::Server, p, Config::default()).unwrap();
    let total = server.free_buffers();
    raw.nic.connect_qp(raw.local.id, &server.local()).unwrap();
    server.connect(&raw.local).unwrap();
    // A genuine window over 64 bytes of the raw peer's memory...
    let mr = raw.nic.reg_mr(4096, Access::LOCAL_WRITE | Access::MW_BIND).unwrap();
    raw.nic.write_mr(mr.id, 0, &[9; 64]).unwrap();
    let mw = raw.nic.alloc_mw().unwrap();
    let rkey = mwcap::backend::rkey::rebind(mw.rkey, 0x42);
    // ...granted twice in one request.
    let grant = grant_bytes(1 << 32 | 1, mr.addr, 64, rkey);
    let twice = [Attach::new(EngineTag::Mw, &grant).unwrap(), Attach::new(EngineTag::Mw, &grant).unwrap()];
    let frame = Frame::Request {
        msg_id: 1,
        trace: None,
        header: b"two",
        inline: b"",
        attach: Attaches::from_slice(&twice).unwrap(),
    };
    let bytes = frame.encode().unwrap();
    let ctrl = raw.nic.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    raw.nic.write_mr(ctrl.id, 0, &bytes).unwrap();
    raw.nic.post_recv(raw.local.id, 1, Sge { mr: ctrl.id, offset: 2048, len: 2048 }).unwrap();
    raw.nic
        .post_send(
            raw.local.id,
            &[
                SendWr::BindMw {
                    wr_id: 2,
                    signaled: false,
                    mw: mw.id,
                    rkey,
                    mr: mr.id,
                    offset: 0,
                    len: 64,
                    access: Access::REMOTE_READ,
                },
                SendWr::Send {
                    wr_id: 3,
                    signaled: true,
                    sge: SgeList::from([Sge { mr: ctrl.id, offset: 0, len: bytes.len() as u32 }]),
                },
            ],
        )
        .unwrap();
    let mut events = Vec::new();
    for _ in 0..200 {
        let now = fabric.now() + Duration::from_micros(100);
        fabric.run_until(now);
        server.handle_timeout(now);
        server.drive(now);
        while let Some(e) = server.poll_event() {
            events.push(e);
        }
        let _ = raw.nic.poll_cq_vec(raw.cq, 16);
    }
    let mut surfaced = 0;
    for e in events.drain(..) {
        match e {
            Event::Request { data, .. } => {
                surfaced += 1;
                if let Some(b) = data {
                    server.free(b);
                }
            }
            Event::BufferReturned(b) => server.free(b),
            _ => {}
        }
    }
    assert_eq!(surfaced, 0, "a request with two payloads is not handed to the user");
    assert!(
        matches!(
            server.is_down(),
            Some(LossReason::PeerMisbehaved(Misbehavior::TooManyPayloads { count: 2, .. }))
        ),
        "{:?}",
        server.is_down()
    );
    assert_eq!(server.free_buffers(), total, "no buffer held");
    assert_no_hazards(&fabric);
}

// ---- 4. confirm: a cancelled fetch releases the server's hold at once ----

#[test]
fn confirm_a_cancelled_call_releases_the_servers_reply_buffer_at_once() {
    for cancel_after_offer in [false, true] {
        let mut p = pair(Policies::both(Policy::Confirm));
        let now = p.now();
        let call = p.client.call(now, b"q", None).unwrap();
        let (req, _) = take_request(&mut p);
        if !cancel_after_offer {
            let now = p.now();
            assert!(p.client.cancel(now, call));
        }
        let b = filled(&mut p.server, &[3; 4000]);
        let now = p.now();
        // The client's Refuse is not there yet: the reply goes out.
        p.server.reply(now, req, 0, b"r", Some(b)).expect("the reply");
        if cancel_after_offer {
            p.settle();
            let now = p.now();
            p.client.cancel(now, call);
        }
        // The lease is 5 s; the buffer must come back long before.
        assert!(
            p.drive_until(Duration::from_millis(50), |p| p.server.busy_buffers() == 0),
            "cancel_after_offer={cancel_after_offer}: the server still holds its buffer"
        );
        assert!(p.client.is_down().is_none() && p.server.is_down().is_none());
        assert_eq!(p.client.busy_buffers(), 0);
        assert_no_hazards(&p.fabric);
    }
}

// ---- 5. mw: a cancelled call releases the reply without reading it ----

#[test]
fn mw_a_cancelled_call_releases_its_reply_without_reading_it() {
    let mut p = pair(Policies::both(Policy::Mw));
    let now = p.now();
    let call = p.client.call(now, b"q", None).unwrap();
    let (req, _) = take_request(&mut p);
    let now = p.now();
    assert!(p.client.cancel(now, call));
    let b = filled(&mut p.server, &[3; 60_000]);
    p.server.reply(now, req, 0, b"r", Some(b)).unwrap();
    assert!(p.drive_until(Duration::from_millis(50), |p| p.server.busy_buffers() == 0), "released at once");
    let read = p.fabric.qp_counters(p.client_qp()).unwrap().bytes_read;
    assert_eq!(read, 0, "the cancelled call's reply was READ");
    assert_eq!(p.client.busy_buffers(), 0);
    assert_no_hazards(&p.fabric);
}

// ---- 6. the confirm engine's message map does not grow ----

#[test]
fn confirm_message_bookkeeping_stays_bounded_over_many_calls() {
    let mut p = pair(Policies::both(Policy::Confirm));
    for i in 0..300u32 {
        let b = filled(&mut p.client, &i.to_le_bytes());
        let now = p.now();
        p.client.call(now, b"q", Some(b)).unwrap();
        let (req, data) = take_request(&mut p);
        p.server.free(data.expect("payload"));
        let b = filled(&mut p.server, b"r");
        let now = p.now();
        p.server.reply(now, req, 0, b"r", Some(b)).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| p
            .client_events
            .iter()
            .any(|e| matches!(e, Event::Reply { .. }))));
        assert!(p.drive_until(Duration::from_secs(1), |p| p.client.busy_buffers() == 0
            && p.server.busy_buffers() == 0));
        let events: Vec<Event> = p.client_events.drain(..).chain(p.server_events.drain(..)).collect();
        for e in events {
            if let Event::Reply { data: Some(b), .. } | Event::BufferReturned(b) = e {
                free_anywhere(&mut p, b);
            }
        }
    }
    assert!(p.client.tracked_messages() <= 2, "client tracks {}", p.client.tracked_messages());
    assert!(p.server.tracked_messages() <= 2, "server tracks {}", p.server.tracked_messages());
}

fn free_anywhere(p: &mut SimPair, b: Buf) {
    if p.client.owns(&b) {
        p.client.free(b);
    } else {
        p.server.free(b);
    }
}

// ---- 7. a peer that never posts receives ----

#[test]
fn a_peer_that_never_posts_receives_is_declared_dead_and_the_buffer_returns() {
    never_posting_peer(Config::default());
}

/// A user's `rnr_retry` of 7 ("retry forever" on a real NIC) is taken as
/// 6: the connection still goes down.
#[test]
fn a_users_rnr_retry_of_7_is_taken_as_6() {
    let mut cfg = Config::default();
    cfg.rnr_retry = 7;
    never_posting_peer(cfg);
}

/// The client (configured by `cfg`, both directions mw) calls a raw peer that never posts a
/// receive: it is declared dead within its RNR budget and its buffer
/// returns once the QP is destroyed.
fn never_posting_peer(cfg: Config) {
    let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(9) });
    let raw = RawPeer::new(&fabric);
    let cn = fabric.add_device(DeviceConfig::spec().named("client"));
    let mut client = Link::new(cn, Role::Client, Policies::both(Policy::Mw), cfg).unwrap();
    raw.nic.connect_qp(raw.local.id, &client.local()).unwrap();
    client.connect(&raw.local).unwrap();
    // Longer than `inline_max`, so it is exposed (inline payloads need no buffer back).
    let b = filled(&mut client, &[7; 1000]);
    let now = fabric.now();
    client.call(now, b"x", Some(b)).unwrap();
    let mut events = Vec::new();
    let mut t = fabric.now();
    while t < Duration::from_secs(2) {
        t += Duration::from_millis(1);
        fabric.run_until(t);
        client.handle_timeout(t);
        client.drive(t);
        if client.flushed() {
            // As the endpoint's driver does: the destroy is the evidence
            // the exposed buffer waits for.
            client.finish_close(t);
        }
        while let Some(e) = client.poll_event() {
            events.push(e);
        }
        if client.busy_buffers() == 0 && client.is_down().is_some() {
            break;
        }
    }
    assert!(t < Duration::from_secs(1), "took {t:?}: the lease is 5 s, the RNR budget far less");
    assert!(
        matches!(client.is_down(), Some(LossReason::Completion { status: WcStatus::RnrRetryExcErr, .. })),
        "{:?}",
        client.is_down()
    );
    assert!(events.iter().any(|e| matches!(e, Event::BufferReturned(_))), "{events:?}");
    assert_no_hazards(&fabric);
}

#[test]
fn queue_pairs_have_a_finite_rnr_budget() {
    let nic = Fabric::with_seed(1).add_device(DeviceConfig::spec());
    let cq = nic.create_cq(4).unwrap();
    let c = QpConfig::new(cq, cq);
    assert!(c.rnr_retry < 7, "7 means retry forever on real NICs");
}
