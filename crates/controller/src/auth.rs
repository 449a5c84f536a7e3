//! API authentication: one bearer token, kept in a 0600 file, generated on first start.
//!
//! The token is 32 random bytes from the kernel (`/dev/urandom`), hex-encoded. Requests carry
//! `Authorization: Bearer <token>`; the comparison runs in time independent of where the first
//! difference is, so response timing leaks nothing about the token.

use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Token length in bytes before hex encoding.
pub const TOKEN_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("token file {path}: {reason}")]
    File { path: PathBuf, reason: String },
}

/// Reads the token from `path`, creating it (mode 0600, random) if it does not exist. A token
/// file readable by group or others is refused: anyone who can read it controls the fabric.
pub fn load_or_create_token(path: &Path) -> Result<String, AuthError> {
    let ferr = |reason: String| AuthError::File {
        path: path.to_path_buf(),
        reason,
    };
    match std::fs::metadata(path) {
        Ok(md) => {
            let mode = md.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(ferr(format!(
                    "mode {mode:o} lets others read it; chmod 600 it"
                )));
            }
            let text = std::fs::read_to_string(path).map_err(|e| ferr(e.to_string()))?;
            let t = text.trim().to_string();
            if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ferr("token must be >= 16 printable characters".into()));
            }
            Ok(t)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let t = random_token().map_err(|e| ferr(format!("/dev/urandom: {e}")))?;
            if let Some(dir) = path.parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir).map_err(|e| ferr(e.to_string()))?;
                }
            }
            // create_new: two controllers racing never overwrite each other's token.
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| ferr(e.to_string()))?;
            writeln!(f, "{t}").map_err(|e| ferr(e.to_string()))?;
            Ok(t)
        }
        Err(e) => Err(ferr(e.to_string())),
    }
}

/// A fresh random token (hex).
pub fn random_token() -> std::io::Result<String> {
    let mut b = [0u8; TOKEN_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Equality whose running time depends only on the lengths, not on the contents.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    // black_box keeps the optimiser from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

/// True when `header` (the Authorization value, if any) carries `token`.
pub fn authorized(header: Option<&str>, token: &str) -> bool {
    let Some(h) = header else { return false };
    let h = h.trim();
    let Some(rest) = h
        .strip_prefix("Bearer ")
        .or_else(|| h.strip_prefix("bearer "))
    else {
        return false;
    };
    constant_time_eq(rest.trim().as_bytes(), token.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn bearer_header_parsing() {
        let t = "0123456789abcdef0123";
        assert!(authorized(Some(&format!("Bearer {t}")), t));
        assert!(authorized(Some(&format!("  Bearer {t}  ")), t));
        assert!(!authorized(None, t));
        assert!(!authorized(Some(t), t), "scheme is required");
        assert!(!authorized(Some(&format!("Basic {t}")), t));
        assert!(!authorized(Some("Bearer "), t));
        assert!(!authorized(Some(&format!("Bearer {t}x")), t));
    }

    #[test]
    fn token_file_is_created_private_and_reread() {
        let d = std::env::temp_dir().join(format!("pliant-ctl-auth-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let p = d.join("token");
        let t1 = load_or_create_token(&p).unwrap();
        assert_eq!(t1.len(), TOKEN_BYTES * 2);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_or_create_token(&p).unwrap(), t1);
        // Opened up to others: refused.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load_or_create_token(&p).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn random_tokens_differ() {
        assert_ne!(random_token().unwrap(), random_token().unwrap());
    }
}
