use super::*;
use proptest::prelude::*;

fn one_attach() -> impl Strategy<Value = Attach> {
    (
        prop_oneof![Just(EngineTag::Mw), Just(EngineTag::Confirm)],
        proptest::collection::vec(any::<u8>(), 0..=MAX_ATTACH_LEN),
    )
        .prop_map(|(engine, bytes)| Attach::new(engine, &bytes).unwrap())
}

fn attach() -> impl Strategy<Value = Attaches> {
    proptest::collection::vec(one_attach(), 0..=MAX_ATTACH).prop_map(|v| Attaches::from_slice(&v).unwrap())
}

type Parts = (u8, u64, u8, Vec<u8>, Attaches, Attach, Option<[u8; 16]>);

/// Frames with their header bytes (owned by the strategy's value).
fn frames() -> impl Strategy<Value = Parts> {
    (
        0..10u8,
        any::<u64>(),
        any::<u8>(),
        proptest::collection::vec(any::<u8>(), 0..128),
        attach(),
        one_attach(),
        any::<Option<[u8; 16]>>(),
    )
}

fn frame(v: &Parts) -> Frame<'_> {
    let (kind, msg_id, status, header, attach, one, trace) = v;
    match kind {
        0 => Frame::Request {
            msg_id: *msg_id,
            trace: trace.map(TraceId::from_bytes),
            header,
            inline: &header[..header.len() / 2],
            attach: *attach,
        },
        1 => Frame::Reply { msg_id: *msg_id, status: *status, header, inline: header, attach: *attach },
        2 => Frame::Ping { seq: *msg_id },
        3 => Frame::Pong { seq: *msg_id },
        4 => Frame::Credit,
        5 => Frame::Ask { msg_id: *msg_id, body: header, attach: *attach },
        6 => Frame::Busy { msg_id: *msg_id, limit: u32::from(*status) << 8 },
        7 => Frame::GiveBack { keep: *msg_id as u32 },
        8 => Frame::Returned { count: (*msg_id >> 32) as u32 },
        _ => Frame::Engine(*one),
    }
}

proptest! {
    #[test]
    fn round_trip(v in frames(), credit in any::<u16>()) {
        let f = frame(&v);
        let bytes = f.encode().unwrap();
        prop_assert_eq!(Frame::decode(&bytes).unwrap(), f);
        let mut slot = [0u8; MAX_FRAME];
        let n = f.encode_into(&mut slot).unwrap();
        prop_assert_eq!(&slot[..n], &bytes[..]);
        let n = f.encode_with_credit(credit, &mut slot).unwrap();
        prop_assert_eq!(Frame::decode_with_credit(&slot[..n]).unwrap(), (f, credit));
        prop_assert_eq!(&slot[CREDIT_AT..CREDIT_AT + 2], &credit.to_le_bytes()[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = Frame::decode(&bytes);
    }

    #[test]
    fn every_truncation_is_an_error(v in frames()) {
        let f = frame(&v);
        let bytes = f.encode().unwrap();
        // Engine frames run to the end, so a shorter one can still parse; all others must not.
        if !matches!(f, Frame::Engine(_)) {
            for n in 0..bytes.len() {
                prop_assert!(Frame::decode(&bytes[..n]).is_err());
            }
        }
    }
}

#[test]
fn rejects_wrong_version_and_trailing_bytes() {
    let f = Frame::Request { msg_id: 7, trace: None, header: b"hi", inline: b"", attach: Attaches::new() };
    let mut b = f.encode().unwrap();
    b.push(0);
    assert_eq!(Frame::decode(&b), Err(FrameError::Trailing(1)));
    b.pop();
    b[0] = 9;
    assert_eq!(Frame::decode(&b), Err(FrameError::Version(9)));
}

#[test]
fn unknown_request_flags_are_refused() {
    let t = TraceId::from_bytes([7; 16]);
    let f = Frame::Request { msg_id: 3, trace: Some(t), header: b"h", inline: b"", attach: Attaches::new() };
    let mut b = f.encode().unwrap();
    assert_eq!(b[12], FLAG_TRACE);
    b[12] = 2;
    assert_eq!(Frame::decode(&b), Err(FrameError::UnknownFlags(2)));
}

#[test]
fn oversized_header_is_refused_both_ways() {
    let big = vec![0; MAX_HEADER + 1];
    let f = Frame::Request { msg_id: 1, trace: None, header: &big, inline: b"", attach: Attaches::new() };
    assert!(matches!(f.encode(), Err(FrameError::TooLarge { .. })));
    let mut b = vec![VERSION, 1, 0, 0];
    b.extend_from_slice(&0u64.to_le_bytes());
    b.push(0);
    b.extend_from_slice(&((MAX_HEADER + 1) as u16).to_le_bytes());
    assert!(matches!(Frame::decode(&b), Err(FrameError::TooLarge { what: "header", .. })));
}

#[test]
fn an_oversized_attachment_is_refused() {
    let mut b = vec![VERSION, 3, 0, 0, 1];
    b.extend_from_slice(&[0; MAX_ATTACH_LEN + 1]);
    assert!(matches!(Frame::decode(&b), Err(FrameError::TooLarge { what: "attachment", .. })));
    assert!(Attach::new(EngineTag::Mw, &[0; MAX_ATTACH_LEN + 1]).is_err());
}

#[test]
fn a_frame_too_big_for_its_slot_is_refused() {
    let header = [7u8; 100];
    let f = Frame::Request { msg_id: 1, trace: None, header: &header, inline: b"", attach: Attaches::new() };
    let mut small = [0u8; 64];
    assert!(matches!(f.encode_into(&mut small), Err(FrameError::TooLarge { .. })));
}
