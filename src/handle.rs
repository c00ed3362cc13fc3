//! The rendezvous between the engine driver and the handle a user holds for
//! one operation (a read in flight, a lease awaiting its return).
//!
//! The driver fulfils a [`Slot`] from its thread; the user polls it, takes
//! the value, or drops the handle. Whatever the interleaving, a value (a
//! buffer, a result that owns a buffer) ends in exactly one place: with the
//! user, or — when the user had given up — back with the driver through
//! [`Slot::fulfil`]'s `Err`, or through the [`Recycle`] queue when it arrived
//! just before the user gave up. The loom models in `tests/loom_handle.rs`
//! check this.

use std::task::{Context, Poll, Waker};

use std::sync::atomic::Ordering;

use crate::sync::{Arc, AtomicBool, Mutex};

enum State<T> {
    Waiting(Option<Waker>),
    Ready(T),
    Taken,
    Abandoned,
}

/// A one-shot slot shared between the driver and one user handle.
pub struct Slot<T> {
    state: Mutex<State<T>>,
}

impl<T> Slot<T> {
    /// A new, empty slot.
    pub fn new() -> Arc<Slot<T>> {
        Arc::new(Slot { state: Mutex::new(State::Waiting(None)) })
    }

    /// Make a used slot new again, for reuse by another operation. Only
    /// for a slot nobody else holds (its handle is gone): a value still in
    /// it is dropped.
    pub fn reset(&self) {
        *self.state.lock() = State::Waiting(None);
    }

