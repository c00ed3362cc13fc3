//! A hub's shared buffer pool ([`BufferPool`]): registered buffers and
//! memory windows that its connections hold only while they use them, so
//! registered memory follows the work in progress, not the number of
//! connections. What the pool promises (a buffer back only on evidence,
//! isolation, windows lent per exposure) and why: `docs/serving.md`,
//! "Shared buffers".
//!
//! # Fairness
//! Each connection on the pool has a guaranteed *share* of each class
//! (`State::share`); any other take *borrows*, and only while no other
//! connection waits for that class (`State::may_take`). A buffer given
//! back wakes **one** waiter that can take it (`State::wake_next` says
//! which); a wake-up its connection does not use is passed on
//! (`Slots::end_turn`), and the rest of several free buffers go to the
//! next waiter (`State::kick`). (With no guaranteed share, a connection
//! that holds buffers long is served after newcomers that have held none:
//! a stream of new connections can keep it waiting.) Windows queue the
//! same way, without shares. The rules live in [`fair`]; what they do
//! against hoarders: `docs/reliability.md`, "Fairness of a shared pool".

mod fair;
mod windows;

use super::{ConfigError, SetupError};
use fair::Member;
use std::task::Waker;

use mwcap_mw as mw;

use super::config::BufClass;
use crate::backend::{Access, MrId, MrInfo, MwId, MwInfo, Nic, NicError};
use crate::mem::{Memory, Registered};
use crate::sync::{Arc, AtomicBool, Mutex};

/// Buffers registered per size class at most (a registration each).
#[cfg_attr(loom, allow(dead_code))] // used by register, absent from the loom models
pub const MAX_POOL_BUFFERS: u32 = 1 << 20;

/// Buffers of a class of `count` kept for incoming payloads (READ
/// destinations, inline payloads received): a quarter, at least one when
/// the class has two or more. A user's alloc (an outgoing payload) never
/// takes them, so a payload the peer exposes can always be read, and users
/// filling the pool with outgoing payloads on both sides cannot deadlock
/// the two directions (each side's exposed payloads wait for the other
/// side's READs, which wait for a destination).
fn reserve_of(count: u32) -> u32 {
    if count < 2 {
        0
    } else {
        count.div_ceil(4)
    }
}

/// A hub's pool of registered data buffers, shared by its connections
/// (see [`EndpointBuilder::shared_buffers`](super::EndpointBuilder::shared_buffers)).
/// A cheap handle: clones share the pool. The buffers are deregistered
/// when the last handle (the hub's, or a connection's) goes.
#[derive(Clone)]
pub struct BufferPool(Arc<Inner>);

struct Inner {
    /// Class sizes, ascending.
    sizes: Vec<u32>,
    /// One registration per buffer, class by class, with its memory.
    bufs: Vec<Registered>,
    /// Where each class starts in `bufs`, and (last) its length.
    firsts: Vec<u32>,
    /// Buffers of each class that only incoming payloads may take.
    reserve: Vec<u32>,
    state: Mutex<State>,
    /// The handle the pool registered through and allocates windows on.
    device: Box<dyn PoolDevice>,
}

/// What the pool does on its NIC handle once it is made: deregister its
/// buffers, allocate and deallocate windows on the protection domain.
trait PoolDevice: Send + Sync {
    fn dereg(&self, mr: MrId);
    fn alloc_mw(&self) -> Result<MwInfo, NicError>;
    fn dealloc_mw(&self, mw: MwId);
}

/// A [`Nic`] handle as the pool's device.
#[cfg_attr(loom, allow(dead_code))] // the hub's, absent under loom
struct OnNic<N>(N);

impl<N: Nic> PoolDevice for OnNic<N> {
    fn dereg(&self, mr: MrId) {
        let _ = self.0.dereg_mr(mr);
    }
    fn alloc_mw(&self) -> Result<MwInfo, NicError> {
        self.0.alloc_mw()
    }
    fn dealloc_mw(&self, mw: MwId) {
        let _ = self.0.dealloc_mw(mw);
    }
}

