//! The relay: the bytes of every established session, in both directions, on a few
//! event-loop threads (`ProxyConfig::relay_threads`) instead of a thread per session.
//!
//! Why: with a thread per session the proxy's own code was ~3 % of its CPU samples under
//! pgbench; the rest was the kernel waking a session thread for every message in each
//! direction (two wake-ups and two context switches per statement on top of a direct
//! connection). A loop handles every session that is ready in one wake-up, so under load
//! it sleeps far less often than once per message.
//!
//! What stays on threads of their own, because it is sequential and blocking with timeouts:
//! the login (startup packet, TLS handshake, authentication, the server connection), once
//! per session, and a session's move at failover (waiting for the controller's verdict,
//! connecting to the new primary, replaying), after which the session comes back to a loop.
//!
//! A loop never blocks: its sockets are non-blocking; bytes a peer does not take yet wait in
//! the session's [`Outbox`] for that peer, and while an outbox holds [`MAX_PENDING`] bytes or
//! more the other side is not read (back-pressure: a client that stops reading results stops
//! its server, not the loop, exactly as the blocking write did for a session thread).
//! Epoll is level-triggered: a socket the loop does not want to read is taken out of the
//! set's input interest, and output interest is asked for only while an outbox is not empty.

use super::{
    backend_lost, mono_ms, note_primary_heard, set_cancel_target, wait_for_epoch_change, Active,
    Backend, CancelReg, Lost, Shared,
};
use crate::proto::{self, Frame};
use crate::session::{ClientAction, CommitTxid, ServerAction, SessionState};
use crate::tls::Stream;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Output waiting for one peer beyond which the other side is no longer read.
const MAX_PENDING: usize = 1 << 20;
/// How often an idle loop looks at the failover epoch and the shutdown flag.
const TICK_MS: i32 = 50;
/// The epoll token of a loop's wake-up eventfd (session tokens are `slot << 1 | side`).
const WAKE: u64 = u64::MAX;
const CLIENT: usize = 0;
const SERVER: usize = 1;
/// How long a closing session may take to hand its last bytes to a slow client.
const CLOSE_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes bound for one peer that it has not taken yet.
#[derive(Default)]
pub(super) struct Outbox {
    buf: Vec<u8>,
    off: usize,
}

impl Outbox {
    fn len(&self) -> usize {
        self.buf.len() - self.off
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.off = 0;
    }

