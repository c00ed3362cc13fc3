//! Zero-copy buffers: bytes lent in place, a dropped handle returns to its
//! pool, a buffer never lost (issue 7, section 3).

use mwcap::backend::NicOps;
use std::time::Duration;

use futures::executor::block_on;
use mwcap::bootstrap::Auth;
use mwcap::conn::{Config, Endpoint, Event, Link, Policies, Policy, Role, SimPair, UseError};
use mwcap::sim::{DeviceConfig, Fabric};

fn pair(p: Policies) -> SimPair {
    SimPair::spec(21, p, Config::default(), Config::default()).expect("pair")
}

#[test]
fn a_payload_written_in_place_is_read_in_place_by_the_peer() {
    for pol in [Policy::Mw, Policy::Confirm] {
        let mut p = pair(Policies::both(pol));
        let mut b = p.client.alloc().unwrap();
        b.write_with(|bytes| {
            for (i, x) in bytes[..5000].iter_mut().enumerate() {
                *x = i as u8;
            }
            5000
        })
        .unwrap();
        assert_eq!(b.len(), 5000);
        let now = p.now();
        p.client.call(now, b"put", Some(b)).unwrap();
        assert!(p.drive_until(Duration::from_secs(1), |p| p
            .server_events
            .iter()
            .any(|e| matches!(e, Event::Request { .. }))));
        let Some(Event::Request { data: Some(d), .. }) = p.server_events.pop() else {
            panic!("{:?}", p.server_events)
        };
        let sum = d.iter().map(|&x| u64::from(x)).sum::<u64>();
        let want: u64 = (0..5000u32).map(|i| u64::from(i as u8)).sum();
        assert_eq!(sum, want, "{pol:?}");
        drop(d);
    }
}

/// A held buffer is the handle's alone: its slice is the payload, the
/// NIC's CPU accessors refuse its bytes (no safe code can race the
/// handle's borrow), and once it is given back they work again.
#[test]
fn a_held_buffer_derefs_to_its_payload_and_nothing_else_touches_its_bytes() {
    use mwcap::backend::NicError;
    let mut p = pair(Policies::both(Policy::Mw));
    let data = p.client.data_region();
    let mut b = p.client.alloc().unwrap();
    assert_eq!((b.len(), b.capacity()), (0, 64 << 10));
    b.set_len(100).unwrap();
    b.fill(7);
    assert_eq!(&b[..], &[7; 100][..]);
    b.copy_from(b"hello").unwrap();
    assert_eq!(&b[..], b"hello");
    assert_eq!(b.set_len(b.capacity() + 1), Err(UseError::TooLong { len: (64 << 10) + 1, cap: 64 << 10 }));
    assert_eq!(b.len(), 5, "a refused length leaves the payload");
    let offset = b.slot() as usize * b.capacity();
    let nic = p.client.nic().clone();
    let held = |e: Result<(), NicError>| matches!(e, Err(NicError::Held { .. }));
    assert!(held(nic.write_mr(data.id, offset + 10, b"x")), "a CPU write into a held buffer");
    assert!(held(nic.read_mr(data.id, offset, &mut [0; 4])), "a CPU read of a held buffer");
    assert!(held(nic.write_mr(data.id, offset.saturating_sub(1), &[0; 2])), "overlapping its start");
    assert_eq!(&b[..], b"hello", "untouched");
    p.client.free(b);
    let mut out = [0; 5];
    nic.read_mr(data.id, offset, &mut out).unwrap();
    assert_eq!(&out, b"hello", "given back, the bytes are the region's again");
}

#[test]
fn fill_refuses_a_length_beyond_the_buffer() {
    let mut p = pair(Policies::both(Policy::Mw));
    let mut b = p.client.alloc().unwrap();
    let cap = p.client.config().buffer_size as usize;
    let err = b.write_with(|_| cap + 1).unwrap_err();
    assert_eq!(err, UseError::TooLong { len: cap + 1, cap: cap as u32 });
    assert_eq!(b.len(), 0, "the length is unchanged");
}

