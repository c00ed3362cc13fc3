//! A link's side of delegation (`conn/delegate.rs`): it answers a
//! delegate's redemption, and a holder's delegation on and revocation,
//! itself, from its endpoint's book, ends the
//! delegated exposures it makes on their evidence, and invalidates one at
//! once when its delegation is revoked. A holder's call for a delegation
//! goes to the application, and the application's reply with a range of a
//! region is delegated instead of exposed.

use std::sync::Arc;
use std::time::Duration;

use super::Link;
use crate::backend::Nic;
use crate::conn::ask::{OwnerAsk, CALL_DELEGATED, CALL_PLAIN, CALL_REFUSED};
use crate::conn::delegate::{CapId, Refusal};
use crate::conn::types::*;
use crate::conn::DelegateError;

/// A link's delegation state.
#[derive(Default)]
pub(crate) struct LinkDelegation {
    /// The name of the key the peer proved (`None`: no key, or no bootstrap).
    identity: Option<Arc<str>>,
    /// Delegations this connection exposes now, with their exposures'
    /// numbers (`Event::RangeReturned`): two of one range are told apart.
    live: Vec<(CapId, u64)>,
    /// Answers to redemptions that waited for a window, control slot or
    /// credit; retried at each of the link's turns.
    waiting: Vec<Answer>,
    /// The list `waiting` was in before its last retry, kept empty for the
    /// next (so retrying allocates nothing).
    retrying: Vec<Answer>,
    /// Requests whose callers asked for the reply's payload as a
    /// delegation (`OwnerAsk::Call`), until replied to: the identity to
    /// delegate to, and for how long.
    calls: Vec<(RequestId, Arc<str>, Duration)>,
}

/// What a redemption is answered with.
enum Answer {
    /// The delegated range, its window's lease ending at `expiry` (the
    /// token's) at the latest, however long the answer waits.
    Expose { req: RequestId, cap: CapId, range: RegionRange, expiry: Duration },
    /// Done: `status` and `header` (a holder's new delegation: its id and
    /// token; a refusal's words), no payload.
    Plain { req: RequestId, status: u8, header: Vec<u8> },
}

impl Answer {
    /// A refusal, in a status and words.
    fn refuse(req: RequestId, refusal: Refusal, message: String) -> Answer {
        Answer::Plain { req, status: refusal.status(), header: message.into_bytes() }
    }
}

impl LinkDelegation {
    /// Whether the link exposes a delegated range now.
    #[inline]
    pub(super) fn exposes(&self) -> bool {
        !self.live.is_empty()
    }

    /// Whether request `req` called for a delegation: where it is kept.
    #[inline]
    pub(super) fn call(&self, req: RequestId) -> Option<usize> {
        if self.calls.is_empty() {
            return None;
        }
        self.calls.iter().position(|&(r, ..)| r == req)
    }
}

impl<N: Nic> Link<N> {
    /// What request `req` asked for, if it is a call for a delegation
    /// waiting for its reply.
    #[cold]
    #[inline(never)]
    pub(crate) fn delegated_call(&self, req: RequestId) -> Option<crate::conn::DelegatedCall> {
        let (_, to, ttl) = &self.delegation.calls[self.delegation.call(req)?];
        Some(crate::conn::DelegatedCall { to: to.clone(), ttl: *ttl })
    }

    /// The identity the peer proved in the bootstrap (tokens name it).
    pub(crate) fn set_identity(&mut self, identity: Option<Arc<str>>) {
        self.delegation.identity = identity;
    }

    /// Delegate `range` of one of its regions to `identity` for `ttl` from
    /// `now` (the link's clock; see `Endpoint::delegate_region`).
    #[cfg(any(test, feature = "testing"))]
    pub fn delegate_region(
        &mut self,
        now: Duration,
        range: RegionRange,
        identity: &str,
        ttl: Duration,
    ) -> Result<crate::conn::Delegation, crate::conn::DelegateError> {
        self.regions.delegate(now, None, range, identity, ttl)
    }

