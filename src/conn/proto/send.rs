//! The send path: staging frames in send slots, receive credit and the
//! backlog of frames waiting for it, selective signaling.

use super::super::frame::{Frame, CREDIT_AT, GIVE_BACK, MAX_FRAME, RETURNED};
use super::super::pool::Holder;
use super::super::types::*;
use super::{wr, Chain, Command, Connection, Staged, TAG_SEND};
use crate::backend::{NicError, SendWr, Sge, SgeList};
use std::time::Duration;

impl Connection {
    /// Carry out every command in place, in order: `run` gets each with
    /// the bytes of the frame it stages (empty if none) and carries it out,
    /// copying those bytes into the command's send slot if it has a frame.
    /// A command `run` fails goes to [`Connection::post_failed`] (and the
    /// commands that leads to are carried out too). Each command stays in
    /// its queue while `run` has it (a command is a few hundred bytes: not
    /// moved out).
    pub fn drain_commands(&mut self, mut run: impl FnMut(&mut Command, &[u8]) -> Result<(), NicError>) {
        loop {
            self.settle();
            let Some(cmd) = self.commands.front_mut() else {
                self.tx_used = 0;
                if self.to_err {
                    // It went through (a failure clears the flag).
                    self.handle_qp_in_error();
                }
                return;
            };
            let bytes = match cmd {
                Command::PostSend { frame: Some(s), .. } => {
                    &self.tx[s.start as usize..(s.start + s.len) as usize]
                }
                _ => &[],
            };
            match run(cmd, bytes) {
                Ok(()) => {
                    self.commands.pop_front();
                }
                Err(e) => {
                    if let Some(cmd) = self.commands.pop_front() {
                        if let Command::SetQpError = cmd {
                            // No evidence: the owner's exposures wait for the destroy.
                            self.to_err = false;
                            tracing::warn!(%e, "moving the QP to ERR failed: what it exposed stays out of use until it is destroyed");
                        }
                        self.post_failed(&cmd, e);
                    }
                }
            }
        }
    }

    /// Whether a frame needing `need` credits can go now.
    #[inline]
    pub(super) fn can_send(&self, need: u32) -> bool {
        self.credits >= need && self.sends.any_free()
    }

    /// Credits a frame of `kind` needs: a `Credit` frame may spend the
    /// last one, every other frame leaves it for a grant.
    pub(super) fn credits_needed(kind: u8) -> u32 {
        if kind == 6 {
            1
        } else {
            2
        }
    }

    /// Whether a call or reply could go now: a send slot, credit, and no
    /// older frame waiting for either.
    pub(super) fn send_capacity(&self) -> Result<(), UseError> {
        if !self.sends.any_free() {
            return Err(UseError::NoCtrlSlot);
        }
        if !self.backlog.is_empty() || self.credits < 2 {
            return Err(UseError::NoCredit);
        }
        Ok(())
    }

    /// Stage one frame for a fresh control slot and queue its SEND, after
    /// `chain` (a bind and the SEND's work request id) when given. A frame
    /// with no chain that finds no credit or send slot (or older frames
    /// waiting) waits in the backlog; a chained one must find both (calls
    /// and replies check first, see [`Connection::send_capacity`]).
    /// Returns whether it went or waits; otherwise (it does not encode, a
    /// chained one found no credit or slot, or the backlog is past its
    /// bound) the connection went down with the reason.
    pub(super) fn send_frame(&mut self, now: Duration, f: &Frame, chain: Option<(SendWr, u64)>) -> bool {
        let need = Self::credits_needed(f.kind_byte());
        let waits = !self.backlog.is_empty() && !matches!(f, Frame::Credit);
        if chain.is_none() && (waits || !self.can_send(need)) {
            return self.defer(now, f, need);
        }
        let e = if !self.can_send(need) {
            let (queue, depth) = if self.credits < need {
                ("peer receive credits", self.credits)
            } else {
                ("control send slots", self.cfg.sends())
            };
            NicError::QueueFull { queue, depth }
        } else {
            let start = self.stage_start();
            let grant = self.owed.min(u32::from(u16::MAX)) as u16;
            match f.encode_with_credit(grant, &mut self.tx[start..start + MAX_FRAME]) {
                Ok(len) => {
                    self.owed -= u32::from(grant);
                    self.granted_total += u64::from(grant);
                    self.post_staged(start, len, chain);
                    return true;
                }
                Err(e) => NicError::InvalidWr(e.to_string()),
            }
        };
        self.go_down(now, LossReason::Nic(e));
        false
    }

