//! Making a [`Link`]: the queue sizes a connection's settings need, the QP
//! on a given CQ ([`Link::prepare_on`]; in tests `Link::new`, which
//! creates the CQ too), then the regions, windows and connection once the
//! policies are known ([`Prepared::finish`]).

use super::*;
use crate::backend::MwInfo;

/// The queue depths a connection's settings need, worked out once (after
/// [`Config::check`]) for the QP and for the completion queue it uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueueSizes {
    /// Send queue: control SENDs, per buffer a bind, an invalidate and the
    /// READs of a payload (one per `read_chunk`).
    pub(crate) send_wrs: u32,
    /// Completion queue entries the connection may need at once: every
    /// work request may come back, as a flush if nothing else.
    pub(crate) cq_entries: u32,
}

impl QueueSizes {
    /// Check `cfg` and size its queues.
    pub(crate) fn of(cfg: &Config) -> Result<QueueSizes, ConfigError> {
        cfg.check()?;
        let layout = Layout::new(cfg);
        let chunk = u64::from(cfg.read_chunk);
        let reads: u64 = (0..layout.slots()).map(|s| u64::from(layout.size(s)).div_ceil(chunk)).sum();
        let exposable = u64::from(layout.slots()) + u64::from(cfg.region_exposures);
        let wanted = u64::from(cfg.sends()) + 2 * exposable + reads + 8;
        let too_many = || ConfigError::TooManyWorkRequests { send_wrs: wanted, receives: cfg.ctrl_slots };
        let send_wrs = u32::try_from(wanted).map_err(|_| too_many())?;
        let cq_entries = send_wrs.checked_add(cfg.ctrl_slots).ok_or_else(too_many)?;
        Ok(QueueSizes { send_wrs, cq_entries })
    }

    /// The entries a connection reserves of a shared completion queue: all
    /// of `cq_entries`, or on a shared receive queue only its send side
    /// (the hub reserves the receives' once for the whole SRQ:
    /// `docs/serving.md`, "Completion queue depth").
    pub(crate) fn reserved(&self, shared_receives: bool) -> u32 {
        if shared_receives {
            self.send_wrs
        } else {
            self.cq_entries
        }
    }
}

/// Whether every buffer class of `cfg` that has buffers is a class of `pool`.
fn check_pool_classes(cfg: &Config, pool: &BufferPool) -> Result<(), ConfigError> {
    let layout = Layout::new(cfg);
    for (size, count) in layout.sizes().into_iter().zip(layout.counts()) {
        if count > 0 && pool.class_of_size(size).is_none() {
            return Err(ConfigError::NotAPoolClass { size, classes: pool.sizes().to_vec() });
        }
    }
    Ok(())
}

impl<N: Nic> Link<N> {
    /// Create the endpoint's resources on `nic` (which should be a protection
    /// domain of its own: see the confirm policy's security note). Returns
    /// it with its QP in INIT; give [`Link::local`] to the peer and call
    /// [`Link::connect`] with the peer's.
    #[cfg(any(test, feature = "testing"))]
    pub fn new(nic: N, role: Role, policies: Policies, cfg: Config) -> Result<Link<N>, SetupError> {
        let sizes = QueueSizes::of(&cfg)?;
        let cq = nic.create_cq(sizes.cq_entries)?;
        match Link::prepare_on(nic, role, cfg, sizes, cq, None, None, None) {
            // (A failed finish drops the `Prepared`: its QP and CQ go.)
            Ok(p) => p.finish(policies),
            Err((nic, e)) => {
                let _ = nic.destroy_cq(cq);
                Err(e)
            }
        }
    }

    /// The QP of a connection with `cfg`, a QP sized by `sizes` (from the
    /// same `cfg`) on the completion queue `cq`, which the endpoint does not own
    /// when `shared` is given, taking its receives from `srq` when given
    /// (`nic` then in the SRQ's PD), whose initial share it takes. On
    /// failure the NIC comes back with the error.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prepare_on(
        nic: N,
        role: Role,
        cfg: Config,
        sizes: QueueSizes,
        cq: CqId,
        shared: Option<std::sync::Arc<dyn SharedCq>>,
        srq: Option<std::sync::Arc<SharedReceives<N>>>,
        pool: Option<BufferPool>,
    ) -> Result<Prepared<N>, (N, SetupError)> {
        if let Some(p) = &pool {
            if let Err(e) = check_pool_classes(&cfg, p) {
                return Err((nic, e.into()));
            }
        }
        let mut qcfg = QpConfig::new(cq, cq);
        qcfg.max_send_wr = sizes.send_wrs;
        qcfg.max_recv_wr = cfg.ctrl_slots;
        qcfg.rnr_retry = cfg.rnr_retry.min(6);
        qcfg.ack_timeout = cfg.ack_timeout;
        if let Some(s) = &srq {
            if let Err(e) = s.admit(cfg.start_credits) {
                return Err((nic, e));
            }
            qcfg.srq = Some(s.id());
            qcfg.max_recv_wr = 0;
        }
        match nic.create_qp(qcfg) {
            Ok(local) => Ok(Prepared { nic: Some(nic), role, cfg, cq, local, shared, srq, pool }),
            Err(e) => {
                if let Some(s) = &srq {
                    s.release(cfg.start_credits);
                }
                Err((nic, e.into()))
            }
        }
    }
}

/// An endpoint whose QP exists but whose policies are not chosen yet; see
/// `Link::prepare_on`. Dropping it
/// destroys the QP, and the CQ unless it is the endpoint's (shared).
pub struct Prepared<N: Nic> {
    nic: Option<N>,
    role: Role,
    cfg: Config,
    cq: CqId,
    local: QpEndpoint,
    shared: Option<std::sync::Arc<dyn SharedCq>>,
    srq: Option<std::sync::Arc<SharedReceives<N>>>,
    /// The hub's shared buffer pool, if it has one.
    pool: Option<BufferPool>,
}

