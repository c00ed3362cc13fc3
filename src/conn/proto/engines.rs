//! Carrying out the engines' actions and events: binds and grants, READs,
//! releases, confirm fetches, and the grants received (`on_grant`) and
//! waiting for a destination.

use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::super::config::*;
use super::super::frame::Frame;
use super::super::pool::Holder;
use super::super::types::*;
use super::confirm::ConfirmEngine;
use super::{fb_attach, mw_attach, push_attach, wr, Connection, Data, TAG_FB_CLIENT, TAG_FB_SERVER};
use crate::backend::{Access, MrId, MwId, SendWr, Sge, SgeList};

impl Connection {
    // ---- carrying out engine actions ----

    /// Owner side: end exposure number `exposure` of a user range now (a
    /// delegation was revoked), as `Endpoint::revoke` describes (under
    /// confirm the range returns at once). Whether an exposure was found to end.
    pub(crate) fn revoke_exposure(&mut self, now: Duration, exposure: u64) -> bool {
        let now = self.advance(now);
        let Some(slot) = self.exposed_slot(exposure) else { return false };
        let revoked = if let Some(o) = self.owner.as_mut() {
            let lease = o.leases.iter().find(|&(_, &s)| s == slot).map(|(&l, _)| l);
            lease.is_some_and(|lease| o.engine.revoke(now, lease).is_ok())
        } else if let Some(c) = self.confirm.as_mut() {
            let buffer = c.bufs[slot as usize];
            c.server().is_some_and(|e| e.withdraw_buffer(now, buffer))
        } else {
            false
        };
        self.pump_rounds(now);
        revoked
    }

    /// Drain every engine's actions and events until all are quiet (at
    /// rest, most calls find nothing to do and cost the checks only).
    pub(super) fn pump(&mut self, now: Duration) {
        if !self.idle() {
            self.pump_rounds(now);
        }
        self.maybe_grant();
    }

    /// [`Connection::pump`]'s rounds, while one makes progress and leaves
    /// something to do.
    #[inline(never)]
    fn pump_rounds(&mut self, now: Duration) {
        loop {
            let mut progressed = self.retry_pending(now);
            while let Some(a) = self.owner.as_mut().and_then(|o| o.engine.poll_action()) {
                progressed = true;
                self.owner_action(now, a, None);
            }
            while let Some(a) = self.reader.as_mut().and_then(|r| r.engine.poll_action()) {
                progressed = true;
                self.reader_action(now, a);
            }
            while let Some(a) = self.confirm.as_mut().and_then(ConfirmEngine::poll_action) {
                progressed = true;
                self.fb_action(now, a, None);
            }
            progressed |= self.owner_events(now);
            progressed |= self.reader_events(now);
            progressed |= self.fb_events(now);
            progressed |= self.drain_backlog();
            if !progressed || self.idle() {
                break;
            }
        }
    }

    /// Whether a round of [`Connection::pump`] would find nothing to do
    /// (most turns of a connection at rest between calls): up, no engine
    /// output queued, nothing waiting for a buffer or for credit. Every
    /// queue the round drains is checked here.
    #[inline]
    fn idle(&self) -> bool {
        self.down.is_none()
            && self.backlog.is_empty()
            && self.inline_wait.is_empty()
            && self.owner.as_ref().map_or(true, |o| !o.engine.has_output())
            && self.reader.as_ref().map_or(true, |r| !r.engine.has_output() && r.pending.is_empty())
            && self.confirm.as_ref().map_or(true, ConfirmEngine::idle)
    }

