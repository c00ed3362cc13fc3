//! The confirm protocol's messages and their versioned wire encoding.
//!
//! Every message is a fixed-size little-endian header:
//!
//! ```text
//! byte 0      version (WIRE_VERSION = 1)
//! byte 1      kind: 1 Fetch, 2 Offer, 3 Expose, 4 Confirm, 5 ConfirmReply, 6 Refuse
//! bytes 2..   the kind's fields, in the order of the variant's docs:
//!   Fetch         msg u64, attempt u32                                  (14 bytes)
//!   Offer/Expose  msg u64, buffer u32, generation u64, addr u64,
//!                 len u32, rkey u32                                     (38 bytes)
//!   Confirm       msg u64, buffer u32, generation u64                   (22 bytes)
//!   ConfirmReply  msg u64, buffer u32, generation u64, verdict u8       (23 bytes)
//!                 verdict: 1 Intact, 2 Reused, 3 Unknown
//!   Refuse        msg u64                                               (10 bytes)
//! ```
//!
//! Bytes after the header are not the engine's: [`Message::decode`] returns
//! them untouched, so a driver may frame application bytes behind a message in
//! the same SEND. A receiver rejects a version it does not know rather than
//! guessing; a later version may add kinds or fields, never reinterpret these.

use std::fmt;

use crate::ids::{BufferId, Generation, MsgId, Region};

/// The version byte this crate writes and the only one it reads.
pub const WIRE_VERSION: u8 = 1;

/// The longest encoded message (an `Offer` or `Expose`), in bytes.
pub const MAX_ENCODED_LEN: usize = 38;

/// The owner's answer to a [`Message::Confirm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The buffer was held for exactly this (msg id, buffer, generation) from
    /// the offer until this answer: the bytes read are the ones offered.
    Intact,
    /// The buffer was taken back since that generation was offered: the bytes
    /// read may be anything; discard them.
    Reused,
    /// The owner never issued this (msg id, buffer, generation), or no longer
    /// knows it. A reader treats it exactly like [`Verdict::Reused`].
    Unknown,
}

impl Verdict {
    /// Whether the read may be used ([`Verdict::Intact`] only).
    pub fn is_intact(self) -> bool {
        self == Verdict::Intact
    }
}

/// A confirm-protocol message. Produced by the engines in
/// [`Action::Send`](crate::Action::Send), consumed by their `handle_message`.
///
/// The variants are public so that tests and tools can build any message,
/// including forged ones: the engines never trust a message's contents beyond
/// matching it against their own state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Message {
    /// Client to server (direction 1): "offer me the reply data of `msg`".
    /// `attempt` is 1 for the first ask and counts up on each retry after a
    /// stale read.
    Fetch {
        /// The request.
        msg: MsgId,
        /// 1, 2, …, at most the client's `max_attempts`.
        attempt: u32,
    },
    /// Server to client (direction 1): the reply data of `msg` lies in
    /// `region`, held as `buffer` at `generation`.
    Offer {
        /// The request this answers.
        msg: MsgId,
        /// The server's buffer.
        buffer: BufferId,
        /// The buffer's generation for this exposure.
        generation: Generation,
        /// Where to READ.
        region: Region,
    },
    /// Client to server (direction 2): a new request `msg` whose data lies in
    /// `region`, held as `buffer` at `generation`.
    Expose {
        /// The new request.
        msg: MsgId,
        /// The client's buffer.
        buffer: BufferId,
        /// The buffer's generation for this exposure.
        generation: Generation,
        /// Where to READ.
        region: Region,
    },
    /// Reader to owner, sent only after the READ completed successfully: "was
    /// `buffer` still held for `msg` at `generation` when you read this?"
    Confirm {
        /// The request.
        msg: MsgId,
        /// The owner's buffer named in the offer.
        buffer: BufferId,
        /// The generation named in the offer.
        generation: Generation,
    },
    /// Owner to reader: the answer to the confirm with the same three ids.
    ConfirmReply {
        /// The request.
        msg: MsgId,
        /// The buffer asked about.
        buffer: BufferId,
        /// The generation asked about.
        generation: Generation,
        /// The answer.
        verdict: Verdict,
    },
    /// Either way: `msg` will not be served (a fetch the server cannot answer,
    /// or an exposed request the server will not read).
    Refuse {
        /// The request.
        msg: MsgId,
    },
}

