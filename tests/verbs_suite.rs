//! The verbs suite: runs on a real device, inside the SoftRoCE VM
//! (`tests/softroce/verbs-suite.sh`). One test per conformance scenario,
//! checked in the rxe flavor on two `VerbsNic` handles on rxe0 (loopback),
//! plus tests of the verbs layer itself, whole `Link` pairs, and the
//! torture run (`verbs_torture/`: random calls and faults over several
//! connections; `docs/reliability.md`).
//!
//! The device, port and GID index come from `MWCAP_DEVICE` (default `rxe0`),
//! `MWCAP_PORT` (1) and `MWCAP_GID_INDEX` (1).
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use futures::future::{select, Either};
use mwcap::backend::{
    rkey, Access, Completion, CqId, MrId, MwId, NicError, NicOps, QpConfig, SendWr, Sge, SgeList, WcOpcode,
    WcStatus,
};
use mwcap::conformance::{check, table, Flavor, Rig};
use mwcap::verbs::{list_devices, Context, OpenError, VerbsNic, MAX_CHAIN};

/// The system allocator, counting this process's allocations
/// (`stats_alloc`'s, so the test holds no `unsafe`). The suite runs with
/// `--test-threads=1` (`tests/softroce/in-vm.sh`), and while a test runs
/// libtest's main thread only waits for it, so a test's steady-state loop
/// is the only code that could allocate in its window.
#[global_allocator]
static GLOBAL: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

/// Heap allocations (and reallocations) made by this process so far.
fn allocations_here() -> usize {
    let s = GLOBAL.stats();
    s.allocations + s.reallocations
}

fn device() -> String {
    std::env::var("MWCAP_DEVICE").unwrap_or_else(|_| "rxe0".into())
}

fn env_u8(name: &str, default: u8) -> u8 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn open() -> VerbsNic {
    let (port, gid) = (env_u8("MWCAP_PORT", 1), env_u8("MWCAP_GID_INDEX", 1));
    VerbsNic::open(Some(&device()), port, gid).unwrap_or_else(|e| panic!("open {}: {e}", device()))
}

fn run_scenario(name: &str) {
    let (owner, reader) = (open(), open());
    let rig = Rig::new(&owner, &reader);
    let t = table();
    let s = t.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no scenario named {name}"));
    if let Err(m) = check(s, &rig, Flavor::Rxe) {
        panic!("{m}");
    }
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                run_scenario(stringify!($name));
            }
        )*
        /// The names above must exist in the table (a renamed scenario
        /// must not silently drop out of the VM run).
        const LISTED: &[&str] = &[$(stringify!($name)),*];
    };
}

// Every scenario of the table (none touches the paths that crash rxe:
// `scenario_list_matches_the_table` fails if one is missing here).
scenarios!(
    bind_send_then_read_inside,
    read_from_other_qp_fails,
    local_inv_then_read_fails,
    send_with_inv_invalidates,
    rebind_new_key_old_fails,
    read_outside_window_inside_mr,
    forced_err_flushes_outstanding,
    bind_error_no_mw_bind,
    bind_error_past_mr_end,
    bind_error_zero_length,
    bind_error_still_bound,
    local_inv_wrong_key,
    region_rkey_without_remote_rights,
    rkey_from_before_the_bind,
    read_past_mr_end,
    rebind_after_send_with_inv,
);

#[test]
fn scenario_list_matches_the_table() {
    let t = table();
    for name in LISTED {
        assert!(t.iter().any(|s| s.name == *name), "{name} is not in the conformance table");
    }
    for s in &t {
        assert!(LISTED.contains(&s.name), "scenario {} of the table does not run in the VM", s.name);
    }
}

#[test]
fn device_port_and_gid_query() {
    let listed = list_devices().expect("list devices");
    let ours = listed.iter().find(|d| d.name == device()).expect("our device is listed");
    let info = ours.info.clone().expect("device info");
    assert!(info.mem_window, "{info:?}");
    assert!(info.mw_type_2a || info.mw_type_2b, "{info:?}");
    assert!(info.max_mw > 0 && info.max_sge > 0 && info.mtu >= 256, "{info:?}");

    let ctx = Context::open(Some(&device())).expect("open");
    let attrs = ctx.query_device().expect("query device");
    assert_eq!(
        (attrs.mem_window, attrs.mw_type_2a, attrs.mw_type_2b),
        (info.mem_window, info.mw_type_2a, info.mw_type_2b)
    );
    assert!(attrs.phys_port_cnt >= 1);
    let port = ctx.query_port(1).expect("query port");
    assert!(port.active, "{port:?}");
    let gid = ctx.query_gid(1, env_u8("MWCAP_GID_INDEX", 1)).expect("query gid");
    // GID index 1 of rxe over lo is ::ffff:127.0.0.1 (RoCE v2, IPv4-mapped).
    if device() == "rxe0" {
        assert_eq!(gid, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]);
    }
    let nic = open();
    assert_eq!(nic.port_info().gid, gid);
    assert_eq!(nic.device_info(), info);
}

#[test]
fn open_errors_name_the_problem() {
    match VerbsNic::open(Some("no_such_dev9"), 1, 1) {
        Err(OpenError::NoSuchDevice { available, .. }) => {
            assert!(available.contains(&device()), "{available}")
        }
        other => panic!("expected NoSuchDevice, got {other:?}"),
    }
    match VerbsNic::open(Some(&device()), 1, 250) {
        Err(e @ OpenError::BadGid { .. }) => assert!(e.to_string().contains("gid index 250"), "{e}"),
        other => panic!("expected BadGid, got {other:?}"),
    }
}

/// A bind of window `mw` over `mr[0..len]` for REMOTE_READ under `rkey`.
fn bind_read(wr_id: u64, signaled: bool, mw: MwId, rkey: u32, mr: MrId, len: usize) -> SendWr {
    SendWr::BindMw { wr_id, signaled, mw, rkey, mr, offset: 0, len, access: Access::REMOTE_READ }
}

/// Two connected QPs on one handle, with their CQs.
struct Loop {
    a: mwcap::backend::QpEndpoint,
    b: mwcap::backend::QpEndpoint,
    cq_a: mwcap::backend::CqId,
    cq_b: mwcap::backend::CqId,
}

fn connect(nic: &VerbsNic) -> Loop {
    let cq_a = nic.create_cq(32).expect("cq");
    let cq_b = nic.create_cq(32).expect("cq");
    let a = nic.create_qp(QpConfig::new(cq_a, cq_a)).expect("qp a");
    let b = nic.create_qp(QpConfig::new(cq_b, cq_b)).expect("qp b");
    nic.connect_qp(a.id, &b).expect("connect a");
    nic.connect_qp(b.id, &a).expect("connect b");
    Loop { a, b, cq_a, cq_b }
}

fn poll_one(nic: &VerbsNic, cq: mwcap::backend::CqId) -> mwcap::backend::Completion {
    async_io::block_on(async {
        let wait = std::pin::pin!(nic.wait_cq(cq, 1));
        let timer = std::pin::pin!(async_io::Timer::after(Duration::from_secs(30)));
        match select(wait, timer).await {
            Either::Left((got, _)) => got.expect("wait").remove(0),
            Either::Right(_) => panic!("no completion within 30 s"),
        }
    })
}

