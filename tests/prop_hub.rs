//! proptest: many connections on one server [`Endpoint`] (one completion
//! queue, one driver, a PD each) under random schedules mixing payload sizes
//! (inline, one buffer, a large buffer), calls cancelled by dropping their
//! future, QP errors on either side, client deaths and pauses, through the
//! async API. After every step:
//!
//! 1. the simulator's oracle saw no hazard: no DMA into a buffer the user
//!    holds or into freed memory, no remote READ of a held buffer, no
//!    invalidation that would crash rxe;
//! 2. no stale or foreign read is accepted: every reply payload holds
//!    exactly the bytes its server wrote for that call (a pattern of the
//!    connection, the call and the size);
//! 3. the endpoint routed no completion to a QP it did not know;
//! 4. no client's SEND met receiver-not-ready (flow control, and on an
//!    endpoint with shared receives the shares, never promise a receive
//!    that is not posted), and the shares never exceed the shared queue.
//!
//! At the end every connection is closed and:
//!
//! 5. every connection finishes, with every buffer back, and leaves the
//!    endpoint (its queue reservation and its share of the shared queue
//!    returned);
//! 6. a connection no fault was injected into never failed a call.
//!
//! Each client is a connection on an endpoint of its own, on a device of
//! its own (killed by a client death). The schedules run on a server
//! endpoint whose connections have receive queues of their own (mixed
//! policies), on one with shared receives (mw), whose
//! queue is small enough that shares grow to its top and shrink again (and
//! a pause of 15 ms gives a grown share back: `Config::give_back_after`), and
//! on one that also shares a buffer pool smaller than its connections
//! could hold, with each call made on every connection at once, where
//! after every step no pool buffer is reachable through two clients' QPs,
//! and at the end every pool buffer is back.

use std::time::Duration;

use futures::executor::LocalPool;
use futures::task::LocalSpawnExt;
use futures::FutureExt;
use mwcap::bootstrap::Auth;
use mwcap::conn::{
    BufClass, Config, Connection, Endpoint, EndpointBuilder, Keepalive, Policies, Policy, PolicyChoice, Role,
    SrqConfig,
};
use mwcap::sim::{DeviceConfig, Fabric, QpAddr, SimNic};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

const CONNS: usize = 5;
const SIZES: [usize; 4] = [0, 200, 3000, 100_000];

#[derive(Clone, Debug)]
enum Op {
    Call {
        conn: usize,
        size: usize,
    },
    /// Start a call and drop its future after a moment.
    Cancel {
        conn: usize,
        size: usize,
    },
    QpError {
        conn: usize,
        client: bool,
    },
    KillClient {
        conn: usize,
    },
    Pause {
        ms: u8,
    },
}

fn ops() -> impl Strategy<Value = Op> {
    let conn = || 0..CONNS;
    let size = || 0..SIZES.len();
    prop_oneof![
        8 => (conn(), size()).prop_map(|(conn, size)| Op::Call { conn, size }),
        2 => (conn(), size()).prop_map(|(conn, size)| Op::Cancel { conn, size }),
        1 => (conn(), any::<bool>()).prop_map(|(conn, client)| Op::QpError { conn, client }),
        1 => conn().prop_map(|conn| Op::KillClient { conn }),
        1 => (0u8..40).prop_map(|ms| Op::Pause { ms }),
    ]
}

fn cfg() -> Config {
    let mut c = Config::default();
    c.buffers = 3;
    c.large_buffers = vec![BufClass { size: 128 * 1024, count: 1 }];
    c.ctrl_slots = 8;
    // Below ctrl_slots, so that shares on shared receives can grow (from
    // 4 to 8) and shrink.
    c.start_credits = 4;
    c.lease_time = Duration::from_millis(200);
    c.safety_margin = Duration::from_millis(40);
    c.call_timeout = Duration::from_millis(600);
    c.keepalive =
        Some(Keepalive { interval: Duration::from_millis(60), timeout: Duration::from_millis(200) });
    // On shared receives, a pause gives grown shares back (and calls,
    // errors and deaths meet give-backs under way).
    c.give_back_after = Duration::from_millis(15);
    c
}

/// What the server writes for call `tag` of `size` bytes.
fn pattern(tag: u8, size: usize) -> Vec<u8> {
    (0..size).map(|k| (k as u8).wrapping_mul(31) ^ tag).collect()
}

/// Answer each request with `pattern(header[0], header[1..] as size)`.
async fn serve(conn: Connection<SimNic>) {
    while let Some(req) = conn.next_request().await {
        drop(req.data);
        let tag = req.header[0];
        let size = u32::from_le_bytes(req.header[1..5].try_into().unwrap()) as usize;
        let out = if size == 0 {
            None
        } else {
            let Ok(mut b) = conn.alloc_for(size).await else { return };
            if b.copy_from(&pattern(tag, size)).is_err() {
                return;
            }
            Some(b)
        };
        if conn.reply(req.id, 0, b"", out).await.is_err() {
            return;
        }
    }
}

