//! The capability probe: does this device really do type-2 memory windows?
//!
//! Device flags lie (bnxt_re advertises type 2B and has no `alloc_mw`; mana
//! allocates but cannot bind), so the probe *tries* every operation the mw
//! policy needs on a throw-away loopback QP pair and reports the first step
//! that fails, with its error or completion status.
//!
//! It never invalidates a window that is not bound, and never invalidates a
//! window twice: on rxe either mistake panics the kernel.

use std::fmt;
use std::time::Duration;

use crate::backend::loopback::{wait_completions, LoopbackPair};
use crate::backend::{
    rkey, Access, Completion, DeviceInfo, MrInfo, MwId, Nic, NicError, SendWr, Sge, SgeList, WcOpcode,
    WcStatus,
};

/// How long the probe waits for one step's completions.
const STEP_TIMEOUT: Duration = Duration::from_secs(2);
/// Size of the probe's memory region; the window covers the middle half.
const MR_LEN: usize = 8192;
const WIN_OFF: usize = 2048;
const WIN_LEN: usize = 4096;
const MSG_LEN: u32 = 64;

/// One step of the probe, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProbeStep {
    /// Allocate a type-2 window.
    Alloc,
    /// Bind it, chained with a SEND, on a loopback QP.
    Bind,
    /// READ inside the window from the peer QP.
    ReadInside,
    /// READ outside the window but inside the region (must fail per spec).
    ReadOutside,
    /// LOCAL_INV the window.
    Invalidate,
    /// READ through the invalidated rkey (must fail).
    ReadAfterInvalidate,
    /// SEND_WITH_INV from the peer invalidates the window.
    SendWithInv,
    /// A SEND_WITH_INV naming the window, received on another queue pair
    /// of the same protection domain (must fail per spec for a type-2B
    /// window; rxe invalidates it).
    SendWithInvOtherQp,
    /// The same, received on a queue pair of another protection domain.
    SendWithInvOtherPd,
}

impl fmt::Display for ProbeStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProbeStep::Alloc => "alloc type-2 window",
            ProbeStep::Bind => "bind chained with SEND",
            ProbeStep::ReadInside => "READ inside the window",
            ProbeStep::ReadOutside => "READ outside the window",
            ProbeStep::Invalidate => "LOCAL_INV",
            ProbeStep::ReadAfterInvalidate => "READ after invalidation",
            ProbeStep::SendWithInv => "SEND_WITH_INV",
            ProbeStep::SendWithInvOtherQp => "SEND_WITH_INV on another QP",
            ProbeStep::SendWithInvOtherPd => "SEND_WITH_INV from another PD",
        })
    }
}

/// What happened at one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepOutcome {
    /// The step behaved as the mw policy needs.
    Ok(String),
    /// The step behaved otherwise; the text says how.
    Failed(String),
    /// Not run, because an earlier step failed.
    Skipped,
}

/// The probe's findings for one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    /// What the device claims.
    pub device: DeviceInfo,
    /// Each step in order with its outcome.
    pub steps: Vec<(ProbeStep, StepOutcome)>,
    /// Type-2 windows work: alloc, bind, READ inside, invalidate, and a READ
    /// after the invalidation fails. The mw policy may be used as owner.
    pub mw_usable: bool,
    /// The NIC rejects a READ outside the window (rxe does not: it checks
    /// only the region's bounds). `None` when not measured.
    pub bounds_enforced: Option<bool>,
    /// A peer's SEND_WITH_INV invalidates the window and is reported with
    /// the right rkey. `None` when not measured.
    pub send_with_inv: Option<bool>,
    /// A SEND_WITH_INV received on *another* queue pair of the window's
    /// protection domain invalidates it (rxe: yes; the specification and
    /// mlx5: no, the receive fails). `None` when not measured.
    pub other_qp_invalidates: Option<bool>,
    /// The same from a queue pair of another protection domain.
    pub other_pd_invalidates: Option<bool>,
}

