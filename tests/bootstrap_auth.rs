//! The auth phase over loopback TCP: the right key connects, and each way
//! of not having it (a wrong key, none, a replay, a reflection, garbage,
//! silence, a hello altered on the way) fails with its own error on the
//! side that can tell, while the listener goes on serving.
// async-io, which these tests use, is left out of loom builds (see Cargo.toml).
#![cfg(not(loom))]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use async_io::Async;
use mwcap::backend::QpEndpoint;
use mwcap::bootstrap::*;

const GENEROUS: Duration = Duration::from_secs(20);
/// How long the listener test's server waits for a silent client.
const SILENCE: Duration = Duration::from_secs(2);

/// Bytes the client sends before its hello: an init and a proof.
const INIT_LEN: usize = HEADER_LEN + AUTH_HELLO_BODY_LEN;
const PROOF_LEN: usize = HEADER_LEN + MAC_LEN;

fn key(text: &str) -> Auth {
    Auth::Key(Key::from_bytes(text.as_bytes().to_vec()).unwrap())
}

fn hello(qpn: u32) -> Hello {
    let mut gid = [0u8; 16];
    gid[10..12].copy_from_slice(&[0xff, 0xff]);
    gid[12..].copy_from_slice(&[127, 0, 0, 1]);
    Hello::new(QpEndpoint { id: PEER_QP_ID, qpn, gid, psn: qpn, mtu: 1024, lid: 0 }, Capabilities::new())
}

fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

/// A real server for one client: exchange and ready, its outcome returned.
fn spawn_server(l: TcpListener, auth: Auth) -> thread::JoinHandle<Result<Hello, BootstrapError>> {
    thread::spawn(move || {
        let hs = exchange_server(&l, &hello(0x100), &auth, GENEROUS)?;
        let peer = *hs.peer();
        hs.ready(GENEROUS)?;
        Ok(peer)
    })
}

/// Read exactly one auth frame of `len` bytes.
fn read_auth(s: &mut TcpStream, len: usize) -> AuthFrame {
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).unwrap();
    decode_auth(&buf).unwrap()
}

fn read_to_end(mut s: TcpStream) -> Vec<u8> {
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    rest
}

#[test]
fn the_same_key_connects_both_ways_blocking_and_async() {
    let (l, addr) = listener();
    let server = spawn_server(l, key("the same key on both sides"));
    let hs = exchange_client(addr, &hello(0x200), &key("the same key on both sides"), GENEROUS).unwrap();
    assert_eq!(hs.peer().endpoint.qpn, 0x100);
    hs.ready(GENEROUS).unwrap();
    assert_eq!(server.join().unwrap().unwrap().endpoint.qpn, 0x200);

    // Async server, the two-step client (authenticate, then hello).
    let l = Async::<TcpListener>::bind(([127, 0, 0, 1], 0)).unwrap();
    let addr = l.get_ref().local_addr().unwrap();
    let client = thread::spawn(move || {
        let authed = authenticate_client(addr, &key("the same key on both sides"), GENEROUS)?;
        assert!(authed.peer_proved_key());
        let hs = authed.hello(&hello(0x400), GENEROUS)?;
        hs.ready(GENEROUS).map(|_| ())
    });
    let peer = async_io::block_on(async {
        let authed = authenticate_server_async(&l, &key("the same key on both sides"), GENEROUS).await?;
        assert!(authed.peer_proved_key());
        let hs = authed.hello(&hello(0x300), GENEROUS).await?;
        let peer = *hs.peer();
        hs.ready(GENEROUS).await.map(|_| peer)
    })
    .unwrap();
    assert_eq!(peer.endpoint.qpn, 0x400);
    client.join().unwrap().unwrap();
}

#[test]
fn a_wrong_key_fails_on_both_sides_with_what_to_do() {
    let (l, addr) = listener();
    let server = spawn_server(l, key("the server's key, 1234"));
    let e = exchange_client(addr, &hello(0x200), &key("the client's key, 5678"), GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::AuthRejected { peer } if peer == addr), "{e:?}");
    assert!(e.to_string().contains("give both sides the same key"), "{e}");
    let e = server.join().unwrap().unwrap_err();
    assert!(matches!(e, BootstrapError::AuthFailed { .. }), "{e:?}");
    assert!(e.to_string().contains("matches no key of this side"), "{e}");
}

#[test]
fn a_key_on_one_side_only_fails_on_both_sides_naming_the_mismatch() {
    // The server has the key, the client runs without.
    let (l, addr) = listener();
    let server = spawn_server(l, key("only the server has it"));
    let e = exchange_client(addr, &hello(0x200), &Auth::Unauthenticated, GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::PeerRequiresKey { .. }), "{e:?}");
    let e = server.join().unwrap().unwrap_err();
    assert!(matches!(e, BootstrapError::PeerUnauthenticated { .. }), "{e:?}");
    assert!(e.to_string().contains("give the peer the same key"), "{e}");

    // The client has the key, the server runs without (async client).
    let (l, addr) = listener();
    let server = spawn_server(l, Auth::Unauthenticated);
    let e = async_io::block_on(exchange_client_async(
        addr,
        &hello(0x200),
        &key("only the client has it"),
        GENEROUS,
    ))
    .unwrap_err();
    assert!(matches!(e, BootstrapError::PeerUnauthenticated { .. }), "{e:?}");
    let e = server.join().unwrap().unwrap_err();
    assert!(matches!(e, BootstrapError::PeerRequiresKey { .. }), "{e:?}");
    assert!(e.to_string().contains("give this side the peer's key"), "{e}");
}

