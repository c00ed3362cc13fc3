//! `mwcap bench --sim`: the cost of mwcap's own code on the simulated NIC
//! (no RDMA needed), the same case matrix as over real verbs, through the
//! async `Connection`/`Driver` API users run, under each executor of
//! `--executor` (`executors.rs`), and, as a reference, through the sans-IO
//! `Link` loop (`SimPair`, turned by the calling thread: `executor=none`).
//! Heap allocations per call come from the binary's counting allocator, in
//! steady state (after warm-up).

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use mwcap::conn::{CallId, Event, Policies, Refused, RequestId, SimPair, UseError};

use crate::cases::{self, Ask, Case, Check, Labels, Measured, Plan};
use crate::count;
use crate::{BenchOpts, ExecutorArg, ServerArg};

/// Run every case under each executor and in the sans-IO loop; print a
/// line for each.
pub fn run(o: &BenchOpts) -> ExitCode {
    let buffer_size = o.buffer_size();
    println!(
        "# mwcap bench --sim: simulated NIC, {} calls per case after {} warm-up calls, {} buffers of {buffer_size} bytes per side",
        o.iters, o.warmup, o.buffers
    );
    for (policy, group) in cases::matrix(&o.kinds, &o.policies, &o.sizes, &o.inflight, o.check()) {
        if o.srq && policy != mwcap::conn::Policy::Mw && !o.trusted_peers {
            println!(
                "# --srq: the {policy:?} cases are skipped (an endpoint with shared receives serves mw only \
                 unless its peers are trusted: --trusted-peers)"
            );
            continue;
        }
        for &place in &o.server {
            for &executor in &o.executor {
                if let Err(e) = async_group(o, policy, &group, executor, place) {
                    let name =
                        executor.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
                    let place = crate::executors::Place::from(place).name();
                    eprintln!(
                        "mwcap bench --sim: async under {name}, server {place}, {policy:?} connection: {e}"
                    );
                    return ExitCode::FAILURE;
                }
            }
        }
        // The sans-IO loop has no endpoint to delegate from: delegate_read
        // runs through the async API only.
        for case in group.iter().filter(|c| c.kind != cases::Kind::DelegateRead) {
            match sansio_case(o, case) {
                Ok(m) => println!("{}", cases::line(case, SANSIO, &m)),
                Err(e) => {
                    eprintln!(
                        "mwcap bench --sim: sansio, case {} policy {} size {}: {e}",
                        case.name(),
                        case.policy_name(),
                        case.size
                    );
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
}

/// The sans-IO loop's lines: the calling thread turns it, no executor.
const SANSIO: Labels = Labels { mode: "sansio", backend: "sim", executor: "none", server: "joined" };

#[cfg(loom)]
fn async_group(
    _: &BenchOpts,
    _: mwcap::conn::Policy,
    _: &[Case],
    _: ExecutorArg,
    _: ServerArg,
) -> Result<(), String> {
    Err("the loom build has no async runtime".into())
}

/// One connection on two simulated devices, both sides' drivers under
/// `executor`, every case of `group` on it.
#[cfg(not(loom))]
fn async_group(
    o: &BenchOpts,
    policy: mwcap::conn::Policy,
    group: &[Case],
    executor: ExecutorArg,
    place: ServerArg,
) -> Result<(), String> {
    let executor = crate::executors::Executor::from(executor);
    let place = crate::executors::Place::from(place);
    use mwcap::bootstrap::Auth;
    use mwcap::conn::{Endpoint, PolicyChoice};
    use mwcap::sim::{DeviceConfig, Fabric};

    let fabric = Fabric::with_seed(1);
    let cn = fabric.add_device(DeviceConfig::spec().named("client"));
    let sn = fabric.add_device(DeviceConfig::spec().named("server"));
    let cfg = || cases::config(o.pool(), &o.conn);
    // Twice each class of the connection: what it can hold at once stays
    // outside the pool's reserve for incoming payloads (a quarter), so the
    // cases measure the pool's per-call cost, not waits for it.
    let c = cfg();
    let mut classes = vec![mwcap::conn::BufClass { size: c.buffer_size, count: 2 * c.buffers }];
    classes
        .extend(c.large_buffers.iter().map(|l| mwcap::conn::BufClass { size: l.size, count: 2 * l.count }));
    let builder = |nic| {
        let q = mwcap::conn::SrqConfig { chunk: 256, max_slots: 4096 };
        let b = Endpoint::builder(nic, Auth::Unauthenticated).queue_depth(1 << 16);
        // Sharing serves confirm only to trusted peers (--trusted-peers).
        let sharing = |b: mwcap::conn::EndpointBuilder<_>| match policy {
            mwcap::conn::Policy::Mw => b.policy(PolicyChoice::Mw).shared_receives(q),
            mwcap::conn::Policy::Confirm => {
                b.policy(PolicyChoice::Confirm).trusted_peers(true).shared_receives(q)
            }
        };
        match (o.srq, o.shared_buffers) {
            (_, true) => sharing(b).shared_buffers(&classes),
            (true, false) => sharing(b),
            (false, false) => b,
        }
    };
    let mode = match (o.srq, o.shared_buffers) {
        (_, true) => "async-pool",
        (true, false) => "async-srq",
        (false, false) => "async",
    };
    crate::asyncbench::one_process(
        [builder(cn), builder(sn)],
        Policies::both(policy),
        [cfg(), cfg()],
        group,
        o.iters,
        o.warmup,
        (executor, place),
        (mode, "sim"),
    )
}

/// A call in flight in the sans-IO loop.
struct Pending {
    id: CallId,
    tag: u8,
    started: Instant,
}

/// `case` through the sans-IO loop: `warmup` calls, then `iters` measured.
fn sansio_case(o: &BenchOpts, case: &Case) -> Result<Measured, String> {
    // The async side's settings (large buffers for payloads above 64 KiB).
    let cfg = || cases::config(o.pool(), &o.conn);
    let mut pair = SimPair::spec(1, Policies::both(case.policy), cfg(), cfg()).map_err(|e| e.to_string())?;
    let mut state = Loop {
        pending: Vec::with_capacity(case.inflight as usize),
        deferred: VecDeque::with_capacity(64),
        tag: 0,
        spare_events: Vec::with_capacity(64),
        spare_server_events: Vec::with_capacity(64),
    };
    let mut scratch = cases::histogram();
    state.calls(&mut pair, case, o.warmup, &mut scratch)?;
    let mut hist = cases::histogram();
    let a0 = count::allocs();
    let t0 = Instant::now();
    state.calls(&mut pair, case, o.iters, &mut hist)?;
    let elapsed = t0.elapsed();
    let allocs = count::allocs() - a0;
    Ok(Measured { hist, elapsed, allocs: Some(allocs) })
}

/// The sans-IO loop's state, kept across its warm-up and measured phases.
struct Loop {
    pending: Vec<Pending>,
    /// Replies not sent yet (waiting for a free buffer or slot): request,
    /// status, tag, reply payload size, how much of it to write.
    deferred: VecDeque<(RequestId, u8, u8, u32, Check)>,
    tag: u8,
    /// Event vectors swapped with the pair's on each turn (kept, not regrown).
    spare_events: Vec<Event>,
    spare_server_events: Vec<Event>,
}

impl Loop {
    /// Make `n` calls, `case.inflight` at a time, recording each latency.
    fn calls(
        &mut self,
        pair: &mut SimPair,
        case: &Case,
        n: u32,
        hist: &mut hdrhistogram::Histogram<u64>,
    ) -> Result<(), String> {
        let (req_size, reply_size, check) = (case.request_size(), case.reply_size(), case.check);
        let (mut started, mut done) = (0, 0);
        let give_up = pair.now() + Duration::from_secs(60);
        while done < n {
            while started < n && self.pending.len() < case.inflight as usize {
                let data = if req_size > 0 {
                    let Some(mut b) = pair.client.alloc_for(req_size as usize).map_err(|e| e.to_string())?
                    else {
                        break;
                    };
                    let (n, tag) = (req_size as usize, self.tag.wrapping_add(1));
                    b.write_with(|bytes| check.write(bytes, n, tag)).map_err(|e| e.to_string())?;
                    Some(b)
                } else {
                    None
                };
                self.tag = self.tag.wrapping_add(1);
                let now = pair.now();
                let t = Instant::now();
                match pair.client.call(now, &Ask::Call { reply_size, tag: self.tag, check }.encode(), data) {
                    Ok(id) => {
                        self.pending.push(Pending { id, tag: self.tag, started: t });
                        started += 1;
                    }
                    // No free window, control slot or credit yet: try again after the next turn.
                    Err(Refused {
                        error: UseError::NoFreeWindow | UseError::NoCtrlSlot | UseError::NoCredit,
                        data,
                    }) => {
                        if let Some(b) = data {
                            pair.client.free(b);
                        }
                        break;
                    }
                    Err(r) => return Err(format!("call refused: {}", r.error)),
                }
            }
            pair.settle();
            let mut progress = self.server_turn(pair)?;
            // Drained from a vector kept across turns (taking the pair's
            // would leave it a fresh one to grow: an allocation per turn).
            let mut events =
                std::mem::replace(&mut pair.client_events, std::mem::take(&mut self.spare_events));
            for e in events.drain(..) {
                progress = true;
                match e {
                    Event::Reply { call, status, data, .. } => {
                        let i = self
                            .pending
                            .iter()
                            .position(|p| p.id == call)
                            .ok_or("a reply to no call in flight")?;
                        let p = self.pending.swap_remove(i);
                        // Recorded before the payload is checked, as the
                        // request payload was written before `started`: the
                        // interval times the calls, not the memcpy.
                        hist.saturating_record(p.started.elapsed().as_nanos() as u64);
                        let ok = match data {
                            Some(d) => {
                                let ok = check.passes(&d, reply_size, p.tag);
                                pair.client.free(d);
                                ok
                            }
                            None => reply_size == 0,
                        };
                        if status != cases::STATUS_OK || !ok {
                            return Err(format!(
                                "call answered status {status}, reply payload as asked: {ok}"
                            ));
                        }
                        done += 1;
                    }
                    Event::CallFailed { error, .. } => return Err(error.to_string()),
                    Event::BufferReturned(b) => pair.client.free(b),
                    _ => {}
                }
            }
            self.spare_events = events;
            if !progress && !pair.step(pair.now() + Duration::from_secs(1)) {
                pair.run_for(Duration::from_micros(10));
            }
            if pair.now() > give_up {
                return Err(format!("{done} of {n} calls done after 60 s of simulated time"));
            }
        }
        Ok(())
    }

    /// Take the server's events and reply; whether anything happened.
    fn server_turn(&mut self, pair: &mut SimPair) -> Result<bool, String> {
        let mut progress = false;
        let mut events =
            std::mem::replace(&mut pair.server_events, std::mem::take(&mut self.spare_server_events));
        for e in events.drain(..) {
            progress = true;
            let (req, header, data) = match e {
                Event::Request { req, header, data, .. } => (req, header, data),
                Event::ReplyAgain { req, header, .. } => (req, header, None),
                Event::BufferReturned(b) => {
                    pair.server.free(b);
                    continue;
                }
                _ => continue,
            };
            let plan = cases::plan(&header);
            let mut status = cases::STATUS_OK;
            if let Some(d) = data {
                let ok =
                    matches!(plan, Plan::Call { tag, check, .. } if check.passes(&d, d.len() as u32, tag));
                pair.server.free(d);
                if !ok {
                    status = cases::STATUS_BAD_PAYLOAD;
                }
            }
            self.deferred.push_back(match plan {
                Plan::Call { reply_size, tag, check } if status == cases::STATUS_OK => {
                    (req, status, tag, reply_size, check)
                }
                Plan::Call { tag, check, .. } => (req, status, tag, 0, check),
                // (delegate_read does not run in this loop)
                Plan::Allocs | Plan::Delegate { .. } | Plan::Bad => {
                    (req, cases::STATUS_BAD_REQUEST, 0, 0, Check::EveryByte)
                }
            });
        }
        self.spare_server_events = events;
        // Reply in order, as far as the server has free buffers and slots.
        while let Some(&(req, status, tag, size, check)) = self.deferred.front() {
            let data = if size > 0 {
                let Some(mut b) = pair.server.alloc_for(size as usize).map_err(|e| e.to_string())? else {
                    break;
                };
                let n = size as usize;
                b.write_with(|bytes| check.write(bytes, n, tag)).map_err(|e| e.to_string())?;
                Some(b)
            } else {
                None
            };
            let now = pair.now();
            match pair.server.reply(now, req, status, &[], data) {
                Ok(()) => {
                    self.deferred.pop_front();
                    progress = true;
                }
                Err(Refused {
                    error: UseError::NoFreeWindow | UseError::NoCtrlSlot | UseError::NoCredit,
                    data,
                }) => {
                    if let Some(b) = data {
                        pair.server.free(b);
                    }
                    break;
                }
                Err(r) => return Err(format!("reply refused: {}", r.error)),
            }
        }
        Ok(progress)
    }
}
