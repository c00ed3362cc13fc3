//! The oracle (exposure, in-flight READs, counters), progress modes and determinism.

use mwcap::backend::NicOps;
use std::time::Duration;

use mwcap::backend::{rkey, Access, Completion, Nic, SendWr, Sge, SgeList, WcStatus};
use mwcap::sim::{
    DeviceConfig, End, Fabric, FabricConfig, Faults, Pair, Progress, ReadPhase, TraceEntry, Via,
};

fn read(wr_id: u64, dst: mwcap::backend::MrId, off: usize, len: u32, addr: u64, rkey: u32) -> SendWr {
    SendWr::Read {
        wr_id,
        signaled: true,
        local: SgeList::from([Sge { mr: dst, offset: off, len }]),
        remote_addr: addr,
        rkey,
    }
}

#[test]
fn exposure_follows_binds_scopes_and_invalidations() {
    for rxe in [false, true] {
        let dev = if rxe { DeviceConfig::rxe() } else { DeviceConfig::spec() };
        let f = Fabric::with_seed(11);
        let p = Pair::new(&f, dev.clone(), dev).unwrap();
        let mr = p.a.nic.reg_mr(1000, Access::MW_BIND).unwrap();
        let pub_mr = p.a.nic.reg_mr(50, Access::REMOTE_READ).unwrap();
        let mw = p.a.nic.alloc_mw().unwrap();
        // Only the public region is reachable before any bind.
        let e = f.exposure(p.a.device(), p.b.addr);
        assert_eq!(e.len(), 1);
        assert_eq!(
            (e[0].mr, e[0].bytes.clone(), e[0].via, e[0].rkey),
            (pub_mr.id, 0..50, Via::Region, pub_mr.rkey)
        );

        let rk = rkey::rebind(mw.rkey, 0x42);
        let bind = SendWr::BindMw {
            wr_id: 1,
            signaled: false,
            mw: mw.id,
            rkey: rk,
            mr: mr.id,
            offset: 100,
            len: 200,
            access: Access::REMOTE_READ,
        };
        p.a.nic.post_send(p.a.qp, &[bind]).unwrap();
        p.settle();
        let win: Vec<_> =
            f.exposure(p.a.device(), p.b.addr).into_iter().filter(|e| e.via == Via::Window(mw.id)).collect();
        assert_eq!(win.len(), 1);
        let expect = if rxe { 0..1000 } else { 100..300 };
        assert_eq!(
            (win[0].mr, win[0].bytes.clone(), win[0].rkey, win[0].through),
            (mr.id, expect, rk, p.a.addr)
        );
        assert!(f.can_reach(p.b.addr, p.a.device(), mr.id, 150..160));
        assert_eq!(f.can_reach(p.b.addr, p.a.device(), mr.id, 0..100), rxe, "outside the window only on rxe");

        // Another connection of the same PDs reaches the public region, not the window.
        let a2 = End::new(&p.a.nic).unwrap();
        let b2 = End::new(&p.b.nic).unwrap();
        End::connect(&a2, &b2).unwrap();
        assert!(!f.can_reach(b2.addr, p.a.device(), mr.id, 0..1000));
        assert!(f.can_reach(b2.addr, p.a.device(), pub_mr.id, 0..1));

        p.a.nic.post_send(p.a.qp, &[SendWr::LocalInv { wr_id: 2, signaled: false, rkey: rk }]).unwrap();
        p.settle();
        assert!(!f.can_reach(p.b.addr, p.a.device(), mr.id, 0..1000), "invalidated");
        p.b.nic.set_qp_error(p.b.qp).unwrap();
        assert!(f.exposure(p.a.device(), p.b.addr).is_empty(), "a remote QP in ERR reaches nothing");
    }
}

