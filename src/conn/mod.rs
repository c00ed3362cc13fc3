//! Connections: mwcap's protocols over a [`Nic`](crate::backend::Nic), in
//! three layers.
//!
//! - `proto::Connection` (internal; public to mwcap's own tests with the
//!   `testing` feature) is one side of one RC connection as a state
//!   machine with no I/O: it runs, per direction, either the memory-window
//!   lease engines of `mwcap-mw` or the confirm engines of
//!   `mwcap-fallback`, takes completions, received frames and the time,
//!   and returns work requests to post (`proto::Command`) and
//!   [`Event`]s.
//! - A `Link` (internal) does its I/O: it owns the queue pair, a control
//!   region for the SENDs and RECVs that carry frames, and a data pool of
//!   fixed-size buffers, posts the connection's commands and feeds back
//!   its completions from the endpoint's completion queue.
//! - [`Endpoint`] and [`Connection`] are the async face: an endpoint is
//!   one completion queue and one driver ([`EndpointDriver`]) for many
//!   connections, made with [`Endpoint::connect`], [`Endpoint::accept`] or,
//!   with a bootstrap of the application's own, [`Endpoint::prepare`]; a
//!   [`Connection`] is a cloneable handle on one.
//!
//! The model is a request/response call with optional zero-copy payloads in
//! both directions:
//!
//! - the **request** payload is the client's memory, READ by the server
//!   ([`Policies::request`]);
//! - the **reply** payload is the server's memory, READ by the client
//!   ([`Policies::reply`]).
//!
//! Buffers are move-only [`Buf`] handles into registered memory. Giving
//! one to a call or reply hands it to the NIC, and it comes back only in
//! [`Event::BufferReturned`], on evidence that no remote access is
//! possible any more (the invalidation's completion, the confirm answered,
//! a READ's own completion, the QP destroyed).

#[cfg(not(loom))]
mod alarm;
mod ask;
mod buf;
mod bufpool;
mod clock;
mod config;
mod delegate;
#[cfg(not(loom))]
mod endpoint;
#[cfg(feature = "testing")]
pub mod frame;
#[cfg(not(feature = "testing"))]
mod frame;
mod header;
#[cfg(not(loom))]
mod hub;
// Under loom only the pool's model is built: what the endpoint uses goes unused.
#[cfg_attr(loom, allow(dead_code))]
mod link;
#[cfg(not(loom))]
mod listen;
#[cfg(not(loom))]
mod live;
mod pool;
// The sans-IO connection under every `Link`: internal, public to
// mwcap's own tests, fuzz targets and cost examples (`testing`).
#[cfg(feature = "testing")]
pub mod proto;
#[cfg(not(feature = "testing"))]
mod proto;
// The hub's ready list; public under loom for its model (tests/loom_ready.rs).
#[cfg(loom)]
pub mod ready;
#[cfg(not(loom))]
mod ready;
#[cfg(not(loom))]
mod reconnect;
// Under loom only the pool's model is built: what the endpoint uses goes unused.
#[cfg_attr(loom, allow(dead_code))]
mod regions;
#[cfg(not(loom))]
pub(crate) use delegate::DelegationFigures;
#[cfg(not(loom))]
pub(crate) use regions::RegionFigures;
#[cfg(not(loom))]
mod routes;
// Under loom only the pool's model is built: what the endpoint uses goes unused.
#[cfg_attr(loom, allow(dead_code))]
mod setup;
#[cfg(feature = "testing")]
mod simpair;
// Under loom only the pool's model is built: what the endpoint uses goes unused.
#[cfg_attr(loom, allow(dead_code))]
mod srq;
mod types;

pub use crate::ProbeCache;
pub use bufpool::BufferPoolStats;
// The pool is the endpoint's (`EndpointBuilder::shared_buffers`); public
// only for the loom models of it (tests/loom_pool.rs).
#[cfg(loom)]
pub use bufpool::BufferPool;

