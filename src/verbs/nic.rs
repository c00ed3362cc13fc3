//! [`VerbsNic`]: the [`Nic`] interface over a real verbs device.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::cq::Cq;
use super::device::{Context, DeviceAttrs};
use super::error::OpenError;
use super::mr::Mr;
use super::mw::Mw;
use super::pd::Pd;
use super::post::{SendOp, SendRequest, Slice};
use super::qp::{PortInfo, Qp};
use super::track::Track;
use crate::backend::{
    Access, Completion, CqId, DeviceInfo, MrId, MrInfo, MwId, MwInfo, Nic, NicError, OsError, QpConfig,
    QpEndpoint, QpId, QpState, SendWr, Sge,
};

/// A queue pair with the record of what was posted on it, used to report
/// the opcode of error and flush completions (whose `opcode` the verbs spec
/// leaves undefined).
struct QpSlot {
    qp: Qp,
    send_cq: CqId,
    recv_cq: CqId,
    track: Mutex<Track>,
}

/// Fields drop in declaration order, which is the safe teardown order:
/// windows (unbinding them), queue pairs, regions (refused while a window
/// is bound), completion queues.
#[derive(Default)]
struct Tables {
    mws: HashMap<u32, Arc<Mw>>,
    qps: HashMap<u32, Arc<QpSlot>>,
    mrs: HashMap<u32, Arc<Mr>>,
    cqs: HashMap<u32, Arc<Cq>>,
    by_qpn: HashMap<u32, u32>,
    next: u32,
}

impl Tables {
    /// Ids are never reused, so a stale id cannot name a newer object.
    fn id(&mut self) -> u32 {
        self.next = self.next.wrapping_add(1);
        self.next
    }
}

fn missing(what: &'static str, id: u32) -> NicError {
    NicError::NoSuchObject { what, id }
}

fn busy(op: &'static str) -> NicError {
    NicError::Os { op, source: OsError::from_errno(libc::EBUSY) }
}

/// Put the mwcap id into a region error coming from the verbs layer.
fn relabel(e: NicError, id: MrId) -> NicError {
    match e {
        NicError::OutOfRange { offset, end, len, .. } => NicError::OutOfRange { mr: id.0, offset, end, len },
        other => other,
    }
}

/// A verbs device as a [`Nic`]: one context, one protection domain, and
/// tables mapping mwcap's small ids to the RAII verbs objects.
pub struct VerbsNic {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    port: PortInfo,
    attrs: DeviceAttrs,
    info: DeviceInfo,
    t: Mutex<Tables>,
}

impl VerbsNic {
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
        Ok(VerbsNic { ctx, pd, port, attrs, info, t: Mutex::new(Tables::default()) })
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The port, GID and MTU in use.
    pub fn port_info(&self) -> PortInfo {
        self.port
    }

    /// The device attributes queried at open.
    pub fn device_attrs(&self) -> DeviceAttrs {
        self.attrs
    }

    /// The current rkey of a window as tracked by the verbs layer (the rkey
    /// of its last posted bind).
    pub fn mw_rkey(&self, mw: MwId) -> Result<u32, NicError> {
        Ok(self.mw(mw)?.rkey())
    }

    /// Wait (asynchronously, on the CQ's completion channel) until a CQ has
    /// completions and return up to `max` of them.
    pub async fn wait_cq(&self, cq: CqId, max: usize) -> Result<Vec<Completion>, NicError> {
        let q = self.cq(cq)?;
        let mut got = q.wait(max).await?;
        self.settle(cq, &mut got);
        Ok(got)
    }

    fn mr(&self, id: MrId) -> Result<Arc<Mr>, NicError> {
        self.t.lock().mrs.get(&id.0).cloned().ok_or(missing("memory region", id.0))
    }

    fn mw(&self, id: MwId) -> Result<Arc<Mw>, NicError> {
        self.t.lock().mws.get(&id.0).cloned().ok_or(missing("memory window", id.0))
    }

    fn cq(&self, id: CqId) -> Result<Arc<Cq>, NicError> {
        self.t.lock().cqs.get(&id.0).cloned().ok_or(missing("completion queue", id.0))
    }

    fn qp(&self, id: QpId) -> Result<Arc<QpSlot>, NicError> {
        self.t.lock().qps.get(&id.0).cloned().ok_or(missing("queue pair", id.0))
    }

    fn settle(&self, cq: CqId, got: &mut [Completion]) {
        for c in got.iter_mut() {
            let slot = {
                let t = self.t.lock();
                t.by_qpn.get(&c.qpn).and_then(|id| t.qps.get(id)).cloned()
            };
            if let Some(slot) = slot {
                let from_sq = match (slot.send_cq == cq, slot.recv_cq == cq) {
                    (true, false) => Some(true),
                    (false, true) => Some(false),
                    _ => None,
                };
                slot.track.lock().settle(c, from_sq);
            }
        }
    }
}

