//! [`CqRouter`]: the sans-IO form of a [`Hub`](super::Hub), for a caller
//! that drives its [`Endpoint`]s itself (its own event loop, a busy-polling
//! thread per core) instead of running async [`Connection`](super::Connection)s.
//!
//! It holds one completion queue (and, made with
//! [`CqRouter::with_shared_receives`], one shared receive queue) for many
//! endpoints, with the hub's rules: each endpoint's worst case is reserved
//! from the queue's depth ([`NicError::CqBudget`] when it does not fit); a
//! QP is known from its creation; and a QP is destroyed under the router's
//! lock, with its completions taken out of the queue before its number can
//! come back (the queue is drained before the destroy too: some providers,
//! mlx5, erase a destroyed QP's completions). Those leftovers are dropped,
//! for the endpoint they belong to has returned everything by then (its QP
//! is gone: that is the evidence), except a shared receive, which goes back
//! to the shared queue.
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

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;

use super::endpoint::{QueueSizes, SharedCq};
use super::hub::CqHold;
use super::srq::{SharedReceives, SrqConfig, SrqStats};
use super::{Config, Endpoint, Prepared, SetupError};
use crate::backend::{Completion, CqId, Nic, NicError};

/// Completions taken per poll of the queue.
const BATCH: usize = 64;

/// One completion queue for many endpoints driven by the caller; see the
/// module docs (`docs/serving.md`). Dropping it while endpoints made on it live is
/// safe: the queue goes with the last of them.
pub struct CqRouter<N: Nic> {
    shared: Arc<Shared<N>>,
}

/// The caller's endpoints, found by QP number ([`Endpoint::local`]`.qpn`)
/// for [`CqRouter::poll`]. Implemented for a map by QP number and for a
/// vector (searched); implement it for your own container.
pub trait Endpoints<N: Nic> {
    /// The endpoint whose QP has number `qpn`, or `None` to keep its
    /// completions for a later poll.
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Endpoint<N>>;
}

impl<N: Nic> Endpoints<N> for HashMap<u32, Endpoint<N>> {
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Endpoint<N>> {
        self.get_mut(&qpn)
    }
}

impl<N: Nic> Endpoints<N> for std::collections::BTreeMap<u32, Endpoint<N>> {
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Endpoint<N>> {
        self.get_mut(&qpn)
    }
}

impl<N: Nic> Endpoints<N> for Vec<Endpoint<N>> {
    fn endpoint(&mut self, qpn: u32) -> Option<&mut Endpoint<N>> {
        self.iter_mut().find(|e| e.local().qpn == qpn)
    }
}

/// What a [`CqRouter`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RouterStats {
    /// Endpoints whose QP is on the queue (prepared or running).
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
    depth: u32,
    state: Mutex<State>,
}

struct State {
    /// QP number to its reservation of the queue's entries.
    known: HashMap<u32, u32>,
    reserved: u64,
    /// Completions taken off the queue and not yet handed over (drained
    /// while a QP was destroyed, or whose endpoint was not given).
    pending: VecDeque<Completion>,
    batch: Vec<Completion>,
    completions: u64,
    deferred: u64,
    orphans: u64,
    retired: u64,
}

impl<N: Nic> Shared<N> {
    /// Move every completion on the queue into `pending`.
    fn drain(&self, st: &mut State) -> Result<(), NicError> {
        let mut batch = std::mem::take(&mut st.batch);
        let r = loop {
            match self.hold.nic.poll_cq(self.hold.cq, &mut batch) {
                Ok(0) => break Ok(()),
                Ok(n) => st.pending.extend(batch[..n].iter().copied()),
                Err(e) => break Err(e),
            }
        };
        st.batch = batch;
        r
    }

