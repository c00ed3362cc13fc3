//! The owner's [`Book`] of capabilities and their delegations.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Duration;

use zeroize::Zeroizing;

use crate::token::{self, Claims, Token, MAX_IDENTITY};
use crate::{CapId, Holder, Range};

/// Where a capability is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum State {
    /// A delegation whose token is out and not yet redeemed.
    Pending,
    /// Exposed to its holder (a window bound, or an offer made).
    Live,
    /// Revoked while live: the owner was told to end the exposure
    /// ([`Event::End`]) and waits for the evidence ([`Book::ended`]).
    Ending,
    /// Its exposure ended on evidence.
    Ended,
    /// A delegation never redeemed, that no longer can be.
    Dead(Dead),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Dead {
    Expired,
    Revoked,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Node {
    root: CapId,
    range: Range,
    expiry: Duration,
    state: State,
    /// The holder: the root's, or the delegate's once redeemed.
    holder: Option<Holder>,
    /// A delegation: the capability it was made from. (The identity that
    /// may redeem it is in its token, sealed: the book seals one token per
    /// delegation and never reuses an id, so a token that opens names the
    /// identity the delegation was made for.)
    parent: Option<CapId>,
    /// Delegations between it and its root (a root's is 0).
    depth: u8,
    revoked: bool,
    children: Children,
}

/// The longest chain of delegations below a root: a capability this many
/// delegations from its root delegates no further
/// ([`DelegateError::TooDeep`]). Each delegation a holder makes uses up
/// the token it redeemed, so a tree is a chain of at most this many nodes
/// per delegation its owner made: a holder cannot grow the book, nor the
/// walks of its tree, without bound.
pub const MAX_DEPTH: u8 = 16;

/// A capability's delegations, in the order made. The first is kept
/// inline: most capabilities are delegated once (a holder hands its reply
/// on), and then making the delegation allocates nothing for it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Children {
    first: Option<CapId>,
    rest: Vec<CapId>,
}

impl Children {
    fn push(&mut self, c: CapId) {
        match self.first {
            None => self.first = Some(c),
            Some(_) => self.rest.push(c),
        }
    }

    fn iter(&self) -> impl Iterator<Item = CapId> + '_ {
        self.first.into_iter().chain(self.rest.iter().copied())
    }
}

/// What the owner must do, from the book.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// End `cap`'s exposure to `holder` (it was revoked): invalidate its
    /// window, or withdraw its offer; tell the book with [`Book::ended`]
    /// once that has happened on evidence.
    End {
        /// The capability.
        cap: CapId,
        /// Its holder.
        holder: Holder,
    },
    /// Every exposure made from `root` (the first, and each delegation) has
    /// ended on evidence, and no token of it can be redeemed any more: the
    /// memory may be reused. The book has forgotten the tree.
    Done {
        /// The capability the tree grew from.
        root: CapId,
    },
}

/// A delegation made: its capability (pending until redeemed; revoke it by
/// this id) and the token the holder passes to the delegate.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Delegation {
    /// The delegation.
    pub cap: CapId,
    /// Its sealed token.
    pub token: Token,
}

/// A delegation redeemed: expose `range` to the delegate until `expiry`,
/// and tell the book with [`Book::ended`] when the exposure ends (at once,
/// if it could not be made).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Redeemed {
    /// The delegation, now live and held by the delegate.
    pub cap: CapId,
    /// The capability its tree grew from (whose memory it covers).
    pub root: CapId,
    /// The bytes to expose.
    pub range: Range,
    /// When the exposure must end at the latest, on the owner's clock.
    pub expiry: Duration,
}

