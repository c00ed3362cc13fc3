//! The async bootstrap under [`Endpoint`](super::Endpoint): a
//! [`Listener`] whose `accept().await` runs many handshakes at once, and
//! [`connect_async_on`], both for connections on an endpoint's [`Hub`].
//!
//! The details are on [`Listener`].

use std::future::poll_fn;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;

use async_io::Async;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::task::AtomicWaker;

use super::hub::Hub;
use super::setup::{agreed, local_caps, serve_set};
use super::{Config, Connection, Policies, PolicyChoice, Role, SetupError, SetupOptions};
use crate::backend::Nic;
use crate::bootstrap::{self, Authenticated, BootstrapError, Hello, Phase, PolicySet};

/// A connection set up over the async bootstrap: the handle, and the
/// bootstrap's TCP stream, whose closing tells that the peer went away.
pub(super) struct AsyncConnected<N: Nic> {
    /// The user's handle.
    pub connection: Connection<N>,
    /// The bootstrap's TCP stream; kept open while the connection lives.
    pub stream: Async<TcpStream>,
    /// The policies chosen for the two directions.
    pub policies: Policies,
    /// The peer's TCP address.
    pub peer_addr: SocketAddr,
    /// The name of the key the peer proved (`None` without a key).
    pub peer_identity: Option<std::sync::Arc<str>>,
}

type Handshake<N> = BoxFuture<'static, Result<AsyncConnected<N>, SetupError>>;

/// What every handshake of a listener shares.
struct Shared<N: Nic> {
    cfg: Config,
    opts: SetupOptions,
    serve: PolicySet,
    /// Accepted connections run on it, each in a protection domain of its
    /// own (or, with shared receives, in the hub's).
    hub: Arc<Hub<N>>,
}

/// A TCP listener that sets up mwcap connections on a hub, many
/// handshakes at once: what [`Endpoint::accept`](super::Endpoint::accept)
/// runs. [`accept`](Listener::accept) runs the handshakes (auth, hello,
/// ready) side by side inside its one future, at most 256 at a time, and
/// returns the first that finishes, successful or not; a client that
/// stays silent holds only its own handshake, for at most
/// [`SetupOptions::timeout`] per phase. [`CloseSignal::close`] (with
/// [`Listener::shut`]; or dropping it) ends the
/// handshakes in progress, not the connections accepted before. The
/// capability probe runs when it is bound, not per client. What this
/// means for a server: `docs/serving.md`, "The endpoint" and "Slow and
/// silent clients".
pub(super) struct Listener<N: Nic> {
    /// `None` once closed.
    tcp: Option<Async<TcpListener>>,
    /// Set by [`CloseSignal::close`]; the next poll of `accept` closes.
    close: Arc<CloseSignal>,
    shared: Arc<Shared<N>>,
    handshakes: FuturesUnordered<Handshake<N>>,
    max_handshakes: usize,
}

