//! What every `mwcap bench` mode shares: the case matrix, the per-call
//! instructions the client puts in the request header for the server, the
//! server's side of those instructions, and the machine-readable result line.
//!
//! A request header is [`HEADER_LEN`] bytes: an operation byte, the reply
//! payload size the client wants (u32, little-endian) and a tag. By default
//! every byte of the call's payload, whichever side writes it, is a pattern
//! of its index and the tag ([`fill`]), and the reader checks every byte
//! ([`check`]): it READ this call's bytes, all of them, in place. A client
//! can ask for stamps instead ([`Check::Stamp`], `--stamp-only`): only the
//! payload's first and last [`STAMP_LEN`] bytes are written and checked,
//! so that timing a 64 KiB call under emulation times the transport, not
//! the memcpy.

use std::time::Duration;

use hdrhistogram::Histogram;
use mwcap::conn::{BufClass, Config, Policy};

use crate::ConnArgs;

/// Bytes of every request header.
pub const HEADER_LEN: usize = 6;
/// Reply status: done.
pub const STATUS_OK: u8 = 0;
/// Reply status: the request payload was not this call's.
pub const STATUS_BAD_PAYLOAD: u8 = 1;
/// Reply status: the header made no sense (or a request came again unknown).
pub const STATUS_BAD_REQUEST: u8 = 2;
/// Reply status: a `delegate_read` ask the server could not delegate (the
/// connection has no identity, or the delegation failed); the reply
/// header says why.
pub const STATUS_NOT_DELEGATED: u8 = 3;

/// What a case measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A call with no payload either way.
    Rpc,
    /// The server replies with a payload the client READs.
    ReplyRead,
    /// The client sends a payload the server READs; the reply has none.
    RequestRead,
    /// The server delegates a range of a region of its endpoint, written
    /// with the payload, to the client's identity and replies with the
    /// token; the client redeems it and READs the range (the timed part:
    /// from having the token to the payload read and released, what a
    /// delegate that was handed a token spends).
    DelegateRead,
}

impl Kind {
    /// Every kind, in the matrix's order.
    pub const ALL: [Kind; 4] = [Kind::Rpc, Kind::ReplyRead, Kind::RequestRead, Kind::DelegateRead];

    /// The kind's name in result lines and in `--cases`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Rpc => "rpc",
            Kind::ReplyRead => "reply_read",
            Kind::RequestRead => "request_read",
            Kind::DelegateRead => "delegate_read",
        }
    }
}

/// How much of each payload its writer writes and its reader checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Check {
    /// Every byte ([`fill`], [`check`]): the pass/fail runs.
    #[default]
    EveryByte,
    /// The first and last [`STAMP_LEN`] bytes ([`stamp`], [`stamp_ok`]):
    /// timing runs, where touching every byte would dominate the call.
    Stamp,
}

impl Check {
    /// The mode in result lines (`check=`).
    pub fn name(self) -> &'static str {
        match self {
            Check::EveryByte => "every_byte",
            Check::Stamp => "stamp",
        }
    }

    /// Write the payload of `len` bytes tagged `tag` into `buf` (see
    /// [`fill_prefix`]); returns its length.
    pub fn write(self, buf: &mut [u8], len: usize, tag: u8) -> usize {
        match self {
            Check::EveryByte => fill_prefix(buf, len, tag),
            Check::Stamp => stamp(buf, len, tag),
        }
    }

    /// Whether `bytes` is the payload of `len` bytes tagged `tag`, as far
    /// as this mode looks.
    pub fn passes(self, bytes: &[u8], len: u32, tag: u8) -> bool {
        match self {
            Check::EveryByte => check(bytes, len, tag),
            Check::Stamp => stamp_ok(bytes, len, tag),
        }
    }
}

/// One line of results: a kind of call, the policy of its payload, its
/// size, how many calls are in flight at once and how much of each payload
/// is written and checked.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// What is measured.
    pub kind: Kind,
    /// The policy of the connection the case runs on.
    pub policy: Policy,
    /// Payload bytes (64 for `rpc`, which has none).
    pub size: u32,
    /// Calls in flight at once.
    pub inflight: u32,
    /// How much of each payload is written and checked.
    pub check: Check,
}

