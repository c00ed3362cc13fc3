//! Torture on real verbs (issue 9 §5, the rxe half; `tests/torture.rs` is
//! the simulator's): a long random run over several client/server
//! `Link<VerbsNic>` pairs at once on rxe0, each side on its own
//! protection domain, driven in real time from one thread.
//!
//! Each step applies one random operation to one live connection: a call
//! with or without a payload of random size, a reply with or without one,
//! a cancel, a request the server never answers (the client's call times
//! out and its request window expires at the owner), a step that only
//! drives; and, as faults, a QP forced into the error state (either side),
//! one side stalled for longer than a lease (late reads, releases never
//! sent), or the abrupt death of one side (its endpoint dropped: QP to ERR,
//! windows freed, QP destroyed, memory deregistered). Each connection
//! gets random policies (mw or confirm, each direction), a random pool size
//! and, one time in four, a short call timeout.
//!
//! Checked as the run goes:
//! - every delivered payload, both directions, is the one sent for that
//!   call, byte for byte (the pattern is keyed by the call's sequence
//!   number, and every buffer that comes back to its owner or is freed by a
//!   reader is overwritten first, so a stale read accepted shows as a
//!   mismatch);
//! - a reply goes to the call it answers, and every call ends once;
//! - no connection without an injected fault goes down (checked for the
//!   connection stepped after each step, and for every connection each time
//!   all are driven, every 4 steps).
//!
//! At the end of each connection's life: a healthy one first drains (no new
//! operations; the server answers what it still means to answer) until no
//! call is outstanding and every buffer is back on both sides without a
//! close, and its window owners invalidated every bind exactly once
//! (`invalidations == grants`); then both sides close. After the close,
//! every buffer is back (`busy_buffers() == 0`) and every buffer handed to
//! the NIC came back in a `BufferReturned` on each side still alive.
//!
//! A window invalidated twice (or never bound) panics rxe's kernel: the VM
//! then dies without its status marker, and `tests/softroce/run.sh` reports
//! the run as failed.
//!
//! `MWCAP_VERBS_TORTURE_CALLS` (delivered calls, default 10,000) and
//! `MWCAP_VERBS_TORTURE_SEED` (default 0x5eed) set the run;
//! `tests/softroce/run.sh` passes `MWCAP_*` variables into the VM.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use mwcap::backend::NicOps;
use mwcap::conn::{Buf, CallError, CallId, Config, Event, Link, Policies, Policy, RequestId, Role};
use mwcap::verbs::VerbsNic;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

type Ep = Link<VerbsNic>;

/// Live connections at a time (draining ones come on top).
const LIVE: usize = 4;
/// Steps between two rounds that drive every connection (live and draining).
const PUMP_ALL_EVERY: u64 = 4;
/// Steps after which a connection has run its course.
const LIFE: u32 = 300;
const LEASE: Duration = Duration::from_millis(1200);
const MARGIN: Duration = Duration::from_millis(300);
const CALL_TIMEOUT: Duration = Duration::from_secs(4);
const BUFFER_SIZE: u32 = 16 << 10;
/// What every buffer is overwritten with before it goes back to the pool.
const SCRIBBLE: u8 = 0xee;

/// Payload `seq` (its first `len` bytes are sent): a window into a table
/// of random bytes, at an offset that differs for any 4,096 consecutive
/// request (or reply) sequence numbers, so every payload of a connection's
/// life differs from the others, and requests from replies. Filled and
/// checked with one copy and one compare (byte loops in a debug build
/// cost more CPU under TCG than rxe's own work).
fn pattern(seq: u32) -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = vec![0; 8192 + BUFFER_SIZE as usize];
        SmallRng::seed_from_u64(0x7ab1e).fill(&mut t[..]);
        t
    });
    let off = ((seq & 0x7fff_ffff).wrapping_mul(977) % 4096 + (seq >> 31) * 4096) as usize;
    &table[off..off + BUFFER_SIZE as usize]
}

