//! The benchmark over the async API (`Connection` + `Driver`), on any NIC:
//! the server's loop, the client's calls with 1 or many in flight, and one
//! process running both sides of a connection in one executor.
//!
//! The calls, the server's loop and the drivers run under one of
//! [`Executor`]'s executors (`executors.rs`). Under `block_on` (the verbs
//! bench's, and one of `--sim`'s) everything is on one thread under
//! `futures::executor::block_on`; async-io's own thread drives its reactor
//! (the completion channel's fd) and mwcap's alarm thread its timers. Not
//! `async_io::block_on` there: it polls the reactor (an `epoll_wait` system
//! call) each time a future yields, which a busy-polling driver does on
//! every idle turn.

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use futures::future::{select, try_join_all, BoxFuture, Either};
use futures::TryFutureExt;
use hdrhistogram::Histogram;
use mwcap::backend::Nic;
use mwcap::conn::{
    Buf, Config, Connection, Endpoint, EndpointBuilder, EndpointDriver, Policies, Refused, RegionId,
    RegionRange, Role, Token, UseError,
};
use parking_lot::Mutex;

use crate::cases::{self, Ask, Case, Check, Kind, Labels, Measured, Plan};
use crate::count;
use crate::executors::{self, Executor, Place};

/// How long a client waits for a request buffer before calling the run
/// stuck.
const STUCK: Duration = Duration::from_secs(10);

/// A free buffer that holds `len` bytes: returned buffers go back to the
/// pool by themselves and wake `alloc_for`; give up after `STUCK`.
async fn alloc<N: Nic>(conn: &Connection<N>, len: u32) -> Result<Buf, String> {
    let wait = pin!(conn.alloc_for(len as usize));
    match select(wait, async_io::Timer::after(STUCK)).await {
        Either::Left((b, _)) => b.map_err(|e| format!("waiting for a buffer: {e}")),
        Either::Right(_) => {
            Err(format!("no buffer came back to the pool in {STUCK:?}; is the peer still reading?"))
        }
    }
}

/// A buffer holding the payload of `len` bytes tagged `tag`, written in
/// place (no copy through the heap) as far as `check` says.
///
/// The server waits for it as long as its connection is up, with no clock
/// of its own: on a shared pool many connections wait their turn (100
/// connections' 1 MiB replies through 16 buffers under TCG wait seconds),
/// every buffer comes back once its reader releases it or its lease runs
/// out, and the client's call timeout bounds the call.
async fn filled<N: Nic>(conn: &Connection<N>, len: u32, tag: u8, check: Check) -> Result<Buf, String> {
    let mut b =
        conn.alloc_for(len as usize).await.map_err(|e| format!("waiting for a {len}-byte buffer: {e}"))?;
    let n = len as usize;
    if let Err(e) = b.write_with(|bytes| check.write(bytes, n, tag)) {
        conn.free(b);
        return Err(format!("writing a {len}-byte payload: {e}"));
    }
    Ok(b)
}

/// Reply (the library waits while every window or control slot is busy:
/// as long as the connection is up, as [`filled`] waits for a buffer).
async fn reply<N: Nic>(
    conn: &Connection<N>,
    req: mwcap::conn::RequestId,
    status: u8,
    header: &[u8],
    data: Option<Buf>,
) -> Result<(), String> {
    conn.reply(req, status, header, data)
        .await
        .map_err(|Refused { error, .. }| format!("the reply was refused: {error}"))
}

/// The identity a benchmark server vouches for on connections made
/// without mwcap's bootstrap (`Pending::authenticated_as`): the client of a
/// one-process run, which `delegate_read` delegates to.
pub const BENCH_IDENTITY: &str = "bench";

/// How long a `delegate_read` token lives: a client that never redeems
/// one (it failed) leaves its range pinned that long.
const DELEGATION_TTL: Duration = Duration::from_secs(30);

/// Bytes of each size's delegation region at most (it has 2-32 slots).
const DELEGATION_REGION: usize = 8 << 20;

/// A benchmark server's side of `delegate_read`: for each payload size
/// asked for, a region of its endpoint (registered at the first ask of
/// that size, kept as long as the endpoint) of 2-32 slots of that size,
/// written with the ask's payload and delegated in turn, one slot per ask.
/// A slot whose last delegation is not over yet (the delegate has not
/// released its read) is waited for before it is written again.
pub struct Delegations<N: Nic> {
    endpoint: Endpoint<N>,
    regions: Mutex<HashMap<u32, (RegionId, usize)>>,
    next: AtomicUsize,
    /// Payloads' bytes before they are written into the region, kept
    /// between asks (the benchmark counts allocations per call): one per
    /// ask in progress at once.
    scratch: Mutex<Vec<Vec<u8>>>,
}

