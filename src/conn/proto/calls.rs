//! The user's operations: calls (client), replies (server), cancels.

use std::time::Duration;

use mwcap_fallback as fb;

use super::super::frame::{Attaches, Frame, MAX_HEADER};
use super::super::pool::Holder;
use super::super::types::*;
use super::confirm::ConfirmEngine;
use super::{Call, Connection, Data};

impl Connection {
    fn ready_to_send(&self, role: Role, header: &[u8]) -> Result<(), UseError> {
        if self.cfg.role != role {
            return Err(UseError::WrongRole(self.cfg.role));
        }
        if let Some(r) = &self.down {
            return Err(UseError::Down(r.clone()));
        }
        if header.len() > MAX_HEADER {
            return Err(UseError::HeaderTooLong(header.len()));
        }
        if self.sends.count(Holder::Free) == 0 {
            return Err(UseError::NoCtrlSlot);
        }
        Ok(())
    }

    /// Client: send a request with `header` and, optionally, a payload the
    /// server will READ from `data` (which returns in an
    /// [`Event::BufferReturned`]). The reply comes as [`Event::Reply`] or
    /// [`Event::CallFailed`].
    ///
    /// A refusal sends nothing and hands `data` back in [`Refused::data`].
    pub fn call(&mut self, now: Duration, header: &[u8], data: Option<Buf>) -> Result<CallId, Refused> {
        self.now = now;
        if let Err(e) = self.check_call(header, data.as_ref()) {
            return Err(Refused::new(e, data));
        }
        let msg = self.next_msg;
        let mut frame = Frame::Request { msg_id: msg, header, attach: Attaches::new() };
        let mut call = Call {
            deadline: now + self.cfg.call_timeout,
            req_lease: None,
            req_fb: None,
            fetch_fb: None,
            reply: None,
            data: Data::Unknown,
        };
        if self.cfg.policies.reply == Policy::Confirm {
            let fbc = self
                .confirm
                .as_mut()
                .and_then(ConfirmEngine::client)
                .expect("confirm reply policy has a client engine");
            match fbc.fetch(now, self.cfg.buffer_size) {
                Ok(fm) => call.fetch_fb = Some(fm),
                Err(e) => return Err(Refused::new(UseError::Confirm(e), data)),
            }
        }
        // An engine refusal below unwinds the fetch and hands the buffer back.
        if let Some(b) = &data {
            let slot = b.slot;
            let exposed = match self.cfg.policies.request {
                Policy::Mw => {
                    let buffer = self.mw_buffer(slot, b.len);
                    let owner = self.owner.as_mut().expect("mw request policy has an owner engine");
                    owner
                        .engine
                        .grant(now, buffer, self.cfg.lease_time)
                        .map(|lease| call.req_lease = Some(lease))
                        .map_err(lease_error)
                }
                Policy::Confirm => {
                    let c = self.confirm.as_mut().expect("confirm request policy has a confirm engine");
                    let id = c.bufs[slot as usize];
                    let fbc = c.client().expect("a client's confirm engine is a client");
                    fbc.send_request(now, id, b.len)
                        .map(|fm| call.req_fb = Some(fm))
                        .map_err(UseError::Confirm)
                }
            };
            if let Err(why) = exposed {
                if let (Some(fm), Some(c)) =
                    (call.fetch_fb, self.confirm.as_mut().and_then(ConfirmEngine::client))
                {
                    c.cancel(now, fm);
                    // The engine's cancellation notice is for no call of ours.
                    while c.poll_action().is_some() {}
                    while c.poll_event().is_some() {}
                }
                return Err(Refused::new(why, data));
            }
            self.bufs.hand(slot, Holder::User, Holder::Exposed);
            if let (Some(lease), Some(o)) = (call.req_lease, self.owner.as_mut()) {
                o.leases.insert(lease, slot);
            }
        }
        if let Some(b) = data {
            b.disarm(); // now the NIC's: its drop must not return it
        }
        // Committed: the call is registered and nothing below refuses it.
        if let Some(c) = self.confirm.as_mut() {
            for fm in [call.fetch_fb, call.req_fb].into_iter().flatten() {
                c.msgs.insert(fm, msg);
            }
        }
        self.next_msg += 1;
        self.calls.insert(msg, call);
        self.drain_fb_into(now, &mut frame);
        self.send_with_grant(now, &mut frame);
        self.pump(now);
        Ok(CallId(msg))
    }

