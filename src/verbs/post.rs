//! Posting work requests: `ibv_post_send` chains and `ibv_post_recv`.
//!
//! Work requests name local memory as [`Slice`]s of a registered [`Mr`],
//! bounds-checked when built, so a post can never point the NIC at memory
//! the region does not own. Remote addresses and rkeys are the peer's
//! business: a wrong one only earns a remote access error.

use rdma_mummy_sys as sys;
use sys::{ibv_send_flags, ibv_wr_opcode as op};

use super::mr::Mr;
use super::mw::Mw;
use super::qp::Qp;
use super::sys::{errno, from_errno};
use crate::backend::{rkey, Access, NicError};

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

    fn sge(&self) -> sys::ibv_sge {
        sys::ibv_sge { addr: self.mr.addr() + self.offset as u64, length: self.len, lkey: self.mr.lkey() }
    }
}

/// What a send-queue work request does.
#[derive(Clone, Debug)]
pub enum SendOp<'a> {
    /// SEND the bytes of the scatter list.
    Send(Vec<Slice<'a>>),
    /// SEND that also invalidates `rkey` at the receiver.
    SendWithInv(Vec<Slice<'a>>, u32),
    /// RDMA READ `remote_addr..+total length` through `rkey` into the scatter list.
    Read {
        /// Destination.
        local: Vec<Slice<'a>>,
        /// Remote virtual address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Bind `mw` over `mr[offset..offset+len]` with `access`, under the new `rkey`.
    BindMw {
        /// The window.
        mw: &'a Mw,
        /// The new rkey ([`Mw::next_rkey`]).
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
#[derive(Clone, Debug)]
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
#[error("{error} (work request {failed} of the chain; {posted} before it were posted)")]
pub struct PostError {
    /// What went wrong.
    #[source]
    pub error: NicError,
    /// Index of the failing request.
    pub failed: usize,
    /// How many requests before it were handed to the device (they will complete).
    pub posted: usize,
}

impl Qp {
    /// Post a chain of send requests with one `ibv_post_send`.
    ///
    /// Every request is validated first (scatter list sizes, bind ranges and
    /// rkeys), so a malformed chain posts nothing. On success each bound
    /// window's tracked rkey becomes the bind's new rkey.
    pub fn post_send(&self, reqs: &[SendRequest<'_>]) -> Result<(), PostError> {
        let fail = |failed, error| PostError { error, failed, posted: 0 };
        // Scatter entries first, all of them, so their addresses are stable
        // while the work requests point at them.
        let mut sges: Vec<Vec<sys::ibv_sge>> = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            let list: &[Slice<'_>] = match &r.op {
                SendOp::Send(l) | SendOp::SendWithInv(l, _) | SendOp::Read { local: l, .. } => l,
                SendOp::BindMw { mw, rkey: new, mr, offset, len, .. } => {
                    mr.check_range(*offset, *len).map_err(|e| fail(i, e))?;
                    if !mw.owns_rkey(*new) {
                        return Err(fail(
                            i,
                            NicError::InvalidWr(format!(
                                "bind rkey {new:#x} does not carry the window's index {:#x}",
                                rkey::index(mw.rkey())
                            )),
                        ));
                    }
                    &[]
                }
                SendOp::LocalInv(_) => &[],
            };
            if list.len() > self.max_sge() as usize {
                return Err(fail(
                    i,
                    NicError::InvalidWr(format!(
                        "{} scatter entries, the queue pair takes {}",
                        list.len(),
                        self.max_sge()
                    )),
                ));
            }
            sges.push(list.iter().map(Slice::sge).collect());
        }

        let mut wrs: Vec<sys::ibv_send_wr> = Vec::with_capacity(reqs.len());
        for (r, sg) in reqs.iter().zip(sges.iter_mut()) {
            // SAFETY: ibv_send_wr is integers, raw pointers and unions of
            // those; all-zero (NULL `next`, no scatter list) is valid.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = r.wr_id;
            wr.sg_list = sg.as_mut_ptr();
            wr.num_sge = sg.len() as i32;
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
            wrs.push(wr);
        }
        // Link the chain; the Vec is not resized from here on.
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let Some(first) = wrs.first_mut() else { return Ok(()) };
        // Lock every window bound in the chain (in address order, so two
        // chains cannot deadlock) across the post and the rkey write-back.
        let mut bound: Vec<&Mw> = reqs
            .iter()
            .filter_map(|r| if let SendOp::BindMw { mw, .. } = &r.op { Some(*mw) } else { None })
            .collect();
        bound.sort_by_key(|m| m.as_ptr() as usize);
        bound.dedup_by(|a, b| std::ptr::eq(*a, *b));
        let _guards: Vec<_> = bound.iter().map(|m| m.lock_binds()).collect();
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; the chain and the scatter lists it points
        // to live in `wrs`/`sges` until the call returns (the provider copies
        // them into its queue); every local address is inside a registered
        // region that outlives the call (the `Slice` borrows); the struct
        // layouts match the C headers (tests/verbs_layout.rs).
        let rc = unsafe { sys::ibv_post_send(self.as_ptr(), first, &mut bad) };
        let posted =
            if rc == 0 { reqs.len() } else { wrs.iter().position(|w| std::ptr::eq(w, bad)).unwrap_or(0) };
        for r in &reqs[..posted] {
            if let SendOp::BindMw { mw, rkey, .. } = &r.op {
                // SAFETY: `_guards` holds the bind lock of every window in the chain.
                unsafe { mw.set_rkey(*rkey) };
            }
        }
        if rc == 0 {
            Ok(())
        } else {
            Err(PostError { error: from_errno("ibv_post_send", post_errno(rc)), failed: posted, posted })
        }
    }

    /// Post one receive request with a scatter list.
    pub fn post_recv(&self, wr_id: u64, local: &[Slice<'_>]) -> Result<(), NicError> {
        if local.len() > self.max_sge() as usize {
            return Err(NicError::InvalidWr(format!(
                "{} scatter entries, the queue pair takes {}",
                local.len(),
                self.max_sge()
            )));
        }
        let mut sg: Vec<sys::ibv_sge> = local.iter().map(Slice::sge).collect();
        let mut wr = sys::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: sg.as_mut_ptr(),
            num_sge: sg.len() as i32,
        };
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
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

/// Providers return an errno, a negated errno, or -1 with `errno` set.
fn post_errno(rc: i32) -> i32 {
    if rc == -1 {
        errno()
    } else {
        rc.saturating_abs()
    }
}
