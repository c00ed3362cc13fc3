//! An [`Endpoint`] with shared receives
//! ([`EndpointBuilder::shared_receives`]): its connections' QPs take their
//! control receives from one shared receive queue, each with a share that
//! follows its load. On the simulated NIC, whose SRQ model (with its limit
//! event) is checked first.

use mwcap::backend::NicOps;
use std::time::{Duration, Instant};

use futures::executor::LocalPool;
use mwcap::backend::{rkey, Access, Completion, QpConfig, SendWr, Sge, SgeList, WcOpcode, WcStatus};
use mwcap::conn::{
    ConfigError, Connection, Endpoint, EndpointBuilder, Event, Link, LossReason, Pending, Policies, Policy,
    PolicyChoice, Role, SetupError, SrqConfig,
};
use mwcap::sim::{DeviceConfig, DeviceId, Fabric, SimNic};

mod hubs;
use hubs::{builder, pattern, serve, serve_clients, spawn, Side};

fn cfg(role: Role) -> Side {
    let mut c = Side::new(role, Policies::both(Policy::Mw));
    c.buffers = 8;
    c.large_buffers = vec![mwcap::conn::BufClass { size: 256 * 1024, count: 1 }];
    c.ctrl_slots = 32;
    c.lease_time = Duration::from_millis(300);
    c.safety_margin = Duration::from_millis(50);
    c.call_timeout = Duration::from_secs(5);
    c
}

/// The builder of an endpoint (mw) on `sn` with shared receives `srq`.
fn shared(sn: SimNic, depth: u32, srq: SrqConfig) -> EndpointBuilder<SimNic> {
    builder(sn).policy(PolicyChoice::Mw).queue_depth(depth).shared_receives(srq)
}

/// A client endpoint (receive queues of their own) and a server endpoint
/// with shared receives, both driven on `pool`; and the client's device.
fn endpoints(
    dev: DeviceConfig,
    srq: SrqConfig,
) -> (Fabric, Endpoint<SimNic>, Endpoint<SimNic>, LocalPool, DeviceId) {
    let fabric = Fabric::with_seed(21);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(dev.named("s"));
    let cdev = cn.device();
    let pool = LocalPool::new();
    let ch = hubs::endpoint(&pool, builder(cn).queue_depth(1 << 16));
    let sh = hubs::endpoint(&pool, shared(sn, 1 << 16, srq));
    (fabric, ch, sh, pool, cdev)
}

/// A client on `ch` and a server on `sh`, connected: (client, server).
fn pair(
    ch: &Endpoint<SimNic>,
    sh: &Endpoint<SimNic>,
) -> Result<(Connection<SimNic>, Connection<SimNic>), SetupError> {
    let s = cfg(Role::Server).prepare(sh)?;
    let c = cfg(Role::Client).prepare(ch)?;
    let (ce, se) = (c.local(), s.local());
    Ok((c.connect(&se)?, s.connect(&ce)?))
}

/// A server queue pair (mw) on `sh` and a client link with a CQ of its own
/// on a new PD of `client_nic`, connected to it:
/// [`hubs::server_with_link_client`] with this file's settings.
fn server_with_link_client(sh: &Endpoint<SimNic>, client_nic: &SimNic) -> (Pending<SimNic>, Link<SimNic>) {
    hubs::server_with_link_client(sh, client_nic, cfg(Role::Server), cfg(Role::Client))
}

