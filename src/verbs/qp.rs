//! RC queue pairs and their state transitions.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sys::{ibv_access_flags as acc, ibv_qp_attr_mask as mask, ibv_qp_state as qps};

use super::cq::Cq;
use super::pd::Pd;
use super::srq::Srq;
use super::sys::{check, last_error, mtu_enum, qp_state};
use crate::backend::{ack_timeout_exponent, NicError, QpConfig, QpEndpoint, QpId, QpState};

/// Where a queue pair lives: port, GID index and what was queried for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// The port number (from 1).
    pub port: u8,
    /// The GID index used for RoCE addressing (1 is `::ffff:<ipv4>` on rxe).
    pub gid_index: u8,
    /// The GID at that index.
    pub gid: [u8; 16],
    /// The port's LID.
    pub lid: u16,
    /// The port's active MTU in bytes.
    pub mtu: u32,
}

/// A reliable-connected queue pair: `struct ibv_qp`. It keeps its PD, its
/// completion queues and its shared receive queue (if any) alive.
pub struct Qp {
    ptr: NonNull<sys::ibv_qp>,
    port: PortInfo,
    psn: u32,
    max_rd_atomic: u8,
    rnr_retry: u8,
    /// The local ACK timeout's exponent (`backend::ack_timeout_exponent`).
    ack_timeout: u8,
    max_sge: u32,
    destroyed: bool,
    /// Keep its completion queues alive until it is gone (a QP is
    /// destroyed before its CQs).
    #[allow(dead_code)]
    send_cq: Arc<Cq>,
    #[allow(dead_code)]
    recv_cq: Arc<Cq>,
    /// Where its receives come from, instead of a receive queue of its own.
    srq: Option<Arc<Srq>>,
    /// Keeps the protection domain alive until this is gone (it is freed
    /// before its PD).
    #[allow(dead_code)]
    pd: Arc<Pd>,
}

