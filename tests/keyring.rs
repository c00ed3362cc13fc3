//! Identities: a server's keyring accepts each client that proves one of
//! its keys, and every connection names the key its peer proved
//! (`Connection::peer_identity`); keyring files load, and say what is wrong
//! with a bad line.

#![cfg(not(loom))]

mod util;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use mwcap::bootstrap::{Auth, BootstrapError, Key, KeyError, Keyring, SHARED_IDENTITY};
use mwcap::conn::{Config, Endpoint, SetupError};
use mwcap::sim::{DeviceConfig, Fabric};

fn key(fill: u8) -> Key {
    Key::from_bytes(vec![fill; 32]).unwrap()
}

fn ring(entries: &[(&str, u8)]) -> Keyring {
    let mut r = Keyring::new();
    for &(name, fill) in entries {
        r.insert(name, key(fill)).unwrap();
    }
    r
}

fn small() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 4096;
    c
}

fn wait(pool: &mut LocalPool, f: impl FnMut() -> bool) -> bool {
    util::wait_for(pool, Duration::from_secs(10), f)
}

/// One server with a keyring of three identities; clients connect with
/// their own keys (one with a ring of several, told which to prove), one
/// with a key the server does not hold, one with a ring that does not say
/// which key is its own. The server's connections name each client; each
/// client's names the key both sides proved; the others get errors that
/// say what to do, and cost the server no connection.
#[test]
fn a_server_keyring_tells_its_clients_apart_and_refuses_the_rest() {
    let fabric = Fabric::with_seed(7);
    let sn = fabric.add_device(DeviceConfig::spec());
    let mut pool = LocalPool::new();
    let sp = pool.spawner();
    let server_ring = ring(&[("storage-1", 1), ("compute-7", 7), ("router", 9)]);
    let (server, sdrv) = Endpoint::builder(sn, Auth::Keyring(server_ring))
        .config(small())
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .unwrap();
    sp.spawn_local(async move {
        sdrv.run().await;
    })
    .unwrap();
    let addr: SocketAddr = server.local_addr().expect("it listens");
    let seen: Rc<RefCell<Vec<Option<String>>>> = Rc::default();
    let (s2, seen2) = (server.clone(), seen.clone());
    sp.spawn_local(async move {
        loop {
            // A handshake that failed is an error here; the listener goes on.
            if let Ok(conn) = s2.accept().await {
                seen2.borrow_mut().push(conn.peer_identity().map(str::to_owned));
            }
        }
    })
    .unwrap();

    let clients = [
        ("compute-7", Auth::Keyring(ring(&[("compute-7", 7)]))),
        ("router", Auth::Keyring(ring(&[("mine-elsewhere", 3), ("router", 9)]).prove_as("router").unwrap())),
        ("storage-1", Auth::Key(key(1))),
    ];
    // Each client's name and what its connect gave: the identity it saw, or the error.
    type Outcome = (String, Result<Option<String>, String>);
    let results: Rc<RefCell<Vec<Outcome>>> = Rc::default();
    let mut keep = Vec::new();
    let client_auths = clients.into_iter().map(|(n, a)| (n.to_owned(), a)).chain([
        ("intruder".to_owned(), Auth::Keyring(ring(&[("compute-7", 8)]))),
        ("undecided".to_owned(), Auth::Keyring(ring(&[("a", 11), ("b", 12)]))),
    ]);
    for (name, auth) in client_auths {
        let (client, cdrv) = Endpoint::builder(fabric.add_device(DeviceConfig::spec()), auth)
            .config(small())
            .handshake_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        sp.spawn_local(async move {
            cdrv.run().await;
        })
        .unwrap();
        let results = results.clone();
        let c2 = client.clone();
        sp.spawn_local(async move {
            let r = match c2.connect(addr).await {
                Ok(conn) => {
                    let id = conn.peer_identity().map(str::to_owned);
                    std::mem::forget(conn); // keep it up until the test ends
                    Ok(id)
                }
                Err(e) => Err(e.to_string()),
            };
            results.borrow_mut().push((name, r));
        })
        .unwrap();
        keep.push(client);
    }
    assert!(wait(&mut pool, || results.borrow().len() == 5), "every client finished");
    let results = results.borrow();
    let of = |n: &str| results.iter().find(|(m, _)| m == n).map(|(_, r)| r.clone()).unwrap();
    assert_eq!(of("compute-7"), Ok(Some("compute-7".into())), "the client names the key both proved");
    assert_eq!(of("router"), Ok(Some("router".into())));
    // A shared key that the server's ring holds under a name: that name.
    assert_eq!(of("storage-1"), Ok(Some(SHARED_IDENTITY.into())), "the client knows only its shared key");
    let intruder = of("intruder").unwrap_err();
    assert!(intruder.contains("refused this side's proof"), "{intruder}");
    let undecided = of("undecided").unwrap_err();
    assert!(undecided.contains("Keyring::prove_as"), "{undecided}");
    assert!(wait(&mut pool, || seen.borrow().len() == 3), "the server accepted exactly three");
    let mut names = seen.borrow().clone();
    names.sort();
    assert_eq!(names, [Some("compute-7".into()), Some("router".into()), Some("storage-1".into())]);
    assert_eq!(server.stats().added, 3, "a refused client costs the server no connection");
}

