//! The hostile-peer suite (issue 9 §5): a peer that runs none of mwcap's
//! connection code drives the `Nic` interface by hand (its own device, QP
//! and memory; frames built with the library's encoders) and attacks a
//! correct mwcap server and client under each policy. See
//! `tests/hostile/mod.rs` for the world and the checks every test ends with
//! (the healthy connection on the victim's device, no hazard, every buffer
//! back), and `docs/reliability.md` ("Hostile peers") for the list.

mod hostile;

use mwcap::backend::NicOps;
use std::time::Duration;

use hostile::*;
use mwcap::backend::{WcOpcode, WcStatus};
use mwcap::conn::{Event, LossReason, Misbehavior, Policies, Policy, Role};
use mwcap_fallback as fb;
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

// ---- by the book ----

#[test]
fn by_the_book_the_attacker_reads_the_grant_and_ends_it() {
    // The baseline: the hand-written peer speaks the protocol correctly.
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let (mut w, seen) = exposed(role, pol);
            assert_eq!(w.payload(&seen).0, WcStatus::Success, "{role:?} {pol:?}");
            let end = match (seen.grant, seen.exposed) {
                (Some(g), _) => release(g.lease.raw(), g.rkey),
                (None, Some((msg, buffer, generation, _))) => {
                    engine_frame(fb_attach(fb::Message::Confirm { msg, buffer, generation }))
                }
                _ => unreachable!(),
            };
            w.send(&end);
            assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 1), "{role:?} {pol:?}");
            assert!(w.down().is_none());
            if seen.grant.is_some() {
                w.assert_binds_invalidated_once();
            }
            w.finish();
        }
    }
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
                // Nothing of the victim's landed: only the simulator's
                // bytes for a failed READ's destination, if any.
                assert!(got.iter().all(|&b| b == 0 || b == mwcap::sim::LATE_BYTE), "{name}: nothing landed");
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
fn rxe_a_window_reaches_its_connections_region_and_never_another_connections() {
    // On rxe a window's bounds are not enforced, only its region's (`mwcap
    // probe` reports it): the attacker's window key reads any buffer of
    // *this* connection's region. Each connection keeps a registration of
    // its own (its own protection domain), so that is all it reaches.
    use mwcap::sim::DeviceConfig;
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            let mut w = World::on(role, pol, DeviceConfig::rxe());
            let seen = match role {
                Role::Server => w.ask_for_payload(1),
                Role::Client => w.take_call().1,
            };
            let (addr, _, rkey) = seen.target();
            let region = w.victim.data_region();
            let beside = if addr == region.addr { addr + BUFFER_SIZE as u64 } else { region.addr };
            let wr = w.attacker.post_read(beside, rkey, 64);
            assert!(w.run_until(Duration::from_millis(5), |w| w.attacker.completion(wr).is_some()));
            assert_eq!(w.attacker.completion(wr).unwrap().status, WcStatus::Success, "{role:?} {pol:?}: rxe");
            assert!(contains_secret(&w.attacker.dst_bytes(64)), "another buffer of this connection's region");
            // The victim's other connection, with the window's key: refused.
            let other = match role {
                Role::Server => w.healthy.server.data_region(),
                Role::Client => w.healthy.client.data_region(),
            };
            let (st, got) = w.read(other.addr, rkey, 64);
            assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?}");
            assert!(!contains_secret(&got), "{role:?} {pol:?}");
            assert!(flushed(Some(&goes_down(&mut w))));
            w.finish();
        }
        for pol in ALL {
            // And with the other connection's own region key.
            let mut w = World::on(role, pol, DeviceConfig::rxe());
            let other = match role {
                Role::Server => w.healthy.server.data_region(),
                Role::Client => w.healthy.client.data_region(),
            };
            let (st, _) = w.read(other.addr, other.rkey, 64);
            assert_eq!(st, WcStatus::RemAccessErr, "{role:?} {pol:?}");
            assert!(flushed(Some(&goes_down(&mut w))));
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
            // What the NIC lets the attacker reach: this connection's data
            // region, nothing else of the victim's device.
            let reach = w.fabric.exposure(w.victim_device(), w.attacker.qp_addr());
            assert_eq!(reach.len(), 1, "{reach:?}");
            assert_eq!((reach[0].mr, reach[0].bytes.clone()), (region.id, 0..region.len));
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
    // Each guess is made from the key of the exposure it is tried on (a
    // connection's consumer keys are its own: another world's key says
    // nothing of this one's).
    type Guess = fn(u32, u32) -> u32;
    let guesses: [(&str, Guess, bool); 5] = [
        ("next consumer key", |rkey, _| rkey ^ 1, false),
        ("previous consumer key", |rkey, _| (rkey & !0xff) | (rkey.wrapping_sub(1) & 0xff), false),
        ("next index", |rkey, _| rkey.wrapping_add(0x100), false),
        ("previous index", |rkey, _| rkey.wrapping_sub(0x100), false),
        // The region under the windows has no remote rights at all.
        ("the region's own key", |_, region| region, true),
    ];
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let owned = if role == Role::Server { pol.reply } else { pol.request };
            for (name, guess, mw_only) in guesses {
                if mw_only && owned != Policy::Mw {
                    continue;
                }
                let (mut w, seen) = exposed(role, pol);
                let (addr, len, rkey) = seen.target();
                let guess = guess(rkey, w.victim.data_region().rkey);
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
            let release = mw::Release { lease: g.lease, rkey: g.rkey, unread: false };
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

// ---- forged, replayed and unknown releases ----

fn release(lease: u64, rkey: u32) -> Vec<u8> {
    engine_frame(mw_attach(mw::Message::Release(mw::Release {
        lease: mw::LeaseId::from_raw(lease),
        rkey,
        unread: false,
    })))
}

fn owner_stats(w: &World) -> mw::OwnerStats {
    w.victim.stats().lease_owner.expect("the victim owns a direction under mw")
}

#[test]
fn mw_forged_and_unknown_releases_are_counted_and_end_nothing() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            let (mut w, seen) = exposed(role, pol);
            let g = seen.grant.unwrap();
            let (slot, epoch) = (g.lease.raw() >> 32, g.lease.raw() & 0xffff_ffff);
            let forged = [
                // A window of the pool that was never granted.
                ((slot + 1) % u64::from(BUFFERS)) << 32 | 1,
                // The granted lease with a wrong rkey.
                g.lease.raw(),
                // No window at all.
                0xdead_beef_0000_0001,
                // The granted window, a bind that never was.
                slot << 32 | (epoch + 7),
            ];
            let rkeys = [g.rkey ^ 0x100, g.rkey ^ 1, 0x1234_5678, g.rkey];
            for (lease, rkey) in forged.into_iter().zip(rkeys) {
                w.send(&release(lease, rkey));
            }
            w.run_for(Duration::from_millis(2));
            assert!(w.down().is_none(), "{role:?} {pol:?}: {:?}", w.down());
            assert_eq!(owner_stats(&w).forged_releases, 4, "{:?}", owner_stats(&w));
            assert_eq!((w.returned, w.victim.busy_buffers()), (0, 1), "the lease is still on");
            // The grant still works: nothing was invalidated early.
            assert_eq!(w.payload(&seen).0, WcStatus::Success);
            w.send(&release(g.lease.raw(), g.rkey));
            assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 1));
            w.assert_binds_invalidated_once();
            w.finish();
        }
    }
}

#[test]
fn mw_a_replayed_release_is_stale_and_never_ends_a_later_lease() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            let (mut w, first) = exposed(role, pol);
            let g = first.grant.unwrap();
            w.send(&release(g.lease.raw(), g.rkey));
            assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 1));
            // A second exposure (possibly the same window, rebound).
            let second = match role {
                Role::Server => w.ask_for_payload(2),
                Role::Client => w.take_call().1,
            };
            let g2 = second.grant.unwrap();
            for _ in 0..3 {
                w.send(&release(g.lease.raw(), g.rkey));
            }
            w.run_for(Duration::from_millis(2));
            assert!(w.down().is_none(), "{role:?} {pol:?}: {:?}", w.down());
            assert_eq!(owner_stats(&w).stale_releases, 3, "{:?}", owner_stats(&w));
            assert_eq!(w.returned, 1, "the second lease is still on");
            assert_eq!(w.payload(&second).0, WcStatus::Success);
            w.send(&release(g2.lease.raw(), g2.rkey));
            assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 2));
            w.assert_binds_invalidated_once();
            w.finish();
        }
    }
}

// ---- forged and replayed confirms (the victim owns under confirm) ----

#[test]
fn confirm_forged_and_replayed_confirms_get_no_intact_and_end_nothing() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Confirm) {
            let (mut w, seen) = exposed(role, pol);
            let (msg, buffer, generation, _) = seen.exposed.unwrap();
            assert_eq!(w.payload(&seen).0, WcStatus::Success);
            let next_gen = fb::Generation::from_raw(generation.raw() + 1);
            let other_buf = fb::BufferId::from_raw(buffer.raw() ^ 1);
            let other_msg = fb::MsgId::from_raw(msg.raw() + 100);
            for (m, b, g) in
                [(other_msg, buffer, generation), (msg, buffer, next_gen), (msg, other_buf, generation)]
            {
                let v = w.verdict(fb::Message::Confirm { msg: m, buffer: b, generation: g });
                assert_ne!(v, fb::Verdict::Intact, "{role:?} {pol:?}");
            }
            assert!(w.down().is_none(), "{role:?} {pol:?}: {:?}", w.down());
            assert_eq!((w.returned, w.victim.busy_buffers()), (0, 1), "the exposure is still on");
            let real = fb::Message::Confirm { msg, buffer, generation };
            assert_eq!(w.verdict(real), fb::Verdict::Intact);
            assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 1));
            // Replayed, now that the buffer is back (and rewritten with the secret).
            assert_eq!(w.verdict(real), fb::Verdict::Reused, "{role:?} {pol:?}");
            assert!(w.down().is_none());
            w.finish();
        }
    }
}

// ---- malformed and oversized frames ----

#[test]
fn malformed_frames_take_the_victim_down_with_the_decoders_reason() {
    use mwcap::conn::frame::{Frame, FrameError};
    let ping = Frame::Ping { seq: 7 }.encode().unwrap();
    let pong = Frame::Pong { seq: 7 }.encode().unwrap();
    // Where the kind is, whatever the header holds before it.
    let kind_at = ping.iter().zip(&pong).position(|(a, b)| a != b).unwrap();
    let mut bad_version = ping.clone();
    bad_version[0] = 0x7e;
    let mut bad_kind = ping.clone();
    bad_kind[kind_at] = 0x7f;
    let truncated = ping[..ping.len() - 1].to_vec();
    let mut trailing = ping.clone();
    trailing.push(0);
    type Case = (&'static str, Vec<u8>, fn(&FrameError) -> bool);
    let cases: [Case; 5] = [
        ("empty", vec![], |e| matches!(e, FrameError::Truncated { .. })),
        ("bad version", bad_version, |e| matches!(e, FrameError::Version(0x7e))),
        ("bad kind", bad_kind, |e| matches!(e, FrameError::UnknownKind(0x7f))),
        ("truncated", truncated, |e| matches!(e, FrameError::Truncated { .. })),
        ("trailing bytes", trailing, |e| matches!(e, FrameError::Trailing(1))),
    ];
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            for (name, bytes, want) in &cases {
                let (mut w, _) = exposed(role, pol);
                w.send(bytes);
                match goes_down(&mut w) {
                    LossReason::PeerMisbehaved(Misbehavior::MalformedFrame(e)) if want(&e) => {}
                    other => panic!("{role:?} {pol:?} {name}: {other:?}"),
                }
                assert!(
                    w.events
                        .iter()
                        .any(|e| matches!(e, Event::ConnectionLost(LossReason::PeerMisbehaved(_)))),
                    "the user is told"
                );
                w.finish();
            }
        }
    }
}

