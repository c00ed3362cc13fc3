//! The async API (`Connection` on an `Endpoint`) over the simulated NIC,
//! on a plain `futures` executor: each side on an endpoint of its own.

use std::time::Duration;

use futures::executor::block_on;
use futures::future::{select, Either};
use futures::FutureExt;
use mwcap::bootstrap::Auth;
use mwcap::conn::{Config, Connection, Endpoint, EndpointDriver, LossReason, Policies, Policy, Role};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

/// A connection's endpoint driver, to run until the connection finished.
struct Drive {
    driver: EndpointDriver<SimNic>,
    conn: Connection<SimNic>,
    /// The fabric both sides are on, whose oracle the test reads.
    fabric: Fabric,
}

impl Drive {
    /// Run the endpoint until its (only) connection is down and every
    /// buffer is back; why it went down.
    async fn run(self) -> LossReason {
        futures::future::join(self.driver.run(), self.conn.finished()).await.1
    }
}

type Pair = (Connection<SimNic>, Drive, Connection<SimNic>, Drive);

/// An endpoint on `nic` for a connection made without TCP, and its driver.
fn endpoint(nic: SimNic) -> (Endpoint<SimNic>, EndpointDriver<SimNic>) {
    Endpoint::builder(nic, Auth::Unauthenticated).build().unwrap()
}

/// One side: its endpoint, the endpoint's driver, its connection.
type Side = (Endpoint<SimNic>, EndpointDriver<SimNic>, Connection<SimNic>);

/// A client connection with `ccfg` on an endpoint on `cn`, a server one with
/// `scfg` on an endpoint on `sn`, with `p`, connected; the endpoints and
/// their drivers.
fn pair_on(cn: SimNic, sn: SimNic, p: Policies, ccfg: Config, scfg: Config) -> (Side, Side) {
    let (ce, cd) = endpoint(cn);
    let (se, sd) = endpoint(sn);
    let (client, server) = connect_on(&ce, &se, p, ccfg, scfg);
    ((ce, cd, client), (se, sd, server))
}

/// A client connection with `ccfg` on `ce` connected to a server one with
/// `scfg` on `se`, under `p`.
fn connect_on(
    ce: &Endpoint<SimNic>,
    se: &Endpoint<SimNic>,
    p: Policies,
    ccfg: Config,
    scfg: Config,
) -> (Connection<SimNic>, Connection<SimNic>) {
    let (c, s) = (ce.prepare(Role::Client, p, ccfg).unwrap(), se.prepare(Role::Server, p, scfg).unwrap());
    let (cl, sl) = (c.local(), s.local());
    (c.connect(&sl).unwrap(), s.connect(&cl).unwrap())
}

fn connected(p: Policies) -> Pair {
    connected_with(p, Duration::from_millis(300))
}

fn connected_with(p: Policies, lease: Duration) -> Pair {
    connected_timeouts(p, lease, Duration::from_secs(2))
}

fn connected_timeouts(p: Policies, lease: Duration, call_timeout: Duration) -> Pair {
    connected_on(&Fabric::with_seed(3), p, lease, call_timeout)
}

/// A pair on `fabric` (whose oracle the caller reads).
fn connected_on(fabric: &Fabric, p: Policies, lease: Duration, call_timeout: Duration) -> Pair {
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let cfg = || {
        let mut c = Config::default();
        c.call_timeout = call_timeout;
        c.lease_time = lease;
        c.safety_margin = Duration::from_millis(50);
        c
    };
    // The endpoints are dropped: each driver ends once its connection has.
    let ((_, cd, client), (_, sd, server)) = pair_on(cn, sn, p, cfg(), cfg());
    let cdrv = Drive { driver: cd, conn: client.clone(), fabric: fabric.clone() };
    let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
    (client, cdrv, server, sdrv)
}

/// Fail on any hazard the simulator's oracle recorded: no DMA into a
/// buffer a user holds or into freed memory, no READ of a held mw buffer,
/// no invalidation that would crash rxe.
fn assert_no_hazards(fabric: &Fabric) {
    let hazards = fabric.hazards();
    assert!(hazards.is_empty(), "the oracle saw {hazards:?}");
}

/// A server that echoes each request payload back, reversed.
async fn echo(server: Connection<SimNic>) {
    while let Some(req) = server.next_request().await {
        let mut bytes = match &req.data {
            Some(d) => d.to_vec(),
            None => Vec::new(),
        };
        if let Some(d) = req.data {
            server.free(d);
        }
        bytes.reverse();
        let out = if bytes.is_empty() {
            None
        } else {
            let mut b = server.alloc().await.unwrap();
            b.copy_from(&bytes).unwrap();
            Some(b)
        };
        server.reply(req.id, 0, b"echo", out).await.unwrap();
    }
}

#[test]
fn calls_over_the_async_api_in_every_policy_combination() {
    for (request, reply) in [
        (Policy::Mw, Policy::Mw),
        (Policy::Confirm, Policy::Mw),
        (Policy::Mw, Policy::Confirm),
        (Policy::Confirm, Policy::Confirm),
    ] {
        let (client, cdrv, server, sdrv) = connected(Policies { request, reply });
        let fabric = cdrv.fabric.clone();
        let app = async {
            for i in 0..5u8 {
                let mut b = client.alloc().await.unwrap();
                b.copy_from(&[i, 1, 2, 3]).unwrap();
                let r = client.call(b"hi", Some(b)).await.expect("call");
                assert_eq!(r.header, b"echo");
                let d = r.data.expect("reply data");
                assert_eq!(d.to_vec(), vec![3, 2, 1, i]);
                client.free(d);
            }
            client.close();
            server.close();
        };
        let drivers = futures::future::join(cdrv.run(), sdrv.run().map(|_| ()));
        let everything = futures::future::join(app, echo(server.clone()));
        // Both drivers end once their connection is closed and every buffer is back.
        let (_, (creason, ())) = block_on(futures::future::join(everything, drivers));
        assert_eq!(creason, mwcap::conn::LossReason::Closed);
        assert_no_hazards(&fabric);
    }
}

