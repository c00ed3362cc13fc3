//! Plain data that crosses the [`Nic`](super::Nic) interface.

use std::fmt;
use std::time::Duration;

macro_rules! id_type {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub(crate) u32);

        impl $name {
            /// The raw number, for logs.
            pub fn raw(self) -> u32 {
                self.0
            }
            /// A handle from its raw number: for a backend of one's own, or a
            /// test that carries out a sans-IO connection's commands by hand.
            pub const fn from_raw(raw: u32) -> Self {
                Self(raw)
            }
        }
    };
}

id_type!(
    /// A registered memory region of one [`Nic`](super::Nic).
    MrId
);
id_type!(
    /// A type-2 memory window of one [`Nic`](super::Nic).
    MwId
);
id_type!(
    /// A completion queue of one [`Nic`](super::Nic).
    CqId
);
id_type!(
    /// A queue pair of one [`Nic`](super::Nic). Not the QPN: see [`QpEndpoint::qpn`].
    QpId
);
id_type!(
    /// A shared receive queue of one [`Nic`](super::Nic) (and its protection
    /// domain); see `NicOps::create_srq`.
    SrqId
);

/// Access rights of a memory region or window.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// No remote access; local read only.
    pub const NONE: Access = Access(0);
    /// The NIC may write the memory for local operations (a READ's destination, a RECV buffer).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote peers may RDMA WRITE (mwcap never grants this; here for the verbs suite).
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote peers may RDMA READ.
    pub const REMOTE_READ: Access = Access(4);
    /// Windows may be bound over the region.
    pub const MW_BIND: Access = Access(16);

    /// Whether every right of `other` is in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// The raw bits, equal to libibverbs' `IBV_ACCESS_*` values.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Rights from raw `IBV_ACCESS_*` bits; unknown bits are dropped.
    pub const fn from_bits_truncate(bits: u32) -> Access {
        Access(bits & 0x17)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Access::LOCAL_WRITE, "LOCAL_WRITE"),
            (Access::REMOTE_WRITE, "REMOTE_WRITE"),
            (Access::REMOTE_READ, "REMOTE_READ"),
            (Access::MW_BIND, "MW_BIND"),
        ];
        let set: Vec<&str> = names.iter().filter(|(a, _)| self.contains(*a)).map(|(_, n)| *n).collect();
        if set.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&set.join("|"))
        }
    }
}

/// What a device claims about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device name (`rxe0`, `mlx5_0`, `sim0`).
    pub name: String,
    /// The kernel driver or provider, when known (`rxe`, `mlx5`, `sim`).
    pub driver: String,
    /// The device advertises memory windows at all.
    pub mem_window: bool,
    /// The device advertises type-2A windows.
    pub mw_type_2a: bool,
    /// The device advertises type-2B windows.
    pub mw_type_2b: bool,
    /// How many windows the device says it can hold.
    pub max_mw: u32,
    /// How many scatter entries a send work request can carry.
    pub max_sge: u32,
    /// How many outstanding RDMA READs a QP may have as requester.
    pub max_qp_rd_atom: u32,
    /// The active path MTU in bytes.
    pub mtu: u32,
}

/// A registered memory region as returned by `NicOps::reg_mr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrInfo {
    /// The handle used in [`Sge`] and [`SendWr::BindMw`].
    pub id: MrId,
    /// The region's virtual address, as remote peers must name it.
    pub addr: u64,
    /// The region's length in bytes.
    pub len: usize,
    /// The region's local key.
    pub lkey: u32,
    /// The region's own remote key. mwcap's confirm policy hands this out;
    /// the MW policy never does.
    pub rkey: u32,
}

/// A memory window as returned by `NicOps::alloc_mw`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MwInfo {
    /// The handle used in [`SendWr::BindMw`].
    pub id: MwId,
    /// The rkey at allocation. Its index bits stay; see [`super::rkey`].
    pub rkey: u32,
}

