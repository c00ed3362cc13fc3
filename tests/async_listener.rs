//! The async setup on simulated NICs: a `Listener` runs many handshakes at
//! once (silent and wrong-key clients do not hold up good ones), the
//! capability probe runs once per device however many clients connect,
//! and `Reconnecting` comes back after the server went away, backing off.

#![cfg(not(loom))]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::executor::{block_on, LocalPool};
use futures::future::join_all;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, BootstrapError, Key, PolicySet};
use mwcap::conn::{
    accept, accept_with, connect_async, connect_with, AsyncConnected, Backoff, Config, Connection, Listener,
    LossReason, Policies, Policy, PolicyChoice, ProbeCache, ReconnectError, Reconnecting, Role, SetupError,
    SetupOptions,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

fn key(text: &str) -> Auth {
    Auth::Key(Key::from_bytes(text.as_bytes().to_vec()).unwrap())
}

const KEY: &str = "async_listener's shared test key";

/// Small endpoints: many of them live at once.
fn cfg(role: Role) -> Config {
    let mut c = Config::new(role, Policies::both(Policy::Confirm));
    c.buffers = 4;
    c.buffer_size = 4096;
    c
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

/// What the server thread reports for each finished handshake.
type Outcome = Result<SocketAddr, String>;

/// A server thread: a listener on `tcp` serving every client with `echo`
/// on a `LocalPool`, reporting each handshake's outcome on `out`.
fn serve(
    tcp: TcpListener,
    nic: SimNic,
    opts: SetupOptions,
    out: mpsc::Sender<(Outcome, usize)>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut pool = LocalPool::new();
        let spawner = pool.spawner();
        let mut listener = Listener::from_std(tcp, cfg(Role::Server), opts, move || Ok(nic.clone())).unwrap();
        let accept_loop = async move {
            loop {
                let r = listener.accept().await;
                let pending = listener.handshakes_in_progress();
                let outcome = match r {
                    Ok(c) => {
                        let peer = c.peer_addr;
                        let (conn, run) = c.run();
                        spawner.spawn_local(echo(conn)).unwrap();
                        spawner
                            .spawn_local(async move {
                                run.await;
                            })
                            .unwrap();
                        Ok(peer)
                    }
                    Err(e) => Err(format!("{e:?}")),
                };
                if out.send((outcome, pending)).is_err() {
                    return;
                }
            }
        };
        pool.run_until(accept_loop);
    })
}

