//! `mwcap demo`: the protocols at work on the simulated NIC, narrated, with
//! the oracle's view of what the peer can reach. Every claim it prints is
//! checked; a wrong outcome ends the demo with a non-zero status.

use std::process::ExitCode;
use std::time::Duration;

use mwcap::conn::{Buf, CallError, Config, Event, Policies, Policy, SimPair};
use mwcap::sim::{DeviceConfig, MwSupport};

type R = Result<(), String>;

fn ensure(cond: bool, what: &str) -> R {
    if cond {
        println!("    ✓ {what}");
        Ok(())
    } else {
        Err(format!("expected: {what}"))
    }
}

fn pair(seed: u64, p: Policies, tweak: impl Fn(&mut Config)) -> Result<SimPair, String> {
    let mut c = Config::default();
    let mut s = Config::default();
    for cfg in [&mut c, &mut s] {
        cfg.buffers = 4;
        cfg.buffer_size = 4096;
        // Every payload is exposed, small as they are here: the demo shows
        // the windows and confirms at work (by default payloads up to 256
        // bytes ride inline in the frame, with none).
        cfg.inline_max = 0;
        tweak(cfg);
    }
    SimPair::spec(seed, p, c, s).map_err(|e| e.to_string())
}

fn filled(p: &mut SimPair, client: bool, bytes: &[u8]) -> Result<Buf, String> {
    let ep = if client { &mut p.client } else { &mut p.server };
    let mut b = ep.alloc().ok_or("pool empty")?;
    b.copy_from(bytes).map_err(|e| e.to_string())?;
    Ok(b)
}

/// Bytes of the owner's data region the peer's QP can reach right now.
fn reachable(p: &SimPair, client_owner: bool) -> u64 {
    let (dev, peer) =
        if client_owner { (p.client_device(), p.server_qp()) } else { (p.server_device(), p.client_qp()) };
    p.fabric.exposure(dev, peer).iter().map(|e| (e.bytes.end - e.bytes.start) as u64).sum()
}

fn t(p: &SimPair) -> String {
    format!("t={:>9.3} ms", p.now().as_secs_f64() * 1e3)
}

fn take_request(p: &mut SimPair) -> Result<(mwcap::conn::RequestId, Option<Buf>), String> {
    if !p.drive_until(Duration::from_secs(2), |p| {
        p.server_events.iter().any(|e| matches!(e, Event::Request { .. }))
    }) {
        return Err("the server never got the request".into());
    }
    let i = p.server_events.iter().position(|e| matches!(e, Event::Request { .. })).expect("checked");
    match p.server_events.remove(i) {
        Event::Request { req, data, .. } => Ok((req, data)),
        _ => unreachable!(),
    }
}

fn mw_round_trip(seed: u64) -> R {
    println!(
        "\n1. mw policy both ways: a request payload READ by the server, a reply payload READ by the client"
    );
    let mut p = pair(seed, Policies::both(Policy::Mw), |_| {})?;
    let b = filled(&mut p, true, b"put key=42 value=hello")?;
    let now = p.now();
    let call = p.client.call(now, b"PUT", Some(b)).map_err(|e| e.to_string())?;
    println!(
        "  {} client binds a window over its 22-byte request, chained with the SEND (one doorbell)",
        t(&p)
    );
    let (req, data) = take_request(&mut p)?;
    let data = data.ok_or("no payload")?;
    let got = data.to_vec();
    println!("  {} server READ the request through the window: {:?}", t(&p), String::from_utf8_lossy(&got));
    p.server.free(data);
    ensure(
        reachable(&p, true) == 22,
        "the server's QP can reach exactly the 22 bytes granted, nothing else of the client's region",
    )?;
    let out = filled(&mut p, false, &[7u8; 1000])?;
    let now = p.now();
    p.server.reply(now, req, 0, b"OK", Some(out)).map_err(|e| e.to_string())?;
    println!(
        "  {} server replies: its 1000-byte reply under a window, the request's release piggybacked",
        t(&p)
    );
    p.drive_until(Duration::from_secs(1), |p| {
        p.client_events.iter().any(|e| matches!(e, Event::Reply { .. }))
    });
    let reply = p.client_events.iter().find_map(|e| match e {
        Event::Reply { call: c, data: Some(d), .. } if *c == call => Some(d.len()),
        _ => None,
    });
    ensure(reply == Some(1000), "the client READ the 1000-byte reply")?;
    let back = p.drive_until(Duration::from_secs(1), |p| {
        p.client.busy_buffers() == 0 && p.server.busy_buffers() == 0
    });
    ensure(back, "every buffer of both sides came back")?;
    println!(
        "  {} both owners posted LOCAL_INV after the releases; buffers returned on its completion",
        t(&p)
    );
    ensure(
        reachable(&p, true) == 0 && reachable(&p, false) == 0,
        "nothing of either region is reachable any more",
    )?;
    ensure(p.fabric.would_crash_rxe().is_empty(), "no window was invalidated twice or while unbound")
}

