//! [`Routes`]: what a completion queue shared by many QPs has to remember,
//! without the device. A [`Hub`](super::hub::Hub) keeps one under its lock and
//! does the device work around it: it polls the queue and passes each
//! completion to [`Routes::route`], which says where it goes; destroys a QP
//! inside [`Routes::retire`]; and posts a shared receive that nobody will
//! take back to its queue.
//!
//! The rules it keeps are on [`Routes::reserve`], [`Routes::open`],
//! [`Routes::attach`] and [`Routes::retire`]; why: `docs/serving.md`,
//! "The hub's rules".

use super::proto::ids::IdMap;
use super::SetupError;
use crate::backend::Completion;

/// The routes of one shared completion queue, by QP number; `T` is what a
/// route delivers to once it has a target (see the module docs).
pub(super) struct Routes<T> {
    depth: u32,
    /// Entries reserved: those set aside when it was made, each route's,
    /// and those reserved for a QP not yet opened.
    reserved: u64,
    /// By QP number: small distinct integers, spread by one multiply
    /// (SipHash cost about 100 instructions a completion).
    by_qpn: IdMap<u32, Route<T>>,
    /// Routes whose QP could not be destroyed ([`Routes::retire`]): not
    /// counted among the QPs routed.
    stuck: usize,
    orphans: u64,
    /// Rkeys that SEND_WITH_INVs invalidated, each with the target of the
    /// route it came on (none: a QP with no connection yet, connected by
    /// an application's own bootstrap or in the moment between a listener
    /// connecting it and adding it, or one that could not be destroyed),
    /// for the owner to find whose windows they were
    /// ([`Routes::take_foreign`]) before any connection's next turn. The
    /// protocol never sends one: each is a hostile peer's, and on rxe it
    /// reaches any window of the device.
    foreign: Vec<(u32, Option<T>)>,
    /// The owner's scratch array for polling the queue (kept: filling 64
    /// fresh entries on every poll cost more than the routing).
    pub(super) batch: Vec<Completion>,
}

struct Route<T> {
    /// `None` until [`Routes::attach`].
    target: Option<T>,
    /// Completions that came while it had no target, oldest first.
    held: Vec<Completion>,
    /// Its reservation of the queue's entries.
    entries: u32,
    /// Its QP could not be destroyed (see [`Routes::retire`]).
    stuck: bool,
}

/// Where [`Routes::route`] put a completion.
#[derive(Debug)]
pub(super) enum Routed<'a, T> {
    /// To its route's target: hand it over.
    To(&'a T),
    /// Held for its route, which has no target.
    Held,
    /// No route has its QP number: nobody will take it (counted as an
    /// orphan; a shared receive among them is the caller's to post again).
    Orphan,
}

/// Completions taken per poll of the queue.
pub(super) const BATCH: usize = 64;

impl<T> Routes<T> {
    /// Routes on a queue of `depth` entries, `up_front` of them reserved for
    /// good (a shared receive queue's receives, which may all complete
    /// before a poll, whichever QP they land on).
    pub(super) fn new(depth: u32, up_front: u32) -> Result<Routes<T>, SetupError> {
        if up_front >= depth {
            return Err(SetupError::CqBudget { depth, reserved: 0, wanted: up_front });
        }
        Ok(Routes {
            depth,
            reserved: u64::from(up_front),
            by_qpn: IdMap::default(),
            stuck: 0,
            orphans: 0,
            foreign: Vec::new(),
            batch: vec![Completion::EMPTY; BATCH],
        })
    }

    /// Reserve `entries` of the queue for a QP about to be created, or
    /// refuse with [`SetupError::CqBudget`]. Hand the reservation to
    /// [`Routes::open`] once the QP exists, or to [`Routes::release`].
    pub(super) fn reserve(&mut self, entries: u32) -> Result<(), SetupError> {
        let reserved = self.reserved;
        if reserved + u64::from(entries) > u64::from(self.depth) {
            return Err(SetupError::CqBudget { depth: self.depth, reserved, wanted: entries });
        }
        self.reserved += u64::from(entries);
        Ok(())
    }

