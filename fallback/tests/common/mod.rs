//! `Pair`: a client and a server engine over a scripted RC connection with a
//! virtual clock, fake memory and fault knobs. Messages cross as encoded
//! bytes, so the wire codec is on the path.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use mwcap_fallback::{Action, BufferId, Client, Config, Event, Message, ReadToken, Region, Server};

pub const CLIENT_BASE: u64 = 0x1000;
pub const SERVER_BASE: u64 = 0x8000;
pub const BUF_LEN: u32 = 16;
pub const RKEY_C: u32 = 0xc1;
pub const RKEY_S: u32 = 0x5e;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// A READ posted by `reader`: waiting for the responder (`sampled: None`),
/// then waiting for its completion.
#[derive(Debug)]
pub struct InFlight {
    pub reader: Side,
    pub token: ReadToken,
    pub remote: Region,
    pub sampled: Option<Vec<u8>>,
}

pub struct Pair {
    pub now: Duration,
    pub client: Client,
    pub server: Server,
    pub client_mem: Vec<u8>,
    pub server_mem: Vec<u8>,
    pub to_server: VecDeque<Vec<u8>>,
    pub to_client: VecDeque<Vec<u8>>,
    pub reads: Vec<InFlight>,
    /// Completed READ destinations by reader side.
    pub client_dest: BTreeMap<ReadToken, Vec<u8>>,
    pub server_dest: BTreeMap<ReadToken, Vec<u8>>,
    pub client_events: Vec<Event>,
    pub server_events: Vec<Event>,
    /// Knobs: hold messages in the queue, hold READs at the responder or
    /// before completion, or kill a side (its engine stops; its NIC still
    /// answers READs).
    pub hold_to_server: bool,
    pub hold_to_client: bool,
    pub hold_reads: bool,
    pub client_dead: bool,
    pub server_dead: bool,
}

impl Pair {
    pub fn new(config: Config, buffers: u32) -> Pair {
        let mut client = Client::new(config.clone());
        let mut server = Server::new(config);
        for i in 0..buffers {
            let off = u64::from(i * BUF_LEN);
            client.add_buffer(Region::new(CLIENT_BASE + off, BUF_LEN, RKEY_C));
            server.add_buffer(Region::new(SERVER_BASE + off, BUF_LEN, RKEY_S));
        }
        let mem = vec![0u8; (buffers * BUF_LEN) as usize];
        Pair {
            now: Duration::ZERO,
            client,
            server,
            client_mem: mem.clone(),
            server_mem: mem,
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            reads: Vec::new(),
            client_dest: BTreeMap::new(),
            server_dest: BTreeMap::new(),
            client_events: Vec::new(),
            server_events: Vec::new(),
            hold_to_server: false,
            hold_to_client: false,
            hold_reads: false,
            client_dead: false,
            server_dead: false,
        }
    }

    /// The owner's application writes `data` into its buffer (a CPU copy).
    pub fn write(&mut self, side: Side, buffer: BufferId, data: &[u8]) {
        let off = (buffer.raw() * BUF_LEN) as usize;
        let mem = match side {
            Side::Client => &mut self.client_mem,
            Side::Server => &mut self.server_mem,
        };
        mem[off..off + data.len()].copy_from_slice(data);
    }

    fn collect(&mut self) {
        while let Some(a) = self.client.poll_action() {
            match a {
                Action::Send(m) => self.to_server.push_back(m.to_bytes()),
                Action::Read(r) => self.reads.push(InFlight {
                    reader: Side::Client,
                    token: r.token(),
                    remote: r.remote(),
                    sampled: None,
                }),
            }
        }
        while let Some(a) = self.server.poll_action() {
            match a {
                Action::Send(m) => self.to_client.push_back(m.to_bytes()),
                Action::Read(r) => self.reads.push(InFlight {
                    reader: Side::Server,
                    token: r.token(),
                    remote: r.remote(),
                    sampled: None,
                }),
            }
        }
        while let Some(e) = self.client.poll_event() {
            self.client_events.push(e);
        }
        while let Some(e) = self.server.poll_event() {
            self.server_events.push(e);
        }
    }

    /// The responder NIC samples the memory for every READ not yet sampled.
    pub fn sample_reads(&mut self) {
        for r in self.reads.iter_mut().filter(|r| r.sampled.is_none()) {
            let (mem, base) = match r.reader {
                Side::Client => (&self.server_mem, SERVER_BASE),
                Side::Server => (&self.client_mem, CLIENT_BASE),
            };
            let off = (r.remote.addr() - base) as usize;
            r.sampled = Some(mem[off..off + r.remote.len() as usize].to_vec());
        }
    }

    /// Completes every sampled READ at its reader.
    pub fn complete_reads(&mut self) {
        let done: Vec<InFlight> = {
            let (done, rest) = std::mem::take(&mut self.reads).into_iter().partition(|r| r.sampled.is_some());
            self.reads = rest;
            done
        };
        for r in done {
            let data = r.sampled.unwrap_or_default();
            match r.reader {
                Side::Client if !self.client_dead => {
                    self.client_dest.insert(r.token, data);
                    self.client.handle_read_completion(self.now, r.token, true);
                }
                Side::Server if !self.server_dead => {
                    self.server_dest.insert(r.token, data);
                    self.server.handle_read_completion(self.now, r.token, true);
                }
                _ => {}
            }
        }
    }

    /// Runs until nothing moves (without advancing the clock).
    pub fn drive(&mut self) {
        for _ in 0..1000 {
            self.collect();
            let mut moved = false;
            if !self.hold_to_server {
                while let Some(b) = self.to_server.pop_front() {
                    moved = true;
                    if !self.server_dead {
                        let (m, rest) = Message::decode(&b).expect("engines send valid messages");
                        assert!(rest.is_empty());
                        self.server.handle_message(self.now, m);
                    }
                }
            }
            if !self.hold_to_client {
                while let Some(b) = self.to_client.pop_front() {
                    moved = true;
                    if !self.client_dead {
                        let (m, _) = Message::decode(&b).expect("engines send valid messages");
                        self.client.handle_message(self.now, m);
                    }
                }
            }
            if !self.hold_reads && !self.reads.is_empty() {
                moved = true;
                self.sample_reads();
                self.complete_reads();
            }
            self.collect();
            if !moved {
                return;
            }
        }
        panic!("pair did not settle");
    }

    /// Advances the virtual clock by `dt`, fires due timers, and drives.
    pub fn advance(&mut self, dt: Duration) {
        self.now += dt;
        if !self.client_dead && self.client.poll_timeout().is_some_and(|t| t <= self.now) {
            self.client.handle_timeout(self.now);
        }
        if !self.server_dead && self.server.poll_timeout().is_some_and(|t| t <= self.now) {
            self.server.handle_timeout(self.now);
        }
        self.drive();
    }

    pub fn take_client_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.client_events)
    }

    pub fn take_server_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.server_events)
    }
}

pub fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

pub fn config() -> Config {
    let mut c = Config::default();
    c.hold_timeout = secs(5);
    c.request_timeout = secs(20);
    c.confirm_timeout = secs(5);
    c.max_attempts = 3;
    c
}
