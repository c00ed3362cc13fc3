//! A simulated RDMA fabric that follows the InfiniBand spec.
//!
//! [`Fabric`] holds several simulated devices, a virtual clock and a seeded
//! scheduler. [`Fabric::add_device`] returns a [`SimNic`], one protection
//! domain of that device, which implements [`Nic`](crate::backend::Nic):
//! the capability probe, the conformance table and the protocol drivers run
//! on it unchanged. Memory regions own their bytes (`Vec<u8>`); there is no
//! `unsafe` here.
//!
//! # What is modelled
//! - Memory regions with access flags, type-2 windows scoped to the binding
//!   QP with range and 8-bit consumer-key checks, bind errors
//!   (`MW_BIND_ERR`, binding QP to ERR), remote access errors
//!   (`REM_ACCESS_ERR`, both QPs to ERR), flushes, `LOCAL_INV`,
//!   `SEND_WITH_INV`, RC ordering, RNR and transport retries.
//! - A READ copies the source bytes when the responder processes it: a CPU
//!   write landing before that shows in the data read.
//! - Faults ([`Faults`], [`Fabric::cut_link`], [`Fabric::kill_device`],
//!   [`SimNic::fail_next`] for a verb that fails, [`MwSupport`],
//!   [`DeviceConfig::rxe_quirks`]).
//! - An oracle: [`Fabric::exposure`], [`Fabric::in_flight`],
//!   [`Fabric::would_crash_rxe`], [`Fabric::qp_counters`].
//!
//! # Progress
//! In [`Progress::Auto`] (the default) `poll_cq` runs every due event and,
//! if the polled queue is still empty, advances the clock to the next
//! pending event and runs that. In [`Progress::Manual`] only
//! [`Fabric::step`], [`Fabric::run_until`], [`Fabric::run_for`] and
//! [`Fabric::run_until_idle`] move time.
//!
//! # Determinism
//! All state sits behind one lock and is kept in ordered containers; the
//! only randomness is the generator seeded with [`FabricConfig::seed`]. The
//! same seed and the same sequence of calls give the same trace.
//!
//! See `docs/sim.md` for the full list of behaviours and fault knobs.

mod config;
mod event;
mod exec;
mod fabric;
mod nic;
mod oracle;
#[cfg(feature = "testing")]
mod pair;
mod ranked;
mod resp;
mod sched;
mod world;

pub use config::{DeviceConfig, FabricConfig, Faults, Latency, MwSupport, Progress};
pub use exec::LATE_BYTE;
pub use fabric::{Fabric, IDLE_EVENT_LIMIT};
pub use nic::{SimNic, Verb};
pub use oracle::{
    Created, DeviceId, Exposure, Hazard, HazardKind, InFlightRead, QpAddr, QpCounters, ReadPhase, ReadSource,
    TraceEntry, Via, WindowState,
};
#[cfg(feature = "testing")]
pub use pair::{End, Pair};
