//! The reader engine: READs what an owner granted, then releases it.

use std::collections::VecDeque;
use std::time::Duration;

use crate::free_slots::FreeSlots;
use crate::slot_heap::SlotHeap;
use crate::types::TokenKind;
use crate::{Buffer, Grant, LeaseId, Release, Status, Token};

/// How the reader's [`Release`] travels back to the owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReleaseMode {
    /// A SEND of its own right after the READ ([`ReaderAction::SendRelease`]).
    /// Used when the owner is the server (reply data): the client releases.
    Message,
    /// Handed to the user in the event ([`ReaderEvent::ReadDone::release`]),
    /// to be carried inside the response. Used when the owner is the client
    /// (request data): the server's response implies the release.
    Piggyback,
}

/// Reader settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReaderConfig {
    /// Time subtracted from a grant's time left before deciding to READ. It
    /// must cover the grant's one-way delay, the clock-rate difference
    /// between the two hosts over a lease time, and the READ's worst latency.
    pub safety_margin: Duration,
    /// How releases travel.
    pub release: ReleaseMode,
    /// The longest lease an owner of this connection may grant (the lease
    /// time both sides agreed on). A grant's time left is counted as at
    /// most this: a hostile owner's larger one would otherwise put the
    /// READ's deadline, the reader's only bound on a READ that never
    /// completes, as far out as the wire allows (71 minutes).
    pub max_lease: Duration,
}

/// The reader side of the MW policy for one connection (one RC QP).
///
/// On a [`Grant`] it computes its own deadline from the time left and READs
/// only if the safety margin fits; after a successful READ it releases. A
/// READ still outstanding when the owner's lease may have ended (receive
/// time + time left) is treated as hung (rxe never completes a READ whose
/// window was invalidated under it): the reader asks for the QP to be
/// flushed, and the destination comes back with the READ's flush completion.
///
/// Every call costs O(log reads) at most, except the ones that happen once
/// per connection (losing the QP), which visit every READ slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reader {
    config: ReaderConfig,
    slots: Vec<ReadSlot>,
    /// The slots with no READ, lowest first: a READ takes the lowest.
    free: FreeSlots,
    /// The deadline of every outstanding READ while the QP is up, earliest
    /// first.
    deadlines: SlotHeap,
    /// Scratch for [`Reader::handle_timeout`]: the slots due, reported in
    /// slot order. Empty between calls.
    due: Vec<u32>,
    link: Link,
    actions: VecDeque<ReaderAction>,
    events: VecDeque<ReaderEvent>,
    stats: ReaderStats,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Link {
    Up,
    /// The reader asked for the QP to be flushed.
    Flushing,
    Down,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ReadSlot {
    epoch: u32,
    read: Option<Read>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Read {
    grant: Grant,
    dest: Buffer,
    /// Receive time + time left: after this the window may be gone.
    deadline: Duration,
    timed_out: bool,
}

/// What the driver must do for the reader.
#[must_use = "a reader action must be carried out"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReaderAction {
    /// Post a signaled `Read { wr_id: token.wr_id(), local: dest[..len],
    /// remote_addr, rkey }`.
    Read {
        /// The work request id.
        token: Token,
        /// Where the bytes go (the first `len` bytes of it).
        dest: Buffer,
        /// The owner's address.
        remote_addr: u64,
        /// The window's rkey.
        rkey: u32,
        /// Bytes to read.
        len: u32,
    },
    /// Encode `Message::Release` and SEND it (mode [`ReleaseMode::Message`]).
    SendRelease(Release),
    /// Move the QP to ERR: a READ is late and may never complete. Afterwards
    /// call [`Reader::handle_qp_error`] and the owner's.
    FlushQp,
}

/// Why a grant was declined without reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeclineReason {
    /// The time left does not exceed the safety margin.
    LeaseTooShort {
        /// The time the grant said was left.
        time_left: Duration,
        /// The reader's margin.
        margin: Duration,
    },
    /// The destination is shorter than the grant.
    DestinationTooSmall {
        /// Bytes granted.
        need: u32,
        /// Bytes of destination.
        have: u32,
    },
    /// The grant covers zero bytes.
    EmptyGrant,
    /// The QP is down; nothing can be read or released.
    ConnectionLost,
    /// The reader's user no longer wants the data (its call was cancelled
    /// or timed out): released without reading.
    Unwanted,
}

