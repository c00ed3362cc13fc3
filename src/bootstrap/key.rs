//! The pre-shared key, and the choice to run without one.

use std::fmt;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

/// The environment variable the `mwcap` CLI reads a key from.
pub const KEY_ENV_VAR: &str = "MWCAP_KEY";

/// How the bootstrap authenticates the peer. There is no default: running
/// without a key is a choice the caller writes down.
#[derive(Clone, Debug)]
pub enum Auth {
    /// Both sides prove that they hold this key before either creates a
    /// queue pair for the other (mutual HMAC-SHA256 challenge-response).
    Key(Key),
    /// No authentication: whoever reaches the bootstrap port gets a
    /// connected queue pair and, under the confirm policy, a region's rkey.
    /// Only for a network where every host that can reach the port is trusted.
    Unauthenticated,
}

/// A pre-shared key: at least [`Key::MIN_LEN`] bytes, the same on both sides.
///
/// Its `Debug` output shows the length, never the bytes, and the bytes are
/// overwritten with zeros when the last copy is dropped.
#[derive(Clone)]
pub struct Key(Zeroizing<Vec<u8>>);

impl Key {
    /// The shortest key accepted: 16 bytes (128 bits, if they are random).
    pub const MIN_LEN: usize = 16;
    /// The longest key accepted; a longer key file is most likely the wrong file.
    pub const MAX_LEN: usize = 1024;

    /// A key made of `bytes`, as they are.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Key, KeyError> {
        let bytes = Zeroizing::new(bytes.into());
        if bytes.len() < Key::MIN_LEN {
            return Err(KeyError::TooShort { len: bytes.len(), min: Key::MIN_LEN });
        }
        if bytes.len() > Key::MAX_LEN {
            return Err(KeyError::TooLong { max: Key::MAX_LEN });
        }
        Ok(Key(bytes))
    }

    /// The key in the file at `path`: its bytes, less one final newline (so
    /// that a key written with `echo` or an editor matches one written with
    /// `printf`). Binary keys are fine: `head -c 32 /dev/urandom > key`.
    ///
    /// On unix a file that every user may read or write is refused (a key
    /// anyone can read authenticates anyone); `chmod 600` it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Key, KeyError> {
        let path = path.as_ref();
        let read_err = |source| KeyError::Read { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(read_err)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = file.metadata().map_err(read_err)?.permissions().mode();
            if mode & 0o006 != 0 {
                return Err(KeyError::OpenToAll { path: path.to_owned(), mode: mode & 0o7777 });
            }
        }
        // Room for one byte more than a key may have, so that reading never
        // reallocates (a reallocation would leave a copy of the key behind).
        let mut bytes = Zeroizing::new(Vec::with_capacity(Key::MAX_LEN + 3));
        file.take(Key::MAX_LEN as u64 + 3).read_to_end(&mut bytes).map_err(read_err)?;
        trim_newline(&mut bytes);
        Key::from_bytes(std::mem::take(&mut *bytes))
    }

    /// The key in the environment variable `var` (for the CLI,
    /// [`KEY_ENV_VAR`]): its bytes, less one final newline.
    pub fn from_env(var: &str) -> Result<Key, KeyError> {
        let value = match std::env::var(var) {
            Ok(v) => v,
            Err(std::env::VarError::NotPresent) => return Err(KeyError::EnvNotSet { var: var.to_owned() }),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(KeyError::EnvNotUnicode { var: var.to_owned() })
            }
        };
        let mut bytes = Zeroizing::new(value.into_bytes());
        trim_newline(&mut bytes);
        Key::from_bytes(std::mem::take(&mut *bytes))
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn trim_newline(bytes: &mut Vec<u8>) {
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({} bytes, redacted)", self.0.len())
    }
}

/// Why a key could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key file cannot be read.
    #[error("cannot read the key file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// Every user may read or write the key file.
    #[error(
        "the key file {} is open to every user (mode {mode:04o}); restrict it: chmod 600 {}",
        path.display(),
        path.display()
    )]
    OpenToAll {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key is too short to be worth anything.
    #[error(
        "the key is {len} bytes, fewer than {min}; use at least {min} random bytes \
         (e.g. head -c 32 /dev/urandom > key)"
    )]
    TooShort {
        /// Its length.
        len: usize,
        /// [`Key::MIN_LEN`].
        min: usize,
    },
    /// The key is longer than any key should be.
    #[error("the key is longer than {max} bytes; is this the right file?")]
    TooLong {
        /// [`Key::MAX_LEN`].
        max: usize,
    },
    /// The environment variable is not set.
    #[error("the environment variable {var} is not set")]
    EnvNotSet {
        /// Its name.
        var: String,
    },
    /// The environment variable holds bytes that are not UTF-8.
    #[error("the environment variable {var} is not valid UTF-8; put a binary key in a file instead")]
    EnvNotUnicode {
        /// Its name.
        var: String,
    },
}
