//! Conformance scenarios: one table of NIC behaviours mwcap relies on, run
//! unchanged on any [`Nic`] (real verbs on SoftRoCE in the VM suite, the
//! simulated NIC in ordinary `cargo test`).
//!
//! A [`Scenario`] drives two NIC handles through a [`Rig`] and returns an
//! [`Outcome`]: a deterministic list of named observations (completion
//! status and opcode, byte counts where meaningful, QP states, facts such as
//! "the READ returned the window's bytes"). [`check`] compares it for
//! equality with the record expected for a [`Flavor`]: what the InfiniBand
//! spec requires, or what rxe is known to do where it deviates (each
//! deviation is documented in [`Scenario::rxe_deviation`]). A mismatch
//! prints a line-by-line diff.
//!
//! Scenarios never exercise the paths that crash rxe's kernel driver
//! (invalidating a window twice, invalidating an unbound window,
//! SEND_WITH_INV with a stale rkey): a panic would take the test VM down.
//!
//! Naming: the **owner** side exposes memory through windows; the **reader**
//! side READs it. On rxe both sides are handles on `rxe0`, connected over
//! loopback.

mod basic;
mod extra;

use std::fmt;
use std::time::{Duration, Instant};

use crate::backend::{
    Access, Completion, CqId, MrId, MrInfo, MwId, MwInfo, Nic, NicError, QpConfig, QpId, QpState, WcOpcode,
    WcStatus,
};

/// One behaviour, with how to provoke it and what to expect.
#[derive(Clone, Copy)]
pub struct Scenario {
    /// Short identifier, used as the test name.
    pub name: &'static str,
    /// One sentence: the behaviour checked.
    pub about: &'static str,
    /// Run it against a rig.
    pub run: fn(&Rig<'_>) -> Result<Outcome, ScenarioError>,
    /// What the InfiniBand spec requires.
    pub expect_spec: fn() -> Outcome,
    /// What rxe does, when it deviates from the spec.
    pub expect_rxe: Option<fn() -> Outcome>,
    /// The rxe deviation in words (set exactly when `expect_rxe` is).
    pub rxe_deviation: Option<&'static str>,
}

impl Scenario {
    /// The record expected for `flavor`.
    pub fn expected(&self, flavor: Flavor) -> Outcome {
        match (flavor, self.expect_rxe) {
            (Flavor::Rxe, Some(f)) => f(),
            _ => (self.expect_spec)(),
        }
    }
}

impl fmt::Debug for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scenario").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Which expected record a run is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flavor {
    /// The InfiniBand spec.
    Spec,
    /// SoftRoCE (rxe) as measured, deviations included.
    Rxe,
}

/// Every scenario: the basic ones (this module) and the extra ones.
pub fn table() -> Vec<Scenario> {
    let mut t = basic::scenarios();
    t.extend(extra::scenarios());
    t
}

/// Run `s` on `rig` and compare its outcome with the `flavor` record.
pub fn check(s: &Scenario, rig: &Rig<'_>, flavor: Flavor) -> Result<(), Mismatch> {
    let actual =
        (s.run)(rig).map_err(|e| Mismatch { scenario: s.name, flavor, kind: MismatchKind::Failed(e) })?;
    let expected = s.expected(flavor);
    if actual == expected {
        Ok(())
    } else {
        Err(Mismatch { scenario: s.name, flavor, kind: MismatchKind::Differs { expected, actual } })
    }
}

/// The two NIC handles a scenario drives, and how long it waits.
#[derive(Clone, Copy)]
pub struct Rig<'a> {
    /// The side that binds windows over its memory.
    pub owner: &'a dyn Nic,
    /// The side that READs. May be another handle on the same device.
    pub reader: &'a dyn Nic,
    /// How long to wait for a completion before recording it as missing.
    pub timeout: Duration,
    /// How long a QP that is not in ERR is watched before its state is
    /// recorded (a responder moves to ERR asynchronously, after it sent the
    /// NAK its requester completed on). Zero records the first answer.
    pub settle: Duration,
    /// Called between polls while waiting (e.g. to advance a simulated
    /// clock); without it the waiting thread sleeps briefly.
    pub idle: Option<&'a (dyn Fn() + Sync)>,
}

