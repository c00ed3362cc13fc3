//! A hub's shared receive queue for control frames ([`SharedReceives`]),
//! and the send slots the hub lends its connections ([`LentSends`]).
//!
//! Each connection on the queue has a *share* of it: the receives its peer
//! may have in use (granted credit, frames in flight, frames waiting to be
//! granted back). A share starts at the connection's
//! `Config::start_credits`, grows while more than [`ROOM`] receives are
//! free and shrinks back while fewer are ([`SharedReceives::regrant`]).
//! The shares never add up to more than the receives the queue holds
//! (posted, or taken by a frame being decoded in its slot, after which it
//! is posted again), so a peer that keeps to its credit always finds one.
//! The queue grows by chunks, and a chunk the shares no longer need is
//! retired: its receives are not posted again, and it is deregistered once
//! none is left ([`SharedReceives::retire`]; they are not counted among
//! those the queue holds meanwhile). How the queue grows, the lent send
//! slots, and why it serves mw only unless the peers are trusted:
//! `docs/serving.md`, "Shared receives".

use super::{ConfigError, SetupError};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::frame::{INITIAL_CREDITS, MAX_FRAME};
use crate::backend::{Access, MrInfo, Nic, NicError, Sge, SrqId};
use crate::mem::Registered;

/// Free receives the queue keeps for the next connection: a share grows
/// while more are free, and shrinks towards its floor while fewer are.
const ROOM: u32 = INITIAL_CREDITS;

/// Send slots registered at a time (one region of 1 MiB).
const SEND_CHUNK: usize = 256;

/// `check_limit` looks for the limit event once in this many calls.
const LIMIT_CHECK_EVERY: u64 = 16;

/// The top byte of a shared receive's `wr_id` (the connection's own tags
/// and the engines' are different).
pub(crate) const TAG_SRQ: u8 = 0xc3;

/// How an endpoint with shared receives sizes its queue
/// ([`EndpointBuilder::shared_receives`](super::EndpointBuilder::shared_receives)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrqConfig {
    /// Receives (of [`MAX_FRAME`] bytes) registered at a time: one region
    /// each. The queue starts with one chunk.
    pub chunk: u32,
    /// The most receives the queue holds (it is created this deep; devices
    /// cap it: `max_srq_wr`, 32,767 on mlx5). Each connection needs its
    /// `Config::start_credits` (8 by default), and up to its `ctrl_slots`
    /// when busy.
    /// The hub reserves this many entries of its completion queue for the
    /// receives' completions.
    pub max_slots: u32,
}

impl Default for SrqConfig {
    /// 1,024 receives a chunk (4 MiB), at most 8,192 (32 MiB): 1,024 idle
    /// connections. The hub's completion queue must be deeper than
    /// `max_slots` (it reserves that many entries for the receives).
    fn default() -> SrqConfig {
        SrqConfig { chunk: 1024, max_slots: 8192 }
    }
}

/// What a shared receive queue has done so far (in [`EndpointStats`](super::EndpointStats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SrqStats {
    /// Receives the queue holds for its connections (registered and
    /// posted, or being handed over), a retiring chunk's not counted.
    pub slots: u32,
    /// The connections' shares, summed.
    pub shares: u32,
    /// Registered bytes of the receives.
    pub registered_bytes: u64,
    /// Chunks of receives retired after the shares shrank (none of their
    /// receives is posted again once a frame took it).
    pub chunks_retired: u64,
    /// Of those, deregistered (none of their receives was left).
    pub chunks_freed: u64,
    /// Frames received through it.
    pub frames: u64,
    /// Shares grown by one.
    pub grown: u64,
    /// Receives not granted again (a share shrunk by one).
    pub withheld: u64,
    /// Receives an idle connection's peer gave back (its share shrunk by
    /// as many: `docs/serving.md`, "Shared receives").
    pub given_back: u64,
    /// Limit events taken (most receives were in use at once).
    pub limit_events: u64,
    /// Connections refused for want of room.
    pub refused: u64,
    /// Receives of frames whose connection was gone (never added, or its
    /// QP destroyed) posted again by the hub.
    pub unclaimed: u64,
    /// Send slots (4 KiB each) the hub has registered to lend its
    /// connections.
    pub send_slots: u32,
    /// Of those, lent to connections now (a SEND in flight, or kept by a
    /// connection whose QP could not be destroyed).
    pub send_slots_lent: u32,
}