/// Why a delegation was refused.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DelegateError {
    /// No such capability (never made, or its tree is over).
    Unknown(CapId),
    /// The one asking does not hold the capability now.
    NotHolder(CapId),
    /// The capability was revoked.
    Revoked(CapId),
    /// The capability's exposure is over (released, expired, or ending).
    NotLive(CapId),
    /// The range is empty or reaches outside the capability's.
    OutOfRange {
        /// What was asked for.
        asked: Range,
        /// The capability's range.
        held: Range,
    },
    /// The expiry has passed already: the token could never be redeemed.
    ExpiryPassed {
        /// What was asked for.
        asked: Duration,
        /// The owner's clock.
        now: Duration,
    },
    /// The expiry is later than the capability's own.
    ExpiryTooLate {
        /// What was asked for.
        asked: Duration,
        /// The capability's expiry.
        held: Duration,
    },
    /// The identity is longer than a token can name.
    IdentityTooLong(usize),
    /// The capability is [`MAX_DEPTH`] delegations from its root already.
    TooDeep(CapId),
}

impl std::fmt::Display for DelegateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DelegateError::Unknown(c) => {
                write!(f, "capability {c:?} is unknown or over: delegate only what you hold now")
            }
            DelegateError::NotHolder(c) => {
                write!(f, "capability {c:?} is held by another connection: only its holder may delegate it")
            }
            DelegateError::Revoked(c) => write!(f, "capability {c:?} was revoked: nothing can be delegated from it"),
            DelegateError::NotLive(c) => write!(
                f,
                "capability {c:?} is no longer exposed (released, expired or being revoked): delegate before \
                 releasing it"
            ),
            DelegateError::OutOfRange { asked, held } => write!(
                f,
                "the range {asked:?} is empty or outside the capability's {held:?}: a delegation covers part \
                 of what its holder holds, never more"
            ),
            DelegateError::ExpiryPassed { asked, now } => write!(
                f,
                "an expiry of {asked:?} has passed (the owner's clock reads {now:?}): give the delegate time \
                 to redeem it"
            ),
            DelegateError::ExpiryTooLate { asked, held } => write!(
                f,
                "an expiry of {asked:?} is later than the capability's {held:?}: a delegation lasts no longer \
                 than what it is made from"
            ),
            DelegateError::IdentityTooLong(n) => {
                write!(f, "an identity of {n} bytes: a token names one of at most {MAX_IDENTITY}")
            }
            DelegateError::TooDeep(c) => write!(
                f,
                "capability {c:?} is {MAX_DEPTH} delegations from its owner's exposure, where a chain of \
                 delegations stops: ask the owner for a delegation of its own"
            ),
        }
    }
}

impl std::error::Error for DelegateError {}

/// Why a token was not redeemed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RedeemError {
    /// Not a token this owner sealed: forged, altered, or another owner's.
    Forged,
    /// A token this owner sealed, whose capability is over (its tree is
    /// done and forgotten).
    Unknown(CapId),
    /// Sealed for another identity than the one redeeming it.
    WrongIdentity {
        /// The delegation.
        cap: CapId,
        /// The identity the token names.
        named: String,
    },
    /// Its expiry has passed.
    Expired(CapId),
    /// It, or a capability it was made from, was revoked.
    Revoked(CapId),
    /// It was redeemed already (a token redeems once).
    AlreadyRedeemed(CapId),
}

impl std::fmt::Display for RedeemError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedeemError::Forged => {
                write!(f, "the token was not sealed by this owner (forged, altered or another owner's)")
            }
            RedeemError::Unknown(c) => {
                write!(f, "delegation {c:?} is over (its memory was released): ask its holder for a new one")
            }
            RedeemError::WrongIdentity { cap, named } => write!(
                f,
                "delegation {cap:?} is for identity {named:?}, not this connection's: connect with that key"
            ),
            RedeemError::Expired(c) => write!(f, "delegation {c:?} expired: ask its holder for a new one"),
            RedeemError::Revoked(c) => write!(f, "delegation {c:?} was revoked"),
            RedeemError::AlreadyRedeemed(c) => {
                write!(f, "delegation {c:?} was redeemed already: a token redeems once")
            }
        }
    }
}

