//! Many connections on one [`Endpoint`]: one completion queue and one
//! driver (the endpoint's hub), each connection in a protection domain of
//! its own, on the simulated NIC.

use mwcap::backend::NicOps;
use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::backend::{Completion, SendWr, Sge, SgeList, WcStatus};
use mwcap::conn::{Connection, Endpoint, LossReason, Policies, Policy, Role, SetupError};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

mod hubs;
use hubs::{
    builder, connected_unadded, endpoint, pattern, serve, serve_clients, server_with_link_client, spawn, Side,
};

fn cfg(role: Role, p: Policies) -> Side {
    let mut c = Side::new(role, p);
    c.buffers = 4;
    c.large_buffers = vec![mwcap::conn::BufClass { size: 256 * 1024, count: 1 }];
    c.ctrl_slots = 8;
    c.lease_time = Duration::from_millis(300);
    c.safety_margin = Duration::from_millis(50);
    c.call_timeout = Duration::from_secs(3);
    c
}

/// A client and a server connection, each on its endpoint, each in a new
/// PD.
fn pair(
    client: &Endpoint<SimNic>,
    server: &Endpoint<SimNic>,
    p: Policies,
) -> (Connection<SimNic>, Connection<SimNic>) {
    hubs::pair(client, server, cfg(Role::Client, p), cfg(Role::Server, p))
}

/// A client and a server endpoint with queues of `depth`, their drivers
/// spawned on the pool; the server's on a device of `dev`.
fn two_endpoints(dev: DeviceConfig, depth: u32) -> (Fabric, Endpoint<SimNic>, Endpoint<SimNic>, LocalPool) {
    let fabric = Fabric::with_seed(11);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(dev.named("s"));
    let pool = LocalPool::new();
    let ch = endpoint(&pool, builder(cn).queue_depth(depth));
    let sh = endpoint(&pool, builder(sn).queue_depth(depth));
    (fabric, ch, sh, pool)
}

