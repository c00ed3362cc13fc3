//! The delegation model's world, shared by the exhaustive check
//! (`model.rs`) and the random walks (`prop_book.rs`): the real [`Book`]
//! beside a model of the owner's exposures, connections that try every
//! token, and a clock; each step checks what the book did against what the
//! model remembers, and records the first violation.

#![allow(dead_code)] // each test file uses part of it

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use mwcap_delegation::{Book, CapId, Event, Holder, Range, Token};

/// The connections and the identity each authenticated as.
pub const CONNS: [(Holder, &str); 3] = [(Holder(1), "h"), (Holder(2), "d"), (Holder(3), "e")];
pub const ROOT_HOLDER: Holder = Holder(1);
pub const ROOT_RANGE: Range = Range { offset: 0, len: 4 };

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    /// The root's expiry, in ticks; the clock ends there.
    pub t_end: u64,
    /// Tokens sealed at most.
    pub tokens: usize,
    /// The identities delegations are made for (every connection tries
    /// every token with its own).
    pub to: &'static [&'static str],
    /// Delegations may also last one tick (tokens that expire before the
    /// capability they were made from).
    pub short: bool,
}

/// A token sealed, with what the model knows it says.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sealed {
    token: Token,
    identity: &'static str,
    range: Range,
    expiry: u64,
    /// Its capability, and the one it was made from.
    cap: CapId,
    parent: CapId,
    redeemed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct World {
    pub book: Book,
    pub now: u64,
    pub root: CapId,
    /// Exposures the owner's engines have made (a window bound or an offer
    /// out), by capability: holder, and whether the book asked to end it.
    pub exposed: BTreeMap<CapId, (Holder, bool)>,
    /// Who held each capability (the root's holder, each redeemer).
    holders: BTreeMap<CapId, Holder>,
    /// Capabilities the model revoked: the book's word is checked against
    /// them.
    revoked: BTreeSet<CapId>,
    pub tokens: Vec<Sealed>,
    /// Connections gone (their QP destroyed).
    dead: BTreeSet<Holder>,
    /// The root's tree is done: its memory may be reused.
    pub done: bool,
    /// Times the book said End, by capability.
    ends: BTreeMap<CapId, u8>,
    /// A delegate redeemed after the root's holder released it.
    pub released_with_token_out: bool,
    /// A delegation of a delegation was redeemed.
    pub second_level: bool,
    /// A live delegation was revoked.
    pub revoked_live: bool,
    /// A token was refused for its expiry.
    pub refused_expired: bool,
    pub violation: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// `by` delegates part (or more, or for longer: asking too much) of
    /// `cap` to `to`.
    Delegate {
        by: Holder,
        cap: CapId,
        range: Range,
        to: &'static str,
        expiry: u64,
    },
    Redeem {
        token: usize,
        by: Holder,
    },
    /// The exposure of `cap` ends on evidence: released by its holder and
    /// invalidated, expired and invalidated, or ended after the book asked.
    End {
        cap: CapId,
    },
    Revoke {
        cap: CapId,
    },
    RevokeDelegations {
        by: Holder,
        cap: CapId,
    },
    /// A connection goes away: its QP destroyed, its exposures end.
    Die {
        who: Holder,
    },
    Tick,
}

fn identity(h: Holder) -> &'static str {
    CONNS.iter().find(|(c, _)| *c == h).map(|(_, id)| *id).expect("a known connection")
}

fn dur(t: u64) -> Duration {
    Duration::from_millis(t)
}

impl World {
    pub fn new(cfg: &Config) -> World {
        let mut book = Book::new([7; 32]);
        let root = book.expose(ROOT_HOLDER, ROOT_RANGE, dur(cfg.t_end));
        World {
            book,
            now: 0,
            root,
            exposed: BTreeMap::from([(root, (ROOT_HOLDER, false))]),
            holders: BTreeMap::from([(root, ROOT_HOLDER)]),
            revoked: BTreeSet::new(),
            tokens: Vec::new(),
            dead: BTreeSet::new(),
            done: false,
            ends: BTreeMap::new(),
            released_with_token_out: false,
            second_level: false,
            revoked_live: false,
            refused_expired: false,
            violation: None,
        }
    }

    fn fail(&mut self, why: String) {
        self.violation.get_or_insert(why);
    }

