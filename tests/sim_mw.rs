//! The type-2 window rows of rdma-facts.md's behaviour table, in spec form
//! (and the rxe deviations where the sim models them).

use mwcap::backend::NicOps;
use mwcap::backend::{
    rkey, Access, Completion, MrInfo, MwInfo, NicError, QpState, SendWr, Sge, SgeList, WcOpcode, WcStatus,
};
use mwcap::sim::{DeviceConfig, End, Fabric, FabricConfig, HazardKind, Pair, SimNic, WindowState};

struct Setup {
    p: Pair,
    /// Owner's region (MW_BIND | LOCAL_WRITE), 4096 bytes of a pattern.
    mr: MrInfo,
    mw: MwInfo,
    /// Reader's READ destination.
    dst: MrInfo,
    /// Owner's SEND source and reader's RECV buffer.
    sbuf: MrInfo,
    rbuf: MrInfo,
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + 3) as u8).collect()
}

fn setup(dev: DeviceConfig) -> Setup {
    let f = Fabric::new(FabricConfig { record_trace: true, ..FabricConfig::with_seed(7) });
    let p = Pair::new(&f, dev.clone(), dev).unwrap();
    let mr = p.a.nic.reg_mr(4096, Access::MW_BIND | Access::LOCAL_WRITE).unwrap();
    p.a.nic.write_mr(mr.id, 0, &pattern(4096)).unwrap();
    let mw = p.a.nic.alloc_mw().unwrap();
    let dst = p.b.nic.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let sbuf = p.a.nic.reg_mr(64, Access::NONE).unwrap();
    let rbuf = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    Setup { p, mr, mw, dst, sbuf, rbuf }
}

fn bind(s: &Setup, rkey: u32, offset: usize, len: usize, access: Access, signaled: bool) -> SendWr {
    SendWr::BindMw { wr_id: 1, signaled, mw: s.mw.id, rkey, mr: s.mr.id, offset, len, access }
}

fn send(s: &Setup, wr_id: u64) -> SendWr {
    SendWr::Send { wr_id, signaled: true, sge: SgeList::from([Sge { mr: s.sbuf.id, offset: 0, len: 8 }]) }
}

fn read(s: &Setup, wr_id: u64, addr: u64, len: u32, rkey: u32) -> SendWr {
    SendWr::Read {
        wr_id,
        signaled: true,
        local: SgeList::from([Sge { mr: s.dst.id, offset: 0, len }]),
        remote_addr: addr,
        rkey,
    }
}

fn recv(s: &Setup, wr_id: u64) {
    s.p.b.nic.post_recv(s.p.b.qp, wr_id, Sge { mr: s.rbuf.id, offset: 0, len: 64 }).unwrap();
}

fn statuses(v: &[Completion]) -> Vec<(u64, WcOpcode, WcStatus)> {
    v.iter().map(|c| (c.wr_id, c.opcode, c.status)).collect()
}

/// Bind [256, 256+512) readable, chained with a SEND; returns the new rkey.
fn bind_and_send(s: &Setup) -> u32 {
    recv(s, 900);
    let rk = rkey::rebind(s.mw.rkey, 0x5a);
    s.p.a.nic.post_send(s.p.a.qp, &[bind(s, rk, 256, 512, Access::REMOTE_READ, false), send(s, 2)]).unwrap();
    let (a, b) = s.p.settle();
    assert_eq!(statuses(&a), vec![(2, WcOpcode::Send, WcStatus::Success)]);
    assert_eq!(statuses(&b), vec![(900, WcOpcode::Recv, WcStatus::Success)]);
    rk
}

fn read_one(s: &Setup, addr: u64, len: u32, rk: u32) -> Completion {
    s.p.b.nic.post_send(s.p.b.qp, &[read(s, 3, addr, len, rk)]).unwrap();
    let (_, b) = s.p.settle();
    assert_eq!(b.len(), 1, "{b:?}");
    b[0]
}

fn dst_bytes(s: &Setup, n: usize) -> Vec<u8> {
    let mut out = vec![0; n];
    s.p.b.nic.read_mr(s.dst.id, 0, &mut out).unwrap();
    out
}

#[test]
fn bind_chained_before_send_then_read_inside_the_window() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    let c = read_one(&s, s.mr.addr + 300, 100, rk);
    assert_eq!((c.opcode, c.status, c.byte_len), (WcOpcode::RdmaRead, WcStatus::Success, 100));
    assert_eq!(dst_bytes(&s, 100), pattern(4096)[300..400].to_vec());
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Rts, QpState::Rts));
}

