//! Capability telemetry through the [`metrics`] facade: the library
//! records, the application picks the exporter (Prometheus, OpenTelemetry,
//! statsd; `mwcap serve --metrics ADDR` serves the Prometheus text format).
//!
//! [`Endpoint::record_metrics`](crate::conn::Endpoint::record_metrics)
//! records an endpoint's figures; call it on a timer, or just before an
//! exporter renders (as `mwcap serve` does on each scrape). The data path
//! only counts: a connection keeps its counters and its age buckets (a
//! few instructions per exposure, no allocation), and `record_metrics`
//! reads them, so a process that never records pays almost nothing, and a
//! record costs the same whatever the traffic since the last. Counters are
//! monotonic over the endpoint's life: a connection that finished still
//! counts.
//!
//! Every series has the label `endpoint` (the endpoint's
//! [`name`](crate::conn::EndpointBuilder::name)); those of capabilities
//! have `policy` (`mw` or `confirm`: the policy of the direction the
//! capability was made in).
//!
//! | series | kind | what |
//! |---|---|---|
//! | `mwcap_connections` | gauge | connections set up on the endpoint and not yet finished |
//! | `mwcap_capabilities_live{policy,kind="own"\|"delegated"}` | gauge | buffers and ranges this side has exposed, not yet ended on evidence: to its peers directly (`own`), or to delegates that redeemed a delegation (`delegated`, `Endpoint::delegate_region`) |
//! | `mwcap_capabilities_total{policy}` | counter | exposures made |
//! | `mwcap_capability_age_seconds_bucket{policy,le}`, `_count`, `_sum` | counters (`_sum`: a gauge) | a Prometheus histogram of each exposure's age when it ended (released, expired or flushed, on the NIC's evidence) |
//! | `mwcap_expiries_total{policy}` | counter | exposures ended by their expiry (mw: the lease timer; confirm: the hold or request timeout) rather than by the peer |
//! | `mwcap_stale_reads_total` | counter | confirm READs of this side discarded: the owner had reused the buffer |
//! | `mwcap_late_accesses_total` | counter | mw READs of this side the owner's NIC refused (`REM_ACCESS_ERR`: the window was already invalidated) |
//! | `mwcap_binds_total`, `mwcap_invalidations_total` | counter | windows bound, and LOCAL_INVs posted (mw) |
//! | `mwcap_pool_buffers{state="free"\|"lent"}` | gauge | the shared pool's buffers |
//! | `mwcap_pool_windows{state="free"\|"lent"}` | gauge | the shared pool's windows |
//! | `mwcap_pool_waits_total`, `mwcap_pool_waiting` | counter, gauge | takes of a buffer that found its class empty or the connection at its share; tasks waiting now |
//! | `mwcap_regions`, `mwcap_region_bytes` | gauge | regions registered on the endpoint (`Endpoint::register_region`), and their bytes |
//! | `mwcap_delegations_total`, `mwcap_redemptions_total` | counter | delegations made (tokens sealed), and tokens redeemed |
//! | `mwcap_redemptions_refused_total{reason}` | counter | redemptions refused: `forged`, `unknown`, `wrong_identity`, `expired`, `revoked`, `already_redeemed`, `stale`, `unavailable`, `outside_capability`, `not_holder`, `malformed` (`conn::Refusal`; a holder's delegation on or revocation refused counts here too) |
//! | `mwcap_revocations_total`, `mwcap_delegation_tokens_expired_total` | counter | delegations revoked (each, with those made from it), and tokens that expired unredeemed |
//! | `mwcap_delegation_tokens_out` | gauge | tokens made and not yet redeemed, expired or revoked |
//! | `mwcap_region_exposures` | gauge | exposures of ranges of those regions not yet ended on evidence (included in `mwcap_capabilities_live`), and ranges pinned by a delegation not yet over (not included there); a range no write may touch meanwhile |
//!
//! The age histogram is counted into its exported buckets directly (`le`
//! of 10 µs to 60 s, then `+Inf`), so it is exact at those bounds. It is
//! exported as the counters of a Prometheus histogram rather than through
//! the facade's histograms, which take one sample at a time: a record
//! would then cost as much as the exposures since the last one.
//! `histogram_quantile(0.99, rate(mwcap_capability_age_seconds_bucket[5m]))`
//! works as for any Prometheus histogram.

// The loom build leaves out the endpoint that records (its async layer).
#![cfg_attr(loom, allow(dead_code))]

use crate::bootstrap::Policy;
use crate::conn::{BufferPoolStats, Policies, Role};

