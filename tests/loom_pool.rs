//! loom models of the shared buffer pool's wake-up protocol
//! (`mwcap::conn::BufferPool`): a connection that finds the pool empty is
//! never left waiting for a buffer (or a window) that has come back. Whatever the
//! interleaving of its take and another connection's give, either the
//! take gets the buffer, or the giver wakes it and its next turn sees that
//! a buffer came back (`unstarve`) and takes it.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 RUSTFLAGS="--cfg loom" cargo test --release --test loom_pool`
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use mwcap::conn::pool_model::{pool, BackedSlots};

mod loom_common;
use loom_common::model;

/// Counts its wake-ups (a connection's hub waker).
struct Woken(AtomicUsize);
impl futures::task::ArcWake for Woken {
    fn wake_by_ref(this: &std::sync::Arc<Self>) {
        this.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn waker() -> (std::sync::Arc<Woken>, std::task::Waker) {
    let w = std::sync::Arc::new(Woken(AtomicUsize::new(0)));
    (w.clone(), futures::task::waker(w))
}

/// Connection A holds the pool's only `T` (taken with `take`) and gives it
/// back (`give`) on another thread while connection B takes one: either B
/// gets it, or B was woken, its turn sees that one came back (`unstarve`)
/// and its retry gets it. `same` says whether what B got is A's very one
/// (a window is; a buffer is named by each connection's own slot).
fn a_take_racing_a_give_gets_it_or_is_woken<T: Copy + std::fmt::Debug + Send + 'static>(
    take: fn(&mut BackedSlots) -> Option<T>,
    give: fn(&mut BackedSlots, T),
    same: fn(T, T) -> bool,
) {
    model(move || {
        let p = pool(64, 1);
        let mut a = BackedSlots::new(&p, 64, 1);
        let mut b = BackedSlots::new(&p, 64, 1);
        let (woken, w) = waker();
        b.wake_on_pool(&w);
        let held = take(&mut a).expect("the pool's only one");
        let giver = thread::spawn(move || {
            give(&mut a, held);
            a
        });
        let got = take(&mut b);
        let _a = giver.join().unwrap();
        let got = match got {
            Some(got) => got,
            None => {
                assert_eq!(woken.0.load(Ordering::SeqCst), 1, "B found the pool empty and was never woken");
                assert!(b.unstarve(), "B's turn would not try again");
                take(&mut b).expect("it is there for B's retry")
            }
        };
        assert!(same(got, held), "B got {got:?}, not {held:?}");
    });
}

/// One buffer; connection A holds it and gives it back while connection B
/// tries to take one (`alloc`).
#[test]
fn a_take_that_finds_the_pool_empty_is_woken_by_the_next_give() {
    a_take_racing_a_give_gets_it_or_is_woken(|s| s.take(), |s, i| assert!(s.give_back(i)), |_, _| true);
}

/// The same through `can_take` (a READ waiting for a destination asks
/// before it takes), with two connections waiting: a give wakes **one**
/// of them (the first to wait), and a woken connection that does not take
/// (its turn, and the turn after it, end without a try) passes the wake-up
/// on to the other, which then gets the buffer. Nobody is left asleep
/// beside a free buffer.
#[test]
fn a_give_wakes_one_waiter_and_an_unused_wake_up_passes_on() {
    model(|| {
        let p = pool(64, 1);
        let mut a = BackedSlots::new(&p, 64, 1);
        let held = a.take().expect("the pool's only buffer");
        let mut waiters = Vec::new();
        for _ in 0..2 {
            let mut s = BackedSlots::new(&p, 64, 1);
            let (woken, w) = waker();
            s.wake_on_pool(&w);
            waiters.push((s, woken));
        }
        let giver = thread::spawn(move || {
            assert!(a.give_back(held));
            a
        });
        let mut asked = Vec::new();
        for (s, _) in &mut waiters {
            asked.push(s.can_take());
        }
        let _a = giver.join().unwrap();
        let woken = |w: &[(BackedSlots, std::sync::Arc<Woken>)]| {
            w.iter().map(|(_, n)| n.0.load(Ordering::SeqCst)).collect::<Vec<_>>()
        };
        let queued = asked.iter().filter(|c| !**c).count();
        let now = woken(&waiters);
        assert_eq!(now.iter().sum::<usize>(), usize::from(queued > 0), "one give, one wake-up: {now:?}");
        if queued == 2 {
            // Both waited: the first is woken. Its turn, and the one after,
            // end without a try: the wake-up passes on to the second.
            assert_eq!(now, vec![1, 0]);
            let (first, _) = &mut waiters[0];
            assert!(first.unstarve(), "a woken waiter's turn sees that something came back");
            assert!(first.end_turn(), "one more turn is due");
            assert!(!first.end_turn());
            assert_eq!(woken(&waiters), vec![1, 1], "the unused wake-up went to the second");
            let (second, _) = &mut waiters[1];
            assert!(second.unstarve());
            assert!(second.take().is_some(), "the second gets the buffer");
        } else {
            // One asked after the give: whoever may take it does.
            assert!(waiters.iter_mut().any(|(s, _)| s.take().is_some()));
        }
    });
}

/// Connection A holds the pool's two buffers and gives both back on
/// another thread while B and C, each wanting one, ask in turn. Three
/// connections on two buffers have no guaranteed share, so one that asks
/// while another is woken waits in the queue. Whatever the interleaving,
/// both end with a buffer: in particular, when B was woken by the first
/// give, the second give found nobody queued, and C queued only then, B's
/// take of one wakes C for the other (before, C slept beside a free
/// buffer until some other give).
#[test]
fn a_woken_waiter_that_takes_one_of_two_wakes_the_next() {
    model(|| {
        let p = pool(64, 2);
        let mut a = BackedSlots::new(&p, 64, 2);
        let held = [a.take().expect("a buffer"), a.take().expect("the other")];
        let mut waiters = Vec::new();
        for _ in 0..2 {
            let mut s = BackedSlots::new(&p, 64, 1);
            let (woken, w) = waker();
            s.wake_on_pool(&w);
            waiters.push((s, woken, None));
        }
        let giver = thread::spawn(move || {
            for i in held {
                assert!(a.give_back(i));
            }
            a
        });
        for (s, _, got) in &mut waiters {
            if s.can_take() {
                *got = s.take();
            }
        }
        let _a = giver.join().unwrap();
        // Each connection's turns, as its driver runs them when woken: a
        // woken one tries again; a turn that ends without a try passes an
        // unused wake-up on. Two rounds are enough for anyone woken.
        for _ in 0..2 {
            for (s, woken, got) in &mut waiters {
                if got.is_none() && woken.0.load(Ordering::SeqCst) > 0 && s.unstarve() {
                    *got = s.take();
                }
            }
        }
        let got: Vec<bool> = waiters.iter().map(|w| w.2.is_some()).collect();
        assert_eq!(got, vec![true, true], "two buffers free, two connections wanting one: each gets one");
        let st = p.stats();
        assert_eq!(st.waiting, 0, "nobody left queued: {st:?}");
        assert!(st.wakeups <= 2, "one wake-up per buffer at most: {st:?}");
    });
}

/// One window (the device has room for no more); connection A has it lent
/// and gives it back, unbound, while connection B's exposure asks for one:
/// B gets that window, or is woken and its retry gets it.
#[test]
fn an_exposure_that_finds_no_window_is_woken_when_one_comes_back() {
    a_take_racing_a_give_gets_it_or_is_woken(|s| s.take_window(), |s, w| s.give_window(w), |a, b| a == b);
}
