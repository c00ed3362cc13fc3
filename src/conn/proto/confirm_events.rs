//! The connection's side of the confirm engine's events: payloads read
//! and verified or discarded, fetches wanted (a request again after a
//! stale read), offers ended, and the bookkeeping of fetch ids.

use std::time::Duration;

use mwcap_fallback as fb;

use super::confirm::ConfirmEngine;
use super::*;

impl Connection {
    /// Carry out what the confirm engine reported since the last call;
    /// whether there was anything.
    pub(super) fn fb_events(&mut self, now: Duration) -> bool {
        let mut any = false;
        let Some(c) = self.confirm.as_mut() else { return false };
        // Expired offers' entries outlive any retry of the client's fetch
        // (which ends within the call timeout) and then go.
        while let Some(&(msg, at)) = c.expired.front() {
            if now < at + self.cfg.call_timeout {
                break;
            }
            c.expired.pop_front();
            if !self.requests.values().any(|r| r.fetch_fb == Some(msg)) {
                if let Some(m) = c.msgs.remove(&msg) {
                    c.kept.remove(&m);
                }
            }
        }
        while let Some(ev) = self.confirm.as_mut().and_then(|c| each!(&mut c.engine, e => e.poll_event())) {
            any = true;
            match ev {
                fb::Event::ReadVerified { msg, token, len } => {
                    self.stats.bytes_read += u64::from(len);
                    let slot = self.cf().reads.remove(&token.raw());
                    if let Some(slot) = slot {
                        self.bufs.hand(slot, Holder::Reading, Holder::User);
                    }
                    // The read side of `msg` is over (a fetch's reply, or an
                    // exposed request's data).
                    match (self.cf().msgs.remove(&msg), slot) {
                        (Some(m), Some(slot)) => self.payload_done(m, Data::Ready(slot, len)),
                        (None, Some(slot)) => self.drop_payload(Data::Ready(slot, len)),
                        _ => {}
                    }
                }
                fb::Event::ReadDiscarded { token } => {
                    self.stats.stale_reads += 1;
                    if let Some(slot) = self.cf().reads.remove(&token.raw()) {
                        self.bufs.hand(slot, Holder::Reading, Holder::Free);
                    }
                }
                fb::Event::ReadFailed { msg, error } => {
                    if let Some(m) = self.cf().msgs.remove(&msg) {
                        // A reply without data, or with its data inline,
                        // refuses the client's fetch: no failure.
                        let refused_without_data = error == fb::ReadError::Refused
                            && self.calls.get(&m).is_some_and(|c| c.data == Data::Absent || c.inline);
                        if !refused_without_data {
                            self.payload_done(m, Data::Failed(PayloadError::Confirm(error)));
                        }
                    }
                }
                fb::Event::ReplyWanted { msg, attempt } => {
                    let Some(m) = self.cf().msgs.get(&msg).copied() else { continue };
                    if attempt > 1 {
                        self.reply_wanted_again(now, msg, m, attempt);
                    } else if let Some(r) = self.requests.get_mut(&m) {
                        r.fetch_fb = Some(msg);
                    }
                }
                fb::Event::BufferFree { buffer, msg, reason } => {
                    // The owner side of `msg` is over. On a client that ends
                    // an exposed request; on a server an offer ends it unless
                    // the client may ask again after a stale read (the hold
                    // expired, or was withdrawn: a revoked delegation), in
                    // which case the entry lives until the client's fetch
                    // is over (pruned by age).
                    if reason == fb::Release::Expired {
                        self.stats.expiries += 1;
                    }
                    let may_ask_again = matches!(reason, fb::Release::Expired | fb::Release::Withdrawn);
                    if self.role == Role::Client || !may_ask_again {
                        if let Some(m) = self.cf().msgs.remove(&msg) {
                            self.cf().kept.remove(&m);
                        }
                    } else {
                        self.cf().expired.push_back((msg, now));
                    }
                    if let Some(slot) = self.cf().slot_of.get(&buffer).copied() {
                        self.exposure_over(slot, 0);
                    }
                    if reason == fb::Release::Refused && self.role == Role::Client {
                        // The server did not read the request's payload.
                        self.request_unread(now, super::sides::Exposure::Confirm(msg));
                    }
                }
            }
        }
        any
    }

    /// The confirm engine, for its own events (which only it makes).
    fn cf(&mut self) -> &mut ConfirmEngine {
        self.confirm.as_mut().expect("confirm events come from the confirm engine")
    }

    /// Server: a retry (`attempt` > 1) of fetch `msg`, which maps to
    /// request `m`: the client read a stale reply and needs it again.
    #[cold]
    fn reply_wanted_again(&mut self, now: Duration, msg: fb::MsgId, m: u64, attempt: u32) {
        if self.requests.contains_key(&m) {
            // A retry names a request not yet answered (a stale fetch id
            // the engine took for another's): no stale read of it can have
            // happened. The live request stays as it is.
            tracing::debug!(req = m, attempt, "a fetch retry for a request not yet answered, ignored");
            return;
        }
        let Some(kept) = self.cf().kept.get(&m).filter(|r| attempt > r.attempt) else {
            // No reply of it was offered under confirm (so none was read
            // stale), or this retry is not a later attempt than the one it
            // answered (a replay): the request does not come again. Only
            // the engine's wanted entry goes; the mapping and the kept
            // reply stay for the offer that is still out.
            tracing::debug!(req = m, attempt, "a fetch retry with no stale reply to redo, ignored");
            if let Some(s) = self.cf().server() {
                let _ = s.forget_wanted(now, msg);
            }
            return;
        };
        let redeem = kept.redeem;
        if self.requests.len() >= self.cfg.max_requests as usize {
            // Asked again while `max_requests` are unanswered: refused
            // like a new request. The `Busy` answer ends the client's
            // fetch (`fetch_refused`).
            self.stats.requests_busy += 1;
            self.forget_fetch(now, msg, m);
            self.answer_busy(now, m);
            return;
        }
        // The request comes again as it came.
        let Some(kept) = self.cf().kept.remove(&m) else { return };
        let (header, trace) = (kept.header, kept.trace);
        let span = tracing::debug_span!("mwcap.request", req = m, attempt);
        let r = Request::new(span, trace, header.clone(), redeem);
        self.requests.insert(m, Request { fetch_fb: Some(msg), attempt, surfaced: true, ..r });
        if redeem {
            // The I/O layer answers it (its read was stale). Refused as
            // stale, its body unread.
            self.emit(Event::Ask { req: RequestId(m), body: Vec::new(), again: true });
        } else {
            self.emit(Event::ReplyAgain { req: RequestId(m), header, trace });
        }
    }

    /// Server: fetch `fm` of request `m` will not bring the request back
    /// (the request was dropped unanswered, or its retry refused busy):
    /// the fetch's mapping, the reply kept for it and the engine's wanted
    /// entry go.
    #[cold]
    pub(super) fn forget_fetch(&mut self, now: Duration, fm: fb::MsgId, m: u64) {
        let Some(c) = self.confirm.as_mut() else { return };
        if c.msgs.get(&fm) == Some(&m) {
            c.msgs.remove(&fm);
        }
        c.kept.remove(&m);
        if let Some(s) = c.server() {
            let _ = s.forget_wanted(now, fm);
        }
    }
}