impl<N: Nic> Prepared<N> {
    /// What the peer needs to connect to this endpoint.
    pub fn local(&self) -> QpEndpoint {
        self.local
    }

    /// The lease time the bootstrap agreed on, for `finish` (the one
    /// setting that changes after `prepare`; the pool's classes were
    /// checked against the others there).
    pub(crate) fn set_lease_time(&mut self, lease: Duration) {
        self.cfg.lease_time = lease;
    }

    /// Create the rest for `policies`: regions, windows, the connection.
    pub fn finish(mut self, policies: Policies) -> Result<Link<N>, SetupError> {
        let cfg = self.cfg.clone();
        let role = self.role;
        cfg.check_lease(role, policies)?;
        let (owns, _) = policies.directions(role);
        let access =
            Access::LOCAL_WRITE | if owns == Policy::Mw { Access::MW_BIND } else { Access::REMOTE_READ };
        // The NIC stays in `self` until success, so that an error drops the
        // QP and the CQ; `Resources` cleans up what was made so far.
        let nic = self.nic.as_ref().expect("finish runs once");
        let mut made = Made { nic, mrs: Vec::new(), windows: Vec::new() };
        let confirm = policies.request != Policy::Mw || policies.reply != Policy::Mw;
        if confirm && self.srq.as_ref().is_some_and(|q| !q.serves_confirm()) {
            let Policies { request, reply } = policies;
            return Err(ConfigError::SharedReceivesNeedMw { request, reply }.into());
        }
        // Send slots, then receive slots; on shared receives neither: the
        // hub's queue receives, and the hub lends send slots per frame.
        let ctrl = match self.srq {
            Some(_) => None,
            None => Some(made.reg(MAX_FRAME * (cfg.sends() + cfg.ctrl_slots) as usize, Access::LOCAL_WRITE)?),
        };
        let lent = LentSends::new(if self.srq.is_some() { cfg.sends() } else { 0 });
        let layout = Layout::new(&cfg);
        let data = match &self.pool {
            None => Some(made.reg(layout.bytes() as usize, access)?),
            Some(_) => None,
        };
        // On a shared pool the windows are the pool's, lent per exposure.
        if owns == Policy::Mw && self.pool.is_none() {
            for _ in 0..layout.slots() + cfg.region_exposures {
                made.windows.push(nic.alloc_mw()?);
            }
        }
        // Looked up before `keep`: a failure still releases what was made.
        let data_region = data.map(|d| Registered::of(nic, d)).transpose()?;
        let ctrl = ctrl.map(|c| Registered::of(nic, c)).transpose()?;
        let windows = made.keep();
        let window_ids: Vec<MwId> = windows.iter().map(|w| w.id).collect();
        let span = tracing::debug_span!(
            "mwcap.conn",
            id = tracing::field::Empty,
            qpn = self.local.qpn,
            role = ?role,
            request = ?policies.request,
            reply = ?policies.reply,
        );
        let memory = match (data_region, self.pool.take()) {
            (Some(d), _) => DataMemory::Region(d.info, d.mem),
            (None, pool) => DataMemory::Pool(pool.expect("no data region only with a pool")),
        };
        let conn = Connection::new(
            role,
            policies,
            cfg,
            // On shared receives the SEND of each frame is pointed at the
            // hub's slot lent for it (`LentSends`).
            Resources {
                ctrl: ctrl.as_ref().map_or(MrId::from_raw(u32::MAX), |c| c.info.id),
                data: memory,
                windows,
            },
        );
        span.record("id", conn.id());
        let nic = self.nic.take().expect("finish runs once");
        Ok(Link {
            nic,
            conn,
            cq: self.cq,
            local: self.local,
            ctrl,
            lent,
            data,
            access,
            windows: window_ids,
            shared: self.shared.take(),
            srq: self.srq.take(),
            share_released: false,
            #[cfg(any(test, feature = "testing"))]
            batch: vec![Completion::EMPTY; POLL_BATCH],
            qp: QpFate::Live,
            regions: std::sync::Arc::new(super::Regions::new(None, crate::conn::clock::Epoch::new())),
            span,
            delegation: Default::default(),
        })
    }
}

/// Regions and windows made by `finish`, released if it fails half-way.
struct Made<'a, N: Nic> {
    nic: &'a N,
    mrs: Vec<MrInfo>,
    windows: Vec<MwInfo>,
}

impl<N: Nic> Made<'_, N> {
    fn reg(&mut self, len: usize, access: Access) -> Result<MrInfo, NicError> {
        let mr = self.nic.reg_mr(len, access)?;
        self.mrs.push(mr);
        Ok(mr)
    }
    /// Success: keep everything; returns the windows.
    fn keep(mut self) -> Vec<MwInfo> {
        self.mrs.clear();
        std::mem::take(&mut self.windows)
    }
}

impl<N: Nic> Drop for Made<'_, N> {
    fn drop(&mut self) {
        for w in self.windows.drain(..) {
            let _ = self.nic.dealloc_mw(w.id);
        }
        for mr in self.mrs.drain(..) {
            let _ = self.nic.dereg_mr(mr.id);
        }
    }
}

impl<N: Nic> Drop for Prepared<N> {
    fn drop(&mut self) {
        if let Some(nic) = self.nic.take() {
            let _ = destroy_qp(&nic, self.shared.as_ref(), &self.local);
            if let Some(s) = &self.srq {
                s.release(self.cfg.start_credits);
            }
            if self.shared.is_none() {
                let _ = nic.destroy_cq(self.cq);
            }
        }
    }
}
