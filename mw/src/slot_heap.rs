//! An indexed min-heap of deadlines over slot numbers: the engines' timers.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::time::Duration;

const ABSENT: u32 = u32::MAX;

/// A min-heap of slots ordered by `(deadline, slot)` that knows where each
/// slot sits in it, so the earliest deadline is read in O(1) and any slot's
/// entry is inserted or removed in O(log n), without a search and without
/// allocating once the slots exist. At most one entry per slot.
///
/// An entry is one `u128`, the deadline's seconds, its nanoseconds and the
/// slot from the top bits down, so the heap's order is the order of
/// `(Duration, slot)` and a comparison is one integer compare: comparing
/// `(Duration, u32)` tuples cost about three times as much, and the heap
/// was a third of an engine call.
///
/// Entries are removed eagerly when their slot changes state, so the heap
/// never holds a stale deadline.
///
/// Equality and hashing go over the entries in slot order, not over the
/// heap's layout (which depends on the order things happened in): two
/// engines in the same state compare equal, as the model checker needs.
#[derive(Clone, Default)]
pub(crate) struct SlotHeap {
    heap: Vec<u128>,
    /// Per slot: its index in `heap`, or `ABSENT`.
    at: Vec<u32>,
}

fn pack(deadline: Duration, slot: u32) -> u128 {
    (u128::from(deadline.as_secs()) << 64) | (u128::from(deadline.subsec_nanos()) << 32) | u128::from(slot)
}

fn deadline(entry: u128) -> Duration {
    Duration::new((entry >> 64) as u64, (entry >> 32) as u32)
}

fn slot(entry: u128) -> u32 {
    entry as u32
}

impl SlotHeap {
    /// An empty heap for slots `0..slots`.
    pub(crate) fn with_slots(slots: usize) -> SlotHeap {
        SlotHeap { heap: Vec::with_capacity(slots), at: vec![ABSENT; slots] }
    }

    /// Makes room for one more slot (numbered `slots()`), not in the heap.
    pub(crate) fn add_slot(&mut self) {
        self.at.push(ABSENT);
    }

    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    /// The earliest entry.
    pub(crate) fn peek(&self) -> Option<(Duration, u32)> {
        self.heap.first().map(|&e| (deadline(e), slot(e)))
    }

    /// Removes and returns the earliest entry.
    pub(crate) fn pop(&mut self) -> Option<(Duration, u32)> {
        let (d, slot) = self.peek()?;
        self.remove(slot);
        Some((d, slot))
    }

    /// Puts `slot` in with `deadline`, replacing its entry if it has one.
    pub(crate) fn insert(&mut self, slot: u32, deadline: Duration) {
        let entry = pack(deadline, slot);
        let i = self.at[slot as usize];
        if i != ABSENT {
            let i = i as usize;
            self.heap[i] = entry;
            self.up(i);
            self.down(i);
            return;
        }
        self.heap.push(entry);
        let i = self.heap.len() - 1;
        self.at[slot as usize] = i as u32;
        self.up(i);
    }

    /// Takes `slot` out; its deadline, if it was in.
    pub(crate) fn remove(&mut self, slot: u32) -> Option<Duration> {
        let i = *self.at.get(slot as usize)?;
        if i == ABSENT {
            return None;
        }
        let i = i as usize;
        let entry = self.heap[i];
        self.at[slot as usize] = ABSENT;
        let last = self.heap.pop()?;
        if i < self.heap.len() {
            // The last entry is usually one of the latest deadlines, so
            // rather than sift it down comparing it at every level, the
            // hole goes down to a leaf along the smaller children and the
            // entry climbs from there (Floyd): half the comparisons.
            let hole = self.sink_hole(i);
            self.heap[hole] = last;
            self.up(hole);
        }
        Some(deadline(entry))
    }

    /// Moves the hole at `i` to a leaf, pulling the smaller child up into
    /// it at each level; the leaf's index.
    fn sink_hole(&mut self, mut i: usize) -> usize {
        let len = self.heap.len();
        loop {
            let left = 2 * i + 1;
            if left >= len {
                return i;
            }
            let right = left + 1;
            let child = if right < len && self.heap[right] < self.heap[left] { right } else { left };
            self.put(i, self.heap[child]);
            i = child;
        }
    }

    /// Empties the heap (O(len)).
    pub(crate) fn clear(&mut self) {
        for &e in &self.heap {
            self.at[slot(e) as usize] = ABSENT;
        }
        self.heap.clear();
    }

