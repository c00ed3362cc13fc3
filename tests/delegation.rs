//! Delegation on the wire, on the simulated NIC: an owner endpoint
//! delegates a range of its region to a named identity; a delegate
//! connected as that identity redeems the token with one message and reads
//! exactly the range, once; every other use of a token gets a refusal a
//! program can match (forged, another owner's, another identity's,
//! expired, revoked, replayed); the range stays pinned (unwritable) until
//! the delegation is over on evidence, and is writable again after.

#![cfg(not(loom))]

mod util;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, Key, Keyring};
use mwcap::conn::{
    Config, Connection, DelegateError, Endpoint, PolicyChoice, RedeemFailed, Refusal, RegionId, RegionRange,
    Token, UseError,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

fn key(fill: u8) -> Key {
    Key::from_bytes(vec![fill; 32]).unwrap()
}

fn small() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 8192;
    c
}

/// An owner listening with a keyring of two identities, a region of
/// 64 KiB holding `pattern`, and a way to connect as either.
struct Net {
    pool: LocalPool,
    fabric: Fabric,
    owner: Endpoint<SimNic>,
    addr: SocketAddr,
    region: RegionId,
    keep: Rc<RefCell<Vec<Connection<SimNic>>>>,
}

const REGION: usize = 64 << 10;

fn pattern(i: usize) -> u8 {
    (i * 7 + i / 251) as u8
}

impl Net {
    fn new(policy: PolicyChoice) -> Net {
        Net::with_config(policy, small())
    }

    /// The owner with `cfg` (its connections' settings).
    fn with_config(policy: PolicyChoice, cfg: Config) -> Net {
        let fabric = Fabric::with_seed(11);
        let pool = LocalPool::new();
        let mut ring = Keyring::new();
        ring.insert("compute", key(7)).unwrap();
        ring.insert("other", key(9)).unwrap();
        let (owner, drv) = Endpoint::builder(fabric.add_device(DeviceConfig::spec()), Auth::Keyring(ring))
            .policy(policy)
            .config(cfg)
            .name("owner")
            .listen("127.0.0.1:0".parse().unwrap())
            .build()
            .unwrap();
        pool.spawner()
            .spawn_local(async move {
                drv.run().await;
            })
            .unwrap();
        let keep: Rc<RefCell<Vec<Connection<SimNic>>>> = Rc::default();
        let (o2, k2) = (owner.clone(), keep.clone());
        pool.spawner()
            .spawn_local(async move {
                while let Ok(c) = o2.accept().await {
                    k2.borrow_mut().push(c);
                }
            })
            .unwrap();
        let region = owner.register_region(REGION).unwrap();
        let bytes: Vec<u8> = (0..REGION).map(pattern).collect();
        owner.region_write(region, 0, &bytes).unwrap();
        let addr = owner.local_addr().unwrap();
        Net { pool, fabric, owner, addr, region, keep }
    }

    /// A client endpoint proving the key `name` of `fill`, connected to the owner.
    fn connect(&mut self, name: &str, fill: u8) -> Connection<SimNic> {
        let mut ring = Keyring::new();
        ring.insert(name, key(fill)).unwrap();
        let (ep, drv) = Endpoint::builder(self.fabric.add_device(DeviceConfig::spec()), Auth::Keyring(ring))
            .config(small())
            .build()
            .unwrap();
        self.pool
            .spawner()
            .spawn_local(async move {
                drv.run().await;
            })
            .unwrap();
        let addr = self.addr;
        self.run(async move { ep.connect(addr).await.unwrap() })
    }

    fn run<T: 'static>(&mut self, f: impl std::future::Future<Output = T> + 'static) -> T {
        let out: Rc<RefCell<Option<T>>> = Rc::default();
        let o2 = out.clone();
        self.pool
            .spawner()
            .spawn_local(async move {
                *o2.borrow_mut() = Some(f.await);
            })
            .unwrap();
        assert!(
            util::wait_for(&mut self.pool, Duration::from_secs(20), || out.borrow().is_some()),
            "timed out"
        );
        let v = out.borrow_mut().take().unwrap();
        v
    }

    fn range(&self, offset: usize, len: u32) -> RegionRange {
        RegionRange { region: self.region, offset, len }
    }

    /// Redeem `token` on `conn`: the payload's bytes, or why not.
    fn redeem(&mut self, conn: &Connection<SimNic>, token: &Token) -> Result<Vec<u8>, RedeemFailed> {
        let (c, t) = (conn.clone(), token.clone());
        self.run(async move {
            let reply = c.redeem(&t).await?;
            let data = reply.data.expect("a redeemed range comes as the payload");
            let bytes = data.to_vec();
            c.free(data);
            Ok(bytes)
        })
    }

    /// Wait until the range may be written (its delegation is over).
    fn writable(&mut self, offset: usize, len: usize) -> bool {
        let (owner, region) = (self.owner.clone(), self.region);
        let bytes = vec![0xEE; len];
        util::wait_for(&mut self.pool, Duration::from_secs(10), || {
            owner.region_write(region, offset, &bytes).is_ok()
        })
    }

    fn refused(&mut self, conn: &Connection<SimNic>, token: &Token) -> Refusal {
        match self.redeem(conn, token) {
            Err(RedeemFailed::Refused { refusal, message }) => {
                assert!(!message.is_empty(), "a refusal says why");
                refusal
            }
            other => panic!("expected a refusal, got {:?}", other.map(|b| b.len())),
        }
    }
}

