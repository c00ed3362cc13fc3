//! The outcomes of the auth and hello phases, shared by the blocking and
//! async exchanges.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::backend::QpEndpoint;

use super::auth::Session;
use super::error::{BootstrapError, Phase};
use super::negotiate::{negotiate, Negotiated};
use super::wire::{AuthFrame, DecodeError, Hello, READY_BYTE};

/// The auth phase is over: the peer proved the key (or both sides agreed to
/// run without one); the hello phase remains.
///
/// Next: create the local queue pair, then call `hello` with its [`Hello`].
/// Nothing needs to exist for the peer before this point, so a peer that
/// cannot prove the key costs nothing but the TCP connection. `S` is the
/// stream, as for [`Handshake`].
#[derive(Debug)]
#[must_use = "the exchange is not finished: create the queue pair, then call hello"]
pub struct Authenticated<S> {
    pub(super) stream: S,
    pub(super) peer_addr: SocketAddr,
    pub(super) session: Session,
}

impl<S> Authenticated<S> {
    /// The peer's TCP address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }
    /// Whether the peer proved the pre-shared key (`false` when both sides
    /// run with [`Auth::Unauthenticated`](super::Auth::Unauthenticated)).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
    pub fn peer_proved_key(&self) -> bool {
        self.session.is_keyed()
    }
    /// The peer's identity: the name of the key it proved
    /// ([`SHARED_IDENTITY`](super::SHARED_IDENTITY) for an
    /// [`Auth::Key`](super::Auth::Key)); `None` without a key.
    pub fn peer_identity(&self) -> Option<&std::sync::Arc<str>> {
        self.session.identity()
    }
}

/// Our hello frame, followed by its tag when the session has a key.
pub(super) fn hello_frames(session: &Session, local: &Hello) -> Vec<u8> {
    let mut out = super::wire::encode(local);
    if let Some(tag) = session.hello_tag(&out) {
        out.extend_from_slice(&super::wire::encode_auth(&AuthFrame::HelloTag(tag)));
    }
    out
}

/// Check the tag that followed the peer's hello `frame`.
pub(super) fn check_hello_tag(
    session: &Session,
    peer_addr: SocketAddr,
    frame: &[u8],
    tag: &AuthFrame,
) -> Result<(), BootstrapError> {
    match tag {
        AuthFrame::HelloTag(tag) if session.check_hello_tag(frame, tag) => Ok(()),
        AuthFrame::HelloTag(_) => Err(BootstrapError::HelloNotAuthentic { peer: peer_addr }),
        other => Err(BootstrapError::from_peer(
            peer_addr,
            DecodeError::UnexpectedFrame { got: other.name(), expected: "a hello tag" },
        )),
    }
}

/// Both hellos are exchanged and valid; the ready phase remains.
///
/// Next: connect the local queue pair to
/// [`remote_endpoint`](Handshake::remote_endpoint) (through RTR to RTS), then
/// call `ready`, which returns once the peer's queue pair is in RTS too.
/// Only then may either side post a SEND. `S` is the stream: a
/// `std::net::TcpStream` from `exchange_client` and friends (the blocking
/// exchanges, `testing` feature only), an `Async<TcpStream>` from the `_async` functions.
#[derive(Debug)]
#[must_use = "the exchange is not finished: connect the queue pair, then call ready"]
pub struct Handshake<S> {
    pub(super) stream: S,
    pub(super) peer_addr: SocketAddr,
    pub(super) local: Hello,
    pub(super) peer: Hello,
    pub(super) negotiated: Negotiated,
}

impl<S> Handshake<S> {
    /// The hello this side sent.
    pub fn local(&self) -> &Hello {
        &self.local
    }
    /// The hello the peer sent (its endpoint's `id` is [`PEER_QP_ID`](super::PEER_QP_ID)).
    pub fn peer(&self) -> &Hello {
        &self.peer
    }
    /// What both sides agreed on.
    pub fn negotiated(&self) -> &Negotiated {
        &self.negotiated
    }
    /// The peer's TCP address.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests'
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }
    /// The endpoint to hand to `NicOps::connect_qp`:
    /// the peer's queue pair with the negotiated MTU.
    pub fn remote_endpoint(&self) -> QpEndpoint {
        QpEndpoint { mtu: self.negotiated.mtu, ..self.peer.endpoint }
    }
}

/// Validate the peer's decoded hello against ours and build the handshake.
pub(super) fn conclude<S>(
    stream: S,
    peer_addr: SocketAddr,
    local: &Hello,
    peer: Hello,
) -> Result<Handshake<S>, BootstrapError> {
    let negotiated = negotiate(local, &peer)?;
    tracing::debug!(
        %peer_addr,
        local_conn = format_args!("{:016x}", local.conn_id),
        peer_conn = format_args!("{:016x}", peer.conn_id),
        peer_qpn = peer.endpoint.qpn,
        ?negotiated,
        "bootstrap hello exchanged"
    );
    Ok(Handshake { stream, peer_addr, local: *local, peer, negotiated })
}

/// Check the peer's ready byte.
pub(super) fn check_ready(peer_addr: SocketAddr, byte: u8) -> Result<(), BootstrapError> {
    if byte == READY_BYTE {
        Ok(())
    } else {
        Err(BootstrapError::from_peer(peer_addr, DecodeError::BadReady(byte)))
    }
}

/// A time limit for one phase.
#[derive(Clone, Copy, Debug)]
pub(super) struct Deadline {
    at: Instant,
    allowed: Duration,
    phase: Phase,
}

impl Deadline {
    pub(super) fn after(allowed: Duration, phase: Phase) -> Deadline {
        Deadline { at: Instant::now() + allowed, allowed, phase }
    }
    /// The same deadline, for the next phase (the time left carries over).
    pub(super) fn with_phase(self, phase: Phase) -> Deadline {
        Deadline { phase, ..self }
    }
    // Only the async exchange uses it, which loom builds leave out.
    #[cfg_attr(loom, allow(dead_code))]
    pub(super) fn at(&self) -> Instant {
        self.at
    }
    pub(super) fn phase(&self) -> Phase {
        self.phase
    }
    /// The time left, or the timeout error once none is.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
    pub(super) fn remaining(&self) -> Result<Duration, BootstrapError> {
        match self.at.checked_duration_since(Instant::now()) {
            Some(left) if !left.is_zero() => Ok(left),
            _ => Err(self.expired()),
        }
    }
    pub(super) fn expired(&self) -> BootstrapError {
        BootstrapError::TimedOut { phase: self.phase, after: self.allowed }
    }
    pub(super) fn io_error(&self, peer: SocketAddr, e: std::io::Error) -> BootstrapError {
        BootstrapError::from_io(peer, self.phase, self.allowed, e)
    }
}
