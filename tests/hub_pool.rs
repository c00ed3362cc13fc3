//! An [`Endpoint`] with a shared buffer pool
//! ([`EndpointBuilder::shared_buffers`]): its connections register no data
//! region and take each buffer from the endpoint's pool while they use it.
//! On the simulated NIC, whose oracle says which memory each remote QP can
//! reach and records every NIC access to a buffer a user holds.

use mwcap::backend::NicOps;
use std::collections::HashMap;
use std::time::Duration;

use futures::executor::LocalPool;
use mwcap::backend::{MrId, SendWr, Sge, SgeList, WcStatus};
use mwcap::conn::{
    BufClass, ConfigError, Connection, Endpoint, EndpointBuilder, EndpointDriver, Link, LossReason, Policies,
    Policy, PolicyChoice, Role, SetupError, SrqConfig,
};
use mwcap::sim::{DeviceConfig, DeviceId, Exposure, Fabric, HazardKind, QpAddr, SimNic, Verb};

mod hubs;
mod util;
use hubs::{builder, pattern, serve, serve_clients, server_with_link_client, spawn, Side};
use util::wait_for;

const SMALL: u32 = 4096;
const LARGE: u32 = 64 * 1024;

/// Per connection: up to 4 small buffers and 1 large one at once.
fn cfg(role: Role) -> Side {
    let mut c = Side::new(role, Policies::both(Policy::Mw));
    c.buffers = 4;
    c.buffer_size = SMALL;
    c.large_buffers = vec![BufClass { size: LARGE, count: 1 }];
    c.ctrl_slots = 16;
    c.send_slots = Some(8);
    c.inline_max = 0;
    c.lease_time = Duration::from_millis(300);
    c.safety_margin = Duration::from_millis(50);
    c.call_timeout = Duration::from_secs(10);
    c
}

/// The builder of an endpoint (mw) on `nic` with shared receives and a
/// shared pool of `small` buffers of `SMALL` bytes and `large` of `LARGE`.
fn pooled(nic: SimNic, small: u32, large: u32) -> EndpointBuilder<SimNic> {
    let classes = [BufClass { size: SMALL, count: small }, BufClass { size: LARGE, count: large }];
    builder(nic)
        .policy(PolicyChoice::Mw)
        .queue_depth(1 << 16)
        .shared_receives(SrqConfig { chunk: 64, max_slots: 4096 })
        .shared_buffers(&classes)
}

/// [`pooled`], built: the endpoint and its driver, not yet spawned.
fn pooled_endpoint(nic: SimNic, small: u32, large: u32) -> (Endpoint<SimNic>, EndpointDriver<SimNic>) {
    pooled(nic, small, large).build().unwrap()
}

fn pair(ch: &Endpoint<SimNic>, sh: &Endpoint<SimNic>) -> (Connection<SimNic>, Connection<SimNic>) {
    pair_with(ch, sh, cfg)
}

/// A client on `ch` and a server on `sh` with settings `cfg(role)`,
/// connected: (client, server).
fn pair_with(
    ch: &Endpoint<SimNic>,
    sh: &Endpoint<SimNic>,
    cfg: impl Fn(Role) -> Side,
) -> (Connection<SimNic>, Connection<SimNic>) {
    hubs::pair(ch, sh, cfg(Role::Client), cfg(Role::Server))
}

/// Connection `i`'s `calls` calls on `c`, one at a time, with payloads of
/// 1 B to 20 KB of its own pattern: each reply must carry them reversed
/// ([`serve`]). `after_call` runs once each reply is in, before its bytes
/// are checked; `label` starts every failure message.
async fn echo_calls(c: &Connection<SimNic>, i: usize, calls: usize, label: String, after_call: impl Fn()) {
    let sizes = [1usize, 100, 3000, 20_000];
    for k in 0..calls {
        let len = sizes[(i + k) % 4];
        let mut b = c.alloc_for(len).await.unwrap();
        b.copy_from(&pattern(i * 100 + k, len)).unwrap();
        let r = c.call(b"x", Some(b)).await.unwrap_or_else(|e| panic!("{label}conn {i} call {k}: {e}"));
        after_call();
        let mut want = pattern(i * 100 + k, len);
        want.reverse();
        let d = r.data.expect("a reply payload");
        assert!(d.to_vec() == want, "{label}conn {i} call {k}: not its own bytes");
        c.free(d);
    }
}

/// Run every one of `calls` on `pool`: whether they all ended within `limit`.
fn all_within<F: std::future::Future>(
    pool: &mut LocalPool,
    calls: impl IntoIterator<Item = F>,
    limit: Duration,
) -> bool {
    pool.run_until(async {
        let all = futures::future::join_all(calls);
        let t = async_io::Timer::after(limit);
        futures::pin_mut!(all);
        futures::pin_mut!(t);
        matches!(futures::future::select(all, t).await, futures::future::Either::Left(_))
    })
}

/// Every region of `owner` that some remote QP can reach now, and which
/// QPs can: a pool buffer is a region of its own, and must be reachable
/// through one connection at most.
fn reachable(fabric: &Fabric, owner: DeviceId, remotes: &[QpAddr]) -> HashMap<MrId, Vec<QpAddr>> {
    let mut by_mr: HashMap<MrId, Vec<QpAddr>> = HashMap::new();
    for &r in remotes {
        for e in fabric.exposure(owner, r) {
            by_mr.entry(e.mr).or_default().push(r);
        }
    }
    by_mr
}

