//! The bootstrap hello codec: exact errors for each kind of bad input,
//! round trips, the streaming decoder, negotiation, and proptests.

use std::time::Duration;

use mwcap::backend::QpEndpoint;
use mwcap::bootstrap::*;
use proptest::prelude::*;

fn rxe_hello() -> Hello {
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&[127, 0, 0, 1]);
    Hello {
        endpoint: QpEndpoint { id: PEER_QP_ID, qpn: 0x11, gid, psn: 0x00ab_cdef, mtu: 1024, lid: 0 },
        caps: Capabilities::new(),
        conn_id: 0x0123_4567_89ab_cdef,
    }
}

/// Offsets of fields in an encoded hello.
const VERSION: usize = 4;
const KIND: usize = 6;
const LEN: usize = 7;
const QPN: usize = HEADER_LEN + 8;
const PSN: usize = QPN + 4;
const MTU: usize = PSN + 4;
const GID: usize = MTU + 4;
const SERVE: usize = GID + 16;
const REQUIRED: usize = SERVE + 2;
const OPTIONAL: usize = REQUIRED + 2;
const MAX_MESSAGE: usize = OPTIONAL + 2;
const LEASE: usize = MAX_MESSAGE + 8;

fn put(bytes: &mut [u8], at: usize, value: &[u8]) {
    bytes[at..at + value.len()].copy_from_slice(value);
}

fn encoded_with(at: usize, value: &[u8]) -> Vec<u8> {
    let mut bytes = encode(&rxe_hello());
    put(&mut bytes, at, value);
    bytes
}

#[test]
fn round_trip_and_layout() {
    let hello = rxe_hello();
    let bytes = encode(&hello);
    assert_eq!(bytes.len(), HEADER_LEN + HELLO_BODY_LEN);
    assert_eq!(&bytes[..4], &MAGIC);
    assert_eq!(&bytes[VERSION..VERSION + 2], &PROTOCOL_VERSION.to_be_bytes());
    assert_eq!(&bytes[QPN..QPN + 4], &0x11u32.to_be_bytes());
    assert_eq!(&bytes[LEASE..LEASE + 4], &1000u32.to_be_bytes());
    assert_eq!(decode(&bytes), Ok(hello));
}

#[test]
fn a_stranger_is_not_an_mwcap_peer() {
    let e = decode(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap_err();
    assert_eq!(e, DecodeError::NotMwcap { prefix: b"HTTP".to_vec() });
    assert!(e.to_string().contains("not an mwcap peer"), "{e}");
    // Recognised from the first wrong byte, without waiting for four.
    assert_eq!(decode(b"MX"), Err(DecodeError::NotMwcap { prefix: b"MX".to_vec() }));
    assert_eq!(decode(b""), Err(DecodeError::Truncated { needed: HEADER_LEN }));
}

#[test]
fn another_version_is_a_version_mismatch_even_with_a_different_body() {
    let e = decode(&encoded_with(VERSION, &3u16.to_be_bytes())).unwrap_err();
    assert_eq!(e, DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 3 });
    // Version 1 (no auth phase) is refused the same way.
    let e = decode(&encoded_with(VERSION, &1u16.to_be_bytes())).unwrap_err();
    assert_eq!(e, DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 1 });
    assert!(e.to_string().contains("upgrade"), "{e}");
    // A future version's header with a longer body and another kind: still the version that is reported.
    let future = [b'M', b'W', b'C', b'P', 0, 7, 9, 0xff, 0xff];
    assert_eq!(decode(&future), Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 7 }));
    assert_eq!(decode(&future[..6]), Err(DecodeError::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 7 }));
}

#[test]
fn every_prefix_is_truncated() {
    let bytes = encode(&rxe_hello());
    for len in 0..bytes.len() {
        // Before the header is complete, the body's length is not known yet.
        let needed = if len < HEADER_LEN { HEADER_LEN - len } else { bytes.len() - len };
        assert_eq!(decode(&bytes[..len]), Err(DecodeError::Truncated { needed }), "{len}");
    }
}

#[test]
fn trailing_bytes_are_rejected() {
    let mut bytes = encode(&rxe_hello());
    bytes.push(0);
    assert_eq!(decode(&bytes), Err(DecodeError::TrailingBytes(1)));
}

