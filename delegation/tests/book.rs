//! The book against the hostile and the careless: forged, replayed,
//! widened, re-targeted and expired tokens, redemption after revocation, a
//! holder revoking while the delegate reads, and when the memory comes back.

use std::time::Duration;

use mwcap_delegation::{
    Book, CapId, DelegateError, Event, Holder, Range, RedeemError, Redeemed, RevokeError, Token,
    TokenTooLong, MAX_DEPTH, MAX_TOKEN,
};

const OWNER_SECRET: [u8; 32] = [0x5e; 32];
const HOLDER: Holder = Holder(1);
const DELEGATE: Holder = Holder(2);
const OTHER: Holder = Holder(3);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn range(offset: u64, len: u64) -> Range {
    Range { offset, len }
}

fn events(b: &mut Book) -> Vec<Event> {
    std::iter::from_fn(|| b.poll_event()).collect()
}

/// A book with one root: 4 KiB exposed to HOLDER until 1 s.
fn exposed() -> (Book, CapId) {
    let mut b = Book::new(OWNER_SECRET);
    let root = b.expose(HOLDER, range(0, 4096), ms(1000));
    (b, root)
}

#[test]
fn a_delegation_is_redeemed_once_by_its_identity_and_the_memory_waits_for_it() {
    let (mut b, root) = exposed();
    let t = b.delegate(ms(0), HOLDER, root, range(1024, 512), "decode-1", ms(800), 42).unwrap().token;
    // The holder releases its own exposure: the token can still be redeemed,
    // so the memory is not the owner's yet.
    assert!(b.ended(root));
    assert_eq!(events(&mut b), vec![]);
    let r = b.redeem(ms(10), DELEGATE, "decode-1", t.as_bytes()).unwrap();
    assert_eq!((r.range, r.expiry), (range(1024, 512), ms(800)));
    assert!(b.is_exposed(r.cap));
    // Replayed: refused, by anyone.
    for (who, id) in [(DELEGATE, "decode-1"), (OTHER, "decode-1"), (OTHER, "other")] {
        assert_eq!(b.redeem(ms(11), who, id, t.as_bytes()), Err(RedeemError::AlreadyRedeemed(r.cap)));
    }
    assert_eq!(events(&mut b), vec![]);
    // The delegate's READ is done and its window invalidated: now it is.
    assert!(b.ended(r.cap));
    assert!(!b.ended(r.cap), "a second report changes nothing");
    assert_eq!(events(&mut b), vec![Event::Done { root }]);
    assert!(b.is_empty(), "the tree is forgotten");
    // Replayed after the tree is over: unknown.
    assert_eq!(b.redeem(ms(12), DELEGATE, "decode-1", t.as_bytes()), Err(RedeemError::Unknown(r.cap)));
    let s = b.stats();
    assert_eq!((s.delegated, s.redeemed, s.refused_redeemed, s.refused_unknown, s.done), (1, 1, 3, 1, 1));
}

#[test]
fn forged_and_altered_tokens_and_another_owners_are_refused() {
    let (mut b, root) = exposed();
    let t = b.delegate(ms(0), HOLDER, root, range(0, 100), "d", ms(500), 1).unwrap().token;
    let mut other = Book::new([0x11; 32]);
    let theirs_root = other.expose(HOLDER, range(0, 4096), ms(1000));
    let theirs = other.delegate(ms(0), HOLDER, theirs_root, range(0, 4096), "d", ms(900), 1).unwrap().token;
    assert_eq!(b.redeem(ms(1), DELEGATE, "d", theirs.as_bytes()), Err(RedeemError::Forged));
    // Widened: the range bytes changed (offset 8 bytes in: cap, root, then
    // offset, len).
    let mut wide = t.as_bytes().to_vec();
    wide[1 + 3 * 8] = 0xff;
    assert_eq!(b.redeem(ms(1), DELEGATE, "d", &wide), Err(RedeemError::Forged));
    // Longer: the expiry changed.
    let mut late = t.as_bytes().to_vec();
    late[1 + 4 * 8 + 7] ^= 0x01;
    assert_eq!(b.redeem(ms(1), DELEGATE, "d", &late), Err(RedeemError::Forged));
    assert_eq!(b.redeem(ms(1), DELEGATE, "d", b""), Err(RedeemError::Forged));
    assert_eq!(b.redeem(ms(1), DELEGATE, "d", &[0u8; 200]), Err(RedeemError::Forged));
    // The genuine one still works.
    assert!(b.redeem(ms(1), DELEGATE, "d", t.as_bytes()).is_ok());
    assert_eq!(b.stats().refused_forged, 5);
}