#[test]
fn rkey_is_tracked_across_rebinds() {
    let nic = open();
    let l = connect(&nic);
    let src = nic.reg_mr(8192, Access::MW_BIND).expect("src");
    nic.write_mr(src.id, 0, &[0x5a; 8192]).expect("fill");
    let dst = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("dst");
    let mw = nic.alloc_mw().expect("mw");
    assert_eq!(nic.mw_rkey(mw.id).expect("rkey"), mw.rkey);

    // A bind whose rkey names another window is refused before posting.
    let foreign = rkey::with_key(mw.rkey ^ 0x100, 7);
    let bad = bind_read(9, true, mw.id, foreign, src.id, 4096);
    assert!(matches!(nic.post_send(l.a.id, &[bad]), Err(NicError::InvalidWr(_))));
    assert_eq!(nic.mw_rkey(mw.id).expect("rkey"), mw.rkey, "a refused bind changes nothing");

    for round in 0..3u64 {
        let current = nic.mw_rkey(mw.id).expect("rkey");
        let new = rkey::rebind(current, rand::random());
        let bind = bind_read(round, true, mw.id, new, src.id, 4096);
        nic.post_send(l.a.id, &[bind]).expect("bind");
        assert_eq!(nic.mw_rkey(mw.id).expect("rkey"), new, "tracked after the post");
        let c = poll_one(&nic, l.cq_a);
        assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::BindMw), "{c:?}");
        assert_eq!(rkey::index(new), rkey::index(mw.rkey));
        // rkey::rebind's contract: never the current key (an older one may
        // come back: the consumer key is a random byte, so "never seen"
        // failed about one run in 80).
        assert_ne!(new, current, "a rebind reused the current key");
        // The peer QP reads through the new key.
        let read = SendWr::Read {
            wr_id: 100 + round,
            signaled: true,
            local: SgeList::from([Sge { mr: dst.id, offset: 0, len: 64 }]),
            remote_addr: src.addr,
            rkey: new,
        };
        nic.post_send(l.b.id, &[read]).expect("read");
        let c = poll_one(&nic, l.cq_b);
        assert_eq!((c.status, c.byte_len), (WcStatus::Success, 64), "{c:?}");
        // Invalidate exactly once before the next bind.
        nic.post_send(l.a.id, &[SendWr::LocalInv { wr_id: 200 + round, signaled: true, rkey: new }])
            .expect("inv");
        let c = poll_one(&nic, l.cq_a);
        assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::LocalInv), "{c:?}");
    }
    nic.destroy_qp(l.a.id).expect("destroy");
    nic.destroy_qp(l.b.id).expect("destroy");
    nic.dealloc_mw(mw.id).expect("dealloc");
    nic.dereg_mr(src.id).expect("dereg");
}

#[test]
fn async_wait_wakes_on_a_completion() {
    let nic = open();
    let l = connect(&nic);
    let buf = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("mr");
    nic.post_recv(l.b.id, 1, Sge { mr: buf.id, offset: 1024, len: 64 }).expect("recv");
    nic.write_mr(buf.id, 0, b"hello").expect("write");
    std::thread::scope(|s| {
        s.spawn(|| {
            // Give the waiter time to park on the channel before anything arrives.
            std::thread::sleep(Duration::from_millis(300));
            let send = SendWr::Send {
                wr_id: 2,
                signaled: true,
                sge: SgeList::from([Sge { mr: buf.id, offset: 0, len: 5 }]),
            };
            nic.post_send(l.a.id, &[send]).expect("send");
        });
        let c = poll_one(&nic, l.cq_b);
        assert_eq!(
            (c.status, c.opcode, c.byte_len, c.wr_id),
            (WcStatus::Success, WcOpcode::Recv, 5, 1),
            "{c:?}"
        );
    });
    let mut got = [0u8; 5];
    nic.read_mr(buf.id, 1024, &mut got).expect("read back");
    assert_eq!(&got, b"hello");
    let c = poll_one(&nic, l.cq_a);
    assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::Send));
}

/// What a retransmission does to a send queue holding a completed window
/// bind: SEND 1 goes to a queue pair that is not yet connected (it drops
/// what arrives), so it is retransmitted after each ACK timeout; behind it a
/// BIND_MW (which completes at once: a local operation) and SEND 3. Then the
/// peer connects and posts receives. On a NIC that keeps to the spec the
/// retransmission delivers both SENDs. rxe's retry rewinds its requester to
/// SEND 1 and trips over the completed bind: SEND 3 is never sent (the queue
/// pair stays RTS and completes nothing more), or the bind runs again and
/// fails with MW_BIND_ERR. Without the bind both SENDs arrive. Hence
/// mwcap's ACK timeout of 1 s, far above the acknowledgement stalls seen
/// under TCG (`Config::ack_timeout`, `docs/deploy.md`, "rxe and
/// retransmissions"). If this fails because SEND 3 arrived, rxe was fixed:
/// say so there. Moving the stalled queue pair to ERR, as mwcap does to a
/// connection it gives up on, flushes what it held.
#[test]
fn rxe_stalls_a_send_queue_retried_past_a_completed_bind() {
    let nic = open();
    let ctrl = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("ctrl");
    let src = nic.reg_mr(4096, Access::MW_BIND).expect("src");
    let run = |bind: bool| -> Vec<Completion> {
        let cq_a = nic.create_cq(32).expect("cq");
        let cq_b = nic.create_cq(32).expect("cq");
        // 16.8 ms: seven retransmissions take about 130 ms.
        let mut cfg = QpConfig::new(cq_a, cq_a);
        cfg.ack_timeout = Duration::from_millis(16);
        let a = nic.create_qp(cfg).expect("qp a");
        let b = nic.create_qp(QpConfig::new(cq_b, cq_b)).expect("qp b");
        nic.connect_qp(a.id, &b).expect("connect a");
        let mw = nic.alloc_mw().expect("mw");
        let send = |wr_id| SendWr::Send {
            wr_id,
            signaled: true,
            sge: SgeList::from([Sge { mr: ctrl.id, offset: 0, len: 16 }]),
        };
        nic.post_send(a.id, &[send(1)]).expect("send 1");
        if bind {
            let new = rkey::rebind(mw.rkey, rand::random());
            let bind = bind_read(2, false, mw.id, new, src.id, 4096);
            nic.post_send(a.id, &[bind, send(3)]).expect("bind and send 3");
        } else {
            nic.post_send(a.id, &[send(3)]).expect("send 3");
        }
        // Two or three retransmissions of SEND 1, then the peer is ready.
        std::thread::sleep(Duration::from_millis(40));
        nic.connect_qp(b.id, &a).expect("connect b");
        for k in 0..2u64 {
            let sge = Sge { mr: ctrl.id, offset: 1024 + 64 * k as usize, len: 64 };
            nic.post_recv(b.id, 10 + k, sge).expect("recv");
        }
        let mut got: Vec<Completion> = Vec::new();
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end && !got.iter().any(|c| c.wr_id == 3 || !c.status.is_success()) {
            got.extend(nic.poll_cq_vec(cq_a, 8).expect("poll"));
            std::thread::sleep(Duration::from_millis(1));
        }
        // What mwcap does to a connection it gives up on: ERR flushes
        // whatever the queue pair still holds, each with a completion.
        nic.set_qp_error(a.id).expect("to ERR");
        let end = Instant::now() + Duration::from_secs(3);
        while Instant::now() < end && !got.iter().any(|c| c.wr_id == 3) {
            got.extend(nic.poll_cq_vec(cq_a, 8).expect("poll"));
            std::thread::sleep(Duration::from_millis(1));
        }
        nic.dealloc_mw(mw.id).expect("dealloc");
        nic.destroy_qp(a.id).expect("destroy a");
        nic.destroy_qp(b.id).expect("destroy b");
        nic.destroy_cq(cq_a).expect("destroy cq");
        nic.destroy_cq(cq_b).expect("destroy cq");
        got
    };
    let sent = |got: &[Completion], id| got.iter().any(|c| c.wr_id == id && c.status == WcStatus::Success);
    let plain = run(false);
    assert!(
        sent(&plain, 1) && sent(&plain, 3),
        "without a bind both SENDs arrive after the retransmission: {plain:?}"
    );
    let bound = run(true);
    assert!(
        !sent(&bound, 3),
        "rxe delivered the SEND behind a completed bind after a retransmission: fixed? {bound:?}"
    );
    // The stalled queue pair still gives its evidence once it is in ERR:
    // the SEND it never sent completes (flushed), so buffers come back.
    assert!(
        bound.iter().any(|c| c.wr_id == 3 && c.status == WcStatus::WrFlushErr),
        "moving the stalled queue pair to ERR did not flush the SEND it held: {bound:?}"
    );
    let bind_failed = bound.iter().any(|c| c.wr_id == 2 && c.status == WcStatus::MwBindErr);
    eprintln!(
        "after the retransmission: {}",
        if bind_failed { "the bind ran again and failed (MW_BIND_ERR)" } else { "the send queue stalled" }
    );
    nic.dereg_mr(src.id).expect("dereg");
    nic.dereg_mr(ctrl.id).expect("dereg");
}

