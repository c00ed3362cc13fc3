//! What the engines hand to their driver: work to post, messages to send,
//! events for the user, and the errors of local calls.

use std::fmt;
use std::time::Duration;

use crate::ids::{BufferId, MsgId, ReadToken, Region};
use crate::wire::Message;

/// Engine settings. Start from [`Config::default`] and change fields.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Config {
    /// Server, direction 1: how long an offered reply buffer stays held for
    /// its reader's confirm. At expiry the buffer returns to the server and its
    /// generation is bumped, so a later confirm gets `Reused`.
    pub hold_timeout: Duration,
    /// Client: how long a fetch (direction 1, all attempts together) or an
    /// exposed request buffer (direction 2) lives. At expiry a fetch fails and
    /// an exposed buffer returns to the client.
    pub request_timeout: Duration,
    /// Server, direction 2: how long after an exposure arrives the
    /// client's answer to its confirm may come. The READ (however long it
    /// waited for a destination) and the answer fit in it, or the request
    /// is dropped ([`ReadError::ConfirmTimedOut`]): a destination is held
    /// for at most this long after the exposure came, whatever the number
    /// of exposures that came with it.
    pub confirm_timeout: Duration,
    /// Client, direction 1: how many offers to READ before giving up after
    /// stale reads (1 means no retry).
    pub max_attempts: u32,
    /// Reader side: the longest region it will READ; longer offers fail or are refused.
    pub max_read_len: u32,
    /// Server: the most requests it tracks at once (wanted replies plus
    /// requests being read); a peer sending more is refused.
    pub max_outstanding: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            hold_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            confirm_timeout: Duration::from_secs(5),
            max_attempts: 3,
            max_read_len: 64 << 20,
            max_outstanding: 1024,
        }
    }
}

/// An RDMA READ to post: `remote` into a local destination of `remote.len()`
/// bytes that the driver picks, with [`ReadToken::raw`] as the work request id.
///
/// The destination belongs to the NIC until the engine reports the token
/// again, in [`Event::ReadVerified`] (now the user's) or [`Event::ReadDiscarded`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadRequest {
    token: ReadToken,
    remote: Region,
}

impl ReadRequest {
    pub(crate) fn new(token: ReadToken, remote: Region) -> ReadRequest {
        ReadRequest { token, remote }
    }
    /// The token to use as (or map to) the work request id.
    pub fn token(&self) -> ReadToken {
        self.token
    }
    /// What to READ: address, length and rkey at the peer.
    pub fn remote(&self) -> Region {
        self.remote
    }
}

/// Work for the driver, from `poll_action`. Post or send in the order given.
#[must_use = "an action not carried out stalls the protocol"]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Post an RDMA READ (`SendWr::Read`, signaled).
    Read(ReadRequest),
    /// Send this message to the peer (encode it into a SEND payload).
    Send(Message),
}

/// Why the owner took a buffer back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Release {
    /// The reader confirmed its READ and was answered `Intact`: it has the data.
    Confirmed,
    /// The hold timed out (server: `hold_timeout`; client: `request_timeout`).
    Expired,
    /// The local user cancelled the request.
    Cancelled,
    /// The peer refused to read it.
    Refused,
    /// The connection failed.
    ConnectionLost,
    /// The owner withdrew its offer before the reader confirmed it (a
    /// revoked capability): a confirm after this is answered `Reused`.
    Withdrawn,
}

