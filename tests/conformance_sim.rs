//! The conformance table (`mwcap::conformance`) on the simulated NIC: every
//! scenario in spec mode against the Spec records, and in rxe-quirks mode
//! against the Rxe records (deviations included).

use std::time::Duration;

use mwcap::conformance::{check, table, Flavor, Rig};
use mwcap::sim::{DeviceConfig, Fabric};

/// Run every scenario on a fresh fabric; owner and reader are two
/// protection domains of one device, as on rxe0 over loopback.
fn run_table(flavor: Flavor, dev: DeviceConfig) -> usize {
    let mut failures = Vec::new();
    let scenarios = table();
    for (i, s) in scenarios.iter().enumerate() {
        let fabric = Fabric::with_seed(1000 + i as u64);
        let owner = fabric.add_device(dev.clone());
        let reader = owner.new_pd().expect("a second protection domain");
        let f = fabric.clone();
        let idle = move || {
            f.run_until_idle();
        };
        // The simulated NIC settles within one idle call, and a responder is in
        // ERR before its requester's completion is pollable: no settle time is
        // needed, and the timeout only bounds waits for completions that never come.
        let rig = Rig {
            owner: &owner,
            reader: &reader,
            timeout: Duration::from_millis(200),
            settle: Duration::ZERO,
            idle: Some(&idle),
        };
        if let Err(m) = check(s, &rig, flavor) {
            failures.push(m.to_string());
        }
        let crashes = fabric.would_crash_rxe();
        assert!(crashes.is_empty(), "scenario {} would crash rxe: {crashes:?}", s.name);
        let hazards = fabric.hazards();
        assert!(hazards.is_empty(), "scenario {} caused hazards: {hazards:?}", s.name);
    }
    assert!(
        failures.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failures.len(),
        scenarios.len(),
        failures.join("\n")
    );
    scenarios.len()
}

#[test]
fn every_scenario_on_the_spec_sim() {
    let n = run_table(Flavor::Spec, DeviceConfig::spec());
    assert_eq!(n, table().len());
    eprintln!("{n} scenarios ran on the spec-mode sim");
}

#[test]
fn every_scenario_on_the_rxe_quirks_sim() {
    let n = run_table(Flavor::Rxe, DeviceConfig::rxe());
    assert_eq!(n, table().len());
    eprintln!("{n} scenarios ran on the rxe-quirks sim");
}
