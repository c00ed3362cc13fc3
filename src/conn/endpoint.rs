//! The endpoint: engines, slots and the NIC, wired together.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::frame::{Attach, EngineTag, Frame, MAX_FRAME};
use super::pool::{Holder, Slots};
use super::types::*;
use crate::backend::{
    Access, Completion, CpuHold, CqId, MrInfo, MwId, Nic, NicError, QpConfig, QpEndpoint, SendWr, Sge, SgeList, WcStatus,
};

mod calls;
mod recv;

/// Tags in the top byte of the work request ids the endpoint itself makes.
/// (`mwcap-mw` tokens use 0xa1..=0xb1.)
const TAG_SEND: u8 = 0xc1;
const TAG_RECV: u8 = 0xc2;
const TAG_FB_CLIENT: u8 = 0xd1;
const TAG_FB_SERVER: u8 = 0xd2;
const LOW56: u64 = (1 << 56) - 1;

fn wr(tag: u8, low: u64) -> u64 {
    (u64::from(tag) << 56) | (low & LOW56)
}

fn tag_of(wr_id: u64) -> u8 {
    (wr_id >> 56) as u8
}

/// Completions taken per `poll_cq` call (an array on the stack).
const POLL_BATCH: usize = 32;

static NEXT_ENDPOINT: AtomicU64 = AtomicU64::new(1);

/// A client call in progress.
#[derive(Debug)]
struct Call {
    deadline: Duration,
    /// Request payload exposure, to cancel on timeout.
    req_lease: Option<mw::LeaseId>,
    req_fb: Option<fb::MsgId>,
    /// Confirm-policy fetch of the reply data.
    fetch_fb: Option<fb::MsgId>,
    reply: Option<(u8, Header)>,
    data: Data,
}

/// Where a payload stands.
#[derive(Debug, PartialEq, Eq)]
enum Data {
    /// Not known yet (no reply frame).
    Unknown,
    /// None was sent.
    Absent,
    /// Being read.
    Reading,
    /// Read and verified into a pool slot.
    Ready(u32, u32),
    /// Could not be read.
    Failed(String),
}

/// A server request in progress.
#[derive(Debug)]
struct Request {
    header: Header,
    data: Data,
    /// The release of the request payload, to piggyback on the reply.
    release: Option<mw::Release>,
    fetch_fb: Option<fb::MsgId>,
    surfaced: bool,
}

/// One side of one RC connection running mwcap's protocols. See the
/// [module docs](super) for the call order.
pub struct Endpoint<N: Nic> {
    nic: N,
    id: u64,
    cfg: Config,
    cq: CqId,
    local: QpEndpoint,
    ctrl: MrInfo,
    sends: Slots,
    /// Work request ids of in-flight SENDs made by the mw owner (grant SENDs) → send slot.
    grant_sends: HashMap<u64, u32>,
    data: MrInfo,
    bufs: Slots,
    /// Where `drive` polls completions into (POLL_BATCH entries).
    batch: Vec<Completion>,
    /// Where a received frame is copied to be decoded (capacity MAX_FRAME).
    scratch: Vec<u8>,
    /// Scratch for `flush_holds`.
    hold_changes: Vec<(u32, bool)>,
    /// Handles dropped by the user, to take back.
    returns: std::sync::Arc<Returns>,
    reclaimed: Vec<(u32, u32)>,
    windows: Vec<MwId>,
    owner: Option<mw::Owner>,
    reader: Option<mw::Reader>,
    fbc: Option<fb::Client>,
    fbs: Option<fb::Server>,
    fb_bufs: Vec<fb::BufferId>,
    fb_slot: HashMap<fb::BufferId, u32>,
    /// mw owner lease → data slot.
    owner_leases: HashMap<mw::LeaseId, u32>,
    /// mw reader lease → message id.
    reader_leases: HashMap<mw::LeaseId, u64>,
    /// fallback message id → our message id.
    fb_msgs: HashMap<fb::MsgId, u64>,
    /// Server: confirm messages whose offer expired, with when (their
    /// `fb_msgs` entries go once the client can no longer retry).
    fb_expired: VecDeque<(fb::MsgId, Duration)>,
    /// fallback READ token → destination slot.
    fb_reads: HashMap<u64, u32>,
    /// Grants waiting for a free destination: (msg, grant, received at).
    pending_grants: VecDeque<(u64, mw::Grant, Duration)>,
    /// Fallback READs waiting for a free destination: (client side?, request).
    pending_fb_reads: VecDeque<(bool, fb::ReadRequest)>,
    next_msg: u64,
    last_request: u64,
    calls: BTreeMap<u64, Call>,
    requests: BTreeMap<u64, Request>,
    events: VecDeque<Event>,
    down: Option<LossReason>,
    destroyed: bool,
}

impl<N: Nic> Endpoint<N> {
    /// Create the endpoint's resources on `nic` (which should be a protection
    /// domain of its own: see the confirm policy's security note). Returns
    /// it with its QP in INIT; give [`Endpoint::local`] to the peer and call
    /// [`Endpoint::connect`] with the peer's.
    pub fn new(nic: N, cfg: Config) -> Result<Endpoint<N>, NicError> {
        let policies = cfg.policies;
        Endpoint::prepare(nic, cfg)?.finish(policies)
    }