/// A call with `payload` on the hand-driven `client`, driven (and `pool`,
/// where its server runs) until its reply comes: the reply's payload.
fn call_by_hand(pool: &mut LocalPool, fabric: &Fabric, client: &mut Link<SimNic>, payload: &[u8]) -> Vec<u8> {
    let mut b = client.alloc().expect("a buffer");
    b.copy_from(payload).unwrap();
    client.call(fabric.now(), b"x", Some(b)).expect("the call is taken");
    let t0 = Instant::now();
    loop {
        client.handle_timeout(fabric.now());
        client.drive(fabric.now());
        while let Some(e) = client.poll_event() {
            match e {
                Event::Reply { data, .. } => {
                    let bytes = data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                    if let Some(d) = data {
                        client.free(d);
                    }
                    return bytes;
                }
                Event::CallFailed { error, .. } => panic!("the call failed: {error}"),
                Event::BufferReturned(b) => client.free(b),
                _ => {}
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no reply: {:?}", client.stats());
        pool.run_until(async_io::Timer::after(Duration::from_millis(1)));
    }
}

/// 12 calls on `c` at once, call `k` with a payload of `sizes[k % len]`
/// bytes (none for 0) holding the pattern of `seed + k`; each must come
/// back with exactly those bytes reversed ([`serve`]), or no payload for
/// none. The reply payloads are freed.
async fn twelve_checked_calls(c: &Connection<SimNic>, seed: usize, sizes: &[usize]) {
    let calls = (0..12usize).map(|k| async move {
        let len = sizes[k % sizes.len()];
        let data = if len == 0 {
            None
        } else {
            let mut b = c.alloc_for(len).await.unwrap();
            b.copy_from(&pattern(seed + k, len)).unwrap();
            Some(b)
        };
        let r = c.call(b"x", data).await.unwrap_or_else(|e| panic!("calls {seed}, call {k}: {e}"));
        let got = r.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
        let mut want = pattern(seed + k, len);
        want.reverse();
        assert!(got == want, "calls {seed}, call {k}: not its own bytes");
        if let Some(d) = r.data {
            c.free(d);
        }
    });
    futures::future::join_all(calls).await;
}

fn rnr_naks(fabric: &Fabric, c: &Connection<SimNic>, dev: DeviceId) -> u64 {
    let addr = mwcap::sim::QpAddr { device: dev, qpn: c.qp_number() };
    fabric.qp_counters(addr).map_or(0, |q| q.rnr_naks)
}

/// The simulator's SRQ: QPs of one PD take its receives oldest first, each
/// completion carries its own QP's number; the limit event fires once; a
/// QP in ERR flushes none of them; a QP of another PD cannot use it.
/// Posts `n` pings on `link`'s QP, unsignaled, eight to a doorbell: a peer
/// that sends before its ready byte.
fn flood_pings(link: &Link<SimNic>, n: u64) {
    use mwcap::conn::frame::Frame;
    let tx = link.nic().reg_mr(n as usize * 64, Access::LOCAL_WRITE).unwrap();
    let mut wrs = Vec::new();
    for i in 0..n {
        let bytes = Frame::Ping { seq: i }.encode().unwrap();
        link.nic().write_mr(tx.id, i as usize * 64, &bytes).unwrap();
        let sge = SgeList::one(Sge { mr: tx.id, offset: i as usize * 64, len: bytes.len() as u32 });
        wrs.push(SendWr::Send { wr_id: 0xf100 + i, signaled: false, sge });
    }
    for chunk in wrs.chunks(8) {
        link.nic().post_send(link.local().id, chunk).unwrap();
    }
}

#[test]
fn the_simulated_srq_serves_its_qps_in_post_order_and_raises_its_limit_once() {
    let fabric = Fabric::with_seed(5);
    let a = fabric.add_device(DeviceConfig::spec().named("a"));
    let b = fabric.add_device(DeviceConfig::spec().named("b"));
    let b2 = b.same_pd().unwrap();
    let srq = b.create_srq(8).unwrap();
    let ring = b.reg_mr(8 * 64, Access::LOCAL_WRITE).unwrap();
    for k in 0..4u64 {
        let sge = Sge { mr: ring.id, offset: k as usize * 64, len: 64 };
        b.post_srq_recv(srq, 100 + k, sge).unwrap();
    }
    b.arm_srq_limit(srq, 3).unwrap();
    let (acq, bcq) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let mut on_srq = QpConfig::new(bcq, bcq);
    on_srq.srq = Some(srq);
    let (b1, b2q) = (b.create_qp(on_srq).unwrap(), b2.create_qp(on_srq).unwrap());
    let (a1, a2) =
        (a.create_qp(QpConfig::new(acq, acq)).unwrap(), a.create_qp(QpConfig::new(acq, acq)).unwrap());
    for (x, y, xn, yn) in [(a1, b1, &a, &b), (a2, b2q, &a, &b2)] {
        xn.connect_qp(x.id, &y).unwrap();
        yn.connect_qp(y.id, &x).unwrap();
    }
    // A QP of another PD cannot take receives from it.
    let other = b.new_pd().unwrap();
    assert!(other.create_qp(on_srq).is_err(), "an SRQ of another PD");
    assert!(
        b.post_recv(b1.id, 1, Sge { mr: ring.id, offset: 0, len: 64 }).is_err(),
        "post_recv on an SRQ QP"
    );
    let src = a.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let send = |qp: &mwcap::backend::QpEndpoint, byte: u8| {
        a.write_mr(src.id, 0, &[byte; 16]).unwrap();
        let wr = SendWr::Send {
            wr_id: u64::from(byte),
            sge: SgeList::one(Sge { mr: src.id, offset: 0, len: 16 }),
            signaled: true,
        };
        a.post_send(qp.id, &[wr]).unwrap();
        fabric.run_until_idle();
    };
    send(&a2, 1);
    assert!(!b.take_srq_limit(srq).unwrap(), "3 left: not below the limit yet");
    send(&a1, 2);
    let got: Vec<Completion> = b.poll_cq_vec(bcq, 8).unwrap();
    let recvs: Vec<(u64, u32)> =
        got.iter().filter(|c| c.opcode == WcOpcode::Recv).map(|c| (c.wr_id, c.qpn)).collect();
    assert_eq!(recvs, vec![(100, b2q.qpn), (101, b1.qpn)], "oldest first, each with its QP's number");
    let mut bytes = [0u8; 16];
    b.read_mr(ring.id, 64, &mut bytes).unwrap();
    assert_eq!(bytes, [2; 16]);
    assert!(b.take_srq_limit(srq).unwrap(), "2 left, below 3: the event");
    assert!(!b.take_srq_limit(srq).unwrap(), "once");
    // A QP in ERR flushes none of the SRQ's receives: the other QP still
    // gets them.
    b.set_qp_error(b1.id).unwrap();
    fabric.run_until_idle();
    let flushed: Vec<Completion> = b.poll_cq_vec(bcq, 8).unwrap();
    assert!(flushed.iter().all(|c| c.opcode != WcOpcode::Recv), "{flushed:?}");
    send(&a2, 3);
    let got = b.poll_cq_vec(bcq, 8).unwrap();
    assert!(got
        .iter()
        .any(|c| c.opcode == WcOpcode::Recv && c.wr_id == 102 && c.status == WcStatus::Success));
    // Busy while a QP uses it; gone after.
    assert!(b.destroy_srq(srq).is_err());
    b.destroy_qp(b1.id).unwrap();
    b2.destroy_qp(b2q.id).unwrap();
    b.destroy_srq(srq).unwrap();
    // With the SRQ empty, a SEND finds no receive: RNR, as for a QP's own.
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// Forty connections on a server endpoint with shared receives: every byte
/// is their own, idle shares are 8 receives, busy ones grow, nobody meets
/// receiver-not-ready, and every share comes back at the end.
#[test]
fn forty_connections_share_one_receive_queue_and_shares_follow_load() {
    let (fabric, ch, sh, mut pool, cdev) =
        endpoints(DeviceConfig::spec(), SrqConfig { chunk: 64, max_slots: 4096 });
    let n = 40;
    let mut conns = Vec::new();
    for _ in 0..n {
        let (c, s) = pair(&ch, &sh).unwrap();
        spawn(&pool, serve(s.clone()));
        conns.push((c, s));
    }
    let st = sh.stats().srq.expect("shared receives");
    assert_eq!(st.shares, 8 * n as u32, "an idle connection holds 8: {st:?}");
    // The queue's receives are reserved once; each connection reserves
    // only its send side.
    let sends = sh.stats().reserved_entries - 4096;
    assert_eq!(sends % n as u64, 0);
    assert!(sends / (n as u64) < 100, "{:?}", sh.stats());
    assert_eq!(st.slots, 320, "five chunks of 64 hold 40 x 8: {st:?}");
    for (_, s) in &conns {
        assert_eq!(s.stats().receive_share, 8);
    }
    // The first ten connections are busy: 12 calls in flight each.
    let sizes = [0usize, 100, 3000, 20_000];
    let busy = conns.iter().take(10).enumerate().map(|(i, (c, _))| twelve_checked_calls(c, i * 100, &sizes));
    pool.run_until(futures::future::join_all(busy));
    let st = sh.stats().srq.unwrap();
    assert!(st.grown > 0, "busy connections' shares grew: {st:?}");
    assert!(st.frames >= 120, "{st:?}");
    let grown = conns.iter().take(10).filter(|(_, s)| s.stats().receive_share > 8).count();
    assert!(grown > 0, "a busy connection holds more than 8");
    for (_, s) in conns.iter().skip(10) {
        assert_eq!(s.stats().receive_share, 8, "an idle connection stays at 8");
    }
    assert!(st.shares <= st.slots, "{st:?}");
    // The send slots: the endpoint's, lent per frame in flight (the busy
    // ten had up to 12 calls' frames each; one chunk of 256 held them).
    // Now that every connection is idle, a busy one keeps at most those of
    // the unsignaled frames after its last signaled one (32 send slots: one
    // frame in 16 is signaled), the idle thirty none.
    assert_eq!(st.send_slots, 256, "{st:?}");
    assert!(st.send_slots_lent <= 10 * 15, "{st:?}");
    for (c, _) in &conns {
        assert_eq!(c.stats().calls_failed, 0);
        assert_eq!(rnr_naks(&fabric, c, cdev), 0);
    }
    for (c, s) in &conns {
        c.close();
        s.close();
    }
    let reasons = pool.run_until(futures::future::join_all(
        conns.iter().map(|(c, s)| futures::future::join(c.finished(), s.finished())),
    ));
    drop(conns);
    for (c, _) in &reasons {
        assert_eq!(*c, LossReason::Closed);
    }
    let st = sh.stats();
    assert_eq!(st.connections, 0);
    assert_eq!(st.orphans, 0);
    assert_eq!(st.srq.unwrap().shares, 0, "every share came back");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A queue at its most: the connection that does not fit is refused with
/// `SrqBudget` (and only it), the ones on it still work, shares cannot
/// grow, and the room comes back when one leaves.
#[test]
fn a_full_shared_queue_refuses_the_next_connection_and_keeps_serving_the_rest() {
    let (fabric, ch, sh, mut pool, _) =
        endpoints(DeviceConfig::spec(), SrqConfig { chunk: 16, max_slots: 32 });
    let mut conns = Vec::new();
    for _ in 0..4 {
        let (c, s) = pair(&ch, &sh).unwrap();
        spawn(&pool, serve(s.clone()));
        conns.push((c, s));
    }
    match pair(&ch, &sh) {
        Err(SetupError::SrqBudget { max_slots: 32, shares: 32 }) => {}
        Err(e) => panic!("refused with {e:?}"),
        Ok(_) => panic!("a fifth connection fit in 32 receives"),
    }
    assert_eq!(sh.stats().srq.unwrap().refused, 1);
    let calls = conns.iter().enumerate().map(|(i, (c, _))| async move {
        for k in 0..10usize {
            let mut b = c.alloc_for(500).await.unwrap();
            b.copy_from(&pattern(i + k, 500)).unwrap();
            let r = c.call(b"x", Some(b)).await.unwrap();
            let mut want = pattern(i + k, 500);
            want.reverse();
            let d = r.data.unwrap();
            assert_eq!(d.to_vec(), want);
            c.free(d);
        }
    });
    pool.run_until(futures::future::join_all(calls));
    let st = sh.stats().srq.unwrap();
    assert_eq!((st.slots, st.shares, st.grown), (32, 32, 0), "no room to grow: {st:?}");
    // One leaves: its share comes back and the next connection fits.
    let (c, s) = conns.pop().unwrap();
    c.close();
    s.close();
    pool.run_until(futures::future::join(c.finished(), s.finished()));
    // (The others may have grown into some of the room since.)
    assert!(sh.stats().srq.unwrap().shares < 32, "{:?}", sh.stats().srq);
    pair(&ch, &sh).expect("room again");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// An endpoint with shared receives reserves every receive of its queue in its
/// completion queue up front (a peer past its credit may fill them all
/// before the driver polls): a completion queue not deeper than that is
/// refused.
#[test]
fn a_hub_with_shared_receives_reserves_its_receives_in_the_completion_queue() {
    let fabric = Fabric::with_seed(3);
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let q = SrqConfig { chunk: 64, max_slots: 1000 };
    match shared(sn.clone(), 1000, q).build() {
        Err(SetupError::CqBudget { depth: 1000, wanted: 1000, .. }) => {}
        Err(e) => panic!("refused with {e}"),
        Ok(_) => panic!("a completion queue of 1000 entries took 1000 receives and more"),
    }
    let (sh, _d) = shared(sn, 1 << 12, q).build().unwrap();
    assert_eq!(sh.stats().reserved_entries, 1000);
}

/// An endpoint with shared receives puts its connections in one protection
/// domain, which the confirm policy's region keys would cross: it refuses
/// a connection that negotiated confirm, saying why.
#[test]
fn a_hub_with_shared_receives_refuses_confirm_and_says_why() {
    let fabric = Fabric::with_seed(3);
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let (sh, _drv) = shared(sn, 1 << 14, SrqConfig::default()).build().unwrap();
    let mut c = cfg(Role::Server);
    c.policies = Policies { request: Policy::Confirm, reply: Policy::Mw };
    let e = c.prepare(&sh).expect_err("refused");
    let msg = e.to_string();
    assert!(msg.contains("mw policy only") && msg.contains("PolicyChoice::Mw"), "{msg}");
    let want = ConfigError::SharedReceivesNeedMw { request: Policy::Confirm, reply: Policy::Mw };
    assert!(matches!(&e, SetupError::Config(c) if *c == want), "{e:?}");
    let small = SrqConfig { chunk: 2, max_slots: 64 };
    let e = shared(fabric.add_device(DeviceConfig::spec()), 1 << 14, small).build().err();
    assert!(
        matches!(e, Some(SetupError::Config(ConfigError::BadSrqConfig { chunk: 2, max_slots: 64, .. }))),
        "{e:?}"
    );
    assert_eq!(sh.stats().srq.unwrap().shares, 0, "its share came back");
}

/// With trusted peers an endpoint with shared receives serves confirm
/// connections too (their data regions, readable by key, are in the
/// endpoint's protection domain): each call's payloads come back right.
#[test]
fn with_trusted_peers_shared_receives_serve_confirm() {
    let fabric = Fabric::with_seed(5);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let ch = hubs::endpoint(&pool, builder(cn).queue_depth(1 << 16));
    let trusted = builder(sn)
        .policy(PolicyChoice::Confirm)
        .trusted_peers(true)
        .queue_depth(1 << 16)
        .shared_receives(SrqConfig::default());
    let sh = hubs::endpoint(&pool, trusted);
    let side = |role| {
        let mut c = cfg(role);
        c.policies = Policies::both(Policy::Confirm);
        c
    };
    let conns: Vec<_> =
        (0..4).map(|_| hubs::pair(&ch, &sh, side(Role::Client), side(Role::Server))).collect();
    for (_, s) in &conns {
        spawn(&pool, serve(s.clone()));
    }
    pool.run_until(futures::future::join_all(conns.iter().enumerate().map(|(i, (c, _))| async move {
        for j in 0..5 {
            let len = 100 + 997 * (i + j);
            let mut b = c.alloc_for(len).await.unwrap();
            b.copy_from(&pattern(i * 10 + j, len)).unwrap();
            let r = c.call(b"x", Some(b)).await.unwrap_or_else(|e| panic!("conn {i} call {j}: {e}"));
            let mut want = pattern(i * 10 + j, len);
            want.reverse();
            assert!(r.data.as_ref().unwrap().to_vec() == want, "conn {i} call {j}: not its own bytes");
        }
    })));
    assert!(sh.stats().srq.unwrap().frames >= 4 * 5, "the requests came through the shared queue");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// On an rxe-like device (windows reach their whole region) the shared PD
/// gives a peer nothing of another connection: the regions allow no remote
/// READ, and another connection's window is scoped to its QP. A READ with
/// the victim's window key through the attacker's own QP fails; the same
/// READ through the victim's QP succeeds; the victim goes on.
#[test]
fn on_rxe_a_peer_on_the_shared_pd_reaches_nothing_of_another_connection() {
    let fabric = Fabric::with_seed(13);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::rxe().named("s"));
    let mut pool = LocalPool::new();
    let sh = hubs::endpoint(&pool, shared(sn, 1 << 14, SrqConfig::default()));
    let on_endpoint = || server_with_link_client(&sh, &cn);
    let (victim_s, mut victim_c) = on_endpoint();
    let (attack_s, attack_c) = on_endpoint();
    // What the test reaches into of the victim's server side, before it
    // runs on the endpoint.
    let secret = victim_s.link().data_region();
    let victim_nic = victim_s.link().nic().clone();
    let victim_qp = victim_s.local().id;
    // Both connected, so both run on the endpoint; its driver takes no
    // turn until the pool runs, at the victim's call below.
    let victim = victim_s.connect(&victim_c.local()).unwrap();
    let _attacked = attack_s.connect(&attack_c.local()).unwrap();
    victim_nic.write_mr(secret.id, 0, b"the victim's bytes").unwrap();
    // A window over the victim's bytes, bound on the victim's QP.
    let mw = victim_nic.alloc_mw().unwrap();
    let wkey = rkey::rebind(mw.rkey, 0x5a);
    let bind = SendWr::BindMw {
        wr_id: 0xb1,
        signaled: false,
        mw: mw.id,
        rkey: wkey,
        mr: secret.id,
        offset: 0,
        len: 18,
        access: Access::REMOTE_READ,
    };
    victim_nic.post_send(victim_qp, &[bind]).unwrap();
    fabric.run_until_idle();
    let read = |ep: &Link<SimNic>, key: u32, wr_id: u64| {
        let dst = ep.data_region();
        let wr = SendWr::Read {
            wr_id,
            local: SgeList::one(Sge { mr: dst.id, offset: 0, len: 18 }),
            remote_addr: secret.addr,
            rkey: key,
            signaled: true,
        };
        ep.nic().post_send(ep.local().id, &[wr]).unwrap();
        fabric.run_until_idle();
        let got = ep.nic().poll_cq_vec(ep.cq(), 256).unwrap();
        let c =
            *got.iter().find(|c| c.wr_id == wr_id).unwrap_or_else(|| panic!("the READ completes: {got:?}"));
        let mut seen = [0u8; 18];
        ep.nic().read_mr(dst.id, 0, &mut seen).unwrap();
        (c.status, seen)
    };
    let (status, seen) = read(&attack_c, secret.rkey, 0xbad1);
    assert_ne!(status, WcStatus::Success, "the region's own key reached it");
    assert_ne!(&seen, b"the victim's bytes");
    let (status, seen) = read(&attack_c, wkey, 0xbad2);
    assert_ne!(status, WcStatus::Success, "another connection's window reached through the shared PD");
    assert_ne!(&seen, b"the victim's bytes");
    // The window itself is good: through the victim's own QP it reads.
    let (status, seen) = read(&victim_c, wkey, 0x600d);
    assert_eq!(status, WcStatus::Success);
    assert_eq!(&seen, b"the victim's bytes");
    // The victim goes on: a call from its client, still driven by hand.
    spawn(&pool, serve(victim.clone()));
    let r = call_by_hand(&mut pool, &fabric, &mut victim_c, b"abc");
    assert_eq!(r, b"cba", "the victim's call");
    assert!(victim.is_down().is_none());
}

/// Shares grown by a busy connection shrink again when the queue, at its
/// most, has less than one connection's room free: the next connection
/// then fits, and nobody meets receiver-not-ready on the way.
#[test]
fn grown_shares_shrink_to_make_room_when_the_queue_is_at_its_most() {
    let (fabric, ch, sh, mut pool, cdev) =
        endpoints(DeviceConfig::spec(), SrqConfig { chunk: 16, max_slots: 48 });
    let mut conns = Vec::new();
    let busy = |conns: &Vec<(Connection<SimNic>, Connection<SimNic>)>,
                pool: &mut LocalPool,
                rounds: usize| {
        let c = conns[0].0.clone();
        let srv = conns[0].1.clone();
        pool.run_until(async move {
            for r in 0..rounds {
                let calls = (0..4usize).map(|k| {
                    let c = c.clone();
                    let srv = srv.clone();
                    async move {
                        let mut b = c.alloc_for(100).await.unwrap();
                        b.copy_from(&pattern(r + k, 100)).unwrap();
                        let d = match c.call(b"x", Some(b)).await {
                            Ok(r) => r.data.unwrap(),
                            Err(e) => {
                                panic!("round {r} call {k}: {e}: {:?}\nserver {:?}", c.stats(), srv.stats())
                            }
                        };
                        let mut want = pattern(r + k, 100);
                        want.reverse();
                        assert_eq!(d.to_vec(), want);
                        c.free(d);
                    }
                });
                futures::future::join_all(calls).await;
            }
        });
    };
    for _ in 0..4 {
        let (cl, sv) = pair(&ch, &sh).unwrap();
        spawn(&pool, serve(sv.clone()));
        conns.push((cl, sv));
    }
    busy(&conns, &mut pool, 16);
    let st = sh.stats().srq.unwrap();
    assert!(st.grown > 0 && conns[0].1.stats().receive_share > 8, "{st:?}");
    // A fifth fits in what is free; then the queue is at its most.
    let (cl, sv) = pair(&ch, &sh).expect("a fifth fits");
    spawn(&pool, serve(sv.clone()));
    conns.push((cl, sv));
    let before = sh.stats().srq.unwrap();
    assert_eq!(before.slots, 48);
    busy(&conns, &mut pool, 16);
    let st = sh.stats().srq.unwrap();
    assert!(st.withheld > 0, "the busy share shrank: {before:?} -> {st:?}");
    assert!(st.slots - st.shares >= 8, "room for one more: {st:?}");
    let (cl, sv) = pair(&ch, &sh).expect("a sixth fits after the shrink");
    conns.push((cl, sv));
    for (c, _) in &conns {
        assert_eq!(rnr_naks(&fabric, c, cdev), 0);
        assert_eq!(c.stats().calls_failed, 0);
    }
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A peer that ignores flow control and floods SENDs takes receives of
/// the shared queue held for others. The server grants each frame's
/// receive again as it goes, but its grants ride on frames the flooder must
/// give it credit for, which it never does: once the server can send no more
/// grants, the next frame is past everything granted and the flooder's
/// connection goes down (`ExceedsCredit`). The other connection on the
/// endpoint goes on with every call answered.
#[test]
fn a_flood_past_its_credit_ends_the_flooders_connection_and_not_the_others() {
    use mwcap::conn::frame::Frame;
    use mwcap::conn::Misbehavior;
    let fabric = Fabric::with_seed(31);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = hubs::endpoint(&pool, shared(sn, 1 << 14, SrqConfig { chunk: 32, max_slots: 64 }));
    // The victim's client: a connection on a client endpoint of its own.
    let ch = hubs::endpoint(&pool, builder(cn.clone()).queue_depth(1 << 14));
    let (vclient, victim) = hubs::pair(&ch, &sh, cfg(Role::Client), cfg(Role::Server));
    // The flooder: a link driven by hand.
    let (flood_s, flooder) = server_with_link_client(&sh, &cn);
    let flooded = flood_s.connect(&flooder.local()).unwrap();
    spawn(&pool, serve(victim.clone()));
    spawn(&pool, serve(flooded.clone()));
    // 48 pings at once from the flooder's own QP, past its 8 credits.
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
    for _ in 0..200 {
        pool.run_until_stalled();
        fabric.run_until_idle();
        if flooded.is_down().is_some() {
            break;
        }
    }
    match flooded.is_down() {
        Some(LossReason::PeerMisbehaved(Misbehavior::ExceedsCredit { granted, received }))
            if received == granted + 1 && received < 48 => {}
        other => panic!("the flooder's connection: {other:?} {:?} {:?}", flooded.stats(), sh.stats()),
    }
    // The victim, on the same queue, still gets answers.
    let r = pool.run_until(async {
        let mut got = Vec::new();
        for k in 0..10usize {
            let mut b = vclient.alloc_for(300).await.unwrap();
            b.copy_from(&pattern(k, 300)).unwrap();
            let d = vclient.call(b"x", Some(b)).await.expect("the victim's call").data.unwrap();
            got.push(d.to_vec());
            vclient.free(d);
        }
        got
    });
    for (k, bytes) in r.iter().enumerate() {
        let mut want = pattern(k, 300);
        want.reverse();
        assert_eq!(bytes, &want);
    }
    assert!(victim.is_down().is_none());
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
    drop(flooder);
}

/// `Config::send_slots` below `ctrl_slots`: a server on shared receives
/// registers no control memory of its own (its receives are the queue's,
/// its 3 send slots the endpoint's, lent while its SENDs are in flight and
/// all back once it is idle), its client (a receive queue of its own, 2
/// send slots) still keeps 12 calls going, and every one is answered with
/// its own bytes; fewer than 2 is refused.
#[test]
fn few_send_slots_keep_a_connections_control_memory_small_and_calls_flowing() {
    let (fabric, ch, sh, mut pool, _) =
        endpoints(DeviceConfig::spec(), SrqConfig { chunk: 64, max_slots: 1024 });
    let with_sends = |role, n| {
        let mut c = cfg(role);
        c.send_slots = Some(n);
        c
    };
    let s = with_sends(Role::Server, 3).prepare(&sh).unwrap();
    let c = with_sends(Role::Client, 2).prepare(&ch).unwrap();
    let data = s.link().data_region().len as u64;
    assert_eq!(s.link().registered_bytes(), data, "no send slots, no receive slots");
    assert_eq!(c.link().registered_bytes(), (2 + 32) * 4096 + data, "2 send slots, 32 receive slots");
    let (ce, se) = (c.local(), s.local());
    let (client, server) = (c.connect(&se).unwrap(), s.connect(&ce).unwrap());
    spawn(&pool, serve(server.clone()));
    pool.run_until(twelve_checked_calls(&client, 0, &[0, 100, 3000]));
    assert_eq!(client.stats().calls_failed, 0);
    // Idle once the last reply's window is released and invalidated (the
    // release's turn also takes the grant SEND's completion, which waited
    // for it in the inbox).
    pool.run_until(async {
        while server.stats().buffers_exposed > 0 {
            async_io::Timer::after(Duration::from_millis(2)).await;
        }
    });
    // Lent while the server sent (at most its 3), all back now it is idle:
    // with fewer than four send slots every frame is signaled, so its last
    // SEND's completion says that none is in flight.
    let st = sh.stats().srq.unwrap();
    assert_eq!((st.send_slots, st.send_slots_lent), (256, 0), "{st:?}");
    client.close();
    server.close();
    pool.run_until(futures::future::join(client.finished(), server.finished()));
    let mut bad = cfg(Role::Client);
    bad.send_slots = Some(1);
    match bad.prepare(&sh) {
        Err(SetupError::Config(e)) => assert!(e.to_string().contains("send_slots"), "{e}"),
        other => panic!("{:?}", other.map(|p| p.local())),
    }
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A connection that takes its initial share and never starts (its QP is
/// never connected, or its handshake fails once its QP is connected, so it
/// never runs on the endpoint) gives exactly that share back, and the
/// receives its peer's frames took while it waited are posted again when
/// it goes: the accounting stays true for the others.
#[test]
fn a_connection_that_never_runs_gives_back_its_share_and_its_peers_receives() {
    use mwcap::sim::{FabricConfig, Progress};
    let fabric = Fabric::new(FabricConfig::with_seed(9));
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    // A listener: building it probes the device, with the fabric moving by
    // itself; from then on nothing moves unless the test says so.
    let sh = hubs::endpoint(
        &pool,
        shared(sn, 1 << 14, SrqConfig { chunk: 64, max_slots: 1024 })
            .config(cfg(Role::Server).cfg)
            .handshake_timeout(Duration::from_secs(5))
            .listen("127.0.0.1:0".parse().unwrap()),
    );
    fabric.set_progress(Progress::Manual);
    let (keep, _keep_client) = {
        let (s, c) = server_with_link_client(&sh, &cn);
        (s.connect(&c.local()).unwrap(), c)
    };
    // Prepared but never connected (ctrl_slots 32): back go 8, not 32.
    let never = cfg(Role::Server).prepare(&sh).unwrap();
    assert_eq!(sh.stats().srq.unwrap().shares, 16);
    drop(never);
    assert_eq!(sh.stats().srq.unwrap().shares, 8, "exactly its initial share came back");

    // Connected, its peer's requests in the endpoint's queue, never run: a
    // server QP connected to a client's but never put on the endpoint, the
    // client sending three requests; then it goes.
    let (unadded, mut c) = hubs::connected_unadded(&sh, &cn, cfg(Role::Server), cfg(Role::Client));
    for _ in 0..3 {
        c.call(fabric.now(), b"never served", None).unwrap();
    }
    for _ in 0..10 {
        fabric.run_until_idle();
        pool.run_until_stalled();
    }
    let before = sh.stats().srq.unwrap();
    assert_eq!(before.frames, 0, "nobody took the frames yet");
    assert_eq!(before.shares, 16, "{before:?}");
    // Dropped: its connected queue pair goes.
    drop(unadded);
    let after = sh.stats().srq.unwrap();
    assert_eq!(after.unclaimed, 3, "its three receives were posted again: {after:?}");
    assert_eq!(after.shares, 8);
    assert_eq!(sh.stats().added, 1, "only `keep` ever ran");
    drop(keep);
}

/// A listening endpoint with shared receives: its clients (mw) all take
/// their receives from its one shared queue. An endpoint that may
/// negotiate confirm cannot have shared receives: it is refused at build.
#[test]
fn a_listening_endpoint_has_shared_receives_only_when_it_requires_mw() {
    use mwcap::bootstrap::{Auth, Key};
    let fabric = Fabric::with_seed(33);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let key = || Auth::Key(Key::from_bytes(b"a listener over mixed hubs: a test key".to_vec()).unwrap());
    let refused = Endpoint::builder(sn.new_pd().unwrap(), key())
        .policy(PolicyChoice::Auto)
        .shared_receives(SrqConfig::default())
        .listen("127.0.0.1:0".parse().unwrap())
        .build();
    let e = refused.err().expect("a client that may get confirm cannot share receives");
    assert!(
        matches!(e, SetupError::Config(ConfigError::SharingNeedsMw { choice: PolicyChoice::Auto })),
        "{e}"
    );
    let (server, sd) = Endpoint::builder(sn.new_pd().unwrap(), key())
        .policy(PolicyChoice::Mw)
        .config(cfg(Role::Server).cfg)
        .queue_depth(1 << 14)
        .shared_receives(SrqConfig::default())
        .handshake_timeout(Duration::from_secs(5))
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .unwrap();
    let (client, cd) = Endpoint::builder(cn, key())
        .policy(PolicyChoice::Mw)
        .config(cfg(Role::Client).cfg)
        .handshake_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    spawn(&pool, sd.run());
    spawn(&pool, cd.run());
    const CLIENTS: usize = 12;
    let served = serve_clients(&mut pool, std::slice::from_ref(&server), CLIENTS, &client);
    assert!(served.iter().all(|&ok| ok));
    let st = server.stats();
    assert_eq!(st.added, CLIENTS as u64);
    assert!(
        st.srq.is_some_and(|q| q.frames >= CLIENTS as u64),
        "every request came through the shared queue: {st:?}"
    );
    assert!(client.stats().srq.is_none(), "the client's endpoint has receive queues of its own");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// `Config::start_credits` travels in the hello. A server on shared
/// receives that offers 3 holds 3 receives per idle client (12 KiB, not
/// the default 32); its clients, which hold 8 for it, learn its 3 and keep
/// to them: 12 calls in flight each, every one answered with its own
/// bytes, no receiver-not-ready and no connection down. (Were a client to
/// take the server's start credits for its own 8, its burst would go past
/// the share and its connection would go down, `ExceedsCredit`.) Then a
/// client offering 3 to a server offering 8, over receives of its own.
#[test]
fn start_credits_are_told_in_the_hello_and_an_idle_connection_holds_only_those() {
    use mwcap::bootstrap::{Auth, Key};
    for (client_start, server_start) in [(8, 3), (3, 8)] {
        let fabric = Fabric::with_seed(35);
        let cn = fabric.add_device(DeviceConfig::spec().named("c"));
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let cdev = cn.device();
        let mut pool = LocalPool::new();
        let key = || Auth::Key(Key::from_bytes(b"start credits in the hello: a test key".to_vec()).unwrap());
        let mut scfg = cfg(Role::Server).cfg;
        scfg.start_credits = server_start;
        let (server, sd) = Endpoint::builder(sn, key())
            .policy(PolicyChoice::Mw)
            .config(scfg)
            .queue_depth(1 << 14)
            .shared_receives(SrqConfig { chunk: 16, max_slots: 1024 })
            .handshake_timeout(Duration::from_secs(5))
            .listen("127.0.0.1:0".parse().unwrap())
            .build()
            .unwrap();
        let mut ccfg = cfg(Role::Client).cfg;
        ccfg.start_credits = client_start;
        let (client, cd) = Endpoint::builder(cn, key())
            .policy(PolicyChoice::Mw)
            .config(ccfg)
            .handshake_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        spawn(&pool, sd.run());
        spawn(&pool, cd.run());
        const CLIENTS: usize = 6;
        let addr = server.local_addr().unwrap();
        let (conns, served) = pool.run_until(async {
            let accepts = async {
                let mut v = Vec::new();
                for _ in 0..CLIENTS {
                    v.push(server.accept().await.expect("a client"));
                }
                v
            };
            let connects = futures::future::join_all((0..CLIENTS).map(|_| client.connect(addr)));
            let (served, conns) = futures::future::join(accepts, connects).await;
            (conns.into_iter().map(|c| c.expect("connect")).collect::<Vec<_>>(), served)
        });
        let st = server.stats().srq.expect("shared receives");
        assert_eq!(
            st.shares,
            server_start * CLIENTS as u32,
            "each idle client holds the start credits: {st:?}"
        );
        // Before any frame: each side may send what the other offered.
        for c in &conns {
            assert_eq!(c.stats().credits, server_start, "the client's credit is the server's offer");
        }
        for s in &served {
            assert_eq!(s.stats().credits, client_start, "the server's credit is the client's offer");
            assert_eq!(s.stats().receive_share, server_start);
            spawn(&pool, serve(s.clone()));
        }
        let sizes = [0usize, 100, 3000];
        let busy = conns.iter().enumerate().take(3).map(|(i, c)| twelve_checked_calls(c, i * 100, &sizes));
        pool.run_until(futures::future::join_all(busy));
        for (i, c) in conns.iter().enumerate() {
            assert!(c.is_down().is_none(), "{client_start}/{server_start}: conn {i}");
            assert_eq!(c.stats().calls_failed, 0);
            assert_eq!(rnr_naks(&fabric, c, cdev), 0, "conn {i}: the client kept to the server's credit");
        }
        // (Accepted in an order of their own: the three idle ones are
        // those at the start credits.)
        let shares: Vec<u32> = served.iter().map(|s| s.stats().receive_share).collect();
        assert!(served.iter().all(|s| s.is_down().is_none()));
        assert!(shares.iter().all(|&n| n >= server_start), "a share below the start credits: {shares:?}");
        let idle = shares.iter().filter(|&&n| n == server_start).count();
        assert!(idle >= CLIENTS - 3, "idle connections stay at their start credits: {shares:?}");
        assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
    }
}

/// A client that proved the key and sent its hello, then SENDs at the
/// server's QP and never sends its ready byte. A listener connected the
/// server's QP before the client's ready byte, its route had no connection
/// yet and held every receive those SENDs took (posted again only when the
/// handshake timed out): the shared queue ran dry, and another connection's
/// request met RNR and lost its connection. The listener now connects a
/// server's QP only once the client said ready: the SENDs reach nothing.
#[test]
fn a_client_before_its_ready_byte_takes_none_of_the_shared_receives() {
    use mwcap::backend::QpState;
    let fabric = Fabric::with_seed(41);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let sdev = sn.device();
    let mut pool = LocalPool::new();
    let sh = hubs::endpoint(
        &pool,
        shared(sn, 1 << 14, SrqConfig { chunk: 32, max_slots: 32 })
            .config(cfg(Role::Server).cfg)
            .handshake_timeout(Duration::from_secs(5))
            .listen("127.0.0.1:0".parse().unwrap()),
    );
    let ch = hubs::endpoint(&pool, builder(cn.clone()).queue_depth(1 << 14));
    let (vclient, victim) = hubs::pair(&ch, &sh, cfg(Role::Client), cfg(Role::Server));
    spawn(&pool, serve(victim.clone()));
    pool.run_until(async { vclient.call(b"x", None).await.expect("the victim's first call") });
    let before = sh.stats().srq.unwrap();
    // The attacker: auth and hello, its own QP connected to the server's,
    // 40 pings, and never the ready byte.
    let mut c = cfg(Role::Client).link(cn.new_pd().unwrap()).unwrap();
    let (hs, at, _rx) = hubs::half_bootstrap(&mut pool, &sh, sdev, &mut c);
    flood_pings(&c, 40);
    for _ in 0..50 {
        fabric.run_until_idle();
        pool.run_until_stalled();
    }
    assert_ne!(fabric.qp_state(at), Some(QpState::Rts), "the server's QP is not up before the ready byte");
    let after = sh.stats().srq.unwrap();
    assert_eq!(after.frames, before.frames, "no frame of the attacker's took a shared receive: {after:?}");
    // The victim's next call is answered.
    let r = pool.run_until(async { vclient.call(b"x", None).await.map(|_| ()) });
    assert!(r.is_ok(), "an honest connection's call failed because of another peer's handshake: {r:?}");
    assert_eq!(rnr_naks(&fabric, &vclient, cn.device()), 0);
    drop(hs);
}

/// The mirror of the test above, for a client endpoint with shared
/// receives: a server that ran the auth and hello, connected its QP to the
/// client's and sent 40 SENDs without its ready byte. The client's QP is up
/// from the hello on, and its connection went on the endpoint only after
/// the ready byte: until then its route held every receive those SENDs
/// took, the shared queue ran dry, and another connection's reply met
/// RNR. The connection is now on the endpoint as soon as its QP is up:
/// the SENDs are frames it takes (past its credit they end only it), and
/// their receives go back to the queue.
#[test]
fn a_server_before_its_ready_byte_takes_none_of_a_clients_shared_receives() {
    use async_io::Async;
    use mwcap::bootstrap::{authenticate_server_async, Auth, Capabilities, Hello, PolicySet};
    let fabric = Fabric::with_seed(43);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mn = fabric.add_device(DeviceConfig::spec().named("m"));
    let sdev = sn.device();
    let mut pool = LocalPool::new();
    let ch = hubs::endpoint(
        &pool,
        shared(cn, 1 << 14, SrqConfig { chunk: 32, max_slots: 32 })
            .config(cfg(Role::Client).cfg)
            .handshake_timeout(Duration::from_secs(5)),
    );
    let sh = hubs::endpoint(&pool, builder(sn).queue_depth(1 << 14));
    let (vclient, victim) = hubs::pair(&ch, &sh, cfg(Role::Client), cfg(Role::Server));
    spawn(&pool, serve(victim.clone()));
    pool.run_until(async { vclient.call(b"x", None).await.expect("the victim's first call") });
    // The attacker: a server that runs auth and hello, connects its own QP
    // to the client's, sends 40 pings, and never the ready byte.
    let listener = Async::<std::net::TcpListener>::bind(([127, 0, 0, 1], 0)).unwrap();
    let addr = listener.get_ref().local_addr().unwrap();
    let client = ch.clone();
    spawn(&pool, async move {
        let _ = client.connect(addr).await;
    });
    let mut m = cfg(Role::Server).link(mn.new_pd().unwrap()).unwrap();
    let mut caps = Capabilities::new();
    caps.serve = PolicySet::MW;
    let hello = Hello::new(m.local(), caps);
    let hs = pool.run_until(async {
        let t = Duration::from_secs(5);
        let authed = authenticate_server_async(&listener, &Auth::Unauthenticated, t).await.expect("auth");
        authed.hello(&hello, t).await.expect("hello")
    });
    m.connect(&hs.remote_endpoint()).unwrap();
    flood_pings(&m, 40);
    for _ in 0..50 {
        fabric.run_until_idle();
        pool.run_until_stalled();
    }
    // The victim's next calls are answered, their replies never refused.
    for _ in 0..3 {
        let r = pool.run_until(async { vclient.call(b"x", None).await.map(|_| ()) });
        assert!(r.is_ok(), "an honest connection's call failed because of another peer's handshake: {r:?}");
    }
    assert_eq!(rnr_naks(&fabric, &victim, sdev), 0, "the honest server's replies met no empty queue");
    drop(hs);
}

/// A connection whose share grew while it was busy gives it back once its
/// peer has been idle for `Config::give_back_after` (1 s by default): the
/// endpoint asks the peer
/// (`GiveBack`), the peer returns the credit past the start credits
/// (`Returned`), and the receives are free for others. Before, a grown
/// share shrank only as frames came, so idle connections kept a full queue
/// full and new connections were refused for good.
#[test]
fn an_idle_connections_grown_share_comes_back_and_makes_room() {
    let give_back_after = mwcap::conn::Config::default().give_back_after;
    let (fabric, ch, sh, mut pool, cdev) =
        endpoints(DeviceConfig::spec(), SrqConfig { chunk: 16, max_slots: 48 });
    let mut conns = Vec::new();
    for _ in 0..4 {
        let (c, s) = pair(&ch, &sh).unwrap();
        spawn(&pool, serve(s.clone()));
        conns.push((c, s));
    }
    let servers: Vec<Connection<SimNic>> = conns.iter().map(|(_, s)| s.clone()).collect();
    let calls = |c: Connection<SimNic>, round: usize| {
        let servers = servers.clone();
        async move {
            let each = (0..4usize).map(|k| {
                let c = c.clone();
                let servers = servers.clone();
                async move {
                    let mut b = c.alloc_for(100).await.unwrap();
                    b.copy_from(&pattern(round + k, 100)).unwrap();
                    let r = c.call(b"x", Some(b)).await.unwrap_or_else(|e| {
                        panic!(
                            "round {round} call {k}: {e}: {:?}\n{:?}",
                            c.stats(),
                            servers.iter().map(|s| s.stats()).collect::<Vec<_>>()
                        )
                    });
                    let mut want = pattern(round + k, 100);
                    want.reverse();
                    let d = r.data.unwrap();
                    assert_eq!(d.to_vec(), want);
                    c.free(d);
                }
            });
            futures::future::join_all(each).await;
        }
    };
    // Two connections get busy: their shares grow until the queue is at
    // its most, and there is no room for another connection.
    for round in 0..16 {
        let busy = conns.iter().take(2).map(|(c, _)| calls(c.clone(), round));
        pool.run_until(futures::future::join_all(busy));
    }
    let grown = sh.stats().srq.unwrap();
    assert!(grown.grown > 0 && conns[0].1.stats().receive_share > 8, "{grown:?}");
    let extra: u32 = conns.iter().map(|(_, s)| s.stats().receive_share - 8).sum();
    assert!(extra > 0, "{grown:?}");
    // Idle past give_back_after: each grown share is given back.
    pool.run_until(async_io::Timer::after(give_back_after + Duration::from_millis(300)));
    let st = sh.stats().srq.unwrap();
    assert_eq!(st.shares, 4 * 8, "every share back at its start credits: {grown:?} -> {st:?}");
    assert_eq!(st.given_back, u64::from(extra), "{st:?}");
    // The give-back went signaled: the send slots the busy connections
    // kept for their last unsignaled frames came back with it.
    assert!(grown.send_slots_lent > 0, "{grown:?}");
    assert_eq!(st.send_slots_lent, 0, "{st:?}");
    for (_, s) in &conns {
        assert_eq!(s.stats().receive_share, 8);
    }
    let returned: u64 = conns.iter().map(|(c, _)| c.stats().credits_returned).sum();
    assert_eq!(returned, u64::from(extra), "the clients gave back what the shares lost");
    // The room goes to new connections, and the old ones still work (and
    // grow again when busy).
    let mut more = Vec::new();
    while st.slots - 4 * 8 >= 8 * (more.len() as u32 + 1) {
        let (c, s) = pair(&ch, &sh).expect("room for a new connection");
        spawn(&pool, serve(s.clone()));
        more.push((c, s));
    }
    assert!(!more.is_empty());
    for round in 16..20 {
        let busy = conns.iter().chain(&more).map(|(c, _)| calls(c.clone(), round));
        pool.run_until(futures::future::join_all(busy));
    }
    for (c, _) in conns.iter().chain(&more) {
        assert_eq!(c.stats().calls_failed, 0);
        assert_eq!(rnr_naks(&fabric, c, cdev), 0);
        assert!(c.is_down().is_none());
    }
    let st = sh.stats().srq.unwrap();
    assert!(st.shares <= st.slots, "{st:?}");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A `Returned` frame answers a `GiveBack`, and gives back no more than
/// the peer could hold past the start credits: one that answers nothing,
/// or gives back more, ends that connection (`BadReturn`), and only it.
/// With keepalive on, a `GiveBack` left unanswered for its timeout ends
/// that connection too (`PeerUnresponsive`), and its share comes back to
/// the queue; with it off, the share waits for the answer.
#[test]
fn a_peer_that_returns_credit_unasked_or_beyond_its_share_or_never_loses_its_connection() {
    use mwcap::conn::frame::Frame;
    use mwcap::conn::Misbehavior;
    let give_back_after = mwcap::conn::Config::default().give_back_after;
    let fabric = Fabric::with_seed(37);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = hubs::endpoint(&pool, shared(sn, 1 << 14, SrqConfig { chunk: 32, max_slots: 64 }));
    let ch = hubs::endpoint(&pool, builder(cn.clone()).queue_depth(1 << 14));
    let (vclient, victim) = hubs::pair(&ch, &sh, cfg(Role::Client), cfg(Role::Server));
    spawn(&pool, serve(victim.clone()));
    // Frames written by hand on a hand-driven client's QP (never driven:
    // what the server sends it stays in its receives).
    let raw = |peer: &Link<SimNic>, frames: &[Frame<'_>]| {
        let tx = peer.nic().reg_mr(frames.len() * 64, Access::LOCAL_WRITE).unwrap();
        let wrs: Vec<SendWr> = frames
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let bytes = f.encode().unwrap();
                peer.nic().write_mr(tx.id, i * 64, &bytes).unwrap();
                let sge = SgeList::one(Sge { mr: tx.id, offset: i * 64, len: bytes.len() as u32 });
                SendWr::Send { wr_id: 0xf200 + i as u64, signaled: false, sge }
            })
            .collect();
        peer.nic().post_send(peer.local().id, &wrs).unwrap();
    };
    let settle = |pool: &mut LocalPool, conn: &Connection<SimNic>| {
        for _ in 0..200 {
            pool.run_until_stalled();
            fabric.run_until_idle();
            if conn.is_down().is_some() {
                break;
            }
        }
    };
    // A server connection on the endpoint, served, with a hand-driven peer.
    let peer = |pool: &LocalPool| {
        let (s, link) = server_with_link_client(&sh, &cn);
        let conn = s.connect(&link.local()).unwrap();
        spawn(pool, serve(conn.clone()));
        (conn, link)
    };
    // Four requests grow the share; the idle time after them brings the
    // `GiveBack`. Returns the share it asks about.
    let grown = |pool: &mut LocalPool, conn: &Connection<SimNic>, link: &Link<SimNic>| {
        let requests: Vec<Frame<'_>> = (1..=4)
            .map(|msg_id| Frame::Request {
                msg_id,
                trace: None,
                header: b"grow",
                inline: b"",
                attach: Default::default(),
            })
            .collect();
        raw(link, &requests);
        settle(pool, conn);
        let share = conn.stats().receive_share;
        assert!(share > 8 && conn.is_down().is_none(), "{:?}", conn.stats());
        pool.run_until(async_io::Timer::after(give_back_after + Duration::from_millis(200)));
        share
    };
    // Unasked.
    let (c1, unasked) = peer(&pool);
    raw(&unasked, &[Frame::Returned { count: 1 }]);
    settle(&mut pool, &c1);
    assert_eq!(c1.is_down(), Some(LossReason::PeerMisbehaved(Misbehavior::BadReturn { count: 1, most: 0 })));
    // Asked, but beyond the share: the requests grow it, the idle time brings
    // the GiveBack, and the answer gives back more than was granted.
    let (c2, greedy) = peer(&pool);
    let share = grown(&mut pool, &c2, &greedy);
    raw(&greedy, &[Frame::Returned { count: 1000 }]);
    settle(&mut pool, &c2);
    assert_eq!(
        c2.is_down(),
        Some(LossReason::PeerMisbehaved(Misbehavior::BadReturn { count: 1000, most: share - 8 }))
    );
    // Asked, and honest, with flow frames sent after it dropped the credit
    // and before its `Returned`: the asking side withholds nothing while
    // its `GiveBack` is unanswered (before, it withheld those frames'
    // receives, its share fell to the start credits while still counting
    // the credit dropped, and the honest `Returned` was taken for
    // `BadReturn`).
    let (c3, honest) = peer(&pool);
    let share = grown(&mut pool, &c3, &honest);
    let count = share - 8;
    let mut frames: Vec<Frame<'_>> = (0..count).map(|_| Frame::Credit).collect();
    frames.push(Frame::Returned { count });
    raw(&honest, &frames);
    settle(&mut pool, &c3);
    assert!(c3.is_down().is_none(), "{:?}", c3.is_down());
    assert_eq!(c3.stats().receive_share, 8, "{:?}", c3.stats());
    // Asked, and silent: the peer keeps its grown credit and never says
    // so. Without keepalive nothing bounds how long a peer may take (an
    // honest one whose driver shares a thread with a busy application
    // may take seconds): the share stays as it grew.
    let (c4, quiet) = peer(&pool);
    let share = grown(&mut pool, &c4, &quiet);
    pool.run_until(async_io::Timer::after(Duration::from_millis(500)));
    settle(&mut pool, &c4);
    assert!(c4.is_down().is_none(), "without keepalive: {:?}", c4.is_down());
    assert_eq!(c4.stats().receive_share, share, "without keepalive the share waits for the answer");
    // With keepalive on, the give-back is due within its timeout, as a
    // ping's pong (its interval here too long for a ping to go): the
    // silent peer is unresponsive, and its share comes back. Before this
    // bound, it stayed at its peak for the connection's life.
    let timeout = Duration::from_millis(300);
    let mut scfg = cfg(Role::Server);
    scfg.keepalive = Some(mwcap::conn::Keepalive { interval: Duration::from_secs(3600), timeout });
    let (s, silent) = hubs::server_with_link_client(&sh, &cn, scfg, cfg(Role::Client));
    let c5 = s.connect(&silent.local()).unwrap();
    spawn(&pool, serve(c5.clone()));
    let share = grown(&mut pool, &c5, &silent);
    let before = sh.stats().srq.unwrap().shares;
    pool.run_until(async_io::Timer::after(timeout + Duration::from_millis(300)));
    settle(&mut pool, &c5);
    match c5.is_down() {
        Some(LossReason::PeerUnresponsive { silent }) => assert!(silent >= timeout, "{silent:?}"),
        other => panic!("the silent peer's connection, with keepalive: {other:?}"),
    }
    let after = sh.stats().srq.unwrap().shares;
    assert_eq!(after, before - share, "the silent peer's share of {share} came back ({before} -> {after})");
    // The victim on the same queue goes on.
    let r = pool.run_until(vclient.call(b"still", None)).expect("the victim's call");
    assert_eq!(r.status, 0);
    assert!(victim.is_down().is_none());
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
    drop((unasked, greedy, honest, quiet, silent));
}

/// After a burst the shares come back, and the chunks of receives they no
/// longer need are retired, newest first, while a whole chunk stays free
/// beyond the room kept for new connections. A retired chunk's receives
/// serve frames as ever but are not posted again, and once none is left
/// the chunk is deregistered: the burst's registered memory goes back as
/// traffic goes on, and no frame ever finds the queue empty.
#[test]
fn chunks_the_shares_no_longer_need_are_retired_and_freed_as_traffic_goes_on() {
    let give_back_after = mwcap::conn::Config::default().give_back_after;
    let (fabric, ch, sh, mut pool, cdev) =
        endpoints(DeviceConfig::spec(), SrqConfig { chunk: 16, max_slots: 64 });
    // Shares of 8 to 16 receives: four busy connections fill the queue.
    let side = |role| {
        let mut c = cfg(role);
        c.ctrl_slots = 16;
        c
    };
    let conns: Vec<_> = (0..4)
        .map(|_| {
            let s = side(Role::Server).prepare(&sh).unwrap();
            let c = side(Role::Client).prepare(&ch).unwrap();
            let (ce, se) = (c.local(), s.local());
            (c.connect(&se).unwrap(), s.connect(&ce).unwrap())
        })
        .collect();
    for (_, s) in &conns {
        spawn(&pool, serve(s.clone()));
    }
    let call = |c: Connection<SimNic>, i: usize| async move {
        let mut b = c.alloc_for(100).await.unwrap();
        b.copy_from(&pattern(i, 100)).unwrap();
        let r = c.call(b"x", Some(b)).await.unwrap_or_else(|e| panic!("call {i}: {e}: {:?}", c.stats()));
        let mut want = pattern(i, 100);
        want.reverse();
        let d = r.data.unwrap();
        assert_eq!(d.to_vec(), want);
        c.free(d);
    };
    // A burst: every connection with 8 calls in flight grows the queue.
    for round in 0..16 {
        let burst = conns.iter().flat_map(|(c, _)| (0..8).map(move |k| call(c.clone(), round * 32 + k)));
        pool.run_until(futures::future::join_all(burst));
    }
    let burst = sh.stats().srq.unwrap();
    assert_eq!(burst.slots, 64, "the burst grew the queue to its most: {burst:?}");
    // Idle: the shares come back, and a chunk is retired.
    pool.run_until(async_io::Timer::after(give_back_after + Duration::from_millis(300)));
    let idle = sh.stats().srq.unwrap();
    assert_eq!(idle.shares, 4 * 8, "{idle:?}");
    assert_eq!((idle.chunks_retired, idle.slots), (1, 48), "{idle:?}");
    // Calls on one connection, one at a time, take the retired receives
    // and free the chunk.
    for i in 0..120 {
        pool.run_until(call(conns[0].0.clone(), 1000 + i));
    }
    let after = sh.stats().srq.unwrap();
    assert_eq!((after.chunks_retired, after.chunks_freed), (1, 1), "{after:?}");
    assert_eq!(after.registered_bytes, burst.registered_bytes / 4 * 3, "{burst:?} -> {after:?}");
    assert!(after.shares <= after.slots, "{after:?}");
    // Another burst grows the queue again, in the freed chunk's place.
    for round in 0..8 {
        let burst =
            conns.iter().flat_map(|(c, _)| (0..8).map(move |k| call(c.clone(), 5000 + round * 32 + k)));
        pool.run_until(futures::future::join_all(burst));
    }
    let again = sh.stats().srq.unwrap();
    assert_eq!((again.slots, again.registered_bytes), (64, burst.registered_bytes), "{again:?}");
    for (c, s) in &conns {
        assert_eq!(c.stats().calls_failed, 0);
        assert_eq!(rnr_naks(&fabric, c, cdev), 0, "a frame found the queue empty");
        assert!(c.is_down().is_none() && s.is_down().is_none());
    }
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}