#[test]
fn signaled_bind_completes_before_the_send() {
    let s = setup(DeviceConfig::spec());
    recv(&s, 900);
    let rk = rkey::rebind(s.mw.rkey, 1);
    s.p.a.nic.post_send(s.p.a.qp, &[bind(&s, rk, 0, 64, Access::REMOTE_READ, true), send(&s, 2)]).unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(
        statuses(&a),
        vec![(1, WcOpcode::BindMw, WcStatus::Success), (2, WcOpcode::Send, WcStatus::Success)]
    );
}

#[test]
fn a_region_without_remote_rights_rejects_its_own_rkey() {
    let s = setup(DeviceConfig::spec());
    let c = read_one(&s, s.mr.addr, 16, s.mr.rkey);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Err, QpState::Err));
    assert_eq!(s.p.fabric.qp_counters(s.p.a.addr).unwrap().resp_remote_access_errors, 1);
}

#[test]
fn a_writable_window_needs_local_write_on_the_region() {
    let f = Fabric::with_seed(1);
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let mr = p.a.nic.reg_mr(128, Access::MW_BIND).unwrap();
    let mw = p.a.nic.alloc_mw().unwrap();
    let rk = rkey::rebind(mw.rkey, 9);
    let wr = |access| SendWr::BindMw {
        wr_id: 1,
        signaled: true,
        mw: mw.id,
        rkey: rk,
        mr: mr.id,
        offset: 0,
        len: 64,
        access,
    };
    p.a.nic.post_send(p.a.qp, &[wr(Access::REMOTE_READ)]).unwrap();
    let (a, _) = p.settle();
    assert_eq!(a[0].status, WcStatus::Success, "a read-only window needs nothing but MW_BIND");
    p.a.nic.post_send(p.a.qp, &[SendWr::LocalInv { wr_id: 5, signaled: false, rkey: rk }]).unwrap();
    let rk2 = rkey::rebind(rk, 10);
    let wr2 = SendWr::BindMw {
        wr_id: 1,
        signaled: true,
        mw: mw.id,
        rkey: rk2,
        mr: mr.id,
        offset: 0,
        len: 64,
        access: Access::REMOTE_READ | Access::REMOTE_WRITE,
    };
    p.a.nic.post_send(p.a.qp, &[wr2]).unwrap();
    let (a, _) = p.settle();
    assert_eq!(statuses(&a), vec![(1, WcOpcode::BindMw, WcStatus::MwBindErr)]);
    assert_eq!(p.a.state(), QpState::Err);
}

fn bind_error_case(make: impl Fn(&Setup) -> Vec<SendWr>, prepare: impl Fn(&Setup)) {
    let s = setup(DeviceConfig::spec());
    prepare(&s);
    recv(&s, 900);
    let mut wrs = make(&s);
    wrs.push(send(&s, 2));
    s.p.a.nic.post_send(s.p.a.qp, &wrs).unwrap();
    let (a, b) = s.p.settle();
    let last = statuses(&a).into_iter().rev().take(2).collect::<Vec<_>>();
    assert_eq!(
        last,
        vec![(2, WcOpcode::Send, WcStatus::WrFlushErr), (1, WcOpcode::BindMw, WcStatus::MwBindErr)]
    );
    assert_eq!(s.p.a.state(), QpState::Err, "the binding QP goes to ERR");
    assert_eq!(s.p.b.state(), QpState::Rts, "the peer is unaffected");
    assert!(b.is_empty(), "nothing reached the peer: {b:?}");
}

#[test]
fn bind_without_mw_bind_on_the_region() {
    bind_error_case(
        |s| {
            let plain = s.p.a.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
            let rk = rkey::rebind(s.mw.rkey, 3);
            vec![SendWr::BindMw {
                wr_id: 1,
                signaled: false,
                mw: s.mw.id,
                rkey: rk,
                mr: plain.id,
                offset: 0,
                len: 64,
                access: Access::REMOTE_READ,
            }]
        },
        |_| {},
    );
}

