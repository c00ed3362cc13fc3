//! Each injected fault: delay, link loss, peer death, forced ERR, missing
//! or broken window support.

use mwcap::backend::NicOps;
use std::time::Duration;

use mwcap::backend::{rkey, Access, Completion, NicError, QpState, SendWr, Sge, SgeList, WcOpcode, WcStatus};
use mwcap::sim::{DeviceConfig, Fabric, FabricConfig, Faults, Latency, MwSupport, Pair, Progress};

fn st(v: &[Completion]) -> Vec<(u64, WcOpcode, WcStatus)> {
    v.iter().map(|c| (c.wr_id, c.opcode, c.status)).collect()
}

struct Rd {
    p: Pair,
    src: mwcap::backend::MrInfo,
    dst: mwcap::backend::MrInfo,
}

fn rd(cfg: FabricConfig) -> Rd {
    let f = Fabric::new(cfg);
    let p = Pair::new(&f, DeviceConfig::spec(), DeviceConfig::spec()).unwrap();
    let src = p.a.nic.reg_mr(64, Access::REMOTE_READ).unwrap();
    let dst = p.b.nic.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    Rd { p, src, dst }
}

impl Rd {
    fn read(&self, wr_id: u64) {
        let wr = SendWr::Read {
            wr_id,
            signaled: true,
            local: SgeList::from([Sge { mr: self.dst.id, offset: 0, len: 8 }]),
            remote_addr: self.src.addr,
            rkey: self.src.rkey,
        };
        self.p.b.nic.post_send(self.p.b.qp, &[wr]).unwrap();
    }
}

/// Post a READ at t=0 and return when its completion became pollable.
fn read_latency(cfg: FabricConfig) -> Duration {
    let cfg = FabricConfig { progress: Progress::Manual, ..cfg };
    let r = rd(cfg);
    r.read(1);
    while r.p.b.poll().is_empty() {
        assert!(r.p.fabric.step(), "the READ never completed");
    }
    r.p.fabric.now()
}

#[test]
fn latency_is_the_sum_of_the_configured_parts_and_extra_delay_adds() {
    let lat = Latency {
        post: Duration::from_nanos(10),
        wire: Duration::from_nanos(100),
        read_responder: Duration::from_nanos(1000),
        completion: Duration::from_nanos(5),
        per_kib: Duration::ZERO,
    };
    let base = FabricConfig { latency: lat, ..FabricConfig::default() };
    assert_eq!(read_latency(base.clone()), Duration::from_nanos(10 + 100 + 1000 + 100 + 5));
    let slow = FabricConfig {
        faults: Faults { extra_delay: Duration::from_micros(3), ..Faults::default() },
        ..base
    };
    assert_eq!(read_latency(slow), Duration::from_nanos(10 + 100 + 1000 + 100 + 5 + 6000));
}

#[test]
fn per_link_delay_applies_only_to_that_link() {
    let r = rd(FabricConfig { progress: Progress::Manual, ..FabricConfig::default() });
    let c = r.p.fabric.add_device(DeviceConfig::spec());
    r.p.fabric.set_link_delay(r.p.a.device(), c.device(), Duration::from_millis(5));
    r.read(1);
    r.p.fabric.run_until_idle();
    assert_eq!(st(&r.p.b.poll()), vec![(1, WcOpcode::RdmaRead, WcStatus::Success)]);
    assert!(r.p.fabric.now() < Duration::from_millis(5));
}

