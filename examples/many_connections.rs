//! Many connections in one process on one `Endpoint` per side, on the simulated
//! NIC, through the async API: how fast they are set up, what each costs,
//! and calls per second with some of them active.
//!
//! ```sh
//! cargo run --release --example many_connections [CONNECTIONS] [ACTIVE] [ROUNDS] [CTRL_SLOTS] [SEND_SLOTS] [START_CREDITS] [--shared-receives] [--shared-buffers]
//! ```
//! (defaults 10000, 1000, 20, 8, `CTRL_SLOTS` and 8). The server side is one simulated device
//! with one endpoint (one completion queue, one driver task) and every server
//! connection in a protection domain of its own; the client side likewise.
//! Connections are made with `Endpoint::prepare` (no TCP bootstrap: the
//! simulator does not need it).
//! Each connection has a small pool: 2 buffers of 4 KiB, `SEND_SLOTS`
//! control slots for SENDs, `CTRL_SLOTS` for receives, and offers its peer
//! `START_CREDITS` of them at the start (`Config::start_credits`). With `--shared-receives` both endpoints are made with
//! `EndpointBuilder::shared_receives`: the connections take their control receives
//! from one shared receive queue per side (`START_CREDITS` each while idle, up to
//! `CTRL_SLOTS` when busy), and borrow the endpoint's send slots while
//! their SENDs are in flight: they register no control memory of their own. With
//! `--shared-buffers` (which implies `--shared-receives`) both endpoints are made
//! with `EndpointBuilder::shared_buffers` and a pool of 2 x `ACTIVE` + 64 buffers
//! of 4 KiB (and a memory window per buffer): a connection registers no
//! buffers and allocates no windows of its own, and takes its 2 buffers,
//! and a window per exposure, from the pool while it uses them. (Two per
//! active connection: a server connection holds the reply its client is
//! reading until the release comes, and may take the next reply's before.
//! With one per active connection the pool ran empty and the run measured
//! waiting for buffers.) Each round, every active client makes a call with a
//! 100-byte payload (inline) and its server answers with a 3000-byte
//! payload (a window bound, READ, released), all checked. Everything runs
//! on one thread (`futures`' `LocalPool`), the simulator included.

use std::time::{Duration, Instant};

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::Auth;
use mwcap::conn::{BufClass, Config, Connection, Endpoint, Policies, Policy, PolicyChoice, Role, SrqConfig};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn config(ctrl_slots: u32, send_slots: u32, start_credits: u32) -> Config {
    let mut c = Config::default();
    c.buffers = 2;
    c.buffer_size = 4096;
    c.ctrl_slots = ctrl_slots;
    c.send_slots = Some(send_slots);
    c.start_credits = start_credits;
    c.region_exposures = 0;
    c
}

