//! The exchange over `async-io` sockets: the same protocol as
//! `blocking` (the `testing` feature's), usable under any executor.

use std::future::Future;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::pin::pin;
use std::time::Duration;

use async_io::{Async, Timer};
use futures::future::{select, Either};
use futures::{AsyncReadExt, AsyncWriteExt};

use super::auth::{fresh_nonce, Machine};
use super::error::{BootstrapError, Phase};
use super::handshake::{
    check_hello_tag, check_ready, conclude, hello_frames, Authenticated, Deadline, Handshake,
};
use super::key::Auth;
use super::wire::{encode_auth, AuthFrame, FrameReader, Hello, Message, MAX_FRAME_LEN, READY_BYTE};

/// Run `fut` until the deadline; past it, fail with the deadline's timeout error.
async fn before<T>(
    deadline: &Deadline,
    fut: impl Future<Output = Result<T, BootstrapError>>,
) -> Result<T, BootstrapError> {
    let fut = pin!(fut);
    match select(fut, Timer::at(deadline.at())).await {
        Either::Left((out, _)) => out,
        Either::Right(_) => Err(deadline.expired()),
    }
}

/// Connect to the server at `addr` and run the auth phase; the async
/// `authenticate_client`.
pub async fn authenticate_client_async(
    addr: SocketAddr,
    auth: &Auth,
    timeout: Duration,
) -> Result<Authenticated<Async<TcpStream>>, BootstrapError> {
    let machine = Machine::client(auth, fresh_nonce()?)?;
    let connect = Deadline::after(timeout, Phase::Connect);
    let stream = dial(addr, &connect).await?;
    auth_phase(stream, addr, machine, connect.with_phase(Phase::Auth)).await
}

/// Accept one connection on `listener` and run the auth phase as the
/// server; the async `authenticate_server`.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub async fn authenticate_server_async(
    listener: &Async<TcpListener>,
    auth: &Auth,
    timeout: Duration,
) -> Result<Authenticated<Async<TcpStream>>, BootstrapError> {
    let (stream, _) =
        listener.accept().await.map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    authenticate_accepted_async(stream, auth, timeout).await
}

/// Run the auth phase as the server over a connection the caller accepted itself.
pub async fn authenticate_accepted_async(
    stream: Async<TcpStream>,
    auth: &Auth,
    timeout: Duration,
) -> Result<Authenticated<Async<TcpStream>>, BootstrapError> {
    let peer = peer_addr(&stream)?;
    let machine = Machine::server(auth, fresh_nonce()?);
    auth_phase(stream, peer, machine, Deadline::after(timeout, Phase::Auth)).await
}

impl Authenticated<Async<TcpStream>> {
    /// The hello phase; the async [`Authenticated::<TcpStream>::hello`].
    pub async fn hello(
        self,
        local: &Hello,
        timeout: Duration,
    ) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
        local.validate().map_err(BootstrapError::from_local)?;
        hello_phase(self, local, Deadline::after(timeout, Phase::Hello)).await
    }
}

/// Connect to the server at `addr`, authenticate and exchange hellos; the
/// async `exchange_client`.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub async fn exchange_client_async(
    addr: SocketAddr,
    local: &Hello,
    auth: &Auth,
    timeout: Duration,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let machine = Machine::client(auth, fresh_nonce()?)?;
    let connect = Deadline::after(timeout, Phase::Connect);
    let stream = dial(addr, &connect).await?;
    let authed = auth_phase(stream, addr, machine, connect.with_phase(Phase::Auth)).await?;
    hello_phase(authed, local, connect.with_phase(Phase::Hello)).await
}

/// Accept one connection on `listener`, authenticate and exchange hellos;
/// the async `exchange_server`. The accept waits
/// as long as it takes; `timeout` bounds the auth and hello phases.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub async fn exchange_server_async(
    listener: &Async<TcpListener>,
    local: &Hello,
    auth: &Auth,
    timeout: Duration,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let (stream, _) =
        listener.accept().await.map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    exchange_accepted_async(stream, local, auth, timeout).await
}

/// [`exchange_server_async`] over a connection the caller accepted itself.
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // the tests' and fuzzers' (no product path)
pub async fn exchange_accepted_async(
    stream: Async<TcpStream>,
    local: &Hello,
    auth: &Auth,
    timeout: Duration,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let peer = peer_addr(&stream)?;
    let deadline = Deadline::after(timeout, Phase::Auth);
    let authed = auth_phase(stream, peer, Machine::server(auth, fresh_nonce()?), deadline).await?;
    hello_phase(authed, local, deadline.with_phase(Phase::Hello)).await
}

fn peer_addr(stream: &Async<TcpStream>) -> Result<SocketAddr, BootstrapError> {
    stream.get_ref().peer_addr().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })
}

async fn dial(addr: SocketAddr, deadline: &Deadline) -> Result<Async<TcpStream>, BootstrapError> {
    before(deadline, async {
        Async::<TcpStream>::connect(addr).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut => deadline.expired(),
            _ => BootstrapError::Unreachable { addr, source: e },
        })
    })
    .await
}

