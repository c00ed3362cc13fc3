//! What a peer asks of an owner's library, never its application, on the
//! wire (the body of an ask frame: [`OwnerAsk`]), and the reply to a call
//! for a delegation ([`DelegatedReply`]). The owner's side answers them in
//! `link/answer.rs`, from its endpoint's book (`conn/delegate.rs`).

use super::delegate::{CapId, Delegation, RedeemFailed, Token, MAX_IDENTITY, MAX_TOKEN};
/// What a caller asked for when it called for a delegation
/// ([`Request::delegated`](super::Request::delegated)): the application
/// may refuse to give its data to `to` (reply without a payload).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DelegatedCall {
    /// The identity the reply's range will be delegated to.
    pub to: std::sync::Arc<str>,
    /// For how long (at most the connection's `lease_time`).
    pub ttl: std::time::Duration,
}

/// The answer to [`Connection::call_delegated`](super::Connection::call_delegated):
/// the owner application's status and header, and the delegation its reply's
/// payload was made into (`None`: the reply had no payload).
#[derive(Clone, Debug)]
pub struct DelegatedReply {
    /// The application's status.
    pub status: u8,
    /// The application's header.
    pub header: Vec<u8>,
    /// The reply's payload, a range of the owner's memory, delegated to
    /// the identity the call named: its id (the caller may
    /// [`Connection::revoke`](super::Connection::revoke) it) and its
    /// token, to pass on.
    pub delegation: Option<Delegation>,
}

impl DelegatedReply {
    /// Parse the reply to a call for a delegation (`OwnerAsk::Call`).
    #[cfg_attr(loom, allow(dead_code))] // used by the async handle, absent under loom
    pub(crate) fn parse(status: u8, header: &[u8]) -> Result<DelegatedReply, RedeemFailed> {
        let bad = || RedeemFailed::BadStatus(status);
        let refused = |words: &[u8]| RedeemFailed::refused(status, words);
        match header.split_first() {
            Some((&CALL_PLAIN, rest)) => {
                Ok(DelegatedReply { status, header: rest.to_vec(), delegation: None })
            }
            Some((&CALL_DELEGATED, rest)) => {
                let (cap, rest) = rest.split_first_chunk::<8>().ok_or_else(bad)?;
                let (len, rest) = rest.split_first_chunk::<2>().ok_or_else(bad)?;
                let len = usize::from(u16::from_le_bytes(*len));
                if rest.len() < len {
                    return Err(bad());
                }
                let (token, header) = rest.split_at(len);
                let delegation = Delegation {
                    cap: CapId(u64::from_le_bytes(*cap)),
                    token: Token::from_bytes(token).map_err(|_| bad())?,
                };
                Ok(DelegatedReply { status, header: header.to_vec(), delegation: Some(delegation) })
            }
            Some((&CALL_REFUSED, rest)) => Err(refused(rest)),
            // A refusal without the kind byte: an ask the owner could not
            // parse (or an owner that knows no calls for a delegation),
            // its words the whole header (words never start with a kind).
            _ => Err(refused(header)),
        }
    }
}

/// What a peer asks of an owner's library, never its application: the
/// body of an ask frame (`frame::Frame::Ask`). An op byte, then
/// its fields (integers little-endian):
///
/// | op | ask | fields |
/// |---|---|---|
/// | 1 | redeem | the token |
/// | 2 | delegate on | ttl in ms (u32), the part's offset and length in the capability (u32 each; length 0: the rest from the offset), the identity's length (u8) and bytes, the token |
/// | 3 | revoke | the delegation's id (u64) |
/// | 4 | call for a delegation | ttl in ms (u32), the identity's length (u8) and bytes, the request's header |
///
/// The reply to op 4 starts with a kind byte (0: the application's header
/// follows; 1: the delegation's id (u64), the token's length (u16) and
/// bytes, then the application's header; 2: the library refused, its
/// words follow), so that the status stays the application's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerAsk<'a> {
    /// A delegate redeems a token made for it: the range comes back as the
    /// reply payload ([`Connection::redeem`](super::Connection::redeem)).
    Redeem {
        /// The token, as the owner sealed it.
        token: &'a [u8],
    },
    /// A holder hands the capability of a token made for it on to
    /// `identity`, for part of its range and no longer: a new token in
    /// the reply ([`Connection::delegate`](super::Connection::delegate)).
    DelegateOn {
        /// The holder's token.
        token: &'a [u8],
        /// The part's first byte, from the capability's start.
        offset: u32,
        /// The part's bytes (0: the rest of the capability from `offset`).
        len: u32,
        /// The new token's life, in milliseconds.
        ttl_ms: u32,
        /// Who may redeem the new token.
        identity: &'a str,
    },
    /// A holder revokes a delegation it made on this connection
    /// ([`Connection::revoke`](super::Connection::revoke)).
    Revoke {
        /// The delegation.
        cap: CapId,
    },
    /// A holder calls the owner's application and asks for the reply's
    /// payload as a delegation to `identity` instead of reading it
    /// ([`Connection::call_delegated`](super::Connection::call_delegated)):
    /// the request surfaces to the application (marked
    /// [`Request::delegated`](super::Request::delegated)); a reply with a
    /// range of a region is delegated, not exposed.
    Call {
        /// The delegation's life, in milliseconds (at most the owner
        /// connection's `lease_time`).
        ttl_ms: u32,
        /// Who may redeem the token.
        identity: &'a str,
        /// The request's header, for the application.
        header: &'a [u8],
    },
}

