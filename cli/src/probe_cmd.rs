//! `mwcap probe`.

use std::process::ExitCode;

use mwcap::sim::{DeviceConfig, Fabric, MwSupport};

use crate::SimKind;

pub fn run(device: Option<&str>, port: u8, gid_index: u8, sim: Option<SimKind>) -> ExitCode {
    if let Some(kind) = sim {
        let cfg = match kind {
            SimKind::Spec => DeviceConfig::spec(),
            SimKind::Rxe => DeviceConfig::rxe(),
            SimKind::NoMw => DeviceConfig::spec().with_mw(MwSupport::None),
            SimKind::Bnxt => DeviceConfig::spec().with_mw(MwSupport::AdvertisedNoAlloc),
            SimKind::Mana => DeviceConfig::spec().with_mw(MwSupport::AllocNoBind),
        };
        let nic = Fabric::with_seed(1).add_device(cfg.named(&format!("sim-{kind:?}").to_lowercase()));
        println!("{}", mwcap::probe(&nic));
        return ExitCode::SUCCESS;
    }
    real(device, port, gid_index)
}

#[cfg(not(feature = "verbs"))]
fn real(_device: Option<&str>, _port: u8, _gid_index: u8) -> ExitCode {
    eprintln!(
        "mwcap probe: this build has no verbs backend (built without the `verbs` feature).\n\
         Rebuild with `cargo run -p mwcap-cli --features verbs -- probe`, or probe a simulated NIC: \
         `mwcap probe --sim rxe`."
    );
    ExitCode::from(2)
}

#[cfg(feature = "verbs")]
fn real(device: Option<&str>, port: u8, gid_index: u8) -> ExitCode {
    use mwcap::verbs::{list_devices, VerbsNic};

    let devices = match list_devices() {
        Ok(d) if d.is_empty() => {
            eprintln!("mwcap probe: no RDMA device found; load a driver (for SoftRoCE: `rdma link add rxe0 type rxe netdev <if>`)");
            return ExitCode::from(2);
        }
        Ok(d) => d,
        Err(e) => {
            eprintln!("mwcap probe: {e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "{:<12} {:<8} {:>6} {:>6} {:>6} {:>8} {:>6}",
        "device", "driver", "mw", "2a", "2b", "max_mw", "mtu"
    );
    for d in &devices {
        match &d.info {
            Ok(i) => println!(
                "{:<12} {:<8} {:>6} {:>6} {:>6} {:>8} {:>6}",
                d.name, i.driver, i.mem_window, i.mw_type_2a, i.mw_type_2b, i.max_mw, i.mtu
            ),
            Err(e) => println!("{:<12} (cannot open: {e})", d.name),
        }
    }
    println!("(advertised flags; the probe below tries the operations)\n");
    let mut ok = true;
    let mut probed = 0;
    for d in devices.iter().filter(|d| device.map_or(true, |n| n == d.name)) {
        probed += 1;
        match VerbsNic::open(Some(&d.name), port, gid_index) {
            Ok(nic) => println!("{}\n", mwcap::probe(&nic)),
            Err(e) => {
                ok = false;
                eprintln!("mwcap probe: {}: {e}", d.name);
            }
        }
    }
    if probed == 0 {
        eprintln!("mwcap probe: no device named {:?}", device.unwrap_or_default());
        return ExitCode::from(2);
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
