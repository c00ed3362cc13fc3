//! The pre-shared keys (one shared key, or a keyring of named keys whose
//! names are the peers' identities), and the choice to run without one.

use std::fmt;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zeroize::Zeroizing;

/// The environment variable the `mwcap` CLI reads a key from.
pub const KEY_ENV_VAR: &str = "MWCAP_KEY";

/// How the bootstrap authenticates the peer. There is no default: running
/// without a key is a choice the caller writes down.
#[derive(Clone, Debug)]
pub enum Auth {
    /// Both sides prove that they hold this key before either creates a
    /// queue pair for the other (mutual HMAC-SHA256 challenge-response).
    /// Every peer then has the same identity, [`SHARED_IDENTITY`].
    Key(Key),
    /// Named keys: a peer proves one of them, and its name is the peer's
    /// identity ([`Connection::peer_identity`]). As a server this side
    /// accepts any key of the ring; as a client it proves the one
    /// [`Keyring::prove_as`] chose (or the only one).
    ///
    /// [`Connection::peer_identity`]: crate::conn::Connection::peer_identity
    Keyring(Keyring),
    /// No authentication: whoever reaches the bootstrap port gets a
    /// connected queue pair and, under the confirm policy, a region's rkey.
    /// Only for a network where every host that can reach the port is trusted.
    Unauthenticated,
}

/// The identity of a peer that proved an [`Auth::Key`]: every such peer
/// has this one.
pub const SHARED_IDENTITY: &str = "shared";

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
        check_not_open_to_all(&file, path)?;
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

    /// The key as HMAC-SHA256 uses it: hashed if longer than the 64-byte
    /// block, then padded with zeros to the block. Two keys with the same
    /// block make the same MACs.
    fn hmac_block(&self) -> Zeroizing<[u8; 64]> {
        use sha2::Digest;
        let mut block = Zeroizing::new([0u8; 64]);
        if self.0.len() > 64 {
            block[..32].copy_from_slice(&sha2::Sha256::digest(&self.0[..]));
        } else {
            block[..self.0.len()].copy_from_slice(&self.0);
        }
        block
    }
}

/// Named pre-shared keys: the identities this process knows.
///
/// A peer's identity is the name of the key it proved. A server holds the
/// keys of everyone it accepts; a client holds (at least) its own and
/// proves it ([`prove_as`](Self::prove_as)). The proof never says which
/// key it is under: the server checks it against every key of its ring
/// (all of them, whichever matches, so the time taken does not tell which
/// one did). No key may be under two names, or a proof would name two
/// identities.
///
/// The file format ([`from_file`](Self::from_file)) is one key per line,
/// `NAME HEX`, with `#` comments and blank lines ignored:
///
/// ```text
/// # mwcap keyring: chmod 600
/// storage-1   8f1c...  (at least 32 hex digits: 16 bytes)
/// compute-7   03ab...
/// ```
#[derive(Clone, Default)]
pub struct Keyring {
    /// Shared with every handshake in progress (none copies the keys).
    keys: Arc<Vec<(Arc<str>, Key)>>,
    own: Option<usize>,
}

impl Keyring {
    /// The most keys a ring may hold (a server checks a proof against each).
    pub const MAX_KEYS: usize = 4096;
    /// The longest name.
    pub const MAX_NAME_LEN: usize = 64;

    /// An empty ring.
    pub fn new() -> Keyring {
        Keyring::default()
    }

    /// Add `key` under `name`: 1 to [`MAX_NAME_LEN`](Self::MAX_NAME_LEN)
    /// ASCII letters, digits, `.`, `_`, `-` or `@`, not already in the
    /// ring, and a key no other name has.
    pub fn insert(&mut self, name: &str, key: Key) -> Result<(), KeyError> {
        let valid = !name.is_empty()
            && name.len() <= Keyring::MAX_NAME_LEN
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-@".contains(&b));
        if !valid {
            return Err(KeyError::BadName { name: name.to_owned(), max: Keyring::MAX_NAME_LEN });
        }
        if self.keys.len() >= Keyring::MAX_KEYS {
            return Err(KeyError::TooManyKeys { max: Keyring::MAX_KEYS });
        }
        if self.keys.iter().any(|(n, _)| &**n == name) {
            return Err(KeyError::DuplicateName { name: name.to_owned() });
        }
        // HMAC pads a key to its block and hashes a longer one first, so
        // different bytes can be one HMAC key (K and K followed by zeros).
        if let Some((other, _)) = self.keys.iter().find(|(_, k)| k.hmac_block() == key.hmac_block()) {
            return Err(KeyError::SameKeyTwice { name: name.to_owned(), other: other.to_string() });
        }
        Arc::make_mut(&mut self.keys).push((name.into(), key));
        Ok(())
    }

    /// The ring, proving the key `name` when this side connects as a client.
    /// (A ring of one key proves it without being told.)
    pub fn prove_as(mut self, name: &str) -> Result<Keyring, KeyError> {
        match self.keys.iter().position(|(n, _)| &**n == name) {
            Some(i) => {
                self.own = Some(i);
                Ok(self)
            }
            None => Err(KeyError::UnknownName { name: name.to_owned() }),
        }
    }