/// A relay from a listening address to `to`: copies both ways, records what
/// the client sent, and flips `byte ^ 1` at offset `tamper` of the client's
/// stream if given.
fn relay(to: SocketAddr, tamper: Option<usize>) -> (SocketAddr, thread::JoinHandle<Vec<u8>>) {
    let (l, addr) = listener();
    let t = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut s = TcpStream::connect(to).unwrap();
        let (mut c2, mut s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
        let back = thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(Shutdown::Write);
        });
        let mut recorded = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let n = match c.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let at = recorded.len();
            recorded.extend_from_slice(&buf[..n]);
            if let Some(i) = tamper.filter(|i| (at..at + n).contains(i)) {
                buf[i - at] ^= 1;
            }
            if s.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = s.shutdown(Shutdown::Write);
        back.join().unwrap();
        recorded
    });
    (addr, t)
}

#[test]
fn a_recorded_handshake_replayed_to_the_server_fails_and_the_server_goes_on() {
    let k = key("replay test key, 32 bytes long!!");
    let (l, server_addr) = listener();
    let k2 = k.clone();
    let server = thread::spawn(move || {
        (0..3)
            .map(|i| {
                let authed = authenticate_server(&l, &k2, GENEROUS)?;
                let hs = authed.hello(&hello(0x100 + i), GENEROUS)?;
                hs.ready(GENEROUS).map(|_| ())
            })
            .collect::<Vec<_>>()
    });
    // A genuine session, recorded on the way.
    let (relay_addr, recording) = relay(server_addr, None);
    let hs = exchange_client(relay_addr, &hello(0x200), &k, GENEROUS).unwrap();
    drop(hs.ready(GENEROUS).unwrap());
    let recorded = recording.join().unwrap();
    assert!(recorded.len() > INIT_LEN + PROOF_LEN);

    // The replay: the client's init and proof, word for word, to a server
    // whose nonce is fresh.
    let mut s = TcpStream::connect(server_addr).unwrap();
    s.write_all(&recorded[..INIT_LEN + PROOF_LEN]).unwrap();
    assert!(matches!(read_auth(&mut s, INIT_LEN), AuthFrame::Challenge { mode: AuthMode::PreSharedKey, .. }));
    assert_eq!(read_auth(&mut s, HEADER_LEN + 1), AuthFrame::Reject(RejectReason::BadProof));
    // Nothing else follows: no proof of the server's, no hello.
    assert_eq!(read_to_end(s), b"");

    // The listener serves the next client.
    let hs = exchange_client(server_addr, &hello(0x300), &k, GENEROUS).unwrap();
    hs.ready(GENEROUS).unwrap();
    let results = server.join().unwrap();
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert!(matches!(results[1], Err(BootstrapError::AuthFailed { .. })), "{:?}", results[1]);
    assert!(results[2].is_ok(), "{:?}", results[2]);
}

#[test]
fn a_server_that_reflects_the_clients_proof_is_refused_and_learns_no_hello() {
    let (l, addr) = listener();
    let fake = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let AuthFrame::Init { mode: AuthMode::PreSharedKey, .. } = read_auth(&mut s, INIT_LEN) else {
            panic!("expected the client's keyed init")
        };
        let challenge = AuthFrame::Challenge { mode: AuthMode::PreSharedKey, nonce: [5; NONCE_LEN] };
        s.write_all(&encode_auth(&challenge)).unwrap();
        let proof = read_auth(&mut s, PROOF_LEN);
        assert!(matches!(proof, AuthFrame::Proof(_)));
        // Back to the sender, as the server's own proof.
        s.write_all(&encode_auth(&proof)).unwrap();
        read_to_end(s)
    });
    let e = exchange_client(addr, &hello(0x200), &key("the client's real key!"), GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::AuthFailed { peer } if peer == addr), "{e:?}");
    // The client sent nothing after its proof: no hello, no queue pair number.
    assert_eq!(fake.join().unwrap(), b"");
}

#[test]
fn a_hello_altered_on_the_way_fails_its_tag() {
    let k = key("tag test key, sixteen+ bytes");
    let (l, server_addr) = listener();
    let server = spawn_server(l, k.clone());
    // The low byte of the client's QPN: after the init, the proof, the
    // hello header and the connection id.
    let qpn_low = INIT_LEN + PROOF_LEN + HEADER_LEN + 8 + 3;
    let (relay_addr, relayed) = relay(server_addr, Some(qpn_low));
    // The client may get the server's hello before the server checks its
    // own; it fails by the ready phase at the latest.
    let r = exchange_client(relay_addr, &hello(0x200), &k, GENEROUS).and_then(|hs| hs.ready(GENEROUS));
    assert!(r.is_err());
    let e = server.join().unwrap().unwrap_err();
    assert!(matches!(e, BootstrapError::HelloNotAuthentic { .. }), "{e:?}");
    relayed.join().unwrap();
}

