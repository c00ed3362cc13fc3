//! [`VerbsNic`]: the [`Nic`] interface over a real verbs device.
//!
//! # The hot path
//! `post_send`, `post_recv`, `post_srq_recv`, `poll_cq` and the CPU
//! accessors (`write_mr`, `read_mr`) allocate nothing and take no lock
//! that covers the whole handle:
//!
//! - ids resolve through lock-free [`Slots`] tables: one compare-and-swap
//!   to pin each object the call names (each distinct region and window of
//!   a chain once) and one atomic decrement to unpin it;
//! - a chain of up to [`MAX_CHAIN`] work requests and their scatter lists
//!   are built as C structs in place on the stack, never moved
//!   ([`SendChain`]);
//! - per queue pair, a post holds that queue's post mutex across recording
//!   and `ibv_post_send`/`ibv_post_recv` (so records are in queue order),
//!   and the QP's track mutex only while it records;
//! - a poll pins the CQ, and for each run of completions of one QP in the
//!   batch, pins that QP (found through a per-CQ hint, validated) and takes
//!   its track mutex once. A poll never waits for a post's system call;
//! - a post to a shared receive queue pins the queue and the region and
//!   records nothing (the provider serialises posts to the SRQ).
//!
//! `take_srq_limit` takes the device context's event lock (see the `event`
//! module) for one non-blocking read when no event is pending.
//!
//! Creating and destroying objects takes the kind's admin mutex and may
//! allocate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::cq::Cq;
use super::device::{Context, DeviceAttrs};
use super::error::OpenError;
use super::mr::Mr;
use super::mw::Mw;
use super::pd::Pd;
use super::post::{
    chain_too_long, srq_recv_error, SendChain, SendOp, SendRequest, Slice, SliceList, MAX_CHAIN,
};
use super::qp::{PortInfo, Qp};
use super::slots::{PinSet, Pinned, Removal, Slots};
use super::srq::Srq;
use super::track::Track;
use crate::backend::{
    Access, Completion, CqId, DeviceInfo, MrId, MrInfo, MwId, MwInfo, Nic, NicError, NicOps, OsError,
    QpConfig, QpEndpoint, QpId, QpState, SendWr, Sge, SgeList, SrqId, MAX_SGE,
};

/// A queue pair with the record of what was posted on it, used to report
/// the opcode of error and flush completions (whose `opcode` the verbs spec
/// leaves undefined).
struct QpSlot {
    qp: Qp,
    /// The handle that made it ([`VerbsNic::token`]): the only one that
    /// reaches it by id.
    owner: u64,
    qpn: u32,
    send_cq: CqId,
    recv_cq: CqId,
    /// Held across recording send requests and posting them, so the records
    /// are in the send queue's order.
    sq_post: Mutex<()>,
    /// The same for the receive queue.
    rq_post: Mutex<()>,
    /// Held briefly: by a post while it records, by a poll while it settles
    /// a run of this QP's completions.
    track: Mutex<Track>,
}

impl QpSlot {
    /// Destroy the QP; on failure the slot comes back whole (to go back
    /// into its table, as [`Slots::remove`] wants: a move, on a cold path).
    #[allow(clippy::result_large_err)]
    fn close(self) -> Result<(), (QpSlot, NicError)> {
        let QpSlot { qp, owner, qpn, send_cq, recv_cq, sq_post, rq_post, track } = self;
        qp.close()
            .map_err(|(qp, e)| (QpSlot { qp, owner, qpn, send_cq, recv_cq, sq_post, rq_post, track }, e))
    }
}

/// How many QP-number hints a CQ keeps (direct-mapped by QPN).
const HINTS: usize = 8;

/// A completion queue, with hints from the QP numbers in its completions
/// to the QPs' ids (`qpn << 32 | id`; checked on use, so a stale one only
/// costs a scan of the QP table).
struct CqSlot {
    cq: Arc<Cq>,
    hints: [AtomicU64; HINTS],
}

/// A fresh handle identity ([`VerbsNic::token`]).
fn next_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn missing(what: &'static str, id: u32) -> NicError {
    NicError::NoSuchObject { what, id }
}

fn busy(op: &'static str) -> NicError {
    NicError::Os { op, source: OsError::from_errno(libc::EBUSY) }
}