    /// The first half of [`Endpoint::new`], for when the policies are only
    /// known after the bootstrap exchange (which needs the QP number): the
    /// completion queue and the QP. `cfg.policies` is ignored.
    pub fn prepare(nic: N, cfg: Config) -> Result<Prepared<N>, NicError> {
        let depth = cfg.ctrl_slots * 2 + cfg.buffers * 3 + 8;
        let cq = nic.create_cq(depth)?;
        let mut qcfg = QpConfig::new(cq, cq);
        qcfg.max_send_wr = cfg.ctrl_slots + cfg.buffers * 3 + 8;
        qcfg.max_recv_wr = cfg.ctrl_slots;
        qcfg.rnr_retry = cfg.rnr_retry.min(6);
        let local = match nic.create_qp(qcfg) {
            Ok(l) => l,
            Err(e) => {
                let _ = nic.destroy_cq(cq);
                return Err(e);
            }
        };
        Ok(Prepared { nic: Some(nic), cfg, cq, local })
    }
    /// What the peer needs to connect to this endpoint.
    pub fn local(&self) -> QpEndpoint {
        self.local
    }

    /// The NIC handle (for tests and the oracle).
    pub fn nic(&self) -> &N {
        &self.nic
    }

    /// The data region (for tests and the oracle).
    pub fn data_region(&self) -> MrInfo {
        self.data
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The completion queue (for a driver waiting on its readiness).
    pub fn cq(&self) -> CqId {
        self.cq
    }

    /// Whether `buf` is one of this endpoint's buffers.
    pub fn owns(&self, buf: &Buf) -> bool {
        buf.endpoint == self.id
    }

    /// Confirm-policy messages the endpoint is tracking (diagnostics: stays
    /// bounded by the calls and requests in progress).
    pub fn tracked_messages(&self) -> usize {
        self.fb_msgs.len()
    }

    /// Connect to the peer's endpoint (QP to RTS) and post the receive buffers.
    pub fn connect(&mut self, peer: &QpEndpoint) -> Result<(), NicError> {
        self.nic.connect_qp(self.local.id, peer)?;
        for slot in 0..self.cfg.ctrl_slots {
            self.post_recv(slot)?;
        }
        Ok(())
    }

    /// Why the connection is down, if it is.
    pub fn is_down(&self) -> Option<&LossReason> {
        self.down.as_ref()
    }

    fn recv_offset(&self, slot: u32) -> usize {
        (self.cfg.ctrl_slots as usize + slot as usize) * MAX_FRAME
    }

    fn post_recv(&mut self, slot: u32) -> Result<(), NicError> {
        let sge = Sge { mr: self.ctrl.id, offset: self.recv_offset(slot), len: MAX_FRAME as u32 };
        self.nic.post_recv(self.local.id, wr(TAG_RECV, u64::from(slot)), sge)
    }

    fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * u64::from(self.cfg.buffer_size)
    }

    fn mw_buffer(&self, slot: u32, len: u32) -> mw::Buffer {
        let offset = self.slot_offset(slot);
        mw::Buffer { mr: self.data.id.raw(), offset, len, addr: self.data.addr + offset }
    }

    fn slot_of_mw(&self, b: &mw::Buffer) -> Option<u32> {
        if b.mr != self.data.id.raw() {
            return None;
        }
        Some((b.offset / u64::from(self.cfg.buffer_size)) as u32)
    }

    /// A handle for a slot the user now holds (its current lending).
    fn buf(&self, slot: u32, len: u32) -> Buf {
        debug_assert_eq!(self.bufs.holder(slot), Some(Holder::User));
        Buf { endpoint: self.id, slot, len, lending: self.bufs.lending(slot), home: Some(self.returns.clone()) }
    }

    /// Take back the buffers whose handles were dropped; returns how many.
    pub(crate) fn reclaim(&mut self) -> usize {
        self.returns.take_all(&mut self.reclaimed);
        let mut n = 0;
        for (slot, lending) in self.reclaimed.drain(..) {
            n += usize::from(self.bufs.give_back(slot, lending));
        }
        if n > 0 {
            self.flush_holds();
        }
        n
    }

    /// Wake `w` when a buffer handle is dropped (the async driver).
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn wake_on_return(&self, w: &std::task::Waker) {
        self.returns.set_waker(w);
    }

    /// Tell the NIC which data buffers the user now holds (a testing aid:
    /// the simulator reports a DMA into one, or under mw a remote READ of
    /// one, as a hazard; real NICs ignore it). Called before the NIC can
    /// act again: before each poll and at the end of every operation.
    fn flush_holds(&mut self) {
        self.bufs.take_changes(&mut self.hold_changes);
        if self.hold_changes.is_empty() {
            return;
        }
        let owns = if self.cfg.role == Role::Client { self.cfg.policies.request } else { self.cfg.policies.reply };
        let remote_reads_allowed = owns == Policy::Confirm;
        let len = self.cfg.buffer_size as usize;
        for &(slot, held) in &self.hold_changes {
            let hold = if held { CpuHold::Held { remote_reads_allowed } } else { CpuHold::Released };
            self.nic.set_cpu_held(self.data.id, self.slot_offset(slot) as usize, len, hold);
        }
    }