impl<N: Nic + 'static> Delegations<N> {
    /// Delegations of ranges of `endpoint`'s regions.
    pub fn new(endpoint: Endpoint<N>) -> Self {
        Delegations {
            endpoint,
            regions: Mutex::new(HashMap::new()),
            next: AtomicUsize::new(0),
            scratch: Mutex::new(Vec::new()),
        }
    }

    /// The region for payloads of `size` bytes and its number of slots.
    fn region(&self, size: u32) -> Result<(RegionId, usize), String> {
        let mut regions = self.regions.lock();
        if let Some(&r) = regions.get(&size) {
            return Ok(r);
        }
        let slots = (DELEGATION_REGION / size.max(1) as usize).clamp(2, 32);
        let id = self
            .endpoint
            .register_region(slots * size as usize)
            .map_err(|e| format!("registering a region of {slots} slots of {size} bytes to delegate: {e}"))?;
        regions.insert(size, (id, slots));
        Ok((id, slots))
    }

    /// Write `bytes` at `at` of `region` once no exposure covers them (a
    /// part of a payload of `size` bytes).
    async fn write(&self, region: RegionId, at: usize, bytes: &[u8], size: u32) -> Result<(), String> {
        self.endpoint
            .region_write_when_free(region, at, bytes)
            .await
            .map_err(|e| format!("writing a {size}-byte range to delegate: {e}"))
    }

    /// Write the payload of `size` bytes tagged `tag` into the next slot
    /// (as far as `check` says) and delegate it to `conn`'s identity: the token.
    async fn delegate(
        &self,
        conn: &Connection<N>,
        size: u32,
        tag: u8,
        check: Check,
    ) -> Result<Token, String> {
        let identity = conn.peer_identity().ok_or(
            "this connection has no identity to delegate to: connect with a key (--key-file or --keyring)",
        )?;
        let (region, slots) = self.region(size)?;
        let offset = self.next.fetch_add(1, Relaxed) % slots * size as usize;
        let n = size as usize;
        if check == Check::Stamp && n >= 2 * cases::STAMP_LEN {
            let [head, tail] = cases::stamps(n, tag);
            self.write(region, offset, &head, size).await?;
            self.write(region, offset + n - cases::STAMP_LEN, &tail, size).await?;
        } else {
            // Taken out of the pool for the write (no guard across an await).
            let mut bytes = self.scratch.lock().pop().unwrap_or_default();
            bytes.resize(n, 0);
            cases::fill(&mut bytes[..n], tag);
            let written = self.write(region, offset, &bytes[..n], size).await;
            self.scratch.lock().push(bytes);
            written?;
        }
        let range = RegionRange { region, offset, len: size };
        let d = self
            .endpoint
            .delegate_region(range, identity, DELEGATION_TTL)
            .map_err(|e| format!("delegating {size} bytes to {identity}: {e}"))?;
        Ok(d.token)
    }
}

/// Serve requests until the connection is down: check each request
/// payload's tag, reply with the payload the header asks for (or the
/// allocation count, or a token of a range delegated to the client by
/// `delegations`), each payload checked and written as far as the header
/// says. Returns the number of requests served.
pub async fn serve<N: Nic + 'static>(
    conn: &Connection<N>,
    max_payload: u32,
    delegations: &Delegations<N>,
) -> Result<u64, String> {
    let mut served = 0;
    while let Some(req) = conn.next_request().await {
        served += 1;
        let plan = cases::plan(&req.header);
        let mut status = cases::STATUS_OK;
        if let Some(d) = req.data {
            let ok = match plan {
                Plan::Call { tag, check, .. } => check.passes(&d, d.len() as u32, tag),
                _ => false,
            };
            conn.free(d);
            if !ok {
                status = cases::STATUS_BAD_PAYLOAD;
            }
        }
        match plan {
            Plan::Allocs => reply(conn, req.id, status, &count::allocs().to_le_bytes(), None).await?,
            Plan::Call { reply_size, tag, check } if status == cases::STATUS_OK && reply_size > 0 => {
                if reply_size > max_payload {
                    reply(conn, req.id, cases::STATUS_BAD_REQUEST, &[], None).await?;
                    continue;
                }
                let b = filled(conn, reply_size, tag, check).await?;
                reply(conn, req.id, status, &[], Some(b)).await?;
            }
            Plan::Call { .. } => reply(conn, req.id, status, &[], None).await?,
            Plan::Delegate { size, .. } if size > max_payload => {
                reply(conn, req.id, cases::STATUS_BAD_REQUEST, &[], None).await?
            }
            Plan::Delegate { size, tag, check } => match delegations.delegate(conn, size, tag, check).await {
                // The token as the reply's payload (inline: a token is
                // 82 bytes and the identity), not its header, where one
                // over 64 bytes costs the client an allocation; in the
                // header only if no buffer holds it (buffers of 64 bytes).
                Ok(token) => match conn.alloc_for(token.as_bytes().len()).await {
                    Ok(mut b) => {
                        b.copy_from(token.as_bytes())
                            .map_err(|e| format!("the token into its buffer: {e}"))?;
                        reply(conn, req.id, status, &[], Some(b)).await?
                    }
                    Err(UseError::TooLong { .. }) => {
                        reply(conn, req.id, status, token.as_bytes(), None).await?
                    }
                    Err(e) => return Err(format!("a buffer for the token: {e}")),
                },
                Err(why) => reply(conn, req.id, cases::STATUS_NOT_DELEGATED, why.as_bytes(), None).await?,
            },
            Plan::Bad => reply(conn, req.id, cases::STATUS_BAD_REQUEST, &[], None).await?,
        }
    }
    Ok(served)
}