/// rxe queues a chain before it rings the doorbell, and the doorbell of a
/// queue pair not yet ready to send fails with no request named (`bad`
/// NULL): the chain counts as posted. Its window's new rkey is tracked, and
/// once the queue pair is connected the next doorbell runs it: the bind's
/// and the SEND's completions come, with their opcodes, and the peer reads
/// through the window.
#[test]
fn a_chain_whose_doorbell_fails_counts_as_posted() {
    let nic = open();
    let cq_a = nic.create_cq(32).expect("cq");
    let cq_b = nic.create_cq(32).expect("cq");
    let a = nic.create_qp(QpConfig::new(cq_a, cq_a)).expect("qp a");
    let b = nic.create_qp(QpConfig::new(cq_b, cq_b)).expect("qp b");
    let src = nic.reg_mr(4096, Access::MW_BIND).expect("src");
    nic.write_mr(src.id, 0, &[0x3c; 4096]).expect("fill");
    let ctrl = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("ctrl");
    let mw = nic.alloc_mw().expect("mw");
    let new = rkey::rebind(mw.rkey, 0x42);
    let chain = [
        bind_read(1, true, mw.id, new, src.id, 4096),
        SendWr::Send {
            wr_id: 2,
            signaled: true,
            sge: SgeList::from([Sge { mr: ctrl.id, offset: 0, len: 16 }]),
        },
    ];
    // In INIT: the provider takes both, its doorbell fails.
    let e = nic.post_send(a.id, &chain).expect_err("a doorbell before RTS fails on rxe");
    assert!(e.to_string().contains("took all 2"), "the error says the chain was taken: {e}");
    assert_eq!(nic.mw_rkey(mw.id).expect("rkey"), new, "a bind that may run is tracked");
    nic.post_recv(b.id, 10, Sge { mr: ctrl.id, offset: 1024, len: 64 }).expect("recv");
    nic.post_recv(b.id, 11, Sge { mr: ctrl.id, offset: 2048, len: 64 }).expect("recv");
    nic.connect_qp(a.id, &b).expect("connect a");
    nic.connect_qp(b.id, &a).expect("connect b");
    // The next doorbell runs the queue from its start.
    let later = SendWr::Send {
        wr_id: 3,
        signaled: true,
        sge: SgeList::from([Sge { mr: ctrl.id, offset: 0, len: 16 }]),
    };
    nic.post_send(a.id, &[later]).expect("send");
    let got: Vec<_> = (0..3).map(|_| poll_one(&nic, cq_a)).map(|c| (c.wr_id, c.status, c.opcode)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::BindMw),
            (2, WcStatus::Success, WcOpcode::Send),
            (3, WcStatus::Success, WcOpcode::Send)
        ],
        "the chain the failed doorbell left queued ran first"
    );
    for id in [10, 11] {
        let c = poll_one(&nic, cq_b);
        assert_eq!((c.wr_id, c.status), (id, WcStatus::Success), "{c:?}");
    }
    let dst = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("dst");
    let read = SendWr::Read {
        wr_id: 20,
        signaled: true,
        local: SgeList::from([Sge { mr: dst.id, offset: 0, len: 64 }]),
        remote_addr: src.addr,
        rkey: new,
    };
    nic.post_send(b.id, &[read]).expect("read");
    let c = poll_one(&nic, cq_b);
    assert_eq!((c.status, c.byte_len), (WcStatus::Success, 64), "read through the tracked key: {c:?}");
    let mut back = [0u8; 64];
    nic.read_mr(dst.id, 0, &mut back).expect("read back");
    assert_eq!(back, [0x3c; 64]);
    // The window's one invalidation.
    nic.post_send(a.id, &[SendWr::LocalInv { wr_id: 30, signaled: true, rkey: new }]).expect("inv");
    let c = poll_one(&nic, cq_a);
    assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::LocalInv), "{c:?}");
    nic.destroy_qp(a.id).expect("destroy");
    nic.destroy_qp(b.id).expect("destroy");
    nic.dealloc_mw(mw.id).expect("dealloc");
    for mr in [src.id, ctrl.id, dst.id] {
        nic.dereg_mr(mr).expect("dereg");
    }
}

#[test]
fn flushed_receive_reports_its_opcode() {
    let nic = open();
    let l = connect(&nic);
    let buf = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("mr");
    nic.post_recv(l.b.id, 77, Sge { mr: buf.id, offset: 0, len: 64 }).expect("recv");
    nic.set_qp_error(l.b.id).expect("to ERR");
    assert_eq!(nic.qp_state(l.b.id).expect("state"), mwcap::backend::QpState::Err);
    let c = poll_one(&nic, l.cq_b);
    assert_eq!((c.wr_id, c.status, c.opcode), (77, WcStatus::WrFlushErr, WcOpcode::Recv), "{c:?}");
}

#[test]
fn bad_ranges_are_refused_before_posting() {
    let nic = open();
    let l = connect(&nic);
    let mr = nic.reg_mr(100, Access::LOCAL_WRITE).expect("mr");
    let read = SendWr::Read {
        wr_id: 1,
        signaled: true,
        local: SgeList::from([Sge { mr: mr.id, offset: 90, len: 20 }]),
        remote_addr: 0,
        rkey: 0,
    };
    match nic.post_send(l.a.id, &[read]) {
        Err(NicError::OutOfRange { mr: id, offset: 90, end: 110, len: 100 }) => assert_eq!(id, mr.id.raw()),
        other => panic!("expected OutOfRange, got {other:?}"),
    }
    assert!(matches!(nic.write_mr(mr.id, 99, b"xy"), Err(NicError::OutOfRange { .. })));
    assert!(nic.poll_cq_vec(l.cq_a, 4).expect("poll").is_empty(), "nothing was posted");
}

#[test]
fn region_under_a_bound_window_is_not_freed() {
    let nic = open();
    let l = connect(&nic);
    let src = nic.reg_mr(4096, Access::MW_BIND).expect("src");
    let mw = nic.alloc_mw().expect("mw");
    let new = rkey::rebind(mw.rkey, rand::random());
    let bind = bind_read(1, true, mw.id, new, src.id, 4096);
    nic.post_send(l.a.id, &[bind]).expect("bind");
    assert_eq!(poll_one(&nic, l.cq_a).status, WcStatus::Success);
    // The device refuses; the region stays registered and usable.
    assert!(nic.dereg_mr(src.id).is_err(), "deregistering under a bound window must fail");
    nic.write_mr(src.id, 0, b"still here").expect("region still usable");
    nic.dealloc_mw(mw.id).expect("dealloc");
    nic.dereg_mr(src.id).expect("dereg after the window is gone");
}

// ---- the hot path: post/poll loops, allocations, concurrency ----

/// Poll `cq` (busy, into `out`) until `out` is full; allocates nothing.
/// Panics after 30 s.
fn reap(nic: &VerbsNic, cq: CqId, out: &mut [Completion]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut got = 0;
    while got < out.len() {
        got += nic.poll_cq(cq, &mut out[got..]).expect("poll");
        if got < out.len() {
            assert!(Instant::now() < deadline, "only {got} of {} completions within 30 s", out.len());
            std::thread::yield_now();
        }
    }
}

/// The byte at `i` of message `round`.
fn pattern(round: u64, i: usize) -> u8 {
    (round as usize * 31 + i * 7) as u8
}

/// Regions and a window for the loops: A sends from `tx` into B's `rx`,
/// and B reads A's `src` through `mw` into `dst`.
struct LoopBufs {
    tx: mwcap::backend::MrInfo,
    rx: mwcap::backend::MrInfo,
    src: mwcap::backend::MrInfo,
    dst: mwcap::backend::MrInfo,
    mw: mwcap::backend::MwInfo,
}

/// Room per message in `tx`/`rx`.
const SLOT: usize = 512;

impl LoopBufs {
    fn new(nic: &VerbsNic) -> LoopBufs {
        let tx = nic.reg_mr(MAX_CHAIN * SLOT, Access::LOCAL_WRITE).expect("tx");
        let rx = nic.reg_mr(MAX_CHAIN * SLOT, Access::LOCAL_WRITE).expect("rx");
        let src = nic.reg_mr(8192, Access::MW_BIND | Access::LOCAL_WRITE).expect("src");
        let dst = nic.reg_mr(8192, Access::LOCAL_WRITE).expect("dst");
        let mw = nic.alloc_mw().expect("mw");
        LoopBufs { tx, rx, src, dst, mw }
    }

    fn free(self, nic: &VerbsNic) {
        nic.dealloc_mw(self.mw.id).expect("dealloc");
        for mr in [self.tx, self.rx, self.src, self.dst] {
            nic.dereg_mr(mr.id).expect("dereg");
        }
    }
}