    // ---- the user's buffers ----

    /// Take a free buffer from the pool, or `None` when all are in use.
    pub fn alloc(&mut self) -> Option<Buf> {
        self.reclaim();
        let slot = self.bufs.take(Holder::User)?;
        self.flush_holds();
        Some(self.buf(slot, 0))
    }

    /// Put a buffer back in the pool (dropping it does the same, a little later).
    pub fn free(&mut self, buf: Buf) {
        if buf.endpoint == self.id {
            let (slot, lending) = (buf.slot, buf.lending);
            buf.disarm();
            self.bufs.give_back(slot, lending);
            self.flush_holds();
        }
    }

    /// Whether `buf` is one of this endpoint's buffers, held by the user.
    fn check_buf(&self, buf: &Buf) -> Result<(), UseError> {
        if buf.endpoint != self.id || !self.bufs.lent(buf.slot, buf.lending) {
            return Err(UseError::ForeignBuffer(buf.slot));
        }
        Ok(())
    }

    /// Lend the bytes of `buf` (its `len()` valid bytes) to `f`, without a
    /// copy, and return what `f` returns.
    pub fn bytes<R>(&self, buf: &Buf, f: impl FnOnce(&[u8]) -> R) -> Result<R, UseError> {
        self.check_buf(buf)?;
        let mut f = Some(f);
        let mut out = None;
        self.nic.with_mr(self.data.id, self.slot_offset(buf.slot) as usize, buf.len as usize, &mut |b| {
            out = f.take().map(|f| f(b));
        })?;
        Ok(out.expect("with_mr calls the closure once on success"))
    }

    /// Lend the whole of `buf` (its capacity, [`Config::buffer_size`]) to `f`
    /// to write a payload in place, without a copy; `f` returns how many
    /// bytes it wrote, which become the buffer's `len()`.
    pub fn fill(&mut self, buf: &mut Buf, f: impl FnOnce(&mut [u8]) -> usize) -> Result<(), UseError> {
        self.check_buf(buf)?;
        let cap = self.cfg.buffer_size;
        let mut f = Some(f);
        let mut wrote = 0;
        self.nic.with_mr_mut(self.data.id, self.slot_offset(buf.slot) as usize, cap as usize, &mut |b| {
            wrote = f.take().map_or(0, |f| f(b));
        })?;
        if wrote > cap as usize {
            return Err(UseError::TooLong { len: wrote, cap });
        }
        buf.len = wrote as u32;
        Ok(())
    }

    /// Fill `buf` with a copy of `bytes` (its length becomes `bytes.len()`);
    /// [`Endpoint::fill`] writes in place instead.
    pub fn write(&mut self, buf: &mut Buf, bytes: &[u8]) -> Result<(), UseError> {
        if bytes.len() > self.cfg.buffer_size as usize {
            self.check_buf(buf)?;
            return Err(UseError::TooLong { len: bytes.len(), cap: self.cfg.buffer_size });
        }
        self.fill(buf, |b| {
            b[..bytes.len()].copy_from_slice(bytes);
            bytes.len()
        })
    }

    /// A copy of the bytes in `buf`; [`Endpoint::bytes`] lends them instead.
    pub fn read(&self, buf: &Buf) -> Result<Vec<u8>, UseError> {
        self.bytes(buf, <[u8]>::to_vec)
    }

    /// Buffers currently exposed to the peer or being read into (for tests).
    pub fn busy_buffers(&self) -> usize {
        self.bufs.count(Holder::Exposed) + self.bufs.count(Holder::Reading)
    }

    /// Buffers free in the pool (dropped handles included).
    pub fn free_buffers(&mut self) -> usize {
        self.reclaim();
        self.bufs.count(Holder::Free)
    }

    /// Byte ranges of the data region that are exposed to the peer or being
    /// read into: every other byte must be unreachable by the peer (mw policy).
    pub fn busy_ranges(&self) -> Vec<std::ops::Range<usize>> {
        (0..self.cfg.buffers)
            .filter(|s| matches!(self.bufs.holder(*s), Some(Holder::Exposed | Holder::Reading)))
            .map(|s| {
                let o = self.slot_offset(s) as usize;
                o..o + self.cfg.buffer_size as usize
            })
            .collect()
    }