#[test]
fn silent_and_wrong_key_clients_do_not_hold_up_good_ones() {
    let fabric = Fabric::with_seed(21);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let timeout = Duration::from_secs(3);
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let opts = SetupOptions::new(PolicyChoice::Auto, key(KEY)).timeout(timeout);
    let _server = serve(tcp, server_nic, opts, tx);

    // Ten clients connect and say nothing; they are first in the queue.
    let silent: Vec<TcpStream> = (0..10).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let started = Instant::now();
    let good_opts = SetupOptions::new(PolicyChoice::Auto, key(KEY)).timeout(timeout);
    let bad_opts =
        SetupOptions::new(PolicyChoice::Confirm, key("a wrong key for this server")).timeout(timeout);
    let clients = async {
        let good = (0..30).map(|i| {
            let (nic, opts) = (client_nic.clone(), &good_opts);
            async move {
                let c = connect_async(nic, addr, cfg(Role::Client), opts).await?;
                let (conn, run) = c.run();
                let call = async {
                    let r = conn.call(format!("client {i}").as_bytes(), None).await;
                    conn.close();
                    r
                };
                let (reply, _) = futures::join!(call, run);
                Ok::<_, SetupError>((reply.map(|r| r.header), started.elapsed()))
            }
        });
        let bad = (0..10).map(|_| connect_async(client_nic.clone(), addr, cfg(Role::Client), &bad_opts));
        futures::join!(join_all(good), join_all(bad))
    };
    let (good, bad) = block_on(clients);
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
    let mut seen: Vec<(Outcome, usize)> = (0..40).map(|_| rx.recv_timeout(timeout).unwrap()).collect();
    assert_eq!(seen.iter().filter(|(o, _)| o.is_ok()).count(), 30);
    assert!(seen.iter().filter_map(|(o, _)| o.as_ref().err()).all(|e| e.contains("AuthFailed")), "{seen:?}");
    assert!(seen.iter().all(|(_, pending)| *pending >= 10), "the silent clients' handshakes stay pending");

    // Then the silent ones time out, each with a typed error.
    seen = (0..10).map(|_| rx.recv_timeout(2 * timeout).unwrap()).collect();
    for (o, _) in &seen {
        let e = o.as_ref().expect_err("a silent client never connects");
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
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let opts = SetupOptions::new(PolicyChoice::Auto, key(KEY)).probe_cache(server_probes.clone());
    let _server = serve(tcp, server_nic, opts, tx);

    let copts = SetupOptions::new(PolicyChoice::Auto, key(KEY)).probe_cache(client_probes.clone());
    block_on(async {
        for _ in 0..20 {
            let c: AsyncConnected<SimNic> =
                connect_async(client_nic.clone(), addr, cfg(Role::Client), &copts).await.expect("connects");
            assert_eq!(c.policies, Policies::both(Policy::Mw), "auto picks mw on a spec device");
            let (conn, run) = c.run();
            conn.close();
            assert_eq!(run.await, LossReason::Closed);
        }
    });
    for _ in 0..20 {
        rx.recv_timeout(Duration::from_secs(5)).unwrap().0.expect("the server connects each");
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

#[test]
fn the_blocking_setup_with_options_probes_once() {
    let fabric = Fabric::with_seed(23);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let sopts = SetupOptions::new(PolicyChoice::Auto, key(KEY));
    let server_probes = sopts.probes.clone();
    let server = std::thread::spawn(move || {
        let mut policies = Vec::new();
        for _ in 0..3 {
            policies.push(
                accept(server_nic.clone(), &tcp, cfg(Role::Server), PolicyChoice::Auto, &key(KEY), T)
                    .unwrap()
                    .policies,
            );
        }
        for _ in 0..5 {
            policies.push(accept_with(server_nic.clone(), &tcp, cfg(Role::Server), &sopts).unwrap().policies);
        }
        policies
    });
    let copts = SetupOptions::new(PolicyChoice::Auto, key(KEY));
    let mut keep = Vec::new();
    for _ in 0..8 {
        keep.push(connect_with(client_nic.clone(), addr, cfg(Role::Client), &copts).unwrap());
    }
    let policies = server.join().unwrap();
    assert!(policies.iter().all(|p| *p == Policies::both(Policy::Mw)));
    // The three plain accepts probed on their own (outside the cache); the five with options once.
    assert_eq!(server_probes.probes_run(), 1);
    assert_eq!(copts.probes.probes_run(), 1);
}

const T: Duration = Duration::from_secs(5);

#[test]
fn an_mw_listener_on_a_device_without_windows_fails_at_bind() {
    let fabric = Fabric::with_seed(24);
    let nic = fabric.add_device(DeviceConfig::spec().with_mw(mwcap::sim::MwSupport::None).named("nomw"));
    let opts = SetupOptions::new(PolicyChoice::Mw, key(KEY));
    let n = nic.clone();
    let e = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts, move || Ok(n.clone()))
        .err()
        .expect("mw cannot be served");
    assert!(matches!(e, SetupError::MwUnusable { .. }), "{e:?}");
    let opts = SetupOptions::new(PolicyChoice::Auto, key(KEY));
    let l = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts, move || Ok(nic.clone()))
        .expect("auto falls back to confirm");
    assert_eq!(l.serves(), PolicySet::CONFIRM);
}

#[test]
fn a_reconnecting_client_comes_back_after_the_server_went_away() {
    let fabric = Fabric::with_seed(25);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let (go_down, down) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY));
        let serve_one = |tcp: TcpListener, until: Option<&mpsc::Receiver<()>>| {
            let mut l = Listener::from_std(tcp, cfg(Role::Server), opts.clone(), {
                let n = server_nic.clone();
                move || Ok(n.clone())
            })
            .unwrap();
            block_on(async {
                let (conn, run) = l.accept().await.expect("the client connects").run();
                let serving = async {
                    match until {
                        Some(rx) => {
                            let stop = blocking_recv(rx);
                            futures::future::select(Box::pin(echo(conn.clone())), Box::pin(stop)).await;
                            // The server goes away: its connection, bootstrap stream and listener.
                            conn.close();
                        }
                        None => echo(conn.clone()).await,
                    }
                };
                futures::join!(serving, run);
            });
        };
        serve_one(tcp, Some(&down));
        // Down for a while: the client's attempts are refused meanwhile.
        std::thread::sleep(Duration::from_millis(700));
        serve_one(TcpListener::bind(addr).unwrap(), None);
    });

    let backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(160)).jitter(0.0);
    let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY)).timeout(Duration::from_secs(2));
    let (client, supervisor) =
        Reconnecting::new(addr, cfg(Role::Client), opts, backoff, move || Ok(client_nic.clone()));
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
    let (stats, end) = block_on(futures::future::join(app, supervisor));
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
    let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY));
    let (client, supervisor) =
        Reconnecting::new(addr, cfg(Role::Client), opts, backoff, move || Ok(nic.clone()));
    let (end, waited) = block_on(futures::future::join(supervisor, client.connection()));
    let ReconnectError::GaveUp { failures: 4, last } = &end else { panic!("{end:?}") };
    assert!(matches!(**last, SetupError::Bootstrap(BootstrapError::Unreachable { .. })), "{last:?}");
    assert!(matches!(waited, Err(ReconnectError::GaveUp { .. })));
    let waits: Vec<u64> = client.stats().waits.iter().map(|d| d.as_millis() as u64).collect();
    assert_eq!(waits, [5, 10, 20], "one wait between each two attempts, doubling to the cap");
}

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
    let fabric = Fabric::with_seed(27);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let timeout = Duration::from_millis(600);
    let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY)).timeout(timeout);
    let mut l = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts.clone(), move || {
        Ok(server_nic.clone())
    })
    .unwrap();
    l.set_max_handshakes(2);
    let addr = l.local_addr().unwrap();
    // Two silent clients take both slots.
    let _silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let started = Instant::now();
    let (server_side, client_side) = block_on(async {
        let server = async {
            let mut outcomes = Vec::new();
            for _ in 0..3 {
                let r = l.accept().await;
                assert!(l.handshakes_in_progress() <= 2);
                outcomes.push(r.map(|c| c.peer_addr));
            }
            outcomes
        };
        // The client allows itself longer than the server allows the silent ones.
        let copts = opts.clone().timeout(Duration::from_secs(5));
        futures::join!(server, connect_async(client_nic.clone(), addr, cfg(Role::Client), &copts))
    });
    // The good client got a slot only once a silent one timed out.
    assert!(started.elapsed() >= timeout);
    assert!(client_side.is_ok(), "{:?}", client_side.err());
    let timed_out = server_side
        .iter()
        .filter(|r| matches!(r, Err(SetupError::Bootstrap(BootstrapError::TimedOut { .. }))))
        .count();
    assert_eq!((timed_out, server_side.iter().filter(|r| r.is_ok()).count()), (2, 1), "{server_side:?}");
}

