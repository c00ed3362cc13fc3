//! An ordered set that knows ranks: insert, remove, the k-th key and how
//! many keys lie below a key, each O(log n) expected.
//!
//! The scheduler needs the k-th of the events due at one instant, and how
//! many there are, in the same order whatever their number; a `BTreeSet`
//! can only walk to them. This is a treap (a binary search tree by key and a
//! heap by a random priority) whose nodes count their subtrees. The nodes
//! live in one vector, and freed ones are reused, so a set that has grown
//! allocates nothing more. The priorities come from a generator of its own
//! with a fixed seed: the tree's shape never shows in what the set answers,
//! and the fabric's seeded generator is not drawn from.

use std::cmp::Ordering;

/// No node.
const NIL: u32 = u32::MAX;

struct Node<K> {
    key: K,
    prio: u64,
    /// Nodes in this subtree, this one included.
    size: u32,
    left: u32,
    right: u32,
}

/// Where a subtree hangs: at the root, or left or right of a node.
#[derive(Clone, Copy)]
enum Hook {
    Root,
    Left(u32),
    Right(u32),
}

pub(crate) struct RankedSet<K> {
    nodes: Vec<Node<K>>,
    /// Indexes of unused nodes.
    spare: Vec<u32>,
    root: u32,
    /// State of the priorities' generator (SplitMix64).
    prio_state: u64,
    /// Scratch for `insert`: the nodes a split passed.
    path: Vec<u32>,
}

impl<K> Default for RankedSet<K> {
    fn default() -> Self {
        // Room for a busy fabric's runnable lanes from the start: a steady
        // run reaches new highs of them now and then, long after warming up.
        RankedSet {
            nodes: Vec::with_capacity(256),
            spare: Vec::with_capacity(256),
            root: NIL,
            prio_state: 0x5eed,
            path: Vec::with_capacity(64),
        }
    }
}

impl<K: Ord + Copy> RankedSet<K> {
    pub(crate) fn len(&self) -> usize {
        self.size(self.root) as usize
    }

    /// Add `key`. Panics if it is there already.
    pub(crate) fn insert(&mut self, key: K) {
        let prio = self.next_prio();
        let n = self.new_node(Node { key, prio, size: 1, left: NIL, right: NIL });
        // Down the key's path to where the new priority belongs, counting
        // the new node in every subtree passed.
        let (mut hook, mut t) = (Hook::Root, self.root);
        while t != NIL && self.nodes[t as usize].prio > prio {
            let node = &mut self.nodes[t as usize];
            node.size += 1;
            (hook, t) = match key.cmp(&node.key) {
                Ordering::Less => (Hook::Left(t), node.left),
                Ordering::Greater => (Hook::Right(t), node.right),
                Ordering::Equal => panic!("a key inserted twice"),
            };
        }
        // Split what hangs there into the keys below and above, left and
        // right of the new node, then size the nodes split, lowest first.
        let (mut below, mut above) = (Hook::Left(n), Hook::Right(n));
        self.path.clear();
        while t != NIL {
            self.path.push(t);
            let node = &self.nodes[t as usize];
            match node.key.cmp(&key) {
                Ordering::Less => {
                    // It and its left subtree are below; its right is split further.
                    let next = node.right;
                    self.hang(below, t);
                    (below, t) = (Hook::Right(t), next);
                }
                Ordering::Greater => {
                    let next = node.left;
                    self.hang(above, t);
                    (above, t) = (Hook::Left(t), next);
                }
                Ordering::Equal => panic!("a key inserted twice"),
            }
        }
        self.hang(below, NIL);
        self.hang(above, NIL);
        for i in (0..self.path.len()).rev() {
            self.resize(self.path[i]);
        }
        self.resize(n);
        self.hang(hook, n);
    }

    /// Take `key` out. Panics if it is not there.
    pub(crate) fn remove(&mut self, key: &K) {
        // Down to it, uncounting it from every subtree passed.
        let (mut hook, mut t) = (Hook::Root, self.root);
        loop {
            assert!(t != NIL, "a key removed that is not there");
            let node = &mut self.nodes[t as usize];
            (hook, t) = match key.cmp(&node.key) {
                Ordering::Less => (Hook::Left(t), node.left),
                Ordering::Greater => (Hook::Right(t), node.right),
                Ordering::Equal => break,
            };
            node.size -= 1;
        }
        // Merge its two subtrees where it hung, the higher priority on top.
        let (mut a, mut b) = (self.nodes[t as usize].left, self.nodes[t as usize].right);
        self.spare.push(t);
        loop {
            if a == NIL || b == NIL {
                self.hang(hook, if a == NIL { b } else { a });
                return;
            }
            let size = self.nodes[a as usize].size + self.nodes[b as usize].size;
            if self.nodes[a as usize].prio > self.nodes[b as usize].prio {
                self.nodes[a as usize].size = size;
                self.hang(hook, a);
                (hook, a) = (Hook::Right(a), self.nodes[a as usize].right);
            } else {
                self.nodes[b as usize].size = size;
                self.hang(hook, b);
                (hook, b) = (Hook::Left(b), self.nodes[b as usize].left);
            }
        }
    }

