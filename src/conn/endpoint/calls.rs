//! The user's operations: calls (client), replies (server), cancels.

use std::time::Duration;

use mwcap_fallback as fb;

use super::super::frame::{Attach, EngineTag, Frame, MAX_HEADER};
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
    pub fn call(&mut self, now: Duration, header: &[u8], data: Option<Buf>) -> Result<CallId, UseError> {
        self.ready_to_send(Role::Client, header)?;
        if let Some(b) = &data {
            self.check_buf(b)?;
            if b.len == 0 {
                return Err(UseError::TooLong { len: 0, cap: self.cfg.buffer_size });
            }
        }
        let msg = self.next_msg;
        let mut frame = Frame::Request { msg_id: msg, header: header.to_vec(), attach: Vec::new() };
        let mut call = Call {
            deadline: now + self.cfg.call_timeout,
            req_lease: None,
            req_fb: None,
            fetch_fb: None,
            reply: None,
            data: Data::Unknown,
        };
        // Check that the payload can be exposed before anything is queued.
        if let Some(b) = &data {
            match self.cfg.policies.request {
                Policy::Mw => {
                    let free = self.owner.as_ref().map_or(0, |o| o.free_windows());
                    if free == 0 {
                        return Err(UseError::Busy("every memory window is leased".into()));
                    }
                }
                Policy::Confirm => {
                    let id = self.fb_bufs[b.slot as usize];
                    if !self.fbc.as_ref().is_some_and(|c| c.is_buffer_free(id)) {
                        return Err(UseError::Busy(format!("buffer {} is still exposed", b.slot)));
                    }
                }
            }
        }
        self.next_msg += 1;
        if self.cfg.policies.reply == Policy::Confirm {
            let fbc = self.fbc.as_mut().expect("confirm reply policy has a client engine");
            match fbc.fetch(now, self.cfg.buffer_size) {
                Ok(fm) => {
                    call.fetch_fb = Some(fm);
                    self.fb_msgs.insert(fm, msg);
                    self.drain_fb_into(now, true, &mut frame);
                }
                Err(e) => return Err(UseError::Busy(e.to_string())),
            }
        }
        match data {
            None => {
                self.calls.insert(msg, call);
                self.send_frame_with(now, &frame, None)?;
            }
            Some(b) => {
                let slot = b.slot;
                self.bufs.hand(slot, Holder::User, Holder::Exposed);
                match self.cfg.policies.request {
                    Policy::Mw => {
                        let buffer = self.mw_buffer(slot, b.len);
                        let owner = self.owner.as_mut().expect("mw request policy has an owner engine");
                        match owner.grant(now, buffer, self.cfg.lease_time) {
                            Ok(lease) => {
                                call.req_lease = Some(lease);
                                self.owner_leases.insert(lease, slot);
                            }
                            Err(e) => {
                                self.bufs.hand(slot, Holder::Exposed, Holder::User);
                                return Err(UseError::Busy(e.to_string()));
                            }
                        }
                        self.calls.insert(msg, call);
                        // The grant's BindAndGrant goes out chained with this request.
                        while let Some(a) = self.owner.as_mut().and_then(|o| o.poll_action()) {
                            let chained = matches!(a, mwcap_mw::OwnerAction::BindAndGrant(_));
                            self.owner_action(now, a, if chained { Some(&mut frame) } else { None });
                        }
                    }
                    Policy::Confirm => {
                        let id = self.fb_bufs[slot as usize];
                        let fbc = self.fbc.as_mut().expect("confirm request policy has a client engine");
                        match fbc.send_request(now, id, b.len) {
                            Ok(fm) => {
                                call.req_fb = Some(fm);
                                self.fb_msgs.insert(fm, msg);
                            }
                            Err(e) => {
                                self.bufs.hand(slot, Holder::Exposed, Holder::User);
                                return Err(UseError::Busy(e.to_string()));
                            }
                        }
                        self.drain_fb_into(now, true, &mut frame);
                        self.calls.insert(msg, call);
                        self.send_frame_with(now, &frame, None)?;
                    }
                }
            }
        }
        self.pump(now);
        Ok(CallId(msg))
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
    pub fn reply(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<(), UseError> {
        self.ready_to_send(Role::Server, header)?;
        let r = self.requests.get(&req.0).ok_or(UseError::NoSuchRequest(req.0))?;
        if !r.surfaced {
            return Err(UseError::NoSuchRequest(req.0));
        }
        let fetch = r.fetch_fb;
        if let Some(b) = &data {
            self.check_buf(b)?;
            if b.len == 0 {
                return Err(UseError::TooLong { len: 0, cap: self.cfg.buffer_size });
            }
            match self.cfg.policies.reply {
                Policy::Mw if self.owner.as_ref().map_or(0, |o| o.free_windows()) == 0 => {
                    return Err(UseError::Busy("every memory window is leased".into()))
                }
                Policy::Confirm if fetch.is_none() => {
                    return Err(UseError::Busy("the client did not ask for reply data".into()))
                }
                _ => {}
            }
        }
        let mut r = self.requests.remove(&req.0).expect("checked above");
        let mut frame = Frame::Reply { msg_id: req.0, status, header: header.to_vec(), attach: Vec::new() };
        if let Some(rel) = r.release.take() {
            let mut bytes = Vec::new();
            mwcap_mw::Message::Release(rel).encode(&mut bytes);
            super::push_attach(&mut frame, Attach { engine: EngineTag::Mw, bytes });
        }
        if let Data::Ready(slot, _) = r.data {
            // The request payload buffer was the user's (delivered with the
            // request); the reply ends the request, so it stays theirs.
            let _ = slot;
        }
        match (data, self.cfg.policies.reply) {
            (Some(b), Policy::Mw) => {
                let slot = b.slot;
                self.bufs.hand(slot, Holder::User, Holder::Exposed);
                let buffer = self.mw_buffer(slot, b.len);
                let owner = self.owner.as_mut().expect("mw reply policy has an owner engine");
                match owner.grant(now, buffer, self.cfg.lease_time) {
                    Ok(lease) => {
                        self.owner_leases.insert(lease, slot);
                    }
                    Err(e) => {
                        self.bufs.hand(slot, Holder::Exposed, Holder::User);
                        self.requests.insert(req.0, r);
                        return Err(UseError::Busy(e.to_string()));
                    }
                }
                while let Some(a) = self.owner.as_mut().and_then(|o| o.poll_action()) {
                    let chained = matches!(a, mwcap_mw::OwnerAction::BindAndGrant(_));
                    self.owner_action(now, a, if chained { Some(&mut frame) } else { None });
                }
            }
            (Some(b), Policy::Confirm) => {
                let fm = fetch.expect("checked above");
                let id = self.fb_bufs[b.slot as usize];
                let fbs = self.fbs.as_mut().expect("confirm reply policy has a server engine");
                if let Err(e) = fbs.offer(now, fm, id, b.len) {
                    self.requests.insert(req.0, r);
                    return Err(UseError::Busy(e.to_string()));
                }
                self.bufs.hand(b.slot, Holder::User, Holder::Exposed);
                self.drain_fb_into(now, false, &mut frame);
                self.send_frame_with(now, &frame, None)?;
            }
            (None, _) => {
                if let (Some(fm), Some(fbs)) = (fetch, self.fbs.as_mut()) {
                    let _ = fbs.refuse(now, fm);
                    self.drain_fb_into(now, false, &mut frame);
                }
                self.send_frame_with(now, &frame, None)?;
            }
        }
        self.pump(now);
        Ok(())
    }

    /// Take a confirm engine's queued messages into `frame`; READs are started.
    pub(super) fn drain_fb_into(&mut self, now: Duration, client: bool, frame: &mut Frame) {
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
