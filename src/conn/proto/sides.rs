//! The two sides of a connection's protocols, each behind one interface
//! whichever policy runs it:
//!
//! - the **owner side** exposes our buffers in our direction (the request
//!   payload on a client, the reply payload on a server): [`Connection::expose_ready`],
//!   [`Connection::expose`], [`Connection::withdraw`]. Under mw it is the
//!   lease owner (a window bound per exposure); under confirm, the confirm
//!   engine (the region key, and a confirm before the buffer is reused).
//! - the **reader side** reads the peer's buffers in its direction:
//!   [`Connection::want_payload`] asks for a reply payload before a call
//!   goes out (confirm: a fetch; mw: nothing, the grant comes with the
//!   reply), and grants, offers and exposures from the peer are started
//!   as READs in `recv.rs` and `start_grant`.

use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::super::pool::Holder;
use super::super::types::*;
use super::confirm::ConfirmEngine;
use super::Connection;

/// One exposure of one of our buffers, made by the owner side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Exposure {
    /// Under mw: a window lease.
    Lease(mw::LeaseId),
    /// Under confirm: the engine's message (an exposed request or an offer).
    Confirm(fb::MsgId),
}

impl Connection {
    /// Owner side: whether `slot` can be exposed now (a free window under
    /// mw; the buffer not still exposed under confirm).
    pub(super) fn expose_ready(&self, slot: u32) -> Result<(), UseError> {
        match (&self.owner, &self.confirm) {
            (Some(o), _) if o.engine.free_windows() == 0 => Err(UseError::NoFreeWindow),
            (Some(_), _) => Ok(()),
            (None, Some(c)) if !c.is_buffer_free(slot) => Err(UseError::BufferExposed(slot)),
            _ => Ok(()),
        }
    }

    /// Owner side: expose the first `len` bytes of `slot` to the peer. On a
    /// server under confirm the exposure answers the client's `fetch`; if
    /// the client withdrew it (or never asked), nothing is exposed and this
    /// returns `None`. On success the buffer is the NIC's until the owner
    /// side returns it.
    pub(super) fn expose(
        &mut self,
        now: Duration,
        slot: u32,
        len: u32,
        fetch: Option<fb::MsgId>,
        lease: Duration,
    ) -> Result<Option<Exposure>, UseError> {
        let (mr, offset) = self.exposure_target(slot);
        let exposure = if let Some(o) = self.owner.as_mut() {
            let buffer = mw::Buffer { mr: mr.id.raw(), offset, len, addr: mr.addr + offset };
            let lease = match o.lent.as_mut() {
                None => o.engine.grant(now, buffer, lease).map_err(lease_error)?,
                Some(lent) => {
                    // A window of the hub's pool; none free: wait, as for a
                    // window of our own (the pool wakes us).
                    let window = self.bufs.take_window().ok_or(UseError::NoFreeWindow)?;
                    match o.engine.grant_on(now, buffer, lease, window) {
                        Ok(lease) => {
                            lent.insert(lease, window.handle);
                            lease
                        }
                        Err(refused) => {
                            self.bufs.give_window(refused.window, false);
                            return Err(lease_error(refused.error));
                        }
                    }
                }
            };
            o.leases.insert(lease, slot);
            Exposure::Lease(lease)
        } else {
            let c = self.confirm.as_mut().expect("a direction without windows runs confirm");
            let id = c.bufs[slot as usize];
            if slot >= self.layout.slots() || self.bufs.is_backed() {
                // A user range, or a slot backed by a pool buffer: its
                // confirm buffer points at the memory for this exposure
                // (its generation moves on, so nothing said about an
                // earlier exposure can match this one).
                let region = fb::Region::new(mr.addr + offset, len, mr.rkey);
                each!(&mut c.engine, e => e.set_buffer_region(id, region)).map_err(UseError::Confirm)?;
            }
            let fm = match &mut c.engine {
                super::confirm::Engine::Client(e) => {
                    e.send_request(now, id, len).map_err(UseError::Confirm)?
                }
                super::confirm::Engine::Server(e) => {
                    let Some(fm) = fetch else { return Ok(None) };
                    // Held no longer than the exposure's capability
                    // lives (a delegation's token), as a window's lease.
                    match e.offer_within(now, fm, id, len, lease) {
                        Ok(()) => fm,
                        // The client's call ended (cancelled, timed out) and
                        // it said so: nothing to expose.
                        Err(fb::UsageError::NotWanted(_)) => return Ok(None),
                        Err(e) => return Err(UseError::Confirm(e)),
                    }
                }
            };
            Exposure::Confirm(fm)
        };
        match slot.checked_sub(self.layout.slots()) {
            None => {
                self.bufs.hand(slot, Holder::User, Holder::Exposed);
            }
            Some(k) => {
                self.ranges.hand(k, Holder::User, Holder::Exposed);
                let region = self.range_at[k as usize].region;
                if let Some(r) = self.regions.iter_mut().find(|r| r.id == region) {
                    r.live += 1;
                }
            }
        }
        self.stats.bytes_exposed += u64::from(len);
        self.stats.exposures += 1;
        if let Some(at) = self.exposed_at.get_mut(slot as usize) {
            *at = now;
        }
        Ok(Some(exposure))
    }