impl<'a> Rig<'a> {
    /// A rig with a 10 s completion timeout and a 100 ms state settle time.
    pub fn new(owner: &'a dyn Nic, reader: &'a dyn Nic) -> Rig<'a> {
        Rig {
            owner,
            reader,
            timeout: Duration::from_secs(10),
            settle: Duration::from_millis(100),
            idle: None,
        }
    }

    /// The handle of `side`.
    pub fn nic(&self, side: Side) -> &'a dyn Nic {
        match side {
            Side::Owner => self.owner,
            Side::Reader => self.reader,
        }
    }

    fn pause(&self) {
        match self.idle {
            Some(f) => f(),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

impl fmt::Debug for Rig<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rig").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

/// Which handle of the rig.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// [`Rig::owner`].
    Owner,
    /// [`Rig::reader`].
    Reader,
}

/// What one observation saw.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Observed {
    /// A completion arrived.
    Completion {
        /// Its status.
        status: WcStatus,
        /// Its opcode.
        opcode: WcOpcode,
        /// Its byte count, recorded only for successful RECV and READ.
        byte_len: Option<u32>,
    },
    /// No completion arrived within the rig's timeout.
    NoCompletion,
    /// A queue pair's state.
    State(QpState),
    /// A yes/no fact (e.g. "the bytes read are the window's bytes").
    Fact(bool),
}

impl fmt::Display for Observed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observed::Completion { status, opcode, byte_len: Some(n) } => {
                write!(f, "completion {status:?} {opcode:?} {n} bytes")
            }
            Observed::Completion { status, opcode, byte_len: None } => {
                write!(f, "completion {status:?} {opcode:?}")
            }
            Observed::NoCompletion => f.write_str("no completion"),
            Observed::State(s) => write!(f, "state {s:?}"),
            Observed::Fact(b) => write!(f, "{b}"),
        }
    }
}

impl From<bool> for Observed {
    fn from(b: bool) -> Observed {
        Observed::Fact(b)
    }
}

/// A named observation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Observation {
    /// What was looked at ("reader: READ inside the window").
    pub name: String,
    /// What was seen.
    pub value: Observed,
}

/// The record of a run: observations in the order they were made.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Outcome {
    /// The observations.
    pub observations: Vec<Observation>,
}

impl Outcome {
    /// An empty record.
    pub fn new() -> Outcome {
        Outcome::default()
    }

    /// Append an observation.
    pub fn push(&mut self, name: impl Into<String>, value: Observed) {
        self.observations.push(Observation { name: name.into(), value });
    }

    /// Builder: a completion (`byte_len` only for successful RECV/READ).
    pub fn completion(
        mut self,
        name: &str,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: Option<u32>,
    ) -> Outcome {
        self.push(name, Observed::Completion { status, opcode, byte_len });
        self
    }

    /// Builder: a queue pair state.
    pub fn state(mut self, name: &str, state: QpState) -> Outcome {
        self.push(name, Observed::State(state));
        self
    }

    /// Builder: a fact.
    pub fn fact(mut self, name: &str, value: bool) -> Outcome {
        self.push(name, Observed::Fact(value));
        self
    }

    /// Record a completion as seen (or its absence).
    pub fn saw(&mut self, name: &str, c: Option<&Completion>) {
        let value = match c {
            None => Observed::NoCompletion,
            Some(c) => {
                let counted =
                    c.status.is_success() && matches!(c.opcode, WcOpcode::Recv | WcOpcode::RdmaRead);
                Observed::Completion {
                    status: c.status,
                    opcode: c.opcode,
                    byte_len: counted.then_some(c.byte_len),
                }
            }
        };
        self.push(name, value);
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for o in &self.observations {
            writeln!(f, "{}: {}", o.name, o.value)?;
        }
        Ok(())
    }
}

