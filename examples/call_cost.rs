//! A fixed number of calls of one kind through the async API on the
//! simulated NIC, for counting what one call costs with callgrind
//! (`tests/cost/callgrind.sh`, `docs/benchmarks.md`).
//!
//!   cargo run --release --example call_cost -- CASE CALLS
//!
//! CASE is `rpc` (64-byte header, no payload), `mw` or `confirm` (a 4 KiB
//! reply payload the client READs). The process makes 200 warm-up calls,
//! then CALLS measured ones, and prints what it did. Each side's
//! connection is on an `Endpoint` of its own (its completion queue and
//! driver, completions routed by QP number), connected without the TCP
//! bootstrap, which the simulator does not need.

use std::time::Duration;

use futures::executor::block_on;
use futures::FutureExt;
use mwcap::bootstrap::Auth;
use mwcap::conn::{Config, Endpoint, Policies, Policy, Role};
use mwcap::sim::{DeviceConfig, Fabric};

fn main() {
    let mut args = std::env::args().skip(1);
    let case = args.next().unwrap_or_else(|| "mw".into());
    let calls: u32 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let (policy, size) = match case.as_str() {
        "rpc" => (Policy::Mw, 0usize),
        "mw" => (Policy::Mw, 4096),
        "confirm" => (Policy::Confirm, 4096),
        other => {
            eprintln!("call_cost: unknown case {other:?}; use rpc, mw or confirm");
            std::process::exit(2);
        }
    };
    let fabric = Fabric::with_seed(1);
    let cn = fabric.add_device(DeviceConfig::spec().named("client"));
    let sn = fabric.add_device(DeviceConfig::spec().named("server"));
    let p = Policies::both(policy);
    let cfg = || {
        let mut c = Config::default();
        // Callgrind runs ~50x slower: keep timers far from firing.
        c.call_timeout = Duration::from_secs(600);
        c.lease_time = Duration::from_secs(300);
        // Count work, not spinning: the driver sleeps as soon as it is idle
        // (on the simulator, waiting runs the fabric, so nothing is lost).
        c.busy_poll = Duration::ZERO;
        c
    };
    let (ce, cdrv) =
        Endpoint::builder(cn, Auth::Unauthenticated).queue_depth(1 << 14).build().expect("endpoint");
    let (se, sdrv) =
        Endpoint::builder(sn, Auth::Unauthenticated).queue_depth(1 << 14).build().expect("endpoint");
    let c = ce.prepare(Role::Client, p, cfg()).expect("prepare");
    let s = se.prepare(Role::Server, p, cfg()).expect("prepare");
    let (a, b) = (c.local(), s.local());
    let client = c.connect(&b).expect("connect client");
    let server = s.connect(&a).expect("connect server");
    let endpoints = [ce, se];
    let serve = {
        let server = server.clone();
        async move {
            while let Some(req) = server.next_request().await {
                let data = if size > 0 {
                    let mut b = server.alloc().await.expect("server buffer");
                    b.write_with(|bytes| {
                        bytes[0] = 0x5a; // the application's own writing is not counted
                        size
                    })
                    .expect("fill");
                    Some(b)
                } else {
                    None
                };
                if server.reply(req.id, 0, b"ok", data).await.is_err() {
                    break;
                }
            }
        }
    };
    let app = async {
        let header = [7u8; 64];
        for _ in 0..200 + calls {
            let r = client.call(&header, None).await.expect("call");
            if let Some(d) = r.data {
                let first = d[0];
                assert_eq!(first, 0x5a);
            }
        }
        let (c, s) = (client.driver_stats(), server.driver_stats());
        println!(
            "call_cost: connection turns per call: client {:.1} ({:.1} busy), server {:.1} ({:.1} busy)",
            c.turns as f64 / f64::from(200 + calls),
            c.busy_turns as f64 / f64::from(200 + calls),
            s.turns as f64 / f64::from(200 + calls),
            s.busy_turns as f64 / f64::from(200 + calls),
        );
        for (side, h) in ["client", "server"].iter().zip(&endpoints) {
            let st = h.stats();
            let n = f64::from(200 + calls);
            println!(
                "call_cost: {side} endpoint: driver loops per call {:.1}, connection turns {:.1}, sleeps {:.1}",
                st.turns as f64 / n,
                st.connection_turns as f64 / n,
                st.sleeps as f64 / n
            );
        }
        client.close();
        server.close();
        drop(endpoints);
    };
    let work = futures::future::join(app, serve);
    let drivers = futures::future::join(cdrv.run(), sdrv.run());
    block_on(futures::future::join(work, drivers).map(|_| ()));
    println!("call_cost: {case}: {calls} calls after 200 warm-up calls");
}
