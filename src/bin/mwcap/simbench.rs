//! `mwcap bench --sim`: the cost of mwcap's own code, on the simulated NIC
//! (no RDMA needed), through the async `Connection`/`Driver` API users run
//! and, as a reference, through the sans-IO `Endpoint` loop (`SimPair`).
//! Heap allocations per call are counted by the binary's counting global
//! allocator, in steady state (after warm-up).
//!
//! Each case prints one machine-readable line:
//! `case=<name> policy=<mw|confirm|none> size=<bytes> inflight=1 mode=<async|sansio> backend=sim p50_us=<x> p99_us=<x> calls_per_s=<x> allocs_per_call=<x>`

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[cfg(not(loom))]
use futures::{executor::block_on, FutureExt};
#[cfg(not(loom))]
use mwcap::conn::{Connection, Endpoint};
use mwcap::conn::{Config, Event, Policies, Policy, Role, SimPair};
#[cfg(not(loom))]
use mwcap::sim::Fabric;
use mwcap::sim::{DeviceConfig, FabricConfig};

/// Heap allocations made by this process (counted by `main`'s allocator).
pub static ALLOCS: AtomicU64 = AtomicU64::new(0);

/// A global allocator that counts allocations, for `allocs_per_call`.
pub struct Counting;

// SAFETY: forwards every call unchanged to the system allocator.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed through unchanged.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        // SAFETY: `p` came from `alloc` above with layout `l`.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(p, l, n) }
    }
}

struct Case {
    name: &'static str,
    policy: Option<Policy>,
    size: u32,
}