#[test]
fn an_oversized_frame_fails_at_the_nic_and_takes_the_victim_down() {
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let (mut w, _) = exposed(role, pol);
            let wr = w.attacker.send(&vec![1; mwcap::conn::frame::MAX_FRAME + 1]);
            let why = goes_down(&mut w);
            assert!(
                matches!(
                    why,
                    LossReason::Completion { status: WcStatus::LocLenErr, opcode: WcOpcode::Recv, .. }
                ),
                "{role:?} {pol:?}: {why:?}"
            );
            assert!(w.run_until(Duration::from_millis(5), |w| w.attacker.completion(wr).is_some()));
            assert_eq!(w.attacker.completion(wr).unwrap().status, WcStatus::RemInvReqErr);
            w.finish();
        }
    }
}

// ---- floods ----

/// The victim went down for the first frame past the credit it granted:
/// exactly one past everything the attacker saw granted.
fn assert_cut_off_at_its_credit(w: &mut World, what: &str) {
    let why = goes_down(w);
    // Every frame the victim sent before it went down has landed.
    w.settle();
    let seen = w.attacker.credit_granted;
    match why {
        LossReason::PeerMisbehaved(Misbehavior::ExceedsCredit { granted, received }) => {
            assert_eq!((granted, received), (seen, seen + 1), "{what}: cut off at the first frame past")
        }
        other => panic!("{what}: {other:?}"),
    }
}

#[test]
fn a_flood_past_its_credit_on_a_receive_queue_of_its_own_is_cut_off_at_the_first_frame_past() {
    // Issue 19, finding 1: 300 requests with credit for far fewer met a few
    // RNR NAKs and were all served; the protocol says a peer sends no more
    // frames than it was granted credit for. Now the first frame past
    // everything the victim granted takes the connection down (the victim
    // keeps granting as it reposts, in `Credit` frames: the attacker counts
    // them).
    use mwcap::conn::frame::Frame;
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let mut w = World::new(role, pol);
            for msg_id in 1..=300 {
                match role {
                    Role::Server => w.attacker.send(&request_frame(msg_id, &[])),
                    Role::Client => w.attacker.send_frame(&Frame::Credit),
                };
                if msg_id % 64 == 0 {
                    // The attacker's send queue is 128 deep: let some land.
                    if w.run_until(Duration::from_millis(5), |w| w.down().is_some()) {
                        break;
                    }
                }
            }
            assert_cut_off_at_its_credit(&mut w, &format!("{role:?} {pol:?}"));
            let requests = w.victim.stats().requests;
            assert!(requests < w.attacker.credit_granted, "{role:?} {pol:?}: {requests} requests served");
            w.finish();
        }
    }
}

#[test]
fn a_ping_flood_that_ignores_flow_control_ends_the_connection_not_the_victims_memory() {
    // Four times the victim's receives at once, each asking for an answer,
    // while the victim holds an exposure: the first ping past the credit
    // ends the connection, before any answer waits for long.
    use mwcap::conn::frame::Frame;
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let (mut w, _) = exposed(role, pol);
            for i in 0..4 * u64::from(CTRL_SLOTS) {
                w.attacker.send_frame(&Frame::Ping { seq: i });
            }
            assert_cut_off_at_its_credit(&mut w, &format!("{role:?} {pol:?}"));
            w.finish();
        }
    }
}

// ---- bounds per connection (issue 19) ----

/// A request to the victim server whose payload, under the request
/// policy, is a window grant with `time_left` (over a window of the
/// attacker's, `rkey`) or a confirm exposure, of `PAYLOAD` bytes.
fn payload_request(w: &World, msg_id: u64, rkey: u32, time_left: Duration) -> Vec<u8> {
    let a = match w.policies.request {
        Policy::Mw => mw_attach(mw::Message::Grant(mw::Grant {
            lease: mw::LeaseId::from_raw(7 << 32 | msg_id),
            addr: w.attacker.mem.addr,
            len: PAYLOAD as u32,
            rkey,
            time_left,
        })),
        Policy::Confirm => fb_attach(fb::Message::Expose {
            msg: fb::MsgId::from_raw(msg_id),
            buffer: fb::BufferId::from_raw(msg_id as u32),
            generation: fb::Generation::from_raw(1),
            region: fb::Region::new(w.attacker.mem.addr, PAYLOAD as u32, w.attacker.mem.rkey),
        }),
    };
    request_frame(msg_id, &[a])
}

/// The victim's user takes every buffer of its pool.
fn hold_every_buffer(w: &mut World) -> Vec<mwcap::conn::Buf> {
    let held: Vec<_> = std::iter::from_fn(|| w.victim.alloc()).collect();
    assert_eq!(held.len(), BUFFERS as usize);
    held
}

#[test]
fn a_server_whose_user_holds_its_buffers_keeps_no_more_waiting_payloads_than_its_bound() {
    // Issue 19, finding 1: while the server's user held every buffer, it
    // kept every grant a client sent (20,000), with no cap: credit does
    // not limit them, the server reposts each receive at once. Now at most
    // `max_waiting_payloads` wait; the next takes the connection down.
    // The attacker keeps to the flow control throughout.
    for pol in ALL {
        let mut w = World::with_config(Role::Server, pol, |c| c.lease_time = Duration::from_secs(10));
        let max = w.victim.config().max_waiting_payloads;
        assert_eq!(max, 64, "the default");
        let held = hold_every_buffer(&mut w);
        let rkey = w.attacker.bind_own(BUFFER_SIZE);
        for msg_id in 1..=u64::from(max) {
            let f = payload_request(&w, msg_id, rkey, Duration::from_secs(10));
            w.send_within_credit(&f);
        }
        w.run_for(Duration::from_millis(2));
        assert!(w.down().is_none(), "{pol:?}: {} waiting is within the bound: {:?}", max, w.down());
        let f = payload_request(&w, u64::from(max) + 1, rkey, Duration::from_secs(10));
        w.send_within_credit(&f);
        match goes_down(&mut w) {
            LossReason::PeerMisbehaved(Misbehavior::TooManyWaitingPayloads { waiting }) => {
                assert_eq!(waiting, max, "{pol:?}")
            }
            other => panic!("{pol:?}: {other:?}"),
        }
        // Nothing was read into a buffer the user holds, and no request
        // surfaced; each is dropped with the connection.
        assert_eq!(w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served, 0, "{pol:?}");
        let dropped = w.events.iter().filter(|e| matches!(e, Event::RequestDropped { .. })).count();
        assert_eq!(dropped as u32, max + 1, "{pol:?}");
        for b in held {
            w.victim.free(b);
        }
        w.finish();
    }
}

#[test]
fn payloads_whose_lease_ran_out_while_waiting_do_not_count_against_the_bound() {
    // The bound is on payloads that can still be read: a client whose
    // earlier payloads expired while the server's user held its buffers may
    // send as many live ones again. Expired grants are declined and
    // released (the owner's lease is over anyway); expired confirm
    // exposures are dropped unread (`ConfirmTimedOut`).
    for pol in ALL {
        let mut w = World::new(Role::Server, pol);
        let max = u64::from(w.victim.config().max_waiting_payloads);
        let held = hold_every_buffer(&mut w);
        let rkey = w.attacker.bind_own(BUFFER_SIZE);
        for msg_id in 1..=max {
            let f = payload_request(&w, msg_id, rkey, LEASE);
            w.send_within_credit(&f);
        }
        w.run_for(LEASE);
        for msg_id in max + 1..=2 * max {
            let f = payload_request(&w, msg_id, rkey, Duration::from_secs(10));
            w.send_within_credit(&f);
        }
        w.run_for(Duration::from_millis(2));
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        if pol.request == Policy::Mw {
            let released = w.attacker.frames.iter().filter(|f| Seen::of(f).release.is_some()).count();
            assert_eq!(released as u64, max, "{pol:?}: every expired grant released");
        }
        let dropped = w.events.iter().filter(|e| matches!(e, Event::RequestDropped { .. })).count();
        assert_eq!(dropped as u64, max, "{pol:?}: every expired payload's request dropped");
        let f = payload_request(&w, 2 * max + 1, rkey, Duration::from_secs(10));
        w.send_within_credit(&f);
        assert!(matches!(
            goes_down(&mut w),
            LossReason::PeerMisbehaved(Misbehavior::TooManyWaitingPayloads { .. })
        ));
        assert_eq!(w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served, 0, "{pol:?}");
        for b in held {
            w.victim.free(b);
        }
        w.finish();
    }
}

#[test]
fn confirm_a_burst_of_unanswered_exposures_holds_the_servers_buffers_for_one_lease() {
    // Issue 19, finding 3: a server reading under confirm took a burst of
    // exposures, read them a pool of buffers at a time, and held each
    // buffer until its confirm timed out, `confirm_timeout` after its READ:
    // one burst pinned every buffer for 63 leases. Now every exposure is
    // read and confirmed within a lease of its arrival or dropped, and an
    // exposure whose time ran out while it waited for a buffer is not read.
    for pol in ALL.into_iter().filter(|p| p.request == Policy::Confirm) {
        let mut w = World::new(Role::Server, pol);
        let n = 4 * u64::from(BUFFERS);
        let start = w.now();
        for msg_id in 1..=n {
            let f = payload_request(&w, msg_id, 0, LEASE);
            w.send_within_credit(&f);
        }
        let sent = w.now();
        assert!(sent - start < LEASE / 10, "the burst took {:?}", sent - start);
        // The attacker never answers a confirm.
        w.run_until(LEASE, |w| w.victim.busy_buffers() == BUFFERS as usize);
        assert_eq!(w.victim.busy_buffers(), BUFFERS as usize, "{pol:?}: every buffer read into");
        let free = w.run_until(2 * LEASE, |w| w.victim.busy_buffers() == 0);
        assert!(free, "{pol:?}: buffers still held at {:?}", w.now() - start);
        assert!(w.now() <= sent + LEASE, "{pol:?}: buffers back {:?} after the burst", w.now() - start);
        let served = w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served;
        assert_eq!(served, u64::from(BUFFERS) * PAYLOAD as u64, "{pol:?}: one READ per buffer, no more");
        w.run_for(Duration::from_millis(2));
        let timed_out = mwcap::conn::CallError::Payload(mwcap::conn::PayloadError::Confirm(
            fb::ReadError::ConfirmTimedOut,
        ));
        let dropped = w
            .events
            .iter()
            .filter(|e| matches!(e, Event::RequestDropped { error, .. } if *error == timed_out))
            .count();
        assert_eq!(dropped as u64, n, "{pol:?}: every request dropped: {:?}", w.events);
        let mut refused: Vec<u64> =
            w.attacker.frames.iter().filter_map(|f| Seen::of(f).refuse).map(|m| m.raw()).collect();
        refused.sort_unstable();
        assert_eq!(refused, (1..=n).collect::<Vec<_>>(), "{pol:?}: the client is told of each");
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        w.finish();
    }
}

