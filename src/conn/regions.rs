//! An endpoint's regions ([`Endpoint::register_region`](super::Endpoint::register_region)).
//!
//! Every range a connection exposes is in its region's [`Book`] from
//! before the exposure is posted until its evidence (the connection's
//! [`Event::RangeReturned`](super::Event::RangeReturned), or its QP
//! destroyed). A write takes the book's lock, is refused if it overlaps a
//! range in it, and copies under that lock, so no exposure can begin in the
//! middle of it. How a region is registered (once in a shared PD, or by
//! each connection in its own), the book's rules and what they cost:
//! `docs/serving.md`, "Serving your own memory".

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Waker};

use parking_lot::Mutex;

use super::delegate::Delegations;
use super::{RegionId, RegionRange, UseError};
use crate::backend::{Access, MrInfo, Nic, NicError, OsError};
use crate::mem::Memory;

/// The first region id: ids are never reused, so a connection never
/// mistakes a new region for a deregistered one it knew.
const FIRST_ID: u32 = 1;

/// The access of a region registered once in a hub's PD: window binding
/// (a confirm connection, served only to trusted peers there, registers
/// the region again with its own access).
const SHARED_ACCESS: Access = Access::from_bits_truncate(Access::LOCAL_WRITE.bits() | Access::MW_BIND.bits());

/// An endpoint's regions (see the module docs).
pub(crate) struct Regions<N: Nic> {
    /// A handle on the PD the endpoint's connections share, if they do.
    shared_pd: Option<N>,
    table: Mutex<Table>,
    /// The ranges the application delegated (`delegate.rs`).
    delegations: Delegations,
}

struct Table {
    next: u32,
    regions: HashMap<RegionId, Arc<Region>>,
}

/// One region: its memory, its registration in a shared PD, and its book.
pub(crate) struct Region {
    mem: Arc<Memory>,
    /// Its registration in the PD the connections share, if they do
    /// ([`SHARED_ACCESS`]).
    shared: Option<MrInfo>,
    book: Mutex<Book>,
}

/// The ranges of a region that some connection exposes, and the writers
/// waiting for them. Hash tables, which allocate only to grow: once a
/// connection has exposed a range of the region, its exposures come and
/// go without allocating.
#[derive(Default)]
struct Book {
    /// Each connection's exposed ranges ([`super::proto::Connection::id`]:
    /// (offset, length) each, at most `Config::region_exposures`). Kept,
    /// empty, while the connection lives.
    by_conn: HashMap<u64, Vec<(usize, usize)>>,
    /// Every distinct range exposed, and by how many exposures.
    exposed: Exposed,
    /// Lists of `by_conn` whose owner went (a delegation tree's pin
    /// lives as long as its tree), kept for the next: a delegation then
    /// allocates none.
    spare: Vec<Vec<(usize, usize)>>,
    /// Deregistered: nothing may be exposed or written any more.
    retired: bool,
    waiters: Vec<Waker>,
}

impl Book {
    fn add(&mut self, conn: u64, range: (usize, usize)) {
        let (by_conn, spare) = (&mut self.by_conn, &mut self.spare);
        let in_use = by_conn.len();
        by_conn.entry(conn).or_insert_with(|| take_list(spare, in_use)).push(range);
        self.exposed.add(range);
    }

    /// One exposure of `range` by `conn` is over; whether it was in the book.
    fn remove(&mut self, conn: u64, range: (usize, usize)) -> bool {
        let Some(mine) = self.by_conn.get_mut(&conn) else { return false };
        let Some(i) = mine.iter().position(|&r| r == range) else { return false };
        mine.swap_remove(i);
        self.exposed.remove(range);
        true
    }

    /// Every exposure of `conn` is over; whether it had any.
    fn forget(&mut self, conn: u64) -> bool {
        let Some(mine) = self.by_conn.remove(&conn) else { return false };
        for &r in &mine {
            self.exposed.remove(r);
        }
        !mine.is_empty()
    }

