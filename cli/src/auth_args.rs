//! `--key-file PATH`, `MWCAP_KEY`, `--keyring PATH [--identity NAME]` and
//! `--no-auth`: how `mwcap serve` and `mwcap bench ADDR` authenticate the
//! bootstrap. There is no default; with no key and no `--no-auth` they
//! refuse to start.

use std::path::PathBuf;

use clap::Args;
use mwcap::bootstrap::{Auth, Key, Keyring, KEY_ENV_VAR};

/// The bootstrap's authentication options.
#[derive(Args)]
pub struct AuthArgs {
    /// Pre-shared key file (at least 16 bytes, not readable by other users,
    /// the same on both sides: e.g. `head -c 32 /dev/urandom > key; chmod
    /// 600 key`). Both sides prove they hold it before any queue pair is
    /// created. The key itself may be given in MWCAP_KEY instead.
    #[arg(long, value_name = "PATH", conflicts_with = "keyring")]
    pub key_file: Option<PathBuf>,
    /// Keyring file of named keys, one `NAME HEX-KEY` a line (`#` comments;
    /// not readable by other users). A peer's identity is the name of the
    /// key it proves: a server accepts any key of the ring and logs each
    /// peer's name; a client proves its `--identity` (or the ring's only key).
    #[arg(long, value_name = "PATH")]
    pub keyring: Option<PathBuf>,
    /// The key of `--keyring` this side proves when it connects (`mwcap
    /// bench`; refused by `mwcap serve`, which accepts every key of its ring).
    #[arg(long, value_name = "NAME", requires = "keyring")]
    pub identity: Option<String>,
    /// Run the bootstrap without authentication: whoever reaches the port
    /// gets a connected queue pair. Only on a network where every host is trusted.
    #[arg(long, conflicts_with_all = ["key_file", "keyring"])]
    pub no_auth: bool,
}

impl AuthArgs {
    /// The choice made on the command line or in the environment.
    pub fn resolve(&self) -> Result<Auth, String> {
        let in_env = std::env::var_os(KEY_ENV_VAR).is_some();
        if let Some(path) = &self.keyring {
            if in_env {
                return Err(format!("a key is given twice (--keyring and {KEY_ENV_VAR}); give one"));
            }
            let ring = Keyring::from_file(path).map_err(|e| format!("--keyring: {e}"))?;
            let ring = match &self.identity {
                Some(name) => ring.prove_as(name).map_err(|e| format!("--identity: {e}"))?,
                None => ring,
            };
            return Ok(Auth::Keyring(ring));
        }
        match (&self.key_file, in_env, self.no_auth) {
            (Some(_), true, _) => {
                Err(format!("the key is given twice (--key-file and {KEY_ENV_VAR}); give one"))
            }
            (Some(path), false, _) => {
                Key::from_file(path).map(Auth::Key).map_err(|e| format!("--key-file: {e}"))
            }
            (None, true, true) => Err(format!(
                "{KEY_ENV_VAR} is set but --no-auth was given; unset {KEY_ENV_VAR} or drop --no-auth"
            )),
            (None, true, false) => {
                Key::from_env(KEY_ENV_VAR).map(Auth::Key).map_err(|e| format!("{KEY_ENV_VAR}: {e}"))
            }
            (None, false, true) => Ok(Auth::Unauthenticated),
            (None, false, false) => Err(format!(
                "no key for the bootstrap: give both sides the same key with --key-file PATH \
                 (e.g. head -c 32 /dev/urandom > key; chmod 600 key) or in {KEY_ENV_VAR}, \
                 or pass --no-auth to let anyone who reaches the port connect"
            )),
        }
    }
}
