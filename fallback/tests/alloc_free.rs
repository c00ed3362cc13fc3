//! The confirm engines, given room for as many fetches as come at once
//! (`Client::reserve`, `Server::reserve`, and the server's buffers), make
//! their first burst of them with no more allocations than a later one: 0,
//! in debug builds too (their index checks compare without collecting).
//! Found on rxe, where a benchmark's short warm-up left the
//! first growth of the engines' queues inside the measured calls. The
//! process's allocator counts allocations (`stats_alloc`); this binary is a
//! plain program (no libtest thread), and the messages cross as values in
//! queues made beforehand.

use std::alloc::System;
use std::collections::VecDeque;
use std::time::Duration;

use mwcap_fallback::{Action, BufferId, Client, Config, Event, Region, Server};
use stats_alloc::{StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn allocs() -> usize {
    let s = GLOBAL.stats();
    s.allocations + s.reallocations
}

const N: u32 = 16;
const LEN: u32 = 4096;

/// A client and a server with `N` buffers, given room for `N` fetches
/// (`reserve`) or not, and the server's free buffers.
struct Rig {
    client: Client,
    server: Server,
    free: VecDeque<BufferId>,
    round: u64,
}

impl Rig {
    fn new(reserve: bool) -> Rig {
        let mut c = Config::default();
        c.max_read_len = LEN;
        let (mut client, mut server) = (Client::new(c.clone()), Server::new(c));
        if reserve {
            client.reserve(N as usize);
            server.reserve(N as usize);
        }
        let free =
            (0..N).map(|i| server.add_buffer(Region::new(0x1000 + u64::from(i * LEN), LEN, 7))).collect();
        Rig { client, server, free, round: 0 }
    }
}

/// One round of `N` fetches at once (fetch, offer, READ, confirm,
/// verdict) between the rig's client and server. Returns the allocations
/// made meanwhile.
fn burst(rig: &mut Rig) -> usize {
    let Rig { client, server, free, round } = rig;
    let (mut to_server, mut to_client, mut reads) =
        (VecDeque::with_capacity(64), VecDeque::with_capacity(64), VecDeque::with_capacity(64));
    let before = allocs();
    {
        *round += 1;
        let now = Duration::from_millis(*round);
        for _ in 0..N {
            client.fetch(now, LEN).expect("a fetch");
        }
        let mut verified = 0;
        for _ in 0..32 {
            while let Some(a) = client.poll_action() {
                match a {
                    Action::Send(m) => to_server.push_back(m),
                    Action::Read(r) => reads.push_back(r.token()),
                }
            }
            while let Some(e) = client.poll_event() {
                assert!(matches!(e, Event::ReadVerified { .. }), "{e:?}");
                verified += 1;
            }
            while let Some(m) = to_server.pop_front() {
                server.handle_message(now, m);
            }
            while let Some(e) = server.poll_event() {
                match e {
                    Event::ReplyWanted { msg, .. } => {
                        let b = free.pop_front().expect("a server buffer");
                        server.offer(now, msg, b, LEN).expect("an offer");
                    }
                    Event::BufferFree { buffer, .. } => free.push_back(buffer),
                    other => panic!("server: {other:?}"),
                }
            }
            while let Some(a) = server.poll_action() {
                let Action::Send(m) = a else { panic!("the server READs nothing here") };
                to_client.push_back(m);
            }
            while let Some(m) = to_client.pop_front() {
                client.handle_message(now, m);
            }
            while let Some(t) = reads.pop_front() {
                client.handle_read_completion(now, t, true);
            }
        }
        assert_eq!(verified, N, "round {round}: every fetch verified");
        assert_eq!(free.len(), N as usize, "round {round}: every server buffer free");
    }
    allocs() - before
}

/// Run as a plain program (`harness = false` in `Cargo.toml`): no other
/// thread runs, so every allocation counted is the engines'.
fn main() {
    a_first_burst_of_fetches_allocates_no_more_than_a_later_one();
    println!("alloc_free: ok");
}

fn a_first_burst_of_fetches_allocates_no_more_than_a_later_one() {
    let mut sized = Rig::new(true);
    let (first, later) = (burst(&mut sized), burst(&mut sized));
    assert_eq!(first, later, "the first burst grew the engines' tables");
    assert_eq!(burst(&mut sized), later);
    assert_eq!(later, 0, "a burst allocated");
    // Engines given no room grow their queues with the first burst, and
    // not after: what the test sees.
    let mut lazy = Rig::new(false);
    let (first, later) = (burst(&mut lazy), burst(&mut lazy));
    assert!(first > later, "the test would not see a growth ({first}, then {later})");
}
