//! Timers: the next deadline, keepalive, and what is due.

use std::time::Duration;

use super::*;

impl Connection {
    /// When [`Connection::handle_timeout`] must next be called. Ask after
    /// taking the commands (the engines run then, and may set timers).
    pub fn poll_timeout(&self) -> Option<Duration> {
        // Asked several times a driver turn: plain comparisons, no iterator
        // chain.
        fn min(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, None) => a,
                (None, b) => b,
            }
        }
        let mut t = self.owner.as_ref().and_then(|o| o.engine.poll_timeout());
        t = min(t, self.reader.as_ref().and_then(|r| r.engine.poll_timeout()));
        t = min(t, self.confirm.as_ref().and_then(ConfirmEngine::poll_timeout));
        // The oldest call's deadline is the earliest (see `Timed`).
        t = min(t, self.calls.first_deadline());
        if self.shared_receives {
            t = min(t, self.reclaim_at());
        }
        min(t, self.keepalive_at())
    }

    /// When keepalive must act next: ping `interval` after the last answer,
    /// give up `timeout` after an unanswered ping.
    pub(super) fn keepalive_at(&self) -> Option<Duration> {
        let k = self.cfg.keepalive?;
        if self.down.is_some() {
            return None;
        }
        Some(match self.ping {
            Some((_, sent)) => sent + k.timeout,
            None => self.last_answer.unwrap_or(self.now) + k.interval,
        })
    }

    pub(super) fn handle_keepalive(&mut self, now: Duration) {
        let Some(k) = self.cfg.keepalive else { return };
        if self.down.is_some() {
            return;
        }
        let answered = *self.last_answer.get_or_insert(now);
        match self.ping {
            Some((_, sent)) if now >= sent + k.timeout => {
                let silent = now.saturating_sub(answered);
                self.go_down(now, LossReason::PeerUnresponsive { silent });
            }
            Some(_) => {}
            None if now >= answered + k.interval => {
                let seq = self.next_ping;
                // (Without a send slot or credit it waits in the backlog.)
                if self.send_frame(now, &Frame::Ping { seq }, None) {
                    self.next_ping += 1;
                    self.ping = Some((seq, now));
                }
            }
            None => {}
        }
    }

    /// Time has reached `now`: fire the engines' timers and call deadlines.
    pub fn handle_timeout(&mut self, now: Duration) {
        let now = self.advance(now);
        // A call out of time whose reply came but whose payload found no
        // free buffer says so (the user's buffers, not the server, are
        // the matter); asked before the engines' timers end its fetch.
        loop {
            let starved = self.calls.expired(now).find_map(|m| self.waits_for_buffer(m).map(|len| (m, len)));
            let Some((msg, len)) = starved else { break };
            self.abandon_call(now, msg, CallError::NoBuffer(len));
        }
        if let Some(o) = &mut self.owner {
            if o.engine.poll_timeout().is_some_and(|t| t <= now) {
                o.engine.handle_timeout(now);
            }
        }
        if let Some(r) = &mut self.reader {
            if r.engine.poll_timeout().is_some_and(|t| t <= now) {
                r.engine.handle_timeout(now);
            }
        }
        if let Some(c) = &mut self.confirm {
            c.handle_timeout(now);
        }
        // Oldest first: deadlines grow with message ids (see poll_timeout).
        while let Some(msg) = self.calls.first_expired(now) {
            self.abandon_call(now, msg, CallError::TimedOut);
        }
        self.handle_keepalive(now);
        if self.shared_receives {
            self.handle_reclaim(now);
        }
        self.dirty = true;
    }
}