    /// Revoke delegation `cap` (see `Endpoint::revoke`); a live exposure
    /// of it on this link ends at its next turn.
    #[cfg(any(test, feature = "testing"))]
    pub fn revoke(&mut self, cap: CapId) -> Result<(), crate::conn::RevokeError> {
        self.regions.revoke(cap)
    }

    /// Say which identity the peer proved (a link outside an endpoint has
    /// no bootstrap to learn it from).
    #[cfg(any(test, feature = "testing"))]
    pub fn set_peer_identity(&mut self, identity: &str) {
        self.set_identity(Some(identity.into()));
    }

    /// Client: ask the owner's library (`body`, an encoded [`OwnerAsk`]:
    /// see `Connection::redeem`, `delegate`, `revoke`).
    pub(crate) fn call_ask(&mut self, now: Duration, body: &[u8]) -> Result<CallId, Refused> {
        self.in_span(|c| c.call_ask(now, body))
    }

    /// A peer asks the owner's library (`body`, an [`OwnerAsk`]) with
    /// request `req`: a delegate redeems a token, a holder delegates a
    /// token made for it on, or revokes what it delegated (`again`: under
    /// confirm, the delegate's READ of the range it was answered with was
    /// stale). A holder's call for a delegation surfaces as the request it
    /// carries, for the application.
    #[cold]
    #[inline(never)]
    pub(super) fn ask(&mut self, e: Option<Event>) -> Option<Event> {
        let Some(Event::Ask { req, body, again }) = e else { return None };
        let surfaced = self.answer_ask(req, &body, again);
        self.conn.recycle_ask(body);
        surfaced
    }

    /// Answer ask `req` (`body`); a holder's call for a delegation is the
    /// request to surface.
    fn answer_ask(&mut self, req: RequestId, body: &[u8], again: bool) -> Option<Event> {
        let now = self.conn.now();
        let answer = match (again, OwnerAsk::decode(body)) {
            (true, _) => {
                let message = "the read of the delegated range was stale (the owner's hold ended before the \
                               delegate confirmed it), and a delegation is exposed once: ask its holder for \
                               a new token"
                    .to_owned();
                self.regions.count_refusal(Refusal::Stale);
                Answer::refuse(req, Refusal::Stale, message)
            }
            (false, Some(OwnerAsk::Redeem { token })) => self.redeem(now, req, token),
            (false, Some(OwnerAsk::DelegateOn { token, offset, len, ttl_ms, identity: to })) => {
                let identity = self.delegation.identity.clone();
                let ttl = Duration::from_millis(u64::from(ttl_ms));
                let conn = self.conn.id();
                match self.regions.delegate_on(now, conn, identity.as_deref(), token, (offset, len), to, ttl)
                {
                    Ok(d) => Answer::Plain {
                        req,
                        status: 0,
                        header: [&d.cap.0.to_le_bytes()[..], d.token.as_bytes()].concat(),
                    },
                    Err((refusal, message)) => {
                        tracing::info!(parent: &self.span, ?req, ?refusal, %message, "delegation on refused");
                        Answer::refuse(req, refusal, message)
                    }
                }
            }
            (false, Some(OwnerAsk::Revoke { cap })) => match self.regions.revoke_held(self.conn.id(), cap) {
                Ok(()) => Answer::Plain { req, status: 0, header: Vec::new() },
                Err((refusal, message)) => Answer::refuse(req, refusal, message),
            },
            (false, Some(OwnerAsk::Call { ttl_ms, identity, header })) => {
                let ttl = Duration::from_millis(u64::from(ttl_ms));
                match self.call_refusal(identity, ttl) {
                    None => {
                        self.delegation.calls.push((req, identity.into(), ttl));
                        let header = crate::conn::Header::from(header);
                        return Some(Event::Request {
                            req,
                            header,
                            data: None,
                            trace: None,
                            delegated: true,
                        });
                    }
                    Some((refusal, message)) => {
                        self.regions.count_refusal(refusal);
                        let header = [&[CALL_REFUSED][..], message.as_bytes()].concat();
                        Answer::Plain { req, status: refusal.status(), header }
                    }
                }
            }
            (false, None) => {
                self.regions.count_refusal(Refusal::Malformed);
                let message =
                    "an ask the owner does not know (its op or fields): is the peer running another \
                               version of mwcap?"
                        .to_owned();
                Answer::refuse(req, Refusal::Malformed, message)
            }
        };
        self.answer(now, answer);
        None
    }