    /// The ring in the file at `path` (format: the type's docs). As for
    /// [`Key::from_file`], a file every user may read or write is refused.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Keyring, KeyError> {
        let path = path.as_ref();
        let read_err = |source| KeyError::Read { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(read_err)?;
        check_not_open_to_all(&file, path)?;
        const MAX_FILE: u64 = 1 << 24;
        // Room for the whole file and one byte more, so that reading never
        // reallocates (a reallocation would leave a copy of the keys behind);
        // a file that fills it is over the limit or grew while it was read.
        let len = file.metadata().map_err(read_err)?.len().min(MAX_FILE);
        let room = len as usize + 1;
        let mut text = Zeroizing::new(Vec::with_capacity(room));
        file.take(room as u64).read_to_end(&mut text).map_err(read_err)?;
        if text.len() >= room {
            return Err(KeyError::KeyringTooLarge { path: path.to_owned(), max: MAX_FILE as usize });
        }
        let line_err = |line: usize, what: String| KeyError::BadLine { path: path.to_owned(), line, what };
        let mut ring = Keyring::new();
        for (n, raw) in text.split(|&b| b == b'\n').enumerate() {
            // A `#` starts a comment, on a line of its own or after the key.
            let line = raw.split(|&b| b == b'#').next().unwrap_or(raw).trim_ascii();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split(|b| b.is_ascii_whitespace()).filter(|w| !w.is_empty());
            let (Some(name), Some(hex), None) = (words.next(), words.next(), words.next()) else {
                return Err(line_err(n + 1, "a line is NAME HEX-KEY".into()));
            };
            let name =
                std::str::from_utf8(name).map_err(|_| line_err(n + 1, "the name is not UTF-8".into()))?;
            let mut key =
                decode_hex(hex).ok_or_else(|| line_err(n + 1, "the key is not hex digits".into()))?;
            let key = Key::from_bytes(std::mem::take(&mut *key)).map_err(|e| {
                let what = match e {
                    KeyError::TooShort { len, min } => format!(
                        "the key is {len} bytes, fewer than {min}; use at least {} hex digits of random bytes",
                        2 * min
                    ),
                    e => e.to_string(),
                };
                line_err(n + 1, what)
            })?;
            ring.insert(name, key).map_err(|e| line_err(n + 1, e.to_string()))?;
        }
        if ring.is_empty() {
            return Err(KeyError::EmptyKeyring { path: path.to_owned() });
        }
        Ok(ring)
    }

    /// The names in the ring, in the order they were added.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(n, _)| &**n)
    }

    /// How many keys the ring holds.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the ring holds no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key a client proves, and its name.
    pub(super) fn own(&self) -> Option<(&Arc<str>, &Key)> {
        let i = match (self.own, self.keys.len()) {
            (Some(i), _) => i,
            (None, 1) => 0,
            (None, _) => return None,
        };
        self.keys.get(i).map(|(n, k)| (n, k))
    }

    /// Every name and key, for a server to check a proof against.
    pub(super) fn keys(&self) -> &Arc<Vec<(Arc<str>, Key)>> {
        &self.keys
    }
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let own = self.own().map(|(n, _)| &**n);
        f.debug_struct("Keyring")
            .field("names", &self.names().collect::<Vec<_>>())
            .field("proves", &own)
            .finish()
    }
}

/// The bytes of a hex string (two digits a byte), or `None`.
fn decode_hex(hex: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Zeroizing::new(Vec::with_capacity(hex.len() / 2));
    for pair in hex.chunks_exact(2) {
        out.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(out)
}

/// Refuse a key file that every user may read or write (unix).
fn check_not_open_to_all(file: &std::fs::File, path: &Path) -> Result<(), KeyError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = file.metadata().map_err(|source| KeyError::Read { path: path.to_owned(), source })?;
        let mode = meta.permissions().mode();
        if mode & 0o006 != 0 {
            return Err(KeyError::OpenToAll { path: path.to_owned(), mode: mode & 0o7777 });
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path);
    Ok(())
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
    /// A keyring name is empty, too long, or has a character other than
    /// an ASCII letter, a digit, `.`, `_`, `-` or `@`.
    #[error("the key name {name:?} is not 1 to {max} ASCII letters, digits, '.', '_', '-' or '@'")]
    BadName {
        /// The name.
        name: String,
        /// [`Keyring::MAX_NAME_LEN`].
        max: usize,
    },
    /// The keyring already has a key under this name.
    #[error("the keyring already has a key named {name:?}; give each key its own name")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// The key is in the keyring under another name already.
    #[error(
        "the key for {name:?} is the key of {other:?} already: a proof would name both; \
         give each identity its own key"
    )]
    SameKeyTwice {
        /// The name being added.
        name: String,
        /// The name the key has already.
        other: String,
    },
    /// The keyring has no key of this name.
    #[error("the keyring has no key named {name:?}")]
    UnknownName {
        /// The name.
        name: String,
    },
    /// The keyring holds [`Keyring::MAX_KEYS`] keys already.
    #[error("the keyring holds {max} keys already, the most it may")]
    TooManyKeys {
        /// [`Keyring::MAX_KEYS`].
        max: usize,
    },
    /// A line of a keyring file is not `NAME HEX-KEY`, or its key or name
    /// is refused.
    #[error("{}, line {line}: {what}", path.display())]
    BadLine {
        /// The file.
        path: PathBuf,
        /// The line's number, from 1.
        line: usize,
        /// What is wrong with it.
        what: String,
    },
    /// A keyring file is larger than any keyring should be (or grew while
    /// it was read).
    #[error("the keyring file {} is over {max} bytes (or grew while it was read); is this the right file?", path.display())]
    KeyringTooLarge {
        /// The file.
        path: PathBuf,
        /// The largest file read.
        max: usize,
    },
    /// A keyring file holds no key.
    #[error("the keyring file {} holds no key (a line is NAME HEX-KEY)", path.display())]
    EmptyKeyring {
        /// The file.
        path: PathBuf,
    },
    /// The environment variable holds bytes that are not UTF-8.
    #[error("the environment variable {var} is not valid UTF-8; put a binary key in a file instead")]
    EnvNotUnicode {
        /// Its name.
        var: String,
    },
}
