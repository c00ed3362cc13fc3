//! Completion queues with a completion channel usable from async code.

use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use rdma_mummy_sys as sys;

use super::device::Context;
use super::sys::{check, errno, from_errno, last_error, wc_opcode, wc_status};
use crate::backend::{Completion, NicError, OsError, WcOpcode};

/// A completion channel: `struct ibv_comp_channel`, its fd non-blocking.
pub struct CompChannel {
    ptr: NonNull<sys::ibv_comp_channel>,
    ctx: Arc<Context>,
}

// SAFETY: the channel is a file descriptor wrapper; libibverbs allows using
// it from any thread.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// Create a channel on `ctx` and make its fd non-blocking.
    pub fn create(ctx: &Arc<Context>) -> Result<Arc<CompChannel>, NicError> {
        // SAFETY: the context is open while `ctx` lives.
        let raw = unsafe { sys::ibv_create_comp_channel(ctx.as_ptr()) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_create_comp_channel"))?;
        let chan = Arc::new(CompChannel { ptr, ctx: Arc::clone(ctx) });
        let fd = chan.raw_fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL take
        // and return plain integers.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            return Err(last_error("fcntl(O_NONBLOCK)"));
        }
        Ok(chan)
    }

    fn raw_fd(&self) -> i32 {
        // SAFETY: the channel is valid while `self` lives; `fd` is set at creation.
        unsafe { (*self.ptr.as_ptr()).fd }
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_comp_channel {
        self.ptr.as_ptr()
    }
}

impl AsFd for CompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open until ibv_destroy_comp_channel in `drop`,
        // which cannot run while `self` is borrowed.
        unsafe { BorrowedFd::borrow_raw(self.raw_fd()) }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds an Arc to it, so none is
        // left; destroyed once.
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, device = self.ctx.name(), "ibv_destroy_comp_channel failed");
        }
    }
}

/// A completion queue with its own completion channel: `struct ibv_cq`.
pub struct Cq {
    ptr: NonNull<sys::ibv_cq>,
    channel: Arc<CompChannel>,
    /// The channel's fd on the process's completion waiter thread.
    reactor: OnceLock<super::waiter::Registration>,
    /// Armed with `ibv_req_notify_cq` and no event taken since.
    armed: std::sync::atomic::AtomicBool,
    destroyed: bool,
}

// SAFETY: polling, arming and reading events are thread-safe in libibverbs
// (providers lock the CQ internally); the OnceLock is thread-safe.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

/// How many completions one `ibv_poll_cq` call takes at most.
const POLL_BATCH: usize = 32;