pub fn run(iters: u32, size: u32) -> ExitCode {
    let cases = [
        Case { name: "rpc", policy: None, size: 64 },
        Case { name: "reply_read", policy: Some(Policy::Mw), size },
        Case { name: "reply_read", policy: Some(Policy::Confirm), size },
    ];
    for c in &cases {
        for mode in ["async", "sansio"] {
            let r = if mode == "async" { async_case(c, iters) } else { sansio_case(c, iters) };
            match r {
                Ok((mut lat, allocs)) => print_line(c, mode, &mut lat, allocs, iters),
                Err(e) => {
                    eprintln!("mwcap bench --sim: {} {mode}: {e}", c.name);
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
}

fn print_line(c: &Case, mode: &str, lat: &mut [Duration], allocs: u64, iters: u32) {
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)].as_secs_f64() * 1e6;
    let total: Duration = lat.iter().sum();
    let policy = match c.policy {
        None => "none",
        Some(Policy::Mw) => "mw",
        Some(Policy::Confirm) => "confirm",
    };
    println!(
        "case={} policy={policy} size={} inflight=1 mode={mode} backend=sim p50_us={:.1} p99_us={:.1} calls_per_s={:.0} allocs_per_call={:.1}",
        c.name,
        c.size,
        pct(0.5),
        pct(0.99),
        lat.len() as f64 / total.as_secs_f64(),
        allocs as f64 / f64::from(iters)
    );
}

fn policies(c: &Case) -> Policies {
    Policies::both(c.policy.unwrap_or(Policy::Mw))
}

#[cfg(loom)]
fn async_case(_: &Case, _: u32) -> Result<(Vec<Duration>, u64), String> {
    Err("the loom build has no async runtime".into())
}

#[cfg(not(loom))]
fn async_case(c: &Case, iters: u32) -> Result<(Vec<Duration>, u64), String> {
    let fabric = Fabric::with_seed(1);
    let cn = fabric.add_device(DeviceConfig::spec().named("client"));
    let sn = fabric.add_device(DeviceConfig::spec().named("server"));
    let p = policies(c);
    let mut ce = Endpoint::new(cn, Config::new(Role::Client, p)).map_err(|e| e.to_string())?;
    let mut se = Endpoint::new(sn, Config::new(Role::Server, p)).map_err(|e| e.to_string())?;
    let (a, b) = (ce.local(), se.local());
    ce.connect(&b).map_err(|e| e.to_string())?;
    se.connect(&a).map_err(|e| e.to_string())?;
    let (client, cdrv) = Connection::new(ce);
    let (server, sdrv) = Connection::new(se);
    let payload = vec![0x5a; c.size as usize];
    let with_data = c.policy.is_some();
    let serve = {
        let server = server.clone();
        let payload = payload.clone();
        async move {
            while let Some(req) = server.next_request().await {
                let data = if with_data {
                    let mut b = server.alloc().await.map_err(|e| e.to_string())?;
                    server.write(&mut b, &payload).map_err(|e| e.to_string())?;
                    Some(b)
                } else {
                    None
                };
                server.reply(req.id, 0, b"ok", data).map_err(|e| e.to_string())?;
            }
            Ok::<(), String>(())
        }
    };
    let app = async {
        let warmup = 200;
        let mut lat = Vec::with_capacity(iters as usize);
        let mut allocs = 0;
        for i in 0..warmup + iters {
            if i == warmup {
                allocs = ALLOCS.load(Ordering::Relaxed);
            }
            let t = Instant::now();
            let r = client.call(b"bench", None).await.map_err(|e| e.to_string())?;
            if let Some(d) = r.data {
                client.free(d);
            }
            if i >= warmup {
                lat.push(t.elapsed());
            }
        }
        let allocs = ALLOCS.load(Ordering::Relaxed) - allocs;
        client.close();
        server.close();
        Ok::<_, String>((lat, allocs))
    };
    let drivers = futures::future::join(cdrv.run(), sdrv.run());
    let (r, _) = block_on(futures::future::join(futures::future::join(app, serve).map(|(a, _)| a), drivers));
    r
}

fn sansio_case(c: &Case, iters: u32) -> Result<(Vec<Duration>, u64), String> {
    let p = policies(c);
    let mut pair = SimPair::new(
        FabricConfig::with_seed(1),
        DeviceConfig::spec(),
        DeviceConfig::spec(),
        Config::new(Role::Client, p),
        Config::new(Role::Server, p),
    )
    .map_err(|e| e.to_string())?;
    let payload = vec![0x5a; c.size as usize];
    let warmup = 200;
    let mut lat = Vec::with_capacity(iters as usize);
    let mut allocs = 0;
    for i in 0..warmup + iters {
        if i == warmup {
            allocs = ALLOCS.load(Ordering::Relaxed);
        }
        let t = Instant::now();
        let now = pair.now();
        pair.client.call(now, b"bench", None).map_err(|e| e.to_string())?;
        let mut replied = false;
        let mut done = false;
        while !done {
            pair.settle();
            for e in std::mem::take(&mut pair.server_events) {
                match e {
                    Event::Request { req, data, .. } => {
                        if let Some(d) = data {
                            pair.server.free(d);
                        }
                        let data = if c.policy.is_some() {
                            let mut b = pair.server.alloc().ok_or("server pool empty")?;
                            pair.server.write(&mut b, &payload).map_err(|e| e.to_string())?;
                            Some(b)
                        } else {
                            None
                        };
                        let now = pair.now();
                        pair.server.reply(now, req, 0, b"ok", data).map_err(|e| e.to_string())?;
                        replied = true;
                    }
                    Event::BufferReturned(b) => pair.server.free(b),
                    _ => {}
                }
            }
            for e in std::mem::take(&mut pair.client_events) {
                match e {
                    Event::Reply { data, .. } => {
                        if let Some(d) = data {
                            pair.client.free(d);
                        }
                        done = true;
                    }
                    Event::CallFailed { error, .. } => return Err(error.to_string()),
                    Event::BufferReturned(b) => pair.client.free(b),
                    _ => {}
                }
            }
            if !done {
                let limit = pair.now() + Duration::from_secs(1);
                if !pair.step(limit) && replied {
                    pair.run_for(Duration::from_micros(10));
                }
            }
        }
        if i >= warmup {
            lat.push(t.elapsed());
        }
    }
    Ok((lat, ALLOCS.load(Ordering::Relaxed) - allocs))
}
