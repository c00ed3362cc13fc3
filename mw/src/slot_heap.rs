//! An indexed min-heap over slot numbers: the engines' timers and free lists.

use std::fmt;
use std::hash::{Hash, Hasher};

const ABSENT: u32 = u32::MAX;

/// A min-heap of slots ordered by `(key, slot)` that knows where each slot
/// sits in it, so the smallest entry is read in O(1) and any slot's entry is
/// inserted or removed in O(log n), without a search and without allocating
/// once the slots exist. At most one entry per slot.
///
/// The engines keep their expiry timers in one (`key` = the deadline: the
/// earliest is the next timeout) and their free slots in another (`key` =
/// `()`: the lowest free slot comes first, as a scan from slot 0 would find
/// it). Entries are removed eagerly when their slot changes state, so the
/// heap never holds a stale deadline.
///
/// Equality and hashing go over the entries in slot order, not over the
/// heap's layout (which depends on the order things happened in): two
/// engines in the same state compare equal, as the model checker needs.
#[derive(Clone, Default)]
pub(crate) struct SlotHeap<K> {
    heap: Vec<(K, u32)>,
    /// Per slot: its index in `heap`, or `ABSENT`.
    at: Vec<u32>,
}

impl<K: Ord + Copy> SlotHeap<K> {
    /// A heap for slots `0..slots` holding every one of them with `key`.
    pub(crate) fn full(slots: usize, key: K) -> SlotHeap<K> {
        // Sorted by slot, equal keys: already a valid heap.
        SlotHeap { heap: (0..slots as u32).map(|s| (key, s)).collect(), at: (0..slots as u32).collect() }
    }

    /// Makes room for one more slot (numbered `slots()`), not in the heap.
    pub(crate) fn add_slot(&mut self) {
        self.at.push(ABSENT);
    }

    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    /// The smallest entry.
    pub(crate) fn peek(&self) -> Option<(K, u32)> {
        self.heap.first().copied()
    }

    /// Removes and returns the smallest entry.
    pub(crate) fn pop(&mut self) -> Option<(K, u32)> {
        let &(_, slot) = self.heap.first()?;
        self.remove(slot).map(|key| (key, slot))
    }

    /// Puts `slot` in with `key`, replacing its entry if it has one.
    pub(crate) fn insert(&mut self, slot: u32, key: K) {
        let i = self.at[slot as usize];
        if i != ABSENT {
            let i = i as usize;
            self.heap[i].0 = key;
            self.up(i);
            self.down(i);
            return;
        }
        self.heap.push((key, slot));
        let i = self.heap.len() - 1;
        self.at[slot as usize] = i as u32;
        self.up(i);
    }

    /// Takes `slot` out; its key, if it was in.
    pub(crate) fn remove(&mut self, slot: u32) -> Option<K> {
        let i = *self.at.get(slot as usize)?;
        if i == ABSENT {
            return None;
        }
        let i = i as usize;
        let key = self.heap[i].0;
        self.at[slot as usize] = ABSENT;
        let last = self.heap.pop()?;
        if i < self.heap.len() {
            // The last entry fills the hole, then finds its place.
            self.heap[i] = last;
            self.at[last.1 as usize] = i as u32;
            self.down(i);
            self.up(i);
        }
        Some(key)
    }

    /// Empties the heap (O(len)).
    pub(crate) fn clear(&mut self) {
        for &(_, slot) in &self.heap {
            self.at[slot as usize] = ABSENT;
        }
        self.heap.clear();
    }

    /// The entries as `(slot, key)`, in slot order (O(slots)).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, K)> + '_ {
        self.at
            .iter()
            .enumerate()
            .filter(|&(_, &i)| i != ABSENT)
            .map(|(s, &i)| (s as u32, self.heap[i as usize].0))
    }

    /// Moves the entry at `i` towards the root until its parent is
    /// smaller, shifting the larger parents down into the hole it leaves.
    fn up(&mut self, mut i: usize) {
        let entry = self.heap[i];
        while i > 0 {
            let parent = (i - 1) / 2;
            let p = self.heap[parent];
            if entry >= p {
                break;
            }
            self.put(i, p);
            i = parent;
        }
        self.put(i, entry);
    }

    /// Moves the entry at `i` towards the leaves until its children are
    /// larger, shifting the smaller child up into the hole it leaves.
    fn down(&mut self, mut i: usize) {
        let len = self.heap.len();
        let entry = self.heap[i];
        loop {
            let left = 2 * i + 1;
            if left >= len {
                break;
            }
            let right = left + 1;
            let mut child = left;
            let mut c = self.heap[left];
            if right < len && self.heap[right] < c {
                child = right;
                c = self.heap[right];
            }
            if c >= entry {
                break;
            }
            self.put(i, c);
            i = child;
        }
        self.put(i, entry);
    }

    fn put(&mut self, i: usize, entry: (K, u32)) {
        self.heap[i] = entry;
        self.at[entry.1 as usize] = i as u32;
    }
}