/// One client task: `calls` calls of `case`, one after the other, each
/// recorded in `hist`.
async fn caller<N: Nic>(
    conn: &Connection<N>,
    case: &Case,
    calls: u32,
    first_tag: u8,
    hist: &Mutex<Histogram<u64>>,
) -> Result<(), String> {
    let (req_size, reply_size, check) = (case.request_size(), case.reply_size(), case.check);
    let mut tag = first_tag;
    for _ in 0..calls {
        tag = tag.wrapping_add(1);
        if case.kind == Kind::DelegateRead {
            delegate_read(conn, case, tag, hist).await?;
            continue;
        }
        // Waiting for a request buffer is part of a call under load, but
        // writing its payload is not: perftest's floor writes none, and
        // under TCG a 64 KiB write alone takes milliseconds.
        let asked = Instant::now();
        let data = if req_size > 0 { Some(alloc(conn, req_size).await?) } else { None };
        let waited = asked.elapsed();
        let data = match data {
            Some(mut b) => {
                let n = req_size as usize;
                if let Err(e) = b.write_with(|bytes| check.write(bytes, n, tag)) {
                    conn.free(b);
                    return Err(format!("writing a {req_size}-byte request payload: {e}"));
                }
                Some(b)
            }
            None => None,
        };
        let t0 = Instant::now();
        let r = conn
            .call(&Ask::Call { reply_size, tag, check }.encode(), data)
            .await
            .map_err(|e| format!("call failed: {e}"))?;
        // Recorded before the reply payload is checked, for the same reason;
        // a payload that fails the check still fails the run.
        hist.lock().saturating_record((waited + t0.elapsed()).as_nanos() as u64);
        let got = match r.data {
            Some(d) => {
                let ok = check.passes(&d, reply_size, tag);
                conn.free(d);
                Some(ok)
            }
            None => None,
        };
        if r.status == cases::STATUS_BAD_REQUEST && check == Check::Stamp {
            // A server that predates stamps knows no such header.
            return Err(format!(
                "the server refused a --stamp-only call (status 2, bad request): either the {reply_size}-byte \
                 reply is above its --max-payload, or it is a mwcap serve older than --stamp-only; \
                 update it, or bench without --stamp-only"
            ));
        }
        if r.status != cases::STATUS_OK {
            return Err(format!(
                "the server answered status {} (1: request payload not this call's, 2: bad request)",
                r.status
            ));
        }
        match got {
            None if reply_size == 0 => {}
            Some(true) => {}
            Some(false) => {
                return Err(format!(
                    "the reply payload read is not this call's {reply_size} bytes tagged {tag} (check={})",
                    check.name()
                ))
            }
            None => return Err(format!("asked for a {reply_size}-byte reply payload, got none")),
        }
    }
    Ok(())
}

