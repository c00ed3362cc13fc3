//! The seeded scheduler: events in FIFO lanes, earliest head first, ties
//! broken by the seeded generator.
//!
//! A lane keeps what RC orders: one queue pair's send-queue execution, the
//! requests arriving at a responder, the responses arriving at a requester,
//! the completions of one CQ. Only a lane's head can run, so a later event
//! of the same lane never overtakes an earlier one, whatever their times.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use rand::rngs::SmallRng;
use rand::Rng;

use super::event::EvKind;
use super::ranked::RankedSet;

/// Sequence numbers hashed by a multiply (`IdHasher`), not SipHash: they
/// are the simulator's own, never chosen by a peer.
type SeqMap<V> = HashMap<u64, V, BuildHasherDefault<mwcap_delegation::IdHasher>>;

/// A FIFO of events that must run in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Lane {
    /// Send-queue execution of (device, qp index).
    Sq(u32, u32),
    /// Request packets arriving at (device, qp index) as responder.
    Resp(u32, u32),
    /// Response packets arriving at (device, qp index) as requester.
    Req(u32, u32),
    /// Completions delivered to (device, cq index).
    Cq(u32, u32),
    /// An unordered event (timers), unique by its sequence number.
    Free(u64),
}

impl Lane {
    /// The first lane in `Lane` order.
    const FIRST: Lane = Lane::Sq(0, 0);
}

#[derive(Debug)]
pub(crate) struct Ev {
    pub(crate) at: u64,
    pub(crate) kind: EvKind,
}

/// Ordered lanes stay (empty) once created, their events in one slab whose
/// nodes are reused; free events (timers) are kept apart by sequence number. Both are
/// found without a search (a lane by its indexes, a free event by hash) and
/// never iterated. `heads` holds the runnable events, one per non-empty lane
/// and every free event, by time and then lane: those due first come in
/// `Lane` order, free events last by sequence number, the order in which
/// the generator picks among them. It counts them, so finding how many are
/// due first and taking the k-th is O(log n) however many there are; so is
/// every step.
pub(crate) struct Scheduler {
    lanes: Queues,
    /// The ordered lanes' events.
    slab: Slab,
    /// Unordered events by sequence number.
    free: SeqMap<Ev>,
    /// (time, lane) of every lane's head and every free event.
    heads: RankedSet<(u64, Lane)>,
    next_free: u64,
    len: usize,
}

impl Default for Scheduler {
    fn default() -> Scheduler {
        Scheduler {
            lanes: Queues::default(),
            slab: Slab::default(),
            // Room for twice the timers a busy fabric has at once: a hash
            // map whose removals' tombstones fill it rehashes in place only
            // while it is at most half full.
            free: SeqMap::with_capacity_and_hasher(256, BuildHasherDefault::default()),
            heads: RankedSet::default(),
            next_free: 0,
            len: 0,
        }
    }
}

impl Scheduler {
    /// Queue `kind` at the back of `lane`, no earlier than `at` nor than the
    /// lane's last event. A free lane must be a new one (from
    /// [`Scheduler::push_free`]).
    pub(crate) fn push(&mut self, lane: Lane, at: u64, kind: EvKind) {
        self.len += 1;
        if let Lane::Free(seq) = lane {
            let old = self.free.insert(seq, Ev { at, kind });
            debug_assert!(old.is_none(), "free lane {seq} queued twice");
            self.heads.insert((at, lane));
            return;
        }
        let q = self.lanes.make(lane);
        let at = match q.back_at(&self.slab) {
            Some(b) => b.max(at),
            None => {
                self.heads.insert((at, lane));
                at
            }
        };
        q.push_back(&mut self.slab, Ev { at, kind });
    }

    /// Queue an unordered event; its lane can be passed to [`Scheduler::cancel`].
    pub(crate) fn push_free(&mut self, at: u64, kind: EvKind) -> Lane {
        self.next_free += 1;
        let lane = Lane::Free(self.next_free);
        self.push(lane, at, kind);
        lane
    }

    /// Drop whatever is queued in `lane`.
    pub(crate) fn cancel(&mut self, lane: Lane) {
        match lane {
            Lane::Free(_) => {
                self.take(lane);
            }
            _ => {
                let Some(q) = self.lanes.get_mut(lane) else { return };
                if let Some(at) = q.front_at(&self.slab) {
                    self.heads.remove(&(at, lane));
                }
                self.len -= q.len as usize;
                q.clear(&mut self.slab);
            }
        }
    }

