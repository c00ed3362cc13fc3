//! The user's operations: calls (client), replies (server), cancels.

use std::time::Duration;

use mwcap_fallback as fb;

use super::super::buf::Buf;
use super::super::config::*;
use super::super::frame::{Attaches, Frame, MAX_FRAME, MAX_HEADER};
use super::super::types::*;
use super::confirm::ConfirmEngine;
use super::sides::Exposure;
use super::{Call, Connection, Data};

/// The most bytes of ask bodies a connection keeps for the next asks
/// (`Connection::recycle_ask`): 13 of the longest (607 bytes), or 93 of
/// the 88-byte asks of a typical redemption.
const SPARE_ASK_BYTES: usize = 8 << 10;

impl Connection {
    fn ready_to_send(&self, role: Role, header: &[u8]) -> Result<(), UseError> {
        if self.role != role {
            return Err(UseError::WrongRole(self.role));
        }
        if let Some(r) = &self.down {
            return Err(UseError::Down(r.clone()));
        }
        if header.len() > MAX_HEADER {
            return Err(UseError::HeaderTooLong(header.len()));
        }
        self.send_capacity()
    }

    /// Client: send a request with `header` and, optionally, a payload the
    /// server will READ from `data` (which returns in an
    /// [`Event::BufferReturned`]). The reply comes as [`Event::Reply`] or
    /// [`Event::CallFailed`].
    ///
    /// A refusal sends nothing and hands `data` back in [`Refused::data`].
    #[cfg(any(test, feature = "testing"))]
    pub fn call(&mut self, now: Duration, header: &[u8], data: Option<Buf>) -> Result<CallId, Refused> {
        self.call_traced(now, None, header, data)
    }

    /// `Connection::call` (the tests') carrying the caller's trace id in the
    /// request frame: the call's span (`mwcap.call`) and the server's span
    /// for the request (`mwcap.request`) both record it.
    pub(crate) fn call_traced(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        data: Option<Buf>,
    ) -> Result<CallId, Refused> {
        self.start_call(now, trace, header, data, &[], false)
    }

    /// Client: a call whose request payload, `inline` (at most
    /// `Config::inline_max` bytes, with `header` fitting one frame), rides
    /// in the request frame: no window, READ or release. The I/O layer
    /// reads it out of the caller's buffer (the peer's limit: `Config::inline_max`).
    pub fn call_inline(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        inline: &[u8],
    ) -> Result<CallId, Refused> {
        self.start_call(now, trace, header, None, inline, false)
    }

    /// Client: a call whose request payload is `range` of a user region
    /// the I/O layer made known (`Connection::add_region`), exposed like a pool buffer (a
    /// window over exactly the range under mw, an exposure under confirm)
    /// until [`Event::RangeReturned`]. A refusal exposes nothing.
    pub(crate) fn call_region(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        range: RegionRange,
    ) -> Result<CallId, UseError> {
        let now = self.advance(now);
        self.settle(); // room for the frame's own messages (`settle`)
        let slot = self.take_range(range)?;
        let exposed = self
            .ready_to_send(Role::Client, header)
            .and_then(|()| self.expose_ready(slot))
            .and_then(|()| self.expose_call(now, Some((slot, range.len))));
        match exposed {
            Ok((fetch, req)) => Ok(self.commit_call(now, trace, header, fetch, req, range.len, &[], false)),
            Err(e) => {
                self.untake_range(slot);
                Err(self.counted(e))
            }
        }
    }

    /// Client: ask the owner's library (`conn/delegate.rs`): an ask frame
    /// carrying `body` (an encoded `OwnerAsk`), answered by the owner's
    /// library like a call (a redeemed range as the reply payload, a new
    /// token in the reply header, or a refusal status).
    pub(crate) fn call_ask(&mut self, now: Duration, body: &[u8]) -> Result<CallId, Refused> {
        self.start_call(now, None, body, None, &[], true)
    }

    /// An ask's body, in a vector from the spares.
    pub(super) fn ask_body(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut body = self.spare_asks.pop().unwrap_or_default();
        self.spare_ask_bytes -= body.capacity();
        body.clear();
        body.extend_from_slice(bytes);
        body
    }

