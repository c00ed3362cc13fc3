//! Memory regions over memory they own.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::pd::Pd;
use super::sys::{check, last_error};
use crate::backend::{Access, NicError};
use crate::mem::Memory;

/// A memory region registered over memory it owns: `struct ibv_mr`.
///
/// The memory (`Memory`) is released only after a successful
/// `ibv_dereg_mr`: once that returns the device no longer accesses it. If
/// deregistration fails the memory is leaked rather than handed back to
/// the allocator while a DMA might still reach it. A buffer handle may keep
/// it alive after deregistration (then it is plain memory).
///
/// The CPU accesses the memory by copying ([`Mr::write`], [`Mr::read`]),
/// under the memory's lock, never in a range a buffer handle holds (see
/// `crate::mem`). The NIC's own DMA is outside that lock; the protocol
/// layer lends only ranges no local work request targets.
pub struct Mr {
    ptr: NonNull<sys::ibv_mr>,
    mem: Arc<Memory>,
    len: usize,
    deregistered: bool,
    /// Keeps the protection domain alive until this is gone (it is freed
    /// before its PD).
    #[allow(dead_code)]
    pd: Arc<Pd>,
}

// SAFETY: the ibv_mr is immutable after registration and every CPU access to
// the owned memory goes through `Memory`, which serialises threads (see
// `crate::mem`); the NIC's DMA is governed by the protocol.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Allocate `len` zeroed bytes (rounded up to whole pages for the
    /// allocation; the region is exactly `len`) and register them with `access`.
    pub fn alloc(pd: &Arc<Pd>, len: usize, access: Access) -> Result<Mr, NicError> {
        if len == 0 {
            return Err(NicError::InvalidWr("a memory region needs at least one byte".into()));
        }
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(4096);
        let mem = Memory::zeroed(len, page).ok_or_else(|| NicError::Os {
            op: "alloc",
            source: crate::backend::OsError::from_errno(libc::ENOMEM),
        })?;
        Mr::register(pd, &mem, access)
    }

    /// Register all of `mem` with `access` (the same memory may be
    /// registered in several protection domains). The region keeps `mem`
    /// alive until it is deregistered, or for good if that fails.
    pub fn register(pd: &Arc<Pd>, mem: &Arc<Memory>, access: Access) -> Result<Mr, NicError> {
        let len = mem.len();
        if len == 0 {
            return Err(NicError::InvalidWr("a memory region needs at least one byte".into()));
        }
        // SAFETY: the PD is alive (we hold an Arc) and `mem` is `len` valid,
        // writable bytes that outlive the registration (the Mr holds an Arc
        // and leaks it if deregistration fails).
        let raw = unsafe {
            sys::ibv_reg_mr(pd.as_ptr(), mem.as_ptr().cast(), len, access.bits() as std::os::raw::c_int)
        };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_reg_mr"))?;
        Ok(Mr { ptr, mem: Arc::clone(mem), len, deregistered: false, pd: Arc::clone(pd) })
    }

    /// The region's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The start address, as remote peers name it.
    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the ibv_mr is valid while `self` is registered; `lkey` is
        // written once by libibverbs at registration.
        unsafe { (*self.ptr.as_ptr()).lkey }
    }

    /// The region's own remote key (valid for any QP of the PD: handle with care).
    pub fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { (*self.ptr.as_ptr()).rkey }
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mr {
        self.ptr.as_ptr()
    }

    /// Check that `offset..offset+len` lies inside the region; returns the end.
    pub fn check_range(&self, offset: usize, len: usize) -> Result<usize, NicError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(end),
            end => Err(NicError::OutOfRange {
                mr: self.lkey(),
                offset,
                end: end.unwrap_or(usize::MAX),
                len: self.len,
            }),
        }
    }

    /// Copy `data` into the region at `offset` with the CPU, under the
    /// memory's lock, unless a buffer handle holds any of the range. The
    /// caller must own the range in the protocol's sense: no local work
    /// request (posted RECV, READ in flight) targets it.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), NicError> {
        self.check_range(offset, data.len())?;
        self.mem.with_mut_as(self.lkey(), offset, data.len(), |b| b.copy_from_slice(data))
    }

    /// Copy bytes at `offset` out of the region with the CPU; the rules of
    /// [`Mr::write`] apply.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), NicError> {
        self.check_range(offset, out.len())?;
        self.mem.with_as(self.lkey(), offset, out.len(), |b| out.copy_from_slice(b))
    }

    /// The region's memory (for a buffer handle to hold ranges of).
    pub fn memory(&self) -> &Arc<Memory> {
        &self.mem
    }

    /// Deregister now, reporting failure (e.g. windows still bound over the
    /// region). On failure the region is handed back intact.
    pub fn close(mut self) -> Result<(), (Mr, NicError)> {
        match self.dereg() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn dereg(&mut self) -> Result<(), NicError> {
        if self.deregistered {
            return Ok(());
        }
        // SAFETY: the region is registered (flag) and deregistered at most
        // once: the flag is set right after success.
        check("ibv_dereg_mr", unsafe { sys::ibv_dereg_mr(self.as_ptr()) })?;
        self.deregistered = true;
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            tracing::warn!(error = %e, "leaking a memory region that could not be deregistered");
            // The device may still reach it: it is never freed.
            std::mem::forget(Arc::clone(&self.mem));
        }
    }
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}