fn a_delegate_reads_exactly_the_range_once(policy: PolicyChoice) {
    let mut net = Net::new(policy);
    let compute = net.connect("compute", 7);
    assert_eq!(compute.peer_identity(), Some("compute"));
    let (offset, len) = (4096 + 100, 5000u32);
    let d = net.owner.delegate_region(net.range(offset, len), "compute", Duration::from_secs(30)).unwrap();
    // Pinned: the owner cannot write it while the token is out.
    let err = net.owner.region_write(net.region, offset + 10, b"x").unwrap_err();
    assert!(matches!(err, UseError::RangeExposed { .. }), "{err}");
    net.owner.region_write(net.region, 0, &[pattern(0)]).unwrap(); // outside it: free
    let read = net.redeem(&compute, &d.token).unwrap();
    let want: Vec<u8> = (offset..offset + len as usize).map(pattern).collect();
    assert_eq!(read, want, "the delegate read exactly the range");
    // A token redeems once (also once the delegation is over).
    assert_eq!(net.refused(&compute, &d.token), Refusal::AlreadyRedeemed);
    // The delegation is over on evidence: the range is the owner's again.
    assert!(net.writable(offset, len as usize), "the range is written again once the exposure ended");
    assert!(net.owner.deregister_region(net.region).is_ok(), "nothing of the region is pinned");
    assert!(!net.keep.borrow().is_empty());
}

#[test]
fn under_mw_a_delegate_reads_exactly_the_range_once() {
    a_delegate_reads_exactly_the_range_once(PolicyChoice::Mw);
}

#[test]
fn under_confirm_a_delegate_reads_exactly_the_range_once() {
    a_delegate_reads_exactly_the_range_once(PolicyChoice::Confirm);
}