#[test]
fn bind_past_the_region_end_is_refused_at_post_time() {
    // A NIC answers MW_BIND_ERR and kills the binding QP (rdma-facts.md);
    // the backend contract checks the range first, as the verbs backend does.
    let s = setup(DeviceConfig::spec());
    let wrs = vec![bind(&s, rkey::rebind(s.mw.rkey, 3), 4000, 200, Access::REMOTE_READ, false), send(&s, 2)];
    let err = s.p.a.nic.post_send(s.p.a.qp, &wrs).unwrap_err();
    assert!(matches!(err, NicError::OutOfRange { offset: 4000, end: 4200, .. }), "{err:?}");
    let (a, b) = s.p.settle();
    assert!(a.is_empty() && b.is_empty(), "nothing was posted");
    assert_eq!(s.p.a.state(), QpState::Rts);
}

#[test]
fn bind_of_zero_length() {
    bind_error_case(|s| vec![bind(s, rkey::rebind(s.mw.rkey, 3), 0, 0, Access::REMOTE_READ, false)], |_| {});
}

#[test]
fn bind_with_another_windows_index_bits() {
    bind_error_case(|s| vec![bind(s, s.mw.rkey ^ 0x100, 0, 64, Access::REMOTE_READ, false)], |_| {});
}

#[test]
fn rebinding_a_still_bound_window() {
    bind_error_case(
        |s| vec![bind(s, rkey::rebind(s.mw.rkey, 4), 0, 64, Access::REMOTE_READ, false)],
        |s| {
            s.p.a
                .nic
                .post_send(
                    s.p.a.qp,
                    &[bind(s, rkey::rebind(s.mw.rkey, 3), 0, 64, Access::REMOTE_READ, false)],
                )
                .unwrap();
            s.p.settle();
        },
    );
}

#[test]
fn read_outside_the_window_inside_the_region_fails_per_spec() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    let c = read_one(&s, s.mr.addr + 200, 100, rk);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Err, QpState::Err));
}

#[test]
fn read_outside_the_window_inside_the_region_succeeds_on_rxe() {
    let s = setup(DeviceConfig::rxe());
    let rk = bind_and_send(&s);
    let c = read_one(&s, s.mr.addr + 200, 100, rk);
    assert_eq!(c.status, WcStatus::Success, "rxe checks only the region's bounds");
    assert_eq!(dst_bytes(&s, 100), pattern(4096)[200..300].to_vec());
}

#[test]
fn read_past_the_region_end_fails_in_both_modes() {
    for dev in [DeviceConfig::spec(), DeviceConfig::rxe()] {
        let s = setup(dev);
        let rk = bind_and_send(&s);
        let c = read_one(&s, s.mr.addr + 4000, 200, rk);
        assert_eq!(c.status, WcStatus::RemAccessErr);
        assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Err, QpState::Err));
    }
}

#[test]
fn read_with_the_rkey_from_before_the_bind_fails() {
    let s = setup(DeviceConfig::spec());
    bind_and_send(&s);
    let c = read_one(&s, s.mr.addr + 300, 16, s.mw.rkey);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Err, QpState::Err));
}

#[test]
fn a_window_without_remote_read_rejects_reads() {
    let s = setup(DeviceConfig::spec());
    let rk = rkey::rebind(s.mw.rkey, 8);
    s.p.a.nic.post_send(s.p.a.qp, &[bind(&s, rk, 0, 64, Access::NONE, false)]).unwrap();
    s.p.settle();
    let c = read_one(&s, s.mr.addr, 16, rk);
    assert_eq!(c.status, WcStatus::RemAccessErr);
}

#[test]
fn a_window_is_scoped_to_its_queue_pair() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    // A second connection between the same PDs.
    let a2 = End::new(&s.p.a.nic).unwrap();
    let b2 = End::new(&s.p.b.nic).unwrap();
    End::connect(&a2, &b2).unwrap();
    b2.nic.post_send(b2.qp, &[read(&s, 4, s.mr.addr + 300, 16, rk)]).unwrap();
    s.p.fabric.run_until_idle();
    assert_eq!(statuses(&b2.poll()), vec![(4, WcOpcode::RdmaRead, WcStatus::RemAccessErr)]);
    assert_eq!((a2.state(), b2.state()), (QpState::Err, QpState::Err), "the foreign pair goes to ERR");
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Rts, QpState::Rts), "the bound pair is unaffected");
    let c = read_one(&s, s.mr.addr + 300, 16, rk);
    assert_eq!(c.status, WcStatus::Success);
}

