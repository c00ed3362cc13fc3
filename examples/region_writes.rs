//! What a region write costs while many ranges of the region are exposed:
//! a store that has delegated N blocks (each pinned until its token is
//! redeemed or expires) writes the blocks between them, N = 10 to 100,000,
//! and 1 MiB past them. Each write is checked against every range exposed
//! (a write of an exposed byte is refused), through the region book's
//! index of ranges by length class and granule (`src/conn/regions.rs`,
//! `Exposed`), or by a pass over the ranges when they are fewer than the
//! granules a long write would look up, so the cost should not grow with N.
//!
//! Run with `cargo run --release --example region_writes [N...]`. One
//! line per N; figures are in docs/benchmarks.md.

use std::time::{Duration, Instant};

use mwcap::bootstrap::Auth;
use mwcap::conn::{Endpoint, RegionRange};
use mwcap::sim::{DeviceConfig, Fabric, FabricConfig};

const BLOCK: usize = 4096;
const WRITES: usize = 20_000;
const LONG: usize = 1 << 20;

fn main() {
    let counts: Vec<usize> =
        std::env::args().skip(1).map(|a| a.parse().expect("N: a number of blocks")).collect();
    let counts = if counts.is_empty() { vec![10, 1_000, 10_000, 100_000] } else { counts };
    for n in counts {
        let fabric = Fabric::new(FabricConfig::default());
        let (ep, _driver) = Endpoint::builder(fabric.add_device(DeviceConfig::spec()), Auth::Unauthenticated)
            .build()
            .unwrap();
        // Blocks 0, 2, 4, ... delegated; 1, 3, 5, ... written.
        let region = ep.register_region((2 * n + 1) * BLOCK + LONG).unwrap();
        for i in 0..n {
            let range = RegionRange { region, offset: 2 * i * BLOCK, len: BLOCK as u32 };
            ep.delegate_region(range, "reader", Duration::from_secs(600)).unwrap();
        }
        let block = [7u8; BLOCK];
        assert!(ep.region_write(region, 0, &block).is_err(), "a delegated block is not written");
        let t = Instant::now();
        for w in 0..WRITES {
            ep.region_write(region, (2 * (w % n) + 1) * BLOCK, &block).unwrap();
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / WRITES as f64;
        let long = vec![7u8; LONG];
        let t = Instant::now();
        for _ in 0..WRITES / 100 {
            ep.region_write(region, (2 * n + 1) * BLOCK, &long).unwrap();
        }
        let long_us = t.elapsed().as_secs_f64() * 1e6 / (WRITES / 100) as f64;
        println!("region_writes delegated={n} block={BLOCK} write_us={us:.2} write_1mib_us={long_us:.1}");
    }
}