    /// Writes what the peer takes now; `Ok(true)` when nothing is left (TLS records
    /// included).
    fn flush(&mut self, s: &mut Stream) -> io::Result<bool> {
        loop {
            if self.off < self.buf.len() {
                match s.write_nb(&self.buf[self.off..]) {
                    Ok(n) => self.off += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
            if !s.flush_nb()? {
                return Ok(false);
            }
            if self.off >= self.buf.len() {
                self.clear();
                return Ok(true);
            }
        }
    }

    /// Writes everything, on a blocking socket.
    fn flush_blocking(&mut self, s: &mut Stream) -> io::Result<()> {
        let r = s.write_all(&self.buf[self.off..]).and_then(|_| s.flush());
        self.clear();
        r
    }
}

/// What a step of a session asks of its loop.
enum Step {
    Go,
    /// The server connection is gone or fenced: move the session (on a thread of its own).
    Lost,
    /// The session is over: send what is queued (best effort) and close.
    End,
}

/// An established session: its two connections and everything relaying needs.
pub(super) struct Session {
    sh: Arc<Shared>,
    c: Stream,
    be: Backend,
    st: SessionState,
    id: u32,
    /// Partial frames from the client / the server.
    cbuf: Vec<u8>,
    bbuf: Vec<u8>,
    to_client: Outbox,
    to_server: Outbox,
    /// Client frames held back until the txid of the transaction being committed is known:
    /// the COMMIT is sent only after its txid is recorded, so a failure in between is known
    /// to have aborted the transaction (one extra round trip per commit).
    held: Vec<u8>,
    /// Set after an error was sent for an extended cycle: drop messages until Sync.
    skip_until_sync: bool,
    /// A FATAL error from the server, kept from the client until the failover verdict.
    fatal_frame: Option<Frame>,
    /// The epoll interest registered for the client and the server socket (0: none).
    masks: [u32; 2],
    _reg: CancelReg,
    _active: Active,
}

impl Session {
    pub(super) fn new(
        sh: &Arc<Shared>,
        c: Stream,
        be: Backend,
        st: SessionState,
        id: u32,
        reg: CancelReg,
        active: Active,
    ) -> Session {
        Session {
            sh: sh.clone(),
            c,
            be,
            st,
            id,
            cbuf: Vec::with_capacity(8192),
            bbuf: Vec::with_capacity(8192),
            to_client: Outbox::default(),
            to_server: Outbox::default(),
            held: Vec::new(),
            skip_until_sync: false,
            fatal_frame: None,
            masks: [0, 0],
            _reg: reg,
            _active: active,
        }
    }

    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.c.set_nonblocking(on)?;
        self.be.s.set_nonblocking(on)
    }

    fn stream(&self, side: usize) -> &Stream {
        if side == CLIENT {
            &self.c
        } else {
            &self.be.s
        }
    }

    /// May the loop read from `side`? Not while the other peer has not taken
    /// [`MAX_PENDING`] bytes of what this one sent.
    fn can_read(&self, side: usize) -> bool {
        if side == CLIENT {
            self.to_server.len() < MAX_PENDING
        } else {
            self.to_client.len() < MAX_PENDING
        }
    }

    /// The epoll interest `side`'s socket needs now.
    fn want(&self, side: usize) -> u32 {
        let (ob, s) = if side == CLIENT {
            (&self.to_client, &self.c)
        } else {
            (&self.to_server, &self.be.s)
        };
        let mut m = 0;
        if self.can_read(side) {
            m |= libc::EPOLLIN as u32;
        }
        if ob.len() > 0 || s.wants_write() {
            m |= libc::EPOLLOUT as u32;
        }
        m
    }

    /// One readiness report for `side` (`hangup`: error or hang-up, read even when
    /// back-pressure says not to, so the EOF or error is seen instead of reported forever).
    fn on_ready(&mut self, side: usize, readable: bool, hangup: bool, tmp: &mut [u8]) -> Step {
        if (readable && self.can_read(side)) || hangup {
            let step = if side == SERVER {
                self.server_input(tmp)
            } else {
                self.client_input(tmp)
            };
            if !matches!(step, Step::Go) {
                return step;
            }
        }
        self.flush()
    }

    /// Sends what both peers take now.
    fn flush(&mut self) -> Step {
        if self.to_server.flush(&mut self.be.s).is_err() {
            // As an EOF on a read: its backend died.
            self.sh.primary_closed_ms.store(mono_ms(&self.sh), Relaxed);
            return Step::Lost;
        }
        if self.to_client.flush(&mut self.c).is_err() {
            return Step::End;
        }
        Step::Go
    }

    fn server_input(&mut self, tmp: &mut [u8]) -> Step {
        let sh = &*self.sh;
        let k = match self.be.s.read_some(tmp) {
            // Part of a TLS record: the rest comes with the next readiness.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Go,
            Ok(0) | Err(_) => {
                // Closed without a word (a FATAL would have come first): its backend died.
                sh.primary_closed_ms.store(mono_ms(sh), Relaxed);
                return Step::Lost;
            }
            Ok(k) => k,
        };
        note_primary_heard(sh);
        let mut lost = false;
        // Frames are inspected where they lie and forwarded as they came (one copy into the
        // client's outbox); only a partial frame is kept in `bbuf`.
        let data: &[u8] = if self.bbuf.is_empty() {
            &tmp[..k]
        } else {
            self.bbuf.extend_from_slice(&tmp[..k]);
            &self.bbuf
        };
        let out = &mut self.to_client.buf;
        let mut used = 0;
        loop {
            match proto::parse_frame_ref(&data[used..]) {
                Ok(Some((tag, body, u))) => {
                    if tag == b'E' && super::is_fatal(body) {
                        // The server ends this session (e.g. "terminating connection due to
                        // unexpected postmaster exit"): the session may still be moved, so
                        // the client does not see this yet.
                        self.fatal_frame = Some(Frame::new(tag, body.to_vec()));
                        lost = true;
                        break;
                    }
                    match self.st.on_server_raw(tag, body) {
                        ServerAction::Forward => out.extend_from_slice(&data[used..used + u]),
                        ServerAction::Replace(g) => g.encode_into(out),
                        ServerAction::Swallow => {}
                    }
                    used += u;
                }
                Ok(None) => break,
                Err(_) => {
                    lost = true;
                    break;
                }
            }
        }
        if self.bbuf.is_empty() {
            self.bbuf.extend_from_slice(&tmp[used..k]);
        } else {
            self.bbuf.drain(..used);
        }
        if self.st.injected_outstanding() == 0 && !self.held.is_empty() {
            self.to_server.buf.extend_from_slice(&self.held);
            self.held.clear();
        }
        if lost {
            Step::Lost
        } else {
            Step::Go
        }
    }

    /// Ends the session with a FATAL error for the client and a Terminate for the server.
    fn fatal(&mut self, code: &str, msg: &str) -> Step {
        proto::error_response("FATAL", code, msg).encode_into(&mut self.to_client.buf);
        Frame::new(b'X', vec![]).encode_into(&mut self.to_server.buf);
        Step::End
    }

    fn client_input(&mut self, tmp: &mut [u8]) -> Step {
        match self.c.read_some(tmp) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Go,
            Ok(0) | Err(_) => {
                Frame::new(b'X', vec![]).encode_into(&mut self.to_server.buf);
                return Step::End;
            }
            Ok(k) => self.cbuf.extend_from_slice(&tmp[..k]),
        }
        let mut used = 0;
        let mut step = Step::Go;
        loop {
            let f = match proto::parse_frame(&self.cbuf[used..]) {
                Ok(Some((f, u))) => {
                    used += u;
                    f
                }
                Ok(None) => break,
                Err(e) => {
                    self.sh.stats.protocol_errors.fetch_add(1, SeqCst);
                    step = self.fatal("08P01", &format!("invalid frontend message: {e}"));
                    break;
                }
            };
            if self.skip_until_sync {
                if f.tag == b'S' {
                    self.skip_until_sync = false;
                    proto::ready_for_query(self.st.status).encode_into(&mut self.to_client.buf);
                }
                continue;
            }
            match self.st.on_client(&f) {
                ClientAction::Forward {
                    inject_before,
                    hold,
                    inject_after,
                } => {
                    if inject_before {
                        proto::query(crate::session::TXID_QUERY)
                            .encode_into(&mut self.to_server.buf);
                    }
                    // Once something is held, everything after it is held too (order).
                    let dst = if hold || !self.held.is_empty() {
                        &mut self.held
                    } else {
                        &mut self.to_server.buf
                    };
                    f.encode_into(dst);
                    if inject_after {
                        proto::query(crate::session::TXID_QUERY).encode_into(dst);
                    }
                }
                ClientAction::Substitute(g) => {
                    let dst = if self.held.is_empty() {
                        &mut self.to_server.buf
                    } else {
                        &mut self.held
                    };
                    g.encode_into(dst);
                }
                ClientAction::Reply {
                    frames,
                    skip_to_sync,
                } => {
                    for g in frames {
                        g.encode_into(&mut self.to_client.buf);
                    }
                    self.skip_until_sync |= skip_to_sync;
                }
                ClientAction::Terminate => {
                    f.encode_into(&mut self.to_server.buf);
                    step = Step::End;
                    break;
                }
                ClientAction::Violation => {
                    self.sh.stats.protocol_errors.fetch_add(1, SeqCst);
                    step = self.fatal("08P01", &format!("invalid frontend message type {}", f.tag));
                    break;
                }
            }
        }
        if !matches!(step, Step::Go) {
            return step;
        }
        self.cbuf.drain(..used);
        if self.held.len() > crate::session::MAX_INFLIGHT_BYTES {
            // A client pipelining megabytes behind a COMMIT that waits for its txid.
            self.sh.stats.protocol_errors.fetch_add(1, SeqCst);
            return self.fatal("54000", "pliant: too much data pipelined behind a COMMIT");
        }
        Step::Go
    }
}