    /// Send `frame`, chained after the window bind of a grant the owner
    /// engine just queued (one doorbell), or alone.
    fn send_with_grant(&mut self, now: Duration, frame: &mut Frame<'_>) {
        let mut sent = false;
        while let Some(a) = self.owner.as_mut().and_then(|o| o.engine.poll_action()) {
            let chained = !sent && matches!(a, mwcap_mw::OwnerAction::BindAndGrant(_));
            sent |= chained;
            self.owner_action(now, a, if chained { Some(&mut *frame) } else { None });
        }
        if !sent {
            if let Err(e) = self.send_frame(frame, None) {
                // The call or reply is committed: going down fails it with the
                // reason, and its buffer returns on the flush evidence.
                self.go_down(now, LossReason::Nic(e));
            }
        }
    }

    /// Everything that can refuse a call before it is registered.
    fn check_call(&self, header: &[u8], data: Option<&Buf>) -> Result<(), UseError> {
        self.ready_to_send(Role::Client, header)?;
        let Some(b) = data else { return Ok(()) };
        self.check_buf(b)?;
        if b.len == 0 {
            return Err(UseError::EmptyPayload);
        }
        match self.cfg.policies.request {
            Policy::Mw if self.owner.as_ref().map_or(0, |o| o.engine.free_windows()) == 0 => {
                Err(UseError::NoFreeWindow)
            }
            Policy::Confirm if !self.confirm.as_ref().is_some_and(|c| c.is_buffer_free(b.slot)) => {
                Err(UseError::BufferExposed(b.slot))
            }
            _ => Ok(()),
        }
    }

    /// Client: give up on a call. Its exposures end as the protocols allow
    /// (an mw window stays bound until the peer releases or it expires).
    pub fn cancel(&mut self, now: Duration, call: CallId) -> bool {
        self.now = now;
        let live = self.calls.contains_key(&call.0);
        if live {
            self.abandon_call(now, call.0, CallError::Cancelled);
            self.pump(now);
        }
        live
    }

    pub(super) fn abandon_call(&mut self, now: Duration, msg: u64, error: CallError) {
        let Some(call) = self.calls.remove(&msg) else { return };
        if let (Some(lease), Some(o)) = (call.req_lease, self.owner.as_mut()) {
            let _ = o.engine.cancel(now, lease);
        }
        if let Some(c) = self.confirm.as_mut().and_then(ConfirmEngine::client) {
            for fm in [call.req_fb, call.fetch_fb].into_iter().flatten() {
                c.cancel(now, fm);
            }
        }
        if let Data::Ready(slot, _) = call.data {
            self.bufs.hand(slot, Holder::User, Holder::Free);
        }
        self.events.push_back(Event::CallFailed { call: CallId(msg), error });
    }

