//! Regions, receives, RNR, ordering, flushes and stale reads on the sim.

use mwcap::backend::NicOps;
use mwcap::backend::{Access, Completion, NicError, QpState, SendWr, Sge, SgeList, WcOpcode, WcStatus};
use mwcap::sim::{DeviceConfig, End, Fabric, Faults, Pair, Progress};

fn pair() -> Pair {
    Pair::new(&Fabric::with_seed(3), DeviceConfig::spec(), DeviceConfig::spec()).unwrap()
}

fn st(v: &[Completion]) -> Vec<(u64, WcOpcode, WcStatus)> {
    v.iter().map(|c| (c.wr_id, c.opcode, c.status)).collect()
}

fn read(
    wr_id: u64,
    signaled: bool,
    dst: mwcap::backend::MrId,
    off: usize,
    len: u32,
    addr: u64,
    rkey: u32,
) -> SendWr {
    SendWr::Read {
        wr_id,
        signaled,
        local: SgeList::from([Sge { mr: dst, offset: off, len }]),
        remote_addr: addr,
        rkey,
    }
}

#[test]
fn read_through_a_region_rkey() {
    let p = pair();
    let src = p.a.nic.reg_mr(256, Access::REMOTE_READ).unwrap();
    p.a.nic.write_mr(src.id, 10, b"hello").unwrap();
    let dst = p.b.nic.reg_mr(256, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(1, true, dst.id, 0, 5, src.addr + 10, src.rkey)]).unwrap();
    let (_, b) = p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::Success)]);
    let mut out = [0u8; 5];
    p.b.nic.read_mr(dst.id, 0, &mut out).unwrap();
    assert_eq!(&out, b"hello");
    assert_eq!(p.fabric.qp_counters(p.b.addr).unwrap().bytes_read, 5);
}

#[test]
fn a_read_destination_needs_local_write() {
    let p = pair();
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::NONE).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(1, true, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    let (_, b) = p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::LocProtErr)]);
    assert_eq!(p.b.state(), QpState::Err);
    assert_eq!(p.a.state(), QpState::Rts);
}

#[test]
fn a_recv_buffer_needs_local_write() {
    let p = pair();
    let rbuf = p.b.nic.reg_mr(64, Access::NONE).unwrap();
    p.b.nic.post_recv(p.b.qp, 5, Sge { mr: rbuf.id, offset: 0, len: 64 }).unwrap();
    p.a.nic.post_send(p.a.qp, &[SendWr::Send { wr_id: 1, signaled: true, sge: SgeList::new() }]).unwrap();
    let (a, b) = p.settle();
    assert_eq!(st(&b), vec![(5, WcOpcode::Recv, WcStatus::LocProtErr)]);
    assert_eq!(st(&a), vec![(1, WcOpcode::Send, WcStatus::RemOpErr)]);
    assert_eq!((p.a.state(), p.b.state()), (QpState::Err, QpState::Err));
}

#[test]
fn a_send_larger_than_the_recv_buffer_is_a_length_error() {
    let p = pair();
    let sbuf = p.a.nic.reg_mr(64, Access::NONE).unwrap();
    let rbuf = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_recv(p.b.qp, 5, Sge { mr: rbuf.id, offset: 0, len: 8 }).unwrap();
    let sge = SgeList::from([Sge { mr: sbuf.id, offset: 0, len: 16 }]);
    p.a.nic.post_send(p.a.qp, &[SendWr::Send { wr_id: 1, signaled: true, sge }]).unwrap();
    let (a, b) = p.settle();
    assert_eq!(st(&b), vec![(5, WcOpcode::Recv, WcStatus::LocLenErr)]);
    assert_eq!(st(&a), vec![(1, WcOpcode::Send, WcStatus::RemInvReqErr)]);
}

#[test]
fn send_without_a_posted_recv_ends_in_rnr_retry_exceeded() {
    let p = pair();
    p.fabric.set_faults(Faults { rnr_retry: 3, ..Faults::default() });
    p.a.nic.post_send(p.a.qp, &[SendWr::Send { wr_id: 1, signaled: true, sge: SgeList::new() }]).unwrap();
    let (a, _) = p.settle();
    assert_eq!(st(&a), vec![(1, WcOpcode::Send, WcStatus::RnrRetryExcErr)]);
    assert_eq!(p.a.state(), QpState::Err);
    assert_eq!(p.fabric.qp_counters(p.a.addr).unwrap().rnr_naks, 4);
    assert_eq!(p.b.state(), QpState::Rts);
}

