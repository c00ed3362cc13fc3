//! Any bytes into every decoder of peer bytes on the data path: the frame
//! envelope, the mw and confirm engine messages (alone and as a frame's
//! attachments), and an ask of the owner's library. Each must return, never panic, and whatever it accepts
//! must encode back to exactly the bytes it read (one encoding per value,
//! so a peer cannot smuggle state through alternative forms).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mwcap::conn::frame::{Attach, EngineTag, Frame, MAX_FRAME};
use mwcap::conn::OwnerAsk;
use mwcap_fallback as fb;
use mwcap_mw as mw;

fn engine_message(engine: EngineTag, bytes: &[u8]) {
    match engine {
        EngineTag::Mw => {
            if let Ok(m) = mw::Message::decode(bytes) {
                assert_eq!(m.to_bytes(), bytes, "mw message re-encodes differently: {m:?}");
                let mut slot = [0u8; 64];
                let n = m.encode_into(&mut slot).expect("an mw message fits an attachment");
                assert_eq!(&slot[..n], bytes);
            }
        }
        EngineTag::Confirm => {
            if let Ok((m, rest)) = fb::Message::decode(bytes) {
                let used = bytes.len() - rest.len();
                assert_eq!(m.to_bytes(), &bytes[..used], "confirm message re-encodes differently: {m:?}");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    engine_message(EngineTag::Mw, data);
    engine_message(EngineTag::Confirm, data);
    if let Some(a) = OwnerAsk::decode(data) {
        assert_eq!(a.encode(), data, "owner ask re-encodes differently: {a:?}");
        a.encode_with(|b| assert_eq!(b, data, "owner ask re-encodes differently on the stack: {a:?}"));
    }
    if let Ok((f, credit)) = Frame::decode_with_credit(data) {
        assert!(data.len() <= MAX_FRAME);
        let mut again = [0u8; MAX_FRAME];
        let n = f.encode_with_credit(credit, &mut again).expect("a decoded frame encodes");
        assert_eq!(&again[..n], data, "frame re-encodes differently: {f:?} (credit {credit})");
        let attaches: &[Attach] = match &f {
            Frame::Request { attach, .. } | Frame::Reply { attach, .. } | Frame::Ask { attach, .. } => attach,
            Frame::Engine(a) => std::slice::from_ref(a),
            _ => &[],
        };
        for a in attaches {
            engine_message(a.engine, a.bytes());
        }
    }
});
