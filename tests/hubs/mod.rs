//! What the tests of many connections on one endpoint (`hub.rs`,
//! `hub_srq.rs`, `hub_pool.rs`) share: spawning on a `LocalPool`, endpoints
//! with their drivers spawned, pairs of connections set up without TCP, the
//! reversed-echo server, the payload pattern, a server on an endpoint with
//! a hand-driven client, and listening endpoints serving a batch of
//! clients.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use async_io::Async;
use futures::channel::oneshot;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{authenticate_client_async, Auth, Capabilities, Handshake, Hello, PolicySet};
use mwcap::conn::{Config, Connection, Endpoint, EndpointBuilder, Link, Pending, Policies, Role, SetupError};
use mwcap::sim::{DeviceId, QpAddr, SimNic};

#[allow(dead_code)] // hub_pool.rs uses it; hub.rs and hub_srq.rs include this module too
pub mod hoarders;

/// One side of a connection as these tests make it: its role, the
/// policies of both directions and its settings (which the library keeps
/// apart: `Endpoint::prepare(role, policies, cfg)`). Dereferences to the
/// settings, to change them in place.
#[derive(Clone, Debug)]
pub struct Side {
    pub role: Role,
    pub policies: Policies,
    pub cfg: Config,
}

impl Side {
    /// `role` with `policies` and the default settings.
    pub fn new(role: Role, policies: Policies) -> Side {
        Side { role, policies, cfg: Config::default() }
    }

    /// A link of this side on `nic`, with a completion queue of its own:
    /// a peer driven by hand.
    #[allow(dead_code)] // not every test of this module drives one
    pub fn link(self, nic: SimNic) -> Result<Link<SimNic>, SetupError> {
        Link::new(nic, self.role, self.policies, self.cfg)
    }

    /// A connection of this side on `ep`, to connect to its peer.
    pub fn prepare(self, ep: &Endpoint<SimNic>) -> Result<Pending<SimNic>, SetupError> {
        ep.prepare(self.role, self.policies, self.cfg)
    }
}

impl std::ops::Deref for Side {
    type Target = Config;
    fn deref(&self) -> &Config {
        &self.cfg
    }
}

impl std::ops::DerefMut for Side {
    fn deref_mut(&mut self) -> &mut Config {
        &mut self.cfg
    }
}

/// Run `f` on `pool`, its output dropped (drivers, services).
pub fn spawn<T: 'static>(pool: &LocalPool, f: impl std::future::Future<Output = T> + 'static) {
    pool.spawner()
        .spawn_local(async move {
            f.await;
        })
        .unwrap();
}

/// The builder of an endpoint on `nic` for connections set up without
/// TCP ([`Endpoint::prepare`], [`Endpoint::connect_local`]): no key.
pub fn builder(nic: SimNic) -> EndpointBuilder<SimNic> {
    Endpoint::builder(nic, Auth::Unauthenticated)
}

/// Build the endpoint `b` says and spawn its driver on `pool`.
pub fn endpoint(pool: &LocalPool, b: EndpointBuilder<SimNic>) -> Endpoint<SimNic> {
    let (ep, driver) = b.build().unwrap();
    spawn(pool, driver.run());
    ep
}

/// A client connection on `client` with `ccfg` and a server connection on
/// `server` with `scfg`, connected to each other.
pub fn pair(
    client: &Endpoint<SimNic>,
    server: &Endpoint<SimNic>,
    ccfg: Side,
    scfg: Side,
) -> (Connection<SimNic>, Connection<SimNic>) {
    let (c, s) = (ccfg.prepare(client).unwrap(), scfg.prepare(server).unwrap());
    let (cl, sl) = (c.local(), s.local());
    (c.connect(&sl).unwrap(), s.connect(&cl).unwrap())
}

/// Serve requests: reply (header `echo`) with the request's payload
/// reversed, or with none. Ends when the connection does; a buffer that
/// cannot be had while the connection is up is a failure.
///
/// A request that comes again (confirm: the client read a stale reply) has
/// no payload; its reply is rebuilt from what the first one carried, which
/// the server keeps, as `Request::again` asks of a server whose reply
/// depends on the request payload.
pub async fn serve(server: Connection<SimNic>) {
    let mut answered: std::collections::HashMap<mwcap::conn::RequestId, Vec<u8>> = Default::default();
    while let Some(req) = server.next_request().await {
        let bytes = if req.again {
            answered.get(&req.id).cloned().unwrap_or_default()
        } else {
            let mut bytes = match &req.data {
                Some(d) => d.to_vec(),
                None => Vec::new(),
            };
            if let Some(d) = req.data {
                server.free(d);
            }
            bytes.reverse();
            answered.insert(req.id, bytes.clone());
            bytes
        };
        let out = if bytes.is_empty() {
            None
        } else {
            let mut b = match server.alloc_for(bytes.len()).await {
                Ok(b) => b,
                Err(_) if server.is_down().is_some() => return,
                Err(e) => panic!("no buffer for a reply on a live connection: {e}"),
            };
            b.copy_from(&bytes).unwrap();
            Some(b)
        };
        if server.reply(req.id, 0, b"echo", out).await.is_err() {
            return;
        }
    }
}

