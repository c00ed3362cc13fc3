//! Delegation on the wire: an endpoint hands a range of one of its regions
//! to a third node, by name, and can take it back. The endpoint's book
//! (`mwcap-delegation`'s [`Book`], under a secret drawn from the OS with
//! the first delegation, never sent) seals each [`Token`]; the owner's
//! library answers redemptions, delegations on and revocations itself
//! (`link/answer.rs`), never the application. From the delegation until
//! the book says its tree is done, the range is *pinned* in its region's
//! book of exposures: it is neither written nor deregistered. The rules and
//! the wire: `docs/protocol.md`, "Delegation: the owner's book".

// The loom build leaves the async endpoint, which makes delegations, out.
#![cfg_attr(loom, allow(dead_code))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mwcap_delegation::{Book, Event as BookEvent, Holder, Range, RedeemError};
pub use mwcap_delegation::{CapId, Delegation, RevokeError, Token, TokenTooLong, MAX_IDENTITY, MAX_TOKEN};
use parking_lot::Mutex;

use super::regions::Regions;
use super::{RegionRange, UseError};
use crate::backend::Nic;
use crate::bootstrap::Policy;

/// How many kinds of [`Refusal`] there are.
const REFUSALS: usize = 11;

/// The owner's application, as the holder of the roots it delegates from.
const APP: Holder = Holder(u64::MAX);

/// The name a delegation tree's pin of its range goes by in its region's
/// book of exposures (connection ids count up from 1: never this high).
fn pin(root: CapId) -> u64 {
    u64::MAX - root.0
}

/// Why [`Endpoint::delegate_region`](super::Endpoint::delegate_region)
/// made no token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DelegateError {
    /// The range cannot be exposed: no such region, outside it, or empty.
    #[error(transparent)]
    Region(#[from] UseError),
    /// No identity named: a token must name the key its delegate proves.
    #[error("a delegation names the identity that may redeem it (a key's name in the owner's keyring); none was given")]
    NoIdentity,
    /// The identity is longer than a token can name.
    #[error("an identity of {0} bytes: a token names one of at most {MAX_IDENTITY}")]
    IdentityTooLong(usize),
    /// A time to live of zero: the token could never be redeemed.
    #[error("a delegation needs a time to live above zero: give the delegate time to redeem it")]
    NoTime,
}

/// Why an owner refused a redemption (a status in its reply; the reply's
/// header says it in words).
/// Each variant's value is its status byte on the wire (0 is success).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum Refusal {
    /// Not a token this owner sealed: forged, altered, or another owner's.
    Forged = 1,
    /// A token this owner sealed whose delegation is over (its range was
    /// released): ask its holder for a new one.
    Unknown,
    /// The token names another identity than the one this connection
    /// proved: connect with that key.
    WrongIdentity,
    /// The token's expiry has passed.
    Expired,
    /// The delegation was revoked.
    Revoked,
    /// The token was redeemed already (a token redeems once).
    AlreadyRedeemed,
    /// Under confirm: the delegate's READ of the range was stale (its
    /// offer's hold ended before the delegate confirmed it) and the
    /// delegation's one exposure is over: ask its holder for a new token.
    Stale,
    /// The owner could not expose the range (its region is gone, or the
    /// connection cannot expose it): nothing was read.
    Unavailable,
    /// A holder's delegation on would be wider or longer than the
    /// capability it is made from (its token's range and expiry): ask for
    /// a part of it, for no longer. The holder's token is not used up.
    OutsideCapability,
    /// A revocation by a connection that did not make the delegation (only
    /// the holder that delegated, on the connection it delegated on, or
    /// the owner's application, revokes it).
    NotHolder,
    /// The ask made no sense to the owner (an op it does not know, or its
    /// fields malformed): a peer running another version.
    Malformed,
}

impl Refusal {
    /// Every refusal, in status order.
    pub(crate) const ALL: [Refusal; REFUSALS] = [
        Refusal::Forged,
        Refusal::Unknown,
        Refusal::WrongIdentity,
        Refusal::Expired,
        Refusal::Revoked,
        Refusal::AlreadyRedeemed,
        Refusal::Stale,
        Refusal::Unavailable,
        Refusal::OutsideCapability,
        Refusal::NotHolder,
        Refusal::Malformed,
    ];

