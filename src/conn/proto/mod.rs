//! The connection state machine: one peer, one queue pair, and no I/O.
//!
//! A [`Connection`] runs mwcap's protocols for one side of one RC
//! connection, in quinn's sans-IO shape. It never touches a NIC, a clock or
//! a thread. Its inputs are the user's operations (`Connection::call` in
//! tests, [`Connection::call_inline`], [`Connection::reply`],
//! [`Connection::cancel`], buffer handles), the completions of its work
//! requests with the bytes of received frames
//! ([`Connection::handle_completion`]) and the time
//! ([`Connection::handle_timeout`]). Its outputs are [`Command`]s (work
//! requests to post, the QP to move to ERR) carried out in place through
//! [`Connection::drain_commands`], [`Event`]s for the user from
//! [`Connection::poll_event`], and the next deadline from
//! [`Connection::poll_timeout`].
//!
//! The I/O layer that carries the commands out on a
//! [`Nic`](crate::backend::Nic) is mwcap's internal `Link`; a test can
//! instead carry them out by hand (see `tests/proto_pair.rs`, which runs two
//! connections against each other with no NIC at all).
//!
//! Inside, each direction has an owner side and a reader side, run by the
//! engine of that direction's policy (`sides.rs`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::buf::Returns;
use super::bufpool::BufferPool;
use super::config::*;
use super::frame::{Attach, EngineTag, Frame, MAX_FRAME};
use super::header::Header;
use super::pool::{Holder, Layout, Slots};
use super::types::*;
use crate::backend::{Completion, MrId, MrInfo, MwId, MwInfo, NicError, SendWr, Sge, SgeList, WcStatus};

#[macro_use] // `each!`, for the modules below
mod confirm;

mod buffers;
mod calls;
mod close;
mod completion;
mod confirm_events;
mod engines;
mod flow;
pub(crate) mod ids;
mod recv;
mod send;
mod sides;
mod timers;

use confirm::ConfirmEngine;
use ids::{id_map, IdMap, Timed};

/// Tags in the top byte of the work request ids the connection itself
/// makes. (`mwcap-mw` tokens use 0xa1..=0xb1.)
const TAG_SEND: u8 = 0xc1;
const TAG_RECV: u8 = 0xc2;
const TAG_FB_CLIENT: u8 = 0xd1;
const TAG_FB_SERVER: u8 = 0xd2;
const LOW56: u64 = (1 << 56) - 1;

/// The `wr_id` under which a frame received through a shared receive
/// queue is handed to [`Connection::handle_completion`] (see
/// [`Connection::start_shared`]).
pub(crate) const SHARED_RECV_WR_ID: u64 = wr(TAG_RECV, 0);

const fn wr(tag: u8, low: u64) -> u64 {
    ((tag as u64) << 56) | (low & LOW56)
}

fn tag_of(wr_id: u64) -> u8 {
    (wr_id >> 56) as u8
}

static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

/// Up to two send-queue work requests posted together (a window bind
/// chained with the SEND of its grant, one doorbell). Plain data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chain {
    wrs: [SendWr; 2],
    len: u8,
}

impl Chain {
    fn one(w: SendWr) -> Chain {
        Chain { wrs: [w, w], len: 1 }
    }
    fn two(a: SendWr, b: SendWr) -> Chain {
        Chain { wrs: [a, b], len: 2 }
    }
    /// The work requests, in posting order.
    pub fn as_slice(&self) -> &[SendWr] {
        &self.wrs[..usize::from(self.len)]
    }

    /// Point the chain's SEND of a staged frame at the send slot `mr`,
    /// `offset` instead of the connection's own (an endpoint's send slots,
    /// lent by the I/O layer).
    pub(crate) fn relocate_send(&mut self, mr: MrId, offset: usize) {
        let last = usize::from(self.len) - 1;
        if let SendWr::Send { sge, .. } | SendWr::SendWithInv { sge, .. } = &mut self.wrs[last] {
            let len = sge.first().map_or(0, |s| s.len);
            *sge = SgeList::one(Sge { mr, offset, len });
        }
    }
}

/// A frame staged by the connection for a SEND: copy its bytes (handed to
/// the closure of [`Connection::drain_commands`]) into the control region
/// at `offset` before posting the chain that sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// Where the frame goes in the control region (its send slot).
    pub offset: usize,
    start: u32,
    len: u32,
}

