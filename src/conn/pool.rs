//! Slot bookkeeping: control slots (SEND and RECV frames) and data buffers.

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

/// A fixed set of equal slots with an owner each. Each hand-over to the
/// user starts a new *lending* (a generation), so a handle from an earlier
/// lending can never give back a later one.
#[derive(Debug)]
pub(crate) struct Slots {
    holder: Vec<Holder>,
    lending: Vec<u32>,
    /// Free slots, so taking one is O(1).
    free: Vec<u32>,
    /// Slots that entered (true) or left (false) the user's hands since the
    /// last `take_changes`, for `Nic::set_cpu_held`.
    changes: Vec<(u32, bool)>,
}

impl Slots {
    pub(crate) fn new(n: u32) -> Slots {
        Slots {
            holder: vec![Holder::Free; n as usize],
            lending: vec![0; n as usize],
            free: (0..n).rev().collect(),
            changes: Vec::with_capacity(2 * n as usize),
        }
    }

    /// Take a free slot for `to`.
    pub(crate) fn take(&mut self, to: Holder) -> Option<u32> {
        let i = self.free.pop()?;
        debug_assert_eq!(self.holder[i as usize], Holder::Free);
        self.set(i, to);
        Some(i)
    }

    fn set(&mut self, i: u32, to: Holder) {
        let h = &mut self.holder[i as usize];
        if to == Holder::User {
            self.lending[i as usize] = self.lending[i as usize].wrapping_add(1);
        }
        if to == Holder::Free && *h != Holder::Free {
            self.free.push(i);
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
            return self.free.len();
        }
        self.holder.iter().filter(|x| **x == h).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
