//! The auth frames' codec: layout, exact errors for bad input, the
//! streaming decoder, and proptests over hostile bytes.

use mwcap::bootstrap::*;
use proptest::prelude::*;

const NONCE: [u8; NONCE_LEN] = [0x11; NONCE_LEN];
const MAC: [u8; MAC_LEN] = [0x22; MAC_LEN];

fn all_frames() -> Vec<AuthFrame> {
    vec![
        AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: NONCE },
        AuthFrame::Init { mode: AuthMode::Unauthenticated, nonce: NONCE },
        AuthFrame::Challenge { mode: AuthMode::PreSharedKey, nonce: NONCE },
        AuthFrame::Proof(MAC),
        AuthFrame::Reject(RejectReason::KeyRequired),
        AuthFrame::Reject(RejectReason::NoKey),
        AuthFrame::Reject(RejectReason::BadProof),
        AuthFrame::HelloTag(MAC),
    ]
}

#[test]
fn layout_and_round_trip() {
    let init = encode_auth(&AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: NONCE });
    assert_eq!(&init[..4], &MAGIC);
    assert_eq!(&init[4..6], &PROTOCOL_VERSION.to_be_bytes());
    assert_eq!(init[6], 2, "kind");
    assert_eq!(&init[7..9], &(AUTH_HELLO_BODY_LEN as u16).to_be_bytes());
    assert_eq!(init[HEADER_LEN], 1, "mode");
    assert_eq!(&init[HEADER_LEN + 1..], &NONCE);
    let kinds: Vec<u8> = all_frames().iter().map(|f| encode_auth(f)[6]).collect();
    assert_eq!(kinds, [2, 2, 3, 4, 5, 5, 5, 6]);
    let reasons: Vec<u8> = all_frames()[4..7].iter().map(|f| encode_auth(f)[HEADER_LEN]).collect();
    assert_eq!(reasons, [1, 2, 3]);
    for f in all_frames() {
        assert_eq!(decode_auth(&encode_auth(&f)), Ok(f));
    }
}

#[test]
fn bad_modes_reasons_lengths_and_kinds_are_named() {
    let mut bytes = encode_auth(&AuthFrame::Challenge { mode: AuthMode::Unauthenticated, nonce: NONCE });
    bytes[HEADER_LEN] = 2;
    assert!(matches!(
        decode_auth(&bytes),
        Err(DecodeError::InvalidField { field: "auth mode", value: 2, .. })
    ));
    let mut bytes = encode_auth(&AuthFrame::Reject(RejectReason::BadProof));
    bytes[HEADER_LEN] = 0;
    assert!(matches!(
        decode_auth(&bytes),
        Err(DecodeError::InvalidField { field: "reject reason", value: 0, .. })
    ));
    // A proof announced one byte short, and a body longer than any frame.
    let mut bytes = encode_auth(&AuthFrame::Proof(MAC));
    bytes[7..9].copy_from_slice(&31u16.to_be_bytes());
    assert_eq!(decode_auth(&bytes[..HEADER_LEN]), Err(DecodeError::BadLength { got: 31, expected: MAC_LEN }));
    bytes[7..9].copy_from_slice(&(MAX_BODY_LEN as u16 + 1).to_be_bytes());
    assert_eq!(
        decode_auth(&bytes[..HEADER_LEN]),
        Err(DecodeError::FrameTooLarge { len: MAX_BODY_LEN + 1, max: MAX_BODY_LEN })
    );
    // Kinds: a hello is not an auth frame, 0 and 7 are no frame at all.
    let [v0, v1] = PROTOCOL_VERSION.to_be_bytes();
    let hello_header = [b'M', b'W', b'C', b'P', v0, v1, 1];
    assert_eq!(
        decode_auth(&hello_header),
        Err(DecodeError::UnexpectedFrame { got: "a hello", expected: "an auth frame" })
    );
    for k in [0u8, 7, 0xff] {
        let header = [b'M', b'W', b'C', b'P', v0, v1, k];
        assert_eq!(decode_auth(&header), Err(DecodeError::UnknownKind(k)));
    }
    let mut bytes = encode_auth(&AuthFrame::HelloTag(MAC));
    bytes.push(0);
    assert_eq!(decode_auth(&bytes), Err(DecodeError::TrailingBytes(1)));
}