#[test]
fn local_inv_with_the_right_key_then_the_old_rkey_fails() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    s.p.a.nic.post_send(s.p.a.qp, &[SendWr::LocalInv { wr_id: 6, signaled: true, rkey: rk }]).unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(statuses(&a), vec![(6, WcOpcode::LocalInv, WcStatus::Success)]);
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Rts, QpState::Rts));
    assert_eq!(s.p.fabric.window(s.p.a.device(), s.mw.id), Some(WindowState::Invalidated { rkey: rk }));
    let c = read_one(&s, s.mr.addr + 300, 16, rk);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Err, QpState::Err));
    assert!(s.p.fabric.would_crash_rxe().is_empty());
}

#[test]
fn local_inv_with_a_wrong_key_is_a_local_qp_error() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    s.p.a
        .nic
        .post_send(s.p.a.qp, &[SendWr::LocalInv { wr_id: 6, signaled: true, rkey: rkey::inc(rk) }])
        .unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(statuses(&a), vec![(6, WcOpcode::LocalInv, WcStatus::LocQpOpErr)]);
    assert_eq!(s.p.a.state(), QpState::Err);
    assert!(matches!(s.p.fabric.window(s.p.a.device(), s.mw.id), Some(WindowState::Bound { .. })));
    assert!(s.p.fabric.would_crash_rxe().is_empty(), "a wrong key on a bound window is not the crash case");
}

#[test]
fn send_with_inv_invalidates_and_reports_the_rkey() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    // The reader tells the owner it is done, invalidating the window.
    let bsrc = s.p.b.nic.reg_mr(8, Access::NONE).unwrap();
    let arecv = s.p.a.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    s.p.a.nic.post_recv(s.p.a.qp, 77, Sge { mr: arecv.id, offset: 0, len: 64 }).unwrap();
    let wr = SendWr::SendWithInv {
        wr_id: 8,
        signaled: true,
        sge: SgeList::from([Sge { mr: bsrc.id, offset: 0, len: 8 }]),
        invalidate_rkey: rk,
    };
    s.p.b.nic.post_send(s.p.b.qp, &[wr]).unwrap();
    let (a, b) = s.p.settle();
    assert_eq!(statuses(&b), vec![(8, WcOpcode::Send, WcStatus::Success)]);
    assert_eq!(a.len(), 1);
    assert_eq!(
        (a[0].opcode, a[0].status, a[0].invalidated_rkey),
        (WcOpcode::Recv, WcStatus::Success, Some(rk))
    );
    let c = read_one(&s, s.mr.addr + 300, 16, rk);
    assert_eq!(c.status, WcStatus::RemAccessErr, "the window really is invalid");
}

/// A SEND_WITH_INV naming a window bound to the QP of the pair `s`,
/// received on a second connection made through `nic_a` (the window's PD,
/// or another): returns the receive's completion.
fn send_with_inv_on_a_second_connection(s: &Setup, nic_a: &SimNic, rk: u32) -> Completion {
    let a2 = End::new(nic_a).unwrap();
    let b2 = End::new(&s.p.b.nic).unwrap();
    End::connect(&a2, &b2).unwrap();
    let arecv = nic_a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    a2.nic.post_recv(a2.qp, 77, Sge { mr: arecv.id, offset: 0, len: 64 }).unwrap();
    let wr = SendWr::SendWithInv { wr_id: 8, signaled: true, sge: SgeList::new(), invalidate_rkey: rk };
    b2.nic.post_send(b2.qp, &[wr]).unwrap();
    s.p.fabric.run_until_idle();
    a2.poll()[0]
}

#[test]
fn send_with_inv_on_another_queue_pair_is_refused_by_the_spec_and_obeyed_by_rxe() {
    // InfiniBand invalidates a type-2B window through a SEND_WITH_INV only
    // on the queue pair it is bound to; rxe looks the key up across the
    // device and checks neither the QP nor the PD (rdma-facts, measured by
    // `mwcap probe` in the VM).
    for other_pd in [false, true] {
        let s = setup(DeviceConfig::spec());
        let rk = bind_and_send(&s);
        let nic = if other_pd { s.p.a.nic.new_pd().unwrap() } else { s.p.a.nic.clone() };
        let c = send_with_inv_on_a_second_connection(&s, &nic, rk);
        assert_eq!(
            (c.status, c.invalidated_rkey),
            (WcStatus::RemInvReqErr, None),
            "spec, other PD {other_pd}"
        );
        assert!(
            matches!(s.p.fabric.window(s.p.a.device(), s.mw.id), Some(WindowState::Bound { .. })),
            "spec, other PD {other_pd}: the window stays bound"
        );

        let s = setup(DeviceConfig::rxe());
        let rk = bind_and_send(&s);
        let nic = if other_pd { s.p.a.nic.new_pd().unwrap() } else { s.p.a.nic.clone() };
        let c = send_with_inv_on_a_second_connection(&s, &nic, rk);
        assert_eq!((c.status, c.invalidated_rkey), (WcStatus::Success, Some(rk)), "rxe, other PD {other_pd}");
        assert_eq!(s.p.fabric.window(s.p.a.device(), s.mw.id), Some(WindowState::Invalidated { rkey: rk }));
    }
}