/// What to do with the receive of a frame just received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Regrant {
    /// Grant it to the peer again.
    Same,
    /// Grant it and one more (the share grows).
    Grow,
    /// Keep it (the share shrinks).
    Withhold,
}

struct State {
    /// The chunks of receive slots; slab `i`'s receives are numbered from
    /// `i` x `chunk`. `None`: freed (a later chunk may take its place).
    slabs: Vec<Option<Slab>>,
    /// The receives of the chunks not retiring: posted, or taken by a frame
    /// being decoded (after which they are posted again).
    slots: u32,
    shares: u32,
}

/// A chunk of receive slots.
struct Slab {
    /// Its region, with its memory: a frame is decoded in its slot through
    /// it, without the NIC (`take_frame`).
    mem: Registered,
    /// Its receives posted, or taken by a frame being decoded.
    held: u32,
    /// No receive of it is posted again: once none is held, it is
    /// deregistered (`SharedReceives::retire`).
    retiring: bool,
}

impl State {
    /// Receives posted or being decoded, retiring chunks' included: what
    /// the queue itself holds.
    fn held(&self) -> u32 {
        self.slabs.iter().flatten().map(|s| s.held).sum()
    }
}

/// The send slots the hub lends: regions of `SEND_CHUNK` slots, and those
/// not lent (room for every slot made, so giving back never allocates).
struct Sends {
    slabs: Vec<MrInfo>,
    free: Vec<SendSlot>,
}

/// One of the hub's send slots: its region (with the memory a frame is
/// written into the slot through, without the NIC) and its offset there.
pub(crate) type SendSlot = (Registered, usize);

/// A connection's hold on the hub's send slots: the hub's slot (region,
/// offset) standing for each of the connection's own, from the first frame
/// staged there until none of its SENDs is in flight (`give_back`).
pub(crate) struct LentSends {
    slots: Vec<Option<SendSlot>>,
    held: u32,
}

impl LentSends {
    /// None held yet, for a connection of `send_slots` send slots.
    pub(crate) fn new(send_slots: u32) -> LentSends {
        LentSends { slots: vec![None; send_slots as usize], held: 0 }
    }

    /// The hub's slot for the connection's own slot `k`, taken from `srq`
    /// the first time.
    pub(crate) fn slot<N: Nic>(&mut self, srq: &SharedReceives<N>, k: usize) -> Result<&SendSlot, NicError> {
        if self.slots[k].is_none() {
            self.slots[k] = Some(srq.take_send()?);
            self.held += 1;
        }
        Ok(self.slots[k].as_ref().expect("taken above"))
    }

    /// Whether any slot is held.
    pub(crate) fn any(&self) -> bool {
        self.held > 0
    }

    /// Every slot held goes back to `srq`: none of the connection's SENDs
    /// can read them any more (each completed or was flushed, or its QP is
    /// destroyed). Never allocates.
    pub(crate) fn give_back<N: Nic>(&mut self, srq: &SharedReceives<N>) {
        if self.held > 0 {
            srq.sends.lock().free.extend(self.slots.iter_mut().filter_map(Option::take));
            self.held = 0;
        }
    }
}

