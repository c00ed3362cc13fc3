//! Slot bookkeeping: control slots (SEND and RECV frames) and data buffers,
//! and where each data buffer is in the data region.

use super::bufpool::BufferPool;
use super::config::Config;
use super::proto::ids::{id_map, IdMap};

/// Where each data buffer is: the size classes laid out one after the
/// other in the data region (the standard class, `Config::buffers` of
/// `Config::buffer_size`, then `Config::large_buffers` by size). Slots are
/// numbered through the classes in that order.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    classes: Vec<Class>,
}

#[derive(Clone, Copy, Debug)]
struct Class {
    size: u32,
    first: u32,
    count: u32,
    offset: u64,
}

impl Layout {
    pub(crate) fn new(cfg: &Config) -> Layout {
        let mut sizes: Vec<(u32, u32)> = vec![(cfg.buffer_size, cfg.buffers)];
        let mut large: Vec<(u32, u32)> = cfg.large_buffers.iter().map(|c| (c.size, c.count)).collect();
        large.sort_unstable();
        sizes.extend(large.into_iter().filter(|&(size, count)| count > 0 && size > 0));
        let (mut first, mut offset) = (0u32, 0u64);
        let classes = sizes
            .into_iter()
            .map(|(size, count)| {
                let c = Class { size, first, count, offset };
                first += count;
                offset += u64::from(size) * u64::from(count);
                c
            })
            .collect();
        Layout { classes }
    }

    /// Buffers in all classes.
    pub(crate) fn slots(&self) -> u32 {
        self.classes.last().map_or(0, |c| c.first + c.count)
    }

    /// Bytes of the data region.
    pub(crate) fn bytes(&self) -> u64 {
        self.classes.last().map_or(0, |c| c.offset + u64::from(c.size) * u64::from(c.count))
    }

    /// Each class's buffer size, in class order.
    pub(crate) fn sizes(&self) -> Vec<u32> {
        self.classes.iter().map(|c| c.size).collect()
    }

    /// How many buffers each class has, in class order.
    pub(crate) fn counts(&self) -> Vec<u32> {
        self.classes.iter().map(|c| c.count).collect()
    }

    /// The class of `slot` (which must exist).
    #[inline]
    pub(crate) fn class_of(&self, slot: u32) -> usize {
        if let [only] = self.classes.as_slice() {
            // The usual layout: one class, no search.
            debug_assert!(slot < only.count, "slot {slot} of {}", only.count);
            return 0;
        }
        self.classes.partition_point(|c| c.first + c.count <= slot)
    }

    /// Where `slot` starts in the data region.
    pub(crate) fn offset(&self, slot: u32) -> u64 {
        let c = &self.classes[self.class_of(slot)];
        c.offset + u64::from(slot - c.first) * u64::from(c.size)
    }

    /// The capacity of `slot`.
    pub(crate) fn size(&self, slot: u32) -> u32 {
        self.classes[self.class_of(slot)].size
    }

    /// The slot that starts at `offset`, if one does.
    pub(crate) fn slot_at(&self, offset: u64) -> Option<u32> {
        let i = self.classes.partition_point(|c| c.offset + u64::from(c.size) * u64::from(c.count) <= offset);
        let c = self.classes.get(i)?;
        let within = offset.checked_sub(c.offset)?;
        (within % u64::from(c.size) == 0).then(|| c.first + (within / u64::from(c.size)) as u32)
    }

    /// The largest buffer.
    pub(crate) fn largest(&self) -> u32 {
        self.classes.iter().map(|c| c.size).max().unwrap_or(0)
    }

    /// The classes whose buffers hold `len` bytes, smallest first.
    pub(crate) fn fitting(&self, len: u32) -> impl Iterator<Item = usize> + '_ {
        (0..self.classes.len()).filter(move |&i| self.classes[i].size >= len)
    }
}

/// Who holds a data buffer right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Holder {
    /// In the pool, free.
    Free,
    /// A `Buf` handle held by the user.
    User,
    /// Exposed to the peer (bound window or offered region).
    Exposed,
    /// The destination of a READ in flight.
    Reading,
}

/// A fixed set of slots in classes (numbered class by class), with an
/// owner each. Each hand-over to the user starts a new *lending* (a
/// generation), so a handle from an earlier lending can never give back a
/// later one.
#[derive(Debug)]
pub(crate) struct Slots {
    /// Each slot's holder, lending and class, together (one bounds check
    /// per hand-over).
    slots: Vec<Slot>,
    /// Free slots of each class, so taking one is O(1).
    free: Vec<Vec<u32>>,
    /// Backing from a shared pool, when the slots are a connection's
    /// places in it rather than buffers of its own.
    backed: Option<Backed>,
}

