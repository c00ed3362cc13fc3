//! Two sans-IO connections run against each other with no `Nic` at all:
//! this test carries out their commands by hand on plain byte vectors (a
//! SEND lands in the peer's oldest posted receive, a READ copies the
//! peer's bytes through a window or the region key, a bind and an
//! invalidation edit a table of valid windows), and checks the protocols'
//! promises as it goes:
//!
//! - a READ only reaches bytes a valid window (mw) or the region (confirm)
//!   covers, and never a buffer its owner's user holds (mw);
//! - nothing is DMA'd into a buffer the user holds;
//! - every window bind is invalidated exactly once, and an invalidation of
//!   a window that is not bound never happens (it crashes rxe);
//! - a grant's bind goes out in the same post as the SEND carrying it;
//! - payloads arrive intact, and every buffer comes back.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use mwcap::backend::{
    Completion, Memory, MrId, MrInfo, MwId, MwInfo, NicError, SendWr, Sge, WcOpcode, WcStatus,
};
use mwcap::conn::frame::{INITIAL_CREDITS, MAX_FRAME, MIN_START_CREDITS};
use mwcap::conn::proto::{Command, Connection, DataMemory, Resources};
use mwcap::conn::{
    Buf, CallError, CallId, Config, Event, Keepalive, LossReason, PayloadError, Policies, Policy, RequestId,
    Role, UseError,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const BUFFERS: u32 = 4;
const SIZE: u32 = 4096;
const SLOTS: u32 = 8;

struct Side {
    conn: Connection,
    ctrl: Vec<u8>,
    data: std::sync::Arc<Memory>,
    addr: u64,
    rkey: u32,
    owns_mw: bool,
    recvs: VecDeque<(u64, Sge)>,
    cq: VecDeque<Completion>,
    /// Valid windows over our data: rkey → byte range.
    windows: HashMap<u32, std::ops::Range<usize>>,
    binds: u64,
    /// The consumer key (low 8 bits) of each bind, in order.
    keys: Vec<u8>,
    invalidations: u64,
    /// Answer a READ of a window that is not bound with REM_ACCESS_ERR (as
    /// a NIC does) instead of failing the test.
    refuse_unbound_reads: bool,
}

impl Side {
    fn with(role: Role, policies: Policies, addr: u64, rkey: u32, keepalive: Option<Keepalive>) -> Side {
        Side::configured(role, policies, addr, rkey, |c| c.keepalive = keepalive)
    }

    fn configured(
        role: Role,
        policies: Policies,
        addr: u64,
        rkey: u32,
        tweak: impl FnOnce(&mut Config),
    ) -> Side {
        let mut cfg = Config::default();
        cfg.buffers = BUFFERS;
        cfg.buffer_size = SIZE;
        cfg.region_exposures = 0; // windows for pool buffers only (no user regions here)
        cfg.ctrl_slots = SLOTS;
        tweak(&mut cfg);
        cfg.check().expect("a config that works");
        let owns_mw = policies.directions(role).0 == Policy::Mw;
        let data = MrInfo { id: MrId::from_raw(2), addr, len: (BUFFERS * SIZE) as usize, lkey: 2, rkey };
        let memory = Memory::zeroed(data.len, 8).unwrap();
        let windows = if owns_mw {
            (0..BUFFERS).map(|i| MwInfo { id: MwId::from_raw(10 + i), rkey: (0x100 + i) << 8 }).collect()
        } else {
            vec![]
        };
        let conn = Connection::new(
            role,
            policies,
            cfg,
            Resources { ctrl: MrId::from_raw(1), data: DataMemory::Region(data, memory.clone()), windows },
        );
        Side {
            conn,
            ctrl: vec![0; MAX_FRAME * 2 * SLOTS as usize],
            data: memory,
            addr,
            rkey,
            owns_mw,
            recvs: VecDeque::new(),
            cq: VecDeque::new(),
            windows: HashMap::new(),
            binds: 0,
            keys: Vec::new(),
            invalidations: 0,
            refuse_unbound_reads: false,
        }
    }

    fn done(&mut self, wr_id: u64, opcode: WcOpcode, byte_len: u32) {
        self.done_with(wr_id, opcode, byte_len, WcStatus::Success)
    }

    fn done_with(&mut self, wr_id: u64, opcode: WcOpcode, byte_len: u32, status: WcStatus) {
        self.cq.push_back(Completion {
            wr_id,
            status,
            opcode,
            byte_len,
            invalidated_rkey: None,
            qpn: 0,
            vendor_err: 0,
        });
    }
}

/// Carry out `me`'s send-queue chain; `peer` is the other side.
fn post_send(me: &mut Side, peer: &mut Side, chain: &[SendWr], chains_with_bind: &mut u64) {
    for (i, w) in chain.iter().enumerate() {
        match *w {
            SendWr::BindMw { wr_id, signaled, rkey, offset, len, .. } => {
                assert!(me.owns_mw, "a bind from a side that owns no windows");
                assert!(
                    matches!(chain.get(i + 1), Some(SendWr::Send { .. })),
                    "a grant's bind goes out chained with its SEND (one doorbell)"
                );
                *chains_with_bind += 1;
                assert!(
                    !me.windows.values().any(|r| r.start < offset + len && offset < r.end),
                    "overlapping binds"
                );
                me.windows.insert(rkey, offset..offset + len);
                me.binds += 1;
                me.keys.push(rkey as u8);
                if signaled {
                    me.done(wr_id, WcOpcode::BindMw, 0);
                }
            }
            SendWr::Send { wr_id, sge, .. } => {
                let s = sge[0];
                let bytes = me.ctrl[s.offset..s.offset + s.len as usize].to_vec();
                let (rid, rsge) = peer.recvs.pop_front().expect("the peer keeps receives posted");
                assert!(bytes.len() <= rsge.len as usize);
                peer.ctrl[rsge.offset..rsge.offset + bytes.len()].copy_from_slice(&bytes);
                peer.done(rid, WcOpcode::Recv, bytes.len() as u32);
                me.done(wr_id, WcOpcode::Send, 0);
            }
            SendWr::Read { wr_id, signaled, local, remote_addr, rkey } => {
                let l = local[0];
                let start = (remote_addr - peer.addr) as usize;
                let range = start..start + l.len as usize;
                if peer.owns_mw {
                    let Some(w) = peer.windows.get(&rkey) else {
                        // As a NIC answers a READ of an invalidated window.
                        assert!(peer.refuse_unbound_reads, "a READ through a window that is not bound");
                        me.done_with(wr_id, WcOpcode::RdmaRead, 0, WcStatus::RemAccessErr);
                        continue;
                    };
                    assert!(w.start <= range.start && range.end <= w.end, "a READ outside its window");
                } else {
                    assert_eq!(rkey, peer.rkey, "a READ with a key that is not the region's");
                }
                let mut bytes = Vec::new();
                let met = peer.data.dma_read(range.start, range.len(), &mut bytes).unwrap();
                assert!(!met || !peer.owns_mw, "under mw, a READ of a buffer its owner's user holds");
                let met = me.data.dma_write(l.offset, &bytes).unwrap();
                assert!(!met, "a READ landed in a buffer a handle holds");
                if signaled {
                    me.done(wr_id, WcOpcode::RdmaRead, bytes.len() as u32);
                }
            }
            SendWr::LocalInv { wr_id, rkey, .. } => {
                assert!(
                    me.windows.remove(&rkey).is_some(),
                    "invalidating a window that is not bound (crashes rxe)"
                );
                me.invalidations += 1;
                me.done(wr_id, WcOpcode::LocalInv, 0);
            }
            other => panic!("mwcap posted {other:?}"),
        }
    }
}

struct Pair {
    c: Side,
    s: Side,
    now: Duration,
    chains_with_bind: u64,
    /// The server takes no more turns (its receives still land).
    frozen_server: bool,
    /// The client takes no more turns (its receives still land).
    frozen_client: bool,
    /// A side may go down (the test expects it).
    allow_down: bool,
}

impl Pair {
    fn new(policies: Policies) -> Pair {
        Pair::with(policies, None)
    }

    fn with(policies: Policies, keepalive: Option<Keepalive>) -> Pair {
        let c = Side::with(Role::Client, policies, 0x1000_0000, 0x77, keepalive);
        let s = Side::with(Role::Server, policies, 0x2000_0000, 0x88, keepalive);
        Pair::started(c, s)
    }

    /// A pair whose sides hold `client` and `server` receives for their
    /// peers at the start (`Config::start_credits`), each told the other's.
    fn with_start_credits(policies: Policies, client: u32, server: u32) -> Pair {
        let c = Side::configured(Role::Client, policies, 0x1000_0000, 0x77, |c| c.start_credits = client);
        let s = Side::configured(Role::Server, policies, 0x2000_0000, 0x88, |c| c.start_credits = server);
        Pair::started(c, s)
    }

    fn started(mut c: Side, mut s: Side) -> Pair {
        let (cc, sc) = (c.conn.config().start_credits, s.conn.config().start_credits);
        c.conn.start(sc);
        s.conn.start(cc);
        let mut p = Pair {
            c,
            s,
            now: Duration::ZERO,
            chains_with_bind: 0,
            frozen_server: false,
            frozen_client: false,
            allow_down: false,
        };
        p.settle();
        p
    }

    /// Carry out commands and deliver completions until both sides are quiet.
    fn settle(&mut self) {
        loop {
            let mut busy = false;
            for client in [true, false] {
                if (!client && self.frozen_server) || (client && self.frozen_client) {
                    continue;
                }
                let (me, peer) = if client { (&mut self.c, &mut self.s) } else { (&mut self.s, &mut self.c) };
                let (allow_down, chains_with_bind) = (self.allow_down, &mut self.chains_with_bind);
                let (mut down, mut posted) = (false, Vec::new());
                let Side { conn, ctrl, recvs, .. } = &mut *me;
                conn.drain_commands(|cmd, staged| {
                    busy = true;
                    match cmd {
                        Command::PostRecv { wr_id, sge } => recvs.push_back((*wr_id, *sge)),
                        Command::PostSend { chain, frame } => {
                            if let Some(f) = frame {
                                ctrl[f.offset..f.offset + staged.len()].copy_from_slice(staged);
                            }
                            posted.push(*chain);
                        }
                        Command::SetQpError => down = true,
                    }
                    Ok(())
                });
                assert!(!down || allow_down, "a healthy connection went down: {:?}", me.conn.is_down());
                for chain in posted.drain(..) {
                    post_send(me, peer, chain.as_slice(), chains_with_bind);
                }
                while let Some(c) = me.cq.pop_front() {
                    busy = true;
                    let frame = match me.conn.received_frame(&c) {
                        Some((offset, len)) => me.ctrl[offset..offset + len].to_vec(),
                        None => vec![],
                    };
                    me.conn.handle_completion(self.now, &c, &frame);
                }
            }
            if !busy {
                break;
            }
        }
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed as usize * 31 + i * 7) as u8).collect()
}

