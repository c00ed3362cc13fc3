//! What tests may ask the fabric: who can reach which bytes, which READs are
//! in flight, which hazards happened, per-QP counters.

use std::ops::Range;
use std::time::Duration;

use super::world::{MwState, World, WrState};
use crate::backend::{Access, MrId, MwId, QpState, SendWr, Sge};

/// A device of a [`Fabric`](super::Fabric).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(pub(crate) u32);

impl DeviceId {
    /// The raw index, for logs.
    pub fn raw(self) -> u32 {
        self.0
    }
}

/// A queue pair anywhere on the fabric: its device and QP number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpAddr {
    /// The device.
    pub device: DeviceId,
    /// The queue pair number.
    pub qpn: u32,
}

/// How an exposed range is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The region's own rkey.
    Region,
    /// A bound type-2 window.
    Window(MwId),
}

/// Bytes of one region that one remote queue pair can reach right now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exposure {
    /// The region.
    pub mr: MrId,
    /// Offsets into the region (what the NIC would really allow, so in
    /// rxe-quirks mode a window exposes its whole region).
    pub bytes: Range<usize>,
    /// The rkey to use.
    pub rkey: u32,
    /// Region or window.
    pub via: Via,
    /// `REMOTE_READ` and/or `REMOTE_WRITE`.
    pub access: Access,
    /// The owner's queue pair the requests must arrive at.
    pub through: QpAddr,
}

/// Where a READ stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPhase {
    /// Posted and sent; the responder has not read memory yet.
    Requested,
    /// The responder copied the bytes at `since`; the data has not landed yet.
    Responding {
        /// When the responder read the source memory.
        since: Duration,
    },
}

/// Where a READ's data came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadSource {
    /// The responder queue pair.
    pub responder: QpAddr,
    /// The source region.
    pub mr: MrId,
    /// Offsets read.
    pub bytes: Range<usize>,
    /// The window used, if any.
    pub window: Option<MwId>,
}

/// A READ that has been issued and has not completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlightRead {
    /// The requester queue pair.
    pub requester: QpAddr,
    /// The work request id.
    pub wr_id: u64,
    /// The rkey used.
    pub rkey: u32,
    /// The remote address.
    pub remote_addr: u64,
    /// Bytes requested.
    pub len: u64,
    /// The destination, which the NIC will still write.
    pub dest: Vec<Sge>,
    /// Where it stands.
    pub phase: ReadPhase,
    /// Set once the responder has processed it.
    pub source: Option<ReadSource>,
    /// rxe quirk: it will never complete (its window was invalidated while
    /// it was being answered).
    pub hung: bool,
}

/// A thing that must never happen in a correct program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HazardKind {
    /// Invalidating an unbound or already invalidated window (LOCAL_INV or
    /// SEND_WITH_INV): the sim returns an error, rxe's kernel panics.
    WouldCrashRxe,
    /// A READ response or a SEND landed in a region deregistered meanwhile:
    /// on a real NIC, a DMA into freed memory.
    DmaIntoFreedMemory,
    /// A READ response or a SEND landed in bytes a buffer handle holds (a
    /// `Buf` its user has, see `crate::mem`): the user's bytes would have
    /// changed under them (the simulator skips them).
    DmaIntoHeldBuffer,
    /// A remote READ was served from bytes a buffer handle holds: through a
    /// memory window (under the mw policy a held buffer must be
    /// unreachable), or through a region's key in memory that does not
    /// expect it (`Memory::expect_reads_of_held`: confirm expects it).
    RemoteReadOfHeldBuffer,
    /// A SEND's bytes changed (or its region went away) between the NIC's
    /// read of them and the end of the SEND (its acknowledgement, or its
    /// flush): its memory was reused while the NIC could still read it,
    /// and a retransmission would have sent the new bytes (the simulator
    /// sends the first ones).
    SendBufferChanged,
    /// A queue pair was destroyed while a memory window was still bound
    /// through it: rxe stalls about 50 s in the destroy, then frees the QP
    /// while the window still points at it (the window's later
    /// deallocation, or the process's end, invalidates through the freed
    /// QP). The simulator destroys it at once and leaves the window bound.
    DestroyUnderBoundWindow,
}