    /// A completion nobody will take: a shared receive goes back.
    fn drop_completion(&self, c: &Completion) {
        if let Some(q) = &self.srq {
            q.repost_unclaimed(c);
        }
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
        let mut st = shared.state.lock();
        // Take what is queued before the destroy too: some providers (mlx5)
        // erase a destroyed QP's completions, and a shared receive among
        // them would never be posted again.
        if let Err(e) = shared.drain(&mut st) {
            tracing::warn!(%e, "polling the router's completion queue");
        }
        destroy();
        // After destroy_qp no completion of it appears: take what is queued
        // before the number is free, and drop that QP's.
        if let Err(e) = shared.drain(&mut st) {
            tracing::warn!(%e, "polling the router's completion queue");
        }
        let before = st.pending.len();
        st.pending.retain(|c| {
            if c.qpn == qpn {
                shared.drop_completion(c);
                false
            } else {
                true
            }
        });
        st.retired += (before - st.pending.len()) as u64;
        if let Some(entries) = st.known.remove(&qpn) {
            st.reserved -= u64::from(entries);
        }
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
        let for_receives = srq.as_ref().map_or(0, |q| q.max_slots());
        if for_receives >= depth {
            return Err(NicError::CqBudget { depth, reserved: 0, wanted: for_receives }.into());
        }
        let cq = nic.create_cq(depth)?;
        let shared = Arc::new(Shared {
            hold: Arc::new(CqHold { nic, cq }),
            srq,
            depth,
            state: Mutex::new(State {
                known: HashMap::new(),
                reserved: u64::from(for_receives),
                pending: VecDeque::new(),
                batch: vec![Completion::EMPTY; BATCH],
                completions: 0,
                deferred: 0,
                orphans: 0,
                retired: 0,
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

    /// [`Endpoint::prepare`] on the router's queue, with the endpoint's
    /// worst case reserved ([`NicError::CqBudget`] when it does not fit).
    /// Finish it, connect it, and from then on hand it its completions
    /// with [`CqRouter::poll`]. Its [`Endpoint::drive`] polls no queue.
    pub fn prepare(&self, nic: N, cfg: Config) -> Result<Prepared<N>, SetupError> {
        let sizes = QueueSizes::of(&cfg)?;
        let entries = sizes.reserved(self.shared.srq.is_some());
        {
            let mut st = self.shared.state.lock();
            if st.reserved + u64::from(entries) > u64::from(self.shared.depth) {
                let reserved = st.reserved;
                return Err(NicError::CqBudget { depth: self.shared.depth, reserved, wanted: entries }.into());
            }
            st.reserved += u64::from(entries);
        }
        let retire: Arc<dyn SharedCq> =
            Arc::new(Retire(Arc::downgrade(&self.shared), self.shared.hold.clone()));
        let srq = self.shared.srq.clone();
        match Endpoint::prepare_on(nic, cfg, sizes, self.shared.hold.cq, Some(retire), srq, None) {
            Ok(p) => {
                // Known before it can complete anything; a QP destroyed with
                // this number had its completions drained by then.
                self.shared.state.lock().known.insert(p.local().qpn, entries);
                Ok(p)
            }
            Err((_, e)) => {
                self.shared.state.lock().reserved -= u64::from(entries);
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
    /// error: take every endpoint on it down ([`Endpoint::begin_close`],
    /// then [`Endpoint::finish_close`]).
    pub fn poll(&self, now: Duration, endpoints: &mut impl Endpoints<N>) -> Result<usize, NicError> {
        let mut st = self.shared.state.lock();
        let drained = self.shared.drain(&mut st);
        let mut handed = 0;
        let mut kept = 0;
        let mut n = st.pending.len();
        while n > 0 {
            n -= 1;
            let Some(c) = st.pending.pop_front() else { break };
            if !st.known.contains_key(&c.qpn) {
                st.orphans += 1;
                self.shared.drop_completion(&c);
                continue;
            }
            match endpoints.endpoint(c.qpn) {
                Some(ep) => {
                    // Outside the lock: an endpoint that destroys its QP
                    // retires through it (parking_lot's mutex is not
                    // reentrant).
                    drop(st);
                    ep.handle_completions(now, std::slice::from_ref(&c));
                    handed += 1;
                    st = self.shared.state.lock();
                }
                None => {
                    st.pending.push_back(c);
                    kept += 1;
                }
            }
        }
        st.completions += handed as u64;
        st.deferred += kept;
        let srq_seen = handed > 0;
        drop(st);
        if let Some(q) = self.shared.srq.as_ref().filter(|_| srq_seen) {
            q.check_limit();
        }
        drained.map(|()| handed)
    }

    /// Readiness of the queue, as [`Nic::poll_cq_ready`]: `Ready` means
    /// poll again. Call it after a [`CqRouter::poll`] that handed nothing.
    pub fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<Result<(), NicError>> {
        if !self.shared.state.lock().pending.is_empty() {
            return Poll::Ready(Ok(()));
        }
        self.shared.hold.nic.poll_cq_ready(self.shared.hold.cq, cx)
    }

    /// What the router has done so far.
    pub fn stats(&self) -> RouterStats {
        let st = self.shared.state.lock();
        RouterStats {
            connections: st.known.len(),
            reserved_entries: st.reserved,
            depth: self.shared.depth,
            completions: st.completions,
            deferred: st.deferred,
            orphans: st.orphans,
            retired: st.retired,
            srq: self.shared.srq.as_ref().map(|q| q.stats()),
        }
    }
}
