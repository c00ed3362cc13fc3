//! The async face of a [`Link`]: the [`Connection`] handle the user
//! holds, and the turns its endpoint's driver (the hub's, `hub/driver.rs`) takes
//! for it.
//!
//! # A connection's turn
//! What a turn does and what gives a connection one (a waiting call takes
//! its connection's turns itself for a while, [`CallFuture`]): see
//! `docs/architecture.md`, "The driver".
//!
//! # Hand-over
//! A call's result travels from the driver to the caller through a
//! [`Slot`]. If the caller drops the call's future, the
//! driver is woken, sees the slot abandoned and cancels the call; a reply
//! that had already arrived comes back through the
//! [`Recycle`] queue and its buffer returns to the
//! pool. The loom models in `tests/loom_handle.rs` check that hand-over
//! under every interleaving.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;

use super::hub::HubPart;
use super::{
    Buf, CallError, CallId, ConnStats, Event, Header, Link, LossReason, Policies, Refused, RegionRange,
    RequestId, Role, TraceId, UseError,
};
use crate::backend::{Nic, NicError};
use crate::handle::{Handle, Recycle, Slot};

mod driver;
mod regions;
pub use driver::DriverStats;
pub(crate) use driver::{idle_turn, yield_now, CallFuture, DriverCounters};

/// A reply to a call.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    /// The server's status byte.
    pub status: u8,
    /// The reply header.
    pub header: Header,
    /// The reply payload; give it back with [`Connection::free`].
    pub data: Option<Buf>,
}

/// A request received by a server.
///
/// Under the confirm policy for replies a request may come again
/// ([`Request::again`]): see [`Connection::next_request`].
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// Name it in [`Connection::reply`].
    pub id: RequestId,
    /// The request header (the same when the request comes again).
    pub header: Header,
    /// The request payload; give it back with [`Connection::free`].
    /// `None` when the request comes again: the payload came the first time.
    pub data: Option<Buf>,
    /// The caller's trace id, if it sent one ([`Connection::call_traced`]);
    /// the same when the request comes again.
    pub trace: Option<TraceId>,
    /// The request comes again (confirm policy; see
    /// [`Connection::next_request`]): `data` is `None`.
    pub again: bool,
    /// The caller asked for the reply's payload as a delegation
    /// ([`Connection::call_delegated`]; to whom and for how long:
    /// [`Connection::delegation_asked`]): reply with a range of a region
    /// (which the library delegates) or no payload.
    pub delegated: bool,
}

type CallResult = Result<Reply, CallError>;

/// Wakers of tasks waiting for one kind of thing; a task polled again
/// replaces its own registration instead of adding one.
#[derive(Default)]
struct Waiters(Vec<Waker>);

impl<N: Nic> State<N> {
    /// The task of `w` waits for a free buffer, control slot or window (and
    /// has run since the last wake-up).
    fn wait_for_capacity(&mut self, w: &Waker) {
        self.capacity_polled = self.capacity_wakes;
        self.capacity_waiters.register(w);
    }

    /// Wake the tasks waiting for capacity.
    pub(crate) fn wake_capacity(&mut self) {
        if self.capacity_waiters.wake_all() {
            self.capacity_wakes += 1;
        }
    }
}

impl Waiters {
    fn register(&mut self, w: &Waker) {
        if !self.0.iter().any(|x| x.will_wake(w)) {
            self.0.push(w.clone());
        }
    }
    /// Whether no task waits.
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Wake every task; whether there was one.
    fn wake_all(&mut self) -> bool {
        if self.0.is_empty() {
            return false;
        }
        self.0.drain(..).for_each(Waker::wake);
        true
    }
}

