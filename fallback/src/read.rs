//! Bookkeeping shared by both readers (client direction 1, server direction 2).

use std::collections::{BTreeSet, VecDeque};

use crate::ids::{BufferId, Generation, ReadToken};
use crate::output::Event;

/// What a reader took from one offer: the READ it posted and the exact
/// (buffer, generation) it must confirm. A READ and its confirm always come
/// from the same offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Exposure {
    pub(crate) token: ReadToken,
    pub(crate) buffer: BufferId,
    pub(crate) generation: Generation,
    pub(crate) len: u32,
}

/// READ tokens and the READs whose request ended while they were in flight.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Reads {
    next: u64,
    /// In flight, no longer wanted: their destinations return on completion.
    orphans: BTreeSet<ReadToken>,
}

impl Reads {
    pub(crate) fn token(&mut self) -> ReadToken {
        // 2^64 READs on one connection cannot happen; wrapping keeps this panic-free.
        self.next = self.next.wrapping_add(1);
        ReadToken::from_raw(self.next)
    }

    /// The request of a READ ended. If the READ already completed its
    /// destination is free now; otherwise when its completion (or flush) comes.
    pub(crate) fn abandon(&mut self, token: ReadToken, completed: bool, events: &mut VecDeque<Event>) {
        if completed {
            events.push_back(Event::ReadDiscarded { token });
        } else {
            self.orphans.insert(token);
        }
    }

    /// A completion for an abandoned READ: its destination is free.
    pub(crate) fn complete_orphan(&mut self, token: ReadToken, events: &mut VecDeque<Event>) -> bool {
        let found = self.orphans.remove(&token);
        if found {
            events.push_back(Event::ReadDiscarded { token });
        }
        found
    }

    /// A READ that was never posted and whose request ended: forgotten
    /// (no completion will come for it). Whether it was one.
    pub(crate) fn forget_orphan(&mut self, token: ReadToken) -> bool {
        self.orphans.remove(&token)
    }

    pub(crate) fn orphans(&self) -> usize {
        self.orphans.len()
    }
}
