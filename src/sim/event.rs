//! What the scheduler carries between the simulated devices.

use crate::backend::{Completion, SgeList, WcStatus};

/// A scheduled event. Devices, queue pairs and CQs are named by slab index.
#[derive(Debug)]
pub(crate) enum EvKind {
    /// The send queue of (dev, qp) executes its next pending work request.
    Issue { dev: u32, qp: u32 },
    /// A request packet reaches the responder (dev, qp).
    Request { dev: u32, qp: u32, src_dev: u32, src_qp: u32, psn: u64, pkt: Packet },
    /// A response packet reaches the requester (dev, qp).
    Response { dev: u32, qp: u32, src_dev: u32, psn: u64, resp: Resp },
    /// The requester's ACK timer fires.
    AckTimer { dev: u32, qp: u32, gen: u64 },
    /// The requester resends after an RNR NAK.
    RnrResend { dev: u32, qp: u32, psn: u64 },
    /// A completion becomes pollable. `late`: the destination of a READ
    /// that failed after its request went out, written just before (see
    /// `World::retire`).
    Deliver { dev: u32, qp: u32, cq: u32, wc: Completion, late: Option<Box<SgeList>> },
}

/// A request on the wire.
#[derive(Debug, Clone)]
pub(crate) enum Packet {
    /// SEND or SEND_WITH_INV; the payload was gathered when the request was issued.
    Send { payload: Vec<u8>, invalidate: Option<u32> },
    /// RDMA READ request.
    Read { addr: u64, len: u64, rkey: u32 },
}

/// A response on the wire.
#[derive(Debug, Clone)]
pub(crate) enum Resp {
    /// A SEND was received.
    Ack,
    /// A READ's data, copied when the responder processed the request.
    ReadData(Vec<u8>),
    /// Receiver not ready: no RECV was posted.
    RnrNak,
    /// A fatal NAK; the requester completes with this status.
    Nak(WcStatus),
}