#[test]
fn a_recv_posted_during_rnr_retries_receives_the_send_in_order() {
    let p = pair();
    p.fabric.set_progress(Progress::Manual);
    let rbuf = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sbuf = p.a.nic.reg_mr(64, Access::NONE).unwrap();
    p.a.nic.write_mr(sbuf.id, 0, b"ab").unwrap();
    let s = |id, off| SendWr::Send {
        wr_id: id,
        signaled: true,
        sge: SgeList::from([Sge { mr: sbuf.id, offset: off, len: 1 }]),
    };
    p.a.nic.post_send(p.a.qp, &[s(1, 0), s(2, 1)]).unwrap();
    while p.fabric.qp_counters(p.a.addr).unwrap().rnr_naks == 0 {
        assert!(p.fabric.step());
    }
    p.b.nic.post_recv(p.b.qp, 10, Sge { mr: rbuf.id, offset: 0, len: 1 }).unwrap();
    p.b.nic.post_recv(p.b.qp, 11, Sge { mr: rbuf.id, offset: 1, len: 1 }).unwrap();
    let (a, b) = p.settle();
    assert_eq!(st(&a), vec![(1, WcOpcode::Send, WcStatus::Success), (2, WcOpcode::Send, WcStatus::Success)]);
    assert_eq!(
        st(&b),
        vec![(10, WcOpcode::Recv, WcStatus::Success), (11, WcOpcode::Recv, WcStatus::Success)]
    );
    let mut out = [0u8; 2];
    p.b.nic.read_mr(rbuf.id, 0, &mut out).unwrap();
    assert_eq!(&out, b"ab");
}

#[test]
fn unsignaled_successes_produce_no_completion_and_order_is_kept() {
    let p = pair();
    let src = p.a.nic.reg_mr(4096, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let wrs: Vec<SendWr> = (0..20)
        .map(|i| read(i, i % 3 == 0, dst.id, i as usize * 100, 100, src.addr + i * 10, src.rkey))
        .collect();
    p.b.nic.post_send(p.b.qp, &wrs).unwrap();
    let (_, b) = p.settle();
    let ids: Vec<u64> = b.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (0..20).filter(|i| i % 3 == 0).collect::<Vec<_>>());
    assert!(b.iter().all(|c| c.status == WcStatus::Success));
}