/// Why a READ failed. The QP is in ERR after any of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReadError {
    /// It did not complete in time; the reader flushed the QP.
    TimedOut,
    /// The owner refused the access (`REM_ACCESS_ERR`): the window was
    /// already invalidated or the grant was bad.
    RemoteAccess,
    /// Flushed: the QP went to ERR for another reason.
    Flushed,
    /// Another error status (raw).
    Failed(u32),
}

/// What the reader tells its user.
#[must_use = "reader events hand back destination buffers"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReaderEvent {
    /// The READ completed: `dest[..len]` holds the granted bytes.
    ReadDone {
        /// The lease.
        lease: LeaseId,
        /// The destination, free again.
        dest: Buffer,
        /// Bytes read.
        len: u32,
        /// In [`ReleaseMode::Piggyback`], the release to carry in the
        /// response; `None` in [`ReleaseMode::Message`] (already queued) or
        /// when the QP is going down (nothing can be sent; the owner gets its
        /// buffer back when its QP is destroyed).
        release: Option<Release>,
    },
    /// The grant was not read; `dest` is untouched and free.
    Declined {
        /// The lease.
        lease: LeaseId,
        /// The destination, free.
        dest: Buffer,
        /// Why.
        reason: DeclineReason,
        /// As in [`ReaderEvent::ReadDone::release`].
        release: Option<Release>,
    },
    /// A READ is late; the QP is being flushed. Its destination returns with
    /// [`ReaderEvent::ReadFailed`] once the flush completion arrives.
    ReadTimedOut {
        /// The lease.
        lease: LeaseId,
    },
    /// The READ failed; `dest` is free (its completion arrived) but its
    /// contents are garbage.
    ReadFailed {
        /// The lease.
        lease: LeaseId,
        /// The destination, free.
        dest: Buffer,
        /// Why.
        error: ReadError,
    },
    /// The QP is unusable (first time only).
    ConnectionLost,
}

/// Counters for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ReaderStats {
    /// READs posted.
    pub reads: u64,
    /// READs completed successfully.
    pub reads_done: u64,
    /// Grants declined.
    pub declined: u64,
    /// READs that failed (including timed out).
    pub reads_failed: u64,
    /// READs that timed out.
    pub timed_out: u64,
    /// Completions whose token is not an outstanding READ of this reader.
    pub unknown_completions: u64,
}

impl Reader {
    /// A reader with no READ outstanding.
    pub fn new(config: ReaderConfig) -> Reader {
        Reader::with_reads(config, 0)
    }

    /// A reader with room for `reads` READs outstanding at once, made now:
    /// until more are outstanding, nothing it does allocates (a reader
    /// from [`Reader::new`] grows its tables with the first READs). A
    /// connection gives it one per buffer a READ can land in.
    pub fn with_reads(config: ReaderConfig, reads: usize) -> Reader {
        Reader {
            config,
            slots: vec![ReadSlot { epoch: 0, read: None }; reads],
            free: FreeSlots::full(reads),
            deadlines: SlotHeap::with_slots(reads),
            due: Vec::with_capacity(reads),
            link: Link::Up,
            // A READ and its release (or a decline's) per slot.
            actions: VecDeque::with_capacity(2 * reads),
            events: VecDeque::with_capacity(2 * reads),
            stats: ReaderStats::default(),
        }
    }

