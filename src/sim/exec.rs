//! The requester side: running events, executing send-queue work requests,
//! transmitting, retrying, and taking responses.

use super::event::{EvKind, Packet, Resp};
use super::oracle::HazardKind;
use super::resp::InvError;
use super::sched::Lane;
use super::world::{World, WrState};
use crate::backend::{Access, QpState, SendWr, WcOpcode, WcStatus};

/// What a READ that failed after its request went out leaves in its
/// destination, written just before its completion shows: a NIC may still
/// be landing the response while the QP goes to ERR, and the
/// specification leaves the destination of a failed work request
/// undefined. Memory reused before that completion (or the QP's
/// destruction) is caught: as a hazard if a buffer handle holds it, as
/// wrong bytes otherwise.
pub const LATE_BYTE: u8 = 0xDB;

impl World {
    /// Run one due event; false if none is due.
    pub(crate) fn run_one_due(&mut self) -> bool {
        let Some(ev) = self.sched.pop_due(self.now, &mut self.rng) else { return false };
        self.handle(ev.kind);
        true
    }

    /// Run every due event (including those that become due meanwhile).
    pub(crate) fn run_due(&mut self) -> usize {
        let mut n = 0;
        while self.run_one_due() {
            n += 1;
        }
        n
    }

    /// Move the clock to the next pending event, if any.
    pub(crate) fn advance_to_next(&mut self) -> bool {
        match self.sched.next_at() {
            Some(at) => {
                self.now = self.now.max(at);
                true
            }
            None => false,
        }
    }

    fn handle(&mut self, kind: EvKind) {
        match kind {
            EvKind::Issue { dev, qp } => self.on_issue(dev, qp),
            EvKind::Request { dev, qp, src_dev, src_qp, psn, pkt } => {
                self.on_request(dev, qp, src_dev, src_qp, psn, pkt)
            }
            EvKind::Response { dev, qp, src_dev, psn, resp } => self.on_response(dev, qp, src_dev, psn, resp),
            EvKind::AckTimer { dev, qp, gen } => self.on_ack_timer(dev, qp, gen),
            EvKind::RnrResend { dev, qp, psn } => self.on_rnr_resend(dev, qp, psn),
            EvKind::Deliver { dev, qp, cq, wc, late } => {
                if let Some(local) = late {
                    self.land_late(dev, qp, wc.wr_id, &local);
                } else if wc.opcode == WcOpcode::RdmaRead && wc.status == WcStatus::Success {
                    self.check_landed(dev, qp, wc.wr_id);
                }
                self.on_deliver(dev, qp, cq, wc)
            }
        }
    }

    /// A READ's successful completion is about to show: its destination
    /// must not have been lent to a buffer handle since its response landed
    /// (a retransmitted response may land again until the completion; the
    /// landing itself checks the instant it happens). A held destination is
    /// `DmaIntoHeldBuffer`, unless its QP is destroyed (its completions are
    /// dropped then, and the destruction is the evidence).
    fn check_landed(&mut self, dev: u32, qp: u32, wr_id: u64) {
        let Some(i) = self.landed.iter().position(|&(d, q, w, _)| (d, q, w) == (dev, qp, wr_id)) else {
            return;
        };
        let (_, _, _, local) = self.landed.swap_remove(i);
        if self.devs[dev as usize].qp(qp).is_none() || !self.held_in(dev, &local) {
            return;
        }
        let detail = format!(
            "READ wr_id {wr_id}: its destination was lent to a buffer handle after its response landed and \
             before its completion showed (a retransmitted response may land until then)"
        );
        self.hazard(dev, HazardKind::DmaIntoHeldBuffer, detail);
    }