    /// Whether any exposed range overlaps `offset..offset + len`.
    fn overlapping(&self, offset: usize, len: usize) -> bool {
        self.exposed.overlapping(offset, len)
    }

    fn wake(&mut self) {
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }
}

impl Region {
    /// The region's memory.
    pub(crate) fn memory(&self) -> &Arc<Memory> {
        &self.mem
    }

    /// Its registration in the shared PD, if that serves `access`.
    pub(crate) fn shared_for(&self, access: Access) -> Option<MrInfo> {
        self.shared.filter(|_| SHARED_ACCESS.contains(access))
    }
}

impl<N: Nic> Regions<N> {
    /// No regions yet; `shared_pd`: a handle on the PD every connection
    /// of the endpoint is in, if they share one; `epoch`: the start of
    /// the clock its connections are driven on.
    pub(crate) fn new(shared_pd: Option<N>, epoch: super::clock::Epoch) -> Self {
        Regions {
            shared_pd,
            table: Mutex::new(Table { next: FIRST_ID, regions: HashMap::new() }),
            delegations: Delegations::new(epoch),
        }
    }

    /// The endpoint's delegations.
    pub(crate) fn delegations(&self) -> &Delegations {
        &self.delegations
    }

    /// A new region of `len` zeroed bytes.
    pub(crate) fn register(&self, len: usize) -> Result<RegionId, NicError> {
        if len == 0 {
            return Err(NicError::InvalidWr("a region needs at least one byte".into()));
        }
        let mem = Memory::zeroed(len, 4096)
            .ok_or(NicError::Os { op: "alloc", source: OsError::from_errno(12 /* ENOMEM */) })?;
        let shared = match &self.shared_pd {
            Some(nic) => Some(nic.reg_memory(&mem, SHARED_ACCESS)?),
            None => None,
        };
        let mut t = self.table.lock();
        let Some(next) = t.next.checked_add(1) else {
            drop(t);
            if let (Some(nic), Some(info)) = (&self.shared_pd, shared) {
                let _ = nic.dereg_mr(info.id);
            }
            return Err(NicError::InvalidWr(
                "this endpoint has registered 2^32 - 1 regions: make a new endpoint".into(),
            ));
        };
        let id = RegionId(t.next);
        t.next = next;
        t.regions.insert(id, Arc::new(Region { mem, shared, book: Mutex::new(Book::default()) }));
        Ok(id)
    }

    fn lookup(&self, id: RegionId) -> Result<Arc<Region>, UseError> {
        self.table.lock().regions.get(&id).cloned().ok_or(UseError::NoSuchRegion(id))
    }

    /// Put `range` in its region's book as exposed by connection `conn`,
    /// before the exposure is posted ([`Regions::unexpose`] if it is not).
    pub(crate) fn expose(&self, conn: u64, range: RegionRange) -> Result<Arc<Region>, UseError> {
        let r = self.lookup(range.region)?;
        if range.len == 0 {
            let len = r.mem.len();
            return Err(UseError::OutOfRegion {
                region: range.region,
                offset: range.offset,
                range_len: 0,
                len,
            });
        }
        Self::inside(range.region, &r, range.offset, range.len as usize)?;
        let mut book = r.book.lock();
        if book.retired {
            return Err(UseError::NoSuchRegion(range.region));
        }
        book.add(conn, (range.offset, range.len as usize));
        drop(book);
        Ok(r)
    }

    /// Connection `conn`'s exposure of `range` is over (or never began):
    /// its bytes may be written again unless another exposure covers them.
    pub(crate) fn unexpose(&self, conn: u64, range: RegionRange) {
        let Ok(r) = self.lookup(range.region) else { return };
        let mut book = r.book.lock();
        if book.remove(conn, (range.offset, range.len as usize)) {
            book.wake();
        }
    }

