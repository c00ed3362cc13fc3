//! `mwcap`: probe devices for what mwcap needs, and a demo on the simulated NIC.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod bench;
mod simbench;

#[global_allocator]
static ALLOC: simbench::Counting = simbench::Counting;
mod demo;
mod probe_cmd;

/// Safe zero-copy RDMA: probe devices and run the demo.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
    /// Measure call latency over real verbs (client and server on one
    /// device, loopback); compare with perftest in the same run.
    Bench {
        /// The device.
        #[arg(long, default_value = "rxe0")]
        device: String,
        /// GID index.
        #[arg(long, default_value_t = 1)]
        gid_index: u8,
        /// Calls per case.
        #[arg(long, default_value_t = 1000)]
        iters: u32,
        /// Payload bytes.
        #[arg(long, default_value_t = 4096)]
        size: u32,
        /// Run on the simulated NIC instead (no RDMA needed): the async API
        /// next to the sans-IO loop, with heap allocations per call.
        #[arg(long)]
        sim: bool,
    },
    /// Show the protocols at work on the simulated NIC: leases, expiry
    /// without teardown, a stale read caught, a dead peer, the probe.
    Demo {
        /// Seed of the simulated fabric.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
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
    match cli.cmd {
        Cmd::Probe { device, port, gid_index, sim } => probe_cmd::run(device.as_deref(), port, gid_index, sim),
        Cmd::Demo { seed } => demo::run(seed),
        Cmd::Bench { sim: true, iters, size, .. } => simbench::run(iters, size),
        Cmd::Bench { device, gid_index, iters, size, .. } => bench::run(&device, gid_index, iters, size),
    }
}