/// A table has no id left (after about 2^32 creations of one kind).
fn no_id(op: &'static str) -> NicError {
    NicError::Os { op, source: OsError::from_errno(libc::ENOSPC) }
}

/// The error of a failed [`Slots::remove`].
fn removal(r: Removal<NicError>, what: &'static str, id: u32, busy_op: &'static str) -> NicError {
    match r {
        Removal::Missing => missing(what, id),
        Removal::Busy => busy(busy_op),
        Removal::Failed(e) => e,
    }
}

/// Put the mwcap id into a region error coming from the verbs layer.
fn relabel(e: NicError, id: MrId) -> NicError {
    match e {
        NicError::OutOfRange { offset, end, len, .. } => NicError::OutOfRange { mr: id.0, offset, end, len },
        other => other,
    }
}

/// A verbs device as a [`Nic`]: one context, one protection domain, and
/// tables mapping mwcap's small ids (never reused) to the RAII verbs objects.
pub struct VerbsNic {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    /// This handle's identity, unique in the process (its queue pairs carry it).
    token: u64,
    port: PortInfo,
    attrs: DeviceAttrs,
    info: DeviceInfo,
    // Teardown order: windows (unbinding them; with the last handle on the
    // PD), this handle's queue pairs (`Drop`), then the fields in
    // declaration order: the PD's shared receive queues (with the last
    // handle on the PD), the shared tables (with the last sibling:
    // completion queues), then the regions.
    /// The PD's memory windows, shared with the `NicOps::same_pd` handles (a
    /// hub's shared pool allocates them through one handle, its connections
    /// bind and deallocate them through theirs); freed with the last. So a
    /// handle that is not the PD's last frees no window before destroying
    /// its queue pairs: the endpoint deallocates its windows (its own, or
    /// the ones the pool lent it) before destroying its QP.
    mws: Arc<Slots<Mw>>,
    /// The PD's shared receive queues, shared with the `NicOps::same_pd`
    /// handles. The `Arc<Srq>`s' other holders are the queue pairs using
    /// them ([`Qp::srq`]), so a queue outlives its QPs whatever the order
    /// the handles go in.
    srqs: Arc<Slots<Arc<Srq>>>,
    shared: Arc<Shared>,
    /// The PD's memory regions, shared with the `NicOps::same_pd` handles
    /// (a hub's shared buffer pool registers through one handle, its
    /// connections name the regions through theirs); freed with the last.
    mrs: Arc<Slots<Mr>>,
    /// The ids of this handle's queue pairs in `shared.qps` (cold: create
    /// and destroy), destroyed when the handle is dropped.
    own_qps: Mutex<Vec<u32>>,
}

/// What a handle shares with its `NicOps::new_pd` and `NicOps::same_pd`
/// siblings: the device context's completion queues, and the queue pairs,
/// so that a poll of a shared CQ finds the QP of each completion whichever
/// handle made it. A handle reaches only its own queue pairs by id.
struct Shared {
    qps: Slots<QpSlot>,
    cqs: Slots<CqSlot>,
}

impl Drop for VerbsNic {
    fn drop(&mut self) {
        drop(std::mem::replace(&mut self.mws, Arc::new(Slots::new())));
        for id in std::mem::take(&mut *self.own_qps.lock()) {
            // A post through another clone may pin it for a moment: wait
            // that out. A QP that still cannot go stays in the table until
            // its last handle (its regions' memory is never freed under it:
            // a region whose deregistration fails is leaked).
            let mut tries = 0;
            let r = loop {
                match self.shared.qps.remove(id, QpSlot::close) {
                    Err(Removal::Busy) if tries < 1000 => {
                        tries += 1;
                        std::thread::yield_now();
                    }
                    r => break r,
                }
            };
            match r {
                Ok(()) | Err(Removal::Missing) => {}
                Err(r) => {
                    let e = removal(r, "queue pair", id, "destroy queue pair (a post is using it)");
                    tracing::warn!(%e, qp = id, "a queue pair of a dropped NIC handle could not be destroyed: it is tried again when the last handle sharing its table is dropped");
                }
            }
        }
        // The shared receive queues go next, with the `srqs` field, if this
        // is the PD's last handle (a queue still held by a QP that could not
        // be destroyed goes when that QP does).
    }
}