#[test]
fn streaming_takes_one_frame_and_leaves_the_next() {
    let first = AuthFrame::Init { mode: AuthMode::PreSharedKey, nonce: NONCE };
    let mut bytes = encode_auth(&first);
    let len = bytes.len();
    bytes.extend_from_slice(&encode_auth(&AuthFrame::Proof(MAC)));
    let mut d = AuthDecoder::new();
    assert_eq!(d.wanted(), HEADER_LEN);
    for (i, b) in bytes.iter().enumerate() {
        assert_eq!(d.feed(std::slice::from_ref(b)).unwrap(), usize::from(i < len), "byte {i}");
    }
    assert_eq!(d.frame(), Some(&first));
    assert_eq!((d.consumed(), d.wanted()), (len, 0));
    let mut d = AuthDecoder::new();
    let mut too_large = *b"MWCP\x00\x00\x04\xff\xff";
    too_large[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    assert_eq!(d.feed(&too_large), Err(DecodeError::FrameTooLarge { len: 0xffff, max: MAX_BODY_LEN }));
    assert_eq!(d.wanted(), 0, "a failed decoder wants nothing more");
}

fn frames() -> impl Strategy<Value = AuthFrame> {
    let mode = prop_oneof![Just(AuthMode::Unauthenticated), Just(AuthMode::PreSharedKey)];
    prop_oneof![
        (mode.clone(), any::<[u8; NONCE_LEN]>()).prop_map(|(mode, nonce)| AuthFrame::Init { mode, nonce }),
        (mode, any::<[u8; NONCE_LEN]>()).prop_map(|(mode, nonce)| AuthFrame::Challenge { mode, nonce }),
        any::<[u8; MAC_LEN]>().prop_map(AuthFrame::Proof),
        prop_oneof![Just(RejectReason::KeyRequired), Just(RejectReason::NoKey), Just(RejectReason::BadProof)]
            .prop_map(AuthFrame::Reject),
        any::<[u8; MAC_LEN]>().prop_map(AuthFrame::HelloTag),
    ]
}

/// Bytes that start with a valid auth header more often than chance would.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..400),
        (2u8..=6, any::<u16>(), prop::collection::vec(any::<u8>(), 0..300)).prop_map(|(kind, len, rest)| {
            let mut v = b"MWCP".to_vec();
            v.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
            v.push(kind);
            v.extend_from_slice(&len.to_be_bytes());
            v.extend(rest);
            v
        }),
    ]
}

proptest! {
    #[test]
    fn prop_frames_round_trip(f in frames()) {
        prop_assert_eq!(decode_auth(&encode_auth(&f)), Ok(f));
    }

    /// Hostile bytes never panic; whatever decodes re-encodes to the same
    /// bytes, and the streaming decoder fed in two pieces agrees.
    #[test]
    fn prop_hostile_bytes_decode_or_fail_cleanly(bytes in hostile_bytes(), cut in any::<prop::sample::Index>()) {
        let once = decode_auth(&bytes);
        if let Ok(f) = &once {
            prop_assert_eq!(&encode_auth(f), &bytes);
        }
        let mut d = AuthDecoder::new();
        let at = cut.index(bytes.len() + 1);
        let r = d.feed(&bytes[..at]).and_then(|a| d.feed(&bytes[at..]).map(|b| a + b));
        prop_assert!(d.consumed() <= MAX_FRAME_LEN);
        match (r, once) {
            (Ok(n), Ok(f)) => prop_assert_eq!((n, d.frame()), (bytes.len(), Some(&f))),
            // The stream fails at the first byte that cannot be right; the
            // one-shot decoder says the same of the bytes the stream took.
            (Err(e), _) => prop_assert_eq!(decode_auth(&bytes[..d.consumed()]), Err(e)),
            // Trailing bytes: the stream stops at the frame's end and decodes it.
            (Ok(n), Err(DecodeError::TrailingBytes(t))) => {
                prop_assert_eq!(n + t, bytes.len());
                prop_assert!(d.frame().is_some());
            }
            // Too few bytes: the stream waits for more.
            (Ok(_), Err(DecodeError::Truncated { .. })) => prop_assert!(d.wanted() > 0),
            (r, once) => prop_assert!(false, "stream {:?}, one-shot {:?}", r, once),
        }
    }
}
