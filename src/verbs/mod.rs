//! The real verbs backend: safe RAII types over libibverbs (internal), and
//! [`VerbsNic`], the [`Nic`](crate::backend::Nic) on top: open one and hand
//! it to [`Endpoint::builder`](crate::conn::Endpoint::builder).
//!
//! This is the only module of mwcap with `unsafe` code. Every `unsafe` block
//! carries a `// SAFETY:` comment naming the invariant it relies on; the
//! struct layouts we or `rdma-mummy-sys` declare by hand are checked against
//! the system's `<infiniband/verbs.h>` by `tests/verbs_layout.rs`.
//!
//! # Objects and ownership
//! Each verbs object is a Rust value holding a `NonNull` to the C object and
//! an `Arc` to its parent, so a parent can never be destroyed before its
//! children: `Context` ← `Pd` ← `Mr`, `Mw`, `Srq`, `Qp`;
//! `Context` ← `CompChannel` ← `Cq` ← `Qp`; `Srq` ← `Qp`.
//! Dropping an object destroys the C object; `close(self)` does the same but
//! hands the object back with the error when the verb fails (a region with
//! windows still bound, a CQ or an SRQ still used by a QP).
//!
//! # Asynchronous events
//! A context's asynchronous events are read only on demand, without
//! blocking, when an SRQ's limit event is asked for
//! (`Srq::take_limit`): every pending event is read and acknowledged
//! under one lock per context, limit events raise their SRQ's flag and the
//! rest are logged at debug level.
//!
//! # Memory
//! A `Mr` owns its memory (page-aligned, zeroed) and the CPU touches it only
//! through copies. The memory goes back to the allocator only after
//! `ibv_dereg_mr` succeeded, because from then on the device cannot reach it;
//! if deregistration fails the memory is leaked. Work requests name memory as
//! bounds-checked `Slice`s of a region, so posting never points the NIC
//! outside registered memory.
//!
//! # The hot path
//! Posting, polling and lending a region's bytes allocate nothing and take
//! no lock that covers a whole [`VerbsNic`]: ids resolve through lock-free
//! slot tables, and a chain of at most `MAX_CHAIN` work requests is built
//! on the stack (the `nic` module's documentation lists the cost per call).
//!
//! # Keys
//! libibverbs does not update `ibv_mw.rkey` after a type-2 bind. `Mw`
//! tracks the current rkey itself: the mw engine draws a fresh
//! 8-bit consumer key for each bind ([`crate::backend::rkey::rebind`], which
//! wraps correctly, unlike the crates' `ibv_inc_rkey`), and a successful
//! post of the bind records it.
//!
//! # Loading
//! rdma-mummy-sys loads `libibverbs.so.1` at run time. Without it every verb
//! fails with EOPNOTSUPP; `Context::open` and [`list_devices`] check first
//! and return [`OpenError::LibraryMissing`] with an install hint.

mod cq;
mod device;
mod error;
mod event;
mod mr;
mod mw;
mod nic;
mod pd;
mod post;
mod qp;
mod slots;
mod srq;
mod sys;
mod track;
mod waiter;

pub use device::{list_devices, DeviceAttrs, ListedDevice, PortAttrs};
pub use error::OpenError;
pub use nic::VerbsNic;
pub use qp::PortInfo;
// The safe wrappers under `VerbsNic` (device context, PD, regions, windows,
// queues, work requests): internal, as `NicOps` is, so that no program can
// reach a connection's QP or windows behind it; mwcap's own verbs tests use
// them with the `testing` feature.
#[cfg(feature = "testing")]
pub use {
    cq::{CompChannel, Cq},
    device::Context,
    mr::Mr,
    mw::Mw,
    pd::Pd,
    post::{PostError, SendChain, SendOp, SendRequest, Slice, SliceList, MAX_CHAIN},
    qp::Qp,
    srq::Srq,
};
#[cfg(not(feature = "testing"))]
#[allow(unused_imports)]
pub(crate) use {
    cq::{CompChannel, Cq},
    device::Context,
    mr::Mr,
    mw::Mw,
    pd::Pd,
    post::{PostError, SendChain, SendOp, SendRequest, Slice, SliceList, MAX_CHAIN},
    qp::Qp,
    srq::Srq,
};
