//! The auth state machine without sockets: both ends fed each other's
//! frames, fixed nonces, and frames an attacker without the key can send.

use proptest::prelude::*;

use super::*;

const NC: Nonce = [1; NONCE_LEN];
const NS: Nonce = [2; NONCE_LEN];

fn key(fill: u8) -> Auth {
    Auth::Key(Key::from_bytes(vec![fill; 32]).unwrap())
}

/// Run a client and a server against each other until neither has
/// anything to send; returns each side's outcome and the frames that
/// crossed, in order.
fn run(
    client: &Auth,
    server: &Auth,
) -> (Result<Session, AuthFailure>, Result<Session, AuthFailure>, Vec<AuthFrame>) {
    let mut c = Machine::client(client, NC).unwrap();
    let mut s = Machine::server(server, NS);
    let (mut c_err, mut s_err) = (None, None);
    let mut wire = Vec::new();
    for _ in 0..10 {
        let mut moved = false;
        while let Some(f) = c.poll_transmit() {
            wire.push(f);
            moved = true;
            if s_err.is_none() {
                s_err = s.handle_frame(f).err();
            }
        }
        while let Some(f) = s.poll_transmit() {
            wire.push(f);
            moved = true;
            if c_err.is_none() {
                c_err = c.handle_frame(f).err();
            }
        }
        if !moved {
            break;
        }
    }
    let outcome = |m: &Machine, e: Option<AuthFailure>| match e {
        Some(e) => Err(e),
        None => Ok(m.session().expect("neither failed nor done")),
    };
    (outcome(&c, c_err), outcome(&s, s_err), wire)
}

#[test]
fn the_same_key_authenticates_both_sides_in_four_frames() {
    let (c, s, wire) = run(&key(7), &key(7));
    let (c, s) = (c.unwrap(), s.unwrap());
    assert!(c.is_keyed() && s.is_keyed());
    assert!(matches!(
        wire.as_slice(),
        [AuthFrame::Init { .. }, AuthFrame::Challenge { .. }, AuthFrame::Proof(_), AuthFrame::Proof(_)]
    ));
    // Each checks the other's hello tag, and neither accepts its own back.
    let (hc, hs) = (b"client hello frame", b"server hello frame");
    assert!(s.check_hello_tag(hc, &c.hello_tag(hc).unwrap()));
    assert!(c.check_hello_tag(hs, &s.hello_tag(hs).unwrap()));
    assert!(!c.check_hello_tag(hc, &c.hello_tag(hc).unwrap()), "a tag reflected to its sender");
    // A hello altered on the way fails its tag.
    assert!(!s.check_hello_tag(b"client hello framE", &c.hello_tag(hc).unwrap()));
}

#[test]
fn without_keys_on_both_sides_two_frames_and_no_tags() {
    let (c, s, wire) = run(&Auth::Unauthenticated, &Auth::Unauthenticated);
    let (c, s) = (c.unwrap(), s.unwrap());
    assert!(!c.is_keyed() && !s.is_keyed());
    assert_eq!(wire.len(), 2);
    assert_eq!(c.hello_tag(b"x"), None);
}

#[test]
fn different_keys_fail_on_both_sides() {
    let (c, s, wire) = run(&key(7), &key(8));
    assert_eq!(s.unwrap_err(), AuthFailure::ProofInvalid);
    assert_eq!(c.unwrap_err(), AuthFailure::ProofRejected);
    // The server proved nothing to a client that did not prove the key.
    assert_eq!(wire.last(), Some(&AuthFrame::Reject(RejectReason::BadProof)));
    assert_eq!(wire.iter().filter(|f| matches!(f, AuthFrame::Proof(_))).count(), 1);
}

#[test]
fn a_key_on_one_side_only_fails_on_both_with_the_mismatch_named() {
    let (c, s, _) = run(&key(7), &Auth::Unauthenticated);
    assert_eq!(c.unwrap_err(), AuthFailure::PeerUnauthenticated);
    assert_eq!(s.unwrap_err(), AuthFailure::PeerRequiresKey);
    let (c, s, wire) = run(&Auth::Unauthenticated, &key(7));
    assert_eq!(c.unwrap_err(), AuthFailure::PeerRequiresKey);
    assert_eq!(s.unwrap_err(), AuthFailure::PeerUnauthenticated);
    assert_eq!(
        wire,
        vec![
            AuthFrame::Init { mode: AuthMode::Unauthenticated, nonce: NC },
            AuthFrame::Reject(RejectReason::KeyRequired)
        ]
    );
}

