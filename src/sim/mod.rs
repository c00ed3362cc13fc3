//! The simulated NIC (being written; see issue 3).
