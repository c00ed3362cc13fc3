//! The envelope of every SEND between two mwcap endpoints.
//!
//! ```text
//! frame   := version:u8 (=2) kind:u8 credit:u16 body
//! kind 1  Request  msg_id:u64 flags:u8 [trace:16 bytes if flags & 1] header_len:u16 header inline attaches
//! kind 2  Reply    msg_id:u64 status:u8 header_len:u16 header inline attaches
//! kind 3  Engine   engine:u8 rest-of-frame  (a mwcap-mw or mwcap-fallback message)
//! kind 4  Ping     seq:u64                  (keepalive, `Config::keepalive`)
//! kind 5  Pong     seq:u64                  (the answer to a ping)
//! kind 6  Credit   (nothing: the header's credit is the message)
//! kind 7  Ask      msg_id:u64 body_len:u16 body attaches  (an ask of the owner's library, `conn::OwnerAsk`)
//! kind 8  Busy     msg_id:u64 limit:u32     (a request refused unread: `Config::max_requests`)
//! kind 9  GiveBack keep:u32                (keep at most `keep` credits; return the rest)
//! kind 10 Returned count:u32               (the answer: `count` credits given back)
//! inline   := len:u16 bytes                (a payload small enough to ride along, `Config::inline_max`)
//! attaches := count:u8 (at most MAX_ATTACH) { engine:u8 (1 mw, 2 confirm) len:u16 bytes }
//! ```
//! All integers little-endian. The decoder reads untrusted bytes: it never
//! panics, checks every length against what is left and against
//! [`MAX_FRAME`], and rejects trailing bytes and unknown flags.
//!
//! `credit` is flow control: the number of receives the sender has posted
//! for its peer since it last said so (see `docs/protocol.md`, "Flow
//! control"). It sits at a fixed offset ([`CREDIT_AT`]) so that a frame
//! staged while it waited for credit gets the grant current when it is
//! finally sent.

use std::fmt;

use super::config::MAX_INLINE;
use super::types::TraceId;

/// The largest frame an endpoint sends or accepts (one receive buffer).
pub const MAX_FRAME: usize = 4096;
/// The largest application header in a request or reply.
pub const MAX_HEADER: usize = 2048;
/// The most engine messages one request or reply carries (a grant or offer
/// for its payload, a fetch for the reply, a piggybacked release).
pub const MAX_ATTACH: usize = 4;
const VERSION: u8 = 2;
/// Where the credit field is in every frame (after version and kind).
pub const CREDIT_AT: usize = 2;
/// The default of [`Config::start_credits`](super::Config::start_credits):
/// the frames a peer may send before this side's first grant (the receives
/// this side holds for it at the start).
pub const INITIAL_CREDITS: u32 = 8;
/// The least [`Config::start_credits`](super::Config::start_credits) may be,
/// which is also the least a connection's share of a shared receive queue
/// can be: with 2, a peer down to its last credit could wait for a grant
/// that never comes (`docs/protocol.md`, "Flow control").
pub const MIN_START_CREDITS: u32 = crate::bootstrap::MIN_START_CREDITS;
/// Whether a received frame (its bytes) is work: all but flow control
/// and keepalive (ping, pong, credit, give-back, returned), which an idle
/// peer sends too. Only work grows a connection's share of a shared
/// receive queue, or keeps the peer from counting as idle
/// (`Config::give_back_after`).
pub(crate) fn grows_share(bytes: &[u8]) -> bool {
    !matches!(bytes.get(1).copied(), Some(4 | 5 | 6 | GIVE_BACK | RETURNED))
}

/// The kind byte of [`Frame::GiveBack`].
pub(crate) const GIVE_BACK: u8 = 9;
/// The kind byte of [`Frame::Returned`].
pub(crate) const RETURNED: u8 = 10;

/// Request flag: a 16-byte trace id follows.
const FLAG_TRACE: u8 = 1;

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

/// The longest engine message an attachment carries (the longest today is
/// a confirm `Offer`, 38 bytes).
pub const MAX_ATTACH_LEN: usize = 64;

