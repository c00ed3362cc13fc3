//! Scripted scenarios: the real owner and reader in `support::World` (NIC
//! model, RC channels, virtual clock), driven step by step, then asserted on
//! their events and on the NIC's ghost counters.

mod support;

use std::time::Duration;

use mwcap_mw::{
    Buffer, DeclineReason, GrantError, LeaseEnd, LossCause, Misbehavior, Owner, OwnerAction, OwnerEvent,
    ReadError, Reader, ReaderAction, ReaderConfig, ReaderEvent, Release, ReleaseMode, Status, Window,
};
use support::{at, Config, Step, WinState, World};

fn world(cfg: &Config) -> World {
    let mut w = World::new(cfg);
    w.log = true;
    w
}

fn run(w: &mut World, cfg: &Config, steps: &[Step]) {
    for &s in steps {
        let mut enabled = Vec::new();
        w.enabled(cfg, &mut enabled);
        assert!(enabled.contains(&s), "{s:?} not enabled; enabled: {enabled:?}");
        w.step(cfg, s);
    }
}

fn returned(w: &World) -> Vec<(LeaseEnd, bool)> {
    w.owner_events
        .iter()
        .filter_map(|e| match e {
            OwnerEvent::BufferReturned { end, cancelled, .. } => Some((*end, *cancelled)),
            _ => None,
        })
        .collect()
}

fn assert_clean(w: &World) {
    assert_eq!(w.violation, None);
    assert!(w.never_over_invalidated());
}

#[test]
fn server_owned_reply_read_then_released_then_invalidated() {
    let cfg = Config::small(ReleaseMode::Message);
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }]);
    w.settle(&cfg);
    assert_clean(&w);
    assert_eq!(w.now, 0, "no timer was needed");
    assert!(matches!(w.reader_events[0], ReaderEvent::ReadDone { len: 64, release: None, .. }));
    assert_eq!(returned(&w), vec![(LeaseEnd::Released, false)]);
    assert_eq!((w.binds.clone(), w.invalidations.clone()), (vec![1, 0], vec![1, 0]));
    assert!(matches!(w.windows[0], WinState::Invalid { .. }));
    let s = w.owner.stats();
    assert_eq!((s.grants, s.released, s.expired, s.invalidations), (1, 1, 0, 1));
    assert_eq!(w.owner.poll_timeout(), None);
    assert_eq!(w.owner.free_windows(), 2);
}

#[test]
fn client_owned_request_release_rides_the_response() {
    let cfg = Config::small(ReleaseMode::Piggyback);
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }, Step::OwnerSq, Step::OwnerSq, Step::ToReader]);
    run(&mut w, &cfg, &[Step::ReaderSq, Step::ToOwner, Step::Serve, Step::ToReader, Step::ReaderCq]);
    let ReaderEvent::ReadDone { lease, release: Some(release), .. } = w.reader_events[0] else {
        panic!("expected a read with a release to piggyback: {:?}", w.reader_events)
    };
    assert_eq!(release.lease, lease);
    assert!(w.reader_sq.is_empty(), "no release message of its own");
    assert!(returned(&w).is_empty(), "the buffer waits for the response");
    run(&mut w, &cfg, &[Step::Respond, Step::ReaderSq, Step::ToOwner, Step::OwnerSq, Step::OwnerCq]);
    w.settle(&cfg);
    assert_clean(&w);
    assert_eq!(returned(&w), vec![(LeaseEnd::Released, false)]);
    assert_eq!(w.invalidations, vec![1, 0]);
}

#[test]
fn release_racing_the_expiry_invalidates_once() {
    let cfg = Config::small(ReleaseMode::Message);
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }, Step::OwnerSq, Step::OwnerSq, Step::OwnerCq, Step::ToReader]);
    run(&mut w, &cfg, &[Step::ReaderSq, Step::ToOwner, Step::Serve, Step::ToReader, Step::ReaderCq]);
    run(&mut w, &cfg, &[Step::ReaderSq]); // the release is on the wire
    w.now = cfg.lease;
    run(&mut w, &cfg, &[Step::OwnerTimer, Step::ToOwner]); // expiry first, then the release
    w.settle(&cfg);
    assert_clean(&w);
    let s = w.owner.stats();
    assert_eq!((s.expired, s.released, s.stale_releases, s.invalidations), (1, 0, 1, 1));
    assert_eq!(w.invalidations, vec![1, 0]);
    assert_eq!(returned(&w), vec![(LeaseEnd::Expired, false)]);
    assert!(!w.a_err && !w.b_err, "a healthy connection survives the race");
}

