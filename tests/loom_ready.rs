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
//! that window. And a queue whose arm is cheap (the simulator's), kept
//! armed while waiters poll it: a completion is never left in the queue
//! with the driver asleep, nor the queue left unarmed.
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
                    list.stop(false, false, || t(0));
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
            thread::spawn(move || list.stop(false, false, || t(0)))
        };
        let long = {
            let list = list.clone();
            thread::spawn(move || {
                list.start(Some((t(20), now)));
                // A busy turn moved the window's end.
                list.extend(t(30));
                // ... got its reply, within its window ...
                list.stop(true, false, || now);
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
            thread::spawn(move || list.stop(true, false, || t(30)))
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

/// A completion queue whose arm is cheap, as the simulator's: its entries,
/// and the waker it was armed with. A completion wakes that waker (once)
/// under the queue's lock; arming finds entries (`Ready`) or stores the
/// waker (`Pending`), as `NicOps::poll_cq_ready` does.
struct CheapCq {
    state: Mutex<(usize, Option<std::task::Waker>)>,
}

impl CheapCq {
    fn new() -> CheapCq {
        CheapCq { state: Mutex::new((0, None)) }
    }
    /// The NIC queues a completion.
    fn complete(&self) {
        let mut s = self.state.lock().unwrap();
        s.0 += 1;
        if let Some(w) = s.1.take() {
            w.wake();
        }
    }
    /// Arm with the list's waker: whether entries were there (`Ready`).
    fn arm(&self, list: &ReadyList<u32>) -> bool {
        let mut s = self.state.lock().unwrap();
        if s.0 > 0 {
            return true;
        }
        s.1 = Some(list.cq_waker().clone());
        false
    }
    /// Take every entry; how many.
    fn poll(&self) -> usize {
        std::mem::take(&mut self.state.lock().unwrap().0)
    }
    fn armed(&self) -> bool {
        self.state.lock().unwrap().1.is_some()
    }
}

/// A queue whose arm is cheap stays armed while waiters poll it
/// (`ReadyList::cq_waker`, `ReadyList::stop`). `spinners` waiters
/// each start (the first before the post, as a call does), poll the queue
/// once and stop, re-arming it if they are the last and its waker fired
/// meanwhile; the NIC queues one completion, racing them; the driver takes
/// its doorbell and arms the queue, then sleeps unless the arm found
/// entries. Under every interleaving, once all are done a completion
/// nobody took is found: the driver's arm saw it, or its doorbell is rung.
/// And the queue is left armed unless the doorbell is rung (the driver
/// then arms it itself): no completion later can go unseen.
fn a_cheap_arm_is_never_left_fired(spinners: usize) {
    model(move || {
        let list = Arc::new(ReadyList::<u32>::new());
        let cq = Arc::new(CheapCq::new());
        list.start(None);
        let nic = {
            let cq = cq.clone();
            thread::spawn(move || cq.complete())
        };
        let waiters: Vec<_> = (0..spinners)
            .map(|i| {
                let (list, cq) = (list.clone(), cq.clone());
                thread::spawn(move || {
                    if i > 0 {
                        list.start(None);
                    }
                    let took = cq.poll();
                    if list.stop(false, true, || t(0)) && cq.arm(&list) {
                        list.bell().ring();
                    }
                    took
                })
            })
            .collect();
        // The driver's loop: its doorbell, then the arm it sleeps on.
        list.bell().take();
        let driver_polls = cq.arm(&list);
        nic.join().unwrap();
        let took: usize = waiters.into_iter().map(|w| w.join().unwrap()).sum();
        assert!(!list.waiter_polls(), "every waiter stopped");
        let rung = list.bell().take();
        let left = cq.state.lock().unwrap().0;
        assert!(took + left == 1, "the completion was taken twice or lost");
        if left == 1 {
            assert!(
                driver_polls || rung,
                "a completion waits in the queue, and neither the driver's arm saw it nor its doorbell rang"
            );
        }
        assert!(
            driver_polls || rung || cq.armed(),
            "the queue is left unarmed (its waker fired while a waiter polled) and the driver sleeps"
        );
    });
}

#[test]
fn a_cheap_arm_against_one_spinner() {
    a_cheap_arm_is_never_left_fired(1);
}

#[test]
fn a_cheap_arm_against_two_spinners() {
    a_cheap_arm_is_never_left_fired(2);
}

/// A cheap arm against a waiter with a long window whose start races the
/// driver's look for a window. A window published earlier ends at 20; the
/// waiter read its clock at 10, before that end, so its start (window to
/// 40) does not ring; the driver, at 25, may look before that start, find
/// no window and sleep on the arm; a completion then fires the arm while
/// the waiter spins; and the waiter, which got what it waited for within
/// its window, lingers. Under every interleaving a driver that slept on
/// the arm finds the queue armed again, or its doorbell rung, and a
/// completion nobody took is seen. (Before the fix the lingering waiter
/// left the fired queue unarmed, with no alarm and no ring.)
#[test]
fn a_cheap_arm_against_a_lingering_waiter() {
    model(|| {
        let list = Arc::new(ReadyList::<u32>::new());
        let cq = Arc::new(CheapCq::new());
        list.extend(t(20));
        let nic = {
            let cq = cq.clone();
            thread::spawn(move || cq.complete())
        };
        let waiter = {
            let (list, cq) = (list.clone(), cq.clone());
            thread::spawn(move || {
                list.start(Some((t(40), t(10))));
                let took = cq.poll();
                if list.stop(true, true, || t(30)) && cq.arm(&list) {
                    list.bell().ring();
                }
                took
            })
        };
        // The driver's loop at 25: its doorbell, then a window; with none,
        // it sleeps on the arm (with one, unarmed, its alarm at its end).
        list.bell().take();
        let alarm = list.watched(t(25));
        let driver_polls = alarm.is_none() && cq.arm(&list);
        nic.join().unwrap();
        let took = waiter.join().unwrap();
        let rung = list.bell().take();
        let left = cq.state.lock().unwrap().0;
        assert!(took + left == 1, "the completion was taken twice or lost");
        if alarm.is_none() {
            assert!(
                driver_polls || rung || cq.armed(),
                "the driver sleeps on an arm that fired, and the lingering waiter left it unarmed"
            );
            if left == 1 {
                assert!(driver_polls || rung, "a completion waits, and the driver sleeps without a ring");
            }
        } else {
            assert_eq!(alarm, Some(t(40)), "an alarm for an end no waiter published");
        }
    });
}
