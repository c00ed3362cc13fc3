//! What can go wrong while connecting two queue pairs over TCP.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use super::auth::AuthFailure;
use super::caps::PolicySet;
use super::wire::DecodeError;

/// The step of the exchange an error happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Phase {
    /// Opening the TCP connection (client) or accepting it (server).
    Connect,
    /// Proving the pre-shared key, both ways (or agreeing to run without).
    Auth,
    /// Sending our hello and reading the peer's.
    Hello,
    /// Sending our ready byte and reading the peer's.
    Ready,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Connect => "connect",
            Phase::Auth => "auth",
            Phase::Hello => "hello",
            Phase::Ready => "ready",
        })
    }
}

/// Which end of the connection something is wrong with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// This process.
    Local,
    /// The remote peer.
    Peer,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "this side's",
            Side::Peer => "the peer's",
        })
    }
}

/// Why the bootstrap exchange failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// No TCP connection could be opened to the peer.
    #[error(
        "cannot reach the mwcap peer at {addr}: {source}; is the server running? check the address and port"
    )]
    Unreachable {
        /// The address tried.
        addr: SocketAddr,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// The peer did not answer in time.
    #[error(
        "timed out after {after:?} in the {phase} phase; the peer may be stuck, \
         or it may not be an mwcap peer: check the address and port"
    )]
    TimedOut {
        /// Where it stopped.
        phase: Phase,
        /// The time allowed.
        after: Duration,
    },
    /// The peer runs another version of the protocol.
    #[error(
        "mwcap protocol version mismatch: this side speaks {ours}, the peer {theirs}; \
         upgrade the older side so both run the same mwcap"
    )]
    VersionMismatch {
        /// Our version.
        ours: u16,
        /// The peer's version.
        theirs: u16,
    },
    /// Whatever answered is not mwcap.
    #[error("{peer} is not an mwcap peer (it sent {prefix:02x?} where \"MWCP\" belongs); check the address and port")]
    NotMwcapPeer {
        /// Who answered.
        peer: SocketAddr,
        /// The bytes it sent where the magic belongs.
        prefix: Vec<u8>,
    },
    /// The peer's message is damaged or does not follow the protocol.
    #[error("malformed message from {peer}: {source}")]
    Malformed {
        /// Who sent it.
        peer: SocketAddr,
        /// What is wrong with it.
        #[source]
        source: DecodeError,
    },
    /// The peer closed the connection before the exchange finished.
    #[error("{peer} closed the connection in the {phase} phase; see the peer's log for why")]
    PeerClosed {
        /// Who closed.
        peer: SocketAddr,
        /// Where it happened.
        phase: Phase,
    },
    /// A device or GID cannot carry the connection (an all-zero GID, an invalid path MTU).
    #[error("{side} device or GID is unusable: {source}")]
    Unusable {
        /// Whose device.
        side: Side,
        /// What is wrong.
        #[source]
        source: DecodeError,
    },
    /// The caller's own hello is invalid (a QPN, PSN or limit out of range).
    #[error("invalid local hello: {0}; this is a bug in the caller")]
    InvalidHello(#[source] DecodeError),
    /// No direction has a policy both sides support.
    #[error(
        "no policy in common: this side serves {local_serve:?} and reads {local_read:?}, \
         the peer serves {peer_serve:?} and reads {peer_read:?}; enable confirm on both sides \
         (it works on every NIC)"
    )]
    NoCommonPolicy {
        /// Policies this side can serve.
        local_serve: PolicySet,
        /// Policies this side can read under.
        local_read: PolicySet,
        /// Policies the peer can serve.
        peer_serve: PolicySet,
        /// Policies the peer can read under.
        peer_read: PolicySet,
    },
    /// The peer did not prove the pre-shared key: its proof matches no key
    /// of this side.
    #[error(
        "{peer} did not prove the pre-shared key: its proof matches no key of this side's \
         (the keys differ, or a recorded handshake was replayed); give both sides the same key \
         (or add the peer's key to this side's keyring)"
    )]
    AuthFailed {
        /// Who failed.
        peer: SocketAddr,
    },
    /// This side connects with a keyring that does not say which of its
    /// keys to prove.
    #[error("{}", no_identity(*keys))]
    NoIdentity {
        /// How many keys the ring holds.
        keys: usize,
    },
    /// The peer refused this side's proof of the pre-shared key.
    #[error(
        "{peer} refused this side's proof of the pre-shared key: the peer does not hold this side's key; \
         give both sides the same key (or add this side's key to the peer's keyring)"
    )]
    AuthRejected {
        /// Who refused.
        peer: SocketAddr,
    },
    /// This side requires the pre-shared key and the peer runs without one.
    #[error(
        "{peer} runs without authentication, but this side requires the pre-shared key; \
         give the peer the same key (or, on a trusted network only, run both sides unauthenticated)"
    )]
    PeerUnauthenticated {
        /// The peer.
        peer: SocketAddr,
    },
    /// The peer requires a pre-shared key and this side runs without one.
    #[error("{peer} requires a pre-shared key, but this side runs without authentication; give this side the peer's key")]
    PeerRequiresKey {
        /// The peer.
        peer: SocketAddr,
    },
    /// The peer's hello does not carry a valid tag for this session.
    #[error(
        "{peer}'s hello does not carry a valid tag for this session: it was altered on the way, \
         or someone without the key took over the connection; do not trust this network path"
    )]
    HelloNotAuthentic {
        /// Whose hello.
        peer: SocketAddr,
    },
    /// Another socket error.
    #[error("tcp error in the {phase} phase: {source}")]
    Io {
        /// Where it happened.
        phase: Phase,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
}