impl Nic for VerbsNic {
    fn device_info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn reg_mr(&self, len: usize, access: Access) -> Result<MrInfo, NicError> {
        let mr = Mr::alloc(&self.pd, len, access)?;
        let info = MrInfo { id: MrId(0), addr: mr.addr(), len: mr.len(), lkey: mr.lkey(), rkey: mr.rkey() };
        let mut t = self.t.lock();
        let id = MrId(t.id());
        t.mrs.insert(id.0, Arc::new(mr));
        Ok(MrInfo { id, ..info })
    }

    fn dereg_mr(&self, id: MrId) -> Result<(), NicError> {
        let mut t = self.t.lock();
        let arc = t.mrs.remove(&id.0).ok_or(missing("memory region", id.0))?;
        let mr = match Arc::try_unwrap(arc) {
            Ok(mr) => mr,
            Err(arc) => {
                t.mrs.insert(id.0, arc);
                return Err(busy("deregister memory region (a post is using it)"));
            }
        };
        mr.close().map_err(|(mr, e)| {
            t.mrs.insert(id.0, Arc::new(mr));
            e
        })
    }

    fn write_mr(&self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), NicError> {
        self.mr(mr)?.write(offset, data).map_err(|e| relabel(e, mr))
    }

    fn read_mr(&self, mr: MrId, offset: usize, out: &mut [u8]) -> Result<(), NicError> {
        self.mr(mr)?.read(offset, out).map_err(|e| relabel(e, mr))
    }

    fn with_mr(&self, mr: MrId, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), NicError> {
        self.mr(mr)?.with_bytes(offset, len, f).map_err(|e| relabel(e, mr))
    }

    fn with_mr_mut(
        &self,
        mr: MrId,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), NicError> {
        self.mr(mr)?.with_bytes_mut(offset, len, f).map_err(|e| relabel(e, mr))
    }

    fn alloc_mw(&self) -> Result<MwInfo, NicError> {
        let mw = Mw::alloc(&self.pd)?;
        let rkey = mw.rkey();
        let mut t = self.t.lock();
        let id = MwId(t.id());
        t.mws.insert(id.0, Arc::new(mw));
        Ok(MwInfo { id, rkey })
    }

    fn dealloc_mw(&self, id: MwId) -> Result<(), NicError> {
        let mut t = self.t.lock();
        let arc = t.mws.remove(&id.0).ok_or(missing("memory window", id.0))?;
        let mw = match Arc::try_unwrap(arc) {
            Ok(mw) => mw,
            Err(arc) => {
                t.mws.insert(id.0, arc);
                return Err(busy("deallocate memory window (a post is using it)"));
            }
        };
        mw.close().map_err(|(mw, e)| {
            t.mws.insert(id.0, Arc::new(mw));
            e
        })
    }

    fn create_cq(&self, depth: u32) -> Result<CqId, NicError> {
        let cq = Cq::create(&self.ctx, depth.min(self.attrs.max_cqe.max(1)))?;
        let mut t = self.t.lock();
        let id = CqId(t.id());
        t.cqs.insert(id.0, Arc::new(cq));
        Ok(id)
    }

    fn destroy_cq(&self, id: CqId) -> Result<(), NicError> {
        let mut t = self.t.lock();
        if t.qps.values().any(|s| s.send_cq == id || s.recv_cq == id) {
            return Err(busy("destroy completion queue (queue pairs still use it)"));
        }
        let arc = t.cqs.remove(&id.0).ok_or(missing("completion queue", id.0))?;
        let cq = match Arc::try_unwrap(arc) {
            Ok(cq) => cq,
            Err(arc) => {
                t.cqs.insert(id.0, arc);
                return Err(busy("destroy completion queue (in use)"));
            }
        };
        cq.close().map_err(|(cq, e)| {
            t.cqs.insert(id.0, Arc::new(cq));
            e
        })
    }