    // ---- events and time ----

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Endpoint::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let engines = [
            self.owner.as_ref().and_then(|e| e.poll_timeout()),
            self.reader.as_ref().and_then(|e| e.poll_timeout()),
            self.fbc.as_ref().and_then(|e| e.poll_timeout()),
            self.fbs.as_ref().and_then(|e| e.poll_timeout()),
        ];
        // Every call gets the same timeout as it starts and message ids grow
        // with time, so the oldest call has the earliest deadline.
        let calls = self.calls.values().next().map(|c| c.deadline);
        engines.into_iter().flatten().chain(calls).min()
    }

    /// Time has reached `now`: fire the engines' timers and call deadlines.
    pub fn handle_timeout(&mut self, now: Duration) {
        if let Some(e) = &mut self.owner {
            if e.poll_timeout().is_some_and(|t| t <= now) {
                e.handle_timeout(now);
            }
        }
        if let Some(e) = &mut self.reader {
            if e.poll_timeout().is_some_and(|t| t <= now) {
                e.handle_timeout(now);
            }
        }
        if let Some(e) = &mut self.fbc {
            if e.poll_timeout().is_some_and(|t| t <= now) {
                e.handle_timeout(now);
            }
        }
        if let Some(e) = &mut self.fbs {
            if e.poll_timeout().is_some_and(|t| t <= now) {
                e.handle_timeout(now);
            }
        }
        // Oldest first: deadlines grow with message ids (see poll_timeout).
        while let Some((&msg, _)) = self.calls.iter().next().filter(|(_, c)| c.deadline <= now) {
            self.abandon_call(now, msg, CallError::TimedOut);
        }
        self.pump(now);
    }

    /// Poll the completion queue, feed every completion and message to the
    /// engines, and carry out what they ask for.
    pub fn drive(&mut self, now: Duration) {
        self.reclaim();
        // Polled into an array kept for the connection's life.
        let mut batch = std::mem::take(&mut self.batch);
        loop {
            self.flush_holds();
            let n = match self.nic.poll_cq(self.cq, &mut batch) {
                Ok(n) => n,
                Err(e) => {
                    self.go_down(now, LossReason::Nic(e));
                    break;
                }
            };
            if n == 0 {
                break;
            }
            for c in &batch[..n] {
                self.on_completion(now, *c);
            }
            self.pump(now);
        }
        self.batch = batch;
        self.pump(now);
    }

    fn status(c: &Completion) -> mw::Status {
        match c.status {
            WcStatus::Success => mw::Status::Success,
            WcStatus::WrFlushErr => mw::Status::Flushed,
            WcStatus::RemAccessErr => mw::Status::RemoteAccess,
            other => mw::Status::Failed(match other {
                WcStatus::Other(n) => n,
                _ => 0xffff,
            }),
        }
    }

    fn on_completion(&mut self, now: Duration, c: Completion) {
        if !c.status.is_success() && self.down.is_none() {
            // Any error, a flush included: the QP is in ERR. A flushed receive
            // may be the first sign (the peer's bad READ took both QPs down
            // while we had nothing of our own outstanding).
            self.go_down(now, LossReason::Completion(format!("{:?} {:?} (wr_id {:#x})", c.opcode, c.status, c.wr_id)));
        }
        let status = Self::status(&c);
        let low = c.wr_id & LOW56;
        match tag_of(c.wr_id) {
            TAG_SEND => {
                self.sends.hand(low as u32, Holder::Exposed, Holder::Free);
            }
            TAG_RECV => {
                if c.status.is_success() {
                    self.on_recv(now, low as u32, c.byte_len, c.invalidated_rkey);
                    if self.down.is_none() {
                        if let Err(e) = self.post_recv(low as u32) {
                            self.go_down(now, LossReason::Nic(e));
                        }
                    }
                }
            }
            TAG_FB_CLIENT | TAG_FB_SERVER => {
                let token = fb::ReadToken::from_raw(low);
                let engine_done = if tag_of(c.wr_id) == TAG_FB_CLIENT {
                    self.fbc.as_mut().map(|e| e.handle_read_completion(now, token, c.status.is_success()))
                } else {
                    self.fbs.as_mut().map(|e| e.handle_read_completion(now, token, c.status.is_success()))
                };
                if engine_done.is_none() {
                    tracing::warn!(wr_id = c.wr_id, "confirm READ completion with no confirm engine");
                }
            }
            _ => {
                let token = mw::Token::from_wr_id(c.wr_id);
                match token.engine() {
                    Some(mw::Engine::Owner) => {
                        if let Some(slot) = self.grant_sends.remove(&c.wr_id) {
                            self.sends.hand(slot, Holder::Exposed, Holder::Free);
                        }
                        if let Some(o) = &mut self.owner {
                            o.handle_completion(now, token, status);
                        }
                    }
                    Some(mw::Engine::Reader) => {
                        if let Some(r) = &mut self.reader {
                            r.handle_completion(now, token, status);
                        }
                    }
                    None => tracing::warn!(wr_id = c.wr_id, "completion with an unknown work request id"),
                }
            }
        }
    }

    /// The connection is down: QP to ERR (every work request flushes), the
    /// engines told, calls failed. Buffers come back as the flushes arrive.
    fn go_down(&mut self, now: Duration, reason: LossReason) {
        if self.down.is_some() {
            return;
        }
        tracing::info!(%reason, "connection down");
        self.down = Some(reason.clone());
        let _ = self.nic.set_qp_error(self.local.id);
        if let Some(o) = &mut self.owner {
            o.handle_qp_error(now);
        }
        if let Some(r) = &mut self.reader {
            r.handle_qp_error(now);
        }
        if let Some(c) = &mut self.fbc {
            c.handle_connection_lost(now);
        }
        if let Some(s) = &mut self.fbs {
            s.handle_connection_lost(now);
        }
        for (msg, _) in std::mem::take(&mut self.calls) {
            self.events.push_back(Event::CallFailed {
                call: CallId(msg),
                error: CallError::ConnectionLost(reason.clone()),
            });
        }
        for (msg, r) in std::mem::take(&mut self.requests) {
            if !r.surfaced {
                self.events.push_back(Event::RequestDropped {
                    req: RequestId(msg),
                    error: CallError::ConnectionLost(reason.clone()),
                });
            }
        }
        self.events.push_back(Event::ConnectionLost(reason));
    }

    /// Start closing: the QP goes to ERR (no remote access through it is
    /// possible any more), every call fails, and the flushes start arriving.
    /// [`Endpoint::drive`] reaps them; [`Endpoint::finish_close`] then
    /// destroys the QP. Never blocks.
    pub fn begin_close(&mut self, now: Duration) {
        self.go_down(now, LossReason::Closed);
    }

    /// Send-queue work requests whose completions have not been reaped.
    pub fn sends_in_flight(&self) -> usize {
        self.sends.count(Holder::Exposed)
    }

    /// Close the connection: QP to ERR, reap the flushes, destroy the QP
    /// (after which no DMA of it is possible) and return every buffer.
    ///
    /// This waits (a bounded number of polls) for the flushes; a driver that
    /// must not block calls [`Endpoint::begin_close`], drives until
    /// [`Endpoint::sends_in_flight`] and [`Endpoint::busy_buffers`] are 0,
    /// then [`Endpoint::finish_close`].
    pub fn close(&mut self, now: Duration) {
        self.begin_close(now);
        self.drive(now);
        if self.destroyed {
            return;
        }
        // Reap the flushes before destroying the QP (rxe warns, and waits,
        // when a QP is destroyed while its flushes are still being
        // generated). Bounded: a backend whose clock does not move (the sim
        // in manual mode) simply falls through to the destroy, which is
        // evidence enough.
        for _ in 0..2000 {
            if self.sends.count(Holder::Exposed) == 0 && self.busy_buffers() == 0 {
                break;
            }
            std::thread::yield_now();
            self.drive(now);
        }
        self.finish_close(now);
    }

    /// Destroy the QP of a connection that is down, and return every buffer
    /// (nothing can reach or fill one after the destroy). Idempotent.
    pub fn finish_close(&mut self, now: Duration) {
        self.go_down(now, LossReason::Closed);
        if self.destroyed {
            return;
        }
        // The QP is in ERR: no remote access through it is possible. Free the
        // windows first (freeing a bound window invalidates it without an
        // invalidation work request); rxe stalls ~50 s destroying a QP that
        // still has valid windows bound to it.
        for w in self.windows.drain(..) {
            let _ = self.nic.dealloc_mw(w);
        }
        if let Err(e) = self.nic.destroy_qp(self.local.id) {
            tracing::warn!(%e, "destroy QP");
        }
        self.destroyed = true;
        if let Some(o) = &mut self.owner {
            o.handle_qp_destroyed(now);
        }
        if let Some(r) = &mut self.reader {
            r.handle_qp_destroyed(now);
        }
        self.pump(now);
        // The QP is gone: nothing can reach or fill any buffer any more.
        for slot in 0..self.cfg.buffers {
            match self.bufs.holder(slot) {
                Some(Holder::Exposed) => {
                    self.bufs.hand(slot, Holder::Exposed, Holder::User);
                    let b = self.buf(slot, 0);
                    self.events.push_back(Event::BufferReturned(b));
                }
                Some(Holder::Reading) => {
                    self.bufs.hand(slot, Holder::Reading, Holder::Free);
                }
                _ => {}
            }
        }
        self.owner_leases.clear();
        self.fb_reads.clear();
        self.flush_holds();
    }

    // ---- carrying out engine actions ----

    /// Drain every engine's actions and events until all are quiet.
    fn pump(&mut self, now: Duration) {
        loop {
            let mut progressed = self.retry_pending(now);
            while let Some(a) = self.owner.as_mut().and_then(|o| o.poll_action()) {
                progressed = true;
                self.owner_action(now, a, None);
            }
            while let Some(a) = self.reader.as_mut().and_then(|r| r.poll_action()) {
                progressed = true;
                self.reader_action(now, a);
            }
            while let Some(a) = self.fbc.as_mut().and_then(|c| c.poll_action()) {
                progressed = true;
                self.fb_action(now, true, a, None);
            }
            while let Some(a) = self.fbs.as_mut().and_then(|s| s.poll_action()) {
                progressed = true;
                self.fb_action(now, false, a, None);
            }
            progressed |= self.owner_events(now);
            progressed |= self.reader_events(now);
            progressed |= self.fb_events(now);
            if !progressed {
                break;
            }
        }
        self.flush_holds();
    }

    /// Carry out an owner action. A `BindAndGrant` goes out chained with the
    /// frame in `frame` (the request or reply carrying the grant).
    fn owner_action(&mut self, now: Duration, a: mw::OwnerAction, frame: Option<&mut Frame<'_>>) {
        match a {
            mw::OwnerAction::BindAndGrant(b) => {
                let attach = mw_attach(&mw::Message::Grant(b.grant));
                let frame = match frame {
                    Some(f) => {
                        push_attach(f, attach);
                        *f
                    }
                    None => Frame::Engine(attach),
                };
                let bind = SendWr::BindMw {
                    wr_id: b.bind_token.wr_id(),
                    signaled: false,
                    mw: MwId(b.window),
                    rkey: b.rkey,
                    mr: self.data.id,
                    offset: b.buffer.offset as usize,
                    len: b.buffer.len as usize,
                    access: Access::REMOTE_READ,
                };
                match self.send_frame_with(now, &frame, Some((bind, b.send_token.wr_id()))) {
                    Ok(()) => {}
                    Err(e) => self.go_down(now, LossReason::Nic(e)),
                }
            }
            mw::OwnerAction::Invalidate { token, rkey, .. } => {
                let wr = SendWr::LocalInv { wr_id: token.wr_id(), signaled: true, rkey };
                if let Err(e) = self.nic.post_send(self.local.id, &[wr]) {
                    self.go_down(now, LossReason::Nic(e));
                }
            }
            mw::OwnerAction::FlushQp => {
                self.go_down(now, LossReason::PeerMisbehaved("the peer invalidated a window itself".into()))
            }
        }
    }

    fn reader_action(&mut self, now: Duration, a: mw::ReaderAction) {
        match a {
            mw::ReaderAction::Read { token, dest, remote_addr, rkey, len } => {
                let local = SgeList::from([Sge { mr: self.data.id, offset: dest.offset as usize, len }]);
                let wr = SendWr::Read { wr_id: token.wr_id(), signaled: true, local, remote_addr, rkey };
                if let Err(e) = self.nic.post_send(self.local.id, &[wr]) {
                    self.go_down(now, LossReason::Nic(e));
                }
            }
            mw::ReaderAction::SendRelease(r) => {
                let f = Frame::Engine(mw_attach(&mw::Message::Release(r)));
                if let Err(e) = self.send_frame_with(now, &f, None) {
                    self.go_down(now, LossReason::Nic(e));
                }
            }
            mw::ReaderAction::FlushQp => self.go_down(now, LossReason::ReadHung),
        }
    }

    /// Carry out a confirm-engine action; its messages ride in `frame` when given.
    fn fb_action(&mut self, now: Duration, client: bool, a: fb::Action, frame: Option<&mut Frame<'_>>) {
        match a {
            fb::Action::Read(rr) => self.start_fb_read(now, client, rr),
            fb::Action::Send(m) => {
                let attach = fb_attach(&m);
                match frame {
                    Some(f) => push_attach(f, attach),
                    None => {
                        if let Err(e) = self.send_frame_with(now, &Frame::Engine(attach), None) {
                            self.go_down(now, LossReason::Nic(e));
                        }
                    }
                }
            }
        }
    }

    fn start_fb_read(&mut self, now: Duration, client: bool, rr: fb::ReadRequest) {
        let Some(slot) = self.bufs.take(Holder::Reading) else {
            self.pending_fb_reads.push_back((client, rr));
            return;
        };
        let token = rr.token().raw();
        let tag = if client { TAG_FB_CLIENT } else { TAG_FB_SERVER };
        let len = rr.remote().len().min(self.cfg.buffer_size);
        let local = SgeList::from([Sge { mr: self.data.id, offset: self.slot_offset(slot) as usize, len }]);
        let w = SendWr::Read {
            wr_id: wr(tag, token),
            signaled: true,
            local,
            remote_addr: rr.remote().addr(),
            rkey: rr.remote().rkey(),
        };
        self.fb_reads.insert(token, slot);
        if let Err(e) = self.nic.post_send(self.local.id, &[w]) {
            self.go_down(now, LossReason::Nic(e));
        }
    }

    /// Start READs that waited for a free destination. Returns whether any did.
    fn retry_pending(&mut self, now: Duration) -> bool {
        let mut any = false;
        while self.bufs.count(Holder::Free) > 0 {
            if let Some((client, rr)) = self.pending_fb_reads.pop_front() {
                self.start_fb_read(now, client, rr);
                any = true;
            } else if let Some((msg, mut g, at)) = self.pending_grants.pop_front() {
                g.time_left = g.time_left.saturating_sub(now.saturating_sub(at));
                self.start_grant(now, msg, g);
                any = true;
            } else {
                break;
            }
        }
        any
    }

    /// Hand a grant to the reader with a destination (or queue it).
    fn start_grant(&mut self, now: Duration, msg: u64, g: mw::Grant) {
        let Some(reader) = self.reader.as_mut() else { return };
        let wanted = match self.cfg.role {
            Role::Client => self.calls.contains_key(&msg),
            Role::Server => self.requests.contains_key(&msg),
        };
        if !wanted {
            // The call was cancelled or timed out: release the lease without
            // reading a byte.
            reader.decline(now, g, mw::DeclineReason::Unwanted);
            return;
        }
        if g.len > self.cfg.buffer_size {
            // Decline: the destination offered is too small.
            reader.handle_grant(now, g, mw::Buffer { mr: u32::MAX, offset: 0, len: 0, addr: 0 });
            self.reader_leases.insert(g.lease, msg);
            return;
        }
        match self.bufs.take(Holder::Reading) {
            Some(slot) => {
                let dest = self.mw_buffer(slot, self.cfg.buffer_size);
                self.reader_leases.insert(g.lease, msg);
                if let Some(reader) = self.reader.as_mut() {
                    reader.handle_grant(now, g, dest);
                }
            }
            None => self.pending_grants.push_back((msg, g, now)),
        }
    }

    /// Post one frame in a fresh control slot, after `chain` (a bind) when given.
    fn send_frame_with(&mut self, _now: Duration, f: &Frame, chain: Option<(SendWr, u64)>) -> Result<(), NicError> {
        let slot = self
            .sends
            .take(Holder::Exposed)
            .ok_or(NicError::QueueFull { queue: "control send slots", depth: self.cfg.ctrl_slots })?;
        let offset = slot as usize * MAX_FRAME;
        // Encoded straight into the send slot (no intermediate buffer): the
        // slot is ours until its SEND completes.
        let mut encoded = Ok(0);
        let lent = self.nic.with_mr_mut(self.ctrl.id, offset, MAX_FRAME, &mut |b| encoded = f.encode_into(b));
        let len = match (lent, encoded) {
            (Ok(()), Ok(n)) => n,
            (Err(e), _) => {
                self.sends.hand(slot, Holder::Exposed, Holder::Free);
                return Err(e);
            }
            (_, Err(e)) => {
                self.sends.hand(slot, Holder::Exposed, Holder::Free);
                return Err(NicError::InvalidWr(e.to_string()));
            }
        };
        let sge = SgeList::one(Sge { mr: self.ctrl.id, offset, len: len as u32 });
        let result = match chain {
            Some((bind, send_wr_id)) => {
                let send = SendWr::Send { wr_id: send_wr_id, signaled: true, sge };
                let r = self.nic.post_send(self.local.id, &[bind, send]);
                if r.is_ok() {
                    self.grant_sends.insert(send_wr_id, slot);
                }
                r
            }
            None => self.nic.post_send(self.local.id, &[SendWr::Send { wr_id: wr(TAG_SEND, u64::from(slot)), signaled: true, sge }]),
        };
        if result.is_err() {
            self.sends.hand(slot, Holder::Exposed, Holder::Free);
        }
        result
    }
}

