//! The I/O layer: a [`Connection`] state machine run over a [`Nic`] by a
//! [`Link`] (the layers: `conn`'s module docs). Everything but the I/O
//! (the protocols, buffers, calls, timers) is the connection's.

use std::time::Duration;

mod answer;
mod buffers;
mod create;
mod regions;
pub use create::Prepared;
#[cfg_attr(loom, allow(unused_imports))] // the hub's, absent under loom
pub(crate) use create::QueueSizes;

use super::buf::Buf;
use super::bufpool::BufferPool;
use super::config::*;
use super::frame::{self, MAX_FRAME};
use super::pool::Layout;
use super::proto::{self, Command, Connection, DataMemory, Resources};
use super::regions::Regions;
use super::srq::{self, LentSends, Regrant, SharedReceives};
use super::types::*;
use super::SetupError;
use crate::backend::{Access, Completion, CqId, MrId, MrInfo, MwId, Nic, NicError, QpConfig, QpEndpoint};
use crate::mem::Registered;

/// Completions taken per `poll_cq` call (an array kept for the endpoint's life).
#[cfg(any(test, feature = "testing"))]
const POLL_BATCH: usize = 32;

/// A completion queue a link shares with others (an endpoint's hub). The
/// endpoint neither polls nor destroys it: its completions are handed to
/// [`Link::handle_completions`], and it destroys its QP through
/// [`SharedCq::retire`].
pub(crate) trait SharedCq: Send + Sync {
    /// Run `destroy` (which destroys the QP numbered `qpn`, and says
    /// whether it did), then take that QP's completions out of the shared
    /// queue and forget the QP, before its number can name a new QP's
    /// completions there. A QP `destroy` could not destroy keeps its place
    /// in the queue (`Routes::retire`).
    fn retire(&self, qpn: u32, destroy: &mut dyn FnMut() -> bool);
}

/// Destroy `qp` directly, or through the shared queue's `retire`.
fn destroy_qp<N: Nic>(
    nic: &N,
    shared: Option<&std::sync::Arc<dyn SharedCq>>,
    qp: &QpEndpoint,
) -> Result<(), NicError> {
    match shared {
        None => nic.destroy_qp(qp.id),
        Some(s) => {
            let mut out = Ok(());
            s.retire(qp.qpn, &mut || {
                out = nic.destroy_qp(qp.id);
                out.is_ok()
            });
            out
        }
    }
}

/// Keep `qp` (not destroyed: a window of it could not be deallocated) as
/// a QP whose destroy failed: on a shared queue its route stays, stuck, and
/// lets its connection go, as `destroy_qp` failing does.
fn hold_qp(shared: Option<&std::sync::Arc<dyn SharedCq>>, qp: &QpEndpoint) {
    if let Some(s) = shared {
        s.retire(qp.qpn, &mut || false);
    }
}

/// What became of a link's QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpFate {
    /// Not destroyed yet.
    Live,
    /// Destroyed: no DMA through it is possible any more.
    Destroyed,
    /// Its destroy failed: it may still reach whatever it could, so nothing
    /// it could reach is used again (`Link::finish_close`).
    Stuck,
}