/// One round of `k` SENDs from A to B in one chain (only the last
/// signaled), each message's bytes checked on arrival. Allocates nothing.
fn send_round(nic: &VerbsNic, l: &Loop, b: &LoopBufs, round: u64, k: usize) {
    let len = |j: usize| (1 + (round as usize * 13 + j * 29) % SLOT) as u32;
    for j in 0..k {
        let slot = Sge { mr: b.rx.id, offset: j * SLOT, len: SLOT as u32 };
        nic.post_recv(l.b.id, round << 8 | j as u64, slot).expect("post recv");
        let mut m = [0u8; SLOT];
        let m = &mut m[..len(j) as usize];
        for (i, x) in m.iter_mut().enumerate() {
            *x = pattern(round + j as u64, i);
        }
        nic.write_mr(b.tx.id, j * SLOT, m).expect("fill");
    }
    let mut chain = [SendWr::LocalInv { wr_id: 0, signaled: false, rkey: 0 }; MAX_CHAIN];
    for (j, wr) in chain[..k].iter_mut().enumerate() {
        let sge = SgeList::one(Sge { mr: b.tx.id, offset: j * SLOT, len: len(j) });
        *wr = SendWr::Send { wr_id: round << 8 | j as u64, signaled: j + 1 == k, sge };
    }
    nic.post_send(l.a.id, &chain[..k]).expect("post sends");
    let mut recvs = [Completion::EMPTY; MAX_CHAIN];
    reap(nic, l.cq_b, &mut recvs[..k]);
    for (j, c) in recvs[..k].iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (round << 8 | j as u64, WcStatus::Success, WcOpcode::Recv, len(j)),
            "round {round}: {c:?}"
        );
        let mut m = [0u8; SLOT];
        let m = &mut m[..len(j) as usize];
        nic.read_mr(b.rx.id, j * SLOT, m).expect("check");
        assert!(
            m.iter().enumerate().all(|(i, x)| *x == pattern(round + j as u64, i)),
            "round {round} msg {j}"
        );
    }
    let mut sent = [Completion::EMPTY; 1];
    reap(nic, l.cq_a, &mut sent);
    assert_eq!(
        (sent[0].wr_id, sent[0].status, sent[0].opcode),
        (round << 8 | (k as u64 - 1), WcStatus::Success, WcOpcode::Send),
        "round {round}"
    );
}

/// One round of bind (A), READ with two scatter entries through the new
/// rkey (B), LOCAL_INV (A); the bytes read are checked. Allocates nothing.
fn read_round(nic: &VerbsNic, l: &Loop, b: &LoopBufs, round: u64) {
    let off = (round as usize * 64) % 4096;
    let mut m = [0u8; 256];
    for (i, x) in m.iter_mut().enumerate() {
        *x = pattern(round, i);
    }
    nic.write_mr(b.src.id, off, &m).expect("fill src");
    let new = rkey::rebind(nic.mw_rkey(b.mw.id).expect("rkey"), round as u8);
    let bind = bind_read(round << 8 | 1, true, b.mw.id, new, b.src.id, 8192);
    nic.post_send(l.a.id, &[bind]).expect("bind");
    let mut c = [Completion::EMPTY; 1];
    reap(nic, l.cq_a, &mut c);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode), (round << 8 | 1, WcStatus::Success, WcOpcode::BindMw));
    let local = SgeList::from([
        Sge { mr: b.dst.id, offset: 4096, len: 100 },
        Sge { mr: b.dst.id, offset: 0, len: 156 },
    ]);
    let read = SendWr::Read {
        wr_id: round << 8 | 2,
        signaled: true,
        local,
        remote_addr: b.src.addr + off as u64,
        rkey: new,
    };
    nic.post_send(l.b.id, &[read]).expect("read");
    reap(nic, l.cq_b, &mut c);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len),
        (round << 8 | 2, WcStatus::Success, WcOpcode::RdmaRead, 256),
        "round {round}"
    );
    let mut m = [0u8; 156];
    nic.read_mr(b.dst.id, 4096, &mut m[..100]).expect("check");
    assert!(m[..100].iter().enumerate().all(|(i, x)| *x == pattern(round, i)), "round {round}, first entry");
    nic.read_mr(b.dst.id, 0, &mut m).expect("check");
    assert!(m.iter().enumerate().all(|(i, x)| *x == pattern(round, 100 + i)), "round {round}, second entry");
    nic.post_send(l.a.id, &[SendWr::LocalInv { wr_id: round << 8 | 3, signaled: true, rkey: new }])
        .expect("inv");
    reap(nic, l.cq_a, &mut c);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (round << 8 | 3, WcStatus::Success, WcOpcode::LocalInv)
    );
}

fn teardown(nic: &VerbsNic, l: Loop, b: LoopBufs) {
    // Windows first (a QP destroyed under a valid window stalls rxe).
    b.free(nic);
    for qp in [l.a.id, l.b.id] {
        nic.set_qp_error(qp).expect("to ERR");
    }
    // Reap the flushes before destroying the QPs (until quiet for 50 ms).
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_millis(50) {
        if [l.cq_a, l.cq_b].iter().any(|cq| !nic.poll_cq_vec(*cq, 16).expect("reap").is_empty()) {
            quiet_since = Instant::now();
        } else {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    nic.destroy_qp(l.a.id).expect("destroy a");
    nic.destroy_qp(l.b.id).expect("destroy b");
    nic.destroy_cq(l.cq_a).expect("destroy cq a");
    nic.destroy_cq(l.cq_b).expect("destroy cq b");
}

#[test]
fn post_poll_loop_delivers_every_chain_in_order() {
    let nic = open();
    let l = connect(&nic);
    let b = LoopBufs::new(&nic);
    for round in 0..240u64 {
        send_round(&nic, &l, &b, round, 1 + round as usize % MAX_CHAIN);
        if round % 4 == 0 {
            read_round(&nic, &l, &b, round);
        }
    }
    // A chain one longer than the limit is refused whole.
    let send =
        SendWr::Send { wr_id: 1, signaled: true, sge: SgeList::one(Sge { mr: b.tx.id, offset: 0, len: 8 }) };
    match nic.post_send(l.a.id, &[send; MAX_CHAIN + 1]) {
        Err(NicError::InvalidWr(m)) => assert!(m.contains("at most 8"), "{m}"),
        other => panic!("expected InvalidWr, got {other:?}"),
    }
    // Flushed receives report their opcode and ids, in order, in one poll.
    for j in 0..5u64 {
        nic.post_recv(l.b.id, 900 + j, Sge { mr: b.rx.id, offset: 0, len: 64 }).expect("recv");
    }
    nic.set_qp_error(l.b.id).expect("to ERR");
    let mut flushed = [Completion::EMPTY; 5];
    reap(&nic, l.cq_b, &mut flushed);
    for (j, c) in flushed.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode),
            (900 + j as u64, WcStatus::WrFlushErr, WcOpcode::Recv),
            "{c:?}"
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(nic.poll_cq_vec(l.cq_a, 4).expect("poll").is_empty(), "the refused chain posted nothing");
    teardown(&nic, l, b);
}

#[test]
fn steady_state_post_and_poll_allocate_nothing() {
    let nic = open();
    let l = connect(&nic);
    let b = LoopBufs::new(&nic);
    let round = |r: u64| {
        send_round(&nic, &l, &b, r, 1 + r as usize % 3);
        read_round(&nic, &l, &b, r);
        let mut none = [Completion::EMPTY; 4];
        assert_eq!(nic.poll_cq(l.cq_a, &mut none).expect("poll"), 0);
    };
    for r in 0..10 {
        round(r);
    }
    let before = allocations_here();
    for r in 10..110 {
        round(r);
    }
    let allocs = allocations_here() - before;
    assert_eq!(
        allocs, 0,
        "100 rounds of post_recv/post_send/bind/READ/LOCAL_INV/poll_cq/write_mr/read_mr allocated {allocs} times"
    );
    teardown(&nic, l, b);
}

#[test]
fn concurrent_loops_and_table_changes_on_one_handle() {
    let nic = open();
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let nic = &nic;
            s.spawn(move || {
                let l = connect(nic);
                let b = LoopBufs::new(nic);
                for r in 0..60 {
                    send_round(nic, &l, &b, t << 32 | r, 1 + r as usize % 4);
                    if r % 3 == 0 {
                        read_round(nic, &l, &b, r);
                    }
                }
                teardown(nic, l, b);
            });
        }
        // Meanwhile objects come and go in every table the loops read.
        s.spawn(|| {
            for _ in 0..40 {
                let mr = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("mr");
                nic.write_mr(mr.id, 0, b"churn").expect("write");
                let mw = nic.alloc_mw().expect("mw");
                let cq = nic.create_cq(4).expect("cq");
                nic.destroy_cq(cq).expect("destroy cq");
                nic.dealloc_mw(mw.id).expect("dealloc");
                nic.dereg_mr(mr.id).expect("dereg");
                std::thread::sleep(Duration::from_millis(2));
            }
        });
    });
}

