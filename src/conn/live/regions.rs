//! A connection's part in its endpoint's regions (`conn/regions.rs`) and
//! in their delegations (`conn/delegate.rs`).

use super::super::{RedeemFailed, Refusal, RegionId, Token, MAX_TOKEN};
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
    /// the READ), or refuses ([`RedeemFailed::Refused`](super::super::RedeemFailed::Refused):
    /// forged, another identity's, expired, revoked, redeemed already, ...).
    /// A token redeems once. Give the payload back with [`Connection::free`].
    pub async fn redeem(&self, token: &Token) -> Result<Reply, RedeemFailed> {
        let bytes = token.as_bytes();
        if bytes.len() > MAX_TOKEN {
            return Err(RedeemFailed::TokenTooLong(bytes.len()));
        }
        let reply = self.make_call(None, |ep, now, _| ep.call_redeem(now, bytes)).await?;
        match reply.status {
            0 => Ok(reply),
            s => {
                if let Some(b) = reply.data {
                    self.free(b);
                }
                match Refusal::from_status(s) {
                    Some(refusal) => Err(RedeemFailed::Refused {
                        refusal,
                        message: String::from_utf8_lossy(&reply.header).into_owned(),
                    }),
                    None => Err(RedeemFailed::BadStatus(s)),
                }
            }
        }
    }
}
