//! What each queue pair has outstanding, so that error and flush
//! completions (whose `opcode` the verbs spec leaves undefined) report the
//! opcode that was posted.

use std::collections::VecDeque;

use crate::backend::{Completion, WcOpcode};

/// The work requests a queue pair has outstanding, oldest first, at most
/// `cap` per queue. Both queues are allocated at their full capacity when
/// the QP is created and never grow: at `cap` the oldest record is dropped
/// (it belongs to an unsignaled request that completed long ago).
pub(super) struct Track {
    sq: VecDeque<(u64, WcOpcode)>,
    rq: VecDeque<u64>,
    cap: usize,
    /// The QP takes its receives from a shared receive queue: none are
    /// recorded here, and every receive completion is one of the SRQ's.
    srq: bool,
}

impl Track {
    /// Room for `cap` records per queue (twice the deeper queue is plenty:
    /// a record leaves when its or a later request's completion is polled).
    pub(super) fn new(cap: usize) -> Track {
        let cap = cap.max(1);
        Track { sq: VecDeque::with_capacity(cap), rq: VecDeque::with_capacity(cap), cap, srq: false }
    }

    /// Room for `cap` send-queue records, for a queue pair whose receives
    /// come from a shared receive queue (nothing is posted to its own).
    pub(super) fn with_srq(cap: usize) -> Track {
        let cap = cap.max(1);
        Track { sq: VecDeque::with_capacity(cap), rq: VecDeque::new(), cap, srq: true }
    }

    /// Record a send-queue request about to be posted.
    pub(super) fn push_sq(&mut self, wr_id: u64, op: WcOpcode) {
        if self.sq.len() >= self.cap {
            self.sq.pop_front();
        }
        self.sq.push_back((wr_id, op));
    }

    /// Forget the newest `n` send-queue records (requests the provider refused).
    pub(super) fn unpush_sq(&mut self, n: usize) {
        let keep = self.sq.len().saturating_sub(n);
        self.sq.truncate(keep);
    }

    /// Record a receive about to be posted.
    pub(super) fn push_rq(&mut self, wr_id: u64) {
        if self.rq.len() >= self.cap {
            self.rq.pop_front();
        }
        self.rq.push_back(wr_id);
    }

    /// Forget the newest receive record (the provider refused it).
    pub(super) fn unpush_rq(&mut self) {
        self.rq.pop_back();
    }

    /// Match a completion with what was posted; fill in the opcode of
    /// unsuccessful ones. `from_sq`: Some(true) if it can only be a send
    /// completion, Some(false) if only a receive, None if unknown.
    /// Completions of a queue arrive in posting order, so everything before
    /// the match (unsignaled requests) is done too and is dropped.
    pub(super) fn settle(&mut self, c: &mut Completion, from_sq: Option<bool>) {
        let in_sq = self.sq.iter().position(|(id, _)| *id == c.wr_id);
        let sq_side = match from_sq {
            Some(side) => side,
            None if c.status.is_success() => c.opcode != WcOpcode::Recv,
            None => in_sq.is_some(),
        };
        if sq_side {
            if let Some(p) = in_sq {
                if !c.status.is_success() {
                    c.opcode = self.sq[p].1;
                }
                self.sq.drain(..=p);
            }
        } else if self.srq {
            // One of the shared receive queue's receives.
            if !c.status.is_success() {
                c.opcode = WcOpcode::Recv;
            }
        } else if let Some(p) = self.rq.iter().position(|id| *id == c.wr_id) {
            if !c.status.is_success() {
                c.opcode = WcOpcode::Recv;
            }
            self.rq.drain(..=p);
        }
    }

    #[cfg(test)]
    fn capacities(&self) -> (usize, usize) {
        (self.sq.capacity(), self.rq.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::WcStatus;

    fn flushed(wr_id: u64) -> Completion {
        Completion { wr_id, status: WcStatus::WrFlushErr, opcode: WcOpcode::Other(0), ..Completion::EMPTY }
    }

    #[test]
    fn flushes_get_the_posted_opcode_and_records_never_grow_the_queues() {
        let mut t = Track::new(4);
        let caps = t.capacities();
        for i in 0..100 {
            t.push_sq(i, WcOpcode::RdmaRead);
            t.push_rq(i);
        }
        assert_eq!(t.capacities(), caps, "at capacity the oldest record goes, the queue does not grow");
        t.push_sq(7, WcOpcode::BindMw);
        t.push_sq(8, WcOpcode::Send);
        let mut c = flushed(8);
        t.settle(&mut c, Some(true));
        assert_eq!(c.opcode, WcOpcode::Send);
        assert!(t.sq.is_empty(), "the unsignaled bind before it is done too");
        let mut c = flushed(99);
        t.settle(&mut c, None);
        assert_eq!(c.opcode, WcOpcode::Recv, "not in the send queue: a receive");
        t.push_sq(1, WcOpcode::LocalInv);
        t.push_sq(2, WcOpcode::Send);
        t.unpush_sq(1);
        let mut c = flushed(2);
        t.settle(&mut c, Some(true));
        assert_eq!(c.opcode, WcOpcode::Other(0), "a refused request is forgotten");
    }

    #[test]
    fn a_failed_receive_of_a_shared_queue_is_a_receive() {
        let mut t = Track::with_srq(4);
        t.push_sq(5, WcOpcode::Send);
        let mut c = flushed(40);
        t.settle(&mut c, None);
        assert_eq!(c.opcode, WcOpcode::Recv, "not in the send queue: the SRQ's");
        let mut c = flushed(5);
        t.settle(&mut c, None);
        assert_eq!(c.opcode, WcOpcode::Send);
        let mut c = flushed(41);
        t.settle(&mut c, Some(false));
        assert_eq!(c.opcode, WcOpcode::Recv);
    }
}
