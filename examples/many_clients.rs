//! A server and many clients at once over the async setup, under two
//! executors: `futures`' `LocalPool` (one thread) and `async-executor`'s
//! `Executor` (two threads, tasks moving between them).
//!
//! Everything runs in one process on simulated NICs (the simulated fabric
//! is in-process) over a localhost TCP bootstrap with a pre-shared key. A
//! few clients connect and then say nothing: the listener keeps their
//! handshakes pending (until the timeout) while everyone else connects.
//! Each good client makes calls with a payload that the server READs and
//! answers with a reply payload that the client READs, then leaves.
//!
//! The server runs every connection it accepts on one `Hub` (one
//! completion queue, one driver task), each in a protection domain of its
//! own; the clients share another hub.
//!
//! Run with `cargo run --example many_clients [futures|async-executor|both] [CLIENTS]`
//! (both, 50 clients by default). A real server would use `VerbsNic`
//! instead of `SimNic` and nothing else would change; see docs/serving.md.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{join_all, BoxFuture};
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, Key};
use mwcap::conn::{
    connect_async_on, Config, Connection, Hub, HubDriver, Listener, Policies, Policy, PolicyChoice, Role,
    SetupError, SetupOptions,
};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

const CALLS: usize = 5;
const SILENT: usize = 3;

fn cfg(role: Role) -> Config {
    let mut c = Config::new(role, Policies::both(Policy::Confirm));
    c.buffers = 4;
    c.buffer_size = 4096;
    c
}

fn options() -> SetupOptions {
    let key = Key::from_bytes(b"many_clients example key, 16+ bytes".to_vec()).expect("a long enough key");
    SetupOptions::new(PolicyChoice::Auto, Auth::Key(key)).timeout(Duration::from_secs(2))
}

/// Serve one connection: each request's payload comes back reversed.
async fn serve(conn: Connection<SimNic>) {
    while let Some(req) = conn.next_request().await {
        let mut bytes = match &req.data {
            Some(d) => d.to_vec(),
            None => Vec::new(),
        };
        drop(req.data); // back to the pool
        bytes.reverse();
        let Ok(mut out) = conn.alloc().await else { break };
        if out.copy_from(&bytes).is_err() || conn.reply(req.id, 0, b"reversed", Some(out)).await.is_err() {
            break;
        }
    }
}

