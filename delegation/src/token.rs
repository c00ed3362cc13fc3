//! Delegation tokens: the claims a token carries, and their seal.
//!
//! A token is the claims, encoded in a fixed order, followed by an
//! HMAC-SHA256 tag over them under the owner's secret. Only the owner (the
//! holder of the secret) makes and opens tokens; the holder and the
//! delegate carry them as opaque bytes.
//!
//! ```text
//! version u8 = 1 | cap u64 | root u64 | offset u64 | len u64 |
//! expiry_ns u64 | nonce u64 | identity_len u8 | identity | tag [u8; 32]
//! ```
//! (integers little-endian; `expiry_ns` on the owner's clock.)

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{CapId, Range};

/// The version byte of the token format.
const VERSION: u8 = 1;
/// Bytes of the fixed part: version, six integers, the identity's length.
const FIXED: usize = 1 + 6 * 8 + 1;
/// Bytes of the tag.
const TAG: usize = 32;
/// The longest identity a token names (a keyring's key name).
pub const MAX_IDENTITY: usize = 255;
/// The longest token: [`MAX_IDENTITY`] bytes of identity.
pub const MAX_TOKEN: usize = FIXED + MAX_IDENTITY + TAG;

/// What a token says: a delegation `cap` of `root`'s capability, over
/// `range` of the exposed memory, for `identity` only, until `expiry` on
/// the owner's clock. The `nonce` makes two tokens of equal claims differ.
/// The identity is borrowed (from the token's bytes, once opened), so
/// reading a token's claims allocates nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Claims<'a> {
    /// The delegation this token redeems.
    pub cap: CapId,
    /// The capability at the root of its tree (the owner's first exposure).
    pub root: CapId,
    /// The bytes it covers, inside every capability above it.
    pub range: Range,
    /// When it can no longer be redeemed (nor read), on the owner's clock.
    pub expiry: Duration,
    /// The identity that may redeem it: the name of the key the delegate's
    /// connection authenticated with.
    pub identity: &'a str,
    /// A value of the owner's choosing (its PRNG's).
    pub nonce: u64,
}

/// A token as it travels: opaque bytes, sealed by the owner. Kept inline
/// (a token is at most [`MAX_TOKEN`] bytes), so making, copying and
/// receiving one allocates nothing.
#[derive(Clone)]
pub struct Token {
    len: u16,
    bytes: [u8; MAX_TOKEN],
}

/// Bytes offered as a [`Token`] are longer than any token an owner seals
/// ([`MAX_TOKEN`]): they are not a token of any owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenTooLong(pub usize);

impl std::fmt::Display for TokenTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes are not a token: an owner seals none longer than {MAX_TOKEN}; pass the token's bytes as the owner gave them",
            self.0
        )
    }
}

impl std::error::Error for TokenTooLong {}

impl Token {
    /// The token's bytes, to pass on by any means.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// A token received as bytes (checked only when the owner opens it);
    /// [`TokenTooLong`] if they are longer than any token.
    pub fn from_bytes(bytes: impl AsRef<[u8]>) -> Result<Token, TokenTooLong> {
        let b = bytes.as_ref();
        if b.len() > MAX_TOKEN {
            return Err(TokenTooLong(b.len()));
        }
        let mut t = Token { len: b.len() as u16, bytes: [0; MAX_TOKEN] };
        t.bytes[..b.len()].copy_from_slice(b);
        Ok(t)
    }
}

impl PartialEq for Token {
    fn eq(&self, o: &Token) -> bool {
        self.as_bytes() == o.as_bytes()
    }
}

impl Eq for Token {}

impl std::hash::Hash for Token {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.as_bytes().hash(h);
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({} bytes)", self.len)
    }
}

fn mac(key: &[u8; 32]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length")
}

