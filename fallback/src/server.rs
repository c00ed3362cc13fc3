//! The server engine: owner in direction 1 (offers reply data), reader in
//! direction 2 (READs request data, then asks the client whether it is alive).

use std::collections::VecDeque;
use std::time::Duration;

use crate::ids::{BufferId, Generation, MsgId, ReadToken, Region};
use crate::output::{Action, Config, Event, ReadError, ReadRequest, Release, UsageError};
use crate::owner::Owner;
use crate::read::{Exposure, Reads};
use crate::sorted::SortedDeque;
use crate::wire::Message;

/// A direction-2 request being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Incoming {
    exposure: Exposure,
    /// The exposure arrived at `deadline - confirm_timeout`: its READ and
    /// the client's answer to the confirm are due by then.
    deadline: Duration,
    /// The READ completed and the confirm went out.
    confirming: bool,
}

/// The server side of one connection.
///
/// Direction 1: on a client's `Fetch` it reports [`Event::ReplyWanted`]; the
/// user writes the reply into a free buffer and calls [`Server::offer`]. The
/// buffer stays held until the client's confirm is answered `Intact` or
/// [`Config::hold_timeout`] passes; either way its generation moves on.
///
/// Direction 2: on a client's `Expose` it READs the request data, confirms,
/// and reports [`Event::ReadVerified`] (process the request) only if the
/// client answers `Intact`; otherwise the request is dropped with
/// [`ReadError::Withdrawn`]. There is no retry: `Reused` means the request
/// itself is gone. The READ and the answer are due within
/// [`Config::confirm_timeout`] of the exposure's arrival, however long the
/// READ waited for a destination: past it the request is dropped with
/// [`ReadError::ConfirmTimedOut`], so a burst of exposures holds the
/// reader's buffers for one such time, not one per round of buffers.
///
/// Call order: see the crate doc.
///
/// Every call is O(log n) amortized in the requests, READs and buffers it
/// tracks (sorted deques, mostly appended to and removed from the front),
/// except [`Server::handle_connection_lost`] (once per connection).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Server {
    config: Config,
    owner: Owner,
    /// The highest new message id seen (0: none). New ids must exceed it.
    last_msg: u64,
    /// Fetches reported in a `ReplyWanted` and not yet offered or refused,
    /// with their attempt. (A sorted deque, as message ids come in
    /// increasing: a `BTreeMap` here cost ~400 instructions a call.)
    wanted: SortedDeque<MsgId, u32>,
    incoming: SortedDeque<MsgId, Incoming>,
    /// The request each READ in flight belongs to (the incoming requests
    /// not confirming yet).
    reading: SortedDeque<ReadToken, MsgId>,
    /// `(deadline, msg)` of every incoming request, earliest first.
    deadlines: SortedDeque<(Duration, MsgId), ()>,
    reads: Reads,
    actions: VecDeque<Action>,
    events: VecDeque<Event>,
    lost: bool,
    violations: u64,
}

impl Server {
    /// A server for a new connection.
    pub fn new(config: Config) -> Server {
        Server {
            config,
            owner: Owner::default(),
            last_msg: 0,
            wanted: SortedDeque::default(),
            incoming: SortedDeque::default(),
            reading: SortedDeque::default(),
            deadlines: SortedDeque::default(),
            reads: Reads::default(),
            actions: VecDeque::new(),
            events: VecDeque::new(),
            lost: false,
            violations: 0,
        }
    }

    /// Makes room for `n` requests at once in its tables and queues (a
    /// connection gives one per buffer), so that the first burst of that
    /// many allocates nothing; more grow them.
    pub fn reserve(&mut self, n: usize) {
        self.wanted.reserve(n);
        self.incoming.reserve(n);
        self.reading.reserve(n);
        self.deadlines.reserve(n);
        self.actions.reserve(2 * n);
        self.events.reserve(2 * n);
    }

    /// Registers a buffer that replies may be offered from (direction 1): a
    /// range of a region registered with remote read in this connection's
    /// protection domain.
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

    /// Direction 1: offers `buffer[..len]`, already holding the reply, for the
    /// wanted `msg`. The buffer is exposed until its [`Event::BufferFree`]
    /// ([`Config::hold_timeout`] at the latest).
    pub fn offer(&mut self, now: Duration, msg: MsgId, buffer: BufferId, len: u32) -> Result<(), UsageError> {
        self.offer_within(now, msg, buffer, len, self.config.hold_timeout)
    }