#[test]
fn lengths_are_capped_and_checked_before_the_body() {
    let header = |len: u16| {
        let mut h = encode(&rxe_hello())[..HEADER_LEN].to_vec();
        put(&mut h, LEN, &len.to_be_bytes());
        h
    };
    assert_eq!(decode(&header(0xffff)), Err(DecodeError::FrameTooLarge { len: 0xffff, max: MAX_BODY_LEN }));
    assert_eq!(
        decode(&header(MAX_BODY_LEN as u16 + 1)),
        Err(DecodeError::FrameTooLarge { len: MAX_BODY_LEN + 1, max: MAX_BODY_LEN })
    );
    assert_eq!(decode(&header(53)), Err(DecodeError::BadLength { got: 53, expected: HELLO_BODY_LEN }));
    assert_eq!(decode(&encoded_with(KIND, &[7])), Err(DecodeError::UnknownKind(7)));
    // An auth frame where the hello belongs is named as such, before its length is read.
    assert_eq!(
        decode(&encoded_with(KIND, &[4])[..KIND + 1]),
        Err(DecodeError::UnexpectedFrame { got: "an auth proof", expected: "a hello" })
    );
}

#[test]
fn invalid_mtus_are_rejected() {
    for mtu in [0u16, 128, 1000, 1500, 8192, 0xffff] {
        assert_eq!(decode(&encoded_with(MTU, &mtu.to_be_bytes())), Err(DecodeError::InvalidMtu(mtu.into())));
    }
    for mtu in VALID_MTUS {
        let h = decode(&encoded_with(MTU, &(mtu as u16).to_be_bytes())).unwrap();
        assert_eq!(h.endpoint.mtu, mtu);
    }
}

#[test]
fn an_all_zero_gid_is_rejected() {
    assert_eq!(decode(&encoded_with(GID, &[0; 16])), Err(DecodeError::ZeroGid));
}

#[test]
fn qpn_psn_and_limits_are_range_checked() {
    for qpn in [0u32, 1, 0x0100_0000, u32::MAX] {
        let e = decode(&encoded_with(QPN, &qpn.to_be_bytes())).unwrap_err();
        assert!(
            matches!(e, DecodeError::InvalidField { field: "qpn", value, .. } if value == u64::from(qpn))
        );
    }
    let e = decode(&encoded_with(PSN, &0x0100_0000u32.to_be_bytes())).unwrap_err();
    assert!(matches!(e, DecodeError::InvalidField { field: "psn", .. }), "{e:?}");
    for (at, field) in [(MAX_MESSAGE, "max_message"), (LEASE, "lease_ms")] {
        let e = decode(&encoded_with(at, &0u32.to_be_bytes())).unwrap_err();
        assert_eq!(e, DecodeError::InvalidField { field, value: 0, expected: "at least 1" });
    }
    // Fewer than 3 start credits could stall the peer's flow control.
    for credits in [0u32, 1, 2] {
        let e = decode(&encoded_with(MAX_MESSAGE + 4, &credits.to_be_bytes())).unwrap_err();
        let value = u64::from(credits);
        assert_eq!(e, DecodeError::InvalidField { field: "start_credits", value, expected: "at least 3" });
    }
    let h = decode(&encoded_with(MAX_MESSAGE + 4, &3u32.to_be_bytes())).unwrap();
    assert_eq!(h.caps.start_credits, MIN_START_CREDITS);
}

#[test]
fn unknown_required_features_fail_unknown_optional_ones_pass() {
    let e = decode(&encoded_with(REQUIRED, &0x0004u16.to_be_bytes())).unwrap_err();
    assert_eq!(e, DecodeError::UnknownRequiredFeatures(0x0004));
    assert!(e.to_string().contains("upgrade this side"), "{e}");
    let h = decode(&encoded_with(OPTIONAL, &0x8001u16.to_be_bytes())).unwrap();
    assert_eq!(h.caps.features, Features { required: 0, optional: 0x8001 });
}

#[test]
fn unknown_policy_bits_are_dropped() {
    let h = decode(&encoded_with(SERVE, &[0xfe, 0xfd])).unwrap();
    assert_eq!(h.caps.serve, PolicySet::CONFIRM);
    assert_eq!(h.caps.read, PolicySet::MW);
}

#[test]
fn validate_names_the_bad_field_of_a_local_hello() {
    let mut h = rxe_hello();
    assert_eq!(h.validate(), Ok(()));
    h.endpoint.mtu = 9000;
    assert_eq!(h.validate(), Err(DecodeError::InvalidMtu(9000)));
    // An MTU too large for the wire's u16 reaches the peer as invalid, not truncated to something valid.
    h.endpoint.mtu = 0x1_0400;
    assert_eq!(decode(&encode(&h)), Err(DecodeError::InvalidMtu(0)));
}

#[test]
fn hello_new_picks_fresh_connection_ids() {
    let a = Hello::new(rxe_hello().endpoint, Capabilities::new());
    let b = Hello::new(rxe_hello().endpoint, Capabilities::new());
    assert_ne!(a.conn_id, b.conn_id);
}