#[test]
fn proofs_match_an_independent_hmac_sha256() {
    // Computed with Python's hmac module over the documented layout.
    let k = Key::from_bytes((0..32).collect::<Vec<u8>>()).unwrap();
    let hex =
        |m: Hmac<Sha256>| m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert_eq!(
        hex(mac(&k, PROOF_LABEL, End::Client, (&NC, &NS), &[])),
        "7a7e5c9d9c9b65c54b63179ba5503ed5cfba37fa0df81ea0e6c9dae720ec6bf1"
    );
    assert_eq!(
        hex(mac(&k, PROOF_LABEL, End::Server, (&NC, &NS), &[])),
        "fd4fe55878782a43bd0491f3710a9c9de0e65c39ce2168fc71171e336b48c375"
    );
}

#[test]
fn a_client_proof_reflected_as_the_server_proof_is_refused() {
    let k = key(7);
    let mut c = Machine::client(&k, NC).unwrap();
    let _init = c.poll_transmit();
    // A fake server without the key sends a challenge, takes the client's
    // proof and sends it back as its own.
    c.handle_frame(AuthFrame::Challenge { mode: AuthMode::PreSharedKey, nonce: NS }).unwrap();
    let Some(AuthFrame::Proof(pc)) = c.poll_transmit() else { panic!("the client proves first") };
    assert_eq!(c.handle_frame(AuthFrame::Proof(pc)), Err(AuthFailure::ProofInvalid));
    assert!(c.session().is_none());
}

#[test]
fn a_recorded_client_transcript_fails_against_a_fresh_server_nonce() {
    let k = key(7);
    let (c, s, wire) = run(&k, &k);
    assert!(c.is_ok() && s.is_ok(), "the recorded session itself succeeded");
    // Replay the client's frames (init and proof) to a server with a new nonce.
    let mut s = Machine::server(&k, [3; NONCE_LEN]);
    s.handle_frame(wire[0]).unwrap();
    assert!(matches!(s.poll_transmit(), Some(AuthFrame::Challenge { .. })));
    assert_eq!(s.handle_frame(wire[2]), Err(AuthFailure::ProofInvalid));
    assert_eq!(s.poll_transmit(), Some(AuthFrame::Reject(RejectReason::BadProof)));
    assert!(s.session().is_none());
}

#[test]
fn frames_out_of_order_are_unexpected_and_final() {
    let mut s = Machine::server(&key(7), NS);
    let e = s.handle_frame(AuthFrame::Proof([0; MAC_LEN])).unwrap_err();
    assert_eq!(e, AuthFailure::Unexpected { got: "an auth proof", expected: "an auth init" });
    // Failed stays failed.
    assert!(s.handle_frame(AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: NC }).is_err());
    assert!(s.session().is_none());
}

fn frames() -> impl Strategy<Value = AuthFrame> {
    let mode = prop_oneof![Just(AuthMode::Unauthenticated), Just(AuthMode::PreSharedKey)];
    let reason =
        prop_oneof![Just(RejectReason::KeyRequired), Just(RejectReason::NoKey), Just(RejectReason::BadProof)];
    prop_oneof![
        (mode.clone(), any::<[u8; NONCE_LEN]>()).prop_map(|(mode, nonce)| AuthFrame::Init { mode, nonce }),
        (mode, any::<[u8; NONCE_LEN]>()).prop_map(|(mode, nonce)| AuthFrame::Challenge { mode, nonce }),
        any::<[u8; MAC_LEN]>().prop_map(AuthFrame::Proof),
        reason.prop_map(AuthFrame::Reject),
        any::<[u8; MAC_LEN]>().prop_map(AuthFrame::HelloTag),
    ]
}

proptest! {
    /// A peer without the key, sending anything in any order, never gets a
    /// keyed session out of a server with a key, and the server sends it
    /// nothing computed from the key (only a challenge or a reject).
    #[test]
    fn prop_no_session_and_no_keyed_output_without_the_key(input in prop::collection::vec(frames(), 0..8)) {
        let mut s = Machine::server(&key(7), NS);
        for f in input {
            let failed = s.handle_frame(f).is_err();
            while let Some(out) = s.poll_transmit() {
                prop_assert!(matches!(out, AuthFrame::Challenge { .. } | AuthFrame::Reject(_)), "{out:?}");
            }
            prop_assert!(s.session().is_none());
            if failed {
                break;
            }
        }
    }
}

fn raw(fill: u8) -> Key {
    Key::from_bytes(vec![fill; 32]).unwrap()
}

fn ring(entries: &[(&str, u8)]) -> Keyring {
    let mut r = Keyring::new();
    for &(name, fill) in entries {
        r.insert(name, raw(fill)).unwrap();
    }
    r
}

use super::super::key::Keyring;

