//! Delegated capabilities, sans-IO: the owner's book of what it exposed,
//! who it may be handed on to, and when the memory is its own again.
//!
//! In mwcap every remote exposure is a capability with a bounded life: a
//! type-2 window bound over exactly the bytes on one peer's QP (mw), or an
//! offer confirmed after the READ (confirm). A **delegation** hands part of
//! one on to a third node, which the owner can take back:
//!
//! 1. The owner exposes memory to a *holder* ([`Book::expose`]: a *root*
//!    capability, live).
//! 2. The holder asks the owner to delegate a range of it to a named
//!    identity, until an expiry no later than its own
//!    ([`Book::delegate`]). The owner answers with a [`Token`]: the claims
//!    (which delegation, its range, expiry and identity, a nonce) sealed
//!    with HMAC-SHA256 under a secret only the owner has. The holder passes
//!    the token on by any means.
//! 3. The *delegate*, connected to the owner and authenticated as that
//!    identity, redeems the token once ([`Book::redeem`]); the owner then
//!    exposes the range to it (a window on the delegate's QP, or an offer)
//!    as to any holder. A delegate may delegate further, never wider or
//!    longer, and at most [`MAX_DEPTH`] delegations from the root.
//! 4. The owner's application revokes a capability ([`Book::revoke`]), or
//!    a holder the delegations it made ([`Book::revoke_delegations`]):
//!    every delegation below ends ([`Event::End`] for each live one; tokens
//!    out are refused). Expiry bounds everything.
//! 5. Each exposure ends on evidence from the NIC ([`Book::ended`]: the
//!    invalidation's completion, the QP destroyed, the offer confirmed or
//!    withdrawn), never on a timer alone. When every exposure
//!    of a tree has ended and no token of it can be redeemed, the book says
//!    [`Event::Done`]: only then may the memory be reused.
//!
//! The book decides; it binds nothing and sends nothing. No I/O, no clock
//! (time is a [`Duration`](std::time::Duration) since any epoch the caller
//! picks, that never goes backwards), no randomness (the caller gives the
//! secret and each token's nonce), no `unsafe`.
//!
//! What the book guarantees, checked exhaustively by the stateright model
//! (`tests/model.rs`) over every order of delegate, redeem, revoke,
//! release, expiry and peer death, and by random walks through the same
//! model with deeper trees (`tests/prop_book.rs`):
//! - a token redeems at most once, only for the identity it names, before
//!   its expiry, and never once it or any capability above it is revoked;
//! - a delegation covers part of its parent's range and ends no later;
//! - [`Event::End`] is said at most once per capability;
//! - [`Event::Done`] comes only when no exposure of the tree is live and
//!   no token of it can be redeemed, and at rest every tree is done.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod book;
mod token;

pub use book::{
    Book, BookStats, DelegateError, Delegation, Event, IdHasher, RedeemError, Redeemed, RevokeError,
    MAX_DEPTH,
};
pub use token::{Claims, Token, TokenTooLong, MAX_IDENTITY, MAX_TOKEN};

/// A capability in an owner's book: a root (an exposure the owner made) or
/// a delegation. Never reused by a book.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CapId(pub u64);

/// Who holds a capability: the caller's name for a connection (its id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holder(pub u64);

/// A byte range of the exposed memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Range {
    /// The first byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl Range {
    /// Whether `inner` is non-empty and lies within this range.
    pub fn contains(&self, inner: Range) -> bool {
        let (Some(end), Some(inner_end)) =
            (self.offset.checked_add(self.len), inner.offset.checked_add(inner.len))
        else {
            return false;
        };
        inner.len > 0 && inner.offset >= self.offset && inner_end <= end
    }
}
