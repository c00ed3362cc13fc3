//! The connection state machine: one peer, one queue pair, and no I/O.
//!
//! A [`Connection`] runs mwcap's protocols for one side of one RC
//! connection, in quinn's sans-IO shape. It never touches a NIC, a clock or
//! a thread. Its inputs are the user's operations ([`Connection::call`],
//! [`Connection::reply`], [`Connection::cancel`], buffer handles), the
//! completions of its work requests with the bytes of received frames
//! ([`Connection::handle_completion`]) and the time
//! ([`Connection::handle_timeout`]). Its outputs are [`Command`]s (work
//! requests to post, the QP to move to ERR) from
//! [`Connection::poll_command`], [`Event`]s for the user from
//! [`Connection::poll_event`], and the next deadline from
//! [`Connection::poll_timeout`].
//!
//! The I/O layer that carries the commands out on a
//! [`Nic`](crate::backend::Nic) is [`Link`](super::Link); a test can
//! instead carry them out by hand (see `tests/proto_pair.rs`, which runs two
//! connections against each other with no NIC at all).
//!
//! Inside, each direction has one owner side (our memory, exposed to the
//! peer) and one reader side (the peer's memory, read by us), each run by
//! the engine of that direction's policy: `mwcap-mw`'s lease owner or
//! reader, or the confirm engine (`mwcap-fallback`'s client or server,
//! which serves both directions of its role).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mwcap_fallback as fb;
use mwcap_mw as mw;

use super::bufpool::BufferPool;
use super::config::*;
use super::frame::{Attach, EngineTag, Frame, INITIAL_CREDITS, MAX_FRAME};
use super::header::Header;
use super::pool::{HoldChange, Holder, Layout, Slots};
use super::types::*;
use crate::backend::{Completion, CpuHold, MrId, MrInfo, MwId, NicError, SendWr, Sge, WcStatus};

mod buffers;
mod calls;
mod confirm;
mod engines;
pub(crate) mod ids;
mod recv;
mod send;
mod sides;

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
pub const SHARED_RECV_WR_ID: u64 = wr(TAG_RECV, 0);

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
}

/// A frame staged by the connection for a SEND: copy
/// [`Connection::staged`] into the control region at `offset` before
/// posting the chain that sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// Where the frame goes in the control region (its send slot).
    pub offset: usize,
    start: u32,
    len: u32,
}

impl Staged {
    /// The frame's length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }
    /// Whether the frame is empty (never: a frame has at least a version byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What the I/O layer must carry out for a connection, in the order given.
/// A command that fails goes back through [`Connection::post_failed`].
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
    SetQpError,
    /// Tell the NIC whether the user holds a data buffer's bytes (a
    /// testing aid, see [`Nic::set_cpu_held`](crate::backend::Nic::set_cpu_held);
    /// real NICs ignore it).
    CpuHold {
        /// The region the buffer is in (the data region, or a buffer of
        /// the hub's shared pool).
        mr: MrId,
        /// Offset in that region.
        offset: usize,
        /// Length.
        len: usize,
        /// Held or released.
        hold: CpuHold,
    },
}

/// The device resources a connection names in its work requests; the I/O
/// layer creates them (see [`Link`](super::Link)).
#[derive(Clone, Debug)]
pub struct Resources {
    /// The control region: `Config::sends()` send slots then (with a
    /// receive queue of the QP's own) `ctrl_slots` receive slots,
    /// [`MAX_FRAME`] bytes each.
    pub ctrl: MrId,
    /// Where the buffers are.
    pub data: DataMemory,
    /// Under the mw policy for the direction we own, one type-2 window per
    /// buffer of every class; otherwise empty.
    pub windows: Vec<MwId>,
    /// The windows' rkeys at allocation, in the same order.
    pub window_rkeys: Vec<u32>,
}

/// Where a connection's data buffers are.
#[derive(Clone, Debug)]
pub enum DataMemory {
    /// A data region of its own: the buffers of every size class, one class
    /// after the other (`Config::buffers` of `buffer_size`, then
    /// `Config::large_buffers` by size), and its memory (which the
    /// connection writes inline payloads into, and its buffer handles lend).
    Region(MrInfo, std::sync::Arc<crate::mem::Memory>),
    /// Buffers of a hub's shared pool, each a region of its own, taken while
    /// a slot is in use; the classes of the `Config` say how many of each
    /// size the connection may hold at once, and each size must be a class
    /// of the pool. Serves the mw policy only.
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
    surfaced: bool,
}

