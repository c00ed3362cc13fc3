//! Incoming frames and the engines' events.
//!
//! Everything here reads what the peer sent: a malformed frame, a message
//! for the wrong role, a replayed request id, or a grant for a direction that
//! does not use windows takes the connection down with
//! [`LossReason::PeerMisbehaved`]; nothing panics.

use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::super::frame::{grows_share, EngineTag, Frame, RawAttaches, Received};
use super::super::pool::Holder;
use super::*;

impl Connection {
    /// A SEND_WITH_INV received on another connection's queue pair
    /// invalidated `rkey`: if it is one of this connection's windows, that
    /// window has had its one invalidation (none is posted for it from now
    /// on) and the connection goes down (`InvalidatedElsewhere`), its
    /// buffers coming back at its QP's destroy. Returns whether it was one.
    pub(crate) fn window_invalidated_elsewhere(&mut self, now: Duration, rkey: u32) -> bool {
        let Some(o) = self.owner.as_mut() else { return false };
        if !o.engine.handle_invalidation_elsewhere(now, rkey) {
            return false;
        }
        tracing::warn!(rkey, "a window of this connection was invalidated through another queue pair");
        let now = self.advance(now);
        self.dirty = true;
        // Down with this reason before the engine's flush says "hostile peer".
        self.go_down(now, LossReason::LeaseEngine(mw::LossCause::InvalidatedElsewhere));
        self.pump(now);
        true
    }

    /// A frame from the peer came with SEND_WITH_INV of `rkey`, which the
    /// NIC has carried out, whatever else is wrong with the frame: only the
    /// owner invalidates, so the connection is over (the owner engine, if
    /// any, keeps the window's slot until the flush). One of another
    /// connection's windows: the endpoint told that connection when it
    /// polled the completion (`Hub::invalidations_found`).
    #[cold]
    #[inline(never)]
    pub(super) fn peer_invalidated(&mut self, now: Duration, rkey: u32) {
        if let Some(o) = self.owner.as_mut() {
            o.engine.handle_peer_invalidation(now, rkey);
        }
    }

    /// The peer broke the protocol: the connection goes down. (Cold: kept
    /// out of the receive path it is checked on.)
    #[cold]
    #[inline(never)]
    pub(super) fn misbehaved(&mut self, now: Duration, what: Misbehavior) {
        tracing::warn!(%what, "peer misbehaved");
        self.go_down(now, LossReason::PeerMisbehaved(what));
    }

    /// A frame arrived (`bytes`, decoded borrowing them), with the rkey a
    /// SEND_WITH_INV invalidated here.
    pub(super) fn on_recv(&mut self, now: Duration, bytes: &[u8], invalidated: Option<u32>) {
        self.stats.frames_received += 1;
        if let Some(rkey) = invalidated {
            self.peer_invalidated(now, rkey);
            return self.misbehaved(now, Misbehavior::SendWithInvalidate { rkey });
        }
        if self.down.is_some() {
            // Condemned, lost or closed, with the QP not yet in ERR (the
            // same poll batch): `go_down` ended every call and request, so
            // what comes after is not carried out. A request or redemption
            // would reach the application, or use up a token, after the
            // loss was reported; engine messages wait for the destroy.
            return;
        }
        // (Flow control and keepalive, which an idle peer sends too, do
        // not count: `Config::give_back_after`.)
        if grows_share(bytes) {
            self.last_frame_at = now;
        }
        match Frame::receive(bytes) {
            Ok((frame, credit)) => {
                // A peer that grants more than it posted only hurts itself
                // (its receive queue runs dry, RNR ends its connection).
                self.credits = self.credits.saturating_add(u32::from(credit));
                self.on_frame(now, frame)
            }
            Err(e) => self.misbehaved(now, Misbehavior::MalformedFrame(e)),
        }
    }

