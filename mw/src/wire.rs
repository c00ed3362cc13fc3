//! The two messages of the MW policy and their wire encoding.
//!
//! Every message starts with a version byte ([`WIRE_VERSION`]) and a type
//! byte, followed by fixed-size little-endian fields:
//!
//! | type | message | fields (after the two header bytes) | total |
//! |---|---|---|---|
//! | 1 | [`Grant`] | lease u64, addr u64, len u32, rkey u32, time left in µs u32 | 30 bytes |
//! | 2 | [`Release`] | lease u64, rkey u32 | 14 bytes |
//! | 3 | [`Release`] unread (the grant was declined) | lease u64, rkey u32 | 14 bytes |
//!
//! A message is exactly that long: trailing bytes are an error, so a
//! truncated or padded frame is never half-understood. A later version that
//! adds fields bumps the version byte. [`Message::decode`] never panics, on
//! any input.

use std::fmt;
use std::time::Duration;

use crate::LeaseId;

/// The version byte this crate writes and accepts.
pub const WIRE_VERSION: u8 = 1;
/// The longest lease time a [`Grant`] can carry (`u32::MAX` microseconds,
/// about 71 minutes).
pub const MAX_LEASE_TIME: Duration = Duration::from_micros(u32::MAX as u64);

const TYPE_GRANT: u8 = 1;
const TYPE_RELEASE: u8 = 2;
const TYPE_RELEASE_UNREAD: u8 = 3;
const GRANT_LEN: usize = 30;
const RELEASE_LEN: usize = 14;

/// The owner's offer: READ `len` bytes at `addr` through `rkey` within
/// `time_left`. Sent in the SEND chained after the bind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Grant {
    /// The lease, to echo in the [`Release`].
    pub lease: LeaseId,
    /// The remote address of the first byte.
    pub addr: u64,
    /// Bytes the window covers (exactly the buffer).
    pub len: u32,
    /// The window's rkey for this bind.
    pub rkey: u32,
    /// How long the window stays bound, counted from when the owner posted
    /// the grant. Microsecond resolution on the wire (truncated).
    pub time_left: Duration,
}

/// The reader is done with a lease: it will not READ through it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Release {
    /// The lease being released.
    pub lease: LeaseId,
    /// The rkey the grant carried; the owner ignores a release whose rkey is
    /// not the window's current one.
    pub rkey: u32,
    /// The reader declined the grant: it did not READ through it, and
    /// drops whatever the data was for (the owner's
    /// [`LeaseEnd::Unread`](crate::LeaseEnd::Unread)).
    pub unread: bool,
}

/// Either message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Message {
    /// A [`Grant`].
    Grant(Grant),
    /// A [`Release`].
    Release(Release),
}

/// Why bytes did not decode as a [`Message`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame is shorter than the two header bytes.
    Empty,
    /// The version byte is not [`WIRE_VERSION`].
    UnsupportedVersion(u8),
    /// The type byte names no message of this version.
    UnknownType(u8),
    /// The frame's length is not the message's length.
    BadLength {
        /// The message type.
        kind: &'static str,
        /// The length that message has.
        expected: usize,
        /// The length received.
        got: usize,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Empty => f.write_str("mw message is shorter than its 2-byte header"),
            DecodeError::UnsupportedVersion(v) => {
                write!(
                    f,
                    "mw message has version {v}, this side speaks {WIRE_VERSION}; upgrade the older side"
                )
            }
            DecodeError::UnknownType(t) => write!(f, "mw message type {t} is unknown"),
            DecodeError::BadLength { kind, expected, got } => {
                write!(f, "mw {kind} message must be {expected} bytes, got {got}")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

impl Message {
    /// The encoded length in bytes.
    pub fn encoded_len(&self) -> usize {
        match self {
            Message::Grant(_) => GRANT_LEN,
            Message::Release(_) => RELEASE_LEN,
        }
    }

    /// Append the encoding to `out`. A grant's time left is truncated to
    /// microseconds and saturates at [`MAX_LEASE_TIME`].
    pub fn encode(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.resize(at + self.encoded_len(), 0);
        self.encode_into(&mut out[at..]).expect("sized to encoded_len");
    }

    /// Encode into the front of `out` without allocating; returns the
    /// length, or `None` (and writes nothing) when `out` is shorter than
    /// [`Message::encoded_len`].
    pub fn encode_into(&self, out: &mut [u8]) -> Option<usize> {
        let n = self.encoded_len();
        let out = out.get_mut(..n)?;
        let mut w = Writer { out, at: 0 };
        self.write(&mut w);
        debug_assert_eq!(w.at, n);
        Some(n)
    }

    fn write(&self, out: &mut Writer<'_>) {
        out.push(WIRE_VERSION);
        match self {
            Message::Grant(g) => {
                out.push(TYPE_GRANT);
                out.extend_from_slice(&g.lease.raw().to_le_bytes());
                out.extend_from_slice(&g.addr.to_le_bytes());
                out.extend_from_slice(&g.len.to_le_bytes());
                out.extend_from_slice(&g.rkey.to_le_bytes());
                let micros = u32::try_from(g.time_left.as_micros()).unwrap_or(u32::MAX);
                out.extend_from_slice(&micros.to_le_bytes());
            }
            Message::Release(r) => {
                out.push(if r.unread { TYPE_RELEASE_UNREAD } else { TYPE_RELEASE });
                out.extend_from_slice(&r.lease.raw().to_le_bytes());
                out.extend_from_slice(&r.rkey.to_le_bytes());
            }
        }
    }

    /// The encoding as a fresh vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode(&mut v);
        v
    }

    /// Decode one message that fills `bytes` exactly. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Message, DecodeError> {
        let [version, kind, body @ ..] = bytes else {
            return Err(DecodeError::Empty);
        };
        if *version != WIRE_VERSION {
            return Err(DecodeError::UnsupportedVersion(*version));
        }
        match *kind {
            TYPE_GRANT => {
                let b = exact::<{ GRANT_LEN - 2 }>(body, "grant")?;
                Ok(Message::Grant(Grant {
                    lease: LeaseId::from_raw(u64::from_le_bytes(field(&b, 0))),
                    addr: u64::from_le_bytes(field(&b, 8)),
                    len: u32::from_le_bytes(field(&b, 16)),
                    rkey: u32::from_le_bytes(field(&b, 20)),
                    time_left: Duration::from_micros(u64::from(u32::from_le_bytes(field(&b, 24)))),
                }))
            }
            TYPE_RELEASE | TYPE_RELEASE_UNREAD => {
                let b = exact::<{ RELEASE_LEN - 2 }>(body, "release")?;
                Ok(Message::Release(Release {
                    lease: LeaseId::from_raw(u64::from_le_bytes(field(&b, 0))),
                    rkey: u32::from_le_bytes(field(&b, 8)),
                    unread: *kind == TYPE_RELEASE_UNREAD,
                }))
            }
            other => Err(DecodeError::UnknownType(other)),
        }
    }
}

