//! Connections: the driver that runs the protocol engines over a
//! [`Nic`](crate::backend::Nic).
//!
//! An [`Endpoint`] is one side of one RC connection. It owns the queue pair,
//! its completion queue, a control region for the SENDs and RECVs that carry
//! [`frame`]s, and a data pool of fixed-size buffers. It runs, per direction,
//! either the memory-window lease engines of `mwcap-mw` or the confirm
//! engines of `mwcap-fallback`, and turns their actions into work requests
//! and their events into [`Event`]s.
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

mod endpoint;
pub mod frame;
#[cfg(not(loom))]
mod live;
mod pool;
pub mod proto;
mod setup;
mod simpair;
mod types;

pub use endpoint::{Endpoint, Prepared};
#[cfg(not(loom))]
pub use live::{Connection, Driver, DriverStats, Reply, Request};
pub use setup::{accept, connect, Connected, PolicyChoice, SetupError};
pub use simpair::SimPair;
pub use types::*;