#[test]
fn late_read_after_expiry_flushes_and_everything_returns_on_evidence() {
    let cfg = Config::small(ReleaseMode::Message);
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }, Step::Grant { buf: 1 }]);
    run(&mut w, &cfg, &[Step::OwnerSq, Step::OwnerSq, Step::OwnerSq, Step::OwnerSq, Step::ToReader]);
    run(&mut w, &cfg, &[Step::ReaderSq, Step::ToOwner]); // the first READ is being served...
    w.now = cfg.lease;
    run(&mut w, &cfg, &[Step::OwnerTimer, Step::OwnerSq]); // ...when the expiry invalidates its window
    assert!(w.a_err, "rxe: the owner's QP goes to ERR");
    assert!(w.serving.is_empty(), "the READ hangs");
    assert_eq!(w.reader.outstanding_reads(), 1);
    w.settle(&cfg);
    assert_clean(&w);
    // The reader's timeout flushed its QP; the destination came back only
    // with the flush completion (the world checks that no READ could still
    // write it).
    assert!(w.b_err);
    assert!(w.reader_events.iter().any(|e| matches!(e, ReaderEvent::ReadTimedOut { .. })));
    assert!(w
        .reader_events
        .iter()
        .any(|e| matches!(e, ReaderEvent::ReadFailed { error: ReadError::TimedOut, .. })));
    assert!(w.dests.iter().all(|d| d.free));
    // Both leases expired at once: the first LOCAL_INV killed the owner's
    // QP (the READ under it), the second was flushed unexecuted. The owner
    // got both buffers back at the QP's destroy and retired its windows.
    assert_eq!(returned(&w), vec![(LeaseEnd::Expired, false), (LeaseEnd::Expired, false)]);
    assert!(w.all_buffers_home());
    assert_eq!(w.invalidations, vec![1, 0], "nothing invalidated twice; the second bind died with the QP");
    let retired = w.owner_events.iter().filter(|e| matches!(e, OwnerEvent::WindowRetired { .. })).count();
    assert_eq!(retired, 2);
}

#[test]
fn too_short_a_lease_is_declined_and_released_at_once() {
    let cfg = Config { lease: 1, margin: 1, ..Config::small(ReleaseMode::Message) };
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }]);
    w.settle(&cfg);
    assert_clean(&w);
    assert!(matches!(
        w.reader_events[0],
        ReaderEvent::Declined { reason: DeclineReason::LeaseTooShort { .. }, release: None, .. }
    ));
    assert_eq!(w.reader.stats().reads, 0);
    // The owner hears that it was not read.
    assert_eq!(returned(&w), vec![(LeaseEnd::Unread, false)]);
    assert_eq!(w.now, 0);
}

#[test]
fn cancel_waits_for_the_expiry_then_returns() {
    let cfg = Config { cancels: 1, peer_death: Some(100), ..Config::small(ReleaseMode::Message) };
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }, Step::OwnerSq, Step::OwnerSq, Step::PeerDies, Step::Cancel]);
    w.settle(&cfg);
    w.advance(&cfg, cfg.lease - 1);
    assert!(returned(&w).is_empty(), "the window stays bound until the lease ends");
    assert!(matches!(w.windows[0], WinState::Bound { .. }));
    w.advance(&cfg, 1);
    assert_clean(&w);
    assert_eq!(returned(&w), vec![(LeaseEnd::Expired, true)]);
    assert!(!w.a_err, "a cancel never tears the connection down");
}

#[test]
fn dead_peer_every_buffer_returns_by_expiry() {
    let cfg = Config { peer_death: Some(100), ..Config::small(ReleaseMode::Message) };
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::PeerDies, Step::Grant { buf: 0 }, Step::Grant { buf: 1 }]);
    w.advance(&cfg, cfg.lease);
    assert_clean(&w);
    assert!(w.all_buffers_home());
    assert_eq!(w.invalidations, vec![1, 1]);
}

