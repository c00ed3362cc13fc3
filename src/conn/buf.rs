//! [`Buf`]: a data buffer in registered memory, lent to the user, and the
//! list its dropped handles go back on ([`Returns`]).

use std::fmt;

use super::UseError;

/// A data buffer in registered memory, owned by whoever holds this handle:
/// it dereferences to its payload, `&[u8]` and `&mut [u8]`, without a copy.
///
/// Its payload is its first `len()` bytes (of [`Buf::capacity`]);
/// write a payload with [`Buf::set_len`] then the slice, or with
/// [`Buf::copy_from`]. Not `Clone`: handing it to
/// [`Connection::call`](super::Connection::call) or
/// [`Connection::reply`](super::Connection::reply) gives it to the NIC, and only
/// the connection gives it back (a reply payload, a returned buffer). While
/// you hold it, nothing else touches its bytes: not the NIC's writes, not
/// another handle, not the CPU accessors of the [`Nic`](crate::backend::Nic)
/// (see `src/mem.rs`).
///
/// Dropping a `Buf` returns it to its pool (the connection takes it back at
/// its next turn): a buffer can be forgotten, never lost. Each hand-over to
/// the user is a new *lending*, so a stale handle can never free a buffer
/// lent again since.
pub struct Buf {
    pub(crate) endpoint: u64,
    pub(crate) slot: u32,
    pub(crate) len: u32,
    pub(crate) lending: u32,
    /// Where a dropped handle goes; `None` once the endpoint took it back.
    pub(crate) home: Option<std::sync::Arc<Returns>>,
    /// Its bytes, held for this handle; `None` only while it is dropped.
    pub(crate) bytes: Option<crate::mem::Lent>,
}

/// Buffers dropped by their holders, waiting for their endpoint to take
/// them back: (slot, lending).
#[derive(Default)]
pub(crate) struct Returns {
    queue: parking_lot::Mutex<Vec<(u32, u32)>>,
    /// Whether `queue` may hold something: set under its lock after a
    /// push, so that `take_all` (run several times a driver turn) skips
    /// the lock when nothing was dropped. A put that `take_all` misses
    /// this way is one it would have missed by taking the lock first: the
    /// put's wake-up brings the driver back for it.
    queued: std::sync::atomic::AtomicBool,
    /// Woken when a handle is dropped (the async driver's waker).
    waker: parking_lot::Mutex<Option<std::task::Waker>>,
    /// Whether `waker` may hold one: set and cleared only by the owning
    /// connection's turns (under its state lock), so `clear_waker`, run
    /// every turn, skips the lock when no waker was set.
    armed: std::sync::atomic::AtomicBool,
}

impl Returns {
    pub(crate) fn take_all(&self, out: &mut Vec<(u32, u32)>) {
        use std::sync::atomic::Ordering::{Acquire, Relaxed};
        if !self.queued.load(Acquire) {
            return;
        }
        let mut q = self.queue.lock();
        self.queued.store(false, Relaxed);
        out.append(&mut q);
    }
    fn put(&self, slot: u32, lending: u32) {
        {
            let mut q = self.queue.lock();
            q.push((slot, lending));
            self.queued.store(true, std::sync::atomic::Ordering::Release);
        }
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn set_waker(&self, w: &std::task::Waker) {
        crate::handle::store_waker(&mut self.waker.lock(), w);
        self.armed.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    /// Wake nobody on a put.
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn clear_waker(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.armed.load(Relaxed) {
            self.armed.store(false, Relaxed);
            self.waker.lock().take();
        }
    }
    /// Whether handles wait to be taken back (no lock: see `queued`).
    #[cfg_attr(loom, allow(dead_code))] // used by the async driver, absent under loom
    pub(crate) fn any(&self) -> bool {
        self.queued.load(std::sync::atomic::Ordering::Acquire)
    }
    /// How many of the handles waiting to be taken back `live` says are
    /// still the user's (slot, lending): they are the pool's already.
    pub(crate) fn count(&self, live: impl Fn(u32, u32) -> bool) -> usize {
        self.queue.lock().iter().filter(|&&(slot, lending)| live(slot, lending)).count()
    }
}

impl Buf {
    /// The most payload it holds: `Config::buffer_size`, or its class's size.
    pub fn capacity(&self) -> usize {
        self.bytes.as_ref().map_or(0, crate::mem::Lent::capacity)
    }

    /// Make the payload `len` bytes (what the slice covers, and what a
    /// call or reply sends); bytes past the old length keep what the buffer
    /// held. Refused above [`Buf::capacity`].
    pub fn set_len(&mut self, len: usize) -> Result<(), UseError> {
        let cap = self.capacity();
        if len > cap {
            return Err(UseError::TooLong { len, cap: cap as u32 });
        }
        self.len = len as u32;
        Ok(())
    }

    /// Make `data` the payload: [`Buf::set_len`] to its length, then copy it in.
    pub fn copy_from(&mut self, data: &[u8]) -> Result<(), UseError> {
        self.set_len(data.len())?;
        self.copy_from_slice(data);
        Ok(())
    }

    /// Lend all of its capacity to `f` to write a payload in place (an
    /// encoder that learns the length as it goes); the count `f` returns
    /// becomes the payload's length. Refused, the length unchanged, when
    /// `f` claims more than the capacity.
    pub fn write_with(&mut self, f: impl FnOnce(&mut [u8]) -> usize) -> Result<(), UseError> {
        let cap = self.capacity();
        let wrote = match self.bytes.as_mut() {
            Some(b) => f(b.bytes_mut(cap)),
            None => 0,
        };
        self.set_len(wrote)
    }

    /// Its index in the pool (for logs).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The endpoint takes the handle back: dropping it no longer returns it.
    pub(crate) fn disarm(mut self) {
        self.home = None;
    }
}

impl std::ops::Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes.as_ref().map_or(&[], |b| b.bytes(self.len as usize))
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len as usize;
        self.bytes.as_mut().map_or(&mut [], |b| b.bytes_mut(len))
    }
}

impl AsRef<[u8]> for Buf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for Buf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // The hold ends before the buffer can be lent again: a handle that
        // goes home is taken back (and may be lent anew) at once.
        drop(self.bytes.take());
        if let Some(home) = self.home.take() {
            home.put(self.slot, self.lending);
        }
    }
}

impl fmt::Debug for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buf").field("slot", &self.slot).field("len", &self.len).finish()
    }
}

impl PartialEq for Buf {
    fn eq(&self, o: &Buf) -> bool {
        (self.endpoint, self.slot, self.len, self.lending) == (o.endpoint, o.slot, o.len, o.lending)
    }
}

impl Eq for Buf {}

impl std::hash::Hash for Buf {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self.endpoint, self.slot, self.len, self.lending).hash(h);
    }
}