impl Case {
    /// The case's name in result lines.
    pub fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// The policy in result lines: `none` for a call without payload.
    pub fn policy_name(&self) -> &'static str {
        match (self.kind, self.policy) {
            (Kind::Rpc, _) => "none",
            (_, Policy::Mw) => "mw",
            (_, Policy::Confirm) => "confirm",
        }
    }

    /// Bytes of the request payload (0: none).
    pub fn request_size(&self) -> u32 {
        if self.kind == Kind::RequestRead {
            self.size
        } else {
            0
        }
    }

    /// Bytes of the reply payload (0: none).
    pub fn reply_size(&self) -> u32 {
        if self.kind == Kind::ReplyRead {
            self.size
        } else {
            0
        }
    }
}

/// Whether the matrix runs `kind`: `kinds` (from `--cases`) names it.
fn wanted(kinds: &[Kind], kind: Kind) -> bool {
    kinds.contains(&kind)
}

/// The cases of `kinds`, grouped by the policy of the connection they run
/// on: `rpc` (at 64 B) on the first policy's connection, then for each
/// policy its `reply_read`, `request_read` and `delegate_read` cases at
/// every size; each case at every in-flight count, every payload written
/// and checked as `check` says.
pub fn matrix(
    kinds: &[Kind],
    policies: &[Policy],
    sizes: &[u32],
    inflights: &[u32],
    check: Check,
) -> Vec<(Policy, Vec<Case>)> {
    let mut groups = Vec::new();
    for (i, &policy) in policies.iter().enumerate() {
        let mut cases = Vec::new();
        if i == 0 && wanted(kinds, Kind::Rpc) {
            for &inflight in inflights {
                cases.push(Case { kind: Kind::Rpc, policy, size: 64, inflight, check });
            }
        }
        for kind in [Kind::ReplyRead, Kind::RequestRead, Kind::DelegateRead] {
            if !wanted(kinds, kind) {
                continue;
            }
            for &size in sizes {
                for &inflight in inflights {
                    cases.push(Case { kind, policy, size, inflight, check });
                }
            }
        }
        groups.push((policy, cases));
    }
    groups
}

/// What a client asks of the server in a request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Answer the call: check the request payload's tag (if there is one),
    /// reply with a payload of `reply_size` bytes tagged `tag` (none if 0).
    Call {
        /// Reply payload bytes.
        reply_size: u32,
        /// The call's tag, in both payloads.
        tag: u8,
        /// How much of both payloads is written and checked: the client
        /// says, so that one server serves timing and pass/fail runs.
        check: Check,
    },
    /// Reply with the server process's allocation count (u64 LE in the
    /// reply header), for `allocs_per_call` across two processes.
    Allocs,
    /// Write the payload of `size` bytes tagged `tag` into a range of a
    /// region of the server's endpoint, delegate the range to the
    /// connection's identity, and reply with the token (the reply header).
    Delegate {
        /// Bytes of the range.
        size: u32,
        /// The call's tag.
        tag: u8,
        /// How much of the range is written (and will be checked).
        check: Check,
    },
}

impl Ask {
    /// The request header.
    pub fn encode(self) -> [u8; HEADER_LEN] {
        let mut h = [0; HEADER_LEN];
        match self {
            Ask::Call { reply_size, tag, check } => {
                h[0] = match check {
                    Check::EveryByte => 0,
                    Check::Stamp => 2,
                };
                h[1..5].copy_from_slice(&reply_size.to_le_bytes());
                h[5] = tag;
            }
            Ask::Allocs => h[0] = 1,
            Ask::Delegate { size, tag, check } => {
                h[0] = match check {
                    Check::EveryByte => 3,
                    Check::Stamp => 4,
                };
                h[1..5].copy_from_slice(&size.to_le_bytes());
                h[5] = tag;
            }
        }
        h
    }

    /// Parse a request header.
    pub fn decode(h: &[u8]) -> Option<Ask> {
        let h: &[u8; HEADER_LEN] = h.try_into().ok()?;
        let size = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
        let call = |check| Ask::Call { reply_size: size, tag: h[5], check };
        let delegate = |check| Ask::Delegate { size, tag: h[5], check };
        match h[0] {
            0 => Some(call(Check::EveryByte)),
            1 => Some(Ask::Allocs),
            2 => Some(call(Check::Stamp)),
            3 => Some(delegate(Check::EveryByte)),
            4 => Some(delegate(Check::Stamp)),
            _ => None,
        }
    }
}

