//! Slot bookkeeping: control slots (SEND and RECV frames) and data buffers,
//! and where each data buffer is in the data region.

use super::types::Config;

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

    /// How many buffers each class has, in class order.
    pub(crate) fn counts(&self) -> Vec<u32> {
        self.classes.iter().map(|c| c.count).collect()
    }

    /// The class of `slot` (which must exist).
    pub(crate) fn class_of(&self, slot: u32) -> usize {
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
    holder: Vec<Holder>,
    lending: Vec<u32>,
    /// Each slot's class.
    class: Vec<u8>,
    /// Free slots of each class, so taking one is O(1).
    free: Vec<Vec<u32>>,
    /// Slots that entered (true) or left (false) the user's hands since the
    /// last `take_changes`, for `Nic::set_cpu_held`.
    changes: Vec<(u32, bool)>,
}

impl Slots {
    /// `n` slots of one class.
    pub(crate) fn new(n: u32) -> Slots {
        Slots::with_classes(&[n])
    }

    /// `counts[k]` slots of class `k`, for each class.
    pub(crate) fn with_classes(counts: &[u32]) -> Slots {
        let n: u32 = counts.iter().sum();
        let mut class = Vec::with_capacity(n as usize);
        let mut free = Vec::with_capacity(counts.len());
        let mut first = 0;
        for (k, &count) in counts.iter().enumerate() {
            class.extend(std::iter::repeat(k as u8).take(count as usize));
            free.push((first..first + count).rev().collect());
            first += count;
        }
        Slots {
            holder: vec![Holder::Free; n as usize],
            lending: vec![0; n as usize],
            class,
            free,
            changes: Vec::with_capacity(2 * n as usize),
        }
    }

    /// Take a free slot of the first class for `to`.
    pub(crate) fn take(&mut self, to: Holder) -> Option<u32> {
        self.take_in(0, to)
    }

    /// Take a free slot of class `k` for `to`.
    pub(crate) fn take_in(&mut self, k: usize, to: Holder) -> Option<u32> {
        let i = self.free.get_mut(k)?.pop()?;
        debug_assert_eq!(self.holder[i as usize], Holder::Free);
        self.set(i, to);
        Some(i)
    }

    /// Free slots of class `k`.
    pub(crate) fn free_in(&self, k: usize) -> usize {
        self.free.get(k).map_or(0, Vec::len)
    }

    fn set(&mut self, i: u32, to: Holder) {
        let h = &mut self.holder[i as usize];
        if to == Holder::User {
            self.lending[i as usize] = self.lending[i as usize].wrapping_add(1);
        }
        if to == Holder::Free && *h != Holder::Free {
            self.free[usize::from(self.class[i as usize])].push(i);
        }
        if (to == Holder::User) != (*h == Holder::User) {
            self.changes.push((i, to == Holder::User));
        }
        *h = to;
    }

    /// Move slot `i` from `from` to `to`; false (and no change) if it was not held by `from`.
    pub(crate) fn hand(&mut self, i: u32, from: Holder, to: Holder) -> bool {
        match self.holder.get(i as usize) {
            Some(h) if *h == from && from != Holder::Free => {
                self.set(i, to);
                true
            }
            _ => false,
        }
    }

    /// Move the recorded user hand-overs into `out` (emptied first).
    pub(crate) fn take_changes(&mut self, out: &mut Vec<(u32, bool)>) {
        out.clear();
        std::mem::swap(out, &mut self.changes);
    }

    /// The current lending of slot `i` (meaningful while the user holds it).
    pub(crate) fn lending(&self, i: u32) -> u32 {
        self.lending.get(i as usize).copied().unwrap_or(0)
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
        self.holder.get(i as usize).copied()
    }

    pub(crate) fn count(&self, h: Holder) -> usize {
        if h == Holder::Free {
            return self.free.iter().map(Vec::len).sum();
        }
        self.holder.iter().filter(|x| **x == h).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::{BufClass, Policies, Policy, Role};

    #[test]
    fn classes_are_laid_out_by_size_after_the_standard_one() {
        let mut cfg = Config::new(Role::Client, Policies::both(Policy::Mw));
        cfg.buffers = 4;
        cfg.buffer_size = 4096;
        cfg.large_buffers = vec![BufClass { size: 1 << 20, count: 1 }, BufClass { size: 65536, count: 2 }];
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
}
