//! Handling of secrets: randomness that fails loudly, comparisons whose time does not depend
//! on the secret, files only their owner can read, and passwords handed to child processes
//! without putting them on a command line (`/proc/<pid>/cmdline` is world-readable).

use std::io::Write;
use std::path::Path;

/// The operating system's random source could not be read. Nonces, salts and cancel keys
/// are then refused rather than made up: zeros would be predictable.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the system's random source: {0}")]
pub struct RandomError(String);

#[cfg(test)]
thread_local! {
    /// Test hook: makes [`fill_random`] fail on this thread.
    static BROKEN_RANDOM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the random source failing on this thread (tests only).
#[cfg(test)]
pub(crate) fn with_broken_random<T>(f: impl FnOnce() -> T) -> T {
    BROKEN_RANDOM.with(|b| b.set(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    BROKEN_RANDOM.with(|b| b.set(false));
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Fills `buf` from getrandom(2); an error when the kernel cannot supply the bytes.
pub fn fill_random(buf: &mut [u8]) -> Result<(), RandomError> {
    #[cfg(test)]
    if BROKEN_RANDOM.with(|b| b.get()) {
        return Err(RandomError("injected failure".into()));
    }
    getrandom::getrandom(buf).map_err(|e| RandomError(e.to_string()))
}

/// `N` random bytes.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], RandomError> {
    let mut b = [0u8; N];
    fill_random(&mut b)?;
    Ok(b)
}

/// A random u32 (cancel keys, md5 salts).
pub fn random_u32() -> Result<u32, RandomError> {
    random_bytes::<4>().map(u32::from_ne_bytes)
}

/// Equality whose time depends only on the lengths, not on where the inputs differ
/// (passwords, proofs, signatures: an early exit would tell an attacker how many leading
/// bytes of a guess were right).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(a.ct_eq(b))
}

/// Creates `path` (replacing a previous file) with mode 0600 — never briefly wider — and
/// writes `bytes`; with `owner` (uid, gid) the file is handed to that user before anything
/// is written, for secrets a server running as another user must read.
pub fn write_private_owned(
    path: &Path,
    bytes: &[u8],
    owner: Option<(u32, u32)>,
) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(err)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid)).map_err(err)?;
    }
    f.write_all(bytes).map_err(err)
}

/// [`write_private_owned`] for the current user.
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    write_private_owned(path, bytes, None)
}

/// A libpq password file line matching any host, port and database for `user`
/// (`:` and `\` escaped as libpq reads them).
pub fn pgpass_line(user: &str, password: &str) -> String {
    let esc = |s: &str| s.replace('\\', "\\\\").replace(':', "\\:");
    format!("*:*:*:{}:{}\n", esc(user), esc(password))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_broken_random_source_is_an_error_not_zeros() {
        assert!(random_bytes::<16>().is_ok_and(|b| b != [0; 16]));
        with_broken_random(|| {
            assert!(random_bytes::<16>().is_err());
            assert!(random_u32().is_err());
        });
        assert!(random_u32().is_ok());
    }

    #[test]
    fn ct_eq_is_equality() {
        assert!(ct_eq(b"md5abc", b"md5abc"));
        assert!(!ct_eq(b"md5abc", b"md5abd"));
        assert!(!ct_eq(b"md5abc", b"md5ab"));
        assert!(!ct_eq(b"", b"x"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn private_files_are_created_0600_even_over_a_wider_one() {
        let dir = std::env::temp_dir().join(format!("pliant-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("pgpass");
        std::fs::write(&p, "old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_private(&p, pgpass_line("u", "pw").as_bytes()).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(mode, 0o600);
        assert_eq!(text, "*:*:*:u:pw\n");
    }

    #[test]
    fn pgpass_escapes_colons_and_backslashes() {
        assert_eq!(pgpass_line("a:b", r"p\w:x"), "*:*:*:a\\:b:p\\\\w\\:x\n");
    }
}
