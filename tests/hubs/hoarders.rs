//! Careless clients, driven by hand: each keeps `DEPTH` calls in flight
//! (within its credit) and never reads a reply, because it holds both of
//! its own buffers, so no READ of its has a destination. Each reply its
//! server connection exposes keeps a buffer of the server's pool for a
//! whole lease. Shared by `tests/hub_pool.rs` and
//! `examples/pool_fairness.rs` (which includes this file by path).

use std::time::Duration;

use mwcap::conn::{Buf, Event, Link};
use mwcap::sim::SimNic;

/// Calls each hoarder keeps in flight.
pub const DEPTH: usize = 6;

/// The hoarders, and how many calls they made.
#[derive(Default)]
pub struct Hoarders {
    links: Vec<(Link<SimNic>, [Buf; 2], usize)>,
    /// Calls made by all of them so far.
    pub calls: u64,
}

impl Hoarders {
    /// Add a connected client; it takes both of its buffers and keeps them.
    pub fn add(&mut self, mut link: Link<SimNic>) {
        let held = [link.alloc().expect("a free buffer"), link.alloc().expect("a free buffer")];
        self.links.push((link, held, 0));
    }

    /// One turn of each at `now` (wall time since the start, as the
    /// endpoints' clocks): run its timers, count its calls that ended
    /// (answered or failed), and call again up to `DEPTH` in flight.
    pub fn turn(&mut self, now: Duration) {
        for (h, _, in_flight) in &mut self.links {
            if h.poll_timeout().is_some_and(|t| t <= now) {
                h.handle_timeout(now);
            }
            h.drive(now);
            while let Some(ev) = h.poll_event() {
                if matches!(ev, Event::Reply { .. } | Event::CallFailed { .. }) {
                    *in_flight -= 1;
                }
            }
            while *in_flight < DEPTH && h.call(now, b"x", None).is_ok() {
                *in_flight += 1;
                self.calls += 1;
            }
            h.drive(now);
        }
    }
}
