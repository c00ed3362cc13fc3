//! The executors `mwcap bench` runs the async API under, each the way its
//! users would run a connection:
//!
//! - `block_on`: `futures::executor::block_on` on the calling thread, the
//!   calls and the driver joined in one future (one thread; a driver's
//!   yield comes straight back to it).
//! - `smol`: the calls under `async_io::block_on` (which is `smol::block_on`)
//!   on the calling thread; the driver spawned on an
//!   `async_executor::Executor` (smol's executor) run by one thread of its
//!   own, as smol's global executor (`smol::spawn`) runs its tasks by
//!   default (`SMOL_THREADS` = 1). The two crates, not `smol` itself, so
//!   that the binary adds only the executor to mwcap's dependencies.
//! - `tokio`: a multi-thread runtime (`tokio::runtime::Builder::
//!   new_multi_thread()`, one worker per core), the driver and the calls
//!   each `tokio::spawn`ed as a task of its own.
//!
//! Under smol and tokio a driver runs on another thread than the calls it
//! serves: each hand-over between them is a cross-thread wake-up.
//!
//! The server's side (its serving loop and its endpoint's driver) runs
//! where [`Place`] says: `apart`, on a thread of its own under
//! `futures::executor::block_on` whatever the client's executor, as in a
//! deployment, where it is another process (every call then crosses
//! between threads, under block_on too, so the executors are compared on
//! what they do to the client's calls); or `joined`, as one more future of
//! the client's executor (under block_on the whole call then runs on one
//! thread with no hand-over at all, like the sans-IO loop the bench
//! compares it with; under smol it runs under `smol::block_on` with the
//! calls, the client's driver on the executor's thread; under tokio in
//! the calls' task). (Spawned as a task of its own on smol's executor, or
//! as a tokio task, it made the 16-in-flight mw 4 KiB read 2.0-2.4x slower
//! than under block_on, against 1.6x joined this way: `docs/benchmarks.md`,
//! stop 60.)

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

/// An executor to run the async API under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    /// `futures::executor::block_on`, everything on the calling thread.
    BlockOn,
    /// `smol::block_on` for the calls, smol's executor on a thread of its
    /// own for the drivers and the server.
    Smol,
    /// tokio's multi-thread runtime, every future a task of its own.
    Tokio,
}

impl From<crate::ExecutorArg> for Executor {
    fn from(e: crate::ExecutorArg) -> Executor {
        match e {
            crate::ExecutorArg::BlockOn => Executor::BlockOn,
            crate::ExecutorArg::Smol => Executor::Smol,
            crate::ExecutorArg::Tokio => Executor::Tokio,
        }
    }
}

impl Executor {
    /// Its name in result lines (`executor=`).
    pub fn name(self) -> &'static str {
        match self {
            Executor::BlockOn => "block_on",
            Executor::Smol => "smol",
            Executor::Tokio => "tokio",
        }
    }
}

/// Where the server side runs (`server=` on each line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// On a thread of its own under `futures::executor::block_on`, as
    /// another process would run it, whatever the client's executor.
    Apart,
    /// Beside the client, under the same executor.
    Joined,
}

impl From<crate::ServerArg> for Place {
    fn from(s: crate::ServerArg) -> Place {
        match s {
            crate::ServerArg::Apart => Place::Apart,
            crate::ServerArg::Joined => Place::Joined,
        }
    }
}

impl Place {
    /// Its name in result lines (`server=`).
    pub fn name(self) -> &'static str {
        match self {
            Place::Apart => "apart",
            Place::Joined => "joined",
        }
    }
}