impl<K: Ord + Copy> PartialEq for SlotHeap<K> {
    fn eq(&self, other: &SlotHeap<K>) -> bool {
        self.len() == other.len() && self.entries().eq(other.entries())
    }
}

impl<K: Ord + Copy> Eq for SlotHeap<K> {}

impl<K: Ord + Copy + Hash> Hash for SlotHeap<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.len().hash(state);
        for entry in self.entries() {
            entry.hash(state);
        }
    }
}

impl<K: Ord + Copy + fmt::Debug> fmt::Debug for SlotHeap<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.entries()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::hash_map::DefaultHasher;
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u32, u8),
        Remove(u32),
        Pop,
        Clear,
    }

    fn ops(slots: u32) -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            6 => (0..slots, any::<u8>()).prop_map(|(s, k)| Op::Insert(s, k)),
            3 => (0..slots).prop_map(Op::Remove),
            2 => Just(Op::Pop),
            1 => Just(Op::Clear),
        ];
        proptest::collection::vec(op, 0..200)
    }

    fn hash_of<T: Hash>(t: &T) -> u64 {
        let mut h = DefaultHasher::new();
        t.hash(&mut h);
        h.finish()
    }

    proptest! {
        /// Every operation agrees with an ordered set of (key, slot).
        #[test]
        fn behaves_like_an_ordered_set(ops in ops(24)) {
            let mut heap = SlotHeap::full(24, 0u8);
            heap.clear();
            let mut set: BTreeSet<(u8, u32)> = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Insert(s, k) => {
                        set.retain(|&(_, x)| x != s);
                        set.insert((k, s));
                        heap.insert(s, k);
                    }
                    Op::Remove(s) => {
                        let old = set.iter().find(|&&(_, x)| x == s).copied();
                        if let Some(e) = old {
                            set.remove(&e);
                        }
                        prop_assert_eq!(heap.remove(s), old.map(|(k, _)| k));
                    }
                    Op::Pop => prop_assert_eq!(heap.pop(), set.pop_first()),
                    Op::Clear => {
                        heap.clear();
                        set.clear();
                    }
                }
                prop_assert_eq!(heap.peek(), set.first().copied());
                prop_assert_eq!(heap.len(), set.len());
                let mut by_slot: Vec<(u32, u8)> = set.iter().map(|&(k, s)| (s, k)).collect();
                by_slot.sort_unstable();
                prop_assert_eq!(heap.entries().collect::<Vec<_>>(), by_slot);
            }
        }

        /// The same entries, put in in any order, make equal heaps with equal
        /// hashes: the layout never shows.
        #[test]
        fn equality_ignores_the_layout(keys in proptest::collection::vec(any::<u8>(), 1..40), seed in any::<u64>()) {
            let n = keys.len();
            let mut a = SlotHeap::full(n, 0u8);
            let mut b = SlotHeap::full(n, 0u8);
            a.clear();
            b.clear();
            for (s, &k) in keys.iter().enumerate() {
                a.insert(s as u32, k);
            }
            let mut order: Vec<usize> = (0..n).collect();
            let mut x = seed | 1;
            for i in (1..n).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            for &s in &order {
                b.insert(s as u32, 255);
                b.insert(s as u32, keys[s]);
            }
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(hash_of(&a), hash_of(&b));
            b.remove(0);
            prop_assert_ne!(&a, &b);
        }
    }

    #[test]
    fn a_full_heap_hands_out_the_lowest_slot_first() {
        let mut free = SlotHeap::full(5, ());
        assert_eq!(free.pop(), Some(((), 0)));
        assert_eq!(free.pop(), Some(((), 1)));
        free.insert(0, ());
        assert_eq!(free.peek(), Some(((), 0)));
        assert_eq!(free.remove(3), Some(()));
        assert_eq!(free.remove(3), None);
        assert_eq!(free.remove(99), None, "a slot the heap never had");
        free.add_slot();
        free.insert(5, ());
        let order: Vec<u32> = std::iter::from_fn(|| free.pop().map(|(_, s)| s)).collect();
        assert_eq!(order, vec![0, 2, 4, 5]);
        assert_eq!(free.len(), 0);
    }

    #[test]
    fn equality_hash_and_debug_see_the_entries() {
        // The engines' Eq, Hash and Debug include their heaps: the model
        // checker tells states apart by them.
        let mut a = SlotHeap::full(3, 0u8);
        let mut b = SlotHeap::full(3, 0u8);
        a.clear();
        b.clear();
        a.insert(0, 5);
        b.insert(1, 5);
        assert_eq!(a.len(), b.len());
        assert_ne!(a, b, "same length, different slot");
        assert_ne!(hash_of(&a), hash_of(&b));
        b.remove(1);
        b.insert(0, 6);
        assert_ne!(a, b, "same slot, different key");
        assert_ne!(hash_of(&a), hash_of(&b));
        b.insert(0, 5);
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
        a.insert(2, 1);
        assert_eq!(format!("{a:?}"), "{0: 5, 2: 1}");
    }
}
