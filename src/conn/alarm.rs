//! Alarms for sleeping drivers: one thread for the process that wakes a
//! driver at its deadline.
//!
//! Not async-io's `Timer`, whose reactor allocates each time a thread parks
//! in it while a timer is registered (`docs/architecture.md`, "The
//! driver"). An alarm is a slot shared by the driver and the alarm thread:
//! arming it stores the deadline and the waker, and pushes one entry on the
//! thread's heap (a vector that keeps its capacity); moving it later is
//! free (the thread finds the entry stale and re-queues it), and a full
//! heap first drops the entries that will never ring ([`compact`]), so
//! nothing allocates in steady state.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// One driver's alarm. Its slot is made when it is first armed, so an
/// alarm that never needs to ring (`Endpoint::region_write_when_free` on
/// a free range) allocates nothing.
#[derive(Default)]
pub(crate) struct Alarm {
    slot: Option<Arc<Slot>>,
    /// The waker this alarm's last `Pending` left in the slot, while it is
    /// there (only a ring takes it, and a ring sets `Slot::rang`): a poll
    /// with a waker that wakes the same task and no ring answers `Pending`
    /// without the lock ([`Alarm::poll`]).
    held: Option<Waker>,
    /// Disarmed, as the last poll found it: only [`Alarm::arm`] arms it
    /// again, so until then a poll answers `Pending` without the lock.
    idle: bool,
}

#[derive(Default)]
struct Slot {
    /// parking_lot's: no poisoning to check on the driver's path.
    state: parking_lot::Mutex<SlotState>,
    /// `SlotState::rang`, readable without the lock. Written under it,
    /// before a ring wakes the waker.
    rang: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct SlotState {
    /// When to ring (`None`: disarmed).
    at: Option<Instant>,
    /// Whether `at` has passed and the alarm rang since it was armed.
    rang: bool,
    waker: Option<Waker>,
}

struct Wheel {
    heap: Mutex<BinaryHeap<Reverse<(Instant, Entry)>>>,
    wake: Condvar,
}

/// A heap entry: the slot, compared by address only (entries with the
/// same instant are ordered arbitrarily).
struct Entry(Arc<Slot>);

impl PartialEq for Entry {
    fn eq(&self, o: &Entry) -> bool {
        Arc::ptr_eq(&self.0, &o.0)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Entry) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Entry) -> std::cmp::Ordering {
        Arc::as_ptr(&self.0).cmp(&Arc::as_ptr(&o.0))
    }
}

/// Start the alarm thread now if it is not running yet, and return once it
/// runs (an endpoint does, when it is made): its start-up allocations
/// (std's, as the OS first runs a thread) then fall in the setup, not in
/// some later call on the allocation-free call path.
pub(crate) fn start() {
    wheel();
}

fn wheel() -> &'static Wheel {
    static WHEEL: OnceLock<&'static Wheel> = OnceLock::new();
    WHEEL.get_or_init(|| {
        let w: &'static Wheel = Box::leak(Box::new(Wheel {
            heap: Mutex::new(BinaryHeap::with_capacity(64)),
            wake: Condvar::new(),
        }));
        let (running, wait) = std::sync::mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("mwcap-alarm".into())
            .spawn(move || {
                let _ = running.send(());
                w.run()
            })
            .expect("the alarm thread starts");
        // Its body runs after std's start-up of the thread.
        let _ = wait.recv();
        w
    })
}

impl Wheel {
    fn run(&self) {
        let mut heap = self.heap.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let now = Instant::now();
            match heap.peek() {
                None => heap = self.wake.wait(heap).unwrap_or_else(|p| p.into_inner()),
                Some(Reverse((at, _))) if *at > now => {
                    let d = *at - now;
                    heap = self.wake.wait_timeout(heap, d).unwrap_or_else(|p| p.into_inner()).0;
                }
                Some(_) => {
                    let Reverse((at, Entry(slot))) = heap.pop().expect("peeked");
                    let mut st = slot.state.lock();
                    match st.at {
                        // Moved later since: queue it again for then.
                        Some(t) if t > at => {
                            drop(st);
                            heap.push(Reverse((t, Entry(slot))));
                        }
                        Some(_) => {
                            st.rang = true;
                            slot.rang.store(true, std::sync::atomic::Ordering::Release);
                            st.at = None;
                            if let Some(w) = st.waker.take() {
                                drop(st);
                                w.wake();
                            }
                        }
                        None => {} // disarmed
                    }
                }
            }
        }
    }
}

