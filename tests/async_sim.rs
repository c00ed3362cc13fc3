//! The async API (Connection + Driver) over the simulated NIC, on a plain
//! `futures` executor.

use std::time::Duration;

use futures::executor::block_on;
use futures::future::{select, Either};
use futures::FutureExt;
use mwcap::conn::{Config, Connection, Endpoint, Policies, Policy, Role};
use mwcap::sim::{DeviceConfig, Fabric, SimNic};

fn connected(p: Policies) -> (Connection<SimNic>, mwcap::conn::Driver<SimNic>, Connection<SimNic>, mwcap::conn::Driver<SimNic>) {
    let fabric = Fabric::with_seed(3);
    let cn = fabric.add_device(DeviceConfig::spec().named("c"));
    let sn = fabric.add_device(DeviceConfig::spec().named("s"));
    let cfg = |role| {
        let mut c = Config::new(role, p);
        c.call_timeout = Duration::from_secs(2);
        c.lease_time = Duration::from_millis(300);
        c.safety_margin = Duration::from_millis(50);
        c
    };
    let mut c = Endpoint::new(cn, cfg(Role::Client)).unwrap();
    let mut s = Endpoint::new(sn, cfg(Role::Server)).unwrap();
    let (ce, se) = (c.local(), s.local());
    c.connect(&se).unwrap();
    s.connect(&ce).unwrap();
    let (client, cdrv) = Connection::new(c);
    let (server, sdrv) = Connection::new(s);
    (client, cdrv, server, sdrv)
}

/// A server that echoes each request payload back, reversed.
async fn echo(server: Connection<SimNic>) {
    while let Some(req) = server.next_request().await {
        let mut bytes = match &req.data {
            Some(d) => server.read(d).unwrap(),
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
            server.write(&mut b, &bytes).unwrap();
            Some(b)
        };
        server.reply(req.id, 0, b"echo", out).unwrap();
    }
}

#[test]
fn calls_over_the_async_api_in_every_policy_combination() {
    for (request, reply) in [(Policy::Mw, Policy::Mw), (Policy::Confirm, Policy::Mw), (Policy::Mw, Policy::Confirm), (Policy::Confirm, Policy::Confirm)] {
        let (client, cdrv, server, sdrv) = connected(Policies { request, reply });
        let app = async {
            for i in 0..5u8 {
                let mut b = client.alloc().await.unwrap();
                client.write(&mut b, &[i, 1, 2, 3]).unwrap();
                let r = client.call(b"hi", Some(b)).await.expect("call");
                assert_eq!(r.header, b"echo");
                let d = r.data.expect("reply data");
                assert_eq!(client.read(&d).unwrap(), vec![3, 2, 1, i]);
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
    }
}

#[test]
fn dropping_a_call_future_cancels_it_and_its_buffer_still_returns() {
    let (client, cdrv, server, sdrv) = connected(Policies::both(Policy::Mw));
    let app = async {
        let mut b = client.alloc().await.unwrap();
        client.write(&mut b, b"abandon me").unwrap();
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
}