/// A scenario could not run to its end because a verb failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scenario step `{step}` failed: {source}")]
pub struct ScenarioError {
    /// What the scenario was doing.
    pub step: &'static str,
    /// The NIC's error.
    #[source]
    pub source: NicError,
}

/// Attach a step name to a NIC error: `.map_err(at("bind"))`.
pub fn at(step: &'static str) -> impl FnOnce(NicError) -> ScenarioError {
    move |source| ScenarioError { step, source }
}

/// How a scenario's run differed from its expected record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scenario {scenario} ({flavor:?}): {kind}")]
pub struct Mismatch {
    /// The scenario.
    pub scenario: &'static str,
    /// The flavor compared with.
    pub flavor: Flavor,
    /// What went wrong.
    pub kind: MismatchKind,
}

/// The two ways a check fails.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MismatchKind {
    /// The scenario itself failed.
    Failed(ScenarioError),
    /// It ran, and its record differs.
    Differs {
        /// The flavor's record.
        expected: Outcome,
        /// What was observed.
        actual: Outcome,
    },
}

impl fmt::Display for MismatchKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MismatchKind::Failed(e) => write!(f, "{e}"),
            MismatchKind::Differs { expected, actual } => {
                writeln!(f, "outcome differs (- expected, + actual):")?;
                f.write_str(&diff(expected, actual))
            }
        }
    }
}

/// A line diff of two records, aligned by position.
pub fn diff(expected: &Outcome, actual: &Outcome) -> String {
    let (e, a) = (&expected.observations, &actual.observations);
    let mut out = String::new();
    for i in 0..e.len().max(a.len()) {
        match (e.get(i), a.get(i)) {
            (Some(x), Some(y)) if x == y => out += &format!("  {}: {}\n", x.name, x.value),
            (x, y) => {
                if let Some(x) = x {
                    out += &format!("- {}: {}\n", x.name, x.value);
                }
                if let Some(y) = y {
                    out += &format!("+ {}: {}\n", y.name, y.value);
                }
            }
        }
    }
    out
}

/// A connected RC queue pair between the owner and the reader, each end
/// with its own completion queue (sends and receives).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpPair {
    /// The owner's QP.
    pub owner_qp: QpId,
    /// The owner's CQ.
    pub owner_cq: CqId,
    /// The reader's QP.
    pub reader_qp: QpId,
    /// The reader's CQ.
    pub reader_cq: CqId,
}

#[derive(Clone, Copy, Debug)]
enum Obj {
    Mr(MrId),
    Mw(MwId),
    Cq(CqId),
    Qp(QpId),
}

/// The objects one scenario run created, destroyed in a safe order
/// (windows, queue pairs, regions, completion queues) when it is dropped,
/// whether the scenario finished or not.
pub struct Session<'r> {
    rig: &'r Rig<'r>,
    created: Vec<(Side, Obj)>,
}