/// Why bytes are not a message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the message needs.
    Truncated {
        /// Bytes the message needs.
        needed: usize,
        /// Bytes there were.
        got: usize,
    },
    /// A version this crate does not speak.
    UnsupportedVersion(u8),
    /// A kind byte this version does not define.
    UnknownKind(u8),
    /// A verdict byte this version does not define.
    UnknownVerdict(u8),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated { needed, got } => {
                write!(f, "confirm message truncated: needs {needed} bytes, got {got}; the peer is broken")
            }
            DecodeError::UnsupportedVersion(v) => write!(
                f,
                "confirm message has wire version {v}, this side speaks {WIRE_VERSION}; upgrade one side"
            ),
            DecodeError::UnknownKind(k) => {
                write!(f, "confirm message has unknown kind {k}; the peer is broken or newer")
            }
            DecodeError::UnknownVerdict(v) => {
                write!(f, "confirm reply has unknown verdict {v}; the peer is broken or newer")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

const KIND_FETCH: u8 = 1;
const KIND_OFFER: u8 = 2;
const KIND_EXPOSE: u8 = 3;
const KIND_CONFIRM: u8 = 4;
const KIND_REPLY: u8 = 5;
const KIND_REFUSE: u8 = 6;

impl Message {
    /// The request this message is about.
    pub fn msg(&self) -> MsgId {
        match *self {
            Message::Fetch { msg, .. }
            | Message::Offer { msg, .. }
            | Message::Expose { msg, .. }
            | Message::Confirm { msg, .. }
            | Message::ConfirmReply { msg, .. }
            | Message::Refuse { msg } => msg,
        }
    }

    /// The encoded length in bytes (at most [`MAX_ENCODED_LEN`]).
    pub fn encoded_len(&self) -> usize {
        2 + match self {
            Message::Fetch { .. } => 12,
            Message::Offer { .. } | Message::Expose { .. } => 36,
            Message::Confirm { .. } => 20,
            Message::ConfirmReply { .. } => 21,
            Message::Refuse { .. } => 8,
        }
    }

    /// Appends the encoding to `out`.
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
        match *self {
            Message::Fetch { msg, attempt } => {
                out.push(KIND_FETCH);
                out.extend_from_slice(&msg.raw().to_le_bytes());
                out.extend_from_slice(&attempt.to_le_bytes());
            }
            Message::Offer { msg, buffer, generation, region }
            | Message::Expose { msg, buffer, generation, region } => {
                out.push(if matches!(self, Message::Offer { .. }) { KIND_OFFER } else { KIND_EXPOSE });
                put_ids(out, msg, buffer, generation);
                out.extend_from_slice(&region.addr().to_le_bytes());
                out.extend_from_slice(&region.len().to_le_bytes());
                out.extend_from_slice(&region.rkey().to_le_bytes());
            }
            Message::Confirm { msg, buffer, generation } => {
                out.push(KIND_CONFIRM);
                put_ids(out, msg, buffer, generation);
            }
            Message::ConfirmReply { msg, buffer, generation, verdict } => {
                out.push(KIND_REPLY);
                put_ids(out, msg, buffer, generation);
                out.push(match verdict {
                    Verdict::Intact => 1,
                    Verdict::Reused => 2,
                    Verdict::Unknown => 3,
                });
            }
            Message::Refuse { msg } => {
                out.push(KIND_REFUSE);
                out.extend_from_slice(&msg.raw().to_le_bytes());
            }
        }
    }

    /// The encoding as a new vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out
    }

    /// Decodes one message from the front of untrusted `bytes`; returns it and
    /// the bytes after it. Never panics, whatever the input.
    pub fn decode(bytes: &[u8]) -> Result<(Message, &[u8]), DecodeError> {
        let mut r = Reader { bytes, pos: 0 };
        let version = r.u8()?;
        if version != WIRE_VERSION {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let kind = r.u8()?;
        let needed = match kind {
            KIND_FETCH => 14,
            KIND_OFFER | KIND_EXPOSE => 38,
            KIND_CONFIRM => 22,
            KIND_REPLY => 23,
            KIND_REFUSE => 10,
            other => return Err(DecodeError::UnknownKind(other)),
        };
        if bytes.len() < needed {
            return Err(DecodeError::Truncated { needed, got: bytes.len() });
        }
        let msg = MsgId::from_raw(r.u64()?);
        let message = match kind {
            KIND_FETCH => Message::Fetch { msg, attempt: r.u32()? },
            KIND_REFUSE => Message::Refuse { msg },
            _ => {
                let buffer = BufferId::from_raw(r.u32()?);
                let generation = Generation::from_raw(r.u64()?);
                match kind {
                    KIND_CONFIRM => Message::Confirm { msg, buffer, generation },
                    KIND_REPLY => {
                        let verdict = match r.u8()? {
                            1 => Verdict::Intact,
                            2 => Verdict::Reused,
                            3 => Verdict::Unknown,
                            other => return Err(DecodeError::UnknownVerdict(other)),
                        };
                        Message::ConfirmReply { msg, buffer, generation, verdict }
                    }
                    _ => {
                        let region = Region::new(r.u64()?, r.u32()?, r.u32()?);
                        if kind == KIND_OFFER {
                            Message::Offer { msg, buffer, generation, region }
                        } else {
                            Message::Expose { msg, buffer, generation, region }
                        }
                    }
                }
            }
        };
        Ok((message, &bytes[r.pos..]))
    }
}