    /// Give back a reservation whose QP was never made.
    pub(super) fn release(&mut self, entries: u32) {
        debug_assert!(self.reserved >= u64::from(entries), "released more entries than were reserved");
        self.reserved = self.reserved.saturating_sub(u64::from(entries));
    }

    /// Before [`Routes::open`] of the QP numbered `qpn`, just created: if
    /// `qpn` has a stuck route (a QP whose destroy failed), its QP is gone
    /// (a device gives a number to one live QP only; the NIC handle's end
    /// destroyed it). `drain` takes what it left on the queue off first (as
    /// orphans: the new QP has completed nothing yet), then the route and
    /// its reservation are forgotten. Whether there was one.
    pub(super) fn take_over_stuck(&mut self, qpn: u32, drain: impl FnOnce(&mut Self)) -> bool {
        if !self.by_qpn.get(&qpn).is_some_and(|r| r.stuck) {
            return false;
        }
        drain(self);
        if let Some(old) = self.by_qpn.remove(&qpn) {
            self.reserved -= u64::from(old.entries);
            self.stuck -= 1;
        }
        true
    }

    /// Route the QP numbered `qpn`, just created with `entries` reserved,
    /// before it can complete anything.
    ///
    /// # Panics
    /// If `qpn` has a route: a device never gives a live QP's number to
    /// another, a QP destroyed through [`Routes::retire`] has none, and a
    /// stuck one's is taken over first ([`Routes::take_over_stuck`]).
    pub(super) fn open(&mut self, qpn: u32, entries: u32) {
        let old = self.by_qpn.insert(qpn, Route { target: None, held: Vec::new(), entries, stuck: false });
        assert!(
            old.is_none(),
            "QP number {qpn:#x} has a route already: a QP on a shared completion queue was destroyed \
             without retiring it there, or the device gave a live QP's number to a new one"
        );
    }

    /// Give the route of `qpn` its target, moving what it holds into
    /// `early` (oldest first) for the caller to hand over. `Err(target)`
    /// when `qpn` has no route or has a target already.
    pub(super) fn attach(&mut self, qpn: u32, target: T, early: &mut Vec<Completion>) -> Result<(), T> {
        let Some(route) = self.by_qpn.get_mut(&qpn).filter(|r| r.target.is_none() && !r.stuck) else {
            return Err(target);
        };
        let held = std::mem::take(&mut route.held);
        route.target = Some(target);
        early.extend(held);
        Ok(())
    }

    /// Where the completion `c`, just taken off the queue, goes. A
    /// SEND_WITH_INV's rkey is noted for [`Routes::take_foreign`] whatever
    /// the route (a QP that could not be destroyed included: its peer may
    /// still invalidate a window of the device).
    pub(super) fn route(&mut self, c: Completion) -> Routed<'_, T>
    where
        T: Clone,
    {
        let route = self.by_qpn.get_mut(&c.qpn);
        if let Some(rkey) = c.invalidated_rkey.filter(|_| c.status.is_success()) {
            if let Some(r) = &route {
                self.foreign.push((rkey, r.target.clone()));
            }
        }
        match route {
            Some(Route { stuck: true, .. }) | None => {
                self.orphans += 1;
                Routed::Orphan
            }
            Some(Route { target: Some(t), .. }) => Routed::To(t),
            Some(Route { target: None, held, .. }) => {
                held.push(c);
                Routed::Held
            }
        }
    }