/// Why a read (a direction-1 fetch, or a direction-2 incoming request) failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReadError {
    /// Every attempt read a buffer the owner had reused meanwhile.
    StaleRetriesExhausted {
        /// Attempts made.
        attempts: u32,
    },
    /// The owner answered that the data is no longer there (direction 2: the
    /// client's request was cancelled or timed out); the request is not processed.
    Withdrawn,
    /// The fetch's `request_timeout` passed.
    TimedOut,
    /// The READ and the owner's answer to its confirm did not both come
    /// within `confirm_timeout` of the exposure.
    ConfirmTimedOut,
    /// The local user cancelled the fetch.
    Cancelled,
    /// The server refused the fetch.
    Refused,
    /// The peer offered more than `max_read_len` (or the fetch's limit).
    TooLong {
        /// Bytes offered.
        offered: u32,
        /// Bytes allowed.
        limit: u32,
    },
    /// The READ completed with an error (the queue pair is now in error).
    ReadFailed,
    /// The connection failed.
    ConnectionLost,
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::StaleRetriesExhausted { attempts } => write!(
                f,
                "all {attempts} reads were stale (the owner reused its buffer before the confirm); \
                 raise hold_timeout or max_attempts"
            ),
            ReadError::Withdrawn => {
                f.write_str("the owner withdrew the data before the confirm; drop the request")
            }
            ReadError::TimedOut => f.write_str("fetch timed out; raise request_timeout or check the peer"),
            ReadError::ConfirmTimedOut => f.write_str(
                "the data was not read and confirmed within confirm_timeout of its exposure \
                     (no destination free soon enough, or no answer from the owner); free \
                     destinations sooner, or check the peer",
            ),
            ReadError::Cancelled => f.write_str("fetch cancelled"),
            ReadError::Refused => f.write_str("the peer refused the request"),
            ReadError::TooLong { offered, limit } => {
                write!(f, "peer offered {offered} bytes, more than the limit of {limit}; raise max_read_len")
            }
            ReadError::ReadFailed => f.write_str("rdma read failed; the connection is broken, reconnect"),
            ReadError::ConnectionLost => f.write_str("connection lost; reconnect"),
        }
    }
}

impl std::error::Error for ReadError {}

/// Something the user of an engine must know, from `poll_event`.
#[must_use = "events carry buffer ownership back to the user"]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// Reader side: the READ of `token` was confirmed intact. Its destination
    /// holds exactly the `len` bytes offered for `msg` and is the user's now.
    /// Client (direction 1): the reply. Server (direction 2): the request, to
    /// be processed.
    ReadVerified {
        /// The request.
        msg: MsgId,
        /// The READ whose destination holds the data.
        token: ReadToken,
        /// Bytes read.
        len: u32,
    },
    /// Reader side: the destination of `token` holds nothing of use (a stale
    /// read, or a failed or abandoned one) and the NIC is done with it: reuse it.
    ReadDiscarded {
        /// The READ.
        token: ReadToken,
    },
    /// Reader side: the fetch or incoming request `msg` ended without data.
    ReadFailed {
        /// The request.
        msg: MsgId,
        /// Why.
        error: ReadError,
    },
    /// Server (direction 1): the client wants the reply of `msg`: call
    /// `Server::offer` (or `Server::refuse`).
    ReplyWanted {
        /// The request.
        msg: MsgId,
        /// 1 for the first ask, more for a retry after a stale read.
        attempt: u32,
    },
    /// Owner side: `buffer`, exposed for `msg`, is the owner's again and may be
    /// rewritten. Client (direction 2): `Confirmed` means the server has the
    /// request's data; any other reason means the request is over.
    BufferFree {
        /// The buffer.
        buffer: BufferId,
        /// The request it was exposed for.
        msg: MsgId,
        /// Why it came back.
        reason: Release,
    },
}

/// Why a local call was refused. These are caller mistakes or a dead
/// connection, never the peer's doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UsageError {
    /// The buffer id was not made by this engine's `add_buffer`.
    UnknownBuffer(BufferId),
    /// The buffer is exposed; wait for its [`Event::BufferFree`].
    BufferBusy(BufferId),
    /// The buffer has been reused 2^64 - 1 times and is retired.
    BufferRetired(BufferId),
    /// More bytes than the buffer has.
    TooLong {
        /// Bytes asked for.
        len: u32,
        /// Bytes the buffer has.
        capacity: u32,
    },
    /// The server has no wanted reply for this message id.
    NotWanted(MsgId),
    /// The connection failed; make a new engine for a new connection.
    ConnectionLost,
    /// All 2^64 - 1 message ids of this connection are used.
    MsgIdsExhausted,
}

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UsageError::UnknownBuffer(b) => write!(f, "buffer {b} was not added to this engine"),
            UsageError::BufferBusy(b) => {
                write!(f, "buffer {b} is still exposed; wait for its BufferFree event")
            }
            UsageError::BufferRetired(b) => write!(f, "buffer {b} ran out of generations; add a new one"),
            UsageError::TooLong { len, capacity } => {
                write!(f, "{len} bytes do not fit a buffer of {capacity}; use a larger buffer")
            }
            UsageError::NotWanted(m) => write!(f, "no reply is wanted for message {m}"),
            UsageError::ConnectionLost => {
                f.write_str("connection lost; make a new engine for a new connection")
            }
            UsageError::MsgIdsExhausted => f.write_str("message ids exhausted; open a new connection"),
        }
    }
}

impl std::error::Error for UsageError {}