fn put_ids(out: &mut Writer<'_>, msg: MsgId, buffer: BufferId, generation: Generation) {
    out.extend_from_slice(&msg.raw().to_le_bytes());
    out.extend_from_slice(&buffer.raw().to_le_bytes());
    out.extend_from_slice(&generation.raw().to_le_bytes());
}

/// A bounds-checked cursor: every read returns `Truncated` instead of panicking.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let end = self.pos.checked_add(N).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(DecodeError::Truncated { needed: self.pos.saturating_add(N), got: self.bytes.len() });
        };
        let mut out = [0u8; N];
        out.copy_from_slice(&self.bytes[self.pos..end]);
        self.pos = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
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

    fn samples() -> Vec<Message> {
        let (m, b, g) = (MsgId::from_raw(7), BufferId::from_raw(3), Generation::from_raw(u64::MAX));
        let region = Region::new(0xdead_beef_0000, 4096, 0x1234_5678);
        vec![
            Message::Fetch { msg: m, attempt: 2 },
            Message::Offer { msg: m, buffer: b, generation: g, region },
            Message::Expose { msg: m, buffer: b, generation: g, region },
            Message::Confirm { msg: m, buffer: b, generation: g },
            Message::ConfirmReply { msg: m, buffer: b, generation: g, verdict: Verdict::Intact },
            Message::ConfirmReply { msg: m, buffer: b, generation: g, verdict: Verdict::Reused },
            Message::ConfirmReply { msg: m, buffer: b, generation: g, verdict: Verdict::Unknown },
            Message::Refuse { msg: m },
        ]
    }

    #[test]
    fn every_kind_round_trips_and_keeps_trailing_bytes() {
        for m in samples() {
            let mut bytes = m.to_bytes();
            assert_eq!(bytes.len(), m.encoded_len());
            assert!(bytes.len() <= MAX_ENCODED_LEN);
            bytes.extend_from_slice(b"app");
            let (back, rest) = Message::decode(&bytes).unwrap();
            assert_eq!(back, m);
            assert_eq!(rest, b"app");
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for m in samples() {
            let bytes = m.to_bytes();
            for cut in 0..bytes.len() {
                match Message::decode(&bytes[..cut]) {
                    Err(DecodeError::Truncated { needed, got }) => {
                        assert_eq!(got, cut);
                        assert!(needed > cut);
                    }
                    other => panic!("{m:?} cut at {cut}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn wrong_version_kind_and_verdict_are_rejected() {
        let mut bytes = samples()[4].to_bytes();
        bytes[0] = 2;
        assert_eq!(Message::decode(&bytes).unwrap_err(), DecodeError::UnsupportedVersion(2));
        bytes[0] = WIRE_VERSION;
        bytes[1] = 0;
        assert_eq!(Message::decode(&bytes).unwrap_err(), DecodeError::UnknownKind(0));
        bytes[1] = KIND_REPLY;
        bytes[22] = 9;
        assert_eq!(Message::decode(&bytes).unwrap_err(), DecodeError::UnknownVerdict(9));
        assert!(DecodeError::UnknownVerdict(9).to_string().contains("unknown verdict 9"));
    }

    #[test]
    fn layout_is_little_endian_and_fixed() {
        let bytes = Message::Confirm {
            msg: MsgId::from_raw(0x0102),
            buffer: BufferId::from_raw(5),
            generation: Generation::from_raw(9),
        }
        .to_bytes();
        assert_eq!(bytes[..4], [1, KIND_CONFIRM, 0x02, 0x01]);
        assert_eq!(bytes[10..14], [5, 0, 0, 0]);
        assert_eq!(bytes[14], 9);
    }
}