/// Answer every request with 3000 bytes of `0x5a`, checking its payload.
async fn serve(conn: Connection<SimNic>) {
    while let Some(req) = conn.next_request().await {
        let want = req.header.first().copied().unwrap_or(0);
        let ok = req.data.as_ref().is_some_and(|d| d.iter().all(|&x| x == want));
        assert!(ok, "a request payload came back wrong");
        drop(req.data);
        let Ok(mut out) = conn.alloc().await else { return };
        if out
            .write_with(|b| {
                b[..3000].fill(0x5a);
                3000
            })
            .is_err()
        {
            return;
        }
        if conn.reply(req.id, 0, b"", Some(out)).await.is_err() {
            return;
        }
    }
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n = args.first().copied().unwrap_or(10_000) as usize;
    let active = (args.get(1).copied().unwrap_or(1_000) as usize).min(n);
    let rounds = args.get(2).copied().unwrap_or(20);
    let ctrl_slots = args.get(3).copied().unwrap_or(8) as u32;
    let send_slots = args.get(4).copied().map_or(ctrl_slots, |n| n as u32);
    let start_credits = args.get(5).copied().unwrap_or(8) as u32;
    let pooled = std::env::args().any(|a| a == "--shared-buffers");
    let shared = pooled || std::env::args().any(|a| a == "--shared-receives");
    let pool_classes = [BufClass { size: 4096, count: 2 * active as u32 + 64 }];
    let fabric = Fabric::with_seed(1);
    let cdev = fabric.add_device(DeviceConfig::spec().named("c"));
    let sdev = fabric.add_device(DeviceConfig::spec().named("s"));
    let server_device = sdev.device();
    let mut pool = LocalPool::new();
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    // 30 completion queue entries per connection of this size with 8
    // control slots, and 2 more per slot beyond.
    let mut depth = (n as u32).saturating_mul(32 + 2 * ctrl_slots).max(1024);
    // With shared receives: `start_credits` receives per idle connection,
    // and room for busy ones; the queue reserves an entry for each.
    let q =
        SrqConfig { chunk: 4096, max_slots: (n as u32 * start_credits + 4096 * 4).next_multiple_of(4096) };
    if shared {
        depth += q.max_slots;
    }
    let endpoint = |dev| {
        let mut b = Endpoint::builder(dev, Auth::Unauthenticated).policy(PolicyChoice::Mw).queue_depth(depth);
        if shared {
            b = b.shared_receives(q);
        }
        if pooled {
            b = b.shared_buffers(&pool_classes);
        }
        b.build()
    };
    let (chub, cdrv) = endpoint(cdev).expect("client endpoint");
    let (shub, sdrv) = endpoint(sdev).expect("server endpoint");
    pool.spawner()
        .spawn_local(async move {
            cdrv.run().await;
        })
        .expect("spawn");
    pool.spawner()
        .spawn_local(async move {
            sdrv.run().await;
        })
        .expect("spawn");
    let mut clients = Vec::with_capacity(n);
    let mut servers = Vec::with_capacity(n);
    let mut registered = 0;
    for _ in 0..n {
        let mw = Policies::both(Policy::Mw);
        let c =
            chub.prepare(Role::Client, mw, config(ctrl_slots, send_slots, start_credits)).expect("client");
        let s =
            shub.prepare(Role::Server, mw, config(ctrl_slots, send_slots, start_credits)).expect("server");
        let (ce, se) = (c.local(), s.local());
        let client = c.connect(&se).expect("connect");
        let server = s.connect(&ce).expect("connect");
        registered = client.registered_bytes();
        pool.spawner().spawn_local(serve(server.clone())).expect("spawn");
        servers.push(server);
        clients.push(client);
    }
    pool.run_until_stalled();
    let setup = t0.elapsed();
    let rss = rss_bytes().saturating_sub(rss0);
    let per_side = rss / (2 * n as u64);
    // The shared receive queue's and buffer pool's regions, per connection
    // on the hub.
    // (With shared receives the endpoint also lends the send slots.)
    let srq_per_conn =
        shub.stats().srq.map_or(0, |q| (q.registered_bytes + u64::from(q.send_slots) * 4096) / n as u64);
    let pool_per_conn = shub.stats().buffers.map_or(0, |b| b.registered_bytes / n as u64);
    // The simulator keeps registered memory on the heap, zeroed and so not
    // resident until touched: rss less it is the heap only when all of it
    // was touched (the shared receive queue's and large control regions'
    // pages mostly are not).
    let heap = per_side
        .checked_sub(registered + srq_per_conn + pool_per_conn)
        .map_or_else(|| "n/a (registered pages not all resident)".to_string(), |h| h.to_string());
    println!(
        "connections={n} endpoints=2 shared_receives={shared} shared_buffers={pooled} ctrl_slots={ctrl_slots} \
         send_slots={send_slots} start_credits={start_credits} setup_s={:.2} setups_per_s={:.0} registered_bytes_per_conn={} (own \
         {registered}, shared receive queue and send slots {srq_per_conn}, shared buffer pool {pool_per_conn}) \
         rss_bytes_per_conn_side={per_side} heap_bytes_per_conn_side={heap} (rss less the simulated \
         registered memory)",
        setup.as_secs_f64(),
        n as f64 / setup.as_secs_f64(),
        registered + srq_per_conn + pool_per_conn,
    );
    let stats = shub.stats();
    println!(
        "server endpoint: connections={} reserved_cq_entries={} of {}",
        stats.connections, stats.reserved_entries, stats.depth
    );
    // Memory windows are device objects, not registered memory: with a
    // shared pool the pool's are the device's only ones.
    let windows = fabric.windows(server_device).len();
    println!("server device: memory_windows={windows} ({:.2} per connection)", windows as f64 / n as f64);

    let t1 = Instant::now();
    let calls = pool.run_until(futures::future::join_all(clients[..active].iter().enumerate().map(
        |(i, c)| async move {
            let mut done = 0u64;
            for round in 0..rounds {
                let tag = (i as u8) ^ (round as u8);
                let mut b = c.alloc().await.expect("a client buffer");
                b.write_with(|x| {
                    x[..100].fill(tag);
                    100
                })
                .expect("fits");
                let r = c.call(&[tag], Some(b)).await.expect("answered");
                let d = r.data.expect("a reply payload");
                assert!(d.len() == 3000 && d.iter().all(|&v| v == 0x5a));
                drop(d);
                done += 1;
            }
            done
        },
    )));
    let elapsed = t1.elapsed();
    let calls: u64 = calls.iter().sum();
    assert_eq!(calls, active as u64 * rounds, "every call answered");
    let s = shub.stats();
    println!(
        "active={active} rounds={rounds} calls={calls} calls_per_s={:.0} server_endpoint_turns={} \
         connection_turns={} sleeps={} (async API, one thread, simulator included)",
        calls as f64 / elapsed.as_secs_f64().max(1e-9),
        s.turns,
        s.connection_turns,
        s.sleeps
    );
    assert_eq!(s.orphans, 0);
    if let Some(q) = s.srq {
        println!(
            "server shared receives: slots={} shares={} registered_bytes={} ({} per connection) frames={} \
             grown={} withheld={} limit_events={} send_slots={} ({} per connection) send_slots_lent={}",
            q.slots,
            q.shares,
            q.registered_bytes,
            q.registered_bytes / n as u64,
            q.frames,
            q.grown,
            q.withheld,
            q.limit_events,
            q.send_slots,
            u64::from(q.send_slots) * 4096 / n as u64,
            q.send_slots_lent
        );
    }
    if let Some(b) = s.buffers {
        println!(
            "server buffer pool: buffers={} free={} registered_bytes={} ({} per connection) taken={} empty={} \
             wakeups={} windows={} windows_lent={} windows_allocated={}",
            b.buffers,
            b.free,
            b.registered_bytes,
            b.registered_bytes / n as u64,
            b.taken,
            b.empty,
            b.wakeups,
            b.windows,
            b.windows_lent,
            b.windows_allocated
        );
    }
    if s.srq.is_some() {
        // Idle past `Config::give_back_after`: the shares the calls grew
        // are given back.
        let wait = Config::default().give_back_after + Duration::from_millis(500);
        pool.run_until(async_io::Timer::after(wait));
        if let Some(q) = shub.stats().srq {
            println!(
                "server shared receives after {:.1} s idle: shares={} ({} per connection) given_back={} \
                 withheld={} send_slots_lent={} slots={} registered_bytes={} chunks_retired={} chunks_freed={}",
                wait.as_secs_f64(),
                q.shares,
                q.shares as f64 / n as f64,
                q.given_back,
                q.withheld,
                q.send_slots_lent,
                q.slots,
                q.registered_bytes,
                q.chunks_retired,
                q.chunks_freed
            );
        }
    }
    let t2 = Instant::now();
    for c in clients.iter().chain(&servers) {
        c.close();
    }
    let finished = futures::future::join_all(clients.iter().chain(&servers).map(|c| c.finished()));
    pool.run_until(finished);
    drop((clients, servers));
    drop((chub, shub));
    pool.run_until_stalled();
    println!("closed={n} close_s={:.2}", t2.elapsed().as_secs_f64());
}
