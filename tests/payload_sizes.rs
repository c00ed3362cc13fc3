//! Payloads of any size on the simulated NIC: small ones inline in the
//! frame (no window, READ or release), large ones in the smallest buffer
//! class that fits, READ in chunks; every byte checked, and the simulator's
//! oracle (spec mode) checks the same safety rules as for every payload.

use std::time::Duration;

use mwcap::conn::{BufClass, CallError, Config, Event, PayloadError, Policies, Policy, SimPair, UseError};
use mwcap::sim::{DeviceConfig, FabricConfig};

const ALL: [Policies; 4] = [
    Policies { request: Policy::Mw, reply: Policy::Mw },
    Policies { request: Policy::Mw, reply: Policy::Confirm },
    Policies { request: Policy::Confirm, reply: Policy::Mw },
    Policies { request: Policy::Confirm, reply: Policy::Confirm },
];

const CHUNK: u32 = 256 << 10;

fn pair_with(p: Policies, tweak: impl Fn(&mut Config)) -> SimPair {
    let cfg = || {
        let mut c = Config::default();
        c.buffers = 4;
        c.buffer_size = 4096;
        c.large_buffers = vec![BufClass { size: 4 << 20, count: 1 }, BufClass { size: 64 << 10, count: 2 }];
        c.read_chunk = CHUNK;
        c.inline_max = 256;
        tweak(&mut c);
        c
    };
    SimPair::spec(11, p, cfg(), cfg()).expect("pair")
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ (i >> 8) as u8 ^ seed).collect()
}

/// Fail on any hazard the simulator's oracle recorded: no DMA into a
/// buffer a user holds or into freed memory, no READ of a held mw buffer,
/// no invalidation that would crash rxe.
fn assert_no_hazards(p: &SimPair) {
    let hazards = p.fabric.hazards();
    assert!(hazards.is_empty(), "the oracle saw {hazards:?}");
}

/// What one round trip saw.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    /// Capacity of the buffer the request payload was delivered in (server).
    req_cap: usize,
    /// Capacity of the buffer the reply payload was delivered in (client).
    rep_cap: usize,
}

fn free_returned(p: &mut SimPair) {
    for (events, ep) in [(&mut p.client_events, &mut p.client), (&mut p.server_events, &mut p.server)] {
        let mut i = 0;
        while i < events.len() {
            if matches!(events[i], Event::BufferReturned(_)) {
                let Event::BufferReturned(b) = events.remove(i) else { unreachable!() };
                ep.free(b);
            } else {
                i += 1;
            }
        }
    }
}

/// One call with a `req`-byte request payload and a `rep`-byte reply
/// payload, both checked byte for byte, and checked by the oracle.
fn round_trip(p: &mut SimPair, req: usize, rep: usize) -> Seen {
    let mut b = p.client.alloc_for(req).unwrap().expect("a free client buffer");
    b.copy_from(&pattern(1, req)).unwrap();
    let now = p.now();
    let call = p.client.call(now, b"get", Some(b)).unwrap();
    assert!(p.drive_until(Duration::from_secs(5), |p| !p.server_events.is_empty()));
    let Some(Event::Request { req: r, data: Some(d), .. }) = p.server_events.pop() else {
        panic!("no request payload")
    };
    let req_cap = d.capacity();
    assert!(d.to_vec() == pattern(1, req), "request payload of {req} bytes");
    p.server.free(d);
    let mut out = p.server.alloc_for(rep).unwrap().expect("a free server buffer");
    out.copy_from(&pattern(2, rep)).unwrap();
    let now = p.now();
    p.server.reply(now, r, 0, b"ok", Some(out)).unwrap();
    // Returned buffers go straight back to the pools, as the async API does
    // (a 4 MiB reply needs the 4 MiB request buffer back at the client).
    let done = |p: &mut SimPair| {
        free_returned(p);
        p.client_events.iter().position(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))
    };
    assert!(
        p.drive_until(Duration::from_secs(5), |p| done(p).is_some()),
        "no reply: client {:?}\nserver {:?}\n{:?} {:?}",
        p.client.stats(),
        p.server.stats(),
        p.client.is_down(),
        p.server.is_down()
    );
    let i = done(p).unwrap();
    let rep_cap = match p.client_events.remove(i) {
        Event::Reply { call: c, data: Some(d), .. } => {
            assert_eq!(c, call);
            assert!(d.to_vec() == pattern(2, rep), "reply payload of {rep} bytes");
            let cap = d.capacity();
            p.client.free(d);
            cap
        }
        other => panic!("{other:?}"),
    };
    // Every buffer comes back (the last release's invalidation included).
    assert!(p.drive_until(Duration::from_secs(10), |p| {
        p.client.busy_buffers() == 0 && p.server.busy_buffers() == 0
    }));
    for e in p.client_events.drain(..).chain(p.server_events.drain(..)) {
        assert!(matches!(e, Event::BufferReturned(_)), "{e:?}");
    }
    assert_no_hazards(p);
    Seen { req_cap, rep_cap }
}