// ---- whole connections on real verbs: the Link over two PDs of rxe0 ----

mod endpoints {
    use std::time::{Duration, Instant};

    use mwcap::conn::{CallError, Config, Event, Link, Policies, Policy, Role};
    use mwcap::verbs::VerbsNic;

    struct Live {
        epoch: Instant,
        client: Link<VerbsNic>,
        server: Link<VerbsNic>,
        cev: Vec<Event>,
        sev: Vec<Event>,
    }

    impl Live {
        fn new(p: Policies, tweak: impl Fn(&mut Config)) -> Live {
            let cfg = || {
                let mut c = Config::default();
                c.buffers = 4;
                c.buffer_size = 16 << 10;
                c.ctrl_slots = 16;
                tweak(&mut c);
                c
            };
            let mut client = Link::new(super::open(), Role::Client, p, cfg()).expect("client endpoint");
            let mut server = Link::new(super::open(), Role::Server, p, cfg()).expect("server endpoint");
            let (c, s) = (client.local(), server.local());
            client.connect(&s).expect("connect client");
            server.connect(&c).expect("connect server");
            Live { epoch: Instant::now(), client, server, cev: Vec::new(), sev: Vec::new() }
        }

        fn now(&self) -> Duration {
            self.epoch.elapsed()
        }

        /// Drive both endpoints in real time until `pred` holds (or 10 s pass).
        fn until(&mut self, what: &str, mut pred: impl FnMut(&mut Live) -> bool) {
            let end = Instant::now() + Duration::from_secs(10);
            loop {
                let now = self.now();
                for ep in [&mut self.client, &mut self.server] {
                    ep.handle_timeout(now);
                    ep.drive(now);
                }
                // Returned buffers go straight back to the pools.
                while let Some(e) = self.client.poll_event() {
                    match e {
                        Event::BufferReturned(b) => self.client.free(b),
                        e => self.cev.push(e),
                    }
                }
                while let Some(e) = self.server.poll_event() {
                    match e {
                        Event::BufferReturned(b) => self.server.free(b),
                        e => self.sev.push(e),
                    }
                }
                if pred(self) {
                    return;
                }
                assert!(
                    Instant::now() < end,
                    "timed out waiting for: {what}\nclient: {:?}\nserver: {:?}",
                    self.cev,
                    self.sev
                );
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    const ALL: [Policies; 4] = [
        Policies { request: Policy::Mw, reply: Policy::Mw },
        Policies { request: Policy::Mw, reply: Policy::Confirm },
        Policies { request: Policy::Confirm, reply: Policy::Mw },
        Policies { request: Policy::Confirm, reply: Policy::Confirm },
    ];

    #[test]
    fn endpoint_calls_with_payloads_both_ways_in_every_policy_combination() {
        for pol in ALL {
            let mut l = Live::new(pol, |_| {});
            for i in 0..4u8 {
                let mut b = l.client.alloc().unwrap();
                b.copy_from(&vec![i; 3000]).unwrap();
                let now = l.now();
                let call = l.client.call(now, b"req", Some(b)).unwrap();
                l.until("the request", |l| l.sev.iter().any(|e| matches!(e, Event::Request { .. })));
                let i_req = l.sev.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
                let Event::Request { req, data: Some(d), .. } = l.sev.remove(i_req) else {
                    panic!("no payload")
                };
                assert_eq!(d.to_vec(), vec![i; 3000], "{pol:?}");
                l.server.free(d);
                let mut out = l.server.alloc().unwrap();
                out.copy_from(&vec![!i; 5000]).unwrap();
                let now = l.now();
                l.server.reply(now, req, 0, b"rep", Some(out)).unwrap();
                l.until("the reply", |l| {
                    l.cev.iter().any(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))
                });
                let i_rep = l
                    .cev
                    .iter()
                    .position(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))
                    .unwrap();
                match l.cev.remove(i_rep) {
                    Event::Reply { call: c, data: Some(d), .. } => {
                        assert_eq!(c, call);
                        assert_eq!(d.to_vec(), vec![!i; 5000], "{pol:?}");
                        l.client.free(d);
                    }
                    other => panic!("{pol:?}: {other:?}"),
                }
            }
            l.until("every buffer back", |l| l.client.busy_buffers() == 0 && l.server.busy_buffers() == 0);
            assert!(l.client.is_down().is_none() && l.server.is_down().is_none(), "{pol:?}");
            let now = l.now();
            l.client.close(now);
            l.server.close(now);
        }
    }

    #[test]
    fn endpoint_call_timeout_keeps_the_buffer_exposed_until_the_lease_ends_and_the_connection_up() {
        let mut l = Live::new(Policies::both(Policy::Mw), |c| {
            // Long enough that the ping below does not time out on a
            // loaded emulated VM (a 100 ms timeout did, once).
            c.call_timeout = Duration::from_millis(500);
            c.lease_time = Duration::from_millis(1500);
            c.safety_margin = Duration::from_millis(100);
        });
        let mut b = l.client.alloc().unwrap();
        // Above `inline_max`: exposed through a window, not copied into the frame.
        b.copy_from(&[0x5a; 1000]).unwrap();
        let now = l.now();
        let call = l.client.call(now, b"slow", Some(b)).unwrap();
        l.until("the call to time out", |l| {
            l.cev.contains(&Event::CallFailed { call, error: CallError::TimedOut })
        });
        assert_eq!(l.client.busy_buffers(), 1, "a timeout alone must not return the buffer");
        l.until("the buffer back after the lease", |l| l.client.busy_buffers() == 0);
        assert!(l.now() >= Duration::from_millis(1500), "returned before the lease could have ended");
        assert!(
            l.client.is_down().is_none() && l.server.is_down().is_none(),
            "a timeout must not tear down the connection"
        );
        let now = l.now();
        let ping = l.client.call(now, b"ping", None).unwrap();
        l.until("the ping request", |l| {
            l.sev.iter().filter(|e| matches!(e, Event::Request { .. })).count() == 2
        });
        let Some(Event::Request { req, .. }) =
            l.sev.iter().rev().find(|e| matches!(e, Event::Request { .. })).map(|e| match e {
                Event::Request { req, header, .. } => Event::Request {
                    req: *req,
                    header: header.clone(),
                    data: None,
                    trace: None,
                    delegated: false,
                },
                _ => unreachable!(),
            })
        else {
            unreachable!()
        };
        let now = l.now();
        l.server.reply(now, req, 0, b"pong", None).unwrap();
        l.until("the pong", |l| {
            l.cev.iter().any(|e| matches!(e, Event::Reply { call, .. } if *call == ping))
        });
    }
}

// ---- torture: random calls and faults over several connections at once ----

mod verbs_torture;

/// One endpoint per side on rxe0: 16 connections, each in a protection domain
/// of its own (`new_pd`), all completing on one completion queue per side
/// and driven by one task per side, with payloads from inline to 200 KB in
/// both policies, every byte checked. Then a READ with one connection's
/// region key through another connection's QP fails (the PDs keep them
/// apart on the shared queue), and the connection it was aimed at goes on.
mod hub {
    use std::time::Duration;

    use futures::executor::LocalPool;
    use futures::task::LocalSpawnExt;
    use mwcap::backend::{NicOps, SendWr, Sge, SgeList, WcStatus};
    use mwcap::bootstrap::Auth;
    use mwcap::conn::{
        BufClass, Config, Connection, Endpoint, EndpointBuilder, Pending, Policies, Policy, PolicyChoice,
        Role,
    };
    use mwcap::verbs::VerbsNic;

    /// An endpoint on its own handle of rxe0, for connections made without
    /// TCP (`Endpoint::prepare`), with `opts` applied to its builder.
    fn builder() -> EndpointBuilder<VerbsNic> {
        // The suite is its own peer on rxe, where a peer reaches other
        // connections' windows: it trusts itself (EndpointBuilder::trusted_peers).
        Endpoint::builder(super::open(), Auth::Unauthenticated).queue_depth(4096).trusted_peers(true)
    }