impl std::error::Error for RedeemError {}

/// Why a revocation was refused.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RevokeError {
    /// No such capability (never made, or its tree is over).
    Unknown(CapId),
    /// The one asking never held the capability.
    NotHolder(CapId),
}

impl std::fmt::Display for RevokeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RevokeError::Unknown(c) => write!(f, "capability {c:?} is unknown or over: nothing to revoke"),
            RevokeError::NotHolder(c) => {
                write!(f, "capability {c:?} was never held by this connection: only its holder revokes its delegations")
            }
        }
    }
}

impl std::error::Error for RevokeError {}

/// What the book has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BookStats {
    /// Capabilities exposed ([`Book::expose`]).
    pub exposed: u64,
    /// Delegations made (tokens sealed).
    pub delegated: u64,
    /// Delegations refused.
    pub delegations_refused: u64,
    /// Tokens redeemed.
    pub redeemed: u64,
    /// Redemptions refused: forged, unknown, wrong identity, expired,
    /// revoked, already redeemed.
    pub refused_forged: u64,
    /// See [`BookStats::refused_forged`].
    pub refused_unknown: u64,
    /// See [`BookStats::refused_forged`].
    pub refused_identity: u64,
    /// See [`BookStats::refused_forged`].
    pub refused_expired: u64,
    /// See [`BookStats::refused_forged`].
    pub refused_revoked: u64,
    /// See [`BookStats::refused_forged`].
    pub refused_redeemed: u64,
    /// Capabilities revoked (each one, with those below it).
    pub revoked: u64,
    /// Tokens that expired unredeemed.
    pub tokens_expired: u64,
    /// Trees done ([`Event::Done`]).
    pub done: u64,
}

/// The owner's book of capabilities: each exposure it made (a *root*) and
/// every delegation made from it, as a tree. See the crate docs.
///
/// Equality and hashing (for model checking) leave the secret and the
/// counts of [`Book::stats`] out.
///
/// Steady use allocates nothing: the capabilities are in a hash map and
/// the tokens out in a heap, which keep their room as entries come and
/// go (a B-tree allocates a node whenever one fills or empties).
#[derive(Clone)]
pub struct Book {
    key: Zeroizing<[u8; 32]>,
    next: u64,
    nodes: HashMap<CapId, Node, BuildHasherDefault<IdHasher>>,
    /// Tokens out, by expiry, earliest first: (expiry, delegation). An
    /// entry whose delegation is no longer pending is stale; the top
    /// never is (`settle`), and a compaction drops the rest once they are
    /// more than half (`tokens_out`).
    pending: BinaryHeap<Reverse<(Duration, CapId)>>,
    /// Delegations pending: the live entries of `pending`.
    tokens_out: usize,
    events: VecDeque<Event>,
    stats: BookStats,
    /// `finish`'s work lists (the tree, and what is left to visit), kept
    /// between calls so that ending a delegation allocates nothing for
    /// them. Not part of the book's state (equality, hashing).
    scratch: (Vec<CapId>, Vec<CapId>),
}

impl Book {
    /// An empty book sealing its tokens under `secret` (32 random bytes of
    /// the owner's, never sent).
    pub fn new(secret: [u8; 32]) -> Book {
        Book {
            key: Zeroizing::new(secret),
            next: 1,
            nodes: HashMap::default(),
            pending: BinaryHeap::new(),
            tokens_out: 0,
            events: VecDeque::new(),
            stats: BookStats::default(),
            scratch: (Vec::new(), Vec::new()),
        }
    }

    fn fresh(&mut self) -> CapId {
        let id = CapId(self.next);
        self.next += 1;
        id
    }

    /// The owner exposed `range` of some memory to `holder` until `expiry`:
    /// a new root capability, live. Its memory is the owner's again only
    /// after [`Event::Done`] for it.
    pub fn expose(&mut self, holder: Holder, range: Range, expiry: Duration) -> CapId {
        let id = self.fresh();
        self.nodes.insert(
            id,
            Node {
                root: id,
                range,
                expiry,
                state: State::Live,
                holder: Some(holder),
                parent: None,
                depth: 0,
                revoked: false,
                children: Children::default(),
            },
        );
        self.stats.exposed += 1;
        id
    }

