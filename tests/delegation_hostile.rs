//! Delegation against a peer that runs none of mwcap's code (the hostile
//! world of `tests/hostile/mod.rs`, on the simulated NIC with manual
//! progress): the delegate redeems a token with a hand-written `Ask`
//! frame and READs through the window the owner binds for it. The owner's
//! revocation invalidates that window while the delegate still holds it;
//! the window ends by the token's expiry even when the connection's lease
//! is longer; a redemption carrying a payload takes only that connection
//! down. Every test ends with the world's checks (the victim's other
//! connection healthy, no hazard, every bind invalidated once).

mod hostile;

use std::time::Duration;

use hostile::*;
use mwcap::backend::WcStatus;
use mwcap::conn::frame::{Attaches, Frame};
use mwcap::conn::{Event, LossReason, Misbehavior, OwnerAsk, Policies, Policy, RegionId, RegionRange, Role};
use mwcap_fallback as fb;
use mwcap_mw as mw;

const MW: Policies = Policies { request: Policy::Mw, reply: Policy::Mw };
const CONFIRM: Policies = Policies { request: Policy::Mw, reply: Policy::Confirm };

/// A victim server whose peer proved "compute", with a region of `GRANTED`
/// bytes: the region and the range delegated below.
fn world() -> (World, RegionId, RegionRange) {
    world_under(MW)
}

fn world_under(policies: Policies) -> (World, RegionId, RegionRange) {
    let mut w = World::server(policies);
    w.victim.set_peer_identity("compute");
    let region = w.victim.register_region(64 << 10).unwrap();
    w.victim.region_write(region, 0, &vec![GRANTED; 64 << 10]).unwrap();
    (w, region, RegionRange { region, offset: 4096, len: 1000 })
}

/// The attacker redeems `token` as request `msg_id` (with a confirm fetch
/// of the reply under confirm): the victim's reply.
fn redeem(w: &mut World, msg_id: u64, token: &[u8]) -> Seen {
    ask(w, msg_id, &OwnerAsk::Redeem { token }.encode())
}

/// The attacker asks the victim's library `body` as request `msg_id`.
fn ask(w: &mut World, msg_id: u64, body: &[u8]) -> Seen {
    let mut attach = Attaches::new();
    if w.policies.reply == Policy::Confirm {
        let fetch = fb::Message::Fetch { msg: fb::MsgId::from_raw(msg_id), attempt: 1 };
        attach.push(fb_attach(fetch)).unwrap();
    }
    w.send_within_credit(&Frame::Ask { msg_id, body, attach }.encode().unwrap());
    Seen::of(&w.next_frame())
}

/// A window of `range` (at `addr`, `rkey`, `len`) was just revoked while
/// the attacker held it: the range stays pinned until the evidence, a READ
/// through the window fails, the owner engine revoked once, the range is
/// the owner's again once the invalidation completed, and every bind was
/// invalidated once.
fn a_revoked_window_ends(mut w: World, range: RegionRange, (addr, rkey, len): (u64, u32, u32)) {
    let region = range.region;
    assert!(w.victim.region_write(region, range.offset, b"new").is_err(), "pinned until the evidence");
    w.settle();
    let (status, _) = w.read(addr, rkey, len);
    assert_ne!(status, WcStatus::Success, "a READ through a revoked window fails");
    let stats = w.victim.stats().lease_owner.unwrap();
    assert_eq!(stats.revoked, 1, "one revocation, by the owner engine");
    assert!(
        writable_within(&mut w, range, Duration::from_millis(50)),
        "the range is the owner's again once the invalidation completed"
    );
    w.assert_binds_invalidated_once();
    w.finish();
}

/// Whether `range` can be written again within `limit` (its exposures'
/// evidence came).
fn writable_within(w: &mut World, range: RegionRange, limit: Duration) -> bool {
    w.run_until(limit, |w| w.victim.region_write(range.region, range.offset, b"new").is_ok())
}