/// Drop the entries that will never ring (their slot disarmed, or armed
/// since for an earlier time, which has an entry of its own), keeping the
/// heap's room: an alarm armed for a call's deadline and then for the end
/// of each short spin window leaves an entry behind per window until the
/// deadline. Called with the heap's lock held, which comes before a slot's
/// (as in `Wheel::run`).
fn compact(heap: &mut BinaryHeap<Reverse<(Instant, Entry)>>) {
    heap.retain(|Reverse((t, Entry(slot)))| slot.state.lock().at.is_some_and(|at| *t <= at));
}

impl Alarm {
    /// An alarm with its slot made now: a driver's, whose first sleep
    /// (inside a call) then allocates nothing.
    pub(crate) fn with_slot() -> Alarm {
        Alarm { slot: Some(Arc::default()), held: None, idle: false }
    }

    /// Ring no later than `at` (an earlier deadline wins; `None` leaves the
    /// alarm as it is); returns when the alarm now rings (`None`:
    /// disarmed), read under the same lock.
    pub(crate) fn arm(&mut self, at: Option<Instant>) -> Option<Instant> {
        let Some(at) = at else { return self.slot.as_ref().and_then(|s| s.state.lock().at) };
        let slot = self.slot.get_or_insert_with(Arc::default);
        let mut st = slot.state.lock();
        match st.at {
            Some(t) if t <= at => Some(t),
            _ => {
                st.at = Some(at);
                st.rang = false;
                slot.rang.store(false, std::sync::atomic::Ordering::Relaxed);
                // A ring since the last poll took the waker `held` names.
                self.held = None;
                self.idle = false;
                drop(st);
                let w = wheel();
                let mut heap = w.heap.lock().unwrap_or_else(|p| p.into_inner());
                let earliest = heap.peek().map_or(true, |Reverse((t, _))| at < *t);
                if heap.len() == heap.capacity() {
                    compact(&mut heap);
                }
                heap.push(Reverse((at, Entry(slot.clone()))));
                drop(heap);
                if earliest {
                    w.wake.notify_one();
                }
                Some(at)
            }
        }
    }

    /// Ready once the alarm rang for the armed deadline (then it is
    /// disarmed). The alarm thread rings it when the deadline passes (it
    /// reads the clock, not the poll: a driver's sleep is polled often).
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // Never armed: nothing will ring.
        let Some(slot) = &self.slot else { return Poll::Pending };
        // Disarmed; or not rung, and the waker in the slot wakes this
        // task: a ring from now on wakes it (it sets `rang` before it
        // takes the waker).
        if self.idle
            || (!slot.rang.load(std::sync::atomic::Ordering::Acquire)
                && self.held.as_ref().is_some_and(|w| w.will_wake(cx.waker())))
        {
            return Poll::Pending;
        }
        let mut st = slot.state.lock();
        if st.rang {
            st.rang = false;
            slot.rang.store(false, std::sync::atomic::Ordering::Relaxed);
            st.at = None;
            self.held = None;
            self.idle = true;
            return Poll::Ready(());
        }
        if st.at.is_some() {
            crate::handle::store_waker(&mut st.waker, cx.waker());
            self.held = st.waker.clone();
        } else {
            self.idle = true;
        }
        Poll::Pending
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        // Disarm: the thread drops its entry when it comes due.
        if let Some(slot) = &self.slot {
            let mut st = slot.state.lock();
            st.at = None;
            st.waker = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Entries that will never ring are dropped when the heap is full
    /// instead of growing it: a thousand alarms armed an hour out and
    /// dropped leave the heap within its first room.
    #[test]
    fn entries_that_will_never_ring_do_not_grow_the_heap() {
        let start = Instant::now();
        for i in 0..1000 {
            let mut a = Alarm::default();
            a.arm(Some(start + Duration::from_secs(3600 + i)));
        }
        let heap = wheel().heap.lock().unwrap_or_else(|p| p.into_inner());
        // Other tests of this process may hold a few live entries.
        assert!(
            heap.len() <= 64 && heap.capacity() <= 128,
            "{} entries, room for {}",
            heap.len(),
            heap.capacity()
        );
    }

    #[test]
    fn an_alarm_rings_at_its_deadline_and_an_earlier_one_wins() {
        let mut a = Alarm::default();
        let start = Instant::now();
        a.arm(Some(start + Duration::from_secs(3600)));
        a.arm(Some(start + Duration::from_millis(30)));
        a.arm(Some(start + Duration::from_secs(60))); // later: ignored
        assert_eq!(a.arm(None), Some(start + Duration::from_millis(30)));
        futures::executor::block_on(std::future::poll_fn(|cx| a.poll(cx)));
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(30), "rang after {waited:?}");
        assert_eq!(a.arm(None), None, "disarmed once rung");
    }

