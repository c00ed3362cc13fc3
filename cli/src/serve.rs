//! `mwcap serve`: the server of `mwcap bench ADDR`, over real verbs and the
//! async API. It listens on two ports, one per policy (the `--listen` port
//! serves mw, the next one confirm), and serves many connections at once
//! on each: every connection of a policy runs on one `Hub` (one completion
//! queue polled by one driver thread), each in a protection domain of its
//! own, and every request is answered as its header asks (see `cases`). A
//! connection ends when its client closes the bootstrap TCP stream. Its
//! connections are shown to `mwcap stat` on a local socket
//! (`--stat-socket`).

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
    use std::net::TcpListener;
    use std::pin::pin;
    use std::time::Duration;

    use futures::future::{select, Either};
    use futures::AsyncReadExt;
    use mwcap::bootstrap::Auth;
    use mwcap::conn::{accept_on, Connected, Hub, Policy, PolicyChoice, Role, SetupOptions};
    use mwcap::conn::{BufClass, SrqConfig};
    use mwcap::stat::{Registry, StatServer};
    use mwcap::verbs::VerbsNic;

    use crate::asyncbench::serve;
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
        // Fail at once, not at the first client, when the device is unusable.
        drop(open(o)?);
        if o.shared_buffers > 0 && o.max_payload > o.buffer_size && o.large_buffers > 0 && o.shared_large == 0
        {
            return Err(format!(
                "--shared-buffers with --large-buffers {} needs --shared-large: the shared pool has no \
                 buffers of --max-payload ({} bytes)",
                o.large_buffers, o.max_payload
            ));
        }
        let mut listeners = Vec::new();
        for policy in [Policy::Mw, Policy::Confirm] {
            let addr = policy_addr(o.listen, policy)?;
            let l = TcpListener::bind(addr)
                .map_err(|e| format!("cannot listen on {addr}: {e}; pick another --listen port"))?;
            listeners.push((policy, l, addr));
        }
        let registry = Registry::new();
        registry.add_device(&o.device, 1);
        let path = o.stat_socket.clone().unwrap_or_else(|| crate::stat_cmd::default_socket(o.listen.port()));
        let stat = StatServer::bind(&path, registry.clone()).map_err(|e| {
            format!("cannot serve stats at {}: {e}; pick another --stat-socket", path.display())
        })?;
        println!(
            "mwcap serve: listening on {} (mw) and {} (confirm), device {}; stats: mwcap stat --socket {}",
            listeners[0].2,
            listeners[1].2,
            o.device,
            stat.path().display()
        );
        let _ = std::io::stdout().flush();
        std::thread::scope(|s| {
            for (policy, l, _) in &listeners {
                let registry = &registry;
                s.spawn(move || accept_loop(o, l, *policy, auth, registry));
            }
        });
        Ok(())
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

    /// Entries of a hub's completion queue: the device's limit, at most 2^17
    /// (several hundred connections of `mwcap bench`'s sizes).
    fn hub_depth(nic: &VerbsNic) -> u32 {
        nic.device_attrs().max_cqe.min(1 << 17)
    }

    /// Accept connections and serve each on a thread of its own, forever;
    /// all of them run on one hub.
    fn accept_loop(o: &ServeOpts, listener: &TcpListener, policy: Policy, auth: &Auth, registry: &Registry) {
        let choice = match policy {
            Policy::Mw => PolicyChoice::Mw,
            Policy::Confirm => PolicyChoice::Confirm,
        };
        let hub = loop {
            match open(o).and_then(|nic| {
                let depth = hub_depth(&nic);
                let max_srq = nic.device_attrs().max_srq_wr;
                // Half the completion queue for the shared receives.
                let max_slots = max_srq.min(depth / 2).min(1 << 16);
                if policy == Policy::Mw && max_slots >= 1024 {
                    // mw connections take their control receives from one
                    // shared receive queue (docs/serving.md), and with
                    // --shared-buffers their buffers from one pool.
                    let q = SrqConfig { chunk: 1024, max_slots };
                    let made = match shared_classes(o) {
                        Some(classes) => Hub::with_shared_buffers(nic, depth, q, &classes),
                        None => Hub::with_shared_receives(nic, depth, q),
                    };
                    match made {
                        Ok(h) => return Ok(h),
                        Err(e) => eprintln!(
                            "mwcap serve: cannot create the mw hub with shared receives: {e}; its \
                             connections get receive queues of their own"
                        ),
                    }
                    let nic = open(o)?;
                    return Hub::new(nic, depth)
                        .map_err(|e| format!("cannot create the {policy:?} hub: {e}"));
                }
                Hub::new(nic, depth).map_err(|e| format!("cannot create the {policy:?} hub: {e}"))
            }) {
                Ok((hub, driver)) => {
                    std::thread::spawn(move || futures::executor::block_on(driver.run()));
                    registry.add_hub(&format!("{policy:?}").to_lowercase(), &hub);
                    break hub;
                }
                Err(e) => {
                    eprintln!("mwcap serve: {e}; trying again in 1 s");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        };
        // The device is probed once (by the first client), not on every accept.
        let opts = SetupOptions::new(choice, auth.clone()).timeout(SETUP);
        let max_payload = o.max_payload.max(o.buffer_size);
        // Each connection is served on a thread of its own, so that many
        // clients are served at once (`mwcap bench --connections`).
        std::thread::scope(|s| loop {
            let cfg = config(Role::Server, policy, o.pool(), &o.conn);
            match accept_on(&hub, listener, cfg, &opts) {
                Ok(c) => {
                    let hub = &hub;
                    s.spawn(move || serve_one(hub, c, policy, max_payload, registry));
                }
                Err(e) => eprintln!("mwcap serve: a {policy:?} connection failed to set up: {e}"),
            }
        })
    }

    /// Serve one connection until its client closes the bootstrap stream
    /// (or the connection goes down).
    fn serve_one(
        hub: &Hub<VerbsNic>,
        c: Connected<VerbsNic>,
        policy: Policy,
        max_payload: u32,
        registry: &Registry,
    ) {
        let Connected { endpoint, stream, policies } = c;
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        println!("mwcap serve: {policy:?} connection from {peer} ({policies:?})");
        let (server, driver) = hub.add(endpoint);
        registry.register(&server, peer.clone());
        let stream = match async_io::Async::new(stream) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("mwcap serve: cannot watch the bootstrap stream of {peer} ({e}); the connection ends with its QP");
                None
            }
        };
        // The client closing its stream (or dying) ends the connection.
        let watch = async {
            if let Some(mut s) = stream {
                let mut b = [0u8; 64];
                while matches!(s.read(&mut b).await, Ok(n) if n > 0) {}
            } else {
                futures::future::pending::<()>().await;
            }
            server.peer_gone();
        };
        let serving = async {
            let r = serve(&server, max_payload).await;
            server.close();
            r
        };
        let work = futures::future::join(serving, driver.run());
        let ((served, reason), _) = futures::executor::block_on(async {
            match select(pin!(work), pin!(watch)).await {
                Either::Left((out, _)) => (out, ()),
                Either::Right(((), work)) => (work.await, ()),
            }
        });
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