/// The raw handles and helpers mwcap's own verbs tests use (the `testing`
/// feature): internal otherwise, like `NicOps`.
#[cfg(feature = "testing")]
impl VerbsNic {
    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The current rkey of a window as tracked by the verbs layer (the rkey
    /// of its last posted bind).
    pub fn mw_rkey(&self, mw: MwId) -> Result<u32, NicError> {
        Ok(self.mw(mw)?.rkey())
    }

    fn mw(&self, id: MwId) -> Result<Pinned<'_, Mw>, NicError> {
        self.mws.pin(id.0).ok_or(missing("memory window", id.0))
    }

    /// Wait (asynchronously, on the CQ's completion channel) until a CQ has
    /// completions and return up to `max` of them. A convenience that
    /// allocates the vector; the data path uses `NicOps::poll_cq` and
    /// `NicOps::poll_cq_ready`.
    pub async fn wait_cq(&self, cq: CqId, max: usize) -> Result<Vec<Completion>, NicError> {
        let slot = self.cq(cq)?;
        let mut got = slot.cq.wait(max).await?;
        self.settle(cq, &slot, &mut got);
        Ok(got)
    }
}

impl VerbsNic {
    /// Know a registered region by a small id.
    fn add_mr(&self, mr: Mr) -> Result<MrInfo, NicError> {
        let info = MrInfo { id: MrId(0), addr: mr.addr(), len: mr.len(), lkey: mr.lkey(), rkey: mr.rkey() };
        let id = self.mrs.insert(mr, 0).map_err(|_| no_id("register memory region"))?;
        Ok(MrInfo { id: MrId(id), ..info })
    }

    /// Open `device_name` (or the first device) and use `port` with GID
    /// `gid_index` (1 for rxe and most RoCE v2 setups: `::ffff:<ipv4>`).
    pub fn open(device_name: Option<&str>, port: u8, gid_index: u8) -> Result<VerbsNic, OpenError> {
        let ctx = Context::open(device_name)?;
        let p = ctx.query_port(port)?;
        if !p.active {
            return Err(OpenError::PortNotActive { device: ctx.name().into(), port, state: p.state });
        }
        let bad_gid =
            |detail: String| OpenError::BadGid { device: ctx.name().into(), port, index: gid_index, detail };
        if u32::from(gid_index) >= p.gid_tbl_len {
            return Err(bad_gid(format!("the table has {} entries", p.gid_tbl_len)));
        }
        let gid = ctx.query_gid(port, gid_index).map_err(|e| bad_gid(e.to_string()))?;
        if gid == [0; 16] {
            return Err(bad_gid("the entry is empty".into()));
        }
        let attrs = ctx.query_device()?;
        let info = ctx.device_info(port)?;
        let pd = Pd::alloc(&ctx)?;
        let port = PortInfo { port, gid_index, gid, lid: p.lid, mtu: p.active_mtu };
        Ok(VerbsNic {
            ctx,
            pd,
            token: next_token(),
            port,
            attrs,
            info,
            mws: Arc::new(Slots::new()),
            srqs: Arc::new(Slots::new()),
            shared: Arc::new(Shared { qps: Slots::new(), cqs: Slots::new() }),
            mrs: Arc::new(Slots::new()),
            own_qps: Mutex::new(Vec::new()),
        })
    }

    /// Another handle on this device context with a protection domain of
    /// its own, sharing the completion queues (`NicOps::new_pd`).
    pub fn new_pd(&self) -> Result<VerbsNic, NicError> {
        Ok(VerbsNic {
            ctx: self.ctx.clone(),
            pd: Pd::alloc(&self.ctx)?,
            token: next_token(),
            port: self.port,
            attrs: self.attrs,
            info: self.info.clone(),
            mws: Arc::new(Slots::new()),
            srqs: Arc::new(Slots::new()),
            shared: self.shared.clone(),
            mrs: Arc::new(Slots::new()),
            own_qps: Mutex::new(Vec::new()),
        })
    }