#[test]
fn sixty_four_connections_on_one_hub_each_get_their_own_answers() {
    let (fabric, ch, sh, mut pool) = two_endpoints(DeviceConfig::spec(), 1 << 16);
    let policies = [
        Policies::both(Policy::Mw),
        Policies::both(Policy::Confirm),
        Policies { request: Policy::Confirm, reply: Policy::Mw },
    ];
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    let n = 64;
    // Leases long enough for a loaded host: the 64 connections' user
    // tasks (filling and checking 200 KB each) share the driver's thread,
    // and with the other tests of this file running beside it a 300 ms
    // lease ran out before a READ's completion was seen (the test is about
    // whose bytes come back, not about expiry).
    let slow = |role, p| {
        let mut c = cfg(role, p);
        c.lease_time = Duration::from_secs(3);
        c.call_timeout = Duration::from_secs(30);
        c
    };
    for i in 0..n {
        let p = policies[i % 3];
        let (c, s) = hubs::pair(&ch, &sh, slow(Role::Client, p), slow(Role::Server, p));
        spawn(&pool, serve(s.clone()));
        servers.push(s);
        clients.push(c);
    }
    assert_eq!(sh.stats().connections, n);
    assert_eq!(ch.stats().connections, n);
    // Every client makes 4 calls at once with payloads from inline to large.
    let sizes = [0usize, 100, 3000, 200_000];
    let shr = &sh;
    let calls = clients.iter().enumerate().map(|(i, c)| async move {
        for (k, &len) in sizes.iter().enumerate() {
            let data = if len == 0 {
                None
            } else {
                let mut b = c.alloc_for(len).await.unwrap();
                b.copy_from(&pattern(i + k, len)).unwrap();
                Some(b)
            };
            let r = c
                .call(b"x", data)
                .await
                .unwrap_or_else(|e| panic!("conn {i} call {k}: {e} {:?} {:?}", c.stats(), shr.stats()));
            assert_eq!(r.header, b"echo");
            match r.data {
                None => assert_eq!(len, 0),
                Some(d) => {
                    let mut want = pattern(i + k, len);
                    want.reverse();
                    assert!(d.to_vec() == want, "conn {i} call {k}: another connection's bytes");
                    c.free(d);
                }
            }
        }
    });
    pool.run_until(futures::future::join_all(calls));
    let s = sh.stats();
    assert_eq!(s.orphans, 0);
    assert!(s.completions >= n as u64 * 4, "{s:?}");
    // Close every connection: each says why once it has finished, and the
    // endpoints forget them.
    for (c, s) in clients.iter().zip(&servers) {
        assert_eq!(c.stats().calls_failed, 0);
        c.close();
        s.close();
    }
    let reasons = pool.run_until(futures::future::join_all(
        clients.iter().zip(&servers).map(|(c, s)| futures::future::join(c.finished(), s.finished())),
    ));
    for (c, _) in &reasons {
        assert_eq!(*c, LossReason::Closed);
    }
    for c in &clients {
        assert_eq!(c.free_buffers(), 5, "every buffer came back");
    }
    assert_eq!(sh.stats().connections, 0);
    assert_eq!(ch.stats().connections, 0);
    assert_eq!(sh.stats().reserved_entries, 0);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

#[test]
fn a_reused_qp_number_never_gets_the_old_qps_completions() {
    // The server device hands a destroyed QP's number to the next QP.
    let dev = DeviceConfig { reuse_qpns: true, ..DeviceConfig::spec() };
    let (fabric, ch, sh, mut pool) = two_endpoints(dev, 1 << 14);
    let p = Policies::both(Policy::Mw);
    let mut seen = std::collections::HashMap::new();
    let checked = std::cell::Cell::new(0);
    for round in 0..12usize {
        let (c, s) = pair(&ch, &sh, p);
        let qpn = s.qp_number();
        *seen.entry(qpn).or_insert(0) += 1;
        spawn(&pool, serve(s.clone()));
        pool.run_until(async {
            // Calls in flight while the server's QP is torn down: their
            // completions (flushes) are in the shared queue when it goes.
            let mut pending = Vec::new();
            for k in 0..3usize {
                let mut b = c.alloc_for(3000).await.unwrap();
                b.copy_from(&pattern(round + k, 3000)).unwrap();
                pending.push(Box::pin(c.call(b"x", Some(b))));
            }
            // The first two are answered, each with its own bytes; the
            // third is in flight while the server's QP goes.
            for k in 0..2 {
                let r = pending.remove(0).await.expect("an answered call");
                let mut want = pattern(round + k, 3000);
                want.reverse();
                let d = r.data.expect("an echo carries the request's bytes");
                assert!(d.to_vec() == want, "round {round} call {k}: not its own reply");
                c.free(d);
                checked.set(checked.get() + 1);
            }
            s.close();
            // Answered (with its own bytes) or failed, never another
            // connection's reply.
            if let Ok(r) = pending.remove(0).await {
                let mut want = pattern(round + 2, 3000);
                want.reverse();
                let d = r.data.expect("an echo carries the request's bytes");
                assert!(d.to_vec() == want, "round {round} call 2: not its own reply");
                c.free(d);
            }
            assert!(matches!(s.finished().await, LossReason::Closed));
            c.close();
            c.finished().await;
        });
    }
    assert!(seen.values().any(|&n| n > 1), "the device reused no QP number: {seen:?}");
    assert_eq!(checked.get(), 24, "two calls answered and checked per round");
    assert_eq!(sh.stats().orphans, 0);
    assert_eq!(sh.stats().connections, 0);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

#[test]
fn a_hub_refuses_a_connection_its_queue_cannot_hold_and_takes_it_once_one_leaves() {
    let fabric = Fabric::with_seed(5);
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let (ep, _drv) = builder(sn).queue_depth(400).build().unwrap();
    let mut held = Vec::new();
    let err = loop {
        match cfg(Role::Server, p).prepare(&ep) {
            Ok(prep) => held.push(prep),
            Err(e) => break e,
        }
        assert!(held.len() < 100, "a 400-entry queue took 100 connections");
    };
    assert!(!held.is_empty());
    match err {
        SetupError::CqBudget { depth, reserved, wanted } => {
            assert_eq!(depth, 400);
            assert!(reserved + u64::from(wanted) > 400);
            assert_eq!(ep.stats().reserved_entries, reserved);
        }
        e => panic!("expected CqBudget, got {e}"),
    }
    assert!(err.to_string().contains("another endpoint"), "{err}");
    // Dropping a queue pair not yet connected gives its share back.
    held.pop();
    cfg(Role::Server, p).prepare(&ep).expect("room again after one left");
}

/// A client that uses another connection's region key on an rxe-like
/// device (windows reach their whole region) reaches nothing: each
/// connection on the endpoint is in its own PD. The other connection goes
/// on.
#[test]
fn on_rxe_a_peer_reaches_nothing_of_another_connection_on_the_same_hub() {
    let fabric = Fabric::with_seed(13);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::rxe().named("s"));
    let mut pool = LocalPool::new();
    let sh = endpoint(&pool, builder(sn).queue_depth(1 << 14));
    // The victim's client is a connection on a client endpoint; the
    // attacker's is a link driven by hand.
    let ch = endpoint(&pool, builder(cn.clone()).queue_depth(1 << 14));
    let p = Policies::both(Policy::Confirm); // the region key covers the whole region
    let victim_s = cfg(Role::Server, p).prepare(&sh).unwrap();
    let victim_c = cfg(Role::Client, p).prepare(&ch).unwrap();
    let (attack_s, attack_c) = server_with_link_client(&sh, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
    let secret = victim_s.link().data_region();
    victim_s.link().nic().write_mr(secret.id, 0, b"the victim's bytes").unwrap();
    let (vc, vs) = (victim_c.local(), victim_s.local());
    let vclient = victim_c.connect(&vs).unwrap();
    let victim = victim_s.connect(&vc).unwrap();
    let _attacked = attack_s.connect(&attack_c.local()).unwrap();
    spawn(&pool, serve(victim.clone()));
    // The attacker READs the victim's region through its own connection.
    let dst = attack_c.data_region();
    let read = SendWr::Read {
        wr_id: 0xbad,
        local: SgeList::one(Sge { mr: dst.id, offset: 0, len: 18 }),
        remote_addr: secret.addr,
        rkey: secret.rkey,
        signaled: true,
    };
    attack_c.nic().post_send(attack_c.local().id, &[read]).unwrap();
    let mut got: Vec<Completion> = Vec::new();
    for _ in 0..1000 {
        got.extend(attack_c.nic().poll_cq_vec(attack_c.cq(), 16).unwrap());
        if got.iter().any(|c| c.wr_id == 0xbad) {
            break;
        }
        pool.run_until_stalled();
    }
    let c = got.iter().find(|c| c.wr_id == 0xbad).expect("the READ completes");
    assert_ne!(c.status, WcStatus::Success, "a key of another PD reached its memory");
    let mut seen = [0u8; 18];
    attack_c.nic().read_mr(dst.id, 0, &mut seen).unwrap();
    assert_ne!(&seen, b"the victim's bytes");
    // The victim's connection, on the same queue, still serves its client.
    let r = pool.run_until(async {
        let mut b = vclient.alloc().await.unwrap();
        b.copy_from(b"abc").unwrap();
        vclient.call(b"x", Some(b)).await
    });
    let r = r.expect("the victim's call");
    assert_eq!(r.data.as_ref().unwrap().to_vec(), b"cba");
    assert!(victim.is_down().is_none());
}

/// The sharp case of QP number reuse: a frame lands in a QP's receive
/// slot, its completion waits in the endpoint's queue, and the QP is
/// destroyed before the endpoint polls. A QP on an endpoint is connected
/// but not yet running while its bootstrap waits for the client's ready
/// byte: the client sends a request then, and goes away before the ready
/// byte, and the failed handshake drops the QP, its driver not yet run. The
/// next QP gets the same number (and posts the same receive `wr_id`s): the
/// old completion must not reach it as a frame.
#[test]
fn a_completion_left_in_the_queue_by_a_destroyed_qp_never_reaches_the_next_qp_with_its_number() {
    use mwcap::conn::PolicyChoice;
    use mwcap::sim::{FabricConfig, Progress};
    let fabric = Fabric::new(FabricConfig::with_seed(17));
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig { reuse_qpns: true, ..DeviceConfig::spec() }.named("s"));
    let p = Policies::both(Policy::Mw);
    let mut pool = LocalPool::new();
    // A listening endpoint whose driver does not run yet: nothing polls its
    // queue. Building it probes the device, with the fabric moving by
    // itself; from then on nothing moves unless the test says so.
    let (ep, driver) = builder(sn.clone())
        .policy(PolicyChoice::Mw)
        .config(cfg(Role::Server, p).cfg)
        .queue_depth(1 << 14)
        .handshake_timeout(Duration::from_secs(5))
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .unwrap();
    fabric.set_progress(Progress::Manual);
    // A server QP connected to a client's, not on the endpoint yet.
    let (old, mut client) = connected_unadded(&ep, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
    let at = mwcap::sim::QpAddr { device: sn.device(), qpn: old.local().qpn };
    // A request lands in the old QP's receive slot; nothing polls the
    // endpoint's queue.
    client.call(fabric.now(), b"for the old QP only", None).unwrap();
    fabric.run_until_idle();
    client.drive(fabric.now());
    // (The request's SEND is unsignaled: the evidence is the server's side.)
    let landed = fabric.qp_counters(at).expect("its counters").completions;
    assert_eq!(landed, 1, "the request landed in the old QP's receive slot, its completion queued");
    // It is dropped before it runs: its QP is destroyed with its RECV
    // completion still queued.
    drop(old);
    assert_eq!(fabric.qp_state(at), None, "the old QP is destroyed");
    // Its number serves the next connection, from another client.
    let (new, client2) = server_with_link_client(&ep, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
    assert_eq!(new.local().qpn, at.qpn, "the device reused the number");
    let conn = new.connect(&client2.local()).unwrap();
    spawn(&pool, driver.run());
    for _ in 0..50 {
        pool.run_until_stalled();
        fabric.run_until_idle();
    }
    let s = conn.stats();
    assert_eq!(s.frames_received, 0, "the old QP's request reached the new connection: {s:?}");
    assert_eq!(s.requests, 0);
    assert_eq!(s.error_completions, 0);
    assert!(conn.is_down().is_none(), "{:?}", conn.is_down());
    assert_eq!(ep.stats().orphans, 0);
    assert_eq!(ep.stats().added, 1, "only the new QP ever ran");
}

/// A client process dies: its server connections on the endpoint find out
/// by keepalive (the endpoint's timer heap wakes them: the ping goes
/// unanswered, or its SEND runs out of transport retries), go down, give
/// every buffer back and leave the endpoint; the other connections on the
/// endpoint go on.
#[test]
fn peers_that_die_are_found_by_keepalive_on_the_hub_and_the_rest_go_on() {
    let fabric = Fabric::with_seed(19);
    let doomed = fabric.add_device(DeviceConfig::spec().named("doomed"));
    let alive = fabric.add_device(DeviceConfig::spec().named("alive"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = endpoint(&pool, builder(sn).queue_depth(1 << 14));
    // Each client process: an endpoint on its device.
    let doomed_ep = endpoint(&pool, builder(doomed.clone()));
    let alive_ep = endpoint(&pool, builder(alive));
    let p = Policies::both(Policy::Mw);
    let ka =
        mwcap::conn::Keepalive { interval: Duration::from_millis(50), timeout: Duration::from_millis(150) };
    let connect = |client_ep: &Endpoint<SimNic>| {
        let mut scfg = cfg(Role::Server, p);
        scfg.keepalive = Some(ka);
        hubs::pair(client_ep, &sh, cfg(Role::Client, p), scfg)
    };
    let mut dying = Vec::new();
    for _ in 0..4 {
        let (client, server) = connect(&doomed_ep);
        spawn(&pool, serve(server.clone()));
        dying.push((client, server));
    }
    let (client, server) = connect(&alive_ep);
    spawn(&pool, serve(server.clone()));
    // Everyone is served once, then the doomed process dies.
    pool.run_until(async {
        for (c, _) in &dying {
            c.call(b"x", None).await.expect("served before the death");
        }
        client.call(b"x", None).await.expect("served");
    });
    fabric.kill_device(doomed.device());
    let reasons = pool.run_until(futures::future::join_all(dying.into_iter().map(|(_, s)| async move {
        let r = s.finished().await;
        (r, s)
    })));
    for (r, s) in &reasons {
        // The ping finds it: unanswered, or its SEND out of transport retries.
        let found = matches!(r, LossReason::PeerUnresponsive { .. })
            || matches!(r, LossReason::Completion { status: WcStatus::RetryExcErr, .. });
        assert!(found, "{r:?}");
        assert_eq!(s.free_buffers(), 5, "every buffer back");
    }
    assert_eq!(sh.stats().connections, 1, "the dead peers' connections left the endpoint");
    // The surviving connection still works.
    let r = pool.run_until(async {
        let mut b = client.alloc().await.unwrap();
        b.copy_from(b"still here").unwrap();
        client.call(b"x", Some(b)).await
    });
    assert_eq!(r.unwrap().data.as_ref().unwrap().to_vec(), b"ereh llits");
    assert!(server.is_down().is_none());
}

/// The endpoint's own device dies (its process's NIC is gone): the queue
/// fails, every connection on it goes down with the error and finishes, and
/// the driver neither spins nor outlives its handles.
#[test]
fn when_the_hubs_device_dies_every_connection_on_it_ends_and_the_driver_does_not_spin() {
    let fabric = Fabric::with_seed(29);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let (sh, sdrv) = builder(sn.clone()).queue_depth(1 << 14).build().unwrap();
    let hub_done = pool.spawner().spawn_local_with_handle(sdrv.run()).unwrap();
    let ch = endpoint(&pool, builder(cn));
    let p = Policies::both(Policy::Confirm);
    let mut servers = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..8 {
        let (client, server) = hubs::pair(&ch, &sh, cfg(Role::Client, p), cfg(Role::Server, p));
        spawn(&pool, serve(server.clone()));
        servers.push(server);
        clients.push(client);
    }
    pool.run_until(async {
        for c in &clients {
            c.call(b"x", None).await.expect("served");
        }
    });
    sn.kill();
    let ends = pool.run_until(futures::future::join_all(servers.iter().map(|s| s.finished())));
    for r in &ends {
        assert!(matches!(r, LossReason::Nic(_)), "{r:?}");
    }
    let turns = sh.stats().turns;
    // Idle for a while: a driver that spins on the failed queue would take
    // thousands of turns here.
    pool.run_until(async_io::Timer::after(Duration::from_millis(200)));
    assert!(sh.stats().turns - turns < 20, "the driver spins: {:?}", sh.stats());
    assert_eq!(sh.stats().connections, 0);
    drop((sh, servers));
    let stats = pool.run_until(hub_done);
    assert_eq!(stats.connections, 0);
}

/// Two listening endpoints on one device, each driver on a thread of its
/// own (a driver per core): the clients, spread over them, are all
/// served, each endpoint's connections on its one hub; they end when
/// their clients close, and the drivers end with no orphan completion.
#[test]
fn two_endpoints_driven_on_two_threads_serve_their_clients() {
    use mwcap::bootstrap::{Auth, Key};
    use mwcap::conn::{Endpoint, PolicyChoice};
    let fabric = Fabric::with_seed(31);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let key = || Auth::Key(Key::from_bytes(b"two endpoints, two threads: a test key".to_vec()).unwrap());
    let p = Policies::both(Policy::Mw);
    let probes = mwcap::conn::ProbeCache::new();
    let mut servers = Vec::new();
    let mut threads = Vec::new();
    for _ in 0..2 {
        let (server, driver) = Endpoint::builder(sn.new_pd().unwrap(), key())
            .policy(PolicyChoice::Auto)
            .config(cfg(Role::Server, p).cfg)
            .queue_depth(1 << 14)
            .handshake_timeout(Duration::from_secs(5))
            .probe_cache(probes.clone())
            .listen("127.0.0.1:0".parse().unwrap())
            .build()
            .unwrap();
        threads.push(std::thread::spawn(move || futures::executor::block_on(driver.run())));
        servers.push(server);
    }
    assert_eq!(probes.probes_run(), 1, "one probe for the device of both endpoints");
    let mut pool = LocalPool::new();
    let (client, cd) = Endpoint::builder(cn, key())
        .config(cfg(Role::Client, p).cfg)
        .handshake_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    spawn(&pool, cd.run());
    const CLIENTS: usize = 20;
    let served = serve_clients(&mut pool, &servers, CLIENTS, &client);
    assert!(served.iter().all(|&ok| ok));
    let counts: Vec<u64> = servers.iter().map(|s| s.stats().added).collect();
    assert_eq!(counts, [10, 10]);
    assert_eq!(client.stats().added, CLIENTS as u64, "the client's connections share its one hub");
    // Servers end when their clients close.
    for _ in 0..500 {
        pool.run_until_stalled();
        if servers.iter().all(|s| s.stats().connections == 0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        servers.iter().all(|s| s.stats().connections == 0),
        "{:?}",
        servers.iter().map(|s| s.stats()).collect::<Vec<_>>()
    );
    drop(servers);
    drop(pool);
    for t in threads {
        assert_eq!(t.join().unwrap().orphans, 0);
    }
}

/// An endpoint whose driver is dropped, then its handle, with a connection
/// on it: the queue stays while a QP is on it, and goes with the
/// connection's last handle, after its QP (not left behind, busy, as it
/// was).
#[test]
fn dropping_a_hub_and_its_driver_destroys_its_connections_before_its_queue() {
    let fabric = Fabric::with_seed(37);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let (ep, driver) = builder(sn.clone()).queue_depth(1 << 12).build().unwrap();
    let (s, client) = server_with_link_client(&ep, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
    let server_qp = mwcap::sim::QpAddr { device: sn.device(), qpn: s.local().qpn };
    let cq = s.link().cq();
    let server = s.connect(&client.local()).unwrap();
    drop(driver);
    drop(ep);
    // The connection's handle is still held: its QP lives, and so does the
    // queue under it.
    assert!(fabric.qp_state(server_qp).is_some());
    assert!(sn.poll_cq_vec(cq, 1).is_ok(), "the queue went while a QP was on it");
    drop(server);
    assert_eq!(fabric.qp_state(server_qp), None, "the server's QP outlived its last handle");
    assert!(sn.poll_cq_vec(cq, 1).is_err(), "the endpoint's queue was left behind");
}

/// `Reconnecting` over an endpoint: a client whose connection the server
/// drops comes back by itself, on the endpoint's same hub, and the first
/// connection's place on the hub is given back.
#[test]
fn a_reconnecting_client_comes_back_on_its_endpoints_hub() {
    use mwcap::bootstrap::{Auth, Key};
    use mwcap::conn::{Backoff, Endpoint, PolicyChoice, Reconnecting};
    let fabric = Fabric::with_seed(41);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let key = || Auth::Key(Key::from_bytes(b"reconnecting on a hub: a test key".to_vec()).unwrap());
    let p = Policies::both(Policy::Mw);
    let (server, sd) = Endpoint::builder(sn, key())
        .policy(PolicyChoice::Auto)
        .config(cfg(Role::Server, p).cfg)
        .handshake_timeout(Duration::from_secs(5))
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .unwrap();
    let addr = server.local_addr().unwrap();
    let mut pool = LocalPool::new();
    let (endpoint, cd) = Endpoint::builder(cn, key())
        .config(cfg(Role::Client, p).cfg)
        .queue_depth(1 << 12)
        .handshake_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    spawn(&pool, sd.run());
    spawn(&pool, cd.run());
    let backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(50));
    let (client, supervisor) = Reconnecting::new(endpoint.clone(), addr, backoff);
    spawn(&pool, supervisor);
    // The server takes the first connection, serves one call, then closes
    // it (its bootstrap stream goes with it); then serves the next one.
    let spawner = pool.spawner();
    pool.spawner()
        .spawn_local(async move {
            let conn = server.accept().await.expect("the first connection");
            spawner.spawn_local(serve(conn.clone())).unwrap();
            async_io::Timer::after(Duration::from_millis(100)).await;
            conn.close();
            let conn = server.accept().await.expect("the reconnection");
            spawner.spawn_local(serve(conn)).unwrap();
        })
        .unwrap();
    let call = |conn: Connection<SimNic>| async move {
        let mut b = conn.alloc().await.unwrap();
        b.copy_from(b"abc").unwrap();
        let r = conn.call(b"x", Some(b)).await?;
        Ok::<_, mwcap::conn::CallError>(r.data.as_ref().unwrap().to_vec())
    };
    let first = pool.run_until(client.connection()).expect("connected");
    assert_eq!(pool.run_until(call(first.clone())).expect("served"), b"cba");
    pool.run_until(first.closed());
    let second = pool.run_until(async {
        loop {
            let c = client.connection().await.expect("reconnected");
            if c.is_down().is_none() {
                return c;
            }
            async_io::Timer::after(Duration::from_millis(5)).await;
        }
    });
    assert_eq!(pool.run_until(call(second)).expect("served again"), b"cba");
    assert_eq!(endpoint.stats().added, 2, "{:?}", endpoint.stats());
    for _ in 0..400 {
        if endpoint.stats().connections == 1 {
            break;
        }
        pool.run_until(async_io::Timer::after(Duration::from_millis(5)));
    }
    assert_eq!(endpoint.stats().connections, 1, "the first connection's place was not given back");
    assert_eq!(client.stats().connects, 2);
    client.stop();
}

/// `EndpointBuilder::busy_poll`: an idle endpoint keeps polling for the
/// window, then sleeps; without it, it sleeps at once. (The window is set
/// when the endpoint is built: each window has a client endpoint of its
/// own, on one device, against one server endpoint.) The client's calls
/// do not spin (`Config::busy_poll` 0), so the driver alone takes the
/// turns: a call that spins would take some of them itself, and its end
/// rings the driver (`ready::ReadyList::stop`), whatever the driver's
/// window.
#[test]
fn a_hub_busy_polls_for_its_window_then_sleeps() {
    let fabric = Fabric::with_seed(11);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = endpoint(&pool, builder(sn).queue_depth(1 << 12));
    let p = Policies::both(Policy::Mw);
    // A client endpoint with busy-poll `window` and a connection on it, served.
    let client = |pool: &LocalPool, window: Duration| {
        let ch = endpoint(pool, builder(cn.new_pd().unwrap()).queue_depth(1 << 12).busy_poll(window));
        let mut ccfg = cfg(Role::Client, p);
        ccfg.busy_poll = Duration::ZERO;
        let (c, s) = hubs::pair(&ch, &sh, ccfg, cfg(Role::Server, p));
        spawn(pool, serve(s));
        (ch, c)
    };
    let idle_turns = |pool: &mut LocalPool, ep: &Endpoint<SimNic>, ms: u64| {
        let (t0, s0) = (ep.stats().turns, ep.stats().sleeps);
        pool.run_until(async_io::Timer::after(Duration::from_millis(ms)));
        (ep.stats().turns - t0, ep.stats().sleeps - s0)
    };
    // Without a window: a call, then idle: a handful of turns and a sleep.
    let (ch, c) = client(&pool, Duration::ZERO);
    pool.run_until(c.call(b"x", None)).unwrap();
    let (turns, _) = idle_turns(&mut pool, &ch, 20);
    assert!(turns < 10, "an endpoint without busy polling took {turns} turns idle");
    // With a 2 s window: it keeps polling (turns) without sleeping ...
    let (ch, c) = client(&pool, Duration::from_secs(2));
    pool.run_until(c.call(b"x", None)).unwrap();
    let (turns, sleeps) = idle_turns(&mut pool, &ch, 20);
    assert!(turns > 100 && sleeps == 0, "{turns} turns and {sleeps} sleeps in the window");
    // ... and after a short one it sleeps again.
    let (ch, c) = client(&pool, Duration::from_millis(5));
    pool.run_until(c.call(b"x", None)).unwrap();
    pool.run_until(async_io::Timer::after(Duration::from_millis(50)));
    let (turns, _) = idle_turns(&mut pool, &ch, 50);
    assert!(turns < 10, "the endpoint did not sleep after its window: {turns} turns");
}

/// The windows of replies the server exposed to `victims` hand-driven
/// clients that never read them, and one more hand-driven client (the
/// attacker) whose peer sends a SEND_WITH_INV naming each of those windows,
/// back to back (one post: they arrive in one batch), on a server endpoint
/// on a device of `dev`. Returns the fabric, the pool, the victims' server
/// connections, the attacker's, the windows' rkeys, and the client links
/// (to keep: a link dropped destroys its QP).
#[allow(clippy::type_complexity)]
fn invalidation_by_another_connection(
    dev: DeviceConfig,
    victims: usize,
    attacker_spins: bool,
) -> (Fabric, LocalPool, Vec<Connection<SimNic>>, Connection<SimNic>, Vec<u32>, Vec<mwcap::conn::Link<SimNic>>)
{
    let fabric = Fabric::with_seed(17);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(dev.named("s"));
    let mut pool = LocalPool::new();
    let sh = endpoint(&pool, builder(sn.clone()).queue_depth(1 << 14));
    let p = Policies::both(Policy::Mw);
    let mut conns = Vec::new();
    let mut links = Vec::new();
    let mut rkeys = Vec::new();
    for v in 0..victims {
        let (victim_s, mut victim_c) =
            server_with_link_client(&sh, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
        let victim_qp = victim_s.link().nic().qp_addr(victim_s.link().local().id).unwrap();
        let victim = victim_s.connect(&victim_c.local()).unwrap();
        spawn(&pool, serve(victim.clone()));
        // The victim's client calls with 3000 bytes (not inline) and is then
        // driven only until its request is out: the reply's window stays bound.
        let mut b = victim_c.alloc().unwrap();
        b.copy_from(&pattern(v, 3000)).unwrap();
        victim_c.call(Duration::ZERO, b"x", Some(b)).unwrap();
        let bound = |fabric: &Fabric| {
            fabric.windows(sn.device()).into_iter().find_map(|(_, w)| match w {
                mwcap::sim::WindowState::Bound { rkey, qp, .. } if qp == victim_qp => Some(rkey),
                _ => None,
            })
        };
        let mut rkey = None;
        for _ in 0..2000 {
            victim_c.drive(Duration::ZERO);
            pool.run_until_stalled();
            rkey = bound(&fabric);
            if rkey.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let rkey = rkey.unwrap_or_else(|| {
            panic!(
                "the server bound no window for its reply: {:?}; victim {:?} {:?}; client {:?}",
                fabric.windows(sn.device()),
                victim.is_down(),
                victim.stats(),
                victim_c.stats()
            )
        });
        conns.push(victim);
        links.push(victim_c);
        rkeys.push(rkey);
    }
    let mut attack_cfg = cfg(Role::Server, p);
    if attacker_spins {
        // Its server waits for requests polling the queue itself, so the
        // attack lands in a waiter's turn, not in the driver's.
        attack_cfg.serve_busy_poll = Duration::from_secs(10);
    }
    let (attack_s, attack_c) = server_with_link_client(&sh, &cn, attack_cfg, cfg(Role::Client, p));
    let attacked = attack_s.connect(&attack_c.local()).unwrap();
    pool.run_until_stalled();
    if attacker_spins {
        // Spawned last: a waiter in its spin window never lets the pool stall.
        spawn(&pool, serve(attacked.clone()));
        pool.run_until(async_io::Timer::after(Duration::from_millis(5)));
    }
    // The attacker's peer invalidates them through its own connection.
    let wrs: Vec<SendWr> = rkeys
        .iter()
        .map(|&rkey| SendWr::SendWithInv {
            wr_id: 0xbad,
            signaled: true,
            sge: SgeList::new(),
            invalidate_rkey: rkey,
        })
        .collect();
    attack_c.nic().post_send(attack_c.local().id, &wrs).unwrap();
    links.push(attack_c);
    (fabric, pool, conns, attacked, rkeys, links)
}

/// Run `fabric` and `pool` (real time, the endpoint's timers) until `done`
/// or 3 s.
fn run_until(fabric: &Fabric, pool: &mut LocalPool, mut done: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while !done() {
        if t0.elapsed() > Duration::from_secs(3) {
            return false;
        }
        fabric.run_until_idle();
        pool.run_until(async_io::Timer::after(Duration::from_millis(2)));
    }
    true
}

/// rxe looks an invalidated key up across the whole device: a peer on one
/// connection of an endpoint invalidates a window bound to another's queue
/// pair. The endpoint finds whose window it was: that connection never
/// invalidates it again (on rxe the second invalidation panics the kernel;
/// the simulator records it as a would-crash-rxe hazard), it goes down
/// (`InvalidatedElsewhere`, not blamed on its peer) and its buffers come
/// back at its QP's destroy; the attacker's connection is closed as misbehaving.
/// Without the endpoint's search, the victim's lease expiry posted the
/// second LOCAL_INV.
#[test]
fn on_rxe_a_peer_that_invalidates_another_connections_window_never_makes_it_invalidated_twice() {
    rxe_invalidations_by_another_connection(1, false);
}

/// As above with two victims, their windows invalidated by two
/// SEND_WITH_INVs that reach the attacker's connection in one batch: each
/// victim is told. (Before, the connection kept one such rkey per turn:
/// the second overwrote the first, whose victim later invalidated its
/// window again.)
#[test]
fn on_rxe_two_windows_invalidated_at_once_through_another_connection_are_both_found() {
    rxe_invalidations_by_another_connection(2, false);
}

/// As the first, with the attacked connection's server waiting for
/// requests in a spin window (`serve_busy_poll`): the attack lands in the
/// waiter's own turn, which hands the rkey to the endpoint as the driver's
/// turn does. (Before, a waiter's turn dropped it: the victim was never
/// told, and its expiry invalidated the window a second time.)
#[test]
fn on_rxe_an_invalidation_found_by_a_waiters_turn_reaches_the_windows_owner() {
    rxe_invalidations_by_another_connection(1, true);
}

fn rxe_invalidations_by_another_connection(n: usize, attacker_spins: bool) {
    let (fabric, mut pool, victims, attacked, rkeys, _links) =
        invalidation_by_another_connection(DeviceConfig::rxe(), n, attacker_spins);
    let done = run_until(&fabric, &mut pool, || {
        victims.iter().all(|v| v.is_down().is_some()) && attacked.is_down().is_some()
    });
    assert!(
        done,
        "victims {:?}, attacked {:?}",
        victims.iter().map(|v| v.is_down()).collect::<Vec<_>>(),
        attacked.is_down()
    );
    assert_eq!(
        attacked.is_down(),
        Some(LossReason::PeerMisbehaved(mwcap::conn::Misbehavior::SendWithInvalidate { rkey: rkeys[0] }))
    );
    for victim in &victims {
        assert_eq!(
            victim.is_down(),
            Some(LossReason::LeaseEngine(mwcap_mw::LossCause::InvalidatedElsewhere))
        );
    }
    // Past the replies' lease (300 ms), when each victim's expiry would
    // have invalidated its window: every connection finishes, every buffer
    // back, and nothing was invalidated twice.
    let all: Vec<_> = victims.iter().chain([&attacked]).cloned().collect();
    pool.run_until(async move { futures::future::join_all(all.iter().map(|c| c.finished())).await });
    pool.run_until(async_io::Timer::after(Duration::from_millis(400)));
    assert!(fabric.would_crash_rxe().is_empty(), "{:?}", fabric.would_crash_rxe());
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A device that follows the specification refuses the same SEND_WITH_INV
/// (a type-2B window is invalidated only through its own queue pair): the
/// attacker's connection fails at the NIC, the victim's window stays bound
/// and its connection stays up.
#[test]
fn on_a_spec_nic_a_peer_cannot_invalidate_another_connections_window() {
    let (fabric, mut pool, victims, attacked, _, _links) =
        invalidation_by_another_connection(DeviceConfig::spec(), 1, false);
    let victim = &victims[0];
    assert!(run_until(&fabric, &mut pool, || attacked.is_down().is_some()));
    assert!(
        matches!(attacked.is_down(), Some(LossReason::Completion { status: WcStatus::RemInvReqErr, .. })),
        "{:?}",
        attacked.is_down()
    );
    pool.run_until(async_io::Timer::after(Duration::from_millis(20)));
    assert_eq!(victim.is_down(), None);
    assert!(fabric.would_crash_rxe().is_empty());
}

/// A call's timeout fires even when nothing else happens on its
/// connection: here the server takes every request and never answers, so
/// no completion comes for the client's second call (its SEND completes
/// unsignaled). Before the fix the first call's timer, once fired, was
/// still taken for armed, the second call did not ring the driver to arm
/// its own, and it waited for ever.
#[test]
fn a_second_call_times_out_when_its_server_never_answers() {
    let (_fabric, ch, sh, mut pool) = two_endpoints(DeviceConfig::spec(), 1 << 14);
    let mut ccfg = cfg(Role::Client, Policies::both(Policy::Mw));
    ccfg.call_timeout = Duration::from_millis(100);
    let (client, server) = hubs::pair(&ch, &sh, ccfg, cfg(Role::Server, Policies::both(Policy::Mw)));
    // The server keeps every request and answers none.
    spawn(&pool, async move {
        let mut kept = Vec::new();
        while let Some(req) = server.next_request().await {
            kept.push(req);
        }
    });
    for k in 0..3 {
        let call = client.call(b"x", None);
        let guard = async_io::Timer::after(Duration::from_secs(5));
        let r = pool.run_until(async {
            futures::pin_mut!(call);
            match futures::future::select(call, guard).await {
                futures::future::Either::Left((r, _)) => Some(r),
                futures::future::Either::Right(_) => None,
            }
        });
        let r = r.unwrap_or_else(|| panic!("call {k} never ended (its timeout is 100 ms)"));
        assert!(matches!(r, Err(mwcap::conn::CallError::TimedOut)), "call {k}: {r:?}");
    }
}

/// An endpoint whose queue is deeper than the device's `max_cqe` is
/// refused with `CqTooDeep` (naming both), not built on a smaller queue
/// that could overflow; one exactly as deep is built. Nothing is left
/// behind by the refusal.
#[test]
fn a_queue_deeper_than_the_device_holds_is_refused() {
    use mwcap::backend::NicError;
    const MAX: u32 = 32_767; // rxe's
    let fabric = Fabric::with_seed(60);
    let nic = fabric.add_device(DeviceConfig::rxe().with_max_cqe(MAX).named("rxe-like"));
    let dev = nic.device();
    for shared in [false, true] {
        let b = builder(nic.clone()).queue_depth(MAX + 1);
        let b = if shared {
            b.policy(mwcap::conn::PolicyChoice::Mw).shared_receives(Default::default())
        } else {
            b
        };
        let before = fabric.created(dev);
        match b.build() {
            Err(SetupError::Nic(NicError::CqTooDeep { depth, max })) => {
                assert_eq!((depth, max), (MAX + 1, MAX))
            }
            Err(e) => panic!("shared receives {shared}: {e:?}"),
            Ok(_) => panic!("shared receives {shared}: a queue of {} entries on a device of {MAX}", MAX + 1),
        }
        assert_eq!(fabric.created(dev).cqs, before.cqs, "shared receives {shared}: no queue made");
    }
    let (ep, _driver) = builder(nic).queue_depth(MAX).build().expect("as deep as the device holds");
    drop(ep);
}

/// A server connection whose serving wait spins with a long window
/// (`serve_busy_poll` of 50 ms: it lingers), and a second connection on the
/// same endpoint whose server waits without spinning. The spinning wait is
/// polled once, then again only after its window ended (a busy executor, a
/// preempted thread), when the driver has handed its request over. Its stop
/// must leave the driver watching the queue: before the fix it lingered
/// without looking at the window, the driver (whose loop after the window's
/// end saw the waiter counted and no window open) slept with the queue
/// unarmed and no alarm, and the other connection's call got no answer.
#[test]
fn a_wait_polled_after_its_window_ended_leaves_the_queue_watched() {
    use futures::executor::block_on;
    use futures::future::{select, Either};
    use std::future::Future;
    use std::task::{Context, Poll};

    fn connect_on(
        ce: &Endpoint<SimNic>,
        se: &Endpoint<SimNic>,
        scfg: mwcap::conn::Config,
    ) -> (Connection<SimNic>, Connection<SimNic>) {
        let p = Policies::both(Policy::Mw);
        let c = ce.prepare(Role::Client, p, mwcap::conn::Config::default()).unwrap();
        let s = se.prepare(Role::Server, p, scfg).unwrap();
        let (cl, sl) = (c.local(), s.local());
        (c.connect(&sl).unwrap(), s.connect(&cl).unwrap())
    }
    /// Whether a call on `c` is answered within `limit`.
    fn answered(c: &Connection<SimNic>, limit: Duration) -> bool {
        let r = block_on(select(Box::pin(c.call(b"b", None)), async_io::Timer::after(limit)));
        matches!(r, Either::Left((Ok(_), _)))
    }

    let fabric = Fabric::with_seed(21);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let auth = || mwcap::bootstrap::Auth::Unauthenticated;
    let (ce, cd) = Endpoint::builder(cn, auth()).build().unwrap();
    let (se, sd) = Endpoint::builder(sn, auth()).build().unwrap();
    let mut lingering = mwcap::conn::Config::default();
    lingering.serve_busy_poll = Duration::from_millis(50);
    let (ca, sa) = connect_on(&ce, &se, lingering);
    let (cb, sb) = connect_on(&ce, &se, mwcap::conn::Config::default());
    let drivers =
        [std::thread::spawn(move || block_on(cd.run())), std::thread::spawn(move || block_on(sd.run()))];
    let sb2 = sb.clone();
    let serving_b = std::thread::spawn(move || {
        block_on(async {
            while let Some(req) = sb2.next_request().await {
                let _ = sb2.reply(req.id, 0, b"echo", None).await;
            }
        })
    });
    assert!(answered(&cb, Duration::from_secs(2)), "B answers at first");
    std::thread::sleep(Duration::from_millis(20));
    // A's serving wait, polled once: it spins, its window open for 50 ms.
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut wait = Box::pin(sa.next_request());
    assert!(wait.as_mut().poll(&mut cx).is_pending());
    let ca2 = ca.clone();
    let calling_a = std::thread::spawn(move || block_on(ca2.call(b"a", None)).is_ok());
    // Polled again only after its window ended; the driver has handed the
    // request over meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    let req = loop {
        match wait.as_mut().poll(&mut cx) {
            Poll::Ready(r) => break r.expect("A's request"),
            Poll::Pending => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    drop(wait);
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        answered(&cb, Duration::from_secs(3)),
        "B's call got no answer: the server's driver was left unwatched"
    );
    block_on(sa.reply(req.id, 0, b"a", None)).unwrap();
    assert!(calling_a.join().unwrap());
    for c in [&ca, &cb, &sa, &sb] {
        c.close();
    }
    drop((ce, se));
    serving_b.join().unwrap();
    for d in drivers {
        d.join().unwrap();
    }
}

/// On rxe any QP of the device can invalidate any window (trusted peers
/// only). A server QP connected to a peer's but never put on the endpoint
/// (a listener left one so while it waited for the client's ready byte,
/// until it waited for that byte to connect; an application's own
/// bootstrap may still) takes a SEND_WITH_INV with another connection's
/// window key, then goes: its QP never got a connection, and the receive's
/// completion, held for it, went to nobody. The owner of the window was
/// never told and invalidated it again at its expiry (a kernel panic on
/// rxe). Now the driver finds the owner as the completion is held.
#[test]
fn an_invalidation_through_a_qp_with_no_connection_reaches_the_windows_owner() {
    let fabric = Fabric::with_seed(17);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::rxe().named("s"));
    let p = Policies::both(Policy::Mw);
    let mut pool = LocalPool::new();
    let (ep, driver) = builder(sn.clone()).queue_depth(1 << 14).build().unwrap();
    spawn(&pool, driver.run());
    // The victim: a server connection whose reply window stays bound.
    let (victim_s, mut victim_c) =
        server_with_link_client(&ep, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
    let victim_qp = victim_s.link().nic().qp_addr(victim_s.link().local().id).unwrap();
    let victim = victim_s.connect(&victim_c.local()).unwrap();
    spawn(&pool, serve(victim.clone()));
    let mut b = victim_c.alloc().unwrap();
    b.copy_from(&hubs::pattern(0, 3000)).unwrap();
    victim_c.call(Duration::ZERO, b"x", Some(b)).unwrap();
    let mut rkey = None;
    for _ in 0..2000 {
        victim_c.drive(Duration::ZERO);
        pool.run_until_stalled();
        rkey = fabric.windows(sn.device()).into_iter().find_map(|(_, w)| match w {
            mwcap::sim::WindowState::Bound { rkey, qp, .. } if qp == victim_qp => Some(rkey),
            _ => None,
        });
        if rkey.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let rkey = rkey.expect("the victim bound a window for its reply");
    // A second server QP, connected to an attacker's and not on the
    // endpoint (as an application's own bootstrap may leave one).
    let (unadded, mut attacker) = connected_unadded(&ep, &cn, cfg(Role::Server, p), cfg(Role::Client, p));
    // It invalidates the victim's window (rxe: any QP).
    let wr = SendWr::SendWithInv { wr_id: 0xbad, signaled: true, sge: SgeList::new(), invalidate_rkey: rkey };
    attacker.nic().post_send(attacker.local().id, &[wr]).unwrap();
    for _ in 0..2000 {
        attacker.drive(fabric.now());
        pool.run_until_stalled();
        let gone = fabric
            .windows(sn.device())
            .into_iter()
            .any(|(_, w)| matches!(w, mwcap::sim::WindowState::Invalidated { .. }));
        if gone {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // It goes before it ran: the QP goes.
    drop(unadded);
    // Past the victim's lease: its expiry must not invalidate the window again.
    pool.run_until(async_io::Timer::after(Duration::from_millis(600)));
    assert!(fabric.would_crash_rxe().is_empty(), "{:?}", fabric.would_crash_rxe());
    // The owner went down for it, as when the news comes through a QP
    // with a connection.
    assert!(
        matches!(victim.is_down(), Some(LossReason::LeaseEngine(mwcap_mw::LossCause::InvalidatedElsewhere))),
        "{:?}",
        victim.is_down()
    );
}

/// A connection whose QP cannot be destroyed keeps its entries of the
/// endpoint's completion queue (the QP may still complete work there, so
/// no new QP may count on them), what it completes later is an orphan,
/// and the endpoint goes on; the entries come back only with a destroy
/// that works (here, the link's second try as it goes).
#[test]
fn a_qp_that_cannot_be_destroyed_keeps_its_completion_queue_entries() {
    let fabric = Fabric::with_seed(12);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let ch = endpoint(&pool, builder(cn).queue_depth(4096));
    let sh = endpoint(&pool, builder(sn.clone()).queue_depth(4096));
    let p = Policies::both(Policy::Mw);
    let (client, server) = pair(&ch, &sh, p);
    spawn(&pool, serve(server.clone()));
    pool.run_until(async { client.call(b"x", None).await.expect("served") });
    let reserved = sh.stats().reserved_entries;
    // Its destroy fails once: at the close, not at the link's retry.
    sn.fail_next(mwcap::sim::Verb::DestroyQp, 1);
    server.close();
    let why = pool.run_until(server.finished());
    assert!(matches!(why, LossReason::Closed), "{why:?}");
    let stuck = sh.stats();
    assert_eq!(stuck.reserved_entries, reserved, "its entries stay reserved: {stuck:?}");
    assert_eq!(stuck.connections, 0, "it is no connection any more: {stuck:?}");
    // The endpoint goes on: a new connection is served.
    let (c2, s2) = pair(&ch, &sh, p);
    spawn(&pool, serve(s2.clone()));
    pool.run_until(async { c2.call(b"y", None).await.expect("served") });
    let with_two = sh.stats().reserved_entries;
    let one = with_two - reserved;
    assert!(one > 0);
    // The last handle goes: the link tries the destroy again, which works,
    // and the stuck connection's entries come back.
    drop(server);
    pool.run_until(async_io::Timer::after(Duration::from_millis(50)));
    let after = sh.stats();
    assert_eq!(after.reserved_entries, with_two - one, "{after:?}");
    drop((client, c2, s2));
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}
