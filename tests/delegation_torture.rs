//! Delegation torture: an owner, the tokens its application hands out,
//! and three delegates, on the simulated NIC through the async API, in a
//! seeded random run with faults.
//!
//! The owner keeps 16 slots of a region, each written with a pattern of
//! its generation; its application delegates random ranges of them to
//! random identities with random lives, revokes random delegations, and
//! rewrites random slots whenever the region lets it (a pinned slot is
//! refused). The delegates redeem random tokens, their own or another
//! identity's, once or again, many at once, while the owner revokes and
//! rewrites. Faults: a delegate's queue pair forced into error mid-run
//! (the delegate reconnects on a fresh device), and delays on the links.
//!
//! What must hold, whatever the order:
//! - a redemption that succeeds returned exactly the range as it was when
//!   it was delegated (the owner never rewrote a delegated range while
//!   a delegate could read it: a stale read is never returned);
//! - it was the token's identity's, the token's first redemption, begun
//!   before the token's expiry and before its revocation;
//! - every other redemption is refused or fails, never half-succeeds;
//! - once every token's life is over, every slot is the owner's again and
//!   the region deregisters (every pin ended on evidence), and the
//!   simulator recorded no hazard (no invalidation of an unbound window,
//!   no DMA into freed memory).
//!
//! CI runs three seeds under mw, confirm and a mix; `MWCAP_TORTURE_SEED`
//! and `MWCAP_DELEGATION_OPS` for longer runs.

#![cfg(not(loom))]

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, Key, Keyring};
use mwcap::conn::{
    CapId, Config, Connection, Endpoint, PolicyChoice, RedeemFailed, RegionId, RegionRange, Token,
};
use mwcap::sim::{DeviceConfig, Fabric, QpAddr, SimNic};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const SLOTS: usize = 16;
const SLOT: usize = 4096;
const NAMES: [&str; 3] = ["d0", "d1", "d2"];

fn key(i: usize) -> Key {
    Key::from_bytes(vec![0x40 + i as u8; 32]).unwrap()
}

fn config() -> Config {
    let mut c = Config::default();
    c.buffers = 8;
    c.buffer_size = SLOT as u32;
    c.safety_margin = Duration::from_millis(20);
    c.lease_time = Duration::from_secs(2);
    c.call_timeout = Duration::from_secs(3);
    c
}

/// Byte `i` of slot `slot` at generation `gen`.
fn pattern(slot: usize, gen: u32, i: usize) -> u8 {
    (slot as u32 * 31 + gen * 131 + i as u32 * 7 + i as u32 / 253) as u8
}

/// A token the application handed out, and what the run knows of it.
struct Tok {
    cap: CapId,
    token: Token,
    identity: usize,
    /// The range's bytes when it was delegated.
    want: Vec<u8>,
    expires: Instant,
    revoked: Option<Instant>,
    /// When a redemption by its identity was first begun.
    first_redeemed: Option<Instant>,
}

/// One redemption, as it ended.
struct Outcome {
    tok: usize,
    by: usize,
    began: Instant,
    result: Result<Vec<u8>, RedeemFailed>,
}

struct Delegate {
    dev: mwcap::sim::DeviceId,
    conn: Connection<SimNic>,
}

struct Run {
    pool: LocalPool,
    fabric: Fabric,
    owner: Endpoint<SimNic>,
    owner_dev: mwcap::sim::DeviceId,
    addr: std::net::SocketAddr,
    region: RegionId,
    policy: PolicyChoice,
}

impl Run {
    fn new(seed: u64, policy: PolicyChoice) -> Run {
        let fabric = Fabric::with_seed(seed);
        let pool = LocalPool::new();
        let mut ring = Keyring::new();
        for (i, n) in NAMES.iter().enumerate() {
            ring.insert(n, key(i)).unwrap();
        }
        let nic = fabric.add_device(DeviceConfig::spec());
        let owner_dev = nic.device();
        let (owner, drv) = Endpoint::builder(nic, Auth::Keyring(ring))
            .policy(policy)
            .config(config())
            .name("owner")
            .listen("127.0.0.1:0".parse().unwrap())
            .build()
            .unwrap();
        pool.spawner()
            .spawn_local(async move {
                drv.run().await;
            })
            .unwrap();
        let o2 = owner.clone();
        pool.spawner()
            .spawn_local(async move {
                // Keep every connection until the owner goes.
                let mut kept = Vec::new();
                while let Ok(c) = o2.accept().await {
                    kept.push(c);
                }
            })
            .unwrap();
        let region = owner.register_region(SLOTS * SLOT).unwrap();
        let addr = owner.local_addr().unwrap();
        Run { pool, fabric, owner, owner_dev, addr, region, policy }
    }

