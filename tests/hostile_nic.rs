//! The hostile-peer suite (issue 9 §5): a peer that runs none of mwcap's
//! connection code drives the `Nic` interface by hand (its own device, QP
//! and memory; frames built with the library's encoders) and attacks a
//! correct mwcap server and client under each policy. See
//! `tests/hostile/mod.rs` for the world and the checks every test ends with
//! (the healthy connection on the victim's device, no hazard, every buffer
//! back), and `docs/reliability.md` ("Hostile peers") for the list.

mod hostile;

use std::time::Duration;

use hostile::*;
use mwcap::backend::{WcOpcode, WcStatus};
use mwcap::conn::{Event, LossReason, Misbehavior, Policies, Policy, Role};
use mwcap_mw as mw;

/// Policies under which the victim of `role` owns its payloads under `owned`.
fn owning(role: Role, owned: Policy) -> [Policies; 2] {
    let other = [Policy::Mw, Policy::Confirm];
    other.map(|o| match role {
        Role::Client => Policies { request: owned, reply: o },
        Role::Server => Policies { request: o, reply: owned },
    })
}

/// A world in which the attacker holds an exposure of one victim buffer:
/// a reply's payload (victim server) or a request's (victim client).
fn exposed(role: Role, pol: Policies) -> (World, Seen) {
    let mut w = World::new(role, pol);
    let seen = match role {
        Role::Server => w.ask_for_payload(1),
        Role::Client => w.take_call().1,
    };
    (w, seen)
}

/// The attacker's bad READ took both QPs to ERR: the victim saw its
/// receives flushed.
fn flushed(r: Option<&LossReason>) -> bool {
    matches!(r, Some(LossReason::Completion { status: WcStatus::WrFlushErr, .. }))
}

/// Run until the victim is down; its reason.
fn goes_down(w: &mut World) -> LossReason {
    assert!(w.run_until(Duration::from_millis(50), |w| w.down().is_some()), "the victim stayed up");
    w.down().cloned().unwrap()
}

// ---- READs outside the grant ----

#[test]
fn mw_reads_outside_the_grant_fail_and_take_only_that_connection_down() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            // (name, address offset from the grant, length)
            let cases: [(&str, i64, u32); 5] = [
                ("past the end", PAYLOAD as i64 - 8, 16),
                ("just past the end", PAYLOAD as i64, 8),
                ("before the start", -8, 16),
                ("the whole buffer", 0, BUFFER_SIZE),
                ("another buffer of the region", 0, 64),
            ];
            for (name, off, len) in cases {
                let (mut w, seen) = exposed(role, pol);
                let (addr, _, rkey) = seen.target();
                let region = w.victim.data_region();
                let off = match (name, addr == region.addr) {
                    ("another buffer of the region", true) => BUFFER_SIZE as i64,
                    ("another buffer of the region", false) => -(BUFFER_SIZE as i64),
                    _ => off,
                };
                let (st, got) = w.read(addr.wrapping_add_signed(off), rkey, len);
                assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?} {name}");
                assert!(got.iter().all(|&b| b == 0), "{name}: nothing landed");
                let why = goes_down(&mut w);
                assert!(flushed(Some(&why)), "{role:?} {pol:?} {name}: {why:?}");
                w.finish();
            }
        }
    }
}

#[test]
fn no_policy_lets_the_attacker_read_the_victims_other_connection() {
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let (mut w, _) = exposed(role, pol);
            // The other connection's memory on the victim's device, with
            // its region key: the best guess an attacker can make.
            let other = match role {
                Role::Server => w.healthy.server.data_region(),
                Role::Client => w.healthy.client.data_region(),
            };
            let (st, _) = w.read(other.addr, other.rkey, 64);
            assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?}");
            let why = goes_down(&mut w);
            assert!(flushed(Some(&why)), "{role:?} {pol:?}: {why:?}");
            w.finish();
        }
    }
}