#[test]
fn streaming_byte_by_byte_matches_and_stops_at_the_frame_end() {
    let hello = rxe_hello();
    let mut bytes = encode(&hello);
    bytes.extend_from_slice(&[READY_BYTE, 1, 2, 3]);
    let mut d = HelloDecoder::new();
    assert_eq!(d.wanted(), HEADER_LEN);
    for (i, b) in bytes.iter().enumerate() {
        let taken = d.feed(std::slice::from_ref(b)).unwrap();
        assert_eq!(taken, usize::from(i < HEADER_LEN + HELLO_BODY_LEN), "byte {i}");
        assert_eq!(
            d.wanted(),
            if i + 1 < HEADER_LEN {
                HEADER_LEN - i - 1
            } else {
                (HEADER_LEN + HELLO_BODY_LEN).saturating_sub(i + 1)
            }
        );
    }
    assert_eq!(d.hello(), Some(&hello));
    assert_eq!(d.consumed(), HEADER_LEN + HELLO_BODY_LEN);
    assert_eq!(d.wanted(), 0);
    // All at once: takes the frame and leaves the ready byte.
    let mut d = HelloDecoder::new();
    assert_eq!(d.feed(&bytes), Ok(HEADER_LEN + HELLO_BODY_LEN));
    assert_eq!(d.hello(), Some(&hello));
}

#[test]
fn streaming_fails_on_the_first_wrong_byte_and_stays_failed() {
    let mut d = HelloDecoder::new();
    assert_eq!(d.feed(b"M"), Ok(1));
    assert_eq!(d.feed(b"Z"), Err(DecodeError::NotMwcap { prefix: b"MZ".to_vec() }));
    assert_eq!(d.wanted(), 0);
    assert_eq!(d.feed(b"WCP"), Err(DecodeError::NotMwcap { prefix: b"MZ".to_vec() }));
    assert_eq!(d.hello(), None);
}

#[test]
fn streaming_header_announces_the_body_before_it_arrives() {
    let bytes = encode(&rxe_hello());
    let mut d = HelloDecoder::new();
    assert_eq!(d.feed(&bytes[..5]), Ok(5));
    assert_eq!(d.wanted(), HEADER_LEN - 5);
    assert_eq!(d.feed(&bytes[5..HEADER_LEN]), Ok(HEADER_LEN - 5));
    assert_eq!(d.wanted(), HELLO_BODY_LEN);
}

fn with_caps(serve: PolicySet, read: PolicySet, mtu: u32) -> Hello {
    let mut h = rxe_hello();
    h.caps.serve = serve;
    h.caps.read = read;
    h.endpoint.mtu = mtu;
    h
}

#[test]
fn negotiation_takes_the_smaller_mtu_and_limits() {
    let mut a = with_caps(PolicySet::BOTH, PolicySet::BOTH, 4096);
    let mut b = with_caps(PolicySet::BOTH, PolicySet::BOTH, 1024);
    a.caps.max_message = 1 << 20;
    b.caps.lease_ms = 250;
    let n = negotiate(&a, &b).unwrap();
    assert_eq!((n.mtu, n.max_message), (1024, 64 * 1024));
    assert_eq!(n.lease, Duration::from_millis(250));
    assert_eq!((n.we_expose, n.peer_exposes), (Some(Policy::Mw), Some(Policy::Mw)));
}

#[test]
fn negotiation_picks_a_policy_per_direction() {
    // a serves both but b reads only confirm; b serves only mw and a reads both.
    let a = with_caps(PolicySet::BOTH, PolicySet::BOTH, 1024);
    let b = with_caps(PolicySet::MW, PolicySet::CONFIRM, 1024);
    let n = negotiate(&a, &b).unwrap();
    assert_eq!((n.we_expose, n.peer_exposes), (Some(Policy::Confirm), Some(Policy::Mw)));
    // One-way: b exposes nothing.
    let b = with_caps(PolicySet::NONE, PolicySet::CONFIRM, 1024);
    let n = negotiate(&a, &b).unwrap();
    assert_eq!((n.we_expose, n.peer_exposes), (Some(Policy::Confirm), None));
}

#[test]
fn negotiation_without_a_common_policy_fails() {
    let a = with_caps(PolicySet::MW, PolicySet::MW, 1024);
    let b = with_caps(PolicySet::CONFIRM, PolicySet::CONFIRM, 1024);
    let e = negotiate(&a, &b).unwrap_err();
    assert!(matches!(e, BootstrapError::NoCommonPolicy { .. }), "{e:?}");
    assert!(e.to_string().contains("enable confirm"), "{e}");
}

// ---- proptest ----

fn policy_sets() -> impl Strategy<Value = PolicySet> {
    any::<u8>().prop_map(PolicySet::from_bits_truncate)
}

