//! Posting work requests: `ibv_post_send` chains and `ibv_post_recv`.
//!
//! Work requests name local memory as [`Slice`]s of a registered [`Mr`],
//! bounds-checked when built, so a post can never point the NIC at memory
//! the region does not own. Remote addresses and rkeys are the peer's
//! business: a wrong one only earns a remote access error.
//!
//! Nothing here allocates: scatter lists are inline ([`SliceList`]), and a
//! chain of at most [`MAX_CHAIN`] requests is built as C structs in a
//! [`SendChain`] on the caller's stack.

use std::ptr;

use parking_lot::MutexGuard;
use rdma_mummy_sys as sys;
use sys::{ibv_send_flags, ibv_wr_opcode as op};

use super::mr::Mr;
use super::mw::Mw;
use super::qp::Qp;
use super::sys::{errno, from_errno};
use crate::backend::{rkey, Access, NicError, MAX_SGE};

/// The most work requests one post chains. Longer chains are refused with
/// [`NicError::InvalidWr`]: post them in several calls.
pub const MAX_CHAIN: usize = 8;

/// The error for a chain longer than [`MAX_CHAIN`].
pub(super) fn chain_too_long(n: usize) -> NicError {
    NicError::InvalidWr(format!(
        "{n} work requests in one post; the verbs backend chains at most {MAX_CHAIN}: post the rest in another call"
    ))
}

/// The error for a receive posted to a queue pair that takes its receives
/// from a shared receive queue.
pub(super) fn srq_recv_error(qpn: u32) -> NicError {
    NicError::InvalidWr(format!(
        "queue pair {qpn:#x} takes its receives from a shared receive queue: post them to the SRQ (post_srq_recv)"
    ))
}

/// A checked range of a registered region, for a scatter/gather entry.
#[derive(Clone, Copy, Debug)]
pub struct Slice<'a> {
    mr: &'a Mr,
    offset: usize,
    len: u32,
}

impl<'a> Slice<'a> {
    /// `mr[offset..offset+len]`, or an error when it does not fit.
    pub fn new(mr: &'a Mr, offset: usize, len: u32) -> Result<Slice<'a>, NicError> {
        mr.check_range(offset, len as usize)?;
        Ok(Slice { mr, offset, len })
    }

    pub(super) fn sge(&self) -> sys::ibv_sge {
        sys::ibv_sge { addr: self.mr.addr() + self.offset as u64, length: self.len, lkey: self.mr.lkey() }
    }
}

/// A scatter list of at most `MAX_SGE` (4) slices, held inline.
#[derive(Clone, Copy, Debug, Default)]
pub struct SliceList<'a> {
    len: u8,
    items: [Option<Slice<'a>>; MAX_SGE],
}

impl<'a> SliceList<'a> {
    /// An empty list.
    pub const fn new() -> SliceList<'a> {
        SliceList { len: 0, items: [None; MAX_SGE] }
    }

    /// Append a slice; gives it back when the list is full.
    pub fn push(&mut self, s: Slice<'a>) -> Result<(), Slice<'a>> {
        let i = self.len as usize;
        if i == MAX_SGE {
            return Err(s);
        }
        self.items[i] = Some(s);
        self.len += 1;
        Ok(())
    }

    /// How many slices.
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    /// The slices in order.
    pub fn iter(&self) -> impl Iterator<Item = &Slice<'a>> {
        self.items[..self.len()].iter().flatten()
    }
}

