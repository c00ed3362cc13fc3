//! A client that reconnects by itself: [`Reconnecting`].
//!
//! The details are on [`Reconnecting`].

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

use super::{Connection, Endpoint, LossReason, SetupError};
use crate::backend::Nic;

/// How long to wait between failed connection attempts.
///
/// After the `n`th failure in a row (from 1) the wait is
/// `min(max, initial * multiplier^(n-1))`, less a random part of up to
/// `jitter` of it (`jitter` 0.5: between half and all of it).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Backoff {
    /// The wait after the first failure.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
    /// The factor from one wait to the next (at least 1).
    pub multiplier: u32,
    /// The share of each wait that is random, 0.0 to 1.0.
    pub jitter: f64,
    /// Give up after this many failures in a row (`None`: never).
    pub max_failures: Option<u32>,
}

impl Default for Backoff {
    /// 100 ms, doubling up to 10 s, half of it random, never giving up.
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
            multiplier: 2,
            jitter: 0.5,
            max_failures: None,
        }
    }
}

impl Backoff {
    /// `initial`, doubling up to `max`, half random, never giving up.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff { initial, max, ..Backoff::default() }
    }
    /// The same backoff with another share of randomness (clamped to 0..=1).
    pub fn jitter(self, jitter: f64) -> Backoff {
        Backoff { jitter: jitter.clamp(0.0, 1.0), ..self }
    }
    /// The same backoff, giving up after `n` failures in a row.
    pub fn max_failures(self, n: u32) -> Backoff {
        Backoff { max_failures: Some(n), ..self }
    }

    /// The wait after the `failures`th failure in a row, before jitter.
    pub fn ceiling(&self, failures: u32) -> Duration {
        let mut d = self.initial;
        for _ in 1..failures {
            d = d.saturating_mul(self.multiplier.max(1));
            if d >= self.max {
                return self.max;
            }
        }
        d.min(self.max)
    }

    /// The wait after the `failures`th failure in a row, jitter drawn from `rng`.
    pub fn delay(&self, failures: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(failures);
        let jitter = self.jitter.clamp(0.0, 1.0);
        ceiling.mul_f64(1.0 - jitter * rng.gen::<f64>())
    }
}

/// Why [`Reconnecting`] has no connection to give.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ReconnectError {
    /// The connection is down and being set up again.
    #[error("not connected (reconnecting, {failures} failed attempts so far); wait with connection() or try later")]
    Down {
        /// Failed attempts since the connection was last up.
        failures: u32,
        /// The last attempt's error, if one failed.
        #[source]
        last: Option<Arc<SetupError>>,
    },
    /// [`Backoff::max_failures`] attempts in a row failed; the wrapper stopped.
    #[error(
        "gave up after {failures} failed attempts in a row; check that the server runs and the key matches"
    )]
    GaveUp {
        /// Failed attempts in a row.
        failures: u32,
        /// The last attempt's error.
        #[source]
        last: Arc<SetupError>,
    },
    /// [`Reconnecting::stop`] was called.
    #[error("the reconnecting client was stopped")]
    Stopped,
}

/// What a [`Reconnecting`] client has done so far.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ReconnectStats {
    /// Connection attempts made.
    pub attempts: u64,
    /// Attempts that connected.
    pub connects: u64,
    /// Attempts that failed.
    pub failures: u64,
    /// Why the last connection went down.
    pub last_loss: Option<LossReason>,
    /// The waits slept since the connection was last up, in order: the
    /// last 32 of them (a server that refuses for days adds one a failure).
    pub waits: Vec<Duration>,
}

/// How many of its latest waits a [`Reconnecting`] client keeps
/// ([`ReconnectStats::waits`]).
const WAITS_KEPT: usize = 32;

struct State<N: Nic> {
    current: Option<Connection<N>>,
    failures_in_row: u32,
    last_error: Option<Arc<SetupError>>,
    finished: Option<ReconnectError>,
    stopped: bool,
    stats: ReconnectStats,
    /// Tasks in `connection()` and the supervisor sleeping in a backoff.
    waiters: Vec<Waker>,
}

impl<N: Nic> State<N> {
    fn wake(&mut self) {
        self.waiters.drain(..).for_each(Waker::wake);
    }

    /// The connection if it is up, else why there is none.
    fn get(&self) -> Result<Connection<N>, ReconnectError> {
        if let Some(c) = self.current.as_ref().filter(|c| c.is_down().is_none()) {
            return Ok(c.clone());
        }
        if let Some(e) = &self.finished {
            return Err(e.clone());
        }
        if self.stopped {
            return Err(ReconnectError::Stopped);
        }
        Err(ReconnectError::Down { failures: self.failures_in_row, last: self.last_error.clone() })
    }
}

