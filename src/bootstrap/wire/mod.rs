//! Frames: a versioned header and a fixed body per message kind.
//!
//! A frame is a fixed 9-byte header followed by a body, all integers
//! big-endian:
//!
//! ```text
//! header: magic "MWCP" (4) | version u16 | kind u8 | body length u16
//! ```
//!
//! The magic and the version come first so that a stranger (an HTTP server,
//! a port scanner) and a peer of another version are told apart from a
//! damaged message before anything else is read: the version sits where every
//! future version will keep it. Every length is checked against
//! [`MAX_BODY_LEN`] and against the length of its kind before a byte of the
//! body is awaited. The bodies are in [`hello`] and [`auth`].

mod auth;
mod hello;

pub use auth::{
    decode_auth, encode_auth, AuthDecoder, AuthFrame, AuthMode, RejectReason, AUTH_HELLO_BODY_LEN, MAC_LEN,
    NONCE_LEN,
};
pub use hello::{decode, encode, Hello, HelloDecoder, HELLO_BODY_LEN, PEER_QP_ID, VALID_MTUS};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MWCP";
/// The protocol version this build speaks.
///
/// Version 2 added the auth phase before the hello; version 3 made the
/// hello's fourth limit the sender's start credits (it was a queue depth
/// no side used); version 4 added the mw release marked unread (a
/// declined grant), which a version-3 peer would take for a protocol
/// violation. A peer of another version is told apart by the header and
/// fails with a version mismatch.
pub const PROTOCOL_VERSION: u16 = 4;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 9;
/// The largest body length any frame may announce; longer frames are refused unread.
pub const MAX_BODY_LEN: usize = 256;
/// The largest frame, header included.
pub const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_BODY_LEN;
/// The byte each side sends once its queue pair is in RTS.
pub const READY_BYTE: u8 = 0xA5;

/// The message kinds (the header's `kind` byte).
pub(super) mod kind {
    /// A [`Hello`](super::Hello).
    pub const HELLO: u8 = 1;
    /// [`AuthFrame::Init`](super::AuthFrame::Init).
    pub const AUTH_INIT: u8 = 2;
    /// [`AuthFrame::Challenge`](super::AuthFrame::Challenge).
    pub const AUTH_CHALLENGE: u8 = 3;
    /// [`AuthFrame::Proof`](super::AuthFrame::Proof).
    pub const AUTH_PROOF: u8 = 4;
    /// [`AuthFrame::Reject`](super::AuthFrame::Reject).
    pub const AUTH_REJECT: u8 = 5;
    /// [`AuthFrame::HelloTag`](super::AuthFrame::HelloTag).
    pub const HELLO_TAG: u8 = 6;

