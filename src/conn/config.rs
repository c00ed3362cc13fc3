//! A connection's settings ([`Config`]) and the policies and roles they name.

use std::time::Duration;

pub use crate::bootstrap::Policy;

/// The policy of each direction. With `auto`, each side's capability probe
/// decides the direction it owns: the client's for `request`, the server's
/// for `reply`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Policies {
    /// Request payloads (client memory, READ by the server).
    pub request: Policy,
    /// Reply payloads (server memory, READ by the client).
    pub reply: Policy,
}

impl Policies {
    /// The same policy both ways.
    pub fn both(p: Policy) -> Policies {
        Policies { request: p, reply: p }
    }

    /// The policies of `role`'s two directions: (the one it owns, whose
    /// payloads are its memory; the one it reads).
    pub fn directions(self, role: Role) -> (Policy, Policy) {
        match role {
            Role::Client => (self.request, self.reply),
            Role::Server => (self.reply, self.request),
        }
    }
}

/// Which side of a connection an endpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Sends requests, receives replies.
    Client,
    /// Receives requests, sends replies.
    Server,
}

/// A connection's settings: buffers, timeouts, flow control, bounds.
/// Start from `Config::default()` and change what you need. Not in here:
/// the role, which connecting or accepting decides, and the policies,
/// which the bootstrap (or [`Endpoint::connect_local`](super::Endpoint::connect_local),
/// [`Endpoint::prepare`](super::Endpoint::prepare)) chooses per connection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Data buffers of the standard size in the pool ([`Connection::alloc`]
    /// hands them out). Under mw each buffer of every class has a window.
    ///
    /// [`Connection::alloc`]: super::Connection::alloc
    pub buffers: u32,
    /// Bytes per standard data buffer.
    pub buffer_size: u32,
    /// Bigger buffers, for payloads larger than `buffer_size` (up to the
    /// largest class): [`Connection::alloc_for`](super::Connection::alloc_for)
    /// takes the smallest that fits, and a reader reads a payload into the
    /// smallest free one that fits. Empty by default: every payload then
    /// fits `buffer_size` or is refused.
    pub large_buffers: Vec<BufClass>,
    /// Payloads of at most this many bytes ride inline in the request or
    /// reply frame: no window, READ or release; the reader copies them into
    /// a buffer of its pool. 0 turns it off. At most [`MAX_INLINE`]. A
    /// receiver closes the connection on an inline payload above its own
    /// `inline_max` ([`Misbehavior::InlineTooLong`](super::Misbehavior::InlineTooLong)):
    /// give both sides the same (the sender's may be smaller).
    pub inline_max: u32,
    /// Exposures of ranges of user regions ([`Endpoint::register_region`](super::Endpoint::register_region))
    /// that may be live at once (under mw, a window each, on top of one per
    /// buffer). A call or reply that finds them all live waits like one
    /// that finds no free window.
    pub region_exposures: u32,
    /// READs of payloads longer than this are split into READs of this
    /// many bytes, posted together (the NIC pipelines them up to the QP's
    /// outstanding-READ limit); only the last asks for a completion.
    pub read_chunk: u32,
    /// Control slots for RECVs: the frames the peer may have in flight
    /// (on a hub with shared receives, the most the connection's share of
    /// the hub's queue grows to). Also the control slots for SENDs unless
    /// `send_slots` says otherwise.
    pub ctrl_slots: u32,
    /// The frames the peer may send before this side's first grant: the
    /// receives this side holds for it from the start (at least 3, and at
    /// most `ctrl_slots`). The rest of `ctrl_slots` goes to the peer in this
    /// side's first frame. [`Endpoint::connect`](super::Endpoint::connect)
    /// and [`Endpoint::accept`](super::Endpoint::accept) tell the peer in
    /// the hello; connections set up by hand ([`Pending::connect`](super::Pending::connect))
    /// assume the peer's is the same as this side's, so give both sides the
    /// same. On an endpoint with shared receives it is also the least a
    /// connection's share of the queue shrinks to, so it is what an idle
    /// connection holds there (4 KiB a receive): a few (3) keep 10,000 idle
    /// connections small, at the cost of a round trip before a new
    /// connection's first burst of more than 2 frames.
    pub start_credits: u32,
    /// Control slots for SENDs (4 KiB of registered memory each): the
    /// frames this side may have in flight. `None`: `ctrl_slots`. A call or
    /// reply that finds none free waits. On an endpoint with shared
    /// receives they are the endpoint's, lent while a SEND is in flight,
    /// and this bounds what the connection borrows at once. At least 2.
    pub send_slots: Option<u32>,
    /// How long an exposure lives before the owner takes it back.
    pub lease_time: Duration,
    /// Reader side: the time a lease must have left to be worth READing.
    pub safety_margin: Duration,
    /// Client: how long a call may take before it fails.
    pub call_timeout: Duration,
    /// Confirm policy: READs of a reply before giving up on stale reads.
    pub max_attempts: u32,
    /// Seed for the consumer keys (a window key's low 8 bits) of this
    /// connection's window binds. `None`, the default: drawn from the
    /// operating system's random source for each connection, so that no
    /// peer can tell one connection's keys from another's (on rxe, a peer
    /// that knows a window's key can invalidate it through any QP of the
    /// device). Set it only to make a test's keys repeatable.
    pub seed: Option<u64>,
    /// How long a call waiting for its reply takes its connection's turns
    /// itself (polling the endpoint's completion queue on the caller's
    /// thread) before it leaves the work to the endpoint's driver, counted
    /// from the start of its wait and again from each turn that found
    /// something to do (a reply's READ, a confirm's answer). Longer costs
    /// CPU; shorter costs a wake-up, often across threads, per call. 200 µs
    /// by default: longer than a call takes with 16 in flight on the
    /// simulator (p50 about 80 µs), which a 50 µs window outlived, so that
    /// under smol and tokio such calls were handed over across threads
    /// (`docs/benchmarks.md`, stop 60). A
    /// window of 500 µs or more lingers: calls made one after another cost
    /// the driver no wake-up each. How the spin yields its core and how it
    /// lingers: `docs/architecture.md`, "The driver". The driver's own
    /// polling is [`EndpointBuilder::busy_poll`](super::EndpointBuilder::busy_poll).
    pub busy_poll: Duration,
    /// Server: how long [`Connection::next_request`](super::Connection::next_request)
    /// waiting for a request takes its connection's turns itself (polling
    /// the endpoint's completion queue on the serving thread) before it
    /// waits for the endpoint's driver (counted, and lingering, as for
    /// `busy_poll`). 0, the default: it waits for the driver at once, whose
    /// thread, if it is another, then wakes the serving one for each
    /// request. The window runs out whenever no
    /// request comes, so give it to a thread or task that serves one busy
    /// connection (as perftest's server polls); on a server of many mostly
    /// idle connections each window costs its CPU for nothing.
    pub serve_busy_poll: Duration,
    /// Receiver-not-ready retries before a SEND fails with
    /// `RnrRetryExcErr` and the connection is declared dead (0..=6; the
    /// verbs value 7, "retry forever", is never used: a peer that stops
    /// posting receives must not hold exposed buffers forever).
    pub rnr_retry: u8,
    /// How long the NIC waits for the peer's acknowledgement of a request
    /// before it sends it again (the queue pair's local ACK timeout,
    /// rounded up to the next 4.096 µs × 2^n; 7 retries, then the
    /// connection fails with `RetryExcErr`). Default 1 s (1.07 s), as
    /// NCCL and UCX use. Keep it well above the longest stall an
    /// acknowledgement may meet: a retransmission is harmless on a NIC that
    /// keeps to the specification, but rxe (SoftRoCE) wedges or fails a
    /// send queue it retries past a completed window bind
    /// (`docs/deploy.md`, "rxe and retransmissions"). The simulated NIC's
    /// retransmissions are its fault injector's
    /// ([`Faults::ack_timeout`](crate::sim::Faults::ack_timeout)).
    pub ack_timeout: Duration,
    /// Server: request payloads (window grants, confirm exposures) that
    /// may wait for a free buffer at once, while every buffer they fit is
    /// held (by the user, or by other payloads). One more takes the
    /// connection down ([`Misbehavior::TooManyWaitingPayloads`](super::Misbehavior::TooManyWaitingPayloads)):
    /// a client sends them faster than this side frees its buffers.
    /// Payloads whose lease ran out while they waited are dropped first
    /// and do not count. An honest client has at most its own buffers and
    /// region exposures exposed at once, so give it at least that many
    /// (`docs/deploy.md`, "Bounds per connection"). A client never counts
    /// the replies to its own calls (one payload each: a grant in a second
    /// reply to a call is released unread).
    pub max_waiting_payloads: u32,
    /// Server: bytes of inline request payloads that may wait in the
    /// connection for a free buffer at once (each is copied out of its
    /// frame, which goes back to the NIC, and waits there while every
    /// buffer it fits is held). One more takes the connection down
    /// ([`Misbehavior::TooMuchWaitingInline`](super::Misbehavior::TooMuchWaitingInline)):
    /// a client sends them faster than this side frees its buffers
    /// (`docs/deploy.md`, "Bounds per connection"). A client keeps at most
    /// one inline payload per call of its own.
    pub max_waiting_inline: u32,
    /// Server: the most requests of one connection it holds unanswered
    /// (received and not yet replied to), 1,024 by default. A request that
    /// comes while that many are is refused unread: the server answers it
    /// at once with a busy refusal, declines its payload, and the call
    /// fails with [`CallError::Busy`](super::CallError::Busy). This bounds
    /// what a client can make a server keep, however slowly the server's
    /// user answers (`docs/deploy.md`, "Bounds per connection"); each
    /// request held costs a few hundred bytes.
    pub max_requests: u32,
    /// On an endpoint with shared receives
    /// ([`EndpointBuilder::shared_receives`](super::EndpointBuilder::shared_receives)):
    /// how long a connection's peer may send nothing before it is asked to
    /// give back the credit its share of the queue grew by while it was
    /// busy (1 s by default; `Duration::MAX`: never). The receives go to
    /// other connections, so that connections busy once and idle since do
    /// not keep the queue full (`docs/serving.md`, "Shared receives").
    /// With [`Config::keepalive`] on, a peer that leaves the request
    /// unanswered for the keepalive's `timeout` is declared unresponsive
    /// ([`LossReason::PeerUnresponsive`](super::LossReason::PeerUnresponsive)),
    /// as for an unanswered ping: it holds the credit, and only its QP's
    /// destroy takes the receives back. With keepalive off it keeps them
    /// until it answers.
    pub give_back_after: Duration,
    /// Dead-peer detection: with `Some`, a connection pings its peer
    /// `interval` after the peer last answered one (busy or idle), and
    /// declares the peer dead ([`LossReason::PeerUnresponsive`](super::LossReason::PeerUnresponsive))
    /// if the pong does not come within `timeout`. Off by default. Both
    /// sides answer pings whether or not they send their own. Only the
    /// pong that echoes the ping answers it (what a ping proves:
    /// `docs/protocol.md`, "Keepalive").
    pub keepalive: Option<Keepalive>,
}

