//! Configuration of the simulated fabric and its devices.

use std::time::Duration;

/// How the virtual clock moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Progress {
    /// `NicOps::poll_cq` drives the fabric: it
    /// runs every event that is due and, if the polled queue is still empty,
    /// advances the clock to the next pending event and runs what is due
    /// then. Code written only against the `Nic` trait terminates its
    /// waiting loops quickly and deterministically.
    #[default]
    Auto,
    /// Nothing happens unless the test calls [`Fabric::step`](super::Fabric::step),
    /// [`Fabric::run_until`](super::Fabric::run_until) or
    /// [`Fabric::run_until_idle`](super::Fabric::run_until_idle); `poll_cq`
    /// only takes what is already in the queue.
    Manual,
}

/// Latency of each kind of operation, in virtual time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Latency {
    /// From `post_send` to the send queue executing the work request.
    pub post: Duration,
    /// One way on the wire, per packet.
    pub wire: Duration,
    /// From a READ request's arrival to the responder reading memory.
    pub read_responder: Duration,
    /// From a work request finishing to its completion being pollable.
    pub completion: Duration,
    /// Extra wire time per KiB of payload (SEND data, READ response).
    pub per_kib: Duration,
}

impl Default for Latency {
    fn default() -> Latency {
        Latency {
            post: Duration::from_nanos(200),
            wire: Duration::from_nanos(1_000),
            read_responder: Duration::from_nanos(300),
            completion: Duration::from_nanos(100),
            per_kib: Duration::from_nanos(80),
        }
    }
}

/// Transport and fault settings that can also be changed at run time with
/// [`Fabric::set_faults`](super::Fabric::set_faults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Faults {
    /// Added to every packet's wire time.
    pub extra_delay: Duration,
    /// A uniformly random extra wire time in `0..=jitter` per packet (drawn
    /// from the seeded generator; RC order is kept).
    pub jitter: Duration,
    /// Transport retries after an ACK timeout before `RETRY_EXC_ERR`.
    pub retry_cnt: u8,
    /// How long the requester waits for an ACK or response before retrying.
    pub ack_timeout: Duration,
    /// Receiver-not-ready retries before `RNR_RETRY_EXC_ERR`, at most: a
    /// queue pair retries `min(its QpConfig::rnr_retry, this)` times, except
    /// that a queue pair created with `rnr_retry` 7 retries forever, as the
    /// verbs attribute says.
    pub rnr_retry: u8,
    /// How long the requester waits after an RNR NAK before resending.
    pub rnr_timer: Duration,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults {
            extra_delay: Duration::ZERO,
            jitter: Duration::ZERO,
            retry_cnt: 7,
            ack_timeout: Duration::from_millis(1),
            rnr_retry: 7,
            rnr_timer: Duration::from_micros(10),
        }
    }
}

/// How a fabric is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    /// Seed of the scheduler's generator (tie-breaks, jitter, consumer keys).
    /// The same seed and the same calls give the same trace.
    pub seed: u64,
    /// Latency per kind of operation.
    pub latency: Latency,
    /// Transport and fault settings.
    pub faults: Faults,
    /// Who moves the clock.
    pub progress: Progress,
    /// Keep a textual trace of every event ([`Fabric::trace`](super::Fabric::trace)).
    pub record_trace: bool,
}

impl Default for FabricConfig {
    fn default() -> FabricConfig {
        FabricConfig {
            seed: 0,
            latency: Latency::default(),
            faults: Faults::default(),
            progress: Progress::Auto,
            record_trace: false,
        }
    }
}

impl FabricConfig {
    /// The default configuration with `seed`.
    pub fn with_seed(seed: u64) -> FabricConfig {
        FabricConfig { seed, ..FabricConfig::default() }
    }
}

/// How far a device supports type-2 memory windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MwSupport {
    /// Windows work as the spec says.
    #[default]
    Full,
    /// The device advertises no windows; `alloc_mw` is unsupported.
    None,
    /// Like bnxt_re: the device advertises type-2B windows, but `alloc_mw`
    /// fails with `EOPNOTSUPP`.
    AdvertisedNoAlloc,
    /// Like mana: windows can be allocated, but posting a bind (or a local
    /// invalidation) is unsupported.
    AllocNoBind,
}

/// How a simulated device behaves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// The device name reported by `device_info` (`sim0`, ...). Empty: `sim<n>`.
    pub name: String,
    /// Window support.
    pub mw: MwSupport,
    /// Behave like SoftRoCE (rxe) where it deviates from the spec: window
    /// bounds are not enforced (only the region's), and a READ in flight
    /// when its window is invalidated never completes while the owner's QP
    /// goes to ERR. (rxe's wrong `IBV_WC_WITH_INV` flag cannot be seen through
    /// `Completion`, which always carries
    /// `invalidated_rkey`.)
    pub rxe_quirks: bool,
    /// Windows the device says it can hold (`alloc_mw` fails beyond).
    pub max_mw: u32,
    /// Scatter entries per work request.
    pub max_sge: u32,
    /// Path MTU in bytes.
    pub mtu: u32,
    /// The deepest completion queue the device makes (`max_cqe`); a
    /// deeper one fails with [`NicError::CqTooDeep`](crate::backend::NicError::CqTooDeep),
    /// as on verbs. Default: mlx5's 4,194,303, also for [`DeviceConfig::rxe`]
    /// (a real rxe holds 32,767: [`DeviceConfig::with_max_cqe`]).
    pub max_cqe: u32,
    /// Hand the number of a destroyed queue pair to the next one created
    /// (the latest freed first), as real devices reuse QP numbers; off by
    /// default, so that numbers are unique in a trace. A completion queue
    /// shared by many connections must tell a new QP's completions from
    /// an old one's of the same number: the tests turn this on to check it.
    pub reuse_qpns: bool,
}

impl Default for DeviceConfig {
    fn default() -> DeviceConfig {
        DeviceConfig {
            name: String::new(),
            mw: MwSupport::Full,
            rxe_quirks: false,
            max_mw: 1 << 16,
            max_sge: 16,
            mtu: 4096,
            max_cqe: (1 << 22) - 1,
            reuse_qpns: false,
        }
    }
}

impl DeviceConfig {
    /// A spec-following device with full window support.
    pub fn spec() -> DeviceConfig {
        DeviceConfig::default()
    }
    /// A device with SoftRoCE's deviations ([`DeviceConfig::rxe_quirks`]).
    pub fn rxe() -> DeviceConfig {
        DeviceConfig { rxe_quirks: true, ..DeviceConfig::default() }
    }
    /// This configuration with another window support level.
    pub fn with_mw(self, mw: MwSupport) -> DeviceConfig {
        DeviceConfig { mw, ..self }
    }
    /// This configuration with another `max_cqe`.
    pub fn with_max_cqe(self, max_cqe: u32) -> DeviceConfig {
        DeviceConfig { max_cqe, ..self }
    }
    /// This configuration with a name.
    pub fn named(self, name: &str) -> DeviceConfig {
        DeviceConfig { name: name.to_string(), ..self }
    }
}