#[test]
fn in_flight_reads_move_from_requested_to_responding_to_done() {
    let f = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(2) });
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(9, dst.id, 8, 16, src.addr + 4, src.rkey)]).unwrap();
    assert!(f.in_flight().is_empty(), "not issued yet");
    let mut phases = Vec::new();
    while f.step() {
        if let Some(r) = f.in_flight().first() {
            if phases.last() != Some(&r.phase) {
                phases.push(r.phase);
            }
            assert_eq!((r.wr_id, r.requester, r.len), (9, p.b.addr, 16));
            if let Some(s) = &r.source {
                assert_eq!((s.responder, s.mr, s.bytes.clone(), s.window), (p.a.addr, src.id, 4..20, None));
            }
        }
    }
    assert_eq!(phases.len(), 2);
    assert_eq!(phases[0], ReadPhase::Requested);
    // post 200 ns + wire 1000 ns + responder 300 ns
    assert_eq!(phases[1], ReadPhase::Responding { since: Duration::from_nanos(1500) });
    assert!(f.in_flight().is_empty());
    assert_eq!(p.b.poll()[0].status, WcStatus::Success);
}

#[test]
fn auto_progress_lets_nic_only_code_wait_for_completions() {
    // Written against the trait only: no fabric calls.
    fn wait_one(nic: &dyn Nic, cq: mwcap::backend::CqId) -> (Completion, usize) {
        for polls in 1..10_000 {
            if let Some(c) = nic.poll_cq_vec(cq, 1).unwrap().pop() {
                return (c, polls);
            }
        }
        panic!("no completion");
    }
    let f = Fabric::with_seed(3);
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(1, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    let (c, polls) = wait_one(&p.b.nic, p.b.cq);
    assert_eq!(c.status, WcStatus::Success);
    assert!(polls <= 10, "each empty poll advances to the next event ({polls} polls)");
    // Nothing pending: polling an empty queue returns at once, empty.
    f.run_until_idle();
    assert!(p.b.nic.poll_cq_vec(p.b.cq, 8).unwrap().is_empty());
}

#[test]
fn manual_progress_moves_only_when_told() {
    let f = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(3) });
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(1, dst.id, 0, 8, src.addr, src.rkey)]).unwrap();
    for _ in 0..100 {
        assert!(p.b.nic.poll_cq_vec(p.b.cq, 8).unwrap().is_empty());
    }
    assert_eq!(f.now(), Duration::ZERO);
    assert_eq!(f.next_event_at(), Some(Duration::from_nanos(200)));
    f.run_until(Duration::from_nanos(1000));
    assert_eq!(f.now(), Duration::from_nanos(1000));
    assert!(p.b.nic.poll_cq_vec(p.b.cq, 8).unwrap().is_empty());
    f.run_until_idle();
    assert_eq!(p.b.nic.poll_cq_vec(p.b.cq, 8).unwrap().len(), 1);
    assert_eq!(f.pending_events(), 0);
}

