//! Registered memory that a [`Buf`](crate::conn::Buf) lends as a plain
//! slice: the one module besides `verbs` with `unsafe`.
//!
//! A [`Memory`] is a zeroed allocation that never moves and lives as long
//! as its last `Arc` (the backend's region, or a buffer handle that
//! outlived it). Its bytes are reached in two ways:
//!
//! - by copying, through [`Memory::read`], [`Memory::write`],
//!   [`Memory::with`] and [`Memory::with_mut`] (a backend's CPU accessors)
//!   and the simulated NIC's DMA ([`Memory::dma_read`],
//!   [`Memory::dma_write`]), all under the memory's lock;
//! - through a *hold*: [`Memory::lend`] marks a range as lent to one
//!   [`Lent`], and from then until it is dropped only that owner touches
//!   it, as a slice ([`Lent::bytes`], [`Lent::bytes_mut`]), without the
//!   lock.
//!
//! # Why a hold is sound
//! The holder's slices alias nothing the Rust abstract machine can see:
//! - every other accessor of this memory goes through the lock and checks
//!   the holds first: a CPU accessor refuses a range that overlaps one
//!   (the caller gets an error), the simulated NIC's READ of it returns
//!   [`POISON`] in its place and its writes skip it (the simulator's oracle
//!   reports both as hazards when the protocol should have prevented them);
//! - [`Memory::lend`] refuses a range that overlaps another hold, so two
//!   owners never lend the same byte;
//! - a [`Lent`] is not `Clone`, its slices borrow it (`&self` for reading,
//!   `&mut self` for writing), and it releases the hold when dropped, after
//!   its last borrow ended;
//! - the allocation outlives it (it owns an `Arc`).
//!
//! A real NIC's DMA is outside the abstract machine, as another process's
//! accesses to shared memory are: the protocol posts no RECV or READ into a
//! held buffer (the simulator's oracle checks that on every test run), and
//! remote READs under the confirm policy may see a held buffer's bytes
//! half-written, which confirm discards as a read of reused memory.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// What the simulated NIC reads in place of bytes a handle holds.
pub const POISON: u8 = 0xA5;

/// A zeroed, fixed allocation of registered memory; see the module docs.
pub struct Memory {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    /// The holds. Every locked access takes this lock, so a hold cannot
    /// begin in the middle of a copy.
    holds: Mutex<Holds>,
    /// A peer may READ held bytes (see [`Memory::expect_reads_of_held`]).
    reads_of_held: AtomicBool,
}

/// The ranges handles hold, and what to run when the last ends.
struct Holds {
    /// Held ranges as (offset, len), sorted by offset, disjoint.
    ranges: Vec<(usize, usize)>,
    /// Run once when the last hold ends ([`Memory::when_unheld`]).
    on_unheld: Option<Box<dyn FnOnce() + Send>>,
}

// SAFETY: `Memory` owns its allocation (like a `Box<[u8]>`); the bytes are
// reached either under `holds`' lock, which serialises threads, or through
// a hold, which lends a range to exactly one handle (module docs).
unsafe impl Send for Memory {}
// SAFETY: as above; `&Memory` exposes no unsynchronised access but a held
// range's, which only its one holder reaches.
unsafe impl Sync for Memory {}

/// Why an access to a [`Memory`] was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// The range ends past the memory.
    #[error("the range ends past the memory")]
    OutOfRange,
    /// The range overlaps bytes a buffer handle holds, at this offset and
    /// length: only the handle reads or writes them until it is given back.
    #[error(
        "bytes {0}..+{1} are lent to a buffer handle (Buf): use the handle, or wait until it is given back"
    )]
    Held(usize, usize),
}

/// A region registered on a NIC, with its memory: the CPU's way into
/// bytes the NIC also reaches (a connection's frame slots, a hub's slabs)
/// without asking the NIC (no lookup of the region; on the simulator, not
/// its fabric's lock).
#[derive(Clone)]
pub(crate) struct Registered {
    /// The region.
    pub(crate) info: crate::backend::MrInfo,
    /// Its memory.
    pub(crate) mem: Arc<Memory>,
}

impl Registered {
    /// Region `info`, registered on `nic`, with its memory.
    pub(crate) fn of<N: crate::backend::Nic>(
        nic: &N,
        info: crate::backend::MrInfo,
    ) -> Result<Registered, crate::backend::NicError> {
        Ok(Registered { info, mem: nic.memory(info.id)? })
    }

