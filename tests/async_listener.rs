//! The async setup through `Endpoint` on simulated NICs: a listening
//! endpoint runs many handshakes at once (silent and wrong-key clients do
//! not hold up good ones), the capability probe runs once per device
//! however many clients connect, stopping to listen ends the accept loop
//! and the handshakes in progress, and `Reconnecting` comes back after the
//! server went away, backing off.

#![cfg(not(loom))]

mod util;

use std::future::Future;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::executor::LocalPool;
use futures::future::join_all;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, BootstrapError, Key};
use mwcap::conn::{
    Backoff, Config, Connection, Endpoint, EndpointBuilder, EndpointDriver, LossReason, Policies, Policy,
    PolicyChoice, ProbeCache, ReconnectError, Reconnecting, SetupError,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

fn key(text: &str) -> Auth {
    Auth::Key(Key::from_bytes(text.as_bytes().to_vec()).unwrap())
}

const KEY: &str = "async_listener's shared test key";

/// Small connections: many of them live at once.
fn cfg() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 4096;
    c
}

/// An endpoint on `nic` with the key `text`, the policy `choice` and small
/// connections.
fn builder(nic: SimNic, text: &str, choice: PolicyChoice) -> EndpointBuilder<SimNic> {
    Endpoint::builder(nic, key(text)).policy(choice).config(cfg())
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Spawn `f` on `pool`, its output dropped.
fn spawn<T: 'static>(pool: &LocalPool, f: impl std::future::Future<Output = T> + 'static) {
    pool.spawner()
        .spawn_local(async move {
            f.await;
        })
        .unwrap();
}

/// The endpoint, its driver spawned on `pool`.
fn driven(pool: &LocalPool, (ep, driver): (Endpoint<SimNic>, EndpointDriver<SimNic>)) -> Endpoint<SimNic> {
    spawn(pool, driver.run());
    ep
}

/// Answer every request with its header, until the connection is down.
async fn echo(conn: Connection<SimNic>) {
    while let Some(req) = conn.next_request().await {
        let header = req.header.clone();
        if let Some(d) = req.data {
            conn.free(d);
        }
        if conn.reply(req.id, 0, &header, None).await.is_err() {
            break;
        }
    }
}

/// What the server reports for each finished handshake.
type Outcome = Result<(), String>;

/// A server thread: the listening endpoint `server` (its driver `driver`)
/// serving every client with `echo` on a `LocalPool`, reporting each
/// handshake's outcome on `out`, until it stops listening.
fn serve(
    server: Endpoint<SimNic>,
    driver: EndpointDriver<SimNic>,
    out: mpsc::Sender<Outcome>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut pool = LocalPool::new();
        spawn(&pool, driver.run());
        let spawner = pool.spawner();
        let accept_loop = async move {
            loop {
                let outcome = match server.accept().await {
                    Ok(conn) => {
                        spawner.spawn_local(echo(conn)).unwrap();
                        Ok(())
                    }
                    Err(SetupError::ListenerClosed) => return,
                    Err(e) => Err(format!("{e:?}")),
                };
                if out.send(outcome).is_err() {
                    return;
                }
            }
        };
        pool.run_until(accept_loop);
    })
}

/// Run `pool` until `f` holds (a wall-time limit: the handshakes are real TCP).
fn wait(pool: &mut LocalPool, f: impl FnMut() -> bool) -> bool {
    util::wait_for(pool, Duration::from_secs(20), f)
}

