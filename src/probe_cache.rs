//! The capability probe, run once per device and remembered.
//!
//! [`probe()`](crate::probe()) creates and tears down a loopback queue pair
//! with its regions and windows; on rxe that takes about 100 ms, so a
//! server that probed on every accept took about 10 clients a second. A
//! device's verdict does not change while the process runs (unless its
//! driver or firmware is swapped under it), so a [`ProbeCache`] runs the
//! probe the first time a device is asked about and hands out the same
//! [`ProbeReport`] afterwards.
//!
//! The cache is a value, not a process-wide table: an [`Endpoint`] keeps
//! one (or one it was given, [`EndpointBuilder::probe_cache`]) for its
//! listener and every connect (in its [`SetupOptions`]). Clones share
//! the table, so one cache can serve every
//! endpoint of a process. Devices are told apart by their name
//! ([`DeviceInfo::name`](crate::backend::DeviceInfo::name)): the name
//! identifies a device within one host. Simulated devices share names
//! across fabrics (`sim0` on each), so tests that build several fabrics
//! give each its own cache.
//!
//! [`Endpoint`]: crate::conn::Endpoint
//! [`EndpointBuilder::probe_cache`]: crate::conn::EndpointBuilder::probe_cache
//! [`SetupOptions`]: crate::conn::SetupOptions

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

// Not shared with a driver, so not loom-modelled: parking_lot's mutex directly.
use parking_lot::Mutex;

use crate::backend::Nic;
use crate::ProbeReport;

/// One device's verdict, filled by the first asker; later askers for the
/// same device wait on its lock instead of probing again.
type Slot = Arc<Mutex<Option<Arc<ProbeReport>>>>;

/// Probe verdicts by device name; cheap to clone (clones share the table).
#[derive(Clone, Default)]
pub struct ProbeCache {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    devices: Mutex<HashMap<String, Slot>>,
    runs: AtomicU64,
}

impl ProbeCache {
    /// An empty cache.
    pub fn new() -> ProbeCache {
        ProbeCache::default()
    }

    /// The probe's report for `nic`'s device: the remembered one, or a
    /// fresh probe the first time this device is asked about. Concurrent
    /// first askers for one device run one probe between them.
    pub fn report(&self, nic: &dyn Nic) -> Arc<ProbeReport> {
        let slot = self.slot(&nic.device_info().name);
        let mut verdict = slot.lock();
        if let Some(r) = &*verdict {
            return r.clone();
        }
        let r = Arc::new(self.run(nic));
        *verdict = Some(r.clone());
        r
    }

    /// Probe `nic`'s device again and remember the new report (after a
    /// driver or firmware change, say).
    pub fn reprobe(&self, nic: &dyn Nic) -> Arc<ProbeReport> {
        let slot = self.slot(&nic.device_info().name);
        let mut verdict = slot.lock();
        let r = Arc::new(self.run(nic));
        *verdict = Some(r.clone());
        r
    }

    /// The remembered report for the device named `device`, without probing.
    pub fn cached(&self, device: &str) -> Option<Arc<ProbeReport>> {
        let slot = self.inner.devices.lock().get(device).cloned()?;
        let verdict = slot.lock();
        verdict.clone()
    }

    /// Forget the device named `device`: the next asker probes it again.
    pub fn forget(&self, device: &str) {
        self.inner.devices.lock().remove(device);
    }

    /// How many probes this cache (and its clones) ran so far.
    pub fn probes_run(&self) -> u64 {
        self.inner.runs.load(Ordering::Relaxed)
    }

    fn slot(&self, device: &str) -> Slot {
        self.inner.devices.lock().entry(device.to_string()).or_default().clone()
    }

    fn run(&self, nic: &dyn Nic) -> ProbeReport {
        self.inner.runs.fetch_add(1, Ordering::Relaxed);
        let r = crate::probe(nic);
        tracing::debug!(device = %r.device.name, mw_usable = r.mw_usable, "capability probe ran");
        r
    }
}

impl fmt::Debug for ProbeCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let devices: Vec<String> = self.inner.devices.lock().keys().cloned().collect();
        f.debug_struct("ProbeCache")
            .field("devices", &devices)
            .field("probes_run", &self.probes_run())
            .finish()
    }
}