#[test]
fn a_server_whose_user_held_its_buffers_is_not_a_peer_withholding_credit() {
    // Issue 19, finding 1: when the buffers came free, the grants that had
    // waited past their lease were declined at once, one release each,
    // more than the client's receives; the server took the client for one
    // withholding credit (`WithholdsCredit`), though it granted credit for
    // every receive it posted. Now the releases wait for credit and go.
    for pol in ALL.into_iter().filter(|p| p.request == Policy::Mw) {
        let mut w = World::new(Role::Server, pol);
        let held = hold_every_buffer(&mut w);
        let rkey = w.attacker.bind_own(BUFFER_SIZE);
        let n = 5 * CTRL_SLOTS as u64;
        for msg_id in 1..=n {
            let f = payload_request(&w, msg_id, rkey, LEASE);
            w.send_within_credit(&f);
        }
        w.run_for(LEASE + Duration::from_millis(10));
        for b in held {
            w.victim.free(b);
        }
        let all = w.run_until(Duration::from_millis(50), |w| {
            w.attacker.frames.iter().filter(|f| Seen::of(f).release.is_some()).count() as u64 == n
        });
        assert!(all, "{pol:?}: every grant released; down: {:?}", w.down());
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        let dropped = w.events.iter().filter(|e| matches!(e, Event::RequestDropped { .. })).count();
        assert_eq!(dropped as u64, n, "{pol:?}: each request dropped (its lease ran out)");
        assert_eq!(w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served, 0, "{pol:?}");
        w.finish();
    }
}

#[test]
fn mw_a_client_releases_the_grant_of_a_second_reply_to_a_call_unread() {
    // A client's waiting payloads are replies to its own calls, one each:
    // a server that replies again and again to one call, each time with a
    // grant, while the client's user holds every buffer, gets each later
    // grant released at once instead of kept.
    for pol in ALL.into_iter().filter(|p| p.reply == Policy::Mw) {
        let mut w = World::new(Role::Client, pol);
        let held = hold_every_buffer(&mut w);
        let now = w.now();
        let call = w.victim.call(now, b"call", None).unwrap();
        let msg_id = Seen::of(&w.next_frame()).msg_id.unwrap();
        let rkey = w.attacker.bind_own(BUFFER_SIZE);
        w.attacker.nic.write_mr(w.attacker.mem.id, 0, &[0x77; PAYLOAD]).unwrap();
        let n = 3 * CTRL_SLOTS as u64;
        for k in 1..=n {
            let g = mw::Grant {
                lease: mw::LeaseId::from_raw(5 << 32 | k),
                addr: w.attacker.mem.addr,
                len: PAYLOAD as u32,
                rkey,
                time_left: Duration::from_secs(10),
            };
            w.send_within_credit(&reply_frame(msg_id, &[mw_attach(mw::Message::Grant(g))]));
        }
        w.run_for(Duration::from_millis(2));
        let released: Vec<u64> = w
            .attacker
            .frames
            .iter()
            .filter_map(|f| Seen::of(f).release)
            .map(|r| r.lease.raw() & 0xffff)
            .collect();
        assert_eq!(released, (2..=n).collect::<Vec<_>>(), "{pol:?}: every grant but the first, unread");
        assert_eq!(w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served, 0, "{pol:?}");
        // The first is read once a buffer comes free.
        for b in held {
            w.victim.free(b);
        }
        let got = w.run_until(Duration::from_millis(20), |w| {
            w.events.iter().any(|e| matches!(e, Event::Reply { call: c, data: Some(b), .. } if *c == call && b[..] == [0x77; PAYLOAD][..]))
        });
        assert!(got, "{pol:?}: {:?} {:?}", w.events, w.down());
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        w.finish();
    }
}

#[test]
fn a_server_whose_user_holds_its_buffers_keeps_no_more_waiting_inline_bytes_than_its_bound() {
    // Issue 19, finding 2: 20,000 inline payloads of 1 KiB from one client
    // were kept (19 MiB) while the server's user held its buffers, and
    // delivered later. Now at most `max_waiting_inline` bytes wait.
    for pol in ALL {
        let mut w = World::new(Role::Server, pol);
        let (max, len) = (w.victim.config().max_waiting_inline, w.victim.config().inline_max);
        assert_eq!(max, 64 << 10, "the default");
        let held = hold_every_buffer(&mut w);
        let fit = u64::from(max / len);
        for msg_id in 1..=fit {
            let f = inline_payload(&mut w, msg_id, &vec![0x3c; len as usize]);
            w.send_within_credit(&f);
        }
        w.run_for(Duration::from_millis(2));
        assert!(w.down().is_none(), "{pol:?}: {max} bytes may wait: {:?}", w.down());
        let f = inline_payload(&mut w, fit + 1, &vec![0x3c; len as usize]);
        w.send_within_credit(&f);
        match goes_down(&mut w) {
            LossReason::PeerMisbehaved(Misbehavior::TooMuchWaitingInline { waiting, len: l, max: m }) => {
                assert_eq!((waiting, l, m), (max, len, max), "{pol:?}")
            }
            other => panic!("{pol:?}: {other:?}"),
        }
        let dropped = w.events.iter().filter(|e| matches!(e, Event::RequestDropped { .. })).count();
        assert_eq!(dropped as u64, fit + 1, "{pol:?}: no request surfaced, each dropped");
        for b in held {
            w.victim.free(b);
        }
        w.finish();
    }
}

#[test]
fn a_client_keeps_one_inline_payload_per_call_while_its_user_holds_its_buffers() {
    // Replies to one call, each with an inline payload, while the client's
    // user holds every buffer: the first waits for a buffer, the others
    // are dropped, so that what a client keeps stays within its calls.
    for pol in ALL {
        let mut w = World::new(Role::Client, pol);
        let held = hold_every_buffer(&mut w);
        let now = w.now();
        let call = w.victim.call(now, b"call", None).unwrap();
        let msg_id = Seen::of(&w.next_frame()).msg_id.unwrap();
        for k in 0..3 * CTRL_SLOTS as u8 {
            let f = mwcap::conn::frame::Frame::Reply {
                msg_id,
                status: 0,
                header: b"h",
                inline: &[k; 200],
                attach: mwcap::conn::frame::Attaches::new(),
            };
            w.send_within_credit(&f.encode().unwrap());
        }
        w.run_for(Duration::from_millis(2));
        assert_eq!(w.victim.stats().inline_received, 1, "{pol:?}: one inline payload kept");
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        for b in held {
            w.victim.free(b);
        }
        let got = w.run_until(Duration::from_millis(20), |w| {
            w.events.iter().any(|e| matches!(e, Event::Reply { call: c, data: Some(b), .. } if *c == call && b[..] == [0; 200][..]))
        });
        assert!(got, "{pol:?}: the first payload delivered: {:?}", w.events);
        w.finish();
    }
}

// ---- keepalive ----

#[test]
fn keepalive_only_a_pong_answers_a_ping() {
    // Issue 19, finding 6: any frame counted as a sign of life, so a peer
    // that kept sending `Credit` frames and never answered a ping stayed up
    // for ever. A ping proves that the peer takes in and answers this
    // side's frames: only its pong answers it.
    use mwcap::conn::frame::Frame;
    use mwcap::conn::Keepalive;
    let ka = Keepalive { interval: Duration::from_millis(20), timeout: Duration::from_millis(50) };
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let mut w = World::with_config(role, pol, |c| c.keepalive = Some(ka));
            // A peer that answers every ping stays up for many intervals.
            let mut answered = 0;
            for _ in 0..20 {
                w.run_for(ka.interval / 2);
                while let Some(f) = w.attacker.frames.pop_front() {
                    if let Ok(Frame::Ping { seq }) = Frame::decode(&f) {
                        w.send_within_credit(&Frame::Pong { seq }.encode().unwrap());
                        answered += 1;
                    }
                }
            }
            assert!(answered >= 5, "{role:?} {pol:?}: {answered} pings");
            assert!(w.down().is_none(), "{role:?} {pol:?}: {:?}", w.down());
            // Then it sends `Credit` frames and never answers again.
            let start = w.now();
            for _ in 0..20 {
                if w.down().is_some() {
                    break;
                }
                w.send_within_credit(&Frame::Credit.encode().unwrap());
                w.run_for(ka.interval / 2);
            }
            match w.down() {
                Some(LossReason::PeerUnresponsive { silent }) => {
                    assert!(*silent >= ka.timeout, "{role:?} {pol:?}: {silent:?}")
                }
                other => panic!("{role:?} {pol:?}: {other:?} after {:?}", w.now() - start),
            }
            assert!(
                w.now() - start <= ka.interval + ka.timeout + ka.interval / 2,
                "{role:?} {pol:?}: down {:?} after it stopped answering",
                w.now() - start
            );
            w.finish();
        }
    }
}

// ---- lying confirm answers (the victim reads under confirm) ----

const LIE_LEN: u32 = 500;

/// The attacker's memory, as offered or exposed to the victim.
fn attacker_region(w: &mut World, fill: u8) -> fb::Region {
    w.attacker.nic.write_mr(w.attacker.mem.id, 0, &[fill; LIE_LEN as usize]).unwrap();
    fb::Region::new(w.attacker.mem.addr, LIE_LEN, w.attacker.mem.rkey)
}

fn confirm_reply(
    msg: fb::MsgId,
    buffer: fb::BufferId,
    generation: fb::Generation,
    verdict: fb::Verdict,
) -> Vec<u8> {
    engine_frame(fb_attach(fb::Message::ConfirmReply { msg, buffer, generation, verdict }))
}

/// The lies told about one READ of (msg, buffer, generation): an `Intact`
/// for another generation, another buffer, another message.
fn lies(msg: fb::MsgId, buffer: fb::BufferId, generation: fb::Generation) -> Vec<Vec<u8>> {
    let intact = fb::Verdict::Intact;
    vec![
        confirm_reply(msg, buffer, fb::Generation::from_raw(generation.raw() + 1), intact),
        confirm_reply(msg, fb::BufferId::from_raw(buffer.raw() ^ 1), generation, intact),
        confirm_reply(fb::MsgId::from_raw(msg.raw() + 50), buffer, generation, intact),
    ]
}