    /// Register `len` new bytes on `nic` with `access`; deregistered again
    /// if its memory cannot be had.
    pub(crate) fn register<N: crate::backend::Nic>(
        nic: &N,
        len: usize,
        access: crate::backend::Access,
    ) -> Result<Registered, crate::backend::NicError> {
        let info = nic.reg_mr(len, access)?;
        Registered::of(nic, info).inspect_err(|_| {
            let _ = nic.dereg_mr(info.id);
        })
    }

    /// Lend `offset..+len` to `f` (see [`Memory::with_as`]).
    pub(crate) fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, crate::backend::NicError> {
        self.mem.with_as(self.info.id.raw(), offset, len, f)
    }

    /// Lend `offset..+len` to `f` for writing (see [`Memory::with_mut_as`]).
    pub(crate) fn with_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, crate::backend::NicError> {
        self.mem.with_mut_as(self.info.id.raw(), offset, len, f)
    }
}

impl MemError {
    /// The error a backend's CPU accessor returns for region `mr`.
    pub(crate) fn into_nic(
        self,
        mr: u32,
        offset: usize,
        len: usize,
        region_len: usize,
    ) -> crate::backend::NicError {
        use crate::backend::NicError;
        match self {
            MemError::OutOfRange => {
                NicError::OutOfRange { mr, offset, end: offset.saturating_add(len), len: region_len }
            }
            MemError::Held(o, l) => NicError::Held { mr, offset: o, end: o + l },
        }
    }
}