/// What the I/O layer must carry out for a connection, in the order given
/// ([`Connection::drain_commands`], which hands a command that fails to
/// [`Connection::post_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Post a receive of the control-region bytes `sge`.
    PostRecv {
        /// The work request id.
        wr_id: u64,
        /// Where the frame is to be received.
        sge: Sge,
    },
    /// Post `chain` to the send queue in one call (one doorbell). When
    /// `frame` is set, first copy its staged bytes into the control region
    /// (the chain's SEND names them).
    PostSend {
        /// The work requests.
        chain: Chain,
        /// The frame the SEND carries.
        frame: Option<Staged>,
    },
    /// Move the QP to the error state: every outstanding work request
    /// flushes and no remote access through the QP is possible any more.
    /// (The owner's exposures wait for the QP's destroy all the same: a
    /// NIC may still be copying a READ response's packet after the move.)
    SetQpError,
}

/// The device resources a connection names in its work requests; the I/O
/// layer creates them.
#[derive(Clone, Debug)]
pub struct Resources {
    /// The control region: `Config::sends()` send slots then (with a
    /// receive queue of the QP's own) `ctrl_slots` receive slots,
    /// [`MAX_FRAME`] bytes each.
    pub ctrl: MrId,
    /// Where the buffers are.
    pub data: DataMemory,
    /// Under the mw policy for the direction we own, one type-2 window per
    /// buffer of every class, with its rkey at allocation; otherwise empty.
    pub windows: Vec<MwInfo>,
}

/// Where a connection's data buffers are.
#[derive(Clone, Debug)]
pub enum DataMemory {
    /// A data region of its own, laid out as `Layout` says, and its memory
    /// (which the connection writes inline payloads into, and its buffer handles lend).
    Region(MrInfo, std::sync::Arc<crate::mem::Memory>),
    /// Buffers of a hub's shared pool, each a region of its own, taken while
    /// a slot is in use; the classes of the `Config` say how many of each
    /// size the connection may hold at once, and each size must be a class
    /// of the pool. Serves confirm only where the peers are trusted (the
    /// pool's buffers then allow remote READs).
    Pool(BufferPool),
}

/// A client call in progress.
#[derive(Debug)]
struct Call {
    /// `mwcap.call`, inside the connection's span (disabled unless a
    /// subscriber wants debug spans).
    span: tracing::Span,
    deadline: Duration,
    /// The request payload's exposure, withdrawn if the call ends early.
    req: Option<sides::Exposure>,
    /// Confirm-policy fetch of the reply data.
    fetch_fb: Option<fb::MsgId>,
    reply: Option<(u8, Header)>,
    data: Data,
    /// The reply carried its payload inline (a confirm fetch the server
    /// refused is then no failure).
    inline: bool,
}

/// Where a payload stands.
#[derive(Debug, PartialEq, Eq)]
enum Data {
    /// Not known yet (no reply frame).
    Unknown,
    /// None was sent.
    Absent,
    /// Being read.
    Reading,
    /// Read and verified into a pool slot.
    Ready(u32, u32),
    /// Could not be read.
    Failed(PayloadError),
}

/// A server request in progress.
#[derive(Debug)]
struct Request {
    /// `mwcap.request`, with the caller's trace id when it sent one.
    span: tracing::Span,
    trace: Option<TraceId>,
    header: Header,
    data: Data,
    /// The release of the request payload, to piggyback on the reply.
    release: Option<mw::Release>,
    fetch_fb: Option<fb::MsgId>,
    /// The fetch attempt this request answers (1, or a retry's): a retry
    /// of it must be a later one.
    attempt: u32,
    surfaced: bool,
    /// A delegate's redemption: it surfaces as [`Event::Ask`], for the
    /// I/O layer to answer (its header is the token).
    redeem: bool,
    /// A redemption's header (the ask's body) until it surfaces, in a
    /// vector from the spares; empty otherwise.
    ask: Vec<u8>,
}

impl Request {
    /// A request just received (attempt 1): no payload yet, not surfaced.
    #[inline(always)]
    fn new(span: tracing::Span, trace: Option<TraceId>, header: Header, redeem: bool) -> Request {
        let (data, release, fetch_fb, ask) = (Data::Absent, None, None, Vec::new());
        Request { span, trace, header, data, release, fetch_fb, attempt: 1, surfaced: false, redeem, ask }
    }
}

/// Events the queue holds before it grows.
const EVENTS_ROOM: usize = 32;

