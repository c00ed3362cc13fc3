//! `mwcap`: probe devices for what mwcap needs, a demo on the simulated NIC,
//! and the benchmark (`bench`, with `serve` as its server over real verbs).

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use mwcap::conn::Policy;

#[cfg(not(loom))]
mod asyncbench;
mod auth_args;
mod bench;
mod cases;
mod count;
mod demo;
#[cfg(not(loom))]
mod executors;
#[cfg_attr(not(all(feature = "verbs", not(loom))), allow(dead_code))]
mod metrics_http;
mod probe_cmd;
mod serve;
mod simbench;
#[cfg(not(loom))]
mod stat_cmd;

/// Safe zero-copy RDMA: probe devices, run the demo, measure.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log to stderr at this level and above (error, warn, info, debug,
    /// trace): connection spans (`mwcap.conn`), per-call spans
    /// (`mwcap.call`, `mwcap.request`, with trace ids) and what went wrong.
    #[arg(long, global = true, value_name = "LEVEL")]
    log: Option<tracing::Level>,
}

#[derive(Subcommand)]
enum Cmd {
    /// List RDMA devices and probe what mwcap needs (type-2 windows, bounds,
    /// SEND_WITH_INV) by trying it on a throw-away loopback QP pair.
    Probe {
        /// Probe only this device (default: every device).
        #[arg(long)]
        device: Option<String>,
        /// Port number.
        #[arg(long, default_value_t = 1)]
        port: u8,
        /// GID index (1 is `::ffff:127.0.0.1` on rxe over `lo`).
        #[arg(long, default_value_t = 1)]
        gid_index: u8,
        /// Probe a simulated NIC of this kind instead of real devices.
        #[arg(long, value_enum)]
        sim: Option<SimKind>,
    },
    /// Measure calls through the async API: rpc, reply_read, request_read
    /// and delegate_read, per policy, size and calls in flight; one
    /// machine-readable line per case. With ADDR, this is the client of a
    /// `mwcap serve` there; without, both sides run in this process (two
    /// protection domains of one device), or on the simulated NIC (--sim).
    Bench(BenchOpts),
    /// The server side of `mwcap bench ADDR`: answers calls as each request
    /// header asks, one connection at a time per policy, until killed.
    Serve(ServeOpts),
    /// A live view of a running `mwcap serve`: its connections, their
    /// policies, state and counters (calls, bytes, binds, invalidations,
    /// expiries, stale reads, credit, buffers), from its stat socket.
    #[cfg(not(loom))]
    Stat(stat_cmd::StatOpts),
    /// Show the protocols at work on the simulated NIC: leases, expiry
    /// without teardown, a stale read caught, a dead peer, the probe.
    Demo {
        /// Seed of the simulated fabric.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// A kind of case of `mwcap bench`, on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum CaseArg {
    /// A call with no payload either way (at 64 B, on the first policy's connection).
    Rpc,
    /// The server replies with a payload the client READs.
    #[value(name = "reply_read")]
    ReplyRead,
    /// The client sends a payload the server READs.
    #[value(name = "request_read")]
    RequestRead,
    /// The server delegates a range of its region to the client's identity
    /// and the client redeems the token: timed from having the token to
    /// the payload read and released.
    #[value(name = "delegate_read")]
    DelegateRead,
}

impl From<CaseArg> for cases::Kind {
    fn from(c: CaseArg) -> cases::Kind {
        match c {
            CaseArg::Rpc => cases::Kind::Rpc,
            CaseArg::ReplyRead => cases::Kind::ReplyRead,
            CaseArg::RequestRead => cases::Kind::RequestRead,
            CaseArg::DelegateRead => cases::Kind::DelegateRead,
        }
    }
}

/// A policy for exposed memory, on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PolicyArg {
    /// Type-2 memory windows.
    Mw,
    /// The confirm protocol.
    Confirm,
}

impl From<PolicyArg> for Policy {
    fn from(p: PolicyArg) -> Policy {
        match p {
            PolicyArg::Mw => Policy::Mw,
            PolicyArg::Confirm => Policy::Confirm,
        }
    }
}

/// An executor for `mwcap bench --sim`, on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExecutorArg {
    /// `futures::executor::block_on`.
    #[value(name = "block_on")]
    BlockOn,
    /// smol's executor and block_on.
    Smol,
    /// tokio's multi-thread runtime.
    Tokio,
}