/// The session's server connection is gone or fenced (on a thread of its own, blocking):
/// hand the client what was already bound for it, then move the session to the new primary
/// and give it back to a loop, or close it with the reason.
fn recover(mut s: Session) {
    let sh = s.sh.clone();
    if s.set_nonblocking(false).is_err() || s.to_client.flush_blocking(&mut s.c).is_err() {
        return;
    }
    // What the old server did not take is lost with it; the session state knows what was
    // in flight.
    s.to_server.clear();
    s.bbuf.clear();
    if let Some(f) = s.fatal_frame.take() {
        if sh.epoch.load(SeqCst) == s.be.epoch && !wait_for_epoch_change(&sh, s.be.epoch) {
            // Not a failover: the server really ended this session; pass its error on.
            sh.stats.sessions_dropped_other.fetch_add(1, SeqCst);
            let _ = proto::write_frames(&mut s.c, &[f]);
            return;
        }
    }
    if !s.held.is_empty() {
        s.st.commit = Some(CommitTxid::NotSent);
        s.held.clear();
    }
    match backend_lost(&mut s.c, &mut s.st, &sh, s.be.epoch) {
        Lost::Moved(nb) => {
            s.be = nb;
            set_cancel_target(&sh, s.id, None, &s.be);
            if s.st.ext_open {
                s.skip_until_sync = true;
                s.st.ext_open = false;
            }
            if s.set_nonblocking(true).is_ok() {
                s.masks = [0, 0];
                sh.relay.submit(s);
            }
        }
        Lost::Closed => {}
    }
}

