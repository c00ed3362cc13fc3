//! [`Header`]: the application's header of a request or reply.

use std::fmt;

/// An application header (of a request or reply): inline up to 64 bytes,
/// so small headers cost no allocation; on the heap beyond, shared by its
/// clones (a clone copies at most 64 bytes and never allocates).
#[derive(Clone)]
pub struct Header(HeaderBytes);

/// Bytes a [`Header`] holds without an allocation.
const INLINE_HEADER: usize = 64;

#[derive(Clone)]
enum HeaderBytes {
    Inline { len: u8, bytes: [u8; INLINE_HEADER] },
    Shared(std::sync::Arc<[u8]>),
}

impl Default for Header {
    fn default() -> Header {
        Header(HeaderBytes::Inline { len: 0, bytes: [0; INLINE_HEADER] })
    }
}

impl std::ops::Deref for Header {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            HeaderBytes::Inline { len, bytes } => &bytes[..usize::from(*len)],
            HeaderBytes::Shared(b) => b,
        }
    }
}

impl AsRef<[u8]> for Header {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl PartialEq for Header {
    fn eq(&self, o: &Header) -> bool {
        self[..] == o[..]
    }
}

impl Eq for Header {}

impl std::hash::Hash for Header {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self[..].hash(h);
    }
}

impl fmt::Debug for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(self) {
            Ok(s) => write!(f, "Header({s:?})"),
            Err(_) => write!(f, "Header({:02x?})", &self[..]),
        }
    }
}

impl From<&[u8]> for Header {
    fn from(b: &[u8]) -> Header {
        if b.len() <= INLINE_HEADER {
            let mut bytes = [0; INLINE_HEADER];
            bytes[..b.len()].copy_from_slice(b);
            Header(HeaderBytes::Inline { len: b.len() as u8, bytes })
        } else {
            Header(HeaderBytes::Shared(b.into()))
        }
    }
}

impl<const N: usize> From<&[u8; N]> for Header {
    fn from(b: &[u8; N]) -> Header {
        Header::from(&b[..])
    }
}

impl From<Vec<u8>> for Header {
    fn from(v: Vec<u8>) -> Header {
        Header::from(&v[..])
    }
}

impl PartialEq<[u8]> for Header {
    fn eq(&self, o: &[u8]) -> bool {
        self[..] == *o
    }
}

impl PartialEq<&[u8]> for Header {
    fn eq(&self, o: &&[u8]) -> bool {
        self[..] == **o
    }
}

impl<const N: usize> PartialEq<[u8; N]> for Header {
    fn eq(&self, o: &[u8; N]) -> bool {
        self[..] == o[..]
    }
}

impl<const N: usize> PartialEq<&[u8; N]> for Header {
    fn eq(&self, o: &&[u8; N]) -> bool {
        self[..] == o[..]
    }
}

impl PartialEq<Vec<u8>> for Header {
    fn eq(&self, o: &Vec<u8>) -> bool {
        self[..] == o[..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_is_its_bytes_inline_or_shared_and_a_clone_shares_a_long_one() {
        for len in [0, 1, 64, 65, 3000] {
            let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let h = Header::from(&bytes[..]);
            assert_eq!(h, bytes);
            assert_eq!(h, Header::from(bytes.clone()));
            let c = h.clone();
            assert_eq!(c, h);
            if len > 64 {
                // On the heap, and the clone points at the same bytes.
                assert_eq!(c.as_ptr(), h.as_ptr(), "a clone of a {len}-byte header allocated");
            }
            assert_eq!(c.to_vec(), bytes);
        }
        assert_eq!(Header::default(), b"");
        assert_ne!(Header::from(b"a"), Header::from(b"ab"));
        assert_eq!(format!("{:?}", Header::from(b"get")), "Header(\"get\")");
    }
}