/// A user region: its registration and how many of its ranges are exposed.
#[derive(Debug)]
struct RegionState {
    info: MrInfo,
    live: u32,
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
    /// Lease → our message id.
    leases: IdMap<mw::LeaseId, u64>,
    /// Grants waiting for a free destination: (msg, grant, received at).
    pending: VecDeque<(u64, mw::Grant, Duration)>,
}

/// One side of one RC connection running mwcap's protocols, without I/O.
/// See the module docs (`docs/serving.md`).
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
    /// The user's regions (`None`: deregistered), by `RegionId`.
    regions: Vec<Option<RegionState>>,
    /// Exposures of ranges of user regions: slot `k` is known to the
    /// engines as buffer `layout.slots() + k` (a window or confirm buffer of
    /// its own), exposing `range_at[k]`.
    ranges: Slots,
    range_at: Vec<RegionRange>,
    /// Inline payloads that arrived while no buffer they fit was free:
    /// (message, start, length) in `inline_bytes`, oldest first.
    inline_wait: VecDeque<(u64, u32, u32)>,
    inline_bytes: Vec<u8>,
    /// Flow control: SENDs the peer has a receive posted for (granted in
    /// the credit field of its frames, `INITIAL_CREDITS` (8) at the start).
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
    /// initial credits and every grant sent), and frames received. On a
    /// shared receive queue a peer past its credit takes receives held for
    /// other connections, so there the connection goes down at once.
    granted_total: u64,
    frames_in: u64,
    /// Frames waiting for credit or a send slot, oldest first: (start,
    /// length) in `backlog_bytes`, encoded with no credit (the grant is
    /// written at [`CREDIT_AT`] when the frame goes).
    backlog: VecDeque<(u32, u32)>,
    backlog_bytes: Vec<u8>,
    bufs: Slots,
    /// Scratch for `flush_holds`.
    hold_changes: Vec<HoldChange>,
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
    /// Keepalive: when the peer was last heard from (any frame).
    last_heard: Option<Duration>,
    /// Keepalive: the unanswered ping (seq, sent at).
    ping: Option<(u64, Duration)>,
    next_ping: u64,
    calls: Timed<Call>,
    requests: IdMap<u64, Request>,
    events: VecDeque<Event>,
    down: Option<LossReason>,
    destroyed: bool,
}