    /// Why a call for a delegation to `to` for `ttl` is refused before
    /// the application sees it, if it is.
    fn call_refusal(&self, to: &str, ttl: Duration) -> Option<(Refusal, String)> {
        let lease = self.config().lease_time;
        if to.is_empty() || to.len() > crate::conn::MAX_IDENTITY {
            let message = format!(
                "a call for a delegation names an identity of 1 to {} bytes, not {}",
                crate::conn::MAX_IDENTITY,
                to.len()
            );
            return Some((Refusal::Malformed, message));
        }
        if ttl.is_zero() || ttl > lease {
            let message = format!(
                "a delegation of a reply for {ttl:?}: a reply's capability lasts at most the \
                 connection's lease_time ({lease:?}, the shorter of the two sides'), and a delegation \
                 needs some time: ask for no longer"
            );
            return Some((Refusal::OutsideCapability, message));
        }
        None
    }

    /// Server: the application replies with `data` to the call for a
    /// delegation kept at `i`: a buffer cannot be delegated (it lives in
    /// this connection's memory), and is handed back.
    #[cold]
    #[inline(never)]
    pub(super) fn reply_to_call(
        &mut self,
        now: Duration,
        i: usize,
        status: u8,
        header: &[u8],
        data: Option<crate::conn::Buf>,
    ) -> Result<(), Refused> {
        if data.is_some() {
            let req = self.delegation.calls[i].0;
            return Err(Refused::new(UseError::NotDelegable(req.0), data));
        }
        self.reply_delegated(now, i, status, header, None).map_err(|e| Refused::new(e, None))
    }

    /// Server: the application replies to `req`, the call for a delegation
    /// kept at `i`, with `status`, `header` and no payload, or with
    /// `range` of a region, which is delegated (not exposed) to the
    /// identity the caller named. The reply says which, before the
    /// application's header.
    #[cold]
    #[inline(never)]
    pub(super) fn reply_delegated(
        &mut self,
        now: Duration,
        i: usize,
        status: u8,
        header: &[u8],
        range: Option<RegionRange>,
    ) -> Result<(), UseError> {
        let (req, ref to, ttl) = self.delegation.calls[i];
        let (h, cap) = match range {
            None => ([&[CALL_PLAIN][..], header].concat(), None),
            Some(range) => {
                let conn = self.conn.id();
                let d = match self.regions.delegate(now, Some(conn), range, to, ttl) {
                    Ok(d) => d,
                    Err(DelegateError::Region(e)) => return Err(e),
                    // The identity and the life were checked when the call
                    // came (`call_refusal`); were they not, the caller is
                    // refused, never the owner's driver brought down.
                    Err(e) => {
                        self.delegation.calls.swap_remove(i);
                        self.regions.count_refusal(Refusal::Malformed);
                        let words = [&[CALL_REFUSED][..], e.to_string().as_bytes()].concat();
                        let r = self.conn.reply(now, req, Refusal::Malformed.status(), &words, None);
                        self.run();
                        return r.map_err(|r| r.error);
                    }
                };
                let token = d.token.as_bytes();
                let len = u16::try_from(token.len()).expect("a token is short").to_le_bytes();
                let h = [&[CALL_DELEGATED][..], &d.cap.0.to_le_bytes(), &len, token, header].concat();
                (h, Some(d.cap))
            }
        };
        let r = self.conn.reply(now, req, status, &h, None).map_err(|r| r.error);
        // Answered, or the request is gone (no answer can be sent): it is
        // no longer a call waiting for its reply.
        if matches!(r, Ok(()) | Err(UseError::NoSuchRequest(_) | UseError::Down(_))) {
            self.delegation.calls.swap_remove(i);
        }
        // Not sent: no token of it is out. It is revoked, which unpins its
        // range; a retry delegates anew.
        if let (Err(_), Some(cap)) = (&r, cap) {
            let _ = self.regions.revoke(cap);
        }
        self.run();
        r
    }

