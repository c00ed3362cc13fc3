//! A device context's asynchronous events (`ibv_get_async_event`).
//!
//! libibverbs reports asynchronous events per device context, on
//! `context->async_fd`. mwcap needs one of them, the shared receive queue's
//! limit event, and reads them only when asked ([`Context::drain_async_events`],
//! called by `NicOps::take_srq_limit`): the fd is made non-blocking the first
//! time, then every pending event is read and acknowledged at once, without
//! waiting. A limit event raises the flag its SRQ registered here (found by
//! its `ibv_srq` pointer); every other event is logged at debug level and
//! dropped.
//!
//! # One lock
//! Draining, and registering and destroying an SRQ, happen under one mutex
//! per context:
//!
//! - two threads never read the fd at once;
//! - no event is ever held unacknowledged outside a drain, and a drain
//!   acknowledges each event before it returns. `ibv_destroy_srq` waits
//!   until every event of the SRQ that was read is acknowledged, so it
//!   runs under the same mutex: it cannot wait for a drain (nor a drain for
//!   it), and once it returns no later drain can read an event naming the
//!   freed SRQ (the kernel drops the unread ones);
//! - an `ibv_srq` address leaves the table under the mutex exactly when
//!   `ibv_destroy_srq` succeeded, so a later SRQ at the same address never
//!   meets a stale entry, and an event is never credited to the wrong SRQ.
//!
//! Queue pairs' events (`LAST_WQE_REACHED` when a QP of an SRQ goes to
//! ERR, fatal errors) are acknowledged the same way, so an
//! `ibv_destroy_qp` that waits for them is never left hanging by us.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use rdma_mummy_sys as sys;
use sys::ibv_event_type as ev;

use super::device::Context;
use super::sys::{errno, from_errno, last_error};
use crate::backend::NicError;

/// `struct ibv_async_event` with the event type as a plain `u32`.
///
/// rdma-mummy-sys declares `event_type` as a Rust enum; a kernel or
/// libibverbs newer than its headers may report a value that enum does not
/// have, and reading such a value as the enum is undefined behaviour. The
/// layout is the same (checked at compile time below), so libibverbs fills
/// this struct through a cast pointer and we only read integers.
#[repr(C)]
struct RawAsyncEvent {
    element: sys::ibv_async_event_element_t,
    event_type: u32,
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<RawAsyncEvent>() == size_of::<sys::ibv_async_event>());
    assert!(align_of::<RawAsyncEvent>() == align_of::<sys::ibv_async_event>());
    assert!(offset_of!(RawAsyncEvent, element) == offset_of!(sys::ibv_async_event, element));
    assert!(offset_of!(RawAsyncEvent, event_type) == offset_of!(sys::ibv_async_event, event_type));
    assert!(size_of::<sys::ibv_event_type>() == size_of::<u32>());
};

const SRQ_LIMIT_REACHED: u32 = ev::IBV_EVENT_SRQ_LIMIT_REACHED as u32;

/// The asynchronous-event state of one device context (owned by its
/// [`Context`]).
pub(super) struct AsyncEvents {
    inner: Mutex<Inner>,
}

struct Inner {
    /// `async_fd` has been made non-blocking.
    nonblocking: bool,
    /// Each live SRQ's limit flag, by its `ibv_srq` address.
    srq_limits: HashMap<usize, Arc<AtomicBool>>,
}

impl AsyncEvents {
    pub(super) fn new() -> AsyncEvents {
        AsyncEvents { inner: Mutex::new(Inner { nonblocking: false, srq_limits: HashMap::new() }) }
    }
}

/// The SRQ registry of a context, locked (draining is excluded meanwhile).
pub(super) struct SrqRegistry<'a>(MutexGuard<'a, Inner>);

impl SrqRegistry<'_> {
    /// Route limit events of the SRQ at `srq` to `flag`.
    pub(super) fn add(&mut self, srq: *mut sys::ibv_srq, flag: Arc<AtomicBool>) {
        // A stale entry at this address is impossible (it leaves with its
        // SRQ's successful destroy, under this lock); replace it anyway.
        self.0.srq_limits.insert(srq as usize, flag);
    }

    /// Forget the SRQ at `srq` (call right after its destroy succeeded,
    /// without releasing the registry in between).
    pub(super) fn remove(&mut self, srq: *mut sys::ibv_srq) {
        self.0.srq_limits.remove(&(srq as usize));
    }
}