    /// Take the head of `lane`, making the next event of an ordered lane its head.
    fn take(&mut self, lane: Lane) -> Option<Ev> {
        let (ev, next) = match lane {
            Lane::Free(seq) => (self.free.remove(&seq)?, None),
            _ => {
                let q = self.lanes.get_mut(lane)?;
                let ev = q.pop_front(&mut self.slab)?;
                (ev, q.front_at(&self.slab))
            }
        };
        // A next event due at the same instant keeps the head's place.
        if next != Some(ev.at) {
            self.heads.remove(&(ev.at, lane));
            if let Some(at) = next {
                self.heads.insert((at, lane));
            }
        }
        self.len -= 1;
        Some(ev)
    }

    /// The time of the earliest runnable event.
    pub(crate) fn next_at(&self) -> Option<u64> {
        self.heads.first().map(|(at, _)| at)
    }

    /// How many events are queued.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Take one of the earliest runnable events if it is due at `now`,
    /// choosing among simultaneous ones with `rng`.
    pub(crate) fn pop_due(&mut self, now: u64, rng: &mut SmallRng) -> Option<Ev> {
        let (at, first) = self.heads.first()?;
        if at > now {
            return None;
        }
        // The heads due at `at` are the first n.
        let n = at.checked_add(1).map_or(self.heads.len(), |later| self.heads.rank(&(later, Lane::FIRST)));
        let lane =
            if n == 1 { first } else { self.heads.nth(rng.gen_range(0..n)).expect("n heads are due").1 };
        self.take(lane)
    }
}

/// No event: the end of a lane, or of the spare list.
const NIL: u32 = u32::MAX;

/// Events in a slab, each lane a linked list through it: a lane costs
/// 12 bytes, and the slab grows only when the events queued in the whole
/// fabric at once reach a new high, not whenever one of thousands of lanes
/// does (which a queue per lane did, now and then thousands of calls into a
/// steady run).
struct Slab {
    nodes: Vec<Node>,
    /// The first unused node, or NIL.
    spare: u32,
}

struct Node {
    ev: Option<Ev>,
    /// The next node of the lane (or of the spare list), or NIL.
    next: u32,
}

/// Events the slab has room for from the start: more than a busy
/// benchmark's fabric holds at once.
const SLAB_ROOM: usize = 1024;

impl Default for Slab {
    fn default() -> Slab {
        Slab { nodes: Vec::with_capacity(SLAB_ROOM), spare: NIL }
    }
}

impl Slab {
    fn put(&mut self, ev: Ev) -> u32 {
        if self.spare == NIL {
            self.nodes.push(Node { ev: Some(ev), next: NIL });
            return (self.nodes.len() - 1) as u32;
        }
        let i = self.spare;
        let node = &mut self.nodes[i as usize];
        self.spare = node.next;
        *node = Node { ev: Some(ev), next: NIL };
        i
    }

    /// Take the event out of node `i`; returns it and the node after it.
    fn take(&mut self, i: u32) -> (Ev, u32) {
        let node = &mut self.nodes[i as usize];
        let ev = node.ev.take().expect("a queued node holds an event");
        let next = std::mem::replace(&mut node.next, self.spare);
        self.spare = i;
        (ev, next)
    }

    fn at(&self, i: u32) -> u64 {
        self.nodes[i as usize].ev.as_ref().expect("a queued node holds an event").at
    }
}

/// One ordered lane: a FIFO linked through the slab.
#[derive(Clone, Copy)]
struct Fifo {
    head: u32,
    tail: u32,
    len: u32,
}

impl Default for Fifo {
    fn default() -> Fifo {
        Fifo { head: NIL, tail: NIL, len: 0 }
    }
}

impl Fifo {
    fn back_at(&self, slab: &Slab) -> Option<u64> {
        (self.len > 0).then(|| slab.at(self.tail))
    }

    fn front_at(&self, slab: &Slab) -> Option<u64> {
        (self.len > 0).then(|| slab.at(self.head))
    }