impl Memory {
    /// `len` zeroed bytes, aligned to `align` (a power of two: a page for
    /// verbs registration); `None` if the allocation fails. A backend
    /// registers it with its device and keeps the `Arc` until the
    /// registration is gone.
    pub fn zeroed(len: usize, align: usize) -> Option<Arc<Memory>> {
        let size = len.max(1).checked_next_multiple_of(align)?;
        let layout = Layout::from_size_align(size, align).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })?;
        Some(Arc::new(Memory {
            ptr,
            len,
            layout,
            // Room for a few holds now, not at the first lend: a pool
            // buffer is one region, and its first lend may come thousands
            // of calls in (a call's path allocates nothing).
            holds: Mutex::new(Holds { ranges: Vec::with_capacity(4), on_unheld: None }),
            reads_of_held: AtomicBool::new(false),
        }))
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes (never: at least one is allocated, but a
    /// region asked for 0 has length 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a buffer handle holds any of its bytes.
    pub fn is_held(&self) -> bool {
        !self.holds.lock().ranges.is_empty()
    }

    /// Whether a buffer handle holds any of `offset..offset + len`.
    pub(crate) fn overlaps_hold(&self, offset: usize, len: usize) -> bool {
        Memory::overlap(&self.holds.lock().ranges, offset, offset.saturating_add(len)).is_some()
    }

    /// If a buffer handle holds any of its bytes now, run `hook()` once the
    /// last hold ends (on the thread that drops it, after the memory's own
    /// lock is released), and return true; otherwise return false and make
    /// nothing. Checked and set under the holds' lock, so a hold cannot end
    /// unseen in between. One hook at a time: a later one replaces it.
    pub(crate) fn when_unheld(&self, hook: impl FnOnce() -> Box<dyn FnOnce() + Send>) -> bool {
        let mut holds = self.holds.lock();
        if holds.ranges.is_empty() {
            return false;
        }
        holds.on_unheld = Some(hook());
        true
    }

    /// Hold `offset..offset + len` with no access to its bytes, until the
    /// [`Hold`] is dropped, as a buffer handle does while its user has it
    /// (`None` if out of range or held already): for tests of what the
    /// simulated NIC does with held bytes.
    pub fn hold(self: &Arc<Memory>, offset: usize, len: usize) -> Option<Hold> {
        self.lend(offset, len).map(Hold)
    }

    /// A peer may READ bytes a handle holds: the memory is exposed under
    /// the confirm policy, whose region key reaches all of it, so a reader
    /// may READ a buffer that is being reused, and discards what it read.
    /// The simulator's oracle then does not report such a READ through the
    /// region's key; it still reports one through a memory window (under
    /// mw a window never covers a buffer a user holds, even in memory a
    /// confirm connection also exposes, as an endpoint's shared pool).
    pub fn expect_reads_of_held(&self) {
        self.reads_of_held.store(true, Ordering::Relaxed);
    }

    /// Whether [`Memory::expect_reads_of_held`] was called.
    pub(crate) fn reads_of_held_expected(&self) -> bool {
        self.reads_of_held.load(Ordering::Relaxed)
    }

    /// The first byte, for registering the memory with a device (whose DMA
    /// the module docs' rules govern).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn end(&self, offset: usize, len: usize) -> Result<usize, MemError> {
        offset.checked_add(len).filter(|&e| e <= self.len).ok_or(MemError::OutOfRange)
    }

    /// The first hold overlapping `offset..end`.
    fn overlap(holds: &[(usize, usize)], offset: usize, end: usize) -> Option<(usize, usize)> {
        let i = holds.partition_point(|&(o, l)| o + l <= offset);
        holds.get(i).copied().filter(|&(o, _)| o < end)
    }

    /// Copy `data` in at `offset` (the CPU's write).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.with_mut(offset, data.len(), |b| b.copy_from_slice(data))
    }

    /// Copy bytes at `offset` out into `out` (the CPU's read).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), MemError> {
        self.with(offset, out.len(), |b| out.copy_from_slice(b))
    }

    /// Lend `offset..offset + len` to `f` under the lock, unless a handle
    /// holds any of it.
    pub(crate) fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, MemError> {
        let end = self.end(offset, len)?;
        let holds = self.holds.lock();
        if let Some((o, l)) = Memory::overlap(&holds.ranges, offset, end) {
            return Err(MemError::Held(o, l));
        }
        // SAFETY: in bounds (checked); no handle holds any of the range and
        // none can start to while the lock is held; every other access to
        // unheld bytes takes the lock, so this borrow is the only one.
        Ok(f(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }))
    }

    /// [`Memory::with`] for writing.
    pub(crate) fn with_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, MemError> {
        let end = self.end(offset, len)?;
        let holds = self.holds.lock();
        if let Some((o, l)) = Memory::overlap(&holds.ranges, offset, end) {
            return Err(MemError::Held(o, l));
        }
        // SAFETY: as in `with`: the lock makes this the only borrow.
        Ok(f(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }))
    }

    /// [`Memory::with`], for the bytes of region `mr` (a backend's, or a
    /// connection's frame slots): a refusal is the NIC error naming them.
    pub(crate) fn with_as<R>(
        &self,
        mr: u32,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, crate::backend::NicError> {
        self.with(offset, len, f).map_err(|e| e.into_nic(mr, offset, len, self.len))
    }

    /// [`Memory::with_mut`], for the bytes of region `mr`, as
    /// [`Memory::with_as`].
    pub(crate) fn with_mut_as<R>(
        &self,
        mr: u32,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, crate::backend::NicError> {
        self.with_mut(offset, len, f).map_err(|e| e.into_nic(mr, offset, len, self.len))
    }

    /// Split `offset..end` at the holds and hand each run to `f` in order
    /// (its start, its end, whether a handle holds it); whether any was
    /// held.
    fn runs(
        holds: &[(usize, usize)],
        offset: usize,
        end: usize,
        mut f: impl FnMut(usize, usize, bool),
    ) -> bool {
        let (mut at, mut met) = (offset, false);
        while at < end {
            let (next, held) = match Memory::overlap(holds, at, end) {
                Some((o, l)) if o <= at => ((o + l).min(end), true),
                Some((o, _)) => (o, false),
                None => (end, false),
            };
            met |= held;
            f(at, next, held);
            at = next;
        }
        met
    }

    /// The simulated NIC reads `offset..offset + len` onto the end of
    /// `out`, with [`POISON`] for bytes a handle holds. Returns whether it
    /// met a hold.
    pub fn dma_read(&self, offset: usize, len: usize, out: &mut Vec<u8>) -> Result<bool, MemError> {
        let end = self.end(offset, len)?;
        let holds = self.holds.lock();
        Ok(Memory::runs(&holds.ranges, offset, end, |at, next, held| {
            if held {
                out.resize(out.len() + (next - at), POISON);
            } else {
                // SAFETY: in bounds; not held (`runs` splits at holds) and
                // under the lock (`holds` lives across the call), so nothing
                // else borrows these bytes.
                out.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(self.ptr.as_ptr().add(at), next - at)
                });
            }
        }))
    }

    /// The simulated NIC writes `data` at `offset`, skipping bytes a handle
    /// holds. Returns whether it met a hold.
    pub fn dma_write(&self, offset: usize, data: &[u8]) -> Result<bool, MemError> {
        let end = self.end(offset, data.len())?;
        let holds = self.holds.lock();
        Ok(Memory::runs(&holds.ranges, offset, end, |at, next, held| {
            if !held {
                let src = &data[at - offset..next - offset];
                // SAFETY: in bounds; not held and under the lock, so no
                // borrow of these bytes exists; `src` is another allocation.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(at), src.len()) };
            }
        }))
    }

    /// Make room for `n` holds at once (the buffers carved out of it), so
    /// that lending one allocates nothing.
    pub(crate) fn reserve_holds(&self, n: usize) {
        let mut holds = self.holds.lock();
        let more = n.saturating_sub(holds.ranges.len());
        holds.ranges.reserve(more);
    }

    /// Lend `offset..offset + len` to one handle, or `None` if it is
    /// empty, out of range or overlaps a range lent already. (An empty
    /// range overlaps nothing, so it could start where another hold does:
    /// holds are told apart by where they start, and its release would end
    /// the other.)
    pub(crate) fn lend(self: &Arc<Memory>, offset: usize, len: usize) -> Option<Lent> {
        if len == 0 {
            return None;
        }
        let end = self.end(offset, len).ok()?;
        let mut holds = self.holds.lock();
        if Memory::overlap(&holds.ranges, offset, end).is_some() {
            return None;
        }
        let i = holds.ranges.partition_point(|&(o, _)| o < offset);
        holds.ranges.insert(i, (offset, len));
        Some(Lent { mem: Arc::clone(self), offset, len })
    }

    /// End the hold that starts at `offset`; the last one runs the hook
    /// set by [`Memory::when_unheld`], after the lock is released.
    fn release(&self, offset: usize) {
        let hook = {
            let mut holds = self.holds.lock();
            if let Ok(i) = holds.ranges.binary_search_by_key(&offset, |&(o, _)| o) {
                holds.ranges.remove(i);
            }
            if holds.ranges.is_empty() {
                holds.on_unheld.take()
            } else {
                None
            }
        };
        if let Some(hook) = hook {
            hook();
        }
    }
}

