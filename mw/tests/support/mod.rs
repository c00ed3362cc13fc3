//! A small world for the engines: the real `Owner` on host A, the real
//! `Reader` on host B, a NIC model on each side (type-2 windows, send queues,
//! completion queues, an RDMA READ responder that behaves like rxe), an RC
//! channel with delay in each direction, a virtual clock, and fault knobs.
//!
//! Every step is a small deterministic function; the model checker
//! (`tests/model.rs`) explores all orders of the enabled steps, the scripted
//! tests (`tests/pair.rs`) pick them. Ghost state records what a real NIC
//! would make observable (bind and invalidation counts, data versions) and
//! the first protocol violation seen.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::time::Duration;

use mwcap_mw::{
    Buffer, Grant, LeaseId, Message, Owner, OwnerAction, OwnerEvent, Reader, ReaderAction, ReaderConfig,
    ReaderEvent, Release, ReleaseMode, Status, Token, Window,
};

/// One tick of the virtual clock.
pub const TICK: Duration = Duration::from_millis(1);
/// Bytes of every owner buffer and reader destination.
pub const BUF_LEN: u32 = 64;

pub fn at(ticks: u32) -> Duration {
    TICK * ticks
}

/// The NIC's view of a window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WinState {
    Unbound,
    Bound {
        rkey: u32,
        buf: u32,
    },
    Invalid {
        rkey: u32,
    },
    /// Invalidated by a (misbehaving) peer's SEND_WITH_INV.
    PeerInvalid {
        rkey: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OwnerWr {
    Bind { token: Token, window: u32, rkey: u32, buf: u32 },
    Send { token: Token, bytes: Vec<u8> },
    LocalInv { token: Token, window: u32, rkey: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReaderWr {
    Read { token: Token, dest: u32, addr: u64, rkey: u32, len: u32 },
    Send { bytes: Vec<u8> },
}

/// What travels on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Packet {
    /// A SEND's payload.
    Send(Vec<u8>),
    /// A SEND_WITH_INV (only a misbehaving peer sends one).
    SendWithInv {
        bytes: Vec<u8>,
        rkey: u32,
    },
    ReadReq {
        token: Token,
        addr: u64,
        rkey: u32,
        len: u32,
    },
    ReadResp {
        token: Token,
        version: u32,
    },
    /// The responder refused a READ (REM_ACCESS_ERR).
    ReadNak {
        token: Token,
    },
}

/// A READ the owner's responder is serving: it has passed the key check and
/// is copying the buffer. A move of A's QP to ERR does not stop it (a NIC
/// looks at the QP's state between packets, and may be copying the last
/// one); only the QP's destruction does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Serving {
    pub token: Token,
    pub window: u32,
    pub buf: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OwnerBuf {
    /// The owner holds it (free to write and to grant).
    pub home: bool,
    /// Its content; bumped every time it is granted anew.
    pub version: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dest {
    pub free: bool,
    /// The version a READ wrote into it, if any since it was handed out.
    pub data: Option<u32>,
}

/// The steps of the world; the model checker's actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// A's user grants owner buffer `buf`.
    Grant { buf: u32 },
    /// A's user cancels its oldest active lease.
    Cancel,
    /// A's user revokes its oldest active lease (`Owner::revoke`).
    Revoke,
    /// A's NIC executes the head of its send queue.
    OwnerSq,
    /// A's driver hands the head completion to the owner.
    OwnerCq,
    /// A's responder finishes the oldest READ it is serving.
    Serve,
    /// The head packet of the B→A channel arrives at A.
    ToOwner,
    /// B's NIC executes the head of its send queue.
    ReaderSq,
    /// B's driver hands the head completion to the reader.
    ReaderCq,
    /// The head packet of the A→B channel arrives at B.
    ToReader,
    /// B's user sends the response carrying a piggybacked release.
    Respond,
    /// A's expiry timer fires.
    OwnerTimer,
    /// B's READ timer fires.
    ReaderTimer,
    /// The clock advances one tick.
    Tick,
    /// B crashes: its process and QP vanish.
    PeerDies,
    /// A's QP goes to ERR (its peer's QP is gone: retries exhausted).
    OwnerQpFails,
    /// A's driver notices its QP is in ERR.
    OwnerNoticesErr,
    /// B's driver notices its QP is in ERR.
    ReaderNoticesErr,
    /// B misbehaves: SEND_WITH_INV of the last rkey it was granted.
    PeerSendsWithInv,
    /// A peer of *another* connection on A's device sends a SEND_WITH_INV
    /// carrying the key of A's window `w`, bound now (it guessed it), and
    /// A's NIC invalidates the window device-wide (rxe): A's owner sees no
    /// completion for it.
    ForeignSendsWithInv { w: u32 },
    /// A's driver takes the connection down (`Owner::handle_connection_lost`)
    /// and asks for its QP to go to ERR, which fails: the QP stays up, its
    /// windows bound and readable.
    OwnerTakesDown,
    /// A's driver destroys its QP (once the connection is down, as the
    /// I/O layer does once the flushes are in, or after its flush grace):
    /// the responder and the send queue stop, its completions never come,
    /// and the owner is told (`Owner::handle_qp_destroyed`).
    OwnerDestroysQp,
    /// A's endpoint polls the other connection's receives, sees that the
    /// oldest rkey not yet reported is none of that connection's, and tells
    /// A's owner (`Owner::handle_invalidation_elsewhere`), which takes A
    /// down. Every one is reported, in order (the endpoint keeps them all).
    HubReportsForeign,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    pub windows: u32,
    pub buffers: u32,
    pub dests: u32,
    pub grants: u8,
    /// Grants only happen while `now <= grant_until`.
    pub grant_until: u32,
    /// The clock stops here.
    pub t_end: u32,
    pub lease: u32,
    pub margin: u32,
    pub mode: ReleaseMode,
    pub cancels: u8,
    /// Revocations A's user may make (`Step::Revoke`).
    pub revokes: u8,
    /// The peer may crash (at any time, and by `die_by` at the latest).
    pub peer_death: Option<u32>,
    pub hostile: bool,
    /// How many of A's windows a peer of another connection may invalidate
    /// (`Step::ForeignSendsWithInv`).
    pub foreign: u8,
    pub seed: u64,
    /// `Some(n)`: the owner is made with `Owner::lending` (`windows` lease
    /// slots) and each grant takes a window from a pool of `n` that the
    /// world keeps, as a hub does for its connections.
    pub lend: Option<u32>,
    /// A's driver may take the connection down while its QP stays up (its
    /// move to ERR failed: `Step::OwnerTakesDown`). (Every connection that
    /// went down may have its QP destroyed: `Step::OwnerDestroysQp`.)
    pub takes_down: bool,
}

impl Config {
    pub fn small(mode: ReleaseMode) -> Config {
        Config {
            windows: 2,
            buffers: 2,
            dests: 2,
            grants: 2,
            grant_until: 1,
            t_end: 7,
            lease: 4,
            margin: 1,
            mode,
            cancels: 0,
            revokes: 0,
            peer_death: None,
            hostile: false,
            foreign: 0,
            seed: 7,
            lend: None,
            takes_down: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct World {
    pub now: u32,
    pub owner: Owner,
    pub reader: Reader,
    // Host A's NIC.
    pub windows: Vec<WinState>,
    pub owner_sq: VecDeque<OwnerWr>,
    pub owner_cq: VecDeque<(Token, Status)>,
    pub serving: VecDeque<Serving>,
    pub a_err: bool,
    /// A's QP was destroyed (`Step::OwnerDestroysQp`).
    pub a_destroyed: bool,
    // Host B's NIC.
    pub reader_sq: VecDeque<ReaderWr>,
    pub reader_cq: VecDeque<(Token, Status)>,
    /// READs B has sent and not yet seen answered: (token, destination).
    pub b_reads: Vec<(Token, u32)>,
    pub b_err: bool,
    pub peer_dead: bool,
    // The RC channels.
    pub to_owner: VecDeque<Packet>,
    pub to_reader: VecDeque<Packet>,
    // Users.
    pub bufs: Vec<OwnerBuf>,
    pub dests: Vec<Dest>,
    /// Releases B's user must carry in a response (piggyback mode).
    pub responses: VecDeque<Release>,
    /// Leases not yet returned, oldest first, with the version granted.
    pub active: Vec<(LeaseId, u32)>,
    /// Versions of every lease granted (for the stale-read check).
    pub granted: Vec<(LeaseId, u32)>,
    pub last_rkey_seen: Option<u32>,
    pub grants_left: u8,
    pub cancels_left: u8,
    pub revokes_left: u8,
    pub hostile_left: bool,
    pub foreign_left: u8,
    /// Rkeys a peer of another connection invalidated, not yet reported to
    /// A's owner by the endpoint, oldest first.
    pub foreign_pending: Vec<u32>,
    // Ghost counters.
    /// A LOCAL_INV the owner posted before it was told met a window that a
    /// peer had invalidated: the double invalidation that panics rxe,
    /// caused by the peer (why mw on rxe needs trusted peers).
    pub peer_caused_double_inv: u32,
    /// Reports of a foreign invalidation that found the owner's bind.
    pub foreign_told: u32,
    pub binds: Vec<u32>,
    pub invalidations: Vec<u32>,
    pub violation: Option<String>,
    /// Windows the owner has been told the peer invalidated.
    pub told_peer_inv: Vec<u32>,
    /// Lending (`Config::lend`): the pool's free windows (last bind's
    /// rkey), the ones lent to the owner, and the ones retired with the QP.
    pub lending: bool,
    pub pool: Vec<Window>,
    pub lent: Vec<u32>,
    pub retired: Vec<u32>,
    /// Events, kept only when `log` is on (scripted tests).
    pub log: bool,
    pub owner_events: Vec<OwnerEvent>,
    pub reader_events: Vec<ReaderEvent>,
}

fn window_handle(w: u32) -> u32 {
    100 + w
}
fn window_index(handle: u32) -> usize {
    (handle - 100) as usize
}
fn buffer(b: u32) -> Buffer {
    Buffer { mr: b, offset: 0, len: BUF_LEN, addr: 0x1000 * (u64::from(b) + 1) }
}

impl World {
    pub fn new(cfg: &Config) -> World {
        let nic_windows = cfg.lend.unwrap_or(cfg.windows);
        let mut windows = (0..nic_windows).map(|w| Window { handle: window_handle(w), rkey: (w + 1) << 8 });
        let (owner, pool) = match cfg.lend {
            None => (Owner::new(cfg.seed, windows), Vec::new()),
            // Taken from the end: window 0 first.
            Some(_) => (Owner::lending(cfg.seed, cfg.windows as usize), windows.by_ref().rev().collect()),
        };
        World {
            now: 0,
            owner,
            reader: Reader::new(ReaderConfig {
                safety_margin: at(cfg.margin),
                release: cfg.mode,
                max_lease: mwcap_mw::MAX_LEASE_TIME,
            }),
            windows: vec![WinState::Unbound; nic_windows as usize],
            owner_sq: VecDeque::new(),
            owner_cq: VecDeque::new(),
            serving: VecDeque::new(),
            a_err: false,
            a_destroyed: false,
            reader_sq: VecDeque::new(),
            reader_cq: VecDeque::new(),
            b_reads: Vec::new(),
            b_err: false,
            peer_dead: false,
            to_owner: VecDeque::new(),
            to_reader: VecDeque::new(),
            bufs: vec![OwnerBuf { home: true, version: 0 }; cfg.buffers as usize],
            dests: vec![Dest { free: true, data: None }; cfg.dests as usize],
            responses: VecDeque::new(),
            active: Vec::new(),
            granted: Vec::new(),
            last_rkey_seen: None,
            grants_left: cfg.grants,
            cancels_left: cfg.cancels,
            revokes_left: cfg.revokes,
            hostile_left: cfg.hostile,
            foreign_left: cfg.foreign,
            foreign_pending: Vec::new(),
            peer_caused_double_inv: 0,
            foreign_told: 0,
            binds: vec![0; nic_windows as usize],
            invalidations: vec![0; nic_windows as usize],
            violation: None,
            told_peer_inv: Vec::new(),
            lending: cfg.lend.is_some(),
            pool,
            lent: Vec::new(),
            retired: Vec::new(),
            log: false,
            owner_events: Vec::new(),
            reader_events: Vec::new(),
        }
    }

    fn violate(&mut self, what: String) {
        if self.violation.is_none() {
            self.violation = Some(what);
        }
    }

    /// Whether a remote READ can still touch owner buffer `b`.
    pub fn remote_access_possible(&self, b: u32) -> bool {
        let bound = self.windows.iter().any(|w| matches!(w, WinState::Bound { buf, .. } if *buf == b));
        (!self.a_err && bound) || self.serving.iter().any(|s| s.buf == b)
    }

    /// Whether a READ may still write into destination `d`.
    pub fn read_into_possible(&self, d: u32) -> bool {
        self.b_reads.iter().any(|&(_, dest)| dest == d)
            || self.reader_sq.iter().any(|wr| matches!(wr, ReaderWr::Read { dest, .. } if *dest == d))
    }

    pub fn enabled(&self, cfg: &Config, out: &mut Vec<Step>) {
        let b_alive = !self.peer_dead;
        let window_ready = cfg.lend.is_none() || !self.pool.is_empty();
        if self.grants_left > 0
            && self.now <= cfg.grant_until
            && self.owner.free_windows() > 0
            && window_ready
        {
            if let Some(b) = self.bufs.iter().position(|b| b.home) {
                // Buffers are interchangeable: offering only the first free
                // one keeps the state space small without losing behaviour.
                out.push(Step::Grant { buf: b as u32 });
            }
        }
        if self.revokes_left > 0 && !self.active.is_empty() {
            out.push(Step::Revoke);
        }
        if self.cancels_left > 0 && !self.active.is_empty() {
            out.push(Step::Cancel);
        }
        if !self.a_err && !self.owner_sq.is_empty() {
            out.push(Step::OwnerSq);
        }
        if !self.owner_cq.is_empty() {
            out.push(Step::OwnerCq);
        }
        if !self.a_destroyed && !self.serving.is_empty() {
            out.push(Step::Serve);
        }
        if !self.to_owner.is_empty() {
            out.push(Step::ToOwner);
        }
        if b_alive && !self.b_err && !self.reader_sq.is_empty() {
            out.push(Step::ReaderSq);
        }
        if b_alive && !self.reader_cq.is_empty() {
            out.push(Step::ReaderCq);
        }
        if b_alive && !self.to_reader.is_empty() {
            let needs_dest = matches!(self.to_reader.front(), Some(Packet::Send(_)));
            if !needs_dest || self.dests.iter().any(|d| d.free) {
                out.push(Step::ToReader);
            }
        }
        if b_alive && !self.responses.is_empty() {
            out.push(Step::Respond);
        }
        if self.owner.poll_timeout().is_some_and(|t| t <= at(self.now)) {
            out.push(Step::OwnerTimer);
        }
        if b_alive && self.reader.poll_timeout().is_some_and(|t| t <= at(self.now)) {
            out.push(Step::ReaderTimer);
        }
        let must_die_first = cfg.peer_death.is_some_and(|by| self.now >= by && b_alive);
        // The clock runs to `t_end`, and beyond only up to the next armed
        // deadline (so every armed timer can fire; grants stop at
        // `grant_until`, so this ends).
        let future = |t: Option<Duration>| t.is_some_and(|t| t > at(self.now));
        let timer_pending =
            future(self.owner.poll_timeout()) || (b_alive && future(self.reader.poll_timeout()));
        if (self.now < cfg.t_end || timer_pending) && !must_die_first {
            out.push(Step::Tick);
        }
        if cfg.peer_death.is_some() && b_alive {
            out.push(Step::PeerDies);
        }
        if !self.a_err && (self.b_err || self.peer_dead) {
            out.push(Step::OwnerQpFails);
        }
        // No step moves B's QP to ERR because A's did: on rxe a READ whose
        // window was invalidated under it hangs with the requester in RTS,
        // so the reader's own timeout and flush are its only way out.
        if self.a_err && !self.owner.is_connection_lost() {
            out.push(Step::OwnerNoticesErr);
        }
        if !self.a_destroyed {
            if !self.owner.is_connection_lost() {
                if cfg.takes_down {
                    out.push(Step::OwnerTakesDown);
                }
            } else {
                out.push(Step::OwnerDestroysQp);
            }
        }
        if b_alive && self.b_err && !self.reader.is_connection_lost() {
            out.push(Step::ReaderNoticesErr);
        }
        if self.hostile_left && b_alive && !self.b_err && self.last_rkey_seen.is_some() {
            out.push(Step::PeerSendsWithInv);
        }
        // Only at a window bound now: one that is not bound any more would
        // be the attacker's own double invalidation.
        if self.foreign_left > 0 {
            for (w, state) in self.windows.iter().enumerate() {
                if matches!(state, WinState::Bound { .. }) {
                    out.push(Step::ForeignSendsWithInv { w: w as u32 });
                }
            }
        }
        if !self.foreign_pending.is_empty() {
            out.push(Step::HubReportsForeign);
        }
    }

    pub fn step(&mut self, cfg: &Config, step: Step) {
        let now = at(self.now);
        match step {
            Step::Grant { buf } => {
                let version = self.bufs[buf as usize].version + 1;
                let granted = match cfg.lend {
                    None => self.owner.grant(now, buffer(buf), at(cfg.lease)),
                    Some(_) => {
                        let w = self.pool.pop().expect("enabled with a window in the pool");
                        match self.owner.grant_on(now, buffer(buf), at(cfg.lease), w) {
                            Ok(lease) => {
                                self.lent.push(window_index(w.handle) as u32);
                                Ok(lease)
                            }
                            Err(refused) => {
                                if refused.window != w {
                                    self.violate(format!(
                                        "a refused grant handed back {:?}, not {w:?}",
                                        refused.window
                                    ));
                                }
                                self.pool.push(w);
                                Err(refused.error)
                            }
                        }
                    }
                };
                match granted {
                    Ok(lease) => {
                        self.grants_left -= 1;
                        let b = &mut self.bufs[buf as usize];
                        b.home = false;
                        b.version = version;
                        self.active.push((lease, version));
                        self.granted.push((lease, version));
                    }
                    Err(e) => self.violate(format!("grant refused with a free window: {e}")),
                }
                self.drive_owner();
            }
            Step::Cancel => {
                self.cancels_left -= 1;
                let (lease, _) = self.active[0];
                if let Err(e) = self.owner.cancel(now, lease) {
                    self.violate(format!("cancel of an active lease refused: {e}"));
                }
                self.drive_owner();
            }
            Step::Revoke => {
                self.revokes_left -= 1;
                let (lease, _) = self.active[0];
                if let Err(e) = self.owner.revoke(now, lease) {
                    self.violate(format!("revocation of an active lease refused: {e}"));
                }
                self.drive_owner();
            }
            Step::OwnerSq => self.owner_sq_step(),
            Step::OwnerCq => {
                if let Some((token, status)) = self.owner_cq.pop_front() {
                    self.owner.handle_completion(now, token, status);
                    self.drive_owner();
                }
            }
            Step::Serve => {
                if let Some(s) = self.serving.pop_front() {
                    let version = self.bufs[s.buf as usize].version;
                    self.to_reader.push_back(Packet::ReadResp { token: s.token, version });
                }
            }
            Step::ToOwner => self.deliver_to_owner(),
            Step::ReaderSq => match self.reader_sq.pop_front() {
                Some(ReaderWr::Read { token, dest, addr, rkey, len }) => {
                    self.b_reads.push((token, dest));
                    self.to_owner.push_back(Packet::ReadReq { token, addr, rkey, len });
                }
                Some(ReaderWr::Send { bytes }) => self.to_owner.push_back(Packet::Send(bytes)),
                None => {}
            },
            Step::ReaderCq => {
                if let Some((token, status)) = self.reader_cq.pop_front() {
                    self.reader.handle_completion(now, token, status);
                    self.drive_reader();
                }
            }
            Step::ToReader => self.deliver_to_reader(),
            Step::Respond => {
                if let Some(release) = self.responses.pop_front() {
                    if !self.b_err {
                        self.reader_sq
                            .push_back(ReaderWr::Send { bytes: Message::Release(release).to_bytes() });
                    }
                }
            }
            Step::OwnerTimer => {
                self.owner.handle_timeout(now);
                self.drive_owner();
            }
            Step::ReaderTimer => {
                self.reader.handle_timeout(now);
                self.drive_reader();
            }
            Step::Tick => self.now += 1,
            Step::PeerDies => {
                self.peer_dead = true;
                self.to_reader.clear();
                self.reader_sq.clear();
                self.reader_cq.clear();
                self.b_reads.clear();
                self.responses.clear();
            }
            Step::OwnerQpFails => self.fail_a(),
            Step::OwnerNoticesErr => {
                self.owner.handle_qp_error(now);
                self.drive_owner();
            }
            Step::OwnerTakesDown => {
                self.owner.handle_connection_lost(now);
                self.drive_owner();
            }
            Step::OwnerDestroysQp => {
                self.a_destroyed = true;
                self.fail_a();
                self.serving.clear();
                self.owner_cq.clear();
                self.owner.handle_qp_destroyed(now);
                self.drive_owner();
            }
            Step::ReaderNoticesErr => {
                self.reader.handle_qp_error(now);
                self.drive_reader();
            }
            Step::ForeignSendsWithInv { w } => {
                self.foreign_left -= 1;
                let w = w as usize;
                let WinState::Bound { rkey, .. } = self.windows[w] else {
                    unreachable!("enabled while bound")
                };
                self.windows[w] = WinState::PeerInvalid { rkey };
                self.invalidations[w] += 1;
                self.foreign_pending.push(rkey);
            }
            Step::HubReportsForeign => {
                let rkey = self.foreign_pending.remove(0);
                if self.owner.handle_invalidation_elsewhere(now, rkey) {
                    self.foreign_told += 1;
                    if let Some(w) = self
                        .windows
                        .iter()
                        .position(|s| matches!(s, WinState::PeerInvalid { rkey: k } if *k == rkey))
                    {
                        self.told_peer_inv.push(window_handle(w as u32));
                    }
                }
                self.drive_owner();
            }
            Step::PeerSendsWithInv => {
                self.hostile_left = false;
                if let Some(rkey) = self.last_rkey_seen {
                    self.to_owner.push_back(Packet::SendWithInv { bytes: Vec::new(), rkey });
                }
            }
        }
    }

    fn owner_sq_step(&mut self) {
        let Some(wr) = self.owner_sq.pop_front() else { return };
        match wr {
            OwnerWr::Bind { token, window, rkey, buf } => {
                let w = window_index(window);
                if matches!(self.windows[w], WinState::Bound { .. }) {
                    self.violate(format!("window {window} bound while still bound"));
                    self.owner_cq.push_back((token, Status::Failed(6)));
                    self.fail_a();
                    return;
                }
                self.windows[w] = WinState::Bound { rkey, buf };
                self.binds[w] += 1;
            }
            OwnerWr::Send { token, bytes } => {
                if !self.peer_dead {
                    self.to_reader.push_back(Packet::Send(bytes));
                }
                self.owner_cq.push_back((token, Status::Success));
            }
            OwnerWr::LocalInv { token, window, rkey } => {
                let w = window_index(window);
                match self.windows[w] {
                    WinState::Bound { rkey: k, .. } if k == rkey => {
                        self.windows[w] = WinState::Invalid { rkey };
                        self.invalidations[w] += 1;
                        self.owner_cq.push_back((token, Status::Success));
                        // rxe: a READ being served through the window hangs
                        // at the requester and puts this QP in ERR.
                        if self.serving.iter().any(|s| s.window == window) {
                            self.serving.retain(|s| s.window != window);
                            self.fail_a();
                        }
                    }
                    WinState::PeerInvalid { .. } => {
                        // The peer's SEND_WITH_INV got there first: a double
                        // invalidation caused by the peer (rxe panics). The
                        // owner is at fault only if it had been told.
                        if self.told_peer_inv.contains(&window) {
                            self.violate(format!(
                                "LOCAL_INV of window {window} after the owner learned of SEND_WITH_INV"
                            ));
                        }
                        self.peer_caused_double_inv += 1;
                        self.owner_cq.push_back((token, Status::Failed(11)));
                        self.fail_a();
                    }
                    other => {
                        self.violate(format!("LOCAL_INV of window {window} in state {other:?} (rxe panics)"));
                        self.owner_cq.push_back((token, Status::Failed(11)));
                        self.fail_a();
                    }
                }
            }
        }
    }

    fn deliver_to_owner(&mut self) {
        let Some(packet) = self.to_owner.pop_front() else { return };
        if self.a_err {
            return;
        }
        let now = at(self.now);
        match packet {
            Packet::Send(bytes) => match Message::decode(&bytes) {
                Ok(Message::Release(release)) => {
                    self.owner.handle_release(now, release);
                    self.drive_owner();
                }
                other => self.violate(format!("owner received {other:?}")),
            },
            Packet::SendWithInv { rkey, .. } => {
                // The NIC invalidates whatever window carries the rkey.
                match self
                    .windows
                    .iter()
                    .position(|w| matches!(w, WinState::Bound { rkey: k, .. } if *k == rkey))
                {
                    Some(w) => {
                        self.windows[w] = WinState::PeerInvalid { rkey };
                        self.invalidations[w] += 1;
                        self.told_peer_inv.push(window_handle(w as u32));
                    }
                    None => {
                        // rxe would panic here; the peer caused it, so it is
                        // not the owner's violation. The model stops the
                        // peer from doing it (see `PeerSendsWithInv`).
                    }
                }
                self.owner.handle_peer_invalidation(now, rkey);
                self.drive_owner();
            }
            Packet::ReadReq { token, addr, rkey, len } => {
                let hit = self.windows.iter().enumerate().find_map(|(w, s)| match *s {
                    WinState::Bound { rkey: k, buf } if k == rkey => Some((w, buf)),
                    _ => None,
                });
                match hit {
                    Some((w, buf)) if addr == buffer(buf).addr && len <= buffer(buf).len => {
                        self.serving.push_back(Serving { token, window: window_handle(w as u32), buf });
                    }
                    _ => {
                        // REM_ACCESS_ERR: both QPs go to ERR.
                        self.to_reader.push_back(Packet::ReadNak { token });
                        self.fail_a();
                    }
                }
            }
            other => self.violate(format!("owner received {other:?}")),
        }
    }

    fn deliver_to_reader(&mut self) {
        let Some(packet) = self.to_reader.pop_front() else { return };
        if self.b_err {
            return;
        }
        let now = at(self.now);
        match packet {
            Packet::Send(bytes) => match Message::decode(&bytes) {
                Ok(Message::Grant(grant)) => {
                    let Some(d) = self.dests.iter().position(|d| d.free) else {
                        self.violate("grant delivered with no free destination".into());
                        return;
                    };
                    self.dests[d] = Dest { free: false, data: None };
                    self.last_rkey_seen = Some(grant.rkey);
                    let dest = Buffer { mr: d as u32, offset: 0, len: BUF_LEN, addr: 0 };
                    self.reader.handle_grant(now, grant, dest);
                    self.drive_reader();
                }
                other => self.violate(format!("reader received {other:?}")),
            },
            Packet::ReadResp { token, version } => {
                if let Some(i) = self.b_reads.iter().position(|&(t, _)| t == token) {
                    let (_, d) = self.b_reads.remove(i);
                    self.dests[d as usize].data = Some(version);
                    self.reader_cq.push_back((token, Status::Success));
                }
            }
            Packet::ReadNak { token } => {
                if let Some(i) = self.b_reads.iter().position(|&(t, _)| t == token) {
                    self.b_reads.remove(i);
                    self.reader_cq.push_back((token, Status::RemoteAccess));
                }
                self.fail_b();
            }
            other => self.violate(format!("reader received {other:?}")),
        }
    }

    /// A's QP goes to ERR: its send queue is flushed (signaled work requests
    /// complete with WR_FLUSH_ERR; the unsignaled bind gives nothing), its
    /// responder starts no READ (those it is copying may still finish,
    /// until the QP is destroyed), packets arriving for it are dropped.
    pub fn fail_a(&mut self) {
        if self.a_err {
            return;
        }
        self.a_err = true;
        for wr in std::mem::take(&mut self.owner_sq) {
            match wr {
                OwnerWr::Send { token, .. } | OwnerWr::LocalInv { token, .. } => {
                    self.owner_cq.push_back((token, Status::Flushed))
                }
                OwnerWr::Bind { .. } => {}
            }
        }
        self.to_owner.clear();
    }

    /// B's QP goes to ERR: every outstanding READ completes flushed.
    pub fn fail_b(&mut self) {
        if self.b_err || self.peer_dead {
            return;
        }
        self.b_err = true;
        for wr in std::mem::take(&mut self.reader_sq) {
            if let ReaderWr::Read { token, .. } = wr {
                self.reader_cq.push_back((token, Status::Flushed));
            }
        }
        for (token, _) in std::mem::take(&mut self.b_reads) {
            self.reader_cq.push_back((token, Status::Flushed));
        }
        self.to_reader.clear();
    }

    /// A's driver: carry out the owner's actions, deliver its events.
    fn drive_owner(&mut self) {
        while let Some(action) = self.owner.poll_action() {
            match action {
                OwnerAction::BindAndGrant(bg) => {
                    if bg.buffer.len != BUF_LEN || bg.grant.rkey != bg.rkey || bg.grant.len != bg.buffer.len {
                        self.violate(format!("malformed bind-and-grant {bg:?}"));
                    }
                    self.check_held(bg.window, "bind");
                    if bg.rkey >> 8 != (window_index(bg.window) as u32 + 1) {
                        self.violate(format!(
                            "bind of window {} with the key of another {:#x}",
                            bg.window, bg.rkey
                        ));
                    }
                    let bytes = Message::Grant(bg.grant).to_bytes();
                    if self.a_err {
                        self.owner_cq.push_back((bg.send_token, Status::Flushed));
                    } else {
                        self.owner_sq.push_back(OwnerWr::Bind {
                            token: bg.bind_token,
                            window: bg.window,
                            rkey: bg.rkey,
                            buf: bg.buffer.mr,
                        });
                        self.owner_sq.push_back(OwnerWr::Send { token: bg.send_token, bytes });
                    }
                }
                OwnerAction::Invalidate { token, window, rkey } => {
                    self.check_held(window, "LOCAL_INV");
                    if self.a_err {
                        self.owner_cq.push_back((token, Status::Flushed));
                    } else {
                        self.owner_sq.push_back(OwnerWr::LocalInv { token, window, rkey });
                    }
                }
                OwnerAction::FlushQp => {
                    self.fail_a();
                    self.owner.handle_qp_error(at(self.now));
                }
            }
        }
        while let Some(event) = self.owner.poll_event() {
            match event {
                OwnerEvent::WindowUnbound { window, .. } => self.window_back(window),
                OwnerEvent::WindowRetired { window } if self.lending => {
                    let w = window_index(window) as u32;
                    match self.lent.iter().position(|&l| l == w) {
                        Some(i) => {
                            self.lent.swap_remove(i);
                            self.retired.push(w);
                        }
                        None => self.violate(format!("window {window} retired but not lent to the owner")),
                    }
                }
                _ => {}
            }
            if let OwnerEvent::BufferReturned { lease, buffer, .. } = event {
                let b = buffer.mr;
                if self.remote_access_possible(b) {
                    self.violate(format!("buffer {b} returned while a remote READ can reach it"));
                }
                if self.bufs[b as usize].home {
                    self.violate(format!("buffer {b} returned twice"));
                }
                self.bufs[b as usize].home = true;
                self.active.retain(|(l, _)| *l != lease);
            }
            if self.log {
                self.owner_events.push(event);
            }
        }
    }

    /// Lending: the owner names `window` in a work request; it must be one
    /// lent to it (not in the pool, not retired).
    fn check_held(&mut self, window: u32, what: &str) {
        if self.pool.iter().any(|w| w.handle == window)
            || self.retired.contains(&(window_index(window) as u32))
        {
            self.violate(format!("{what} of window {window}, which is not lent to the owner"));
        }
    }

    /// Lending: the owner hands `window` back to the pool. It must be lent
    /// to it, unbound (every bind invalidated once, by the owner), and no
    /// work request or READ of this QP may still use it: another
    /// connection binds it next.
    fn window_back(&mut self, window: Window) {
        let w = window_index(window.handle);
        let Some(i) = self.lent.iter().position(|&l| l as usize == w) else {
            self.violate(format!("window {} handed back but not lent", window.handle));
            return;
        };
        self.lent.swap_remove(i);
        if !matches!(self.windows[w], WinState::Invalid { rkey } if rkey == window.rkey) {
            self.violate(format!(
                "window {} handed back in state {:?} (rkey {:#x})",
                window.handle, self.windows[w], window.rkey
            ));
        }
        if self.binds[w] != self.invalidations[w] {
            self.violate(format!("window {} handed back with a bind not invalidated", window.handle));
        }
        let queued = self.owner_sq.iter().any(|wr| match wr {
            OwnerWr::Bind { window: x, .. } | OwnerWr::LocalInv { window: x, .. } => *x == window.handle,
            OwnerWr::Send { .. } => false,
        });
        if queued || self.serving.iter().any(|s| s.window == window.handle) {
            self.violate(format!("window {} handed back while this QP still uses it", window.handle));
        }
        self.pool.push(window);
    }

    /// Lending: every window is in the pool, lent, or retired, once.
    pub fn windows_accounted(&self, cfg: &Config) -> bool {
        let Some(n) = cfg.lend else { return true };
        let mut all: Vec<u32> = self.pool.iter().map(|w| window_index(w.handle) as u32).collect();
        all.extend(&self.lent);
        all.extend(&self.retired);
        all.sort_unstable();
        all == (0..n).collect::<Vec<_>>()
    }

    /// B's driver.
    fn drive_reader(&mut self) {
        while let Some(action) = self.reader.poll_action() {
            match action {
                ReaderAction::Read { token, dest, remote_addr, rkey, len } => {
                    if self.b_err {
                        self.reader_cq.push_back((token, Status::Flushed));
                    } else {
                        self.reader_sq.push_back(ReaderWr::Read {
                            token,
                            dest: dest.mr,
                            addr: remote_addr,
                            rkey,
                            len,
                        });
                    }
                }
                ReaderAction::SendRelease(release) => {
                    if !self.b_err {
                        self.reader_sq
                            .push_back(ReaderWr::Send { bytes: Message::Release(release).to_bytes() });
                    }
                }
                ReaderAction::FlushQp => {
                    self.fail_b();
                    self.reader.handle_qp_error(at(self.now));
                }
            }
        }
        while let Some(event) = self.reader.poll_event() {
            match &event {
                ReaderEvent::ReadDone { lease, dest, release, .. } => {
                    let want = self.granted.iter().find(|(l, _)| l == lease).map(|&(_, v)| v);
                    let got = self.dests[dest.mr as usize].data;
                    if want.is_none() || got != want {
                        self.violate(format!(
                            "stale read accepted: lease {lease:?} wanted {want:?} got {got:?}"
                        ));
                    }
                    self.free_dest(dest.mr);
                    if let Some(r) = release {
                        self.responses.push_back(*r);
                    }
                }
                ReaderEvent::Declined { dest, release, .. } => {
                    self.free_dest(dest.mr);
                    if let Some(r) = release {
                        self.responses.push_back(*r);
                    }
                }
                ReaderEvent::ReadFailed { dest, .. } => self.free_dest(dest.mr),
                ReaderEvent::ReadTimedOut { .. } | ReaderEvent::ConnectionLost => {}
            }
            if self.log {
                self.reader_events.push(event);
            }
        }
    }

    fn free_dest(&mut self, d: u32) {
        if self.read_into_possible(d) {
            self.violate(format!("destination {d} handed back while a READ can still write it"));
        }
        if self.dests[d as usize].free {
            self.violate(format!("destination {d} handed back twice"));
        }
        self.dests[d as usize].free = true;
    }

    pub fn all_buffers_home(&self) -> bool {
        self.bufs.iter().all(|b| b.home)
    }

    /// Every bind of every window was invalidated exactly once, or A's QP died.
    pub fn binds_all_invalidated(&self) -> bool {
        self.a_err || self.binds.iter().zip(&self.invalidations).all(|(b, i)| b == i)
    }

    pub fn never_over_invalidated(&self) -> bool {
        self.binds.iter().zip(&self.invalidations).all(|(b, i)| i <= b)
    }

    // ---- helpers for scripted tests ----

    /// Run every enabled step except time, faults and user requests, in a
    /// fixed order, until none is left.
    pub fn settle(&mut self, cfg: &Config) {
        let quiet = |s: &Step| {
            matches!(
                s,
                Step::OwnerSq
                    | Step::OwnerCq
                    | Step::Serve
                    | Step::ToOwner
                    | Step::ReaderSq
                    | Step::ReaderCq
                    | Step::ToReader
                    | Step::Respond
                    | Step::OwnerTimer
                    | Step::ReaderTimer
                    | Step::OwnerNoticesErr
                    | Step::ReaderNoticesErr
                    // A driver that took its connection down destroys the QP.
                    | Step::OwnerDestroysQp
            )
        };
        for _ in 0..10_000 {
            let mut steps = Vec::new();
            self.enabled(cfg, &mut steps);
            match steps.into_iter().find(quiet) {
                Some(s) => self.step(cfg, s),
                None => return,
            }
        }
        panic!("world did not settle");
    }

    /// Advance the clock by `ticks`, settling after each tick.
    pub fn advance(&mut self, cfg: &Config, ticks: u32) {
        for _ in 0..ticks {
            self.now += 1;
            self.settle(cfg);
        }
    }
}

/// A grant as a peer would see it, for tests that forge messages.
pub fn decode_grant(bytes: &[u8]) -> Option<Grant> {
    match Message::decode(bytes) {
        Ok(Message::Grant(g)) => Some(g),
        _ => None,
    }
}
