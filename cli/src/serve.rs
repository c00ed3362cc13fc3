//! `mwcap serve`: the server of `mwcap bench ADDR`, over real verbs and the
//! async API. It listens on two ports, one per policy (the `--listen` port
//! serves mw, the next one confirm), and serves many connections at once
//! on each: every connection of a policy runs on one `Endpoint` (one
//! completion queue polled by one driver thread), each in a protection
//! domain of its own, and every request is answered as its header asks
//! (see `cases`). A connection ends when its client closes the bootstrap
//! TCP stream (the endpoint watches it). Its
//! connections are shown to `mwcap stat` on a local socket
//! (`--stat-socket`), and with `--metrics ADDR` its telemetry to
//! Prometheus (`metrics_http`).

use std::process::ExitCode;

use mwcap::bootstrap::Auth;

use crate::ServeOpts;

#[cfg(not(all(feature = "verbs", not(loom))))]
pub fn run(_: &ServeOpts, _: &Auth) -> ExitCode {
    eprintln!("mwcap serve: this build has no verbs backend; rebuild with `--features verbs`");
    ExitCode::from(2)
}

/// Serve until killed; every client must prove `auth`'s key.
#[cfg(all(feature = "verbs", not(loom)))]
pub fn run(o: &ServeOpts, auth: &Auth) -> ExitCode {
    match imp::run(o, auth) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mwcap serve: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(all(feature = "verbs", not(loom)))]
mod imp {
    use std::io::Write;
    use std::net::SocketAddr;
    use std::time::Duration;

    use futures::executor::block_on;
    use mwcap::bootstrap::Auth;
    use mwcap::conn::SrqConfig;
    use mwcap::conn::{BufClass, Connection, Endpoint, EndpointDriver, Policy, PolicyChoice, SetupError};
    use mwcap::stat::{Registry, StatServer};
    use mwcap::verbs::VerbsNic;
    use mwcap::ProbeCache;

    use crate::asyncbench::{serve, Delegations};
    use crate::bench::policy_addr;
    use crate::cases::config;
    use crate::ServeOpts;

    /// How long the hellos and the ready phase may take once a client connected.
    const SETUP: Duration = Duration::from_secs(60);

    fn open(o: &ServeOpts) -> Result<VerbsNic, String> {
        VerbsNic::open(Some(&o.device), 1, o.gid_index).map_err(|e| {
            format!("cannot open {} (GID index {}): {e}; check `mwcap probe`", o.device, o.gid_index)
        })
    }