#[test]
fn rebind_after_invalidation_works_with_a_new_key_only() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    s.p.a.nic.post_send(s.p.a.qp, &[SendWr::LocalInv { wr_id: 6, signaled: false, rkey: rk }]).unwrap();
    let rk2 = rkey::rebind(rk, 0x77);
    s.p.a.nic.post_send(s.p.a.qp, &[bind(&s, rk2, 1024, 128, Access::REMOTE_READ, true)]).unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(statuses(&a), vec![(1, WcOpcode::BindMw, WcStatus::Success)]);
    let c = read_one(&s, s.mr.addr + 1024, 128, rk2);
    assert_eq!(c.status, WcStatus::Success);
    assert_eq!(dst_bytes(&s, 128), pattern(4096)[1024..1152].to_vec());
    let c = read_one(&s, s.mr.addr + 1024, 16, rk);
    assert_eq!(c.status, WcStatus::RemAccessErr, "the old rkey stays dead");
}

#[test]
fn the_crash_cases_are_errors_and_are_counted() {
    // LOCAL_INV of a never-bound window.
    let s = setup(DeviceConfig::spec());
    s.p.a.nic.post_send(s.p.a.qp, &[SendWr::LocalInv { wr_id: 6, signaled: true, rkey: s.mw.rkey }]).unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(statuses(&a), vec![(6, WcOpcode::LocalInv, WcStatus::LocQpOpErr)]);
    assert_eq!(s.p.fabric.would_crash_rxe().len(), 1);

    // LOCAL_INV twice.
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    let inv = |id| SendWr::LocalInv { wr_id: id, signaled: true, rkey: rk };
    s.p.a.nic.post_send(s.p.a.qp, &[inv(6), inv(7)]).unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(
        statuses(&a),
        vec![(6, WcOpcode::LocalInv, WcStatus::Success), (7, WcOpcode::LocalInv, WcStatus::LocQpOpErr)]
    );
    assert_eq!(s.p.fabric.would_crash_rxe().len(), 1);

    // SEND_WITH_INV of an already invalidated rkey (a peer can do this).
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    s.p.a.nic.post_send(s.p.a.qp, &[inv_wr(rk)]).unwrap();
    s.p.settle();
    let arecv = s.p.a.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    s.p.a.nic.post_recv(s.p.a.qp, 77, Sge { mr: arecv.id, offset: 0, len: 64 }).unwrap();
    let wr = SendWr::SendWithInv { wr_id: 8, signaled: true, sge: SgeList::new(), invalidate_rkey: rk };
    s.p.b.nic.post_send(s.p.b.qp, &[wr]).unwrap();
    let (a, b) = s.p.settle();
    assert_eq!(statuses(&a), vec![(77, WcOpcode::Recv, WcStatus::RemInvReqErr)]);
    assert_eq!(statuses(&b), vec![(8, WcOpcode::Send, WcStatus::RemInvReqErr)]);
    let crashes = s.p.fabric.would_crash_rxe();
    assert_eq!(crashes.len(), 1);
    assert!(crashes[0].detail.contains("SEND_WITH_INV"), "{crashes:?}");
}

/// A LOCAL_INV of `rk` posted on a QP of another PD of the owner's
/// device, run to its completion: its (wr_id, opcode, status).
fn local_inv_from_another_pd(s: &Setup, rk: u32) -> Vec<(u64, WcOpcode, WcStatus)> {
    let other = s.p.a.nic.new_pd().unwrap();
    let a2 = End::new(&other).unwrap();
    let b2 = End::new(&s.p.b.nic).unwrap();
    End::connect(&a2, &b2).unwrap();
    a2.nic.post_send(a2.qp, &[SendWr::LocalInv { wr_id: 9, signaled: true, rkey: rk }]).unwrap();
    s.p.fabric.run_until_idle();
    statuses(&a2.poll())
}