    /// A grant arrived at `now`; `dest` is where to READ it. Either a
    /// [`ReaderAction::Read`] is queued, or the grant is declined at once
    /// (with a release, so the owner need not wait for the expiry).
    pub fn handle_grant(&mut self, now: Duration, mut grant: Grant, dest: Buffer) {
        grant.time_left = grant.time_left.min(self.config.max_lease);
        let reason = if self.link != Link::Up {
            Some(DeclineReason::ConnectionLost)
        } else if grant.len == 0 {
            Some(DeclineReason::EmptyGrant)
        } else if dest.len < grant.len {
            Some(DeclineReason::DestinationTooSmall { need: grant.len, have: dest.len })
        } else if grant.time_left <= self.config.safety_margin {
            Some(DeclineReason::LeaseTooShort {
                time_left: grant.time_left,
                margin: self.config.safety_margin,
            })
        } else {
            None
        };
        if let Some(reason) = reason {
            self.stats.declined += 1;
            let release = self.release(&grant, true);
            self.events.push_back(ReaderEvent::Declined { lease: grant.lease, dest, reason, release });
            return;
        }
        let idx = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.slots.push(ReadSlot { epoch: 0, read: None });
                self.free.add_slot();
                self.deadlines.add_slot();
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[idx];
        debug_assert!(slot.read.is_none());
        let deadline = now + grant.time_left;
        slot.epoch = slot.epoch.wrapping_add(1);
        slot.read = Some(Read { grant, dest, deadline, timed_out: false });
        self.deadlines.insert(idx as u32, deadline);
        self.stats.reads += 1;
        self.actions.push_back(ReaderAction::Read {
            token: Token::new(TokenKind::Read, idx as u32, slot.epoch),
            dest,
            remote_addr: grant.addr,
            rkey: grant.rkey,
            len: grant.len,
        });
        self.check_indexes();
    }

    /// Decline a grant without reading it (its data is no longer wanted):
    /// a [`ReaderEvent::Declined`] with a release is queued, so the owner
    /// invalidates at once instead of waiting for the lease to expire.
    pub fn decline(&mut self, _now: Duration, grant: Grant, reason: DeclineReason) {
        let reason = if self.link != Link::Up { DeclineReason::ConnectionLost } else { reason };
        self.stats.declined += 1;
        let release = self.release(&grant, true);
        let dest = Buffer { mr: u32::MAX, offset: 0, len: 0, addr: 0 };
        self.events.push_back(ReaderEvent::Declined { lease: grant.lease, dest, reason, release });
    }

    /// A READ completed (route by [`Token::engine`]).
    pub fn handle_completion(&mut self, _now: Duration, token: Token, status: Status) {
        let idx = token.slot() as usize;
        let slot = match self.slots.get_mut(idx) {
            Some(s)
                if token.kind() == Some(TokenKind::Read) && s.epoch == token.epoch() && s.read.is_some() =>
            {
                s
            }
            _ => {
                self.stats.unknown_completions += 1;
                return;
            }
        };
        let Some(read) = slot.read.take() else { return };
        self.free.insert(idx as u32);
        self.deadlines.remove(idx as u32);
        let lease = read.grant.lease;
        // A READ that timed out already was reported (`ReadTimedOut`) and
        // made the reader flush the QP: its bytes overlapped the owner's
        // expiry and are not handed out, whatever the status.
        if status.is_success() && !read.timed_out {
            self.stats.reads_done += 1;
            let release = self.release(&read.grant, false);
            self.events.push_back(ReaderEvent::ReadDone {
                lease,
                dest: read.dest,
                len: read.grant.len,
                release,
            });
            self.check_indexes();
            return;
        }
        self.stats.reads_failed += 1;
        let error = match status {
            _ if read.timed_out => ReadError::TimedOut,
            Status::RemoteAccess => ReadError::RemoteAccess,
            Status::Flushed => ReadError::Flushed,
            Status::Failed(raw) => ReadError::Failed(raw),
            Status::Success => ReadError::Failed(0),
        };
        self.events.push_back(ReaderEvent::ReadFailed { lease, dest: read.dest, error });
        self.go_down();
        self.check_indexes();
    }