    /// Retire the route of `qpn`, whose QP `destroy` destroys: `drain`
    /// (which takes every completion off the queue through
    /// [`Routes::route`]), `destroy`, `drain` again, then forget `qpn` and
    /// give back its reservation. What is still held for it goes to
    /// `unclaimed`: nobody will take it. Returns the
    /// route's target, to be dropped by the caller once its lock is
    /// released. The caller holds its lock throughout, so no QP takes the
    /// number until its completions are out of the queue.
    ///
    /// If `destroy` says the QP is still there (its destroy failed), the
    /// route stays `stuck`, with its reservation: the QP may still complete
    /// work into the queue, whose entries no new QP may count on, and what
    /// completes is an orphan (a shared receive among them goes back to
    /// its queue). A later retire whose destroy works forgets it.
    pub(super) fn retire(
        &mut self,
        qpn: u32,
        mut drain: impl FnMut(&mut Self),
        destroy: impl FnOnce() -> bool,
        mut unclaimed: impl FnMut(&Completion),
    ) -> Option<T> {
        // Before the destroy too: some providers (mlx5) erase a destroyed
        // QP's completions, and a shared receive among them would never be
        // posted again.
        drain(self);
        let destroyed = destroy();
        // No completion of a destroyed QP appears any more: once these are
        // taken, the queue has none of it.
        drain(self);
        if !destroyed {
            let route = self.by_qpn.get_mut(&qpn)?;
            if !route.stuck {
                route.stuck = true;
                self.stuck += 1;
            }
            std::mem::take(&mut route.held).iter().for_each(&mut unclaimed);
            return route.target.take();
        }
        let route = self.by_qpn.remove(&qpn)?;
        self.reserved -= u64::from(route.entries);
        if route.stuck {
            self.stuck -= 1;
        }
        route.held.iter().for_each(&mut unclaimed);
        route.target
    }

    /// Whether some SEND_WITH_INV's rkey waits for [`Routes::take_foreign`].
    #[inline]
    pub(super) fn has_foreign(&self) -> bool {
        !self.foreign.is_empty()
    }

    /// Take the rkeys that SEND_WITH_INVs invalidated, with the target of
    /// the route each came on: the owner finds whose windows they were
    /// (once the lock is released), each having had its one invalidation.
    /// (The completion itself goes on to its connection, which treats it
    /// as its peer's breach, and as its own window's invalidation if the
    /// rkey was one of its own.)
    pub(super) fn take_foreign(&mut self) -> Vec<(u32, Option<T>)> {
        std::mem::take(&mut self.foreign)
    }

    /// Every route's target.
    pub(super) fn targets(&self) -> impl Iterator<Item = &T> {
        self.by_qpn.values().filter_map(|r| r.target.as_ref())
    }

    /// Forget every route without retiring it (its owner is going, with
    /// its queue); the targets are dropped here.
    pub(super) fn clear(&mut self) {
        self.by_qpn.clear();
        self.stuck = 0;
    }

    /// QPs routed (prepared or running), those that could not be destroyed
    /// left out.
    pub(super) fn len(&self) -> usize {
        self.by_qpn.len().saturating_sub(self.stuck)
    }

    /// Whether no QP is routed but those that could not be destroyed.
    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries reserved.
    pub(super) fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The queue's depth.
    pub(super) fn depth(&self) -> u32 {
        self.depth
    }

