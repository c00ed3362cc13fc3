//! A link's side of the user's buffers: allocating and freeing them,
//! taking back the handles the user dropped, and the hooks that tell the
//! async driver when that (or a control send slot) is waited for.

use super::Link;
use crate::backend::Nic;
use crate::conn::buf::Buf;
use crate::conn::proto::Connection;
use crate::conn::types::*;

impl<N: Nic> Link<N> {
    /// Take back the buffers whose handles were dropped; returns how many.
    pub(crate) fn reclaim(&mut self) -> usize {
        self.with_conn(|c| c.reclaim() + usize::from(c.pool_came_back()))
    }

    /// Whether a frame or an answer waits for a control send slot (or
    /// credit): a grant SEND's completion, which frees one, must then be
    /// handled at once.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn send_slot_awaited(&self) -> bool {
        self.conn.send_slot_awaited() || self.answers_waiting()
    }

    /// Take a free buffer from the pool, or `None` when all are in use.
    pub fn alloc(&mut self) -> Option<Buf> {
        self.with_conn(Connection::alloc)
    }

    /// Take the smallest free buffer that holds `len` bytes (see
    /// [`Config::large_buffers`](crate::conn::Config::large_buffers)), or `Ok(None)` when all such buffers are
    /// in use; fails when no buffer is that large.
    pub fn alloc_for(&mut self, len: usize) -> Result<Option<Buf>, UseError> {
        self.with_conn(|c| c.alloc_for(len))
    }

    /// Put a buffer back in the pool (dropping it does the same, a little later).
    pub fn free(&mut self, buf: Buf) {
        self.with_conn(|c| c.free(buf))
    }

    /// Buffers free in the pool (dropped handles included).
    pub fn free_buffers(&mut self) -> usize {
        self.with_conn(Connection::free_buffers)
    }
}