/// The most bytes [`Config::inline_max`] may be: an inline payload, its
/// header and attachments fit one frame.
pub const MAX_INLINE: u32 = 1024;

/// The most buffer classes a pool may have: the standard one and 255
/// [`Config::large_buffers`] classes.
pub const MAX_CLASSES: usize = 256;

/// The longest time setting (a year): deadlines are the clock plus a
/// setting, and a longer one would overflow it. [`Config::give_back_after`]
/// may also be `Duration::MAX` (never).
pub const MAX_TIME_SETTING: Duration = Duration::from_secs(365 * 24 * 3600);

/// Why [`Config::check`] refused a configuration (the field to change is
/// in the message).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The standard class is empty.
    #[error(
        "Config::buffers is {buffers} and Config::buffer_size {buffer_size}: a connection needs \
         at least one standard buffer of at least one byte (inline payloads land in one)"
    )]
    NoBuffers {
        /// `Config::buffers`.
        buffers: u32,
        /// `Config::buffer_size`.
        buffer_size: u32,
    },
    /// A large class is no larger than a standard buffer.
    #[error(
        "a Config::large_buffers class of {size}-byte buffers is not larger than \
         Config::buffer_size ({buffer_size}); make it larger, or add to Config::buffers"
    )]
    LargeClassTooSmall {
        /// The class's buffer size.
        size: u32,
        /// `Config::buffer_size`.
        buffer_size: u32,
    },
    /// More classes than a pool can tell apart.
    #[error("{classes} buffer classes (Config::buffer_size and Config::large_buffers), above the {MAX_CLASSES} a pool can have; merge some")]
    TooManyClasses {
        /// Classes asked for (the standard one included).
        classes: usize,
    },
    /// `Config::read_chunk` is 0.
    #[error("Config::read_chunk is 0; set it to the bytes per READ (1 MiB is the default)")]
    ZeroReadChunk,
    /// `Config::start_credits` is below 3 (`MIN_START_CREDITS`) or above
    /// `Config::ctrl_slots`.
    #[error(
        "Config::start_credits is {start_credits} with ctrl_slots {ctrl_slots}: it must be at least {} \
         (flow control could stall below) and at most ctrl_slots (the receives there are); change either",
        super::frame::MIN_START_CREDITS
    )]
    BadStartCredits {
        /// `Config::start_credits`.
        start_credits: u32,
        /// `Config::ctrl_slots`.
        ctrl_slots: u32,
    },
    /// Fewer than 2 send slots: a frame and a grant must be able to go.
    #[error("Config::send_slots is {send_slots}, below 2 (a frame and a credit grant); raise it, or leave it None for ctrl_slots")]
    TooFewSendSlots {
        /// `Config::send_slots`.
        send_slots: u32,
    },
    /// `Config::inline_max` is above [`MAX_INLINE`].
    #[error("Config::inline_max is {inline_max}, above MAX_INLINE ({MAX_INLINE}); lower it")]
    InlineTooLarge {
        /// `Config::inline_max`.
        inline_max: u32,
    },
    /// `Config::max_attempts` is 0.
    #[error("Config::max_attempts is 0: a confirm read could never be tried; set it to 1 or more")]
    NoAttempts,
    /// `Config::max_requests` is 0.
    #[error("Config::max_requests is 0: a server would refuse every request; set it to 1 or more (1,024 is the default)")]
    NoRequests,
    /// A time setting is longer than [`MAX_TIME_SETTING`].
    #[error(
        "Config::{setting} is {value:?}, longer than a year ({max:?}): the deadlines it sets would overflow the          clock; give a year or less (for a call that may wait as long as it likes, a year will do)",
        max = MAX_TIME_SETTING
    )]
    TimeTooLong {
        /// The setting.
        setting: &'static str,
        /// Its value.
        value: Duration,
    },
    /// The settings need more work requests on the send queue than a queue
    /// can be asked for.
    #[error(
        "these settings need {send_wrs} send work requests and {receives} receives at once, \
         more than a queue holds: fewer buffers (Config::buffers, Config::large_buffers), \
         or a larger Config::read_chunk"
    )]
    TooManyWorkRequests {
        /// Send work requests the connection may have outstanding.
        send_wrs: u64,
        /// `Config::ctrl_slots`.
        receives: u32,
    },
    /// A buffer size of the connection is not a class of the shared pool
    /// it would take its buffers from.
    #[error(
        "this connection's buffers of {size} bytes are not a class of the hub's shared buffer \
         pool (its classes are {classes:?} bytes): set Config::buffer_size and \
         Config::large_buffers to sizes the pool has"
    )]
    NotAPoolClass {
        /// The connection's buffer size.
        size: u32,
        /// The pool's buffer sizes.
        classes: Vec<u32>,
    },
    /// A connection on an endpoint with shared receives would run confirm,
    /// and the endpoint's peers are not trusted.
    #[error(
        "an endpoint with shared receives serves the mw policy only, and this connection's \
         policies are {request:?} (requests) and {reply:?} (replies): under confirm a region's key \
         would reach every connection's memory in the endpoint's protection domain; serve confirm \
         clients from an endpoint without shared receives, require PolicyChoice::Mw, or, if every \
         peer is yours, build the endpoint with EndpointBuilder::trusted_peers(true)"
    )]
    SharedReceivesNeedMw {
        /// The request payloads' policy.
        request: Policy,
        /// The reply payloads' policy.
        reply: Policy,
    },
    /// A shared buffer pool was asked for with no buffers.
    #[error("a shared buffer pool needs at least one class with a size and a count; give one")]
    EmptyPool,
    /// A shared buffer pool with more size classes than a pool can hold.
    #[error("a shared buffer pool of {classes} buffer sizes: at most {max}; use fewer sizes")]
    TooManyPoolClasses {
        /// The sizes asked for (after merging equal ones).
        classes: usize,
        /// The most a pool may have.
        max: usize,
    },
    /// A shared buffer pool class is larger than a pool can index.
    #[error(
        "a shared buffer pool class of {count} buffers of {size} bytes: at most {max} per class; \
         split it, or use fewer buffers"
    )]
    PoolClassTooLarge {
        /// The class's buffer count.
        count: u32,
        /// The class's buffer size.
        size: u32,
        /// The most a class may hold.
        max: u32,
    },
    /// An endpoint that shares receives or buffers between its connections
    /// was asked to serve another policy than mw, and its peers are not
    /// trusted.
    #[error(
        "an Endpoint with shared receives or a shared buffer pool serves the mw policy only \
         (under confirm a region's key would reach every connection's memory in its protection \
         domain), and it was built with {choice:?}: choose PolicyChoice::Mw, share nothing, or, \
         if every peer is yours, add EndpointBuilder::trusted_peers(true)"
    )]
    SharingNeedsMw {
        /// The policy choice it was built with.
        choice: super::PolicyChoice,
    },
    /// Under mw, the lease time leaves a reader no time to READ (it is at
    /// most the safety margin), or is longer than a grant can say.
    #[error(
        "Config::lease_time is {lease_time:?} (the shorter of the two sides' after a handshake) and \
         Config::safety_margin {safety_margin:?}: under mw a reader READs only while more than the \
         margin of a lease is left, so every payload would be declined; make the lease longer than \
         the margin (and at most 71 minutes, what a grant can carry)"
    )]
    BadLeaseTime {
        /// `Config::lease_time`.
        lease_time: std::time::Duration,
        /// `Config::safety_margin`.
        safety_margin: std::time::Duration,
    },
    /// A shared receive queue's settings cannot work.
    #[error(
        "SrqConfig {{ chunk: {chunk}, max_slots: {max_slots} }}: a chunk holds at least \
         {min_chunk} receives and max_slots at least a chunk; raise them"
    )]
    BadSrqConfig {
        /// `SrqConfig::chunk`.
        chunk: u32,
        /// `SrqConfig::max_slots`.
        max_slots: u32,
        /// The least a chunk may hold (the initial credits of one connection).
        min_chunk: u32,
    },
}

