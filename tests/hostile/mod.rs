//! The world of `hostile_nic.rs`: a correct mwcap endpoint (the victim), a
//! peer that drives the `Nic` interface by hand (the attacker: its own
//! device, CQ, QP and memory, frames written with the library's encoders),
//! and a second, healthy connection of the victim's device (another PD of
//! it) that keeps making calls with checked payloads the whole time.
//!
//! Every byte the victim keeps for anyone but the attacker (its free
//! buffers, the bytes past a payload in a granted buffer, both sides of the
//! healthy connection) holds [`SECRET`]; every byte it grants holds
//! [`GRANTED`]. Whatever the attacker READs is checked for the secret.

#![allow(dead_code)] // each test uses part of the harness

use mwcap::backend::NicOps;
use std::collections::VecDeque;
use std::time::Duration;

use mwcap::backend::{
    Access, Completion, CqId, MrInfo, QpConfig, QpEndpoint, SendWr, Sge, SgeList, WcStatus,
};
use mwcap::conn::frame::{Attach, Attaches, EngineTag, Frame, INITIAL_CREDITS, MAX_FRAME};
use mwcap::conn::{Buf, CallId, Config, Event, Link, LossReason, Policies, Policy, RequestId, Role};
use mwcap::sim::{DeviceConfig, DeviceId, Fabric, FabricConfig, Progress, QpAddr, SimNic};
use mwcap_fallback as fb;
use mwcap_mw as mw;

/// What the victim keeps from the attacker.
pub const SECRET: &[u8; 8] = b"S3CR3T!!";
/// What the victim grants the attacker (one byte, repeated).
pub const GRANTED: u8 = 0xa5;
pub const BUFFERS: u32 = 4;
pub const BUFFER_SIZE: u32 = 4096;
pub const CTRL_SLOTS: u32 = 8;
pub const LEASE: Duration = Duration::from_millis(100);
pub const CALL_TIMEOUT: Duration = Duration::from_millis(400);
/// Bytes of payload the victim grants.
pub const PAYLOAD: usize = 1000;

pub const ALL: [Policies; 4] = [
    Policies { request: Policy::Mw, reply: Policy::Mw },
    Policies { request: Policy::Mw, reply: Policy::Confirm },
    Policies { request: Policy::Confirm, reply: Policy::Mw },
    Policies { request: Policy::Confirm, reply: Policy::Confirm },
];

pub fn config() -> Config {
    let mut c = Config::default();
    c.buffers = BUFFERS;
    c.buffer_size = BUFFER_SIZE;
    c.ctrl_slots = CTRL_SLOTS;
    c.lease_time = LEASE;
    c.safety_margin = Duration::from_millis(10);
    c.call_timeout = CALL_TIMEOUT;
    c
}

/// `len` bytes of the secret, repeated, after a 4-byte sequence number.
pub fn secret_payload(seq: u32, len: usize) -> Vec<u8> {
    let mut v = seq.to_le_bytes().to_vec();
    while v.len() < len {
        v.extend_from_slice(SECRET);
    }
    v.truncate(len);
    v
}

pub fn contains_secret(bytes: &[u8]) -> bool {
    bytes.windows(SECRET.len()).any(|w| w == SECRET)
}

// ---- the attacker ----

const RECV_TAG: u64 = 1 << 40;
const SEND_TAG: u64 = 2 << 40;
const READ_TAG: u64 = 3 << 40;
const RECV_SLOTS: usize = 32;
// Enough that a flood (4 × CTRL_SLOTS frames plus grants) never reuses a
// slot whose SEND is still waiting out an RNR.
const SEND_SLOTS: usize = 128;
/// Bytes of a send slot: room for a frame larger than `MAX_FRAME`.
pub const SEND_SLOT: usize = 2 * MAX_FRAME;