#[test]
fn dropping_a_call_future_cancels_it_and_its_buffer_still_returns() {
    let (client, cdrv, server, sdrv) = connected(Policies::both(Policy::Mw));
    let fabric = cdrv.fabric.clone();
    let app = async {
        let mut b = client.alloc().await.unwrap();
        // Longer than `inline_max`: it is exposed through a window.
        b.copy_from(&[7; 1000]).unwrap();
        // Nobody serves requests: the call future is dropped after a moment.
        let call = Box::pin(client.call(b"x", Some(b)));
        let timer = async_io::Timer::after(Duration::from_millis(20));
        match select(call, timer).await {
            Either::Left(_) => panic!("no server is answering"),
            // Dropping the call future here cancels the call.
            Either::Right((_, call)) => drop(call),
        }
        // The buffer is still exposed (the window stays bound until the
        // lease ends); wait for it to come back to the pool.
        assert_eq!(client.free_buffers(), 15, "exposed while the lease runs");
        for _ in 0..800 {
            if client.free_buffers() == 16 {
                break;
            }
            async_io::Timer::after(Duration::from_millis(10)).await;
        }
        assert_eq!(client.free_buffers(), 16, "the request buffer must return once its lease ended");
    };
    let drivers = futures::future::join(cdrv.run(), sdrv.run());
    let r = block_on(select(Box::pin(app), Box::pin(drivers)));
    assert!(matches!(r, Either::Left(_)), "drivers ended first");
    drop(server);
    assert_no_hazards(&fabric);
}

#[test]
fn an_idle_connection_sleeps_instead_of_polling() {
    let fabric = Fabric::with_seed(3);
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let p = Policies::both(Policy::Mw);
    let ((ce, cd, client), (se, sd, server)) = pair_on(cn, sn, p, Config::default(), Config::default());
    let app = async {
        // One call, so that everything has run once, then nothing.
        client.call(b"ping", None).await.expect("call");
        async_io::Timer::after(Duration::from_millis(100)).await;
        let at_100ms = (client.driver_stats(), server.driver_stats(), ce.stats(), se.stats());
        async_io::Timer::after(Duration::from_millis(200)).await;
        let at_300ms = (client.driver_stats(), server.driver_stats(), ce.stats(), se.stats());
        (at_100ms, at_300ms)
    };
    let rest = futures::future::join3(cd.run(), sd.run(), echo(server.clone()));
    let Either::Left(((a, b), _)) = block_on(select(Box::pin(app), Box::pin(rest))) else {
        panic!("drivers ended first")
    };
    // Asleep: not a single turn between 100 ms and 300 ms of idleness.
    assert_eq!(a.0.turns, b.0.turns, "the client connection kept taking turns: {a:?} -> {b:?}");
    assert_eq!(a.1.turns, b.1.turns, "the server connection kept taking turns: {a:?} -> {b:?}");
    assert_eq!(a.2.turns, b.2.turns, "the client endpoint kept polling: {a:?} -> {b:?}");
    assert_eq!(a.3.turns, b.3.turns, "the server endpoint kept polling: {a:?} -> {b:?}");
    assert!(b.2.sleeps >= 1 && b.3.sleeps >= 1);
}

#[test]
fn a_call_made_while_the_driver_sleeps_still_times_out() {
    // The driver is not rung for a call whose deadline comes after the
    // alarm it already armed; the call must time out all the same, at its
    // own deadline, not at the first one's.
    let timeout = Duration::from_millis(300);
    let (client, cdrv, server, sdrv) = connected_timeouts(Policies::both(Policy::Mw), timeout, timeout);
    let fabric = cdrv.fabric.clone();
    let app = async {
        client.call(b"first", None).await.expect("the first call is answered");
        // Idle: both drivers go to sleep (the client's alarm still armed at
        // the first call's deadline).
        async_io::Timer::after(Duration::from_millis(100)).await;
        let start = std::time::Instant::now();
        // A lost deadline would wait forever: give up after 20 s instead.
        let call = std::pin::pin!(client.call(b"second", None));
        match select(call, async_io::Timer::after(Duration::from_secs(20))).await {
            Either::Left((r, _)) => (r, start.elapsed()),
            Either::Right(_) => panic!("the call never timed out: its deadline was lost"),
        }
    };
    // A server that answers the first request and swallows the rest.
    let swallow = async {
        let mut first = true;
        while let Some(req) = server.next_request().await {
            if std::mem::take(&mut first) {
                server.reply(req.id, 0, b"", None).await.unwrap();
            }
        }
    };
    let rest = futures::future::join3(cdrv.run(), sdrv.run(), swallow);
    let Either::Left(((r, took), _)) = block_on(select(Box::pin(app), Box::pin(rest))) else {
        panic!("drivers ended first")
    };
    assert_eq!(r.unwrap_err(), mwcap::conn::CallError::TimedOut);
    assert!(took >= timeout, "timed out after {took:?}, before its {timeout:?}");
    assert_no_hazards(&fabric);
}

/// A server that answers every request with a 64-byte payload.
async fn answer_with_data(server: Connection<SimNic>) {
    while let Some(req) = server.next_request().await {
        let mut b = server.alloc().await.expect("server buffer");
        b.copy_from(&[0x42; 64]).unwrap();
        server.reply(req.id, 0, b"data", Some(b)).await.unwrap();
    }
}