    /// Whether frames wait in the backlog for a send slot or credit.
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn send_slot_awaited(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// Where the next frame is staged in `tx` (room for [`MAX_FRAME`]).
    pub(super) fn stage_start(&mut self) -> usize {
        if self.commands.is_empty() {
            self.tx_used = 0; // every staged frame was taken
        }
        let start = self.tx_used;
        if self.tx.len() < start + MAX_FRAME {
            self.tx.resize(start + MAX_FRAME, 0); // grows to the peak burst, once
        }
        start
    }

    /// Queue the SEND of the frame staged at `tx[start..start + len]`
    /// (credit checked by the caller), spending a slot and a credit.
    pub(super) fn post_staged(&mut self, start: usize, len: usize, chain: Option<(SendWr, u64)>) {
        let slot = self.sends.take(Holder::Exposed).expect("a free send slot was checked");
        self.credits -= 1;
        self.tx_used = start + len;
        self.stats.frames_sent += 1;
        let offset = slot as usize * MAX_FRAME;
        let staged = Staged { offset, start: start as u32, len: len as u32 };
        let sge = SgeList::one(Sge { mr: self.res.ctrl, offset, len: len as u32 });
        let chain = match chain {
            Some((bind, send_wr_id)) => {
                if let Some(o) = &mut self.owner {
                    o.grant_sends.insert(send_wr_id, slot);
                }
                Chain::two(bind, SendWr::Send { wr_id: send_wr_id, signaled: true, sge })
            }
            None => {
                // Selective signaling: most plain frames complete without a
                // completion of their own (and so without a driver turn).
                // On shared receives (whose send slots are the endpoint's,
                // lent) a give-back and its answer go when the connection
                // is idle: signaled, their completion frees every slot
                // before them, and the lent slots go back.
                let signaled = self.unsignaled_run + 1 >= self.signal_every()
                    || (self.shared_receives && matches!(self.tx[start + 1], GIVE_BACK | RETURNED));
                self.unsignaled_run = if signaled { 0 } else { self.unsignaled_run + 1 };
                self.plain_sends.push_back(slot);
                Chain::one(SendWr::Send { wr_id: wr(TAG_SEND, u64::from(slot)), signaled, sge })
            }
        };
        self.commands.push_back(Command::PostSend { chain, frame: Some(staged) });
    }

    /// One plain frame in `signal_every` is posted signaled: half the send
    /// slots, so that when they run out a signaled one is in flight whose
    /// completion frees those before it (every frame signaled with fewer
    /// than four slots).
    pub(super) fn signal_every(&self) -> u32 {
        (self.cfg.sends() / 2).max(1)
    }

    /// A plain frame's SEND completed (or failed, or was flushed): its slot
    /// and every plain frame's posted before it are free (a send queue
    /// completes in order).
    pub(super) fn plain_send_done(&mut self, slot: u32) {
        let Some(at) = self.plain_sends.iter().position(|&s| s == slot) else {
            tracing::warn!(slot, "completion of a send slot not in flight");
            return;
        };
        for _ in 0..=at {
            if let Some(s) = self.plain_sends.pop_front() {
                self.sends.hand(s, Holder::Exposed, Holder::Free);
            }
        }
    }

    /// The most frames that may wait for credit: what this side has open
    /// (the answers to a peer within its credit, a message or two per
    /// payload it may hold, one per call or request). A backstop a peer
    /// that keeps to its credit cannot reach: see `docs/protocol.md`,
    /// "Flow control" ("Backpressure, not errors").
    fn backlog_max(&self) -> usize {
        let payloads = self.layout.slots() as usize
            + self.cfg.region_exposures as usize
            + self.cfg.max_waiting_payloads as usize;
        2 * (self.cfg.ctrl_slots as usize + payloads) + self.calls.len() + self.requests.len()
    }

    /// Keep `f` (encoded) until credit and a send slot come; past
    /// [`Connection::backlog_max`] frames the connection goes down instead.
    /// Whether `f` waits (otherwise the connection went down: for that, or
    /// because `f` does not encode).
    pub(super) fn defer(&mut self, now: Duration, f: &Frame, need: u32) -> bool {
        if self.backlog.len() >= self.backlog_max() {
            let queued = self.backlog.len();
            tracing::warn!(queued, "peer withholds receive credit");
            self.go_down(now, LossReason::PeerMisbehaved(Misbehavior::WithholdsCredit { queued }));
            return false;
        }
        let start = self.backlog_bytes.len();
        self.backlog_bytes.resize(start + MAX_FRAME, 0);
        match f.encode_into(&mut self.backlog_bytes[start..]) {
            Ok(n) => {
                self.backlog_bytes.truncate(start + n);
                self.backlog.push_back((start as u32, n as u32));
                if self.credits < need {
                    self.stats.credit_waits += 1;
                }
                true
            }
            Err(e) => {
                self.backlog_bytes.truncate(start);
                self.go_down(now, LossReason::Nic(NicError::InvalidWr(e.to_string())));
                false
            }
        }
    }

    /// Send the frames that waited, oldest first, as far as credit and
    /// send slots allow. Returns whether any went.
    pub(super) fn drain_backlog(&mut self) -> bool {
        let mut any = false;
        while let Some(&(at, len)) = self.backlog.front() {
            let (at, len) = (at as usize, len as usize);
            if !self.can_send(Self::credits_needed(self.backlog_bytes[at + 1])) {
                break;
            }
            self.backlog.pop_front();
            let start = self.stage_start();
            self.tx[start..start + len].copy_from_slice(&self.backlog_bytes[at..at + len]);
            let grant = self.owed.min(u32::from(u16::MAX)) as u16;
            self.tx[start + CREDIT_AT..start + CREDIT_AT + 2].copy_from_slice(&grant.to_le_bytes());
            self.owed -= u32::from(grant);
            self.granted_total += u64::from(grant);
            self.post_staged(start, len, None);
            any = true;
        }
        if self.backlog.is_empty() {
            self.backlog_bytes.clear();
        } else if let Some(&(first, _)) = self.backlog.front() {
            // Frames keep waiting: drop the bytes of those gone, once they
            // are most of the arena, so that it holds only the waiting ones.
            let first = first as usize;
            if first > 0 && first * 2 >= self.backlog_bytes.len() {
                self.backlog_bytes.drain(..first);
                for e in self.backlog.iter_mut() {
                    e.0 -= first as u32;
                }
            }
        }
        any
    }

    /// Grant the peer the receives posted since the last frame out, in a
    /// `Credit` frame of its own, once they are half of the share (at least
    /// 2, so that a `Credit` frame never causes another by itself): a peer
    /// that sends while we have nothing to say must not run dry. It may
    /// spend our last credit (the reserve against deadlock:
    /// `docs/protocol.md`, "Flow control").
    #[inline]
    pub(super) fn maybe_grant(&mut self) {
        let threshold = (self.share / 2).max(2);
        if self.owed >= threshold && self.down.is_none() && self.can_send(1) {
            self.stats.credit_frames += 1;
            self.send_frame(self.now, &Frame::Credit, None);
        }
    }
}