    /// Another handle on this handle's protection domain (`NicOps::same_pd`):
    /// its queue pairs are its own (reachable by id only through it,
    /// destroyed when it drops); the PD's regions and windows (freed with the
    /// last handle on the PD that has not freed them), shared receive
    /// queues and the context's completion queues are common.
    pub fn same_pd(&self) -> VerbsNic {
        VerbsNic {
            ctx: self.ctx.clone(),
            pd: self.pd.clone(),
            token: next_token(),
            port: self.port,
            attrs: self.attrs,
            info: self.info.clone(),
            mws: self.mws.clone(),
            srqs: self.srqs.clone(),
            shared: self.shared.clone(),
            mrs: self.mrs.clone(),
            own_qps: Mutex::new(Vec::new()),
        }
    }

    /// The port, GID and MTU in use.
    pub fn port_info(&self) -> PortInfo {
        self.port
    }

    /// The device attributes queried at open.
    pub fn device_attrs(&self) -> DeviceAttrs {
        self.attrs
    }

    fn mr(&self, id: MrId) -> Result<Pinned<'_, Mr>, NicError> {
        self.mrs.pin(id.0).ok_or(missing("memory region", id.0))
    }

    fn srq(&self, id: SrqId) -> Result<Pinned<'_, Arc<Srq>>, NicError> {
        self.srqs.pin(id.0).ok_or(missing("shared receive queue", id.0))
    }

    fn cq(&self, id: CqId) -> Result<Pinned<'_, CqSlot>, NicError> {
        self.shared.cqs.pin(id.0).ok_or(missing("completion queue", id.0))
    }

    /// One of this handle's queue pairs (a sibling's are not reachable by id).
    fn qp(&self, id: QpId) -> Result<Pinned<'_, QpSlot>, NicError> {
        self.shared.qps.pin(id.0).filter(|q| q.owner == self.token).ok_or(missing("queue pair", id.0))
    }

    /// The QP with number `qpn`, through `cq`'s hint or else a scan.
    fn qp_by_qpn(&self, cq: &CqSlot, qpn: u32) -> Option<Pinned<'_, QpSlot>> {
        let hint = &cq.hints[qpn as usize % HINTS];
        let h = hint.load(Ordering::Relaxed);
        if (h >> 32) as u32 == qpn {
            if let Some(qp) = self.shared.qps.pin(h as u32).filter(|qp| qp.qpn == qpn) {
                return Some(qp);
            }
        }
        let qp = self.shared.qps.find(qpn, |qp| qp.qpn == qpn)?;
        hint.store(u64::from(qpn) << 32 | u64::from(qp.id()), Ordering::Relaxed);
        Some(qp)
    }

    /// Post `wrs` (at most `N`) as one chain built in arrays of `N`
    /// requests and `M` (`N * MAX_SGE`) regions.
    fn post_chain<const N: usize, const M: usize>(
        &self,
        slot: &QpSlot,
        wrs: &[SendWr],
    ) -> Result<(), NicError> {
        debug_assert!(wrs.len() <= N && M == N * MAX_SGE);
        // Pin every region and window the chain names (each once) for the
        // post. A work request has scatter entries or a bind's region, not
        // both, so MAX_SGE regions per request is enough.
        let mut mrs: PinSet<'_, Mr, M> = PinSet::new();
        let mut mws: PinSet<'_, Mw, N> = PinSet::new();
        for wr in wrs {
            let mut pin_mr = |id: MrId| mrs.pin(&self.mrs, id.0).ok_or(missing("memory region", id.0));
            match wr {
                SendWr::Send { sge, .. }
                | SendWr::SendWithInv { sge, .. }
                | SendWr::Read { local: sge, .. } => sge.iter().try_for_each(|s| pin_mr(s.mr))?,
                SendWr::BindMw { mw, mr, .. } => {
                    pin_mr(*mr)?;
                    mws.pin(&self.mws, mw.0).ok_or(missing("memory window", mw.0))?;
                }
                SendWr::LocalInv { .. } => {}
            }
        }
        let mr = |id: MrId| mrs.get(id.0).ok_or(missing("memory region", id.0));
        let slices = |list: &SgeList| -> Result<SliceList<'_>, NicError> {
            let mut out = SliceList::new();
            for s in list.iter() {
                let slice = Slice::new(mr(s.mr)?, s.offset, s.len).map_err(|e| relabel(e, s.mr))?;
                out.push(slice)
                    .map_err(|_| NicError::InvalidWr(format!("more than {MAX_SGE} scatter entries")))?;
            }
            Ok(out)
        };
        // Built and posted in place: neither the chain nor a request is
        // ever moved or copied whole.
        let mut chain = SendChain::<N>::new(&slot.qp);
        for wr in wrs {
            let op = match wr {
                SendWr::Send { sge, .. } => SendOp::Send(slices(sge)?),
                SendWr::SendWithInv { sge, invalidate_rkey, .. } => {
                    SendOp::SendWithInv(slices(sge)?, *invalidate_rkey)
                }
                SendWr::Read { local, remote_addr, rkey, .. } => {
                    SendOp::Read { local: slices(local)?, remote_addr: *remote_addr, rkey: *rkey }
                }
                SendWr::BindMw { mw, rkey, mr: id, offset, len, access, .. } => {
                    let region = mr(*id)?;
                    region.check_range(*offset, *len).map_err(|e| relabel(e, *id))?;
                    SendOp::BindMw {
                        mw: mws.get(mw.0).ok_or(missing("memory window", mw.0))?,
                        rkey: *rkey,
                        mr: region,
                        offset: *offset,
                        len: *len,
                        access: *access,
                    }
                }
                SendWr::LocalInv { rkey, .. } => SendOp::LocalInv(*rkey),
            };
            chain
                .push(&SendRequest { wr_id: wr.wr_id(), signaled: wr.signaled(), op })
                .map_err(|e| e.error)?;
        }
        // Record, then post, under the send queue's post mutex: the records
        // are in the queue's order and exist before any completion can.
        let _order = slot.sq_post.lock();
        {
            let mut track = slot.track.lock();
            for wr in wrs {
                track.push_sq(wr.wr_id(), wr.opcode());
            }
        }
        chain.post().map_err(|e| {
            slot.track.lock().unpush_sq(wrs.len() - e.posted);
            if e.posted == 0 {
                e.error
            } else {
                NicError::InvalidWr(e.to_string())
            }
        })
    }

    /// Match polled completions with what their QPs posted (see
    /// [`Track::settle`]): one pin and one track lock per run of
    /// completions of the same QP.
    fn settle(&self, cq: CqId, slot: &CqSlot, got: &mut [Completion]) {
        let mut rest = got;
        while let Some(first) = rest.first() {
            let qpn = first.qpn;
            let run = rest.iter().position(|c| c.qpn != qpn).unwrap_or(rest.len());
            let (now, later) = std::mem::take(&mut rest).split_at_mut(run);
            rest = later;
            let Some(qp) = self.qp_by_qpn(slot, qpn) else { continue };
            let from_sq = match (qp.send_cq == cq, qp.recv_cq == cq) {
                (true, false) => Some(true),
                (false, true) => Some(false),
                _ => None,
            };
            let mut track = qp.track.lock();
            for c in now {
                track.settle(c, from_sq);
            }
        }
    }
}