/// A server queue pair on `server` with `scfg`, and a client link with
/// `ccfg` and a CQ of its own on a new PD of `client_nic`, connected to
/// it: drive the client by hand (a hostile or misbehaving peer), and
/// connect the server with `pending.connect(&client.local())` (or look into
/// it first, `pending.link()`).
pub fn server_with_link_client(
    server: &Endpoint<SimNic>,
    client_nic: &SimNic,
    scfg: Side,
    ccfg: Side,
) -> (Pending<SimNic>, Link<SimNic>) {
    let s = scfg.prepare(server).unwrap();
    let mut c = Link::new(client_nic.new_pd().unwrap(), ccfg.role, ccfg.policies, ccfg.cfg).unwrap();
    c.connect(&s.local()).unwrap();
    (s, c)
}

/// The first half of a client's bootstrap, by hand, against the listening
/// endpoint `ep` (whose QPs are on device `server_dev` of `fabric`): an
/// `accept` spawned on `pool`, `client`'s hello (serving mw); `client`
/// connected to the server's QP, which the server does not connect until
/// the client's ready byte. Returns the handshake (drop it to go away
/// before the ready byte, which fails the server's handshake and destroys
/// its QP), the server QP's address, and what that `accept` will end with
/// (`Some` error: the handshake failed).
#[allow(dead_code)] // hub_srq.rs uses it; hub.rs and hub_pool.rs include this module too
pub fn half_bootstrap(
    pool: &mut LocalPool,
    ep: &Endpoint<SimNic>,
    server_dev: DeviceId,
    client: &mut Link<SimNic>,
) -> (Handshake<Async<TcpStream>>, QpAddr, oneshot::Receiver<Option<SetupError>>) {
    let (tx, rx) = oneshot::channel();
    let server = ep.clone();
    spawn(pool, async move {
        let _ = tx.send(server.accept().await.err());
    });
    let mut caps = Capabilities::new();
    caps.serve = PolicySet::MW;
    let hello = Hello::new(client.local(), caps);
    let addr = ep.local_addr().expect("it listens");
    let hs = pool.run_until(async {
        let t = Duration::from_secs(5);
        let authed = authenticate_client_async(addr, &Auth::Unauthenticated, t).await.expect("auth");
        authed.hello(&hello, t).await.expect("hello")
    });
    let at = QpAddr { device: server_dev, qpn: hs.peer().endpoint.qpn };
    client.connect(&hs.remote_endpoint()).unwrap();
    (hs, at, rx)
}

/// A server connection prepared on `server` whose QP is connected to a
/// client link's (on `client_nic`) but not put on the endpoint
/// (`Pending::connect_unadded`): nothing takes its completions, which its
/// route holds. Drop the `Pending` to destroy its QP (the route retired).
#[allow(dead_code)] // hub.rs and hub_srq.rs use it; hub_pool.rs includes this module too
pub fn connected_unadded(
    server: &Endpoint<SimNic>,
    client_nic: &SimNic,
    scfg: Side,
    ccfg: Side,
) -> (Pending<SimNic>, Link<SimNic>) {
    let (mut s, c) = server_with_link_client(server, client_nic, scfg, ccfg);
    s.connect_unadded(&c.local()).unwrap();
    (s, c)
}

/// The bytes of payload `i`.
pub fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| ((k * 31 + i * 7) % 251) as u8).collect()
}

/// Accept `clients` connections, spread over the listening endpoints
/// `servers` (client `i` goes to `servers[i % servers.len()]`), each
/// served by [`serve`] until its client's connection is down (its
/// bootstrap stream closes with it); connect that many clients through
/// `client`, each making one call with 500 bytes of its pattern; returns
/// whether each got its own bytes back, reversed. Spawn the endpoints'
/// drivers first.
pub fn serve_clients(
    pool: &mut LocalPool,
    servers: &[Endpoint<SimNic>],
    clients: usize,
    client: &Endpoint<SimNic>,
) -> Vec<bool> {
    for (j, server) in servers.iter().enumerate() {
        let mine = (0..clients).filter(|i| i % servers.len() == j).count();
        let (server, spawner) = (server.clone(), pool.spawner());
        pool.spawner()
            .spawn_local(async move {
                for _ in 0..mine {
                    let conn = server.accept().await.expect("a client");
                    spawner.spawn_local(serve(conn)).unwrap();
                }
            })
            .unwrap();
    }
    let addrs: Vec<SocketAddr> = servers.iter().map(|s| s.local_addr().expect("it listens")).collect();
    pool.run_until(futures::future::join_all((0..clients).map(|i| {
        let (client, addr) = (client.clone(), addrs[i % addrs.len()]);
        async move {
            let conn = client.connect(addr).await.expect("connect");
            let mut b = conn.alloc().await.unwrap();
            b.copy_from(&pattern(i, 500)).unwrap();
            let r = conn.call(b"x", Some(b)).await.expect("served");
            let mut want = pattern(i, 500);
            want.reverse();
            let ok = r.data.as_ref().unwrap().to_vec() == want;
            drop(r);
            conn.close();
            ok
        }
    })))
}