async fn auth_phase(
    mut stream: Async<TcpStream>,
    peer: SocketAddr,
    mut machine: Machine,
    deadline: Deadline,
) -> Result<Authenticated<Async<TcpStream>>, BootstrapError> {
    stream.get_ref().set_nodelay(true).map_err(|e| deadline.io_error(peer, e))?;
    let session = before(&deadline, async {
        loop {
            while let Some(frame) = machine.poll_transmit() {
                stream.write_all(&encode_auth(&frame)).await.map_err(|e| deadline.io_error(peer, e))?;
            }
            if let Some(session) = machine.session() {
                return Ok(session);
            }
            let (frame, _) = read_frame::<AuthFrame>(&mut stream, peer, &deadline).await?;
            if let Err(e) = machine.handle_frame(frame) {
                // Tell the peer why, if there is something to tell (see blocking).
                if let Some(frame) = machine.poll_transmit() {
                    let _ = stream.write_all(&encode_auth(&frame)).await;
                }
                return Err(BootstrapError::from_auth(peer, e));
            }
        }
    })
    .await?;
    Ok(Authenticated { stream, peer_addr: peer, session })
}

async fn hello_phase(
    authed: Authenticated<Async<TcpStream>>,
    local: &Hello,
    deadline: Deadline,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    let Authenticated { mut stream, peer_addr: peer, session } = authed;
    let hello = before(&deadline, async {
        stream.write_all(&hello_frames(&session, local)).await.map_err(|e| deadline.io_error(peer, e))?;
        let (hello, reader) = read_frame::<Hello>(&mut stream, peer, &deadline).await?;
        if session.is_keyed() {
            let (tag, _) = read_frame::<AuthFrame>(&mut stream, peer, &deadline).await?;
            check_hello_tag(&session, peer, reader.frame(), &tag)?;
        }
        Ok(hello)
    })
    .await?;
    conclude(stream, peer, local, hello)
}

/// Read one frame of `M`, never a byte past its end (see blocking).
async fn read_frame<M: Message + Copy>(
    stream: &mut Async<TcpStream>,
    peer: SocketAddr,
    deadline: &Deadline,
) -> Result<(M, FrameReader<M>), BootstrapError> {
    let mut reader = FrameReader::<M>::new();
    let mut buf = [0u8; MAX_FRAME_LEN];
    loop {
        if let Some(m) = reader.message() {
            return Ok((*m, reader));
        }
        let want = reader.wanted();
        let n = read_some(stream, &mut buf[..want], peer, deadline).await?;
        reader.feed(&buf[..n]).map_err(|e| BootstrapError::from_peer(peer, e))?;
    }
}

async fn read_some(
    stream: &mut Async<TcpStream>,
    buf: &mut [u8],
    peer: SocketAddr,
    deadline: &Deadline,
) -> Result<usize, BootstrapError> {
    loop {
        match stream.read(buf).await {
            Ok(0) => return Err(BootstrapError::PeerClosed { peer, phase: deadline.phase() }),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(deadline.io_error(peer, e)),
        }
    }
}

impl Handshake<Async<TcpStream>> {
    /// The ready phase; the async [`Handshake::<TcpStream>::ready`].
    pub async fn ready(mut self, timeout: Duration) -> Result<Async<TcpStream>, BootstrapError> {
        let deadline = Deadline::after(timeout, Phase::Ready);
        let (stream, peer) = (&mut self.stream, self.peer_addr);
        before(&deadline, async {
            send_ready(stream, peer, &deadline).await?;
            take_ready(stream, peer, &deadline).await
        })
        .await?;
        Ok(self.stream)
    }

    /// A server's ready phase, in its order: the client's ready byte first
    /// (the server then connects its queue pair), its own after
    /// ([`ClientReady::send`]). A client's SENDs can then reach the
    /// server's queue pair only once it said ready, and an honest one sends
    /// none before the server's byte (it comes after the server's queue
    /// pair is up). Were the server's queue pair up before the client's
    /// byte, a client that never sent it could fill the server's (shared)
    /// receives with frames no connection takes until the handshake
    /// times out.
    pub(crate) async fn client_ready(mut self, timeout: Duration) -> Result<ClientReady, BootstrapError> {
        let deadline = Deadline::after(timeout, Phase::Ready);
        let (stream, peer) = (&mut self.stream, self.peer_addr);
        before(&deadline, take_ready(stream, peer, &deadline)).await?;
        Ok(ClientReady { stream: self.stream, peer, deadline })
    }
}

/// A server's handshake whose client said ready ([`Handshake::client_ready`]).
pub(crate) struct ClientReady {
    stream: Async<TcpStream>,
    peer: SocketAddr,
    deadline: Deadline,
}

impl ClientReady {
    /// Send the server's ready byte (its queue pair is up): the stream,
    /// now the connection's.
    pub(crate) async fn send(mut self) -> Result<Async<TcpStream>, BootstrapError> {
        let deadline = &self.deadline;
        before(deadline, send_ready(&mut self.stream, self.peer, deadline)).await?;
        Ok(self.stream)
    }
}

async fn send_ready(
    stream: &mut Async<TcpStream>,
    peer: SocketAddr,
    deadline: &Deadline,
) -> Result<(), BootstrapError> {
    stream.write_all(&[READY_BYTE]).await.map_err(|e| deadline.io_error(peer, e))
}

/// Read the peer's ready byte (and nothing past it).
async fn take_ready(
    stream: &mut Async<TcpStream>,
    peer: SocketAddr,
    deadline: &Deadline,
) -> Result<(), BootstrapError> {
    let mut byte = [0u8; 1];
    read_some(stream, &mut byte, peer, deadline).await?;
    check_ready(peer, byte[0])
}
