//! [`CqRouter`]: many endpoints on one completion queue, driven by the
//! caller's own loop (sans-IO), on the simulated NIC.

use std::collections::HashMap;
use std::time::Duration;

use mwcap::backend::Nic;
use mwcap::conn::{Config, CqRouter, Event, Link, Policies, Policy, Role, SetupError, SrqConfig};
use mwcap::sim::{DeviceConfig, Fabric, FabricConfig, Progress, SimNic};

fn cfg(role: Role, p: Policies) -> Config {
    let mut c = Config::new(role, p);
    c.buffers = 4;
    c.large_buffers = vec![mwcap::conn::BufClass { size: 256 * 1024, count: 1 }];
    c.ctrl_slots = 16;
    c.lease_time = Duration::from_millis(300);
    c.safety_margin = Duration::from_millis(50);
    c.call_timeout = Duration::from_secs(3);
    c
}

fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| ((k * 31 + i * 7) % 251) as u8).collect()
}

struct World {
    fabric: Fabric,
    router: CqRouter<SimNic>,
    servers: HashMap<u32, Link<SimNic>>,
    clients: Vec<Link<SimNic>>,
}

impl World {
    fn new(srq: Option<SrqConfig>, n: usize, policies: impl Fn(usize) -> Policies) -> World {
        let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(41) });
        let cn = fabric.add_device(DeviceConfig::spec().named("c"));
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let router = match srq {
            Some(q) => CqRouter::with_shared_receives(sn, 1 << 14, q).unwrap(),
            None => CqRouter::new(sn, 1 << 14).unwrap(),
        };
        let mut servers = HashMap::new();
        let mut clients = Vec::new();
        for i in 0..n {
            let p = policies(i);
            let mut s = router
                .prepare(router.connection_nic().unwrap(), cfg(Role::Server, p))
                .unwrap()
                .finish(p)
                .unwrap();
            let mut c = Link::new(cn.new_pd().unwrap(), cfg(Role::Client, p)).unwrap();
            c.connect(&s.local()).unwrap();
            s.connect(&c.local()).unwrap();
            servers.insert(s.local().qpn, s);
            clients.push(c);
        }
        World { fabric, router, servers, clients }
    }

    /// One turn of the caller's loop: the fabric, the router, every
    /// endpoint; servers answer each request with its payload reversed.
    fn turn(&mut self, replies: &mut Vec<(usize, Vec<u8>)>, failures: &mut usize) {
        self.fabric.run_until_idle();
        let now = self.fabric.now();
        self.router.poll(now, &mut self.servers).unwrap();
        for s in self.servers.values_mut() {
            s.drive(now);
            s.handle_timeout(now);
            while let Some(e) = s.poll_event() {
                if let Event::Request { req, data, .. } = e {
                    let mut bytes = data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                    drop(data);
                    bytes.reverse();
                    let out = if bytes.is_empty() {
                        None
                    } else {
                        let mut b = s.alloc_for(bytes.len()).unwrap().expect("a server buffer");
                        b.copy_from(&bytes).unwrap();
                        Some(b)
                    };
                    s.reply(now, req, 0, b"echo", out).unwrap();
                }
            }
        }
        for (i, c) in self.clients.iter_mut().enumerate() {
            c.drive(now);
            c.handle_timeout(now);
            while let Some(e) = c.poll_event() {
                match e {
                    Event::Reply { data, .. } => {
                        replies.push((i, data.as_ref().map(|d| d.to_vec()).unwrap_or_default()));
                    }
                    Event::CallFailed { .. } => *failures += 1,
                    _ => {}
                }
            }
        }
    }
}

/// Twenty servers on one router (mixed policies), each client making calls
/// with payloads from none to a large buffer: every reply holds exactly its
/// own call's bytes, reversed; nothing is orphaned; closing them all gives
/// every reservation back.
#[test]
fn twenty_endpoints_on_one_router_each_get_their_own_answers() {
    let mut w = World::new(None, 20, |i| {
        if i % 2 == 0 {
            Policies::both(Policy::Mw)
        } else {
            Policies::both(Policy::Confirm)
        }
    });
    assert_eq!(w.router.stats().connections, 20);
    let sizes = [0usize, 100, 3000, 200_000];
    let mut expected: Vec<Vec<Vec<u8>>> = vec![Vec::new(); 20];
    for (k, &len) in sizes.iter().enumerate() {
        let now = w.fabric.now();
        for (i, c) in w.clients.iter_mut().enumerate() {
            let data = (len > 0).then(|| {
                let mut b = c.alloc_for(len).unwrap().expect("a client buffer");
                b.copy_from(&pattern(i * 10 + k, len)).unwrap();
                b
            });
            c.call(now, b"x", data).map_err(|r| r.error).unwrap();
            let mut want = pattern(i * 10 + k, len);
            want.reverse();
            expected[i].push(if len == 0 { Vec::new() } else { want });
        }
    }
    let (mut replies, mut failures) = (Vec::new(), 0);
    for _ in 0..2000 {
        w.turn(&mut replies, &mut failures);
        if replies.len() == 20 * sizes.len() {
            break;
        }
    }
    assert_eq!(failures, 0);
    assert_eq!(replies.len(), 80, "every call answered");
    for (i, bytes) in replies {
        let k = expected[i]
            .iter()
            .position(|e| *e == bytes)
            .unwrap_or_else(|| panic!("conn {i}: bytes not its own"));
        expected[i].remove(k);
    }
    let st = w.router.stats();
    assert_eq!(st.orphans, 0);
    assert!(st.completions >= 80, "{st:?}");
    // Close every server endpoint: its QP is destroyed through the router,
    // which forgets it and gives its reservation back.
    let now = w.fabric.now();
    for s in w.servers.values_mut() {
        s.finish_close(now);
    }
    assert_eq!(w.router.stats().connections, 0);
    assert_eq!(w.router.stats().reserved_entries, 0);
    drop(w.servers);
    drop(w.router);
    assert!(w.fabric.hazards().is_empty(), "{:?}", w.fabric.hazards());
}