#[test]
fn a_dropped_accept_future_loses_no_handshake() {
    let fabric = Fabric::with_seed(28);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY));
    let mut l = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts.clone(), move || {
        Ok(server_nic.clone())
    })
    .unwrap();
    let addr = l.local_addr().unwrap();
    let (accepted, client) = block_on(async {
        let client = connect_async(client_nic.clone(), addr, cfg(Role::Client), &opts);
        let server = async {
            // Poll accept a little (the TCP connection is taken and its
            // handshake starts), drop it, then accept again.
            {
                let first = std::pin::pin!(l.accept());
                let tick = async_io::Timer::after(Duration::from_millis(1));
                if let futures::future::Either::Left((r, _)) = futures::future::select(first, tick).await {
                    return r.map(|c| c.peer_addr);
                }
            }
            l.accept().await.map(|c| c.peer_addr)
        };
        futures::join!(server, client)
    });
    assert!(accepted.is_ok(), "{accepted:?}");
    assert!(client.is_ok(), "{:?}", client.err());
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
    let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY));
    let mut l = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts.clone(), move || {
        Ok(server_nic.clone())
    })
    .unwrap();
    let addr = l.local_addr().unwrap();
    let (call, closed, ran) = block_on(async {
        let server = async {
            let AsyncConnected { connection, driver, stream, .. } =
                l.accept().await.expect("the client connects");
            // The request arrives; then the process dies: its driver stops
            // and everything it held goes (nothing is closed in order).
            {
                let request = std::pin::pin!(connection.next_request());
                let driving = std::pin::pin!(driver.run());
                let _ = futures::future::select(request, driving).await;
            }
            drop((connection, stream));
        };
        let client = async {
            let (conn, run) = connect_async(client_nic.clone(), addr, cfg(Role::Client), &opts)
                .await
                .expect("connects")
                .run();
            let (call, ran) = futures::join!(conn.call(b"get", None), run);
            (call, conn.closed().await, ran)
        };
        futures::join!(server, client).1
    });
    let e = call.expect_err("the server is gone");
    let msg = e.to_string();
    assert_eq!(e, mwcap::conn::CallError::ConnectionLost(LossReason::PeerGone), "{msg}");
    assert!(!msg.contains("closed by the user") && msg.contains("went away"), "{msg}");
    assert_eq!((closed, ran), (LossReason::PeerGone, LossReason::PeerGone));
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