    pub fn run(o: &ServeOpts, auth: &Auth) -> Result<(), String> {
        // Its allocations are counted by the benchmarks it serves.
        crate::count::parking_lot_settled();
        if o.shared_buffers > 0 && o.max_payload > o.buffer_size && o.large_buffers > 0 && o.shared_large == 0
        {
            return Err(format!(
                "--shared-buffers with --large-buffers {} needs --shared-large: the shared pool has no \
                 buffers of --max-payload ({} bytes)",
                o.large_buffers, o.max_payload
            ));
        }
        // Both endpoints are made (their ports bound, the device opened and
        // probed) before anything is printed: a taken port or an unusable
        // device fails at once, not at the first client.
        let probes = ProbeCache::new();
        let mut endpoints = Vec::new();
        for policy in [Policy::Mw, Policy::Confirm] {
            let addr = policy_addr(o.listen, policy)?;
            if policy == Policy::Mw {
                if let Some(why) = mw_not_served(o, &probes)? {
                    eprintln!("mwcap serve: not serving mw on {}: {why}", o.device);
                    continue;
                }
            }
            let (endpoint, driver) = endpoint(o, policy, addr, auth, &probes)?;
            endpoints.push((policy, endpoint, driver));
        }
        let registry = Registry::new();
        registry.add_device(&o.device, 1);
        for (policy, endpoint, _) in &endpoints {
            registry.add_endpoint(&format!("{policy:?}").to_lowercase(), endpoint);
        }
        let path = o.stat_socket.clone().unwrap_or_else(|| crate::stat_cmd::default_socket(o.listen.port()));
        let stat = StatServer::bind(&path, registry.clone()).map_err(|e| {
            format!("cannot serve stats at {}: {e}; pick another --stat-socket", path.display())
        })?;
        if let Some(at) = o.metrics {
            let listener = crate::metrics_http::bind(at)?;
            let handle = crate::metrics_http::install()?;
            let served: Vec<Endpoint<VerbsNic>> = endpoints.iter().map(|(_, e, _)| e.clone()).collect();
            println!("mwcap serve: metrics at http://{}/metrics", listener.local_addr().unwrap_or(at));
            std::thread::spawn(move || {
                crate::metrics_http::serve(listener, handle, || {
                    served.iter().for_each(Endpoint::record_metrics)
                })
            });
        }
        let addr = |p: Policy| {
            let e = endpoints.iter().find(|(q, ..)| *q == p);
            e.and_then(|(_, e, _)| e.local_addr()).map_or_else(|| "nothing".into(), |a| a.to_string())
        };
        println!(
            "mwcap serve: listening on {} (mw) and {} (confirm), device {}; stats: mwcap stat --socket {}",
            addr(Policy::Mw),
            addr(Policy::Confirm),
            o.device,
            stat.path().display()
        );
        let _ = std::io::stdout().flush();
        let max_payload = o.max_payload.max(o.buffer_size);
        std::thread::scope(|s| {
            for (policy, endpoint, driver) in endpoints {
                // Every connection of a policy runs on its endpoint's one
                // completion queue, polled by this thread.
                std::thread::spawn(move || block_on(driver.run()));
                let registry = &registry;
                s.spawn(move || accept_loop(s, &endpoint, policy, max_payload, registry));
            }
        });
        Ok(())
    }

    /// Why this device does not serve mw (the capability probe's verdict),
    /// if it does not: its type-2 windows fail, or a peer can invalidate
    /// windows bound to other connections' queue pairs (rxe) and the
    /// clients are not trusted (--trusted-peers). Confirm is served either way.
    fn mw_not_served(o: &ServeOpts, probes: &ProbeCache) -> Result<Option<String>, String> {
        let report = probes.report(&open(o)?);
        Ok(if !report.mw_usable {
            let why = report.first_failure().map(|(s, t)| format!("{s}: {t}")).unwrap_or_default();
            Some(format!("its type-2 windows fail ({why})"))
        } else if !report.mw_safe_with_untrusted_peers() && !o.trusted_peers {
            Some(
                "a client's SEND_WITH_INV can invalidate windows bound to other connections there, and a \
                 double invalidation panics the rxe kernel; pass --trusted-peers if every client is yours"
                    .into(),
            )
        } else {
            None
        })
    }

    /// The shared pool's classes (--shared-buffers, --shared-large), if any.
    fn shared_classes(o: &ServeOpts) -> Option<Vec<BufClass>> {
        if o.shared_buffers == 0 {
            return None;
        }
        let mut classes = vec![BufClass { size: o.buffer_size, count: o.shared_buffers }];
        if o.max_payload > o.buffer_size {
            classes.push(BufClass { size: o.max_payload, count: o.shared_large });
        }
        Some(classes)
    }

    /// Entries of an endpoint's completion queue: the device's limit, at
    /// most 2^17 (several hundred connections of `mwcap bench`'s sizes).
    fn queue_depth(nic: &VerbsNic) -> u32 {
        nic.device_attrs().max_cqe.min(1 << 17)
    }