/// `calls` calls, each with a request and a reply payload, checked byte
/// for byte; afterwards every buffer is back and every window invalidated.
fn run_calls(policies: Policies, calls: u64) -> Pair {
    run_calls_on(Pair::new(policies), policies, calls)
}

/// [`run_calls`] on a pair already made, with `policies`.
fn run_calls_on(mut p: Pair, policies: Policies, calls: u64) -> Pair {
    let (mut req_bytes, mut rep_bytes) = (0u64, 0u64);
    for i in 0..calls {
        p.now += Duration::from_micros(10);
        let req_len = 1 + (i as usize * 37) % SIZE as usize;
        let rep_len = 1 + (i as usize * 91) % SIZE as usize;
        req_bytes += req_len as u64;
        rep_bytes += rep_len as u64;
        let mut b = p.c.conn.alloc().expect("a free client buffer");
        b.copy_from(&pattern(i, req_len)).unwrap();
        let header = i.to_le_bytes();
        let call = p.c.conn.call(p.now, &header, Some(b)).expect("call accepted");
        p.settle();
        let mut replied = false;
        while let Some(ev) = p.s.conn.poll_event() {
            match ev {
                Event::Request { req, header: h, data, .. } => {
                    assert_eq!(h, header);
                    let data = data.expect("the request payload");
                    assert_eq!(data.to_vec(), pattern(i, req_len), "request payload of call {i}");
                    p.s.conn.free(data);
                    let mut out = p.s.conn.alloc().expect("a free server buffer");
                    out.copy_from(&pattern(i + 1000, rep_len)).unwrap();
                    p.s.conn.reply(p.now, req, 0, b"ok", Some(out)).expect("reply accepted");
                    replied = true;
                }
                Event::BufferReturned(b) => p.s.conn.free(b),
                other => panic!("server: {other:?}"),
            }
        }
        assert!(replied, "call {i} reached the server");
        p.settle();
        let mut got = false;
        while let Some(ev) = p.c.conn.poll_event() {
            match ev {
                Event::Reply { call: c, status, header: h, data } => {
                    assert_eq!((c, status, &h[..]), (call, 0, &b"ok"[..]));
                    let data = data.expect("the reply payload");
                    assert_eq!(data.to_vec(), pattern(i + 1000, rep_len), "reply payload of call {i}");
                    p.c.conn.free(data);
                    got = true;
                }
                Event::BufferReturned(b) => p.c.conn.free(b),
                other => panic!("client: {other:?}"),
            }
        }
        assert!(got, "call {i} got its reply");
        // Returns that finish after the reply (the last release's invalidation).
        p.settle();
        for side in [&mut p.c, &mut p.s] {
            while let Some(ev) = side.conn.poll_event() {
                match ev {
                    Event::BufferReturned(b) => side.conn.free(b),
                    other => panic!("{other:?}"),
                }
            }
        }
    }
    assert_eq!(p.c.conn.free_buffers(), BUFFERS as usize, "every client buffer is back");
    assert_eq!(p.s.conn.free_buffers(), BUFFERS as usize, "every server buffer is back");
    p.settle();
    // The counters agree with what the test did.
    let (c, s) = (p.c.conn.stats(), p.s.conn.stats());
    assert_eq!((c.calls, c.replies_received, c.calls_failed), (calls, calls, 0));
    assert_eq!((s.requests, s.replies_sent, s.requests_dropped), (calls, calls, 0));
    assert_eq!((c.bytes_exposed, s.bytes_read), (req_bytes, req_bytes), "request payload bytes");
    assert_eq!((s.bytes_exposed, c.bytes_read), (rep_bytes, rep_bytes), "reply payload bytes");
    assert_eq!((c.stale_reads, s.stale_reads, c.error_completions, s.error_completions), (0, 0, 0, 0));
    assert_eq!((c.buffers_free, s.buffers_free), (BUFFERS, BUFFERS));
    for (st, owns_mw, reads_mw) in [
        (c, policies.request == Policy::Mw, policies.reply == Policy::Mw),
        (s, policies.reply == Policy::Mw, policies.request == Policy::Mw),
    ] {
        match st.lease_owner {
            Some(o) => {
                assert!(owns_mw);
                assert_eq!((o.grants, o.released, o.invalidations, o.expired), (calls, calls, calls, 0));
            }
            None => assert!(!owns_mw),
        }
        match st.lease_reader {
            Some(r) => {
                assert!(reads_mw);
                assert_eq!((r.reads, r.reads_done, r.reads_failed), (calls, calls, 0));
            }
            None => assert!(!reads_mw),
        }
    }
    for side in [&mut p.c, &mut p.s] {
        assert!(side.windows.is_empty(), "every bound window was invalidated");
        assert_eq!(side.binds, side.invalidations, "each bind invalidated exactly once");
        assert!(!side.data.is_held(), "no buffer left held");
    }
    p
}

