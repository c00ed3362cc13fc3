//! The responder side and the memory-protection rules: remote access checks,
//! receives, binds and invalidations.

use std::ops::Range;

use super::event::{EvKind, Packet, Resp};
use super::oracle::HazardKind;
use super::sched::Lane;
use super::world::{KeyObj, MwState, Served, Srq, World, WrState};
use crate::backend::{rkey, Access, Completion, QpState, WcOpcode, WcStatus};

/// Why an invalidation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InvError {
    /// No object of this PD has the key's index.
    UnknownKey,
    /// The key names a memory region, which cannot be invalidated.
    NotAWindow,
    /// The window is bound, with another consumer key.
    WrongKey,
    /// The window is not bound (never bound, or already invalidated).
    NotBound,
    /// A SEND_WITH_INV received on a queue pair other than the one the
    /// type-2 window is bound to (or through another protection domain):
    /// the specification refuses it; rxe does not check.
    OtherQp,
    /// A window of another protection domain of the device: the
    /// specification does not find it (as an unknown key); rxe finds it,
    /// and invalidates it if it is bound, or panics if it is not.
    OtherPd,
}

impl InvError {
    /// rxe dereferences the window's (absent) region here and panics.
    pub(crate) fn would_crash_rxe(self) -> bool {
        self == InvError::NotBound
    }
}

/// `addr..addr+len` as offsets into an object at `base` of `size` bytes.
fn offsets(base: u64, size: usize, addr: u64, len: u64) -> Option<Range<usize>> {
    let start = usize::try_from(addr.checked_sub(base)?).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    (end <= size).then_some(start..end)
}

impl World {
    pub(crate) fn on_request(&mut self, dev: u32, qp: u32, src_dev: u32, src_qp: u32, psn: u64, pkt: Packet) {
        if !self.path_up(src_dev, dev) {
            self.log(|| format!("dev{dev} request psn {psn} from dev{src_dev} lost"));
            return;
        }
        let src_gid = self.devs[src_dev as usize].gid;
        let Some(src_qpn) = self.devs[src_dev as usize].qp(src_qp).map(|q| q.qpn) else { return };
        let Some(q) = self.devs[dev as usize].qp(qp) else { return };
        // A QP in ERR (or not yet connected) silently drops what arrives.
        if !matches!(q.state, QpState::Rtr | QpState::Rts) || q.remote != Some((src_gid, src_qpn)) {
            return;
        }
        if psn > q.epsn {
            return; // out of sequence: the requester goes back and resends
        }
        let dup = psn < q.epsn;
        match pkt {
            Packet::Send { payload, invalidate } => {
                self.on_send(dev, qp, (src_dev, src_qp), psn, dup, &payload, invalidate);
                self.spare.put(payload);
            }
            Packet::Read { addr, len, rkey } => {
                self.on_read(dev, qp, (src_dev, src_qp), psn, dup, addr, len, rkey)
            }
        }
    }

    fn respond(&mut self, dev: u32, to: (u32, u32), psn: u64, resp: Resp) {
        let bytes = match &resp {
            Resp::ReadData(d) => d.len() as u64,
            _ => 0,
        };
        let at = self.now + self.wire_time(dev, to.0, bytes);
        let kind = EvKind::Response { dev: to.0, qp: to.1, src_dev: dev, psn, resp };
        self.sched.push(Lane::Req(to.0, to.1), at, kind);
    }