#[test]
fn peer_send_with_invalidate_is_hostile_and_never_double_invalidated() {
    let cfg = Config { hostile: true, ..Config::small(ReleaseMode::Message) };
    let mut w = world(&cfg);
    run(&mut w, &cfg, &[Step::Grant { buf: 0 }, Step::OwnerSq, Step::OwnerSq, Step::ToReader]);
    run(&mut w, &cfg, &[Step::PeerSendsWithInv, Step::ToOwner]);
    assert!(w.owner_events.iter().any(|e| matches!(
        e,
        OwnerEvent::PeerMisbehaved(Misbehavior::SendWithInvalidate { window: Some(100), .. })
    )));
    assert!(w.owner_events.contains(&OwnerEvent::ConnectionLost { cause: LossCause::HostilePeer }));
    assert!(w.a_err, "the owner flushed the connection");
    w.advance(&cfg, cfg.lease + 2);
    assert_clean(&w);
    assert_eq!(w.owner.stats().invalidations, 0, "no LOCAL_INV after the peer's invalidation");
    assert_eq!(w.invalidations, vec![1, 0]);
    assert_eq!(returned(&w), vec![(LeaseEnd::ConnectionLost, false)]);
}

// ---- the engines alone ----

fn buf(mr: u32) -> Buffer {
    Buffer { mr, offset: 0, len: 64, addr: 0x1000 }
}

fn owner(windows: u32) -> Owner {
    Owner::new(1, (0..windows).map(|w| Window { handle: w, rkey: (w + 1) << 8 }))
}

fn take_bind(o: &mut Owner) -> mwcap_mw::BindAndGrant {
    match o.poll_action() {
        Some(OwnerAction::BindAndGrant(bg)) => bg,
        other => panic!("expected a bind-and-grant, got {other:?}"),
    }
}

fn take_inv(o: &mut Owner) -> mwcap_mw::Token {
    match o.poll_action() {
        Some(OwnerAction::Invalidate { token, .. }) => token,
        other => panic!("expected an invalidation, got {other:?}"),
    }
}

#[test]
fn grant_without_a_free_window_is_backpressure() {
    let mut o = owner(1);
    o.grant(Duration::ZERO, buf(0), at(4)).unwrap();
    let err = o.grant(Duration::ZERO, buf(1), at(4)).unwrap_err();
    assert_eq!(err, GrantError::NoFreeWindow { pool: 1 });
    assert!(err.to_string().contains("all 1 memory windows are leased"));
    assert_eq!(o.grant(Duration::ZERO, Buffer { len: 0, ..buf(1) }, at(4)), Err(GrantError::EmptyBuffer));
    assert!(matches!(o.grant(Duration::ZERO, buf(1), Duration::ZERO), Err(GrantError::BadLeaseTime(_))));
}

#[test]
fn forged_stale_and_replayed_releases_are_counted_and_ignored() {
    let mut o = owner(2);
    let t0 = Duration::ZERO;
    let lease = o.grant(t0, buf(0), at(4)).unwrap();
    let bg = take_bind(&mut o);
    let good = Release { lease, rkey: bg.rkey, unread: false };
    o.handle_release(t0, Release { rkey: bg.rkey ^ 1, ..good }); // wrong rkey
    o.handle_release(t0, Release { lease: mwcap_mw::LeaseId::from_raw(7 << 32 | 1), ..good }); // no such window
    o.handle_release(t0, Release { lease: mwcap_mw::LeaseId::from_raw(lease.raw() + 1), ..good }); // future bind
    o.handle_release(t0, Release { lease: mwcap_mw::LeaseId::from_raw(1 << 32), rkey: 0x200, unread: false }); // never granted
    assert_eq!(o.stats().forged_releases, 4);
    assert_eq!(o.poll_action(), None, "nothing invalidated");
    o.handle_release(t0, good);
    let inv = take_inv(&mut o);
    o.handle_release(t0, good); // duplicate
    assert_eq!(o.poll_action(), None);
    o.handle_completion(t0, bg.send_token, Status::Success);
    o.handle_completion(t0, inv, Status::Success);
    assert!(matches!(o.poll_event(), Some(OwnerEvent::BufferReturned { end: LeaseEnd::Released, .. })));
    o.handle_release(t0, good); // replay after the buffer returned
    o.grant(t0, buf(0), at(4)).unwrap();
    let _ = take_bind(&mut o);
    o.handle_release(t0, good); // replay of the previous bind's release
    assert_eq!(o.poll_action(), None);
    assert_eq!(o.stats().stale_releases, 3);
    assert_eq!(o.stats().invalidations, 1);
    o.handle_completion(t0, inv, Status::Success); // a duplicate completion
    assert_eq!(o.stats().unknown_completions, 1);
}

