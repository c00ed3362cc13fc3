//! Helpers shared by the integration tests that include this module
//! (`mod util;`): each test file is its own crate, so an unused helper is
//! not an error.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::executor::LocalPool;

/// Run `pool` until `f` holds, for at most `limit` of wall time (the
/// bootstrap's handshakes are real TCP); whether it came to hold.
pub fn wait_for(pool: &mut LocalPool, limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while !f() {
        if t0.elapsed() > limit {
            return false;
        }
        pool.run_until(async_io::Timer::after(Duration::from_millis(2)));
    }
    true
}

/// A fresh file `name` holding `bytes`, with permissions `mode` on unix,
/// in a directory of the temp space of its own (named after `test`, this
/// process and a count), removed with the file when the handle drops.
pub fn temp_file(test: &str, name: &str, bytes: &[u8], mode: u32) -> TempFile {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("mwcap-{test}-{}-{n}", std::process::id()));
    // A killed run's leftover of the same name (a reused pid) goes first.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    #[cfg(not(unix))]
    let _ = mode;
    TempFile { dir, path }
}

/// A file made by [`temp_file`]; dropping it removes it and its directory.
pub struct TempFile {
    dir: PathBuf,
    path: PathBuf,
}

impl AsRef<std::path::Path> for TempFile {
    fn as_ref(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
