//! The auth phase as a sans-IO state machine, and the MACs it and the hello
//! tags are made of.
//!
//! With a key `K` and fresh 32-byte nonces `Nc` (client) and `Ns` (server):
//!
//! ```text
//! 1. client -> server  init(mode, Nc)
//! 2. server -> client  challenge(mode, Ns)   or reject(KeyRequired | NoKey) if the modes differ
//!                      (both without a key: the phase ends here)
//! 3. client -> server  proof(Pc)             or reject(KeyRequired | NoKey) if the modes differ
//! 4. server -> client  proof(Ps)             or reject(BadProof)
//!
//! Pc  = HMAC-SHA256(K, "mwcap bootstrap v2 auth proof\0" || 'C' || Nc || Ns)
//! Ps  = HMAC-SHA256(K, "mwcap bootstrap v2 auth proof\0" || 'S' || Nc || Ns)
//! tag = HMAC-SHA256(K, "mwcap bootstrap v2 hello tag\0"  || sender || Nc || Ns || hello frame)
//! ```
//!
//! The client proves first, so the server computes nothing keyed for a peer
//! that has not proved the key, and it creates nothing for it either. The
//! sender's role byte keeps a proof from being reflected back to its sender
//! as the other side's; the two nonces keep a recorded proof from being
//! replayed into a new session, whose other nonce is fresh. The hello tags
//! bind each side's queue pair parameters to the session, so a relay in
//! the middle cannot swap in its own queue pair. Proofs and tags are checked
//! in constant time ([`Mac::verify_slice`]).

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use super::error::{BootstrapError, Phase};
use std::sync::Arc;

use super::key::{Auth, Key, SHARED_IDENTITY};
use super::wire::{AuthFrame, AuthMode, RejectReason, MAC_LEN, NONCE_LEN};

type Nonce = [u8; NONCE_LEN];

const PROOF_LABEL: &[u8] = b"mwcap bootstrap v2 auth proof\0";
const HELLO_LABEL: &[u8] = b"mwcap bootstrap v2 hello tag\0";

/// Which end of the bootstrap a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    /// The side that connected.
    Client,
    /// The side that accepted.
    Server,
}

impl End {
    fn byte(self) -> u8 {
        match self {
            End::Client => b'C',
            End::Server => b'S',
        }
    }
    fn other(self) -> End {
        match self {
            End::Client => End::Server,
            End::Server => End::Client,
        }
    }
}

/// A fresh nonce from the operating system's generator.
pub(super) fn fresh_nonce() -> Result<Nonce, BootstrapError> {
    let mut nonce = [0; NONCE_LEN];
    rand::rngs::OsRng
        .try_fill_bytes(&mut nonce)
        .map_err(|e| BootstrapError::Io { phase: Phase::Auth, source: std::io::Error::other(e) })?;
    Ok(nonce)
}

/// The MAC of `sender` over the session's nonces and `rest`, under `label`.
fn mac(key: &Key, label: &[u8], sender: End, nonces: (&Nonce, &Nonce), rest: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length; `Key` guarantees at least 16 bytes.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key.bytes()).expect("HMAC accepts any key length");
    m.update(label);
    m.update(&[sender.byte()]);
    m.update(nonces.0);
    m.update(nonces.1);
    m.update(rest);
    m
}

/// What both sides share once the auth phase is over.
#[derive(Clone, Debug)]
pub(super) struct Session {
    us: End,
    keyed: Option<Keyed>,
}

#[derive(Clone, Debug)]
struct Keyed {
    key: Key,
    /// The key's name: the peer's identity.
    name: Arc<str>,
    client_nonce: Nonce,
    server_nonce: Nonce,
}

impl Keyed {
    fn mac(&self, label: &[u8], sender: End, rest: &[u8]) -> Hmac<Sha256> {
        mac(&self.key, label, sender, (&self.client_nonce, &self.server_nonce), rest)
    }
}

impl Session {
    /// Whether the peer proved the key.
    pub(super) fn is_keyed(&self) -> bool {
        self.keyed.is_some()
    }

    /// The name of the key the peer proved: its identity (`None` without a key).
    pub(super) fn identity(&self) -> Option<&Arc<str>> {
        self.keyed.as_ref().map(|k| &k.name)
    }

    /// The tag to send after our hello `frame`, if the session has a key.
    pub(super) fn hello_tag(&self, frame: &[u8]) -> Option<[u8; MAC_LEN]> {
        let k = self.keyed.as_ref()?;
        Some(k.mac(HELLO_LABEL, self.us, frame).finalize().into_bytes().into())
    }

