//! loom model of the endpoint's ready list (`src/conn/ready.rs`): the
//! hand-off between whatever wakes a connection (a completion routed to
//! it, its user's doorbell, a buffer coming home) and the endpoint's
//! driver, which takes the list and gives each connection a turn. Under
//! every interleaving no wake-up is lost (each change is seen by a turn, or
//! the connection is on the list for another) and no connection is on the
//! list twice. And the driver's sleep against waiters that poll the
//! completion queue themselves: a driver that leaves the queue unarmed for
//! them is rung when the last one stops, or, when that one had a long
//! window and got what it waited for, sleeps with its alarm at the end of
//! that window.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" cargo test --release --test loom_ready`
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use mwcap::conn::ready::{Mark, ReadyList};
use std::time::Duration;

/// A time on the endpoint's clock, `n` ns after its epoch.
fn t(n: u64) -> Duration {
    Duration::from_nanos(n)
}

mod loom_common;
use loom_common::model;

/// `wakers` threads each change the connection's state once and push it;
/// the driver takes up to `rounds` turns meanwhile, then one more look
/// once they are done.
fn no_wake_up_is_lost(wakers: usize, rounds: usize) {
    model(move || {
        let list = Arc::new(ReadyList::<u32>::new());
        let mark = Arc::new(Mark::default());
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
            // The driver's loop: its doorbell first, then the list (whose
            // take skips the lock when its flag says nothing is due).
            list.bell().take();
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
        // What the driver finds as it would go to sleep: the doorbell rung
        // since its last loop took it, and then the list.
        let rung = list.bell().take();
        list.take(&mut due);
        assert!(due.len() <= 1, "on the list twice");
        assert!(
            seen == wakers || due.len() == 1,
            "a wake-up was lost: the last turn saw {seen} of {wakers} changes and the connection is not on the list"
        );
        if due.len() == 1 {
            // The doorbell was rung for it (the driver would have woken).
            assert!(rung, "on the list without the driver's doorbell rung since its last loop");
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
/// would; the others race it), none with a long window. Under every
/// interleaving, a driver that sleeps unarmed finds its doorbell rung once
/// they have all stopped: it never sleeps with nobody polling the queue.
fn no_sleep_with_the_queue_unpolled(spinners: usize) {
    model(move || {
        let list = Arc::new(ReadyList::<u32>::new());
        list.start(None);
        let threads: Vec<_> = (0..spinners)
            .map(|i| {
                let list = list.clone();
                thread::spawn(move || {
                    if i > 0 {
                        list.start(None);
                    }
                    // ... polls the queue for a while ...
                    list.stop(false, || t(0));
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

/// A waiter with a long window that got what it waited for leaves without
/// ringing (`ReadyList::stop(true, ..)`, within its window): the queue
/// counts as watched until its window's end, which it published as it
/// started (ringing the doorbell, as no window was open) and moved with a
/// busy turn. Here a short-window
/// waiter already spins when the driver takes its turn, and stops (ringing
/// if it is the last) while the long one starts, moves its end and leaves.
/// The driver takes its doorbell, looks at the count, then at the window:
/// it arms the queue if neither says it is polled, or sleeps unarmed, with
/// its alarm at the window's end if one is open. Under every interleaving
/// a driver that sleeps unarmed without an alarm finds its doorbell rung
/// once both have stopped, and an alarm it sets is for an end a waiter
/// published; afterwards the latest end is kept.
#[test]
fn a_lingering_waiter_leaves_the_driver_an_alarm_or_a_ring() {
    model(|| {
        let list = Arc::new(ReadyList::<u32>::new());
        let now = t(5);
        list.start(None);
        let short = {
            let list = list.clone();
            thread::spawn(move || list.stop(false, || t(0)))
        };
        let long = {
            let list = list.clone();
            thread::spawn(move || {
                list.start(Some((t(20), now)));
                // A busy turn moved the window's end.
                list.extend(t(30));
                // ... got its reply, within its window ...
                list.stop(true, || now);
            })
        };
        list.bell().take();
        let polled = list.waiter_polls();
        let alarm = list.watched(now);
        short.join().unwrap();
        long.join().unwrap();
        if let Some(at) = alarm {
            assert!(at == t(20) || at == t(30), "an alarm at {at:?}, which no waiter published");
        } else if polled {
            assert!(
                list.bell().take(),
                "the driver left the queue unarmed without an alarm, and the waiters stopped without ringing it"
            );
        }
        assert_eq!(list.watched(now), Some(t(30)), "the window's latest end was lost");
        assert_eq!(list.watched(t(30)), None, "a window counts after its end");
    });
}

/// The ends of long windows that two waiters publish against each other
/// (`ReadyList::extend`, as their busy turns move them): an earlier end
/// published after a later one does not replace it, so a driver looking
/// again does not arm the queue while a published window is still open.
#[test]
fn the_latest_window_end_wins() {
    model(|| {
        let list = Arc::new(ReadyList::<u32>::new());
        let threads: Vec<_> = [[10, 20], [11, 30]]
            .into_iter()
            .map(|ends| {
                let list = list.clone();
                thread::spawn(move || {
                    for end in ends {
                        list.extend(t(end));
                    }
                })
            })
            .collect();
        let seen = list.watched(t(0));
        for t in threads {
            t.join().unwrap();
        }
        if let Some(w) = seen {
            assert!([10, 20, 11, 30].map(t).contains(&w), "the driver saw {w:?}, which no waiter published");
        }
        assert_eq!(list.watched(t(0)), Some(t(30)), "the latest window's end was lost");
    });
}

/// A long window's waiter that gets what it waited for only after its
/// window ended (its future polled again late, by a busy executor; the
/// driver handed the reply over meanwhile) must ring as it stops: a driver
/// loop that ran after the window's end but before the stop saw the waiter
/// counted and no window open, and sleeps with the queue unarmed and no
/// alarm. (Before the fix the stop looked only at `lingers`, and another
/// connection's completions then waited for an unrelated ring or timer.)
#[test]
fn a_waiter_stopping_after_its_window_ended_rings() {
    model(|| {
        let list = Arc::new(ReadyList::<u32>::new());
        // The waiter started at 5 with a window to 20; the driver answered
        // the ring of its start.
        list.start(Some((t(20), t(5))));
        list.bell().take();
        let waiter = {
            let list = list.clone();
            // Its next poll, at 30, finds its reply: got it, window long.
            thread::spawn(move || list.stop(true, || t(30)))
        };
        // The driver's loop at 25, woken by its alarm at the window's end.
        list.bell().take();
        let polled = list.waiter_polls();
        let alarm = list.watched(t(25));
        waiter.join().unwrap();
        assert_eq!(alarm, None, "the window ended at 20");
        if polled {
            assert!(
                list.bell().take(),
                "the driver sleeps unarmed with no alarm, and the waiter stopped without ringing"
            );
        }
    });
}
