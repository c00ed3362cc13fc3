//! A connection's turns (taken by its hub's driver), and a call that
//! takes its connection's turns while it waits (see the module docs of
//! `live`).

use super::*;

/// The turns its endpoint's driver took for a connection so far. Turns a
/// waiting call (or `next_request`) takes itself in its busy-poll window
/// are not counted (only the driver writes these counts). An idle
/// connection takes none; the endpoint's sleeps are in its
/// [`EndpointStats`](crate::conn::EndpointStats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverStats {
    /// Turns taken (take its completions, run the engines, hand out events).
    pub turns: u64,
    /// Turns that found something to do.
    pub busy_turns: u64,
}

#[derive(Default)]
pub(crate) struct DriverCounters {
    pub(crate) turns: std::sync::atomic::AtomicU64,
    pub(crate) busy_turns: std::sync::atomic::AtomicU64,
}

/// A call in flight: the result's handle, and a kick for the driver when the
/// caller gives up (so a sleeping driver cancels the call at once). While
/// its reply has not come it spins ([`Spin`]) for up to `Config::busy_poll`,
/// then waits for the driver.
pub(crate) struct CallFuture<'a, N: Nic> {
    pub(crate) handle: Handle<CallResult>,
    /// The connection (borrowed from the caller's handle for the call).
    pub(crate) inner: &'a Inner<N>,
    pub(crate) done: bool,
    /// Its turns while it waits.
    pub(crate) spin: Spin,
}

/// A waiter (a call for its reply, a serving loop for its next request)
/// that takes its connection's turns itself for a while: it polls the
/// hub's shared completion queue on its own thread, so what it waits for
/// is found there instead of by the driver, which on another thread would
/// have to wake it. At most one waiter of a connection spins at a time.
#[derive(Default)]
pub(crate) struct Spin {
    /// When the waiter stops taking turns itself: a window after its first
    /// wait, opened again by every turn of its connection that found
    /// something to do (a call of several steps, such as a confirm read's
    /// READ and confirm, spins through them while the peer answers each
    /// within the window).
    until: Option<Duration>,
    /// This waiter holds `Inner::spinning`.
    spinning: bool,
    /// Its window is long ([`LINGER_MIN`](crate::conn::ready::LINGER_MIN)
    /// or more): it publishes the window's end, and leaves without waking
    /// the driver once it got what it waited for.
    long: bool,
    /// Turns taken while spinning that found nothing (see [`OS_YIELD_EVERY`]).
    idle: u32,
}

/// A thread that busy-polls (a call taking its connection's turns, or the
/// endpoint's driver in its busy-poll window) gives its CPU up to the OS
/// (`std::thread::yield_now`) once every this many turns that found
/// nothing: on a host with fewer free cores than busy threads, the thread
/// it waits for would otherwise get a core only when the spin window ends.
/// A `sched_yield` with nothing else to run returns at once.
pub(crate) const OS_YIELD_EVERY: u32 = 16;

/// Count one turn that found nothing, and give the CPU up to the OS once
/// every [`OS_YIELD_EVERY`].
#[inline]
pub(crate) fn idle_turn(idle: &mut u32) {
    *idle = idle.wrapping_add(1);
    if *idle % OS_YIELD_EVERY == 0 {
        std::thread::yield_now();
    }
}

impl Spin {
    /// The waiter no longer takes turns itself; `got` says whether it got
    /// what it waited for (the last to stop: `ReadyList::stop`).
    #[inline(always)]
    pub(crate) fn stop<N: Nic>(&mut self, inner: &Inner<N>, got: bool) {
        if self.spinning {
            self.stopped(inner, got);
        }
    }

    /// [`Spin::stop`] of a waiter that spins (out of line: most never do).
    #[inline(never)]
    fn stopped<N: Nic>(&mut self, inner: &Inner<N>, got: bool) {
        self.spinning = false;
        inner.spinning.store(false, std::sync::atomic::Ordering::Release);
        if let Some(hub) = inner.hub.hub.upgrade() {
            hub.ready.stop(self.long && got, || inner.now());
        }
    }
}

