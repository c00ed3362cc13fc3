//! A connection's part in its endpoint's regions (`conn/regions.rs`) and
//! in their delegations (`conn/delegate.rs`).

use std::time::Duration;

use super::super::ask::OwnerAsk;
use super::super::{
    CapId, DelegatedReply, Delegation, RedeemFailed, RegionId, Token, MAX_HEADER, MAX_IDENTITY,
};
use super::{Connection, Inner, Reply};
use crate::backend::Nic;

impl<N: Nic> Inner<N> {
    /// Region `id` is being deregistered: release this connection's
    /// registration of it, if it has one.
    pub(in crate::conn) fn forget_region(&self, id: RegionId) {
        self.state.lock().ep.forget_region(id);
    }
}

impl<N: Nic> Connection<N> {
    /// Delegate: redeem `token`, a delegation of a range of the owner's
    /// memory made for the identity this connection proved
    /// ([`Endpoint::delegate_region`](super::super::Endpoint::delegate_region) on
    /// the owner, this connection's peer). One message: the owner's library
    /// answers it itself with the range as the reply payload (read and
    /// released like any reply's: under mw through a window the owner
    /// bound on this connection's QP, under confirm an offer checked after
    /// the READ), or refuses ([`RedeemFailed::Refused`]:
    /// forged, another identity's, expired, revoked, redeemed already, ...).
    /// A token redeems once. Give the payload back with [`Connection::free`].
    pub async fn redeem(&self, token: &Token) -> Result<Reply, RedeemFailed> {
        self.ask(OwnerAsk::Redeem { token: token.as_bytes() }).await
    }

    /// Holder: hand the capability of `token` (made for the identity this
    /// connection proved) on to `to`, for `part` of its range (bytes from
    /// the capability's start; `None`: all of it) and `ttl` (no longer
    /// than the token has left). One message: the owner's library makes
    /// the new delegation itself and answers with its token, which this
    /// holder passes on by any means; the holder's token is used up
    /// (nothing is exposed to the holder). The owner keeps the range
    /// pinned until every delegation made from it is over, and this
    /// connection may [`Connection::revoke`] what it made. A part wider or
    /// a life longer than the capability's is refused
    /// ([`Refusal::OutsideCapability`](super::super::Refusal::OutsideCapability))
    /// and leaves the token unused; the delegate may delegate further in
    /// turn, never wider or longer.
    pub async fn delegate(
        &self,
        token: &Token,
        to: &str,
        part: Option<std::ops::Range<u32>>,
        ttl: Duration,
    ) -> Result<Delegation, RedeemFailed> {
        let token = token.as_bytes();
        Self::identity(to)?;
        let (offset, len) = match part {
            // An empty part is sent as its offset and a length of one
            // byte past the capability's end, for the owner to refuse.
            Some(p) if p.is_empty() => (p.start, u32::MAX),
            Some(p) => (p.start, p.end - p.start),
            None => (0, 0),
        };
        let ttl_ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
        let reply = self.ask(OwnerAsk::DelegateOn { token, offset, len, ttl_ms, identity: to }).await?;
        let Some((cap, token)) = reply.header.split_first_chunk::<8>() else {
            return Err(RedeemFailed::BadStatus(0));
        };
        let token = Token::from_bytes(token).map_err(|_| RedeemFailed::BadStatus(0))?;
        Ok(Delegation { cap: CapId(u64::from_le_bytes(*cap)), token })
    }

    /// Holder: revoke delegation `cap`, which this connection made
    /// ([`Connection::delegate`]): its token is refused from now on, and
    /// whatever was made from it ends; a delegate reading it now has its
    /// window invalidated (mw) or its offer withdrawn (confirm).
    pub async fn revoke(&self, cap: CapId) -> Result<(), RedeemFailed> {
        self.ask(OwnerAsk::Revoke { cap }).await.map(|_| ())
    }

    /// Holder: call the owner's application with `header` and ask for the
    /// reply's payload as a delegation to `to`, for `ttl`, instead of
    /// reading it. The request reaches the owner's application marked
    /// [`Request::delegated`](super::Request::delegated); when it replies
    /// with a range of one of its regions, the owner's library delegates
    /// the range to `to` (nothing is exposed to this caller) and answers
    /// with the token, which this holder passes on by any means; the
    /// range stays pinned (the owner cannot write it) until the delegation
    /// is over, and this connection may [`Connection::revoke`] it. A reply
    /// without a payload comes back without a delegation.
    ///
    /// `ttl` is at most the connection's `lease_time` (the life of any
    /// capability the owner exposes on it: the shorter of the two sides'
    /// [`Config::lease_time`](super::super::Config::lease_time), agreed at connect;
    /// [`Refusal::OutsideCapability`](super::super::Refusal::OutsideCapability)
    /// otherwise, before the application sees the request), and `to`
    /// names an identity of 1 to [`MAX_IDENTITY`] bytes
    /// ([`RedeemFailed::BadIdentity`]
    /// otherwise, and nothing is sent). The application sees `to` and
    /// `ttl` and may refuse (a reply without a payload). The reply's
    /// header has less room for the application's header: 1 byte less,
    /// and 11 bytes and the token's (at most [`MAX_TOKEN`](super::super::MAX_TOKEN)) less when it
    /// carries a delegation. For a part of the range, name this
    /// connection's own identity as `to` and hand a part on with
    /// [`Connection::delegate`].
    pub async fn call_delegated(
        &self,
        header: &[u8],
        to: &str,
        ttl: Duration,
    ) -> Result<DelegatedReply, RedeemFailed> {
        Self::identity(to)?;
        let ttl_ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
        let ask = OwnerAsk::Call { ttl_ms, identity: to, header };
        // The body goes where a request's header does.
        let len = ask.encoded_len();
        if len > MAX_HEADER {
            return Err(RedeemFailed::Call(super::CallError::Refused(super::Refused::new(
                super::UseError::HeaderTooLong(len),
                None,
            ))));
        }
        // Encoded on the stack unless the header is long.
        let reply = self.make_call(None, |ep, now, _| ask.encode_with(|body| ep.call_ask(now, body))).await?;
        if let Some(b) = reply.data {
            // An owner of this version sends none; the caller asked for a token.
            self.free(b);
            return Err(RedeemFailed::BadStatus(reply.status));
        }
        DelegatedReply::parse(reply.status, &reply.header)
    }

    /// An identity a token can name (an encoded ask cuts none short).
    fn identity(to: &str) -> Result<(), RedeemFailed> {
        if to.is_empty() || to.len() > MAX_IDENTITY {
            return Err(RedeemFailed::BadIdentity(to.len()));
        }
        Ok(())
    }

    /// Server: what request `req` asked for, if it is a call for a
    /// delegation ([`Request::delegated`](super::Request::delegated)) not
    /// yet replied to: the identity the reply's range would be delegated
    /// to, and for how long. The application may refuse to give its data
    /// to that identity (a reply without a payload).
    pub fn delegation_asked(&self, req: super::RequestId) -> Option<super::super::DelegatedCall> {
        self.inner.state.lock().ep.delegated_call(req)
    }

    /// Ask the owner's library; its refusal, matched.
    async fn ask(&self, ask: OwnerAsk<'_>) -> Result<Reply, RedeemFailed> {
        let reply = self.make_call(None, |ep, now, _| ask.encode_with(|body| ep.call_ask(now, body))).await?;
        match reply.status {
            0 => Ok(reply),
            s => {
                if let Some(b) = reply.data {
                    self.free(b);
                }
                Err(RedeemFailed::refused(s, &reply.header))
            }
        }
    }
}
