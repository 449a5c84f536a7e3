//! A three-replica group in this process, each replica with its own redis-server child, and a
//! small RESP client. Everything started here is stopped by `Drop` (servers killed by PID),
//! also when a test fails.
#![allow(dead_code)]

use pliant_smr::child::{redis_argv, ServerChild};
use pliant_smr::{Config, Limits, PeerSpec, Replica};
use pliant_wire::endpoint::Endpoint;
use pliant_wire::{role, Ca, Security};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub fn have_redis() -> bool {
    pliant_testkit::require_tool("redis-server", "redis-server")
}

/// A loopback port nobody listens on now (bound and released: good enough for a test).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Group {
    pub dir: PathBuf,
    ca: Ca,
    members: Vec<PeerSpec>,
    pub replicas: Vec<Option<Replica>>,
    pub servers: Vec<Option<ServerChild>>,
    pub limits: Limits,
}

impl Group {
    /// `n` replicas; peers over unix sockets in the group's directory, or TCP loopback.
    pub fn start(name: &str, n: u64, tcp_peers: bool) -> Group {
        let dir = std::env::temp_dir().join(format!("smr-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let members: Vec<PeerSpec> = (1..=n)
            .map(|id| PeerSpec {
                id,
                name: format!("smr-{id}"),
                endpoint: if tcp_peers {
                    Endpoint::Tcp(format!("127.0.0.1:{}", free_port()))
                } else {
                    Endpoint::Unix(dir.join(format!("peer-{id}.sock")))
                },
            })
            .collect();
        let mut g = Group {
            dir,
            ca: Ca::generate(None).unwrap(),
            members,
            replicas: (0..n).map(|_| None).collect(),
            servers: (0..n).map(|_| None).collect(),
            limits: Limits::default(),
        };
        for id in 1..=n {
            g.start_replica(id);
        }
        g
    }

    /// Starts (or restarts, on its log) replica `id` with a fresh, empty server.
    pub fn start_replica(&mut self, id: u64) {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let server = ServerChild::spawn(
            &redis_argv("redis-server", port),
            addr,
            Duration::from_secs(10),
        )
        .unwrap();
        let identity = self
            .ca
            .issue(&format!("smr-{id}"), role::REPLICA, 3600)
            .unwrap();
        let r = Replica::start(Config {
            id,
            members: self.members.clone(),
            front: Endpoint::Tcp("127.0.0.1:0".into()),
            server: addr,
            dir: self.dir.join(format!("r{id}")),
            security: Security::new(identity),
            limits: self.limits.clone(),
        })
        .unwrap();
        self.servers[id as usize - 1] = Some(server);
        self.replicas[id as usize - 1] = Some(r);
    }

    /// SIGKILLs replica `id`'s server and stops its Raft node, transport and front.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut s) = self.servers[id as usize - 1].take() {
            s.kill();
        }
        if let Some(r) = self.replicas[id as usize - 1].take() {
            r.stop();
        }
    }

    pub fn replica(&self, id: u64) -> &Replica {
        self.replicas[id as usize - 1]
            .as_ref()
            .expect("replica running")
    }

    pub fn live(&self) -> impl Iterator<Item = &Replica> {
        self.replicas.iter().flatten()
    }

    /// The one live leader, once there is exactly one.
    pub fn wait_leader(&self, within: Duration) -> u64 {
        let t0 = Instant::now();
        loop {
            let leaders: Vec<u64> = self
                .live()
                .filter(|r| r.is_leader())
                .map(|r| r.id)
                .collect();
            if leaders.len() == 1 {
                return leaders[0];
            }
            assert!(
                t0.elapsed() < within,
                "no single leader within {within:?}: {leaders:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn front_addr(&self, id: u64) -> String {
        match self.replica(id).front() {
            Some(Endpoint::Tcp(a)) => a,
            e => panic!("front {e:?}"),
        }
    }

    pub fn server_addr(&self, id: u64) -> SocketAddr {
        self.servers[id as usize - 1].as_ref().unwrap().addr
    }

    /// Waits until every live replica has applied everything the leader committed.
    pub fn wait_converged(&self, within: Duration) {
        let t0 = Instant::now();
        loop {
            assert!(self.live().all(|r| !r.is_failed()), "a replica failed");
            let commit = self.live().map(|r| r.commit()).max().unwrap_or(0);
            if self
                .live()
                .all(|r| r.applied() >= commit && r.commit() == commit)
            {
                return;
            }
            assert!(
                t0.elapsed() < within,
                "replicas did not converge within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `DEBUG DIGEST` and `DBSIZE` of each live replica's server, read directly.
    pub fn server_states(&self) -> Vec<(u64, String, String)> {
        (1..=self.servers.len() as u64)
            .filter(|id| self.servers[*id as usize - 1].is_some())
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
}

impl Drop for Group {
    fn drop(&mut self) {
        for r in self.replicas.iter_mut() {
            if let Some(r) = r.take() {
                r.stop();
            }
        }
        for s in self.servers.iter_mut() {
            if let Some(mut s) = s.take() {
                s.kill();
            }
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
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
