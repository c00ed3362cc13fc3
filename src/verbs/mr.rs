//! Memory regions over memory they own.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::pd::Pd;
use super::sys::{check, last_error};
use crate::backend::{Access, NicError};

/// Page-aligned, zeroed memory, freed on drop unless leaked.
struct PageBuf {
    ptr: NonNull<u8>,
    layout: Layout,
    leaked: bool,
}

impl PageBuf {
    fn new(len: usize) -> Result<PageBuf, NicError> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(4096);
        let size = len.checked_next_multiple_of(page).filter(|&s| s > 0);
        let layout = size
            .and_then(|s| Layout::from_size_align(s, page).ok())
            .ok_or_else(|| NicError::InvalidWr(format!("cannot allocate a region of {len} bytes")))?;
        // SAFETY: the layout has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| NicError::Os {
            op: "alloc",
            source: crate::backend::OsError::from_errno(libc::ENOMEM),
        })?;
        Ok(PageBuf { ptr, layout, leaked: false })
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if !self.leaked {
            // SAFETY: allocated in `new` with exactly this layout, freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

/// A memory region registered over memory it owns: `struct ibv_mr`.
///
/// The memory is freed only after a successful `ibv_dereg_mr`: once that
/// returns the device no longer accesses it. If deregistration fails the
/// memory is leaked rather than handed back to the allocator while a DMA
/// might still reach it.
///
/// The CPU accesses the memory by copying ([`Mr::write`], [`Mr::read`]) or
/// through a borrow lent to a closure ([`Mr::with_bytes`],
/// [`Mr::with_bytes_mut`]), always under the region's CPU lock: reads share
/// it, writes take it alone, so two threads never race on the same bytes.
/// The NIC's own DMA is outside that lock; the protocol layer lends only
/// ranges no local work request targets (see `Nic::with_mr`).
pub struct Mr {
    ptr: NonNull<sys::ibv_mr>,
    buf: PageBuf,
    /// Serialises CPU accesses to `buf`.
    cpu: parking_lot::RwLock<()>,
    len: usize,
    access: Access,
    deregistered: bool,
    pd: Arc<Pd>,
}

// SAFETY: the ibv_mr is immutable after registration and every CPU access to
// the owned memory happens under `cpu` (shared for reads, exclusive for
// writes), so sharing `&Mr` across threads creates no data race between
// threads; the NIC's DMA is governed by the protocol (see `with_bytes`).
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Allocate `len` zeroed bytes (rounded up to whole pages for the
    /// allocation; the region is exactly `len`) and register them with `access`.
    pub fn alloc(pd: &Arc<Pd>, len: usize, access: Access) -> Result<Mr, NicError> {
        if len == 0 {
            return Err(NicError::InvalidWr("a memory region needs at least one byte".into()));
        }
        let buf = PageBuf::new(len)?;
        // SAFETY: the PD is alive (we hold an Arc) and `buf` is `len` valid,
        // writable bytes that outlive the registration (the Mr owns both and
        // frees `buf` only after deregistration succeeds).
        let raw = unsafe {
            sys::ibv_reg_mr(pd.as_ptr(), buf.ptr.as_ptr().cast(), len, access.bits() as std::os::raw::c_int)
        };
        let ptr = NonNull::new(raw).ok_or_else(|| last_error("ibv_reg_mr"))?;
        Ok(Mr {
            ptr,
            buf,
            cpu: parking_lot::RwLock::new(()),
            len,
            access,
            deregistered: false,
            pd: Arc::clone(pd),
        })
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: regions have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The start address, as remote peers name it.
    pub fn addr(&self) -> u64 {
        self.buf.ptr.as_ptr() as u64
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the ibv_mr is valid while `self` is registered; `lkey` is
        // written once by libibverbs at registration.
        unsafe { (*self.ptr.as_ptr()).lkey }
    }

    /// The region's own remote key (valid for any QP of the PD: handle with care).
    pub fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { (*self.ptr.as_ptr()).rkey }
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mr {
        self.ptr.as_ptr()
    }

    /// Check that `offset..offset+len` lies inside the region; returns the end.
    pub fn check_range(&self, offset: usize, len: usize) -> Result<usize, NicError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(end),
            end => Err(NicError::OutOfRange {
                mr: self.lkey(),
                offset,
                end: end.unwrap_or(usize::MAX),
                len: self.len,
            }),
        }
    }

    /// Copy `data` into the region at `offset` with the CPU.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), NicError> {
        self.with_bytes_mut(offset, data.len(), &mut |b| b.copy_from_slice(data))
    }

    /// Copy bytes at `offset` out of the region with the CPU.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), NicError> {
        self.with_bytes(offset, out.len(), &mut |b| out.copy_from_slice(b))
    }

    /// Lend `offset..offset + len` to `f` for reading, under the shared CPU
    /// lock. The caller must own the range in the protocol's sense: no
    /// local work request (posted RECV, READ in flight) targets it.
    pub fn with_bytes(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) -> Result<(), NicError> {
        self.check_range(offset, len)?;
        let _cpu = self.cpu.read();
        // SAFETY: the range is inside the owned allocation (checked), which
        // lives as long as `self`; no thread writes it with the CPU while the
        // shared lock is held; the NIC does not write it, because the caller
        // owns the range (no RECV or READ targets it), and remote peers can
        // only read (mwcap never grants REMOTE_WRITE). The borrow ends with
        // `f`.
        let bytes = unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr().add(offset), len) };
        f(bytes);
        Ok(())
    }

    /// Lend `offset..offset + len` to `f` for writing, under the exclusive
    /// CPU lock; the ownership rule of [`Mr::with_bytes`] applies.
    pub fn with_bytes_mut(
        &self,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), NicError> {
        self.check_range(offset, len)?;
        let _cpu = self.cpu.write();
        // SAFETY: as in `with_bytes`; the exclusive lock also keeps every
        // other CPU reader away, so this is the only reference to the range.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.buf.ptr.as_ptr().add(offset), len) };
        f(bytes);
        Ok(())
    }

    /// Deregister now, reporting failure (e.g. windows still bound over the
    /// region). On failure the region is handed back intact.
    pub fn close(mut self) -> Result<(), (Mr, NicError)> {
        match self.dereg() {
            Ok(()) => Ok(()),
            Err(e) => Err((self, e)),
        }
    }

    fn dereg(&mut self) -> Result<(), NicError> {
        if self.deregistered {
            return Ok(());
        }
        // SAFETY: the region is registered (flag) and deregistered at most
        // once: the flag is set right after success.
        check("ibv_dereg_mr", unsafe { sys::ibv_dereg_mr(self.as_ptr()) })?;
        self.deregistered = true;
        Ok(())
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            tracing::warn!(error = %e, "leaking a memory region that could not be deregistered");
            self.buf.leaked = true;
        }
    }
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("access", &self.access)
            .finish()
    }
}