    /// The late bytes of a READ that failed after its request went out
    /// (`World::retire`), written into its destination just before its
    /// completion shows: unless its QP is destroyed (its completions are
    /// then dropped, and the destruction is the evidence).
    fn land_late(&mut self, dev: u32, qp: u32, wr_id: u64, local: &crate::backend::SgeList) {
        let d = &mut self.devs[dev as usize];
        if d.qp(qp).is_none() {
            return;
        }
        let mut hazard = None;
        for s in local.iter() {
            let Some(mr) = d.mr_mut(s.mr.0) else {
                hazard = Some((
                    HazardKind::DmaIntoFreedMemory,
                    format!("failed READ wr_id {wr_id} landed late in deregistered region {}", s.mr.0),
                ));
                continue;
            };
            let late = vec![LATE_BYTE; s.len as usize];
            if mr.data.dma_write(s.offset, &late).unwrap_or(false) {
                hazard = Some((
                    HazardKind::DmaIntoHeldBuffer,
                    format!(
                        "failed READ wr_id {wr_id} landed late in region {} bytes {}..{}, some lent to a buffer handle \
                         before its completion",
                        s.mr.0,
                        s.offset,
                        s.offset + s.len as usize,
                    ),
                ));
            }
        }
        if let Some((kind, detail)) = hazard {
            self.hazard(dev, kind, detail);
        }
    }

    fn on_deliver(&mut self, dev: u32, qp: u32, cq: u32, wc: crate::backend::Completion) {
        let d = &mut self.devs[dev as usize];
        // A destroyed QP's completions still on their way are dropped.
        let Some(q) = d.qp_mut(qp) else { return };
        {
            let c = &mut q.counters;
            c.completions += 1;
            match wc.status {
                WcStatus::Success => {}
                WcStatus::WrFlushErr => c.flushed += 1,
                _ => c.error_completions += 1,
            }
        }
        let Some(Some(c)) = d.cqs.get_mut(cq as usize) else { return };
        c.entries.push_back(wc);
        if let Some(waker) = c.waker.take() {
            waker.wake();
        }
        self.log(|| {
            format!(
                "dev{dev} cq{cq} <- wr_id {} {:?} {:?} len {} qpn {:#x} inv {:?}",
                wc.wr_id, wc.opcode, wc.status, wc.byte_len, wc.qpn, wc.invalidated_rkey
            )
        });
    }

    fn on_issue(&mut self, dev: u32, qp: u32) {
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        q.issue_scheduled = false;
        if q.state != QpState::Rts {
            return;
        }
        let Some(i) = q.sq.iter().position(|e| e.st == WrState::Pending) else { return };
        let wr = q.sq[i].wr;
        let qpn = q.qpn;
        self.log(|| format!("dev{dev} qpn {qpn:#x} executes {wr:?}"));
        match &wr {
            SendWr::BindMw { mw, rkey, mr, offset, len, access, .. } => {
                match self.bind(dev, qp, mw.0, *rkey, mr.0, *offset, *len, *access) {
                    Ok(()) => self.done(dev, qp, i, 0),
                    Err(why) => {
                        self.log(|| format!("dev{dev} qpn {qpn:#x} bind error: {why}"));
                        self.enter_error(dev, qp, Some((i, WcStatus::MwBindErr)));
                    }
                }
            }
            SendWr::LocalInv { rkey, .. } => {
                let pd = self.devs[dev as usize].qp(qp).map_or(0, |q| q.pd);
                match self.invalidate(dev, pd, *rkey, None) {
                    Ok(to_err) => {
                        self.done(dev, qp, i, 0);
                        self.error_all(to_err);
                    }
                    Err(e) => {
                        // Another PD's window: the spec does not find it, but
                        // rxe would invalidate it (its owner's own LOCAL_INV
                        // then panics) or panic now (not bound): a LOCAL_INV
                        // the library posted on the wrong connection's QP.
                        if e.would_crash_rxe() || e == InvError::OtherPd {
                            let detail = format!("LOCAL_INV of rkey {rkey:#x} on qpn {qpn:#x}: {e:?}");
                            self.hazard(dev, HazardKind::WouldCrashRxe, detail);
                        }
                        self.enter_error(dev, qp, Some((i, WcStatus::LocQpOpErr)));
                    }
                }
            }
            SendWr::Send { sge, .. } | SendWr::SendWithInv { sge, .. } => match self.gather(dev, qp, sge) {
                Some(payload) => {
                    self.start(dev, qp, i, Some(payload));
                    self.transmit(dev, qp, i);
                }
                None => self.enter_error(dev, qp, Some((i, WcStatus::LocProtErr))),
            },
            SendWr::Read { local, .. } => {
                if self.local_writable(dev, qp, local) {
                    self.start(dev, qp, i, None);
                    self.transmit(dev, qp, i);
                } else {
                    self.enter_error(dev, qp, Some((i, WcStatus::LocProtErr)));
                }
            }
        }
        self.retire(dev, qp);
        self.schedule_issue(dev, qp);
    }

