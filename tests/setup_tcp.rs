//! Connecting endpoints over TCP with a policy choice (mw, confirm, auto),
//! on simulated NICs: auto picks per direction from each owner's probe.

use std::net::TcpListener;
use std::time::Duration;

use mwcap::bootstrap::{Auth, Key, Policy};
use mwcap::conn::{accept, connect, Config, Event, Policies, PolicyChoice, Role, SetupError};
use mwcap::sim::{DeviceConfig, Fabric, MwSupport};

const T: Duration = Duration::from_secs(5);

fn key() -> Auth {
    Auth::Key(Key::from_bytes(b"setup_tcp's shared test key".to_vec()).unwrap())
}

/// One side's outcome.
type Setup = Result<mwcap::conn::Connected<mwcap::sim::SimNic>, SetupError>;

fn pair(
    client_dev: DeviceConfig,
    server_dev: DeviceConfig,
    cc: PolicyChoice,
    sc: PolicyChoice,
) -> (Fabric, Setup, Setup) {
    let fabric = Fabric::with_seed(9);
    let cn = fabric.add_device(client_dev.named("client"));
    let sn = fabric.add_device(server_dev.named("server"));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        accept(sn, &listener, Config::new(Role::Server, Policies::both(Policy::Mw)), sc, &key(), T)
    });
    let client = connect(cn, addr, Config::new(Role::Client, Policies::both(Policy::Mw)), cc, &key(), T);
    (fabric, client, server.join().unwrap())
}

#[test]
fn auto_picks_per_direction_from_each_owners_probe() {
    // The client's NIC has working windows; the server's advertises them but
    // cannot allocate (like bnxt_re): requests go under mw, replies under confirm.
    let (fabric, c, s) = pair(
        DeviceConfig::spec(),
        DeviceConfig::spec().with_mw(MwSupport::AdvertisedNoAlloc),
        PolicyChoice::Auto,
        PolicyChoice::Auto,
    );
    let (mut c, mut s) = (c.expect("client"), s.expect("server"));
    let want = Policies { request: Policy::Mw, reply: Policy::Confirm };
    assert_eq!((c.policies, s.policies), (want, want));

    // And a call with payloads both ways works over the negotiated policies.
    let mut b = c.endpoint.alloc().unwrap();
    b.copy_from(b"over tcp bootstrap").unwrap();
    let call = c.endpoint.call(fabric.now(), b"h", Some(b)).unwrap();
    let mut cev = Vec::new();
    let mut sev = Vec::new();
    let mut replied = false;
    for _ in 0..10_000 {
        let now = fabric.now();
        for ep in [&mut c.endpoint, &mut s.endpoint] {
            ep.handle_timeout(now);
            ep.drive(now);
        }
        while let Some(e) = s.endpoint.poll_event() {
            sev.push(e);
        }
        while let Some(e) = c.endpoint.poll_event() {
            cev.push(e);
        }
        if !replied {
            if let Some(Event::Request { req, data: Some(d), .. }) = sev.pop() {
                assert_eq!(d.to_vec(), b"over tcp bootstrap");
                s.endpoint.free(d);
                let mut out = s.endpoint.alloc().unwrap();
                out.copy_from(b"reply").unwrap();
                s.endpoint.reply(now, req, 0, b"r", Some(out)).unwrap();
                replied = true;
            }
        }
        if cev.iter().any(|e| matches!(e, Event::Reply { .. })) {
            break;
        }
    }
    let reply = cev.iter().find_map(|e| match e {
        Event::Reply { call: id, data: Some(d), .. } if *id == call => Some(d.to_vec()),
        _ => None,
    });
    assert_eq!(reply.as_deref(), Some(&b"reply"[..]));
}

#[test]
fn explicit_choices_are_honoured_and_confirm_everywhere_works_without_windows() {
    let (_f, c, s) = pair(
        DeviceConfig::spec().with_mw(MwSupport::None),
        DeviceConfig::spec().with_mw(MwSupport::None),
        PolicyChoice::Confirm,
        PolicyChoice::Auto,
    );
    let want = Policies::both(Policy::Confirm);
    assert_eq!((c.unwrap().policies, s.unwrap().policies), (want, want));
}

#[test]
fn asking_for_mw_on_a_nic_without_working_windows_is_a_clear_error() {
    let fabric = Fabric::with_seed(1);
    let nic = fabric.add_device(DeviceConfig::spec().with_mw(MwSupport::AllocNoBind).named("mana0"));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = Config::new(Role::Client, Policies::both(Policy::Mw));
    let err = connect(nic, addr, cfg, PolicyChoice::Mw, &Auth::Unauthenticated, T)
        .err()
        .expect("must fail before connecting");
    let msg = err.to_string();
    assert!(matches!(err, SetupError::MwUnusable { .. }), "{msg}");
    assert!(msg.contains("mana0") && msg.contains("use confirm or auto"), "{msg}");
}
