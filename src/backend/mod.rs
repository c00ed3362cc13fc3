//! The backend interface: what mwcap needs from a NIC, and nothing more.
//!
//! Two backends implement [`Nic`]: the real verbs layer (`crate::verbs`, behind
//! the `verbs` feature) and the simulated NIC ([`crate::sim`]). The protocol
//! drivers, the capability probe and the differential test table are written
//! once against this trait and run unchanged on either.
//!
//! The interface is shaped around mwcap's needs rather than mirroring
//! libibverbs: one protection domain per [`Nic`] handle is enough for a
//! connection, memory regions own their memory (so the simulated NIC can be
//! written without `unsafe`), scatter entries name a region and an offset
//! instead of a raw address and lkey (so a backend checks bounds before it
//! posts), and every object is addressed by a small copyable id.
//!
//! # Keys
//! A type-2 window's rkey is `index << 8 | key`. libibverbs never updates
//! `ibv_mw.rkey` after a type-2 bind, so the caller tracks the current rkey
//! and passes the *new* rkey in `SendWr::BindMw`; [`rkey::rebind`] computes
//! it from the old one and a fresh random consumer key, wrapping correctly.

#[cfg(feature = "testing")]
pub mod loopback;
#[cfg(not(feature = "testing"))]
pub(crate) mod loopback;
#[cfg(feature = "testing")]
pub mod ops;
#[cfg(not(feature = "testing"))]
pub(crate) mod ops;
pub mod rkey;
mod types;

#[cfg(feature = "testing")]
pub use ops::NicOps;
#[cfg(not(feature = "testing"))]
pub(crate) use ops::NicOps;

// What a user of the public API meets: errors, a QP's address and state,
// the device's description, and the types the simulator's oracle reports.
#[cfg(feature = "verbs")]
pub(crate) use types::ack_timeout_exponent;
pub use types::{
    Access, DeviceInfo, MrId, MwId, NicError, OsError, QpEndpoint, QpId, QpState, Sge, WcOpcode, WcStatus,
};
// What only `NicOps` takes and gives: internal, like it (public for
// mwcap's own tests with the `testing` feature).
#[cfg(not(feature = "testing"))]
pub(crate) use crate::mem::Memory;
#[cfg(feature = "testing")]
pub use crate::mem::{Hold, MemError, Memory, POISON};
#[cfg(feature = "testing")]
pub use types::{Completion, CqId, MrInfo, MwInfo, QpConfig, SendWr, SgeList, SrqId, MAX_SGE};
#[cfg(not(feature = "testing"))]
#[allow(unused_imports)]
pub(crate) use types::{Completion, CqId, MrInfo, MwInfo, QpConfig, SendWr, SgeList, SrqId, MAX_SGE};

/// A NIC mwcap runs on: the simulated NIC ([`crate::sim::SimNic`]) or,
/// with the `verbs` feature, real verbs (`mwcap::verbs::VerbsNic`). Pick one
/// and hand it to [`crate::conn::Endpoint::builder`]; everything the
/// endpoint does with it goes through the connection layer's rules (every
/// window bind invalidated once, memory reused only on evidence).
///
/// Sealed: its operations (posting work requests, binding windows,
/// polling completion queues) are mwcap's own, not part of its public API,
/// so no program can post on a connection's queue pair or invalidate one
/// of its windows behind its back. (mwcap's own tests reach them with the
/// `testing` feature, as `backend::NicOps`.)
pub trait Nic: NicOps {}

impl<T: NicOps> Nic for T {}
