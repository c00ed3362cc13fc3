//! Links over the simulated NIC: calls in every policy combination,
//! and the safety properties checked through the sim's oracle.

use std::time::Duration;

use mwcap::conn::{Buf, CallError, Config, Event, Policies, Policy, SimPair};
use mwcap::sim::Verb;

fn pair(p: Policies) -> SimPair {
    SimPair::spec(7, p, Config::default(), Config::default()).expect("pair")
}

const ALL: [Policies; 4] = [
    Policies { request: Policy::Mw, reply: Policy::Mw },
    Policies { request: Policy::Mw, reply: Policy::Confirm },
    Policies { request: Policy::Confirm, reply: Policy::Mw },
    Policies { request: Policy::Confirm, reply: Policy::Confirm },
];

fn filled(p: &mut SimPair, client: bool, bytes: &[u8]) -> Buf {
    let ep = if client { &mut p.client } else { &mut p.server };
    let mut b = ep.alloc().expect("free buffer");
    b.copy_from(bytes).unwrap();
    b
}

/// One full call with payloads both ways; returns the reply bytes.
fn round_trip(p: &mut SimPair, req: &[u8], rep: &[u8]) -> Vec<u8> {
    let b = filled(p, true, req);
    let now = p.now();
    let call = p.client.call(now, b"get", Some(b)).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .server_events
        .iter()
        .any(|e| matches!(e, Event::Request { .. }))));
    let Some(Event::Request { req: r, header, data, .. }) = p.server_events.pop() else {
        panic!("no request")
    };
    assert_eq!(header, b"get");
    let data = data.expect("request payload");
    assert_eq!(data.to_vec(), req);
    p.server.free(data);
    let out = filled(p, false, rep);
    let now = p.now();
    p.server.reply(now, r, 0, b"ok", Some(out)).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .client_events
        .iter()
        .any(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))));
    let pos = p
        .client_events
        .iter()
        .position(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))
        .unwrap();
    match p.client_events.remove(pos) {
        Event::Reply { call: c, status, header, data } => {
            assert_eq!(c, call);
            assert_eq!((status, &header[..]), (0, &b"ok"[..]));
            let d = data.expect("reply payload");
            let bytes = d.to_vec();
            p.client.free(d);
            bytes
        }
        other => panic!("call failed: {other:?}"),
    }
}

#[test]
fn a_call_with_payloads_both_ways_works_in_every_policy_combination() {
    for pol in ALL {
        let mut p = pair(pol);
        for i in 0..3u8 {
            let got = round_trip(&mut p, &[i; 1000], &[i ^ 0xff; 3000]);
            assert_eq!(got, vec![i ^ 0xff; 3000], "{pol:?}");
        }
        // Both exposed buffers come back, on evidence.
        assert!(p.drive_until(Duration::from_secs(10), |p| p.client.busy_buffers() == 0
            && p.server.busy_buffers() == 0));
        let returned_c = p.client_events.iter().filter(|e| matches!(e, Event::BufferReturned(_))).count();
        let returned_s = p.server_events.iter().filter(|e| matches!(e, Event::BufferReturned(_))).count();
        assert_eq!((returned_c, returned_s), (3, 3), "{pol:?}: {:?} {:?}", p.client_events, p.server_events);
        assert!(p.fabric.would_crash_rxe().is_empty(), "{pol:?}");
        assert!(p.fabric.hazards().is_empty(), "{pol:?}: {:?}", p.fabric.hazards());
        assert!(p.client.is_down().is_none() && p.server.is_down().is_none(), "{pol:?}");
    }
}

#[test]
fn a_call_without_payloads_is_a_plain_rpc() {
    for pol in ALL {
        let mut p = pair(pol);
        let now = p.now();
        let call = p.client.call(now, b"ping", None).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
        let Some(Event::Request { req, data: None, .. }) = p.server_events.pop() else { panic!() };
        let now = p.now();
        p.server.reply(now, req, 3, b"pong", None).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| !p.client_events.is_empty()));
        assert_eq!(
            p.client_events.pop(),
            Some(Event::Reply { call, status: 3, header: b"pong".into(), data: None }),
            "{pol:?}"
        );
    }
}