/// A peer with no mwcap connection code: its own device, CQ and QP, receive
/// slots, send slots, a READ destination and memory of its own to expose.
pub struct Attacker {
    pub nic: SimNic,
    pub cq: CqId,
    pub qp: QpEndpoint,
    send: MrInfo,
    recv: MrInfo,
    /// READ destinations.
    pub dst: MrInfo,
    /// Memory the attacker exposes when it plays the owner.
    pub mem: MrInfo,
    next: u64,
    /// Re-post a receive slot as soon as its frame is taken.
    pub repost: bool,
    /// Receives posted, and credit granted for them (the victim counts on
    /// `INITIAL_CREDITS` of them without a grant).
    posted: u64,
    granted: u64,
    /// Grant credit like an honest peer (in every frame, and in a `Credit`
    /// frame once 4 receives are owed). Off: the attacker withholds it.
    pub auto_credit: bool,
    /// Frames received, oldest first.
    pub frames: VecDeque<Vec<u8>>,
    /// The credit the victim granted: `INITIAL_CREDITS` and the credit
    /// field of every frame received from it.
    pub credit_granted: u64,
    /// SENDs posted (each takes one of the victim's receives).
    pub sends: u64,
    /// Send-queue completions (SENDs, READs).
    pub sent: Vec<Completion>,
    /// Receive completions that failed.
    pub recv_errors: Vec<Completion>,
}

impl Attacker {
    fn new(fabric: &Fabric) -> Attacker {
        let nic = fabric.add_device(DeviceConfig::spec().named("attacker"));
        let cq = nic.create_cq(256).unwrap();
        let mut qc = QpConfig::new(cq, cq);
        qc.max_recv_wr = RECV_SLOTS as u32;
        let qp = nic.create_qp(qc).unwrap();
        let send = nic.reg_mr(SEND_SLOTS * SEND_SLOT, Access::LOCAL_WRITE).unwrap();
        let recv = nic.reg_mr(RECV_SLOTS * MAX_FRAME, Access::LOCAL_WRITE).unwrap();
        let dst = nic.reg_mr(4 * BUFFER_SIZE as usize, Access::LOCAL_WRITE).unwrap();
        let mem = nic
            .reg_mr(BUFFER_SIZE as usize, Access::LOCAL_WRITE | Access::REMOTE_READ | Access::MW_BIND)
            .unwrap();
        Attacker {
            nic,
            cq,
            qp,
            send,
            recv,
            dst,
            mem,
            next: 0,
            repost: true,
            posted: 0,
            granted: 0,
            auto_credit: true,
            frames: VecDeque::new(),
            credit_granted: u64::from(INITIAL_CREDITS),
            sends: 0,
            sent: Vec::new(),
            recv_errors: Vec::new(),
        }
    }

    pub fn qp_addr(&self) -> QpAddr {
        self.nic.qp_addr(self.qp.id).unwrap()
    }

    fn id(&mut self, tag: u64) -> u64 {
        self.next += 1;
        tag | self.next
    }

    /// Post `n` receives of one frame each.
    pub fn post_recvs(&mut self, n: usize) {
        for i in 0..n {
            let slot = i % RECV_SLOTS;
            self.post_recv(slot);
        }
    }

    fn post_recv(&mut self, slot: usize) {
        self.posted += 1;
        let sge = Sge { mr: self.recv.id, offset: slot * MAX_FRAME, len: MAX_FRAME as u32 };
        self.nic.post_recv(self.qp.id, RECV_TAG | slot as u64, sge).unwrap();
    }

    /// SEND `bytes` (any length up to two frames); returns the wr_id.
    pub fn send(&mut self, bytes: &[u8]) -> u64 {
        self.send_wr(bytes, None)
    }

    /// SEND_WITH_INV of `bytes`, invalidating `rkey` at the victim.
    pub fn send_with_inv(&mut self, bytes: &[u8], rkey: u32) -> u64 {
        self.send_wr(bytes, Some(rkey))
    }

    fn send_wr(&mut self, bytes: &[u8], inv: Option<u32>) -> u64 {
        let wr_id = self.id(SEND_TAG);
        let offset = (wr_id as usize % SEND_SLOTS) * SEND_SLOT;
        self.nic.write_mr(self.send.id, offset, bytes).unwrap();
        let sge = SgeList::from([Sge { mr: self.send.id, offset, len: bytes.len() as u32 }]);
        let wr = match inv {
            None => SendWr::Send { wr_id, signaled: true, sge },
            Some(invalidate_rkey) => SendWr::SendWithInv { wr_id, signaled: true, sge, invalidate_rkey },
        };
        self.nic.post_send(self.qp.id, &[wr]).unwrap();
        self.sends += 1;
        wr_id
    }

    /// SEND a frame, granting the credit owed (unless `auto_credit` is off).
    pub fn send_frame(&mut self, f: &Frame<'_>) -> u64 {
        let credit = if self.auto_credit { self.take_grant() } else { 0 };
        let mut bytes = vec![0; MAX_FRAME];
        let n = f.encode_with_credit(credit, &mut bytes).unwrap();
        bytes.truncate(n);
        self.send(&bytes)
    }