/// Build the endpoint `b` says, its driver spawned on `pool`.
fn endpoint(pool: &LocalPool, b: EndpointBuilder<SimNic>) -> Endpoint<SimNic> {
    let (ep, driver) = b.build().unwrap();
    pool.spawner()
        .spawn_local(async move {
            driver.run().await;
        })
        .unwrap();
    ep
}

struct Side {
    client: Connection<SimNic>,
    server: Connection<SimNic>,
    client_dev: SimNic,
    server_qp: QpAddr,
    client_qp: QpAddr,
    faulted: bool,
    tag: u8,
}

fn run(
    policies: Vec<Policies>,
    schedule: Vec<Op>,
    srq: Option<SrqConfig>,
    buffers: Option<&[BufClass]>,
) -> Result<(), TestCaseError> {
    let fabric = Fabric::with_seed(23);
    let sdev = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let b = Endpoint::builder(sdev.clone(), Auth::Unauthenticated).queue_depth(1 << 14);
    let b = match (srq, buffers) {
        (Some(q), Some(classes)) => b.policy(PolicyChoice::Mw).shared_receives(q).shared_buffers(classes),
        (Some(q), None) => b.policy(PolicyChoice::Mw).shared_receives(q),
        _ => b,
    };
    let server_ep = endpoint(&pool, b);
    let mut sides = Vec::new();
    for p in policies {
        let client_dev = fabric.add_device(DeviceConfig::spec().named("c"));
        let client_ep = endpoint(&pool, Endpoint::builder(client_dev.clone(), Auth::Unauthenticated));
        let s = server_ep.prepare(Role::Server, p, cfg()).unwrap();
        let c = client_ep.prepare(Role::Client, p, cfg()).unwrap();
        let (sl, cl) = (s.local(), c.local());
        let server_qp = QpAddr { device: sdev.device(), qpn: sl.qpn };
        let client_qp = QpAddr { device: client_dev.device(), qpn: cl.qpn };
        let client = c.connect(&sl).unwrap();
        let server = s.connect(&cl).unwrap();
        pool.spawner().spawn_local(serve(server.clone())).unwrap();
        sides.push(Side { client, server, client_dev, server_qp, client_qp, faulted: false, tag: 0 });
    }

    for op in schedule {
        match op {
            Op::Call { conn, size } | Op::Cancel { conn, size } => {
                let cancel = matches!(op, Op::Cancel { .. });
                let side = &mut sides[conn];
                side.tag = side.tag.wrapping_add(1);
                let (tag, c) = (side.tag, side.client.clone());
                let call = async move {
                    let mut header = vec![tag];
                    header.extend_from_slice(&(SIZES[size] as u32).to_le_bytes());
                    let r = c.call(&header, None).await;
                    (c, r)
                };
                if cancel {
                    let mut call = Box::pin(call);
                    pool.run_until(async {
                        futures::select! {
                            _ = call.as_mut().fuse() => {},
                            _ = async_io::Timer::after(Duration::from_millis(2)).fuse() => {},
                        }
                    });
                    drop(call);
                } else {
                    // On a shared pool, every other connection makes a call
                    // of the same size at the same time: the pool runs short.
                    let others: Vec<usize> = if buffers.is_some() {
                        (0..sides.len()).filter(|&i| i != conn).collect()
                    } else {
                        Vec::new()
                    };
                    let mut all = vec![(
                        conn,
                        tag,
                        Box::pin(call) as std::pin::Pin<Box<dyn std::future::Future<Output = _>>>,
                    )];
                    for &i in &others {
                        let side = &mut sides[i];
                        side.tag = side.tag.wrapping_add(1);
                        let (tag, c) = (side.tag, side.client.clone());
                        all.push((
                            i,
                            tag,
                            Box::pin(async move {
                                let mut header = vec![tag];
                                header.extend_from_slice(&(SIZES[size] as u32).to_le_bytes());
                                let r = c.call(&header, None).await;
                                (c, r)
                            }),
                        ));
                    }
                    let (who, futs): (Vec<(usize, u8)>, Vec<_>) =
                        all.into_iter().map(|(i, t, f)| ((i, t), f)).unzip();
                    let results = pool.run_until(futures::future::join_all(futs));
                    for ((i, tag), (_, r)) in who.into_iter().zip(results) {
                        match r {
                            Ok(reply) => {
                                let want = pattern(tag, SIZES[size]);
                                let got = reply.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                                prop_assert!(got == want, "conn {i} call {tag}: a stale or foreign payload");
                            }
                            Err(e) => prop_assert!(
                                sides[i].faulted,
                                "conn {i}: a call failed with no fault injected: {e}"
                            ),
                        }
                    }
                }
            }
            Op::QpError { conn, client } => {
                let s = &mut sides[conn];
                s.faulted = true;
                fabric.force_qp_error(if client { s.client_qp } else { s.server_qp });
            }
            Op::KillClient { conn } => {
                sides[conn].faulted = true;
                sides[conn].client_dev.kill();
            }
            Op::Pause { ms } => {
                pool.run_until(async_io::Timer::after(Duration::from_millis(u64::from(ms))));
            }
        }
        pool.run_until_stalled();
        prop_assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
        prop_assert_eq!(server_ep.stats().orphans, 0);
        for (i, s) in sides.iter().enumerate() {
            let rnr = fabric.qp_counters(s.client_qp).map_or(0, |q| q.rnr_naks);
            prop_assert_eq!(rnr, 0, "conn {}: a SEND found no receive", i);
        }
        if let Some(q) = server_ep.stats().srq {
            prop_assert!(q.shares <= q.slots, "{:?}", q);
        }
        // No region (a connection's, or a buffer of the shared pool) is
        // reachable through two clients' QPs.
        let mut reach = std::collections::HashMap::new();
        for s in &sides {
            for e in fabric.exposure(sdev.device(), s.client_qp) {
                let other = reach.insert(e.mr, s.client_qp);
                prop_assert!(
                    other.is_none(),
                    "{:?} reachable through {:?} and {:?}",
                    e.mr,
                    other,
                    s.client_qp
                );
            }
        }
    }

    if srq.is_some() {
        // Idle past `give_back_after`: every live connection's share is
        // back at its start credits.
        pool.run_until(async_io::Timer::after(Duration::from_millis(80)));
        pool.run_until_stalled();
        for (i, s) in sides.iter().enumerate().filter(|(_, s)| !s.faulted) {
            prop_assert_eq!(s.server.stats().receive_share, 4, "conn {}: {:?}", i, server_ep.stats().srq);
        }
    }
    for s in &sides {
        s.client.close();
        s.server.close();
    }
    pool.run_until(futures::future::join_all(sides.iter().map(|s| s.server.finished())));
    pool.run_until(futures::future::join_all(sides.iter().map(|s| s.client.finished())));
    for (i, s) in sides.iter().enumerate() {
        prop_assert_eq!(s.server.free_buffers(), 4, "conn {}: a server buffer never came back", i);
        if !s.faulted || s.client.is_down().is_some() {
            prop_assert_eq!(s.client.free_buffers(), 4, "conn {}: a client buffer never came back", i);
        }
    }
    let st = server_ep.stats();
    prop_assert_eq!(st.connections, 0);
    // (An endpoint with shared receives keeps its queue's receives reserved.)
    prop_assert_eq!(st.reserved_entries, srq.map_or(0, |q| u64::from(q.max_slots)));
    if let Some(q) = st.srq {
        prop_assert_eq!(q.shares, 0, "a share never came back: {:?}", q);
    }
    if let Some(b) = st.buffers {
        prop_assert_eq!((b.free, b.held_bytes), (b.buffers, 0), "a pool buffer never came back: {:?}", b);
        // Every window is back in the pool (or was deallocated with a
        // faulted QP), and the pool's are the device's only windows: no
        // connection made or kept one of its own.
        prop_assert_eq!(b.windows_free, b.windows, "a pool window never came back: {:?}", b);
        prop_assert_eq!(fabric.windows(sdev.device()).len(), b.windows as usize, "windows outside the pool");
    }
    prop_assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
    Ok(())
}

