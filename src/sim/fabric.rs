//! The public handle on the simulated fabric: devices, the clock, fault
//! knobs and the oracle.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use super::config::{DeviceConfig, FabricConfig, Faults, Progress};
use super::oracle::{
    Created, DeviceId, Exposure, Hazard, HazardKind, InFlightRead, QpAddr, QpCounters, TraceEntry,
    WindowState,
};
use super::world::{Device, World};
use super::SimNic;
use crate::backend::{MrId, MwId, QpEndpoint, QpState};

/// Most events [`Fabric::run_until_idle`] runs before giving up.
pub const IDLE_EVENT_LIMIT: usize = 1_000_000;

/// An in-process RDMA fabric: devices, a virtual clock and a seeded
/// scheduler. Cheap to clone; clones share the fabric.
#[derive(Clone)]
pub struct Fabric {
    world: Arc<Mutex<World>>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = self.world.lock();
        f.debug_struct("Fabric").field("now_ns", &w.now).field("devices", &w.devs.len()).finish()
    }
}

impl Default for Fabric {
    fn default() -> Fabric {
        Fabric::new(FabricConfig::default())
    }
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Fabric {
    /// A fabric with no devices.
    pub fn new(cfg: FabricConfig) -> Fabric {
        Fabric { world: Arc::new(Mutex::new(World::new(cfg))) }
    }

    /// A default fabric (auto progress) with `seed`.
    pub fn with_seed(seed: u64) -> Fabric {
        Fabric::new(FabricConfig::with_seed(seed))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, World> {
        self.world.lock()
    }

    /// Add a device; the returned handle owns its first protection domain.
    /// More PDs on the same device: [`SimNic::new_pd`].
    pub fn add_device(&self, mut cfg: DeviceConfig) -> SimNic {
        let mut w = self.lock();
        let idx = w.devs.len() as u32;
        if cfg.name.is_empty() {
            cfg.name = format!("sim{idx}");
        }
        let mut d = Device::new(idx, cfg);
        let pd = d.next_pd;
        d.next_pd += 1;
        w.devs.push(d);
        drop(w);
        SimNic::new(self.clone(), idx, pd)
    }

    // ----- clock -----

    /// The virtual time since the fabric was created.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.lock().now)
    }

    /// Who moves the clock.
    pub fn progress(&self) -> Progress {
        self.lock().cfg.progress
    }

    /// Switch between auto and manual progress.
    pub fn set_progress(&self, p: Progress) {
        self.lock().cfg.progress = p;
    }

    /// Run the earliest pending event, moving the clock to it. False if nothing is pending.
    pub fn step(&self) -> bool {
        let mut w = self.lock();
        if w.run_one_due() {
            return true;
        }
        w.advance_to_next() && w.run_one_due()
    }

    /// Run every event due up to virtual time `t`, then set the clock to `t`
    /// (if it is later). Returns how many events ran.
    pub fn run_until(&self, t: Duration) -> usize {
        let t = ns(t);
        let mut w = self.lock();
        let mut n = w.run_due();
        while let Some(at) = w.sched.next_at().filter(|&at| at <= t) {
            w.now = w.now.max(at);
            n += w.run_due();
        }
        w.now = w.now.max(t);
        n
    }

    /// Run for `d` of virtual time from now.
    pub fn run_for(&self, d: Duration) -> usize {
        let t = self.now() + d;
        self.run_until(t)
    }

    /// Run until no event is pending (at most [`IDLE_EVENT_LIMIT`] events).
    /// Returns how many ran.
    pub fn run_until_idle(&self) -> usize {
        let mut w = self.lock();
        let mut n = 0;
        while n < IDLE_EVENT_LIMIT {
            if w.run_one_due() || (w.advance_to_next() && w.run_one_due()) {
                n += 1;
            } else {
                break;
            }
        }
        n
    }

    /// How many events are pending.
    pub fn pending_events(&self) -> usize {
        self.lock().sched.len()
    }

    /// When the next event is due, if any.
    pub fn next_event_at(&self) -> Option<Duration> {
        self.lock().sched.next_at().map(Duration::from_nanos)
    }

    // ----- faults -----

    /// The current transport and fault settings.
    pub fn faults(&self) -> Faults {
        self.lock().cfg.faults
    }

    /// Change the transport and fault settings (extra delay, jitter, retry
    /// counts and timers). Every queue pair's retry budgets restart from the
    /// new counts.
    pub fn set_faults(&self, f: Faults) {
        let mut w = self.lock();
        w.cfg.faults = f;
        for q in w.devs.iter_mut().flat_map(|d| d.qps.iter_mut().flatten()) {
            q.retries_left = f.retry_cnt;
            q.rnr_left = super::world::rnr_budget(&q.cfg, f.rnr_retry);
        }
        w.log(|| format!("faults set: {f:?}"));
    }

    /// Drop every packet between two devices until [`Fabric::restore_link`].
    /// Requesters retry and end in `RETRY_EXC_ERR` if the link stays down.
    pub fn cut_link(&self, a: DeviceId, b: DeviceId) {
        let mut w = self.lock();
        w.set_link(a.0, b.0, |l| l.0 = true);
        w.log(|| format!("link dev{} <-> dev{} cut", a.0, b.0));
    }

    /// Undo [`Fabric::cut_link`].
    pub fn restore_link(&self, a: DeviceId, b: DeviceId) {
        let mut w = self.lock();
        w.set_link(a.0, b.0, |l| l.0 = false);
        w.log(|| format!("link dev{} <-> dev{} restored", a.0, b.0));
    }

    /// Add `extra` to every packet's wire time between two devices.
    pub fn set_link_delay(&self, a: DeviceId, b: DeviceId, extra: Duration) {
        let mut w = self.lock();
        w.set_link(a.0, b.0, |l| l.1 = ns(extra));
    }

    /// The process owning a device dies: its queue pairs vanish without
    /// completions, its regions, windows and CQs are gone, and every call
    /// through its handles fails. Peers see their requests time out
    /// (`RETRY_EXC_ERR`).
    pub fn kill_device(&self, dev: DeviceId) {
        let mut w = self.lock();
        let Some(d) = w.devs.get_mut(dev.0 as usize) else { return };
        d.alive = false;
        d.keys.clear();
        for v in d.mrs.iter_mut() {
            *v = None;
        }
        for v in d.mws.iter_mut() {
            *v = None;
        }
        for v in d.cqs.iter_mut() {
            // A waiting driver must wake up to find its device gone.
            if let Some(waker) = v.take().and_then(|c| c.waker) {
                waker.wake();
            }
        }
        for v in d.qps.iter_mut() {
            *v = None;
        }
        d.by_qpn.clear();
        w.log(|| format!("dev{} died", dev.0));
    }

    /// Force a queue pair to ERR (as `set_qp_error` through its handle).
    /// False if it does not exist.
    pub fn force_qp_error(&self, qp: QpAddr) -> bool {
        let mut w = self.lock();
        let Some(idx) = w.devs.get(qp.device.0 as usize).and_then(|d| d.qp_by_qpn(qp.qpn)) else {
            return false;
        };
        w.enter_error(qp.device.0, idx, None);
        true
    }

    // ----- oracle -----

    /// The fabric address of a connection endpoint (device found by GID).
    pub fn qp_addr(&self, ep: &QpEndpoint) -> Option<QpAddr> {
        let w = self.lock();
        w.dev_by_gid(&ep.gid).map(|d| QpAddr { device: DeviceId(d), qpn: ep.qpn })
    }

    /// Exactly which bytes of which regions of device `owner` the remote
    /// queue pair `remote` can reach right now, and through which rkey.
    /// A connection counts while both sides could still exchange requests
    /// (remote QP in RTS, owner's QP in RTR or RTS, both devices alive); a
    /// cut link does not hide an exposure, since it may come back.
    pub fn exposure(&self, owner: DeviceId, remote: QpAddr) -> Vec<Exposure> {
        self.lock().exposure(owner.0, remote)
    }

    /// Whether `remote` can reach any byte of `mr[range]` on device `owner`.
    pub fn can_reach(&self, remote: QpAddr, owner: DeviceId, mr: MrId, range: Range<usize>) -> bool {
        self.exposure(owner, remote)
            .iter()
            .any(|e| e.mr == mr && e.bytes.start < range.end && range.start < e.bytes.end)
    }

    /// Every READ that has been issued and has not completed, with where it stands.
    pub fn in_flight(&self) -> Vec<InFlightRead> {
        self.lock().in_flight()
    }

    /// Every hazard recorded so far.
    pub fn hazards(&self) -> Vec<Hazard> {
        self.lock().hazards.clone()
    }

    /// The invalidations of unbound or already invalidated windows, which
    /// crash rxe's kernel. A correct protocol keeps this empty.
    pub fn would_crash_rxe(&self) -> Vec<Hazard> {
        self.lock().hazards.iter().filter(|h| h.kind == HazardKind::WouldCrashRxe).cloned().collect()
    }

    /// A queue pair's counters.
    pub fn qp_counters(&self, qp: QpAddr) -> Option<QpCounters> {
        self.lock().qp_counters(qp)
    }

    /// A queue pair's state.
    pub fn qp_state(&self, qp: QpAddr) -> Option<QpState> {
        self.lock().qp_state_of(qp)
    }

    /// A window's state on device `dev`.
    pub fn window(&self, dev: DeviceId, mw: MwId) -> Option<WindowState> {
        self.lock().window_state(dev.0, mw.0)
    }

    /// The virtual address of region `mr` of device `dev` (where remote
    /// addresses into it start), if it is registered.
    pub fn region_addr(&self, dev: DeviceId, mr: MrId) -> Option<u64> {
        let w = self.lock();
        w.devs.get(dev.0 as usize)?.mr(mr.0).map(|m| m.addr)
    }

    /// The memory windows allocated on device `dev` and not deallocated,
    /// with their states.
    pub fn windows(&self, dev: DeviceId) -> Vec<(MwId, WindowState)> {
        let w = self.lock();
        let Some(d) = w.devs.get(dev.0 as usize) else { return Vec::new() };
        (0..d.mws.len() as u32).filter_map(|i| w.window_state(dev.0, i).map(|s| (MwId(i), s))).collect()
    }

    /// How many objects of each kind were ever created on device `dev`.
    pub fn created(&self, dev: DeviceId) -> Created {
        let w = self.lock();
        let Some(d) = w.devs.get(dev.0 as usize) else { return Created::default() };
        let n = |len: usize| len as u32;
        Created {
            pds: d.next_pd,
            cqs: n(d.cqs.len()),
            qps: n(d.qps.len()),
            srqs: n(d.srqs.len()),
            mrs: n(d.mrs.len()),
            mws: n(d.mws.len()),
        }
    }

    /// The recorded trace ([`FabricConfig::record_trace`]).
    pub fn trace(&self) -> Vec<TraceEntry> {
        self.lock().trace.clone()
    }
}