    /// Its name in telemetry (`reason` label).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Refusal::Forged => "forged",
            Refusal::Unknown => "unknown",
            Refusal::WrongIdentity => "wrong_identity",
            Refusal::Expired => "expired",
            Refusal::Revoked => "revoked",
            Refusal::AlreadyRedeemed => "already_redeemed",
            Refusal::Stale => "stale",
            Refusal::Unavailable => "unavailable",
            Refusal::OutsideCapability => "outside_capability",
            Refusal::NotHolder => "not_holder",
            Refusal::Malformed => "malformed",
        }
    }

    /// Its status byte in a redemption's reply.
    pub(crate) fn status(self) -> u8 {
        self as u8
    }

    /// The refusal a redemption's reply status names (0 is success;
    /// `None` for a status no owner sends).
    fn from_status(status: u8) -> Option<Refusal> {
        Refusal::ALL.get(usize::from(status).checked_sub(1)?).copied()
    }

    /// The book's refusal `e`, with its words for the delegate.
    fn of(e: RedeemError) -> (Refusal, String) {
        let refusal = match e {
            RedeemError::Forged => Refusal::Forged,
            RedeemError::Unknown(_) => Refusal::Unknown,
            RedeemError::WrongIdentity { .. } => Refusal::WrongIdentity,
            RedeemError::Expired(_) => Refusal::Expired,
            RedeemError::Revoked(_) => Refusal::Revoked,
            RedeemError::AlreadyRedeemed(_) => Refusal::AlreadyRedeemed,
        };
        (refusal, e.to_string())
    }
}

/// Why [`Connection::redeem`](super::Connection::redeem) read nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedeemFailed {
    /// The owner refused the token; `message` is its reason in words.
    #[error("the owner refused the token ({refusal:?}): {message}")]
    Refused {
        /// Why, for a program to match.
        refusal: Refusal,
        /// The owner's words.
        message: String,
    },
    /// The redemption's call failed (the connection went down, the call
    /// timed out, the payload could not be read, ...).
    #[error(transparent)]
    Call(#[from] super::CallError),
    /// The identity to delegate to is empty or longer than a token can
    /// name; nothing was sent.
    #[error("a delegation names an identity of 1 to {MAX_IDENTITY} bytes, not {0}")]
    BadIdentity(usize),
    /// The owner answered with a status no owner sends (not an mwcap
    /// endpoint of this version?).
    #[error("the owner answered a redemption with status {0}, which no mwcap owner sends")]
    BadStatus(u8),
}

impl RedeemFailed {
    /// An owner's refusal: reply status `status` (not 0), `words` its
    /// reason.
    pub(crate) fn refused(status: u8, words: &[u8]) -> RedeemFailed {
        match Refusal::from_status(status) {
            Some(refusal) => {
                RedeemFailed::Refused { refusal, message: String::from_utf8_lossy(words).into_owned() }
            }
            None => RedeemFailed::BadStatus(status),
        }
    }
}

/// An endpoint's delegations at a glance (telemetry).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DelegationFigures {
    /// Exposures made by redeeming a delegation, live now: mw, confirm.
    pub(crate) live: [u64; 2],
    /// Tokens out: made, not yet redeemed, expired or revoked.
    pub(crate) tokens_out: u64,
    /// Redemptions refused, by [`Refusal::status`] - 1.
    pub(crate) refused: [u64; REFUSALS],
    /// What the book has done.
    pub(crate) stats: mwcap_delegation::BookStats,
}

/// An endpoint's delegations: its book, created with the first one.
pub(crate) struct Delegations {
    /// The epoch of the endpoint's clock (its connections' `now`).
    epoch: super::clock::Epoch,
    state: Mutex<State>,
    /// Some live exposure was revoked and waits for its connection to
    /// invalidate it ([`Regions::take_ends`]).
    ends_due: AtomicBool,
    /// Live exposures were revoked since the endpoint last rang their
    /// connections (`Hub::ring_ends`, [`Regions::take_ring`]).
    ring: AtomicBool,
}