#[test]
fn silent_and_wrong_key_clients_do_not_hold_up_good_ones() {
    let fabric = Fabric::with_seed(21);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let timeout = Duration::from_secs(3);
    let (server, sd) = builder(server_nic, KEY, PolicyChoice::Auto)
        .handshake_timeout(timeout)
        .listen(any_port())
        .build()
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let _server = serve(server, sd, tx);

    // Ten clients connect and say nothing; they are first in the queue.
    let silent: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let started = Instant::now();
    let mut pool = LocalPool::new();
    let good = driven(
        &pool,
        builder(client_nic.clone(), KEY, PolicyChoice::Auto).handshake_timeout(timeout).build().unwrap(),
    );
    let bad = driven(
        &pool,
        builder(client_nic, "a wrong key for this server", PolicyChoice::Confirm)
            .handshake_timeout(timeout)
            .build()
            .unwrap(),
    );
    let clients = async {
        let good = (0..30).map(|i| {
            let good = good.clone();
            async move {
                let conn = good.connect(addr).await?;
                let r = conn.call(format!("client {i}").as_bytes(), None).await;
                conn.close();
                Ok::<_, SetupError>((r.map(|r| r.header), started.elapsed()))
            }
        });
        let bad = (0..10).map(|_| bad.connect(addr));
        futures::join!(join_all(good), join_all(bad))
    };
    let (good, bad) = pool.run_until(clients);
    for (i, g) in good.into_iter().enumerate() {
        let (reply, at) = g.expect("a client with the key connects");
        assert_eq!(reply.expect("its call is answered"), format!("client {i}").as_bytes());
        assert!(at < timeout, "client {i} took {at:?}: held up by the silent ones");
    }
    for b in bad {
        let e = b.err().expect("a wrong key is refused");
        assert!(matches!(e, SetupError::Bootstrap(BootstrapError::AuthRejected { .. })), "{e:?}");
    }
    // The server saw 30 connections and 10 refusals while the silent
    // clients' handshakes stayed in progress.
    let seen: Vec<Outcome> = (0..40).map(|_| rx.recv_timeout(timeout).unwrap()).collect();
    assert_eq!(seen.iter().filter(|o| o.is_ok()).count(), 30);
    assert!(seen.iter().filter_map(|o| o.as_ref().err()).all(|e| e.contains("AuthFailed")), "{seen:?}");

    // Then the silent ones time out, each with a typed error.
    for _ in 0..10 {
        let e = rx.recv_timeout(2 * timeout).unwrap().expect_err("a silent client never connects");
        assert!(e.contains("TimedOut") && e.contains("Auth"), "{e}");
    }
    assert!(started.elapsed() >= timeout);
    drop(silent);
}

#[test]
fn the_probe_runs_once_per_device_across_many_accepts() {
    let fabric = Fabric::with_seed(22);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let (server_probes, client_probes) = (ProbeCache::new(), ProbeCache::new());
    let (server, sd) = builder(server_nic, KEY, PolicyChoice::Auto)
        .probe_cache(server_probes.clone())
        .listen(any_port())
        .build()
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let _server = serve(server, sd, tx);

    let mut pool = LocalPool::new();
    let client = driven(
        &pool,
        builder(client_nic, KEY, PolicyChoice::Auto).probe_cache(client_probes.clone()).build().unwrap(),
    );
    pool.run_until(async {
        for _ in 0..20 {
            let conn = client.connect(addr).await.expect("connects");
            let s = conn.stats();
            assert!(s.lease_owner.is_some() && s.lease_reader.is_some(), "auto picks mw on a spec device");
            conn.close();
            assert_eq!(conn.closed().await, LossReason::Closed);
        }
    });
    for _ in 0..20 {
        rx.recv_timeout(Duration::from_secs(5)).unwrap().expect("the server connects each");
    }
    assert_eq!(server_probes.probes_run(), 1, "one probe for the server's device");
    assert_eq!(client_probes.probes_run(), 1, "one probe for the client's device");
    assert!(server_probes.cached("server").is_some_and(|r| r.mw_usable));
    assert!(server_probes.cached("client").is_none());

    // A re-probe is explicit, and forgetting makes the next asker probe.
    server_probes.reprobe(&fabric.add_device(DeviceConfig::spec().named("server")));
    assert_eq!(server_probes.probes_run(), 2);
    client_probes.forget("client");
    assert!(client_probes.cached("client").is_none());
}

