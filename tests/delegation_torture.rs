//! Delegation torture: an owner, the tokens its application hands out,
//! and three delegates, on the simulated NIC through the async API, in a
//! seeded random run with faults.
//!
//! The owner keeps 16 slots of a region, each written with a pattern of
//! its generation; its application delegates random ranges of them to
//! random identities with random lives, revokes random delegations, and
//! rewrites random slots whenever the region lets it (a pinned slot is
//! refused). It also serves requests for ranges of its slots, which the
//! delegates call for as delegations to one another
//! (`Connection::call_delegated`). The delegates redeem random tokens,
//! their own or another identity's, once or again, many at once, hand
//! parts on and revoke what they made, while the owner revokes and
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
    CapId, Config, Connection, Endpoint, PolicyChoice, RedeemFailed, Refusal, RegionId, RegionRange, Token,
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
    /// The token it was delegated on from (by a holder), if any.
    parent: Option<usize>,
    /// The delegate that made it (and may revoke it, on the connection it
    /// made it on: the delegate's connection generation), if a holder did.
    holder: Option<(usize, u32)>,
    /// The range's bytes when it was delegated.
    want: Vec<u8>,
    expires: Instant,
    revoked: Option<Instant>,
    /// When a redemption (or delegation on) by its identity was first
    /// begun: a token to pick less often.
    first_redeemed: Option<Instant>,
}

/// A holder's delegation on, as it ended.
struct MadeOn {
    parent: usize,
    by: usize,
    by_gen: u32,
    to: usize,
    part: std::ops::Range<usize>,
    ttl: Duration,
    ended: Instant,
    result: Result<mwcap::conn::Delegation, RedeemFailed>,
}

/// A call for a reply as a delegation, as it ended.
struct Called {
    by: usize,
    by_gen: u32,
    to: usize,
    slot: usize,
    offset: usize,
    len: usize,
    ttl: Duration,
    /// Asked for longer than the connection's lease: must be refused.
    over: bool,
    result: Result<mwcap::conn::DelegatedReply, RedeemFailed>,
}

/// A token to use: mostly one not yet used, revoked or near its expiry
/// (so that most asks could succeed), else any.
fn pick(rng: &mut SmallRng, toks: &[Tok]) -> usize {
    let soon = Instant::now() + Duration::from_millis(60);
    let fresh: Vec<usize> = (0..toks.len())
        .filter(|&t| toks[t].first_redeemed.is_none() && toks[t].revoked.is_none() && toks[t].expires > soon)
        .collect();
    if !fresh.is_empty() && rng.gen_bool(0.7) {
        fresh[rng.gen_range(0..fresh.len())]
    } else {
        rng.gen_range(0..toks.len())
    }
}