    /// A delegate proving `NAMES[i]`, on a device of its own.
    fn connect(&mut self, i: usize) -> Delegate {
        let mut ring = Keyring::new();
        ring.insert(NAMES[i], key(i)).unwrap();
        let nic = self.fabric.add_device(DeviceConfig::spec());
        let dev = nic.device();
        let (ep, drv) =
            Endpoint::builder(nic, Auth::Keyring(ring)).policy(self.policy).config(config()).build().unwrap();
        self.pool
            .spawner()
            .spawn_local(async move {
                drv.run().await;
            })
            .unwrap();
        let addr = self.addr;
        let out: Rc<RefCell<Option<Connection<SimNic>>>> = Rc::default();
        let o2 = out.clone();
        self.pool
            .spawner()
            .spawn_local(async move {
                *o2.borrow_mut() = Some(ep.connect(addr).await.expect("a delegate connects"));
            })
            .unwrap();
        assert!(util::wait_for(&mut self.pool, Duration::from_secs(20), || out.borrow().is_some()));
        let conn = out.borrow_mut().take().unwrap();
        assert_eq!(conn.peer_identity(), Some(NAMES[i]));
        Delegate { dev, conn }
    }

    fn pump(&mut self, ms: u64) {
        self.pool.run_until(async_io::Timer::after(Duration::from_millis(ms)));
    }
}

#[derive(Default, Debug)]
struct Counts {
    delegated: u32,
    redeemed: u32,
    refused: u32,
    failed: u32,
    revoked: u32,
    rewritten: u32,
    write_refused: u32,
    qp_faults: u32,
}

