//! A connection's user regions: memory the application registers to
//! expose ranges of it without copying them into pool buffers.

use std::future::poll_fn;
use std::task::Poll;

use super::super::{RegionId, UseError};
use super::Connection;
use crate::backend::{Nic, NicError};

impl<N: Nic> Connection<N> {
    /// Register `len` bytes of memory for the application to keep its data
    /// in (a KV cache's values, a store's blocks) and expose ranges of it
    /// without copying them into pool buffers ([`Connection::call_region`],
    /// [`Connection::reply_region`]): each exposure gets the same capability
    /// as a pool buffer (under mw a window over exactly the range, the
    /// lease, expiry and evidence rules). Zeroed. Write it with
    /// [`Connection::region_write`]; a range cannot be written, nor the
    /// region deregistered, while it is exposed. Under confirm the region's
    /// key lets the peer read all of it (`docs/protocol-confirm.md`): keep
    /// in it only what that peer may read.
    pub fn register_region(&self, len: usize) -> Result<RegionId, NicError> {
        self.peek(|s| s.ep.register_region(len))
    }

    /// Deregister a region once none of its ranges is exposed.
    pub fn deregister_region(&self, id: RegionId) -> Result<(), UseError> {
        self.peek(|s| s.ep.deregister_region(id))
    }

    /// Copy `bytes` into a region; refused while any of them is exposed
    /// ([`UseError::RangeExposed`]).
    pub fn region_write(&self, id: RegionId, offset: usize, bytes: &[u8]) -> Result<(), UseError> {
        self.peek(|s| s.ep.region_write(id, offset, bytes))
    }

    /// Copy `bytes` into a region, waiting while any of them is exposed
    /// (each exposure ends on its evidence, or when the connection closes).
    pub async fn region_write_when_free(
        &self,
        id: RegionId,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), UseError> {
        poll_fn(|cx| {
            let mut st = self.inner.state.lock();
            st.capacity_polled = st.capacity_wakes;
            match st.ep.region_write(id, offset, bytes) {
                Err(UseError::RangeExposed { .. }) => {
                    st.wait_for_capacity(cx.waker());
                    Poll::Pending
                }
                r => Poll::Ready(r),
            }
        })
        .await
    }

    /// Lend bytes of a region to `f` without a copy (under the connection's
    /// lock: keep it short).
    pub fn region_bytes<R>(
        &self,
        id: RegionId,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, UseError> {
        self.peek(|s| s.ep.region_bytes(id, offset, len, f))
    }
}