/// One side of one RC connection: its device resources on a [`Nic`], and
/// the [`Connection`] state machine it runs. The call order: create its QP
/// (`Link::prepare_on`, through `Hub::prepare` on an endpoint;
/// `Link::new` in tests), then [`Prepared::finish`] once the policies
/// are known, and connect it to the peer (`Link::connect_with`;
/// `Link::connect` in tests); then feed it completions
/// (`Link::handle_completions`; `Link::drive` in tests) and the time
/// ([`Link::handle_timeout`]), take its events ([`Link::poll_event`]), call
/// and reply; to close, [`Link::begin_close`], then [`Link::finish_close`]
/// once the flushes are reaped.
pub struct Link<N: Nic> {
    nic: N,
    conn: Connection,
    cq: CqId,
    local: QpEndpoint,
    /// Its control region: send slots, then (with a receive queue of its
    /// own) receive slots, with its memory (a frame is written into its
    /// send slot and decoded in its receive slot through it, not through
    /// the NIC). `None` on shared receives: its receives are the hub's
    /// queue's, and its send slots the hub's, lent (`lent`).
    ctrl: Option<Registered>,
    /// On shared receives: the hub's send slots it holds.
    lent: LentSends,
    /// Its own data region; `None` on a hub's shared buffer pool.
    data: Option<MrInfo>,
    /// The access of the data region, which user regions get too.
    access: Access,
    windows: Vec<MwId>,
    /// The completion queue is shared with other endpoints (see
    /// [`SharedCq`]); `None`: it is this endpoint's own.
    shared: Option<std::sync::Arc<dyn SharedCq>>,
    /// The hub's shared receive queue the QP takes its receives from;
    /// `None`: a receive queue of its own.
    srq: Option<std::sync::Arc<SharedReceives<N>>>,
    /// The share of `srq` went back with the QP.
    share_released: bool,
    /// Where `drive` polls completions into (a link with a CQ of its own:
    /// tests).
    #[cfg(any(test, feature = "testing"))]
    batch: Vec<Completion>,
    /// Whether its QP is still there, and if not, how it went.
    qp: QpFate,
    /// The regions whose ranges it exposes: its endpoint's, once a hub
    /// adopts it (`Hub::add`); until then, or for a link of its own, its own.
    regions: std::sync::Arc<Regions<N>>,
    /// The connection's span (id, QP number, role, policies): every log
    /// line of its work is inside it, so many connections' logs can be
    /// told apart.
    span: tracing::Span,
    /// Delegations (`delegate.rs`): the identity the peer proved, the
    /// delegated ranges this connection exposes now, and the answers to
    /// redemptions waiting for capacity.
    pub(crate) delegation: answer::LinkDelegation,
}

/// The state machine a link runs, read-only: what it reports (`stats`,
/// `is_down`, `poll_timeout`, ...) is read from it directly. What changes
/// it goes through the link, which carries out the commands it queues.
impl<N: Nic> std::ops::Deref for Link<N> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.conn
    }
}

impl<N: Nic> Link<N> {
    /// What the peer needs to connect to this endpoint.
    pub fn local(&self) -> QpEndpoint {
        self.local
    }

    /// The NIC handle (for tests and the oracle).
    #[cfg(any(test, feature = "testing"))]
    pub fn nic(&self) -> &N {
        &self.nic
    }

    /// The state machine, for what queues no command (one queued through
    /// it would wait for the link's next run of its commands).
    pub(crate) fn connection_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// Bytes of memory this connection has registered with the NIC: its
    /// control slots, its buffer pool, and the user regions it holds.
    pub fn registered_bytes(&self) -> u64 {
        let regions: u64 = self.conn.region_infos().iter().map(|r| r.len as u64).sum();
        self.ctrl.as_ref().map_or(0, |c| c.info.len as u64) + self.data.map_or(0, |d| d.len as u64) + regions
    }

    /// The data region (for tests and the oracle).
    ///
    /// # Panics
    /// On a hub's shared buffer pool, where the connection has no data
    /// region ([`Link::shares_buffers`]).
    #[cfg(any(test, feature = "testing"))]
    pub fn data_region(&self) -> MrInfo {
        self.data.expect("a connection on a shared buffer pool has no data region")
    }

    /// Whether the connection's buffers come from a hub's shared buffer
    /// pool ([`EndpointBuilder::shared_buffers`](super::EndpointBuilder::shared_buffers)).
    #[cfg(any(test, feature = "testing"))]
    pub fn shares_buffers(&self) -> bool {
        self.data.is_none()
    }

    /// The completion queue (for a driver waiting on its readiness).
    #[cfg(any(test, feature = "testing"))]
    pub fn cq(&self) -> CqId {
        self.cq
    }

    /// Connect to the peer's endpoint (QP to RTS) and post the receive
    /// buffers, with the peer holding as many receives for this side at
    /// the start as this side's `Config::start_credits` says (see
    /// `Link::connect_with`).
    #[cfg(any(test, feature = "testing"))]
    pub fn connect(&mut self, peer: &QpEndpoint) -> Result<(), NicError> {
        let credits = self.conn.config().start_credits;
        self.connect_with(peer, credits)
    }

