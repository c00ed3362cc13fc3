//! Protection domain.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::device::Context;
use super::sys::last_error;
use crate::backend::NicError;

/// A protection domain: `struct ibv_pd`, keeping its [`Context`] alive.
pub struct Pd {
    ptr: NonNull<sys::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: a PD is an immutable kernel handle; libibverbs allows using it from
// any thread concurrently.
unsafe impl Send for Pd {}
// SAFETY: as above; `&Pd` only exposes thread-safe verbs.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocate a protection domain on `ctx`.
    pub fn alloc(ctx: &Arc<Context>) -> Result<Arc<Pd>, NicError> {
        // SAFETY: the context is open for as long as `ctx` lives.
        let raw = unsafe { sys::ibv_alloc_pd(ctx.as_ptr()) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_alloc_pd"))?;
        Ok(Arc::new(Pd { ptr, ctx: Arc::clone(ctx) }))
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_pd {
        self.ptr.as_ptr()
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: the PD is deallocated once. Every MR, MW and QP of it
        // holds an Arc to it, so none is alive as a Rust object; one whose
        // own teardown failed (`Mr`, `Mw`, `Qp` drops) was leaked and is
        // never touched again, and its memory kept (an `Mr` forgets its
        // `Arc<Memory>`). Then `ibv_dealloc_pd` fails (EBUSY) and frees
        // nothing, which is what the warning below reports.
        let rc = unsafe { sys::ibv_dealloc_pd(self.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_pd failed");
        }
    }
}