/// Closes a finished session: what is queued goes out if the peers take it now; a client
/// that does not gets its last bytes (errors, results) on a thread of its own, bounded by
/// [`CLOSE_WRITE_TIMEOUT`], so the loop never waits for it.
fn finish(mut s: Session) {
    let _ = s.to_server.flush(&mut s.be.s);
    match s.to_client.flush(&mut s.c) {
        Ok(true) => s.c.shutdown(),
        Ok(false) => {
            std::thread::spawn(move || {
                if s.set_nonblocking(false).is_ok()
                    && s.c.set_write_timeout(Some(CLOSE_WRITE_TIMEOUT)).is_ok()
                {
                    let _ = s.to_client.flush_blocking(&mut s.c);
                }
                s.c.shutdown();
            });
        }
        Err(_) => {}
    }
}

/// One event loop's mailbox: sessions handed to it (after login or after a move) and the
/// eventfd that wakes it.
struct Mailbox {
    inbox: Mutex<Vec<Session>>,
    wake: OwnedFd,
    epoll: OwnedFd,
    sessions: AtomicUsize,
}

/// The proxy's event loops (their threads run [`run`]).
pub(super) struct Relay {
    loops: Vec<Mailbox>,
}

fn sys(what: &str) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

impl Relay {
    pub(super) fn new(n: usize) -> Result<Relay, String> {
        let mut loops = Vec::new();
        for _ in 0..n.max(1) {
            // SAFETY: plain syscalls; non-negative results are new fds we own.
            let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if wake < 0 {
                return Err(sys("eventfd"));
            }
            // SAFETY: as above.
            let wake = unsafe { OwnedFd::from_raw_fd(wake) };
            // SAFETY: as above.
            let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if ep < 0 {
                return Err(sys("epoll_create1"));
            }
            // SAFETY: as above.
            let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
            ctl(
                &epoll,
                libc::EPOLL_CTL_ADD,
                wake.as_raw_fd(),
                libc::EPOLLIN as u32,
                WAKE,
            )?;
            loops.push(Mailbox {
                inbox: Mutex::new(Vec::new()),
                wake,
                epoll,
                sessions: AtomicUsize::new(0),
            });
        }
        Ok(Relay { loops })
    }

    pub(super) fn threads(&self) -> usize {
        self.loops.len()
    }

