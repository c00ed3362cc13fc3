//! The fabric's state: devices, their objects, the clock and the scheduler.
//!
//! Everything lives behind one lock in [`super::Fabric`]; objects are kept
//! in slabs whose indexes are never reused, so an event naming a destroyed
//! object finds nothing and is dropped.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::config::{DeviceConfig, FabricConfig};
use super::event::EvKind;
use super::oracle::{Hazard, HazardKind, QpCounters, TraceEntry};
use super::sched::{Lane, Scheduler};
use super::DeviceId;
use crate::backend::{Access, Completion, QpConfig, QpState, SendWr, Sge, SgeList, WcOpcode, WcStatus};

pub(crate) struct World {
    pub(crate) cfg: FabricConfig,
    pub(crate) now: u64,
    pub(crate) rng: SmallRng,
    pub(crate) sched: Scheduler,
    pub(crate) devs: Vec<Device>,
    /// Per unordered device pair: (cut, extra delay in ns).
    pub(crate) links: BTreeMap<(u32, u32), (bool, u64)>,
    pub(crate) hazards: Vec<Hazard>,
    pub(crate) trace: Vec<TraceEntry>,
    /// Byte vectors of finished packets, reused for the next ones (a
    /// simulated call allocates nothing in steady state).
    pub(crate) spare: SpareBytes,
    /// READs that succeeded and whose completion has not shown yet (device,
    /// QP, work request id, destination): until it shows, their response
    /// may land again (`World::check_landed`).
    pub(crate) landed: Vec<(u32, u32, u64, SgeList)>,
}

/// Spare byte vectors kept at most.
const MAX_SPARE: usize = 256;
/// The least room a new byte vector is made with (a control frame's).
const MIN_BYTES: usize = 4096;

/// Numbers handed out in order, freed ones again first (the latest freed
/// first), as devices hand out key indexes and QP numbers.
pub(crate) struct Numbers {
    next: u32,
    free: Vec<u32>,
}

impl Numbers {
    pub(crate) fn from(first: u32) -> Numbers {
        Numbers { next: first, free: Vec::new() }
    }

    pub(crate) fn take(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        })
    }

    pub(crate) fn give_back(&mut self, n: u32) {
        self.free.push(n);
    }
}