/// A user region: its id, its registration in this connection's
/// protection domain, how many of its ranges are exposed, and whether the
/// registration is the connection's to release (an endpoint's region
/// registered once in the hub's PD is not).
#[derive(Debug)]
struct RegionState {
    id: RegionId,
    info: MrInfo,
    live: u32,
    owned: bool,
}

/// The owner side of our direction under mw: the lease engine, and which
/// buffer each lease exposes.
struct MwOwner {
    engine: mw::Owner,
    /// Lease → data slot.
    leases: IdMap<mw::LeaseId, u32>,
    /// Work request ids of in-flight grant SENDs → send slot.
    grant_sends: IdMap<u64, u32>,
    /// On a hub's shared pool (the engine lends its windows): lease → the
    /// pool's window lent to it, until the window goes back unbound or is
    /// deallocated with the QP ([`Connection::release_lent_windows`]).
    lent: Option<IdMap<mw::LeaseId, u32>>,
}

/// The reader side of the peer's direction under mw.
struct MwReader {
    engine: mw::Reader,
    /// Lease → our message id (0, which names no message, for a grant
    /// declined unread), from its grant until the engine's event for it.
    leases: IdMap<mw::LeaseId, u64>,
    /// Grants waiting for a free destination: (msg, grant, received at).
    pending: VecDeque<(u64, mw::Grant, Duration)>,
}

/// One side of one RC connection running mwcap's protocols, without I/O.
/// See the module docs, and `docs/architecture.md` (its `proto::Connection`
/// entry) for its place between the engines and the `Link`.
pub struct Connection {
    id: u64,
    cfg: Config,
    res: Resources,
    /// The last time an input gave (for work done lazily and for failures
    /// reported without one).
    now: Duration,
    /// Inputs arrived since the engines last ran (they run before any output
    /// is taken).
    dirty: bool,
    /// A `SetQpError` is queued and has not failed: once the commands
    /// ahead of it and it are carried out, the QP is in ERR
    /// ([`Connection::handle_qp_in_error`]).
    to_err: bool,
    commands: VecDeque<Command>,
    /// Frames staged for SENDs whose commands are not taken yet; reused
    /// from the start once every command is taken (never shrinks).
    tx: Vec<u8>,
    tx_used: usize,
    sends: Slots,
    /// Send slots of plain frames (no chained bind) in flight, in posting
    /// order. Only every
    /// [`Connection::signal_every`]-th is signaled: the completion of one
    /// frees it and every slot before it (a send queue completes in order;
    /// a failed or flushed request completes signaled or not).
    plain_sends: VecDeque<u32>,
    /// Plain frames posted unsignaled since the last signaled one.
    unsignaled_run: u32,
    /// Where each data buffer is (its size class, offset and size).
    layout: Layout,
    /// The user regions it knows (a few: looked up by a scan).
    regions: Vec<RegionState>,
    /// Exposures of ranges of user regions: slot `k` is known to the
    /// engines as buffer `layout.slots() + k` (a window or confirm buffer of
    /// its own), exposing `range_at[k]`.
    ranges: Slots,
    range_at: Vec<RegionRange>,
    /// Times slot `k` was taken: with `k`, the exposure's number
    /// (`Connection::exposure_number`).
    range_takes: Vec<u32>,
    /// Inline payloads that arrived while no buffer they fit was free:
    /// (message, start, length) in `inline_bytes`, oldest first.
    inline_wait: VecDeque<(u64, u32, u32)>,
    inline_bytes: Vec<u8>,
    /// The bytes of the payloads in `inline_wait` (a server keeps at most
    /// `Config::max_waiting_inline`).
    inline_waiting: u32,
    /// Flow control: SENDs the peer has a receive posted for (granted in
    /// the credit field of its frames, the peer's `Config::start_credits` at
    /// the start).
    /// Every frame but a `Credit` leaves one in reserve, so that a grant
    /// can always be sent (see `docs/protocol.md`, "Flow control").
    credits: u32,
    /// Flow control: receives posted and not yet granted to the peer.
    owed: u32,
    /// Flow control: the receives this side keeps for its peer (granted,
    /// in flight, or owed). `ctrl_slots` with a receive queue of the QP's
    /// own; on a shared receive queue ([`Connection::start_shared`]) the
    /// share its owner gives the connection ([`Connection::grant_receives`],
    /// [`Connection::withhold_receive`]).
    share: u32,
    /// Receives come from a shared receive queue: nothing is posted here.
    shared_receives: bool,
    /// Flow control: frames the peer was granted credit for in all (the
    /// initial credits and every grant sent), and frames received (past the
    /// credit: [`Misbehavior::ExceedsCredit`]).
    granted_total: u64,
    frames_in: u64,
    /// Shared receives: when the peer's last frame other than flow control
    /// and keepalive came (an idle peer is asked to give back the credit
    /// past its start credits, see `Config::give_back_after`).
    last_frame_at: Duration,
    /// Shared receives: a `GiveBack` is unanswered, asked at this time.
    giving_back: Option<Duration>,
    /// Shared receives: the credits the peer gave back in a `Returned`
    /// frame that the owner of the queue has not taken yet
    /// ([`Connection::take_returned`]).
    returned: u32,
    /// Frames waiting for credit or a send slot, oldest first: (start,
    /// length) in `backlog_bytes`, encoded with no credit (the grant is
    /// written at [`CREDIT_AT`](super::frame::CREDIT_AT) when the frame goes).
    backlog: VecDeque<(u32, u32)>,
    backlog_bytes: Vec<u8>,
    bufs: Slots,
    /// Handles dropped by the user, to take back.
    returns: std::sync::Arc<Returns>,
    reclaimed: Vec<(u32, u32)>,
    owner: Option<MwOwner>,
    reader: Option<MwReader>,
    confirm: Option<ConfirmEngine>,
    next_msg: u64,
    last_request: u64,
    /// Counters for `stats` (the buffer counts are read when asked).
    stats: ConnStats,
    /// When each buffer (pool slots, then range slots) was last exposed,
    /// for the age histogram.
    exposed_at: Vec<Duration>,
    /// Ages of the exposures that ended (telemetry).
    ages: crate::telemetry::Ages,
    /// Keepalive: when the peer last answered a ping (or, until it has,
    /// when keepalive first ran): the next ping goes `interval` after.
    last_answer: Option<Duration>,
    /// Keepalive: the unanswered ping (seq, sent at).
    ping: Option<(u64, Duration)>,
    /// Ask bodies handed back once answered ([`Connection::recycle_ask`]),
    /// for the next asks: an ask allocates nothing once a few were.
    spare_asks: Vec<Vec<u8>>,
    /// The capacity of `spare_asks`, in all.
    spare_ask_bytes: usize,
    next_ping: u64,
    calls: Timed<Call>,
    requests: IdMap<u64, Request>,
    role: Role,
    policies: Policies,
    events: VecDeque<Event>,
    down: Option<LossReason>,
    destroyed: bool,
}