    /// Whether `tag` is the peer's tag for its hello `frame` (constant time).
    /// Without a key there is no tag, and nothing to check.
    pub(super) fn check_hello_tag(&self, frame: &[u8], tag: &[u8; MAC_LEN]) -> bool {
        match &self.keyed {
            Some(k) => k.mac(HELLO_LABEL, self.us.other(), frame).verify_slice(tag).is_ok(),
            None => true,
        }
    }
}

/// Why the auth phase failed, before the peer's address is added
/// ([`BootstrapError::from_auth`](super::BootstrapError)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AuthFailure {
    /// The peer's proof does not match our key.
    ProofInvalid,
    /// The peer refused our proof.
    ProofRejected,
    /// We have a key, the peer runs without.
    PeerUnauthenticated,
    /// The peer has a key, we run without.
    PeerRequiresKey,
    /// A frame arrived that does not belong at this point.
    Unexpected {
        /// What arrived.
        got: &'static str,
        /// What belongs there.
        expected: &'static str,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    AwaitInit,
    AwaitChallenge,
    AwaitProof,
    Done,
    Failed,
}

/// One side of the auth phase.
///
/// Drive it like this: send every frame [`poll_transmit`](Self::poll_transmit)
/// gives; if [`session`](Self::session) is `Some`, the phase is over; else
/// read one auth frame and [`handle_frame`](Self::handle_frame) it. On an
/// error, still send what `poll_transmit` gives (a reject that tells the
/// peer why), then close.
#[derive(Debug)]
pub(super) struct Machine {
    us: End,
    /// The keys this side proves or accepts: a client's one, a server's
    /// ring; empty without a key. Once the peer's proof is checked, the
    /// one it proved is `keys[proved]`.
    keys: Arc<Vec<(Arc<str>, Key)>>,
    /// Whether this side runs with a key (a server with an empty ring
    /// does, and accepts no one).
    keyed: bool,
    proved: usize,
    ours: Nonce,
    theirs: Nonce,
    step: Step,
    out: Option<AuthFrame>,
}

impl Machine {
    /// The client, with its fresh nonce: it speaks first. A keyring of
    /// several keys must say which one the client proves.
    pub(super) fn client(auth: &Auth, nonce: Nonce) -> Result<Machine, BootstrapError> {
        let keys = match auth {
            Auth::Key(k) => vec![(Arc::from(SHARED_IDENTITY), k.clone())],
            Auth::Keyring(ring) => match ring.own() {
                Some((name, key)) => vec![(name.clone(), key.clone())],
                None => return Err(BootstrapError::NoIdentity { keys: ring.len() }),
            },
            Auth::Unauthenticated => Vec::new(),
        };
        let keys = Arc::new(keys);
        let keyed = !keys.is_empty();
        let mut m = Machine::new(End::Client, keys, keyed, nonce, Step::AwaitChallenge);
        m.out = Some(AuthFrame::Init { mode: m.mode(), nonce });
        Ok(m)
    }

    /// The server, with its fresh nonce: it waits for the client's init,
    /// and accepts a proof of any of its keys.
    pub(super) fn server(auth: &Auth, nonce: Nonce) -> Machine {
        let keys = match auth {
            Auth::Key(k) => Arc::new(vec![(Arc::from(SHARED_IDENTITY), k.clone())]),
            Auth::Keyring(ring) => ring.keys().clone(),
            Auth::Unauthenticated => Arc::default(),
        };
        let keyed = !matches!(auth, Auth::Unauthenticated);
        Machine::new(End::Server, keys, keyed, nonce, Step::AwaitInit)
    }

    fn new(us: End, keys: Arc<Vec<(Arc<str>, Key)>>, keyed: bool, ours: Nonce, step: Step) -> Machine {
        Machine { us, keys, keyed, proved: 0, ours, theirs: [0; NONCE_LEN], step, out: None }
    }

    fn mode(&self) -> AuthMode {
        if self.keyed {
            AuthMode::PreSharedKey
        } else {
            AuthMode::Unauthenticated
        }
    }

    /// The next frame to send.
    #[must_use]
    pub(super) fn poll_transmit(&mut self) -> Option<AuthFrame> {
        self.out.take()
    }

    /// The session, once the phase is over (and the last frame was polled).
    pub(super) fn session(&self) -> Option<Session> {
        if self.step != Step::Done || self.out.is_some() {
            return None;
        }
        let keyed = self.keys.get(self.proved).map(|(name, key)| {
            let (client_nonce, server_nonce) = match self.us {
                End::Client => (self.ours, self.theirs),
                End::Server => (self.theirs, self.ours),
            };
            Keyed { key: key.clone(), name: name.clone(), client_nonce, server_nonce }
        });
        Some(Session { us: self.us, keyed })
    }

