//! One thread for the process that waits on every completion channel's fd
//! (`epoll`) and wakes the driver sleeping on it.
//!
//! async-io's reactor did this before, and allocated a vector of wakers
//! each time it woke one (`Reactor::react`), so every call whose driver
//! slept until its completion allocated once on verbs. Here the thread
//! keeps its event array and each channel keeps its waker slot
//! ([`AtomicWaker`]), so a wake-up allocates nothing.
//!
//! A channel is registered `EPOLLONESHOT`: the thread reports it once and
//! it stays quiet until its driver sleeps again ([`Registration::poll_readable`]
//! re-arms it, and epoll reports at once an fd that is readable when
//! re-armed, so no event between the driver's look and its sleep is lost).
//! A channel still armed (not reported since) is not armed again: a driver
//! woken by something else (its doorbell, its alarm) sleeps again without
//! an `epoll_ctl`.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use parking_lot::Mutex;

/// Events taken per `epoll_wait`.
const EVENTS: usize = 64;

/// A channel's slot: set when its fd became readable, and who to wake.
#[derive(Default)]
struct Watch {
    ready: AtomicBool,
    /// The fd is armed in epoll: set by the poll that arms it, cleared by
    /// the thread when epoll reports it (a one-shot event disarms it).
    armed: AtomicBool,
    waker: AtomicWaker,
    /// `epoll_ctl` re-arms, for the tests.
    #[cfg(test)]
    arms: std::sync::atomic::AtomicUsize,
}

struct Waiter {
    epfd: RawFd,
    /// Watches by token (the index); `None` for a free token.
    watches: Mutex<Watches>,
}

#[derive(Default)]
struct Watches {
    by_token: Vec<Option<Arc<Watch>>>,
    free: Vec<usize>,
}

/// The process's waiter, its thread started with the first registration.
fn waiter() -> std::io::Result<&'static Waiter> {
    static WAITER: OnceLock<Result<Waiter, i32>> = OnceLock::new();
    let w = WAITER.get_or_init(|| {
        // SAFETY: epoll_create1 takes a flag and returns a new fd or -1.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO));
        }
        Ok(Waiter { epfd, watches: Mutex::new(Watches::default()) })
    });
    match w {
        Ok(w) => {
            static THREAD: OnceLock<()> = OnceLock::new();
            THREAD.get_or_init(|| {
                std::thread::Builder::new()
                    .name("mwcap-cq-wait".into())
                    .spawn(move || w.run())
                    .map(|_| ())
                    .unwrap_or_else(|e| tracing::error!(%e, "cannot start the completion waiter thread"));
            });
            Ok(w)
        }
        Err(errno) => Err(std::io::Error::from_raw_os_error(*errno)),
    }
}

impl Waiter {
    fn run(&self) {
        // SAFETY: an all-zero epoll_event is a valid value (plain integers).
        let mut events: [libc::epoll_event; EVENTS] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: `events` holds EVENTS entries the kernel may write;
            // the epoll fd lives as long as the process (never closed).
            let n = unsafe { libc::epoll_wait(self.epfd, events.as_mut_ptr(), EVENTS as i32, -1) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                tracing::error!(%e, "epoll_wait on the completion channels failed; drivers fall back to their timers");
                return;
            }
            for ev in &events[..n as usize] {
                let token = ev.u64 as usize;
                // Cloned under the lock, woken outside it (a waker may run
                // code that registers or deregisters a channel).
                let watch = self.watches.lock().by_token.get(token).and_then(Option::clone);
                if let Some(w) = watch {
                    // Disarmed by the report: the next sleep arms it again.
                    // (Cleared before `ready` is set: a poll that finds the
                    // fd still armed and skips the re-arm finds `ready`
                    // after registering its waker, or is woken below.)
                    w.armed.store(false, Ordering::Release);
                    w.ready.store(true, Ordering::Release);
                    w.waker.wake();
                }
            }
        }
    }
}

/// A completion channel's fd registered with the waiter; deregistered on
/// drop (before the fd is closed).
pub(crate) struct Registration {
    fd: RawFd,
    token: u64,
    watch: Arc<Watch>,
}