impl<'r> Session<'r> {
    /// Start a run on `rig`.
    pub fn new(rig: &'r Rig<'r>) -> Session<'r> {
        Session { rig, created: Vec::new() }
    }

    /// The handle of `side`.
    pub fn nic(&self, side: Side) -> &'r dyn Nic {
        self.rig.nic(side)
    }

    /// Register a region on `side`.
    pub fn mr(&mut self, side: Side, len: usize, access: Access) -> Result<MrInfo, ScenarioError> {
        let mr = self.nic(side).reg_mr(len, access).map_err(at("register a memory region"))?;
        self.created.push((side, Obj::Mr(mr.id)));
        Ok(mr)
    }

    /// Allocate a window on `side`.
    pub fn mw(&mut self, side: Side) -> Result<MwInfo, ScenarioError> {
        let mw = self.nic(side).alloc_mw().map_err(at("allocate a memory window"))?;
        self.created.push((side, Obj::Mw(mw.id)));
        Ok(mw)
    }

    /// Create and connect a QP pair between the owner and the reader.
    pub fn pair(&mut self) -> Result<QpPair, ScenarioError> {
        let (o, r) = (self.rig.owner, self.rig.reader);
        let owner_cq = o.create_cq(64).map_err(at("create the owner's CQ"))?;
        self.created.push((Side::Owner, Obj::Cq(owner_cq)));
        let reader_cq = r.create_cq(64).map_err(at("create the reader's CQ"))?;
        self.created.push((Side::Reader, Obj::Cq(reader_cq)));
        let oe = o.create_qp(QpConfig::new(owner_cq, owner_cq)).map_err(at("create the owner's QP"))?;
        self.created.push((Side::Owner, Obj::Qp(oe.id)));
        let re = r.create_qp(QpConfig::new(reader_cq, reader_cq)).map_err(at("create the reader's QP"))?;
        self.created.push((Side::Reader, Obj::Qp(re.id)));
        o.connect_qp(oe.id, &re).map_err(at("connect the owner's QP"))?;
        r.connect_qp(re.id, &oe).map_err(at("connect the reader's QP"))?;
        Ok(QpPair { owner_qp: oe.id, owner_cq, reader_qp: re.id, reader_cq })
    }

    /// Wait for up to `n` completions on `side`'s `cq`, at most the rig's
    /// timeout; returns what arrived (possibly fewer).
    pub fn wait(&self, side: Side, cq: CqId, n: usize) -> Result<Vec<Completion>, ScenarioError> {
        crate::backend::loopback::wait_completions_with(self.nic(side), cq, n, self.rig.timeout, || {
            self.rig.pause()
        })
        .map_err(at("poll a CQ"))
    }

    /// Wait for one completion and record it (or its absence) under `name`.
    pub fn expect_one(
        &self,
        out: &mut Outcome,
        name: &str,
        side: Side,
        cq: CqId,
    ) -> Result<Option<Completion>, ScenarioError> {
        let c = self.wait(side, cq, 1)?.into_iter().next();
        out.saw(name, c.as_ref());
        Ok(c)
    }

    /// A queue pair's state. A QP that is not yet in ERR is watched for up to
    /// [`Rig::settle`].
    pub fn state(&self, side: Side, qp: QpId) -> Result<QpState, ScenarioError> {
        let settle = Instant::now() + self.rig.settle;
        loop {
            let s = self.nic(side).qp_state(qp).map_err(at("query a QP's state"))?;
            if s == QpState::Err || Instant::now() >= settle {
                return Ok(s);
            }
            self.rig.pause();
        }
    }

    /// Record a queue pair's state under `name`.
    pub fn record_state(
        &self,
        out: &mut Outcome,
        name: &str,
        side: Side,
        qp: QpId,
    ) -> Result<(), ScenarioError> {
        let s = self.state(side, qp)?;
        out.push(name, Observed::State(s));
        Ok(())
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // Windows first: deallocating a bound window unbinds it (no
        // invalidation verb, so no rxe crash path), and rxe's QP teardown
        // stalls for tens of seconds while a bound window still refers to it.
        let rank = |o: &Obj| match o {
            Obj::Mw(_) => 0,
            Obj::Qp(_) => 1,
            Obj::Mr(_) => 2,
            Obj::Cq(_) => 3,
        };
        let mut all = std::mem::take(&mut self.created);
        // Within a kind, newest first.
        all.reverse();
        all.sort_by_key(|(_, o)| rank(o));
        for (side, obj) in all {
            let nic = self.rig.nic(side);
            let r = match obj {
                Obj::Qp(id) => nic.destroy_qp(id),
                Obj::Mw(id) => nic.dealloc_mw(id),
                Obj::Mr(id) => nic.dereg_mr(id),
                Obj::Cq(id) => nic.destroy_cq(id),
            };
            if let Err(e) = r {
                tracing::warn!(?side, ?obj, error = %e, "conformance cleanup failed");
            }
        }
    }
}
