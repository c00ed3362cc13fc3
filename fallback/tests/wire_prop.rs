//! The decoder never panics on untrusted bytes, and what it accepts
//! re-encodes to the same bytes.

use mwcap_fallback::{BufferId, Generation, Message, MsgId, Region, Verdict, MAX_ENCODED_LEN};
use proptest::prelude::*;

fn verdicts() -> impl Strategy<Value = Verdict> {
    prop_oneof![Just(Verdict::Intact), Just(Verdict::Reused), Just(Verdict::Unknown)]
}

fn messages() -> impl Strategy<Value = Message> {
    let ids = (any::<u64>(), any::<u32>(), any::<u64>());
    let region = (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(a, l, k)| Region::new(a, l, k));
    prop_oneof![
        (any::<u64>(), any::<u32>())
            .prop_map(|(m, attempt)| Message::Fetch { msg: MsgId::from_raw(m), attempt }),
        (ids, region.clone()).prop_map(|((m, b, g), region)| Message::Offer {
            msg: MsgId::from_raw(m),
            buffer: BufferId::from_raw(b),
            generation: Generation::from_raw(g),
            region
        }),
        (ids, region).prop_map(|((m, b, g), region)| Message::Expose {
            msg: MsgId::from_raw(m),
            buffer: BufferId::from_raw(b),
            generation: Generation::from_raw(g),
            region
        }),
        ids.prop_map(|(m, b, g)| Message::Confirm {
            msg: MsgId::from_raw(m),
            buffer: BufferId::from_raw(b),
            generation: Generation::from_raw(g)
        }),
        (ids, verdicts()).prop_map(|((m, b, g), verdict)| Message::ConfirmReply {
            msg: MsgId::from_raw(m),
            buffer: BufferId::from_raw(b),
            generation: Generation::from_raw(g),
            verdict
        }),
        any::<u64>().prop_map(|m| Message::Refuse { msg: MsgId::from_raw(m) }),
    ]
}

/// Arbitrary bytes, biased to start like a real message so the decoder gets
/// past the version and kind bytes often.
fn untrusted_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        (0u8..8, proptest::collection::vec(any::<u8>(), 0..48)).prop_map(|(kind, mut rest)| {
            rest.splice(0..0, [1u8, kind]);
            rest
        }),
    ]
}

proptest! {
    #[test]
    fn encode_into_writes_the_same_bytes_without_allocating(m in messages(), spare in 0usize..8) {
        let want = m.to_bytes();
        let mut exact = vec![0u8; want.len() + spare];
        prop_assert_eq!(m.encode_into(&mut exact), Some(want.len()));
        prop_assert_eq!(&exact[..want.len()], &want[..]);
        let mut short = vec![0u8; want.len() - 1];
        prop_assert_eq!(m.encode_into(&mut short), None);
        prop_assert!(short.iter().all(|&b| b == 0), "nothing written when too short");
    }

    #[test]
    fn decode_never_panics_and_accepts_only_canonical_prefixes(bytes in untrusted_bytes()) {
        if let Ok((m, rest)) = Message::decode(&bytes) {
            let used = bytes.len() - rest.len();
            prop_assert_eq!(used, m.encoded_len());
            prop_assert_eq!(&m.to_bytes()[..], &bytes[..used]);
        }
    }

    #[test]
    fn encode_then_decode_is_identity(m in messages(), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
        let mut bytes = m.to_bytes();
        prop_assert!(bytes.len() <= MAX_ENCODED_LEN);
        bytes.extend_from_slice(&tail);
        let (back, rest) = Message::decode(&bytes).unwrap();
        prop_assert_eq!(back, m);
        prop_assert_eq!(rest, &tail[..]);
    }

    #[test]
    fn any_corruption_decodes_to_an_error_or_a_well_formed_message(
        m in messages(), pos in any::<prop::sample::Index>(), byte in any::<u8>(),
    ) {
        let mut bytes = m.to_bytes();
        let i = pos.index(bytes.len());
        bytes[i] = byte;
        let truncated = &bytes[..i];
        prop_assert!(Message::decode(truncated).is_err());
        if let Ok((back, rest)) = Message::decode(&bytes) {
            prop_assert!(rest.is_empty() || back.encoded_len() < bytes.len());
        }
    }
}
