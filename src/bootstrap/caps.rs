//! What each side can do, as announced in its [`Hello`](super::Hello).

use std::fmt;
use std::time::Duration;

/// A protection policy for one exposure of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// The owner binds a type-2 memory window per exposure.
    Mw,
    /// No windows: the reader confirms with the owner after each READ.
    Confirm,
}

/// A set of [`Policy`] values, one bit each on the wire.
///
/// Bits this version does not know are dropped when decoding: a newer peer
/// may announce a policy we cannot follow, and we simply do not pick it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicySet(u8);

impl PolicySet {
    /// No policy at all (this side does not take part in that direction).
    pub const NONE: PolicySet = PolicySet(0);
    /// Only [`Policy::Mw`].
    pub const MW: PolicySet = PolicySet(1);
    /// Only [`Policy::Confirm`].
    pub const CONFIRM: PolicySet = PolicySet(2);
    /// Both policies.
    pub const BOTH: PolicySet = PolicySet(3);
    const KNOWN: u8 = 3;

    /// Whether `policy` is in the set.
    pub const fn contains(self, policy: Policy) -> bool {
        self.0 & Self::bit(policy) != 0
    }
    /// The set with `policy` added.
    pub const fn with(self, policy: Policy) -> PolicySet {
        PolicySet(self.0 | Self::bit(policy))
    }
    /// The policies in both sets.
    pub const fn intersection(self, other: PolicySet) -> PolicySet {
        PolicySet(self.0 & other.0)
    }
    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// The policy to use when several are possible: [`Policy::Mw`] (evidence
    /// from the NIC) over [`Policy::Confirm`] (an extra round trip per read).
    pub const fn preferred(self) -> Option<Policy> {
        if self.contains(Policy::Mw) {
            Some(Policy::Mw)
        } else if self.contains(Policy::Confirm) {
            Some(Policy::Confirm)
        } else {
            None
        }
    }
    /// The wire bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
    /// A set from wire bits; unknown bits are dropped.
    pub const fn from_bits_truncate(bits: u8) -> PolicySet {
        PolicySet(bits & Self::KNOWN)
    }

    const fn bit(policy: Policy) -> u8 {
        match policy {
            Policy::Mw => 1,
            Policy::Confirm => 2,
        }
    }
}

impl fmt::Debug for PolicySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.contains(Policy::Mw), self.contains(Policy::Confirm)) {
            (false, false) => f.write_str("{}"),
            (true, false) => f.write_str("{mw}"),
            (false, true) => f.write_str("{confirm}"),
            (true, true) => f.write_str("{mw, confirm}"),
        }
    }
}

/// Optional protocol features, as two bit sets.
///
/// Like ext4's compat/incompat flags: an unknown bit in
/// [`optional`](Features::optional) is ignored (the peer can do without it),
/// while an unknown bit in [`required`](Features::required) makes the decoder
/// refuse the hello with
/// [`DecodeError::UnknownRequiredFeatures`](super::DecodeError::UnknownRequiredFeatures),
/// so a future extension that changes the meaning of the exchange can be
/// added without a version bump and still fail cleanly against old peers.
/// This version defines no feature, so both are zero when it sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Features {
    /// Features the peer must understand.
    pub required: u16,
    /// Features the peer may ignore.
    pub optional: u16,
}

impl Features {
    /// The required features this version understands (none).
    pub const KNOWN_REQUIRED: u16 = 0;
}

/// The fewest start credits a hello may offer: with fewer, flow control
/// could stall (see `Config::start_credits`).
pub const MIN_START_CREDITS: u32 = 3;

/// What one side can do, sent in its [`Hello`](super::Hello).
///
/// Directions are named from the announcing side: `serve` are the policies
/// it can apply to memory it *exposes* (as the owner), `read` the policies it
/// can follow when it *reads* the peer's memory. The policy for memory that A
/// exposes to B is then picked from `A.serve ∩ B.read`; see
/// [`Negotiated`](super::Negotiated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// Policies this side can serve as the owner of exposed memory.
    pub serve: PolicySet,
    /// Policies this side can follow as a reader of the peer's memory.
    pub read: PolicySet,
    /// The largest message this side accepts, in bytes (at least 1).
    pub max_message: u32,
    /// The frames the peer may send before this side's first credit grant
    /// (the receives this side holds for it at the start: its
    /// `Config::start_credits`); at least [`MIN_START_CREDITS`].
    pub start_credits: u32,
    /// The default life of an exposure this side grants, in milliseconds (at least 1).
    pub lease_ms: u32,
    /// Optional protocol features.
    pub features: Features,
}

impl Capabilities {
    /// A side that can serve and read under both policies, with moderate limits
    /// (64 KiB messages, 8 start credits, 1 s leases).
    pub fn new() -> Capabilities {
        Capabilities {
            serve: PolicySet::BOTH,
            read: PolicySet::BOTH,
            max_message: 64 * 1024,
            start_credits: 8,
            lease_ms: 1000,
            features: Features::default(),
        }
    }

    /// The default lease as a [`Duration`].
    pub fn lease(&self) -> Duration {
        Duration::from_millis(u64::from(self.lease_ms))
    }
}

impl Default for Capabilities {
    fn default() -> Capabilities {
        Capabilities::new()
    }
}