    /// Credit for the receives posted and not granted yet.
    fn owed(&self) -> u64 {
        self.posted.saturating_sub(u64::from(INITIAL_CREDITS) + self.granted)
    }

    fn take_grant(&mut self) -> u16 {
        let g = self.owed().min(u64::from(u16::MAX));
        self.granted += g;
        g as u16
    }

    /// READ `len` bytes at `addr` through `rkey` into the (zeroed) destination.
    pub fn post_read(&mut self, addr: u64, rkey: u32, len: u32) -> u64 {
        let wr_id = self.id(READ_TAG);
        self.nic.write_mr(self.dst.id, 0, &vec![0; len as usize]).unwrap();
        let local = SgeList::from([Sge { mr: self.dst.id, offset: 0, len }]);
        self.nic
            .post_send(self.qp.id, &[SendWr::Read { wr_id, signaled: true, local, remote_addr: addr, rkey }])
            .unwrap();
        wr_id
    }

    pub fn dst_bytes(&self, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.nic.read_mr(self.dst.id, 0, &mut out).unwrap();
        out
    }

    pub fn completion(&self, wr_id: u64) -> Option<Completion> {
        self.sent.iter().find(|c| c.wr_id == wr_id).copied()
    }

    /// Take completions; returns whether there were any.
    fn poll(&mut self) -> bool {
        let Ok(cs) = self.nic.poll_cq_vec(self.cq, 64) else { return false };
        let any = !cs.is_empty();
        for c in cs {
            if c.wr_id & RECV_TAG != 0 && c.wr_id & SEND_TAG == 0 {
                if c.status.is_success() {
                    let slot = (c.wr_id & 0xffff) as usize;
                    let mut b = vec![0; c.byte_len as usize];
                    self.nic.read_mr(self.recv.id, slot * MAX_FRAME, &mut b).unwrap();
                    if let Ok((_, credit)) = Frame::decode_with_credit(&b) {
                        self.credit_granted += u64::from(credit);
                    }
                    self.frames.push_back(b);
                    if self.repost {
                        self.post_recv(slot);
                        if self.auto_credit && self.owed() >= 4 {
                            self.send_frame(&Frame::Credit);
                        }
                    }
                } else {
                    self.recv_errors.push(c);
                }
            } else {
                self.sent.push(c);
            }
        }
        any
    }

    /// A window over the first `len` bytes of the attacker's own memory,
    /// bound with a fresh key (for playing a hostile owner); returns its rkey.
    pub fn bind_own(&mut self, len: u32) -> u32 {
        let w = self.nic.alloc_mw().unwrap();
        let rkey = mwcap::backend::rkey::rebind(w.rkey, 0x5d);
        let wr = SendWr::BindMw {
            wr_id: self.id(SEND_TAG),
            signaled: false,
            mw: w.id,
            rkey,
            mr: self.mem.id,
            offset: 0,
            len: len as usize,
            access: Access::REMOTE_READ,
        };
        self.nic.post_send(self.qp.id, &[wr]).unwrap();
        rkey
    }
}

// ---- what the attacker makes of the victim's frames ----

/// The engine messages of one frame from the victim.
#[derive(Debug, Default)]
pub struct Seen {
    pub msg_id: Option<u64>,
    pub grant: Option<mw::Grant>,
    pub release: Option<mw::Release>,
    pub fetch: Option<fb::MsgId>,
    /// An `Offer` or `Expose`: (msg, buffer, generation, region).
    pub exposed: Option<(fb::MsgId, fb::BufferId, fb::Generation, fb::Region)>,
    pub verdict: Option<(fb::MsgId, fb::Verdict)>,
    pub confirm: Option<(fb::MsgId, fb::BufferId, fb::Generation)>,
    pub refuse: Option<fb::MsgId>,
    pub kind: &'static str,
    /// A reply's status and header.
    pub status: Option<u8>,
    pub header: Vec<u8>,
}

