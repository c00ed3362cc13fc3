//! Small values that cross the boundary between the engines and their driver.

use std::fmt;

/// Names one lease: which window of the owner's pool, and which bind of it.
///
/// Sent to the peer in a [`Grant`](crate::Grant) and echoed back in the
/// [`Release`](crate::Release). A lease id names one bind only: after the
/// window is invalidated and rebound, the old id is stale forever (until the
/// 32-bit bind counter of that window wraps, after 2^32 binds; it counts
/// from 1 and skips 0, which names no bind). A stale release that came
/// round again must still name the window's current rkey, whose consumer
/// key changes with every bind.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(u64);

impl LeaseId {
    pub(crate) fn new(slot: u32, epoch: u32) -> LeaseId {
        LeaseId((u64::from(slot) << 32) | u64::from(epoch))
    }
    pub(crate) fn slot(self) -> u32 {
        (self.0 >> 32) as u32
    }
    pub(crate) fn epoch(self) -> u32 {
        self.0 as u32
    }
    /// The id as it travels on the wire and in logs.
    pub fn raw(self) -> u64 {
        self.0
    }
    /// An id read from the wire. Any value is accepted: the owner checks it
    /// against its own table before acting on it.
    pub fn from_raw(raw: u64) -> LeaseId {
        LeaseId(raw)
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({}#{})", self.slot(), self.epoch())
    }
}

/// Which engine posted a work request (see [`Token::engine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// The [`Owner`](crate::Owner): binds, grant SENDs and LOCAL_INVs.
    Owner,
    /// The [`Reader`](crate::Reader): RDMA READs.
    Reader,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum TokenKind {
    Bind = 0xa1,
    GrantSend = 0xa2,
    Invalidate = 0xa3,
    Read = 0xb1,
}

/// A work request id chosen by an engine. The driver posts the work request
/// with `wr_id = token.wr_id()` and hands the completion back with
/// [`Token::from_wr_id`]. Both engines of one connection share a QP, so the
/// driver routes a completion by [`Token::engine`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u64);

impl Token {
    pub(crate) fn new(kind: TokenKind, slot: u32, epoch: u32) -> Token {
        Token(((kind as u64) << 56) | ((u64::from(slot) & 0x00ff_ffff) << 32) | u64::from(epoch))
    }
    pub(crate) fn kind(self) -> Option<TokenKind> {
        match (self.0 >> 56) as u8 {
            0xa1 => Some(TokenKind::Bind),
            0xa2 => Some(TokenKind::GrantSend),
            0xa3 => Some(TokenKind::Invalidate),
            0xb1 => Some(TokenKind::Read),
            _ => None,
        }
    }
    pub(crate) fn slot(self) -> u32 {
        ((self.0 >> 32) & 0x00ff_ffff) as u32
    }
    pub(crate) fn epoch(self) -> u32 {
        self.0 as u32
    }
    /// The value to post as the work request's `wr_id`.
    pub fn wr_id(self) -> u64 {
        self.0
    }
    /// The token of a completion's `wr_id`. Any value is accepted; an engine
    /// ignores (and counts) completions it does not recognise.
    pub fn from_wr_id(wr_id: u64) -> Token {
        Token(wr_id)
    }
    /// Whether this is a grant SEND's token. Its successful completion
    /// only ends the SEND (the buffer returns on its LOCAL_INV's
    /// completion, which comes after it on the send queue), so a driver
    /// may hand it to [`Owner::handle_completion`](crate::Owner::handle_completion)
    /// late, with the connection's next completion, as long as nothing
    /// waits for the SEND's slot.
    pub fn is_grant_send(self) -> bool {
        self.kind() == Some(TokenKind::GrantSend)
    }
    /// Which engine the work request belongs to, or `None` if neither
    /// engine made this token (then it is the driver's own).
    pub fn engine(self) -> Option<Engine> {
        match self.kind()? {
            TokenKind::Bind | TokenKind::GrantSend | TokenKind::Invalidate => Some(Engine::Owner),
            TokenKind::Read => Some(Engine::Reader),
        }
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind() {
            Some(k) => write!(f, "Token({k:?} {}#{})", self.slot(), self.epoch()),
            None => write!(f, "Token({:#x})", self.0),
        }
    }
}

/// A range of registered memory, named the way the driver posts it.
///
/// The engines never touch the bytes; they carry the value to the actions
/// that need it and give it back in the event that returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Buffer {
    /// The memory region's handle (the root crate's `MrId::raw()`).
    pub mr: u32,
    /// Start of the range inside the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// The address a remote peer names the first byte by (the region's
    /// virtual address plus `offset`). Unused for READ destinations.
    pub addr: u64,
}

/// One memory window of the owner's pool, as allocated by the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    /// The window's handle (the root crate's `MwId::raw()`).
    pub handle: u32,
    /// Its rkey at allocation; every bind changes only the low 8 bits.
    pub rkey: u32,
}

/// The outcome of a work request, reduced to what the engines distinguish.
/// The driver maps the NIC's completion status onto it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// The work request succeeded.
    Success,
    /// Flushed because the QP is in ERR (`WR_FLUSH_ERR`).
    Flushed,
    /// The remote side refused the access (`REM_ACCESS_ERR`): bad rkey,
    /// range or rights. Both QPs are in ERR afterwards.
    RemoteAccess,
    /// Any other error, with the NIC's raw status for logs. The QP is in ERR.
    Failed(u32),
}

impl Status {
    /// Whether the work request succeeded.
    pub fn is_success(self) -> bool {
        self == Status::Success
    }
}