/// A class of data buffers of one size; see [`Config::large_buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufClass {
    /// Bytes per buffer.
    pub size: u32,
    /// How many.
    pub count: u32,
}

/// Dead-peer detection settings; see [`Config::keepalive`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Silence after which the connection pings its peer.
    pub interval: Duration,
    /// How long an unanswered ping may wait before the peer is declared dead.
    pub timeout: Duration,
}

/// The defaults: 16 buffers of 64 KiB (no larger classes), payloads up to
/// 256 bytes inline, READs in 1 MiB chunks, 5 s leases, a 500 ms safety
/// margin, 10 s calls; a server lets 64 request payloads and 64 KiB of
/// inline ones wait for a buffer. Change the rest on it
/// (`let mut cfg = Config::default(); cfg.buffers = 64;`).
impl Default for Config {
    fn default() -> Config {
        Config {
            buffers: 16,
            buffer_size: 64 << 10,
            large_buffers: Vec::new(),
            inline_max: 256,
            region_exposures: 8,
            read_chunk: 1 << 20,
            ctrl_slots: 64,
            start_credits: super::frame::INITIAL_CREDITS,
            send_slots: None,
            lease_time: Duration::from_secs(5),
            safety_margin: Duration::from_millis(500),
            call_timeout: Duration::from_secs(10),
            max_attempts: 3,
            seed: None,
            busy_poll: Duration::from_micros(200),
            serve_busy_poll: Duration::ZERO,
            rnr_retry: 6,
            ack_timeout: Duration::from_secs(1),
            keepalive: None,
            max_waiting_payloads: 64,
            max_waiting_inline: 64 << 10,
            max_requests: 1024,
            give_back_after: Duration::from_secs(1),
        }
    }
}

