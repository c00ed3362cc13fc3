//! The hello message and its versioned binary encoding.
//!
//! A frame is a fixed 9-byte header followed by a body, all integers
//! big-endian:
//!
//! ```text
//! header: magic "MWCP" (4) | version u16 | kind u8 | body length u16
//! hello body (version 1, kind 1, 54 bytes):
//!   conn_id u64 | qpn u32 | psn u32 | mtu u16 | lid u16 | gid [16]
//!   | serve u8 | read u8 | required features u16 | optional features u16
//!   | max_message u32 | queue_depth u32 | lease_ms u32
//! ```
//!
//! The magic and the version come first so that a stranger (an HTTP server,
//! a port scanner) and a peer of another version are told apart from a
//! damaged message before anything else is read: the version sits where every
//! future version will keep it. Every length is checked against
//! [`MAX_BODY_LEN`] before a byte of the body is awaited.

use crate::backend::{QpEndpoint, QpId};

use super::caps::{Capabilities, Features, PolicySet};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MWCP";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 9;
/// Bytes in a version-1 hello body.
pub const HELLO_BODY_LEN: usize = 54;
/// The largest body length any frame may announce; longer frames are refused unread.
pub const MAX_BODY_LEN: usize = 256;
/// The largest frame, header included.
pub const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_BODY_LEN;
/// The message kind of a hello.
const KIND_HELLO: u8 = 1;
/// The valid path MTUs, as in the InfiniBand spec.
pub const VALID_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];
/// The `id` a decoded [`Hello`]'s endpoint carries: the peer's local handle
/// is not sent (it means nothing on this side).
pub const PEER_QP_ID: QpId = QpId(u32::MAX);

/// What each side sends first: how to reach its queue pair and what it can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hello {
    /// The sender's queue pair. `id` is not sent; a decoded hello carries [`PEER_QP_ID`].
    pub endpoint: QpEndpoint,
    /// What the sender can do.
    pub caps: Capabilities,
    /// A random id the sender picked for this connection; both sides log the
    /// pair, so the two ends of one connection can be matched in logs.
    pub conn_id: u64,
}

impl Hello {
    /// A hello for `endpoint` with a fresh random connection id.
    pub fn new(endpoint: QpEndpoint, caps: Capabilities) -> Hello {
        Hello { endpoint, caps, conn_id: rand::random() }
    }

    /// Check the fields a peer would check: a usable QPN, PSN, MTU and GID,
    /// non-zero limits, no unknown required feature.
    pub fn validate(&self) -> Result<(), DecodeError> {
        let e = &self.endpoint;
        if !(2..=0xff_ffff).contains(&e.qpn) {
            return Err(DecodeError::InvalidField {
                field: "qpn",
                value: e.qpn.into(),
                expected: "2..=0xffffff",
            });
        }
        if e.psn > 0xff_ffff {
            return Err(DecodeError::InvalidField {
                field: "psn",
                value: e.psn.into(),
                expected: "0..=0xffffff",
            });
        }
        if !VALID_MTUS.contains(&e.mtu) {
            return Err(DecodeError::InvalidMtu(e.mtu));
        }
        if e.gid == [0; 16] {
            return Err(DecodeError::ZeroGid);
        }
        let c = &self.caps;
        for (field, value) in
            [("max_message", c.max_message), ("queue_depth", c.queue_depth), ("lease_ms", c.lease_ms)]
        {
            if value == 0 {
                return Err(DecodeError::InvalidField { field, value: 0, expected: "at least 1" });
            }
        }
        let unknown = c.features.required & !Features::KNOWN_REQUIRED;
        if unknown != 0 {
            return Err(DecodeError::UnknownRequiredFeatures(unknown));
        }
        Ok(())
    }
}

/// Why bytes are not a valid hello frame.
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
    /// The body length does not fit the message kind.
    #[error("hello body is {got} bytes, expected {expected}")]
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

/// The byte each side sends once its queue pair is in RTS.
pub const READY_BYTE: u8 = 0xA5;

/// Encode a hello as one frame.
pub fn encode(hello: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + HELLO_BODY_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.push(KIND_HELLO);
    out.extend_from_slice(&(HELLO_BODY_LEN as u16).to_be_bytes());
    let (e, c) = (&hello.endpoint, &hello.caps);
    out.extend_from_slice(&hello.conn_id.to_be_bytes());
    out.extend_from_slice(&e.qpn.to_be_bytes());
    out.extend_from_slice(&e.psn.to_be_bytes());
    // An MTU that does not fit in u16 is invalid; encode it as 0 so the peer says so.
    out.extend_from_slice(&u16::try_from(e.mtu).unwrap_or(0).to_be_bytes());
    out.extend_from_slice(&e.lid.to_be_bytes());
    out.extend_from_slice(&e.gid);
    out.push(c.serve.bits());
    out.push(c.read.bits());
    out.extend_from_slice(&c.features.required.to_be_bytes());
    out.extend_from_slice(&c.features.optional.to_be_bytes());
    out.extend_from_slice(&c.max_message.to_be_bytes());
    out.extend_from_slice(&c.queue_depth.to_be_bytes());
    out.extend_from_slice(&c.lease_ms.to_be_bytes());
    debug_assert_eq!(out.len(), HEADER_LEN + HELLO_BODY_LEN);
    out
}

