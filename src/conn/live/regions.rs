//! A connection's part in its endpoint's regions (`conn/regions.rs`).

use super::super::RegionId;
use super::Inner;
use crate::backend::Nic;

impl<N: Nic> Inner<N> {
    /// Region `id` is being deregistered: release this connection's
    /// registration of it, if it has one.
    pub(in crate::conn) fn forget_region(&self, id: RegionId) {
        self.state.lock().ep.forget_region(id);
    }
}