fn reader_confirm_policies(role: Role) -> [Policies; 2] {
    // The victim reads under confirm: the reply on a client, the request on a server.
    [Policy::Mw, Policy::Confirm].map(|o| match role {
        Role::Client => Policies { request: o, reply: Policy::Confirm },
        Role::Server => Policies { request: Policy::Confirm, reply: o },
    })
}

/// The victim reads the attacker's offer (client) or exposure (server) of
/// `region` as (msg, buffer, generation); returns the call or nothing.
fn lure(w: &mut World, region: fb::Region, early_intact: bool) -> (Option<mwcap::conn::CallId>, fb::MsgId) {
    let (buffer, generation) = (fb::BufferId::from_raw(0), fb::Generation::from_raw(5));
    let (call, msg, frame) = match w.role {
        Role::Client => {
            let (call, seen) = w.take_call();
            let msg = seen.fetch.expect("a fetch for the reply");
            let offer = fb::Message::Offer { msg, buffer, generation, region };
            (Some(call), msg, reply_frame(seen.msg_id.unwrap(), &[fb_attach(offer)]))
        }
        Role::Server => {
            let msg = fb::MsgId::from_raw(1);
            let expose = fb::Message::Expose { msg, buffer, generation, region };
            (None, msg, request_frame(1, &[fb_attach(expose)]))
        }
    };
    w.attacker.send(&frame);
    if early_intact {
        // Before the victim's READ can have completed.
        w.attacker.send(&confirm_reply(msg, buffer, generation, fb::Verdict::Intact));
    }
    (call, msg)
}

/// The victim's confirm for `msg`, after its READ.
fn victims_confirm(w: &mut World) -> (fb::MsgId, fb::BufferId, fb::Generation) {
    loop {
        let seen = Seen::of(&w.next_frame());
        if let Some(c) = seen.confirm {
            return c;
        }
    }
}

fn no_payload_delivered(w: &World) {
    for e in &w.events {
        assert!(!matches!(e, Event::Reply { data: Some(_), .. } | Event::Request { .. }), "delivered: {e:?}");
    }
}

#[test]
fn confirm_lying_answers_never_make_the_victim_accept_a_read() {
    for role in [Role::Client, Role::Server] {
        for pol in reader_confirm_policies(role) {
            let mut w = World::new(role, pol);
            let region = attacker_region(&mut w, 0x11);
            let (call, _) = lure(&mut w, region, true);
            let (msg, buffer, generation) = victims_confirm(&mut w);
            for lie in lies(msg, buffer, generation) {
                w.send(&lie);
            }
            w.run_for(Duration::from_millis(2));
            no_payload_delivered(&w);
            // The truth, at last: the buffer was reused.
            w.send(&confirm_reply(msg, buffer, generation, fb::Verdict::Reused));
            w.run_for(CALL_TIMEOUT + LEASE);
            no_payload_delivered(&w);
            assert!(w.down().is_none(), "{role:?} {pol:?}: lies are ignored, not fatal: {:?}", w.down());
            // A client retries the stale read (its fetch goes unanswered)
            // until the call times out; a server drops the request.
            use mwcap::conn::{CallError, PayloadError};
            let withdrawn = CallError::Payload(PayloadError::Confirm(fb::ReadError::Withdrawn));
            let as_wanted = match (call, &w.events[..]) {
                (Some(call), [Event::CallFailed { call: c, error: CallError::TimedOut }]) => *c == call,
                (None, [Event::RequestDropped { req, error }]) => req.raw() == 1 && *error == withdrawn,
                _ => false,
            };
            assert!(as_wanted, "{role:?} {pol:?}: {:?}", w.events);
            assert!(w.victim.stats().stale_reads >= 1 || role == Role::Server);
            w.finish();
        }
    }
}

#[test]
fn confirm_an_intact_after_lies_delivers_exactly_the_bytes_the_nic_read() {
    // "Not reused" when it was: the attacker rewrites its memory after the
    // READ and says Intact. The victim delivers what its READ sampled
    // (the attacker's own bytes), never anything of its own.
    for role in [Role::Client, Role::Server] {
        for pol in reader_confirm_policies(role) {
            let mut w = World::new(role, pol);
            let region = attacker_region(&mut w, 0x11);
            lure(&mut w, region, false);
            let (msg, buffer, generation) = victims_confirm(&mut w);
            attacker_region(&mut w, 0x22);
            for lie in lies(msg, buffer, generation) {
                w.send(&lie);
            }
            w.send(&confirm_reply(msg, buffer, generation, fb::Verdict::Intact));
            let found = w.run_until(Duration::from_millis(20), |w| {
                w.events.iter().any(|e| matches!(e, Event::Reply { .. } | Event::Request { .. }))
            });
            assert!(found, "{role:?} {pol:?}: {:?}", w.events);
            let data = w.events.iter().find_map(|e| match e {
                Event::Reply { data: Some(d), .. } | Event::Request { data: Some(d), .. } => Some(d),
                _ => None,
            });
            let got = data.expect("a payload").to_vec();
            assert_eq!(got, vec![0x11; LIE_LEN as usize], "{role:?} {pol:?}");
            assert!(w.down().is_none());
            w.finish();
        }
    }
}

// ---- hostile grants (the victim reads under mw) ----

#[test]
fn mw_a_grant_of_a_window_that_is_not_bound_fails_the_read_and_the_connection() {
    for role in [Role::Client, Role::Server] {
        for o in [Policy::Mw, Policy::Confirm] {
            let pol = match role {
                Role::Client => Policies { request: o, reply: Policy::Mw },
                Role::Server => Policies { request: Policy::Mw, reply: o },
            };
            let mut w = World::new(role, pol);
            let g = mw::Grant {
                lease: mw::LeaseId::from_raw(1 << 32 | 1),
                addr: w.attacker.mem.addr,
                len: LIE_LEN,
                rkey: 0x0bad_0001,
                time_left: LEASE,
            };
            let call = send_grant(&mut w, g);
            let why = goes_down(&mut w);
            assert!(
                matches!(
                    why,
                    LossReason::Completion { status: WcStatus::RemAccessErr, opcode: WcOpcode::RdmaRead, .. }
                ),
                "{role:?} {pol:?}: {why:?}"
            );
            no_payload_delivered(&w);
            if let Some(call) = call {
                assert!(w
                    .events
                    .iter()
                    .any(|e| matches!(e, Event::CallFailed { call: c, .. } if *c == call)));
            }
            w.finish();
        }
    }
}

#[test]
fn mw_grants_the_victim_cannot_use_are_declined_and_released() {
    for role in [Role::Client, Role::Server] {
        let pol = Policies::both(Policy::Mw);
        let short = Duration::from_millis(5);
        let cases = [
            (
                "longer than a buffer",
                BUFFER_SIZE + 1,
                LEASE,
                mw::DeclineReason::DestinationTooSmall { need: BUFFER_SIZE + 1, have: BUFFER_SIZE },
            ),
            (
                "too little time left",
                LIE_LEN,
                short,
                mw::DeclineReason::LeaseTooShort { time_left: short, margin: Duration::from_millis(10) },
            ),
        ];
        for (name, len, time_left, reason) in cases {
            let mut w = World::new(role, pol);
            let rkey = w.attacker.bind_own(BUFFER_SIZE);
            let lease = mw::LeaseId::from_raw(2 << 32 | 9);
            let g = mw::Grant { lease, addr: w.attacker.mem.addr, len, rkey, time_left };
            let call = send_grant(&mut w, g);
            // The release comes back, nothing was READ.
            let mut released = false;
            for _ in 0..4 {
                let seen = Seen::of(&w.next_frame());
                if seen.release.is_some_and(|r| r.lease == lease) {
                    released = true;
                    break;
                }
            }
            assert!(released, "{role:?} {name}");
            assert_eq!(w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served, 0, "{name}");
            w.run_for(Duration::from_millis(2));
            no_payload_delivered(&w);
            assert!(w.down().is_none(), "{role:?} {name}: {:?}", w.down());
            // The user is told why, with the victim's own figures.
            let declined = mwcap::conn::CallError::Payload(mwcap::conn::PayloadError::Declined(reason));
            let failed = |e: &Event| match e {
                Event::CallFailed { call: c, error } => Some(*c) == call && *error == declined,
                Event::RequestDropped { error, .. } => *error == declined,
                _ => false,
            };
            assert!(w.events.iter().any(failed), "{role:?} {name}: {:?}", w.events);
            w.finish();
        }
    }
}

/// The attacker grants `g`: in a reply to the victim client's call, or in
/// a request to the victim server.
fn send_grant(w: &mut World, g: mw::Grant) -> Option<mwcap::conn::CallId> {
    let a = mw_attach(mw::Message::Grant(g));
    match w.role {
        Role::Client => {
            let (call, seen) = w.take_call();
            w.attacker.send(&reply_frame(seen.msg_id.unwrap(), &[a]));
            Some(call)
        }
        Role::Server => {
            w.attacker.send(&request_frame(1, &[a]));
            None
        }
    }
}

// ---- SEND_WITH_INV ----

fn ping() -> Vec<u8> {
    mwcap::conn::frame::Frame::Ping { seq: 1 }.encode().unwrap()
}

#[test]
fn mw_send_with_inv_of_the_granted_window_is_misbehaviour_and_nothing_is_invalidated_twice() {
    for role in [Role::Server, Role::Client] {
        for pol in owning(role, Policy::Mw) {
            let (mut w, seen) = exposed(role, pol);
            let g = seen.grant.unwrap();
            w.attacker.send_with_inv(&ping(), g.rkey);
            let why = goes_down(&mut w);
            assert_eq!(
                why,
                LossReason::PeerMisbehaved(Misbehavior::SendWithInvalidate { rkey: g.rkey }),
                "{role:?} {pol:?}"
            );
            assert_eq!(owner_stats(&w).peer_invalidations, 1);
            // The window died by the peer's hand: the owner never LOCAL_INVs
            // it (the sim would record a would-crash-rxe hazard), and the
            // buffer comes back at the QP's destroy, after the flush.
            w.run_for(Duration::from_millis(5));
            assert_eq!(owner_stats(&w).invalidations, 0, "{:?}", owner_stats(&w));
            assert!(w.fabric.would_crash_rxe().is_empty());
            w.finish();
        }
    }
}

#[test]
fn send_with_inv_of_a_key_the_victim_never_granted_fails_at_the_nic() {
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let owned = if role == Role::Server { pol.reply } else { pol.request };
            let (w0, seen) = exposed(role, pol);
            let (_, _, rkey) = seen.target();
            drop(w0);
            let mut keys = vec![("the granted key, wrong consumer key", rkey ^ 1)];
            if owned == Policy::Confirm {
                keys = vec![("the region key", rkey)];
            }
            for (name, key) in keys {
                let (mut w, _) = exposed(role, pol);
                let wr = w.attacker.send_with_inv(&ping(), key);
                let why = goes_down(&mut w);
                assert!(
                    matches!(
                        why,
                        LossReason::Completion { status: WcStatus::RemInvReqErr, opcode: WcOpcode::Recv, .. }
                    ),
                    "{role:?} {pol:?} {name}: {why:?}"
                );
                assert!(w.run_until(Duration::from_millis(5), |w| w.attacker.completion(wr).is_some()));
                assert_eq!(w.attacker.completion(wr).unwrap().status, WcStatus::RemInvReqErr);
                w.finish();
            }
        }
    }
}