#[test]
fn a_token_for_another_identity_is_refused_and_stays_redeemable_by_its_own() {
    let (mut b, root) = exposed();
    let t = b.delegate(ms(0), HOLDER, root, range(0, 100), "prefill-7", ms(500), 9).unwrap().token;
    match b.redeem(ms(1), OTHER, "decode-2", t.as_bytes()) {
        Err(e @ RedeemError::WrongIdentity { .. }) => {
            assert!(e.to_string().contains("prefill-7"), "{e}");
        }
        r => panic!("{r:?}"),
    }
    assert!(b.redeem(ms(2), DELEGATE, "prefill-7", t.as_bytes()).is_ok());
}

#[test]
fn an_expired_token_is_refused_and_the_memory_comes_back_without_it() {
    let (mut b, root) = exposed();
    let t = b.delegate(ms(0), HOLDER, root, range(0, 100), "d", ms(300), 9).unwrap().token;
    assert_eq!(b.poll_timeout(), Some(ms(300)));
    assert!(b.ended(root));
    // At its expiry, before the timer ran: refused.
    assert!(matches!(b.redeem(ms(300), DELEGATE, "d", t.as_bytes()), Err(RedeemError::Expired(_))));
    assert_eq!(events(&mut b), vec![]);
    b.handle_timeout(ms(300));
    assert_eq!(events(&mut b), vec![Event::Done { root }]);
    assert_eq!(b.poll_timeout(), None);
    assert_eq!(b.stats().tokens_expired, 1);
}

#[test]
fn the_next_timeout_is_the_earliest_token_still_out_whatever_was_redeemed_or_revoked() {
    let mut b = Book::new(OWNER_SECRET);
    let root = b.expose(HOLDER, range(0, 4096), ms(100_000));
    // Tokens expiring at 1, 2, ... 3000 ms; all but every 1000th are
    // redeemed or revoked, latest first and earliest first.
    let mut out = Vec::new();
    let caps: Vec<_> = (1..=3000u64)
        .map(|i| {
            let d = b.delegate(ms(0), HOLDER, root, range(0, 10), "d", ms(i), i).unwrap();
            (i, d)
        })
        .collect();
    for (i, d) in caps.iter().rev() {
        if i % 1000 == 0 {
            out.push(*i);
        } else if i % 2 == 0 {
            let r = b.redeem(ms(0), DELEGATE, "d", d.token.as_bytes()).unwrap();
            assert!(b.ended(r.cap));
        } else {
            b.revoke(d.cap).unwrap();
        }
    }
    assert_eq!(b.tokens_out(), 3);
    for i in [1000, 2000, 3000] {
        assert_eq!(b.poll_timeout(), Some(ms(i)), "the earliest token out is the one expiring at {i} ms");
        b.handle_timeout(ms(i));
    }
    assert_eq!((b.poll_timeout(), b.tokens_out(), b.stats().tokens_expired), (None, 0, 3));
    assert!(b.ended(root));
    assert_eq!(events(&mut b), vec![Event::Done { root }]);
    assert!(b.is_empty());
}

#[test]
fn below_a_capability_is_every_delegation_made_from_it_and_nothing_else() {
    let (mut b, root) = exposed();
    let other = b.expose(OTHER, range(0, 64), ms(1000));
    let d1 = b.delegate(ms(0), HOLDER, root, range(0, 100), "d", ms(500), 1).unwrap();
    let r1 = b.redeem(ms(0), DELEGATE, "d", d1.token.as_bytes()).unwrap();
    let d2 = b.delegate(ms(0), DELEGATE, r1.cap, range(0, 10), "e", ms(400), 2).unwrap();
    let d3 = b.delegate(ms(0), HOLDER, root, range(200, 100), "f", ms(500), 3).unwrap();
    b.delegate(ms(0), OTHER, other, range(0, 64), "g", ms(500), 4).unwrap();
    let below = |b: &Book, c| {
        let mut v = vec![];
        b.below(c, &mut v);
        v.sort();
        v
    };
    assert_eq!(below(&b, root), vec![d1.cap, d2.cap, d3.cap]);
    assert_eq!(below(&b, d1.cap), vec![d2.cap]);
    assert_eq!(below(&b, d2.cap), vec![]);
    assert_eq!(below(&b, CapId(999)), vec![], "an unknown capability has nothing below");
}