/// Slot numbers backed by buffers of a [`BufferPool`]: a slot that leaves
/// the free list takes a buffer of its class's size from the pool, and
/// gives it back when it returns to the free list. The slots are a member
/// of the pool (its fairness: `bufpool`'s module docs).
#[derive(Debug)]
struct Backed {
    pool: BufferPool,
    /// Its member id in the pool (a take that finds nothing queues it
    /// there, to be woken in its turn: [`Slots::unstarve`]).
    member: u32,
    /// The pool's class for each of ours.
    class: Vec<usize>,
    /// The pool buffer behind each slot (`NONE` while free).
    of: Vec<u32>,
    /// The slot each taken pool buffer backs, by its region's raw id.
    by_mr: IdMap<u32, u32>,
    /// Set by the pool when it is the slots' turn for something they wait
    /// for (it then wakes their waker).
    turn: crate::sync::Arc<crate::sync::AtomicBool>,
    /// Turns to go before a wake-up from the pool that was not used is
    /// passed on (0: none pending): see [`Slots::end_turn`].
    settle_in: u8,
    /// No evidence will come for the buffers held (the QP could not be
    /// destroyed): none goes back to the pool, unless a later destroy works
    /// ([`Slots::release_backing`]).
    quarantined: bool,
    /// The pool buffers freed from their slots while quarantined.
    kept: Vec<u32>,
}

const NONE: u32 = u32::MAX;

impl Drop for Backed {
    fn drop(&mut self) {
        self.pool.leave(self.member);
    }
}

/// One slot of [`Slots`].
#[derive(Clone, Copy, Debug)]
struct Slot {
    holder: Holder,
    /// Its class.
    class: u8,
    lending: u32,
}

impl Slots {
    /// `n` slots of one class.
    pub(crate) fn new(n: u32) -> Slots {
        Slots::with_classes(&[n])
    }

    /// `counts[k]` slots of class `k`, for each class.
    pub(crate) fn with_classes(counts: &[u32]) -> Slots {
        let n: u32 = counts.iter().sum();
        let mut slots = Vec::with_capacity(n as usize);
        let mut free = Vec::with_capacity(counts.len());
        let mut first = 0;
        for (k, &count) in counts.iter().enumerate() {
            let slot = Slot { holder: Holder::Free, class: k as u8, lending: 0 };
            slots.extend(std::iter::repeat(slot).take(count as usize));
            free.push((first..first + count).rev().collect());
            first += count;
        }
        Slots { slots, free, backed: None }
    }

    /// Back the slots with `pool`'s buffers: slot class `k` (of
    /// `classes[k]`: size and count) with the pool's class of that size. Fails (naming the size) when the pool has
    /// no such class.
    pub(crate) fn back_with(&mut self, pool: BufferPool, classes: &[(u32, u32)]) -> Result<(), u32> {
        // A class without slots is never taken from: it needs no pool class.
        let class = classes
            .iter()
            .map(|&(size, count)| match pool.class_of_size(size) {
                Some(k) => Ok(k),
                None if count == 0 => Ok(usize::MAX),
                None => Err(size),
            })
            .collect::<Result<Vec<_>, u32>>()?;
        let n = self.slots.len();
        let by_mr = id_map(n);
        let (member, turn) = pool.join();
        self.backed = Some(Backed {
            pool,
            member,
            class,
            of: vec![NONE; n],
            by_mr,
            turn,
            settle_in: 0,
            quarantined: false,
            kept: Vec::new(),
        });
        Ok(())
    }

    /// Wake `w` when it is the slots' turn for something of the pool they
    /// wait for (a buffer, a window).
    pub(crate) fn wake_on_pool(&mut self, w: &std::task::Waker) {
        if let Some(b) = &self.backed {
            b.pool.set_waker(b.member, w);
        }
    }

    /// The owner's turn is over. A wake-up from the pool (seen by
    /// [`Slots::unstarve`]) that no try has used by the end of the *next*
    /// turn goes to the next waiter: the turn after the wake-up lets the
    /// tasks it woke (a user's `alloc`) try first; `defer`: not yet, those
    /// tasks have not run. Returns true when that next turn is due (the
    /// caller runs one soon).
    pub(crate) fn end_turn(&mut self, defer: bool) -> bool {
        let Some(b) = &mut self.backed else { return false };
        match b.settle_in {
            0 => false,
            1 if defer => true,
            2 => {
                b.settle_in = 1;
                true
            }
            _ => {
                b.settle_in = 0;
                b.pool.settle(b.member);
                false
            }
        }
    }