/// Where `mwcap bench --sim` runs the server, on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ServerArg {
    /// On a thread of its own under `futures::executor::block_on`, as
    /// another process would run it: every call crosses between threads.
    Apart,
    /// Beside the client, under the same executor.
    Joined,
}

/// Options of `mwcap bench`.
#[derive(Args)]
pub struct BenchOpts {
    /// Address of a `mwcap serve` (its mw port; confirm is on the next
    /// port). Without it, the server runs in this process.
    pub addr: Option<SocketAddr>,
    /// The device.
    #[arg(long, default_value = "rxe0")]
    pub device: String,
    /// GID index (1 is `::ffff:127.0.0.1` on rxe over `lo`).
    #[arg(long, default_value_t = 1)]
    pub gid_index: u8,
    /// Measured calls per case.
    #[arg(long, default_value_t = 1000)]
    pub iters: u32,
    /// Warm-up calls per case, before the measured ones.
    #[arg(long, default_value_t = 100)]
    pub warmup: u32,
    /// Payload sizes in bytes (rpc runs at 64 only).
    #[arg(long, value_delimiter = ',', default_value = "64,4096,65536")]
    pub sizes: Vec<u32>,
    /// Calls in flight at once (1: latency; more: throughput).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub inflight: Vec<u32>,
    /// Policies, one connection each (confirm alone on a NIC without
    /// working type-2 windows).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "mw,confirm")]
    pub policy: Vec<PolicyArg>,
    /// The kinds of case to run (each at every size, policy and in-flight
    /// count; rpc at 64 B only).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "rpc,reply_read,request_read,delegate_read"
    )]
    pub cases: Vec<CaseArg>,
    /// Data buffers of 64 KiB (or of the largest size, if smaller) per side.
    #[arg(long, default_value_t = 32)]
    pub buffers: u32,
    /// Buffers of the largest size per side, when it exceeds 64 KiB (the
    /// larger payloads wait for one of them).
    #[arg(long, default_value_t = 4)]
    pub large_buffers: u32,
    /// Connections per policy; the calls of each case are spread over them
    /// (each connection keeps `inflight` calls in flight).
    #[arg(long, default_value_t = 1)]
    pub connections: u32,
    /// With `--sim`: both endpoints with shared receives (one shared
    /// receive queue per side; mode `async-srq`). Such an endpoint serves
    /// the mw policy only unless its peers are trusted, so the confirm
    /// cases are skipped without --trusted-peers.
    #[arg(long, requires = "sim")]
    pub srq: bool,
    /// With `--sim --srq`: the endpoints also share a buffer pool of the
    /// connection's classes (`EndpointBuilder::shared_buffers`; mode
    /// `async-pool`): each buffer, and each exposure's window, is taken
    /// from the pool while in use.
    #[arg(long, requires = "srq")]
    pub shared_buffers: bool,
    /// Write and check only a stamp at each end of every payload (its
    /// call's tag and length, 8 bytes each) instead of every byte, on both
    /// sides (the request header tells the server; `check=stamp` on each
    /// line). For timing runs, where writing and checking a large payload
    /// would cost more than moving it (under emulation); the default checks
    /// every byte, which is what proves the READs right.
    #[arg(long)]
    pub stamp_only: bool,
    /// Settings of each connection beyond its pool.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Run on the simulated NIC instead (no RDMA needed): the async API
    /// under each of --executor, next to the sans-IO loop.
    #[arg(long, conflicts_with = "addr")]
    pub sim: bool,
    /// With `--sim`: the executors to run the client's side of the async
    /// API under (`executor=` on each line): block_on
    /// (`futures::executor::block_on`, the calls and the client's driver on
    /// the calling thread), smol (`smol::block_on` for the calls, smol's
    /// executor on a thread of its own for the driver), tokio (a
    /// multi-thread runtime, each future a spawned task). The server runs
    /// as `--server` says. Over real verbs the async API runs under
    /// block_on.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "block_on,smol,tokio")]
    pub executor: Vec<ExecutorArg>,
    /// With `--sim`: where the server (its serving loop and its endpoint's
    /// driver) runs (`server=` on each line): apart (on a thread of its
    /// own under `futures::executor::block_on`, as another process would
    /// run it, whatever the client's executor: the lines to compare
    /// executors by) or joined (beside the client under the same
    /// executor: under block_on the whole call on one thread, the line to
    /// compare with the sans-IO loop, which turns both sides on one
    /// thread too).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "apart,joined")]
    pub server: Vec<ServerArg>,
    /// Trust the peers not to invalidate windows they were not granted:
    /// needed for mw on a device where a peer's SEND_WITH_INV reaches
    /// windows bound to other connections' queue pairs (rxe; `mwcap probe`
    /// says), where a hostile peer could panic the kernel.
    #[arg(long)]
    pub trusted_peers: bool,
    /// How the bootstrap is authenticated (with ADDR).
    #[command(flatten)]
    pub auth: auth_args::AuthArgs,
    #[arg(skip)]
    pub policies: Vec<Policy>,
    #[arg(skip)]
    pub kinds: Vec<cases::Kind>,
}

