//! Object tables that the hot path reads without taking a lock.
//!
//! [`VerbsNic`](super::VerbsNic) names its regions, windows, completion
//! queues and queue pairs by small ids. A post or a poll resolves those ids
//! here with one compare-and-swap per object ("pinning" it) and no lock;
//! only creating and destroying objects serialise, on the table's own admin
//! mutex.
//!
//! # Ids
//! An id is `index << GEN_BITS | generation`. A slot is reused after its
//! object is destroyed, with the next generation, so a stale id never names
//! a newer object. A slot whose generations are used up is retired for good
//! rather than wrapped: ids are never reused, and the table refuses new
//! objects only after about 2^32 creations. No id is 0 or `u32::MAX`
//! (callers use both as placeholders).
//!
//! # Pins
//! Each slot has one atomic state word: generation, `LIVE`, `CLOSING` and a
//! pin count. [`Slots::pin`] increments the count if the slot is live with
//! the id's generation; the returned [`Pinned`] derefs to the object and
//! decrements on drop. [`Slots::remove`] succeeds only when it can swap
//! "live, no pins" for "closing" in one step, so no pin exists or can be
//! taken while the object is moved out and closed: a destroy racing a post
//! gets `Busy`, as `Arc::try_unwrap` gave before. While a destroy is in
//! progress (`CLOSING`), `pin` waits on the admin mutex and retries, so it
//! sees the outcome (the object back, or gone) instead of a transient miss.
//!
//! # Memory
//! Slots live in chunks of 8, 16, 32, ... (doubling) that are allocated
//! under the admin mutex, published with a release store and freed only
//! when the table drops, so a `&Slot` never dangles. Lookup is an index
//! computation and one acquire load.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

/// Generation bits of an id (low bits).
const GEN_BITS: u32 = 12;
/// The last generation a slot gets; one more would let an id be `u32::MAX`.
const GEN_MAX: u32 = (1 << GEN_BITS) - 2;
/// How many slots a table can have.
const CAPACITY: u32 = 1 << (32 - GEN_BITS);

/// State word: pins in the low 32 bits, then flags, then the generation.
const PINS: u64 = 0xffff_ffff;
const LIVE: u64 = 1 << 32;
const CLOSING: u64 = 1 << 33;
const GEN_SHIFT: u32 = 40;
/// A retired slot: generation 0 matches no id.
const RETIRED: u64 = 0;

/// Chunk `k` holds `FIRST_CHUNK << k` slots.
const FIRST_CHUNK_LOG: u32 = 3;
const FIRST_CHUNK: usize = 1 << FIRST_CHUNK_LOG;
/// Enough chunks for `CAPACITY` slots: 8 * (2^18 - 1) >= 2^20.
const CHUNKS: usize = 18;

fn gen_of(state: u64) -> u32 {
    (state >> GEN_SHIFT) as u32
}

fn state(gen: u32, flags: u64) -> u64 {
    u64::from(gen) << GEN_SHIFT | flags
}

fn split(id: u32) -> (u32, u32) {
    (id >> GEN_BITS, id & ((1 << GEN_BITS) - 1))
}

/// Chunk number and offset of slot `index`.
fn locate(index: u32) -> (usize, usize) {
    let v = index as usize + FIRST_CHUNK;
    let k = (usize::BITS - 1 - v.leading_zeros() - FIRST_CHUNK_LOG) as usize;
    (k, v - (FIRST_CHUNK << k))
}

struct Slot<T> {
    state: AtomicU64,
    /// A lookup key for [`Slots::find`] (a QP's number), set before the
    /// object is published. A hint: the caller checks the object itself.
    key: AtomicU32,
    /// Initialised exactly when `state` has `LIVE` or `CLOSING`.
    val: UnsafeCell<MaybeUninit<T>>,
}

impl<T> Slot<T> {
    fn free() -> Slot<T> {
        Slot {
            state: AtomicU64::new(state(1, 0)),
            key: AtomicU32::new(0),
            val: UnsafeCell::new(MaybeUninit::uninit()),
        }
    }
}

struct Admin {
    /// Freed slots, oldest first (so a slot's generations last long).
    free: VecDeque<u32>,
    /// Slots handed out so far.
    used: u32,
}

/// Why [`Slots::remove`] did not remove.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Removal<E> {
    /// No live object has that id.
    Missing,
    /// The object is pinned (a post, poll or CPU access is using it).
    Busy,
    /// The close function failed; the object is back in its slot.
    Failed(E),
}

