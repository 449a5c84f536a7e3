//! Unix-socket server plumbing shared by the replication server ([`crate::transport`]) and the
//! coherence hub (pliant-coherence): binding over a dead server's socket file, waiting for a
//! connection or a stop signal, and unlinking only our own socket file.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

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