/// A recorded hazard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hazard {
    /// When.
    pub at: Duration,
    /// Where.
    pub device: DeviceId,
    /// What kind.
    pub kind: HazardKind,
    /// Which request, which key.
    pub detail: String,
}

/// Counters of one queue pair.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpCounters {
    /// Send-queue work requests posted.
    pub sends_posted: u64,
    /// Receives posted.
    pub recvs_posted: u64,
    /// Completions delivered (send and receive side, any status).
    pub completions: u64,
    /// Completions with an error other than a flush.
    pub error_completions: u64,
    /// Flushed work requests.
    pub flushed: u64,
    /// ACK-timeout retransmission rounds.
    pub retransmits: u64,
    /// RNR NAKs received as requester.
    pub rnr_naks: u64,
    /// Remote access errors as responder (`resp_remote_access_errors`).
    pub resp_remote_access_errors: u64,
    /// Bytes that landed from READs as requester.
    pub bytes_read: u64,
    /// Bytes copied out for READs as responder.
    pub bytes_served: u64,
}

/// How many objects of each kind were ever created on one device, in
/// any of its protection domains (destroyed ones still count): what a
/// test reads to show that something was refused before anything was
/// created ([`Fabric::created`](super::Fabric::created)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Created {
    /// Protection domains, the device's first one included.
    pub pds: u32,
    /// Completion queues.
    pub cqs: u32,
    /// Queue pairs.
    pub qps: u32,
    /// Shared receive queues.
    pub srqs: u32,
    /// Memory regions.
    pub mrs: u32,
    /// Memory windows.
    pub mws: u32,
}

/// A window's state as the device sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowState {
    /// Allocated, never bound.
    Unbound {
        /// The current rkey (not usable).
        rkey: u32,
    },
    /// Bound.
    Bound {
        /// The valid rkey.
        rkey: u32,
        /// The queue pair it is scoped to.
        qp: QpAddr,
        /// The region.
        mr: MrId,
        /// Offsets into the region.
        bytes: Range<usize>,
        /// Rights granted.
        access: Access,
    },
    /// Invalidated; may be bound again.
    Invalidated {
        /// The last rkey (no longer valid).
        rkey: u32,
    },
}

/// One line of the fabric's trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// Virtual time.
    pub at: Duration,
    /// What happened.
    pub what: String,
}

impl World {
    fn qp_idx(&self, a: QpAddr) -> Option<(u32, u32)> {
        let d = self.devs.get(a.device.0 as usize)?;
        Some((a.device.0, d.qp_by_qpn(a.qpn)?))
    }

    pub(crate) fn qp_counters(&self, a: QpAddr) -> Option<QpCounters> {
        let (d, q) = self.qp_idx(a)?;
        Some(self.devs[d as usize].qp(q)?.counters)
    }

    pub(crate) fn qp_state_of(&self, a: QpAddr) -> Option<QpState> {
        let (d, q) = self.qp_idx(a)?;
        Some(self.devs[d as usize].qp(q)?.state)
    }

    pub(crate) fn window_state(&self, dev: u32, mw: u32) -> Option<WindowState> {
        let d = self.devs.get(dev as usize)?;
        let w = d.mw(mw)?;
        Some(match w.state {
            MwState::Unbound => WindowState::Unbound { rkey: w.rkey },
            MwState::Invalidated => WindowState::Invalidated { rkey: w.rkey },
            MwState::Bound { qp, mr, offset, len, access } => WindowState::Bound {
                rkey: w.rkey,
                qp: QpAddr { device: DeviceId(dev), qpn: d.qp(qp).map_or(0, |q| q.qpn) },
                mr: MrId(mr),
                bytes: offset..offset + len,
                access,
            },
        })
    }

