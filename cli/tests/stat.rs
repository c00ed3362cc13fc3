//! `mwcap::stat` and `mwcap stat`: a live view of a process's connections
//! over a local socket, with the counters the connections themselves keep.

use futures::executor::{block_on, LocalPool};
use futures::future::{select, Either};
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, Key};
use mwcap::conn::{Connection, Endpoint, Policies, Policy, PolicyChoice};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};
use mwcap::stat::{Registry, StatServer};

/// The driver of an endpoint with one connection: ends once the
/// connection has (the endpoint handle is dropped).
type Drive = futures::future::BoxFuture<'static, mwcap::conn::EndpointStats>;

type Pair = (Connection<SimNic>, Drive, Connection<SimNic>, Drive);

fn connected(p: Policies) -> Pair {
    let fabric = Fabric::with_seed(5);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let (ce, cdrv) = Endpoint::builder(cn, Auth::Unauthenticated).build().unwrap();
    let (se, sdrv) = Endpoint::builder(sn, Auth::Unauthenticated).build().unwrap();
    let (client, server) = ce.connect_local(&se, p).unwrap();
    (client, Box::pin(cdrv.run()), server, Box::pin(sdrv.run()))
}

/// `n` calls with a 1000-byte request payload, answered by `server`.
async fn calls(client: &Connection<SimNic>, server: &Connection<SimNic>, n: usize) {
    let serve = async {
        for _ in 0..n {
            let req = server.next_request().await.expect("a request");
            if let Some(d) = req.data {
                server.free(d);
            }
            server.reply(req.id, 0, b"ok", None).await.unwrap();
        }
    };
    let app = async {
        for _ in 0..n {
            let mut b = client.alloc().await.unwrap();
            b.copy_from(&[7; 1000]).unwrap();
            client.call(b"q", Some(b)).await.expect("call");
        }
    };
    futures::future::join(serve, app).await;
}

fn socket(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("mwcap-test-{}-{name}.sock", std::process::id()))
}

fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(' ')
        .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[test]
