//! Endpoints: where a channel listens or connects, a unix socket path or a TCP `host:port`.
//!
//! Every config field that names a socket takes an endpoint: `unix:/run/x.sock` or a path
//! starting with `/` or `.` is a unix socket (same host only: the kernel tells a peer's uid and
//! a dead peer is seen at once), `tcp:host:port` or `host:port` is TCP (across hosts). The
//! [`Stream`] and [`Listener`] types hide which one a channel runs on; the session on top
//! ([`crate::session`]) authenticates both the same way, so a unix socket is no longer trusted
//! for being on the same machine.
//!
//! TCP: Nagle off (a checkpoint or an ack is one small frame that must leave now), keepalives on
//! with a LAN-sized schedule ([`TcpTuning`]) so a peer whose host vanished without a RST is
//! noticed by the kernel too, not only by the channel's own heartbeats.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

/// A place to listen on or connect to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port`; the host may be a name, resolved at connect.
    Tcp(String),
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {0:?} is empty")]
    Empty(String),
    #[error(
        "endpoint {0:?} is neither a unix socket path (unix:/path, /path, ./path) nor a TCP \
         address (tcp:host:port, host:port)"
    )]
    Unrecognised(String),
    #[error("endpoint {0:?}: the port is not a number from 0 to 65535")]
    BadPort(String),
}

impl FromStr for Endpoint {
    type Err = EndpointError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.is_empty() {
            return Err(EndpointError::Empty(s.into()));
        }
        if let Some(p) = t.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(EndpointError::Empty(s.into()));
            }
            return Ok(Endpoint::Unix(p.into()));
        }
        if t.starts_with('/') || t.starts_with('.') {
            return Ok(Endpoint::Unix(t.into()));
        }
        let hp = t.strip_prefix("tcp:").unwrap_or(t);
        // `[v6]:port` or `host:port`: the port is after the last colon.
        let Some((host, port)) = hp.rsplit_once(':') else {
            return Err(EndpointError::Unrecognised(s.into()));
        };
        if host.is_empty() {
            return Err(EndpointError::Unrecognised(s.into()));
        }
        port.parse::<u16>()
            .map_err(|_| EndpointError::BadPort(s.into()))?;
        Ok(Endpoint::Tcp(hp.into()))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

impl From<&Path> for Endpoint {
    fn from(p: &Path) -> Self {
        Endpoint::Unix(p.to_path_buf())
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(a: SocketAddr) -> Self {
        Endpoint::Tcp(a.to_string())
    }
}

impl Endpoint {
    pub fn is_tcp(&self) -> bool {
        matches!(self, Endpoint::Tcp(_))
    }
}

/// Kernel-level liveness of TCP connections. The defaults let one lost segment be
/// retransmitted (RTO starts at 200 ms) before anything is declared dead, and notice a silent
/// peer in `idle + interval * count` = 5 s; the channels' own heartbeats detect faster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpTuning {
    pub keepalive_idle: Duration,
    pub keepalive_interval: Duration,
    pub keepalive_count: u32,
    /// TCP_USER_TIMEOUT: sent data unacknowledged this long fails the connection.
    pub user_timeout: Duration,
}

impl Default for TcpTuning {
    fn default() -> Self {
        TcpTuning {
            keepalive_idle: Duration::from_secs(2),
            keepalive_interval: Duration::from_secs(1),
            keepalive_count: 3,
            user_timeout: Duration::from_secs(5),
        }
    }
}

fn setsockopt_int(fd: RawFd, level: i32, opt: i32, v: i32) -> io::Result<()> {
    // SAFETY: `v` lives across the call and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Applies Nagle-off and the keepalive schedule to a TCP stream.
pub fn tune_tcp(s: &TcpStream, t: &TcpTuning) -> io::Result<()> {
    s.set_nodelay(true)?;
    let fd = s.as_raw_fd();
    let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64) as i32;
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        secs(t.keepalive_idle),
    )?;
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        secs(t.keepalive_interval),
    )?;
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        t.keepalive_count.clamp(1, 127) as i32,
    )?;
    setsockopt_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        t.user_timeout.as_millis().clamp(1, i32::MAX as u128) as i32,
    )
}

