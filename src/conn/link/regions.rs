//! A link's side of the user's regions: registering them in its PD the
//! first time it exposes a range, and calls and replies whose payload is a
//! range of one (the book of exposed ranges is `conn/regions.rs`).

use std::time::Duration;

use super::Link;
use crate::backend::Nic;
use crate::conn::regions::Regions;
use crate::conn::types::*;

impl<N: Nic> Link<N> {
    /// Register `len` zeroed bytes in the link's regions (its endpoint's,
    /// once a hub adopts it; see `Endpoint::register_region`).
    #[cfg(any(test, feature = "testing"))]
    pub fn register_region(&mut self, len: usize) -> Result<RegionId, crate::backend::NicError> {
        self.regions.register(len)
    }

    /// Deregister a region once none of its ranges is exposed
    /// ([`UseError::RegionBusy`] until then).
    #[cfg(any(test, feature = "testing"))]
    pub fn deregister_region(&mut self, id: RegionId) -> Result<(), UseError> {
        self.regions.deregister(id)?;
        self.forget_region(id);
        Ok(())
    }

    /// Copy `bytes` into region `id` at `offset`. Refused while any of those
    /// bytes is exposed to the peer ([`UseError::RangeExposed`]): wait for
    /// the exposure's [`Event::RangeReturned`].
    #[cfg(any(test, feature = "testing"))]
    pub fn region_write(&mut self, id: RegionId, offset: usize, bytes: &[u8]) -> Result<(), UseError> {
        self.regions.write(id, offset, bytes, None)
    }

    /// Client: a call whose request payload is `range` of a user region,
    /// exposed until its [`Event::RangeReturned`] (see
    /// [`Endpoint::register_region`](crate::conn::Endpoint::register_region)
    /// on an endpoint, `Link::register_region` in tests).
    pub fn call_region(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        range: RegionRange,
    ) -> Result<CallId, UseError> {
        self.expose_range(range)?;
        let r = self.span.in_scope(|| self.conn.call_region(now, trace, header, range));
        if r.is_err() {
            self.unexpose_range(range);
        }
        self.run();
        r
    }

    /// Server: answer `req` with `range` of a user region as the payload,
    /// exposed until its [`Event::RangeReturned`], its window's lease at
    /// most `lease`. The exposure's number (see [`Event::RangeReturned`]),
    /// if the range was exposed rather than returned at once.
    pub fn reply_region(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        range: RegionRange,
        lease: Option<Duration>,
    ) -> Result<Option<u64>, UseError> {
        if let Some(i) = self.delegation.call(req) {
            return self.reply_delegated(now, i, status, header, Some(range)).map(|()| None);
        }
        self.expose_range(range)?;
        let r = self.span.in_scope(|| self.conn.reply_region(now, req, status, header, range, lease));
        if r.is_err() {
            self.unexpose_range(range);
        }
        self.run();
        r
    }

    /// The link's endpoint's regions (set once, when a hub adopts it).
    pub(crate) fn set_regions(&mut self, regions: std::sync::Arc<Regions<N>>) {
        self.regions = regions;
    }

    /// On an endpoint: put `range` in its region's book (see
    /// `regions.rs`) and, the first time this connection exposes the
    /// region, know its registration in the connection's PD (registering
    /// it there unless the endpoint's serves).
    fn expose_range(&mut self, range: RegionRange) -> Result<(), UseError> {
        let regions = &self.regions;
        let me = self.conn.id();
        let region = regions.expose(me, range)?;
        if !self.conn.knows_region(range.region) {
            let made = match region.shared_for(self.access) {
                Some(info) => Ok((info, false)),
                None => self.nic.reg_memory(region.memory(), self.access).map(|info| (info, true)),
            };
            match made {
                Ok((info, owned)) => self.conn.add_region(range.region, info, owned),
                Err(e) => {
                    regions.unexpose(me, range);
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    fn unexpose_range(&self, range: RegionRange) {
        self.regions.unexpose(self.conn.id(), range);
    }

    /// Release this connection's registration of endpoint region `id`, if
    /// it has one (the region is being deregistered: no range of it is
    /// exposed).
    pub(crate) fn forget_region(&mut self, id: RegionId) {
        if let Ok(Some(info)) = self.conn.remove_region(id) {
            if let Err(e) = self.nic.dereg_mr(info.id) {
                tracing::warn!(%e, "deregistering a connection's registration of a region (its memory is kept)");
            }
        }
    }
}