#[test]
fn a_server_keyring_names_each_client_by_the_key_it_proved() {
    let server = Auth::Keyring(ring(&[("storage-1", 1), ("compute-7", 7), ("router", 9)]));
    for (name, fill) in [("compute-7", 7), ("router", 9), ("storage-1", 1)] {
        // The client holds only its own key, or a ring that names it.
        for client in [
            Auth::Keyring(ring(&[(name, fill)])),
            Auth::Keyring(ring(&[("other", 42), (name, fill)]).prove_as(name).unwrap()),
        ] {
            let (c, s, wire) = run(&client, &server);
            let (c, s) = (c.unwrap(), s.unwrap());
            assert_eq!(s.identity().map(|n| &**n), Some(name), "the server names the client");
            assert_eq!(c.identity().map(|n| &**n), Some(name), "and the client the key both proved");
            assert_eq!(wire.len(), 4);
            let h = b"client hello";
            assert!(s.check_hello_tag(h, &c.hello_tag(h).unwrap()), "the tags are under the proved key");
        }
    }
}

#[test]
fn a_key_not_in_the_servers_ring_is_refused_and_a_shared_key_is_one_identity() {
    let server = Auth::Keyring(ring(&[("storage-1", 1), ("compute-7", 7)]));
    let (c, s, wire) = run(&Auth::Keyring(ring(&[("compute-7", 8)])), &server);
    assert_eq!(s.unwrap_err(), AuthFailure::ProofInvalid, "the name is not what is checked: the key is");
    assert_eq!(c.unwrap_err(), AuthFailure::ProofRejected);
    assert!(matches!(wire.last(), Some(AuthFrame::Reject(RejectReason::BadProof))));
    // One shared key on both sides: everyone is SHARED_IDENTITY.
    let (c, s, _) = run(&key(5), &key(5));
    assert_eq!(s.unwrap().identity().map(|n| &**n), Some(SHARED_IDENTITY));
    assert_eq!(c.unwrap().identity().map(|n| &**n), Some(SHARED_IDENTITY));
    // A shared key on the client and a ring holding it under a name: the name.
    let (_, s, _) = run(&key(7), &server);
    assert_eq!(s.unwrap().identity().map(|n| &**n), Some("compute-7"));
    // An empty ring on a server runs keyed and accepts no one.
    let (_, s, _) = run(&key(7), &Auth::Keyring(Keyring::new()));
    assert_eq!(s.unwrap_err(), AuthFailure::ProofInvalid);
}

#[test]
fn a_client_ring_of_several_keys_must_say_which_it_proves() {
    let r = ring(&[("a", 1), ("b", 2)]);
    let e = Machine::client(&Auth::Keyring(r.clone()), NC).unwrap_err();
    assert!(matches!(e, BootstrapError::NoIdentity { keys: 2 }), "{e}");
    assert!(e.to_string().contains("prove_as"), "{e}");
    let e = Machine::client(&Auth::Keyring(Keyring::new()), NC).unwrap_err();
    assert!(e.to_string().contains("the keyring is empty"), "{e}");
    assert!(matches!(r.prove_as("c"), Err(KeyError::UnknownName { .. })));
}

#[test]
fn a_keyring_refuses_bad_names_duplicates_and_one_key_under_two_names() {
    let mut r = ring(&[("a", 1)]);
    assert!(matches!(r.insert("a", raw(2)), Err(KeyError::DuplicateName { .. })));
    assert!(matches!(r.insert("b", raw(1)), Err(KeyError::SameKeyTwice { .. })));
    for bad in ["", "has space", "slash/", &"x".repeat(Keyring::MAX_NAME_LEN + 1), "é"] {
        assert!(matches!(r.insert(bad, raw(3)), Err(KeyError::BadName { .. })), "{bad:?}");
    }
    // Keys HMAC makes one key: K and K followed by zeros; a key longer than
    // the block and its SHA-256.
    let k = vec![5u8; 20];
    r.insert("k", Key::from_bytes(k.clone()).unwrap()).unwrap();
    let padded = [k.clone(), vec![0; 7]].concat();
    assert!(matches!(r.insert("k0", Key::from_bytes(padded).unwrap()), Err(KeyError::SameKeyTwice { .. })));
    let long = vec![6u8; 100];
    use sha2::Digest;
    r.insert("long", Key::from_bytes(long.clone()).unwrap()).unwrap();
    let hashed = sha2::Sha256::digest(&long).to_vec();
    assert!(matches!(
        r.insert("hashed", Key::from_bytes(hashed).unwrap()),
        Err(KeyError::SameKeyTwice { .. })
    ));
    r.insert("node-2.rack_1@dc", raw(3)).unwrap();
    assert_eq!(r.names().collect::<Vec<_>>(), ["a", "k", "long", "node-2.rack_1@dc"]);
    assert!(!format!("{r:?}").contains("0101"), "Debug shows names, never keys: {r:?}");
}

use super::super::key::KeyError;