#[test]
fn a_revoked_delegation_invalidates_the_window_its_delegate_holds() {
    let (mut w, _, range) = world();
    let d = w.victim.delegate_region(w.now(), range, "compute", Duration::from_secs(10)).unwrap();
    let seen = redeem(&mut w, 1, d.token.as_bytes());
    assert_eq!(seen.kind, "reply");
    let (addr, len, rkey) = seen.target();
    assert_eq!(len, range.len, "the window covers exactly the range");
    let (status, bytes) = w.read(addr, rkey, len);
    assert_eq!(status, WcStatus::Success);
    assert!(bytes.iter().all(|&b| b == GRANTED));
    // The delegate holds the window (no release). The owner revokes.
    w.victim.revoke(d.cap).unwrap();
    a_revoked_window_ends(w, range, (addr, rkey, len));
}

#[test]
fn revoking_one_of_two_delegations_of_one_range_ends_its_own_window() {
    // Two delegations of the same range, both redeemed on one connection:
    // two windows. Revoking the second ends the second's window, not the
    // first's, whose delegate reads on (the connection told its exposures
    // apart by range alone, and ended the first's).
    let (mut w, _, range) = world();
    let ttl = Duration::from_secs(10);
    let a = w.victim.delegate_region(w.now(), range, "compute", ttl).unwrap();
    let b = w.victim.delegate_region(w.now(), range, "compute", ttl).unwrap();
    let (addr_a, len_a, rkey_a) = redeem(&mut w, 1, a.token.as_bytes()).target();
    let (addr_b, len_b, rkey_b) = redeem(&mut w, 2, b.token.as_bytes()).target();
    assert_ne!(rkey_a, rkey_b, "two windows");
    w.victim.revoke(b.cap).unwrap();
    w.settle();
    w.run_for(Duration::from_millis(5));
    // (A READ that fails takes the attacker's QP down: the first's first.)
    let (status, bytes) = w.read(addr_a, rkey_a, len_a);
    assert_eq!(status, WcStatus::Success, "the other delegation's window is still bound");
    assert!(bytes.iter().all(|&b| b == GRANTED));
    assert_ne!(w.read(addr_b, rkey_b, len_b).0, WcStatus::Success, "the revoked delegation's window ended");
    // The failed READ took the connection down too: the first's window
    // ends with it, and the range is the owner's again after both.
    assert!(
        writable_within(&mut w, range, Duration::from_millis(50)),
        "the range is the owner's again once both exposures ended"
    );
    let s = w.victim.stats().lease_owner.unwrap();
    assert_eq!(
        (s.grants, s.revoked, s.invalidations),
        (2, 1, 1),
        "B's window invalidated, A's ended with the QP: {s:?}"
    );
    w.finish();
}

#[test]
fn a_delegated_window_ends_by_the_tokens_expiry_not_the_connections_lease() {
    let (mut w, region, range) = world();
    // The connection's lease is LEASE (100 ms); the token lives 30 ms.
    let ttl = Duration::from_millis(30);
    assert!(ttl < LEASE);
    let d = w.victim.delegate_region(w.now(), range, "compute", ttl).unwrap();
    let seen = redeem(&mut w, 1, d.token.as_bytes());
    let (addr, len, rkey) = seen.target();
    assert_eq!(w.read(addr, rkey, len).0, WcStatus::Success);
    let grant = seen.grant.expect("an mw grant");
    w.run_for(ttl + Duration::from_millis(5));
    let (status, _) = w.read(addr, rkey, len);
    assert_ne!(status, WcStatus::Success, "the window was invalidated by the token's expiry ({grant:?})");
    assert!(
        w.run_until(Duration::from_millis(20), |w| w.victim.region_write(region, range.offset, b"x").is_ok())
    );
    let s = w.victim.stats().lease_owner.unwrap();
    assert_eq!((s.expired, s.revoked), (1, 0), "ended by its expiry: {s:?}");
    w.assert_binds_invalidated_once();
    // (The late READ's remote access error took this connection down, as
    // any READ outside a grant does; the victim's other one runs on.)
    w.finish();
}