impl ProbeReport {
    /// The first failing step and what happened there.
    pub fn first_failure(&self) -> Option<(ProbeStep, &str)> {
        self.steps.iter().find_map(|(s, o)| match o {
            StepOutcome::Failed(t) if s.needed_by_mw() => Some((*s, t.as_str())),
            _ => None,
        })
    }

    /// Whether the mw policy is safe with peers that are not trusted: type-2
    /// windows work, and a peer cannot invalidate a window bound to another
    /// connection's queue pair. Where it can (rxe), a peer that invalidates
    /// a window its owner then invalidates too, or one already invalid,
    /// panics the rxe kernel driver (`docs/protocol-mw.md`, "Invalidation
    /// by a peer"), so [`PolicyChoice::Auto`](crate::conn::PolicyChoice::Auto)
    /// picks confirm there unless the peers are trusted
    /// ([`EndpointBuilder::trusted_peers`](crate::conn::EndpointBuilder::trusted_peers)).
    /// Not measured counts as unsafe.
    pub fn mw_safe_with_untrusted_peers(&self) -> bool {
        self.mw_usable && self.other_qp_invalidates == Some(false) && self.other_pd_invalidates == Some(false)
    }
}

impl ProbeStep {
    /// Whether the mw policy cannot work when this step fails (a READ past
    /// the window and another queue pair's invalidation are findings about
    /// isolation, not about whether windows work).
    fn needed_by_mw(self) -> bool {
        !matches!(
            self,
            ProbeStep::ReadOutside | ProbeStep::SendWithInvOtherQp | ProbeStep::SendWithInvOtherPd
        )
    }
}

impl fmt::Display for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.device;
        writeln!(f, "device {} (driver {})", d.name, d.driver)?;
        writeln!(
            f,
            "  advertised: mem_window={} type_2a={} type_2b={} max_mw={} max_sge={} max_qp_rd_atom={} mtu={}",
            d.mem_window, d.mw_type_2a, d.mw_type_2b, d.max_mw, d.max_sge, d.max_qp_rd_atom, d.mtu
        )?;
        writeln!(f, "  steps:")?;
        for (step, outcome) in &self.steps {
            let (mark, text) = match outcome {
                StepOutcome::Ok(t) => ("ok    ", t.as_str()),
                StepOutcome::Failed(t) => ("FAILED", t.as_str()),
                StepOutcome::Skipped => ("skip  ", "an earlier step failed"),
            };
            writeln!(f, "    {mark} {step}: {text}")?;
        }
        let yn = |b: Option<bool>| match b {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        };
        writeln!(f, "  type-2 memory windows usable: {}", if self.mw_usable { "yes" } else { "no" })?;
        writeln!(f, "  window bounds enforced:       {}", yn(self.bounds_enforced))?;
        writeln!(f, "  SEND_WITH_INV works:          {}", yn(self.send_with_inv))?;
        writeln!(f, "  ... invalidates another QP's: {}", yn(self.other_qp_invalidates))?;
        writeln!(f, "  ... and another PD's:         {}", yn(self.other_pd_invalidates))?;
        match (self.mw_usable, self.first_failure()) {
            (true, _) if !self.mw_safe_with_untrusted_peers() => write!(
                f,
                "  policy: confirm with untrusted peers; mw only with trusted ones (a peer can invalidate \
                 windows bound to other connections, and a double invalidation panics rxe)"
            ),
            (true, _) => write!(f, "  policy: mw (confirm also available)"),
            (false, Some((s, t))) => write!(f, "  policy: confirm (type-2 windows fail at '{s}': {t})"),
            (false, None) => write!(f, "  policy: confirm"),
        }
    }
}

