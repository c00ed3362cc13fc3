//! The verbs suite: runs on a real device, inside the SoftRoCE VM
//! (`tests/softroce/verbs-suite.sh`). One test per conformance scenario,
//! checked in the rxe flavor on two `VerbsNic` handles on rxe0 (loopback),
//! plus tests of the verbs layer itself.
//!
//! The device, port and GID index come from `MWCAP_DEVICE` (default `rxe0`),
//! `MWCAP_PORT` (1) and `MWCAP_GID_INDEX` (1).
#![cfg(feature = "verbs")]

use std::time::Duration;

use futures::future::{select, Either};
use mwcap::backend::{rkey, Access, Nic, NicError, QpConfig, SendWr, Sge, SgeList, WcOpcode, WcStatus};
use mwcap::conformance::{check, table, Flavor, Rig};
use mwcap::verbs::{list_devices, Context, OpenError, VerbsNic};

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
    let bad = SendWr::BindMw {
        wr_id: 9,
        signaled: true,
        mw: mw.id,
        rkey: foreign,
        mr: src.id,
        offset: 0,
        len: 4096,
        access: Access::REMOTE_READ,
    };
    assert!(matches!(nic.post_send(l.a.id, &[bad]), Err(NicError::InvalidWr(_))));
    assert_eq!(nic.mw_rkey(mw.id).expect("rkey"), mw.rkey, "a refused bind changes nothing");

    let mut seen = vec![mw.rkey];
    for round in 0..3u64 {
        let current = nic.mw_rkey(mw.id).expect("rkey");
        let new = rkey::rebind(current, rand::random());
        let bind = SendWr::BindMw {
            wr_id: round,
            signaled: true,
            mw: mw.id,
            rkey: new,
            mr: src.id,
            offset: 0,
            len: 4096,
            access: Access::REMOTE_READ,
        };
        nic.post_send(l.a.id, &[bind]).expect("bind");
        assert_eq!(nic.mw_rkey(mw.id).expect("rkey"), new, "tracked after the post");
        let c = poll_one(&nic, l.cq_a);
        assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::BindMw), "{c:?}");
        assert_eq!(rkey::index(new), rkey::index(mw.rkey));
        assert!(!seen.contains(&new) || seen.len() > 255);
        seen.push(new);
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
            let send =
                SendWr::Send { wr_id: 2, signaled: true, sge: SgeList::from([Sge { mr: buf.id, offset: 0, len: 5 }]) };
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
    let bind = SendWr::BindMw {
        wr_id: 1,
        signaled: true,
        mw: mw.id,
        rkey: new,
        mr: src.id,
        offset: 0,
        len: 4096,
        access: Access::REMOTE_READ,
    };
    nic.post_send(l.a.id, &[bind]).expect("bind");
    assert_eq!(poll_one(&nic, l.cq_a).status, WcStatus::Success);
    // The device refuses; the region stays registered and usable.
    assert!(nic.dereg_mr(src.id).is_err(), "deregistering under a bound window must fail");
    nic.write_mr(src.id, 0, b"still here").expect("region still usable");
    nic.dealloc_mw(mw.id).expect("dealloc");
    nic.dereg_mr(src.id).expect("dereg after the window is gone");
}

// ---- whole connections on real verbs: the Endpoint over two PDs of rxe0 ----

mod endpoints {
    use std::time::{Duration, Instant};

    use mwcap::conn::{CallError, Config, Endpoint, Event, Policies, Policy, Role};
    use mwcap::verbs::VerbsNic;

    struct Live {
        epoch: Instant,
        client: Endpoint<VerbsNic>,
        server: Endpoint<VerbsNic>,
        cev: Vec<Event>,
        sev: Vec<Event>,
    }

    impl Live {
        fn new(p: Policies, tweak: impl Fn(&mut Config)) -> Live {
            let cfg = |role| {
                let mut c = Config::new(role, p);
                c.buffers = 4;
                c.buffer_size = 16 << 10;
                c.ctrl_slots = 16;
                tweak(&mut c);
                c
            };
            let mut client = Endpoint::new(super::open(), cfg(Role::Client)).expect("client endpoint");
            let mut server = Endpoint::new(super::open(), cfg(Role::Server)).expect("server endpoint");
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
                assert!(Instant::now() < end, "timed out waiting for: {what}\nclient: {:?}\nserver: {:?}", self.cev, self.sev);
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
                l.client.write(&mut b, &vec![i; 3000]).unwrap();
                let now = l.now();
                let call = l.client.call(now, b"req", Some(b)).unwrap();
                l.until("the request", |l| l.sev.iter().any(|e| matches!(e, Event::Request { .. })));
                let i_req = l.sev.iter().position(|e| matches!(e, Event::Request { .. })).unwrap();
                let Event::Request { req, data: Some(d), .. } = l.sev.remove(i_req) else { panic!("no payload") };
                assert_eq!(l.server.read(&d).unwrap(), vec![i; 3000], "{pol:?}");
                l.server.free(d);
                let mut out = l.server.alloc().unwrap();
                l.server.write(&mut out, &vec![!i; 5000]).unwrap();
                let now = l.now();
                l.server.reply(now, req, 0, b"rep", Some(out)).unwrap();
                l.until("the reply", |l| l.cev.iter().any(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. })));
                let i_rep = l.cev.iter().position(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. })).unwrap();
                match l.cev.remove(i_rep) {
                    Event::Reply { call: c, data: Some(d), .. } => {
                        assert_eq!(c, call);
                        assert_eq!(l.client.read(&d).unwrap(), vec![!i; 5000], "{pol:?}");
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
            c.call_timeout = Duration::from_millis(100);
            c.lease_time = Duration::from_millis(600);
            c.safety_margin = Duration::from_millis(100);
        });
        let mut b = l.client.alloc().unwrap();
        l.client.write(&mut b, b"never answered").unwrap();
        let now = l.now();
        let call = l.client.call(now, b"slow", Some(b)).unwrap();
        l.until("the call to time out", |l| l.cev.contains(&Event::CallFailed { call, error: CallError::TimedOut }));
        assert_eq!(l.client.busy_buffers(), 1, "a timeout alone must not return the buffer");
        l.until("the buffer back after the lease", |l| l.client.busy_buffers() == 0);
        assert!(l.now() >= Duration::from_millis(600), "returned before the lease could have ended");
        assert!(l.client.is_down().is_none() && l.server.is_down().is_none(), "a timeout must not tear down the connection");
        let now = l.now();
        let ping = l.client.call(now, b"ping", None).unwrap();
        l.until("the ping request", |l| l.sev.iter().filter(|e| matches!(e, Event::Request { .. })).count() == 2);
        let Some(Event::Request { req, .. }) = l.sev.iter().rev().find(|e| matches!(e, Event::Request { .. })).map(|e| match e {
            Event::Request { req, header, .. } => Event::Request { req: *req, header: header.clone(), data: None },
            _ => unreachable!(),
        }) else { unreachable!() };
        let now = l.now();
        l.server.reply(now, req, 0, b"pong", None).unwrap();
        l.until("the pong", |l| l.cev.iter().any(|e| matches!(e, Event::Reply { call, .. } if *call == ping)));
    }
}
