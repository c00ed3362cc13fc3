//! The owner's half, shared by both directions: buffers, their generations,
//! holds, and the answer to a confirm.

use std::time::Duration;

use crate::ids::{BufferId, Generation, MsgId, Region};
use crate::output::{Event, Release, UsageError};
use crate::sorted::SortedDeque;
use crate::wire::Verdict;

/// One exposure: `buffer` at its current generation is held for `msg`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Hold {
    msg: MsgId,
    deadline: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Slot {
    region: Region,
    /// The generation of the current (or next) exposure. `None`: retired.
    generation: Option<Generation>,
    hold: Option<Hold>,
}

/// The buffers one side exposes on one connection.
///
/// Holds are indexed by message and by deadline, so every call is
/// O(log buffers) amortized (an offer far out of message order shifts the
/// holds between, see [`SortedDeque`]), but [`Owner::release_all`] (once per
/// connection).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Owner {
    slots: Vec<Slot>,
    /// `(msg, buffer)` of every hold, for [`Owner::release_msg`].
    by_msg: SortedDeque<(MsgId, BufferId), ()>,
    /// `(deadline, buffer)` of every hold, earliest first.
    deadlines: SortedDeque<(Duration, BufferId), ()>,
}

impl Owner {
    pub(crate) fn add(&mut self, region: Region) -> BufferId {
        let id = BufferId::from_raw(u32::try_from(self.slots.len()).unwrap_or(u32::MAX));
        if self.slots.len() < u32::MAX as usize {
            self.slots.push(Slot { region, generation: Some(Generation::from_raw(0)), hold: None });
            // Room for every buffer held at once: a hold allocates nothing.
            self.by_msg.reserve(self.slots.len());
            self.deadlines.reserve(self.slots.len());
        }
        id
    }

    /// Points a free `buffer` at another `region` (a range of memory the
    /// user registered, exposed one range at a time). The generation moves
    /// on, so nothing said about the old region can match the new one.
    pub(crate) fn set_region(&mut self, buffer: BufferId, region: Region) -> Result<(), UsageError> {
        let slot = self.slots.get_mut(buffer.raw() as usize).ok_or(UsageError::UnknownBuffer(buffer))?;
        let generation = slot.generation.ok_or(UsageError::BufferRetired(buffer))?;
        if slot.hold.is_some() {
            return Err(UsageError::BufferBusy(buffer));
        }
        slot.generation = generation.next();
        slot.region = region;
        slot.generation.map(|_| ()).ok_or(UsageError::BufferRetired(buffer))
    }

    fn slot(&self, buffer: BufferId) -> Option<&Slot> {
        self.slots.get(buffer.raw() as usize)
    }

    pub(crate) fn generation(&self, buffer: BufferId) -> Option<Generation> {
        self.slot(buffer).and_then(|s| s.generation)
    }

    pub(crate) fn is_free(&self, buffer: BufferId) -> bool {
        self.slot(buffer).is_some_and(|s| s.hold.is_none() && s.generation.is_some())
    }

    /// The message `buffer` is held for, if it is.
    pub(crate) fn holder(&self, buffer: BufferId) -> Option<MsgId> {
        self.slot(buffer).and_then(|s| s.hold).map(|h| h.msg)
    }

    pub(crate) fn held(&self) -> usize {
        self.deadlines.len()
    }

    /// Exposes `buffer[..len]` for `msg` until `deadline`: the generation and
    /// region to put in the offer.
    pub(crate) fn hold(
        &mut self,
        buffer: BufferId,
        len: u32,
        msg: MsgId,
        deadline: Duration,
    ) -> Result<(Generation, Region), UsageError> {
        let slot = self.slots.get_mut(buffer.raw() as usize).ok_or(UsageError::UnknownBuffer(buffer))?;
        let generation = slot.generation.ok_or(UsageError::BufferRetired(buffer))?;
        if slot.hold.is_some() {
            return Err(UsageError::BufferBusy(buffer));
        }
        if len > slot.region.len() {
            return Err(UsageError::TooLong { len, capacity: slot.region.len() });
        }
        slot.hold = Some(Hold { msg, deadline });
        let region = slot.region.prefix(len);
        self.by_msg.insert((msg, buffer), ());
        self.deadlines.insert((deadline, buffer), ());
        self.check_indexes();
        Ok((generation, region))
    }