/// A table of `T`s addressed by never-reused `u32` ids, read without locks.
pub(super) struct Slots<T> {
    chunks: [AtomicPtr<Slot<T>>; CHUNKS],
    /// Slots ever handed out (for scans); published after their chunk.
    used: AtomicU32,
    admin: Mutex<Admin>,
    _owns: PhantomData<T>,
}

// SAFETY: a `&Slots<T>` hands out `&T` to any thread (so `T: Sync`) and lets
// any thread move a `T` out in `remove` or drop it (so `T: Send`); every
// other field is an atomic or a mutex.
unsafe impl<T: Send + Sync> Sync for Slots<T> {}
// SAFETY: sending the table sends its `T`s.
unsafe impl<T: Send> Send for Slots<T> {}

/// A pinned object: it cannot be removed while this lives.
pub(super) struct Pinned<'a, T> {
    slot: &'a Slot<T>,
    id: u32,
}

// SAFETY: a `Pinned` is a shared reference to `T` plus an atomic decrement
// on drop, so it may move to or be shared with another thread when `&T` may.
unsafe impl<T: Sync> Send for Pinned<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for Pinned<'_, T> {}

impl<T> Pinned<'_, T> {
    /// The object's id.
    pub(super) fn id(&self) -> u32 {
        self.id
    }
}

impl<T> std::ops::Deref for Pinned<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this pin keeps the slot's pin count above zero, and the
        // count only rose from a LIVE state, so the value is initialised and
        // `remove` (which needs a zero count) cannot move it out while we
        // exist; nothing writes a live value except `remove`'s put-back,
        // which happens before the release store that makes it LIVE again.
        unsafe { (*self.slot.val.get()).assume_init_ref() }
    }
}

impl<T> Drop for Pinned<'_, T> {
    fn drop(&mut self) {
        // Release: our reads of the value happen before a remover's acquire
        // of a zero count.
        self.slot.state.fetch_sub(1, Ordering::Release);
    }
}

/// At most `N` objects of one table pinned for one operation, each once
/// (a chain naming one region in eight work requests pins it once).
pub(super) struct PinSet<'a, T, const N: usize> {
    pins: [Option<Pinned<'a, T>>; N],
    len: usize,
}

impl<'a, T, const N: usize> PinSet<'a, T, N> {
    pub(super) fn new() -> PinSet<'a, T, N> {
        PinSet { pins: std::array::from_fn(|_| None), len: 0 }
    }

    /// Pin `id` in `table` unless it is pinned here already; `None` if
    /// there is no such object.
    ///
    /// # Panics
    /// When asked for more than `N` distinct objects (callers size `N` for
    /// the most an operation can name).
    pub(super) fn pin(&mut self, table: &'a Slots<T>, id: u32) -> Option<()> {
        if self.get(id).is_none() {
            self.pins[self.len] = Some(table.pin(id)?);
            self.len += 1;
        }
        Some(())
    }

    /// The object `id`, if pinned here.
    pub(super) fn get(&self, id: u32) -> Option<&T> {
        self.pins[..self.len].iter().flatten().find(|p| p.id() == id).map(|p| &**p)
    }
}

/// Puts a slot in a safe final state if a close function panics.
struct Closing<'a, T> {
    slot: &'a Slot<T>,
    armed: bool,
}

impl<T> Drop for Closing<'_, T> {
    fn drop(&mut self) {
        if self.armed {
            // The value was moved into the close function and is gone; the
            // slot must not stay CLOSING (pins would wait forever) nor be
            // reused with this generation.
            self.slot.state.store(RETIRED, Ordering::Release);
        }
    }
}

impl<T> Slots<T> {
    pub(super) fn new() -> Slots<T> {
        Slots {
            chunks: std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            used: AtomicU32::new(0),
            admin: Mutex::new(Admin { free: VecDeque::new(), used: 0 }),
            _owns: PhantomData,
        }
    }

    fn slot(&self, index: u32) -> Option<&Slot<T>> {
        if index >= CAPACITY {
            return None;
        }
        let (k, off) = locate(index);
        let chunk = self.chunks[k].load(Ordering::Acquire);
        if chunk.is_null() {
            return None;
        }
        // SAFETY: a non-null chunk pointer was published (release, after its
        // slots were initialised) from a boxed slice of `FIRST_CHUNK << k`
        // slots that is freed only in `drop`, which takes `&mut self`; `off`
        // is below that length by construction of `locate`.
        Some(unsafe { &*chunk.add(off) })
    }

