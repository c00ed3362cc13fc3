//! What an [`Owner`](super::Owner) tells its driver and its user: the
//! actions to carry out, the events, its counters and its errors.

use std::fmt;
use std::time::Duration;

use crate::wire::MAX_LEASE_TIME;
use crate::{Buffer, Grant, LeaseId, Status, Token, Window};

/// How a lease ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseEnd {
    /// The peer released it (it will not READ again).
    Released,
    /// The peer released it unread: it declined the grant (too little
    /// time left, a destination too small, or the data no longer wanted)
    /// and drops whatever the data was for. A release like any other for
    /// the window; the driver may tell its user at once.
    Unread,
    /// The owner's expiry timer fired.
    Expired,
    /// The owner's user took it back early ([`Owner::revoke`](super::Owner::revoke)).
    Revoked,
    /// The QP died before the lease ended otherwise.
    ConnectionLost,
}

/// Why the owner considers its QP unusable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LossCause {
    /// One of its work requests completed with this error status.
    WorkRequestFailed(Status),
    /// The driver reported the QP in ERR ([`Owner::handle_qp_error`](super::Owner::handle_qp_error)).
    QpError,
    /// The driver destroyed the QP.
    QpDestroyed,
    /// The driver took the connection down and asked for its QP to go to
    /// ERR ([`Owner::handle_connection_lost`](super::Owner::handle_connection_lost)):
    /// until [`Owner::handle_qp_error`](super::Owner::handle_qp_error) says
    /// it is there, nothing is evidence but completions.
    ConnectionLost,
    /// The peer broke the protocol; the owner asked for the QP to be flushed.
    HostilePeer,
    /// One of its windows was invalidated by a SEND_WITH_INV received on
    /// another queue pair of the device ([`Owner::handle_invalidation_elsewhere`](super::Owner::handle_invalidation_elsewhere)):
    /// not this peer's doing. The owner asked for the QP to be flushed.
    InvalidatedElsewhere,
}

/// Peer behaviour the protocol forbids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Misbehavior {
    /// The peer sent SEND_WITH_INV (only the owner invalidates). `window` is
    /// the window whose current bind carried that rkey, if any.
    SendWithInvalidate {
        /// The rkey the peer invalidated.
        rkey: u32,
        /// The window it belongs to, if it names a bound window of the pool.
        window: Option<u32>,
    },
}

/// What the driver must do for the owner. Post work requests in the order
/// the actions come out.
#[must_use = "an owner action must be carried out, or buffers never return"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OwnerAction {
    /// Post, in one `post_send` (one doorbell), the bind then the SEND of
    /// the grant; see [`BindAndGrant`].
    BindAndGrant(BindAndGrant),
    /// Post a signaled `LocalInv { wr_id: token.wr_id(), rkey }` for `window`.
    Invalidate {
        /// The work request id.
        token: Token,
        /// The window being invalidated (for logs; the verb names it by rkey).
        window: u32,
        /// The window's current rkey.
        rkey: u32,
    },
    /// Move the QP to ERR (the peer is hostile, or a window was invalidated
    /// through another connection). Afterwards call
    /// [`Owner::handle_qp_error`](super::Owner::handle_qp_error) (and the reader's) on this connection.
    /// Asked again, while the connection is down, until that call: a move
    /// that failed is retried on the next such news.
    FlushQp,
}

/// A bind chained with the SEND of its grant.
///
/// Post `BindMw { wr_id: bind_token, signaled: false, mw: window, rkey, mr:
/// buffer.mr, offset: buffer.offset, len: buffer.len, access: REMOTE_READ }`
/// followed by `Send { wr_id: send_token, signaled: true }` whose payload is
/// `Message::Grant(grant)` encoded. Both go in one `post_send`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BindAndGrant {
    /// The bind's work request id (the bind is unsignaled: its completion
    /// only arrives on error).
    pub bind_token: Token,
    /// The window handle.
    pub window: u32,
    /// The new rkey for this bind.
    pub rkey: u32,
    /// The buffer the window covers, exactly.
    pub buffer: Buffer,
    /// The SEND's work request id (signaled).
    pub send_token: Token,
    /// The message to encode into the SEND.
    pub grant: Grant,
}