/// A client that keeps a connection to one server up. Cheap to clone;
/// clones share the connection.
///
/// Once the connection is down, for whatever [`LossReason`], it connects
/// again at once through its [`Endpoint`], and after each failed attempt
/// waits as [`Backoff`] says (with jitter, so that the clients of a
/// restarted server do not come back in step). While it is down,
/// [`Reconnecting::current`] fails fast with [`ReconnectError::Down`] and
/// [`Reconnecting::connection`] waits for the next connection. Calls are
/// never retried: a call made on a connection that then goes down fails
/// with its own [`CallError`](super::CallError), and whether it is safe to
/// make it again is the caller's to know.
pub struct Reconnecting<N: Nic> {
    state: Arc<Mutex<State<N>>>,
}

impl<N: Nic> Clone for Reconnecting<N> {
    fn clone(&self) -> Self {
        Reconnecting { state: self.state.clone() }
    }
}

impl<N: Nic + 'static> Reconnecting<N> {
    /// A client of the server at `addr` whose connections `endpoint` makes
    /// ([`Endpoint::connect`]; they run on its driver, which must be
    /// spawned). Returns the handle and the future that connects and
    /// reconnects: spawn it. It ends when [`Reconnecting::stop`] is called
    /// or the backoff gives up.
    pub fn new(
        endpoint: Endpoint<N>,
        addr: SocketAddr,
        backoff: Backoff,
    ) -> (Reconnecting<N>, impl Future<Output = ReconnectError> + Send + 'static) {
        let state = Arc::new(Mutex::new(State {
            current: None,
            failures_in_row: 0,
            last_error: None,
            finished: None,
            stopped: false,
            stats: ReconnectStats::default(),
            waiters: Vec::new(),
        }));
        let handle = Reconnecting { state: state.clone() };
        let supervisor = async move {
            let mut rng = rand::rngs::SmallRng::from_entropy();
            let end = loop {
                if state.lock().stopped {
                    break ReconnectError::Stopped;
                }
                state.lock().stats.attempts += 1;
                let attempt = endpoint.connect(addr).await;
                match attempt {
                    Ok(conn) => {
                        {
                            let mut st = state.lock();
                            st.stats.connects += 1;
                            st.stats.waits.clear();
                            st.failures_in_row = 0;
                            st.last_error = None;
                            if st.stopped {
                                conn.close();
                            }
                            st.current = Some(conn.clone());
                            st.wake();
                        }
                        tracing::debug!(%addr, "reconnecting client: connected");
                        let reason = conn.closed().await;
                        tracing::debug!(%addr, %reason, "reconnecting client: connection down");
                        let mut st = state.lock();
                        st.current = None;
                        st.stats.last_loss = Some(reason);
                    }
                    Err(e) => {
                        let e = Arc::new(e);
                        tracing::debug!(%addr, error = %e, "reconnecting client: attempt failed");
                        let wait = {
                            let mut st = state.lock();
                            st.stats.failures += 1;
                            st.failures_in_row = st.failures_in_row.saturating_add(1);
                            st.last_error = Some(e.clone());
                            let failures = st.failures_in_row;
                            if backoff.max_failures.is_some_and(|m| failures >= m) {
                                break ReconnectError::GaveUp { failures, last: e };
                            }
                            let wait = backoff.delay(failures, &mut rng);
                            if st.stats.waits.len() >= WAITS_KEPT {
                                st.stats.waits.remove(0);
                            }
                            st.stats.waits.push(wait);
                            wait
                        };
                        sleep_unless_stopped(&state, wait).await;
                    }
                }
            };
            let mut st = state.lock();
            st.finished = Some(end.clone());
            st.wake();
            end
        };
        (handle, supervisor)
    }
}

/// Sleep for `wait`, or until `stop` is called.
async fn sleep_unless_stopped<N: Nic>(state: &Mutex<State<N>>, wait: Duration) {
    let mut timer = std::pin::pin!(async_io::Timer::after(wait));
    poll_fn(|cx| {
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        let mut st = state.lock();
        if st.stopped {
            return Poll::Ready(());
        }
        // (Once per waker: the timer wakes this task too, and each of its
        // wake-ups would add a clone until the waiters are woken.)
        if !st.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            st.waiters.push(cx.waker().clone());
        }
        Poll::Pending
    })
    .await;
}

impl<N: Nic> Reconnecting<N> {
    /// The connection if it is up; fails fast while it is down.
    pub fn current(&self) -> Result<Connection<N>, ReconnectError> {
        self.state.lock().get()
    }

    /// The connection, waiting while it is being set up again. Fails only
    /// once the wrapper stopped or gave up.
    pub async fn connection(&self) -> Result<Connection<N>, ReconnectError> {
        poll_fn(|cx| {
            let mut st = self.state.lock();
            match st.get() {
                Err(ReconnectError::Down { .. }) => {
                    if !st.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                        st.waiters.push(cx.waker().clone());
                    }
                    Poll::Pending
                }
                r => Poll::Ready(r),
            }
        })
        .await
    }

    /// Close the connection and stop reconnecting; the supervisor future
    /// ends with [`ReconnectError::Stopped`] once the connection is down.
    pub fn stop(&self) {
        let mut st = self.state.lock();
        st.stopped = true;
        if let Some(c) = &st.current {
            c.close();
        }
        st.wake();
    }

    /// What the client has done so far.
    pub fn stats(&self) -> ReconnectStats {
        self.state.lock().stats.clone()
    }
}
