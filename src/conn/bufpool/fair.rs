//! Who waits for what in a [`BufferPool`](super::BufferPool), and who gets
//! what comes back: the fairness rules of the module docs ("Fairness"),
//! as methods of the pool's state under its lock.

use std::task::Waker;

use mwcap_mw as mw;

use super::State;
use crate::sync::{Arc, AtomicBool, Ordering};

/// A connection on the pool (the slots of one connection, backed by it).
#[derive(Default)]
pub(super) struct Member {
    /// Woken when it is its turn for what it waits for.
    pub(super) waker: Option<Waker>,
    /// Set before `waker` is woken: the member's next turn sees it.
    pub(super) flag: Option<Arc<AtomicBool>>,
    /// Buffers it holds, per class.
    pub(super) held: Vec<u32>,
    /// The queues it is in (bit `k`: class `k`'s; the windows' is the
    /// last class's bit plus one).
    pub(super) queued: u64,
    /// The queues it was woken from and has not tried again since.
    pub(super) woken: u64,
    /// How much it held the pool's buffers of late: for each buffer it
    /// took, the gives that passed until it came back (halved every 256
    /// gives). A connection that holds buffers for a whole lease (a peer
    /// that never reads) uses far more than one that hands them back
    /// within a call, and is woken after it.
    pub(super) used: u64,
}

impl State {
    /// Members on the pool now.
    pub(super) fn live(&self) -> u32 {
        (self.members.len() - self.vacant.len()) as u32
    }

    /// Windows allocated and not deallocated: free, or lent to a connection.
    pub(super) fn windows_live(&self) -> u32 {
        (self.windows_allocated - self.windows_dropped) as u32
    }

    /// Each member's guaranteed share of a class of `count` buffers: the
    /// buffers divided by the members, rounded down. With more members
    /// than buffers it is none: nobody is owed a buffer, and every take
    /// while others wait goes through the queue.
    pub(super) fn share(&self, count: u32) -> u32 {
        count / self.live().max(1)
    }

    /// Whether member `m` was woken from queue `k` and has not tried since.
    pub(super) fn is_woken(&self, m: u32, k: usize) -> bool {
        self.members[m as usize].woken & (1 << k) != 0
    }

    /// Member `m` tried again (or gave up) after a wake-up from queue `k`.
    pub(super) fn unwake(&mut self, m: u32, k: usize) {
        let member = &mut self.members[m as usize];
        if member.woken & (1 << k) != 0 {
            member.woken &= !(1 << k);
            self.woken_n[k] -= 1;
        }
    }

    /// Every wake-up member `m` has not used, taken from it (bits).
    pub(super) fn unwake_all(&mut self, m: u32) -> u64 {
        let woken = std::mem::take(&mut self.members[m as usize].woken);
        for (k, n) in self.woken_n.iter_mut().enumerate() {
            if woken & (1 << k) != 0 {
                *n -= 1;
            }
        }
        woken
    }

    /// Whether a member other than `m` waits in queue `k`, or was woken
    /// from it and has not tried yet.
    pub(super) fn others_wait(&self, m: u32, k: usize) -> bool {
        let queued = self.members[m as usize].queued & (1 << k) != 0;
        self.queues[k].len() > usize::from(queued) || self.woken_n[k] > u32::from(self.is_woken(m, k))
    }

    /// Member `m` got what it waited for in queue `k` without a wake-up
    /// (nobody else waited): out of the queue.
    pub(super) fn dequeue(&mut self, m: u32, k: usize) {
        let member = &mut self.members[m as usize];
        if member.queued & (1 << k) != 0 {
            member.queued &= !(1 << k);
            self.queues[k].retain(|e| e.0 != m);
        }
    }

    /// Whether member `m` may take one of class `k`'s free buffers now,
    /// leaving `keep` free: it was woken for one, or nobody else waits, or
    /// it is below its share (of `count`).
    pub(super) fn may_take(&self, m: u32, k: usize, count: u32, keep: usize) -> bool {
        if self.free[k].len() <= keep {
            return false;
        }
        self.is_woken(m, k) || !self.others_wait(m, k) || self.members[m as usize].held[k] < self.share(count)
    }

