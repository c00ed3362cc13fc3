//! Public types of the connection layer.

use std::fmt;
use std::time::Duration;

use crate::backend::{NicError, WcOpcode, WcStatus};

use super::buf::Buf;
use super::config::Role;
use super::header::Header;

/// A region of memory the application registered with an endpoint
/// ([`Endpoint::register_region`](super::Endpoint::register_region)), to
/// expose ranges of it without copying them into pool buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub(crate) u32);

/// A byte range of a user region: what a call or reply exposes, and what
/// [`Event::RangeReturned`] gives back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionRange {
    /// The region.
    pub region: RegionId,
    /// Where the range starts in it.
    pub offset: usize,
    /// Its length.
    pub len: u32,
}

/// A call made by a client, named in its events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallId(pub(crate) u64);

/// A request received by a server, named when replying.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub(crate) u64);

impl CallId {
    /// The message id on the wire.
    pub fn raw(self) -> u64 {
        self.0
    }
}
impl RequestId {
    /// The message id on the wire.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A caller's trace id (16 bytes, as in W3C trace context), carried in a
/// request's frame so that the server's span for the request
/// (`mwcap.request`, field `trace`) joins the client's (`mwcap.call`)
/// across nodes. Shown as 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TraceId([u8; 16]);

impl TraceId {
    /// The trace id with these bytes.
    pub const fn from_bytes(b: [u8; 16]) -> TraceId {
        TraceId(b)
    }