    fn done(&mut self, dev: u32, qp: u32, i: usize, byte_len: u32) {
        if let Some(e) = self.devs[dev as usize].qp_mut(qp).and_then(|q| q.sq.get_mut(i)) {
            e.st = WrState::Done { status: WcStatus::Success, byte_len };
        }
    }

    pub(crate) fn error_all(&mut self, qps: Vec<(u32, u32)>) {
        for (d, q) in qps {
            self.enter_error(d, q, None);
        }
    }

    fn start(&mut self, dev: u32, qp: u32, i: usize, payload: Option<Vec<u8>>) {
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        let psn = q.next_psn;
        q.next_psn += 1;
        let e = &mut q.sq[i];
        e.psn = Some(psn);
        e.payload = payload;
        e.st = WrState::Issued;
    }

    /// The bytes of a SEND, read by the NIC when it executes the request.
    pub(crate) fn gather(&mut self, dev: u32, qp: u32, sges: &[crate::backend::Sge]) -> Option<Vec<u8>> {
        let len: usize = sges.iter().map(|s| s.len as usize).sum();
        let mut out = self.spare.take(len);
        let d = &self.devs[dev as usize];
        let pd = d.qp(qp)?.pd;
        for s in sges {
            let mr = d.mr(s.mr.0).filter(|m| m.pd == pd)?;
            // A held byte reads as POISON (the oracle reports a SEND from
            // held memory nowhere: the protocol sends only from its slots).
            mr.data.dma_read(s.offset, s.len as usize, &mut out).ok()?;
        }
        Some(out)
    }

    fn local_writable(&self, dev: u32, qp: u32, sges: &[crate::backend::Sge]) -> bool {
        let d = &self.devs[dev as usize];
        let Some(pd) = d.qp(qp).map(|q| q.pd) else { return false };
        sges.iter().all(|s| {
            d.mr(s.mr.0).is_some_and(|m| {
                m.pd == pd
                    && m.access.contains(Access::LOCAL_WRITE)
                    && s.offset.checked_add(s.len as usize).is_some_and(|end| end <= m.data.len())
            })
        })
    }

    /// Send (or resend) the request of send-queue entry `i`.
    pub(crate) fn transmit(&mut self, dev: u32, qp: u32, i: usize) {
        let read_lat = self.cfg.latency.read_responder.as_nanos() as u64;
        let Some(q) = self.devs[dev as usize].qp(qp) else { return };
        let e = &q.sq[i];
        let (Some(psn), Some((gid, rqpn))) = (e.psn, q.remote) else { return };
        let (pkt, bytes, extra) = match &e.wr {
            SendWr::Send { .. } => {
                let bytes = e.payload.as_deref().unwrap_or_default();
                let mut payload = self.spare.take(bytes.len());
                payload.extend_from_slice(bytes);
                let n = payload.len() as u64;
                (Packet::Send { payload, invalidate: None }, n, 0)
            }
            SendWr::SendWithInv { invalidate_rkey, .. } => {
                let bytes = e.payload.as_deref().unwrap_or_default();
                let mut payload = self.spare.take(bytes.len());
                payload.extend_from_slice(bytes);
                let n = payload.len() as u64;
                (Packet::Send { payload, invalidate: Some(*invalidate_rkey) }, n, 0)
            }
            SendWr::Read { local, remote_addr, rkey, .. } => {
                let len = local.iter().map(|s| s.len as u64).sum();
                (Packet::Read { addr: *remote_addr, len, rkey: *rkey }, 0, read_lat)
            }
            _ => return,
        };
        self.arm_timer(dev, qp);
        let dst = self.dev_by_gid(&gid);
        let dst = dst.filter(|&d| self.path_up(dev, d));
        let target = dst.and_then(|d| self.devs[d as usize].qp_by_qpn(rqpn).map(|q| (d, q)));
        match target {
            Some((dst, dqp)) => {
                let at = self.now + self.wire_time(dev, dst, bytes) + extra;
                let kind = EvKind::Request { dev: dst, qp: dqp, src_dev: dev, src_qp: qp, psn, pkt };
                self.sched.push(Lane::Resp(dst, dqp), at, kind);
            }
            None => self.log(|| format!("dev{dev} psn {psn} to qpn {rqpn:#x} lost (no path)")),
        }
    }