    /// Take an unbound window of the pool for an exposure. `None`: the
    /// pool has none (the connection is woken, as for a buffer, when one
    /// comes back), or the slots are not backed by a pool.
    pub(crate) fn take_window(&mut self) -> Option<mwcap_mw::Window> {
        let b = self.backed.as_ref()?;
        b.pool.take_window(b.member)
    }

    /// Give the pool back a window lent for an exposure, unbound (its
    /// LOCAL_INV completed successfully), or never bound (`used` false: the
    /// grant it was taken for was refused).
    pub(crate) fn give_window(&self, w: mwcap_mw::Window, used: bool) {
        if let Some(b) = &self.backed {
            b.pool.give_window(w, used);
        }
    }

    /// Tell the pool that `n` of its windows were deallocated.
    pub(crate) fn windows_dropped(&self, n: u32) {
        if let Some(b) = &self.backed {
            b.pool.windows_dropped(n);
        }
    }

    /// Whether the pool woke the slots for something they wait for (a
    /// buffer or window came back and it is their turn): the caller tries
    /// again, and a wake-up no try uses is passed on ([`Slots::end_turn`]).
    pub(crate) fn unstarve(&mut self) -> bool {
        let Some(b) = &mut self.backed else { return false };
        if !b.turn.swap(false, crate::sync::Ordering::AcqRel) {
            return false;
        }
        b.settle_in = 2;
        true
    }

    /// The pool and its buffer behind slot `i`, while it is taken.
    pub(crate) fn backing(&self, i: u32) -> Option<(&BufferPool, u32)> {
        let b = self.backed.as_ref()?;
        let of = *b.of.get(i as usize)?;
        (of != NONE).then_some((&b.pool, of))
    }

    /// Keep every buffer taken now (and later) out of the pool for good.
    pub(crate) fn quarantine(&mut self) {
        if let Some(b) = &mut self.backed {
            b.quarantined = true;
        }
    }

    /// The slot a taken pool buffer (named by its region's raw id) backs.
    pub(crate) fn slot_of_mr(&self, mr: u32) -> Option<u32> {
        self.backed.as_ref()?.by_mr.get(&mr).copied()
    }

    /// Whether the slots are backed by a shared pool.
    pub(crate) fn is_backed(&self) -> bool {
        self.backed.is_some()
    }

    /// Give every slot's pool buffer back, whoever holds the slot, if
    /// `gone`: nothing can reach any of them (the QP destroyed, its windows
    /// freed), even if an earlier destroy failed. Otherwise quarantine them.
    pub(crate) fn release_backing(&mut self, gone: bool) {
        if !gone {
            self.quarantine();
        } else if let Some(b) = &mut self.backed {
            b.quarantined = false;
            b.by_mr.clear();
            for of in b.of.iter_mut().filter(|o| **o != NONE) {
                b.pool.give(std::mem::replace(of, NONE));
            }
            for of in b.kept.drain(..) {
                b.pool.give(of);
            }
        }
    }

    /// Take a free slot of the first class for `to`.
    pub(crate) fn take(&mut self, to: Holder) -> Option<u32> {
        self.take_in(0, to)
    }

    /// Take a free slot of class `k` for `to` (an incoming payload, when
    /// backed: it may take the pool's reserve).
    pub(crate) fn take_in(&mut self, k: usize, to: Holder) -> Option<u32> {
        self.take_backed(k, to, false)
    }

    /// Take a free slot of class `k` for a user's outgoing payload: when
    /// backed, the pool's reserve for incoming payloads stays.
    pub(crate) fn take_outgoing(&mut self, k: usize) -> Option<u32> {
        self.take_backed(k, Holder::User, true)
    }

    #[inline]
    fn take_backed(&mut self, k: usize, to: Holder, outgoing: bool) -> Option<u32> {
        let i = *self.free.get(k)?.last()?;
        if self.backed.is_some() {
            self.back(k, i, outgoing)?;
        }
        self.free[k].pop();
        debug_assert_eq!(self.slots[i as usize].holder, Holder::Free);
        self.set(i, to);
        Some(i)
    }

