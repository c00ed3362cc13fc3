//! A sorted map for keys that mostly arrive in increasing order: the
//! engines' requests, READs, holds and deadlines.

use std::collections::VecDeque;
use std::fmt;
use std::hash::{Hash, Hasher};

/// An ordered map kept as a sorted deque of `(key, value)`, where removed
/// entries leave a tombstone (`None`) until they reach either end or the
/// deque is compacted.
///
/// The engines' keys nearly always arrive in increasing order (message ids
/// and READ tokens are allocated increasing, deadlines grow with the clock)
/// and leave roughly in the same order, which makes a B-tree do a node
/// split or merge every few calls. Here:
///
/// - inserting a key above every other is a `push_back`, O(1) amortized,
///   with no allocation once the deque has grown; a key that arrives late
///   goes into a tombstone next to its place if there is one, else shifts
///   the entries after it (O(entries between));
/// - looking up or removing a key is a binary search, O(log n), or O(1) for
///   the first key (keys mostly leave oldest first); removing leaves a
///   tombstone, and tombstones at either end are dropped at once;
/// - the first entry is always live, so `first` is O(1);
/// - when tombstones outnumber live entries, they are all dropped (O(n),
///   amortized O(1) per removal), so memory stays O(live entries).
///
/// Equality, hashing and iteration see only the live entries, in key order,
/// so two engines in the same state compare equal whatever the tombstones.
#[derive(Clone)]
pub(crate) struct SortedDeque<K, V> {
    entries: VecDeque<(K, Option<V>)>,
    live: usize,
}

/// A key of a [`SortedDeque`]. A counter (message id, READ token) says how
/// far it is from another, which is where it sits in a deque with no key
/// missing between: a lookup tries that index before it searches. The
/// requests in flight mostly have consecutive ids, so the guess mostly
/// hits, where a binary search of a `VecDeque` cost ~60-80 instructions.
pub(crate) trait Key: Ord + Copy {
    /// How many keys `self` is above `front`, if keys are counters.
    fn distance(self, front: Self) -> Option<u64> {
        let _ = front;
        None
    }
}

impl<K, V> Default for SortedDeque<K, V> {
    fn default() -> SortedDeque<K, V> {
        SortedDeque { entries: VecDeque::new(), live: 0 }
    }
}

impl<K: Key, V> SortedDeque<K, V> {
    /// Room for `n` more entries.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.entries.reserve(n);
    }

    pub(crate) fn len(&self) -> usize {
        self.live
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.live == 0
    }

    fn find(&self, key: &K) -> Result<usize, usize> {
        // Keys mostly leave oldest first, and counters sit at their
        // distance from the front: try there before searching.
        let Some(&(front, _)) = self.entries.front() else { return Err(0) };
        let guess = key.distance(front).map_or(0, |d| usize::try_from(d).unwrap_or(usize::MAX));
        if self.entries.get(guess).is_some_and(|(k, _)| k == key) {
            return Ok(guess);
        }
        self.entries.binary_search_by(|(k, _)| k.cmp(key))
    }

    /// Inserts `value` under `key`; the value it replaces, if any.
    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        if self.entries.back().map_or(true, |(last, _)| *last < key) {
            self.entries.push_back((key, Some(value)));
            self.live += 1;
            return None;
        }
        match self.find(&key) {
            Ok(i) => {
                let old = self.entries[i].1.replace(value);
                if old.is_none() {
                    self.live += 1;
                }
                old
            }
            Err(i) => {
                // entries[i - 1] < key < entries[i]: a tombstone just below
                // takes the key without moving anything.
                if i > 0 && self.entries[i - 1].1.is_none() {
                    self.entries[i - 1] = (key, Some(value));
                } else {
                    self.entries.insert(i, (key, Some(value)));
                }
                self.live += 1;
                None
            }
        }
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        let i = self.find(key).ok()?;
        self.entries[i].1.as_ref()
    }

    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let i = self.find(key).ok()?;
        self.entries[i].1.as_mut()
    }

    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.get(key).is_some()
    }

    /// Debug builds' index checks: whether this holds exactly the entries
    /// `want` lists (keys unique, any order). Compared without collecting
    /// or sorting, so a debug build allocates no more than a release one
    /// (`tests/alloc_free.rs`): each listed entry found with its value, and
    /// no other.
    pub(crate) fn holds_exactly(&self, want: impl Iterator<Item = (K, V)>) -> bool
    where
        V: PartialEq,
    {
        let mut n = 0;
        for (k, v) in want {
            if self.get(&k) != Some(&v) {
                return false;
            }
            n += 1;
        }
        n == self.len()
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        // The usual case, the oldest key leaving, needs no search and
        // leaves no tombstone (the front is always live).
        let i = self.find(key).ok()?;
        if i == 0 {
            let (_, old) = self.entries.pop_front()?;
            self.live -= 1;
            self.tidy();
            return old;
        }
        let old = self.entries[i].1.take()?;
        self.live -= 1;
        self.tidy();
        Some(old)
    }

    /// The entry with the smallest key.
    pub(crate) fn first(&self) -> Option<(&K, &V)> {
        let (k, v) = self.entries.front()?;
        Some((k, v.as_ref()?))
    }

    /// The smallest live key in `lo..=hi`. Visits only the entries (live or
    /// not) between `lo` and that key.
    pub(crate) fn first_in(&self, lo: &K, hi: &K) -> Option<K> {
        let start = self.find(lo).unwrap_or_else(|i| i);
        self.entries.range(start..).take_while(|(k, _)| k <= hi).find(|(_, v)| v.is_some()).map(|&(k, _)| k)
    }

    /// The live entries, in key order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        self.entries.iter().filter_map(|(k, v)| Some((k, v.as_ref()?)))
    }

    /// The live entries, in key order, taking them.
    pub(crate) fn into_entries(self) -> impl Iterator<Item = (K, V)> {
        self.entries.into_iter().filter_map(|(k, v)| Some((k, v?)))
    }

    /// Drops tombstones at the ends, and all of them once they outnumber
    /// the live entries.
    fn tidy(&mut self) {
        if self.live == 0 {
            // Only tombstones left.
            self.entries.clear();
            return;
        }
        while self.entries.front().is_some_and(|(_, v)| v.is_none()) {
            self.entries.pop_front();
        }
        while self.entries.back().is_some_and(|(_, v)| v.is_none()) {
            self.entries.pop_back();
        }
        if self.entries.len() > 2 * self.live + 16 {
            self.entries.retain(|(_, v)| v.is_some());
        }
    }
}

