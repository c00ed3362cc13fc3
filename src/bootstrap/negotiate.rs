//! What two hellos agree on.

use std::time::Duration;

use super::caps::Policy;
use super::error::BootstrapError;
use super::wire::Hello;

/// The parameters both sides derive from the two hellos.
///
/// Symmetric: the peer computes the same values, with the two directions
/// swapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Negotiated {
    /// The path MTU both queue pairs use: the smaller of the two.
    pub mtu: u32,
    /// The largest message either side may send: the smaller of the two limits.
    pub max_message: u32,
    /// The default exposure lease: the shorter of the two, so both sides
    /// expire exposures on the same schedule.
    pub lease: Duration,
    /// The policy for memory this side exposes and the peer reads (ours
    /// `serve` ∩ the peer's `read`, [`Policy::Mw`] preferred), or `None`
    /// when this side cannot expose memory to the peer.
    pub we_expose: Option<Policy>,
    /// The policy for memory the peer exposes and this side reads, or `None`.
    pub peer_exposes: Option<Policy>,
}

/// Agree on the connection's parameters. Both hellos must be valid
/// ([`Hello::validate`]); fails when no direction has a common policy.
pub fn negotiate(local: &Hello, peer: &Hello) -> Result<Negotiated, BootstrapError> {
    let (l, p) = (&local.caps, &peer.caps);
    let we_expose = l.serve.intersection(p.read).preferred();
    let peer_exposes = p.serve.intersection(l.read).preferred();
    if we_expose.is_none() && peer_exposes.is_none() {
        return Err(BootstrapError::NoCommonPolicy {
            local_serve: l.serve,
            local_read: l.read,
            peer_serve: p.serve,
            peer_read: p.read,
        });
    }
    Ok(Negotiated {
        mtu: local.endpoint.mtu.min(peer.endpoint.mtu),
        max_message: l.max_message.min(p.max_message),
        lease: l.lease().min(p.lease()),
        we_expose,
        peer_exposes,
    })
}
