//! A live view of a running process's connections, for operators:
//! [`Registry`] keeps the connections a server registers, [`StatServer`]
//! serves a snapshot of them over a local (Unix) socket, and `mwcap stat`
//! reads and prints it (like `ss` or `ibv_devinfo`).
//!
//! ```no_run
//! # fn f(conn: &mwcap::conn::Connection<mwcap::sim::SimNic>) -> std::io::Result<()> {
//! let registry = mwcap::stat::Registry::new();
//! let _server = mwcap::stat::StatServer::bind("/run/myapp/mwcap.sock", registry.clone())?;
//! // For every connection accepted:
//! registry.register(conn, "10.0.0.7:41234");
//! # Ok(()) }
//! ```
//!
//! Reading a snapshot takes each connection's lock once, off the data path;
//! a connection that has finished and whose handles are all dropped
//! leaves the registry by itself.
//!
//! # The format
//! Text, one record per line, `key=value` words (values have no spaces),
//! so that scripts can read it with `awk` as easily as `mwcap stat` does:
//!
//! ```text
//! mwcap-stat 1 pid=4242 connections=2
//! conn id=3 peer=10.0.0.7:41234 qpn=17 role=server request=mw reply=mw state=up age_ms=5120 calls=0 ...
//! conn id=4 ... state=down age_ms=90 ... reason=the peer closed the connection
//! total connections=2 up=1 calls=0 requests=1200 ...
//! ```
//!
//! A down connection's line ends with `reason=` and the reason as a
//! sentence (it may have spaces: it is always last). After the total, a
//! `hub name=mw connections=100 ...` line per endpoint the server added,
//! with the counts of its hub (with `srq_slots=... srq_shares=...` for one
//! with shared receives, and `pool_buffers=... pool_free=...` for one with
//! a shared buffer pool) ([`Registry::add_endpoint`]), then a
//! `device name=rxe0 port=1 ...` line per device the server added
//! ([`Registry::add_device`]) gives the kernel's hardware counters of the
//! port (RNR NAKs, retries, sequence errors, packets). The socket is made
//! readable by its owner only (mode 0600): the figures are the server's
//! business.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::backend::Nic;
use crate::conn::{ConnStats, Connection, DriverStats, LossReason, Policies, Policy, Role};

/// Version of the text format (the first line's second word).
pub const FORMAT_VERSION: u32 = 1;

/// One connection, as a snapshot sees it.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The connection's id in the process (as in its tracing span).
    pub id: u64,
    /// What the server called it when registering (usually the peer's
    /// address).
    pub peer: String,
    /// Its queue pair number.
    pub qpn: u32,
    /// Client or server.
    pub role: Role,
    /// The policy of each direction.
    pub policies: Policies,
    /// Why it is down, if it is.
    pub down: Option<LossReason>,
    /// How long since it was registered.
    pub age: Duration,
    /// Its counters.
    pub stats: ConnStats,
    /// Its driver's counters.
    pub driver: DriverStats,
}

type Source = Box<dyn Fn() -> Option<Snapshot> + Send + Sync>;

struct Entry {
    source: Source,
    /// Whether the connection is still alive (cheap: no snapshot).
    alive: Box<dyn Fn() -> bool + Send>,
}

/// The connections a process shows to `mwcap stat`, and the devices whose
/// hardware counters it shows with them. Cheap to clone (all clones are
/// one registry).
#[derive(Clone, Default)]
pub struct Registry {
    entries: Arc<Mutex<Vec<Entry>>>,
    devices: Arc<Mutex<Vec<(String, u8)>>>,
    hubs: Arc<Mutex<Vec<HubEntry>>>,
}

