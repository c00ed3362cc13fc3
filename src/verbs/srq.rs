//! Shared receive queues, with their limit event.

use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::pd::Pd;
use super::post::{post_errno, Slice};
use super::sys::{check, from_errno, last_error};
use crate::backend::NicError;

/// A shared receive queue: `struct ibv_srq`, one scatter entry per receive.
/// It keeps its PD alive; queue pairs that take their receives from it keep
/// it alive in turn ([`Qp::srq`](super::Qp::srq)).
///
/// Its limit event ([`Srq::arm_limit`]) arrives on the device context's
/// asynchronous event fd; the context routes it to this queue's flag by
/// the `ibv_srq` address (the `event` module), and [`Srq::take_limit`]
/// drains the fd and takes the flag.
pub struct Srq {
    ptr: NonNull<sys::ibv_srq>,
    max_wr: u32,
    /// Raised by the context's event drain on `IBV_EVENT_SRQ_LIMIT_REACHED`.
    limit_reached: Arc<AtomicBool>,
    destroyed: bool,
    pd: Arc<Pd>,
}

// SAFETY: posting to and modifying an SRQ are thread-safe in libibverbs
// (providers lock the queue); the Rust fields are immutable after creation
// apart from the atomic flag.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    /// Create a shared receive queue in `pd` with room for at least
    /// `max_wr` receives of one scatter entry each. The limit starts disarmed.
    pub fn create(pd: &Arc<Pd>, max_wr: u32) -> Result<Srq, NicError> {
        // SAFETY: ibv_srq_init_attr is a pointer and integers; all-zero
        // (no srq_context, limit 0 = disarmed) is valid.
        let mut init: sys::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = max_wr.max(1);
        init.attr.max_sge = 1;
        let limit_reached = Arc::new(AtomicBool::new(false));
        // Created and registered under the registry lock, so no drain can
        // see an event of this SRQ before its flag is in place.
        let mut registry = pd.context().srq_registry();
        // SAFETY: the PD is alive and stays so as long as the SRQ (which
        // holds an Arc to it); `init` is valid for the call, which may
        // write the actual sizes back into it.
        let raw = unsafe { sys::ibv_create_srq(pd.as_ptr(), &mut init) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_create_srq"))?;
        registry.add(ptr.as_ptr(), Arc::clone(&limit_reached));
        drop(registry);
        Ok(Srq { ptr, max_wr: init.attr.max_wr, limit_reached, destroyed: false, pd: Arc::clone(pd) })
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_srq {
        self.ptr.as_ptr()
    }

    /// Post one receive into `local` (a checked slice of a region of the
    /// same PD; the device refuses another PD's region).
    pub fn post_recv(&self, wr_id: u64, local: Slice<'_>) -> Result<(), NicError> {
        let mut sge = local.sge();
        let mut wr = sys::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the SRQ is alive (borrowed); `wr` and `sge` live until the
        // call returns (the provider copies them into its queue); the scatter
        // entry lies inside a registered region borrowed for the call.
        let rc = unsafe { sys::ibv_post_srq_recv(self.as_ptr(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(from_errno("ibv_post_srq_recv", post_errno(rc)))
        }
    }

    /// Arm the limit: once fewer than `limit` receives remain posted, the
    /// device raises `IBV_EVENT_SRQ_LIMIT_REACHED` once and disarms. 0 disarms.
    pub fn arm_limit(&self, limit: u32) -> Result<(), NicError> {
        let mut attr = sys::ibv_srq_attr { max_wr: 0, max_sge: 0, srq_limit: limit };
        let mask = sys::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as std::os::raw::c_int;
        // SAFETY: the SRQ is alive; `attr` is valid for the call and the
        // mask names only its `srq_limit`.
        check("ibv_modify_srq(IBV_SRQ_LIMIT)", unsafe { sys::ibv_modify_srq(self.as_ptr(), &mut attr, mask) })
    }

    /// Whether the limit event came since the last call, taking it. Reads
    /// (and acknowledges) every pending asynchronous event of the device
    /// context first, without blocking.
    pub fn take_limit(&self) -> Result<bool, NicError> {
        self.pd.context().drain_async_events()?;
        Ok(self.limit_reached.swap(false, Ordering::AcqRel))
    }

    /// Destroy now, reporting failure (e.g. queue pairs still use it). The
    /// receives still posted are dropped without completions.
    pub fn close(mut self) -> Result<(), (Srq, NicError)> {
        match self.destroy() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn destroy(&mut self) -> Result<(), NicError> {
        if self.destroyed {
            return Ok(());
        }
        // Under the registry lock: no drain holds an unacknowledged event
        // of this SRQ (ibv_destroy_srq would wait for it), and the address
        // leaves the table exactly when the SRQ is gone.
        let mut registry = self.pd.context().srq_registry();
        // SAFETY: the SRQ exists (flag) and is destroyed at most once; no
        // queue pair uses it (each holds an Arc to it, and `self` is owned).
        check("ibv_destroy_srq", unsafe { sys::ibv_destroy_srq(self.as_ptr()) })?;
        registry.remove(self.as_ptr());
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::warn!(error = %e, "ibv_destroy_srq failed");
        }
    }
}

impl std::fmt::Debug for Srq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Srq").field("max_wr", &self.max_wr).finish()
    }
}