/// Accept `clients` connections (and report those that fail), handing
/// each to `spawn`: its driver and its service are two tasks.
async fn server<S>(mut listener: Listener<SimNic>, clients: usize, spawn: S)
where
    S: Fn(BoxFuture<'static, ()>),
{
    let mut connected = 0;
    while connected < clients {
        match listener.accept().await {
            Ok(c) => {
                connected += 1;
                let (conn, run) = c.run();
                spawn(Box::pin(serve(conn)));
                spawn(Box::pin(async move {
                    run.await;
                }));
            }
            Err(e) => eprintln!("server: a client failed to connect: {e}"),
        }
    }
    println!(
        "server: {connected} clients connected; {} handshakes still pending (the silent clients)",
        listener.handshakes_in_progress()
    );
}

/// One client: connect, make `CALLS` calls, leave. Returns the setup time.
async fn client(
    hub: Hub<SimNic>,
    addr: SocketAddr,
    opts: SetupOptions,
    id: usize,
) -> Result<Duration, SetupError> {
    let started = Instant::now();
    let (conn, run) = connect_async_on(&hub, addr, cfg(Role::Client), &opts).await?.run();
    let setup = started.elapsed();
    let calls = async {
        for i in 0..CALLS {
            let text = format!("client {id} call {i}");
            let mut b = conn.alloc().await.expect("a buffer");
            b.copy_from(text.as_bytes()).expect("fits");
            let reply = conn.call(b"reverse", Some(b)).await.expect("answered");
            let got = reply.data.as_ref().expect("a reply payload").to_vec();
            assert_eq!(got, text.bytes().rev().collect::<Vec<u8>>());
        }
        conn.close();
    };
    futures::join!(calls, run);
    Ok(setup)
}

/// What `setup` makes.
struct Setup {
    listener: Listener<SimNic>,
    addr: SocketAddr,
    /// The server's hub driver and the clients' hub and its driver.
    server_hub: HubDriver<SimNic>,
    client_hub: (Hub<SimNic>, HubDriver<SimNic>),
    _silent: Vec<TcpStream>,
}

/// The fabric, the hubs, the listener (on the server's hub), the silent clients.
fn setup() -> Setup {
    let fabric = Fabric::with_seed(7);
    let server_nic = fabric.add_device(DeviceConfig::spec().named("server"));
    let client_nic = fabric.add_device(DeviceConfig::spec().named("client"));
    // A hub's completion queue holds every connection's worst case: 65,536
    // entries are enough for several hundred connections of this size.
    let (hub, server_hub) = Hub::new(server_nic, 1 << 16).expect("a hub");
    let nics = hub.clone();
    let listener =
        Listener::bind("127.0.0.1:0".parse().expect("an address"), cfg(Role::Server), options(), {
            move || nics.nic().new_pd() // each connection in a PD of its own
        })
        .expect("listen")
        .on_hub(hub);
    let addr = listener.local_addr().expect("bound");
    let _silent = (0..SILENT).map(|_| TcpStream::connect(addr).expect("connect")).collect();
    let client_hub = Hub::new(client_nic, 1 << 16).expect("a hub");
    Setup { listener, addr, server_hub, client_hub, _silent }
}

fn report(name: &str, started: Instant, setups: Vec<Result<Duration, SetupError>>) {
    let ok: Vec<Duration> = setups.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
    let slowest = ok.iter().max().copied().unwrap_or_default();
    println!(
        "{name}: {} of {} clients served ({CALLS} calls each) in {:?}; slowest setup {slowest:?}",
        ok.len(),
        setups.len(),
        started.elapsed()
    );
    for e in setups.iter().filter_map(|r| r.as_ref().err()) {
        println!("  a client failed: {e}");
    }
}

/// `futures`' single-threaded `LocalPool`.
fn with_local_pool(clients: usize) {
    let Setup { listener, addr, server_hub, client_hub: (hub, client_hub), _silent } = setup();
    let mut pool = futures::executor::LocalPool::new();
    let spawner = pool.spawner();
    let spawn = move |f: BoxFuture<'static, ()>| spawner.spawn_local(f).expect("the pool runs");
    pool.spawner()
        .spawn_local(async move {
            server_hub.run().await;
        })
        .expect("the pool runs");
    pool.spawner()
        .spawn_local(async move {
            client_hub.run().await;
        })
        .expect("the pool runs");
    pool.spawner().spawn_local(server(listener, clients, spawn)).expect("the pool runs");
    // One set of options for every client: its clones share one probe
    // cache, so the client device is probed once, not by each client.
    let opts = options();
    let started = Instant::now();
    let all = join_all((0..clients).map(|id| client(hub.clone(), addr, opts.clone(), id)));
    report("futures LocalPool", started, pool.run_until(all));
}

/// `async-executor`'s `Executor` on two threads.
fn with_async_executor(clients: usize) {
    let Setup { listener, addr, server_hub, client_hub: (hub, client_hub), _silent } = setup();
    let ex = Arc::new(async_executor::Executor::new());
    let (stop, stopped) = async_channel_pair();
    let worker = {
        let ex = ex.clone();
        std::thread::spawn(move || async_io::block_on(ex.run(stopped)))
    };
    let spawn = {
        let ex = ex.clone();
        move |f: BoxFuture<'static, ()>| ex.spawn(f).detach()
    };
    ex.spawn(server_hub.run()).detach();
    ex.spawn(client_hub.run()).detach();
    ex.spawn(server(listener, clients, spawn)).detach();
    let opts = options();
    let started = Instant::now();
    let tasks: Vec<_> =
        (0..clients).map(|id| ex.spawn(client(hub.clone(), addr, opts.clone(), id))).collect();
    let setups = async_io::block_on(ex.run(join_all(tasks)));
    report("async-executor Executor (2 threads)", started, setups);
    stop();
    let _ = worker.join();
}

/// A stop signal for the second executor thread.
fn async_channel_pair() -> (impl FnOnce(), impl std::future::Future<Output = ()> + Send) {
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    (
        move || {
            let _ = tx.send(());
        },
        async move {
            let _ = rx.await;
        },
    )
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or_else(|| "both".into());
    let clients: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(50);
    if matches!(which.as_str(), "futures" | "both") {
        with_local_pool(clients);
    }
    if matches!(which.as_str(), "async-executor" | "both") {
        with_async_executor(clients);
    }
}
