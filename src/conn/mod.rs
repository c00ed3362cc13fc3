//! Connections: the driver that runs the protocol engines over a [`Nic`](crate::backend::Nic).
pub mod frame;
