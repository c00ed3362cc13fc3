//! [`Hub`]: one completion queue and one driver for the connections of an
//! [`Endpoint`](super::Endpoint), whose engine it is.
//!
//! Every connection's queue pair completes on the hub's one completion
//! queue, and one driver ([`Hub::run`]) polls it, hands each completion to
//! its connection (by QP number) and gives a turn to each connection that
//! has something to do (a completion, a user's call or reply, a timer).
//!
//! The rules it keeps, and why: `docs/serving.md`, "The hub's rules". The
//! routing table and the depth's reservations are `routes.rs`'s `Routes`;
//! the hub does the device work around it.

mod driver;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::bufpool::{BufferPool, BufferPoolStats};
use super::link::{QueueSizes, SharedCq};
use super::live::Inner;
use super::ready::{Mark, ReadyList};
use super::regions::Regions;
use super::routes::{Routed, Routes};
use super::srq::{SharedReceives, SrqConfig, SrqStats};
use super::{BufClass, Config, Connection, Link, Prepared, RegionId, Role, SetupError, UseError};
use crate::backend::{Completion, CqId, Nic, NicError};
use crate::telemetry::Tally;

/// Completions taken per poll of the shared queue (the routes' scratch
/// array's size).
use super::routes::BATCH as POLL_BATCH;

/// What an [`Endpoint`](super::Endpoint)'s completion queue and driver
/// have done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EndpointStats {
    /// Connections on the endpoint now (being set up or running, not yet
    /// finished).
    pub connections: usize,
    /// Connections added over the endpoint's life.
    pub added: u64,
    /// Completion queue entries reserved by the connections on it.
    pub reserved_entries: u64,
    /// The completion queue's depth.
    pub depth: u32,
    /// Completions taken off the queue.
    pub completions: u64,
    /// Completions of QPs the endpoint does not know (none in a correct run: a
    /// QP is known from its creation until its completions are drained), or
    /// of a QP whose destroy failed (`docs/protocol.md`, "Evidence, not
    /// timeouts").
    pub orphans: u64,
    /// Turns the driver took (poll, timers, connection turns).
    pub turns: u64,
    /// Connection turns given.
    pub connection_turns: u64,
    /// Times the driver slept (queue armed, waiting).
    pub sleeps: u64,
    /// The shared receive queue, on an endpoint with shared receives
    /// ([`EndpointBuilder::shared_receives`](super::EndpointBuilder::shared_receives)).
    pub srq: Option<SrqStats>,
    /// The shared buffer pool, on an endpoint with one
    /// ([`EndpointBuilder::shared_buffers`](super::EndpointBuilder::shared_buffers)).
    pub buffers: Option<BufferPoolStats>,
}

/// A hub's shared completion queue and
/// the handle it was made on; destroyed when the last of its owner and
/// the endpoints on it lets go (a queue outlives every QP on it).
pub(super) struct CqHold<N: Nic> {
    pub(super) nic: N,
    pub(super) cq: CqId,
}

impl<N: Nic> CqHold<N> {
    /// Take every completion off the queue, each where `routes` says: to
    /// `deliver` with its route's target, held for its route, or, with no
    /// route, to nobody ([`unclaimed`]). How many were taken. Under the
    /// owner's lock (a QP is retired under it).
    pub(super) fn drain<T: Clone>(
        &self,
        routes: &mut Routes<T>,
        srq: Option<&SharedReceives<N>>,
        mut deliver: impl FnMut(&T, Completion),
    ) -> Result<usize, NicError> {
        let mut batch = std::mem::take(&mut routes.batch);
        if batch.is_empty() {
            batch.resize(POLL_BATCH, Completion::EMPTY);
        }
        let mut total = 0;
        let r = loop {
            let n = match self.nic.poll_cq(self.cq, &mut batch) {
                Ok(n) => n,
                Err(e) => break Err(e),
            };
            if n == 0 {
                break Ok(total);
            }
            total += n;
            for c in &batch[..n] {
                match routes.route(*c) {
                    Routed::To(target) => deliver(target, *c),
                    Routed::Held => {}
                    Routed::Orphan => unclaimed(srq, c),
                }
            }
            if n < batch.len() {
                // Fewer than asked: the queue was empty (no poll that
                // finds nothing).
                break Ok(total);
            }
        };
        routes.batch = batch;
        r
    }
}