/// Endpoints built with a probe cache of their own each probe their
/// device as they are built; endpoints that share one probe it once
/// between them, and a client endpoint probes once however often it connects.
#[test]
fn endpoints_sharing_a_probe_cache_probe_once_and_fresh_caches_each_probe() {
    let fabric = Fabric::with_seed(23);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let mut pool = LocalPool::new();
    let (shared, client_probes) = (ProbeCache::new(), ProbeCache::new());
    let mut fresh_probes = 0;
    let client = driven(
        &pool,
        builder(client_nic, KEY, PolicyChoice::Auto).probe_cache(client_probes.clone()).build().unwrap(),
    );
    let mut policies = Vec::new();
    for i in 0..8 {
        // The first three with a cache of their own, the other five sharing one.
        let probes = if i < 3 { ProbeCache::new() } else { shared.clone() };
        let built = builder(server_nic.clone(), KEY, PolicyChoice::Auto)
            .probe_cache(probes.clone())
            .listen(any_port())
            .build()
            .unwrap();
        if i < 3 {
            fresh_probes += probes.probes_run();
        }
        let server = driven(&pool, built);
        let addr = server.local_addr().unwrap();
        let (s, c) = pool.run_until(async { futures::join!(server.accept(), client.connect(addr)) });
        policies.push((s.expect("accepted").policies(), c.expect("connected").policies()));
    }
    assert!(policies.iter().all(|&(s, c)| s == Policies::both(Policy::Mw) && c == s), "{policies:?}");
    assert_eq!(fresh_probes, 3, "a probe per endpoint with a cache of its own");
    assert_eq!(shared.probes_run(), 1, "five endpoints, one probe");
    assert_eq!(client_probes.probes_run(), 1, "eight connects, one probe");
}