/// An engine message carried along with a request or reply (a grant, an
/// offer), held inline: building or decoding one allocates nothing.
#[derive(Clone, Copy)]
pub struct Attach {
    /// Whose message.
    pub engine: EngineTag,
    len: u8,
    buf: [u8; MAX_ATTACH_LEN],
}

impl Attach {
    const EMPTY: Attach = Attach { engine: EngineTag::Mw, len: 0, buf: [0; MAX_ATTACH_LEN] };

    /// An attachment of `bytes` (the engine's own encoding).
    pub fn new(engine: EngineTag, bytes: &[u8]) -> Result<Attach, FrameError> {
        Attach::encoded(engine, |b| {
            let n = bytes.len().min(b.len());
            b[..n].copy_from_slice(&bytes[..n]);
            bytes.len()
        })
    }

    /// An attachment written in place by `f`, which returns the length.
    pub fn encoded(engine: EngineTag, f: impl FnOnce(&mut [u8]) -> usize) -> Result<Attach, FrameError> {
        let mut a = Attach { engine, ..Attach::EMPTY };
        let n = f(&mut a.buf);
        if n > MAX_ATTACH_LEN {
            return Err(FrameError::TooLarge { what: "attachment", len: n, max: MAX_ATTACH_LEN });
        }
        a.len = n as u8;
        Ok(a)
    }

    /// The engine's encoding.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

impl PartialEq for Attach {
    fn eq(&self, o: &Attach) -> bool {
        self.engine == o.engine && self.bytes() == o.bytes()
    }
}

impl Eq for Attach {}

impl std::hash::Hash for Attach {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.engine.hash(h);
        self.bytes().hash(h);
    }
}

impl fmt::Debug for Attach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Attach({}, {:02x?})", self.engine, self.bytes())
    }
}

/// The attachments of a request or reply: at most [`MAX_ATTACH`], inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Attaches {
    len: u8,
    items: [Attach; MAX_ATTACH],
}

impl Attaches {
    /// None.
    pub const fn new() -> Attaches {
        Attaches { len: 0, items: [Attach::EMPTY; MAX_ATTACH] }
    }

    /// Add one; fails past [`MAX_ATTACH`].
    pub fn push(&mut self, a: Attach) -> Result<(), FrameError> {
        let i = self.len as usize;
        if i == MAX_ATTACH {
            return Err(FrameError::TooLarge { what: "attachment count", len: i + 1, max: MAX_ATTACH });
        }
        self.items[i] = a;
        self.len += 1;
        Ok(())
    }

    /// From a slice; fails past [`MAX_ATTACH`].
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // tests and fuzzing build frames by hand
    pub fn from_slice(s: &[Attach]) -> Result<Attaches, FrameError> {
        let mut out = Attaches::new();
        for a in s {
            out.push(*a)?;
        }
        Ok(out)
    }
}

impl Default for Attaches {
    fn default() -> Attaches {
        Attaches::new()
    }
}

impl std::ops::Deref for Attaches {
    type Target = [Attach];
    fn deref(&self) -> &[Attach] {
        &self.items[..self.len as usize]
    }
}

