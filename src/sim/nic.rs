//! [`SimNic`]: one protection domain of a simulated device, behind the
//! [`Nic`] trait.

use parking_lot::MutexGuard;

use super::config::{MwSupport, Progress};
use super::oracle::{DeviceId, HazardKind, QpAddr};
use super::world::{Cq, Device, KeyObj, Mr, Mw, MwState, Qp, RqEntry, SqEntry, Srq, World, WrState};
use super::Fabric;
use crate::backend::{
    Access, Completion, CqId, DeviceInfo, MrId, MrInfo, MwId, MwInfo, Nic, NicError, NicOps, OsError,
    QpConfig, QpEndpoint, QpId, QpState, SendWr, Sge, SrqId,
};

const ENODEV: i32 = 19;
const EBUSY: i32 = 16;
const EINVAL: i32 = 22;
const ENOMEM: i32 = 12;
const EIO: i32 = 5;

/// A verb [`SimNic::fail_next`] can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Verb {
    /// `ibv_create_cq`.
    CreateCq,
    /// `ibv_destroy_cq`.
    DestroyCq,
    /// `ibv_create_qp`.
    CreateQp,
    /// Moving a queue pair to RTS (`ibv_modify_qp` INIT, RTR, RTS).
    ConnectQp,
    /// Moving a queue pair to ERR (`ibv_modify_qp`).
    SetQpError,
    /// `ibv_destroy_qp`: the queue pair stays, in its state.
    DestroyQp,
    /// `ibv_dealloc_mw`: the window stays, bound or not.
    DeallocMw,
    /// `ibv_dereg_mr`: the region stays registered.
    DeregMr,
    /// `ibv_post_send`: nothing of the list is posted.
    PostSend,
    /// `ibv_post_recv`.
    PostRecv,
    /// `ibv_create_srq`.
    CreateSrq,
    /// `ibv_destroy_srq`.
    DestroySrq,
    /// `ibv_post_srq_recv`.
    PostSrqRecv,
    /// Arming an SRQ's limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`).
    ArmSrqLimit,
    /// `ibv_poll_cq`.
    PollCq,
}

impl Verb {
    /// The name its failure reports (`NicError::Os::op`).
    fn op(self) -> &'static str {
        match self {
            Verb::CreateCq => "create_cq",
            Verb::DestroyCq => "destroy_cq",
            Verb::CreateQp => "create_qp",
            Verb::ConnectQp => "connect_qp",
            Verb::SetQpError => "set_qp_error",
            Verb::DestroyQp => "destroy_qp",
            Verb::DeallocMw => "dealloc_mw",
            Verb::DeregMr => "dereg_mr",
            Verb::PostSend => "post_send",
            Verb::PostRecv => "post_recv",
            Verb::CreateSrq => "create_srq",
            Verb::DestroySrq => "destroy_srq",
            Verb::PostSrqRecv => "post_srq_recv",
            Verb::ArmSrqLimit => "arm_srq_limit",
            Verb::PollCq => "poll_cq",
        }
    }
}

/// One protection domain of a simulated device. Cheap to clone; clones
/// share the PD. Objects of other PDs (even on the same device) are
/// invisible through it.
#[derive(Clone, Debug)]
pub struct SimNic {
    fabric: Fabric,
    dev: u32,
    pd: u32,
}

fn os(op: &'static str, errno: i32) -> NicError {
    NicError::Os { op, source: OsError::from_errno(errno) }
}

fn no_such(what: &'static str, id: u32) -> NicError {
    NicError::NoSuchObject { what, id }
}

impl SimNic {
    pub(crate) fn new(fabric: Fabric, dev: u32, pd: u32) -> SimNic {
        SimNic { fabric, dev, pd }
    }

    /// The fabric this device belongs to.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The device, for fault knobs and the oracle.
    pub fn device(&self) -> DeviceId {
        DeviceId(self.dev)
    }

