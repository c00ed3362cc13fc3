//! The random-schedule world shared by the proptest suite
//! (`prop_endpoint.rs`) and the torture run (`torture.rs`): a client and a
//! server endpoint on the simulated NIC, operations that drive them, and
//! the safety checks made after every step (see `prop_endpoint.rs`).

use std::collections::VecDeque;
use std::time::Duration;

use mwcap::conn::{Buf, Config, Event, Policies, Policy, RequestId, SimPair};

#[derive(Clone, Debug)]
pub enum Op {
    Call {
        len: u16,
        payload: bool,
    },
    Reply {
        pick: u8,
        len: u16,
        payload: bool,
    },
    Cancel {
        pick: u8,
    },
    Advance {
        ms: u16,
    },
    LinkDelay {
        ms: u16,
    },
    /// The link drops every packet for `ms` of simulated time, then
    /// carries them again: lost packets, resent by the transport within
    /// its retries (about 7 ms), or the connection lost past them.
    LinkLoss {
        ms: u16,
    },
    QpError {
        client: bool,
    },
    KillServer,
}

fn pattern(seq: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seq as usize).wrapping_mul(131).wrapping_add(i * 7) as u8 ^ 0x3c).collect()
}

fn header(seq: u32, len: usize) -> Vec<u8> {
    let mut h = seq.to_le_bytes().to_vec();
    h.extend_from_slice(&(len as u32).to_le_bytes());
    h
}

fn parse(h: &[u8]) -> (u32, usize) {
    (
        u32::from_le_bytes(h[0..4].try_into().unwrap()),
        u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize,
    )
}

pub struct World {
    pub p: SimPair,
    pub policies: Policies,
    pub seq: u32,
    pub calls: Vec<(mwcap::conn::CallId, u32)>,
    pub pending: VecDeque<(RequestId, u32)>,
    pub given: [usize; 2],
    pub returned: [usize; 2],
    /// The server process died: its memory is gone and nobody drives it.
    pub server_dead: bool,
    /// Calls made (accepted by `call`), replies delivered (payloads
    /// checked) and calls failed.
    pub made: u64,
    pub replies: u64,
    pub failed: u64,
}

const SCRIBBLE: [u8; 16] = [0xee; 16];

impl World {
    pub fn new(policies: Policies, seed: u64) -> World {
        let cfg = || {
            let mut c = Config::default();
            c.buffers = 6;
            c.buffer_size = 8192;
            // Payloads of every path: inline (up to 256 bytes), a standard
            // buffer, and a large class READ in 16 KiB chunks.
            c.large_buffers = vec![mwcap::conn::BufClass { size: 64 << 10, count: 2 }];
            c.read_chunk = 16 << 10;
            c.lease_time = Duration::from_millis(2000);
            c.safety_margin = Duration::from_millis(200);
            c.call_timeout = Duration::from_millis(4000);
            c.seed = Some(seed);
            c
        };
        let p = SimPair::spec(seed, policies, cfg(), cfg()).unwrap();
        World {
            p,
            policies,
            seq: 0,
            calls: Vec::new(),
            pending: VecDeque::new(),
            given: [0; 2],
            returned: [0; 2],
            server_dead: false,
            made: 0,
            replies: 0,
            failed: 0,
        }
    }

    fn filled(&mut self, client: bool, seq: u32, len: usize) -> Option<Buf> {
        let ep = if client { &mut self.p.client } else { &mut self.p.server };
        let mut b = ep.alloc_for(len).unwrap()?;
        b.copy_from(&pattern(seq, len)).unwrap();
        Some(b)
    }

    pub fn apply(&mut self, op: &Op) {
        let now = self.p.now();
        match *op {
            Op::Call { len, payload } => {
                self.seq += 1;
                let seq = self.seq;
                let len = len as usize;
                let data = if payload { self.filled(true, seq, len) } else { None };
                let had = data.is_some();
                let h = header(seq, if had { len } else { 0 });
                match self.p.client.call(now, &h, data) {
                    Ok(id) => {
                        self.made += 1;
                        self.calls.push((id, seq));
                        // An inline payload was copied into the frame and its
                        // buffer freed at once: only the others come back.
                        if had && len > self.p.client.config().inline_max as usize {
                            self.given[0] += 1;
                        }
                    }
                    Err(_) => {
                        // Refused (backpressure, or down): the buffer was not taken.
                    }
                }
            }
            Op::Reply { pick, len, payload } => {
                if self.pending.is_empty() || self.server_dead {
                    return;
                }
                let i = pick as usize % self.pending.len();
                let (req, seq) = self.pending.remove(i).unwrap();
                let len = len as usize;
                let rseq = seq | 0x8000_0000;
                let data = if payload { self.filled(false, rseq, len) } else { None };
                let had = data.is_some();
                let h = header(rseq, if had { len } else { 0 });
                let inline = len <= self.p.server.config().inline_max as usize;
                if self.p.server.reply(now, req, 0, &h, data).is_ok() && had && !inline {
                    self.given[1] += 1;
                }
            }
            Op::Cancel { pick } => {
                if !self.calls.is_empty() {
                    let (id, _) = self.calls[pick as usize % self.calls.len()];
                    self.p.client.cancel(now, id);
                }
            }
            Op::Advance { ms } => self.p.run_for(Duration::from_millis(ms.into())),
            Op::LinkDelay { ms } => {
                let (c, s) = (self.p.client_device(), self.p.server_device());
                self.p.fabric.set_link_delay(c, s, Duration::from_millis(ms.into()));
            }
            Op::LinkLoss { ms } => {
                let (c, s) = (self.p.client_device(), self.p.server_device());
                self.p.fabric.cut_link(c, s);
                self.p.run_for(Duration::from_millis(ms.into()));
                self.p.fabric.restore_link(c, s);
            }
            Op::QpError { client } => {
                let qp = if client { self.p.client_qp() } else { self.p.server_qp() };
                self.p.fabric.force_qp_error(qp);
            }
            Op::KillServer => {
                self.p.fabric.kill_device(self.p.server_device());
                self.server_dead = true;
            }
        }
        self.p.settle();
        self.take_events();
    }