#[test]
fn an_mw_endpoint_on_a_device_without_windows_fails_at_build() {
    let fabric = Fabric::with_seed(24);
    let nic = fabric.add_device(DeviceConfig::spec().with_mw(mwcap::sim::MwSupport::None).named("nomw"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let e = builder(nic.clone(), KEY, PolicyChoice::Mw)
        .listen(any_port())
        .build()
        .err()
        .expect("mw cannot be served");
    assert!(matches!(e, SetupError::MwUnusable { .. }), "{e:?}");
    let mut pool = LocalPool::new();
    let server = driven(
        &pool,
        builder(nic, KEY, PolicyChoice::Auto).listen(any_port()).build().expect("auto falls back to confirm"),
    );
    let client = driven(&pool, builder(client_nic, KEY, PolicyChoice::Auto).build().unwrap());
    let addr = server.local_addr().unwrap();
    let (s, c) = pool.run_until(async { futures::join!(server.accept(), client.connect(addr)) });
    let (s, c) = (s.expect("accepted"), c.expect("connected"));
    // The server serves confirm only: it owns no window, its client reads none.
    assert!(s.stats().lease_owner.is_none() && c.stats().lease_reader.is_none());
}

#[test]
fn where_a_peer_reaches_other_connections_windows_mw_is_served_only_to_trusted_peers() {
    // On rxe (and the sim's rxe mode) a SEND_WITH_INV received on any queue
    // pair invalidates any window of the device, and a second invalidation
    // panics the kernel: the probe sees it, `mw` is refused and `auto`
    // serves confirm, unless the peers are trusted.
    let fabric = Fabric::with_seed(26);
    let nic = fabric.add_device(DeviceConfig::rxe().named("rxe0"));
    let client_nic = fabric.add_device(DeviceConfig::rxe().named("rxe1"));
    let e = builder(nic.clone(), KEY, PolicyChoice::Mw).listen(any_port()).build().err().expect("refused");
    assert!(matches!(e, SetupError::MwUnsafe { .. }), "{e:?}");
    assert!(e.to_string().contains("trusted_peers(true)"), "the error says what to do: {e}");
    let mut pool = LocalPool::new();
    for trusted in [false, true] {
        let server = driven(
            &pool,
            builder(nic.clone(), KEY, PolicyChoice::Auto)
                .trusted_peers(trusted)
                .listen(any_port())
                .build()
                .unwrap(),
        );
        let client = driven(
            &pool,
            builder(client_nic.clone(), KEY, PolicyChoice::Auto).trusted_peers(trusted).build().unwrap(),
        );
        let addr = server.local_addr().unwrap();
        let (s, c) = pool.run_until(async { futures::join!(server.accept(), client.connect(addr)) });
        let (s, c) = (s.expect("accepted"), c.expect("connected"));
        let want = if trusted { Policy::Mw } else { Policy::Confirm };
        assert_eq!(s.policies(), Policies::both(want), "trusted peers: {trusted}");
        assert_eq!(c.policies(), Policies::both(want), "trusted peers: {trusted}");
    }
}

#[test]
fn a_reconnecting_client_comes_back_after_the_server_went_away() {
    let fabric = Fabric::with_seed(25);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let listening =
        move |addr| builder(server_nic.clone(), KEY, PolicyChoice::Confirm).listen(addr).build().unwrap();
    let first = listening(any_port());
    let addr = first.0.local_addr().unwrap();
    let (go_down, down) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let serve_one = |endpoint: (Endpoint<SimNic>, EndpointDriver<SimNic>),
                         until: Option<&mpsc::Receiver<()>>| {
            let mut pool = LocalPool::new();
            let server = driven(&pool, endpoint);
            pool.run_until(async {
                let conn = server.accept().await.expect("the client connects");
                match until {
                    Some(rx) => {
                        let stop = blocking_recv(rx);
                        futures::future::select(Box::pin(echo(conn.clone())), Box::pin(stop)).await;
                        // The server goes away: its connection, bootstrap stream and listener.
                        conn.close();
                        conn.closed().await;
                    }
                    None => echo(conn).await,
                }
            });
            // The endpoint, its driver and the streams it watched go with the pool.
        };
        serve_one(first, Some(&down));
        // Down for a while: the client's attempts are refused meanwhile.
        std::thread::sleep(Duration::from_millis(700));
        serve_one(listening(addr), None);
    });

    let backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(160)).jitter(0.0);
    let mut pool = LocalPool::new();
    let endpoint = driven(
        &pool,
        builder(client_nic, KEY, PolicyChoice::Confirm)
            .handshake_timeout(Duration::from_secs(2))
            .build()
            .unwrap(),
    );
    let (client, supervisor) = Reconnecting::new(endpoint, addr, backoff);
    let app = async {
        let c = client.connection().await.expect("connects");
        assert_eq!(c.call(b"first", None).await.expect("answered").header, b"first");
        go_down.send(()).unwrap();
        c.closed().await;
        // While down, current() fails fast.
        let e = client.current().err().expect("down");
        assert!(matches!(e, ReconnectError::Down { .. }), "{e:?}");
        // The server stays away for 700 ms: the attempts meanwhile are
        // refused and the waits between them double (jitter is off).
        async_io::Timer::after(Duration::from_millis(300)).await;
        let waits: Vec<u64> = client.stats().waits.iter().map(|d| d.as_millis() as u64).collect();
        assert!(waits.len() >= 2 && waits[..2] == [20, 40], "{waits:?}");
        assert!(waits.windows(2).all(|w| w[1] == (w[0] * 2).min(160)), "{waits:?}");
        let e = client.current().err().expect("still down");
        assert!(matches!(e, ReconnectError::Down { failures: 2.., last: Some(_) }), "{e:?}");
        let c = client.connection().await.expect("reconnects");
        assert_eq!(c.call(b"second", None).await.expect("answered").header, b"second");
        let stats = client.stats();
        client.stop();
        stats
    };
    let (stats, end) = pool.run_until(futures::future::join(app, supervisor));
    assert!(matches!(end, ReconnectError::Stopped), "{end:?}");
    server.join().unwrap();
    assert_eq!(stats.connects, 2);
    assert!(stats.failures >= 3, "refused while the server was down: {stats:?}");
    assert_eq!(stats.last_loss, Some(LossReason::PeerGone), "the server went away");
    assert!(stats.waits.is_empty(), "cleared once connected again");
}