impl fmt::Debug for Attaches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One frame, borrowing its header: encoded from the caller's bytes,
/// decoded from the receive slot's. Building or decoding one allocates
/// nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Frame<'a> {
    /// A client's request.
    Request {
        /// The request's id on this connection.
        msg_id: u64,
        /// The caller's trace id, if it gave one (joins the server's span
        /// for the request to the client's across nodes).
        trace: Option<TraceId>,
        /// The application's header bytes.
        header: &'a [u8],
        /// The payload, when small enough to ride along (else empty).
        inline: &'a [u8],
        /// Engine messages riding along: the exposure of the request's
        /// payload, a confirm-policy fetch of the reply.
        attach: Attaches,
    },
    /// A request for the owner's library (`conn::OwnerAsk`): it answers a
    /// redemption, a delegation on or a revocation itself, and hands a call
    /// for a delegation to the application, marked.
    Ask {
        /// The request's id on this connection (the requests' sequence).
        msg_id: u64,
        /// The ask: an op byte, then its fields (at most [`MAX_HEADER`] bytes).
        body: &'a [u8],
        /// Engine messages riding along: a confirm-policy fetch of the reply.
        attach: Attaches,
    },
    /// A server's reply.
    Reply {
        /// The request answered.
        msg_id: u64,
        /// 0 for success; otherwise an application or mwcap error code.
        status: u8,
        /// The application's header bytes.
        header: &'a [u8],
        /// The payload, when small enough to ride along (else empty).
        inline: &'a [u8],
        /// Engine messages riding along: the exposure of the reply's payload,
        /// the release of the request's payload.
        attach: Attaches,
    },
    /// A message for a protocol engine (release, confirm, answer...).
    Engine(Attach),
    /// Keepalive: "are you there?" (an idle connection checks its peer).
    Ping {
        /// Echoed in the answer.
        seq: u64,
    },
    /// Keepalive: the answer to a [`Frame::Ping`].
    Pong {
        /// The ping's.
        seq: u64,
    },
    /// Flow control: a grant of credit (in the header) with nothing else to
    /// say, sent when enough receives were posted and no other frame is
    /// going the peer's way.
    Credit,
    /// A server's answer to a request it refused unread: `limit` requests
    /// of this connection (its `Config::max_requests`) were unanswered
    /// when it came.
    Busy {
        /// The request refused.
        msg_id: u64,
        /// The server's `Config::max_requests`.
        limit: u32,
    },
    /// Flow control, from a side on shared receives whose peer has been
    /// idle: keep at most `keep` of the credit granted, and give the rest
    /// back ([`Frame::Returned`]), so that the receives go to others.
    GiveBack {
        /// The credits the peer may keep (the sender's start credits).
        keep: u32,
    },
    /// Flow control: the answer to a [`Frame::GiveBack`]; the sender holds
    /// `count` credits fewer than it was granted.
    Returned {
        /// Credits given back.
        count: u32,
    },
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
    /// Request flags this build does not know.
    #[error("unknown request flags {0:#04x}")]
    UnknownFlags(u8),
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
    #[inline(always)]
    fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        let left = self.buf.len() - self.at;
        if left < n {
            return Err(FrameError::Truncated { at: self.at, needed: n - left });
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    #[inline(always)]
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    #[inline(always)]
    fn u16(&mut self) -> Result<u16, FrameError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    #[inline(always)]
    fn u64(&mut self) -> Result<u64, FrameError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    #[inline(always)]
    fn header(&mut self) -> Result<&'a [u8], FrameError> {
        let len = self.u16()? as usize;
        if len > MAX_HEADER {
            return Err(FrameError::TooLarge { what: "header", len, max: MAX_HEADER });
        }
        self.take(len)
    }
    #[inline(always)]
    fn inline(&mut self) -> Result<&'a [u8], FrameError> {
        let len = self.u16()? as usize;
        if len > MAX_INLINE as usize {
            return Err(FrameError::TooLarge { what: "inline payload", len, max: MAX_INLINE as usize });
        }
        self.take(len)
    }
    /// The attachment list, checked (count, engines, lengths) but left in
    /// the received bytes.
    #[inline(always)]
    fn attaches(&mut self) -> Result<RawAttaches<'a>, FrameError> {
        let count = self.u8()? as usize;
        if count > MAX_ATTACH {
            return Err(FrameError::TooLarge { what: "attachment count", len: count, max: MAX_ATTACH });
        }
        let start = self.at;
        for _ in 0..count {
            EngineTag::from_u8(self.u8()?)?.ok_or(FrameError::UnknownEngine(0))?;
            let len = self.u16()? as usize;
            self.take(len)?;
            if len > MAX_ATTACH_LEN {
                return Err(FrameError::TooLarge { what: "attachment", len, max: MAX_ATTACH_LEN });
            }
        }
        Ok(RawAttaches { count: count as u8, bytes: &self.buf[start..self.at] })
    }
}