/// What the loom models of the shared buffer pool (`tests/loom_pool.rs`)
/// drive: a pool over stand-in regions, and a connection's buffer slots
/// backed by it, as the protocol core uses them.
#[cfg(loom)]
pub mod pool_model {
    use super::pool::{Holder, Slots};
    use super::{BufClass, BufferPool};

    /// A pool of `count` buffers of `size` bytes (no NIC) and as many
    /// windows; no more windows can be allocated.
    pub fn pool(size: u32, count: u32) -> BufferPool {
        BufferPool::for_model(&[BufClass { size, count }], count)
    }

    /// A connection's `count` slots of `size` bytes, backed by `pool`.
    pub struct BackedSlots(Slots);

    impl BackedSlots {
        /// Slots of one class, each backed by a buffer of `pool` while taken.
        pub fn new(pool: &BufferPool, size: u32, count: u32) -> BackedSlots {
            let mut s = Slots::new(count);
            s.back_with(pool.clone(), &[(size, count)]).expect("the pool has the class");
            BackedSlots(s)
        }
        /// Take a slot for the user (and a buffer of the pool), as `alloc` does.
        pub fn take(&mut self) -> Option<u32> {
            self.0.take(Holder::User)
        }
        /// Whether a take would find a buffer (registering for a wake-up if not).
        pub fn can_take(&mut self) -> bool {
            self.0.can_take(0)
        }
        /// The user gives slot `i` back (its buffer goes back to the pool).
        pub fn give_back(&mut self, i: u32) -> bool {
            self.0.hand(i, Holder::User, Holder::Free)
        }
        /// The waker the pool wakes after a take found it empty.
        pub fn wake_on_pool(&mut self, w: &std::task::Waker) {
            self.0.wake_on_pool(w)
        }
        /// Whether a buffer came back since a take found the pool empty.
        pub fn unstarve(&mut self) -> bool {
            self.0.unstarve()
        }
        /// The connection's turn is over (see `Slots::end_turn`): true when
        /// one more turn is due, after which an unused wake-up passes on.
        pub fn end_turn(&mut self) -> bool {
            self.0.end_turn(false)
        }
        /// Take a window of the pool for an exposure (registering for a
        /// wake-up if there is none), as an mw exposure does.
        pub fn take_window(&mut self) -> Option<mwcap_mw::Window> {
            self.0.take_window()
        }
        /// Give a window back unbound (its invalidation completed).
        pub fn give_window(&mut self, w: mwcap_mw::Window) {
            self.0.give_window(w, true)
        }
    }
}
pub use ask::{DelegatedCall, DelegatedReply};
// The wire form of an ask of the owner's library, like the frames: public
// only to mwcap's own hostile-peer tests (`testing`).
#[cfg(feature = "testing")]
pub use ask::OwnerAsk;
pub use buf::Buf;
pub use config::*;
pub use delegate::{
    CapId, DelegateError, Delegation, RedeemFailed, Refusal, RevokeError, Token, TokenTooLong, MAX_IDENTITY,
    MAX_TOKEN,
};
#[cfg(not(loom))]
pub use endpoint::{Endpoint, EndpointBuilder, EndpointDriver, Pending};
pub use frame::{FrameError, MAX_FRAME, MAX_HEADER};
pub use header::Header;
#[cfg(not(loom))]
pub use hub::EndpointStats;
// The I/O layer is internal: mwcap's own tests, the fuzzers and the
// benchmark's sans-IO rows reach it through the `testing` feature.
#[cfg(feature = "testing")]
pub use link::{Link, Prepared};
#[cfg(not(feature = "testing"))]
pub(crate) use link::{Link, Prepared};
#[cfg(not(loom))]
pub use live::{Connection, DriverStats, Reply, Request};
#[cfg(not(loom))]
pub use reconnect::{Backoff, ReconnectError, ReconnectStats, Reconnecting};
#[cfg_attr(loom, allow(unused_imports))] // the endpoint's, left out of loom builds
pub(crate) use setup::SetupOptions;
pub use setup::{PolicyChoice, SetupError};
#[cfg(feature = "testing")]
pub use simpair::SimPair;
pub use srq::{SrqConfig, SrqStats};
pub use types::*;