#[test]
fn a_lost_link_ends_in_retry_exceeded_after_the_configured_retries() {
    let faults = Faults { retry_cnt: 3, ack_timeout: Duration::from_micros(50), ..Faults::default() };
    let r = rd(FabricConfig { faults, ..FabricConfig::default() });
    r.p.fabric.cut_link(r.p.a.device(), r.p.b.device());
    r.read(1);
    r.read(2);
    let (_, b) = r.p.settle();
    assert_eq!(
        st(&b),
        vec![(1, WcOpcode::RdmaRead, WcStatus::RetryExcErr), (2, WcOpcode::RdmaRead, WcStatus::WrFlushErr)]
    );
    assert_eq!(r.p.b.state(), QpState::Err);
    assert_eq!(r.p.fabric.qp_counters(r.p.b.addr).unwrap().retransmits, 3);
    // Issued at 200 ns (post latency), 1 + 3 timeouts, then the completion latency.
    assert_eq!(r.p.fabric.now(), Duration::from_nanos(200 + 100) + Duration::from_micros(50) * 4);
}

#[test]
fn a_link_restored_before_the_retries_run_out_recovers() {
    let faults = Faults { retry_cnt: 3, ack_timeout: Duration::from_micros(50), ..Faults::default() };
    let r = rd(FabricConfig { faults, progress: Progress::Manual, ..FabricConfig::default() });
    r.p.a.nic.write_mr(r.src.id, 0, b"survived").unwrap();
    r.p.fabric.cut_link(r.p.a.device(), r.p.b.device());
    r.read(1);
    r.p.fabric.run_until(Duration::from_micros(120));
    assert!(r.p.b.poll().is_empty());
    r.p.fabric.restore_link(r.p.a.device(), r.p.b.device());
    let (_, b) = r.p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::Success)]);
    // Retransmissions at 50.2, 100.2 and 150.2 us; the last one, after the restore, gets through.
    assert_eq!(r.p.fabric.qp_counters(r.p.b.addr).unwrap().retransmits, 3);
    let mut out = [0u8; 8];
    r.p.b.nic.read_mr(r.dst.id, 0, &mut out).unwrap();
    assert_eq!(&out, b"survived");
}

#[test]
fn a_link_cut_while_the_response_is_on_the_wire_is_retried() {
    let faults = Faults { retry_cnt: 5, ack_timeout: Duration::from_micros(20), ..Faults::default() };
    let r = rd(FabricConfig { faults, progress: Progress::Manual, ..FabricConfig::default() });
    r.read(1);
    while !r.p.fabric.in_flight().iter().any(|x| x.source.is_some()) {
        assert!(r.p.fabric.step());
    }
    r.p.fabric.cut_link(r.p.a.device(), r.p.b.device());
    r.p.fabric.run_for(Duration::from_micros(30));
    r.p.fabric.restore_link(r.p.a.device(), r.p.b.device());
    let (_, b) = r.p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::Success)]);
    assert!(r.p.fabric.qp_counters(r.p.a.addr).unwrap().bytes_served >= 16, "the READ was served twice");
}

#[test]
fn peer_death_gives_the_survivor_retry_exceeded_and_frees_the_dead_sides_memory() {
    let faults = Faults { retry_cnt: 2, ack_timeout: Duration::from_micros(10), ..Faults::default() };
    let r = rd(FabricConfig { faults, ..FabricConfig::default() });
    let mw = r.p.a.nic.alloc_mw();
    assert!(mw.is_ok());
    assert!(!r.p.fabric.exposure(r.p.a.device(), r.p.b.addr).is_empty());
    r.p.a.nic.kill();
    r.read(1);
    let (_, b) = r.p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::RetryExcErr)]);
    assert_eq!(r.p.b.state(), QpState::Err);
    assert!(r.p.fabric.exposure(r.p.a.device(), r.p.b.addr).is_empty());
    assert!(matches!(r.p.a.nic.reg_mr(8, Access::NONE), Err(NicError::Os { .. })));
    assert!(r.p.a.nic.poll_cq_vec(r.p.a.cq, 1).is_err());
    assert!(r.p.fabric.qp_state(r.p.a.addr).is_none(), "the dead side's QPs vanished");
}

#[test]
fn a_forced_err_on_the_owner_times_out_the_readers_request() {
    let faults = Faults { retry_cnt: 1, ack_timeout: Duration::from_micros(10), ..Faults::default() };
    let r = rd(FabricConfig { faults, ..FabricConfig::default() });
    assert!(r.p.fabric.force_qp_error(r.p.a.addr));
    r.read(1);
    let (_, b) = r.p.settle();
    assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::RetryExcErr)]);
}

