//! The async `Endpoint` on simulated NICs over localhost TCP: one way to
//! connect (`Endpoint::connect`) and one to accept (`Endpoint::accept`),
//! every connection on the endpoint's one completion queue and driver, and
//! each connection's bootstrap stream kept and watched by the endpoint.

#![cfg(not(loom))]

mod util;

use std::net::SocketAddr;
use std::time::Duration;

use futures::executor::{LocalPool, LocalSpawner};
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, Key};
use mwcap::conn::{
    BufClass, CallError, Config, ConfigError, Connection, Endpoint, EndpointDriver, LossReason, Policies,
    Policy, PolicyChoice, SetupError, SrqConfig,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

fn auth() -> Auth {
    Auth::Key(Key::from_bytes(b"endpoint_async's shared test key".to_vec()).unwrap())
}

fn small() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 4096;
    c
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Reverse each request's payload into the reply's, until the connection
/// is down.
async fn reverse(conn: Connection<SimNic>) {
    while let Some(req) = conn.next_request().await {
        let mut bytes = req.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
        drop(req.data);
        bytes.reverse();
        let out = if bytes.is_empty() {
            None
        } else {
            let Ok(mut out) = conn.alloc().await else { return };
            out.copy_from(&bytes).unwrap();
            Some(out)
        };
        if conn.reply(req.id, 0, &req.header, out).await.is_err() {
            return;
        }
    }
}

/// Run an endpoint's driver on `sp`.
fn spawn_driver(sp: &LocalSpawner, drv: EndpointDriver<SimNic>) {
    sp.spawn_local(async move {
        drv.run().await;
    })
    .unwrap();
}

fn wait(pool: &mut LocalPool, f: impl FnMut() -> bool) -> bool {
    util::wait_for(pool, Duration::from_secs(10), f)
}

/// Three clients connect to one listening endpoint and call it; every
/// connection on each side is on its endpoint's one completion queue.
#[test]
fn clients_connect_to_a_listening_endpoint_and_call_it() {
    let fabric = Fabric::with_seed(31);
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let mut pool = LocalPool::new();
    let sp = pool.spawner();
    let (server, sdrv) = Endpoint::builder(sn, auth()).config(small()).listen(any_port()).build().unwrap();
    let (client, cdrv) = Endpoint::builder(cn, auth()).config(small()).build().unwrap();
    spawn_driver(&sp, sdrv);
    spawn_driver(&sp, cdrv);
    let addr = server.local_addr().expect("it listens");
    let s2 = server.clone();
    let sp2 = sp.clone();
    sp.spawn_local(async move {
        while let Ok(conn) = s2.accept().await {
            sp2.spawn_local(reverse(conn)).unwrap();
        }
    })
    .unwrap();
    let done = std::rc::Rc::new(std::cell::Cell::new(0));
    for i in 0..3u8 {
        let (client, done) = (client.clone(), done.clone());
        sp.spawn_local(async move {
            let conn = client.connect(addr).await.expect("connected");
            for k in 0..5u8 {
                let mut b = conn.alloc().await.unwrap();
                b.copy_from(&[i, k, 1, 2, 3]).unwrap();
                let r = conn.call(&[i], Some(b)).await.expect("a reply");
                assert_eq!(r.data.as_deref(), Some(&[3, 2, 1, k, i][..]), "client {i} call {k}");
            }
            conn.close();
            done.set(done.get() + 1);
        })
        .unwrap();
    }
    assert!(wait(&mut pool, || done.get() == 3), "every client made its calls");
    assert_eq!(client.stats().added, 3, "the client side's connections share its one hub");
    assert_eq!(server.stats().added, 3);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// Nothing the application keeps holds a connection up or lets it down:
/// the endpoint keeps the bootstrap stream, so a client that keeps only its
/// `Connection` stays up, and the server sees `PeerGone` when the client's
/// process (here: its endpoint and driver) goes away.
#[test]
fn the_endpoint_keeps_each_bootstrap_stream_and_a_peer_that_goes_is_seen() {
    let fabric = Fabric::with_seed(32);
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let mut pool = LocalPool::new();
    let sp = pool.spawner();
    let (server, sdrv) = Endpoint::builder(sn, auth()).config(small()).listen(any_port()).build().unwrap();
    spawn_driver(&sp, sdrv);
    let addr = server.local_addr().unwrap();
    let accepted = std::rc::Rc::new(std::cell::RefCell::new(None));
    let a2 = accepted.clone();
    let s2 = server.clone();
    sp.spawn_local(async move {
        let conn = s2.accept().await.expect("accepted");
        *a2.borrow_mut() = Some(conn.clone());
        reverse(conn).await;
    })
    .unwrap();
    // The client runs on a thread of its own, as another process would.
    let (tx, rx) = std::sync::mpsc::channel();
    let client = std::thread::spawn(move || {
        let (ep, drv) = Endpoint::builder(cn, auth()).config(small()).build().unwrap();
        let mut pool = LocalPool::new();
        spawn_driver(&pool.spawner(), drv);
        let conn = pool.run_until(ep.connect(addr)).expect("connected");
        drop(ep); // only the connection is kept
        pool.run_until(async_io::Timer::after(Duration::from_millis(200)));
        let r = pool.run_until(conn.call(b"x", None)).expect("still up without the endpoint handle");
        tx.send(r.status).unwrap();
        // The process "dies": its pool (driver included) and connection go.
    });
    // The server's side runs on this thread's pool meanwhile.
    let mut status = None;
    assert!(wait(&mut pool, || {
        status = status.or(rx.try_recv().ok());
        status.is_some() && client.is_finished()
    }));
    assert_eq!(status, Some(0), "the call was answered");
    client.join().unwrap();
    assert!(wait(&mut pool, || accepted.borrow().as_ref().is_some_and(|c| c.is_down().is_some())));
    let conn = accepted.borrow().clone().unwrap();
    assert_eq!(conn.is_down(), Some(LossReason::PeerGone), "the server saw its peer go");
}

/// An application that learns by its own means that the peer is gone
/// says so (`Connection::peer_gone`): the connection closes, calls fail,
/// and it ends, each with `PeerGone`, not `Closed`. (The peer learns of it
/// as of any close: from the bootstrap stream, none between these two
/// endpoints, from keepalive, or when it next sends.)
#[test]
fn a_peer_the_application_says_is_gone_fails_calls_and_ends_as_peer_gone() {
    let fabric = Fabric::with_seed(34);
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let endpoint = |nic| Endpoint::builder(nic, Auth::Unauthenticated).config(small()).build().unwrap();
    let ((ce, cdrv), (se, sdrv)) = (endpoint(cn), endpoint(sn));
    let (client, server) = ce.connect_local(&se, Policies::both(Policy::Mw)).unwrap();
    let mut pool = LocalPool::new();
    let sp = pool.spawner();
    for drv in [cdrv, sdrv] {
        spawn_driver(&sp, drv);
    }
    sp.spawn_local(reverse(server.clone())).unwrap();
    let r = pool.run_until(client.call(b"x", None)).expect("a call while the peer is there");
    assert_eq!(r.status, 0);
    client.peer_gone();
    let err = pool.run_until(client.call(b"y", None)).expect_err("the connection is closed");
    assert_eq!(err, CallError::ConnectionLost(LossReason::PeerGone), "{err}");
    assert_eq!(pool.run_until(client.finished()), LossReason::PeerGone);
    assert_eq!(client.is_down(), Some(LossReason::PeerGone));
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A server's user that is slow to answer holds at most
/// `Config::max_requests` requests of a connection: the next call fails at
/// once with `CallError::Busy`, saying what to do, and the connection goes
/// on; once the held request is answered, calls go through again.
#[test]
fn a_call_past_the_servers_max_requests_fails_as_busy_and_the_connection_goes_on() {
    let fabric = Fabric::with_seed(35);
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let endpoint = |nic, max_requests| {
        let mut cfg = small();
        cfg.max_requests = max_requests;
        Endpoint::builder(nic, Auth::Unauthenticated).config(cfg).build().unwrap()
    };
    let ((ce, cdrv), (se, sdrv)) = (endpoint(cn, 1024), endpoint(sn, 1));
    let (client, server) = ce.connect_local(&se, Policies::both(Policy::Confirm)).unwrap();
    let mut pool = LocalPool::new();
    let sp = pool.spawner();
    for drv in [cdrv, sdrv] {
        spawn_driver(&sp, drv);
    }
    let first = {
        let client = client.clone();
        sp.spawn_local_with_handle(async move { client.call(b"first", None).await }).unwrap()
    };
    let held = pool.run_until(server.next_request()).expect("the first request");
    assert_eq!(&held.header[..], b"first");
    let err = pool.run_until(client.call(b"second", None)).expect_err("one request is held");
    assert_eq!(err, CallError::Busy { limit: 1 });
    let msg = err.to_string();
    assert!(msg.contains("Config::max_requests") && msg.contains("retry"), "{msg}");
    pool.run_until(server.reply(held.id, 0, b"one", None)).expect("reply");
    assert_eq!(&pool.run_until(first).expect("the first call").header[..], b"one");
    sp.spawn_local(reverse(server.clone())).unwrap();
    let r = pool.run_until(client.call(b"third", None)).expect("room again");
    assert_eq!(&r.header[..], b"third");
    assert_eq!(server.stats().requests_busy, 1);
    assert!(client.is_down().is_none() && server.is_down().is_none());
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// `accept` on an endpoint that does not listen says so; one that stops
/// listening ends its accept loop; sharing needs the mw policy.
#[test]
fn accept_without_listening_stop_listening_and_sharing_say_what_to_do() {
    let fabric = Fabric::with_seed(33);
    let nic = fabric.add_device(DeviceConfig::spec());
    let mut pool = LocalPool::new();
    let (client, _drv) = Endpoint::builder(nic.clone(), auth()).build().unwrap();
    let e = pool.run_until(client.accept()).err().unwrap();
    assert!(matches!(e, SetupError::NotListening), "{e}");
    assert!(e.to_string().contains("EndpointBuilder::listen"), "{e}");
    let (server, _sdrv) = Endpoint::builder(nic.clone(), auth()).listen(any_port()).build().unwrap();
    let s2 = server.clone();
    let waiting = pool.spawner().spawn_local_with_handle(async move { s2.accept().await.err() }).unwrap();
    pool.run_until_stalled();
    server.stop_listening();
    let e = pool.run_until(waiting).expect("the waiting accept ended");
    assert!(matches!(e, SetupError::ListenerClosed), "{e}");
    assert!(matches!(pool.run_until(server.accept()), Err(SetupError::ListenerClosed)));
    let shared = Endpoint::builder(nic, auth())
        .policy(PolicyChoice::Auto)
        .shared_buffers(&[BufClass { size: 4096, count: 8 }])
        .shared_receives(SrqConfig::default())
        .build();
    let e = shared.err().expect("refused");
    assert!(
        matches!(e, SetupError::Config(ConfigError::SharingNeedsMw { choice: PolicyChoice::Auto })),
        "{e}"
    );
}