// SAFETY: posting and modifying a QP are thread-safe in libibverbs (providers
// lock the queues); the Rust fields are immutable after creation.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// Create an RC queue pair and move it to INIT. `max_rd_atomic` and the
    /// queue sizes are used as given; clamp them to the device first.
    ///
    /// With `srq` the QP takes its receives from that shared receive queue
    /// (which must be of the same PD): it gets no receive queue of its own
    /// (`cfg.max_recv_wr` is ignored) and [`Qp::post_recv`] fails. `cfg.srq`
    /// (an id of the layer above) is not looked at here.
    pub fn create(
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        srq: Option<&Arc<Srq>>,
        cfg: &QpConfig,
        port: PortInfo,
    ) -> Result<Qp, NicError> {
        if let Some(s) = srq {
            if !Arc::ptr_eq(s.pd(), pd) {
                return Err(NicError::InvalidWr(
                    "a queue pair and its shared receive queue must be in the same protection domain".into(),
                ));
            }
        }
        // SAFETY: ibv_qp_init_attr holds integers and raw pointers; all-zero
        // (NULL pointers) is a valid value.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.as_ptr();
        init.recv_cq = recv_cq.as_ptr();
        init.cap.max_send_wr = cfg.max_send_wr;
        init.cap.max_send_sge = cfg.max_sge;
        match srq {
            Some(s) => init.srq = s.as_ptr(),
            None => {
                init.cap.max_recv_wr = cfg.max_recv_wr;
                init.cap.max_recv_sge = cfg.max_sge;
            }
        }
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: the PD, both CQs and the SRQ (if any) are alive and stay
        // alive as long as the QP (it holds Arcs to them); `init` is valid
        // for the call.
        let raw = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_create_qp"))?;
        let qp = Qp {
            ptr,
            port,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            max_rd_atomic: cfg.max_rd_atomic.max(1),
            rnr_retry: cfg.rnr_retry.min(7),
            ack_timeout: ack_timeout_exponent(cfg.ack_timeout),
            max_sge: cfg.max_sge,
            destroyed: false,
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(recv_cq),
            srq: srq.cloned(),
            pd: Arc::clone(pd),
        };
        let mut a = zeroed_attr();
        a.qp_state = qps::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port.port;
        a.qp_access_flags = acc::IBV_ACCESS_REMOTE_READ.0;
        qp.modify(
            "ibv_modify_qp(INIT)",
            &mut a,
            mask::IBV_QP_STATE.0
                | mask::IBV_QP_PKEY_INDEX.0
                | mask::IBV_QP_PORT.0
                | mask::IBV_QP_ACCESS_FLAGS.0,
        )?;
        Ok(qp)
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: the QP is alive while `self` lives; qp_num is set at creation.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    /// What a peer needs to connect to this QP; `id` is the caller's handle
    /// (the QPN when the caller has none).
    pub fn endpoint(&self, id: Option<QpId>) -> QpEndpoint {
        QpEndpoint {
            id: id.unwrap_or(QpId(self.qpn())),
            qpn: self.qpn(),
            gid: self.port.gid,
            psn: self.psn,
            mtu: self.port.mtu,
            lid: self.port.lid,
        }
    }

    /// Scatter entries per work request this QP was created with.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// The shared receive queue it takes its receives from, if any.
    pub fn srq(&self) -> Option<&Arc<Srq>> {
        self.srq.as_ref()
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_qp {
        self.ptr.as_ptr()
    }

    /// Move INIT → RTR → RTS towards `remote`. The path MTU is the smaller
    /// of both sides'.
    pub fn connect(&self, remote: &QpEndpoint) -> Result<(), NicError> {
        if remote.qpn > 0x00ff_ffff || remote.psn > 0x00ff_ffff {
            return Err(NicError::InvalidWr(format!(
                "remote qpn {:#x} or psn {:#x} does not fit 24 bits",
                remote.qpn, remote.psn
            )));
        }
        let mut a = zeroed_attr();
        a.qp_state = qps::IBV_QPS_RTR;
        a.path_mtu = mtu_enum(self.port.mtu.min(remote.mtu));
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = self.max_rd_atomic;
        // 20.48 ms between a peer's RNR retries (encoding 22): with its rnr_retry of 6
        // a driver may stall ~120 ms before the peer declares it dead.
        a.min_rnr_timer = 22;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid.raw = remote.gid;
        a.ah_attr.grh.sgid_index = self.port.gid_index;
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = self.port.port;
        self.modify(
            "ibv_modify_qp(RTR)",
            &mut a,
            mask::IBV_QP_STATE.0
                | mask::IBV_QP_AV.0
                | mask::IBV_QP_PATH_MTU.0
                | mask::IBV_QP_DEST_QPN.0
                | mask::IBV_QP_RQ_PSN.0
                | mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | mask::IBV_QP_MIN_RNR_TIMER.0,
        )?;
        let mut a = zeroed_attr();
        a.qp_state = qps::IBV_QPS_RTS;
        a.timeout = self.ack_timeout;
        a.retry_cnt = 7;
        a.rnr_retry = self.rnr_retry;
        a.sq_psn = self.psn;
        a.max_rd_atomic = self.max_rd_atomic;
        self.modify(
            "ibv_modify_qp(RTS)",
            &mut a,
            mask::IBV_QP_STATE.0
                | mask::IBV_QP_TIMEOUT.0
                | mask::IBV_QP_RETRY_CNT.0
                | mask::IBV_QP_RNR_RETRY.0
                | mask::IBV_QP_SQ_PSN.0
                | mask::IBV_QP_MAX_QP_RD_ATOMIC.0,
        )
    }

    /// Force the QP to ERR: every outstanding work request is flushed.
    pub fn set_error(&self) -> Result<(), NicError> {
        let mut a = zeroed_attr();
        a.qp_state = qps::IBV_QPS_ERR;
        self.modify("ibv_modify_qp(ERR)", &mut a, mask::IBV_QP_STATE.0)
    }

    /// The current state, as the device reports it.
    pub fn state(&self) -> Result<QpState, NicError> {
        let mut a = zeroed_attr();
        // SAFETY: ibv_qp_init_attr is integers and pointers; zero is valid.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is alive; both out-structs are valid and writable.
        let rc = unsafe { sys::ibv_query_qp(self.as_ptr(), &mut a, mask::IBV_QP_STATE.0 as i32, &mut init) };
        check("ibv_query_qp", rc)?;
        qp_state(a.qp_state)
            .ok_or_else(|| NicError::InvalidWr(format!("device reported unknown qp state {}", a.qp_state)))
    }

    fn modify(&self, op: &'static str, a: &mut sys::ibv_qp_attr, m: u32) -> Result<(), NicError> {
        // SAFETY: the QP is alive; `a` is a valid ibv_qp_attr whose fields
        // named in `m` are set (the layout is checked by tests/verbs_layout.rs).
        check(op, unsafe { sys::ibv_modify_qp(self.as_ptr(), a, m as i32) })
    }

    /// Destroy now, reporting failure. After success no DMA of this QP is in flight.
    // The QP comes back by value on failure: a move, on a cold path.
    #[allow(clippy::result_large_err)]
    pub fn close(mut self) -> Result<(), (Qp, NicError)> {
        match self.destroy() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn destroy(&mut self) -> Result<(), NicError> {
        if self.destroyed {
            return Ok(());
        }
        // SAFETY: the QP exists (flag) and is destroyed at most once.
        check("ibv_destroy_qp", unsafe { sys::ibv_destroy_qp(self.as_ptr()) })?;
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::warn!(error = %e, "ibv_destroy_qp failed");
        }
    }
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp").field("qpn", &self.qpn()).field("port", &self.port).finish()
    }
}

fn zeroed_attr() -> sys::ibv_qp_attr {
    // SAFETY: ibv_qp_attr holds integers and unions of integer arrays; the
    // all-zero value is valid (and what libibverbs' own examples start from).
    unsafe { std::mem::zeroed() }
}
