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
//! A waiter that polls the completion queue itself (it spins,
//! `live::driver::Spin`) is counted ([`ReadyList::start`]), and the driver
//! leaves the queue's arm off while any waiter polls
//! ([`ReadyList::waiter_polls`]): the last to stop rings. A waiter with a
//! long window ([`LINGER_MIN`]) that got what it waited for leaves without
//! ringing, the driver sleeping on its alarm until the window's end
//! ([`ReadyList::watched`]). The cases, in full: [`ReadyList::stop`].
//!
//! Why, and what it saves: `docs/architecture.md`, "The driver".
//!
//! `tests/loom_ready.rs` checks the hand-offs under every interleaving of
//! the threads it models (the ready list's, and the waiters' and the
//! driver's with and without a long window).

use crate::handle::Doorbell;
use std::time::Duration;

use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

/// The shortest spin window whose waiter, having got what it waited for,
/// leaves without waking the driver ([`ReadyList::stop`]): the driver
/// then wakes on its alarm once per window, and over a shorter window the
/// alarm's round trip (the alarm thread's wake-up, then the driver's)
/// would cost more than the ring it saves.
pub const LINGER_MIN: Duration = Duration::from_micros(500);

/// Whether a member is on its [`ReadyList`] (or in the driver's hands,
/// before its turn clears it); `Mark::default()`: not on it.
#[derive(Debug, Default)]
pub struct Mark(AtomicBool);

impl Mark {
    /// Driver, at the start of the member's turn and before it reads the
    /// member's state: a wake-up from now on puts it on the list again.
    pub fn clear(&self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Members due a turn, each once, and the doorbell that wakes the driver.
pub struct ReadyList<T> {
    list: Mutex<Vec<T>>,
    /// Whether `list` may hold a member: set under its lock after a push,
    /// so a [`ReadyList::take`] that finds nothing due (most of the
    /// driver's loops) skips the lock. A take that misses a push this way
    /// is one that took the lock before it: the push's ring (read after
    /// the flag by the driver's doorbell) brings the driver back for it.
    pending: AtomicBool,
    /// The driver's doorbell.
    bell: Doorbell,
    /// Waiters polling the completion queue themselves.
    spinners: AtomicUsize,
    /// The latest end of a long spin window, in ns since the endpoint's
    /// epoch ([`ns`]): until then the queue counts as watched.
    watch: AtomicU64,
}

impl<T> ReadyList<T> {
    /// An empty list.
    pub fn new() -> ReadyList<T> {
        ReadyList {
            list: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            bell: Doorbell::new(),
            spinners: AtomicUsize::new(0),
            watch: AtomicU64::new(0),
        }
    }

    /// Put the member whose mark is `mark` on the list (made by `item`)
    /// unless it is on it already, and with `ring` wake the driver (not
    /// when the driver itself pushes: it takes the list next anyway).
    /// Call it after the change that is the reason.
    #[inline(always)]
    pub fn push(&self, mark: &Mark, item: impl FnOnce() -> T, ring: bool) {
        if mark.0.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut list = self.list.lock();
            list.push(item());
            self.pending.store(true, Ordering::Release);
        }
        if ring {
            self.bell.ring();
        }
    }

    /// Driver: move the members due a turn into `out` (emptied first), in
    /// the order they came.
    pub fn take(&self, out: &mut Vec<T>) {
        out.clear();
        if !self.pending.load(Ordering::Acquire) {
            return;
        }
        let mut list = self.list.lock();
        self.pending.store(false, Ordering::Relaxed);
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

    /// The driver's doorbell, rung by [`ReadyList::push`], by a waiter
    /// that opens a long window when none is open ([`ReadyList::start`]),
    /// and by the last waiter to stop unless it lingers
    /// ([`ReadyList::stop`]).
    pub fn bell(&self) -> &Doorbell {
        &self.bell
    }

    /// A waiter starts polling the completion queue itself. With a long
    /// window, `window` is its end and the time now (both since the
    /// endpoint's epoch): published first, and the doorbell rung if no
    /// window was open, so that a driver asleep without the alarm looks
    /// again.
    pub fn start(&self, window: Option<(Duration, Duration)>) {
        if let Some((until, now)) = window {
            if self.watch.fetch_max(ns(until), Ordering::AcqRel) <= ns(now) {
                self.bell.ring();
            }
        }
        self.spinners.fetch_add(1, Ordering::AcqRel);
    }

    /// A long window's waiter's busy turn moved its end to `until`.
    #[inline]
    pub fn extend(&self, until: Duration) {
        self.watch.fetch_max(ns(until), Ordering::AcqRel);
    }

    /// A waiter stops polling the queue. Unless it is the last to stop,
    /// that is all. The last one rings the doorbell, unless it `lingers`
    /// (a long window's waiter that got what it waited for) while a window
    /// is still open at `now()`, read after the count went down: the queue
    /// then stays watched until that end.
    ///
    /// Why the read comes after: a driver that saw this waiter counted
    /// ([`ReadyList::waiter_polls`]) read its clock before that, so its
    /// `now` is no later than the waiter's. A window open at the waiter's
    /// `now` was open at the driver's, and the driver set its alarm for
    /// it ([`ReadyList::watched`]); a window already over may have been
    /// over for the driver too (a waiter polled again only after its
    /// window ended, by a busy executor), and then the driver sleeps
    /// with the queue unarmed and no alarm, so the waiter rings.
    pub fn stop(&self, lingers: bool, now: impl FnOnce() -> Duration) {
        if self.spinners.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if lingers && self.watch.load(Ordering::Acquire) > ns(now()) {
            return;
        }
        self.bell.ring();
    }

    /// Driver, after taking the doorbell and before it sleeps: whether a
    /// waiter polls the queue (then it does not busy-poll, and need not
    /// arm it: when the last waiter stops, the doorbell rings, or the
    /// window below is open). Read before [`ReadyList::watched`].
    pub fn waiter_polls(&self) -> bool {
        self.spinners.load(Ordering::Acquire) > 0
    }

    /// Driver, before it sleeps: the end of the latest long window if it is
    /// after `now` (since the endpoint's epoch). The driver may then sleep
    /// without arming the queue, its alarm set for that end.
    #[inline]
    pub fn watched(&self, now: Duration) -> Option<Duration> {
        let until = self.watch.load(Ordering::Acquire);
        (until > ns(now)).then(|| Duration::from_nanos(until))
    }
}

/// A time since the endpoint's epoch in ns, as the window's end is kept
/// (u64 ns: 584 years).
#[inline]
fn ns(t: Duration) -> u64 {
    t.as_nanos() as u64
}