fn exact<const N: usize>(body: &[u8], kind: &'static str) -> Result<[u8; N], DecodeError> {
    <[u8; N]>::try_from(body).map_err(|_| DecodeError::BadLength {
        kind,
        expected: N + 2,
        got: body.len() + 2,
    })
}

/// `N` bytes of `b` from `at`; callers pass constant in-bounds offsets.
fn field<const N: usize, const M: usize>(b: &[u8; M], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = b.get(at + i).copied().unwrap_or(0);
    }
    out
}

/// A slice known to be long enough (checked against `encoded_len` first).
struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn push(&mut self, b: u8) {
        self.out[self.at] = b;
        self.at += 1;
    }
    fn extend_from_slice(&mut self, s: &[u8]) {
        self.out[self.at..self.at + s.len()].copy_from_slice(s);
        self.at += s.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> Grant {
        Grant {
            lease: LeaseId::new(3, 9),
            addr: 0x7f00_dead_beef,
            len: 4096,
            rkey: 0x0012_34ab,
            time_left: Duration::from_micros(1500),
        }
    }

    #[test]
    fn grant_and_release_round_trip_with_documented_lengths() {
        let g = Message::Grant(grant());
        let r = Message::Release(Release { lease: LeaseId::new(1, 2), rkey: 7, unread: false });
        let unread = Message::Release(Release { lease: LeaseId::new(1, 2), rkey: 7, unread: true });
        assert_eq!((r.to_bytes()[1], unread.to_bytes()[1]), (2, 3), "types 2 and 3");
        for (m, len) in [(g, 30), (r, 14), (unread, 14)] {
            let bytes = m.to_bytes();
            assert_eq!(bytes.len(), len);
            assert_eq!(bytes.len(), m.encoded_len());
            assert_eq!(Message::decode(&bytes), Ok(m));
        }
    }

    #[test]
    fn time_left_is_truncated_to_micros_and_saturates() {
        let mut g = grant();
        g.time_left = Duration::from_nanos(2_999);
        let Ok(Message::Grant(back)) = Message::decode(&Message::Grant(g).to_bytes()) else { panic!() };
        assert_eq!(back.time_left, Duration::from_micros(2));
        g.time_left = Duration::from_secs(1 << 40);
        let Ok(Message::Grant(back)) = Message::decode(&Message::Grant(g).to_bytes()) else { panic!() };
        assert_eq!(back.time_left, MAX_LEASE_TIME);
    }

    #[test]
    fn malformed_frames_are_errors() {
        let good = Message::Grant(grant()).to_bytes();
        assert_eq!(Message::decode(&[]), Err(DecodeError::Empty));
        assert_eq!(Message::decode(&[1]), Err(DecodeError::Empty));
        let mut v = good.clone();
        v[0] = 2;
        assert_eq!(Message::decode(&v), Err(DecodeError::UnsupportedVersion(2)));
        let mut v = good.clone();
        v[1] = 9;
        assert_eq!(Message::decode(&v), Err(DecodeError::UnknownType(9)));
        assert_eq!(
            Message::decode(&good[..29]),
            Err(DecodeError::BadLength { kind: "grant", expected: 30, got: 29 })
        );
        let mut v = good.clone();
        v.push(0);
        assert!(matches!(Message::decode(&v), Err(DecodeError::BadLength { got: 31, .. })));
        assert!(DecodeError::UnknownType(9).to_string().starts_with("mw message type 9"));
    }
}