    /// Store `val` under a fresh id; gives it back when the table is full.
    /// `key` is what [`Slots::find`] looks for (0 if unused).
    pub(super) fn insert(&self, val: T, key: u32) -> Result<u32, T> {
        let mut admin = self.admin.lock();
        let index = match admin.free.pop_front() {
            Some(i) => i,
            None if admin.used == CAPACITY => return Err(val),
            None => {
                let i = admin.used;
                let (k, _) = locate(i);
                if self.chunks[k].load(Ordering::Relaxed).is_null() {
                    let chunk: Box<[Slot<T>]> = (0..FIRST_CHUNK << k).map(|_| Slot::free()).collect();
                    self.chunks[k].store(Box::into_raw(chunk).cast::<Slot<T>>(), Ordering::Release);
                }
                admin.used += 1;
                self.used.store(admin.used, Ordering::Release);
                i
            }
        };
        let slot = self.slot(index).expect("a handed-out slot's chunk exists");
        let s = slot.state.load(Ordering::Relaxed);
        debug_assert_eq!(s & (LIVE | CLOSING | PINS), 0, "a free slot has no value and no pins");
        slot.key.store(key, Ordering::Relaxed);
        // SAFETY: the slot is free: not LIVE, so nobody can pin it and no
        // reference to its value exists; we hold the admin mutex, so no other
        // insert or remove touches it.
        unsafe { (*slot.val.get()).write(val) };
        // Release: the value and key are visible to whoever pins this state.
        slot.state.store(s | LIVE, Ordering::Release);
        Ok(index << GEN_BITS | gen_of(s))
    }

    /// Pin the live object `id`, or `None` if there is none.
    ///
    /// Inlined into every post and poll: one load and one compare-and-swap
    /// when the slot is live and uncontended; only the wait for a destroy
    /// in progress ([`Slots::await_destroy`]) is out of line.
    #[inline]
    pub(super) fn pin(&self, id: u32) -> Option<Pinned<'_, T>> {
        let (index, gen) = split(id);
        if gen == 0 || gen > GEN_MAX {
            return None;
        }
        let slot = self.slot(index)?;
        let mut s = slot.state.load(Ordering::Relaxed);
        loop {
            if gen_of(s) != gen {
                return None;
            }
            if s & LIVE == 0 {
                if s & CLOSING == 0 {
                    return None;
                }
                self.await_destroy();
                s = slot.state.load(Ordering::Relaxed);
                continue;
            }
            assert!(s & PINS != PINS, "pin count overflow");
            // Acquire: pairs with the release store that made the value LIVE.
            match slot.state.compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Some(Pinned { slot, id }),
                Err(now) => s = now,
            }
        }
    }

    /// A slot is being destroyed: the destroyer holds the admin mutex
    /// until the slot is LIVE again or freed. Wait for that (the caller
    /// then looks again).
    #[cold]
    #[inline(never)]
    fn await_destroy(&self) {
        drop(self.admin.lock());
    }

    /// Pin the first live object whose key is `key` and that `pred` accepts.
    /// A linear scan over every slot ever used: for rare lookups only.
    pub(super) fn find(&self, key: u32, mut pred: impl FnMut(&T) -> bool) -> Option<Pinned<'_, T>> {
        let used = self.used.load(Ordering::Acquire);
        for index in 0..used {
            let Some(slot) = self.slot(index) else { continue };
            if slot.key.load(Ordering::Relaxed) != key {
                continue;
            }
            let s = slot.state.load(Ordering::Relaxed);
            if s & LIVE == 0 {
                continue;
            }
            if let Some(p) = self.pin(index << GEN_BITS | gen_of(s)) {
                if pred(&p) {
                    return Some(p);
                }
            }
        }
        None
    }

    /// Remove the object `id` and hand it to `close`. If `close` fails it
    /// returns the object, which goes back in place under the same id.
    pub(super) fn remove<E>(
        &self,
        id: u32,
        close: impl FnOnce(T) -> Result<(), (T, E)>,
    ) -> Result<(), Removal<E>> {
        let (index, gen) = split(id);
        if gen == 0 || gen > GEN_MAX {
            return Err(Removal::Missing);
        }
        let slot = self.slot(index).ok_or(Removal::Missing)?;
        let mut admin = self.admin.lock();
        let live = state(gen, LIVE);
        // Acquire: every pin's release decrement happened before; no
        // reference to the value is left.
        if let Err(s) =
            slot.state.compare_exchange(live, state(gen, CLOSING), Ordering::Acquire, Ordering::Relaxed)
        {
            let pinned = gen_of(s) == gen && s & LIVE != 0;
            return Err(if pinned { Removal::Busy } else { Removal::Missing });
        }
        let mut guard = Closing { slot, armed: true };
        // SAFETY: the slot was LIVE (so initialised) and is now CLOSING with
        // no pins: no reference to the value exists and none can be made;
        // we hold the admin mutex, so no other insert or remove touches it.
        // The value is read out once and the slot treated as uninitialised
        // until it is written back below.
        let val = unsafe { (*slot.val.get()).assume_init_read() };
        let result = close(val);
        guard.armed = false;
        match result {
            Ok(()) => {
                if gen < GEN_MAX {
                    slot.state.store(state(gen + 1, 0), Ordering::Release);
                    admin.free.push_back(index);
                } else {
                    slot.state.store(RETIRED, Ordering::Release);
                }
                Ok(())
            }
            Err((val, e)) => {
                // SAFETY: as above, the slot is CLOSING, unpinnable and ours;
                // its value was moved out, so this write overwrites nothing.
                unsafe { (*slot.val.get()).write(val) };
                slot.state.store(live, Ordering::Release);
                Err(Removal::Failed(e))
            }
        }
    }
}