#[test]
fn a_dropped_buffer_returns_to_its_pool() {
    let mut p = pair(Policies::both(Policy::Mw));
    let total = p.client.free_buffers();
    let held: Vec<_> = std::iter::from_fn(|| p.client.alloc()).collect();
    assert_eq!(held.len(), total);
    assert!(p.client.alloc().is_none());
    drop(held);
    assert_eq!(p.client.free_buffers(), total);
}

#[test]
fn a_dropped_event_gives_its_buffer_back() {
    let mut p = pair(Policies::both(Policy::Mw));
    let total = p.client.free_buffers();
    let now = p.now();
    p.client.call(now, b"q", None).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| !p.server_events.is_empty()));
    let Some(Event::Request { req, .. }) = p.server_events.pop() else { panic!() };
    let mut out = p.server.alloc().unwrap();
    out.copy_from(&[1; 100]).unwrap();
    let now = p.now();
    p.server.reply(now, req, 0, b"r", Some(out)).unwrap();
    assert!(p.drive_until(Duration::from_secs(1), |p| p
        .client_events
        .iter()
        .any(|e| matches!(e, Event::Reply { .. }))));
    // The application ignores the reply, payload and all.
    p.client_events.clear();
    assert_eq!(p.client.free_buffers(), total, "the reply's buffer is back in the pool");
}

#[test]
fn a_buffer_of_another_endpoint_is_refused_and_handed_back() {
    let mut p = pair(Policies::both(Policy::Mw));
    let mut foreign = p.server.alloc().unwrap();
    foreign.copy_from(b"x").unwrap();
    let now = p.now();
    let r = p.client.call(now, b"q", Some(foreign)).unwrap_err();
    assert!(matches!(r.error, UseError::ForeignBuffer(_)));
    let total = p.server.config().buffers as usize;
    drop(r);
    assert_eq!(p.server.free_buffers(), total, "the refused buffer went home");
}

#[test]
fn alloc_waits_for_a_buffer_dropped_by_another_task() {
    let fabric = Fabric::with_seed(8);
    let nic = fabric.add_device(DeviceConfig::spec());
    let cfg_p = Policies::both(Policy::Mw);
    let mut cfg = Config::default();
    cfg.buffers = 1;
    let (endpoint, driver) = Endpoint::builder(nic, Auth::Unauthenticated).build().unwrap();
    let (peer, _peer_driver) =
        Endpoint::builder(fabric.add_device(DeviceConfig::spec()), Auth::Unauthenticated).build().unwrap();
    let c = endpoint.prepare(Role::Client, cfg_p, cfg).unwrap();
    let s = peer.prepare(Role::Server, cfg_p, Config::default()).unwrap();
    let (cl, sl) = (c.local(), s.local());
    let (conn, _server) = (c.connect(&sl).unwrap(), s.connect(&cl).unwrap());
    let only = conn.try_alloc().unwrap();
    assert!(conn.try_alloc().is_none());
    let waiter = async {
        let b = conn.alloc().await.expect("a buffer comes back");
        assert_eq!(b.slot(), 0);
    };
    let dropper = async move {
        async_io::Timer::after(Duration::from_millis(20)).await;
        drop(only);
    };
    let work = futures::future::join(waiter, dropper);
    futures::pin_mut!(work);
    let drive = driver.run();
    futures::pin_mut!(drive);
    match block_on(futures::future::select(work, drive)) {
        futures::future::Either::Left(_) => {}
        futures::future::Either::Right((stats, _)) => panic!("the driver ended: {stats:?}"),
    }
}

type Case = (fn(&mut Config), fn(&mwcap::conn::ConfigError) -> bool);

