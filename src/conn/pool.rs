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

/// A fixed set of equal slots with an owner each.
#[derive(Debug)]
pub(crate) struct Slots {
    holder: Vec<Holder>,
}

impl Slots {
    pub(crate) fn new(n: u32) -> Slots {
        Slots { holder: vec![Holder::Free; n as usize] }
    }

    /// Take a free slot for `to`.
    pub(crate) fn take(&mut self, to: Holder) -> Option<u32> {
        let i = self.holder.iter().position(|h| *h == Holder::Free)?;
        self.holder[i] = to;
        Some(i as u32)
    }

    /// Move slot `i` from `from` to `to`; false (and no change) if it was not held by `from`.
    pub(crate) fn hand(&mut self, i: u32, from: Holder, to: Holder) -> bool {
        match self.holder.get_mut(i as usize) {
            Some(h) if *h == from => {
                *h = to;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn holder(&self, i: u32) -> Option<Holder> {
        self.holder.get(i as usize).copied()
    }

    pub(crate) fn count(&self, h: Holder) -> usize {
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