#[test]
fn closing_a_listener_ends_its_accept_loop_and_the_handshakes_in_progress() {
    // Issue 18 §4.5: a listener had no close(); ending its accept loop
    // meant dropping the accept future, which its docs did not say.
    use std::io::Read;
    let fabric = Fabric::with_seed(31);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    let opts = SetupOptions::new(PolicyChoice::Confirm, key(KEY));
    let mut l = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts.clone(), move || {
        Ok(server_nic.clone())
    })
    .unwrap();
    let addr = l.local_addr().unwrap();
    let closer = l.closer();
    // A client whose handshake is in progress when the listener closes.
    let mut silent = TcpStream::connect(addr).unwrap();
    let (mut accepted, client) = block_on(async {
        // A server's accept loop: it ends when the listener is closed.
        let accept_loop = async {
            let mut accepted = Vec::new();
            loop {
                match l.accept().await {
                    Ok(c) => accepted.push(c),
                    Err(SetupError::ListenerClosed) => break accepted,
                    Err(e) => panic!("{e}"),
                }
            }
        };
        // Another task closes it, once a client is connected.
        let client = async {
            let c =
                connect_async(client_nic.clone(), addr, cfg(Role::Client), &opts).await.expect("connects");
            closer.close();
            c
        };
        futures::join!(accept_loop, client)
    });
    assert_eq!(accepted.len(), 1);
    assert_eq!(l.handshakes_in_progress(), 0, "the handshakes in progress ended");
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
    let e = block_on(l.accept()).err().expect("closed");
    assert!(matches!(e, SetupError::ListenerClosed), "{e:?}");
    assert!(e.to_string().contains("listener was closed"), "{e}");
    assert!(l.local_addr().is_err());
    l.close(); // again: nothing more happens
               // The connection accepted before runs on.
    let (server, srun) = accepted.pop().unwrap().run();
    let (client, crun) = client.run();
    let call = async {
        let r = client.call(b"still here", None).await;
        client.close();
        r
    };
    let (reply, ..) = block_on(async { futures::join!(call, echo(server), srun, crun) });
    assert_eq!(reply.expect("answered").header, b"still here");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}