impl Seen {
    fn attach(&mut self, a: &Attach) {
        match a.engine {
            EngineTag::Mw => match mw::Message::decode(a.bytes()).expect("the victim's lease message") {
                mw::Message::Grant(g) => self.grant = Some(g),
                mw::Message::Release(r) => self.release = Some(r),
            },
            EngineTag::Confirm => {
                match fb::Message::decode(a.bytes()).expect("the victim's confirm message").0 {
                    fb::Message::Fetch { msg, .. } => self.fetch = Some(msg),
                    fb::Message::Offer { msg, buffer, generation, region }
                    | fb::Message::Expose { msg, buffer, generation, region } => {
                        self.exposed = Some((msg, buffer, generation, region))
                    }
                    fb::Message::ConfirmReply { msg, verdict, .. } => self.verdict = Some((msg, verdict)),
                    fb::Message::Confirm { msg, buffer, generation } => {
                        self.confirm = Some((msg, buffer, generation))
                    }
                    fb::Message::Refuse { msg } => self.refuse = Some(msg),
                    _ => {}
                }
            }
        }
    }

    pub fn of(bytes: &[u8]) -> Seen {
        let mut s = Seen::default();
        match Frame::decode(bytes).expect("the victim sends frames") {
            Frame::Request { msg_id, attach, .. } => {
                s.kind = "request";
                s.msg_id = Some(msg_id);
                attach.iter().for_each(|a| s.attach(a));
            }
            Frame::Ask { msg_id, attach, .. } => {
                s.kind = "ask";
                s.msg_id = Some(msg_id);
                attach.iter().for_each(|a| s.attach(a));
            }
            Frame::Reply { msg_id, status, header, attach, .. } => {
                s.kind = "reply";
                s.msg_id = Some(msg_id);
                s.status = Some(status);
                s.header = header.to_vec();
                attach.iter().for_each(|a| s.attach(a));
            }
            Frame::Engine(a) => {
                s.kind = "engine";
                s.attach(&a);
            }
            Frame::Ping { .. } => s.kind = "ping",
            Frame::Pong { .. } => s.kind = "pong",
            Frame::Credit => s.kind = "credit",
            Frame::Busy { msg_id, .. } => {
                s.kind = "busy";
                s.msg_id = Some(msg_id);
            }
            Frame::GiveBack { .. } => s.kind = "give back",
            Frame::Returned { .. } => s.kind = "returned",
        }
        s
    }

    /// Where the payload is: (addr, len, rkey).
    pub fn target(&self) -> (u64, u32, u32) {
        if let Some(g) = &self.grant {
            return (g.addr, g.len, g.rkey);
        }
        let (_, _, _, r) = self.exposed.expect("a grant, offer or exposure");
        (r.addr(), r.len(), r.rkey())
    }
}

pub fn mw_attach(m: mw::Message) -> Attach {
    Attach::new(EngineTag::Mw, &m.to_bytes()).unwrap()
}

pub fn fb_attach(m: fb::Message) -> Attach {
    Attach::new(EngineTag::Confirm, &m.to_bytes()).unwrap()
}

pub fn engine_frame(a: Attach) -> Vec<u8> {
    Frame::Engine(a).encode().unwrap()
}

pub fn request_frame(msg_id: u64, attach: &[Attach]) -> Vec<u8> {
    Frame::Request {
        msg_id,
        trace: None,
        header: b"hostile",
        inline: b"",
        attach: Attaches::from_slice(attach).unwrap(),
    }
    .encode()
    .unwrap()
}

pub fn reply_frame(msg_id: u64, attach: &[Attach]) -> Vec<u8> {
    Frame::Reply {
        msg_id,
        status: 0,
        header: b"hostile",
        inline: b"",
        attach: Attaches::from_slice(attach).unwrap(),
    }
    .encode()
    .unwrap()
}

// ---- the healthy connection ----

/// A client and a server on the same fabric, one of them on another PD of
/// the victim's device, calling each other with checked payloads every
/// few milliseconds.
pub struct Healthy {
    pub client: Link<SimNic>,
    pub server: Link<SimNic>,
    call: Option<(CallId, u32)>,
    next_at: Duration,
    seq: u32,
    /// Calls completed with correct payloads.
    pub done: u32,
    /// Anything that went wrong.
    pub failures: Vec<String>,
}

/// Time between the end of a healthy call and the next (virtual time: a
/// test that waits out leases and timeouts would otherwise make thousands).
const HEALTHY_EVERY: Duration = Duration::from_millis(8);
const HEALTHY_REQ: usize = 1500;
const HEALTHY_REP: usize = 2500;