    /// [`Server::offer`], held for at most `hold` (and at most
    /// [`Config::hold_timeout`]): an offer whose capability ends sooner (a
    /// delegation's token) ends with it, and a confirm after that is
    /// answered `Reused`.
    pub fn offer_within(
        &mut self,
        now: Duration,
        msg: MsgId,
        buffer: BufferId,
        len: u32,
        hold: Duration,
    ) -> Result<(), UsageError> {
        if self.lost {
            return Err(UsageError::ConnectionLost);
        }
        // One lookup instead of two: taken out now, put back if refused.
        let attempt = self.wanted.remove(&msg).ok_or(UsageError::NotWanted(msg))?;
        let deadline = now.saturating_add(hold.min(self.config.hold_timeout));
        let (generation, region) = match self.owner.hold(buffer, len, msg, deadline) {
            Ok(exposed) => exposed,
            Err(e) => {
                self.wanted.insert(msg, attempt);
                return Err(e);
            }
        };
        self.actions.push_back(Action::Send(Message::Offer { msg, buffer, generation, region }));
        self.check_indexes();
        Ok(())
    }

    /// Direction 1: withdraws the offer held for `msg` before the client
    /// confirmed its READ (the capability it carried was revoked). The
    /// hold ends now ([`Event::BufferFree`] with [`Release::Withdrawn`]):
    /// the buffer's generation moves on, so the client's confirm is
    /// answered `Reused` and what it read is discarded, never returned;
    /// the client then wants the reply again ([`Event::ReplyWanted`]).
    /// Whether an offer was held for `msg` (`false`: confirmed, expired or
    /// never made; nothing changes).
    pub fn withdraw(&mut self, now: Duration, msg: MsgId) -> bool {
        let _ = now;
        self.owner.release_msg(msg, Release::Withdrawn, &mut self.events)
    }

    /// [`Server::withdraw`] of the offer `buffer` is held for, if any.
    pub fn withdraw_buffer(&mut self, now: Duration, buffer: BufferId) -> bool {
        match self.owner.holder(buffer) {
            Some(msg) => self.withdraw(now, msg),
            None => false,
        }
    }

    /// Direction 1: drops the wanted `msg` without a word to the client,
    /// which learns of the refusal another way (the driver's own flow
    /// control, see [`crate::Client::refused`]).
    pub fn forget_wanted(&mut self, now: Duration, msg: MsgId) -> Result<(), UsageError> {
        let _ = now;
        self.wanted.remove(&msg).ok_or(UsageError::NotWanted(msg))?;
        self.check_indexes();
        Ok(())
    }

    /// Direction 1: declines the wanted `msg` (the client's fetch fails with
    /// [`ReadError::Refused`]).
    pub fn refuse(&mut self, now: Duration, msg: MsgId) -> Result<(), UsageError> {
        let _ = now;
        if self.lost {
            return Err(UsageError::ConnectionLost);
        }
        self.wanted.remove(&msg).ok_or(UsageError::NotWanted(msg))?;
        self.actions.push_back(Action::Send(Message::Refuse { msg }));
        Ok(())
    }

    fn outstanding(&self) -> usize {
        self.wanted.len() + self.incoming.len()
    }

    /// A message from the client.
    pub fn handle_message(&mut self, now: Duration, message: Message) {
        if self.lost {
            return;
        }
        self.on_message(now, message);
        self.check_indexes();
    }

