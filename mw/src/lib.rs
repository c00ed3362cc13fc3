//! mwcap memory-window lease engine (being written).
#![forbid(unsafe_code)]