impl Healthy {
    fn new(victim_dev: &SimNic, fabric: &Fabric, victim_role: Role, policies: Policies) -> Healthy {
        let own_pd = victim_dev.new_pd().unwrap();
        let friend = fabric.add_device(DeviceConfig::spec().named("friend"));
        let (cn, sn) = match victim_role {
            Role::Client => (own_pd, friend),
            Role::Server => (friend, own_pd),
        };
        let mut client = Link::new(cn, Role::Client, policies, config()).unwrap();
        let mut server = Link::new(sn, Role::Server, policies, config()).unwrap();
        let (c, s) = (client.local(), server.local());
        client.connect(&s).unwrap();
        server.connect(&c).unwrap();
        // Every free buffer of both sides holds the secret.
        for ep in [&mut client, &mut server] {
            let bufs: Vec<Buf> = std::iter::from_fn(|| ep.alloc()).collect();
            for mut b in bufs {
                b.copy_from(&secret_payload(0, BUFFER_SIZE as usize)).unwrap();
                ep.free(b);
            }
        }
        Healthy { client, server, call: None, next_at: Duration::ZERO, seq: 0, done: 0, failures: Vec::new() }
    }

    fn timeouts(&self) -> [Option<Duration>; 3] {
        [self.client.poll_timeout(), self.server.poll_timeout(), self.call.is_none().then_some(self.next_at)]
    }

    fn tick(&mut self, now: Duration) -> bool {
        let mut any = false;
        for ep in [&mut self.client, &mut self.server] {
            ep.handle_timeout(now);
            ep.drive(now);
        }
        while let Some(e) = self.server.poll_event() {
            any = true;
            match e {
                Event::Request { req, header, data, .. } => {
                    let seq = u32::from_le_bytes(header[..4].try_into().unwrap());
                    match data {
                        Some(d) => {
                            if d.to_vec() != secret_payload(seq, HEALTHY_REQ) {
                                self.failures.push(format!("request {seq}: wrong payload"));
                            }
                            self.server.free(d);
                        }
                        None => self.failures.push(format!("request {seq}: no payload")),
                    }
                    self.answer(now, req, seq);
                }
                Event::ReplyAgain { req, .. } => self.answer(now, req, self.seq),
                Event::BufferReturned(b) => self.server.free(b),
                other => self.failures.push(format!("server: {other:?}")),
            }
        }
        while let Some(e) = self.client.poll_event() {
            any = true;
            match e {
                Event::Reply { call, data, .. } => {
                    match (self.call.take(), data) {
                        (Some((c, seq)), Some(d)) if c == call => {
                            if d.to_vec() != secret_payload(seq | 1 << 31, HEALTHY_REP) {
                                self.failures.push(format!("reply {seq}: wrong payload"));
                            } else {
                                self.done += 1;
                            }
                            self.client.free(d);
                        }
                        other => self.failures.push(format!("unexpected reply {other:?}")),
                    }
                    self.next_at = now + HEALTHY_EVERY;
                }
                Event::BufferReturned(b) => self.client.free(b),
                other => self.failures.push(format!("client: {other:?}")),
            }
        }
        if self.call.is_none() && now >= self.next_at && self.failures.is_empty() {
            self.seq += 1;
            let seq = self.seq;
            if let Some(mut b) = self.client.alloc() {
                b.copy_from(&secret_payload(seq, HEALTHY_REQ)).unwrap();
                match self.client.call(now, &seq.to_le_bytes(), Some(b)) {
                    Ok(c) => self.call = Some((c, seq)),
                    Err(r) => self.failures.push(format!("call refused: {r}")),
                }
                any = true;
            }
        }
        any
    }

    fn answer(&mut self, now: Duration, req: RequestId, seq: u32) {
        let Some(mut b) = self.server.alloc() else {
            return self.failures.push("server: no buffer".into());
        };
        b.copy_from(&secret_payload(seq | 1 << 31, HEALTHY_REP)).unwrap();
        if let Err(r) = self.server.reply(now, req, 0, b"ok", Some(b)) {
            self.failures.push(format!("reply refused: {r}"));
        }
    }
}

// ---- the world ----

pub struct World {
    pub fabric: Fabric,
    pub policies: Policies,
    pub role: Role,
    pub victim: Link<SimNic>,
    pub attacker: Attacker,
    pub healthy: Healthy,
    /// The victim's events, except buffers coming back (counted, scribbled
    /// with the secret and freed at once).
    pub events: Vec<Event>,
    /// Buffers the victim got back.
    pub returned: usize,
    /// Buffers that came back while the attacker could still reach them (mw).
    pub reachable_after_return: Vec<u32>,
}

impl World {
    /// A victim of `role` under `policies`, connected to the attacker,
    /// with every free buffer holding the secret.
    pub fn new(role: Role, policies: Policies) -> World {
        World::with_recvs(role, policies, CTRL_SLOTS as usize * 2)
    }