/// How to create a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// Completion queue for send-queue work requests.
    pub send_cq: CqId,
    /// Completion queue for receive-queue work requests.
    pub recv_cq: CqId,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored when `srq` is set).
    pub max_recv_wr: u32,
    /// Take receives from this shared receive queue instead of a receive
    /// queue of the QP's own (`NicOps::post_recv`
    /// then fails). The SRQ must belong to the QP's protection domain (the
    /// handle's, or a `NicOps::same_pd` sibling's): rxe
    /// checks a receive's key against the QP's PD.
    pub srq: Option<SrqId>,
    /// Scatter entries per work request.
    pub max_sge: u32,
    /// Outstanding READs as requester and responder.
    pub max_rd_atomic: u8,
    /// Receiver-not-ready retries of a SEND before it fails with
    /// `RnrRetryExcErr`. 0..=6; 7 means "retry forever" on real NICs, which
    /// lets a peer that stops posting receives stall the sender for good.
    pub rnr_retry: u8,
    /// The local ACK timeout: how long a request waits for its
    /// acknowledgement before it is sent again, rounded up to 4.096 µs ×
    /// 2^n. The simulated NIC ignores it (its
    /// fabric's `Faults::ack_timeout` rules).
    pub ack_timeout: Duration,
}

/// The verbs encoding of an ACK timeout: the smallest `n` in 1..=31 with
/// 4.096 µs × 2^n at least `timeout` (0, "wait forever", is never used: a
/// lost packet must not stall a queue pair for good).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only verbs posts it
pub(crate) fn ack_timeout_exponent(timeout: Duration) -> u8 {
    let units = timeout.as_nanos().div_ceil(4096).max(2);
    (units.next_power_of_two().trailing_zeros() as u8).min(31)
}

impl QpConfig {
    /// A configuration with moderate depths over the given completion queues.
    pub fn new(send_cq: CqId, recv_cq: CqId) -> QpConfig {
        QpConfig {
            send_cq,
            recv_cq,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_sge: 4,
            max_rd_atomic: 16,
            rnr_retry: 6,
            ack_timeout: Duration::from_secs(1),
            srq: None,
        }
    }
}

/// What a peer needs to connect an RC queue pair to this one. Exchanged by
/// the TCP bootstrap (`crate::bootstrap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpEndpoint {
    /// The local handle (meaningless to the peer).
    pub id: QpId,
    /// The queue pair number.
    pub qpn: u32,
    /// The port's GID, 16 bytes (for RoCE, an IPv6 or IPv4-mapped address).
    pub gid: [u8; 16],
    /// The first packet sequence number this side sends.
    pub psn: u32,
    /// The path MTU in bytes (256..=4096).
    pub mtu: u32,
    /// The port's LID (0 on RoCE).
    pub lid: u16,
}

/// RC queue pair states, as in the InfiniBand spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Initialised; receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained (unused by mwcap).
    Sqd,
    /// Send queue error (unused for RC).
    Sqe,
    /// Error: every work request is flushed; no DMA will happen any more.
    Err,
}

/// One scatter/gather entry: a range of a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// The region.
    pub mr: MrId,
    /// Offset into the region.
    pub offset: usize,
    /// Bytes.
    pub len: u32,
}

impl Sge {
    const EMPTY: Sge = Sge { mr: MrId(u32::MAX), offset: 0, len: 0 };
}

/// The most scatter entries one work request carries in mwcap.
pub const MAX_SGE: usize = 4;

/// A work request's scatter/gather list, held inline (on the stack, or
/// inside the work request): posting allocates nothing. At most
/// [`MAX_SGE`] entries.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SgeList {
    len: u8,
    items: [Sge; MAX_SGE],
}

