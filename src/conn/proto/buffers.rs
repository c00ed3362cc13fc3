//! The user's buffers and regions: taking, giving back, exposing ranges,
//! and the CPU holds the simulator's oracle checks.

use super::super::buf::Buf;
use super::super::pool::Holder;
use super::*;
use crate::backend::MrInfo;

impl Connection {
    // ---- the user's buffers ----

    /// Take a free buffer of the standard size (`Config::buffer_size`)
    /// from the pool, or `None` when all are in use.
    pub fn alloc(&mut self) -> Option<Buf> {
        self.reclaim();
        let slot = self.bufs.take_outgoing(0)?;
        Some(self.buf(slot, 0))
    }

    /// Take the smallest free buffer that holds `len` bytes (of the
    /// standard size or a class of `Config::large_buffers`), or `Ok(None)`
    /// when every such buffer is in use. Fails when no class is that large.
    pub(crate) fn alloc_for(&mut self, len: usize) -> Result<Option<Buf>, UseError> {
        let largest = self.layout.largest();
        let Ok(want) = u32::try_from(len) else { return Err(UseError::TooLong { len, cap: largest }) };
        if want > largest {
            return Err(UseError::TooLong { len, cap: largest });
        }
        self.reclaim();
        let Some(slot) = self.bufs.first_fitting(self.layout.fitting(want), |b, k| b.take_outgoing(k)) else {
            return Ok(None);
        };
        Ok(Some(self.buf(slot, 0)))
    }

    /// A free buffer of the smallest class that has one and holds `len`.
    pub(super) fn take_fit(&mut self, len: u32, to: Holder) -> Option<u32> {
        self.bufs.first_fitting(self.layout.fitting(len), |b, k| b.take_in(k, to))
    }

    /// Whether some class holds `len` bytes and has a free buffer.
    pub(super) fn can_fit(&mut self, len: u32) -> bool {
        self.bufs.first_fitting(self.layout.fitting(len), |b, k| b.can_take(k).then_some(())).is_some()
    }

    /// Put a buffer back in the pool (dropping it does the same, a little later).
    pub fn free(&mut self, buf: Buf) {
        if buf.endpoint == self.id {
            let (slot, lending) = (buf.slot, buf.lending);
            buf.disarm();
            if self.bufs.give_back(slot, lending) {
                // A payload may be waiting for a free buffer: the engines run.
                self.dirty = true;
            }
        }
    }

    /// Whether `buf` is one of this connection's buffers, held by the user.
    pub(crate) fn check_buf(&self, buf: &Buf) -> Result<(), UseError> {
        if buf.endpoint != self.id || !self.bufs.lent(buf.slot, buf.lending) {
            return Err(UseError::ForeignBuffer(buf.slot));
        }
        Ok(())
    }

    /// Buffers (and user ranges) currently exposed to the peer or being
    /// read into.
    pub fn busy_buffers(&self) -> usize {
        self.bufs.count(Holder::Exposed)
            + self.bufs.count(Holder::Reading)
            + self.ranges.count(Holder::Exposed)
    }

    // ---- the user's regions ----

    /// Know region `id` (`conn/regions.rs`), registered as `info` in this
    /// connection's protection domain with remote read, or window binding
    /// under mw (`owned`: by and for this connection, released with it;
    /// otherwise the endpoint's, in the hub's PD); ranges of it can then
    /// be exposed.
    pub(crate) fn add_region(&mut self, id: RegionId, info: MrInfo, owned: bool) {
        debug_assert!(self.region(id).is_err(), "region {id:?} known twice");
        self.regions.push(RegionState { id, info, live: 0, owned });
    }

    /// Whether region `id` is known to this connection.
    pub(crate) fn knows_region(&self, id: RegionId) -> bool {
        self.region(id).is_ok()
    }

    /// Forget a region, once no range of it is exposed ([`UseError::RegionBusy`]
    /// until then); returns its registration for the I/O layer to release
    /// if it is the connection's.
    pub(crate) fn remove_region(&mut self, id: RegionId) -> Result<Option<MrInfo>, UseError> {
        let i = self.regions.iter().position(|r| r.id == id).ok_or(UseError::NoSuchRegion(id))?;
        if self.regions[i].live > 0 {
            return Err(UseError::RegionBusy(id));
        }
        let r = self.regions.swap_remove(i);
        Ok(r.owned.then_some(r.info))
    }

