//! Test scaffolding: connected queue pairs on simulated devices.

use super::oracle::{DeviceId, QpAddr};
use super::{DeviceConfig, Fabric, SimNic};
use crate::backend::{Completion, CqId, NicError, NicOps, QpConfig, QpEndpoint, QpId, QpState};

/// One queue pair with its own completion queue (shared by its send and
/// receive queues) on a [`SimNic`].
#[derive(Clone, Debug)]
pub struct End {
    /// The protection domain it lives in.
    pub nic: SimNic,
    /// Its completion queue.
    pub cq: CqId,
    /// The queue pair.
    pub qp: QpId,
    /// What a peer connects to.
    pub ep: QpEndpoint,
    /// Its fabric address, for the oracle.
    pub addr: QpAddr,
}

impl End {
    /// A new queue pair (in INIT) with a fresh completion queue on `nic`.
    pub fn new(nic: &SimNic) -> Result<End, NicError> {
        let cq = nic.create_cq(256)?;
        let ep = nic.create_qp(QpConfig::new(cq, cq))?;
        let addr = QpAddr { device: nic.device(), qpn: ep.qpn };
        Ok(End { nic: nic.clone(), cq, qp: ep.id, ep, addr })
    }

    /// Connect two ends to each other (both to RTS).
    pub fn connect(a: &End, b: &End) -> Result<(), NicError> {
        a.nic.connect_qp(a.qp, &b.ep)?;
        b.nic.connect_qp(b.qp, &a.ep)
    }

    /// Take every completion already in the queue.
    ///
    /// In [`Progress::Auto`](super::Progress::Auto) mode polling may also
    /// move the clock; call [`Fabric::run_until_idle`] first to settle.
    pub fn poll(&self) -> Vec<Completion> {
        let mut out = Vec::new();
        loop {
            match self.nic.poll_cq_vec(self.cq, 64) {
                Ok(v) if !v.is_empty() => out.extend(v),
                _ => return out,
            }
        }
    }

    /// The queue pair's state (ERR if it is gone).
    pub fn state(&self) -> QpState {
        self.nic.qp_state(self.qp).unwrap_or(QpState::Err)
    }

    /// Its device.
    pub fn device(&self) -> DeviceId {
        self.addr.device
    }
}

/// Two devices with one connected queue pair between them: `a` is usually
/// the owner of memory, `b` the reader.
#[derive(Clone, Debug)]
pub struct Pair {
    /// The fabric.
    pub fabric: Fabric,
    /// The first end.
    pub a: End,
    /// The second end.
    pub b: End,
}

impl Pair {
    /// Add two devices to `fabric` and connect a queue pair between them.
    pub fn new(fabric: &Fabric, a: DeviceConfig, b: DeviceConfig) -> Result<Pair, NicError> {
        let a = End::new(&fabric.add_device(a))?;
        let b = End::new(&fabric.add_device(b))?;
        End::connect(&a, &b)?;
        Ok(Pair { fabric: fabric.clone(), a, b })
    }

    /// Run the fabric until nothing is pending and take both sides' completions.
    pub fn settle(&self) -> (Vec<Completion>, Vec<Completion>) {
        self.fabric.run_until_idle();
        (self.a.poll(), self.b.poll())
    }
}