/// A benchmark side's pool: `buffers` standard buffers of `buffer_size`
/// bytes and, when `max_payload` is larger, `large` buffers of
/// `max_payload` bytes.
#[derive(Clone, Copy, Debug)]
pub struct Pool {
    /// Standard buffers.
    pub buffers: u32,
    /// Their size.
    pub buffer_size: u32,
    /// The largest payload.
    pub max_payload: u32,
    /// Buffers of `max_payload` bytes, if it exceeds `buffer_size`.
    pub large: u32,
}

/// A benchmark connection's settings: `pool` and `conn` (either side's).
pub fn config(pool: Pool, conn: &ConnArgs) -> Config {
    let mut c = Config::default();
    c.buffers = pool.buffers;
    c.buffer_size = pool.buffer_size;
    if pool.max_payload > pool.buffer_size && pool.large > 0 {
        c.large_buffers = vec![BufClass { size: pool.max_payload, count: pool.large }];
    }
    conn.apply(&mut c);
    c
}

/// Byte `i` of every payload tagged `tag`: a hash of the index (so that
/// a chunk read into the wrong place, or a stale buffer, shows) mixed with
/// the call's tag.
#[inline]
fn pattern(i: usize, tag: u8) -> u8 {
    (((i as u32).wrapping_mul(0x9e37_79b1) >> 24) as u8) ^ tag
}

/// Write the payload tagged `tag` over all of `bytes` (in place: into a
/// registered buffer through its `Buf`).
pub fn fill(bytes: &mut [u8], tag: u8) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(i, tag);
    }
}

/// Write the first `len` bytes of `buf` (all of it if shorter) with the
/// payload tagged `tag`; returns how many were written (a short payload
/// fails the reader's [`check`]).
pub fn fill_prefix(buf: &mut [u8], len: usize, tag: u8) -> usize {
    let n = len.min(buf.len());
    fill(&mut buf[..n], tag);
    n
}

/// Whether `bytes` is the payload of `len` bytes tagged `tag`, every byte
/// of it (a loop with no early exit, which the compiler vectorizes).
pub fn check(bytes: &[u8], len: u32, tag: u8) -> bool {
    bytes.len() == len as usize
        && bytes.iter().enumerate().fold(0u8, |acc, (i, &b)| acc | (b ^ pattern(i, tag))) == 0
}

/// Bytes of each of a stamped payload's two stamps, its first and its last.
pub const STAMP_LEN: usize = 8;

/// The stamp at the start (`tail` false) or the end of the payload of
/// `len` bytes tagged `tag`. Its top bytes are constant and non-zero, so
/// that a zeroed buffer never passes; the tag makes it this call's, the
/// length this size's, and `tail` tells the two apart.
fn stamp_bytes(len: usize, tag: u8, tail: bool) -> [u8; STAMP_LEN] {
    let w = 0x6d77_u64 << 48 | u64::from(tail) << 40 | u64::from(tag) << 32 | len as u64 & 0xffff_ffff;
    w.to_le_bytes()
}

/// The two stamps (head, tail) of the payload of `len` bytes tagged `tag`,
/// to write at its start and its end (a payload of at least two stamps'
/// length: see [`stamp`]).
pub fn stamps(len: usize, tag: u8) -> [[u8; STAMP_LEN]; 2] {
    [stamp_bytes(len, tag, false), stamp_bytes(len, tag, true)]
}

/// Write the stamps of the payload of `len` bytes tagged `tag` into `buf`
/// (the rest of its bytes stay what they were); returns the payload's
/// length, as [`fill_prefix`] does. A payload too short for two stamps
/// gets every byte, which costs nothing at that size.
pub fn stamp(buf: &mut [u8], len: usize, tag: u8) -> usize {
    let n = len.min(buf.len());
    if n < 2 * STAMP_LEN {
        return fill_prefix(buf, n, tag);
    }
    buf[..STAMP_LEN].copy_from_slice(&stamp_bytes(n, tag, false));
    buf[n - STAMP_LEN..n].copy_from_slice(&stamp_bytes(n, tag, true));
    n
}

/// Whether `bytes` carries the stamps of the payload of `len` bytes tagged
/// `tag` (every byte, if too short for two: see [`stamp`]). The bytes
/// between the stamps are not looked at; that is [`check`]'s job.
pub fn stamp_ok(bytes: &[u8], len: u32, tag: u8) -> bool {
    let n = len as usize;
    if bytes.len() != n || n < 2 * STAMP_LEN {
        return check(bytes, len, tag);
    }
    bytes[..STAMP_LEN] == stamp_bytes(n, tag, false) && bytes[n - STAMP_LEN..] == stamp_bytes(n, tag, true)
}