impl Connection {
    /// A connection for `cfg` (its role and policies) over `res`.
    ///
    /// # Panics
    /// If `res` does not match `cfg`: a window per buffer when we own a
    /// direction under mw, none otherwise.
    pub fn new(cfg: Config, res: Resources) -> Connection {
        let is_client = cfg.role == Role::Client;
        let (owns, reads) = cfg.directions();
        let layout = Layout::new(&cfg);
        let slots = layout.slots() as usize;
        let exposable = slots + cfg.region_exposures as usize;
        assert_eq!(res.windows.len(), res.window_rkeys.len(), "one rkey per window");
        let pooled = matches!(res.data, DataMemory::Pool(_));
        let owner = (owns == Policy::Mw).then(|| {
            let engine = if pooled {
                assert!(res.windows.is_empty(), "on a shared pool the windows are the pool's");
                mw::Owner::lending(cfg.seed, exposable)
            } else {
                assert_eq!(
                    res.windows.len(),
                    exposable,
                    "one window per buffer and region exposure under mw"
                );
                let ws: Vec<mw::Window> = res
                    .windows
                    .iter()
                    .zip(&res.window_rkeys)
                    .map(|(w, &rkey)| mw::Window { handle: w.raw(), rkey })
                    .collect();
                mw::Owner::new(cfg.seed, ws)
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
                engine: mw::Reader::new(mw::ReaderConfig { safety_margin: cfg.safety_margin, release }),
                leases: id_map(slots),
                pending: VecDeque::with_capacity(slots),
            }
        });
        let mut bufs = Slots::with_classes(&layout.counts());
        let confirm = (owns == Policy::Confirm || reads == Policy::Confirm).then(|| {
            let DataMemory::Region(data, _) = &res.data else {
                panic!("a shared buffer pool serves the mw policy only, not confirm")
            };
            ConfirmEngine::new(&cfg, &layout, owns == Policy::Confirm, data)
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
            granted_total: u64::from(INITIAL_CREDITS),
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
            inline_wait: VecDeque::new(),
            inline_bytes: Vec::new(),
            returns: Default::default(),
            hold_changes: Vec::with_capacity(2 * slots),
            reclaimed: Vec::with_capacity(slots),
            now: Duration::ZERO,
            dirty: false,
            commands: VecDeque::with_capacity(2 * cfg.ctrl_slots as usize + 2 * slots),
            tx: Vec::new(),
            tx_used: 0,
            owner,
            reader,
            confirm,
            next_msg: 1,
            last_request: 0,
            stats: ConnStats::default(),
            last_heard: None,
            ping: None,
            next_ping: 1,
            calls: Timed::with_capacity(cfg.ctrl_slots as usize),
            requests: id_map(cfg.ctrl_slots as usize),
            events: VecDeque::new(),
            down: None,
            destroyed: false,
            res,
            cfg,
        }
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// This connection's id in the process (in logs and spans; buffers
    /// name it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether `buf` is one of this connection's buffers.
    pub fn owns(&self, buf: &Buf) -> bool {
        buf.endpoint == self.id
    }

    /// Confirm-policy messages the connection is tracking (diagnostics:
    /// stays bounded by the calls and requests in progress).
    pub fn tracked_messages(&self) -> usize {
        self.confirm.as_ref().map_or(0, ConfirmEngine::tracked)
    }

    /// The QP is connected: post every receive slot. The peer may send
    /// `INITIAL_CREDITS` (8) frames at once; the rest of the receives are
    /// granted in our first frame out. Nothing is sent here: the peer's
    /// QP may not be connected yet (the bootstrap's ready phase follows),
    /// so a client grants with its first request and a server as soon as
    /// the first request arrives.
    ///
    /// # Panics
    /// If `ctrl_slots` is below `INITIAL_CREDITS` (8) (the endpoint refuses
    /// such a `Config` before it gets here).
    pub fn start(&mut self) {
        assert!(self.cfg.ctrl_slots >= INITIAL_CREDITS, "ctrl_slots below INITIAL_CREDITS");
        for slot in 0..self.cfg.ctrl_slots {
            self.post_recv(slot);
        }
        self.credits = INITIAL_CREDITS;
        self.owed = self.cfg.ctrl_slots - INITIAL_CREDITS;
    }

    /// [`Connection::start`] for a QP that takes its receives from a
    /// shared receive queue its owner posts (a
    /// [`Hub`](crate::conn::Hub) with shared receives): nothing is posted
    /// here, the peer may send `INITIAL_CREDITS` (8) frames, and the
    /// connection's share of the queue is that many until the owner
    /// changes it. A received frame's receive is not re-granted by itself:
    /// the owner calls [`Connection::grant_receives`] (or
    /// [`Connection::withhold_receive`]) for each.
    ///
    /// Its completions arrive as for a receive of its own
    /// (`TAG_RECV`): the owner copies the frame out of its slot and passes
    /// the bytes to [`Connection::handle_completion`].
    pub fn start_shared(&mut self) {
        self.shared_receives = true;
        self.credits = INITIAL_CREDITS;
        self.share = INITIAL_CREDITS;
        self.owed = 0;
    }

    /// Shared receives: grant the peer `n` more receives (its share grows
    /// by `n - 1` when called for one received frame with `n` above 1).
    /// They go with the next frame out, or in a `Credit` frame once they
    /// are half the share.
    pub fn grant_receives(&mut self, n: u32, grows: u32) {
        self.owed += n;
        self.share += grows;
        self.dirty = true;
        self.maybe_grant();
    }

    /// Shared receives: the receive of a frame just received goes back to
    /// the owner instead of the peer (the share shrinks by one). Refused
    /// (false) at `INITIAL_CREDITS` (8): below it flow control could stall.
    pub fn withhold_receive(&mut self) -> bool {
        if self.share <= INITIAL_CREDITS {
            return false;
        }
        self.share -= 1;
        true
    }

    /// The receives this side keeps for its peer (see `share`).
    pub fn receive_share(&self) -> u32 {
        self.share
    }

    /// Whether the connection started on a shared receive queue
    /// ([`Connection::start_shared`]).
    pub fn takes_shared_receives(&self) -> bool {
        self.shared_receives
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

    /// Where buffer `slot` is: its region and its offset in it (the data
    /// region, or while the slot is taken the pool buffer behind it).
    fn place(&self, slot: u32) -> (MrInfo, u64) {
        match &self.res.data {
            DataMemory::Region(data, _) => (*data, self.layout.offset(slot)),
            DataMemory::Pool(_) => {
                let (pool, of) = self.bufs.backing(slot).expect("a taken slot of a pool has a buffer");
                (pool.info(of), 0)
            }
        }
    }

    /// The memory of buffer `slot` (taken: on a pool, backed) and its
    /// offset in it.
    fn memory_at(&self, slot: u32) -> (&std::sync::Arc<crate::mem::Memory>, usize) {
        match &self.res.data {
            DataMemory::Region(_, mem) => (mem, self.layout.offset(slot) as usize),
            DataMemory::Pool(_) => {
                let (pool, of) = self.bufs.backing(slot).expect("a taken slot of a pool has a buffer");
                (pool.memory(of), 0)
            }
        }
    }

    /// Write `bytes` at the start of buffer `slot`, which nobody holds (an
    /// inline payload received into a buffer just taken for it).
    pub(super) fn fill_slot(&self, slot: u32, bytes: &[u8]) {
        let (mem, offset) = self.memory_at(slot);
        if let Err(e) = mem.write(offset, bytes) {
            // A buffer just taken has no handle: this is mwcap's bug.
            debug_assert!(false, "writing an inline payload into buffer {slot}: {e}");
            tracing::error!(%e, slot, "writing an inline payload into a buffer failed (a bug in mwcap)");
        }
    }

    fn mw_buffer(&self, slot: u32, len: u32) -> mw::Buffer {
        let (mr, offset) = self.place(slot);
        mw::Buffer { mr: mr.id.raw(), offset, len, addr: mr.addr + offset }
    }

    fn slot_of_mw(&self, b: &mw::Buffer) -> Option<u32> {
        match &self.res.data {
            DataMemory::Region(data, _) if b.mr == data.id.raw() => self.layout.slot_at(b.offset),
            DataMemory::Region(..) => None,
            DataMemory::Pool(_) => self.bufs.slot_of_mr(b.mr).filter(|_| b.offset == 0),
        }
    }

    /// A handle for a slot the user now holds (its current lending).
    fn buf(&self, slot: u32, len: u32) -> Buf {
        debug_assert_eq!(self.bufs.holder(slot), Some(Holder::User));
        let (mem, offset) = self.memory_at(slot);
        let cap = self.layout.size(slot) as usize;
        // No two handles ever hold one buffer: a slot is lent to one at a
        // time, and a pool parks a buffer a stale handle still holds.
        let bytes = mem.lend(offset, cap).unwrap_or_else(|| {
            panic!(
                "buffer {slot} ({cap} bytes at {offset}) is already held by another handle: a bug in mwcap"
            )
        });
        Buf {
            endpoint: self.id,
            slot,
            len,
            lending: self.bufs.lending(slot),
            home: Some(self.returns.clone()),
            bytes: Some(bytes),
        }
    }

    /// Take back the buffers whose handles were dropped; returns how many.
    pub fn reclaim(&mut self) -> usize {
        self.returns.take_all(&mut self.reclaimed);
        let mut n = 0;
        for (slot, lending) in self.reclaimed.drain(..) {
            n += usize::from(self.bufs.give_back(slot, lending));
        }
        if n > 0 {
            // A payload may be waiting for a free buffer: the engines run.
            self.dirty = true;
            self.flush_holds();
        }
        n
    }

    /// Wake `w` when a buffer handle is dropped (the async driver); true if
    /// dropped handles already wait to be taken back ([`Connection::reclaim`]).
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn wake_on_return(&self, w: &std::task::Waker) -> bool {
        self.returns.set_waker(w);
        self.returns.any()
    }

    /// Whether a take found the shared buffer pool empty and a buffer has
    /// come back to it since: the engines run again (a READ waiting for a
    /// destination). Only the driver's turn asks, so that it also wakes the
    /// user's waiting `alloc`s; a user call that took the news instead
    /// would leave them asleep.
    pub(crate) fn pool_came_back(&mut self) -> bool {
        let back = self.bufs.unstarve();
        if back {
            self.dirty = true;
        }
        back
    }

    /// Make sure no buffer of the shared pool goes back to it from now on:
    /// the QP could not be destroyed, so no evidence says the peer's NIC
    /// cannot reach them. They stay out of the pool (lost to it).
    pub(crate) fn quarantine_pool_buffers(&mut self) {
        self.bufs.quarantine();
    }

    /// Wake `w` when the shared buffer pool gets a buffer back after a take
    /// found none (the hub's driver then asks
    /// [`Connection::pool_came_back`]). No-op without a shared pool.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn wake_on_pool(&mut self, w: &std::task::Waker) {
        self.bufs.wake_on_pool(w);
    }

    /// Deallocate (with `dealloc`) the shared pool's windows lent to this
    /// connection's exposures and not yet back: bound to its QP, or unbound
    /// by an invalidation whose news has not been taken yet. Call it once
    /// the QP is in ERR and before it is destroyed (rxe stalls destroying a
    /// QP with windows bound to it). They never go back to the pool; it
    /// allocates others. No-op without a shared pool.
    ///
    /// `dealloc` says whether the window was deallocated; one that was not
    /// stays out of the pool for good (still counted among its windows).
    pub(crate) fn release_lent_windows(&mut self, mut dealloc: impl FnMut(MwId) -> bool) {
        let Some(lent) = self.owner.as_mut().and_then(|o| o.lent.as_mut()) else { return };
        let mut n = 0;
        for (_, w) in lent.drain() {
            n += u32::from(dealloc(MwId::from_raw(w)));
        }
        self.bufs.windows_dropped(n);
    }

    /// Give the shared pool's buffers back, whoever holds their slots. Call
    /// it only once the QP is destroyed and the windows are freed (the
    /// endpoint's drop), and use no buffer of the connection afterwards.
    pub(crate) fn release_pool_buffers(&mut self) {
        self.bufs.release_backing();
    }

    /// Give the shared pool the buffers users gave back. The I/O layer
    /// calls it after carrying out the commands, so that a buffer's
    /// [`Command::CpuHold`] release comes before another connection can
    /// take it (a testing aid's order: the NIC never reaches such a buffer).
    pub(crate) fn give_returned_buffers(&mut self) {
        self.bufs.give_returned();
    }

    /// Queue [`Command::CpuHold`]s for the buffers the user took or gave
    /// back since the last time. Called before the NIC can act again: at the
    /// end of every input.
    pub(super) fn flush_holds(&mut self) {
        self.bufs.take_changes(&mut self.hold_changes);
        if self.hold_changes.is_empty() {
            return;
        }
        let remote_reads_allowed = self.cfg.directions().0 == Policy::Confirm;
        for i in 0..self.hold_changes.len() {
            let c = self.hold_changes[i];
            let len = self.layout.size(c.slot) as usize;
            let hold = if c.held { CpuHold::Held { remote_reads_allowed } } else { CpuHold::Released };
            // A pool buffer as it was at the change (a slot given back at
            // once no longer has one).
            let (mr, offset) = match (&self.res.data, c.backing) {
                (DataMemory::Pool(pool), Some(of)) => (pool.info(of).id, 0),
                (DataMemory::Pool(_), None) => continue,
                (DataMemory::Region(data, _), _) => (data.id, self.layout.offset(c.slot) as usize),
            };
            self.commands.push_back(Command::CpuHold { mr, offset, len, hold });
        }
    }

    // ---- outputs ----

    /// Run the engines if inputs arrived since they last ran.
    fn settle(&mut self) {
        if self.dirty {
            self.dirty = false;
            self.pump(self.now);
        }
    }

    /// The next command for the I/O layer. Carry each out before giving
    /// the connection any other input; a staged frame is valid until then.
    pub fn poll_command(&mut self) -> Option<Command> {
        self.settle();
        let c = self.commands.pop_front();
        if c.is_none() {
            self.tx_used = 0;
        }
        c
    }

    /// Whether [`Connection::poll_command`] may have a command: some are
    /// queued, or inputs wait for the engines (which may queue some).
    pub fn has_commands(&self) -> bool {
        self.dirty || !self.commands.is_empty()
    }

    /// The bytes of a frame staged for a [`Command::PostSend`].
    pub fn staged(&self, s: &Staged) -> &[u8] {
        &self.tx[s.start as usize..(s.start + s.len) as usize]
    }

    /// Whether events wait to be taken (or inputs wait for the engines,
    /// which may make some).
    pub fn has_events(&self) -> bool {
        self.dirty || !self.events.is_empty()
    }

    /// Queue an event for the user, counting it.
    fn emit(&mut self, e: Event) {
        let s = &mut self.stats;
        match &e {
            Event::Reply { .. } => s.replies_received += 1,
            Event::CallFailed { .. } => s.calls_failed += 1,
            Event::Request { .. } => s.requests += 1,
            Event::RequestDropped { .. } => s.requests_dropped += 1,
            Event::ReplyAgain { .. }
            | Event::BufferReturned(_)
            | Event::RangeReturned(_)
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
            ..self.stats
        }
    }

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.settle();
        self.events.pop_front()
    }

    /// When [`Connection::handle_timeout`] must next be called. Ask after
    /// taking the commands (the engines run then, and may set timers).
    pub fn poll_timeout(&self) -> Option<Duration> {
        // Asked several times a driver turn: plain comparisons, no iterator
        // chain.
        fn min(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
            match (a, b) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, None) => a,
                (None, b) => b,
            }
        }
        let mut t = self.owner.as_ref().and_then(|o| o.engine.poll_timeout());
        t = min(t, self.reader.as_ref().and_then(|r| r.engine.poll_timeout()));
        t = min(t, self.confirm.as_ref().and_then(ConfirmEngine::poll_timeout));
        // Every call gets the same timeout as it starts and message ids grow
        // with time, so the oldest call has the earliest deadline.
        t = min(t, self.calls.first_deadline());
        min(t, self.keepalive_at())
    }

    /// When keepalive must act next: ping after `interval` of silence, give
    /// up `timeout` after an unanswered ping.
    fn keepalive_at(&self) -> Option<Duration> {
        let k = self.cfg.keepalive?;
        if self.down.is_some() {
            return None;
        }
        Some(match self.ping {
            Some((_, sent)) => sent + k.timeout,
            None => self.last_heard.unwrap_or(self.now) + k.interval,
        })
    }

    fn handle_keepalive(&mut self, now: Duration) {
        let Some(k) = self.cfg.keepalive else { return };
        if self.down.is_some() {
            return;
        }
        let heard = *self.last_heard.get_or_insert(now);
        match self.ping {
            Some((_, sent)) if now >= sent + k.timeout => {
                let silent = now.saturating_sub(heard);
                self.go_down(now, LossReason::PeerUnresponsive { silent });
            }
            Some(_) => {}
            None if now >= heard + k.interval => {
                let seq = self.next_ping;
                // No free send slot means traffic is flowing: try later.
                if self.send_frame(&Frame::Ping { seq }, None).is_ok() {
                    self.next_ping += 1;
                    self.ping = Some((seq, now));
                }
            }
            None => {}
        }
    }

    /// Time has reached `now`: fire the engines' timers and call deadlines.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.now = now;
        // A call out of time whose reply came but whose payload found no
        // free buffer says so (the user's buffers, not the server, are
        // the matter); asked before the engines' timers end its fetch.
        loop {
            let starved = self.calls.expired(now).find_map(|m| self.waits_for_buffer(m).map(|len| (m, len)));
            let Some((msg, len)) = starved else { break };
            self.abandon_call(now, msg, CallError::NoBuffer(len));
        }
        if let Some(o) = &mut self.owner {
            if o.engine.poll_timeout().is_some_and(|t| t <= now) {
                o.engine.handle_timeout(now);
            }
        }
        if let Some(r) = &mut self.reader {
            if r.engine.poll_timeout().is_some_and(|t| t <= now) {
                r.engine.handle_timeout(now);
            }
        }
        if let Some(c) = &mut self.confirm {
            c.handle_timeout(now);
        }
        // Oldest first: deadlines grow with message ids (see poll_timeout).
        while let Some(msg) = self.calls.first_expired(now) {
            self.abandon_call(now, msg, CallError::TimedOut);
        }
        self.handle_keepalive(now);
        self.dirty = true;
    }

    // ---- completions ----

    /// If `c` is a successful receive, where its frame is in the control
    /// region: (offset, length). Hand those bytes to
    /// [`Connection::handle_completion`].
    pub fn received_frame(&self, c: &Completion) -> Option<(usize, usize)> {
        (tag_of(c.wr_id) == TAG_RECV && c.status.is_success() && !self.shared_receives)
            .then(|| (self.recv_offset((c.wr_id & LOW56) as u32), (c.byte_len as usize).min(MAX_FRAME)))
    }

    fn status(c: &Completion) -> mw::Status {
        match c.status {
            WcStatus::Success => mw::Status::Success,
            WcStatus::WrFlushErr => mw::Status::Flushed,
            WcStatus::RemAccessErr => mw::Status::RemoteAccess,
            other => mw::Status::Failed(match other {
                WcStatus::Other(n) => n,
                _ => 0xffff,
            }),
        }
    }

    /// A completion of one of this connection's work requests. For a
    /// successful receive, `frame` is the received bytes (see
    /// [`Connection::received_frame`]); otherwise it is ignored.
    pub fn handle_completion(&mut self, now: Duration, c: &Completion, frame: &[u8]) {
        self.now = now;
        self.dirty = true;
        self.stats.completions += 1;
        if !c.status.is_success() {
            self.stats.error_completions += 1;
            match c.status {
                WcStatus::RnrRetryExcErr => self.stats.rnr_retries_exceeded += 1,
                WcStatus::RetryExcErr => self.stats.transport_retries_exceeded += 1,
                _ => {}
            }
        }
        if !c.status.is_success() && self.down.is_none() {
            // Any error, a flush included: the QP is in ERR. A flushed receive
            // may be the first sign (the peer's bad READ took both QPs down
            // while we had nothing of our own outstanding).
            let reason = LossReason::Completion {
                status: c.status,
                opcode: c.opcode,
                vendor_err: c.vendor_err,
                wr_id: c.wr_id,
            };
            self.go_down(now, reason);
        }
        let low = c.wr_id & LOW56;
        match tag_of(c.wr_id) {
            TAG_SEND => self.plain_send_done(low as u32),
            TAG_RECV => {
                if c.status.is_success() {
                    self.frames_in += 1;
                    if self.shared_receives && self.frames_in > self.granted_total {
                        let (granted, received) = (self.granted_total, self.frames_in);
                        return self.misbehaved(now, Misbehavior::ExceedsCredit { granted, received });
                    }
                    self.on_recv(now, frame, c.invalidated_rkey);
                    if self.down.is_none() && !self.shared_receives {
                        self.post_recv(low as u32);
                        self.owed += 1; // granted with the next frame out
                    }
                }
            }
            TAG_FB_CLIENT | TAG_FB_SERVER => {
                let token = fb::ReadToken::from_raw(low);
                match &mut self.confirm {
                    Some(e) => e.handle_read_completion(now, token, c.status.is_success()),
                    None => tracing::warn!(wr_id = c.wr_id, "confirm READ completion with no confirm engine"),
                }
            }
            _ => {
                let token = mw::Token::from_wr_id(c.wr_id);
                let status = Self::status(c);
                match token.engine() {
                    Some(mw::Engine::Owner) => {
                        if let Some(o) = &mut self.owner {
                            if let Some(slot) = o.grant_sends.remove(&c.wr_id) {
                                self.sends.hand(slot, Holder::Exposed, Holder::Free);
                            }
                            o.engine.handle_completion(now, token, status);
                        }
                    }
                    Some(mw::Engine::Reader) => {
                        if let Some(r) = &mut self.reader {
                            r.engine.handle_completion(now, token, status);
                        }
                    }
                    None => tracing::warn!(wr_id = c.wr_id, "completion with an unknown work request id"),
                }
            }
        }
    }

    /// The I/O layer could not carry out `cmd`: the connection goes down
    /// (its resources are what failed), and a frame's send slot is freed.
    pub fn post_failed(&mut self, cmd: &Command, e: NicError) {
        if let Command::PostSend { chain, frame: Some(f) } = cmd {
            let slot = (f.offset / MAX_FRAME) as u32;
            // Not posted: no completion comes for it (nor for the plain
            // frames behind it, which go down with the connection).
            if let Some(i) = self.plain_sends.iter().position(|&s| s == slot) {
                self.plain_sends.remove(i);
            }
            self.sends.hand(slot, Holder::Exposed, Holder::Free);
            if let Some(o) = &mut self.owner {
                for w in chain.as_slice() {
                    o.grant_sends.remove(&w.wr_id());
                }
            }
        }
        self.dirty = true;
        self.go_down(self.now, LossReason::Nic(e));
    }

    /// The connection is down: QP to ERR (every work request flushes), the
    /// engines told, calls failed. Buffers come back as the flushes arrive.
    fn go_down(&mut self, now: Duration, reason: LossReason) {
        if self.down.is_some() {
            return;
        }
        tracing::info!(%reason, "connection down");
        self.down = Some(reason.clone());
        // Nothing more goes out: frames waiting for credit are dropped.
        self.backlog.clear();
        self.backlog_bytes.clear();
        self.commands.push_back(Command::SetQpError);
        if let Some(o) = &mut self.owner {
            o.engine.handle_qp_error(now);
        }
        if let Some(r) = &mut self.reader {
            r.engine.handle_qp_error(now);
        }
        if let Some(c) = &mut self.confirm {
            c.handle_connection_lost(now);
        }
        for (msg, _) in self.calls.drain() {
            self.emit(Event::CallFailed {
                call: CallId(msg),
                error: CallError::ConnectionLost(reason.clone()),
            });
        }
        let mut requests: Vec<_> = self.requests.drain().collect();
        requests.sort_unstable_by_key(|&(msg, _)| msg);
        for (msg, r) in requests {
            if !r.surfaced {
                self.emit(Event::RequestDropped {
                    req: RequestId(msg),
                    error: CallError::ConnectionLost(reason.clone()),
                });
            }
        }
        self.emit(Event::ConnectionLost(reason));
    }

    /// Start closing: the QP goes to ERR (no remote access through it is
    /// possible any more), every call fails, and the flushes start
    /// arriving. Once the QP is destroyed, tell
    /// [`Connection::handle_qp_destroyed`].
    pub fn begin_close(&mut self, now: Duration) {
        self.now = now;
        self.dirty = true;
        self.go_down(now, LossReason::Closed);
    }

    /// The peer went away (its bootstrap stream closed): as
    /// [`Connection::begin_close`], but the connection is down with
    /// [`LossReason::PeerGone`] (unless it was down already).
    pub fn peer_gone(&mut self, now: Duration) {
        self.now = now;
        self.dirty = true;
        self.go_down(now, LossReason::PeerGone);
    }

    /// Send-queue work requests whose completions are still to come. The
    /// plain frames posted unsignaled after the last signaled one are not
    /// counted: one that completed gives no completion, and one that did
    /// not is flushed with the QP (their slots are control memory only).
    pub fn sends_in_flight(&self) -> usize {
        let silent = (self.unsignaled_run as usize).min(self.plain_sends.len());
        self.sends.count(Holder::Exposed) - silent
    }

    /// Whether the QP was destroyed.
    pub fn is_destroyed(&self) -> bool {
        self.destroyed
    }

    /// The QP is destroyed: no DMA through it is possible any more, so every
    /// buffer comes back. Idempotent.
    pub fn handle_qp_destroyed(&mut self, now: Duration) {
        self.now = now;
        self.go_down(now, LossReason::Closed);
        if self.destroyed {
            return;
        }
        self.destroyed = true;
        if let Some(o) = &mut self.owner {
            o.engine.handle_qp_destroyed(now);
        }
        if let Some(r) = &mut self.reader {
            r.engine.handle_qp_destroyed(now);
        }
        self.pump(now);
        // The QP is gone: nothing can reach or fill any buffer any more.
        for k in 0..self.cfg.region_exposures {
            if self.ranges.holder(k) == Some(Holder::Exposed) {
                self.exposure_over(self.layout.slots() + k, 0);
            }
        }
        for slot in 0..self.layout.slots() {
            match self.bufs.holder(slot) {
                Some(Holder::Exposed) => self.exposure_over(slot, 0),
                Some(Holder::Reading) => {
                    self.bufs.hand(slot, Holder::Reading, Holder::Free);
                }
                _ => {}
            }
        }
        if let Some(o) = &mut self.owner {
            o.leases.clear();
        }
        if let Some(c) = &mut self.confirm {
            c.forget_reads();
        }
        self.flush_holds();
    }
}

/// Add an engine message to a request or reply. At most three ride in one
/// (a payload's grant or offer, a fetch, a release), below `MAX_ATTACH`.
fn push_attach(f: &mut Frame<'_>, a: Attach) {
    match f {
        Frame::Request { attach, .. } | Frame::Reply { attach, .. } => {
            let pushed = attach.push(a);
            debug_assert!(pushed.is_ok(), "more engine messages than a frame carries");
        }
        Frame::Engine(_) | Frame::Ping { .. } | Frame::Pong { .. } | Frame::Credit => {}
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
    /// (with `invalidated` as a SEND_WITH_INV's rkey).
    pub fn fuzz_deliver(&mut self, now: Duration, bytes: &[u8], invalidated: Option<u32>) {
        self.now = now;
        self.dirty = true;
        self.on_recv(now, &bytes[..bytes.len().min(MAX_FRAME)], invalidated);
    }
}