impl<N: Nic> Future for CallFuture<'_, N> {
    type Output = CallResult;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<CallResult> {
        let this = self.get_mut();
        let handle = &mut this.handle;
        let r = this.spin.wait(this.inner, this.inner.spin, cx, |cx| Pin::new(&mut *handle).poll(cx));
        if r.is_ready() {
            this.done = true;
        }
        r
    }
}

impl Spin {
    /// A waiter's poll: what `take` finds; if nothing, a turn of the
    /// connection taken here while the `window` allows (then the waiter
    /// yields and looks again), and otherwise the wait for the driver.
    #[inline]
    pub(crate) fn wait<N: Nic, T>(
        &mut self,
        inner: &Inner<N>,
        window: Duration,
        cx: &mut Context<'_>,
        mut take: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        let mut r = take(cx);
        if r.is_pending() && !window.is_zero() && self.turn(inner, window) {
            r = take(cx);
            if r.is_pending() {
                // Yield, then look again.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        self.stop(inner, r.is_ready());
        r
    }

    /// Start spinning, with the window ending at `until`, unless another
    /// waiter of the connection spins: counted by the hub, the queue is
    /// the waiter's to poll. Whether it spins now.
    fn enter<N: Nic>(
        &mut self,
        inner: &Inner<N>,
        hub: Option<&crate::conn::hub::Hub<N>>,
        window: Duration,
        until: Duration,
        now: Duration,
    ) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        if inner.spinning.compare_exchange(false, true, AcqRel, Acquire).is_err() {
            return false;
        }
        self.spinning = true;
        self.long = window >= crate::conn::ready::LINGER_MIN;
        if let Some(hub) = hub {
            hub.ready.start(self.long.then_some((until, now)));
        }
        true
    }

    /// While the waiter may spin (its `window` is open and no other waiter
    /// of the connection spins): take a turn of the connection and return
    /// true.
    #[inline(never)]
    pub(crate) fn turn<N: Nic>(&mut self, inner: &Inner<N>, window: Duration) -> bool {
        // The connection's clock (its endpoint's), read once for the turn.
        let now = inner.now();
        let until = *self.until.get_or_insert(now + window);
        if now >= until {
            return false;
        }
        let hub = inner.hub.hub.upgrade();
        if !self.spinning && !self.enter(inner, hub.as_deref(), window, until, now) {
            return false;
        }
        let part = &inner.hub;
        // Poll the shared queue (our completions come to our inbox, the
        // others' to theirs, queued for the hub's driver), then take our
        // turn with what came.
        if let Some(hub) = &hub {
            hub.poll_for(inner);
            // Windows a SEND_WITH_INV invalidated: their owners hear of it
            // before this turn (`Hub::invalidations_found`).
            hub.invalidations_found(now);
        }
        // The spinner's own vector trades places with the inbox (`Hub::add`).
        let mut inbox = std::mem::take(&mut *part.spin_scratch.lock());
        // The clock read above, not a second one.
        let t = inner.turn(now, &mut inbox, |st, next| {
            // The hub's timer heap must hold a deadline no later than
            // `next`: a turn by the driver puts it there.
            if next.is_some_and(|t| !matches!(st.driver_next, Some(armed) if armed <= t)) {
                part.waker.wake_by_ref();
            }
        });
        inbox.clear();
        *part.spin_scratch.lock() = inbox;
        if let Some(hub) = &hub {
            // A holder's revocation answered on this turn rings the
            // connections exposing what it revoked, as the driver's would.
            hub.ring_ends();
        }
        if t.finished {
            // Finished in this turn, which retired it and folded its
            // figures: the driver's turn this queues finds nothing left to
            // do (kept as a wake-up that costs one idle turn, once).
            part.waker.wake_by_ref();
        }
        if t.busy {
            self.until = Some(now + window);
            if let Some(hub) = hub.as_ref().filter(|_| self.long) {
                hub.ready.extend(now + window);
            }
        } else {
            idle_turn(&mut self.idle);
        }
        true
    }
}

/// [`Connection::next_request`] waiting with a spin window: the next
/// request, or `None` once the connection is down and no request is left.
pub(crate) struct NextRequest<'a, N: Nic> {
    pub(crate) inner: &'a Inner<N>,
    pub(crate) spin: Spin,
}

