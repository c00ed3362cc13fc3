//! The pool's memory windows (`docs/serving.md`, "Windows are the pool's
//! too"): lent for an exposure, given back unbound, dropped with a
//! connection that went down.

use mwcap_mw as mw;

use super::BufferPool;

impl BufferPool {
    /// Take an unbound window for member `m`'s exposure; when there is none
    /// for it and none can be allocated, it waits in the windows' queue.
    pub(crate) fn take_window(&self, m: u32) -> Option<mw::Window> {
        let wk = self.0.sizes.len();
        let lent = {
            let mut st = self.0.state.lock();
            st.lend_window_to(m, wk).map(|w| (w, st.kick(wk, None, 0)))
        };
        if let Some((w, wake)) = lent {
            if let Some(wake) = wake {
                wake.wake();
            }
            return Some(w);
        }
        // Short: one more (outside the lock: a device call).
        let made = self.0.device.alloc_mw();
        let mut st = self.0.state.lock();
        let (taken, wake) = match made {
            Ok(w) => {
                st.windows_allocated += 1;
                st.windows_lent += 1;
                st.unwake(m, wk);
                st.dequeue(m, wk);
                (Some(mw::Window { handle: w.id.raw(), rkey: w.rkey }), st.kick(wk, None, 0))
            }
            Err(e) => {
                st.window_alloc_failures += 1;
                // One may have come back meanwhile.
                let lent = st.lend_window_to(m, wk);
                if lent.is_none() {
                    // The first, then every 1024th: a device at its max_mw
                    // fails every retry.
                    if st.window_waits % 1024 == 0 {
                        tracing::warn!(
                            %e,
                            live = st.windows_live(),
                            waits = st.window_waits + 1,
                            "no memory window for an exposure and none can be allocated: waiting for one to come back"
                        );
                    }
                    st.window_waits += 1;
                    st.enqueue(m, wk, false);
                }
                (lent, st.kick(wk, None, 0))
            }
        };
        drop(st);
        if let Some(w) = wake {
            w.wake();
        }
        taken
    }

    /// Give back a window lent for an exposure: its one LOCAL_INV completed
    /// successfully, so it is unbound (`window.rkey` is its last bind's).
    /// `used`: false for a window taken for a grant that was refused (never
    /// bound), which is not counted as lent.
    pub(crate) fn give_window(&self, window: mw::Window, used: bool) {
        self.put_back(self.0.sizes.len(), |st| {
            debug_assert!(!st.windows.iter().any(|w| w.handle == window.handle), "window given back twice");
            st.windows.push(window);
            if !used {
                st.windows_lent -= 1;
            }
            true
        });
    }

    /// `n` lent windows were deallocated by their connection (it went down
    /// while they were lent). The pool allocates others when it runs short;
    /// the next connection waiting for a window tries again (the device has
    /// room).
    pub(crate) fn windows_dropped(&self, n: u32) {
        if n == 0 {
            return;
        }
        let wk = self.0.sizes.len();
        let wake = {
            let mut st = self.0.state.lock();
            st.windows_dropped += u64::from(n);
            st.wake_next(wk, None, 0)
        };
        if let Some(w) = wake {
            w.wake();
        }
    }
}
