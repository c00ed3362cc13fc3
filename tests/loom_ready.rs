//! loom model of the endpoint's ready list (`src/conn/ready.rs`): the
//! hand-off between whatever wakes a connection (a completion routed to
//! it, its user's doorbell, a buffer coming home) and the endpoint's
//! driver, which takes the list and gives each connection a turn. Under
//! every interleaving no wake-up is lost (each change is seen by a turn, or
//! the connection is on the list for another) and no connection is on the
//! list twice. And the driver's sleep against waiters that poll the
//! completion queue themselves: a driver that leaves the queue unarmed for
//! them is rung when the last one stops.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" cargo test --release --test loom_ready`
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use mwcap::conn::ready::{Mark, ReadyList};

mod loom_common;
use loom_common::model;

/// `wakers` threads each change the connection's state once and push it;
/// the driver takes up to `rounds` turns meanwhile, then one more look
/// once they are done.
fn no_wake_up_is_lost(wakers: usize, rounds: usize) {
    model(move || {
        let list = Arc::new(ReadyList::<u32>::new());
        let mark = Arc::new(Mark::new());
        // The connection's state: how many changes were made.
        let state = Arc::new(Mutex::new(0usize));
        let threads: Vec<_> = (0..wakers)
            .map(|_| {
                let (list, mark, state) = (list.clone(), mark.clone(), state.clone());
                thread::spawn(move || {
                    *state.lock().unwrap() += 1;
                    list.push(&mark, || 7, true);
                })
            })
            .collect();
        let mut seen = 0;
        let mut due = Vec::new();
        for _ in 0..rounds {
            list.take(&mut due);
            assert!(due.len() <= 1, "on the list twice");
            for _ in due.drain(..) {
                mark.clear();
                seen = *state.lock().unwrap();
            }
        }
        for t in threads {
            t.join().unwrap();
        }
        list.take(&mut due);
        assert!(due.len() <= 1, "on the list twice");
        assert!(
            seen == wakers || due.len() == 1,
            "a wake-up was lost: the last turn saw {seen} of {wakers} changes and the connection is not on the list"
        );
        if due.len() == 1 {
            // The doorbell was rung for it (the driver would have woken).
            assert!(list.bell().take(), "on the list without the driver's doorbell rung");
        }
    });
}

#[test]
fn one_waker_against_the_drivers_turns() {
    no_wake_up_is_lost(1, 2);
}

#[test]
fn two_wakers_against_the_drivers_turns() {
    no_wake_up_is_lost(2, 2);
}

/// The driver's sleep against waiters that poll the completion queue
/// themselves. The driver takes its doorbell, then looks whether a waiter
/// polls; if one does it sleeps without arming the queue, woken only by
/// the doorbell. `spinners` waiters each start and stop polling (the
/// first starts before the driver's turn, as a caller already spinning
/// would; the others race it). Under every interleaving, a driver that
/// sleeps unarmed finds its doorbell rung once they have all stopped: it
/// never sleeps with nobody polling the queue.
fn no_sleep_with_the_queue_unpolled(spinners: usize) {
    model(move || {
        let list = Arc::new(ReadyList::<u32>::new());
        list.spinning(true);
        let threads: Vec<_> = (0..spinners)
            .map(|i| {
                let list = list.clone();
                thread::spawn(move || {
                    if i > 0 {
                        list.spinning(true);
                    }
                    // ... polls the queue for a while ...
                    list.spinning(false);
                })
            })
            .collect();
        // The driver's turn: the doorbell first, then the count.
        list.bell().take();
        let unarmed = list.waiter_polls();
        for t in threads {
            t.join().unwrap();
        }
        assert!(!list.waiter_polls(), "every waiter stopped");
        if unarmed {
            assert!(
                list.bell().take(),
                "the driver left the queue unarmed for a waiter, which stopped without ringing it"
            );
        }
    });
}

#[test]
fn one_spinner_against_the_drivers_sleep() {
    no_sleep_with_the_queue_unpolled(1);
}

#[test]
fn two_spinners_against_the_drivers_sleep() {
    no_sleep_with_the_queue_unpolled(2);
}