    /// Owner side: the call an exposure belongs to is over before the peer
    /// said so. It ends as its protocol allows: an mw window stays bound
    /// until the peer releases or the lease expires; a confirm exposure
    /// waits for the peer's confirm or its own expiry.
    pub(super) fn withdraw(&mut self, now: Duration, e: Exposure) {
        match e {
            Exposure::Lease(lease) => {
                if let Some(o) = self.owner.as_mut() {
                    let _ = o.engine.cancel(now, lease);
                }
            }
            Exposure::Confirm(fm) => {
                if let Some(c) = self.confirm.as_mut().and_then(ConfirmEngine::client) {
                    c.cancel(now, fm);
                }
            }
        }
    }

    /// Reader side, on a client: ask for the reply payload of a call about
    /// to go out. Under confirm that is a fetch the server answers with an
    /// offer; under mw nothing (the server's grant rides on its reply).
    pub(super) fn want_payload(&mut self, now: Duration) -> Result<Option<fb::MsgId>, UseError> {
        if self.reader.is_some() {
            return Ok(None);
        }
        let max = self.layout.largest();
        match self.confirm.as_mut().and_then(ConfirmEngine::client) {
            Some(c) => c.fetch(now, max).map(Some).map_err(UseError::Confirm),
            None => Ok(None),
        }
    }

    /// Reader side, on a client: the server refused the request `fetch`
    /// rode on unread (`Busy`), so it never saw the fetch. The fetch ends
    /// as the server's refusal would end it, with nothing sent (a refusal
    /// of our own would name a fetch the server does not know).
    #[cold]
    pub(super) fn fetch_refused(&mut self, now: Duration, fetch: fb::MsgId) {
        if let Some(c) = self.confirm.as_mut().and_then(ConfirmEngine::client) {
            c.refused(now, fetch);
        }
    }

    /// Reader side, on a client: the call's payload is no longer wanted.
    /// With `quiet`, the call never went out: the engine's notices about it
    /// are dropped too.
    pub(super) fn unwant(&mut self, now: Duration, fetch: fb::MsgId, quiet: bool) {
        if let Some(c) = self.confirm.as_mut().and_then(ConfirmEngine::client) {
            c.cancel(now, fetch);
            if quiet {
                while c.poll_action().is_some() {}
                while c.poll_event().is_some() {}
            }
        }
    }
}

/// An mw grant refusal as the user's error: a full window pool is plain
/// backpressure.
fn lease_error(e: mw::GrantError) -> UseError {
    match e {
        mw::GrantError::NoFreeWindow { .. } => UseError::NoFreeWindow,
        other => UseError::Lease(other),
    }
}