fn timeout_without_teardown(seed: u64) -> R {
    println!(
        "\n2. a call times out: the request buffer is NOT reused on the timeout; the connection stays up"
    );
    let mut p = pair(seed, Policies::both(Policy::Mw), |c| {
        c.call_timeout = Duration::from_millis(100);
        c.lease_time = Duration::from_millis(300);
        c.safety_margin = Duration::from_millis(50);
    })?;
    let b = filled(&mut p, true, &[1u8; 512])?;
    let now = p.now();
    let call = p.client.call(now, b"SLOW", Some(b)).map_err(|e| e.to_string())?;
    let (_req, data) = take_request(&mut p)?;
    if let Some(d) = data {
        p.server.free(d);
    }
    println!("  {} the server got the request and sits on it", t(&p));
    p.run_for(Duration::from_millis(150));
    let failed = p.client_events.contains(&Event::CallFailed { call, error: CallError::TimedOut });
    ensure(failed, "the call failed with TimedOut after 100 ms")?;
    ensure(
        p.client.busy_buffers() == 1,
        "its request buffer is still with the NIC: the window is still bound",
    )?;
    println!("  {} the server could still READ it; only the lease expiry (300 ms) may end that", t(&p));
    let back = p.drive_until(Duration::from_secs(1), |p| p.client.busy_buffers() == 0);
    ensure(back, "the request buffer came back once its lease expired")?;
    println!("  {} lease expired -> LOCAL_INV -> its completion -> the buffer is back", t(&p));
    ensure(reachable(&p, true) == 0, "the server can reach nothing of the client's region")?;
    ensure(p.client.is_down().is_none(), "the connection is still up: a timeout never tears it down")?;
    let now = p.now();
    let again = p.client.call(now, b"PING", None).map_err(|e| e.to_string())?;
    let (req, _) = take_request(&mut p)?;
    let now = p.now();
    p.server.reply(now, req, 0, b"PONG", None).map_err(|e| e.to_string())?;
    p.drive_until(Duration::from_secs(1), |p| {
        p.client_events.iter().any(|e| matches!(e, Event::Reply { call, .. } if *call == again))
    });
    ensure(
        p.client_events.iter().any(|e| matches!(e, Event::Reply { call, .. } if *call == again)),
        "the next call on the same connection works",
    )
}

fn stale_read_caught(seed: u64) -> R {
    println!("\n3. confirm policy (no windows): a READ of a reused buffer is discarded, never returned");
    let mut p = pair(seed, Policies::both(Policy::Confirm), |c| {
        c.lease_time = Duration::from_millis(20);
        c.call_timeout = Duration::from_secs(5);
    })?;
    let now = p.now();
    let call = p.client.call(now, b"GET", None).map_err(|e| e.to_string())?;
    let (req, _) = take_request(&mut p)?;
    // Slow the link so the server's 20 ms hold runs out before the confirm
    // arrives (with a transport timeout that tolerates the delay).
    let mut faults = p.fabric.faults();
    faults.ack_timeout = Duration::from_millis(500);
    p.fabric.set_faults(faults);
    p.fabric.set_link_delay(p.client_device(), p.server_device(), Duration::from_millis(15));
    let out = filled(&mut p, false, b"generation one")?;
    let now = p.now();
    p.server.reply(now, req, 0, b"", Some(out)).map_err(|e| e.to_string())?;
    println!("  {} server offers its buffer (region rkey + generation), holds it 20 ms; the link now takes 15 ms each way", t(&p));
    let mut reused = false;
    let mut answered_again = false;
    let done = p.drive_until(Duration::from_secs(3), |p| {
        for e in std::mem::take(&mut p.server_events) {
            match e {
                Event::BufferReturned(mut b) if !reused => {
                    // The hold expired: the server reuses the buffer at once.
                    let _ = b.copy_from(b"SOMEONE ELSE'S");
                    p.server.free(b);
                    reused = true;
                    println!("  {} hold expired; the server REUSES the buffer while the client's READ/confirm is under way", t(p));
                }
                Event::BufferReturned(b) => p.server.free(b),
                Event::ReplyAgain { req, .. } => {
                    println!(
                        "  {} the client's READ sampled the reused bytes; its confirm got 'reused': read discarded, asks again",
                        t(p)
                    );
                    p.fabric.set_link_delay(p.client_device(), p.server_device(), Duration::ZERO);
                    if let Some(mut b) = p.server.alloc() {
                        let _ = b.copy_from(b"generation one");
                        let now = p.now();
                        let _ = p.server.reply(now, req, 0, b"", Some(b));
                        answered_again = true;
                    }
                }
                _ => {}
            }
        }
        p.client_events.iter().any(|e| matches!(e, Event::Reply { .. } | Event::CallFailed { .. }))
    });
    ensure(done && reused, "the buffer was reused during the exchange")?;
    let data = p.client_events.iter().find_map(|e| match e {
        Event::Reply { call: c, data: Some(d), .. } if *c == call => Some(d),
        _ => None,
    });
    let bytes = data.map(|d| d.to_vec()).unwrap_or_default();
    println!("  {} the call returned {:?}", t(&p), String::from_utf8_lossy(&bytes));
    ensure(answered_again, "the server was asked again")?;
    ensure(bytes == b"generation one", "only intact data was returned: never the reused buffer's bytes")
}

