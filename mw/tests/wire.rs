//! Property tests of the wire encoding: untrusted bytes never panic the
//! decoder, and every message round-trips.

use std::time::Duration;

use mwcap_mw::{Grant, LeaseId, Message, Release, MAX_LEASE_TIME, WIRE_VERSION};
use proptest::prelude::*;

fn grants() -> impl Strategy<Value = Grant> {
    (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), 0..=u32::MAX).prop_map(
        |(lease, addr, len, rkey, micros)| Grant {
            lease: LeaseId::from_raw(lease),
            addr,
            len,
            rkey,
            time_left: Duration::from_micros(u64::from(micros)),
        },
    )
}

fn releases() -> impl Strategy<Value = Release> {
    (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(lease, rkey, unread)| Release {
        lease: LeaseId::from_raw(lease),
        rkey,
        unread,
    })
}

fn messages() -> impl Strategy<Value = Message> {
    prop_oneof![grants().prop_map(Message::Grant), releases().prop_map(Message::Release)]
}

/// Mostly well-formed headers, so the body decoders get exercised too.
fn frames() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        (0u8..4, proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(kind, mut body)| {
            body.insert(0, kind);
            body.insert(0, WIRE_VERSION);
            body
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

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
    fn random_bytes_never_panic(bytes in frames()) {
        if let Ok(m) = Message::decode(&bytes) {
            // Whatever decodes re-encodes to the same bytes.
            prop_assert_eq!(m.to_bytes(), bytes);
        }
    }

    #[test]
    fn messages_round_trip(m in messages()) {
        let bytes = m.to_bytes();
        prop_assert_eq!(bytes.len(), m.encoded_len());
        prop_assert_eq!(Message::decode(&bytes), Ok(m));
        // Any truncation or extension is an error, never a panic.
        for cut in 0..bytes.len() {
            prop_assert!(Message::decode(&bytes[..cut]).is_err());
        }
        let mut longer = bytes.clone();
        longer.push(0);
        prop_assert!(Message::decode(&longer).is_err());
    }

    #[test]
    fn time_left_is_micros_truncated_and_capped(nanos in any::<u64>()) {
        let g = Grant { lease: LeaseId::from_raw(1), addr: 0, len: 1, rkey: 0, time_left: Duration::from_nanos(nanos) };
        let Ok(Message::Grant(back)) = Message::decode(&Message::Grant(g).to_bytes()) else {
            return Err(TestCaseError::fail("grant did not decode"));
        };
        let want = Duration::from_micros(nanos / 1000).min(MAX_LEASE_TIME);
        prop_assert_eq!(back.time_left, want);
    }
}
