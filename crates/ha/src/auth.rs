//! Authentication of the replication channel.
//!
//! - The secret is a file of 32+ random bytes written hex (64+ hex chars, trailing newline
//!   allowed), mode 0600, owned by the user running the replicas. The lab/agent creates one per
//!   deployment (`/run/pliant/<lab>/repl.secret`, see [`Secret::generate`]); every replica's
//!   config names it (`[ha] repl_secret = "..."`). A file readable or writable by group/other, or
//!   owned by another user, is refused by [`Secret::load`].
//! - Handshake on each new connection, before any [`crate::wire::ReplMsg`]: the server sends a
//!   32-byte random nonce `nonce_s`; the client answers
//!   `HMAC-SHA256(secret, "pliant-repl-v1" || nonce_s || nonce_c) || nonce_c`; the server answers
//!   `HMAC-SHA256(secret, "pliant-repl-v1-server" || nonce_c || nonce_s)`. Both compare in
//!   constant time. A failure closes the connection and is counted (by
//!   [`crate::transport`]).
//!
//! Why this shape: each side proves knowledge of the secret over a nonce the *other* side just
//! chose, so a recorded transcript replays to nothing (the fresh nonce differs), and the two
//! directions use different labels so one side's answer cannot be reflected back as the other's.
//! Unix sockets are also 0600 and SO_PEERCRED-checked; the HMAC is what makes the same channel
//! safe to carry over TCP between hosts. The channel is authenticated, not encrypted: flow
//! state is not secret from someone who can already read the replicas' memory.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use thiserror::Error;

type HmacSha256 = Hmac<Sha256>;

/// Shortest secret accepted, in bytes (256 bits: the HMAC-SHA256 key size).
pub const MIN_SECRET_BYTES: usize = 32;
/// Bound on the secret file read by [`Secret::load`] (a secret is a line of hex, not a file of
/// megabytes; a larger file is refused instead of read into memory).
pub const MAX_SECRET_FILE: u64 = 4096;
/// Size of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Size of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;

const CLIENT_LABEL: &[u8] = b"pliant-repl-v1";
const SERVER_LABEL: &[u8] = b"pliant-repl-v1-server";

#[derive(Debug, Error)]
pub enum AuthError {
    #[error("secret file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "secret file {path} has mode {mode:o}: it must not be accessible by group or other \
         (chmod 600 {path})"
    )]
    Permissions { path: PathBuf, mode: u32 },
    #[error("secret file {path} is owned by uid {owner}, not by this process's uid {me}")]
    Owner { path: PathBuf, owner: u32, me: u32 },
    #[error("secret file {path} is {size} bytes, over the {max}-byte bound", max = MAX_SECRET_FILE)]
    FileTooLarge { path: PathBuf, size: u64 },
    #[error("secret file {path}: {reason}")]
    BadHex { path: PathBuf, reason: String },
    #[error("secret is {got} bytes, at least {min} are required", min = MIN_SECRET_BYTES)]
    TooShort { got: usize },
    #[error("no randomness from the kernel: {0}")]
    Random(std::io::Error),
    #[error("handshake i/o: {0}")]
    HandshakeIo(std::io::Error),
    /// The peer closed the connection during the handshake. Seen by a client whose secret the
    /// server refused (the server closes without saying why).
    #[error("peer closed the connection during the handshake (wrong secret?)")]
    Closed,
    #[error("peer's handshake answer does not match the secret (wrong secret or replay)")]
    BadMac,
}

