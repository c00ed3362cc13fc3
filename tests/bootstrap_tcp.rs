//! The bootstrap exchange over loopback TCP (127.0.0.1 only): success with
//! blocking and async sockets, and each failure a peer can cause. Both
//! sides run unauthenticated here; the key is `bootstrap_auth.rs`'s.
// async-io, which these tests use, is left out of loom builds (see Cargo.toml).
#![cfg(not(loom))]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use async_io::Async;
use mwcap::backend::QpEndpoint;
use mwcap::bootstrap::*;

/// Long enough never to fire on a loaded machine when the peer answers.
const GENEROUS: Duration = Duration::from_secs(20);
/// For the tests where the peer never answers.
const SHORT: Duration = Duration::from_millis(200);

fn hello(qpn: u32, mtu: u32) -> Hello {
    let mut gid = [0u8; 16];
    gid[10..12].copy_from_slice(&[0xff, 0xff]);
    gid[12..].copy_from_slice(&[127, 0, 0, 1]);
    Hello::new(QpEndpoint { id: PEER_QP_ID, qpn, gid, psn: qpn * 7, mtu, lid: 0 }, Capabilities::new())
}

fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

/// A fake peer: accepts one connection and runs `f` on it.
fn fake_server(f: impl FnOnce(TcpStream) + Send + 'static) -> (SocketAddr, thread::JoinHandle<()>) {
    let (l, addr) = listener();
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        f(s)
    });
    (addr, t)
}

const NO_AUTH: &Auth = &Auth::Unauthenticated;

/// Answer the client's auth init as an unauthenticated server would.
fn answer_auth(s: &mut TcpStream) {
    let mut buf = [0u8; HEADER_LEN + AUTH_HELLO_BODY_LEN];
    s.read_exact(&mut buf).unwrap();
    assert!(matches!(decode_auth(&buf), Ok(AuthFrame::Init { mode: AuthMode::Unauthenticated, .. })));
    s.write_all(&encode_auth(&AuthFrame::Challenge {
        mode: AuthMode::Unauthenticated,
        nonce: [9; NONCE_LEN],
    }))
    .unwrap();
}

/// Run the auth phase and read the client's hello off `s` as a fake peer
/// would, and check it is valid.
fn read_client_hello(s: &mut TcpStream) -> Hello {
    answer_auth(s);
    let mut buf = [0u8; HEADER_LEN + HELLO_BODY_LEN];
    s.read_exact(&mut buf).unwrap();
    decode(&buf).unwrap()
}

/// Read until the other side closes, so that closing here sends FIN, not RST.
fn drain(mut s: TcpStream) {
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
}

#[test]
fn blocking_exchange_connects_both_sides_with_the_smaller_mtu() {
    let (l, addr) = listener();
    let server_hello = hello(0x100, 1024);
    let client_hello = hello(0x200, 4096);
    let server = thread::spawn(move || {
        let hs = exchange_server(&l, &server_hello, NO_AUTH, GENEROUS).unwrap();
        assert_eq!(hs.peer().endpoint.qpn, 0x200);
        assert_eq!(hs.peer().conn_id, client_hello.conn_id);
        assert_eq!(hs.remote_endpoint().mtu, 1024);
        assert_eq!(hs.remote_endpoint().psn, 0x200 * 7);
        let mut s = hs.ready(GENEROUS).unwrap();
        // The stream stays usable after the handshake.
        s.write_all(b"x").unwrap();
        drain(s);
    });
    let hs = exchange_client(addr, &client_hello, NO_AUTH, GENEROUS).unwrap();
    assert_eq!(hs.peer().endpoint.qpn, 0x100);
    assert_eq!(hs.peer().endpoint.id, PEER_QP_ID);
    assert_eq!(hs.local(), &client_hello);
    assert_eq!(hs.peer_addr(), addr);
    assert_eq!(hs.negotiated().mtu, 1024);
    assert_eq!(hs.remote_endpoint(), QpEndpoint { mtu: 1024, ..hs.peer().endpoint });
    assert_eq!(hs.negotiated().we_expose, Some(Policy::Mw));
    let mut s = hs.ready(GENEROUS).unwrap();
    let mut b = [0u8];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"x");
    drop(s);
    server.join().unwrap();
}

#[test]
fn async_exchange_connects_both_sides() {
    let l = Async::<TcpListener>::bind(([127, 0, 0, 1], 0)).unwrap();
    let addr = l.get_ref().local_addr().unwrap();
    let (sh, ch) = (hello(0x300, 2048), hello(0x400, 1024));
    let (server, client) = async_io::block_on(async {
        let server = async {
            let hs = exchange_server_async(&l, &sh, NO_AUTH, GENEROUS).await?;
            let peer = *hs.peer();
            hs.ready(GENEROUS).await.map(|_| peer)
        };
        let client = async {
            let hs = exchange_client_async(addr, &ch, NO_AUTH, GENEROUS).await?;
            let (peer, mtu) = (*hs.peer(), hs.remote_endpoint().mtu);
            hs.ready(GENEROUS).await.map(|_| (peer, mtu))
        };
        futures::join!(server, client)
    });
    assert_eq!(server.unwrap().endpoint.qpn, 0x400);
    let (peer, mtu) = client.unwrap();
    assert_eq!((peer.endpoint.qpn, mtu), (0x300, 1024));
}

