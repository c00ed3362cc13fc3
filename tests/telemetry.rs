//! Capability telemetry (`Endpoint::record_metrics`, `mwcap::telemetry`)
//! read back through `metrics-util`'s debugging recorder: the counters
//! match the calls made, the live gauge comes back to 0 once the peer
//! released, every ended exposure has its age in the histogram once, the
//! counters of a finished connection stay, and records made while
//! connections finish never see a counter go back.

#![cfg(not(loom))]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use mwcap::bootstrap::Auth;
use mwcap::conn::{BufClass, Config, Connection, Endpoint, Policies, Policy, PolicyChoice};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

/// What one `record_metrics` recorded: each series (name and sorted
/// labels, as `name{k=v,...}`) and its value.
struct Recorded(HashMap<String, DebugValue>);

impl Recorded {
    fn of(ep: &Endpoint<SimNic>) -> Recorded {
        let recorder = DebuggingRecorder::new();
        let snap: Snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || ep.record_metrics());
        let mut out = HashMap::new();
        for (key, _, _, value) in snap.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<String> =
                key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            labels.sort();
            out.insert(format!("{}{{{}}}", key.name(), labels.join(",")), value);
        }
        Recorded(out)
    }

    fn counter(&self, series: &str) -> u64 {
        match self.0.get(series) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{series}: {other:?} (recorded: {:?})", self.0.keys()),
        }
    }

    fn gauge(&self, series: &str) -> f64 {
        match self.0.get(series) {
            Some(DebugValue::Gauge(g)) => g.into_inner(),
            other => panic!("{series}: {other:?}"),
        }
    }

    /// Exposures whose age was counted, for `endpoint,policy`.
    fn ages(&self, labels: &str) -> u64 {
        self.counter(&format!("mwcap_capability_age_seconds_count{{{labels}}}"))
    }

    /// Exposures whose age was at most `le` seconds.
    fn ages_le(&self, labels: &str, le: &str) -> u64 {
        let (endpoint, policy) = labels.split_once(',').unwrap();
        self.counter(&format!("mwcap_capability_age_seconds_bucket{{{endpoint},le={le},{policy}}}"))
    }
}

fn config() -> Config {
    let mut c = Config::default();
    c.buffers = 8;
    c.buffer_size = 4096;
    c
}

/// A client and a server endpoint ("client", "store") on one fabric, each
/// driven on a thread of its own; the server's with a shared pool if asked.
fn endpoints(shared_pool: bool) -> (Endpoint<SimNic>, Endpoint<SimNic>) {
    let fabric = Fabric::with_seed(77);
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let mut sb = Endpoint::builder(sn, Auth::Unauthenticated).config(config()).name("store");
    if shared_pool {
        sb = sb.policy(PolicyChoice::Mw).shared_buffers(&[BufClass { size: 4096, count: 32 }]);
    }
    let (server, sdrv) = sb.build().unwrap();
    let (client, cdrv) =
        Endpoint::builder(cn, Auth::Unauthenticated).config(config()).name("client").build().unwrap();
    std::thread::spawn(move || futures::executor::block_on(sdrv.run()));
    std::thread::spawn(move || futures::executor::block_on(cdrv.run()));
    (client, server)
}

/// A connection from `client` to `server` under `policies`, whose server
/// side echoes every request's payload back in its reply on a thread of
/// its own (ending when the connection is down): the client's side, the
/// server's, and the echoing thread.
fn echoing(
    client: &Endpoint<SimNic>,
    server: &Endpoint<SimNic>,
    policies: Policies,
) -> (Connection<SimNic>, Connection<SimNic>, std::thread::JoinHandle<()>) {
    let (c, s) = client.connect_local(server, policies).unwrap();
    let serving = s.clone();
    let echo = std::thread::spawn(move || {
        futures::executor::block_on(async {
            while let Some(req) = s.next_request().await {
                let bytes = req.data.as_ref().map(|d| d.to_vec()).unwrap_or_default();
                drop(req.data);
                let mut out = s.alloc().await.unwrap();
                out.copy_from(&bytes).unwrap();
                if s.reply(req.id, 0, &req.header, Some(out)).await.is_err() {
                    return;
                }
            }
        })
    });
    (c, serving, echo)
}

/// [`endpoints`] and one [`echoing`] connection between them.
fn connected(
    policies: Policies,
    shared_pool: bool,
) -> (Endpoint<SimNic>, Endpoint<SimNic>, Connection<SimNic>, Connection<SimNic>) {
    let (client, server) = endpoints(shared_pool);
    let (c, serving, _) = echoing(&client, &server, policies);
    (client, server, c, serving)
}