/// An endpoint whose QP exists but whose policies are not chosen yet; see
/// [`Endpoint::prepare`]. Dropping it destroys the QP and the CQ.
pub struct Prepared<N: Nic> {
    nic: Option<N>,
    cfg: Config,
    cq: CqId,
    local: QpEndpoint,
}

impl<N: Nic> Prepared<N> {
    /// What the peer needs to connect to this endpoint.
    pub fn local(&self) -> QpEndpoint {
        self.local
    }

    /// The settings `finish` will use (adjust them after the bootstrap, e.g.
    /// to the negotiated lease time).
    pub fn config_mut(&mut self) -> &mut Config {
        &mut self.cfg
    }

    /// Create the rest for `policies`: regions, windows, engines.
    pub fn finish(mut self, policies: Policies) -> Result<Endpoint<N>, NicError> {
        // The NIC stays in `self` until success, so that an error drops the QP and CQ.
        let nic = self.nic.as_ref().expect("finish runs once");
        let mut cfg = self.cfg.clone();
        cfg.policies = policies;
        let (cq, local) = (self.cq, self.local);
        let is_client = cfg.role == Role::Client;
        let (owns, reads) = if is_client {
            (cfg.policies.request, cfg.policies.reply)
        } else {
            (cfg.policies.reply, cfg.policies.request)
        };
        let mut access = Access::LOCAL_WRITE;
        if owns == Policy::Mw {
            access = access | Access::MW_BIND;
        } else {
            access = access | Access::REMOTE_READ;
        }
        let ctrl = nic.reg_mr(MAX_FRAME * 2 * cfg.ctrl_slots as usize, Access::LOCAL_WRITE)?;
        let data = nic.reg_mr(cfg.buffer_size as usize * cfg.buffers as usize, access)?;
        let mut windows = Vec::new();
        let owner = if owns == Policy::Mw {
            let mut ws = Vec::new();
            for _ in 0..cfg.buffers {
                let w = nic.alloc_mw()?;
                windows.push(w.id);
                ws.push(mw::Window { handle: w.id.raw(), rkey: w.rkey });
            }
            Some(mw::Owner::new(cfg.seed, ws))
        } else {
            None
        };
        let reader = (reads == Policy::Mw).then(|| {
            let release = if is_client { mw::ReleaseMode::Message } else { mw::ReleaseMode::Piggyback };
            mw::Reader::new(mw::ReaderConfig { safety_margin: cfg.safety_margin, release })
        });
        let mut fcfg = fb::Config::default();
        fcfg.hold_timeout = cfg.lease_time;
        fcfg.request_timeout = cfg.call_timeout;
        fcfg.confirm_timeout = cfg.lease_time;
        fcfg.max_attempts = cfg.max_attempts;
        fcfg.max_read_len = cfg.buffer_size;
        let any_confirm = owns == Policy::Confirm || reads == Policy::Confirm;
        let mut fbc = (is_client && any_confirm).then(|| fb::Client::new(fcfg.clone()));
        let mut fbs = (!is_client && any_confirm).then(|| fb::Server::new(fcfg));
        let mut fb_bufs = Vec::new();
        let mut fb_slot = HashMap::new();
        if owns == Policy::Confirm {
            for slot in 0..cfg.buffers {
                let off = u64::from(slot) * u64::from(cfg.buffer_size);
                let region = fb::Region::new(data.addr + off, cfg.buffer_size, data.rkey);
                let id = match (&mut fbc, &mut fbs) {
                    (Some(c), _) => c.add_buffer(region),
                    (_, Some(s)) => s.add_buffer(region),
                    _ => unreachable!("a confirm owner has a fallback engine"),
                };
                fb_bufs.push(id);
                fb_slot.insert(id, slot);
            }
        }
        let nic = self.nic.take().expect("finish runs once");
        Ok(Endpoint {
            id: NEXT_ENDPOINT.fetch_add(1, Ordering::Relaxed),
            sends: Slots::new(cfg.ctrl_slots),
            bufs: Slots::new(cfg.buffers),
            returns: Default::default(),
            hold_changes: Vec::with_capacity(2 * cfg.buffers as usize),
            scratch: Vec::with_capacity(MAX_FRAME),
            batch: vec![Completion::EMPTY; POLL_BATCH],
            reclaimed: Vec::with_capacity(cfg.buffers as usize),
            nic,
            cq,
            local,
            ctrl,
            grant_sends: HashMap::new(),
            data,
            windows,
            owner,
            reader,
            fbc,
            fbs,
            fb_bufs,
            fb_slot,
            owner_leases: HashMap::new(),
            reader_leases: HashMap::new(),
            fb_msgs: HashMap::new(),
            fb_expired: VecDeque::new(),
            fb_reads: HashMap::new(),
            pending_grants: VecDeque::new(),
            pending_fb_reads: VecDeque::new(),
            next_msg: 1,
            last_request: 0,
            calls: BTreeMap::new(),
            requests: BTreeMap::new(),
            events: VecDeque::new(),
            down: None,
            destroyed: false,
            cfg,
        })
    }
}