#[test]
fn mw_calls_run_without_a_nic() {
    let p = run_calls(Policies::both(Policy::Mw), 300);
    // One bind per payload, each chained with the SEND of its grant.
    assert_eq!(p.c.binds, 300);
    assert_eq!(p.s.binds, 300);
    assert_eq!(p.chains_with_bind, 600);
}

/// A window's consumer key is drawn from the connection's own sequence:
/// two connections made with the default config bind with different keys
/// (a peer of one learns nothing of the other's), and so do the two sides
/// of one; a seed set in the config repeats its sequence.
#[test]
fn each_connection_binds_with_keys_of_its_own_unless_seeded() {
    // `None`: the config's default, untouched.
    let keys = |seed: Option<u64>| {
        let mw = Policies::both(Policy::Mw);
        let seeded = |c: &mut Config| c.seed = seed.or(c.seed);
        let c = Side::configured(Role::Client, mw, 0x1000_0000, 0x77, seeded);
        let s = Side::configured(Role::Server, mw, 0x2000_0000, 0x88, seeded);
        let p = run_calls_on(Pair::started(c, s), mw, 16);
        (p.c.keys, p.s.keys)
    };
    let (a, b) = (keys(None), keys(None));
    assert_eq!((a.0.len(), a.1.len()), (16, 16), "a bind per payload");
    assert_ne!(a.0, b.0, "two clients bound with the same consumer keys");
    assert_ne!(a.1, b.1, "two servers bound with the same consumer keys");
    assert_ne!(a.0, a.1, "the two sides of a connection bound with the same consumer keys");
    assert_eq!(keys(Some(7)), keys(Some(7)), "a seeded connection repeats its keys");
}

#[test]
fn confirm_calls_run_without_a_nic() {
    let p = run_calls(Policies::both(Policy::Confirm), 300);
    assert_eq!(p.c.binds + p.s.binds, 0);
}

#[test]
fn mixed_policies_run_without_a_nic() {
    run_calls(Policies { request: Policy::Mw, reply: Policy::Confirm }, 100);
    run_calls(Policies { request: Policy::Confirm, reply: Policy::Mw }, 100);
}