    /// The endpoint serving `policy` on `addr`. mw connections (and, with
    /// --trusted-peers, confirm ones: sharing puts every connection in one
    /// protection domain, where a confirm offer's key reaches the others'
    /// memory) take their control receives from one shared receive queue
    /// (docs/serving.md), and with --shared-buffers their buffers from one
    /// pool; a device that cannot make those gets an endpoint whose
    /// connections have their own.
    fn endpoint(
        o: &ServeOpts,
        policy: Policy,
        addr: SocketAddr,
        auth: &Auth,
        probes: &ProbeCache,
    ) -> Result<(Endpoint<VerbsNic>, EndpointDriver<VerbsNic>), String> {
        let choice = match policy {
            Policy::Mw => PolicyChoice::Mw,
            Policy::Confirm => PolicyChoice::Confirm,
        };
        // --busy-poll-us: the driver polls that long before it sleeps, as
        // perftest's server polls (a request found by a polling driver, not
        // by a wake-up through the completion channel).
        let spin = o.conn.busy_poll_us.map_or(Duration::ZERO, Duration::from_micros);
        let builder = |nic: VerbsNic| {
            Endpoint::builder(nic, auth.clone())
                .policy(choice)
                .config(config(o.pool(), &o.conn))
                .busy_poll(spin)
                .handshake_timeout(SETUP)
                .probe_cache(probes.clone())
                .trusted_peers(o.trusted_peers)
                .name(&format!("{policy:?}").to_lowercase())
                .listen(addr)
        };
        let failed = |e: SetupError| match e {
            // Binding the listening socket is the only bootstrap step of a build.
            SetupError::Bootstrap(e) => format!("cannot listen on {addr}: {e}; pick another --listen port"),
            e => format!("cannot serve {policy:?} on {}: {e}", o.device),
        };
        let nic = open(o)?;
        let depth = queue_depth(&nic);
        // Half the completion queue for the shared receives.
        let max_slots = nic.device_attrs().max_srq_wr.min(depth / 2).min(1 << 16);
        if (policy != Policy::Mw && !o.trusted_peers) || max_slots < 1024 {
            return builder(nic).queue_depth(depth).build().map_err(failed);
        }
        let mut shared =
            builder(nic).queue_depth(depth).shared_receives(SrqConfig { chunk: 1024, max_slots });
        if let Some(classes) = shared_classes(o) {
            shared = shared.shared_buffers(&classes);
        }
        match shared.build() {
            Ok(made) => return Ok(made),
            // Without sharing these fail the same.
            Err(e @ (SetupError::Bootstrap(_) | SetupError::MwUnusable { .. })) => return Err(failed(e)),
            Err(e) => eprintln!(
                "mwcap serve: cannot create the {policy:?} endpoint with shared receives: {e}; its \
                 connections get receive queues of their own"
            ),
        }
        builder(open(o)?).queue_depth(depth).build().map_err(failed)
    }

    /// Accept connections and serve each on a thread of its own (so that
    /// many clients are served at once: `mwcap bench --connections`),
    /// forever.
    fn accept_loop<'s>(
        s: &'s std::thread::Scope<'s, '_>,
        endpoint: &Endpoint<VerbsNic>,
        policy: Policy,
        max_payload: u32,
        registry: &'s Registry,
    ) {
        // delegate_read's ranges: regions of this endpoint, for every connection.
        let delegations = std::sync::Arc::new(Delegations::new(endpoint.clone()));
        block_on(async {
            loop {
                match endpoint.accept().await {
                    Ok(conn) => {
                        let delegations = delegations.clone();
                        s.spawn(move || serve_one(conn, policy, max_payload, registry, &delegations));
                    }
                    Err(SetupError::ListenerClosed) => break,
                    Err(e) => eprintln!("mwcap serve: a {policy:?} connection failed to set up: {e}"),
                }
            }
        })
    }

    /// Serve one connection until it is down: its client closed the
    /// bootstrap stream (the endpoint watches it) or the connection failed.
    fn serve_one(
        conn: Connection<VerbsNic>,
        policy: Policy,
        max_payload: u32,
        registry: &Registry,
        delegations: &Delegations<VerbsNic>,
    ) {
        let peer = conn.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
        let who = conn.peer_identity().map_or_else(|| "no key".into(), |id| format!("identity {id}"));
        println!("mwcap serve: {policy:?} connection from {peer}, {who} ({:?})", conn.policies());
        registry.register(&conn, peer.clone());
        let served = block_on(serve(&conn, max_payload, delegations));
        conn.close();
        let reason = block_on(conn.closed());
        match served {
            Ok(n) => {
                println!("mwcap serve: {policy:?} connection from {peer} done after {n} requests ({reason})")
            }
            Err(e) => {
                eprintln!("mwcap serve: {policy:?} connection from {peer} failed after: {e} ({reason})")
            }
        }
    }
}
