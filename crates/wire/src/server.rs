//! Server plumbing shared by every listener: bind (never over a live server), an accept thread
//! that a stop signal ends, and a bounded set of connection threads that stopping the server
//! unblocks and joins.
//!
//! Bounds a hostile peer meets: at most `max` connection threads (more are closed at once and
//! counted by the caller); the handshake runs on the connection thread within one whole-
//! handshake deadline ([`crate::session`]), so a peer trickling bytes holds a slot for that
//! long at most; after the handshake each channel applies its own idle timeout.

use crate::endpoint::{BindError, Endpoint, Listener, Stream, TcpTuning};
use crate::session::SessionError;
use std::collections::HashMap;
use std::io;
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// What [`wait_accept_or_stop`] saw.
pub enum Wake {
    /// The listener is readable (connections to accept).
    Accept,
    /// The stop socket is readable or closed: the accept loop ends.
    Stop,
    /// poll(2) failed with something other than EINTR.
    Failed(io::Error),
}

/// Blocks until `listener` has a connection or `stop` is readable/closed.
pub fn wait_accept_or_stop(listener: &Listener, stop: &UnixStream) -> Wake {
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
        if fds[0].revents != 0 {
            return Wake::Accept;
        }
    }
}

/// Accepts until `stop` is signalled, `stopped` is set, poll(2) fails or `on_conn` breaks.
pub fn accept_until_stopped(
    listener: &Listener,
    stop: &UnixStream,
    stopped: &AtomicBool,
    server: &str,
    mut on_conn: impl FnMut(Stream) -> ControlFlow<()>,
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
                Ok(s) => s,
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

/// The uid fence of an accepted stream: on a unix socket the kernel vouches for the peer's uid
/// (SO_PEERCRED), and a peer of another uid than this process is refused (counted in
/// `refused`) before any handshake, a second fence behind it. TCP has no such fence: true.
pub fn same_uid_peer(stream: &Stream, refused: &AtomicU64, server: &str) -> bool {
    match stream.peer_uid() {
        None => true,
        Some(Ok(uid)) if uid == crate::endpoint::euid() => true,
        Some(r) => {
            refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(uid = ?r.ok(), "{server} peer refused: other uid");
            false
        }
    }
}

/// Counts a server's failed handshake where it belongs: `auth_failures` for a peer that could
/// not prove an acceptable identity (certificate not the CA's or expired, a bad signature, a
/// missing role, another name than required), `aborted` for one that went away, stalled or
/// spoke garbage. Every channel's server counts the same way, so their stats read alike.
pub fn count_handshake_failure(
    e: &SessionError,
    auth_failures: &AtomicU64,
    aborted: &AtomicU64,
    server: &str,
) {
    match e {
        SessionError::Cert(_)
        | SessionError::BadSignature
        | SessionError::Role { .. }
        | SessionError::PeerName { .. } => {
            auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "{server} handshake refused");
        }
        _ => {
            aborted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(error = %e, "{server} handshake aborted");
        }
    }
}

/// Why [`ServerSocket::start`] failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error("server socket: {0}")]
    Io(io::Error),
    #[error("cannot start the accept thread: {0}")]
    Spawn(io::Error),
}

/// A server's listening socket with an accept thread that [`ServerSocket::stop_accepting`]
/// signals through a socket pair. The listener (and a unix socket file) goes with the thread.
pub struct ServerSocket {
    endpoint: Endpoint,
    stop_w: Option<UnixStream>,
    accept: Option<JoinHandle<()>>,
}

impl ServerSocket {
    /// Binds `ep` and runs `accept(listener, stop)` on a thread named `thread`.
    pub fn start(
        ep: &Endpoint,
        tcp: &TcpTuning,
        thread: &str,
        accept: impl FnOnce(Listener, UnixStream) + Send + 'static,
    ) -> Result<ServerSocket, StartError> {
        let listener = Listener::bind(ep, tcp)?;
        let endpoint = listener.local_endpoint().map_err(StartError::Io)?;
        listener.set_nonblocking(true).map_err(StartError::Io)?;
        let (stop_r, stop_w) = UnixStream::pair().map_err(StartError::Io)?;
        let accept = std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || accept(listener, stop_r))
            .map_err(StartError::Spawn)?;
        Ok(ServerSocket {
            endpoint,
            stop_w: Some(stop_w),
            accept: Some(accept),
        })
    }

    /// Where the server listens (a TCP port 0 resolved).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Signals the accept thread and waits for it (set the server's own stop flag first, so
    /// that a connection accepted meanwhile is not served). Closes the listener.
    pub fn stop_accepting(&mut self) {
        drop(self.stop_w.take());
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerSocket {
    fn drop(&mut self) {
        self.stop_accepting();
    }
}

/// Why [`ConnThreads::spawn`] did not start a thread (the connection is dropped).
#[derive(Debug)]
pub enum SpawnRefused {
    /// `max` connection threads are running. The stream is handed back so the caller can
    /// count the refusal before the peer sees its connection close.
    OverBound(Stream),
    /// The stream could not be cloned for shutdown.
    Clone(io::Error),
    /// No thread could be spawned.
    Thread(io::Error),
}

/// A thread per connection, with a clone of each connection so that stopping the server can
/// shut them down (unblocking their reads) and join the threads.
#[derive(Default)]
pub struct ConnThreads {
    conns: Arc<Mutex<HashMap<u64, Stream>>>,
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
        stream: Stream,
        max: usize,
        name: &str,
        serve: impl FnOnce(Stream) + Send + 'static,
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
    use crate::frame::FrameError;

    #[test]
    fn an_unproven_identity_is_an_auth_failure_a_vanished_peer_is_not() {
        let (auth, aborted) = (AtomicU64::new(0), AtomicU64::new(0));
        let role = SessionError::Role {
            name: "x".into(),
            roles: 4,
            need: 1,
        };
        count_handshake_failure(&role, &auth, &aborted, "t");
        count_handshake_failure(&SessionError::BadSignature, &auth, &aborted, "t");
        count_handshake_failure(
            &SessionError::Frame(FrameError::Closed),
            &auth,
            &aborted,
            "t",
        );
        count_handshake_failure(
            &SessionError::TimedOut(Duration::from_secs(1)),
            &auth,
            &aborted,
            "t",
        );
        assert_eq!(auth.load(Ordering::Relaxed), 2);
        assert_eq!(aborted.load(Ordering::Relaxed), 2);
    }
}