impl Cq {
    /// Create a CQ of at least `depth` entries with a fresh completion channel.
    pub fn create(ctx: &Arc<Context>, depth: u32) -> Result<Cq, NicError> {
        let channel = CompChannel::create(ctx)?;
        let cqe = i32::try_from(depth.max(1)).unwrap_or(i32::MAX);
        // SAFETY: the context and the channel are alive (the Cq keeps an Arc
        // to the channel, which keeps the context).
        let raw = unsafe { sys::ibv_create_cq(ctx.as_ptr(), cqe, std::ptr::null_mut(), channel.as_ptr(), 0) };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_create_cq"))?;
        let cq = Cq { ptr, channel, reactor: OnceLock::new(), armed: false.into(), destroyed: false };
        // Registered now, not at a driver's first sleep: the waiter thread
        // starts (and allocates) with the first CQ instead of inside a
        // call, and no two waits race to register the fd. If it fails, the
        // first wait tries again.
        if let Err(e) = cq.reactor() {
            tracing::warn!(%e, "completion channel not registered with the waiter yet; retried at the first wait");
        }
        Ok(cq)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_cq {
        self.ptr.as_ptr()
    }

    /// Take completions into `out` (at most `out.len()`) without waiting;
    /// returns how many. Allocates nothing.
    pub fn poll_into(&self, out: &mut [Completion]) -> Result<usize, NicError> {
        // Not zeroed (1.5 KiB on every poll, most of which find one entry
        // or none): the provider writes the entries it returns, and only
        // those are read.
        let mut wcs = std::mem::MaybeUninit::<[sys::ibv_wc; POLL_BATCH]>::uninit();
        let wcs = wcs.as_mut_ptr().cast::<sys::ibv_wc>();
        let mut got = 0;
        while got < out.len() {
            let want = (out.len() - got).min(POLL_BATCH);
            // SAFETY: the CQ is alive; `wcs` has room for `want` entries and
            // its layout matches the C header (tests/verbs_layout.rs).
            let n = unsafe { sys::ibv_poll_cq(self.as_ptr(), want as i32, wcs) };
            if n < 0 {
                return Err(from_errno("ibv_poll_cq", -n));
            }
            let n = (n as usize).min(want);
            for (i, o) in out[got..got + n].iter_mut().enumerate() {
                // SAFETY: ibv_poll_cq returned the first `n` entries (at
                // most `want`, within `wcs`), and nothing else refers to
                // them; `completion` reads only the fields it wrote.
                *o = unsafe { completion(wcs.add(i)) };
            }
            got += n;
            if n < want {
                break;
            }
        }
        Ok(got)
    }

    /// Take up to `max` completions without waiting.
    #[cfg(feature = "testing")]
    pub fn poll(&self, max: usize) -> Result<Vec<Completion>, NicError> {
        let mut out = vec![Completion::EMPTY; max];
        let n = self.poll_into(&mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Ask for an event on the channel at the next completion.
    pub fn arm(&self) -> Result<(), NicError> {
        // SAFETY: the CQ is alive and was created with a channel.
        check("ibv_req_notify_cq", unsafe { sys::ibv_req_notify_cq(self.as_ptr(), 0) })
    }

    /// Consume and acknowledge the events waiting on the channel, without
    /// blocking. Returns how many there were.
    pub fn take_events(&self) -> Result<usize, NicError> {
        let mut n = 0u32;
        loop {
            let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::os::raw::c_void = std::ptr::null_mut();
            // SAFETY: the channel is alive; its fd is non-blocking so this
            // returns -1/EAGAIN instead of blocking; the out-pointers are valid.
            let rc = unsafe { sys::ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut ctx) };
            if rc != 0 {
                let e = errno();
                if n > 0 {
                    // SAFETY: `n` events of this CQ (the channel is ours
                    // alone) were received and not yet acknowledged.
                    unsafe { sys::ibv_ack_cq_events(self.as_ptr(), n) };
                }
                return if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                    Ok(n as usize)
                } else {
                    Err(NicError::Os { op: "ibv_get_cq_event", source: OsError::from_errno(e) })
                };
            }
            n += 1;
        }
    }

    /// Wait until at least one completion is available and return up to
    /// `max` of them.
    ///
    /// The loop polls, arms the CQ, polls again (a completion may have landed
    /// between the first poll and the arming, and would raise no event),
    /// and only then waits for the channel's fd to become readable, so a
    /// completion is never missed. Works under any executor (the fd is
    /// waited on by mwcap's own thread, `waiter.rs`).
    #[cfg(feature = "testing")]
    pub async fn wait(&self, max: usize) -> Result<Vec<Completion>, NicError> {
        let max = max.max(1);
        loop {
            let got = self.poll(max)?;
            if !got.is_empty() {
                return Ok(got);
            }
            self.arm()?;
            let got = self.poll(max)?;
            if !got.is_empty() {
                return Ok(got);
            }
            let reactor = self.reactor()?;
            std::future::poll_fn(|cx| reactor.poll_readable(cx))
                .await
                .map_err(|e| NicError::Os { op: "wait for completion event", source: io_error(&e) })?;
            self.take_events()?;
        }
    }

    /// Readiness for a driver (see `NicOps::poll_cq_ready`):
    /// `Ready` means poll the CQ again. Arms the CQ (returning `Ready`, so
    /// the caller re-polls and no completion between its last poll and the
    /// arming is missed); once armed, waits for the channel's fd on the
    /// process's waiter thread (`waiter.rs`), and when it is readable takes
    /// and acknowledges the channel's event, which disarmed the CQ.
    ///
    /// The channel is read only once the waiter saw it readable: an armed CQ
    /// raises one event, taken then, and a disarmed one none, so a read on
    /// every call (a system call that found nothing on most) had nothing to
    /// take.
    pub fn poll_ready(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), NicError>> {
        use std::sync::atomic::Ordering;
        use std::task::Poll;
        if !self.armed.swap(true, Ordering::AcqRel) {
            return Poll::Ready(self.arm().inspect_err(|_| self.armed.store(false, Ordering::Release)));
        }
        let reactor = match self.reactor() {
            Ok(r) => r,
            Err(e) => return Poll::Ready(Err(e)),
        };
        match reactor.poll_readable(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(())) => {
                if let Err(e) = self.take_events() {
                    return Poll::Ready(Err(e));
                }
                self.armed.store(false, Ordering::Release);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                Poll::Ready(Err(NicError::Os { op: "wait for completion event", source: io_error(&e) }))
            }
        }
    }