#[test]
fn a_local_inv_of_another_pds_window_is_a_crash_case_in_both_modes() {
    // The spec does not find a window of another PD (LOC_QP_OP_ERR, the
    // window stays bound); rxe finds it across the device and invalidates
    // it (its owner's own LOCAL_INV then panics the kernel) or, not bound,
    // panics at once. Either is a LOCAL_INV the library posted on the
    // wrong connection's QP: flagged in spec mode as well.
    for bound in [true, false] {
        let s = setup(DeviceConfig::spec());
        let rk = if bound { bind_and_send(&s) } else { s.mw.rkey };
        assert_eq!(
            local_inv_from_another_pd(&s, rk),
            vec![(9, WcOpcode::LocalInv, WcStatus::LocQpOpErr)],
            "bound {bound}"
        );
        let crashes = s.p.fabric.would_crash_rxe();
        assert_eq!(crashes.len(), 1, "bound {bound}: {crashes:?}");
        assert!(crashes[0].detail.contains("OtherPd"), "{crashes:?}");
    }
    // rxe mode invalidates the bound window of the other PD, as rxe does,
    // and records it all the same (before, it recorded nothing).
    let s = setup(DeviceConfig::rxe());
    let rk = bind_and_send(&s);
    assert_eq!(local_inv_from_another_pd(&s, rk), vec![(9, WcOpcode::LocalInv, WcStatus::Success)], "rxe");
    assert_eq!(s.p.fabric.window(s.p.a.device(), s.mw.id), Some(WindowState::Invalidated { rkey: rk }));
    let crashes = s.p.fabric.would_crash_rxe();
    assert_eq!(crashes.len(), 1, "rxe: {crashes:?}");
    assert!(crashes[0].detail.contains("OtherPd"), "{crashes:?}");
}

fn inv_wr(rk: u32) -> SendWr {
    SendWr::LocalInv { wr_id: 6, signaled: false, rkey: rk }
}

#[test]
fn dealloc_of_a_bound_window_invalidates_it_without_a_hazard() {
    let s = setup(DeviceConfig::spec());
    let rk = bind_and_send(&s);
    assert!(s.p.a.nic.dereg_mr(s.mr.id).is_err(), "a region under a bound window cannot be deregistered");
    s.p.a.nic.dealloc_mw(s.mw.id).unwrap();
    assert!(s.p.fabric.hazards().is_empty());
    let c = read_one(&s, s.mr.addr + 300, 16, rk);
    assert_eq!(c.status, WcStatus::RemAccessErr);
    s.p.a.nic.dereg_mr(s.mr.id).unwrap();
}

/// Bind `s`'s window and send its rkey, post a 16-byte READ (wr_id 3) of
/// bytes 300.. through it, and step the fabric (manual progress) until the
/// responder has served it: its response is on its way. Returns the rkey.
fn read_served(s: &Setup) -> u32 {
    let rk = bind_and_send(s);
    s.p.b.nic.post_send(s.p.b.qp, &[read(s, 3, s.mr.addr + 300, 16, rk)]).unwrap();
    while !s.p.fabric.in_flight().iter().any(|r| r.source.is_some()) {
        assert!(s.p.fabric.step());
    }
    rk
}