fn dead_peer(seed: u64) -> R {
    println!(
        "\n4. the server dies mid-call: calls fail, and every client buffer returns once the QP is flushed and destroyed"
    );
    let mut p = pair(seed, Policies::both(Policy::Mw), |_| {})?;
    let mut calls = Vec::new();
    for i in 0..3u8 {
        let b = filled(&mut p, true, &[i; 100])?;
        let now = p.now();
        calls.push(p.client.call(now, b"W", Some(b)).map_err(|e| e.to_string())?);
    }
    p.settle();
    p.fabric.kill_device(p.server_device());
    println!("  {} server process killed with 3 calls outstanding, 3 windows bound", t(&p));
    let now = p.now();
    let _ = p.client.call(now, b"PING", None);
    // The SENDs to the dead peer are retried (7 times, `ack_timeout`
    // apart) before the QP goes to error and every call fails.
    let all_failed = |p: &mut SimPair| {
        p.client_events.iter().filter(|e| matches!(e, Event::CallFailed { .. })).count() == 4
    };
    p.drive_until(Duration::from_secs(12), all_failed);
    let failed = p.client_events.iter().filter(|e| matches!(e, Event::CallFailed { .. })).count();
    println!(
        "  {} {failed} calls failed, the 3 and a ping sent after the kill ({})",
        t(&p),
        p.client.is_down().map(|r| r.to_string()).unwrap_or_default()
    );
    ensure(failed == 4, "every call failed")?;
    let now = p.now();
    p.client.close(now);
    p.settle();
    let back = p.client_events.iter().filter(|e| matches!(e, Event::BufferReturned(_))).count();
    ensure(back == 3, "all 3 request buffers returned (the QP's destroy, after the flush, is the evidence)")?;
    ensure(p.fabric.would_crash_rxe().is_empty(), "no invalidation of a dead window was attempted")
}

fn probes() -> R {
    println!("\n5. the capability probe on simulated NICs (device flags are not trusted)");
    // (device, windows usable, mw safe with peers that are not trusted: a
    // peer's SEND_WITH_INV cannot reach other queue pairs' windows)
    let kinds = [
        ("spec", DeviceConfig::spec(), true, true),
        ("rxe", DeviceConfig::rxe(), true, false),
        ("bnxt-like", DeviceConfig::spec().with_mw(MwSupport::AdvertisedNoAlloc), false, false),
        ("mana-like", DeviceConfig::spec().with_mw(MwSupport::AllocNoBind), false, false),
        ("no-mw", DeviceConfig::spec().with_mw(MwSupport::None), false, false),
    ];
    for (name, cfg, want, safe) in kinds {
        let nic = mwcap::sim::Fabric::with_seed(1).add_device(cfg.named(name));
        let r = mwcap::probe(&nic);
        let why = r.first_failure().map(|(s, t)| format!(" (fails at '{s}': {t})")).unwrap_or_default();
        println!(
            "  {name:<10} advertises 2B={:<5} -> windows usable={:<5} bounds enforced={:<11} \
             safe with untrusted peers={:<5}{why}",
            r.device.mw_type_2b,
            r.mw_usable,
            format!("{:?}", r.bounds_enforced),
            r.mw_safe_with_untrusted_peers()
        );
        ensure(r.mw_usable == want, &format!("{name}: policy {}", if want { "mw" } else { "confirm" }))?;
        ensure(
            r.mw_safe_with_untrusted_peers() == safe,
            &format!("{name}: mw {}for untrusted peers", if safe { "" } else { "not " }),
        )?;
    }
    Ok(())
}

pub fn run(seed: u64) -> ExitCode {
    println!("mwcap demo on the simulated NIC (seed {seed}); times are virtual");
    let steps: [fn(u64) -> R; 4] = [mw_round_trip, timeout_without_teardown, stale_read_caught, dead_peer];
    let result = steps.iter().try_for_each(|s| s(seed)).and_then(|()| probes());
    match result {
        Ok(()) => {
            println!("\ndemo finished: every check held");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("\ndemo FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
