//! Remote-key arithmetic for type-2 memory windows: index bits, the 8-bit
//! consumer key, its wrapping increment and the next bind's key.
//!
//! The implementation (and its known-answer tests) is `mwcap_mw::rkey`, which
//! the MW lease engine uses; it is re-exported here so that the backends, the
//! simulator and the conformance checks compute rkeys with the same code.

pub use mwcap_mw::rkey::{inc, index, key, rebind, with_key};