#[test]
fn a_client_ring_without_an_identity_fails_before_it_dials() {
    // Nothing listens at this address: the error is about the ring, not the network.
    let e = futures::executor::block_on(async {
        let fabric = Fabric::with_seed(1);
        let (ep, drv) = Endpoint::builder(
            fabric.add_device(DeviceConfig::spec()),
            Auth::Keyring(ring(&[("a", 1), ("b", 2)])),
        )
        .build()
        .unwrap();
        drop(drv);
        ep.connect("127.0.0.1:9".parse().unwrap()).await.map(|_| ()).unwrap_err()
    });
    assert!(matches!(e, SetupError::Bootstrap(BootstrapError::NoIdentity { keys: 2 })), "{e}");
}

fn file(name: &str, text: &str, mode: u32) -> util::TempFile {
    util::temp_file("keyring-test", name, text.as_bytes(), mode)
}

#[test]
fn a_keyring_file_loads_names_and_hex_keys() {
    let hex = |b: u8| format!("{b:02x}").repeat(16);
    let text = format!(
        "# mwcap keyring\n\nstorage-1 {}\r\n  compute-7\t{}  # the compute node\n# done\n",
        hex(0xab),
        hex(0x07).to_uppercase()
    );
    let r = Keyring::from_file(file("good", &text, 0o600)).unwrap();
    assert_eq!(r.names().collect::<Vec<_>>(), ["storage-1", "compute-7"]);
    let shown = format!("{r:?}");
    assert!(!shown.contains("abab") && !shown.contains("0707"), "{shown}");
    // The keys are the hex's bytes: a shared key of those bytes proves the name.
    assert!(r.clone().prove_as("compute-7").is_ok());
}

#[test]
fn a_bad_keyring_file_says_which_line_and_why() {
    let k16 = "00".repeat(16);
    let cases: &[(&str, String, &str)] = &[
        ("one-word", "storage-1\n".into(), "line 1: a line is NAME HEX-KEY"),
        ("three-words", format!("a {k16} extra\n"), "line 1: a line is NAME HEX-KEY"),
        ("not-hex", "# c\na zz\n".into(), "line 2: the key is not hex digits"),
        ("odd-hex", "a abc\n".into(), "line 1: the key is not hex digits"),
        ("short", "a 0011\n".into(), "2 bytes, fewer than 16; use at least 32 hex digits"),
        ("bad-name", format!("a/b {k16}\n"), "is not 1 to 64"),
        (
            "dup-name",
            format!("a {k16}\na {}\n", "11".repeat(16)),
            "line 2: the keyring already has a key named",
        ),
        ("dup-key", format!("a {k16}\nb {k16}\n"), "line 2: the key for \"b\" is the key of \"a\""),
        ("empty", "# nothing\n\n".into(), "holds no key"),
    ];
    for (name, text, want) in cases {
        let e = Keyring::from_file(file(name, text, 0o600)).unwrap_err();
        assert!(e.to_string().contains(want), "{name}: {e}");
    }
    #[cfg(unix)]
    {
        let e = Keyring::from_file(file("open", &format!("a {k16}\n"), 0o644)).unwrap_err();
        assert!(matches!(e, KeyError::OpenToAll { .. }), "{e}");
    }
}