#[derive(Default)]
struct State {
    book: Option<Book>,
    /// Each tree's root: the region range it covers and pins.
    roots: HashMap<CapId, RegionRange>,
    /// Each redeemed delegation exposed now: its connection, range, and
    /// the policy of its exposure.
    live: HashMap<CapId, (u64, RegionRange, Policy)>,
    /// Live exposures revoked, to invalidate, by the connection exposing
    /// each: (range, delegation). A connection takes its own list, and an
    /// exposure that ends is looked for in its connection's alone.
    ends: HashMap<u64, Vec<(RegionRange, CapId)>>,
    /// Capabilities revoked, until a second past their tokens' expiry
    /// (a turn's `now` may lag the endpoint's clock): once the book
    /// has forgotten a tree, a token of it that is not expired was
    /// revoked if it is here and redeemed if not ([`State::refusal`]).
    /// Entries past their expiry are dropped once they could be half
    /// (`purge_at`), so that this grows with revocations, never with
    /// redemptions.
    revoked: HashMap<CapId, Duration>,
    /// `revoked`'s length at which its expired entries are next dropped.
    purge_at: usize,
    /// Redemptions refused, by [`Refusal::status`] - 1.
    refused: [u64; REFUSALS],
    nonce: u64,
}

impl Delegations {
    pub(crate) fn new(epoch: super::clock::Epoch) -> Delegations {
        Delegations {
            epoch,
            state: Mutex::new(State::default()),
            ends_due: AtomicBool::new(false),
            ring: AtomicBool::new(false),
        }
    }

    fn now(&self) -> Duration {
        self.epoch.now()
    }
}

impl State {
    /// Count a refusal (telemetry, by reason).
    fn count(&mut self, refusal: Refusal) {
        self.refused[usize::from(refusal.status() - 1)] += 1;
    }

    /// The refusal for the book's redemption error `e` of `token`. A token
    /// of a tree the book has forgotten (`Unknown`) is refused for what
    /// happened to it: expired once its expiry has passed, else revoked
    /// (`revoked`) or redeemed already, for the book forgets a tree only
    /// once none of it can be exposed any more. (A token the book did not
    /// seal is `Forged` before this; `Unknown` is left for a token whose
    /// claims no longer open.)
    fn refusal(&self, now: Duration, e: RedeemError, token: &[u8]) -> (Refusal, String) {
        let RedeemError::Unknown(cap) = e else { return Refusal::of(e) };
        let claims = self.book.as_ref().and_then(|b| b.open(token));
        Refusal::of(match claims {
            Some(c) if now >= c.expiry => RedeemError::Expired(cap),
            Some(_) if self.revoked.contains_key(&cap) => RedeemError::Revoked(cap),
            Some(_) => RedeemError::AlreadyRedeemed(cap),
            None => RedeemError::Unknown(cap),
        })
    }

    /// `caps` were revoked: their tokens are refused `Revoked` until
    /// `expiry` (none of theirs outlives it), also once the book has
    /// forgotten their tree.
    fn mark_revoked(&mut self, now: Duration, expiry: Duration, caps: &[CapId]) {
        for &c in caps {
            self.revoked.insert(c, expiry);
        }
        if self.revoked.len() >= self.purge_at {
            // A second past their expiry: a connection's turn judges a
            // token with a `now` that may be a little behind this one.
            self.revoked.retain(|_, &mut expiry| expiry + Duration::from_secs(1) > now);
            self.purge_at = (2 * self.revoked.len()).max(64);
        }
    }

    fn book(&mut self) -> &mut Book {
        self.book.get_or_insert_with(|| {
            use rand::RngCore;
            let mut secret = [0u8; 32];
            rand::rngs::OsRng.fill_bytes(&mut secret);
            Book::new(secret)
        })
    }
}

impl<N: Nic> Regions<N> {
    /// The time on the clock of the endpoint's connections.
    pub(crate) fn delegation_clock(&self) -> Duration {
        self.delegations().now()
    }

