//! The user's buffers and regions: taking, giving back, exposing ranges,
//! and the CPU holds the simulator's oracle checks.

use super::super::pool::Holder;
use super::super::types::*;
use super::{Connection, RegionState};
use crate::backend::MrInfo;

impl Connection {
    // ---- the user's buffers ----

    /// Take a free buffer of the standard size (`Config::buffer_size`)
    /// from the pool, or `None` when all are in use.
    pub fn alloc(&mut self) -> Option<Buf> {
        self.reclaim();
        let slot = self.bufs.take_outgoing(0)?;
        self.flush_holds();
        Some(self.buf(slot, 0))
    }

    /// Take the smallest free buffer that holds `len` bytes (of the
    /// standard size or a class of `Config::large_buffers`), or `Ok(None)`
    /// when every such buffer is in use. Fails when no class is that large.
    pub fn alloc_for(&mut self, len: usize) -> Result<Option<Buf>, UseError> {
        let largest = self.layout.largest();
        let Ok(want) = u32::try_from(len) else { return Err(UseError::TooLong { len, cap: largest }) };
        if want > largest {
            return Err(UseError::TooLong { len, cap: largest });
        }
        self.reclaim();
        let bufs = &mut self.bufs;
        let found = self.layout.fitting(want).find_map(|k| {
            if bufs.free_in(k) > 0 {
                bufs.take_outgoing(k)
            } else {
                None
            }
        });
        let Some(slot) = found else { return Ok(None) };
        self.flush_holds();
        Ok(Some(self.buf(slot, 0)))
    }

    /// A free buffer of the smallest class that has one and holds `len`.
    pub(super) fn take_fit(&mut self, len: u32, to: Holder) -> Option<u32> {
        // Smallest class first; with a shared pool a class with free slots
        // may find the pool's buffers of its size all taken (the take then
        // registers for a wake-up), and a larger class is tried.
        let bufs = &mut self.bufs;
        self.layout.fitting(len).find_map(|k| if bufs.free_in(k) > 0 { bufs.take_in(k, to) } else { None })
    }

    /// Whether some class holds `len` bytes and has a free buffer.
    pub(super) fn can_fit(&mut self, len: u32) -> bool {
        let bufs = &mut self.bufs;
        self.layout.fitting(len).any(|k| bufs.can_take(k))
    }

    /// The largest payload a buffer of the pool holds.
    pub fn largest_buffer(&self) -> u32 {
        self.layout.largest()
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
            self.flush_holds();
        }
    }

    /// Whether `buf` is one of this connection's buffers, held by the user.
    pub fn check_buf(&self, buf: &Buf) -> Result<(), UseError> {
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

    /// Know the user region registered as `info` (a memory region with
    /// remote read, and window binding under mw, in this connection's
    /// protection domain); ranges of it can then be exposed.
    pub fn add_region(&mut self, info: MrInfo) -> RegionId {
        let id = match self.regions.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.regions.push(None);
                self.regions.len() - 1
            }
        };
        self.regions[id] = Some(RegionState { info, live: 0 });
        RegionId(id as u32)
    }

    /// Forget a region, once no range of it is exposed; returns its
    /// registration for the I/O layer to release.
    pub fn remove_region(&mut self, id: RegionId) -> Result<MrInfo, UseError> {
        let info = self.removable_region(id)?;
        self.regions[id.0 as usize] = None;
        Ok(info)
    }

    /// Whether region `id` may be removed (it exists and no range of it is
    /// exposed): its registration, to deregister before
    /// [`Connection::remove_region`].
    pub fn removable_region(&self, id: RegionId) -> Result<MrInfo, UseError> {
        let r = self.region(id)?;
        if r.live > 0 {
            return Err(UseError::RegionBusy(id));
        }
        Ok(r.info)
    }

    /// Every region still registered (for the I/O layer's teardown).
    pub fn region_infos(&self) -> Vec<MrInfo> {
        self.regions.iter().flatten().map(|r| r.info).collect()
    }

    pub(super) fn region(&self, id: RegionId) -> Result<&RegionState, UseError> {
        self.regions.get(id.0 as usize).and_then(Option::as_ref).ok_or(UseError::NoSuchRegion(id))
    }

    /// Where a region is: its registration.
    pub fn region_info(&self, id: RegionId) -> Result<MrInfo, UseError> {
        Ok(self.region(id)?.info)
    }

    /// Whether `offset..offset + len` of region `id` may be written (it is
    /// inside the region and overlaps no exposed range).
    pub fn check_region_write(&self, id: RegionId, offset: usize, len: usize) -> Result<(), UseError> {
        let r = self.region(id)?;
        let range_len = u32::try_from(len).unwrap_or(u32::MAX);
        if offset.checked_add(len).map_or(true, |end| end > r.info.len) {
            return Err(UseError::OutOfRegion { region: id, offset, range_len, len: r.info.len });
        }
        if r.live > 0 {
            let overlaps = (0..self.cfg.region_exposures).any(|k| {
                let x = self.range_at[k as usize];
                self.ranges.holder(k) == Some(Holder::Exposed)
                    && x.region == id
                    && x.offset < offset + len
                    && offset < x.offset + x.len as usize
            });
            if overlaps {
                return Err(UseError::RangeExposed { region: id, offset, len });
            }
        }
        Ok(())
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
        Ok(self.layout.slots() + k)
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
                let info = self.regions[r.region.0 as usize]
                    .as_ref()
                    .expect("a live exposure keeps its region")
                    .info;
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
                    let b = self.buf(slot, len);
                    self.emit(Event::BufferReturned(b));
                }
            }
            Some(k) => {
                if self.ranges.hand(k, Holder::Exposed, Holder::Free) {
                    let range = self.range_at[k as usize];
                    if let Some(r) = self.regions.get_mut(range.region.0 as usize).and_then(Option::as_mut) {
                        r.live = r.live.saturating_sub(1);
                    }
                    self.emit(Event::RangeReturned(range));
                }
            }
        }
    }

    /// Buffers free in the pool (dropped handles included).
    pub fn free_buffers(&mut self) -> usize {
        self.reclaim();
        self.bufs.count(Holder::Free)
    }

    /// Byte ranges of the data region that are exposed to the peer or being
    /// read into: every other byte must be unreachable by the peer (mw policy).
    /// Empty with a shared buffer pool (each buffer is a region of its own).
    pub fn busy_ranges(&self) -> Vec<std::ops::Range<usize>> {
        if self.bufs.is_backed() {
            return Vec::new();
        }
        (0..self.layout.slots())
            .filter(|s| matches!(self.bufs.holder(*s), Some(Holder::Exposed | Holder::Reading)))
            .map(|s| {
                let o = self.layout.offset(s) as usize;
                o..o + self.layout.size(s) as usize
            })
            .collect()
    }

    /// The byte range of every buffer of the data region, every class,
    /// in slot order (for checking [`Connection::busy_ranges`] against).
    /// Empty with a shared buffer pool.
    pub fn buffer_ranges(&self) -> Vec<std::ops::Range<usize>> {
        if self.bufs.is_backed() {
            return Vec::new();
        }
        (0..self.layout.slots())
            .map(|s| {
                let o = self.layout.offset(s) as usize;
                o..o + self.layout.size(s) as usize
            })
            .collect()
    }
}