/// 24 connections per side, each allowed 4 small buffers and 1 large one at
/// once, share pools of 16 small and 3 large buffers per side (a fifth of
/// what they could hold), making 12 calls each, one after another, all
/// connections at once: the pools run empty, connections wait and are
/// woken, every byte comes back right, no
/// buffer is ever reachable through two connections, the NIC never touches
/// a buffer a user holds, and every buffer is back in its pool at the end.
#[test]
fn connections_share_a_pool_smaller_than_their_needs_and_every_byte_is_right() {
    let fabric = Fabric::with_seed(5);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let (cdev, sdev) = (cn.device(), sn.device());
    let mut pool = LocalPool::new();
    let ch = hubs::endpoint(&pool, pooled(cn, 16, 3));
    let sh = hubs::endpoint(&pool, pooled(sn, 16, 3));
    let n = 24;
    let mut conns = Vec::new();
    for _ in 0..n {
        let (c, s) = pair(&ch, &sh);
        spawn(&pool, serve(s.clone()));
        conns.push((c, s));
    }
    // A connection registers nothing: its receives are the shared queue's,
    // its send slots and buffers the endpoint's, lent while in use.
    for (c, s) in &conns {
        assert_eq!(s.registered_bytes(), 0, "nothing of its own");
        assert_eq!(c.registered_bytes(), 0);
    }
    let client_qps: Vec<QpAddr> =
        conns.iter().map(|(c, _)| QpAddr { device: cdev, qpn: c.qp_number() }).collect();
    let server_qps: Vec<QpAddr> =
        conns.iter().map(|(_, s)| QpAddr { device: sdev, qpn: s.qp_number() }).collect();
    // One call at a time per connection, 24 connections at once: see
    // docs/serving.md on pools smaller than the calls in flight.
    let calls = conns.iter().enumerate().map(|(i, (c, _))| {
        let (fabric, client_qps, server_qps) = (&fabric, &client_qps, &server_qps);
        echo_calls(c, i, 12, String::new(), move || {
            for (owner, remotes) in [(sdev, client_qps), (cdev, server_qps)] {
                for (mr, through) in reachable(fabric, owner, remotes) {
                    assert!(through.len() <= 1, "region {mr:?} reachable through {through:?}");
                }
            }
        })
    });
    let done = all_within(&mut pool, calls, Duration::from_secs(60));
    if !done {
        eprintln!("client pool {:?}", ch.stats().buffers);
        eprintln!("server pool {:?}", sh.stats().buffers);
        for (c, s) in &conns {
            eprintln!("client {:?}\nserver {:?}", c.stats(), s.stats());
        }
        panic!("the calls stalled");
    }
    for side in [&ch, &sh] {
        let st = side.stats().buffers.expect("a shared pool");
        assert_eq!((st.buffers, st.registered_bytes), (19, 16 * 4096 + 3 * 65536), "{st:?}");
        assert!(st.taken >= 24 * 12, "every call took a buffer from the pool: {st:?}");
        assert!(st.empty > 0 && st.wakeups > 0, "the pool ran empty and waiters were woken: {st:?}");
    }
    for (c, s) in &conns {
        assert_eq!(c.stats().calls_failed, 0);
        assert_eq!(s.stats().requests_dropped, 0);
    }
    // Windows still lent as the connections close (releases on their way,
    // invalidations not yet completed): no call starts from here on, so
    // these are the only ones a close can drop.
    let lent_at_close: Vec<u32> = [&ch, &sh]
        .iter()
        .map(|side| {
            let st = side.stats().buffers.expect("a shared pool");
            st.windows - st.windows_free
        })
        .collect();
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
    for ((side, dev), lent) in [(&ch, cdev), (&sh, sdev)].into_iter().zip(lent_at_close) {
        let st = side.stats().buffers.unwrap();
        assert_eq!((st.free, st.held_bytes), (19, 0), "every buffer is back: {st:?}");
        // Windows: one per pool buffer, lent to every exposure of every
        // connection (a request payload per call on the client, a reply
        // payload on the server), all back but those lent when their
        // connection closed (a release whose LOCAL_INV the close flushed:
        // deallocated, not given back), and the device's only ones (24
        // connections with windows of their own would hold 120).
        assert_eq!(st.windows + st.windows_dropped as u32, 19, "{st:?}");
        assert_eq!(st.windows_free, st.windows, "{st:?}");
        assert!(st.windows_dropped <= u64::from(lent), "{lent} lent at the close: {st:?}");
        assert!(lent <= 24, "at most one exposure per connection and side (one call at a time): {st:?}");
        assert!(st.windows_lent >= 24 * 12, "{st:?}");
        assert_eq!(fabric.windows(dev).len(), st.windows as usize);
    }
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// Per connection: 2 small buffers, nothing else.
fn small_cfg(role: Role) -> Side {
    let mut c = cfg(role);
    c.buffers = 2;
    c.large_buffers = Vec::new();
    c
}

/// Answer every request with 3000 bytes of `fill`, after checking (with
/// `check`) that the moment is right.
async fn serve_fixed(server: Connection<SimNic>, fill: u8, check: impl Fn()) {
    while let Some(req) = server.next_request().await {
        let Ok(mut out) = server.alloc().await else { return };
        check();
        out.copy_from(&[fill; 3000]).unwrap();
        if server.reply(req.id, 0, b"", Some(out)).await.is_err() {
            return;
        }
    }
}

/// The builder of an endpoint (mw) on `sn` whose shared pool has `count`
/// buffers of `SMALL` bytes (and a window each).
fn small_pool(sn: SimNic, count: u32) -> EndpointBuilder<SimNic> {
    let classes = [BufClass { size: SMALL, count }];
    builder(sn)
        .policy(PolicyChoice::Mw)
        .queue_depth(1 << 14)
        .shared_receives(SrqConfig::default())
        .shared_buffers(&classes)
}

/// [`small_pool`], its driver spawned on `pool`.
fn small_pool_endpoint(pool: &LocalPool, sn: SimNic, count: u32) -> Endpoint<SimNic> {
    hubs::endpoint(pool, small_pool(sn, count))
}

/// An endpoint on `cn` with nothing shared but its CQ, its driver spawned
/// on `pool`.
fn plain_endpoint(pool: &LocalPool, cn: SimNic) -> Endpoint<SimNic> {
    hubs::endpoint(pool, builder(cn).queue_depth(1 << 14))
}

/// A server connection on `sh` and a client on `client_nic` driven by
/// hand (with `small_cfg`), connected: (the server's connection, the
/// client, the client's QP).
fn hand_driven_client(
    sh: &Endpoint<SimNic>,
    client_nic: &SimNic,
) -> (Connection<SimNic>, Link<SimNic>, QpAddr) {
    let (s, c) = server_with_link_client(sh, client_nic, small_cfg(Role::Server), small_cfg(Role::Client));
    let qp = QpAddr { device: client_nic.device(), qpn: c.local().qpn };
    (s.connect(&c.local()).unwrap(), c, qp)
}

/// `client` (whose QP is `qp`) makes a call and says nothing more; once
/// its server's reply window is bound, what the client can reach of
/// device `dev`.
fn call_and_wait_for_the_reply_window(
    pool: &mut LocalPool,
    fabric: &Fabric,
    dev: DeviceId,
    client: &mut Link<SimNic>,
    qp: QpAddr,
) -> Vec<Exposure> {
    client.call(fabric.now(), b"x", None).unwrap();
    client.drive(fabric.now());
    assert!(
        wait_for(pool, Duration::from_secs(5), || !fabric.exposure(dev, qp).is_empty()),
        "the reply's window was bound"
    );
    fabric.exposure(dev, qp)
}

/// A READ of 64 bytes at `remote_addr` with `rkey`, through `ep`'s QP
/// into its data region: the completion's status, and the bytes there
/// afterwards.
fn read_with_key(fabric: &Fabric, ep: &Link<SimNic>, remote_addr: u64, rkey: u32) -> (WcStatus, [u8; 64]) {
    let dst = ep.data_region();
    let wr = SendWr::Read {
        wr_id: 0x57a1e,
        local: SgeList::one(Sge { mr: dst.id, offset: 0, len: 64 }),
        remote_addr,
        rkey,
        signaled: true,
    };
    ep.nic().post_send(ep.local().id, &[wr]).unwrap();
    fabric.run_until_idle();
    let got = ep.nic().poll_cq_vec(ep.cq(), 256).unwrap();
    let c = got.iter().find(|c| c.wr_id == 0x57a1e).expect("the READ completes");
    let mut seen = [0u8; 64];
    ep.nic().read_mr(dst.id, 0, &mut seen).unwrap();
    (c.status, seen)
}

/// A server endpoint whose pool has one buffer, and a client that gets a
/// reply window over it and then says nothing: the buffer stays out of the
/// pool (and another connection that wants one waits) until the window's lease
/// ends in an invalidation; only then does the other connection get it,
/// and the silent client's key reaches nothing any more. On rxe, whose
/// windows reach their whole region, the window reached exactly that
/// buffer, which is a region of its own.
#[test]
fn a_pooled_buffer_goes_to_another_connection_only_after_its_window_is_invalidated() {
    for (dev, reach) in [(DeviceConfig::spec(), 3000), (DeviceConfig::rxe(), SMALL as usize)] {
        let fabric = Fabric::with_seed(8);
        let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
        let cn = fabric.add_device(DeviceConfig::spec().named("c"));
        let sn = fabric.add_device(dev.named("s"));
        let sdev = sn.device();
        let mut pool = LocalPool::new();
        let sh = small_pool_endpoint(&pool, sn, 1);
        let ch = plain_endpoint(&pool, cn);
        // The silent client: a link nobody drives after its call.
        let (a, mut silent, silent_qp) = hand_driven_client(&sh, &silent_nic);
        // No data region of its own: whatever it exposes is the pool's.
        assert_eq!(a.registered_bytes(), 0, "nothing of its own");
        spawn(&pool, serve_fixed(a.clone(), 0xaa, || {}));
        let exposed = call_and_wait_for_the_reply_window(&mut pool, &fabric, sdev, &mut silent, silent_qp);
        assert_eq!(exposed.len(), 1, "{exposed:?}");
        let x = exposed[0].clone();
        // The payload's bytes; on rxe the whole region, which is the buffer.
        assert_eq!(x.bytes, 0..reach, "the window reaches its buffer and no more");
        let st = sh.stats().buffers.unwrap();
        assert_eq!((st.free, st.held_bytes), (0, u64::from(SMALL)));

        // Another connection's server wants the buffer: it waits.
        let (b_client, b_server) = pair_with(&ch, &sh, small_cfg);
        let f = fabric.clone();
        spawn(
            &pool,
            serve_fixed(b_server.clone(), 0xbb, move || {
                assert!(
                    f.exposure(sdev, silent_qp).is_empty(),
                    "the buffer went to another connection while the silent client could reach it"
                )
            }),
        );
        let reply = pool.run_until(async {
            let t = async_io::Timer::after(Duration::from_secs(20));
            let call = b_client.call(b"y", None);
            futures::pin_mut!(call);
            match futures::future::select(call, t).await {
                futures::future::Either::Left((r, _)) => r.expect("the other connection is served"),
                futures::future::Either::Right(_) => panic!("the other connection never got the buffer"),
            }
        });
        assert_eq!(reply.data.as_ref().unwrap().to_vec(), vec![0xbb; 3000]);
        assert!(a.stats().bytes_exposed > 0);
        // The silent client's key, on the buffer that now holds the other
        // connection's bytes, reaches nothing.
        let addr = fabric.region_addr(sdev, x.mr).expect("the buffer's region");
        let (status, seen) = read_with_key(&fabric, &silent, addr, x.rkey);
        assert_ne!(status, WcStatus::Success, "a stale key read a reused buffer");
        assert_ne!(seen, [0xbb; 64]);
        assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
    }
}

/// A connection whose buffer sizes the pool does not have is refused at
/// `prepare`, with the sizes in the message; confirm is refused as on any
/// endpoint with shared receives; a pool with no buffers is refused.
#[test]
fn a_pool_refuses_what_it_cannot_serve_and_says_why() {
    let fabric = Fabric::with_seed(3);
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let (sh, _d) = small_pool(sn.clone(), 4).build().unwrap();
    let mut c = small_cfg(Role::Server);
    c.buffer_size = 8192;
    let e = c.prepare(&sh).expect_err("8 KiB buffers are not in the pool");
    let msg = e.to_string();
    assert!(msg.contains("8192") && msg.contains("4096"), "{msg}");
    assert!(
        matches!(&e, SetupError::Config(ConfigError::NotAPoolClass { size: 8192, classes }) if classes == &[SMALL]),
        "{e:?}"
    );
    let mut confirm = small_cfg(Role::Server);
    confirm.policies = Policies::both(Policy::Confirm);
    let e = confirm.prepare(&sh).expect_err("confirm on a shared pool");
    assert!(e.to_string().contains("mw policy only"), "{e}");
    assert!(matches!(e, SetupError::Config(ConfigError::SharedReceivesNeedMw { .. })), "{e:?}");
    let none = builder(sn)
        .policy(PolicyChoice::Mw)
        .queue_depth(1 << 14)
        .shared_receives(SrqConfig::default())
        .shared_buffers(&[BufClass { size: 0, count: 9 }])
        .build();
    assert!(matches!(none, Err(SetupError::Config(ConfigError::EmptyPool))), "{:?}", none.err());
    assert_eq!(sh.stats().buffers.unwrap().free, 4, "nothing was taken");
}

/// A connection torn down while its buffer is exposed to a silent peer:
/// the buffer comes back to the pool once the QP is destroyed and the
/// connection is gone, not before.
#[test]
fn a_torn_down_connections_buffers_come_back_after_its_qp_is_destroyed() {
    let fabric = Fabric::with_seed(9);
    let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let sdev = sn.device();
    let mut pool = LocalPool::new();
    // Three buffers, one of them kept for incoming payloads.
    let sh = small_pool_endpoint(&pool, sn, 3);
    let (a, mut silent, silent_qp) = hand_driven_client(&sh, &silent_nic);
    spawn(&pool, serve_fixed(a.clone(), 0xaa, || {}));
    call_and_wait_for_the_reply_window(&mut pool, &fabric, sdev, &mut silent, silent_qp);
    // The user holds the second buffer; the third is the reserve, which a
    // user's alloc does not take.
    let held = a.try_alloc().expect("the pool's second buffer");
    assert_eq!(sh.stats().buffers.unwrap().free, 1);
    a.close();
    let reason = pool.run_until(a.finished());
    assert_eq!(reason, LossReason::Closed);
    assert!(fabric.exposure(sdev, silent_qp).is_empty(), "the QP is destroyed");
    drop(held);
    drop(a);
    pool.run_until(async_io::Timer::after(Duration::from_millis(20)));
    let st = sh.stats().buffers.unwrap();
    assert_eq!((st.free, st.held_bytes), (3, 0), "every buffer back once the connection is gone: {st:?}");
    // The window lent to the silent client was deallocated before the QP
    // was destroyed, never given back; the other two are the pool's.
    assert_eq!((st.windows, st.windows_free, st.windows_dropped), (2, 2, 1), "{st:?}");
    assert_eq!(fabric.windows(sdev).len(), 2);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A connection whose QP could not be moved to ERR at its close, and then
/// either not destroyed or (its window not freed) not destroyed under the
/// window, keeps the pool's buffer it exposed (the peer may still READ
/// it), and gives it back once the link's drop frees the window and
/// destroys the QP. A window that cannot be freed at the drop either does
/// not keep the QP: the connection's route on the endpoint goes, so the
/// endpoint counts no connection and no reserved entries. (Before, the
/// buffers stayed out of the pool for good, and a window whose
/// deallocation failed stayed allocated, its QP destroyed under it.) A
/// window that cannot be freed at the drop either keeps the buffer it may
/// cover out of the pool for good: the destroy of its QP alone is no
/// evidence (before, the buffer went back to the pool under it). That
/// destroy under a bound window is the simulator's one record
/// (`DestroyUnderBoundWindow`: rxe would stall on it).
#[test]
fn a_stuck_connections_buffers_come_back_when_its_destroy_works_at_last() {
    // What fails: at the close, and (the window's deallocation) at the drop.
    for (fails, again) in [
        ([Verb::SetQpError, Verb::DestroyQp], false),
        ([Verb::SetQpError, Verb::DeallocMw], false),
        ([Verb::SetQpError, Verb::DeallocMw], true),
    ] {
        let fabric = Fabric::with_seed(9);
        let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let sdev = sn.device();
        let mut pool = LocalPool::new();
        let sh = small_pool_endpoint(&pool, sn.clone(), 3);
        // What the endpoint reserves with no connection (its shared receives).
        let base = sh.stats().reserved_entries;
        let (a, mut silent, silent_qp) = hand_driven_client(&sh, &silent_nic);
        spawn(&pool, serve_fixed(a.clone(), 0xaa, || {}));
        call_and_wait_for_the_reply_window(&mut pool, &fabric, sdev, &mut silent, silent_qp);
        assert_eq!(sh.stats().buffers.unwrap().free, 2, "the reply's buffer is exposed");
        // Nothing at the close says the peer cannot READ the buffer.
        for verb in fails {
            sn.fail_next(verb, 1);
        }
        if again {
            sn.fail_next(Verb::DeallocMw, 2);
        }
        a.close();
        assert_eq!(pool.run_until(a.finished()), LossReason::Closed);
        pool.run_until(async_io::Timer::after(Duration::from_millis(20)));
        assert_eq!(
            sh.stats().buffers.unwrap().free,
            2,
            "{fails:?}: the stuck QP's buffer stays out of the pool"
        );
        // A user still holding the connection takes nothing more from the
        // pool (each buffer taken and dropped joined what the stuck
        // connection keeps: a loop of these drained the pool).
        for _ in 0..4 {
            assert!(a.try_alloc().is_none(), "{fails:?}: a buffer for a connection that is down");
        }
        pool.run_until(async_io::Timer::after(Duration::from_millis(5)));
        assert_eq!(sh.stats().buffers.unwrap().free, 2, "{fails:?}: nothing taken from the pool");
        drop(a);
        pool.run_until(async_io::Timer::after(Duration::from_millis(20)));
        let st = sh.stats().buffers.unwrap();
        if again {
            // The window over the buffer is still allocated, still bound:
            // no evidence that nothing reaches the buffer, which stays out
            // of the pool for good.
            assert_eq!(st.free, 2, "{fails:?}: kept while a window may cover it: {st:?}");
        } else {
            assert_eq!(
                (st.free, st.held_bytes),
                (3, 0),
                "{fails:?}: every buffer back once the QP is destroyed: {st:?}"
            );
        }
        let es = sh.stats();
        assert_eq!((es.connections, es.reserved_entries), (0, base), "{fails:?} {again}: {es:?}");
        if again {
            // The window could not go: still allocated, still the pool's
            // count, never lent again.
            assert_eq!((st.windows, st.windows_free, st.windows_dropped), (3, 2, 0), "{st:?}");
            assert_eq!(fabric.windows(sdev).len(), 3);
        } else {
            // The lent window was deallocated (at the close, or at the drop
            // if that failed), never given back: the other two are the
            // pool's, and nothing else is allocated.
            assert_eq!((st.windows, st.windows_free, st.windows_dropped), (2, 2, 1), "{fails:?}: {st:?}");
            assert_eq!(fabric.windows(sdev).len(), 2, "{fails:?}");
        }
        // The QP went at the drop although its window could not: the one
        // record, of the rxe stall the drop accepts rather than keep the
        // QP (and its route) for good.
        let kinds: Vec<HazardKind> = fabric.hazards().iter().map(|h| h.kind).collect();
        let expected = if again { vec![HazardKind::DestroyUnderBoundWindow] } else { vec![] };
        assert_eq!(kinds, expected, "{fails:?} {again}: {:?}", fabric.hazards());
    }
}

/// A buffer handle that outlives its connection keeps its bytes: the pool
/// gets the buffer back when the connection goes, but lends it to nobody
/// while the handle lives (another handle would alias its slice). Dropping
/// the handle frees it at once and wakes a connection waiting for it.
/// (Before, the pool noticed only at a later take of that class: a
/// connection already waiting slept on.)
#[test]
fn a_handle_that_outlives_its_connection_keeps_its_buffer_from_the_pool() {
    let fabric = Fabric::with_seed(11);
    let (n1, n2) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    // Three buffers, one kept for incoming payloads.
    let sh = small_pool_endpoint(&pool, sn, 3);
    let (a, _peer, _) = hand_driven_client(&sh, &n1);
    let mut held = a.try_alloc().expect("a buffer");
    held.copy_from(&[0xab; 1000]).unwrap();
    a.close();
    assert_eq!(pool.run_until(a.finished()), LossReason::Closed);
    drop(a);
    pool.run_until(async_io::Timer::after(Duration::from_millis(20)));
    assert_eq!(sh.stats().connections, 0, "the connection is gone");
    assert_eq!(sh.stats().buffers.unwrap().free, 2, "the held one is parked, not free");
    assert_eq!(&held[..], &[0xab; 1000][..], "its bytes are still the handle's");
    held[..3].copy_from_slice(b"xyz");
    let (b, _peer2, _) = hand_driven_client(&sh, &n2);
    let first = b.try_alloc().expect("a free buffer");
    assert!(b.try_alloc().is_none(), "the last free one is the reserve; the parked one is not lent");
    assert_eq!(&held[..3], b"xyz");
    // A second alloc waits for a buffer: the parked one.
    let got = std::rc::Rc::new(std::cell::RefCell::new(None));
    let g = got.clone();
    let b2 = b.clone();
    spawn(&pool, async move {
        *g.borrow_mut() = Some(b2.alloc().await);
    });
    pool.run_until(async_io::Timer::after(Duration::from_millis(20)));
    assert!(got.borrow().is_none(), "nothing free for it yet");
    drop(held);
    assert_eq!(sh.stats().buffers.unwrap().free, 2, "free as soon as its handle is gone");
    let t0 = std::time::Instant::now();
    while got.borrow().is_none() && t0.elapsed() < Duration::from_secs(5) {
        pool.run_until(async_io::Timer::after(Duration::from_millis(5)));
    }
    let second = got.borrow_mut().take().expect("the waiting alloc was woken").expect("the parked buffer");
    drop((first, second));
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A listening endpoint with a shared pool: mw clients connected through
/// the async setup take their buffers from it, each gets its own bytes
/// back, and every buffer is back in the pool when they are gone.
#[test]
fn a_listening_endpoint_serves_mw_clients_from_a_shared_pool() {
    use mwcap::bootstrap::{Auth, Key};
    let fabric = Fabric::with_seed(34);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let key = || Auth::Key(Key::from_bytes(b"a listener over a pooled hub: a test key".to_vec()).unwrap());
    let (server, sd) = Endpoint::builder(sn.new_pd().unwrap(), key())
        .policy(PolicyChoice::Mw)
        .config(cfg(Role::Server).cfg)
        .shared_receives(SrqConfig { chunk: 64, max_slots: 4096 })
        .shared_buffers(&[BufClass { size: SMALL, count: 4 }, BufClass { size: LARGE, count: 1 }])
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
    let served = serve_clients(&mut pool, std::slice::from_ref(&server), 10, &client);
    assert!(served.iter().all(|&ok| ok));
    assert_eq!(server.stats().added, 10);
    assert!(wait_for(&mut pool, Duration::from_secs(10), || server.stats().connections == 0));
    let st = server.stats().buffers.unwrap();
    assert!(st.taken >= 20, "a READ destination and a reply buffer per client: {st:?}");
    assert_eq!((st.free, st.held_bytes), (5, 0), "{st:?}");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A user's `alloc().await` that found the pool empty is woken when
/// another connection gives a buffer back, even when a user call on the
/// same connection (here `free_buffers`) runs between the give and the
/// connection's turn: only the turn takes the pool's news, and wakes the
/// waiting `alloc` with it.
#[test]
fn a_waiting_alloc_is_woken_by_a_give_whatever_runs_before_its_turn() {
    let fabric = Fabric::with_seed(12);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = small_pool_endpoint(&pool, sn, 1);
    let ch = plain_endpoint(&pool, cn);
    let pairs: Vec<_> = (0..2).map(|_| pair_with(&ch, &sh, small_cfg)).collect();
    let (c, d) = (pairs[0].1.clone(), pairs[1].1.clone());
    let held = d.try_alloc().expect("the pool's only buffer");
    let got = std::rc::Rc::new(std::cell::Cell::new(false));
    let (c2, got2) = (c.clone(), got.clone());
    spawn(&pool, async move {
        let b = c2.alloc().await.expect("a buffer once one comes back");
        got2.set(true);
        drop(b);
    });
    pool.run_until_stalled();
    assert!(!got.get(), "the pool is empty");
    d.free(held);
    let _ = c.free_buffers();
    assert!(
        wait_for(&mut pool, Duration::from_secs(5), || got.get()),
        "the waiting alloc was never woken: {:?}",
        sh.stats().buffers
    );
}

/// Connections on two threads: both endpoints' drivers, the services and the
/// callers run as tasks of an `async-executor` on two threads, so takes,
/// gives and wake-ups of the shared pools race for real (loom models the
/// protocol; this runs it). 12 connections make 8 calls each, one after
/// another, over pools of 8 + 2 buffers per side (which most runs find
/// empty at times). Every byte is checked, the simulator's oracle records
/// no hazard, and every buffer is back at the end.
#[test]
fn connections_on_two_threads_share_pools_and_every_byte_is_right() {
    use std::sync::Arc;
    let fabric = Fabric::with_seed(17);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let (ch, cdrv) = pooled_endpoint(cn, 8, 2);
    let (sh, sdrv) = pooled_endpoint(sn, 8, 2);
    let ex = Arc::new(async_executor::Executor::new());
    let (stop, stopped) = futures::channel::oneshot::channel::<()>();
    let worker = {
        let ex = ex.clone();
        std::thread::spawn(move || {
            async_io::block_on(ex.run(async move {
                let _ = stopped.await;
            }))
        })
    };
    ex.spawn(cdrv.run()).detach();
    ex.spawn(sdrv.run()).detach();
    let mut conns = Vec::new();
    for _ in 0..12 {
        let (c, s) = pair(&ch, &sh);
        ex.spawn(serve(s.clone())).detach();
        conns.push((c, s));
    }
    let sizes = [1usize, 100, 3000, 20_000];
    // Each connection's calls one after another (its server serves one
    // request at a time): 12 at once over pools of 8 + 2.
    let tasks: Vec<_> = conns
        .iter()
        .enumerate()
        .map(|(i, (c, _))| {
            let c = c.clone();
            ex.spawn(async move {
                for k in 0..8usize {
                    let len = sizes[(i + k) % 4];
                    let mut b = c.alloc_for(len).await.unwrap();
                    b.copy_from(&pattern(i * 100 + k, len)).unwrap();
                    let r = match c.call(b"x", Some(b)).await {
                        Ok(r) => r,
                        Err(e) => return Err(format!("conn {i} call {k}: {e}")),
                    };
                    let mut want = pattern(i * 100 + k, len);
                    want.reverse();
                    let d = r.data.expect("a reply payload");
                    assert!(d.to_vec() == want, "conn {i} call {k}: not its own bytes");
                }
                Ok(())
            })
        })
        .collect();
    let done = async_io::block_on(ex.run(async {
        let all = futures::future::join_all(tasks);
        let t = async_io::Timer::after(Duration::from_secs(60));
        futures::pin_mut!(all);
        futures::pin_mut!(t);
        match futures::future::select(all, t).await {
            futures::future::Either::Left((r, _)) => Some(r),
            futures::future::Either::Right(_) => None,
        }
    }));
    let failed: Vec<String> = match done {
        Some(results) => results.into_iter().filter_map(Result::err).collect(),
        None => vec!["the calls stalled".into()],
    };
    if !failed.is_empty() {
        for (c, s) in &conns {
            eprintln!("client {:?}\nserver {:?}", c.stats(), s.stats());
        }
        panic!("{failed:?}: client pool {:?} server pool {:?}", ch.stats().buffers, sh.stats().buffers);
    }
    for (c, s) in &conns {
        c.close();
        s.close();
    }
    let finished: Vec<_> = conns
        .into_iter()
        .flat_map(|(c, s)| [c, s])
        .map(|c| ex.spawn(async move { c.finished().await }))
        .collect();
    let reasons = async_io::block_on(ex.run(futures::future::join_all(finished)));
    assert!(reasons.iter().all(|r| *r == LossReason::Closed), "{reasons:?}");
    let _ = stop.send(());
    worker.join().unwrap();
    for side in [&ch, &sh] {
        let st = side.stats().buffers.unwrap();
        assert_eq!((st.free, st.held_bytes), (10, 0), "every buffer is back: {st:?}");
    }
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A quarter of each class of the pool is kept for incoming payloads: a
/// user's allocs stop short of it, and a request payload the peer exposes
/// is still read into it. (Without the reserve, users filling both sides'
/// pools with outgoing payloads deadlock the two directions until leases
/// expire: 96 calls at once over 12 connections on two threads failed
/// calls that way in 17 runs of 40.)
#[test]
fn a_users_allocs_leave_the_pools_reserve_for_incoming_payloads() {
    let fabric = Fabric::with_seed(19);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = small_pool_endpoint(&pool, sn, 4);
    let ch = plain_endpoint(&pool, cn);
    let four = |role| {
        let mut c = small_cfg(role);
        c.buffers = 4;
        c
    };
    let (client, server) = pair_with(&ch, &sh, four);
    let held: Vec<_> = (0..3).map(|_| server.try_alloc().expect("outside the reserve")).collect();
    assert!(server.try_alloc().is_none(), "a user's alloc took the reserve");
    assert_eq!(sh.stats().buffers.unwrap().free, 1);
    let (server2, client2) = (server.clone(), client.clone());
    let got = pool.run_until(async move {
        let call = async {
            let mut b = client2.alloc().await.unwrap();
            b.copy_from(&pattern(7, 3000)).unwrap();
            client2.call(b"x", Some(b)).await
        };
        let serve = async {
            let req = server2.next_request().await.expect("the request");
            let bytes = req.data.as_ref().expect("its payload").to_vec();
            drop(req.data);
            server2.reply(req.id, 0, b"", None).await.unwrap();
            bytes
        };
        let (r, bytes) = futures::join!(call, serve);
        r.expect("answered");
        bytes
    });
    assert_eq!(got, pattern(7, 3000), "the request payload was read into the reserve");
    drop(held);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// The pool's windows are lent per exposure. A server device with a single
/// memory window (`max_mw` 1), which the pool holds: connection A exposes
/// a range of the endpoint's region to a silent client, which takes the window
/// and says nothing. Connection B's reply needs a window: the pool has
/// none and cannot allocate one, so B waits until A's lease expires and
/// its invalidation completes; then the very same window is bound for B's
/// client. The silent client's key reaches nothing any more, and a READ
/// with it fails.
#[test]
fn a_pooled_window_goes_to_another_connection_only_after_its_invalidation() {
    use mwcap::conn::RegionRange;
    use mwcap::sim::Via;
    let fabric = Fabric::with_seed(21);
    let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let mut one_window = DeviceConfig::spec().named("s");
    one_window.max_mw = 1;
    let sn = fabric.add_device(one_window);
    let (cdev, sdev) = (cn.device(), sn.device());
    let mut pool = LocalPool::new();
    let sh = small_pool_endpoint(&pool, sn, 1);
    let ch = plain_endpoint(&pool, cn);
    let st = sh.stats().buffers.unwrap();
    assert_eq!((st.windows, st.windows_free), (1, 1), "a window per buffer: {st:?}");

    // A: replies with a range of the endpoint's region, to a silent client.
    let (a, mut silent, silent_qp) = hand_driven_client(&sh, &silent_nic);
    let region = sh.register_region(SMALL as usize).unwrap();
    sh.region_write(region, 0, &[0xaa; 3000]).unwrap();
    let a2 = a.clone();
    spawn(&pool, async move {
        while let Some(req) = a2.next_request().await {
            let range = RegionRange { region, offset: 0, len: 3000 };
            if a2.reply_region(req.id, 0, b"", range).await.is_err() {
                return;
            }
        }
    });
    let x = call_and_wait_for_the_reply_window(&mut pool, &fabric, sdev, &mut silent, silent_qp).remove(0);
    let Via::Window(window) = x.via else { panic!("exposed through a window: {x:?}") };
    let st = sh.stats().buffers.unwrap();
    assert_eq!((st.windows, st.windows_free, st.windows_lent), (1, 0, 1), "{st:?}");

    // B: its reply waits for the window.
    let (b_client, b_server) = pair_with(&ch, &sh, small_cfg);
    let b_qp = QpAddr { device: cdev, qpn: b_client.qp_number() };
    // B's READ takes a few hundred microseconds more (below the ACK
    // timeout), so that the watch below sees B's client reach the window.
    fabric.set_link_delay(cdev, sdev, Duration::from_micros(400));
    spawn(&pool, serve_fixed(b_server.clone(), 0xbb, || {}));
    let f = fabric.clone();
    let bound_for_b = std::rc::Rc::new(std::cell::Cell::new(false));
    let seen = bound_for_b.clone();
    let reply = pool.run_until(async {
        let watch = async {
            // Whenever B's client can reach the window, the silent one
            // cannot.
            loop {
                let b_reach = f.exposure(sdev, b_qp);
                if b_reach.iter().any(|e| e.via == Via::Window(window)) {
                    assert!(f.exposure(sdev, silent_qp).is_empty(), "one window reachable by two QPs");
                    seen.set(true);
                }
                // Yield: look again after every other task's turn.
                let mut again = false;
                futures::future::poll_fn(|cx| {
                    if std::mem::replace(&mut again, true) {
                        std::task::Poll::Ready(())
                    } else {
                        cx.waker().wake_by_ref();
                        std::task::Poll::Pending
                    }
                })
                .await;
            }
        };
        let t = async_io::Timer::after(Duration::from_secs(20));
        let call = b_client.call(b"y", None);
        futures::pin_mut!(call, t, watch);
        let call_or_timeout = futures::future::select(call, t);
        match futures::future::select(call_or_timeout, watch).await {
            futures::future::Either::Left((futures::future::Either::Left((r, _)), _)) => {
                r.expect("B is served")
            }
            _ => panic!("B never got the window"),
        }
    });
    assert_eq!(reply.data.as_ref().unwrap().to_vec(), vec![0xbb; 3000]);
    assert!(bound_for_b.get(), "the silent client's window was bound again for B's client");
    let st = sh.stats().buffers.unwrap();
    assert!(st.window_alloc_failures >= 1 && st.window_waits >= 1, "B waited for the window: {st:?}");
    assert_eq!(st.windows_lent, 2, "{st:?}");
    assert_eq!(fabric.windows(sdev).len(), 1, "the device's only window, shared");

    // The silent client's key on the window (now bound and invalidated
    // again for B) reads nothing.
    let (status, _) = read_with_key(&fabric, &silent, fabric.region_addr(sdev, x.mr).unwrap(), x.rkey);
    assert_ne!(status, WcStatus::Success, "a stale key read through a lent window");
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A known exposure of an endpoint whose connections share a protection
/// domain (shared receives, shared pool): on rxe (and in the simulator's
/// rxe mode) a SEND_WITH_INV invalidates any window of the device that
/// carries the key, not only the receiving QP's (a spec device refuses it;
/// `tests/hub.rs`). A hostile client of connection A that knows (or guesses: an
/// 8-bit consumer key) the key of connection B's bound window invalidates
/// it. A goes down for it. The endpoint finds the window among B's: B
/// posts no LOCAL_INV for it (before the endpoint's search it did, at the
/// lease's end, and on rxe that second invalidation is a kernel panic,
/// `would_crash_rxe`) and goes down. No byte is read or reused without
/// evidence: B's buffer comes back at its QP's destroy.
#[test]
fn a_send_with_inv_on_one_connection_reaches_a_window_of_another_in_the_same_pd() {
    use mwcap::sim::Via;
    let fabric = Fabric::with_seed(44);
    let attacker_nic = fabric.add_device(DeviceConfig::spec().named("attacker"));
    let b_nic = fabric.add_device(DeviceConfig::spec().named("b"));
    let sn = fabric.add_device(DeviceConfig::rxe().named("s"));
    let sdev = sn.device();
    let mut pool = LocalPool::new();
    let sh = small_pool_endpoint(&pool, sn, 4);
    // Two clients driven by hand: B takes a reply window and holds it (it
    // never READs); the attacker only sends.
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    let mut qps = Vec::new();
    for nic in [&attacker_nic, &b_nic] {
        let (s, client, qp) = hand_driven_client(&sh, nic);
        spawn(&pool, serve_fixed(s.clone(), 0xbb, || {}));
        servers.push(s);
        clients.push(client);
        qps.push(qp);
    }
    let b_qp = qps[1];
    let x = call_and_wait_for_the_reply_window(&mut pool, &fabric, sdev, &mut clients[1], b_qp).remove(0);
    let Via::Window(window) = x.via else { panic!("{x:?}") };

    // The attacker's SEND_WITH_INV of B's key, through its own connection.
    let attacker = &clients[0];
    let src = attacker.data_region();
    let wr = SendWr::SendWithInv {
        wr_id: 0xbad,
        signaled: true,
        sge: SgeList::one(Sge { mr: src.id, offset: 0, len: 16 }),
        invalidate_rkey: x.rkey,
    };
    attacker.nic().post_send(attacker.local().id, &[wr]).unwrap();
    let (a, b) = (&servers[0], &servers[1]);
    assert!(wait_for(&mut pool, Duration::from_secs(5), || a.is_down().is_some()), "A goes down");
    assert!(
        matches!(a.is_down(), Some(LossReason::PeerMisbehaved(_))),
        "A's peer invalidated a key that is not A's: {:?}",
        a.is_down()
    );
    assert!(fabric.exposure(sdev, b_qp).is_empty(), "B's client reaches nothing any more");
    // The endpoint found whose window it was: B never invalidates it again
    // (on rxe a kernel panic) and goes down, not blaming its peer.
    assert!(wait_for(&mut pool, Duration::from_secs(5), || b.is_down().is_some()), "B goes down");
    assert_eq!(b.is_down(), Some(LossReason::LeaseEngine(mwcap_mw::LossCause::InvalidatedElsewhere)));
    assert_eq!(b.stats().lease_owner.unwrap().peer_invalidations, 1);
    // Past B's lease (300 ms): still no second invalidation.
    pool.run_until(async_io::Timer::after(Duration::from_millis(400)));
    assert!(fabric.would_crash_rxe().is_empty(), "{:?}", fabric.would_crash_rxe());
    let data_hazards: Vec<_> =
        fabric.hazards().into_iter().filter(|h| h.kind != mwcap::sim::HazardKind::WouldCrashRxe).collect();
    assert!(data_hazards.is_empty(), "{data_hazards:?}");
    // B's window was deallocated before its QP was destroyed, not given back.
    assert!(fabric.window(sdev, window).is_none());
    drop(servers);
    drop(clients);
    assert!(wait_for(&mut pool, Duration::from_secs(5), || sh.stats().connections == 0));
    let st = sh.stats().buffers.unwrap();
    assert_eq!((st.free, st.held_bytes), (4, 0), "{st:?}");
    assert_eq!((st.windows, st.windows_free, st.windows_dropped), (3, 3, 1), "{st:?}");
}

/// Issue 19, finding 4: a shared pool is fair. Two careless clients (hand
/// driven) that keep 6 calls in flight, within their credit, and never read
/// a reply (they hold both of their own buffers, so no READ of theirs ever
/// has a destination): each reply their server connections expose keeps a
/// pool buffer for a whole lease. Beside them an honest client makes 30
/// calls one after another, 30 ms apart, on a pool of 4 buffers, and every
/// one is answered with its payload: the honest server connection is below
/// its share (4 buffers / 3 connections: one), so each buffer a hoarder's
/// lease gives back goes to it first. Before the pool had shares and
/// queues, every give woke every waiter and a hoarder's reply could take
/// it first, and the honest calls timed out.
#[test]
fn hoarders_on_a_shared_pool_do_not_starve_an_honest_client() {
    honest_client_beside_hoarders(2);
}

/// As above with 8 hoarders on 4 buffers: nobody has a guaranteed share
/// (4 / 9 rounds down to none), so every take while others wait goes
/// through the queue, and each buffer that comes back goes to the waiter
/// that has held the pool's buffers least: the honest connection, which
/// hands its back within a call. Before, each hoarder holding none was
/// "below its share" of one and took a returned buffer before the honest
/// connection's woken task could: 0 of 30 calls answered. (It also found a
/// lost wake-up: a woken connection that took one of two free buffers left
/// the next waiter asleep beside the other, `State::kick`.)
#[test]
fn more_hoarders_than_buffers_do_not_starve_an_honest_client() {
    honest_client_beside_hoarders(8);
}

fn honest_client_beside_hoarders(n: usize) {
    let fabric = Fabric::with_seed(19);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = small_pool_endpoint(&pool, sn, 4);
    let ch = plain_endpoint(&pool, cn.clone());
    let mut hoarders = hubs::hoarders::Hoarders::default();
    for _ in 0..n {
        // Its calls give up after 400 ms (a lease and a bit), and it calls again.
        let mut ccfg = small_cfg(Role::Client);
        ccfg.call_timeout = Duration::from_millis(400);
        let (s, client) = server_with_link_client(&sh, &cn, small_cfg(Role::Server), ccfg);
        let s = s.connect(&client.local()).unwrap();
        spawn(&pool, serve_fixed(s, 0x40, || {}));
        hoarders.add(client);
    }
    let (honest, honest_s) = pair_with(&ch, &sh, |role| {
        let mut c = small_cfg(role);
        c.call_timeout = Duration::from_secs(3);
        c
    });
    spawn(&pool, serve_fixed(honest_s, 0x11, || {}));
    let done = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let d = done.clone();
    spawn(&pool, async move {
        for _ in 0..30 {
            async_io::Timer::after(Duration::from_millis(30)).await;
            let r = honest.call(b"x", None).await;
            let ok = matches!(&r, Ok(r) if r.data.as_ref().is_some_and(|b| b.to_vec() == vec![0x11; 3000]));
            d.borrow_mut().push(if ok { Ok(()) } else { Err(format!("{:?}", r.map(|_| ()))) });
        }
    });
    let t0 = std::time::Instant::now();
    while done.borrow().len() < 30 && t0.elapsed() < Duration::from_secs(120) {
        hoarders.turn(t0.elapsed());
        pool.run_until(async_io::Timer::after(Duration::from_millis(1)));
    }
    let hoarded = hoarders.calls;
    let done = done.borrow();
    assert_eq!(done.len(), 30, "the honest client finished {} calls", done.len());
    let failed: Vec<_> = done.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "honest calls failed beside the hoarders: {failed:?}; pool {:?}",
        sh.stats().buffers
    );
    // Each hoarder's first 6 calls go out at once; more means their calls
    // timed out and they called again, holding the pool all along.
    assert!(hoarded > 7 * n as u64, "the hoarders kept calling ({hoarded} calls)");
    let st = sh.stats().buffers.unwrap();
    assert!(st.empty > 0, "the pool ran empty: {st:?}");
}

/// The builder of an endpoint on `nic` serving confirm (and mw, where the
/// peer wants it) to trusted peers, with shared receives and a shared pool
/// of `small` buffers of `SMALL` bytes and `large` of `LARGE`.
fn trusted_pooled(nic: SimNic, small: u32, large: u32) -> EndpointBuilder<SimNic> {
    let classes = [BufClass { size: SMALL, count: small }, BufClass { size: LARGE, count: large }];
    builder(nic)
        .policy(PolicyChoice::Confirm)
        .trusted_peers(true)
        .queue_depth(1 << 16)
        .shared_receives(SrqConfig { chunk: 64, max_slots: 4096 })
        .shared_buffers(&classes)
}

/// With trusted peers a shared pool serves confirm too, in either
/// direction and beside mw on the other: connections on two pooled
/// endpoints, more calls in flight than buffers, every payload's bytes are
/// its own, every buffer comes back, and the simulator's oracle saw no
/// READ of a buffer returned as success while another user held it.
#[test]
fn trusted_peers_let_a_shared_pool_serve_confirm_and_every_byte_is_right() {
    let (mw, confirm) = (Policy::Mw, Policy::Confirm);
    for (k, policies) in [
        Policies::both(confirm),
        Policies { request: confirm, reply: mw },
        Policies { request: mw, reply: confirm },
    ]
    .into_iter()
    .enumerate()
    {
        let fabric = Fabric::with_seed(40 + k as u64);
        let cn = fabric.add_device(DeviceConfig::spec().named("c"));
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let mut pool = LocalPool::new();
        let ch = hubs::endpoint(&pool, trusted_pooled(cn, 6, 2));
        let sh = hubs::endpoint(&pool, trusted_pooled(sn, 6, 2));
        let side = |role| {
            let mut c = cfg(role);
            c.policies = policies;
            c
        };
        let conns: Vec<_> = (0..8)
            .map(|_| {
                let (c, s) = pair_with(&ch, &sh, side);
                spawn(&pool, serve(s.clone()));
                (c, s)
            })
            .collect();
        let calls =
            conns.iter().enumerate().map(|(i, (c, _))| echo_calls(c, i, 10, format!("{policies:?} "), || {}));
        assert!(all_within(&mut pool, calls, Duration::from_secs(60)), "{policies:?}: the calls stalled");
        for (c, s) in &conns {
            assert_eq!(c.stats().calls_failed, 0, "{policies:?}");
            assert_eq!(s.stats().requests_dropped, 0, "{policies:?}");
            c.close();
            s.close();
        }
        pool.run_until(futures::future::join_all(
            conns.iter().map(|(c, s)| futures::future::join(c.finished(), s.finished())),
        ));
        drop(conns);
        for side in [&ch, &sh] {
            let st = side.stats().buffers.unwrap();
            assert!(st.taken >= 8 * 10, "{policies:?}: every call took a buffer from the pool: {st:?}");
            assert_eq!((st.free, st.held_bytes), (8, 0), "{policies:?}: every buffer is back: {st:?}");
        }
        assert!(fabric.hazards().is_empty(), "{policies:?}: {:?}", fabric.hazards());
    }
}

/// Without trusted peers an endpoint that shares receives or buffers
/// refuses confirm when it is built, and says what would serve it.
#[test]
fn sharing_with_confirm_needs_trusted_peers_and_says_so() {
    let fabric = Fabric::with_seed(3);
    for choice in [PolicyChoice::Confirm, PolicyChoice::Auto] {
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let e = trusted_pooled(sn, 4, 1).policy(choice).trusted_peers(false).build().err();
        let Some(SetupError::Config(ConfigError::SharingNeedsMw { choice: c })) = &e else {
            panic!("built: {e:?}")
        };
        assert_eq!(*c, choice);
        let msg = e.unwrap().to_string();
        assert!(msg.contains("trusted_peers(true)") && msg.contains("PolicyChoice::Mw"), "{msg}");
    }
}

/// Under confirm on a shared pool the one buffer a silent client was
/// offered goes back to the pool when the offer's hold ends, and another
/// connection fills it; the silent client then READs the other
/// connection's bytes with the old offer's key (trusted peers share a
/// protection domain), and the owner's confirm says the buffer was reused:
/// the call never returns those bytes, it asks again and gets its own.
#[test]
fn under_confirm_a_read_of_a_pool_buffer_another_connection_reused_is_never_returned() {
    let fabric = Fabric::with_seed(17);
    let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let classes = [BufClass { size: SMALL, count: 1 }];
    let sh = hubs::endpoint(
        &pool,
        builder(sn)
            .policy(PolicyChoice::Confirm)
            .trusted_peers(true)
            .queue_depth(1 << 14)
            .shared_receives(SrqConfig::default())
            .shared_buffers(&classes),
    );
    let ch = plain_endpoint(&pool, cn);
    let confirm_cfg = |role| {
        let mut c = small_cfg(role);
        c.policies = Policies::both(Policy::Confirm);
        c
    };
    let (s, mut silent) =
        server_with_link_client(&sh, &silent_nic, confirm_cfg(Role::Server), confirm_cfg(Role::Client));
    let a = s.connect(&silent.local()).unwrap();
    spawn(&pool, serve_fixed(a.clone(), 0xaa, || {}));
    let call = silent.call(fabric.now(), b"x", None).unwrap();
    silent.drive(fabric.now());
    // The offer is made and its hold ends unread: the buffer is back.
    assert!(
        wait_for(&mut pool, Duration::from_secs(5), || a.stats().exposures >= 1),
        "the reply was offered"
    );
    assert!(
        wait_for(&mut pool, Duration::from_secs(5), || sh.stats().buffers.unwrap().free == 1),
        "the unread offer's buffer came back when its hold ended"
    );
    // Another connection takes it and fills it with its own reply.
    let (b_client, b_server) = pair_with(&ch, &sh, confirm_cfg);
    spawn(&pool, serve_fixed(b_server.clone(), 0xbb, || {}));
    let r = pool.run_until(b_client.call(b"y", None)).expect("the other connection is served");
    assert_eq!(r.data.as_ref().unwrap().to_vec(), vec![0xbb; 3000]);
    drop(r);
    // Now the silent client reads with the old offer.
    let t0 = std::time::Instant::now();
    let got = loop {
        assert!(t0.elapsed() < Duration::from_secs(10), "the silent client's call never ended");
        silent.drive(fabric.now());
        if let Some(ev) = silent.poll_event() {
            match ev {
                mwcap::conn::Event::Reply { call: c, data, .. } if c == call => break Ok(data),
                mwcap::conn::Event::CallFailed { call: c, error } if c == call => break Err(error),
                _ => continue,
            }
        }
        pool.run_until(async_io::Timer::after(Duration::from_millis(2)));
    };
    assert!(silent.stats().stale_reads >= 1, "the old offer read a reused buffer: {:?}", silent.stats());
    // Asked again, the server offers its own bytes anew.
    let d = got.expect("the call asked again and was answered").expect("a reply payload");
    assert_eq!(d.to_vec(), vec![0xaa; 3000], "the call returned another connection's bytes");
    silent.free(d);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}