/// The attachments of a received request or reply, checked by the decoder
/// and borrowed from the received bytes: reading a frame copies none of
/// them (an [`Attaches`] is 265 bytes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawAttaches<'a> {
    count: u8,
    /// `count` entries `engine:u8 len:u16 bytes`, each checked.
    bytes: &'a [u8],
}

impl<'a> RawAttaches<'a> {
    /// Whether there are none.
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Each attachment: its engine and its bytes (at most [`MAX_ATTACH_LEN`]).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (EngineTag, &'a [u8])> {
        let mut r = Reader { buf: self.bytes, at: 0 };
        // Checked when decoded: an entry that does not parse cannot occur,
        // and would end the list rather than panic.
        (0..self.count).map_while(move |_| {
            let engine = EngineTag::from_u8(r.u8().ok()?).ok()??;
            let len = r.u16().ok()? as usize;
            Some((engine, r.take(len).ok()?))
        })
    }

    fn to_attaches(self) -> Result<Attaches, FrameError> {
        let mut out = Attaches::new();
        for (engine, bytes) in self.iter() {
            out.push(Attach::new(engine, bytes)?)?;
        }
        Ok(out)
    }
}

/// A frame as the connection reads it: a [`Frame`] whose attachments stay
/// in the received bytes ([`RawAttaches`]), and whose engine message is
/// borrowed too. Decoding one copies nothing.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Received<'a> {
    /// [`Frame::Request`].
    Request {
        msg_id: u64,
        trace: Option<TraceId>,
        header: &'a [u8],
        inline: &'a [u8],
        attach: RawAttaches<'a>,
    },
    /// [`Frame::Ask`].
    Ask { msg_id: u64, body: &'a [u8], attach: RawAttaches<'a> },
    /// [`Frame::Reply`].
    Reply { msg_id: u64, status: u8, header: &'a [u8], inline: &'a [u8], attach: RawAttaches<'a> },
    /// [`Frame::Engine`]: the engine and its message (at most [`MAX_ATTACH_LEN`] bytes).
    Engine(EngineTag, &'a [u8]),
    /// [`Frame::Ping`].
    Ping { seq: u64 },
    /// [`Frame::Pong`].
    Pong { seq: u64 },
    /// [`Frame::Credit`].
    Credit,
    /// [`Frame::Busy`].
    Busy { msg_id: u64, limit: u32 },
    /// [`Frame::GiveBack`].
    GiveBack { keep: u32 },
    /// [`Frame::Returned`].
    Returned { count: u32 },
}

impl<'a> Received<'a> {
    /// The frame's kind, named (for `Misbehavior::WrongFrame`).
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Received::Request { .. } => "request",
            Received::Ask { .. } => "owner ask",
            Received::Reply { .. } => "reply",
            Received::Engine(..) => "engine message",
            Received::Ping { .. } => "ping",
            Received::Pong { .. } => "pong",
            Received::Credit => "credit",
            Received::Busy { .. } => "busy",
            Received::GiveBack { .. } => "give back",
            Received::Returned { .. } => "returned",
        }
    }

    /// The [`Frame`] (its attachments copied out).
    fn to_frame(self) -> Result<Frame<'a>, FrameError> {
        Ok(match self {
            Received::Request { msg_id, trace, header, inline, attach } => {
                Frame::Request { msg_id, trace, header, inline, attach: attach.to_attaches()? }
            }
            Received::Ask { msg_id, body, attach } => {
                Frame::Ask { msg_id, body, attach: attach.to_attaches()? }
            }
            Received::Reply { msg_id, status, header, inline, attach } => {
                Frame::Reply { msg_id, status, header, inline, attach: attach.to_attaches()? }
            }
            Received::Engine(engine, bytes) => Frame::Engine(Attach::new(engine, bytes)?),
            Received::Ping { seq } => Frame::Ping { seq },
            Received::Pong { seq } => Frame::Pong { seq },
            Received::Credit => Frame::Credit,
            Received::Busy { msg_id, limit } => Frame::Busy { msg_id, limit },
            Received::GiveBack { keep } => Frame::GiveBack { keep },
            Received::Returned { count } => Frame::Returned { count },
        })
    }
}