    /// Another protection domain on the same device (keys are shared by the
    /// device, objects are not, except completion queues, which belong to
    /// the device: see `NicOps::new_pd`).
    pub fn new_pd(&self) -> Result<SimNic, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "alloc_pd")?;
        let pd = d.next_pd;
        d.next_pd += 1;
        Ok(SimNic::new(self.fabric.clone(), self.dev, pd))
    }

    /// The fabric address of one of this handle's queue pairs.
    pub fn qp_addr(&self, qp: QpId) -> Result<QpAddr, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "qp_addr")?;
        let q = d.qp(qp.0).filter(|q| q.pd == self.pd).ok_or_else(|| no_such("queue pair", qp.0))?;
        Ok(QpAddr { device: DeviceId(self.dev), qpn: q.qpn })
    }

    /// The next `times` calls of `verb` on this device (any protection
    /// domain) fail with `EIO` and change nothing, as a provider's error
    /// would: a queue pair whose destroy failed is still there, and so is
    /// its access to memory. Adds to failures already set for `verb`.
    pub fn fail_next(&self, verb: Verb, times: u32) {
        let mut w = self.fabric.lock();
        if let Some(d) = w.devs.get_mut(self.dev as usize) {
            match d.failing.iter_mut().find(|f| f.0 == verb.op()) {
                Some(f) => f.1 += times,
                None => d.failing.push((verb.op(), times)),
            }
        }
    }

    /// The process owning this device dies ([`Fabric::kill_device`]).
    pub fn kill(&self) {
        self.fabric.kill_device(self.device());
    }
}

fn live<'a>(
    w: &'a mut MutexGuard<'_, World>,
    dev: u32,
    op: &'static str,
) -> Result<&'a mut Device, NicError> {
    match w.devs.get_mut(dev as usize) {
        Some(d) if d.alive => {
            if !d.failing.is_empty() {
                if let Some(f) = d.failing.iter_mut().find(|f| f.0 == op && f.1 > 0) {
                    f.1 -= 1;
                    return Err(os(op, EIO));
                }
            }
            Ok(d)
        }
        _ => Err(os(op, ENODEV)),
    }
}

impl SimNic {
    /// In [`Progress::Auto`] a real NIC works on what was posted by itself;
    /// here, whoever waits on a queue runs the fabric. Wake the waiters on
    /// `qp`'s completion queues, so that a driver asleep on one (perhaps a
    /// hub's, shared with many QPs) runs what was just posted.
    fn kick(&self, w: &mut MutexGuard<'_, World>, qp: QpId) {
        if w.cfg.progress != Progress::Auto {
            return;
        }
        let d = &mut w.devs[self.dev as usize];
        let Some(cfg) = d.qp(qp.0).map(|q| q.cfg) else { return };
        for cq in [cfg.send_cq, cfg.recv_cq] {
            if let Some(waker) =
                d.cqs.get_mut(cq.0 as usize).and_then(Option::as_mut).and_then(|c| c.waker.take())
            {
                waker.wake();
            }
        }
    }

    /// Whether the device's completion queue `cq` holds a completion.
    fn cq_has_entries(&self, w: &World, cq: CqId) -> Result<bool, NicError> {
        let c = w.devs[self.dev as usize].cqs.get(cq.0 as usize).and_then(Option::as_ref);
        let c = c.ok_or_else(|| no_such("completion queue", cq.0))?;
        Ok(!c.entries.is_empty())
    }