/// When `t` or a capability above it was revoked first.
fn revoked_at(toks: &[Tok], t: usize) -> Option<Instant> {
    let own = toks[t].revoked;
    let above = toks[t].parent.and_then(|p| revoked_at(toks, p));
    match (own, above) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
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

/// The owner's slots: each one's generation, how many replies with a
/// range of it its application is making now (it does not rewrite a slot
/// it is serving, as a storage node would not), and when each reply was
/// sent (by the reply's number).
#[derive(Default)]
struct Slots {
    gens: [u32; SLOTS],
    serving: [u32; SLOTS],
    sent: Vec<Option<Instant>>,
}

/// The owner's application: "SLOT OFFSET LEN" is answered with that range,
/// its header the slot's generation and the reply's number.
async fn serve(c: Connection<SimNic>, region: RegionId, slots: Rc<RefCell<Slots>>) {
    while let Some(req) = c.next_request().await {
        let w: Vec<usize> =
            String::from_utf8_lossy(&req.header).split(' ').map(|x| x.parse().unwrap()).collect();
        let (slot, offset, len) = (w[0], w[1], w[2]);
        let (gen, n) = {
            let mut s = slots.borrow_mut();
            s.serving[slot] += 1;
            s.sent.push(None);
            (s.gens[slot], s.sent.len() as u32 - 1)
        };
        let range = RegionRange { region, offset: slot * SLOT + offset, len: len as u32 };
        let header = [gen.to_le_bytes(), n.to_le_bytes()].concat();
        let r = c.reply_region(req.id, 0, &header, range).await;
        let mut s = slots.borrow_mut();
        s.serving[slot] -= 1;
        // Sent by now: the token's expiry, from the owner's clock when it
        // delegated, is no later than this plus its ttl.
        s.sent[n as usize] = Some(Instant::now());
        if r.is_err() {
            return;
        }
    }
}

struct Run {
    pool: LocalPool,
    fabric: Fabric,
    owner: Endpoint<SimNic>,
    slots: Rc<RefCell<Slots>>,
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
        let region = owner.register_region(SLOTS * SLOT).unwrap();
        let slots: Rc<RefCell<Slots>> = Rc::default();
        let (o2, s2, sp) = (owner.clone(), slots.clone(), pool.spawner());
        pool.spawner()
            .spawn_local(async move {
                // Keep every connection until the owner goes.
                let mut kept = Vec::new();
                while let Ok(c) = o2.accept().await {
                    sp.spawn_local(serve(c.clone(), region, s2.clone())).unwrap();
                    kept.push(c);
                }
            })
            .unwrap();
        let addr = owner.local_addr().unwrap();
        Run { pool, fabric, owner, slots, owner_dev, addr, region, policy }
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
    delegated_on: u32,
    /// Revocations holders asked for, and those that revoked something
    /// (the others came after the delegation was over, or from another
    /// connection than the one it was made on).
    holder_revokes: u32,
    holder_revoked: u32,
    /// Replies a delegate called for as a delegation, and got.
    called_for: u32,
    rewritten: u32,
    write_refused: u32,
    qp_faults: u32,
}

fn torture(seed: u64, policy: PolicyChoice, ops: u32) -> Counts {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut run = Run::new(seed, policy);
    for s in 0..SLOTS {
        let bytes: Vec<u8> = (0..SLOT).map(|i| pattern(s, 0, i)).collect();
        run.owner.region_write(run.region, s * SLOT, &bytes).unwrap();
    }
    let mut delegates: Vec<Delegate> = (0..NAMES.len()).map(|i| run.connect(i)).collect();
    let mut toks: Vec<Tok> = Vec::new();
    let outcomes: Rc<RefCell<Vec<Outcome>>> = Rc::default();
    let mut started = 0usize;
    let mut c = Counts::default();
    let made_on: Rc<RefCell<Vec<MadeOn>>> = Rc::default();
    // The tokens handed on, each time one was.
    let mut used_on: Vec<usize> = Vec::new();
    // Each delegate's connection generation (a reconnect is a new one).
    let mut gens_conn = [0u32; NAMES.len()];
    let holder_revocations: Rc<RefCell<Vec<(usize, Instant)>>> = Rc::default();
    let mut pending_on = 0usize;
    let mut pending_revokes = 0usize;
    let called: Rc<RefCell<Vec<Called>>> = Rc::default();
    let mut pending_calls = 0usize;
    for _ in 0..ops {
        match rng.gen_range(0..100) {
            // The application delegates a random range of a random slot to
            // a random identity.
            0..=19 => {
                let slot = rng.gen_range(0..SLOTS);
                let offset = rng.gen_range(0..SLOT - 1);
                let len = rng.gen_range(1..=SLOT - offset);
                let identity = rng.gen_range(0..NAMES.len());
                let ttl = Duration::from_millis(rng.gen_range(60..1500));
                let range = RegionRange { region: run.region, offset: slot * SLOT + offset, len: len as u32 };
                let d = run.owner.delegate_region(range, NAMES[identity], ttl).unwrap();
                let gen = run.slots.borrow().gens[slot];
                let want = (offset..offset + len).map(|i| pattern(slot, gen, i)).collect();
                toks.push(Tok {
                    cap: d.cap,
                    token: d.token,
                    identity,
                    parent: None,
                    holder: None,
                    want,
                    expires: Instant::now() + ttl,
                    revoked: None,
                    first_redeemed: None,
                });
                c.delegated += 1;
            }
            // A holder hands part of a token on (mostly its own; sometimes
            // another identity's, or wider or longer than it may).
            20..=27 if !toks.is_empty() => {
                let t = pick(&mut rng, &toks);
                let by = if rng.gen_bool(0.85) { toks[t].identity } else { rng.gen_range(0..NAMES.len()) };
                let to = rng.gen_range(0..NAMES.len());
                let n = toks[t].want.len();
                let start = rng.gen_range(0..n);
                let end = if rng.gen_bool(0.9) { rng.gen_range(start + 1..=n) } else { n + 1 };
                let left = toks[t].expires.saturating_duration_since(Instant::now());
                let ttl = if rng.gen_bool(0.9) {
                    Duration::from_millis(rng.gen_range(30..1200))
                        .min(left.saturating_sub(Duration::from_millis(30)))
                } else {
                    left + Duration::from_secs(1)
                };
                if by == toks[t].identity && toks[t].first_redeemed.is_none() {
                    toks[t].first_redeemed = Some(Instant::now());
                }
                let (conn, token, out) = (delegates[by].conn.clone(), toks[t].token.clone(), made_on.clone());
                let part = start as u32..end as u32;
                let by_gen = gens_conn[by];
                pending_on += 1;
                run.pool
                    .spawner()
                    .spawn_local(async move {
                        let result = conn.delegate(&token, NAMES[to], Some(part.clone()), ttl).await;
                        let part = part.start as usize..part.end as usize;
                        let ended = Instant::now();
                        out.borrow_mut().push(MadeOn { parent: t, by, by_gen, to, part, ttl, ended, result });
                    })
                    .unwrap();
            }
            // Redeem a random token: by its identity mostly, else another's.
            28..=57 if !toks.is_empty() => {
                let t = pick(&mut rng, &toks);
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
            // The application revokes a random delegation (once over, it
            // is an error: fine).
            58..=62 if !toks.is_empty() => {
                let t = pick(&mut rng, &toks);
                if run.owner.revoke(toks[t].cap).is_ok() {
                    toks[t].revoked.get_or_insert(Instant::now());
                    c.revoked += 1;
                }
            }
            // A holder revokes a delegation it made (on the connection it
            // made it on; after a reconnect the owner refuses).
            63..=67 => {
                // Mostly one not yet redeemed (revoking it can still matter,
                // made on the holder's connection now), else any a holder made.
                let fresh = rng.gen_bool(0.8);
                let soon = Instant::now() + Duration::from_millis(60);
                let mine: Vec<usize> = (0..toks.len())
                    .filter(|&t| match toks[t].holder {
                        Some((h, g)) => {
                            !fresh
                                || (toks[t].first_redeemed.is_none()
                                    && g == gens_conn[h]
                                    && toks[t].expires > soon
                                    && revoked_at(&toks, t).is_none())
                        }
                        None => false,
                    })
                    .collect();
                if let Some(&t) = mine.get(rng.gen_range(0..mine.len().max(1))) {
                    let (h, _) = toks[t].holder.expect("made by a holder");
                    let (conn, cap, out) =
                        (delegates[h].conn.clone(), toks[t].cap, holder_revocations.clone());
                    pending_revokes += 1;
                    run.pool
                        .spawner()
                        .spawn_local(async move {
                            // Revoked from when it is answered (a redemption
                            // the owner took before may still succeed).
                            let r = conn.revoke(cap).await;
                            let at = Instant::now();
                            out.borrow_mut().push((if r.is_ok() { t } else { usize::MAX }, at));
                        })
                        .unwrap();
                }
            }
            // Rewrite a random slot, if no part of it is delegated or read.
            68..=82 => {
                let slot = rng.gen_range(0..SLOTS);
                let mut slots = run.slots.borrow_mut();
                if slots.serving[slot] > 0 {
                    continue;
                }
                let bytes: Vec<u8> = (0..SLOT).map(|i| pattern(slot, slots.gens[slot] + 1, i)).collect();
                match run.owner.region_write(run.region, slot * SLOT, &bytes) {
                    Ok(()) => {
                        slots.gens[slot] += 1;
                        c.rewritten += 1;
                    }
                    Err(_) => c.write_refused += 1,
                }
            }
            // A delegate's queue pair fails: it reconnects on a fresh device.
            83..=84 => {
                let i = rng.gen_range(0..NAMES.len());
                let qp = QpAddr { device: delegates[i].dev, qpn: delegates[i].conn.qp_number() };
                run.fabric.force_qp_error(qp);
                c.qp_faults += 1;
                run.pump(2);
                delegates[i] = run.connect(i);
                gens_conn[i] += 1;
            }
            // A slower link between the owner and a delegate.
            85..=89 => {
                let i = rng.gen_range(0..NAMES.len());
                let extra = Duration::from_micros(rng.gen_range(0..3000));
                run.fabric.set_link_delay(run.owner_dev, delegates[i].dev, extra);
            }
            // A delegate calls the owner's application for a range of a
            // slot as a delegation to another (or itself; sometimes for
            // longer than the connection's lease).
            90..=93 => {
                let by = rng.gen_range(0..NAMES.len());
                let to = rng.gen_range(0..NAMES.len());
                let slot = rng.gen_range(0..SLOTS);
                let offset = rng.gen_range(0..SLOT - 1);
                let len = rng.gen_range(1..=SLOT - offset);
                let over = rng.gen_bool(0.1);
                let ttl = if over {
                    config().lease_time + Duration::from_millis(1)
                } else {
                    Duration::from_millis(rng.gen_range(60..1500))
                };
                let (conn, out, by_gen) = (delegates[by].conn.clone(), called.clone(), gens_conn[by]);
                pending_calls += 1;
                run.pool
                    .spawner()
                    .spawn_local(async move {
                        let header = format!("{slot} {offset} {len}");
                        let result = conn.call_delegated(header.as_bytes(), NAMES[to], ttl).await;
                        out.borrow_mut().push(Called {
                            by,
                            by_gen,
                            to,
                            slot,
                            offset,
                            len,
                            ttl,
                            over,
                            result,
                        });
                    })
                    .unwrap();
            }
            // Time passes.
            _ => run.pump(rng.gen_range(1..20)),
        }
        run.pump(1);
        // Delegations on that were made become tokens like any other.
        for m in made_on.borrow_mut().drain(..) {
            pending_on -= 1;
            let parent = &toks[m.parent];
            match m.result {
                Ok(d) => {
                    let ctx = format!("seed {seed}: token {} handed on by {}", m.parent, NAMES[m.by]);
                    assert_eq!(m.by, parent.identity, "{ctx}: another identity's token was handed on");
                    assert!(m.part.end <= parent.want.len(), "{ctx}: wider than its capability");
                    toks.push(Tok {
                        cap: d.cap,
                        token: d.token,
                        identity: m.to,
                        parent: Some(m.parent),
                        holder: Some((m.by, m.by_gen)),
                        want: parent.want[m.part].to_vec(),
                        // At the latest (the owner's clock read before the answer).
                        expires: (m.ended + m.ttl).min(parent.expires),
                        revoked: None,
                        first_redeemed: None,
                    });
                    c.delegated_on += 1;
                    used_on.push(m.parent);
                }
                Err(RedeemFailed::Refused { .. }) => c.refused += 1,
                Err(_) => c.failed += 1,
            }
        }
        // Replies called for as delegations become tokens like any other.
        for m in called.borrow_mut().drain(..) {
            pending_calls -= 1;
            let ctx = format!("seed {seed}: {} called for a delegation to {}", NAMES[m.by], NAMES[m.to]);
            match m.result {
                Ok(r) => {
                    assert!(!m.over, "{ctx}: longer than the lease, not refused");
                    let d = r.delegation.expect("a range comes as a delegation");
                    let gen = u32::from_le_bytes(r.header[..4].try_into().unwrap());
                    let n = u32::from_le_bytes(r.header[4..8].try_into().unwrap()) as usize;
                    let sent = run.slots.borrow().sent[n].expect("the reply was sent");
                    let want = (m.offset..m.offset + m.len).map(|i| pattern(m.slot, gen, i)).collect();
                    toks.push(Tok {
                        cap: d.cap,
                        token: d.token,
                        identity: m.to,
                        parent: None,
                        holder: Some((m.by, m.by_gen)),
                        want,
                        expires: sent + m.ttl,
                        revoked: None,
                        first_redeemed: None,
                    });
                    c.called_for += 1;
                }
                Err(RedeemFailed::Refused { refusal, message }) => {
                    // Only a life longer than the lease is refused.
                    assert!(
                        m.over && refusal == Refusal::OutsideCapability,
                        "{ctx}: refused {refusal:?}: {message}"
                    );
                    c.refused += 1;
                }
                // The call failed (its connection faulted): nothing else.
                Err(RedeemFailed::Call(_)) => c.failed += 1,
                Err(e) => panic!("{ctx}: {e}"),
            }
        }
        for (t, at) in holder_revocations.borrow_mut().drain(..) {
            pending_revokes -= 1;
            c.holder_revokes += 1;
            if t != usize::MAX {
                toks[t].revoked.get_or_insert(at);
                c.holder_revoked += 1;
            }
        }
    }
    let _ = (pending_on, pending_revokes, pending_calls);
    for d in &delegates {
        run.fabric.set_link_delay(run.owner_dev, d.dev, Duration::ZERO);
    }
    let all_ended =
        util::wait_for(&mut run.pool, Duration::from_secs(20), || outcomes.borrow().len() == started);
    assert!(all_ended, "seed {seed}: {} of {started} redemptions ended", outcomes.borrow().len());

    // A token is used once: read, or handed on.
    let mut uses: Vec<u32> =
        (0..toks.len()).map(|t| used_on.iter().filter(|&&p| p == t).count() as u32).collect();
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
                uses[o.tok] += 1;
                assert_eq!(uses[o.tok], 1, "{ctx}: the token was used twice");
                assert!(o.began < tok.expires, "{ctx}: begun after the token's expiry");
                let revoked = revoked_at(&toks, o.tok);
                assert!(
                    revoked.map_or(true, |r| o.began < r),
                    "{ctx}: begun after its (or its parent's) revocation"
                );
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
    assert!(c.delegated_on > 3 && c.holder_revokes > 0, "holders handed tokens on and revoked: {c:?}");
    assert!(c.called_for > 3, "delegates called for replies as delegations: {c:?}");
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