#[test]
fn forcing_err_flushes_every_outstanding_request_with_its_opcode() {
    let p = pair();
    p.fabric.set_progress(Progress::Manual);
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_recv(p.b.qp, 20, Sge { mr: dst.id, offset: 0, len: 8 }).unwrap();
    p.b.nic.post_recv(p.b.qp, 21, Sge { mr: dst.id, offset: 8, len: 8 }).unwrap();
    p.b.nic
        .post_send(
            p.b.qp,
            &[
                read(1, true, dst.id, 16, 8, src.addr, src.rkey),
                read(2, false, dst.id, 24, 8, src.addr, src.rkey),
            ],
        )
        .unwrap();
    p.b.nic.set_qp_error(p.b.qp).unwrap();
    assert_eq!(p.b.state(), QpState::Err);
    let (_, b) = p.settle();
    assert_eq!(
        st(&b),
        vec![
            (1, WcOpcode::RdmaRead, WcStatus::WrFlushErr),
            (2, WcOpcode::RdmaRead, WcStatus::WrFlushErr),
            (20, WcOpcode::Recv, WcStatus::WrFlushErr),
            (21, WcOpcode::Recv, WcStatus::WrFlushErr),
        ]
    );
    let mut out = [0u8; 32];
    p.b.nic.read_mr(dst.id, 0, &mut out).unwrap();
    assert_eq!(out, [0; 32], "no DMA after the flush");
    // Work posted in ERR is flushed at once.
    p.b.nic.post_send(p.b.qp, &[read(3, true, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    let (_, b) = p.settle();
    assert_eq!(st(&b), vec![(3, WcOpcode::RdmaRead, WcStatus::WrFlushErr)]);
    assert_eq!(p.fabric.qp_counters(p.b.addr).unwrap().flushed, 5);
}

#[test]
fn a_read_sees_memory_as_the_responder_processed_it() {
    let p = pair();
    p.fabric.set_progress(Progress::Manual);
    let src = p.a.nic.reg_mr(8, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(16, Access::LOCAL_WRITE).unwrap();
    p.a.nic.write_mr(src.id, 0, b"old-data").unwrap();
    // An overwrite before the responder runs is seen...
    p.b.nic.post_send(p.b.qp, &[read(1, true, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    p.a.nic.write_mr(src.id, 0, b"new-data").unwrap();
    p.settle();
    // ...one after the responder copied the bytes is not (a stale read).
    p.b.nic.post_send(p.b.qp, &[read(2, true, dst.id, 8, 8, src.addr, src.rkey)]).unwrap();
    while !p.fabric.in_flight().iter().any(|r| r.source.is_some()) {
        assert!(p.fabric.step());
    }
    p.a.nic.write_mr(src.id, 0, b"3rd-data").unwrap();
    p.settle();
    let mut out = [0u8; 16];
    p.b.nic.read_mr(dst.id, 0, &mut out).unwrap();
    assert_eq!(&out, b"new-datanew-data");
}

#[test]
fn rkeys_do_not_cross_protection_domains() {
    let f = Fabric::with_seed(4);
    let a = f.add_device(DeviceConfig::spec());
    let b = f.add_device(DeviceConfig::spec());
    let a_other_pd = a.new_pd().unwrap();
    let src = a_other_pd.reg_mr(64, Access::REMOTE_READ).unwrap();
    let ea = End::new(&a).unwrap();
    let eb = End::new(&b).unwrap();
    End::connect(&ea, &eb).unwrap();
    let dst = b.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    assert!(matches!(a.write_mr(src.id, 0, b"x"), Err(NicError::NoSuchObject { .. })), "objects are per PD");
    b.post_send(eb.qp, &[read(1, true, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    f.run_until_idle();
    assert_eq!(st(&eb.poll()), vec![(1, WcOpcode::RdmaRead, WcStatus::RemAccessErr)]);
}

#[test]
fn posting_checks_ranges_state_and_depth() {
    let f = Fabric::with_seed(5);
    let a = f.add_device(DeviceConfig::spec());
    let e = End::new(&a).unwrap();
    let mr = a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let bad = Sge { mr: mr.id, offset: 60, len: 8 };
    assert!(matches!(a.post_recv(e.qp, 1, bad), Err(NicError::OutOfRange { .. })));
    let send = SendWr::Send { wr_id: 1, signaled: true, sge: SgeList::new() };
    assert!(
        matches!(a.post_send(e.qp, std::slice::from_ref(&send)), Err(NicError::BadQpState { .. })),
        "INIT cannot send"
    );
    let b = f.add_device(DeviceConfig::spec());
    let e2 = End::new(&b).unwrap();
    End::connect(&e, &e2).unwrap();
    let too_many = vec![send; 129];
    assert!(matches!(a.post_send(e.qp, &too_many), Err(NicError::QueueFull { .. })));
    assert!(matches!(a.write_mr(mr.id, 63, b"ab"), Err(NicError::OutOfRange { .. })));
    assert!(a.reg_mr(8, Access::REMOTE_WRITE).is_err(), "REMOTE_WRITE needs LOCAL_WRITE");
    assert!(matches!(a.destroy_cq(e.cq), Err(NicError::Os { .. })), "a CQ in use cannot be destroyed");
    a.destroy_qp(e.qp).unwrap();
    a.destroy_cq(e.cq).unwrap();
}

#[test]
fn a_read_into_a_region_deregistered_meanwhile_is_a_hazard() {
    let p = pair();
    p.fabric.set_progress(Progress::Manual);
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(1, true, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    p.fabric.run_for(std::time::Duration::from_nanos(300));
    p.b.nic.dereg_mr(dst.id).unwrap();
    let (_, b) = p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::LocProtErr)]);
    let h = p.fabric.hazards();
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].kind, mwcap::sim::HazardKind::DmaIntoFreedMemory);
}