impl<N: Nic> NextRequest<'_, N> {
    /// A request, or the end, if either is there.
    #[inline]
    pub(crate) fn take(inner: &Inner<N>, cx: &mut Context<'_>) -> Poll<Option<Request>> {
        let mut st = inner.state.lock();
        if let Some(r) = st.requests.pop_front() {
            return Poll::Ready(Some(r));
        }
        if st.down.is_some() {
            return Poll::Ready(None);
        }
        st.request_waiters.register(cx.waker());
        Poll::Pending
    }
}

impl<N: Nic> Future for NextRequest<'_, N> {
    type Output = Option<Request>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Request>> {
        let this = self.get_mut();
        let inner = this.inner;
        this.spin.wait(inner, inner.serve_spin, cx, |cx| NextRequest::take(inner, cx))
    }
}

impl<N: Nic> Drop for NextRequest<'_, N> {
    fn drop(&mut self) {
        self.spin.stop(self.inner, false);
    }
}

impl<N: Nic> Drop for CallFuture<'_, N> {
    fn drop(&mut self) {
        self.spin.stop(self.inner, false);
        if !self.done {
            // Mark the slot abandoned first, then ring: the driver's next
            // turn sees the abandonment and cancels the call.
            let handle =
                std::mem::replace(&mut self.handle, Handle::new(Slot::new(), self.inner.recycle.clone()));
            drop(handle);
            self.inner.abandoned.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            self.inner.ring();
        }
    }
}

impl<N: Nic> State<N> {
    /// A slot for a new call: a finished call's, if its handle is gone.
    pub(crate) fn spare_slot(&mut self) -> Arc<Slot<CallResult>> {
        if let Some(i) = self.spare_slots.iter().position(|s| Arc::strong_count(s) == 1) {
            let slot = self.spare_slots.swap_remove(i);
            slot.reset();
            return slot;
        }
        Slot::new()
    }

    pub(crate) fn dispatch(&mut self, ev: Event) {
        match ev {
            Event::Reply { call, status, header, data } => {
                self.finish(call, Ok(Reply { status, header, data }))
            }
            Event::CallFailed { call, error } => self.finish(call, Err(error)),
            Event::Request { req, header, data, trace, delegated } => {
                self.requests.push_back(Request { id: req, header, data, trace, again: false, delegated });
                self.request_waiters.wake_all();
            }
            Event::ReplyAgain { req, header, trace } => {
                // Confirm policy: the client read a stale reply. The request
                // comes again (same id, header and trace, no payload).
                self.requests.push_back(Request {
                    id: req,
                    header,
                    data: None,
                    trace,
                    again: true,
                    delegated: false,
                });
                self.request_waiters.wake_all();
            }
            Event::RequestDropped { req, error } => tracing::info!(?req, %error, "request dropped"),
            // Its link answers a redemption itself (`Link::poll_event`).
            Event::Ask { .. } => {}
            // No remote access to it is possible any more: back to the pool.
            Event::BufferReturned(b) => self.ep.free(b),
            // A user range may be written again: writers waiting for it retry.
            Event::RangeReturned { .. } => self.wake_capacity(),
            Event::ConnectionLost(r) => {
                self.down = Some(r);
                self.request_waiters.wake_all();
                self.wake_capacity();
                self.closed_waiters.wake_all();
            }
        }
    }

