//! The hub's driver loop ([`Hub::run`]; what it does: the hub's module docs).

use std::collections::BinaryHeap;
use std::future::poll_fn;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use super::{EndpointStats, Hub, POLL_BATCH};
use crate::backend::{Completion, Nic, NicError};
use crate::conn::hub::HubPart;
use crate::conn::live::Inner;

/// A connection's next timer, in the hub's heap (earliest first).
struct Due<N: Nic> {
    at: Duration,
    conn: Weak<Inner<N>>,
}

impl<N: Nic> PartialEq for Due<N> {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at
    }
}
impl<N: Nic> Eq for Due<N> {}
impl<N: Nic> PartialOrd for Due<N> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl<N: Nic> Ord for Due<N> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.at.cmp(&self.at) // reversed: BinaryHeap is a max-heap
    }
}

impl<N: Nic> Hub<N> {
    /// Drive every connection on the hub; ends once the hub is closed
    /// ([`Hub::close`]) and every connection has finished. Returns the hub's
    /// final counts. `after_turns` runs after each loop's turns, unless
    /// that loop ended the driver (the endpoint's bootstrap streams: rung
    /// through their waker, `WatchWake` in endpoint.rs, it finds what woke them).
    pub async fn run(self: Arc<Self>, mut after_turns: impl FnMut()) -> EndpointStats {
        let shared = &*self;
        let mut timers: BinaryHeap<Due<N>> = BinaryHeap::new();
        let mut work: Vec<Arc<Inner<N>>> = Vec::new();
        let mut inbox: Vec<Completion> = Vec::with_capacity(POLL_BATCH);
        let mut alarm = crate::conn::alarm::Alarm::with_slot();
        // When the alarm rings (since the hub's epoch), while it is armed.
        let mut armed: Option<Duration> = None;
        // The waker the driver left in its doorbell (its only poller).
        let mut bell_waker: Option<std::task::Waker> = None;
        // Set once the queue failed (its device is gone): it is polled no
        // more, and every connection on it is taken down.
        let mut failed: Option<NicError> = None;
        // The `added` count when the connections were last taken down
        // after the failure.
        let mut swept_at: Option<u64> = None;
        // Since when turns have found nothing (for the busy-poll window),
        // and how many have (for `live::idle_turn`).
        let mut idle_since: Option<Duration> = None;
        let mut idle_turns = 0u32;
        loop {
            shared.ready.bell().take();
            // Counters with one writer, the driver: no locked add.
            shared.turns.store(shared.turns.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            // One clock read a loop: the turns' time and the busy-poll window's.
            let now = shared.epoch.now();
            let mut busy = false;
            if failed.is_none() {
                let polled = shared.poll(&mut shared.routes.lock(), false);
                match polled {
                    Ok((n, queued)) => {
                        // Completions that only wait for their connection's
                        // next turn are no work for this loop.
                        busy |= queued > 0;
                        if let Some(srq) = shared.srq.as_ref().filter(|_| n > 0) {
                            // Receives were taken: most in use at once?
                            srq.check_limit();
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%e, "the hub's completion queue failed; its connections go down");
                        failed = Some(e);
                    }
                }
            }
            let added = shared.added.load(Ordering::Relaxed);
            if let Some(e) = failed.as_ref().filter(|_| swept_at != Some(added)) {
                // Every connection, once, and again only when more were
                // added since: each goes down with the error and ends by
                // its flush grace (no flush can come), its QP destroyed as
                // evidence.
                swept_at = Some(added);
                let conns: Vec<Arc<Inner<N>>> = shared.routes.lock().targets().cloned().collect();
                for c in conns {
                    if c.cq_failed(e) {
                        shared.queue(&c);
                    }
                }
            }
            while timers.peek().is_some_and(|d| d.at <= now) {
                let d = timers.pop().expect("peeked");
                if let Some(c) = d.conn.upgrade() {
                    shared.queue(&c);
                }
            }
            shared.ready.take(&mut work);
            for inner in &work {
                busy = true;
                // Windows invalidated by a SEND_WITH_INV this poll, or a
                // turn's retire, found: their owners hear of it first.
                self.invalidations_found(now);
                self.turn(inner, now, &mut inbox, &mut timers);
            }
            work.clear();
            if shared.closed.load(Ordering::Acquire) && shared.routes.lock().is_empty() {
                shared.ready.bell().forget_waker();
                return shared.stats();
            }
            after_turns();
            if busy {
                // Yield, then loop again: what came meanwhile is found by
                // polling, not by a sleep and a wake-up (which on a
                // multi-threaded executor crosses threads per completion).
                idle_since = None;
                crate::conn::live::yield_now().await;
                continue;
            }
            // Read after this loop took the doorbell: a waiter that stops
            // from now on rings it (and the sleep below sees the ring), or
            // leaves a window open, read next (`ReadyList::stop`).
            let waiter_polls = shared.ready.waiter_polls();
            // Until when the queue counts as watched: a long window's end.
            let watched = shared.ready.watched(now);
            let unpolled = waiter_polls || watched.is_some();
            // A waiter polling the queue: one polling thread is enough.
            if !shared.busy_poll.is_zero() && failed.is_none() && !unpolled {
                let idle = *idle_since.get_or_insert(now);
                if now.saturating_sub(idle) < shared.busy_poll {
                    crate::conn::live::idle_turn(&mut idle_turns);
                    crate::conn::live::yield_now().await;
                    continue;
                }
            }
            idle_since = None;
            // The alarm rings for the earliest timer, or the end of the
            // long window if that is earlier; armed only when earlier than
            // it is (an earlier deadline wins; a later one would change
            // nothing).
            let wake = match (timers.peek().map(|d| d.at), watched) {
                (Some(t), Some(w)) => Some(t.min(w)),
                (t, w) => t.or(w),
            };
            if let Some(at) = wake.filter(|at| armed.map_or(true, |a| *at < a)) {
                alarm.arm(Some(shared.epoch.instant(at)));
                armed = Some(at);
            }
            // The arm is left off while a waiter polls: its polls find the
            // completions (and ring for the other connections'), and an
            // armed queue would raise an event, a system call and a
            // wake-up, for each. The last waiter to stop rings the
            // doorbell, or once the long window ends the alarm above wakes
            // the driver, which polls and, with no waiter left, arms it.
            let cq_gone = failed.is_some() || unpolled;
            let mut slept = false;
            poll_fn(|cx: &mut Context<'_>| {
                if shared.ready.bell().poll_rung_held(cx, &mut bell_waker).is_ready() {
                    return Poll::Ready(());
                }
                if !cq_gone && shared.hold.nic.poll_cq_ready(shared.hold.cq, cx).is_ready() {
                    return Poll::Ready(());
                }
                if alarm.poll(cx).is_ready() {
                    // Rung, and disarmed.
                    armed = None;
                    return Poll::Ready(());
                }
                if !slept {
                    slept = true;
                    shared.sleeps.fetch_add(1, Ordering::Relaxed);
                }
                Poll::Pending
            })
            .await;
        }
    }