/// Under confirm as under mw: the offer of a delegated range is held until
/// the token's expiry, not the connection's lease, so a read confirmed
/// after it is stale and the range is the owner's again. (It was held for
/// the connection's lease: a delegate could have its read confirmed
/// `Intact` after its token expired.)
#[test]
fn under_confirm_a_delegated_offer_ends_by_the_tokens_expiry_not_the_connections_lease() {
    let (mut w, region, range) = world_under(CONFIRM);
    let ttl = Duration::from_millis(30);
    assert!(ttl < LEASE);
    let d = w.victim.delegate_region(w.now(), range, "compute", ttl).unwrap();
    let seen = redeem(&mut w, 1, d.token.as_bytes());
    let (msg, buffer, generation, _) = seen.exposed.expect("an offer");
    let (addr, len, rkey) = seen.target();
    assert_eq!(w.read(addr, rkey, len).0, WcStatus::Success);
    w.run_for(ttl + Duration::from_millis(5));
    assert!(
        w.run_until(Duration::from_millis(20), |w| w.victim.region_write(region, range.offset, b"x").is_ok()),
        "the range is the owner's once the token expired"
    );
    let verdict = w.verdict(fb::Message::Confirm { msg, buffer, generation });
    assert_eq!(verdict, fb::Verdict::Reused, "a read confirmed after the token's expiry is stale");
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn a_redemption_carrying_a_payload_takes_only_its_connection_down() {
    let (mut w, _, range) = world();
    let d = w.victim.delegate_region(w.now(), range, "compute", Duration::from_secs(10)).unwrap();
    let own = w.attacker.bind_own(64);
    let grant = mw::Grant {
        lease: mw::LeaseId::from_raw(1),
        addr: w.attacker.mem.addr,
        len: 64,
        rkey: own,
        time_left: Duration::from_secs(1),
    };
    let mut attach = Attaches::new();
    attach.push(mw_attach(mw::Message::Grant(grant))).unwrap();
    let body = OwnerAsk::Redeem { token: d.token.as_bytes() }.encode();
    w.send_within_credit(&Frame::Ask { msg_id: 1, body: &body, attach }.encode().unwrap());
    assert!(w.run_until(Duration::from_millis(50), |w| w.down().is_some()));
    assert!(
        matches!(w.down(), Some(LossReason::PeerMisbehaved(Misbehavior::PayloadOnRedemption { msg: 1 }))),
        "{:?}",
        w.down()
    );
    assert!(!w.events.iter().any(|e| matches!(e, Event::Request { .. })), "nothing reached the application");
    w.finish();
}

#[test]
fn under_confirm_a_revoked_delegation_withdraws_the_offer_and_its_read_is_never_confirmed() {
    let (mut w, _, range) = world_under(CONFIRM);
    let d = w.victim.delegate_region(w.now(), range, "compute", Duration::from_secs(10)).unwrap();
    let seen = redeem(&mut w, 1, d.token.as_bytes());
    assert_eq!(seen.kind, "reply");
    let (msg, buffer, generation, _) = seen.exposed.expect("an offer");
    let (addr, len, rkey) = seen.target();
    let (status, bytes) = w.read(addr, rkey, len);
    assert_eq!(status, WcStatus::Success);
    assert!(bytes.iter().all(|&b| b == GRANTED));
    // Read, not yet confirmed. The owner revokes: the offer is withdrawn,
    // and the range is the owner's again at once.
    w.victim.revoke(d.cap).unwrap();
    assert!(
        writable_within(&mut w, range, Duration::from_millis(5)),
        "the range is written again once the offer was withdrawn"
    );
    // The delegate's confirm of what it read: never `Intact`.
    let verdict = w.verdict(fb::Message::Confirm { msg, buffer, generation });
    assert_eq!(verdict, fb::Verdict::Reused, "the read of a withdrawn offer is stale");
    // Asked again, the owner's library refuses: a delegation is exposed once.
    w.attacker.frames.clear();
    let again = fb::Message::Fetch { msg, attempt: 2 };
    w.send(&engine_frame(fb_attach(again)));
    let (reply, status) = loop {
        let bytes = w.next_frame();
        if let Ok(Frame::Reply { status, .. }) = Frame::decode(&bytes) {
            break (Seen::of(&bytes), status);
        }
    };
    assert_eq!(reply.msg_id, Some(1));
    assert!(reply.exposed.is_none(), "nothing is offered again");
    assert_eq!(status, 7, "refused as stale (`Refusal::Stale`)");
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn under_confirm_revoking_one_of_two_delegations_of_one_range_withdraws_its_own_offer() {
    // As revoking_one_of_two_delegations_of_one_range_ends_its_own_window:
    // revoking the second withdraws the second's offer, and the first's
    // read is still confirmed intact.
    let (mut w, _, range) = world_under(CONFIRM);
    let ttl = Duration::from_secs(10);
    let a = w.victim.delegate_region(w.now(), range, "compute", ttl).unwrap();
    let b = w.victim.delegate_region(w.now(), range, "compute", ttl).unwrap();
    let mut offers = Vec::new();
    for (msg_id, d) in [(1, &a), (2, &b)] {
        let seen = redeem(&mut w, msg_id, d.token.as_bytes());
        let (msg, buffer, generation, _) = seen.exposed.expect("an offer");
        let (addr, len, rkey) = seen.target();
        assert_eq!(w.read(addr, rkey, len).0, WcStatus::Success);
        offers.push((msg, buffer, generation));
    }
    w.victim.revoke(b.cap).unwrap();
    w.run_for(Duration::from_millis(2));
    let [(ma, ba, ga), (mb, bb, gb)] = [offers[0], offers[1]];
    let verdict_b = w.verdict(fb::Message::Confirm { msg: mb, buffer: bb, generation: gb });
    assert_eq!(verdict_b, fb::Verdict::Reused, "the revoked delegation's read is stale");
    let verdict_a = w.verdict(fb::Message::Confirm { msg: ma, buffer: ba, generation: ga });
    assert_eq!(verdict_a, fb::Verdict::Intact, "the other delegation's read stands");
    assert!(w.down().is_none());
    w.finish();
}

/// The peer is the holder and the delegate at once (a holder may delegate
/// to its own identity): it hands its capability on, redeems the new
/// token and READs through the window; then, as the holder, revokes the
/// delegation while it holds the window: the window is invalidated (one
/// `Owner::revoke`), the READ fails, and the range comes back only on the
/// invalidation's evidence. Asks it has no right to make are refused with
/// their reason, and only that ask: the connection runs on.
#[test]
fn a_holder_revoking_what_it_delegated_invalidates_the_window_being_read() {
    let (mut w, _, range) = world();
    let d = w.victim.delegate_region(w.now(), range, "compute", Duration::from_secs(10)).unwrap();
    // Wider than the capability: refused, the token not used.
    let wide = OwnerAsk::DelegateOn {
        token: d.token.as_bytes(),
        offset: 0,
        len: range.len + 1,
        ttl_ms: 1000,
        identity: "compute",
    };
    let seen = ask(&mut w, 1, &wide.encode());
    assert_eq!(seen.status, Some(9), "OutsideCapability: {}", String::from_utf8_lossy(&seen.header));
    // An op the owner does not know.
    let seen = ask(&mut w, 2, &[42, 1, 2, 3]);
    assert_eq!(seen.status, Some(11), "Malformed: {}", String::from_utf8_lossy(&seen.header));
    // A part of it, to itself.
    let on = OwnerAsk::DelegateOn {
        token: d.token.as_bytes(),
        offset: 100,
        len: 500,
        ttl_ms: 5000,
        identity: "compute",
    };
    let seen = ask(&mut w, 3, &on.encode());
    assert_eq!(seen.status, Some(0), "{}", String::from_utf8_lossy(&seen.header));
    let (cap, token) = seen.header.split_at(8);
    let cap = mwcap::conn::CapId(u64::from_le_bytes(cap.try_into().unwrap()));
    let seen = redeem(&mut w, 4, token);
    let (addr, len, rkey) = seen.target();
    assert_eq!(len, 500, "the window covers exactly the part");
    let (status, bytes) = w.read(addr, rkey, len);
    assert_eq!(status, WcStatus::Success);
    assert!(bytes.iter().all(|&b| b == GRANTED));
    // The application's own delegation cannot be revoked by the peer.
    let seen = ask(&mut w, 5, &OwnerAsk::Revoke { cap: d.cap }.encode());
    assert_eq!(seen.status, Some(10), "NotHolder: {}", String::from_utf8_lossy(&seen.header));
    // As the holder, it revokes what it delegated, window and all.
    let seen = ask(&mut w, 6, &OwnerAsk::Revoke { cap }.encode());
    assert_eq!(seen.status, Some(0), "{}", String::from_utf8_lossy(&seen.header));
    a_revoked_window_ends(w, range, (addr, rkey, len));
}

/// A peer that delegates its capability to itself, again and again, each
/// time with the token it got back, would grow the owner's book (and the
/// walks of its tree, under the lock every connection's delegation work
/// takes) for as long as the root lives. The chain stops at `MAX_DEPTH`:
/// the next hand-on is refused `OutsideCapability` with its token unused,
/// which still redeems, and the connection runs on.
#[test]
fn a_chain_of_hand_ons_stops_at_the_books_depth() {
    let (mut w, _, range) = world();
    let d = w.victim.delegate_region(w.now(), range, "compute", Duration::from_secs(10)).unwrap();
    let mut token = d.token.as_bytes().to_vec();
    let mut msg = 1;
    // The application's delegation is one from the root; each hand-on one more.
    for depth in 2..=mwcap_delegation::MAX_DEPTH {
        // Each a little shorter than the one it is made from.
        let ttl_ms = 9000 - 100 * u32::from(depth);
        let on = OwnerAsk::DelegateOn { token: &token, offset: 0, len: 0, ttl_ms, identity: "compute" };
        let seen = ask(&mut w, msg, &on.encode());
        msg += 1;
        assert_eq!(seen.status, Some(0), "hand-on {depth}: {}", String::from_utf8_lossy(&seen.header));
        token = seen.header[8..].to_vec();
    }
    let on = OwnerAsk::DelegateOn { token: &token, offset: 0, len: 0, ttl_ms: 1000, identity: "compute" };
    let seen = ask(&mut w, msg, &on.encode());
    let words = String::from_utf8_lossy(&seen.header).into_owned();
    assert_eq!(seen.status, Some(9), "OutsideCapability: {words}");
    assert!(words.contains("a chain of delegations stops"), "{words}");
    assert!(w.victim.is_down().is_none(), "the connection runs on");
    // The token it could not hand on is still its own to redeem.
    let seen = redeem(&mut w, msg + 1, &token);
    let (addr, len, rkey) = seen.target();
    assert_eq!(len, range.len);
    assert_eq!(w.read(addr, rkey, len).0, WcStatus::Success);
}

/// A holder's call for a delegation, from a hostile peer: malformed fields
/// and a life longer than the owner's lease are refused before the
/// application sees the call (the connection runs on); a well-formed one
/// reaches the application marked delegated, which cannot delegate a
/// buffer (handed back) and replies with a range of its region. That
/// range comes back as a token, never as a window on the caller's QP; the
/// caller, named as the delegate, redeems it for a window over exactly the
/// range, and revokes it while it reads: the window is invalidated and the
/// range comes back on evidence.
#[test]
fn a_call_for_a_delegation_exposes_nothing_to_its_caller_and_is_revoked_by_it() {
    let (mut w, _, range) = world();
    let seen = ask(&mut w, 1, &[4, 1, 0]);
    assert_eq!(seen.status, Some(11), "Malformed: {}", String::from_utf8_lossy(&seen.header));
    // Well-formed, but naming nobody: refused by the library.
    let nobody = OwnerAsk::Call { ttl_ms: 50, identity: "", header: b"get" };
    let seen = ask(&mut w, 2, &nobody.encode());
    assert_eq!((seen.status, seen.header.first()), (Some(11), Some(&2)), "Malformed, by the library");
    let long = OwnerAsk::Call { ttl_ms: 600_000, identity: "compute", header: b"get" };
    let seen = ask(&mut w, 3, &long.encode());
    assert_eq!((seen.status, seen.header.first()), (Some(9), Some(&2)), "OutsideCapability, by the library");
    assert!(w.events.iter().all(|e| !matches!(e, Event::Request { .. })), "the application saw neither");
    let ttl_ms = u32::try_from(LEASE.as_millis()).unwrap();
    let call = OwnerAsk::Call { ttl_ms, identity: "compute", header: b"get" };
    w.send_within_credit(
        &Frame::Ask { msg_id: 4, body: &call.encode(), attach: Attaches::new() }.encode().unwrap(),
    );
    assert!(w.run_until(Duration::from_millis(50), |w| w
        .events
        .iter()
        .any(|e| matches!(e, Event::Request { .. }))));
    let pos = w.events.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
    let Event::Request { req, header, data: None, delegated: true, .. } = w.events.remove(pos) else {
        panic!("a call for a delegation reaches the application marked, without a payload")
    };
    assert_eq!(&header[..], b"get");
    let buf = w.granted_buf();
    let now = w.now();
    let refused = w.victim.reply(now, req, 0, b"", Some(buf)).unwrap_err();
    assert!(matches!(refused.error, mwcap::conn::UseError::NotDelegable(4)), "{}", refused.error);
    w.victim.free(refused.data.expect("handed back"));
    w.victim.reply_region(now, req, 0, b"blk", range, None).unwrap();
    let seen = Seen::of(&w.next_frame());
    assert_eq!((seen.status, seen.grant.is_none(), seen.exposed.is_none()), (Some(0), true, true));
    let (&kind, rest) = seen.header.split_first().unwrap();
    assert_eq!(kind, 1, "a delegation");
    let cap = mwcap::conn::CapId(u64::from_le_bytes(rest[..8].try_into().unwrap()));
    let len = usize::from(u16::from_le_bytes(rest[8..10].try_into().unwrap()));
    let (token, app) = rest[10..].split_at(len);
    assert_eq!(app, b"blk");
    let seen = redeem(&mut w, 5, token);
    let (addr, len, rkey) = seen.target();
    assert_eq!(len, range.len, "the window covers exactly the range");
    let (status, bytes) = w.read(addr, rkey, len);
    assert_eq!(status, WcStatus::Success);
    assert!(bytes.iter().all(|&b| b == GRANTED));
    let seen = ask(&mut w, 6, &OwnerAsk::Revoke { cap }.encode());
    assert_eq!(seen.status, Some(0), "{}", String::from_utf8_lossy(&seen.header));
    a_revoked_window_ends(w, range, (addr, rkey, len));
}

/// A call for a delegation whose connection goes down before the
/// application replies: the reply with a range is refused `Down`, nothing
/// of the range stays pinned (the delegation it would have carried is
/// taken back at once, not left to its expiry), also for a second reply.
#[test]
fn a_call_for_a_delegation_answered_after_its_connection_went_down_pins_nothing() {
    let (mut w, region, range) = world();
    let ttl_ms = u32::try_from(LEASE.as_millis()).unwrap();
    let call = OwnerAsk::Call { ttl_ms, identity: "compute", header: b"get" };
    w.send_within_credit(
        &Frame::Ask { msg_id: 1, body: &call.encode(), attach: Attaches::new() }.encode().unwrap(),
    );
    assert!(w.run_until(Duration::from_millis(50), |w| w
        .events
        .iter()
        .any(|e| matches!(e, Event::Request { .. }))));
    let (req, _) = w.take_request();
    let now = w.now();
    w.victim.begin_close(now);
    for _ in 0..2 {
        let err = w.victim.reply_region(now, req, 0, b"", range, None).unwrap_err();
        assert!(
            matches!(err, mwcap::conn::UseError::Down(_) | mwcap::conn::UseError::NoSuchRequest(_)),
            "{err}"
        );
        assert!(w.victim.region_write(region, range.offset, b"new").is_ok(), "nothing pinned");
    }
}

/// A server with one region exposure, held by the attacker's window of a
/// first delegation (read, never released), while the redemption of a
/// second delegation, whose token lives `ttl`, waits for capacity as
/// request 2: (world, the held window's range and its `(addr, len,
/// rkey)`, the waiting range, the waiting delegation).
fn a_redemption_waiting_for_capacity(
    ttl: Duration,
) -> (World, RegionRange, (u64, u32, u32), RegionRange, mwcap::conn::Delegation) {
    let mut w = World::with_config(Role::Server, MW, |c| c.region_exposures = 1);
    w.victim.set_peer_identity("compute");
    let region = w.victim.register_region(64 << 10).unwrap();
    w.victim.region_write(region, 0, &vec![GRANTED; 64 << 10]).unwrap();
    let (first, second) =
        (RegionRange { region, offset: 0, len: 1000 }, RegionRange { region, offset: 8192, len: 1000 });
    let a = w.victim.delegate_region(w.now(), first, "compute", Duration::from_secs(10)).unwrap();
    let b = w.victim.delegate_region(w.now(), second, "compute", ttl).unwrap();
    let held = redeem(&mut w, 1, a.token.as_bytes()).target();
    assert_eq!(w.read(held.0, held.2, held.1).0, WcStatus::Success, "the first window is held (no release)");
    let frame = Frame::Ask {
        msg_id: 2,
        body: &OwnerAsk::Redeem { token: b.token.as_bytes() }.encode(),
        attach: Attaches::new(),
    };
    w.send_within_credit(&frame.encode().unwrap());
    w.settle();
    assert!(w.attacker.frames.is_empty(), "no answer while no exposure is free");
    assert!(w.victim.region_write(region, second.offset, b"new").is_err(), "pinned while it waits");
    (w, first, held, second, b)
}

/// The waiting redemption of `a_redemption_waiting_for_capacity` is
/// refused with `status`, nothing exposed; its range is the owner's again
/// at once, and the held window's range stays pinned.
fn refused_never_exposed(w: &mut World, first: RegionRange, second: RegionRange, status: u8, why: &str) {
    let seen = Seen::of(&w.next_frame());
    assert_eq!(
        (seen.kind, seen.msg_id, seen.status),
        ("reply", Some(2), Some(status)),
        "refused {why}: {seen:?}"
    );
    assert!(seen.grant.is_none(), "nothing exposed");
    assert!(
        w.victim.region_write(second.region, second.offset, b"new").is_ok(),
        "the {why} range is unpinned"
    );
    assert!(
        w.victim.region_write(first.region, first.offset, b"new").is_err(),
        "the held window's range stays pinned"
    );
}

/// A redemption waits for capacity (the one region exposure is held) past
/// its token's expiry: it is refused as expired when too little of the
/// token's life is left for a READ, and its range is the owner's again
/// then, not when capacity comes back (before, it stayed pinned until then
/// and was exposed after its token's expiry, with its lease counted again
/// from that moment).
#[test]
fn a_redemption_waiting_for_capacity_past_its_tokens_expiry_is_refused_never_exposed() {
    // The held window's lease (100 ms, `LEASE`) outlives the second token.
    let (mut w, first, _, second, _) = a_redemption_waiting_for_capacity(Duration::from_millis(50));
    // Past the second token's expiry less the safety margin (10 ms), before
    // the first window's lease ends.
    w.run_for(Duration::from_millis(60));
    refused_never_exposed(&mut w, first, second, 4, "expired");
    w.finish();
}

/// A redemption whose answer waits for capacity (every region exposure
/// is live: the delegate holds the first window) and is revoked meanwhile
/// is refused `Revoked` and never exposed, and its range is unpinned at
/// once; the window held stays until its own end.
#[test]
fn a_redemption_revoked_while_it_waits_for_capacity_is_refused_never_exposed() {
    let (mut w, first, (addr, len, rkey), second, b) =
        a_redemption_waiting_for_capacity(Duration::from_secs(10));
    w.victim.revoke(b.cap).unwrap();
    refused_never_exposed(&mut w, first, second, 5, "revoked");
    assert_eq!(w.read(addr, rkey, len).0, WcStatus::Success, "the held window is untouched");
    w.finish();
}