    /// A delegation tree is done (`delegate.rs`): its pin of `range`
    /// goes, with its entry.
    pub(crate) fn unpin(&self, pin: u64, range: RegionRange) {
        let Ok(r) = self.lookup(range.region) else { return };
        let mut book = r.book.lock();
        if book.remove(pin, (range.offset, range.len as usize)) {
            if let Some(mut list) = book.by_conn.remove(&pin) {
                list.clear();
                book.spare.push(list);
            }
            book.wake();
        }
    }

    /// Connection `conn`'s QP is destroyed: none of its exposures can be
    /// read any more.
    pub(crate) fn forget(&self, conn: u64) {
        let regions: Vec<Arc<Region>> = self.table.lock().regions.values().cloned().collect();
        for r in regions {
            let mut book = r.book.lock();
            if book.forget(conn) {
                book.wake();
            }
        }
    }

    /// Check `offset..offset + len` is inside region `r` (named `id`).
    fn inside(id: RegionId, r: &Region, offset: usize, len: usize) -> Result<(), UseError> {
        if offset.checked_add(len).map_or(true, |end| end > r.mem.len()) {
            let range_len = u32::try_from(len).unwrap_or(u32::MAX);
            return Err(UseError::OutOfRegion { region: id, offset, range_len, len: r.mem.len() });
        }
        Ok(())
    }

    /// Copy `bytes` into region `id` at `offset`, unless any of them is
    /// exposed ([`UseError::RangeExposed`]; with `cx`, its waker is kept
    /// and woken when an exposure of the region ends).
    pub(crate) fn write(
        &self,
        id: RegionId,
        offset: usize,
        bytes: &[u8],
        cx: Option<&mut Context<'_>>,
    ) -> Result<(), UseError> {
        let r = self.lookup(id)?;
        Self::inside(id, &r, offset, bytes.len())?;
        // Delegations whose tokens expired unredeemed unpin their ranges.
        self.expire_delegations();
        let mut book = r.book.lock();
        if book.retired {
            return Err(UseError::NoSuchRegion(id));
        }
        if book.overlapping(offset, bytes.len()) {
            if let Some(cx) = cx {
                if !book.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                    book.waiters.push(cx.waker().clone());
                }
            }
            return Err(UseError::RangeExposed { region: id, offset, len: bytes.len() });
        }
        // Under the book's lock: no exposure can begin during the copy.
        r.mem.with_mut_as(0, offset, bytes.len(), |b| b.copy_from_slice(bytes)).map_err(UseError::Nic)
    }

    /// Lend `len` bytes of region `id` at `offset` to `f`, without a copy.
    pub(crate) fn bytes<R>(
        &self,
        id: RegionId,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, UseError> {
        let r = self.lookup(id)?;
        Self::inside(id, &r, offset, len)?;
        r.mem.with_as(0, offset, len, f).map_err(UseError::Nic)
    }

    /// Deregister region `id` once no connection exposes any of it
    /// ([`UseError::RegionBusy`] until then). Each connection that
    /// registered it in its own PD must then release that registration
    /// (`Link::forget_region`).
    pub(crate) fn deregister(&self, id: RegionId) -> Result<(), UseError> {
        let r = self.lookup(id)?;
        // Delegations whose tokens expired unredeemed unpin their ranges
        // (nothing else may have looked at the clock since).
        self.expire_delegations();
        let mut book = r.book.lock();
        if book.retired {
            return Err(UseError::NoSuchRegion(id));
        }
        if !book.exposed.is_empty() {
            return Err(UseError::RegionBusy(id));
        }
        if let (Some(nic), Some(info)) = (&self.shared_pd, r.shared) {
            // Under the book's lock: no exposure can begin meanwhile.
            nic.dereg_mr(info.id)?;
        }
        book.retired = true;
        book.wake();
        drop(book);
        self.table.lock().regions.remove(&id);
        Ok(())
    }
}

