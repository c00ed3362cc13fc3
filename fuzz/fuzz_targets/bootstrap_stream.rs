//! Bytes that arrive in arbitrary pieces, as from a TCP socket with short
//! reads, into the streaming hello decoder. It must never panic, never take
//! more than the frame, and agree with the one-shot decoder on the bytes it
//! took.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use mwcap::bootstrap::{decode, HelloDecoder, MAX_FRAME_LEN};

#[derive(Arbitrary, Debug)]
enum Chunk {
    /// Bytes as they come.
    Bytes(Vec<u8>),
    /// A read that returned nothing new (the decoder must not change).
    Empty,
    /// One byte at a time.
    Drip(Vec<u8>),
}

fuzz_target!(|chunks: Vec<Chunk>| {
    let mut d = HelloDecoder::new();
    let mut taken = Vec::new();
    let mut failed = None;
    'feed: for chunk in &chunks {
        let pieces: Vec<&[u8]> = match chunk {
            Chunk::Bytes(b) => vec![b.as_slice()],
            Chunk::Empty => vec![&[][..]],
            Chunk::Drip(b) => b.chunks(1).collect(),
        };
        for piece in pieces {
            let before = d.consumed();
            let res = d.feed(piece);
            // Whatever happened, the bytes taken are a prefix of this piece.
            let took = d.consumed() - before;
            assert!(took <= piece.len());
            assert!(d.consumed() <= MAX_FRAME_LEN);
            taken.extend_from_slice(&piece[..took]);
            match res {
                Ok(n) => {
                    assert_eq!(n, took);
                    // Bytes left over are only ever past the end of the frame.
                    assert!(n == piece.len() || d.hello().is_some());
                }
                Err(e) => {
                    // The error is sticky.
                    assert_eq!(d.feed(piece), Err(e.clone()));
                    assert_eq!(d.wanted(), 0);
                    failed = Some(e);
                    break 'feed;
                }
            }
        }
    }
    match (failed, d.hello()) {
        // The one-shot decoder finds the same fault in the same bytes.
        (Some(e), _) => assert_eq!(decode(&taken), Err(e)),
        (None, Some(hello)) => assert_eq!(decode(&taken), Ok(*hello)),
        (None, None) => {
            // Still waiting: what it took so far is a valid prefix, so the
            // one-shot decoder can only say it is truncated.
            assert!(d.wanted() > 0);
            assert!(matches!(decode(&taken), Err(mwcap::bootstrap::DecodeError::Truncated { .. })));
        }
    }
});
