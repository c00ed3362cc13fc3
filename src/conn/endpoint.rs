//! [`Endpoint`]: the connections of one process on one NIC, with one
//! completion queue and one driver, made with [`Endpoint::connect`] and
//! taken with [`Endpoint::accept`]; [`Endpoint::builder`] says how. The
//! bootstrap's TCP stream of each connection is the endpoint's to keep:
//! its driver watches every stream and takes a connection down with
//! [`LossReason::PeerGone`](super::LossReason::PeerGone) when its peer
//! closes it, so nothing the application forgets to keep alive closes a
//! connection. Its place in the layers: `docs/architecture.md`.

use std::future::poll_fn;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::channel::mpsc;
use futures::future::{select, BoxFuture, Either};
use futures::stream::{FuturesUnordered, StreamExt};

use super::hub::Hub;
use super::listen::{AsyncConnected, CloseSignal, Listener};
use super::{
    BufClass, CapId, Config, ConfigError, Connection, DelegateError, Delegation, EndpointStats, Link,
    Policies, PolicyChoice, RegionId, RegionRange, RevokeError, Role, SetupError, SetupOptions, SrqConfig,
    UseError,
};
use crate::backend::{Nic, NicError, QpEndpoint};
use crate::bootstrap::Auth;
use crate::ProbeCache;

/// The connections of a process on one NIC, with one completion queue and
/// one driver ([`EndpointDriver`]); see the module docs (`src/conn/endpoint.rs`). Cheap to
/// clone: every clone is the same endpoint.
pub struct Endpoint<N: Nic> {
    shared: Arc<Shared<N>>,
}

impl<N: Nic> Clone for Endpoint<N> {
    fn clone(&self) -> Self {
        Endpoint { shared: self.shared.clone() }
    }
}

/// The future that runs every connection of an [`Endpoint`]: spawn it
/// once (or `block_on` it on a thread of its own). It ends once every
/// [`Endpoint`] clone is dropped and every connection has finished.
///
/// Nothing else runs the connections' timers and turns: dropped before it
/// ends (its task aborted, a runtime shut down, a `select!` that drops it
/// while the work goes on), it leaves calls waiting past their timeout and
/// `close()` and `finished()` never completing (memory stays safe: no
/// buffer is taken back without evidence). Drop it only with the endpoint
/// and its connections, as when a `select!` of the driver and the work
/// ends with the work.
pub struct EndpointDriver<N: Nic> {
    hub: Arc<Hub<N>>,
    streams: mpsc::UnboundedReceiver<Watch>,
}

/// A connection's bootstrap stream, watched by the driver until it closes
/// (then its connection goes down) or the connection has finished.
type Watch = BoxFuture<'static, ()>;

struct Shared<N: Nic> {
    hub: Arc<Hub<N>>,
    cfg: Config,
    opts: SetupOptions,
    listener: Option<futures::lock::Mutex<Listener<N>>>,
    /// Closes the listener while an `accept` holds it.
    closer: Option<Arc<CloseSignal>>,
    local_addr: Option<SocketAddr>,
    streams: mpsc::UnboundedSender<Watch>,
    /// The `endpoint` label of its telemetry.
    name: String,
}

/// How an [`Endpoint`] is made: [`Endpoint::builder`], then its options,
/// then [`EndpointBuilder::build`].
#[must_use = "an endpoint builder does nothing until build() is called"]
pub struct EndpointBuilder<N: Nic> {
    nic: N,
    opts: SetupOptions,
    cfg: Config,
    depth: u32,
    srq: Option<SrqConfig>,
    buffers: Option<Vec<BufClass>>,
    listen: Option<SocketAddr>,
    busy_poll: Duration,
    name: String,
}