#[test]
fn a_delegation_is_never_wider_nor_longer_than_what_it_is_made_from() {
    let (mut b, root) = exposed();
    let widen = |b: &mut Book, cap, r, until| b.delegate(ms(0), HOLDER, cap, r, "d", until, 0).unwrap_err();
    assert!(matches!(widen(&mut b, root, range(4000, 200), ms(900)), DelegateError::OutOfRange { .. }));
    assert!(matches!(widen(&mut b, root, range(0, 0), ms(900)), DelegateError::OutOfRange { .. }));
    assert!(matches!(widen(&mut b, root, range(u64::MAX, 2), ms(900)), DelegateError::OutOfRange { .. }));
    let e = widen(&mut b, root, range(0, 10), ms(1001));
    assert_eq!(e, DelegateError::ExpiryTooLate { asked: ms(1001), held: ms(1000) });
    assert!(e.to_string().contains("no longer than"), "{e}");
    // A delegate delegates on, within what it holds.
    let t = b.delegate(ms(0), HOLDER, root, range(1000, 1000), "d", ms(600), 0).unwrap().token;
    let Redeemed { cap, .. } = b.redeem(ms(1), DELEGATE, "d", t.as_bytes()).unwrap();
    let again = |b: &mut Book, r, until| b.delegate(ms(2), DELEGATE, cap, r, "e", until, 0);
    assert!(matches!(again(&mut b, range(999, 10), ms(500)), Err(DelegateError::OutOfRange { .. })));
    assert!(matches!(again(&mut b, range(1990, 11), ms(500)), Err(DelegateError::OutOfRange { .. })));
    assert!(matches!(again(&mut b, range(1000, 10), ms(601)), Err(DelegateError::ExpiryTooLate { .. })));
    let t2 = again(&mut b, range(1500, 500), ms(600)).unwrap().token;
    let r2 = b.redeem(ms(3), OTHER, "e", t2.as_bytes()).unwrap();
    assert_eq!(b.parent(r2.cap), Some(cap));
    assert_eq!(b.parent(cap), Some(root));
    // Only the holder delegates, and only while it holds.
    assert_eq!(
        b.delegate(ms(4), OTHER, cap, range(1000, 1), "x", ms(5), 0),
        Err(DelegateError::NotHolder(cap))
    );
    assert!(b.ended(cap));
    assert_eq!(
        b.delegate(ms(4), DELEGATE, cap, range(1000, 1), "x", ms(5), 0),
        Err(DelegateError::NotLive(cap))
    );
    assert!(matches!(
        b.delegate(ms(4), HOLDER, root, range(0, 1), &"n".repeat(256), ms(5), 0),
        Err(DelegateError::IdentityTooLong(256))
    ));
    assert!(matches!(
        b.delegate(ms(4), HOLDER, root, range(0, 1), "x", ms(4), 0),
        Err(DelegateError::ExpiryPassed { .. })
    ));
    assert_eq!(b.stats().delegations_refused, 11);
}