#[test]
fn a_call_times_out_when_the_server_never_replies_and_buffers_still_return() {
    for pol in ALL {
        let mut p = pair(pol);
        let b = filled(&mut p, true, b"abc");
        let now = p.now();
        let call = p.client.call(now, b"slow", Some(b)).unwrap();
        p.run_for(Duration::from_secs(30));
        assert!(
            p.client_events.contains(&Event::CallFailed { call, error: CallError::TimedOut }),
            "{pol:?}: {:?}",
            p.client_events
        );
        assert_eq!(p.client.busy_buffers(), 0, "{pol:?}");
        assert!(p.client.is_down().is_none(), "{pol:?}: a timeout must not tear the connection down");
        assert!(p.fabric.would_crash_rxe().is_empty());
    }
}

/// Selective signaling: most plain frames are posted unsignaled and their
/// send slots come back with the completion of a later signaled one (a
/// send queue completes in order). With a few send slots, many more calls
/// than slots go through, one plain frame in `slots / 2` is signaled, and
/// a close reaps the flushes without waiting out the flush grace.
#[test]
fn unsignaled_frames_give_their_send_slots_back_with_a_later_completion() {
    for slots in [4u32, 6] {
        let cfg = || {
            let mut c = Config::default();
            c.send_slots = Some(slots);
            c
        };
        let mut p = SimPair::spec(11, Policies::both(Policy::Mw), cfg(), cfg()).expect("pair");
        let calls = 10 * slots as u64;
        for i in 0..calls {
            let now = p.now();
            let call = p.client.call(now, b"ping", None).unwrap_or_else(|e| panic!("call {i}: {e:?}"));
            assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()), "call {i}");
            let Some(Event::Request { req, .. }) = p.server_events.pop() else { panic!("call {i}") };
            let now = p.now();
            p.server.reply(now, req, 0, b"pong", None).unwrap_or_else(|e| panic!("reply {i}: {e:?}"));
            assert!(p.drive_until(Duration::from_secs(1), |p| !p.client_events.is_empty()), "reply {i}");
            assert!(matches!(p.client_events.pop(), Some(Event::Reply { call: c, .. }) if c == call));
        }
        // Every frame is a request or a reply (credit rides in them): the
        // client sent `calls` and got a completion for one in `slots / 2`
        // of them, besides its receives'.
        let s = p.client.stats();
        assert_eq!(s.frames_sent, calls, "{s:?}");
        let send_completions = s.completions - s.frames_received;
        assert_eq!(send_completions, calls / u64::from(slots / 2), "{s:?}");
        // At most `slots / 2 - 1` unsignaled frames wait for a later
        // completion; none is counted as a send in flight.
        assert_eq!(p.client.sends_in_flight(), 0);
        let closing = p.now();
        p.client.begin_close(closing);
        p.server.begin_close(closing);
        assert!(p.drive_until(Duration::from_millis(900), |p| p.client.sends_in_flight() == 0
            && p.server.sends_in_flight() == 0));
        let now = p.now();
        p.client.finish_close(now);
        p.server.finish_close(now);
        assert_eq!(p.client.busy_buffers() + p.server.busy_buffers(), 0);
        assert!(p.fabric.hazards().is_empty(), "{:?}", p.fabric.hazards());
    }
}

/// Close `p.client` without reaping its flushes, with its QP's destroy
/// failing, as a driver does when its flush grace ends on a device that
/// has stopped answering: no evidence says its NIC is done.
fn close_client_stuck(p: &mut SimPair) {
    let now = p.now();
    p.client.nic().fail_next(Verb::DestroyQp, 1);
    p.client.begin_close(now);
    p.client.finish_close(now);
}

