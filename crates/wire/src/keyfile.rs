//! Private files (node keys, the cluster CA key): read only if the opened file is mode 0600 or
//! stricter and owned by this process's uid; written with mode 0600 from creation; bounded.
//! Public files (certificates, the CA's public key) are read bounded, without the mode check.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Bound on a key or certificate file (they are a line of hex, not megabytes).
pub const MAX_KEY_FILE: u64 = 16 << 10;

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} has mode {mode:o}: a private key must not be accessible by group or other \
         (chmod 600 {path})"
    )]
    Permissions { path: PathBuf, mode: u32 },
    #[error("{path} is owned by uid {owner}, not by this process's uid {me}")]
    Owner { path: PathBuf, owner: u32, me: u32 },
    #[error("{path} is {size} bytes, over the {max}-byte bound", max = MAX_KEY_FILE)]
    TooLarge { path: PathBuf, size: u64 },
    #[error("{path}: {reason}")]
    Bad { path: PathBuf, reason: String },
}

fn read_bounded(path: &Path, private: bool) -> Result<Vec<u8>, KeyFileError> {
    let text = read_text_bounded(path, private)?;
    decode_hex(text.trim()).map_err(|reason| KeyFileError::Bad {
        path: path.to_path_buf(),
        reason,
    })
}

fn read_text_bounded(path: &Path, private: bool) -> Result<String, KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    // Checked on the open file, not the path, so a swap between check and read is moot.
    let meta = f.metadata().map_err(io)?;
    if private {
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyFileError::Permissions {
                path: path.to_path_buf(),
                mode,
            });
        }
        let me = crate::endpoint::euid();
        if meta.uid() != me {
            return Err(KeyFileError::Owner {
                path: path.to_path_buf(),
                owner: meta.uid(),
                me,
            });
        }
    }
    if meta.len() > MAX_KEY_FILE {
        return Err(KeyFileError::TooLarge {
            path: path.to_path_buf(),
            size: meta.len(),
        });
    }
    let mut text = String::new();
    Read::by_ref(&mut f)
        .take(MAX_KEY_FILE)
        .read_to_string(&mut text)
        .map_err(|e| KeyFileError::Bad {
            path: path.to_path_buf(),
            reason: format!("not text: {e}"),
        })?;
    Ok(text)
}

/// Reads a private text file as it is (a PEM key for another program's protocol, e.g. etcd's
/// TLS), with the same checks as [`read_private`]: mode and owner on the open file, bounded.
pub fn read_private_text(path: &Path) -> Result<String, KeyFileError> {
    read_text_bounded(path, true)
}

/// Reads a public text file as it is (a PEM certificate), bounded.
pub fn read_public_text(path: &Path) -> Result<String, KeyFileError> {
    read_text_bounded(path, false)
}

/// Reads a private hex file (mode and owner checked on the open file).
pub fn read_private(path: &Path) -> Result<Vec<u8>, KeyFileError> {
    read_bounded(path, true)
}

/// Reads a public hex file (certificate, CA public key).
pub fn read_public(path: &Path) -> Result<Vec<u8>, KeyFileError> {
    read_bounded(path, false)
}

/// Writes `bytes` as hex to a new file: mode 0600 from creation when `private` (never readable
/// by others, not even briefly), 0644 otherwise. An existing file is never replaced.
pub fn write_new(path: &Path, bytes: &[u8], private: bool) -> Result<(), KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .map_err(io)?;
    let mut text = encode_hex(bytes);
    text.push('\n');
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

pub fn encode_hex(b: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(D[(x >> 4) as usize] as char);
        s.push(D[(x & 15) as usize] as char);
    }
    s
}

pub fn decode_hex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd number of hex digits".into());
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(format!("{:?} is not a hex digit", c as char)),
    };
    s.as_bytes()
        .chunks(2)
        .map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn private_files_are_created_0600_and_loose_ones_refused() {
        let d = std::env::temp_dir().join(format!("pliant-wire-kf-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("k");
        let _ = std::fs::remove_file(&p);
        write_new(&p, &[1, 2, 0xab], true).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(read_private(&p).unwrap(), vec![1, 2, 0xab]);
        assert!(matches!(
            write_new(&p, &[1], true),
            Err(KeyFileError::Io { .. })
        ));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(
            read_private(&p),
            Err(KeyFileError::Permissions { mode: 0o640, .. })
        ));
        assert_eq!(read_public(&p).unwrap(), vec![1, 2, 0xab]);
        let big = d.join("big");
        std::fs::write(&big, vec![b'a'; MAX_KEY_FILE as usize + 2]).unwrap();
        assert!(matches!(
            read_public(&big),
            Err(KeyFileError::TooLarge { .. })
        ));
        std::fs::write(&big, b"zz\n").unwrap();
        assert!(matches!(read_public(&big), Err(KeyFileError::Bad { .. })));
        let _ = std::fs::remove_dir_all(d);
    }
}