    /// Consume events: check every payload, scribble over every returned buffer.
    pub fn take_events(&mut self) {
        for e in std::mem::take(&mut self.p.server_events) {
            match e {
                Event::Request { req, header, data, .. } => {
                    let (seq, len) = parse(&header);
                    if let Some(d) = data.filter(|_| !self.server_dead) {
                        let got = d.to_vec();
                        assert_eq!(
                            got,
                            pattern(seq, len),
                            "server accepted a stale or wrong request payload"
                        );
                        self.p.server.free(d);
                    }
                    self.pending.push_back((req, seq));
                }
                Event::BufferReturned(mut b) => {
                    self.returned[1] += 1;
                    if self.server_dead {
                        continue;
                    }
                    b.copy_from(&SCRIBBLE).unwrap();
                    self.p.server.free(b);
                }
                Event::ReplyAgain { req, header, .. } => {
                    // The client read a stale reply; answer again with fresh
                    // data, from the request's header (it comes again).
                    let (seq, _) = parse(&header);
                    self.pending.push_back((req, seq));
                }
                _ => {}
            }
        }
        for e in std::mem::take(&mut self.p.client_events) {
            match e {
                Event::Reply { call, header, data, .. } => {
                    let (rseq, len) = parse(&header);
                    let (_, seq) =
                        *self.calls.iter().find(|(c, _)| *c == call).expect("reply to a known call");
                    assert_eq!(rseq, seq | 0x8000_0000, "reply delivered to the wrong call");
                    if let Some(d) = data {
                        let got = d.to_vec();
                        assert_eq!(got, pattern(rseq, len), "client accepted a stale or wrong reply payload");
                        self.p.client.free(d);
                    }
                    self.calls.retain(|(c, _)| *c != call);
                    self.replies += 1;
                }
                Event::CallFailed { call, .. } => {
                    self.calls.retain(|(c, _)| *c != call);
                    self.failed += 1;
                }
                Event::BufferReturned(mut b) => {
                    self.returned[0] += 1;
                    b.copy_from(&SCRIBBLE).unwrap();
                    self.p.client.free(b);
                }
                _ => {}
            }
        }
    }

    /// Let leases expire and retries run out, close both sides, and check
    /// that every buffer given to the NIC came back (invariant 5).
    pub fn finish(&mut self) {
        self.p.run_for(Duration::from_secs(10));
        self.take_events();
        self.check();
        let now = self.p.now();
        self.p.client.close(now);
        self.p.server.close(now);
        self.p.settle();
        self.take_events();
        self.check();
        assert_eq!(self.p.client.busy_buffers(), 0);
        assert_eq!(self.returned[0], self.given[0], "every client buffer given to the NIC must come back");
        if !self.server_dead {
            assert_eq!(self.p.server.busy_buffers(), 0);
            assert_eq!(
                self.returned[1], self.given[1],
                "every server buffer given to the NIC must come back"
            );
        }
    }

    /// Invariants 1-3, through the oracle.
    pub fn check(&self) {
        let f = &self.p.fabric;
        assert!(f.would_crash_rxe().is_empty(), "would crash rxe: {:?}", f.would_crash_rxe());
        assert!(f.hazards().is_empty(), "hazards: {:?}", f.hazards());
        let sides = [
            (
                &self.p.client,
                self.p.client_device(),
                self.p.server_qp(),
                self.policies.request,
                self.p.client_qp(),
            ),
            (
                &self.p.server,
                self.p.server_device(),
                self.p.client_qp(),
                self.policies.reply,
                self.p.server_qp(),
            ),
        ];
        for (ep, dev, peer, owned, me) in sides {
            let ranges = ep.buffer_ranges();
            let mr = ep.data_region();
            if owned == Policy::Mw {
                // Every buffer of every class: standard and large.
                for (slot, (r, busy)) in ranges.iter().enumerate() {
                    if !busy {
                        assert!(
                            !f.can_reach(peer, dev, mr.id, r.clone()),
                            "buffer {slot} is back with its owner but the peer can still reach it"
                        );
                    }
                }
            }
            for read in f.in_flight().iter().filter(|r| r.requester == me) {
                for sge in &read.dest {
                    if sge.mr == mr.id {
                        let inside = ranges.iter().any(|(b, busy)| {
                            *busy && b.start <= sge.offset && sge.offset + sge.len as usize <= b.end
                        });
                        assert!(inside, "a READ is in flight into a buffer the user holds: {read:?}");
                    }
                }
            }
        }
    }
}
