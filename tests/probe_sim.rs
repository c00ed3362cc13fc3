//! The capability probe on simulated NICs of every kind: it must not trust
//! the advertised flags, must name the failing step, and must never do what
//! crashes rxe.

use mwcap::sim::{DeviceConfig, Fabric, MwSupport};
use mwcap::{probe, ProbeStep, StepOutcome};

fn run(cfg: DeviceConfig) -> (mwcap::ProbeReport, Fabric) {
    let fabric = Fabric::with_seed(5);
    let nic = fabric.add_device(cfg.named("dev0"));
    let report = probe(&nic);
    assert!(
        fabric.would_crash_rxe().is_empty(),
        "the probe invalidated badly: {:?}",
        fabric.would_crash_rxe()
    );
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
    (report, fabric)
}

#[test]
fn a_spec_nic_has_usable_enforced_windows() {
    let (r, _) = run(DeviceConfig::spec());
    assert!(r.mw_usable, "{r}");
    assert_eq!((r.bounds_enforced, r.send_with_inv), (Some(true), Some(true)), "{r}");
    assert!(r.steps.iter().all(|(_, o)| matches!(o, StepOutcome::Ok(_))), "{r}");
    assert_eq!(r.steps.len(), 9);
    // The spec's rule: a SEND_WITH_INV invalidates only a window bound to
    // the queue pair it arrives on. Safe for mw with any peer.
    assert_eq!((r.other_qp_invalidates, r.other_pd_invalidates), (Some(false), Some(false)), "{r}");
    assert!(r.mw_safe_with_untrusted_peers(), "{r}");
    assert!(r.to_string().contains("policy: mw (confirm also available)"), "{r}");
}

#[test]
fn rxe_windows_are_usable_but_not_bounded() {
    let (r, _) = run(DeviceConfig::rxe());
    assert!(r.mw_usable, "{r}");
    assert_eq!(r.bounds_enforced, Some(false), "{r}");
    assert!(matches!(r.steps[3], (ProbeStep::ReadOutside, StepOutcome::Failed(_))), "{r}");
    assert!(r.first_failure().is_none(), "an unbounded window does not make windows unusable: {r}");
    // rxe's rule: any queue pair of the device invalidates any window.
    assert_eq!((r.other_qp_invalidates, r.other_pd_invalidates), (Some(true), Some(true)), "{r}");
    assert!(!r.mw_safe_with_untrusted_peers(), "{r}");
    for step in [ProbeStep::SendWithInvOtherQp, ProbeStep::SendWithInvOtherPd] {
        assert!(r.steps.iter().any(|(s, o)| *s == step && matches!(o, StepOutcome::Failed(_))), "{r}");
    }
    assert!(r.to_string().contains("policy: confirm with untrusted peers"), "{r}");
}

#[test]
fn device_flags_are_not_trusted() {
    for (mw, failing) in [
        (MwSupport::AdvertisedNoAlloc, ProbeStep::Alloc),
        (MwSupport::AllocNoBind, ProbeStep::Bind),
        (MwSupport::None, ProbeStep::Alloc),
    ] {
        let (r, _) = run(DeviceConfig::spec().with_mw(mw));
        assert!(!r.mw_usable, "{mw:?}: {r}");
        let (step, why) = r.first_failure().expect("a failing step");
        assert_eq!(step, failing, "{mw:?}: {r}");
        assert!(why.contains("not supported"), "{mw:?}: the reason must say what failed: {why}");
        // Later steps are reported as skipped, not silently missing.
        assert!(r.steps.iter().any(|(_, o)| *o == StepOutcome::Skipped), "{r}");
        assert!(r.to_string().contains("policy: confirm"), "{r}");
    }
}
