//! The exchange over blocking `std::net` sockets.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use super::auth::{fresh_nonce, Machine};
use super::error::{BootstrapError, Phase};
use super::handshake::{
    check_hello_tag, check_ready, conclude, hello_frames, Authenticated, Deadline, Handshake,
};
use super::key::Auth;
use super::wire::{encode_auth, AuthFrame, FrameReader, Hello, Message, MAX_FRAME_LEN, READY_BYTE};

/// Connect to the server at `addr` and run the auth phase.
///
/// `timeout` bounds the connect and the auth phase together. Create the
/// queue pair once this returns, then call [`Authenticated::hello`].
pub fn authenticate_client(
    addr: SocketAddr,
    auth: &Auth,
    timeout: Duration,
) -> Result<Authenticated<TcpStream>, BootstrapError> {
    let machine = Machine::client(auth, fresh_nonce()?)?;
    let connect = Deadline::after(timeout, Phase::Connect);
    let stream = dial(addr, &connect)?;
    auth_phase(stream, addr, machine, connect.with_phase(Phase::Auth))
}

/// Accept one connection on `listener` and run the auth phase as the server.
///
/// The accept waits as long as it takes (a server waits for its client);
/// `timeout` bounds the auth phase once a client has connected, so a silent
/// client cannot hold the listener longer. An error concerns that one
/// connection only: call again to take the next client.
pub fn authenticate_server(
    listener: &TcpListener,
    auth: &Auth,
    timeout: Duration,
) -> Result<Authenticated<TcpStream>, BootstrapError> {
    let (stream, _) =
        listener.accept().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    authenticate_accepted(stream, auth, timeout)
}

/// Run the auth phase as the server over a connection the caller accepted itself.
pub fn authenticate_accepted(
    stream: TcpStream,
    auth: &Auth,
    timeout: Duration,
) -> Result<Authenticated<TcpStream>, BootstrapError> {
    let peer = stream.peer_addr().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    auth_phase(stream, peer, Machine::server(auth, fresh_nonce()?), Deadline::after(timeout, Phase::Auth))
}

impl Authenticated<TcpStream> {
    /// The hello phase: send `local` (the queue pair created after the auth
    /// phase), read and check the peer's, and negotiate. `timeout` bounds it.
    pub fn hello(self, local: &Hello, timeout: Duration) -> Result<Handshake<TcpStream>, BootstrapError> {
        local.validate().map_err(BootstrapError::from_local)?;
        hello_phase(self, local, Deadline::after(timeout, Phase::Hello))
    }
}

/// Connect to the server at `addr`, run the auth phase and exchange hellos,
/// for a caller whose queue pair exists already ([`authenticate_client`]
/// lets it be created after the server proved the key).
///
/// `timeout` bounds the connect, the auth and the hello phases together. The
/// returned [`Handshake`] holds the peer's endpoint and the negotiated parameters.
pub fn exchange_client(
    addr: SocketAddr,
    local: &Hello,
    auth: &Auth,
    timeout: Duration,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let machine = Machine::client(auth, fresh_nonce()?)?;
    let connect = Deadline::after(timeout, Phase::Connect);
    let stream = dial(addr, &connect)?;
    let authed = auth_phase(stream, addr, machine, connect.with_phase(Phase::Auth))?;
    hello_phase(authed, local, connect.with_phase(Phase::Hello))
}

/// Accept one connection on `listener`, run the auth phase and exchange
/// hellos, for a caller whose queue pair exists already
/// ([`authenticate_server`] creates nothing before the client proved the key).
///
/// The accept waits as long as it takes; `timeout` bounds the auth and
/// hello phases together once a client has connected.
pub fn exchange_server(
    listener: &TcpListener,
    local: &Hello,
    auth: &Auth,
    timeout: Duration,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let (stream, _) =
        listener.accept().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    exchange_accepted(stream, local, auth, timeout)
}

