//! The client engine: reader in direction 1 (fetches reply data), owner in
//! direction 2 (exposes request data).

use std::collections::VecDeque;
use std::time::Duration;

use crate::ids::{BufferId, Generation, MsgId, ReadToken, Region};
use crate::output::{Action, Config, Event, ReadError, ReadRequest, Release, UsageError};
use crate::owner::Owner;
use crate::read::{Exposure, Reads};
use crate::sorted::SortedDeque;
use crate::wire::Message;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// `Fetch` sent, waiting for the server's offer.
    AwaitOffer,
    /// READ posted, waiting for its completion.
    Reading(Exposure),
    /// READ completed, `Confirm` sent, waiting for the verdict.
    Confirming(Exposure),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Fetch {
    attempt: u32,
    max_len: u32,
    deadline: Duration,
    phase: Phase,
}

/// The client side of one connection.
///
/// Direction 1 ([`Client::fetch`]): asks the server for reply data, READs the
/// offered buffer, confirms, and reports [`Event::ReadVerified`] only on an
/// `Intact` verdict; a stale read is discarded and fetched again, at most
/// [`Config::max_attempts`] times.
///
/// Direction 2 ([`Client::send_request`]): exposes a request buffer for the
/// server to READ and answers the server's confirm `Intact` only while the
/// request is alive: exposed, not cancelled, not timed out.
///
/// Call order: see the crate doc.
///
/// Every call is O(log n) amortized in the fetches, READs and buffers it
/// tracks (sorted deques, mostly appended to and removed from the front),
/// except [`Client::handle_connection_lost`] (once per connection).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    config: Config,
    owner: Owner,
    /// The last message id handed out (0: none yet).
    last_msg: u64,
    fetches: SortedDeque<MsgId, Fetch>,
    /// `(deadline, msg)` of every fetch, earliest first.
    deadlines: SortedDeque<(Duration, MsgId), ()>,
    /// The fetch each READ in flight belongs to (the fetches in
    /// `Phase::Reading`).
    reading: SortedDeque<ReadToken, MsgId>,
    reads: Reads,
    actions: VecDeque<Action>,
    events: VecDeque<Event>,
    lost: bool,
    violations: u64,
}

impl Client {
    /// A client for a new connection.
    pub fn new(config: Config) -> Client {
        Client {
            config,
            owner: Owner::default(),
            last_msg: 0,
            fetches: SortedDeque::default(),
            deadlines: SortedDeque::default(),
            reading: SortedDeque::default(),
            reads: Reads::default(),
            actions: VecDeque::new(),
            events: VecDeque::new(),
            lost: false,
            violations: 0,
        }
    }

    /// Makes room for `n` fetches and exposures at once in its tables and
    /// queues (a connection gives one per buffer), so that the first burst
    /// of that many allocates nothing; more grow them.
    pub fn reserve(&mut self, n: usize) {
        self.fetches.reserve(n);
        self.deadlines.reserve(n);
        self.reading.reserve(n);
        self.actions.reserve(2 * n);
        self.events.reserve(2 * n);
    }

    /// Registers a buffer that requests may expose (direction 2): a range of a
    /// region registered with remote read in this connection's protection domain.
    pub fn add_buffer(&mut self, region: Region) -> BufferId {
        self.owner.add(region)
    }

    /// Points a free buffer at another region of memory registered with
    /// remote read in this connection's protection domain (to expose a range
    /// of the user's own memory, one range at a time). Its generation moves
    /// on: a confirm of the old region is answered `Reused`.
    pub fn set_buffer_region(&mut self, buffer: BufferId, region: Region) -> Result<(), UsageError> {
        self.owner.set_region(buffer, region)
    }

    fn next_msg(&mut self) -> Result<MsgId, UsageError> {
        if self.lost {
            return Err(UsageError::ConnectionLost);
        }
        let next = self.last_msg.checked_add(1).ok_or(UsageError::MsgIdsExhausted)?;
        Ok(MsgId::from_raw(next))
    }

