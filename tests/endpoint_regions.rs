//! Regions registered on an [`Endpoint`] (`Endpoint::register_region`):
//! one registered store served to every connection of the endpoint, a
//! range written only while no connection exposes it, each connection's
//! registration released with the region, and a connection that goes down
//! giving its ranges back. On the simulated NIC, whose oracle says what
//! each remote QP can reach.

use std::collections::HashSet;
use std::time::Duration;

use futures::executor::LocalPool;
use mwcap::backend::MrId;
use mwcap::conn::{
    Connection, Endpoint, Link, Policies, Policy, PolicyChoice, RegionId, RegionRange, Role, SrqConfig,
    UseError,
};
use mwcap::sim::{DeviceConfig, Fabric, QpAddr, SimNic};

#[allow(dead_code)] // the echo server and the listening helpers are other tests'
mod hubs;
mod util;
use hubs::{builder, endpoint, pair, pattern, server_with_link_client, spawn, Side};
use util::wait_for;

/// Bytes of the region: no buffer of these tests has this size, so the
/// oracle's view of it is told apart from buffers.
const REGION: usize = 40_000;
/// Each value: `VALUE` bytes at `key * 4096`.
const VALUE: u32 = 3000;

fn side(role: Role, policy: Policy) -> Side {
    let mut s = Side::new(role, Policies::both(policy));
    s.buffers = 2;
    s.buffer_size = 4096;
    s.inline_max = 0;
    s.lease_time = Duration::from_millis(300);
    s.safety_margin = Duration::from_millis(50);
    s.call_timeout = Duration::from_secs(10);
    s
}

fn range(region: RegionId, key: u8) -> RegionRange {
    RegionRange { region, offset: usize::from(key) * 4096, len: VALUE }
}

/// A region of `sh` holding value `key` (`pattern(key)`) for keys 0..3.
fn values(sh: &Endpoint<SimNic>) -> RegionId {
    let region = sh.register_region(REGION).unwrap();
    for key in 0..3u8 {
        sh.region_write(region, range(region, key).offset, &pattern(key.into(), VALUE as usize)).unwrap();
    }
    region
}

/// Answer each request, whose header is a key, with that key's range of
/// `region`.
async fn serve_values(server: Connection<SimNic>, region: RegionId) {
    while let Some(req) = server.next_request().await {
        let key = req.header.first().copied().unwrap_or(0);
        if server.reply_region(req.id, 0, b"", range(region, key)).await.is_err() {
            return;
        }
    }
}

/// The value of gauge `name` (labelled with the endpoint only) in what
/// `ep` records now.
fn gauge(ep: &Endpoint<SimNic>, name: &str) -> f64 {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || ep.record_metrics());
    let found = snap.snapshot().into_vec().into_iter().find(|(k, ..)| k.key().name() == name);
    match found {
        Some((.., DebugValue::Gauge(g))) => g.into_inner(),
        other => panic!("{name}: {other:?}"),
    }
}

/// A connection of `sh` (settings `scfg`) serving `region`'s values to a
/// client on `silent_nic` driven by hand, which asks for `key` and never
/// reads the reply's range: the server's connection and the client, once
/// the range is exposed.
fn silent_client(
    pool: &mut LocalPool,
    fabric: &Fabric,
    sh: &Endpoint<SimNic>,
    silent_nic: &SimNic,
    scfg: Side,
    region: RegionId,
    key: u8,
) -> (Connection<SimNic>, Link<SimNic>) {
    let (pending, mut silent) = server_with_link_client(sh, silent_nic, scfg, side(Role::Client, Policy::Mw));
    let server = pending.connect(&silent.local()).unwrap();
    spawn(pool, serve_values(server.clone(), region));
    silent.call(fabric.now(), &[key], None).unwrap();
    silent.drive(fabric.now());
    assert!(
        wait_for(pool, Duration::from_secs(5), || server.stats().exposures == 1),
        "the silent client's reply is exposed"
    );
    (server, silent)
}

