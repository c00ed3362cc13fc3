//! What one transfer costs the engines, with many buffers and requests in
//! flight.
//!
//! A steady-state loop over a `Client` and a `Server` joined by an ideal NIC
//! and wire. Every iteration starts one *call* and finishes an earlier one,
//! because READ completions and the client's messages to the server are
//! delayed (by `buffers / 2` and `buffers / 2 - 4` iterations): an owner
//! buffer is held for `buffers - 3` iterations, so almost every one is held
//! all the time, and the reader has about half as many READs in flight.
//!
//! - direction 1 (`fetch`): fetch → `Fetch` → `ReplyWanted` → offer →
//!   `Offer` → READ → completion → `Confirm` → `Intact` → `ConfirmReply` →
//!   `ReadVerified`, and the server's `BufferFree`;
//! - direction 2 (`request`): send_request → `Expose` → READ → completion →
//!   `Confirm` → `Intact` → `ConfirmReply` → `ReadVerified`, and the
//!   client's `BufferFree`.
//!
//! Messages cross as values (the codec is not on this path). On each side
//! the driver re-arms its timer with `poll_timeout` after every batch.
//!
//! ```text
//! cargo run --release -p mwcap-fallback --example confirm_cost -- [fetch|request] [buffers] [calls]
//! ```
//! prints calls/s for both directions and 16 and 1024 buffers (or only the
//! ones named). Instructions per call: run it under callgrind with
//! `--collect-atstart=no --toggle-collect='confirm_cost::client_side*'` (or
//! `server_side`); see `docs/protocol-confirm.md`, "Cost per call".

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use mwcap_fallback::{Action, BufferId, Client, Config, Event, Message, ReadToken, Region, Server};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Fetch,
    Request,
}

const LEN: u32 = 4096;

/// The wires, the READs in flight and the users' free buffers.
struct Net {
    dir: Direction,
    /// Iteration number, for the delay lines.
    iter: u64,
    /// Client → server messages, each with the iteration it arrives in.
    to_server: VecDeque<(u64, Message)>,
    msg_delay: u64,
    /// Server → client messages (arrive in the next client batch).
    to_client: VecDeque<Message>,
    /// READs in flight, each with the iteration it completes in.
    client_reads: VecDeque<(u64, ReadToken)>,
    server_reads: VecDeque<(u64, ReadToken)>,
    read_delay: u64,
    /// Buffers free for the owner's user.
    client_free: VecDeque<BufferId>,
    server_free: VecDeque<BufferId>,
    verified: u64,
}

/// The client's driver for one iteration.
#[inline(never)]
fn client_side(client: &mut Client, net: &mut Net, now: Duration) -> Option<Duration> {
    match net.dir {
        Direction::Fetch => {
            client.fetch(now, LEN).expect("fetch");
        }
        Direction::Request => {
            let b = net.client_free.pop_front().expect("a client buffer is free");
            client.send_request(now, b, LEN).expect("send_request");
        }
    }
    while let Some(m) = net.to_client.pop_front() {
        client.handle_message(now, m);
    }
    while net.client_reads.front().is_some_and(|&(due, _)| due <= net.iter) {
        if let Some((_, token)) = net.client_reads.pop_front() {
            client.handle_read_completion(now, token, true);
        }
    }
    if client.poll_timeout().is_some_and(|t| t <= now) {
        client.handle_timeout(now);
    }
    while let Some(a) = client.poll_action() {
        match a {
            Action::Send(m) => net.to_server.push_back((net.iter + net.msg_delay, m)),
            Action::Read(r) => net.client_reads.push_back((net.iter + net.read_delay, r.token())),
        }
    }
    while let Some(e) = client.poll_event() {
        match e {
            Event::ReadVerified { .. } => net.verified += 1,
            Event::BufferFree { buffer, .. } => net.client_free.push_back(buffer),
            other => panic!("unexpected client event {other:?}"),
        }
    }
    client.poll_timeout()
}