    /// Take a buffer of the pool for slot `i` of class `k` (backed); none
    /// while quarantined (the connection is down: what it took would only
    /// join what it keeps until its QP is gone).
    #[inline(never)]
    fn back(&mut self, k: usize, i: u32, outgoing: bool) -> Option<()> {
        let b = self.backed.as_mut().filter(|b| !b.quarantined)?;
        let class = b.class[k];
        let of = b.pool.take(b.member, class, outgoing)?;
        b.of[i as usize] = of;
        b.by_mr.insert(b.pool.info(of).id.raw(), i);
        Some(())
    }

    /// The first of `classes` (smallest first) with a free slot for which
    /// `take` succeeds. With a shared pool a class with free slots may find
    /// the pool's buffers of its size all taken (the failed take queues the
    /// slots for a wake-up) and the next class is tried; once one serves,
    /// the classes that queued stop waiting ([`Slots::stop_waiting`]).
    #[inline]
    pub(crate) fn first_fitting<T>(
        &mut self,
        classes: impl IntoIterator<Item = usize>,
        mut take: impl FnMut(&mut Slots, usize) -> Option<T>,
    ) -> Option<T> {
        let mut queued = 0u64;
        let found = classes.into_iter().find_map(|k| {
            if self.free_in(k) == 0 {
                return None;
            }
            let got = take(self, k);
            queued |= u64::from(got.is_none()) << k;
            got
        });
        if found.is_some() && queued != 0 {
            self.stop_waiting(queued);
        }
        found
    }

    /// The slots no longer wait for the pool's buffers of their classes in
    /// `classes` (bits): a take of a larger class that fits as well
    /// succeeded after those failed ([`BufferPool::withdraw`]).
    #[cold]
    fn stop_waiting(&mut self, classes: u64) {
        let Some(b) = &self.backed else { return };
        let mut mask = 0u64;
        for (k, &c) in b.class.iter().enumerate() {
            if classes & (1 << k) != 0 && c != usize::MAX {
                mask |= 1 << c;
            }
        }
        if mask != 0 {
            b.pool.withdraw(b.member, mask);
        }
    }

    /// Whether a take of class `k` would find a buffer now: a free slot,
    /// and when backed, a free buffer of the pool (if not, the slots wait
    /// for one as a failed take does).
    pub(crate) fn can_take(&mut self, k: usize) -> bool {
        if self.free_in(k) == 0 {
            return false;
        }
        let Some(b) = &self.backed else { return true };
        b.pool.has_free(b.member, b.class[k])
    }

    /// Free slots of class `k`. When backed by a pool, a take may still
    /// find the pool's class empty (and the slots then wait for it).
    pub(crate) fn free_in(&self, k: usize) -> usize {
        self.free.get(k).map_or(0, Vec::len)
    }

    #[inline]
    fn set(&mut self, i: u32, to: Holder) {
        let at = i as usize;
        let slot = &mut self.slots[at];
        let (from, class) = (slot.holder, slot.class);
        slot.holder = to;
        if to == Holder::User {
            slot.lending = slot.lending.wrapping_add(1);
        }
        if to == Holder::Free && from != Holder::Free {
            self.free[usize::from(class)].push(i);
            if self.backed.is_some() {
                self.unback(at);
            }
        }
    }

    /// Slot `at` (backed) goes back to the free list: its pool buffer goes
    /// back to the pool, unless quarantined. (A buffer the user held was
    /// released by its handle already: a `Buf`'s hold on the memory ends
    /// when the handle does.)
    #[inline(never)]
    fn unback(&mut self, at: usize) {
        let Some(b) = &mut self.backed else { return };
        let of = std::mem::replace(&mut b.of[at], NONE);
        if of != NONE {
            b.by_mr.remove(&b.pool.info(of).id.raw());
            if b.quarantined {
                b.kept.push(of);
            } else {
                b.pool.give(of);
            }
        }
    }

    /// Move slot `i` from `from` to `to`; false (and no change) if it was not held by `from`.
    pub(crate) fn hand(&mut self, i: u32, from: Holder, to: Holder) -> bool {
        match self.slots.get(i as usize) {
            Some(s) if s.holder == from && from != Holder::Free => {
                self.set(i, to);
                true
            }
            _ => false,
        }
    }

    /// The current lending of slot `i` (meaningful while the user holds it).
    pub(crate) fn lending(&self, i: u32) -> u32 {
        self.slots.get(i as usize).map_or(0, |s| s.lending)
    }