    /// What the model knows `cap` covers, and until when.
    fn bounds(&self, cfg_end: u64, cap: CapId) -> (Range, u64) {
        if cap == self.root {
            return (ROOT_RANGE, cfg_end);
        }
        let t = self.tokens.iter().find(|t| t.cap == cap).expect("a token's capability");
        (t.range, t.expiry)
    }

    fn parent_of(&self, cap: CapId) -> Option<CapId> {
        self.tokens.iter().find(|t| t.cap == cap).map(|t| t.parent)
    }

    /// Whether `cap` or a capability above it was revoked.
    fn revoked_above(&self, mut cap: CapId) -> bool {
        loop {
            if self.revoked.contains(&cap) {
                return true;
            }
            match self.parent_of(cap) {
                Some(p) => cap = p,
                None => return false,
            }
        }
    }

    pub fn enabled(&self, cfg: &Config, out: &mut Vec<Step>) {
        if self.violation.is_some() {
            return;
        }
        for (&cap, &(holder, _)) in &self.exposed {
            out.push(Step::End { cap });
            if self.tokens.len() < cfg.tokens && !self.dead.contains(&holder) {
                let (r, expiry) = self.bounds(cfg.t_end, cap);
                let half = Range { offset: r.offset, len: r.len / 2 };
                let wide = Range { offset: r.offset + r.len / 2, len: r.len };
                for range in [r, half, wide] {
                    let short = (self.now + 1 < expiry && cfg.short).then_some(self.now + 1);
                    for e in [Some(expiry), Some(expiry + 1), short].into_iter().flatten() {
                        for &to in cfg.to {
                            out.push(Step::Delegate { by: holder, cap, range, to, expiry: e });
                        }
                    }
                }
            }
        }
        for token in 0..self.tokens.len() {
            for (by, _) in CONNS {
                if !self.dead.contains(&by) {
                    out.push(Step::Redeem { token, by });
                }
            }
        }
        for cap in self.book.capabilities() {
            if !self.revoked.contains(&cap) {
                out.push(Step::Revoke { cap });
            }
            for (by, _) in CONNS {
                if !self.dead.contains(&by) {
                    out.push(Step::RevokeDelegations { by, cap });
                }
            }
        }
        for (who, _) in CONNS {
            if !self.dead.contains(&who) {
                out.push(Step::Die { who });
            }
        }
        if self.now < cfg.t_end {
            out.push(Step::Tick);
        }
    }