/// One `delegate_read` call: ask the server for a token of a range holding
/// the payload tagged `tag` (not timed: a delegate is handed its token by
/// someone else), then redeem it, READ the range and release it (timed;
/// the payload's check between the two is not).
async fn delegate_read<N: Nic>(
    conn: &Connection<N>,
    case: &Case,
    tag: u8,
    hist: &Mutex<Histogram<u64>>,
) -> Result<(), String> {
    let (size, check) = (case.size, case.check);
    let asked = conn
        .call(&Ask::Delegate { size, tag, check }.encode(), None)
        .await
        .map_err(|e| format!("asking for a token: {e}"))?;
    if asked.status != cases::STATUS_OK {
        let why = String::from_utf8_lossy(&asked.header);
        return Err(format!(
            "the server delegated nothing (status {}: {}){}",
            asked.status,
            if why.is_empty() { "bad request" } else { &why },
            if asked.status == cases::STATUS_BAD_REQUEST {
                "; is it a mwcap serve older than delegate_read, or the size above its --max-payload?"
            } else {
                ""
            }
        ));
    }
    // The token is the reply's payload, or its header when no buffer
    // holds it.
    let token = match asked.data {
        Some(given) => {
            let token = Token::from_bytes(&given[..]);
            conn.free(given);
            token
        }
        None => Token::from_bytes(&asked.header[..]),
    }
    .map_err(|e| format!("the server's reply: {e}"))?;
    let t0 = Instant::now();
    let reply = conn.redeem(&token).await.map_err(|e| format!("redeeming the token: {e}"))?;
    let read = t0.elapsed();
    let data = reply.data.ok_or("a redeemed token came back without the range")?;
    let ok = check.passes(&data, size, tag);
    let t1 = Instant::now();
    conn.free(data);
    hist.lock().saturating_record((read + t1.elapsed()).as_nanos() as u64);
    if !ok {
        return Err(format!(
            "the delegated range read is not this call's {size} bytes tagged {tag} (check={})",
            check.name()
        ));
    }
    Ok(())
}

/// The server process's allocation count (asked for over the connection).
async fn server_allocs<N: Nic>(conn: &Connection<N>) -> Result<u64, String> {
    let r = conn
        .call(&Ask::Allocs.encode(), None)
        .await
        .map_err(|e| format!("asking the server's allocations: {e}"))?;
    if let Some(d) = r.data {
        conn.free(d);
    }
    let b: [u8; 8] =
        r.header[..].try_into().map_err(|_| "the server's allocation count is malformed".to_string())?;
    Ok(u64::from_le_bytes(b))
}

/// `calls` calls of `case`, `case.inflight` at a time. The join is built
/// here, at once (its one allocation), and its output is `()`, so that
/// awaiting it allocates nothing more.
fn batch<'a, N: Nic>(
    conn: &'a Connection<N>,
    case: &'a Case,
    calls: u32,
    tags: &'a AtomicU8,
    hist: &'a Mutex<Histogram<u64>>,
) -> impl Future<Output = Result<(), String>> + 'a {
    let n = case.inflight.max(1);
    try_join_all((0..n).map(move |k| {
        let share = calls / n + u32::from(k < calls % n);
        // Each caller starts its tags elsewhere, so that two calls in
        // flight rarely share one.
        let first_tag = tags.fetch_add(97, Relaxed).wrapping_add(97);
        caller(conn, case, share, first_tag, hist)
    }))
    .map_ok(|_| ())
}

/// Whether the server runs in this process (its allocations are counted here).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// In this process.
    Here,
    /// In another process: ask it for its count over the connection.
    Remote,
}

/// `calls` calls of `case` spread over `conns`, each keeping
/// `case.inflight` in flight. Built at once, like [`batch`]: the
/// allocations of the joins happen here, not while it is awaited.
fn spread<'a, N: Nic>(
    conns: &'a [Connection<N>],
    case: &'a Case,
    calls: u32,
    tags: &'a AtomicU8,
    hist: &'a Mutex<Histogram<u64>>,
) -> impl Future<Output = Result<(), String>> + 'a {
    let n = conns.len().max(1) as u32;
    let batches = conns.iter().enumerate().map(move |(i, c)| {
        let share = calls / n + u32::from((i as u32) < calls % n);
        batch(c, case, share, tags, hist)
    });
    try_join_all(batches).map_ok(|_| ())
}

/// Run `case` on connected clients: `warmup` calls, then `iters` calls
/// measured, spread over `conns`, `case.inflight` at a time on each.
pub async fn run_case<N: Nic>(
    conns: &[Connection<N>],
    case: &Case,
    iters: u32,
    warmup: u32,
    server: Server,
) -> Result<Measured, String> {
    let first = conns.first().ok_or("no connection")?;
    let tags = AtomicU8::new(0);
    let scratch = Mutex::new(cases::histogram());
    spread(conns, case, warmup, &tags, &scratch).await?;
    let hist = Mutex::new(cases::histogram());
    let remote0 = if server == Server::Remote { Some(server_allocs(first).await?) } else { None };
    let run = spread(conns, case, iters, &tags, &hist);
    let a0 = count::allocs();
    let t0 = Instant::now();
    run.await?;
    let elapsed = t0.elapsed();
    let local = count::allocs() - a0;
    let allocs = match remote0 {
        Some(r0) => local + server_allocs(first).await?.saturating_sub(r0),
        None => local,
    };
    Ok(Measured { hist: hist.into_inner(), elapsed, allocs: Some(allocs) })
}

