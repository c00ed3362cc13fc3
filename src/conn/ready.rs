//! The hub's ready list: the connections due a turn of the endpoint's
//! driver, each on it at most once.
//!
//! Whatever wakes a connection (a completion routed to its inbox, its
//! user's doorbell, a buffer handle coming home, its timer) first changes
//! the connection's state under that state's lock, then [`ReadyList::push`]es
//! it; the driver [`take`](ReadyList::take)s the list, and for each
//! connection [`Mark::clear`]s its mark and only then reads its state. So a
//! wake-up is never lost: a push that found the mark set was made before
//! the clear (its change is read by the turn that follows), and one made
//! after the clear puts the connection on the list again (another turn).
//!
//! A waiter may poll the completion queue itself for a while (it spins,
//! `live::driver::Spin`), and the driver then leaves the queue unarmed: every
//! completion would otherwise raise an event, a system call and a wake-up.
//! Each waiter publishes the end of its spin window ([`ReadyList::watch`]):
//! the queue is watched until the latest one. A driver that finds it
//! watched ([`ReadyList::watched`]) sleeps unarmed with its alarm set for
//! that end, and then looks again; a waiter that got what it waited for
//! leaves without waking it, so that a caller or server making one call or
//! reply after another, each found by its own polling, costs the driver no
//! wake-up per call (it wakes once a window, and at the end polls and arms
//! the queue). A completion that comes once the waiters have gone waits at
//! most until the end of the last window.
//!
//! `tests/loom_ready.rs` checks the list's hand-off under every
//! interleaving, and that concurrent windows leave the latest end.

use crate::handle::Doorbell;
use crate::sync::{AtomicBool, AtomicU64, Mutex, Ordering};

/// Whether a member is on its [`ReadyList`] (or in the driver's hands,
/// before its turn clears it).
#[derive(Debug, Default)]
pub struct Mark(AtomicBool);

impl Mark {
    /// A member not on the list.
    pub fn new() -> Mark {
        Mark(AtomicBool::new(false))
    }

    /// Driver, at the start of the member's turn and before it reads the
    /// member's state: a wake-up from now on puts it on the list again.
    pub fn clear(&self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Members due a turn, each once, and the doorbell that wakes the driver.
pub struct ReadyList<T> {
    list: Mutex<Vec<T>>,
    bell: Doorbell,
    /// Until when a waiter polls the completion queue itself: the latest
    /// end of a spin window published, in ns since the endpoint's epoch.
    watch: AtomicU64,
}

impl<T> Default for ReadyList<T> {
    fn default() -> Self {
        ReadyList::new()
    }
}

impl<T> ReadyList<T> {
    /// An empty list.
    pub fn new() -> ReadyList<T> {
        ReadyList { list: Mutex::new(Vec::new()), bell: Doorbell::new(), watch: AtomicU64::new(0) }
    }

    /// Put the member whose mark is `mark` on the list (made by `item`)
    /// unless it is on it already, and with `ring` wake the driver (not
    /// when the driver itself pushes: it takes the list next anyway).
    /// Call it after the change that is the reason. Whether it was added.
    #[inline(always)]
    pub fn push(&self, mark: &Mark, item: impl FnOnce() -> T, ring: bool) -> bool {
        if mark.0.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.list.lock().push(item());
        if ring {
            self.bell.ring();
        }
        true
    }

    /// Driver: move the members due a turn into `out` (emptied first), in
    /// the order they came.
    pub fn take(&self, out: &mut Vec<T>) {
        out.clear();
        let mut list = self.list.lock();
        // The list and `out` trade places: each keeps room for as many
        // members as either has held, so a push never grows it after the
        // first time that many were due.
        if out.capacity() < list.capacity() {
            out.reserve(list.capacity());
        }
        std::mem::swap(&mut *list, out);
    }

    /// Make room on the list for `members` (each is on it at most once),
    /// so that a push never allocates.
    pub fn reserve(&self, members: usize) {
        let mut list = self.list.lock();
        let len = list.len();
        if list.capacity() < members {
            list.reserve(members - len);
        }
    }

    /// The driver's doorbell, rung by [`ReadyList::push`].
    pub fn bell(&self) -> &Doorbell {
        &self.bell
    }

    /// A waiter polls the completion queue itself until `until` (ns since
    /// the endpoint's epoch): the end of its spin window, published when it
    /// starts and whenever a busy turn moves it. The latest end wins.
    #[inline]
    pub fn watch(&self, until: u64) {
        self.watch.fetch_max(until, Ordering::AcqRel);
    }

    /// Driver, before it sleeps: the end of the latest spin window if it is
    /// after `now` (ns since the endpoint's epoch). The driver may then
    /// sleep without arming the queue, its alarm set for that end.
    #[inline]
    pub fn watched(&self, now: u64) -> Option<u64> {
        let until = self.watch.load(Ordering::Acquire);
        (until > now).then_some(until)
    }
}