    pub(crate) fn finish(&mut self, call: CallId, result: CallResult) {
        match self.calls.remove(&call) {
            Some(slot) => {
                if let Err(Ok(reply)) = slot.fulfil(result) {
                    // The caller gave up: its reply buffer goes back to the pool.
                    if let Some(b) = reply.data {
                        self.ep.free(b);
                    }
                }
                if self.spare_slots.len() < self.spare_slots.capacity() {
                    self.spare_slots.push(slot);
                }
            }
            None => {
                if let Ok(Reply { data: Some(b), .. }) = result {
                    self.ep.free(b);
                }
            }
        }
    }
}

/// Returns `Pending` once, after asking to be polled again: lets the
/// executor run other tasks. (`futures::future::ready(())` does not yield.)
pub(crate) struct YieldNow(bool);

/// Yield to the executor once (it polls other tasks, then this one again).
pub(crate) fn yield_now() -> YieldNow {
    YieldNow(false)
}

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// What one turn of the driver found.
pub(crate) struct Turn {
    /// Anything happened.
    pub(crate) busy: bool,
    /// The connection is down, closed and every buffer is back.
    pub(crate) finished: bool,
}

impl<N: Nic> Inner<N> {
    /// Add its figures to `tally` unless they are in the hub's tally of
    /// finished connections as of `epoch` (telemetry).
    pub(crate) fn tally_into(&self, epoch: u64, tally: &mut crate::telemetry::Tally) {
        let st = self.state.lock();
        if !st.folded.is_some_and(|e| e <= epoch) {
            tally.add(&st.ep.counts());
        }
    }