impl Connection {
    /// A connection of `role` with `policies` for its two directions (both
    /// sides must agree), with the settings `cfg`, over `res`.
    ///
    /// # Panics
    /// If `res` does not match: a window per buffer when we own a direction
    /// under mw, none otherwise.
    pub fn new(role: Role, policies: Policies, cfg: Config, res: Resources) -> Connection {
        let is_client = role == Role::Client;
        let (owns, reads) = policies.directions(role);
        let layout = Layout::new(&cfg);
        let slots = layout.slots() as usize;
        let exposable = slots + cfg.region_exposures as usize;
        let pooled = matches!(res.data, DataMemory::Pool(_));
        let owner = (owns == Policy::Mw).then(|| {
            // (A connection is made once; its keys' seed is the one input
            // here not given by the caller, unless the config gives it.)
            let seed = cfg.seed.unwrap_or_else(|| rand::RngCore::next_u64(&mut rand::rngs::OsRng));
            let engine = if pooled {
                assert!(res.windows.is_empty(), "on a shared pool the windows are the pool's");
                mw::Owner::lending(seed, exposable)
            } else {
                assert_eq!(
                    res.windows.len(),
                    exposable,
                    "one window per buffer and region exposure under mw"
                );
                let ws: Vec<mw::Window> =
                    res.windows.iter().map(|w| mw::Window { handle: w.id.raw(), rkey: w.rkey }).collect();
                mw::Owner::new(seed, ws)
            };
            MwOwner {
                engine,
                leases: id_map(exposable),
                grant_sends: id_map(exposable),
                lent: pooled.then(|| id_map(exposable)),
            }
        });
        let reader = (reads == Policy::Mw).then(|| {
            let release = if is_client { mw::ReleaseMode::Message } else { mw::ReleaseMode::Piggyback };
            MwReader {
                // A READ for each buffer it can land in, sized now.
                engine: mw::Reader::with_reads(
                    mw::ReaderConfig { safety_margin: cfg.safety_margin, release, max_lease: cfg.lease_time },
                    slots,
                ),
                leases: id_map(slots),
                pending: VecDeque::with_capacity(slots),
            }
        });
        let mut bufs = Slots::with_classes(&layout.counts());
        if let DataMemory::Region(_, mem) = &res.data {
            // A hold per buffer, at most, at once: lending one allocates nothing.
            mem.reserve_holds(slots);
        }
        if let (Policy::Confirm, DataMemory::Region(_, mem)) = (owns, &res.data) {
            // The region's key reaches all of it: a peer may READ a buffer
            // the user holds (reused), and discards what it read.
            mem.expect_reads_of_held();
        }
        let confirm = (owns == Policy::Confirm || reads == Policy::Confirm).then(|| {
            let data = match &res.data {
                DataMemory::Region(data, _) => Some(data),
                // A slot's engine buffer follows the pool buffer behind it.
                DataMemory::Pool(_) => None,
            };
            ConfirmEngine::new(role, &cfg, &layout, owns == Policy::Confirm, data)
        });
        if let DataMemory::Pool(pool) = &res.data {
            let classes: Vec<(u32, u32)> = layout.sizes().into_iter().zip(layout.counts()).collect();
            if let Err(size) = bufs.back_with(pool.clone(), &classes) {
                panic!("the shared buffer pool has no class of {size} bytes (it has {:?})", pool.sizes());
            }
        }
        Connection {
            id: NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed),
            sends: Slots::new(cfg.sends()),
            plain_sends: VecDeque::with_capacity(cfg.sends() as usize),
            unsignaled_run: 0,
            credits: 0,
            owed: 0,
            share: cfg.ctrl_slots,
            shared_receives: false,
            last_frame_at: Duration::ZERO,
            giving_back: None,
            returned: 0,
            granted_total: u64::from(cfg.start_credits),
            frames_in: 0,
            backlog: VecDeque::new(),
            backlog_bytes: Vec::new(),
            bufs,
            layout,
            regions: Vec::new(),
            ranges: Slots::new(cfg.region_exposures),
            range_at: vec![
                RegionRange { region: RegionId(u32::MAX), offset: 0, len: 0 };
                cfg.region_exposures as usize
            ],
            range_takes: vec![0; cfg.region_exposures as usize],
            inline_wait: VecDeque::new(),
            inline_bytes: Vec::new(),
            inline_waiting: 0,
            returns: Default::default(),
            reclaimed: Vec::with_capacity(slots),
            now: Duration::ZERO,
            dirty: false,
            to_err: false,
            commands: VecDeque::with_capacity(2 * cfg.ctrl_slots as usize + 2 * slots),
            tx: Vec::new(),
            tx_used: 0,
            owner,
            reader,
            confirm,
            next_msg: 1,
            last_request: 0,
            stats: ConnStats::default(),
            exposed_at: vec![Duration::ZERO; slots + cfg.region_exposures as usize],
            ages: Default::default(),
            last_answer: None,
            ping: None,
            spare_asks: Vec::new(),
            spare_ask_bytes: 0,
            next_ping: 1,
            calls: Timed::with_capacity(cfg.ctrl_slots as usize),
            requests: id_map(cfg.ctrl_slots as usize),
            // A burst's worth up front (16 calls in flight, each with its
            // reply and its buffer back): growing the queue the first time
            // a burst is larger would allocate on the data path.
            events: VecDeque::with_capacity(EVENTS_ROOM),
            down: None,
            destroyed: false,
            res,
            role,
            policies,
            cfg,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Client or server.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The policy of each direction.
    pub fn policies(&self) -> Policies {
        self.policies
    }

    /// The time of the last input it was given.
    pub(crate) fn now(&self) -> Duration {
        self.now
    }

    /// This connection's id in the process (in logs and spans; buffers
    /// name it).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Whether `buf` is one of this connection's buffers.
    #[cfg(any(test, feature = "testing"))]
    pub fn owns(&self, buf: &super::buf::Buf) -> bool {
        buf.endpoint == self.id
    }

    /// Confirm-policy messages the connection is tracking (diagnostics:
    /// stays bounded by the calls and requests in progress).
    #[cfg(any(test, feature = "testing"))]
    pub fn tracked_messages(&self) -> usize {
        self.confirm.as_ref().map_or(0, |c| c.msgs.len())
    }

    /// Confirm-policy messages from the peer that fit no exchange and were
    /// ignored (diagnostics: an honest peer causes none).
    #[cfg(any(test, feature = "testing"))]
    pub fn confirm_violations(&self) -> u64 {
        self.confirm.as_ref().map_or(0, |c| each!(&c.engine, e => e.peer_violations()))
    }

    /// The QP is connected: post every receive slot. The peer may send
    /// `Config::start_credits` frames at once; the rest of the receives are
    /// granted in our first frame out. This side may send `peer_credits`
    /// (the peer's `start_credits`, from its hello) before the peer's first
    /// grant. Nothing is sent here: the peer's QP may not be connected yet
    /// (the bootstrap's ready phase follows), so a client grants with its
    /// first request and a server as soon as the first request arrives.
    ///
    /// # Panics
    /// If `ctrl_slots` is below `start_credits` (the endpoint refuses such
    /// a `Config` before it gets here).
    pub fn start(&mut self, peer_credits: u32) {
        assert!(self.cfg.ctrl_slots >= self.cfg.start_credits, "ctrl_slots below start_credits");
        for slot in 0..self.cfg.ctrl_slots {
            self.post_recv(slot);
        }
        self.credits = peer_credits;
        self.owed = self.cfg.ctrl_slots - self.cfg.start_credits;
    }

    /// Whether a send slot is taken: a frame's SEND posted and not known to
    /// have completed (or been flushed). When none is, the NIC reads none
    /// of the connection's send slots. The plain frames posted unsignaled
    /// after the last signaled one (at most `send_slots / 2 - 1`, none with
    /// fewer than four slots) keep theirs until a later completion.
    pub(crate) fn holds_send_slots(&self) -> bool {
        self.sends.count(Holder::Free) < self.cfg.sends() as usize
    }

    /// Why the connection is down, if it is.
    pub fn is_down(&self) -> Option<&LossReason> {
        self.down.as_ref()
    }

    fn recv_offset(&self, slot: u32) -> usize {
        (self.cfg.sends() as usize + slot as usize) * MAX_FRAME
    }

    fn post_recv(&mut self, slot: u32) {
        let sge = Sge { mr: self.res.ctrl, offset: self.recv_offset(slot), len: MAX_FRAME as u32 };
        self.commands.push_back(Command::PostRecv { wr_id: wr(TAG_RECV, u64::from(slot)), sge });
    }

    fn post(&mut self, w: SendWr) {
        self.commands.push_back(Command::PostSend { chain: Chain::one(w), frame: None });
    }

    // ---- outputs ----

    /// Time has reached `now` (an entry point's): the connection's time,
    /// which never goes back. A caller may read the clock before a turn
    /// that read it earlier takes the connection (the driver reads it once
    /// for a loop of turns), and the engines must not see time go back.
    #[inline]
    pub(crate) fn advance(&mut self, now: Duration) -> Duration {
        self.now = self.now.max(now);
        self.now
    }

    /// Run the engines if inputs arrived since they last ran.
    ///
    /// Calls and replies settle before they build their frame: what the
    /// engines queued from inputs not settled yet (a batch of frames, each
    /// of which may queue an answer) goes out first, so that the frame's own
    /// messages (its payload's grant or offer, a fetch, a release) find room
    /// among the `MAX_ATTACH` it carries. The I/O layer settles after every
    /// input, so there they find nothing to do.
    #[inline]
    pub(crate) fn settle(&mut self) {
        if self.dirty {
            self.dirty = false;
            self.pump(self.now);
        }
    }

    /// Whether [`Connection::drain_commands`] may have a command: some are
    /// queued, or inputs wait for the engines (which may queue some).
    pub(crate) fn has_commands(&self) -> bool {
        self.dirty || !self.commands.is_empty()
    }

    /// Whether events wait to be taken (or inputs wait for the engines,
    /// which may make some).
    #[cfg_attr(loom, allow(dead_code))] // the async driver's, absent under loom
    pub(crate) fn has_events(&self) -> bool {
        self.dirty || !self.events.is_empty()
    }

    /// Queue an event for the user, counting it.
    #[inline]
    fn emit(&mut self, e: Event) {
        let s = &mut self.stats;
        match &e {
            Event::Reply { .. } => s.replies_received += 1,
            Event::CallFailed { .. } => s.calls_failed += 1,
            Event::Request { .. } => s.requests += 1,
            Event::RequestDropped { .. } => s.requests_dropped += 1,
            Event::ReplyAgain { .. }
            | Event::Ask { .. }
            | Event::BufferReturned(_)
            | Event::RangeReturned { .. }
            | Event::ConnectionLost(_) => {}
        }
        self.events.push_back(e);
    }

    /// What the connection has done so far, and where its buffers are.
    pub fn stats(&self) -> ConnStats {
        let count = |h| self.bufs.count(h) as u32;
        // Handles the user dropped are the pool's, though not taken back yet.
        let dropped = self.returns.count(|slot, lending| self.bufs.lent(slot, lending)) as u32;
        ConnStats {
            lease_owner: self.owner.as_ref().map(|o| o.engine.stats()),
            lease_reader: self.reader.as_ref().map(|r| r.engine.stats()),
            buffers_free: count(Holder::Free) + dropped,
            buffers_user: count(Holder::User) - dropped,
            buffers_exposed: count(Holder::Exposed),
            buffers_reading: count(Holder::Reading),
            credits: self.credits,
            credits_owed: self.owed,
            receive_share: self.share,
            expiries: self.expiries(),
            ..self.stats
        }
    }

    /// The counters telemetry records (without the buffer counts of
    /// [`Connection::stats`], which scan the slots).
    #[cfg_attr(loom, allow(dead_code))] // the async driver's, absent under loom
    pub(crate) fn counts(&self) -> crate::telemetry::ConnCounts {
        let owner = self.owner.as_ref().map(|o| o.engine.stats());
        crate::telemetry::ConnCounts {
            own: crate::telemetry::own_policy(self.policies(), self.role),
            exposures: self.stats.exposures,
            ended: self.stats.exposures_ended,
            expiries: self.expiries(),
            ages: self.ages,
            stale_reads: self.stats.stale_reads,
            late_accesses: self.stats.late_accesses,
            binds: owner.map_or(0, |o| o.grants),
            invalidations: owner.map_or(0, |o| o.invalidations),
        }
    }

    /// Exposures ended by their own timer: confirm's, counted here, and
    /// the mw lease engine's.
    fn expiries(&self) -> u64 {
        self.stats.expiries + self.owner.as_ref().map_or(0, |o| o.engine.stats().expired)
    }

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.settle();
        self.events.pop_front()
    }