#[test]
fn blocking_client_and_async_server_interoperate() {
    let l = Async::<TcpListener>::bind(([127, 0, 0, 1], 0)).unwrap();
    let addr = l.get_ref().local_addr().unwrap();
    let client = thread::spawn(move || {
        let hs = exchange_client(addr, &hello(0x500, 256), NO_AUTH, GENEROUS)?;
        hs.ready(GENEROUS).map(|_| ())
    });
    let peer = async_io::block_on(async {
        let hs = exchange_server_async(&l, &hello(0x600, 4096), NO_AUTH, GENEROUS).await.unwrap();
        assert_eq!(hs.negotiated().mtu, 256);
        let peer = *hs.peer();
        hs.ready(GENEROUS).await.unwrap();
        peer
    });
    assert_eq!(peer.endpoint.qpn, 0x500);
    client.join().unwrap().unwrap();
}

#[test]
fn a_peer_of_another_version_is_a_version_mismatch() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        let mut theirs = encode(&hello(0x100, 1024));
        theirs[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_be_bytes());
        s.write_all(&theirs).unwrap();
        drain(s);
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    assert!(
        matches!(e, BootstrapError::VersionMismatch { ours: PROTOCOL_VERSION, theirs } if theirs == PROTOCOL_VERSION + 1),
        "{e:?}"
    );
    assert!(e.to_string().contains("upgrade"), "{e}");
    t.join().unwrap();
}

/// A hello as version 1 sent it (the same body; version 1 had no auth phase).
fn version_1_hello(qpn: u32) -> Vec<u8> {
    let mut v1 = encode(&hello(qpn, 1024));
    v1[4..6].copy_from_slice(&1u16.to_be_bytes());
    v1
}

#[test]
fn a_version_1_peer_is_a_version_mismatch_in_the_auth_phase_both_ways() {
    // A version-1 server sends its hello at once, where our challenge belongs.
    let (addr, t) = fake_server(|mut s| {
        s.write_all(&version_1_hello(0x100)).unwrap();
        drain(s);
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 1 }), "{e:?}");
    t.join().unwrap();
    // A version-1 client's hello arrives where the auth init belongs.
    let (l, addr) = listener();
    let client = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&version_1_hello(0x200)).unwrap();
        drain(s);
    });
    let e = authenticate_server(&l, NO_AUTH, GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 1 }), "{e:?}");
    drop(l);
    client.join().unwrap();
}

#[test]
fn a_server_that_is_not_mwcap_is_named_as_such() {
    let (addr, t) = fake_server(|mut s| {
        s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
        drain(s);
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    match &e {
        BootstrapError::NotMwcapPeer { peer, prefix } => {
            assert_eq!(*peer, addr);
            assert_eq!(prefix, b"SSH-");
        }
        other => panic!("expected NotMwcapPeer, got {other:?}"),
    }
    assert!(e.to_string().contains("is not an mwcap peer"), "{e}");
    t.join().unwrap();
}

#[test]
fn a_client_that_is_not_mwcap_is_named_as_such() {
    let (l, addr) = listener();
    let client = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        drain(s);
    });
    let e = exchange_server(&l, &hello(0x100, 1024), NO_AUTH, GENEROUS).unwrap_err();
    assert!(matches!(&e, BootstrapError::NotMwcapPeer { prefix, .. } if prefix == b"GET "), "{e:?}");
    drop(l);
    client.join().unwrap();
}

#[test]
fn a_peer_that_closes_mid_hello_is_reported() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        s.write_all(&encode(&hello(0x100, 1024))[..20]).unwrap();
        // Dropping closes with nothing unread: a clean FIN after 20 bytes.
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::PeerClosed { peer, phase: Phase::Hello } if peer == addr), "{e:?}");
    t.join().unwrap();
}

#[test]
fn a_peer_that_closes_before_ready_is_reported() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        s.write_all(&encode(&hello(0x100, 1024))).unwrap();
        let mut ready = [0u8];
        s.read_exact(&mut ready).unwrap();
        assert_eq!(ready[0], READY_BYTE);
    });
    let hs = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap();
    let e = hs.ready(GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::PeerClosed { phase: Phase::Ready, .. }), "{e:?}");
    t.join().unwrap();
}

#[test]
fn a_wrong_ready_byte_is_malformed() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        s.write_all(&encode(&hello(0x100, 1024))).unwrap();
        s.write_all(&[0x00]).unwrap();
        drain(s);
    });
    let hs = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap();
    let e = hs.ready(GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::Malformed { source: DecodeError::BadReady(0), .. }), "{e:?}");
    t.join().unwrap();
}

