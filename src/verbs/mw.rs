//! Type-2 memory windows, with their current rkey tracked here.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use rdma_mummy_sys as sys;

use super::pd::Pd;
use super::sys::{check, last_error};
use crate::backend::{rkey, NicError};

/// A type-2 memory window: `struct ibv_mw`.
///
/// libibverbs never updates `ibv_mw.rkey` after a type-2 bind (the bind
/// happens in a work request, not in a verb that returns the key), so the
/// window's current rkey lives here: a new one is proposed from it
/// ([`crate::backend::rkey::rebind`]) with a random consumer key, and a successful post of the bind records it
/// ([`Mw::rkey`]).
///
/// The record is also written back into `ibv_mw.rkey`: rxe's provider puts
/// that field in the bind work request as the window's *current* key and the
/// kernel refuses the bind (`MW_BIND_ERR`) when it is stale, so without the
/// write-back every second bind of a window fails (measured on Linux 6.1).
/// The write happens under the window's bind lock, which a post holds from
/// before the provider reads the field until after the write.
pub struct Mw {
    ptr: NonNull<sys::ibv_mw>,
    rkey: AtomicU32,
    bind_lock: Mutex<()>,
    deallocated: bool,
    /// Keeps the protection domain alive until this is gone (it is freed
    /// before its PD).
    #[allow(dead_code)]
    pd: Arc<Pd>,
}

// SAFETY: the ibv_mw handle is only passed to thread-safe verbs; the tracked
// rkey is an atomic.
unsafe impl Send for Mw {}
// SAFETY: as above.
unsafe impl Sync for Mw {}

impl Mw {
    /// Allocate a type-2 window in `pd`. It starts unbound.
    pub fn alloc(pd: &Arc<Pd>) -> Result<Mw, NicError> {
        // SAFETY: the PD is alive; the inline ibv_alloc_mw checks that the
        // provider implements alloc_mw and sets EOPNOTSUPP otherwise.
        let raw = unsafe { sys::ibv_alloc_mw(pd.as_ptr(), sys::ibv_mw_type::IBV_MW_TYPE_2) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_alloc_mw"))?;
        // SAFETY: `ptr` is the window libibverbs just returned; its rkey field
        // was set at allocation.
        let initial = unsafe { (*ptr.as_ptr()).rkey };
        Ok(Mw {
            ptr,
            rkey: AtomicU32::new(initial),
            bind_lock: Mutex::new(()),
            deallocated: false,
            pd: Arc::clone(pd),
        })
    }

    /// The current rkey: the one of the last bind posted successfully (or the
    /// allocation's rkey before any bind).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::Acquire)
    }

    /// Whether `new` carries this window's index bits.
    pub fn owns_rkey(&self, new: u32) -> bool {
        rkey::index(new) == rkey::index(self.rkey())
    }

    /// Take the window's bind lock: held across a post that binds it and
    /// the [`Mw::set_rkey`] that follows.
    pub(crate) fn lock_binds(&self) -> MutexGuard<'_, ()> {
        self.bind_lock.lock()
    }

    /// Record that a bind with `new` was posted, here and in `ibv_mw.rkey`.
    ///
    /// # Safety
    /// The caller holds this window's [`Mw::lock_binds`] guard, so no other
    /// thread is inside a post that reads `ibv_mw.rkey` of this window.
    pub(crate) unsafe fn set_rkey(&self, new: u32) {
        self.rkey.store(new, Ordering::Release);
        // SAFETY: the ibv_mw is allocated (we own it until dealloc, which
        // needs `&mut self`); the only readers of its `rkey` are posts binding
        // this window and `rkey()`-like reads in libibverbs, all of which run
        // under the bind lock the caller holds (see the contract above).
        unsafe { (*self.ptr.as_ptr()).rkey = new };
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mw {
        self.ptr.as_ptr()
    }

    /// Deallocate now, reporting failure. A bound window is invalidated.
    pub fn close(mut self) -> Result<(), (Mw, NicError)> {
        match self.dealloc() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn dealloc(&mut self) -> Result<(), NicError> {
        if self.deallocated {
            return Ok(());
        }
        // SAFETY: the window is allocated (flag) and freed at most once.
        check("ibv_dealloc_mw", unsafe { sys::ibv_dealloc_mw(self.as_ptr()) })?;
        self.deallocated = true;
        Ok(())
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        if let Err(e) = self.dealloc() {
            tracing::warn!(error = %e, "ibv_dealloc_mw failed");
        }
    }
}

impl std::fmt::Debug for Mw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mw").field("rkey", &format_args!("{:#x}", self.rkey())).finish()
    }
}