impl<N: Nic + 'static> Listener<N> {
    /// Listen on `addr`. Every client that proved the key gets a server
    /// connection on `hub` with the settings `cfg`.
    ///
    /// For `mw` and `auto` the device is probed here, once, through
    /// `opts.probes` (which may already know it).
    pub(super) fn bind(
        addr: SocketAddr,
        cfg: Config,
        opts: SetupOptions,
        hub: Arc<Hub<N>>,
    ) -> Result<Listener<N>, SetupError> {
        let tcp =
            TcpListener::bind(addr).map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
        // Confirm needs no probe, nor a NIC handle to probe through.
        let serve = match opts.choice {
            PolicyChoice::Confirm => PolicySet::CONFIRM,
            choice => serve_set(&hub.connection_nic()?, choice, opts.trusted_peers, &opts.probes)?,
        };
        let tcp = Async::new(tcp).map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
        Ok(Listener {
            tcp: Some(tcp),
            close: Arc::default(),
            shared: Arc::new(Shared { cfg, opts, serve, hub }),
            handshakes: FuturesUnordered::new(),
            max_handshakes: 256,
        })
    }

    /// The address the listener is bound to (`None` once it is closed).
    pub(super) fn local_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|tcp| tcp.get_ref().local_addr().ok())
    }

    /// The [`CloseSignal`] that closes this listener from another task.
    pub(super) fn closer(&self) -> Arc<CloseSignal> {
        self.close.clone()
    }

    /// Drop the socket, so new clients are refused, and the handshakes in
    /// progress (whatever was made for them is destroyed). With its
    /// [`CloseSignal`] closed first, [`Listener::accept`] returns
    /// [`SetupError::ListenerClosed`] from then on. Idempotent.
    pub(super) fn shut(&mut self) {
        self.tcp = None;
        self.handshakes = FuturesUnordered::new();
    }

    /// What [`Endpoint::accept`](super::Endpoint::accept) runs, with its
    /// results (closed: [`SetupError::ListenerClosed`]); failing to take a TCP
    /// connection at all (out of file descriptors, say) is an error too.
    /// Cancel-safe: the next call goes on with the handshakes in progress.
    pub(super) async fn accept(&mut self) -> Result<AsyncConnected<N>, SetupError> {
        poll_fn(|cx| loop {
            // Registered before looking: a close from now on wakes this task.
            self.close.waker.register(cx.waker());
            if self.close.is_closed() {
                self.shut();
            }
            let Some(tcp) = &self.tcp else { return Poll::Ready(Err(SetupError::ListenerClosed)) };
            if let Poll::Ready(Some(done)) = self.handshakes.poll_next_unpin(cx) {
                return Poll::Ready(done);
            }
            if self.handshakes.len() >= self.max_handshakes {
                return Poll::Pending;
            }
            match tcp.get_ref().accept() {
                Ok((stream, _)) => {
                    let shared = self.shared.clone();
                    self.handshakes.push(Box::pin(handshake(stream, shared)));
                    // Poll the new handshake (it registers its wakers), then look for more.
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => match tcp.poll_readable(cx) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(source)) => {
                        return Poll::Ready(Err(BootstrapError::Io { phase: Phase::Connect, source }.into()))
                    }
                    Poll::Pending => return Poll::Pending,
                },
                Err(e) if is_transient(&e) => continue,
                Err(source) => {
                    return Poll::Ready(Err(BootstrapError::Io { phase: Phase::Connect, source }.into()))
                }
            }
        })
        .await
    }
}

/// A listener's close request and the waker of its `accept`.
#[derive(Default)]
pub(super) struct CloseSignal {
    closed: AtomicBool,
    waker: AtomicWaker,
}

impl CloseSignal {
    /// Close the listener: the `accept` its loop waits in (or its next
    /// one) shuts it ([`Listener::shut`]) and returns
    /// [`SetupError::ListenerClosed`]. Idempotent.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.waker.wake();
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// Accept errors that concern one connection that is already gone.
fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), Interrupted | ConnectionAborted | ConnectionReset)
}

/// One client's handshake, as the server.
async fn handshake<N: Nic + 'static>(
    stream: TcpStream,
    shared: Arc<Shared<N>>,
) -> Result<AsyncConnected<N>, SetupError> {
    let stream = Async::new(stream).map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    let opts = &shared.opts;
    let authed = bootstrap::authenticate_accepted_async(stream, &opts.auth, opts.timeout).await?;
    // Only now, for a client that proved the key, is anything created.
    let nic = shared.hub.connection_nic()?;
    finish_setup_async(nic, Role::Server, shared.cfg.clone(), shared.serve, authed, opts, &shared.hub).await
}