/// An endpoint's regions at a glance (telemetry).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RegionFigures {
    /// Regions registered.
    pub(crate) regions: usize,
    /// Their bytes.
    pub(crate) bytes: u64,
    /// Exposures of their ranges not yet ended on evidence.
    pub(crate) exposed: u64,
}

impl<N: Nic> Regions<N> {
    /// How many regions, their bytes and their live exposures (each
    /// region's book locked in turn, off the data path).
    pub(crate) fn figures(&self) -> RegionFigures {
        let regions: Vec<Arc<Region>> = self.table.lock().regions.values().cloned().collect();
        let mut f = RegionFigures { regions: regions.len(), ..RegionFigures::default() };
        for r in regions {
            f.bytes += r.mem.len() as u64;
            f.exposed += r.book.lock().exposed.count;
        }
        f
    }
}

impl<N: Nic> Drop for Regions<N> {
    fn drop(&mut self) {
        // The last connection is gone (each holds this): no window is bound
        // over a region any more.
        if let Some(nic) = &self.shared_pd {
            for r in self.table.get_mut().regions.values() {
                if let Some(info) = r.shared {
                    if let Err(e) = nic.dereg_mr(info.id) {
                        tracing::warn!(%e, "deregistering an endpoint's region (its memory is kept)");
                    }
                }
            }
        }
    }
}

/// Lists a book makes as it first needs one, each with room for as many
/// entries.
const FIRST_LISTS: usize = 4;

/// A list from `spare`, where lists emptied are kept for the next. The
/// first time one is needed, [`FIRST_LISTS`] are made at once, with room
/// for as many entries; after that one at a time, as lists in use reach a
/// new high. `spare` keeps room for every list made, so that a list given
/// back never grows it. With calls and delegations one at a time, the
/// number alive at once varies with the threads' timing: a third
/// delegation alive, reached for the first time while a benchmark counted
/// allocations at one call in flight, allocated there (two lists, and the
/// spares' growth when they emptied).
fn take_list<T>(spare: &mut Vec<Vec<T>>, in_use: usize) -> Vec<T> {
    if let Some(list) = spare.pop() {
        return list;
    }
    if in_use == 0 {
        spare.reserve(FIRST_LISTS);
        spare.extend((1..FIRST_LISTS).map(|_| Vec::with_capacity(FIRST_LISTS)));
        return Vec::with_capacity(FIRST_LISTS);
    }
    spare.reserve(in_use + 1);
    Vec::new()
}

/// A range exposed: (offset, length, exposures of it).
type Entry = (usize, usize, u32);

/// The distinct ranges exposed in a region, each with its number of
/// exposures, listed by where they start so that a write finds those it
/// overlaps without a pass over all of them. A range of length in
/// `2^k..2^(k+1)` is listed under `(k, offset >> max(k, 12))`: its length
/// class and its granule (4 KiB, or 2^k for longer ranges). A range of
/// class `k` that overlaps a write starts less than `2^(k+1)` bytes before
/// it, so for each class present a write of `len` bytes looks up at most
/// `len / 2^max(k, 12) + 4` granules, whatever the number of ranges (or,
/// when those lookups would outnumber the ranges, it checks each range;
/// figures: `docs/serving.md`, "Serving your own memory"). Lists of
/// granules emptied are kept for the next, so exposures come and go
/// without allocating once the tables have grown.
#[derive(Default)]
struct Exposed {
    lists: HashMap<(u32, usize), Vec<Entry>>,
    spare: Vec<Vec<Entry>>,
    /// Distinct ranges of each length class (lengths are `u32`s).
    classes: [u32; 32],
    /// Distinct ranges.
    distinct: usize,
    /// Exposures, in all (telemetry).
    count: u64,
}

impl Exposed {
    /// A range's length class and the log2 of its granule's size.
    fn class(len: usize) -> (u32, u32) {
        debug_assert!(u32::try_from(len).is_ok(), "a range's length is a u32");
        let k = (usize::BITS - 1 - len.max(1).leading_zeros()).min(31);
        (k, k.max(12))
    }