    /// Delegate `range` whole to `identity` for `ttl` from `now` (on the
    /// clock its connections are driven on), from a new root held by the
    /// owner's application (`by` None) or by connection `by`, whose call for
    /// a delegation the application replied to with `range`; `by` may
    /// revoke what it made ([`Regions::revoke_held`]). The root is never
    /// exposed to its holder: it ends at once.
    pub(crate) fn delegate(
        &self,
        now: Duration,
        by: Option<u64>,
        range: RegionRange,
        identity: &str,
        ttl: Duration,
    ) -> Result<Delegation, DelegateError> {
        if identity.is_empty() {
            return Err(DelegateError::NoIdentity);
        }
        if identity.len() > MAX_IDENTITY {
            return Err(DelegateError::IdentityTooLong(identity.len()));
        }
        if ttl.is_zero() {
            return Err(DelegateError::NoTime);
        }
        let holder = by.map_or(APP, Holder);
        let d = self.delegations();
        // A token holds its expiry in u64 nanoseconds (about 584 years):
        // a longer life is that long.
        let expiry = now.saturating_add(ttl).min(Duration::from_nanos(u64::MAX));
        let mut st = d.state.lock();
        let bytes = Range { offset: range.offset as u64, len: u64::from(range.len) };
        let root = st.book().expose(holder, bytes, expiry);
        // The pin checks the range (region, bounds, not deregistered).
        if let Err(e) = self.expose(pin(root), range) {
            st.book().ended(root);
            self.drain(&mut st);
            return Err(e.into());
        }
        st.nonce += 1;
        let nonce = st.nonce;
        let made = st.book().delegate(now, holder, root, bytes, identity, expiry, nonce);
        // The root stands for the application itself (or a holder's reply
        // it never reads), not an exposure on a NIC: it ends at once, and
        // the tree lives on in its delegation.
        st.book().ended(root);
        st.roots.insert(root, range);
        self.drain(&mut st);
        Ok(made.expect("checked above: a live root, its whole range, its own expiry, a short identity"))
    }

    /// A redemption of `token` on connection `conn`, authenticated as
    /// `identity`: the delegation, its range, and how long its exposure
    /// may last.
    pub(crate) fn redeem(
        &self,
        now: Duration,
        conn: u64,
        identity: Option<&str>,
        token: &[u8],
        policy: Policy,
    ) -> Result<(CapId, RegionRange, Duration), (Refusal, String)> {
        let d = self.delegations();
        let mut st = d.state.lock();
        let Some(book) = st.book.as_mut() else { return Err(Refusal::of(RedeemError::Forged)) };
        book.handle_timeout(now);
        // A connection that proved no key has no identity a token can name.
        let r = book.redeem(now, Holder(conn), identity.unwrap_or(""), token);
        let out = match r {
            Ok(r) => {
                let region = st.roots.get(&r.root).expect("a tree in the book has its root's range").region;
                let range = RegionRange { region, offset: r.range.offset as usize, len: r.range.len as u32 };
                st.live.insert(r.cap, (conn, range, policy));
                Ok((r.cap, range, r.expiry.saturating_sub(now)))
            }
            Err(e) => Err(st.refusal(now, e, token)),
        };
        self.settle(&mut st, &out);
        out
    }

    /// After an ask answered from the book: count its refusal, carry out
    /// the book's events.
    fn settle<T>(&self, st: &mut State, out: &Result<T, (Refusal, String)>) {
        if let Err((refusal, _)) = out {
            st.count(*refusal);
        }
        self.drain(st);
    }