impl NicOps for VerbsNic {
    fn device_info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn new_pd(&self) -> Result<VerbsNic, NicError> {
        VerbsNic::new_pd(self)
    }

    fn new_pd_boxed(&self) -> Result<Box<dyn Nic>, NicError> {
        Ok(Box::new(VerbsNic::new_pd(self)?))
    }

    fn same_pd(&self) -> Result<VerbsNic, NicError> {
        Ok(VerbsNic::same_pd(self))
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<MrInfo, NicError> {
        self.add_mr(Mr::alloc(&self.pd, len, access)?)
    }

    fn reg_memory(
        &self,
        mem: &std::sync::Arc<crate::mem::Memory>,
        access: Access,
    ) -> Result<MrInfo, NicError> {
        self.add_mr(Mr::register(&self.pd, mem, access)?)
    }

    fn dereg_mr(&self, id: MrId) -> Result<(), NicError> {
        self.mrs
            .remove(id.0, Mr::close)
            .map_err(|r| removal(r, "memory region", id.0, "deregister memory region (a post is using it)"))
    }

    fn write_mr(&self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), NicError> {
        self.mr(mr)?.write(offset, data).map_err(|e| relabel(e, mr))
    }

    fn read_mr(&self, mr: MrId, offset: usize, out: &mut [u8]) -> Result<(), NicError> {
        self.mr(mr)?.read(offset, out).map_err(|e| relabel(e, mr))
    }

    fn memory(&self, mr: MrId) -> Result<Arc<crate::mem::Memory>, NicError> {
        Ok(self.mr(mr)?.memory().clone())
    }

    fn alloc_mw(&self) -> Result<MwInfo, NicError> {
        let mw = Mw::alloc(&self.pd)?;
        let rkey = mw.rkey();
        let id = self.mws.insert(mw, 0).map_err(|_| no_id("allocate memory window"))?;
        Ok(MwInfo { id: MwId(id), rkey })
    }

    fn dealloc_mw(&self, id: MwId) -> Result<(), NicError> {
        self.mws
            .remove(id.0, Mw::close)
            .map_err(|r| removal(r, "memory window", id.0, "deallocate memory window (a post is using it)"))
    }

    fn create_cq(&self, depth: u32) -> Result<CqId, NicError> {
        if depth > self.attrs.max_cqe {
            // Clamping would hand back a queue that can overflow, which
            // takes every queue pair on it to ERR.
            return Err(NicError::CqTooDeep { depth, max: self.attrs.max_cqe });
        }
        let cq = Cq::create(&self.ctx, depth.max(1))?;
        let slot = CqSlot { cq: Arc::new(cq), hints: Default::default() };
        let id = self.shared.cqs.insert(slot, 0).map_err(|_| no_id("create completion queue"))?;
        Ok(CqId(id))
    }

    fn destroy_cq(&self, id: CqId) -> Result<(), NicError> {
        self.shared
            .cqs
            .remove(id.0, |slot| {
                let CqSlot { cq, hints } = slot;
                // Queue pairs hold the other references to the Cq.
                match Arc::try_unwrap(cq) {
                    Ok(cq) => cq.close().map_err(|(cq, e)| (CqSlot { cq: Arc::new(cq), hints }, e)),
                    Err(cq) => Err((
                        CqSlot { cq, hints },
                        busy("destroy completion queue (queue pairs still use it)"),
                    )),
                }
            })
            .map_err(|r| removal(r, "completion queue", id.0, "destroy completion queue (in use)"))
    }

    fn create_qp(&self, cfg: QpConfig) -> Result<QpEndpoint, NicError> {
        let a = &self.attrs;
        let rd = a.max_qp_rd_atom.min(a.max_qp_init_rd_atom).clamp(1, 255) as u8;
        let cfg = QpConfig {
            max_rd_atomic: cfg.max_rd_atomic.clamp(1, rd),
            max_sge: cfg.max_sge.clamp(1, a.max_sge.max(1)),
            max_send_wr: cfg.max_send_wr.clamp(1, a.max_qp_wr.max(1)),
            // No receive queue of its own with a shared one.
            max_recv_wr: if cfg.srq.is_some() { 0 } else { cfg.max_recv_wr.clamp(1, a.max_qp_wr.max(1)) },
            ..cfg
        };
        let qp = {
            let scq = self.cq(cfg.send_cq)?;
            let rcq = self.cq(cfg.recv_cq)?;
            // One of the PD's (the Qp keeps an Arc to it).
            let srq = cfg.srq.map(|id| self.srq(id)).transpose()?;
            Qp::create(&self.pd, &scq.cq, &rcq.cq, srq.as_deref(), &cfg, self.port)?
        };
        let qpn = qp.qpn();
        let mut endpoint = qp.endpoint(None);
        let cap = (cfg.max_send_wr.max(cfg.max_recv_wr) as usize) * 2;
        let slot = QpSlot {
            qp,
            owner: self.token,
            qpn,
            send_cq: cfg.send_cq,
            recv_cq: cfg.recv_cq,
            sq_post: Mutex::new(()),
            rq_post: Mutex::new(()),
            track: Mutex::new(if cfg.srq.is_some() { Track::with_srq(cap) } else { Track::new(cap) }),
        };
        let id = self.shared.qps.insert(slot, qpn).map_err(|_| no_id("create queue pair"))?;
        self.own_qps.lock().push(id);
        endpoint.id = QpId(id);
        Ok(endpoint)
    }

    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), NicError> {
        self.qp(qp)?.qp.connect(remote)
    }

