//! Capabilities that travel: a storage node, a client that gets a
//! capability to one of its blocks and hands it on, and a compute node that
//! reads the block with it.
//!
//! The storage node keeps its blocks in a region of its endpoint and serves
//! one request of its own protocol, "read BLOCK", answered with the block's
//! range of the region (`Connection::reply_region`): its application knows
//! nothing of delegation. A plain call reads the block. The client instead
//! calls with `Connection::call_delegated`, naming the compute node's
//! identity: the storage node's library, not its application, delegates the
//! block the application replied with and answers with a token (sealed by
//! the storage endpoint, naming the block's bytes, the identity that may
//! redeem it and an expiry); nothing is exposed to the client. The client
//! passes the token on by its own means, and may revoke it
//! (`Connection::revoke`). The compute node, connected to the storage node
//! as that identity, redeems it with `Connection::redeem`: one message, and
//! the block comes back as the reply payload, read through an exposure
//! made for the compute node alone (under mw a window over exactly the
//! block on its queue pair). A token redeems once; a revoked one is
//! refused; another identity's connection is refused; a holder hands on
//! part of what it holds (`Connection::delegate`), never more or for
//! longer; until every delegation of the block is over the storage node
//! cannot overwrite it.
//!
//! On the simulated NIC, all three in this process (the keys are demo keys,
//! derived from each name):
//!
//! ```text
//! cargo run --example delegate
//! ```
//!
//! On verbs, three processes (the SoftRoCE VM suite runs this on rxe0):
//!
//! ```text
//! cargo build --release --features verbs --example delegate
//! delegate storage --device rxe0 --listen 127.0.0.1:7000 [--trusted-peers] [--for SECS]
//! delegate client  --device rxe0 --connect 127.0.0.1:7000 --block 7 [--count N] [--revoke]   # prints: token CAP HEX
//! delegate compute --device rxe0 --connect 127.0.0.1:7000 --block 7 --token HEX[,HEX...] [--expect-refusal]
//! ```
//!
//! Every role takes `--policy mw|confirm|auto` (auto by default) and
//! `--trusted-peers` (mw on rxe needs it: `mwcap probe` says why). The
//! client prints one token per block (`--count`, blocks from `--block`
//! on), each handed on to compute-1 (`--revoke`: and revoked by the
//! client); the compute node redeems each, times each redemption (from
//! having the token to the block read, `delegate_read`) and prints the
//! policies its connection runs.

use std::net::SocketAddr;
use std::time::Duration;

use mwcap::backend::Nic;
use mwcap::bootstrap::{Auth, Key, Keyring};
use mwcap::conn::{
    CapId, Config, Connection, Endpoint, PolicyChoice, RedeemFailed, RegionId, RegionRange, Token,
};

/// Bytes of a block, and blocks the storage node keeps.
const BLOCK: usize = 4096;
const BLOCKS: usize = 64;
/// How long the storage node's capabilities last (the `lease_time` its
/// connections agree on: a delegation of a reply lasts no longer).
const TTL: Duration = Duration::from_secs(30);

/// Byte `i` of block `b`: every byte the compute node reads is checked.
fn byte(b: usize, i: usize) -> u8 {
    (b * 131 + i * 7 + i / 251) as u8
}

/// A demo key for `name` (32 bytes derived from it). Real deployments load
/// a keyring file (`Keyring::from_file`, `docs/deploy.md`).
fn demo_key(name: &str) -> Key {
    let mut k = format!("mwcap-demo-key:{name}:").into_bytes();
    while k.len() < 32 {
        k.extend_from_slice(name.as_bytes());
    }
    Key::from_bytes(k).expect("32 bytes or more")
}

fn keyring(names: &[&str]) -> Keyring {
    let mut r = Keyring::new();
    for n in names {
        r.insert(n, demo_key(n)).expect("a valid name");
    }
    r
}