    /// One turn of the connection at `now`, with the completions of its QP
    /// the hub routed to its inbox: they are swapped into `inbox` (an empty
    /// vector, whose capacity the inbox gets) under the state lock, so two
    /// turns on two threads (the driver's and a spinning waiter's) handle
    /// them in the order the queue gave them. `arm` is called under the
    /// state lock with when the next turn is due.
    pub(crate) fn turn(
        &self,
        now: Duration,
        inbox: &mut Vec<crate::backend::Completion>,
        arm: impl FnOnce(&mut State<N>, Option<Duration>),
    ) -> Turn {
        let inner = self;
        let mut st = inner.state.lock();
        // Taken only now (see above): a turn that took it earlier could handle
        // a request before the one sent ahead of it, as if the peer misbehaved.
        std::mem::swap(&mut *inner.hub.inbox.lock(), inbox);
        let completions = &inbox[..];
        if let Some(why) = st.closing.clone().filter(|_| st.ep.is_down().is_none()) {
            st.ep.peer_lost(now, why);
        }
        let mut busy = st.ep.reclaim() > 0;
        // Completions first, then timers: a READ that completed in time, or
        // a release that came in time, whose turn came late, is not taken
        // for one past its deadline (the reader would flush a healthy QP).
        if !completions.is_empty() {
            st.ep.handle_completions(now, completions);
            busy = true;
        }
        // A deadline at or before now has its entry in the hub's timer heap
        // due (`driver_next`): every deadline is armed there, or rings the
        // driver to arm it (`State::needs_driver`, the turn's `arm`), so one
        // not looked for here (a deadline earlier than the armed entry, now
        // past) is found one driver loop later, never lost.
        #[allow(clippy::unnecessary_map_or)] // `is_none_or`: Rust 1.82
        let due = st.driver_next.map_or(true, |armed| armed <= now);
        if due && st.ep.poll_timeout().is_some_and(|t| t <= now) {
            st.ep.handle_timeout(now);
        }
        // Redemptions that waited for capacity, revoked delegations.
        st.ep.delegation_turn();
        // A call future dropped before its result counts itself in
        // `abandoned` after its handle gave up (and recycled a result that
        // had come): both are looked at only when it is non-zero.
        let mut recycled = Vec::new();
        if inner.abandoned.load(std::sync::atomic::Ordering::Relaxed) > 0
            && inner.abandoned.swap(0, std::sync::atomic::Ordering::AcqRel) > 0
        {
            let abandoned: Vec<CallId> =
                st.calls.iter().filter(|(_, s)| s.is_abandoned()).map(|(id, _)| *id).collect();
            for id in &abandoned {
                st.calls.remove(id);
                st.ep.cancel(now, *id);
            }
            busy |= !abandoned.is_empty();
            recycled = inner.recycle.drain();
        }
        // (`has_events` first: the last, empty poll would copy an event's
        // worth of nothing, and carry out the commands again.)
        while st.ep.has_events() {
            let Some(ev) = st.ep.poll_event() else { break };
            busy = true;
            st.dispatch(ev);
        }
        for r in recycled {
            busy = true;
            if let Ok(Reply { data: Some(b), .. }) = r {
                st.ep.free(b);
            }
        }
        if busy {
            st.wake_capacity();
        }
        let mut next = st.ep.poll_timeout();
        let mut finished = false;
        if st.down.is_some() {
            let down_at = *st.down_at.get_or_insert(now);
            let drained = st.calls.is_empty() && st.ep.flushed();
            if drained || now >= down_at + FLUSH_GRACE {
                // Destroying the QP is the evidence for whatever is left.
                st.ep.finish_close(now);
                while let Some(ev) = st.ep.poll_event() {
                    st.dispatch(ev);
                }
                finished = st.calls.is_empty();
            } else {
                let grace = down_at + FLUSH_GRACE;
                next = Some(next.map_or(grace, |t| t.min(grace)));
            }
        }
        if finished && !st.finished {
            // Its figures move to the hub's tally for good (telemetry).
            if let Some(hub) = self.hub.hub.upgrade() {
                st.folded = Some(hub.fold(self.id, &mut |t| t.add(&st.ep.counts())));
            }
            st.finished = true;
            st.finish_waiters.wake_all();
        }
        arm(&mut st, next);
        // The pool's wake-up waits while tasks it woke have not run (a few
        // turns at most; `Slots::end_turn`).
        let defer = st.capacity_polled < st.capacity_wakes && st.pool_defers < 16;
        st.pool_defers = if defer { st.pool_defers + 1 } else { 0 };
        let again = st.ep.connection_mut().end_pool_turn(defer);
        // While something waits for a free buffer (a READ for its
        // destination, a user's alloc, the connection's end, another
        // connection on the shared pool), a buffer handle dropped from now
        // on queues the connection, and one dropped since this turn's
        // reclaim queues it now. Otherwise a dropped handle waits for the
        // next turn's reclaim (an allocation reclaims too): a call's reply
        // buffer, dropped by its caller, costs no turn of its own.
        // (Both hooks below act at once while the connection is down or a
        // user's call, reply or alloc waits for capacity.)
        let urgent = st.down.is_some() || !st.capacity_waiters.is_empty();
        let returns = if urgent || st.ep.wants_returns() {
            st.ep.wake_on_return(&inner.hub.waker)
        } else {
            st.ep.ignore_returns();
            false
        };
        // A grant SEND's successful completion may wait in the inbox for
        // the connection's next turn unless something waits for the control
        // send slot it frees (a frame in the backlog, an answer to a
        // redemption, a call or reply, or the connection's end). Cleared
        // before the inbox is looked at, under its lock: one routed since
        // this turn took the inbox queues it now (`HubPart::route`). While
        // the flag stays clear every completion queues the connection.
        let lazy = !urgent && !st.ep.send_slot_awaited();
        let flag = &inner.hub.lazy_grant_sends;
        let was = flag.load(std::sync::atomic::Ordering::Relaxed);
        if was != lazy {
            flag.store(lazy, std::sync::atomic::Ordering::Relaxed);
        }
        let routed = was && !lazy && !inner.hub.inbox.lock().is_empty();
        if returns || again || routed {
            inner.hub.waker.wake_by_ref();
        }
        Turn { busy, finished }
    }

    /// `proto::Connection::window_invalidated_elsewhere`, under the state lock.
    pub(crate) fn window_invalidated_elsewhere(&self, now: Duration, rkey: u32) -> bool {
        self.state.lock().ep.window_invalidated_elsewhere(now, rkey)
    }
}
