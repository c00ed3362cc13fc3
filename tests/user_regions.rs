//! Memory the application already has: a region registered with the
//! endpoint, ranges of it exposed in requests and replies with the same
//! capability rules as pool buffers (a window over exactly the range under
//! mw, the lease, expiry and evidence), and no write or deregistration while
//! a range is exposed. On the simulated NIC in spec mode, whose oracle
//! flags any access a window does not allow.

use std::time::Duration;

use mwcap::conn::{Config, Event, Policies, Policy, RegionId, RegionRange, SimPair, UseError};

const ALL: [Policies; 4] = [
    Policies { request: Policy::Mw, reply: Policy::Mw },
    Policies { request: Policy::Mw, reply: Policy::Confirm },
    Policies { request: Policy::Confirm, reply: Policy::Mw },
    Policies { request: Policy::Confirm, reply: Policy::Confirm },
];

fn pair(p: Policies, tweak: impl Fn(&mut Config)) -> SimPair {
    let cfg = || {
        let mut c = Config::default();
        c.lease_time = Duration::from_millis(500);
        c.safety_margin = Duration::from_millis(50);
        c.call_timeout = Duration::from_secs(2);
        tweak(&mut c);
        c
    };
    SimPair::spec(21, p, cfg(), cfg()).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect()
}

/// A server region of 1 MiB holding "values" at known offsets.
fn values(p: &mut SimPair) -> RegionId {
    let r = p.server.register_region(1 << 20).unwrap();
    for k in 0..4u8 {
        p.server.region_write(r, usize::from(k) * 4096, &pattern(k, 3000)).unwrap();
    }
    r
}

fn take_request(p: &mut SimPair) -> mwcap::conn::RequestId {
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .server_events
        .iter()
        .any(|e| matches!(e, Event::Request { .. }))));
    let i = p.server_events.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
    let Event::Request { req, data, .. } = p.server_events.remove(i) else { unreachable!() };
    if let Some(d) = data {
        p.server.free(d);
    }
    req
}

fn take_reply(p: &mut SimPair) -> Vec<u8> {
    let done = |p: &mut SimPair| {
        p.client_events.iter().position(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))
    };
    assert!(p.drive_until(Duration::from_secs(2), |p| done(p).is_some()));
    let i = done(p).unwrap();
    match p.client_events.remove(i) {
        Event::Reply { data: Some(d), .. } => {
            let bytes = d.to_vec();
            p.client.free(d);
            bytes
        }
        other => panic!("{other:?}"),
    }
}

fn range_returned(p: &SimPair, range: RegionRange) -> bool {
    p.server_events.iter().any(|e| matches!(e, Event::RangeReturned { range: r, .. } if *r == range))
}

#[test]
fn a_range_of_a_user_region_is_served_without_a_copy_and_comes_back_on_evidence() {
    for pol in ALL {
        let mut p = pair(pol, |_| {});
        let r = values(&mut p);
        for k in 0..4u8 {
            let now = p.now();
            p.client.call(now, b"get", None).unwrap();
            let req = take_request(&mut p);
            let range = RegionRange { region: r, offset: usize::from(k) * 4096, len: 3000 };
            let now = p.now();
            p.server.reply_region(now, req, 0, b"ok", range, None).unwrap();
            // While exposed, the range is the NIC's: no write, no deregistration.
            assert_eq!(
                p.server.region_write(r, usize::from(k) * 4096 + 10, b"x"),
                Err(UseError::RangeExposed { region: r, offset: usize::from(k) * 4096 + 10, len: 1 }),
                "{pol:?}"
            );
            assert_eq!(p.server.deregister_region(r), Err(UseError::RegionBusy(r)));
            // Bytes next to it are not exposed.
            p.server.region_write(r, usize::from(k) * 4096 + 3000, b"neighbour").unwrap();
            assert_eq!(take_reply(&mut p), pattern(k, 3000), "{pol:?} value {k}");
            assert!(p.drive_until(Duration::from_secs(2), |p| range_returned(p, range)), "{pol:?}");
            p.server.region_write(r, usize::from(k) * 4096, b"rewritten").unwrap();
        }
        let s = p.server.stats();
        if pol.reply == Policy::Mw {
            let o = s.lease_owner.unwrap();
            assert_eq!(
                (o.grants, o.invalidations),
                (4, 4),
                "{pol:?}: a window bound and invalidated per range"
            );
        }
        assert!(p.fabric.hazards().is_empty(), "{pol:?}: {:?}", p.fabric.hazards());
        p.server.deregister_region(r).unwrap();
        assert_eq!(p.server.region_write(r, 0, b"x"), Err(UseError::NoSuchRegion(r)));
    }
}