/// The upper bounds of the age buckets, in nanoseconds (a last bucket,
/// `+Inf`, holds the rest), and the same as Prometheus `le` labels.
const AGE_LE_NS: [u64; 15] = [
    10_000,
    50_000,
    100_000,
    500_000,
    1_000_000,
    5_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
    60_000_000_000,
];
const AGE_LE: [&str; 16] = [
    "0.00001", "0.00005", "0.0001", "0.0005", "0.001", "0.005", "0.01", "0.05", "0.1", "0.5", "1", "5", "10",
    "30", "60", "+Inf",
];

/// Exposure ages, counted into the exported buckets: no allocation and a
/// few instructions per exposure. Cumulative over the connection's life.
#[derive(Clone, Copy, Default)]
pub(crate) struct Ages {
    counts: [u64; 16],
    sum_ns: u64,
}

impl Ages {
    /// Count one age.
    pub(crate) fn record(&mut self, age: std::time::Duration) {
        let ns = u64::try_from(age.as_nanos()).unwrap_or(u64::MAX);
        let i = AGE_LE_NS.partition_point(|&le| le < ns);
        self.counts[i] += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    fn add(&mut self, other: &Ages) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
    }

    /// Each bucket's cumulative count (`le` order), as Prometheus has them.
    fn cumulative(&self) -> [u64; 16] {
        let mut out = self.counts;
        for i in 1..out.len() {
            out[i] += out[i - 1];
        }
        out
    }
}

/// One connection's counters, as [`Tally::add`] takes them.
pub(crate) struct ConnCounts {
    /// The policy of the direction this side exposes in (its own payloads:
    /// requests on a client, replies on a server).
    pub own: Policy,
    pub exposures: u64,
    pub ended: u64,
    pub expiries: u64,
    pub ages: Ages,
    pub stale_reads: u64,
    pub late_accesses: u64,
    pub binds: u64,
    pub invalidations: u64,
}

/// The policy this side exposes in.
pub(crate) fn own_policy(policies: Policies, role: Role) -> Policy {
    match role {
        Role::Client => policies.request,
        Role::Server => policies.reply,
    }
}

/// What one policy's capabilities did, summed over connections.
#[derive(Clone, Copy, Default)]
struct PolicyTally {
    exposures: u64,
    ended: u64,
    expiries: u64,
    ages: Ages,
}

/// An endpoint's figures, summed over its connections (those running and
/// those finished).
#[derive(Clone, Copy, Default)]
pub(crate) struct Tally {
    /// By [`Policy`]: mw, then confirm.
    own: [PolicyTally; 2],
    stale_reads: u64,
    late_accesses: u64,
    binds: u64,
    invalidations: u64,
}

impl Tally {
    /// Add a connection's counters.
    pub(crate) fn add(&mut self, c: &ConnCounts) {
        let t = &mut self.own[match c.own {
            Policy::Mw => 0,
            Policy::Confirm => 1,
        }];
        t.exposures += c.exposures;
        t.ended += c.ended;
        t.expiries += c.expiries;
        t.ages.add(&c.ages);
        self.stale_reads += c.stale_reads;
        self.late_accesses += c.late_accesses;
        self.binds += c.binds;
        self.invalidations += c.invalidations;
    }