    pub(crate) fn first(&self) -> Option<K> {
        self.nth(0)
    }

    /// The key with `k` keys below it.
    pub(crate) fn nth(&self, mut k: usize) -> Option<K> {
        let mut t = self.root;
        while t != NIL {
            let n = &self.nodes[t as usize];
            let left = self.size(n.left) as usize;
            match k.cmp(&left) {
                Ordering::Less => t = n.left,
                Ordering::Equal => return Some(n.key),
                Ordering::Greater => {
                    k -= left + 1;
                    t = n.right;
                }
            }
        }
        None
    }

    /// How many keys are below `key`.
    pub(crate) fn rank(&self, key: &K) -> usize {
        let (mut t, mut below) = (self.root, 0);
        while t != NIL {
            let n = &self.nodes[t as usize];
            if n.key < *key {
                below += self.size(n.left) as usize + 1;
                t = n.right;
            } else {
                t = n.left;
            }
        }
        below
    }

    fn new_node(&mut self, node: Node<K>) -> u32 {
        match self.spare.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 keys")
            }
        }
    }

    fn hang(&mut self, hook: Hook, t: u32) {
        match hook {
            Hook::Root => self.root = t,
            Hook::Left(p) => self.nodes[p as usize].left = t,
            Hook::Right(p) => self.nodes[p as usize].right = t,
        }
    }

    fn size(&self, t: u32) -> u32 {
        if t == NIL {
            0
        } else {
            self.nodes[t as usize].size
        }
    }

    fn resize(&mut self, t: u32) {
        let n = &self.nodes[t as usize];
        let size = 1 + self.size(n.left) + self.size(n.right);
        self.nodes[t as usize].size = size;
    }

    fn next_prio(&mut self) -> u64 {
        self.prio_state = self.prio_state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.prio_state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u8),
        Remove(u8),
    }

    /// Inserts and removes over few keys, so that both often find the key
    /// (a key already there is not inserted, one not there not removed).
    fn set_ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![(0..64u8).prop_map(Op::Insert), (0..64u8).prop_map(Op::Remove)];
        proptest::collection::vec(op, 0..400)
    }

    /// The size of the subtree `t`, checking its sizes, key order and
    /// priorities on the way.
    fn checked_size(set: &RankedSet<u8>, t: u32, above: Option<u8>, below: Option<u8>, prio: u64) -> u32 {
        if t == NIL {
            return 0;
        }
        let n = &set.nodes[t as usize];
        assert!(above.map_or(true, |a| n.key > a) && below.map_or(true, |b| n.key < b), "keys out of order");
        assert!(n.prio <= prio, "a node above one of a higher priority");
        let size = 1
            + checked_size(set, n.left, above, Some(n.key), n.prio)
            + checked_size(set, n.right, Some(n.key), below, n.prio);
        assert_eq!(n.size, size, "a subtree miscounted");
        size
    }

    proptest! {
        #[test]
        fn answers_as_a_sorted_set(ops in set_ops()) {
            let (mut set, mut model) = (RankedSet::default(), BTreeSet::new());
            for op in ops {
                match op {
                    Op::Insert(k) => {
                        if model.insert(k) {
                            set.insert(k);
                        }
                    }
                    Op::Remove(k) => {
                        if model.remove(&k) {
                            set.remove(&k);
                        }
                    }
                }
                prop_assert_eq!(checked_size(&set, set.root, None, None, u64::MAX) as usize, model.len());
                prop_assert_eq!(set.len(), model.len());
                prop_assert_eq!(set.first(), model.first().copied());
                let sorted: Vec<u8> = model.iter().copied().collect();
                for (k, &key) in sorted.iter().enumerate() {
                    prop_assert_eq!(set.nth(k), Some(key));
                }
                prop_assert_eq!(set.nth(sorted.len()), None);
                for key in [0, 1, 17, 32, 63, 64, 255] {
                    prop_assert_eq!(set.rank(&key), model.range(..key).count());
                }
            }
            // Freed nodes are used again.
            prop_assert!(set.nodes.len() <= 64);
        }
    }

    #[test]
    #[should_panic(expected = "a key inserted twice")]
    fn refuses_a_key_twice() {
        let mut set = RankedSet::default();
        for k in [3, 1, 4, 5, 9, 2, 6, 4] {
            set.insert(k);
        }
    }

    #[test]
    #[should_panic(expected = "a key removed that is not there")]
    fn refuses_to_remove_a_missing_key() {
        let mut set = RankedSet::default();
        set.insert(1);
        set.remove(&2);
    }
}