    /// Build `b`'s endpoint and run its driver as a task of `pool`.
    fn endpoint(pool: &LocalPool, b: EndpointBuilder<VerbsNic>) -> Endpoint<VerbsNic> {
        let (ep, driver) = b.build().expect("endpoint");
        pool.spawner()
            .spawn_local(async move {
                driver.run().await;
            })
            .unwrap();
        ep
    }

    /// Queue pairs for a client on `ch` and a server on `sh`, not yet
    /// connected; `connect` connects them.
    fn prepared(
        ch: &Endpoint<VerbsNic>,
        sh: &Endpoint<VerbsNic>,
        p: Policies,
        ccfg: Config,
        scfg: Config,
    ) -> (Pending<VerbsNic>, Pending<VerbsNic>) {
        (
            ch.prepare(Role::Client, p, ccfg).expect("client"),
            sh.prepare(Role::Server, p, scfg).expect("server"),
        )
    }

    fn connect(
        (c, s): (Pending<VerbsNic>, Pending<VerbsNic>),
    ) -> (Connection<VerbsNic>, Connection<VerbsNic>) {
        let (cl, sl) = (c.local(), s.local());
        (c.connect(&sl).unwrap(), s.connect(&cl).unwrap())
    }

    fn cfg() -> Config {
        let mut c = Config::default();
        c.buffers = 4;
        c.large_buffers = vec![BufClass { size: 256 << 10, count: 1 }];
        c.ctrl_slots = 8;
        c.call_timeout = Duration::from_secs(20);
        c
    }

    fn pattern(i: usize, k: usize, len: usize) -> Vec<u8> {
        (0..len).map(|x| (x as u8).wrapping_mul(13) ^ (i as u8) ^ ((k as u8) << 4)).collect()
    }

    async fn serve(conn: Connection<VerbsNic>) {
        while let Some(req) = conn.next_request().await {
            let mut bytes = req.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
            drop(req.data);
            bytes.reverse();
            let out = if bytes.is_empty() {
                None
            } else {
                let Ok(mut b) = conn.alloc_for(bytes.len()).await else { return };
                b.copy_from(&bytes).unwrap();
                Some(b)
            };
            if conn.reply(req.id, 0, b"", out).await.is_err() {
                return;
            }
        }
    }