fn the_stat_socket_shows_each_connection_with_its_counters_until_it_is_gone() {
    let (client, cdrv, server, sdrv) = connected(Policies::both(Policy::Mw));
    let registry = Registry::new();
    let path = socket("counters");
    let stat = StatServer::bind(&path, registry.clone()).unwrap();
    assert!(StatServer::bind(&path, Registry::new()).is_err(), "a live socket is not taken over");
    registry.register(&client, "client side");
    registry.register(&server, "10.0.0.9:5000");
    let app = async {
        calls(&client, &server, 25).await;
        let text = mwcap::stat::fetch(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("mwcap-stat 1 ") && lines[0].ends_with(" connections=2"), "{text}");
        let (c, s) = (lines[1], lines[2]);
        assert_eq!(field(c, "peer"), "client_side", "spaces in a name become underscores");
        assert_eq!((field(c, "role"), field(c, "request"), field(c, "state")), ("client", "mw", "up"));
        assert_eq!((field(c, "calls"), field(c, "replies_received")), ("25", "25"));
        assert_eq!((field(c, "binds"), field(c, "bytes_exposed")), ("25", "25000"));
        assert_eq!((field(s, "role"), field(s, "peer")), ("server", "10.0.0.9:5000"));
        assert_eq!(
            (field(s, "requests"), field(s, "replies_sent"), field(s, "bytes_read")),
            ("25", "25", "25000")
        );
        assert!(field(s, "qpn").parse::<u32>().is_ok(), "{s}");
        assert!(lines[3].starts_with("total connections=2 up=2 calls=25 "), "{text}");
        // The CLI reads the same socket.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mwcap"))
            .args(["stat", "--socket"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let table = String::from_utf8(out.stdout).unwrap();
        assert!(table.contains("2 connection(s)") && table.contains("10.0.0.9:5000"), "{table}");
        assert!(table.lines().any(|l| l.starts_with("total") && l.contains("2 up")), "{table}");
        // A closed connection shows down, with its reason.
        client.close();
        let reason = client.closed().await;
        let text = mwcap::stat::fetch(&path).unwrap();
        let c = text.lines().nth(1).unwrap();
        assert_eq!(field(c, "state"), "down");
        assert!(c.ends_with(&format!(" reason={reason}")), "{c}");
        server.close();
    };
    let drivers = futures::future::join(cdrv, sdrv);
    block_on(async {
        match select(std::pin::pin!(app), std::pin::pin!(drivers)).await {
            Either::Left(((), d)) => {
                d.await;
            }
            Either::Right(_) => panic!("the drivers ended before the test"),
        }
    });
    drop((client, server));
    let text = mwcap::stat::fetch(&path).unwrap();
    assert!(text.starts_with("mwcap-stat 1 ") && text.contains(" connections=0\n"), "{text}");
    drop(stat);
    assert!(!path.exists(), "the socket file goes with the server");
    let err = mwcap::stat::fetch(&path).unwrap_err();
    assert!(err.to_string().contains("--stat-socket"), "{err}");
}

#[test]
fn a_device_whose_counters_cannot_be_read_says_so_on_its_line() {
    let registry = Registry::new();
    registry.add_device("no-such-dev", 1);
    registry.add_device("no-such-dev", 1);
    let text = registry.render();
    let devices: Vec<&str> = text.lines().filter(|l| l.starts_with("device ")).collect();
    assert_eq!(devices.len(), 1, "added once: {text}");
    assert!(
        devices[0].starts_with(
            "device name=no-such-dev port=1 reason=cannot read /sys/class/infiniband/no-such-dev/"
        ),
        "{text}"
    );
    assert!(text.contains("\ntotal connections=0 up=0 "), "{text}");
}

/// A server endpoint on a simulated NIC (its completion queue 1000 deep,
/// with shared receives if `srq`) with one client connected to it from
/// another endpoint, both drivers spawned on the returned pool.
fn endpoints(srq: Option<mwcap::conn::SrqConfig>) -> (LocalPool, Endpoint<SimNic>, Endpoint<SimNic>) {
    let fabric = Fabric::with_seed(3);
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let key = Key::from_bytes(b"the stat tests' endpoint key".to_vec()).unwrap();
    let mut server = Endpoint::builder(sn, Auth::Key(key.clone()))
        .policy(PolicyChoice::Mw)
        .queue_depth(1000)
        .listen("127.0.0.1:0".parse().unwrap());
    if let Some(q) = srq {
        server = server.shared_receives(q);
    }
    let (server, sdrv) = server.build().unwrap();
    let (client, cdrv) = Endpoint::builder(cn, Auth::Key(key)).policy(PolicyChoice::Mw).build().unwrap();
    let pool = LocalPool::new();
    for drv in [sdrv, cdrv] {
        pool.spawner()
            .spawn_local(async move {
                drv.run().await;
            })
            .unwrap();
    }
    (pool, server, client)
}

/// Connect `client` to `server` on `pool`: the two sides' connections.
fn connect(
    pool: &mut LocalPool,
    server: &Endpoint<SimNic>,
    client: &Endpoint<SimNic>,
) -> (Connection<SimNic>, Connection<SimNic>) {
    let addr = server.local_addr().unwrap();
    let (c, s) = pool.run_until(futures::future::join(client.connect(addr), server.accept()));
    (c.expect("connected"), s.expect("accepted"))
}

#[test]
fn an_endpoint_has_a_hub_line_with_its_counts_while_it_lives() {
    let (mut pool, server, client) = endpoints(None);
    let registry = Registry::new();
    registry.add_endpoint("mw hub", &server);
    let (c, s) = connect(&mut pool, &server, &client);
    // The server's endpoint knows where its client is: the client's end of
    // the bootstrap stream.
    let peer = s.peer_addr().expect("an endpoint's connection has its peer's address");
    assert!(peer.ip().is_loopback() && peer.port() != server.local_addr().unwrap().port(), "{peer}");
    let text = registry.render();
    let line = text.lines().find(|l| l.starts_with("hub ")).unwrap_or_else(|| panic!("no hub line: {text}"));
    assert_eq!(field(line, "name"), "mw_hub");
    assert_eq!(field(line, "connections"), "1");
    assert_eq!(field(line, "depth"), "1000");
    assert_eq!(field(line, "reserved_entries"), server.stats().reserved_entries.to_string());
    assert!(!line.contains("srq_slots="), "an endpoint without shared receives: {line}");
    c.close();
    s.close();
    drop((c, s, client, server));
    // The drivers end once their endpoints are dropped and their
    // connections have finished.
    pool.run();
    assert!(!registry.render().contains("\nhub "), "a gone endpoint keeps its line");
}

#[test]
fn an_endpoint_with_shared_receives_shows_its_queue_on_its_line() {
    use mwcap::conn::SrqConfig;
    let (mut pool, server, client) = endpoints(Some(SrqConfig { chunk: 64, max_slots: 256 }));
    let registry = Registry::new();
    registry.add_endpoint("mw", &server);
    let (_c, _s) = connect(&mut pool, &server, &client);
    let text = registry.render();
    let line = text.lines().find(|l| l.starts_with("hub ")).unwrap_or_else(|| panic!("no hub line: {text}"));
    assert_eq!(field(line, "connections"), "1");
    assert_eq!(field(line, "srq_slots"), "64");
    assert_eq!(field(line, "srq_shares"), "8");
    assert_eq!(field(line, "srq_bytes"), (64 * 4096).to_string());
}
