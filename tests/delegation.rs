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
    Config, Connection, DelegateError, Delegation, Endpoint, PolicyChoice, RedeemFailed, Refusal, RegionId,
    RegionRange, Token, UseError,
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
        ring.insert("third", key(11)).unwrap();
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
        let region = owner.register_region(REGION).unwrap();
        let (o2, k2, sp) = (owner.clone(), keep.clone(), pool.spawner());
        pool.spawner()
            .spawn_local(async move {
                while let Ok(c) = o2.accept().await {
                    k2.borrow_mut().push(c.clone());
                    sp.spawn_local(serve(c, region)).unwrap();
                }
            })
            .unwrap();
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

    /// `holder` calls the owner's application with `header`, asking for
    /// the reply's payload as a delegation to `to`.
    fn call_delegated(
        &mut self,
        holder: &Connection<SimNic>,
        header: &str,
        to: &str,
        ttl: Duration,
    ) -> Result<mwcap::conn::DelegatedReply, RedeemFailed> {
        let (c, h, to) = (holder.clone(), header.to_owned(), to.to_owned());
        self.run(async move { c.call_delegated(h.as_bytes(), &to, ttl).await })
    }

    /// Wait until the range may be written (its delegation is over).
    fn writable(&mut self, offset: usize, len: usize) -> bool {
        let (owner, region) = (self.owner.clone(), self.region);
        let bytes = vec![0xEE; len];
        util::wait_for(&mut self.pool, Duration::from_secs(10), || {
            owner.region_write(region, offset, &bytes).is_ok()
        })
    }

    /// `holder` hands the capability of `token` on to `to`.
    fn delegate_on(
        &mut self,
        holder: &Connection<SimNic>,
        token: &Token,
        to: &str,
        part: Option<std::ops::Range<u32>>,
        ttl: Duration,
    ) -> Result<Delegation, RedeemFailed> {
        let (c, t, to) = (holder.clone(), token.clone(), to.to_owned());
        self.run(async move { c.delegate(&t, &to, part, ttl).await })
    }

    /// `holder` revokes `cap`, which it delegated.
    fn revoke_held(
        &mut self,
        holder: &Connection<SimNic>,
        cap: mwcap::conn::CapId,
    ) -> Result<(), RedeemFailed> {
        let c = holder.clone();
        self.run(async move { c.revoke(cap).await })
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

/// The owner's application: a storage protocol of its own that knows
/// nothing of delegation. "range OFFSET LEN" is answered with that range
/// of the region, "buf" with a buffer (and, when the caller asked for a
/// delegation, which a buffer cannot be, with status 7 and no payload),
/// anything else with status 3 and no payload. Each reply's header says
/// whether the request was marked delegated, and to whom. It gives nothing
/// of its region to "third" (status 4, no payload).
async fn serve(c: Connection<SimNic>, region: RegionId) {
    while let Some(req) = c.next_request().await {
        let to = c.delegation_asked(req.id).map(|d| d.to);
        assert_eq!(to.is_some(), req.delegated);
        let marked = match &to {
            Some(to) => format!("delegated {to}").into_bytes(),
            None => b"plain".to_vec(),
        };
        let marked = &marked[..];
        let words = String::from_utf8_lossy(&req.header).into_owned();
        let mut it = words.split(' ');
        let r = match (it.next(), it.next(), it.next()) {
            _ if to.as_deref() == Some("third") => {
                c.reply(req.id, 4, marked, None).await.map_err(|r| r.error)
            }
            (Some("range"), Some(off), Some(len)) => {
                let range = RegionRange { region, offset: off.parse().unwrap(), len: len.parse().unwrap() };
                match c.reply_region(req.id, 0, marked, range).await {
                    Ok(()) => Ok(()),
                    Err(e) => c.reply(req.id, 9, e.to_string().as_bytes(), None).await.map_err(|r| r.error),
                }
            }
            (Some("buf"), ..) => {
                let mut b = c.alloc().await.unwrap();
                b.copy_from(&[0xAB; 100]).unwrap();
                match c.reply(req.id, 0, marked, Some(b)).await {
                    Ok(()) => Ok(()),
                    Err(refused) => {
                        assert!(matches!(refused.error, UseError::NotDelegable(_)), "{}", refused.error);
                        c.free(refused.data.expect("the buffer is handed back"));
                        c.reply(req.id, 7, b"a buffer cannot be delegated", None).await.map_err(|r| r.error)
                    }
                }
            }
            _ => c.reply(req.id, 3, marked, None).await.map_err(|r| r.error),
        };
        if r.is_err() {
            return;
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
        assert_eq!(net.refused(&compute, &Token::from_bytes(&bytes).unwrap()), Refusal::Forged, "byte {i}");
        bytes[i] ^= 1;
    }
    assert_eq!(net.refused(&compute, &Token::from_bytes([0u8; 40]).unwrap()), Refusal::Forged);
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

/// A token that expired unredeemed pins nothing, whether or not anything
/// has looked at the delegations since: the region can be deregistered
/// (it stayed `RegionBusy` until a write or a redemption ran the expiry).
/// A time to live past what a token holds (about 584 years) is that long,
/// not a panic.
#[test]
fn a_region_whose_tokens_expired_unredeemed_can_be_deregistered() {
    let net = Net::new(PolicyChoice::Mw);
    let forever = net.owner.delegate_region(net.range(4096, 64), "compute", Duration::MAX).unwrap();
    net.owner.revoke(forever.cap).unwrap();
    let _d = net.owner.delegate_region(net.range(0, 64), "compute", Duration::from_millis(50)).unwrap();
    assert!(
        matches!(net.owner.deregister_region(net.region), Err(UseError::RegionBusy(_))),
        "pinned while its token lives"
    );
    std::thread::sleep(Duration::from_millis(80));
    net.owner.deregister_region(net.region).expect("an expired token pins nothing");
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

fn refusal_of<T>(r: Result<T, RedeemFailed>) -> Refusal {
    match r {
        Err(RedeemFailed::Refused { refusal, message }) => {
            assert!(!message.is_empty(), "a refusal says why");
            refusal
        }
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("expected a refusal, got success"),
    }
}

/// A holder (here "other", to whom the owner's application delegated a
/// range) hands part of its capability on to "compute" with one message:
/// the delegate reads exactly that part, once; the holder's own token is
/// used up; the range stays pinned until the delegate's exposure ended.
fn a_holder_hands_part_of_its_capability_on(policy: PolicyChoice) {
    let mut net = Net::new(policy);
    let holder = net.connect("other", 9);
    let compute = net.connect("compute", 7);
    let ttl = Duration::from_secs(30);
    let (offset, len) = (8192 + 7, 3000u32);
    let mine = net.owner.delegate_region(net.range(offset, len), "other", ttl).unwrap();
    let on =
        net.delegate_on(&holder, &mine.token, "compute", Some(100..1100), Duration::from_secs(10)).unwrap();
    assert_ne!(on.cap, mine.cap);
    // The holder's token was redeemed into the delegation.
    assert_eq!(net.refused(&holder, &mine.token), Refusal::AlreadyRedeemed, "{policy:?}");
    assert!(net.owner.region_write(net.region, offset + 2000, b"x").is_err(), "{policy:?}: still pinned");
    let read = net.redeem(&compute, &on.token).unwrap();
    let want: Vec<u8> = (offset + 100..offset + 1100).map(pattern).collect();
    assert_eq!(read, want, "{policy:?}: the delegate read exactly the part");
    assert_eq!(net.refused(&compute, &on.token), Refusal::AlreadyRedeemed, "{policy:?}");
    assert!(net.writable(offset, len as usize), "{policy:?}: the range is the owner's once it is over");
    let m = recorded(&net.owner);
    assert_eq!(m["mwcap_delegations_total{endpoint=owner}"], 2.0, "{policy:?}");
    assert_eq!(m["mwcap_redemptions_total{endpoint=owner}"], 2.0, "{policy:?}");
}

#[test]
fn under_mw_a_holder_hands_part_of_its_capability_on() {
    a_holder_hands_part_of_its_capability_on(PolicyChoice::Mw);
}

#[test]
fn under_confirm_a_holder_hands_part_of_its_capability_on() {
    a_holder_hands_part_of_its_capability_on(PolicyChoice::Confirm);
}

/// A delegation on is never wider or longer than the holder's capability
/// (refused before the holder's token is used), and only the right
/// identity's connection hands a token on.
#[test]
fn a_holder_cannot_widen_lengthen_or_take_another_identitys_capability() {
    let mut net = Net::new(PolicyChoice::Mw);
    let holder = net.connect("other", 9);
    let compute = net.connect("compute", 7);
    let mine = net.owner.delegate_region(net.range(0, 4096), "other", Duration::from_secs(5)).unwrap();
    let long = Duration::from_secs(60);
    let short = Duration::from_secs(1);
    for (part, ttl, what) in [
        (Some(4000..4097), short, "one byte past its end"),
        (Some(5000..6000), short, "outside it"),
        (Some(10..10), short, "empty"),
        (None, long, "longer than its own"),
        (None, Duration::ZERO, "no time"),
    ] {
        let r = net.delegate_on(&holder, &mine.token, "compute", part, ttl);
        assert_eq!(refusal_of(r), Refusal::OutsideCapability, "{what}");
    }
    // Another identity's connection cannot hand it on.
    let r = net.delegate_on(&compute, &mine.token, "third", None, short);
    assert_eq!(refusal_of(r), Refusal::WrongIdentity);
    // Forged.
    let mut bytes = mine.token.as_bytes().to_vec();
    bytes[5] ^= 1;
    let r = net.delegate_on(&holder, &Token::from_bytes(bytes).unwrap(), "compute", None, short);
    assert_eq!(refusal_of(r), Refusal::Forged);
    // The token was never used: the holder hands all of it on now.
    let on = net.delegate_on(&holder, &mine.token, "compute", None, short).unwrap();
    assert_eq!(net.redeem(&compute, &on.token).unwrap().len(), 4096);
    // A replay of the holder's token.
    let r = net.delegate_on(&holder, &mine.token, "compute", None, short);
    assert_eq!(refusal_of(r), Refusal::AlreadyRedeemed);
    let m = recorded(&net.owner);
    assert_eq!(m["mwcap_redemptions_refused_total{endpoint=owner,reason=outside_capability}"], 5.0);
}

/// A delegate may delegate further, never wider or longer; the holder that
/// delegated revokes on its connection (nobody else's connection can), and
/// everything made from what it revoked is refused too.
#[test]
fn delegations_chain_and_a_holder_revokes_what_it_made() {
    for policy in [PolicyChoice::Mw, PolicyChoice::Confirm] {
        let mut net = Net::new(policy);
        let holder = net.connect("other", 9);
        let compute = net.connect("compute", 7);
        let third = net.connect("third", 11);
        let ttl = Duration::from_secs(20);
        let root = net.owner.delegate_region(net.range(0, 8192), "other", ttl).unwrap();
        // other -> compute (half) -> third (a quarter of that).
        let a = net.delegate_on(&holder, &root.token, "compute", Some(4096..8192), ttl / 2).unwrap();
        let b = net.delegate_on(&compute, &a.token, "third", Some(1024..2048), ttl / 4).unwrap();
        let r = net.delegate_on(&third, &b.token, "other", Some(0..2048), ttl / 8);
        assert_eq!(refusal_of(r), Refusal::OutsideCapability, "{policy:?}: wider than the chain's link");
        let read = net.redeem(&third, &b.token).unwrap();
        assert_eq!(read, (4096 + 1024..4096 + 2048).map(pattern).collect::<Vec<u8>>(), "{policy:?}");
        // A second chain, revoked by its holder before it is read: the
        // delegation and what was made from it are refused.
        let root = net.owner.delegate_region(net.range(16384, 4096), "other", ttl).unwrap();
        let a = net.delegate_on(&holder, &root.token, "compute", None, ttl / 2).unwrap();
        let b = net.delegate_on(&compute, &a.token, "third", None, ttl / 4).unwrap();
        let r = net.revoke_held(&third, a.cap);
        assert_eq!(refusal_of(r), Refusal::NotHolder, "{policy:?}: only its holder revokes it");
        net.revoke_held(&holder, a.cap).unwrap();
        assert_eq!(net.refused(&third, &b.token), Refusal::Revoked, "{policy:?}: made from a revoked one");
        let r = net.revoke_held(&holder, mwcap::conn::CapId(999_999));
        assert_eq!(refusal_of(r), Refusal::Unknown, "{policy:?}");
        // Every delegation is over: the ranges are the owner's again.
        assert!(net.writable(0, 8192) && net.writable(16384, 4096), "{policy:?}");
        let m = recorded(&net.owner);
        assert_eq!(m["mwcap_revocations_total{endpoint=owner}"], 2.0, "{policy:?}: a and b");
    }
}

/// A holder revokes the delegation it made while the delegate redeems it
/// (whichever comes first; `tests/delegation_hostile.rs` revokes while the
/// delegate holds the window, step by step): the delegate reads the range
/// as delegated or learns it failed, never other bytes, and the range
/// comes back on evidence.
#[test]
fn a_holder_revoking_while_the_delegate_reads_never_yields_other_bytes() {
    for policy in [PolicyChoice::Mw, PolicyChoice::Confirm] {
        let mut net = Net::new(policy);
        let holder = net.connect("other", 9);
        let compute = net.connect("compute", 7);
        let ttl = Duration::from_secs(20);
        let mine = net.owner.delegate_region(net.range(0, 8192), "other", ttl).unwrap();
        let on = net.delegate_on(&holder, &mine.token, "compute", None, ttl / 2).unwrap();
        let (c, h, t, cap) = (compute.clone(), holder.clone(), on.token.clone(), on.cap);
        let result = net.run(async move {
            let read = async {
                match c.redeem(&t).await {
                    Ok(reply) => {
                        let data = reply.data.expect("a payload");
                        let bytes = data.to_vec();
                        c.free(data);
                        Ok(bytes)
                    }
                    Err(e) => Err(e),
                }
            };
            let revoke = async {
                async_io::Timer::after(Duration::from_micros(300)).await;
                h.revoke(cap).await
            };
            let (read, revoked) = futures::join!(read, revoke);
            // Revoked, or over already (read and released: nothing to revoke).
            match &revoked {
                Ok(()) | Err(RedeemFailed::Refused { refusal: Refusal::Unknown, .. }) => {}
                other => panic!("the revocation: {other:?}"),
            }
            read
        });
        match result {
            Ok(bytes) => assert_eq!(bytes, (0..8192).map(pattern).collect::<Vec<u8>>(), "{policy:?}"),
            Err(e) => eprintln!("{policy:?}: the read ended {e}"),
        }
        assert!(net.writable(0, 8192), "{policy:?}: the range comes back on evidence");
        let again = net.refused(&compute, &on.token);
        assert!(matches!(again, Refusal::AlreadyRedeemed | Refusal::Revoked), "{policy:?}: {again:?}");
    }
}

/// A holder calls the owner's application (which knows nothing of
/// delegation) and asks for the reply's payload as a delegation instead of
/// reading it: the application replies with a range of its region as it
/// would to any caller, the owner's library delegates it to the identity
/// the holder named, and the delegate reads exactly that range, once. The
/// range is pinned until the delegation is over, and the holder revokes
/// what it was given.
fn a_reply_payload_is_delegated_to_a_third_node(policy: PolicyChoice) {
    let mut net = Net::new(policy);
    let holder = net.connect("other", 9);
    let compute = net.connect("compute", 7);
    let ttl = Duration::from_secs(4);
    let (offset, len) = (12_288 + 5, 6000u32);
    let r = net.call_delegated(&holder, &format!("range {offset} {len}"), "compute", ttl).unwrap();
    assert_eq!(
        (r.status, &r.header[..]),
        (0, &b"delegated compute"[..]),
        "{policy:?}: the application's answer"
    );
    let d = r.delegation.expect("a reply with a range comes as a delegation");
    // Nothing was exposed to the holder; the range is pinned for the delegate.
    let err = net.owner.region_write(net.region, offset + len as usize - 1, b"x").unwrap_err();
    assert!(matches!(err, UseError::RangeExposed { .. }), "{policy:?}: {err}");
    // Only the identity named redeems it.
    assert_eq!(net.refused(&holder, &d.token), Refusal::WrongIdentity, "{policy:?}");
    let read = net.redeem(&compute, &d.token).unwrap();
    assert_eq!(read, (offset..offset + len as usize).map(pattern).collect::<Vec<u8>>(), "{policy:?}");
    assert_eq!(net.refused(&compute, &d.token), Refusal::AlreadyRedeemed, "{policy:?}");
    assert!(net.writable(offset, len as usize), "{policy:?}: the range is the owner's once it is over");

    // A second one, revoked by the holder before the delegate redeems it.
    let r = net.call_delegated(&holder, "range 0 4096", "compute", ttl).unwrap();
    let d = r.delegation.unwrap();
    assert_eq!(refusal_of(net.revoke_held(&compute, d.cap)), Refusal::NotHolder, "{policy:?}");
    net.revoke_held(&holder, d.cap).unwrap();
    assert_eq!(net.refused(&compute, &d.token), Refusal::Revoked, "{policy:?}");
    assert!(net.writable(0, 4096), "{policy:?}: a revoked delegation unpins its range");

    // Naming its own identity, the holder hands a part on later.
    let r = net.call_delegated(&holder, "range 8192 4096", "other", ttl).unwrap();
    let mine = r.delegation.unwrap();
    let on = net.delegate_on(&holder, &mine.token, "compute", Some(96..196), ttl / 2).unwrap();
    let read = net.redeem(&compute, &on.token).unwrap();
    assert_eq!(read, (8192 + 96..8192 + 196).map(pattern).collect::<Vec<u8>>(), "{policy:?}");
    assert!(net.writable(8192, 4096), "{policy:?}");
    let m = recorded(&net.owner);
    assert_eq!(m["mwcap_delegations_total{endpoint=owner}"], 4.0, "{policy:?}");
}

#[test]
fn under_mw_a_reply_payload_is_delegated_to_a_third_node() {
    a_reply_payload_is_delegated_to_a_third_node(PolicyChoice::Mw);
}

#[test]
fn under_confirm_a_reply_payload_is_delegated_to_a_third_node() {
    a_reply_payload_is_delegated_to_a_third_node(PolicyChoice::Confirm);
}

/// What cannot be delegated says why: a reply without a payload comes back
/// as the application's answer without a delegation; a buffer is refused to
/// the application (which answers otherwise); a range outside the region
/// fails the application's reply; a life longer than the owner's lease, no
/// life, and a bad identity are refused before the application sees the
/// call. A plain call is not marked delegated, and reads as before.
#[test]
fn what_cannot_be_delegated_says_why() {
    let mut net = Net::new(PolicyChoice::Mw);
    let holder = net.connect("other", 9);
    let ttl = Duration::from_secs(2);
    let r = net.call_delegated(&holder, "nothing", "compute", ttl).unwrap();
    assert_eq!((r.status, &r.header[..]), (3, &b"delegated compute"[..]));
    assert!(r.delegation.is_none(), "no payload, no delegation");
    // The application sees whom it would give its data to, and refuses.
    let r = net.call_delegated(&holder, "range 0 10", "third", ttl).unwrap();
    assert_eq!((r.status, &r.header[..], r.delegation.is_none()), (4, &b"delegated third"[..], true));
    let r = net.call_delegated(&holder, "buf", "compute", ttl).unwrap();
    assert_eq!((r.status, r.delegation.is_none()), (7, true), "the application was told and answered");
    let r = net.call_delegated(&holder, &format!("range {} 10", REGION - 5), "compute", ttl).unwrap();
    assert_eq!(r.status, 9, "the application's reply_region failed: {}", String::from_utf8_lossy(&r.header));
    assert!(r.delegation.is_none());
    let lease = small().lease_time;
    for (to, ttl, want) in [
        ("compute", lease + Duration::from_millis(1), Refusal::OutsideCapability),
        ("compute", Duration::ZERO, Refusal::OutsideCapability),
    ] {
        let r = net.call_delegated(&holder, "range 0 10", to, ttl);
        assert_eq!(refusal_of(r), want, "{to} {ttl:?}");
    }
    for to in ["", &"x".repeat(256)] {
        let r = net.call_delegated(&holder, "range 0 10", to, ttl);
        assert!(matches!(r, Err(RedeemFailed::BadIdentity(n)) if n == to.len()), "{r:?}");
    }
    // A plain call to the same application is not marked, and reads the range.
    let c = holder.clone();
    let read = net.run(async move {
        let reply = c.call(b"range 100 200", None).await.unwrap();
        assert_eq!(&reply.header[..], b"plain");
        let data = reply.data.unwrap();
        let v = data.to_vec();
        c.free(data);
        v
    });
    assert_eq!(read, (100..300).map(pattern).collect::<Vec<u8>>());
    // Nothing was delegated or pinned by any of them.
    assert!(net.writable(0, REGION));
    let m = recorded(&net.owner);
    assert_eq!(m["mwcap_delegations_total{endpoint=owner}"], 0.0);
    assert_eq!(m["mwcap_redemptions_refused_total{endpoint=owner,reason=outside_capability}"], 2.0);
    // A header too long for the ask to be encoded on the stack goes all
    // the same; one that takes the ask past a request header's limit is
    // refused before anything is sent.
    let long = format!("range 0 10 {}", "x".repeat(700));
    let d = net.call_delegated(&holder, &long, "compute", ttl).unwrap().delegation.expect("delegated");
    net.revoke_held(&holder, d.cap).unwrap();
    let r = net.call_delegated(&holder, &"x".repeat(mwcap::conn::MAX_HEADER), "compute", ttl);
    assert!(
        matches!(&r, Err(RedeemFailed::Call(mwcap::conn::CallError::Refused(f))) if matches!(f.error, UseError::HeaderTooLong(_))),
        "{r:?}"
    );
    assert!(net.writable(0, REGION));
}

/// Revoking wakes only the connections that expose what was revoked (none,
/// for tokens not redeemed yet), not every connection of the owner: its
/// idle connections take no turn for a holder's revocation, nor for the
/// owner application's.
#[test]
fn a_revocation_wakes_only_the_connections_exposing_it() {
    let mut net = Net::new(PolicyChoice::Mw);
    let holder = net.connect("other", 9);
    for _ in 0..8 {
        net.connect("third", 11);
    }
    let quiet = |net: &mut Net| {
        for _ in 0..20 {
            net.pool.run_until_stalled();
            std::thread::sleep(Duration::from_millis(2));
        }
        // The owner's side of the 8 idle connections (accepted after the holder's).
        net.keep.borrow()[1..].iter().map(|c| c.driver_stats().turns).collect::<Vec<u64>>()
    };
    assert_eq!(net.keep.borrow().len(), 9);
    let ttl = Duration::from_secs(4);
    let d = net.call_delegated(&holder, "range 0 4096", "compute", ttl).unwrap().delegation.unwrap();
    let before = quiet(&mut net);
    net.revoke_held(&holder, d.cap).unwrap();
    assert_eq!(quiet(&mut net), before, "a holder's revocation woke idle connections");
    let mine = net.owner.delegate_region(net.range(8192, 4096), "compute", ttl).unwrap();
    let before = quiet(&mut net);
    net.owner.revoke(mine.cap).unwrap();
    assert_eq!(quiet(&mut net), before, "the owner's revocation woke idle connections");
    assert!(net.writable(0, 4096) && net.writable(8192, 4096), "both ranges come back");
}
