//! The confirm engine of a connection: `mwcap-fallback`'s client (on a
//! client) or server (on a server), which runs the confirm protocol for
//! every direction that uses it, with the connection's bookkeeping around it.

use std::collections::VecDeque;
use std::time::Duration;

use mwcap_fallback as fb;

use super::super::config::{Config, Role};
use super::super::pool::Layout;
use super::ids::{id_map, IdMap};
use crate::backend::MrInfo;

/// `$body` with `$e` bound to the engine that runs, client or server
/// (the two share the methods the connection calls).
macro_rules! each {
    ($engine:expr, $e:ident => $body:expr) => {
        match $engine {
            $crate::conn::proto::confirm::Engine::Client($e) => $body,
            $crate::conn::proto::confirm::Engine::Server($e) => $body,
        }
    };
}

/// The engine of this side's role.
pub(super) enum Engine {
    Client(fb::Client),
    Server(fb::Server),
}

pub(super) struct ConfirmEngine {
    pub(super) engine: Engine,
    /// Our buffers registered with the engine (when we own a direction
    /// under confirm), by data slot.
    pub(super) bufs: Vec<fb::BufferId>,
    /// Engine buffer → data slot.
    pub(super) slot_of: IdMap<fb::BufferId, u32>,
    /// Engine message id → our message id.
    pub(super) msgs: IdMap<fb::MsgId, u64>,
    /// Server: messages whose offer expired, with when (their `msgs`
    /// entries go once the client can no longer retry).
    pub(super) expired: VecDeque<(fb::MsgId, Duration)>,
    /// Server: each request whose reply was offered, by its id, kept as
    /// long as the `msgs` entry of the client's fetch: a client that reads
    /// a stale reply asks again, and the request then comes again with
    /// its header and trace id ([`Event::ReplyAgain`]). (The map's type is
    /// the connection's `requests`'.)
    ///
    /// [`Event::ReplyAgain`]: super::super::types::Event::ReplyAgain
    pub(super) kept: IdMap<u64, super::Request>,
    /// READ token → destination slot.
    pub(super) reads: IdMap<u64, u32>,
    /// READs waiting for a free destination.
    pub(super) pending_reads: VecDeque<fb::ReadRequest>,
}

impl ConfirmEngine {
    /// The engine for `role`; when `owns` (we expose a direction under
    /// confirm), every data buffer is registered with it: where it is in
    /// `data`, or, on a shared pool (`None`), pointed at the pool buffer
    /// behind its slot each time it is exposed (`set_buffer_region`).
    pub(super) fn new(
        role: Role,
        cfg: &Config,
        layout: &Layout,
        owns: bool,
        data: Option<&MrInfo>,
    ) -> ConfirmEngine {
        let mut fcfg = fb::Config::default();
        fcfg.hold_timeout = cfg.lease_time;
        fcfg.request_timeout = cfg.call_timeout;
        // An exposure is read and confirmed within a lease of its arrival,
        // however long its READ waits for a buffer (as a window grant is
        // read within its lease or declined).
        fcfg.confirm_timeout = cfg.lease_time;
        fcfg.max_attempts = cfg.max_attempts;
        fcfg.max_read_len = layout.largest();
        let slots = layout.slots();
        // Sized for a fetch or request per buffer: the first burst of
        // calls allocates no more than later ones.
        let mut engine = match role {
            Role::Client => {
                let mut c = fb::Client::new(fcfg);
                c.reserve(slots as usize);
                Engine::Client(c)
            }
            Role::Server => {
                let mut s = fb::Server::new(fcfg);
                s.reserve(slots as usize);
                Engine::Server(s)
            }
        };
        let mut bufs = Vec::new();
        let mut slot_of = id_map(slots as usize);
        if owns {
            // One buffer per slot, then one per possible user-range
            // exposure, pointed at its range when it is exposed
            // (`set_buffer_region`).
            for slot in 0..slots + cfg.region_exposures {
                let region = match data.filter(|_| slot < slots) {
                    Some(data) => {
                        fb::Region::new(data.addr + layout.offset(slot), layout.size(slot), data.rkey)
                    }
                    None => fb::Region::new(0, 0, 0),
                };
                let id = each!(&mut engine, e => e.add_buffer(region));
                bufs.push(id);
                slot_of.insert(id, slot);
            }
        }
        ConfirmEngine {
            engine,
            bufs,
            slot_of,
            msgs: id_map(2 * cfg.ctrl_slots as usize),
            expired: VecDeque::new(),
            kept: id_map(if role == Role::Server { 2 * cfg.ctrl_slots as usize } else { 0 }),
            reads: id_map(slots as usize),
            pending_reads: VecDeque::with_capacity(slots as usize),
        }
    }

    /// The client engine (on a client).
    pub(super) fn client(&mut self) -> Option<&mut fb::Client> {
        match &mut self.engine {
            Engine::Client(c) => Some(c),
            Engine::Server(_) => None,
        }
    }

    /// The server engine (on a server).
    pub(super) fn server(&mut self) -> Option<&mut fb::Server> {
        match &mut self.engine {
            Engine::Server(s) => Some(s),
            Engine::Client(_) => None,
        }
    }

    /// Client: the length of the READ for fetch `fm` if it waits for a
    /// free destination.
    pub(super) fn waiting_read(&self, fm: fb::MsgId) -> Option<u32> {
        let Engine::Client(c) = &self.engine else { return None };
        let rr = self.pending_reads.iter().find(|rr| c.fetch_of_read(rr.token()) == Some(fm))?;
        Some(rr.remote().len())
    }

    /// Whether READ `token`, waiting for a destination, has no more than
    /// `margin` left before its request is due (a server's: an exposure is
    /// read and confirmed within a lease of its arrival), so that starting
    /// it now would only take a buffer for an answer that cannot come in
    /// time. It then keeps waiting until its request ends.
    pub(super) fn too_late(&self, token: fb::ReadToken, now: Duration, margin: Duration) -> bool {
        match &self.engine {
            Engine::Server(s) => s.read_deadline(token).is_some_and(|d| d.saturating_sub(now) <= margin),
            Engine::Client(_) => false,
        }
    }

    pub(super) fn is_buffer_free(&self, slot: u32) -> bool {
        let Some(&id) = self.bufs.get(slot as usize) else { return false };
        each!(&self.engine, e => e.is_buffer_free(id))
    }

    /// Whether the connection's pump has nothing of the engine's to carry
    /// out: no action or event queued, no READ waiting for a destination,
    /// no expired offer whose entries are to go.
    pub(super) fn idle(&self) -> bool {
        let quiet = each!(&self.engine, e => !e.has_output());
        quiet && self.pending_reads.is_empty() && self.expired.is_empty()
    }

    pub(super) fn poll_action(&mut self) -> Option<fb::Action> {
        each!(&mut self.engine, e => e.poll_action())
    }

    pub(super) fn poll_timeout(&self) -> Option<Duration> {
        each!(&self.engine, e => e.poll_timeout())
    }

    /// Fire the engine's timers if one is due.
    pub(super) fn handle_timeout(&mut self, now: Duration) {
        if self.poll_timeout().is_some_and(|t| t <= now) {
            each!(&mut self.engine, e => e.handle_timeout(now))
        }
    }
}
