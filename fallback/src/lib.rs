//! mwcap confirm-protocol engine (being written).
#![forbid(unsafe_code)]