/// A hold on a range of a [`Memory`] with no access to its bytes
/// ([`Memory::hold`]); released when dropped.
pub struct Hold(#[allow(dead_code)] Lent);

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hold")
    }
}

/// A range of a [`Memory`] lent to one owner, who reads and writes it as a
/// slice without a lock until it drops this (module docs).
pub(crate) struct Lent {
    mem: Arc<Memory>,
    offset: usize,
    len: usize,
}

impl Lent {
    /// The first `len` bytes of the range (at most all of it).
    pub(crate) fn bytes(&self, len: usize) -> &[u8] {
        let len = len.min(self.len);
        // SAFETY: in bounds (`lend` checked the range); the range is held by
        // this `Lent` alone, every other accessor of the memory skips held
        // bytes, and the borrow is tied to `&self`, so it ends before `drop`
        // releases the hold; the `Arc` keeps the allocation alive.
        unsafe { std::slice::from_raw_parts(self.mem.ptr.as_ptr().add(self.offset), len) }
    }

    /// [`Lent::bytes`] for writing.
    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        let len = len.min(self.len);
        // SAFETY: as in `bytes`; `&mut self` makes this the only borrow of
        // the range.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr.as_ptr().add(self.offset), len) }
    }

    /// The range's length.
    pub(crate) fn capacity(&self) -> usize {
        self.len
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.mem.release(self.offset);
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout; the last
        // `Arc` is gone, so no borrow or device registration remains (a
        // backend keeps its `Arc` until deregistration succeeded, and leaks
        // it if that fails).
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory")
            .field("len", &self.len)
            .field("holds", &self.holds.lock().ranges.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_keeps_every_locked_access_out_and_lends_its_bytes() {
        let m = Memory::zeroed(100, 8).unwrap();
        m.write(0, &[1; 100]).unwrap();
        let mut a = m.lend(10, 20).unwrap();
        assert!(m.lend(29, 5).is_none(), "overlaps the first hold's end");
        assert!(m.lend(0, 11).is_none(), "overlaps its start");
        let b = m.lend(30, 5).unwrap();
        assert!(m.is_held());
        assert_eq!(m.write(25, &[2; 10]), Err(MemError::Held(10, 20)));
        assert_eq!(m.read(0, &mut [0; 11]), Err(MemError::Held(10, 20)));
        assert_eq!(m.with(34, 2, |_| ()), Err(MemError::Held(30, 5)));
        m.write(0, &[3; 10]).unwrap();
        a.bytes_mut(20).copy_from_slice(&[7; 20]);
        assert_eq!(a.bytes(100), &[7; 20], "at most the range");
        let mut out = Vec::new();
        assert!(m.dma_read(5, 30, &mut out).unwrap());
        assert_eq!(&out[..5], &[3; 5]);
        assert_eq!(&out[5..], &[POISON; 25][..], "held bytes are never read");
        assert!(m.dma_write(0, &[9; 40]).unwrap());
        drop((a, b));
        assert!(!m.is_held());
        let mut all = [0; 40];
        m.read(0, &mut all).unwrap();
        assert_eq!(&all[..10], &[9; 10]);
        assert_eq!(&all[10..30], &[7; 20], "the DMA skipped the held bytes");
        assert_eq!(&all[30..35], &[1; 5], "and these, held then");
        assert_eq!(&all[35..], &[9; 5]);
        assert_eq!(m.write(99, &[0; 2]), Err(MemError::OutOfRange));
        assert!(m.lend(90, 11).is_none());
    }

    /// An empty hold where a lent range starts would share its start, and
    /// its release would end the lent one's hold: the CPU could then write
    /// bytes a live `&mut [u8]` covers. It is refused.
    #[test]
    fn an_empty_range_is_never_lent() {
        let m = Memory::zeroed(100, 8).unwrap();
        let a = m.lend(16, 16).unwrap();
        assert!(m.lend(16, 0).is_none(), "an empty hold at the lent range's start");
        assert!(m.lend(50, 0).is_none(), "an empty hold anywhere");
        assert_eq!(m.write(16, &[1]), Err(MemError::Held(16, 16)), "the lent range stays held");
        drop(a);
        m.write(16, &[1]).unwrap();
    }

    /// With room made for its buffers, lending all of them at once never
    /// grows the list of holds (a connection's first burst of calls
    /// allocates no more than its thousandth); without, it grows.
    #[test]
    fn lending_every_buffer_of_a_region_made_room_for_does_not_grow_its_holds() {
        let lend_all = |m: &Arc<Memory>| {
            let room = m.holds.lock().ranges.capacity();
            let lent: Vec<Lent> = (0..16).map(|i| m.lend(i * 64, 64).unwrap()).collect();
            let grown = m.holds.lock().ranges.capacity() != room;
            drop(lent);
            grown
        };
        let m = Memory::zeroed(16 * 64, 8).unwrap();
        m.reserve_holds(16);
        assert!(!lend_all(&m), "the holds grew though room was made");
        assert!(lend_all(&Memory::zeroed(16 * 64, 8).unwrap()), "the test would not see a growth");
    }

    /// A hook set while a handle holds bytes runs once, when the last hold
    /// ends; on memory no handle holds, none is made.
    #[test]
    fn a_hook_runs_once_when_the_last_hold_ends() {
        use std::sync::atomic::AtomicUsize;
        let m = Memory::zeroed(100, 8).unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let hook = |runs: &Arc<AtomicUsize>| {
            let r = runs.clone();
            move || -> Box<dyn FnOnce() + Send> {
                Box::new(move || {
                    r.fetch_add(1, Ordering::SeqCst);
                })
            }
        };
        assert!(!m.when_unheld(hook(&runs)), "nothing held: no hook");
        let (a, b) = (m.lend(0, 10).unwrap(), m.lend(20, 10).unwrap());
        assert!(m.when_unheld(hook(&runs)));
        drop(a);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "one hold is left");
        drop(b);
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the last hold ended");
        drop(m.lend(0, 10).unwrap());
        assert_eq!(runs.load(Ordering::SeqCst), 1, "once");
    }
}