impl<N: Nic + 'static> Endpoint<N> {
    /// An endpoint on `nic` (its connections get protection domains of
    /// their own, siblings of `nic`'s), whose peers must prove `auth`'s
    /// key. By default it connects only (no [`EndpointBuilder::listen`]),
    /// picks the policy with the capability probe
    /// ([`PolicyChoice::Auto`]), uses the default [`Config`] for every
    /// connection and a completion queue of 65,536 entries.
    pub fn builder(nic: N, auth: Auth) -> EndpointBuilder<N> {
        EndpointBuilder {
            nic,
            opts: SetupOptions {
                choice: PolicyChoice::Auto,
                auth,
                timeout: Duration::from_secs(10),
                probes: ProbeCache::new(),
                trusted_peers: false,
            },
            cfg: Config::default(),
            depth: 1 << 16,
            srq: None,
            buffers: None,
            listen: None,
            busy_poll: Duration::ZERO,
            name: default_name(),
        }
    }

    /// Connect to the endpoint listening at `addr`: the bootstrap (key,
    /// policies per direction, queue pairs), then a connection on this
    /// endpoint. The device is probed for `mw` and `auto` once per
    /// endpoint's probe cache, on a thread of its own.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Connection<N>, SetupError> {
        let cfg = self.shared.cfg.clone();
        let c = super::listen::connect_async_on(&self.shared.hub, addr, cfg, &self.shared.opts).await?;
        Ok(self.adopt(c))
    }

    /// Connect to `server`, another endpoint of this process, without TCP
    /// or a bootstrap: a queue pair on each endpoint, connected to each
    /// other, with `policies` for the two directions (no probe runs: say
    /// what the device can do). Returns the client's connection and the
    /// server's. For tests on the simulated NIC (both endpoints' NICs on
    /// one [`Fabric`](crate::sim::Fabric)) and loopback on one device. Each
    /// side has its endpoint's [`EndpointBuilder::config`] settings. An
    /// endpoint with shared receives or buffers serves the mw policy only
    /// unless its peers are trusted ([`ConfigError::SharedReceivesNeedMw`]
    /// otherwise); one whose
    /// completion queue has no room left refuses with
    /// [`SetupError::CqBudget`].
    pub fn connect_local(
        &self,
        server: &Endpoint<N>,
        policies: Policies,
    ) -> Result<(Connection<N>, Connection<N>), SetupError> {
        let side = |ep: &Endpoint<N>, role| ep.prepare(role, policies, ep.shared.cfg.clone());
        let client = side(self, Role::Client)?;
        let srv = side(server, Role::Server)?;
        let (c, s) = (client.local(), srv.local());
        let (cc, sc) = (self.shared.cfg.start_credits, server.shared.cfg.start_credits);
        Ok((client.connect_with(&s, sc)?, srv.connect_with(&c, cc)?))
    }

    /// A connection set up by the application's own bootstrap instead of
    /// mwcap's TCP one: a queue pair on this endpoint, of `role`, with
    /// `policies` for the two directions and the settings `cfg`, to be
    /// connected to the peer's once the two sides have swapped their
    /// [`Pending::local`] addresses by their own means. The application then
    /// answers for what the bootstrap does: authenticating the peer, and
    /// both sides agreeing on the policies and on `cfg.start_credits`
    /// (give both the same).
    /// Dropping it unconnected destroys the queue pair.
    pub fn prepare(&self, role: Role, policies: Policies, cfg: Config) -> Result<Pending<N>, SetupError> {
        // Before the connection's protection domain: nothing is created
        // for settings that cannot work.
        cfg.check()?;
        let hub = &self.shared.hub;
        let link = hub.prepare(hub.connection_nic()?, role, cfg)?.finish(policies)?;
        Ok(Pending { link, hub: hub.clone(), identity: None })
    }

    /// The next client whose handshake finished: connected, or the error
    /// that ended its handshake (a wrong key, silence past the timeout,
    /// ...), which concerns that client only: call `accept` again. Many
    /// handshakes run at once, but only while an `accept` is awaited:
    /// serve each connection in a task of its own and go straight back.
    /// [`SetupError::NotListening`] on an endpoint built without
    /// [`EndpointBuilder::listen`], [`SetupError::ListenerClosed`] once
    /// [`Endpoint::stop_listening`] was called: end the accept loop then.
    /// Cancel-safe: dropping the future loses no handshake.
    pub async fn accept(&self) -> Result<Connection<N>, SetupError> {
        let Some(listener) = &self.shared.listener else { return Err(SetupError::NotListening) };
        let c = listener.lock().await.accept().await?;
        Ok(self.adopt(c))
    }

    /// Stop taking clients: the listening socket closes, the handshakes in
    /// progress end, and [`Endpoint::accept`] returns
    /// [`SetupError::ListenerClosed`] (an `accept` waiting now too).
    /// Connections already made run on.
    pub fn stop_listening(&self) {
        // The closer reaches an `accept` in progress (it holds the lock);
        // with none, the socket closes now.
        if let Some(c) = &self.shared.closer {
            c.close();
        }
        if let Some(mut l) = self.shared.listener.as_ref().and_then(|l| l.try_lock()) {
            l.shut();
        }
    }

    /// The address it listens on, if it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.shared.local_addr
    }

    /// What its completion queue and driver have done so far.
    pub fn stats(&self) -> EndpointStats {
        self.shared.hub.stats()
    }

    /// Record the endpoint's capability telemetry through the [`metrics`]
    /// facade, to whatever recorder the application installed (none: a
    /// no-op): connections, capabilities live and made by policy, their
    /// ages when they ended, expiries, stale reads, late accesses, binds,
    /// invalidations and the shared pool ([`crate::telemetry`] lists the
    /// series). Call it on a timer, or just before the exporter renders;
    /// it takes each connection's lock once, off the data path.
    pub fn record_metrics(&self) {
        self.shared.hub.record_metrics(&self.shared.name);
    }

    /// Register `len` zeroed bytes for the application to keep its data
    /// in (a KV cache's values, a store's blocks) and expose ranges of to
    /// any of this endpoint's connections without copying them into
    /// buffers ([`Connection::call_region`], [`Connection::reply_region`]).
    /// Each exposure gets the capability a buffer gets: under mw a window
    /// over exactly the range on that connection's QP, the lease, expiry
    /// and evidence rules. Write it with [`Endpoint::region_write`]: a
    /// range is not written, nor the region deregistered, while any
    /// connection exposes any of it.
    ///
    /// Under confirm a connection's registration of the region lets its
    /// peer read all of it (`docs/serving.md`, "Serving your own memory"):
    /// keep in a region only what every peer it is exposed to may read.
    pub fn register_region(&self, len: usize) -> Result<RegionId, NicError> {
        self.shared.hub.regions().register(len)
    }

    /// Deregister a region once no connection exposes any of it
    /// ([`UseError::RegionBusy`] until then: each exposure ends on its
    /// evidence, or when its connection's QP is destroyed).
    pub fn deregister_region(&self, id: RegionId) -> Result<(), UseError> {
        self.shared.hub.deregister_region(id)
    }

    /// Copy `bytes` into region `id` at `offset`; refused while any of
    /// them is exposed to a peer ([`UseError::RangeExposed`]).
    pub fn region_write(&self, id: RegionId, offset: usize, bytes: &[u8]) -> Result<(), UseError> {
        self.shared.hub.regions().write(id, offset, bytes, None)
    }

    /// Copy `bytes` into region `id` at `offset`, waiting while any of them
    /// is exposed (each exposure ends on its evidence, or when its
    /// connection's QP is destroyed).
    pub async fn region_write_when_free(
        &self,
        id: RegionId,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), UseError> {
        // A pinned range may be waiting for a token to expire unredeemed:
        // an alarm at the next expiry looks again.
        let mut alarm = super::alarm::Alarm::default();
        poll_fn(|cx| {
            let regions = self.shared.hub.regions();
            match regions.write(id, offset, bytes, Some(cx)) {
                Err(UseError::RangeExposed { .. }) => {
                    alarm.arm(regions.next_delegation_expiry());
                    if alarm.poll(cx).is_ready() {
                        cx.waker().wake_by_ref();
                    }
                    Poll::Pending
                }
                r => Poll::Ready(r),
            }
        })
        .await
    }

    /// Delegate `range` of one of its regions to the peer that proves the
    /// key named `identity` (in this endpoint's keyring, see
    /// [`Auth::Keyring`]), for `ttl`:
    /// returns the delegation's id and its [`Token`](super::Token), which
    /// the application hands on by any means (its own RPC, a queue). The
    /// delegate, connected to this endpoint as `identity`, reads the
    /// range with [`Connection::redeem`]: once, before `ttl` has passed,
    /// through an exposure made for it alone (under mw a window over
    /// exactly the range on its QP, whose lease ends by the token's
    /// expiry). Nobody else can make or alter a token (HMAC-SHA256 under
    /// a secret of this endpoint's). A token holds its expiry in 64 bits of
    /// nanoseconds: a `ttl` beyond that (about 584 years) is taken as that.
    ///
    /// The range is pinned until the delegation is over: redeemed and its
    /// exposure ended on evidence, or expired or revoked unredeemed.
    /// Meanwhile [`Endpoint::region_write`] refuses to write it and the
    /// region is not deregistered; [`Endpoint::region_write_when_free`]
    /// waits. [`Endpoint::revoke`] ends it early.
    ///
    /// Under confirm the delegate's READ goes through the region's
    /// registration on its connection, as any region reply's
    /// (`docs/protocol-confirm.md`): the range is what it is handed and
    /// what a stale read is checked against, not a limit on what its key
    /// reaches.
    pub fn delegate_region(
        &self,
        range: RegionRange,
        identity: &str,
        ttl: Duration,
    ) -> Result<Delegation, DelegateError> {
        let regions = self.shared.hub.regions();
        regions.delegate(regions.delegation_clock(), None, range, identity, ttl)
    }

    /// Revoke delegation `cap` (and every delegation made from it): its
    /// token is refused from now on, and an exposure of it a delegate holds
    /// now ends: under mw its window is invalidated at once (its one
    /// LOCAL_INV; the range is pinned until that completes), under confirm
    /// its offer is withdrawn (the delegate's confirm is answered
    /// `Reused`: what it read is discarded, never returned).
    pub fn revoke(&self, cap: CapId) -> Result<(), RevokeError> {
        self.shared.hub.revoke(cap)
    }

    /// Lend `len` bytes of region `id` at `offset` to `f`, without a copy
    /// (under the region's memory lock: keep it short).
    pub fn region_bytes<R>(
        &self,
        id: RegionId,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, UseError> {
        self.shared.hub.regions().bytes(id, offset, len, f)
    }

    /// Its counts for as long as its hub lives, without keeping it alive
    /// (for [`crate::stat::Registry::add_endpoint`]).
    pub(crate) fn stats_source(&self) -> impl Fn() -> Option<EndpointStats> + Send + 'static {
        let weak = Arc::downgrade(&self.shared.hub);
        move || weak.upgrade().map(|s| s.stats())
    }

    /// Keep the connection made by a handshake: its bootstrap stream goes
    /// to the driver, which watches it.
    fn adopt(&self, c: AsyncConnected<N>) -> Connection<N> {
        let AsyncConnected { connection, mut stream, policies, peer_addr, peer_identity } = c;
        tracing::debug!(peer = %peer_addr, identity = ?peer_identity, ?policies, "endpoint: a connection is up");
        connection.set_peer(Some(peer_addr), peer_identity);
        let watched = connection.clone();
        let watch: Watch = Box::pin(async move {
            let gone = std::pin::pin!(async {
                use futures::AsyncReadExt;
                // The peer sends nothing on the stream after the ready
                // byte: its end is the peer going away, and a byte breaks
                // the protocol. Either way one read settles it (a peer
                // that kept writing held the driver here, polling no
                // completion for any connection, before).
                let mut b = [0u8; 1];
                matches!(stream.read(&mut b).await, Ok(1))
            });
            let finished = std::pin::pin!(watched.closed());
            if let Either::Left((wrote, _)) = select(gone, finished).await {
                if wrote {
                    watched.peer_misbehaved(super::Misbehavior::BootstrapAfterReady);
                } else {
                    watched.peer_gone();
                }
            }
        });
        if self.shared.streams.unbounded_send(watch).is_err() {
            tracing::warn!(
                "the endpoint's driver is gone: its new connection's bootstrap stream is not watched"
            );
        }
        connection
    }
}