    /// The entries as `(slot, deadline)`, in slot order (O(slots)).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u32, Duration)> + '_ {
        self.at
            .iter()
            .enumerate()
            .filter(|&(_, &i)| i != ABSENT)
            .map(|(s, &i)| (s as u32, deadline(self.heap[i as usize])))
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

    fn put(&mut self, i: usize, entry: u128) {
        self.heap[i] = entry;
        self.at[slot(entry) as usize] = i as u32;
    }
}

impl PartialEq for SlotHeap {
    fn eq(&self, other: &SlotHeap) -> bool {
        self.len() == other.len() && self.entries().eq(other.entries())
    }
}

impl Eq for SlotHeap {}

impl Hash for SlotHeap {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.len().hash(state);
        for entry in self.entries() {
            entry.hash(state);
        }
    }
}

impl fmt::Debug for SlotHeap {
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

    /// Keys in order for u8s in order, with both seconds and nanoseconds.
    fn d(k: u8) -> Duration {
        Duration::new(u64::from(k / 16), u32::from(k % 16) * 60_000_000)
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
            let mut heap = SlotHeap::with_slots(24);
            let mut set: BTreeSet<(u8, u32)> = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Insert(s, k) => {
                        set.retain(|&(_, x)| x != s);
                        set.insert((k, s));
                        heap.insert(s, d(k));
                    }
                    Op::Remove(s) => {
                        let old = set.iter().find(|&&(_, x)| x == s).copied();
                        if let Some(e) = old {
                            set.remove(&e);
                        }
                        prop_assert_eq!(heap.remove(s), old.map(|(k, _)| d(k)));
                    }
                    Op::Pop => prop_assert_eq!(heap.pop(), set.pop_first().map(|(k, s)| (d(k), s))),
                    Op::Clear => {
                        heap.clear();
                        set.clear();
                    }
                }
                prop_assert_eq!(heap.peek(), set.first().map(|&(k, s)| (d(k), s)));
                prop_assert_eq!(heap.len(), set.len());
                let mut by_slot: Vec<(u32, Duration)> = set.iter().map(|&(k, s)| (s, d(k))).collect();
                by_slot.sort_unstable();
                prop_assert_eq!(heap.entries().collect::<Vec<_>>(), by_slot);
            }
        }

        /// The same entries, put in in any order, make equal heaps with equal
        /// hashes: the layout never shows.
        #[test]
        fn equality_ignores_the_layout(keys in proptest::collection::vec(any::<u8>(), 1..40), seed in any::<u64>()) {
            let n = keys.len();
            let mut a = SlotHeap::with_slots(n);
            let mut b = SlotHeap::with_slots(n);
            for (s, &k) in keys.iter().enumerate() {
                a.insert(s as u32, d(k));
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
                b.insert(s as u32, d(255));
                b.insert(s as u32, d(keys[s]));
            }
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(hash_of(&a), hash_of(&b));
            b.remove(0);
            prop_assert_ne!(&a, &b);
        }
    }

    #[test]
    fn equality_hash_and_debug_see_the_entries() {
        // The engines' Eq, Hash and Debug include their heaps: the model
        // checker tells states apart by them.
        let mut a = SlotHeap::with_slots(3);
        let mut b = SlotHeap::with_slots(3);
        a.insert(0, d(5));
        b.insert(1, d(5));
        assert_eq!(a.len(), b.len());
        assert_ne!(a, b, "same length, different slot");
        assert_ne!(hash_of(&a), hash_of(&b));
        b.remove(1);
        b.insert(0, d(6));
        assert_ne!(a, b, "same slot, different key");
        assert_ne!(hash_of(&a), hash_of(&b));
        b.insert(0, d(5));
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
        a.insert(2, d(17));
        assert_eq!(format!("{a:?}"), "{0: 300ms, 2: 1.06s}");
        assert_eq!(a.remove(2), Some(d(17)));
        assert_eq!(a.remove(2), None);
        assert_eq!(a.remove(99), None, "a slot the heap never had");
        a.add_slot();
        a.insert(3, Duration::new(u64::MAX, 999_999_999));
        assert_eq!(a.pop(), Some((d(5), 0)));
        assert_eq!(
            a.pop(),
            Some((Duration::new(u64::MAX, 999_999_999), 3)),
            "the largest deadline survives packing"
        );
    }
}