/// A server holds at most `Config::max_requests` unanswered requests of a
/// connection: one more is refused unread with a busy answer, whatever it
/// carries, and its call fails with `CallError::Busy`. Its payload is never
/// read (a window grant is released unread, a confirm exposure left
/// alone) and comes back to the caller; a confirm fetch of its reply is
/// neither kept nor answered. Once the server answers one, calls go
/// through again, and nothing leaks: every buffer back, every bind
/// invalidated once.
#[test]
fn a_request_past_max_requests_is_refused_unread_and_the_server_keeps_nothing_of_it() {
    for policies in [
        Policies::both(Policy::Mw),
        Policies::both(Policy::Confirm),
        Policies { request: Policy::Mw, reply: Policy::Confirm },
        Policies { request: Policy::Confirm, reply: Policy::Mw },
    ] {
        let c = Side::with(Role::Client, policies, 0x1000_0000, 0x77, None);
        let s = Side::configured(Role::Server, policies, 0x2000_0000, 0x88, |c| c.max_requests = 2);
        let mut p = Pair::started(c, s);
        let call_with = |p: &mut Pair, seed: u64, payload: bool| {
            p.now += Duration::from_micros(10);
            let data = payload.then(|| {
                let mut b = p.c.conn.alloc().expect("a free client buffer");
                b.copy_from(&pattern(seed, 100)).unwrap();
                b
            });
            let call = p.c.conn.call(p.now, &seed.to_le_bytes(), data).expect("call accepted");
            p.settle();
            call
        };
        let server_requests = |p: &mut Pair| {
            let mut reqs = Vec::new();
            while let Some(ev) = p.s.conn.poll_event() {
                match ev {
                    Event::Request { req, header, data, .. } => {
                        if let Some(d) = data {
                            let seed = u64::from_le_bytes(header[..8].try_into().unwrap());
                            assert_eq!(d.to_vec(), pattern(seed, 100), "{policies:?}");
                            p.s.conn.free(d);
                        }
                        reqs.push(req);
                    }
                    Event::BufferReturned(b) => p.s.conn.free(b),
                    other => panic!("server, {policies:?}: {other:?}"),
                }
            }
            reqs
        };
        // Two requests are held, unanswered.
        let first = [call_with(&mut p, 1, true), call_with(&mut p, 2, false)];
        let held = server_requests(&mut p);
        assert_eq!(held.len(), 2, "{policies:?}");
        // Two more, with and without a payload, are refused unread.
        let refused = [call_with(&mut p, 3, true), call_with(&mut p, 4, false)];
        p.settle();
        assert!(server_requests(&mut p).is_empty(), "{policies:?}: a refused request reached the user");
        let mut failed = Vec::new();
        while let Some(ev) = p.c.conn.poll_event() {
            match ev {
                Event::CallFailed { call, error } => {
                    assert_eq!(error, CallError::Busy { limit: 2 }, "{policies:?}");
                    failed.push(call);
                }
                Event::BufferReturned(b) => p.c.conn.free(b),
                other => panic!("client, {policies:?}: {other:?}"),
            }
        }
        assert_eq!(failed, refused, "{policies:?}");
        let st = p.s.conn.stats();
        assert_eq!((st.requests, st.requests_busy, st.bytes_read), (2, 2, 100), "{policies:?}");
        // The refused payload was never read, and it is the caller's again;
        // under mw call 1's window waits for its release (on the reply).
        let out = usize::from(policies.request == Policy::Mw);
        assert_eq!(
            p.c.conn.free_buffers(),
            BUFFERS as usize - out,
            "{policies:?}: only call 1's payload is out"
        );
        // An answer makes room: the next call goes through.
        p.s.conn.reply(p.now, held[0], 0, b"a", None).expect("reply");
        p.settle();
        let next = call_with(&mut p, 5, true);
        let more = server_requests(&mut p);
        assert_eq!(more.len(), 1, "{policies:?}");
        for r in [held[1], more[0]] {
            p.s.conn.reply(p.now, r, 0, b"a", None).expect("reply");
            p.settle();
        }
        let mut replied = Vec::new();
        for _ in 0..3 {
            p.settle();
            while let Some(ev) = p.c.conn.poll_event() {
                match ev {
                    Event::Reply { call, .. } => replied.push(call),
                    Event::BufferReturned(b) => p.c.conn.free(b),
                    other => panic!("client, {policies:?}: {other:?}"),
                }
            }
            while let Some(ev) = p.s.conn.poll_event() {
                match ev {
                    Event::BufferReturned(b) => p.s.conn.free(b),
                    other => panic!("server, {policies:?}: {other:?}"),
                }
            }
        }
        assert_eq!(replied, [first[0], first[1], next], "{policies:?}");
        assert!(p.c.conn.is_down().is_none() && p.s.conn.is_down().is_none(), "{policies:?}");
        // Nothing the client sent about the refused calls names what the
        // server never kept (a refusal of the fetch did).
        assert_eq!(p.s.conn.confirm_violations(), 0, "{policies:?}");
        assert_eq!(p.c.conn.confirm_violations(), 0, "{policies:?}");
        assert_eq!(p.c.conn.free_buffers(), BUFFERS as usize, "{policies:?}: every client buffer is back");
        assert_eq!(p.s.conn.free_buffers(), BUFFERS as usize, "{policies:?}: every server buffer is back");
        for side in [&p.c, &p.s] {
            assert!(side.windows.is_empty(), "{policies:?}: every bound window was invalidated");
            assert_eq!(side.binds, side.invalidations, "{policies:?}: each bind invalidated once");
        }
    }
}

/// Under confirm a client that read a stale reply asks for its data
/// again, and the request comes back to the server: while
/// `Config::max_requests` are unanswered that is refused too (a `Busy`
/// answer, the fetch refused), as a new request would be, and the bound
/// holds.
#[test]
fn a_stale_reply_asked_again_past_max_requests_is_refused_busy() {
    let c = Side::with(Role::Client, Policies::both(Policy::Confirm), 0x1000_0000, 0x77, None);
    let s = Side::configured(Role::Server, Policies::both(Policy::Confirm), 0x2000_0000, 0x88, |c| {
        c.max_requests = 2
    });
    let mut p = Pair::started(c, s);
    let lease = p.s.conn.config().lease_time;
    let requests = |p: &mut Pair| {
        let mut reqs = Vec::new();
        while let Some(ev) = p.s.conn.poll_event() {
            match ev {
                Event::Request { req, .. } => reqs.push(req),
                Event::BufferReturned(b) => p.s.conn.free(b),
                other => panic!("server: {other:?}"),
            }
        }
        reqs
    };
    // A and B reach the server.
    let a = p.c.conn.call(p.now, b"A", None).unwrap();
    let _b = p.c.conn.call(p.now, b"B", None).unwrap();
    p.settle();
    let held = requests(&mut p);
    assert_eq!(held.len(), 2);
    // A is answered with a payload while the client takes no turns; C is
    // called meanwhile; the server's hold on A's payload ends before the
    // client reads it.
    p.frozen_client = true;
    let mut out = p.s.conn.alloc().unwrap();
    out.copy_from(b"the reply of A").unwrap();
    p.s.conn.reply(p.now, held[0], 0, b"a", Some(out)).unwrap();
    p.settle();
    let _c = p.c.conn.call(p.now, b"C", None).unwrap();
    p.now += lease + Duration::from_millis(1);
    p.s.conn.handle_timeout(p.now);
    p.settle();
    // The client runs: C reaches the server (two unanswered again), the
    // client's read of A is stale, and its fetch again is refused.
    p.frozen_client = false;
    p.settle();
    p.c.conn.handle_timeout(p.now);
    p.s.conn.handle_timeout(p.now);
    p.settle();
    assert_eq!(requests(&mut p).len(), 1, "C");
    let mut failed = Vec::new();
    while let Some(ev) = p.c.conn.poll_event() {
        match ev {
            Event::CallFailed { call, error } => failed.push((call, error)),
            Event::BufferReturned(b) => p.c.conn.free(b),
            other => panic!("client: {other:?}"),
        }
    }
    assert_eq!(failed, [(a, CallError::Busy { limit: 2 })]);
    let st = p.s.conn.stats();
    assert_eq!((st.requests_busy, st.stale_reads, p.c.conn.stats().stale_reads), (1, 0, 1));
    assert!(p.c.conn.is_down().is_none() && p.s.conn.is_down().is_none());
    assert_eq!((p.c.conn.confirm_violations(), p.s.conn.confirm_violations()), (0, 0));
}