fn torture(seed: u64, policy: PolicyChoice, ops: u32) -> Counts {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut run = Run::new(seed, policy);
    let mut gens = [0u32; SLOTS];
    for (s, g) in gens.iter().enumerate() {
        let bytes: Vec<u8> = (0..SLOT).map(|i| pattern(s, *g, i)).collect();
        run.owner.region_write(run.region, s * SLOT, &bytes).unwrap();
    }
    let mut delegates: Vec<Delegate> = (0..NAMES.len()).map(|i| run.connect(i)).collect();
    let mut toks: Vec<Tok> = Vec::new();
    let outcomes: Rc<RefCell<Vec<Outcome>>> = Rc::default();
    let mut started = 0usize;
    let mut c = Counts::default();
    for _ in 0..ops {
        match rng.gen_range(0..100) {
            // Delegate a random range of a random slot to a random identity.
            0..=24 => {
                let slot = rng.gen_range(0..SLOTS);
                let offset = rng.gen_range(0..SLOT - 1);
                let len = rng.gen_range(1..=SLOT - offset);
                let identity = rng.gen_range(0..NAMES.len());
                let ttl = Duration::from_millis(rng.gen_range(60..1500));
                let range = RegionRange { region: run.region, offset: slot * SLOT + offset, len: len as u32 };
                let d = run.owner.delegate_region(range, NAMES[identity], ttl).unwrap();
                let want = (offset..offset + len).map(|i| pattern(slot, gens[slot], i)).collect();
                toks.push(Tok {
                    cap: d.cap,
                    token: d.token,
                    identity,
                    want,
                    expires: Instant::now() + ttl,
                    revoked: None,
                    first_redeemed: None,
                });
                c.delegated += 1;
            }
            // Redeem a random token: by its identity mostly, else another's.
            25..=59 if !toks.is_empty() => {
                let t = rng.gen_range(0..toks.len());
                let by = if rng.gen_bool(0.75) { toks[t].identity } else { rng.gen_range(0..NAMES.len()) };
                let began = Instant::now();
                if by == toks[t].identity && toks[t].first_redeemed.is_none() {
                    toks[t].first_redeemed = Some(began);
                }
                let (conn, token, out) =
                    (delegates[by].conn.clone(), toks[t].token.clone(), outcomes.clone());
                started += 1;
                run.pool
                    .spawner()
                    .spawn_local(async move {
                        let result = match conn.redeem(&token).await {
                            Ok(reply) => {
                                let data = reply.data.expect("a redeemed range comes as the payload");
                                let bytes = data.to_vec();
                                conn.free(data);
                                Ok(bytes)
                            }
                            Err(e) => Err(e),
                        };
                        out.borrow_mut().push(Outcome { tok: t, by, began, result });
                    })
                    .unwrap();
            }
            // Revoke a random delegation (once over, it is an error: fine).
            60..=69 if !toks.is_empty() => {
                let t = rng.gen_range(0..toks.len());
                if run.owner.revoke(toks[t].cap).is_ok() {
                    toks[t].revoked.get_or_insert(Instant::now());
                    c.revoked += 1;
                }
            }
            // Rewrite a random slot, if no part of it is delegated or read.
            70..=84 => {
                let slot = rng.gen_range(0..SLOTS);
                let bytes: Vec<u8> = (0..SLOT).map(|i| pattern(slot, gens[slot] + 1, i)).collect();
                match run.owner.region_write(run.region, slot * SLOT, &bytes) {
                    Ok(()) => {
                        gens[slot] += 1;
                        c.rewritten += 1;
                    }
                    Err(_) => c.write_refused += 1,
                }
            }
            // A delegate's queue pair fails: it reconnects on a fresh device.
            85..=86 => {
                let i = rng.gen_range(0..NAMES.len());
                let qp = QpAddr { device: delegates[i].dev, qpn: delegates[i].conn.qp_number() };
                run.fabric.force_qp_error(qp);
                c.qp_faults += 1;
                run.pump(2);
                delegates[i] = run.connect(i);
            }
            // A slower link between the owner and a delegate.
            87..=91 => {
                let i = rng.gen_range(0..NAMES.len());
                let extra = Duration::from_micros(rng.gen_range(0..3000));
                run.fabric.set_link_delay(run.owner_dev, delegates[i].dev, extra);
            }
            // Time passes.
            _ => run.pump(rng.gen_range(1..20)),
        }
        run.pump(1);
    }
    for d in &delegates {
        run.fabric.set_link_delay(run.owner_dev, d.dev, Duration::ZERO);
    }
    let all_ended =
        util::wait_for(&mut run.pool, Duration::from_secs(20), || outcomes.borrow().len() == started);
    assert!(all_ended, "seed {seed}: {} of {started} redemptions ended", outcomes.borrow().len());

    for o in outcomes.borrow().iter() {
        let tok = &toks[o.tok];
        match &o.result {
            Ok(bytes) => {
                c.redeemed += 1;
                let ctx = format!("seed {seed}, token {} redeemed by {}", o.tok, NAMES[o.by]);
                assert!(
                    bytes == &tok.want,
                    "{ctx}: the range read is not the range as delegated (a stale read)"
                );
                assert_eq!(o.by, tok.identity, "{ctx}: another identity's token");
                assert_eq!(tok.first_redeemed, Some(o.began), "{ctx}: not the token's first redemption");
                assert!(o.began < tok.expires, "{ctx}: begun after the token's expiry");
                assert!(tok.revoked.map_or(true, |r| o.began < r), "{ctx}: begun after its revocation");
            }
            Err(RedeemFailed::Refused { .. }) => c.refused += 1,
            Err(_) => c.failed += 1,
        }
    }

    // Every token's life ends (1.5 s at most): every slot is the owner's
    // again, on evidence, and the region deregisters.
    let (owner, region) = (run.owner.clone(), run.region);
    let zeros = vec![0u8; SLOT];
    let free = util::wait_for(&mut run.pool, Duration::from_secs(20), || {
        (0..SLOTS).all(|s| owner.region_write(region, s * SLOT, &zeros).is_ok())
    });
    assert!(free, "seed {seed}: a slot stayed pinned after every delegation's life ended");
    let dereg = run.owner.deregister_region(run.region);
    assert!(dereg.is_ok(), "seed {seed}: the region does not deregister: {dereg:?}");
    assert_eq!(run.fabric.hazards(), vec![], "seed {seed}: the simulator recorded hazards");
    c
}

fn seed() -> Option<u64> {
    std::env::var("MWCAP_TORTURE_SEED").ok().and_then(|s| s.parse().ok())
}

fn ops() -> u32 {
    std::env::var("MWCAP_DELEGATION_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(400)
}

fn check(policy: PolicyChoice, default_seed: u64) {
    let s = seed().unwrap_or(default_seed);
    let c = torture(s, policy, ops());
    println!("{policy:?} seed {s}: {c:?}");
    assert!(c.redeemed > 10, "the run read delegated ranges: {c:?}");
    assert!(c.refused > 5, "the run was refused redemptions: {c:?}");
    assert!(c.revoked > 0 && c.rewritten > 0 && c.write_refused > 0, "{c:?}");
}

#[test]
fn three_parties_under_mw_with_faults() {
    check(PolicyChoice::Mw, 1);
}

#[test]
fn three_parties_under_confirm_with_faults() {
    check(PolicyChoice::Confirm, 2);
}

#[test]
fn three_parties_under_auto_with_faults() {
    check(PolicyChoice::Auto, 3);
}
