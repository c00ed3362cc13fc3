//! A tiny seeded PRNG (SplitMix64) for consumer keys.
//!
//! The crate has no randomness source of its own: the caller seeds it, so a
//! simulation or the model checker replays the same keys.

/// SplitMix64 (Steele, Lea, Flood 2014): 64 bits of state, one add and three
/// xor-shift-multiplies per output.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn next_u8(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // The reference SplitMix64 (splitmix64.c, Vigna) from state 0.
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(g.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(g.next_u64(), 0x06c4_5d18_8009_454f);
        // The consumer keys are the top byte of each output.
        let mut g = SplitMix64::new(1);
        let keys: Vec<u8> = (0..8).map(|_| g.next_u8()).collect();
        assert_eq!(keys, [0x91, 0xbe, 0xf8, 0x71, 0x71, 0xc3, 0xe0, 0x85]);
        let mut g = SplitMix64::new(7);
        let keys: Vec<u8> = (0..8).map(|_| g.next_u8()).collect();
        assert_eq!(keys, [0x63, 0x04, 0xe6, 0x95, 0x73, 0x3f, 0x77, 0x53]);
    }

    #[test]
    fn same_seed_same_sequence_and_bytes_vary() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        let xs: Vec<u8> = (0..64).map(|_| a.next_u8()).collect();
        let ys: Vec<u8> = (0..64).map(|_| b.next_u8()).collect();
        assert_eq!(xs, ys);
        let distinct: std::collections::HashSet<u8> = xs.iter().copied().collect();
        assert!(distinct.len() > 32, "64 draws gave only {} distinct bytes", distinct.len());
    }
}