#[test]
fn an_expired_lease_is_invalidated_once_and_the_buffer_returns() {
    let mut p = Pair::new(Policies::both(Policy::Mw));
    p.frozen_server = true; // it receives, but never runs again
    let mut b = p.c.conn.alloc().unwrap();
    b.copy_from(b"payload").unwrap();
    let call = p.c.conn.call(p.now, b"h", Some(b)).unwrap();
    p.settle();
    assert_eq!(p.c.windows.len(), 1, "the window is bound while the server sits on the grant");
    assert_eq!(p.c.conn.free_buffers(), BUFFERS as usize - 1);
    // Past the lease (5 s), the window is invalidated and the buffer returns;
    // past the call timeout (10 s), the call fails.
    for _ in 0..30 {
        p.now += Duration::from_secs(1);
        p.c.conn.handle_timeout(p.now);
        p.settle();
    }
    let mut failed = false;
    let mut returned = false;
    while let Some(ev) = p.c.conn.poll_event() {
        match ev {
            Event::CallFailed { call: c, .. } => failed = c == call,
            Event::BufferReturned(b) => {
                returned = true;
                p.c.conn.free(b);
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(failed, "the call timed out");
    assert!(returned, "the buffer came back on the invalidation's completion");
    assert!(p.c.windows.is_empty());
    assert_eq!(p.c.invalidations, 1);
    let st = p.c.conn.stats();
    let o = st.lease_owner.expect("the client owns its direction under mw");
    assert_eq!((o.grants, o.expired, o.invalidations, o.released), (1, 1, 1, 0));
    assert_eq!((st.calls, st.calls_failed, st.buffers_exposed), (1, 1, 0));
    // Telemetry's counts: one exposure, ended, by its expiry.
    assert_eq!((st.exposures, st.exposures_ended, st.expiries, st.late_accesses), (1, 1, 1, 0));
}

/// A READ that meets a window its owner already invalidated (the reader
/// sat on the grant past the lease) fails with REM_ACCESS_ERR: the reader
/// counts a late access, the owner an expiry.
#[test]
fn a_read_of_an_invalidated_window_is_counted_as_a_late_access() {
    let mut p = Pair::new(Policies::both(Policy::Mw));
    p.allow_down = true; // a READ that fails takes the QP to ERR
    p.s.refuse_unbound_reads = true;
    p.c.conn.call(p.now, b"h", None).unwrap();
    p.settle();
    let Some(Event::Request { req, .. }) = p.s.conn.poll_event() else { panic!("no request") };
    p.frozen_client = true; // the grant lands, but the client does not run
    let mut b = p.s.conn.alloc().unwrap();
    b.copy_from(b"reply").unwrap();
    p.s.conn.reply(p.now, req, 0, b"", Some(b)).unwrap();
    p.settle();
    for _ in 0..8 {
        p.now += Duration::from_secs(1);
        p.s.conn.handle_timeout(p.now);
        p.settle();
    }
    let s = p.s.conn.stats();
    assert_eq!((s.exposures, s.exposures_ended, s.expiries), (1, 1, 1), "{s:?}");
    assert!(p.s.windows.is_empty(), "the lease ran out: the window is invalidated");
    p.frozen_client = false;
    p.c.conn.handle_timeout(p.now);
    p.settle();
    let c = p.c.conn.stats();
    assert_eq!(c.late_accesses, 1, "{c:?}");
    assert_eq!(c.lease_reader.map(|r| r.reads_failed), Some(1));
}

const KEEPALIVE: Keepalive =
    Keepalive { interval: Duration::from_millis(100), timeout: Duration::from_millis(300) };

#[test]
fn an_idle_connection_with_keepalive_pings_and_stays_up() {
    let mut p = Pair::with(Policies::both(Policy::Mw), Some(KEEPALIVE));
    for _ in 0..100 {
        p.now += Duration::from_millis(25);
        p.c.conn.handle_timeout(p.now);
        p.s.conn.handle_timeout(p.now);
        p.settle();
    }
    assert!(p.c.conn.is_down().is_none() && p.s.conn.is_down().is_none());
    // 2.5 s of silence at a 100 ms interval: each side pinged about every
    // interval (only a pong answers a ping: the other side's pings do not
    // count) and answered the other's.
    let (c, s) = (p.c.conn.stats(), p.s.conn.stats());
    assert!(c.frames_sent >= 40 && s.frames_sent >= 40, "{c:?} {s:?}");
    assert!(c.frames_sent <= 60 && s.frames_sent <= 60, "{c:?} {s:?}");
    // A call still works afterwards.
    let call = p.c.conn.call(p.now, b"after", None).unwrap();
    p.settle();
    let Some(Event::Request { req, .. }) = p.s.conn.poll_event() else { panic!("no request") };
    p.s.conn.reply(p.now, req, 0, b"", None).unwrap();
    p.settle();
    assert!(matches!(p.c.conn.poll_event(), Some(Event::Reply { call: c, .. }) if c == call));
}

#[test]
fn a_silent_peer_is_declared_dead_after_its_ping_goes_unanswered() {
    let mut p = Pair::with(Policies::both(Policy::Mw), Some(KEEPALIVE));
    p.frozen_server = true;
    p.allow_down = true;
    let mut down_at = None;
    for i in 1..=40 {
        p.now = Duration::from_millis(25 * i);
        p.c.conn.handle_timeout(p.now);
        p.settle();
        if down_at.is_none() && p.c.conn.is_down().is_some() {
            down_at = Some(p.now);
        }
    }
    match p.c.conn.is_down() {
        Some(LossReason::PeerUnresponsive { silent }) => assert!(*silent >= KEEPALIVE.timeout, "{silent:?}"),
        other => panic!("unexpected: {other:?}"),
    }
    // Silence for `interval`, then an unanswered ping for `timeout`.
    let at = down_at.unwrap();
    assert!(at >= KEEPALIVE.interval + KEEPALIVE.timeout, "declared dead at {at:?}");
    assert!(
        at <= KEEPALIVE.interval + KEEPALIVE.timeout + Duration::from_millis(50),
        "declared dead at {at:?}"
    );
    let mut lost = 0;
    while let Some(e) = p.c.conn.poll_event() {
        lost += usize::from(matches!(e, Event::ConnectionLost(LossReason::PeerUnresponsive { .. })));
    }
    assert_eq!(lost, 1);
}

#[test]
fn an_inline_payload_above_inline_max_is_refused_before_anything_is_sent() {
    // A receiver closes the connection on an inline payload above its own
    // inline_max (the same on both sides here), so the sender keeps to its.
    let mut p = Pair::new(Policies::both(Policy::Mw));
    let max = p.c.conn.config().inline_max as usize;
    let sent = p.c.conn.stats().frames_sent;
    let r = p.c.conn.call_inline(p.now, None, b"h", &vec![1; max + 1]).unwrap_err();
    assert_eq!(r.error, UseError::TooLong { len: max + 1, cap: max as u32 });
    assert_eq!(p.c.conn.stats().frames_sent, sent, "nothing sent");
    let call = p.c.conn.call_inline(p.now, None, b"h", &vec![1; max]).unwrap();
    p.settle();
    let Some(Event::Request { req, data: Some(b), .. }) = p.s.conn.poll_event() else { panic!("no request") };
    assert_eq!(b.len(), max);
    p.s.conn.free(b);
    p.s.conn.reply(p.now, req, 0, b"", None).unwrap();
    p.settle();
    assert!(matches!(p.c.conn.poll_event(), Some(Event::Reply { call: c, .. }) if c == call));
}

#[test]
fn without_keepalive_an_idle_connection_sends_nothing() {
    let mut p = Pair::new(Policies::both(Policy::Mw));
    for _ in 0..40 {
        p.now += Duration::from_millis(100);
        p.c.conn.handle_timeout(p.now);
        p.s.conn.handle_timeout(p.now);
        p.settle();
    }
    assert_eq!((p.c.conn.stats().frames_sent, p.s.conn.stats().frames_sent), (0, 0));
    assert_eq!(p.c.conn.poll_timeout(), None, "no timer to wake for");
}

#[test]
fn a_read_queued_for_a_buffer_is_dropped_once_the_connection_is_gone() {
    // Found by tests/torture.rs: a READ waiting for a free destination was
    // started after the QP was destroyed, taking a buffer no completion
    // would ever return.
    for policy in [Policy::Confirm, Policy::Mw] {
        let mut p = Pair::new(Policies::both(policy));
        p.allow_down = true;
        // The client's user holds every buffer: the reply's READ must wait.
        let held: Vec<Buf> = (0..BUFFERS).map(|_| p.c.conn.alloc().unwrap()).collect();
        p.settle();
        p.c.conn.call(p.now, b"h", None).unwrap();
        p.settle();
        let Some(Event::Request { req, .. }) = p.s.conn.poll_event() else { panic!("no request") };
        let mut out = p.s.conn.alloc().unwrap();
        out.copy_from(b"reply payload").unwrap();
        p.s.conn.reply(p.now, req, 0, b"", Some(out)).unwrap();
        p.settle();
        assert_eq!(p.c.conn.busy_buffers(), 0, "{policy:?}: the READ waits for a buffer");
        // The connection goes away with the READ still queued.
        p.c.conn.begin_close(p.now);
        p.c.conn.handle_qp_destroyed(p.now);
        p.c.conn.drain_commands(|_, _| Ok(()));
        // A buffer comes free: nothing may be read into it any more.
        for b in held {
            p.c.conn.free(b);
        }
        p.now += Duration::from_millis(1);
        p.c.conn.handle_timeout(p.now); // any input runs the engines again
        let mut reads = 0;
        p.c.conn.drain_commands(|c, _| {
            if let Command::PostSend { chain, .. } = c {
                reads += chain.as_slice().iter().filter(|w| matches!(w, SendWr::Read { .. })).count();
            }
            Ok(())
        });
        assert_eq!(reads, 0, "{policy:?}: a READ was posted after the QP was destroyed");
        assert_eq!(p.c.conn.busy_buffers(), 0, "{policy:?}: a buffer is stuck");
        assert_eq!(p.c.conn.free_buffers(), BUFFERS as usize);
    }
}

// ---- flow control: a SEND never finds the peer without a posted receive ----
// (`post_send` above panics if one does: the harness is the RNR oracle.)

#[test]
fn a_stalled_server_gets_no_more_frames_than_its_receives_and_the_caller_waits() {
    // The server's start credits are what the client may send before its
    // first grant: the default, and the fewest a side may offer.
    for start in [INITIAL_CREDITS, MIN_START_CREDITS] {
        a_stalled_server_with_start_credits(start);
    }
}

fn a_stalled_server_with_start_credits(start: u32) {
    let mut p = Pair::with_start_credits(Policies::both(Policy::Mw), INITIAL_CREDITS, start);
    p.frozen_server = true; // its receives land, it never reposts them
    let mut sent = 0;
    let refused = loop {
        p.now += Duration::from_micros(10);
        match p.c.conn.call(p.now, b"q", None) {
            Ok(_) => sent += 1,
            Err(r) => break r.error,
        }
        p.settle();
    };
    // One credit stays in reserve for a grant.
    assert_eq!(refused, UseError::NoCredit, "backpressure, not an error or an RNR");
    assert_eq!(sent, start - 1, "start credits {start}");
    // Its receives beyond the start credits were posted but not granted yet.
    assert_eq!(p.s.recvs.len() as u32, SLOTS - (start - 1), "the server's receives not spent");
    assert!(p.c.conn.is_down().is_none());
    assert_eq!(p.c.conn.stats().credit_waits, 1);
    // The server runs again: its grant lets the waiting caller go on.
    p.frozen_server = false;
    p.settle();
    assert!(p.s.conn.stats().credit_frames >= 1, "the server granted its reposted receives");
    let last = p.c.conn.call(p.now, b"q", None).expect("credit came back");
    p.settle();
    let mut reqs = Vec::new();
    while let Some(ev) = p.s.conn.poll_event() {
        if let Event::Request { req, .. } = ev {
            reqs.push(req);
        }
    }
    assert_eq!(reqs.len() as u32, start);
    for r in reqs {
        p.s.conn.reply(p.now, r, 0, b"a", None).expect("reply");
        p.settle();
    }
    let replies: Vec<CallId> = std::iter::from_fn(|| p.c.conn.poll_event())
        .filter_map(|e| match e {
            Event::Reply { call, .. } => Some(call),
            _ => None,
        })
        .collect();
    assert_eq!(replies.len() as u32, start);
    assert_eq!(replies.last(), Some(&last));
}

/// The last credit is kept for a `Credit` frame: a release (or any frame
/// but a grant) that finds one credit left waits for more. Were it sent,
/// two sides each down to their last credit could each spend it on a
/// release at once, each then owing the other a grant it has no credit to
/// send: both stall for good. Here the server stops turning (its receives
/// land, none is reposted), the client spends its credit on calls down to
/// the last, and only then reads a reply payload: its release (a frame of
/// its own; a request payload's rides on the reply) must leave the
/// server's last receive alone, and go once the server runs.
#[test]
fn a_release_leaves_the_last_credit_for_a_grant() {
    let mut p = Pair::new(Policies::both(Policy::Mw));
    let replies = |p: &mut Pair, held: &mut Vec<_>| {
        let mut n = 0;
        while let Some(ev) = p.c.conn.poll_event() {
            if let Event::Reply { data, .. } = ev {
                held.extend(data);
                n += 1;
            }
        }
        n
    };
    // The server answers what it can: each reply with a payload of its
    // own buffers, while it has one free.
    let mut pending: Vec<RequestId> = Vec::new();
    let mut answer = |p: &mut Pair| {
        while let Some(ev) = p.s.conn.poll_event() {
            if let Event::Request { req, .. } = ev {
                pending.push(req);
            }
        }
        while !pending.is_empty() {
            let Some(mut b) = p.s.conn.alloc() else { break };
            b.copy_from(&pattern(7, 100)).unwrap();
            p.s.conn.reply(p.now, pending.remove(0), 0, b"a", Some(b)).expect("credit for the reply");
            p.settle();
        }
    };
    // BUFFERS calls whose reply payloads the client reads and its
    // application keeps: it has no buffer left for the next one.
    let mut held = Vec::new();
    for _ in 0..BUFFERS {
        p.c.conn.call(p.now, b"q", None).expect("credit for the call");
        p.settle();
        answer(&mut p);
    }
    let mut answered = replies(&mut p, &mut held);
    assert_eq!(held.len() as u32, BUFFERS, "every reply payload read");
    p.c.conn.call(p.now, b"q", None).expect("credit for the call");
    p.settle();
    answer(&mut p);
    assert_eq!(replies(&mut p, &mut held), 0, "no buffer for the last reply payload yet");
    // The server stops turning; the client calls until it is down to its
    // last credit.
    p.frozen_server = true;
    let mut calls = BUFFERS + 1;
    loop {
        match p.c.conn.call(p.now, b"q", None) {
            Ok(_) => calls += 1,
            Err(r) => {
                assert_eq!(r.error, UseError::NoCredit, "backpressure");
                break;
            }
        }
        p.settle();
    }
    assert_eq!(p.c.conn.stats().credits, 1, "down to the last credit");
    assert_eq!(p.s.recvs.len(), 1, "one server receive left");
    // A buffer comes free: the client reads the waiting payload, and its
    // release finds one credit.
    let waits = p.c.conn.stats().credit_waits;
    let released = p.s.conn.stats().lease_owner.unwrap().released;
    p.c.conn.free(held.pop().unwrap());
    p.settle();
    answered += replies(&mut p, &mut held);
    assert_eq!(answered, BUFFERS + 1, "the last reply payload was read");
    assert_eq!(p.c.conn.stats().credits, 1, "the release waits: the last credit is the grant's");
    assert_eq!(p.s.recvs.len(), 1, "the server's last receive is left for a grant");
    assert!(p.c.conn.stats().credit_waits > waits, "the release waited for credit");
    assert_eq!(p.s.conn.stats().lease_owner.unwrap().released, released, "nothing released yet");
    // The server runs again: credit comes back, the release goes, and
    // every call is answered.
    p.frozen_server = false;
    p.settle();
    for b in held.drain(..) {
        p.c.conn.free(b);
    }
    for _ in 0..calls {
        answer(&mut p);
        p.settle();
        answered += replies(&mut p, &mut held);
        for b in held.drain(..) {
            p.c.conn.free(b);
        }
    }
    assert_eq!(answered, calls, "every call answered");
    assert_eq!(p.s.conn.stats().lease_owner.unwrap().released, u64::from(calls), "every payload released");
}

/// Random schedules of calls, replies (with and without payloads) and sides
/// that stall and resume: no SEND ever finds the peer's receive queue empty
/// (the harness panics), nothing goes down, and once both sides run again
/// every call completes (credit never deadlocks).
#[test]
fn random_stalls_never_overrun_receives_and_never_deadlock() {
    let (mut waits, mut grants) = (0, 0);
    for seed in 0..60u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let pol = |r: &mut SmallRng| if r.gen_bool(0.5) { Policy::Mw } else { Policy::Confirm };
        let policies = Policies { request: pol(&mut rng), reply: pol(&mut rng) };
        // Start credits from the fewest a side may offer to all its receives.
        let (cs, ss) = (rng.gen_range(MIN_START_CREDITS..=SLOTS), rng.gen_range(MIN_START_CREDITS..=SLOTS));
        let mut p = Pair::with_start_credits(policies, cs, ss);
        let mut pending: Vec<RequestId> = Vec::new();
        let mut made = 0u64;
        let mut t = Tally::default();
        for _ in 0..400 {
            p.now += Duration::from_micros(rng.gen_range(0..50));
            match rng.gen_range(0..10) {
                0..=3 => {
                    let data = if rng.gen_bool(0.5) { p.c.conn.alloc() } else { None };
                    let data = data.map(|mut b| {
                        b.copy_from(&pattern(made, 100)).unwrap();
                        b
                    });
                    match p.c.conn.call(p.now, b"q", data) {
                        Ok(_) => made += 1,
                        Err(r) => {
                            assert!(
                                matches!(
                                    r.error,
                                    UseError::NoCredit | UseError::NoCtrlSlot | UseError::NoFreeWindow
                                ),
                                "{:?}",
                                r.error
                            );
                            if let Some(b) = r.data {
                                p.c.conn.free(b);
                            }
                        }
                    }
                }
                4..=6 if !pending.is_empty() => {
                    let req = pending.swap_remove(rng.gen_range(0..pending.len()));
                    let data = if rng.gen_bool(0.5) { p.s.conn.alloc() } else { None };
                    let data = data.map(|mut b| {
                        b.copy_from(&pattern(7, 200)).unwrap();
                        b
                    });
                    if let Err(r) = p.s.conn.reply(p.now, req, 0, b"a", data) {
                        pending.push(req);
                        if let Some(b) = r.data {
                            p.s.conn.free(b);
                        }
                    }
                }
                7 => p.frozen_server = !p.frozen_server,
                8 => p.frozen_client = !p.frozen_client,
                _ => {}
            }
            p.settle();
            drain(&mut p, &mut pending, &mut t);
        }
        // Everyone runs again: every call must finish. Time moves on too: a
        // side whose buffers are all exposed for payloads the peer cannot
        // read (its buffers exposed in turn) waits for leases to end.
        p.frozen_server = false;
        p.frozen_client = false;
        for _ in 0..200 {
            if t.done + t.timed_out == made {
                break;
            }
            p.now += Duration::from_millis(500);
            p.c.conn.handle_timeout(p.now);
            p.s.conn.handle_timeout(p.now);
            p.settle();
            drain(&mut p, &mut pending, &mut t);
            while let Some(req) = pending.pop() {
                if let Err(r) = p.s.conn.reply(p.now, req, 0, b"a", None) {
                    assert!(matches!(r.error, UseError::NoCredit | UseError::NoCtrlSlot), "{:?}", r.error);
                    pending.push(req);
                    break;
                }
            }
        }
        assert_eq!(
            t.done + t.timed_out,
            made,
            "seed {seed}: every call finished ({policies:?}, start credits {cs}/{ss}) pending {pending:?}\nclient {:?}\nserver {:?}",
            p.c.conn.stats(),
            p.s.conn.stats()
        );
        // A call times out (or fails unread) only when the server dropped
        // its request (its payload out of time). Any other
        // timeout is a call that never finished (a credit deadlock, say).
        assert_eq!(
            t.timed_out, t.dropped,
            "seed {seed}: calls timed out whose requests were not dropped ({policies:?})"
        );
        assert!(p.c.conn.is_down().is_none() && p.s.conn.is_down().is_none(), "seed {seed}");
        let (c, s) = (p.c.conn.stats(), p.s.conn.stats());
        waits += c.credit_waits + s.credit_waits;
        grants += c.credit_frames + s.credit_frames;
    }
    assert!(waits > 100 && grants > 100, "the schedules ran out of credit ({waits} waits, {grants} grants)");
}

/// What became of the calls of a schedule.
#[derive(Default)]
struct Tally {
    /// Finished: a reply, or a reply payload the client could not read.
    done: u64,
    /// Failed by their timeout (mw: a server says nothing when it drops
    /// a request), or told their request was dropped unread (confirm:
    /// `PayloadError::Unread`).
    timed_out: u64,
    /// Requests the server dropped (their payload out of time).
    dropped: u64,
}

/// Take both sides' events: requests to answer, calls counted, buffers
/// freed.
fn drain(p: &mut Pair, pending: &mut Vec<RequestId>, t: &mut Tally) {
    while let Some(ev) = p.s.conn.poll_event() {
        match ev {
            Event::Request { req, data, .. } => {
                if let Some(b) = data {
                    p.s.conn.free(b);
                }
                pending.push(req);
            }
            // Confirm: the client read a reply whose buffer was reused; answer again.
            Event::ReplyAgain { req, .. } => pending.push(req),
            // A request payload out of time (the call times out at the
            // client, or fails as unread under confirm).
            Event::RequestDropped { .. } => t.dropped += 1,
            Event::BufferReturned(b) => p.s.conn.free(b),
            other => panic!("server: {other:?}"),
        }
    }
    while let Some(ev) = p.c.conn.poll_event() {
        match ev {
            Event::Reply { data, .. } => {
                if let Some(b) = data {
                    p.c.conn.free(b);
                }
                t.done += 1;
            }
            Event::CallFailed {
                error: CallError::TimedOut | CallError::Payload(PayloadError::Unread),
                ..
            } => t.timed_out += 1,
            // A payload the client could not read in time: finished, not
            // lost.
            Event::CallFailed { error: CallError::Payload(_), .. } => t.done += 1,
            Event::BufferReturned(b) => p.c.conn.free(b),
            other => panic!("client: {other:?}"),
        }
    }
}

/// The interleaving `d9564df` fixed: the connection is down with its move
/// to ERR queued when the link reports another loss (a failed poll, a
/// frame it cannot read: `post_failed(&Command::SetQpError, ..)` with no
/// `SetQpError` tried). The queued move still goes out. (Before the fix
/// the second report cleared the flag saying a move was queued.) The
/// buffer the frozen server was given comes back only with the QP's
/// destroy, not on the move to ERR: a NIC may still be copying a READ
/// response's last packet out of it (`docs/protocol.md`, "Evidence, not
/// timeouts"); the connection says when only the destroy is left.
#[test]
fn a_loss_reported_while_the_move_to_err_is_queued_still_moves_and_the_buffer_waits_for_the_destroy() {
    let mut p = Pair::new(Policies::both(Policy::Mw));
    p.allow_down = true;
    // The server takes the request in but never READs or releases it.
    p.frozen_server = true;
    let mut b = p.c.conn.alloc().unwrap();
    // Past the inline maximum: exposed through a window, not sent inline.
    b.copy_from(&[5u8; SIZE as usize]).unwrap();
    p.c.conn.call(p.now, b"put", Some(b)).unwrap();
    p.settle();
    assert_eq!(p.c.conn.busy_buffers(), 1, "the payload is exposed to the server");
    p.c.conn.begin_close(p.now);
    // Before the queued move to ERR is carried out, the link reports a
    // failed poll (`Link::drive`, `Link::cq_failed`).
    let failed = NicError::NoSuchObject { what: "completion queue", id: 1 };
    p.c.conn.post_failed(&Command::SetQpError, failed);
    let mut moves = 0;
    p.c.conn.drain_commands(|c, _| {
        moves += matches!(c, Command::SetQpError) as u32;
        Ok(())
    });
    assert!(moves >= 1, "no move to ERR was asked for");
    // The QP is in ERR and nothing of the client's is in flight: only the
    // destroy is left, and the buffer waits for it.
    let returned = |p: &mut Pair| {
        let mut n = 0;
        while let Some(e) = p.c.conn.poll_event() {
            n += matches!(e, Event::BufferReturned(_)) as u32;
        }
        n
    };
    assert_eq!(returned(&mut p), 0, "the buffer came back on the move to ERR");
    assert!(p.c.conn.flushed());
    p.c.conn.handle_qp_destroyed(p.now);
    assert_eq!(returned(&mut p), 1);
    assert_eq!(p.c.conn.busy_buffers(), 0);
}
