//! The seed corpus of the `bootstrap_decode` fuzz target is made of these
//! encodings (hellos and auth frames; the target feeds every input to both
//! decoders). This test checks that the committed files still match the
//! current encoder (and that each decodes as intended); after a change of the
//! wire format, regenerate them with
//! `MWCAP_WRITE_CORPUS=1 cargo test --test bootstrap_corpus`.

use std::path::PathBuf;

use mwcap::backend::QpEndpoint;
use mwcap::bootstrap::*;

fn endpoint(qpn: u32, gid: [u8; 16], psn: u32, mtu: u32, lid: u16) -> QpEndpoint {
    QpEndpoint { id: PEER_QP_ID, qpn, gid, psn, mtu, lid }
}

/// The seeds: a name, the bytes, and whether they decode (as a hello, or as
/// an auth frame for the names that start with `auth_` or `hello_tag`).
fn seeds() -> Vec<(&'static str, Vec<u8>, Result<(), DecodeError>)> {
    let rxe_gid = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1];
    let ib_gid = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x50, 0x6b, 0x4b, 0x03, 0x00, 0x12, 0x34, 0x56];
    let rxe =
        Hello { endpoint: endpoint(0x11, rxe_gid, 0x12345, 1024, 0), caps: Capabilities::new(), conn_id: 1 };
    let ib = Hello {
        endpoint: endpoint(0x1234, ib_gid, 0, 4096, 0x12),
        caps: Capabilities { serve: PolicySet::CONFIRM, read: PolicySet::BOTH, ..Capabilities::new() },
        conn_id: 0xdead_beef_0bad_f00d,
    };
    let smallest = Hello {
        endpoint: endpoint(2, rxe_gid, 0, 256, 0),
        caps: Capabilities {
            serve: PolicySet::NONE,
            read: PolicySet::MW,
            max_message: 1,
            start_credits: MIN_START_CREDITS,
            lease_ms: 1,
            features: Features::default(),
        },
        conn_id: 0,
    };
    let largest = Hello {
        endpoint: endpoint(0xff_ffff, [0xff; 16], 0xff_ffff, 4096, u16::MAX),
        caps: Capabilities {
            serve: PolicySet::BOTH,
            read: PolicySet::BOTH,
            max_message: u32::MAX,
            start_credits: u32::MAX,
            lease_ms: u32::MAX,
            features: Features { required: 0, optional: u16::MAX },
        },
        conn_id: u64::MAX,
    };
    let with_version = |v: u16| {
        let mut bytes = encode(&rxe);
        bytes[4..6].copy_from_slice(&v.to_be_bytes());
        bytes
    };
    let nonce: [u8; NONCE_LEN] = std::array::from_fn(|i| i as u8);
    let mac: [u8; MAC_LEN] = std::array::from_fn(|i| 0xff - i as u8);
    let mut bad_mode = encode_auth(&AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce });
    bad_mode[HEADER_LEN] = 9;
    vec![
        ("hello_rxe_loopback", encode(&rxe), Ok(())),
        ("hello_ib_confirm_serve", encode(&ib), Ok(())),
        ("hello_smallest", encode(&smallest), Ok(())),
        ("hello_largest", encode(&largest), Ok(())),
        (
            "hello_version_1",
            with_version(1),
            Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 1 }),
        ),
        (
            "hello_version_2",
            with_version(2),
            Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 2 }),
        ),
        (
            "hello_version_3",
            with_version(3),
            Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 3 }),
        ),
        (
            "hello_version_5",
            with_version(5),
            Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 5 }),
        ),
        ("auth_init_key", encode_auth(&AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce }), Ok(())),
        ("auth_init_none", encode_auth(&AuthFrame::Init { mode: AuthMode::Unauthenticated, nonce }), Ok(())),
        (
            "auth_challenge_key",
            encode_auth(&AuthFrame::Challenge { mode: AuthMode::PreSharedKey, nonce }),
            Ok(()),
        ),
        ("auth_proof", encode_auth(&AuthFrame::Proof(mac)), Ok(())),
        ("auth_reject_bad_proof", encode_auth(&AuthFrame::Reject(RejectReason::BadProof)), Ok(())),
        (
            "auth_init_bad_mode",
            bad_mode,
            Err(DecodeError::InvalidField {
                field: "auth mode",
                value: 9,
                expected: "0 (no key) or 1 (pre-shared key)",
            }),
        ),
        ("hello_tag", encode_auth(&AuthFrame::HelloTag(mac)), Ok(())),
    ]
}

#[test]
fn seed_corpus_matches_the_encoder() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/bootstrap_decode");
    let write = std::env::var_os("MWCAP_WRITE_CORPUS").is_some();
    if write {
        std::fs::create_dir_all(&dir).unwrap();
    }
    for (name, bytes, expect) in seeds() {
        if name.starts_with("auth_") || name == "hello_tag" {
            assert_eq!(decode_auth(&bytes).map(|_| ()), expect, "{name}");
        } else {
            assert_eq!(decode(&bytes).map(|_| ()), expect, "{name}");
        }
        let path = dir.join(name);
        if write {
            std::fs::write(&path, &bytes).unwrap();
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e}; run MWCAP_WRITE_CORPUS=1 cargo test --test bootstrap_corpus", path.display())
        });
        assert!(
            committed == bytes,
            "{} is stale; run MWCAP_WRITE_CORPUS=1 cargo test --test bootstrap_corpus",
            path.display()
        );
    }
}