    /// `by` delegates `range` of capability `cap`, which it holds live, to
    /// `identity` until `expiry`: the delegation (pending) and its token
    /// for the delegate, which it redeems once ([`Book::redeem`]). `nonce`
    /// is put in the token.
    #[allow(clippy::too_many_arguments)]
    pub fn delegate(
        &mut self,
        now: Duration,
        by: Holder,
        cap: CapId,
        range: Range,
        identity: &str,
        expiry: Duration,
        nonce: u64,
    ) -> Result<Delegation, DelegateError> {
        let r = self.check_delegation(now, by, cap, range, identity, expiry);
        if r.is_err() {
            self.stats.delegations_refused += 1;
        }
        let (root, depth) = r?;
        let id = self.fresh();
        let claims = Claims { cap: id, root, range, expiry, identity, nonce };
        let token = token::seal(&self.key, &claims).expect("the identity's length was checked");
        self.nodes.get_mut(&cap).expect("checked").children.push(id);
        self.nodes.insert(
            id,
            Node {
                root,
                range,
                expiry,
                state: State::Pending,
                holder: None,
                parent: Some(cap),
                depth,
                revoked: false,
                children: Children::default(),
            },
        );
        self.pending.push(Reverse((expiry, id)));
        self.tokens_out += 1;
        self.stats.delegated += 1;
        Ok(Delegation { cap: id, token })
    }

    fn check_delegation(
        &self,
        now: Duration,
        by: Holder,
        cap: CapId,
        range: Range,
        identity: &str,
        expiry: Duration,
    ) -> Result<(CapId, u8), DelegateError> {
        let n = self.nodes.get(&cap).ok_or(DelegateError::Unknown(cap))?;
        if n.holder != Some(by) {
            return Err(DelegateError::NotHolder(cap));
        }
        if n.revoked {
            return Err(DelegateError::Revoked(cap));
        }
        if n.state != State::Live || now >= n.expiry {
            return Err(DelegateError::NotLive(cap));
        }
        if !n.range.contains(range) {
            return Err(DelegateError::OutOfRange { asked: range, held: n.range });
        }
        if expiry > n.expiry {
            return Err(DelegateError::ExpiryTooLate { asked: expiry, held: n.expiry });
        }
        if expiry <= now {
            return Err(DelegateError::ExpiryPassed { asked: expiry, now });
        }
        if identity.len() > MAX_IDENTITY {
            return Err(DelegateError::IdentityTooLong(identity.len()));
        }
        if n.depth >= MAX_DEPTH {
            return Err(DelegateError::TooDeep(cap));
        }
        Ok((n.root, n.depth + 1))
    }

    /// How many delegations capability `cap` is from its root (0 for a
    /// root), while the book knows it.
    pub fn depth(&self, cap: CapId) -> Option<u8> {
        self.nodes.get(&cap).map(|n| n.depth)
    }

    /// `by`, authenticated as `identity`, redeems `token`: on success the
    /// delegation is live and held by `by`, and the owner exposes its range
    /// to it ([`Redeemed`]).
    pub fn redeem(
        &mut self,
        now: Duration,
        by: Holder,
        identity: &str,
        token: &[u8],
    ) -> Result<Redeemed, RedeemError> {
        let r = self.check_redeem(now, identity, token);
        let s = &mut self.stats;
        match &r {
            Ok(_) => s.redeemed += 1,
            Err(RedeemError::Forged) => s.refused_forged += 1,
            Err(RedeemError::Unknown(_)) => s.refused_unknown += 1,
            Err(RedeemError::WrongIdentity { .. }) => s.refused_identity += 1,
            Err(RedeemError::Expired(_)) => s.refused_expired += 1,
            Err(RedeemError::Revoked(_)) => s.refused_revoked += 1,
            Err(RedeemError::AlreadyRedeemed(_)) => s.refused_redeemed += 1,
        }
        let cap = r?;
        let n = self.nodes.get_mut(&cap).expect("checked");
        n.state = State::Live;
        n.holder = Some(by);
        let redeemed = Redeemed { cap, root: n.root, range: n.range, expiry: n.expiry };
        self.tokens_out -= 1;
        self.settle();
        Ok(redeemed)
    }