/// The storage node: its endpoint listening at `listen` (the peers it knows:
/// "client-a" and "compute-1"), its blocks written, a thread serving each
/// connection. Returns the endpoint, its region and the address it listens on.
fn storage<N: Nic + Send + Sync + 'static>(
    nic: N,
    listen: SocketAddr,
    trusted: bool,
    policy: PolicyChoice,
) -> (Endpoint<N>, RegionId, SocketAddr) {
    let mut cfg = Config::default();
    cfg.lease_time = TTL;
    let (ep, driver) = Endpoint::builder(nic, Auth::Keyring(keyring(&["client-a", "compute-1"])))
        .trusted_peers(trusted)
        .policy(policy)
        .config(cfg)
        // rxe's completion queues hold at most 32,767 entries.
        .queue_depth(4096)
        .name("storage")
        .listen(listen)
        .build()
        .expect("the storage endpoint");
    std::thread::spawn(move || futures::executor::block_on(driver.run()));
    let region = ep.register_region(BLOCK * BLOCKS).expect("the storage region");
    let blocks: Vec<u8> = (0..BLOCKS).flat_map(|b| (0..BLOCK).map(move |i| byte(b, i))).collect();
    ep.region_write(region, 0, &blocks).expect("the blocks written");
    let addr = ep.local_addr().expect("it listens");
    let acceptor = ep.clone();
    std::thread::spawn(move || {
        futures::executor::block_on(async {
            while let Ok(conn) = acceptor.accept().await {
                std::thread::spawn(move || futures::executor::block_on(serve(conn, region)));
            }
        })
    });
    (ep, region, addr)
}

/// The storage node's protocol: "read BLOCK" is answered with the block, a
/// range of the region. (A call for a delegation is answered the same way:
/// the library, not this code, turns the range into a token.)
async fn serve<N: Nic + 'static>(conn: Connection<N>, region: RegionId) {
    while let Some(req) = conn.next_request().await {
        let text = String::from_utf8_lossy(&req.header).into_owned();
        let words: Vec<&str> = text.split_whitespace().collect();
        let r = match &words[..] {
            ["read", block] => match block.parse::<usize>() {
                Ok(b) if b < BLOCKS => {
                    let range = RegionRange { region, offset: b * BLOCK, len: BLOCK as u32 };
                    match conn.reply_region(req.id, 0, b"", range).await {
                        Ok(()) => Ok(()),
                        Err(e) => conn.reply(req.id, 2, e.to_string().as_bytes(), None).await,
                    }
                }
                _ => {
                    conn.reply(req.id, 1, format!("no block {block}: there are {BLOCKS}").as_bytes(), None)
                        .await
                }
            },
            _ => conn.reply(req.id, 1, format!("unknown request {text:?}").as_bytes(), None).await,
        };
        if r.is_err() {
            return;
        }
    }
}

/// An endpoint proving `name`'s key, connected to the storage node at `addr`.
fn connect<N: Nic + Send + Sync + 'static>(
    nic: N,
    name: &str,
    addr: SocketAddr,
    trusted: bool,
    policy: PolicyChoice,
) -> Connection<N> {
    // The lease both sides agree on is the shorter of theirs.
    let mut cfg = Config::default();
    cfg.lease_time = TTL;
    let (ep, driver) = Endpoint::builder(nic, Auth::Keyring(keyring(&[name])))
        .trusted_peers(trusted)
        .policy(policy)
        .config(cfg)
        .queue_depth(4096)
        .name(name)
        .build()
        .expect("an endpoint");
    std::thread::spawn(move || futures::executor::block_on(driver.run()));
    let conn = futures::executor::block_on(ep.connect(addr)).expect("connected to the storage node");
    assert_eq!(conn.peer_identity(), Some(name), "the key both sides proved");
    conn
}

/// The client: get a capability to `block`, delegated to `identity`: the
/// delegation (its id, to revoke it, and the token to pass on).
fn hand_on<N: Nic + 'static>(conn: &Connection<N>, block: usize, identity: &str) -> (CapId, Token) {
    let header = format!("read {block}");
    let reply = futures::executor::block_on(conn.call_delegated(header.as_bytes(), identity, TTL / 2))
        .expect("the storage node answers");
    assert_eq!(reply.status, 0, "{}", String::from_utf8_lossy(&reply.header));
    let d = reply.delegation.expect("a block comes as a delegation");
    (d.cap, d.token)
}

/// The client: revoke a delegation it made.
fn revoke<N: Nic + 'static>(conn: &Connection<N>, cap: CapId) {
    futures::executor::block_on(conn.revoke(cap)).expect("the client revokes what it delegated");
}

/// The compute node: redeem `token` and check every byte of `block`.
fn read_block<N: Nic + 'static>(
    conn: &Connection<N>,
    token: &Token,
    block: usize,
) -> Result<(), RedeemFailed> {
    let reply = futures::executor::block_on(conn.redeem(token))?;
    let data = reply.data.expect("the block comes as the payload");
    assert_eq!(data.len(), BLOCK, "exactly the block");
    for (i, &b) in data.iter().enumerate() {
        assert_eq!(b, byte(block, i), "byte {i} of block {block}");
    }
    conn.free(data);
    Ok(())
}