    /// The body of an [`Event::Ask`], answered: kept for the next ask, if
    /// it is no longer than the longest ask but a call for a delegation.
    pub fn recycle_ask(&mut self, body: Vec<u8>) {
        // Asks are answered in the turn they arrive, so a connection holds
        // at most as many bodies at once as the peer may have frames in
        // flight (`ctrl_slots`): that many are kept, none larger than an
        // ask needs (a peer's long calls for a delegation leave no large
        // vectors behind), and at most `SPARE_ASK_BYTES` in all.
        if self.spare_asks.len() < self.cfg.ctrl_slots as usize
            && body.capacity() <= crate::conn::ask::ASK_ON_STACK
            && self.spare_ask_bytes + body.capacity() <= SPARE_ASK_BYTES
        {
            self.spare_ask_bytes += body.capacity();
            self.spare_asks.push(body);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_call(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        data: Option<Buf>,
        inline: &[u8],
        redeem: bool,
    ) -> Result<CallId, Refused> {
        let now = self.advance(now);
        self.settle(); // room for the frame's own messages (`settle`)
        let exposed = check_inline(header, inline, self.cfg.inline_max)
            .and_then(|()| self.check_call(header, data.as_ref()))
            .and_then(|()| self.expose_call(now, data.as_ref().map(|b| (b.slot, b.len))));
        let (fetch, req) = match exposed {
            Ok(e) => e,
            // The buffer goes back to the caller.
            Err(e) => return Err(Refused::new(self.counted(e), data)),
        };
        let data_len = data.as_ref().map_or(0, |b| b.len);
        if let Some(b) = data {
            b.disarm(); // now the NIC's: its drop must not return it
        }
        Ok(self.commit_call(now, trace, header, fetch, req, data_len, inline, redeem))
    }

    /// A call's exposures, once it may be sent: the fetch of its reply's
    /// payload (confirm) and the exposure of buffer `slot`'s first `len`
    /// bytes, if it has a payload; the fetch is unwound if the exposure
    /// fails.
    fn expose_call(
        &mut self,
        now: Duration,
        payload: Option<(u32, u32)>,
    ) -> Result<(Option<fb::MsgId>, Option<Exposure>), UseError> {
        let fetch = self.want_payload(now)?;
        let Some((slot, len)) = payload else { return Ok((fetch, None)) };
        match self.expose(now, slot, len, None, self.cfg.lease_time) {
            Ok(req) => Ok((fetch, req)),
            Err(why) => {
                if let Some(fm) = fetch {
                    self.unwant(now, fm, true);
                }
                Err(why)
            }
        }
    }

    /// `e`, counted as a wait for credit if it is one.
    fn counted(&mut self, e: UseError) -> UseError {
        if e == UseError::NoCredit {
            self.stats.credit_waits += 1;
        }
        e
    }

    /// Register a call whose payload is exposed (`req`) or inline, and send
    /// its request. Nothing here refuses: the call is committed.
    #[allow(clippy::too_many_arguments)]
    fn commit_call(
        &mut self,
        now: Duration,
        trace: Option<TraceId>,
        header: &[u8],
        fetch: Option<fb::MsgId>,
        req: Option<Exposure>,
        data_len: u32,
        inline: &[u8],
        redeem: bool,
    ) -> CallId {
        let msg = self.next_msg;
        self.next_msg += 1;
        if let Some(c) = self.confirm.as_mut() {
            let exposed = match req {
                Some(Exposure::Confirm(fm)) => Some(fm),
                _ => None,
            };
            for fm in [fetch, exposed].into_iter().flatten() {
                c.msgs.insert(fm, msg);
            }
        }
        let span = tracing::debug_span!("mwcap.call", call = msg, trace = tracing::field::Empty);
        if let Some(t) = trace {
            span.record("trace", tracing::field::display(t));
        }
        let data_len = data_len + inline.len() as u32;
        tracing::debug!(parent: &span, header_len = header.len(), payload = data_len, inline = !inline.is_empty(), "call sent");
        let call = Call {
            span,
            deadline: now + self.cfg.call_timeout,
            req,
            fetch_fb: fetch,
            reply: None,
            data: Data::Unknown,
            inline: false,
        };
        self.calls.insert(msg, call.deadline, call);
        self.stats.calls += 1;
        if !inline.is_empty() {
            self.stats.inline_sent += 1;
            self.stats.bytes_exposed += inline.len() as u64;
        }
        let mut frame = if redeem {
            Frame::Ask { msg_id: msg, body: header, attach: Attaches::new() }
        } else {
            Frame::Request { msg_id: msg, trace, header, inline, attach: Attaches::new() }
        };
        self.drain_fb_into(now, &mut frame);
        self.send_with_grant(now, &mut frame);
        self.pump(now);
        CallId(msg)
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
            // The call or reply is committed: a failure takes the connection
            // down, which fails it with the reason, and its buffer returns on
            // the evidence (the QP's destroy, after the flush).
            self.send_frame(now, frame, None);
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
        self.expose_ready(b.slot)
    }

    /// Client: give up on a call. Its exposures end as the protocols allow
    /// (an mw window stays bound until the peer releases or it expires).
    pub fn cancel(&mut self, now: Duration, call: CallId) -> bool {
        let now = self.advance(now);
        let live = self.calls.contains_key(&call.0);
        if live {
            self.abandon_call(now, call.0, CallError::Cancelled);
            self.pump(now);
        }
        live
    }

    /// Client: the server did not read the request payload exposed as
    /// `e` (under mw it declined the grant: a release marked unread;
    /// under confirm it refused the exposure) and so dropped the request:
    /// its call fails now, as `PayloadError::Unread`, rather than at its
    /// timeout. A scan of the calls, on this cold path only.
    #[cold]
    #[inline(never)]
    pub(super) fn request_unread(&mut self, now: Duration, e: super::sides::Exposure) {
        let call = self.calls.iter().find(|(_, c)| c.req == Some(e) && c.reply.is_none()).map(|(m, _)| *m);
        if let Some(m) = call {
            self.abandon_call(now, m, CallError::Payload(PayloadError::Unread));
        }
    }

    pub(super) fn abandon_call(&mut self, now: Duration, msg: u64, error: CallError) {
        let Some(call) = self.calls.remove(&msg) else { return };
        tracing::debug!(parent: &call.span, %error, "call failed");
        if let Some(e) = call.req {
            self.withdraw(now, e);
        }
        if let Some(fm) = call.fetch_fb {
            if let CallError::Busy { .. } = error {
                // Refused unread: the server kept nothing of the fetch.
                self.fetch_refused(now, fm);
            } else {
                self.unwant(now, fm, false);
            }
        }
        self.drop_payload(call.data);
        self.emit(Event::CallFailed { call: CallId(msg), error });
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
        self.send_reply(now, req, status, header, data, &[])
    }

    /// Server: a reply whose payload, `inline` (at most
    /// `Config::inline_max` bytes, with `header` fitting one frame), rides
    /// in the reply frame: no window, READ or release (see
    /// [`Connection::call_inline`]).
    pub fn reply_inline(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        inline: &[u8],
    ) -> Result<(), Refused> {
        self.send_reply(now, req, status, header, None, inline)
    }

    fn send_reply(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        data: Option<Buf>,
        inline: &[u8],
    ) -> Result<(), Refused> {
        let now = self.advance(now);
        self.settle(); // room for the frame's own messages (`settle`)
        let fetch = match check_inline(header, inline, self.cfg.inline_max)
            .and_then(|()| self.check_reply(req, header, data.as_ref()))
        {
            Ok(f) => f,
            Err(e) => return Err(Refused::new(self.counted(e), data)),
        };
        let exposed = match &data {
            Some(b) => match self.expose(now, b.slot, b.len, fetch, self.cfg.lease_time) {
                Ok(e) => e.is_some(),
                Err(e) => return Err(Refused::new(e, data)),
            },
            None => {
                if let (Some(fm), Some(c)) = (fetch, self.confirm.as_mut()) {
                    if let Some(fbs) = c.server() {
                        let _ = fbs.refuse(now, fm);
                    }
                }
                false
            }
        };
        // Committed: nothing below refuses.
        if let Some(b) = data {
            if exposed {
                b.disarm(); // now the NIC's: its drop must not return it
            } else {
                // The client withdrew its fetch: the reply goes without data,
                // and the buffer, never exposed, comes straight back.
                self.emit(Event::BufferReturned(b));
            }
        }
        self.commit_reply(now, req, status, header, fetch, exposed, inline);
        Ok(())
    }

    /// Server: answer `req` with `range` of a user region as the payload
    /// (see [`Connection::call_region`]); the range returns in an
    /// [`Event::RangeReturned`] (at once if the client no longer wants the
    /// payload). A refusal exposes nothing and leaves the request waiting.
    /// Under mw its window's lease is `lease` at most (the connection's
    /// `Config::lease_time` if longer): a delegation's exposure ends by
    /// its token's expiry. The exposure's number, if the range was
    /// exposed (not returned at once).
    pub(crate) fn reply_region(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        range: RegionRange,
        lease: Option<Duration>,
    ) -> Result<Option<u64>, UseError> {
        let lease = lease.map_or(self.cfg.lease_time, |l| l.min(self.cfg.lease_time));
        let now = self.advance(now);
        self.settle(); // room for the frame's own messages (`settle`)
        let fetch = self.check_reply(req, header, None).map_err(|e| self.counted(e))?;
        let slot = self.take_range(range)?;
        let exposed =
            match self.expose_ready(slot).and_then(|()| self.expose(now, slot, range.len, fetch, lease)) {
                Ok(e) => e.is_some(),
                Err(e) => {
                    self.untake_range(slot);
                    return Err(e);
                }
            };
        let exposure = self.exposure_number(slot);
        if !exposed {
            // The client withdrew its fetch: never exposed, back at once.
            self.untake_range(slot);
            self.emit(Event::RangeReturned { range, exposure });
        }
        self.commit_reply(now, req, status, header, fetch, exposed, &[]);
        Ok(exposed.then_some(exposure))
    }

    /// Send the reply to `req` (its payload exposed or not, or inline).
    /// Nothing here refuses: the reply is committed.
    #[allow(clippy::too_many_arguments)]
    fn commit_reply(
        &mut self,
        now: Duration,
        req: RequestId,
        status: u8,
        header: &[u8],
        fetch: Option<fb::MsgId>,
        exposed: bool,
        inline: &[u8],
    ) {
        if let (Some(fm), Some(c)) = (fetch.filter(|_| !exposed), self.confirm.as_mut()) {
            c.msgs.remove(&fm);
        }
        let mut r = self.requests.remove(&req.0).expect("checked in check_reply");
        tracing::debug!(parent: &r.span, status, exposed, "reply sent");
        self.stats.replies_sent += 1;
        if !inline.is_empty() {
            self.stats.inline_sent += 1;
            self.stats.bytes_exposed += inline.len() as u64;
        }
        let mut frame = Frame::Reply { msg_id: req.0, status, header, inline, attach: Attaches::new() };
        if let Some(rel) = r.release.take() {
            super::push_attach(&mut frame, super::mw_attach(&mwcap_mw::Message::Release(rel)));
        }
        self.drain_fb_into(now, &mut frame);
        self.send_with_grant(now, &mut frame);
        if let (Some(_), true, Some(c)) = (fetch, exposed, self.confirm.as_mut()) {
            // Offered under confirm: a stale read brings the request again
            // (see `ConfirmEngine::kept`).
            c.kept.insert(req.0, r);
        }
        self.pump(now);
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
            if self.owner.is_some() {
                self.expose_ready(b.slot)?;
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

/// Whether `inline` may ride in a frame with `header`: at most `max`
/// (`Config::inline_max`).
fn check_inline(header: &[u8], inline: &[u8], max: u32) -> Result<(), UseError> {
    let max = max.min(MAX_INLINE);
    if inline.len() > max as usize {
        return Err(UseError::TooLong { len: inline.len(), cap: max });
    }
    let room = MAX_FRAME - MAX_HEADER - 512; // version, ids, trace, attachments
    if !inline.is_empty() && header.len() + inline.len() > MAX_HEADER + room.min(MAX_INLINE as usize) {
        return Err(UseError::HeaderTooLong(header.len()));
    }
    Ok(())
}