    /// Its bytes.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// Parse 32 hex digits (either case), e.g. from a W3C `traceparent`.
    pub fn from_hex(s: &str) -> Option<TraceId> {
        let s = s.as_bytes();
        if s.len() != 32 {
            return None;
        }
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut b = [0u8; 16];
        for (i, out) in b.iter_mut().enumerate() {
            *out = digit(s[2 * i])? << 4 | digit(s[2 * i + 1])?;
        }
        Some(TraceId(b))
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({self})")
    }
}

/// What an endpoint tells its user.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "events may carry buffers; dropping one leaks it from the pool"]
pub enum Event {
    /// Client: a call's reply, with its payload read and verified.
    Reply {
        /// The call.
        call: CallId,
        /// The server's status byte (0 = success).
        status: u8,
        /// The reply header.
        header: Header,
        /// The reply payload, now the user's.
        data: Option<Buf>,
    },
    /// Client: a call failed; nothing of its reply is returned.
    CallFailed {
        /// The call.
        call: CallId,
        /// Why.
        error: CallError,
    },
    /// Server: a request, with its payload read and verified.
    Request {
        /// Name it in the reply.
        req: RequestId,
        /// The request header.
        header: Header,
        /// The request payload, now the user's.
        data: Option<Buf>,
        /// The caller's trace id, if it sent one (see [`TraceId`]).
        trace: Option<TraceId>,
        /// The caller asked for the reply's payload as a delegation to a
        /// third node, not to read it (see `Request::delegated`).
        delegated: bool,
    },
    /// Server: a peer asks the owner's library (a redemption, a holder's
    /// delegation on, a holder's revocation: `OwnerAsk`, the request's
    /// header). The I/O layer answers it itself, from its endpoint's book
    /// of delegations, never the application.
    Ask {
        /// Name it in the reply.
        req: RequestId,
        /// The ask's bytes (handed back once answered,
        /// `proto::Connection::recycle_ask`, for the next ask).
        body: Vec<u8>,
        /// Under confirm: it comes again, the delegate's READ of the
        /// range it was answered with being stale.
        again: bool,
    },
    /// Server: a request was dropped before it reached the user (its payload
    /// was withdrawn, could not be read, or was stale).
    RequestDropped {
        /// The request.
        req: RequestId,
        /// Why.
        error: CallError,
    },
    /// Server, confirm policy: the client read a stale reply (the offered
    /// buffer's hold ended before it confirmed its READ) and asks for it
    /// again. Answer `req` again as the first time, with a fresh payload: the
    /// request's header and trace id come again here; its payload, which
    /// the server had the first time, does not.
    ReplyAgain {
        /// The request (the same id as its [`Event::Request`]).
        req: RequestId,
        /// The request header, as in its [`Event::Request`].
        header: Header,
        /// The caller's trace id, as in its [`Event::Request`].
        trace: Option<TraceId>,
    },
    /// A buffer given to the NIC is the user's again: no remote access to it
    /// is possible any more.
    BufferReturned(Buf),
    /// An exposure of a range of a user region
    /// ([`Connection::call_region`](super::Connection::call_region),
    /// [`Connection::reply_region`](super::Connection::reply_region)) is
    /// over: no remote access to it is possible any more, and the range may
    /// be written again.
    RangeReturned {
        /// The range.
        range: RegionRange,
        /// Which exposure of the connection's it was: two exposures of one
        /// range at once have different numbers, and a number is not
        /// used again for the connection's life.
        exposure: u64,
    },
    /// The connection is down; every call fails, buffers return as the NIC
    /// flushes.
    ConnectionLost(LossReason),
}

/// What a connection has done so far, and where its buffers are now
/// (`Connection::stats`). Counters only grow; the buffer counts are a
/// snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnStats {
    /// Client: calls sent.
    pub calls: u64,
    /// Client: replies delivered (with their payloads read and verified).
    pub replies_received: u64,
    /// Client: calls that failed (timed out, cancelled, payload unreadable,
    /// connection lost).
    pub calls_failed: u64,
    /// Server: requests handed to the user.
    pub requests: u64,
    /// Server: requests dropped before the user saw them.
    pub requests_dropped: u64,
    /// Credits this side gave back to a peer on shared receives that
    /// asked for them (its idle share shrank by as many).
    pub credits_returned: u64,
    /// Server: requests refused unread because `Config::max_requests`
    /// were unanswered ([`CallError::Busy`] at the client).
    pub requests_busy: u64,
    /// Server: replies sent.
    pub replies_sent: u64,
    /// Payload bytes this side READ from the peer and accepted.
    pub bytes_read: u64,
    /// Payload bytes this side exposed to the peer.
    pub bytes_exposed: u64,
    /// Confirm policy: READs discarded because the owner had reused the
    /// buffer meanwhile (each is retried, or the call fails).
    pub stale_reads: u64,
    /// Exposures this side made (buffers and ranges of regions, mw or
    /// confirm): each a capability the peer may READ.
    pub exposures: u64,
    /// Exposures that ended on evidence (released, expired, or the QP
    /// destroyed) and came back; `exposures - exposures_ended`
    /// are live.
    pub exposures_ended: u64,
    /// Exposures ended by their own expiry rather than by the peer (mw:
    /// the lease timer; confirm: the hold or request timeout).
    pub expiries: u64,
    /// mw: READs of this side that the owner's NIC refused
    /// (`REM_ACCESS_ERR`): the window was already invalidated, or the
    /// grant was bad.
    pub late_accesses: u64,
    /// Control frames sent.
    pub frames_sent: u64,
    /// Control frames received.
    pub frames_received: u64,
    /// Completions reaped.
    pub completions: u64,
    /// Completions with an error status (flushes included).
    pub error_completions: u64,
    /// Of those, the NIC gave up retrying because the peer posted no
    /// receive (`RnrRetryExcErr`; with flow control this means the peer
    /// stopped posting receives).
    pub rnr_retries_exceeded: u64,
    /// Of those, the NIC gave up retrying because the peer did not answer
    /// (`RetryExcErr`: a dead peer or a cut link).
    pub transport_retries_exceeded: u64,
    /// Flow control: receive credit the peer has granted us and we have not
    /// spent (the SENDs we may still post).
    pub credits: u32,
    /// Flow control: receives we posted and have not yet told the peer of.
    pub credits_owed: u32,
    /// Flow control: the receives this side keeps for its peer (granted,
    /// in flight or owed): `ctrl_slots`, or on a hub with shared receives
    /// the connection's current share of the hub's queue.
    pub receive_share: u32,
    /// Flow control: times a call or reply found no credit and waited, or a
    /// protocol message was queued until credit came.
    pub credit_waits: u64,
    /// Flow control: frames sent only to grant credit (the rest rides on
    /// other frames).
    pub credit_frames: u64,
    /// Payloads sent inline in a request or reply frame (no window, READ
    /// or release).
    pub inline_sent: u64,
    /// Inline payloads received (copied into a buffer of the pool).
    pub inline_received: u64,
    /// Memory-window policy, our direction: binds, releases, expiries,
    /// invalidations, stale and forged releases.
    pub lease_owner: Option<mwcap_mw::OwnerStats>,
    /// Memory-window policy, the peer's direction: READs, declines, failures.
    pub lease_reader: Option<mwcap_mw::ReaderStats>,
    /// Buffers now free in the pool.
    pub buffers_free: u32,
    /// Buffers now held by the user.
    pub buffers_user: u32,
    /// Buffers now exposed to the peer (waiting for evidence to come back).
    pub buffers_exposed: u32,
    /// Buffers now being READ into.
    pub buffers_reading: u32,
}