pub(crate) struct State<N: Nic> {
    ep: Link<N>,
    /// Keyed by the connection's own sequential call ids (a multiplicative
    /// hash, not SipHash).
    calls: super::proto::ids::IdMap<CallId, Arc<Slot<CallResult>>>,
    /// Slots of finished calls, reused once their handle is gone (a call
    /// allocates nothing in steady state).
    spare_slots: Vec<Arc<Slot<CallResult>>>,
    requests: VecDeque<Request>,
    /// Tasks in `next_request`.
    request_waiters: Waiters,
    /// Tasks waiting for a free buffer, control slot or window.
    capacity_waiters: Waiters,
    /// Times `capacity_waiters` were woken, and the count when one of them
    /// last ran: a wake-up from the shared pool is not passed on while
    /// tasks it woke have not run yet (`Inner::turn`).
    capacity_wakes: u64,
    capacity_polled: u64,
    /// Turns the pass-on has waited for them (a bounded few).
    pool_defers: u8,
    /// Tasks in `closed`.
    closed_waiters: Waiters,
    /// The connection is down, closed and every buffer is back (its QP is
    /// destroyed); [`Connection::finished`] waits for it.
    finished: bool,
    /// Tasks in [`Connection::finished`].
    finish_waiters: Waiters,
    /// Once finished, its figures are in its hub's tally of finished
    /// connections, as of that tally's epoch (telemetry reads it live until
    /// then).
    folded: Option<u64>,
    /// The user asked to close (`Closed`), or the peer went away
    /// (`PeerGone`): the connection goes down for that reason.
    closing: Option<LossReason>,
    /// When the connection went down (to bound the wait for flushes).
    down_at: Option<Duration>,
    down: Option<LossReason>,
    /// When the driver's sleep timer fires (`None`: none is armed). Set
    /// under this lock by the turn that arms it; a timer that fired leaves
    /// it in the past, and the driver is then awake for a turn. A call or
    /// reply posts its own work requests and the driver wakes on their
    /// completions, so it is rung only when it has events to hand out or
    /// must wake earlier than this.
    pub(super) driver_next: Option<Duration>,
}