#[test]
fn backoff_grows_to_its_cap_with_jitter_below_the_ceiling() {
    let b = Backoff::new(Duration::from_millis(20), Duration::from_millis(160));
    let ceilings: Vec<u64> = (1..=6).map(|n| b.ceiling(n).as_millis() as u64).collect();
    assert_eq!(ceilings, [20, 40, 80, 160, 160, 160]);
    let mut rng = rand::rngs::mock::StepRng::new(u64::MAX / 2, 1);
    for n in 1..=6 {
        let d = b.delay(n, &mut rng);
        assert!(d <= b.ceiling(n) && d >= b.ceiling(n) / 2, "{d:?}");
    }
}

#[test]
fn a_reconnecting_client_gives_up_after_max_failures() {
    // Nobody listens here (a port bound and closed again).
    let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let fabric = Fabric::with_seed(26);
    let nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let backoff =
        Backoff::new(Duration::from_millis(5), Duration::from_millis(20)).jitter(0.0).max_failures(4);
    let mut pool = LocalPool::new();
    let endpoint = driven(&pool, builder(nic, KEY, PolicyChoice::Confirm).build().unwrap());
    let (client, supervisor) = Reconnecting::new(endpoint, addr, backoff);
    let (end, waited) = pool.run_until(futures::future::join(supervisor, client.connection()));
    let ReconnectError::GaveUp { failures: 4, last } = &end else { panic!("{end:?}") };
    assert!(matches!(**last, SetupError::Bootstrap(BootstrapError::Unreachable { .. })), "{last:?}");
    assert!(matches!(waited, Err(ReconnectError::GaveUp { .. })));
    let waits: Vec<u64> = client.stats().waits.iter().map(|d| d.as_millis() as u64).collect();
    assert_eq!(waits, [5, 10, 20], "one wait between each two attempts, doubling to the cap");
}

#[test]
fn a_reconnecting_client_keeps_only_its_latest_waits() {
    // A server that refuses for good, a client that never gives up: each
    // failure adds a wait, and only the latest 32 are kept (it kept them
    // all before, without bound).
    let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let fabric = Fabric::with_seed(27);
    let nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let backoff = Backoff::new(Duration::from_micros(100), Duration::from_micros(100)).jitter(0.0);
    let mut pool = LocalPool::new();
    let endpoint = driven(&pool, builder(nic, KEY, PolicyChoice::Confirm).build().unwrap());
    let (client, supervisor) = Reconnecting::new(endpoint, addr, backoff);
    let watch = async {
        while client.stats().failures < 200 {
            async_io::Timer::after(Duration::from_millis(5)).await;
        }
        client.stop();
    };
    let (end, ()) = pool.run_until(futures::future::join(supervisor, watch));
    assert!(matches!(end, ReconnectError::Stopped), "{end:?}");
    let stats = client.stats();
    assert!(stats.failures >= 200, "{stats:?}");
    assert_eq!(stats.waits.len(), 32, "the latest 32 waits of {} failures", stats.failures);
}

/// A listening endpoint runs at most 256 handshakes at once; the clients
/// past them wait in the kernel's accept queue until a slot frees.
/// Wait for a message on a std channel without blocking the executor's thread.
async fn blocking_recv(rx: &mpsc::Receiver<()>) {
    loop {
        if rx.try_recv().is_ok() {
            return;
        }
        async_io::Timer::after(Duration::from_millis(5)).await;
    }
}

