//! Capability telemetry through the [`metrics`] facade: the library
//! records, the application picks the exporter (Prometheus, OpenTelemetry,
//! statsd; `mwcap serve --metrics ADDR` serves the Prometheus text format).
//!
//! [`Endpoint::record_metrics`](crate::conn::Endpoint::record_metrics)
//! records an endpoint's figures; call it on a timer, or just before an
//! exporter renders (as `mwcap serve` does on each scrape). Nothing is
//! recorded on the data path: a connection keeps the counts it keeps
//! anyway, and one age histogram (an array of counts, no allocation), and
//! `record_metrics` reads them, so a process that never records pays
//! nothing. Counters are monotonic over the endpoint's life: a connection
//! that finished still counts.
//!
//! Every series has the label `endpoint` (the endpoint's
//! [`name`](crate::conn::EndpointBuilder::name)); those of capabilities
//! have `policy` (`mw` or `confirm`: the policy of the direction the
//! capability was made in).
//!
//! | series | kind | what |
//! |---|---|---|
//! | `mwcap_connections` | gauge | connections on the endpoint |
//! | `mwcap_capabilities_live{policy,kind="own"}` | gauge | buffers and ranges this side has exposed, not yet ended on evidence |
//! | `mwcap_capabilities_total{policy}` | counter | exposures made |
//! | `mwcap_capability_age_seconds{policy}` | histogram | an exposure's age when it ended (released, expired or flushed, on the NIC's evidence) |
//! | `mwcap_expiries_total{policy}` | counter | exposures ended by their expiry (mw: the lease timer; confirm: the hold) rather than by the peer |
//! | `mwcap_stale_reads_total` | counter | confirm READs discarded: the owner had reused the buffer |
//! | `mwcap_late_accesses_total` | counter | mw READs that failed (the window was invalidated or never valid) |
//! | `mwcap_binds_total`, `mwcap_invalidations_total` | counter | windows bound, and LOCAL_INVs posted (mw) |
//! | `mwcap_pool_buffers{state="free"\|"lent"}` | gauge | the shared pool's buffers |
//! | `mwcap_pool_windows{state="free"\|"lent"}` | gauge | the shared pool's windows |
//! | `mwcap_pool_waits_total`, `mwcap_pool_waiting` | counter, gauge | takes that found the pool empty; tasks waiting now |
//!
//! The age histogram is kept with four buckets per doubling (from 1 µs to
//! about an hour); each bucket is recorded at its midpoint, so an age is
//! off by at most 12.5 %.

// The loom build leaves out the endpoint that records (its async layer).
#![cfg_attr(loom, allow(dead_code))]

use std::time::Duration;

use crate::bootstrap::Policy;
use crate::conn::{BufferPoolStats, ConnStats, Policies, Role};

/// Buckets of [`Ages`]: one below 1,024 ns, then four per doubling up to 2^43 ns.
const AGE_BUCKETS: usize = 1 + 4 * 33;

/// A histogram of exposure ages, four buckets per doubling: no allocation
/// and a few instructions to record, so it lives on the data path.
#[derive(Clone)]
pub(crate) struct Ages {
    counts: [u32; AGE_BUCKETS],
    any: bool,
}

impl Default for Ages {
    fn default() -> Ages {
        Ages { counts: [0; AGE_BUCKETS], any: false }
    }
}

impl Ages {
    fn bucket(age: Duration) -> usize {
        let ns = u64::try_from(age.as_nanos()).unwrap_or(u64::MAX);
        if ns < 1024 {
            return 0;
        }
        let e = 63 - ns.leading_zeros() as usize; // >= 10
        let sub = ((ns >> (e - 2)) & 3) as usize;
        (1 + (e - 10) * 4 + sub).min(AGE_BUCKETS - 1)
    }

    /// The midpoint of bucket `i`, in seconds.
    fn midpoint(i: usize) -> f64 {
        if i == 0 {
            return 512e-9;
        }
        let e = (i - 1) / 4 + 10;
        let sub = ((i - 1) % 4) as f64;
        (1u64 << e) as f64 * (1.0 + (sub + 0.5) / 4.0) * 1e-9
    }

    /// Count one age.
    pub(crate) fn record(&mut self, age: Duration) {
        let c = &mut self.counts[Ages::bucket(age)];
        *c = c.saturating_add(1);
        self.any = true;
    }

    /// Move every count of `self` into `into`.
    pub(crate) fn drain_into(&mut self, into: &mut Ages) {
        if !self.any {
            return;
        }
        for (a, b) in into.counts.iter_mut().zip(self.counts.iter_mut()) {
            *a = a.saturating_add(std::mem::take(b));
        }
        into.any = true;
        self.any = false;
    }

    /// Each bucket's midpoint (seconds) and count, for the non-empty ones.
    fn each(&self, mut f: impl FnMut(f64, u32)) {
        for (i, &n) in self.counts.iter().enumerate().filter(|(_, &n)| n > 0) {
            f(Ages::midpoint(i), n);
        }
    }

    fn clear(&mut self) {
        self.counts = [0; AGE_BUCKETS];
        self.any = false;
    }
}

/// What one policy's capabilities did, summed over connections.
#[derive(Clone, Copy, Default)]
struct PolicyTally {
    exposures: u64,
    ended: u64,
    expiries: u64,
}

/// An endpoint's figures, summed over its connections (those running and
/// those finished).
#[derive(Clone, Default)]
pub(crate) struct Tally {
    /// By [`Policy`]: mw, then confirm.
    own: [PolicyTally; 2],
    ages: [Ages; 2],
    stale_reads: u64,
    late_accesses: u64,
    binds: u64,
    invalidations: u64,
}

