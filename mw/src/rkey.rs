//! Remote-key arithmetic for type-2 windows (the same rules as the root
//! crate's `backend::rkey`; repeated here because this crate has no
//! dependencies).
//!
//! An rkey is the window's 24-bit index (fixed at allocation) above an 8-bit
//! consumer key chosen at each bind. Only the low byte ever changes, so the
//! index can never be corrupted by a carry.

/// `rkey` with its consumer key replaced by `key`.
pub(crate) const fn with_key(rkey: u32, key: u8) -> u32 {
    (rkey & !0xff) | key as u32
}

/// The rkey for the next bind of a window whose current rkey is `current`,
/// with `random` as the consumer key; never equal to `current` (a key equal to
/// it is bumped by one, wrapping inside the low byte).
pub(crate) const fn rebind(current: u32, random: u8) -> u32 {
    if random == (current & 0xff) as u8 {
        with_key(current, random.wrapping_add(1))
    } else {
        with_key(current, random)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebind_changes_only_the_low_byte_and_never_repeats() {
        for cur in [0u32, 0xff, 0xffff_ffff, 0x0001_0080] {
            for r in 0..=255u8 {
                let next = rebind(cur, r);
                assert_ne!(next, cur);
                assert_eq!(next & !0xff, cur & !0xff);
            }
        }
        assert_eq!(rebind(0x1234_56ff, 0xff), 0x1234_5600);
    }
}
