//! Many connections in one process on the simulated NIC: how fast they are
//! set up, what each costs (registered bytes; resident memory, which on the
//! simulator includes the simulated registered memory), and calls per
//! second with some of them active.
//!
//! ```sh
//! cargo run --release --example many_connections [CONNECTIONS] [ACTIVE] [ROUNDS]
//! ```
//! (defaults 10000, 1000 and 20). Every connection is a client and a server
//! endpoint, each on a simulated device of its own (its own protection
//! domain), with a small pool: 2 buffers of 4 KiB and 8 control slots.
//! Each round, every active client makes a call with a 100-byte payload
//! (inline) and every server answers with a 3000-byte payload (a window
//! bound, READ, released), all checked.

use std::time::Instant;

use mwcap::conn::{Config, Endpoint, Event, Policies, Policy, Role};
use mwcap::sim::{DeviceConfig, Fabric, FabricConfig, Progress, SimNic};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn config(role: Role) -> Config {
    let mut c = Config::new(role, Policies::both(Policy::Mw));
    c.buffers = 2;
    c.buffer_size = 4096;
    c.ctrl_slots = 8;
    c.region_exposures = 0;
    c
}

struct Conn {
    client: Endpoint<SimNic>,
    server: Endpoint<SimNic>,
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n = args.first().copied().unwrap_or(10_000) as usize;
    let active = (args.get(1).copied().unwrap_or(1_000) as usize).min(n);
    let rounds = args.get(2).copied().unwrap_or(20);
    let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(1) });
    let rss0 = rss_bytes();
    let t0 = Instant::now();
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        let mut client =
            Endpoint::new(fabric.add_device(DeviceConfig::spec().named("c")), config(Role::Client))
                .expect("client endpoint");
        let mut server =
            Endpoint::new(fabric.add_device(DeviceConfig::spec().named("s")), config(Role::Server))
                .expect("server endpoint");
        let (c, s) = (client.local(), server.local());
        client.connect(&s).expect("connect");
        server.connect(&c).expect("connect");
        conns.push(Conn { client, server });
    }
    let setup = t0.elapsed();
    let rss = rss_bytes().saturating_sub(rss0);
    let registered = conns[0].client.registered_bytes();
    println!(
        "connections={n} setup_s={:.2} setups_per_s={:.0} registered_bytes_per_conn={registered} \
         rss_bytes_per_conn={} (both sides, simulated registered memory included)",
        setup.as_secs_f64(),
        n as f64 / setup.as_secs_f64(),
        rss / n as u64
    );

    let reply = vec![0x5a; 3000];
    let t1 = Instant::now();
    let mut calls = 0u64;
    for round in 0..rounds {
        for (i, c) in conns[..active].iter_mut().enumerate() {
            let now = fabric.now();
            let mut b = c.client.alloc().expect("a free client buffer");
            c.client.write(&mut b, &[(i as u8) ^ (round as u8); 100]).unwrap();
            c.client.call(now, &(i as u64).to_le_bytes(), Some(b)).expect("call");
        }
        fabric.run_until_idle();
        for (i, c) in conns[..active].iter_mut().enumerate() {
            let now = fabric.now();
            c.server.drive(now);
            while let Some(e) = c.server.poll_event() {
                match e {
                    Event::Request { req, data: Some(d), header, .. } => {
                        assert_eq!(&header[..], &(i as u64).to_le_bytes()[..]);
                        assert_eq!(c.server.read(&d).unwrap(), vec![(i as u8) ^ (round as u8); 100]);
                        c.server.free(d);
                        let mut out = c.server.alloc().expect("a free server buffer");
                        c.server.write(&mut out, &reply).unwrap();
                        c.server.reply(now, req, 0, b"", Some(out)).expect("reply");
                    }
                    Event::BufferReturned(b) => c.server.free(b),
                    other => panic!("server {i}: {other:?}"),
                }
            }
        }
        // READs, releases and invalidations take a few more steps.
        for _ in 0..4 {
            fabric.run_until_idle();
            for (i, c) in conns[..active].iter_mut().enumerate() {
                let now = fabric.now();
                for ep in [&mut c.client, &mut c.server] {
                    ep.handle_timeout(now);
                    ep.drive(now);
                }
                while let Some(e) = c.client.poll_event() {
                    match e {
                        Event::Reply { data: Some(d), .. } => {
                            assert_eq!(c.client.read(&d).unwrap(), reply, "connection {i}");
                            c.client.free(d);
                            calls += 1;
                        }
                        Event::BufferReturned(b) => c.client.free(b),
                        other => panic!("client {i}: {other:?}"),
                    }
                }
                while let Some(e) = c.server.poll_event() {
                    match e {
                        Event::BufferReturned(b) => c.server.free(b),
                        other => panic!("server {i}: {other:?}"),
                    }
                }
            }
        }
    }
    let elapsed = t1.elapsed();
    assert_eq!(calls, active as u64 * rounds, "every call answered");
    println!(
        "active={active} rounds={rounds} calls={calls} calls_per_s={:.0} (sans-IO endpoints, one thread, simulator included)",
        calls as f64 / elapsed.as_secs_f64().max(1e-9)
    );
}