/// The memory regions of the server's device that `qp` can reach whole
/// (the user region, under confirm: its key reaches all of it).
fn regions_reachable(fabric: &Fabric, server: &SimNic, qp: QpAddr) -> HashSet<MrId> {
    fabric.exposure(server.device(), qp).iter().filter(|e| e.bytes == (0..REGION)).map(|e| e.mr).collect()
}

/// Three clients each read every value of one region of the server's
/// endpoint, under mw and confirm with a protection domain per connection
/// and under mw with shared receives (one PD): every byte is right, no
/// client's QP reaches another's registration of the region, and once the
/// region is deregistered none reaches any.
#[test]
fn one_region_serves_every_connection_of_its_endpoint() {
    for (policy, shared_receives) in [(Policy::Mw, false), (Policy::Confirm, false), (Policy::Mw, true)] {
        let what = format!("{policy:?}, shared receives: {shared_receives}");
        let fabric = Fabric::with_seed(31);
        let cn = fabric.add_device(DeviceConfig::spec().named("c"));
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let mut pool = LocalPool::new();
        let ch = endpoint(&pool, builder(cn.clone()).queue_depth(1 << 12));
        let mut sb = builder(sn.clone()).queue_depth(1 << 14);
        if shared_receives {
            sb = sb.shared_receives(SrqConfig::default()).policy(PolicyChoice::Mw);
        }
        let sh = endpoint(&pool, sb);
        let region = values(&sh);
        let clients: Vec<Connection<SimNic>> = (0..3)
            .map(|_| {
                let (c, s) = pair(&ch, &sh, side(Role::Client, policy), side(Role::Server, policy));
                spawn(&pool, serve_values(s, region));
                c
            })
            .collect();
        let got =
            pool.run_until(futures::future::join_all(clients.iter().enumerate().map(|(i, c)| async move {
                let mut ok = true;
                for j in 0..3u8 {
                    let key = (i as u8 + j) % 3;
                    let r = c.call(&[key], None).await.expect("served");
                    ok &= r.data.as_ref().expect("a payload").to_vec() == pattern(key.into(), VALUE as usize);
                }
                ok
            })));
        assert_eq!(got, vec![true; 3], "{what}: every value read right");

        let qps: Vec<QpAddr> =
            clients.iter().map(|c| QpAddr { device: cn.device(), qpn: c.qp_number() }).collect();
        let reach: Vec<HashSet<MrId>> = qps.iter().map(|&qp| regions_reachable(&fabric, &sn, qp)).collect();
        for (i, r) in reach.iter().enumerate() {
            if policy == Policy::Confirm {
                // The documented cost of confirm: the peer's key reaches the
                // whole region, but only through its own registration.
                assert_eq!(r.len(), 1, "{what}: client {i} reaches its connection's registration: {reach:?}");
            } else {
                assert!(
                    r.is_empty(),
                    "{what}: under mw no key reaches the region once its windows are invalidated"
                );
            }
        }
        assert!(reach[0].is_disjoint(&reach[1]) && reach[1].is_disjoint(&reach[2]), "{what}: {reach:?}");

        // Every exposure ends on its evidence: then the region can go.
        assert!(
            wait_for(&mut pool, Duration::from_secs(5), || sh.deregister_region(region).is_ok()),
            "{what}: the region was deregistered once nothing exposed it"
        );
        for &qp in &qps {
            assert!(
                regions_reachable(&fabric, &sn, qp).is_empty(),
                "{what}: a registration outlived its region"
            );
        }
        assert_eq!(sh.region_write(region, 0, b"x"), Err(UseError::NoSuchRegion(region)), "{what}");
        assert!(fabric.hazards().is_empty(), "{what}: {:?}", fabric.hazards());
    }
}

