//! The async face of an [`Endpoint`]: a [`Connection`] handle for the user
//! and one [`Driver`] future that runs the endpoint (house style: quinn's
//! `ConnectionDriver`). The driver works under any executor: it only needs
//! `async-io`'s timer, so tokio, smol, or `futures::executor::block_on` on a
//! plain thread all do.
//!
//! A call's result travels from the driver to the caller through a
//! [`Slot`](crate::handle::Slot). If the caller drops the call's future, the
//! driver sees the slot abandoned and cancels the call; a reply that had
//! already arrived comes back through the [`Recycle`](crate::handle::Recycle)
//! queue and its buffer returns to the pool. The loom models in
//! `tests/loom_handle.rs` check that hand-over under every interleaving.

use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Buf, CallError, CallId, Endpoint, Event, LossReason, RequestId, UseError};
use crate::backend::Nic;
use crate::handle::{Handle, Recycle, Slot};

/// A reply to a call.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    /// The server's status byte.
    pub status: u8,
    /// The reply header.
    pub header: Vec<u8>,
    /// The reply payload; give it back with [`Connection::free`].
    pub data: Option<Buf>,
}

/// A request received by a server.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// Name it in [`Connection::reply`].
    pub id: RequestId,
    /// The request header.
    pub header: Vec<u8>,
    /// The request payload; give it back with [`Connection::free`].
    pub data: Option<Buf>,
}

type CallResult = Result<Reply, CallError>;

struct State<N: Nic> {
    ep: Endpoint<N>,
    calls: HashMap<CallId, Arc<Slot<CallResult>>>,
    requests: VecDeque<Request>,
    returned: VecDeque<Buf>,
    waiters: Vec<Waker>,
    driver: Option<Waker>,
    /// The user did something the driver should look at now.
    kicked: bool,
    down: Option<LossReason>,
}

struct Inner<N: Nic> {
    state: Mutex<State<N>>,
    recycle: Arc<Recycle<CallResult>>,
    epoch: Instant,
}

impl<N: Nic> Inner<N> {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }
}

/// The user's handle on a connection. Cheap to clone.
pub struct Connection<N: Nic> {
    inner: Arc<Inner<N>>,
}

impl<N: Nic> Clone for Connection<N> {
    fn clone(&self) -> Self {
        Connection { inner: self.inner.clone() }
    }
}

/// The future that runs a connection; spawn it (or poll it alongside the
/// user's work). It finishes when the connection is down, with the reason.
pub struct Driver<N: Nic> {
    inner: Arc<Inner<N>>,
}