impl<T> Drop for Slots<T> {
    fn drop(&mut self) {
        for (k, chunk) in self.chunks.iter_mut().enumerate() {
            let p = *chunk.get_mut();
            if p.is_null() {
                continue;
            }
            // SAFETY: `p` came from `Box::into_raw` of a boxed slice of exactly
            // this length in `insert`, and is freed only here, once.
            let mut slots = unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(p, FIRST_CHUNK << k)) };
            for slot in slots.iter_mut() {
                if *slot.state.get_mut() & (LIVE | CLOSING) != 0 {
                    // SAFETY: LIVE means initialised (CLOSING cannot be seen
                    // here: `remove` ends before `&mut self` can exist); with
                    // `&mut self` no pin is left. Dropped once, then the
                    // chunk is freed.
                    unsafe { slot.val.get_mut().assume_init_drop() };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use super::*;

    #[test]
    fn locate_covers_every_index_once() {
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(7), (0, 7));
        assert_eq!(locate(8), (1, 0));
        assert_eq!(locate(23), (1, 15));
        assert_eq!(locate(24), (2, 0));
        let (k, off) = locate(CAPACITY - 1);
        assert!(k < CHUNKS && off < FIRST_CHUNK << k);
        let mut next = (0, 0);
        for i in 0..5000 {
            let at = locate(i);
            assert_eq!(at, next, "index {i}");
            next = if at.1 + 1 == FIRST_CHUNK << at.0 { (at.0 + 1, 0) } else { (at.0, at.1 + 1) };
        }
    }

    #[test]
    fn insert_pin_remove() {
        let t: Slots<String> = Slots::new();
        let a = t.insert("a".into(), 0).unwrap();
        let b = t.insert("b".into(), 0).unwrap();
        assert_ne!(a, b);
        assert_eq!(&*t.pin(a).unwrap(), "a");
        assert_eq!(t.pin(b).unwrap().id(), b);
        {
            let _p = t.pin(a).unwrap();
            assert_eq!(t.remove(a, |_| Ok::<(), (String, ())>(())), Err(Removal::Busy));
        }
        assert_eq!(t.remove(a, |_| Err(("again".to_string(), 7))), Err(Removal::Failed(7)));
        assert_eq!(&*t.pin(a).unwrap(), "again", "a failed close puts the object back");
        assert_eq!(t.remove(a, |_| Ok::<(), (String, ())>(())), Ok(()));
        assert!(t.pin(a).is_none());
        assert_eq!(t.remove(a, |_| Ok::<(), (String, ())>(())), Err(Removal::Missing));
        let c = t.insert("c".into(), 0).unwrap();
        assert_ne!(c, a, "the slot is reused under a new id");
        assert_eq!(split(c).0, split(a).0);
        assert!(t.pin(a).is_none(), "the stale id does not name the new object");
        for bad in [0, u32::MAX, u32::MAX - 1, 1 << 31] {
            assert!(t.pin(bad).is_none());
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "8000 rounds: minutes under Miri; nothing concurrent")]
    fn ids_are_never_reused_and_exhausted_slots_retire() {
        let t: Slots<u32> = Slots::new();
        let mut seen = std::collections::HashSet::new();
        for i in 0..2 * GEN_MAX + 10 {
            let id = t.insert(i, 0).unwrap();
            assert!(id != 0 && id != u32::MAX);
            assert!(seen.insert(id), "id {id:#x} repeated at round {i}");
            assert_eq!(*t.pin(id).unwrap(), i);
            t.remove(id, |_| Ok::<(), (u32, ())>(())).unwrap();
        }
        // One slot at a time: each slot lasts GEN_MAX generations.
        assert_eq!(t.admin.lock().used, 3);
    }

    #[test]
    fn find_uses_keys_and_skips_dead_slots() {
        let t: Slots<u32> = Slots::new();
        let ids: Vec<u32> = (0..40).map(|i| t.insert(i, 1000 + i).unwrap()).collect();
        t.remove(ids[17], |_| Ok::<(), (u32, ())>(())).unwrap();
        assert!(t.find(1017, |_| true).is_none());
        let p = t.find(1030, |v| *v == 30).unwrap();
        assert_eq!(p.id(), ids[30]);
        assert!(t.find(1030, |v| *v == 31).is_none());
    }

    #[test]
    fn drop_drops_live_values_once() {
        #[derive(Debug)]
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let t: Slots<Counted> = Slots::new();
        let ids: Vec<u32> = (0..20).map(|_| t.insert(Counted(drops.clone()), 0).unwrap()).collect();
        t.remove(ids[3], |v| {
            drop(v);
            Ok::<(), (Counted, ())>(())
        })
        .unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 1);
        drop(t);
        assert_eq!(drops.load(Ordering::Relaxed), 20);
    }