#[test]
fn mw_send_with_inv_of_a_released_window_would_crash_rxe_and_the_victim_survives_it() {
    // An invalidation of an already invalidated window is what panics the
    // rxe kernel driver. No protocol can stop a peer from sending one
    // (docs/protocol-mw.md); on the sim the victim's connection goes down
    // with the NIC's error and nothing else is touched.
    for role in [Role::Server, Role::Client] {
        let pol = Policies::both(Policy::Mw);
        let (mut w, seen) = exposed(role, pol);
        let g = seen.grant.unwrap();
        w.send(&release(g.lease.raw(), g.rkey));
        assert!(w.run_until(Duration::from_millis(5), |w| w.returned == 1));
        w.attacker.send_with_inv(&ping(), g.rkey);
        let why = goes_down(&mut w);
        assert!(
            matches!(why, LossReason::Completion { status: WcStatus::RemInvReqErr, .. }),
            "{role:?}: {why:?}"
        );
        w.finish_with(|h| {
            assert_eq!(h.len(), 1, "{h:?}");
            assert_eq!(h[0].kind, mwcap::sim::HazardKind::WouldCrashRxe, "{h:?}");
        });
    }
}

// ---- a peer that stops posting receives, or never reads ----

/// The victim exposes a payload to the attacker: a reply to request
/// `msg_id` (victim server) or a call (victim client). Returns nothing the
/// attacker sees: its receives may be gone.
fn expose_blind(w: &mut World, msg_id: u64) {
    match w.role {
        Role::Server => {
            let attach = match w.policies.reply {
                Policy::Confirm => {
                    vec![fb_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(msg_id), attempt: 1 })]
                }
                Policy::Mw => vec![],
            };
            w.send(&request_frame(msg_id, &attach));
            let (req, _) = w.take_request();
            w.reply_granted(req);
        }
        Role::Client => {
            w.call_granted();
        }
    }
}

#[test]
fn a_peer_that_stops_posting_receives_is_declared_gone_and_every_buffer_returns() {
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            // No receive ever, or one and then none.
            for posted in [0, 1] {
                let mut w = World::with_recvs(role, pol, posted);
                w.attacker.repost = false;
                for msg_id in 1..=posted as u64 + 1 {
                    expose_blind(&mut w, msg_id);
                }
                assert_eq!(w.victim.busy_buffers(), posted + 1);
                let start = w.now();
                let why = goes_down(&mut w);
                assert!(
                    matches!(
                        why,
                        LossReason::Completion {
                            status: WcStatus::RnrRetryExcErr,
                            opcode: WcOpcode::Send,
                            ..
                        }
                    ),
                    "{role:?} {pol:?}: {why:?}"
                );
                assert!(w.now() - start < LEASE, "the RNR budget ends it before the lease");
                assert!(
                    w.run_until(Duration::from_millis(5), |w| w.victim.busy_buffers() == 0),
                    "{role:?} {pol:?}"
                );
                assert_eq!(w.returned, posted + 1, "back at the destroy after the flush, before any close");
                w.finish();
            }
        }
    }
}

#[test]
fn a_ping_flood_from_a_peer_that_posts_no_receives_gets_at_most_its_credit_then_rnr() {
    // Every ping wants a pong; a peer that posts no receive for them gets
    // no more pongs than the credit every peer starts with (flow control),
    // and those end on RNR: the victim gives up on the peer, with the
    // reason that says so, rather than queueing without bound.
    use mwcap::conn::frame::{Frame, INITIAL_CREDITS};
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let mut w = World::with_recvs(role, pol, 0);
            // Within the credit every peer starts with: no frame past it.
            for seq in 0..u64::from(INITIAL_CREDITS) {
                w.attacker.send_frame(&Frame::Ping { seq });
            }
            match goes_down(&mut w) {
                LossReason::Completion { status: WcStatus::RnrRetryExcErr, .. } => {}
                other => panic!("{role:?} {pol:?}: {other:?}"),
            }
            let sent = w.victim.stats().frames_sent;
            // The pongs leave one credit for a grant, which may spend it.
            assert!(sent <= u64::from(INITIAL_CREDITS), "{role:?} {pol:?}: {sent} frames past the credit");
            w.finish();
        }
    }
}

#[test]
fn a_peer_that_withholds_credit_gets_its_credit_worth_then_loses_the_connection() {
    // Receives posted, but no credit ever granted: the victim answers as
    // far as the initial credit goes and keeps the rest waiting (no more
    // than it granted the peer credit for); the first frame past that
    // credit names the peer's fault.
    use mwcap::conn::frame::{Frame, INITIAL_CREDITS};
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let mut w = World::new(role, pol);
            w.attacker.auto_credit = false;
            for seq in 0..u64::from(CTRL_SLOTS) {
                w.send(&Frame::Ping { seq }.encode().unwrap());
            }
            w.run_for(Duration::from_millis(2));
            let pongs = w.attacker.frames.iter().filter(|f| Seen::of(f).kind == "pong").count();
            assert_eq!(pongs as u32, INITIAL_CREDITS - 1, "{role:?} {pol:?}: one credit kept for a grant");
            assert!(w.down().is_none(), "{role:?} {pol:?}: waiting for credit is not an error");
            // Granting credit lets the rest go.
            w.attacker.auto_credit = true;
            w.attacker.send_frame(&Frame::Credit);
            w.run_for(Duration::from_millis(2));
            let pongs = w.attacker.frames.iter().filter(|f| Seen::of(f).kind == "pong").count();
            assert_eq!(pongs as u32, CTRL_SLOTS, "{role:?} {pol:?}: every ping answered once credit came");
            // Withheld again, every ping within the victim's credit: the
            // answers wait (as many as the victim granted, no more), and
            // waiting is still no error.
            w.attacker.auto_credit = false;
            let waits = w.victim.stats().credit_waits;
            let mut seq = 100;
            while w.attacker.sends < w.attacker.credit_granted {
                w.attacker.send_frame(&Frame::Ping { seq });
                seq += 1;
                w.run_for(Duration::from_micros(200));
            }
            w.run_for(Duration::from_millis(2));
            assert!(w.down().is_none(), "{role:?} {pol:?}: {:?}", w.down());
            assert!(w.victim.stats().credit_waits > waits, "{role:?} {pol:?}: answers wait for credit");
            // One ping past the credit ends it.
            w.attacker.send_frame(&Frame::Ping { seq });
            assert_cut_off_at_its_credit(&mut w, &format!("{role:?} {pol:?}"));
            w.finish();
        }
    }
}

#[test]
fn a_peer_that_never_reads_nor_answers_gets_its_exposure_ended_by_the_owner() {
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let owned = if role == Role::Server { pol.reply } else { pol.request };
            let (mut w, seen) = exposed(role, pol);
            let start = w.now();
            assert!(w.run_until(CALL_TIMEOUT * 2, |w| w.returned == 1), "{role:?} {pol:?}");
            let held = w.now() - start;
            assert!(held >= LEASE - Duration::from_millis(1), "{role:?} {pol:?}: back after {held:?}");
            assert!(w.down().is_none(), "{role:?} {pol:?}: {:?}", w.down());
            if role == Role::Client {
                w.run_for(CALL_TIMEOUT);
                assert!(
                    w.events.iter().any(|e| matches!(
                        e,
                        Event::CallFailed { error: mwcap::conn::CallError::TimedOut, .. }
                    )),
                    "{pol:?}: {:?}",
                    w.events
                );
            }
            match owned {
                Policy::Mw => {
                    w.assert_binds_invalidated_once();
                    assert_eq!(owner_stats(&w).expired, 1);
                }
                Policy::Confirm => {
                    // A late READ samples whatever the buffer holds now (the
                    // secret); its confirm is answered Reused, never Intact.
                    let (msg, buffer, generation, _) = seen.exposed.unwrap();
                    let v = w.verdict(fb::Message::Confirm { msg, buffer, generation });
                    assert_ne!(v, fb::Verdict::Intact, "{role:?} {pol:?}");
                }
            }
            w.finish();
        }
    }
}

#[test]
fn mw_unsolicited_grants_are_released_unread() {
    // Replies with grants for calls that were never made: the client reads
    // nothing, and releases every one.
    let mut w = World::client(Policies::both(Policy::Mw));
    let rkey = w.attacker.bind_own(BUFFER_SIZE);
    let n = 3 * u64::from(BUFFERS);
    for i in 0..n {
        let lease = mw::LeaseId::from_raw(1 << 32 | (i + 1));
        let g = mw::Grant { lease, addr: w.attacker.mem.addr, len: LIE_LEN, rkey, time_left: LEASE };
        w.attacker.send(&reply_frame(100 + i, &[mw_attach(mw::Message::Grant(g))]));
    }
    w.run_for(Duration::from_millis(5));
    assert_eq!(w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served, 0);
    let released = w.attacker.frames.iter().filter(|f| Seen::of(f).release.is_some()).count();
    assert_eq!(released as u64, n);
    assert!(w.down().is_none() && w.events.is_empty(), "{:?} {:?}", w.down(), w.events);
    assert_eq!(w.victim.busy_buffers(), 0);
    w.finish();
}

// ---- protocol violations, through the NIC ----

/// A request (to a victim server) or a reply to the victim client's call
/// (made here) carrying `inline` as its payload.
fn inline_payload(w: &mut World, msg_id: u64, inline: &[u8]) -> Vec<u8> {
    use mwcap::conn::frame::{Attaches, Frame};
    let attach = Attaches::new();
    match w.role {
        Role::Server => {
            Frame::Request { msg_id, trace: None, header: b"h", inline, attach }.encode().unwrap()
        }
        Role::Client => {
            let now = w.now();
            w.victim.call(now, b"call", None).unwrap();
            let seen = Seen::of(&w.next_frame());
            let msg_id = seen.msg_id.expect("the victim's request");
            Frame::Reply { msg_id, status: 0, header: b"h", inline, attach }.encode().unwrap()
        }
    }
}

#[test]
fn an_inline_payload_above_the_victims_inline_max_ends_the_connection() {
    // Issue 19, finding 2: inline payloads up to 1024 bytes (MAX_INLINE)
    // were taken whatever the receiver's own inline_max (256 here). One of
    // exactly inline_max is delivered; one byte more ends the connection.
    let max = hostile::config().inline_max as usize;
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let mut w = World::new(role, pol);
            let fits = inline_payload(&mut w, 1, &vec![0x5a; max]);
            w.send(&fits);
            let got = w.run_until(Duration::from_millis(5), |w| {
                w.events.iter().any(|e| match e {
                    Event::Request { data: Some(b), .. } | Event::Reply { data: Some(b), .. } => {
                        b[..] == vec![0x5a; max][..]
                    }
                    _ => false,
                })
            });
            assert!(got, "{role:?} {pol:?}: {:?} {:?}", w.events, w.down());
            let over = inline_payload(&mut w, 2, &vec![0x5b; max + 1]);
            w.send(&over);
            match goes_down(&mut w) {
                LossReason::PeerMisbehaved(Misbehavior::InlineTooLong { len, max: m, .. }) => {
                    assert_eq!((len as usize, m as usize), (max + 1, max), "{role:?} {pol:?}")
                }
                other => panic!("{role:?} {pol:?}: {other:?}"),
            }
            w.finish();
        }
    }
}