    /// Every region registration the connection must release (for the
    /// I/O layer's teardown).
    pub(crate) fn region_infos(&self) -> Vec<MrInfo> {
        self.regions.iter().filter(|r| r.owned).map(|r| r.info).collect()
    }

    pub(super) fn region(&self, id: RegionId) -> Result<&RegionState, UseError> {
        self.regions.iter().find(|r| r.id == id).ok_or(UseError::NoSuchRegion(id))
    }

    /// Take a range slot for exposing `range` (checked to be inside its
    /// region): the engines' buffer number for it.
    pub(super) fn take_range(&mut self, range: RegionRange) -> Result<u32, UseError> {
        let r = self.region(range.region)?;
        let end = range.offset as u64 + u64::from(range.len);
        if range.len == 0 || end > r.info.len as u64 {
            return Err(UseError::OutOfRegion {
                region: range.region,
                offset: range.offset,
                range_len: range.len,
                len: r.info.len,
            });
        }
        let k = self.ranges.take(Holder::User).ok_or(UseError::NoFreeWindow)?;
        self.range_at[k as usize] = range;
        let takes = &mut self.range_takes[k as usize];
        *takes = takes.wrapping_add(1);
        Ok(self.layout.slots() + k)
    }

    /// The number of the exposure in user range slot `slot` (see
    /// [`Event::RangeReturned`]): the slot, and how many times it was
    /// taken.
    pub(super) fn exposure_number(&self, slot: u32) -> u64 {
        let k = slot - self.layout.slots();
        u64::from(self.range_takes[k as usize]) << 32 | u64::from(k)
    }

    /// The user range slot exposure number `exposure` is in, while that
    /// exposure is live.
    pub(super) fn exposed_slot(&self, exposure: u64) -> Option<u32> {
        let k = exposure as u32;
        let live = self.ranges.holder(k) == Some(Holder::Exposed)
            && self.range_takes.get(k as usize).is_some_and(|&t| u64::from(t) == exposure >> 32);
        live.then(|| self.layout.slots() + k)
    }

    /// Give back a range slot that was not exposed after all.
    pub(super) fn untake_range(&mut self, slot: u32) {
        let k = slot - self.layout.slots();
        self.ranges.hand(k, Holder::User, Holder::Free);
    }

    /// What an exposure of buffer number `slot` covers: (region, offset in
    /// it, its registration) for a pool buffer or a user range.
    pub(super) fn exposure_target(&self, slot: u32) -> (MrInfo, u64) {
        match slot.checked_sub(self.layout.slots()) {
            None => self.place(slot),
            Some(k) => {
                let r = self.range_at[k as usize];
                let info = self.region(r.region).expect("a live exposure keeps its region").info;
                (info, r.offset as u64)
            }
        }
    }

    /// The exposure of buffer number `slot` is over: a pool buffer goes
    /// back to the user, a user range is returned.
    pub(super) fn exposure_over(&mut self, slot: u32, len: u32) {
        match slot.checked_sub(self.layout.slots()) {
            None => {
                if self.bufs.hand(slot, Holder::Exposed, Holder::User) {
                    self.exposure_ended(slot);
                    let b = self.buf(slot, len);
                    self.emit(Event::BufferReturned(b));
                }
            }
            Some(k) => {
                if self.ranges.hand(k, Holder::Exposed, Holder::Free) {
                    self.exposure_ended(slot);
                    let range = self.range_at[k as usize];
                    if let Some(r) = self.regions.iter_mut().find(|r| r.id == range.region) {
                        r.live = r.live.saturating_sub(1);
                    }
                    let exposure = self.exposure_number(slot);
                    self.emit(Event::RangeReturned { range, exposure });
                }
            }
        }
    }

    /// Count an exposure's end, and its age.
    fn exposure_ended(&mut self, slot: u32) {
        self.stats.exposures_ended += 1;
        if let Some(&at) = self.exposed_at.get(slot as usize) {
            self.ages.record(self.now.saturating_sub(at));
        }
    }