#[test]
fn read_in_flight_when_invalidated_spec_and_rxe() {
    // Spec: the READ's bytes are copied when the responder processes it; an
    // invalidation that lands first makes it fail, one that lands after
    // leaves it successful.
    let s = setup(DeviceConfig::spec());
    s.p.fabric.set_progress(mwcap::sim::Progress::Manual);
    let rk = bind_and_send(&s);
    s.p.b.nic.post_send(s.p.b.qp, &[read(&s, 3, s.mr.addr + 300, 16, rk)]).unwrap();
    s.p.a.nic.post_send(s.p.a.qp, &[inv_wr(rk)]).unwrap();
    let (_, b) = s.p.settle();
    assert_eq!(statuses(&b), vec![(3, WcOpcode::RdmaRead, WcStatus::RemAccessErr)]);

    for dev in [DeviceConfig::spec(), DeviceConfig::rxe()] {
        let rxe = dev.rxe_quirks;
        let s = setup(dev);
        s.p.fabric.set_progress(mwcap::sim::Progress::Manual);
        let rk = read_served(&s);
        s.p.a.nic.post_send(s.p.a.qp, &[inv_wr(rk)]).unwrap();
        let (_, b) = s.p.settle();
        if rxe {
            assert!(b.is_empty(), "rxe: the requester gets no completion at all");
            assert_eq!(s.p.b.state(), QpState::Rts);
            assert_eq!(s.p.a.state(), QpState::Err, "rxe: the owner's QP goes to ERR");
            let inflight = s.p.fabric.in_flight();
            assert!(inflight.len() == 1 && inflight[0].hung);
            // The library's way out: flush the reader's QP.
            s.p.b.nic.set_qp_error(s.p.b.qp).unwrap();
            let (_, b) = s.p.settle();
            assert_eq!(statuses(&b), vec![(3, WcOpcode::RdmaRead, WcStatus::WrFlushErr)]);
            assert!(s.p.fabric.in_flight().is_empty());
        } else {
            assert_eq!(statuses(&b), vec![(3, WcOpcode::RdmaRead, WcStatus::Success)]);
            assert_eq!((s.p.a.state(), s.p.b.state()), (QpState::Rts, QpState::Rts));
        }
    }
}

/// Deallocate `s`'s window, which `bind_and_send` bound with the rkey
/// `stale`, allocate another, and bind it over the same bytes with the
/// consumer key `key`; returns its rkey.
fn replace_window(s: &Setup, stale: u32, key: u8) -> u32 {
    s.p.a.nic.dealloc_mw(s.mw.id).unwrap();
    let mw = s.p.a.nic.alloc_mw().unwrap();
    assert_eq!(mw.rkey >> 8, stale >> 8, "the freed key index is given out again");
    let rk = rkey::rebind(mw.rkey, key);
    let wr = SendWr::BindMw {
        wr_id: 1,
        signaled: true,
        mw: mw.id,
        rkey: rk,
        mr: s.mr.id,
        offset: 256,
        len: 512,
        access: Access::REMOTE_READ,
    };
    s.p.a.nic.post_send(s.p.a.qp, &[wr]).unwrap();
    let (a, _) = s.p.settle();
    assert_eq!(statuses(&a), vec![(1, WcOpcode::BindMw, WcStatus::Success)]);
    rk
}

/// Key indexes are reused, as on real devices: a window allocated after
/// another was deallocated gets its index, so the old window's rkey names
/// the new window. With another consumer key it reads nothing; with the
/// same key (a key byte that wrapped) it reads what the new window
/// exposes: only the key byte tells a stale rkey from a live one.
#[test]
fn a_deallocated_windows_index_is_reused_and_only_its_key_byte_stops_a_stale_rkey() {
    let s = setup(DeviceConfig::spec());
    let stale = bind_and_send(&s);
    assert_ne!(replace_window(&s, stale, 0x77), stale);
    let c = read_one(&s, s.mr.addr + 256, 64, stale);
    assert_eq!(c.status, WcStatus::RemAccessErr, "a stale rkey with another key byte read the new window");
    // (The failed READ took the reader's QP to ERR: a fresh pair.)
    let s = setup(DeviceConfig::spec());
    let stale = bind_and_send(&s);
    assert_eq!(replace_window(&s, stale, (stale & 0xff) as u8), stale, "the same key byte, the same rkey");
    let c = read_one(&s, s.mr.addr + 256, 64, stale);
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    assert_eq!(dst_bytes(&s, 64), pattern(4096)[256..320]);
}

/// A LOCAL_INV of a stale rkey whose index a newer, unbound window took
/// fails on the key, as rxe checks it first (`rxe_invalidate_mw`): a
/// wrong key, not the crash case of an unbound window's own key.
#[test]
fn a_stale_rkey_on_a_reused_index_is_a_wrong_key_not_the_crash_case() {
    for dev in [DeviceConfig::spec(), DeviceConfig::rxe()] {
        let s = setup(dev);
        let stale = bind_and_send(&s);
        s.p.a.nic.dealloc_mw(s.mw.id).unwrap();
        let mw = s.p.a.nic.alloc_mw().unwrap();
        assert_eq!(mw.rkey >> 8, stale >> 8, "the freed key index is given out again");
        assert_ne!(mw.rkey, stale, "this seed draws another key byte");
        s.p.a.nic.post_send(s.p.a.qp, &[SendWr::LocalInv { wr_id: 6, signaled: true, rkey: stale }]).unwrap();
        let (a, _) = s.p.settle();
        assert_eq!(statuses(&a), vec![(6, WcOpcode::LocalInv, WcStatus::LocQpOpErr)]);
        assert!(s.p.fabric.would_crash_rxe().is_empty(), "{:?}", s.p.fabric.would_crash_rxe());
    }
}