#[test]
fn protocol_violations_end_the_connection_with_their_reason() {
    use mwcap::conn::frame::{Attach, EngineTag};
    let grant = mw_attach(mw::Message::Grant(mw::Grant {
        lease: mw::LeaseId::from_raw(1 << 32 | 1),
        addr: 0x1000,
        len: 64,
        rkey: 0x100,
        time_left: LEASE,
    }));
    let fetch = |m| fb_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(m), attempt: 1 });
    let expose = |m| {
        fb_attach(fb::Message::Expose {
            msg: fb::MsgId::from_raw(m),
            buffer: fb::BufferId::from_raw(0),
            generation: fb::Generation::from_raw(1),
            region: fb::Region::new(0x1000, 64, 0x100),
        })
    };
    let mut bad_lease = grant.bytes().to_vec();
    bad_lease.truncate(5);
    let bad_lease = Attach::new(EngineTag::Mw, &bad_lease).unwrap();
    /// What is sent, to whom, and the reason expected.
    type Case = (&'static str, Role, Policies, Vec<Vec<u8>>, fn(&Misbehavior) -> bool);
    let cases: Vec<Case> = vec![
        (
            "a replayed request id",
            Role::Server,
            Policies::both(Policy::Mw),
            vec![request_frame(3, &[]), request_frame(3, &[])],
            |m| *m == Misbehavior::RequestIdReused { msg: 3, last: 3 },
        ),
        (
            "a reply sent to a server",
            Role::Server,
            Policies::both(Policy::Mw),
            vec![reply_frame(1, &[])],
            |m| matches!(m, Misbehavior::WrongFrame { role: Role::Server, got: "reply" }),
        ),
        (
            "a request sent to a client",
            Role::Client,
            Policies::both(Policy::Mw),
            vec![request_frame(1, &[])],
            |m| matches!(m, Misbehavior::WrongFrame { role: Role::Client, got: "request" }),
        ),
        (
            "two payloads in one request",
            Role::Server,
            Policies::both(Policy::Mw),
            vec![request_frame(1, &[grant, grant])],
            |m| matches!(m, Misbehavior::TooManyPayloads { count: 2, .. }),
        ),
        (
            "a grant outside a message",
            Role::Server,
            Policies::both(Policy::Mw),
            vec![engine_frame(grant)],
            |m| *m == Misbehavior::GrantOutsideMessage,
        ),
        (
            "a confirm message under mw",
            Role::Server,
            Policies::both(Policy::Mw),
            vec![request_frame(1, &[fetch(1)])],
            |m| matches!(m, Misbehavior::WrongPolicy { what: "confirm message" }),
        ),
        (
            "a confirm exposure on a request whose payloads go under mw",
            Role::Server,
            Policies { request: Policy::Mw, reply: Policy::Confirm },
            vec![request_frame(1, &[expose(1)])],
            |m| {
                matches!(
                    m,
                    Misbehavior::WrongPolicy { what: "confirm exposure of a payload that goes under mw" }
                )
            },
        ),
        (
            "a grant under confirm",
            Role::Server,
            Policies::both(Policy::Confirm),
            vec![request_frame(1, &[grant])],
            |m| matches!(m, Misbehavior::WrongPolicy { what: "window grant" }),
        ),
        (
            "a truncated lease message",
            Role::Server,
            Policies::both(Policy::Mw),
            vec![engine_frame(bad_lease)],
            |m| matches!(m, Misbehavior::MalformedLeaseMessage(_)),
        ),
    ];
    for (name, role, pol, frames, want) in cases {
        let mut w = World::new(role, pol);
        for f in &frames {
            w.attacker.send(f);
        }
        match goes_down(&mut w) {
            LossReason::PeerMisbehaved(m) if want(&m) => {}
            other => panic!("{name}: {other:?}"),
        }
        w.finish();
    }
}

#[test]
fn mw_send_with_inv_cannot_reach_the_other_connections_windows() {
    // On a spec device a type-2 window is invalidated only through its own
    // queue pair: a live window of the healthy connection (another QP and
    // PD of the victim's device) cannot be invalidated through the
    // attacker's connection. (rxe allows it: tests/hub.rs.)
    use mwcap::backend::MwId;
    use mwcap::sim::WindowState;
    for role in [Role::Server, Role::Client] {
        let mut w = World::new(role, Policies::both(Policy::Mw));
        let dev = w.victim_device();
        // The device's windows: the victim's (one per buffer and per user
        // range exposure), then the healthy side's; find a bound one of the
        // healthy side's.
        let windows = 4 * (BUFFERS + 16);
        let theirs = |w: &World| {
            (0..windows).find_map(|i| match w.fabric.window(dev, MwId::from_raw(i)) {
                Some(WindowState::Bound { rkey, qp, .. })
                    if qp != w.victim.nic().qp_addr(w.victim.local().id).unwrap() =>
                {
                    Some(rkey)
                }
                _ => None,
            })
        };
        assert!(w.run_until(Duration::from_millis(50), |w| theirs(w).is_some()), "{role:?}");
        let rkey = theirs(&w).unwrap();
        w.attacker.send_with_inv(&ping(), rkey);
        let why = goes_down(&mut w);
        assert!(
            matches!(why, LossReason::Completion { status: WcStatus::RemInvReqErr, .. }),
            "{role:?}: {why:?}"
        );
        assert!(
            (0..windows).any(|i| matches!(
                w.fabric.window(dev, MwId::from_raw(i)),
                Some(WindowState::Bound { rkey: k, .. }) if k == rkey
            )),
            "the healthy window is still bound"
        );
        let ep = if role == Role::Server { &w.healthy.server } else { &w.healthy.client };
        assert_eq!(ep.stats().lease_owner.unwrap().peer_invalidations, 0);
        w.finish();
    }
}

// ---- exposures a confirm server cannot take ----

fn expose_request(w: &mut World, msg_id: u64, fm: u64, len: u32) {
    let region = fb::Region::new(w.attacker.mem.addr, len, w.attacker.mem.rkey);
    let m = fb::Message::Expose {
        msg: fb::MsgId::from_raw(fm),
        buffer: fb::BufferId::from_raw(0),
        generation: fb::Generation::from_raw(1),
        region,
    };
    w.send(&request_frame(msg_id, &[fb_attach(m)]));
}

fn dropped_as_refused(w: &World, req: u64) -> bool {
    use mwcap::conn::{CallError, PayloadError};
    let refused = CallError::Payload(PayloadError::Confirm(fb::ReadError::Refused));
    w.events
        .iter()
        .any(|e| matches!(e, Event::RequestDropped { req: r, error } if r.raw() == req && *error == refused))
}

/// The requests that surfaced, in order.
fn requests(w: &World) -> Vec<mwcap::conn::RequestId> {
    w.events
        .iter()
        .filter_map(|e| match e {
            Event::Request { req, .. } => Some(*req),
            _ => None,
        })
        .collect()
}

/// The payload request `req` surfaced with, if it did.
fn request_payload(w: &World, req: u64) -> Option<Vec<u8>> {
    w.events.iter().find_map(|e| match e {
        Event::Request { req: r, data: Some(d), .. } if r.raw() == req => Some(d.to_vec()),
        _ => None,
    })
}

#[test]
fn confirm_a_request_whose_exposure_is_refused_is_dropped_not_kept_forever() {
    // Longer than a buffer: the engine refuses it (and says so to the
    // peer). The request must not wait for a payload that never comes.
    for o in [Policy::Mw, Policy::Confirm] {
        let mut w = World::server(Policies { request: Policy::Confirm, reply: o });
        for i in 1..=20 {
            expose_request(&mut w, i, i, BUFFER_SIZE + 1);
        }
        w.run_for(Duration::from_millis(2));
        for i in 1..=20 {
            assert!(dropped_as_refused(&w, i), "{o:?} request {i}: {:?}", w.events);
        }
        assert_eq!(w.victim.tracked_messages(), 0, "nothing kept for them");
        assert!(w.down().is_none());
        w.finish();
    }
}

#[test]
fn confirm_a_dropped_requests_fetch_is_forgotten_and_its_retry_brings_nothing_back() {
    // Each request exposes a payload the engine refuses (longer than a
    // buffer) and asks for its reply's payload: it is dropped unread.
    // Nothing may stay kept for its fetch (before, every such request left
    // one mapping for good), and a "retry" of that fetch must not bring
    // the request back as a `ReplyAgain`.
    let mut w = World::server(Policies::both(Policy::Confirm));
    for i in 1..=20u64 {
        let region = fb::Region::new(w.attacker.mem.addr, BUFFER_SIZE + 1, w.attacker.mem.rkey);
        let expose = fb::Message::Expose {
            msg: fb::MsgId::from_raw(i),
            buffer: fb::BufferId::from_raw(0),
            generation: fb::Generation::from_raw(1),
            region,
        };
        let fetch = fb::Message::Fetch { msg: fb::MsgId::from_raw(100 + i), attempt: 1 };
        w.send(&request_frame(i, &[fb_attach(expose), fb_attach(fetch)]));
    }
    w.run_for(Duration::from_millis(2));
    for i in 1..=20 {
        assert!(dropped_as_refused(&w, i), "request {i}: {:?}", w.events);
    }
    assert_eq!(w.victim.tracked_messages(), 0, "nothing kept for the dropped requests' fetches");
    w.events.clear();
    for i in 1..=20u64 {
        let retry = fb::Message::Fetch { msg: fb::MsgId::from_raw(100 + i), attempt: 2 };
        w.send(&engine_frame(fb_attach(retry)));
    }
    w.run_for(Duration::from_millis(2));
    assert!(
        !w.events.iter().any(|e| matches!(e, Event::ReplyAgain { .. } | Event::Request { .. })),
        "a dropped request came back: {:?}",
        w.events
    );
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn confirm_a_replayed_fetch_retry_brings_the_request_back_once() {
    // A client whose read was stale asks again (attempt 2), and the request
    // comes again once; a replay of that same attempt, after the second
    // reply, must not bring it back again (before, every replay made the
    // application handle the request again, and hold another buffer).
    let mut w = World::server(Policies::both(Policy::Confirm));
    let fetch = |attempt| fb_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(100), attempt });
    w.send(&request_frame(1, &[fetch(1)]));
    w.run_for(Duration::from_millis(1));
    let (req, _) = w.take_request();
    w.reply_granted(req);
    w.run_for(Duration::from_millis(1));
    let again = |w: &World| w.events.iter().filter(|e| matches!(e, Event::ReplyAgain { .. })).count();
    for round in 0..3 {
        w.send(&engine_frame(fetch(2)));
        w.run_for(Duration::from_millis(1));
        assert_eq!(again(&w), 1, "round {round}: the request comes again once: {:?}", w.events);
        if round == 0 {
            w.reply_granted(req);
            w.run_for(Duration::from_millis(1));
        }
    }
    // A later attempt is a retry of the second reply: it comes again.
    w.send(&engine_frame(fetch(3)));
    w.run_for(Duration::from_millis(1));
    assert_eq!(again(&w), 2, "{:?}", w.events);
    assert!(w.down().is_none());
}

