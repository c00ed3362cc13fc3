//! The sans-IO connection alone: two `proto::Connection`s, client and
//! server, whose commands this program carries out on byte vectors (no
//! `Nic`, no simulator, no executor), for counting what the protocol layer
//! and its engines cost per call with callgrind (`tests/cost/callgrind.sh`
//! reports the inclusive cost of `proto::Connection`'s entry points).
//!
//!   cargo run --release --example proto_cost -- CASE CALLS
//!
//! CASE is `rpc` (64-byte header, no payload), `mw` or `confirm` (a 4 KiB
//! reply payload the client READs).

use std::collections::VecDeque;
use std::time::Duration;

use mwcap::backend::{Completion, MrId, MrInfo, MwId, MwInfo, SendWr, Sge, WcOpcode, WcStatus};
use mwcap::conn::proto::{Command, Connection, DataMemory, Resources};
use mwcap::conn::{Config, Event, Policies, Policy, Role, MAX_FRAME};

const BUFFERS: u32 = 16;
const SIZE: u32 = 4096;
const SLOTS: u32 = 16;

struct Side {
    conn: Connection,
    ctrl: Vec<u8>,
    data: Vec<u8>,
    addr: u64,
    recvs: VecDeque<(u64, Sge)>,
    cq: VecDeque<Completion>,
}

fn done(cq: &mut VecDeque<Completion>, wr_id: u64, opcode: WcOpcode, byte_len: u32) {
    let c = Completion {
        wr_id,
        status: WcStatus::Success,
        opcode,
        byte_len,
        invalidated_rkey: None,
        qpn: 0,
        vendor_err: 0,
    };
    cq.push_back(c);
}

impl Side {
    fn new(role: Role, p: Policy, addr: u64) -> Side {
        let mut cfg = Config::default();
        cfg.buffers = BUFFERS;
        cfg.buffer_size = SIZE;
        cfg.region_exposures = 0; // windows for pool buffers only (no user regions here)
        cfg.ctrl_slots = SLOTS;
        cfg.call_timeout = Duration::from_secs(600);
        cfg.lease_time = Duration::from_secs(300);
        let data = MrInfo { id: MrId::from_raw(2), addr, len: (BUFFERS * SIZE) as usize, lkey: 2, rkey: 7 };
        let mw = Policies::both(p).directions(role).0 == Policy::Mw;
        let n = if mw { BUFFERS } else { 0 };
        let res = Resources {
            ctrl: MrId::from_raw(1),
            data: DataMemory::Region(data, mwcap::backend::Memory::zeroed(data.len, 8).expect("memory")),
            windows: (0..n).map(|i| MwInfo { id: MwId::from_raw(10 + i), rkey: (0x100 + i) << 8 }).collect(),
        };
        let mut conn = Connection::new(role, Policies::both(p), cfg, res);
        conn.start(conn.config().start_credits);
        Side {
            conn,
            ctrl: vec![0; MAX_FRAME * 2 * SLOTS as usize],
            data: vec![0; (BUFFERS * SIZE) as usize],
            addr,
            recvs: VecDeque::new(),
            cq: VecDeque::new(),
        }
    }
}

/// Carry out `me`'s commands (SENDs land in `peer`, READs copy from it).
fn run(me: &mut Side, peer: &mut Side) -> bool {
    let mut any = false;
    let (ctrl, data, recvs, cq) = (&mut me.ctrl, &mut me.data, &mut me.recvs, &mut me.cq);
    me.conn.drain_commands(|cmd, staged| {
        any = true;
        match cmd {
            Command::PostRecv { wr_id, sge } => recvs.push_back((*wr_id, *sge)),
            Command::PostSend { chain, frame } => {
                if let Some(f) = frame {
                    ctrl[f.offset..f.offset + staged.len()].copy_from_slice(staged);
                }
                for w in chain.as_slice() {
                    match *w {
                        SendWr::Send { wr_id, sge, .. } => {
                            let s = sge[0];
                            let (rid, r) = peer.recvs.pop_front().expect("a receive is posted");
                            let (src, dst) = (&ctrl[s.offset..s.offset + s.len as usize], r.offset);
                            peer.ctrl[dst..dst + src.len()].copy_from_slice(src);
                            done(&mut peer.cq, rid, WcOpcode::Recv, s.len);
                            done(cq, wr_id, WcOpcode::Send, 0);
                        }
                        SendWr::Read { wr_id, local, remote_addr, .. } => {
                            let l = local[0];
                            let at = (remote_addr - peer.addr) as usize;
                            data[l.offset..l.offset + l.len as usize]
                                .copy_from_slice(&peer.data[at..at + l.len as usize]);
                            done(cq, wr_id, WcOpcode::RdmaRead, l.len);
                        }
                        SendWr::LocalInv { wr_id, .. } => done(cq, wr_id, WcOpcode::LocalInv, 0),
                        SendWr::BindMw { wr_id, signaled: true, .. } => done(cq, wr_id, WcOpcode::BindMw, 0),
                        _ => {}
                    }
                }
            }
            Command::SetQpError => panic!("the connection went down: it asked for its QP to go to ERR"),
        }
        Ok(())
    });
    while let Some(c) = me.cq.pop_front() {
        any = true;
        let (off, len) = me.conn.received_frame(&c).unwrap_or((0, 0));
        let frame = std::mem::take(&mut me.ctrl);
        me.conn.handle_completion(Duration::from_secs(1), &c, &frame[off..off + len]);
        me.ctrl = frame;
    }
    any
}

fn main() {
    let mut args = std::env::args().skip(1);
    let case = args.next().unwrap_or_else(|| "mw".into());
    let calls: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let (policy, size) = match case.as_str() {
        "rpc" => (Policy::Mw, 0),
        "mw" => (Policy::Mw, 4096),
        "confirm" => (Policy::Confirm, 4096),
        other => panic!("unknown case {other:?}; use rpc, mw or confirm"),
    };
    let mut c = Side::new(Role::Client, policy, 0x1000_0000);
    let mut s = Side::new(Role::Server, policy, 0x2000_0000);
    let now = Duration::from_secs(1);
    // Post both sides' receives before anything is sent.
    run(&mut s, &mut c);
    run(&mut c, &mut s);
    let header = [7u8; 64];
    for _ in 0..200 + calls {
        c.conn.call(now, &header, None).expect("call");
        let mut replied = false;
        loop {
            let busy = run(&mut c, &mut s) | run(&mut s, &mut c);
            while let Some(e) = s.conn.poll_event() {
                match e {
                    Event::Request { req, data, .. } => {
                        assert!(data.is_none());
                        let out = (size > 0).then(|| {
                            let mut b = s.conn.alloc().expect("a server buffer");
                            b.set_len(size).unwrap();
                            b
                        });
                        s.conn.reply(now, req, 0, b"ok", out).expect("reply");
                    }
                    Event::BufferReturned(b) => s.conn.free(b),
                    other => panic!("server: {other:?}"),
                }
            }
            while let Some(e) = c.conn.poll_event() {
                match e {
                    Event::Reply { data, .. } => {
                        if let Some(d) = data {
                            c.conn.free(d);
                        }
                        replied = true;
                    }
                    Event::BufferReturned(b) => c.conn.free(b),
                    other => panic!("client: {other:?}"),
                }
            }
            if !busy && replied {
                break;
            }
        }
    }
    eprintln!("proto_cost: {case}: {calls} calls after 200 warm-up calls");
}
