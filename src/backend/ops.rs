//! [`NicOps`]: the operations mwcap carries out on a NIC. Internal (the
//! public [`Nic`] is sealed over it); mwcap's own tests reach
//! it with the `testing` feature.

use super::*;

/// A NIC as mwcap uses it: one protection domain, its memory, windows,
/// completion queues and RC queue pairs.
///
/// All methods take `&self` and are safe to call from several threads; a
/// backend serialises internally where it must.
///
/// Methods that post work (`post_send`, `post_recv`) only enqueue; results
/// arrive as [`Completion`]s from [`NicOps::poll_cq`].
pub trait NicOps: Send + Sync {
    /// What the device says about itself. Flags are claims, not facts: the
    /// capability probe ([`crate::probe()`]) tries the operations instead.
    fn device_info(&self) -> DeviceInfo;

    /// Allocate `len` bytes of memory and register them with `access`.
    fn reg_mr(&self, len: usize, access: Access) -> Result<MrInfo, NicError>;
    /// Register memory allocated elsewhere with `access`, in this handle's
    /// protection domain: the same bytes may be registered in several PDs
    /// (an endpoint's region is, once per connection's PD). The region
    /// keeps `mem` allocated until it is deregistered (or, if that fails,
    /// for good).
    fn reg_memory(&self, mem: &std::sync::Arc<Memory>, access: Access) -> Result<MrInfo, NicError>;
    /// Deregister a region and free its memory.
    fn dereg_mr(&self, mr: MrId) -> Result<(), NicError>;
    /// Copy `data` into a region with the CPU (not a DMA).
    fn write_mr(&self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), NicError>;
    /// Copy bytes out of a region with the CPU (not a DMA).
    fn read_mr(&self, mr: MrId, offset: usize, out: &mut [u8]) -> Result<(), NicError>;

    /// The memory of a region, which a buffer handle
    /// ([`crate::conn::Buf`]) lends as a slice while it holds a range of
    /// it (see [`Memory`]); it stays allocated while an `Arc` of it lives.
    fn memory(&self, mr: MrId) -> Result<std::sync::Arc<Memory>, NicError>;

    /// Allocate a type-2 memory window. It starts unbound; its rkey's index
    /// bits are fixed for its life.
    fn alloc_mw(&self) -> Result<MwInfo, NicError>;
    /// Free a window. Freeing a bound window invalidates it.
    fn dealloc_mw(&self, mw: MwId) -> Result<(), NicError>;

    /// Another handle on the same device context with a protection domain
    /// of its own. Its regions, windows and queue pairs are invisible
    /// through this handle (and a key of one PD reaches nothing of the
    /// other), but completion queues belong to the device context, as in
    /// verbs: a queue pair of either handle may complete on a CQ created
    /// through either (an [`Endpoint`](crate::conn::Endpoint) serves many
    /// connections, each in its own PD, from one CQ).
    fn new_pd(&self) -> Result<Self, NicError>
    where
        Self: Sized;

    /// [`NicOps::new_pd`] through `dyn Nic`, boxed (the capability probe
    /// tries a SEND_WITH_INV from another protection domain).
    fn new_pd_boxed(&self) -> Result<Box<dyn Nic>, NicError>;

    /// Another handle on this handle's protection domain. The queue pairs
    /// made through it are its own and go with it; its regions and windows
    /// are the PD's (named by id through any of the PD's handles, as a
    /// hub's shared pool's buffers and windows are by its connections), and the PD's
    /// keys and shared receive queues ([`NicOps::create_srq`]) serve its
    /// queue pairs.
    /// An [`Endpoint`](crate::conn::Endpoint) with shared receives puts its
    /// connections in its own PD this way (which is safe under the mw policy
    /// only: see `docs/serving.md`). (The simulator's `same_pd` is a clone: every handle
    /// of the PD sees its objects, and they outlive the handle.)
    fn same_pd(&self) -> Result<Self, NicError>
    where
        Self: Sized;

    /// Create a completion queue with room for `depth` entries. It belongs
    /// to the device context: queue pairs of this handle and of its
    /// [`NicOps::new_pd`] siblings may use it.
    fn create_cq(&self, depth: u32) -> Result<CqId, NicError>;
    /// Destroy a completion queue. Its queue pairs must be gone first.
    fn destroy_cq(&self, cq: CqId) -> Result<(), NicError>;