#[test]
fn confirm_a_fetch_on_a_request_whose_reply_goes_under_mw_is_not_kept() {
    // Replies go under mw, requests under confirm: a fetch asks for
    // nothing the server will offer. Before, each was kept (with its
    // request, after the reply) for good: one leak per reply.
    let mut w = World::server(Policies { request: Policy::Confirm, reply: Policy::Mw });
    for i in 1..=20u64 {
        let fetch = fb::Message::Fetch { msg: fb::MsgId::from_raw(100 + i), attempt: 1 };
        w.send(&request_frame(i, &[fb_attach(fetch)]));
    }
    w.run_for(Duration::from_millis(2));
    let reqs = requests(&w);
    assert_eq!(reqs.len(), 20, "{:?}", w.events);
    assert_eq!(w.victim.tracked_messages(), 0, "no fetch recorded");
    for req in reqs {
        let now = w.now();
        w.victim.reply(now, req, 0, b"done", None).expect("replies");
        w.run_for(Duration::from_micros(200));
    }
    w.run_for(Duration::from_millis(2));
    assert_eq!(w.victim.tracked_messages(), 0, "nothing kept after the replies");
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn confirm_a_reused_exposure_id_fails_only_the_request_that_reused_it() {
    // Request 2 exposes under the engine message id of request 1, whose
    // payload is still being confirmed: request 2 is dropped, request 1
    // gets its own payload.
    let mut w = World::server(Policies::both(Policy::Confirm));
    attacker_region(&mut w, 0x11);
    expose_request(&mut w, 1, 1, LIE_LEN);
    let (m, b, g) = victims_confirm(&mut w);
    expose_request(&mut w, 2, 1, LIE_LEN);
    w.run_for(Duration::from_millis(1));
    assert!(dropped_as_refused(&w, 2), "{:?}", w.events);
    w.send(&confirm_reply(m, b, g, fb::Verdict::Intact));
    w.run_for(Duration::from_millis(1));
    assert_eq!(request_payload(&w, 1), Some(vec![0x11; LIE_LEN as usize]), "{:?}", w.events);
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn confirm_a_fetch_reusing_an_exposure_id_leaves_the_exposing_request_whole() {
    // Request 2 asks for its reply's payload under the engine message id
    // of request 1's exposure, still being confirmed: the fetch is not
    // recorded, and request 1 still gets its own payload.
    let mut w = World::server(Policies::both(Policy::Confirm));
    attacker_region(&mut w, 0x11);
    expose_request(&mut w, 1, 1, LIE_LEN);
    let (m, b, g) = victims_confirm(&mut w);
    let fetch = fb::Message::Fetch { msg: fb::MsgId::from_raw(1), attempt: 1 };
    w.send(&request_frame(2, &[fb_attach(fetch)]));
    w.send(&confirm_reply(m, b, g, fb::Verdict::Intact));
    w.run_for(Duration::from_millis(1));
    assert_eq!(request_payload(&w, 1), Some(vec![0x11; LIE_LEN as usize]), "{:?}", w.events);
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn confirm_fetches_a_reply_carries_to_a_client_are_not_kept() {
    // Only a client fetches (a reply payload, with its request): a
    // server's reply that carries fetches, to whatever call, leaves
    // nothing behind.
    let mut w = World::client(Policies::both(Policy::Confirm));
    for i in 0..200u64 {
        let fetches: Vec<_> = (0..4)
            .map(|k| fb_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(1000 + 4 * i + k), attempt: 1 }))
            .collect();
        w.send_within_credit(&reply_frame(1_000_000 + i, &fetches));
    }
    w.run_for(Duration::from_millis(10));
    assert_eq!(w.victim.tracked_messages(), 0);
    assert!(w.down().is_none());
    w.finish();
}

#[test]
fn confirm_a_request_carrying_two_fetches_keeps_only_its_first() {
    // One fetch per request: a second, under a fresh id, would be
    // recorded and never removed (the reply ends only the request's own).
    let mut w = World::server(Policies::both(Policy::Confirm));
    for i in 1..=50u64 {
        let fetches: Vec<_> = (0..3)
            .map(|k| fb_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(10 * i + k), attempt: 1 }))
            .collect();
        w.send_within_credit(&request_frame(i, &fetches));
    }
    w.run_for(Duration::from_millis(2));
    let reqs = requests(&w);
    assert_eq!(reqs.len(), 50, "{:?}", w.events);
    assert!(w.victim.tracked_messages() <= 50, "tracked {}", w.victim.tracked_messages());
    // Each reply ends its request's one fetch: nothing is left.
    for req in reqs {
        let now = w.now();
        w.victim.reply(now, req, 0, b"", None).expect("replies");
        w.run_for(Duration::from_micros(200));
    }
    w.run_for(Duration::from_millis(10));
    assert_eq!(w.victim.tracked_messages(), 0);
    assert!(w.down().is_none());
    w.finish();
}

// ---- odd regions ----

#[test]
fn confirm_a_zero_length_exposure_is_delivered_empty() {
    // Only a hostile peer sends one (the user API refuses empty payloads).
    for role in [Role::Client, Role::Server] {
        let mut w = World::new(role, Policies::both(Policy::Confirm));
        let region = fb::Region::new(w.attacker.mem.addr, 0, w.attacker.mem.rkey);
        lure(&mut w, region, false);
        let (m, b, g) = victims_confirm(&mut w);
        w.send(&confirm_reply(m, b, g, fb::Verdict::Intact));
        w.run_for(Duration::from_millis(1));
        let len = w.events.iter().find_map(|e| match e {
            Event::Reply { data: Some(d), .. } | Event::Request { data: Some(d), .. } => Some(d.len()),
            _ => None,
        });
        assert_eq!(len, Some(0), "{role:?}: {:?}", w.events);
        assert!(w.down().is_none());
        w.finish();
    }
}

#[test]
fn a_grant_reusing_a_live_lease_id_ends_the_connection() {
    // The reader finds a lease's message by the lease id the owner chose:
    // a second grant under a live id would take the first's bytes and
    // strand the first. The connection goes down at it, and neither
    // message gets the other's payload.
    for role in [Role::Server, Role::Client] {
        let mut w = World::new(role, Policies::both(Policy::Mw));
        let rkey = w.attacker.bind_own(BUFFER_SIZE);
        let lease = mw::LeaseId::from_raw(7 << 32 | 1);
        let addr = w.attacker.mem.addr;
        let grant = |offset: u64, len: u32| {
            mw_attach(mw::Message::Grant(mw::Grant {
                lease,
                addr: addr + offset,
                len,
                rkey,
                time_left: LEASE,
            }))
        };
        match role {
            Role::Server => {
                w.send(&request_frame(1, &[grant(0, 100)]));
                w.send(&request_frame(2, &[grant(1000, 200)]));
            }
            Role::Client => {
                let (_, first) = w.take_call();
                let (_, second) = w.take_call();
                w.send(&reply_frame(first.msg_id.unwrap(), &[grant(0, 100)]));
                w.send(&reply_frame(second.msg_id.unwrap(), &[grant(1000, 200)]));
            }
        }
        let why = goes_down(&mut w);
        assert_eq!(
            why,
            LossReason::PeerMisbehaved(Misbehavior::LeaseIdReused { lease: lease.raw() }),
            "{role:?}"
        );
        w.run_for(Duration::from_millis(5));
        for e in &w.events {
            if let Event::Request { data: Some(d), .. } | Event::Reply { data: Some(d), .. } = e {
                assert_eq!(d.len(), 100, "{role:?}: only the first grant's payload can surface: {e:?}");
            }
        }
        w.finish();
    }
}

#[test]
fn a_chunked_read_at_the_top_of_the_address_space_fails_cleanly() {
    // As below, with a payload longer than `read_chunk`: the chunks'
    // addresses run past the top (no overflow panic), and the NIC fails
    // the READ.
    for role in [Role::Client, Role::Server] {
        let mut w = World::with_config(role, Policies::both(Policy::Mw), |c| c.read_chunk = 64);
        let g = mw::Grant {
            lease: mw::LeaseId::from_raw(1 << 32 | 1),
            addr: u64::MAX - 4,
            len: 100,
            rkey: 0x1234,
            time_left: LEASE,
        };
        send_grant(&mut w, g);
        let why = goes_down(&mut w);
        assert!(
            matches!(why, LossReason::Completion { status: WcStatus::RemAccessErr, .. }),
            "{role:?}: {why:?}"
        );
        w.finish();
    }
}

#[test]
fn addresses_at_the_top_of_the_address_space_fail_cleanly() {
    let top = u64::MAX - 4;
    // The attacker READs there with a valid key.
    for pol in [Policies::both(Policy::Mw), Policies::both(Policy::Confirm)] {
        let (mut w, seen) = exposed(Role::Server, pol);
        let (_, _, rkey) = seen.target();
        assert_eq!(w.read(top, rkey, 16).0, WcStatus::RemAccessErr, "{pol:?}");
        assert!(flushed(Some(&goes_down(&mut w))));
        w.finish();
    }
    // The attacker makes the victim READ there.
    for role in [Role::Client, Role::Server] {
        let mut w = World::new(role, Policies::both(Policy::Mw));
        let g = mw::Grant {
            lease: mw::LeaseId::from_raw(1 << 32 | 1),
            addr: top,
            len: 100,
            rkey: 0x1234,
            time_left: LEASE,
        };
        send_grant(&mut w, g);
        let why = goes_down(&mut w);
        assert!(
            matches!(
                why,
                LossReason::Completion { status: WcStatus::RemAccessErr, opcode: WcOpcode::RdmaRead, .. }
            ),
            "{role:?}: {why:?}"
        );
        no_payload_delivered(&w);
        w.finish();
    }
}