impl BenchOpts {
    /// Bytes per standard data buffer: 64 KiB, or the largest size if smaller.
    pub fn buffer_size(&self) -> u32 {
        self.max_payload().clamp(1, 64 << 10)
    }

    /// The largest payload size.
    pub fn max_payload(&self) -> u32 {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    /// How much of each payload is written and checked.
    pub fn check(&self) -> cases::Check {
        if self.stamp_only {
            cases::Check::Stamp
        } else {
            cases::Check::EveryByte
        }
    }

    /// Each side's pool.
    pub fn pool(&self) -> cases::Pool {
        cases::Pool {
            buffers: self.buffers,
            buffer_size: self.buffer_size(),
            max_payload: self.max_payload(),
            large: self.large_buffers,
        }
    }
}

/// Connection settings `bench` and `serve` share.
#[derive(Args, Clone, Copy, Debug)]
pub struct ConnArgs {
    /// Control slots per connection (SENDs in flight, receives posted; at
    /// least `--start-credits`).
    #[arg(long, default_value_t = 64)]
    pub ctrl_slots: u32,
    /// Frames the peer may send before this side's first credit grant
    /// (`Config::start_credits`, 3 to `--ctrl-slots`; told to the peer in
    /// the hello). With shared receives, what an idle connection holds of
    /// the queue (4 KiB each).
    #[arg(long, default_value_t = 8)]
    pub start_credits: u32,
    /// Control slots for SENDs, if fewer than `--ctrl-slots`
    /// (`Config::send_slots`; at least 2).
    #[arg(long)]
    pub send_slots: Option<u32>,
    /// How long an exposed payload stays readable, in ms (`Config::lease_time`):
    /// longer than the slowest READ, e.g. many 16 MiB payloads at once on a
    /// slow link.
    #[arg(long, default_value_t = 5000)]
    pub lease_ms: u64,
    /// How long a call may take, in ms (`Config::call_timeout`): longer than
    /// the lease.
    #[arg(long, default_value_t = 10000)]
    pub call_timeout_ms: u64,
    /// How long a waiting call (`Config::busy_poll`) and a server's wait
    /// for its next request (`Config::serve_busy_poll`) take their
    /// connection's turns themselves, and how long the endpoint's driver
    /// keeps polling an idle completion queue before it sleeps on the
    /// completion channel (`EndpointBuilder::busy_poll`), in µs. Default:
    /// the library's (200 µs for a call, 0 for a server's wait and for a
    /// driver: they wait, and sleep, at once). A
    /// one-connection `bench ADDR`, whose driver runs on the calling
    /// thread, polls it for as long as its calls; `bench --sim` leaves its
    /// drivers at 0.
    #[arg(long)]
    pub busy_poll_us: Option<u64>,
    /// Server: request payloads that may wait for a free buffer per
    /// connection before it is closed (`Config::max_waiting_payloads`,
    /// default: the library's; sizing: `docs/deploy.md`).
    #[arg(long)]
    pub max_waiting_payloads: Option<u32>,
    /// Server: bytes of inline request payloads that may wait for a free
    /// buffer per connection before it is closed
    /// (`Config::max_waiting_inline`, default: the library's).
    #[arg(long)]
    pub max_waiting_inline: Option<u32>,
    /// Server: unanswered requests a connection may have before the next
    /// is refused unread with a busy answer (`Config::max_requests`,
    /// default: the library's).
    #[arg(long)]
    pub max_requests: Option<u32>,
}

impl ConnArgs {
    /// Put these settings into `c`.
    pub fn apply(&self, c: &mut mwcap::conn::Config) {
        c.ctrl_slots = self.ctrl_slots;
        c.start_credits = self.start_credits;
        c.send_slots = self.send_slots;
        c.lease_time = std::time::Duration::from_millis(self.lease_ms);
        c.call_timeout = std::time::Duration::from_millis(self.call_timeout_ms);
        if let Some(n) = self.max_waiting_payloads {
            c.max_waiting_payloads = n;
        }
        if let Some(n) = self.max_waiting_inline {
            c.max_waiting_inline = n;
        }
        if let Some(n) = self.max_requests {
            c.max_requests = n;
        }
        if let Some(us) = self.busy_poll_us {
            c.busy_poll = std::time::Duration::from_micros(us);
            c.serve_busy_poll = c.busy_poll;
        }
    }
}

/// Options of `mwcap serve`.
#[derive(Args)]
pub struct ServeOpts {
    /// The device.
    #[arg(long, default_value = "rxe0")]
    pub device: String,
    /// GID index (1 is `::ffff:127.0.0.1` on rxe over `lo`).
    #[arg(long, default_value_t = 1)]
    pub gid_index: u8,
    /// Where to listen for mw connections; confirm connections are taken
    /// on the next port.
    #[arg(long, default_value = "0.0.0.0:18600")]
    pub listen: SocketAddr,
    /// Data buffers per connection.
    #[arg(long, default_value_t = 32)]
    pub buffers: u32,
    /// Bytes per standard data buffer.
    #[arg(long, default_value_t = 64 << 10)]
    pub buffer_size: u32,
    /// The largest payload served (and read): when above --buffer-size,
    /// each connection gets --large-buffers buffers of this size.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_payload: u32,
    /// Buffers of --max-payload bytes per connection.
    #[arg(long, default_value_t = 2)]
    pub large_buffers: u32,
    /// Serve the mw connections (and with --trusted-peers the confirm
    /// ones) from one buffer pool shared by all of them,
    /// of this many --buffer-size buffers (and --shared-large ones), and a
    /// memory window per buffer; each connection then registers no buffers
    /// and allocates no windows of its own, and --buffers and
    /// --large-buffers say how many buffers it may hold at once. 0: each
    /// connection registers its own.
    #[arg(long, default_value_t = 0)]
    pub shared_buffers: u32,
    /// With --shared-buffers: --max-payload buffers in the shared pool.
    #[arg(long, default_value_t = 0)]
    pub shared_large: u32,
    /// Settings of each connection beyond its pool.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Trust the peers not to invalidate windows they were not granted:
    /// needed for mw on a device where a peer's SEND_WITH_INV reaches
    /// windows bound to other connections' queue pairs (rxe; `mwcap probe`
    /// says), where a hostile peer could panic the kernel. It also serves
    /// the confirm clients from shared receives (and --shared-buffers):
    /// those put every connection in one protection domain, where a
    /// confirm offer's key lets one client read what is offered to another.
    #[arg(long)]
    pub trusted_peers: bool,
    /// How the bootstrap is authenticated.
    #[command(flatten)]
    pub auth: auth_args::AuthArgs,
    /// Where `mwcap stat` reads this server's live view (a Unix socket,
    /// mode 0600). Default: `/tmp/mwcap-<port of --listen>.sock`.
    #[arg(long)]
    pub stat_socket: Option<std::path::PathBuf>,
    /// Serve the capability telemetry in the Prometheus text format at
    /// `http://ADDR/metrics` (each series labelled `endpoint="mw"` or
    /// `"confirm"`; see `mwcap::telemetry` and docs/deploy.md). Off by
    /// default. The port has no authentication: bind it to an address only
    /// your monitoring reaches.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
}

impl ServeOpts {
    /// Each connection's pool.
    #[cfg_attr(not(all(feature = "verbs", not(loom))), allow(dead_code))]
    pub fn pool(&self) -> cases::Pool {
        cases::Pool {
            buffers: self.buffers,
            buffer_size: self.buffer_size,
            max_payload: self.max_payload,
            large: self.large_buffers,
        }
    }
}

/// Kinds of simulated NIC for `probe --sim`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SimKind {
    /// Follows the InfiniBand spec.
    Spec,
    /// rxe's quirks: window bounds not enforced.
    Rxe,
    /// No memory windows at all.
    NoMw,
    /// Advertises type 2B but cannot allocate (bnxt_re).
    Bnxt,
    /// Allocates windows but cannot bind (mana).
    Mana,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(level) = cli.log {
        tracing_subscriber::fmt().with_max_level(level).with_writer(std::io::stderr).init();
    }
    match cli.cmd {
        #[cfg(not(loom))]
        Cmd::Stat(o) => stat_cmd::run(&o),
        Cmd::Probe { device, port, gid_index, sim } => {
            probe_cmd::run(device.as_deref(), port, gid_index, sim)
        }
        Cmd::Demo { seed } => demo::run(seed),
        Cmd::Bench(mut o) => {
            o.policies = o.policy.iter().map(|&p| p.into()).collect();
            o.kinds = o.cases.iter().map(|&c| c.into()).collect();
            if let Err(e) = check(&o) {
                eprintln!("mwcap bench: {e}");
                return ExitCode::from(2);
            }
            // Only a client of `mwcap serve` runs a bootstrap.
            let auth = match o.addr.map(|_| o.auth.resolve()).transpose() {
                Ok(auth) => auth,
                Err(e) => {
                    eprintln!("mwcap bench: {e}");
                    return ExitCode::from(2);
                }
            };
            if o.sim {
                simbench::run(&o)
            } else {
                bench::run(&o, auth.as_ref())
            }
        }
        Cmd::Serve(o) => match o.auth.resolve() {
            Ok(_) if o.auth.identity.is_some() => {
                eprintln!(
                    "mwcap serve: --identity is for a client (mwcap bench); a server accepts every key \
                     of its --keyring: drop --identity"
                );
                ExitCode::from(2)
            }
            Ok(auth) => {
                if matches!(auth, mwcap::bootstrap::Auth::Unauthenticated) {
                    eprintln!("mwcap serve: --no-auth: anyone who reaches {} gets a connection", o.listen);
                }
                serve::run(&o, &auth)
            }
            Err(e) => {
                eprintln!("mwcap serve: {e}");
                ExitCode::from(2)
            }
        },
    }
}

