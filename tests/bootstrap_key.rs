//! Loading the pre-shared key: from a file, from the environment, the
//! limits, and that the bytes never show in `Debug`.

mod util;

use mwcap::bootstrap::{Auth, Key, KeyError};

fn key_file(name: &str, bytes: &[u8], mode: u32) -> util::TempFile {
    util::temp_file("key-test", name, bytes, mode)
}

#[test]
fn a_private_key_file_loads_and_one_final_newline_does_not_count() {
    let raw = key_file("raw", &[0xabu8; 32], 0o600);
    let echoed = key_file("echoed", b"0123456789abcdef0123\n", 0o600);
    let crlf = key_file("crlf", b"0123456789abcdef0123\r\n", 0o400);
    let printed = key_file("printed", b"0123456789abcdef0123", 0o640);
    Key::from_file(&raw).unwrap();
    // The same key however the file ended: proved with one, checked with another.
    let keys = [&echoed, &crlf, &printed].map(|p| format!("{:?}", Key::from_file(p).unwrap()));
    assert!(keys.iter().all(|k| k == "Key(20 bytes, redacted)"), "{keys:?}");
}

#[test]
fn debug_never_shows_the_bytes() {
    let k = Key::from_bytes(b"correct horse battery staple".to_vec()).unwrap();
    let shown = format!("{k:?} {:?}", Auth::Key(k.clone()));
    assert!(!shown.contains("horse") && !shown.contains("99, 111"), "{shown}");
    assert!(shown.contains("28 bytes"), "{shown}");
}

#[test]
fn short_and_overlong_keys_are_refused() {
    let e = Key::from_bytes(vec![1u8; 15]).unwrap_err();
    assert!(matches!(e, KeyError::TooShort { len: 15, min: 16 }), "{e:?}");
    assert!(e.to_string().contains("head -c 32 /dev/urandom"), "{e}");
    Key::from_bytes(vec![1u8; Key::MIN_LEN]).unwrap();
    let e = Key::from_file(key_file("long", &vec![7u8; Key::MAX_LEN + 1], 0o600)).unwrap_err();
    assert!(matches!(e, KeyError::TooLong { .. }), "{e:?}");
    // "secret\n" is 6 bytes once the newline is dropped.
    let e = Key::from_file(key_file("short", b"secret\n", 0o600)).unwrap_err();
    assert!(matches!(e, KeyError::TooShort { len: 6, .. }), "{e:?}");
}

#[cfg(unix)]
#[test]
fn a_key_file_open_to_every_user_is_refused() {
    for mode in [0o644, 0o604, 0o602, 0o666] {
        let path = key_file(&format!("open{mode:o}"), &[1u8; 32], mode);
        let e = Key::from_file(&path).unwrap_err();
        assert!(matches!(e, KeyError::OpenToAll { mode: m, .. } if m == mode), "{mode:o}: {e:?}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
    }
}

#[test]
fn a_missing_file_names_the_path() {
    let e = Key::from_file("/nonexistent/mwcap/key").unwrap_err();
    assert!(matches!(e, KeyError::Read { .. }), "{e:?}");
    assert!(e.to_string().contains("/nonexistent/mwcap/key"), "{e}");
}

#[test]
fn the_environment_variable_holds_the_key_itself() {
    // Names of our own, so that tests running in parallel do not collide.
    std::env::set_var("MWCAP_TEST_KEY_SET", "a key of twenty-four by\n");
    assert_eq!(format!("{:?}", Key::from_env("MWCAP_TEST_KEY_SET").unwrap()), "Key(23 bytes, redacted)");
    let e = Key::from_env("MWCAP_TEST_KEY_UNSET").unwrap_err();
    assert!(matches!(&e, KeyError::EnvNotSet { var } if var == "MWCAP_TEST_KEY_UNSET"), "{e:?}");
    std::env::set_var("MWCAP_TEST_KEY_SHORT", "short");
    assert!(matches!(Key::from_env("MWCAP_TEST_KEY_SHORT"), Err(KeyError::TooShort { len: 5, .. })));
}
