//! Unix-socket server plumbing shared by the replication server ([`crate::transport`]), the
//! coherence hub (pliant-coherence) and the FTMB logger server (pliant-ftmb): binding over a
//! dead server's socket file, the accept loop that waits for a connection or a stop signal,
//! admitting a peer (same uid, shared-secret handshake), unlinking only our own socket file
//! ([`ServerSocket`] puts these together), and a thread per connection that stopping the
//! server can unblock and join ([`ConnThreads`]).

use crate::auth::{server_handshake, AuthError, Secret};
use std::collections::HashMap;
use std::io;
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
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

/// Why [`ServerSocket::start`] failed.
#[derive(Debug)]
pub enum StartError {
    /// Binding: a live server, a non-socket file, or an I/O error.
    Bind(BindError),
    /// chmod, the stop pair or the non-blocking switch.
    Io(io::Error),
    /// The accept thread could not be spawned.
    Spawn(io::Error),
}

impl StartError {
    /// Maps to a server's own error type.
    pub fn map<E>(
        self,
        in_use: impl FnOnce() -> E,
        not_a_socket: impl FnOnce() -> E,
        io: impl FnOnce(io::Error) -> E,
        spawn: impl FnOnce(io::Error) -> E,
    ) -> E {
        match self {
            StartError::Bind(BindError::InUse) => in_use(),
            StartError::Bind(BindError::NotASocket) => not_a_socket(),
            StartError::Bind(BindError::Io(e)) | StartError::Io(e) => io(e),
            StartError::Spawn(e) => spawn(e),
        }
    }
}

/// A server's listening socket: bound at `path` over a dead server's file
/// ([`bind_replacing_stale`]), mode 0600 at once (bind(2) used the umask; the uid check and
/// the HMAC handshake guard the short window), non-blocking, with an accept thread that
/// [`ServerSocket::stop_accepting`] signals through a socket pair ([`wait_accept_or_stop`]).
pub struct ServerSocket {
    path: PathBuf,
    inode: (u64, u64),
    stop_w: Option<UnixStream>,
    accept: Option<JoinHandle<()>>,
}