/// `calls` calls, each with a request payload and a reply payload, every
/// byte checked.
fn call(c: &Connection<SimNic>, calls: u32) {
    futures::executor::block_on(async {
        for i in 0..calls {
            let payload: Vec<u8> = (0..1000u32).map(|k| (k * 7 + i) as u8).collect();
            let mut b = c.alloc().await.unwrap();
            b.copy_from(&payload).unwrap();
            let reply = c.call(b"echo", Some(b)).await.unwrap();
            let data = reply.data.expect("a reply payload");
            assert_eq!(&data[..], &payload[..]);
        }
    })
}

/// Record `ep` until `done` holds of what it recorded (the peer's
/// releases reach the owner a little after the call returns).
fn until(ep: &Endpoint<SimNic>, mut done: impl FnMut(&Recorded) -> bool) -> Recorded {
    let t0 = Instant::now();
    loop {
        let r = Recorded::of(ep);
        if done(&r) || t0.elapsed() > Duration::from_secs(10) {
            return r;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

const CALLS: u32 = 20;

#[test]
fn mw_capabilities_are_counted_aged_and_kept_after_the_connection_finished() {
    let (client, server, c, serving) = connected(Policies::both(Policy::Mw), false);
    call(&c, CALLS);

    // The server exposed each reply's payload in a window: bound, released
    // by the client, invalidated, its age recorded once.
    let s = until(&server, |r| {
        r.gauge("mwcap_capabilities_live{endpoint=store,kind=own,policy=mw}") == 0.0
            && r.counter("mwcap_invalidations_total{endpoint=store}") == u64::from(CALLS)
    });
    assert_eq!(s.counter("mwcap_capabilities_total{endpoint=store,policy=mw}"), u64::from(CALLS));
    assert_eq!(s.counter("mwcap_capabilities_total{endpoint=store,policy=confirm}"), 0);
    assert_eq!(s.counter("mwcap_binds_total{endpoint=store}"), u64::from(CALLS));
    assert_eq!(s.counter("mwcap_invalidations_total{endpoint=store}"), u64::from(CALLS));
    assert_eq!(s.gauge("mwcap_capabilities_live{endpoint=store,kind=own,policy=mw}"), 0.0);
    assert_eq!(s.counter("mwcap_expiries_total{endpoint=store,policy=mw}"), 0);
    assert_eq!(s.counter("mwcap_late_accesses_total{endpoint=store}"), 0);
    assert_eq!(s.gauge("mwcap_connections{endpoint=store}"), 1.0);
    assert_eq!(s.ages("endpoint=store,policy=mw"), u64::from(CALLS), "one age per ended exposure");
    assert_eq!(s.ages_le("endpoint=store,policy=mw", "10"), u64::from(CALLS), "each under 10 s");
    assert_eq!(s.ages_le("endpoint=store,policy=mw", "+Inf"), u64::from(CALLS));

    // The client exposed each request's payload; the server read it (no
    // failed READs on the client's side of the count: those are the
    // server's READs of the client's windows).
    let cl =
        until(&client, |r| r.gauge("mwcap_capabilities_live{endpoint=client,kind=own,policy=mw}") == 0.0);
    assert_eq!(cl.counter("mwcap_capabilities_total{endpoint=client,policy=mw}"), u64::from(CALLS));
    assert_eq!(cl.counter("mwcap_binds_total{endpoint=client}"), u64::from(CALLS));

    // Closed and finished: the counters stay, and nothing is counted twice.
    c.close();
    serving.close();
    futures::executor::block_on(c.finished());
    futures::executor::block_on(serving.finished());
    let s = until(&server, |r| r.gauge("mwcap_connections{endpoint=store}") == 0.0);
    assert_eq!(s.gauge("mwcap_connections{endpoint=store}"), 0.0, "the server's side finished");
    assert_eq!(s.counter("mwcap_capabilities_total{endpoint=store,policy=mw}"), u64::from(CALLS));
    assert_eq!(s.counter("mwcap_binds_total{endpoint=store}"), u64::from(CALLS));
    assert_eq!(s.counter("mwcap_invalidations_total{endpoint=store}"), u64::from(CALLS));
    assert_eq!(s.ages("endpoint=store,policy=mw"), u64::from(CALLS));
    let again = Recorded::of(&server);
    assert_eq!(again.counter("mwcap_capabilities_total{endpoint=store,policy=mw}"), u64::from(CALLS));
}

#[test]
fn confirm_capabilities_are_counted_without_windows() {
    let (_client, server, c, _serving) = connected(Policies::both(Policy::Confirm), false);
    call(&c, CALLS);
    let s =
        until(&server, |r| r.gauge("mwcap_capabilities_live{endpoint=store,kind=own,policy=confirm}") == 0.0);
    assert_eq!(s.counter("mwcap_capabilities_total{endpoint=store,policy=confirm}"), u64::from(CALLS));
    assert_eq!(s.counter("mwcap_capabilities_total{endpoint=store,policy=mw}"), 0);
    assert_eq!(s.counter("mwcap_binds_total{endpoint=store}"), 0, "confirm binds no window");
    assert_eq!(s.counter("mwcap_stale_reads_total{endpoint=store}"), 0);
    assert_eq!(s.ages("endpoint=store,policy=confirm"), u64::from(CALLS));
}

#[test]
fn a_shared_pool_reports_its_buffers_and_windows() {
    let (_client, server, c, _serving) = connected(Policies::both(Policy::Mw), true);
    call(&c, CALLS);
    let s = until(&server, |r| r.gauge("mwcap_pool_windows{endpoint=store,state=lent}") == 0.0);
    assert_eq!(s.gauge("mwcap_pool_windows{endpoint=store,state=lent}"), 0.0);
    let (free, lent) = (
        s.gauge("mwcap_pool_buffers{endpoint=store,state=free}"),
        s.gauge("mwcap_pool_buffers{endpoint=store,state=lent}"),
    );
    assert_eq!(free + lent, 32.0, "the pool's 32 buffers, free or lent");
    assert!(s.gauge("mwcap_pool_windows{endpoint=store,state=free}") > 0.0);
    assert_eq!(s.counter("mwcap_binds_total{endpoint=store}"), u64::from(CALLS));
}

/// Every value each counter was given, in order (the debugging recorder
/// keeps only the last).
#[derive(Clone, Default)]
struct History(Arc<Mutex<HashMap<String, Vec<u64>>>>);

struct Series(String, History);

impl metrics::CounterFn for Series {
    fn increment(&self, _: u64) {
        panic!("{}: mwcap records totals, not increments", self.0);
    }
    fn absolute(&self, value: u64) {
        (self.1).0.lock().unwrap().entry(self.0.clone()).or_default().push(value);
    }
}

impl metrics::Recorder for History {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        let mut labels: Vec<String> = key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        metrics::Counter::from_arc(Arc::new(Series(name, self.clone())))
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Eight connections make their calls and finish one after another while
/// another thread records the server's endpoint as fast as it can: no
/// counter ever goes back (a finishing connection is counted live or in
/// the finished tally, never in neither), and the last totals are every
/// call's.
#[test]
fn records_made_while_connections_finish_never_go_back() {
    let (client, server) = endpoints(false);
    let history = History::default();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let recorder = {
        let (server, history, done) = (server.clone(), history.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                metrics::with_local_recorder(&history, || server.record_metrics());
            }
        })
    };
    for _ in 0..8 {
        let (c, serving, echo) = echoing(&client, &server, Policies::both(Policy::Mw));
        call(&c, 5);
        c.close();
        serving.close();
        futures::executor::block_on(c.finished());
        futures::executor::block_on(serving.finished());
        echo.join().unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    recorder.join().unwrap();
    metrics::with_local_recorder(&history, || server.record_metrics());
    let h = history.0.lock().unwrap();
    for (series, values) in h.iter() {
        assert!(values.windows(2).all(|w| w[0] <= w[1]), "{series} went back: {values:?}");
    }
    let last = |s: &str| *h[s].last().unwrap();
    assert!(h["mwcap_binds_total{endpoint=store}"].len() > 8, "records ran while the connections did");
    assert_eq!(last("mwcap_capabilities_total{endpoint=store,policy=mw}"), 40);
    assert_eq!(last("mwcap_binds_total{endpoint=store}"), 40);
    // Every exposure ended (each connection finished); a window still bound
    // when its connection closed ended with the QP, without a LOCAL_INV.
    assert_eq!(last("mwcap_capability_age_seconds_count{endpoint=store,policy=mw}"), 40);
    let inv = last("mwcap_invalidations_total{endpoint=store}");
    assert!((32..=40).contains(&inv), "{inv} invalidations of 40 binds, at most one a connection short");
}
