//! An endpoint's clock: the time since its epoch, which is every `now` its
//! connections, its delegations and its driver see.
//!
//! Read from `CLOCK_MONOTONIC` as nanoseconds (through `rustix` and libc's
//! `clock_gettime`, the vDSO on Linux), not as `Instant::now()` followed by
//! `saturating_duration_since`: the checked `timespec` arithmetic of the
//! latter cost about 100 instructions a read on the call path, and a call
//! reads the clock about 3 times a side. `Instant` reads the same clock,
//! so [`Epoch::instant`] converts a time for timers that take an `Instant`.
//!
//! Every reader of a connection's time must use the same epoch and this
//! read: two epochs taken at different moments would let `now` step back
//! by their gap when a turn's time came from one and the next's from the
//! other.

use std::time::{Duration, Instant};

/// The start of an endpoint's clock (copied into each of its connections).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Epoch {
    /// `CLOCK_MONOTONIC` at the epoch, in ns.
    raw: u64,
    /// The same moment as an `Instant`, read just after `raw`: a time
    /// converted by [`Epoch::instant`] is at most that gap (nanoseconds)
    /// late, never early, so an alarm set for a deadline finds it due.
    at: Instant,
}

impl Epoch {
    /// An epoch of now.
    pub(crate) fn new() -> Epoch {
        let raw = raw_ns();
        Epoch { raw, at: Instant::now() }
    }

    /// The time since the epoch.
    #[inline]
    pub(crate) fn now(&self) -> Duration {
        Duration::from_nanos(raw_ns().saturating_sub(self.raw))
    }

    /// The `Instant` of `t` since the epoch (for timers that take one).
    pub(crate) fn instant(&self, t: Duration) -> Instant {
        self.at + t
    }
}

/// `CLOCK_MONOTONIC` in ns (584 years of range from boot).
#[inline]
fn raw_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(t.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_moves_with_instant_and_never_back() {
        let e = Epoch::new();
        let start = Instant::now();
        let mut last = e.now();
        while start.elapsed() < Duration::from_millis(20) {
            let t = e.now();
            assert!(t >= last, "the clock stepped back from {last:?} to {t:?}");
            last = t;
        }
        // The same clock as Instant's: 20 ms on it are 20 ms on this one
        // (CLOCK_REALTIME, say, would differ by decades; the bound leaves
        // room for a preempted test).
        let (ours, std) = (e.now(), e.at.elapsed());
        let gap = ours.abs_diff(std);
        assert!(gap < Duration::from_secs(1), "epoch time {ours:?} against Instant's {std:?}");
        // A converted time is never early: an alarm set for it finds the
        // epoch time at or past it.
        let before = Instant::now();
        let t = e.now();
        assert!(e.instant(t) >= before, "a converted time is early");
    }
}