fn policies() -> impl Strategy<Value = Vec<Policies>> {
    let p = || prop_oneof![Just(Policy::Mw), Just(Policy::Confirm)];
    proptest::collection::vec((p(), p()).prop_map(|(request, reply)| Policies { request, reply }), CONNS)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/prop_hub.txt"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn connections_on_one_hub_stay_safe_under_random_schedules(
        policies in policies(),
        schedule in proptest::collection::vec(ops(), 1..30),
    ) {
        run(policies, schedule, None, None)?;
    }

    #[test]
    fn connections_on_a_hub_with_shared_receives_stay_safe_under_random_schedules(
        schedule in proptest::collection::vec(ops(), 1..30),
    ) {
        // 5 x 4 receives to start, up to 8 each, 48 at most: shares grow,
        // shrink to make room, and are given back in pauses.
        let q = SrqConfig { chunk: 16, max_slots: 48 };
        run(vec![Policies::both(Policy::Mw); CONNS], schedule, Some(q), None)?;
    }

    #[test]
    fn connections_sharing_a_buffer_pool_stay_safe_under_random_schedules(
        schedule in proptest::collection::vec(ops(), 1..30),
    ) {
        // Far fewer buffers than the connections could hold (5 x 3 standard
        // and 5 large), and each call made on every connection at once: the
        // pool runs empty, buffers move between connections, and a faulted
        // connection's wait for its evidence holds some back.
        let q = SrqConfig { chunk: 16, max_slots: 48 };
        let b = [BufClass { size: Config::default().buffer_size, count: 2 },
            BufClass { size: 128 * 1024, count: 1 }];
        run(vec![Policies::both(Policy::Mw); CONNS], schedule, Some(q), Some(&b))?;
    }
}