/// Refuse options that cannot make a run.
fn check(o: &BenchOpts) -> Result<(), String> {
    if o.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    if o.sizes.is_empty() || o.sizes.contains(&0) {
        return Err("--sizes needs sizes of at least 1 byte".into());
    }
    if o.inflight.is_empty() || o.inflight.contains(&0) {
        return Err("--inflight needs counts of at least 1".into());
    }
    if let Some(&n) = o.inflight.iter().find(|&&n| n > o.buffers / 2) {
        return Err(format!("--inflight {n} needs --buffers of at least {} (two per call in flight)", 2 * n));
    }
    if o.policies.is_empty() {
        return Err("--policy needs mw, confirm or both".into());
    }
    if o.executor.is_empty() {
        return Err("--executor needs block_on, smol, tokio or several".into());
    }
    if o.server.is_empty() {
        return Err("--server needs apart, joined or both".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounds' flags reach the connection's `Config`; left out, the
    /// library's defaults stay.
    #[test]
    fn bound_flags_set_the_config() {
        let conn = |args: &[&str]| match Cli::try_parse_from(args).expect("valid flags").cmd {
            Cmd::Serve(o) => o.conn,
            _ => unreachable!("a serve command"),
        };
        let mut c = mwcap::conn::Config::default();
        let default = (c.max_waiting_payloads, c.max_waiting_inline, c.max_requests);
        conn(&["mwcap", "serve"]).apply(&mut c);
        assert_eq!((c.max_waiting_payloads, c.max_waiting_inline, c.max_requests), default);
        let flags = ["--max-waiting-payloads", "3", "--max-waiting-inline", "4096", "--max-requests", "5"];
        conn(&[&["mwcap", "serve"][..], &flags[..]].concat()).apply(&mut c);
        assert_eq!((c.max_waiting_payloads, c.max_waiting_inline, c.max_requests), (3, 4096, 5));
    }
}