    /// Hands a session to the loop with the fewest sessions.
    pub(super) fn submit(&self, s: Session) {
        if s.sh.shutdown.load(SeqCst) {
            return;
        }
        let Some(m) = self.loops.iter().min_by_key(|m| m.sessions.load(Relaxed)) else {
            return;
        };
        m.sessions.fetch_add(1, Relaxed);
        if let Ok(mut q) = m.inbox.lock() {
            q.push(s);
        }
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a valid buffer to our eventfd; a full counter (never,
        // it is read on every wake-up) would only make the write fail harmlessly.
        unsafe { libc::write(m.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

fn ctl(ep: &OwnedFd, op: i32, fd: i32, events: u32, token: u64) -> Result<(), String> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: ep is our epoll fd, fd a live socket or eventfd, ev valid for the call.
    if unsafe { libc::epoll_ctl(ep.as_raw_fd(), op, fd, &mut ev) } < 0 {
        return Err(sys("epoll_ctl"));
    }
    Ok(())
}

/// The sessions of one loop, indexed by slot (epoll tokens are `slot << 1 | side`).
struct Slots {
    v: Vec<Option<Session>>,
    free: Vec<usize>,
}

impl Slots {
    fn insert(&mut self, s: Session) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.v[i] = Some(s);
                i
            }
            None => {
                self.v.push(Some(s));
                self.v.len() - 1
            }
        }
    }

    fn take(&mut self, i: usize) -> Option<Session> {
        let s = self.v.get_mut(i)?.take();
        if s.is_some() {
            self.free.push(i);
        }
        s
    }
}

/// Brings the epoll interest of slot `i`'s sockets up to date.
fn sync_interest(ep: &OwnedFd, i: usize, s: &mut Session) -> Result<(), String> {
    for side in [CLIENT, SERVER] {
        let want = s.want(side);
        if want == s.masks[side] {
            continue;
        }
        let fd = s.stream(side).as_raw_fd();
        let op = if s.masks[side] == 0 && want != 0 {
            libc::EPOLL_CTL_ADD
        } else if want == 0 {
            libc::EPOLL_CTL_DEL
        } else {
            libc::EPOLL_CTL_MOD
        };
        ctl(ep, op, fd, want, (i as u64) << 1 | side as u64)?;
        s.masks[side] = want;
    }
    Ok(())
}

/// Takes slot `i`'s session out of the loop and does what `step` asks.
fn retire(ep: &OwnedFd, m: &Mailbox, slots: &mut Slots, i: usize, step: Step) {
    let Some(mut s) = slots.take(i) else { return };
    m.sessions.fetch_sub(1, Relaxed);
    for side in [CLIENT, SERVER] {
        if s.masks[side] != 0 {
            let _ = ctl(ep, libc::EPOLL_CTL_DEL, s.stream(side).as_raw_fd(), 0, 0);
            s.masks[side] = 0;
        }
    }
    match step {
        Step::Go => {}
        Step::Lost => {
            std::thread::spawn(move || recover(s));
        }
        Step::End => finish(s),
    }
}

/// Event loop `me` of the proxy's relay, until shutdown.
pub(super) fn run(sh: Arc<Shared>, me: usize) {
    let m = &sh.relay.loops[me];
    let ep = &m.epoll;

    let mut slots = Slots {
        v: Vec::new(),
        free: Vec::new(),
    };
    let mut tmp = vec![0u8; 65536];
    let mut evs = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    // (slot, side) with decrypted TLS bytes waiting: readiness will not announce them.
    let mut again: Vec<(usize, usize)> = Vec::new();
    let mut ready: Vec<(usize, usize, u32)> = Vec::new();
    let mut epoch = sh.epoch.load(SeqCst);
    while !sh.shutdown.load(SeqCst) {
        let wait = if again.is_empty() { TICK_MS } else { 0 };
        // SAFETY: evs holds evs.len() events, as passed.
        let n =
            unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, wait) };
        ready.clear();
        ready.extend(
            again
                .drain(..)
                .map(|(i, side)| (i, side, libc::EPOLLIN as u32)),
        );
        for e in evs.iter().take(n.max(0) as usize) {
            if e.u64 == WAKE {
                let mut b = [0u8; 8];
                // SAFETY: reads 8 bytes into a valid buffer from our non-blocking eventfd.
                unsafe { libc::read(m.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
                let new: Vec<Session> = m
                    .inbox
                    .lock()
                    .map(|mut q| q.drain(..).collect())
                    .unwrap_or_default();
                for s in new {
                    let i = slots.insert(s);
                    // Bytes may already wait (TLS-decrypted, or in the socket: level-triggered
                    // epoll reports those once registered).
                    again.push((i, CLIENT));
                    again.push((i, SERVER));
                }
                continue;
            }
            ready.push(((e.u64 >> 1) as usize, (e.u64 & 1) as usize, e.events));
        }
        // A failover fenced the primary: every session on an older server connection moves.
        let now = sh.epoch.load(SeqCst);
        if now != epoch {
            epoch = now;
            for i in 0..slots.v.len() {
                if slots.v[i].as_ref().is_some_and(|s| s.be.epoch != now) {
                    retire(ep, m, &mut slots, i, Step::Lost);
                }
            }
        }
        for &(i, side, events) in &ready {
            let Some(s) = slots.v.get_mut(i).and_then(|s| s.as_mut()) else {
                continue;
            };
            if s.be.epoch != now {
                retire(ep, m, &mut slots, i, Step::Lost);
                continue;
            }
            let readable = events & libc::EPOLLIN as u32 != 0;
            let hangup = events & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
            let step = s.on_ready(side, readable, hangup, &mut tmp);
            if !matches!(step, Step::Go) {
                retire(ep, m, &mut slots, i, step);
                continue;
            }
            if let Err(e) = sync_interest(ep, i, s) {
                super::set_err(&sh, &format!("relay: {e}"));
                retire(ep, m, &mut slots, i, Step::End);
                continue;
            }
            for side in [CLIENT, SERVER] {
                let st = if side == CLIENT {
                    &mut s.c
                } else {
                    &mut s.be.s
                };
                if st.is_tls() && s.masks[side] & libc::EPOLLIN as u32 != 0 && st.buffered() {
                    again.push((i, side));
                }
            }
        }
        again.sort_unstable();
        again.dedup();
    }
    // Shutdown: the sessions close with their sockets.
    if let Ok(mut q) = m.inbox.lock() {
        q.clear();
    }
}