/// What the server does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Reply with a payload (`reply_size` > 0) or none, tagged `tag`, after
    /// checking the request payload against `tag`, both as `check` says.
    Call {
        /// Reply payload bytes.
        reply_size: u32,
        /// The call's tag.
        tag: u8,
        /// How much of both payloads is written and checked.
        check: Check,
    },
    /// Reply with the allocation count.
    Allocs,
    /// Delegate a range holding the payload of `size` bytes tagged `tag`
    /// (written as `check` says) to the connection's identity; reply with
    /// the token.
    Delegate {
        /// Bytes of the range.
        size: u32,
        /// The call's tag.
        tag: u8,
        /// How much of the range is written.
        check: Check,
    },
    /// Reply [`STATUS_BAD_REQUEST`].
    Bad,
}

/// What to do with a request carrying `header`. A request that comes again
/// under confirm (the client read a stale reply) carries its header again
/// (`Request::again`), so nothing needs remembering.
pub fn plan(header: &[u8]) -> Plan {
    match Ask::decode(header) {
        Some(Ask::Call { reply_size, tag, check }) => Plan::Call { reply_size, tag, check },
        Some(Ask::Allocs) => Plan::Allocs,
        Some(Ask::Delegate { size, tag, check }) => Plan::Delegate { size, tag, check },
        None => Plan::Bad,
    }
}

/// Latencies of the measured calls of one case.
pub struct Measured {
    /// Call latencies in nanoseconds.
    pub hist: Histogram<u64>,
    /// Wall time of the measured calls, all of them.
    pub elapsed: Duration,
    /// Heap allocations during the measured calls (both sides), if counted.
    pub allocs: Option<u64>,
}

/// A histogram of call latencies in nanoseconds, 1 ns to 100 s, 3 significant
/// digits; recording into it allocates nothing.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// How the calls of a result line ran.
#[derive(Clone, Copy, Debug)]
pub struct Labels {
    /// `async` (each side's connection on an endpoint of its own),
    /// `async-srq`, `async-pool`, or `sansio`.
    pub mode: &'static str,
    /// `sim` or `verbs`.
    pub backend: &'static str,
    /// The executor the async API ran under (`block_on`, `smol`, `tokio`);
    /// `none` for the sans-IO loop, which the caller's own thread turns.
    pub executor: &'static str,
    /// Where the server ran: `apart` (another process, or on the simulator
    /// a thread of its own: `executors::Place`) or `joined` (beside the
    /// client, under its executor; the sans-IO loop turns both sides).
    pub server: &'static str,
}