/// Decode exactly one hello frame. Bytes after the frame are an error.
pub fn decode(bytes: &[u8]) -> Result<Hello, DecodeError> {
    let header = &bytes[..bytes.len().min(HEADER_LEN)];
    let body_len = match check_header(header)? {
        Some(len) => len,
        None => return Err(DecodeError::Truncated { needed: HEADER_LEN - bytes.len() }),
    };
    let frame_len = HEADER_LEN + body_len;
    if bytes.len() < frame_len {
        return Err(DecodeError::Truncated { needed: frame_len - bytes.len() });
    }
    if bytes.len() > frame_len {
        return Err(DecodeError::TrailingBytes(bytes.len() - frame_len));
    }
    parse_hello_body(&bytes[HEADER_LEN..])
}

/// Check as much of a header as `prefix` holds (at most [`HEADER_LEN`]
/// bytes), in wire order, so that a stranger is recognised by its first
/// bytes. Returns the body length once the whole header is there.
fn check_header(prefix: &[u8]) -> Result<Option<usize>, DecodeError> {
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
    if prefix[6] != KIND_HELLO {
        return Err(DecodeError::UnknownKind(prefix[6]));
    }
    if prefix.len() < HEADER_LEN {
        return Ok(None);
    }
    let len = usize::from(u16::from_be_bytes([prefix[7], prefix[8]]));
    if len > MAX_BODY_LEN {
        return Err(DecodeError::FrameTooLarge { len, max: MAX_BODY_LEN });
    }
    if len != HELLO_BODY_LEN {
        return Err(DecodeError::BadLength { got: len, expected: HELLO_BODY_LEN });
    }
    Ok(Some(len))
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

fn parse_hello_body(body: &[u8]) -> Result<Hello, DecodeError> {
    if body.len() != HELLO_BODY_LEN {
        return Err(DecodeError::BadLength { got: body.len(), expected: HELLO_BODY_LEN });
    }
    let mut b = Body(body);
    let conn_id = b.u64();
    let qpn = b.u32();
    let psn = b.u32();
    let mtu = u32::from(b.u16());
    let lid = b.u16();
    let gid = b.take::<16>();
    let serve = PolicySet::from_bits_truncate(b.u8());
    let read = PolicySet::from_bits_truncate(b.u8());
    let features = Features { required: b.u16(), optional: b.u16() };
    let max_message = b.u32();
    let queue_depth = b.u32();
    let lease_ms = b.u32();
    let hello = Hello {
        endpoint: QpEndpoint { id: PEER_QP_ID, qpn, gid, psn, mtu, lid },
        caps: Capabilities { serve, read, max_message, queue_depth, lease_ms, features },
        conn_id,
    };
    hello.validate()?;
    Ok(hello)
}

/// A streaming hello decoder, for bytes that arrive in pieces.
///
/// It never takes a byte past the end of the frame (what follows on the
/// stream belongs to the next phase), and it fails as soon as the bytes seen
/// so far cannot start a valid frame: a stranger is recognised by its first
/// byte, not after a timeout. Loop: read at most [`wanted`](Self::wanted)
/// bytes (so that no byte of the next phase is read off the socket),
/// [`feed`](Self::feed) them, until [`hello`](Self::hello) is `Some`.
#[derive(Clone, Debug)]
pub struct HelloDecoder {
    buf: [u8; MAX_FRAME_LEN],
    filled: usize,
    body_len: Option<usize>,
    state: State,
}

#[derive(Clone, Debug)]
enum State {
    Reading,
    Done(Hello),
    Failed(DecodeError),
}

impl HelloDecoder {
    /// A decoder waiting for the first byte.
    pub fn new() -> HelloDecoder {
        HelloDecoder { buf: [0; MAX_FRAME_LEN], filled: 0, body_len: None, state: State::Reading }
    }

    /// How many more bytes complete the frame, as far as is known (the
    /// header first, then the body). Zero once done or failed.
    pub fn wanted(&self) -> usize {
        match (&self.state, self.body_len) {
            (State::Reading, None) => HEADER_LEN - self.filled,
            (State::Reading, Some(len)) => HEADER_LEN + len - self.filled,
            _ => 0,
        }
    }

    /// Take bytes from `input` up to the end of the frame and return how many
    /// were taken; bytes after the frame are left. On an error the bytes
    /// taken are [`consumed`](Self::consumed), and the decoder stays failed,
    /// returning the same error again.
    pub fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError> {
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
        if self.body_len.is_none() {
            self.body_len = check_header(&self.buf[..self.filled])?;
        }
        if let Some(len) = self.body_len {
            if self.filled == HEADER_LEN + len && matches!(self.state, State::Reading) {
                self.state = State::Done(parse_hello_body(&self.buf[HEADER_LEN..self.filled])?);
            }
        }
        Ok(())
    }

    /// The decoded hello, once the whole frame was fed.
    pub fn hello(&self) -> Option<&Hello> {
        match &self.state {
            State::Done(hello) => Some(hello),
            _ => None,
        }
    }

    /// How many bytes were taken so far.
    pub fn consumed(&self) -> usize {
        self.filled
    }
}

impl Default for HelloDecoder {
    fn default() -> HelloDecoder {
        HelloDecoder::new()
    }
}
