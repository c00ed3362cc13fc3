//! The envelope of every SEND between two mwcap endpoints.
//!
//! ```text
//! frame   := version:u8 (=1) kind:u8 body
//! kind 1  Request  msg_id:u64 header_len:u16 header attaches
//! kind 2  Reply    msg_id:u64 status:u8 header_len:u16 header attaches
//! kind 3  Engine   engine:u8 rest-of-frame  (a mwcap-mw or mwcap-fallback message)
//! attaches := count:u8 (at most MAX_ATTACH) { engine:u8 (1 mw, 2 confirm) len:u16 bytes }
//! ```
//! All integers little-endian. The decoder reads untrusted bytes: it never
//! panics, checks every length against what is left and against
//! [`MAX_FRAME`], and rejects trailing bytes.

use std::fmt;

/// The largest frame an endpoint sends or accepts (one receive buffer).
pub const MAX_FRAME: usize = 4096;
/// The largest application header in a request or reply.
pub const MAX_HEADER: usize = 2048;
/// The most engine messages one request or reply carries (a grant or offer
/// for its payload, a fetch for the reply, a piggybacked release).
pub const MAX_ATTACH: usize = 4;
const VERSION: u8 = 1;

/// Which protocol engine a message or attachment belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineTag {
    /// `mwcap-mw` (memory-window leases).
    Mw,
    /// `mwcap-fallback` (confirm protocol).
    Confirm,
}

impl EngineTag {
    fn to_u8(self) -> u8 {
        match self {
            EngineTag::Mw => 1,
            EngineTag::Confirm => 2,
        }
    }
    fn from_u8(b: u8) -> Result<Option<EngineTag>, FrameError> {
        match b {
            0 => Ok(None),
            1 => Ok(Some(EngineTag::Mw)),
            2 => Ok(Some(EngineTag::Confirm)),
            other => Err(FrameError::UnknownEngine(other)),
        }
    }
}

/// An engine message carried along with a request or reply (a grant, an offer).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attach {
    /// Whose message.
    pub engine: EngineTag,
    /// The engine's own encoding.
    pub bytes: Vec<u8>,
}

/// One decoded frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Frame {
    /// A client's request.
    Request {
        /// The request's id on this connection.
        msg_id: u64,
        /// The application's header bytes.
        header: Vec<u8>,
        /// Engine messages riding along: the exposure of the request's
        /// payload, a confirm-policy fetch of the reply.
        attach: Vec<Attach>,
    },
    /// A server's reply.
    Reply {
        /// The request answered.
        msg_id: u64,
        /// 0 for success; otherwise an application or mwcap error code.
        status: u8,
        /// The application's header bytes.
        header: Vec<u8>,
        /// Engine messages riding along: the exposure of the reply's payload,
        /// the release of the request's payload.
        attach: Vec<Attach>,
    },
    /// A message for a protocol engine (release, confirm, answer...).
    Engine(Attach),
}

/// Why a frame was rejected. The connection treats each as peer misbehaviour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than the frame's fields need.
    #[error("frame truncated: needed {needed} more bytes at offset {at}")]
    Truncated {
        /// Where the read stopped.
        at: usize,
        /// How many more bytes were needed.
        needed: usize,
    },
    /// Bytes left over after the frame.
    #[error("{0} trailing bytes after the frame")]
    Trailing(usize),
    /// A version this build does not speak.
    #[error("frame version {0}, this build speaks version {VERSION}; upgrade the older side")]
    Version(u8),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// An unknown engine tag.
    #[error("unknown engine tag {0}")]
    UnknownEngine(u8),
    /// A frame or header larger than allowed.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Which field.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let left = self.buf.len() - self.at;
        if left < n {
            return Err(FrameError::Truncated { at: self.at, needed: n - left });
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn header(&mut self) -> Result<Vec<u8>, FrameError> {
        let len = self.u16()? as usize;
        if len > MAX_HEADER {
            return Err(FrameError::TooLarge { what: "header", len, max: MAX_HEADER });
        }
        Ok(self.take(len)?.to_vec())
    }
    fn attaches(&mut self) -> Result<Vec<Attach>, FrameError> {
        let count = self.u8()? as usize;
        if count > MAX_ATTACH {
            return Err(FrameError::TooLarge { what: "attachment count", len: count, max: MAX_ATTACH });
        }
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            let engine = EngineTag::from_u8(self.u8()?)?.ok_or(FrameError::UnknownEngine(0))?;
            let len = self.u16()? as usize;
            out.push(Attach { engine, bytes: self.take(len)?.to_vec() });
        }
        Ok(out)
    }
}

/// A cursor writing into a caller's slice (a control slot of registered
/// memory): encoding allocates nothing.
struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        let end = self.at + bytes.len();
        if end > self.out.len() {
            return Err(FrameError::TooLarge { what: "frame", len: end, max: self.out.len().min(MAX_FRAME) });
        }
        self.out[self.at..end].copy_from_slice(bytes);
        self.at = end;
        Ok(())
    }
    fn header(&mut self, header: &[u8]) -> Result<(), FrameError> {
        check_header(header)?;
        self.put(&(header.len() as u16).to_le_bytes())?;
        self.put(header)
    }
    fn attaches(&mut self, attach: &[Attach]) -> Result<(), FrameError> {
        if attach.len() > MAX_ATTACH {
            return Err(FrameError::TooLarge { what: "attachment count", len: attach.len(), max: MAX_ATTACH });
        }
        self.put(&[attach.len() as u8])?;
        for a in attach {
            if a.bytes.len() > MAX_FRAME {
                return Err(FrameError::TooLarge { what: "attachment", len: a.bytes.len(), max: MAX_FRAME });
            }
            self.put(&[a.engine.to_u8()])?;
            self.put(&(a.bytes.len() as u16).to_le_bytes())?;
            self.put(&a.bytes)?;
        }
        Ok(())
    }
}