pub(crate) struct Device {
    pub(crate) cfg: DeviceConfig,
    pub(crate) alive: bool,
    pub(crate) gid: [u8; 16],
    pub(crate) next_pd: u32,
    /// Key index (rkey >> 8) to the object it names; shared by all PDs, as on real devices.
    pub(crate) keys: BTreeMap<u32, KeyObj>,
    /// Key indexes. A freed one (a region deregistered, a window
    /// deallocated) is given out again first: real devices reuse their key
    /// indexes, so a stale rkey may name a newer object at the same index
    /// (with another consumer key, unless the random byte repeats, 1 in
    /// 256, as the 8-bit key of real devices wraps).
    pub(crate) indexes: Numbers,
    pub(crate) next_addr: u64,
    /// QP numbers; a destroyed QP's is handed out again only when the
    /// device reuses numbers ([`DeviceConfig::reuse_qpns`]).
    pub(crate) qpns: Numbers,
    pub(crate) mrs: Vec<Option<Mr>>,
    pub(crate) mws: Vec<Option<Mw>>,
    pub(crate) cqs: Vec<Option<Cq>>,
    pub(crate) qps: Vec<Option<Qp>>,
    pub(crate) srqs: Vec<Option<Srq>>,
    /// QP number to index in `qps`, for the live QPs; the numbers are the
    /// simulator's own, so hashed by a multiply, not SipHash.
    pub(crate) by_qpn:
        std::collections::HashMap<u32, u32, std::hash::BuildHasherDefault<mwcap_delegation::IdHasher>>,
    /// Verbs made to fail ([`crate::sim::SimNic::fail_next`]): the verb's
    /// name and how many more calls of it fail.
    pub(crate) failing: Vec<(&'static str, u32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyObj {
    Mr(u32),
    Mw(u32),
}

pub(crate) struct Mr {
    pub(crate) pd: u32,
    /// Its bytes (a buffer handle may hold some: see `crate::mem`).
    pub(crate) data: std::sync::Arc<crate::mem::Memory>,
    pub(crate) access: Access,
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) bound_mws: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MwState {
    Unbound,
    Bound { qp: u32, mr: u32, offset: usize, len: usize, access: Access },
    Invalidated,
}

pub(crate) struct Mw {
    pub(crate) pd: u32,
    pub(crate) rkey: u32,
    pub(crate) state: MwState,
}

/// A completion queue belongs to the device, not to a protection domain
/// (as `ibv_create_cq` takes a context): queue pairs of every PD of the
/// device may complete on it.
pub(crate) struct Cq {
    pub(crate) entries: VecDeque<Completion>,
    pub(crate) users: u32,
    /// Armed by `poll_cq_ready`: woken at the next completion queued.
    pub(crate) waker: Option<std::task::Waker>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrState {
    Pending,
    Issued,
    Done { status: WcStatus, byte_len: u32 },
}

/// Where a READ was served from, for the oracle and rxe's in-flight quirk.
#[derive(Clone, Debug)]
pub(crate) struct Served {
    pub(crate) at: u64,
    pub(crate) dev: u32,
    pub(crate) qp: u32,
    /// The responder QP's number (checked as well as the index).
    pub(crate) qpn: u32,
    pub(crate) mr: u32,
    pub(crate) range: Range<usize>,
    pub(crate) mw: Option<u32>,
    /// The key the READ came with (a window's: its bind, which an
    /// invalidation ends).
    pub(crate) rkey: u32,
    /// The response's last packet as copied when its responder QP, gone
    /// to ERR meanwhile, was destroyed (`World::late_tail`).
    pub(crate) tail: Option<Vec<u8>>,
}

pub(crate) struct SqEntry {
    pub(crate) wr: SendWr,
    pub(crate) posted_at: u64,
    pub(crate) st: WrState,
    pub(crate) psn: Option<u64>,
    /// The SEND payload gathered at issue, kept for retransmission.
    pub(crate) payload: Option<Vec<u8>>,
    pub(crate) served: Option<Served>,
    /// rxe quirk: the response will never come and no retry is made.
    pub(crate) hung: bool,
}

pub(crate) struct RqEntry {
    pub(crate) wr_id: u64,
    pub(crate) sge: Sge,
}

/// A shared receive queue: receives of one PD that any of its queue pairs
/// created with [`QpConfig::srq`] consume, oldest first.
pub(crate) struct Srq {
    pub(crate) pd: u32,
    pub(crate) max_wr: u32,
    pub(crate) rq: VecDeque<RqEntry>,
    /// Armed limit (0: disarmed): the event fires once fewer remain posted.
    pub(crate) limit: u32,
    /// The limit event fired and nobody took it yet.
    pub(crate) limit_fired: bool,
    /// Queue pairs using it.
    pub(crate) users: u32,
}

impl Srq {
    /// Take the oldest receive, firing the limit event if that leaves
    /// fewer than the armed limit (as `ibv_modify_srq(3)` says).
    pub(crate) fn pop(&mut self) -> Option<RqEntry> {
        let r = self.rq.pop_front()?;
        if self.limit > 0 && (self.rq.len() as u32) < self.limit {
            self.limit = 0;
            self.limit_fired = true;
        }
        Some(r)
    }
}

pub(crate) struct Qp {
    pub(crate) pd: u32,
    pub(crate) qpn: u32,
    pub(crate) cfg: QpConfig,
    pub(crate) state: QpState,
    /// The peer's (gid, qpn).
    pub(crate) remote: Option<([u8; 16], u32)>,
    pub(crate) sq: VecDeque<SqEntry>,
    pub(crate) rq: VecDeque<RqEntry>,
    pub(crate) next_psn: u64,
    /// Responder side: the next expected request sequence number.
    pub(crate) epsn: u64,
    pub(crate) issue_scheduled: bool,
    pub(crate) timer_gen: u64,
    pub(crate) timer_armed: bool,
    /// The armed timer's event, cancelled when the timer is disarmed.
    pub(crate) timer_lane: Option<Lane>,
    pub(crate) retries_left: u8,
    pub(crate) rnr_left: u8,
    pub(crate) counters: QpCounters,
}

/// `Qp::rnr_left` of a queue pair that retries forever.
pub(crate) const RNR_FOREVER: u8 = u8::MAX;

/// A queue pair's RNR budget: its own `rnr_retry`, capped by the fabric's.
/// 7 means "retry forever", as on real NICs.
pub(crate) fn rnr_budget(cfg: &QpConfig, fabric_rnr: u8) -> u8 {
    if cfg.rnr_retry >= 7 {
        RNR_FOREVER
    } else {
        cfg.rnr_retry.min(fabric_rnr)
    }
}

impl Qp {
    pub(crate) fn new(pd: u32, qpn: u32, cfg: QpConfig, retry: u8, rnr: u8) -> Qp {
        let rnr = rnr_budget(&cfg, rnr);
        Qp {
            pd,
            qpn,
            cfg,
            state: QpState::Init,
            remote: None,
            // The send queue's room up front, as a device allocates it.
            sq: VecDeque::with_capacity((cfg.max_send_wr as usize).min(1024)),
            rq: VecDeque::new(),
            next_psn: 0,
            epsn: 0,
            issue_scheduled: false,
            timer_gen: 0,
            timer_armed: false,
            timer_lane: None,
            retries_left: retry,
            rnr_left: rnr,
            counters: QpCounters::default(),
        }
    }
}

impl Device {
    pub(crate) fn new(idx: u32, cfg: DeviceConfig) -> Device {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[12..16].copy_from_slice(&(idx + 1).to_be_bytes());
        Device {
            cfg,
            alive: true,
            gid,
            next_pd: 0,
            keys: BTreeMap::new(),
            indexes: Numbers::from(1),
            next_addr: 0x10_0000,
            qpns: Numbers::from(0x11),
            mrs: Vec::new(),
            mws: Vec::new(),
            cqs: Vec::new(),
            qps: Vec::new(),
            srqs: Vec::new(),
            by_qpn: std::collections::HashMap::default(),
            failing: Vec::new(),
        }
    }