/// The shared replication secret. `Debug` never prints it; the bytes are overwritten on drop.
#[derive(Clone)]
pub struct Secret {
    key: Vec<u8>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.key.len())
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        for b in self.key.iter_mut() {
            // Volatile so the wipe of memory about to be freed is not optimised away.
            // SAFETY: `b` is a valid, aligned &mut u8.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl Secret {
    /// A secret from raw bytes (tests, or a caller that keeps the secret elsewhere).
    pub fn from_bytes(bytes: &[u8]) -> Result<Secret, AuthError> {
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(AuthError::TooShort { got: bytes.len() });
        }
        Ok(Secret {
            key: bytes.to_vec(),
        })
    }

    /// Reads a secret file: hex, 32+ bytes, mode without any group/other bits, owned by the
    /// effective uid. Surrounding whitespace (the trailing newline) is ignored.
    pub fn load(path: &Path) -> Result<Secret, AuthError> {
        let io = |source| AuthError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::fs::File::open(path).map_err(io)?;
        // Checked on the open file, not the path, so a swap between check and read is moot.
        let meta = f.metadata().map_err(io)?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(AuthError::Permissions {
                path: path.to_path_buf(),
                mode,
            });
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(AuthError::Owner {
                path: path.to_path_buf(),
                owner: meta.uid(),
                me,
            });
        }
        if meta.len() > MAX_SECRET_FILE {
            return Err(AuthError::FileTooLarge {
                path: path.to_path_buf(),
                size: meta.len(),
            });
        }
        let mut text = String::new();
        Read::by_ref(&mut f)
            .take(MAX_SECRET_FILE)
            .read_to_string(&mut text)
            .map_err(|e| AuthError::BadHex {
                path: path.to_path_buf(),
                reason: format!("not text: {e}"),
            })?;
        let key = decode_hex(text.trim()).map_err(|reason| AuthError::BadHex {
            path: path.to_path_buf(),
            reason,
        })?;
        Secret::from_bytes(&key)
    }

    /// Creates a new secret file at `path` (32 random bytes as hex + newline, mode 0600). Fails
    /// if the file exists: a deployment's secret is never silently replaced.
    pub fn generate(path: &Path) -> Result<Secret, AuthError> {
        let mut key = vec![0u8; MIN_SECRET_BYTES];
        fill_random(&mut key).map_err(AuthError::Random)?;
        let secret = Secret { key };
        let io = |source| AuthError::Io {
            path: path.to_path_buf(),
            source,
        };
        // mode() applies at creation, so the file is never readable by others, not even briefly.
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        let mut text = encode_hex(&secret.key);
        text.push('\n');
        f.write_all(text.as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        Ok(secret)
    }

    fn mac(&self, label: &[u8], a: &[u8], b: &[u8]) -> HmacSha256 {
        // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        m.update(label);
        m.update(a);
        m.update(b);
        m
    }
}

/// Client side of the handshake (the primary, which connects). On `Ok` the stream carries
/// [`crate::wire`] frames next. The caller bounds the time spent here with socket timeouts.
pub fn client_handshake<S: Read + Write>(stream: &mut S, secret: &Secret) -> Result<(), AuthError> {
    let mut nonce_s = [0u8; NONCE_LEN];
    read_exact(stream, &mut nonce_s)?;
    let mut nonce_c = [0u8; NONCE_LEN];
    fill_random(&mut nonce_c).map_err(AuthError::Random)?;
    let tag = secret
        .mac(CLIENT_LABEL, &nonce_s, &nonce_c)
        .finalize()
        .into_bytes();
    let mut answer = [0u8; MAC_LEN + NONCE_LEN];
    answer[..MAC_LEN].copy_from_slice(&tag);
    answer[MAC_LEN..].copy_from_slice(&nonce_c);
    stream.write_all(&answer).map_err(AuthError::HandshakeIo)?;
    stream.flush().map_err(AuthError::HandshakeIo)?;
    let mut server_tag = [0u8; MAC_LEN];
    read_exact(stream, &mut server_tag)?;
    // verify_slice compares in constant time.
    secret
        .mac(SERVER_LABEL, &nonce_c, &nonce_s)
        .verify_slice(&server_tag)
        .map_err(|_| AuthError::BadMac)
}

/// Server side of the handshake (the backup, which accepts). On `Err` the caller closes the
/// connection and counts the failure; nothing is sent to a client that failed.
pub fn server_handshake<S: Read + Write>(stream: &mut S, secret: &Secret) -> Result<(), AuthError> {
    let mut nonce_s = [0u8; NONCE_LEN];
    fill_random(&mut nonce_s).map_err(AuthError::Random)?;
    stream.write_all(&nonce_s).map_err(AuthError::HandshakeIo)?;
    stream.flush().map_err(AuthError::HandshakeIo)?;
    let mut answer = [0u8; MAC_LEN + NONCE_LEN];
    read_exact(stream, &mut answer)?;
    let (tag, nonce_c) = answer.split_at(MAC_LEN);
    secret
        .mac(CLIENT_LABEL, &nonce_s, nonce_c)
        .verify_slice(tag)
        .map_err(|_| AuthError::BadMac)?;
    let server_tag = secret
        .mac(SERVER_LABEL, nonce_c, &nonce_s)
        .finalize()
        .into_bytes();
    stream
        .write_all(&server_tag)
        .map_err(AuthError::HandshakeIo)?;
    stream.flush().map_err(AuthError::HandshakeIo)
}

fn read_exact<S: Read>(s: &mut S, buf: &mut [u8]) -> Result<(), AuthError> {
    s.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            AuthError::Closed
        } else {
            AuthError::HandshakeIo(e)
        }
    })
}