    /// Connection `conn`, authenticated as `identity`, hands the
    /// capability of `token` (made for it) on to `to`: the part
    /// `offset..offset + len` of its range (`len` 0: the rest), for `ttl`
    /// at most as long as its own. The holder's token is redeemed into
    /// the new delegation (it exposes nothing to the holder) and `conn`
    /// holds it: it may revoke what it made ([`Regions::revoke_held`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn delegate_on(
        &self,
        now: Duration,
        conn: u64,
        identity: Option<&str>,
        token: &[u8],
        (offset, len): (u32, u32),
        to: &str,
        ttl: Duration,
    ) -> Result<Delegation, (Refusal, String)> {
        let d = self.delegations();
        let mut st = d.state.lock();
        let out = Self::delegate_on_locked(&mut st, now, conn, identity, token, (offset, len), to, ttl);
        self.settle(&mut st, &out);
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn delegate_on_locked(
        st: &mut State,
        now: Duration,
        conn: u64,
        identity: Option<&str>,
        token: &[u8],
        (offset, len): (u32, u32),
        to: &str,
        ttl: Duration,
    ) -> Result<Delegation, (Refusal, String)> {
        let outside = |why: String| (Refusal::OutsideCapability, why);
        if to.is_empty() || to.len() > MAX_IDENTITY {
            return Err((
                Refusal::Malformed,
                format!("a delegation names an identity of 1 to {MAX_IDENTITY} bytes, not {}", to.len()),
            ));
        }
        let Some(book) = st.book.as_mut() else { return Err(Refusal::of(RedeemError::Forged)) };
        book.handle_timeout(now);
        // The part and the life are checked against the token's claims
        // first: a holder asking too much keeps its token.
        let part = match book.open(token) {
            Some(c) => {
                let (offset, held) = (u64::from(offset), c.range.len);
                let len = if len == 0 { held.saturating_sub(offset) } else { u64::from(len) };
                if len == 0 || offset + len > held {
                    return Err(outside(format!(
                        "bytes {offset}..{} of a capability of {held} bytes: delegate a part of it",
                        offset + len
                    )));
                }
                let left = c.expiry.saturating_sub(now);
                if ttl.is_zero() || ttl > left {
                    return Err(outside(format!(
                        "a life of {ttl:?} from a capability with {left:?} left: delegate for no longer"
                    )));
                }
                if book.depth(c.cap).is_some_and(|d| d >= mwcap_delegation::MAX_DEPTH) {
                    return Err(outside(format!(
                        "this capability is {} delegations from the owner's exposure, where a chain of \
                         delegations stops: read it, or ask the owner for a delegation of its own",
                        mwcap_delegation::MAX_DEPTH
                    )));
                }
                Range { offset: c.range.offset + offset, len }
            }
            // Not a token of this owner's: the redemption says why.
            None => Range { offset: 0, len: 0 },
        };
        let r = match book.redeem(now, Holder(conn), identity.unwrap_or(""), token) {
            Ok(r) => r,
            Err(e) => return Err(st.refusal(now, e, token)),
        };
        st.nonce += 1;
        let nonce = st.nonce;
        let book = st.book.as_mut().expect("it redeemed");
        let made = book.delegate(now, Holder(conn), r.cap, part, to, now + ttl, nonce);
        // The holder's own capability is handed on, never exposed to it:
        // its exposure is over, and the tree lives on in the delegation.
        book.ended(r.cap);
        made.map_err(|e| {
            outside(format!("the delegation was refused after the holder's token was used: {e:?}"))
        })
    }

    /// Connection `conn` revokes delegation `cap`, which it made
    /// ([`Regions::delegate_on`]): `cap` and everything made from it end,
    /// as the owner's revocation ends them.
    pub(crate) fn revoke_held(&self, conn: u64, cap: CapId) -> Result<(), (Refusal, String)> {
        let d = self.delegations();
        let mut st = d.state.lock();
        let unknown =
            || (Refusal::Unknown, format!("delegation {} is unknown or over: nothing to revoke", cap.0));
        let Some(b) = st.book.as_mut() else { return Err(unknown()) };
        let Some(parent) = b.parent(cap) else { return Err(unknown()) };
        let Some((_, expiry)) = b.bounds(parent) else { return Err(unknown()) };
        // What is revoked (every delegation made from `parent`, `cap`
        // among them) is remembered before the book forgets the tree.
        let mut below = Vec::new();
        b.below(parent, &mut below);
        let r = match b.revoke_delegations(Holder(conn), parent) {
            Ok(()) => Ok(()),
            Err(RevokeError::NotHolder(_)) => Err((
                Refusal::NotHolder,
                format!(
                    "delegation {} was not made on this connection: only the holder that delegated it, on \
                     the connection it delegated on, or the owner's application revokes it",
                    cap.0
                ),
            )),
            Err(_) => Err(unknown()),
        };
        if r.is_ok() {
            st.mark_revoked(d.now(), expiry, &below);
        }
        self.settle(&mut st, &r);
        r
    }

    /// Whether live exposures were revoked since the last call (the flag
    /// is cleared): the connections of [`Regions::ends_conns`] are to be
    /// rung.
    #[inline]
    pub(crate) fn take_ring(&self) -> bool {
        let d = self.delegations();
        d.ring.load(Ordering::Relaxed) && d.ring.swap(false, Ordering::AcqRel)
    }

    /// A redemption refused by a connection itself (stale, unavailable).
    pub(crate) fn count_refusal(&self, refusal: Refusal) {
        self.delegations().state.lock().count(refusal);
    }

    /// Delegation `cap`'s exposure ended on evidence (or was never made).
    pub(crate) fn delegation_ended(&self, cap: CapId) {
        let d = self.delegations();
        let mut st = d.state.lock();
        if let Some((conn, ..)) = st.live.remove(&cap) {
            if let Some(mine) = st.ends.get_mut(&conn) {
                mine.retain(|&(_, c)| c != cap);
                if mine.is_empty() {
                    st.ends.remove(&conn);
                    if st.ends.is_empty() {
                        d.ends_due.store(false, Ordering::Release);
                    }
                }
            }
        }
        if let Some(b) = st.book.as_mut() {
            b.ended(cap);
        }
        self.drain(&mut st);
    }

    /// The owner's application revokes `cap` and everything made from it.
    pub(crate) fn revoke(&self, cap: CapId) -> Result<(), RevokeError> {
        let d = self.delegations();
        let mut st = d.state.lock();
        let Some(b) = st.book.as_mut() else { return Err(RevokeError::Unknown(cap)) };
        let expiry = b.bounds(cap).map(|(_, e)| e);
        let mut revoked = vec![cap];
        b.below(cap, &mut revoked);
        let r = b.revoke(cap);
        if let (Ok(()), Some(expiry)) = (&r, expiry) {
            st.mark_revoked(d.now(), expiry, &revoked);
        }
        self.drain(&mut st);
        r
    }

    /// Tokens whose expiry has passed can no longer be redeemed: their
    /// trees end, and their ranges may be written again.
    pub(crate) fn expire_delegations(&self) {
        let d = self.delegations();
        let mut st = d.state.lock();
        if let Some(b) = st.book.as_mut() {
            b.handle_timeout(d.now());
            self.drain(&mut st);
        }
    }

    /// When the next token expires, on the endpoint's clock.
    pub(crate) fn next_delegation_expiry(&self) -> Option<Instant> {
        let d = self.delegations();
        let st = d.state.lock();
        st.book.as_ref().and_then(Book::poll_timeout).map(|t| d.epoch.instant(t))
    }

    /// Whether some revoked exposure waits for its connection.
    #[inline]
    pub(crate) fn ends_due(&self) -> bool {
        self.delegations().ends_due.load(Ordering::Acquire)
    }

    /// The connections that have revoked exposures to end, each once.
    pub(crate) fn ends_conns(&self, out: &mut Vec<u64>) {
        out.extend(self.delegations().state.lock().ends.keys().copied());
    }

    /// Revoked exposures connection `conn` must end now, with their
    /// delegations (cheap when none).
    pub(crate) fn take_ends(&self, conn: u64) -> Vec<(RegionRange, CapId)> {
        let d = self.delegations();
        if !d.ends_due.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut st = d.state.lock();
        let mine = st.ends.remove(&conn).unwrap_or_default();
        if st.ends.is_empty() {
            d.ends_due.store(false, Ordering::Release);
        }
        mine
    }

    /// Its delegations at a glance (telemetry; one lock, off the data path).
    pub(crate) fn delegation_figures(&self) -> DelegationFigures {
        let st = self.delegations().state.lock();
        let mut f = DelegationFigures::default();
        for &(_, _, policy) in st.live.values() {
            f.live[usize::from(policy == Policy::Confirm)] += 1;
        }
        f.refused = st.refused;
        if let Some(b) = &st.book {
            f.tokens_out = b.tokens_out() as u64;
            f.stats = b.stats();
        }
        f
    }

    /// Carry out the book's events: a done tree unpins its range; a
    /// revoked live exposure waits for its connection.
    fn drain(&self, st: &mut State) {
        let Some(book) = st.book.as_mut() else { return };
        while let Some(ev) = book.poll_event() {
            match ev {
                BookEvent::Done { root } => {
                    if let Some(range) = st.roots.remove(&root) {
                        self.unpin(pin(root), range);
                    }
                }
                BookEvent::End { cap, .. } => {
                    if let Some(&(conn, range, _)) = st.live.get(&cap) {
                        st.ends.entry(conn).or_default().push((range, cap));
                        self.delegations().ends_due.store(true, Ordering::Release);
                        self.delegations().ring.store(true, Ordering::Release);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Revocations are remembered until a second past their tokens'
    /// expiry, and no longer than that by more than twice their number: an
    /// owner that revokes steadily keeps a record of the recent ones only.
    #[test]
    fn records_of_revocations_are_dropped_after_their_expiry() {
        let ms = Duration::from_millis;
        let mut st = State::default();
        for i in 0..10_000u64 {
            // Each revoked at i ms, its token expiring 100 ms later.
            st.mark_revoked(ms(i), ms(i + 100), &[CapId(2 * i), CapId(2 * i + 1)]);
            // Those within 100 ms and a second of their expiry, twice over at most.
            assert!(st.revoked.len() <= 2 * 2 * 1100 + 64, "{} records at {i} ms", st.revoked.len());
        }
        assert!(st.revoked.contains_key(&CapId(19_999)), "the latest is remembered");
    }
}
