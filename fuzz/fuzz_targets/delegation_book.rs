//! Any sequence of operations on the owner's delegation book, with tokens
//! that are genuine, altered or made of any bytes a peer could send: the
//! book never panics, a token never redeems twice, and once a tree is done
//! (the memory back) nothing of it redeems or stays exposed.
#![no_main]

use std::collections::BTreeSet;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use mwcap_delegation::{Book, CapId, Event, Holder, Range, Token};

#[derive(Arbitrary, Debug)]
enum Op {
    Expose { holder: u8, offset: u16, len: u16, expiry: u16 },
    Delegate { by: u8, cap: u8, offset: u16, len: u16, to: u8, expiry: u16 },
    /// Redeem token `token` (of those made), its byte `flip` xored with `bit`.
    Redeem { by: u8, id: u8, token: u8, flip: u16, bit: u8 },
    /// Redeem raw bytes.
    RedeemBytes { by: u8, id: u8, bytes: Vec<u8> },
    Revoke { cap: u8 },
    RevokeDelegations { by: u8, cap: u8 },
    Ended { cap: u8 },
    Tick { by: u16 },
}

const IDS: [&str; 3] = ["a", "b", "c"];

fuzz_target!(|ops: Vec<Op>| {
    let mut b = Book::new([3; 32]);
    let mut now = 0u64;
    let mut caps: Vec<CapId> = Vec::new();
    let mut tokens: Vec<Token> = Vec::new();
    let mut redeemed: BTreeSet<CapId> = BTreeSet::new();
    let mut exposed: BTreeSet<CapId> = BTreeSet::new();
    let mut done_caps: BTreeSet<CapId> = BTreeSet::new();
    let d = |t: u64| Duration::from_millis(t);
    for op in ops.into_iter().take(256) {
        match op {
            Op::Expose { holder, offset, len, expiry } => {
                let r = Range { offset: u64::from(offset), len: u64::from(len) };
                let c = b.expose(Holder(u64::from(holder % 4)), r, d(now + u64::from(expiry)));
                caps.push(c);
                exposed.insert(c);
            }
            Op::Delegate { by, cap, offset, len, to, expiry } => {
                let Some(&c) = caps.get(cap as usize % caps.len().max(1)) else { continue };
                let r = Range { offset: u64::from(offset), len: u64::from(len) };
                let id = IDS[to as usize % IDS.len()];
                if let Ok(dl) = b.delegate(d(now), Holder(u64::from(by % 4)), c, r, id, d(u64::from(expiry)), 0) {
                    caps.push(dl.cap);
                    tokens.push(dl.token);
                }
            }
            Op::Redeem { by, id, token, flip, bit } => {
                let Some(t) = tokens.get(token as usize % tokens.len().max(1)) else { continue };
                let mut x = t.as_bytes().to_vec();
                if bit != 0 {
                    let i = flip as usize % x.len();
                    x[i] ^= bit;
                }
                let id = IDS[id as usize % IDS.len()];
                if let Ok(r) = b.redeem(d(now), Holder(u64::from(by % 4)), id, &x) {
                    assert_eq!(bit, 0, "an altered token redeemed");
                    assert!(redeemed.insert(r.cap), "{:?} redeemed twice", r.cap);
                    assert!(!done_caps.contains(&r.cap), "{:?} redeemed after its tree was done", r.cap);
                    assert!(d(now) < r.expiry);
                    exposed.insert(r.cap);
                }
            }
            Op::RedeemBytes { by, id, bytes } => {
                let id = IDS[id as usize % IDS.len()];
                if let Ok(r) = b.redeem(d(now), Holder(u64::from(by % 4)), id, &bytes) {
                    // Only a genuine token's bytes can redeem.
                    assert!(tokens.iter().any(|t| t.as_bytes() == bytes.as_slice()), "raw bytes redeemed {r:?}");
                    assert!(redeemed.insert(r.cap));
                    exposed.insert(r.cap);
                }
            }
            Op::Revoke { cap } => {
                if let Some(&c) = caps.get(cap as usize % caps.len().max(1)) {
                    let _ = b.revoke(c);
                }
            }
            Op::RevokeDelegations { by, cap } => {
                if let Some(&c) = caps.get(cap as usize % caps.len().max(1)) {
                    let _ = b.revoke_delegations(Holder(u64::from(by % 4)), c);
                }
            }
            Op::Ended { cap } => {
                if let Some(&c) = caps.get(cap as usize % caps.len().max(1)) {
                    assert_eq!(b.ended(c), exposed.remove(&c), "ended({c:?}) and the exposures disagree");
                }
            }
            Op::Tick { by } => {
                now += u64::from(by);
                if b.poll_timeout().is_some_and(|t| t <= d(now)) {
                    b.handle_timeout(d(now));
                }
            }
        }
        while let Some(e) = b.poll_event() {
            if let Event::Done { root } = e {
                // Every capability of the tree is forgotten: none is exposed.
                for &c in &caps {
                    if b.bounds(c).is_none() && !done_caps.contains(&c) {
                        assert!(!exposed.contains(&c), "{c:?} still exposed when {root:?}'s tree was done");
                        done_caps.insert(c);
                    }
                }
            }
        }
    }
});