/// Seal `claims` under `key`. `None` if the identity is longer than
/// [`MAX_IDENTITY`] bytes.
pub(crate) fn seal(key: &[u8; 32], claims: &Claims<'_>) -> Option<Token> {
    let id = claims.identity.as_bytes();
    if id.len() > MAX_IDENTITY {
        return None;
    }
    let mut t = Token { len: (FIXED + id.len() + TAG) as u16, bytes: [0; MAX_TOKEN] };
    let out = &mut t.bytes;
    out[0] = VERSION;
    for (i, v) in [
        claims.cap.0,
        claims.root.0,
        claims.range.offset,
        claims.range.len,
        u64::try_from(claims.expiry.as_nanos()).unwrap_or(u64::MAX),
        claims.nonce,
    ]
    .into_iter()
    .enumerate()
    {
        out[1 + 8 * i..9 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    out[FIXED - 1] = id.len() as u8;
    out[FIXED..FIXED + id.len()].copy_from_slice(id);
    let body = FIXED + id.len();
    let mut m = mac(key);
    m.update(&out[..body]);
    out[body..body + TAG].copy_from_slice(&m.finalize().into_bytes());
    Some(t)
}

/// Open `token` under `key`: its claims if its tag is right and its
/// encoding well formed; `None` otherwise (forged, altered, truncated, or
/// sealed under another key).
pub(crate) fn open<'t>(key: &[u8; 32], token: &'t [u8]) -> Option<Claims<'t>> {
    if token.len() < FIXED + TAG || token.len() > MAX_TOKEN {
        return None;
    }
    let (body, tag) = token.split_at(token.len() - TAG);
    let mut m = mac(key);
    m.update(body);
    // Constant time: a wrong tag says nothing of how close it was.
    m.verify_slice(tag).ok()?;
    if body[0] != VERSION {
        return None;
    }
    let int = |i: usize| {
        let at = 1 + 8 * i;
        u64::from_le_bytes(body[at..at + 8].try_into().expect("eight bytes"))
    };
    let id_len = body[FIXED - 1] as usize;
    if body.len() != FIXED + id_len {
        return None;
    }
    let identity = std::str::from_utf8(&body[FIXED..]).ok()?;
    Some(Claims {
        cap: CapId(int(0)),
        root: CapId(int(1)),
        range: Range { offset: int(2), len: int(3) },
        expiry: Duration::from_nanos(int(4)),
        nonce: int(5),
        identity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(identity: &str) -> Claims<'_> {
        Claims {
            cap: CapId(7),
            root: CapId(3),
            range: Range { offset: 4096, len: 1000 },
            expiry: Duration::from_millis(1500),
            identity,
            nonce: 0x0123_4567_89ab_cdef,
        }
    }

    #[test]
    fn a_sealed_token_opens_to_its_claims_under_its_key_only() {
        let key = [7u8; 32];
        for id in ["", "decode-node-3", &"x".repeat(MAX_IDENTITY)] {
            let t = seal(&key, &claims(id)).expect("sealed");
            assert_eq!(open(&key, t.as_bytes()), Some(claims(id)));
            assert_eq!(open(&[8u8; 32], t.as_bytes()), None, "another key");
        }
        assert!(seal(&key, &claims(&"x".repeat(MAX_IDENTITY + 1))).is_none());
    }

    #[test]
    fn any_altered_byte_or_length_is_refused() {
        let key = [1u8; 32];
        let t = seal(&key, &claims("delegate")).unwrap();
        let b = t.as_bytes();
        for i in 0..b.len() {
            for bit in [0x01u8, 0x80] {
                let mut x = b.to_vec();
                x[i] ^= bit;
                assert_eq!(open(&key, &x), None, "byte {i} bit {bit:#x}");
            }
        }
        for n in 0..b.len() {
            assert_eq!(open(&key, &b[..n]), None, "truncated to {n}");
        }
        let mut longer = b.to_vec();
        longer.push(0);
        assert_eq!(open(&key, &longer), None);
    }
}
