//! What the setup of a connection over TCP shares between
//! [`Endpoint::connect`](super::Endpoint::connect) and
//! [`Endpoint::accept`](super::Endpoint::accept) (which run it, in
//! `listen.rs`): the policy choice, `mw`, `confirm` or `auto`, its
//! options and errors.
//!
//! Each side says which policies it can *serve* for memory it exposes
//! (with `auto`: what its own capability probe found) and reads both; the
//! bootstrap picks per direction the owner's `serve` ∩ the reader's
//! `read`, preferring mw (`docs/protocol.md`, "Choosing: `mw`, `confirm`
//! or `auto`"). The server creates nothing for a client before it proved
//! the key ([`Auth`]; `docs/protocol-bootstrap.md`).

use std::time::Duration;

use super::{Config, Policies, Role};
use crate::backend::{Nic, NicError};
use crate::bootstrap::{Auth, BootstrapError, Capabilities, Handshake, PolicySet};
use crate::ProbeCache;

/// What a side asks for when it connects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyChoice {
    /// Serve only type-2 windows; fail if the device cannot (see `mwcap
    /// probe`), or if a peer could invalidate other connections' windows
    /// there and the peers are not trusted ([`EndpointBuilder::trusted_peers`](super::EndpointBuilder::trusted_peers)).
    Mw,
    /// Serve only the confirm protocol.
    Confirm,
    /// Probe the device and serve mw where it works and is safe with the
    /// peers (see [`Mw`](PolicyChoice::Mw)), else confirm.
    Auto,
}

/// Why setting up a connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The TCP exchange failed (unreachable, version mismatch, no common policy...).
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// The NIC refused to create or connect the endpoint's resources.
    #[error("the NIC refused: {0}")]
    Nic(#[from] NicError),
    /// The connection's settings cannot work; nothing was created.
    #[error(transparent)]
    Config(#[from] super::ConfigError),
    /// A shared completion queue has no room left for another queue pair's
    /// completions (it would overflow, taking every connection on it down).
    #[error("the endpoint's completion queue holds {depth} entries, {reserved} are reserved by its connections and this one needs {wanted}: serve it on another endpoint (one per driver thread), or build the endpoint with a deeper queue (EndpointBuilder::queue_depth)")]
    CqBudget {
        /// The queue's depth.
        depth: u32,
        /// Entries reserved by the connections on it.
        reserved: u64,
        /// What the new connection needs.
        wanted: u32,
    },
    /// An endpoint's shared receive queue is at its most and has no room for a
    /// new connection's initial share.
    #[error("the endpoint's shared receive queue holds its most, {max_slots} receives, and its connections' shares take {shares}: serve this connection on another endpoint, or raise SrqConfig::max_slots (up to the device's max_srq_wr)")]
    SrqBudget {
        /// `SrqConfig::max_slots`.
        max_slots: u32,
        /// The connections' shares, summed.
        shares: u32,
    },
    /// `mw` was asked for but the device's type-2 windows do not work.
    #[error("the mw policy was requested but type-2 windows fail on {device} ({why}); use confirm or auto")]
    MwUnusable {
        /// The device.
        device: String,
        /// The probe's first failing step.
        why: String,
    },
    /// `mw` was asked for, with peers that are not trusted, on a device
    /// where a peer can invalidate windows bound to other queue pairs (rxe):
    /// a peer could make its owner invalidate a window twice, which panics
    /// the rxe kernel driver.
    #[error("the mw policy was requested but on {device} a peer can invalidate windows bound to other connections' queue pairs (SEND_WITH_INV; {why}), and a double invalidation panics the rxe kernel: use confirm or auto, or, if every peer is yours, EndpointBuilder::trusted_peers(true)")]
    MwUnsafe {
        /// The device.
        device: String,
        /// What the probe measured.
        why: String,
    },
    /// The endpoint stopped listening
    /// ([`Endpoint::stop_listening`](super::Endpoint::stop_listening)): it
    /// takes no more clients. End the accept loop.
    #[error("the listener was closed (Endpoint::stop_listening): it accepts no more clients (build a new endpoint to accept again)")]
    ListenerClosed,
    /// [`Endpoint::accept`](super::Endpoint::accept) on an endpoint that
    /// does not listen.
    #[error("this endpoint does not listen: build it with EndpointBuilder::listen(addr) to accept clients")]
    NotListening,
}

/// What this side serves for `choice`: the probe's verdict for `mw` and
/// `auto` (from `probes`, which may already know the device).
///
/// Where a peer can invalidate windows bound to other queue pairs (the
/// probe's [`ProbeReport::mw_safe_with_untrusted_peers`](crate::ProbeReport::mw_safe_with_untrusted_peers)),
/// mw is served only to `trusted` peers.
pub(super) fn serve_set(
    nic: &dyn Nic,
    choice: PolicyChoice,
    trusted: bool,
    probes: &ProbeCache,
) -> Result<PolicySet, SetupError> {
    match choice {
        PolicyChoice::Confirm => Ok(PolicySet::CONFIRM),
        PolicyChoice::Mw | PolicyChoice::Auto => {
            let report = probes.report(nic);
            let safe = trusted || report.mw_safe_with_untrusted_peers();
            match (report.mw_usable, choice) {
                (true, PolicyChoice::Mw) if !safe => Err(SetupError::MwUnsafe {
                    device: report.device.name.clone(),
                    why: format!(
                        "another QP of the PD: {}, another PD: {}",
                        measured(report.other_qp_invalidates),
                        measured(report.other_pd_invalidates)
                    ),
                }),
                (true, PolicyChoice::Mw) => Ok(PolicySet::MW),
                (true, _) if !safe => {
                    tracing::warn!(
                        device = %report.device.name,
                        "type-2 windows work here, but a peer can invalidate windows bound to other queue \
                         pairs: serving confirm (EndpointBuilder::trusted_peers(true) serves mw to peers you trust)"
                    );
                    Ok(PolicySet::CONFIRM)
                }
                (true, _) => Ok(PolicySet::BOTH),
                (false, PolicyChoice::Mw) => Err(SetupError::MwUnusable {
                    device: report.device.name.clone(),
                    why: report.first_failure().map(|(s, t)| format!("{s}: {t}")).unwrap_or_default(),
                }),
                (false, _) => Ok(PolicySet::CONFIRM),
            }
        }
    }
}

fn measured(b: Option<bool>) -> &'static str {
    match b {
        Some(true) => "invalidates",
        Some(false) => "refused",
        None => "not measured",
    }
}