#[test]
fn small_payloads_ride_inline_with_no_window_read_or_release() {
    for pol in ALL {
        let mut p = pair_with(pol, |_| {});
        let (c0, s0) =
            (p.fabric.qp_counters(p.client_qp()).unwrap(), p.fabric.qp_counters(p.server_qp()).unwrap());
        let seen = round_trip(&mut p, 100, 256);
        // Delivered in the smallest buffers.
        assert_eq!(seen, Seen { req_cap: 4096, rep_cap: 4096 }, "{pol:?}");
        let (c, s) = (p.client.stats(), p.server.stats());
        assert_eq!((c.inline_sent, s.inline_received, s.inline_sent, c.inline_received), (1, 1, 1, 1));
        for st in [&c, &s] {
            assert_eq!(st.lease_owner.map_or(0, |o| o.grants), 0, "{pol:?}: no window bound");
            assert_eq!(st.lease_reader.map_or(0, |r| r.reads), 0, "{pol:?}: no READ");
        }
        let (c1, s1) =
            (p.fabric.qp_counters(p.client_qp()).unwrap(), p.fabric.qp_counters(p.server_qp()).unwrap());
        assert_eq!(
            (c1.bytes_read - c0.bytes_read, s1.bytes_read - s0.bytes_read),
            (0, 0),
            "{pol:?}: nothing READ"
        );
    }
}

#[test]
fn one_byte_past_inline_max_takes_a_window_or_an_offer() {
    for pol in ALL {
        let mut p = pair_with(pol, |_| {});
        let seen = round_trip(&mut p, 257, 257);
        assert_eq!(seen, Seen { req_cap: 4096, rep_cap: 4096 });
        let (c, s) = (p.client.stats(), p.server.stats());
        assert_eq!((c.inline_sent, s.inline_sent), (0, 0), "{pol:?}");
        assert_eq!((s.bytes_read, c.bytes_read), (257, 257), "{pol:?}: both payloads READ");
    }
}

#[test]
fn large_payloads_take_the_smallest_class_that_fits_and_are_read_in_chunks() {
    for pol in ALL {
        let mut p = pair_with(pol, |_| {});
        let before = p.fabric.qp_counters(p.server_qp()).unwrap().sends_posted;
        // 3 MiB + 1 byte: the 4 MiB class, 13 READs of 256 KiB.
        let big = (3 << 20) + 1;
        let seen = round_trip(&mut p, big, 40_000);
        assert_eq!(seen, Seen { req_cap: 4 << 20, rep_cap: 64 << 10 }, "{pol:?}");
        let s = p.server.stats();
        assert_eq!(s.bytes_read, big as u64, "{pol:?}");
        let posted = p.fabric.qp_counters(p.server_qp()).unwrap().sends_posted - before;
        let chunks = (big as u64).div_ceil(u64::from(CHUNK));
        assert!(posted >= chunks, "{pol:?}: {posted} send WRs for {chunks} chunks");
        // The same buffers serve again (nothing left exposed or reading).
        let seen = round_trip(&mut p, 4 << 20, 4 << 20);
        assert_eq!(seen, Seen { req_cap: 4 << 20, rep_cap: 4 << 20 }, "{pol:?}");
    }
}

#[test]
fn a_payload_larger_than_every_reader_buffer_is_refused_with_its_reason() {
    for pol in ALL {
        // The server has no 4 MiB class; the client sends 1 MiB.
        let mut p = SimPair::new(
            FabricConfig::with_seed(3),
            DeviceConfig::spec(),
            DeviceConfig::spec(),
            pol,
            {
                let mut c = Config::default();
                c.large_buffers = vec![BufClass { size: 4 << 20, count: 1 }];
                c
            },
            Config::default(),
        )
        .unwrap();
        let mut b = p.client.alloc_for(1 << 20).unwrap().unwrap();
        b.copy_from(&pattern(3, 1 << 20)).unwrap();
        let now = p.now();
        let call = p.client.call(now, b"big", Some(b)).unwrap();
        assert!(p.drive_until(Duration::from_secs(5), |p| {
            p.server_events.iter().any(|e| matches!(e, Event::RequestDropped { .. }))
                || p.client_events.iter().any(|e| matches!(e, Event::CallFailed { .. }))
        }));
        match pol.request {
            Policy::Mw => {
                let dropped = p.server_events.iter().find_map(|e| match e {
                    Event::RequestDropped { error, .. } => Some(error),
                    _ => None,
                });
                assert!(
                    matches!(
                        dropped,
                        Some(CallError::Payload(PayloadError::Declined(
                            mwcap_mw::DeclineReason::DestinationTooSmall { have: 65536, .. }
                        )))
                    ),
                    "{pol:?}: {dropped:?}"
                );
            }
            // Under confirm the server's engine refuses an exposure longer
            // than its largest buffer: the request is dropped too.
            Policy::Confirm => assert!(
                p.server_events.iter().any(|e| matches!(e, Event::RequestDropped { .. })),
                "{pol:?}: {:?}",
                p.server_events
            ),
        }
        assert!(p.client.is_down().is_none() && p.server.is_down().is_none(), "{pol:?}");
        assert_no_hazards(&p);
        let _ = call;
    }
}