/// The server's driver for one iteration.
#[inline(never)]
fn server_side(server: &mut Server, net: &mut Net, now: Duration) -> Option<Duration> {
    while net.to_server.front().is_some_and(|&(due, _)| due <= net.iter) {
        if let Some((_, m)) = net.to_server.pop_front() {
            server.handle_message(now, m);
        }
        // Offer in the same batch, as a server user that has the reply
        // ready would.
        while let Some(e) = server.poll_event() {
            server_event(server, net, now, e);
        }
    }
    while net.server_reads.front().is_some_and(|&(due, _)| due <= net.iter) {
        if let Some((_, token)) = net.server_reads.pop_front() {
            server.handle_read_completion(now, token, true);
        }
    }
    if server.poll_timeout().is_some_and(|t| t <= now) {
        server.handle_timeout(now);
    }
    while let Some(a) = server.poll_action() {
        match a {
            Action::Send(m) => net.to_client.push_back(m),
            Action::Read(r) => net.server_reads.push_back((net.iter + net.read_delay, r.token())),
        }
    }
    while let Some(e) = server.poll_event() {
        server_event(server, net, now, e);
    }
    server.poll_timeout()
}

fn server_event(server: &mut Server, net: &mut Net, now: Duration, e: Event) {
    match e {
        Event::ReplyWanted { msg, .. } => {
            let b = net.server_free.pop_front().expect("a server buffer is free");
            server.offer(now, msg, b, LEN).expect("offer");
        }
        Event::BufferFree { buffer, .. } => net.server_free.push_back(buffer),
        Event::ReadVerified { .. } => net.verified += 1,
        other => panic!("unexpected server event {other:?}"),
    }
}

/// Runs `calls` iterations with `buffers` per side; returns the elapsed time.
fn run(dir: Direction, buffers: u32, calls: u64) -> Duration {
    assert!(buffers >= 8, "the pipeline needs a few buffers");
    let mut config = Config::default();
    config.max_outstanding = 1 << 20;
    config.max_read_len = LEN;
    let mut client = Client::new(config.clone());
    let mut server = Server::new(config);
    let mut net = Net {
        dir,
        iter: 0,
        to_server: VecDeque::with_capacity(2 * buffers as usize),
        msg_delay: 0,
        to_client: VecDeque::with_capacity(8),
        client_reads: VecDeque::with_capacity(buffers as usize),
        server_reads: VecDeque::with_capacity(buffers as usize),
        read_delay: u64::from(buffers / 2),
        client_free: VecDeque::with_capacity(buffers as usize),
        server_free: VecDeque::with_capacity(buffers as usize),
        verified: 0,
    };
    // A buffer is held from its offer (or exposure) for about read_delay +
    // msg_delay + 2 iterations; one new hold starts per iteration.
    net.msg_delay = u64::from(buffers) - net.read_delay - 4;
    for i in 0..buffers {
        let off = u64::from(i) * u64::from(LEN);
        net.client_free.push_back(client.add_buffer(Region::new(0x10_0000 + off, LEN, 0xc1)));
        net.server_free.push_back(server.add_buffer(Region::new(0x80_0000 + off, LEN, 0x5e)));
    }
    let mut now = Duration::ZERO;
    let start = Instant::now();
    for i in 0..calls {
        net.iter = i;
        now += Duration::from_micros(1);
        let c = client_side(&mut client, &mut net, now);
        let s = server_side(&mut server, &mut net, now);
        std::hint::black_box((c, s));
    }
    let elapsed = start.elapsed();
    let lag = net.read_delay + 2 * net.msg_delay + 4;
    assert!(net.verified + lag >= calls, "calls kept up: {} of {calls}", net.verified);
    assert_eq!(client.peer_violations() + server.peer_violations(), 0);
    elapsed
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dirs = match args.next().as_deref() {
        None | Some("both") => vec![Direction::Fetch, Direction::Request],
        Some("fetch") => vec![Direction::Fetch],
        Some("request") => vec![Direction::Request],
        Some(other) => panic!("direction: fetch, request or both, not {other}"),
    };
    let buffers: Option<u32> = args.next().map(|a| a.parse().expect("buffers: a number"));
    let calls: u64 = args.next().map_or(1_000_000, |a| a.parse().expect("calls: a number"));
    let sizes = match buffers {
        Some(b) => vec![b],
        None => vec![16, 1024],
    };
    for dir in dirs {
        for &buffers in &sizes {
            let elapsed = run(dir, buffers, calls);
            let per_s = calls as f64 / elapsed.as_secs_f64();
            println!(
                "confirm dir={dir:?} buffers={buffers} calls={calls} elapsed_ms={} calls_per_s={per_s:.0} ns_per_call={:.0}",
                elapsed.as_millis(),
                elapsed.as_nanos() as f64 / calls as f64
            );
        }
    }
}