    /// An alarm never armed makes no slot (nothing to allocate), stays
    /// pending, and reports no deadline.
    #[test]
    fn an_alarm_never_armed_has_no_slot() {
        let mut a = Alarm::default();
        a.arm(None);
        assert!(a.slot.is_none());
        assert_eq!(a.arm(None), None);
        assert!(a.poll(&mut Context::from_waker(Waker::noop())).is_pending());
        assert!(a.slot.is_none(), "polling made a slot");
        a.arm(Some(Instant::now() + Duration::from_secs(3600)));
        assert!(a.slot.is_some());
    }

    /// Records which alarm rang, in the order they ring.
    struct Ring(usize, std::sync::mpsc::Sender<usize>);

    impl std::task::Wake for Ring {
        fn wake(self: Arc<Self>) {
            let _ = self.1.send(self.0);
        }
    }

    /// An alarm that rang before it was polled again, and was armed again
    /// meanwhile, rings at the new deadline: the first ring took the
    /// waker the last poll left, so the next poll must leave it again (a
    /// poll that answered from the waker it remembered leaving would
    /// sleep through the second ring). Likewise an alarm polled while
    /// disarmed, then armed (a poll that still took it for disarmed would
    /// leave no waker).
    #[test]
    fn an_alarm_armed_again_after_an_unpolled_ring_wakes_its_poller() {
        let (tx, rx) = std::sync::mpsc::channel();
        let waker = Waker::from(Arc::new(Ring(0, tx)));
        let mut a = Alarm::with_slot();
        // Disarmed: the poll finds nothing to wait for, and the arm below
        // must make the next poll leave its waker.
        assert!(a.poll(&mut Context::from_waker(&waker)).is_pending());
        a.arm(Some(Instant::now() + Duration::from_millis(5)));
        assert!(a.poll(&mut Context::from_waker(&waker)).is_pending());
        rx.recv_timeout(Duration::from_secs(10)).expect("the first ring wakes the poller");
        a.arm(Some(Instant::now() + Duration::from_millis(200)));
        assert!(a.poll(&mut Context::from_waker(&waker)).is_pending(), "rang 200 ms early");
        rx.recv_timeout(Duration::from_secs(10)).expect("the second ring wakes the poller");
        assert!(a.poll(&mut Context::from_waker(&waker)).is_ready());
        // Rung and polled: disarmed, and armed again it rings again.
        assert!(a.poll(&mut Context::from_waker(&waker)).is_pending());
        a.arm(Some(Instant::now() + Duration::from_millis(5)));
        assert!(a.poll(&mut Context::from_waker(&waker)).is_pending());
        rx.recv_timeout(Duration::from_secs(10)).expect("the third ring wakes the poller");
        assert!(a.poll(&mut Context::from_waker(&waker)).is_ready());
    }

    #[test]
    fn many_alarms_ring_in_order() {
        // Alarm i rings at base + 5 ms x (20 - i): the last armed first.
        // The thread takes them off its heap by deadline, so the order in
        // which they ring does not depend on how late it runs.
        let base = Instant::now() + Duration::from_millis(200);
        let (tx, rx) = std::sync::mpsc::channel();
        let mut alarms: Vec<Alarm> = (0..20).map(|_| Alarm::default()).collect();
        for (i, a) in alarms.iter_mut().enumerate() {
            a.arm(Some(base + Duration::from_millis(5 * (20 - i as u64))));
            let waker = Waker::from(Arc::new(Ring(i, tx.clone())));
            assert!(
                a.poll(&mut Context::from_waker(&waker)).is_pending(),
                "alarm {i} rang before its deadline"
            );
        }
        let rang: Vec<usize> = (0..20).map(|_| rx.recv().expect("every alarm rings")).collect();
        assert_eq!(rang, (0..20).rev().collect::<Vec<_>>(), "rung by deadline, earliest first");
        let noop = Waker::noop();
        for (i, a) in alarms.iter_mut().enumerate() {
            assert!(a.poll(&mut Context::from_waker(noop)).is_ready(), "alarm {i} rang");
        }
    }
}