    fn push_back(&mut self, slab: &mut Slab, ev: Ev) {
        let i = slab.put(ev);
        if self.len == 0 {
            self.head = i;
        } else {
            slab.nodes[self.tail as usize].next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    fn pop_front(&mut self, slab: &mut Slab) -> Option<Ev> {
        if self.len == 0 {
            return None;
        }
        let (ev, next) = slab.take(self.head);
        self.head = next;
        self.len -= 1;
        if self.len == 0 {
            *self = Fifo::default();
        }
        Some(ev)
    }

    fn clear(&mut self, slab: &mut Slab) {
        while self.pop_front(slab).is_some() {}
    }
}

/// The ordered lanes by device, kind and index: devices, queue pairs and
/// CQs are named by slab indexes, dense and never reused.
#[derive(Default)]
struct Queues(Vec<[Vec<Fifo>; 4]>);

impl Queues {
    /// Where an ordered lane is: (device, kind, index).
    fn slot(lane: Lane) -> (usize, usize, usize) {
        let (kind, dev, index) = match lane {
            Lane::Sq(dev, qp) => (0, dev, qp),
            Lane::Resp(dev, qp) => (1, dev, qp),
            Lane::Req(dev, qp) => (2, dev, qp),
            Lane::Cq(dev, cq) => (3, dev, cq),
            Lane::Free(_) => unreachable!("a free event has no queue"),
        };
        (dev as usize, kind, index as usize)
    }

    fn get_mut(&mut self, lane: Lane) -> Option<&mut Fifo> {
        let (dev, kind, index) = Queues::slot(lane);
        self.0.get_mut(dev)?[kind].get_mut(index)
    }

    /// The lane, made (empty) if it is new.
    fn make(&mut self, lane: Lane) -> &mut Fifo {
        let (dev, kind, index) = Queues::slot(lane);
        if self.0.len() <= dev {
            self.0.resize_with(dev + 1, Default::default);
        }
        let queues = &mut self.0[dev][kind];
        if queues.len() <= index {
            queues.resize_with(index + 1, Fifo::default);
        }
        &mut queues[index]
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, VecDeque};

    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The scheduler as it was before the runnable heads were kept in a
    /// set: every step scans every lane. A seed must give the same schedule
    /// on both.
    #[derive(Default)]
    struct Scan {
        lanes: BTreeMap<Lane, VecDeque<Ev>>,
        free: Vec<(u64, Ev)>,
        next_free: u64,
    }

    impl Scan {
        fn push(&mut self, lane: Lane, at: u64, kind: EvKind) {
            let q = self.lanes.entry(lane).or_default();
            let at = q.back().map_or(at, |b| b.at.max(at));
            q.push_back(Ev { at, kind });
        }

        fn push_free(&mut self, at: u64, kind: EvKind) -> Lane {
            self.next_free += 1;
            self.free.push((self.next_free, Ev { at, kind }));
            Lane::Free(self.next_free)
        }

        fn cancel(&mut self, lane: Lane) {
            match lane {
                Lane::Free(seq) => self.free.retain(|&(s, _)| s != seq),
                _ => self.lanes.get_mut(&lane).map_or((), VecDeque::clear),
            }
        }

        fn next_at(&self) -> Option<u64> {
            let ordered = self.lanes.values().filter_map(|q| q.front()).map(|e| e.at);
            ordered.chain(self.free.iter().map(|(_, e)| e.at)).min()
        }

        fn len(&self) -> usize {
            self.lanes.values().map(VecDeque::len).sum::<usize>() + self.free.len()
        }

        fn pop_due(&mut self, now: u64, rng: &mut SmallRng) -> Option<Ev> {
            let at = self.next_at().filter(|&at| at <= now)?;
            let mut ready: Vec<Lane> = self
                .lanes
                .iter()
                .filter(|(_, q)| q.front().is_some_and(|e| e.at == at))
                .map(|(l, _)| *l)
                .collect();
            ready.extend(self.free.iter().filter(|(_, e)| e.at == at).map(|(seq, _)| Lane::Free(*seq)));
            let n = ready.len();
            let lane = if n == 1 { ready[0] } else { ready[rng.gen_range(0..n)] };
            match lane {
                Lane::Free(seq) => {
                    let i = self.free.iter().position(|&(s, _)| s == seq)?;
                    Some(self.free.remove(i).1)
                }
                _ => self.lanes.get_mut(&lane)?.pop_front(),
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Queue on the `lane`th of [`LANES`], at `now + delay`.
        Push { lane: usize, delay: u64 },
        /// Queue a free event at `now + delay`.
        PushFree { delay: u64 },
        /// Cancel the `lane`th of [`LANES`].
        Cancel { lane: usize },
        /// Cancel the `nth` free event queued so far (perhaps run or cancelled already).
        CancelFree { nth: usize },
        /// Move the clock on by `by`, then run what is due, at most `max` events.
        Run { by: u64, max: usize },
        /// Move the clock to the next event, as `Fabric::step` does, and run one.
        Step,
    }

    /// Few lanes and few instants, so that many heads are due together.
    const LANES: [Lane; 8] = [
        Lane::Sq(0, 0),
        Lane::Sq(0, 1),
        Lane::Sq(1, 0),
        Lane::Resp(0, 0),
        Lane::Resp(1, 3),
        Lane::Req(0, 1),
        Lane::Cq(0, 0),
        Lane::Cq(1, 0),
    ];

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            4 => (0..LANES.len(), 0..4u64).prop_map(|(lane, delay)| Op::Push { lane, delay }),
            2 => (0..4u64).prop_map(|delay| Op::PushFree { delay }),
            1 => (0..LANES.len()).prop_map(|lane| Op::Cancel { lane }),
            1 => (0..16usize).prop_map(|nth| Op::CancelFree { nth }),
            3 => (0..3u64, 0..6usize).prop_map(|(by, max)| Op::Run { by, max }),
            1 => Just(Op::Step),
        ];
        proptest::collection::vec(op, 0..200)
    }

    /// An event named by `id`, so the two schedules can be compared.
    fn ev(id: u64) -> EvKind {
        EvKind::AckTimer { dev: 0, qp: 0, gen: id }
    }

    fn id(e: Ev) -> (u64, u64) {
        match e.kind {
            EvKind::AckTimer { gen, .. } => (e.at, gen),
            other => panic!("not a test event: {other:?}"),
        }
    }

    #[test]
    fn lanes_that_fill_in_turn_reuse_the_same_nodes() {
        // 64 lanes each fill to 16 events and drain, one after another, as
        // a fabric's queue pairs take turns: the slab holds 16 events, not
        // 16 per lane (a queue per lane kept room for each lane's highest).
        let mut s = Scheduler::default();
        let mut rng = SmallRng::seed_from_u64(7);
        let mut now = 0;
        for qp in 0..64 {
            for i in 0..16 {
                s.push(Lane::Resp(0, qp), now + i, ev(i));
            }
            while s.len() > 0 {
                now = s.next_at().expect("queued");
                s.pop_due(now, &mut rng).expect("due");
            }
        }
        assert_eq!(s.slab.nodes.len(), 16);
        assert_eq!(s.slab.nodes.capacity(), SLAB_ROOM, "the slab never grew");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn same_schedule_as_a_scan_of_every_lane(seed in any::<u64>(), ops in ops()) {
            let (mut new, mut old) = (Scheduler::default(), Scan::default());
            let (mut rng_new, mut rng_old) = (SmallRng::seed_from_u64(seed), SmallRng::seed_from_u64(seed));
            let (mut now, mut next_id, mut frees) = (0u64, 0u64, Vec::new());
            for op in ops {
                match op {
                    Op::Push { lane, delay } => {
                        next_id += 1;
                        new.push(LANES[lane], now + delay, ev(next_id));
                        old.push(LANES[lane], now + delay, ev(next_id));
                    }
                    Op::PushFree { delay } => {
                        next_id += 1;
                        let lane = new.push_free(now + delay, ev(next_id));
                        prop_assert_eq!(lane, old.push_free(now + delay, ev(next_id)));
                        frees.push(lane);
                    }
                    Op::Cancel { lane } => {
                        new.cancel(LANES[lane]);
                        old.cancel(LANES[lane]);
                    }
                    Op::CancelFree { nth } => {
                        if let Some(&lane) = frees.get(nth) {
                            new.cancel(lane);
                            old.cancel(lane);
                        }
                    }
                    Op::Run { by, max } => {
                        now += by;
                        for _ in 0..max {
                            let (a, b) = (new.pop_due(now, &mut rng_new), old.pop_due(now, &mut rng_old));
                            prop_assert_eq!(a.map(id), b.map(id));
                        }
                    }
                    Op::Step => {
                        prop_assert_eq!(new.next_at(), old.next_at());
                        now = now.max(new.next_at().unwrap_or(now));
                        let (a, b) = (new.pop_due(now, &mut rng_new), old.pop_due(now, &mut rng_old));
                        prop_assert_eq!(a.map(id), b.map(id));
                    }
                }
                prop_assert_eq!(new.next_at(), old.next_at());
                prop_assert_eq!(new.len(), old.len());
                // The generators were drawn from alike.
                prop_assert_eq!(rng_new.clone().gen::<u64>(), rng_old.clone().gen::<u64>());
            }
            // Drain both.
            while let Some(at) = old.next_at() {
                now = now.max(at);
                let (a, b) = (new.pop_due(now, &mut rng_new), old.pop_due(now, &mut rng_old));
                prop_assert_eq!(a.map(id), b.map(id));
            }
            prop_assert_eq!(new.len(), 0);
            prop_assert_eq!(new.heads.len(), 0);
        }
    }
}
