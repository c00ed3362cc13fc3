//! Testing your own service on the simulated NIC.
//!
//! A toy blob service on mwcap: the client asks for a blob and the server
//! replies with it as a payload the client READs (under the mw policy: a
//! window bound over exactly the reply buffer, scoped to the client's queue
//! pair, released once read). The same program would run on `VerbsNic`;
//! here both endpoints sit on devices of one simulated fabric, so the test
//! can break the network and ask the fabric's oracle what the NICs did.
//!
//! It runs the exchange on a healthy fabric, then cuts the link between the
//! two devices: the next call fails with an error that says so (never a
//! stale or partial blob), and the oracle shows that no READ is still in
//! flight, no NIC touched memory a program held, and no invalidation would
//! have crashed rxe.
//!
//! Run with `cargo run --example sim_service`.

use std::time::{Duration, Instant};

use mwcap::bootstrap::Auth;
use mwcap::conn::{Config, Connection, Endpoint, Policies, Policy};
use mwcap::sim::{DeviceConfig, Fabric, Faults, SimNic, WindowState};

const BLOB: &[u8] = b"a blob served by the owner through a type-2 window";

fn config() -> Config {
    let mut c = Config::default();
    c.buffers = 4;
    c.buffer_size = 4096;
    // A short call timeout: a call over the cut link gives up quickly.
    c.call_timeout = Duration::from_secs(1);
    c
}

/// An endpoint on `nic`, its driver on a thread of its own.
fn endpoint(nic: SimNic) -> Endpoint<SimNic> {
    let (ep, driver) =
        Endpoint::builder(nic, Auth::Unauthenticated).config(config()).build().expect("an endpoint");
    std::thread::spawn(move || futures::executor::block_on(driver.run()));
    ep
}

/// The service: every request is answered with the blob, as a payload.
fn serve(conn: Connection<SimNic>) {
    std::thread::spawn(move || {
        futures::executor::block_on(async {
            while let Some(req) = conn.next_request().await {
                drop(req.data);
                let Ok(mut out) = conn.alloc().await else { return };
                if out.copy_from(BLOB).is_err() || conn.reply(req.id, 0, b"blob", Some(out)).await.is_err() {
                    return;
                }
            }
        })
    });
}

/// Wait (up to 5 s) until `done` holds: the peer's release reaches the
/// owner a little after the call returns, and a failed connection's
/// cleanup runs on its driver's thread.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(5), "{what}: not after 5 s");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn main() {
    // A retry budget short enough that a cut link fails a work request
    // within the call timeout.
    let faults = Faults { retry_cnt: 3, ack_timeout: Duration::from_millis(10), ..Faults::default() };
    let fabric = Fabric::with_seed(42);
    fabric.set_faults(faults);
    let (client_nic, server_nic) =
        (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let (client_dev, server_dev) = (client_nic.device(), server_nic.device());
    let (client, server) = (endpoint(client_nic), endpoint(server_nic));
    let (conn, serving) = client.connect_local(&server, Policies::both(Policy::Mw)).expect("connected");
    serve(serving);

    // Healthy: the blob arrives intact, and once the client's release
    // reaches the server no window of the server's is bound any more.
    let reply = futures::executor::block_on(conn.call(b"get", None)).expect("a healthy call");
    let data = reply.data.expect("a blob");
    assert_eq!(&data[..], BLOB);
    drop(data);
    eventually("every window released", || {
        fabric.windows(server_dev).iter().all(|(_, w)| !matches!(w, WindowState::Bound { .. }))
    });
    println!("healthy link: got {} bytes, every window released", BLOB.len());

    // Cut: the call fails, and says why.
    fabric.cut_link(client_dev, server_dev);
    let err = futures::executor::block_on(conn.call(b"get", None)).expect_err("no call crosses a cut link");
    println!("cut link: the call failed: {err}");
    eventually("the connection down", || conn.is_down().is_some());
    eventually("no READ in flight", || fabric.in_flight().is_empty());
    let hazards = fabric.hazards();
    assert!(hazards.is_empty(), "the oracle saw {hazards:?}");
    assert!(fabric.would_crash_rxe().is_empty(), "an invalidation would have crashed rxe");
    println!(
        "cut link: the connection is down ({}); no READ in flight, no hazard (virtual time {:?})",
        conn.is_down().expect("down"),
        fabric.now()
    );
}