fn hellos() -> impl Strategy<Value = Hello> {
    let endpoint =
        (2u32..=0xff_ffff, 0u32..=0xff_ffff, prop::sample::select(VALID_MTUS.to_vec()), any::<u16>())
            .prop_flat_map(|(qpn, psn, mtu, lid)| {
                any::<[u8; 16]>()
                    .prop_filter("non-zero gid", |g| *g != [0; 16])
                    .prop_map(move |gid| QpEndpoint { id: PEER_QP_ID, qpn, gid, psn, mtu, lid })
            });
    let caps = (policy_sets(), policy_sets(), 1u32.., MIN_START_CREDITS.., 1u32.., any::<u16>()).prop_map(
        |(serve, read, max_message, start_credits, lease_ms, optional)| Capabilities {
            serve,
            read,
            max_message,
            start_credits,
            lease_ms,
            features: Features { required: 0, optional },
        },
    );
    (endpoint, caps, any::<u64>()).prop_map(|(endpoint, caps, conn_id)| Hello { endpoint, caps, conn_id })
}

/// Bytes that start with a valid header prefix more often than chance would.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..400),
        (0usize..=HEADER_LEN, prop::collection::vec(any::<u8>(), 0..100)).prop_map(|(keep, rest)| {
            let mut v = encode(&rxe_hello())[..keep].to_vec();
            v.extend(rest);
            v
        }),
    ]
}

/// Feed `bytes` to a streaming decoder in pieces cut at `cuts`, as short reads would.
fn feed_in_pieces(bytes: &[u8], cuts: &[usize]) -> (HelloDecoder, Result<(), DecodeError>) {
    let mut d = HelloDecoder::new();
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    ends.push(bytes.len());
    ends.sort_unstable();
    let mut start = 0;
    for end in ends {
        if let Err(e) = d.feed(&bytes[start..end]) {
            return (d, Err(e));
        }
        start = end;
    }
    (d, Ok(()))
}

proptest! {
    #[test]
    fn prop_round_trip(hello in hellos()) {
        let bytes = encode(&hello);
        prop_assert_eq!(bytes.len(), HEADER_LEN + HELLO_BODY_LEN);
        prop_assert_eq!(decode(&bytes), Ok(hello));
    }

    #[test]
    fn prop_arbitrary_bytes_never_panic(bytes in hostile_bytes()) {
        if let Ok(h) = decode(&bytes) {
            prop_assert_eq!(encode(&h).len(), bytes.len());
        }
        let mut d = HelloDecoder::new();
        let _ = d.feed(&bytes);
        prop_assert!(d.consumed() <= MAX_FRAME_LEN);
    }

    #[test]
    fn prop_one_byte_corruption_is_an_error_or_a_valid_hello(
        hello in hellos(), at in 0usize..HEADER_LEN + HELLO_BODY_LEN, x in 1u8..,
    ) {
        let mut bytes = encode(&hello);
        bytes[at] ^= x;
        if let Ok(h) = decode(&bytes) {
            prop_assert_eq!(h.validate(), Ok(()));
        }
    }

    #[test]
    fn prop_streaming_in_any_pieces_equals_one_shot(
        hello in hellos(), cuts in prop::collection::vec(any::<usize>(), 0..8), tail in prop::collection::vec(any::<u8>(), 0..4),
    ) {
        let mut bytes = encode(&hello);
        let frame = bytes.len();
        bytes.extend(tail);
        let (d, res) = feed_in_pieces(&bytes, &cuts);
        prop_assert_eq!(res, Ok(()));
        prop_assert_eq!(d.hello(), Some(&hello));
        prop_assert_eq!(d.consumed(), frame);
    }

    #[test]
    fn prop_streaming_garbage_fails_like_one_shot(
        bytes in hostile_bytes(), cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let (d, res) = feed_in_pieces(&bytes, &cuts);
        let taken = &bytes[..d.consumed()];
        match (res, d.hello()) {
            (Err(e), _) => prop_assert_eq!(decode(taken), Err(e)),
            (Ok(()), Some(h)) => prop_assert_eq!(decode(taken), Ok(*h)),
            (Ok(()), None) => {
                prop_assert_eq!(d.consumed(), bytes.len());
                let truncated = matches!(decode(taken), Err(DecodeError::Truncated { .. }));
                prop_assert!(truncated);
            }
        }
    }

    #[test]
    fn prop_negotiation_is_symmetric(a in hellos(), b in hellos()) {
        match (negotiate(&a, &b), negotiate(&b, &a)) {
            (Ok(ab), Ok(ba)) => {
                prop_assert_eq!((ab.mtu, ab.max_message, ab.lease), (ba.mtu, ba.max_message, ba.lease));
                prop_assert_eq!((ab.we_expose, ab.peer_exposes), (ba.peer_exposes, ba.we_expose));
                prop_assert!(VALID_MTUS.contains(&ab.mtu));
            }
            (Err(_), Err(_)) => {}
            (x, y) => prop_assert!(false, "asymmetric: {:?} / {:?}", x, y),
        }
    }
}
