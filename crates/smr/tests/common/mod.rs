//! The in-process group of the library with redis-server children, wrapped for tests
//! (panics instead of errors), and a small RESP client. Everything started is stopped by
//! `Drop` (servers killed by PID), also when a test fails.
#![allow(dead_code)]

use pliant_smr::child::redis_argv;
use pliant_smr::group::LocalGroup;
use pliant_smr::{Limits, Replica};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub fn have_redis() -> bool {
    pliant_testkit::require_tool("redis-server", "redis-server")
}

pub struct Group {
    g: LocalGroup,
    pub dir: PathBuf,
}

impl Group {
    /// `n` replicas; peers over unix sockets in the group's directory, or TCP loopback.
    pub fn start(name: &str, n: u64, tcp_peers: bool) -> Group {
        let dir = std::env::temp_dir().join(format!("smr-{name}-{}", std::process::id()));
        let argv = Box::new(|port| redis_argv("redis-server", port));
        let g = LocalGroup::start(dir.clone(), n, tcp_peers, Limits::default(), argv).unwrap();
        Group { g, dir }
    }

    pub fn start_replica(&mut self, id: u64) {
        self.g.start_replica(id).unwrap();
    }

    pub fn kill(&mut self, id: u64) {
        self.g.kill(id);
    }

    pub fn replica(&self, id: u64) -> &Replica {
        self.g.replica(id).expect("replica running")
    }

    pub fn live(&self) -> impl Iterator<Item = &Replica> {
        self.g.live()
    }

    pub fn wait_leader(&self, within: Duration) -> u64 {
        self.g.wait_leader(within).unwrap()
    }

    pub fn front_addr(&self, id: u64) -> String {
        self.g.front_addr(id).expect("front")
    }

    pub fn server_addr(&self, id: u64) -> SocketAddr {
        self.g.server_addr(id).expect("server running")
    }

    /// A client of replica `id`'s front that got an answer: a new leader may still be
    /// settling (its front closes clients until it leads), so connect until a PING answers.
    pub fn serving_client(&self, id: u64, within: Duration) -> Resp {
        let t0 = Instant::now();
        loop {
            if let Ok(mut c) = Resp::connect(&self.front_addr(id)) {
                if c.cmd(&["PING"]).is_ok() {
                    return c;
                }
            }
            assert!(t0.elapsed() < within, "replica {id} serves no client");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every live replica has applied everything committed.
    pub fn wait_converged(&self, within: Duration) {
        let t0 = Instant::now();
        while !self.g.converged() {
            assert!(self.live().all(|r| !r.is_failed()), "a replica failed");
            assert!(
                t0.elapsed() < within,
                "replicas did not converge within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every live replica's output digests once each has `conns` connections, all ended
    /// (panics after `within`).
    pub fn ended_digests(
        &self,
        conns: usize,
        within: Duration,
    ) -> Vec<std::collections::BTreeMap<u64, pliant_smr::apply::Digest>> {
        let t0 = Instant::now();
        loop {
            let d: Vec<_> = self.live().map(|r| r.digests()).collect();
            if d.iter()
                .all(|m| m.len() == conns && m.values().all(|x| x.ended))
            {
                return d;
            }
            assert!(t0.elapsed() < within, "output digests: {d:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `DEBUG DIGEST` and `DBSIZE` of each live replica's server, read directly.
    pub fn server_states(&self) -> Vec<(u64, String, String)> {
        self.live()
            .map(|r| r.id)
            .collect::<Vec<_>>()
            .into_iter()
            .map(|id| {
                let mut c = Resp::connect(&self.server_addr(id).to_string()).unwrap();
                (
                    id,
                    c.cmd(&["DEBUG", "DIGEST"]).unwrap(),
                    c.cmd(&["DBSIZE"]).unwrap(),
                )
            })
            .collect()
    }

    /// [`Group::server_states`] once they agree, or as they are after `within`. Applied means
    /// written to the server's socket: a server may still be reading the last bytes (on its
    /// connections in any order), so agreement is awaited, not sampled once.
    pub fn settled_states(&self, within: Duration) -> Vec<(u64, String, String)> {
        let t0 = Instant::now();
        loop {
            let s = self.server_states();
            if s.iter().all(|x| (&x.1, &x.2) == (&s[0].1, &s[0].2)) || t0.elapsed() > within {
                return s;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // The group stops and kills everything when it drops, right after this; the logs stay
        // when the test failed.
        self.g.keep_dir = std::thread::panicking();
    }
}

/// A minimal RESP client: one command, one reply (simple, error, integer or bulk string).
pub struct Resp {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Resp {
    pub fn connect(addr: &str) -> std::io::Result<Resp> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Resp {
            r: BufReader::new(s.try_clone()?),
            w: s,
        })
    }

    pub fn send(&mut self, args: &[&str]) -> std::io::Result<()> {
        let mut b = format!("*{}\r\n", args.len());
        for a in args {
            b.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        self.w.write_all(b.as_bytes())
    }

    /// Reads one reply as text: `+OK` -> "OK", `:5` -> "5", `$3 abc` -> "abc", `$-1` -> "(nil)",
    /// `-ERR x` -> "ERR x" as an error.
    pub fn reply(&mut self) -> std::io::Result<String> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let line = line.trim_end().to_string();
        let (t, rest) = line.split_at(1);
        match t {
            "+" | ":" => Ok(rest.to_string()),
            "-" => Err(std::io::Error::other(rest.to_string())),
            "$" => {
                let n: i64 = rest.parse().map_err(std::io::Error::other)?;
                if n < 0 {
                    return Ok("(nil)".into());
                }
                let mut b = vec![0u8; n as usize + 2];
                std::io::Read::read_exact(&mut self.r, &mut b)?;
                b.truncate(n as usize);
                String::from_utf8(b).map_err(std::io::Error::other)
            }
            _ => Err(std::io::Error::other(format!("unexpected reply {line:?}"))),
        }
    }

    pub fn cmd(&mut self, args: &[&str]) -> std::io::Result<String> {
        self.send(args)?;
        self.reply()
    }
}
