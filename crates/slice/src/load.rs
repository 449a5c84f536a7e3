//! Client load for tests and benchmarks of moves, speaking the demo application's protocol
//! ([`crate::demo::LineApp`]): every reply carries the number of lines and the hash of every
//! byte the server received, so each reply checks the whole stream both ways.

use crate::demo::reply;
use crate::format::{fnv1a, FNV_OFFSET};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Many mostly idle sessions, driven in rounds from one thread: a round writes one line on
/// every connection, then reads and checks every reply.
pub struct IdleSessions {
    conns: Vec<IdleConn>,
    /// Bytes of lines whose reply did not match.
    corrupted: u64,
}

struct IdleConn {
    w: TcpStream,
    r: BufReader<TcpStream>,
    lines: u64,
    hash: u64,
    /// Lines written whose reply was not read yet.
    unanswered: u64,
    n: usize,
}

/// Line `k` of connection `n` (deterministic, different lengths).
fn idle_line(n: usize, k: u64) -> String {
    format!("{n} {k} {}\n", "y".repeat((k as usize * 7 + n) % 61))
}

impl IdleSessions {
    /// Opens `n` connections to `addr` (replies are awaited at most `timeout` each).
    pub fn connect(addr: &str, n: usize, timeout: Duration) -> io::Result<IdleSessions> {
        let mut conns = Vec::with_capacity(n);
        for i in 0..n {
            let s = TcpStream::connect(addr)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_nodelay(true)?;
            conns.push(IdleConn {
                r: BufReader::new(s.try_clone()?),
                w: s,
                lines: 0,
                hash: FNV_OFFSET,
                unanswered: 0,
                n: i,
            });
        }
        Ok(IdleSessions {
            conns,
            corrupted: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// The client ends' addresses (the sessions' remote ends).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.conns
            .iter()
            .filter_map(|c| c.w.local_addr().ok())
            .collect()
    }

    /// Writes one line on every connection without reading the replies.
    pub fn send_all(&mut self) -> io::Result<()> {
        self.send_every(1)
    }

    /// Writes one line on every `step`-th connection without reading the replies.
    pub fn send_every(&mut self, step: usize) -> io::Result<()> {
        for c in self.conns.iter_mut().step_by(step.max(1)) {
            let l = idle_line(c.n, c.lines + c.unanswered);
            c.w.write_all(l.as_bytes())?;
            c.unanswered += 1;
        }
        Ok(())
    }

    /// Reads every reply owed and checks it; the first wrong or missing one is the error.
    pub fn check_all(&mut self) -> Result<(), String> {
        match self.check_each() {
            (_, None) => Ok(()),
            (_, Some(e)) => Err(e),
        }
    }

    /// Reads and checks every reply owed, connection by connection (one that fails does not
    /// stop the others): how many connections had every reply right, and the first error.
    pub fn check_each(&mut self) -> (usize, Option<String>) {
        let mut got = String::new();
        let (mut ok, mut first) = (0, None);
        for c in &mut self.conns {
            let mut failed = None;
            while c.unanswered > 0 {
                got.clear();
                match c.r.read_line(&mut got) {
                    Ok(0) => failed = Some(format!("connection {}: closed", c.n)),
                    Ok(_) => {}
                    Err(e) => failed = Some(format!("connection {}: {e}", c.n)),
                }
                if failed.is_some() {
                    break;
                }
                let line = idle_line(c.n, c.lines);
                c.hash = fnv1a(c.hash, line.as_bytes());
                c.lines += 1;
                c.unanswered -= 1;
                let want = reply(c.lines, c.hash);
                if got != want {
                    self.corrupted += line.len() as u64;
                    failed = Some(format!(
                        "connection {}: reply {got:?}, expected {want:?}",
                        c.n
                    ));
                    break;
                }
            }
            match failed {
                None => ok += 1,
                Some(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        (ok, first)
    }

    /// One line on every connection, every reply checked.
    pub fn round(&mut self) -> Result<(), String> {
        self.send_all().map_err(|e| format!("write: {e}"))?;
        self.check_all()
    }

    /// Bytes of lines whose reply did not match what the stream must produce.
    pub fn corrupted_bytes(&self) -> u64 {
        self.corrupted
    }

    /// Lines answered and checked, over all connections.
    pub fn lines(&self) -> u64 {
        self.conns.iter().map(|c| c.lines).sum()
    }
}

/// What a stream's reader saw.
#[derive(Debug, Default)]
struct Seen {
    /// Gaps between two consecutive replies of at least `GAP_RECORDED`.
    gaps: Vec<Duration>,
    /// Bytes of lines whose reply did not match what the stream must produce.
    corrupted: u64,
    error: Option<String>,
}

/// Inter-reply gaps shorter than this are not kept (a streaming session answers every few
/// hundred microseconds).
const GAP_RECORDED: Duration = Duration::from_millis(5);

/// One connection streaming lines of `line_len` bytes as fast as the server answers them, at
/// most `window` unanswered: a writer thread and a reader thread that checks every reply.
pub struct StreamClient {
    /// The client's own address (the session's remote end at the server).
    pub local: SocketAddr,
    sock: TcpStream,
    /// Replies received and checked.
    pub checked: Arc<AtomicU64>,
    /// Bytes of the lines answered and checked.
    pub answered_bytes: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    writer: Option<std::thread::JoinHandle<io::Result<()>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

/// Line `k` of stream `c`, `len` bytes long (at least its numbers and the newline).
fn stream_line(c: usize, k: u64, len: usize) -> Vec<u8> {
    let mut l = format!("{c} {k} ").into_bytes();
    let fill = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let extra = if len > 0 {
        len.saturating_sub(l.len() + 1)
    } else {
        (k % 97) as usize
    };
    l.extend((0..extra).map(|i| fill[(i + k as usize) % fill.len()]));
    l.push(b'\n');
    l
}

/// TCP_INFO counters of a client socket about retransmissions.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Retrans {
    pub total_retrans: u64,
    /// Retransmission timeouts that fired (tcpi_total_rto, Linux 6.7+; 0 before).
    pub rto: u64,
}

/// The retransmission counters of `s` (offsets of struct tcp_info, linux/tcp.h).
pub fn retrans(s: &TcpStream) -> io::Result<Retrans> {
    let mut b = [0u8; 256];
    let mut len = b.len() as libc::socklen_t;
    // SAFETY: `b` is writable for `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            b.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Retrans {
        total_retrans: u64::from(u32::from_ne_bytes([b[100], b[101], b[102], b[103]])),
        rto: if len >= 244 {
            u64::from(u16::from_ne_bytes([b[240], b[241]]))
        } else {
            0
        },
    })
}

impl StreamClient {
    /// Connects to `addr` as stream `c`; lines of `line_len` bytes (0: short lines of varying
    /// length), at most `window` of them unanswered.
    pub fn start(addr: &str, c: usize, line_len: usize, window: u64) -> io::Result<StreamClient> {
        let s = TcpStream::connect(addr)?;
        let local = s.local_addr()?;
        let sock = s.try_clone()?;
        let mut w = s.try_clone()?;
        let checked = Arc::new(AtomicU64::new(0));
        let answered_bytes = Arc::new(AtomicU64::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (checked_w, sent_w, stop_w) = (checked.clone(), sent.clone(), stop.clone());
        let writer = std::thread::spawn(move || -> io::Result<()> {
            let mut n = 0u64;
            let mut batch = Vec::new();
            while !stop_w.load(Ordering::Relaxed) {
                if n - checked_w.load(Ordering::Relaxed) >= window {
                    // Pacing of the load only: nothing waits on it for correctness.
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                batch.clear();
                let per = if line_len == 0 { 16 } else { 1 };
                for _ in 0..per {
                    batch.extend_from_slice(&stream_line(c, n, line_len));
                    n += 1;
                }
                w.write_all(&batch)?;
                sent_w.store(n, Ordering::Release);
            }
            w.shutdown(std::net::Shutdown::Write)
        });
        let (checked_r, bytes_r, seen_r) = (checked.clone(), answered_bytes.clone(), seen.clone());
        let reader = std::thread::spawn(move || {
            let mut r = BufReader::new(s);
            let (mut hash, mut n) = (FNV_OFFSET, 0u64);
            let mut got = String::new();
            let mut last = std::time::Instant::now();
            loop {
                got.clear();
                match r.read_line(&mut got) {
                    Ok(0) => return,
                    Ok(_) => {}
                    Err(e) => {
                        lock(&seen_r).error = Some(format!("stream {c}: read after {n}: {e}"));
                        return;
                    }
                }
                let now = std::time::Instant::now();
                if now - last >= GAP_RECORDED {
                    lock(&seen_r).gaps.push(now - last);
                }
                last = now;
                let line = stream_line(c, n, line_len);
                hash = fnv1a(hash, &line);
                n += 1;
                let want = reply(n, hash);
                if got != want {
                    let mut s = lock(&seen_r);
                    s.corrupted += line.len() as u64;
                    s.error = Some(format!(
                        "stream {c}: reply {n} is {got:?}, expected {want:?}"
                    ));
                    return;
                }
                bytes_r.fetch_add(line.len() as u64, Ordering::Relaxed);
                checked_r.store(n, Ordering::Relaxed);
            }
        });
        Ok(StreamClient {
            local,
            sock,
            checked,
            answered_bytes,
            sent,
            stop,
            seen,
            writer: Some(writer),
            reader: Some(reader),
        })
    }

    /// Waits up to `limit` for `more` further replies.
    pub fn progresses(&self, more: u64, limit: Duration) -> bool {
        let from = self.checked.load(Ordering::Relaxed);
        let end = std::time::Instant::now() + limit;
        while std::time::Instant::now() < end {
            if self.checked.load(Ordering::Relaxed) >= from + more {
                return true;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        false
    }

    pub fn retrans(&self) -> io::Result<Retrans> {
        retrans(&self.sock)
    }

    /// Stops streaming and waits for every reply: lines answered, the gaps between replies
    /// of at least 5 ms, bytes corrupted; an error if a reply was wrong or missing.
    pub fn finish(mut self) -> StreamOutcome {
        self.stop.store(true, Ordering::Relaxed);
        let wrote = self.writer.take().map(|w| w.join());
        // The reader ends at the server's close after the last reply (or at an error).
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let mut seen = std::mem::take(&mut *lock(&self.seen));
        match wrote {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(e))) => {
                seen.error.get_or_insert(format!("write: {e}"));
            }
            _ => {
                seen.error.get_or_insert("writer panicked".into());
            }
        }
        let sent = self.sent.load(Ordering::Acquire);
        let checked = self.checked.load(Ordering::Relaxed);
        if seen.error.is_none() && checked != sent {
            seen.error = Some(format!("{} lines unanswered", sent - checked));
        }
        StreamOutcome {
            lines: checked,
            gaps: seen.gaps,
            corrupted_bytes: seen.corrupted,
            error: seen.error,
        }
    }
}

/// How a stream ended.
#[derive(Debug)]
pub struct StreamOutcome {
    pub lines: u64,
    pub gaps: Vec<Duration>,
    pub corrupted_bytes: u64,
    pub error: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A counter of the calling thread's network namespace from `/proc/thread-self/net/<file>`
/// (`snmp`, `netstat`): the value under `name` in the two lines starting with `section`
/// (`Tcp:`, `TcpExt:`). None if the file, section or name is missing.
pub fn net_counter(file: &str, section: &str, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/thread-self/net/{file}")).ok()?;
    let mut lines = text.lines().filter(|l| l.starts_with(section));
    let (names, values) = (lines.next()?, lines.next()?);
    let i = names.split_whitespace().position(|n| n == name)?;
    values.split_whitespace().nth(i)?.parse().ok()
}
