//! The exchange over blocking `std::net` sockets.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use super::error::{BootstrapError, Phase};
use super::handshake::{check_ready, conclude, Deadline, Handshake};
use super::wire::{encode, Hello, HelloDecoder, READY_BYTE};

/// Connect to the server at `addr` and exchange hellos.
///
/// `timeout` bounds the connect and the hello phase together. The returned
/// [`Handshake`] holds the peer's endpoint and the negotiated parameters.
pub fn exchange_client(
    addr: SocketAddr,
    local: &Hello,
    timeout: Duration,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let connect = Deadline::after(timeout, Phase::Connect);
    let stream = TcpStream::connect_timeout(&addr, connect.remaining()?).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => connect.expired(),
        _ => BootstrapError::Unreachable { addr, source: e },
    })?;
    let hello = connect.with_phase(Phase::Hello);
    hello_phase(stream, addr, local, hello)
}

/// Accept one connection on `listener` and exchange hellos.
///
/// The accept waits as long as it takes (a server waits for its client);
/// `timeout` bounds the hello phase once a client has connected.
pub fn exchange_server(
    listener: &TcpListener,
    local: &Hello,
    timeout: Duration,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let (stream, _) =
        listener.accept().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    exchange_accepted(stream, local, timeout)
}

/// Exchange hellos over a connection the caller opened or accepted itself.
pub fn exchange_accepted(
    stream: TcpStream,
    local: &Hello,
    timeout: Duration,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let peer = stream.peer_addr().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    hello_phase(stream, peer, local, Deadline::after(timeout, Phase::Hello))
}

fn hello_phase(
    mut stream: TcpStream,
    peer: SocketAddr,
    local: &Hello,
    deadline: Deadline,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    let io = |e| deadline.io_error(peer, e);
    // Each side writes before it reads and the hello fits any socket buffer,
    // so the symmetric exchange cannot deadlock.
    stream.set_nodelay(true).map_err(io)?;
    stream.set_write_timeout(Some(deadline.remaining()?)).map_err(io)?;
    stream.write_all(&encode(local)).map_err(io)?;
    let mut decoder = HelloDecoder::new();
    let mut buf = [0u8; super::wire::MAX_FRAME_LEN];
    let hello = loop {
        if let Some(hello) = decoder.hello() {
            break *hello;
        }
        let want = decoder.wanted();
        let n = read_some(&mut stream, &mut buf[..want], peer, &deadline)?;
        decoder.feed(&buf[..n]).map_err(|e| BootstrapError::from_peer(peer, e))?;
    };
    conclude(stream, peer, local, hello)
}

/// Read at least one byte before the deadline; a clean end of stream is the
/// peer closing.
fn read_some(
    stream: &mut TcpStream,
    buf: &mut [u8],
    peer: SocketAddr,
    deadline: &Deadline,
) -> Result<usize, BootstrapError> {
    loop {
        stream.set_read_timeout(Some(deadline.remaining()?)).map_err(|e| deadline.io_error(peer, e))?;
        match stream.read(buf) {
            Ok(0) => return Err(BootstrapError::PeerClosed { peer, phase: deadline.phase() }),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(deadline.io_error(peer, e)),
        }
    }
}

impl Handshake<TcpStream> {
    /// The ready phase: call once the local queue pair is in RTS. Sends the
    /// ready byte and waits (at most `timeout`) for the peer's, which it
    /// sends once its queue pair is in RTS. Returns the stream, with its
    /// timeouts cleared, for the caller to keep: its closing tells that the
    /// peer went away.
    pub fn ready(mut self, timeout: Duration) -> Result<TcpStream, BootstrapError> {
        let deadline = Deadline::after(timeout, Phase::Ready);
        let peer = self.peer_addr;
        let io = |e| deadline.io_error(peer, e);
        self.stream.set_write_timeout(Some(deadline.remaining()?)).map_err(io)?;
        self.stream.write_all(&[READY_BYTE]).map_err(io)?;
        let mut byte = [0u8; 1];
        read_some(&mut self.stream, &mut byte, peer, &deadline)?;
        check_ready(peer, byte[0])?;
        self.stream.set_read_timeout(None).map_err(io)?;
        self.stream.set_write_timeout(None).map_err(io)?;
        Ok(self.stream)
    }
}