    /// The answer to a confirm of (`msg`, `buffer`, `generation`). `Intact`
    /// releases the hold (the reader has the data), so the same confirm asked
    /// again gets `Reused`: `Intact` is said at most once per exposure.
    pub(crate) fn answer(
        &mut self,
        msg: MsgId,
        buffer: BufferId,
        generation: Generation,
        events: &mut impl Extend<Event>,
    ) -> Verdict {
        let Some(slot) = self.slots.get(buffer.raw() as usize) else {
            return Verdict::Unknown;
        };
        let Some(current) = slot.generation else {
            // Retired after its last exposure: every generation it had is past.
            return Verdict::Reused;
        };
        if generation < current {
            return Verdict::Reused;
        }
        if generation > current {
            return Verdict::Unknown;
        }
        match slot.hold {
            Some(hold) if hold.msg == msg => {
                self.release(buffer, Release::Confirmed, events);
                Verdict::Intact
            }
            // The current generation was never exposed for `msg`.
            _ => Verdict::Unknown,
        }
    }

    /// Releases the holds for `msg`, if any, in buffer order. (A well-behaved
    /// peer gets at most one buffer per message.)
    pub(crate) fn release_msg(
        &mut self,
        msg: MsgId,
        reason: Release,
        events: &mut impl Extend<Event>,
    ) -> bool {
        let mut found = false;
        let (lo, hi) = ((msg, BufferId::from_raw(0)), (msg, BufferId::from_raw(u32::MAX)));
        while let Some((_, buffer)) = self.by_msg.first_in(&lo, &hi) {
            self.release(buffer, reason, events);
            found = true;
        }
        found
    }

    /// Releases every hold whose deadline is at or before `now`, in buffer
    /// order.
    pub(crate) fn expire(&mut self, now: Duration, events: &mut impl Extend<Event>) {
        let due = self.deadlines.due(now);
        for buffer in due {
            self.release(buffer, Release::Expired, events);
        }
    }

    /// Releases every hold (once per connection: visits every buffer).
    pub(crate) fn release_all(&mut self, reason: Release, events: &mut impl Extend<Event>) {
        for i in 0..self.slots.len() {
            if self.slots[i].hold.is_some() {
                self.release(BufferId::from_raw(i as u32), reason, events);
            }
        }
    }

    pub(crate) fn next_deadline(&self) -> Option<Duration> {
        self.deadlines.first().map(|(&(deadline, _), ())| deadline)
    }

    /// Ends the current exposure of `buffer`: the generation moves on, so
    /// nothing said about the old one can ever match again, and the buffer is
    /// the user's.
    fn release(&mut self, buffer: BufferId, reason: Release, events: &mut impl Extend<Event>) {
        let Some(slot) = self.slots.get_mut(buffer.raw() as usize) else { return };
        if let Some(hold) = slot.hold.take() {
            slot.generation = slot.generation.and_then(Generation::next);
            self.by_msg.remove(&(hold.msg, buffer));
            self.deadlines.remove(&(hold.deadline, buffer));
            events.extend([Event::BufferFree { buffer, msg: hold.msg, reason }]);
        }
        self.check_indexes();
    }