    fn on_message(&mut self, now: Duration, message: Message) {
        match message {
            Message::Fetch { msg, attempt } => self.on_fetch(msg, attempt),
            Message::Expose { msg, buffer, generation, region } => {
                self.on_expose(now, msg, buffer, generation, region)
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
            Message::ConfirmReply { msg, buffer, generation, verdict } => {
                let matches = self.incoming.get(&msg).is_some_and(|i| {
                    i.confirming && (i.exposure.buffer, i.exposure.generation) == (buffer, generation)
                });
                if !matches {
                    self.violations += 1;
                    return;
                }
                let Some(inc) = self.remove_incoming(msg) else { return };
                let e = inc.exposure;
                if verdict.is_intact() {
                    self.events.push_back(Event::ReadVerified { msg, token: e.token, len: e.len });
                } else {
                    self.events.push_back(Event::ReadDiscarded { token: e.token });
                    self.events.push_back(Event::ReadFailed { msg, error: ReadError::Withdrawn });
                }
            }
            Message::Refuse { msg } => self.on_refuse(msg),
            Message::Offer { .. } => self.violations += 1,
        }
    }

    /// The client no longer wants the reply of `msg` (its fetch was
    /// cancelled or timed out): forget the wanted reply (a later `offer`
    /// gets [`UsageError::NotWanted`](crate::UsageError::NotWanted)) and
    /// release a buffer offered for it, with [`Release::Refused`].
    fn on_refuse(&mut self, msg: MsgId) {
        let wanted = self.wanted.remove(&msg).is_some();
        let held = self.owner.release_msg(msg, Release::Refused, &mut self.events);
        if !wanted && !held && (msg.raw() == 0 || msg.raw() > self.last_msg) {
            // A refusal of a message never asked for. (One that is already
            // over, e.g. confirmed as the Refuse crossed it, is harmless.)
            self.violations += 1;
        }
    }

    fn on_fetch(&mut self, msg: MsgId, attempt: u32) {
        let fresh = attempt == 1 && msg.raw() > self.last_msg;
        let retry = attempt > 1
            && attempt <= self.config.max_attempts
            && msg.raw() != 0
            && msg.raw() <= self.last_msg
            && !self.wanted.contains_key(&msg)
            && !self.incoming.contains_key(&msg);
        if !fresh && !retry {
            self.violations += 1;
            return;
        }
        if fresh {
            self.last_msg = msg.raw();
        }
        if self.outstanding() >= self.config.max_outstanding {
            self.actions.push_back(Action::Send(Message::Refuse { msg }));
            return;
        }
        self.wanted.insert(msg, attempt);
        self.events.push_back(Event::ReplyWanted { msg, attempt });
    }

    fn on_expose(
        &mut self,
        now: Duration,
        msg: MsgId,
        buffer: BufferId,
        generation: Generation,
        region: Region,
    ) {
        if msg.raw() <= self.last_msg {
            self.violations += 1;
            return;
        }
        self.last_msg = msg.raw();
        if self.outstanding() >= self.config.max_outstanding || region.len() > self.config.max_read_len {
            self.actions.push_back(Action::Send(Message::Refuse { msg }));
            return;
        }
        let token = self.reads.token();
        let exposure = Exposure { token, buffer, generation, len: region.len() };
        let deadline = now.saturating_add(self.config.confirm_timeout);
        self.incoming.insert(msg, Incoming { exposure, deadline, confirming: false });
        self.deadlines.insert((deadline, msg), ());
        self.reading.insert(token, msg);
        self.actions.push_back(Action::Read(ReadRequest::new(token, region)));
    }

    /// The completion of the READ `token` (`success`: status was success).
    /// Also call it for flushed READs after a connection loss.
    pub fn handle_read_completion(&mut self, now: Duration, token: ReadToken, success: bool) {
        if self.reads.complete_orphan(token, &mut self.events) {
            return;
        }
        let Some(msg) = self.reading.remove(&token) else { return };
        let Some(inc) = self.incoming.get_mut(&msg) else { return };
        debug_assert!(!inc.confirming && inc.exposure.token == token);
        if success && now < inc.deadline {
            // Only now, with the bytes landed, may the client be asked.
            inc.confirming = true;
            let Exposure { buffer, generation, .. } = inc.exposure;
            self.actions.push_back(Action::Send(Message::Confirm { msg, buffer, generation }));
        } else {
            // Failed, or landed too late for an answer (a driver that took
            // its timeout late): the request ends here.
            self.remove_incoming(msg);
            self.events.push_back(Event::ReadDiscarded { token });
            let error = if success {
                self.actions.push_back(Action::Send(Message::Refuse { msg }));
                ReadError::ConfirmTimedOut
            } else {
                ReadError::ReadFailed
            };
            self.events.push_back(Event::ReadFailed { msg, error });
        }
        self.check_indexes();
    }

    /// Fires every deadline at or before `now`: incoming requests in
    /// message order (a READ still in flight, or never posted, gives its
    /// destination back on its completion; the client is sent a `Refuse`,
    /// so that its buffer comes back at once rather than at its own
    /// timeout), then offered buffers in buffer order.
    pub fn handle_timeout(&mut self, now: Duration) {
        let due = self.deadlines.due(now);
        for msg in due {
            if let Some(inc) = self.remove_incoming(msg) {
                self.reads.abandon(inc.exposure.token, inc.confirming, &mut self.events);
                self.events.push_back(Event::ReadFailed { msg, error: ReadError::ConfirmTimedOut });
                self.actions.push_back(Action::Send(Message::Refuse { msg }));
            }
        }
        self.owner.expire(now, &mut self.events);
        self.check_indexes();
    }

    /// Forgets an incoming request, and its entries in the indexes.
    fn remove_incoming(&mut self, msg: MsgId) -> Option<Incoming> {
        let inc = self.incoming.remove(&msg)?;
        if !inc.confirming {
            self.reading.remove(&inc.exposure.token);
        }
        self.deadlines.remove(&(inc.deadline, msg));
        Some(inc)
    }

    /// When the request of READ `token` is due: its READ and the client's
    /// answer to the confirm must be in by then. A driver whose READ waited
    /// for a destination need not start it with too little time left (the
    /// request ends at this deadline, and the READ is withdrawn then).
    /// `None` for a READ not in flight.
    pub fn read_deadline(&self, token: ReadToken) -> Option<Duration> {
        let msg = self.reading.get(&token)?;
        self.incoming.get(msg).map(|i| i.deadline)
    }

    /// The driver never posted READ `token` (it waited for a destination).
    /// If its request is over (its time ran out, or the connection was
    /// lost), the READ is forgotten and true returned: do not post it, and
    /// no event names it. False while the READ is still wanted, and for a
    /// READ posted: one posted must be handed in by its completion.
    pub fn withdraw_read(&mut self, token: ReadToken) -> bool {
        self.reads.forget_orphan(token)
    }

    /// The queue pair went to error (or was destroyed): every request fails,
    /// every offered buffer returns. READs still in flight return their
    /// destinations when their flush completions are handed in.
    pub fn handle_connection_lost(&mut self, now: Duration) {
        let _ = now;
        self.lost = true;
        self.wanted = SortedDeque::default();
        let incoming = std::mem::take(&mut self.incoming);
        self.reading = SortedDeque::default();
        self.deadlines = SortedDeque::default();
        for (msg, inc) in incoming.into_entries() {
            self.reads.abandon(inc.exposure.token, inc.confirming, &mut self.events);
            self.events.push_back(Event::ReadFailed { msg, error: ReadError::ConnectionLost });
        }
        self.owner.release_all(Release::ConnectionLost, &mut self.events);
        self.check_indexes();
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

    /// When to call [`Server::handle_timeout`] next, if ever.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let confirms = self.deadlines.first().map(|(&(deadline, _), ())| deadline);
        match (confirms, self.owner.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The generation `buffer` will be (or is) exposed at; `None` if unknown or retired.
    pub fn buffer_generation(&self, buffer: BufferId) -> Option<Generation> {
        self.owner.generation(buffer)
    }

    /// Whether `buffer` is the user's (not offered, not retired).
    pub fn is_buffer_free(&self, buffer: BufferId) -> bool {
        self.owner.is_free(buffer)
    }

    /// Nothing outstanding: no wanted reply, no request being read, no READ in
    /// flight, no offered buffer.
    pub fn is_idle(&self) -> bool {
        self.wanted.is_empty()
            && self.incoming.is_empty()
            && self.reads.orphans() == 0
            && self.owner.held() == 0
    }

    /// Whether the client's request `msg` was taken: its data is being read,
    /// or waits for the client's answer to its confirm. False for an
    /// exposure that was refused (too long, too many outstanding) or
    /// ignored (a message id already used), and once the request is over.
    pub fn is_reading(&self, msg: MsgId) -> bool {
        self.incoming.contains_key(&msg)
    }

    /// Whether [`Server::handle_connection_lost`] was called.
    pub fn is_connection_lost(&self) -> bool {
        self.lost
    }

    /// How many client messages did not fit the protocol and were ignored. A
    /// driver may close a connection whose peer misbehaves.
    pub fn peer_violations(&self) -> u64 {
        self.violations
    }

    /// Debug builds: the indexes agree with the incoming requests
    /// (O(requests), so not in release builds).
    fn check_indexes(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let reading =
            self.incoming.iter().filter(|(_, i)| !i.confirming).map(|(&m, i)| (i.exposure.token, m));
        assert!(self.reading.holds_exactly(reading), "READs by token");
        let deadlines = self.incoming.iter().map(|(&m, i)| ((i.deadline, m), ()));
        assert!(self.deadlines.holds_exactly(deadlines), "deadlines");
    }
}

#[cfg(test)]
mod tests;