    /// The next event, left queued (call [`Connection::settle`] first).
    #[inline]
    pub(crate) fn peek_event(&self) -> Option<&Event> {
        self.events.front()
    }
}

/// Add an engine message to a request or reply. At most three ride in one
/// (a payload's grant or offer, a fetch, a release), below `MAX_ATTACH`.
fn push_attach(f: &mut Frame<'_>, a: Attach) {
    match f {
        Frame::Request { attach, .. } | Frame::Reply { attach, .. } | Frame::Ask { attach, .. } => {
            let pushed = attach.push(a);
            debug_assert!(pushed.is_ok(), "more engine messages than a frame carries");
        }
        _ => {}
    }
}

/// An mw engine message as an attachment, encoded in place.
pub(super) fn mw_attach(m: &mw::Message) -> Attach {
    Attach::encoded(EngineTag::Mw, |b| m.encode_into(b).unwrap_or(usize::MAX))
        .expect("mw messages are shorter than MAX_ATTACH_LEN")
}

/// A confirm engine message as an attachment, encoded in place.
pub(super) fn fb_attach(m: &fb::Message) -> Attach {
    Attach::encoded(EngineTag::Confirm, |b| m.encode_into(b).unwrap_or(usize::MAX))
        .expect("confirm messages are shorter than MAX_ATTACH_LEN")
}

#[cfg(fuzzing)]
impl Connection {
    /// Fuzzing hook: handle `bytes` as if a SEND carrying them had arrived
    /// (with `invalidated` as a SEND_WITH_INV's rkey), counted against the
    /// credit granted as a received frame is: past it, the connection goes
    /// down (`ExceedsCredit`). No receive is consumed, so none is posted
    /// again nor granted back to the peer.
    pub fn fuzz_deliver(&mut self, now: Duration, bytes: &[u8], invalidated: Option<u32>) {
        let now = self.advance(now);
        self.dirty = true;
        self.frame_in(now, &bytes[..bytes.len().min(MAX_FRAME)], invalidated);
    }
}