    /// Completions held over every route.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.by_qpn.values().map(|r| r.held.len()).sum()
    }

    /// Completions of a QP number with no route.
    pub(super) fn orphans(&self) -> u64 {
        self.orphans
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::{BTreeMap, HashMap, VecDeque};

    use proptest::prelude::*;

    use super::*;

    /// A completion of the QP numbered `qpn`, tagged `tag` (in `wr_id`).
    fn wc(qpn: u32, tag: u64) -> Completion {
        Completion { qpn, wr_id: tag, ..Completion::EMPTY }
    }

    /// Route `cs`, returning (target, tag) of each delivered one.
    fn route_all(r: &mut Routes<u64>, cs: &[Completion]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for c in cs {
            if let Routed::To(t) = r.route(*c) {
                out.push((*t, c.wr_id));
            }
        }
        out
    }

    #[test]
    fn refuses_what_does_not_fit_and_gives_back_what_is_released() {
        assert!(matches!(
            Routes::<u64>::new(100, 100),
            Err(SetupError::CqBudget { depth: 100, reserved: 0, wanted: 100 })
        ));
        let mut r = Routes::<u64>::new(100, 40).unwrap();
        r.reserve(50).unwrap();
        assert!(matches!(r.reserve(11), Err(SetupError::CqBudget { depth: 100, reserved: 90, wanted: 11 })));
        assert_eq!(r.reserved(), 90, "a refusal reserves nothing");
        r.release(50);
        r.reserve(60).unwrap();
        r.open(7, 60);
        assert_eq!(r.reserved(), 100);
        assert!(r.retire(7, |_| {}, || true, |_| {}).is_none());
        assert_eq!(r.reserved(), 40, "only the up-front entries stay");
        assert_eq!(r.len(), 0);
    }

    /// A QP whose destroy failed keeps a stuck route (its completions
    /// orphans, its entries reserved). When the device gives its number to
    /// a new QP, the old one is gone: what it left on the queue is drained
    /// as orphans, its reservation given back, and the new QP routed (this
    /// panicked in `open`).
    #[test]
    fn a_stuck_routes_number_given_to_a_new_qp_is_taken_over() {
        let mut r = Routes::<u64>::new(100, 0).unwrap();
        r.reserve(10).unwrap();
        r.open(7, 10);
        r.attach(7, 77, &mut Vec::new()).unwrap();
        assert_eq!(r.retire(7, |_| {}, || false, |_| {}), Some(77), "its target goes; the route stays");
        assert_eq!((r.stuck, r.reserved()), (1, 10));
        assert!(!r.take_over_stuck(8, |_| unreachable!("no route of 8")));
        r.reserve(20).unwrap();
        let mut drained = 0;
        let taken = r.take_over_stuck(7, |r| {
            // The old QP's last completion, still on the queue.
            assert!(matches!(r.route(wc(7, 1)), Routed::Orphan));
            drained += 1;
        });
        assert!(taken);
        assert_eq!(drained, 1, "drained before the route went");
        assert_eq!((r.stuck, r.reserved()), (0, 20), "the old reservation given back");
        r.open(7, 20);
        assert!(matches!(r.route(wc(7, 2)), Routed::Held), "the new QP's completion waits for its target");
        r.attach(7, 78, &mut Vec::new()).unwrap();
        assert!(matches!(r.route(wc(7, 3)), Routed::To(78)));
    }

    /// Every SEND_WITH_INV is noted as it is routed, with the target of
    /// its route (none for a QP with no connection yet), so that its
    /// window's owner hears of it before any turn; the completion goes on
    /// as it would. A failed one invalidated nothing and is not noted.
    #[test]
    fn every_send_with_invalidate_is_noted_with_its_routes_target() {
        let mut r = Routes::<u64>::new(100, 0).unwrap();
        r.reserve(20).unwrap();
        r.open(7, 10);
        r.open(8, 10);
        r.attach(7, 77, &mut Vec::new()).unwrap();
        assert!(!r.has_foreign());
        let inv = |qpn, tag, rkey| Completion { invalidated_rkey: Some(rkey), ..wc(qpn, tag) };
        assert!(matches!(r.route(inv(7, 1, 0xa1)), Routed::To(77)));
        assert!(matches!(r.route(inv(8, 2, 0xb2)), Routed::Held));
        let failed = Completion { status: crate::backend::WcStatus::RemInvReqErr, ..inv(7, 3, 0xc3) };
        assert!(matches!(r.route(failed), Routed::To(77)));
        assert!(r.has_foreign());
        assert_eq!(r.take_foreign(), [(0xa1, Some(77)), (0xb2, None)]);
        assert!(!r.has_foreign());
    }

    /// A QP whose destroy failed keeps its reservation (it may still
    /// complete work into the queue), its completions are orphans, and its
    /// target goes; a later retire whose destroy works forgets it.
    #[test]
    fn a_qp_that_could_not_be_destroyed_keeps_its_entries_until_it_is() {
        let mut r = Routes::<u64>::new(100, 0).unwrap();
        r.reserve(60).unwrap();
        r.open(7, 60);
        let mut early = Vec::new();
        r.attach(7, 77, &mut early).unwrap();
        assert!(route_all(&mut r, &[wc(7, 1)]) == [(77, 1)]);
        let mut dropped = Vec::new();
        assert_eq!(r.retire(7, |_| {}, || false, |c| dropped.push(c.wr_id)), Some(77), "the target goes");
        assert!(dropped.is_empty());
        assert_eq!(r.reserved(), 60, "its entries stay reserved");
        assert!(r.is_empty(), "a stuck QP is no QP routed");
        assert_eq!(r.retire(7, |_| {}, || false, |_| {}), None, "failing again changes nothing");
        assert_eq!((r.reserved(), r.len()), (60, 0));
        assert!(matches!(r.reserve(41), Err(SetupError::CqBudget { .. })));
        assert!(route_all(&mut r, &[wc(7, 2)]).is_empty());
        assert_eq!((r.orphans(), r.held()), (1, 0), "a completion of it is an orphan");
        assert_eq!(r.attach(7, 78, &mut early), Err(78), "no new target");
        // Its peer's SEND_WITH_INV still reaches the window's owner.
        let inv = Completion { invalidated_rkey: Some(0x1234), ..wc(7, 3) };
        assert!(matches!(r.route(inv), Routed::Orphan));
        assert_eq!(r.take_foreign(), [(0x1234, None)]);
        assert!(r.retire(7, |_| {}, || true, |_| {}).is_none());
        assert_eq!((r.reserved(), r.len()), (0, 0));
        // A QP with no connection yet holds what it completes: a failed
        // destroy hands that to `unclaimed` (a shared receive goes back).
        r.reserve(10).unwrap();
        r.open(8, 10);
        assert!(matches!(r.route(wc(8, 4)), Routed::Held));
        let mut dropped = Vec::new();
        assert!(r.retire(8, |_| {}, || false, |c| dropped.push(c.wr_id)).is_none());
        assert_eq!((dropped, r.held(), r.reserved()), (vec![4], 0, 10));
    }

    #[test]
    fn early_completions_reach_the_route_when_its_target_comes() {
        let mut r = Routes::<u64>::new(100, 0).unwrap();
        r.reserve(10).unwrap();
        r.open(3, 10);
        assert!(route_all(&mut r, &[wc(3, 1), wc(3, 2)]).is_empty());
        assert_eq!(r.held(), 2);
        let mut early = Vec::new();
        r.attach(3, 33, &mut early).unwrap();
        assert_eq!(early.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(r.held(), 0);
        assert_eq!(route_all(&mut r, &[wc(3, 3)]), [(33, 3)]);
        assert_eq!(r.attach(3, 34, &mut early), Err(34), "a second target");
        assert_eq!(r.attach(4, 44, &mut early), Err(44), "no route");
    }

    #[test]
    fn completions_of_an_unknown_qp_are_orphans() {
        let mut r = Routes::<u64>::new(100, 0).unwrap();
        assert!(matches!(r.route(wc(9, 1)), Routed::Orphan));
        assert_eq!((r.orphans(), r.held()), (1, 0));
    }

    /// A completion left in the queue by a retired QP is never delivered to
    /// the next QP with its number: `retire` drains it out, after the
    /// destroy, and drops it.
    #[test]
    fn a_retired_number_gets_none_of_the_old_qps_completions() {
        let mut r = Routes::<u64>::new(100, 0).unwrap();
        let cq: RefCell<VecDeque<Completion>> = RefCell::default();
        r.reserve(10).unwrap();
        r.open(5, 10);
        // Held (not yet added) and in the queue when it goes, and one more
        // that lands between the first drain and the destroy.
        cq.borrow_mut().push_back(wc(5, 1));
        let mut dropped = Vec::new();
        let order = RefCell::new(Vec::new());
        let gone = r.retire(
            5,
            |r| {
                order.borrow_mut().push("drain");
                while let Some(c) = cq.borrow_mut().pop_front() {
                    assert!(!matches!(r.route(c), Routed::To(_)));
                }
                if order.borrow().len() == 1 {
                    cq.borrow_mut().push_back(wc(5, 2));
                }
            },
            || {
                order.borrow_mut().push("destroy");
                true
            },
            |c| dropped.push(c.wr_id),
        );
        let order = order.into_inner();
        assert_eq!(order, ["drain", "destroy", "drain"]);
        assert_eq!(gone, None);
        assert_eq!(dropped, [1, 2]);
        assert_eq!((r.held(), r.reserved()), (0, 0));
        r.reserve(10).unwrap();
        r.open(5, 10);
        let mut early = Vec::new();
        r.attach(5, 55, &mut early).unwrap();
        assert!(early.is_empty(), "the new QP got the old one's completion");
    }

    #[test]
    #[should_panic(expected = "has a route already")]
    fn a_live_number_cannot_be_opened_twice() {
        let mut r = Routes::<()>::new(100, 0).unwrap();
        r.open(1, 0);
        r.open(1, 0);
    }

    /// What a test does to the routes (indices pick among live QPs).
    #[derive(Clone, Debug)]
    enum Op {
        /// Reserve for a QP about to be made.
        Reserve(u32),
        /// The QP of the oldest reservation is made (or its creation failed).
        Open(bool),
        Attach(usize),
        /// A live QP completes `n` work requests.
        Complete(usize, u8),
        /// The caller takes up to `n` completions off the queue.
        Poll(usize),
        /// Retire a QP; `late` completions of it land between the first
        /// drain and the destroy.
        Retire(usize, u8),
        /// A completion of a QP that was never routed.
        Stray,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u32..60).prop_map(Op::Reserve),
            3 => any::<bool>().prop_map(Op::Open),
            2 => any::<usize>().prop_map(Op::Attach),
            4 => (any::<usize>(), 1u8..4).prop_map(|(i, n)| Op::Complete(i, n)),
            3 => (1usize..8).prop_map(Op::Poll),
            2 => (any::<usize>(), 0u8..3).prop_map(|(i, n)| Op::Retire(i, n)),
            1 => Just(Op::Stray),
        ]
    }

    /// A live QP: its generation (a fresh number per QP, whatever its QP
    /// number), its reservation, and how many completions it made.
    struct Live {
        generation: u64,
        entries: u32,
        made: u64,
    }

    /// The routes, a queue of completions and what should be true of them.
    /// A completion's tag is its QP's generation << 32 | its sequence.
    struct Model {
        r: Routes<u64>,
        up_front: u32,
        cq: VecDeque<Completion>,
        pending: VecDeque<u32>,
        live: BTreeMap<u32, Live>,
        next_generation: u64,
        /// Per generation: the sequence of the last completion that came out
        /// (delivered, taken, or dropped at its retirement), and how many did.
        out: HashMap<u64, (Option<u64>, u64)>,
        held: usize,
        orphans: u64,
    }

    impl Model {
        /// A completion of generation `g` came out of the routes: the
        /// current QP's, and in order.
        fn came_out(&mut self, to: Option<u64>, c: &Completion) {
            let (g, seq) = (c.wr_id >> 32, c.wr_id & 0xffff_ffff);
            if let Some(t) = to {
                assert_eq!(t, g, "delivered to a route of another QP with its number");
            }
            let (last, n) = self.out.entry(g).or_default();
            assert!(last.map_or(true, |l| l < seq), "out of order");
            *last = Some(seq);
            *n += 1;
        }

        fn pick(&self, i: usize) -> Option<u32> {
            (!self.live.is_empty()).then(|| *self.live.keys().nth(i % self.live.len()).expect("in range"))
        }

        /// Route one completion taken off the queue.
        fn route(&mut self, c: Completion) {
            let current = self.live.get(&c.qpn).map(|l| l.generation);
            match self.r.route(c) {
                Routed::To(t) => {
                    let t = *t;
                    assert_eq!(Some(t), current);
                    self.came_out(Some(t), &c);
                }
                Routed::Held => self.held += 1,
                Routed::Orphan => {
                    assert!(current.is_none(), "a known QP's completion was an orphan");
                    self.orphans += 1;
                }
            }
        }

        fn apply(&mut self, op: Op) {
            match op {
                Op::Reserve(n) => {
                    let free = u64::from(self.r.depth()) - self.r.reserved();
                    match self.r.reserve(n) {
                        Ok(()) => self.pending.push_back(n),
                        Err(SetupError::CqBudget { .. }) => assert!(u64::from(n) > free),
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Open(made) => {
                    let Some(entries) = self.pending.pop_front() else { return };
                    // The lowest free number, as a device that reuses them.
                    let qpn = (0..).find(|q| !self.live.contains_key(q)).expect("a free number");
                    if made {
                        self.r.open(qpn, entries);
                        let generation = self.next_generation;
                        self.next_generation += 1;
                        self.live.insert(qpn, Live { generation, entries, made: 0 });
                    } else {
                        self.r.release(entries);
                    }
                }
                Op::Attach(i) => {
                    let Some(qpn) = self.pick(i) else { return };
                    let g = self.live[&qpn].generation;
                    let mut early = Vec::new();
                    if self.r.attach(qpn, g, &mut early).is_ok() {
                        self.held -= early.len();
                        early.iter().for_each(|c| self.came_out(Some(g), c));
                    }
                }
                Op::Complete(i, n) => {
                    let Some(qpn) = self.pick(i) else { return };
                    let l = self.live.get_mut(&qpn).expect("picked");
                    for _ in 0..n {
                        self.cq.push_back(wc(qpn, l.generation << 32 | l.made));
                        l.made += 1;
                    }
                }
                Op::Poll(n) => {
                    for _ in 0..n {
                        let Some(c) = self.cq.pop_front() else { break };
                        self.route(c);
                    }
                }
                Op::Retire(i, late) => {
                    let Some(qpn) = self.pick(i) else { return };
                    let mut r = std::mem::replace(&mut self.r, Routes::new(1, 0).expect("fits"));
                    let mut drains = 0;
                    let mut dropped = Vec::new();
                    let gone = r.retire(
                        qpn,
                        |r| {
                            std::mem::swap(&mut self.r, r);
                            while let Some(c) = self.cq.pop_front() {
                                self.route(c);
                            }
                            std::mem::swap(&mut self.r, r);
                            drains += 1;
                            if drains == 1 {
                                let l = self.live.get_mut(&qpn).expect("picked");
                                for _ in 0..late {
                                    self.cq.push_back(wc(qpn, l.generation << 32 | l.made));
                                    l.made += 1;
                                }
                            }
                        },
                        || true,
                        |c| dropped.push(*c),
                    );
                    self.r = r;
                    let l = self.live.remove(&qpn).expect("picked");
                    assert!(gone.map_or(true, |t| t == l.generation));
                    self.held -= dropped.len();
                    dropped.iter().for_each(|c| self.came_out(None, c));
                    // Every completion it made came out, once: none is left to
                    // reach a later QP with its number.
                    let made = l.made;
                    assert_eq!(self.out.get(&l.generation).map_or(0, |o| o.1), made);
                    assert!(self.cq.iter().all(|c| c.qpn != qpn));
                }
                Op::Stray => self.cq.push_back(wc(1000, u64::MAX)),
            }
        }

        fn check(&self) {
            let routed: u64 = self.live.values().map(|l| u64::from(l.entries)).sum();
            let pending: u64 = self.pending.iter().map(|&n| u64::from(n)).sum();
            assert_eq!(
                self.r.reserved(),
                u64::from(self.up_front) + routed + pending,
                "reservations drifted"
            );
            assert!(self.r.reserved() <= u64::from(self.r.depth()));
            assert_eq!(self.r.len(), self.live.len());
            assert_eq!(self.r.held(), self.held);
            assert_eq!(self.r.orphans(), self.orphans);
        }
    }

    proptest! {
        #[test]
        fn routes_keep_their_books_under_random_schedules(
            up_front in 0u32..50,
            ops in prop::collection::vec(op(), 1..200),
        ) {
            let mut m = Model {
                r: Routes::new(200, up_front).expect("fits"),
                up_front,
                cq: VecDeque::new(),
                pending: VecDeque::new(),
                live: BTreeMap::new(),
                next_generation: 0,
                out: HashMap::new(),
                held: 0,
                orphans: 0,
            };
            for op in ops {
                m.apply(op);
                m.check();
            }
        }
    }
}