    fn set_qp_error(&self, qp: QpId) -> Result<(), NicError> {
        self.qp(qp)?.qp.set_error()
    }

    fn qp_state(&self, qp: QpId) -> Result<QpState, NicError> {
        self.qp(qp)?.qp.state()
    }

    fn destroy_qp(&self, id: QpId) -> Result<(), NicError> {
        drop(self.qp(id)?); // one of this handle's
        self.shared
            .qps
            .remove(id.0, QpSlot::close)
            .map_err(|r| removal(r, "queue pair", id.0, "destroy queue pair (a post is using it)"))?;
        self.own_qps.lock().retain(|&q| q != id.0);
        Ok(())
    }

    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<(), NicError> {
        let slot = self.qp(qp)?;
        // mwcap posts one or two requests at a time (a bind chained with its
        // grant's SEND): those are built in arrays of two, which every post
        // zeroes and fills (with room for MAX_CHAIN, about 1,500
        // instructions more a call on rxe, under callgrind).
        if wrs.len() <= 2 {
            self.post_chain::<2, { 2 * MAX_SGE }>(&slot, wrs)
        } else if wrs.len() <= MAX_CHAIN {
            self.post_chain::<MAX_CHAIN, { MAX_CHAIN * MAX_SGE }>(&slot, wrs)
        } else {
            Err(chain_too_long(wrs.len()))
        }
    }