#[test]
fn past_max_handshakes_clients_wait_in_the_kernel_queue() {
    const MAX_HANDSHAKES: usize = 256;
    let fabric = Fabric::with_seed(27);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let timeout = Duration::from_millis(600);
    let (server, sd) = builder(server_nic, KEY, PolicyChoice::Confirm)
        .handshake_timeout(timeout)
        .listen(any_port())
        .build()
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let _server = serve(server, sd, tx);
    // Silent clients take every slot (each from when it is taken, after `started`).
    let started = Instant::now();
    let _silent: Vec<TcpStream> = (0..MAX_HANDSHAKES).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // The client allows itself longer than the server allows the silent ones.
    let mut pool = LocalPool::new();
    let client = driven(
        &pool,
        builder(client_nic, KEY, PolicyChoice::Confirm)
            .handshake_timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
    );
    let connected = pool.run_until(client.connect(addr));
    // The good client got a slot only once a silent one timed out.
    assert!(started.elapsed() >= timeout);
    assert!(connected.is_ok(), "{:?}", connected.err());
    let seen: Vec<Outcome> =
        (0..=MAX_HANDSHAKES).map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
    let timed_out = seen.iter().filter(|o| o.as_ref().is_err_and(|e| e.contains("TimedOut"))).count();
    assert_eq!((timed_out, seen.iter().filter(|o| o.is_ok()).count()), (MAX_HANDSHAKES, 1));
    assert!(seen[0].is_err(), "the good client was served before a silent one timed out: {:?}", seen[0]);
}