    /// Buffers free in the pool (dropped handles included).
    pub fn free_buffers(&mut self) -> usize {
        self.reclaim();
        self.bufs.count(Holder::Free)
    }

    /// The byte range of every buffer of the data region, every class, in
    /// slot order, and whether it is busy: exposed to the peer or being read
    /// into. Every other byte must be unreachable by the peer (mw policy).
    /// Empty with a shared buffer pool (each buffer is a region of its own).
    #[cfg(any(test, feature = "testing"))]
    pub fn buffer_ranges(&self) -> Vec<(std::ops::Range<usize>, bool)> {
        if self.bufs.is_backed() {
            return Vec::new();
        }
        (0..self.layout.slots())
            .map(|s| {
                let o = self.layout.offset(s) as usize;
                let busy = matches!(self.bufs.holder(s), Some(Holder::Exposed | Holder::Reading));
                (o..o + self.layout.size(s) as usize, busy)
            })
            .collect()
    }

    // ---- where buffers are, and who holds them ----

    /// Where buffer `slot` is: its region and its offset in it (the data
    /// region, or while the slot is taken the pool buffer behind it).
    pub(super) fn place(&self, slot: u32) -> (MrInfo, u64) {
        match &self.res.data {
            DataMemory::Region(data, _) => (*data, self.layout.offset(slot)),
            DataMemory::Pool(_) => {
                let (pool, of) = self.bufs.backing(slot).expect("a taken slot of a pool has a buffer");
                (pool.info(of), 0)
            }
        }
    }

    /// The memory of buffer `slot` (taken: on a pool, backed) and its
    /// offset in it.
    pub(super) fn memory_at(&self, slot: u32) -> (&std::sync::Arc<crate::mem::Memory>, usize) {
        match &self.res.data {
            DataMemory::Region(_, mem) => (mem, self.layout.offset(slot) as usize),
            DataMemory::Pool(_) => {
                let (pool, of) = self.bufs.backing(slot).expect("a taken slot of a pool has a buffer");
                (pool.memory(of), 0)
            }
        }
    }

    /// Write `bytes` at the start of buffer `slot`, which nobody holds (an
    /// inline payload received into a buffer just taken for it).
    pub(super) fn fill_slot(&self, slot: u32, bytes: &[u8]) {
        let (mem, offset) = self.memory_at(slot);
        if let Err(e) = mem.write(offset, bytes) {
            // A buffer just taken has no handle: this is mwcap's bug.
            debug_assert!(false, "writing an inline payload into buffer {slot}: {e}");
            tracing::error!(%e, slot, "writing an inline payload into a buffer failed (a bug in mwcap)");
        }
    }

    pub(super) fn mw_buffer(&self, slot: u32, len: u32) -> mw::Buffer {
        let (mr, offset) = self.place(slot);
        mw::Buffer { mr: mr.id.raw(), offset, len, addr: mr.addr + offset }
    }

    pub(super) fn slot_of_mw(&self, b: &mw::Buffer) -> Option<u32> {
        match &self.res.data {
            DataMemory::Region(data, _) if b.mr == data.id.raw() => self.layout.slot_at(b.offset),
            DataMemory::Region(..) => None,
            DataMemory::Pool(_) => self.bufs.slot_of_mr(b.mr).filter(|_| b.offset == 0),
        }
    }

    /// A handle for a slot the user now holds (its current lending).
    pub(super) fn buf(&self, slot: u32, len: u32) -> Buf {
        debug_assert_eq!(self.bufs.holder(slot), Some(Holder::User));
        let (mem, offset) = self.memory_at(slot);
        let cap = self.layout.size(slot) as usize;
        // No two handles ever hold one buffer: a slot is lent to one at a
        // time, and a pool parks a buffer a stale handle still holds.
        let bytes = mem.lend(offset, cap).unwrap_or_else(|| {
            panic!(
                "buffer {slot} ({cap} bytes at {offset}) is already held by another handle: a bug in mwcap"
            )
        });
        Buf {
            endpoint: self.id,
            slot,
            len,
            lending: self.bufs.lending(slot),
            home: Some(self.returns.clone()),
            bytes: Some(bytes),
        }
    }