/// A queue pair on an endpoint waiting for its peer's address
/// ([`Endpoint::prepare`]).
pub struct Pending<N: Nic> {
    link: Link<N>,
    hub: Arc<Hub<N>>,
    /// The peer's identity, as the application vouched for it.
    identity: Option<std::sync::Arc<str>>,
}

impl<N: Nic + 'static> Pending<N> {
    /// Its address, for the peer to connect to.
    pub fn local(&self) -> QpEndpoint {
        self.link.local()
    }

    /// The link under it, not yet connected (mwcap's own tests reach into
    /// its regions and NIC).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn link(&self) -> &Link<N> {
        &self.link
    }

    /// The peer is `identity`: the application's own bootstrap
    /// authenticated it as that name, as mwcap's proves a keyring's name.
    /// The connection's [`Connection::peer_identity`] says so, and tokens
    /// delegated to `identity` ([`Endpoint::delegate_region`]) redeem on
    /// it. Without it a prepared connection has no identity, and every
    /// redemption on it is refused (`WrongIdentity`).
    pub fn authenticated_as(mut self, identity: &str) -> Self {
        self.identity = Some(identity.into());
        self
    }

    /// Connect to the peer's queue pair at `peer`: the connection runs on
    /// the endpoint from now on. The peer is taken to hold as many
    /// receives for this side at the start as this side's
    /// [`Config::start_credits`] says: give both sides the same.
    pub fn connect(self, peer: &QpEndpoint) -> Result<Connection<N>, SetupError> {
        let credits = self.link.config().start_credits;
        self.connect_with(peer, credits)
    }

    /// Connect its queue pair without putting the connection on the
    /// endpoint: a queue pair whose completions no connection takes (a
    /// listener no longer leaves one so: it connects a server's queue pair
    /// only once the client said ready, and puts it on the endpoint at
    /// once). For tests of what the endpoint does with such completions;
    /// drop it to destroy the queue pair.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn connect_unadded(&mut self, peer: &QpEndpoint) -> Result<(), NicError> {
        self.link.connect(peer)
    }

    /// [`Pending::connect`] to a peer whose `Config::start_credits` is
    /// `peer_credits`.
    pub(crate) fn connect_with(
        mut self,
        peer: &QpEndpoint,
        peer_credits: u32,
    ) -> Result<Connection<N>, SetupError> {
        self.link.connect_with(peer, peer_credits)?;
        let connection = self.hub.add(self.link, self.identity.clone());
        if let Some(identity) = self.identity {
            connection.set_peer(None, Some(identity));
        }
        Ok(connection)
    }
}