    /// READ timeouts: a READ outstanding past its deadline makes the reader
    /// flush the QP (once). Every READ late at `now` is reported, in slot
    /// order.
    pub fn handle_timeout(&mut self, now: Duration) {
        if self.link != Link::Up {
            return;
        }
        let mut due = std::mem::take(&mut self.due);
        while let Some((deadline, idx)) = self.deadlines.peek() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            due.push(idx);
        }
        due.sort_unstable();
        for &idx in &due {
            if let Some(read) = self.slots[idx as usize].read.as_mut() {
                read.timed_out = true;
                self.stats.timed_out += 1;
                self.events.push_back(ReaderEvent::ReadTimedOut { lease: read.grant.lease });
            }
        }
        if !due.is_empty() {
            // The other outstanding READs are flushed with the QP and come
            // back as ReadError::Flushed.
            self.link = Link::Flushing;
            self.deadlines.clear();
            self.events.push_back(ReaderEvent::ConnectionLost);
            self.actions.push_back(ReaderAction::FlushQp);
        }
        due.clear();
        self.due = due;
        self.check_indexes();
    }

    /// The QP is in ERR. Outstanding READs return their destinations as
    /// their flush completions arrive.
    pub fn handle_qp_error(&mut self, _now: Duration) {
        self.go_down();
        self.check_indexes();
    }

    /// The QP is destroyed: every outstanding READ's destination is free.
    pub fn handle_qp_destroyed(&mut self, _now: Duration) {
        self.go_down();
        for (idx, slot) in self.slots.iter_mut().enumerate() {
            if let Some(read) = slot.read.take() {
                self.free.insert(idx as u32);
                self.stats.reads_failed += 1;
                let error = if read.timed_out { ReadError::TimedOut } else { ReadError::Flushed };
                self.events.push_back(ReaderEvent::ReadFailed {
                    lease: read.grant.lease,
                    dest: read.dest,
                    error,
                });
            }
        }
        self.check_indexes();
    }

    /// Whether actions or events wait to be polled (a driver with none
    /// skips polling).
    #[inline]
    pub fn has_output(&self) -> bool {
        !self.actions.is_empty() || !self.events.is_empty()
    }

    /// The next work to post, in order.
    pub fn poll_action(&mut self) -> Option<ReaderAction> {
        self.actions.pop_front()
    }

    /// The next event for the user.
    pub fn poll_event(&mut self) -> Option<ReaderEvent> {
        self.events.pop_front()
    }

    /// When [`Reader::handle_timeout`] must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.link != Link::Up {
            return None;
        }
        self.deadlines.peek().map(|(deadline, _)| deadline)
    }

    /// READs posted and not yet completed.
    pub fn outstanding_reads(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether the QP is considered unusable.
    pub fn is_connection_lost(&self) -> bool {
        self.link != Link::Up
    }

    /// The counters.
    pub fn stats(&self) -> ReaderStats {
        self.stats
    }

    /// The release for `grant` (`unread` when it was declined): queued as
    /// a message, or returned for the user to piggyback. Nothing when the
    /// QP is down.
    fn release(&mut self, grant: &Grant, unread: bool) -> Option<Release> {
        if self.link != Link::Up {
            return None;
        }
        let release = Release { lease: grant.lease, rkey: grant.rkey, unread };
        match self.config.release {
            ReleaseMode::Message => {
                self.actions.push_back(ReaderAction::SendRelease(release));
                None
            }
            ReleaseMode::Piggyback => Some(release),
        }
    }

    fn go_down(&mut self) {
        if self.link == Link::Up {
            self.events.push_back(ReaderEvent::ConnectionLost);
        }
        self.link = Link::Down;
        // Once per connection: no READ times out from now on.
        self.deadlines.clear();
    }

    /// Debug builds: the indexes agree with the slots (O(slots), so not in
    /// release builds).
    fn check_indexes(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        let free = || (0..self.slots.len() as u32).filter(|&i| self.slots[i as usize].read.is_none());
        crate::assert_lists("free READ slots", || self.free.iter(), free);
        let deadlines = || {
            (0..self.slots.len() as u32).filter_map(|i| match &self.slots[i as usize].read {
                Some(r) if self.link == Link::Up && !r.timed_out => Some((i, r.deadline)),
                _ => None,
            })
        };
        crate::assert_lists("READ deadlines", || self.deadlines.entries(), deadlines);
        assert!(self.due.is_empty());
    }
}

#[cfg(test)]
mod tests;