/// Many READs and SENDs over two connections with jitter.
fn workload(seed: u64) -> (Vec<TraceEntry>, Vec<Completion>) {
    let faults = Faults { jitter: Duration::from_nanos(700), ..Faults::default() };
    let f = Fabric::new(FabricConfig { faults, record_trace: true, ..FabricConfig::with_seed(seed) });
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let a2 = End::new(&p.a.nic).unwrap();
    let b2 = End::new(&p.b.nic).unwrap();
    End::connect(&a2, &b2).unwrap();
    let src = p.a.nic.reg_mr(4096, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    for i in 0..8u64 {
        let rbuf = p.a.nic.reg_mr(16, Access::LOCAL_WRITE).unwrap();
        p.a.nic.post_recv(p.a.qp, 100 + i, Sge { mr: rbuf.id, offset: 0, len: 16 }).unwrap();
        p.b.nic
            .post_send(p.b.qp, &[read(i, dst.id, i as usize * 64, 64, src.addr + i * 64, src.rkey)])
            .unwrap();
        b2.nic
            .post_send(b2.qp, &[read(50 + i, dst.id, 2048 + i as usize * 64, 64, src.addr, src.rkey)])
            .unwrap();
        p.b.nic
            .post_send(p.b.qp, &[SendWr::Send { wr_id: 200 + i, signaled: true, sge: SgeList::new() }])
            .unwrap();
    }
    let mut all = Vec::new();
    for _ in 0..1000 {
        for e in [&p.a, &p.b, &b2] {
            all.extend(e.nic.poll_cq_vec(e.cq, 4).unwrap());
        }
    }
    (f.trace(), all)
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    let (t1, c1) = workload(99);
    let (t2, c2) = workload(99);
    assert_eq!(c1.len(), 8 * 3 + 8, "every READ, SEND and RECV completed");
    assert!(c1.iter().all(|c| c.status == WcStatus::Success), "{c1:?}");
    assert!(t1.len() > 50);
    assert_eq!(t1, t2);
    assert_eq!(c1, c2);
    assert_ne!(workload(100).0, t1, "the seed drives jitter and tie-breaks");
}

#[test]
fn a_dma_into_or_a_forbidden_read_of_cpu_held_memory_is_a_hazard() {
    use mwcap::sim::HazardKind;
    let f = Fabric::with_seed(5);
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    // a's region is public; b READs it into its own region.
    let src = p.a.nic.reg_mr(256, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(256, Access::LOCAL_WRITE).unwrap();
    let (src_mem, dst_mem) = (p.a.nic.memory(src.id).unwrap(), p.b.nic.memory(dst.id).unwrap());
    // Holding other bytes is fine: nothing happens.
    let _other = dst_mem.hold(128, 64).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(1, dst.id, 0, 64, src.addr, src.rkey)]).unwrap();
    p.settle();
    assert!(f.hazards().is_empty(), "{:?}", f.hazards());
    // A READ into bytes a handle holds would change them under its user.
    p.b.nic.post_send(p.b.qp, &[read(2, dst.id, 150, 8, src.addr, src.rkey)]).unwrap();
    p.settle();
    let h = f.hazards();
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].kind, HazardKind::DmaIntoHeldBuffer);
    // A remote READ of held bytes is a hazard unless the memory expects it
    // (confirm); the reader gets POISON in their place.
    let held = src_mem.hold(0, 32).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(3, dst.id, 0, 16, src.addr, src.rkey)]).unwrap();
    p.settle();
    let h = f.hazards();
    assert_eq!(h.len(), 2, "{h:?}");
    assert_eq!(h[1].kind, HazardKind::RemoteReadOfHeldBuffer);
    let mut seen = [0u8; 16];
    dst_mem.read(0, &mut seen).unwrap();
    assert_eq!(seen, [mwcap::backend::POISON; 16]);
    src_mem.expect_reads_of_held();
    p.b.nic.post_send(p.b.qp, &[read(4, dst.id, 0, 16, src.addr, src.rkey)]).unwrap();
    p.settle();
    assert_eq!(f.hazards().len(), 2);
    // Released: no more hazards, and the bytes are the region's again.
    drop(held);
    src_mem.write(0, &[7; 16]).unwrap();
    p.b.nic.post_send(p.b.qp, &[read(5, dst.id, 0, 16, src.addr, src.rkey)]).unwrap();
    p.settle();
    assert_eq!(f.hazards().len(), 2);
    dst_mem.read(0, &mut seen).unwrap();
    assert_eq!(seen, [7; 16]);
}

