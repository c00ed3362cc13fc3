//! [`CqRouter`]: the sans-IO form of a [`Hub`](super::Hub), for a caller
//! that drives its [`Link`]s itself (its own event loop, a busy-polling
//! thread per core) instead of running async [`Connection`](super::Connection)s.
//!
//! It holds one completion queue (and, made with
//! [`CqRouter::with_shared_receives`], one shared receive queue) for many
//! endpoints, with the hub's rules: each endpoint's worst case is reserved
//! from the queue's depth ([`SetupError::CqBudget`] when it does not fit); a
//! QP is known from its creation; and a QP is destroyed under the router's
//! lock, with its completions taken out of the queue before its number can
//! come back (the queue is drained before the destroy too: some providers,
//! mlx5, erase a destroyed QP's completions). Those leftovers are dropped,
//! for the endpoint they belong to has returned everything by then (its QP
//! is gone: that is the evidence), except a shared receive, which goes back
//! to the shared queue. The hub and the router keep these books in one
//! `Routes` (`routes.rs`); a router's routes never get a target, for the
//! caller gives its endpoints only at a poll, so each holds its completions
//! until then.
//!
//! ```text
//! let router = CqRouter::new(nic, 1 << 16)?;
//! let ep = router.prepare(router.connection_nic()?, cfg)?.finish(policies)?;  // then connect it
//! loop {
//!     router.poll(now, &mut endpoints)?;        // completions to their endpoints (a map by QP number)
//!     for ep in endpoints.values_mut() {
//!         ep.drive(now);                                   // commands, buffers (it polls no queue)
//!         while let Some(e) = ep.poll_event() { ... }
//!         // ep.poll_timeout() / ep.handle_timeout(now) for its timers
//!     }
//!     // sleep until router.poll_ready(cx) or the next timeout
//! }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;

use super::hub::{unclaimed, CqHold};
use super::link::{QueueSizes, SharedCq};
use super::routes::Routes;
use super::srq::{SharedReceives, SrqConfig, SrqStats};
use super::{Config, Link, Prepared, SetupError};
use crate::backend::{Completion, CqId, Nic, NicError};

/// One completion queue for many endpoints driven by the caller; see the
/// module docs (`docs/serving.md`). Dropping it while endpoints made on it live is
/// safe: the queue goes with the last of them.
pub struct CqRouter<N: Nic> {
    shared: Arc<Shared<N>>,
}

/// The caller's endpoints, found by QP number ([`Link::local`]`.qpn`)
/// for [`CqRouter::poll`]. Implemented for a map by QP number and for a
/// vector (searched); implement it for your own container.
pub trait Links<N: Nic> {
    /// The endpoint whose QP has number `qpn`, or `None` to keep its
    /// completions for a later poll. A poll asks twice about a QP with
    /// completions (whether it has them, then to hand them over): give the
    /// same answer both times.
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Link<N>>;
}

impl<N: Nic> Links<N> for HashMap<u32, Link<N>> {
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Link<N>> {
        self.get_mut(&qpn)
    }
}

impl<N: Nic> Links<N> for std::collections::BTreeMap<u32, Link<N>> {
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Link<N>> {
        self.get_mut(&qpn)
    }
}

impl<N: Nic> Links<N> for Vec<Link<N>> {
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Link<N>> {
        self.iter_mut().find(|e| e.local().qpn == qpn)
    }
}

/// What a [`CqRouter`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouterStats {
    /// Links whose QP is on the queue (prepared or running).
    pub connections: usize,
    /// Queue entries reserved by them.
    pub reserved_entries: u64,
    /// The queue's depth.
    pub depth: u32,
    /// Completions handed to endpoints.
    pub completions: u64,
    /// Completions of a known QP whose endpoint the caller did not give
    /// (kept, and handed over at a later poll).
    pub deferred: u64,
    /// Completions of a QP the router does not know (none in a correct run).
    pub orphans: u64,
    /// Completions of a destroyed QP taken out of the queue and dropped.
    pub retired: u64,
    /// The shared receive queue, if the router has one.
    pub srq: Option<SrqStats>,
}

