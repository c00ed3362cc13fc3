//! The owner engine: exposes buffers through a pool of type-2 windows.

use std::collections::VecDeque;
use std::time::Duration;

use crate::free_slots::FreeSlots;
use crate::rng::SplitMix64;
use crate::slot_heap::SlotHeap;
use crate::types::TokenKind;
use crate::wire::MAX_LEASE_TIME;
use crate::{rkey, Buffer, Grant, LeaseId, Release, Status, Token, Window};

mod events;
pub use events::*;

/// The owner side of the MW policy for one connection (one RC QP).
///
/// It binds a window of its pool over a buffer, chained with the SEND that
/// carries the [`Grant`], and takes the buffer back only on NIC evidence that
/// no remote access is possible any more: the successful completion of its own
/// LOCAL_INV of that bind, or the QP destroyed. It is the only
/// party that invalidates, exactly once per bind. See the crate docs for the
/// call order and `docs/protocol-mw.md` for the argument.
///
/// Every call costs O(log windows) at most, except the ones that happen
/// once per connection (losing the QP) or only to a hostile peer
/// ([`Owner::handle_peer_invalidation`]), which visit every window.
///
/// # Own windows or lent ones
/// An owner made with [`Owner::new`] keeps its windows: slot `i` always
/// binds window `i`. One made with [`Owner::lending`] has lease slots but
/// no windows: each grant brings one ([`Owner::grant_on`], from a pool
/// the caller shares between connections), and the window goes back in an
/// [`OwnerEvent::WindowUnbound`] once its LOCAL_INV has completed
/// successfully (it is unbound, and may be bound again through any QP of
/// the protection domain). A window whose QP died while it was lent is
/// retired ([`OwnerEvent::WindowRetired`]) and must be deallocated, never
/// lent again.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    slots: Vec<Slot>,
    /// Windows come with each grant and go back unbound
    /// ([`Owner::lending`]).
    lending: bool,
    /// The `Free` slots while the QP is up, lowest first: a grant binds the
    /// lowest free window.
    free: FreeSlots,
    /// The expiry of every `Leased` slot while the QP is up, earliest first.
    expiries: SlotHeap,
    /// Slots `Leased`, `Invalidating` or `Stranded`: buffers not returned.
    outstanding: usize,
    /// Grant SENDs and LOCAL_INVs posted and not completed (the slots'
    /// `send_pending` and `inv_pending` flags that are set).
    pending_wrs: usize,
    /// The QP is destroyed ([`Owner::handle_qp_destroyed`]): what it
    /// exposed is out of reach.
    destroyed: bool,
    /// Scratch for [`Owner::handle_timeout`]: the slots due, to be
    /// invalidated in slot order. Empty between calls.
    due: Vec<u32>,
    rng: SplitMix64,
    link: Link,
    actions: VecDeque<OwnerAction>,
    events: VecDeque<OwnerEvent>,
    stats: OwnerStats,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Link {
    /// The QP is usable.
    Up,
    /// The QP is unusable; `in_err` once there is evidence it is in ERR (an
    /// error or flush completion, or the driver said so).
    Down { in_err: bool },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Slot {
    window: Window,
    /// Binds so far; the current bind's number.
    epoch: u32,
    state: SlotState,
    /// The grant SEND (signaled) has not completed.
    send_pending: bool,
    /// The LOCAL_INV has not completed.
    inv_pending: bool,
    /// The peer invalidated this bind with SEND_WITH_INV: never LOCAL_INV it.
    peer_invalidated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum SlotState {
    /// Unbound, ready for the next bind.
    Free,
    /// Bound; the grant is out.
    Leased { buffer: Buffer, expiry: Duration, cancelled: bool },
    /// LOCAL_INV posted; the buffer returns on its successful completion.
    Invalidating { buffer: Buffer, end: LeaseEnd, cancelled: bool },
    /// The QP is down; the buffer returns when it is destroyed.
    Stranded { buffer: Buffer, end: LeaseEnd, cancelled: bool },
    /// The QP is down and the buffer is back: never rebound; the driver
    /// deallocates the window.
    Retired,
}

impl Owner {
    /// An owner over a pool of freshly allocated (unbound) windows; `seed`
    /// seeds the consumer keys.
    ///
    /// # Panics
    /// If the pool holds more than 2^24 windows (tokens carry a 24-bit index).
    pub fn new(seed: u64, windows: impl IntoIterator<Item = Window>) -> Owner {
        Owner::with_slots(seed, windows, false)
    }

    /// An owner with `slots` lease slots and no windows of its own: each
    /// grant brings one ([`Owner::grant_on`]), and it goes back unbound in
    /// an [`OwnerEvent::WindowUnbound`] (see [the type's docs](Owner)).
    /// `seed` seeds the consumer keys.
    ///
    /// # Panics
    /// If `slots` is over 2^24 (tokens carry a 24-bit index).
    pub fn lending(seed: u64, slots: usize) -> Owner {
        // Until its first grant a slot names no window: an rkey of 0 with
        // epoch 0 matches no release (epoch 0 is never granted).
        let none = Window { handle: u32::MAX, rkey: 0 };
        Owner::with_slots(seed, std::iter::repeat(none).take(slots), true)
    }

    fn with_slots(seed: u64, windows: impl IntoIterator<Item = Window>, lending: bool) -> Owner {
        let slots: Vec<Slot> = windows
            .into_iter()
            .map(|window| Slot {
                window,
                epoch: 0,
                state: SlotState::Free,
                send_pending: false,
                inv_pending: false,
                peer_invalidated: false,
            })
            .collect();
        assert!(slots.len() <= 1 << 24, "a window pool holds at most 2^24 windows");
        let free = FreeSlots::full(slots.len());
        let expiries = SlotHeap::with_slots(slots.len());
        // Sized now, so that granting, releasing and expiring allocate
        // nothing: per slot at most a bind-and-grant and an invalidation
        // queued, and a return and an unbinding to report.
        let (n, queued) = (slots.len(), 2 * slots.len());
        Owner {
            slots,
            lending,
            free,
            expiries,
            outstanding: 0,
            pending_wrs: 0,
            destroyed: false,
            due: Vec::with_capacity(n),
            rng: SplitMix64::new(seed),
            link: Link::Up,
            actions: VecDeque::with_capacity(queued),
            events: VecDeque::with_capacity(queued),
            stats: OwnerStats::default(),
        }
    }

    /// Expose `buffer` for `lease_time` from `now`: binds a free window and
    /// queues a [`OwnerAction::BindAndGrant`]. The buffer comes back in an
    /// [`OwnerEvent::BufferReturned`].
    ///
    /// Only for an owner made with [`Owner::new`]; one made with
    /// [`Owner::lending`] grants with [`Owner::grant_on`].
    pub fn grant(
        &mut self,
        now: Duration,
        buffer: Buffer,
        lease_time: Duration,
    ) -> Result<LeaseId, GrantError> {
        if self.lending {
            return Err(GrantError::WrongWindowSource { lending: true });
        }
        self.grant_with(now, buffer, lease_time, None)
    }

    /// [`Owner::grant`] for an owner made with [`Owner::lending`]: binds
    /// `window` (unbound, of the QP's protection domain, with its current
    /// rkey) over `buffer` in a free lease slot. The window comes back in
    /// the [`OwnerEvent::WindowUnbound`] after the lease's
    /// [`OwnerEvent::BufferReturned`], or in an [`OwnerEvent::WindowRetired`]
    /// if the QP dies first. A refusal hands `window` back untouched.
    pub fn grant_on(
        &mut self,
        now: Duration,
        buffer: Buffer,
        lease_time: Duration,
        window: Window,
    ) -> Result<LeaseId, LendRefused> {
        if !self.lending {
            return Err(LendRefused { error: GrantError::WrongWindowSource { lending: false }, window });
        }
        self.grant_with(now, buffer, lease_time, Some(window)).map_err(|error| LendRefused { error, window })
    }

    fn grant_with(
        &mut self,
        now: Duration,
        buffer: Buffer,
        lease_time: Duration,
        window: Option<Window>,
    ) -> Result<LeaseId, GrantError> {
        if self.link != Link::Up {
            return Err(GrantError::ConnectionLost);
        }
        if buffer.len == 0 {
            return Err(GrantError::EmptyBuffer);
        }
        if lease_time < Duration::from_micros(1) || lease_time > MAX_LEASE_TIME {
            return Err(GrantError::BadLeaseTime(lease_time));
        }
        let Some(idx) = self.free.pop() else {
            return Err(GrantError::NoFreeWindow { pool: self.slots.len() });
        };
        let random = self.rng.next_u8();
        let slot = &mut self.slots[idx as usize];
        debug_assert!(slot.state == SlotState::Free && !slot.send_pending && !slot.inv_pending);
        if let Some(w) = window {
            slot.window = w;
        }
        let expiry = now + lease_time;
        // Bind numbers start at 1 and skip 0 when they wrap (after 2^32
        // binds of the window): 0 names no bind (a slot never granted).
        slot.epoch = slot.epoch.wrapping_add(1).max(1);
        slot.window.rkey = rkey::rebind(slot.window.rkey, random);
        slot.send_pending = true;
        slot.peer_invalidated = false;
        slot.state = SlotState::Leased { buffer, expiry, cancelled: false };
        self.expiries.insert(idx, expiry);
        self.outstanding += 1;
        self.pending_wrs += 1;
        let lease = LeaseId::new(idx, slot.epoch);
        let grant = Grant {
            lease,
            addr: buffer.addr,
            len: buffer.len,
            rkey: slot.window.rkey,
            time_left: lease_time,
        };
        self.actions.push_back(OwnerAction::BindAndGrant(BindAndGrant {
            bind_token: Token::new(TokenKind::Bind, idx, slot.epoch),
            window: slot.window.handle,
            rkey: slot.window.rkey,
            buffer,
            send_token: Token::new(TokenKind::GrantSend, idx, slot.epoch),
            grant,
        }));
        self.stats.grants += 1;
        self.check_indexes();
        Ok(lease)
    }

    /// The user no longer needs the lease. The window stays bound until the
    /// peer releases it or it expires, so that a healthy peer never READs an
    /// invalidated window; the [`OwnerEvent::BufferReturned`] then says
    /// `cancelled`.
    pub fn cancel(&mut self, _now: Duration, lease: LeaseId) -> Result<(), CancelError> {
        let slot = self.slot_of(lease).ok_or(CancelError::NotActive(lease))?;
        match &mut slot.state {
            SlotState::Leased { cancelled, .. }
            | SlotState::Invalidating { cancelled, .. }
            | SlotState::Stranded { cancelled, .. } => {
                *cancelled = true;
                Ok(())
            }
            SlotState::Free | SlotState::Retired => Err(CancelError::NotActive(lease)),
        }
    }

    /// Take a lease back now, before the peer releases it or it expires (a
    /// capability its owner revokes): its window is invalidated at once,
    /// with the one LOCAL_INV of its bind (as at expiry), so a READ the peer
    /// posts after the invalidation fails with a remote access error, and
    /// the buffer comes back in [`OwnerEvent::BufferReturned`] with
    /// [`LeaseEnd::Revoked`] once the invalidation completes (never
    /// before: the NIC's completion is the evidence). A lease already
    /// ending (released, expired, or its QP down) ends as it was going to,
    /// and a release or expiry that comes after this finds it ended.
    /// Refused for a lease that is not active.
    pub fn revoke(&mut self, _now: Duration, lease: LeaseId) -> Result<(), CancelError> {
        let idx = lease.slot() as usize;
        let up = self.link == Link::Up;
        let slot = self.slot_of(lease).ok_or(CancelError::NotActive(lease))?;
        match slot.state {
            SlotState::Leased { .. } if up => {
                self.stats.revoked += 1;
                self.invalidate(idx, LeaseEnd::Revoked);
            }
            SlotState::Leased { .. } | SlotState::Invalidating { .. } | SlotState::Stranded { .. } => {}
            SlotState::Free | SlotState::Retired => return Err(CancelError::NotActive(lease)),
        }
        self.check_indexes();
        Ok(())
    }

    /// A [`Release`] arrived from the peer. A valid one (active lease,
    /// current rkey) ends the lease with a LOCAL_INV; anything else is
    /// counted and ignored.
    pub fn handle_release(&mut self, _now: Duration, release: Release) {
        let idx = release.lease.slot() as usize;
        let Some(slot) = self.slots.get(idx) else {
            self.stats.forged_releases += 1;
            return;
        };
        let epoch = release.lease.epoch();
        if epoch != slot.epoch {
            if epoch != 0 && epoch < slot.epoch {
                self.stats.stale_releases += 1;
            } else {
                self.stats.forged_releases += 1;
            }
            return;
        }
        if release.rkey != slot.window.rkey {
            self.stats.forged_releases += 1;
            return;
        }
        match slot.state {
            SlotState::Leased { .. } if self.link == Link::Up => {
                self.stats.released += 1;
                self.invalidate(idx, if release.unread { LeaseEnd::Unread } else { LeaseEnd::Released });
            }
            SlotState::Leased { .. }
            | SlotState::Invalidating { .. }
            | SlotState::Stranded { .. }
            | SlotState::Retired => self.stats.stale_releases += 1,
            // Epoch 0 is never granted, so a Free slot with a matching epoch
            // had a lease that already returned.
            SlotState::Free if epoch == 0 => self.stats.forged_releases += 1,
            SlotState::Free => self.stats.stale_releases += 1,
        }
        self.check_indexes();
    }

    /// A completion of one of the owner's work requests (route by
    /// [`Token::engine`]). Error statuses put the QP on the ERR path.
    pub fn handle_completion(&mut self, _now: Duration, token: Token, status: Status) {
        let idx = token.slot() as usize;
        let known =
            matches!(token.kind(), Some(TokenKind::Bind | TokenKind::GrantSend | TokenKind::Invalidate))
                && self.slots.get(idx).is_some_and(|s| s.epoch == token.epoch() && s.epoch != 0);
        if !known {
            self.stats.unknown_completions += 1;
            return;
        }
        let slot = &mut self.slots[idx];
        match token.kind() {
            Some(TokenKind::GrantSend) if slot.send_pending => {
                slot.send_pending = false;
                self.pending_wrs -= 1;
            }
            Some(TokenKind::Invalidate) if slot.inv_pending => {
                slot.inv_pending = false;
                self.pending_wrs -= 1;
                if status.is_success() {
                    // The window is unbound now; the buffer may return.
                    if let SlotState::Invalidating { buffer, end, cancelled } = slot.state {
                        slot.state = SlotState::Stranded { buffer, end, cancelled };
                    }
                }
            }
            // The bind is unsignaled; its completion only matters as an error.
            Some(TokenKind::Bind) => {}
            _ => {
                self.stats.unknown_completions += 1;
                return;
            }
        }
        if !status.is_success() {
            self.go_down(LossCause::WorkRequestFailed(status), true);
        }
        self.settle(Some(idx));
        self.check_indexes();
    }

    /// The owner's expiry timers: every lease whose time is up is invalidated
    /// (in window order when several are).
    pub fn handle_timeout(&mut self, now: Duration) {
        if self.link != Link::Up {
            return;
        }
        let mut due = std::mem::take(&mut self.due);
        while let Some((expiry, idx)) = self.expiries.peek() {
            if expiry > now {
                break;
            }
            self.expiries.pop();
            due.push(idx);
        }
        due.sort_unstable();
        for &idx in &due {
            self.stats.expired += 1;
            self.invalidate(idx as usize, LeaseEnd::Expired);
        }
        due.clear();
        self.due = due;
        self.check_indexes();
    }

    /// A receive completed carrying `invalidated_rkey`: the peer used
    /// SEND_WITH_INV, which this protocol forbids. That bind is never
    /// LOCAL_INVed; the connection is torn down ([`OwnerAction::FlushQp`]).
    pub fn handle_peer_invalidation(&mut self, _now: Duration, rkey: u32) {
        self.stats.peer_invalidations += 1;
        // A search by rkey over the pool: only a hostile peer gets here, and
        // the connection is over.
        let hit = self.slots.iter_mut().find(|s| {
            s.window.rkey == rkey
                && matches!(
                    s.state,
                    SlotState::Leased { .. } | SlotState::Invalidating { .. } | SlotState::Stranded { .. }
                )
        });
        let window = hit.map(|s| {
            s.peer_invalidated = true;
            s.window.handle
        });
        self.withdraw_invalidation(rkey);
        self.events.push_back(OwnerEvent::PeerMisbehaved(Misbehavior::SendWithInvalidate { rkey, window }));
        self.flush_for(LossCause::HostilePeer);
        self.settle(None);
        self.check_indexes();
    }

    /// Whether `rkey` is the key of one of this owner's current binds (a
    /// window leased, being invalidated, or stranded by a loss).
    pub fn binds_rkey(&self, rkey: u32) -> bool {
        self.slots.iter().any(|s| {
            s.window.rkey == rkey
                && matches!(
                    s.state,
                    SlotState::Leased { .. } | SlotState::Invalidating { .. } | SlotState::Stranded { .. }
                )
        })
    }

    /// One of this owner's windows, bound with `rkey`, was invalidated by a
    /// SEND_WITH_INV received on *another* queue pair of the device, which
    /// the driver saw (a device that does not scope invalidation to the
    /// window's queue pair: rxe). The window has had its one invalidation:
    /// the owner never posts another for it (on rxe a second one panics the
    /// kernel). Its peer did nothing wrong, but a READ of it through the
    /// window now fails, so the connection goes down
    /// ([`LossCause::InvalidatedElsewhere`]) and its buffers come back at
    /// the QP's destroy, as for [`handle_peer_invalidation`](Owner::handle_peer_invalidation).
    /// Returns false (and changes nothing) when no current bind has `rkey`;
    /// the same news again changes nothing either (returns true).
    pub fn handle_invalidation_elsewhere(&mut self, _now: Duration, rkey: u32) -> bool {
        let hit = self.slots.iter_mut().find(|s| {
            s.window.rkey == rkey
                && matches!(
                    s.state,
                    SlotState::Leased { .. } | SlotState::Invalidating { .. } | SlotState::Stranded { .. }
                )
        });
        let Some(slot) = hit else { return false };
        if slot.peer_invalidated {
            return true;
        }
        slot.peer_invalidated = true;
        self.stats.peer_invalidations += 1;
        self.withdraw_invalidation(rkey);
        self.flush_for(LossCause::InvalidatedElsewhere);
        self.settle(None);
        self.check_indexes();
        true
    }

    /// The driver takes the connection down and has asked for its QP to go
    /// to ERR, which has not happened yet (or failed): no more grants and
    /// no expiry, and no leased buffer returns until the QP is destroyed
    /// ([`Owner::handle_qp_destroyed`]).
    pub fn handle_connection_lost(&mut self, _now: Duration) {
        self.go_down(LossCause::ConnectionLost, false);
        self.check_indexes();
    }

    /// The QP is in ERR (async event, a flush the driver did, or the other
    /// engine's error): no more grants and no expiry. Leased buffers still
    /// do not return: a NIC may be copying a READ response's packet out of
    /// one after the move to ERR and the flush of the send queue (rxe's
    /// responder looks at the QP's state only between packets, copying
    /// outside any lock). They return when the QP is destroyed
    /// ([`Owner::handle_qp_destroyed`]), which the driver does once the
    /// flushes are in.
    pub fn handle_qp_error(&mut self, _now: Duration) {
        self.go_down(LossCause::QpError, true);
        self.settle(None);
        self.check_indexes();
    }

    /// The QP is destroyed: no DMA of it can happen any more, so every
    /// buffer returns now and every window is retired.
    pub fn handle_qp_destroyed(&mut self, _now: Duration) {
        self.go_down(LossCause::QpDestroyed, true);
        self.destroyed = true;
        for s in &mut self.slots {
            s.send_pending = false;
            s.inv_pending = false;
        }
        self.pending_wrs = 0;
        self.settle(None);
        self.check_indexes();
    }

    /// Whether actions or events wait to be polled (a driver with none
    /// skips polling).
    #[inline]
    pub fn has_output(&self) -> bool {
        !self.actions.is_empty() || !self.events.is_empty()
    }

    /// The next work to post, in order.
    pub fn poll_action(&mut self) -> Option<OwnerAction> {
        self.actions.pop_front()
    }

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<OwnerEvent> {
        self.events.pop_front()
    }

    /// When [`Owner::handle_timeout`] must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.link != Link::Up {
            return None;
        }
        self.expiries.peek().map(|(expiry, _)| expiry)
    }

    /// Windows free for a grant now; for an owner made with
    /// [`Owner::lending`], lease slots free (each grant brings its window).
    pub fn free_windows(&self) -> usize {
        if self.link != Link::Up {
            return 0;
        }
        self.free.len()
    }

    /// Buffers not yet returned.
    pub fn outstanding_buffers(&self) -> usize {
        self.outstanding
    }

    /// Whether the QP is considered unusable.
    pub fn is_connection_lost(&self) -> bool {
        self.link != Link::Up
    }

    /// The counters.
    pub fn stats(&self) -> OwnerStats {
        self.stats
    }

    fn slot_of(&mut self, lease: LeaseId) -> Option<&mut Slot> {
        let slot = self.slots.get_mut(lease.slot() as usize)?;
        (slot.epoch == lease.epoch() && slot.epoch != 0).then_some(slot)
    }

    /// Post the one LOCAL_INV of the current bind of slot `idx` (which is
    /// `Leased`: a bind is posted, and no invalidation yet).
    fn invalidate(&mut self, idx: usize, end: LeaseEnd) {
        let slot = &mut self.slots[idx];
        let SlotState::Leased { buffer, cancelled, .. } = slot.state else { return };
        self.expiries.remove(idx as u32);
        if slot.peer_invalidated {
            // Unreachable while the QP is up (a peer invalidation takes it
            // down at once), hence no settle here.
            slot.state = SlotState::Stranded { buffer, end, cancelled };
            return;
        }
        slot.state = SlotState::Invalidating { buffer, end, cancelled };
        slot.inv_pending = true;
        self.pending_wrs += 1;
        self.stats.invalidations += 1;
        self.actions.push_back(OwnerAction::Invalidate {
            token: Token::new(TokenKind::Invalidate, idx as u32, slot.epoch),
            window: slot.window.handle,
            rkey: slot.window.rkey,
        });
    }

    /// The window bound with `rkey` was invalidated by someone else: a
    /// LOCAL_INV of it still queued (the driver has not taken it: the
    /// release came in the same batch) is withdrawn, for the window has had
    /// its one invalidation and on rxe a second panics the kernel. (One the
    /// driver took is posted before the move to ERR this asks for, and
    /// flushed by it, unless that move fails.) Its slot waits for the QP's
    /// destroy, as any the peer invalidated.
    fn withdraw_invalidation(&mut self, rkey: u32) {
        let queued = self.actions.len();
        self.actions.retain(|a| !matches!(a, OwnerAction::Invalidate { rkey: r, .. } if *r == rkey));
        if self.actions.len() == queued {
            return;
        }
        if let Some(s) = self.slots.iter_mut().find(|s| s.window.rkey == rkey && s.inv_pending) {
            s.inv_pending = false;
            self.pending_wrs -= 1;
        }
    }

    /// A window was invalidated behind the owner's back: the QP must be
    /// flushed before any LOCAL_INV the owner posted earlier executes.
    /// Asks for it ([`OwnerAction::FlushQp`]) and goes down for `cause`; a
    /// driver that took the connection down already is asked again unless
    /// the QP is known to be in ERR (its move there may have failed).
    fn flush_for(&mut self, cause: LossCause) {
        match self.link {
            Link::Up => {
                self.actions.push_back(OwnerAction::FlushQp);
                self.go_down(cause, false);
            }
            Link::Down { in_err: false } => self.actions.push_back(OwnerAction::FlushQp),
            Link::Down { in_err: true } => {}
        }
    }

    fn go_down(&mut self, cause: LossCause, in_err: bool) {
        match &mut self.link {
            Link::Up => {
                self.link = Link::Down { in_err };
                self.events.push_back(OwnerEvent::ConnectionLost { cause });
                // Once per connection: no grant, no expiry from now on.
                self.free.clear();
                self.expiries.clear();
                for s in &mut self.slots {
                    s.state = match s.state {
                        // A free slot of a lending owner holds no window.
                        SlotState::Free if self.lending => SlotState::Retired,
                        SlotState::Free => {
                            self.events.push_back(OwnerEvent::WindowRetired { window: s.window.handle });
                            SlotState::Retired
                        }
                        SlotState::Leased { buffer, cancelled, .. } => {
                            SlotState::Stranded { buffer, end: LeaseEnd::ConnectionLost, cancelled }
                        }
                        SlotState::Invalidating { buffer, end, cancelled } => {
                            SlotState::Stranded { buffer, end, cancelled }
                        }
                        other => other,
                    };
                }
            }
            Link::Down { in_err: e } => *e |= in_err,
        }
    }

    /// Return every buffer that has its evidence. `touched` is the slot a
    /// completion just changed.
    ///
    /// With the QP up, a `Stranded` slot is one whose LOCAL_INV succeeded:
    /// it returns once its grant SEND has completed too. Only a completion
    /// changes that, and only for its own slot, so only `touched` needs a
    /// look (no other slot is `Stranded` and ready after any call). With
    /// the QP down, every outstanding buffer is `Stranded` and returns, in
    /// slot order, once the QP is destroyed.
    fn settle(&mut self, touched: Option<usize>) {
        match self.link {
            Link::Up => {
                let Some(idx) = touched else { return };
                let s = &mut self.slots[idx];
                let SlotState::Stranded { buffer, end, cancelled } = s.state else { return };
                if s.send_pending || s.inv_pending {
                    return;
                }
                let lease = LeaseId::new(idx as u32, s.epoch);
                self.events.push_back(OwnerEvent::BufferReturned { lease, buffer, end, cancelled });
                if self.lending {
                    // Its LOCAL_INV completed successfully (the only way to
                    // `Stranded` with the QP up): unbound, so it may serve
                    // another QP of the protection domain.
                    self.events.push_back(OwnerEvent::WindowUnbound { lease, window: s.window });
                }
                s.state = SlotState::Free;
                self.free.insert(idx as u32);
                self.outstanding -= 1;
            }
            Link::Down { .. } => {
                if !self.destroyed || self.outstanding == 0 {
                    return;
                }
                for (idx, s) in self.slots.iter_mut().enumerate() {
                    let SlotState::Stranded { buffer, end, cancelled } = s.state else { continue };
                    let lease = LeaseId::new(idx as u32, s.epoch);
                    self.events.push_back(OwnerEvent::BufferReturned { lease, buffer, end, cancelled });
                    s.state = SlotState::Retired;
                    self.events.push_back(OwnerEvent::WindowRetired { window: s.window.handle });
                    self.outstanding -= 1;
                }
            }
        }
    }

    /// Buffers the owner keeps only until the QP is destroyed: with the
    /// connection lost and none of its work requests outstanding, every
    /// one it still holds (0 otherwise, and once the QP is destroyed).
    pub fn waits_for_destroy(&self) -> usize {
        let flushed = matches!(self.link, Link::Down { .. }) && self.pending_wrs == 0;
        if flushed && !self.destroyed {
            self.outstanding
        } else {
            0
        }
    }

    /// Debug builds: the indexes agree with the slots (O(windows), so not
    /// in release builds).
    fn check_indexes(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let up = self.link == Link::Up;
        let free = || {
            (0..self.slots.len() as u32).filter(|&i| up && self.slots[i as usize].state == SlotState::Free)
        };
        crate::assert_lists("free list", || self.free.iter(), free);
        let expiries = || {
            (0..self.slots.len() as u32).filter_map(|i| match self.slots[i as usize].state {
                SlotState::Leased { expiry, .. } if up => Some((i, expiry)),
                _ => None,
            })
        };
        crate::assert_lists("expiry timers", || self.expiries.entries(), expiries);
        let outstanding = self
            .slots
            .iter()
            .filter(|s| {
                matches!(
                    s.state,
                    SlotState::Leased { .. } | SlotState::Invalidating { .. } | SlotState::Stranded { .. }
                )
            })
            .count();
        assert_eq!(self.outstanding, outstanding, "outstanding buffers");
        let pending: usize =
            self.slots.iter().map(|s| usize::from(s.send_pending) + usize::from(s.inv_pending)).sum();
        assert_eq!(self.pending_wrs, pending, "pending work requests");
        if up {
            assert!(
                !self.slots.iter().any(|s| matches!(s.state, SlotState::Stranded { .. })
                    && !s.send_pending
                    && !s.inv_pending),
                "a returnable buffer was kept"
            );
        }
        assert!(self.due.is_empty());
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod wrap {
    use super::*;

    /// The peer's release and its SEND_WITH_INV of the same window come in
    /// one batch, before the driver takes the LOCAL_INV the release queued:
    /// the LOCAL_INV is withdrawn (the window had its one invalidation, and
    /// on rxe a second panics the kernel), the QP is flushed, and the
    /// buffer comes back at the destroy. Before, the LOCAL_INV stayed
    /// queued, and went out on a live QP if the move to ERR failed.
    #[test]
    fn a_queued_invalidation_of_a_window_the_peer_invalidated_is_withdrawn() {
        let mut o = Owner::new(1, [Window { handle: 0, rkey: 0x100 }]);
        let buffer = Buffer { mr: 1, offset: 0, len: 8, addr: 0x1000 };
        let t = Duration::ZERO;
        let lease = o.grant(t, buffer, Duration::from_secs(1)).expect("a free window");
        let Some(OwnerAction::BindAndGrant(bg)) = o.poll_action() else { panic!("a bind") };
        o.handle_completion(t, bg.send_token, Status::Success);
        assert!(o.revoke(t, lease).is_ok());
        // The LOCAL_INV is queued, not taken; the peer invalidates the window.
        o.handle_peer_invalidation(t, bg.rkey);
        let actions: Vec<_> = std::iter::from_fn(|| o.poll_action()).collect();
        assert!(
            !actions.iter().any(|a| matches!(a, OwnerAction::Invalidate { .. })),
            "no second invalidation: {actions:?}"
        );
        assert!(actions.iter().any(|a| matches!(a, OwnerAction::FlushQp)), "the QP is flushed: {actions:?}");
        assert_eq!(
            o.waits_for_destroy(),
            1,
            "nothing posted waits for a completion: the buffer waits for the destroy"
        );
        o.handle_qp_destroyed(t);
        let returned =
            std::iter::from_fn(|| o.poll_event()).any(|e| matches!(e, OwnerEvent::BufferReturned { .. }));
        assert!(returned, "the buffer comes back at the destroy");
    }

    /// After 2^32 binds of a window its bind number wraps: it skips 0,
    /// which names no bind (before, the 2^32nd-and-first lease was taken
    /// for a slot never granted: its revocation was refused, its
    /// completions ignored, and its buffer and window never came back).
    #[test]
    fn a_window_bound_2_pow_32_times_still_ends_its_lease() {
        let mut o = Owner::new(1, [Window { handle: 0, rkey: 0 }]);
        o.slots[0].epoch = u32::MAX;
        let buffer = Buffer { mr: 1, offset: 0, len: 8, addr: 0x1000 };
        let t = Duration::ZERO;
        let lease = o.grant(t, buffer, Duration::from_secs(1)).expect("a free window");
        assert_eq!(lease.epoch(), 1, "0 is skipped");
        let Some(OwnerAction::BindAndGrant(bg)) = o.poll_action() else { panic!("a bind") };
        o.handle_completion(t, bg.send_token, Status::Success);
        assert!(o.revoke(t, lease).is_ok(), "the live lease is revocable");
        let Some(OwnerAction::Invalidate { token, .. }) = o.poll_action() else { panic!("one LOCAL_INV") };
        o.handle_completion(t, token, Status::Success);
        let returned =
            std::iter::from_fn(|| o.poll_event()).any(|e| matches!(e, OwnerEvent::BufferReturned { .. }));
        assert!(returned, "the buffer comes back on the invalidation's completion");
        assert_eq!(o.stats().unknown_completions, 0);
        assert_eq!(o.free_windows(), 1);
    }
}