impl<N: Nic> Drop for Prepared<N> {
    fn drop(&mut self) {
        if let Some(nic) = self.nic.take() {
            let _ = nic.destroy_qp(self.local.id);
            let _ = nic.destroy_cq(self.cq);
        }
    }
}

impl<N: Nic> Drop for Endpoint<N> {
    fn drop(&mut self) {
        // Order: QP to ERR (no more remote access), windows freed, QP
        // destroyed, then the memory and the CQ.
        if !self.destroyed {
            let _ = self.nic.set_qp_error(self.local.id);
        }
        for w in self.windows.drain(..) {
            let _ = self.nic.dealloc_mw(w);
        }
        if !self.destroyed {
            let _ = self.nic.destroy_qp(self.local.id);
        }
        let _ = self.nic.dereg_mr(self.data.id);
        let _ = self.nic.dereg_mr(self.ctrl.id);
        let _ = self.nic.destroy_cq(self.cq);
    }
}

/// Add an engine message to a request or reply. At most three ride in one
/// (a payload's grant or offer, a fetch, a release), below `MAX_ATTACH`.
fn push_attach(f: &mut Frame<'_>, a: Attach) {
    match f {
        Frame::Request { attach, .. } | Frame::Reply { attach, .. } => {
            let pushed = attach.push(a);
            debug_assert!(pushed.is_ok(), "more engine messages than a frame carries");
        }
        Frame::Engine(_) => {}
    }
}

