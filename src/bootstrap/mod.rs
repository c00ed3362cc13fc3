//! TCP bootstrap of RC queue pairs, with mutual authentication by a
//! pre-shared key.
//!
//! rdma_cm does not work on rxe over loopback, so two mwcap peers connect
//! their queue pairs by exchanging what each needs over a plain TCP
//! connection, in three phases:
//!
//! 1. **auth**: each side sends a fresh random nonce, and with
//!    [`Auth::Key`] each proves that it holds the [`Key`] with an
//!    HMAC-SHA256 over both nonces and its role; the client proves first.
//!    A side that runs with [`Auth::Unauthenticated`] says so, and a peer
//!    that does not run the same way is refused with an error that names
//!    the mismatch. Nothing is created for the peer in this phase: the
//!    queue pair comes after it (see `Authenticated`).
//! 2. **hello**: each side sends a `Hello` (its QPN, GID, PSN, MTU, LID and
//!    `Capabilities`), followed under a key by a tag that binds it to the
//!    session, and reads the peer's. Both validate it and `negotiate` the
//!    parameters (the path MTU is the smaller of the two).
//! 3. **ready**: each side moves its queue pair through RTR to RTS towards
//!    `Handshake::remote_endpoint`, then sends one ready byte and waits for
//!    the peer's. When `Handshake::ready` returns, the peer's queue pair is
//!    in RTS, so a SEND cannot reach a queue pair that is not yet receiving.
//!
//! [`Endpoint::connect`] and [`Endpoint::accept`] run all of it for a
//! connection (`Endpoint::prepare` leaves the exchange to an application's
//! own channel). The pieces (the codec, the phases' state machines, the
//! blocking and async exchanges) are internal; mwcap's tests and fuzzers
//! reach them through the `testing` feature. A failed auth phase costs the
//! listener nothing but that connection, and the handshake timeout bounds
//! how long a silent client can hold it.
//!
//! [`Endpoint::connect`]: crate::conn::Endpoint::connect
//! [`Endpoint::accept`]: crate::conn::Endpoint::accept
//!
//! # What the key protects, and what it does not
//!
//! The key authenticates the bootstrap peer: without it, no one who reaches
//! the port gets a queue pair connected to ours, nor (under the confirm
//! policy) a region's rkey; a recorded handshake cannot be replayed (the
//! other side's nonce is fresh), a proof cannot be reflected back to its
//! sender (the role is in the MAC), and a hello altered on the way, or
//! swapped by a relay in the middle, fails its tag. It does **not** encrypt
//! or authenticate anything after the bootstrap: the RDMA traffic itself
//! (RoCE or InfiniBand packets, rkeys included) travels in the clear, and
//! whoever can inject packets on the fabric with the right QPN and PSN is
//! not stopped by it. The bootstrap is not encrypted either: an observer
//! learns both sides' queue pair parameters. More in `docs/protocol-bootstrap.md`.
//!
//! # Wire format
//! Every message is a frame: a fixed header (magic, version, kind, length)
//! and a fixed body per kind (see `MAGIC`, `PROTOCOL_VERSION`,
//! `HEADER_LEN`, `HELLO_BODY_LEN`, `AUTH_HELLO_BODY_LEN`,
//! `MAC_LEN`, `MAX_BODY_LEN`, `READY_BYTE`):
//!
//! ```text
//! header:        magic "MWCP" (4) | version u16 (2) | kind u8 | body length u16
//! auth init      kind 2, client -> server: mode u8 (0 none, 1 key) | client nonce [32]
//! auth challenge kind 3, server -> client: mode u8 | server nonce [32]
//! auth proof     kind 4, client first, then server: HMAC-SHA256 [32]
//! auth reject    kind 5, either way: reason u8 (1 key required, 2 no key, 3 bad proof)
//! hello          kind 1, both ways: 54 bytes (see Hello)
//! hello tag      kind 6, after each hello under a key: HMAC-SHA256 [32]
//! ready          one byte, READY_BYTE, both ways
//! ```
//!
//! The decoders (`decode` and `HelloDecoder`, `decode_auth` and
//! `AuthDecoder`) read untrusted bytes: they never panic, never wait for
//! more than `MAX_FRAME_LEN` bytes, check the length of a kind before its
//! body, and reject trailing bytes. A peer of another version fails with
//! [`BootstrapError::VersionMismatch`]; anything else that answers fails
//! with [`BootstrapError::NotMwcapPeer`].

mod auth;
// Blocking exchanges over std's TcpStream: the tests' and fuzzers' only.
#[cfg(feature = "testing")]
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

pub use caps::Policy;
pub use error::{BootstrapError, Phase, Side};
pub use key::{Auth, Key, KeyError, Keyring, KEY_ENV_VAR, SHARED_IDENTITY};
pub use wire::RejectReason;

// The handshake's pieces (codec, state machines, blocking and async
// exchanges) are internal: mwcap's own tests and the fuzzers reach them
// through the `testing` feature. An application bootstraps through
// `Endpoint` (or its own channel, `Endpoint::prepare`).
#[cfg(feature = "testing")]
pub use testing_api::*;
#[cfg(not(feature = "testing"))]
pub(crate) use testing_api::*;

#[cfg_attr(not(feature = "testing"), allow(unused_imports))]
mod testing_api {
    #[cfg(feature = "testing")]
    pub use super::blocking::{
        authenticate_accepted, authenticate_client, authenticate_server, exchange_accepted, exchange_client,
        exchange_server,
    };
    pub use super::caps::{Capabilities, Features, PolicySet, MIN_START_CREDITS};
    pub use super::handshake::{Authenticated, Handshake};
    pub use super::negotiate::{negotiate, Negotiated};
    #[cfg(not(loom))]
    pub use super::nonblocking::{
        authenticate_accepted_async, authenticate_client_async, authenticate_server_async,
        exchange_accepted_async, exchange_client_async, exchange_server_async,
    };
    pub use super::wire::{
        decode, decode_auth, encode, encode_auth, AuthDecoder, AuthFrame, AuthMode, DecodeError, Hello,
        HelloDecoder, AUTH_HELLO_BODY_LEN, HEADER_LEN, HELLO_BODY_LEN, MAC_LEN, MAGIC, MAX_BODY_LEN,
        MAX_FRAME_LEN, NONCE_LEN, PEER_QP_ID, PROTOCOL_VERSION, READY_BYTE, VALID_MTUS,
    };
}
