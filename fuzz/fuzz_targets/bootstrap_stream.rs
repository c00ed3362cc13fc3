//! Bytes that arrive in arbitrary pieces, as from a TCP socket with short
//! reads, into the streaming hello and auth frame decoders. They must never
//! panic, never take more than the frame, and agree with their one-shot
//! decoders on the bytes they took.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use mwcap::bootstrap::{decode, decode_auth, AuthDecoder, DecodeError, HelloDecoder, MAX_FRAME_LEN};

#[derive(Arbitrary, Debug)]
enum Chunk {
    /// Bytes as they come.
    Bytes(Vec<u8>),
    /// A read that returned nothing new (the decoder must not change).
    Empty,
    /// One byte at a time.
    Drip(Vec<u8>),
}

/// What the two streaming decoders have in common.
trait Stream {
    type Out: PartialEq + std::fmt::Debug + Clone;
    fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError>;
    fn consumed(&self) -> usize;
    fn wanted(&self) -> usize;
    fn done(&self) -> Option<Self::Out>;
    fn one_shot(bytes: &[u8]) -> Result<Self::Out, DecodeError>;
}

impl Stream for HelloDecoder {
    type Out = mwcap::bootstrap::Hello;
    fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError> {
        HelloDecoder::feed(self, input)
    }
    fn consumed(&self) -> usize {
        HelloDecoder::consumed(self)
    }
    fn wanted(&self) -> usize {
        HelloDecoder::wanted(self)
    }
    fn done(&self) -> Option<Self::Out> {
        self.hello().copied()
    }
    fn one_shot(bytes: &[u8]) -> Result<Self::Out, DecodeError> {
        decode(bytes)
    }
}

impl Stream for AuthDecoder {
    type Out = mwcap::bootstrap::AuthFrame;
    fn feed(&mut self, input: &[u8]) -> Result<usize, DecodeError> {
        AuthDecoder::feed(self, input)
    }
    fn consumed(&self) -> usize {
        AuthDecoder::consumed(self)
    }
    fn wanted(&self) -> usize {
        AuthDecoder::wanted(self)
    }
    fn done(&self) -> Option<Self::Out> {
        self.frame().copied()
    }
    fn one_shot(bytes: &[u8]) -> Result<Self::Out, DecodeError> {
        decode_auth(bytes)
    }
}

fuzz_target!(|chunks: Vec<Chunk>| {
    check(HelloDecoder::new(), &chunks);
    check(AuthDecoder::new(), &chunks);
});

fn check<D: Stream>(mut d: D, chunks: &[Chunk]) {
    let mut taken = Vec::new();
    let mut failed = None;
    'feed: for chunk in chunks {
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
                    assert!(n == piece.len() || d.done().is_some());
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
    match (failed, d.done()) {
        // The one-shot decoder finds the same fault in the same bytes.
        (Some(e), _) => assert_eq!(D::one_shot(&taken), Err(e)),
        (None, Some(out)) => assert_eq!(D::one_shot(&taken), Ok(out)),
        (None, None) => {
            // Still waiting: what it took so far is a valid prefix, so the
            // one-shot decoder can only say it is truncated.
            assert!(d.wanted() > 0);
            assert!(matches!(D::one_shot(&taken), Err(DecodeError::Truncated { .. })));
        }
    }
}