    fn qp_of<'a>(&self, d: &'a Device, qp: QpId) -> Result<&'a Qp, NicError> {
        d.qp(qp.0).filter(|q| q.pd == self.pd).ok_or_else(|| no_such("queue pair", qp.0))
    }

    fn srq_of<'a>(&self, d: &'a mut Device, srq: SrqId) -> Result<&'a mut Srq, NicError> {
        d.srq_mut(srq.0).filter(|q| q.pd == self.pd).ok_or_else(|| no_such("shared receive queue", srq.0))
    }

    fn mr_of<'a>(&self, d: &'a Device, mr: MrId) -> Result<&'a Mr, NicError> {
        d.mr(mr.0).filter(|m| m.pd == self.pd).ok_or_else(|| no_such("memory region", mr.0))
    }

    fn check_sge(&self, d: &Device, s: &Sge) -> Result<(), NicError> {
        let mr = self.mr_of(d, s.mr)?;
        let end = s.offset.checked_add(s.len as usize);
        match end {
            Some(end) if end <= mr.data.len() => Ok(()),
            _ => Err(NicError::OutOfRange {
                mr: s.mr.0,
                offset: s.offset,
                end: end.unwrap_or(usize::MAX),
                len: mr.data.len(),
            }),
        }
    }

    fn check_wr(&self, d: &Device, q: &Qp, wr: &SendWr) -> Result<(), NicError> {
        let max_sge = q.cfg.max_sge.min(d.cfg.max_sge) as usize;
        let sges = match wr {
            SendWr::Send { sge, .. } | SendWr::SendWithInv { sge, .. } => &sge[..],
            SendWr::Read { local, .. } => &local[..],
            SendWr::BindMw { mw, mr, offset, len, .. } => {
                if d.cfg.mw == MwSupport::AllocNoBind {
                    let detail = "the provider cannot post a window bind".to_string();
                    return Err(NicError::Unsupported { op: "bind_mw", detail });
                }
                d.mw(mw.0).filter(|w| w.pd == self.pd).ok_or_else(|| no_such("memory window", mw.0))?;
                // Like the verbs backend: a range past the region's end is
                // refused at post time (the NIC would answer MW_BIND_ERR and
                // kill the QP). Zero length is left to the NIC.
                let len =
                    u32::try_from(*len).map_err(|_| NicError::InvalidWr(format!("bind of {len} bytes")))?;
                self.check_sge(d, &Sge { mr: *mr, offset: *offset, len })?;
                &[]
            }
            SendWr::LocalInv { .. } => {
                if d.cfg.mw == MwSupport::AllocNoBind {
                    let detail = "the provider cannot post a local invalidation".to_string();
                    return Err(NicError::Unsupported { op: "local_inv", detail });
                }
                &[]
            }
        };
        if sges.len() > max_sge {
            return Err(NicError::InvalidWr(format!("{} scatter entries, at most {max_sge}", sges.len())));
        }
        let total: u64 = sges.iter().map(|s| s.len as u64).sum();
        if total > 1 << 31 {
            return Err(NicError::InvalidWr(format!("{total} bytes in one request, at most 2 GiB")));
        }
        sges.iter().try_for_each(|s| self.check_sge(d, s))
    }
}