    /// Member `m` waits for queue `k` (at its head, if it had been woken
    /// for it: its turn came and went to someone below their share), for
    /// an `outgoing` payload only or not.
    pub(super) fn enqueue(&mut self, m: u32, k: usize, outgoing: bool) {
        let was_woken = self.is_woken(m, k);
        self.unwake(m, k);
        let member = &mut self.members[m as usize];
        if member.queued & (1 << k) != 0 {
            if let Some(e) = self.queues[k].iter_mut().find(|e| e.0 == m) {
                e.1 &= outgoing;
            }
            return;
        }
        member.queued |= 1 << k;
        if was_woken {
            self.queues[k].push_front((m, outgoing));
        } else {
            self.queues[k].push_back((m, outgoing));
        }
    }

    /// Something of queue `k` came back: wake one waiter that can take
    /// what is free (an outgoing one only above the class's `reserve`).
    /// Which one: below its share (of `count` buffers; windows have no
    /// shares) before at or above it, then the one that has held the pool's
    /// buffers least of late ([`Member::used`]), then the first to come.
    /// Returns its waker, to wake outside the lock.
    pub(super) fn wake_next(&mut self, k: usize, count: Option<u32>, reserve: usize) -> Option<Waker> {
        let share = count.map_or(u32::MAX, |c| self.share(c));
        let room = match count {
            Some(_) => self.free[k].len() > reserve,
            None => true,
        };
        let members = &self.members;
        let at = self.queues[k]
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.1 || room)
            .min_by_key(|(i, e)| {
                let m = &members[e.0 as usize];
                let held = if count.is_some() { m.held[k] } else { 0 };
                (held >= share, m.used, *i)
            })
            .map(|(i, _)| i)?;
        let (m, _) = self.queues[k].remove(at)?;
        let member = &mut self.members[m as usize];
        member.queued &= !(1 << k);
        member.woken |= 1 << k;
        if let Some(f) = &member.flag {
            f.store(true, Ordering::Release);
        }
        self.woken_n[k] += 1;
        self.wakeups += 1;
        member.waker.clone()
    }

    /// Keep queue `k` moving: if something is free, someone waits, and
    /// nobody is on the way to take it (none woken that has not tried
    /// since), wake the next waiter that can take it. Called whenever a
    /// take, a failed take or a lapsed wake-up may have left a free buffer
    /// beside waiters with nobody woken: after a woken member takes one
    /// buffer of several free, the next waiter must hear of the rest
    /// (`count`, `reserve`: as for [`State::wake_next`]).
    pub(super) fn kick(&mut self, k: usize, count: Option<u32>, reserve: usize) -> Option<Waker> {
        let free = match count {
            Some(_) => !self.free[k].is_empty(),
            None => !self.windows.is_empty(),
        };
        if self.woken_n[k] > 0 || !free || self.queues[k].is_empty() {
            return None;
        }
        self.wake_next(k, count, reserve)
    }

    /// Lend member `m` a free window if it may have one now (it was woken
    /// for one, or nobody else waits for one).
    pub(super) fn lend_window_to(&mut self, m: u32, wk: usize) -> Option<mw::Window> {
        if !self.is_woken(m, wk) && self.others_wait(m, wk) {
            return None;
        }
        let w = self.windows.pop()?;
        self.windows_lent += 1;
        self.unwake(m, wk);
        self.dequeue(m, wk);
        Some(w)
    }

    /// Buffer `i`, held by member `m`, came back: `m` used the pool for
    /// as many gives as passed while it held it. Every 256 gives, what
    /// every member used is halved: old use fades.
    pub(super) fn account(&mut self, m: u32, i: u32) {
        self.clock += 1;
        let since = self.took_at[i as usize];
        if let Some(member) = self.members.get_mut(m as usize) {
            member.used += self.clock - since;
        }
        if self.clock % 256 == 0 {
            for member in &mut self.members {
                member.used /= 2;
            }
        }
    }
}
