//! Any bytes into the one-shot hello and auth frame decoders: they must
//! return, never panic, and whatever they accept must encode back to
//! exactly the same bytes (a hello after one round: unknown policy bits are
//! dropped on decode).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mwcap::bootstrap::{decode, decode_auth, encode, encode_auth, AuthDecoder, HelloDecoder};

fuzz_target!(|data: &[u8]| {
    if let Ok(hello) = decode(data) {
        assert!(hello.validate().is_ok(), "decode accepted an invalid hello: {hello:?}");
        // Unknown policy bits are dropped on decode, so compare after one round.
        let again = encode(&hello);
        assert_eq!(decode(&again), Ok(hello));
        // The streaming decoder fed all at once agrees.
        let mut d = HelloDecoder::new();
        assert_eq!(d.feed(data), Ok(data.len()));
        assert_eq!(d.hello(), Some(&hello));
    }
    if let Ok(frame) = decode_auth(data) {
        // Every bit of an auth frame means something: the same bytes back.
        assert_eq!(encode_auth(&frame), data);
        let mut d = AuthDecoder::new();
        assert_eq!(d.feed(data), Ok(data.len()));
        assert_eq!(d.frame(), Some(&frame));
    }
});
