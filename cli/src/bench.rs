//! `mwcap bench` over real verbs, through the async API: as the client of
//! a `mwcap serve` in another process (`mwcap bench ADDR`, the production
//! path: TCP bootstrap, a policy choice, one `Endpoint` per policy), or with
//! both sides in this process on two protection domains of one device, each
//! side with its own `Driver` in one executor.
//!
//! Compare with perftest on the same device in the same run (`ib_send_lat`,
//! `ib_read_lat`, `ib_read_bw`): on SoftRoCE every figure is 10-100x a real
//! NIC's, and only ratios measured together mean anything.

use std::process::ExitCode;

use mwcap::bootstrap::Auth;

use crate::BenchOpts;

#[cfg(not(all(feature = "verbs", not(loom))))]
pub fn run(_: &BenchOpts, _: Option<&Auth>) -> ExitCode {
    eprintln!("mwcap bench: this build has no verbs backend; rebuild with `--features verbs`, or use --sim");
    ExitCode::from(2)
}

/// Run the case matrix over real verbs; print a line per case. `auth`
/// comes with `o.addr`: the bootstrap's authentication.
#[cfg(all(feature = "verbs", not(loom)))]
pub fn run(o: &BenchOpts, auth: Option<&Auth>) -> ExitCode {
    let r = match o.addr.zip(auth) {
        Some((addr, auth)) => imp::remote(o, addr, auth),
        None => imp::local(o),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mwcap bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The address of a `mwcap serve`'s listener for `policy`: the given port
/// for mw, the next one for confirm.
#[cfg(all(feature = "verbs", not(loom)))]
pub fn policy_addr(
    mw: std::net::SocketAddr,
    policy: mwcap::conn::Policy,
) -> Result<std::net::SocketAddr, String> {
    let mut a = mw;
    if policy == mwcap::conn::Policy::Confirm {
        let p = mw.port().checked_add(1).filter(|_| mw.port() != 0);
        a.set_port(p.ok_or_else(|| {
            format!("port {} has no next port for confirm; pick a port below 65535, not 0", mw.port())
        })?);
    }
    Ok(a)
}

#[cfg(all(feature = "verbs", not(loom)))]
mod imp {
    use std::net::SocketAddr;
    use std::time::Duration;

    use futures::executor::block_on;
    use mwcap::bootstrap::Auth;
    use mwcap::conn::{Endpoint, Policies, Policy, PolicyChoice};
    use mwcap::verbs::VerbsNic;
    use mwcap::ProbeCache;

    use super::policy_addr;
    use crate::asyncbench::{one_process, run_cases, Server};
    use crate::cases::{config, Labels};
    use crate::executors::{Executor, Place};
    use crate::BenchOpts;
    use crate::{cases, count};

    /// How long connecting (TCP, hellos, the probe of the peer) may take.
    const SETUP: Duration = Duration::from_secs(60);

    fn open(o: &BenchOpts) -> Result<VerbsNic, String> {
        VerbsNic::open(Some(&o.device), 1, o.gid_index).map_err(|e| {
            format!("cannot open {} (GID index {}): {e}; check `mwcap probe`", o.device, o.gid_index)
        })
    }

    fn header(o: &BenchOpts, how: &str) {
        println!(
            "# mwcap bench: {how}, device {}, {} calls per case after {} warm-up calls, {} buffers of {} bytes per side",
            o.device,
            o.iters,
            o.warmup,
            o.buffers,
            o.buffer_size()
        );
    }

    /// Client of a `mwcap serve` at `addr`: `--connections` connections
    /// per policy (the device probed once for all of them).
    pub fn remote(o: &BenchOpts, addr: SocketAddr, auth: &Auth) -> Result<(), String> {
        crate::count::parking_lot_settled();
        header(o, &format!("two processes, client of mwcap serve at {addr}"));
        let probes = ProbeCache::new();
        for (policy, group) in cases::matrix(&o.kinds, &o.policies, &o.sizes, &o.inflight, o.check()) {
            let to = policy_addr(addr, policy)?;
            let choice = match policy {
                Policy::Mw => PolicyChoice::Mw,
                Policy::Confirm => PolicyChoice::Confirm,
            };
            let cfg = config(o.pool(), &o.conn);
            let endpoint = |busy_poll| {
                let nic = open(o)?;
                let depth = nic.device_attrs().max_cqe.min(1 << 17);
                Endpoint::builder(nic, auth.clone())
                    .policy(choice)
                    .config(cfg.clone())
                    .queue_depth(depth)
                    .handshake_timeout(SETUP)
                    .probe_cache(probes.clone())
                    .trusted_peers(o.trusted_peers)
                    .busy_poll(busy_poll)
                    .build()
                    .map_err(|e| format!("setting up the {policy:?} endpoint: {e}"))
            };
            let heap0 = count::heap_bytes();
            // Many connections run on one endpoint (one completion queue,
            // one driver, on a thread of its own); a single one has its own
            // endpoint, driven on this thread and busy-polled as its
            // connection's settings say, as perftest's is.
            let mut endpoints = Vec::new();
            let mut driven_here = Vec::new();
            let mut driver_threads = Vec::new();
            let shared = o.connections > 1;
            if shared {
                let (ep, driver) = endpoint(Duration::ZERO)?;
                driver_threads.push(std::thread::spawn(move || block_on(driver.run())));
                endpoints.push(ep);
            }
            let started = std::time::Instant::now();
            let mut clients = Vec::new();
            for _ in 0..o.connections.max(1) {
                if !shared {
                    let (ep, driver) = endpoint(cfg.busy_poll)?;
                    driven_here.push(driver.run());
                    endpoints.push(ep);
                }
                let ep = endpoints.last().expect("an endpoint was made above");
                let c = block_on(ep.connect(to))
                    .map_err(|e| format!("connecting to {to} for {policy:?}: {e}"))?;
                if c.policies() != Policies::both(policy) {
                    return Err(format!(
                        "the connection to {to} runs {:?}, not {policy:?} both ways; is {to} the server's {policy:?} port (mw: the --listen port, confirm: the next)?",
                        c.policies()
                    ));
                }
                clients.push(c);
            }
            let n = clients.len();
            let setup = started.elapsed();
            let heap = (count::heap_bytes() - heap0).max(0) as u64 / n as u64;
            let registered = clients[0].registered_bytes();
            eprintln!(
                "# {policy:?}: {n} connection(s) set up in {:.2} s ({:.0} per second)",
                setup.as_secs_f64(),
                n as f64 / setup.as_secs_f64().max(1e-9)
            );
            let extra =
                format!(" connections={n} registered_bytes_per_conn={registered} heap_bytes_per_conn={heap}");
            let app = async move {
                let r = run_cases(
                    &clients,
                    &group,
                    o.iters,
                    o.warmup,
                    Server::Remote,
                    Labels {
                        mode: "async",
                        backend: "verbs",
                        executor: Executor::BlockOn.name(),
                        server: Place::Apart.name(),
                    },
                    &extra,
                )
                .await;
                // Closing the connections tells the server these clients are
                // done: their endpoints stop watching, and so close, the
                // bootstrap streams.
                for c in &clients {
                    c.close();
                }
                // The drivers end once the endpoints are gone and every
                // connection has finished (its memory deregistered).
                drop((clients, endpoints));
                r
            };
            let (r, _) = block_on(futures::future::join(app, futures::future::join_all(driven_here)));
            // This policy's connections are gone before the next policy's are
            // made (100 connections with 16 MiB buffers register 1.6 GB).
            for t in driver_threads {
                let _ = t.join();
            }
            r?;
        }
        Ok(())
    }

    /// Both sides here, on two protection domains of one device.
    pub fn local(o: &BenchOpts) -> Result<(), String> {
        header(o, "one process, client and server on two protection domains");
        for (policy, group) in cases::matrix(&o.kinds, &o.policies, &o.sizes, &o.inflight, o.check()) {
            let cfg = || config(o.pool(), &o.conn);
            let builder = || -> Result<_, String> {
                Ok(Endpoint::builder(open(o)?, Auth::Unauthenticated).queue_depth(1 << 14))
            };
            one_process(
                [builder()?, builder()?],
                Policies::both(policy),
                [cfg(), cfg()],
                &group,
                o.iters,
                o.warmup,
                (Executor::BlockOn, Place::Joined),
                ("async", "verbs"),
            )?;
        }
        Ok(())
    }
}
