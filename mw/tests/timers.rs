//! The engines' timers and free lists, driven directly (no NIC model): the
//! cases where an indexed heap or a free list could go wrong where the old
//! scans could not — a deadline left behind by a lease that ended, a slot
//! handed out twice, several timers due at once.

use std::time::Duration;

use mwcap_mw::{
    Buffer, Grant, LeaseEnd, LeaseId, Owner, OwnerAction, OwnerEvent, Reader, ReaderAction, ReaderConfig,
    ReaderEvent, Release, ReleaseMode, Status, Token, Window,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn buffer(i: u32) -> Buffer {
    Buffer { mr: 1, offset: u64::from(i) * 64, len: 64, addr: 0x1000 + u64::from(i) * 64 }
}

fn owner(windows: u32) -> Owner {
    Owner::new(1, (0..windows).map(|i| Window { handle: 100 + i, rkey: i << 8 }))
}

/// Grants `buffer(i)` for `lease`; returns the lease, its release and the
/// grant SEND's token (the bind is unsignaled).
fn grant(o: &mut Owner, now: Duration, i: u32, lease: Duration) -> (LeaseId, Release, Token) {
    let id = o.grant(now, buffer(i), lease).expect("a window is free");
    match o.poll_action() {
        Some(OwnerAction::BindAndGrant(b)) => {
            assert_eq!(b.grant.lease, id);
            (id, Release { lease: id, rkey: b.rkey, unread: false }, b.send_token)
        }
        other => panic!("expected a bind and grant, got {other:?}"),
    }
}

/// The LOCAL_INVs queued, as (window, token).
fn invalidations(o: &mut Owner) -> Vec<(u32, Token)> {
    let mut out = Vec::new();
    while let Some(a) = o.poll_action() {
        match a {
            OwnerAction::Invalidate { token, window, .. } => out.push((window, token)),
            other => panic!("expected only invalidations, got {other:?}"),
        }
    }
    out
}

fn returned(o: &mut Owner) -> Vec<(LeaseId, LeaseEnd, bool)> {
    let mut out = Vec::new();
    while let Some(e) = o.poll_event() {
        match e {
            OwnerEvent::BufferReturned { lease, end, cancelled, .. } => out.push((lease, end, cancelled)),
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}

/// Releases a lease and completes its LOCAL_INV and grant SEND: the buffer
/// is back and the window free.
fn release_and_return(o: &mut Owner, now: Duration, release: Release, send: Token) {
    release_and_return_cancelled(o, now, release, send, false);
}

fn release_and_return_cancelled(
    o: &mut Owner,
    now: Duration,
    release: Release,
    send: Token,
    cancelled: bool,
) {
    o.handle_release(now, release);
    let inv = invalidations(o);
    assert_eq!(inv.len(), 1);
    o.handle_completion(now, send, Status::Success);
    o.handle_completion(now, inv[0].1, Status::Success);
    assert_eq!(returned(o), vec![(release.lease, LeaseEnd::Released, cancelled)]);
}

#[test]
fn a_regranted_window_does_not_inherit_its_old_deadline() {
    let mut o = owner(1);
    let (_, r, send) = grant(&mut o, ms(0), 0, ms(10));
    assert_eq!(o.poll_timeout(), Some(ms(10)));
    release_and_return(&mut o, ms(1), r, send);
    assert_eq!(o.poll_timeout(), None, "a returned lease leaves no timer behind");
    // The same window, bound again for much longer.
    let (second, _, _) = grant(&mut o, ms(2), 0, ms(100));
    assert_eq!(o.poll_timeout(), Some(ms(102)));
    o.handle_timeout(ms(10));
    o.handle_timeout(ms(50));
    assert!(invalidations(&mut o).is_empty(), "the first lease's expiry must not fire on the second");
    assert_eq!(o.stats().expired, 0);
    o.handle_timeout(ms(102));
    let inv = invalidations(&mut o);
    assert_eq!(inv.len(), 1);
    assert_eq!(inv[0].1.wr_id() as u32, second.raw() as u32, "the LOCAL_INV of the current bind");
    assert_eq!(o.stats().expired, 1);
    assert_eq!(o.poll_timeout(), None);
}

#[test]
fn the_next_timeout_follows_releases_and_not_cancels() {
    let mut o = owner(3);
    let (_a, ra, sa) = grant(&mut o, ms(0), 0, ms(30));
    let (b, rb, sb) = grant(&mut o, ms(0), 1, ms(10));
    let (_c, _, _) = grant(&mut o, ms(0), 2, ms(20));
    assert_eq!(o.poll_timeout(), Some(ms(10)));
    // A cancel keeps the window bound until the release or the expiry.
    o.cancel(ms(1), b).expect("active");
    assert_eq!(o.poll_timeout(), Some(ms(10)));
    release_and_return_cancelled(&mut o, ms(2), rb, sb, true);
    assert_eq!(o.poll_timeout(), Some(ms(20)), "the released lease's timer is gone");
    release_and_return(&mut o, ms(3), ra, sa);
    assert_eq!(o.poll_timeout(), Some(ms(20)));
    assert_eq!(o.free_windows(), 2);
    assert_eq!(o.outstanding_buffers(), 1);
    // A stale release (the lease already returned) changes nothing.
    o.handle_release(ms(4), ra);
    assert!(invalidations(&mut o).is_empty());
    assert_eq!(o.poll_timeout(), Some(ms(20)));
}

#[test]
fn leases_expire_in_deadline_order_and_together_in_window_order() {
    const N: u32 = 64;
    let mut o = owner(N);
    // Lease times in a scrambled order, some equal: window i expires at
    // 1 + (i * 37) % 16 ms.
    let expiry = |i: u32| ms(1 + u64::from((i * 37) % 16));
    let mut sends = Vec::new();
    for i in 0..N {
        let (_, _, send) = grant(&mut o, ms(0), i, expiry(i));
        sends.push(send);
    }
    assert_eq!(o.free_windows(), 0);
    for s in sends {
        o.handle_completion(ms(0), s, Status::Success);
    }
    let mut expired = [false; N as usize];
    let mut t = ms(0);
    let mut step = 0;
    while let Some(next) = o.poll_timeout() {
        let earliest = (0..N).filter(|&i| !expired[i as usize]).map(expiry).min();
        assert_eq!(Some(next), earliest, "the next timeout is the earliest live lease's");
        assert!(next > t, "timers move forward");
        // Jump to the deadline, and on every other step past the next one
        // too, so several deadlines with different times are due at once.
        t = if step % 2 == 0 { next } else { next + ms(1) };
        step += 1;
        o.handle_timeout(t);
        let due: Vec<u32> = (0..N).filter(|&i| !expired[i as usize] && expiry(i) <= t).collect();
        let inv = invalidations(&mut o);
        let windows: Vec<u32> = inv.iter().map(|&(w, _)| w - 100).collect();
        assert_eq!(windows, due, "exactly the leases due, in window order");
        for (_, token) in inv {
            o.handle_completion(t, token, Status::Success);
        }
        for i in due {
            expired[i as usize] = true;
        }
        assert!(returned(&mut o).iter().all(|&(_, end, _)| end == LeaseEnd::Expired));
        let left = expired.iter().filter(|&&e| !e).count();
        assert_eq!(o.outstanding_buffers(), left);
        assert_eq!(o.free_windows(), N as usize - left);
    }
    assert!(expired.iter().all(|&e| e));
    assert!(step < N as usize, "several leases expired per call");
    assert_eq!(o.stats().expired, u64::from(N));
}

#[test]
fn the_lowest_free_window_is_bound_next() {
    let mut o = owner(4);
    let leases: Vec<_> = (0..4).map(|i| grant(&mut o, ms(0), i, ms(50))).collect();
    assert!(o.grant(ms(0), buffer(9), ms(50)).is_err(), "pool exhausted");
    // Return windows 2 and 1 (in that order): the next grants take 1, then 2.
    for i in [2, 1] {
        let (_, r, s) = leases[i];
        release_and_return(&mut o, ms(1), r, s);
    }
    assert_eq!(o.free_windows(), 2);
    let (x, _, _) = grant(&mut o, ms(2), 7, ms(50));
    let (y, _, _) = grant(&mut o, ms(2), 8, ms(50));
    assert_eq!((x.raw() >> 32, y.raw() >> 32), (1, 2));
    assert_eq!(o.free_windows(), 0);
    assert_eq!(o.outstanding_buffers(), 4);
}

#[test]
fn no_timer_and_no_free_window_once_the_qp_is_lost() {
    let mut o = owner(3);
    let (_, _, send) = grant(&mut o, ms(0), 0, ms(10));
    o.handle_qp_error(ms(1));
    assert_eq!(o.poll_timeout(), None);
    assert_eq!(o.free_windows(), 0);
    assert_eq!(o.outstanding_buffers(), 1);
    o.handle_timeout(ms(20));
    assert!(o.poll_action().is_none(), "no LOCAL_INV on a dead QP");
    o.handle_completion(ms(2), send, Status::Flushed);
    o.handle_qp_destroyed(ms(3));
    let mut back = 0;
    while let Some(e) = o.poll_event() {
        back += usize::from(matches!(e, OwnerEvent::BufferReturned { end: LeaseEnd::ConnectionLost, .. }));
    }
    assert_eq!(back, 1);
    assert_eq!(o.outstanding_buffers(), 0);
}

fn reader() -> Reader {
    Reader::new(ReaderConfig {
        safety_margin: ms(1),
        release: ReleaseMode::Piggyback,
        max_lease: mwcap_mw::MAX_LEASE_TIME,
    })
}

fn grant_msg(slot: u64, time_left: Duration) -> Grant {
    Grant { lease: LeaseId::from_raw((slot << 32) | 1), addr: 0x1000, len: 8, rkey: 7, time_left }
}

fn read_token(r: &mut Reader) -> Token {
    match r.poll_action() {
        Some(ReaderAction::Read { token, .. }) => token,
        other => panic!("expected a READ, got {other:?}"),
    }
}

#[test]
fn reader_deadlines_leave_with_their_reads_and_slots_are_reused_lowest_first() {
    let mut r = reader();
    let dest = Buffer { mr: 2, offset: 0, len: 64, addr: 0 };
    r.handle_grant(ms(0), grant_msg(0, ms(30)), dest);
    let t0 = read_token(&mut r);
    r.handle_grant(ms(0), grant_msg(1, ms(10)), dest);
    let t1 = read_token(&mut r);
    r.handle_grant(ms(0), grant_msg(2, ms(20)), dest);
    let t2 = read_token(&mut r);
    assert_eq!(r.poll_timeout(), Some(ms(10)));
    r.handle_completion(ms(1), t1, Status::Success);
    assert_eq!(r.poll_timeout(), Some(ms(20)), "a completed READ's deadline is gone");
    r.handle_completion(ms(1), t0, Status::Success);
    assert_eq!(r.outstanding_reads(), 1);
    // The freed slots are reused lowest first, with a new epoch; the old
    // READ's deadline (10 ms) does not come back with its slot.
    r.handle_grant(ms(2), grant_msg(3, ms(100)), dest);
    let t3 = read_token(&mut r);
    assert_ne!(t3, t0);
    assert_eq!((t3.wr_id() >> 32) & 0xff_ffff, 0, "the lowest free slot");
    assert_eq!(r.poll_timeout(), Some(ms(20)));
    // A stale completion of the slot's previous READ is not this READ's.
    r.handle_completion(ms(3), t0, Status::Success);
    assert_eq!(r.stats().unknown_completions, 1);
    assert_eq!(r.outstanding_reads(), 2);
    r.handle_timeout(ms(19));
    assert!(r.poll_action().is_none(), "nothing is late yet");
    r.handle_completion(ms(19), t2, Status::Success);
    assert_eq!(r.poll_timeout(), Some(ms(102)));
}

#[test]
fn reader_reports_every_late_read_in_slot_order_then_flushes_once() {
    let mut r = reader();
    let dest = Buffer { mr: 2, offset: 0, len: 64, addr: 0 };
    for (slot, left) in [(0, 30), (1, 10), (2, 20), (3, 50)] {
        r.handle_grant(ms(0), grant_msg(slot, ms(left)), dest);
        let _ = read_token(&mut r);
    }
    r.handle_timeout(ms(30));
    let late: Vec<u64> = std::iter::from_fn(|| r.poll_event())
        .filter_map(|e| match e {
            ReaderEvent::ReadTimedOut { lease } => Some(lease.raw() >> 32),
            _ => None,
        })
        .collect();
    assert_eq!(late, vec![0, 1, 2], "every late READ, in slot order, not deadline order");
    assert!(matches!(r.poll_action(), Some(ReaderAction::FlushQp)));
    assert_eq!(r.poll_timeout(), None);
    r.handle_timeout(ms(60));
    assert!(r.poll_action().is_none() && r.poll_event().is_none(), "flushed once");
    assert_eq!(r.stats().timed_out, 3);
}