    /// Take back the buffers whose handles were dropped; returns how many.
    pub(crate) fn reclaim(&mut self) -> usize {
        self.returns.take_all(&mut self.reclaimed);
        let mut n = 0;
        for (slot, lending) in self.reclaimed.drain(..) {
            n += usize::from(self.bufs.give_back(slot, lending));
        }
        if n > 0 {
            // A payload may be waiting for a free buffer: the engines run.
            self.dirty = true;
        }
        n
    }

    /// Wake `w` when a buffer handle is dropped (the async driver); true if
    /// dropped handles already wait to be taken back ([`Connection::reclaim`]).
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn wake_on_return(&self, w: &std::task::Waker) -> bool {
        self.returns.set_waker(w);
        self.returns.any()
    }

    /// Wake nobody when a buffer handle is dropped (see
    /// [`Connection::wants_returns`]).
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn ignore_returns(&self) {
        self.returns.clear_waker();
    }

    /// Whether a dropped buffer handle must be taken back at once, not at
    /// the next turn: a READ or an inline payload waits for a free buffer,
    /// the connection is going down (its end waits for every buffer), or
    /// its buffers are the shared pool's (another connection may wait for
    /// one).
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn wants_returns(&self) -> bool {
        self.down.is_some() || self.bufs.is_backed() || self.buffer_awaited()
    }

    /// Whether a READ (a grant's, a confirm fetch's) or an inline payload
    /// waits for a free buffer.
    pub(super) fn buffer_awaited(&self) -> bool {
        self.confirm.as_ref().is_some_and(|c| !c.pending_reads.is_empty())
            || self.reader.as_ref().is_some_and(|r| !r.pending.is_empty())
            || !self.inline_wait.is_empty()
    }

    /// Whether a take found the shared buffer pool empty and a buffer has
    /// come back to it since: the engines run again (a READ waiting for a
    /// destination). Only the driver's turn asks, so that it also wakes the
    /// user's waiting `alloc`s; a user call that took the news instead
    /// would leave them asleep.
    pub(crate) fn pool_came_back(&mut self) -> bool {
        let back = self.bufs.unstarve();
        if back {
            self.dirty = true;
        }
        back
    }

    /// The driver's turn of this connection is over: `Slots::end_turn`.
    #[inline]
    #[cfg_attr(loom, allow(dead_code))] // the async driver's, absent under loom
    pub(crate) fn end_pool_turn(&mut self, defer: bool) -> bool {
        self.bufs.end_turn(defer)
    }

    /// Wake `w` when the shared buffer pool gets a buffer back after a take
    /// found none (the hub's driver then asks
    /// [`Connection::pool_came_back`]). No-op without a shared pool.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn wake_on_pool(&mut self, w: &std::task::Waker) {
        self.bufs.wake_on_pool(w);
    }

    /// Deallocate (with `dealloc`) the shared pool's windows lent to this
    /// connection's exposures and not yet back: bound to its QP, or unbound
    /// by an invalidation whose news has not been taken yet. Call it once
    /// the QP is in ERR and before it is destroyed (rxe stalls destroying a
    /// QP with windows bound to it). They never go back to the pool; it
    /// allocates others. No-op without a shared pool.
    ///
    /// `dealloc` says whether the window was deallocated; one that was not
    /// never goes back to the pool either (still counted among its
    /// windows), and is tried again at the next call (the link's drop
    /// makes one). Returns how many are left.
    pub(crate) fn release_lent_windows(&mut self, mut dealloc: impl FnMut(MwId) -> bool) -> usize {
        let Some(lent) = self.owner.as_mut().and_then(|o| o.lent.as_mut()) else { return 0 };
        let mut n = 0;
        lent.retain(|_, w| {
            let gone = dealloc(MwId::from_raw(*w));
            n += u32::from(gone);
            !gone
        });
        let left = lent.len();
        self.bufs.windows_dropped(n);
        left
    }

    /// At the link's drop: if `gone` (the QP destroyed, the windows freed),
    /// give the shared pool's buffers back, whoever holds their slots, and
    /// use no buffer of the connection afterwards. Otherwise no evidence
    /// says the peer's NIC cannot reach them: they stay out of the pool for
    /// good.
    pub(crate) fn release_pool_buffers(&mut self, gone: bool) {
        self.bufs.release_backing(gone);
    }
}