/// Settings that cannot work, each with the error it must meet.
fn broken_settings() -> Vec<Case> {
    use mwcap::conn::{BufClass, ConfigError, Keepalive};
    vec![
        (|c| c.buffers = 0, |e| matches!(e, ConfigError::NoBuffers { buffers: 0, .. })),
        (|c| c.buffer_size = 0, |e| matches!(e, ConfigError::NoBuffers { buffer_size: 0, .. })),
        (
            |c| c.large_buffers = vec![BufClass { size: c.buffer_size, count: 1 }],
            |e| matches!(e, ConfigError::LargeClassTooSmall { .. }),
        ),
        (
            |c| c.large_buffers = (1..=256).map(|i| BufClass { size: c.buffer_size + i, count: 1 }).collect(),
            |e| matches!(e, ConfigError::TooManyClasses { classes: 257 }),
        ),
        (|c| c.read_chunk = 0, |e| matches!(e, ConfigError::ZeroReadChunk)),
        (
            |c| c.ctrl_slots = 7,
            |e| matches!(e, ConfigError::BadStartCredits { start_credits: 8, ctrl_slots: 7 }),
        ),
        (
            |c| c.start_credits = 2,
            |e| matches!(e, ConfigError::BadStartCredits { start_credits: 2, ctrl_slots: 64 }),
        ),
        (|c| c.inline_max = 1025, |e| matches!(e, ConfigError::InlineTooLarge { inline_max: 1025 })),
        (|c| c.max_attempts = 0, |e| matches!(e, ConfigError::NoAttempts)),
        (|c| c.send_slots = Some(1), |e| matches!(e, ConfigError::TooFewSendSlots { send_slots: 1 })),
        // Deadlines past the clock's range (they panicked in a call, or in
        // the endpoint's driver): a year at most.
        (
            |c| c.call_timeout = Duration::MAX,
            |e| matches!(e, ConfigError::TimeTooLong { setting: "call_timeout", .. }),
        ),
        (
            |c| c.busy_poll = Duration::MAX,
            |e| matches!(e, ConfigError::TimeTooLong { setting: "busy_poll", .. }),
        ),
        (
            |c| c.serve_busy_poll = mwcap::conn::MAX_TIME_SETTING + Duration::from_secs(1),
            |e| matches!(e, ConfigError::TimeTooLong { setting: "serve_busy_poll", .. }),
        ),
        (
            |c| c.keepalive = Some(Keepalive { interval: Duration::from_secs(1), timeout: Duration::MAX }),
            |e| matches!(e, ConfigError::TimeTooLong { setting: "keepalive.timeout", .. }),
        ),
    ]
}

#[test]
fn settings_that_cannot_work_are_refused_with_the_field_to_change() {
    use mwcap::conn::{BufClass, SetupError};
    let base = Config::default();
    let mw = Policies::both(Policy::Mw);
    let cases = broken_settings();
    let fabric = Fabric::with_seed(3);
    let nic = fabric.add_device(DeviceConfig::spec());
    for (i, (break_it, expected)) in cases.into_iter().enumerate() {
        let mut cfg = base.clone();
        break_it(&mut cfg);
        match Link::new(nic.clone(), Role::Server, mw, cfg.clone()) {
            Err(SetupError::Config(e)) => {
                assert!(expected(&e), "case {i}: {e:?}");
                assert!(e.to_string().contains("Config::"), "case {i}: the message names the field: {e}");
            }
            Err(e) => panic!("case {i}: {e:?}"),
            Ok(_) => panic!("case {i}: accepted {cfg:?}"),
        }
    }
    // 255 large classes (256 in all) are fine, and so is the default.
    let mut cfg = base.clone();
    cfg.buffer_size = 64;
    cfg.large_buffers = (1..=255).map(|i| BufClass { size: 64 + i, count: 1 }).collect();
    assert_eq!(cfg.check(), Ok(()));
    Link::new(nic.clone(), Role::Server, mw, base).expect("the defaults work");
}

