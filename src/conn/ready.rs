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
//! sleeps by the NIC's arm: a **dear** one (verbs) is left off while any
//! waiter polls, and the last to stop rings ([`ReadyList::waiter_polls`]);
//! a **cheap** one (the simulator) stays armed through
//! [`ReadyList::cq_waker`], so a caller making call after call on another
//! thread than the driver's wakes the driver for none of them. A waiter
//! with a long window ([`LINGER_MIN`]) that got what it waited for leaves
//! without ringing, the driver sleeping on its alarm until the window's
//! end ([`ReadyList::watched`]): what a server posts between its requests
//! wakes no driver on the simulator either. The cases, in full:
//! [`ReadyList::stop`].
//!
//! Why, and what it saves: `docs/architecture.md`, "The driver".
//!
//! `tests/loom_ready.rs` checks the hand-offs under every interleaving of
//! the threads it models (the ready list's, the dear arm's with and
//! without a long window, and the cheap arm's with short waiters and
//! with a long one racing the driver's look for a window).

use crate::handle::Doorbell;
use std::time::Duration;

use crate::sync::{AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

/// The shortest spin window whose waiter, having got what it waited for,
/// leaves without waking the driver, or arming its queue
/// ([`ReadyList::stop`]): the driver then wakes on its alarm once per
/// window, and over a shorter window the alarm's round trip (the alarm
/// thread's wake-up, then the driver's) would cost more than the ring it
/// saves.
pub const LINGER_MIN: Duration = Duration::from_micros(500);

/// Set beside the count of waiters polling the queue ([`ReadyList::cq_waker`])
/// when the queue's waker fired while one polled: the queue is no longer
/// armed, and the last waiter to stop arms it again
/// ([`ReadyList::stop`]).
const FIRED: usize = 1 << (usize::BITS - 1);

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
    /// Whether `list` may hold a member: set under its lock after a push,
    /// so a [`ReadyList::take`] that finds nothing due (most of the
    /// driver's loops) skips the lock. A take that misses a push this way
    /// is one that took the lock before it: the push's ring (read after
    /// the flag by the driver's doorbell) brings the driver back for it.
    pending: AtomicBool,
    /// The doorbell, and the waiters polling the queue: shared with the
    /// queue's waker, `cq_waker`.
    signal: std::sync::Arc<Signal>,
    cq_waker: std::task::Waker,
    /// The latest end of a long spin window, in ns since the endpoint's
    /// epoch ([`ns`]): until then the queue counts as watched.
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
        let signal = std::sync::Arc::new(Signal { bell: Doorbell::new(), spinners: AtomicUsize::new(0) });
        ReadyList {
            list: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            cq_waker: futures::task::waker(signal.clone()),
            signal,
            watch: AtomicU64::new(0),
        }
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
        {
            let mut list = self.list.lock();
            list.push(item());
            self.pending.store(true, Ordering::Release);
        }
        if ring {
            self.signal.bell.ring();
        }
        true
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
    /// by the last waiter to stop unless it lingers, on a dear arm
    /// ([`ReadyList::stop`]), and by the waker of a cheap arm while no
    /// waiter polls ([`ReadyList::cq_waker`]).
    pub fn bell(&self) -> &Doorbell {
        &self.signal.bell
    }

    /// The waker a driver arms a queue whose arm is cheap with: it rings
    /// the doorbell unless a waiter polls the queue, and then marks the
    /// queue as fired, for the last waiter to stop to arm it again
    /// ([`ReadyList::stop`]). It holds only the doorbell and the
    /// count (no connection, no queue), so a NIC may drop it under its own
    /// lock.
    pub fn cq_waker(&self) -> &std::task::Waker {
        &self.cq_waker
    }

    /// A waiter starts polling the completion queue itself. With a long
    /// window, `window` is its end and the time now (both since the
    /// endpoint's epoch): published first, and the doorbell rung if no
    /// window was open, so that a driver asleep without the alarm looks
    /// again.
    pub fn start(&self, window: Option<(Duration, Duration)>) {
        if let Some((until, now)) = window {
            if self.watch.fetch_max(ns(until), Ordering::AcqRel) <= ns(now) {
                self.signal.bell.ring();
            }
        }
        self.signal.spinners.fetch_add(1, Ordering::AcqRel);
    }

    /// A long window's waiter's busy turn moved its end to `until`.
    #[inline]
    pub fn extend(&self, until: Duration) {
        self.watch.fetch_max(ns(until), Ordering::AcqRel);
    }

    /// A waiter stops polling the queue. Unless it is the last to stop,
    /// that is all. For the last one:
    ///
    /// - If the queue's arm is `cheap` and its waker fired while waiters
    ///   polled, it returns true: the caller arms the queue again, and
    ///   rings if the arm finds completions. Even if it lingers: a driver
    ///   that armed the queue sleeps on that arm (it may have looked for
    ///   a window before this waiter published its own, and found none).
    /// - Otherwise, one that `lingers` (a long window's waiter that got
    ///   what it waited for) while a window is still open at `now()`,
    ///   read after the count went down, leaves the queue watched until
    ///   that end.
    /// - Otherwise it rings the doorbell, or with a cheap arm returns true
    ///   if a window is open (the driver may sleep unarmed) for the
    ///   caller to arm the queue.
    ///
    /// Why the read comes after: a driver that saw this waiter counted
    /// ([`ReadyList::waiter_polls`]) read its clock before that, so its
    /// `now` is no later than the waiter's. A window open at the waiter's
    /// `now` was open at the driver's, and the driver set its alarm for
    /// it ([`ReadyList::watched`]); a window already over may have been
    /// over for the driver too (a waiter polled again only after its
    /// window ended, by a busy executor), and then the driver sleeps
    /// with the queue unarmed and no alarm, so the waiter rings. (A
    /// driver whose arm is cheap sleeps unarmed only while it sees a
    /// window, and otherwise on the arm, which the first point keeps.)
    pub fn stop(&self, lingers: bool, cheap: bool, now: impl FnOnce() -> Duration) -> bool {
        let was = self.signal.spinners.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
            Some(if s & !FIRED == 1 { 0 } else { s - 1 })
        });
        let was = was.unwrap_or_else(|s| s);
        if was & !FIRED != 1 {
            return false;
        }
        if cheap && was & FIRED != 0 {
            // The doc's first case: armed again, even by a waiter that lingers.
            return true;
        }
        if !lingers && !cheap {
            self.signal.bell.ring();
            return false;
        }
        let open = self.watch.load(Ordering::Acquire) > ns(now());
        if lingers && open {
            return false;
        }
        if cheap {
            return open;
        }
        self.signal.bell.ring();
        false
    }

    /// Driver, after taking the doorbell and before it sleeps: whether a
    /// waiter polls the queue (then it does not busy-poll, and on a dear
    /// arm need not arm it: when the last waiter stops, the doorbell
    /// rings, or the window below is open). Read before
    /// [`ReadyList::watched`].
    pub fn waiter_polls(&self) -> bool {
        self.signal.spinners.load(Ordering::Acquire) & !FIRED > 0
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

/// What wakes the driver: its doorbell, and for a queue whose arm is
/// cheap, the queue's waker unless a waiter polls it.
struct Signal {
    bell: Doorbell,
    /// Waiters polling the completion queue themselves, and [`FIRED`].
    spinners: AtomicUsize,
}

impl Signal {
    /// The queue's waker fired: whether to wake the driver (not while a
    /// waiter polls: [`ReadyList::cq_waker`]).
    fn cq_woke(&self) -> bool {
        self.spinners
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s & !FIRED > 0).then_some(s | FIRED))
            .is_err()
    }
}

impl futures::task::ArcWake for Signal {
    fn wake_by_ref(this: &std::sync::Arc<Self>) {
        if this.cq_woke() {
            this.bell.ring();
        }
    }
}

/// A time since the endpoint's epoch in ns, as the window's end is kept
/// (u64 ns: 584 years).
#[inline]
fn ns(t: Duration) -> u64 {
    t.as_nanos() as u64
}