/// [`exchange_server`] over a connection the caller accepted itself.
pub fn exchange_accepted(
    stream: TcpStream,
    local: &Hello,
    auth: &Auth,
    timeout: Duration,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    local.validate().map_err(BootstrapError::from_local)?;
    let peer = stream.peer_addr().map_err(|source| BootstrapError::Io { phase: Phase::Connect, source })?;
    let deadline = Deadline::after(timeout, Phase::Auth);
    let authed = auth_phase(stream, peer, Machine::server(auth, fresh_nonce()?), deadline)?;
    hello_phase(authed, local, deadline.with_phase(Phase::Hello))
}

fn dial(addr: SocketAddr, deadline: &Deadline) -> Result<TcpStream, BootstrapError> {
    TcpStream::connect_timeout(&addr, deadline.remaining()?).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => deadline.expired(),
        _ => BootstrapError::Unreachable { addr, source: e },
    })
}

fn auth_phase(
    mut stream: TcpStream,
    peer: SocketAddr,
    mut machine: Machine,
    deadline: Deadline,
) -> Result<Authenticated<TcpStream>, BootstrapError> {
    stream.set_nodelay(true).map_err(|e| deadline.io_error(peer, e))?;
    loop {
        while let Some(frame) = machine.poll_transmit() {
            send(&mut stream, &encode_auth(&frame), peer, &deadline)?;
        }
        if let Some(session) = machine.session() {
            return Ok(Authenticated { stream, peer_addr: peer, session });
        }
        let (frame, _) = read_frame::<AuthFrame>(&mut stream, peer, &deadline)?;
        if let Err(e) = machine.handle_frame(frame) {
            // Tell the peer why (a reject), if there is something to tell;
            // it may have gone already, and our error says more than that.
            if let Some(frame) = machine.poll_transmit() {
                let _ = send(&mut stream, &encode_auth(&frame), peer, &deadline);
            }
            return Err(BootstrapError::from_auth(peer, e));
        }
    }
}

fn hello_phase(
    authed: Authenticated<TcpStream>,
    local: &Hello,
    deadline: Deadline,
) -> Result<Handshake<TcpStream>, BootstrapError> {
    let Authenticated { mut stream, peer_addr: peer, session } = authed;
    // Each side writes before it reads and the hello (with its tag) fits any
    // socket buffer, so the symmetric exchange cannot deadlock.
    send(&mut stream, &hello_frames(&session, local), peer, &deadline)?;
    let (hello, reader) = read_frame::<Hello>(&mut stream, peer, &deadline)?;
    if session.is_keyed() {
        let (tag, _) = read_frame::<AuthFrame>(&mut stream, peer, &deadline)?;
        check_hello_tag(&session, peer, reader.frame(), &tag)?;
    }
    conclude(stream, peer, local, hello)
}

fn send(
    stream: &mut TcpStream,
    bytes: &[u8],
    peer: SocketAddr,
    deadline: &Deadline,
) -> Result<(), BootstrapError> {
    let io = |e| deadline.io_error(peer, e);
    stream.set_write_timeout(Some(deadline.remaining()?)).map_err(io)?;
    stream.write_all(bytes).map_err(io)
}

/// Read one frame of `M`, never a byte past its end; returns the message
/// and the reader, which holds the frame's bytes as received.
fn read_frame<M: Message + Copy>(
    stream: &mut TcpStream,
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
        let n = read_some(stream, &mut buf[..want], peer, deadline)?;
        reader.feed(&buf[..n]).map_err(|e| BootstrapError::from_peer(peer, e))?;
    }
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
        send(&mut self.stream, &[READY_BYTE], peer, &deadline)?;
        let mut byte = [0u8; 1];
        read_some(&mut self.stream, &mut byte, peer, &deadline)?;
        check_ready(peer, byte[0])?;
        self.stream.set_read_timeout(None).map_err(io)?;
        self.stream.set_write_timeout(None).map_err(io)?;
        Ok(self.stream)
    }
}