/// A completion nobody will take: a shared receive is posted again, or
/// the shared queue would lose it for good.
pub(super) fn unclaimed<N: Nic>(srq: Option<&SharedReceives<N>>, c: &Completion) {
    if let Some(q) = srq {
        q.repost_unclaimed(c);
    }
}

impl<N: Nic> Drop for CqHold<N> {
    fn drop(&mut self) {
        if let Err(e) = self.nic.destroy_cq(self.cq) {
            tracing::warn!(%e, "destroying a shared completion queue");
        }
    }
}

/// One completion queue and one driver for the connections of an
/// [`Endpoint`](super::Endpoint), shared by the endpoint's handles, the
/// driver ([`Hub::run`]) and each connection (weakly); see the module docs.
pub(crate) struct Hub<N: Nic> {
    hold: Arc<CqHold<N>>,
    /// The shared receive queue its connections take their receives from,
    /// if it has one.
    srq: Option<Arc<SharedReceives<N>>>,
    /// The buffer pool its connections take their buffers from, if it has one.
    pool: Option<BufferPool>,
    /// The endpoint's regions (`regions.rs`); each connection holds them too.
    regions: Arc<Regions<N>>,
    epoch: crate::conn::clock::Epoch,
    /// Its connections by QP number. A QP is retired under this lock.
    routes: Mutex<Routes<Arc<Inner<N>>>>,
    /// Connections due a turn, the driver's doorbell, and the count of
    /// waiters taking their connection's turns themselves (see `ready.rs`).
    pub(in crate::conn) ready: ReadyList<Arc<Inner<N>>>,
    /// The endpoint is gone ([`Hub::close`]).
    closed: AtomicBool,
    /// A poll found SEND_WITH_INVs (`Routes::take_foreign`), whose windows'
    /// owners must hear of them before any connection's next turn
    /// ([`Hub::invalidations_found`]). Set under the routing lock.
    foreign: AtomicBool,
    /// How long the driver keeps polling an idle queue before it sleeps.
    busy_poll: Duration,
    added: AtomicU64,
    completions: AtomicU64,
    turns: AtomicU64,
    connection_turns: AtomicU64,
    sleeps: AtomicU64,
    /// Telemetry's books (`record_metrics`).
    telemetry: Mutex<Members<N>>,
    /// Held through a record, so that records write their totals in order.
    recording: Mutex<()>,
}

/// Telemetry's books: the connections added and not yet finished, and the
/// figures of those that finished, with how many have (the epoch a
/// finished connection's figures came in at). A connection leaves
/// `running` as its figures enter `finished`, under this lock, so a
/// record that takes both under it counts each connection once.
struct Members<N: Nic> {
    epoch: u64,
    finished: Tally,
    /// By connection id (`Inner::id`).
    running: std::collections::HashMap<u64, Arc<Inner<N>>>,
}

impl<N: Nic> Hub<N> {
    /// Live exposures were revoked since the last call (by the owner's
    /// application, or a holder on its connection's turn): ring the
    /// connections exposing them, so that each takes a turn and ends
    /// them (`Link::delegation_turn`). The others are not woken.
    #[inline]
    pub(super) fn ring_ends(&self) {
        if self.regions.take_ring() {
            self.ring_exposing();
        }
    }

    #[cold]
    #[inline(never)]
    fn ring_exposing(&self) {
        let mut conns = Vec::new();
        self.regions.ends_conns(&mut conns);
        let ringing: Vec<Arc<Inner<N>>> = {
            let m = self.telemetry.lock();
            conns.iter().filter_map(|id| m.running.get(id).cloned()).collect()
        };
        for inner in ringing {
            inner.ring();
        }
    }