    /// Carry out an owner action. A `BindAndGrant` goes out chained with the
    /// frame in `frame` (the request or reply carrying the grant).
    pub(super) fn owner_action(&mut self, now: Duration, a: mw::OwnerAction, frame: Option<&mut Frame<'_>>) {
        match a {
            mw::OwnerAction::BindAndGrant(b) => {
                let attach = mw_attach(&mw::Message::Grant(b.grant));
                let alone;
                let frame: &Frame<'_> = match frame {
                    Some(f) => {
                        push_attach(f, attach);
                        f
                    }
                    None => {
                        alone = Frame::Engine(attach);
                        &alone
                    }
                };
                let bind = SendWr::BindMw {
                    wr_id: b.bind_token.wr_id(),
                    signaled: false,
                    mw: MwId(b.window),
                    rkey: b.rkey,
                    // The pool's data region, or a user region (the buffer names it).
                    mr: MrId(b.buffer.mr),
                    offset: b.buffer.offset as usize,
                    len: b.buffer.len as usize,
                    access: Access::REMOTE_READ,
                };
                self.send_frame(now, frame, Some((bind, b.send_token.wr_id())));
            }
            mw::OwnerAction::Invalidate { token, rkey, .. } => {
                self.post(SendWr::LocalInv { wr_id: token.wr_id(), signaled: true, rkey });
            }
            // Asked again once down: the move to ERR has not been seen to
            // work, and a LOCAL_INV posted before must not execute.
            mw::OwnerAction::FlushQp if self.down.is_some() => self.ask_err_again(),
            mw::OwnerAction::FlushQp => {
                self.go_down(now, LossReason::LeaseEngine(mw::LossCause::HostilePeer))
            }
        }
    }

    pub(super) fn reader_action(&mut self, now: Duration, a: mw::ReaderAction) {
        match a {
            mw::ReaderAction::Read { token, dest, remote_addr, rkey, len } => {
                self.post_read(token.wr_id(), MrId(dest.mr), dest.offset as usize, remote_addr, rkey, len);
            }
            mw::ReaderAction::SendRelease(r) => {
                self.send_frame(now, &Frame::Engine(mw_attach(&mw::Message::Release(r))), None);
            }
            mw::ReaderAction::FlushQp => self.go_down(now, LossReason::ReadHung),
        }
    }

    /// Carry out a confirm-engine action; its messages ride in `frame` when given.
    pub(super) fn fb_action(&mut self, now: Duration, a: fb::Action, frame: Option<&mut Frame<'_>>) {
        match a {
            fb::Action::Read(rr) => self.start_fb_read(rr),
            fb::Action::Send(m) => {
                let attach = fb_attach(&m);
                match frame {
                    Some(f) => push_attach(f, attach),
                    None => _ = self.send_frame(now, &Frame::Engine(attach), None),
                }
            }
        }
    }

    /// READ `len` bytes at `remote_addr` into the data region at
    /// `offset`: one READ, or READs of `Config::read_chunk` bytes posted
    /// together, of which only the last is signaled (RC completes READs in
    /// order, so its completion covers the others; an error in any ends
    /// the QP, and the signaled one then flushes). All carry `wr_id`.
    pub(super) fn post_read(
        &mut self,
        wr_id: u64,
        mr: MrId,
        offset: usize,
        remote_addr: u64,
        rkey: u32,
        len: u32,
    ) {
        let chunk = self.cfg.read_chunk.max(1);
        let mut done = 0u32;
        loop {
            let n = (len - done).min(chunk);
            let last = done + n == len;
            let local = SgeList::from([Sge { mr, offset: offset + done as usize, len: n }]);
            // The peer's address: past the top of the address space it
            // wraps, and the peer's NIC fails the READ as it fails any
            // outside the window or region it bound.
            let remote_addr = remote_addr.wrapping_add(u64::from(done));
            self.post(SendWr::Read { wr_id, signaled: last, local, remote_addr, rkey });
            done += n;
            if last {
                break;
            }
        }
    }

    pub(super) fn start_fb_read(&mut self, rr: fb::ReadRequest) {
        if self.confirm.is_none() || self.down.is_some() {
            // Down: the engine failed the read's request when the
            // connection was lost, and nothing is read any more.
            return;
        }
        let len = rr.remote().len();
        let Some(slot) = self.take_fit(len, Holder::Reading) else {
            // The engine refuses reads longer than the largest buffer, so
            // one fits once a buffer of its class is free.
            if self.may_wait(self.now) {
                if let Some(c) = self.confirm.as_mut() {
                    c.pending_reads.push_back(rr);
                }
            }
            return;
        };
        let c = self.confirm.as_mut().expect("checked");
        let token = rr.token().raw();
        let tag = if self.role == Role::Client { TAG_FB_CLIENT } else { TAG_FB_SERVER };
        c.reads.insert(token, slot);
        let (mr, offset) = self.place(slot);
        self.post_read(wr(tag, token), mr.id, offset as usize, rr.remote().addr(), rr.remote().rkey(), len);
    }

    /// Start READs that waited for a free destination. Returns whether any did.
    pub(super) fn retry_pending(&mut self, now: Duration) -> bool {
        if !self.buffer_awaited() && self.down.is_none() {
            return false; // nothing waits for a buffer
        }
        let mut any = false;
        if self.down.is_some() {
            // Nothing can be read any more: a queued READ would take a
            // buffer that no completion ever returns once the QP is gone.
            // Queued grants are declined (the owner's lease ends with the
            // QP); queued confirm READs are dropped (the engine failed
            // their fetches when the connection was lost).
            if let Some(c) = self.confirm.as_mut() {
                any |= !c.pending_reads.is_empty();
                c.pending_reads.clear();
            }
            if let Some(r) = self.reader.as_mut() {
                while let Some((_, g, _)) = r.pending.pop_front() {
                    r.engine.decline(now, g, mw::DeclineReason::ConnectionLost);
                    any = true;
                }
            }
            any |= !self.inline_wait.is_empty();
            self.inline_wait.clear();
            self.inline_bytes.clear();
            self.inline_waiting = 0;
            return any;
        }
        // Each waiting READ, oldest first, starts if a buffer it fits is
        // free; the others keep their place.
        let waiting = self.confirm.as_ref().map_or(0, |c| c.pending_reads.len());
        for _ in 0..waiting {
            let Some(rr) = self.confirm.as_mut().and_then(|c| c.pending_reads.pop_front()) else { break };
            let margin = self.cfg.safety_margin;
            if self.confirm.as_mut().is_some_and(|c| each!(&mut c.engine, e => e.withdraw_read(rr.token()))) {
                // Its request ended while it waited (its time ran out, or
                // the fetch was cancelled): nothing is read for nobody.
                any = true;
            } else if self.confirm.as_ref().is_some_and(|c| c.too_late(rr.token(), now, margin)) {
                // As a grant with too little lease left is declined: not
                // started, it ends with its request, shortly.
                if let Some(c) = self.confirm.as_mut() {
                    c.pending_reads.push_back(rr);
                }
            } else if self.can_fit(rr.remote().len()) {
                self.start_fb_read(rr);
                any = true;
            } else if let Some(c) = self.confirm.as_mut() {
                c.pending_reads.push_back(rr);
            }
        }
        let waiting = self.reader.as_ref().map_or(0, |r| r.pending.len());
        for _ in 0..waiting {
            let Some((msg, mut g, at)) = self.reader.as_mut().and_then(|r| r.pending.pop_front()) else {
                break;
            };
            if self.can_fit(g.len) {
                g.time_left = g.time_left.saturating_sub(now.saturating_sub(at));
                self.start_grant(now, msg, g);
                any = true;
            } else if let Some(r) = self.reader.as_mut() {
                r.pending.push_back((msg, g, at));
            }
        }
        any |= self.retry_inline();
        any
    }

    /// The length of the payload for `msg` (a call) if it is waiting for a
    /// free buffer to be read or copied into.
    pub(super) fn waits_for_buffer(&self, msg: u64) -> Option<u32> {
        if let Some((_, g, _)) = self.reader.as_ref().and_then(|r| r.pending.iter().find(|p| p.0 == msg)) {
            return Some(g.len);
        }
        if let Some(&(_, _, len)) = self.inline_wait.iter().find(|w| w.0 == msg) {
            return Some(len);
        }
        let fm = self.calls.get(&msg)?.fetch_fb?;
        self.confirm.as_ref()?.waiting_read(fm)
    }

    /// A window grant, riding in request or reply `msg` (or alone): to the
    /// reader, or refused.
    pub(super) fn on_grant(&mut self, now: Duration, msg: Option<u64>, g: mw::Grant) {
        let Some(msg) = msg else {
            return self.misbehaved(now, Misbehavior::GrantOutsideMessage);
        };
        let Some(r) = self.reader.as_ref() else {
            return self.misbehaved(now, Misbehavior::WrongPolicy { what: "window grant" });
        };
        // Every lease this side holds is in `leases` (read or declined,
        // until the engine's event for it) or waiting for a buffer: its
        // outcome finds its message by the lease id, so a second grant
        // under a live id would take the first's outcome.
        if r.leases.contains_key(&g.lease) || r.pending.iter().any(|p| p.1.lease == g.lease) {
            return self.misbehaved(now, Misbehavior::LeaseIdReused { lease: g.lease.raw() });
        }
        if self.role == Role::Server {
            if let Some(r) = self.requests.get_mut(&msg) {
                r.data = Data::Reading;
            }
        } else if let Some(c) = self.calls.get_mut(&msg) {
            if c.reply.is_some() {
                // A second reply to the call (an honest server never sends
                // one under mw): its grant is released unread, so that a
                // client's waiting grants stay within its calls, one each.
                if let Some(r) = self.reader.as_mut() {
                    // Its id is taken until the engine's event, which fails
                    // no message (no call has id 0).
                    r.leases.insert(g.lease, 0);
                    r.engine.decline(now, g, mw::DeclineReason::Unwanted);
                }
                return;
            }
            c.data = Data::Reading;
        }
        self.start_grant(now, msg, g);
    }

    /// Hand a grant to the reader with a destination (or queue it).
    pub(super) fn start_grant(&mut self, now: Duration, msg: u64, g: mw::Grant) {
        let wanted = match self.role {
            Role::Client => self.calls.contains_key(&msg),
            Role::Server => self.requests.contains_key(&msg),
        };
        let largest = self.layout.largest();
        let dest = if wanted && g.len <= largest { self.take_fit(g.len, Holder::Reading) } else { None };
        if wanted && g.len <= largest && dest.is_none() {
            // Every buffer it fits is busy: it waits, if it may (else the
            // connection is down, and the lease ends with the QP).
            let waits = self.may_wait(now);
            if let Some(r) = self.reader.as_mut() {
                if waits {
                    r.pending.push_back((msg, g, now));
                } else {
                    r.engine.decline(now, g, mw::DeclineReason::ConnectionLost);
                }
            }
            return;
        }
        let dest = dest.map(|slot| self.mw_buffer(slot, self.layout.size(slot)));
        let Some(r) = self.reader.as_mut() else { return };
        if !wanted {
            // The call was cancelled or timed out: release the lease without
            // reading a byte (its id stays taken until the engine's event).
            r.leases.insert(g.lease, msg);
            r.engine.decline(now, g, mw::DeclineReason::Unwanted);
        } else if g.len > largest {
            // Decline: the destination offered is too small. The stand-in
            // (no region: never read into) has a buffer's capacity, so the
            // reason the user sees says what a buffer holds, not 0.
            let dest = mw::Buffer { mr: u32::MAX, offset: 0, len: largest, addr: 0 };
            r.engine.handle_grant(now, g, dest);
            r.leases.insert(g.lease, msg);
        } else if let Some(dest) = dest {
            r.leases.insert(g.lease, msg);
            r.engine.handle_grant(now, g, dest);
        }
    }

    /// Payloads of the peer's waiting for a free buffer: window grants and
    /// confirm READs.
    fn waiting_payloads(&self) -> usize {
        self.reader.as_ref().map_or(0, |r| r.pending.len())
            + self.confirm.as_ref().map_or(0, |c| c.pending_reads.len())
    }

    /// A payload of the peer's found every buffer it fits busy: whether it
    /// may wait for one (the bound on a server: `Config::max_waiting_payloads`;
    /// past it the connection goes down).
    fn may_wait(&mut self, now: Duration) -> bool {
        if self.role == Role::Client {
            return true;
        }
        let max = self.cfg.max_waiting_payloads as usize;
        if self.waiting_payloads() >= max {
            self.drop_stale_waiting(now);
        }
        if self.waiting_payloads() < max {
            return true;
        }
        self.misbehaved(now, Misbehavior::TooManyWaitingPayloads { waiting: max as u32 });
        false
    }

    /// Drop the waiting payloads that will never be read: confirm READs
    /// whose request ended (its time ran out), and grants whose lease has
    /// no more than the safety margin left (declined and released: they
    /// would be declined when a buffer came free anyway).
    fn drop_stale_waiting(&mut self, now: Duration) {
        if let Some(c) = self.confirm.as_mut() {
            for _ in 0..c.pending_reads.len() {
                let Some(rr) = c.pending_reads.pop_front() else { break };
                if !each!(&mut c.engine, e => e.withdraw_read(rr.token())) {
                    c.pending_reads.push_back(rr);
                }
            }
        }
        let margin = self.cfg.safety_margin;
        let Some(r) = self.reader.as_mut() else { return };
        for _ in 0..r.pending.len() {
            let Some((msg, mut g, at)) = r.pending.pop_front() else { break };
            let left = g.time_left.saturating_sub(now.saturating_sub(at));
            if left > margin {
                r.pending.push_back((msg, g, at));
                continue;
            }
            g.time_left = left;
            r.leases.insert(g.lease, msg);
            r.engine.decline(now, g, mw::DeclineReason::LeaseTooShort { time_left: left, margin });
        }
    }
}
