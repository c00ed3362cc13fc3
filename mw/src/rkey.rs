//! Remote-key arithmetic for type-2 memory windows: the one implementation
//! (the root crate's `backend::rkey` re-exports it).
//!
//! An rkey is 32 bits: the upper 24 are the window's index, fixed by the
//! device at allocation; the low 8 are the consumer key, chosen by whoever
//! binds. rdma-sys' and rdma-mummy-sys' `ibv_inc_rkey` compute `rkey + 1` in
//! 32 bits and so overflow (a panic in debug builds) at `0xFFFF_FFFF`; these
//! functions only ever touch the low byte, so the index can never be
//! corrupted by a carry.

/// The window index bits of an rkey.
pub const fn index(rkey: u32) -> u32 {
    rkey & !0xff
}

/// The consumer key (low 8 bits) of an rkey.
pub const fn key(rkey: u32) -> u8 {
    (rkey & 0xff) as u8
}

/// `rkey` with its consumer key replaced by `key`.
pub const fn with_key(rkey: u32, key: u8) -> u32 {
    index(rkey) | key as u32
}

/// The consumer key after `rkey`'s, wrapping from 0xff to 0x00.
pub const fn inc(rkey: u32) -> u32 {
    with_key(rkey, key(rkey).wrapping_add(1))
}

/// The rkey for the next bind of a window whose current rkey is `current`,
/// using the random byte `random` as consumer key.
///
/// A key equal to the current one is never returned (it is bumped by one,
/// wrapping inside the low byte): a peer holding the old rkey must not find
/// it valid again on the very next bind. (Any later bind may give it
/// back: the key is random, one chance in 255 each time. The window's
/// scoping to one QP and its short life bound what that buys an
/// attacker.)
pub const fn rebind(current: u32, random: u8) -> u32 {
    if random == key(current) {
        inc(current)
    } else {
        with_key(current, random)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_and_key_split_the_rkey() {
        assert_eq!(index(0x1234_56ab), 0x1234_5600);
        assert_eq!(key(0x1234_56ab), 0xab);
        assert_eq!(with_key(0x1234_56ab, 0x07), 0x1234_5607);
        assert_eq!(with_key(0xffff_ff00, 0xff), 0xffff_ffff);
        assert_eq!(with_key(0xffff_ffff, 0x00), 0xffff_ff00);
    }

    #[test]
    fn inc_wraps_from_0xff_to_0x00_without_touching_the_index() {
        assert_eq!(inc(0xffff_ffff), 0xffff_ff00);
        assert_eq!(inc(0x1234_56ff), 0x1234_5600);
        assert_eq!(inc(0x0000_00ff), 0x0000_0000);
        assert_eq!(inc(0x1234_5601), 0x1234_5602);
        assert_eq!(inc(0x1234_56fe), 0x1234_56ff);
        // 256 increments come back to the start; the index never moves.
        let mut r = 0xabcd_ef00;
        for i in 1..=256u32 {
            r = inc(r);
            assert_eq!(index(r), 0xabcd_ef00);
            assert_eq!(u32::from(key(r)), i % 256);
        }
        assert_eq!(r, 0xabcd_ef00);
    }

    #[test]
    fn rebind_takes_the_random_key_unless_it_is_the_current_one() {
        assert_eq!(rebind(0x1234_5600, 0x42), 0x1234_5642);
        assert_eq!(rebind(0x1234_5642, 0x42), 0x1234_5643, "equal key: bumped by one");
        assert_eq!(rebind(0x1234_56ff, 0xff), 0x1234_5600, "bumped with the wrap");
        assert_eq!(rebind(0xffff_ffff, 0xff), 0xffff_ff00);
        assert_eq!(rebind(0x1234_56ff, 0x00), 0x1234_5600);
    }

    #[test]
    fn rebind_never_repeats_the_current_key_nor_changes_the_index() {
        for cur in [0u32, 0xff, 0xffff_ffff, 0x0001_0080, 0xffff_ff00] {
            for r in 0..=255u8 {
                let next = rebind(cur, r);
                assert_ne!(next, cur);
                assert_eq!(index(next), index(cur));
            }
        }
    }
}
