//! The reader's defensive paths, driven directly (no NIC model): declining,
//! the QP going to ERR or away with READs outstanding, and the counters.

use std::time::Duration;

use mwcap_mw::{
    Buffer, DeclineReason, Grant, LeaseId, ReadError, Reader, ReaderAction, ReaderConfig, ReaderEvent,
    ReaderStats, Release, ReleaseMode, Status, Token,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn reader(release: ReleaseMode) -> Reader {
    Reader::new(ReaderConfig { safety_margin: ms(1), release, max_lease: mwcap_mw::MAX_LEASE_TIME })
}

fn grant(slot: u64) -> Grant {
    Grant {
        lease: LeaseId::from_raw((slot << 32) | 1),
        addr: 0x1000,
        len: 8,
        rkey: 0x700 | slot as u32,
        time_left: ms(20),
    }
}

fn dest(i: u32) -> Buffer {
    Buffer { mr: 2, offset: u64::from(i) * 64, len: 64, addr: 0 }
}

/// The release of a declined grant (unread).
fn release_of(g: Grant) -> Release {
    Release { lease: g.lease, rkey: g.rkey, unread: true }
}

fn read_token(r: &mut Reader) -> Token {
    match r.poll_action() {
        Some(ReaderAction::Read { token, .. }) => token,
        other => panic!("expected a READ, got {other:?}"),
    }
}

fn events(r: &mut Reader) -> Vec<ReaderEvent> {
    std::iter::from_fn(|| r.poll_event()).collect()
}

#[test]
fn decline_releases_at_once_and_counts() {
    let mut r = reader(ReleaseMode::Message);
    r.decline(ms(0), grant(0), DeclineReason::Unwanted);
    r.decline(ms(0), grant(1), DeclineReason::Unwanted);
    assert_eq!(r.poll_action(), Some(ReaderAction::SendRelease(release_of(grant(0)))));
    assert_eq!(r.poll_action(), Some(ReaderAction::SendRelease(release_of(grant(1)))));
    assert_eq!(r.poll_action(), None, "nothing is read");
    let ev = events(&mut r);
    assert_eq!(ev.len(), 2);
    assert!(matches!(
        ev[0],
        ReaderEvent::Declined { lease, reason: DeclineReason::Unwanted, release: None, .. } if lease == grant(0).lease
    ));
    assert_eq!(r.stats(), ReaderStats { declined: 2, ..ReaderStats::default() });

    let mut r = reader(ReleaseMode::Piggyback);
    r.decline(ms(0), grant(3), DeclineReason::Unwanted);
    assert_eq!(r.poll_action(), None);
    assert!(matches!(
        events(&mut r)[..],
        [ReaderEvent::Declined { reason: DeclineReason::Unwanted, release: Some(rel), .. }] if rel == release_of(grant(3))
    ));
}

#[test]
fn declines_once_the_qp_is_down_say_so_and_release_nothing() {
    let mut r = reader(ReleaseMode::Message);
    r.handle_qp_error(ms(0));
    assert!(r.is_connection_lost());
    assert_eq!(events(&mut r), vec![ReaderEvent::ConnectionLost]);
    r.decline(ms(1), grant(0), DeclineReason::Unwanted);
    r.handle_grant(ms(1), grant(1), dest(0));
    assert_eq!(r.poll_action(), None, "no release can be sent, no READ posted");
    let ev = events(&mut r);
    assert!(matches!(
        ev[0],
        ReaderEvent::Declined { reason: DeclineReason::ConnectionLost, release: None, .. }
    ));
    assert!(matches!(
        ev[1],
        ReaderEvent::Declined { reason: DeclineReason::ConnectionLost, release: None, .. }
    ));
    assert_eq!(r.stats().declined, 2);
}

#[test]
fn handle_grant_counts_reads_and_declines() {
    let mut r = reader(ReleaseMode::Message);
    assert!(!r.is_connection_lost());
    r.handle_grant(ms(0), grant(0), dest(0));
    r.handle_grant(ms(0), grant(1), dest(1));
    r.handle_grant(ms(0), Grant { time_left: ms(1), ..grant(2) }, dest(2));
    r.handle_grant(ms(0), Grant { len: 0, ..grant(3) }, dest(3));
    assert_eq!(r.stats(), ReaderStats { reads: 2, declined: 2, ..ReaderStats::default() });
    assert_eq!(r.outstanding_reads(), 2);
}

#[test]
fn a_qp_error_fails_outstanding_reads_as_their_flushes_arrive() {
    let mut r = reader(ReleaseMode::Message);
    r.handle_grant(ms(0), grant(0), dest(0));
    let t0 = read_token(&mut r);
    r.handle_grant(ms(0), grant(1), dest(1));
    let t1 = read_token(&mut r);
    assert_eq!(r.poll_timeout(), Some(ms(20)));
    r.handle_qp_error(ms(1));
    assert!(r.is_connection_lost());
    assert_eq!(r.poll_timeout(), None, "no READ times out on a dead QP");
    assert_eq!(events(&mut r), vec![ReaderEvent::ConnectionLost]);
    r.handle_timeout(ms(30));
    assert_eq!(r.poll_action(), None, "no flush request: the QP is in ERR already");
    assert_eq!(r.outstanding_reads(), 2, "the destinations are the NIC's until the flushes");
    r.handle_completion(ms(2), t1, Status::Flushed);
    r.handle_completion(ms(2), t0, Status::Failed(12));
    assert_eq!(
        events(&mut r),
        vec![
            ReaderEvent::ReadFailed { lease: grant(1).lease, dest: dest(1), error: ReadError::Flushed },
            ReaderEvent::ReadFailed { lease: grant(0).lease, dest: dest(0), error: ReadError::Failed(12) },
        ]
    );
    assert_eq!(r.stats().reads_failed, 2);
    assert_eq!(r.outstanding_reads(), 0);
}

#[test]
fn a_destroyed_qp_returns_every_destination_at_once() {
    let mut r = reader(ReleaseMode::Piggyback);
    for i in 0..3 {
        r.handle_grant(ms(0), grant(u64::from(i)), dest(i));
        let _ = read_token(&mut r);
    }
    r.handle_qp_destroyed(ms(1));
    let ev = events(&mut r);
    assert_eq!(ev[0], ReaderEvent::ConnectionLost);
    let failed: Vec<_> = ev[1..]
        .iter()
        .map(|e| match e {
            ReaderEvent::ReadFailed { dest, error, .. } => (dest.offset, *error),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(failed, vec![(0, ReadError::Flushed), (64, ReadError::Flushed), (128, ReadError::Flushed)]);
    assert_eq!(r.stats().reads_failed, 3);
    assert_eq!(r.outstanding_reads(), 0);
}

/// `has_output` says whether an action or an event waits to be polled,
/// each on its own.
#[test]
fn has_output_counts_actions_and_events_each() {
    let mut r = reader(ReleaseMode::Message);
    assert!(!r.has_output());
    r.handle_grant(ms(0), grant(0), dest(0));
    assert!(r.has_output(), "a READ to post");
    let _ = read_token(&mut r);
    assert!(!r.has_output());
    r.handle_qp_error(ms(1));
    assert!(r.has_output(), "the ConnectionLost event alone");
    let _ = events(&mut r);
    assert!(!r.has_output());
}

/// A grant's time left is counted as at most the agreed lease
/// (`ReaderConfig::max_lease`): a hostile owner's larger one does not push
/// the READ's deadline, the reader's only bound on a READ that never
/// completes, out to the 71 minutes the wire allows.
#[test]
fn a_grant_past_the_agreed_lease_is_bounded_by_it() {
    let mut r =
        Reader::new(ReaderConfig { safety_margin: ms(1), release: ReleaseMode::Message, max_lease: ms(50) });
    let g = Grant { time_left: mwcap_mw::MAX_LEASE_TIME, ..grant(1) };
    r.handle_grant(ms(0), g, dest(0));
    let _ = read_token(&mut r);
    assert_eq!(r.poll_timeout(), Some(ms(50)), "the deadline is the agreed lease's");
    r.handle_timeout(ms(50));
    assert_eq!(r.poll_event(), Some(ReaderEvent::ReadTimedOut { lease: g.lease }));
    assert_eq!(r.poll_action(), Some(ReaderAction::FlushQp));
}

/// A READ that completes successfully after it timed out (its deadline,
/// the owner's expiry as the reader sees it, passed: its bytes overlap the
/// expiry) fails as `TimedOut`; its bytes are not handed out.
#[test]
fn a_read_that_succeeds_after_its_timeout_fails_as_timed_out() {
    let mut r = reader(ReleaseMode::Message);
    let g = grant(1);
    r.handle_grant(ms(0), g, dest(0));
    let token = read_token(&mut r);
    r.handle_timeout(ms(20));
    assert_eq!(r.poll_event(), Some(ReaderEvent::ReadTimedOut { lease: g.lease }));
    let _ = events(&mut r);
    r.handle_completion(ms(21), token, Status::Success);
    assert_eq!(
        events(&mut r),
        vec![ReaderEvent::ReadFailed { lease: g.lease, dest: dest(0), error: ReadError::TimedOut }]
    );
}