/// Closes a TCP stream with a reset instead of a FIN (SO_LINGER with a zero timeout): for a
/// connection that only proved the peer listens, so that a listener that defers accepting
/// until data arrives ([`Listener::defer_accept_until_data`]) discards it in the kernel,
/// without ever waking its server.
pub fn close_with_reset(s: TcpStream) {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `l` lives across the call and its size is passed; the fd is `s`'s, open here.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    drop(s);
}

/// A connected stream, unix or TCP.
#[derive(Debug)]
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }

    pub fn is_unix(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }

    /// The peer closed the connection without sending a byte, as far as can be told without
    /// waiting (a non-blocking peek reads the end of the stream): a liveness probe, not a
    /// client. False when bytes wait, nothing has arrived yet, or the peek fails.
    pub fn closed_before_sending(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: `b` is valid for writes of its length for the duration of the call.
        let n = unsafe {
            libc::recv(
                self.as_raw_fd(),
                b.as_mut_ptr().cast(),
                b.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n == 0
    }

    /// The peer's uid on a unix socket (SO_PEERCRED); `None` on TCP, where the kernel cannot
    /// know who is at the other end.
    pub fn peer_uid(&self) -> Option<io::Result<u32>> {
        match self {
            Stream::Unix(s) => Some(peer_uid(s)),
            Stream::Tcp(_) => None,
        }
    }

    /// One `send(2)` with MSG_NOSIGNAL (a peer that went away is an error, not SIGPIPE).
    pub fn send_nosignal(&self, buf: &[u8]) -> io::Result<usize> {
        self.send_flags(buf, libc::MSG_NOSIGNAL)
    }

    /// One `send(2)` that never blocks (MSG_DONTWAIT | MSG_NOSIGNAL): as much of `buf` as the
    /// socket takes now; `WouldBlock` when it takes nothing.
    pub fn send_nowait(&self, buf: &[u8]) -> io::Result<usize> {
        self.send_flags(buf, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
    }

    fn send_flags(&self, buf: &[u8], flags: libc::c_int) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of its length for the duration of the call.
        let n = unsafe { libc::send(self.as_raw_fd(), buf.as_ptr().cast(), buf.len(), flags) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Writes all of `buf` with [`Stream::send_nosignal`].
    pub fn send_all(&self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            match self.send_nosignal(buf) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send_nosignal(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// The uid of the process at the other end of a unix socket (SO_PEERCRED).
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

/// Connects to `ep` within `timeout` (per resolved address for TCP), tuned for TCP.
pub fn connect(ep: &Endpoint, timeout: Duration, tcp: &TcpTuning) -> io::Result<Stream> {
    match ep {
        Endpoint::Unix(p) => UnixStream::connect(p).map(Stream::Unix),
        Endpoint::Tcp(a) => {
            let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{a}: no address"));
            for addr in a.to_socket_addrs()? {
                match TcpStream::connect_timeout(&addr, timeout.max(Duration::from_millis(1))) {
                    Ok(s) => {
                        tune_tcp(&s, tcp)?;
                        return Ok(Stream::Tcp(s));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
    }
}

/// Why [`Listener::bind`] failed.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("{0} is in use by a live server")]
    InUse(Endpoint),
    #[error("{0} exists and is not a socket (not replaced)")]
    NotASocket(Endpoint),
    #[error("{ep}: {source}")]
    Io { ep: Endpoint, source: io::Error },
}

/// A listening socket. A unix socket file left by a dead server is replaced; a live server's
/// socket or port is never taken over ([`BindError::InUse`]). A unix socket is mode 0600 and
/// removed on drop if it is still ours.
#[derive(Debug)]
pub enum Listener {
    Unix {
        l: UnixListener,
        path: PathBuf,
        inode: (u64, u64),
    },
    Tcp(TcpListener, TcpTuning),
}

impl Listener {
    pub fn bind(ep: &Endpoint, tcp: &TcpTuning) -> Result<Listener, BindError> {
        let io = |source| BindError::Io {
            ep: ep.clone(),
            source,
        };
        match ep {
            Endpoint::Unix(path) => {
                let l = bind_unix_replacing_stale(path, ep)?;
                let inode = file_id(path).map_err(io)?;
                // bind(2) used the umask; the session handshake guards the short window.
                if let Err(e) = std::fs::set_permissions(path, PermissionsExt::from_mode(0o600)) {
                    remove_if_same(path, inode);
                    return Err(io(e));
                }
                Ok(Listener::Unix {
                    l,
                    path: path.clone(),
                    inode,
                })
            }
            Endpoint::Tcp(a) => {
                // std sets SO_REUSEADDR, which on Linux still refuses a port with a live
                // listener (only TIME_WAIT leftovers are reused); no SO_REUSEPORT, so a second
                // process cannot share the port and steal half the connections.
                let l = TcpListener::bind(a.as_str()).map_err(|e| {
                    if e.kind() == io::ErrorKind::AddrInUse {
                        BindError::InUse(ep.clone())
                    } else {
                        io(e)
                    }
                })?;
                Ok(Listener::Tcp(l, *tcp))
            }
        }
    }

    /// For a protocol whose client speaks first (every pliant-wire handshake does): the
    /// kernel completes a TCP handshake but wakes the server only once the client's first
    /// bytes arrive, for up to `wait` (then as usual). A connection that is reset before
    /// sending anything (a liveness probe, [`close_with_reset`]) never reaches `accept`, and
    /// one that connects and stays silent holds no thread meanwhile. Nothing on unix.
    pub fn defer_accept_until_data(&self, wait: Duration) -> io::Result<()> {
        match self {
            Listener::Unix { .. } => Ok(()),
            Listener::Tcp(l, _) => setsockopt_int(
                l.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_DEFER_ACCEPT,
                wait.as_secs().clamp(1, i32::MAX as u64) as i32,
            ),
        }
    }

    /// The endpoint actually bound (a TCP port 0 becomes the kernel's choice).
    pub fn local_endpoint(&self) -> io::Result<Endpoint> {
        match self {
            Listener::Unix { path, .. } => Ok(Endpoint::Unix(path.clone())),
            Listener::Tcp(l, _) => Ok(Endpoint::from(l.local_addr()?)),
        }
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Listener::Unix { l, .. } => l.set_nonblocking(on),
            Listener::Tcp(l, _) => l.set_nonblocking(on),
        }
    }

    /// Accepts one connection (an accepted stream is blocking, TCP tuned).
    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Unix { l, .. } => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok(Stream::Unix(s))
            }
            Listener::Tcp(l, t) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                tune_tcp(&s, t)?;
                Ok(Stream::Tcp(s))
            }
        }
    }
}

impl AsRawFd for Listener {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Listener::Unix { l, .. } => l.as_raw_fd(),
            Listener::Tcp(l, _) => l.as_raw_fd(),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix { path, inode, .. } = self {
            remove_if_same(path, *inode);
        }
    }
}

fn bind_unix_replacing_stale(path: &Path, ep: &Endpoint) -> Result<UnixListener, BindError> {
    let io = |source| BindError::Io {
        ep: ep.clone(),
        source,
    };
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            let meta = std::fs::symlink_metadata(path).map_err(io)?;
            if !meta.file_type().is_socket() {
                return Err(BindError::NotASocket(ep.clone()));
            }
            // A live server accepts; the file of a dead one refuses.
            if UnixStream::connect(path).is_ok() {
                return Err(BindError::InUse(ep.clone()));
            }
            std::fs::remove_file(path).map_err(io)?;
            UnixListener::bind(path).map_err(io)
        }
        Err(e) => Err(io(e)),
    }
}

/// `(device, inode)` of the file at `path`, to recognise it later.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deferring_listener_never_wakes_for_a_reset_probe_but_takes_a_speaking_client() {
        let l = Listener::bind(&"127.0.0.1:0".parse().unwrap(), &TcpTuning::default()).unwrap();
        l.defer_accept_until_data(Duration::from_secs(3)).unwrap();
        l.set_nonblocking(true).unwrap();
        let Endpoint::Tcp(a) = l.local_endpoint().unwrap() else {
            panic!("tcp")
        };
        // Connected (the kernel answered the SYN), reset before a byte: nothing to accept.
        close_with_reset(TcpStream::connect(&a).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(l.accept(), Err(e) if e.kind() == io::ErrorKind::WouldBlock));
        // Without the reset, a FIN would complete the connection: accepted, already closed.
        drop(TcpStream::connect(&a).unwrap());
        let probe = wait_accept(&l);
        assert!(probe.closed_before_sending());
        // A client that speaks is accepted, and is not taken for a probe.
        let mut c = TcpStream::connect(&a).unwrap();
        c.write_all(b"hi").unwrap();
        let s = wait_accept(&l);
        assert!(!s.closed_before_sending());
        drop(c);
    }

    fn wait_accept(l: &Listener) -> Stream {
        for _ in 0..200 {
            match l.accept() {
                Ok(s) => return s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
        panic!("nothing to accept within 1 s")
    }

    #[test]
    fn endpoints_parse_both_kinds_and_refuse_junk() {
        let u: Endpoint = "/run/x.sock".parse().unwrap();
        assert_eq!(u, Endpoint::Unix("/run/x.sock".into()));
        assert_eq!(
            "unix:rel.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("rel.sock".into())
        );
        assert_eq!(
            "10.0.0.1:7000".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("10.0.0.1:7000".into())
        );
        assert_eq!(
            "tcp:[::1]:7000".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("[::1]:7000".into())
        );
        assert_eq!(
            "tcp:h:1".parse::<Endpoint>().unwrap().to_string(),
            "tcp:h:1"
        );
        assert!(matches!(
            "".parse::<Endpoint>(),
            Err(EndpointError::Empty(_))
        ));
        assert!(matches!(
            "host".parse::<Endpoint>(),
            Err(EndpointError::Unrecognised(_))
        ));
        assert!(matches!(
            "h:99999".parse::<Endpoint>(),
            Err(EndpointError::BadPort(_))
        ));
        assert!(matches!(
            ":80".parse::<Endpoint>(),
            Err(EndpointError::Unrecognised(_))
        ));
    }

    #[test]
    fn a_live_server_is_never_taken_over_and_a_dead_ones_file_is() {
        let t = TcpTuning::default();
        let l = Listener::bind(&"127.0.0.1:0".parse().unwrap(), &t).unwrap();
        let ep = l.local_endpoint().unwrap();
        assert!(matches!(Listener::bind(&ep, &t), Err(BindError::InUse(_))));
        let d = std::env::temp_dir().join(format!("pliant-wire-ep-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let uep = Endpoint::Unix(d.join("s.sock"));
        let u = Listener::bind(&uep, &t).unwrap();
        let mode = std::fs::metadata(d.join("s.sock"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(matches!(Listener::bind(&uep, &t), Err(BindError::InUse(_))));
        // A file left by a dead server (its listener closed, the file still there) is replaced.
        drop(u);
        {
            let _dead = UnixListener::bind(d.join("s.sock")).unwrap();
        }
        assert!(d.join("s.sock").exists());
        let again = Listener::bind(&uep, &t).unwrap();
        drop(again);
        assert!(!d.join("s.sock").exists());
        let plain = d.join("plain");
        std::fs::write(&plain, b"x").unwrap();
        assert!(matches!(
            Listener::bind(&Endpoint::Unix(plain.clone()), &t),
            Err(BindError::NotASocket(_))
        ));
        assert!(plain.exists());
        let _ = std::fs::remove_dir_all(d);
        // TCP streams come out tuned.
        let c = connect(&ep, Duration::from_secs(1), &t).unwrap();
        let Stream::Tcp(c) = c else { panic!() };
        assert!(c.nodelay().unwrap());
        let s = l.accept().unwrap();
        assert!(s.peer_uid().is_none());
    }
}