    fn add(&mut self, (offset, len): (usize, usize)) {
        let (k, g) = Exposed::class(len);
        let (lists, spare) = (&mut self.lists, &mut self.spare);
        let in_use = lists.len();
        let list = lists.entry((k, offset >> g)).or_insert_with(|| take_list(spare, in_use));
        match list.iter_mut().find(|e| (e.0, e.1) == (offset, len)) {
            Some(e) => e.2 += 1,
            None => {
                list.push((offset, len, 1));
                self.classes[k as usize] += 1;
                self.distinct += 1;
            }
        }
        self.count += 1;
    }

    /// One exposure of the range fewer (nothing if none is listed).
    fn remove(&mut self, (offset, len): (usize, usize)) {
        let (k, g) = Exposed::class(len);
        let key = (k, offset >> g);
        let Some(list) = self.lists.get_mut(&key) else { return };
        let Some(i) = list.iter().position(|e| (e.0, e.1) == (offset, len)) else { return };
        self.count -= 1;
        list[i].2 -= 1;
        if list[i].2 > 0 {
            return;
        }
        list.swap_remove(i);
        self.classes[k as usize] -= 1;
        self.distinct -= 1;
        if list.is_empty() {
            if let Some(list) = self.lists.remove(&key) {
                self.spare.push(list);
            }
        }
    }

    /// Whether any range overlaps `offset..offset + len`: the granules
    /// where one could start, or every list when those are more than the
    /// ranges (a long write with few ranges exposed), whichever is fewer.
    fn overlapping(&self, offset: usize, len: usize) -> bool {
        match self.granules(offset, len) {
            Some(spans)
                if spans.clone().fold(0usize, |n, (_, a, b)| n.saturating_add(b - a + 1))
                    <= self.distinct =>
            {
                self.in_granules(spans, offset, len)
            }
            Some(_) => self.lists.values().any(|list| Exposed::overlaps(list, offset, len)),
            None => false,
        }
    }

    /// For each class present, the granules a range of it that overlaps
    /// `offset..offset + len` can start in: (class, first, last). `None`
    /// for a write that ends at 0 (nothing overlaps it).
    fn granules(
        &self,
        offset: usize,
        len: usize,
    ) -> Option<impl Iterator<Item = (u32, usize, usize)> + Clone + '_> {
        let last = (offset + len).checked_sub(1)?;
        Some(self.classes.iter().enumerate().filter(|(_, &n)| n > 0).map(move |(k, _)| {
            let k = k as u32;
            let g = k.max(12);
            // Ranges of this class are shorter than 2^(k+1) bytes: one that
            // overlaps starts after `offset - 2^(k+1)`, and before the end.
            let longest = 1usize.checked_shl(k + 1).map_or(usize::MAX, |n| n - 1);
            let first = (offset + 1).saturating_sub(longest);
            (k, first >> g, last >> g)
        }))
    }

    fn in_granules(
        &self,
        mut spans: impl Iterator<Item = (u32, usize, usize)>,
        offset: usize,
        len: usize,
    ) -> bool {
        spans.any(|(k, a, b)| {
            (a..=b).any(|granule| {
                self.lists.get(&(k, granule)).is_some_and(|l| Exposed::overlaps(l, offset, len))
            })
        })
    }

    fn overlaps(list: &[Entry], offset: usize, len: usize) -> bool {
        list.iter().any(|&(o, l, _)| o < offset + len && offset < o + l)
    }

    fn is_empty(&self) -> bool {
        self.distinct == 0
    }
}

#[cfg(test)]
mod tests {
    use super::{Book, Exposed};
    use proptest::prelude::*;

