//! How many clients a server sets up per second on the simulated NIC, with
//! the capability probe run for every client (a listening `conn::Endpoint`
//! built per client, each with a `ProbeCache` of its own) and with its
//! verdict cached (one listening endpoint, taking one client at a time,
//! then many at once).
//!
//! Run with `cargo run --release --example accept_rate [CLIENTS]`. Clients
//! connect from a client endpoint with `confirm`, so only the server
//! probes; the server serves `auto`. Figures are in docs/serving.md.

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use mwcap::bootstrap::{Auth, Key};
use mwcap::conn::{Config, Endpoint, PolicyChoice};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};
use mwcap::ProbeCache;

const T: Duration = Duration::from_secs(10);

fn cfg() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 4096;
    c
}

fn devices() -> (SimNic, SimNic) {
    let fabric = Fabric::with_seed(1);
    (
        fabric.add_device(DeviceConfig::spec().named("server")),
        fabric.add_device(DeviceConfig::spec().named("client")),
    )
}

/// `n` clients one after the other, each served by a listening endpoint
/// built for it with a probe cache of its own: the probe runs for every
/// client, as a server without a cache would run it on every accept.
fn probe_per_client(n: usize, auth: &Auth) -> f64 {
    let (server_nic, client_nic) = devices();
    let (tx, rx) = mpsc::channel();
    let server_auth = auth.clone();
    let started = Instant::now();
    let server = std::thread::spawn(move || {
        let mut probes = 0;
        for _ in 0..n {
            let (endpoint, cache) = server_endpoint(server_nic.clone(), &server_auth);
            probes += cache.probes_run();
            tx.send(endpoint.local_addr().unwrap()).unwrap();
            drop(block_on(endpoint.accept()).expect("accept"));
        }
        probes
    });
    let client = client_endpoint(client_nic, auth);
    for addr in rx.iter().take(n) {
        drop(block_on(client.connect(addr)).expect("connect"));
    }
    let probes = server.join().unwrap();
    let rate = n as f64 / started.elapsed().as_secs_f64();
    println!("an Endpoint per client (fresh ProbeCache): {n} clients, {rate:.0} setups/s, {probes} probes");
    rate
}

/// A client endpoint serving `confirm` (it does not probe) on `nic`, its
/// driver on a thread of its own.
fn client_endpoint(nic: SimNic, auth: &Auth) -> Endpoint<SimNic> {
    let (client, driver) = Endpoint::builder(nic, auth.clone())
        .policy(PolicyChoice::Confirm)
        .config(cfg())
        .handshake_timeout(T)
        .build()
        .expect("a client endpoint");
    std::thread::spawn(move || block_on(driver.run()));
    client
}

/// `n` clients one after the other from a client endpoint.
fn clients_one_by_one(n: usize, nic: SimNic, addr: SocketAddr, auth: &Auth) {
    let client = client_endpoint(nic, auth);
    for _ in 0..n {
        drop(block_on(client.connect(addr)).expect("connect"));
    }
}

/// A listening endpoint serving `auto` on `nic`, its driver on a thread of
/// its own, and the cache of its probe.
fn server_endpoint(nic: SimNic, auth: &Auth) -> (Endpoint<SimNic>, ProbeCache) {
    let probes = ProbeCache::new();
    let (endpoint, driver) = Endpoint::builder(nic, auth.clone())
        .policy(PolicyChoice::Auto)
        .config(cfg())
        .handshake_timeout(T)
        .probe_cache(probes.clone())
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .expect("a listening endpoint");
    std::thread::spawn(move || block_on(driver.run()));
    (endpoint, probes)
}

/// Accept `n` clients on `endpoint` from a thread of its own, dropping each.
fn accept_n(endpoint: Endpoint<SimNic>, n: usize) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        block_on(async {
            for _ in 0..n {
                drop(endpoint.accept().await.expect("accept"));
            }
        })
    })
}

/// The same `n` clients one after the other, served by one listening
/// endpoint: its probe (run as it is built, timed here as the
/// first accept's was) is cached for every client.
fn one_at_a_time(n: usize, auth: &Auth) -> f64 {
    let (server_nic, client_nic) = devices();
    let started = Instant::now();
    let (endpoint, probes) = server_endpoint(server_nic, auth);
    let addr = endpoint.local_addr().unwrap();
    let server = accept_n(endpoint, n);
    clients_one_by_one(n, client_nic, addr, auth);
    server.join().unwrap();
    let rate = n as f64 / started.elapsed().as_secs_f64();
    println!(
        "Endpoint::accept, one client at a time (cached): {n} clients, {rate:.0} setups/s, {} probes",
        probes.probes_run()
    );
    rate
}

/// `n` clients at once, from a client endpoint to a listening one.
fn at_once(n: usize, auth: &Auth) -> f64 {
    let (server_nic, client_nic) = devices();
    let (endpoint, probes) = server_endpoint(server_nic, auth);
    let addr = endpoint.local_addr().unwrap();
    let server = accept_n(endpoint, n);
    let client = client_endpoint(client_nic, auth);
    let started = Instant::now();
    let all = block_on(futures::future::join_all((0..n).map(|_| client.connect(addr))));
    server.join().unwrap();
    let rate = n as f64 / started.elapsed().as_secs_f64();
    assert!(all.iter().all(|c| c.is_ok()));
    println!("Endpoint::accept: {n} clients at once, {rate:.0} setups/s, {} probes", probes.probes_run());
    rate
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let auth = Auth::Key(Key::from_bytes(b"accept_rate example key".to_vec()).unwrap());
    let before = probe_per_client(n, &auth);
    let after = one_at_a_time(n, &auth);
    at_once(n, &auth);
    println!("probe cache: {:.1}x the setups per second of a probe per client", after / before);
}
