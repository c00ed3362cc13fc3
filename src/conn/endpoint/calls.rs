//! The user's operations: calls (client), replies (server), cancels.

use std::time::Duration;

use mwcap_fallback as fb;

use super::super::frame::{Attaches, Frame, MAX_HEADER};
use super::super::pool::Holder;
use super::super::types::*;
use super::{Call, Data, Endpoint};
use crate::backend::Nic;

impl<N: Nic> Endpoint<N> {
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
            let fbc = self.fbc.as_mut().expect("confirm reply policy has a client engine");
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
                    owner.grant(now, buffer, self.cfg.lease_time).map(|lease| call.req_lease = Some(lease)).map_err(lease_error)
                }
                Policy::Confirm => {
                    let id = self.fb_bufs[slot as usize];
                    let fbc = self.fbc.as_mut().expect("confirm request policy has a client engine");
                    fbc.send_request(now, id, b.len).map(|fm| call.req_fb = Some(fm)).map_err(UseError::Confirm)
                }
            };
            if let Err(why) = exposed {
                if let (Some(fm), Some(c)) = (call.fetch_fb, self.fbc.as_mut()) {
                    c.cancel(now, fm);
                    // The engine's cancellation notice is for no call of ours.
                    while c.poll_action().is_some() {}
                    while c.poll_event().is_some() {}
                }
                return Err(Refused::new(why, data));
            }
            self.bufs.hand(slot, Holder::User, Holder::Exposed);
            if let Some(lease) = call.req_lease {
                self.owner_leases.insert(lease, slot);
            }
        }
        if let Some(b) = data {
            b.disarm(); // now the NIC's: its drop must not return it
        }
        // Committed: the call is registered and nothing below refuses it.
        for fm in [call.fetch_fb, call.req_fb].into_iter().flatten() {
            self.fb_msgs.insert(fm, msg);
        }
        self.next_msg += 1;
        self.calls.insert(msg, call);
        if self.fbc.is_some() {
            self.drain_fb_into(now, true, &mut frame);
        }
        self.send_with_grant(now, &mut frame);
        self.pump(now);
        Ok(CallId(msg))
    }

    /// Send `frame`, chained after the window bind of a grant the owner
    /// engine just queued (one doorbell), or alone.
    fn send_with_grant(&mut self, now: Duration, frame: &mut Frame<'_>) {
        let mut sent = false;
        while let Some(a) = self.owner.as_mut().and_then(|o| o.poll_action()) {
            let chained = !sent && matches!(a, mwcap_mw::OwnerAction::BindAndGrant(_));
            sent |= chained;
            self.owner_action(now, a, if chained { Some(&mut *frame) } else { None });
        }
        if !sent {
            if let Err(e) = self.send_frame_with(now, frame, None) {
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
            Policy::Mw if self.owner.as_ref().map_or(0, |o| o.free_windows()) == 0 => {
                Err(UseError::NoFreeWindow)
            }
            Policy::Confirm
                if !self.fbc.as_ref().is_some_and(|c| c.is_buffer_free(self.fb_bufs[b.slot as usize])) =>
            {
                Err(UseError::BufferExposed(b.slot))
            }
            _ => Ok(()),
        }
    }

    /// Client: give up on a call. Its exposures end as the protocols allow
    /// (an mw window stays bound until the peer releases or it expires).
    pub fn cancel(&mut self, now: Duration, call: CallId) -> bool {
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
            let _ = o.cancel(now, lease);
        }
        if let Some(c) = self.fbc.as_mut() {
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
        let fetch = match self.check_reply(req, header, data.as_ref()) {
            Ok(f) => f,
            Err(e) => return Err(Refused::new(e, data)),
        };
        let mut unexposed = false;
        match (&data, self.cfg.policies.reply) {
            (Some(b), Policy::Mw) => {
                let buffer = self.mw_buffer(b.slot, b.len);
                let owner = self.owner.as_mut().expect("mw reply policy has an owner engine");
                match owner.grant(now, buffer, self.cfg.lease_time) {
                    Ok(lease) => {
                        self.owner_leases.insert(lease, b.slot);
                    }
                    Err(e) => return Err(Refused::new(lease_error(e), data)),
                }
            }
            (Some(b), Policy::Confirm) => {
                let id = self.fb_bufs[b.slot as usize];
                let fbs = self.fbs.as_mut().expect("confirm reply policy has a server engine");
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
                if let (Some(fm), Some(fbs)) = (fetch, self.fbs.as_mut()) {
                    let _ = fbs.refuse(now, fm);
                    self.fb_msgs.remove(&fm);
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
        if let Some(fm) = fetch.filter(|_| unexposed) {
            self.fb_msgs.remove(&fm);
        }
        let mut r = self.requests.remove(&req.0).expect("checked in check_reply");
        let mut frame = Frame::Reply { msg_id: req.0, status, header, attach: Attaches::new() };
        if let Some(rel) = r.release.take() {
            super::push_attach(&mut frame, super::mw_attach(&mwcap_mw::Message::Release(rel)));
        }
        if self.fbs.is_some() {
            self.drain_fb_into(now, false, &mut frame);
        }
        self.send_with_grant(now, &mut frame);
        self.pump(now);
        Ok(())
    }

    /// Everything that can refuse a reply; returns the request's confirm fetch.
    fn check_reply(&self, req: RequestId, header: &[u8], data: Option<&Buf>) -> Result<Option<fb::MsgId>, UseError> {
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
                Policy::Mw if self.owner.as_ref().map_or(0, |o| o.free_windows()) == 0 => {
                    return Err(UseError::NoFreeWindow)
                }
                _ => {}
            }
        }
        Ok(fetch)
    }

    /// Take a confirm engine's queued messages into `frame`; READs are started.
    pub(super) fn drain_fb_into(&mut self, now: Duration, client: bool, frame: &mut Frame<'_>) {
        loop {
            let a = if client {
                self.fbc.as_mut().and_then(fb::Client::poll_action)
            } else {
                self.fbs.as_mut().and_then(fb::Server::poll_action)
            };
            let Some(a) = a else { break };
            self.fb_action(now, client, a, Some(frame));
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