/// Why a connection went down.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// A work request completed with an error (the first one seen; a flush
    /// of a receive is often the first sign that the peer's side failed).
    Completion {
        /// The completion status (`RnrRetryExcErr`: the peer stopped posting
        /// receives; `RetryExcErr`: it stopped answering).
        status: WcStatus,
        /// The operation, as the provider reported it.
        opcode: WcOpcode,
        /// The provider's vendor error, 0 if none.
        vendor_err: u32,
        /// The work request's id (for matching with logs).
        wr_id: u64,
    },
    /// The memory-window engine found its QP unusable.
    LeaseEngine(mwcap_mw::LossCause),
    /// The peer broke the protocol.
    PeerMisbehaved(Misbehavior),
    /// A READ did not complete in time and the QP was flushed.
    ReadHung,
    /// Keepalive (`Config::keepalive`): the peer left unanswered what it
    /// must answer, a ping or, on shared receives, a request to give back
    /// the credit its share grew by (`Config::give_back_after`). It is
    /// dead, hung, cut off, or holding receives other connections need.
    PeerUnresponsive {
        /// For a ping, the time since the peer last answered one; for a
        /// give-back, the time since it was asked.
        silent: Duration,
    },
    /// The user closed it.
    Closed,
    /// The peer went away: its end of the bootstrap TCP stream closed (it
    /// closed the connection, or its process exited or died). Reported by
    /// the [`EndpointDriver`](super::EndpointDriver), which watches the
    /// stream of every connection of its endpoint, or by whoever watches it
    /// and calls
    /// [`Connection::peer_gone`](super::Connection::peer_gone).
    PeerGone,
    /// The NIC refused an operation.
    Nic(NicError),
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::Completion { status, opcode, vendor_err, wr_id } => write!(
                f,
                "a {opcode:?} work request (wr_id {wr_id:#x}) completed with {status:?} (vendor error {vendor_err:#x}); \
                 the QP is in error: reconnect, and if it repeats check the peer and the link"
            ),
            LossReason::LeaseEngine(c) => write!(f, "the memory-window engine lost its QP ({c:?}); reconnect"),
            LossReason::PeerMisbehaved(m) => write!(f, "the peer broke the protocol: {m}; connection closed"),
            LossReason::ReadHung => f.write_str("a READ never completed; the QP was flushed, reconnect"),
            LossReason::PeerUnresponsive { silent } => write!(
                f,
                "the peer left a keepalive ping or a request to give back receives unanswered for {silent:?}: \
                 it is dead, hung or cut off; reconnect"
            ),
            LossReason::Closed => f.write_str("closed by the user"),
            LossReason::PeerGone => f.write_str(
                "the peer went away (its bootstrap TCP stream closed: it closed the connection, \
                 or its process exited or died); reconnect once it is back",
            ),
            LossReason::Nic(e) => write!(f, "the NIC refused an operation: {e}"),
        }
    }
}