/// Fills `buf` from the kernel's CSPRNG (getrandom(2); blocks only before the pool is seeded).
pub(crate) fn fill_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length describe `rest`, a valid writable slice.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

fn encode_hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(char::from(DIGITS[usize::from(x >> 4)]));
        s.push(char::from(DIGITS[usize::from(x & 0xf)]));
    }
    s
}

fn decode_hex(s: &str) -> Result<Vec<u8>, String> {
    let b = s.as_bytes();
    if b.is_empty() {
        return Err("empty: expected at least 64 hex digits".into());
    }
    if !b.len().is_multiple_of(2) {
        return Err(format!("odd number of hex digits ({})", b.len()));
    }
    let digit = |i: usize| -> Result<u8, String> {
        let c = b[i];
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!(
                "not a hex digit at offset {i}: {:?}",
                char::from(c)
            )),
        }
    };
    (0..b.len() / 2)
        .map(|i| Ok((digit(2 * i)? << 4) | digit(2 * i + 1)?))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A private directory removed on drop (also when the test fails).
    pub(crate) struct TempDir(pub(crate) PathBuf);
    impl TempDir {
        pub(crate) fn new() -> TempDir {
            static N: AtomicU32 = AtomicU32::new(0);
            let mut r = [0u8; 4];
            fill_random(&mut r).unwrap();
            let p = std::env::temp_dir().join(format!(
                "pliant-ha-auth-{}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed),
                encode_hex(&r)
            ));
            std::fs::create_dir(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write_mode(path: &Path, text: &str, mode: u32) {
        let _ = std::fs::remove_file(path); // it may be read-only from the previous case
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn generate_then_load_round_trips_and_refuses_overwrite() {
        let d = TempDir::new();
        let p = d.0.join("repl.secret");
        let s = Secret::generate(&p).unwrap();
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.len(), 65, "64 hex digits and a newline");
        assert_eq!(Secret::load(&p).unwrap().key, s.key);
        assert!(matches!(Secret::generate(&p), Err(AuthError::Io { .. })));
        assert_ne!(Secret::generate(&d.0.join("other")).unwrap().key, s.key);
    }

    #[test]
    fn load_refuses_bad_files_with_clear_errors() {
        let d = TempDir::new();
        let p = d.0.join("s");
        let good = "ab".repeat(32);
        write_mode(&p, &good, 0o640);
        let e = Secret::load(&p).unwrap_err();
        assert!(
            matches!(e, AuthError::Permissions { mode: 0o640, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
        write_mode(&p, &good, 0o604);
        assert!(matches!(
            Secret::load(&p),
            Err(AuthError::Permissions { .. })
        ));
        write_mode(&p, &format!("{good}\n"), 0o400);
        assert!(Secret::load(&p).is_ok());
        write_mode(&p, &"ab".repeat(31), 0o600);
        assert!(matches!(
            Secret::load(&p),
            Err(AuthError::TooShort { got: 31 })
        ));
        write_mode(&p, &format!("{}zz", "ab".repeat(32)), 0o600);
        let e = Secret::load(&p).unwrap_err();
        assert!(matches!(e, AuthError::BadHex { .. }), "{e}");
        assert!(e.to_string().contains("offset 64"), "{e}");
        write_mode(&p, &format!("{}a", "ab".repeat(32)), 0o600);
        assert!(matches!(Secret::load(&p), Err(AuthError::BadHex { .. })));
        write_mode(&p, "", 0o600);
        assert!(matches!(Secret::load(&p), Err(AuthError::BadHex { .. })));
        write_mode(&p, &"0".repeat(MAX_SECRET_FILE as usize + 2), 0o600);
        assert!(matches!(
            Secret::load(&p),
            Err(AuthError::FileTooLarge { .. })
        ));
        assert!(matches!(
            Secret::load(&d.0.join("missing")),
            Err(AuthError::Io { .. })
        ));
        assert!(format!("{:?}", Secret::from_bytes(&[7; 32]).unwrap()).contains("32 bytes"));
    }

    /// Runs the server handshake on a thread and the client here.
    fn pair(server: &Secret, client: &Secret) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let server = server.clone();
        let t = std::thread::spawn(move || {
            let r = server_handshake(&mut a, &server);
            drop(a); // a refusing server closes the connection
            r
        });
        let c = client_handshake(&mut b, client);
        (t.join().unwrap(), c)
    }

    #[test]
    fn same_secret_authenticates_both_ways() {
        let s = Secret::from_bytes(&[1; 32]).unwrap();
        let (srv, cli) = pair(&s, &s);
        srv.unwrap();
        cli.unwrap();
    }

    #[test]
    fn wrong_secret_is_refused_by_the_server() {
        let s = Secret::from_bytes(&[1; 32]).unwrap();
        let other = Secret::from_bytes(&[2; 32]).unwrap();
        let (srv, cli) = pair(&s, &other);
        assert!(matches!(srv, Err(AuthError::BadMac)), "{srv:?}");
        assert!(matches!(cli, Err(AuthError::Closed)), "{cli:?}");
    }

    #[test]
    fn wrong_secret_is_refused_by_the_client() {
        // A server that does not know the secret answers with some tag: the client refuses it.
        let s = Secret::from_bytes(&[1; 32]).unwrap();
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            a.write_all(&[9; NONCE_LEN]).unwrap();
            let mut answer = [0u8; MAC_LEN + NONCE_LEN];
            a.read_exact(&mut answer).unwrap();
            let fake = Secret::from_bytes(&[2; 32]).unwrap();
            let tag = fake
                .mac(SERVER_LABEL, &answer[MAC_LEN..], &[9; NONCE_LEN])
                .finalize()
                .into_bytes();
            a.write_all(&tag).unwrap();
        });
        let r = client_handshake(&mut b, &s);
        t.join().unwrap();
        assert!(matches!(r, Err(AuthError::BadMac)), "{r:?}");
    }

    /// Records what a genuine client sent in one session and replays it to a fresh server
    /// session: the server's new nonce makes the recorded tag worthless.
    #[test]
    fn replayed_client_transcript_is_refused() {
        let s = Secret::from_bytes(&[5; 32]).unwrap();
        // A genuine session, recorded by a relay in the middle.
        let (mut a, mut relay_srv) = UnixStream::pair().unwrap();
        let (mut relay_cli, mut b) = UnixStream::pair().unwrap();
        let srv = s.clone();
        let t = std::thread::spawn(move || server_handshake(&mut a, &srv));
        let cli = s.clone();
        let c = std::thread::spawn(move || client_handshake(&mut b, &cli));
        let mut nonce = [0u8; NONCE_LEN];
        relay_srv.read_exact(&mut nonce).unwrap();
        relay_cli.write_all(&nonce).unwrap();
        let mut recorded = [0u8; MAC_LEN + NONCE_LEN];
        relay_cli.read_exact(&mut recorded).unwrap();
        relay_srv.write_all(&recorded).unwrap();
        let mut tag = [0u8; MAC_LEN];
        relay_srv.read_exact(&mut tag).unwrap();
        relay_cli.write_all(&tag).unwrap();
        t.join().unwrap().unwrap();
        c.join().unwrap().unwrap();
        // Replay to a new server session.
        let (mut a, mut attacker) = UnixStream::pair().unwrap();
        let srv = s.clone();
        let t = std::thread::spawn(move || server_handshake(&mut a, &srv));
        let mut fresh = [0u8; NONCE_LEN];
        attacker.read_exact(&mut fresh).unwrap();
        assert_ne!(fresh, nonce, "nonces must be fresh per session");
        attacker.write_all(&recorded).unwrap();
        let r = t.join().unwrap();
        assert!(matches!(r, Err(AuthError::BadMac)), "{r:?}");
        // And a recorded server answer replayed to a new client session.
        let (mut fake_srv, mut b) = UnixStream::pair().unwrap();
        let cli = s.clone();
        let c = std::thread::spawn(move || client_handshake(&mut b, &cli));
        fake_srv.write_all(&nonce).unwrap();
        let mut answer = [0u8; MAC_LEN + NONCE_LEN];
        fake_srv.read_exact(&mut answer).unwrap();
        fake_srv.write_all(&tag).unwrap();
        let r = c.join().unwrap();
        assert!(matches!(r, Err(AuthError::BadMac)), "{r:?}");
    }

    #[test]
    fn garbage_and_truncation_are_errors_not_panics() {
        let s = Secret::from_bytes(&[1; 32]).unwrap();
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let srv = s.clone();
        let t = std::thread::spawn(move || server_handshake(&mut a, &srv));
        let mut n = [0u8; NONCE_LEN];
        b.read_exact(&mut n).unwrap();
        b.write_all(b"short").unwrap();
        drop(b);
        assert!(matches!(t.join().unwrap(), Err(AuthError::Closed)));
        assert!(matches!(
            Secret::from_bytes(&[0; 31]),
            Err(AuthError::TooShort { got: 31 })
        ));
    }
}