    /// Driver side: deliver `value`. Returns it back when the user has
    /// already given up, so the driver can recycle it.
    pub fn fulfil(&self, value: T) -> Result<(), T> {
        let waker = {
            let mut st = self.state.lock();
            match &mut *st {
                State::Waiting(w) => {
                    let w = w.take();
                    *st = State::Ready(value);
                    w
                }
                // Abandoned: the user gave up. Or fulfilled twice: a driver
                // bug; keep the first value, hand the second back rather
                // than lose or double-deliver it.
                _ => return Err(value),
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Driver side: whether the user gave up (the operation may be cancelled).
    pub fn is_abandoned(&self) -> bool {
        matches!(*self.state.lock(), State::Abandoned)
    }

    /// User side: take the value if it has arrived, else register `cx`'s waker.
    pub fn poll_take(&self, cx: &mut Context<'_>) -> Poll<T> {
        let mut st = self.state.lock();
        match &mut *st {
            State::Ready(_) => match std::mem::replace(&mut *st, State::Taken) {
                State::Ready(v) => Poll::Ready(v),
                _ => Poll::Pending, // matched Ready under the lock: never
            },
            State::Waiting(w) => {
                // A task polled again keeps its waker (no clone).
                store_waker(w, cx.waker());
                Poll::Pending
            }
            _ => Poll::Pending,
        }
    }

    /// User side: take the value if it has arrived, without waiting.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the loom models use it
    pub fn try_take(&self) -> Option<T> {
        let mut st = self.state.lock();
        match &*st {
            State::Ready(_) => match std::mem::replace(&mut *st, State::Taken) {
                State::Ready(v) => Some(v),
                _ => None, // matched Ready under the lock: never
            },
            _ => None,
        }
    }

    /// User side: give up. Returns a value that had already arrived (the
    /// caller must recycle it); afterwards [`Slot::fulfil`] hands values back.
    pub fn abandon(&self) -> Option<T> {
        let mut st = self.state.lock();
        match &*st {
            State::Ready(_) => match std::mem::replace(&mut *st, State::Abandoned) {
                State::Ready(v) => Some(v),
                _ => None, // matched Ready under the lock: never
            },
            State::Taken => None,
            _ => {
                *st = State::Abandoned;
                None
            }
        }
    }
}

/// Where values go back to the driver when their user gave up after they
/// arrived. The driver drains it in a turn that finds calls abandoned.
pub struct Recycle<T> {
    queue: Mutex<Vec<T>>,
}

impl<T> Recycle<T> {
    /// An empty queue.
    pub fn new() -> Arc<Recycle<T>> {
        Arc::new(Recycle { queue: Mutex::new(Vec::new()) })
    }
    /// Hand a value back.
    pub fn put(&self, value: T) {
        self.queue.lock().push(value);
    }
    /// Take everything handed back so far.
    pub fn drain(&self) -> Vec<T> {
        std::mem::take(&mut *self.queue.lock())
    }
}

/// A user's handle on a [`Slot`]: a future of the value that, when dropped
/// before taking it, gives up and recycles anything that arrived.
pub struct Handle<T> {
    slot: Arc<Slot<T>>,
    recycle: Arc<Recycle<T>>,
    done: bool,
}

impl<T> Handle<T> {
    /// A handle on `slot` recycling into `recycle`.
    pub fn new(slot: Arc<Slot<T>>, recycle: Arc<Recycle<T>>) -> Handle<T> {
        Handle { slot, recycle, done: false }
    }
    /// Take the value if it has arrived.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the loom models use it
    pub fn try_take(&mut self) -> Option<T> {
        let v = self.slot.try_take();
        self.done |= v.is_some();
        v
    }
}

impl<T> std::future::Future for Handle<T> {
    type Output = T;
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let p = self.slot.poll_take(cx);
        if p.is_ready() {
            self.done = true;
        }
        p
    }
}

impl<T> Unpin for Handle<T> {}

impl<T> Drop for Handle<T> {
    fn drop(&mut self) {
        if !self.done {
            if let Some(v) = self.slot.abandon() {
                self.recycle.put(v);
            }
        }
    }
}

/// Leave `new` in `slot` to be woken, unless the waker there already wakes
/// the same task (a task polled again must not clone its waker each time).
pub(crate) fn store_waker(slot: &mut Option<Waker>, new: &Waker) {
    if !slot.as_ref().is_some_and(|w| w.will_wake(new)) {
        *slot = Some(new.clone());
    }
}

/// The driver's doorbell: a user rings it after changing something the
/// driver must look at (a new call, a dropped call future, a close); the
/// driver clears it at the start of each turn and, before it sleeps, checks
/// it and leaves its waker. Whatever the interleaving, a ring after the
/// driver's last look either is seen by [`Doorbell::poll_rung`] or wakes the
/// waker it left: the driver never sleeps through a ring. The loom model
/// `tests/loom_handle.rs::a_ring_is_never_slept_through` checks this.
pub struct Doorbell {
    state: Mutex<Bell>,
    /// `Bell::rung`, readable without the lock. Written under the lock.
    rung: AtomicBool,
}

struct Bell {
    rung: bool,
    waker: Option<Waker>,
}

impl Default for Doorbell {
    fn default() -> Doorbell {
        Doorbell::new()
    }
}

impl Doorbell {
    /// A silent doorbell.
    pub fn new() -> Doorbell {
        Doorbell { state: Mutex::new(Bell { rung: false, waker: None }), rung: AtomicBool::new(false) }
    }

    /// User side: ring, waking the driver if it sleeps. Only the first
    /// ring since the driver's last [`Doorbell::take`] wakes it (the
    /// others find the bell rung already: that ring woke it).
    pub fn ring(&self) {
        let waker = {
            let mut b = self.state.lock();
            if std::mem::replace(&mut b.rung, true) {
                return;
            }
            self.rung.store(true, Ordering::Release);
            b.waker.clone()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Driver side, at the start of a turn: clear the bell; returns whether
    /// it had been rung.
    ///
    /// Without the lock when it finds the bell silent: a ring it does not
    /// see yet stays rung, and [`Doorbell::poll_rung`] sees it.
    pub fn take(&self) -> bool {
        if !self.rung.load(Ordering::Acquire) {
            return false;
        }
        let mut b = self.state.lock();
        self.rung.store(false, Ordering::Relaxed);
        std::mem::take(&mut b.rung)
    }

    /// Driver side, before sleeping: `Ready` if rung since the last
    /// [`Doorbell::take`], else leave `cx`'s waker for the next ring (it
    /// stays in the bell until another replaces it, or
    /// [`Doorbell::forget_waker`]).
    pub fn poll_rung(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut b = self.state.lock();
        if b.rung {
            return Poll::Ready(());
        }
        store_waker(&mut b.waker, cx.waker());
        Poll::Pending
    }

    /// Driver side, as it ends: let go of the waker it left (a ring
    /// afterwards wakes nothing, and the ended task's waker is not kept).
    pub fn forget_waker(&self) {
        let waker = self.state.lock().waker.take();
        drop(waker);
    }

    /// [`Doorbell::poll_rung`] for the bell's one poller (the driver),
    /// which keeps in `held` the waker it left at its last `Pending`.
    /// Without the lock: `Ready` if the bell is rung, and `Pending` if not
    /// while `held`'s waker (in the bell: a ring leaves it there) wakes
    /// `cx`'s task: a ring that comes meanwhile wakes that waker.
    /// Only for a bell nobody else polls (another poller's waker would
    /// replace `held`'s).
    pub fn poll_rung_held(&self, cx: &mut Context<'_>, held: &mut Option<Waker>) -> Poll<()> {
        if self.rung.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        // `held` is what `poll_rung` left in the bell, where a ring leaves
        // it (and only `poll_rung` replaces it).
        if held.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return Poll::Pending;
        }
        let r = self.poll_rung(cx);
        if r.is_pending() {
            store_waker(held, cx.waker());
        }
        r
    }
}