    pub(crate) fn qp(&self, qp: u32) -> Option<&Qp> {
        self.qps.get(qp as usize).and_then(Option::as_ref)
    }
    pub(crate) fn qp_mut(&mut self, qp: u32) -> Option<&mut Qp> {
        self.qps.get_mut(qp as usize).and_then(Option::as_mut)
    }
    pub(crate) fn srq_mut(&mut self, srq: u32) -> Option<&mut Srq> {
        self.srqs.get_mut(srq as usize).and_then(Option::as_mut)
    }
    pub(crate) fn mr(&self, mr: u32) -> Option<&Mr> {
        self.mrs.get(mr as usize).and_then(Option::as_ref)
    }
    pub(crate) fn mr_mut(&mut self, mr: u32) -> Option<&mut Mr> {
        self.mrs.get_mut(mr as usize).and_then(Option::as_mut)
    }
    pub(crate) fn mw(&self, mw: u32) -> Option<&Mw> {
        self.mws.get(mw as usize).and_then(Option::as_ref)
    }
    pub(crate) fn mw_mut(&mut self, mw: u32) -> Option<&mut Mw> {
        self.mws.get_mut(mw as usize).and_then(Option::as_mut)
    }
    pub(crate) fn qp_by_qpn(&self, qpn: u32) -> Option<u32> {
        self.by_qpn.get(&qpn).copied()
    }
    /// A key index (a freed one if any) with a random consumer key.
    pub(crate) fn new_key(&mut self, obj: KeyObj, rng: &mut SmallRng) -> u32 {
        let index = self.indexes.take();
        self.keys.insert(index, obj);
        (index << 8) | rng.gen::<u8>() as u32
    }