#[test]
fn confirm_cancelled_calls_do_not_starve_the_servers_pool() {
    // Issue 7 §5.4: with 10 % of calls cancelled and 8 in flight, a server
    // pool of 16 buffers used to starve (each cancelled fetch left its reply
    // buffer held for a whole 5 s lease) and every call timed out.
    let (client, cdrv, server, sdrv) =
        connected_with(Policies::both(Policy::Confirm), Duration::from_secs(5));
    let fabric = cdrv.fabric.clone();
    let app = async {
        let mut ok = 0;
        let mut cancelled = 0;
        for round in 0..25u32 {
            let calls = (0..8u32).map(|i| {
                let client = client.clone();
                async move {
                    let n = round * 8 + i;
                    let mut call = Box::pin(client.call(b"get", None));
                    if n % 10 == 3 {
                        // Cancel this one as soon as its request is out.
                        match futures::poll!(call.as_mut()) {
                            std::task::Poll::Ready(r) => r.map(|_| false),
                            std::task::Poll::Pending => Ok(true),
                        }
                    } else {
                        call.await.map(|r| {
                            assert_eq!(r.data.map(|d| d.to_vec()), Some(vec![0x42; 64]));
                            false
                        })
                    }
                }
            });
            for r in futures::future::join_all(calls).await {
                match r {
                    Ok(true) => cancelled += 1,
                    Ok(false) => ok += 1,
                    Err(e) => panic!("a call failed: {e}"),
                }
            }
        }
        (ok, cancelled)
    };
    let rest = futures::future::join3(cdrv.run(), sdrv.run(), answer_with_data(server.clone()));
    let Either::Left(((ok, cancelled), _)) = block_on(select(Box::pin(app), Box::pin(rest))) else {
        panic!("drivers ended first")
    };
    // Every call that was not cancelled succeeded (none timed out waiting
    // for a server buffer).
    assert_eq!(ok + cancelled, 200);
    assert!(cancelled >= 16, "enough cancelled calls to starve the pool without the fix: {cancelled}");
    assert_no_hazards(&fabric);
}

#[test]
fn closed_resolves_with_the_reason_once_the_connection_is_down() {
    let (client, cdrv, server, sdrv) = connected(Policies::both(Policy::Mw));
    let fabric = cdrv.fabric.clone();
    let app = async {
        client.call(b"ping", None).await.expect("call");
        assert_eq!(client.is_down(), None);
        // Not down yet: closed() waits.
        assert!(client.closed().now_or_never().is_none());
        let waiter = client.clone();
        let closed = async move { waiter.closed().await };
        client.close();
        closed.await
    };
    let rest = futures::future::join3(cdrv.run(), sdrv.run(), echo(server.clone()));
    let Either::Left((reason, _)) = block_on(select(Box::pin(app), Box::pin(rest))) else {
        panic!("drivers ended first")
    };
    assert_eq!(reason, mwcap::conn::LossReason::Closed);
    assert_eq!(client.is_down(), Some(mwcap::conn::LossReason::Closed));
    assert_no_hazards(&fabric);
}

#[test]
fn an_inline_request_that_waited_for_a_buffer_arrives_as_soon_as_one_is_freed() {
    // The server's user holds every buffer: a small request payload (inline)
    // waits in the connection. Freeing a buffer must deliver it at once,
    // with no timer due to wake the driver.
    let (client, cdrv, server, sdrv) = connected(Policies::both(Policy::Mw));
    let fabric = cdrv.fabric.clone();
    let app = async {
        let mut held = Vec::new();
        while let Some(b) = server.try_alloc() {
            held.push(b);
        }
        let mut b = client.alloc().await.unwrap();
        b.copy_from(&[9; 100]).unwrap();
        let call = client.call(b"q", Some(b));
        let serve = async {
            async_io::Timer::after(Duration::from_millis(50)).await;
            let freed = std::time::Instant::now();
            server.free(held.pop().unwrap());
            let req = server.next_request().await.expect("the request");
            let waited = freed.elapsed();
            assert!(waited < Duration::from_millis(500), "delivered {waited:?} after the buffer was freed");
            assert_eq!(req.data.as_ref().unwrap().to_vec(), vec![9; 100]);
            server.free(req.data.unwrap());
            server.reply(req.id, 0, b"ok", None).await.unwrap();
            held
        };
        let (r, held) = futures::future::join(call, serve).await;
        r.expect("the call");
        drop(held);
        client.close();
        server.close();
    };
    let drivers = futures::future::join(cdrv.run(), sdrv.run());
    let (_, _) = block_on(futures::future::join(app, drivers));
    assert_no_hazards(&fabric);
}

/// A server that answers every request with `len` bytes of `0x42` (READ
/// by the client when longer than `inline_max`), counting its replies in
/// `replied`.
async fn answer_with(server: Connection<SimNic>, len: usize, replied: &std::cell::Cell<usize>) {
    while let Some(req) = server.next_request().await {
        let mut b = server.alloc().await.expect("server buffer");
        b.copy_from(&vec![0x42; len]).unwrap();
        server.reply(req.id, 0, b"data", Some(b)).await.unwrap();
        replied.set(replied.get() + 1);
    }
}

/// Wait (on the executor) until `cond` holds; gives up after 20 s.
async fn until(mut cond: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        async_io::Timer::after(Duration::from_millis(10)).await;
    }
    panic!("never happened");
}