#[test]
fn alloc_for_picks_the_smallest_free_class_and_says_when_none_is_large_enough() {
    let mut p = pair_with(Policies::both(Policy::Mw), |_| {});
    let cap = |_: &SimPair, b: &mwcap::conn::Buf| b.capacity();
    let a = p.client.alloc_for(5000).unwrap().unwrap();
    assert_eq!(cap(&p, &a), 64 << 10);
    let b = p.client.alloc_for(5000).unwrap().unwrap();
    assert_eq!(cap(&p, &b), 64 << 10);
    // The 64 KiB class is used up: the next larger one.
    let c = p.client.alloc_for(5000).unwrap().unwrap();
    assert_eq!(cap(&p, &c), 4 << 20);
    assert_eq!(p.client.alloc_for(5000).unwrap(), None, "every buffer that fits is in use");
    assert_eq!(
        p.client.alloc_for((4 << 20) + 1).unwrap_err(),
        UseError::TooLong { len: (4 << 20) + 1, cap: 4 << 20 }
    );
    // Writing past a buffer's class is refused with its capacity.
    let mut small = p.client.alloc().unwrap();
    assert_eq!(small.copy_from(&[0; 4097]).unwrap_err(), UseError::TooLong { len: 4097, cap: 4096 });
    for x in [a, b, c, small] {
        p.client.free(x);
    }
}

#[test]
fn an_inline_payload_waits_for_a_free_buffer_and_then_arrives() {
    let mut p = pair_with(Policies::both(Policy::Mw), |c| c.large_buffers.clear());
    // The server's user holds every buffer.
    let held: Vec<_> = (0..4).map(|_| p.server.alloc().unwrap()).collect();
    let mut b = p.client.alloc().unwrap();
    b.copy_from(&pattern(9, 200)).unwrap();
    let now = p.now();
    p.client.call(now, b"q", Some(b)).unwrap();
    p.run_for(Duration::from_millis(50));
    assert!(p.server_events.is_empty(), "no buffer to put it in yet: {:?}", p.server_events);
    for h in held {
        p.server.free(h);
    }
    assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
    let Some(Event::Request { data: Some(d), .. }) = p.server_events.pop() else { panic!("no request") };
    assert_eq!(d.to_vec(), pattern(9, 200));
    assert_no_hazards(&p);
}

#[test]
fn an_inline_reply_waiting_for_a_client_buffer_is_delivered_under_every_policy() {
    // Under confirm the server refuses the client's fetch when its reply
    // carries the payload inline: that is no failure, even when the bytes
    // wait for a client buffer.
    for pol in ALL {
        let mut p = pair_with(pol, |c| c.large_buffers.clear());
        let held: Vec<_> = (0..4).map(|_| p.client.alloc().unwrap()).collect();
        let now = p.now();
        let call = p.client.call(now, b"get", None).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
        let Some(Event::Request { req, .. }) = p.server_events.pop() else { panic!("no request") };
        let mut out = p.server.alloc().unwrap();
        out.copy_from(&pattern(4, 200)).unwrap();
        let now = p.now();
        p.server.reply(now, req, 0, b"ok", Some(out)).unwrap();
        p.run_for(Duration::from_millis(20));
        assert!(p.client_events.is_empty(), "{pol:?}: no client buffer yet: {:?}", p.client_events);
        for h in held {
            p.client.free(h);
        }
        assert!(p.drive_until(Duration::from_millis(100), |p| !p.client_events.is_empty()));
        match p.client_events.remove(0) {
            Event::Reply { call: c, data: Some(d), .. } => {
                assert_eq!(c, call);
                assert_eq!(d.to_vec(), pattern(4, 200), "{pol:?}");
            }
            other => panic!("{pol:?}: {other:?}"),
        }
        assert_no_hazards(&p);
    }
}