    fn on_frame(&mut self, now: Duration, frame: Received<'_>) {
        match (frame, self.role) {
            (Received::Request { msg_id, trace, header, inline, attach }, Role::Server) => {
                self.on_request(now, msg_id, trace, header, inline, attach, false)
            }
            (Received::Ask { msg_id, body, attach }, Role::Server) => {
                self.on_request(now, msg_id, None, body, &[], attach, true)
            }
            (Received::Reply { msg_id, status, header, inline, attach }, Role::Client) => {
                self.on_reply(now, msg_id, status, header, inline, attach)
            }
            (Received::Engine(engine, bytes), _) => self.on_attach(now, None, engine, bytes),
            (Received::Ping { seq }, _) => _ = self.send_frame(now, &Frame::Pong { seq }, None),
            (Received::Pong { seq }, _) => {
                // Only the pong of the outstanding ping answers it (see
                // `Config::keepalive`: what a ping proves); another is
                // stale or made up, and ignored.
                if self.ping.is_some_and(|(s, _)| s == seq) {
                    self.ping = None;
                    self.last_answer = Some(now);
                }
            }
            (Received::Credit, _) => {} // credit taken: see on_recv
            (Received::Busy { msg_id, limit }, Role::Client) => {
                self.abandon_call(now, msg_id, CallError::Busy { limit });
            }
            (Received::GiveBack { keep }, _) => self.give_back(now, keep),
            (Received::Returned { count }, _) => self.on_returned(now, count),
            (f, role) => self.misbehaved(now, Misbehavior::WrongFrame { role, got: f.name() }),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_request(
        &mut self,
        now: Duration,
        msg: u64,
        trace: Option<TraceId>,
        header: &[u8],
        inline: &[u8],
        attach: RawAttaches<'_>,
        redeem: bool,
    ) {
        let payloads = payloads(attach, inline);
        // A redemption carries its token only: no payload.
        if redeem && payloads > 0 {
            return self.misbehaved(now, Misbehavior::PayloadOnRedemption { msg });
        }
        if payloads > 1 {
            return self.misbehaved(now, Misbehavior::TooManyPayloads { msg, count: payloads });
        }
        if inline.len() > self.cfg.inline_max as usize {
            return self.inline_too_long(now, msg, inline.len());
        }
        if msg <= self.last_request {
            return self.misbehaved(now, Misbehavior::RequestIdReused { msg, last: self.last_request });
        }
        self.last_request = msg;
        if self.requests.len() >= self.cfg.max_requests as usize {
            return self.refuse_busy(now, msg, attach);
        }
        let span = tracing::debug_span!("mwcap.request", req = msg, trace = tracing::field::Empty);
        if let Some(t) = trace {
            span.record("trace", tracing::field::display(t));
        }
        tracing::debug!(parent: &span, header_len = header.len(), "request received");
        if attach.is_empty() && inline.is_empty() {
            // No payload, no fetch: the request surfaces at once (as
            // maybe_surface would), its header going straight into the
            // event (the request keeps none: only a confirm fetch needs it).
            let r = Request { surfaced: true, ..Request::new(span, trace, Header::default(), redeem) };
            self.requests.insert(msg, r);
            if redeem {
                let body = self.ask_body(header);
                return self.emit(Event::Ask { req: RequestId(msg), body, again: false });
            }
            let header = header.into();
            return self.emit(Event::Request {
                req: RequestId(msg),
                header,
                data: None,
                trace,
                delegated: false,
            });
        }
        let ask = if redeem { self.ask_body(header) } else { Vec::new() };
        let header = if redeem { Header::default() } else { header.into() };
        self.requests.insert(msg, Request { ask, ..Request::new(span, trace, header, redeem) });
        if !self.on_attaches(now, msg, attach) {
            return;
        }
        if !inline.is_empty() {
            if let Some(r) = self.requests.get_mut(&msg) {
                r.data = Data::Reading;
            }
            self.take_inline(msg, inline);
        }
        self.maybe_surface(msg);
    }

    /// An inline payload longer than our `inline_max` (a peer whose own
    /// is larger, or one that ignores it).
    #[cold]
    #[inline(never)]
    fn inline_too_long(&mut self, now: Duration, msg: u64, len: usize) {
        let max = self.cfg.inline_max;
        self.misbehaved(now, Misbehavior::InlineTooLong { msg, len: len as u32, max })
    }

    /// An inline payload for `msg` arrived: copy it into the smallest free
    /// buffer it fits (written into its memory at once), or keep it until one is
    /// free. Longer than every buffer: the payload fails.
    fn take_inline(&mut self, msg: u64, bytes: &[u8]) {
        let len = bytes.len() as u32;
        self.stats.inline_received += 1;
        let have = self.layout.largest();
        if len > have {
            return self.payload_done(msg, Data::Failed(PayloadError::TooLarge { len, have }));
        }
        match self.take_fit(len, Holder::User) {
            Some(slot) => {
                self.fill_slot(slot, bytes);
                self.payload_done(msg, Data::Ready(slot, len));
            }
            None => {
                let waiting = self.inline_waiting;
                let max = self.cfg.max_waiting_inline;
                if self.role == Role::Server && u64::from(waiting) + u64::from(len) > u64::from(max) {
                    let now = self.now;
                    return self.misbehaved(now, Misbehavior::TooMuchWaitingInline { waiting, len, max });
                }
                let start = self.inline_bytes.len();
                self.inline_bytes.extend_from_slice(bytes);
                self.inline_wait.push_back((msg, start as u32, len));
                self.inline_waiting += len;
            }
        }
    }

    /// Copy the inline payloads that waited into buffers now free, oldest
    /// first as far as buffers fit; drop those nobody waits for. Returns
    /// whether any moved.
    pub(super) fn retry_inline(&mut self) -> bool {
        let mut any = false;
        for _ in 0..self.inline_wait.len() {
            let Some((msg, start, len)) = self.inline_wait.pop_front() else { break };
            if !self.awaits_payload(msg) {
                self.inline_waiting -= len;
                any = true;
                continue;
            }
            match self.take_fit(len, Holder::User) {
                Some(slot) => {
                    self.inline_waiting -= len;
                    let (at, n) = (start as usize, len as usize);
                    self.fill_slot(slot, &self.inline_bytes[at..at + n]);
                    self.payload_done(msg, Data::Ready(slot, len));
                    any = true;
                }
                None => self.inline_wait.push_back((msg, start, len)),
            }
        }
        if self.inline_wait.is_empty() {
            self.inline_bytes.clear();
        } else if let Some(first) = self.inline_wait.iter().map(|e| e.1 as usize).min() {
            // Payloads keep waiting: drop the bytes of those gone, once they
            // are most of the arena.
            if first > 0 && first * 2 >= self.inline_bytes.len() {
                self.inline_bytes.drain(..first);
                for e in self.inline_wait.iter_mut() {
                    e.1 -= first as u32;
                }
            }
        }
        any
    }

    fn on_reply(
        &mut self,
        now: Duration,
        msg: u64,
        status: u8,
        header: &[u8],
        inline: &[u8],
        attach: RawAttaches<'_>,
    ) {
        let payloads = payloads(attach, inline);
        if payloads > 1 {
            return self.misbehaved(now, Misbehavior::TooManyPayloads { msg, count: payloads });
        }
        if inline.len() > self.cfg.inline_max as usize {
            return self.inline_too_long(now, msg, inline.len());
        }
        let carries_data = payloads > 0;
        if payloads == 0 && attach.is_empty() {
            // No payload and nothing else attached: a call that waited for
            // nothing but this reply is delivered at once (as maybe_finish
            // would), its header going straight into the event.
            if self.calls.get(&msg).is_some_and(|c| c.data == Data::Unknown) {
                let call = self.calls.remove(&msg).expect("present");
                tracing::debug!(parent: &call.span, status = Some(status), "reply delivered");
                let header = header.into();
                return self.emit(Event::Reply { call: CallId(msg), status, header, data: None });
            }
        }
        if !self.on_attaches(now, msg, attach) {
            return;
        }
        if let Some(call) = self.calls.get_mut(&msg) {
            call.reply = Some((status, header.into()));
            if call.data == Data::Unknown {
                call.data = if carries_data { Data::Reading } else { Data::Absent };
            }
            if !inline.is_empty() && !call.inline {
                // (An inline payload in a later reply to a call that had one
                // is dropped: a client's waiting inline payloads stay
                // within its calls, one each.)
                call.inline = true;
                self.take_inline(msg, inline);
            }
            self.maybe_finish(msg);
        }
    }

    /// The engine messages riding in a request or reply for `msg`, in
    /// order; false when one took the connection down (the rest are not
    /// read).
    #[inline(always)]
    pub(super) fn on_attaches(&mut self, now: Duration, msg: u64, attach: RawAttaches<'_>) -> bool {
        for (engine, bytes) in attach.iter() {
            self.on_attach(now, Some(msg), engine, bytes);
            if self.down.is_some() {
                return false;
            }
        }
        true
    }

    /// One engine message, riding in a request or reply for `msg`, or alone.
    pub(super) fn on_attach(&mut self, now: Duration, msg: Option<u64>, engine: EngineTag, bytes: &[u8]) {
        match engine {
            EngineTag::Mw => match mw::Message::decode(bytes) {
                Ok(mw::Message::Grant(g)) => self.on_grant(now, msg, g),
                Ok(mw::Message::Release(r)) => match self.owner.as_mut() {
                    Some(o) => o.engine.handle_release(now, r),
                    None => self.misbehaved(now, Misbehavior::WrongPolicy { what: "window release" }),
                },
                Err(e) => self.misbehaved(now, Misbehavior::MalformedLeaseMessage(e)),
            },
            EngineTag::Confirm => {
                let m = match fb::Message::decode(bytes) {
                    Ok((m, [])) => m,
                    Ok(_) => return self.misbehaved(now, Misbehavior::ConfirmTrailingBytes),
                    Err(e) => return self.misbehaved(now, Misbehavior::MalformedConfirmMessage(e)),
                };
                let Some(c) = self.confirm.as_mut() else {
                    return self.misbehaved(now, Misbehavior::WrongPolicy { what: "confirm message" });
                };
                let mut exposure = None;
                if let Some(msg) = msg {
                    match m {
                        fb::Message::Expose { msg: fm, .. } => {
                            // The payload of this direction goes under mw
                            // (the engine is here for the other): a READ
                            // of it would bypass the policy agreed.
                            let agreed = if self.role == Role::Server {
                                self.policies.request
                            } else {
                                self.policies.reply
                            };
                            if agreed != Policy::Confirm {
                                let what = "confirm exposure of a payload that goes under mw";
                                return self.misbehaved(now, Misbehavior::WrongPolicy { what });
                            }
                            match self.requests.get_mut(&msg) {
                                Some(r) => r.data = Data::Reading,
                                // A request refused unread (`refuse_busy`).
                                None if self.role == Role::Server => return,
                                None => {}
                            }
                            // An id in use names another request's exposure:
                            // that mapping stays (the engine ignores the reuse).
                            c.msgs.entry(fm).or_insert(msg);
                            exposure = Some((fm, msg));
                        }
                        // A first fetch asks for the reply payload of the
                        // request it rides on: one per request, under an id
                        // that names no other message. Anything else (a
                        // second one, a reused id, one sent to a client) is
                        // neither recorded nor handed to the engine, and
                        // that request's reply goes without a payload. A
                        // retry (attempt 2 on) names an earlier request's
                        // fetch, whatever it rides on: the engine maps it
                        // back (`ReplyWanted`).
                        fb::Message::Fetch { msg: fm, attempt } if attempt <= 1 => {
                            if self.policies.reply != Policy::Confirm {
                                // Replies go under mw: no confirm exposure
                                // would ever end what it kept.
                                return;
                            }
                            match self.requests.get_mut(&msg) {
                                Some(r) if r.fetch_fb.is_none() && !c.msgs.contains_key(&fm) => {
                                    r.fetch_fb = Some(fm);
                                    c.msgs.insert(fm, msg);
                                }
                                _ => return,
                            }
                        }
                        _ => {}
                    }
                }
                each!(&mut c.engine, e => e.handle_message(now, m));
                if let Some((fm, msg)) = exposure {
                    let ours = c.msgs.get(&fm) == Some(&msg);
                    if !(ours && c.server().is_some_and(|s| s.is_reading(fm))) {
                        // The engine refused the exposure (too long, too
                        // many outstanding) or ignored it (a reused id):
                        // nothing will ever be read for this request, so
                        // its payload fails now rather than never come.
                        if ours {
                            c.msgs.remove(&fm);
                        }
                        if let Some(r) = self.requests.get_mut(&msg) {
                            r.data = Data::Failed(PayloadError::Confirm(fb::ReadError::Refused));
                        }
                    }
                }
            }
        }
    }

    /// Client: deliver the call once both its reply and its data are in.
    fn maybe_finish(&mut self, msg: u64) {
        let Some(call) = self.calls.get(&msg) else { return };
        let ready =
            call.reply.is_some() && matches!(call.data, Data::Absent | Data::Ready(..) | Data::Failed(_));
        if !ready {
            return;
        }
        let call = self.calls.remove(&msg).expect("present");
        match &call.data {
            Data::Failed(why) => tracing::debug!(parent: &call.span, %why, "reply payload unreadable"),
            _ => {
                tracing::debug!(parent: &call.span, status = call.reply.as_ref().map(|r| r.0), "reply delivered")
            }
        }
        let (status, header) = call.reply.expect("checked");
        let ev = match call.data {
            Data::Ready(slot, len) => {
                Event::Reply { call: CallId(msg), status, header, data: Some(self.buf(slot, len)) }
            }
            Data::Failed(why) => Event::CallFailed { call: CallId(msg), error: CallError::Payload(why) },
            _ => Event::Reply { call: CallId(msg), status, header, data: None },
        };
        self.emit(ev);
    }

    /// Server: hand the request to the user once its payload is in.
    fn maybe_surface(&mut self, msg: u64) {
        let Some(r) = self.requests.get_mut(&msg) else { return };
        if r.surfaced {
            return;
        }
        let data = match &r.data {
            Data::Absent | Data::Unknown => None,
            Data::Ready(slot, len) => Some((*slot, *len)),
            Data::Reading => return,
            Data::Failed(why) => {
                let error = CallError::Payload(*why);
                if let Some(r) = self.requests.remove(&msg) {
                    tracing::debug!(parent: &r.span, %error, "request dropped");
                    if let Some(fm) = r.fetch_fb {
                        // Its reply will never be sent: the fetch it asked
                        // for is forgotten, so a "retry" of it cannot bring
                        // the request back, and nothing is kept for it.
                        self.forget_fetch(self.now, fm, msg);
                    }
                }
                self.emit(Event::RequestDropped { req: RequestId(msg), error });
                return;
            }
        };
        r.surfaced = true;
        let trace = r.trace;
        // Under confirm a client that reads a stale reply asks again, and
        // the request comes again: its header is kept for that (a copy of
        // at most 64 bytes, or a shared longer one: no allocation).
        let header = std::mem::take(&mut r.header);
        if r.fetch_fb.is_some() {
            r.header = header.clone();
        }
        if r.redeem {
            let body = std::mem::take(&mut r.ask);
            return self.emit(Event::Ask { req: RequestId(msg), body, again: false });
        }
        let data = data.map(|(s, l)| self.buf(s, l));
        self.emit(Event::Request { req: RequestId(msg), header, data, trace, delegated: false });
    }

    /// Whether `msg` (a request on a server, a call on a client) still waits
    /// for its payload.
    fn awaits_payload(&self, msg: u64) -> bool {
        let pending = |d: &Data| matches!(d, Data::Reading | Data::Unknown);
        match self.role {
            Role::Server => self.requests.get(&msg).is_some_and(|r| !r.surfaced && pending(&r.data)),
            Role::Client => self.calls.get(&msg).is_some_and(|c| pending(&c.data)),
        }
    }

    /// A payload for `msg` is resolved: on a server the request, on a
    /// client the call.
    pub(super) fn payload_done(&mut self, msg: u64, data: Data) {
        // A payload for a message that is gone, or whose payload is already
        // resolved, has nobody to go to: its buffer goes back to the pool.
        if self.role == Role::Server {
            match self.requests.get_mut(&msg) {
                Some(r) if !r.surfaced && matches!(r.data, Data::Reading | Data::Unknown) => r.data = data,
                _ => return self.drop_payload(data),
            }
            self.maybe_surface(msg);
        } else {
            match self.calls.get_mut(&msg) {
                Some(c) if matches!(c.data, Data::Reading | Data::Unknown) => c.data = data,
                _ => return self.drop_payload(data),
            }
            self.maybe_finish(msg);
        }
    }

    /// Nobody wants this payload any more: its buffer goes back to the pool.
    pub(super) fn drop_payload(&mut self, data: Data) {
        if let Data::Ready(slot, _) = data {
            self.bufs.hand(slot, Holder::User, Holder::Free);
        }
    }

    pub(super) fn owner_events(&mut self, now: Duration) -> bool {
        let mut any = false;
        while let Some(ev) = self.owner.as_mut().and_then(|o| o.engine.poll_event()) {
            any = true;
            match ev {
                mw::OwnerEvent::BufferReturned { lease, buffer, end, .. } => {
                    let slot = self.owner.as_mut().and_then(|o| o.leases.remove(&lease));
                    let slot = slot.or_else(|| self.slot_of_mw(&buffer));
                    if let Some(slot) = slot {
                        self.exposure_over(slot, buffer.len);
                    }
                    if end == mw::LeaseEnd::Unread && self.role == Role::Client {
                        self.request_unread(now, sides::Exposure::Lease(lease));
                    }
                }
                mw::OwnerEvent::ConnectionLost { cause } => {
                    self.go_down(now, LossReason::LeaseEngine(cause));
                }
                mw::OwnerEvent::PeerMisbehaved(mw::Misbehavior::SendWithInvalidate { rkey, .. }) => {
                    self.misbehaved(now, Misbehavior::SendWithInvalidate { rkey })
                }
                mw::OwnerEvent::PeerMisbehaved(m) => {
                    tracing::warn!(?m, "peer misbehaved");
                    self.go_down(now, LossReason::LeaseEngine(mw::LossCause::HostilePeer));
                }
                mw::OwnerEvent::WindowRetired { window } => {
                    // A window of the pool stays in `lent` until the endpoint
                    // deallocates it, before destroying the QP.
                    tracing::debug!(window, "window retired with its QP");
                }
                mw::OwnerEvent::WindowUnbound { lease, window } => {
                    // Unbound: back to the hub's pool, unless the endpoint
                    // already deallocated it (the connection went down).
                    if let Some(lent) = self.owner.as_mut().and_then(|o| o.lent.as_mut()) {
                        match lent.remove(&lease) {
                            Some(w) if w == window.handle => self.bufs.give_window(window, true),
                            Some(w) => {
                                debug_assert!(false, "lease {lease:?} had window {w}, not {}", window.handle);
                                lent.insert(lease, w);
                            }
                            None => {}
                        }
                    }
                }
            }
        }
        any
    }

    pub(super) fn reader_events(&mut self, now: Duration) -> bool {
        let mut any = false;
        while let Some(ev) = self.reader.as_mut().and_then(|r| r.engine.poll_event()) {
            any = true;
            match ev {
                mw::ReaderEvent::ReadDone { lease, dest, len, release } => {
                    self.stats.bytes_read += u64::from(len);
                    let slot = self.slot_of_mw(&dest);
                    let msg = self.reader.as_mut().and_then(|r| r.leases.remove(&lease));
                    if let Some(slot) = slot {
                        self.bufs.hand(slot, Holder::Reading, Holder::User);
                    }
                    if let (Some(rel), Some(msg)) = (release, msg) {
                        match self.requests.get_mut(&msg) {
                            Some(r) => r.release = Some(rel),
                            None => self.send_release(now, rel),
                        }
                    }
                    match (msg, slot) {
                        (Some(msg), Some(slot)) => self.payload_done(msg, Data::Ready(slot, len)),
                        (None, Some(slot)) => self.drop_payload(Data::Ready(slot, len)),
                        _ => {}
                    }
                }
                mw::ReaderEvent::Declined { lease, dest, reason, release } => {
                    if let Some(slot) = self.slot_of_mw(&dest) {
                        self.bufs.hand(slot, Holder::Reading, Holder::Free);
                    }
                    if let Some(rel) = release {
                        self.send_release(now, rel);
                    }
                    if let Some(msg) = self.reader.as_mut().and_then(|r| r.leases.remove(&lease)) {
                        self.payload_done(msg, Data::Failed(PayloadError::Declined(reason)));
                    }
                }
                mw::ReaderEvent::ReadTimedOut { lease } => {
                    tracing::warn!(?lease, "READ timed out; flushing the QP");
                }
                mw::ReaderEvent::ReadFailed { lease, dest, error } => {
                    if error == mw::ReadError::RemoteAccess {
                        self.stats.late_accesses += 1;
                    }
                    if let Some(slot) = self.slot_of_mw(&dest) {
                        self.bufs.hand(slot, Holder::Reading, Holder::Free);
                    }
                    if let Some(msg) = self.reader.as_mut().and_then(|r| r.leases.remove(&lease)) {
                        self.payload_done(msg, Data::Failed(PayloadError::ReadFailed(error)));
                    }
                }
                mw::ReaderEvent::ConnectionLost => {
                    self.go_down(now, LossReason::LeaseEngine(mw::LossCause::QpError))
                }
            }
        }
        any
    }

    /// A server's release that cannot ride on a reply goes alone.
    fn send_release(&mut self, now: Duration, rel: mw::Release) {
        if self.down.is_some() {
            return;
        }
        self.send_frame(now, &Frame::Engine(super::mw_attach(&mw::Message::Release(rel))), None);
    }
}

fn is_data_exposure(engine: EngineTag, bytes: &[u8]) -> bool {
    match engine {
        EngineTag::Mw => matches!(mw::Message::decode(bytes), Ok(mw::Message::Grant(_))),
        EngineTag::Confirm => matches!(
            fb::Message::decode(bytes),
            Ok((fb::Message::Offer { .. } | fb::Message::Expose { .. }, _))
        ),
    }
}

/// The payloads a request or reply carries: its grants, offers and
/// exposures, and its inline payload. It may carry at most one; more would
/// make the reader fill buffers nobody is handed.
fn payloads(attach: RawAttaches<'_>, inline: &[u8]) -> usize {
    attach.iter().filter(|&(e, b)| is_data_exposure(e, b)).count() + usize::from(!inline.is_empty())
}