/// A hub's shared receive queue, held by the hub and by each endpoint on
/// it (the last one destroys it, after every QP on it is gone).
pub(crate) struct SharedReceives<N: Nic> {
    nic: N,
    srq: SrqId,
    cfg: SrqConfig,
    state: Mutex<State>,
    sends: Mutex<Sends>,
    frames: AtomicU64,
    grown: AtomicU64,
    withheld: AtomicU64,
    given_back: AtomicU64,
    limit_events: AtomicU64,
    refused: AtomicU64,
    unclaimed: AtomicU64,
    /// Chunks retired, and of those deregistered.
    retiring: AtomicU64,
    freed: AtomicU64,
    /// Calls of `check_limit`.
    checks: AtomicU64,
    /// Whether its connections may run confirm: their regions' keys then
    /// reach every connection's memory in the shared PD, which only an
    /// endpoint whose peers are all trusted allows
    /// (`EndpointBuilder::trusted_peers`).
    serves_confirm: bool,
}

impl<N: Nic> SharedReceives<N> {
    /// Create the queue on `nic` (the hub's handle and PD) with its first
    /// chunk posted and the limit armed; `serves_confirm`: whether its
    /// connections may run confirm (their peers are trusted).
    pub(crate) fn new(nic: N, cfg: SrqConfig, serves_confirm: bool) -> Result<SharedReceives<N>, SetupError> {
        if cfg.chunk < INITIAL_CREDITS || cfg.max_slots < cfg.chunk {
            let (chunk, max_slots, min_chunk) = (cfg.chunk, cfg.max_slots, INITIAL_CREDITS);
            return Err(ConfigError::BadSrqConfig { chunk, max_slots, min_chunk }.into());
        }
        let srq = nic.create_srq(cfg.max_slots)?;
        let me = SharedReceives {
            nic,
            srq,
            cfg,
            state: Mutex::new(State { slabs: Vec::new(), slots: 0, shares: 0 }),
            sends: Mutex::new(Sends { slabs: Vec::new(), free: Vec::new() }),
            frames: AtomicU64::new(0),
            grown: AtomicU64::new(0),
            withheld: AtomicU64::new(0),
            given_back: AtomicU64::new(0),
            limit_events: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            unclaimed: AtomicU64::new(0),
            retiring: AtomicU64::new(0),
            freed: AtomicU64::new(0),
            checks: AtomicU64::new(0),
            serves_confirm,
        };
        {
            let mut st = me.state.lock();
            me.grow(&mut st)?;
        }
        Ok(me)
    }

    /// Whether its connections may run confirm (see the field).
    pub(crate) fn serves_confirm(&self) -> bool {
        self.serves_confirm
    }

    /// The most receives the queue will hold.
    pub(crate) fn max_slots(&self) -> u32 {
        self.cfg.max_slots
    }

    /// The queue, for the QPs on it.
    pub(crate) fn id(&self) -> SrqId {
        self.srq
    }