    /// A delegate redeems `token` with request `req`.
    fn redeem(&mut self, now: Duration, req: RequestId, token: &[u8]) -> Answer {
        let identity = self.delegation.identity.clone();
        let policy = crate::telemetry::own_policy(self.conn.policies(), self.conn.role());
        let margin = self.config().safety_margin;
        match self.regions.redeem(now, self.conn.id(), identity.as_deref(), token, policy) {
            Ok((cap, _, lease)) if lease <= margin => self.expired(req, cap, lease),
            Ok((cap, range, lease)) => Answer::Expose { req, cap, range, expiry: now + lease },
            Err((refusal, message)) => {
                tracing::info!(parent: &self.span, ?req, ?refusal, %message, "redemption refused");
                Answer::refuse(req, refusal, message)
            }
        }
    }

    /// Too little of the token's life (`left`) is left for a READ: the
    /// delegate would decline the grant (its safety margin) and learn
    /// nothing it can match. Expired, as it is in a moment; the range is
    /// the owner's again.
    fn expired(&mut self, req: RequestId, cap: CapId, left: Duration) -> Answer {
        let margin = self.config().safety_margin;
        self.regions.delegation_ended(cap);
        self.regions.count_refusal(Refusal::Expired);
        let message = format!(
            "the token expires in {left:?}, within the {margin:?} safety margin a read of it \
             needs: ask its holder for a new token, or delegate with a longer ttl"
        );
        Answer::refuse(req, Refusal::Expired, message)
    }

    /// Send `a`, or keep it for a later turn while capacity lacks.
    fn answer(&mut self, now: Duration, a: Answer) {
        let r = match &a {
            Answer::Expose { req, cap, range, expiry } => {
                // It may have waited for capacity: what is left of the token.
                let left = expiry.saturating_sub(now);
                if left <= self.config().safety_margin {
                    let refusal = self.expired(*req, *cap, left);
                    return self.answer(now, refusal);
                }
                self.reply_region(now, *req, 0, &[], *range, Some(left))
            }
            Answer::Plain { req, status, header } => {
                self.reply(now, *req, *status, header, None).map(|()| None).map_err(|r| r.error)
            }
        };
        match (r, a) {
            (Ok(Some(exposure)), Answer::Expose { cap, .. }) => self.delegation.live.push((cap, exposure)),
            // The delegate no longer wanted it: the range came back at once.
            (Ok(None), Answer::Expose { cap, .. }) => self.regions.delegation_ended(cap),
            (Ok(_), Answer::Plain { .. }) => {}
            (Err(UseError::NoFreeWindow | UseError::NoCtrlSlot | UseError::NoCredit), a) => {
                self.delegation.waiting.push(a)
            }
            (Err(e), Answer::Expose { req, cap, .. }) => {
                // Nothing was exposed: the delegation's one exposure is over.
                self.regions.delegation_ended(cap);
                self.regions.count_refusal(Refusal::Unavailable);
                let message = format!("the owner could not expose the delegated range: {e}");
                self.answer(now, Answer::refuse(req, Refusal::Unavailable, message));
            }
            (Err(e), Answer::Plain { req, .. }) => {
                // The request is gone (the connection is down): nothing to answer.
                tracing::debug!(parent: &self.span, ?req, %e, "a redemption's refusal was not sent");
            }
        }
    }

