//! The seeded scheduler: events in FIFO lanes, earliest head first, ties
//! broken by the seeded generator.
//!
//! A lane keeps what RC orders: one queue pair's send-queue execution, the
//! requests arriving at a responder, the responses arriving at a requester,
//! the completions of one CQ. Only a lane's head can run, so a later event
//! of the same lane never overtakes an earlier one, whatever their times.

use std::collections::{BTreeMap, VecDeque};

use rand::rngs::SmallRng;
use rand::Rng;

use super::event::EvKind;

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

#[derive(Debug)]
pub(crate) struct Ev {
    pub(crate) at: u64,
    pub(crate) kind: EvKind,
}

/// Ordered lanes stay (empty) once created, so a busy fabric reuses their
/// queues; free events (timers) are kept apart by sequence number. The
/// runnable choice scans lanes in `Lane` order, free events last, exactly
/// as one map of lanes would, so a seed gives the same schedule.
#[derive(Default)]
pub(crate) struct Scheduler {
    lanes: BTreeMap<Lane, VecDeque<Ev>>,
    /// Unordered events by sequence number, ascending (a vector: timers
    /// armed and cancelled on every call allocate nothing).
    free: Vec<(u64, Ev)>,
    next_free: u64,
    /// Scratch for `pop_due`.
    ready: Vec<Lane>,
}

impl Scheduler {
    /// Queue `kind` at the back of `lane`, no earlier than `at` nor than the
    /// lane's last event.
    pub(crate) fn push(&mut self, lane: Lane, at: u64, kind: EvKind) {
        if let Lane::Free(seq) = lane {
            let i = self.free.partition_point(|&(s, _)| s < seq);
            self.free.insert(i, (seq, Ev { at, kind }));
            return;
        }
        let q = self.lanes.entry(lane).or_default();
        let at = q.back().map_or(at, |b| b.at.max(at));
        q.push_back(Ev { at, kind });
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
            Lane::Free(seq) => {
                self.take_free(seq);
            }
            _ => {
                if let Some(q) = self.lanes.get_mut(&lane) {
                    q.clear();
                }
            }
        }
    }

    fn take_free(&mut self, seq: u64) -> Option<Ev> {
        let i = self.free.binary_search_by_key(&seq, |&(s, _)| s).ok()?;
        Some(self.free.remove(i).1)
    }

    /// The time of the earliest runnable event.
    pub(crate) fn next_at(&self) -> Option<u64> {
        let ordered = self.lanes.values().filter_map(|q| q.front()).map(|e| e.at);
        ordered.chain(self.free.iter().map(|(_, e)| e.at)).min()
    }

    /// How many events are queued.
    pub(crate) fn len(&self) -> usize {
        self.lanes.values().map(VecDeque::len).sum::<usize>() + self.free.len()
    }

    /// Take one of the earliest runnable events if it is due at `now`,
    /// choosing among simultaneous ones with `rng`.
    pub(crate) fn pop_due(&mut self, now: u64, rng: &mut SmallRng) -> Option<Ev> {
        let at = self.next_at()?;
        if at > now {
            return None;
        }
        self.ready.clear();
        self.ready.extend(
            self.lanes.iter().filter(|(_, q)| q.front().is_some_and(|e| e.at == at)).map(|(l, _)| *l),
        );
        self.ready.extend(self.free.iter().filter(|(_, e)| e.at == at).map(|(seq, _)| Lane::Free(*seq)));
        let n = self.ready.len();
        let lane = if n == 1 { self.ready[0] } else { self.ready[rng.gen_range(0..n)] };
        match lane {
            Lane::Free(seq) => self.take_free(seq),
            _ => self.lanes.get_mut(&lane)?.pop_front(),
        }
    }
}