impl<N: Nic> std::fmt::Debug for Pending<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("local", &self.link.local()).finish_non_exhaustive()
    }
}

impl<N: Nic + 'static> EndpointBuilder<N> {
    /// Which policies to serve for the memory this side exposes: mw, confirm,
    /// or whatever the capability probe finds (`auto`, the default).
    pub fn policy(mut self, choice: PolicyChoice) -> Self {
        self.opts.choice = choice;
        self
    }

    /// Trust every peer not to invalidate windows it was not granted (false
    /// by default). On a device where a peer's SEND_WITH_INV reaches
    /// windows bound to other queue pairs (rxe; `mwcap probe` says), a
    /// hostile peer can make an owner invalidate a window twice, which
    /// panics the rxe kernel driver: there `auto` serves confirm and `mw`
    /// is refused ([`SetupError::MwUnsafe`]) unless the peers are trusted.
    /// Devices that follow the specification (mlx5) are safe either way.
    ///
    /// It also lets an endpoint with [`EndpointBuilder::shared_receives`]
    /// or [`EndpointBuilder::shared_buffers`] serve confirm, whose keys then
    /// reach what the endpoint's other connections expose
    /// (`docs/serving.md`, "Shared receives", "mw only, and why"). Integrity
    /// holds either way; what trust buys is the confidentiality between
    /// peers.
    pub fn trusted_peers(mut self, trusted: bool) -> Self {
        self.opts.trusted_peers = trusted;
        self
    }

    /// The settings of every connection (buffers, timeouts, keepalive, ...),
    /// from [`Config::default`]: the role is set per connection and the
    /// policies by the bootstrap (this endpoint's [`EndpointBuilder::policy`]
    /// and the peer's), so the ones in `cfg` are not used.
    pub fn config(mut self, cfg: Config) -> Self {
        self.cfg = cfg;
        self
    }

    /// Entries of the completion queue all connections share (65,536 by
    /// default; each connection reserves its worst case, see
    /// [`SetupError::CqBudget`]). A connection needs about `ctrl_slots` +
    /// 2 x its buffers + the READs of its payloads + 8 entries (small pools:
    /// 60 to 200), so the default holds several hundred. A queue deeper
    /// than the device allows (`max_cqe`) fails `build` with
    /// `SetupError::Nic(`[`NicError::CqTooDeep`]`)`.
    pub fn queue_depth(mut self, depth: u32) -> Self {
        self.depth = depth;
        self
    }

    /// Connections take their control receives from one shared receive
    /// queue (see [`SrqConfig`] and `docs/serving.md`): an idle connection
    /// holds [`Config::start_credits`] receives of 4 KiB instead of
    /// `ctrl_slots`, a busy one up to `ctrl_slots`, and its send slots are
    /// the endpoint's, lent while a SEND is in flight. Its connections
    /// share the endpoint's protection domain, so it serves the mw policy
    /// only, unless its peers are trusted ([`EndpointBuilder::trusted_peers`]).
    pub fn shared_receives(mut self, srq: SrqConfig) -> Self {
        self.srq = Some(srq);
        self
    }

    /// Connections take their buffers from one pool of `classes` (see
    /// `docs/serving.md`): a connection registers no data region, its buffer
    /// classes (`Config::buffers` of `buffer_size`, and `large_buffers`)
    /// say how many buffers of each size it may hold at once, and each is a
    /// buffer of the pool while it is in use; every size a connection uses
    /// must be one of `classes`. Implies shared receives (with
    /// [`SrqConfig::default`] unless [`EndpointBuilder::shared_receives`]
    /// says otherwise): the mw policy only, unless its peers are trusted
    /// ([`EndpointBuilder::trusted_peers`]: then a pool buffer exposed
    /// under confirm is offered with its region's key).
    pub fn shared_buffers(mut self, classes: &[BufClass]) -> Self {
        self.buffers = Some(classes.to_vec());
        self
    }

    /// Take clients on `addr` ([`Endpoint::accept`]).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    /// The time allowed for each phase of a handshake (10 s by default).
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.opts.timeout = timeout;
        self
    }

    /// Where the capability probe's verdicts are kept (share one between
    /// endpoints on one device).
    pub fn probe_cache(mut self, probes: ProbeCache) -> Self {
        self.opts.probes = probes;
        self
    }

    /// Keep polling the completion queue for `d` after the driver's turns
    /// stop finding work, before it sleeps (0, the default: sleep at once).
    /// Every 16 idle turns the driver's thread gives its core up to the OS.
    pub fn busy_poll(mut self, d: Duration) -> Self {
        self.busy_poll = d;
        self
    }

    /// The endpoint's name in its telemetry: the `endpoint` label of
    /// every series [`Endpoint::record_metrics`] records. By default
    /// "mwcap-1", "mwcap-2", ... in the order the process builds its
    /// endpoints; give a name for a label that stays the same across
    /// restarts. Two endpoints of one process given the same name write
    /// the same series, each over the other's figures: name them apart.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }

    /// Make the endpoint: its completion queue (and shared receive queue
    /// and buffer pool, if asked for), and with [`EndpointBuilder::listen`]
    /// its listening socket, after the device's probe. Spawn the driver.
    pub fn build(self) -> Result<(Endpoint<N>, EndpointDriver<N>), SetupError> {
        let EndpointBuilder { nic, opts, cfg, depth, srq, buffers, listen, busy_poll, name } = self;
        cfg.check()?;
        let shares = srq.is_some() || buffers.is_some();
        // Sharing puts every connection in one protection domain, where a
        // confirm region's key reaches every connection's memory: only
        // among trusted peers.
        let confirm = opts.choice != PolicyChoice::Mw;
        if shares && confirm && !opts.trusted_peers {
            return Err(ConfigError::SharingNeedsMw { choice: opts.choice }.into());
        }
        let hub = Hub::new(nic, depth, srq, buffers.as_deref(), confirm, busy_poll)?;
        let (listener, local_addr, closer) = match listen {
            None => (None, None, None),
            Some(addr) => {
                let l = Listener::bind(addr, cfg.clone(), opts.clone(), hub.clone())?;
                let local = l.local_addr();
                let closer = l.closer();
                (Some(futures::lock::Mutex::new(l)), local, Some(closer))
            }
        };
        let (tx, rx) = mpsc::unbounded();
        let shared = Arc::new(Shared { hub, cfg, opts, listener, local_addr, closer, streams: tx, name });
        let driver = EndpointDriver { hub: shared.hub.clone(), streams: rx };
        Ok((Endpoint { shared }, driver))
    }
}