    /// Take every completion off the queue into its connection's inbox,
    /// queueing the connection for a turn. Under the routing lock.
    /// `ring`: wake the driver for the connections queued (not when the
    /// driver polls, for it takes their turns next: a ring would cost it
    /// another loop and a sleep that returns at once).
    /// Returns how many completions were taken and how many of those
    /// queued their connection (the others wait in its inbox for its next
    /// turn, `HubPart::route`).
    fn poll(&self, routes: &mut Routes<Arc<Inner<N>>>, ring: bool) -> Result<(usize, usize), NicError> {
        let mut queued = 0;
        let n = self.hold.drain(routes, self.srq.as_deref(), |inner, c| {
            if inner.hub.route(c) {
                queued += 1;
                self.queue_ringing(inner, ring);
            }
        });
        // (On a failure too: what was routed before it counts.)
        self.note_foreign(routes);
        let n = n?;
        if n > 0 {
            self.completions.fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok((n, queued))
    }

    /// Drain the queue before a route changes hands (a QP retired, a stuck
    /// one's number taken over): every completion of the old QP reaches its
    /// connection, or nobody. A failed poll is logged, and the change goes
    /// on: the QP is gone either way.
    fn drain_for_route(&self, routes: &mut Routes<Arc<Inner<N>>>) {
        if let Err(e) = self.poll(routes, true) {
            tracing::warn!(%e, "polling the hub's completion queue");
        }
    }

    /// After a poll, under the routing lock: whether SEND_WITH_INVs came.
    #[inline]
    fn note_foreign(&self, routes: &Routes<Arc<Inner<N>>>) {
        if routes.has_foreign() {
            self.mark_foreign();
        }
    }

    #[cold]
    #[inline(never)]
    fn mark_foreign(&self) {
        self.foreign.store(true, Ordering::Release);
    }

    /// Hand the rkeys of windows that SEND_WITH_INVs invalidated, found by
    /// any poll, to their owners (`Hub::invalidated_elsewhere`), before
    /// any connection's next turn: called by the driver after its poll and
    /// before each turn, and by a waiter before its own, with no
    /// connection's state locked. One load when none came.
    #[inline]
    pub(in crate::conn) fn invalidations_found(&self, now: Duration) {
        if self.foreign.load(Ordering::Acquire) {
            self.hand_on_foreign(now);
        }
    }

    #[cold]
    #[inline(never)]
    fn hand_on_foreign(&self, now: Duration) {
        let found = {
            let mut routes = self.routes.lock();
            self.foreign.store(false, Ordering::Relaxed);
            routes.take_foreign()
        };
        for (rkey, from) in found {
            self.invalidated_elsewhere(from.as_deref(), now, rkey);
        }
    }

    /// Put a connection on the ready list (once) and wake the driver.
    fn queue(&self, inner: &Arc<Inner<N>>) {
        self.queue_ringing(inner, true)
    }

    fn queue_ringing(&self, inner: &Arc<Inner<N>>, ring: bool) {
        self.ready.push(&inner.hub.queued, || inner.clone(), ring);
    }
}

/// The destroy hook a hub's endpoints hold: the hub weakly (a connection
/// does not keep its hub alive), the queue strongly (it outlives the QP).
struct Retire<N: Nic>(Weak<Hub<N>>, #[allow(dead_code)] Arc<CqHold<N>>);

impl<N: Nic> SharedCq for Retire<N> {
    fn retire(&self, qpn: u32, destroy: &mut dyn FnMut() -> bool) {
        let Some(shared) = self.0.upgrade() else {
            destroy();
            return;
        };
        let mut routes = shared.routes.lock();
        // Its completions drained after the destroy go to its inbox with
        // the others'; an unadded connection's go to nobody.
        let gone = routes.retire(
            qpn,
            |routes| shared.drain_for_route(routes),
            destroy,
            |c| unclaimed(shared.srq.as_deref(), c),
        );
        // (Its polls noted any SEND_WITH_INV: handed on before the next
        // turn, not here, where a connection's state is locked.)
        drop(routes);
        // Dropped outside the lock: it may hold the last handle on a
        // connection, whose endpoint would retire through here again.
        drop(gone);
        shared.ready.bell().ring();
    }
}

impl<N: Nic> Hub<N> {
    /// Connection `id` finished: `add` puts its figures into the hub's
    /// tally of finished connections, and it leaves the running ones.
    /// Returns the epoch they came in at.
    pub(in crate::conn) fn fold(&self, id: u64, add: &mut dyn FnMut(&mut Tally)) -> u64 {
        let mut m = self.telemetry.lock();
        m.epoch += 1;
        add(&mut m.finished);
        let gone = m.running.remove(&id);
        let epoch = m.epoch;
        drop(m);
        // Not the last handle (the turn that folds holds one), but dropped
        // outside the lock all the same.
        drop(gone);
        epoch
    }

    /// A waiting call of connection `me` polls the shared queue
    /// (`live::driver::Spin::turn`): `me`'s completions go to its inbox
    /// without queueing it (the caller takes that turn), the others' as
    /// the driver would route them. Whether anything came.
    pub(in crate::conn) fn poll_for(&self, me: &Inner<N>) -> bool {
        let Some(mut routes) = self.routes.try_lock() else {
            // The driver (or another caller) is polling: it routes ours too.
            return false;
        };
        let n = self.hold.drain(&mut routes, self.srq.as_deref(), |inner, c| {
            if inner.hub.route(c) && !std::ptr::eq(Arc::as_ptr(inner), me) {
                self.queue(inner);
            }
        });
        // The caller hands them on before its turn (`Spin::turn`).
        self.note_foreign(&routes);
        drop(routes);
        match n {
            Ok(n) => {
                self.completions.fetch_add(n as u64, Ordering::Relaxed);
                if let Some(srq) = self.srq.as_ref().filter(|_| n > 0) {
                    // As the driver does after a poll that took receives:
                    // while waiters poll, its own polls find few.
                    srq.check_limit();
                }
                n > 0
            }
            // The driver sees the failure at its next poll.
            Err(_) => {
                self.ready.bell().ring();
                false
            }
        }
    }
}

/// A connection's place on its hub: the waker that puts it on the hub's
/// ready list, and the completions the hub routed to it.
pub(in crate::conn) struct HubPart<N: Nic> {
    /// Woken by the user ([`Inner::ring`]), the buffer-return hook and
    /// the pool: it queues the connection for a turn and wakes the hub.
    pub(in crate::conn) waker: std::task::Waker,
    /// On the hub's ready list already.
    pub(in crate::conn) queued: crate::conn::ready::Mark,
    /// Completions of its QP, taken off the shared queue by the hub.
    pub(in crate::conn) inbox: Mutex<Vec<crate::backend::Completion>>,
    /// The vector a spinning waiter trades for the inbox on its turns
    /// (`driver::Spin`): empty between them.
    pub(in crate::conn) spin_scratch: Mutex<Vec<crate::backend::Completion>>,
    /// The hub, for a call that polls its queue itself while it waits.
    pub(in crate::conn) hub: Weak<Hub<N>>,
    /// A grant SEND's success may wait in the inbox for the next turn: set
    /// by `Inner::turn` (its end says when), read by [`HubPart::route`].
    pub(in crate::conn) lazy_grant_sends: std::sync::atomic::AtomicBool,
}

impl<N: Nic> HubPart<N> {
    /// Put `c` in the inbox; whether the connection needs a turn for it
    /// (false only for a grant SEND's success while `lazy_grant_sends`; why
    /// no completion is missed: the end of `Inner::turn`).
    #[inline]
    pub(in crate::conn) fn route(&self, c: crate::backend::Completion) -> bool {
        let mut inbox = self.inbox.lock();
        inbox.push(c);
        !(mwcap_mw::Token::from_wr_id(c.wr_id).is_grant_send()
            && c.status.is_success()
            && self.lazy_grant_sends.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// The waker of a connection on a hub: queue it for a turn.
struct ConnWake<N: Nic> {
    conn: Weak<Inner<N>>,
    hub: Weak<Hub<N>>,
}

impl<N: Nic> futures::task::ArcWake for ConnWake<N> {
    fn wake_by_ref(this: &Arc<Self>) {
        if let (Some(conn), Some(hub)) = (this.conn.upgrade(), this.hub.upgrade()) {
            hub.queue(&conn);
        }
    }
}

impl<N: Nic + 'static> Hub<N> {
    /// A hub whose completion queue, of `depth` entries, is created on
    /// `nic`; `Hub::run` drives it (the endpoint's `EndpointDriver`). The
    /// options are the `EndpointBuilder`'s (`queue_depth`,
    /// `shared_receives`, `shared_buffers`, `trusted_peers` as `confirm`,
    /// `busy_poll`), documented there. Without `srq` or `buffers` its
    /// connections' NIC handles are siblings of `nic`, each in a protection
    /// domain of its own ([`Hub::connection_nic`]).
    pub fn new(
        nic: N,
        depth: u32,
        srq: Option<SrqConfig>,
        buffers: Option<&[BufClass]>,
        confirm: bool,
        busy_poll: Duration,
    ) -> Result<Arc<Hub<N>>, SetupError> {
        // A shared pool comes with shared receives (of the default size
        // unless given).
        let srq = srq.or(buffers.map(|_| SrqConfig::default()));
        let pool =
            buffers.map(|classes| BufferPool::register(nic.same_pd()?, classes, confirm)).transpose()?;
        let srq = srq
            .map(|q| Ok::<_, SetupError>(Arc::new(SharedReceives::new(nic.same_pd()?, q, confirm)?)))
            .transpose()?;
        // Every receive of the shared queue may complete before the driver
        // polls: their entries are reserved once, up front.
        let routes = Routes::new(depth, srq.as_ref().map_or(0, |q| q.max_slots()))?;
        // The driver sleeps on the alarm thread: started now, with the
        // endpoint, not by the first call that waits.
        super::alarm::start();
        // Connections on shared receives are in the hub's PD: a region is
        // registered once, there.
        let epoch = crate::conn::clock::Epoch::new();
        let regions = Arc::new(Regions::new(if srq.is_some() { Some(nic.same_pd()?) } else { None }, epoch));
        let cq = nic.create_cq(depth)?;
        Ok(Arc::new(Hub {
            hold: Arc::new(CqHold { nic, cq }),
            srq,
            pool,
            regions,
            epoch,
            routes: Mutex::new(routes),
            ready: ReadyList::new(),
            closed: AtomicBool::new(false),
            foreign: AtomicBool::new(false),
            busy_poll,
            added: AtomicU64::new(0),
            completions: AtomicU64::new(0),
            turns: AtomicU64::new(0),
            connection_turns: AtomicU64::new(0),
            sleeps: AtomicU64::new(0),
            telemetry: Mutex::new(Members {
                epoch: 0,
                finished: Tally::default(),
                running: Default::default(),
            }),
            recording: Mutex::new(()),
        }))
    }

    /// The NIC handle for a new connection on this hub: a protection domain
    /// of its own (`NicOps::new_pd`), or on a hub with shared receives a
    /// handle on the hub's PD (`NicOps::same_pd`), where its QP can take
    /// receives from the hub's queue.
    pub fn connection_nic(&self) -> Result<N, NicError> {
        match &self.srq {
            Some(_) => self.hold.nic.same_pd(),
            None => self.hold.nic.new_pd(),
        }
    }

    /// [`Link::prepare_on`] on the hub's completion queue: the QP, with
    /// its share of the queue reserved. `nic` must be a sibling of the
    /// hub's ([`Hub::connection_nic`]). Finish it, connect it, and
    /// hand it to [`Hub::add`]; dropping it on the way gives its share back.
    pub fn prepare(self: &Arc<Self>, nic: N, role: Role, cfg: Config) -> Result<Prepared<N>, SetupError> {
        let sizes = QueueSizes::of(&cfg)?;
        // Reserved now (or refused with `CqBudget`), given back on failure.
        let entries = sizes.reserved(self.srq.is_some());
        self.routes.lock().reserve(entries)?;
        let retire: Arc<dyn SharedCq> = Arc::new(Retire(Arc::downgrade(self), self.hold.clone()));
        let srq = self.srq.clone();
        let prepared =
            match Link::prepare_on(nic, role, cfg, sizes, self.hold.cq, Some(retire), srq, self.pool.clone())
            {
                Ok(p) => p,
                Err((_, e)) => {
                    self.routes.lock().release(entries);
                    return Err(e);
                }
            };
        // The QP has posted nothing and is not connected: it has no
        // completion yet, and is known to the hub before it can have one.
        // A QP destroyed with this number had its completions drained under
        // the lock by then; one whose destroy failed (a stuck route) is
        // gone now that the device gave its number out again, and what it
        // left on the queue is drained first.
        let qpn = prepared.local().qpn;
        let mut routes = self.routes.lock();
        let took = routes.take_over_stuck(qpn, |routes| self.drain_for_route(routes));
        if took {
            tracing::info!(
                qpn,
                "a new queue pair has the number of one whose destroy failed: its route is the new one's"
            );
        }
        routes.open(qpn, entries);
        drop(routes);
        Ok(prepared)
    }

    /// Run a connected link made with [`Hub::prepare`] on this hub, its
    /// peer proved (or vouched for) as `identity`: the name delegated
    /// tokens must be for to redeem on it.
    ///
    /// # Panics
    /// If `ep` was not prepared on this hub.
    pub fn add(self: &Arc<Self>, mut ep: Link<N>, identity: Option<Arc<str>>) -> Connection<N> {
        // Before the connection runs: a redemption may be its first frame,
        // and is checked against this identity.
        ep.set_identity(identity);
        ep.set_regions(self.regions.clone());
        let qpn = ep.local().qpn;
        let hub = Arc::downgrade(self);
        let conn = Connection::on_hub(ep, self.epoch, |w| HubPart {
            waker: futures::task::waker(Arc::new(ConnWake { conn: w, hub })),
            queued: Mark::default(),
            // The inbox, the spinner's vector and the driver's trade places
            // (`Inner::turn`): each has a batch's room from the start, or
            // the first burst routed to one without would grow it on the
            // data path.
            inbox: Mutex::new(Vec::with_capacity(POLL_BATCH)),
            spin_scratch: Mutex::new(Vec::with_capacity(POLL_BATCH)),
            hub: Arc::downgrade(self),
            lazy_grant_sends: std::sync::atomic::AtomicBool::new(false),
        });
        let inner = conn.inner_arc();
        // Counted from now until its figures move to the finished ones.
        let members = {
            let mut t = self.telemetry.lock();
            t.running.insert(inner.id, inner.clone());
            t.running.len()
        };
        self.ready.reserve(members);
        {
            let part = &inner.hub;
            let mut routes = self.routes.lock();
            if routes.attach(qpn, inner.clone(), &mut part.inbox.lock()).is_err() {
                drop(routes);
                panic!("Hub::add: the endpoint of QP {qpn:#x} was not prepared on this hub (Hub::prepare)");
            }
        }
        self.added.fetch_add(1, Ordering::Relaxed);
        self.queue(&inner);
        conn
    }

    /// The endpoint's regions (`regions.rs`).
    pub(super) fn regions(&self) -> &Regions<N> {
        &self.regions
    }

    /// Deregister region `id` (see [`Regions::deregister`]), then release
    /// each connection's registration of it.
    pub(super) fn deregister_region(&self, id: RegionId) -> Result<(), UseError> {
        self.regions.deregister(id)?;
        // Taken out of the books' lock: a connection folds its figures
        // into them under its own.
        let running: Vec<Arc<Inner<N>>> = self.telemetry.lock().running.values().cloned().collect();
        for inner in running {
            inner.forget_region(id);
        }
        Ok(())
    }

    /// The owner's application revokes delegation `cap` (see
    /// `delegate.rs`); the connections holding a live exposure of it get
    /// a turn to invalidate it.
    pub(super) fn revoke(&self, cap: super::CapId) -> Result<(), super::RevokeError> {
        self.regions.revoke(cap)?;
        self.ring_ends();
        Ok(())
    }

    /// Record the hub's figures through the `metrics` facade, labelled
    /// `endpoint = name` (see [`crate::telemetry`]).
    pub(crate) fn record_metrics(&self, name: &str) {
        let s = self;
        let _one_at_a_time = s.recording.lock();
        // The finished connections' figures and the running ones, as of one
        // epoch; then each running connection's own, unless it finished by
        // that epoch (it folds under its own lock, which `tally_into`
        // takes): each connection counted once, and none missed.
        let (epoch, mut tally, running) = {
            let m = s.telemetry.lock();
            (m.epoch, m.finished, m.running.values().cloned().collect::<Vec<_>>())
        };
        for inner in &running {
            inner.tally_into(epoch, &mut tally);
        }
        let connections = running.len();
        drop(running);
        let pool = s.pool.as_ref().map(BufferPool::stats);
        let delegations = s.regions.delegation_figures();
        tally.record(name, connections, pool.as_ref(), delegations.live);
        crate::telemetry::record_regions(name, s.regions.figures());
        crate::telemetry::record_delegations(name, &delegations);
    }
}

impl<N: Nic> Hub<N> {
    /// What the hub has done so far.
    pub(crate) fn stats(&self) -> EndpointStats {
        let routes = self.routes.lock();
        EndpointStats {
            connections: routes.len(),
            added: self.added.load(Ordering::Relaxed),
            reserved_entries: routes.reserved(),
            depth: routes.depth(),
            completions: self.completions.load(Ordering::Relaxed),
            orphans: routes.orphans(),
            turns: self.turns.load(Ordering::Relaxed),
            connection_turns: self.connection_turns.load(Ordering::Relaxed),
            sleeps: self.sleeps.load(Ordering::Relaxed),
            srq: self.srq.as_ref().map(|s| s.stats()),
            buffers: self.pool.as_ref().map(BufferPool::stats),
        }
    }

    /// The endpoint is gone (its last handle dropped): the driver ends
    /// once every connection has finished.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.ready.bell().ring();
    }
}

impl<N: Nic> Drop for Hub<N> {
    fn drop(&mut self) {
        // Connections still routed here (the driver was dropped before they
        // finished) go now, unless a user still holds one; the queue goes
        // with the last of them (`CqHold`).
        self.routes.get_mut().clear();
    }
}

impl<N: Nic> std::fmt::Debug for Hub<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").field("stats", &self.stats()).finish()
    }
}
