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
//! The server runs every connection it accepts on its one `Endpoint` (one
//! completion queue, one driver task), each in a protection domain of its
//! own; the clients share another endpoint.
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
use mwcap::conn::{Config, Connection, Endpoint, EndpointDriver, PolicyChoice, SetupError};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

const CALLS: usize = 5;
const SILENT: usize = 3;

fn cfg() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 4096;
    c
}

/// An endpoint on `nic` (listening on a free port for the server): `auto`,
/// the example's key, 2 s per handshake phase.
fn endpoint(nic: SimNic, server: bool) -> (Endpoint<SimNic>, EndpointDriver<SimNic>) {
    let key = Key::from_bytes(b"many_clients example key, 16+ bytes".to_vec()).expect("a long enough key");
    let mut b = Endpoint::builder(nic, Auth::Key(key))
        .policy(PolicyChoice::Auto)
        .config(cfg())
        .handshake_timeout(Duration::from_secs(2))
        // A completion queue holds every connection's worst case: 65,536
        // entries are enough for several hundred connections of this size.
        .queue_depth(1 << 16);
    if server {
        b = b.listen("127.0.0.1:0".parse().expect("an address"));
    }
    b.build().expect("an endpoint")
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
/// each to `spawn` to be served; then stop listening, which ends the
/// silent clients' handshakes.
async fn server<S>(endpoint: Endpoint<SimNic>, clients: usize, silent: Arc<Vec<TcpStream>>, spawn: S)
where
    S: Fn(BoxFuture<'static, ()>),
{
    let mut connected = 0;
    while connected < clients {
        match endpoint.accept().await {
            Ok(conn) => {
                connected += 1;
                spawn(Box::pin(serve(conn)));
            }
            Err(e) => eprintln!("server: a client failed to connect: {e}"),
        }
    }
    println!(
        "server: {connected} clients connected; {} handshakes still pending (the silent clients)",
        still_open(&silent)
    );
    endpoint.stop_listening();
}

/// How many of the silent clients' TCP connections the server has not
/// closed: their handshakes are still pending (a handshake that timed out
/// or failed closes its connection).
fn still_open(silent: &[TcpStream]) -> usize {
    silent
        .iter()
        .filter(|s| match s.peek(&mut [0u8; 1]) {
            Ok(n) => n > 0,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        })
        .count()
}

/// One client: connect, make `CALLS` calls, leave. Returns the setup time.
async fn client(endpoint: Endpoint<SimNic>, addr: SocketAddr, id: usize) -> Result<Duration, SetupError> {
    let started = Instant::now();
    let conn = endpoint.connect(addr).await?;
    let setup = started.elapsed();
    for i in 0..CALLS {
        let text = format!("client {id} call {i}");
        let mut b = conn.alloc().await.expect("a buffer");
        b.copy_from(text.as_bytes()).expect("fits");
        let reply = conn.call(b"reverse", Some(b)).await.expect("answered");
        let got = reply.data.as_ref().expect("a reply payload").to_vec();
        assert_eq!(got, text.bytes().rev().collect::<Vec<u8>>());
    }
    conn.close();
    conn.closed().await;
    Ok(setup)
}

/// What `setup` makes.
struct Setup {
    server: (Endpoint<SimNic>, EndpointDriver<SimNic>),
    addr: SocketAddr,
    client: (Endpoint<SimNic>, EndpointDriver<SimNic>),
    silent: Arc<Vec<TcpStream>>,
}

/// The fabric, the two endpoints (the server's listening), the silent clients.
fn setup() -> Setup {
    let fabric = Fabric::with_seed(7);
    let server = endpoint(fabric.add_device(DeviceConfig::spec().named("server")), true);
    let addr = server.0.local_addr().expect("it listens");
    let silent = (0..SILENT)
        .map(|_| {
            let s = TcpStream::connect(addr).expect("connect");
            s.set_nonblocking(true).expect("a socket");
            s
        })
        .collect();
    let client = endpoint(fabric.add_device(DeviceConfig::spec().named("client")), false);
    Setup { server, addr, client, silent: Arc::new(silent) }
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
    let Setup { server: (server_ep, server_driver), addr, client: (client_ep, client_driver), silent } =
        setup();
    let mut pool = futures::executor::LocalPool::new();
    let spawner = pool.spawner();
    let spawn = move |f: BoxFuture<'static, ()>| spawner.spawn_local(f).expect("the pool runs");
    for driver in [server_driver, client_driver] {
        pool.spawner()
            .spawn_local(async move {
                driver.run().await;
            })
            .expect("the pool runs");
    }
    pool.spawner().spawn_local(server(server_ep, clients, silent, spawn)).expect("the pool runs");
    // The clients share one endpoint, and so its probe cache: the client
    // device is probed once, not by each client.
    let started = Instant::now();
    let all = join_all((0..clients).map(|id| client(client_ep.clone(), addr, id)));
    report("futures LocalPool", started, pool.run_until(all));
}

/// `async-executor`'s `Executor` on two threads.
fn with_async_executor(clients: usize) {
    let Setup { server: (server_ep, server_driver), addr, client: (client_ep, client_driver), silent } =
        setup();
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
    ex.spawn(server_driver.run()).detach();
    ex.spawn(client_driver.run()).detach();
    ex.spawn(server(server_ep, clients, silent, spawn)).detach();
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients).map(|id| ex.spawn(client(client_ep.clone(), addr, id))).collect();
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