    /// Debug builds: the indexes agree with the holds (O(buffers), so not
    /// in release builds).
    fn check_indexes(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let holds = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.hold.map(|h| (BufferId::from_raw(i as u32), h)));
        assert!(self.by_msg.holds_exactly(holds.clone().map(|(b, h)| ((h.msg, b), ()))), "holds by message");
        assert!(self.deadlines.holds_exactly(holds.map(|(b, h)| ((h.deadline, b), ()))), "hold deadlines");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_buffer_moves_to_another_region_and_its_old_generation_is_past() {
        let mut o = Owner::default();
        let mut events = Vec::new();
        let b = o.add(Region::new(0x1000, 64, 7));
        let msg = MsgId::from_raw(1);
        let (g0, r0) = o.hold(b, 64, msg, Duration::from_secs(1)).unwrap();
        assert_eq!(r0.addr(), 0x1000);
        assert_eq!(o.set_region(b, Region::new(0x9000, 128, 7)), Err(UsageError::BufferBusy(b)));
        o.release_msg(msg, Release::Confirmed, &mut events);
        o.set_region(b, Region::new(0x9000, 128, 7)).unwrap();
        let (g1, r1) = o.hold(b, 128, MsgId::from_raw(2), Duration::from_secs(1)).unwrap();
        assert_eq!((r1.addr(), r1.len()), (0x9000, 128));
        assert!(g1 > g0);
        assert_eq!(o.answer(msg, b, g0, &mut events), Verdict::Reused, "the old exposure is past");
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn verdicts_follow_the_generation_rules() {
        let mut o = Owner::default();
        let mut ev = Vec::new();
        let b = o.add(Region::new(0x1000, 64, 7));
        let (m1, m2) = (MsgId::from_raw(1), MsgId::from_raw(2));
        let (g0, r) = o.hold(b, 16, m1, secs(5)).unwrap();
        assert_eq!((g0.raw(), r.len(), r.addr()), (0, 16, 0x1000));
        assert_eq!(o.hold(b, 16, m2, secs(5)), Err(UsageError::BufferBusy(b)));
        // Wrong message, future generation, unknown buffer: never intact.
        assert_eq!(o.answer(m2, b, g0, &mut ev), Verdict::Unknown);
        assert_eq!(o.answer(m1, b, Generation::from_raw(1), &mut ev), Verdict::Unknown);
        assert_eq!(o.answer(m1, BufferId::from_raw(9), g0, &mut ev), Verdict::Unknown);
        assert!(ev.is_empty());
        assert_eq!(o.answer(m1, b, g0, &mut ev), Verdict::Intact);
        assert_eq!(ev, vec![Event::BufferFree { buffer: b, msg: m1, reason: Release::Confirmed }]);
        // A replay of an answered confirm: the exposure is over.
        assert_eq!(o.answer(m1, b, g0, &mut ev), Verdict::Reused);
        assert_eq!(o.generation(b), Some(Generation::from_raw(1)));
        assert!(o.is_free(b));
    }

    #[test]
    fn expiry_bumps_the_generation_and_frees() {
        let mut o = Owner::default();
        let mut ev = Vec::new();
        let b = o.add(Region::new(0, 8, 1));
        let m = MsgId::from_raw(1);
        let (g, _) = o.hold(b, 8, m, secs(5)).unwrap();
        assert_eq!(o.next_deadline(), Some(secs(5)));
        o.expire(secs(4), &mut ev);
        assert!(ev.is_empty());
        o.expire(secs(5), &mut ev);
        assert_eq!(ev, vec![Event::BufferFree { buffer: b, msg: m, reason: Release::Expired }]);
        assert_eq!(o.answer(m, b, g, &mut ev), Verdict::Reused);
        assert_eq!(o.next_deadline(), None);
        assert_eq!(o.hold(b, 9, m, secs(9)), Err(UsageError::TooLong { len: 9, capacity: 8 }));
    }

    /// The debug self-check is live and fires when an index drifts from the
    /// holds (the model checker relies on it).
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "hold deadlines")]
    fn check_indexes_notices_a_lost_hold_deadline() {
        let mut o = Owner::default();
        let b = o.add(Region::new(0, 8, 1));
        o.hold(b, 8, MsgId::from_raw(1), secs(5)).unwrap();
        o.deadlines.remove(&(secs(5), b));
        o.check_indexes();
    }

    #[test]
    fn a_retired_buffer_cannot_be_exposed_and_is_never_intact() {
        let mut o = Owner::default();
        let mut ev = Vec::new();
        let b = o.add(Region::new(0, 8, 1));
        o.slots[0].generation = Some(Generation::from_raw(u64::MAX));
        o.check_indexes();
        let m = MsgId::from_raw(1);
        let (g, _) = o.hold(b, 8, m, secs(1)).unwrap();
        assert!(o.release_msg(m, Release::Cancelled, &mut ev));
        assert_eq!(o.hold(b, 8, m, secs(1)), Err(UsageError::BufferRetired(b)));
        assert_eq!(o.answer(m, b, g, &mut ev), Verdict::Reused);
        assert!(!o.is_free(b));
    }
}
