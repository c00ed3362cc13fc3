//! The hello message: what each side sends so that the peer can connect
//! its queue pair.
//!
//! ```text
//! hello body (kind 1, 54 bytes):
//!   conn_id u64 | qpn u32 | psn u32 | mtu u16 | lid u16 | gid [16]
//!   | serve u8 | read u8 | required features u16 | optional features u16
//!   | max_message u32 | start_credits u32 | lease_ms u32
//! ```

use crate::backend::{QpEndpoint, QpId};
use crate::bootstrap::caps::{Capabilities, Features, PolicySet, MIN_START_CREDITS};

use super::{decode_frame, kind, put_header, Body, DecodeError, FrameReader, Message, HEADER_LEN};

/// Bytes in a hello body.
pub const HELLO_BODY_LEN: usize = 54;
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
        for (field, value) in [("max_message", c.max_message), ("lease_ms", c.lease_ms)] {
            if value == 0 {
                return Err(DecodeError::InvalidField { field, value: 0, expected: "at least 1" });
            }
        }
        if c.start_credits < MIN_START_CREDITS {
            return Err(DecodeError::InvalidField {
                field: "start_credits",
                value: c.start_credits.into(),
                expected: "at least 3",
            });
        }
        let unknown = c.features.required & !Features::KNOWN_REQUIRED;
        if unknown != 0 {
            return Err(DecodeError::UnknownRequiredFeatures(unknown));
        }
        Ok(())
    }
}

/// Encode a hello as one frame.
pub fn encode(hello: &Hello) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + HELLO_BODY_LEN);
    put_header(&mut out, kind::HELLO, HELLO_BODY_LEN);
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
    out.extend_from_slice(&c.start_credits.to_be_bytes());
    out.extend_from_slice(&c.lease_ms.to_be_bytes());
    debug_assert_eq!(out.len(), HEADER_LEN + HELLO_BODY_LEN);
    out
}

/// Decode exactly one hello frame. Bytes after the frame are an error.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub fn decode(bytes: &[u8]) -> Result<Hello, DecodeError> {
    decode_frame(bytes)
}

impl Message for Hello {
    fn body_len(k: u8) -> Result<usize, DecodeError> {
        match k {
            kind::HELLO => Ok(HELLO_BODY_LEN),
            k => Err(kind::unexpected(k, "a hello")),
        }
    }

    fn parse(_: u8, body: &[u8]) -> Result<Hello, DecodeError> {
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
        let start_credits = b.u32();
        let lease_ms = b.u32();
        let hello = Hello {
            endpoint: QpEndpoint { id: PEER_QP_ID, qpn, gid, psn, mtu, lid },
            caps: Capabilities { serve, read, max_message, start_credits, lease_ms, features },
            conn_id,
        };
        hello.validate()?;
        Ok(hello)
    }
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
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub struct HelloDecoder(FrameReader<Hello>);

#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
impl HelloDecoder {
    /// A decoder waiting for the first byte.
    pub fn new() -> HelloDecoder {
        HelloDecoder(FrameReader::new())
    }

    /// How many more bytes complete the frame, as far as is known (the
    /// header first, then the body). Zero once done or failed.
    pub fn wanted(&self) -> usize {
        self.0.wanted()
    }

    /// Take bytes from `input` up to the end of the frame and return how many
    /// were taken; bytes after the frame are left. On an error the bytes
    /// taken are [`consumed`](Self::consumed), and the decoder stays failed,
    /// returning the same error again.
    pub fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError> {
        self.0.feed(input)
    }

    /// The decoded hello, once the whole frame was fed.
    pub fn hello(&self) -> Option<&Hello> {
        self.0.message()
    }

    /// How many bytes were taken so far.
    pub fn consumed(&self) -> usize {
        self.0.frame().len()
    }

    /// The bytes taken so far: the whole frame, exactly as received, once
    /// [`hello`](Self::hello) is `Some`.
    pub fn frame(&self) -> &[u8] {
        self.0.frame()
    }
}

impl Default for HelloDecoder {
    fn default() -> HelloDecoder {
        HelloDecoder::new()
    }
}
