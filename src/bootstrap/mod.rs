//! TCP bootstrap of RC queue pairs.
//!
//! rdma_cm does not work on rxe over loopback, so two mwcap peers connect
//! their queue pairs by exchanging what each needs over a plain TCP
//! connection, in two phases:
//!
//! 1. **hello**: each side sends a [`Hello`] (its QPN, GID, PSN, MTU, LID and
//!    [`Capabilities`]) and reads the peer's. Both validate it and
//!    [`negotiate`] the parameters (the path MTU is the smaller of the two).
//! 2. **ready**: each side moves its queue pair through RTR to RTS towards
//!    [`Handshake::remote_endpoint`], then sends one ready byte and waits for
//!    the peer's. When [`Handshake::ready`] returns, the peer's queue pair is
//!    in RTS, so a SEND cannot reach a queue pair that is not yet receiving.
//!
//! ```no_run
//! # use mwcap::backend::{Nic, QpId, QpEndpoint};
//! # use mwcap::bootstrap::{exchange_client, Capabilities, Hello};
//! # use std::time::Duration;
//! # fn demo(nic: &dyn Nic, qp: QpId, local: QpEndpoint) -> Result<(), Box<dyn std::error::Error>> {
//! let timeout = Duration::from_secs(5);
//! let hs = exchange_client("192.0.2.7:18515".parse()?, &Hello::new(local, Capabilities::new()), timeout)?;
//! nic.connect_qp(qp, &hs.remote_endpoint())?;
//! let control = hs.ready(timeout)?; // keep it: its closing tells that the peer went away
//! # drop(control); Ok(()) }
//! ```
//!
//! Both are offered over blocking `std::net` sockets ([`exchange_client`],
//! [`exchange_server`]) and over `async-io` ([`exchange_client_async`],
//! [`exchange_server_async`]). The [wire format](self#wire-format) is
//! a fixed header (magic, version, kind, length) and a fixed body, decoded by
//! [`decode`] or, from a stream, by [`HelloDecoder`]. The decoders read
//! untrusted bytes: they never panic, never wait for more than
//! [`MAX_FRAME_LEN`] bytes, and reject trailing bytes.
//!
//! # Wire format
//! See the constants: [`MAGIC`], [`PROTOCOL_VERSION`], [`HEADER_LEN`],
//! [`HELLO_BODY_LEN`], [`MAX_BODY_LEN`], [`READY_BYTE`]. A peer of another
//! version fails with [`BootstrapError::VersionMismatch`]; anything else
//! that answers fails with [`BootstrapError::NotMwcapPeer`].

mod blocking;
mod caps;
mod error;
mod handshake;
mod key;
mod negotiate;
// async-io is left out of loom builds (see Cargo.toml).
#[cfg(not(loom))]
mod nonblocking;
mod wire;

pub use blocking::{exchange_accepted, exchange_client, exchange_server};
pub use caps::{Capabilities, Features, Policy, PolicySet};
pub use error::{BootstrapError, Phase, Side};
pub use handshake::Handshake;
pub use key::{Auth, Key, KeyError, KEY_ENV_VAR};
pub use negotiate::{negotiate, Negotiated};
#[cfg(not(loom))]
pub use nonblocking::{exchange_accepted_async, exchange_client_async, exchange_server_async};
pub use wire::{
    decode, encode, DecodeError, Hello, HelloDecoder, HEADER_LEN, HELLO_BODY_LEN, MAGIC, MAX_BODY_LEN,
    MAX_FRAME_LEN, PEER_QP_ID, PROTOCOL_VERSION, READY_BYTE, VALID_MTUS,
};