#[test]
fn dropping_a_held_buffer_starts_the_reads_that_wait_for_one() {
    // Issue 18 §4.1: two GETs wait for a free buffer for their reply
    // payloads; the user drops one of the buffers it holds. The driver,
    // asleep, was woken by the drop but did not take the buffer back:
    // both calls timed out. `free()` worked.
    for (p, len) in [
        (Policies::both(Policy::Mw), 1000),
        (Policies::both(Policy::Confirm), 1000),
        // Inline (up to `inline_max`): the payload waits in the connection.
        (Policies::both(Policy::Mw), 100),
    ] {
        let fabric = Fabric::with_seed(31);
        let (client, cdrv, server, sdrv) =
            connected_on(&fabric, p, Duration::from_secs(5), Duration::from_secs(10));
        let replied = std::cell::Cell::new(0);
        let app = async {
            let mut held = Vec::new();
            while let Some(b) = client.try_alloc() {
                held.push(b);
            }
            let n = held.len() as u32;
            // A dropped buffer is the pool's at once, in the counts too.
            drop(held.pop());
            let s = client.stats();
            assert_eq!(
                (s.buffers_user, s.buffers_free),
                (n - 1, 1),
                "{p:?}: a dropped buffer counted as the user's"
            );
            held.push(client.try_alloc().expect("the dropped buffer"));
            let get = || async {
                let r = client.call(b"get", None).await?;
                let d = r.data.expect("a reply payload");
                let bytes = d.to_vec();
                drop(d); // the next payload may take it
                Ok::<_, mwcap::conn::CallError>(bytes)
            };
            let drop_one = async {
                // Both replies arrived and their payloads wait for a buffer
                // (the client's driver then sleeps), then one is dropped.
                until(|| replied.get() == 2).await;
                let frames = client.stats().frames_received;
                async_io::Timer::after(Duration::from_millis(100)).await;
                until(|| client.stats().frames_received == frames).await;
                assert_eq!(client.stats().buffers_reading, 0, "{p:?}: no buffer to read into yet");
                drop(held.pop());
                held
            };
            let (a, b, held) = futures::join!(get(), get(), drop_one);
            assert_eq!(a.expect("the first GET"), vec![0x42; len], "{p:?}");
            assert_eq!(b.expect("the second GET"), vec![0x42; len], "{p:?}");
            drop(held);
            client.close();
            server.close();
        };
        let rest = futures::future::join3(cdrv.run(), sdrv.run(), answer_with(server.clone(), len, &replied));
        block_on(futures::future::join(app, rest));
        assert_no_hazards(&fabric);
    }
}

#[test]
fn a_reply_buffer_dropped_while_nothing_waits_costs_no_turn() {
    // The caller drops its reply's buffer; nothing waits for a buffer, so
    // the driver is not woken for it (a turn per call, a third of an mw
    // call's client turns): the next turn, or an alloc, takes it back.
    // The counts see it as free at once all the same.
    for p in [Policies::both(Policy::Mw), Policies::both(Policy::Confirm)] {
        let fabric = Fabric::with_seed(32);
        let (client, cdrv, server, sdrv) =
            connected_on(&fabric, p, Duration::from_secs(5), Duration::from_secs(10));
        let replied = std::cell::Cell::new(0);
        let app = async {
            let total = client.stats().buffers_free;
            let r = client.call(b"get", None).await.expect("a call");
            let d = r.data.expect("a reply payload");
            assert_eq!(d.to_vec(), vec![0x42; 1000], "{p:?}");
            // Every turn the call brings (the release's, the server's) taken.
            async_io::Timer::after(Duration::from_millis(100)).await;
            let turns = client.driver_stats().turns;
            drop(d);
            assert_eq!(client.stats().buffers_free, total, "{p:?}: a dropped buffer counts as free");
            async_io::Timer::after(Duration::from_millis(100)).await;
            assert_eq!(client.driver_stats().turns, turns, "{p:?}: the dropped buffer woke the driver");
            // The next call's turn takes it back; every buffer is free after it.
            let r = client.call(b"get", None).await.expect("a second call");
            drop(r);
            let all: Vec<_> = std::iter::from_fn(|| client.try_alloc()).collect();
            assert_eq!(all.len() as u32, total, "{p:?}: a buffer was lost");
            drop(all);
            client.close();
            server.close();
        };
        let rest =
            futures::future::join3(cdrv.run(), sdrv.run(), answer_with(server.clone(), 1000, &replied));
        block_on(futures::future::join(app, rest));
        assert_no_hazards(&fabric);
    }
}

#[test]
fn a_grant_sends_completion_waits_for_the_servers_next_turn() {
    // Under mw the server's grant SEND completes as soon as the client's
    // NIC acknowledges it. Nothing waits for the send slot it frees, so the
    // completion waits in the connection's inbox for its next turn (on
    // every call the peer's release comes one READ later) instead of
    // taking a turn of its own. Here the client's software is frozen (its
    // driver does not run) and never releases: the completion is handled
    // at the lease's expiry, whose turn then invalidates the window, and
    // the buffer comes back on that invalidation's completion.
    let fabric = Fabric::with_seed(33);
    let (client, cdrv, server, sdrv) = connected_on(
        &fabric,
        Policies::both(Policy::Mw),
        Duration::from_millis(400),
        Duration::from_secs(10),
    );
    let replied = std::cell::Cell::new(0);
    let thawed = std::cell::Cell::new(false);
    let app = async {
        async_io::Timer::after(Duration::from_millis(50)).await;
        let before = server.stats().completions;
        let mut call = Box::pin(client.call(b"get", None));
        assert!(futures::poll!(call.as_mut()).is_pending(), "the request is out");
        until(|| replied.get() == 1).await;
        async_io::Timer::after(Duration::from_millis(150)).await;
        let s = server.stats();
        assert_eq!(s.buffers_exposed, 1, "granted, not released");
        assert_eq!(
            s.completions,
            before + 1,
            "only the request's receive was handled: the grant SEND's completion took a turn of its own"
        );
        until(|| server.stats().buffers_exposed == 0).await;
        let s = server.stats();
        assert_eq!(s.lease_owner.expect("an owner").expired, 1, "{s:?}");
        assert_eq!(s.completions, before + 3, "the grant SEND's and the LOCAL_INV's, at the expiry");
        drop(call);
        thawed.set(true);
        client.close();
        server.close();
    };
    let frozen_client = async {
        until(|| thawed.get()).await;
        cdrv.run().await
    };
    let rest = futures::future::join3(sdrv.run(), frozen_client, answer_with(server.clone(), 1000, &replied));
    block_on(futures::future::join(app, rest));
    assert_no_hazards(&fabric);
}

