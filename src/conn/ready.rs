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
//! `tests/loom_ready.rs` checks it under every interleaving.

use crate::handle::Doorbell;
use crate::sync::{AtomicBool, Mutex, Ordering};

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
}

impl<T> Default for ReadyList<T> {
    fn default() -> Self {
        ReadyList::new()
    }
}

impl<T> ReadyList<T> {
    /// An empty list.
    pub fn new() -> ReadyList<T> {
        ReadyList { list: Mutex::new(Vec::new()), bell: Doorbell::new() }
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
}