    /// [`World::new`], with the attacker posting only `recvs` receives.
    pub fn with_recvs(role: Role, policies: Policies, recvs: usize) -> World {
        World::build(role, policies, config(), recvs, DeviceConfig::spec())
    }

    /// [`World::new`] with the victim (and its other connection) on a
    /// device that behaves like `device` (e.g. [`DeviceConfig::rxe`]).
    pub fn on(role: Role, policies: Policies, device: DeviceConfig) -> World {
        World::build(role, policies, config(), CTRL_SLOTS as usize * 2, device)
    }

    /// [`World::new`] with the victim's settings changed by `tweak` (its
    /// other connection keeps [`config`]).
    pub fn with_config(role: Role, policies: Policies, tweak: impl FnOnce(&mut Config)) -> World {
        let mut cfg = config();
        tweak(&mut cfg);
        World::build(role, policies, cfg, CTRL_SLOTS as usize * 2, DeviceConfig::spec())
    }

    fn build(role: Role, policies: Policies, cfg: Config, recvs: usize, device: DeviceConfig) -> World {
        let fabric =
            Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(0x4057) });
        let vdev = fabric.add_device(device.named("victim"));
        let mut victim = Link::new(vdev.clone(), role, policies, cfg).unwrap();
        let mut attacker = Attacker::new(&fabric);
        attacker.nic.connect_qp(attacker.qp.id, &victim.local()).unwrap();
        victim.connect(&attacker.qp).unwrap();
        attacker.post_recvs(recvs);
        let bufs: Vec<Buf> = std::iter::from_fn(|| victim.alloc()).collect();
        for mut b in bufs {
            b.copy_from(&secret_payload(0, BUFFER_SIZE as usize)).unwrap();
            victim.free(b);
        }
        let healthy = Healthy::new(&vdev, &fabric, role, policies);
        World {
            fabric,
            policies,
            role,
            victim,
            attacker,
            healthy,
            events: Vec::new(),
            returned: 0,
            reachable_after_return: Vec::new(),
        }
    }

    pub fn server(policies: Policies) -> World {
        World::new(Role::Server, policies)
    }

    pub fn client(policies: Policies) -> World {
        World::new(Role::Client, policies)
    }

    pub fn now(&self) -> Duration {
        self.fabric.now()
    }

    pub fn victim_device(&self) -> DeviceId {
        self.victim.nic().device()
    }

    /// The policy of the direction the victim owns (its payloads, which the
    /// attacker reads).
    pub fn owned(&self) -> Policy {
        self.policies.directions(self.role).0
    }

    fn take_victim_events(&mut self) -> bool {
        let mut any = false;
        while let Some(e) = self.victim.poll_event() {
            any = true;
            match e {
                Event::BufferReturned(mut b) => {
                    self.returned += 1;
                    let size = BUFFER_SIZE as usize;
                    let range = b.slot() as usize * size..(b.slot() as usize + 1) * size;
                    let mr = self.victim.data_region().id;
                    // (Under confirm the region key reaches every buffer of
                    // the region by design: see the confirm security note.)
                    if self.owned() == Policy::Mw
                        && self.fabric.can_reach(self.attacker.qp_addr(), self.victim_device(), mr, range)
                    {
                        self.reachable_after_return.push(b.slot());
                    }
                    b.copy_from(&secret_payload(0, size)).unwrap();
                    self.victim.free(b);
                }
                other => self.events.push(other),
            }
        }
        any
    }

    /// Take in everything due now.
    pub fn settle(&mut self) {
        let now = self.now();
        for _ in 0..1000 {
            self.fabric.run_until(now);
            self.victim.handle_timeout(now);
            self.victim.drive(now);
            if self.victim.flushed() {
                // As an endpoint's driver does once the flushes are in: the
                // destroy is the evidence window-exposed memory waits for.
                self.victim.finish_close(now);
            }
            let mut any = self.take_victim_events();
            any |= self.healthy.tick(now);
            any |= self.attacker.poll();
            let due = self.fabric.next_event_at().is_some_and(|t| t <= now);
            if !any && !due {
                return;
            }
        }
    }

    fn next_wakeup(&self) -> Option<Duration> {
        let mut all = vec![self.fabric.next_event_at(), self.victim.poll_timeout()];
        all.extend(self.healthy.timeouts());
        all.into_iter().flatten().min()
    }

    /// Run until `pred` holds or `limit` of virtual time passed; returns `pred`.
    pub fn run_until(&mut self, limit: Duration, mut pred: impl FnMut(&mut World) -> bool) -> bool {
        let end = self.now() + limit;
        loop {
            self.settle();
            if pred(self) {
                return true;
            }
            let now = self.now();
            if now >= end {
                return false;
            }
            let t = self.next_wakeup().map_or(end, |t| t.max(now + Duration::from_micros(1)).min(end));
            self.fabric.run_until(t);
        }
    }

    pub fn run_for(&mut self, d: Duration) {
        self.run_until(d, |_| false);
    }

    // ---- the attacker's moves ----

    /// The next frame the victim sends the attacker.
    pub fn next_frame(&mut self) -> Vec<u8> {
        assert!(
            self.run_until(Duration::from_millis(50), |w| !w.attacker.frames.is_empty()),
            "the victim sent nothing; down: {:?}",
            self.victim.is_down()
        );
        self.attacker.frames.pop_front().unwrap()
    }

    /// READ through the NIC; returns the status and the bytes that landed.
    /// Never returns the secret: that is checked here for every READ.
    pub fn read(&mut self, addr: u64, rkey: u32, len: u32) -> (WcStatus, Vec<u8>) {
        let wr = self.attacker.post_read(addr, rkey, len);
        assert!(self.run_until(Duration::from_millis(50), |w| w.attacker.completion(wr).is_some()));
        let c = self.attacker.completion(wr).unwrap();
        let got = self.attacker.dst_bytes(len as usize);
        assert!(!contains_secret(&got), "the attacker read a secret with status {:?}", c.status);
        (c.status, got)
    }

    /// [`World::send`], once the victim has granted credit for it (an
    /// attacker that keeps to the flow control).
    pub fn send_within_credit(&mut self, bytes: &[u8]) -> u64 {
        let has = self.run_until(Duration::from_millis(50), |w| w.attacker.sends < w.attacker.credit_granted);
        assert!(has, "no credit from the victim; down: {:?}", self.victim.is_down());
        self.send(bytes)
    }

    /// Send `m` and return the victim's verdict on it.
    pub fn verdict(&mut self, m: fb::Message) -> fb::Verdict {
        self.attacker.frames.clear();
        self.send(&engine_frame(fb_attach(m)));
        loop {
            // (Other frames may come first: a client's refuse of a fetch that timed out.)
            if let Some((_, v)) = Seen::of(&self.next_frame()).verdict {
                return v;
            }
        }
    }

    /// SEND a frame and let the victim take it in.
    pub fn send(&mut self, bytes: &[u8]) -> u64 {
        let wr = self.attacker.send(bytes);
        self.run_until(Duration::from_millis(5), |w| w.attacker.completion(wr).is_some());
        wr
    }

    // ---- the victim's user ----

    /// Victim server: take the next request handed to the user.
    pub fn take_request(&mut self) -> (RequestId, Option<Buf>) {
        let found = self.run_until(Duration::from_millis(50), |w| {
            w.events.iter().any(|e| matches!(e, Event::Request { .. }))
        });
        assert!(found, "no request; events {:?}, down {:?}", self.events, self.victim.is_down());
        let pos = self.events.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
        match self.events.remove(pos) {
            Event::Request { req, data, .. } => (req, data),
            _ => unreachable!(),
        }
    }

    /// A buffer of the victim holding `PAYLOAD` granted bytes (the rest of
    /// the buffer keeps the secret).
    pub fn granted_buf(&mut self) -> Buf {
        let mut b = self.victim.alloc().expect("a free buffer");
        b.write_with(|s| {
            s[..PAYLOAD].fill(GRANTED);
            PAYLOAD
        })
        .unwrap();
        b
    }

    /// Victim server: reply to `req` with a granted payload.
    pub fn reply_granted(&mut self, req: RequestId) {
        let b = self.granted_buf();
        let now = self.now();
        self.victim.reply(now, req, 0, b"here", Some(b)).unwrap();
    }

    /// Victim client: call with a granted payload.
    pub fn call_granted(&mut self) -> CallId {
        let b = self.granted_buf();
        let now = self.now();
        self.victim.call(now, b"hello", Some(b)).unwrap()
    }

    /// Attacker as a client: send request `msg_id` (with a fetch under a
    /// confirm reply policy), have the victim server reply with a payload,
    /// and return what the reply exposes.
    pub fn ask_for_payload(&mut self, msg_id: u64) -> Seen {
        let attach = match self.policies.reply {
            Policy::Confirm => {
                vec![fb_attach(fb::Message::Fetch { msg: fb::MsgId::from_raw(msg_id), attempt: 1 })]
            }
            Policy::Mw => vec![],
        };
        self.send(&request_frame(msg_id, &attach));
        let (req, data) = self.take_request();
        assert!(data.is_none());
        self.reply_granted(req);
        let seen = Seen::of(&self.next_frame());
        assert_eq!(seen.kind, "reply");
        seen
    }

    /// Attacker as a server: the victim client calls with a payload; returns
    /// what its request exposes.
    pub fn take_call(&mut self) -> (CallId, Seen) {
        let call = self.call_granted();
        let seen = Seen::of(&self.next_frame());
        assert_eq!(seen.kind, "request");
        (call, seen)
    }

    /// The victim's payload, as the attacker gets it by the book.
    pub fn payload(&mut self, seen: &Seen) -> (WcStatus, Vec<u8>) {
        let (addr, len, rkey) = seen.target();
        let (st, got) = self.read(addr, rkey, len.min(PAYLOAD as u32));
        if st.is_success() {
            assert_eq!(got, vec![GRANTED; PAYLOAD], "the granted bytes");
        }
        (st, got)
    }

    // ---- the end ----

    pub fn down(&self) -> Option<&LossReason> {
        self.victim.is_down()
    }

    /// Buffers held by the victim's user (in events): freed.
    fn free_held(&mut self) {
        for e in std::mem::take(&mut self.events) {
            match e {
                Event::Request { data: Some(b), .. } | Event::Reply { data: Some(b), .. } => {
                    self.victim.free(b)
                }
                _ => {}
            }
        }
    }

    /// The checks every test ends with: the healthy connection worked
    /// throughout and goes on working; nothing the sim counts as a hazard
    /// happened; no buffer came back while the attacker could reach it; the
    /// victim closes with every buffer back.
    pub fn finish(self) {
        self.finish_with(|h| assert!(h.is_empty(), "hazards: {h:?}"));
    }

    /// [`World::finish`], with the hazards checked by `hazards`.
    pub fn finish_with(mut self, hazards: impl Fn(&[mwcap::sim::Hazard])) {
        self.settle();
        // While the victim is in whatever state the attack left it...
        let start = self.healthy.done;
        self.run_for(HEALTHY_EVERY * 2);
        assert!(self.healthy.done > start, "the healthy connection completes calls during the attack");
        // ...and after the victim closed.
        let before = self.healthy.done;
        let now = self.now();
        let reason = self.down().cloned().unwrap_or(LossReason::Closed);
        self.victim.close(now);
        self.settle();
        // The user heard of the loss once, with the reason it went down for.
        let lost: Vec<&LossReason> = self
            .events
            .iter()
            .filter_map(|e| match e {
                Event::ConnectionLost(r) => Some(r),
                _ => None,
            })
            .collect();
        assert_eq!(lost, [&reason], "one ConnectionLost event");
        self.free_held();
        assert_eq!(self.victim.busy_buffers(), 0, "the victim got every buffer back");
        assert_eq!(self.victim.free_buffers(), BUFFERS as usize, "no buffer lost");
        self.run_for(HEALTHY_EVERY * 2);
        assert!(self.healthy.failures.is_empty(), "healthy connection: {:?}", self.healthy.failures);
        assert!(self.healthy.client.is_down().is_none() && self.healthy.server.is_down().is_none());
        assert!(self.healthy.done > before, "the healthy connection keeps completing calls");
        assert!(
            self.reachable_after_return.is_empty(),
            "returned while reachable: {:?}",
            self.reachable_after_return
        );
        hazards(&self.fabric.hazards());
    }

    /// Under mw: every bind was invalidated exactly once, by the owner (no
    /// lease is live, and no invalidation the sim would call a crash).
    pub fn assert_binds_invalidated_once(&self) {
        let s = self.victim.stats().lease_owner.expect("the victim owns a direction under mw");
        assert_eq!(s.grants, s.invalidations, "{s:?}");
        assert_eq!(s.invalidations, s.released + s.expired + s.revoked, "{s:?}");
        assert!(self.fabric.would_crash_rxe().is_empty());
        assert!(
            self.fabric.exposure(self.victim_device(), self.attacker.qp_addr()).is_empty(),
            "no window of the victim is reachable by the attacker"
        );
    }
}