/// Probe `nic` for what the mw policy needs. Never panics; every failure is
/// a step outcome in the report.
pub fn probe(nic: &dyn Nic) -> ProbeReport {
    let mut p = Prober { nic, steps: Vec::new() };
    let (mw_usable, bounds_enforced, send_with_inv) = p.run();
    let (other_qp_invalidates, other_pd_invalidates) = if send_with_inv == Some(true) {
        (p.run_foreign_invalidation(false), p.run_foreign_invalidation(true))
    } else {
        (None, None)
    };
    let mut steps = p.steps;
    for step in ALL_STEPS {
        if !steps.iter().any(|(s, _)| *s == step) {
            steps.push((step, StepOutcome::Skipped));
        }
    }
    steps.sort_by_key(|(s, _)| ALL_STEPS.iter().position(|x| x == s));
    ProbeReport {
        device: nic.device_info(),
        steps,
        mw_usable,
        bounds_enforced,
        send_with_inv,
        other_qp_invalidates,
        other_pd_invalidates,
    }
}

const ALL_STEPS: [ProbeStep; 9] = [
    ProbeStep::Alloc,
    ProbeStep::Bind,
    ProbeStep::ReadInside,
    ProbeStep::ReadOutside,
    ProbeStep::Invalidate,
    ProbeStep::ReadAfterInvalidate,
    ProbeStep::SendWithInv,
    ProbeStep::SendWithInvOtherQp,
    ProbeStep::SendWithInvOtherPd,
];

/// A bound window with its memory and QP pair. Field order is drop order:
/// the window is freed before its QPs are destroyed (rxe stalls ~50 s
/// destroying a QP with a valid window bound to it).
struct Bound<'a> {
    setup: Setup<'a>,
    pair: LoopbackPair<'a>,
    rkey: u32,
}

struct Prober<'a> {
    nic: &'a dyn Nic,
    steps: Vec<(ProbeStep, StepOutcome)>,
}

/// A region pair and window for one scenario, freed on drop.
struct Setup<'a> {
    nic: &'a dyn Nic,
    owner_mr: MrInfo,
    reader_mr: MrInfo,
    mws: Vec<MwId>,
}

impl Drop for Setup<'_> {
    fn drop(&mut self) {
        // Deallocating a bound type-2 window is allowed and invalidates it;
        // it is not an invalidation work request (those crash rxe when doubled).
        for mw in self.mws.drain(..) {
            let _ = self.nic.dealloc_mw(mw);
        }
        let _ = self.nic.dereg_mr(self.owner_mr.id);
        let _ = self.nic.dereg_mr(self.reader_mr.id);
    }
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ 0x5a) as u8
}

fn describe(c: &Completion) -> String {
    format!("{:?} {:?} (vendor_err {})", c.opcode, c.status, c.vendor_err)
}

impl<'a> Prober<'a> {
    fn record(&mut self, step: ProbeStep, outcome: StepOutcome) -> bool {
        let ok = matches!(outcome, StepOutcome::Ok(_));
        self.steps.push((step, outcome));
        ok
    }

    fn fail(&mut self, step: ProbeStep, what: impl fmt::Display) -> bool {
        self.record(step, StepOutcome::Failed(what.to_string()))
    }