/// What the owner tells its user.
#[must_use = "owner events return buffers; dropping one leaks it"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OwnerEvent {
    /// The buffer is the owner's again: no remote access to it is possible.
    BufferReturned {
        /// The lease that covered it.
        lease: LeaseId,
        /// The buffer, as given to [`Owner::grant`](super::Owner::grant).
        buffer: Buffer,
        /// How the lease ended.
        end: LeaseEnd,
        /// Whether the user cancelled the lease before it ended.
        cancelled: bool,
    },
    /// The QP is unusable; no new grants. Leased buffers return as flush
    /// evidence arrives.
    ConnectionLost {
        /// Why.
        cause: LossCause,
    },
    /// The peer broke the protocol; the connection is being torn down.
    PeerMisbehaved(Misbehavior),
    /// The window will never be bound again: deallocate it (it may still
    /// be bound to the dead QP; freeing a bound window invalidates it). A
    /// free window's comes as the connection goes down, a leased one's
    /// with its buffer's return, at [`Owner::handle_qp_destroyed`](super::Owner::handle_qp_destroyed);
    /// rxe stalls destroying a QP with windows still bound, so a driver
    /// deallocates the windows it knows of before the destroy (a lending
    /// owner's driver: the windows it lent and has not had back).
    WindowRetired {
        /// The window handle.
        window: u32,
    },
    /// Only for an owner made with [`Owner::lending`](super::Owner::lending), right after the
    /// [`OwnerEvent::BufferReturned`] of the same lease: the window lent to
    /// it is unbound (its one LOCAL_INV completed successfully) and goes
    /// back to its pool, with the rkey of its last bind (libibverbs does not
    /// track it; the next bind changes its low 8 bits).
    WindowUnbound {
        /// The lease the window served.
        lease: LeaseId,
        /// The window, with its current rkey.
        window: Window,
    },
}

/// Counters for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OwnerStats {
    /// Grants issued.
    pub grants: u64,
    /// Leases ended by a valid release.
    pub released: u64,
    /// Leases ended by the expiry timer.
    pub expired: u64,
    /// Leases ended early by the owner's user ([`Owner::revoke`](super::Owner::revoke)).
    pub revoked: u64,
    /// LOCAL_INVs posted.
    pub invalidations: u64,
    /// Releases for a lease that already ended (late after expiry, duplicate, replay).
    pub stale_releases: u64,
    /// Releases naming no lease ever granted, or with the wrong rkey.
    pub forged_releases: u64,
    /// SEND_WITH_INV received from the peer.
    pub peer_invalidations: u64,
    /// Completions whose token is not one of this owner's outstanding ones.
    pub unknown_completions: u64,
}

/// Why [`Owner::grant`](super::Owner::grant) refused.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrantError {
    /// Every window of the pool is leased (backpressure).
    NoFreeWindow {
        /// The pool size.
        pool: usize,
    },
    /// The buffer has zero length (a zero-length bind fails and kills the QP).
    EmptyBuffer,
    /// The lease time is zero or longer than [`MAX_LEASE_TIME`].
    BadLeaseTime(Duration),
    /// The QP is down.
    ConnectionLost,
    /// [`Owner::grant`](super::Owner::grant) on an owner made with [`Owner::lending`](super::Owner::lending) (each grant
    /// brings its window: use [`Owner::grant_on`](super::Owner::grant_on)), or [`Owner::grant_on`](super::Owner::grant_on)
    /// on one made with [`Owner::new`](super::Owner::new) (it binds its own windows).
    WrongWindowSource {
        /// Whether the owner lends its windows per grant.
        lending: bool,
    },
}

/// [`Owner::grant_on`](super::Owner::grant_on) refused: why, and the window it was given, unused
/// and still unbound, to go back to its pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LendRefused {
    /// Why the grant was refused.
    pub error: GrantError,
    /// The window, untouched.
    pub window: Window,
}

impl fmt::Display for GrantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrantError::NoFreeWindow { pool } => write!(
                f,
                "all {pool} memory windows are leased; wait for a buffer to return or size the pool to the queue depth"
            ),
            GrantError::EmptyBuffer => f.write_str("cannot grant an empty buffer"),
            GrantError::BadLeaseTime(t) => {
                write!(f, "lease time {t:?} is not in 1µs..={MAX_LEASE_TIME:?}")
            }
            GrantError::ConnectionLost => f.write_str("the connection is lost; open a new one"),
            GrantError::WrongWindowSource { lending: true } => f.write_str(
                "this owner has no windows of its own (Owner::lending): grant with a window from the pool, \
                 Owner::grant_on",
            ),
            GrantError::WrongWindowSource { lending: false } => f.write_str(
                "this owner binds its own windows (Owner::new): grant without one, Owner::grant",
            ),
        }
    }
}

impl std::error::Error for GrantError {}

/// Why [`Owner::cancel`](super::Owner::cancel) refused.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CancelError {
    /// No active lease has this id (it already returned, or never existed).
    NotActive(LeaseId),
}

impl fmt::Display for CancelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CancelError::NotActive(l) => {
                write!(f, "lease {l:?} is not active (its buffer already returned?)")
            }
        }
    }
}

impl std::error::Error for CancelError {}