/// Memory a confirm connection exposes expects READs of held bytes through
/// its region's key (the reader discards them); a READ through a memory
/// window over held bytes is a hazard all the same, since under mw a window
/// never covers a buffer a user holds. (An endpoint's shared pool serving
/// both policies is such memory: without this an mw connection's window
/// reads of held pool buffers went unreported there.)
#[test]
fn a_window_read_of_held_bytes_is_a_hazard_even_where_confirm_reads_are_expected() {
    use mwcap::sim::HazardKind;
    let f = Fabric::with_seed(6);
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let src = p.a.nic.reg_mr(256, Access::REMOTE_READ | Access::MW_BIND).unwrap();
    let dst = p.b.nic.reg_mr(256, Access::LOCAL_WRITE).unwrap();
    let src_mem = p.a.nic.memory(src.id).unwrap();
    src_mem.expect_reads_of_held();
    let mw = p.a.nic.alloc_mw().unwrap();
    let rk = rkey::rebind(mw.rkey, 1);
    let bind = SendWr::BindMw {
        wr_id: 1,
        signaled: true,
        mw: mw.id,
        rkey: rk,
        mr: src.id,
        offset: 0,
        len: 64,
        access: Access::REMOTE_READ,
    };
    p.a.nic.post_send(p.a.qp, &[bind]).unwrap();
    p.settle();
    let _held = src_mem.hold(0, 32).unwrap();
    // Through the region's key: expected (confirm), not reported.
    p.b.nic.post_send(p.b.qp, &[read(2, dst.id, 0, 16, src.addr, src.rkey)]).unwrap();
    p.settle();
    assert!(f.hazards().is_empty(), "{:?}", f.hazards());
    // Through the window over the same bytes: reported.
    p.b.nic.post_send(p.b.qp, &[read(3, dst.id, 0, 16, src.addr, rk)]).unwrap();
    p.settle();
    let h = f.hazards();
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].kind, HazardKind::RemoteReadOfHeldBuffer);
    assert!(h[0].detail.contains("through a memory window"), "{h:?}");
}

/// A READ flushed after its request went out may still land: its
/// destination is written over (with `LATE_BYTE`) just before its flush
/// completion shows, the latest a NIC may. Memory a user took back before
/// that completion is a hazard; after it, or once the QP is destroyed,
/// nothing lands. A READ flushed before it was issued writes nothing.
#[test]
fn a_read_flushed_in_flight_lands_late_until_its_completion_shows() {
    use mwcap::sim::{HazardKind, LATE_BYTE};
    let run = |take_back_early: bool, destroy: bool| {
        let f = Fabric::with_seed(7);
        let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
        f.set_progress(Progress::Manual);
        let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
        let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let dst_mem = p.b.nic.memory(dst.id).unwrap();
        p.b.nic.post_send(p.b.qp, &[read(1, dst.id, 0, 16, src.addr, src.rkey)]).unwrap();
        // The request is on the wire, its response not back.
        f.run_for(Duration::from_nanos(300));
        p.b.nic.set_qp_error(p.b.qp).unwrap();
        let held = take_back_early.then(|| dst_mem.hold(0, 16).unwrap());
        if destroy {
            p.b.nic.destroy_qp(p.b.qp).unwrap();
        }
        f.run_for(Duration::from_millis(1));
        let cqes = if destroy { vec![] } else { p.b.nic.poll_cq_vec(p.b.cq, 4).unwrap() };
        drop(held);
        let mut bytes = [0u8; 16];
        dst_mem.read(0, &mut bytes).unwrap();
        (f.hazards(), cqes.len(), cqes.first().map(|c| c.status), bytes)
    };
    // Taken back only after the flush: no hazard, the late bytes are there.
    let (h, n, status, bytes) = run(false, false);
    assert!(h.is_empty(), "{h:?}");
    assert_eq!((n, status), (1, Some(WcStatus::WrFlushErr)));
    assert_eq!(bytes, [LATE_BYTE; 16]);
    // Taken back before it: the late landing is caught.
    let (h, _, _, _) = run(true, false);
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].kind, HazardKind::DmaIntoHeldBuffer);
    // The QP destroyed: its completions are gone, and nothing lands.
    let (h, _, _, bytes) = run(true, true);
    assert!(h.is_empty(), "{h:?}");
    assert_eq!(bytes, [0; 16]);
}