#[test]
fn a_request_payload_from_a_user_region_reaches_the_server() {
    for pol in ALL {
        let mut p = pair(pol, |_| {});
        let r = p.client.register_region(64 << 10).unwrap();
        p.client.region_write(r, 1000, &pattern(7, 20_000)).unwrap();
        let range = RegionRange { region: r, offset: 1000, len: 20_000 };
        let now = p.now();
        p.client.call_region(now, None, b"put", range).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| p
            .server_events
            .iter()
            .any(|e| matches!(e, Event::Request { .. }))));
        let i = p.server_events.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
        let Event::Request { req, data: Some(d), .. } = p.server_events.remove(i) else {
            panic!("{pol:?}: no payload")
        };
        assert_eq!(d.to_vec(), pattern(7, 20_000), "{pol:?}");
        p.server.free(d);
        let now = p.now();
        p.server.reply(now, req, 0, b"ok", None).unwrap();
        assert!(
            p.drive_until(Duration::from_secs(2), |p| {
                p.client_events
                    .iter()
                    .any(|e| matches!(e, Event::RangeReturned { range: r, .. } if *r == range))
            }),
            "{pol:?}"
        );
        assert!(p.fabric.hazards().is_empty(), "{pol:?}: {:?}", p.fabric.hazards());
    }
}

#[test]
fn an_unreleased_range_expires_and_returns_only_after_its_lease() {
    // The client never reads the reply's range (its call is cancelled): the
    // server's lease ends it, and not before.
    for pol in [Policies::both(Policy::Mw), Policies::both(Policy::Confirm)] {
        let mut p = pair(pol, |_| {});
        let r = values(&mut p);
        let now = p.now();
        let call = p.client.call(now, b"get", None).unwrap();
        let req = take_request(&mut p);
        let range = RegionRange { region: r, offset: 0, len: 3000 };
        // The client gives up before the reply is read.
        let now = p.now();
        p.client.cancel(now, call);
        let exposed_at = p.now();
        p.server.reply_region(exposed_at, req, 0, b"ok", range, None).unwrap();
        assert!(p.drive_until(Duration::from_secs(3), |p| range_returned(p, range)), "{pol:?}");
        if pol.reply == Policy::Mw && p.server.stats().lease_owner.unwrap().released == 0 {
            assert!(
                p.now() >= exposed_at + Duration::from_millis(500),
                "{pol:?}: back before the lease ended"
            );
        }
        assert!(p.client.is_down().is_none() && p.server.is_down().is_none(), "{pol:?}");
        assert!(p.fabric.hazards().is_empty(), "{pol:?}: {:?}", p.fabric.hazards());
    }
}

#[test]
fn ranges_outside_their_region_or_past_the_exposure_limit_are_refused() {
    let mut p = pair(Policies::both(Policy::Mw), |c| c.region_exposures = 2);
    let r = p.client.register_region(8192).unwrap();
    let now = p.now();
    let outside = RegionRange { region: r, offset: 8000, len: 500 };
    assert!(matches!(p.client.call_region(now, None, b"x", outside), Err(UseError::OutOfRegion { .. })));
    let empty = RegionRange { region: r, offset: 0, len: 0 };
    assert!(matches!(p.client.call_region(now, None, b"x", empty), Err(UseError::OutOfRegion { .. })));
    for i in 0..2 {
        p.client.call_region(now, None, b"x", RegionRange { region: r, offset: i * 1000, len: 500 }).unwrap();
    }
    assert_eq!(
        p.client.call_region(now, None, b"x", RegionRange { region: r, offset: 4000, len: 500 }),
        Err(UseError::NoFreeWindow),
        "past region_exposures: backpressure"
    );
    assert!(matches!(p.client.region_write(r, 8000, &[0; 500]), Err(UseError::OutOfRegion { .. })));
}

#[test]
fn the_window_of_a_range_covers_exactly_that_range_on_the_connections_qp() {
    use mwcap::backend::MwId;
    use mwcap::sim::WindowState;
    let mut p = pair(Policies::both(Policy::Mw), |_| {});
    let r = values(&mut p);
    let now = p.now();
    p.client.call(now, b"get", None).unwrap();
    let req = take_request(&mut p);
    let range = RegionRange { region: r, offset: 2 * 4096 + 100, len: 2000 };
    let now = p.now();
    p.server.reply_region(now, req, 0, b"ok", range, None).unwrap();
    // The NICs carry out the bind and the SEND; no endpoint runs, so the
    // client has not READ or released yet.
    p.fabric.run_until_idle();
    let dev = p.server_device();
    let bound: Vec<_> = (0..64)
        .filter_map(|i| match p.fabric.window(dev, MwId::from_raw(i)) {
            Some(WindowState::Bound { qp, bytes, .. }) => Some((qp, bytes)),
            _ => None,
        })
        .collect();
    // Bound through the server's QP of this connection: only its peer can use it.
    assert_eq!(
        bound,
        vec![(p.server_qp(), range.offset..range.offset + 2000)],
        "one window, exactly the range"
    );
    assert_eq!(take_reply(&mut p)[..], pattern(2, 3000)[100..2100]);
}