impl Context {
    /// Lock the SRQ registry of this context: no drain runs while it is held.
    pub(super) fn srq_registry(&self) -> SrqRegistry<'_> {
        SrqRegistry(self.async_events().inner.lock())
    }

    /// Read and acknowledge every pending asynchronous event of this
    /// context without blocking, raising the limit flag of each SRQ named by
    /// an `IBV_EVENT_SRQ_LIMIT_REACHED`. Returns when the fd has no more
    /// (EAGAIN).
    pub(super) fn drain_async_events(&self) -> Result<(), NicError> {
        let mut inner = self.async_events().inner.lock();
        let fd = self.async_fd();
        if !inner.nonblocking {
            // SAFETY: `fd` is the context's open async descriptor (it stays
            // open until ibv_close_device, which cannot run while `self`
            // is borrowed); F_GETFL/F_SETFL take and return plain integers.
            let rc = unsafe {
                let flags = libc::fcntl(fd, libc::F_GETFL);
                if flags < 0 {
                    flags
                } else {
                    libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
                }
            };
            if rc < 0 {
                return Err(last_error("fcntl(async_fd, O_NONBLOCK)"));
            }
            inner.nonblocking = true;
        }
        loop {
            // SAFETY: RawAsyncEvent is a union of pointers and an integer
            // plus an integer; all-zero bytes are a valid value.
            let mut event: RawAsyncEvent = unsafe { std::mem::zeroed() };
            // SAFETY: the context is open while `self` lives; `event` is
            // writable and laid out as `struct ibv_async_event` (asserted
            // above), and libibverbs only writes it. The fd is non-blocking,
            // so the call returns at once when no event is pending.
            let rc = unsafe { sys::ibv_get_async_event(self.as_ptr(), std::ptr::addr_of_mut!(event).cast()) };
            if rc != 0 {
                return match errno() {
                    libc::EAGAIN => Ok(()),
                    libc::EINTR => continue,
                    e => Err(from_errno("ibv_get_async_event", e)),
                };
            }
            if event.event_type == SRQ_LIMIT_REACHED {
                // SAFETY: for SRQ events libibverbs sets the `srq` member;
                // it is read as an address only, never dereferenced.
                let srq = unsafe { event.element.srq } as usize;
                match inner.srq_limits.get(&srq) {
                    Some(flag) => flag.store(true, Ordering::Release),
                    None => tracing::debug!(
                        device = self.name(),
                        srq = format_args!("{srq:#x}"),
                        "SRQ limit event for an SRQ mwcap does not know; ignored"
                    ),
                }
            } else {
                tracing::debug!(
                    device = self.name(),
                    event = event_name(event.event_type),
                    code = event.event_type,
                    "asynchronous event ignored"
                );
            }
            // SAFETY: `event` came from a successful ibv_get_async_event on
            // this context and is acknowledged exactly once; the object it
            // names is alive, because its destroy waits for this
            // acknowledgement (and an SRQ's destroy cannot start: it needs
            // the lock we hold). The layout is `struct ibv_async_event`'s.
            unsafe { sys::ibv_ack_async_event(std::ptr::addr_of_mut!(event).cast()) };
        }
    }
}

/// A readable name for an event type (the number itself when unknown).
fn event_name(t: u32) -> &'static str {
    const NAMES: &[(ev, &str)] = &[
        (ev::IBV_EVENT_CQ_ERR, "CQ_ERR"),
        (ev::IBV_EVENT_QP_FATAL, "QP_FATAL"),
        (ev::IBV_EVENT_QP_REQ_ERR, "QP_REQ_ERR"),
        (ev::IBV_EVENT_QP_ACCESS_ERR, "QP_ACCESS_ERR"),
        (ev::IBV_EVENT_COMM_EST, "COMM_EST"),
        (ev::IBV_EVENT_SQ_DRAINED, "SQ_DRAINED"),
        (ev::IBV_EVENT_PATH_MIG, "PATH_MIG"),
        (ev::IBV_EVENT_PATH_MIG_ERR, "PATH_MIG_ERR"),
        (ev::IBV_EVENT_DEVICE_FATAL, "DEVICE_FATAL"),
        (ev::IBV_EVENT_PORT_ACTIVE, "PORT_ACTIVE"),
        (ev::IBV_EVENT_PORT_ERR, "PORT_ERR"),
        (ev::IBV_EVENT_LID_CHANGE, "LID_CHANGE"),
        (ev::IBV_EVENT_PKEY_CHANGE, "PKEY_CHANGE"),
        (ev::IBV_EVENT_SM_CHANGE, "SM_CHANGE"),
        (ev::IBV_EVENT_SRQ_ERR, "SRQ_ERR"),
        (ev::IBV_EVENT_SRQ_LIMIT_REACHED, "SRQ_LIMIT_REACHED"),
        (ev::IBV_EVENT_QP_LAST_WQE_REACHED, "QP_LAST_WQE_REACHED"),
        (ev::IBV_EVENT_CLIENT_REREGISTER, "CLIENT_REREGISTER"),
        (ev::IBV_EVENT_GID_CHANGE, "GID_CHANGE"),
        (ev::IBV_EVENT_WQ_FATAL, "WQ_FATAL"),
    ];
    NAMES.iter().find(|(e, _)| *e as u32 == t).map_or("unknown", |(_, n)| n)
}
