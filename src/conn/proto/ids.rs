//! Maps keyed by the connection's own ids (message ids, lease ids, tokens):
//! sequential numbers, so a multiplicative hash spreads them well and costs
//! a few instructions instead of SipHash's hundred. Nothing here reads keys
//! chosen by the peer unchecked: a peer's message id is looked up, never
//! used to grow a map beyond the calls and requests in progress.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::time::Duration;

/// Fibonacci hashing of an id (`mwcap-delegation`'s, whose book keys its
/// capabilities by sequential ids too).
pub(crate) use mwcap_delegation::IdHasher;

/// A hash map keyed by one of the connection's ids.
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// An empty [`IdMap`] for at most `n` entries at once, that never allocates
/// again however many come and go. Removals leave tombstones; once they use
/// up the free room, the next insert rehashes the table, in place if it is
/// at most half full and into a new, larger allocation otherwise. So the
/// table gets room for `2 * n`: with `n` live entries it is at most half
/// full, and a rehash never needs a new allocation.
pub(crate) fn id_map<K, V>(n: usize) -> IdMap<K, V> {
    HashMap::with_capacity_and_hasher(2 * n, BuildHasherDefault::default())
}

/// Entries keyed by increasing message ids, each with a deadline that grows
/// with its id (every entry gets the same timeout when it is made): the
/// earliest deadline is the oldest live entry's. Allocates nothing in
/// steady state (a `BTreeMap` allocates a node whenever it goes from empty
/// to one entry, and splits nodes past eleven).
pub(crate) struct Timed<V> {
    map: IdMap<u64, V>,
    /// (deadline, id) in id order; entries of removed ids are dropped
    /// lazily (from the front, and by a compaction when more than half are
    /// stale).
    order: VecDeque<(Duration, u64)>,
}

impl<V> Timed<V> {
    pub(crate) fn with_capacity(n: usize) -> Timed<V> {
        Timed { map: id_map(n), order: VecDeque::with_capacity(2 * n + 16) }
    }

    /// Add `id` (above every id added before) with its deadline.
    pub(crate) fn insert(&mut self, id: u64, deadline: Duration, v: V) {
        debug_assert!(self.order.back().map_or(true, |&(_, last)| last < id), "ids increase");
        self.map.insert(id, v);
        self.order.push_back((deadline, id));
    }

    pub(crate) fn get(&self, id: &u64) -> Option<&V> {
        self.map.get(id)
    }

    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut V> {
        self.map.get_mut(id)
    }

    pub(crate) fn contains_key(&self, id: &u64) -> bool {
        self.map.contains_key(id)
    }

    /// Every live entry, in no order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&u64, &V)> {
        self.map.iter()
    }

    /// Live entries.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn remove(&mut self, id: &u64) -> Option<V> {
        let v = self.map.remove(id)?;
        self.prune();
        Some(v)
    }

    /// Drop stale entries from the front; compact when most are stale.
    fn prune(&mut self) {
        if self.map.is_empty() {
            // All stale (one call in flight, the usual case: no lookup).
            self.order.clear();
            return;
        }
        while let Some(&(_, id)) = self.order.front() {
            if self.map.contains_key(&id) {
                break;
            }
            self.order.pop_front();
        }
        if self.order.len() > 2 * self.map.len() + 16 {
            let map = &self.map;
            self.order.retain(|(_, id)| map.contains_key(id));
        }
    }

    /// The earliest deadline of a live entry.
    pub(crate) fn first_deadline(&self) -> Option<Duration> {
        self.order.front().map(|&(d, _)| d)
    }

    /// The oldest live entry whose deadline is at or before `now`.
    pub(crate) fn first_expired(&self, now: Duration) -> Option<u64> {
        self.order.front().filter(|&&(d, _)| d <= now).map(|&(_, id)| id)
    }

    /// The live entries whose deadlines are at or before `now`, oldest first.
    pub(crate) fn expired(&self, now: Duration) -> impl Iterator<Item = u64> + '_ {
        self.order
            .iter()
            .take_while(move |&&(d, _)| d <= now)
            .map(|&(_, id)| id)
            .filter(|id| self.map.contains_key(id))
    }

    /// Remove every entry, oldest first.
    pub(crate) fn drain(&mut self) -> Vec<(u64, V)> {
        let mut out = Vec::with_capacity(self.map.len());
        for (_, id) in self.order.drain(..) {
            if let Some(v) = self.map.remove(&id) {
                out.push((id, v));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_deadline_is_the_oldest_live_entry() {
        let mut t = Timed::with_capacity(4);
        for id in 1..=5u64 {
            t.insert(id, Duration::from_secs(id), id * 10);
        }
        assert_eq!(t.first_deadline(), Some(Duration::from_secs(1)));
        assert_eq!(t.remove(&1), Some(10));
        assert_eq!(t.remove(&3), Some(30));
        assert_eq!(t.first_deadline(), Some(Duration::from_secs(2)));
        assert_eq!(t.remove(&2), Some(20));
        // 3 was removed already: the front skips to 4.
        assert_eq!(t.first_deadline(), Some(Duration::from_secs(4)));
        assert_eq!(t.first_expired(Duration::from_secs(3)), None);
        assert_eq!(t.first_expired(Duration::from_secs(4)), Some(4));
        assert_eq!(t.expired(Duration::from_secs(5)).collect::<Vec<_>>(), vec![4, 5]);
        assert_eq!(t.drain(), vec![(4, 40), (5, 50)]);
        assert_eq!(t.len(), 0);
        assert_eq!(t.first_deadline(), None);
    }

    #[test]
    fn stale_entries_do_not_pile_up_behind_a_stuck_one() {
        let mut t = Timed::with_capacity(4);
        t.insert(1, Duration::from_secs(1), ());
        for id in 2..10_000u64 {
            t.insert(id, Duration::from_secs(id), ());
            t.remove(&id);
        }
        assert_eq!(t.len(), 1);
        assert!(t.order.len() <= 2 * t.len() + 17, "{} entries kept for 1 live", t.order.len());
        assert_eq!(t.first_deadline(), Some(Duration::from_secs(1)));
    }

    #[test]
    fn an_id_map_at_its_bound_never_grows_however_many_come_and_go() {
        // As the lease map of a connection with 40 exposures, every one
        // live, each released in some order and replaced by a new lease.
        let n = 40;
        let mut m: IdMap<u64, u32> = id_map(n);
        let room = m.capacity();
        let mut live: Vec<u64> = (0..n as u64).collect();
        for &id in &live {
            m.insert(id, 0);
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for id in n as u64..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % n as u64) as usize;
            m.remove(&live[i]);
            live[i] = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 3;
            m.insert(live[i], 0);
            assert_eq!(m.capacity(), room, "grew after {id} leases");
        }
    }
}