    /// Everything `remote` can reach on device `owner` right now.
    pub(crate) fn exposure(&self, owner: u32, remote: QpAddr) -> Vec<Exposure> {
        let mut out = Vec::new();
        let (Some(d), Some(rd)) = (self.devs.get(owner as usize), self.devs.get(remote.device.0 as usize))
        else {
            return out;
        };
        let Some(rq) = rd.qp_by_qpn(remote.qpn).and_then(|i| rd.qp(i)) else { return out };
        if !d.alive || !rd.alive || rq.state != QpState::Rts {
            return out;
        }
        let remote_bits = Access::REMOTE_READ | Access::REMOTE_WRITE;
        for (li, l) in d.qps.iter().enumerate() {
            let Some(l) = l else { continue };
            let paired = l.remote == Some((rd.gid, remote.qpn)) && rq.remote == Some((d.gid, l.qpn));
            if !paired || !matches!(l.state, QpState::Rtr | QpState::Rts) {
                continue;
            }
            let through = QpAddr { device: DeviceId(owner), qpn: l.qpn };
            for (mi, m) in d.mrs.iter().enumerate() {
                let Some(m) = m.as_ref().filter(|m| m.pd == l.pd) else { continue };
                let access = Access::from_bits_truncate(m.access.bits() & remote_bits.bits());
                if access != Access::NONE {
                    let bytes = 0..m.data.len();
                    out.push(Exposure {
                        mr: MrId(mi as u32),
                        bytes,
                        rkey: m.rkey,
                        via: Via::Region,
                        access,
                        through,
                    });
                }
            }
            for (wi, w) in d.mws.iter().enumerate() {
                let Some(w) = w.as_ref().filter(|w| w.pd == l.pd) else { continue };
                let MwState::Bound { qp, mr, offset, len, access } = w.state else { continue };
                let Some(m) = d.mr(mr).filter(|_| qp as usize == li) else { continue };
                let access = Access::from_bits_truncate(access.bits() & remote_bits.bits());
                if access == Access::NONE {
                    continue;
                }
                let bytes = if d.cfg.rxe_quirks { 0..m.data.len() } else { offset..offset + len };
                let via = Via::Window(MwId(wi as u32));
                out.push(Exposure { mr: MrId(mr), bytes, rkey: w.rkey, via, access, through });
            }
        }
        out
    }

    /// Every issued READ that has not completed.
    pub(crate) fn in_flight(&self) -> Vec<InFlightRead> {
        let mut out = Vec::new();
        for (di, d) in self.devs.iter().enumerate() {
            for q in d.qps.iter().flatten() {
                for e in q.sq.iter().filter(|e| e.st == WrState::Issued) {
                    let SendWr::Read { wr_id, local, remote_addr, rkey, .. } = &e.wr else { continue };
                    let source = e.served.as_ref().map(|s| ReadSource {
                        responder: QpAddr {
                            device: DeviceId(s.dev),
                            qpn: self.devs[s.dev as usize].qp(s.qp).map_or(0, |q| q.qpn),
                        },
                        mr: MrId(s.mr),
                        bytes: s.range.clone(),
                        window: s.mw.map(MwId),
                    });
                    let phase = match &e.served {
                        Some(s) => ReadPhase::Responding { since: Duration::from_nanos(s.at) },
                        None => ReadPhase::Requested,
                    };
                    out.push(InFlightRead {
                        requester: QpAddr { device: DeviceId(di as u32), qpn: q.qpn },
                        wr_id: *wr_id,
                        rkey: *rkey,
                        remote_addr: *remote_addr,
                        len: local.iter().map(|s| s.len as u64).sum(),
                        dest: local.to_vec(),
                        phase,
                        source,
                        hung: e.hung,
                    });
                }
            }
        }
        out
    }
}