impl Frame {
    /// Encode; fails when the result would exceed [`MAX_FRAME`] or a header [`MAX_HEADER`].
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut out = vec![0; MAX_FRAME];
        let n = self.encode_into(&mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Encode straight into `out` (a control slot); returns the length.
    /// Fails when the frame does not fit `out` or [`MAX_FRAME`].
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, FrameError> {
        let limit = out.len().min(MAX_FRAME);
        let mut w = Writer { out: &mut out[..limit], at: 0 };
        w.put(&[VERSION])?;
        match self {
            Frame::Request { msg_id, header, attach } => {
                w.put(&[1])?;
                w.put(&msg_id.to_le_bytes())?;
                w.header(header)?;
                w.attaches(attach)?;
            }
            Frame::Reply { msg_id, status, header, attach } => {
                w.put(&[2])?;
                w.put(&msg_id.to_le_bytes())?;
                w.put(&[*status])?;
                w.header(header)?;
                w.attaches(attach)?;
            }
            Frame::Engine(a) => {
                w.put(&[3, a.engine.to_u8()])?;
                w.put(&a.bytes)?;
            }
        }
        Ok(w.at)
    }

    /// Decode one frame from untrusted bytes.
    pub fn decode(buf: &[u8]) -> Result<Frame, FrameError> {
        if buf.len() > MAX_FRAME {
            return Err(FrameError::TooLarge { what: "frame", len: buf.len(), max: MAX_FRAME });
        }
        let mut r = Reader { buf, at: 0 };
        let version = r.u8()?;
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let frame = match r.u8()? {
            1 => Frame::Request { msg_id: r.u64()?, header: r.header()?, attach: r.attaches()? },
            2 => Frame::Reply { msg_id: r.u64()?, status: r.u8()?, header: r.header()?, attach: r.attaches()? },
            3 => {
                let engine = EngineTag::from_u8(r.u8()?)?.ok_or(FrameError::UnknownEngine(0))?;
                let bytes = r.take(buf.len() - r.at)?.to_vec();
                Frame::Engine(Attach { engine, bytes })
            }
            k => return Err(FrameError::UnknownKind(k)),
        };
        if r.at != buf.len() {
            return Err(FrameError::Trailing(buf.len() - r.at));
        }
        Ok(frame)
    }
}

fn check_header(h: &[u8]) -> Result<(), FrameError> {
    if h.len() > MAX_HEADER {
        return Err(FrameError::TooLarge { what: "header", len: h.len(), max: MAX_HEADER });
    }
    Ok(())
}

impl fmt::Display for EngineTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineTag::Mw => "mw",
            EngineTag::Confirm => "confirm",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attach() -> impl Strategy<Value = Vec<Attach>> {
        proptest::collection::vec(
            (prop_oneof![Just(EngineTag::Mw), Just(EngineTag::Confirm)], proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(engine, bytes)| Attach { engine, bytes }),
            0..=MAX_ATTACH,
        )
    }

    fn frames() -> impl Strategy<Value = Frame> {
        let header = || proptest::collection::vec(any::<u8>(), 0..128);
        prop_oneof![
            (any::<u64>(), header(), attach()).prop_map(|(msg_id, header, attach)| Frame::Request {
                msg_id,
                header,
                attach
            }),
            (any::<u64>(), any::<u8>(), header(), attach()).prop_map(|(msg_id, status, header, attach)| {
                Frame::Reply { msg_id, status, header, attach }
            }),
            (prop_oneof![Just(EngineTag::Mw), Just(EngineTag::Confirm)], proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(engine, bytes)| Frame::Engine(Attach { engine, bytes })),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(f in frames()) {
            let bytes = f.encode().unwrap();
            prop_assert_eq!(Frame::decode(&bytes).unwrap(), f);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = Frame::decode(&bytes);
        }

        #[test]
        fn every_truncation_is_an_error(f in frames()) {
            let bytes = f.encode().unwrap();
            // Engine frames run to the end, so a shorter one can still parse; all others must not.
            if !matches!(f, Frame::Engine(_)) {
                for n in 0..bytes.len() {
                    prop_assert!(Frame::decode(&bytes[..n]).is_err());
                }
            }
        }
    }

    #[test]
    fn rejects_wrong_version_and_trailing_bytes() {
        let f = Frame::Request { msg_id: 7, header: b"hi".to_vec(), attach: vec![] };
        let mut b = f.encode().unwrap();
        b.push(0);
        assert_eq!(Frame::decode(&b), Err(FrameError::Trailing(1)));
        b.pop();
        b[0] = 9;
        assert_eq!(Frame::decode(&b), Err(FrameError::Version(9)));
    }

    #[test]
    fn oversized_header_is_refused_both_ways() {
        let f = Frame::Request { msg_id: 1, header: vec![0; MAX_HEADER + 1], attach: vec![] };
        assert!(matches!(f.encode(), Err(FrameError::TooLarge { .. })));
        let mut b = vec![1, 1];
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&((MAX_HEADER + 1) as u16).to_le_bytes());
        assert!(matches!(Frame::decode(&b), Err(FrameError::TooLarge { what: "header", .. })));
    }
}