/// A range one connection exposes to a client that never reads it, and
/// another connection exposes to a client that reads at once: the reader
/// gets the old bytes, writes of the range are refused (and
/// `deregister_region` too) until the silent client's lease has expired
/// and its window is invalidated, while a neighbouring range is written
/// at any time; `region_write_when_free` then writes, and the next read
/// sees the new bytes.
#[test]
fn a_range_is_written_only_once_no_connection_exposes_it() {
    let fabric = Fabric::with_seed(32);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let ch = endpoint(&pool, builder(cn).queue_depth(1 << 12));
    let sh = endpoint(&pool, builder(sn).queue_depth(1 << 12));
    let region = values(&sh);

    // The silent client: calls, and never reads the reply's range.
    let (silent_server, _silent) =
        silent_client(&mut pool, &fabric, &sh, &silent_nic, side(Role::Server, Policy::Mw), region, 1);

    // The reader, on another connection of the same endpoint.
    let (reader, server) = pair(&ch, &sh, side(Role::Client, Policy::Mw), side(Role::Server, Policy::Mw));
    spawn(&pool, serve_values(server, region));
    let old = pool.run_until(reader.call(&[1], None)).expect("served");
    assert_eq!(old.data.as_ref().unwrap().to_vec(), pattern(1, VALUE as usize));
    drop(old);

    let at = range(region, 1).offset;
    assert!(
        matches!(sh.region_write(region, at + 100, b"new"), Err(UseError::RangeExposed { .. })),
        "written while the silent client may still read it"
    );
    assert_eq!(sh.deregister_region(region), Err(UseError::RegionBusy(region)));
    sh.region_write(region, range(region, 2).offset, b"the neighbour").expect("a range nobody exposes");
    assert_eq!(silent_server.stats().expiries, 0, "the lease has not expired yet");
    assert_eq!(gauge(&sh, "mwcap_regions"), 1.0);
    assert_eq!(gauge(&sh, "mwcap_region_bytes"), REGION as f64);
    assert!(
        wait_for(&mut pool, Duration::from_secs(5), || gauge(&sh, "mwcap_region_exposures") == 1.0),
        "once the reader's exposure ended on its evidence, the silent client's alone is left"
    );

    let new = pattern(9, VALUE as usize);
    pool.run_until(sh.region_write_when_free(region, at, &new)).expect("written once free");
    assert_eq!(silent_server.stats().expiries, 1, "written only after the silent client's lease expired");
    assert_eq!(gauge(&sh, "mwcap_region_exposures"), 0.0, "the expiry ended the exposure");
    let r = pool.run_until(reader.call(&[1], None)).expect("served");
    assert_eq!(r.data.as_ref().unwrap().to_vec(), new, "the next read sees the new bytes");
    drop(r);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}

/// A connection that goes down gives back the ranges it exposed once its
/// QP is destroyed: the write waits for that, not for the lease.
#[test]
fn a_connection_that_goes_down_gives_its_ranges_back() {
    let fabric = Fabric::with_seed(33);
    let silent_nic = fabric.add_device(DeviceConfig::spec().named("silent"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let mut pool = LocalPool::new();
    let sh = endpoint(&pool, builder(sn).queue_depth(1 << 12));
    let region = values(&sh);
    let mut slow = side(Role::Server, Policy::Mw);
    slow.lease_time = Duration::from_secs(60);
    let (server, silent) = silent_client(&mut pool, &fabric, &sh, &silent_nic, slow, region, 0);
    assert!(matches!(sh.region_write(region, 0, b"new"), Err(UseError::RangeExposed { .. })));

    server.close();
    let t0 = std::time::Instant::now();
    pool.run_until(sh.region_write_when_free(region, 0, b"new")).expect("written once the QP is gone");
    assert!(t0.elapsed() < Duration::from_secs(30), "waited for the 60 s lease, not for the QP");
    assert_eq!(server.stats().expiries, 0);
    let mut seen = [0u8; 3];
    sh.region_bytes(region, 0, 3, |b| seen.copy_from_slice(b)).unwrap();
    assert_eq!(&seen, b"new");
    sh.deregister_region(region).expect("nothing exposes it");
    drop(silent);
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}