    /// The object `rkey` names is gone: its index may be given out again.
    pub(crate) fn free_key(&mut self, rkey: u32) {
        if self.keys.remove(&(rkey >> 8)).is_some() {
            self.indexes.give_back(rkey >> 8);
        }
    }
}

impl World {
    pub(crate) fn new(cfg: FabricConfig) -> World {
        World {
            rng: SmallRng::seed_from_u64(cfg.seed),
            cfg,
            now: 0,
            sched: Scheduler::default(),
            devs: Vec::new(),
            links: BTreeMap::new(),
            hazards: Vec::new(),
            trace: Vec::new(),
            spare: SpareBytes::new(),
            landed: Vec::new(),
        }
    }

    pub(crate) fn log(&mut self, what: impl FnOnce() -> String) {
        if self.cfg.record_trace {
            let what = what();
            tracing::trace!(at_ns = self.now, "{what}");
            self.trace.push(TraceEntry { at: Duration::from_nanos(self.now), what });
        }
    }

    pub(crate) fn hazard(&mut self, dev: u32, kind: HazardKind, detail: String) {
        tracing::warn!(device = dev, ?kind, "{detail}");
        self.log(|| format!("HAZARD {kind:?} dev{dev}: {detail}"));
        self.hazards.push(Hazard { at: Duration::from_nanos(self.now), device: DeviceId(dev), kind, detail });
    }

    pub(crate) fn dev_by_gid(&self, gid: &[u8; 16]) -> Option<u32> {
        self.devs.iter().position(|d| &d.gid == gid).map(|i| i as u32)
    }

    fn link_key(a: u32, b: u32) -> (u32, u32) {
        (a.min(b), a.max(b))
    }

    /// Whether packets can currently travel between two devices.
    pub(crate) fn path_up(&self, a: u32, b: u32) -> bool {
        let alive = |d: u32| self.devs.get(d as usize).is_some_and(|d| d.alive);
        alive(a) && alive(b) && !self.links.get(&World::link_key(a, b)).is_some_and(|l| l.0)
    }

    pub(crate) fn set_link(&mut self, a: u32, b: u32, f: impl FnOnce(&mut (bool, u64))) {
        f(self.links.entry(World::link_key(a, b)).or_insert((false, 0)))
    }

    /// One packet's travel time between two devices.
    pub(crate) fn wire_time(&mut self, a: u32, b: u32, bytes: u64) -> u64 {
        let lat = self.cfg.latency;
        let f = self.cfg.faults;
        let link = self.links.get(&World::link_key(a, b)).map_or(0, |l| l.1);
        let jitter = f.jitter.as_nanos() as u64;
        let jitter = if jitter > 0 { self.rng.gen_range(0..=jitter) } else { 0 };
        lat.wire.as_nanos() as u64
            + f.extra_delay.as_nanos() as u64
            + link
            + jitter
            + (lat.per_kib.as_nanos() as u64).saturating_mul(bytes) / 1024
    }

    /// Queue a completion of queue pair `qp` (its index) for the CQ after
    /// the completion latency. It is dropped if the QP is destroyed first:
    /// after `destroy_qp` no completion of it appears (its number may serve
    /// a new QP by then).
    pub(crate) fn deliver(&mut self, dev: u32, qp: u32, cq: u32, wc: Completion) {
        self.deliver_late(dev, qp, cq, wc, None);
    }

    fn deliver_late(&mut self, dev: u32, qp: u32, cq: u32, wc: Completion, late: Option<Box<SgeList>>) {
        let at = self.now + self.cfg.latency.completion.as_nanos() as u64;
        self.sched.push(Lane::Cq(dev, cq), at, EvKind::Deliver { dev, qp, cq, wc, late });
    }