impl NicOps for SimNic {
    fn device_info(&self) -> DeviceInfo {
        let w = self.fabric.lock();
        let d = &w.devs[self.dev as usize];
        let (mem_window, max_mw) = match d.cfg.mw {
            MwSupport::None => (false, 0),
            _ => (true, d.cfg.max_mw),
        };
        DeviceInfo {
            name: d.cfg.name.clone(),
            driver: if d.cfg.rxe_quirks { "sim-rxe".into() } else { "sim".into() },
            mem_window,
            mw_type_2a: false,
            mw_type_2b: mem_window,
            max_mw,
            max_sge: d.cfg.max_sge,
            max_qp_rd_atom: 16,
            mtu: d.cfg.mtu,
        }
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<MrInfo, NicError> {
        if len > 1 << 32 {
            return Err(os("reg_mr", ENOMEM));
        }
        let mem = crate::mem::Memory::zeroed(len, 8).ok_or_else(|| os("reg_mr", ENOMEM))?;
        self.reg_memory(&mem, access)
    }

    fn reg_memory(
        &self,
        mem: &std::sync::Arc<crate::mem::Memory>,
        access: Access,
    ) -> Result<MrInfo, NicError> {
        let len = mem.len();
        let mut w = self.fabric.lock();
        let World { devs, rng, .. } = &mut *w;
        let d = devs.get_mut(self.dev as usize).filter(|d| d.alive).ok_or_else(|| os("reg_mr", ENODEV))?;
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            return Err(os("reg_mr", EINVAL));
        }
        if len > 1 << 32 {
            return Err(os("reg_mr", ENOMEM));
        }
        let idx = d.mrs.len() as u32;
        let rkey = d.new_key(KeyObj::Mr(idx), rng);
        let addr = d.next_addr;
        // Regions are spaced apart so that an overrun never lands in a neighbour.
        d.next_addr += (len as u64).div_ceil(4096) * 4096 + 0x10_0000;
        d.mrs.push(Some(Mr {
            pd: self.pd,
            data: std::sync::Arc::clone(mem),
            access,
            addr,
            rkey,
            bound_mws: 0,
        }));
        Ok(MrInfo { id: MrId(idx), addr, len, lkey: rkey, rkey })
    }