#[test]
fn a_dropped_accept_future_loses_no_handshake() {
    let fabric = Fabric::with_seed(28);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let server_dev = server_nic.device();
    let mut pool = LocalPool::new();
    let server =
        driven(&pool, builder(server_nic, KEY, PolicyChoice::Confirm).listen(any_port()).build().unwrap());
    let client = driven(&pool, builder(client_nic, KEY, PolicyChoice::Confirm).build().unwrap());
    let addr = server.local_addr().unwrap();
    // The server creates a queue pair only for a client that proved the
    // key, half-way through its handshake, which then waits for the
    // client's hello and ready: the first accept is dropped right then.
    let qps = fabric.created(server_dev).qps;
    let (accepted, connected) = pool.run_until(async {
        let mut connect = std::pin::pin!(client.connect(addr));
        let mut connected = None;
        {
            let mut first = std::pin::pin!(server.accept());
            std::future::poll_fn(|cx| {
                if connected.is_none() {
                    if let Poll::Ready(c) = connect.as_mut().poll(cx) {
                        connected = Some(c);
                    }
                }
                match first.as_mut().poll(cx) {
                    Poll::Ready(r) => panic!("the first accept ended before it was dropped: {:?}", r.err()),
                    Poll::Pending if fabric.created(server_dev).qps > qps => Poll::Ready(()),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
        }
        assert!(connected.is_none(), "the client connected with no server to finish its handshake");
        let connected = std::pin::pin!(async {
            match connected {
                Some(c) => c,
                None => connect.await,
            }
        });
        // A client whose handshake was lost fails: seen at once, not as a
        // second accept that waits for ever.
        match futures::future::select(std::pin::pin!(server.accept()), connected).await {
            futures::future::Either::Left((accepted, connected)) => (accepted, connected.await),
            futures::future::Either::Right((connected, accepted)) => {
                assert!(connected.is_ok(), "{:?}", connected.err());
                (accepted.await, connected)
            }
        }
    });
    assert!(accepted.is_ok(), "{:?}", accepted.err());
    assert!(connected.is_ok(), "{:?}", connected.err());
    assert_eq!(fabric.created(server_dev).qps, qps + 1, "the handshake went on; no second one started");
}

#[test]
fn concurrent_first_askers_share_one_probe() {
    let fabric = Fabric::with_seed(29);
    let nic = fabric.add_device(DeviceConfig::spec().named("shared"));
    let other = fabric.add_device(DeviceConfig::spec().with_mw(mwcap::sim::MwSupport::None).named("nomw"));
    let probes = ProbeCache::new();
    std::thread::scope(|s| {
        for _ in 0..8 {
            let (probes, nic, other) = (probes.clone(), nic.clone(), other.clone());
            s.spawn(move || {
                assert!(probes.report(&nic).mw_usable);
                assert!(!probes.report(&other).mw_usable);
            });
        }
    });
    assert_eq!(probes.probes_run(), 2, "one probe per device, not per asker");
}

#[test]
fn a_server_that_goes_away_is_reported_as_gone_not_as_closed_by_the_user() {
    // Issue 18 §4.3: the server process dies while a call is in flight.
    // The client's connection went down as "closed by the user" (its
    // stream watch closed it), which misleads whoever reads the error.
    let fabric = Fabric::with_seed(30);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let (server, sd) = builder(server_nic, KEY, PolicyChoice::Confirm).listen(any_port()).build().unwrap();
    let addr = server.local_addr().unwrap();
    // The server's process, on a thread of its own.
    let server = std::thread::spawn(move || {
        let mut pool = LocalPool::new();
        let server = driven(&pool, (server, sd));
        let conn = pool.run_until(server.accept()).expect("the client connects");
        // The request arrives; then the process dies: its driver stops
        // and everything it held goes (nothing is closed in order).
        let request = pool.run_until(conn.next_request());
        assert!(request.is_some());
        drop((request, conn, server, pool));
    });
    let mut pool = LocalPool::new();
    let client = driven(&pool, builder(client_nic, KEY, PolicyChoice::Confirm).build().unwrap());
    let (call, closed) = pool.run_until(async {
        let conn = client.connect(addr).await.expect("connects");
        let call = conn.call(b"get", None).await;
        (call, conn.closed().await)
    });
    server.join().unwrap();
    let e = call.expect_err("the server is gone");
    let msg = e.to_string();
    assert_eq!(e, mwcap::conn::CallError::ConnectionLost(LossReason::PeerGone), "{msg}");
    assert!(!msg.contains("closed by the user") && msg.contains("went away"), "{msg}");
    assert_eq!(closed, LossReason::PeerGone);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

#[test]
fn stopping_to_listen_ends_the_accept_loop_and_the_handshakes_in_progress() {
    // Issue 18 §4.5: a listener had no close(); ending its accept loop
    // meant dropping the accept future, which its docs did not say.
    use std::io::Read;
    let fabric = Fabric::with_seed(31);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let mut pool = LocalPool::new();
    let server =
        driven(&pool, builder(server_nic, KEY, PolicyChoice::Confirm).listen(any_port()).build().unwrap());
    let client = driven(&pool, builder(client_nic, KEY, PolicyChoice::Confirm).build().unwrap());
    let addr = server.local_addr().unwrap();
    // A client whose handshake is in progress when the endpoint stops listening.
    let mut silent = TcpStream::connect(addr).unwrap();
    let (mut accepted, connected) = pool.run_until(async {
        // A server's accept loop: it ends when the endpoint stops listening.
        let accept_loop = async {
            let mut accepted = Vec::new();
            loop {
                match server.accept().await {
                    Ok(c) => accepted.push(c),
                    Err(SetupError::ListenerClosed) => break accepted,
                    Err(e) => panic!("{e}"),
                }
            }
        };
        // Another task stops it, once a client is connected.
        let connect = async {
            let c = client.connect(addr).await.expect("connects");
            server.stop_listening();
            c
        };
        futures::join!(accept_loop, connect)
    });
    assert_eq!(accepted.len(), 1);
    // The silent client's connection was closed: it reads the end, not a timeout.
    silent.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut b = [0u8; 64];
    match silent.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the handshake in progress was not ended: {other:?}"),
    }
    // Nobody listens any more, and accept says why.
    let e = TcpStream::connect(addr).expect_err("the listener's socket is closed");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    let e = pool.run_until(server.accept()).err().expect("closed");
    assert!(matches!(e, SetupError::ListenerClosed), "{e:?}");
    assert!(e.to_string().contains("listener was closed"), "{e}");
    server.stop_listening(); // again: nothing more happens
                             // The connection accepted before runs on.
    spawn(&pool, echo(accepted.pop().unwrap()));
    let reply = pool.run_until(async {
        let r = connected.call(b"still here", None).await;
        connected.close();
        r
    });
    assert_eq!(reply.expect("answered").header, b"still here");
    assert!(wait(&mut pool, || server.stats().connections == 0), "{:?}", server.stats());
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A key holder completes the bootstrap, then keeps writing on its
/// bootstrap stream after the ready byte. The endpoint's driver watches
/// that stream: it read it to the end before, which a fast writer never
/// let come, so the driver polled no completion queue and every other
/// connection of the endpoint stalled. Now one byte there takes the
/// writer's connection down (`BootstrapAfterReady`), and the others are
/// answered throughout.
#[test]
fn a_peer_writing_on_its_bootstrap_stream_loses_its_connection_and_stalls_nobody() {
    use futures::future::{select, Either};
    use mwcap::bootstrap::{authenticate_client, Capabilities, Hello};
    use mwcap::conn::{Misbehavior, Role};
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let fabric = Fabric::with_seed(91);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let (server, sd) = builder(server_nic, KEY, PolicyChoice::Confirm).listen(any_port()).build().unwrap();
    let addr = server.local_addr().unwrap();
    // The server: each accepted connection echoes, and says how it ended.
    let (accepted, accepts) = mpsc::channel();
    let (ended, ends) = mpsc::channel();
    std::thread::spawn(move || {
        let mut pool = LocalPool::new();
        pool.spawner().spawn_local(async move { _ = sd.run().await }).unwrap();
        let spawner = pool.spawner();
        pool.run_until(async move {
            while let Ok(conn) = server.accept().await {
                let ended = ended.clone();
                let watched = conn.clone();
                spawner.spawn_local(async move { _ = ended.send(watched.closed().await) }).unwrap();
                spawner.spawn_local(echo(conn)).unwrap();
                if accepted.send(()).is_err() {
                    return;
                }
            }
        });
    });
    let mut pool = LocalPool::new();
    let (good, gd) = builder(client_nic, KEY, PolicyChoice::Confirm).build().unwrap();
    pool.spawner().spawn_local(async move { _ = gd.run().await }).unwrap();
    let conn = pool.run_until(good.connect(addr)).unwrap();
    accepts.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(pool.run_until(conn.call(b"before", None)).unwrap().header, b"before");
    // The writer: a bootstrap by hand (a QP of its own), then a flood.
    let pending = good
        .prepare(Role::Client, Policies { request: Policy::Confirm, reply: Policy::Confirm }, cfg())
        .unwrap();
    let hello = Hello::new(pending.local(), Capabilities::new());
    let t = Duration::from_secs(5);
    let stream = authenticate_client(addr, &key(KEY), t).unwrap().hello(&hello, t).unwrap().ready(t).unwrap();
    accepts.recv_timeout(t).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flood: Vec<_> = (0..2)
        .map(|_| {
            let (stop, mut stream) = (stop.clone(), stream.try_clone().unwrap());
            std::thread::spawn(move || {
                let buf = vec![0x5a_u8; 1 << 16];
                while !stop.load(Ordering::Relaxed) && stream.write_all(&buf).is_ok() {}
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = pool.run_until(async {
        let call = std::pin::pin!(conn.call(b"during", None));
        match select(call, async_io::Timer::after(Duration::from_secs(3))).await {
            Either::Left((r, _)) => Some(r.map(|r| r.header)),
            Either::Right(_) => None,
        }
    });
    stop.store(true, Ordering::Relaxed);
    flood.into_iter().for_each(|t| t.join().unwrap());
    assert!(matches!(&during, Some(Ok(h)) if h == b"during"), "not answered during the flood: {during:?}");
    let why = ends.recv_timeout(Duration::from_secs(5)).expect("the writer's connection ended");
    assert_eq!(why, LossReason::PeerMisbehaved(Misbehavior::BootstrapAfterReady));
    assert_eq!(pool.run_until(conn.call(b"after", None)).unwrap().header, b"after");
}