    /// Hand the send queue's finished head entries to the CQ, in order.
    pub(crate) fn retire(&mut self, dev: u32, qp: u32) {
        loop {
            let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
            let Some(WrState::Done { status, byte_len }) = q.sq.front().map(|e| e.st) else { return };
            let mut e = q.sq.pop_front().expect("front exists");
            if let Some(p) = e.payload.take() {
                self.check_send_unchanged(dev, qp, &e.wr, &p);
                self.spare.put(p);
            }
            let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
            if status != WcStatus::Success || e.wr.signaled() {
                let wc = Completion {
                    wr_id: e.wr.wr_id(),
                    status,
                    opcode: e.wr.opcode(),
                    byte_len,
                    invalidated_rkey: None,
                    qpn: q.qpn,
                    vendor_err: 0,
                };
                let cq = q.cfg.send_cq.0;
                // A READ that fails (flushed, or its own error) after its
                // request went out leaves its destination undefined: the
                // response may still be landing while the QP goes to ERR.
                // Its bytes are written over just before the completion
                // shows (the latest a NIC may), so memory reused before
                // that evidence is caught (`land_late`). Not after a local
                // protection error: the destination could not be written.
                let late = match e.wr {
                    // A READ that succeeded: until its completion shows, a
                    // response may still land in its destination (a
                    // retransmitted one, as RC allows), so it must not be
                    // handed to anyone before (`check_landed`).
                    SendWr::Read { local, wr_id, .. } if status == WcStatus::Success => {
                        // (Held now, the landing just reported it.)
                        if !self.held_in(dev, &local) {
                            self.landed.push((dev, qp, wr_id, local));
                        }
                        None
                    }
                    SendWr::Read { local, .. }
                        if !matches!(status, WcStatus::Success | WcStatus::LocProtErr) && e.psn.is_some() =>
                    {
                        Some(Box::new(local))
                    }
                    _ => None,
                };
                self.deliver_late(dev, qp, cq, wc, late);
            }
        }
    }

    /// Whether a buffer handle holds any byte of `local` on device `dev`.
    pub(crate) fn held_in(&self, dev: u32, local: &SgeList) -> bool {
        let d = &self.devs[dev as usize];
        local.iter().any(|s| d.mr(s.mr.0).is_some_and(|mr| mr.data.overlaps_hold(s.offset, s.len as usize)))
    }

    /// A SEND ends (acknowledged or flushed): its memory must still hold
    /// the bytes the NIC read at its issue, which a retransmission would
    /// read again.
    fn check_send_unchanged(&mut self, dev: u32, qp: u32, wr: &SendWr, sent: &[u8]) {
        let (SendWr::Send { wr_id, sge, .. } | SendWr::SendWithInv { wr_id, sge, .. }) = wr else { return };
        let now = self.gather(dev, qp, sge);
        if now.as_deref() != Some(sent) {
            let detail = match &now {
                Some(_) => {
                    format!("SEND wr_id {wr_id}: its bytes changed while the NIC could still read them")
                }
                None => format!("SEND wr_id {wr_id}: its region went away while the NIC could still read it"),
            };
            self.hazard(dev, HazardKind::SendBufferChanged, detail);
        }
        if let Some(v) = now {
            self.spare.put(v);
        }
    }

    /// Move a queue pair to ERR: `cause` (a send-queue entry index and its
    /// status) completes with its error, every other outstanding work
    /// request with `WR_FLUSH_ERR`.
    pub(crate) fn enter_error(&mut self, dev: u32, qp: u32, cause: Option<(usize, WcStatus)>) {
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        let was = q.state;
        q.state = QpState::Err;
        q.timer_gen += 1;
        q.timer_armed = false;
        if let Some(lane) = q.timer_lane.take() {
            self.sched.cancel(lane);
        }
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        for (i, e) in q.sq.iter_mut().enumerate() {
            if !matches!(e.st, WrState::Done { .. }) {
                let status = match cause {
                    Some((c, s)) if c == i => s,
                    _ => WcStatus::WrFlushErr,
                };
                e.st = WrState::Done { status, byte_len: 0 };
            }
        }
        let qpn = q.qpn;
        let recv_cq = q.cfg.recv_cq.0;
        let rq: Vec<RqEntry> = q.rq.drain(..).collect();
        self.log(|| format!("dev{dev} qpn {qpn:#x} {was:?} -> ERR"));
        self.retire(dev, qp);
        for r in rq {
            let wc = Completion {
                wr_id: r.wr_id,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                invalidated_rkey: None,
                qpn,
                vendor_err: 0,
            };
            self.deliver(dev, qp, recv_cq, wc);
        }
    }