impl<N: Nic> Connection<N> {
    /// Wrap a connected endpoint.
    pub fn new(ep: Endpoint<N>) -> (Connection<N>, Driver<N>) {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                ep,
                calls: HashMap::new(),
                requests: VecDeque::new(),
                returned: VecDeque::new(),
                waiters: Vec::new(),
                driver: None,
                kicked: false,
                down: None,
            }),
            recycle: Recycle::new(),
            epoch: Instant::now(),
        });
        (Connection { inner: inner.clone() }, Driver { inner })
    }

    fn with<T>(&self, f: impl FnOnce(&mut State<N>) -> T) -> T {
        let mut st = self.inner.state.lock();
        let out = f(&mut st);
        st.kicked = true;
        if let Some(w) = st.driver.take() {
            w.wake();
        }
        out
    }

    /// Take a free buffer from the pool.
    pub fn alloc(&self) -> Option<Buf> {
        self.with(|s| s.ep.alloc())
    }
    /// Fill a buffer.
    pub fn write(&self, buf: &mut Buf, bytes: &[u8]) -> Result<(), UseError> {
        self.with(|s| s.ep.write(buf, bytes))
    }
    /// Read a buffer.
    pub fn read(&self, buf: &Buf) -> Result<Vec<u8>, UseError> {
        self.with(|s| s.ep.read(buf))
    }
    /// Return a buffer to the pool.
    pub fn free(&self, buf: Buf) {
        self.with(|s| s.ep.free(buf))
    }

    /// Buffers the NIC gave back (request or reply payloads whose exposure ended).
    pub fn take_returned(&self) -> Vec<Buf> {
        self.with(|s| s.returned.drain(..).collect())
    }

    /// Client: make a call and wait for its reply. Dropping the future
    /// cancels the call; its buffers still return only on evidence.
    pub async fn call(&self, header: &[u8], data: Option<Buf>) -> Result<Reply, CallError> {
        let now = self.inner.now();
        let slot = Slot::new();
        let started = self.with(|s| {
            let id = s.ep.call(now, header, data)?;
            s.calls.insert(id, slot.clone());
            Ok::<_, UseError>(id)
        });
        if let Err(e) = started {
            return Err(match e {
                UseError::Down(r) => CallError::ConnectionLost(r),
                other => CallError::Payload(other.to_string()),
            });
        }
        Handle::new(slot, self.inner.recycle.clone()).await
    }

    /// Server: the next request, or `None` once the connection is down.
    pub async fn next_request(&self) -> Option<Request> {
        poll_fn(|cx| {
            let mut st = self.inner.state.lock();
            if let Some(r) = st.requests.pop_front() {
                return Poll::Ready(Some(r));
            }
            if st.down.is_some() {
                return Poll::Ready(None);
            }
            st.waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Server: answer a request.
    pub fn reply(&self, req: RequestId, status: u8, header: &[u8], data: Option<Buf>) -> Result<(), UseError> {
        let now = self.inner.now();
        self.with(|s| s.ep.reply(now, req, status, header, data))
    }

    /// Close: the QP is flushed and destroyed; every buffer returns.
    pub fn close(&self) {
        let now = self.inner.now();
        self.with(|s| s.ep.close(now));
    }
}

impl<N: Nic> State<N> {
    fn dispatch(&mut self, ev: Event) {
        match ev {
            Event::Reply { call, status, header, data } => self.finish(call, Ok(Reply { status, header, data })),
            Event::CallFailed { call, error } => self.finish(call, Err(error)),
            Event::Request { req, header, data } => {
                self.requests.push_back(Request { id: req, header, data });
                self.waiters.drain(..).for_each(Waker::wake);
            }
            Event::ReplyAgain { req } => {
                // Confirm policy: the client read a stale reply. The request
                // comes again (same id, empty header): reply with fresh data.
                self.requests.push_back(Request { id: req, header: Vec::new(), data: None });
                self.waiters.drain(..).for_each(Waker::wake);
            }
            Event::RequestDropped { req, error } => tracing::info!(?req, %error, "request dropped"),
            Event::BufferReturned(b) => self.returned.push_back(b),
            Event::ConnectionLost(r) => {
                self.down = Some(r);
                self.waiters.drain(..).for_each(Waker::wake);
            }
        }
    }

    fn finish(&mut self, call: CallId, result: CallResult) {
        match self.calls.remove(&call) {
            Some(slot) => {
                if let Err(Ok(reply)) = slot.fulfil(result) {
                    // The caller gave up: its reply buffer goes back to the pool.
                    if let Some(b) = reply.data {
                        self.ep.free(b);
                    }
                }
            }
            None => {
                if let Ok(Reply { data: Some(b), .. }) = result {
                    self.ep.free(b);
                }
            }
        }
    }
}

impl<N: Nic> Driver<N> {
    /// One turn: timers, completions, events, abandoned calls. Returns
    /// whether anything happened and when to wake up next.
    fn turn(&self) -> (bool, Option<Duration>, bool) {
        let inner = &self.inner;
        let now = inner.now();
        let mut st = inner.state.lock();
        if st.ep.poll_timeout().is_some_and(|t| t <= now) {
            st.ep.handle_timeout(now);
        }
        st.ep.drive(now);
        let abandoned: Vec<CallId> =
            st.calls.iter().filter(|(_, s)| s.is_abandoned()).map(|(id, _)| *id).collect();
        for id in &abandoned {
            st.calls.remove(id);
            st.ep.cancel(now, *id);
        }
        let mut any = !abandoned.is_empty();
        while let Some(ev) = st.ep.poll_event() {
            any = true;
            st.dispatch(ev);
        }
        for r in inner.recycle.drain() {
            any = true;
            if let Ok(Reply { data: Some(b), .. }) = r {
                st.ep.free(b);
            }
        }
        let finished = st.down.is_some() && st.calls.is_empty() && st.ep.busy_buffers() == 0;
        (any, st.ep.poll_timeout(), finished)
    }

    /// Run the connection until it is down and every buffer is back.
    pub async fn run(self) -> LossReason {
        let mut idle_for = 0u32;
        loop {
            let (any, next, finished) = self.turn();
            if finished {
                let st = self.inner.state.lock();
                return st.down.clone().unwrap_or(LossReason::Closed);
            }
            if any {
                idle_for = 0;
                futures::future::ready(()).await;
                continue;
            }
            // Nothing to do: sleep until the next timer, polling the CQ with
            // a backoff from 10 µs to 1 ms. (A CQ event channel would let
            // the verbs backend sleep on the fd instead.)
            idle_for = idle_for.saturating_add(1);
            let backoff = Duration::from_micros(10u64 << idle_for.min(7)).min(Duration::from_millis(1));
            let now = self.inner.now();
            let wait = next.map_or(backoff, |t| t.saturating_sub(now).min(backoff));
            let timer = async_io::Timer::after(wait);
            let kicked = poll_fn(|cx| {
                let mut st = self.inner.state.lock();
                if std::mem::take(&mut st.kicked) {
                    return Poll::Ready(());
                }
                st.driver = Some(cx.waker().clone());
                Poll::Pending
            });
            futures::pin_mut!(kicked);
            futures::future::select(timer, kicked).await;
        }
    }
}