    fn post_recv(&self, qp: QpId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        let slot = self.qp(qp)?;
        if slot.qp.srq().is_some() {
            return Err(srq_recv_error(slot.qpn));
        }
        let mr = self.mr(sge.mr)?;
        let slice = Slice::new(&mr, sge.offset, sge.len).map_err(|e| relabel(e, sge.mr))?;
        let _order = slot.rq_post.lock();
        slot.track.lock().push_rq(wr_id);
        slot.qp.post_recv(wr_id, &[slice]).inspect_err(|_| slot.track.lock().unpush_rq())
    }

    fn create_srq(&self, max_wr: u32) -> Result<SrqId, NicError> {
        if self.attrs.max_srq_wr == 0 {
            return Err(NicError::Unsupported {
                op: "ibv_create_srq",
                detail: "the device reports no shared receive queues".into(),
            });
        }
        if max_wr == 0 {
            return Err(NicError::Os { op: "ibv_create_srq", source: OsError::from_errno(libc::EINVAL) });
        }
        if max_wr > self.attrs.max_srq_wr {
            return Err(NicError::InvalidWr(format!(
                "a shared receive queue of {max_wr} receives was asked for and the device holds at most {}",
                self.attrs.max_srq_wr
            )));
        }
        let srq = Srq::create(&self.pd, max_wr)?;
        let id = self.srqs.insert(Arc::new(srq), 0).map_err(|_| no_id("create shared receive queue"))?;
        Ok(SrqId(id))
    }

    fn destroy_srq(&self, id: SrqId) -> Result<(), NicError> {
        self.srqs
            .remove(id.0, |srq| {
                // Queue pairs hold the other references to the Srq.
                match Arc::try_unwrap(srq) {
                    Ok(srq) => srq.close().map_err(|(srq, e)| (Arc::new(srq), e)),
                    Err(srq) => Err((srq, busy("destroy shared receive queue (queue pairs still use it)"))),
                }
            })
            .map_err(|r| removal(r, "shared receive queue", id.0, "destroy shared receive queue (in use)"))
    }

    fn post_srq_recv(&self, srq: SrqId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        let queue = self.srq(srq)?;
        let mr = self.mr(sge.mr)?;
        let slice = Slice::new(&mr, sge.offset, sge.len).map_err(|e| relabel(e, sge.mr))?;
        queue.post_recv(wr_id, slice)
    }

    fn arm_srq_limit(&self, srq: SrqId, limit: u32) -> Result<(), NicError> {
        self.srq(srq)?.arm_limit(limit)
    }

    fn take_srq_limit(&self, srq: SrqId) -> Result<bool, NicError> {
        self.srq(srq)?.take_limit()
    }

    fn poll_cq_ready(
        &self,
        cq: CqId,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), NicError>> {
        match self.cq(cq) {
            Ok(c) => c.cq.poll_ready(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_cq(&self, cq: CqId, out: &mut [Completion]) -> Result<usize, NicError> {
        let slot = self.cq(cq)?;
        let n = slot.cq.poll_into(out)?;
        self.settle(cq, &slot, &mut out[..n]);
        Ok(n)
    }
}

impl std::fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsNic").field("device", &self.ctx.name()).field("port", &self.port).finish()
    }
}