    fn check_redeem(&self, now: Duration, identity: &str, token: &[u8]) -> Result<CapId, RedeemError> {
        let claims = token::open(&self.key, token).ok_or(RedeemError::Forged)?;
        let cap = claims.cap;
        let n = self.nodes.get(&cap).ok_or(RedeemError::Unknown(cap))?;
        // The book's record decides the state and the expiry; the identity
        // is the token's, sealed by this book for this delegation alone.
        if n.revoked {
            return Err(RedeemError::Revoked(cap));
        }
        match n.state {
            State::Pending => {}
            State::Dead(Dead::Expired) => return Err(RedeemError::Expired(cap)),
            State::Dead(Dead::Revoked) => return Err(RedeemError::Revoked(cap)),
            State::Live | State::Ending | State::Ended => return Err(RedeemError::AlreadyRedeemed(cap)),
        }
        if claims.identity != identity {
            return Err(RedeemError::WrongIdentity { cap, named: claims.identity.to_owned() });
        }
        if now >= n.expiry {
            return Err(RedeemError::Expired(cap));
        }
        Ok(cap)
    }

    /// The owner's application revokes `cap`: its exposure and every
    /// delegation made from it (and from those) end. Live exposures end
    /// through [`Event::End`]; tokens out are refused from now on.
    pub fn revoke(&mut self, cap: CapId) -> Result<(), RevokeError> {
        if !self.nodes.contains_key(&cap) {
            return Err(RevokeError::Unknown(cap));
        }
        self.revoke_tree(cap);
        Ok(())
    }

    /// `by`, which holds or held `cap`, revokes every delegation made from
    /// it (and from those); its own exposure stays.
    pub fn revoke_delegations(&mut self, by: Holder, cap: CapId) -> Result<(), RevokeError> {
        let n = self.nodes.get(&cap).ok_or(RevokeError::Unknown(cap))?;
        if n.holder != Some(by) {
            return Err(RevokeError::NotHolder(cap));
        }
        for c in n.children.clone().iter() {
            self.revoke_tree(c);
        }
        Ok(())
    }

    fn revoke_tree(&mut self, cap: CapId) {
        let (tree, mut stack) = std::mem::take(&mut self.scratch);
        stack.clear();
        stack.push(cap);
        let mut touched = None;
        while let Some(c) = stack.pop() {
            let Some(n) = self.nodes.get_mut(&c) else { continue };
            stack.extend(n.children.iter());
            if n.revoked {
                continue;
            }
            n.revoked = true;
            touched = Some(n.root);
            self.stats.revoked += 1;
            match n.state {
                State::Pending => {
                    n.state = State::Dead(Dead::Revoked);
                    self.tokens_out -= 1;
                }
                State::Live => {
                    n.state = State::Ending;
                    let holder = n.holder.expect("a live capability has a holder");
                    self.events.push_back(Event::End { cap: c, holder });
                }
                State::Ending | State::Ended | State::Dead(_) => {}
            }
        }
        self.scratch = (tree, stack);
        self.settle();
        if let Some(root) = touched {
            self.finish(root);
        }
    }

