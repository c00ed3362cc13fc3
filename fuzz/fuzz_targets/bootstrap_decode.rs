//! Any bytes into the one-shot hello decoder: it must return, never panic,
//! and whatever it accepts must encode back to exactly the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mwcap::bootstrap::{decode, encode, HelloDecoder};

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
});