    fn arm_timer(&mut self, dev: u32, qp: u32) {
        let at = self.now + self.cfg.faults.ack_timeout.as_nanos() as u64;
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        if q.timer_armed || !q.sq.iter().any(|e| e.st == WrState::Issued && !e.hung) {
            return;
        }
        q.timer_gen += 1;
        q.timer_armed = true;
        let gen = q.timer_gen;
        let lane = self.sched.push_free(at, EvKind::AckTimer { dev, qp, gen });
        if let Some(q) = self.devs[dev as usize].qp_mut(qp) {
            q.timer_lane = Some(lane);
        }
    }

    fn disarm_timer(&mut self, dev: u32, qp: u32) {
        if let Some(q) = self.devs[dev as usize].qp_mut(qp) {
            q.timer_gen += 1;
            q.timer_armed = false;
            if let Some(lane) = q.timer_lane.take() {
                self.sched.cancel(lane);
            }
        }
    }

    fn outstanding(&self, dev: u32, qp: u32, from_psn: u64) -> Vec<usize> {
        let Some(q) = self.devs[dev as usize].qp(qp) else { return Vec::new() };
        (0..q.sq.len())
            .filter(|&i| {
                let e = &q.sq[i];
                e.st == WrState::Issued && !e.hung && e.psn.is_some_and(|p| p >= from_psn)
            })
            .collect()
    }

    fn on_ack_timer(&mut self, dev: u32, qp: u32, gen: u64) {
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        if q.state != QpState::Rts || !q.timer_armed || q.timer_gen != gen {
            return;
        }
        q.timer_armed = false;
        q.timer_lane = None;
        let out = self.outstanding(dev, qp, 0);
        let Some(&first) = out.first() else { return };
        let q = self.devs[dev as usize].qp_mut(qp).expect("checked above");
        if q.retries_left == 0 {
            let qpn = q.qpn;
            self.log(|| format!("dev{dev} qpn {qpn:#x} transport retries exhausted"));
            self.enter_error(dev, qp, Some((first, WcStatus::RetryExcErr)));
            return;
        }
        q.retries_left -= 1;
        q.counters.retransmits += 1;
        for i in out {
            self.transmit(dev, qp, i);
        }
    }

    fn on_rnr_resend(&mut self, dev: u32, qp: u32, psn: u64) {
        let Some(q) = self.devs[dev as usize].qp(qp) else { return };
        if q.state != QpState::Rts {
            return;
        }
        for i in self.outstanding(dev, qp, psn) {
            self.transmit(dev, qp, i);
        }
    }