    /// What a frame of `kind` is, for an error that names what arrived;
    /// `None` for a kind this version does not know.
    pub fn name(kind: u8) -> Option<&'static str> {
        Some(match kind {
            HELLO => "a hello",
            AUTH_INIT => "an auth init",
            AUTH_CHALLENGE => "an auth challenge",
            AUTH_PROOF => "an auth proof",
            AUTH_REJECT => "an auth reject",
            HELLO_TAG => "a hello tag",
            _ => return None,
        })
    }

    /// The error for a frame of `kind` where `expected` belongs.
    pub fn unexpected(kind: u8, expected: &'static str) -> super::DecodeError {
        match name(kind) {
            Some(got) => super::DecodeError::UnexpectedFrame { got, expected },
            None => super::DecodeError::UnknownKind(kind),
        }
    }
}

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The first bytes are not the magic.
    #[error(
        "this is not an mwcap peer: it sent {prefix:02x?} where \"MWCP\" belongs; check the address and port"
    )]
    NotMwcap {
        /// The bytes received where the magic belongs (at most 4).
        prefix: Vec<u8>,
    },
    /// The peer speaks another protocol version.
    #[error(
        "mwcap protocol version mismatch: this side speaks {ours}, the peer {theirs}; \
         upgrade the older side so both run the same mwcap"
    )]
    VersionMismatch {
        /// Our version.
        ours: u16,
        /// The peer's version.
        theirs: u16,
    },
    /// The frame ends early.
    #[error("message truncated: at least {needed} more bytes were expected")]
    Truncated {
        /// How many bytes are missing (at least).
        needed: usize,
    },
    /// The frame announces a body longer than any message may be.
    #[error("frame announces {len} body bytes, more than the limit of {max}")]
    FrameTooLarge {
        /// The announced length.
        len: usize,
        /// The limit ([`MAX_BODY_LEN`]).
        max: usize,
    },
    /// The message kind is not one this version knows.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A well-formed frame arrived where another belongs.
    #[error("{got} arrived where {expected} belongs; the peer does not follow the protocol")]
    UnexpectedFrame {
        /// What arrived.
        got: &'static str,
        /// What belongs there.
        expected: &'static str,
    },
    /// The body length does not fit the message kind.
    #[error("message body is {got} bytes, expected {expected} for its kind")]
    BadLength {
        /// The announced length.
        got: usize,
        /// The length of this kind.
        expected: usize,
    },
    /// Bytes follow the frame.
    #[error("{0} unexpected bytes after the message")]
    TrailingBytes(usize),
    /// The path MTU is not one of 256, 512, 1024, 2048, 4096.
    #[error("invalid path MTU {0}: must be 256, 512, 1024, 2048 or 4096")]
    InvalidMtu(u32),
    /// The GID is all zeros: the port has no usable address at that GID index.
    #[error("the GID is all zeros: no address is configured at that GID index (for rxe use index 1)")]
    ZeroGid,
    /// A numeric field is out of range.
    #[error("invalid {field} {value}: expected {expected}")]
    InvalidField {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it should be.
        expected: &'static str,
    },
    /// The hello requires features this version does not know.
    #[error("the hello requires unknown features {0:#06x}; upgrade this side")]
    UnknownRequiredFeatures(u16),
    /// The one-byte ready signal was some other byte.
    #[error("expected the ready byte {READY_BYTE:#04x}, got {0:#04x}")]
    BadReady(u8),
}

/// A set of message kinds read at one point of the exchange, and how to
/// parse their bodies.
pub(super) trait Message: Sized + Clone {
    /// The body length of `kind`, or why a frame of that kind is refused here.
    fn body_len(kind: u8) -> Result<usize, DecodeError>;
    /// Parse a body of the length [`body_len`](Self::body_len) gave.
    fn parse(kind: u8, body: &[u8]) -> Result<Self, DecodeError>;
}

/// Append a header for a body of `body_len` bytes.
fn put_header(out: &mut Vec<u8>, kind: u8, body_len: usize) {
    debug_assert!(body_len <= MAX_BODY_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.push(kind);
    out.extend_from_slice(&(body_len as u16).to_be_bytes());
}

/// Check as much of a header as `prefix` holds (at most [`HEADER_LEN`]
/// bytes), in wire order, so that a stranger is recognised by its first
/// bytes. Returns the kind and the body length once the whole header is there.
fn check_header<M: Message>(prefix: &[u8]) -> Result<Option<(u8, usize)>, DecodeError> {
    let magic = &prefix[..prefix.len().min(4)];
    if magic != &MAGIC[..magic.len()] {
        return Err(DecodeError::NotMwcap { prefix: magic.to_vec() });
    }
    if prefix.len() < 6 {
        return Ok(None);
    }
    let theirs = u16::from_be_bytes([prefix[4], prefix[5]]);
    if theirs != PROTOCOL_VERSION {
        return Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs });
    }
    if prefix.len() < 7 {
        return Ok(None);
    }
    let kind = prefix[6];
    let expected = M::body_len(kind)?;
    if prefix.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = usize::from(u16::from_be_bytes([prefix[7], prefix[8]]));
    if len > MAX_BODY_LEN {
        return Err(DecodeError::FrameTooLarge { len, max: MAX_BODY_LEN });
    }
    if len != expected {
        return Err(DecodeError::BadLength { got: len, expected });
    }
    Ok(Some((kind, len)))
}