/// A hub's name and where its counts come from (`None` once it is gone).
type HubEntry = (String, Box<dyn Fn() -> Option<crate::conn::EndpointStats> + Send>);

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Show `conn` under `peer` (a name for the operator, usually the
    /// peer's address) until it and its driver are dropped.
    pub fn register<N: Nic + 'static>(&self, conn: &Connection<N>, peer: impl Into<String>) {
        let weak: Weak<_> = conn.downgrade();
        let alive = {
            let weak = weak.clone();
            Box::new(move || weak.strong_count() > 0)
        };
        let peer = peer.into();
        let since = Instant::now();
        let source: Source = Box::new(move || {
            let conn = Connection::upgrade(&weak)?;
            let (id, qpn, role, policies, down, stats) = conn.describe();
            Some(Snapshot {
                id,
                peer: peer.clone(),
                qpn,
                role,
                policies,
                down,
                age: since.elapsed(),
                stats,
                driver: conn.driver_stats(),
            })
        });
        let mut entries = self.entries.lock();
        // Forget the connections gone since, so that a server registering
        // connection after connection and never asked for a snapshot does
        // not keep an entry for each.
        entries.retain(|e| (e.alive)());
        entries.push(Entry { source, alive });
    }

    /// Show `endpoint`'s counts too, as `name` (a `hub` line: its
    /// connections, queue entries reserved of its depth, completions,
    /// orphans, turns, connection turns and sleeps), for as long as its
    /// completion queue lives (every clone of it is dropped and its driver
    /// has ended).
    #[cfg(not(loom))]
    pub fn add_endpoint<N: Nic + 'static>(&self, name: &str, endpoint: &crate::conn::Endpoint<N>) {
        let source = endpoint.stats_source();
        let name = name.chars().map(|c| if c.is_whitespace() { '_' } else { c }).collect();
        self.hubs.lock().push((name, Box::new(source)));
    }

    /// Show `device`'s `port` counters too, read from the kernel
    /// (`/sys/class/infiniband/<device>/ports/<port>/hw_counters`): the
    /// NIC's own view of RNR NAKs, retries, sequence errors and packets,
    /// which no completion reports one by one.
    pub fn add_device(&self, device: &str, port: u8) {
        let mut d = self.devices.lock();
        if !d.iter().any(|(n, p)| n == device && *p == port) {
            d.push((device.to_string(), port));
        }
    }

    /// Every registered connection still alive, in registration order (the
    /// others are forgotten).
    pub fn snapshot(&self) -> Vec<Snapshot> {
        let mut entries = self.entries.lock();
        let mut out = Vec::with_capacity(entries.len());
        entries.retain(|e| match (e.source)() {
            Some(s) => {
                out.push(s);
                true
            }
            None => false,
        });
        out
    }

    /// The snapshot in the text format (see the [module docs](self)),
    /// with a `device` line per device added.
    pub fn render(&self) -> String {
        let mut out = render(&self.snapshot());
        self.hubs.lock().retain(|(name, source)| {
            let Some(h) = source() else { return false };
            let _ = write!(
                out,
                "hub name={name} connections={} added={} reserved_entries={} depth={} completions={} orphans={} turns={} connection_turns={} sleeps={}",
                h.connections,
                h.added,
                h.reserved_entries,
                h.depth,
                h.completions,
                h.orphans,
                h.turns,
                h.connection_turns,
                h.sleeps
            );
            if let Some(q) = h.srq {
                // The line goes on: the hub's shared receive queue.
                let _ = write!(
                    out,
                    " srq_slots={} srq_shares={} srq_bytes={} srq_frames={} srq_grown={} srq_withheld={} srq_given_back={} srq_limit_events={} srq_refused={} srq_unclaimed={} srq_send_slots={} srq_send_lent={} srq_chunks_retired={} srq_chunks_freed={}",
                    q.slots,
                    q.shares,
                    q.registered_bytes,
                    q.frames,
                    q.grown,
                    q.withheld,
                    q.given_back,
                    q.limit_events,
                    q.refused,
                    q.unclaimed,
                    q.send_slots,
                    q.send_slots_lent,
                    q.chunks_retired,
                    q.chunks_freed
                );
            }
            if let Some(b) = h.buffers {
                // The line goes on: the hub's shared pool.
                let _ = write!(
                    out,
                    " pool_buffers={} pool_free={} pool_bytes={} pool_held_bytes={} pool_taken={} pool_empty={} pool_wakeups={} \
                     pool_windows={} pool_windows_free={} pool_windows_lent={} pool_windows_allocated={} \
                     pool_windows_dropped={} pool_window_alloc_failures={} pool_window_waits={}",
                    b.buffers,
                    b.free,
                    b.registered_bytes,
                    b.held_bytes,
                    b.taken,
                    b.empty,
                    b.wakeups,
                    b.windows,
                    b.windows_free,
                    b.windows_lent,
                    b.windows_allocated,
                    b.windows_dropped,
                    b.window_alloc_failures,
                    b.window_waits
                );
            }
            out.push('\n');
            true
        });
        for (name, port) in self.devices.lock().iter() {
            let dir = format!("/sys/class/infiniband/{name}/ports/{port}/hw_counters");
            let _ = write!(out, "device name={name} port={port}");
            match hw_counters(Path::new(&dir)) {
                Ok(counters) => {
                    for (k, v) in counters {
                        let _ = write!(out, " {k}={v}");
                    }
                }
                Err(e) => {
                    let _ = write!(out, " reason=cannot read {dir}: {e}");
                }
            }
            out.push('\n');
        }
        out
    }
}

