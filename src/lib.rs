//! # mwcap: safe zero-copy RDMA
//!
//! With one-sided RDMA a peer reads your registered memory directly. When a
//! request times out you cannot know whether the peer's NIC will still touch
//! the buffer, so reusing it risks handing stale or foreign data to someone.
//! mwcap makes every exposure a capability with a bounded life:
//!
//! - **mw policy**: the owner binds a type-2 memory window over exactly the
//!   buffer, scoped to the peer's queue pair, chained with the SEND that
//!   carries the rkey. Memory is reused only on evidence from the NIC.
//! - **confirm policy**: for NICs without working type-2 windows, the reader
//!   asks the owner after each READ whether the buffer was reused meanwhile;
//!   a stale read is discarded and retried, never returned.
//! - **auto**: [`probe()`] tries the window operations on a throw-away
//!   loopback QP pair and picks; a [`ProbeCache`] runs it once per device.
//!
//! ## Architecture
//! - [`backend`]: the [`Nic`](backend::Nic) trait, the small interface the
//!   rest of mwcap needs from a NIC.
//! - `verbs` (feature `verbs`): the real verbs backend over libibverbs, one
//!   of the two modules with `unsafe` (the other, `mem`, is the registered
//!   memory a [`conn::Buf`] lends as a slice, with the argument that makes
//!   it sound).
//! - [`sim`]: an in-process simulated NIC that follows the InfiniBand spec,
//!   deterministic, with fault injection and an oracle for tests.
//! - [`bootstrap`]: the TCP exchange that connects RC queue pairs, once both
//!   sides proved a pre-shared key.
//! - The protocol engines live in the sans-IO crates `mwcap-mw` and
//!   `mwcap-fallback`.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod bootstrap;
#[cfg(feature = "testing")]
pub mod conformance;
pub mod conn;
mod probe;
mod probe_cache;
pub mod sim;
#[cfg(not(loom))]
pub mod stat;
pub mod telemetry;
// The one module with `unsafe`: every block carries its SAFETY comment.
#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;

pub use probe::{probe, ProbeReport, ProbeStep, StepOutcome};
pub use probe_cache::ProbeCache;
#[cfg(feature = "testing")]
pub mod handle;
#[cfg(not(feature = "testing"))]
mod handle;
// The other module with `unsafe`: registered memory a buffer handle lends
// as a slice, with the argument that makes it sound.
#[allow(unsafe_code)]
mod mem;
mod sync;
