//! loom models of the driver/handle rendezvous (`mwcap::handle`): whatever
//! the interleaving of the driver fulfilling a slot and the user taking or
//! dropping its handle, the value (standing for a buffer) ends in exactly one
//! place.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" cargo test --release --test loom_handle`
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use mwcap::handle::{Handle, Recycle, Slot};

mod loom_common;
use loom_common::model;

/// A value whose drop is counted, so a lost or duplicated buffer shows up.
struct Buf(Arc<AtomicUsize>);
impl Drop for Buf {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn fulfil_races_with_drop_of_the_handle() {
    model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let slot = Slot::new();
        let recycle = Recycle::new();
        let handle = Handle::new(slot.clone(), recycle.clone());
        let d = drops.clone();
        let driver = thread::spawn(move || {
            // The driver gets the value back iff the user had given up.
            match slot.fulfil(Buf(d)) {
                Ok(()) => 0,
                Err(b) => {
                    drop(b);
                    1
                }
            }
        });
        drop(handle);
        let returned_to_driver = driver.join().unwrap();
        let recycled = recycle.drain();
        // Exactly one of: the driver got it back, or it went to the recycle queue.
        assert_eq!(returned_to_driver + recycled.len(), 1);
        drop(recycled);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn fulfil_races_with_take() {
    model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let slot = Slot::new();
        let recycle = Recycle::new();
        let mut handle = Handle::new(slot.clone(), recycle.clone());
        let d = drops.clone();
        let driver = thread::spawn(move || slot.fulfil(Buf(d)).is_ok());
        let taken = handle.try_take();
        let delivered = driver.join().unwrap();
        assert!(delivered, "the user never gave up, so the driver must deliver");
        let got = taken.or_else(|| handle.try_take());
        assert!(got.is_some(), "a delivered value must be takeable");
        drop(handle);
        assert!(recycle.drain().is_empty(), "a taken value is never also recycled");
        drop(got);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn abandon_is_visible_to_the_driver_or_the_value_is_recycled() {
    model(|| {
        let slot: Arc<Slot<u32>> = Slot::new();
        let recycle = Recycle::new();
        let handle = Handle::new(slot.clone(), recycle.clone());
        let s2 = slot.clone();
        let user = thread::spawn(move || drop(handle));
        let saw_abandon = s2.is_abandoned();
        let r = if saw_abandon { s2.fulfil(7) } else { Ok(()) };
        user.join().unwrap();
        if saw_abandon {
            assert_eq!(r, Err(7), "after an abandon the driver keeps its value");
        }
        assert!(slot.is_abandoned());
    });
}

#[test]
fn a_ring_is_never_slept_through() {
    use mwcap::handle::Doorbell;
    model(|| {
        let bell = Arc::new(Doorbell::new());
        let work = Arc::new(AtomicUsize::new(0));
        let (b, w) = (bell.clone(), work.clone());
        // The user: does something for the driver, then rings.
        let user = thread::spawn(move || {
            w.store(1, Ordering::SeqCst);
            b.ring();
        });
        // The driver: a turn looks for work; with none, it sleeps on the
        // bell. If a ring could be slept through, loom reports a deadlock.
        loop {
            bell.take();
            if work.load(Ordering::SeqCst) == 1 {
                break;
            }
            loom::future::block_on(std::future::poll_fn(|cx| bell.poll_rung(cx)));
        }
        user.join().unwrap();
    });
}

/// The driver's lock-free look at its bell (`Doorbell::poll_rung_held`),
/// as the hub's driver uses it: one task for the whole loop (so the waker it
/// left stays the same), and a second source of wake-ups (standing for the
/// completion queue) that ends a sleep while the bell keeps its waker, so
/// the next sleep takes the lock-free path. No ring is slept through.
#[test]
fn a_ring_is_never_slept_through_with_a_held_waker() {
    use mwcap::handle::Doorbell;
    model(|| {
        let bell = Arc::new(Doorbell::new());
        let other = Arc::new(Doorbell::new());
        let work = Arc::new(AtomicUsize::new(0));
        let (b, o, w) = (bell.clone(), other.clone(), work.clone());
        // The other source first (the bell keeps its waker through that
        // wake-up), then the work and its ring.
        let user = thread::spawn(move || {
            o.ring();
            w.store(1, Ordering::SeqCst);
            b.ring();
        });
        // The driver's task, polled by hand with one waker for its life (so
        // that the waker it leaves in the bell is the one it is polled with).
        struct Task(loom::sync::Notify);
        impl std::task::Wake for Task {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.notify();
            }
        }
        let task = std::sync::Arc::new(Task(loom::sync::Notify::new()));
        let waker = std::task::Waker::from(task.clone());
        assert!(waker.clone().will_wake(&waker), "the model needs a waker that knows its clones");
        let mut cx = std::task::Context::from_waker(&waker);
        let mut held = None;
        loop {
            bell.take();
            other.take();
            if work.load(Ordering::SeqCst) == 1 {
                break;
            }
            loop {
                let bell_rung = bell.poll_rung_held(&mut cx, &mut held).is_ready();
                if bell_rung || other.poll_rung(&mut cx).is_ready() {
                    break;
                }
                task.0.wait();
            }
        }
        user.join().unwrap();
    });
}