    #[test]
    fn hub_serves_sixteen_connections_on_one_cq_per_side_and_keeps_their_pds_apart() {
        let mut pool = LocalPool::new();
        let ch = endpoint(&pool, builder());
        let sh = endpoint(&pool, builder());
        let mut clients = Vec::new();
        let mut servers = Vec::new();
        let mut regions = Vec::new();
        for i in 0..16 {
            let p = if i % 2 == 0 { Policies::both(Policy::Mw) } else { Policies::both(Policy::Confirm) };
            let both = prepared(&ch, &sh, p, cfg(), cfg());
            regions.push(both.1.link().data_region());
            let (client, server) = connect(both);
            pool.spawner().spawn_local(serve(server.clone())).unwrap();
            clients.push(client);
            servers.push(server);
        }
        let sizes = [0usize, 100, 3000, 200_000];
        pool.run_until(futures::future::join_all(clients.iter().enumerate().map(|(i, c)| async move {
            for (k, &len) in sizes.iter().enumerate() {
                let data = if len == 0 {
                    None
                } else {
                    let mut b = c.alloc_for(len).await.unwrap();
                    b.copy_from(&pattern(i, k, len)).unwrap();
                    Some(b)
                };
                let r = c.call(b"x", data).await.unwrap_or_else(|e| panic!("conn {i} call {k}: {e}"));
                let got = r.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                let mut want = pattern(i, k, len);
                want.reverse();
                assert!(got == want, "conn {i} call {k}: wrong bytes");
            }
        })));
        let s = sh.stats();
        assert_eq!(s.orphans, 0, "{s:?}");
        assert!(s.completions >= 16 * 4, "{s:?}");
        // Connection 1 (confirm: its region key covers its whole region)
        // READ through connection 3's client QP, whose peer is in another PD.
        let attacker_nic = super::open().new_pd().unwrap();
        let mut raw =
            mwcap::conn::Link::new(attacker_nic, Role::Client, Policies::both(Policy::Confirm), cfg())
                .expect("attacker endpoint");
        let victim = regions[1];
        let target = sh.prepare(Role::Server, Policies::both(Policy::Confirm), cfg()).unwrap();
        raw.connect(&target.local()).unwrap();
        let target_conn = target.connect(&raw.local()).unwrap();
        let dst = raw.data_region();
        let read = SendWr::Read {
            wr_id: 0xbad,
            local: SgeList::one(Sge { mr: dst.id, offset: 0, len: 64 }),
            remote_addr: victim.addr,
            rkey: victim.rkey,
            signaled: true,
        };
        raw.nic().post_send(raw.local().id, &[read]).unwrap();
        let mut status = None;
        for _ in 0..2000 {
            pool.run_until_stalled();
            if let Some(c) =
                raw.nic().poll_cq_vec(raw.cq(), 8).unwrap().into_iter().find(|c| c.wr_id == 0xbad)
            {
                status = Some(c.status);
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let status = status.expect("the READ completes");
        assert_ne!(status, WcStatus::Success, "another PD's region key reached its memory on rxe");
        println!("a READ with another connection's region key: {status:?}");
        target_conn.close();
        // The victim's connection goes on.
        let r = pool.run_until(async {
            let mut b = clients[1].alloc().await.unwrap();
            b.copy_from(b"abc").unwrap();
            clients[1].call(b"x", Some(b)).await
        });
        assert_eq!(r.expect("the victim still serves").data.as_ref().unwrap().to_vec(), b"cba");
        for c in clients.iter().chain(&servers) {
            c.close();
        }
        for _ in 0..3000 {
            pool.run_until_stalled();
            if sh.stats().connections == 0 && ch.stats().connections == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(ch.stats().connections, 0, "{:?}", ch.stats());
        assert_eq!(sh.stats().connections, 0, "{:?}", sh.stats());
    }

    /// A server endpoint with shared receives on rxe0: sixteen mw connections
    /// take their control receives from one SRQ (in the endpoint's PD), busy
    /// ones grow their shares, every byte is their own, and every share
    /// comes back when they close.
    #[test]
    fn shared_receives_serve_sixteen_mw_connections_from_one_srq() {
        use mwcap::conn::SrqConfig;
        let mut pool = LocalPool::new();
        let ch = endpoint(&pool, builder());
        let srq = SrqConfig { chunk: 64, max_slots: 1024 };
        let sh = endpoint(&pool, builder().policy(PolicyChoice::Mw).shared_receives(srq));
        let p = Policies::both(Policy::Mw);
        let cfg16 = || {
            let mut c = cfg();
            c.ctrl_slots = 16;
            c
        };
        let mut clients = Vec::new();
        let mut servers = Vec::new();
        for _ in 0..16 {
            let (client, server) = connect(prepared(&ch, &sh, p, cfg16(), cfg16()));
            pool.spawner().spawn_local(serve(server.clone())).unwrap();
            clients.push(client);
            servers.push(server);
        }
        let q = sh.stats().srq.expect("shared receives");
        assert_eq!((q.shares, q.slots), (16 * 8, 128), "{q:?}");
        let sizes = [0usize, 100, 3000, 200_000];
        pool.run_until(futures::future::join_all(clients.iter().enumerate().map(|(i, c)| async move {
            for round in 0..3 {
                let calls = sizes.iter().enumerate().map(|(k, &len)| async move {
                    let data = if len == 0 {
                        None
                    } else {
                        let mut b = c.alloc_for(len).await.unwrap();
                        b.copy_from(&pattern(i, k + round, len)).unwrap();
                        Some(b)
                    };
                    let r = c.call(b"x", data).await.unwrap_or_else(|e| panic!("conn {i} call {k}: {e}"));
                    let got = r.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                    let mut want = pattern(i, k + round, len);
                    want.reverse();
                    assert!(got == want, "conn {i} call {k}: wrong bytes");
                });
                futures::future::join_all(calls).await;
            }
        })));
        let s = sh.stats();
        let q = s.srq.unwrap();
        println!("shared receives on rxe0: {q:?}");
        assert_eq!(s.orphans, 0, "{s:?}");
        assert!(q.frames >= 16 * 12, "{q:?}");
        assert!(q.grown > 0 && q.shares <= q.slots, "{q:?}");
        for c in &clients {
            assert_eq!(c.stats().calls_failed, 0);
            assert_eq!(c.stats().rnr_retries_exceeded, 0);
        }
        for c in clients.iter().chain(&servers) {
            c.close();
        }
        for _ in 0..3000 {
            pool.run_until_stalled();
            if sh.stats().connections == 0 && ch.stats().connections == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let s = sh.stats();
        assert_eq!(s.connections, 0, "{s:?}");
        assert_eq!(s.srq.unwrap().shares, 0, "every share came back: {s:?}");
    }

    /// Endpoints with a shared buffer pool on rxe0, both sides: sixteen mw
    /// connections that could hold 4 standard and 1 large buffer each take
    /// them from pools of 12 and 2 (each buffer a region of its own, named
    /// through every connection's handle on the PD), and their windows
    /// from the pools' 14 (bound through each connection's QP, given back
    /// after each invalidation), each making its calls
    /// one after another, all at once: the pools run empty, every byte is
    /// the call's own,
    /// and every buffer is back in its pool when the connections are gone.
    #[test]
    fn shared_buffers_serve_sixteen_mw_connections_from_one_pool() {
        use mwcap::conn::SrqConfig;
        let mut pool = LocalPool::new();
        let p = Policies::both(Policy::Mw);
        let std_size = cfg().buffer_size;
        let classes = [BufClass { size: std_size, count: 12 }, BufClass { size: 256 << 10, count: 2 }];
        let srq = SrqConfig { chunk: 64, max_slots: 1024 };
        let pooled = || builder().policy(PolicyChoice::Mw).shared_receives(srq).shared_buffers(&classes);
        let ch = endpoint(&pool, pooled());
        let sh = endpoint(&pool, pooled());
        let mut clients = Vec::new();
        let mut servers = Vec::new();
        for _ in 0..16 {
            let both = prepared(&ch, &sh, p, cfg(), cfg());
            assert!(both.0.link().shares_buffers() && both.1.link().shares_buffers());
            let (client, server) = connect(both);
            pool.spawner().spawn_local(serve(server.clone())).unwrap();
            clients.push(client);
            servers.push(server);
        }
        let sizes = [1usize, 100, 3000, 200_000];
        // One call at a time per connection, all sixteen at once (a pool
        // smaller than the calls in flight can hold: docs/serving.md).
        pool.run_until(futures::future::join_all(clients.iter().enumerate().map(|(i, c)| async move {
            for round in 0..3 {
                for (k, &len) in sizes.iter().enumerate() {
                    let mut b = c.alloc_for(len).await.unwrap();
                    b.copy_from(&pattern(i, k + round, len)).unwrap();
                    let r = c.call(b"x", Some(b)).await.unwrap_or_else(|e| panic!("conn {i} call {k}: {e}"));
                    let got = r.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                    let mut want = pattern(i, k + round, len);
                    want.reverse();
                    assert!(got == want, "conn {i} call {k}: wrong bytes");
                }
            }
        })));
        for side in [&ch, &sh] {
            let b = side.stats().buffers.expect("a shared pool");
            println!("shared buffers on rxe0: {b:?}");
            assert!(b.taken >= 16 * 12 && b.empty > 0 && b.wakeups > 0, "{b:?}");
            // The pool's 14 windows (one per buffer, allocated through the
            // pool's handle) served every exposure of the 16 connections,
            // each bound through its connection's QP and handle and given
            // back only after its LOCAL_INV completed.
            assert_eq!((b.windows, b.windows_allocated, b.windows_dropped), (14, 14, 0), "{b:?}");
            // (1 and 100 bytes ride inline: two exposures of four calls.)
            assert!(b.windows_lent >= 16 * 6, "{b:?}");
        }
        for c in &clients {
            assert_eq!(c.stats().calls_failed, 0);
        }
        for c in clients.iter().chain(&servers) {
            c.close();
        }
        drop((clients, servers));
        for _ in 0..3000 {
            pool.run_until_stalled();
            if sh.stats().connections == 0 && ch.stats().connections == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        for side in [&ch, &sh] {
            let s = side.stats();
            assert_eq!(s.connections, 0, "{s:?}");
            let b = s.buffers.unwrap();
            assert_eq!((b.free, b.held_bytes), (14, 0), "every buffer is back: {b:?}");
            // Every window is back, but those lent when their connection
            // closed (deallocated before its QP was destroyed).
            assert_eq!(b.windows_free, b.windows, "{b:?}");
            assert_eq!(b.windows + b.windows_dropped as u32, 14, "{b:?}");
        }
    }

    /// A hostile peer on rxe0 floods SENDs at a connection on an endpoint
    /// with shared receives, past its credit and granting none back: that
    /// connection goes down with `ExceedsCredit`, and another connection on
    /// the same shared queue answers every call with its own bytes.
    #[test]
    fn shared_receives_a_flood_past_its_credit_ends_only_the_flooders_connection() {
        use mwcap::backend::Access;
        use mwcap::conn::frame::Frame;
        use mwcap::conn::{Link, LossReason, Misbehavior, SrqConfig};
        let mut pool = LocalPool::new();
        let srq = SrqConfig { chunk: 64, max_slots: 128 };
        let sh = endpoint(&pool, builder().policy(PolicyChoice::Mw).shared_receives(srq));
        let ch = endpoint(&pool, builder());
        let p = Policies::both(Policy::Mw);
        // The victim's client is an ordinary connection; the flooder drives
        // a link by hand.
        let (vclient, victim) = connect(prepared(&ch, &sh, p, cfg(), cfg()));
        let flood_s = sh.prepare(Role::Server, p, cfg()).unwrap();
        let mut flooder = Link::new(super::open().new_pd().unwrap(), Role::Client, p, cfg()).unwrap();
        flooder.connect(&flood_s.local()).unwrap();
        let flooded = flood_s.connect(&flooder.local()).unwrap();
        pool.spawner().spawn_local(serve(victim.clone())).unwrap();
        pool.spawner().spawn_local(serve(flooded.clone())).unwrap();
        // 48 pings from the flooder's own QP, past its 8 credits.
        let tx = flooder.nic().reg_mr(48 * 64, Access::LOCAL_WRITE).unwrap();
        let mut wrs = Vec::new();
        for i in 0..48u64 {
            let bytes = Frame::Ping { seq: i }.encode().unwrap();
            flooder.nic().write_mr(tx.id, i as usize * 64, &bytes).unwrap();
            wrs.push(SendWr::Send {
                wr_id: 0xf100 + i,
                signaled: false,
                sge: SgeList::one(Sge { mr: tx.id, offset: i as usize * 64, len: bytes.len() as u32 }),
            });
        }
        for chunk in wrs.chunks(8) {
            flooder.nic().post_send(flooder.local().id, chunk).unwrap();
        }
        for _ in 0..5000 {
            pool.run_until_stalled();
            if flooded.is_down().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let reason = flooded.is_down();
        println!("the flooder's connection on rxe0: {reason:?}");
        assert!(
            matches!(reason, Some(LossReason::PeerMisbehaved(Misbehavior::ExceedsCredit { .. }))),
            "{reason:?} {:?}",
            sh.stats()
        );
        // The victim, on the same shared queue, is answered.
        let got = pool.run_until(async {
            let mut ok = 0;
            for k in 0..10usize {
                let mut b = vclient.alloc_for(300).await.unwrap();
                b.copy_from(&pattern(1, k, 300)).unwrap();
                let r = vclient.call(b"x", Some(b)).await.expect("the victim's call");
                let mut want = pattern(1, k, 300);
                want.reverse();
                ok += usize::from(r.data.as_ref().unwrap().to_vec() == want);
            }
            ok
        });
        assert_eq!(got, 10, "every victim call answered with its own bytes");
        assert!(victim.is_down().is_none());
        drop(flooder);
    }

    /// An endpoint whose queue is deeper than rxe0's `max_cqe` is refused
    /// with `CqTooDeep` naming both, not built on a smaller queue that
    /// could overflow; one exactly as deep is built.
    #[test]
    fn an_endpoint_deeper_than_max_cqe_is_refused() {
        use mwcap::backend::NicError;
        use mwcap::conn::SetupError;
        let nic = super::open();
        let max = nic.device_attrs().max_cqe;
        println!("rxe0's max_cqe: {max}");
        let deeper = max.checked_add(1).expect("a device that caps its queues");
        match Endpoint::builder(nic, Auth::Unauthenticated).queue_depth(deeper).build() {
            Err(SetupError::Nic(NicError::CqTooDeep { depth, max: m })) => {
                assert_eq!((depth, m), (deeper, max))
            }
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("a queue of {deeper} entries on a device of {max}"),
        }
        let built = Endpoint::builder(super::open(), Auth::Unauthenticated).queue_depth(max).build();
        assert!(built.is_ok(), "as deep as the device holds: {:?}", built.err());
    }

    /// One region of the server's endpoint serves four connections: on an
    /// endpoint with a PD per connection (two mw, two confirm: each
    /// registers the region in its own PD) and on one with shared receives
    /// (four mw connections in the hub's PD, one registration). Every
    /// client reads every value right; the region is deregistered once
    /// every exposure has ended, and is then gone. (The simulator's
    /// `tests/endpoint_regions.rs` checks the writes refused meanwhile.)
    #[test]
    fn one_region_of_an_endpoint_serves_all_its_connections() {
        use mwcap::conn::{RegionRange, SrqConfig, UseError};
        const VALUE: usize = 3000;
        for shared in [false, true] {
            let mut pool = LocalPool::new();
            let ch = endpoint(&pool, builder());
            let sb = if shared {
                builder().queue_depth(1 << 14).shared_receives(SrqConfig::default()).policy(PolicyChoice::Mw)
            } else {
                builder()
            };
            let sh = endpoint(&pool, sb);
            let region = sh.register_region(40_000).expect("register a region");
            for key in 0..3 {
                sh.region_write(region, key * 4096, &pattern(key, 0, VALUE)).unwrap();
            }
            let mut clients = Vec::new();
            for i in 0..4 {
                let p = if shared || i % 2 == 0 {
                    Policies::both(Policy::Mw)
                } else {
                    Policies::both(Policy::Confirm)
                };
                let (client, server) = connect(prepared(&ch, &sh, p, cfg(), cfg()));
                pool.spawner()
                    .spawn_local(async move {
                        while let Some(req) = server.next_request().await {
                            let key = usize::from(req.header[0]);
                            let range = RegionRange { region, offset: key * 4096, len: VALUE as u32 };
                            if server.reply_region(req.id, 0, b"", range).await.is_err() {
                                return;
                            }
                        }
                    })
                    .unwrap();
                clients.push(client);
            }
            pool.run_until(futures::future::join_all(clients.iter().enumerate().map(|(i, c)| async move {
                for j in 0..6 {
                    let key = (i + j) % 3;
                    let r = c.call(&[key as u8], None).await.unwrap_or_else(|e| panic!("conn {i}: {e}"));
                    let got = r.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                    assert!(
                        got == pattern(key, 0, VALUE),
                        "shared {shared}: conn {i} key {key}: wrong bytes"
                    );
                }
            })));
            let t0 = std::time::Instant::now();
            loop {
                match sh.deregister_region(region) {
                    Ok(()) => break,
                    Err(UseError::RegionBusy(_)) => {}
                    Err(e) => panic!("{e}"),
                }
                assert!(t0.elapsed() < Duration::from_secs(10), "an exposure never ended");
                pool.run_until(async_io::Timer::after(Duration::from_millis(2)));
            }
            assert_eq!(sh.region_write(region, 0, b"x"), Err(UseError::NoSuchRegion(region)));
            for c in &clients {
                c.close();
            }
        }
    }
}

/// A shared receive queue on rxe0: one QP of a loopback pair takes its
/// receives from an SRQ. SENDs to it consume the SRQ's receives in the order
/// they were posted and complete with the receiving QP's number; the limit
/// event arrives (asynchronously) once the queue runs below its limit and is
/// taken once; the QP has no receive queue of its own; and the SRQ cannot
/// go before its QP does.
mod srq {
    use std::time::{Duration, Instant};

    use mwcap::backend::{
        Access, Completion, NicError, NicOps, QpConfig, SendWr, Sge, SgeList, WcOpcode, WcStatus,
    };

    /// Room per receive in the receiving region.
    const SLOT: usize = 256;

    #[test]
    fn srq_receives_complete_in_post_order_and_the_limit_fires_once() {
        let nic = super::open();
        let cq_a = nic.create_cq(32).expect("cq a");
        let cq_b = nic.create_cq(32).expect("cq b");
        let srq = nic.create_srq(16).expect("create srq");
        let a = nic.create_qp(QpConfig::new(cq_a, cq_a)).expect("qp a");
        let b =
            nic.create_qp(QpConfig { srq: Some(srq), ..QpConfig::new(cq_b, cq_b) }).expect("qp b on the srq");
        nic.connect_qp(a.id, &b).expect("connect a");
        nic.connect_qp(b.id, &a).expect("connect b");

        let rx = nic.reg_mr(4 * SLOT, Access::LOCAL_WRITE).expect("rx");
        let wr_ids = [0x5a00_0001u64, 0x5a00_0002, 0x5a00_0003, 0x5a00_0004];
        for (k, &wr_id) in wr_ids.iter().enumerate() {
            nic.post_srq_recv(srq, wr_id, Sge { mr: rx.id, offset: k * SLOT, len: SLOT as u32 })
                .expect("post to the srq");
        }
        // Out of the region: refused before posting, as post_recv does.
        match nic.post_srq_recv(srq, 99, Sge { mr: rx.id, offset: 4 * SLOT - 8, len: 16 }) {
            Err(NicError::OutOfRange { mr, .. }) => assert_eq!(mr, rx.id.raw()),
            other => panic!("expected OutOfRange, got {other:?}"),
        }
        nic.arm_srq_limit(srq, 3).expect("arm the limit");
        assert!(!nic.take_srq_limit(srq).expect("take the limit"), "no event before a receive is used");

        let frames: [&[u8]; 2] = [b"first frame", b"the second, longer frame"];
        let tx = nic.reg_mr(4096, Access::LOCAL_WRITE).expect("tx");
        let mut sends = Vec::new();
        for (k, f) in frames.iter().enumerate() {
            nic.write_mr(tx.id, k * 1024, f).expect("write the frame");
            sends.push(SendWr::Send {
                wr_id: 100 + k as u64,
                signaled: true,
                sge: SgeList::from([Sge { mr: tx.id, offset: k * 1024, len: f.len() as u32 }]),
            });
        }
        nic.post_send(a.id, &sends).expect("send both frames");

        let mut got = [Completion::EMPTY; 2];
        super::reap(&nic, cq_b, &mut got);
        for (k, c) in got.iter().enumerate() {
            assert_eq!(
                (c.status, c.opcode, c.qpn, c.wr_id, c.byte_len),
                (WcStatus::Success, WcOpcode::Recv, b.qpn, wr_ids[k], frames[k].len() as u32),
                "receive {k}: {c:?}"
            );
            let mut bytes = vec![0u8; frames[k].len()];
            nic.read_mr(rx.id, k * SLOT, &mut bytes).expect("read the receive");
            assert_eq!(bytes, frames[k], "receive {k}'s bytes");
        }
        let mut sent = [Completion::EMPTY; 2];
        super::reap(&nic, cq_a, &mut sent);
        for c in &sent {
            assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::Send), "{c:?}");
        }

        // Two of four receives left: below the limit of 3. The event is asynchronous.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !nic.take_srq_limit(srq).expect("take the limit") {
            assert!(Instant::now() < deadline, "no SRQ limit event within 2 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!nic.take_srq_limit(srq).expect("take the limit"), "the limit event is taken once");

        // The QP has no receive queue of its own.
        match nic.post_recv(b.id, 7, Sge { mr: rx.id, offset: 0, len: 64 }) {
            Err(NicError::InvalidWr(m)) => assert!(m.contains("shared receive queue"), "{m}"),
            other => panic!("expected InvalidWr from post_recv on an SRQ's QP, got {other:?}"),
        }

        // The SRQ outlives its QP.
        match nic.destroy_srq(srq) {
            Err(NicError::Os { .. }) => {}
            other => panic!("destroying an SRQ a QP uses: expected a busy error, got {other:?}"),
        }
        nic.post_srq_recv(srq, 0x5a00_0005, Sge { mr: rx.id, offset: 0, len: SLOT as u32 })
            .expect("the SRQ is still there");
        nic.destroy_qp(b.id).expect("destroy qp b");
        nic.destroy_qp(a.id).expect("destroy qp a");
        nic.destroy_srq(srq).expect("destroy the SRQ once its QP is gone");
        assert!(
            matches!(nic.take_srq_limit(srq), Err(NicError::NoSuchObject { .. })),
            "a destroyed SRQ is gone"
        );
        nic.dereg_mr(rx.id).expect("dereg rx");
        nic.dereg_mr(tx.id).expect("dereg tx");
    }
}