fn index(p: Policy) -> usize {
    match p {
        Policy::Mw => 0,
        Policy::Confirm => 1,
    }
}

impl Tally {
    /// Add a connection's counters, and move its ages here.
    pub(crate) fn add(&mut self, stats: &ConnStats, policies: Policies, role: Role, ages: &mut Ages) {
        // Our side exposes request payloads on a client, reply payloads on
        // a server.
        let own = index(match role {
            Role::Client => policies.request,
            Role::Server => policies.reply,
        });
        let t = &mut self.own[own];
        t.exposures += stats.exposures;
        t.ended += stats.exposures_ended;
        t.expiries += stats.expiries;
        ages.drain_into(&mut self.ages[own]);
        self.stale_reads += stats.stale_reads;
        if let Some(o) = &stats.lease_owner {
            self.binds += o.grants;
            self.invalidations += o.invalidations;
        }
        if let Some(r) = &stats.lease_reader {
            self.late_accesses += r.reads_failed;
        }
    }

    /// Add another tally's counters, and move its ages here.
    pub(crate) fn merge(&mut self, other: &mut Tally) {
        for i in 0..2 {
            let (a, b) = (&mut self.own[i], other.own[i]);
            a.exposures += b.exposures;
            a.ended += b.ended;
            a.expiries += b.expiries;
            other.ages[i].drain_into(&mut self.ages[i]);
        }
        self.stale_reads += other.stale_reads;
        self.late_accesses += other.late_accesses;
        self.binds += other.binds;
        self.invalidations += other.invalidations;
    }

    /// Record it through the facade: counters as their totals, gauges as
    /// they are now, and the ages counted since the last record.
    pub(crate) fn record(&mut self, endpoint: &str, connections: usize, pool: Option<&BufferPoolStats>) {
        let ep = endpoint.to_owned();
        metrics::gauge!("mwcap_connections", "endpoint" => ep.clone()).set(connections as f64);
        for (i, policy) in ["mw", "confirm"].into_iter().enumerate() {
            let t = self.own[i];
            let l = [("endpoint", ep.clone()), ("policy", policy.to_owned())];
            metrics::counter!("mwcap_capabilities_total", &l).absolute(t.exposures);
            metrics::counter!("mwcap_expiries_total", &l).absolute(t.expiries);
            let live = [("endpoint", ep.clone()), ("policy", policy.to_owned()), ("kind", "own".to_owned())];
            metrics::gauge!("mwcap_capabilities_live", &live).set(t.exposures.saturating_sub(t.ended) as f64);
            let h = metrics::histogram!("mwcap_capability_age_seconds", &l);
            self.ages[i].each(|secs, n| h.record_many(secs, n as usize));
            self.ages[i].clear();
        }
        let l = [("endpoint", ep.clone())];
        metrics::counter!("mwcap_stale_reads_total", &l).absolute(self.stale_reads);
        metrics::counter!("mwcap_late_accesses_total", &l).absolute(self.late_accesses);
        metrics::counter!("mwcap_binds_total", &l).absolute(self.binds);
        metrics::counter!("mwcap_invalidations_total", &l).absolute(self.invalidations);
        if let Some(p) = pool {
            let state = |s: &str| [("endpoint", ep.clone()), ("state", s.to_owned())];
            metrics::gauge!("mwcap_pool_buffers", &state("free")).set(f64::from(p.free));
            metrics::gauge!("mwcap_pool_buffers", &state("lent")).set(f64::from(p.buffers - p.free));
            metrics::gauge!("mwcap_pool_windows", &state("free")).set(f64::from(p.windows_free));
            metrics::gauge!("mwcap_pool_windows", &state("lent")).set(f64::from(p.windows - p.windows_free));
            metrics::counter!("mwcap_pool_waits_total", &l).absolute(p.empty);
            metrics::gauge!("mwcap_pool_waiting", &l).set(f64::from(p.waiting));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_age_lands_in_a_bucket_whose_midpoint_is_within_an_eighth_of_it() {
        for ns in [1_100u64, 1_500, 2_047, 2_048, 3_000, 10_000, 123_456, 1_000_000, 7_777_777_777] {
            let i = Ages::bucket(Duration::from_nanos(ns));
            let mid = Ages::midpoint(i) * 1e9;
            let err = (mid - ns as f64).abs() / ns as f64;
            assert!(err <= 0.125 + 1e-9, "{ns} ns: bucket {i}, midpoint {mid}, off by {err}");
        }
        assert_eq!(Ages::bucket(Duration::from_nanos(10)), 0);
        assert_eq!(Ages::bucket(Duration::from_secs(1 << 20)), AGE_BUCKETS - 1);
    }

    #[test]
    fn draining_moves_the_counts_once() {
        let mut a = Ages::default();
        a.record(Duration::from_micros(5));
        a.record(Duration::from_micros(5));
        a.record(Duration::from_millis(3));
        let mut b = Ages::default();
        a.drain_into(&mut b);
        a.drain_into(&mut b);
        let mut seen = Vec::new();
        b.each(|s, n| seen.push((s, n)));
        assert_eq!(seen.len(), 2);
        assert_eq!(seen.iter().map(|s| s.1).sum::<u32>(), 3);
        let mut none = 0;
        a.each(|_, _| none += 1);
        assert_eq!(none, 0);
    }
}
