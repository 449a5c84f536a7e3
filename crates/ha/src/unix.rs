//! Unix-socket server plumbing shared by the replication server ([`crate::transport`]), the
//! coherence hub (pliant-coherence) and the FTMB logger server (pliant-ftmb): binding over a
//! dead server's socket file, the accept loop that waits for a connection or a stop signal,
//! admitting a peer (same uid, shared-secret handshake), and unlinking only our own socket
//! file.

use crate::auth::{server_handshake, AuthError, Secret};
use std::io;
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Why [`bind_replacing_stale`] failed.
#[derive(Debug)]
pub enum BindError {
    /// A live server accepts on the path.
    InUse,
    /// The path exists and is not a socket (never removed).
    NotASocket,
    Io(io::Error),
}

/// Binds `path`; a socket file left by a dead server (connect refused) is replaced, a live
/// one or a non-socket file is refused.
pub fn bind_replacing_stale(path: &Path) -> Result<UnixListener, BindError> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let meta = std::fs::symlink_metadata(path).map_err(BindError::Io)?;
            if !meta.file_type().is_socket() {
                return Err(BindError::NotASocket);
            }
            // A live server accepts; the file of a dead one refuses.
            if UnixStream::connect(path).is_ok() {
                return Err(BindError::InUse);
            }
            std::fs::remove_file(path).map_err(BindError::Io)?;
            UnixListener::bind(path).map_err(BindError::Io)
        }
        Err(e) => Err(BindError::Io(e)),
    }
}

/// What [`wait_accept_or_stop`] saw.
pub enum Wake {
    /// The listener is readable (connections to accept).
    Accept,
    /// The stop socket is readable or closed: the accept loop ends.
    Stop,
    /// poll(2) failed with something other than EINTR.
    Failed(io::Error),
}

/// Blocks until `listener` has a connection or `stop` becomes readable (its other end was
/// written or closed). EINTR is retried.
pub fn wait_accept_or_stop(listener: &UnixListener, stop: &UnixStream) -> Wake {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Wake::Failed(e);
        }
        if fds[1].revents != 0 {
            return Wake::Stop;
        }
        return Wake::Accept;
    }
}

/// Accepts connections on the non-blocking `listener` and hands each to `on_conn`, until
/// `stop` is signalled (see [`wait_accept_or_stop`]), `stopped` is set, poll(2) fails or
/// `on_conn` breaks. `server` names the server in log messages ("replication", ...).
pub fn accept_until_stopped(
    listener: &UnixListener,
    stop: &UnixStream,
    stopped: &AtomicBool,
    server: &str,
    mut on_conn: impl FnMut(UnixStream) -> ControlFlow<()>,
) {
    loop {
        match wait_accept_or_stop(listener, stop) {
            Wake::Accept => {}
            Wake::Stop => return,
            Wake::Failed(e) => {
                tracing::error!(error = %e, "{server} accept loop: poll failed");
                return;
            }
        }
        if stopped.load(Ordering::SeqCst) {
            return;
        }
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning on a readable listener.
                    tracing::warn!(error = %e, "{server} accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            };
            if on_conn(stream).is_break() {
                return;
            }
        }
    }
}

/// Where a server counts the connections [`admit_peer`] refuses (the server's own counters).
pub struct AdmitCounters<'a> {
    /// Peer of another uid, or without credentials.
    pub peer_refused: &'a AtomicU64,
    /// Handshake with the wrong secret.
    pub auth_failures: &'a AtomicU64,
    /// Handshake cut short (closed, timed out, malformed).
    pub handshake_aborted: &'a AtomicU64,
}

/// Admits an accepted connection: the peer must run as our effective uid and prove `secret`
/// (server side of [`crate::auth`]), each read and write within `timeout` (at least 1 ms).
/// A refusal is counted in `c`, logged with `server` ("replication", ...) and returns false;
/// so does failing to set the timeouts (not counted: not the peer's doing). On success the
/// timeouts stay set.
pub fn admit_peer(
    stream: &mut UnixStream,
    secret: &Secret,
    timeout: Duration,
    c: &AdmitCounters<'_>,
    server: &str,
) -> bool {
    match peer_uid(stream) {
        Ok(uid) if uid == euid() => {}
        Ok(uid) => {
            c.peer_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(uid, "{server} peer refused: other uid");
            return false;
        }
        Err(e) => {
            c.peer_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "{server} peer refused: no credentials");
            return false;
        }
    }
    let t = Some(timeout.max(Duration::from_millis(1)));
    if stream.set_read_timeout(t).is_err() || stream.set_write_timeout(t).is_err() {
        return false;
    }
    match server_handshake(stream, secret) {
        Ok(()) => true,
        Err(AuthError::BadMac) => {
            c.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("{server} handshake failed: wrong secret");
            false
        }
        Err(e) => {
            c.handshake_aborted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "{server} handshake aborted");
            false
        }
    }
}

/// The uid of the process at the other end of `s` (SO_PEERCRED).
pub fn peer_uid(s: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` holds the buffer size.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: no preconditions, cannot fail.
    unsafe { libc::geteuid() }
}

/// `(device, inode)` of the socket file at `path`, to recognise it later.
pub fn file_id(path: &Path) -> io::Result<(u64, u64)> {
    let m = std::fs::symlink_metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// Removes `path` only if it is still the file `id` (a newer server may have replaced it).
pub fn remove_if_same(path: &Path, id: (u64, u64)) {
    if file_id(path).ok() == Some(id) {
        let _ = std::fs::remove_file(path);
    }
}