/// A SEND's memory must keep the bytes the NIC read until the SEND ends: a
/// retransmission reads them again. Writing them while it is in flight is
/// a hazard (the peer still gets the first bytes); after its completion,
/// nothing is.
#[test]
fn a_send_buffer_changed_while_in_flight_is_a_hazard() {
    use mwcap::sim::HazardKind;
    let run = |write_early: bool| {
        let f = Fabric::with_seed(8);
        let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
        f.set_progress(Progress::Manual);
        let src = p.a.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        p.a.nic.write_mr(src.id, 0, b"first bytes").unwrap();
        p.b.nic.post_recv(p.b.qp, 9, Sge { mr: dst.id, offset: 0, len: 64 }).unwrap();
        let sge = SgeList::from([Sge { mr: src.id, offset: 0, len: 11 }]);
        p.a.nic.post_send(p.a.qp, &[SendWr::Send { wr_id: 1, signaled: true, sge }]).unwrap();
        f.run_for(Duration::from_nanos(300));
        if write_early {
            p.a.nic.write_mr(src.id, 0, b"other bytes").unwrap();
        }
        f.run_for(Duration::from_millis(1));
        let done = p.a.nic.poll_cq_vec(p.a.cq, 4).unwrap();
        assert_eq!(done.iter().map(|c| c.status).collect::<Vec<_>>(), [WcStatus::Success]);
        p.a.nic.write_mr(src.id, 0, b"later bytes").unwrap();
        let mut got = [0u8; 11];
        p.b.nic.memory(dst.id).unwrap().read(0, &mut got).unwrap();
        assert_eq!(&got, b"first bytes");
        f.hazards()
    };
    assert!(run(false).is_empty(), "reused after its completion: no hazard");
    let h = run(true);
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].kind, HazardKind::SendBufferChanged);
}

/// A READ's response has landed, but until its completion shows another
/// (retransmitted) response may land again: a destination lent to a buffer
/// handle in between is `DmaIntoHeldBuffer`. Taken after the completion,
/// it is not.
#[test]
fn a_read_destination_taken_before_its_completion_shows_is_a_hazard() {
    use mwcap::sim::HazardKind;
    let run = |before_completion: bool| {
        let f = Fabric::with_seed(9);
        let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
        f.set_progress(Progress::Manual);
        let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
        p.a.nic.memory(src.id).unwrap().write(0, &[9; 16]).unwrap();
        let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let dst_mem = p.b.nic.memory(dst.id).unwrap();
        p.b.nic.post_send(p.b.qp, &[read(1, dst.id, 0, 16, src.addr, src.rkey)]).unwrap();
        // Step until the response has landed.
        let mut bytes = [0u8; 16];
        for _ in 0..10_000 {
            dst_mem.read(0, &mut bytes).unwrap();
            if bytes == [9; 16] {
                break;
            }
            f.run_for(Duration::from_nanos(10));
        }
        assert_eq!(bytes, [9; 16], "the response landed");
        let early = p.b.nic.poll_cq_vec(p.b.cq, 4).unwrap();
        assert!(early.is_empty(), "its completion has not shown yet: {early:?}");
        let held = before_completion.then(|| dst_mem.hold(0, 16).unwrap());
        f.run_for(Duration::from_millis(1));
        let cqes = p.b.nic.poll_cq_vec(p.b.cq, 4).unwrap();
        assert_eq!(cqes.len(), 1);
        assert_eq!(cqes[0].status, WcStatus::Success);
        let after = (!before_completion).then(|| dst_mem.hold(0, 16).unwrap());
        f.run_for(Duration::from_millis(1));
        drop((held, after));
        f.hazards()
    };
    let h = run(true);
    assert_eq!(h.len(), 1, "{h:?}");
    assert_eq!(h[0].kind, HazardKind::DmaIntoHeldBuffer);
    assert!(run(false).is_empty());
}