impl<N: Nic> State<N> {
    /// Whether the driver must take a turn for what the user just did.
    fn needs_driver(&self) -> bool {
        if self.ep.has_events() {
            return true;
        }
        match (self.ep.poll_timeout(), self.driver_next) {
            (Some(t), Some(armed)) => t < armed,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

pub(crate) struct Inner<N: Nic> {
    /// What the driver did (read without the state lock).
    counters: DriverCounters,
    state: Mutex<State<N>>,
    /// Call futures dropped before their result (the driver looks for
    /// abandoned calls only when this is non-zero).
    abandoned: std::sync::atomic::AtomicUsize,
    recycle: Arc<Recycle<CallResult>>,
    epoch: crate::conn::clock::Epoch,
    /// A waiting call, or a server's `next_request`, takes the
    /// connection's turns itself (see [`driver::Spin`]); at most one does
    /// at a time.
    spinning: std::sync::atomic::AtomicBool,
    /// `Config::busy_poll`: how long a pending call takes turns itself.
    spin: Duration,
    /// `Config::serve_busy_poll`: how long `next_request` takes turns itself.
    serve_spin: Duration,
    /// Its place on the endpoint's hub.
    pub(super) hub: HubPart<N>,
    /// Its connection's id (`proto::Connection::id`): what the endpoint's
    /// delegations name it by, so that a revocation rings it alone.
    pub(crate) id: u64,
    /// The peer's TCP address and the name of the key it proved, set once
    /// by the [`super::Endpoint`] that made the connection (a prepared
    /// connection has no address, and an identity only if the application
    /// vouched for one: [`super::Pending::authenticated_as`]).
    peer: std::sync::OnceLock<(Option<std::net::SocketAddr>, Option<std::sync::Arc<str>>)>,
}

impl<N: Nic> Inner<N> {
    fn new(ep: Link<N>, epoch: crate::conn::clock::Epoch, hub: HubPart<N>) -> Inner<N> {
        let spin = ep.config().busy_poll;
        let serve_spin = ep.config().serve_busy_poll;
        // Made now, so that a first burst allocates no more than a later one:
        // room for a server's requests waiting for its user (one per buffer),
        // a client's call results (a slot per buffer, at least 64).
        let (server, buffers) = (ep.role() == Role::Server, ep.config().buffers as usize);
        let id = ep.id();
        let (waiting, slots) = if server { (buffers, 0) } else { (0, buffers.max(64)) };
        let mut spare_slots = Vec::with_capacity(slots.max(64));
        spare_slots.extend((0..slots).map(|_| Slot::new()));
        Inner {
            spinning: std::sync::atomic::AtomicBool::new(false),
            spin,
            serve_spin,
            state: Mutex::new(State {
                ep,
                calls: super::proto::ids::id_map(slots.max(64)),
                spare_slots,
                requests: VecDeque::with_capacity(waiting),
                request_waiters: Waiters::default(),
                // Room for 16 tasks waiting at once (a shared pool's
                // wake-one hand-off can have every call in flight of a
                // busy connection wait): no allocation while they do.
                capacity_waiters: Waiters(Vec::with_capacity(16)),
                capacity_wakes: 0,
                capacity_polled: 0,
                pool_defers: 0,
                closed_waiters: Waiters::default(),
                finished: false,
                finish_waiters: Waiters::default(),
                folded: None,
                closing: None,
                down_at: None,
                down: None,
                driver_next: None,
            }),
            abandoned: std::sync::atomic::AtomicUsize::new(0),
            counters: DriverCounters::default(),
            recycle: Recycle::new(),
            epoch,
            hub,
            id,
            peer: std::sync::OnceLock::new(),
        }
    }

    /// The connection's time: its endpoint's clock.
    #[inline]
    pub(super) fn now(&self) -> Duration {
        self.epoch.now()
    }

    /// The hub's completion queue failed: take the connection down with
    /// `e`. Returns whether it was up.
    pub(super) fn cq_failed(&self, e: &NicError) -> bool {
        let mut st = self.state.lock();
        let up = st.ep.is_down().is_none();
        if up {
            st.ep.cq_failed(e.clone());
        }
        up
    }

    /// Count a turn taken by a hub.
    pub(super) fn count_turn(&self, busy: bool) {
        // Only the hub's driver writes them: no locked add.
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.counters;
        c.turns.store(c.turns.load(Relaxed) + 1, Relaxed);
        if busy {
            c.busy_turns.store(c.busy_turns.load(Relaxed) + 1, Relaxed);
        }
    }

    /// The user changed something the driver must act on: queue the
    /// connection for a turn (once, until the turn starts) and wake the hub.
    pub(super) fn ring(&self) {
        self.hub.waker.wake_by_ref();
    }
}

/// The user's handle on a connection, made by an
/// [`Endpoint`](super::Endpoint), whose driver runs it. Cheap to clone.
pub struct Connection<N: Nic> {
    inner: Arc<Inner<N>>,
}

impl<N: Nic> Clone for Connection<N> {
    fn clone(&self) -> Self {
        Connection { inner: self.inner.clone() }
    }
}

/// How long a closing or lost connection waits for the NIC to flush its
/// work requests before destroying the QP anyway (destroying it is evidence
/// too: no DMA of it is possible afterwards).
const FLUSH_GRACE: Duration = Duration::from_secs(1);

impl<N: Nic> Connection<N> {
    /// A connection driven by a hub: `part` makes its hub part from the
    /// connection's weak handle (for its waker).
    pub(super) fn on_hub(
        ep: Link<N>,
        epoch: crate::conn::clock::Epoch,
        part: impl FnOnce(std::sync::Weak<Inner<N>>) -> HubPart<N>,
    ) -> Connection<N> {
        let inner = Arc::new_cyclic(|w| Inner::new(ep, epoch, part(w.clone())));
        // A connection that finds the hub's shared buffer pool empty is
        // queued for a turn when a buffer comes back.
        inner.state.lock().ep.connection_mut().wake_on_pool(&inner.hub.waker);
        Connection { inner }
    }

    /// The shared part (for the hub).
    pub(super) fn inner_arc(&self) -> Arc<Inner<N>> {
        self.inner.clone()
    }

    /// Run `f` on the state, then wake the driver to act on it.
    fn with<T>(&self, f: impl FnOnce(&mut State<N>) -> T) -> T {
        let out = f(&mut self.inner.state.lock());
        self.inner.ring();
        out
    }

    /// Run `f` on the state without waking the driver (nothing for it to do).
    fn peek<T>(&self, f: impl FnOnce(&mut State<N>) -> T) -> T {
        f(&mut self.inner.state.lock())
    }

    /// The task of `w` waits for a free buffer: a handle dropped from now
    /// on brings the driver back for it (`Inner::turn` arms the hook only
    /// while something waits), and one dropped already rings it now.
    fn wait_for_buffer(&self, st: &mut State<N>, w: &Waker) {
        st.wait_for_capacity(w);
        if st.ep.wake_on_return(&self.inner.hub.waker) {
            self.inner.ring();
        }
    }

    /// Take a free buffer from the pool, or `None` when every buffer is in
    /// use or the connection is down. [`Connection::alloc`] waits for one
    /// instead.
    pub fn try_alloc(&self) -> Option<Buf> {
        self.peek(|s| if s.down.is_some() { None } else { s.ep.alloc() })
    }

    /// Take a free buffer from the pool, waiting until one is free. Fails
    /// only when the connection is down.
    pub async fn alloc(&self) -> Result<Buf, UseError> {
        self.alloc_with(|ep| Ok(ep.alloc())).await
    }

    /// Take the smallest free buffer that holds `len` bytes (the standard
    /// size, or a class of [`Config::large_buffers`](super::Config::large_buffers)),
    /// waiting until one is free. Fails when no buffer is that large, or
    /// the connection is down.
    pub async fn alloc_for(&self, len: usize) -> Result<Buf, UseError> {
        self.alloc_with(|ep| ep.alloc_for(len)).await
    }

    /// A buffer from `take`, waiting while it finds none free.
    async fn alloc_with(
        &self,
        take: impl Fn(&mut Link<N>) -> Result<Option<Buf>, UseError>,
    ) -> Result<Buf, UseError> {
        poll_fn(|cx| {
            let mut st = self.inner.state.lock();
            if let Some(r) = &st.down {
                return Poll::Ready(Err(UseError::Down(r.clone())));
            }
            st.capacity_polled = st.capacity_wakes;
            match take(&mut st.ep) {
                Ok(Some(b)) => Poll::Ready(Ok(b)),
                Ok(None) => {
                    self.wait_for_buffer(&mut st, cx.waker());
                    Poll::Pending
                }
                Err(e) => Poll::Ready(Err(e)),
            }
        })
        .await
    }

    /// Bytes of memory this connection has registered with the NIC: its
    /// control slots, its buffers (none of its own on an endpoint with a
    /// shared pool), and the user regions it holds.
    pub fn registered_bytes(&self) -> u64 {
        self.peek(|s| s.ep.registered_bytes())
    }

    /// Return a buffer to the pool (dropping it does the same).
    pub fn free(&self, buf: Buf) {
        let mut st = self.inner.state.lock();
        st.ep.free(buf);
        st.wake_capacity();
        if st.ep.has_events() {
            // A payload that waited for a free buffer arrived.
            self.inner.ring();
        }
    }

    /// Buffers free in the pool. A buffer given to a call or reply comes
    /// back to the pool by itself, once no remote access to it is possible.
    pub fn free_buffers(&self) -> usize {
        self.peek(|s| s.ep.free_buffers())
    }

    /// Client: make a call and wait for its reply. Dropping the future
    /// cancels the call; its buffers still return only on evidence.
    ///
    /// Poll the future to its end, or drop it. With
    /// [`Config::busy_poll`](super::Config::busy_poll) set (the default),
    /// a waiting call polls its endpoint's completion queue itself, and
    /// the endpoint's driver leaves the queue to it: a future polled once
    /// and then held unpolled leaves other connections' completions
    /// waiting for the driver's next wake-up (a ring, or at the latest a
    /// timer such as this call's deadline).
    ///
    /// A call that finds no free control slot, memory window or receive
    /// credit (the peer has no receive free: flow control) waits for one.
    /// A call refused for any other reason (wrong role, a header that is
    /// too long, a foreign or empty buffer, the connection down) fails with
    /// [`CallError::Refused`], which hands `data` back.
    pub async fn call(&self, header: &[u8], data: Option<Buf>) -> Result<Reply, CallError> {
        // (Not through `call_traced`: one future less around each poll.)
        self.make_call(data, |ep, now, data| ep.call(now, header, data)).await
    }

    /// [`Connection::call`] carrying the caller's trace id to the server:
    /// the call's span (`mwcap.call`) and the server's (`mwcap.request`)
    /// both record it, and the server's [`Request::trace`] has it.
    pub async fn call_traced(
        &self,
        trace: Option<TraceId>,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<Reply, CallError> {
        self.make_call(data, |ep, now, data| ep.call_traced(now, trace, header, data)).await
    }

    /// Start a call with `attempt` (given the payload to send, if any),
    /// retried while it waits for a window, control slot or credit, then
    /// wait for its reply.
    async fn make_call(
        &self,
        mut data: Option<Buf>,
        mut attempt: impl FnMut(&mut Link<N>, Duration, Option<Buf>) -> Result<CallId, Refused>,
    ) -> Result<Reply, CallError> {
        // Its result's slot, taken under the lock the call starts under.
        let slot = poll_fn(|cx| {
            // The clock read under the lock: a wait for it would make the
            // time a lease starts at stale (its grant goes out later).
            let mut st = self.inner.state.lock();
            let now = self.inner.now();
            let r = attempt(&mut st.ep, now, data.take());
            let r = self
                .committed_or_wait(&mut st, cx, r, &mut data)
                .map_ok(|id| {
                    let slot = st.spare_slot();
                    st.calls.insert(id, slot.clone());
                    slot
                })
                .map_err(CallError::Refused);
            drop(st);
            r
        })
        .await?;
        CallFuture {
            handle: Handle::new(slot, self.inner.recycle.clone()),
            inner: &self.inner,
            done: false,
            spin: driver::Spin::default(),
        }
        .await
    }

    /// Client: make a call whose request payload is `range` of a region of
    /// this connection's endpoint ([`Endpoint::register_region`](super::Endpoint::register_region))
    /// and wait for its reply. The range stays exposed until the server
    /// releases it or its lease ends; [`Endpoint::region_write`](super::Endpoint::region_write)
    /// refuses to write it until then, [`Endpoint::region_write_when_free`](super::Endpoint::region_write_when_free)
    /// waits. Like [`Connection::call`], it waits for a window, control
    /// slot or credit.
    pub async fn call_region(
        &self,
        trace: Option<TraceId>,
        header: &[u8],
        range: RegionRange,
    ) -> Result<Reply, CallError> {
        self.make_call(None, |ep, now, _| {
            ep.call_region(now, trace, header, range).map_err(|error| Refused { error, data: None })
        })
        .await
    }

    /// Server: answer a request with `range` of a region of this
    /// connection's endpoint as the payload (see [`Connection::call_region`]),
    /// waiting for a window, control slot or credit like [`Connection::reply`].
    pub async fn reply_region(
        &self,
        req: RequestId,
        status: u8,
        header: &[u8],
        range: RegionRange,
    ) -> Result<(), UseError> {
        self.send_reply(None, |ep, now, _| {
            ep.reply_region(now, req, status, header, range, None)
                .map(|_| ())
                .map_err(|error| Refused { error, data: None })
        })
        .await
        .map_err(|Refused { error, .. }| error)
    }

    /// What a call or reply attempt leads to: committed (the driver is rung
    /// only if it must act), waiting for a window or control slot (`data`
    /// kept for the retry, the driver rung to free capacity), or refused.
    fn committed_or_wait<T>(
        &self,
        st: &mut State<N>,
        cx: &mut Context<'_>,
        r: Result<T, Refused>,
        data: &mut Option<Buf>,
    ) -> Poll<Result<T, Refused>> {
        st.capacity_polled = st.capacity_wakes;
        match r {
            Ok(v) => {
                if st.needs_driver() {
                    self.inner.ring();
                }
                Poll::Ready(Ok(v))
            }
            Err(Refused {
                error: UseError::NoFreeWindow | UseError::NoCtrlSlot | UseError::NoCredit,
                data: back,
            }) => {
                *data = back;
                st.wait_for_capacity(cx.waker());
                // The driver frees capacity as completions arrive.
                self.inner.ring();
                Poll::Pending
            }
            Err(refused) => Poll::Ready(Err(refused)),
        }
    }

    /// Server: the next request, or `None` once the connection is down.
    ///
    /// Under the confirm policy for replies, a request may come again after
    /// it was answered ([`Request::again`] set): the client's READ of the
    /// reply payload was stale (the offered buffer's hold,
    /// [`Config::lease_time`](super::Config::lease_time), ended before the
    /// client confirmed it), so it needs the payload again. It comes with
    /// the same id, header and trace id as the first time, and no payload
    /// (`data` is `None`: the server had it the first time). Answer it
    /// with [`Connection::reply`] as the first time, with a fresh reply
    /// payload: the connection kept the header for this, so a server that
    /// answers from the header has nothing to remember. A server whose
    /// reply depends on the request payload must keep what it needs of it
    /// until the client's call is over (the client's
    /// [`Config::call_timeout`](super::Config::call_timeout) after the
    /// request came, at most), or answer a request that comes again with
    /// an error status.
    ///
    /// With [`Config::serve_busy_poll`](super::Config::serve_busy_poll)
    /// set, a wait first takes the connection's turns itself for that long.
    pub async fn next_request(&self) -> Option<Request> {
        if self.inner.serve_spin.is_zero() {
            // No spin: the plain wait, without a spinner's state.
            poll_fn(|cx| driver::NextRequest::take(&self.inner, cx)).await
        } else {
            driver::NextRequest { inner: &self.inner, spin: driver::Spin::default() }.await
        }
    }

    /// Server: answer a request. A reply that finds no free memory window,
    /// control slot or receive credit waits for one (like [`Connection::call`]); any other
    /// refusal (no such request, a header too long, a foreign buffer, the
    /// connection down) sends nothing, leaves the request waiting for a
    /// reply, and hands `data` back in [`Refused::data`].
    pub async fn reply(
        &self,
        req: RequestId,
        status: u8,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<(), Refused> {
        self.send_reply(data, |ep, now, data| ep.reply(now, req, status, header, data)).await
    }

    /// Send a reply with `attempt` (given the payload, if any), retried
    /// while it waits for a window, control slot or credit.
    /// (A future, not an `async fn`: no state machine around the poll.)
    fn send_reply<'a>(
        &'a self,
        mut data: Option<Buf>,
        mut attempt: impl FnMut(&mut Link<N>, Duration, Option<Buf>) -> Result<(), Refused> + 'a,
    ) -> impl Future<Output = Result<(), Refused>> + 'a {
        poll_fn(move |cx| {
            // The clock read under the lock, as `make_call`'s.
            let mut st = self.inner.state.lock();
            let now = self.inner.now();
            let r = attempt(&mut st.ep, now, data.take());
            let r = self.committed_or_wait(&mut st, cx, r, &mut data);
            if matches!(r, Poll::Ready(Err(_))) {
                self.inner.ring();
            }
            r
        })
    }

    /// Close: the QP goes to ERR at once, every call fails, and the driver
    /// reaps the flushes, destroys the QP (after which no DMA of it is
    /// possible) and ends once every buffer is back. Does not block.
    pub fn close(&self) {
        self.with(|s| _ = s.closing.get_or_insert(LossReason::Closed));
    }

    /// The peer went away: its bootstrap stream closed. Closes the
    /// connection as [`Connection::close`] does, but calls then fail, and
    /// [`Connection::closed`] and [`Connection::finished`] end, with
    /// [`LossReason::PeerGone`] (unless it was down already). The
    /// [`EndpointDriver`](super::EndpointDriver) calls it when it sees the
    /// stream close; call it yourself when you learn by other means that
    /// the peer is gone.
    pub fn peer_gone(&self) {
        self.with(|s| _ = s.closing.get_or_insert(LossReason::PeerGone));
    }

    /// The peer broke the protocol on its bootstrap stream: the connection
    /// goes down as for [`Connection::peer_gone`], saying so.
    pub(crate) fn peer_misbehaved(&self, what: super::Misbehavior) {
        self.with(|s| _ = s.closing.get_or_insert(LossReason::PeerMisbehaved(what)));
    }

    /// What the connection has done so far (calls, bytes, binds,
    /// invalidations, expiries, stale reads, errors), and where its buffers
    /// are now.
    pub fn stats(&self) -> super::ConnStats {
        self.peek(|s| s.ep.stats())
    }

    /// Wait until the connection is down, and say why: the peer went away
    /// ([`LossReason::PeerGone`]) or broke the protocol, a work request
    /// failed, the user closed it ([`LossReason::Closed`]). Every
    /// call fails once it is; its buffers come back as the NIC flushes and
    /// the driver destroys the QP.
    pub async fn closed(&self) -> LossReason {
        poll_fn(|cx| {
            let mut st = self.inner.state.lock();
            if let Some(r) = &st.down {
                return Poll::Ready(r.clone());
            }
            st.closed_waiters.register(cx.waker());
            Poll::Pending
        })
        .await
    }

    /// Wait until the connection is down, closed, and every buffer is back
    /// (its QP destroyed: no remote access to its memory is possible any
    /// more), and say why it went down. The endpoint's driver must run
    /// meanwhile.
    pub async fn finished(&self) -> LossReason {
        poll_fn(|cx| {
            let mut st = self.inner.state.lock();
            if st.finished {
                return Poll::Ready(st.down.clone().unwrap_or(LossReason::Closed));
            }
            st.finish_waiters.register(cx.waker());
            Poll::Pending
        })
        .await
    }

    /// A weak handle, for [`crate::stat::Registry`] (which must not keep a
    /// connection alive).
    pub(crate) fn downgrade(&self) -> std::sync::Weak<Inner<N>> {
        Arc::downgrade(&self.inner)
    }

    /// The connection behind a weak handle, if it (or its driver) lives.
    pub(crate) fn upgrade(w: &std::sync::Weak<Inner<N>>) -> Option<Connection<N>> {
        w.upgrade().map(|inner| Connection { inner })
    }

    /// Its id, QP number, role, policies, state and counters, read under
    /// one lock (for [`crate::stat`]).
    pub(crate) fn describe(&self) -> (u64, u32, Role, Policies, Option<LossReason>, ConnStats) {
        self.peek(|s| {
            let c = &*s.ep;
            (c.id(), s.ep.local().qpn, c.role(), c.policies(), s.down.clone(), s.ep.stats())
        })
    }

    /// The number of the connection's queue pair (as the peer, `ibv_devinfo`
    /// and the tracing spans name it).
    pub fn qp_number(&self) -> u32 {
        self.peek(|s| s.ep.local().qpn)
    }

    /// The policy of each direction, as the bootstrap agreed them.
    pub fn policies(&self) -> Policies {
        self.peek(|s| s.ep.policies())
    }

    /// The peer's address on the bootstrap's TCP connection (`None` for a
    /// connection made without one, [`Endpoint::connect_local`](super::Endpoint::connect_local)).
    pub fn peer_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.peer.get().and_then(|p| p.0)
    }

    /// The peer's identity: the name of the key it proved in the bootstrap
    /// (an [`Auth::Keyring`](crate::bootstrap::Auth::Keyring)'s name, or
    /// [`SHARED_IDENTITY`](crate::bootstrap::SHARED_IDENTITY) for an
    /// [`Auth::Key`](crate::bootstrap::Auth::Key)). Both sides proved the
    /// same key, so on a client it is the name of the client's own key, as
    /// its ring names it (the server is known by its address). `None` when the
    /// bootstrap ran without a key, or without a bootstrap
    /// ([`Endpoint::connect_local`](super::Endpoint::connect_local),
    /// [`Endpoint::prepare`](super::Endpoint::prepare)) unless the
    /// application vouched for the peer
    /// ([`Pending::authenticated_as`](super::Pending::authenticated_as)).
    pub fn peer_identity(&self) -> Option<&str> {
        self.inner.peer.get().and_then(|p| p.1.as_deref())
    }

    /// Record the peer's address and identity (once: the endpoint adopting it).
    /// (The link has the identity already: it is set before the
    /// connection runs, since a redemption may be its first frame.)
    pub(super) fn set_peer(&self, addr: Option<std::net::SocketAddr>, identity: Option<std::sync::Arc<str>>) {
        let _ = self.inner.peer.set((addr, identity));
    }

    /// The turns its endpoint's driver took for it (not those a waiting
    /// call took itself).
    pub fn driver_stats(&self) -> DriverStats {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.inner.counters;
        DriverStats { turns: c.turns.load(Relaxed), busy_turns: c.busy_turns.load(Relaxed) }
    }

    /// Why the connection is down, if it is.
    pub fn is_down(&self) -> Option<LossReason> {
        self.peek(|s| s.down.clone())
    }
}

#[cfg(test)]
mod tests;