#[test]
fn a_reply_whose_payload_finds_no_free_buffer_fails_with_no_buffer() {
    // Issue 18 §4.2: the user holds every buffer; the server replies, but
    // the payload has nowhere to go. The call used to fail with TimedOut
    // ("the server may be overloaded or gone"), which sends the user
    // looking at the server.
    for (p, len) in [
        (Policies::both(Policy::Mw), 1000),
        (Policies::both(Policy::Confirm), 1000),
        (Policies::both(Policy::Mw), 100), // inline
    ] {
        let fabric = Fabric::with_seed(32);
        let (client, cdrv, server, sdrv) =
            connected_on(&fabric, p, Duration::from_secs(5), Duration::from_millis(300));
        let replied = std::cell::Cell::new(0);
        let app = async {
            let held: Vec<_> = std::iter::from_fn(|| client.try_alloc()).collect();
            let r = client.call(b"get", None).await;
            assert_eq!(replied.get(), 1, "{p:?}: the server replied");
            let e = r.expect_err("no buffer for the reply payload");
            let msg = e.to_string();
            assert_eq!(e, mwcap::conn::CallError::NoBuffer(len as u32), "{p:?}: {msg}");
            assert!(msg.contains("no buffer was free") && !msg.contains("overloaded or gone"), "{msg}");
            drop(held);
            // With a buffer free, the next call goes through.
            let r = client.call(b"get", None).await.expect("a buffer is free now");
            assert_eq!(r.data.as_ref().unwrap().to_vec(), vec![0x42; len], "{p:?}");
            client.close();
            server.close();
        };
        let rest = futures::future::join3(cdrv.run(), sdrv.run(), answer_with(server.clone(), len, &replied));
        block_on(futures::future::join(app, rest));
        assert_no_hazards(&fabric);
    }
}

#[test]
fn a_request_that_comes_again_under_confirm_has_its_header_and_trace() {
    // Issue 18 §4.4: under confirm a client that read a stale reply asks
    // for it again, and the request comes again through next_request()
    // with the same id. It came with an empty header (and no trace), so a
    // server had to remember every request's header to answer it.
    // A header inline (up to 64 bytes) and one on the heap.
    for header in [b"get key-7".to_vec(), vec![7; 200]] {
        let fabric = Fabric::with_seed(33);
        // The server holds an offered reply for 100 ms (the lease); the
        // client holds every buffer meanwhile, so its READ waits, the hold
        // expires, and the READ it then makes is stale.
        let (client, cdrv, server, sdrv) = connected_on(
            &fabric,
            Policies::both(Policy::Confirm),
            Duration::from_millis(100),
            Duration::from_secs(10),
        );
        let trace = mwcap::conn::TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        let app = async {
            let mut held: Vec<_> = std::iter::from_fn(|| client.try_alloc()).collect();
            let call = client.call_traced(Some(trace), &header, None);
            let serve = async {
                let first = server.next_request().await.expect("the request");
                assert_eq!((&first.header[..], first.trace, first.again), (&header[..], Some(trace), false));
                let mut b = server.alloc().await.unwrap();
                b.copy_from(&[1; 1000]).unwrap();
                server.reply(first.id, 0, b"v1", Some(b)).await.unwrap();
                // The offer's hold expires with the client's READ not made.
                until(|| server.stats().buffers_exposed == 0).await;
                client.free(held.pop().unwrap());
                let again = server.next_request().await.expect("the request again");
                assert_eq!(again.id, first.id);
                assert!(again.again && again.data.is_none(), "{again:?}");
                assert_eq!(again.header, header, "the request's own header");
                assert_eq!(again.trace, Some(trace));
                let mut b = server.alloc().await.unwrap();
                b.copy_from(&[2; 1000]).unwrap();
                server.reply(again.id, 0, b"v2", Some(b)).await.unwrap();
            };
            let (reply, ()) = futures::join!(call, serve);
            let reply = reply.expect("answered the second time");
            assert_eq!(reply.header, b"v2");
            assert_eq!(reply.data.as_ref().unwrap().to_vec(), vec![2; 1000]);
            assert!(client.stats().stale_reads >= 1, "{:?}", client.stats());
            drop((reply, held));
            client.close();
            server.close();
        };
        block_on(futures::future::join(app, futures::future::join(cdrv.run(), sdrv.run())));
        assert_no_hazards(&fabric);
    }
}

/// 20 calls, each with a 4 KiB payload the echo server sends back, checked.
async fn twenty_echoed_calls(client: &Connection<SimNic>) {
    for i in 0..20u8 {
        let mut b = client.alloc().await.unwrap();
        b.copy_from(&[i; 4096]).unwrap();
        let r = client.call(b"hi", Some(b)).await.expect("call");
        let data = r.data.expect("a payload");
        assert_eq!(data.to_vec(), vec![i; 4096]);
        client.free(data);
    }
}