struct State {
    /// Free buffers of each class (indices into `bufs`).
    free: Vec<Vec<u32>>,
    /// The member holding each buffer (`NOBODY` while free).
    owner_of: Vec<u32>,
    /// The pool's clock (gives so far) when each buffer was taken.
    took_at: Vec<u64>,
    /// Buffers given back so far.
    clock: u64,
    /// The connections on the pool, by member id (ids are reused).
    members: Vec<Member>,
    /// Ids of members that left, for the next to join.
    vacant: Vec<u32>,
    /// Members waiting for each class, in the order they came, each with
    /// whether it waits only for an outgoing payload (which leaves the
    /// class's reserve); the last queue is the windows'.
    queues: Vec<std::collections::VecDeque<(u32, bool)>>,
    /// An empty list with room for a waker per queue, taken to pass
    /// wake-ups on without allocating (`BufferPool::pass_on`).
    spare: Vec<Waker>,
    /// Members woken from each queue that have not tried again yet: they
    /// count as waiting (a connection at its share does not borrow while
    /// one is on its way).
    woken_n: Vec<u32>,
    taken: u64,
    empty: u64,
    wakeups: u64,
    held_bytes: u64,
    /// Unbound windows, with the rkey of their last bind.
    windows: Vec<mw::Window>,
    windows_lent: u64,
    windows_allocated: u64,
    windows_dropped: u64,
    window_alloc_failures: u64,
    window_waits: u64,
}

/// No member.
const NOBODY: u32 = u32::MAX;

/// Size classes a pool may have (a bit each, and one for windows, in a
/// member's `queued` and `woken`).
pub(crate) const MAX_POOL_CLASSES: usize = 63;

/// What an endpoint's shared pool of buffers and windows ([`EndpointBuilder::shared_buffers`](super::EndpointBuilder::shared_buffers)) holds and has done (in [`EndpointStats`](super::EndpointStats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BufferPoolStats {
    /// Buffers in the pool, of every class.
    pub buffers: u32,
    /// Of those, free now.
    pub free: u32,
    /// Bytes registered for the pool's buffers.
    pub registered_bytes: u64,
    /// Bytes of the buffers connections hold right now.
    pub held_bytes: u64,
    /// Buffers handed to connections so far.
    pub taken: u64,
    /// Times a connection wanted a buffer of a class that had none free
    /// for it (none free, or it was at its share while others waited): it
    /// waits in the class's queue.
    pub empty: u64,
    /// Wake-ups of waiting connections (one per buffer or window given
    /// back while some wait, and one per wake-up passed on).
    pub wakeups: u64,
    /// Connections waiting now (for a buffer of some class, or a window).
    pub waiting: u32,
    /// Memory windows of the pool (allocated and not deallocated).
    pub windows: u32,
    /// Of those, unbound and free now (the rest are lent to exposures).
    pub windows_free: u32,
    /// Windows lent to exposures so far.
    pub windows_lent: u64,
    /// Windows allocated so far (a window per buffer when the pool was
    /// made, then one each time the pool ran short).
    pub windows_allocated: u64,
    /// Windows deallocated because their connection went down while they
    /// were lent (bound, or their invalidation unconfirmed).
    pub windows_dropped: u64,
    /// Window allocations that failed (the device's `max_mw`, most
    /// likely).
    pub window_alloc_failures: u64,
    /// Times an exposure found no window and none could be allocated (it
    /// waits, and is woken when one comes back).
    pub window_waits: u64,
}