    /// Schedule the send queue's next execution if it has pending work.
    pub(crate) fn schedule_issue(&mut self, dev: u32, qp: u32) {
        let post = self.cfg.latency.post.as_nanos() as u64;
        let now = self.now;
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        if q.issue_scheduled || q.state != QpState::Rts {
            return;
        }
        let Some(e) = q.sq.iter().find(|e| e.st == WrState::Pending) else { return };
        let at = now.max(e.posted_at + post);
        q.issue_scheduled = true;
        self.sched.push(Lane::Sq(dev, qp), at, EvKind::Issue { dev, qp });
    }
}

/// Byte vectors for packets in flight, kept for reuse so that the
/// simulator allocates nothing once a workload has run for a while.
pub(crate) struct SpareBytes {
    vecs: Vec<Vec<u8>>,
    /// Vectors made larger than a frame (READ payloads), ever.
    large: usize,
}

impl SpareBytes {
    /// Half full of frame-sized vectors, made up front (a burst larger than
    /// the warm-up's would otherwise allocate).
    fn new() -> SpareBytes {
        let mut vecs = Vec::with_capacity(MAX_SPARE);
        vecs.extend((0..MAX_SPARE / 2).map(|_| Vec::with_capacity(MIN_BYTES)));
        SpareBytes { vecs, large: 0 }
    }

    /// An empty byte vector with room for `len` bytes: the most recently
    /// kept one with room (so a small one kept from a frame does not grow
    /// for a READ's payload), a frame-sized one for a frame where there is
    /// one (a frame carried in a READ payload's vector would leave a READ
    /// without one); otherwise a new one. Large ones are made in batches
    /// that double how many there are (4, 8, 16, ...), so a workload's
    /// high of READs in flight is covered once it reaches half of it, not
    /// first met in the middle of a measured run (with 16 READs of 64 KiB in
    /// flight the 16th was first needed after 1,000 calls about one run in
    /// five).
    pub(crate) fn take(&mut self, len: usize) -> Vec<u8> {
        let small = |v: &Vec<u8>| v.capacity() >= len && v.capacity() <= MIN_BYTES;
        let found = match len <= MIN_BYTES {
            true => self.vecs.iter().rposition(small),
            false => None,
        };
        if let Some(i) = found.or_else(|| self.vecs.iter().rposition(|v| v.capacity() >= len)) {
            return self.vecs.swap_remove(i);
        }
        if len > MIN_BYTES {
            // 4, 8, 16, 32, ... made in all.
            let room = MAX_SPARE - self.vecs.len();
            let more = (self.large.max(2) * 2 - self.large - 1).min(room);
            self.vecs.extend((0..more).map(|_| Vec::with_capacity(len)));
            self.large += more + 1;
        }
        Vec::with_capacity(len.max(MIN_BYTES))
    }

    /// Keep `v` for reuse; when full, in place of a smaller one.
    pub(crate) fn put(&mut self, mut v: Vec<u8>) {
        if v.capacity() == 0 {
            return;
        }
        v.clear();
        if self.vecs.len() < MAX_SPARE {
            self.vecs.push(v);
        } else if let Some(i) = self.vecs.iter().position(|s| s.capacity() < v.capacity()) {
            self.vecs[i] = v;
        }
    }
}