impl<'a, const N: usize> From<[Slice<'a>; N]> for SliceList<'a> {
    /// # Panics
    /// If `N` exceeds `MAX_SGE` (4).
    fn from(a: [Slice<'a>; N]) -> SliceList<'a> {
        let mut l = SliceList::new();
        for s in a {
            assert!(l.push(s).is_ok(), "a work request carries at most {MAX_SGE} scatter entries, not {N}");
        }
        l
    }
}

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug)]
pub enum SendOp<'a> {
    /// SEND the bytes of the scatter list.
    Send(SliceList<'a>),
    /// SEND that also invalidates `rkey` at the receiver.
    SendWithInv(SliceList<'a>, u32),
    /// RDMA READ `remote_addr..+total length` through `rkey` into the scatter list.
    Read {
        /// Destination.
        local: SliceList<'a>,
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Bind `mw` over `mr[offset..offset+len]` with `access`, under the new `rkey`.
    BindMw {
        /// The window.
        mw: &'a Mw,
        /// The new rkey ([`crate::backend::rkey::rebind`] of the window's).
        rkey: u32,
        /// The region.
        mr: &'a Mr,
        /// Start inside the region.
        offset: usize,
        /// Length.
        len: usize,
        /// Rights through the window.
        access: Access,
    },
    /// Invalidate `rkey` locally.
    LocalInv(u32),
}

/// One send-queue work request.
#[derive(Clone, Copy, Debug)]
pub struct SendRequest<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Whether success produces a completion.
    pub signaled: bool,
    /// The operation.
    pub op: SendOp<'a>,
}

/// Why a post failed, and how many of the chain's requests the provider took.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error} ({})", taken(*.failed, *.posted))]
pub struct PostError {
    /// What went wrong.
    #[source]
    pub error: NicError,
    /// Index of the failing request; the chain's length when the provider
    /// named none (it queued every request and failed after: rxe's doorbell
    /// fails so on a queue pair not yet ready to send).
    pub failed: usize,
    /// How many requests the provider took (they will execute or be
    /// flushed, and complete).
    pub posted: usize,
}

fn taken(failed: usize, posted: usize) -> String {
    if failed == posted {
        format!("after the provider took all {posted} of the chain's work requests")
    } else {
        format!("work request {failed} of the chain; {posted} before it were posted")
    }
}

/// A validated chain of send requests as libibverbs structs, built in
/// place on the caller's stack ([`SendChain::new`], then
/// [`SendChain::push`] for each request) and posted with one doorbell by
/// [`SendChain::post`]; it is never moved (a chain is about 430 bytes: its
/// two moves a post, when `Qp::prepare_send` returned it and `post` took
/// it by value, cost about 280 instructions on rxe). It borrows the QP,
/// the regions and the windows it names, so none can go away before it is
/// posted. `N` is the room it has (at most [`MAX_CHAIN`]): the backend
/// builds the usual chain, one or two requests, in arrays of two.
pub struct SendChain<'a, const N: usize = MAX_CHAIN> {
    qp: &'a Qp,
    len: usize,
    wrs: [sys::ibv_send_wr; N],
    sges: [[sys::ibv_sge; MAX_SGE]; N],
    /// For each request that binds a window: the window and its new rkey.
    binds: [Option<(&'a Mw, u32)>; N],
}

impl Qp {
    /// Post one receive request with a scatter list of at most
    /// `MAX_SGE` (4) slices.
    pub fn post_recv(&self, wr_id: u64, local: &[Slice<'_>]) -> Result<(), NicError> {
        if self.srq().is_some() {
            return Err(srq_recv_error(self.qpn()));
        }
        if local.len() > (self.max_sge() as usize).min(MAX_SGE) {
            return Err(NicError::InvalidWr(format!(
                "{} scatter entries, the queue pair takes {}",
                local.len(),
                (self.max_sge() as usize).min(MAX_SGE)
            )));
        }
        let mut sg = [sys::ibv_sge { addr: 0, length: 0, lkey: 0 }; MAX_SGE];
        for (sge, s) in sg.iter_mut().zip(local) {
            *sge = s.sge();
        }
        let mut wr = sys::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: sg.as_mut_ptr(),
            num_sge: local.len() as i32,
        };
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the QP is alive; `wr` and `sg` live until the call returns;
        // the scatter entries lie inside registered regions borrowed for the call.
        let rc = unsafe { sys::ibv_post_recv(self.as_ptr(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(from_errno("ibv_post_recv", post_errno(rc)))
        }
    }
}

impl<'a, const N: usize> SendChain<'a, N> {
    /// An empty chain on `qp`, built in place with [`SendChain::push`].
    #[inline]
    pub fn new(qp: &'a Qp) -> Self {
        SendChain {
            qp,
            len: 0,
            // SAFETY: ibv_send_wr is integers, raw pointers and unions of
            // those; all-zero (NULL `next`, no scatter list) is valid.
            wrs: unsafe { std::mem::zeroed() },
            sges: [[sys::ibv_sge { addr: 0, length: 0, lkey: 0 }; MAX_SGE]; N],
            binds: [None; N],
        }
    }

    /// Validate `r` and build it as a C work request at the end of the
    /// chain. Checks everything the device would otherwise fail on later
    /// or not at all: the chain's room (`N`, at most [`MAX_CHAIN`]), the
    /// scatter list's size, a bind's range and that its rkey carries its
    /// window's index. On an error the chain is as it was (`posted: 0`,
    /// `failed`: the request's index).
    pub fn push(&mut self, r: &SendRequest<'a>) -> Result<(), PostError> {
        let i = self.len;
        let fail = |error| PostError { error, failed: i, posted: 0 };
        if i >= N.min(MAX_CHAIN) {
            return Err(fail(chain_too_long(i + 1)));
        }
        self.binds[i] = None;
        let list = match &r.op {
            SendOp::Send(l) | SendOp::SendWithInv(l, _) | SendOp::Read { local: l, .. } => *l,
            SendOp::BindMw { mw, rkey: new, mr, offset, len, .. } => {
                mr.check_range(*offset, *len).map_err(fail)?;
                if !mw.owns_rkey(*new) {
                    return Err(fail(NicError::InvalidWr(format!(
                        "bind rkey {new:#x} does not carry the window's index {:#x}",
                        rkey::index(mw.rkey())
                    ))));
                }
                self.binds[i] = Some((*mw, *new));
                SliceList::new()
            }
            SendOp::LocalInv(_) => SliceList::new(),
        };
        if list.len() > self.qp.max_sge() as usize {
            return Err(fail(NicError::InvalidWr(format!(
                "{} scatter entries, the queue pair takes {}",
                list.len(),
                self.qp.max_sge()
            ))));
        }
        for (sge, s) in self.sges[i].iter_mut().zip(list.iter()) {
            *sge = s.sge();
        }
        let wr = &mut self.wrs[i];
        wr.wr_id = r.wr_id;
        wr.num_sge = list.len() as i32;
        wr.send_flags = if r.signaled { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
        match &r.op {
            SendOp::Send(_) => wr.opcode = op::IBV_WR_SEND,
            SendOp::SendWithInv(_, inv) => {
                wr.opcode = op::IBV_WR_SEND_WITH_INV;
                wr.imm_data_invalidated_rkey_union.invalidated_rkey = *inv;
            }
            SendOp::Read { remote_addr, rkey, .. } => {
                wr.opcode = op::IBV_WR_RDMA_READ;
                wr.wr.rdma = sys::rdma_t { remote_addr: *remote_addr, rkey: *rkey };
            }
            SendOp::BindMw { mw, rkey, mr, offset, len, access } => {
                wr.opcode = op::IBV_WR_BIND_MW;
                wr.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
                    mw: mw.as_ptr(),
                    rkey: *rkey,
                    bind_info: sys::ibv_mw_bind_info {
                        mr: mr.as_ptr(),
                        addr: mr.addr() + *offset as u64,
                        length: *len as u64,
                        mw_access_flags: access.bits(),
                    },
                };
            }
            SendOp::LocalInv(inv) => {
                wr.opcode = op::IBV_WR_LOCAL_INV;
                wr.imm_data_invalidated_rkey_union.invalidated_rkey = *inv;
            }
        }
        self.len = i + 1;
        Ok(())
    }
}

impl<const N: usize> SendChain<'_, N> {
    /// Post the chain with one `ibv_post_send`.
    ///
    /// The windows it binds are locked (in address order, so two chains
    /// cannot deadlock) across the post and the rkey write-back: rxe's
    /// provider reads `ibv_mw.rkey` inside the call. On return, each window
    /// bound by a posted request tracks the bind's new rkey. The chain is
    /// empty afterwards, whatever the outcome: posting it again posts
    /// nothing.
    pub fn post(&mut self) -> Result<(), PostError> {
        let n = std::mem::replace(&mut self.len, 0);
        if n == 0 {
            return Ok(());
        }
        // Link the chain now that it has its final address (`self` is
        // borrowed mutably and does not move during this call). All pointers come from one
        // raw pointer per array, so none is invalidated by a later borrow.
        let wrs = self.wrs.as_mut_ptr();
        let sges = self.sges.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n <= MAX_CHAIN, and `wrs.add(i + 1)` is formed only
            // when i + 1 < n, so every pointer is in bounds of its array; no
            // reference into either array is live while we write through them.
            unsafe {
                let wr = &mut *wrs.add(i);
                wr.sg_list = (*sges.add(i)).as_mut_ptr();
                wr.next = if i + 1 < n { wrs.add(i + 1) } else { ptr::null_mut() };
            }
        }
        let mut bound = [None::<&Mw>; N];
        let mut k = 0;
        for (mw, _) in self.binds[..n].iter().flatten() {
            bound[k] = Some(*mw);
            k += 1;
        }
        bound[..k].sort_unstable_by_key(|m| m.map_or(0, |m| m.as_ptr() as usize));
        let mut guards: [Option<MutexGuard<'_, ()>>; N] = std::array::from_fn(|_| None);
        let mut last: *const Mw = ptr::null();
        for (g, mw) in guards.iter_mut().zip(bound[..k].iter().flatten()) {
            if !ptr::eq(*mw, last) {
                *g = Some(mw.lock_binds());
                last = *mw;
            }
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is alive (borrowed); the chain and the scatter lists
        // it points to live in `self` until the call returns (the provider
        // copies them into its queue); every local address is inside a
        // registered region that outlives the call (the `Slice` borrows
        // checked at `push`); every bound window is locked; the
        // struct layouts match the C headers (tests/verbs_layout.rs).
        let rc = unsafe { sys::ibv_post_send(self.qp.as_ptr(), wrs, &mut bad) };
        // Which requests the provider took: those before `bad` (pointer
        // comparisons only). With no `bad` in the chain, all of them: rxe
        // queues every request, then fails its doorbell with `bad` NULL, and
        // a request that may run counts as posted (its window's new rkey
        // recorded, its record kept for its completion).
        let posted =
            if rc == 0 { n } else { (0..n).find(|&i| ptr::eq(wrs.wrapping_add(i), bad)).unwrap_or(n) };
        for (mw, new) in self.binds[..posted].iter().flatten() {
            // SAFETY: `guards` holds the bind lock of every window in the chain.
            unsafe { mw.set_rkey(*new) };
        }
        drop(guards);
        if rc == 0 {
            Ok(())
        } else {
            Err(PostError { error: from_errno("ibv_post_send", post_errno(rc)), failed: posted, posted })
        }
    }
}

/// Providers return an errno, a negated errno, or -1 with `errno` set.
pub(super) fn post_errno(rc: i32) -> i32 {
    if rc == -1 {
        errno()
    } else {
        rc.saturating_abs()
    }
}