impl BufferPool {
    /// Register `classes` on `nic` (each buffer a region of its own, for
    /// window binding and local writes, and with `confirm` for remote
    /// READs: `docs/serving.md`, "Shared buffers"), which the pool keeps to
    /// deregister them with. Classes of the same size are merged; empty
    /// ones are skipped.
    #[cfg_attr(loom, allow(dead_code))] // the hub's, absent under loom
    pub(crate) fn register<N: Nic + 'static>(
        nic: N,
        classes: &[BufClass],
        confirm: bool,
    ) -> Result<BufferPool, SetupError> {
        let mut wanted: Vec<BufClass> = Vec::new();
        for c in classes.iter().filter(|c| c.size > 0 && c.count > 0) {
            match wanted.iter_mut().find(|w| w.size == c.size) {
                Some(w) => w.count = w.count.saturating_add(c.count),
                None => wanted.push(*c),
            }
        }
        wanted.sort_unstable_by_key(|c| c.size);
        if wanted.is_empty() {
            return Err(ConfigError::EmptyPool.into());
        }
        if wanted.len() > MAX_POOL_CLASSES {
            return Err(
                ConfigError::TooManyPoolClasses { classes: wanted.len(), max: MAX_POOL_CLASSES }.into()
            );
        }
        if let Some(c) = wanted.iter().find(|c| c.count > MAX_POOL_BUFFERS) {
            let (count, size, max) = (c.count, c.size, MAX_POOL_BUFFERS);
            return Err(ConfigError::PoolClassTooLarge { count, size, max }.into());
        }
        let device = OnNic(nic);
        let access = match confirm {
            false => Access::LOCAL_WRITE | Access::MW_BIND,
            true => Access::LOCAL_WRITE | Access::MW_BIND | Access::REMOTE_READ,
        };
        let total: usize = wanted.iter().map(|c| c.count as usize).sum();
        let mut bufs: Vec<Registered> = Vec::with_capacity(total);
        let mut free = Vec::with_capacity(wanted.len());
        let mut firsts = Vec::with_capacity(wanted.len() + 1);
        for c in &wanted {
            let first = bufs.len() as u32;
            firsts.push(first);
            for _ in 0..c.count {
                match Registered::register(&device.0, c.size as usize, access) {
                    Ok(buf) => {
                        if confirm {
                            // Under confirm a peer may READ a buffer while a
                            // user holds it (it was reused), and discards
                            // what it read: the simulator's oracle expects it.
                            buf.mem.expect_reads_of_held();
                        }
                        bufs.push(buf);
                    }
                    Err(e) => {
                        for b in &bufs {
                            device.dereg(b.info.id);
                        }
                        return Err(e.into());
                    }
                }
            }
            free.push((first..first + c.count).rev().collect());
        }
        firsts.push(bufs.len() as u32);
        // A window per buffer: every buffer can be exposed at once without
        // an allocation on the data path.
        let mut windows = Vec::with_capacity(total);
        for _ in 0..total {
            match device.alloc_mw() {
                Ok(w) => windows.push(mw::Window { handle: w.id.raw(), rkey: w.rkey }),
                Err(e) => {
                    for w in &windows {
                        device.dealloc_mw(MwId::from_raw(w.handle));
                    }
                    for b in &bufs {
                        device.dereg(b.info.id);
                    }
                    return Err(e.into());
                }
            }
        }
        let sizes = wanted.iter().map(|c| c.size).collect();
        Ok(BufferPool::from_regions(sizes, bufs, firsts, free, windows, Box::new(device)))
    }

    fn from_regions(
        sizes: Vec<u32>,
        bufs: Vec<Registered>,
        firsts: Vec<u32>,
        free: Vec<Vec<u32>>,
        windows: Vec<mw::Window>,
        device: Box<dyn PoolDevice>,
    ) -> BufferPool {
        let classes = free.len();
        let state = State {
            free,
            owner_of: vec![NOBODY; bufs.len()],
            took_at: vec![0; bufs.len()],
            clock: 0,
            members: Vec::new(),
            vacant: Vec::new(),
            queues: vec![std::collections::VecDeque::new(); classes + 1],
            woken_n: vec![0; classes + 1],
            spare: Vec::with_capacity(classes + 1),
            taken: 0,
            empty: 0,
            wakeups: 0,
            held_bytes: 0,
            windows_lent: 0,
            windows_allocated: windows.len() as u64,
            windows,
            windows_dropped: 0,
            window_alloc_failures: 0,
            window_waits: 0,
        };
        let reserve = firsts.windows(2).map(|w| reserve_of(w[1] - w[0])).collect();
        BufferPool(Arc::new(Inner { sizes, bufs, firsts, reserve, state: Mutex::new(state), device }))
    }

    /// A pool of `classes` over stand-in regions (no NIC), for the loom
    /// models of the wake-up protocol and unit tests.
    #[cfg(any(loom, test))]
    pub(crate) fn for_model(classes: &[BufClass], windows: u32) -> BufferPool {
        let (mut bufs, mut firsts, mut free) = (Vec::new(), Vec::new(), Vec::new());
        for c in classes {
            let first = bufs.len() as u32;
            firsts.push(first);
            for i in 0..c.count {
                let id = MrId::from_raw(first + i + 1);
                let info = MrInfo {
                    id,
                    addr: 0x1000 * u64::from(first + i + 1),
                    len: c.size as usize,
                    lkey: 0,
                    rkey: 0,
                };
                let mem = Memory::zeroed(c.size as usize, 8).expect("a small allocation");
                bufs.push(Registered { info, mem });
            }
            free.push((first..first + c.count).rev().collect());
        }
        firsts.push(bufs.len() as u32);
        /// No NIC, and no room for more windows.
        struct NoDevice;
        impl PoolDevice for NoDevice {
            fn dereg(&self, _: MrId) {}
            fn alloc_mw(&self) -> Result<MwInfo, NicError> {
                Err(NicError::InvalidWr("no more windows in the loom models".into()))
            }
            fn dealloc_mw(&self, _: MwId) {}
        }
        let windows = (0..windows).map(|i| mw::Window { handle: i, rkey: (i + 1) << 8 }).collect();
        BufferPool::from_regions(
            classes.iter().map(|c| c.size).collect(),
            bufs,
            firsts,
            free,
            windows,
            Box::new(NoDevice),
        )
    }

    /// The class sizes, ascending.
    pub fn sizes(&self) -> &[u32] {
        &self.0.sizes
    }

    /// The class of buffers of exactly `size` bytes.
    pub(crate) fn class_of_size(&self, size: u32) -> Option<usize> {
        self.0.sizes.iter().position(|&s| s == size)
    }

    /// Join the pool as a member (a connection's slots). Returns its member
    /// id, and the flag the pool sets (before it wakes the member's waker)
    /// when it is the member's turn for something it waits for.
    pub(crate) fn join(&self) -> (u32, Arc<AtomicBool>) {
        let mut st = self.0.state.lock();
        let classes = self.0.sizes.len();
        let m = match st.vacant.pop() {
            Some(m) => m,
            None => {
                st.members.push(Member::default());
                st.members.len() as u32 - 1
            }
        };
        let flag = Arc::new(AtomicBool::new(false));
        st.members[m as usize] = Member {
            waker: None,
            flag: Some(flag.clone()),
            held: vec![0; classes],
            queued: 0,
            woken: 0,
            used: 0,
        };
        // Room in every queue for every member, made now: waiting
        // allocates nothing.
        let live = st.live() as usize;
        for q in &mut st.queues {
            if q.capacity() < live {
                q.reserve(live - q.len());
            }
        }
        (m, flag)
    }

    /// Member `m` wakes `waker` when its turn comes.
    pub(crate) fn set_waker(&self, m: u32, waker: &Waker) {
        let mut st = self.0.state.lock();
        let member = &mut st.members[m as usize];
        if !member.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
            member.waker = Some(waker.clone());
        }
    }

    /// Member `m` leaves the pool (its connection is gone, every buffer it
    /// could give back given): out of every queue, and a wake-up it had not
    /// used goes to the next waiter.
    pub(crate) fn leave(&self, m: u32) {
        let wake = {
            let mut st = self.0.state.lock();
            for q in &mut st.queues {
                q.retain(|e| e.0 != m);
            }
            let woken = st.unwake_all(m);
            st.members[m as usize] = Member::default();
            st.vacant.push(m);
            self.pass_on(&mut st, woken)
        };
        self.wake_and_keep(wake);
    }

    /// Member `m`'s turn is over: wake-ups it got and did not use (it did
    /// not try again: it wants nothing of that queue now) go to the next
    /// waiter of each queue. Cheap when it has none.
    pub(crate) fn settle(&self, m: u32) {
        let wake = {
            let mut st = self.0.state.lock();
            if st.members[m as usize].woken == 0 {
                return;
            }
            let woken = st.unwake_all(m);
            self.pass_on(&mut st, woken)
        };
        self.wake_and_keep(wake);
    }

    /// Wake the next waiter of each queue in `woken` (bits), where the
    /// queue has something free. The wakers come back in the pool's spare
    /// list (no allocation): wake them outside the lock with [`BufferPool::wake_and_keep`].
    fn pass_on(&self, st: &mut State, woken: u64) -> Vec<Waker> {
        let mut wake = std::mem::take(&mut st.spare);
        if woken == 0 {
            return wake;
        }
        for k in 0..st.queues.len() {
            if woken & (1 << k) == 0 {
                continue;
            }
            let free = if k == self.0.sizes.len() { !st.windows.is_empty() } else { !st.free[k].is_empty() };
            if free {
                let (count, reserve) = self.bounds(k);
                wake.extend(st.wake_next(k, count, reserve));
            }
        }
        wake
    }

    /// Member `m` no longer waits for the pool classes in `classes` (bits):
    /// it found a buffer of a larger class that suits it as well. Out of
    /// those queues (a stale entry would make others defer to it), and a
    /// wake-up it got from one and did not use goes to the next waiter.
    pub(crate) fn withdraw(&self, m: u32, classes: u64) {
        let wake = {
            let mut st = self.0.state.lock();
            let mut woken = 0;
            for k in 0..self.0.sizes.len() {
                if classes & (1 << k) != 0 {
                    st.dequeue(m, k);
                    if st.is_woken(m, k) {
                        st.unwake(m, k);
                        woken |= 1 << k;
                    }
                }
            }
            self.pass_on(&mut st, woken)
        };
        self.wake_and_keep(wake);
    }

    /// Wake `wake` (from [`BufferPool::pass_on`]) outside the lock and
    /// keep the emptied list for the next time.
    fn wake_and_keep(&self, mut wake: Vec<Waker>) {
        wake.drain(..).for_each(Waker::wake);
        let mut st = self.0.state.lock();
        if st.spare.capacity() < wake.capacity() {
            st.spare = wake;
        }
    }

    /// Buffers in class `k`.
    fn count(&self, k: usize) -> u32 {
        self.0.firsts[k + 1] - self.0.firsts[k]
    }

    /// The class of buffer `i`.
    fn class_of(&self, i: u32) -> usize {
        self.0.firsts.partition_point(|&f| f <= i) - 1
    }

    /// What choosing a waiter of queue `k` weighs ([`State::wake_next`]):
    /// a class's buffers (for the shares) and its reserve; `(None, 0)` for
    /// the windows' queue.
    fn bounds(&self, k: usize) -> (Option<u32>, usize) {
        if k == self.0.sizes.len() {
            (None, 0)
        } else {
            (Some(self.count(k)), self.0.reserve[k] as usize)
        }
    }

    /// Take a free buffer of `class` for member `m`, if it may have one now
    /// (it is below its share, or nobody waits, or it was woken for one);
    /// if not, it waits in the class's queue. An `outgoing` take (a user's
    /// alloc) leaves the class's reserve for incoming payloads.
    pub(crate) fn take(&self, m: u32, class: usize, outgoing: bool) -> Option<u32> {
        let mut st = self.0.state.lock();
        let keep = if outgoing { self.0.reserve[class] as usize } else { 0 };
        let taken = if st.may_take(m, class, self.count(class), keep) {
            let i = st.free[class].pop().expect("may_take saw one");
            st.unwake(m, class);
            st.dequeue(m, class);
            st.members[m as usize].held[class] += 1;
            st.owner_of[i as usize] = m;
            st.took_at[i as usize] = st.clock;
            st.taken += 1;
            st.held_bytes += u64::from(self.0.sizes[class]);
            Some(i)
        } else {
            st.empty += 1;
            st.enqueue(m, class, outgoing);
            None
        };
        // Taken: it may have been woken for one of several free, and the
        // next waiter hears of the rest. Not: a free buffer the reserve
        // keeps from it may suit a waiter behind it.
        self.kick(st, class);
        taken
    }

    /// [`State::kick`] for buffer class `class`; the waiter is woken once
    /// `st`, the pool's lock, is released.
    fn kick(&self, mut st: impl std::ops::DerefMut<Target = State>, class: usize) {
        let (count, reserve) = self.bounds(class);
        let wake = st.kick(class, count, reserve);
        drop(st);
        if let Some(w) = wake {
            w.wake();
        }
    }

    /// Whether member `m` may take a buffer of `class` now (as
    /// [`BufferPool::take`] would, with no reserve kept); if not, it waits in
    /// the class's queue.
    pub(crate) fn has_free(&self, m: u32, class: usize) -> bool {
        let mut st = self.0.state.lock();
        if st.may_take(m, class, self.count(class), 0) {
            return true;
        }
        st.enqueue(m, class, false);
        self.kick(st, class);
        false
    }

    /// Give buffer `i` back (its connection has evidence that no remote
    /// access to it is possible) and wake the next connection waiting for
    /// its class.
    pub(crate) fn give(&self, i: u32) {
        let class = self.class_of(i);
        let size = u64::from(self.0.sizes[class]);
        self.put_back(class, |st| {
            debug_assert!(!st.free[class].contains(&i), "buffer {i} given back twice");
            let m = std::mem::replace(&mut st.owner_of[i as usize], NOBODY);
            if let Some(member) = st.members.get_mut(m as usize) {
                member.held[class] = member.held[class].saturating_sub(1);
            }
            st.account(m, i);
            st.held_bytes -= size;
            // A handle of a connection that went down may still hold it:
            // lent to nobody (another handle would alias its slice) until
            // that handle is dropped, which frees it (`unheld`).
            let held = self.0.bufs[i as usize].mem.when_unheld(|| {
                let pool = self.clone();
                Box::new(move || pool.unheld(i))
            });
            if !held {
                st.free[class].push(i);
            }
            !held
        });
    }

    /// Buffer `i`, given back while a user's handle still held it, is free:
    /// that handle was dropped. The next waiter for its class is woken.
    fn unheld(&self, i: u32) {
        let class = self.class_of(i);
        self.put_back(class, |st| {
            st.free[class].push(i);
            true
        });
    }

    /// Change the pool under its lock with `f` (something of queue `k`
    /// came back: a buffer class's, or the windows'), and, if `f` says
    /// something is free for it now, wake the next connection waiting in
    /// that queue.
    fn put_back(&self, k: usize, f: impl FnOnce(&mut State) -> bool) {
        let (count, reserve) = self.bounds(k);
        let wake = {
            let mut st = self.0.state.lock();
            if !f(&mut st) || st.queues[k].is_empty() {
                return;
            }
            st.wake_next(k, count, reserve)
        };
        // Woken outside the lock: waking can drop the last reference to a
        // connection, whose endpoint then gives its own buffers back.
        if let Some(w) = wake {
            w.wake();
        }
    }

    /// The memory of buffer `i`.
    pub(crate) fn memory(&self, i: u32) -> &std::sync::Arc<Memory> {
        &self.0.bufs[i as usize].mem
    }

    /// The registration of buffer `i`.
    pub(crate) fn info(&self, i: u32) -> MrInfo {
        self.0.bufs[i as usize].info
    }

    /// What the pool holds and has done.
    pub fn stats(&self) -> BufferPoolStats {
        let st = self.0.state.lock();
        BufferPoolStats {
            buffers: self.0.bufs.len() as u32,
            free: st.free.iter().map(|f| f.len() as u32).sum(),
            registered_bytes: self.0.bufs.iter().map(|b| b.info.len as u64).sum(),
            held_bytes: st.held_bytes,
            taken: st.taken,
            empty: st.empty,
            wakeups: st.wakeups,
            waiting: st.members.iter().filter(|m| m.queued != 0).count() as u32,
            windows: st.windows_live(),
            windows_free: st.windows.len() as u32,
            windows_lent: st.windows_lent,
            windows_allocated: st.windows_allocated,
            windows_dropped: st.windows_dropped,
            window_alloc_failures: st.window_alloc_failures,
            window_waits: st.window_waits,
        }
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool").field("stats", &self.stats()).finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every window is back by now (a connection holds a handle on the
        // pool until its lent ones are back or deallocated): all unbound.
        let windows = std::mem::take(&mut self.state.lock().windows);
        for w in windows {
            self.device.dealloc_mw(MwId::from_raw(w.handle));
        }
        for b in &self.bufs {
            self.device.dereg(b.info.id);
        }
    }
}