fn refusal(r: Result<(), RedeemFailed>) -> String {
    match r {
        Err(RedeemFailed::Refused { refusal, message }) => format!("{refusal:?}: {message}"),
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(()) => panic!("expected a refusal, but the block was read"),
    }
}

/// All three on one simulated fabric, in this process.
fn simulated() {
    use mwcap::sim::{DeviceConfig, Fabric};
    let fabric = Fabric::with_seed(7);
    let auto = PolicyChoice::Auto;
    let (store, region, addr) =
        storage(fabric.add_device(DeviceConfig::spec()), "127.0.0.1:0".parse().unwrap(), false, auto);
    let client = connect(fabric.add_device(DeviceConfig::spec()), "client-a", addr, false, auto);
    let compute = connect(fabric.add_device(DeviceConfig::spec()), "compute-1", addr, false, auto);

    // The client gets a capability to block 7 and hands it on to compute-1.
    let (cap, token) = hand_on(&client, 7, "compute-1");
    println!(
        "client-a: called for block 7 as a delegation to compute-1: delegation {}, a token of {} bytes",
        cap.0,
        token.as_bytes().len()
    );
    let pinned = store.region_write(region, 7 * BLOCK, b"new").expect_err("block 7 is pinned");
    println!("storage: overwriting block 7 while the token is out: {pinned}");
    read_block(&compute, &token, 7).expect("compute-1 reads block 7");
    println!("compute-1: read block 7 with it ({BLOCK} bytes, every byte checked)");
    println!("compute-1, the same token again: refused, {}", refusal(read_block(&compute, &token, 7)));
    // A token for another identity's connection.
    let (_, theirs) = hand_on(&client, 8, "compute-1");
    println!(
        "client-a, redeeming compute-1's token itself: refused, {}",
        refusal(read_block(&client, &theirs, 8))
    );
    read_block(&compute, &theirs, 8).expect("compute-1 still reads block 8 with it");
    // Revoked by the client before it was redeemed.
    let (cap, token) = hand_on(&client, 9, "compute-1");
    revoke(&client, cap);
    println!("compute-1, a token client-a revoked: refused, {}", refusal(read_block(&compute, &token, 9)));
    // A capability for itself, of which it hands on a part: never more,
    // never for longer than the storage node's capabilities last.
    let mine = futures::executor::block_on(client.call_delegated(b"read 10", "client-a", TTL / 2))
        .expect("an answer")
        .delegation
        .expect("a delegation");
    let part = futures::executor::block_on(client.delegate(&mine.token, "compute-1", Some(0..512), TTL / 4))
        .expect("the client hands on a part of block 10");
    let reply = futures::executor::block_on(compute.redeem(&part.token)).expect("compute-1 reads the part");
    let data = reply.data.expect("the part");
    assert!(data.len() == 512 && data.iter().enumerate().all(|(i, &b)| b == byte(10, i)));
    compute.free(data);
    println!("client-a, a token for itself, of which it handed on 512 bytes: compute-1 read exactly those");
    let mine = futures::executor::block_on(client.call_delegated(b"read 11", "client-a", TTL / 2))
        .expect("an answer")
        .delegation
        .expect("a delegation");
    let wider = futures::executor::block_on(client.delegate(
        &mine.token,
        "compute-1",
        Some(0..BLOCK as u32 + 1),
        TTL / 4,
    ));
    println!("client-a, handing on more than its block: refused, {}", refusal(wider.map(|_| ())));
    let longer = futures::executor::block_on(client.call_delegated(b"read 12", "compute-1", TTL * 2));
    println!(
        "client-a, asking for longer than the storage node's lease: refused, {}",
        refusal(longer.map(|_| ()))
    );
    // A plain call reads the block itself.
    let reply = futures::executor::block_on(client.call(b"read 13", None)).expect("a plain call");
    let data = reply.data.expect("the block");
    assert!(data.len() == BLOCK && data.iter().enumerate().all(|(i, &b)| b == byte(13, i)));
    client.free(data);
    println!("client-a, a plain call of the same protocol: read block 13 itself");
    // Every delegation is over: the blocks are the storage node's again.
    let free = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(10));
        store.region_write(region, 7 * BLOCK, &[0; 16]).is_ok()
    });
    assert!(free, "block 7 is written again once its delegation is over");
    println!("storage: block 7 written again, its delegation over");
    println!("delegate: every delegation behaved (simulated NIC)");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        return simulated();
    }
    #[cfg(feature = "verbs")]
    return verbs::main(&args);
    #[cfg(not(feature = "verbs"))]
    {
        eprintln!("delegate: the roles (storage, client, compute) run on verbs: build with --features verbs");
        std::process::exit(2);
    }
}

