//! The lease engines of mwcap's memory-window (MW) policy, sans-IO.
//!
//! Every remote exposure of memory is a *lease*: the [`Owner`] binds a
//! type-2 memory window over exactly one buffer, scoped to the peer's QP,
//! and sends a [`Grant`] (address, length, rkey, time left) in a SEND chained
//! after the bind, so exposing adds no round trip. The [`Reader`] READs
//! through the window while enough of the lease is left, then sends a
//! [`Release`]. The same two engines serve both directions:
//!
//! - **server-owned reply data**: the server is the `Owner`, the client the
//!   `Reader` ([`ReleaseMode::Message`]: the client sends the release after
//!   its READ);
//! - **client-owned request data**: the client is the `Owner`, the server
//!   the `Reader` ([`ReleaseMode::Piggyback`]: the server's response carries
//!   the release).
//!
//! # Who invalidates
//! The owner, always, with one LOCAL_INV per bind, posted on the first of:
//! a valid release, its own expiry timer. A local [`Owner::cancel`] waits
//! for one of those too, so a healthy peer never READs an invalidated
//! window. When the QP dies nothing is invalidated: the windows die with it
//! and are retired. Peers never use SEND_WITH_INV: a release racing with
//! the expiry would invalidate the same bind twice, which panics the rxe
//! kernel. A buffer returns to its owner only on evidence: the LOCAL_INV's
//! successful completion, or the QP destroyed (not the flush after a move
//! to ERR: a NIC may still be copying a READ response's last packet out of
//! the buffer). `docs/protocol-mw.md` has the sequence diagrams and the
//! argument.
//!
//! # Driving an engine
//! Both engines are deterministic state machines: no I/O, no clock, no
//! threads, no randomness but a PRNG seeded by the caller. Time is a
//! [`Duration`](std::time::Duration) since any epoch the driver picks, and
//! must not go backwards. A driver loops:
//!
//! 1. feed every input with a `handle_*` call: a decoded message
//!    ([`Owner::handle_release`], [`Reader::handle_grant`]), a completion
//!    routed by [`Token::engine`] (`handle_completion`), a receive with an
//!    invalidated rkey ([`Owner::handle_peer_invalidation`]), the connection
//!    taken down before its QP is in ERR ([`Owner::handle_connection_lost`]),
//!    the QP in ERR or destroyed (`handle_qp_error` once the move to ERR
//!    succeeded, `handle_qp_destroyed`: tell *both* engines of the
//!    connection), a user request ([`Owner::grant`],
//!    [`Owner::cancel`]), and `handle_timeout(now)` once `now` has reached
//!    the deadline from `poll_timeout`;
//! 2. drain `poll_action()` and carry out each action in order (post the
//!    work requests with the token as `wr_id`, send the messages, flush the
//!    QP);
//! 3. drain `poll_event()` and deliver the events (returned buffers, READ
//!    results);
//! 4. arm a timer for `poll_timeout()` and wait for the next input.
//!
//! Messages have their own versioned encoding ([`Message::encode`],
//! [`Message::decode`]); decoding never panics.
//!
//! The type-2 rkey arithmetic (index bits, consumer key, the next bind's key)
//! lives in [`rkey`], the one implementation of it: the root crate's backends
//! use it too.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod free_slots;
mod owner;
mod reader;
pub mod rkey;
mod rng;
mod slot_heap;
mod types;
mod wire;

pub use owner::{
    BindAndGrant, CancelError, GrantError, LeaseEnd, LendRefused, LossCause, Misbehavior, Owner, OwnerAction,
    OwnerEvent, OwnerStats,
};
pub use reader::{
    DeclineReason, ReadError, Reader, ReaderAction, ReaderConfig, ReaderEvent, ReaderStats, ReleaseMode,
};
pub use types::{Buffer, Engine, LeaseId, Status, Token, Window};
pub use wire::{DecodeError, Grant, Message, Release, MAX_LEASE_TIME, WIRE_VERSION};

/// Debug builds' index checks: `have()` lists what `want()` does. Compared
/// without collecting, so a debug build allocates no more than a release
/// one (`tests/alloc_free.rs`); both are listed on a mismatch.
#[track_caller]
pub(crate) fn assert_lists<I, J>(what: &str, have: impl Fn() -> I, want: impl Fn() -> J)
where
    I: Iterator,
    J: Iterator<Item = I::Item>,
    I::Item: PartialEq + std::fmt::Debug,
{
    if !have().eq(want()) {
        assert_eq!(have().collect::<Vec<_>>(), want().collect::<Vec<_>>(), "{what}");
    }
}