/// An mw engine message as an attachment, encoded in place.
pub(super) fn mw_attach(m: &mw::Message) -> Attach {
    Attach::encoded(EngineTag::Mw, |b| m.encode_into(b).unwrap_or(usize::MAX))
        .expect("mw messages are shorter than MAX_ATTACH_LEN")
}

/// A confirm engine message as an attachment, encoded in place.
pub(super) fn fb_attach(m: &fb::Message) -> Attach {
    Attach::encoded(EngineTag::Confirm, |b| m.encode_into(b).unwrap_or(usize::MAX))
        .expect("confirm messages are shorter than MAX_ATTACH_LEN")
}

#[cfg(fuzzing)]
impl<N: Nic> Endpoint<N> {
    /// Fuzzing hook: handle `bytes` as if a SEND carrying them had arrived
    /// (with `invalidated` as a SEND_WITH_INV's rkey), then run the engines.
    pub fn fuzz_deliver(&mut self, now: Duration, bytes: &[u8], invalidated: Option<u32>) {
        let len = bytes.len().min(MAX_FRAME);
        if self.nic.write_mr(self.ctrl.id, self.recv_offset(0), &bytes[..len]).is_ok() {
            self.on_recv(now, 0, len as u32, invalidated);
            self.pump(now);
        }
    }
}