/// The kind byte of a reply to a call for a delegation (op 4; the layouts
/// are [`OwnerAsk`]'s): the application's header, no payload.
pub(crate) const CALL_PLAIN: u8 = 0;
/// ... the application's range of a region, delegated.
pub(crate) const CALL_DELEGATED: u8 = 1;
/// ... refused by the owner's library (a [`Refusal`](super::Refusal) in
/// the status); the application never saw it.
pub(crate) const CALL_REFUSED: u8 = 2;

/// The longest ask but a call for a delegation (whose header has no bound
/// here): a delegation on of the longest token to the longest identity.
pub(crate) const ASK_ON_STACK: usize = 1 + 13 + MAX_IDENTITY + MAX_TOKEN;

impl OwnerAsk<'_> {
    /// The body's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        self.encode_to(&mut |part| b.extend_from_slice(part));
        b
    }

    /// `f` of the body's bytes, encoded on the stack when they fit (every
    /// ask but a call for a delegation with a long header), so asking
    /// allocates nothing.
    pub fn encode_with<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        if self.encoded_len() > ASK_ON_STACK {
            return f(&self.encode());
        }
        let mut b = [0u8; ASK_ON_STACK];
        let mut n = 0;
        self.encode_to(&mut |part| {
            b[n..n + part.len()].copy_from_slice(part);
            n += part.len();
        });
        f(&b[..n])
    }

    pub(crate) fn encoded_len(&self) -> usize {
        let mut n = 0;
        self.encode_to(&mut |part| n += part.len());
        n
    }

    /// The body, part by part.
    fn encode_to(&self, put: &mut impl FnMut(&[u8])) {
        // An identity longer than a length byte says is cut short (the
        // owner then refuses it); callers check identities first.
        let identity = |put: &mut dyn FnMut(&[u8]), id: &str| {
            let id = &id.as_bytes()[..id.len().min(255)];
            put(&[id.len() as u8]);
            put(id);
        };
        match *self {
            OwnerAsk::Redeem { token } => {
                put(&[1]);
                put(token);
            }
            OwnerAsk::DelegateOn { token, offset, len, ttl_ms, identity: to } => {
                put(&[2]);
                put(&ttl_ms.to_le_bytes());
                put(&offset.to_le_bytes());
                put(&len.to_le_bytes());
                identity(put, to);
                put(token);
            }
            OwnerAsk::Revoke { cap } => {
                put(&[3]);
                put(&cap.0.to_le_bytes());
            }
            OwnerAsk::Call { ttl_ms, identity: to, header } => {
                put(&[4]);
                put(&ttl_ms.to_le_bytes());
                identity(put, to);
                put(header);
            }
        }
    }

    /// Parse a body (`None`: an op this owner does not know, or fields
    /// that do not parse).
    pub fn decode(b: &[u8]) -> Option<OwnerAsk<'_>> {
        let (&op, rest) = b.split_first()?;
        let u32_at = |i: usize| rest.get(i..i + 4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        match op {
            1 => Some(OwnerAsk::Redeem { token: rest }),
            2 => {
                let (ttl_ms, offset, len) = (u32_at(0)?, u32_at(4)?, u32_at(8)?);
                let n = usize::from(*rest.get(12)?);
                let identity = std::str::from_utf8(rest.get(13..13 + n)?).ok()?;
                Some(OwnerAsk::DelegateOn { token: &rest[13 + n..], offset, len, ttl_ms, identity })
            }
            3 if rest.len() == 8 => {
                Some(OwnerAsk::Revoke { cap: CapId(u64::from_le_bytes(rest.try_into().ok()?)) })
            }
            4 => {
                let ttl_ms = u32_at(0)?;
                let n = usize::from(*rest.get(4)?);
                let identity = std::str::from_utf8(rest.get(5..5 + n)?).ok()?;
                Some(OwnerAsk::Call { ttl_ms, identity, header: &rest[5 + n..] })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::Refusal;

    /// Every ask decodes to itself, and a truncated one to nothing.
    #[test]
    fn an_ask_decodes_to_what_was_encoded_and_a_truncated_one_to_nothing() {
        let token = [9u8; 40];
        let asks = [
            OwnerAsk::Redeem { token: &token },
            OwnerAsk::DelegateOn { token: &token, offset: 3, len: 70, ttl_ms: 500, identity: "compute" },
            OwnerAsk::Revoke { cap: CapId(77) },
            OwnerAsk::Call { ttl_ms: 1500, identity: "decode-3", header: b"GET blk 7" },
            OwnerAsk::Call { ttl_ms: 1, identity: "a", header: b"" },
        ];
        for ask in asks {
            let b = ask.encode();
            assert_eq!(OwnerAsk::decode(&b), Some(ask));
            ask.encode_with(|on_stack| assert_eq!(on_stack, b));
        }
        // The longest ask but a call, on the stack; a call with a long
        // header, on the heap: the same bytes either way.
        let (token, to) = ([3u8; MAX_TOKEN], "i".repeat(MAX_IDENTITY));
        let longest = OwnerAsk::DelegateOn { token: &token, offset: 1, len: 2, ttl_ms: 3, identity: &to };
        assert_eq!(longest.encoded_len(), ASK_ON_STACK);
        let header = [5u8; 2 * ASK_ON_STACK];
        let call = OwnerAsk::Call { ttl_ms: 9, identity: &to, header: &header };
        for ask in [longest, call] {
            ask.encode_with(|b| assert_eq!(OwnerAsk::decode(b), Some(ask)));
        }
        // Cut inside the fixed fields or the identity.
        let b = OwnerAsk::Call { ttl_ms: 1500, identity: "decode-3", header: b"" }.encode();
        for cut in 1..b.len() {
            assert_eq!(OwnerAsk::decode(&b[..cut]), None, "cut at {cut}");
        }
        assert_eq!(OwnerAsk::decode(&[]), None);
        assert_eq!(OwnerAsk::decode(&[5]), None);
    }

    /// A reply to a call for a delegation parses to what the owner said,
    /// and a mangled one to an error, never a panic.
    #[test]
    fn a_reply_to_a_call_for_a_delegation_parses_or_says_it_is_not_one() {
        let token = [7u8; 50];
        let h = [&[CALL_DELEGATED][..], &5u64.to_le_bytes(), &50u16.to_le_bytes(), &token, b"app"].concat();
        let r = DelegatedReply::parse(4, &h).unwrap();
        assert_eq!((r.status, &r.header[..]), (4, &b"app"[..]));
        let d = r.delegation.unwrap();
        assert_eq!((d.cap, d.token.as_bytes()), (CapId(5), &token[..]));
        let r = DelegatedReply::parse(0, &[CALL_PLAIN, b'x']).unwrap();
        assert!(r.delegation.is_none() && r.header == b"x");
        let refused = [&[CALL_REFUSED][..], b"no"].concat();
        assert!(matches!(
            DelegatedReply::parse(9, &refused),
            Err(RedeemFailed::Refused { refusal: Refusal::OutsideCapability, .. })
        ));
        for cut in 0..h.len() - 3 {
            assert!(DelegatedReply::parse(0, &h[..cut]).is_err(), "cut at {cut}");
        }
        assert!(DelegatedReply::parse(0, &[3]).is_err());
        // A token longer than any an owner seals is no token.
        let long = [7u8; MAX_TOKEN + 1];
        let n = (MAX_TOKEN as u16 + 1).to_le_bytes();
        let h = [&[CALL_DELEGATED][..], &5u64.to_le_bytes(), &n, &long, b"app"].concat();
        assert!(matches!(DelegatedReply::parse(0, &h), Err(RedeemFailed::BadStatus(0))));
        assert!(DelegatedReply::parse(200, &refused).is_err());
        // A refusal without a kind byte (an ask the owner could not parse).
        assert!(matches!(
            DelegatedReply::parse(11, b"an ask the owner does not know"),
            Err(RedeemFailed::Refused { refusal: Refusal::Malformed, ref message }) if message.starts_with("an ask")
        ));
        assert!(DelegatedReply::parse(0, b"").is_err());
    }
}