    /// Record it through the facade: counters as their totals, gauges as
    /// they are now.
    /// `delegated`: of the live exposures, those made by redeeming a
    /// delegation (mw, confirm), recorded as `kind="delegated"`.
    pub(crate) fn record(
        &self,
        endpoint: &str,
        connections: usize,
        pool: Option<&BufferPoolStats>,
        delegated: [u64; 2],
    ) {
        let ep = endpoint.to_owned();
        metrics::gauge!("mwcap_connections", "endpoint" => ep.clone()).set(connections as f64);
        for ((t, policy), delegated) in self.own.iter().zip(["mw", "confirm"]).zip(delegated) {
            let l = [("endpoint", ep.clone()), ("policy", policy.to_owned())];
            metrics::counter!("mwcap_capabilities_total", &l).absolute(t.exposures);
            metrics::counter!("mwcap_expiries_total", &l).absolute(t.expiries);
            let kind =
                |k: &str| [("endpoint", ep.clone()), ("policy", policy.to_owned()), ("kind", k.to_owned())];
            let live = t.exposures.saturating_sub(t.ended);
            // A delegation's exposure ends in the connection's counts
            // before the book hears of it: never below zero.
            metrics::gauge!("mwcap_capabilities_live", &kind("own"))
                .set(live.saturating_sub(delegated) as f64);
            metrics::gauge!("mwcap_capabilities_live", &kind("delegated")).set(delegated.min(live) as f64);
            let cumulative = t.ages.cumulative();
            for (le, n) in AGE_LE.iter().zip(cumulative) {
                let b = [("endpoint", ep.clone()), ("policy", policy.to_owned()), ("le", (*le).to_owned())];
                metrics::counter!("mwcap_capability_age_seconds_bucket", &b).absolute(n);
            }
            metrics::counter!("mwcap_capability_age_seconds_count", &l).absolute(cumulative[15]);
            metrics::gauge!("mwcap_capability_age_seconds_sum", &l).set(t.ages.sum_ns as f64 * 1e-9);
        }
        let l = [("endpoint", ep.clone())];
        metrics::counter!("mwcap_stale_reads_total", &l).absolute(self.stale_reads);
        metrics::counter!("mwcap_late_accesses_total", &l).absolute(self.late_accesses);
        metrics::counter!("mwcap_binds_total", &l).absolute(self.binds);
        metrics::counter!("mwcap_invalidations_total", &l).absolute(self.invalidations);
        if let Some(p) = pool {
            let state = |s: &str| [("endpoint", ep.clone()), ("state", s.to_owned())];
            metrics::gauge!("mwcap_pool_buffers", &state("free")).set(f64::from(p.free));
            metrics::gauge!("mwcap_pool_buffers", &state("lent"))
                .set(f64::from(p.buffers.saturating_sub(p.free)));
            metrics::gauge!("mwcap_pool_windows", &state("free")).set(f64::from(p.windows_free));
            metrics::gauge!("mwcap_pool_windows", &state("lent"))
                .set(f64::from(p.windows.saturating_sub(p.windows_free)));
            metrics::counter!("mwcap_pool_waits_total", &l).absolute(p.empty);
            metrics::gauge!("mwcap_pool_waiting", &l).set(f64::from(p.waiting));
        }
    }
}

/// Record an endpoint's delegation series (see the table above).
#[cfg(not(loom))]
pub(crate) fn record_delegations(endpoint: &str, f: &crate::conn::DelegationFigures) {
    let l = [("endpoint", endpoint.to_owned())];
    let s = &f.stats;
    metrics::counter!("mwcap_delegations_total", &l).absolute(s.delegated);
    metrics::counter!("mwcap_redemptions_total", &l).absolute(s.redeemed);
    metrics::counter!("mwcap_revocations_total", &l).absolute(s.revoked);
    metrics::counter!("mwcap_delegation_tokens_expired_total", &l).absolute(s.tokens_expired);
    metrics::gauge!("mwcap_delegation_tokens_out", &l).set(f.tokens_out as f64);
    for (refusal, n) in crate::conn::Refusal::ALL.into_iter().zip(f.refused) {
        let r = [("endpoint", endpoint.to_owned()), ("reason", refusal.label().to_owned())];
        metrics::counter!("mwcap_redemptions_refused_total", &r).absolute(n);
    }
}

/// Record an endpoint's region gauges (see the table above).
#[cfg(not(loom))]
pub(crate) fn record_regions(endpoint: &str, f: crate::conn::RegionFigures) {
    let l = [("endpoint", endpoint.to_owned())];
    metrics::gauge!("mwcap_regions", &l).set(f.regions as f64);
    metrics::gauge!("mwcap_region_bytes", &l).set(f.bytes as f64);
    metrics::gauge!("mwcap_region_exposures", &l).set(f.exposed as f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_age_is_counted_in_the_first_bucket_whose_bound_is_not_below_it() {
        let mut a = Ages::default();
        for d in [
            Duration::from_nanos(1),
            Duration::from_micros(10),
            Duration::from_micros(11),
            Duration::from_millis(1),
            Duration::from_secs(60),
            Duration::from_secs(61),
            Duration::MAX,
        ] {
            a.record(d);
        }
        // le=10us: 1 ns and 10 us; le=50us: 11 us; le=1ms: 1 ms; le=60: 60 s;
        // +Inf: 61 s and the longest.
        assert_eq!(a.counts[0], 2);
        assert_eq!(a.counts[1], 1);
        assert_eq!(a.counts[4], 1);
        assert_eq!(a.counts[14], 1);
        assert_eq!(a.counts[15], 2);
        let c = a.cumulative();
        assert_eq!(c[15], 7, "the +Inf bucket counts every age");
        assert!(c.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(a.sum_ns, u64::MAX, "the sum saturates");
    }

    #[test]
    fn the_le_labels_name_the_bounds() {
        for (le, ns) in AGE_LE.iter().zip(AGE_LE_NS) {
            let secs: f64 = le.parse().unwrap();
            assert_eq!((secs * 1e9).round() as u64, ns, "{le}");
        }
        assert_eq!(AGE_LE[15], "+Inf");
    }
}