impl Config {
    /// Control slots for SENDs: `send_slots`, or `ctrl_slots`.
    pub(crate) fn sends(&self) -> u32 {
        self.send_slots.unwrap_or(self.ctrl_slots)
    }

    /// Whether these settings can work: every way of connecting (and
    /// [`EndpointBuilder::build`](super::EndpointBuilder::build)) refuses
    /// the ones that cannot, before it creates anything.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.buffers == 0 || self.buffer_size == 0 {
            return Err(ConfigError::NoBuffers { buffers: self.buffers, buffer_size: self.buffer_size });
        }
        if let Some(c) = self.large_buffers.iter().find(|c| c.size <= self.buffer_size) {
            return Err(ConfigError::LargeClassTooSmall { size: c.size, buffer_size: self.buffer_size });
        }
        let classes = 1 + self.large_buffers.iter().filter(|c| c.count > 0).count();
        if classes > MAX_CLASSES {
            return Err(ConfigError::TooManyClasses { classes });
        }
        if self.read_chunk == 0 {
            return Err(ConfigError::ZeroReadChunk);
        }
        if self.start_credits < super::frame::MIN_START_CREDITS || self.start_credits > self.ctrl_slots {
            return Err(ConfigError::BadStartCredits {
                start_credits: self.start_credits,
                ctrl_slots: self.ctrl_slots,
            });
        }
        if self.send_slots.is_some_and(|n| n < 2) {
            return Err(ConfigError::TooFewSendSlots { send_slots: self.send_slots.unwrap_or(0) });
        }
        if self.inline_max > MAX_INLINE {
            return Err(ConfigError::InlineTooLarge { inline_max: self.inline_max });
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::NoAttempts);
        }
        if self.max_requests == 0 {
            return Err(ConfigError::NoRequests);
        }
        let keepalive = self.keepalive.map_or([Duration::ZERO; 2], |k| [k.interval, k.timeout]);
        let times = [
            ("lease_time", self.lease_time),
            ("safety_margin", self.safety_margin),
            ("call_timeout", self.call_timeout),
            ("busy_poll", self.busy_poll),
            ("serve_busy_poll", self.serve_busy_poll),
            ("ack_timeout", self.ack_timeout),
            (
                "give_back_after",
                if self.give_back_after == Duration::MAX { Duration::ZERO } else { self.give_back_after },
            ),
            ("keepalive.interval", keepalive[0]),
            ("keepalive.timeout", keepalive[1]),
        ];
        if let Some(&(setting, value)) = times.iter().find(|(_, t)| *t > MAX_TIME_SETTING) {
            return Err(ConfigError::TimeTooLong { setting, value });
        }
        Ok(())
    }

    /// The lease against the policies a connection of `role` runs (its
    /// lease time the one agreed with its peer, if a handshake made it):
    /// reading under mw, a lease at most the safety margin would have
    /// every payload declined; under mw either way, a grant carries at
    /// most [`mwcap_mw::MAX_LEASE_TIME`]. (Under confirm the lease is how
    /// long an offer is held, and the margin is not used.)
    pub(crate) fn check_lease(&self, role: Role, policies: Policies) -> Result<(), ConfigError> {
        let (owns, reads) = policies.directions(role);
        let mw = owns == Policy::Mw || reads == Policy::Mw;
        if (reads == Policy::Mw && self.lease_time <= self.safety_margin)
            || (mw && self.lease_time > mwcap_mw::MAX_LEASE_TIME)
        {
            return Err(ConfigError::BadLeaseTime {
                lease_time: self.lease_time,
                safety_margin: self.safety_margin,
            });
        }
        Ok(())
    }
}