impl ServerSocket {
    /// Binds `path` and runs `accept(listener, stop)` on a thread named `thread`. On an error
    /// after the bind the socket file is removed again.
    pub fn start(
        path: &Path,
        thread: &str,
        accept: impl FnOnce(UnixListener, UnixStream) + Send + 'static,
    ) -> Result<ServerSocket, StartError> {
        let listener = bind_replacing_stale(path).map_err(StartError::Bind)?;
        let inode = file_id(path).map_err(StartError::Io)?;
        let fail = |e: StartError| {
            remove_if_same(path, inode);
            e
        };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| fail(StartError::Io(e)))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(StartError::Io(e)))?;
        let (stop_r, stop_w) = UnixStream::pair().map_err(|e| fail(StartError::Io(e)))?;
        let accept = std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || accept(listener, stop_r))
            .map_err(|e| fail(StartError::Spawn(e)))?;
        Ok(ServerSocket {
            path: path.to_path_buf(),
            inode,
            stop_w: Some(stop_w),
            accept: Some(accept),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Signals the accept thread and waits for it (set the server's own stop flag first, so
    /// that a connection accepted meanwhile is not served).
    pub fn stop_accepting(&mut self) {
        drop(self.stop_w.take());
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }

    /// Removes the socket file if it is still the one bound here (a newer server may have
    /// replaced it).
    pub fn unlink(&self) {
        remove_if_same(&self.path, self.inode);
    }
}

/// Why [`ConnThreads::spawn`] did not start a thread (the connection is dropped).
#[derive(Debug)]
pub enum SpawnRefused {
    /// `max` connection threads are running. The stream is handed back so the caller can
    /// count the refusal before the peer sees its connection close.
    OverBound(UnixStream),
    /// The stream could not be cloned for shutdown.
    Clone(io::Error),
    /// No thread could be spawned.
    Thread(io::Error),
}

/// A thread per connection, with a clone of each connection so that stopping the server can
/// shut them down (unblocking their reads) and join the threads.
#[derive(Default)]
pub struct ConnThreads {
    conns: Arc<Mutex<HashMap<u64, UnixStream>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicked connection thread must not take the server down with it.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ConnThreads {
    /// Runs `serve(stream)` on a thread named `name`, unless `max` connection threads are
    /// still running.
    pub fn spawn(
        &self,
        stream: UnixStream,
        max: usize,
        name: &str,
        serve: impl FnOnce(UnixStream) + Send + 'static,
    ) -> Result<(), SpawnRefused> {
        let mut threads = lock(&self.threads);
        threads.retain(|t| !t.is_finished());
        if threads.len() >= max {
            return Err(SpawnRefused::OverBound(stream));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let clone = stream.try_clone().map_err(SpawnRefused::Clone)?;
        lock(&self.conns).insert(id, clone);
        let conns = self.conns.clone();
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                serve(stream);
                lock(&conns).remove(&id);
            });
        match spawned {
            Ok(t) => {
                threads.push(t);
                Ok(())
            }
            Err(e) => {
                lock(&self.conns).remove(&id);
                Err(SpawnRefused::Thread(e))
            }
        }
    }

    /// Shuts every open connection down and joins every connection thread.
    pub fn shutdown_and_join(&self) {
        for s in lock(&self.conns).values() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        lock(&self.conns).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::AtomicUsize;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pliant-unix-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A server made of the two pieces: echo one byte per connection, at most 1 thread.
    #[test]
    fn server_socket_and_conn_threads_serve_bound_and_stop() {
        let d = dir("server");
        let path = d.join("s.sock");
        let conns = Arc::new(ConnThreads::default());
        let stopped = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicUsize::new(0));
        let (c2, s2, r2) = (conns.clone(), stopped.clone(), refused.clone());
        let mut sock = ServerSocket::start(&path, "test-accept", move |l, stop| {
            accept_until_stopped(&l, &stop, &s2, "test", |stream| {
                let served = c2.spawn(stream, 1, "test-conn", |mut s| {
                    let mut b = [0u8; 1];
                    // Blocks until the client writes or the server shuts the stream down.
                    while matches!(s.read(&mut b), Ok(1)) {
                        let _ = s.write_all(&b);
                    }
                });
                if let Err(SpawnRefused::OverBound(s)) = served {
                    r2.fetch_add(1, Ordering::SeqCst);
                    drop(s);
                }
                ControlFlow::Continue(())
            })
        })
        .unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        let mut a = UnixStream::connect(&path).unwrap();
        a.write_all(b"k").unwrap();
        let mut b = [0u8; 1];
        a.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"k");
        // The bound: a second connection gets no thread (closed at once).
        let mut second = UnixStream::connect(&path).unwrap();
        second
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(second.read(&mut b).unwrap_or(0), 0);
        // The accept thread counts the refusal just after closing the stream.
        for _ in 0..500 {
            if refused.load(Ordering::SeqCst) == 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(refused.load(Ordering::SeqCst), 1);
        assert_eq!(conns.open(), 1);
        // A second server on a live socket is refused (its liveness probe is one more
        // connection); a non-socket file is never replaced.
        assert!(matches!(
            ServerSocket::start(&path, "x", |_, _| {}),
            Err(StartError::Bind(BindError::InUse))
        ));
        let plain = d.join("plain");
        std::fs::write(&plain, b"x").unwrap();
        assert!(matches!(
            ServerSocket::start(&plain, "x", |_, _| {}),
            Err(StartError::Bind(BindError::NotASocket))
        ));
        assert!(plain.exists());
        // Stopping: the accept thread ends, the blocked connection thread is unblocked and
        // joined, the socket file goes.
        stopped.store(true, Ordering::SeqCst);
        sock.stop_accepting();
        conns.shutdown_and_join();
        assert_eq!(conns.open(), 0);
        sock.unlink();
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(d);
    }
}