    fn reactor(&self) -> Result<&super::waiter::Registration, NicError> {
        if let Some(r) = self.reactor.get() {
            return Ok(r);
        }
        match super::waiter::Registration::new(self.channel.raw_fd()) {
            Ok(r) => Ok(self.reactor.get_or_init(|| r)),
            // A thread that lost the race to register the fd gets EEXIST
            // from epoll: the winner's registration serves.
            Err(e) => self
                .reactor
                .get()
                .ok_or_else(|| NicError::Os { op: "register completion channel", source: io_error(&e) }),
        }
    }

    /// Destroy now, reporting failure (e.g. queue pairs still use the CQ).
    pub fn close(mut self) -> Result<(), (Cq, NicError)> {
        match self.destroy() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn destroy(&mut self) -> Result<(), NicError> {
        if self.destroyed {
            return Ok(());
        }
        // Unregister from the reactor before the fd can go away.
        drop(self.reactor.take());
        // Events must be acknowledged before ibv_destroy_cq, or it blocks.
        self.take_events()?;
        // SAFETY: the CQ exists (flag), all its events are acknowledged, and
        // it is destroyed at most once.
        check("ibv_destroy_cq", unsafe { sys::ibv_destroy_cq(self.as_ptr()) })?;
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        if let Err(e) = self.destroy() {
            tracing::warn!(error = %e, "ibv_destroy_cq failed");
        }
    }
}

fn io_error(e: &std::io::Error) -> OsError {
    OsError::from_errno(e.raw_os_error().unwrap_or(libc::EIO))
}

/// `IBV_WC_WITH_INV`.
const WITH_INV: u32 = sys::ibv_wc_flags::IBV_WC_WITH_INV.0;
/// The bit rxe sets for a received SEND_WITH_INV (see [`completion`]).
const RXE_WITH_INV: u32 = 0x4;

/// An owned completion from a C work completion that `ibv_poll_cq`
/// returned.
///
/// A provider writes only the fields the verbs spec makes valid for an
/// entry (mlx5 leaves `opcode`, `byte_len` and the immediate/invalidate
/// union unwritten on an error or flush, and `byte_len` and the union on a
/// successful send-queue completion, and `vendor_err` on a success):
/// `wr_id`, `status` and `qp_num` always, `vendor_err` on an error or
/// flush, `opcode` on success, `byte_len` on a successful receive or READ,
/// `wc_flags` and the union on a successful receive. Only
/// those are read, each on its own (no reference to the whole entry, whose
/// other fields may be uninitialised). The opcode of an unsuccessful
/// completion is filled in from what was posted (`track.rs`).
///
/// # Safety
/// `wc` points to an entry `ibv_poll_cq` returned.
unsafe fn completion(wc: *const sys::ibv_wc) -> Completion {
    use std::ptr::addr_of;
    // SAFETY: `wc` is an entry ibv_poll_cq returned (the caller's
    // promise); these three fields are written for every entry.
    let (wr_id, status, qpn) = unsafe {
        (
            addr_of!((*wc).wr_id).read(),
            wc_status(addr_of!((*wc).status).read()),
            addr_of!((*wc).qp_num).read(),
        )
    };
    let mut c = Completion { wr_id, status, opcode: WcOpcode::Other(u32::MAX), qpn, ..Completion::EMPTY };
    if !status.is_success() {
        // SAFETY: as above; the vendor's syndrome is written for an
        // unsuccessful entry (mlx5 writes it for no other).
        c.vendor_err = unsafe { addr_of!((*wc).vendor_err).read() };
        return c;
    }
    // SAFETY: as above; the opcode is written for a successful entry.
    c.opcode = wc_opcode(unsafe { addr_of!((*wc).opcode).read() });
    if matches!(c.opcode, WcOpcode::Recv | WcOpcode::RdmaRead) {
        // SAFETY: as above; written for a successful receive or READ.
        c.byte_len = unsafe { addr_of!((*wc).byte_len).read() };
    }
    if c.opcode == WcOpcode::Recv {
        // SAFETY: as above; the flags are written for a successful receive.
        let flags = unsafe { addr_of!((*wc).wc_flags).read() };
        // rxe reports a SEND_WITH_INV with 0x4 (the kernel's
        // IB_WC_WITH_INVALIDATE, which is IBV_WC_IP_CSUM_OK in user space)
        // instead of IBV_WC_WITH_INV (0x8). Take the field when either bit
        // is set: RC receives never carry a checksum flag, and mwcap never
        // sends immediate data (IBV_WC_WITH_IMM, 0x2, is not accepted).
        if flags & (WITH_INV | RXE_WITH_INV) != 0 {
            // SAFETY: as above; the union is written for a receive with
            // either flag, and both its members are plain u32.
            let rkey = unsafe { addr_of!((*wc).imm_data_invalidated_rkey_union.invalidated_rkey).read() };
            c.invalidated_rkey = Some(rkey);
        }
    }
    c
}