    pub fn step(&mut self, cfg: &Config, step: Step) {
        match step {
            Step::Delegate { by, cap, range, to, expiry } => {
                let (held, until) = self.bounds(cfg.t_end, cap);
                let within = held.contains(range) && expiry <= until;
                let live = self.exposed.get(&cap).is_some_and(|&(_, ending)| !ending) && self.now < until;
                let nonce = self.tokens.len() as u64;
                match self.book.delegate(dur(self.now), by, cap, range, to, dur(expiry), nonce) {
                    Ok(d) => {
                        if !within {
                            self.fail(format!(
                                "delegated {range:?} until {expiry} from {held:?} until {until}"
                            ));
                        }
                        if self.revoked_above(cap) {
                            self.fail(format!("delegated from revoked {cap:?}"));
                        }
                        let (token, id) = (d.token, d.cap);
                        self.tokens.push(Sealed {
                            token,
                            identity: to,
                            range,
                            expiry,
                            cap: id,
                            parent: cap,
                            redeemed: false,
                        });
                    }
                    Err(e) => {
                        if within && live && !self.revoked_above(cap) && self.now < expiry {
                            self.fail(format!(
                                "a delegation within {cap:?}, which is live, was refused: {e}"
                            ));
                        }
                    }
                }
            }
            Step::Redeem { token, by } => {
                let t = self.tokens[token].clone();
                let root_released = !self.exposed.contains_key(&self.root);
                let redeemable = !t.redeemed
                    && t.identity == identity(by)
                    && self.now < t.expiry
                    && !self.revoked_above(t.cap)
                    && !self.done;
                match self.book.redeem(dur(self.now), by, identity(by), t.token.as_bytes()) {
                    Ok(r) => {
                        if r.cap != t.cap {
                            self.fail(format!("token {token} redeemed {:?}, not its own {:?}", r.cap, t.cap));
                        }
                        if t.redeemed {
                            self.fail(format!("token {token} redeemed twice"));
                        }
                        if t.identity != identity(by) {
                            self.fail(format!(
                                "token {token} for {} redeemed by {}",
                                t.identity,
                                identity(by)
                            ));
                        }
                        if self.now >= t.expiry {
                            self.fail(format!(
                                "token {token} redeemed at {} after its expiry {}",
                                self.now, t.expiry
                            ));
                        }
                        if self.revoked_above(t.cap) {
                            self.fail(format!("token {token} redeemed after it was revoked"));
                        }
                        if self.done {
                            self.fail(format!("token {token} redeemed after the memory was given back"));
                        }
                        if (r.range, r.expiry) != (t.range, dur(t.expiry)) {
                            self.fail(format!("token {token} redeemed for {r:?}"));
                        }
                        self.exposed.insert(r.cap, (by, false));
                        self.holders.insert(r.cap, by);
                        self.released_with_token_out |= root_released;
                        self.second_level |= t.parent != self.root;
                        self.tokens[token].redeemed = true;
                    }
                    Err(e) => {
                        if redeemable {
                            self.fail(format!("token {token}, redeemable by {by:?}, was refused: {e}"));
                        }
                        self.refused_expired |= matches!(e, mwcap_delegation::RedeemError::Expired(_));
                    }
                }
            }
            Step::End { cap } => {
                self.exposed.remove(&cap);
                if !self.book.ended(cap) {
                    self.fail(format!("the book did not know exposure {cap:?} was live"));
                }
            }
            Step::Revoke { cap } => {
                if self.book.revoke(cap).is_ok() {
                    self.mark_revoked(cap, true);
                }
            }
            Step::RevokeDelegations { by, cap } => {
                if self.book.revoke_delegations(by, cap).is_ok() {
                    if self.holders.get(&cap) != Some(&by) {
                        self.fail(format!("{by:?} revoked the delegations of {cap:?}, never its holder"));
                    }
                    self.mark_revoked(cap, false);
                }
            }
            Step::Die { who } => {
                self.dead.insert(who);
                let mine: Vec<CapId> =
                    self.exposed.iter().filter(|(_, &(h, _))| h == who).map(|(&c, _)| c).collect();
                for cap in mine {
                    self.exposed.remove(&cap);
                    self.book.ended(cap);
                }
            }
            Step::Tick => self.now += 1,
        }
        // The owner's driver fires the book's timer as soon as it is due.
        if self.book.poll_timeout().is_some_and(|t| t <= dur(self.now)) {
            self.book.handle_timeout(dur(self.now));
        }
        self.take_events();
    }

    /// The model's own record of a revocation: `cap` (if `itself`) and
    /// every delegation below it, redeemed or not.
    fn mark_revoked(&mut self, cap: CapId, itself: bool) {
        if itself {
            self.revoked.insert(cap);
        }
        let below: Vec<CapId> = self.tokens.iter().filter(|t| t.parent == cap).map(|t| t.cap).collect();
        for c in below {
            self.revoked_live |= self.exposed.get(&c).is_some_and(|&(_, ending)| !ending);
            self.mark_revoked(c, true);
        }
    }

    fn take_events(&mut self) {
        while let Some(e) = self.book.poll_event() {
            match e {
                Event::End { cap, holder } => {
                    let n = self.ends.entry(cap).or_insert(0);
                    *n += 1;
                    if *n > 1 {
                        self.fail(format!("End said twice for {cap:?}"));
                    }
                    if !self.revoked.contains(&cap) {
                        self.fail(format!("End for {cap:?}, which was not revoked"));
                    }
                    match self.exposed.get_mut(&cap) {
                        Some((h, ending)) if *h == holder => *ending = true,
                        _ => self
                            .fail(format!("End for {cap:?} of {holder:?}, which the owner does not expose")),
                    }
                }
                Event::Done { root } => {
                    if root != self.root || self.done {
                        self.fail(format!("Done for {root:?} again or unknown"));
                    }
                    if !self.exposed.is_empty() {
                        self.fail(format!("the memory came back with {:?} still exposed", self.exposed));
                    }
                    let redeemable = self
                        .tokens
                        .iter()
                        .any(|t| !t.redeemed && !self.revoked_above(t.cap) && self.now < t.expiry);
                    if redeemable {
                        self.fail("the memory came back with a token still redeemable".into());
                    }
                    self.done = true;
                }
            }
        }
    }
}