/// "mwcap-N", N counting the endpoint builders of the process from 1.
fn default_name() -> String {
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!("mwcap-{}", MADE.fetch_add(1, Ordering::Relaxed) + 1)
}

impl<N: Nic + 'static> EndpointDriver<N> {
    /// Run every connection of the endpoint and watch their bootstrap
    /// streams; returns the final counts once every [`Endpoint`] clone is
    /// dropped and every connection has finished.
    pub async fn run(self) -> EndpointStats {
        let EndpointDriver { hub, mut streams } = self;
        let mut watching: FuturesUnordered<Watch> = FuturesUnordered::new();
        // The streams are looked at only when one of them (or the channel
        // of new ones) woke the driver, which they do through its doorbell:
        // polling them on every loop of the driver cost about 150
        // instructions a call, and a future around its loop to poll them
        // after it about 40 a call per side.
        let woke = Arc::new(WatchWake { due: AtomicBool::new(true), hub: Arc::downgrade(&hub) });
        let watch_waker = futures::task::waker(woke.clone());
        // After the turns: a connection that finished in one ends its
        // watch now, closing its stream (the peer may be waiting for it).
        hub.run(move || {
            if woke.due.load(Ordering::Acquire) && woke.due.swap(false, Ordering::AcqRel) {
                let mut wcx = Context::from_waker(&watch_waker);
                while let Poll::Ready(Some(w)) = streams.poll_next_unpin(&mut wcx) {
                    watching.push(w);
                }
                while let Poll::Ready(Some(())) = watching.poll_next_unpin(&mut wcx) {}
            }
        })
        .await
    }
}

/// The waker the driver polls the bootstrap streams with: it marks them
/// due and rings the driver's doorbell, for as long as the hub lives.
struct WatchWake<N: Nic> {
    due: AtomicBool,
    hub: std::sync::Weak<Hub<N>>,
}

impl<N: Nic> futures::task::ArcWake for WatchWake<N> {
    fn wake_by_ref(this: &Arc<Self>) {
        this.due.store(true, Ordering::Release);
        if let Some(hub) = this.hub.upgrade() {
            hub.ready.bell().ring();
        }
    }
}

impl<N: Nic> Drop for Shared<N> {
    fn drop(&mut self) {
        // The last handle: the driver ends once every connection finished.
        self.hub.close();
    }
}

impl<N: Nic> std::fmt::Debug for Endpoint<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("local_addr", &self.shared.local_addr).finish_non_exhaustive()
    }
}