#[cfg(feature = "verbs")]
mod verbs {
    use super::*;
    use mwcap::verbs::VerbsNic;

    fn opt<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
    }

    fn need<'a>(args: &'a [String], name: &str) -> &'a str {
        opt(args, name).unwrap_or_else(|| {
            eprintln!("delegate: {name} is needed (see the example's docs)");
            std::process::exit(2)
        })
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
    }

    pub fn main(args: &[String]) {
        let device = need(args, "--device");
        let nic = || VerbsNic::open(Some(device), 1, 1).expect("the verbs device");
        let trusted = args.iter().any(|a| a == "--trusted-peers");
        let policy = match opt(args, "--policy") {
            None | Some("auto") => PolicyChoice::Auto,
            Some("mw") => PolicyChoice::Mw,
            Some("confirm") => PolicyChoice::Confirm,
            Some(other) => {
                eprintln!("delegate: --policy is mw, confirm or auto, not {other:?}");
                std::process::exit(2)
            }
        };
        match args[0].as_str() {
            "storage" => {
                let listen = need(args, "--listen").parse().expect("an address");
                let (_ep, _region, addr) = storage(nic(), listen, trusted, policy);
                println!("storage: listening on {addr}");
                let secs = opt(args, "--for").map_or(600, |s| s.parse().expect("seconds"));
                std::thread::sleep(Duration::from_secs(secs));
            }
            "client" => {
                let addr = need(args, "--connect").parse().expect("an address");
                let block: usize = need(args, "--block").parse().expect("a block");
                let count: usize = opt(args, "--count").map_or(1, |c| c.parse().expect("a count"));
                let conn = connect(nic(), "client-a", addr, trusted, policy);
                for b in block..block + count {
                    let (cap, token) = hand_on(&conn, b % BLOCKS, "compute-1");
                    if args.iter().any(|a| a == "--revoke") {
                        revoke(&conn, cap);
                    }
                    println!("token {} {}", cap.0, hex(token.as_bytes()));
                }
            }
            "compute" => {
                let addr = need(args, "--connect").parse().expect("an address");
                let block: usize = need(args, "--block").parse().expect("a block");
                // One token, or several (comma-separated) for blocks
                // block, block + 1, ...: each redemption is timed.
                let tokens: Vec<Token> = need(args, "--token")
                    .split(',')
                    .map(|t| Token::from_bytes(unhex(t)).expect("--token: a token the holder printed"))
                    .collect();
                let conn = connect(nic(), "compute-1", addr, trusted, policy);
                if args.iter().any(|a| a == "--expect-refusal") {
                    println!("compute-1: refused, {}", refusal(read_block(&conn, &tokens[0], block)));
                    return;
                }
                let mut times = Vec::new();
                for (i, token) in tokens.iter().enumerate() {
                    let start = std::time::Instant::now();
                    let reply = futures::executor::block_on(conn.redeem(token)).expect("compute-1 redeems");
                    times.push(start.elapsed());
                    let data = reply.data.expect("the block comes as the payload");
                    let b = (block + i) % BLOCKS;
                    assert!(data.len() == BLOCK && data.iter().enumerate().all(|(j, &x)| x == byte(b, j)));
                    conn.free(data);
                }
                println!("compute-1: policies {:?}", conn.policies());
                println!(
                    "compute-1: read {} block(s) from block {block} ({BLOCK} bytes each, every byte checked)",
                    tokens.len()
                );
                times.sort();
                println!(
                    "delegate_read size={BLOCK} n={} p50_us={:.1} min_us={:.1} (the token to the block read, by its redemption)",
                    times.len(),
                    times[times.len() / 2].as_secs_f64() * 1e6,
                    times[0].as_secs_f64() * 1e6
                );
                println!(
                    "compute-1, the same token again: refused, {}",
                    refusal(read_block(&conn, &tokens[0], block))
                );
            }
            other => {
                eprintln!("delegate: unknown role {other:?}: storage, client or compute");
                std::process::exit(2);
            }
        }
    }
}