#[test]
fn every_misuse_of_a_token_is_refused_with_its_reason() {
    let mut net = Net::new(PolicyChoice::Mw);
    let compute = net.connect("compute", 7);
    let other = net.connect("other", 9);
    let ttl = Duration::from_secs(30);
    let d = net.owner.delegate_region(net.range(0, 4096), "compute", ttl).unwrap();

    // Forged: any byte changed.
    let mut bytes = d.token.as_bytes().to_vec();
    for i in [0, bytes.len() / 2, bytes.len() - 1] {
        bytes[i] ^= 1;
        assert_eq!(net.refused(&compute, &Token::from_bytes(bytes.clone())), Refusal::Forged, "byte {i}");
        bytes[i] ^= 1;
    }
    assert_eq!(net.refused(&compute, &Token::from_bytes(vec![0u8; 40])), Refusal::Forged);
    // Another identity's connection: refused, and the token is not used up.
    assert_eq!(net.refused(&other, &d.token), Refusal::WrongIdentity);
    // Another owner's token (same claims, another secret): forged here.
    let elsewhere = Net::new(PolicyChoice::Mw);
    let theirs = elsewhere.owner.delegate_region(elsewhere.range(0, 4096), "compute", ttl).unwrap();
    assert_eq!(net.refused(&compute, &theirs.token), Refusal::Forged);
    // The right identity still redeems it.
    assert_eq!(net.redeem(&compute, &d.token).unwrap().len(), 4096);
    // A replay, on either connection, while or after the delegation is over.
    assert_eq!(net.refused(&compute, &d.token), Refusal::AlreadyRedeemed);
    assert!(net.writable(0, 4096), "the delegation is over");
    assert_eq!(net.refused(&compute, &d.token), Refusal::AlreadyRedeemed);
    assert_eq!(net.refused(&other, &d.token), Refusal::AlreadyRedeemed);

    // Revoked before it was redeemed: refused, and the range is free at once.
    let r = net.owner.delegate_region(net.range(8192, 4096), "compute", ttl).unwrap();
    assert!(net.owner.region_write(net.region, 8192, b"x").is_err(), "pinned");
    net.owner.revoke(r.cap).unwrap();
    assert!(net.owner.region_write(net.region, 8192, b"x").is_ok(), "a revoked token pins nothing");
    assert_eq!(net.refused(&compute, &r.token), Refusal::Revoked);
    assert!(net.owner.revoke(r.cap).is_err(), "nothing left to revoke");

    // Expired unredeemed: refused; the range is the owner's again.
    let e = net.owner.delegate_region(net.range(16384, 100), "compute", Duration::from_millis(50)).unwrap();
    assert!(net.owner.region_write(net.region, 16384, b"x").is_err(), "pinned until it expires");
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(net.refused(&compute, &e.token), Refusal::Expired);
    assert!(net.owner.region_write(net.region, 16384, b"x").is_ok(), "an expired token pins nothing");

    // The owner's telemetry counts it all.
    let m = recorded(&net.owner);
    let ep = "endpoint=owner";
    assert_eq!(m[&format!("mwcap_delegations_total{{{ep}}}")], 3.0);
    assert_eq!(m[&format!("mwcap_redemptions_total{{{ep}}}")], 1.0);
    assert_eq!(m[&format!("mwcap_revocations_total{{{ep}}}")], 1.0);
    assert_eq!(m[&format!("mwcap_delegation_tokens_out{{{ep}}}")], 0.0);
    let refused = |reason: &str| m[&format!("mwcap_redemptions_refused_total{{{ep},reason={reason}}}")];
    assert_eq!(refused("forged"), 5.0, "three altered, one of zeros, one of another owner's");
    assert_eq!(refused("wrong_identity"), 1.0);
    assert_eq!(refused("already_redeemed"), 3.0, "three replays");
    assert_eq!(refused("revoked"), 1.0);
    assert_eq!(refused("expired"), 1.0);
    assert_eq!(refused("unknown"), 0.0);
    assert_eq!(refused("stale"), 0.0);
    assert_eq!(m[&format!("mwcap_capabilities_live{{{ep},kind=delegated,policy=mw}}")], 0.0);
}

/// Every series `record_metrics` records, as `name{k=v,...}` (labels
/// sorted) and its value.
fn recorded(ep: &Endpoint<SimNic>) -> std::collections::HashMap<String, f64> {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || ep.record_metrics());
    let mut out = std::collections::HashMap::new();
    for (key, _, _, value) in snap.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        labels.sort();
        let v = match value {
            DebugValue::Counter(n) => n as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(_) => continue,
        };
        out.insert(format!("{}{{{}}}", key.name(), labels.join(",")), v);
    }
    out
}

#[test]
fn a_range_waits_for_its_token_to_expire_before_it_is_written() {
    let mut net = Net::new(PolicyChoice::Mw);
    let _d = net.owner.delegate_region(net.range(0, 64), "compute", Duration::from_millis(100)).unwrap();
    let (owner, region) = (net.owner.clone(), net.region);
    let started = std::time::Instant::now();
    net.run(async move { owner.region_write_when_free(region, 0, b"new").await.unwrap() });
    assert!(started.elapsed() >= Duration::from_millis(90), "written only after the token expired");
}

#[test]
fn delegations_that_cannot_be_made_say_why() {
    let net = Net::new(PolicyChoice::Mw);
    let ttl = Duration::from_secs(1);
    let out = net.owner.delegate_region(net.range(REGION - 10, 20), "compute", ttl).unwrap_err();
    assert!(matches!(out, DelegateError::Region(UseError::OutOfRegion { .. })), "{out}");
    assert!(matches!(net.owner.delegate_region(net.range(0, 10), "", ttl), Err(DelegateError::NoIdentity)));
    let long = "x".repeat(300);
    assert!(matches!(
        net.owner.delegate_region(net.range(0, 10), &long, ttl),
        Err(DelegateError::IdentityTooLong(300))
    ));
    assert!(matches!(
        net.owner.delegate_region(net.range(0, 10), "compute", Duration::ZERO),
        Err(DelegateError::NoTime)
    ));
    // A refused delegation pinned nothing.
    net.owner.region_write(net.region, 0, &[1; 100]).unwrap();
}