    /// `Link::connect` (the tests') to a peer that holds `peer_credits`
    /// receives for this side at the start (its `Config::start_credits`,
    /// from its hello).
    pub(crate) fn connect_with(&mut self, peer: &QpEndpoint, peer_credits: u32) -> Result<(), NicError> {
        self.nic.connect_qp(self.local.id, peer)?;
        if self.srq.is_some() {
            self.conn.start_shared(peer_credits);
        } else {
            self.conn.start(peer_credits);
        }
        self.run();
        match self.conn.is_down() {
            Some(LossReason::Nic(e)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Carry out every command the connection has queued. A command the NIC
    /// refuses goes back to the connection, which goes down.
    #[inline]
    fn run(&mut self) {
        if self.conn.has_commands() {
            self.run_commands();
        }
    }

    /// `f` on the connection, then what it asks of the NIC carried out.
    #[inline(always)]
    fn with_conn<T>(&mut self, f: impl FnOnce(&mut Connection) -> T) -> T {
        let r = f(&mut self.conn);
        self.run();
        r
    }

    /// `f` on the connection in its span, then what it asks of the NIC
    /// carried out.
    #[inline(always)]
    fn in_span<T>(&mut self, f: impl FnOnce(&mut Connection) -> T) -> T {
        let conn = &mut self.conn;
        let r = self.span.in_scope(|| f(conn));
        self.run();
        r
    }

    /// [`Link::run`] with commands queued.
    #[inline(never)]
    fn run_commands(&mut self) {
        let _in = self.span.enter();
        let (nic, qp, destroyed) = (&self.nic, self.local.id, self.qp == QpFate::Destroyed);
        let (ctrl, srq, lent) = (self.ctrl.as_ref(), self.srq.as_deref(), &mut self.lent);
        self.conn.drain_commands(|cmd, bytes| match cmd {
            Command::PostSend { chain, frame } => {
                if let Some(f) = frame {
                    // The frame is copied from the connection's staging into
                    // its send slot (registered memory), then sent.
                    let (slab, at) = match (ctrl, srq) {
                        (Some(ctrl), _) => (ctrl, f.offset),
                        // On shared receives: the hub's slot standing for
                        // its own, and the SEND pointed at it.
                        (None, Some(srq)) => {
                            let (slab, at) = lent.slot(srq, f.offset / MAX_FRAME)?;
                            chain.relocate_send(slab.info.id, *at);
                            (slab, *at)
                        }
                        (None, None) => unreachable!("only a link on shared receives has no control region"),
                    };
                    slab.with_mut(at, bytes.len(), |b| b.copy_from_slice(bytes))?;
                }
                nic.post_send(qp, chain.as_slice())
            }
            Command::PostRecv { wr_id, sge } => nic.post_recv(qp, *wr_id, *sge),
            // Its success is evidence the owner's exposures wait for: a
            // failure goes back to the connection.
            Command::SetQpError if destroyed => Ok(()),
            Command::SetQpError => nic.set_qp_error(qp),
        });
    }

    /// On shared receives: once none of the connection's SENDs is in
    /// flight, the hub's send slots it holds go back.
    #[inline]
    fn give_back_sends(&mut self) {
        if self.lent.any() && !self.conn.holds_send_slots() {
            if let Some(srq) = &self.srq {
                self.lent.give_back(srq);
            }
        }
    }

    // ---- events and time ----

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<Event> {
        // Most events go to the user as they are: post what the engines
        // queued with them first, then hand the event over without
        // holding it across the post. Asks and user ranges returned are
        // handled here first (below).
        self.conn.settle();
        self.run();
        if matches!(self.conn.peek_event(), Some(e) if !matches!(e, Event::Ask { .. } | Event::RangeReturned { .. }))
        {
            return self.conn.poll_event();
        }
        let mut e = self.conn.poll_event();
        while let Some(Event::Ask { .. }) = &e {
            // Answered here, from the endpoint's delegations (a call for
            // a delegation surfaces as its request).
            e = self.ask(e.take()).or_else(|| self.conn.poll_event());
        }
        if let Some(Event::RangeReturned { range, exposure }) = &e {
            self.regions.unexpose(self.conn.id(), *range);
            if self.delegation.exposes() {
                self.delegated_range_returned(*exposure);
            }
        }
        self.run();
        e
    }

    /// Time has reached `now`: fire the engines' timers and call deadlines.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.in_span(|c| c.handle_timeout(now))
    }

    /// Poll the completion queue, feed every completion and received frame
    /// to the connection, and post what it asks for. Returns how many
    /// completions it handled.
    ///
    /// On a shared completion queue (an endpoint's) it does not poll: the
    /// hub hands the completions over (`Link::handle_completions`).
    #[cfg(any(test, feature = "testing"))]
    pub fn drive(&mut self, now: Duration) -> usize {
        self.reclaim();
        let mut handled = 0;
        if self.shared.is_none() {
            let mut batch = std::mem::take(&mut self.batch);
            loop {
                let n = match self.nic.poll_cq(self.cq, &mut batch) {
                    Ok(n) => n,
                    Err(e) => {
                        self.conn.post_failed(&Command::SetQpError, e);
                        break;
                    }
                };
                if n == 0 {
                    break;
                }
                handled += n;
                self.handle_completions(now, &batch[..n]);
            }
            self.batch = batch;
        }
        self.delegation_turn();
        self.run();
        handled
    }

    /// The completion queue this endpoint's QP completes on failed (its
    /// device is gone): the connection goes down with `e`, as when its own
    /// queue fails in `Link::drive` (tests).
    pub(crate) fn cq_failed(&mut self, e: NicError) {
        self.with_conn(|c| c.post_failed(&Command::SetQpError, e))
    }

    /// See [`Connection::window_invalidated_elsewhere`](super::proto::Connection::window_invalidated_elsewhere);
    /// the commands it leads to are carried out.
    pub(crate) fn window_invalidated_elsewhere(&mut self, now: Duration, rkey: u32) -> bool {
        self.with_conn(|c| c.window_invalidated_elsewhere(now, rkey))
    }

    /// Feed completions of this endpoint's QP (taken off a completion queue
    /// by whoever polls it) and the frames they received to the connection,
    /// and post what it asks for.
    pub(crate) fn handle_completions(&mut self, now: Duration, completions: &[Completion]) {
        // The driver read the clock before it took this connection, and a
        // caller may have taken it since with a later time.
        let now = self.conn.advance(now);
        let span = self.span.clone();
        let _in = span.enter();
        for c in completions {
            if let (Some(srq), Some(slot)) = (&self.srq, srq::slot_of(c.wr_id)) {
                self.shared_receive(now, srq.clone(), slot, c);
                continue;
            }
            let Some((offset, len)) = self.conn.received_frame(c) else {
                self.conn.handle_completion(now, c, &[]);
                continue;
            };
            // Decoded in place, in its receive slot: the slot is posted
            // again by a command of this turn, run after every completion
            // of the batch is handled. The memory's lock is held meanwhile,
            // so nothing `handle_completion` reaches may call the NIC (the
            // simulator takes its fabric's lock, then a memory's).
            let conn = &mut self.conn;
            let decoded = match &self.ctrl {
                Some(ctrl) => ctrl.with(offset, len, |frame| conn.handle_completion(now, c, frame)),
                None => Err(NicError::NoSuchObject { what: "receive slot", id: offset as u32 }),
            };
            if let Err(e) = decoded {
                conn.post_failed(&Command::SetQpError, e);
                conn.handle_completion(now, c, &[]);
            }
        }
        drop(_in);
        self.run();
        self.give_back_sends();
    }

    /// A completion of a receive of the hub's shared queue: hand the frame
    /// to the connection (decoded in the hub's slot), post the receive
    /// again, and grant the connection its receive again (or more, or
    /// none: see [`SharedReceives::regrant`]).
    fn shared_receive(
        &mut self,
        now: Duration,
        srq: std::sync::Arc<SharedReceives<N>>,
        slot: u32,
        c: &Completion,
    ) {
        let mut own = *c;
        own.wr_id = proto::SHARED_RECV_WR_ID;
        let len = c.status.is_success().then_some(c.byte_len as usize);
        let conn = &mut self.conn;
        let mut grows = true;
        let took = srq.take_frame(slot, len, |frame| {
            grows = frame::grows_share(frame);
            conn.handle_completion(now, &own, frame)
        });
        if let Err(e) = took {
            conn.post_failed(&Command::SetQpError, e);
            conn.handle_completion(now, &own, &[]);
        }
        // Receives an idle peer gave back: free for others (before the
        // regrant below counts what is free).
        if !self.share_released {
            let n = self.conn.take_returned();
            if n > 0 {
                srq.given_back(n);
            }
        }
        if c.status.is_success() && self.conn.is_down().is_none() && !self.share_released {
            let (share, cfg) = (self.conn.receive_share(), self.conn.config());
            // While a `GiveBack` is unanswered nothing is withheld: the peer
            // may already have dropped the credits it will say it returned,
            // and the share, still counting them, must not shrink below
            // them (the `Returned` is checked against it).
            let floor = if self.conn.giving_back() { share } else { cfg.start_credits };
            match srq.regrant(share, floor, cfg.ctrl_slots, grows) {
                Regrant::Same => self.conn.grant_receives(1, 0),
                Regrant::Grow => self.conn.grant_receives(2, 1),
                Regrant::Withhold => {
                    let kept = self.conn.withhold_receive();
                    debug_assert!(kept, "regrant withholds only above the least share");
                }
            }
        }
    }

    /// The QP is gone: no frame takes a shared receive for it any more, so
    /// its share goes back to the hub's queue (once).
    fn release_share(&mut self) {
        if let Some(s) = self.srq.as_ref().filter(|_| !self.share_released) {
            // Admitted with the initial share; the connection's own once it
            // started on the queue.
            let share = if self.conn.takes_shared_receives() {
                // (With any receives given back and not yet taken: the
                // share already left them out.)
                self.conn.receive_share() + self.conn.take_returned()
            } else {
                self.conn.config().start_credits
            };
            s.release(share);
            self.share_released = true;
        }
    }

    // ---- calls ----

    /// Client: send a request with `header` and an optional payload `data`,
    /// as `proto::Connection::call` (the reply, the buffer's return, a refusal).
    pub fn call(&mut self, now: Duration, header: &[u8], data: Option<Buf>) -> Result<CallId, Refused> {
        self.call_traced(now, None, header, data)
    }

    /// [`Link::call`] carrying the caller's trace id (see
    /// `proto::Connection::call_traced`).
    pub fn call_traced(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<CallId, Refused> {
        self.send_maybe_inline(
            data,
            |conn, inline| conn.call_inline(now, trace, header, inline),
            |conn, data| conn.call_traced(now, trace, header, data),
        )
    }

    /// Send a call or reply with `data` inline (`inline_send`, when it fits
    /// `Config::inline_max`: its bytes are copied from the buffer into the
    /// frame, with no copy of their own on the way, and the buffer goes
    /// back to the pool, since nothing can reach it) or exposed (`send`),
    /// in the connection's span, then carry out what it asks of the NIC.
    /// Refused, the buffer goes back to the caller. (Not through
    /// [`Link::in_span`]: the nested closure cost every call 14
    /// instructions under callgrind.)
    fn send_maybe_inline<T>(
        &mut self,
        data: Option<Buf>,
        inline_send: impl FnOnce(&mut Connection, &[u8]) -> Result<T, Refused>,
        send: impl FnOnce(&mut Connection, Option<Buf>) -> Result<T, Refused>,
    ) -> Result<T, Refused> {
        let conn = &mut self.conn;
        let r = match data {
            Some(b) if b.len > 0 && b.len <= conn.config().inline_max && conn.check_buf(&b).is_ok() => {
                match self.span.in_scope(|| inline_send(conn, &b)) {
                    Ok(v) => {
                        conn.free(b);
                        Ok(v)
                    }
                    Err(Refused { error, .. }) => Err(Refused { error, data: Some(b) }),
                }
            }
            data => self.span.in_scope(|| send(conn, data)),
        };
        self.run();
        r
    }

    /// Client: give up on a call, as `proto::Connection::cancel`.
    pub fn cancel(&mut self, now: Duration, call: CallId) -> bool {
        self.with_conn(|c| c.cancel(now, call))
    }

    /// Server: answer `req` with `status`, `header` and an optional payload
    /// `data`, as `proto::Connection::reply`.
    pub fn reply(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<(), Refused> {
        if let Some(i) = self.delegation.call(req) {
            return self.reply_to_call(now, i, status, header, data);
        }
        self.send_maybe_inline(
            data,
            |conn, inline| conn.reply_inline(now, req, status, header, inline),
            |conn, data| conn.reply(now, req, status, header, data),
        )
    }

    // ---- closing ----

    /// Start closing (`proto::Connection::begin_close`); `Link::drive`
    /// (tests) or the hub reaps the flushes, then [`Link::finish_close`]
    /// destroys the QP. Never blocks.
    pub fn begin_close(&mut self, now: Duration) {
        self.in_span(|c| c.begin_close(now))
    }

    /// The peer went away or broke the protocol on its bootstrap stream: as
    /// `proto::Connection::peer_lost`, the commands carried out. Never blocks.
    pub fn peer_lost(&mut self, now: Duration, why: LossReason) {
        self.in_span(|c| c.peer_lost(now, why))
    }

    /// Close the connection: QP to ERR, reap the flushes, destroy the QP
    /// (after which no DMA of it is possible) and return every buffer.
    ///
    /// This waits (a bounded number of polls) for the flushes; a driver that
    /// must not block calls [`Link::begin_close`], drives until
    /// [`Connection::flushed`], then [`Link::finish_close`].
    #[cfg(any(test, feature = "testing"))]
    pub fn close(&mut self, now: Duration) {
        self.begin_close(now);
        self.drive(now);
        if self.qp != QpFate::Live {
            return;
        }
        // Reap the flushes before destroying the QP (rxe warns, and waits,
        // when a QP is destroyed while its flushes are still being
        // generated). Bounded: a backend whose clock does not move (the sim
        // in manual mode) simply falls through to the destroy, which is
        // evidence enough.
        for _ in 0..2000 {
            if self.flushed() {
                break;
            }
            std::thread::yield_now();
            self.drive(now);
        }
        self.finish_close(now);
    }

    /// Destroy the QP of a connection that is down, and return every buffer
    /// (nothing can reach or fill one after the destroy). Idempotent.
    pub fn finish_close(&mut self, now: Duration) {
        self.begin_close(now);
        if self.qp != QpFate::Live {
            return;
        }
        // The QP is in ERR (unless moving it there failed: then the destroy
        // is the evidence, if it works). Free the windows first (freeing a
        // bound window invalidates it without an invalidation work request).
        // A window whose deallocation fails is kept, and the QP is not
        // destroyed under it now: rxe stalls ~50 s destroying a QP that
        // still has a valid window bound to it, and then frees the QP while
        // the window still points at it (its later deallocation, or the
        // process's end, would invalidate through the freed QP). The QP
        // counts as stuck until the drop, which tries the windows again
        // before the destroy.
        let failed = if let Some(left) = self.free_windows() {
            hold_qp(self.shared.as_ref(), &self.local);
            Some(format!("{left}, so it was not destroyed under them"))
        } else {
            destroy_qp(&self.nic, self.shared.as_ref(), &self.local).err().map(|e| e.to_string())
        };
        if let Some(why) = failed {
            // No evidence (`proto::Connection::handle_qp_stuck`): what it could
            // reach stays with it until the drop destroys it, or for good.
            self.qp = QpFate::Stuck;
            let kept = self.conn.handle_qp_stuck(now);
            tracing::warn!(why, kept, "the QP is still alive after the close: the buffers and ranges it could still reach are not used again until it is destroyed (tried once more when the connection is dropped; otherwise the memory is released when the process ends)");
            // Its share of the shared receives stays taken too: the QP may
            // still take receives.
            self.run();
            return;
        }
        self.qp = QpFate::Destroyed;
        self.release_share();
        self.conn.handle_qp_destroyed(now);
        self.run();
    }
}

impl<N: Nic> Link<N> {
    /// Deallocate the connection's windows and the shared pool's windows
    /// lent to it (lent ones never go back to the pool); one whose
    /// deallocation fails is kept, to be tried again. `None` once all are
    /// gone; otherwise what is left, for the caller's one warning.
    fn free_windows(&mut self) -> Option<String> {
        let nic = &self.nic;
        let mut last = None;
        let mut dealloc = |w: MwId| nic.dealloc_mw(w).map_err(|e| last = Some(e)).is_ok();
        self.windows.retain(|&w| !dealloc(w));
        let lent = self.conn.release_lent_windows(&mut dealloc);
        last.map(|e| format!("{} memory window(s) of its own and {lent} lent by the shared pool could not be deallocated ({e})", self.windows.len()))
    }
}

impl<N: Nic> Drop for Link<N> {
    fn drop(&mut self) {
        // Order: QP to ERR (no more remote access), windows freed, QP
        // destroyed, then the memory and the CQ.
        if self.qp != QpFate::Destroyed {
            let _ = self.nic.set_qp_error(self.local.id);
        }
        // Windows whose deallocation failed in `finish_close` (or all of
        // them, if it never ran) are tried once more, before a QP whose
        // destroy failed or was held back there is tried again. A window
        // that still cannot go does not hold the QP back now: the NIC
        // handle's own end destroys its QPs anyway, and a QP kept alive
        // here would leave its route on the endpoint's queue stuck for
        // good (its number, once the device reuses it, taken twice).
        let windows_left = self.free_windows();
        if let Some(left) = &windows_left {
            tracing::warn!(%left, "deallocating memory windows failed again at the connection's drop: its queue pair is destroyed under them (rxe may stall on the destroy); they stay allocated until the device is closed, and the memory they may cover is not used again");
        }
        let gone =
            self.qp == QpFate::Destroyed || destroy_qp(&self.nic, self.shared.as_ref(), &self.local).is_ok();
        if gone {
            // The QP's own: nothing sends from the hub's send slots it
            // holds, or takes its share of the shared receives, any more.
            if let Some(srq) = &self.srq {
                self.lent.give_back(srq);
            }
            self.release_share();
        }
        // Nothing can reach the memory only once the QP is destroyed and
        // every window freed: a window still allocated is still bound, and
        // what checks its QP (on rxe a pointer to the freed QP) is no
        // evidence. Then the endpoint's regions and the shared pool's
        // buffers it exposed are the owner's again and its delegations
        // end; otherwise the pool's buffers serve nobody, the ranges stay
        // unwritable and the delegations' trees stay pinned, for good.
        let unreachable = gone && windows_left.is_none();
        if unreachable {
            self.regions.forget(self.conn.id());
            self.delegations_gone();
        }
        self.conn.release_pool_buffers(unreachable);
        if let Some(data) = self.data {
            let _ = self.nic.dereg_mr(data.id);
        }
        if let Some(ctrl) = &self.ctrl {
            let _ = self.nic.dereg_mr(ctrl.info.id);
        }
        for r in self.conn.region_infos() {
            let _ = self.nic.dereg_mr(r.id);
        }
        if self.shared.is_none() {
            let _ = self.nic.destroy_cq(self.cq);
        }
    }
}

#[cfg(fuzzing)]
impl<N: Nic> Link<N> {
    /// Fuzzing hook: handle `bytes` as if a SEND carrying them had arrived
    /// (with `invalidated` as a SEND_WITH_INV's rkey), counted against the
    /// credit granted (`proto::Connection::fuzz_deliver`), then run the
    /// engines.
    pub fn fuzz_deliver(&mut self, now: Duration, bytes: &[u8], invalidated: Option<u32>) {
        self.conn.fuzz_deliver(now, bytes, invalidated);
        self.run();
    }
}
