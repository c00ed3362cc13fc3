//! Flow control past credit: a connection's share of a shared receive
//! queue (its grants, the receives withheld, the give-back of an idle
//! peer's credit: `docs/protocol.md`, "Flow control"), and the requests
//! refused past `Config::max_requests`.

use std::time::Duration;

use super::super::frame::{Frame, RawAttaches, MIN_START_CREDITS};
use super::*;

impl Connection {
    /// [`Connection::start`] for a QP that takes its receives from a
    /// shared receive queue its owner posts (an endpoint with shared
    /// receives): nothing is posted here, the peer may send
    /// `Config::start_credits` frames, and the connection's share of the
    /// queue is that many until the owner changes it. A received frame's
    /// receive is not re-granted by itself: the owner calls
    /// [`Connection::grant_receives`] (or [`Connection::withhold_receive`])
    /// for each.
    ///
    /// Its completions come as `SHARED_RECV_WR_ID` (see `Link::shared_receive`).
    pub(crate) fn start_shared(&mut self, peer_credits: u32) {
        self.shared_receives = true;
        self.credits = peer_credits;
        self.share = self.cfg.start_credits;
        self.owed = 0;
    }

    /// Shared receives: grant the peer `n` more receives (its share grows
    /// by `n - 1` when called for one received frame with `n` above 1).
    /// They go with the next frame out, or in a `Credit` frame once they
    /// are half the share.
    pub(crate) fn grant_receives(&mut self, n: u32, grows: u32) {
        self.owed += n;
        self.share += grows;
        self.dirty = true;
        self.maybe_grant();
    }

    /// Shared receives: whether a `GiveBack` of this side is unanswered.
    pub(crate) fn giving_back(&self) -> bool {
        self.giving_back.is_some()
    }

    /// Shared receives: the credits the peer gave back since the last
    /// call (the share shrank by as many): the owner of the queue takes
    /// them back.
    pub(crate) fn take_returned(&mut self) -> u32 {
        std::mem::take(&mut self.returned)
    }

    /// Shared receives: the receive of a frame just received goes back to
    /// the owner instead of the peer (the share shrinks by one). Refused
    /// (false) at `Config::start_credits`: the peer was promised that many.
    pub(crate) fn withhold_receive(&mut self) -> bool {
        if self.share <= self.cfg.start_credits {
            return false;
        }
        self.share -= 1;
        true
    }

    /// The receives this side keeps for its peer (see `share`).
    pub(crate) fn receive_share(&self) -> u32 {
        self.share
    }

    /// Whether the connection started on a shared receive queue
    /// ([`Connection::start_shared`]).
    pub(crate) fn takes_shared_receives(&self) -> bool {
        self.shared_receives
    }

    /// Shared receives: when to ask an idle peer to give back the credit
    /// it holds past the start credits (`Config::give_back_after` after its
    /// last frame), if it holds any and is not asked already; once asked,
    /// when the answer is due: with keepalive on, its `timeout` after the
    /// asking (an unanswered give-back is an unanswered ping); with it
    /// off, never (a peer whose driver shares a thread with a busy
    /// application may answer seconds later, and only keepalive says how
    /// long a peer may be silent).
    #[cold]
    pub(super) fn reclaim_at(&self) -> Option<Duration> {
        if !self.shared_receives || self.down.is_some() {
            return None;
        }
        if let Some(asked) = self.giving_back {
            return self.cfg.keepalive.and_then(|k| asked.checked_add(k.timeout));
        }
        if self.share <= self.cfg.start_credits {
            return None;
        }
        self.last_frame_at.checked_add(self.cfg.give_back_after)
    }

    /// Ask an idle peer for its credit back, or, when its answer is
    /// overdue, give up on the peer: it keeps the credit and may spend it
    /// any time, so only its QP's destroy takes the receives back for the
    /// other connections of the queue.
    #[cold]
    pub(super) fn handle_reclaim(&mut self, now: Duration) {
        if !self.reclaim_at().is_some_and(|t| now >= t) {
            return;
        }
        match self.giving_back {
            Some(asked) => {
                tracing::debug!(
                    share = self.share,
                    "a give-back went unanswered: the peer is declared unresponsive"
                );
                self.go_down(now, LossReason::PeerUnresponsive { silent: now.saturating_sub(asked) });
            }
            None => {
                let keep = self.cfg.start_credits;
                // (Without credit or a send slot it waits in the backlog.)
                if self.send_frame(now, &Frame::GiveBack { keep }, None) {
                    self.giving_back = Some(now);
                }
            }
        }
    }

    /// Server: `Config::max_requests` of the connection's requests are
    /// unanswered, and `msg` is refused unread. It is never recorded: its
    /// attachments meet no request, so a window grant for its payload is
    /// released unread, and a confirm exposure or fetch is neither read
    /// nor answered (the client ends them as the call fails). Others
    /// riding along (releases, fetches of earlier messages) are handled as
    /// ever. An inline payload is dropped with the frame.
    #[cold]
    #[inline(never)]
    pub(super) fn refuse_busy(&mut self, now: Duration, msg: u64, attach: RawAttaches<'_>) {
        tracing::debug!(req = msg, limit = self.cfg.max_requests, "request refused: too many unanswered");
        self.stats.requests_busy += 1;
        if !self.on_attaches(now, msg, attach) {
            return;
        }
        self.answer_busy(now, msg);
    }

    /// Server: request `msg`, refused past `Config::max_requests`, is
    /// answered with a `Busy` frame.
    pub(super) fn answer_busy(&mut self, now: Duration, msg: u64) {
        let limit = self.cfg.max_requests;
        self.send_frame(now, &Frame::Busy { msg_id: msg, limit }, None);
    }

    /// The peer, on shared receives, asks for its credit back: keep
    /// `keep` (at least `MIN_START_CREDITS`, whatever it says), give back
    /// the rest at once, and say how many in a `Returned` frame (which
    /// spends one of those kept, as any frame).
    #[cold]
    #[inline(never)]
    pub(super) fn give_back(&mut self, now: Duration, keep: u32) {
        let count = self.credits.saturating_sub(keep.max(MIN_START_CREDITS));
        self.credits -= count;
        self.stats.credits_returned += u64::from(count);
        self.send_frame(now, &Frame::Returned { count }, None);
    }

    /// The peer gave back `count` credits, answering our `GiveBack`: the
    /// share shrinks by as many (never below the start credits), and so
    /// does the credit it may use. A `Returned` nobody asked for, or more
    /// than it could hold, breaks the protocol.
    #[cold]
    #[inline(never)]
    pub(super) fn on_returned(&mut self, now: Duration, count: u32) {
        let most = self.share.saturating_sub(self.cfg.start_credits);
        if self.giving_back.is_none() || !self.shared_receives || count > most {
            let asked = self.giving_back.is_some() && self.shared_receives;
            return self
                .misbehaved(now, Misbehavior::BadReturn { count, most: if asked { most } else { 0 } });
        }
        self.giving_back = None;
        self.share -= count;
        self.granted_total -= u64::from(count);
        self.returned += count;
    }
}