/// A destroyed QP's completions left in the queue never reach the next QP
/// with its number: the router takes them out when the QP goes.
#[test]
fn a_reused_qp_number_never_gets_the_old_qps_completions_through_the_router() {
    let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(17) });
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig { reuse_qpns: true, ..DeviceConfig::spec() }.named("s"));
    let router = CqRouter::new(sn, 1 << 14).unwrap();
    let p = Policies::both(Policy::Mw);
    let on_router = || {
        let mut s = router
            .prepare(router.connection_nic().unwrap(), cfg(Role::Server, p))
            .unwrap()
            .finish(p)
            .unwrap();
        let mut c = Link::new(cn.new_pd().unwrap(), cfg(Role::Client, p)).unwrap();
        c.connect(&s.local()).unwrap();
        s.connect(&c.local()).unwrap();
        (s, c)
    };
    let (old, mut client) = on_router();
    client.call(fabric.now(), b"for the old QP only", None).unwrap();
    fabric.run_until_idle();
    client.drive(fabric.now());
    let old_qpn = old.local().qpn;
    drop(old); // destroyed with the request's completion still queued
    let (new, _client2) = on_router();
    assert_eq!(new.local().qpn, old_qpn, "the device reused the number");
    let mut servers = HashMap::from([(new.local().qpn, new)]);
    for _ in 0..20 {
        fabric.run_until_idle();
        router.poll(fabric.now(), &mut servers).unwrap();
    }
    let s = servers[&old_qpn].stats();
    assert_eq!(s.frames_received, 0, "the old QP's request reached the new endpoint: {s:?}");
    assert_eq!(router.stats().orphans, 0);
    assert!(router.stats().retired >= 1, "{:?}", router.stats());
}

/// With shared receives: the servers' QPs take their receives from the
/// router's SRQ, calls are answered, and every share comes back.
#[test]
fn a_router_with_shared_receives_serves_its_endpoints_from_one_srq() {
    let q = SrqConfig { chunk: 32, max_slots: 512 };
    let mut w = World::new(Some(q), 12, |_| Policies::both(Policy::Mw));
    assert_eq!(w.router.stats().srq.unwrap().shares, 12 * 8);
    let (mut replies, mut failures) = (Vec::new(), 0);
    for round in 0..5usize {
        let now = w.fabric.now();
        for (i, c) in w.clients.iter_mut().enumerate() {
            for k in 0..3usize {
                let mut b = c.alloc_for(500).unwrap().expect("a client buffer");
                b.copy_from(&pattern(i + k + round, 500)).unwrap();
                c.call(now, b"x", Some(b)).map_err(|r| r.error).unwrap();
            }
        }
        let want = (round + 1) * 12 * 3;
        for _ in 0..2000 {
            w.turn(&mut replies, &mut failures);
            if replies.len() == want {
                break;
            }
        }
        assert_eq!(replies.len(), want);
    }
    assert_eq!(failures, 0);
    let st = w.router.stats();
    let srq = st.srq.unwrap();
    assert!(srq.frames >= 180 && srq.grown > 0 && srq.shares <= srq.slots, "{srq:?}");
    let now = w.fabric.now();
    for s in w.servers.values_mut() {
        s.finish_close(now);
    }
    assert_eq!(w.router.stats().srq.unwrap().shares, 0, "every share came back");
    assert!(w.fabric.hazards().is_empty(), "{:?}", w.fabric.hazards());
}

/// The router refuses an endpoint its queue cannot hold, and takes it once
/// another leaves.
#[test]
fn a_router_refuses_what_its_queue_cannot_hold() {
    let fabric = Fabric::with_seed(3);
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let router = CqRouter::new(sn, 100).unwrap();
    let first = router.prepare(router.connection_nic().unwrap(), cfg(Role::Server, p)).unwrap();
    let need = router.stats().reserved_entries;
    assert!(need > 50, "one endpoint reserves {need}: the test needs two not to fit in 100");
    match router.prepare(router.connection_nic().unwrap(), cfg(Role::Server, p)) {
        Err(SetupError::CqBudget { depth: 100, .. }) => {}
        other => panic!("{:?}", other.map(|p| p.local())),
    }
    drop(first);
    assert_eq!(router.stats().reserved_entries, 0);
    router.prepare(router.connection_nic().unwrap(), cfg(Role::Server, p)).expect("room again");
    let _ = router.nic().device_info();
}