    proptest! {
        /// The index answers as a pass over every range exposed would,
        /// whatever the ranges' lengths (from 1 byte to 1 MiB, so in many
        /// classes at once), their overlaps and repeats, and the writes'.
        #[test]
        fn the_index_finds_exactly_the_overlaps_a_scan_finds(
            ops in proptest::collection::vec(
                (any::<bool>(), 0usize..(4 << 20), prop_oneof![1usize..64, 1usize..8192, 1usize..(1 << 20)]),
                1..100,
            ),
            writes in proptest::collection::vec(
                (0usize..(5 << 20), prop_oneof![0usize..64, 0usize..(1 << 18)]),
                1..20,
            ),
        ) {
            let mut x = Exposed::default();
            let mut all: Vec<(usize, usize)> = Vec::new();
            for (add, offset, len) in ops {
                // A removal takes away an exposure made before (or nothing).
                let r = if add || all.is_empty() { (offset, len) } else { all[offset % all.len()] };
                if add || all.is_empty() {
                    x.add(r);
                    all.push(r);
                } else {
                    x.remove(r);
                    let i = all.iter().position(|&a| a == r).unwrap();
                    all.swap_remove(i);
                }
                let mut distinct = all.clone();
                distinct.sort();
                distinct.dedup();
                prop_assert_eq!((x.count, x.distinct), (all.len() as u64, distinct.len()));
                for &(o, l) in &writes {
                    let scan = all.iter().any(|&(ro, rl)| ro < o + l && o < ro + rl);
                    prop_assert_eq!(x.overlapping(o, l), scan, "a write of {} at {} with {:?}", l, o, all);
                    // The granules alone, whichever way `overlapping` went.
                    let by_granules = x.granules(o, l).is_some_and(|s| x.in_granules(s, o, l));
                    prop_assert_eq!(by_granules, scan, "granules: a write of {} at {} with {:?}", l, o, all);
                }
            }
            for r in all.clone() {
                x.remove(r);
            }
            prop_assert!(x.is_empty() && x.lists.is_empty() && x.classes.iter().all(|&n| n == 0));
        }
    }

    /// Lists emptied go back to the spares without growing them, whatever
    /// the number alive at once (each range here is in a granule of its
    /// own): the spares' room is made with the lists. The first lists
    /// come with room for their first entries.
    #[test]
    fn lists_emptied_never_grow_the_spares() {
        let mut x = Exposed::default();
        for high in [1, 3, 4, 5, 9, 2, 17, 17] {
            for i in 0..high {
                x.add((i << 12, 64));
            }
            assert_eq!(x.lists.len(), high);
            let room = x.spare.capacity();
            for i in 0..high {
                x.remove((i << 12, 64));
            }
            assert_eq!(x.spare.capacity(), room, "{high} lists emptied at once grew the spares");
            assert!(x.spare.len() >= high && x.lists.is_empty());
        }
        assert!(x.spare.iter().filter(|l| l.capacity() >= super::FIRST_LISTS).count() >= super::FIRST_LISTS);
    }

    #[test]
    fn a_book_counts_each_connections_exposures_of_shared_ranges() {
        let mut b = Book::default();
        for conn in 0..1000 {
            b.add(conn, (4096, 3000));
        }
        b.add(7, (0, 100));
        assert_eq!(
            (b.exposed.distinct, b.exposed.count),
            (2, 1001),
            "1,000 exposures of one value are one range"
        );
        assert!(b.overlapping(4096 + 2999, 1) && b.overlapping(50, 1000));
        assert!(!b.overlapping(100, 3996) && !b.overlapping(7096, 10));
        assert!(!b.remove(1000, (4096, 3000)), "a connection that exposed nothing");
        assert!(!b.remove(3, (0, 100)), "another connection's range");
        for conn in 0..999 {
            assert!(b.remove(conn, (4096, 3000)));
        }
        assert!(b.overlapping(5000, 1), "one exposure of the range is left");
        assert!(b.forget(999));
        assert!(!b.overlapping(5000, 1));
        assert!(b.forget(7), "connection 7 still had (0, 100)");
        assert!(b.exposed.is_empty() && !b.forget(7));
    }
}