/// What a peer did that the protocol forbids. Each closes the connection
/// (only that one); none panics or loses a buffer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Misbehavior {
    /// A control message that is not a frame.
    #[error("malformed frame: {0}")]
    MalformedFrame(super::frame::FrameError),
    /// A memory-window engine message that does not decode.
    #[error("malformed memory-window message: {0:?}")]
    MalformedLeaseMessage(mwcap_mw::DecodeError),
    /// A confirm message that does not decode.
    #[error("malformed confirm message: {0:?}")]
    MalformedConfirmMessage(mwcap_fallback::DecodeError),
    /// Bytes after a confirm message.
    #[error("trailing bytes after a confirm message")]
    ConfirmTrailingBytes,
    /// A frame of the other role: a request sent to a client, a reply to a server.
    #[error("a {role:?} got a {got}")]
    WrongFrame {
        /// Our role.
        role: Role,
        /// What came: `"request"` or `"reply"`.
        got: &'static str,
    },
    /// A request or reply carrying more than one payload.
    #[error("message {msg} carries {count} payloads; at most one is allowed")]
    TooManyPayloads {
        /// The message id.
        msg: u64,
        /// Payloads it carried.
        count: usize,
    },
    /// A redemption of a delegation token carrying a payload (it carries
    /// the token only).
    #[error("redemption {msg} carries a payload; a redemption carries its token only")]
    PayloadOnRedemption {
        /// The message id.
        msg: u64,
    },
    /// A request id not above the last one (a replayed or forged request).
    #[error("request id {msg} is not above the last one ({last})")]
    RequestIdReused {
        /// The id received.
        msg: u64,
        /// The last id accepted.
        last: u64,
    },
    /// Bytes on the bootstrap stream after the handshake's ready byte: the
    /// peer sends nothing there afterwards (the stream stays open only so
    /// that each side sees the other go away).
    #[error("the peer wrote on its bootstrap stream after the handshake ended")]
    BootstrapAfterReady,
    /// A `Returned` frame that answers no `GiveBack` of this side, or
    /// gives back more credit than the peer could hold past this side's
    /// start credits (`most`; 0 when nothing was asked).
    #[error("the peer gave back {count} credits unasked or beyond the {most} it could (flow control)")]
    BadReturn {
        /// Credits it said it gave back.
        count: u32,
        /// The most it could give back.
        most: u32,
    },
    /// A window grant whose lease id names a lease of the peer's that this
    /// side still holds (reading it, waiting for a buffer, or declining
    /// it): the owner names each live lease once, and this side maps the
    /// lease's outcome back to its message by that id.
    #[error("a window grant reuses lease {lease:#x}, which is still live on this side")]
    LeaseIdReused {
        /// The lease id (`mwcap_mw::LeaseId::raw`).
        lease: u64,
    },
    /// A window grant that rides on no request or reply.
    #[error("a window grant outside a request or reply")]
    GrantOutsideMessage,
    /// A message of a policy neither direction uses (a grant, a release, or
    /// a confirm message), or a confirm exposure of a payload whose direction
    /// goes under mw.
    #[error("a {what}, which the policies this connection agreed do not allow")]
    WrongPolicy {
        /// What came: `"window grant"`, `"window release"`, `"confirm
        /// message"` or `"confirm exposure of a payload that goes under mw"`.
        what: &'static str,
    },
    /// The peer invalidated a window itself (SEND_WITH_INV): only the owner
    /// may; the owner's engine flushed the QP.
    #[error("the peer invalidated rkey {rkey:#x} itself (SEND_WITH_INV); only the owner invalidates")]
    SendWithInvalidate {
        /// The rkey it invalidated.
        rkey: u32,
    },
    /// More of our frames wait for receive credit than a peer that grants
    /// as it reposts its receives can leave waiting (answers to its frames,
    /// and a message or two for each call, request and payload open): it
    /// does not run mwcap's flow control (`docs/protocol.md`, "Flow
    /// control"). A peer that keeps within its own credit cannot cause it.
    #[error("{queued} of our frames wait for receive credit the peer does not grant; it does not run mwcap's flow control")]
    WithholdsCredit {
        /// Frames waiting for credit when the connection gave up.
        queued: usize,
    },
    /// A server's user held every buffer a request payload fits, and the
    /// client sent more payloads (window grants, confirm exposures) than
    /// `Config::max_waiting_payloads` lets wait for one.
    #[error(
        "{waiting} request payloads already wait for a free buffer (Config::max_waiting_payloads), \
         and the peer sent another: it sends faster than this side frees its buffers; free them \
         sooner, or give this side more buffers or a larger max_waiting_payloads"
    )]
    TooManyWaitingPayloads {
        /// Payloads waiting when the next came (`max_waiting_payloads`).
        waiting: u32,
    },
    /// A server's user held every buffer an inline request payload fits,
    /// and the client sent more inline bytes than
    /// `Config::max_waiting_inline` lets wait for one.
    #[error(
        "{waiting} bytes of inline request payloads already wait for a free buffer and the peer \
         sent {len} more, past Config::max_waiting_inline ({max}): it sends faster than this side \
         frees its buffers; free them sooner, or give this side more buffers or a larger \
         max_waiting_inline"
    )]
    TooMuchWaitingInline {
        /// Bytes waiting when the next payload came.
        waiting: u32,
        /// Bytes of that payload.
        len: u32,
        /// `Config::max_waiting_inline`.
        max: u32,
    },
    /// An inline payload longer than this side's `Config::inline_max`:
    /// the peer ignores it, or its own is larger (set `inline_max` the same
    /// on both sides, or the sender's smaller).
    #[error(
        "message {msg} carries an inline payload of {len} bytes, above this side's \
         Config::inline_max ({max}); give both sides the same inline_max"
    )]
    InlineTooLong {
        /// The message id.
        msg: u64,
        /// Bytes it carried inline.
        len: u32,
        /// This side's `Config::inline_max`.
        max: u32,
    },
    /// The peer sent more frames than it had receive credit for (the
    /// initial credits and every grant this side sent): the connection goes
    /// down at the first one. On a receive queue of the connection's own
    /// such a frame met RNR, or took a receive reposted for a grant not yet
    /// sent; on a shared receive queue (an endpoint with shared receives)
    /// it takes a receive held for another connection.
    #[error("the peer sent frame {received} with receive credit for {granted}; it does not run mwcap's flow control")]
    ExceedsCredit {
        /// Frames the peer was granted credit for, in all.
        granted: u64,
        /// Frames received, this one included.
        received: u64,
    },
}

