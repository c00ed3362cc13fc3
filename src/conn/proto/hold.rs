//! Releases and invalidations held for the next frame
//! (`Config::release_hold`): a client's release of a reply payload it read
//! rides in its next request, and an owner's LOCAL_INV ending a lease
//! released in a request or reply is posted after its next frame; either
//! goes on its own when the hold ends.

use std::time::Duration;

use mwcap_mw as mw;

use super::*;

impl Connection {
    /// Hold a release or an invalidation until `Config::release_hold` from
    /// now at most.
    pub(super) fn hold(&mut self, now: Duration) {
        self.hold_until.get_or_insert(now + self.cfg.release_hold);
    }

    /// Post the LOCAL_INVs held (after the frame just queued, or with the
    /// QP in error, where they flush).
    pub(super) fn post_held_invs(&mut self) {
        for i in 0..self.held_invs.len() {
            let w = self.held_invs[i];
            self.post(w);
        }
        self.held_invs.clear();
        if self.held_releases.is_empty() {
            self.hold_until = None;
        }
    }

    /// Send everything held now, on its own.
    pub(super) fn flush_held(&mut self, now: Duration) {
        self.hold_until = None;
        let releases = std::mem::take(&mut self.held_releases);
        for &r in &releases {
            let f = Frame::Engine(mw_attach(&mw::Message::Release(r)));
            if let Err(e) = self.send_frame(&f, None) {
                self.go_down(now, LossReason::Nic(e));
                break;
            }
        }
        self.held_releases = releases;
        self.held_releases.clear();
        self.post_held_invs();
    }

    /// Attach the releases held to `frame`, leaving room for a grant; the
    /// rest stay held.
    pub(super) fn attach_held(&mut self, frame: &mut Frame<'_>) {
        if let Frame::Request { attach, .. } | Frame::Ask { attach, .. } = frame {
            while attach.len() + 1 < crate::conn::frame::MAX_ATTACH {
                let Some(r) = self.held_releases.pop() else { break };
                let _ = attach.push(mw_attach(&mw::Message::Release(r)));
            }
        }
    }
}