    #[test]
    fn a_panicking_close_retires_the_slot() {
        let t: Slots<u32> = Slots::new();
        let id = t.insert(5, 0).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = t.remove(id, |_| -> Result<(), (u32, ())> { panic!("close failed hard") });
        }));
        assert!(r.is_err());
        assert!(t.pin(id).is_none(), "no pin waits forever on a slot left CLOSING");
        let next = t.insert(6, 0).unwrap();
        assert_ne!(split(next).0, split(id).0, "the slot is not reused");
    }

    #[test]
    fn pin_during_a_destroy_waits_for_its_outcome() {
        let t: Slots<u32> = Slots::new();
        let id = t.insert(9, 0).unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let closer = s.spawn(|| {
                t.remove(id, |v| {
                    entered_tx.send(()).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    Err((v, "refused"))
                })
            });
            entered_rx.recv().unwrap();
            // The close is in progress: the pin waits, then sees the object back.
            assert_eq!(t.pin(id).map(|p| *p), Some(9));
            assert_eq!(closer.join().unwrap(), Err(Removal::Failed("refused")));
        });
    }

    /// Pinners on several threads while another thread creates and destroys:
    /// a pinned value is always intact, and a destroy never sees a pin.
    #[test]
    fn concurrent_pins_inserts_and_removes() {
        const ROUNDS: usize = if cfg!(miri) { 30 } else { 3000 };
        let t: Slots<(u32, Box<u64>)> = Slots::new();
        let stable: Vec<u32> =
            (0..4).map(|i| t.insert((i, Box::new(u64::from(i) * 7)), 0).unwrap()).collect();
        let churn = Mutex::new(Vec::<u32>::new());
        let busy = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for r in 0..2 {
                let (t, stable, churn) = (&t, &stable, &churn);
                s.spawn(move || {
                    for i in 0..ROUNDS {
                        let id = stable[(i + r) % stable.len()];
                        let p = t.pin(id).expect("a stable object");
                        assert_eq!(*p.1, u64::from(p.0) * 7);
                        let maybe = churn.lock().last().copied();
                        if let Some(id) = maybe {
                            if let Some(p) = t.pin(id) {
                                assert_eq!(*p.1, u64::from(p.0) * 7);
                            }
                        }
                    }
                });
            }
            s.spawn(|| {
                for i in 0..ROUNDS as u32 {
                    let id = t.insert((i + 100, Box::new(u64::from(i + 100) * 7)), 0).unwrap();
                    churn.lock().push(id);
                    if i % 2 == 1 {
                        let victim = churn.lock().remove(0);
                        loop {
                            match t.remove(victim, |v| {
                                assert_eq!(*v.1, u64::from(v.0) * 7);
                                Ok::<(), ((u32, Box<u64>), ())>(())
                            }) {
                                Ok(()) => break,
                                Err(Removal::Busy) => {
                                    busy.fetch_add(1, Ordering::Relaxed);
                                    std::thread::yield_now();
                                }
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                    }
                }
            });
        });
        for id in stable {
            assert!(t.pin(id).is_some());
        }
    }
}
