//! The model check of `examples/model.rs`, in smaller configurations so it
//! stays quick in a debug build. The full run is the example, in release:
//! `cargo run --release -p mwcap-fallback --example model`.

#[path = "../examples/model.rs"]
mod model;

use model::{check, models, ConfirmModel};

fn small(name: &str) -> ConfirmModel {
    let mut m = models().into_iter().find(|m| m.name.starts_with(name)).expect("a model of that name");
    m.fetches = m.fetches.min(1);
    m.requests = m.requests.min(1);
    m
}

#[test]
fn direction1_with_replays_holds() {
    assert!(check(small("direction 1 with a replayed")) > 1000);
}

#[test]
fn direction2_with_replays_holds() {
    assert!(check(small("direction 2")) > 1000);
}

#[test]
fn both_directions_with_connection_loss_hold() {
    assert!(check(small("both directions, connection loss")) > 1000);
}

#[test]
fn direction1_with_a_withdrawn_offer_holds() {
    assert!(check(small("direction 1 with a withdrawn")) > 1000);
}
