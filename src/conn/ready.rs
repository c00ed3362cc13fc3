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
//! The list counts those waiters ([`ReadyList::spinning`]); the last to
//! stop rings the doorbell, so the driver, which looked at the count after
//! taking the doorbell, polls and arms the queue again rather than sleep
//! with nobody polling it.
//!
//! `tests/loom_ready.rs` checks both hand-offs under every interleaving.

use crate::handle::Doorbell;
use crate::sync::{AtomicBool, AtomicUsize, Mutex, Ordering};

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
    /// Waiters polling the completion queue themselves.
    spinners: AtomicUsize,
}

impl<T> Default for ReadyList<T> {
    fn default() -> Self {
        ReadyList::new()
    }
}

impl<T> ReadyList<T> {
    /// An empty list.
    pub fn new() -> ReadyList<T> {
        ReadyList { list: Mutex::new(Vec::new()), bell: Doorbell::new(), spinners: AtomicUsize::new(0) }
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

    /// The driver's doorbell, rung by [`ReadyList::push`] and by the last
    /// waiter to stop spinning.
    pub fn bell(&self) -> &Doorbell {
        &self.bell
    }

    /// A waiter starts (`true`) or stops polling the completion queue
    /// itself. The last to stop rings the doorbell: the driver, which may
    /// have left the queue unarmed for it, polls and arms it again.
    pub fn spinning(&self, on: bool) {
        if on {
            self.spinners.fetch_add(1, Ordering::AcqRel);
        } else if self.spinners.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.bell.ring();
        }
    }

    /// Driver, after taking the doorbell and before it sleeps: whether a
    /// waiter polls the queue (then it need not arm it: when the last
    /// waiter stops, the doorbell rings).
    pub fn waiter_polls(&self) -> bool {
        self.spinners.load(Ordering::Acquire) > 0
    }
}
