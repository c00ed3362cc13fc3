//! The frames of the auth phase, and the tag that follows a hello.
//!
//! ```text
//! auth init      (kind 2, 33 bytes, client -> server): mode u8 | client nonce [32]
//! auth challenge (kind 3, 33 bytes, server -> client): mode u8 | server nonce [32]
//! auth proof     (kind 4, 32 bytes, client first, then server): HMAC-SHA256 [32]
//! auth reject    (kind 5,  1 byte,  either way): reason u8
//! hello tag      (kind 6, 32 bytes, after each hello under a key): HMAC-SHA256 [32]
//! ```
//!
//! What the MACs cover is in [`auth`](crate::bootstrap::auth).

use super::{decode_frame, kind, put_header, Body, DecodeError, FrameReader, Message, HEADER_LEN};

/// Bytes in a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes in a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Bytes in an init or challenge body: the mode and a nonce.
pub const AUTH_HELLO_BODY_LEN: usize = 1 + NONCE_LEN;

/// How a side runs the auth phase, as announced in its init or challenge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AuthMode {
    /// No key: nothing is proved (wire value 0).
    Unauthenticated,
    /// Both sides prove a pre-shared key with HMAC-SHA256 (wire value 1).
    PreSharedKey,
}

impl AuthMode {
    fn bits(self) -> u8 {
        match self {
            AuthMode::Unauthenticated => 0,
            AuthMode::PreSharedKey => 1,
        }
    }
}

/// Why a side refuses to go on, as sent in a reject frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The sender requires a key; the receiver offered none (wire value 1).
    KeyRequired,
    /// The sender runs without a key, so it cannot prove one (wire value 2).
    NoKey,
    /// The receiver's proof does not match the sender's key (wire value 3).
    BadProof,
}

impl RejectReason {
    fn bits(self) -> u8 {
        match self {
            RejectReason::KeyRequired => 1,
            RejectReason::NoKey => 2,
            RejectReason::BadProof => 3,
        }
    }
}

/// A frame of the auth phase (or the tag after a hello).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AuthFrame {
    /// The client's opening: how it runs and its fresh nonce.
    Init {
        /// The client's mode.
        mode: AuthMode,
        /// The client's nonce.
        nonce: [u8; NONCE_LEN],
    },
    /// The server's answer: how it runs and its fresh nonce.
    Challenge {
        /// The server's mode.
        mode: AuthMode,
        /// The server's nonce.
        nonce: [u8; NONCE_LEN],
    },
    /// A proof of the key: the client's, then the server's.
    Proof([u8; MAC_LEN]),
    /// The sender stops here.
    Reject(RejectReason),
    /// Binds the hello frame just before it to this session.
    HelloTag([u8; MAC_LEN]),
}

impl AuthFrame {
    fn kind(&self) -> u8 {
        match self {
            AuthFrame::Init { .. } => kind::AUTH_INIT,
            AuthFrame::Challenge { .. } => kind::AUTH_CHALLENGE,
            AuthFrame::Proof(_) => kind::AUTH_PROOF,
            AuthFrame::Reject(_) => kind::AUTH_REJECT,
            AuthFrame::HelloTag(_) => kind::HELLO_TAG,
        }
    }

    /// What the frame is, for an error that names what arrived.
    pub fn name(&self) -> &'static str {
        kind::name(self.kind()).unwrap_or("an auth frame")
    }
}

/// Encode an auth frame.
pub fn encode_auth(frame: &AuthFrame) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + AUTH_HELLO_BODY_LEN);
    let body_len = AuthFrame::body_len(frame.kind()).unwrap_or(0);
    put_header(&mut out, frame.kind(), body_len);
    match frame {
        AuthFrame::Init { mode, nonce } | AuthFrame::Challenge { mode, nonce } => {
            out.push(mode.bits());
            out.extend_from_slice(nonce);
        }
        AuthFrame::Proof(mac) | AuthFrame::HelloTag(mac) => out.extend_from_slice(mac),
        AuthFrame::Reject(reason) => out.push(reason.bits()),
    }
    debug_assert_eq!(out.len(), HEADER_LEN + body_len);
    out
}

/// Decode exactly one auth frame. Bytes after the frame are an error.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub fn decode_auth(bytes: &[u8]) -> Result<AuthFrame, DecodeError> {
    decode_frame(bytes)
}

impl Message for AuthFrame {
    fn body_len(k: u8) -> Result<usize, DecodeError> {
        match k {
            kind::AUTH_INIT | kind::AUTH_CHALLENGE => Ok(AUTH_HELLO_BODY_LEN),
            kind::AUTH_PROOF | kind::HELLO_TAG => Ok(MAC_LEN),
            kind::AUTH_REJECT => Ok(1),
            k => Err(kind::unexpected(k, "an auth frame")),
        }
    }

    fn parse(k: u8, body: &[u8]) -> Result<AuthFrame, DecodeError> {
        let expected = AuthFrame::body_len(k)?;
        if body.len() != expected {
            return Err(DecodeError::BadLength { got: body.len(), expected });
        }
        let mut b = Body(body);
        let frame = match k {
            kind::AUTH_INIT | kind::AUTH_CHALLENGE => {
                let mode = match b.u8() {
                    0 => AuthMode::Unauthenticated,
                    1 => AuthMode::PreSharedKey,
                    m => {
                        return Err(DecodeError::InvalidField {
                            field: "auth mode",
                            value: m.into(),
                            expected: "0 (no key) or 1 (pre-shared key)",
                        })
                    }
                };
                let nonce = b.take();
                if k == kind::AUTH_INIT {
                    AuthFrame::Init { mode, nonce }
                } else {
                    AuthFrame::Challenge { mode, nonce }
                }
            }
            kind::AUTH_PROOF => AuthFrame::Proof(b.take()),
            kind::HELLO_TAG => AuthFrame::HelloTag(b.take()),
            kind::AUTH_REJECT => AuthFrame::Reject(match b.u8() {
                1 => RejectReason::KeyRequired,
                2 => RejectReason::NoKey,
                3 => RejectReason::BadProof,
                r => {
                    return Err(DecodeError::InvalidField {
                        field: "reject reason",
                        value: r.into(),
                        expected: "1, 2 or 3",
                    })
                }
            }),
            k => return Err(DecodeError::UnknownKind(k)),
        };
        Ok(frame)
    }
}

/// A streaming auth frame decoder, used like [`HelloDecoder`](super::HelloDecoder):
/// read at most [`wanted`](Self::wanted) bytes, [`feed`](Self::feed) them,
/// until [`frame`](Self::frame) is `Some`.
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub struct AuthDecoder(FrameReader<AuthFrame>);

#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
impl AuthDecoder {
    /// A decoder waiting for the first byte.
    pub fn new() -> AuthDecoder {
        AuthDecoder(FrameReader::new())
    }

    /// How many more bytes complete the frame, as far as is known. Zero once
    /// done or failed.
    pub fn wanted(&self) -> usize {
        self.0.wanted()
    }

    /// Take bytes from `input` up to the end of the frame and return how many
    /// were taken; bytes after the frame are left. On an error the decoder
    /// stays failed, returning the same error again.
    pub fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError> {
        self.0.feed(input)
    }

    /// The decoded frame, once it was all fed.
    pub fn frame(&self) -> Option<&AuthFrame> {
        self.0.message()
    }

    /// How many bytes were taken so far.
    pub fn consumed(&self) -> usize {
        self.0.frame().len()
    }
}

impl Default for AuthDecoder {
    fn default() -> AuthDecoder {
        AuthDecoder::new()
    }
}