#[test]
fn revoking_ends_every_delegation_below_and_refuses_their_tokens() {
    let (mut b, root) = exposed();
    let t1 = b.delegate(ms(0), HOLDER, root, range(0, 2048), "d", ms(900), 0).unwrap().token;
    let c1 = b.redeem(ms(1), DELEGATE, "d", t1.as_bytes()).unwrap().cap;
    let t2 = b.delegate(ms(2), DELEGATE, c1, range(0, 1024), "e", ms(800), 0).unwrap().token;
    let t3 = b.delegate(ms(2), HOLDER, root, range(2048, 2048), "f", ms(800), 0).unwrap().token;
    // Only a holder of the capability revokes its delegations.
    assert_eq!(b.revoke_delegations(OTHER, root), Err(RevokeError::NotHolder(root)));
    // The holder revokes while the delegate reads: the delegate's exposure
    // is to end (its window invalidated), the tokens out are refused.
    b.revoke_delegations(HOLDER, root).unwrap();
    assert_eq!(events(&mut b), vec![Event::End { cap: c1, holder: DELEGATE }]);
    assert!(b.is_exposed(c1), "exposed until the evidence comes");
    assert!(matches!(b.redeem(ms(3), OTHER, "e", t2.as_bytes()), Err(RedeemError::Revoked(_))));
    assert!(matches!(b.redeem(ms(3), OTHER, "f", t3.as_bytes()), Err(RedeemError::Revoked(_))));
    assert!(matches!(
        b.delegate(ms(3), DELEGATE, c1, range(0, 1), "g", ms(5), 0),
        Err(DelegateError::Revoked(_))
    ));
    // The holder's own exposure stays, and can delegate anew.
    assert!(b.is_exposed(root));
    let t4 = b.delegate(ms(4), HOLDER, root, range(0, 10), "d", ms(900), 0).unwrap().token;
    // Revoked twice: said once.
    b.revoke(root).unwrap();
    b.revoke(root).unwrap();
    assert_eq!(events(&mut b), vec![Event::End { cap: root, holder: HOLDER }]);
    assert!(matches!(b.redeem(ms(5), DELEGATE, "d", t4.as_bytes()), Err(RedeemError::Revoked(_))));
    assert!(b.ended(root));
    assert_eq!(events(&mut b), vec![], "c1 is still exposed");
    assert!(b.ended(c1));
    assert_eq!(events(&mut b), vec![Event::Done { root }]);
    assert_eq!(b.revoke(root), Err(RevokeError::Unknown(root)));
}

#[test]
fn errors_say_what_happened_and_what_to_do() {
    let e = RedeemError::AlreadyRedeemed(CapId(4)).to_string();
    assert!(e.contains("redeems once"), "{e}");
    let e = DelegateError::NotLive(CapId(4)).to_string();
    assert!(e.contains("before releasing"), "{e}");
    let t = Token::from_bytes(vec![1, 2, 3]).unwrap();
    assert_eq!(format!("{t:?}"), "Token(3 bytes)");
    assert_eq!(t.as_bytes(), [1, 2, 3]);
}

#[test]
fn bytes_longer_than_any_token_are_not_a_token() {
    let longest = Token::from_bytes([7u8; MAX_TOKEN]).expect("the longest token");
    assert_eq!(longest.as_bytes(), [7u8; MAX_TOKEN]);
    let e = Token::from_bytes([7u8; MAX_TOKEN + 1]).expect_err("one byte too long");
    assert_eq!(e, TokenTooLong(MAX_TOKEN + 1));
    assert!(e.to_string().contains("not a token"), "{e}");
}

proptest::proptest! {
    /// Whatever bytes a peer sends as a token, the book refuses them as
    /// forged, without panicking; and a genuine token with any one byte
    /// changed is forged too.
    #[test]
    fn any_bytes_but_a_sealed_token_are_forged(
        bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..400),
        flip in 0usize..1000,
        bit in 0u8..8,
    ) {
        let (mut b, root) = exposed();
        proptest::prop_assert_eq!(b.redeem(ms(0), DELEGATE, "d", &bytes), Err(RedeemError::Forged));
        let t = b.delegate(ms(0), HOLDER, root, range(0, 10), "d", ms(10), 5).unwrap().token;
        let mut x = t.as_bytes().to_vec();
        let i = flip % x.len();
        x[i] ^= 1 << bit;
        proptest::prop_assert_eq!(b.redeem(ms(0), DELEGATE, "d", &x), Err(RedeemError::Forged));
        proptest::prop_assert!(b.redeem(ms(0), DELEGATE, "d", t.as_bytes()).is_ok());
    }
}

#[test]
fn a_chain_of_delegations_stops_at_max_depth() {
    let (mut b, root) = exposed();
    assert_eq!(b.depth(root), Some(0));
    let mut cap = root;
    for depth in 1..=MAX_DEPTH {
        let t =
            b.delegate(ms(0), HOLDER, cap, range(0, 4096), "self", ms(900), u64::from(depth)).unwrap().token;
        cap = b.redeem(ms(0), HOLDER, "self", t.as_bytes()).unwrap().cap;
        assert_eq!(b.depth(cap), Some(depth));
    }
    let e = b.delegate(ms(0), HOLDER, cap, range(0, 4096), "self", ms(900), 99).unwrap_err();
    assert_eq!(e, DelegateError::TooDeep(cap));
    assert!(e.to_string().contains("a chain of delegations stops"), "{e}");
    // The capability at the bottom is still live and held.
    assert!(b.is_exposed(cap));
}