/// Both sides of one connection in this process, each on an endpoint of
/// its own made by `builders` (client, server) and connected without TCP
/// (`Endpoint::prepare`) with `policies` and `cfgs` (client, server), under `executor`:
/// run `cases` and print a line for each.
#[allow(clippy::too_many_arguments)]
pub fn one_process<N: Nic + 'static>(
    builders: [EndpointBuilder<N>; 2],
    policies: Policies,
    cfgs: [Config; 2],
    cases: &[Case],
    iters: u32,
    warmup: u32,
    (executor, place): (Executor, Place),
    (mode, backend): (&'static str, &'static str),
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("setting up the {mode} connection: {e}");
    let [cb, sb] = builders;
    let [ccfg, scfg] = cfgs;
    let max_payload = scfg.large_buffers.iter().map(|c| c.size).max().unwrap_or(0).max(scfg.buffer_size);
    let (ce, cd) = cb.build().map_err(|e| err(&e))?;
    let (se, sd) = sb.build().map_err(|e| err(&e))?;
    let c = ce.prepare(Role::Client, policies, ccfg).map_err(|e| err(&e))?;
    // No bootstrap proves the client's key here: the server vouches for it,
    // so that delegate_read has an identity to delegate to.
    let s = se.prepare(Role::Server, policies, scfg).map_err(|e| err(&e))?.authenticated_as(BENCH_IDENTITY);
    let (cl, sl) = (c.local(), s.local());
    let client = c.connect(&sl).map_err(|e| err(&e))?;
    let server = s.connect(&cl).map_err(|e| err(&e))?;
    // The endpoint handles go now (the server's once it stops serving):
    // the drivers end once both connections have.
    drop(ce);
    let delegations = Delegations::new(se);
    let drivers: Vec<BoxFuture<'static, ()>> = vec![Box::pin(async move {
        cd.run().await;
    })];
    let labels = Labels { mode, backend, executor: executor.name(), server: place.name() };
    let server = (server, delegations);
    run_pair((executor, place), client, server, (drivers, sd), max_payload, cases, iters, warmup, labels)
}

/// Run `cases` over a client and a server connection in this process
/// under `executor`, with their endpoints' `drivers`, until both are
/// closed.
#[allow(clippy::too_many_arguments)]
fn run_pair<N: Nic + 'static>(
    (executor, place): (Executor, Place),
    client: Connection<N>,
    (server, delegations): (Connection<N>, Delegations<N>),
    (drivers, server_driver): (Vec<BoxFuture<'static, ()>>, EndpointDriver<N>),
    max_payload: u32,
    cases: &[Case],
    iters: u32,
    warmup: u32,
    labels: Labels,
) -> Result<(), String> {
    let cases = cases.to_vec();
    let app = {
        let server = server.clone();
        async move {
            let r = run_cases(std::slice::from_ref(&client), &cases, iters, warmup, Server::Here, labels, "")
                .await;
            client.close();
            server.close();
            r
        }
    };
    let srv = async move {
        let serving = async {
            let r = serve(&server, max_payload, &delegations).await;
            server.close();
            // Its endpoint handle goes with it, so that the driver can end.
            drop(delegations);
            r
        };
        let (r, _) = futures::future::join(serving, server_driver.run()).await;
        r
    };
    let (r, s) = executors::run(executor, place, app, srv, drivers)?;
    r?;
    s.map(|_| ())
}

/// Run `cases` on connected clients, printing a line for each (with
/// `extra` at its end: the connection figures).
pub async fn run_cases<N: Nic>(
    conns: &[Connection<N>],
    cases: &[Case],
    iters: u32,
    warmup: u32,
    server: Server,
    labels: Labels,
    extra: &str,
) -> Result<(), String> {
    for case in cases {
        let m = run_case(conns, case, iters, warmup, server).await.map_err(|e| {
            format!(
                "case {} policy {} size {} inflight {}: {e}",
                case.name(),
                case.policy_name(),
                case.size,
                case.inflight
            )
        })?;
        println!("{}{extra}", cases::line(case, labels, &m));
    }
    Ok(())
}
