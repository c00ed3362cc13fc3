//! Fairness of an endpoint's shared buffer pool, on the simulated NIC: an
//! honest client's call latency beside 0, 1, 2, 8 and 32 careless clients
//! ("hoarders") on the same server endpoint.
//!
//! The server endpoint has shared receives and a shared pool of 4 buffers
//! of 4 KiB (and a window each); every server connection answers each call
//! with 3,000 bytes from the pool, exposed through a window for a lease of
//! 300 ms. A hoarder is a client driven by hand that keeps 6 calls in
//! flight (within its credit) and never reads a reply: it holds both of its
//! own buffers, so no READ of its ever has a destination, and each reply
//! its server connection exposes keeps a pool buffer until its lease ends
//! (its calls give up after 400 ms and it calls again). The honest client
//! makes `--calls` calls one after another, 20 ms apart, through the async
//! API under a `LocalPool`, each given up after 3 s (10 leases).
//!
//! One line per number of hoarders: the honest client's p50 and p99 (and
//! the worst), its p99 minus the unloaded one in leases, and whether that
//! is within 2 leases (issue 19's bar); then the pool's counters. Figures
//! in `docs/benchmarks.md`.
//!
//!     cargo run --release --example pool_fairness [-- --calls 60]
//!
//! `HOARDERS=n` runs that case only; `FAIRNESS_TRACE=1` prints each honest
//! call's time and result, and the endpoint's stats at the end.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::Auth;
use mwcap::conn::{
    BufClass, Config, Connection, Endpoint, Link, Policies, Policy, PolicyChoice, Role, SrqConfig,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

/// The hand-driven careless clients, as `tests/hub_pool.rs` runs them.
#[path = "../tests/hubs/hoarders.rs"]
mod hoarders;

const LEASE: Duration = Duration::from_millis(300);
const POOL: u32 = 4;

/// Both directions under mw.
const MW: Policies = Policies { request: Policy::Mw, reply: Policy::Mw };

fn cfg() -> Config {
    let mut c = Config::default();
    c.buffers = 2;
    c.buffer_size = 4096;
    c.large_buffers = Vec::new();
    c.ctrl_slots = 16;
    c.send_slots = Some(8);
    c.inline_max = 0;
    c.lease_time = LEASE;
    c.safety_margin = Duration::from_millis(50);
    c.call_timeout = Duration::from_secs(10);
    c
}

/// Answer every request with 3,000 bytes of `fill` from the pool.
async fn serve(server: Connection<SimNic>, fill: u8) {
    while let Some(req) = server.next_request().await {
        let Ok(mut out) = server.alloc().await else { return };
        out.copy_from(&[fill; 3000]).unwrap();
        if server.reply(req.id, 0, b"", Some(out)).await.is_err() {
            return;
        }
    }
}

fn spawn(pool: &LocalPool, f: impl std::future::Future<Output = ()> + 'static) {
    pool.spawner().spawn_local(f).unwrap();
}

struct Run {
    /// The honest client's call times.
    lat: Vec<Duration>,
    failed: usize,
    hoarded: u64,
    stats: String,
}

fn run(hoarders: usize, calls: usize) -> Run {
    let fabric = Fabric::with_seed(19);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let (sh, sd) = Endpoint::builder(sn, Auth::Unauthenticated)
        .policy(PolicyChoice::Mw)
        .queue_depth(1 << 14)
        .shared_receives(SrqConfig::default())
        .shared_buffers(&[BufClass { size: 4096, count: POOL }])
        .build()
        .unwrap();
    spawn(&pool, async move {
        sd.run().await;
    });
    let (ch, cd) = Endpoint::builder(cn.clone(), Auth::Unauthenticated).queue_depth(1 << 14).build().unwrap();
    spawn(&pool, async move {
        cd.run().await;
    });
    let mut hoards = hoarders::Hoarders::default();
    for _ in 0..hoarders {
        let s = sh.prepare(Role::Server, MW, cfg()).unwrap();
        let mut ccfg = cfg();
        ccfg.call_timeout = Duration::from_millis(400);
        let mut c = Link::new(cn.new_pd().unwrap(), Role::Client, MW, ccfg).unwrap();
        c.connect(&s.local()).unwrap();
        let s = s.connect(&c.local()).unwrap();
        spawn(&pool, serve(s, 0x40));
        hoards.add(c);
    }
    // The honest client gives a call up after 3 s (10 leases).
    let mut hcfg = cfg();
    hcfg.call_timeout = Duration::from_secs(3);
    let (c, s) = (ch.prepare(Role::Client, MW, hcfg).unwrap(), sh.prepare(Role::Server, MW, cfg()).unwrap());
    let (cl, sl) = (c.local(), s.local());
    let (honest, honest_s) = (c.connect(&sl).unwrap(), s.connect(&cl).unwrap());
    let watch = honest_s.clone();
    let watch_c = honest.clone();
    spawn(&pool, serve(honest_s, 0x11));
    let out = Rc::new(RefCell::new((Vec::new(), 0usize)));
    let o = out.clone();
    spawn(&pool, async move {
        for _ in 0..calls {
            async_io::Timer::after(Duration::from_millis(20)).await;
            let t = Instant::now();
            let r = honest.call(b"x", None).await;
            let ok = matches!(&r, Ok(r) if r.data.as_ref().is_some_and(|b| b.to_vec() == vec![0x11; 3000]));
            let mut o = o.borrow_mut();
            if std::env::var_os("FAIRNESS_TRACE").is_some() {
                eprintln!("call {} {:?} {:?}", o.0.len() + o.1, t.elapsed(), r.as_ref().map(|_| ()));
            }
            if ok {
                o.0.push(t.elapsed());
            } else {
                o.1 += 1;
            }
        }
    });
    let t0 = Instant::now();
    let mut shown = 0;
    loop {
        if std::env::var_os("FAIRNESS_TRACE").is_some() && t0.elapsed().as_secs() >= shown + 5 {
            shown = t0.elapsed().as_secs();
            eprintln!("{shown}s client {:?}\n server {:?}", watch_c.stats(), watch.stats());
        }
        let (n, f) = (out.borrow().0.len(), out.borrow().1);
        if n + f >= calls {
            break;
        }
        hoards.turn(t0.elapsed());
        pool.run_until(async_io::Timer::after(Duration::from_millis(1)));
    }
    if std::env::var_os("FAIRNESS_TRACE").is_some() {
        eprintln!("honest server: {:?}\nendpoint: {:?}", watch.stats(), sh.stats());
    }
    let b = sh.stats().buffers.unwrap();
    let stats = format!("pool_taken={} pool_empty={} pool_wakeups={}", b.taken, b.empty, b.wakeups);
    let (lat, failed) = std::mem::take(&mut *out.borrow_mut());
    Run { lat, failed, hoarded: hoards.calls, stats }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let calls = args
        .iter()
        .position(|a| a == "--calls")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    println!("# pool of {POOL} buffers, lease {} ms, honest calls {calls}, 20 ms apart", LEASE.as_millis());
    let mut unloaded_p99 = None;
    let only: Option<usize> = std::env::var("HOARDERS").ok().and_then(|v| v.parse().ok());
    for hoarders in [0, 1, 2, 8, 32].into_iter().filter(|h| only.map_or(true, |o| o == *h)) {
        let mut r = run(hoarders, calls);
        r.lat.sort();
        let (p50, p99, max) =
            (pct(&r.lat, 0.5), pct(&r.lat, 0.99), r.lat.last().copied().unwrap_or_default());
        let base = *unloaded_p99.get_or_insert(p99);
        let over = p99.saturating_sub(base).as_secs_f64() / LEASE.as_secs_f64();
        println!(
            "pool_fairness hoarders={hoarders} honest_calls={} failed={} p50_us={} p99_us={} max_us={} \
             p99_over_unloaded_leases={over:.2} within_2_leases={} hoarder_calls={} {}",
            r.lat.len(),
            r.failed,
            p50.as_micros(),
            p99.as_micros(),
            max.as_micros(),
            if over <= 2.0 && r.failed == 0 { "yes" } else { "no" },
            r.hoarded,
            r.stats
        );
    }
}