/// A READ still in flight when the QP cannot be destroyed may land later:
/// its destination is never handed out again. (Given back, the next
/// `alloc` took it, and the READ's late landing wrote into the user's
/// buffer: `DmaIntoHeldBuffer`.)
#[test]
fn a_read_in_flight_when_the_qp_cannot_be_destroyed_keeps_its_buffer_until_its_completion() {
    let mut cfg = Config::default();
    cfg.buffers = 1;
    let mut p = SimPair::spec(7, Policies::both(Policy::Mw), cfg, Config::default()).expect("pair");
    let now = p.now();
    p.client.call(now, b"get", None).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
    let Some(Event::Request { req, .. }) = p.server_events.pop() else { panic!("no request") };
    let out = filled(&mut p, false, &[7u8; 4096]);
    let now = p.now();
    p.server.reply(now, req, 0, b"ok", Some(out)).unwrap();
    // The client takes the reply in and posts its READ into its one buffer.
    assert!(p.drive_until(Duration::from_secs(1), |p| p.client.busy_buffers() == 1));
    close_client_stuck(&mut p);
    assert_eq!(p.client.busy_buffers(), 1, "the READ's destination is still the NIC's");
    assert_eq!(p.client.free_buffers(), 0);
    assert!(p.client.alloc().is_none(), "the READ's destination was handed out");
    // The READ's flush, after its late landing, is the evidence.
    assert!(p.drive_until(Duration::from_secs(1), |p| p.client.busy_buffers() == 0));
    assert!(p.fabric.hazards().is_empty(), "{:?}", p.fabric.hazards());
}

/// An exposure whose QP neither went to ERR nor could be destroyed, its
/// window not freed either, stays the peer's: the peer can still READ it
/// through the window (and does), so it never comes back. (Given back once
/// its SEND completed, as when a failed move to ERR was taken for done, the
/// user held it when the peer's READ came: `RemoteReadOfHeldBuffer`.)
#[test]
fn an_exposure_whose_qp_neither_errs_nor_dies_is_never_returned() {
    for reply in [Policy::Mw, Policy::Confirm] {
        let pol = Policies { request: Policy::Mw, reply };
        let mut cfg = Config::default();
        cfg.buffers = 1;
        let mut p = SimPair::spec(7, pol, cfg, Config::default()).expect("pair");
        // Past `MAX_INLINE`: exposed, not sent inline.
        let b = filled(&mut p, true, &[3u8; 4096]);
        let now = p.now();
        p.client.call(now, b"put", Some(b)).unwrap();
        assert_eq!(p.client.busy_buffers(), 1, "{pol:?}");
        let nic = p.client.nic().clone();
        nic.fail_next(Verb::SetQpError, 1);
        nic.fail_next(Verb::DeallocMw, 64);
        close_client_stuck(&mut p);
        // The bind and the request's SEND complete, the server READs.
        assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()), "{pol:?}");
        p.run_for(Duration::from_secs(1));
        assert_eq!(p.client.busy_buffers(), 1, "{pol:?}");
        assert!(p.client.alloc().is_none(), "{pol:?}: the exposed buffer was handed out");
        assert!(
            !p.client_events.iter().any(|e| matches!(e, Event::BufferReturned(_))),
            "{pol:?}: {:?}",
            p.client_events
        );
        assert!(p.fabric.hazards().is_empty(), "{pol:?}: {:?}", p.fabric.hazards());
    }
}

/// When only the destroy fails, the move to ERR that worked is no
/// evidence: a NIC may still be copying a READ response's packet out of
/// the exposed buffer after the flush, and nothing but the destroy says it
/// has stopped. The buffer is kept for good, as when nothing worked.
#[test]
fn an_exposure_whose_qp_erred_but_was_not_destroyed_is_kept() {
    let mut p = pair(Policies::both(Policy::Mw));
    // Past `MAX_INLINE`: exposed, not sent inline.
    let b = filled(&mut p, true, &[3u8; 4096]);
    let now = p.now();
    p.client.call(now, b"put", Some(b)).unwrap();
    // The request (and its window's bind) went out before the close.
    assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
    assert_eq!(p.client.busy_buffers(), 1);
    close_client_stuck(&mut p);
    p.run_for(Duration::from_secs(1));
    assert_eq!(p.client.busy_buffers(), 1);
    assert!(!p.client_events.iter().any(|e| matches!(e, Event::BufferReturned(_))), "{:?}", p.client_events);
    assert!(p.fabric.hazards().is_empty(), "{:?}", p.fabric.hazards());
}