impl Registration {
    /// Register `fd` (open and non-blocking while the registration lives),
    /// not armed until the first [`Registration::poll_readable`].
    pub(crate) fn new(fd: RawFd) -> std::io::Result<Registration> {
        let w = waiter()?;
        let watch = Arc::new(Watch::default());
        let token = {
            let mut watches = w.watches.lock();
            let i = match watches.free.pop() {
                Some(i) => i,
                None => {
                    watches.by_token.push(None);
                    watches.by_token.len() - 1
                }
            };
            watches.by_token[i] = Some(watch.clone());
            i as u64
        };
        // Registered disarmed (no events asked for); armed on each sleep.
        let mut ev = libc::epoll_event { events: libc::EPOLLONESHOT as u32, u64: token };
        // SAFETY: both fds are open; `ev` is a valid event for the call.
        if unsafe { libc::epoll_ctl(w.epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            let e = std::io::Error::last_os_error();
            let mut watches = w.watches.lock();
            watches.by_token[token as usize] = None;
            watches.free.push(token as usize);
            return Err(e);
        }
        Ok(Registration { fd, token, watch })
    }

    /// `Ready` once the fd was readable since the last `Ready`; otherwise
    /// arm the fd (unless it is armed already) and wake `cx` when it
    /// becomes readable.
    pub(crate) fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.watch.ready.swap(false, Ordering::AcqRel) {
            return Poll::Ready(Ok(()));
        }
        self.watch.waker.register(cx.waker());
        if !self.watch.armed.swap(true, Ordering::AcqRel) {
            let w = waiter().inspect_err(|_| self.watch.armed.store(false, Ordering::Release))?;
            let mut ev =
                libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLONESHOT) as u32, u64: self.token };
            #[cfg(test)]
            self.watch.arms.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the fd is registered with the epoll fd and open (the
            // registration lives); `ev` is valid.
            if unsafe { libc::epoll_ctl(w.epfd, libc::EPOLL_CTL_MOD, self.fd, &mut ev) } < 0 {
                self.watch.armed.store(false, Ordering::Release);
                return Poll::Ready(Err(std::io::Error::last_os_error()));
            }
        }
        // Readable already (reported at once by the re-arm) or meanwhile.
        if self.watch.ready.swap(false, Ordering::AcqRel) {
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(w) = waiter() {
            // SAFETY: the fd is still open (the channel outlives this) and
            // registered; a null event is allowed for EPOLL_CTL_DEL.
            unsafe { libc::epoll_ctl(w.epfd, libc::EPOLL_CTL_DEL, self.fd, std::ptr::null_mut()) };
            // A wake-up the thread took before the DEL reaches a watch no
            // one polls, or a later registration's: spurious, harmless.
            let mut watches = w.watches.lock();
            watches.by_token[self.token as usize] = None;
            watches.free.push(self.token as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Count(AtomicUsize);
    impl futures::task::ArcWake for Count {
        fn wake_by_ref(this: &Arc<Self>) {
            this.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A non-blocking pipe, both ends closed on drop (after the
    /// registration of its read end, declared later, is dropped).
    struct Pipe {
        rd: RawFd,
        wr: RawFd,
    }

    impl Pipe {
        fn new() -> Pipe {
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two descriptors pipe2 returns.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) }, 0);
            Pipe { rd: fds[0], wr: fds[1] }
        }

        fn write_byte(&self) {
            // SAFETY: `wr` is the pipe's open write end; one byte from a valid buffer.
            assert_eq!(unsafe { libc::write(self.wr, b"x".as_ptr().cast(), 1) }, 1);
        }

        fn drain(&self) {
            let mut b = [0u8; 8];
            // SAFETY: `rd` is open; `b` is a valid buffer of its length.
            unsafe { libc::read(self.rd, b.as_mut_ptr().cast(), b.len()) };
        }
    }

    impl Drop for Pipe {
        fn drop(&mut self) {
            // SAFETY: both ends are open and closed once, here.
            unsafe {
                libc::close(self.rd);
                libc::close(self.wr);
            }
        }
    }

    /// A pipe's read end stands in for a completion channel: pending until
    /// written, woken by the waiter thread, ready once, quiet until armed
    /// again, and reported at once when readable as it is armed.
    #[test]
    fn a_registered_fd_wakes_its_waker_once_per_arming() {
        let pipe = Pipe::new();
        let reg = Registration::new(pipe.rd).unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = futures::task::waker(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(reg.poll_readable(&mut cx).is_pending());
        pipe.write_byte();
        let t0 = std::time::Instant::now();
        while count.0.load(Ordering::SeqCst) == 0 {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "never woken");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(reg.poll_readable(&mut cx).is_ready(), "woken: ready");
        // Still readable (the byte is unread): re-armed, reported at once.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let r = reg.poll_readable(&mut cx);
        let woken_again = r.is_ready() || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            reg.poll_readable(&mut cx).is_ready()
        };
        assert!(woken_again, "a readable fd is reported when armed");
        pipe.drain();
        assert!(reg.poll_readable(&mut cx).is_pending(), "drained: pending again");
        let before = count.0.load(Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(count.0.load(Ordering::SeqCst), before, "no wake-up without data");
    }

    /// A driver woken by something else polls again while its fd is still
    /// armed: no second `epoll_ctl`, and the fd's report still wakes the
    /// latest waker. Once reported, the next sleep arms it again.
    #[test]
    fn an_armed_fd_is_not_armed_again() {
        let pipe = Pipe::new();
        let reg = Registration::new(pipe.rd).unwrap();
        let arms = || reg.watch.arms.load(Ordering::Relaxed);
        let first = Arc::new(Count(AtomicUsize::new(0)));
        let second = Arc::new(Count(AtomicUsize::new(0)));
        let (w1, w2) = (futures::task::waker(first.clone()), futures::task::waker(second.clone()));
        assert!(reg.poll_readable(&mut Context::from_waker(&w1)).is_pending());
        assert_eq!(arms(), 1);
        for _ in 0..3 {
            assert!(reg.poll_readable(&mut Context::from_waker(&w2)).is_pending());
        }
        assert_eq!(arms(), 1, "armed once while not reported");
        pipe.write_byte();
        let t0 = std::time::Instant::now();
        while second.0.load(Ordering::SeqCst) == 0 {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "the latest waker was never woken");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(first.0.load(Ordering::SeqCst), 0, "the replaced waker is not woken");
        assert!(reg.poll_readable(&mut Context::from_waker(&w2)).is_ready());
        pipe.drain();
        assert!(reg.poll_readable(&mut Context::from_waker(&w2)).is_pending());
        assert_eq!(arms(), 2, "reported, so armed again");
    }
}