    /// Server: answer `req` with `status`, `header` and optionally a payload
    /// the client will READ from `data` (it returns in an
    /// [`Event::BufferReturned`]).
    ///
    /// A refusal sends nothing, leaves the request waiting for a reply, and
    /// hands `data` back in [`Refused::data`].
    pub fn reply(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<(), Refused> {
        self.now = now;
        let fetch = match self.check_reply(req, header, data.as_ref()) {
            Ok(f) => f,
            Err(e) => return Err(Refused::new(e, data)),
        };
        let mut unexposed = false;
        match (&data, self.cfg.policies.reply) {
            (Some(b), Policy::Mw) => {
                let buffer = self.mw_buffer(b.slot, b.len);
                let owner = self.owner.as_mut().expect("mw reply policy has an owner engine");
                match owner.engine.grant(now, buffer, self.cfg.lease_time) {
                    Ok(lease) => {
                        owner.leases.insert(lease, b.slot);
                    }
                    Err(e) => return Err(Refused::new(lease_error(e), data)),
                }
            }
            (Some(b), Policy::Confirm) => {
                let c = self.confirm.as_mut().expect("confirm reply policy has a confirm engine");
                let id = c.bufs[b.slot as usize];
                let fbs = c.server().expect("a server's confirm engine is a server");
                match fetch.map(|fm| fbs.offer(now, fm, id, b.len)) {
                    Some(Ok(())) => {}
                    // The client's call ended (cancelled, timed out) and it
                    // said so: the reply goes without data, and the buffer,
                    // never exposed, comes straight back.
                    None | Some(Err(fb::UsageError::NotWanted(_))) => unexposed = true,
                    Some(Err(e)) => return Err(Refused::new(UseError::Confirm(e), data)),
                }
            }
            (None, _) => {
                if let (Some(fm), Some(c)) = (fetch, self.confirm.as_mut()) {
                    if let Some(fbs) = c.server() {
                        let _ = fbs.refuse(now, fm);
                    }
                    c.msgs.remove(&fm);
                }
            }
        }
        // Committed: nothing below refuses.
        match data {
            Some(b) if unexposed => self.events.push_back(Event::BufferReturned(b)),
            Some(b) => {
                self.bufs.hand(b.slot, Holder::User, Holder::Exposed);
                b.disarm(); // now the NIC's: its drop must not return it
            }
            None => {}
        }
        if let (Some(fm), Some(c)) = (fetch.filter(|_| unexposed), self.confirm.as_mut()) {
            c.msgs.remove(&fm);
        }
        let mut r = self.requests.remove(&req.0).expect("checked in check_reply");
        let mut frame = Frame::Reply { msg_id: req.0, status, header, attach: Attaches::new() };
        if let Some(rel) = r.release.take() {
            super::push_attach(&mut frame, super::mw_attach(&mwcap_mw::Message::Release(rel)));
        }
        self.drain_fb_into(now, &mut frame);
        self.send_with_grant(now, &mut frame);
        self.pump(now);
        Ok(())
    }

    /// Everything that can refuse a reply; returns the request's confirm fetch.
    fn check_reply(
        &self,
        req: RequestId,
        header: &[u8],
        data: Option<&Buf>,
    ) -> Result<Option<fb::MsgId>, UseError> {
        self.ready_to_send(Role::Server, header)?;
        let r = self.requests.get(&req.0).ok_or(UseError::NoSuchRequest(req.0))?;
        if !r.surfaced {
            return Err(UseError::NoSuchRequest(req.0));
        }
        let fetch = r.fetch_fb;
        if let Some(b) = data {
            self.check_buf(b)?;
            if b.len == 0 {
                return Err(UseError::EmptyPayload);
            }
            match self.cfg.policies.reply {
                Policy::Mw if self.owner.as_ref().map_or(0, |o| o.engine.free_windows()) == 0 => {
                    return Err(UseError::NoFreeWindow)
                }
                _ => {}
            }
        }
        Ok(fetch)
    }

    /// Take a confirm engine's queued messages into `frame`; READs are started.
    pub(super) fn drain_fb_into(&mut self, now: Duration, frame: &mut Frame<'_>) {
        while let Some(a) = self.confirm.as_mut().and_then(ConfirmEngine::poll_action) {
            self.fb_action(now, a, Some(frame));
        }
    }
}

/// An mw grant refusal as the user's error: a full window pool is plain
/// backpressure.
fn lease_error(e: mwcap_mw::GrantError) -> UseError {
    match e {
        mwcap_mw::GrantError::NoFreeWindow { .. } => UseError::NoFreeWindow,
        other => UseError::Lease(other),
    }
}