    /// The user gives slot `i` back to the pool, if they still hold it
    /// under `lending` (a stale handle gives back nothing); returns whether
    /// it went back.
    pub(crate) fn give_back(&mut self, i: u32, lending: u32) -> bool {
        self.lent(i, lending) && self.hand(i, Holder::User, Holder::Free)
    }

    /// Whether the user holds slot `i` under lending `lending`.
    pub(crate) fn lent(&self, i: u32, lending: u32) -> bool {
        self.holder(i) == Some(Holder::User) && self.lending(i) == lending
    }

    pub(crate) fn holder(&self, i: u32) -> Option<Holder> {
        self.slots.get(i as usize).map(|s| s.holder)
    }

    /// Whether some slot, of any class, is free.
    #[inline]
    pub(crate) fn any_free(&self) -> bool {
        self.free.iter().any(|f| !f.is_empty())
    }

    pub(crate) fn count(&self, h: Holder) -> usize {
        if h == Holder::Free {
            return self.free.iter().map(Vec::len).sum();
        }
        self.slots.iter().filter(|s| s.holder == h).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::BufClass;

    #[test]
    fn classes_are_laid_out_by_size_after_the_standard_one() {
        let cfg = Config {
            buffers: 4,
            buffer_size: 4096,
            large_buffers: vec![BufClass { size: 1 << 20, count: 1 }, BufClass { size: 65536, count: 2 }],
            ..Config::default()
        };
        let l = Layout::new(&cfg);
        assert_eq!(l.slots(), 7);
        assert_eq!(l.bytes(), 4 * 4096 + 2 * 65536 + (1 << 20));
        assert_eq!((l.offset(3), l.size(3)), (3 * 4096, 4096));
        assert_eq!((l.offset(4), l.size(4)), (4 * 4096, 65536));
        assert_eq!((l.offset(6), l.size(6)), (4 * 4096 + 2 * 65536, 1 << 20));
        for slot in 0..7 {
            assert_eq!(l.slot_at(l.offset(slot)), Some(slot));
        }
        assert_eq!(l.slot_at(4096 + 1), None, "not the start of a slot");
        assert_eq!(l.slot_at(l.bytes()), None);
        assert_eq!(l.fitting(5000).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(l.fitting(2 << 20).count(), 0);
        assert_eq!(l.largest(), 1 << 20);
        let mut s = Slots::with_classes(&l.counts());
        assert_eq!(s.take_in(2, Holder::User), Some(6));
        assert_eq!(s.take_in(2, Holder::User), None);
        assert!(s.hand(6, Holder::User, Holder::Free));
        assert_eq!((s.free_in(2), s.count(Holder::Free)), (1, 7));
    }

    #[test]
    fn a_slot_moves_only_from_its_holder() {
        let mut s = Slots::new(2);
        let a = s.take(Holder::User).unwrap();
        assert!(!s.hand(a, Holder::Exposed, Holder::Free));
        assert!(s.hand(a, Holder::User, Holder::Exposed));
        assert_eq!(s.count(Holder::Exposed), 1);
        let b = s.take(Holder::Reading).unwrap();
        assert_ne!(a, b);
        assert_eq!(s.take(Holder::User), None);
        assert!(s.hand(a, Holder::Exposed, Holder::Free));
        assert_eq!(s.holder(a), Some(Holder::Free));
    }

    /// A quarantined pool buffer stays out of the pool, whether its slot is
    /// held or freed meanwhile (a READ's flush), until the destroy works.
    #[test]
    fn quarantined_buffers_come_back_only_when_the_qp_is_gone() {
        let pool = crate::conn::bufpool::BufferPool::for_model(&[BufClass { size: 4096, count: 4 }], 4);
        let mut s = Slots::new(2);
        s.back_with(pool.clone(), &[(4096, 2)]).unwrap();
        let (a, b) = (s.take(Holder::Exposed).unwrap(), s.take(Holder::Reading).unwrap());
        assert_eq!(pool.stats().free, 2);
        s.release_backing(false);
        assert!(s.hand(b, Holder::Reading, Holder::Free));
        assert_eq!(pool.stats().free, 2, "freed while quarantined: kept");
        // Nor does a quarantined connection take more (each take after a
        // give drained the pool into what it keeps).
        assert_eq!(s.take(Holder::User), None);
        assert_eq!(pool.stats().free, 2, "a quarantined connection takes no buffer");
        s.release_backing(false);
        assert_eq!(pool.stats().free, 2);
        s.release_backing(true);
        assert_eq!(pool.stats().free, 4, "both back once the QP is gone");
        assert_eq!(s.holder(a), Some(Holder::Exposed));
    }
}