struct Shared<N: Nic> {
    hold: Arc<CqHold<N>>,
    srq: Option<Arc<SharedReceives<N>>>,
    state: Mutex<State>,
}

struct State {
    /// Its endpoints' QPs by number. The caller gives the endpoints only at
    /// a poll, so no route has a target: each holds its completions until
    /// a poll finds its endpoint. A QP is retired under this lock.
    routes: Routes<()>,
    /// The completions a poll hands over, by endpoint: kept so that a poll
    /// allocates nothing.
    handing: Vec<Completion>,
    taken: Vec<(u32, usize)>,
    completions: u64,
    deferred: u64,
}

impl<N: Nic> Shared<N> {
    /// Take every completion off the queue, each held for its QP's route.
    fn drain(&self, routes: &mut Routes<()>) -> Result<(), NicError> {
        self.hold.drain(routes, self.srq.as_deref(), |(), _| {}).map(drop)
    }
}

/// The destroy hook of a router's endpoints.
struct Retire<N: Nic>(Weak<Shared<N>>, #[allow(dead_code)] Arc<CqHold<N>>);

impl<N: Nic> SharedCq for Retire<N> {
    fn retire(&self, qpn: u32, destroy: &mut dyn FnMut()) {
        let Some(shared) = self.0.upgrade() else {
            destroy();
            return;
        };
        // What is still held for the QP once it is destroyed is dropped
        // (counted as retired): its endpoint has everything back by then,
        // the destroy being the evidence.
        shared.state.lock().routes.retire(
            qpn,
            |routes| {
                if let Err(e) = shared.drain(routes) {
                    tracing::warn!(%e, "polling the router's completion queue");
                }
            },
            destroy,
            |c| unclaimed(shared.srq.as_deref(), c),
        );
    }
}

impl<N: Nic + 'static> CqRouter<N> {
    /// A router whose completion queue, of `depth` entries, is created on
    /// `nic`. Give each endpoint [`CqRouter::connection_nic`].
    pub fn new(nic: N, depth: u32) -> Result<CqRouter<N>, SetupError> {
        CqRouter::make(nic, depth, None)
    }

    /// A router whose endpoints also take their control receives from one
    /// shared receive queue: as [`Hub::with_shared_receives`](super::Hub::with_shared_receives)
    /// (mw only).
    pub fn with_shared_receives(nic: N, depth: u32, srq: SrqConfig) -> Result<CqRouter<N>, SetupError> {
        let q = SharedReceives::new(nic.same_pd()?, srq)?;
        CqRouter::make(nic, depth, Some(Arc::new(q)))
    }

    fn make(nic: N, depth: u32, srq: Option<Arc<SharedReceives<N>>>) -> Result<CqRouter<N>, SetupError> {
        // Every receive of the shared queue may complete before a poll.
        let routes = Routes::new(depth, srq.as_ref().map_or(0, |q| q.max_slots()))?;
        let cq = nic.create_cq(depth)?;
        let shared = Arc::new(Shared {
            hold: Arc::new(CqHold { nic, cq }),
            srq,
            state: Mutex::new(State {
                routes,
                handing: Vec::new(),
                taken: Vec::new(),
                completions: 0,
                deferred: 0,
            }),
        });
        Ok(CqRouter { shared })
    }

    /// The handle the queue was created on.
    pub fn nic(&self) -> &N {
        &self.shared.hold.nic
    }

    /// The NIC handle for a new endpoint: a protection domain of its own,
    /// or with shared receives the router's (as [`Hub::connection_nic`](super::Hub::connection_nic)).
    pub fn connection_nic(&self) -> Result<N, NicError> {
        match &self.shared.srq {
            Some(_) => self.shared.hold.nic.same_pd(),
            None => self.shared.hold.nic.new_pd(),
        }
    }

    /// The completion queue (for the caller's readiness wait; see
    /// [`CqRouter::poll_ready`]).
    pub fn cq(&self) -> CqId {
        self.shared.hold.cq
    }

    /// [`Link::prepare`] on the router's queue, with the endpoint's
    /// worst case reserved ([`SetupError::CqBudget`] when it does not fit).
    /// Finish it, connect it, and from then on hand it its completions
    /// with [`CqRouter::poll`]. Its [`Link::drive`] polls no queue.
    pub fn prepare(&self, nic: N, cfg: Config) -> Result<Prepared<N>, SetupError> {
        let sizes = QueueSizes::of(&cfg)?;
        let entries = sizes.reserved(self.shared.srq.is_some());
        self.shared.state.lock().routes.reserve(entries)?;
        let retire: Arc<dyn SharedCq> =
            Arc::new(Retire(Arc::downgrade(&self.shared), self.shared.hold.clone()));
        let srq = self.shared.srq.clone();
        match Link::prepare_on(nic, cfg, sizes, self.shared.hold.cq, Some(retire), srq, None) {
            Ok(p) => {
                // Known before it can complete anything; a QP destroyed with
                // this number had its completions drained by then.
                self.shared.state.lock().routes.open(p.local().qpn, entries);
                Ok(p)
            }
            Err((_, e)) => {
                self.shared.state.lock().routes.release(entries);
                Err(e)
            }
        }
    }

    /// Take the completions off the queue and hand each to its endpoint in
    /// `endpoints` (one it does not have keeps its completions for a later
    /// poll). A destroyed QP's completions are taken out of the queue before
    /// its number can come back, so a completion handed over is always the
    /// current QP's with that number; remove an endpoint whose QP is
    /// destroyed from `endpoints` before another QP can get its number.
    /// Poll from one thread at a time (others may drop endpoints). Returns
    /// how many were handed over. Allocates nothing in
    /// steady state. A queue that fails (the device is gone) returns the
    /// error: take every endpoint on it down ([`Link::begin_close`],
    /// then [`Link::finish_close`]).
    pub fn poll(&self, now: Duration, endpoints: &mut impl Links<N>) -> Result<usize, NicError> {
        let mut st = self.shared.state.lock();
        let drained = self.shared.drain(&mut st.routes);
        let mut handing = std::mem::take(&mut st.handing);
        let mut taken = std::mem::take(&mut st.taken);
        st.routes.take_held(|qpn| endpoints.endpoint(qpn).is_some(), &mut handing, &mut taken);
        st.deferred += st.routes.held() as u64;
        // Handed over outside the lock: an endpoint that destroys its QP
        // retires through it (parking_lot's mutex is not reentrant).
        drop(st);
        let mut at = 0;
        for &(qpn, n) in &taken {
            let ep = endpoints.endpoint(qpn).unwrap_or_else(|| {
                panic!("Links::endpoint gave QP {qpn:#x}'s endpoint, then none, within one CqRouter::poll: answer the same until the poll returns")
            });
            ep.handle_completions(now, &handing[at..at + n]);
            at += n;
        }
        let handed = handing.len();
        handing.clear();
        taken.clear();
        let mut st = self.shared.state.lock();
        st.handing = handing;
        st.taken = taken;
        st.completions += handed as u64;
        drop(st);
        let srq_seen = handed > 0;
        if let Some(q) = self.shared.srq.as_ref().filter(|_| srq_seen) {
            q.check_limit();
        }
        drained.map(|()| handed)
    }

    /// Readiness of the queue, as [`Nic::poll_cq_ready`]: `Ready` means
    /// poll again. Call it after a [`CqRouter::poll`] that handed nothing.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<Result<(), NicError>> {
        if self.shared.state.lock().routes.held() > 0 {
            return Poll::Ready(Ok(()));
        }
        self.shared.hold.nic.poll_cq_ready(self.shared.hold.cq, cx)
    }

    /// What the router has done so far.
    pub fn stats(&self) -> RouterStats {
        let st = self.shared.state.lock();
        RouterStats {
            connections: st.routes.len(),
            reserved_entries: st.routes.reserved(),
            depth: st.routes.depth(),
            completions: st.completions,
            deferred: st.deferred,
            orphans: st.routes.orphans(),
            retired: st.routes.retired(),
            srq: self.shared.srq.as_ref().map(|q| q.stats()),
        }
    }
}