/// A cursor writing into a caller's slice (a control slot of registered
/// memory): encoding allocates nothing.
struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    #[inline(always)]
    fn put(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        let end = self.at + bytes.len();
        if end > self.out.len() {
            return Err(FrameError::TooLarge { what: "frame", len: end, max: self.out.len().min(MAX_FRAME) });
        }
        self.out[self.at..end].copy_from_slice(bytes);
        self.at = end;
        Ok(())
    }
    #[inline(always)]
    fn header(&mut self, header: &[u8]) -> Result<(), FrameError> {
        if header.len() > MAX_HEADER {
            return Err(FrameError::TooLarge { what: "header", len: header.len(), max: MAX_HEADER });
        }
        self.put(&(header.len() as u16).to_le_bytes())?;
        self.put(header)
    }
    #[inline(always)]
    fn inline(&mut self, inline: &[u8]) -> Result<(), FrameError> {
        if inline.len() > MAX_INLINE as usize {
            return Err(FrameError::TooLarge {
                what: "inline payload",
                len: inline.len(),
                max: MAX_INLINE as usize,
            });
        }
        self.put(&(inline.len() as u16).to_le_bytes())?;
        if inline.is_empty() {
            return Ok(());
        }
        self.put(inline)
    }
    #[inline(always)]
    fn attaches(&mut self, attach: &[Attach]) -> Result<(), FrameError> {
        if attach.len() > MAX_ATTACH {
            return Err(FrameError::TooLarge {
                what: "attachment count",
                len: attach.len(),
                max: MAX_ATTACH,
            });
        }
        self.put(&[attach.len() as u8])?;
        for a in attach {
            let [l0, l1] = (a.bytes().len() as u16).to_le_bytes();
            self.put(&[a.engine.to_u8(), l0, l1])?;
            self.put(a.bytes())?;
        }
        Ok(())
    }
}