impl SgeList {
    /// An empty list (a zero-length SEND).
    pub const fn new() -> SgeList {
        SgeList { len: 0, items: [Sge::EMPTY; MAX_SGE] }
    }
    /// A list of one entry.
    pub const fn one(sge: Sge) -> SgeList {
        let mut l = SgeList::new();
        l.items[0] = sge;
        l.len = 1;
        l
    }
    /// Append an entry; gives it back when the list is full.
    pub fn push(&mut self, sge: Sge) -> Result<(), Sge> {
        let i = self.len as usize;
        if i == MAX_SGE {
            return Err(sge);
        }
        self.items[i] = sge;
        self.len += 1;
        Ok(())
    }
    /// The total number of bytes.
    pub fn bytes(&self) -> u64 {
        self.iter().map(|s| u64::from(s.len)).sum()
    }
}

impl Default for SgeList {
    fn default() -> SgeList {
        SgeList::new()
    }
}

impl<'a> IntoIterator for &'a SgeList {
    type Item = &'a Sge;
    type IntoIter = std::slice::Iter<'a, Sge>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl std::ops::Deref for SgeList {
    type Target = [Sge];
    fn deref(&self) -> &[Sge] {
        &self.items[..self.len as usize]
    }
}

impl fmt::Debug for SgeList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<const N: usize> From<[Sge; N]> for SgeList {
    /// # Panics
    /// If `N` exceeds [`MAX_SGE`].
    fn from(a: [Sge; N]) -> SgeList {
        assert!(N <= MAX_SGE, "a work request carries at most {MAX_SGE} scatter entries, not {N}");
        let mut l = SgeList::new();
        l.items[..N].copy_from_slice(&a);
        l.len = N as u8;
        l
    }
}

impl TryFrom<&[Sge]> for SgeList {
    type Error = NicError;
    fn try_from(s: &[Sge]) -> Result<SgeList, NicError> {
        if s.len() > MAX_SGE {
            return Err(NicError::InvalidWr(format!(
                "{} scatter entries; a work request carries at most {MAX_SGE}",
                s.len()
            )));
        }
        let mut l = SgeList::new();
        l.items[..s.len()].copy_from_slice(s);
        l.len = s.len() as u8;
        Ok(l)
    }
}

/// A send-queue work request. Lists of these are posted with one doorbell by
/// `NicOps::post_send`. Plain data (`Copy`): a chain
/// is built on the stack and posting allocates nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendWr {
    /// A two-sided SEND of the bytes in `sge`.
    Send {
        /// Returned in the completion.
        wr_id: u64,
        /// Whether a successful completion is generated.
        signaled: bool,
        /// The payload.
        sge: SgeList,
    },
    /// A SEND that also invalidates `invalidate_rkey` at the receiver.
    SendWithInv {
        /// Returned in the completion.
        wr_id: u64,
        /// Whether a successful completion is generated.
        signaled: bool,
        /// The payload.
        sge: SgeList,
        /// The remote window's rkey to invalidate. Invalidating a window that
        /// is not bound with exactly this key is a protocol bug (and crashes rxe).
        invalidate_rkey: u32,
    },
    /// An RDMA READ of `remote_addr..+len(local)` through `rkey` into `local`.
    Read {
        /// Returned in the completion.
        wr_id: u64,
        /// Whether a successful completion is generated.
        signaled: bool,
        /// The destination scatter list.
        local: SgeList,
        /// The remote virtual address.
        remote_addr: u64,
        /// The remote key (window or region).
        rkey: u32,
    },
    /// Bind a type-2 window over `mr[offset..offset+len]` for the posting QP.
    BindMw {
        /// Returned in the completion.
        wr_id: u64,
        /// Whether a successful completion is generated.
        signaled: bool,
        /// The window.
        mw: MwId,
        /// The new rkey: the window's index with a fresh consumer key
        /// ([`super::rkey::rebind`]).
        rkey: u32,
        /// The region to bind over.
        mr: MrId,
        /// Start of the window inside the region.
        offset: usize,
        /// Length of the window.
        len: usize,
        /// Rights granted through the window.
        access: Access,
    },
    /// Invalidate a window (or region) by rkey, locally.
    LocalInv {
        /// Returned in the completion.
        wr_id: u64,
        /// Whether a successful completion is generated.
        signaled: bool,
        /// The rkey to invalidate.
        rkey: u32,
    },
}