#[test]
fn every_bind_gets_a_new_rkey_in_the_low_byte_only() {
    let mut o = owner(1);
    let t0 = Duration::ZERO;
    let mut last = 0x100;
    for _ in 0..600 {
        let lease = o.grant(t0, buf(0), at(4)).unwrap();
        let bg = take_bind(&mut o);
        assert_ne!(bg.rkey, last);
        assert_eq!(bg.rkey & !0xff, 0x100);
        assert_eq!((bg.grant.rkey, bg.grant.len, bg.grant.addr), (bg.rkey, 64, 0x1000));
        last = bg.rkey;
        o.handle_release(t0, Release { lease, rkey: bg.rkey, unread: false });
        let inv = take_inv(&mut o);
        o.handle_completion(t0, bg.send_token, Status::Success);
        o.handle_completion(t0, inv, Status::Success);
        assert!(matches!(o.poll_event(), Some(OwnerEvent::BufferReturned { .. })));
    }
}

#[test]
fn qp_error_returns_buffers_only_once_the_qp_is_destroyed() {
    let mut o = owner(3);
    let t0 = Duration::ZERO;
    o.grant(t0, buf(0), at(4)).unwrap();
    o.grant(t0, buf(1), at(4)).unwrap();
    let (a, b) = (take_bind(&mut o), take_bind(&mut o));
    o.handle_qp_error(t0);
    assert_eq!(o.poll_event(), Some(OwnerEvent::ConnectionLost { cause: LossCause::QpError }));
    assert_eq!(o.poll_event(), Some(OwnerEvent::WindowRetired { window: 2 }));
    assert_eq!(o.poll_event(), None, "two grant SENDs are still outstanding");
    o.handle_completion(t0, a.send_token, Status::Flushed);
    assert_eq!(o.poll_event(), None);
    o.handle_completion(t0, b.send_token, Status::Flushed);
    // Every work request flushed: still none (a READ response's packet may
    // still be copied out of a buffer), until the QP is destroyed.
    assert_eq!(o.poll_event(), None);
    assert_eq!(o.outstanding_buffers(), 2);
    o.handle_qp_destroyed(t0);
    let evs: Vec<_> = std::iter::from_fn(|| o.poll_event()).collect();
    assert_eq!(evs.iter().filter(|e| matches!(e, OwnerEvent::BufferReturned { .. })).count(), 2);
    assert_eq!(evs.iter().filter(|e| matches!(e, OwnerEvent::WindowRetired { .. })).count(), 2);
    assert_eq!(o.grant(t0, buf(0), at(4)), Err(GrantError::ConnectionLost));
    assert_eq!(o.poll_timeout(), None);
}

#[test]
fn failed_local_inv_takes_the_error_path_and_qp_destroy_returns_the_rest() {
    let mut o = owner(2);
    let t0 = Duration::ZERO;
    let l0 = o.grant(t0, buf(0), at(4)).unwrap();
    let a = take_bind(&mut o);
    o.grant(t0, buf(1), at(4)).unwrap();
    let _b = take_bind(&mut o);
    o.handle_completion(t0, a.send_token, Status::Success);
    o.handle_release(t0, Release { lease: l0, rkey: a.rkey, unread: false });
    let inv = take_inv(&mut o);
    o.handle_completion(t0, inv, Status::Failed(11));
    assert_eq!(
        o.poll_event(),
        Some(OwnerEvent::ConnectionLost { cause: LossCause::WorkRequestFailed(Status::Failed(11)) })
    );
    assert_eq!(o.poll_event(), None, "the second grant's SEND has not flushed yet");
    assert_eq!(o.outstanding_buffers(), 2);
    o.handle_qp_destroyed(t0);
    let evs: Vec<_> = std::iter::from_fn(|| o.poll_event()).collect();
    assert_eq!(evs.iter().filter(|e| matches!(e, OwnerEvent::BufferReturned { .. })).count(), 2);
    assert!(evs.contains(&OwnerEvent::BufferReturned {
        lease: l0,
        buffer: buf(0),
        end: LeaseEnd::Released,
        cancelled: false
    }));
    assert_eq!(o.outstanding_buffers(), 0);
}

fn reader(mode: ReleaseMode) -> Reader {
    Reader::new(ReaderConfig { safety_margin: at(1), release: mode, max_lease: mwcap_mw::MAX_LEASE_TIME })
}