#[test]
fn a_nic_without_windows() {
    let f = Fabric::with_seed(1);
    let n = f.add_device(DeviceConfig::spec().with_mw(MwSupport::None));
    let info = n.device_info();
    assert!(!info.mem_window && !info.mw_type_2b);
    assert!(matches!(n.alloc_mw(), Err(NicError::Unsupported { op: "alloc_mw", .. })));
}

#[test]
fn a_nic_that_advertises_windows_but_cannot_allocate_them() {
    let f = Fabric::with_seed(1);
    let n = f.add_device(DeviceConfig::spec().with_mw(MwSupport::AdvertisedNoAlloc));
    let info = n.device_info();
    assert!(info.mem_window && info.mw_type_2b);
    assert!(matches!(n.alloc_mw(), Err(NicError::Unsupported { op: "alloc_mw", .. })));
}

#[test]
fn a_nic_that_allocates_windows_but_cannot_bind_them() {
    let f = Fabric::with_seed(1);
    let cfg = DeviceConfig::spec().with_mw(MwSupport::AllocNoBind);
    let p = Pair::new(&f, cfg.clone(), cfg).unwrap();
    let mr = p.a.nic.reg_mr(64, Access::MW_BIND).unwrap();
    let mw = p.a.nic.alloc_mw().unwrap();
    let rk = rkey::rebind(mw.rkey, 1);
    let bind = SendWr::BindMw {
        wr_id: 1,
        signaled: true,
        mw: mw.id,
        rkey: rk,
        mr: mr.id,
        offset: 0,
        len: 64,
        access: Access::REMOTE_READ,
    };
    assert!(matches!(p.a.nic.post_send(p.a.qp, &[bind]), Err(NicError::Unsupported { op: "bind_mw", .. })));
    assert_eq!(p.a.state(), QpState::Rts, "a refused post changes nothing");
}

#[test]
fn the_rxe_device_reports_itself() {
    let f = Fabric::with_seed(1);
    assert_eq!(f.add_device(DeviceConfig::rxe()).device_info().driver, "sim-rxe");
    assert_eq!(f.add_device(DeviceConfig::spec()).device_info().driver, "sim");
}

#[test]
fn a_response_whose_responder_went_to_err_on_its_way_lands_its_last_packet_as_copied_late() {
    // The responder copies a packet's bytes just before it goes and looks
    // at its QP's state only between packets: the move to ERR (and the
    // flush of its send queue) may come while the last packet is being
    // copied. Its destruction is the one point after which it copies
    // nothing.
    for destroy in [false, true] {
        let r = rd(FabricConfig { progress: Progress::Manual, ..FabricConfig::default() });
        r.p.a.nic.write_mr(r.src.id, 0, b"old-data").unwrap();
        r.read(1);
        while !r.p.fabric.in_flight().iter().any(|x| x.source.is_some()) {
            assert!(r.p.fabric.step());
        }
        assert!(r.p.fabric.force_qp_error(r.p.a.addr));
        // Reused on the ERR alone: the packet still being copied takes it.
        r.p.a.nic.write_mr(r.src.id, 0, b"new-data").unwrap();
        if destroy {
            r.p.a.nic.destroy_qp(r.p.a.qp).unwrap();
            // Reused after the destruction: the READ does not see it.
            r.p.a.nic.write_mr(r.src.id, 0, b"3rd-data").unwrap();
        }
        let (_, b) = r.p.settle();
        assert_eq!(st(&b), vec![(1, WcOpcode::RdmaRead, WcStatus::Success)], "destroy={destroy}");
        let mut out = [0u8; 8];
        r.p.b.nic.read_mr(r.dst.id, 0, &mut out).unwrap();
        assert_eq!(&out, b"new-data", "destroy={destroy}");
    }
}