/// Client: connect to a server listening at `addr` without blocking the
/// thread, for a connection that runs on `hub` (in a protection domain of
/// its own, `hub.connection_nic()`); what [`Endpoint::connect`](super::Endpoint::connect)
/// runs. The device is probed (for `mw` and `auto`) through `opts.probes`,
/// so only the first connect on a device pays for it; that probe (about
/// 100 ms on rxe) runs on a thread of its own, not on the executor's.
pub(super) async fn connect_async_on<N: Nic + 'static>(
    hub: &Arc<Hub<N>>,
    addr: SocketAddr,
    cfg: Config,
    opts: &SetupOptions,
) -> Result<AsyncConnected<N>, SetupError> {
    let nic = hub.connection_nic()?;
    let (nic, serve) = serve_set_off_thread(nic, opts).await?;
    let authed = bootstrap::authenticate_client_async(addr, &opts.auth, opts.timeout).await?;
    finish_setup_async(nic, Role::Client, cfg, serve, authed, opts, hub).await
}

/// [`serve_set`] without blocking the executor: a verdict the cache holds
/// is taken at once, a probe runs on a thread of its own (the NIC handle
/// goes there and comes back).
async fn serve_set_off_thread<N: Nic + 'static>(
    nic: N,
    opts: &SetupOptions,
) -> Result<(N, PolicySet), SetupError> {
    let known = opts.choice == PolicyChoice::Confirm || opts.probes.cached(&nic.device_info().name).is_some();
    if known {
        let serve = serve_set(&nic, opts.choice, opts.trusted_peers, &opts.probes)?;
        return Ok((nic, serve));
    }
    let (tx, rx) = futures::channel::oneshot::channel();
    let (choice, trusted, probes) = (opts.choice, opts.trusted_peers, opts.probes.clone());
    std::thread::Builder::new()
        .name("mwcap-probe".into())
        .spawn(move || {
            let serve = serve_set(&nic, choice, trusted, &probes);
            let _ = tx.send((nic, serve));
        })
        .map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    let (nic, serve) = rx.await.map_err(|_| BootstrapError::Io {
        phase: Phase::Connect,
        source: std::io::Error::other("the capability probe's thread ended without a verdict"),
    })?;
    Ok((nic, serve?))
}

/// The hello and ready phases, once the peer proved the key: only now are
/// the connection's queue pair and memory created.
async fn finish_setup_async<N: Nic + 'static>(
    nic: N,
    role: Role,
    mut cfg: Config,
    serve: PolicySet,
    authed: Authenticated<Async<TcpStream>>,
    opts: &SetupOptions,
    hub: &Arc<Hub<N>>,
) -> Result<AsyncConnected<N>, SetupError> {
    let peer_addr = authed.peer_addr();
    let peer_identity = authed.peer_identity().cloned();
    let mut prepared = hub.prepare(nic, role, cfg.clone())?;
    let hello = Hello::new(prepared.local(), local_caps(&cfg, serve));
    let hs = authed.hello(&hello, opts.timeout).await?;
    let policies = agreed(&hs, role, &mut cfg)?;
    prepared.set_lease_time(cfg.lease_time);
    let mut endpoint = prepared.finish(policies)?;
    let (remote, credits) = (hs.remote_endpoint(), hs.peer().caps.start_credits);
    let (connection, stream) = match role {
        Role::Client => {
            // On the hub as soon as its queue pair is up: the server may
            // send from then on, and frames a connection not on the hub
            // received would hold the endpoint's shared receives until the
            // handshake ended (past its credit a flood ends only this
            // connection). Closed if the ready byte does not come.
            endpoint.connect_with(&remote, credits)?;
            let connection = hub.add(endpoint, peer_identity.clone());
            match hs.ready(opts.timeout).await {
                Ok(stream) => (connection, stream),
                Err(e) => {
                    connection.close();
                    return Err(e.into());
                }
            }
        }
        Role::Server => {
            // The client's ready byte before the queue pair is up, and the
            // connection on the hub before ours goes out (see
            // `Handshake::client_ready`).
            let said = hs.client_ready(opts.timeout).await?;
            endpoint.connect_with(&remote, credits)?;
            let connection = hub.add(endpoint, peer_identity.clone());
            match said.send().await {
                Ok(stream) => (connection, stream),
                Err(e) => {
                    connection.close();
                    return Err(e.into());
                }
            }
        }
    };
    Ok(AsyncConnected { connection, stream, policies, peer_addr, peer_identity })
}