impl BootstrapError {
    /// The error for a peer's hello or ready byte that failed to decode.
    pub(super) fn from_peer(peer: SocketAddr, e: DecodeError) -> BootstrapError {
        match e {
            DecodeError::NotMwcap { prefix } => BootstrapError::NotMwcapPeer { peer, prefix },
            DecodeError::VersionMismatch { ours, theirs } => BootstrapError::VersionMismatch { ours, theirs },
            DecodeError::ZeroGid | DecodeError::InvalidMtu(_) => {
                BootstrapError::Unusable { side: Side::Peer, source: e }
            }
            e => BootstrapError::Malformed { peer, source: e },
        }
    }

    /// The error for a failed auth phase.
    pub(super) fn from_auth(peer: SocketAddr, e: AuthFailure) -> BootstrapError {
        match e {
            AuthFailure::ProofInvalid => BootstrapError::AuthFailed { peer },
            AuthFailure::ProofRejected => BootstrapError::AuthRejected { peer },
            AuthFailure::PeerUnauthenticated => BootstrapError::PeerUnauthenticated { peer },
            AuthFailure::PeerRequiresKey => BootstrapError::PeerRequiresKey { peer },
            AuthFailure::Unexpected { got, expected } => {
                BootstrapError::Malformed { peer, source: DecodeError::UnexpectedFrame { got, expected } }
            }
        }
    }

    /// The error for our own hello failing validation.
    pub(super) fn from_local(e: DecodeError) -> BootstrapError {
        match e {
            DecodeError::ZeroGid | DecodeError::InvalidMtu(_) => {
                BootstrapError::Unusable { side: Side::Local, source: e }
            }
            e => BootstrapError::InvalidHello(e),
        }
    }

    /// The error for a failed socket read or write.
    pub(super) fn from_io(peer: SocketAddr, phase: Phase, after: Duration, e: io::Error) -> BootstrapError {
        use io::ErrorKind::*;
        match e.kind() {
            WouldBlock | TimedOut => BootstrapError::TimedOut { phase, after },
            UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe => {
                BootstrapError::PeerClosed { peer, phase }
            }
            _ => BootstrapError::Io { phase, source: e },
        }
    }
}

fn no_identity(keys: usize) -> String {
    match keys {
        0 => "the keyring is empty, so this side has no key to prove as a client; \
              add its key (Keyring::insert, or a line of the --keyring file)"
            .into(),
        n => format!(
            "the keyring holds {n} keys and none is chosen as this side's identity; \
             choose the one to prove with Keyring::prove_as (mwcap: --identity NAME)"
        ),
    }
}