#[test]
fn a_closed_port_is_unreachable() {
    // Bind to learn a free port, then close it: nothing listens there.
    let addr = listener().1;
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    match &e {
        BootstrapError::Unreachable { addr: a, source } => {
            assert_eq!(*a, addr);
            assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&addr.to_string()) && msg.contains("is the server running"), "{msg}");
    assert!(std::error::Error::source(&e).is_some());
    let e =
        async_io::block_on(exchange_client_async(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS)).unwrap_err();
    assert!(matches!(e, BootstrapError::Unreachable { .. }), "{e:?}");
}

#[test]
fn a_silent_server_times_out() {
    let (addr, t) = fake_server(|mut s| {
        // Read the client's hello and then say nothing until it gives up.
        read_client_hello(&mut s);
        drain(s);
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, SHORT).unwrap_err();
    assert!(matches!(e, BootstrapError::TimedOut { phase: Phase::Hello, after } if after == SHORT), "{e:?}");
    drop(e);
    t.join().unwrap();
}

#[test]
fn a_silent_server_times_out_async() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        drain(s);
    });
    let e = async_io::block_on(exchange_client_async(addr, &hello(0x200, 1024), NO_AUTH, SHORT)).unwrap_err();
    assert!(matches!(e, BootstrapError::TimedOut { phase: Phase::Hello, .. }), "{e:?}");
    t.join().unwrap();
}

#[test]
fn a_silent_client_times_out_the_server() {
    let (l, addr) = listener();
    let client = thread::spawn(move || drain(TcpStream::connect(addr).unwrap()));
    let e = exchange_server(&l, &hello(0x100, 1024), NO_AUTH, SHORT).unwrap_err();
    assert!(matches!(e, BootstrapError::TimedOut { phase: Phase::Auth, .. }), "{e:?}");
    drop(e);
    drop(l);
    client.join().unwrap();
}

#[test]
fn a_peer_that_never_sends_ready_times_out() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        s.write_all(&encode(&hello(0x100, 1024))).unwrap();
        drain(s);
    });
    let hs = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap();
    let e = hs.ready(SHORT).unwrap_err();
    assert!(matches!(e, BootstrapError::TimedOut { phase: Phase::Ready, .. }), "{e:?}");
    drop(e);
    t.join().unwrap();
}

#[test]
fn a_zero_gid_is_unusable_on_either_side() {
    // Ours: refused before any connection is tried (the address is never dialled).
    let mut bad = hello(0x200, 1024);
    bad.endpoint.gid = [0; 16];
    let e = exchange_client(listener().1, &bad, NO_AUTH, GENEROUS).unwrap_err();
    assert!(
        matches!(e, BootstrapError::Unusable { side: Side::Local, source: DecodeError::ZeroGid }),
        "{e:?}"
    );
    assert!(e.to_string().contains("this side's device or GID is unusable"), "{e}");
    // The peer's.
    let (addr, t) = fake_server(move |mut s| {
        read_client_hello(&mut s);
        let mut theirs = encode(&hello(0x100, 1024));
        theirs[HEADER_LEN + 20..HEADER_LEN + 36].fill(0);
        s.write_all(&theirs).unwrap();
        drain(s);
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    assert!(
        matches!(e, BootstrapError::Unusable { side: Side::Peer, source: DecodeError::ZeroGid }),
        "{e:?}"
    );
    t.join().unwrap();
}

#[test]
fn a_peer_mtu_that_cannot_be_negotiated_is_unusable() {
    let (addr, t) = fake_server(|mut s| {
        read_client_hello(&mut s);
        let mut theirs = encode(&hello(0x100, 1024));
        theirs[HEADER_LEN + 16..HEADER_LEN + 18].copy_from_slice(&1500u16.to_be_bytes());
        s.write_all(&theirs).unwrap();
        drain(s);
    });
    let e = exchange_client(addr, &hello(0x200, 1024), NO_AUTH, GENEROUS).unwrap_err();
    assert!(
        matches!(e, BootstrapError::Unusable { side: Side::Peer, source: DecodeError::InvalidMtu(1500) }),
        "{e:?}"
    );
    t.join().unwrap();
}

#[test]
fn peers_without_a_common_policy_are_refused_on_both_sides() {
    let (l, addr) = listener();
    let mut mw_only = hello(0x100, 1024);
    mw_only.caps.serve = PolicySet::MW;
    mw_only.caps.read = PolicySet::MW;
    let mut confirm_only = hello(0x200, 1024);
    confirm_only.caps.serve = PolicySet::CONFIRM;
    confirm_only.caps.read = PolicySet::CONFIRM;
    let server = thread::spawn(move || exchange_server(&l, &mw_only, NO_AUTH, GENEROUS).map(|_| ()));
    let e = exchange_client(addr, &confirm_only, NO_AUTH, GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::NoCommonPolicy { .. }), "{e:?}");
    let e = server.join().unwrap().unwrap_err();
    assert!(matches!(e, BootstrapError::NoCommonPolicy { .. }), "{e:?}");
}