/// The capabilities this side sends in its hello.
pub(super) fn local_caps(cfg: &Config, serve: PolicySet) -> Capabilities {
    let mut caps = Capabilities::new();
    caps.serve = serve;
    caps.read = PolicySet::BOTH;
    caps.lease_ms = u32::try_from(cfg.lease_time.as_millis()).unwrap_or(u32::MAX).max(1);
    caps.start_credits = cfg.start_credits;
    caps
}

/// The policies both hellos agreed on, for this side's `role`, and the
/// lease time that applies (the shorter of the two sides'), written into
/// `cfg`.
pub(super) fn agreed<S>(hs: &Handshake<S>, role: Role, cfg: &mut Config) -> Result<Policies, SetupError> {
    let n = hs.negotiated();
    let (Some(we), Some(they)) = (n.we_expose, n.peer_exposes) else {
        // `negotiate` already refuses this; kept as an error, not a panic.
        let (l, p) = (&hs.local().caps, &hs.peer().caps);
        return Err(SetupError::Bootstrap(BootstrapError::NoCommonPolicy {
            local_serve: l.serve,
            local_read: l.read,
            peer_serve: p.serve,
            peer_read: p.read,
        }));
    };
    cfg.lease_time = cfg.lease_time.min(n.lease);
    Ok(match role {
        Role::Client => Policies { request: we, reply: they },
        Role::Server => Policies { request: they, reply: we },
    })
}

/// How to set up connections: the policy choice, the key, the time
/// allowed per phase, and the [`ProbeCache`] that remembers each device's
/// probe. An [`Endpoint`](super::Endpoint) keeps one, set by its builder
/// ([`EndpointBuilder`](super::EndpointBuilder) is where a user sets them).
#[derive(Clone, Debug)]
pub(crate) struct SetupOptions {
    /// Which policies to serve.
    pub choice: PolicyChoice,
    /// The pre-shared key, or running without one.
    pub auth: Auth,
    /// The time allowed for each phase (connect and auth, hello, ready).
    pub timeout: Duration,
    /// Where the capability probe's verdicts are kept.
    pub probes: ProbeCache,
    /// Whether every peer is trusted: see
    /// [`EndpointBuilder::trusted_peers`](super::EndpointBuilder::trusted_peers).
    pub trusted_peers: bool,
}