/// Two redemptions at once on a connection that may expose one range at a
/// time: the second answer waits for the first exposure to end, then goes;
/// both delegates read their own block.
#[test]
fn a_redemption_that_waits_for_capacity_is_answered_when_there_is_some() {
    for policy in [PolicyChoice::Mw, PolicyChoice::Confirm] {
        let mut cfg = small();
        cfg.region_exposures = 1;
        let mut net = Net::with_config(policy, cfg);
        let compute = net.connect("compute", 7);
        let ttl = Duration::from_secs(30);
        let a = net.owner.delegate_region(net.range(0, 4096), "compute", ttl).unwrap();
        let b = net.owner.delegate_region(net.range(8192, 4096), "compute", ttl).unwrap();
        let (c1, c2) = (compute.clone(), compute.clone());
        let (ta, tb) = (a.token.clone(), b.token.clone());
        let (ra, rb) = net.run(async move {
            let read = |c: Connection<SimNic>, t: Token| async move {
                let reply = c.redeem(&t).await.expect("redeemed");
                let data = reply.data.expect("a payload");
                let bytes = data.to_vec();
                c.free(data);
                bytes
            };
            futures::join!(read(c1, ta), read(c2, tb))
        });
        assert_eq!(ra, (0..4096).map(pattern).collect::<Vec<u8>>(), "{policy:?}");
        assert_eq!(rb, (8192..8192 + 4096).map(pattern).collect::<Vec<u8>>(), "{policy:?}");
        assert!(net.writable(0, 4096) && net.writable(8192, 4096), "{policy:?}: both delegations over");
    }
}

/// A connection made by the application's own bootstrap has an identity
/// only if the application vouches for one: tokens for that name redeem
/// on it, and on a connection without one every redemption is refused.
#[test]
fn a_prepared_connection_redeems_as_the_identity_the_application_vouched_for() {
    use mwcap::conn::{Policies, Policy, Role};
    for policy in [Policy::Mw, Policy::Confirm] {
        let mut net = Net::new(PolicyChoice::Auto);
        let (client_ep, drv) =
            Endpoint::builder(net.fabric.add_device(DeviceConfig::spec()), Auth::Unauthenticated)
                .build()
                .unwrap();
        net.pool
            .spawner()
            .spawn_local(async move {
                drv.run().await;
            })
            .unwrap();
        let pair = |vouched: Option<&str>| {
            let c = client_ep.prepare(Role::Client, Policies::both(policy), small()).unwrap();
            let mut s = net.owner.prepare(Role::Server, Policies::both(policy), small()).unwrap();
            if let Some(name) = vouched {
                s = s.authenticated_as(name);
            }
            let (cl, sl) = (c.local(), s.local());
            let client = c.connect(&sl).unwrap();
            let server = s.connect(&cl).unwrap();
            (client, server)
        };
        let (vouched, vouched_server) = pair(Some("compute"));
        let (anonymous, anonymous_server) = pair(None);
        assert_eq!(vouched_server.peer_identity(), Some("compute"));
        assert_eq!(vouched_server.peer_addr(), None, "no bootstrap, no address");
        assert_eq!(anonymous_server.peer_identity(), None);
        let ttl = Duration::from_secs(30);
        let d = net.owner.delegate_region(net.range(4096, 4096), "compute", ttl).unwrap();
        assert_eq!(net.refused(&anonymous, &d.token), Refusal::WrongIdentity, "{policy:?}");
        let read = net.redeem(&vouched, &d.token).unwrap();
        assert_eq!(read, (4096..8192).map(pattern).collect::<Vec<u8>>(), "{policy:?}");
        assert!(net.writable(4096, 4096), "{policy:?}: the delegation is over");
        drop((vouched_server, anonymous_server));
    }
}

/// A token redeemed with less of its life left than a READ's safety
/// margin (`Config::safety_margin`, 500 ms here) is refused `Expired` at
/// once: an exposure that short would be declined by the delegate, who
/// would learn nothing it can match. The range is the owner's again.
#[test]
fn a_token_about_to_expire_is_refused_expired_not_exposed() {
    for policy in [PolicyChoice::Mw, PolicyChoice::Confirm] {
        let mut net = Net::new(policy);
        let compute = net.connect("compute", 7);
        let d = net.owner.delegate_region(net.range(0, 4096), "compute", Duration::from_millis(300)).unwrap();
        match net.redeem(&compute, &d.token) {
            Err(RedeemFailed::Refused { refusal: Refusal::Expired, message }) => {
                assert!(message.contains("safety margin"), "{policy:?}: {message}")
            }
            other => panic!("{policy:?}: expected Expired, got {:?}", other.map(|b| b.len())),
        }
        assert!(net.owner.region_write(net.region, 0, b"x").is_ok(), "{policy:?}: nothing stays pinned");
        // With more than the margin left it is read.
        let d = net.owner.delegate_region(net.range(0, 4096), "compute", Duration::from_secs(2)).unwrap();
        assert_eq!(net.redeem(&compute, &d.token).unwrap().len(), 4096, "{policy:?}");
    }
}