    /// One connection's turn, with the completions routed to it.
    fn turn(
        &self,
        inner: &Arc<Inner<N>>,
        now: Duration,
        inbox: &mut Vec<Completion>,
        timers: &mut BinaryHeap<Due<N>>,
    ) {
        let part: &HubPart<N> = &inner.hub;
        // Cleared before the turn takes the connection's lock: whatever the
        // user does and rings for from now on queues it again
        // (`Inner::ring`), and what it did before, this turn sees.
        part.queued.clear();
        // `inbox` trades places with the routed completions (`Inner::turn`).
        let t = inner.turn(now, inbox, |st, next| {
            // A heap entry at or before now has fired (this turn may be
            // its): it arms nothing any more, and a deadline set from now on
            // (a call) rings the driver to be armed (`State::needs_driver`).
            if st.driver_next.is_some_and(|armed| armed <= now) {
                st.driver_next = None;
            }
            let Some(next) = next else { return };
            // A heap entry at or before `next`, still ahead, serves.
            if st.driver_next.is_some_and(|armed| armed <= next) {
                return;
            }
            timers.push(Due { at: next, conn: Arc::downgrade(inner) });
            st.driver_next = Some(next);
        });
        inbox.clear();
        inner.count_turn(t.busy);
        self.connection_turns.store(self.connection_turns.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        // A holder may have revoked a delegation on this turn.
        self.ring_ends();
    }

    /// The peer of `from` (or of a QP with no connection yet, or stuck:
    /// `None`) invalidated `rkey` with a SEND_WITH_INV, which the protocol
    /// never sends. If the rkey is another connection's window (rxe lets
    /// any queue pair reach any window of the device), find it: its one
    /// invalidation has happened, so it must never post another (on rxe a
    /// second one panics the kernel), and it goes down. `from`'s own
    /// window, if it was one, is `from`'s to handle on its turn, which
    /// closes it as misbehaving either way. A search of every connection,
    /// only ever run for a hostile peer; run when a poll finds the
    /// completion, before any connection's next turn
    /// ([`Hub::invalidations_found`]).
    #[inline(never)]
    pub(super) fn invalidated_elsewhere(&self, from: Option<&Inner<N>>, now: Duration, rkey: u32) {
        let conns: Vec<Arc<Inner<N>>> = self.routes.lock().targets().cloned().collect();
        let owner = conns.iter().find(|c| {
            from.map_or(true, |f| !std::ptr::eq(Arc::as_ptr(c), f))
                && c.window_invalidated_elsewhere(now, rkey)
        });
        match owner {
            Some(c) => self.queue(c),
            // (With `from`, the rkey may be its own window's.)
            None if from.is_none() => {
                tracing::warn!(rkey, "a peer invalidated a window of no connection of this endpoint")
            }
            None => {}
        }
    }
}