#[test]
fn a_request_the_server_does_not_read_fails_its_call_at_once() {
    use mwcap::conn::{CallError, PayloadError};
    // A server that does not read a request's payload drops the request:
    // under mw it declines the grant (too little time left, a destination
    // too small) with a release marked unread; under confirm it refuses
    // the exposure (too long, too many reads outstanding, or its READ and
    // confirm past its confirm timeout). Before, the client's buffer came
    // back but its call waited for its call timeout, for a reply that
    // could not come.
    for policy in [Policy::Mw, Policy::Confirm] {
        let mut w = World::client(Policies::both(policy));
        let (call, seen) = w.take_call();
        let (start, returned) = (w.now(), w.returned);
        match policy {
            Policy::Mw => {
                let g = seen.grant.expect("the request's payload is granted");
                let unread = mw::Release { lease: g.lease, rkey: g.rkey, unread: true };
                w.send(&engine_frame(mw_attach(mw::Message::Release(unread))));
            }
            Policy::Confirm => {
                let (msg, ..) = seen.exposed.expect("the request's payload is exposed");
                w.send(&engine_frame(fb_attach(fb::Message::Refuse { msg })));
            }
        }
        let failed = |w: &mut World| w.events.iter().any(|e| matches!(e, Event::CallFailed { .. }));
        assert!(w.run_until(CALL_TIMEOUT * 2, failed), "{policy:?}: {:?}", w.events);
        assert!(w.now() - start < CALL_TIMEOUT / 4, "{policy:?}: failed at once, not at the call timeout");
        let error = CallError::Payload(PayloadError::Unread);
        assert!(w.events.contains(&Event::CallFailed { call, error }), "{policy:?}: {:?}", w.events);
        w.run_for(Duration::from_millis(1));
        assert_eq!(w.returned, returned + 1, "{policy:?}: the buffer came back");
        assert!(w.down().is_none());
        w.finish();
    }
}

#[test]
fn mw_a_release_after_a_read_leaves_the_call_waiting_for_its_reply() {
    // Only a release marked unread fails the call: an ordinary one is the
    // server saying it read the payload, and the reply is still to come.
    let mut w = World::client(Policies::both(Policy::Mw));
    let (call, seen) = w.take_call();
    let g = seen.grant.expect("the request's payload is granted");
    let read = mw::Release { lease: g.lease, rkey: g.rkey, unread: false };
    let returned = w.returned;
    w.send(&engine_frame(mw_attach(mw::Message::Release(read))));
    w.run_for(CALL_TIMEOUT / 4);
    assert_eq!(w.returned, returned + 1, "the buffer came back");
    assert!(w.events.iter().all(|e| !matches!(e, Event::CallFailed { .. })), "{:?}", w.events);
    w.send(&reply_frame(seen.msg_id.unwrap(), &[]));
    w.run_for(Duration::from_millis(1));
    assert!(
        w.events.iter().any(|e| matches!(e, Event::Reply { call: c, .. } if *c == call)),
        "the reply ends the call: {:?}",
        w.events
    );
    w.finish();
}

#[test]
fn confirm_offers_the_client_cannot_take_fail_the_call() {
    use mwcap::conn::{CallError, PayloadError};
    // Longer than a buffer: refused at once. For a fetch never made:
    // ignored, and the call times out.
    for (name, len, other_fetch) in [("too long", BUFFER_SIZE + 1, false), ("unknown fetch", LIE_LEN, true)] {
        let mut w = World::client(Policies::both(Policy::Confirm));
        let (call, seen) = w.take_call();
        let fetch = seen.fetch.unwrap();
        let msg = if other_fetch { fb::MsgId::from_raw(fetch.raw() + 40) } else { fetch };
        let region = fb::Region::new(w.attacker.mem.addr, len, w.attacker.mem.rkey);
        let (buffer, generation) = (fb::BufferId::from_raw(0), fb::Generation::from_raw(1));
        let offer = fb::Message::Offer { msg, buffer, generation, region };
        w.send(&reply_frame(seen.msg_id.unwrap(), &[fb_attach(offer)]));
        let start = w.now();
        assert!(w.run_until(CALL_TIMEOUT * 2, |w| !w.events.is_empty()), "{name}");
        let want = if other_fetch {
            assert!(w.now() - start >= CALL_TIMEOUT - Duration::from_millis(1), "{name}");
            CallError::TimedOut
        } else {
            let too_long = fb::ReadError::TooLong { offered: BUFFER_SIZE + 1, limit: BUFFER_SIZE };
            CallError::Payload(PayloadError::Confirm(too_long))
        };
        assert_eq!(w.events, [Event::CallFailed { call, error: want }], "{name}");
        assert_eq!(
            w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served,
            0,
            "{name}: nothing read"
        );
        assert!(w.down().is_none());
        w.finish();
    }
}

#[test]
fn a_flood_of_requests_within_credit_is_refused_past_max_requests_and_keeps_nothing() {
    // A client keeping to its credit, but never waiting for answers: before
    // `Config::max_requests`, each request without a payload was kept (and
    // handed to the user) as it came, credit coming back as each frame was
    // taken in, so a server whose user answers slowly kept them without
    // bound. Now the victim keeps 16, answers the rest at once with a busy
    // refusal, and stays up.
    use mwcap::conn::frame::Frame;
    const LIMIT: u32 = 16;
    const SENT: u64 = 600;
    for pol in ALL {
        let mut w = World::with_config(Role::Server, pol, |c| c.max_requests = LIMIT);
        for msg_id in 1..=SENT {
            let has =
                w.run_until(Duration::from_millis(50), |w| w.attacker.sends < w.attacker.credit_granted);
            assert!(has, "{pol:?}: no credit at request {msg_id}; down: {:?}", w.victim.is_down());
            // Every other one past the limit carries an inline payload
            // (which would wait for a buffer, were it kept).
            let inline: &[u8] =
                if msg_id > u64::from(LIMIT) && msg_id % 2 == 0 { b"inline payload" } else { b"" };
            w.attacker.send_frame(&Frame::Request {
                msg_id,
                trace: None,
                header: b"h",
                inline,
                attach: Default::default(),
            });
        }
        w.run_for(Duration::from_millis(5));
        assert!(w.victim.is_down().is_none(), "{pol:?}: {:?}", w.victim.is_down());
        let s = w.victim.stats();
        assert_eq!((s.requests, s.requests_busy), (u64::from(LIMIT), SENT - u64::from(LIMIT)), "{pol:?}");
        let held = w.events.iter().filter(|e| matches!(e, Event::Request { .. })).count();
        assert_eq!(held, LIMIT as usize, "{pol:?}: requests handed to the user");
        let busy: Vec<u64> = std::iter::from_fn(|| w.attacker.frames.pop_front())
            .map(|f| Seen::of(&f))
            .filter(|s| s.kind == "busy")
            .filter_map(|s| s.msg_id)
            .collect();
        assert_eq!(
            busy,
            (u64::from(LIMIT) + 1..=SENT).collect::<Vec<_>>(),
            "{pol:?}: one busy answer each, in order"
        );
        // Answering one makes room for one more.
        let (req, data) = w.take_request();
        if let Some(d) = data {
            w.victim.free(d);
        }
        let now = w.now();
        w.victim.reply(now, req, 0, b"a", None).unwrap();
        w.send_within_credit(&request_frame(SENT + 1, &[]));
        w.settle();
        assert_eq!(w.victim.stats().requests, u64::from(LIMIT) + 1, "{pol:?}");
        w.finish();
    }
}

#[test]
fn a_give_back_asking_for_everything_leaves_the_victim_its_least_credit() {
    // A peer may ask for the credit it granted back (`GiveBack`, meant for
    // an idle connection on shared receives); asking for all of it would
    // leave the victim unable to send. The victim keeps the least a side
    // may start with (3), gives back the rest, says so, and goes on.
    use mwcap::conn::frame::{Frame, MIN_START_CREDITS};
    for role in [Role::Server, Role::Client] {
        for pol in ALL {
            let mut w = World::new(role, pol);
            let before = w.victim.stats().credits;
            w.attacker.frames.clear();
            w.attacker.send_frame(&Frame::GiveBack { keep: 0 });
            let count = loop {
                if let Ok((Frame::Returned { count }, _)) = Frame::decode_with_credit(&w.next_frame()) {
                    break count;
                }
            };
            // (The GiveBack frame may itself grant credit.)
            assert!(count >= before - MIN_START_CREDITS, "{role:?} {pol:?}: {count} of {before}");
            let s = w.victim.stats();
            assert_eq!(
                (s.credits, s.credits_returned),
                (MIN_START_CREDITS - 1, u64::from(count)),
                "{role:?} {pol:?}"
            );
            assert!(w.victim.is_down().is_none(), "{role:?} {pol:?}");
            w.finish();
        }
    }
}

#[test]
fn confirm_a_client_neither_reads_nor_keeps_the_offers_of_a_second_reply_to_a_call() {
    // The confirm side of `mw_a_client_releases_the_grant_of_a_second_reply_to_a_call_unread`:
    // a server that replies again and again to one call, each time with an
    // offer of its reply's payload, while the client's user holds every
    // buffer. The client keeps the first offer only (one message tracked),
    // reads none of them while it has no buffer, and ignores the others:
    // a `Refuse` names only the message, so it would refuse the first
    // offer too. Once a buffer is free it reads the first offer, once, and
    // the call ends on the server's verdict.
    for pol in ALL.into_iter().filter(|p| p.reply == Policy::Confirm) {
        let mut w = World::new(Role::Client, pol);
        let held = hold_every_buffer(&mut w);
        let now = w.now();
        let call = w.victim.call(now, b"call", None).unwrap();
        let seen = Seen::of(&w.next_frame());
        let (msg_id, fetch) =
            (seen.msg_id.unwrap(), seen.fetch.expect("the call asks for its reply's payload"));
        w.attacker.nic.write_mr(w.attacker.mem.id, 0, &[0x77; PAYLOAD]).unwrap();
        let region = fb::Region::new(w.attacker.mem.addr, PAYLOAD as u32, w.attacker.mem.rkey);
        let generation = fb::Generation::from_raw(1);
        let n = 3 * CTRL_SLOTS;
        for k in 1..=n {
            let offer =
                fb::Message::Offer { msg: fetch, buffer: fb::BufferId::from_raw(k), generation, region };
            w.send_within_credit(&reply_frame(msg_id, &[fb_attach(offer)]));
        }
        w.run_for(Duration::from_millis(2));
        let served = |w: &World| w.fabric.qp_counters(w.attacker.qp_addr()).unwrap().bytes_served;
        assert_eq!(served(&w), 0, "{pol:?}: nothing read while every buffer is held");
        assert_eq!(w.victim.tracked_messages(), 1, "{pol:?}: the call's one message, nothing per offer");
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        assert!(w.attacker.frames.iter().all(|f| Seen::of(f).refuse.is_none()), "{pol:?}: no refusal");
        for b in held {
            w.victim.free(b);
        }
        let (msg, buffer, g) = victims_confirm(&mut w);
        assert_eq!(
            (msg, buffer, g),
            (fetch, fb::BufferId::from_raw(1), generation),
            "{pol:?}: the first offer"
        );
        assert_eq!(served(&w), PAYLOAD as u64, "{pol:?}: read once");
        w.attacker.send(&confirm_reply(msg, buffer, g, fb::Verdict::Intact));
        let got = w.run_until(Duration::from_millis(20), |w| {
            w.events.iter().any(|e| matches!(e, Event::Reply { call: c, data: Some(b), .. } if *c == call && b[..] == [0x77; PAYLOAD][..]))
        });
        assert!(got, "{pol:?}: {:?} {:?}", w.events, w.down());
        w.run_for(Duration::from_millis(2));
        assert_eq!(served(&w), PAYLOAD as u64, "{pol:?}: no other offer read");
        assert!(w.down().is_none(), "{pol:?}: {:?}", w.down());
        w.finish();
    }
}
