//! `mwcap bench`: call latency over real verbs, client and server endpoints
//! on two protection domains of one device (loopback), driven from one
//! thread. Compare with perftest on the same device in the same run
//! (`ib_send_lat`, `ib_read_lat`): on SoftRoCE every figure is 10-100x a
//! real NIC's, and only ratios measured together mean anything.

use std::process::ExitCode;

#[cfg(not(feature = "verbs"))]
pub fn run(_device: &str, _gid_index: u8, _iters: u32, _size: u32) -> ExitCode {
    eprintln!("mwcap bench: this build has no verbs backend; rebuild with `--features verbs`");
    ExitCode::from(2)
}

#[cfg(feature = "verbs")]
pub fn run(device: &str, gid_index: u8, iters: u32, size: u32) -> ExitCode {
    use mwcap::conn::{Policies, Policy};

    let cases: [(&str, Policies, bool); 4] = [
        ("rpc, no payload", Policies::both(Policy::Mw), false),
        ("mw reply payload", Policies::both(Policy::Mw), true),
        ("confirm reply payload", Policies::both(Policy::Confirm), true),
        ("mw request + reply payloads", Policies::both(Policy::Mw), true),
    ];
    println!("mwcap bench on {device}: {iters} calls per case, payload {size} bytes, one thread drives both sides");
    println!("{:<30} {:>10} {:>10} {:>10} {:>10}", "case", "p50 µs", "p99 µs", "mean µs", "calls/s");
    for (i, (name, pol, payload)) in cases.into_iter().enumerate() {
        let both_ways = i == 3;
        match imp::measure(device, gid_index, pol, payload, both_ways, iters, size) {
            Ok(mut lat) => {
                lat.sort_unstable();
                let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] as f64 / 1e3;
                let mean = lat.iter().sum::<u64>() as f64 / lat.len() as f64 / 1e3;
                println!("{name:<30} {:>10.1} {:>10.1} {:>10.1} {:>10.0}", pct(0.5), pct(0.99), mean, 1e6 / mean);
            }
            Err(e) => {
                eprintln!("mwcap bench: {name}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(feature = "verbs")]
mod imp {
    use std::time::{Duration, Instant};

    use mwcap::conn::{Config, Endpoint, Event, Policies, Role};
    use mwcap::verbs::VerbsNic;

    fn pump(c: &mut Endpoint<VerbsNic>, s: &mut Endpoint<VerbsNic>, epoch: Instant, cev: &mut Vec<Event>, sev: &mut Vec<Event>) {
        let now = epoch.elapsed();
        for ep in [&mut *c, &mut *s] {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
            ep.drive(now);
        }
        while let Some(e) = c.poll_event() {
            match e {
                Event::BufferReturned(b) => c.free(b),
                e => cev.push(e),
            }
        }
        while let Some(e) = s.poll_event() {
            match e {
                Event::BufferReturned(b) => s.free(b),
                e => sev.push(e),
            }
        }
    }

    /// Latencies of `iters` calls in nanoseconds (after 50 warm-up calls).
    pub fn measure(
        device: &str,
        gid: u8,
        pol: Policies,
        payload: bool,
        both_ways: bool,
        iters: u32,
        size: u32,
    ) -> Result<Vec<u64>, String> {
        let open = || VerbsNic::open(Some(device), 1, gid).map_err(|e| e.to_string());
        let cfg = |role| {
            let mut c = Config::new(role, pol);
            c.buffers = 8;
            c.buffer_size = size.max(64);
            c
        };
        let mut c = Endpoint::new(open()?, cfg(Role::Client)).map_err(|e| e.to_string())?;
        let mut s = Endpoint::new(open()?, cfg(Role::Server)).map_err(|e| e.to_string())?;
        let (ce, se) = (c.local(), s.local());
        c.connect(&se).map_err(|e| e.to_string())?;
        s.connect(&ce).map_err(|e| e.to_string())?;
        let data = vec![0x5a; size as usize];
        let epoch = Instant::now();
        let (mut cev, mut sev) = (Vec::new(), Vec::new());
        let mut out = Vec::with_capacity(iters as usize);
        for i in 0..iters + 50 {
            let t0 = Instant::now();
            let req_buf = if both_ways {
                // Wait for a free buffer (request buffers return after the reply's release).
                loop {
                    if let Some(mut b) = c.alloc() {
                        c.write(&mut b, &data).map_err(|e| e.to_string())?;
                        break Some(b);
                    }
                    pump(&mut c, &mut s, epoch, &mut cev, &mut sev);
                }
            } else {
                None
            };
            let call = c.call(epoch.elapsed(), b"bench", req_buf).map_err(|e| e.to_string())?;
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut replied = false;
            loop {
                pump(&mut c, &mut s, epoch, &mut cev, &mut sev);
                if !replied {
                    if let Some(pos) = sev.iter().position(|e| matches!(e, Event::Request { .. })) {
                        let Event::Request { req, data: d, .. } = sev.remove(pos) else { unreachable!() };
                        if let Some(d) = d {
                            s.free(d);
                        }
                        let reply = if payload {
                            let mut b = loop {
                                if let Some(b) = s.alloc() {
                                    break b;
                                }
                                pump(&mut c, &mut s, epoch, &mut cev, &mut sev);
                            };
                            s.write(&mut b, &data).map_err(|e| e.to_string())?;
                            Some(b)
                        } else {
                            None
                        };
                        s.reply(epoch.elapsed(), req, 0, b"ok", reply).map_err(|e| e.to_string())?;
                        replied = true;
                    }
                }
                if let Some(pos) = cev.iter().position(|e| matches!(e, Event::Reply { call: id, .. } | Event::CallFailed { call: id, .. } if *id == call)) {
                    match cev.remove(pos) {
                        Event::Reply { data, .. } => {
                            if let Some(d) = data {
                                c.free(d);
                            }
                        }
                        other => return Err(format!("call {i} failed: {other:?}")),
                    }
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!("call {i} got no reply in 10 s"));
                }
            }
            if i >= 50 {
                out.push(t0.elapsed().as_nanos() as u64);
            }
        }
        let now = epoch.elapsed();
        c.close(now);
        s.close(now);
        Ok(out)
    }
}