    /// Direction 1: asks the server for the reply data of a new request, at
    /// most `max_len` bytes (and at most [`Config::max_read_len`]). Ends with
    /// exactly one [`Event::ReadVerified`] or [`Event::ReadFailed`] for the
    /// returned id.
    pub fn fetch(&mut self, now: Duration, max_len: u32) -> Result<MsgId, UsageError> {
        let msg = self.next_msg()?;
        self.last_msg = msg.raw();
        let fetch = Fetch {
            attempt: 1,
            max_len: max_len.min(self.config.max_read_len),
            deadline: now.saturating_add(self.config.request_timeout),
            phase: Phase::AwaitOffer,
        };
        self.fetches.insert(msg, fetch);
        self.deadlines.insert((fetch.deadline, msg), ());
        self.actions.push_back(Action::Send(Message::Fetch { msg, attempt: 1 }));
        self.check_indexes();
        Ok(msg)
    }

    /// Direction 2: exposes `buffer[..len]` as the data of a new request. The
    /// buffer comes back with exactly one [`Event::BufferFree`] for the
    /// returned id: `Confirmed` once the server has the data, or why not.
    pub fn send_request(&mut self, now: Duration, buffer: BufferId, len: u32) -> Result<MsgId, UsageError> {
        let msg = self.next_msg()?;
        let deadline = now.saturating_add(self.config.request_timeout);
        let (generation, region) = self.owner.hold(buffer, len, msg, deadline)?;
        self.last_msg = msg.raw();
        self.actions.push_back(Action::Send(Message::Expose { msg, buffer, generation, region }));
        Ok(msg)
    }

    /// Cancels a fetch (reported as [`ReadError::Cancelled`]; a `Refuse`
    /// tells the server at once, so it drops the wanted reply or releases
    /// the buffer it offered instead of holding it until `hold_timeout`) or
    /// an exposed request (its buffer returns with [`Release::Cancelled`];
    /// from now on the server's confirm gets `Reused`). Returns whether
    /// `msg` was live.
    pub fn cancel(&mut self, now: Duration, msg: MsgId) -> bool {
        let _ = now;
        let live = if self.fetches.contains_key(&msg) {
            self.end_fetch(msg, ReadError::Cancelled);
            true
        } else {
            self.owner.release_msg(msg, Release::Cancelled, &mut self.events)
        };
        self.check_indexes();
        live
    }

    /// The server refused the request `msg` rode on outside this protocol
    /// (the driver's own flow control), so it never saw the fetch: end it
    /// as [`ReadError::Refused`], telling the server nothing. False if no
    /// such fetch is in progress.
    pub fn refused(&mut self, now: Duration, msg: MsgId) -> bool {
        let _ = now;
        if !self.fetches.contains_key(&msg) {
            return false;
        }
        self.end_fetch(msg, ReadError::Refused);
        self.check_indexes();
        true
    }

    /// A message from the server.
    pub fn handle_message(&mut self, now: Duration, message: Message) {
        let _ = now;
        if self.lost {
            return;
        }
        self.on_message(message);
        self.check_indexes();
    }