/// Why a payload could not be read (a call's reply payload, or a request's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadError {
    /// Memory-window policy: the grant was not read (too little lease time
    /// left, a destination too small, the connection lost).
    #[error("the window grant was declined: {0:?}")]
    Declined(mwcap_mw::DeclineReason),
    /// Memory-window policy: the READ failed.
    #[error("the READ of the granted window failed: {0:?}")]
    ReadFailed(mwcap_mw::ReadError),
    /// Confirm policy: the read failed or every read was stale.
    #[error("{0}")]
    Confirm(mwcap_fallback::ReadError),
    /// The server did not read the request's payload, so it dropped the
    /// request: nothing of it reached the server's user. Under mw it
    /// declined the grant (too little of the lease left, a destination too
    /// small) with a release marked unread; under confirm it refused the
    /// exposure (longer than it reads, too many reads outstanding, or its
    /// READ and confirm past its confirm timeout). The call fails at once,
    /// not at its timeout; its buffer comes back as the policy allows.
    #[error(
        "the server dropped the request unread: it declined or refused its payload, or could not read it \
         in time; nothing of it reached the server's user, so the call may be retried (a lease too \
         short for the server to read in: raise Config::lease_time)"
    )]
    Unread,
    /// An inline payload longer than every buffer of the reader's pool.
    #[error("an inline payload of {len} bytes does not fit the largest buffer ({have} bytes); give the reader larger buffers or the sender a smaller Config::inline_max")]
    TooLarge {
        /// Bytes sent.
        len: u32,
        /// The reader's largest buffer.
        have: u32,
    },
}

/// Why a call (or a request's payload) failed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The call was refused before anything was sent; the request payload
    /// (if one was given) comes back in it, untouched and still the
    /// caller's: the same [`Refused`] a refused reply gives.
    #[error("the call was not sent: {0}")]
    Refused(#[from] Refused),
    /// No reply within [`Config::call_timeout`](super::Config::call_timeout).
    #[error("no reply within the call timeout; the server may be overloaded or gone")]
    TimedOut,
    /// The user cancelled it.
    #[error("cancelled")]
    Cancelled,
    /// The connection went down.
    #[error("connection lost: {0}")]
    ConnectionLost(LossReason),
    /// The payload could not be read intact (every read of it stale under
    /// confirm, a grant declined, a READ failed); nothing of it is returned.
    #[error("the payload could not be read intact: {0}")]
    Payload(PayloadError),
    /// The reply came, but no buffer was free to take its payload (of this
    /// many bytes) before the call timed out: the user holds them all, or
    /// other payloads took them.
    #[error(
        "the reply came but no buffer was free for its {0}-byte payload before the call timed out; \
         free or drop the buffers you hold sooner, or configure more (Config::buffers, Config::large_buffers)"
    )]
    NoBuffer(u32),
    /// The server refused the request unread: `limit` requests of this
    /// connection (its `Config::max_requests`) were unanswered when it
    /// came (or when, under confirm, this side asked for a stale reply's
    /// data again). Nothing of it reached the server's user. Its payload
    /// buffer, if any, goes back to the pool (`Event::BufferReturned` on
    /// the sans-IO connection): a retry fills a buffer again. Retry once
    /// earlier calls have finished, send fewer at once, or raise the
    /// server's limit.
    #[error(
        "the server refused the request unread: it already held {limit} unanswered requests of this \
         connection (its Config::max_requests); retry after earlier calls finish, or send fewer at once"
    )]
    Busy {
        /// The server's `Config::max_requests`.
        limit: u32,
    },
}

/// A call or reply that was refused before anything was sent: why, and the
/// payload buffer handed back to the caller (never lost from the pool).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
#[must_use = "a refusal may carry the caller's buffer; dropping it leaks it from the pool"]
pub struct Refused {
    /// Why.
    pub error: UseError,
    /// The payload buffer given to the refused operation, untouched.
    pub data: Option<Buf>,
}