impl<'a> Frame<'a> {
    /// Encode; fails when the result would exceed [`MAX_FRAME`] or a header [`MAX_HEADER`].
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // tests and fuzzing build frames by hand
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut out = vec![0; MAX_FRAME];
        let n = self.encode_into(&mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Encode straight into `out` (a control slot) with no credit; returns
    /// the length. Fails when the frame does not fit `out` or [`MAX_FRAME`].
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, FrameError> {
        self.encode_with_credit(0, out)
    }

    /// Encode straight into `out` granting the peer `credit` receives;
    /// returns the length.
    pub fn encode_with_credit(&self, credit: u16, out: &mut [u8]) -> Result<usize, FrameError> {
        let limit = out.len().min(MAX_FRAME);
        let mut w = Writer { out: &mut out[..limit], at: 0 };
        let [c0, c1] = credit.to_le_bytes();
        w.put(&[VERSION, self.kind_byte(), c0, c1])?;
        match self {
            Frame::Request { msg_id, trace, header, inline, attach } => {
                w.put(&msg_id.to_le_bytes())?;
                match trace {
                    Some(t) => {
                        w.put(&[FLAG_TRACE])?;
                        w.put(&t.to_bytes())?;
                    }
                    None => w.put(&[0])?,
                }
                w.header(header)?;
                w.inline(inline)?;
                w.attaches(attach)?;
            }
            Frame::Ask { msg_id, body, attach } => {
                w.put(&msg_id.to_le_bytes())?;
                w.header(body)?;
                w.attaches(attach)?;
            }
            Frame::Reply { msg_id, status, header, inline, attach } => {
                w.put(&msg_id.to_le_bytes())?;
                w.put(&[*status])?;
                w.header(header)?;
                w.inline(inline)?;
                w.attaches(attach)?;
            }
            Frame::Engine(a) => {
                w.put(&[a.engine.to_u8()])?;
                w.put(a.bytes())?;
            }
            Frame::Ping { seq } | Frame::Pong { seq } => w.put(&seq.to_le_bytes())?,
            Frame::Credit => {}
            Frame::Busy { msg_id, limit } => {
                w.put(&msg_id.to_le_bytes())?;
                w.put(&limit.to_le_bytes())?;
            }
            Frame::GiveBack { keep: n } | Frame::Returned { count: n } => w.put(&n.to_le_bytes())?,
        }
        Ok(w.at)
    }

    /// The kind byte (second of every frame).
    pub(crate) fn kind_byte(&self) -> u8 {
        match self {
            Frame::Request { .. } => 1,
            Frame::Reply { .. } => 2,
            Frame::Engine(_) => 3,
            Frame::Ping { .. } => 4,
            Frame::Pong { .. } => 5,
            Frame::Credit => 6,
            Frame::Ask { .. } => 7,
            Frame::Busy { .. } => 8,
            Frame::GiveBack { .. } => GIVE_BACK,
            Frame::Returned { .. } => RETURNED,
        }
    }

    /// Decode one frame from untrusted bytes (its credit ignored).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // tests and fuzzing read frames
    pub fn decode(buf: &'a [u8]) -> Result<Frame<'a>, FrameError> {
        Frame::decode_with_credit(buf).map(|(f, _)| f)
    }

    /// Decode one frame from untrusted bytes, with the credit it grants.
    pub fn decode_with_credit(buf: &'a [u8]) -> Result<(Frame<'a>, u16), FrameError> {
        let (r, credit) = Frame::receive(buf)?;
        Ok((r.to_frame()?, credit))
    }

    /// Decode one frame from untrusted bytes, with the credit it grants,
    /// leaving its attachments in `buf` (what the connection reads: the
    /// checks are [`Frame::decode_with_credit`]'s, which builds on it).
    pub(crate) fn receive(buf: &'a [u8]) -> Result<(Received<'a>, u16), FrameError> {
        if buf.len() > MAX_FRAME {
            return Err(FrameError::TooLarge { what: "frame", len: buf.len(), max: MAX_FRAME });
        }
        let mut r = Reader { buf, at: 0 };
        let version = r.u8()?;
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let kind = r.u8()?;
        let credit = r.u16()?;
        let frame = match kind {
            1 => {
                let msg_id = r.u64()?;
                let trace = match r.u8()? {
                    0 => None,
                    FLAG_TRACE => Some(TraceId::from_bytes(r.array()?)),
                    other => return Err(FrameError::UnknownFlags(other)),
                };
                Received::Request {
                    msg_id,
                    trace,
                    header: r.header()?,
                    inline: r.inline()?,
                    attach: r.attaches()?,
                }
            }
            2 => Received::Reply {
                msg_id: r.u64()?,
                status: r.u8()?,
                header: r.header()?,
                inline: r.inline()?,
                attach: r.attaches()?,
            },
            3 => {
                let engine = EngineTag::from_u8(r.u8()?)?.ok_or(FrameError::UnknownEngine(0))?;
                let bytes = r.take(buf.len() - r.at)?;
                if bytes.len() > MAX_ATTACH_LEN {
                    let len = bytes.len();
                    return Err(FrameError::TooLarge { what: "attachment", len, max: MAX_ATTACH_LEN });
                }
                Received::Engine(engine, bytes)
            }
            4 => Received::Ping { seq: r.u64()? },
            5 => Received::Pong { seq: r.u64()? },
            6 => Received::Credit,
            7 => Received::Ask { msg_id: r.u64()?, body: r.header()?, attach: r.attaches()? },
            8 => Received::Busy { msg_id: r.u64()?, limit: r.u32()? },
            GIVE_BACK => Received::GiveBack { keep: r.u32()? },
            RETURNED => Received::Returned { count: r.u32()? },
            k => return Err(FrameError::UnknownKind(k)),
        };
        if r.at != buf.len() {
            return Err(FrameError::Trailing(buf.len() - r.at));
        }
        Ok((frame, credit))
    }
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
#[path = "frame_tests.rs"]
mod tests;
