//! Going down and closing: the QP to ERR, the engines told, the QP
//! destroyed as evidence.

use std::time::Duration;

use super::*;

impl Connection {
    /// The connection is down: QP to ERR (every work request flushes), the
    /// engines told, calls failed. Buffers come back on their evidence:
    /// READ destinations on their flushes, window exposures at the QP's
    /// destroy ([`Connection::flushed`] says when only that is left).
    pub(super) fn go_down(&mut self, now: Duration, reason: LossReason) {
        if self.down.is_some() {
            return;
        }
        tracing::info!(%reason, "connection down");
        self.down = Some(reason.clone());
        // Nothing more goes out: frames waiting for credit are dropped.
        self.backlog.clear();
        self.backlog_bytes.clear();
        // No new READ of the peer's starts once it works
        // ([`Connection::handle_qp_in_error`]); the owner's leased buffers
        // still wait for the destroy.
        self.commands.push_back(Command::SetQpError);
        self.to_err = true;
        if let Some(o) = &mut self.owner {
            o.engine.handle_connection_lost(now);
        }
        if let Some(r) = &mut self.reader {
            r.engine.handle_qp_error(now);
        }
        if let Some(c) = &mut self.confirm {
            each!(&mut c.engine, e => e.handle_connection_lost(now));
        }
        for (msg, _) in self.calls.drain() {
            self.emit(Event::CallFailed {
                call: CallId(msg),
                error: CallError::ConnectionLost(reason.clone()),
            });
        }
        let mut requests: Vec<_> = self.requests.drain().collect();
        requests.sort_unstable_by_key(|&(msg, _)| msg);
        for (msg, r) in requests {
            if !r.surfaced {
                self.emit(Event::RequestDropped {
                    req: RequestId(msg),
                    error: CallError::ConnectionLost(reason.clone()),
                });
            }
        }
        self.emit(Event::ConnectionLost(reason));
    }

    /// Start closing: the QP goes to ERR (no remote access through it is
    /// possible any more), every call fails, and the flushes start
    /// arriving. Once the QP is destroyed, tell
    /// [`Connection::handle_qp_destroyed`].
    pub fn begin_close(&mut self, now: Duration) {
        self.peer_lost(now, LossReason::Closed)
    }

    /// Outside the connection, the peer went away or broke the protocol
    /// (its bootstrap stream closed, or carried a byte after the ready
    /// byte): as [`Connection::begin_close`], but the connection is down
    /// for `why` ([`LossReason::PeerGone`] or
    /// [`LossReason::PeerMisbehaved`]; `Closed` is `begin_close`), unless
    /// it was down already.
    pub fn peer_lost(&mut self, now: Duration, why: LossReason) {
        let now = self.advance(now);
        self.dirty = true;
        match why {
            LossReason::PeerMisbehaved(what) => self.misbehaved(now, what),
            why => self.go_down(now, why),
        }
    }

    /// Send-queue work requests whose completions are still to come. The
    /// plain frames posted unsignaled after the last signaled one are not
    /// counted: one that completed gives no completion, and one that did
    /// not is flushed with the QP (their slots are control memory only).
    pub fn sends_in_flight(&self) -> usize {
        let silent = (self.unsignaled_run as usize).min(self.plain_sends.len());
        self.sends.count(Holder::Exposed) - silent
    }

    /// The owner engine asks again for the QP to go to ERR (a window was
    /// invalidated behind its back after the connection went down, and no
    /// move to ERR has been seen to work): queue one more `SetQpError`,
    /// unless one is queued.
    #[cold]
    pub(super) fn ask_err_again(&mut self) {
        if !self.to_err {
            self.commands.push_back(Command::SetQpError);
            self.to_err = true;
        }
    }

    /// The QP is in ERR (the driver's `SetQpError` succeeded, see
    /// [`Connection::drain_commands`]): no new READ of the peer's starts.
    /// The owner's exposed buffers still come back only with the QP's
    /// destroy (a NIC may still be copying a READ response's packet out of
    /// one: `Owner::handle_qp_error`).
    #[cold]
    #[inline(never)]
    pub(super) fn handle_qp_in_error(&mut self) {
        self.to_err = false;
        if let Some(o) = &mut self.owner {
            o.engine.handle_qp_error(self.now);
            self.dirty = true;
        }
    }

    /// The connection is down and every completion it waits for is in (its
    /// SENDs and READs, the owner's binds, grants and invalidations, done
    /// or flushed): destroying the QP now loses none, and it is what the
    /// buffers and ranges still exposed through windows wait for (a NIC
    /// may still be copying a READ response's packet out of one after the
    /// flush). What a driver waits for before [`Link::finish_close`](crate::conn::Link::finish_close).
    pub fn flushed(&self) -> bool {
        let kept = self.owner.as_ref().map_or(0, |o| o.engine.waits_for_destroy());
        self.down.is_some()
            && self.sends_in_flight() == 0
            && self.bufs.count(Holder::Reading) == 0
            && self.bufs.count(Holder::Exposed) + self.ranges.count(Holder::Exposed) == kept
    }

    /// Destroying the QP failed: it may still reach every buffer and range
    /// it could (a READ not flushed may still land, a window not freed may
    /// still be read), so they stay where they are, for good, and the
    /// shared pool's buffers among them never go back to the pool. The
    /// connection is down. Returns how many buffers and ranges are kept.
    pub fn handle_qp_stuck(&mut self, now: Duration) -> usize {
        let now = self.advance(now);
        self.go_down(now, LossReason::Closed);
        self.bufs.quarantine();
        self.busy_buffers()
    }

    /// The QP is destroyed: no DMA through it is possible any more, so every
    /// buffer comes back. Idempotent.
    pub fn handle_qp_destroyed(&mut self, now: Duration) {
        let now = self.advance(now);
        self.go_down(now, LossReason::Closed);
        if self.destroyed {
            return;
        }
        self.destroyed = true;
        if let Some(o) = &mut self.owner {
            o.engine.handle_qp_destroyed(now);
        }
        if let Some(r) = &mut self.reader {
            r.engine.handle_qp_destroyed(now);
        }
        self.pump(now);
        // The QP is gone: nothing can reach or fill any buffer any more.
        for k in 0..self.cfg.region_exposures {
            if self.ranges.holder(k) == Some(Holder::Exposed) {
                self.exposure_over(self.layout.slots() + k, 0);
            }
        }
        for slot in 0..self.layout.slots() {
            match self.bufs.holder(slot) {
                Some(Holder::Exposed) => self.exposure_over(slot, 0),
                Some(Holder::Reading) => {
                    self.bufs.hand(slot, Holder::Reading, Holder::Free);
                }
                _ => {}
            }
        }
        if let Some(o) = &mut self.owner {
            o.leases.clear();
        }
        if let Some(c) = &mut self.confirm {
            // The QP is gone: no READ of ours will complete.
            c.reads.clear();
        }
    }
}