    fn dereg_mr(&self, mr: MrId) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "dereg_mr")?;
        let m = self.mr_of(d, mr)?;
        if m.bound_mws > 0 {
            return Err(os("dereg_mr", EBUSY));
        }
        let rkey = m.rkey;
        d.free_key(rkey);
        d.mrs[mr.0 as usize] = None;
        Ok(())
    }

    fn write_mr(&self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "write_mr")?;
        self.check_sge(d, &Sge { mr, offset, len: u32::try_from(data.len()).unwrap_or(u32::MAX) })?;
        let m = d.mr_mut(mr.0).expect("checked");
        m.data.write(offset, data).map_err(|e| e.into_nic(mr.0, offset, data.len(), m.data.len()))
    }

    fn read_mr(&self, mr: MrId, offset: usize, out: &mut [u8]) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "read_mr")?;
        self.check_sge(d, &Sge { mr, offset, len: u32::try_from(out.len()).unwrap_or(u32::MAX) })?;
        let m = self.mr_of(d, mr)?;
        m.data.read(offset, out).map_err(|e| e.into_nic(mr.0, offset, out.len(), m.data.len()))
    }

    fn memory(&self, mr: MrId) -> Result<std::sync::Arc<crate::mem::Memory>, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "memory")?;
        Ok(self.mr_of(d, mr)?.data.clone())
    }

    fn alloc_mw(&self) -> Result<MwInfo, NicError> {
        let mut w = self.fabric.lock();
        let World { devs, rng, .. } = &mut *w;
        let d = devs.get_mut(self.dev as usize).filter(|d| d.alive).ok_or_else(|| os("alloc_mw", ENODEV))?;
        match d.cfg.mw {
            MwSupport::None => {
                let detail = "the device has no memory windows".to_string();
                return Err(NicError::Unsupported { op: "alloc_mw", detail });
            }
            MwSupport::AdvertisedNoAlloc => {
                let detail = "the provider has no alloc_mw (EOPNOTSUPP), although the device advertises \
                              type-2B windows"
                    .to_string();
                return Err(NicError::Unsupported { op: "alloc_mw", detail });
            }
            MwSupport::Full | MwSupport::AllocNoBind => {}
        }
        if d.mws.iter().flatten().count() >= d.cfg.max_mw as usize {
            return Err(os("alloc_mw", ENOMEM));
        }
        let idx = d.mws.len() as u32;
        let rkey = d.new_key(KeyObj::Mw(idx), rng);
        d.mws.push(Some(Mw { pd: self.pd, rkey, state: MwState::Unbound }));
        Ok(MwInfo { id: MwId(idx), rkey })
    }

    fn dealloc_mw(&self, mw: MwId) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "dealloc_mw")?;
        let m = d.mw(mw.0).filter(|m| m.pd == self.pd).ok_or_else(|| no_such("memory window", mw.0))?;
        let (rkey, bound) = (m.rkey, matches!(m.state, MwState::Bound { .. }));
        let mut to_err = Vec::new();
        if bound {
            // Freeing a bound window invalidates it (a legitimate invalidation, never a hazard).
            to_err = w.invalidate(self.dev, self.pd, rkey, None).unwrap_or_default();
        }
        let d = &mut w.devs[self.dev as usize];
        d.free_key(rkey);
        d.mws[mw.0 as usize] = None;
        w.error_all(to_err);
        Ok(())
    }

    fn new_pd(&self) -> Result<SimNic, NicError> {
        SimNic::new_pd(self)
    }

    fn new_pd_boxed(&self) -> Result<Box<dyn Nic>, NicError> {
        Ok(Box::new(SimNic::new_pd(self)?))
    }

    fn same_pd(&self) -> Result<SimNic, NicError> {
        Ok(self.clone())
    }

    fn create_cq(&self, depth: u32) -> Result<CqId, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "create_cq")?;
        if depth > d.cfg.max_cqe {
            return Err(NicError::CqTooDeep { depth, max: d.cfg.max_cqe });
        }
        // Room for a burst up front, as a device's queue is allocated
        // whole: a queue that grows while completions pile up would
        // allocate on the data path the first time a burst is larger.
        let room = (depth as usize).min(1024);
        d.cqs.push(Some(Cq {
            entries: std::collections::VecDeque::with_capacity(room),
            users: 0,
            waker: None,
        }));
        Ok(CqId(d.cqs.len() as u32 - 1))
    }

    fn destroy_cq(&self, cq: CqId) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "destroy_cq")?;
        let c = d.cqs.get(cq.0 as usize).and_then(Option::as_ref);
        match c {
            None => Err(no_such("completion queue", cq.0)),
            Some(c) if c.users > 0 => Err(os("destroy_cq", EBUSY)),
            Some(_) => {
                d.cqs[cq.0 as usize] = None;
                Ok(())
            }
        }
    }

    fn create_qp(&self, cfg: QpConfig) -> Result<QpEndpoint, NicError> {
        let mut w = self.fabric.lock();
        let (retry, rnr) = (w.cfg.faults.retry_cnt, w.cfg.faults.rnr_retry);
        let d = live(&mut w, self.dev, "create_qp")?;
        for cq in [cfg.send_cq, cfg.recv_cq] {
            if d.cqs.get(cq.0 as usize).and_then(Option::as_ref).is_none() {
                return Err(no_such("completion queue", cq.0));
            }
        }
        if let Some(srq) = cfg.srq {
            self.srq_of(d, srq)?.users += 1;
        }
        for cq in [cfg.send_cq, cfg.recv_cq] {
            d.cqs[cq.0 as usize].as_mut().expect("checked").users += 1;
        }
        let qpn = d.qpns.take();
        let idx = d.qps.len() as u32;
        d.qps.push(Some(Qp::new(self.pd, qpn, cfg, retry, rnr)));
        d.by_qpn.insert(qpn, idx);
        let (gid, mtu) = (d.gid, d.cfg.mtu);
        Ok(QpEndpoint { id: QpId(idx), qpn, gid, psn: 0, mtu, lid: 0 })
    }

    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "connect_qp")?;
        let state = self.qp_of(d, qp)?.state;
        if state != QpState::Init {
            return Err(NicError::BadQpState { qp: qp.0, state, op: "connect_qp", needs: "INIT" });
        }
        let q = d.qp_mut(qp.0).expect("checked");
        q.remote = Some((remote.gid, remote.qpn));
        q.state = QpState::Rts;
        let qpn = q.qpn;
        w.log(|| format!("dev{} qpn {qpn:#x} -> RTS towards qpn {:#x}", self.dev, remote.qpn));
        Ok(())
    }

    fn set_qp_error(&self, qp: QpId) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "set_qp_error")?;
        self.qp_of(d, qp)?;
        w.enter_error(self.dev, qp.0, None);
        Ok(())
    }

    fn qp_state(&self, qp: QpId) -> Result<QpState, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "qp_state")?;
        Ok(self.qp_of(d, qp)?.state)
    }

    fn destroy_qp(&self, qp: QpId) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "destroy_qp")?;
        let cfg = self.qp_of(d, qp)?.cfg;
        let bound =
            d.mws.iter().flatten().filter(|m| matches!(m.state, MwState::Bound { qp: q, .. } if q == qp.0));
        let rkeys: Vec<u32> = bound.map(|m| m.rkey).collect();
        if !rkeys.is_empty() {
            let detail = format!(
                "queue pair {} destroyed with {} memory window(s) still bound through it (rkeys {rkeys:#x?}): \
                 rxe stalls in the destroy, then frees the QP under the windows",
                qp.0,
                rkeys.len()
            );
            w.hazard(self.dev, HazardKind::DestroyUnderBoundWindow, detail);
        }
        w.responder_destroyed(self.dev, qp.0);
        let d = live(&mut w, self.dev, "destroy_qp")?;
        for cq in [cfg.send_cq, cfg.recv_cq] {
            if let Some(Some(c)) = d.cqs.get_mut(cq.0 as usize) {
                c.users -= 1;
            }
        }
        if let Some(s) = cfg.srq.and_then(|s| d.srq_mut(s.0)) {
            s.users -= 1;
        }
        if let Some(q) = d.qps[qp.0 as usize].take() {
            d.by_qpn.remove(&q.qpn);
            if d.cfg.reuse_qpns {
                d.qpns.give_back(q.qpn);
            }
        }
        Ok(())
    }

    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let now = w.now;
        let d = live(&mut w, self.dev, "post_send")?;
        let q = self.qp_of(d, qp)?;
        if !matches!(q.state, QpState::Rts | QpState::Err) {
            return Err(NicError::BadQpState { qp: qp.0, state: q.state, op: "post_send", needs: "RTS" });
        }
        if q.sq.len() + wrs.len() > q.cfg.max_send_wr as usize {
            return Err(NicError::QueueFull { queue: "send queue", depth: q.cfg.max_send_wr });
        }
        for wr in wrs {
            self.check_wr(d, q, wr)?;
        }
        let q = d.qp_mut(qp.0).expect("checked");
        let err = q.state == QpState::Err;
        for wr in wrs {
            q.counters.sends_posted += 1;
            q.sq.push_back(SqEntry {
                wr: *wr,
                posted_at: now,
                st: WrState::Pending,
                psn: None,
                payload: None,
                served: None,
                hung: false,
            });
        }
        if err {
            // Work posted to a QP in ERR completes at once with WR_FLUSH_ERR.
            w.enter_error(self.dev, qp.0, None);
        } else {
            w.schedule_issue(self.dev, qp.0);
        }
        self.kick(&mut w, qp);
        Ok(())
    }

    fn post_recv(&self, qp: QpId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "post_recv")?;
        let q = self.qp_of(d, qp)?;
        if q.state == QpState::Reset {
            return Err(NicError::BadQpState { qp: qp.0, state: q.state, op: "post_recv", needs: "INIT" });
        }
        if let Some(srq) = q.cfg.srq {
            return Err(NicError::InvalidWr(format!(
                "queue pair {} takes its receives from shared receive queue {}: post them there \
                 (post_srq_recv)",
                qp.0, srq.0
            )));
        }
        if q.rq.len() >= q.cfg.max_recv_wr as usize {
            return Err(NicError::QueueFull { queue: "receive queue", depth: q.cfg.max_recv_wr });
        }
        self.check_sge(d, &sge)?;
        let q = d.qp_mut(qp.0).expect("checked");
        q.counters.recvs_posted += 1;
        q.rq.push_back(RqEntry { wr_id, sge });
        if q.state == QpState::Err {
            w.enter_error(self.dev, qp.0, None);
        }
        self.kick(&mut w, qp);
        Ok(())
    }

    fn create_srq(&self, max_wr: u32) -> Result<SrqId, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "create_srq")?;
        if max_wr == 0 {
            return Err(os("create_srq", EINVAL));
        }
        let srq = Srq { pd: self.pd, max_wr, rq: Default::default(), limit: 0, limit_fired: false, users: 0 };
        d.srqs.push(Some(srq));
        Ok(SrqId(d.srqs.len() as u32 - 1))
    }

    fn destroy_srq(&self, srq: SrqId) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "destroy_srq")?;
        if self.srq_of(d, srq)?.users > 0 {
            return Err(os("destroy_srq", EBUSY));
        }
        d.srqs[srq.0 as usize] = None;
        Ok(())
    }

    fn post_srq_recv(&self, srq: SrqId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "post_srq_recv")?;
        self.check_sge(d, &sge)?;
        let q = self.srq_of(d, srq)?;
        if q.rq.len() >= q.max_wr as usize {
            return Err(NicError::QueueFull { queue: "shared receive queue", depth: q.max_wr });
        }
        q.rq.push_back(RqEntry { wr_id, sge });
        Ok(())
    }

    fn arm_srq_limit(&self, srq: SrqId, limit: u32) -> Result<(), NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "arm_srq_limit")?;
        let q = self.srq_of(d, srq)?;
        if limit > q.max_wr {
            return Err(os("modify_srq", EINVAL));
        }
        q.limit = limit;
        Ok(())
    }

    fn take_srq_limit(&self, srq: SrqId) -> Result<bool, NicError> {
        let mut w = self.fabric.lock();
        let d = live(&mut w, self.dev, "take_srq_limit")?;
        Ok(std::mem::take(&mut self.srq_of(d, srq)?.limit_fired))
    }

    fn poll_cq(&self, cq: CqId, out: &mut [Completion]) -> Result<usize, NicError> {
        let mut w = self.fabric.lock();
        live(&mut w, self.dev, "poll_cq")?;
        self.cq_has_entries(&w, cq)?;
        if w.cfg.progress == Progress::Auto {
            w.run_due();
            if !self.cq_has_entries(&w, cq)? && w.advance_to_next() {
                w.run_due();
            }
        }
        let c = w.devs[self.dev as usize].cqs.get_mut(cq.0 as usize).and_then(Option::as_mut);
        let c = c.ok_or_else(|| no_such("completion queue", cq.0))?;
        let n = out.len().min(c.entries.len());
        for (o, e) in out.iter_mut().zip(c.entries.drain(..n)) {
            *o = e;
        }
        Ok(n)
    }

    fn poll_cq_ready(
        &self,
        cq: CqId,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), NicError>> {
        use std::task::Poll;
        let mut w = self.fabric.lock();
        let ready = (|| {
            live(&mut w, self.dev, "poll_cq_ready")?;
            if w.cfg.progress == Progress::Auto {
                // Whoever waits runs the fabric, until this queue has a
                // completion or nothing is pending; completions landing on
                // other queues wake their waiters.
                while !self.cq_has_entries(&w, cq)? {
                    if w.run_due() == 0 && !w.advance_to_next() {
                        break;
                    }
                }
            }
            self.cq_has_entries(&w, cq)
        })();
        match ready {
            Ok(false) => {
                let c =
                    w.devs[self.dev as usize].cqs[cq.0 as usize].as_mut().expect("checked by cq_has_entries");
                crate::handle::store_waker(&mut c.waker, cx.waker());
                Poll::Pending
            }
            Ok(true) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}