    /// When an answer waiting for capacity must be refused as expired (its
    /// token's expiry less the safety margin), if one waits: the link's
    /// `poll_timeout` includes it, so a turn refuses it then and its range
    /// is the owner's again, capacity or not.
    #[cold]
    #[inline(never)]
    fn waiting_expires_at(&self) -> Option<Duration> {
        let margin = self.config().safety_margin;
        self.delegation
            .waiting
            .iter()
            .filter_map(|a| match a {
                Answer::Expose { expiry, .. } => Some(expiry.saturating_sub(margin)),
                _ => None,
            })
            .min()
    }

    /// [`Connection::poll_timeout`](super::proto::Connection::poll_timeout),
    /// and the expiry of an answer to a redemption waiting for capacity.
    #[inline]
    pub fn poll_timeout(&self) -> Option<Duration> {
        let t = self.conn.poll_timeout();
        if self.delegation.waiting.is_empty() {
            return t;
        }
        match (t, self.waiting_expires_at()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether answers to redemptions wait for capacity.
    #[cfg_attr(loom, allow(dead_code))]
    pub(super) fn answers_waiting(&self) -> bool {
        !self.delegation.waiting.is_empty()
    }

    /// Once per turn of the link (its driver's, or `Link::drive`'s in tests),
    /// after its completions: retry the answers waiting for capacity, and
    /// end this connection's revoked delegated exposures (a revocation
    /// rings the connection for a turn). Two loads when it has neither.
    #[inline]
    pub(crate) fn delegation_turn(&mut self) {
        if !self.delegation.live.is_empty() || !self.delegation.waiting.is_empty() {
            self.delegation_work();
        }
    }

    /// End revoked exposures of this connection; retry waiting answers.
    #[inline(never)]
    fn delegation_work(&mut self) {
        let now = self.conn.now();
        if self.regions.ends_due() {
            for (range, cap) in self.regions.take_ends(self.conn.id()) {
                // Revoked while its answer waited for capacity: refused,
                // never exposed (taking its end here and exposing it on
                // the retry below would leave it live until its lease).
                let waiting = self
                    .delegation
                    .waiting
                    .iter()
                    .position(|a| matches!(a, Answer::Expose { cap: c, .. } if *c == cap));
                if let Some(Answer::Expose { req, .. }) = waiting.map(|i| self.delegation.waiting.remove(i)) {
                    self.regions.delegation_ended(cap);
                    let message = format!("delegation {} was revoked before it could be exposed", cap.0);
                    self.answer(now, Answer::refuse(req, Refusal::Revoked, message));
                    continue;
                }
                // Its own exposure: another delegation of the same range
                // may be live on this connection too.
                let exposure = self.delegation.live.iter().find(|&&(c, _)| c == cap).map(|&(_, e)| e);
                let conn = &mut self.conn;
                let revoked = exposure.is_some_and(|e| self.span.in_scope(|| conn.revoke_exposure(now, e)));
                tracing::debug!(parent: &self.span, ?range, revoked, "a delegated exposure was revoked");
            }
        }
        // An answer that still finds no capacity waits again, in the
        // other list.
        let spare = std::mem::take(&mut self.delegation.retrying);
        let mut retry = std::mem::replace(&mut self.delegation.waiting, spare);
        for a in retry.drain(..) {
            self.answer(now, a);
        }
        self.delegation.retrying = retry;
    }

    /// Exposure number `exposure` of a user range ended on evidence: if it
    /// was a delegation's, the book hears of it.
    #[inline(never)]
    pub(super) fn delegated_range_returned(&mut self, exposure: u64) {
        if let Some(i) = self.delegation.live.iter().position(|&(_, e)| e == exposure) {
            let (cap, _) = self.delegation.live.swap_remove(i);
            self.regions.delegation_ended(cap);
        }
    }

    /// The QP is destroyed: no delegated exposure of it can be read, and
    /// none waiting to be answered will be made.
    pub(super) fn delegations_gone(&mut self) {
        for (cap, _) in self.delegation.live.drain(..) {
            self.regions.delegation_ended(cap);
        }
        for a in self.delegation.waiting.drain(..) {
            if let Answer::Expose { cap, .. } = a {
                self.regions.delegation_ended(cap);
            }
        }
    }
}