/// A window whose deallocation fails at the close keeps its QP from
/// being destroyed under it (rxe would stall, then free the QP the window
/// still points at), and both go when the connection is dropped: the
/// window is tried again, then the QP destroyed. (Before, the close forgot
/// the window, still allocated, and destroyed the QP under it.)
#[test]
fn a_window_whose_deallocation_failed_at_the_close_is_freed_at_the_drop() {
    let mut p = pair(Policies::both(Policy::Mw));
    assert_eq!(round_trip(&mut p, &[1u8; 4096], &[2u8; 4096]), vec![2u8; 4096]);
    let (dev, qp) = (p.client.nic().device(), p.client_qp());
    let windows = p.fabric.windows(dev).len();
    assert!(windows > 0, "an mw client has windows");
    p.client.nic().fail_next(Verb::DeallocMw, 1);
    let now = p.now();
    p.client.close(now);
    assert_eq!(p.fabric.windows(dev).len(), 1, "the one whose deallocation failed is still allocated");
    assert!(p.fabric.qp_state(qp).is_some(), "the QP was destroyed under a window still allocated");
    let SimPair { fabric, client, .. } = p;
    drop(client);
    assert_eq!(fabric.windows(dev), vec![], "a window outlived its connection");
    assert_eq!(fabric.qp_state(qp), None, "the QP outlived its connection");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

#[test]
fn a_window_exposed_buffer_returns_on_the_qp_destroy_not_on_the_flush() {
    // The server's connection goes down while the response to the
    // client's READ of its reply payload is on the wire. The server's NIC
    // may still be copying that response's last packet from the buffer
    // after its QP went to ERR and its send queue flushed (rxe's
    // responder looks at the QP's state only between packets): only the
    // QP's destruction ends that, so the buffer returns only then.
    let mut p = pair(Policies::both(Policy::Mw));
    p.fabric.set_link_delay(p.client_device(), p.server_device(), Duration::from_millis(1));
    let now = p.now();
    let call = p.client.call(now, b"get", None).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .server_events
        .iter()
        .any(|e| matches!(e, Event::Request { .. }))));
    let Some(Event::Request { req, .. }) = p.server_events.pop() else { panic!("no request") };
    let out = filled(&mut p, false, &[0x5a; 3000]);
    let now = p.now();
    p.server.reply(now, req, 0, b"ok", Some(out)).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .fabric
        .in_flight()
        .iter()
        .any(|r| r.source.is_some())));
    let now = p.now();
    p.server.begin_close(now);
    // The server took in its flushes, long before the response lands.
    assert!(p.drive_until(Duration::from_micros(200), |p| p.server.sends_in_flight() == 0));
    p.run_for(Duration::from_micros(100));
    let returned = |p: &SimPair| p.server_events.iter().any(|e| matches!(e, Event::BufferReturned(_)));
    assert!(!returned(&p), "the buffer came back on the flush, while the NIC may still copy from it");
    assert_eq!(p.server.busy_buffers(), 1);
    // Destroyed: now it comes back.
    let now = p.now();
    p.server.finish_close(now);
    p.settle();
    assert!(returned(&p), "the destroy is the evidence");
    // The response carries the payload as it was (its last packet copied
    // late, at the destroy, while the buffer still held it): the client's
    // call succeeds, and no READ touched a buffer a user held.
    assert!(p.drive_until(Duration::from_millis(5), |p| p
        .client_events
        .iter()
        .any(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))));
    match p.client_events.iter().find(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. })) {
        Some(Event::Reply { call: c, data: Some(d), .. }) => {
            assert_eq!(*c, call);
            assert_eq!(d.to_vec(), vec![0x5a; 3000]);
        }
        other => panic!("expected the reply: {other:?}"),
    }
    assert!(p.fabric.hazards().is_empty(), "{:?}", p.fabric.hazards());
}