    /// The proof `sender` gives for this session.
    fn proof(&self, key: &Key, sender: End) -> Hmac<Sha256> {
        let nonces = match self.us {
            End::Client => (&self.ours, &self.theirs),
            End::Server => (&self.theirs, &self.ours),
        };
        mac(key, PROOF_LABEL, sender, nonces, &[])
    }

    /// Take one frame from the peer.
    pub(super) fn handle_frame(&mut self, frame: AuthFrame) -> Result<(), AuthFailure> {
        let r = self.step(frame);
        self.step = if r.is_err() { Step::Failed } else { self.step };
        r
    }

    fn step(&mut self, frame: AuthFrame) -> Result<(), AuthFailure> {
        let unexpected = |expected| Err(AuthFailure::Unexpected { got: frame.name(), expected });
        match (self.step, frame) {
            (Step::AwaitInit | Step::AwaitChallenge | Step::AwaitProof, AuthFrame::Reject(reason)) => {
                Err(match reason {
                    RejectReason::KeyRequired => AuthFailure::PeerRequiresKey,
                    RejectReason::NoKey => AuthFailure::PeerUnauthenticated,
                    RejectReason::BadProof => AuthFailure::ProofRejected,
                })
            }
            (Step::AwaitInit, AuthFrame::Init { mode, nonce }) => {
                self.theirs = nonce;
                self.agree(mode)?;
                self.out = Some(AuthFrame::Challenge { mode, nonce: self.ours });
                self.step = if mode == AuthMode::PreSharedKey { Step::AwaitProof } else { Step::Done };
                Ok(())
            }
            (Step::AwaitInit, _) => unexpected("an auth init"),
            (Step::AwaitChallenge, AuthFrame::Challenge { mode, nonce }) => {
                self.theirs = nonce;
                self.agree(mode)?;
                self.step = match self.keys.first() {
                    Some((_, key)) => {
                        let pc = self.proof(key, End::Client).finalize().into_bytes().into();
                        self.out = Some(AuthFrame::Proof(pc));
                        Step::AwaitProof
                    }
                    None => Step::Done,
                };
                Ok(())
            }
            (Step::AwaitChallenge, _) => unexpected("an auth challenge"),
            (Step::AwaitProof, AuthFrame::Proof(p)) => {
                if !self.keyed {
                    return unexpected("nothing (no key)");
                }
                // Check the proof against every key (a client has one), all
                // of them whichever matches, so the time does not tell which.
                // Two matches cannot happen (a ring refuses keys that are one
                // HMAC key); if they did, the proof would name neither.
                let (mut proved, mut matches) = (0, 0);
                for (i, (_, key)) in self.keys.iter().enumerate() {
                    if self.proof(key, self.us.other()).verify_slice(&p).is_ok() {
                        (proved, matches) = (i, matches + 1);
                    }
                }
                let (1, i) = (matches, proved) else {
                    if self.us == End::Server {
                        self.out = Some(AuthFrame::Reject(RejectReason::BadProof));
                    }
                    return Err(AuthFailure::ProofInvalid);
                };
                self.proved = i;
                if self.us == End::Server {
                    let ps = self.proof(&self.keys[i].1, End::Server).finalize().into_bytes().into();
                    self.out = Some(AuthFrame::Proof(ps));
                }
                self.step = Step::Done;
                Ok(())
            }
            (Step::AwaitProof, _) => unexpected("an auth proof"),
            (Step::Done | Step::Failed, _) => unexpected("nothing more in the auth phase"),
        }
    }

    /// Check the peer's mode against ours; on a difference, queue the
    /// reject that tells the peer why.
    fn agree(&mut self, theirs: AuthMode) -> Result<(), AuthFailure> {
        match (self.mode(), theirs) {
            (ours, theirs) if ours == theirs => Ok(()),
            (AuthMode::PreSharedKey, _) => {
                self.out = Some(AuthFrame::Reject(RejectReason::KeyRequired));
                Err(AuthFailure::PeerUnauthenticated)
            }
            (AuthMode::Unauthenticated, _) => {
                self.out = Some(AuthFrame::Reject(RejectReason::NoKey));
                Err(AuthFailure::PeerRequiresKey)
            }
        }
    }
}

#[cfg(test)]
mod tests;