/// Under mw a reader READs only while more than its safety margin of a
/// lease is left: a lease at most the margin (which would decline every
/// payload), or longer than a grant carries, is refused when the
/// connection gets its policies. Under confirm the margin is not used and
/// a short lease is fine.
#[test]
fn a_lease_no_mw_reader_could_read_within_is_refused() {
    use mwcap::conn::{ConfigError, SetupError};
    let fabric = Fabric::with_seed(3);
    let nic = fabric.add_device(DeviceConfig::spec());
    let with_lease = |lease| {
        let mut c = Config::default();
        c.lease_time = lease;
        c
    };
    let short = with_lease(std::time::Duration::from_millis(20));
    let long = with_lease(mwcap_mw::MAX_LEASE_TIME + std::time::Duration::from_micros(1));
    for (role, policies, cfg, refused) in [
        (Role::Server, Policies::both(Policy::Mw), short.clone(), true),
        // A client reads replies: under mw it reads, under confirm it does not.
        (Role::Client, Policies { request: Policy::Confirm, reply: Policy::Mw }, short.clone(), true),
        (Role::Client, Policies { request: Policy::Mw, reply: Policy::Confirm }, short.clone(), false),
        (Role::Server, Policies::both(Policy::Confirm), short, false),
        (Role::Server, Policies::both(Policy::Mw), long, true),
    ] {
        match Link::new(nic.clone(), role, policies, cfg) {
            Err(SetupError::Config(e @ ConfigError::BadLeaseTime { .. })) if refused => {
                assert!(e.to_string().contains("Config::lease_time"), "{e}");
            }
            Ok(_) if !refused => {}
            Err(e) => panic!("{role:?} {policies:?}: {e}"),
            Ok(_) => panic!("{role:?} {policies:?}: accepted"),
        }
    }
}

/// Every way to connect checks the settings before it creates anything on
/// the device: an endpoint's (which `connect`, `accept` and
/// `connect_local` use) when it is built, plain, listening, with shared
/// receives or with shared buffers; a connection's own when
/// `Endpoint::prepare` gets them (then `Pending::local` and
/// `Pending::connect`).
#[test]
fn settings_that_cannot_work_are_refused_before_anything_is_created() {
    use mwcap::conn::{BufClass, EndpointBuilder, PolicyChoice, SetupError, SrqConfig};
    use mwcap::sim::SimNic;
    let fabric = Fabric::with_seed(4);
    let nic = fabric.add_device(DeviceConfig::spec());
    let dev = nic.device();
    let (good, _driver) = Endpoint::builder(nic.clone(), Auth::Unauthenticated).build().unwrap();
    type Way = fn(SimNic, Config) -> EndpointBuilder<SimNic>;
    let builders: [(&str, Way); 4] = [
        ("build", |n, c| Endpoint::builder(n, Auth::Unauthenticated).config(c)),
        ("build with listen", |n, c| {
            Endpoint::builder(n, Auth::Unauthenticated).config(c).listen("127.0.0.1:0".parse().unwrap())
        }),
        ("build with shared receives", |n, c| {
            Endpoint::builder(n, Auth::Unauthenticated)
                .config(c)
                .policy(PolicyChoice::Mw)
                .shared_receives(SrqConfig::default())
        }),
        ("build with shared buffers", |n, c| {
            Endpoint::builder(n, Auth::Unauthenticated)
                .config(c)
                .policy(PolicyChoice::Mw)
                .shared_buffers(&[BufClass { size: 4096, count: 8 }])
        }),
    ];
    for (i, (break_it, expected)) in broken_settings().into_iter().enumerate() {
        let mut cfg = Config::default();
        break_it(&mut cfg);
        for (way, make) in builders {
            let before = fabric.created(dev);
            match make(nic.clone(), cfg.clone()).build() {
                Err(SetupError::Config(e)) => assert!(expected(&e), "case {i}, {way}: {e:?}"),
                Err(e) => panic!("case {i}, {way}: {e:?}"),
                Ok(_) => panic!("case {i}, {way}: accepted {cfg:?}"),
            }
            assert_eq!(fabric.created(dev), before, "case {i}, {way}: created something first");
        }
        let before = fabric.created(dev);
        match good.prepare(Role::Client, Policies::both(Policy::Mw), cfg.clone()) {
            Err(SetupError::Config(e)) => assert!(expected(&e), "case {i}, prepare: {e:?}"),
            Err(e) => panic!("case {i}, prepare: {e:?}"),
            Ok(_) => panic!("case {i}, prepare: accepted {cfg:?}"),
        }
        assert_eq!(fabric.created(dev), before, "case {i}, prepare: created something first");
    }
    // The counts do move when a way to connect creates something.
    let before = fabric.created(dev);
    let pending = good.prepare(Role::Client, Policies::both(Policy::Mw), Config::default()).unwrap();
    assert!(fabric.created(dev).qps > before.qps);
    drop(pending);
}
