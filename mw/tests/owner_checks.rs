//! The owner's defensive checks, driven directly (no NIC model): what a
//! completion must match before it counts (kind, window, bind), a failed
//! bind, duplicate and stale completions, the order of the evidence a buffer
//! needs, the grant limits, the consumer keys a seed gives, and the counters.
//! Each test names the misbehaviour a check exists for.

use std::time::Duration;

use mwcap_mw::{
    Buffer, CancelError, Engine, Grant, GrantError, LeaseEnd, LeaseId, LendRefused, LossCause, Misbehavior,
    Owner, OwnerAction, OwnerEvent, Reader, ReaderAction, ReaderConfig, Release, ReleaseMode, Status, Token,
    Window, MAX_LEASE_TIME,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn buffer(i: u32) -> Buffer {
    Buffer { mr: 1, offset: u64::from(i) * 64, len: 64, addr: 0x1000 + u64::from(i) * 64 }
}

fn owner(windows: u32) -> Owner {
    Owner::new(1, (0..windows).map(|i| Window { handle: 100 + i, rkey: (i + 1) << 8 }))
}

/// One lease as the driver sees it.
#[derive(Clone, Copy, Debug)]
struct Granted {
    lease: LeaseId,
    rkey: u32,
    bind: Token,
    send: Token,
}

impl Granted {
    fn release(self) -> Release {
        Release { lease: self.lease, rkey: self.rkey, unread: false }
    }
}

fn grant(o: &mut Owner, now: Duration, i: u32) -> Granted {
    let lease = o.grant(now, buffer(i), ms(50)).expect("a window is free");
    match o.poll_action() {
        Some(OwnerAction::BindAndGrant(b)) => {
            assert_eq!(b.grant.lease, lease);
            assert_eq!(b.buffer, buffer(i));
            Granted { lease, rkey: b.rkey, bind: b.bind_token, send: b.send_token }
        }
        other => panic!("expected a bind and grant, got {other:?}"),
    }
}

/// The one LOCAL_INV queued now.
fn invalidation(o: &mut Owner) -> Token {
    match (o.poll_action(), o.poll_action()) {
        (Some(OwnerAction::Invalidate { token, .. }), None) => token,
        other => panic!("expected one invalidation, got {other:?}"),
    }
}

fn events(o: &mut Owner) -> Vec<OwnerEvent> {
    std::iter::from_fn(|| o.poll_event()).collect()
}

fn returned(lease: LeaseId, i: u32, end: LeaseEnd) -> OwnerEvent {
    OwnerEvent::BufferReturned { lease, buffer: buffer(i), end, cancelled: false }
}

/// Grants `buffer(i)`, completes the grant SEND, releases and completes the
/// LOCAL_INV: the buffer is back.
fn full_cycle(o: &mut Owner, now: Duration, i: u32) -> (Granted, Token) {
    let g = grant(o, now, i);
    o.handle_completion(now, g.send, Status::Success);
    o.handle_release(now, g.release());
    let inv = invalidation(o);
    o.handle_completion(now, inv, Status::Success);
    assert_eq!(events(o), vec![returned(g.lease, i, LeaseEnd::Released)]);
    (g, inv)
}

#[test]
fn a_stale_invalidate_completion_does_not_return_the_current_binds_buffer() {
    let mut o = owner(1);
    let (first, old_inv) = full_cycle(&mut o, ms(0), 0);
    // The same window, bound again; its LOCAL_INV is posted, not completed.
    let second = grant(&mut o, ms(1), 1);
    assert_eq!(second.lease.raw() >> 32, first.lease.raw() >> 32, "the same window");
    o.handle_completion(ms(1), second.send, Status::Success);
    o.handle_release(ms(2), second.release());
    let inv = invalidation(&mut o);
    assert_ne!(inv, old_inv);
    // A completion of the first bind's LOCAL_INV (a duplicate, or a replay
    // by a broken driver) is not evidence for the second bind.
    o.handle_completion(ms(3), old_inv, Status::Success);
    assert_eq!(events(&mut o), vec![], "the window may still be bound");
    assert_eq!(o.outstanding_buffers(), 1);
    assert_eq!(o.stats().unknown_completions, 1);
    // The same for the first bind's grant SEND and bind.
    o.handle_completion(ms(3), first.send, Status::Success);
    o.handle_completion(ms(3), first.bind, Status::Failed(1));
    assert_eq!(o.stats().unknown_completions, 3);
    assert!(!o.is_connection_lost(), "a stale bind error is not this QP's news");
    o.handle_completion(ms(4), inv, Status::Success);
    assert_eq!(events(&mut o), vec![returned(second.lease, 1, LeaseEnd::Released)]);
}

#[test]
fn a_stale_grant_send_completion_does_not_stand_for_the_current_one() {
    let mut o = owner(1);
    let (first, _) = full_cycle(&mut o, ms(0), 0);
    let second = grant(&mut o, ms(1), 1);
    o.handle_release(ms(2), second.release());
    let inv = invalidation(&mut o);
    o.handle_completion(ms(3), inv, Status::Success);
    // The LOCAL_INV is done but the grant SEND is not: no return yet.
    assert_eq!(events(&mut o), vec![]);
    o.handle_completion(ms(3), first.send, Status::Success);
    assert_eq!(events(&mut o), vec![], "the first bind's SEND is not the second's");
    assert_eq!(o.stats().unknown_completions, 1);
    o.handle_completion(ms(4), second.send, Status::Success);
    assert_eq!(events(&mut o), vec![returned(second.lease, 1, LeaseEnd::Released)]);
}

#[test]
fn duplicate_completions_are_counted_and_change_nothing() {
    let mut o = owner(2);
    let g = grant(&mut o, ms(0), 0);
    let other = grant(&mut o, ms(0), 1);
    o.handle_completion(ms(1), g.send, Status::Success);
    o.handle_completion(ms(1), g.send, Status::Success);
    assert_eq!(o.stats().unknown_completions, 1, "the SEND completed once");
    o.handle_release(ms(2), g.release());
    let inv = invalidation(&mut o);
    o.handle_completion(ms(3), inv, Status::Success);
    assert_eq!(events(&mut o), vec![returned(g.lease, 0, LeaseEnd::Released)]);
    // Now the slot is free: a second copy of its LOCAL_INV's completion (or
    // an error one) must not touch the next bind or the connection.
    o.handle_completion(ms(4), inv, Status::Success);
    o.handle_completion(ms(4), inv, Status::Flushed);
    o.handle_completion(ms(4), g.send, Status::Success);
    assert_eq!(o.stats().unknown_completions, 4);
    assert!(!o.is_connection_lost());
    assert_eq!(o.outstanding_buffers(), 1);
    assert_eq!(o.free_windows(), 1);
    // The other lease is unaffected.
    o.handle_completion(ms(5), other.send, Status::Success);
    o.handle_release(ms(5), other.release());
    let inv = invalidation(&mut o);
    o.handle_completion(ms(6), inv, Status::Success);
    assert_eq!(events(&mut o), vec![returned(other.lease, 1, LeaseEnd::Released)]);
}

#[test]
fn completions_of_other_engines_and_windows_are_not_the_owners() {
    let mut o = owner(1);
    let g = grant(&mut o, ms(0), 0);
    // A READ of the reader sharing the QP.
    let mut r = Reader::new(ReaderConfig {
        safety_margin: ms(1),
        release: ReleaseMode::Message,
        max_lease: mwcap_mw::MAX_LEASE_TIME,
    });
    let grant_msg = Grant { lease: g.lease, addr: 0x1000, len: 8, rkey: g.rkey, time_left: ms(50) };
    r.handle_grant(ms(0), grant_msg, buffer(5));
    let Some(ReaderAction::Read { token: read, .. }) = r.poll_action() else { panic!("a READ") };
    assert_eq!(read.engine(), Some(Engine::Reader));
    // A window the pool lacks (slot 1 of a bigger pool).
    let mut big = owner(2);
    let _ = grant(&mut big, ms(0), 0);
    let other_window = grant(&mut big, ms(0), 1);
    // The driver's own wr_ids.
    let foreign = [Token::from_wr_id(0), Token::from_wr_id(1), Token::from_wr_id(u64::MAX)];
    for t in foreign.into_iter().chain([read, other_window.send, other_window.bind]) {
        o.handle_completion(ms(1), t, Status::Failed(5));
    }
    assert_eq!(o.stats().unknown_completions, 6);
    assert!(!o.is_connection_lost());
    assert_eq!(events(&mut o), vec![]);
    o.handle_completion(ms(1), g.send, Status::Success);
    assert_eq!(o.stats().unknown_completions, 6);
}

#[test]
fn a_failed_bind_takes_the_error_path_and_the_buffer_returns_on_the_destroy() {
    let mut o = owner(2);
    let g = grant(&mut o, ms(0), 0);
    assert!(!o.is_connection_lost());
    // The unsignaled bind completes only on error.
    o.handle_completion(ms(1), g.bind, Status::Failed(9));
    assert!(o.is_connection_lost());
    assert_eq!(o.free_windows(), 0);
    assert_eq!(o.poll_timeout(), None);
    assert_eq!(
        events(&mut o),
        vec![
            OwnerEvent::ConnectionLost { cause: LossCause::WorkRequestFailed(Status::Failed(9)) },
            OwnerEvent::WindowRetired { window: 101 },
        ]
    );
    assert_eq!(o.grant(ms(1), buffer(1), ms(50)), Err(GrantError::ConnectionLost));
    // The grant SEND chained after the bind is flushed: that is no
    // evidence (a NIC may still be copying a READ response's packet out of
    // the buffer); the QP's destruction is.
    o.handle_completion(ms(2), g.send, Status::Flushed);
    assert_eq!(events(&mut o), vec![]);
    assert_eq!(o.outstanding_buffers(), 1);
    o.handle_qp_destroyed(ms(3));
    assert_eq!(
        events(&mut o),
        vec![returned(g.lease, 0, LeaseEnd::ConnectionLost), OwnerEvent::WindowRetired { window: 100 }]
    );
    assert_eq!(o.outstanding_buffers(), 0);
}

#[test]
fn a_successful_bind_completion_changes_nothing() {
    let mut o = owner(1);
    let g = grant(&mut o, ms(0), 0);
    o.handle_completion(ms(1), g.bind, Status::Success);
    assert!(!o.is_connection_lost());
    assert_eq!(o.stats().unknown_completions, 0);
    assert_eq!(events(&mut o), vec![]);
    assert_eq!(o.outstanding_buffers(), 1);
}

#[test]
fn the_buffer_waits_for_both_the_local_inv_and_the_grant_send() {
    let mut o = owner(1);
    let g = grant(&mut o, ms(0), 0);
    o.handle_release(ms(1), g.release());
    let inv = invalidation(&mut o);
    o.handle_completion(ms(2), inv, Status::Success);
    assert_eq!(events(&mut o), vec![], "the grant SEND has not completed");
    assert_eq!(o.outstanding_buffers(), 1);
    o.handle_completion(ms(3), g.send, Status::Success);
    assert_eq!(events(&mut o), vec![returned(g.lease, 0, LeaseEnd::Released)]);
    assert_eq!(o.free_windows(), 1);
}

#[test]
fn tokens_round_trip_through_wr_id_and_route_to_their_engine() {
    let mut o = owner(1);
    let g = grant(&mut o, ms(0), 0);
    o.handle_release(ms(1), g.release());
    let inv = invalidation(&mut o);
    let tokens = [g.bind, g.send, inv];
    for t in tokens {
        assert_eq!(Token::from_wr_id(t.wr_id()), t);
        assert_eq!(t.engine(), Some(Engine::Owner), "{t:?}");
    }
    assert_ne!(g.bind, g.send);
    assert_ne!(g.send, inv);
    assert_ne!(g.bind, inv);
    assert_eq!(Token::from_wr_id(0).engine(), None);
    assert_eq!(Token::from_wr_id(u64::MAX).engine(), None);
    // Only the grant's SEND is one (a driver may hand its success over late).
    assert!(g.send.is_grant_send());
    assert!(!g.bind.is_grant_send() && !inv.is_grant_send());
    assert!(!Token::from_wr_id(0).is_grant_send() && !Token::from_wr_id(42).is_grant_send());
    assert_eq!(Token::from_wr_id(42).wr_id(), 42);
    // Debug output names the kind, window and bind; a foreign one its value.
    assert_eq!(format!("{:?}", g.bind), "Token(Bind 0#1)");
    assert_eq!(format!("{:?}", g.send), "Token(GrantSend 0#1)");
    assert_eq!(format!("{inv:?}"), "Token(Invalidate 0#1)");
    assert_eq!(format!("{:?}", Token::from_wr_id(0x2a)), "Token(0x2a)");
    assert_eq!(format!("{:?}", g.lease), "LeaseId(0#1)");
}

#[test]
fn lease_time_limits_are_inclusive() {
    let mut o = owner(4);
    let micro = Duration::from_micros(1);
    let too_short = micro - Duration::from_nanos(1);
    let too_long = MAX_LEASE_TIME + Duration::from_nanos(1);
    assert_eq!(o.grant(ms(0), buffer(0), too_short), Err(GrantError::BadLeaseTime(too_short)));
    assert_eq!(o.grant(ms(0), buffer(0), Duration::ZERO), Err(GrantError::BadLeaseTime(Duration::ZERO)));
    assert_eq!(o.grant(ms(0), buffer(0), too_long), Err(GrantError::BadLeaseTime(too_long)));
    assert!(o.grant(ms(0), buffer(0), micro).is_ok());
    assert!(o.grant(ms(0), buffer(1), MAX_LEASE_TIME).is_ok());
    assert!(o.grant(ms(0), buffer(2), MAX_LEASE_TIME - micro).is_ok());
    let empty = Buffer { len: 0, ..buffer(3) };
    assert_eq!(o.grant(ms(0), empty, ms(1)), Err(GrantError::EmptyBuffer));
    assert_eq!(o.stats().grants, 3);
}

#[test]
fn error_messages_say_what_happened_and_what_to_do() {
    let pool = GrantError::NoFreeWindow { pool: 4 }.to_string();
    assert!(pool.contains("all 4 memory windows are leased") && pool.contains("size the pool"), "{pool}");
    assert_eq!(GrantError::EmptyBuffer.to_string(), "cannot grant an empty buffer");
    let t = GrantError::BadLeaseTime(Duration::ZERO).to_string();
    assert!(t.starts_with("lease time 0ns is not in 1µs..="), "{t}");
    assert_eq!(GrantError::ConnectionLost.to_string(), "the connection is lost; open a new one");
    let mut o = owner(1);
    let (g, _) = full_cycle(&mut o, ms(0), 0);
    let err = o.cancel(ms(1), g.lease).unwrap_err();
    assert_eq!(err, CancelError::NotActive(g.lease));
    assert_eq!(err.to_string(), "lease LeaseId(0#1) is not active (its buffer already returned?)");
}

#[test]
fn cancelling_a_stale_lease_does_not_touch_the_windows_current_one() {
    let mut o = owner(1);
    let (first, _) = full_cycle(&mut o, ms(0), 0);
    let second = grant(&mut o, ms(1), 1);
    assert_eq!(o.cancel(ms(2), first.lease), Err(CancelError::NotActive(first.lease)));
    let never = LeaseId::from_raw(second.lease.raw() + 1);
    assert_eq!(o.cancel(ms(2), never), Err(CancelError::NotActive(never)));
    o.handle_completion(ms(3), second.send, Status::Success);
    o.handle_release(ms(3), second.release());
    let inv = invalidation(&mut o);
    o.handle_completion(ms(4), inv, Status::Success);
    assert_eq!(events(&mut o), vec![returned(second.lease, 1, LeaseEnd::Released)], "not cancelled");
}

#[test]
fn a_peer_invalidation_names_only_the_window_that_carried_the_rkey() {
    let mut o = owner(3);
    let (earlier, _) = full_cycle(&mut o, ms(0), 0);
    let leased = grant(&mut o, ms(1), 1);
    assert_eq!(leased.lease.raw() >> 32, 0, "window 0 again, rebound");
    assert!(!o.is_connection_lost());
    // The rkey of the window's earlier bind, which no window carries now.
    o.handle_peer_invalidation(ms(2), earlier.rkey);
    assert_eq!(o.stats().peer_invalidations, 1);
    assert_eq!(o.poll_action(), Some(OwnerAction::FlushQp));
    let ev = events(&mut o);
    assert_eq!(
        ev[0],
        OwnerEvent::PeerMisbehaved(Misbehavior::SendWithInvalidate { rkey: earlier.rkey, window: None })
    );
    assert_eq!(ev[1], OwnerEvent::ConnectionLost { cause: LossCause::HostilePeer });
    // A second one, with the leased window's rkey: named, and the flush
    // asked for again (the first is not known to have worked: no
    // `handle_qp_error` yet), with no second loss.
    o.handle_peer_invalidation(ms(3), leased.rkey);
    assert_eq!(o.stats().peer_invalidations, 2);
    assert_eq!(o.poll_action(), Some(OwnerAction::FlushQp));
    assert_eq!(o.poll_action(), None);
    assert_eq!(
        events(&mut o),
        vec![OwnerEvent::PeerMisbehaved(Misbehavior::SendWithInvalidate {
            rkey: leased.rkey,
            window: Some(100)
        })]
    );
}

#[test]
fn an_invalidation_through_another_queue_pair_ends_the_connection_without_a_second_one() {
    let mut o = owner(2);
    let (earlier, _) = full_cycle(&mut o, ms(0), 0);
    let leased = grant(&mut o, ms(1), 1);
    o.handle_completion(ms(1), leased.send, Status::Success);
    // Keys this owner does not bind now: nothing changes.
    assert!(!o.binds_rkey(earlier.rkey));
    assert!(!o.handle_invalidation_elsewhere(ms(2), earlier.rkey));
    assert!(!o.is_connection_lost() && o.poll_action().is_none() && events(&mut o).is_empty());
    assert_eq!(o.stats().peer_invalidations, 0);
    // Its leased window's key: invalidated elsewhere, so the QP is flushed
    // and the connection lost, not blamed on the peer.
    assert!(o.binds_rkey(leased.rkey));
    assert!(o.handle_invalidation_elsewhere(ms(2), leased.rkey));
    assert_eq!(o.stats().peer_invalidations, 1);
    assert_eq!(o.poll_action(), Some(OwnerAction::FlushQp));
    let ev = events(&mut o);
    assert_eq!(ev[0], OwnerEvent::ConnectionLost { cause: LossCause::InvalidatedElsewhere });
    assert!(!ev.iter().any(|e| matches!(e, OwnerEvent::PeerMisbehaved(_))), "{ev:?}");
    // The same news again (the QP that took the SEND got a connection,
    // which reports it too): the owner's window still, nothing changes.
    assert!(o.handle_invalidation_elsewhere(ms(2), leased.rkey));
    assert_eq!(o.stats().peer_invalidations, 1);
    assert!(o.poll_action().is_none() && events(&mut o).is_empty());
    // The lease's end and the peer's release post no LOCAL_INV: the window
    // had its one invalidation. The buffer comes back on the QP's flush.
    o.handle_release(ms(3), leased.release());
    o.handle_timeout(ms(100));
    assert_eq!(o.poll_action(), None, "no second invalidation");
    o.handle_qp_destroyed(ms(101));
    assert!(events(&mut o).contains(&returned(leased.lease, 1, LeaseEnd::ConnectionLost)));
    assert_eq!(o.stats().invalidations, 1, "only the earlier bind's");
}

#[test]
fn a_fixed_seed_gives_a_fixed_sequence_of_consumer_keys() {
    // Seed 1's key bytes are 91 be f8 71 71 c3 e0 85 (see rng.rs); the
    // second 0x71 equals the current key and is bumped to 0x72.
    let mut o = Owner::new(1, [Window { handle: 7, rkey: 0xabcd_ef00 }]);
    let mut rkeys = Vec::new();
    for _ in 0..8 {
        let (g, _) = full_cycle(&mut o, ms(0), 0);
        rkeys.push(g.rkey);
    }
    assert_eq!(
        rkeys,
        [
            0xabcd_ef91,
            0xabcd_efbe,
            0xabcd_eff8,
            0xabcd_ef71,
            0xabcd_ef72,
            0xabcd_efc3,
            0xabcd_efe0,
            0xabcd_ef85
        ]
    );
}

#[test]
fn a_new_owner_is_up_with_every_window_free() {
    let o = owner(3);
    assert!(!o.is_connection_lost());
    assert_eq!(o.free_windows(), 3);
    assert_eq!(o.outstanding_buffers(), 0);
    assert_eq!(o.poll_timeout(), None);
}

/// A lending owner (windows from a pool, one per grant): a refused grant
/// hands its window back untouched; a lease's window comes back right after
/// its buffer, unbound, with the rkey of its last bind; a window lent when
/// the QP dies is retired, never handed back; the two grant calls refuse
/// the other kind of owner.
#[test]
fn a_lending_owner_hands_windows_back_only_unbound() {
    let w = |i: u32| Window { handle: 500 + i, rkey: (i + 7) << 8 };
    let mut o = Owner::lending(9, 2);
    assert_eq!(o.free_windows(), 2);
    assert_eq!(o.grant(ms(0), buffer(0), ms(50)), Err(GrantError::WrongWindowSource { lending: true }));
    assert_eq!(
        owner(1).grant_on(ms(0), buffer(0), ms(50), w(0)),
        Err(LendRefused { error: GrantError::WrongWindowSource { lending: false }, window: w(0) })
    );
    let refused = o.grant_on(ms(0), buffer(0), Duration::ZERO, w(0)).unwrap_err();
    assert_eq!(refused, LendRefused { error: GrantError::BadLeaseTime(Duration::ZERO), window: w(0) });
    assert!(refused.error.to_string().contains("lease time"));

    // A full cycle: bind, release, LOCAL_INV; the buffer, then the window.
    let lease = o.grant_on(ms(0), buffer(0), ms(50), w(0)).expect("a slot is free");
    let Some(OwnerAction::BindAndGrant(b)) = o.poll_action() else { panic!("expected a bind") };
    assert_eq!(b.window, w(0).handle);
    assert_eq!(b.rkey >> 8, w(0).rkey >> 8, "the bind keeps the window's index");
    assert_ne!(b.rkey, w(0).rkey, "and changes its consumer key");
    o.handle_completion(ms(1), b.send_token, Status::Success);
    o.handle_release(ms(1), Release { lease, rkey: b.rkey, unread: false });
    let inv = invalidation(&mut o);
    assert_eq!(events(&mut o), vec![], "nothing back before the LOCAL_INV completes");
    o.handle_completion(ms(2), inv, Status::Success);
    assert_eq!(
        events(&mut o),
        vec![
            returned(lease, 0, LeaseEnd::Released),
            OwnerEvent::WindowUnbound { lease, window: Window { handle: w(0).handle, rkey: b.rkey } },
        ]
    );
    // A replayed release of the returned lease is stale, not a new LOCAL_INV.
    o.handle_release(ms(3), Release { lease, rkey: b.rkey, unread: false });
    assert_eq!(o.poll_action(), None);
    assert_eq!(o.stats().stale_releases, 1);

    // Lent when the QP dies: retired once it is destroyed, not handed back.
    let lease = o.grant_on(ms(3), buffer(1), ms(50), w(1)).expect("a slot is free");
    let Some(OwnerAction::BindAndGrant(b)) = o.poll_action() else { panic!("expected a bind") };
    o.handle_qp_error(ms(4));
    assert_eq!(o.free_windows(), 0);
    o.handle_completion(ms(4), b.send_token, Status::Flushed);
    let evs = events(&mut o);
    assert!(!evs.iter().any(|e| matches!(e, OwnerEvent::BufferReturned { .. })), "{evs:?}");
    o.handle_qp_destroyed(ms(5));
    let evs = events(&mut o);
    assert!(evs.contains(&OwnerEvent::BufferReturned {
        lease,
        buffer: buffer(1),
        end: LeaseEnd::ConnectionLost,
        cancelled: false
    }));
    assert!(evs.contains(&OwnerEvent::WindowRetired { window: w(1).handle }), "{evs:?}");
    assert!(!evs.iter().any(|e| matches!(e, OwnerEvent::WindowUnbound { .. })), "{evs:?}");
    assert!(!evs.iter().any(|e| matches!(e, OwnerEvent::WindowRetired { window } if *window == u32::MAX)));
}

/// `has_output` says whether an action or an event waits to be polled,
/// each on its own.
#[test]
fn has_output_counts_actions_and_events_each() {
    let mut o = owner(1);
    assert!(!o.has_output());
    o.grant(ms(0), buffer(0), ms(50)).expect("a window is free");
    assert!(o.has_output(), "a bind and grant to post");
    assert!(matches!(o.poll_action(), Some(OwnerAction::BindAndGrant(_))));
    assert!(!o.has_output());
    o.handle_qp_error(ms(1));
    assert!(o.has_output(), "the ConnectionLost event alone");
    let _ = events(&mut o);
    assert!(!o.has_output());
}

/// A revocation (`Owner::revoke`: a capability its owner takes back) ends a
/// live lease at once with its one LOCAL_INV; the buffer comes back only on
/// that invalidation's completion, a release or expiry after it finds the
/// lease ended (no second LOCAL_INV), a second revocation changes nothing,
/// and a lease that is over cannot be revoked.
#[test]
fn a_revocation_invalidates_a_live_lease_once_and_returns_its_buffer_on_the_evidence() {
    let mut o = owner(2);
    let g = grant(&mut o, ms(0), 0);
    o.handle_completion(ms(1), g.send, Status::Success);
    o.revoke(ms(2), g.lease).expect("an active lease");
    let inv = invalidation(&mut o);
    assert_eq!(events(&mut o), vec![], "no buffer back before the invalidation completes");
    // The peer's release and the expiry come after: the lease is ending.
    o.handle_release(ms(3), g.release());
    o.handle_timeout(ms(60));
    o.revoke(ms(3), g.lease).expect("still active until its buffer is back");
    assert_eq!(o.poll_action(), None, "one LOCAL_INV per bind");
    assert_eq!(o.stats().stale_releases, 1);
    assert_eq!(o.stats().expired, 0);
    o.handle_completion(ms(4), inv, Status::Success);
    assert_eq!(events(&mut o), vec![returned(g.lease, 0, LeaseEnd::Revoked)]);
    assert_eq!(o.stats().revoked, 1);
    assert_eq!(o.revoke(ms(5), g.lease), Err(CancelError::NotActive(g.lease)));
    // The other leases are untouched, and the window serves again.
    let next = grant(&mut o, ms(6), 1);
    o.handle_completion(ms(6), next.send, Status::Success);
    assert_eq!(o.poll_action(), None);
    assert_eq!(o.outstanding_buffers(), 1);
}

/// Taken down by its driver before the QP is known to be in ERR
/// (`handle_connection_lost`), the owner returns no leased buffer on a
/// successful completion: the window is still bound and the QP may still
/// serve READs. Not once the QP is in ERR either (a READ response's packet
/// may still be copied out of the buffer): only once it is destroyed.
#[test]
fn a_connection_lost_returns_nothing_until_the_qp_is_destroyed() {
    for destroyed in [false, true] {
        let mut o = owner(2);
        let lease = o.grant(ms(0), buffer(0), ms(50)).expect("a window is free");
        let Some(OwnerAction::BindAndGrant(b)) = o.poll_action() else { panic!("expected a bind") };
        o.handle_connection_lost(ms(1));
        // The free window is retired (unbound: nothing to wait for).
        assert_eq!(
            events(&mut o),
            vec![
                OwnerEvent::ConnectionLost { cause: LossCause::ConnectionLost },
                OwnerEvent::WindowRetired { window: 101 }
            ]
        );
        assert_eq!(o.grant(ms(1), buffer(1), ms(50)), Err(GrantError::ConnectionLost));
        // Its SEND completes: no work of the owner is outstanding.
        o.handle_completion(ms(2), b.send_token, Status::Success);
        // No expiry runs either.
        o.handle_timeout(ms(100));
        assert_eq!(o.poll_action(), None);
        let evs = events(&mut o);
        assert!(!evs.iter().any(|e| matches!(e, OwnerEvent::BufferReturned { .. })), "{evs:?}");
        if !destroyed {
            // In ERR, every work request done: still nothing (a READ
            // response's packet may still be copied out of the buffer).
            o.handle_qp_error(ms(101));
            let evs = events(&mut o);
            assert!(!evs.iter().any(|e| matches!(e, OwnerEvent::BufferReturned { .. })), "{evs:?}");
        }
        o.handle_qp_destroyed(ms(102));
        let evs = events(&mut o);
        assert!(evs.contains(&returned(lease, 0, LeaseEnd::ConnectionLost)), "{evs:?}");
    }
}

/// Taken down without ERR evidence, the owner asks again for the flush
/// when one of its windows is invalidated behind its back (a LOCAL_INV it
/// posted before must not outrun it); known in ERR, it does not.
#[test]
fn a_foreign_invalidation_after_a_connection_lost_asks_for_the_flush_again() {
    for in_err in [false, true] {
        let mut o = owner(2);
        o.grant(ms(0), buffer(0), ms(50)).expect("a window is free");
        let Some(OwnerAction::BindAndGrant(b)) = o.poll_action() else { panic!("expected a bind") };
        o.handle_connection_lost(ms(1));
        if in_err {
            o.handle_qp_error(ms(1));
        }
        let _ = events(&mut o);
        assert!(o.handle_invalidation_elsewhere(ms(2), b.rkey));
        let want = if in_err { None } else { Some(OwnerAction::FlushQp) };
        assert_eq!(o.poll_action(), want, "in ERR: {in_err}");
        assert_eq!(o.poll_action(), None);
    }
}
