//! Remote-key arithmetic for type-2 memory windows.
//!
//! An rkey is 32 bits: the upper 24 are the window's index, fixed by the
//! device at allocation; the low 8 are the consumer key, chosen by whoever
//! binds. rdma-sys' and rdma-mummy-sys' `ibv_inc_rkey` compute `rkey + 1` in
//! 32 bits and so overflow (a panic in debug builds) at `0xFFFF_FFFF`; these
//! helpers only ever touch the low byte.

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
/// A key equal to the current one is never returned: a peer holding the old
/// rkey must not find it valid again on the very next bind. (It may after
/// 255 more binds; the window's scoping to one QP and its short life bound
/// what that buys an attacker.)
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
    fn inc_wraps_without_touching_the_index() {
        assert_eq!(inc(0xFFFF_FFFF), 0xFFFF_FF00);
        assert_eq!(inc(0x1234_56FF), 0x1234_5600);
        assert_eq!(inc(0x1234_5601), 0x1234_5602);
    }

    #[test]
    fn rebind_never_repeats_the_current_key() {
        for cur in [0u32, 0xFF, 0xFFFF_FFFF, 0x0001_0080] {
            for r in 0..=255u8 {
                let next = rebind(cur, r);
                assert_ne!(next, cur);
                assert_eq!(index(next), index(cur));
            }
        }
    }
}
