//! A throw-away loopback pair of RC queue pairs on one device, and a bounded
//! wait for completions. Used by the capability probe; handy in tests.

use std::time::{Duration, Instant};

use super::{Completion, CqId, Nic, NicError, QpConfig, QpEndpoint};

/// Two RC queue pairs on one device connected to each other, each with its
/// own completion queue. Everything is destroyed on drop (QPs first).
pub struct LoopbackPair<'a> {
    nic: &'a dyn Nic,
    /// The first side (in mwcap's terms usually the owner of the memory).
    pub a: QpEndpoint,
    /// The second side (usually the reader).
    pub b: QpEndpoint,
    /// Completion queue of `a` (send and receive).
    pub cq_a: CqId,
    /// Completion queue of `b` (send and receive).
    pub cq_b: CqId,
}

impl<'a> LoopbackPair<'a> {
    /// Create and connect the pair.
    pub fn new(nic: &'a dyn Nic) -> Result<LoopbackPair<'a>, NicError> {
        let cq_a = nic.create_cq(64)?;
        let cq_b = match nic.create_cq(64) {
            Ok(cq) => cq,
            Err(e) => {
                let _ = nic.destroy_cq(cq_a);
                return Err(e);
            }
        };
        let mut pair = LoopbackPair { nic, a: placeholder(), b: placeholder(), cq_a, cq_b };
        pair.a = nic.create_qp(QpConfig::new(cq_a, cq_a))?;
        pair.b = nic.create_qp(QpConfig::new(cq_b, cq_b))?;
        nic.connect_qp(pair.a.id, &pair.b)?;
        nic.connect_qp(pair.b.id, &pair.a)?;
        Ok(pair)
    }
}

fn placeholder() -> QpEndpoint {
    QpEndpoint { id: super::QpId(u32::MAX), qpn: 0, gid: [0; 16], psn: 0, mtu: 0, lid: 0 }
}

impl Drop for LoopbackPair<'_> {
    fn drop(&mut self) {
        // Move both QPs to ERR and reap the flushes before destroying them
        // (bounded: quiet for 50 ms, or 500 ms in all).
        for qp in [self.a.id, self.b.id].into_iter().filter(|q| q.0 != u32::MAX) {
            let _ = self.nic.set_qp_error(qp);
        }
        let start = Instant::now();
        let mut quiet_since = Instant::now();
        while start.elapsed() < Duration::from_millis(500)
            && quiet_since.elapsed() < Duration::from_millis(50)
        {
            let mut any = false;
            for cq in [self.cq_a, self.cq_b] {
                any |= self.nic.poll_cq_vec(cq, 64).is_ok_and(|v| !v.is_empty());
            }
            if any {
                quiet_since = Instant::now();
            } else {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        for qp in [self.a.id, self.b.id] {
            if qp.0 != u32::MAX {
                let _ = self.nic.destroy_qp(qp);
            }
        }
        let _ = self.nic.destroy_cq(self.cq_a);
        let _ = self.nic.destroy_cq(self.cq_b);
    }
}

/// Poll `cq` until `n` completions arrived or `timeout` passed; returns what
/// arrived (possibly fewer than `n`: a READ whose window was invalidated while
/// it was in flight never completes on rxe). Sleeps 200 µs between empty polls.
pub fn wait_completions(
    nic: &dyn Nic,
    cq: CqId,
    n: usize,
    timeout: Duration,
) -> Result<Vec<Completion>, NicError> {
    wait_completions_with(nic, cq, n, timeout, || std::thread::sleep(Duration::from_micros(200)))
}

/// [`wait_completions`] with the caller's `pause` between empty polls (a
/// simulated fabric's test rig advances its clock there).
pub fn wait_completions_with(
    nic: &dyn Nic,
    cq: CqId,
    n: usize,
    timeout: Duration,
    mut pause: impl FnMut(),
) -> Result<Vec<Completion>, NicError> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    while got.len() < n {
        let batch = nic.poll_cq_vec(cq, n - got.len())?;
        let empty = batch.is_empty();
        got.extend(batch);
        if got.len() >= n || Instant::now() >= deadline {
            break;
        }
        if empty {
            pause();
        }
    }
    Ok(got)
}