fn grant_for(o: &mut Owner) -> mwcap_mw::Grant {
    o.grant(Duration::ZERO, buf(0), at(4)).unwrap();
    take_bind(o).grant
}

#[test]
fn reader_remote_access_error_is_reported_and_the_connection_is_lost() {
    let mut o = owner(2);
    let mut r = reader(ReleaseMode::Message);
    let g = grant_for(&mut o);
    r.handle_grant(at(1), g, buf(9));
    let Some(ReaderAction::Read { token, rkey, len: 64, .. }) = r.poll_action() else { panic!() };
    assert_eq!(rkey, g.rkey);
    assert_eq!(r.poll_timeout(), Some(at(5)));
    r.handle_completion(at(2), token, Status::RemoteAccess);
    assert_eq!(
        r.poll_event(),
        Some(ReaderEvent::ReadFailed { lease: g.lease, dest: buf(9), error: ReadError::RemoteAccess })
    );
    assert_eq!(r.poll_event(), Some(ReaderEvent::ConnectionLost));
    assert_eq!(r.poll_action(), None, "no release on a dead QP");
    let g2 = grant_for(&mut o);
    r.handle_grant(at(3), g2, buf(8));
    assert!(matches!(
        r.poll_event(),
        Some(ReaderEvent::Declined { reason: DeclineReason::ConnectionLost, release: None, .. })
    ));
}

#[test]
fn reader_declines_bad_destinations_and_returns_reads_on_destroy() {
    let mut o = owner(3);
    let mut r = reader(ReleaseMode::Piggyback);
    let g = grant_for(&mut o);
    r.handle_grant(at(0), g, Buffer { len: 10, ..buf(9) });
    let Some(ReaderEvent::Declined { reason, release: Some(rel), .. }) = r.poll_event() else { panic!() };
    assert_eq!(reason, DeclineReason::DestinationTooSmall { need: 64, have: 10 });
    assert_eq!(rel, Release { lease: g.lease, rkey: g.rkey, unread: true }, "a decline's release is unread");
    let g2 = grant_for(&mut o);
    r.handle_grant(at(0), g2, buf(7));
    let Some(ReaderAction::Read { token, .. }) = r.poll_action() else { panic!() };
    r.handle_completion(at(0), mwcap_mw::Token::from_wr_id(token.wr_id() ^ 1), Status::Success);
    assert_eq!(r.stats().unknown_completions, 1);
    r.handle_qp_destroyed(at(1));
    assert_eq!(r.poll_event(), Some(ReaderEvent::ConnectionLost));
    assert_eq!(
        r.poll_event(),
        Some(ReaderEvent::ReadFailed { lease: g2.lease, dest: buf(7), error: ReadError::Flushed })
    );
    assert_eq!(r.outstanding_reads(), 0);
}

#[test]
fn reader_timeout_flushes_once_and_a_late_success_still_counts() {
    let mut o = owner(3);
    let mut r = reader(ReleaseMode::Message);
    let (g1, g2) = (grant_for(&mut o), grant_for(&mut o));
    r.handle_grant(at(0), g1, buf(1));
    r.handle_grant(at(2), g2, buf(2));
    let Some(ReaderAction::Read { token: t1, .. }) = r.poll_action() else { panic!() };
    let Some(ReaderAction::Read { token: t2, .. }) = r.poll_action() else { panic!() };
    assert_eq!(r.poll_timeout(), Some(at(4)));
    r.handle_timeout(at(3));
    assert_eq!(r.poll_event(), None, "not yet");
    r.handle_timeout(at(4));
    assert_eq!(r.poll_event(), Some(ReaderEvent::ReadTimedOut { lease: g1.lease }));
    assert_eq!(r.poll_event(), Some(ReaderEvent::ConnectionLost));
    assert_eq!(r.poll_action(), Some(ReaderAction::FlushQp));
    r.handle_timeout(at(9));
    assert_eq!(r.poll_action(), None, "one flush only");
    r.handle_completion(at(9), t2, Status::Success); // answered before the flush took effect
    assert!(matches!(r.poll_event(), Some(ReaderEvent::ReadDone { release: None, .. })));
    assert_eq!(r.poll_action(), None, "no release on a QP being flushed");
    r.handle_completion(at(9), t1, Status::Flushed);
    assert_eq!(
        r.poll_event(),
        Some(ReaderEvent::ReadFailed { lease: g1.lease, dest: buf(1), error: ReadError::TimedOut })
    );
}