/// A server waiting for its next request takes its connection's turns
/// itself with `Config::serve_busy_poll`: here the server's endpoint
/// driver is never run, so the requests arrive (and their payloads are
/// read, and the replies' windows come back) only if the waiting
/// `next_request` does the work. Without the setting the same server gets
/// nothing.
#[test]
fn a_server_waiting_for_a_request_takes_its_connections_turns_itself() {
    for spin in [true, false] {
        let fabric = Fabric::with_seed(5);
        let cn = fabric.add_device(DeviceConfig::spec().named("c"));
        let sn = fabric.add_device(DeviceConfig::spec().named("s"));
        let p = Policies::both(Policy::Mw);
        let mut scfg = Config::default();
        if spin {
            scfg.serve_busy_poll = Duration::from_secs(10);
        }
        let ((_, cd, client), (se, sd, server)) = pair_on(cn, sn, p, Config::default(), scfg);
        let (done_tx, done_rx) = futures::channel::oneshot::channel::<()>();
        let cdrv = Drive { driver: cd, conn: client.clone(), fabric: fabric.clone() };
        let calling = std::thread::spawn(move || {
            let calls = async {
                let out = select(
                    Box::pin(twenty_echoed_calls(&client)),
                    async_io::Timer::after(Duration::from_secs(3)),
                )
                .await;
                let finished = matches!(out, Either::Left(_));
                client.close();
                let _ = done_tx.send(());
                finished
            };
            block_on(futures::future::join(calls, cdrv.run())).0
        });
        // The server's loop, and not its driver, until the client is done.
        block_on(select(Box::pin(echo(server.clone())), done_rx));
        let finished = calling.join().unwrap();
        assert_eq!(finished, spin, "the calls finish only when the server's wait takes turns (spin: {spin})");
        if spin {
            assert_eq!(se.stats().connection_turns, 0, "the server's driver never ran");
            assert_eq!(server.driver_stats().turns, 0, "no turn by the driver (the waits' are not counted)");
            assert_eq!(server.stats().requests, 20);
        }
        let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
        // The driver ends once the endpoint is dropped and the connection finished.
        drop(se);
        server.close();
        block_on(sdrv.run());
        assert_no_hazards(&fabric);
    }
}

/// A spinning serving wait on one thread and the endpoint's driver on
/// another both take the connection's turns, with 16 calls in flight: each
/// turn takes the routed completions under the connection's lock, so the
/// requests are handled in the order they came. (When a turn took them
/// before the lock, a later turn could run first: on rxe the server saw
/// request ids going backwards and closed the connection.)
#[test]
fn a_spinning_server_and_its_driver_on_two_threads_keep_the_order_of_requests() {
    let fabric = Fabric::with_seed(6);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let mut scfg = Config::default();
    scfg.serve_busy_poll = Duration::from_millis(20);
    let ((_, cd, client), (_, sd, server)) = pair_on(cn, sn, p, Config::default(), scfg);
    let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
    let driving = std::thread::spawn(move || block_on(sdrv.run()));
    let s2 = server.clone();
    let serving = std::thread::spawn(move || block_on(echo(s2)));
    let cdrv = Drive { driver: cd, conn: client.clone(), fabric: fabric.clone() };
    let calls = async {
        let one = |i: u32| {
            let client = &client;
            async move {
                let mut b = client.alloc().await.unwrap();
                b.copy_from(&i.to_le_bytes()).unwrap();
                let r = client.call(b"hi", Some(b)).await.expect("a reply");
                let mut want = i.to_le_bytes();
                want.reverse();
                assert_eq!(r.data.as_deref(), Some(&want[..]), "call {i}");
            }
        };
        for round in 0..200u32 {
            futures::future::join_all((0..16).map(|k| one(round * 16 + k))).await;
        }
        assert_eq!(client.stats().calls_failed, 0);
        client.close();
    };
    block_on(futures::future::join(calls, cdrv.run()));
    assert_eq!(server.stats().requests, 3200, "{:?}", server.stats());
    server.close();
    serving.join().unwrap();
    driving.join().unwrap();
    assert_no_hazards(&fabric);
}

/// Runs `calls` echo calls from a client on a thread of its own, its
/// endpoint's driver and the server's each on another thread and the
/// server's handler on a fourth, as `mwcap serve` and a client of it run
/// under a multi-threaded executor; returns how many times the client's
/// and the server's drivers slept over the calls. Every call must succeed
/// and the fabric must end with no hazard.
fn driver_sleeps_over_threaded_calls(
    dev: DeviceConfig,
    ccfg: Config,
    scfg: Config,
    calls: u64,
) -> (u64, u64) {
    let fabric = Fabric::with_seed(12);
    let cn = fabric.add_device(dev.clone().named("c"));
    let sn = fabric.add_device(dev.named("s"));
    let p = Policies::both(Policy::Mw);
    let ((ce, cd, client), (se, sd, server)) = pair_on(cn, sn, p, ccfg, scfg);
    let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
    let sdriving = std::thread::spawn(move || block_on(sdrv.run()));
    let cdrv = Drive { driver: cd, conn: client.clone(), fabric: fabric.clone() };
    let cdriving = std::thread::spawn(move || block_on(cdrv.run()));
    let s2 = server.clone();
    let serving = std::thread::spawn(move || block_on(echo(s2)));
    let (c0, s0) = (ce.stats().sleeps, se.stats().sleeps);
    block_on(async {
        for _ in 0..calls {
            client.call(b"hi", None).await.expect("a reply");
        }
    });
    let slept = (ce.stats().sleeps - c0, se.stats().sleeps - s0);
    assert_eq!(client.stats().calls_failed, 0);
    client.close();
    server.close();
    // The drivers end once their endpoints' handles are gone.
    drop((ce, se));
    serving.join().unwrap();
    cdriving.join().unwrap();
    sdriving.join().unwrap();
    assert_no_hazards(&fabric);
    slept
}

