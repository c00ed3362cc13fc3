//! Errors of opening a device.

use crate::backend::NicError;

/// Why a verbs device could not be opened or queried.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenError {
    /// libibverbs itself is missing.
    #[error("libibverbs.so.1 could not be loaded ({detail}); install rdma-core / libibverbs1")]
    LibraryMissing {
        /// The dynamic loader's message.
        detail: String,
    },
    /// libibverbs found no device.
    #[error("no RDMA device found; load a driver (for SoftRoCE: `rdma link add rxe0 type rxe netdev <if>`)")]
    NoDevices,
    /// The named device does not exist.
    #[error("no RDMA device named {name:?}; devices here: {available}")]
    NoSuchDevice {
        /// The requested name.
        name: String,
        /// The names that exist, comma-separated.
        available: String,
    },
    /// The port is not active.
    #[error("port {port} of {device} is not active (state {state}); check the link with `rdma link`")]
    PortNotActive {
        /// The device.
        device: String,
        /// The port number.
        port: u8,
        /// The raw `ibv_port_state`.
        state: u32,
    },
    /// The GID index does not hold a usable GID.
    #[error(
        "gid index {index} of {device} port {port} is not usable ({detail}); list GIDs with `ibv_devinfo -v`"
    )]
    BadGid {
        /// The device.
        device: String,
        /// The port number.
        port: u8,
        /// The GID index.
        index: u8,
        /// What was wrong.
        detail: String,
    },
    /// A libibverbs call failed.
    #[error(transparent)]
    Nic(#[from] NicError),
}
