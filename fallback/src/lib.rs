//! mwcap's confirm protocol: safe zero-copy RDMA READs on NICs without type-2
//! memory windows.
//!
//! A buffer owner hands out its registered region's own rkey; the reader READs
//! and, only after the READ completed successfully, asks the owner whether the
//! buffer was still held, unchanged, for that very exposure. A read the owner
//! cannot vouch for is discarded (and, for a fetch, retried a bounded number of
//! times). No stale read is ever reported as data. Only RDMA READ moves data.
//!
//! This crate is the protocol logic only, *sans-IO*: it never touches a NIC,
//! a socket or a clock, and carries `#![forbid(unsafe_code)]`. Time enters as
//! `now: Duration` since an epoch the driver picks (monotonic), so a virtual
//! clock, the simulated NIC or a model checker can drive it deterministically.
//! Both engines are `Clone + Eq + Hash` for the model checker
//! (`examples/model.rs`).
//!
//! # Engines and directions
//! One engine per connection side: [`Client`] and [`Server`].
//!
//! * **Direction 1**, the server owns reply data: client [`Client::fetch`] →
//!   `Fetch` → server user gets [`Event::ReplyWanted`], fills a free buffer,
//!   calls [`Server::offer`] → `Offer` → client READs → client `Confirm` →
//!   server `ConfirmReply` → client [`Event::ReadVerified`] (or discard and
//!   `Fetch` again with `attempt + 1`).
//! * **Direction 2**, the client owns request data: client
//!   [`Client::send_request`] → `Expose` → server READs → server `Confirm` →
//!   client answers `Intact` only while the request is alive → server
//!   [`Event::ReadVerified`]: process it (or [`ReadError::Withdrawn`]: drop it).
//!
//! # Call order
//! For each engine, from one task or thread:
//! 1. feed inputs as they happen, each with the current `now`:
//!    `handle_message` (a decoded SEND from the peer),
//!    `handle_read_completion` (a completion whose `wr_id` is a [`ReadToken`],
//!    flushed ones included), `handle_timeout` (when `poll_timeout`'s instant
//!    has passed), `handle_connection_lost` (the QP is in ERR or destroyed),
//!    and the local calls (`fetch`, `send_request`, `offer`, `refuse`, `cancel`;
//!    `Client::refused` and `Server::forget_wanted` when the driver's own
//!    flow control refused a request, and told the client, outside this
//!    protocol);
//! 2. then drain `poll_action` until `None`, carrying out each [`Action`] in
//!    order: [`Action::Read`] → `SendWr::Read` (signaled) with the token as
//!    `wr_id` into a destination of `remote().len()` bytes (a driver with no
//!    destination free may hold the READ back; before posting it later it
//!    asks `withdraw_read`, which forgets a READ whose request ended
//!    meanwhile); [`Action::Send`] → [`Message::encode`] into a `SendWr::Send`
//!    payload;
//! 3. drain `poll_event` until `None` and hand ownership back to the user as
//!    each [`Event`] says;
//! 4. re-arm the timer with `poll_timeout` (it may move earlier after any call).
//!
//! A READ destination belongs to the NIC from [`Action::Read`] until the same
//! token comes back in [`Event::ReadVerified`] (the user's data) or
//! [`Event::ReadDiscarded`] (reuse it) — never earlier, even when its request
//! timed out, was cancelled or lost its connection. An exposed buffer belongs
//! to the peer's READs until [`Event::BufferFree`]; the user must not write it
//! before (writing it then would be a reuse without a generation bump, which
//! no protocol can detect).
//!
//! # Generation rules
//! * Every buffer has a [`Generation`], starting at 0. Each exposure (offer or
//!   expose) uses the buffer's current generation; ending the exposure (for
//!   any [`Release`] reason) bumps it, before the buffer is handed back. So
//!   every (buffer, generation) names at most one exposure, and a buffer is
//!   rewritten only at a generation greater than any it was offered at.
//! * The owner answers a confirm of (msg, buffer, generation) **`Intact`**
//!   only if the buffer is held right now for that msg at that generation,
//!   and that answer ends the hold. Otherwise **`Reused`** if the generation
//!   is older than the buffer's current one, and **`Unknown`** if it is newer,
//!   the buffer id is unknown, or the current generation is not held for that
//!   msg. Readers treat `Unknown` as `Reused`.
//! * Consequently a replayed or duplicate confirm whose first copy got
//!   `Intact` now gets `Reused`, even if the buffer has not been rewritten
//!   yet: `Intact` is said at most once per exposure, and an answer is only
//!   ever about the present. A reader only waits for one verdict per offer and
//!   ignores verdicts it is not waiting for, so the later `Reused` is harmless;
//!   a forged or stale confirm can at worst end an exposure early (a spurious
//!   retry), never make a reused buffer look intact.
//! * Generations are 64-bit; a buffer that reaches `u64::MAX` is retired
//!   rather than wrapped.
//!
//! # Message ids
//! * A [`MsgId`] names one logical request on one connection. The client
//!   allocates them from 1, strictly increasing across fetches and exposed
//!   requests, and never reuses one; the server rejects a new `Fetch` or
//!   `Expose` whose id is not above every id seen (RC delivers in order).
//! * A fetch's retries keep its id and count `attempt` up; each attempt gets a
//!   fresh offer, so a fresh (buffer, generation).
//! * Confirms are matched by (connection, msg, buffer, generation): the
//!   connection is the engine instance (one per QP), so an id from another
//!   connection matches nothing. Verdicts are matched the same way on the
//!   reader side; anything unmatched is counted in `peer_violations` and ignored.
//!
//! # Why reuse during a READ is safe here
//! The owner may take a buffer back (hold timeout, cancel) while a READ of it
//! is still in flight; that READ may then return bytes of a later generation,
//! or a mix. This is safe because the reader confirms only after the READ's
//! completion, so every byte was sampled before the confirm was sent; if the
//! owner says `Intact`, the hold covered offer → answer, hence the whole
//! sampling, and the bytes are the offered ones. If the hold ended at any
//! point before the answer, the generation moved on and the answer is
//! `Reused`/`Unknown`. Stale reads happen, but are always detected.
//!
//! # Security cost
//! No memory windows means the rkey sent is the memory region's own: it is
//! region-wide and lives as long as the registration. Any QP of the same
//! protection domain that learns it can READ the *whole* region, at any time,
//! not just the offered range during the hold. Hence: one protection domain
//! (and one region set) per connection, so a peer can only ever read memory
//! that is exposed to it anyway. Rkeys are guessable, so a shared PD would
//! expose every connection's buffers to every peer.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod client;
mod ids;
mod output;
mod owner;
mod read;
mod server;
mod sorted;
mod wire;

pub use client::Client;
pub use ids::{BufferId, Generation, MsgId, ReadToken, Region};
pub use output::{Action, Config, Event, ReadError, ReadRequest, Release, UsageError};
pub use server::Server;
pub use wire::{DecodeError, Message, Verdict, MAX_ENCODED_LEN, WIRE_VERSION};