/// Decode exactly one frame of `M`. Bytes after the frame are an error.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
fn decode_frame<M: Message>(bytes: &[u8]) -> Result<M, DecodeError> {
    let header = &bytes[..bytes.len().min(HEADER_LEN)];
    let (kind, body_len) = match check_header::<M>(header)? {
        Some(h) => h,
        None => return Err(DecodeError::Truncated { needed: HEADER_LEN - bytes.len() }),
    };
    let frame_len = HEADER_LEN + body_len;
    if bytes.len() < frame_len {
        return Err(DecodeError::Truncated { needed: frame_len - bytes.len() });
    }
    if bytes.len() > frame_len {
        return Err(DecodeError::TrailingBytes(bytes.len() - frame_len));
    }
    M::parse(kind, &bytes[HEADER_LEN..])
}

/// A cursor over a body whose length was already checked.
struct Body<'a>(&'a [u8]);

impl Body<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        // The caller checked the body length, so `N <= self.0.len()` here;
        // `get` keeps even a mistake from panicking (it yields zeros, which fail validation).
        if let Some(bytes) = self.0.get(..N) {
            out.copy_from_slice(bytes);
            self.0 = &self.0[N..];
        }
        out
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take())
    }
}

/// The streaming decoder behind [`HelloDecoder`]: one frame of `M`, from
/// bytes that arrive in pieces.
///
/// It never takes a byte past the end of the frame (what follows on the
/// stream belongs to the next message), and it fails as soon as the bytes
/// seen so far cannot start a valid frame.
#[derive(Clone, Debug)]
pub(super) struct FrameReader<M> {
    buf: [u8; MAX_FRAME_LEN],
    filled: usize,
    header: Option<(u8, usize)>,
    state: State<M>,
}

#[derive(Clone, Debug)]
enum State<M> {
    Reading,
    Done(M),
    Failed(DecodeError),
}

impl<M: Message> FrameReader<M> {
    pub(super) fn new() -> FrameReader<M> {
        FrameReader { buf: [0; MAX_FRAME_LEN], filled: 0, header: None, state: State::Reading }
    }

    /// How many more bytes complete the frame, as far as is known (the
    /// header first, then the body). Zero once done or failed.
    pub(super) fn wanted(&self) -> usize {
        match (&self.state, self.header) {
            (State::Reading, None) => HEADER_LEN - self.filled,
            (State::Reading, Some((_, len))) => HEADER_LEN + len - self.filled,
            _ => 0,
        }
    }

    /// Take bytes from `input` up to the end of the frame and return how
    /// many were taken. On an error the decoder stays failed.
    pub(super) fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError> {
        if let State::Failed(e) = &self.state {
            return Err(e.clone());
        }
        let mut taken = 0;
        // Once for the header, once for the body.
        while taken < input.len() && self.wanted() > 0 {
            let take = (input.len() - taken).min(self.wanted());
            self.buf[self.filled..self.filled + take].copy_from_slice(&input[taken..taken + take]);
            self.filled += take;
            taken += take;
            if let Err(e) = self.advance() {
                self.state = State::Failed(e.clone());
                return Err(e);
            }
        }
        Ok(taken)
    }

    fn advance(&mut self) -> Result<(), DecodeError> {
        if self.header.is_none() {
            self.header = check_header::<M>(&self.buf[..self.filled])?;
        }
        if let Some((kind, len)) = self.header {
            if self.filled == HEADER_LEN + len && matches!(self.state, State::Reading) {
                self.state = State::Done(M::parse(kind, &self.buf[HEADER_LEN..self.filled])?);
            }
        }
        Ok(())
    }

    /// The decoded message, once the whole frame was fed.
    pub(super) fn message(&self) -> Option<&M> {
        match &self.state {
            State::Done(m) => Some(m),
            _ => None,
        }
    }

    /// The bytes taken so far: the whole frame once it is decoded.
    pub(super) fn frame(&self) -> &[u8] {
        &self.buf[..self.filled]
    }
}