/// Run `app` (the client's calls) to its end under `executor`, with the
/// client's `drivers` beside it, and `server` (the server's loop and its
/// endpoint's driver) where `place` says; wait for the server too (it
/// ends once `app` has closed the connections).
pub fn run<A, S>(
    executor: Executor,
    place: Place,
    app: A,
    server: S,
    drivers: Vec<BoxFuture<'static, ()>>,
) -> Result<(A::Output, S::Output), String>
where
    A: Future + Send + 'static,
    A::Output: Send + 'static,
    S: Future + Send + 'static,
    S::Output: Send + 'static,
{
    // Before any executor: so that no thread's start falls in measured calls.
    crate::count::helper_threads_started();
    if place == Place::Joined {
        let client = async move {
            let (out, served) = futures::future::join(app, server).await;
            (out, Some(served))
        };
        let (out, served) = client_side(executor, client, drivers)?;
        return Ok((out, served.expect("joined: the server ran beside the client")));
    }
    // The server's thread has started (std allocates as a thread starts)
    // before anything is measured.
    let started = Arc::new(Barrier::new(2));
    let thread = {
        let started = started.clone();
        std::thread::Builder::new()
            .name("bench-server".into())
            .spawn(move || {
                started.wait();
                futures::executor::block_on(server)
            })
            .map_err(|e| format!("starting the server's thread: {e}"))?
    };
    started.wait();
    let out = client_side(executor, app, drivers);
    let served = thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    Ok((out?, served))
}

/// Run `app` to its end under `executor`, with `drivers` beside it; wait
/// for the drivers too.
fn client_side<A>(
    executor: Executor,
    app: A,
    drivers: Vec<BoxFuture<'static, ()>>,
) -> Result<A::Output, String>
where
    A: Future + Send + 'static,
    A::Output: Send + 'static,
{
    match executor {
        Executor::BlockOn => Ok(futures::executor::block_on(async {
            let (out, _) = futures::future::join(app, futures::future::join_all(drivers)).await;
            out
        })),
        Executor::Smol => Ok(smol(app, drivers)),
        Executor::Tokio => tokio(app, drivers),
    }
}

/// [`run`] under smol's pieces.
fn smol<A>(app: A, drivers: Vec<BoxFuture<'static, ()>>) -> A::Output
where
    A: Future + Send + 'static,
    A::Output: Send + 'static,
{
    let ex = Arc::new(async_executor::Executor::new());
    let (stop, stopped) = futures::channel::oneshot::channel::<()>();
    // The executor's thread has started (std allocates as a thread starts)
    // before anything is measured.
    let started = Arc::new(Barrier::new(2));
    let thread = {
        let (ex, started) = (ex.clone(), started.clone());
        std::thread::Builder::new()
            .name("smol-executor".into())
            .spawn(move || {
                started.wait();
                async_io::block_on(ex.run(async {
                    let _ = stopped.await;
                }))
            })
            .expect("a thread for the smol executor")
    };
    started.wait();
    let drivers: Vec<_> = drivers.into_iter().map(|d| ex.spawn(d)).collect();
    let out = async_io::block_on(app);
    async_io::block_on(futures::future::join_all(drivers));
    let _ = stop.send(());
    thread.join().expect("the smol executor's thread ends");
    out
}

/// [`run`] under tokio's multi-thread runtime.
fn tokio<A>(app: A, drivers: Vec<BoxFuture<'static, ()>>) -> Result<A::Output, String>
where
    A: Future + Send + 'static,
    A::Output: Send + 'static,
{
    let started = Arc::new(AtomicUsize::new(0));
    let rt = {
        let started = started.clone();
        tokio::runtime::Builder::new_multi_thread()
            .on_thread_start(move || {
                started.fetch_add(1, Ordering::Relaxed);
            })
            .build()
            .map_err(|e| format!("starting a tokio runtime: {e}"))?
    };
    // Its workers have started (std allocates as a thread starts) before
    // anything is measured.
    let until = Instant::now() + Duration::from_secs(1);
    while started.load(Ordering::Relaxed) < rt.metrics().num_workers() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(rt.block_on(async {
        let drivers: Vec<_> = drivers.into_iter().map(tokio::spawn).collect();
        let out = joined(tokio::spawn(app).await);
        for d in drivers {
            joined(d.await);
        }
        out
    }))
}

/// A tokio task's output, or its panic passed on.
fn joined<T>(r: Result<T, tokio::task::JoinError>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}
