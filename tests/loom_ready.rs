//! loom model of the endpoint's ready list (`src/conn/ready.rs`): the
//! hand-off between whatever wakes a connection (a completion routed to
//! it, its user's doorbell, a buffer coming home) and the endpoint's
//! driver, which takes the list and gives each connection a turn. Under
//! every interleaving no wake-up is lost (each change is seen by a turn, or
//! the connection is on the list for another) and no connection is on the
//! list twice. And the spin windows that waiters publish while they poll
//! the completion queue themselves: the latest end is kept, which a driver
//! that leaves the queue unarmed for them sleeps until.
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

/// The ends of spin windows that waiters publish (`ReadyList::watch`)
/// against the driver's look before it sleeps (`ReadyList::watched`). Each
/// of `waiters` publishes the end of its window as it starts and a later
/// one as a busy turn moves it; the driver looks once meanwhile. Under
/// every interleaving the end the driver saw, if any, is one a waiter
/// published (its alarm is set for a window that was open), and once they
/// are done the list holds the latest end: an earlier end published after
/// a later one does not replace it, so a driver looking again does not arm
/// the queue and stop sleeping on the alarm while a published window is
/// still open, and it does once the last has ended.
fn the_latest_window_wins(waiters: u64) {
    model(move || {
        let list = Arc::new(ReadyList::<u32>::new());
        let ends = move |i: u64| [10 + i, 20 + 10 * i];
        let threads: Vec<_> = (0..waiters)
            .map(|i| {
                let list = list.clone();
                thread::spawn(move || {
                    for end in ends(i) {
                        list.watch(end);
                    }
                })
            })
            .collect();
        let seen = list.watched(0);
        for t in threads {
            t.join().unwrap();
        }
        let all: Vec<u64> = (0..waiters).flat_map(ends).collect();
        if let Some(w) = seen {
            assert!(all.contains(&w), "the driver saw {w}, which no waiter published");
        }
        let latest = *all.iter().max().expect("a waiter");
        assert_eq!(list.watched(0), Some(latest), "the latest window's end was lost");
        assert_eq!(list.watched(latest), None, "a window counts after its end");
    });
}

#[test]
fn one_waiters_windows_against_the_drivers_look() {
    the_latest_window_wins(1);
}

#[test]
fn two_waiters_windows_against_the_drivers_look() {
    the_latest_window_wins(2);
}
