//! Sequences of untrusted frames from a peer into a live endpoint (client or
//! server, any policy pair) on the simulated NIC, with time passing between
//! them, each counted against the credit granted as a received frame is
//! (past it the endpoint goes down): nothing may panic, and the endpoint
//! must never do what would crash rxe (invalidate an unbound window or one
//! twice) nor DMA into freed memory.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use mwcap::conn::{Config, Policies, Policy, SimPair};
use mwcap::sim::{DeviceConfig, FabricConfig};

#[derive(Arbitrary, Debug)]
struct Step {
    to_client: bool,
    bytes: Vec<u8>,
    invalidated: Option<u32>,
    advance_us: u16,
    /// Also make a legitimate call first (so grants and leases exist).
    call_first: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    request_mw: bool,
    reply_mw: bool,
    steps: Vec<Step>,
}

fuzz_target!(|input: Input| {
    let pol = |mw| if mw { Policy::Mw } else { Policy::Confirm };
    let p = Policies { request: pol(input.request_mw), reply: pol(input.reply_mw) };
    let cfg = || {
        let mut c = Config::default();
        c.buffers = 2;
        c.buffer_size = 4096;
        c.ctrl_slots = 8;
        c
    };
    let Ok(mut pair) =
        SimPair::new(FabricConfig::with_seed(1), DeviceConfig::spec(), DeviceConfig::spec(), p, cfg(), cfg())
    else {
        return;
    };
    for step in input.steps.iter().take(16) {
        if step.call_first {
            let now = pair.now();
            let data = pair.client.alloc().map(|mut b| {
                let _ = b.copy_from(b"payload");
                b
            });
            let _ = pair.client.call(now, b"h", data);
        }
        let now = pair.now();
        let ep = if step.to_client { &mut pair.client } else { &mut pair.server };
        ep.fuzz_deliver(now, &step.bytes, step.invalidated);
        pair.run_for(Duration::from_micros(step.advance_us.into()));
        assert!(pair.fabric.would_crash_rxe().is_empty(), "{:?}", pair.fabric.would_crash_rxe());
        assert!(pair.fabric.hazards().is_empty(), "{:?}", pair.fabric.hazards());
    }
});