fn header(seq: u32, len: usize) -> [u8; 8] {
    let mut h = [0; 8];
    h[..4].copy_from_slice(&seq.to_le_bytes());
    h[4..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

fn parse(h: &[u8]) -> (u32, usize) {
    assert_eq!(h.len(), 8, "header length");
    (u32::from_le_bytes(h[..4].try_into().unwrap()), u32::from_le_bytes(h[4..].try_into().unwrap()) as usize)
}

/// A buffer of `ep` holding payload `seq` of `len` bytes, if one is free.
fn filled(ep: &mut Ep, seq: u32, len: usize) -> Option<Buf> {
    let mut b = ep.alloc()?;
    b.write_with(|m| {
        m[..len].copy_from_slice(&pattern(seq)[..len]);
        len
    })
    .expect("fill");
    Some(b)
}

/// Check a delivered payload against what was sent, then overwrite it and
/// give it back to the pool.
fn verify_and_free(ep: &mut Ep, b: Buf, seq: u32, len: usize, what: &str) -> u64 {
    assert_eq!(b.len(), len, "{what} {seq:#x}: payload length");
    let want = &pattern(seq)[..len];
    if &b[..] != want {
        let (i, got) =
            b.iter().zip(want).enumerate().find(|(_, (x, y))| x != y).map(|(i, (x, _))| (i, *x)).unwrap();
        panic!(
            "{what} {seq:#x}: byte {i} of {len} is {got:#04x}, sent {:#04x}: a stale or foreign payload was accepted",
            want[i]
        );
    }
    scribble_and_free(ep, b);
    len as u64
}

fn scribble_and_free(ep: &mut Ep, mut b: Buf) {
    b.write_with(|m| {
        m.fill(SCRIBBLE);
        m.len()
    })
    .expect("scribble");
    ep.free(b);
}

#[derive(Default, Debug)]
struct Counts {
    steps: u64,
    connections: u64,
    calls: u64,
    calls_with_payload: u64,
    refused: u64,
    delivered: u64,
    failed: u64,
    /// Calls whose client died before they ended (no ending is owed).
    orphaned: u64,
    timed_out: u64,
    cancelled: u64,
    lost: u64,
    failed_other: u64,
    requests: u64,
    requests_dropped: u64,
    replies: u64,
    replies_with_payload: u64,
    reply_again: u64,
    abandoned: u64,
    cancels: u64,
    bytes_checked: u64,
    expired: u64,
    stale_reads: u64,
    qp_errors: u64,
    stalls: u64,
    kills: u64,
    went_down: u64,
    /// Wall time spent setting connections up and closing them.
    setup: Duration,
    teardown: Duration,
}

struct Conn {
    epoch: Instant,
    policies: Policies,
    client: Option<Ep>,
    server: Option<Ep>,
    /// Buffers handed to the NIC and returned, per side (client, server).
    given: [u64; 2],
    returned: [u64; 2],
    seq: u32,
    calls: HashMap<CallId, u32>,
    pending: VecDeque<(RequestId, u32)>,
    req_seq: HashMap<RequestId, u32>,
    /// The fault injected, if any: only then may it go down.
    fault: Option<&'static str>,
    steps: u32,
    /// Draining since.
    drain: Option<Instant>,
    /// A side (client, server) that stopped running until then: it drives
    /// nothing, takes no events and makes no calls or replies.
    stalled: [Option<Instant>; 2],
    call_timeout: Duration,
}

impl Conn {
    fn new(rng: &mut SmallRng) -> Conn {
        let p = |r: &mut SmallRng| if r.gen_bool(0.5) { Policy::Mw } else { Policy::Confirm };
        let policies = Policies { request: p(rng), reply: p(rng) };
        let call_timeout =
            if rng.gen_bool(0.25) { Duration::from_millis(rng.gen_range(20..300)) } else { CALL_TIMEOUT };
        let buffers = rng.gen_range(4..=8);
        let seed = rng.gen();
        let cfg = || {
            let mut c = Config::default();
            c.buffers = buffers;
            c.buffer_size = BUFFER_SIZE;
            c.ctrl_slots = 16;
            c.lease_time = LEASE;
            c.safety_margin = MARGIN;
            c.call_timeout = call_timeout;
            c.seed = Some(seed);
            c
        };
        let mut client = Link::new(super::open(), Role::Client, policies, cfg()).expect("client endpoint");
        let mut server = Link::new(super::open(), Role::Server, policies, cfg()).expect("server endpoint");
        let (c, s) = (client.local(), server.local());
        client.connect(&s).expect("connect client");
        server.connect(&c).expect("connect server");
        Conn {
            epoch: Instant::now(),
            policies,
            client: Some(client),
            server: Some(server),
            given: [0; 2],
            returned: [0; 2],
            // A random start: payloads of different connections differ too.
            seq: rng.gen_range(0..1 << 30),
            calls: HashMap::new(),
            pending: VecDeque::new(),
            req_seq: HashMap::new(),
            fault: None,
            steps: 0,
            drain: None,
            stalled: [None; 2],
            call_timeout,
        }
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn down(&self) -> Option<String> {
        [&self.client, &self.server].into_iter().flatten().find_map(|ep| ep.is_down().map(|r| r.to_string()))
    }

    /// Drive both sides once and take their events; returns whether any came.
    fn pump(&mut self, c: &mut Counts) -> bool {
        let now = self.now();
        let t = Instant::now();
        for (i, ep) in [self.client.as_mut(), self.server.as_mut()].into_iter().enumerate() {
            match (ep, self.stalled[i]) {
                (Some(_), Some(until)) if t < until => {}
                (Some(ep), _) => {
                    ep.handle_timeout(now);
                    ep.drive(now);
                }
                (None, _) => {}
            }
        }
        self.take_events(c)
    }

    /// Whether side `i` (0 client, 1 server) is stalled now.
    fn is_stalled(&self, i: usize) -> bool {
        self.stalled[i].is_some_and(|until| Instant::now() < until)
    }

    fn take_events(&mut self, c: &mut Counts) -> bool {
        let mut any = false;
        let (client_stalled, server_stalled) = (self.is_stalled(0), self.is_stalled(1));
        while let Some(e) = self.server.as_mut().filter(|_| !server_stalled).and_then(Ep::poll_event) {
            any = true;
            self.on_server(e, c);
        }
        while let Some(e) = self.client.as_mut().filter(|_| !client_stalled).and_then(Ep::poll_event) {
            any = true;
            self.on_client(e, c);
        }
        any
    }

    fn on_server(&mut self, e: Event, c: &mut Counts) {
        let s = self.server.as_mut().expect("events come from a live server");
        match e {
            Event::Request { req, header, data, .. } => {
                let (seq, len) = parse(&header);
                match data {
                    Some(d) => c.bytes_checked += verify_and_free(s, d, seq, len, "request"),
                    None => assert_eq!(len, 0, "request {seq:#x} lost its payload"),
                }
                c.requests += 1;
                self.pending.push_back((req, seq));
                self.req_seq.insert(req, seq);
            }
            Event::BufferReturned(b) => {
                self.returned[1] += 1;
                scribble_and_free(s, b);
            }
            Event::ReplyAgain { req, .. } => {
                c.reply_again += 1;
                let seq = *self.req_seq.get(&req).expect("reply again to a known request");
                self.pending.push_back((req, seq));
            }
            Event::RequestDropped { .. } => c.requests_dropped += 1,
            Event::ConnectionLost(_) => {}
            other => panic!("a server got {other:?}"),
        }
    }

    fn on_client(&mut self, e: Event, c: &mut Counts) {
        let cl = self.client.as_mut().expect("events come from a live client");
        match e {
            Event::Reply { call, header, data, .. } => {
                let seq = self.calls.remove(&call).expect("a reply to a known call");
                let (rseq, len) = parse(&header);
                assert_eq!(rseq, seq | 0x8000_0000, "the reply to call {seq:#x} is another call's");
                match data {
                    Some(d) => c.bytes_checked += verify_and_free(cl, d, rseq, len, "reply"),
                    None => assert_eq!(len, 0, "reply {rseq:#x} lost its payload"),
                }
                c.delivered += 1;
            }
            Event::CallFailed { call, error } => {
                self.calls.remove(&call).expect("a failure of a known call");
                c.failed += 1;
                match error {
                    CallError::TimedOut => c.timed_out += 1,
                    CallError::Cancelled => c.cancelled += 1,
                    CallError::ConnectionLost(_) => c.lost += 1,
                    _ => c.failed_other += 1,
                }
            }
            Event::BufferReturned(b) => {
                self.returned[0] += 1;
                scribble_and_free(cl, b);
            }
            Event::ConnectionLost(_) => {}
            other => panic!("a client got {other:?}"),
        }
    }

    fn call(&mut self, rng: &mut SmallRng, c: &mut Counts) {
        let now = self.now();
        if self.is_stalled(0) {
            return;
        }
        let Some(cl) = self.client.as_mut() else { return };
        self.seq += 1;
        let seq = self.seq;
        let len =
            if rng.gen_bool(0.5) { rng.gen_range(1..=256) } else { rng.gen_range(1..=BUFFER_SIZE as usize) };
        let data = if rng.gen_bool(0.7) { filled(cl, seq, len) } else { None };
        let had = data.is_some();
        // Up to `inline_max` bytes ride in the frame: the buffer is back at
        // once, not in a BufferReturned.
        let inline = len <= cl.config().inline_max as usize;
        match cl.call(now, &header(seq, if had { len } else { 0 }), data) {
            Ok(id) => {
                self.calls.insert(id, seq);
                c.calls += 1;
                if had && !inline {
                    self.given[0] += 1;
                    c.calls_with_payload += 1;
                }
            }
            Err(r) => {
                c.refused += 1;
                if let Some(b) = r.data {
                    cl.free(b);
                }
            }
        }
    }

    fn reply(&mut self, rng: &mut SmallRng, c: &mut Counts, payload: bool) {
        let now = self.now();
        if self.is_stalled(1) {
            return;
        }
        let Some(s) = self.server.as_mut() else { return };
        if self.pending.is_empty() {
            return;
        }
        let i = rng.gen_range(0..self.pending.len());
        let (req, seq) = self.pending.remove(i).unwrap();
        let rseq = seq | 0x8000_0000;
        let len =
            if rng.gen_bool(0.5) { rng.gen_range(1..=256) } else { rng.gen_range(1..=BUFFER_SIZE as usize) };
        let data = if payload { filled(s, rseq, len) } else { None };
        let had = data.is_some();
        let inline = len <= s.config().inline_max as usize;
        match s.reply(now, req, 0, &header(rseq, if had { len } else { 0 }), data) {
            Ok(()) => {
                c.replies += 1;
                if had && !inline {
                    self.given[1] += 1;
                    c.replies_with_payload += 1;
                }
            }
            Err(r) => {
                if let Some(b) = r.data {
                    s.free(b);
                }
                // Backpressure leaves the request waiting; anything else
                // (dropped, down) ends it.
                if matches!(r.error, mwcap::conn::UseError::NoFreeWindow | mwcap::conn::UseError::NoCtrlSlot)
                {
                    self.pending.push_back((req, seq));
                }
            }
        }
    }

    fn apply(&mut self, rng: &mut SmallRng, c: &mut Counts) {
        self.steps += 1;
        match rng.gen_range(0..1000) {
            0..=379 => self.call(rng, c),
            380..=729 => {
                let payload = rng.gen_bool(0.7);
                self.reply(rng, c, payload)
            }
            730..=759 => {
                if self.is_stalled(0) {
                    return;
                }
                if let (Some(cl), false) = (self.client.as_mut(), self.calls.is_empty()) {
                    let ids: Vec<CallId> = self.calls.keys().copied().collect();
                    let now = self.epoch.elapsed();
                    cl.cancel(now, ids[rng.gen_range(0..ids.len())]);
                    c.cancels += 1;
                }
            }
            760..=784 => {
                // The server never answers this one.
                if !self.pending.is_empty() {
                    let i = rng.gen_range(0..self.pending.len());
                    self.pending.remove(i);
                    c.abandoned += 1;
                }
            }
            785..=989 => {} // a step that only drives every connection
            990..=993 => {
                let client = rng.gen_bool(0.5);
                let ep = if client { self.client.as_ref() } else { self.server.as_ref() };
                if let Some(ep) = ep {
                    ep.nic().set_qp_error(ep.local().id).expect("QP to ERR");
                    self.fault = Some(if client { "client QP error" } else { "server QP error" });
                    c.qp_errors += 1;
                }
            }
            994..=996 => {
                // One side stops running for longer than a lease: the
                // server answers no release, the client reads its grants
                // late (a late READ may meet an invalidated window).
                let client = rng.gen_bool(0.5);
                let ms = LEASE.as_millis() as u64 + rng.gen_range(100..1000);
                self.stalled[usize::from(!client)] = Some(Instant::now() + Duration::from_millis(ms));
                self.fault = Some(if client { "client stalled" } else { "server stalled" });
                c.stalls += 1;
            }
            _ => {
                // One side dies: its endpoint is dropped with no close.
                if rng.gen_bool(0.5) {
                    self.client = None;
                    self.fault = Some("client died");
                    c.orphaned += self.calls.len() as u64;
                    self.calls.clear();
                } else {
                    self.server = None;
                    self.fault = Some("server died");
                    self.pending.clear();
                }
                c.kills += 1;
            }
        }
    }

    /// A connection no fault was injected into stays up.
    fn check_healthy(&self) {
        if let (None, Some(why)) = (self.fault, self.down()) {
            panic!("a healthy connection ({:?}) went down: {why}", self.policies);
        }
    }

    /// Whether its life is over (it went down, lost a side, or ran its course).
    fn over(&self) -> bool {
        self.steps >= LIFE || self.client.is_none() || self.server.is_none() || self.down().is_some()
    }

    /// Start draining: no more operations; a healthy server answers what it
    /// still means to.
    fn begin_drain(&mut self, rng: &mut SmallRng, c: &mut Counts) {
        if self.fault.is_none() {
            let keep = self.pending.len();
            for _ in 0..keep {
                let payload = rng.gen_bool(0.5);
                self.reply(rng, c, payload);
                self.pump(c);
            }
        }
        self.drain = Some(Instant::now());
    }

    /// Drained: a healthy connection has nothing in flight; a faulted one
    /// is down on every side left (or has nothing in flight), or its time is up.
    fn drained(&self) -> bool {
        if self.is_stalled(0) || self.is_stalled(1) {
            return false;
        }
        let since = self.drain.expect("draining").elapsed();
        // A side that went down keeps its window-exposed buffers until its
        // QP is destroyed (at the close, below): flushed is as idle as it gets.
        let idle = self.calls.is_empty()
            && [&self.client, &self.server]
                .into_iter()
                .flatten()
                .all(|ep| ep.busy_buffers() == 0 || ep.flushed());
        if self.fault.is_none() {
            let limit = self.call_timeout.max(LEASE) + Duration::from_secs(5);
            assert!(
                since < limit,
                "a healthy connection ({:?}) did not drain within {limit:?}: calls {}, busy buffers {:?}, stats {:?} / {:?}",
                self.policies,
                self.calls.len(),
                [&self.client, &self.server].map(|e| e.as_ref().map(|l| l.busy_buffers())),
                self.client.as_ref().map(|l| l.stats()),
                self.server.as_ref().map(|l| l.stats()),
            );
            return idle;
        }
        let all_down = [&self.client, &self.server].into_iter().flatten().all(|ep| ep.is_down().is_some());
        idle || all_down || since > LEASE + Duration::from_secs(3)
    }

    /// Close both sides and check that every buffer is back.
    fn finish(mut self, c: &mut Counts) {
        for ep in [&self.client, &self.server].into_iter().flatten() {
            let st = ep.stats();
            c.stale_reads += st.stale_reads;
            if let Some(o) = st.lease_owner {
                c.expired += o.expired;
                assert!(o.invalidations <= o.grants, "more invalidations than binds: {o:?}");
                if self.fault.is_none() {
                    assert_eq!(
                        o.invalidations, o.grants,
                        "a healthy owner invalidates every bind once: {o:?}"
                    );
                }
            }
        }
        if self.down().is_some() {
            c.went_down += 1;
        }
        let now = self.now();
        for ep in [self.client.as_mut(), self.server.as_mut()].into_iter().flatten() {
            ep.close(now);
        }
        self.take_events(c);
        for (i, ep) in [&self.client, &self.server].into_iter().enumerate() {
            if let Some(ep) = ep {
                assert_eq!(
                    ep.busy_buffers(),
                    0,
                    "side {i} has buffers out after the close ({:?})",
                    self.fault
                );
                assert_eq!(
                    self.returned[i], self.given[i],
                    "side {i}: every buffer handed to the NIC comes back ({:?})",
                    self.fault
                );
            }
        }
        assert!(self.calls.is_empty() || self.client.is_none(), "calls without an ending: {:?}", self.calls);
    }
}

/// A line for the VM's log, as it happens: written to stdout directly
/// (libtest captures `println!` of a passing test, not the stream itself).
fn say(line: std::fmt::Arguments) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn torture_random_calls_and_faults_over_several_connections() {
    let target = env_u64("MWCAP_VERBS_TORTURE_CALLS", 10_000);
    let seed = env_u64("MWCAP_VERBS_TORTURE_SEED", 0x5eed);
    let start = Instant::now();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut c = Counts::default();
    let t = Instant::now();
    let mut live: Vec<Conn> = (0..LIVE).map(|_| Conn::new(&mut rng)).collect();
    c.setup += t.elapsed();
    let mut draining: Vec<Conn> = Vec::new();
    c.connections = LIVE as u64;
    let mut last_report = Instant::now();
    while c.delivered < target || !live.is_empty() || !draining.is_empty() {
        let mut quiet = true;
        if c.delivered < target {
            let i = rng.gen_range(0..live.len());
            live[i].apply(&mut rng, &mut c);
            live[i].pump(&mut c);
            live[i].check_healthy();
            c.steps += 1;
        }
        // Every connection is driven every few steps (driving them all
        // after every step costs more CPU than rxe's work under TCG).
        if c.steps % PUMP_ALL_EVERY == 0 || c.delivered >= target {
            for conn in live.iter_mut().chain(draining.iter_mut()) {
                quiet &= !conn.pump(&mut c);
                conn.check_healthy();
            }
        }
        if c.delivered >= target {
            // Done: every live connection drains, none replaces it.
            for mut old in live.drain(..) {
                old.begin_drain(&mut rng, &mut c);
                draining.push(old);
            }
            if quiet {
                std::thread::yield_now();
            }
        }
        for conn in live.iter_mut().filter(|conn| conn.over()) {
            let t = Instant::now();
            let mut old = std::mem::replace(conn, Conn::new(&mut rng));
            c.setup += t.elapsed();
            c.connections += 1;
            old.begin_drain(&mut rng, &mut c);
            draining.push(old);
        }
        let mut k = 0;
        while k < draining.len() {
            if draining[k].drained() {
                let t = Instant::now();
                draining.swap_remove(k).finish(&mut c);
                c.teardown += t.elapsed();
            } else {
                k += 1;
            }
        }
        if last_report.elapsed() > Duration::from_secs(20) {
            last_report = Instant::now();
            say(format_args!(
                "torture (verbs): {:.0?}: {} delivered, {} steps, {} connections",
                start.elapsed(),
                c.delivered,
                c.steps,
                c.connections
            ));
        }
    }
    say(format_args!(
        "torture (verbs): seed {seed:#x}: {} delivered calls of {} made in {:.1?} ({} steps, {} connections, \
         {} went down; {:.1?} setting up, {:.1?} closing)",
        c.delivered,
        c.calls,
        start.elapsed(),
        c.steps,
        c.connections,
        c.went_down,
        c.setup,
        c.teardown
    ));
    say(format_args!(
        "torture (verbs): calls: {} with a payload, {} refused, {} failed ({} timed out, {} cancelled, \
         {} connection lost, {} other)",
        c.calls_with_payload, c.refused, c.failed, c.timed_out, c.cancelled, c.lost, c.failed_other
    ));
    say(format_args!(
        "torture (verbs): requests: {} ({} dropped, {} asked again, {} never answered), {} replies sent \
         ({} with a payload), {} cancels, {} payload bytes checked, {} leases expired, {} stale reads detected",
        c.requests,
        c.requests_dropped,
        c.reply_again,
        c.abandoned,
        c.replies,
        c.replies_with_payload,
        c.cancels,
        c.bytes_checked,
        c.expired,
        c.stale_reads
    ));
    say(format_args!(
        "torture (verbs): faults: {} QP errors, {} stalls past a lease, {} deaths",
        c.qp_errors, c.stalls, c.kills
    ));
    // Every call made ended, delivered or failed, unless its client died
    // first: none was lost.
    assert_eq!(c.delivered + c.failed + c.orphaned, c.calls, "{c:?}");
    assert!(
        c.qp_errors + c.stalls + c.kills > 0 && c.connections > LIVE as u64,
        "faults injected, connections replaced: {c:?}"
    );
}
