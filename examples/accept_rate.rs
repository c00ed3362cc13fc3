//! How many clients a server sets up per second on the simulated NIC, with
//! the capability probe run on every accept (the plain `conn::accept` with
//! `auto`) and with its verdict cached (`conn::accept_with`, the async
//! `Listener`).
//!
//! Run with `cargo run --release --example accept_rate [CLIENTS]`. Clients
//! connect with `confirm`, so only the server probes; the server serves
//! `auto`. Figures are in docs/serving.md.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use futures::executor::block_on;
use mwcap::bootstrap::{Auth, Key};
use mwcap::conn::{
    accept, accept_with, connect, connect_async, Config, Listener, Policies, Policy, PolicyChoice, Role,
    SetupOptions,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

const T: Duration = Duration::from_secs(10);

fn cfg(role: Role) -> Config {
    let mut c = Config::new(role, Policies::both(Policy::Confirm));
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

/// `n` blocking setups one after the other; `cached` picks `accept_with`.
fn blocking(n: usize, auth: &Auth, cached: bool) -> f64 {
    let (server_nic, client_nic) = devices();
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = tcp.local_addr().unwrap();
    let opts = SetupOptions::new(PolicyChoice::Auto, auth.clone()).timeout(T);
    let server = std::thread::spawn(move || {
        for _ in 0..n {
            let c = if cached {
                accept_with(server_nic.clone(), &tcp, cfg(Role::Server), &opts)
            } else {
                accept(server_nic.clone(), &tcp, cfg(Role::Server), PolicyChoice::Auto, &opts.auth, T)
            };
            drop(c.expect("accept"));
        }
        opts.probes.probes_run()
    });
    let started = Instant::now();
    for _ in 0..n {
        drop(
            connect(client_nic.clone(), addr, cfg(Role::Client), PolicyChoice::Confirm, auth, T)
                .expect("connect"),
        );
    }
    let probes = server.join().unwrap();
    let rate = n as f64 / started.elapsed().as_secs_f64();
    println!(
        "blocking accept{}: {n} clients, {rate:.0} setups/s, {} probes",
        if cached { "_with (cached)" } else { " (probe per accept)" },
        if cached { probes.to_string() } else { n.to_string() }
    );
    rate
}

/// `n` clients at once through the async listener.
fn listener(n: usize, auth: &Auth) -> f64 {
    let (server_nic, client_nic) = devices();
    let opts = SetupOptions::new(PolicyChoice::Auto, auth.clone()).timeout(T);
    let probes = opts.probes.clone();
    let mut l = Listener::bind("127.0.0.1:0".parse().unwrap(), cfg(Role::Server), opts, move || {
        Ok(server_nic.clone())
    })
    .expect("bind");
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        block_on(async {
            for _ in 0..n {
                drop(l.accept().await.expect("accept"));
            }
        })
    });
    let copts = SetupOptions::new(PolicyChoice::Confirm, auth.clone()).timeout(T);
    let started = Instant::now();
    let clients = (0..n).map(|_| connect_async(client_nic.clone(), addr, cfg(Role::Client), &copts));
    let all = block_on(futures::future::join_all(clients));
    server.join().unwrap();
    let rate = n as f64 / started.elapsed().as_secs_f64();
    assert!(all.iter().all(|c| c.is_ok()));
    println!("async Listener: {n} clients at once, {rate:.0} setups/s, {} probes", probes.probes_run());
    rate
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let auth = Auth::Key(Key::from_bytes(b"accept_rate example key".to_vec()).unwrap());
    let before = blocking(n, &auth, false);
    let after = blocking(n, &auth, true);
    listener(n, &auth);
    println!("probe cache: {:.1}x the blocking setups per second", after / before);
}