impl SendWr {
    /// The work request id.
    pub fn wr_id(&self) -> u64 {
        match self {
            SendWr::Send { wr_id, .. }
            | SendWr::SendWithInv { wr_id, .. }
            | SendWr::Read { wr_id, .. }
            | SendWr::BindMw { wr_id, .. }
            | SendWr::LocalInv { wr_id, .. } => *wr_id,
        }
    }
    /// The opcode its completion will carry.
    pub fn opcode(&self) -> WcOpcode {
        match self {
            SendWr::Send { .. } | SendWr::SendWithInv { .. } => WcOpcode::Send,
            SendWr::Read { .. } => WcOpcode::RdmaRead,
            SendWr::BindMw { .. } => WcOpcode::BindMw,
            SendWr::LocalInv { .. } => WcOpcode::LocalInv,
        }
    }
    /// Whether it asks for a completion on success.
    pub fn signaled(&self) -> bool {
        match self {
            SendWr::Send { signaled, .. }
            | SendWr::SendWithInv { signaled, .. }
            | SendWr::Read { signaled, .. }
            | SendWr::BindMw { signaled, .. }
            | SendWr::LocalInv { signaled, .. } => *signaled,
        }
    }
}

/// Completion status, as `ibv_wc_status` (subset mwcap distinguishes; the
/// rest map to [`WcStatus::Other`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// Success.
    Success,
    /// Local length error.
    LocLenErr,
    /// Local QP operation error (e.g. LOCAL_INV with a wrong key).
    LocQpOpErr,
    /// Local protection error (bad lkey or range).
    LocProtErr,
    /// Flushed because the QP went to ERR.
    WrFlushErr,
    /// Memory window bind error.
    MwBindErr,
    /// Remote invalid request.
    RemInvReqErr,
    /// Remote access error: bad rkey, range or rights.
    RemAccessErr,
    /// Remote operation error.
    RemOpErr,
    /// Transport retries exhausted: the peer is gone or the link is down.
    RetryExcErr,
    /// Receiver-not-ready retries exhausted.
    RnrRetryExcErr,
    /// Any other status, with its raw value.
    Other(u32),
}

impl WcStatus {
    /// Whether it is [`WcStatus::Success`].
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

/// Completion opcode, as `ibv_wc_opcode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND (with or without invalidate) finished.
    Send,
    /// An RDMA READ finished.
    RdmaRead,
    /// An RDMA WRITE finished (never posted by mwcap).
    RdmaWrite,
    /// A window bind finished.
    BindMw,
    /// A local invalidation finished.
    LocalInv,
    /// A receive finished.
    Recv,
    /// Any other opcode, with its raw value.
    Other(u32),
}

/// A work completion, owned.
///
/// For flushed work requests ([`WcStatus::WrFlushErr`]) the verbs spec leaves
/// `opcode` and `byte_len` undefined; backends report the posted opcode where
/// they know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The posted work request's id.
    pub wr_id: u64,
    /// The outcome.
    pub status: WcStatus,
    /// The operation.
    pub opcode: WcOpcode,
    /// Bytes received (RECV) or read (READ).
    pub byte_len: u32,
    /// For a RECV of a SEND_WITH_INV: the rkey the sender invalidated here.
    /// Backends fill it from `invalidated_rkey` whether or not the
    /// `IBV_WC_WITH_INV` flag is set (rxe sets the wrong flag).
    pub invalidated_rkey: Option<u32>,
    /// The local QP number the completion belongs to.
    pub qpn: u32,
    /// The provider's vendor error, 0 if none.
    pub vendor_err: u32,
}

impl Completion {
    /// A placeholder to fill arrays that `NicOps::poll_cq`
    /// writes into.
    pub const EMPTY: Completion = Completion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Other(0),
        byte_len: 0,
        invalidated_rkey: None,
        qpn: 0,
        vendor_err: 0,
    };
}