impl Refused {
    pub(crate) fn new(error: impl Into<UseError>, data: Option<Buf>) -> Refused {
        Refused { error: error.into(), data }
    }
}

/// Why a local call on an endpoint was refused. Nothing was sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UseError {
    /// The operation belongs to the other role.
    #[error("this is a {0:?} endpoint; that operation is for the other role")]
    WrongRole(Role),
    /// The buffer belongs to another endpoint.
    #[error("buffer {0} belongs to another endpoint")]
    ForeignBuffer(u32),
    /// Data longer than a buffer.
    #[error("{len} bytes do not fit a {cap}-byte buffer")]
    TooLong {
        /// Bytes given.
        len: usize,
        /// Buffer size.
        cap: u32,
    },
    /// A payload buffer with no bytes in it (write it first).
    #[error("the payload buffer is empty; write the payload into it first")]
    EmptyPayload,
    /// A header longer than a frame allows.
    #[error("header of {0} bytes exceeds the limit of {max}", max = super::frame::MAX_HEADER)]
    HeaderTooLong(usize),
    /// No such request (already replied to, or dropped).
    #[error("request {0} is not waiting for a reply")]
    NoSuchRequest(u64),
    /// Every memory window is leased (backpressure; the async API waits).
    #[error("every memory window is leased; wait for an exposed buffer to return")]
    NoFreeWindow,
    /// Confirm policy: the buffer is still exposed to the peer (a handle to
    /// it should not exist: it comes back only once the exposure ended).
    #[error("buffer {0} is still exposed to the peer; use a buffer from alloc()")]
    BufferExposed(u32),
    /// The mw lease engine refused the exposure.
    #[error("the memory window could not be leased: {0}")]
    Lease(mwcap_mw::GrantError),
    /// The confirm engine refused the operation.
    #[error("the confirm protocol refused: {0}")]
    Confirm(mwcap_fallback::UsageError),
    /// Every control slot is in use.
    #[error("all control slots are in use; drive the endpoint to reap completions")]
    NoCtrlSlot,
    /// No region has this id (never registered, or deregistered).
    #[error("region {0:?} is not registered with this endpoint")]
    NoSuchRegion(RegionId),
    /// A range past the end of its region, or empty.
    #[error("range {offset}..{end} is not inside region {region:?} of {len} bytes (or is empty)", end = *offset as u64 + u64::from(*range_len))]
    OutOfRegion {
        /// The region.
        region: RegionId,
        /// The range's start.
        offset: usize,
        /// The range's length.
        range_len: u32,
        /// The region's length.
        len: usize,
    },
    /// The range overlaps one exposed to a peer, or delegated: it may not
    /// be written until that exposure is over ([`Event::RangeReturned`] on
    /// its connection, or its QP destroyed) or that delegation is (its
    /// token redeemed and that exposure over, or expired, or revoked).
    #[error("bytes {offset}..{end} of region {region:?} are exposed to a peer or delegated; write them once that exposure or delegation ends (region_write_when_free waits for it)", end = offset + len)]
    RangeExposed {
        /// The region.
        region: RegionId,
        /// Where the write started.
        offset: usize,
        /// Its length.
        len: usize,
    },
    /// The region has live exposures: it cannot be deregistered until each
    /// has ended ([`Event::RangeReturned`] on its connection, or its QP
    /// destroyed).
    #[error("region {0:?} has ranges exposed to a peer; deregister it once every exposure has ended")]
    RegionBusy(RegionId),
    /// Flow control: the peer has no receive posted for another message
    /// (backpressure; the async API waits). Drive the endpoint: the peer's
    /// next frame grants more.
    #[error("the peer has no receive free for another message (flow control); drive the endpoint and retry")]
    NoCredit,
    /// The request's caller asked for the reply's payload as a delegation
    /// to a third node ([`Request::delegated`](super::Request::delegated)),
    /// and a buffer cannot be delegated (it lives in this connection's
    /// memory, which a third node's queue pair cannot reach).
    #[error("request {0} asked for its reply's payload as a delegation: reply with a range of a region (reply_region), or with no payload; a buffer cannot be delegated")]
    NotDelegable(u64),
    /// The connection is down.
    #[error("connection is down: {0}")]
    Down(LossReason),
    /// The NIC refused.
    #[error(transparent)]
    Nic(#[from] NicError),
}