/// The counters in a `hw_counters` directory, sorted by name.
fn hw_counters(dir: &Path) -> io::Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().replace(char::is_whitespace, "_");
        if let Ok(v) = std::fs::read_to_string(e.path()) {
            if let Ok(v) = v.trim().parse::<u64>() {
                out.push((name, v));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn policy(p: Policy) -> &'static str {
    match p {
        Policy::Mw => "mw",
        Policy::Confirm => "confirm",
    }
}

/// The counters of one connection (or a sum), as `key=value` words.
fn counters(out: &mut String, s: &ConnStats) {
    let owner = s.lease_owner.unwrap_or_default();
    let reader = s.lease_reader.unwrap_or_default();
    let pairs: [(&str, u64); 33] = [
        ("calls", s.calls),
        ("replies_received", s.replies_received),
        ("calls_failed", s.calls_failed),
        ("requests", s.requests),
        ("requests_dropped", s.requests_dropped),
        ("requests_busy", s.requests_busy),
        ("replies_sent", s.replies_sent),
        ("bytes_read", s.bytes_read),
        ("bytes_exposed", s.bytes_exposed),
        ("stale_reads", s.stale_reads),
        ("frames_sent", s.frames_sent),
        ("frames_received", s.frames_received),
        ("error_completions", s.error_completions),
        ("rnr_retries_exceeded", s.rnr_retries_exceeded),
        ("transport_retries_exceeded", s.transport_retries_exceeded),
        ("credits", u64::from(s.credits)),
        ("credits_owed", u64::from(s.credits_owed)),
        ("credit_waits", s.credit_waits),
        ("credit_frames", s.credit_frames),
        ("credits_returned", s.credits_returned),
        ("binds", owner.grants),
        ("releases", owner.released),
        ("expiries", owner.expired),
        ("invalidations", owner.invalidations),
        ("forged_releases", owner.forged_releases),
        ("peer_invalidations", owner.peer_invalidations),
        ("window_reads", reader.reads),
        ("window_reads_failed", reader.reads_failed),
        ("declined", reader.declined),
        ("buffers_free", u64::from(s.buffers_free)),
        ("buffers_user", u64::from(s.buffers_user)),
        ("buffers_exposed", u64::from(s.buffers_exposed)),
        ("buffers_reading", u64::from(s.buffers_reading)),
    ];
    for (k, v) in pairs {
        let _ = write!(out, " {k}={v}");
    }
}

/// Add `b`'s counters to `a`'s.
fn add(a: &mut ConnStats, b: &ConnStats) {
    macro_rules! sum {
        ($($f:ident),*) => { $( a.$f += b.$f; )* };
    }
    sum!(
        calls,
        replies_received,
        calls_failed,
        requests,
        requests_dropped,
        requests_busy,
        replies_sent,
        bytes_read,
        bytes_exposed,
        stale_reads,
        frames_sent,
        frames_received,
        completions,
        error_completions,
        rnr_retries_exceeded,
        transport_retries_exceeded,
        credits,
        credits_owed,
        credit_waits,
        credit_frames,
        credits_returned,
        buffers_free,
        buffers_user,
        buffers_exposed,
        buffers_reading
    );
    if let Some(o) = b.lease_owner {
        let t = a.lease_owner.get_or_insert_with(Default::default);
        t.grants += o.grants;
        t.released += o.released;
        t.expired += o.expired;
        t.invalidations += o.invalidations;
        t.forged_releases += o.forged_releases;
        t.peer_invalidations += o.peer_invalidations;
    }
    if let Some(r) = b.lease_reader {
        let t = a.lease_reader.get_or_insert_with(Default::default);
        t.reads += r.reads;
        t.reads_failed += r.reads_failed;
        t.declined += r.declined;
    }
}

/// `snaps` in the text format (see the [module docs](self)).
pub fn render(snaps: &[Snapshot]) -> String {
    let mut out = String::with_capacity(256 * (snaps.len() + 2));
    let _ =
        writeln!(out, "mwcap-stat {FORMAT_VERSION} pid={} connections={}", std::process::id(), snaps.len());
    let mut total = ConnStats::default();
    for s in snaps {
        // A registered name is the operator's words: no spaces in a value.
        let peer: String = s.peer.chars().map(|c| if c.is_whitespace() { '_' } else { c }).collect();
        let _ = write!(
            out,
            "conn id={} peer={} qpn={} role={} request={} reply={} state={} age_ms={}",
            s.id,
            if peer.is_empty() { "-" } else { &peer },
            s.qpn,
            match s.role {
                Role::Client => "client",
                Role::Server => "server",
            },
            policy(s.policies.request),
            policy(s.policies.reply),
            if s.down.is_some() { "down" } else { "up" },
            s.age.as_millis(),
        );
        counters(&mut out, &s.stats);
        let _ = write!(out, " driver_turns={} driver_busy_turns={}", s.driver.turns, s.driver.busy_turns);
        if let Some(r) = &s.down {
            let reason = r.to_string().replace('\n', " ");
            let _ = write!(out, " reason={reason}");
        }
        out.push('\n');
        add(&mut total, &s.stats);
    }
    let up = snaps.iter().filter(|s| s.down.is_none()).count();
    let _ = write!(out, "total connections={} up={up}", snaps.len());
    counters(&mut out, &total);
    out.push('\n');
    out
}

/// Serves [`Registry::render`] to every client of a Unix socket, one
/// snapshot per connection, from a thread of its own (`mwcap-stat`).
/// Dropping it stops the thread and removes the socket file.
pub struct StatServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StatServer {
    /// Listen at `path` (a stale socket file left by a dead process is
    /// replaced; a live one is an error: another server uses it).
    pub fn bind(path: impl AsRef<Path>, registry: Registry) -> io::Result<StatServer> {
        let path = path.as_ref().to_path_buf();
        if UnixStream::connect(&path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is served by another live process; pick another stat socket", path.display()),
            ));
        }
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("mwcap-stat".into()).spawn(move || {
            for stream in listener.incoming() {
                if flag.load(Ordering::Acquire) {
                    break;
                }
                match stream {
                    Ok(mut s) => {
                        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                        let _ = s.write_all(registry.render().as_bytes());
                    }
                    // Out of file descriptors or the like: back off rather
                    // than spin on the error.
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        })?;
        Ok(StatServer { path, stop, thread: Some(thread) })
    }

    /// Where it listens.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for StatServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept with a connection of our own. When that fails
        // (the socket file was removed, or no descriptor is left) the thread
        // is left blocked in accept rather than joined forever; it ends at
        // its next client, or with the process.
        let woken = UnixStream::connect(&self.path).is_ok();
        if let Some(t) = self.thread.take() {
            if woken {
                let _ = t.join();
            }
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Read one snapshot from the stat socket at `path` (what `mwcap stat` does).
pub fn fetch(path: impl AsRef<Path>) -> io::Result<String> {
    use std::io::Read;
    let path = path.as_ref();
    let mut s = UnixStream::connect(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "cannot connect to {}: {e}; is the server running with this stat socket (`mwcap serve --stat-socket`)?",
                path.display()
            ),
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::Auth;
    use crate::conn::{Endpoint, Policies, Policy};
    use crate::sim::{DeviceConfig, Fabric, SimNic};

    /// A connection between two endpoints of their own (not driven).
    fn connection(fabric: &Fabric, i: usize) -> Connection<SimNic> {
        let ep = |name: String| {
            Endpoint::builder(fabric.add_device(DeviceConfig::spec().named(&name)), Auth::Unauthenticated)
                .build()
                .unwrap()
                .0
        };
        let (c, s) = (ep(format!("c{i}")), ep(format!("s{i}")));
        c.connect_local(&s, Policies::both(Policy::Mw)).unwrap().0
    }

    #[test]
    fn registering_forgets_the_connections_gone_without_a_snapshot() {
        let fabric = Fabric::with_seed(1);
        let registry = Registry::new();
        let kept = connection(&fabric, 0);
        registry.register(&kept, "kept");
        for i in 1..50 {
            let conn = connection(&fabric, i);
            registry.register(&conn, format!("gone {i}"));
            drop(conn);
        }
        // The last one registered is gone too, but is forgotten only at the
        // next registration or snapshot.
        assert_eq!(registry.entries.lock().len(), 2);
        assert_eq!(registry.snapshot().len(), 1);
        assert_eq!(registry.entries.lock().len(), 1);
    }
}