/// Why a [`Nic`](super::Nic) call failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NicError {
    /// The device does not support the operation at all.
    #[error("{op} is not supported by this device ({detail}); use the confirm policy")]
    Unsupported {
        /// What was tried.
        op: &'static str,
        /// What the device or provider said.
        detail: String,
    },
    /// The OS or provider returned an error.
    #[error("{op} failed: {source}")]
    Os {
        /// What was tried.
        op: &'static str,
        /// The errno.
        #[source]
        source: OsError,
    },
    /// A handle does not name a live object of this device.
    #[error("{what} {id} does not exist on this device (already destroyed?)")]
    NoSuchObject {
        /// The kind of object.
        what: &'static str,
        /// The handle.
        id: u32,
    },
    /// A scatter entry or offset lies outside its region.
    #[error("range {offset}..{end} is outside memory region {mr} of {len} bytes")]
    OutOfRange {
        /// The region.
        mr: u32,
        /// Start offset.
        offset: usize,
        /// End offset.
        end: usize,
        /// The region's length.
        len: usize,
    },
    /// The queue pair is not in a state that allows the operation.
    #[error("queue pair {qp} is in state {state:?}; {op} needs {needs}")]
    BadQpState {
        /// The queue pair.
        qp: u32,
        /// Its state.
        state: QpState,
        /// What was tried.
        op: &'static str,
        /// What state it needs.
        needs: &'static str,
    },
    /// A CPU access (`write_mr`, `read_mr`)
    /// reached bytes a buffer handle ([`crate::conn::Buf`]) holds: while a
    /// handle holds them, only it reads or writes them.
    #[error("bytes {offset}..{end} of memory region {mr} are lent to a buffer handle (Buf): read and write them through the handle, or after it is given back")]
    Held {
        /// The region.
        mr: u32,
        /// Start of the held range.
        offset: usize,
        /// End of the held range.
        end: usize,
    },
    /// The work request is malformed (e.g. a bind whose rkey has another window's index).
    #[error("invalid work request: {0}")]
    InvalidWr(String),
    /// A completion queue deeper than the device allows was asked for.
    #[error("a completion queue of {depth} entries was asked for and the device holds at most {max}; ask for fewer (a shared queue: serve fewer connections on it)")]
    CqTooDeep {
        /// The depth asked for.
        depth: u32,
        /// The device's `max_cqe`.
        max: u32,
    },
    /// The queue is full.
    #[error("{queue} is full ({depth} entries); poll completions before posting more")]
    QueueFull {
        /// Which queue.
        queue: &'static str,
        /// Its depth.
        depth: u32,
    },
}

/// An OS error number with its text, cloneable (unlike `std::io::Error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text} (errno {errno})")]
pub struct OsError {
    /// The errno.
    pub errno: i32,
    /// `strerror` text.
    pub text: String,
}

impl OsError {
    /// An OS error from an errno.
    pub fn from_errno(errno: i32) -> OsError {
        OsError { errno, text: std::io::Error::from_raw_os_error(errno).to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The encoding rounds up to 4.096 µs × 2^n and stays within 1..=31.
    #[test]
    fn ack_timeouts_round_up_to_the_verbs_encoding() {
        let us = |n: u64| Duration::from_nanos(n * 4096);
        assert_eq!(ack_timeout_exponent(Duration::ZERO), 1);
        assert_eq!(ack_timeout_exponent(us(2)), 1);
        assert_eq!(ack_timeout_exponent(us(2) + Duration::from_nanos(1)), 2);
        // 67.1 ms, what mwcap used before 1 s.
        assert_eq!(ack_timeout_exponent(us(1 << 14)), 14);
        // The default: 1 s rounds up to 1.07 s.
        assert_eq!(ack_timeout_exponent(Duration::from_secs(1)), 18);
        assert_eq!(ack_timeout_exponent(Duration::from_secs(1 << 20)), 31);
    }
}