    fn on_message(&mut self, message: Message) {
        match message {
            Message::Offer { msg, buffer, generation, region } => {
                self.on_offer(msg, buffer, generation, region)
            }
            Message::ConfirmReply { msg, buffer, generation, verdict } => {
                let Some(fetch) = self.fetches.get_mut(&msg) else {
                    self.violations += 1;
                    return;
                };
                let Phase::Confirming(e) = fetch.phase else {
                    self.violations += 1;
                    return;
                };
                if (e.buffer, e.generation) != (buffer, generation) {
                    self.violations += 1;
                    return;
                }
                if verdict.is_intact() {
                    self.remove_fetch(msg);
                    self.events.push_back(Event::ReadVerified { msg, token: e.token, len: e.len });
                } else if fetch.attempt < self.config.max_attempts {
                    // Stale: throw the bytes away and ask for a fresh offer.
                    fetch.attempt += 1;
                    fetch.phase = Phase::AwaitOffer;
                    let attempt = fetch.attempt;
                    self.events.push_back(Event::ReadDiscarded { token: e.token });
                    self.actions.push_back(Action::Send(Message::Fetch { msg, attempt }));
                } else {
                    let attempts = fetch.attempt;
                    self.end_fetch(msg, ReadError::StaleRetriesExhausted { attempts });
                }
            }
            Message::Confirm { msg, buffer, generation } => {
                let verdict = self.owner.answer(msg, buffer, generation, &mut self.events);
                self.actions.push_back(Action::Send(Message::ConfirmReply {
                    msg,
                    buffer,
                    generation,
                    verdict,
                }));
            }
            Message::Refuse { msg } => {
                if self.fetches.contains_key(&msg) {
                    self.end_fetch(msg, ReadError::Refused);
                } else if !self.owner.release_msg(msg, Release::Refused, &mut self.events) {
                    self.violations += 1;
                }
            }
            Message::Fetch { .. } | Message::Expose { .. } => self.violations += 1,
        }
    }

    fn on_offer(&mut self, msg: MsgId, buffer: BufferId, generation: Generation, region: Region) {
        let Some(fetch) = self.fetches.get_mut(&msg) else {
            if msg.raw() == 0 || msg.raw() > self.last_msg {
                self.violations += 1;
            }
            // Otherwise the fetch already ended here (cancelled, timed out)
            // and its Refuse crossed this offer: the server releases the
            // buffer when the Refuse arrives. Nothing to read.
            return;
        };
        if fetch.phase != Phase::AwaitOffer {
            self.violations += 1;
            return;
        }
        if region.len() > fetch.max_len {
            let limit = fetch.max_len;
            self.end_fetch(msg, ReadError::TooLong { offered: region.len(), limit });
            return;
        }
        let token = self.reads.token();
        fetch.phase = Phase::Reading(Exposure { token, buffer, generation, len: region.len() });
        self.reading.insert(token, msg);
        self.actions.push_back(Action::Read(ReadRequest::new(token, region)));
    }

    /// The completion of the READ `token` (`success`: status was success).
    /// Also call it for flushed READs after a connection loss.
    pub fn handle_read_completion(&mut self, now: Duration, token: ReadToken, success: bool) {
        let _ = now;
        if self.reads.complete_orphan(token, &mut self.events) {
            return;
        }
        let Some(msg) = self.reading.remove(&token) else { return };
        let Some(fetch) = self.fetches.get_mut(&msg) else { return };
        let Phase::Reading(e) = fetch.phase else { return };
        debug_assert_eq!(e.token, token);
        // Completed either way: the NIC is done with the destination.
        fetch.phase = Phase::Confirming(e);
        if success {
            let Exposure { buffer, generation, .. } = e;
            self.actions.push_back(Action::Send(Message::Confirm { msg, buffer, generation }));
        } else {
            self.end_fetch(msg, ReadError::ReadFailed);
        }
        self.check_indexes();
    }

    /// Fires every deadline at or before `now`: fetches in message order,
    /// then exposed buffers in buffer order.
    pub fn handle_timeout(&mut self, now: Duration) {
        let due = self.deadlines.due(now);
        for msg in due {
            self.end_fetch(msg, ReadError::TimedOut);
        }
        self.owner.expire(now, &mut self.events);
        self.check_indexes();
    }

    /// The queue pair went to error (or was destroyed): every request fails,
    /// every exposed buffer returns. READs still in flight return their
    /// destinations when their flush completions are handed in.
    pub fn handle_connection_lost(&mut self, now: Duration) {
        let _ = now;
        self.lost = true;
        let all: Vec<MsgId> = self.fetches.iter().map(|(&m, _)| m).collect();
        for msg in all {
            self.end_fetch(msg, ReadError::ConnectionLost);
        }
        self.owner.release_all(Release::ConnectionLost, &mut self.events);
        self.check_indexes();
    }