/// What the server said to `bytes`, and the error it returned.
fn server_answer(auth: &Auth, bytes: &[u8]) -> (Vec<u8>, BootstrapError) {
    let (l, addr) = listener();
    let bytes = bytes.to_vec();
    let client = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(Shutdown::Write);
        read_to_end(s)
    });
    let e = authenticate_server(&l, auth, GENEROUS).unwrap_err();
    (client.join().unwrap(), e)
}

#[test]
fn garbage_and_oversized_auth_frames_are_refused_without_a_panic() {
    let k = key("garbage test key 0123456789");
    // A header that announces 65535 bytes: refused before any body is read.
    let mut huge = encode_auth(&AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: [0; NONCE_LEN] });
    huge[7..9].copy_from_slice(&u16::MAX.to_be_bytes());
    let (said, e) = server_answer(&k, &huge);
    assert!(
        matches!(e, BootstrapError::Malformed { source: DecodeError::FrameTooLarge { len: 65535, .. }, .. }),
        "{e:?}"
    );
    assert_eq!(said, b"", "nothing is answered to a malformed frame");
    // The right size for the kind, but an unknown mode.
    let mut bad_mode = encode_auth(&AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: [0; NONCE_LEN] });
    bad_mode[HEADER_LEN] = 7;
    let (_, e) = server_answer(&k, &bad_mode);
    assert!(
        matches!(
            e,
            BootstrapError::Malformed { source: DecodeError::InvalidField { field: "auth mode", .. }, .. }
        ),
        "{e:?}"
    );
    // A proof where the init belongs, and a hello where the init belongs.
    let (_, e) = server_answer(&k, &encode_auth(&AuthFrame::Proof([1; MAC_LEN])));
    assert!(
        matches!(
            &e,
            BootstrapError::Malformed {
                source: DecodeError::UnexpectedFrame { got: "an auth proof", expected: "an auth init" },
                ..
            }
        ),
        "{e:?}"
    );
    let (_, e) = server_answer(&k, &encode(&hello(0x200)));
    assert!(
        matches!(
            &e,
            BootstrapError::Malformed { source: DecodeError::UnexpectedFrame { got: "a hello", .. }, .. }
        ),
        "{e:?}"
    );
    // A valid init, then a proof frame cut short.
    let mut cut = encode_auth(&AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: [0; NONCE_LEN] });
    cut.extend_from_slice(&encode_auth(&AuthFrame::Proof([1; MAC_LEN]))[..20]);
    let (said, e) = server_answer(&k, &cut);
    assert!(matches!(e, BootstrapError::PeerClosed { phase: Phase::Auth, .. }), "{e:?}");
    assert_eq!(said.len(), INIT_LEN, "the challenge, and nothing keyed");
}

#[test]
fn the_listener_serves_a_good_client_after_bad_ones() {
    let k = key("listener test key 0123456789");
    let (l, addr) = listener();
    let k2 = k.clone();
    let server = thread::spawn(move || {
        let mut errors = Vec::new();
        loop {
            let r = authenticate_server(&l, &k2, SILENCE)
                .and_then(|a| a.hello(&hello(0x100), GENEROUS))
                .and_then(|hs| hs.ready(GENEROUS));
            match r {
                Ok(_) => return errors,
                Err(e) => errors.push(e),
            }
        }
    });
    // A wrong key, no key, a stranger, and one that says nothing at all.
    let e = exchange_client(addr, &hello(0x201), &key("a wrong key, 0123456789"), GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::AuthRejected { .. }), "{e:?}");
    let e = exchange_client(addr, &hello(0x202), &Auth::Unauthenticated, GENEROUS).unwrap_err();
    assert!(matches!(e, BootstrapError::PeerRequiresKey { .. }), "{e:?}");
    let mut stranger = TcpStream::connect(addr).unwrap();
    stranger.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_to_end(stranger), b"");
    let silent = TcpStream::connect(addr).unwrap();
    assert_eq!(read_to_end(silent), b"", "the server gives up on a silent client");
    // And then the one with the key.
    let hs = exchange_client(addr, &hello(0x203), &k, GENEROUS).unwrap();
    hs.ready(GENEROUS).unwrap();
    let errors = server.join().unwrap();
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert!(matches!(errors[0], BootstrapError::AuthFailed { .. }), "{:?}", errors[0]);
    assert!(matches!(errors[1], BootstrapError::PeerUnauthenticated { .. }), "{:?}", errors[1]);
    assert!(matches!(errors[2], BootstrapError::NotMwcapPeer { .. }), "{:?}", errors[2]);
    assert!(matches!(errors[3], BootstrapError::TimedOut { phase: Phase::Auth, .. }), "{:?}", errors[3]);
}