    /// `cap`'s exposure ended on evidence (its window's invalidation
    /// completed, its QP was destroyed, its offer was confirmed or
    /// withdrawn), or could not be made. Returns whether it was live:
    /// a second report of the same end changes nothing.
    pub fn ended(&mut self, cap: CapId) -> bool {
        let Some(n) = self.nodes.get_mut(&cap) else { return false };
        if !matches!(n.state, State::Live | State::Ending) {
            return false;
        }
        n.state = State::Ended;
        let root = n.root;
        self.finish(root);
        true
    }

    /// Tokens whose expiry has come can no longer be redeemed.
    pub fn handle_timeout(&mut self, now: Duration) {
        while let Some(&Reverse((at, cap))) = self.pending.peek() {
            if at > now {
                break;
            }
            self.pending.pop();
            // The top is a token out (`settle`); checked all the same.
            let n = match self.nodes.get_mut(&cap) {
                Some(n) if n.state == State::Pending && n.expiry == at => n,
                _ => continue,
            };
            n.state = State::Dead(Dead::Expired);
            self.tokens_out -= 1;
            self.stats.tokens_expired += 1;
            let root = n.root;
            self.settle();
            self.finish(root);
        }
    }

    /// When [`Book::handle_timeout`] next has something to do.
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.pending.peek().map(|&Reverse((at, _))| at)
    }

    /// Drop stale entries of `pending` (delegations no longer pending):
    /// from the top, so that the top is a token out; and all of them once
    /// they outnumber the tokens out, so that the heap stays within twice
    /// their number (plus a few) however many come and go.
    fn settle(&mut self) {
        let nodes = &self.nodes;
        let live = |&Reverse((at, cap)): &Reverse<(Duration, CapId)>| {
            nodes.get(&cap).is_some_and(|n| n.state == State::Pending && n.expiry == at)
        };
        while self.pending.peek().is_some_and(|e| !live(e)) {
            self.pending.pop();
        }
        if self.pending.len() > 2 * self.tokens_out + 16 {
            self.pending.retain(live);
        }
    }

    /// The claims of `token` if this book sealed it (whether or not its
    /// capability is still in the book): what a refusal can say about a
    /// token of a tree already forgotten ([`RedeemError::Unknown`]).
    pub fn open<'t>(&self, token: &'t [u8]) -> Option<Claims<'t>> {
        token::open(&self.key, token)
    }

    /// Tokens out: delegations made and not yet redeemed, expired or revoked.
    pub fn tokens_out(&self) -> usize {
        self.tokens_out
    }

    /// The next thing the owner must do.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// What the book has done.
    pub fn stats(&self) -> BookStats {
        self.stats
    }

    /// Capabilities in the book (every tree not done).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the book holds no capability.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Whether `cap` is exposed now (live, or revoked and not yet ended).
    pub fn is_exposed(&self, cap: CapId) -> bool {
        self.nodes.get(&cap).is_some_and(|n| matches!(n.state, State::Live | State::Ending))
    }

    /// The range and expiry of `cap`, if the book knows it.
    pub fn bounds(&self, cap: CapId) -> Option<(Range, Duration)> {
        self.nodes.get(&cap).map(|n| (n.range, n.expiry))
    }

    /// The capability `cap` was delegated from (`None` for a root, or an
    /// unknown one).
    pub fn parent(&self, cap: CapId) -> Option<CapId> {
        self.nodes.get(&cap).and_then(|n| n.parent)
    }

    /// Every capability made from `cap`, directly or not (its tree below
    /// it, not `cap` itself), appended to `out`: a walk of that subtree
    /// alone.
    pub fn below(&self, cap: CapId, out: &mut Vec<CapId>) {
        let start = out.len();
        if let Some(n) = self.nodes.get(&cap) {
            out.extend(n.children.iter());
        }
        let mut i = start;
        while i < out.len() {
            if let Some(n) = self.nodes.get(&out[i]) {
                out.extend(n.children.iter());
            }
            i += 1;
        }
    }

    /// Every capability in the book, in no particular order.
    pub fn capabilities(&self) -> impl Iterator<Item = CapId> + '_ {
        self.nodes.keys().copied()
    }

    /// If nothing of `root`'s tree can be exposed any more, say so and forget it.
    fn finish(&mut self, root: CapId) {
        let (mut tree, mut stack) = std::mem::take(&mut self.scratch);
        tree.clear();
        stack.clear();
        stack.push(root);
        let mut over = true;
        while let Some(c) = stack.pop() {
            let Some(n) = self.nodes.get(&c) else { continue };
            if !matches!(n.state, State::Ended | State::Dead(_)) {
                over = false;
                break;
            }
            tree.push(c);
            stack.extend(n.children.iter());
        }
        if over {
            // Nothing in the tree is pending: `pending` has no live entry of it.
            for &c in &tree {
                self.nodes.remove(&c);
            }
            self.stats.done += 1;
            self.events.push_back(Event::Done { root });
        }
        self.scratch = (tree, stack);
    }
}

