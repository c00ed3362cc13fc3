//! Connecting endpoints over TCP with a policy choice (mw, confirm, auto),
//! on simulated NICs: auto picks per direction from each owner's probe.

#![cfg(not(loom))]

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, Key, Policy};
use mwcap::conn::{Connection, Endpoint, EndpointDriver, Policies, PolicyChoice, SetupError};
use mwcap::sim::{DeviceConfig, Fabric, MwSupport, SimNic};

const T: Duration = Duration::from_secs(5);

fn key() -> Auth {
    Auth::Key(Key::from_bytes(b"setup_tcp's shared test key".to_vec()).unwrap())
}

/// One side's outcome.
type Setup = Result<Connection<SimNic>, SetupError>;

/// The endpoint, its driver spawned on `pool`.
fn driven(pool: &LocalPool, (ep, driver): (Endpoint<SimNic>, EndpointDriver<SimNic>)) -> Endpoint<SimNic> {
    pool.spawner()
        .spawn_local(async move {
            driver.run().await;
        })
        .unwrap();
    ep
}

/// A client endpoint choosing `cc` connects to a listening one choosing
/// `sc`; the pool runs both endpoints' drivers.
fn pair(
    client_dev: DeviceConfig,
    server_dev: DeviceConfig,
    cc: PolicyChoice,
    sc: PolicyChoice,
) -> (LocalPool, Setup, Setup) {
    let fabric = Fabric::with_seed(9);
    let cn = fabric.add_device(client_dev.named("client"));
    let sn = fabric.add_device(server_dev.named("server"));
    let mut pool = LocalPool::new();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = Endpoint::builder(sn, key()).policy(sc).handshake_timeout(T).listen(any).build();
    let server = driven(&pool, server.expect("a listening endpoint"));
    let client = driven(&pool, Endpoint::builder(cn, key()).policy(cc).handshake_timeout(T).build().unwrap());
    let addr = server.local_addr().unwrap();
    let (s, c) = pool.run_until(async { futures::join!(server.accept(), client.connect(addr)) });
    (pool, c, s)
}

#[test]
fn auto_picks_per_direction_from_each_owners_probe() {
    // The client's NIC has working windows; the server's advertises them but
    // cannot allocate (like bnxt_re): requests go under mw, replies under confirm.
    let (mut pool, c, s) = pair(
        DeviceConfig::spec(),
        DeviceConfig::spec().with_mw(MwSupport::AdvertisedNoAlloc),
        PolicyChoice::Auto,
        PolicyChoice::Auto,
    );
    let (c, s) = (c.expect("client"), s.expect("server"));
    let want = Policies { request: Policy::Mw, reply: Policy::Confirm };
    assert_eq!((c.policies(), s.policies()), (want, want));

    // And a call with payloads both ways works over the negotiated policies.
    let reply = pool.run_until(async {
        let serve = async {
            let req = s.next_request().await.expect("a request");
            assert_eq!(req.data.as_ref().map(|d| d.to_vec()).as_deref(), Some(&b"over tcp bootstrap"[..]));
            drop(req.data);
            let mut out = s.alloc().await.unwrap();
            out.copy_from(b"reply").unwrap();
            s.reply(req.id, 0, b"r", Some(out)).await.expect("replied");
        };
        let call = async {
            let mut b = c.alloc().await.unwrap();
            b.copy_from(b"over tcp bootstrap").unwrap();
            c.call(b"h", Some(b)).await.expect("a reply")
        };
        futures::join!(serve, call).1
    });
    assert_eq!(reply.data.as_deref(), Some(&b"reply"[..]));
}

#[test]
fn explicit_choices_are_honoured_and_confirm_everywhere_works_without_windows() {
    let (_pool, c, s) = pair(
        DeviceConfig::spec().with_mw(MwSupport::None),
        DeviceConfig::spec().with_mw(MwSupport::None),
        PolicyChoice::Confirm,
        PolicyChoice::Auto,
    );
    let want = Policies::both(Policy::Confirm);
    assert_eq!((c.unwrap().policies(), s.unwrap().policies()), (want, want));
}

#[test]
fn asking_for_mw_on_a_nic_without_working_windows_is_a_clear_error() {
    let fabric = Fabric::with_seed(1);
    let nic = fabric.add_device(DeviceConfig::spec().with_mw(MwSupport::AllocNoBind).named("mana0"));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut pool = LocalPool::new();
    let client = driven(
        &pool,
        Endpoint::builder(nic, Auth::Unauthenticated)
            .policy(PolicyChoice::Mw)
            .handshake_timeout(T)
            .build()
            .unwrap(),
    );
    let err = pool.run_until(client.connect(addr)).err().expect("must fail before connecting");
    let msg = err.to_string();
    assert!(matches!(err, SetupError::MwUnusable { .. }), "{msg}");
    assert!(msg.contains("mana0") && msg.contains("use confirm or auto"), "{msg}");
    // It failed before it dialled: no connection waits at the listener.
    listener.set_nonblocking(true).unwrap();
    assert_eq!(listener.accept().err().map(|e| e.kind()), Some(std::io::ErrorKind::WouldBlock));
}