/// A client calling and a server serving, each spinning on a thread of its
/// own (`Config::busy_poll`, `Config::serve_busy_poll`) beside its
/// endpoint's driver on another, as `mwcap serve` and a client of it run:
/// each call and each request is found by the waiter's own polling, and a
/// waiter with a long window (20 ms here, `LINGER_MIN` or more) that got
/// what it waited for leaves without waking its driver, which sleeps until
/// the end of the last window published (`ReadyList::stop`). So the
/// drivers sleep and wake about once a window, not once a call: when the
/// last waiter to stop always rang the driver, each driver woke about once
/// per call (0.8-1.0 sleeps a call here).
#[test]
fn spinning_waiters_do_not_wake_their_drivers_once_a_call() {
    let window = Duration::from_millis(20);
    let mut ccfg = Config::default();
    ccfg.busy_poll = window;
    let mut scfg = Config::default();
    scfg.serve_busy_poll = window;
    let calls = 2000u64;
    let (client, server) = driver_sleeps_over_threaded_calls(DeviceConfig::spec(), ccfg, scfg, calls);
    assert!(
        client < calls / 4 && server < calls / 4,
        "over {calls} calls the client's driver slept {client} times and the server's {server}: woken per call",
    );
}

/// A client calling on a thread of its own with a short spin window
/// (under `LINGER_MIN`, so it never lingers), beside its endpoint's driver
/// on another thread, as under a multi-threaded executor: the driver
/// leaves the queue unarmed while a call polls it, and the last call to
/// stop rings it (`ReadyList::stop`). Every call gets its reply, and the
/// simulator's oracle finds no hazard. (The simulator's queue arm once
/// had a second protocol of its own, kept armed while calls polled; it
/// is gone, so what runs here is what runs on verbs.)
#[test]
fn short_spinning_calls_beside_their_driver_on_another_thread_all_succeed() {
    let mut ccfg = Config::default();
    ccfg.busy_poll = Duration::from_micros(400);
    // The helper asserts that no call failed and that no hazard was seen.
    driver_sleeps_over_threaded_calls(DeviceConfig::spec(), ccfg, Config::default(), 2000);
}

/// A pending call takes its connection's turns itself while it busy-polls
/// (`Config::busy_poll`): it polls the endpoint's shared completion queue
/// and finds its reply on its own thread. Here the client's endpoint driver
/// is never run, so the calls finish only if the waiting calls do the work.
#[test]
fn a_pending_call_takes_its_connections_turns_itself() {
    let fabric = Fabric::with_seed(4);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let mut ccfg = Config::default();
    ccfg.busy_poll = Duration::from_secs(10);
    let ((ce, _client_driver, client), (_, sd, server)) = pair_on(cn, sn, p, ccfg, Config::default());
    let closer = server.clone();
    let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
    let served = std::thread::spawn(move || block_on(futures::future::join(echo(server), sdrv.run())));
    let calls = twenty_echoed_calls(&client);
    // Fails rather than hangs if a waiting call stops taking turns (the
    // client's driver is not running, so nothing else would).
    match block_on(select(Box::pin(calls), async_io::Timer::after(Duration::from_secs(30)))) {
        Either::Left(_) => {}
        Either::Right(_) => panic!("the calls did not finish: a waiting call took no turns"),
    }
    assert_eq!(ce.stats().connection_turns, 0, "the endpoint's driver never ran");
    assert_eq!(client.driver_stats().turns, 0);
    closer.close();
    served.join().unwrap();
    assert_no_hazards(&fabric);
}

/// A waiting call's spin window (`Config::busy_poll`) opens again whenever
/// a turn of its connection finds something to do, so a wait longer than
/// the window spins through as long as something comes within each
/// window. Here the window is 1 s and the client's driver never runs: of
/// two calls, the server answers one after 0.6 s and the other after
/// 1.2 s. The call that spins finds the first reply within its window,
/// which then runs to 1.6 s and so takes in the second; with the window
/// counted from the start of the wait alone it closed at 1 s, nobody
/// polled any more, and the second call never finished.
#[test]
fn a_waiting_calls_spin_window_opens_again_with_each_turn_that_finds_work() {
    let fabric = Fabric::with_seed(9);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let mut ccfg = Config::default();
    ccfg.busy_poll = Duration::from_secs(1);
    let ((ce, _client_driver, client), (_, sd, server)) = pair_on(cn, sn, p, ccfg, Config::default());
    let closer = server.clone();
    let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
    let serving = async move {
        let slow = server.next_request().await.expect("the first request");
        let fast = server.next_request().await.expect("the second request");
        async_io::Timer::after(Duration::from_millis(600)).await;
        server.reply(fast.id, 0, b"fast", None).await.unwrap();
        async_io::Timer::after(Duration::from_millis(600)).await;
        server.reply(slow.id, 0, b"slow", None).await.unwrap();
    };
    let served = std::thread::spawn(move || block_on(futures::future::join(serving, sdrv.run())));
    let calls = futures::future::join(client.call(b"slow", None), client.call(b"fast", None));
    let (slow, fast) =
        match block_on(select(Box::pin(calls), async_io::Timer::after(Duration::from_secs(10)))) {
            Either::Left((replies, _)) => replies,
            Either::Right(_) => {
                panic!("a call did not finish: its spin window closed while replies still came")
            }
        };
    assert_eq!(&slow.expect("the slow call").header[..], b"slow");
    assert_eq!(&fast.expect("the fast call").header[..], b"fast");
    assert_eq!(ce.stats().connection_turns, 0, "the endpoint's driver never ran");
    closer.close();
    served.join().unwrap();
    assert_no_hazards(&fabric);
}