    /// Register and post one more chunk, and re-arm the limit at an
    /// eighth of the new total. Once the chunk is posted the growth
    /// stands: a failure to arm the limit is logged, not returned (the
    /// connection that asked for the room has it; the next growth arms
    /// the limit again).
    fn grow(&self, st: &mut State) -> Result<(), SetupError> {
        // A retiring chunk's receives still posted take room in the queue.
        let n = self.cfg.chunk.min(self.cfg.max_slots.saturating_sub(st.held()));
        if n == 0 {
            return Err(SetupError::SrqBudget { max_slots: self.cfg.max_slots, shares: st.shares });
        }
        let mem = match Registered::register(&self.nic, n as usize * MAX_FRAME, Access::LOCAL_WRITE) {
            Ok(mem) => mem,
            Err(e) => {
                self.rearm_limit(st);
                return Err(e.into());
            }
        };
        let mr = mem.info.id;
        // Slab i's receives are numbered from i x chunk (`place`), whatever
        // came of the others: the first free place.
        let i = st.slabs.iter().position(Option::is_none).unwrap_or(st.slabs.len());
        let first = i as u32 * self.cfg.chunk;
        let slab = Slab { mem, held: 0, retiring: false };
        if i == st.slabs.len() {
            st.slabs.push(Some(slab));
        } else {
            st.slabs[i] = Some(slab);
        }
        let mut posted = 0;
        let mut failed = None;
        for k in 0..n {
            let sge = Sge { mr, offset: k as usize * MAX_FRAME, len: MAX_FRAME as u32 };
            if let Err(e) = self.nic.post_srq_recv(self.srq, wr_id(first + k), sge) {
                // Those posted stay posted (and are counted); the rest of the
                // region is unused.
                failed = Some(e);
                break;
            }
            posted += 1;
        }
        st.slots += posted;
        if let Some(Some(s)) = st.slabs.get_mut(i) {
            s.held = posted;
        }
        self.rearm_limit(st);
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// After a growth, failed part-way or not: the limit event (disarmed
    /// when it fired, which may be what asked for the growth) is armed
    /// for what is posted, so that the next time the queue runs low asks
    /// again. Its own failure is only logged: a growth's failure is the
    /// growth's, and posted receives serve whether the limit is armed or
    /// not.
    fn rearm_limit(&self, st: &State) {
        if let Err(e) = self.nic.arm_srq_limit(self.srq, (st.slots / 8).max(1)) {
            tracing::warn!(%e, "arming the shared receive queue's limit event again");
        }
    }

    /// After the shares shrank: while a whole chunk is free beyond twice
    /// [`ROOM`], the chunk in the last place is retired (the first place's
    /// never is). Its receives still posted serve frames as ever, but none
    /// is posted again, and once none is held it is deregistered
    /// (`unhold`; at once if none is): the registered memory of a burst
    /// goes back as traffic goes on. A chunk whose last receive never
    /// comes back (its completion lost) keeps its memory, and keeps no
    /// other chunk from retiring.
    fn retire(&self, st: &mut State) {
        loop {
            let last = st.slabs.iter().rposition(|s| s.as_ref().is_some_and(|s| !s.retiring));
            let Some(j) = last.filter(|&j| j > 0) else { return };
            let Some(s) = st.slabs[j].as_mut() else { return };
            if st.slots - s.held < st.shares + 2 * ROOM {
                return;
            }
            s.retiring = true;
            st.slots -= s.held;
            self.retiring.fetch_add(1, Ordering::Relaxed);
            if s.held == 0 {
                if let Some(s) = st.slabs[j].take() {
                    self.free_chunk(s);
                }
            }
        }
    }

    /// Deregister a retired chunk none of whose receives is held.
    fn free_chunk(&self, s: Slab) {
        self.freed.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.nic.dereg_mr(s.mem.info.id) {
            tracing::warn!(%e, "deregistering a retired chunk of the shared receive queue");
        }
    }

    /// Receive `slot` of slab `i` is neither posted nor being decoded any
    /// more (its chunk is retiring, or it could not be posted again). A
    /// retiring chunk with none left is deregistered.
    fn unhold(&self, slot: u32) {
        let i = (slot / self.cfg.chunk) as usize;
        let freed = {
            let mut st = self.state.lock();
            let Some(s) = st.slabs.get_mut(i).and_then(Option::as_mut) else { return };
            s.held = s.held.saturating_sub(1);
            let (retiring, left) = (s.retiring, s.held);
            if !retiring {
                st.slots = st.slots.saturating_sub(1);
                None
            } else if left == 0 {
                let s = st.slabs[i].take();
                // The next one, if the shares still leave it free.
                self.retire(&mut st);
                s
            } else {
                None
            }
        };
        if let Some(s) = freed {
            self.free_chunk(s);
        }
    }

    /// A new connection's initial share of `start` receives, growing the
    /// queue if it does not fit; `SrqBudget` when the queue is at its most.
    pub(crate) fn admit(&self, start: u32) -> Result<(), SetupError> {
        let mut st = self.state.lock();
        while st.shares + start > st.slots {
            // `grow` names the queue's most and the shares when it is full.
            if let Err(e) = self.grow(&mut st) {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        }
        st.shares += start;
        Ok(())
    }

    /// A connection's peer gave back `n` receives of its share (it was
    /// idle, and asked): they are free for others.
    pub(crate) fn given_back(&self, n: u32) {
        self.given_back.fetch_add(u64::from(n), Ordering::Relaxed);
        self.release(n);
    }

    /// A connection's QP is gone: its share comes back.
    pub(crate) fn release(&self, share: u32) {
        let mut st = self.state.lock();
        debug_assert!(share <= st.shares, "a share of {share} released of {} held", st.shares);
        st.shares -= share.min(st.shares);
        self.retire(&mut st);
    }

    /// A send slot of the hub's (its region and offset) to lend a
    /// connection, registering `SEND_CHUNK` more when none is free.
    fn take_send(&self) -> Result<SendSlot, NicError> {
        let mut s = self.sends.lock();
        if let Some(slot) = s.free.pop() {
            return Ok(slot);
        }
        let slab = Registered::register(&self.nic, SEND_CHUNK * MAX_FRAME, Access::LOCAL_WRITE)?;
        s.slabs.push(slab.info);
        let made = s.slabs.len() * SEND_CHUNK;
        let free = s.free.len();
        s.free.reserve(made - free);
        s.free.extend((1..SEND_CHUNK).rev().map(|k| (slab.clone(), k * MAX_FRAME)));
        Ok((slab, 0))
    }

    /// A frame arrived for a connection whose share is `share` (at least
    /// `floor`, at most `max`): what to do with its receive. The queue keeps
    /// [`ROOM`] receives free for the next connection: a share grows while
    /// more than that are free (adding a chunk first if fewer are, and the
    /// queue may grow), and shrinks towards `floor` while fewer are. Only
    /// `work` (a frame other than flow control and keepalive,
    /// `frame::grows_share`) grows a share; a frame that is not work
    /// shrinks it whenever it is above `floor` (an idle peer's pings would
    /// otherwise undo its give-back).
    pub(crate) fn regrant(&self, share: u32, floor: u32, max: u32, work: bool) -> Regrant {
        self.frames.fetch_add(1, Ordering::Relaxed);
        let mut st = self.state.lock();
        let free = |st: &State| st.slots - st.shares.min(st.slots);
        let may_grow = work && share < max;
        // (A retiring chunk's receives still posted take room in the queue.)
        if may_grow && free(&st) <= ROOM && st.held() < self.cfg.max_slots {
            // A busy connection and no room to spare: add a chunk.
            if let Err(e) = self.grow(&mut st) {
                tracing::warn!(%e, "growing the hub's shared receive queue");
            }
        }
        if share > floor && (!work || free(&st) < ROOM) {
            st.shares -= 1;
            self.withheld.fetch_add(1, Ordering::Relaxed);
            Regrant::Withhold
        } else if may_grow && free(&st) > ROOM {
            st.shares += 1;
            self.grown.fetch_add(1, Ordering::Relaxed);
            Regrant::Grow
        } else {
            Regrant::Same
        }
    }

    /// A receive of the queue completed: hand `decode` its frame, in its
    /// slot, when `len` gives its length (a successful receive; the empty
    /// slice otherwise), then post the receive again, unless its chunk is
    /// retiring (`retire`). `decode` runs under
    /// the slab memory's lock: it must not call the NIC (the simulator
    /// takes its fabric's lock, then a memory's). Fails, without
    /// calling `decode`, only if the frame cannot be reached; a receive
    /// that cannot be posted again is counted out of the queue.
    pub(crate) fn take_frame<R>(
        &self,
        slot: u32,
        len: Option<usize>,
        decode: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, NicError> {
        let placed = self.place(slot);
        let decoded = match (&placed, len) {
            (Ok((slab, offset, _)), Some(len)) => slab.with(*offset, len.min(MAX_FRAME), decode),
            (Ok(_), None) => Ok(decode(&[])),
            (Err(e), _) => Err(e.clone()),
        };
        match placed {
            Ok((slab, offset, false)) => {
                let sge = Sge { mr: slab.info.id, offset, len: MAX_FRAME as u32 };
                if let Err(e) = self.nic.post_srq_recv(self.srq, wr_id(slot), sge) {
                    // The queue holds one receive fewer (the limit event
                    // adds more if most are in use).
                    tracing::warn!(%e, slot, "posting a shared receive again");
                    self.unhold(slot);
                }
            }
            // Its chunk is retiring: not posted again.
            Ok((_, _, true)) => self.unhold(slot),
            Err(_) => {}
        }
        decoded
    }

    /// Receive `slot`'s region and offset, and whether its chunk is retiring.
    fn place(&self, slot: u32) -> Result<(Registered, usize, bool), NicError> {
        let st = self.state.lock();
        let chunk = self.cfg.chunk;
        let offset = (slot % chunk) as usize * MAX_FRAME;
        let i = (slot / chunk) as usize;
        match st.slabs.get(i).and_then(Option::as_ref) {
            Some(s) if offset < s.mem.info.len => Ok((s.mem.clone(), offset, s.retiring)),
            _ => Err(NicError::NoSuchObject { what: "shared receive", id: slot }),
        }
    }

    /// Take the SRQ's limit event, if it came: most receives are in use at
    /// once, so add a chunk (if the queue may grow) and re-arm. Called after
    /// each poll that found completions; it looks every
    /// [`LIMIT_CHECK_EVERY`]th time (on verbs a look is a `read` of the
    /// context's event fd), the event waiting in the device meanwhile.
    pub(crate) fn check_limit(&self) {
        if self.checks.fetch_add(1, Ordering::Relaxed) % LIMIT_CHECK_EVERY != 0 {
            return;
        }
        match self.nic.take_srq_limit(self.srq) {
            Ok(false) => {}
            Ok(true) => {
                self.limit_events.fetch_add(1, Ordering::Relaxed);
                let mut st = self.state.lock();
                let grown = if st.held() < self.cfg.max_slots {
                    self.grow(&mut st)
                } else {
                    self.nic.arm_srq_limit(self.srq, (st.slots / 8).max(1)).map_err(SetupError::from)
                };
                if let Err(e) = grown {
                    tracing::warn!(%e, "growing the hub's shared receive queue");
                }
            }
            Err(e) => tracing::warn!(%e, "reading the shared receive queue's limit event"),
        }
    }

    /// A completion of a receive of this queue that no connection will
    /// take (its QP is gone): post the receive again.
    pub(crate) fn repost_unclaimed(&self, c: &crate::backend::Completion) {
        if let Some(slot) = slot_of(c.wr_id) {
            self.unclaimed.fetch_add(1, Ordering::Relaxed);
            let _ = self.take_frame(slot, None, |_| ());
        }
    }

    pub(crate) fn stats(&self) -> SrqStats {
        let (send_slots, send_slots_lent) = {
            let s = self.sends.lock();
            let made = s.slabs.len() * SEND_CHUNK;
            (made as u32, (made - s.free.len()) as u32)
        };
        let st = self.state.lock();
        SrqStats {
            send_slots,
            send_slots_lent,
            slots: st.slots,
            shares: st.shares,
            registered_bytes: st.slabs.iter().flatten().map(|s| s.mem.info.len as u64).sum(),
            chunks_retired: self.retiring.load(Ordering::Relaxed),
            chunks_freed: self.freed.load(Ordering::Relaxed),
            frames: self.frames.load(Ordering::Relaxed),
            grown: self.grown.load(Ordering::Relaxed),
            withheld: self.withheld.load(Ordering::Relaxed),
            given_back: self.given_back.load(Ordering::Relaxed),
            limit_events: self.limit_events.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            unclaimed: self.unclaimed.load(Ordering::Relaxed),
        }
    }
}

impl<N: Nic> Drop for SharedReceives<N> {
    fn drop(&mut self) {
        if let Err(e) = self.nic.destroy_srq(self.srq) {
            tracing::warn!(%e, "destroying the hub's shared receive queue");
        }
        for slab in self.state.get_mut().slabs.drain(..).flatten() {
            let _ = self.nic.dereg_mr(slab.mem.info.id);
        }
        // Every connection holds the queue while it lives (the last one
        // drops it), so no SEND can read these any more, except one of a
        // connection whose QP could not be destroyed: its slots stay
        // registered.
        let s = self.sends.get_mut();
        if s.free.len() == s.slabs.len() * SEND_CHUNK {
            for mr in s.slabs.drain(..) {
                let _ = self.nic.dereg_mr(mr.id);
            }
        }
    }
}

fn wr_id(slot: u32) -> u64 {
    (u64::from(TAG_SRQ) << 56) | u64::from(slot)
}

/// The receive slot of a shared receive's `wr_id`, if it is one.
pub(crate) fn slot_of(wr_id: u64) -> Option<u32> {
    ((wr_id >> 56) as u8 == TAG_SRQ).then_some(wr_id as u32)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::sim::{DeviceConfig, Fabric};

    /// A chunk none of whose receives could be posted is freed as soon as
    /// it is retired (nothing will ever come back to free it later).
    #[test]
    fn a_chunk_retired_with_nothing_held_is_freed_at_once() {
        let nic = Fabric::with_seed(4).add_device(DeviceConfig::spec());
        let srq = SharedReceives::new(nic.clone(), SrqConfig { chunk: 16, max_slots: 64 }, false).unwrap();
        srq.admit(8).unwrap();
        // The second chunk is registered, and its first post fails.
        nic.fail_next(crate::sim::Verb::PostSrqRecv, 1);
        assert!(srq.admit(16).is_err());
        let st = srq.stats();
        assert_eq!((st.slots, st.registered_bytes), (16, 2 * 16 * MAX_FRAME as u64), "{st:?}");
        // The share goes: the chunk in the last place, with none held, goes
        // at once; the first place's stays.
        srq.release(8);
        let st = srq.stats();
        assert_eq!((st.chunks_retired, st.chunks_freed), (1, 1), "{st:?}");
        assert_eq!((st.slots, st.registered_bytes), (16, 16 * MAX_FRAME as u64), "{st:?}");
        // And the queue grows again in its place.
        srq.admit(24).unwrap();
        assert_eq!(srq.stats().slots, 32);
    }

    /// A growth that fails (here its chunk's first receive cannot be
    /// posted) arms the limit event again: the event that asked for it
    /// fired once, and before it stayed disarmed, so the queue running low
    /// later asked for nothing.
    #[test]
    fn a_failed_growth_arms_the_limit_event_again() {
        use crate::backend::{ops::NicOps, Access, QpConfig, SendWr, Sge, SgeList};
        let fabric = Fabric::with_seed(6);
        let a = fabric.add_device(DeviceConfig::spec().named("a"));
        let b = fabric.add_device(DeviceConfig::spec().named("b"));
        let srq = SharedReceives::new(b.clone(), SrqConfig { chunk: 16, max_slots: 64 }, false).unwrap();
        srq.admit(8).unwrap();
        let (acq, bcq) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
        let mut on_srq = QpConfig::new(bcq, bcq);
        on_srq.srq = Some(srq.id());
        let (x, y) = (a.create_qp(QpConfig::new(acq, acq)).unwrap(), b.create_qp(on_srq).unwrap());
        a.connect_qp(x.id, &y).unwrap();
        b.connect_qp(y.id, &x).unwrap();
        let src = a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let send = |n: u64| {
            for k in 0..n {
                let sge = SgeList::one(Sge { mr: src.id, offset: 0, len: 16 });
                a.post_send(x.id, &[SendWr::Send { wr_id: k, sge, signaled: false }]).unwrap();
            }
            fabric.run_until_idle();
        };
        // 16 posted, the limit at 2: 15 taken leave 1, and the event fires.
        send(15);
        // The growth it asks for fails.
        b.fail_next(crate::sim::Verb::PostSrqRecv, 1);
        for _ in 0..LIMIT_CHECK_EVERY {
            srq.check_limit();
        }
        assert_eq!(srq.stats().slots, 16, "the growth failed");
        // Armed again at 2 for the 16 posted: one more taken fires it.
        send(1);
        assert!(b.take_srq_limit(srq.id()).unwrap(), "the limit event is armed again");
    }

    /// A growth whose receives are all posted stands though arming the
    /// limit event after it fails: the connection that asked for the room
    /// is admitted (the failure is logged), and the next growth arms the
    /// limit again.
    #[test]
    fn a_growth_stands_when_arming_the_limit_after_it_fails() {
        let nic = Fabric::with_seed(7).add_device(DeviceConfig::spec());
        let srq = SharedReceives::new(nic.clone(), SrqConfig { chunk: 16, max_slots: 64 }, false).unwrap();
        srq.admit(16).unwrap();
        nic.fail_next(crate::sim::Verb::ArmSrqLimit, 1);
        srq.admit(8).expect("admitted: the chunk that makes room is posted");
        let st = srq.stats();
        assert_eq!((st.slots, st.shares, st.refused), (32, 24, 0), "{st:?}");
        srq.admit(16).expect("the next growth");
        assert_eq!(srq.stats().slots, 48);
    }

    /// Connections take more send slots than one chunk holds: the hub
    /// registers chunks as needed, never lends a slot to two holders at
    /// once, takes every slot back, and lends the same ones again without
    /// registering more.
    #[test]
    fn send_slots_grow_by_chunks_and_are_never_lent_twice() {
        let nic = Fabric::with_seed(3).add_device(DeviceConfig::spec());
        let srq = SharedReceives::new(nic, SrqConfig { chunk: 16, max_slots: 64 }, false).unwrap();
        // 40 connections of 16 send slots: 640 slots, 3 chunks.
        let mut conns: Vec<LentSends> = (0..40).map(|_| LentSends::new(16)).collect();
        let mut seen = HashSet::new();
        // A slot's region and offset (its memory is the region's).
        let key = |s: &SendSlot| (s.0.info.id, s.1);
        for c in conns.iter_mut() {
            for k in 0..16 {
                let slot = key(c.slot(&srq, k).unwrap());
                assert_eq!(key(c.slot(&srq, k).unwrap()), slot, "a held slot stands for the same own slot");
                assert_eq!(slot.1 % MAX_FRAME, 0);
                assert!(slot.1 < SEND_CHUNK * MAX_FRAME);
                assert!(seen.insert(slot), "slot {slot:?} lent twice");
            }
        }
        let stats = srq.stats();
        assert_eq!((stats.send_slots, stats.send_slots_lent), (3 * SEND_CHUNK as u32, 640));
        // Half give theirs back; the others' stay lent.
        for c in conns.iter_mut().step_by(2) {
            c.give_back(&srq);
            assert!(!c.any());
        }
        assert_eq!(srq.stats().send_slots_lent, 320);
        // Taken again: from those given back, never one still lent.
        let still: HashSet<_> =
            conns.iter().skip(1).step_by(2).flat_map(|c| c.slots.iter().flatten().map(key)).collect();
        for c in conns.iter_mut().step_by(2) {
            for k in 0..16 {
                assert!(!still.contains(&key(c.slot(&srq, k).unwrap())));
            }
        }
        for c in conns.iter_mut() {
            c.give_back(&srq);
        }
        let stats = srq.stats();
        assert_eq!((stats.send_slots, stats.send_slots_lent), (3 * SEND_CHUNK as u32, 0));
    }
}