/// The case's result line (see the crate's `bench` docs for its fields).
pub fn line(case: &Case, Labels { mode, backend, executor, server }: Labels, m: &Measured) -> String {
    let us = |q: f64| m.hist.value_at_quantile(q) as f64 / 1e3;
    let calls = m.hist.len();
    let mut s = format!(
        "case={} policy={} size={} inflight={} mode={mode} backend={backend} executor={executor} server={server} check={} p50_us={:.1} p99_us={:.1} p999_us={:.1} calls_per_s={:.0}",
        case.name(),
        case.policy_name(),
        case.size,
        case.inflight,
        case.check.name(),
        us(0.5),
        us(0.99),
        us(0.999),
        calls as f64 / m.elapsed.as_secs_f64().max(1e-9),
    );
    if let Some(a) = m.allocs {
        s += &format!(" allocs_per_call={:.1} allocs={a}", a as f64 / calls.max(1) as f64);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        for ask in [
            Ask::Call { reply_size: 65536, tag: 7, check: Check::EveryByte },
            Ask::Call { reply_size: 0, tag: 255, check: Check::EveryByte },
            Ask::Call { reply_size: 4096, tag: 9, check: Check::Stamp },
            Ask::Allocs,
            Ask::Delegate { size: 4096, tag: 3, check: Check::EveryByte },
            Ask::Delegate { size: 1 << 24, tag: 0, check: Check::Stamp },
        ] {
            assert_eq!(Ask::decode(&ask.encode()), Some(ask));
        }
        assert_eq!(Ask::decode(b"short"), None);
        assert_eq!(Ask::decode(&[9, 0, 0, 0, 0, 0]), None);
    }

    #[test]
    fn every_byte_of_a_payload_is_checked() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 3);
        assert!(check(&b, 4096, 3));
        assert!(!check(&b, 4096, 4), "another call's tag");
        assert!(!check(&b[..64], 4096, 3), "another length");
        for i in [0, 1, 2047, 4095] {
            let mut bad = b.clone();
            bad[i] ^= 1;
            assert!(!check(&bad, 4096, 3), "byte {i} changed");
        }
        // A chunk moved by any offset does not pass for the original.
        let mut moved = vec![0u8; 8192];
        fill(&mut moved, 3);
        for d in [1, 256, 4096] {
            assert!(!check(&moved[d..d + 4096], 4096, 3), "offset {d}");
        }
    }

    #[test]
    fn a_stamp_is_this_calls_and_this_sizes() {
        let mut b = vec![0u8; 4096];
        assert_eq!(stamp(&mut b, 4096, 3), 4096);
        assert!(stamp_ok(&b, 4096, 3));
        assert!(Check::Stamp.passes(&b, 4096, 3));
        assert!(!stamp_ok(&b, 4096, 4), "another call's tag");
        assert!(!stamp_ok(&b[..64], 64, 3), "another length (the tail stamp is not there)");
        // A payload of another length, read whole: its stamps say its length.
        let mut longer = vec![0u8; 8192];
        stamp(&mut longer, 8192, 3);
        assert!(!stamp_ok(&longer[..4096], 4096, 3), "the head of a longer payload");
        assert!(!stamp_ok(&[0u8; 4096], 4096, 3), "a zeroed buffer");
        assert!(!stamp_ok(&b[..4095], 4096, 3), "a short read");
        for i in [0, 7, 4088, 4095] {
            let mut bad = b.clone();
            bad[i] ^= 1;
            assert!(!stamp_ok(&bad, 4096, 3), "stamp byte {i} changed");
        }
        // An every-byte payload is not a stamped one, nor the reverse.
        let mut full = vec![0u8; 4096];
        fill(&mut full, 3);
        assert!(!stamp_ok(&full, 4096, 3) && !check(&b, 4096, 3));
    }

    #[test]
    fn a_recycled_buffer_passes_only_for_the_call_that_stamped_it() {
        // A pool buffer keeps its last call's bytes: stamping it for the
        // next call makes it that call's, and the old call's no longer.
        let mut b = vec![0u8; 65536];
        fill(&mut b, 1);
        stamp(&mut b, 65536, 2);
        assert!(stamp_ok(&b, 65536, 2));
        stamp(&mut b, 4096, 3);
        assert!(stamp_ok(&b[..4096], 4096, 3));
        assert!(!stamp_ok(&b, 65536, 2), "the head stamp is the new call's");
    }

    #[test]
    fn a_payload_too_short_for_two_stamps_is_checked_whole() {
        for len in [1usize, 8, 15] {
            let mut b = vec![0u8; 64];
            assert_eq!(stamp(&mut b, len, 5), len);
            assert!(stamp_ok(&b[..len], len as u32, 5) && check(&b[..len], len as u32, 5));
            assert!(!stamp_ok(&b[..len], len as u32, 6), "another call's tag at {len} bytes");
        }
        let mut b = vec![0u8; 16];
        stamp(&mut b, 16, 5);
        assert!(stamp_ok(&b, 16, 5) && !check(&b, 16, 5), "16 bytes hold two stamps");
    }

    #[test]
    fn a_plan_follows_the_header() {
        assert_eq!(
            plan(&Ask::Call { reply_size: 64, tag: 1, check: Check::Stamp }.encode()),
            Plan::Call { reply_size: 64, tag: 1, check: Check::Stamp }
        );
        assert_eq!(plan(&[]), Plan::Bad);
    }

    #[test]
    fn the_matrix_puts_rpc_on_the_first_connection_only() {
        let m = matrix(
            &Kind::ALL,
            &[Policy::Mw, Policy::Confirm],
            &[64, 4096, 65536],
            &[1, 16],
            Check::EveryByte,
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].1.len(), 2 + 3 * 3 * 2);
        assert_eq!(m[1].1.len(), 3 * 3 * 2);
        assert!(m[1].1.iter().all(|c| c.kind != Kind::Rpc));
        let some = matrix(&[Kind::DelegateRead], &[Policy::Mw], &[4096], &[1], Check::Stamp);
        assert_eq!(some[0].1.len(), 1);
        assert_eq!(some[0].1[0].name(), "delegate_read");
    }
}