/// While a call takes its connection's turns itself, the endpoint's driver
/// neither busy-polls nor arms the queue: one thread polls, not two (on a
/// host with fewer cores than spinning threads, each would take the
/// other's core). Here both may busy-poll for 10 s, and the server holds
/// its answer back for 300 ms: a driver that kept polling beside the
/// waiting call would take thousands of turns in that time.
#[test]
fn a_driver_does_not_busy_poll_while_a_call_polls_for_it() {
    let fabric = Fabric::with_seed(8);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let p = Policies::both(Policy::Mw);
    let mut ccfg = Config::default();
    ccfg.busy_poll = Duration::from_secs(10);
    let (ce, cd) =
        Endpoint::builder(cn, Auth::Unauthenticated).busy_poll(Duration::from_secs(10)).build().unwrap();
    let (se, sd) = endpoint(sn);
    let (client, server) = connect_on(&ce, &se, p, ccfg, Config::default());
    drop(se);
    let cdrv = Drive { driver: cd, conn: client.clone(), fabric: fabric.clone() };
    let driving = std::thread::spawn(move || block_on(cdrv.run()));
    let sdrv = Drive { driver: sd, conn: server.clone(), fabric: fabric.clone() };
    let c2 = client.clone();
    let calling = std::thread::spawn(move || block_on(c2.call(b"wait", None)).map(|r| r.status));
    // The call is out and spinning; the server has not looked yet.
    std::thread::sleep(Duration::from_millis(100));
    let before = ce.stats().turns;
    std::thread::sleep(Duration::from_millis(300));
    let turns = ce.stats().turns - before;
    let closer = server.clone();
    let served = std::thread::spawn(move || block_on(futures::future::join(echo(server), sdrv.run())));
    assert_eq!(calling.join().unwrap().expect("the reply"), 0);
    assert!(turns < 20, "the client's driver took {turns} turns in 300 ms beside a spinning call");
    client.close();
    closer.close();
    drop(ce);
    driving.join().unwrap();
    served.join().unwrap();
    assert_no_hazards(&fabric);
}

/// A turn takes the completions that came before its timers: a READ that
/// completed within its lease, whose connection's turn came only after
/// the lease's end (a driver held up), delivers its call's reply. (With
/// the timers first, the reader took the READ for one past its deadline
/// and flushed a healthy QP: the call failed with the connection down for
/// `ReadHung`.) The fabric moves only when the test says, and the client's
/// driver is polled by hand: not between the READ's completion and the
/// lease's end.
#[test]
fn a_read_that_completed_in_time_is_taken_though_its_turn_comes_after_its_deadline() {
    use futures::task::{noop_waker, Context, Poll};
    use mwcap::sim::{FabricConfig, Progress};
    use std::future::Future;
    let fabric = Fabric::new(FabricConfig { progress: Progress::Manual, ..FabricConfig::with_seed(61) });
    let (cn, sn) = (fabric.add_device(DeviceConfig::spec()), fabric.add_device(DeviceConfig::spec()));
    let lease = Duration::from_millis(150);
    let mut cfg = Config::default();
    cfg.lease_time = lease;
    cfg.safety_margin = Duration::from_millis(10);
    // Only the driver takes the client's turns (a waiting call does not).
    cfg.busy_poll = Duration::ZERO;
    let ((ce, cd), (se, sd)) = (endpoint(cn), endpoint(sn));
    let p = Policies::both(Policy::Mw);
    let (c, s) =
        (ce.prepare(Role::Client, p, cfg.clone()).unwrap(), se.prepare(Role::Server, p, cfg).unwrap());
    let (cl, sl) = (c.local(), s.local());
    let qp = fabric.qp_addr(&cl).expect("the client's QP is on the fabric");
    let (client, server) = (c.connect(&sl).unwrap(), s.connect(&cl).unwrap());
    let serve = {
        let server = server.clone();
        async move {
            let req = server.next_request().await.expect("the call's request");
            let mut out = server.alloc().await.expect("a buffer for the reply");
            out.copy_from(&[7u8; 4096]).unwrap();
            server.reply(req.id, 0, b"", Some(out)).await.expect("the reply");
        }
    };
    // (Fused: polled again once it has replied.)
    let mut serve = Box::pin(serve.fuse());
    let mut sdrv = Box::pin(sd.run());
    let mut cdrv = Box::pin(cd.run());
    let mut call = Box::pin(client.call(b"get", None));
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    let read = |f: &Fabric| f.qp_counters(qp).map_or(0, |c| c.bytes_read);
    // Until the client's READ has completed on the fabric, its completion
    // in the client's queue: every side polled, then the fabric run.
    let mut rounds = 0;
    while read(&fabric) < 4096 {
        rounds += 1;
        assert!(rounds < 10_000, "the client never READ the reply's payload");
        let _ = serve.as_mut().poll(&mut cx);
        let _ = sdrv.as_mut().poll(&mut cx);
        let _ = cdrv.as_mut().poll(&mut cx);
        assert!(call.as_mut().poll(&mut cx).is_pending(), "the call ended before its READ completed");
        fabric.run_until_idle();
    }
    // The client's driver is held up past the lease: the READ's deadline
    // passes with its completion waiting in the queue.
    std::thread::sleep(lease + Duration::from_millis(100));
    let mut got = None;
    for _ in 0..100 {
        let _ = cdrv.as_mut().poll(&mut cx);
        if let Poll::Ready(r) = call.as_mut().poll(&mut cx) {
            got = Some(r);
            break;
        }
    }
    let reply = got.expect("the call ended").expect("the call's reply, not a READ taken for a late one");
    assert_eq!(reply.data.as_deref(), Some(&[7u8; 4096][..]));
    assert!(client.is_down().is_none(), "the client's connection went down: {:?}", client.is_down());
    assert!(fabric.hazards().is_empty(), "{:?}", fabric.hazards());
}