#[test]
fn destroying_a_qp_under_a_bound_window_is_recorded() {
    // rxe stalls about 50 s destroying a QP with a window still bound
    // through it, then frees the QP under the window: the simulator
    // destroys it at once and records it. Deallocated first (as mwcap
    // does), the window leaves no record.
    for dealloc_first in [false, true] {
        let s = setup(DeviceConfig::spec());
        bind_and_send(&s);
        if dealloc_first {
            s.p.a.nic.dealloc_mw(s.mw.id).unwrap();
        }
        s.p.a.nic.destroy_qp(s.p.a.qp).unwrap();
        let kinds: Vec<HazardKind> = s.p.fabric.hazards().iter().map(|h| h.kind).collect();
        let expected = if dealloc_first { vec![] } else { vec![HazardKind::DestroyUnderBoundWindow] };
        assert_eq!(kinds, expected, "dealloc_first={dealloc_first}: {:?}", s.p.fabric.hazards());
    }
}

#[test]
fn a_window_deallocated_after_its_responder_erred_does_not_end_the_late_copy() {
    // The owner's QP goes to ERR while the response to a READ through its
    // bound window is on its way, and the owner then deallocates the
    // window (as a down connection does with its lent windows, before the
    // destroy). A deallocation is no evidence that a copy under way ended:
    // the responder may still copy the last packet until the QP is
    // destroyed, so bytes rewritten before the destroy reach the reader,
    // and after it they do not. (Before, the freed window ended the
    // modelled late copy, and a reuse between the deallocation and the
    // destroy went unseen.)
    for destroy in [false, true] {
        let s = setup(DeviceConfig::spec());
        s.p.fabric.set_progress(mwcap::sim::Progress::Manual);
        read_served(&s);
        assert!(s.p.fabric.force_qp_error(s.p.a.addr));
        s.p.a.nic.dealloc_mw(s.mw.id).unwrap();
        s.p.a.nic.write_mr(s.mr.id, 0, &[0xee; 4096]).unwrap();
        if destroy {
            s.p.a.nic.destroy_qp(s.p.a.qp).unwrap();
            s.p.a.nic.write_mr(s.mr.id, 0, &[0x33; 4096]).unwrap();
        }
        let (_, b) = s.p.settle();
        assert_eq!(statuses(&b), vec![(3, WcOpcode::RdmaRead, WcStatus::Success)], "destroy={destroy}");
        // 16 bytes: one packet, the last, copied late.
        assert_eq!(dst_bytes(&s, 16), vec![0xee; 16], "destroy={destroy}");
    }
}

#[test]
fn a_read_served_before_its_window_was_invalidated_keeps_its_bytes_when_the_responder_errs_later() {
    // Spec device: the READ was served, then its window invalidated (the
    // owner may reuse the bytes on that completion), then the owner's QP
    // goes to ERR before the response lands. The invalidation ended the
    // bind, so the response is not copied again late (the ERR model's
    // last-packet copy is for binds still live): the reader gets the
    // bytes as served, not the reused ones.
    let s = setup(DeviceConfig::spec());
    s.p.fabric.set_progress(mwcap::sim::Progress::Manual);
    let rk = read_served(&s);
    s.p.a.nic.post_send(s.p.a.qp, &[inv_wr(rk)]).unwrap();
    let dev = s.p.a.device();
    while !matches!(s.p.fabric.window(dev, s.mw.id), Some(WindowState::Invalidated { .. })) {
        assert!(s.p.fabric.step());
    }
    assert_eq!(s.p.fabric.in_flight().len(), 1, "the response is still on its way");
    s.p.a.nic.write_mr(s.mr.id, 0, &[0xee; 4096]).unwrap();
    assert!(s.p.fabric.force_qp_error(s.p.a.addr));
    let (_, b) = s.p.settle();
    assert_eq!(statuses(&b), vec![(3, WcOpcode::RdmaRead, WcStatus::Success)]);
    assert_eq!(dst_bytes(&s, 16), pattern(4096)[300..316].to_vec());
    assert!(s.p.fabric.hazards().is_empty(), "{:?}", s.p.fabric.hazards());
}
