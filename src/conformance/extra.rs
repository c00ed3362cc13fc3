//! Further scenarios (added by the simulated-NIC work).

use super::Scenario;

pub(super) fn scenarios() -> Vec<Scenario> {
    Vec::new()
}
