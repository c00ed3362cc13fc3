//! Connections: mwcap's protocols over a [`Nic`](crate::backend::Nic), in
//! three layers.
//!
//! - [`proto::Connection`] is one side of one RC connection as a state
//!   machine with no I/O: it runs, per direction, either the memory-window
//!   lease engines of `mwcap-mw` or the confirm engines of
//!   `mwcap-fallback`, takes completions, received frames and the time,
//!   and returns work requests to post ([`proto::Command`]) and
//!   [`Event`]s.
//! - An [`Endpoint`] does its I/O: it owns the queue pair, its completion
//!   queue, a control region for the SENDs and RECVs that carry frames, and
//!   a data pool of fixed-size buffers, posts the connection's commands and
//!   feeds back its completions.
//! - [`Connection`] and [`Driver`] are the async face over an endpoint.
//!
//! The model is a request/response call with optional zero-copy payloads in
//! both directions:
//!
//! - the **request** payload is the client's memory, READ by the server
//!   ([`Policies::request`]);
//! - the **reply** payload is the server's memory, READ by the client
//!   ([`Policies::reply`]).
//!
//! Buffers are move-only [`Buf`] handles into registered memory, whose
//! bytes are lent without a copy ([`Endpoint::bytes`], [`Endpoint::fill`]):
//! giving one to [`Endpoint::call`] or [`Endpoint::reply`] hands it to the
//! NIC, and it comes back only in [`Event::BufferReturned`], which the
//! endpoint emits only on evidence that no remote access is possible any
//! more (the invalidation's completion, the confirm answered, the QP flushed
//! or destroyed). A reply payload arrives as a `Buf` the user owns. Dropping
//! a `Buf` returns it to the pool; a refused call or reply hands it back in
//! [`Refused`].
//!
//! [`Connection`] and [`Driver`] are the async face (see `live.rs`): the
//! driver busy-polls briefly, then sleeps on the completion queue's
//! readiness, the user's doorbell or the next timer.
//!
//! Like the engines, an endpoint is sans-clock: the caller passes `now` and
//! follows the quinn-style loop: `handle_*`/`call`/`reply` inputs, then
//! [`Endpoint::drive`] (polls completions and carries out engine actions),
//! then [`Endpoint::poll_event`] until `None`, then wait until
//! [`Endpoint::poll_timeout`] or the next completion.

#[cfg(not(loom))]
mod alarm;
mod bufpool;
mod endpoint;
#[cfg(feature = "testing")]
pub mod frame;
#[cfg(not(feature = "testing"))]
mod frame;
#[cfg(not(loom))]
mod hub;
#[cfg(not(loom))]
mod listen;
#[cfg(not(loom))]
mod live;
mod pool;
pub mod proto;
#[cfg(not(loom))]
mod reconnect;
#[cfg(not(loom))]
mod router;
mod setup;
mod simpair;
mod srq;
mod types;

pub use crate::ProbeCache;
pub use bufpool::{BufferPool, BufferPoolStats};
pub use endpoint::{Endpoint, Prepared};
pub use frame::{FrameError, MAX_FRAME, MAX_HEADER};
#[cfg(not(loom))]
pub use hub::{Hub, HubDriver, HubStats};
#[cfg(not(loom))]
pub use listen::{connect_async, connect_async_on, AsyncConnected, Listener};
#[cfg(not(loom))]
pub use live::{Connection, Driver, DriverStats, Reply, Request};
#[cfg(not(loom))]
pub use reconnect::{Backoff, ReconnectError, ReconnectStats, Reconnecting};
#[cfg(not(loom))]
pub use router::{CqRouter, Endpoints, RouterStats};
pub use setup::{
    accept, accept_with, connect, connect_with, Connected, PolicyChoice, SetupError, SetupOptions,
};
#[cfg(not(loom))]
pub use setup::{accept_on, connect_on};
pub use simpair::SimPair;
pub use srq::{SrqConfig, SrqStats};
pub use types::*;
