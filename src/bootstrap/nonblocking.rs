//! The exchange over `async-io` sockets: the same protocol as
//! [`blocking`](super::blocking), usable under any executor.

use std::future::Future;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::pin::pin;
use std::time::Duration;

use async_io::{Async, Timer};
use futures::future::{select, Either};
use futures::{AsyncReadExt, AsyncWriteExt};

use super::error::{BootstrapError, Phase};
use super::handshake::{check_ready, conclude, Deadline, Handshake};
use super::wire::{encode, Hello, HelloDecoder, MAX_FRAME_LEN, READY_BYTE};

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

/// Connect to the server at `addr` and exchange hellos; the async
/// [`exchange_client`](super::exchange_client).
pub async fn exchange_client_async(
    addr: SocketAddr,
    local: &Hello,
    timeout: Duration,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let connect = Deadline::after(timeout, Phase::Connect);
    let stream = before(&connect, async {
        Async::<TcpStream>::connect(addr).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut => connect.expired(),
            _ => BootstrapError::Unreachable { addr, source: e },
        })
    })
    .await?;
    hello_phase(stream, addr, local, connect.with_phase(Phase::Hello)).await
}

/// Accept one connection on `listener` and exchange hellos; the async
/// [`exchange_server`](super::exchange_server). The accept waits as long as
/// it takes; `timeout` bounds the hello phase.
pub async fn exchange_server_async(
    listener: &Async<TcpListener>,
    local: &Hello,
    timeout: Duration,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let (stream, _) =
        listener.accept().await.map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    exchange_accepted_async(stream, local, timeout).await
}

/// Exchange hellos over a connection the caller opened or accepted itself.
pub async fn exchange_accepted_async(
    stream: Async<TcpStream>,
    local: &Hello,
    timeout: Duration,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let peer = stream
        .get_ref()
        .peer_addr()
        .map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    hello_phase(stream, peer, local, Deadline::after(timeout, Phase::Hello)).await
}

async fn hello_phase(
    mut stream: Async<TcpStream>,
    peer: SocketAddr,
    local: &Hello,
    deadline: Deadline,
) -> Result<Handshake<Async<TcpStream>>, BootstrapError> {
    let io = |e| deadline.io_error(peer, e);
    stream.get_ref().set_nodelay(true).map_err(io)?;
    let hello = before(&deadline, async {
        stream.write_all(&encode(local)).await.map_err(io)?;
        let mut decoder = HelloDecoder::new();
        let mut buf = [0u8; MAX_FRAME_LEN];
        loop {
            if let Some(hello) = decoder.hello() {
                return Ok(*hello);
            }
            let want = decoder.wanted();
            let n = read_some(&mut stream, &mut buf[..want], peer, &deadline).await?;
            decoder.feed(&buf[..n]).map_err(|e| BootstrapError::from_peer(peer, e))?;
        }
    })
    .await?;
    conclude(stream, peer, local, hello)
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
        let peer = self.peer_addr;
        let stream = &mut self.stream;
        let byte = before(&deadline, async {
            stream.write_all(&[READY_BYTE]).await.map_err(|e| deadline.io_error(peer, e))?;
            let mut byte = [0u8; 1];
            read_some(stream, &mut byte, peer, &deadline).await?;
            Ok(byte[0])
        })
        .await?;
        check_ready(peer, byte)?;
        Ok(self.stream)
    }
}