// `pending` is left out of equality and hashing: its live entries are
// the pending nodes, with their expiries.
impl PartialEq for Book {
    fn eq(&self, o: &Book) -> bool {
        (self.next, &self.nodes, &self.events) == (o.next, &o.nodes, &o.events)
    }
}

impl Eq for Book {}

impl std::hash::Hash for Book {
    /// In the order of the capabilities' ids, so that equal books hash
    /// alike. (It allocates: model checking hashes books, the owner never.)
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let mut nodes: Vec<_> = self.nodes.iter().collect();
        nodes.sort_unstable_by_key(|&(c, _)| *c);
        (self.next, nodes, &self.events).hash(h);
    }
}

/// Fibonacci hashing of an id a program allocates itself, sequentially
/// (the book's capability ids; mwcap's message and lease ids): it spreads
/// them well for a few instructions where SipHash takes a hundred, and its
/// high bits, which hashbrown uses for its control bytes, depend on every
/// bit of the key. Only for keys a peer does not choose: a peer's id may
/// be looked up, never inserted.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
}

impl std::fmt::Debug for Book {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Book")
            .field("capabilities", &self.nodes.len())
            .field("tokens_out", &self.tokens_out)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Thousands of exposures, each delegated once, redeemed and ended,
    /// 16 at a time (as a holder hands on its replies), while an early
    /// token stays out (so that none of theirs reaches the top of the
    /// heap): the heap stays within twice the tokens out, and neither it
    /// nor the map of capabilities grows after the first rounds.
    #[test]
    fn steady_delegation_keeps_the_books_room() {
        let ms = Duration::from_millis;
        let range = Range { offset: 0, len: 64 };
        let mut b = Book::new([1; 32]);
        let first = b.expose(Holder(1), range, ms(1_000_000));
        b.delegate(ms(0), Holder(1), first, range, "early", ms(1), 0).unwrap();
        let mut room = None;
        for round in 0..200u64 {
            let ds: Vec<_> = (0..16)
                .map(|i| {
                    let root = b.expose(Holder(1), range, ms(1_000_000));
                    let d = b.delegate(ms(0), Holder(1), root, range, "d", ms(500_000 + round * 16 + i), i);
                    assert!(b.ended(root));
                    d.unwrap()
                })
                .collect();
            for d in ds {
                let r = b.redeem(ms(0), Holder(2), "d", d.token.as_bytes()).unwrap();
                assert!(b.ended(r.cap));
            }
            while b.poll_event().is_some() {}
            assert_eq!(b.len(), 2, "the first exposure and its token out");
            assert_eq!(b.tokens_out(), 1);
            assert!(b.pending.len() <= 2 * b.tokens_out + 16, "{} entries for 1 token out", b.pending.len());
            assert_eq!(b.poll_timeout(), Some(ms(1)));
            let now = (b.nodes.capacity(), b.pending.capacity());
            if round == 20 {
                room = Some(now);
            } else if round > 20 {
                assert_eq!(Some(now), room, "the book grew in round {round}");
            }
        }
    }
}
