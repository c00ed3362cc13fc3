//! Completions of the connection's work requests, routed to what posted
//! them: received frames (checked against the credit granted), plain
//! sends, the engines' binds, invalidations and READs; and posts the I/O
//! layer could not carry out.

use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::super::pool::Holder;
use super::*;

impl Connection {
    /// If `c` is a successful receive, where its frame is in the control
    /// region: (offset, length). Hand those bytes to
    /// [`Connection::handle_completion`].
    pub fn received_frame(&self, c: &Completion) -> Option<(usize, usize)> {
        (tag_of(c.wr_id) == TAG_RECV && c.status.is_success() && !self.shared_receives)
            .then(|| (self.recv_offset((c.wr_id & LOW56) as u32), (c.byte_len as usize).min(MAX_FRAME)))
    }

    pub(super) fn status(c: &Completion) -> mw::Status {
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

    /// A completion of one of this connection's work requests. For a
    /// successful receive, `frame` is the received bytes (see
    /// [`Connection::received_frame`]); otherwise it is ignored.
    pub fn handle_completion(&mut self, now: Duration, c: &Completion, frame: &[u8]) {
        // No earlier than the connection's time: the I/O layer advances it
        // once a batch ([`Connection::advance`]), not once a completion.
        debug_assert!(now >= self.now, "a completion's time before the connection's");
        self.now = now;
        self.dirty = true;
        self.stats.completions += 1;
        if !c.status.is_success() {
            self.stats.error_completions += 1;
            match c.status {
                WcStatus::RnrRetryExcErr => self.stats.rnr_retries_exceeded += 1,
                WcStatus::RetryExcErr => self.stats.transport_retries_exceeded += 1,
                _ => {}
            }
        }
        if !c.status.is_success() && self.down.is_none() {
            // Any error, a flush included: the QP is in ERR. A flushed receive
            // may be the first sign (the peer's bad READ took both QPs down
            // while we had nothing of our own outstanding).
            let reason = LossReason::Completion {
                status: c.status,
                opcode: c.opcode,
                vendor_err: c.vendor_err,
                wr_id: c.wr_id,
            };
            self.go_down(now, reason);
        }
        let low = c.wr_id & LOW56;
        match tag_of(c.wr_id) {
            TAG_SEND => self.plain_send_done(low as u32),
            TAG_RECV => {
                // The receive goes back (granted with the next frame out)
                // unless the frame took the connection down.
                if c.status.is_success()
                    && self.frame_in(now, frame, c.invalidated_rkey)
                    && self.down.is_none()
                    && !self.shared_receives
                {
                    self.post_recv(low as u32);
                    self.owed += 1;
                }
            }
            TAG_FB_CLIENT | TAG_FB_SERVER => {
                let token = fb::ReadToken::from_raw(low);
                match &mut self.confirm {
                    Some(e) => {
                        each!(&mut e.engine, e => e.handle_read_completion(now, token, c.status.is_success()))
                    }
                    None => tracing::warn!(wr_id = c.wr_id, "confirm READ completion with no confirm engine"),
                }
            }
            _ => {
                let token = mw::Token::from_wr_id(c.wr_id);
                let status = Self::status(c);
                match token.engine() {
                    Some(mw::Engine::Owner) => {
                        if let Some(o) = &mut self.owner {
                            if let Some(slot) = o.grant_sends.remove(&c.wr_id) {
                                self.sends.hand(slot, Holder::Exposed, Holder::Free);
                            }
                            o.engine.handle_completion(now, token, status);
                        }
                    }
                    Some(mw::Engine::Reader) => {
                        if let Some(r) = &mut self.reader {
                            r.engine.handle_completion(now, token, status);
                        }
                    }
                    None => tracing::warn!(wr_id = c.wr_id, "completion with an unknown work request id"),
                }
            }
        }
    }

    /// A frame the peer sent (`bytes`, with the rkey its SEND_WITH_INV
    /// invalidated), counted against the credit granted: one past every
    /// credit granted takes the connection down
    /// (`Misbehavior::ExceedsCredit`) unread, and returns false.
    #[inline]
    pub(super) fn frame_in(&mut self, now: Duration, bytes: &[u8], invalidated: Option<u32>) -> bool {
        self.frames_in += 1;
        if self.frames_in > self.granted_total {
            // Its SEND_WITH_INV, if any, has happened all the same.
            if let Some(rkey) = invalidated {
                self.peer_invalidated(now, rkey);
            }
            let (granted, received) = (self.granted_total, self.frames_in);
            self.misbehaved(now, Misbehavior::ExceedsCredit { granted, received });
            return false;
        }
        self.on_recv(now, bytes, invalidated);
        true
    }

    /// The I/O layer could not carry out `cmd`: the connection goes down
    /// (its resources are what failed), and a frame's send slot is freed.
    pub fn post_failed(&mut self, cmd: &Command, e: NicError) {
        if let Command::PostSend { chain, frame: Some(f) } = cmd {
            let slot = (f.offset / MAX_FRAME) as u32;
            // Not posted: no completion comes for it (nor for the plain
            // frames behind it, which go down with the connection).
            if let Some(i) = self.plain_sends.iter().position(|&s| s == slot) {
                self.plain_sends.remove(i);
            }
            self.sends.hand(slot, Holder::Exposed, Holder::Free);
            if let Some(o) = &mut self.owner {
                for w in chain.as_slice() {
                    o.grant_sends.remove(&w.wr_id());
                }
            }
        }
        self.dirty = true;
        self.go_down(self.now, LossReason::Nic(e));
    }
}
