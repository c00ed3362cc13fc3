//! Capability probe (being written).