    fn setup(&self) -> Result<Setup<'a>, NicError> {
        let owner_mr = self.nic.reg_mr(MR_LEN, Access::LOCAL_WRITE | Access::MW_BIND)?;
        let reader_mr = match self.nic.reg_mr(MR_LEN, Access::LOCAL_WRITE) {
            Ok(mr) => mr,
            Err(e) => {
                let _ = self.nic.dereg_mr(owner_mr.id);
                return Err(e);
            }
        };
        let bytes: Vec<u8> = (0..MR_LEN).map(pattern).collect();
        let setup = Setup { nic: self.nic, owner_mr, reader_mr, mws: Vec::new() };
        self.nic.write_mr(owner_mr.id, 0, &bytes)?;
        Ok(setup)
    }

    /// Bind `mw` over the window on `pair.a`, chained with a SEND to `pair.b`.
    /// Returns the new rkey once the peer received the SEND.
    fn bind(&mut self, setup: &Setup, pair: &LoopbackPair, mw: MwId, current: u32) -> Result<u32, String> {
        let nic = self.nic;
        nic.post_recv(pair.b.id, 1, Sge { mr: setup.reader_mr.id, offset: 0, len: MSG_LEN })
            .map_err(|e| format!("post RECV: {e}"))?;
        let new_rkey = rkey::rebind(current, rand::random());
        let wrs = [
            SendWr::BindMw {
                wr_id: 10,
                signaled: true,
                mw,
                rkey: new_rkey,
                mr: setup.owner_mr.id,
                offset: WIN_OFF,
                len: WIN_LEN,
                access: Access::REMOTE_READ,
            },
            SendWr::Send {
                wr_id: 11,
                signaled: true,
                sge: SgeList::from([Sge { mr: setup.owner_mr.id, offset: 0, len: MSG_LEN }]),
            },
        ];
        nic.post_send(pair.a.id, &wrs).map_err(|e| format!("post BIND_MW+SEND: {e}"))?;
        let done = wait_completions(nic, pair.cq_a, 2, STEP_TIMEOUT).map_err(|e| e.to_string())?;
        if let Some(bad) = done.iter().find(|c| !c.status.is_success()) {
            return Err(format!("completion {}", describe(bad)));
        }
        if done.len() < 2 {
            return Err(format!("only {} of 2 completions within {STEP_TIMEOUT:?}", done.len()));
        }
        let recv = wait_completions(nic, pair.cq_b, 1, STEP_TIMEOUT).map_err(|e| e.to_string())?;
        match recv.first() {
            Some(c) if c.status.is_success() && c.opcode == WcOpcode::Recv => Ok(new_rkey),
            Some(c) => Err(format!("peer's RECV: {}", describe(c))),
            None => Err("the peer never received the SEND chained after the bind".into()),
        }
    }

    /// READ `len` bytes at window offset `off` from `pair.b`; returns the completion.
    fn read(
        &mut self,
        setup: &Setup,
        pair: &LoopbackPair,
        rkey: u32,
        off: i64,
        len: u32,
    ) -> Result<Option<Completion>, String> {
        let remote_addr = (setup.owner_mr.addr as i64 + WIN_OFF as i64 + off) as u64;
        let wr = SendWr::Read {
            wr_id: 20,
            signaled: true,
            local: SgeList::from([Sge { mr: setup.reader_mr.id, offset: 0, len }]),
            remote_addr,
            rkey,
        };
        self.nic.post_send(pair.b.id, &[wr]).map_err(|e| format!("post READ: {e}"))?;
        let got = wait_completions(self.nic, pair.cq_b, 1, STEP_TIMEOUT).map_err(|e| e.to_string())?;
        Ok(got.into_iter().next())
    }

    fn read_matches(&self, setup: &Setup, off: usize, len: usize) -> bool {
        let mut buf = vec![0u8; len];
        if self.nic.read_mr(setup.reader_mr.id, 0, &mut buf).is_err() {
            return false;
        }
        buf.iter().enumerate().all(|(i, b)| *b == pattern(WIN_OFF + off + i))
    }

    /// Returns (mw usable, bounds enforced, send_with_inv works).
    fn run(&mut self) -> (bool, Option<bool>, Option<bool>) {
        let usable = self.run_main();
        let bounds = if usable { self.run_bounds() } else { None };
        let swi = if usable { self.run_send_with_inv() } else { None };
        (usable, bounds, swi)
    }

    /// Alloc, bind, READ inside, LOCAL_INV, READ after.
    ///
    /// In each scenario the QP pair is created before the `Setup` so that it
    /// is dropped after it: windows are freed before their QPs are destroyed
    /// (rxe stalls for ~50 s destroying a QP with a valid window bound to it).
    fn run_main(&mut self) -> bool {
        let nic = self.nic;
        let pair = match LoopbackPair::new(nic) {
            Ok(p) => p,
            Err(e) => {
                return self.fail(ProbeStep::Alloc, format!("could not create a loopback QP pair: {e}"))
            }
        };
        let mut setup = match self.setup() {
            Ok(s) => s,
            Err(e) => return self.fail(ProbeStep::Alloc, format!("could not set up memory: {e}")),
        };
        let mw = match nic.alloc_mw() {
            Ok(mw) => mw,
            Err(e) => return self.fail(ProbeStep::Alloc, e),
        };
        setup.mws.push(mw.id);
        self.record(ProbeStep::Alloc, StepOutcome::Ok(format!("rkey {:#010x}", mw.rkey)));
        let rk = match self.bind(&setup, &pair, mw.id, mw.rkey) {
            Ok(rk) => rk,
            Err(e) => return self.fail(ProbeStep::Bind, e),
        };
        self.record(ProbeStep::Bind, StepOutcome::Ok(format!("new rkey {rk:#010x}, peer got the SEND")));

        match self.read(&setup, &pair, rk, 0, WIN_LEN as u32) {
            Ok(Some(c)) if c.status.is_success() => {
                if !self.read_matches(&setup, 0, WIN_LEN) {
                    return self.fail(ProbeStep::ReadInside, "READ succeeded but returned the wrong bytes");
                }
                self.record(
                    ProbeStep::ReadInside,
                    StepOutcome::Ok(format!("{} bytes, data intact", c.byte_len)),
                );
            }
            Ok(Some(c)) => return self.fail(ProbeStep::ReadInside, format!("completion {}", describe(&c))),
            Ok(None) => {
                return self.fail(ProbeStep::ReadInside, format!("no completion within {STEP_TIMEOUT:?}"))
            }
            Err(e) => return self.fail(ProbeStep::ReadInside, e),
        }

        // The window is bound (its bind completed), so this is its one invalidation.
        let inv = SendWr::LocalInv { wr_id: 30, signaled: true, rkey: rk };
        if let Err(e) = nic.post_send(pair.a.id, &[inv]) {
            return self.fail(ProbeStep::Invalidate, format!("post LOCAL_INV: {e}"));
        }
        match wait_completions(nic, pair.cq_a, 1, STEP_TIMEOUT) {
            Ok(c) if c.first().is_some_and(|c| c.status.is_success() && c.opcode == WcOpcode::LocalInv) => {
                self.record(ProbeStep::Invalidate, StepOutcome::Ok("LOCAL_INV completed".into()));
            }
            Ok(c) => {
                let what = c.first().map_or_else(|| "no completion".to_string(), describe);
                return self.fail(ProbeStep::Invalidate, what);
            }
            Err(e) => return self.fail(ProbeStep::Invalidate, e),
        }

        match self.read(&setup, &pair, rk, 0, 64) {
            Ok(Some(c)) if c.status == WcStatus::RemAccessErr => self
                .record(ProbeStep::ReadAfterInvalidate, StepOutcome::Ok("REM_ACCESS_ERR, as it must".into())),
            Ok(Some(c)) if c.status.is_success() => self.fail(
                ProbeStep::ReadAfterInvalidate,
                "READ through the invalidated rkey SUCCEEDED: invalidation does not revoke access",
            ),
            Ok(Some(c)) => self.fail(ProbeStep::ReadAfterInvalidate, format!("completion {}", describe(&c))),
            Ok(None) => {
                self.fail(ProbeStep::ReadAfterInvalidate, format!("no completion within {STEP_TIMEOUT:?}"))
            }
            Err(e) => self.fail(ProbeStep::ReadAfterInvalidate, e),
        }
    }

    /// A fresh loopback pair and memory with a newly allocated window bound
    /// on it, for one more step; a failure is recorded against `step`.
    fn fresh_bound(&mut self, step: ProbeStep) -> Option<Bound<'a>> {
        let nic = self.nic;
        let pair = LoopbackPair::new(nic).ok()?;
        let mut setup = self.setup().ok()?;
        let mw = nic.alloc_mw().ok()?;
        setup.mws.push(mw.id);
        match self.bind(&setup, &pair, mw.id, mw.rkey) {
            Ok(rkey) => Some(Bound { setup, pair, rkey }),
            Err(e) => {
                self.fail(step, format!("bind of a fresh window failed: {e}"));
                None
            }
        }
    }

    /// On a fresh pair and window: READ just past the window's end.
    fn run_bounds(&mut self) -> Option<bool> {
        // Not destructured: `Bound` must drop as a whole, window before QPs
        // (destructured bindings would drop in reverse order, QPs first).
        let bound = self.fresh_bound(ProbeStep::ReadOutside)?;
        let (setup, pair, rk) = (&bound.setup, &bound.pair, bound.rkey);
        // 64 bytes starting right after the window, still inside the region.
        match self.read(setup, pair, rk, WIN_LEN as i64, 64) {
            Ok(Some(c)) if c.status == WcStatus::RemAccessErr => {
                self.record(
                    ProbeStep::ReadOutside,
                    StepOutcome::Ok("REM_ACCESS_ERR: bounds enforced".into()),
                );
                Some(true)
            }
            Ok(Some(c)) if c.status.is_success() => {
                self.record(
                    ProbeStep::ReadOutside,
                    StepOutcome::Failed(
                        "READ past the window SUCCEEDED (only region bounds are checked, as on rxe); \
                         mwcap's protocol still bounds what it exposes, but a hostile peer can read \
                         the rest of the region"
                            .into(),
                    ),
                );
                Some(false)
            }
            Ok(Some(c)) => {
                self.fail(ProbeStep::ReadOutside, format!("completion {}", describe(&c)));
                None
            }
            Ok(None) | Err(_) => {
                self.fail(ProbeStep::ReadOutside, "no completion");
                None
            }
        }
    }

    /// On a fresh pair and window: the peer SENDs WITH_INV carrying the rkey.
    fn run_send_with_inv(&mut self) -> Option<bool> {
        let nic = self.nic;
        let bound = self.fresh_bound(ProbeStep::SendWithInv)?;
        let (setup, pair, rk) = (&bound.setup, &bound.pair, bound.rkey);
        let step = ProbeStep::SendWithInv;
        if let Err(e) = nic.post_recv(pair.a.id, 2, Sge { mr: setup.owner_mr.id, offset: 0, len: MSG_LEN }) {
            self.fail(step, format!("post RECV: {e}"));
            return None;
        }
        let wr = SendWr::SendWithInv {
            wr_id: 40,
            signaled: true,
            sge: SgeList::from([Sge { mr: setup.reader_mr.id, offset: 0, len: 8 }]),
            invalidate_rkey: rk,
        };
        if let Err(e) = nic.post_send(pair.b.id, &[wr]) {
            self.fail(step, format!("post SEND_WITH_INV: {e}"));
            return Some(false);
        }
        let sent = wait_completions(nic, pair.cq_b, 1, STEP_TIMEOUT).ok()?;
        let recv = wait_completions(nic, pair.cq_a, 1, STEP_TIMEOUT).ok()?;
        match (sent.first(), recv.first()) {
            (Some(s), Some(r)) if s.status.is_success() && r.status.is_success() => {
                if r.invalidated_rkey != Some(rk) {
                    self.fail(
                        step,
                        format!("RECV reported invalidated rkey {:?}, sent {rk:#x}", r.invalidated_rkey),
                    );
                    return Some(false);
                }
            }
            (s, r) => {
                let d = |c: Option<&Completion>| c.map_or_else(|| "none".to_string(), describe);
                self.fail(step, format!("sender {}, receiver {}", d(s), d(r)));
                return Some(false);
            }
        }
        // The window must now be invalid: a READ through it fails. (It is never
        // invalidated again: the Setup drop only deallocates it.)
        match self.read(setup, pair, rk, 0, 64) {
            Ok(Some(c)) if c.status == WcStatus::RemAccessErr => {
                self.record(
                    step,
                    StepOutcome::Ok("peer invalidated the window; READ then REM_ACCESS_ERR".into()),
                );
                Some(true)
            }
            Ok(Some(c)) => {
                self.fail(step, format!("READ after SEND_WITH_INV: {}", describe(&c)));
                Some(false)
            }
            _ => {
                self.fail(step, "READ after SEND_WITH_INV: no completion");
                Some(false)
            }
        }
    }

    /// On a fresh window bound on one loopback pair: a SEND_WITH_INV naming
    /// it arrives on a queue pair of another pair, made through this
    /// handle's protection domain or (`other_pd`) another one. `Some(true)`:
    /// the window was invalidated (a READ through it then fails);
    /// `Some(false)`: the receive failed and the window is still bound (a
    /// READ through it works). On rxe the window is invalidated once here
    /// and only deallocated afterwards: never a second invalidation.
    fn run_foreign_invalidation(&mut self, other_pd: bool) -> Option<bool> {
        let step = if other_pd { ProbeStep::SendWithInvOtherPd } else { ProbeStep::SendWithInvOtherQp };
        let bound = self.fresh_bound(step)?;
        // Declared before the pair and the region: dropped after them.
        let other: Box<dyn Nic>;
        let via: &dyn Nic = if other_pd {
            other = match self.nic.new_pd_boxed() {
                Ok(n) => n,
                Err(e) => {
                    self.fail(step, format!("could not open another protection domain: {e}"));
                    return None;
                }
            };
            &*other
        } else {
            self.nic
        };
        let pair = match LoopbackPair::new(via) {
            Ok(p) => p,
            Err(e) => {
                self.fail(step, format!("could not create a second loopback QP pair: {e}"));
                return None;
            }
        };
        let mr = match via.reg_mr(MR_LEN, Access::LOCAL_WRITE) {
            Ok(mr) => mr,
            Err(e) => {
                self.fail(step, format!("could not register memory: {e}"));
                return None;
            }
        };
        let outcome = self.foreign_invalidation(via, &pair, mr, &bound, step);
        drop(pair);
        let _ = via.dereg_mr(mr.id);
        outcome
    }

    fn foreign_invalidation(
        &mut self,
        via: &dyn Nic,
        pair: &LoopbackPair,
        mr: MrInfo,
        bound: &Bound,
        step: ProbeStep,
    ) -> Option<bool> {
        let rk = bound.rkey;
        if let Err(e) = via.post_recv(pair.a.id, 3, Sge { mr: mr.id, offset: 0, len: MSG_LEN }) {
            self.fail(step, format!("post RECV: {e}"));
            return None;
        }
        let wr = SendWr::SendWithInv {
            wr_id: 50,
            signaled: true,
            sge: SgeList::from([Sge { mr: mr.id, offset: 0, len: 8 }]),
            invalidate_rkey: rk,
        };
        if let Err(e) = via.post_send(pair.b.id, &[wr]) {
            self.fail(step, format!("post SEND_WITH_INV: {e}"));
            return None;
        }
        let recv = wait_completions(via, pair.cq_a, 1, STEP_TIMEOUT).ok()?;
        let Some(r) = recv.first() else {
            self.fail(step, format!("no receive completion within {STEP_TIMEOUT:?}"));
            return None;
        };
        let invalidated = r.status.is_success();
        // Is the window still bound? A READ through it from its own pair.
        let read = self.read(&bound.setup, &bound.pair, rk, 0, 64);
        match (invalidated, read) {
            (true, Ok(Some(c))) if c.status == WcStatus::RemAccessErr => {
                self.fail(
                    step,
                    "the window was invalidated through a queue pair it is not bound to: a peer of one \
                     connection can invalidate another's windows",
                );
                Some(true)
            }
            (false, Ok(Some(c))) if c.status.is_success() => {
                self.record(
                    step,
                    StepOutcome::Ok(format!("refused ({}); the window stays bound", describe(r))),
                );
                Some(false)
            }
            (_, read) => {
                let what = match read {
                    Ok(Some(c)) => describe(&c),
                    Ok(None) => "no completion".into(),
                    Err(e) => e,
                };
                self.fail(step, format!("receive {}, then a READ through the window: {what}", describe(r)));
                // Not known to be refused: counted as reachable.
                Some(true)
            }
        }
    }
}
