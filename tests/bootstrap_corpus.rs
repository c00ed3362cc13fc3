//! The seed corpus of the `bootstrap_decode` fuzz target is made of these
//! encodings. This test checks that the committed files still match the
//! current encoder (and that each decodes as intended); after a change of the
//! wire format, regenerate them with
//! `MWCAP_WRITE_CORPUS=1 cargo test --test bootstrap_corpus`.

use std::path::PathBuf;

use mwcap::backend::QpEndpoint;
use mwcap::bootstrap::*;

fn endpoint(qpn: u32, gid: [u8; 16], psn: u32, mtu: u32, lid: u16) -> QpEndpoint {
    QpEndpoint { id: PEER_QP_ID, qpn, gid, psn, mtu, lid }
}

/// The seeds: a name, the bytes, and whether they decode.
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
            queue_depth: 1,
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
            queue_depth: u32::MAX,
            lease_ms: u32::MAX,
            features: Features { required: 0, optional: u16::MAX },
        },
        conn_id: u64::MAX,
    };
    let mut future = encode(&rxe);
    future[4..6].copy_from_slice(&2u16.to_be_bytes());
    vec![
        ("hello_rxe_loopback", encode(&rxe), Ok(())),
        ("hello_ib_confirm_serve", encode(&ib), Ok(())),
        ("hello_smallest", encode(&smallest), Ok(())),
        ("hello_largest", encode(&largest), Ok(())),
        ("hello_version_2", future, Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 2 })),
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
        assert_eq!(decode(&bytes).map(|_| ()), expect, "{name}");
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