    /// Forgets a fetch, and its entries in the indexes.
    fn remove_fetch(&mut self, msg: MsgId) -> Option<Fetch> {
        let fetch = self.fetches.remove(&msg)?;
        self.deadlines.remove(&(fetch.deadline, msg));
        if let Phase::Reading(e) = fetch.phase {
            self.reading.remove(&e.token);
        }
        Some(fetch)
    }

    fn end_fetch(&mut self, msg: MsgId, error: ReadError) {
        let Some(fetch) = self.remove_fetch(msg) else { return };
        match fetch.phase {
            Phase::AwaitOffer => {}
            Phase::Reading(e) => self.reads.abandon(e.token, false, &mut self.events),
            Phase::Confirming(e) => self.reads.abandon(e.token, true, &mut self.events),
        }
        // Tell the server when it may still hold something for this fetch (a
        // wanted reply, an offered buffer): it lets go at once. (The client
        // has no confirm timeout of its own: a fetch whose verdict never
        // comes ends by `TimedOut`.)
        let server_may_hold =
            matches!(error, ReadError::Cancelled | ReadError::TimedOut | ReadError::TooLong { .. });
        if server_may_hold && !self.lost {
            self.actions.push_back(Action::Send(Message::Refuse { msg }));
        }
        self.events.push_back(Event::ReadFailed { msg, error });
    }

    /// Whether actions or events wait to be polled (a driver with none
    /// skips polling).
    #[inline]
    pub fn has_output(&self) -> bool {
        !self.actions.is_empty() || !self.events.is_empty()
    }

    /// The next work request to post or message to send.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When to call [`Client::handle_timeout`] next, if ever.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let fetches = self.deadlines.first().map(|(&(deadline, _), ())| deadline);
        match (fetches, self.owner.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The generation `buffer` will be (or is) exposed at; `None` if unknown or retired.
    pub fn buffer_generation(&self, buffer: BufferId) -> Option<Generation> {
        self.owner.generation(buffer)
    }

    /// Whether `buffer` is the user's (not exposed, not retired).
    pub fn is_buffer_free(&self, buffer: BufferId) -> bool {
        self.owner.is_free(buffer)
    }

    /// The fetch the READ `token` belongs to, from its [`Action::Read`]
    /// until its completion is handled (a driver that has no destination
    /// for the READ yet can say which fetch waits for one).
    pub fn fetch_of_read(&self, token: ReadToken) -> Option<MsgId> {
        self.reading.get(&token).copied()
    }

    /// The driver never posted READ `token` (it waited for a destination).
    /// If its fetch is over (timed out, cancelled, the connection lost),
    /// the READ is forgotten and true returned: do not post it, and no
    /// event names it. False while the READ is still wanted, and for a
    /// READ posted: one posted must be handed in by its completion.
    pub fn withdraw_read(&mut self, token: ReadToken) -> bool {
        self.reads.forget_orphan(token)
    }

    /// Nothing outstanding: no fetch, no READ in flight, no exposed buffer.
    pub fn is_idle(&self) -> bool {
        self.fetches.is_empty() && self.reads.orphans() == 0 && self.owner.held() == 0
    }

    /// Whether [`Client::handle_connection_lost`] was called.
    pub fn is_connection_lost(&self) -> bool {
        self.lost
    }

    /// How many server messages did not fit the protocol and were ignored. A
    /// driver may close a connection whose peer misbehaves.
    pub fn peer_violations(&self) -> u64 {
        self.violations
    }

    /// Debug builds: the indexes agree with the fetches (O(fetches), so not
    /// in release builds).
    fn check_indexes(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let deadlines = self.fetches.iter().map(|(&m, f)| ((f.deadline, m), ()));
        assert!(self.deadlines.holds_exactly(deadlines), "fetch deadlines");
        let reading = self.fetches.iter().filter_map(|(&m, f)| match f.phase {
            Phase::Reading(e) => Some((e.token, m)),
            _ => None,
        });
        assert!(self.reading.holds_exactly(reading), "READs by token");
    }
}

#[cfg(test)]
mod tests;