    #[allow(clippy::too_many_arguments)]
    fn on_send(
        &mut self,
        dev: u32,
        qp: u32,
        src: (u32, u32),
        psn: u64,
        dup: bool,
        payload: &[u8],
        invalidate: Option<u32>,
    ) {
        if dup {
            return self.respond(dev, src, psn, Resp::Ack);
        }
        let d = &mut self.devs[dev as usize];
        let srq = d.qp(qp).expect("checked by caller").cfg.srq;
        let popped = match srq {
            // A QP on a shared receive queue takes the SRQ's oldest receive.
            Some(s) => d.srq_mut(s.0).and_then(Srq::pop),
            None => d.qp_mut(qp).expect("checked by caller").rq.pop_front(),
        };
        let q = self.devs[dev as usize].qp_mut(qp).expect("checked by caller");
        let Some(r) = popped else {
            let qpn = q.qpn;
            self.log(|| format!("dev{dev} qpn {qpn:#x} RNR: no receive posted"));
            return self.respond(dev, src, psn, Resp::RnrNak);
        };
        q.epsn += 1;
        let (qpn, pd, recv_cq) = (q.qpn, q.pd, q.cfg.recv_cq.0);
        let d = &self.devs[dev as usize];
        let check = match d.mr(r.sge.mr.0) {
            None => Err((WcStatus::LocProtErr, WcStatus::RemOpErr, true)),
            // rxe checks a receive's key against the receiving QP's PD, also
            // for a receive taken from a shared receive queue.
            Some(mr) if mr.pd != pd => Err((WcStatus::LocProtErr, WcStatus::RemOpErr, false)),
            Some(mr) if !mr.access.contains(Access::LOCAL_WRITE) => {
                Err((WcStatus::LocProtErr, WcStatus::RemOpErr, false))
            }
            Some(_) if payload.len() > r.sge.len as usize => {
                Err((WcStatus::LocLenErr, WcStatus::RemInvReqErr, false))
            }
            Some(_) => Ok(()),
        };
        let mut to_err = Vec::new();
        let result = check.and_then(|()| match invalidate {
            None => Ok(None),
            Some(rk) => match self.invalidate(dev, pd, rk, Some(qp)) {
                Ok(qps) => {
                    to_err = qps;
                    Ok(Some(rk))
                }
                Err(e) => {
                    if e.would_crash_rxe() {
                        let detail = format!("SEND_WITH_INV of rkey {rk:#x} received on qpn {qpn:#x}: {e:?}");
                        self.hazard(dev, HazardKind::WouldCrashRxe, detail);
                    }
                    Err((WcStatus::RemInvReqErr, WcStatus::RemInvReqErr, false))
                }
            },
        });
        let mut wc = Completion {
            wr_id: r.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: payload.len() as u32,
            invalidated_rkey: None,
            qpn,
            vendor_err: 0,
        };
        match result {
            Ok(inv) => {
                let mr = self.devs[dev as usize].mr_mut(r.sge.mr.0).expect("checked above");
                let range = r.sge.offset..r.sge.offset + payload.len();
                // Held bytes are skipped, and reported.
                if mr.data.dma_write(range.start, payload).unwrap_or(false) {
                    let detail = format!(
                        "SEND landed in region {} bytes {range:?}, some lent to a buffer handle (recv wr_id {})",
                        r.sge.mr.0, r.wr_id
                    );
                    self.hazard(dev, HazardKind::DmaIntoHeldBuffer, detail);
                }
                wc.invalidated_rkey = inv;
                self.deliver(dev, qp, recv_cq, wc);
                self.respond(dev, src, psn, Resp::Ack);
                self.error_all(to_err);
            }
            Err((local, nak, freed)) => {
                if freed {
                    let detail =
                        format!("SEND landed in deregistered region {} (recv wr_id {})", r.sge.mr.0, r.wr_id);
                    self.hazard(dev, HazardKind::DmaIntoFreedMemory, detail);
                }
                wc.status = local;
                wc.byte_len = 0;
                self.deliver(dev, qp, recv_cq, wc);
                self.respond(dev, src, psn, Resp::Nak(nak));
                self.enter_error(dev, qp, None);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_read(
        &mut self,
        dev: u32,
        qp: u32,
        src: (u32, u32),
        psn: u64,
        dup: bool,
        addr: u64,
        len: u64,
        rk: u32,
    ) {
        match self.check_read(dev, qp, addr, len, rk) {
            Ok((mr, range, mw)) => {
                let m = self.devs[dev as usize].mr(mr).expect("checked");
                let mut data = self.spare.take(range.len());
                if serve_bytes(m, range.clone(), mw.is_some(), &mut data) {
                    let via =
                        if mw.is_some() { "through a memory window" } else { "through the region's key" };
                    let detail = format!(
                        "a READ {via} was served from region {mr} bytes {range:?}, some lent to a buffer handle"
                    );
                    self.hazard(dev, HazardKind::RemoteReadOfHeldBuffer, detail);
                }
                let q = self.devs[dev as usize].qp_mut(qp).expect("checked by caller");
                if !dup {
                    q.epsn += 1;
                }
                q.counters.bytes_served += data.len() as u64;
                let qpn = q.qpn;
                let served = Served { at: self.now, dev, qp, qpn, mr, range, mw, rkey: rk, tail: None };
                if let Some(e) = self.devs[src.0 as usize]
                    .qp_mut(src.1)
                    .and_then(|q| q.sq.iter_mut().find(|e| e.psn == Some(psn) && e.st == WrState::Issued))
                {
                    e.served = Some(served);
                }
                self.respond(dev, src, psn, Resp::ReadData(data));
            }
            Err(why) => {
                let q = self.devs[dev as usize].qp_mut(qp).expect("checked by caller");
                q.counters.resp_remote_access_errors += 1;
                let qpn = q.qpn;
                self.log(|| format!("dev{dev} qpn {qpn:#x} remote access error, rkey {rk:#x}: {why}"));
                self.respond(dev, src, psn, Resp::Nak(WcStatus::RemAccessErr));
                self.enter_error(dev, qp, None);
            }
        }
    }

    /// A READ's response leaves its responder packet by packet, each copied
    /// from memory just before it goes, and the responder looks at its QP's
    /// state only between packets: rxe's `read_reply` copies outside any
    /// lock while another CPU may move the QP to ERR and flush its send
    /// queue, and nothing says a NIC's move to ERR waits for a copy under
    /// way. So a READ whose responder QP went to ERR while the response was
    /// on its way has its last packet copied as late as a NIC may: now, or
    /// when the QP was destroyed (the one point after which it copies
    /// nothing: `World::responder_destroyed`). The bytes so copied land in
    /// the requester's destination; a buffer handle holding them is a
    /// hazard, as for any READ (memory reused on the flush, before the
    /// destroy, is caught). A READ through a window whose bind was
    /// invalidated since is left as served: the invalidation's completion
    /// is the owner's evidence, and the packet a NIC may still be copying
    /// then is a gap this model does not cover (`docs/protocol-mw.md`, "The
    /// one-packet gap"). A window deallocated is no such evidence: its
    /// READs' last packets are still copied late.
    pub(crate) fn late_tail(&mut self, s: &mut Served, data: &mut [u8]) {
        let bytes = match s.tail.take() {
            Some(t) => t,
            None => {
                let err = self.devs[s.dev as usize]
                    .qp(s.qp)
                    .is_some_and(|q| q.qpn == s.qpn && q.state == QpState::Err);
                if !err || self.bind_ended(s) {
                    return;
                }
                match self.copy_tail(s) {
                    Some(t) => t,
                    None => return,
                }
            }
        };
        if bytes.len() <= data.len() {
            let at = data.len() - bytes.len();
            data[at..].copy_from_slice(&bytes);
        }
    }

    /// Whether `s` came through a window whose bind has been invalidated
    /// since (a LOCAL_INV, a SEND_WITH_INV, or a bind anew: the key
    /// changed). A window deallocated while bound has not: a deallocation
    /// is no evidence a copy under way ended (mwcap deallocates a down
    /// connection's lent windows before the destroy, and the buffers wait
    /// for the destroy), so its READs' last packets are still copied late.
    fn bind_ended(&self, s: &Served) -> bool {
        let Some(w) = s.mw else { return false };
        match self.devs[s.dev as usize].mw(w) {
            Some(m) => !(m.rkey == s.rkey && matches!(m.state, MwState::Bound { .. })),
            None => false,
        }
    }

    /// The last packet's bytes of the READ served as `s`, read from memory
    /// now (none if its region is gone: deregistration waits for a copy
    /// under way). A hazard if a buffer handle holds some of them.
    fn copy_tail(&mut self, s: &Served) -> Option<Vec<u8>> {
        let d = &self.devs[s.dev as usize];
        let n = s.range.len().min(d.cfg.mtu.max(1) as usize);
        let tail = s.range.end - n..s.range.end;
        let m = d.mr(s.mr)?;
        let mut out = Vec::with_capacity(n);
        if serve_bytes(m, tail.clone(), s.mw.is_some(), &mut out) {
            let detail = format!(
                "the last packet of a READ from region {} bytes {tail:?} was still being copied after its \
                 responder QP went to ERR, and some of them were lent to a buffer handle: the memory was \
                 reused before the QP was destroyed",
                s.mr
            );
            self.hazard(s.dev, HazardKind::RemoteReadOfHeldBuffer, detail);
        }
        Some(out)
    }

    /// Responder QP `qp` of `dev` is being destroyed: the READs it served
    /// whose responses are still on their way, if it is in ERR, have their
    /// last packet copied now, the latest it may be (`World::late_tail`).
    pub(crate) fn responder_destroyed(&mut self, dev: u32, qp: u32) {
        let Some(q) = self.devs[dev as usize].qp(qp) else { return };
        let (Some((gid, rqpn)), QpState::Err, qpn) = (q.remote, q.state, q.qpn) else { return };
        let Some(pd) = self.dev_by_gid(&gid) else { return };
        let Some(pq) = self.devs[pd as usize].qp_by_qpn(rqpn) else { return };
        let Some(peer) = self.devs[pd as usize].qp(pq) else { return };
        let waiting: Vec<(usize, Served)> = peer
            .sq
            .iter()
            .enumerate()
            .filter(|(_, e)| e.st == WrState::Issued && !e.hung)
            .filter_map(|(i, e)| Some((i, e.served.clone()?)))
            .filter(|(_, s)| s.dev == dev && s.qp == qp && s.qpn == qpn && s.tail.is_none())
            .filter(|(_, s)| !self.bind_ended(s))
            .collect();
        for (i, s) in waiting {
            let tail = self.copy_tail(&s);
            if let Some(s) = self.devs[pd as usize].qp_mut(pq).and_then(|q| q.sq[i].served.as_mut()) {
                s.tail = tail;
            }
        }
    }

    /// Check a READ of `addr..+len` through `rk` arriving at responder `qp`;
    /// on success the region and offsets to copy, and the window used.
    pub(crate) fn check_read(
        &self,
        dev: u32,
        qp: u32,
        addr: u64,
        len: u64,
        rk: u32,
    ) -> Result<(u32, Range<usize>, Option<u32>), &'static str> {
        let d = &self.devs[dev as usize];
        let pd = d.qp(qp).ok_or("no such queue pair")?.pd;
        match d.keys.get(&(rk >> 8)).copied().ok_or("unknown rkey")? {
            KeyObj::Mr(m) => {
                let mr = d.mr(m).filter(|mr| mr.pd == pd).ok_or("region of another protection domain")?;
                if mr.rkey != rk {
                    return Err("wrong consumer key");
                }
                if !mr.access.contains(Access::REMOTE_READ) {
                    return Err("region grants no remote read");
                }
                let range = offsets(mr.addr, mr.data.len(), addr, len).ok_or("outside the region")?;
                Ok((m, range, None))
            }
            KeyObj::Mw(w) => {
                let mw = d.mw(w).filter(|mw| mw.pd == pd).ok_or("window of another protection domain")?;
                let MwState::Bound { qp: bound, mr: m, offset, len: wlen, access } = mw.state else {
                    return Err("window not bound");
                };
                if mw.rkey != rk {
                    return Err("stale or wrong consumer key");
                }
                if bound != qp {
                    return Err("window bound to another queue pair");
                }
                if !access.contains(Access::REMOTE_READ) {
                    return Err("window grants no remote read");
                }
                let mr = d.mr(m).ok_or("window's region is gone")?;
                let range = if d.cfg.rxe_quirks {
                    offsets(mr.addr, mr.data.len(), addr, len).ok_or("outside the region")?
                } else {
                    let r = offsets(mr.addr + offset as u64, wlen, addr, len).ok_or("outside the window")?;
                    r.start + offset..r.end + offset
                };
                Ok((m, range, Some(w)))
            }
        }
    }

    /// Bind window `mw` for queue pair `qp`, following the spec's checks.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bind(
        &mut self,
        dev: u32,
        qp: u32,
        mw: u32,
        new_rkey: u32,
        mr: u32,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<(), &'static str> {
        let d = &mut self.devs[dev as usize];
        let pd = d.qp(qp).ok_or("no such queue pair")?.pd;
        let m = d.mr(mr).filter(|m| m.pd == pd).ok_or("region is gone")?;
        let w = d.mw(mw).filter(|w| w.pd == pd).ok_or("window is gone")?;
        if rkey::index(new_rkey) != rkey::index(w.rkey) {
            return Err("new rkey has another window's index bits");
        }
        if matches!(w.state, MwState::Bound { .. }) {
            return Err("window is still bound; invalidate it first");
        }
        if !m.access.contains(Access::MW_BIND) {
            return Err("region lacks MW_BIND");
        }
        if len == 0 {
            return Err("zero-length window");
        }
        if !offset.checked_add(len).is_some_and(|end| end <= m.data.len()) {
            return Err("window extends past the region");
        }
        if access.contains(Access::REMOTE_WRITE) && !m.access.contains(Access::LOCAL_WRITE) {
            return Err("a writable window needs LOCAL_WRITE on the region");
        }
        d.mr_mut(mr).expect("checked").bound_mws += 1;
        let w = d.mw_mut(mw).expect("checked");
        w.rkey = new_rkey;
        w.state = MwState::Bound { qp, mr, offset, len, access };
        Ok(())
    }

    /// Invalidate the window named by `rk`: by a LOCAL_INV posted in
    /// protection domain `pd` (`by_qp` `None`), or by a SEND_WITH_INV
    /// received on queue pair `by_qp` of `pd`.
    ///
    /// A spec device finds the window among `pd`'s, and invalidates a
    /// type-2 window for a SEND_WITH_INV only when it is bound to the
    /// receiving queue pair (InfiniBand's rule for type 2B windows, which
    /// mlx5 follows). An rxe device looks the key up across the whole
    /// device and checks neither the queue pair nor the protection domain
    /// (`rxe_invalidate_mw`; measured by `mwcap probe` in the VM): any
    /// peer that knows or guesses a key can invalidate any window.
    ///
    /// Returns the queue pairs rxe's in-flight quirk moves to ERR.
    pub(crate) fn invalidate(
        &mut self,
        dev: u32,
        pd: u32,
        rk: u32,
        by_qp: Option<u32>,
    ) -> Result<Vec<(u32, u32)>, InvError> {
        let d = &mut self.devs[dev as usize];
        let rxe = d.cfg.rxe_quirks;
        let w = match d.keys.get(&(rk >> 8)) {
            Some(KeyObj::Mw(w)) => *w,
            Some(KeyObj::Mr(m)) if d.mr(*m).is_some_and(|m| m.pd == pd) => return Err(InvError::NotAWindow),
            _ => return Err(InvError::UnknownKey),
        };
        let mw = d.mw_mut(w).ok_or(InvError::UnknownKey)?;
        // The key first, as rxe checks it (`rxe_invalidate_mw`): a stale
        // rkey whose index a newer window took (indexes are reused) is
        // refused, whatever that window's PD or state.
        if mw.rkey != rk {
            return Err(InvError::WrongKey);
        }
        if !rxe && mw.pd != pd {
            return Err(InvError::OtherPd);
        }
        let MwState::Bound { mr, qp: bound_to, .. } = mw.state else { return Err(InvError::NotBound) };
        if by_qp.is_some_and(|q| q != bound_to) && !rxe {
            return Err(InvError::OtherQp);
        }
        let foreign = by_qp.is_none() && mw.pd != pd;
        mw.state = MwState::Invalidated;
        if let Some(m) = d.mr_mut(mr) {
            m.bound_mws -= 1;
        }
        self.log(|| format!("dev{dev} window rkey {rk:#x} invalidated"));
        if foreign {
            // rxe found another PD's window for a LOCAL_INV (a spec device
            // refuses it, and that is recorded as the same hazard): its
            // owner, not told, would invalidate it again.
            let detail = format!(
                "LOCAL_INV of rkey {rk:#x} posted in protection domain {pd} invalidated another domain's window \
                 (OtherPd; rxe checks neither QP nor PD): its owner's own LOCAL_INV of it would panic rxe's kernel"
            );
            self.hazard(dev, HazardKind::WouldCrashRxe, detail);
        }
        Ok(if self.devs[dev as usize].cfg.rxe_quirks { self.hang_reads_through(dev, w) } else { Vec::new() })
    }

    /// rxe: READs being answered through an invalidated window never
    /// complete, and the responder's QP goes to ERR.
    fn hang_reads_through(&mut self, dev: u32, w: u32) -> Vec<(u32, u32)> {
        let mut owners = Vec::new();
        for d in &mut self.devs {
            for q in d.qps.iter_mut().flatten() {
                for e in q.sq.iter_mut().filter(|e| e.st == WrState::Issued && !e.hung) {
                    if let Some(s) = e.served.as_ref().filter(|s| s.dev == dev && s.mw == Some(w)) {
                        e.hung = true;
                        if !owners.contains(&(dev, s.qp)) {
                            owners.push((dev, s.qp));
                        }
                    }
                }
            }
        }
        if !owners.is_empty() {
            self.log(|| format!("rxe quirk: READs through window {w} on dev{dev} will never complete"));
        }
        owners
    }
}

/// Read `range` of region `m` into `out` as a responder's DMA, held bytes
/// as POISON; whether that is a hazard: it met bytes a buffer handle holds
/// and the memory's policy does not let a peer read a held buffer (only
/// confirm's does, through the region's own key). A READ through a window
/// never may, whatever else reads the memory: under mw a window never
/// covers a buffer a user holds.
fn serve_bytes(m: &super::world::Mr, range: Range<usize>, via_window: bool, out: &mut Vec<u8>) -> bool {
    let met = m.data.dma_read(range.start, range.len(), out).unwrap_or(false);
    met && (via_window || !m.data.reads_of_held_expected())
}
