//! Client load for tests and benchmarks of moves, speaking the demo application's protocol
//! ([`crate::demo::LineApp`]): every reply carries the number of lines and the hash of every
//! byte the server received, so each reply checks the whole stream both ways.

use crate::demo::reply;
use crate::format::{fnv1a, FNV_OFFSET};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Many mostly idle sessions, driven in rounds from one thread: a round writes one line on
/// every connection, then reads and checks every reply.
pub struct IdleSessions {
    conns: Vec<IdleConn>,
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
        Ok(IdleSessions { conns })
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
        for c in &mut self.conns {
            let l = idle_line(c.n, c.lines + c.unanswered);
            c.w.write_all(l.as_bytes())?;
            c.unanswered += 1;
        }
        Ok(())
    }

    /// Reads every reply owed and checks it; the first wrong or missing one is the error.
    pub fn check_all(&mut self) -> Result<(), String> {
        let mut got = String::new();
        for c in &mut self.conns {
            while c.unanswered > 0 {
                got.clear();
                match c.r.read_line(&mut got) {
                    Ok(0) => return Err(format!("connection {}: closed", c.n)),
                    Ok(_) => {}
                    Err(e) => return Err(format!("connection {}: {e}", c.n)),
                }
                c.hash = fnv1a(c.hash, idle_line(c.n, c.lines).as_bytes());
                c.lines += 1;
                c.unanswered -= 1;
                let want = reply(c.lines, c.hash);
                if got != want {
                    return Err(format!(
                        "connection {}: reply {got:?}, expected {want:?}",
                        c.n
                    ));
                }
            }
        }
        Ok(())
    }

    /// One line on every connection, every reply checked.
    pub fn round(&mut self) -> Result<(), String> {
        self.send_all().map_err(|e| format!("write: {e}"))?;
        self.check_all()
    }

    /// Lines answered and checked, over all connections.
    pub fn lines(&self) -> u64 {
        self.conns.iter().map(|c| c.lines).sum()
    }
}