    /// Create an RC queue pair in RESET, moved to INIT. The returned
    /// [`QpEndpoint`] is what the peer needs to connect to it.
    fn create_qp(&self, cfg: QpConfig) -> Result<QpEndpoint, NicError>;
    /// Move a queue pair through RTR to RTS towards `remote`.
    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), NicError>;
    /// Force a queue pair to ERR; every outstanding work request is flushed.
    fn set_qp_error(&self, qp: QpId) -> Result<(), NicError>;
    /// The queue pair's current state.
    fn qp_state(&self, qp: QpId) -> Result<QpState, NicError>;
    /// Destroy a queue pair. After this returns no DMA of it is in flight.
    fn destroy_qp(&self, qp: QpId) -> Result<(), NicError>;

    /// Post a chain of send-queue work requests with one doorbell. On an
    /// error none is posted if the chain was refused before the provider saw
    /// it (the simulator validates every request first), but a device's
    /// provider takes requests one by one and may have queued some or all of
    /// them (rxe queues them all, then fails the doorbell of a queue pair not
    /// ready to send): a caller must treat a failed chain as possibly posted.
    /// mwcap's connection goes down on it and takes no payload buffer back
    /// before its queue pair's flush or destroy.
    fn post_send(&self, qp: QpId, wrs: &[SendWr]) -> Result<(), NicError>;
    /// Post one receive buffer.
    fn post_recv(&self, qp: QpId, wr_id: u64, sge: Sge) -> Result<(), NicError>;

    /// Create a shared receive queue in this handle's protection domain
    /// with room for `max_wr` receives. Queue pairs created through this
    /// handle with [`QpConfig::srq`] take their receives from it: a
    /// SEND to any of them consumes the oldest receive posted, and its
    /// completion carries that QP's number on the QP's receive CQ. A QP
    /// that goes to ERR flushes none of the SRQ's receives.
    fn create_srq(&self, max_wr: u32) -> Result<SrqId, NicError>;
    /// Destroy a shared receive queue. Its queue pairs must be gone first;
    /// the receives still posted are dropped without completions.
    fn destroy_srq(&self, srq: SrqId) -> Result<(), NicError>;
    /// Post one receive buffer to a shared receive queue.
    fn post_srq_recv(&self, srq: SrqId, wr_id: u64, sge: Sge) -> Result<(), NicError>;
    /// Arm the SRQ limit (`ibv_modify_srq(IBV_SRQ_LIMIT)`): once fewer than
    /// `limit` receives remain posted, the device raises the limit event
    /// once and disarms; [`NicOps::take_srq_limit`] reports it. 0 disarms.
    fn arm_srq_limit(&self, srq: SrqId, limit: u32) -> Result<(), NicError>;
    /// Whether the SRQ's limit event came since the last call (taking it).
    /// On verbs this reads the device context's asynchronous events without
    /// blocking (one `read` that finds none when nothing happened).
    fn take_srq_limit(&self, srq: SrqId) -> Result<bool, NicError>;
    /// Take completions off a completion queue into `out` (at most
    /// `out.len()`); returns how many. Allocates nothing.
    fn poll_cq(&self, cq: CqId, out: &mut [Completion]) -> Result<usize, NicError>;

    /// [`NicOps::poll_cq`] into a fresh vector of at most `max` (a convenience
    /// for tests and tools; the data path polls into its own array).
    fn poll_cq_vec(&self, cq: CqId, max: usize) -> Result<Vec<Completion>, NicError> {
        let mut out = vec![Completion::EMPTY; max];
        let n = self.poll_cq(cq, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Readiness of a completion queue, for a driver that sleeps instead of
    /// spinning. `Ready` means "poll the queue again": a completion may be
    /// waiting. `Pending` means the queue is armed and `cx`'s waker will be
    /// woken at the next completion.
    ///
    /// Use it as `ibv_req_notify_cq(3)` says: poll until empty, then call
    /// this; on `Ready` poll again. The first call after a wake-up re-arms
    /// and returns `Ready`, so a completion that lands between the last poll
    /// and the arming is never missed. On verbs the waker is the completion
    /// channel's fd, registered with `async-io`; the simulator wakes it when
    /// it queues a completion (in [`Progress::Auto`](crate::sim::Progress)
    /// it first runs the fabric, as `poll_cq` does).
    fn poll_cq_ready(
        &self,
        cq: CqId,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), NicError>>;
}