#[test]
fn confirm_the_region_key_reaches_this_connections_buffers_and_nothing_else() {
    // The documented cost of the confirm policy (docs/protocol-confirm.md,
    // "Security cost"): the offered rkey is the region's, so the attacker
    // reads any buffer of *this* connection's region, and only that.
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Confirm) {
            let (mut w, seen) = exposed(role, pol);
            let (addr, _, rkey) = seen.target();
            let region = w.victim.data_region();
            let other = if addr == region.addr { addr + BUFFER_SIZE as u64 } else { region.addr };
            let wr = w.attacker.post_read(other, rkey, 64);
            assert!(w.run_until(Duration::from_millis(5), |w| w.attacker.completion(wr).is_some()));
            assert_eq!(w.attacker.completion(wr).unwrap().status, WcStatus::Success, "{role:?} {pol:?}");
            assert!(contains_secret(&w.attacker.dst_bytes(64)), "another buffer of the region");
            // Past the region's end: refused.
            let (st, _) = w.read(region.addr + region.len as u64 - 8, rkey, 16);
            assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?}");
            assert!(flushed(Some(&goes_down(&mut w))));
            w.finish();
        }
    }
}

// ---- guessed keys ----

#[test]
fn guessed_keys_fail() {
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let owned = if role == Role::Server { pol.reply } else { pol.request };
            let (w0, seen) = exposed(role, pol);
            let (_, _, rkey) = seen.target();
            let region = w0.victim.data_region();
            drop(w0);
            let mut guesses = vec![
                ("next consumer key", rkey ^ 1),
                ("previous consumer key", (rkey & !0xff) | (rkey.wrapping_sub(1) & 0xff)),
                ("next index", rkey.wrapping_add(0x100)),
                ("previous index", rkey.wrapping_sub(0x100)),
            ];
            if owned == Policy::Mw {
                // The region under the windows has no remote rights at all.
                guesses.push(("the region's own key", region.rkey));
            }
            for (name, guess) in guesses {
                let (mut w, seen) = exposed(role, pol);
                let (addr, len, _) = seen.target();
                let (st, got) = w.read(addr, guess, len);
                assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?} {name}");
                assert!(!got.contains(&GRANTED), "{name}");
                assert!(flushed(Some(&goes_down(&mut w))), "{role:?} {pol:?} {name}");
                w.finish();
            }
        }
    }
}

// ---- stale READs ----

#[test]
fn mw_a_read_after_the_release_fails() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            let (mut w, seen) = exposed(role, pol);
            assert_eq!(w.payload(&seen).0, WcStatus::Success);
            let g = seen.grant.unwrap();
            let release = mw::Release { lease: g.lease, rkey: g.rkey };
            w.send(&engine_frame(mw_attach(mw::Message::Release(release))));
            assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 1), "{role:?} {pol:?}");
            assert!(w.down().is_none());
            w.assert_binds_invalidated_once();
            let (st, _) = w.read(g.addr, g.rkey, g.len);
            assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?}");
            assert!(flushed(Some(&goes_down(&mut w))));
            w.finish();
        }
    }
}

#[test]
fn mw_a_read_after_the_expiry_fails_and_the_buffer_waits_for_the_invalidation() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            let (mut w, seen) = exposed(role, pol);
            let g = seen.grant.unwrap();
            let start = w.now();
            // The attacker neither reads nor releases.
            assert!(w.run_until(LEASE * 2, |w| w.returned == 1), "{role:?} {pol:?}");
            assert!(w.now() - start >= LEASE - Duration::from_millis(1), "returned before the lease ended");
            let s = w.victim.stats().lease_owner.unwrap();
            assert_eq!((s.expired, s.invalidations), (1, 1), "{s:?}");
            // (`reachable_after_return`, checked at the end, says the window
            // was gone when the buffer came back.)
            assert!(w.down().is_none(), "an expiry does not tear the connection down");
            w.assert_binds_invalidated_once();
            let (st, _) = w.read(g.addr, g.rkey, g.len);
            assert_eq!(st, WcStatus::RemAccessErr);
            assert!(flushed(Some(&goes_down(&mut w))));
            w.finish();
        }
    }
}
