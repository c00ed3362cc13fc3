//! Small opaque identifiers that cross the engine boundary.

use std::fmt;

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident($inner:ty)) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name($inner);

        impl $name {
            /// Wraps a raw value (from the wire, a work request id, or a test).
            pub const fn from_raw(raw: $inner) -> $name {
                $name(raw)
            }
            /// The raw value, for the wire, a work request id, or logs.
            pub const fn raw(self) -> $inner {
                self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

id_type!(
    /// A message id: names one logical request on one connection.
    ///
    /// The client allocates them, starting at 1, strictly increasing, never
    /// reused for another request (see the crate doc, "Message ids").
    MsgId(u64)
);
id_type!(
    /// An owner-side buffer, as handed out by `add_buffer`. Meaningful only to
    /// the engine that created it and on the wire to its peer.
    BufferId(u32)
);
id_type!(
    /// A buffer's generation: bumped every time the owner takes the buffer
    /// back (confirmed, expired, cancelled, refused, connection lost), so each
    /// exposure of a buffer has a generation no other exposure ever had.
    Generation(u64)
);
id_type!(
    /// Names one RDMA READ posted by a reader engine. Post it as the work
    /// request's `wr_id` (or map it to one) and hand it back with the completion.
    ReadToken(u64)
);

// Message ids and READ tokens are counters: a deque of them mostly has
// every id between its ends.
impl crate::sorted::Key for MsgId {
    fn distance(self, front: MsgId) -> Option<u64> {
        self.0.checked_sub(front.0)
    }
}

impl crate::sorted::Key for ReadToken {
    fn distance(self, front: ReadToken) -> Option<u64> {
        self.0.checked_sub(front.0)
    }
}

impl crate::sorted::Key for (MsgId, BufferId) {}

impl Generation {
    /// The generation after this one, or `None` after 2^64 - 1 reuses.
    pub(crate) fn next(self) -> Option<Generation> {
        self.0.checked_add(1).map(Generation)
    }
}

/// A range of a registered memory region as a remote peer names it: virtual
/// address, length and the region's own rkey.
///
/// The rkey is region-wide: whoever holds it (any QP of the same protection
/// domain) can READ the *whole* region for as long as it stays registered, not
/// just this range. See the crate doc, "Security cost".
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    addr: u64,
    len: u32,
    rkey: u32,
}

impl Region {
    /// A region of `len` bytes at remote address `addr`, readable with `rkey`.
    pub const fn new(addr: u64, len: u32, rkey: u32) -> Region {
        Region { addr, len, rkey }
    }
    /// The virtual address.
    pub const fn addr(self) -> u64 {
        self.addr
    }
    /// The length in bytes.
    pub const fn len(self) -> u32 {
        self.len
    }
    /// Whether the region is empty.
    pub const fn is_empty(self) -> bool {
        self.len == 0
    }
    /// The remote key.
    pub const fn rkey(self) -> u32 {
        self.rkey
    }
    /// The first `len` bytes of this region (`len` must not exceed [`Region::len`]).
    pub(crate) const fn prefix(self, len: u32) -> Region {
        Region { addr: self.addr, len, rkey: self.rkey }
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Region({:#x}+{}, rkey {:#x})", self.addr, self.len, self.rkey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_and_ids_print_and_measure() {
        let r = Region::new(0x1000, 64, 0x5e);
        assert_eq!((r.addr(), r.len(), r.rkey(), r.is_empty()), (0x1000, 64, 0x5e, false));
        assert!(Region::new(0x1000, 0, 0x5e).is_empty());
        assert_eq!(r.prefix(8), Region::new(0x1000, 8, 0x5e));
        assert_eq!(format!("{r:?}"), "Region(0x1000+64, rkey 0x5e)");
        assert_eq!(format!("{:?} {}", MsgId::from_raw(7), MsgId::from_raw(7)), "MsgId(7) 7");
        assert_eq!(Generation::from_raw(3).next(), Some(Generation::from_raw(4)));
        assert_eq!(Generation::from_raw(u64::MAX).next(), None);
    }

    #[test]
    fn counters_say_how_far_they_are_above_the_front() {
        use crate::sorted::Key;
        assert_eq!(MsgId::from_raw(7).distance(MsgId::from_raw(3)), Some(4));
        assert_eq!(MsgId::from_raw(3).distance(MsgId::from_raw(3)), Some(0));
        assert_eq!(MsgId::from_raw(3).distance(MsgId::from_raw(7)), None, "below the front");
        assert_eq!(ReadToken::from_raw(12).distance(ReadToken::from_raw(2)), Some(10));
        assert_eq!(ReadToken::from_raw(2).distance(ReadToken::from_raw(2)), Some(0));
        assert_eq!(ReadToken::from_raw(1).distance(ReadToken::from_raw(2)), None, "below the front");
        // Pairs are no counters: a lookup searches.
        let pair = (MsgId::from_raw(5), BufferId::from_raw(0));
        assert_eq!(pair.distance((MsgId::from_raw(1), BufferId::from_raw(0))), None);
    }
}