impl<K: Key, V: PartialEq> PartialEq for SortedDeque<K, V> {
    fn eq(&self, other: &SortedDeque<K, V>) -> bool {
        self.live == other.live && self.iter().eq(other.iter())
    }
}

impl<K: Key, V: Eq> Eq for SortedDeque<K, V> {}

impl<K: Key + Hash, V: Hash> Hash for SortedDeque<K, V> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.live.hash(state);
        for entry in self.iter() {
            entry.hash(state);
        }
    }
}

impl<T: Ord + Copy> Key for (std::time::Duration, T) {}

impl<T: Ord + Copy> SortedDeque<(std::time::Duration, T), ()> {
    /// The ids whose deadline is at or before `now`, in id order.
    pub(crate) fn due(&self, now: std::time::Duration) -> Vec<T> {
        let mut due: Vec<T> = self
            .iter()
            .take_while(|&(&(deadline, _), ())| deadline <= now)
            .map(|(&(_, id), ())| id)
            .collect();
        due.sort_unstable();
        due
    }
}

impl<K: Key + fmt::Debug, V: fmt::Debug> fmt::Debug for SortedDeque<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::hash_map::DefaultHasher;
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    // u16 searches; u32 is a counter, so its lookups guess first.
    impl Key for u16 {}
    impl Key for u32 {
        fn distance(self, front: u32) -> Option<u64> {
            self.checked_sub(front).map(u64::from)
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16, u8),
        Remove(u16),
        First,
        Range(u16, u16),
    }

    /// Keys mostly increasing (as the engines make them), with some late ones.
    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            4 => (0u16..8, any::<u8>()).prop_map(|(d, v)| Op::Insert(d, v)),
            2 => (0u16..300).prop_map(|k| Op::Insert(k, 0)),
            5 => (0u16..300).prop_map(Op::Remove),
            1 => Just(Op::First),
            1 => (0u16..300, 0u16..40).prop_map(|(lo, w)| Op::Range(lo, lo.saturating_add(w))),
        ];
        proptest::collection::vec(op, 0..400)
    }

    fn hash_of<T: Hash>(t: &T) -> u64 {
        let mut h = DefaultHasher::new();
        t.hash(&mut h);
        h.finish()
    }

    proptest! {
        /// Every operation agrees with a BTreeMap, and the deque never holds
        /// more than about twice its live entries.
        #[test]
        fn behaves_like_a_btree_map(ops in ops()) {
            let mut d: SortedDeque<u16, u8> = SortedDeque::default();
            let mut m: BTreeMap<u16, u8> = BTreeMap::new();
            let mut next = 0u16;
            for op in ops {
                match op {
                    // Small steps up from the last key: the common case.
                    Op::Insert(step, v) if step > 0 => {
                        next = next.saturating_add(step);
                        prop_assert_eq!(d.insert(next, v), m.insert(next, v));
                    }
                    Op::Insert(k, v) => prop_assert_eq!(d.insert(k, v), m.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(d.remove(&k), m.remove(&k)),
                    Op::First => prop_assert_eq!(d.first(), m.first_key_value()),
                    Op::Range(lo, hi) => {
                        prop_assert_eq!(d.first_in(&lo, &hi), m.range(lo..=hi).next().map(|(&k, _)| k));
                    }
                }
                prop_assert_eq!(d.len(), m.len());
                prop_assert_eq!(d.first(), m.first_key_value());
                prop_assert!(d.iter().eq(m.iter()));
                prop_assert!(d.entries.len() <= 2 * d.len() + 17, "{} entries for {} live", d.entries.len(), d.len());
                for k in [0u16, next, next / 2] {
                    prop_assert_eq!(d.get(&k), m.get(&k));
                }
            }
        }

        /// The same live entries compare and hash equal whatever tombstones
        /// each deque carries.
        #[test]
        fn equality_sees_only_live_entries(keys in proptest::collection::btree_set(0u16..1000, 0..60), extra in proptest::collection::vec(0u16..1000, 0..30)) {
            let mut a: SortedDeque<u16, u16> = SortedDeque::default();
            let mut b: SortedDeque<u16, u16> = SortedDeque::default();
            for &k in &keys {
                a.insert(k, k);
            }
            for &k in keys.iter().rev() {
                b.insert(k, k);
            }
            for &k in &extra {
                if !keys.contains(&k) {
                    b.insert(k, 0);
                    b.remove(&k);
                }
            }
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(hash_of(&a), hash_of(&b));
        }
    }

    #[test]
    fn tombstones_are_dropped_once_they_pass_twice_the_live_entries_plus_16() {
        let mut d: SortedDeque<u32, ()> = SortedDeque::default();
        for k in 0..40 {
            d.insert(k, ());
        }
        // Remove from the middle, so no tombstone reaches an end.
        for k in 1..=28 {
            d.remove(&k);
            assert_eq!(d.entries.len(), 40, "{} live: 40 <= 2 * live + 16 keeps the tombstones", d.len());
        }
        assert_eq!(d.len(), 12);
        d.remove(&29);
        assert_eq!(d.len(), 11);
        assert_eq!(d.entries.len(), 11, "40 > 2 * 11 + 16: every tombstone dropped");
        assert_eq!(
            d.iter().map(|(&k, ())| k).collect::<Vec<_>>(),
            [0, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
        );
    }

    #[test]
    fn equality_hash_and_debug_see_the_live_entries() {
        // The engines' Eq, Hash and Debug include their deques: the model
        // checker tells states apart by them.
        let mut a: SortedDeque<u32, u8> = SortedDeque::default();
        let mut b: SortedDeque<u32, u8> = SortedDeque::default();
        a.insert(1, 5);
        b.insert(2, 5);
        assert_eq!(a.len(), b.len());
        assert_ne!(a, b, "same length, different key");
        assert_ne!(hash_of(&a), hash_of(&b));
        b.remove(&2);
        b.insert(1, 6);
        assert_ne!(a, b, "same key, different value");
        assert_ne!(hash_of(&a), hash_of(&b));
        b.insert(1, 5);
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
        a.insert(3, 7);
        assert_ne!(a, b, "one more entry");
        a.insert(2, 0);
        a.remove(&2);
        assert_eq!(format!("{a:?}"), "{1: 5, 3: 7}", "no tombstone shows");
    }

    #[test]
    fn late_keys_reuse_a_tombstone_next_to_their_place() {
        let mut d: SortedDeque<u32, ()> = SortedDeque::default();
        for k in [10, 20, 30, 40] {
            d.insert(k, ());
        }
        d.remove(&20);
        let before = d.entries.len();
        d.insert(25, ());
        assert_eq!(d.entries.len(), before, "took 20's tombstone");
        assert_eq!(d.iter().map(|(&k, _)| k).collect::<Vec<_>>(), vec![10, 25, 30, 40]);
        d.remove(&10);
        assert_eq!(d.first(), Some((&25, &())), "the front is live");
        assert_eq!(d.first_in(&26, &35), Some(30));
        assert_eq!(d.first_in(&31, &39), None);
        assert_eq!(d.into_entries().map(|(k, ())| k).collect::<Vec<_>>(), vec![25, 30, 40]);
    }
}