    fn create_qp(&self, cfg: QpConfig) -> Result<QpEndpoint, NicError> {
        let scq = self.cq(cfg.send_cq)?;
        let rcq = self.cq(cfg.recv_cq)?;
        let a = &self.attrs;
        let rd = a.max_qp_rd_atom.min(a.max_qp_init_rd_atom).clamp(1, 255) as u8;
        let cfg = QpConfig {
            max_rd_atomic: cfg.max_rd_atomic.clamp(1, rd),
            max_sge: cfg.max_sge.clamp(1, a.max_sge.max(1)),
            max_send_wr: cfg.max_send_wr.clamp(1, a.max_qp_wr.max(1)),
            max_recv_wr: cfg.max_recv_wr.clamp(1, a.max_qp_wr.max(1)),
            ..cfg
        };
        let qp = Qp::create(&self.pd, &scq, &rcq, &cfg, self.port)?;
        let qpn = qp.qpn();
        let mut t = self.t.lock();
        let id = QpId(t.id());
        let endpoint = qp.endpoint(Some(id));
        let cap = (cfg.max_send_wr.max(cfg.max_recv_wr) as usize) * 2;
        let track = Mutex::new(Track::new(cap));
        t.qps.insert(id.0, Arc::new(QpSlot { qp, send_cq: cfg.send_cq, recv_cq: cfg.recv_cq, track }));
        t.by_qpn.insert(qpn, id.0);
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
        let mut t = self.t.lock();
        let arc = t.qps.remove(&id.0).ok_or(missing("queue pair", id.0))?;
        let slot = match Arc::try_unwrap(arc) {
            Ok(slot) => slot,
            Err(arc) => {
                t.qps.insert(id.0, arc);
                return Err(busy("destroy queue pair (a post is using it)"));
            }
        };
        let qpn = slot.qp.qpn();
        let QpSlot { qp, send_cq, recv_cq, track } = slot;
        match qp.close() {
            Ok(()) => {
                t.by_qpn.remove(&qpn);
                Ok(())
            }
            Err((qp, e)) => {
                t.qps.insert(id.0, Arc::new(QpSlot { qp, send_cq, recv_cq, track }));
                Err(e)
            }
        }
    }

    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<(), NicError> {
        let slot = self.qp(qp)?;
        // Resolve every id first (holding Arcs keeps the objects alive for the post).
        let mut mrs: HashMap<u32, Arc<Mr>> = HashMap::new();
        let mut mws: HashMap<u32, Arc<Mw>> = HashMap::new();
        {
            let t = self.t.lock();
            let mut need_mr = |id: MrId| -> Result<(), NicError> {
                let mr = t.mrs.get(&id.0).ok_or(missing("memory region", id.0))?;
                mrs.entry(id.0).or_insert_with(|| Arc::clone(mr));
                Ok(())
            };
            for wr in wrs {
                match wr {
                    SendWr::Send { sge, .. }
                    | SendWr::SendWithInv { sge, .. }
                    | SendWr::Read { local: sge, .. } => sge.iter().try_for_each(|s| need_mr(s.mr))?,
                    SendWr::BindMw { mw, mr, .. } => {
                        need_mr(*mr)?;
                        let w = t.mws.get(&mw.0).ok_or(missing("memory window", mw.0))?;
                        mws.entry(mw.0).or_insert_with(|| Arc::clone(w));
                    }
                    SendWr::LocalInv { .. } => {}
                }
            }
        }
        let slices = |list: &[Sge]| -> Result<Vec<Slice<'_>>, NicError> {
            list.iter()
                .map(|s| Slice::new(&mrs[&s.mr.0], s.offset, s.len).map_err(|e| relabel(e, s.mr)))
                .collect()
        };
        let mut reqs = Vec::with_capacity(wrs.len());
        for wr in wrs {
            let op = match wr {
                SendWr::Send { sge, .. } => SendOp::Send(slices(sge)?),
                SendWr::SendWithInv { sge, invalidate_rkey, .. } => {
                    SendOp::SendWithInv(slices(sge)?, *invalidate_rkey)
                }
                SendWr::Read { local, remote_addr, rkey, .. } => {
                    SendOp::Read { local: slices(local)?, remote_addr: *remote_addr, rkey: *rkey }
                }
                SendWr::BindMw { mw, rkey, mr, offset, len, access, .. } => {
                    let mrr = &mrs[&mr.0];
                    mrr.check_range(*offset, *len).map_err(|e| relabel(e, *mr))?;
                    SendOp::BindMw {
                        mw: &mws[&mw.0],
                        rkey: *rkey,
                        mr: mrr,
                        offset: *offset,
                        len: *len,
                        access: *access,
                    }
                }
                SendWr::LocalInv { rkey, .. } => SendOp::LocalInv(*rkey),
            };
            reqs.push(SendRequest { wr_id: wr.wr_id(), signaled: wr.signaled(), op });
        }
        let mut track = slot.track.lock();
        for wr in wrs {
            track.push_sq(wr.wr_id(), wr.opcode());
        }
        match slot.qp.post_send(&reqs) {
            Ok(()) => Ok(()),
            Err(e) => {
                track.unpush_sq(wrs.len() - e.posted);
                if e.posted == 0 {
                    Err(e.error)
                } else {
                    Err(NicError::InvalidWr(e.to_string()))
                }
            }
        }
    }

    fn post_recv(&self, qp: QpId, wr_id: u64, sge: Sge) -> Result<(), NicError> {
        let slot = self.qp(qp)?;
        let mr = self.mr(sge.mr)?;
        let slice = Slice::new(&mr, sge.offset, sge.len).map_err(|e| relabel(e, sge.mr))?;
        let mut track = slot.track.lock();
        track.push_rq(wr_id);
        slot.qp.post_recv(wr_id, &[slice]).inspect_err(|_| {
            track.unpush_rq();
        })
    }

    fn poll_cq_ready(&self, cq: CqId, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), NicError>> {
        match self.cq(cq) {
            Ok(c) => c.poll_ready(cx),
            Err(e) => std::task::Poll::Ready(Err(e)),
        }
    }

    fn poll_cq(&self, cq: CqId, out: &mut [Completion]) -> Result<usize, NicError> {
        let n = self.cq(cq)?.poll_into(out)?;
        self.settle(cq, &mut out[..n]);
        Ok(n)
    }
}

impl std::fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsNic").field("device", &self.ctx.name()).field("port", &self.port).finish()
    }
}