    fn on_response(&mut self, dev: u32, qp: u32, src_dev: u32, psn: u64, resp: Resp) {
        if !self.path_up(src_dev, dev) {
            self.log(|| format!("dev{dev} response psn {psn} from dev{src_dev} lost"));
            return;
        }
        let (retry, rnr) = (self.cfg.faults.retry_cnt, self.cfg.faults.rnr_retry);
        let Some(q) = self.devs[dev as usize].qp_mut(qp) else { return };
        if q.state != QpState::Rts {
            return;
        }
        let Some(i) = q.sq.iter().position(|e| e.psn == Some(psn) && e.st == WrState::Issued) else {
            return;
        };
        if q.sq[i].hung {
            return;
        }
        // An earlier READ still waiting for data: this response is out of order; go-back-N resends.
        let earlier = q.sq.iter().take(i);
        if earlier.clone().any(|e| e.st == WrState::Issued && matches!(e.wr, SendWr::Read { .. })) {
            return;
        }
        // A response acknowledges every earlier SEND.
        for e in q.sq.iter_mut().take(i) {
            if e.st == WrState::Issued {
                let n = e.payload.as_ref().map_or(0, Vec::len) as u32;
                e.st = WrState::Done { status: WcStatus::Success, byte_len: n };
            }
        }
        match resp {
            Resp::Ack => {
                let n = q.sq[i].payload.as_ref().map_or(0, Vec::len) as u32;
                q.sq[i].st = WrState::Done { status: WcStatus::Success, byte_len: n };
            }
            Resp::ReadData(mut data) => {
                // Taken for the look, put back for the oracle.
                if let Some(mut s) = q.sq[i].served.take() {
                    self.late_tail(&mut s, &mut data);
                    if let Some(q) = self.devs[dev as usize].qp_mut(qp) {
                        q.sq[i].served = Some(s);
                    }
                }
                if let Err(detail) = self.scatter(dev, qp, i, &data) {
                    self.hazard(dev, HazardKind::DmaIntoFreedMemory, detail);
                    self.enter_error(dev, qp, Some((i, WcStatus::LocProtErr)));
                    return;
                }
                let q = self.devs[dev as usize].qp_mut(qp).expect("checked above");
                q.counters.bytes_read += data.len() as u64;
                q.sq[i].st = WrState::Done { status: WcStatus::Success, byte_len: data.len() as u32 };
                self.spare.put(data);
            }
            Resp::RnrNak => {
                q.counters.rnr_naks += 1;
                if q.rnr_left == 0 {
                    self.enter_error(dev, qp, Some((i, WcStatus::RnrRetryExcErr)));
                    return;
                }
                if q.rnr_left != super::world::RNR_FOREVER {
                    q.rnr_left -= 1;
                }
                self.disarm_timer(dev, qp);
                let at = self.now + self.cfg.faults.rnr_timer.as_nanos() as u64;
                self.sched.push_free(at, EvKind::RnrResend { dev, qp, psn });
                self.retire(dev, qp);
                return;
            }
            Resp::Nak(status) => {
                self.enter_error(dev, qp, Some((i, status)));
                return;
            }
        }
        let q = self.devs[dev as usize].qp_mut(qp).expect("checked above");
        q.retries_left = retry;
        q.rnr_left = super::world::rnr_budget(&q.cfg, rnr);
        self.disarm_timer(dev, qp);
        self.arm_timer(dev, qp);
        self.retire(dev, qp);
    }

    /// Write a READ's data into its destination. Errs if a destination
    /// region was deregistered meanwhile (on a real NIC: a DMA into freed memory).
    fn scatter(&mut self, dev: u32, qp: u32, i: usize, data: &[u8]) -> Result<(), String> {
        let d = &mut self.devs[dev as usize];
        let Some(q) = d.qp(qp) else { return Ok(()) };
        let SendWr::Read { local, wr_id, .. } = q.sq[i].wr else { return Ok(()) };
        let mut at = 0;
        let mut held = None;
        for s in &local {
            let n = s.len as usize;
            let Some(mr) = d.mr_mut(s.mr.0) else {
                return Err(format!("READ wr_id {wr_id} landed in deregistered region {}", s.mr.0));
            };
            // Held bytes are skipped (reported just below).
            if mr.data.dma_write(s.offset, &data[at..at + n]).unwrap_or(false) {
                held = Some(format!(
                    "READ wr_id {wr_id} landed in region {} bytes {}..{}, some lent to a buffer handle",
                    s.mr.0,
                    s.offset,
                    s.offset + n,
                ));
            }
            at += n;
        }
        if let Some(detail) = held {
            self.hazard(dev, HazardKind::DmaIntoHeldBuffer, detail);
        }
        Ok(())
    }
}
