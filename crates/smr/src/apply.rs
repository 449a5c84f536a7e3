//! The applier thread: committed entries, in order, into this replica's unmodified server, one
//! local TCP connection per client connection id. Its own thread, so a slow server write does
//! not stall the Raft thread's heartbeats.
//!
//! Each local connection has an output reader: it hashes everything the server sends on it
//! (every replica, so outputs can be compared across replicas later) and, on the leader, copies
//! it to the client. When the server ends the connection, the client's is ended too.
//!
//! A new leader inherits connections the old leader's clients opened; nobody will close them
//! (their clients were cut with the old leader). The applier of the leader proposes a reset
//! for each open connection of an older term that it does not serve.

use crate::deliver::{Action, Admit, Cursor, Table};
use crate::event::{self, Kind};
use crate::front::Sinks;
use crate::lock;
use crate::node::{Input, Status};
use raft::prelude::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Server-side bounds.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    /// Connecting to the local server.
    pub connect_timeout: Duration,
    /// A write to the server that blocks this long marks it failed.
    pub write_timeout: Duration,
    /// Output digests kept (the oldest connection ids are forgotten first).
    pub max_digests: usize,
    /// How often the leader looks for orphaned connections.
    pub reap_every: Duration,
    /// How long the applier waits for the server's answer to the last write on one
    /// connection before it writes on another (see [`Applier::order`]).
    pub order_wait: Duration,
}

/// FNV-1a 64 parameters (offset basis, prime). FNV because the digest only has to tell two
/// honest replicas' outputs apart, cheaply, byte by byte as they arrive; a replica that lies
/// is not in this slice's model (Raft's is crash faults).
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// What a server sent on one connection: byte count and FNV-1a 64 over the bytes. Equal on
/// every replica when the server is deterministic for that input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digest {
    pub bytes: u64,
    pub fnv: u64,
    /// The server ended the connection.
    pub ended: bool,
}

impl Default for Digest {
    fn default() -> Digest {
        Digest {
            bytes: 0,
            fnv: FNV_OFFSET,
            ended: false,
        }
    }
}

impl Digest {
    pub fn update(&mut self, b: &[u8]) {
        for &x in b {
            self.fnv ^= u64::from(x);
            self.fnv = self.fnv.wrapping_mul(FNV_PRIME);
        }
        self.bytes += b.len() as u64;
    }
}

/// Output digests by connection id.
#[derive(Default)]
pub struct Digests {
    map: Mutex<BTreeMap<u64, Digest>>,
}

impl Digests {
    pub fn snapshot(&self) -> BTreeMap<u64, Digest> {
        lock(&self.map).clone()
    }

    fn put(&self, conn: u64, d: Digest, max: usize) {
        let mut m = lock(&self.map);
        m.insert(conn, d);
        while m.len() > max {
            m.pop_first();
        }
    }
}

struct Local {
    stream: TcpStream,
    reader: JoinHandle<()>,
    /// Bytes the server has sent on this connection so far (counted by its output reader).
    out: Arc<AtomicU64>,
}

/// The connection written last and its output count just before that write.
#[derive(Clone, Copy)]
struct LastWrite {
    conn: u64,
    out_before: u64,
}

pub struct Applier {
    pub server: SocketAddr,
    pub limits: ServerLimits,
    pub entries: Receiver<Vec<Entry>>,
    pub inbox: SyncSender<Input>,
    pub status: Arc<Status>,
    pub sinks: Arc<Sinks>,
    pub digests: Arc<Digests>,
}

impl Applier {
    /// Runs until the Raft thread drops its sender; then closes every local connection.
    pub fn run(self) {
        let mut cursor = Cursor::new(0);
        let mut table = Table::default();
        let mut locals: HashMap<u64, Local> = HashMap::new();
        let mut reaped: HashSet<u64> = HashSet::new();
        let mut last: Option<LastWrite> = None;
        loop {
            match self.entries.recv_timeout(self.limits.reap_every) {
                Ok(batch) => {
                    for e in batch {
                        if !self.entry(&e, &mut cursor, &mut table, &mut locals, &mut last) {
                            // Delivery cannot go on without running the server on another
                            // input than its peers: stop here, loudly.
                            self.status.server_failed.store(true, Ordering::SeqCst);
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.reap_orphans(&table, &mut reaped);
        }
        for (_, l) in locals.drain() {
            let _ = l.stream.shutdown(Shutdown::Both);
            let _ = l.reader.join();
        }
    }

    /// Applies one committed entry; false when delivery must stop.
    fn entry(
        &self,
        e: &Entry,
        cursor: &mut Cursor,
        table: &mut Table,
        locals: &mut HashMap<u64, Local>,
        last: &mut Option<LastWrite>,
    ) -> bool {
        if self.status.server_failed.load(Ordering::Relaxed) {
            return false;
        }
        match cursor.admit(e.index) {
            Admit::Duplicate => return true,
            Admit::Gap { expected } => {
                tracing::error!(index = e.index, expected, "smr: gap in committed entries");
                return false;
            }
            Admit::Deliver => {}
        }
        self.status.applied.store(e.index, Ordering::Release);
        let Some(ev) = event::decode(&e.data) else {
            return true; // a new leader's empty entry
        };
        match table.decide(&ev) {
            Action::Open => match self.open(ev.conn) {
                Ok(l) => {
                    locals.insert(ev.conn, l);
                }
                Err(err) => {
                    tracing::error!(conn = ev.conn, error = %err, "smr: server unreachable");
                    return false;
                }
            },
            Action::Write => {
                self.order(ev.conn, *last, locals);
                if let Some(l) = locals.get_mut(&ev.conn) {
                    *last = Some(LastWrite {
                        conn: ev.conn,
                        out_before: l.out.load(Ordering::Acquire),
                    });
                    match l.stream.write_all(&ev.bytes) {
                        Ok(()) => {}
                        Err(err) if closed_by_server(&err) => {
                            // The server closed this connection itself (QUIT, a protocol
                            // error): its later bytes have nowhere to go, on every replica
                            // alike.
                            tracing::debug!(conn = ev.conn, error = %err, "smr: server write");
                        }
                        Err(err) => {
                            // A timeout or another failure: part of the bytes may be written,
                            // this server no longer sees what its peers see.
                            tracing::error!(conn = ev.conn, error = %err, "smr: server write");
                            return false;
                        }
                    }
                }
            }
            Action::HalfClose | Action::Drop => {
                // A reset is delivered as a FIN too. Cutting the local connection (RST) would
                // discard whatever the server had not read yet, a different amount on each
                // replica; with a FIN every server reads every byte the log gave it, and ends
                // the connection itself. The reader drains the output until then, so our side
                // never closes with unread data (which would be a RST again).
                if let Some(l) = locals.remove(&ev.conn) {
                    let _ = l.stream.shutdown(Shutdown::Write);
                    // The reader finishes on the server's close; it is not joined here.
                    drop(l.reader);
                }
            }
            Action::Ignore => {}
        }
        debug_assert!(ev.kind != Kind::Connect || table.is_open(ev.conn));
        true
    }

    /// Before a write on `conn`: when the last write went to another connection, wait until
    /// the server has answered it (its output count moved), for at most `order_wait`. A server
    /// reads its connections in whatever order it finds them ready, so two connections'
    /// bytes written back to back could otherwise run in a different order on each replica
    /// (with different replies, or a different state when they touch the same data). For a
    /// server that answers every request (Redis) this keeps the log's order across
    /// connections; for one that does not answer some write it is a delay of `order_wait`.
    fn order(&self, conn: u64, last: Option<LastWrite>, locals: &HashMap<u64, Local>) {
        let Some(prev) = last.filter(|p| p.conn != conn) else {
            return;
        };
        let Some(out) = locals.get(&prev.conn).map(|l| &l.out) else {
            return; // closed since: it was read to its end
        };
        let until = Instant::now() + self.limits.order_wait;
        let mut spins = 0u32;
        while out.load(Ordering::Acquire) == prev.out_before && Instant::now() < until {
            if spins < 64 {
                std::thread::yield_now();
                spins += 1;
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    fn open(&self, conn: u64) -> std::io::Result<Local> {
        let s = TcpStream::connect_timeout(&self.server, self.limits.connect_timeout)?;
        s.set_nodelay(true)?;
        s.set_write_timeout(Some(self.limits.write_timeout))?;
        let r = s.try_clone()?;
        let (sinks, digests, max) = (
            self.sinks.clone(),
            self.digests.clone(),
            self.limits.max_digests,
        );
        let out = Arc::new(AtomicU64::new(0));
        let counted = out.clone();
        let reader = std::thread::Builder::new()
            .name("smr-output".into())
            .spawn(move || output(r, conn, &sinks, &digests, max, &counted))?;
        Ok(Local {
            stream: s,
            reader,
            out,
        })
    }

    /// On the leader: a reset for every open connection of an earlier term not served here.
    fn reap_orphans(&self, table: &Table, reaped: &mut HashSet<u64>) {
        let term = self.status.leader_term.load(Ordering::SeqCst);
        if term == 0 {
            reaped.clear();
            return;
        }
        reaped.retain(|c| table.is_open(*c));
        for conn in table.open_ids() {
            if conn >> 32 < term && !self.sinks.contains(conn) && reaped.insert(conn) {
                let data = event::encode(conn, Kind::Reset, b"");
                if self.inbox.try_send(Input::Propose { conn, data }).is_err() {
                    reaped.remove(&conn);
                }
            }
        }
    }
}

/// Whether a write failed because the server had closed the connection (as it does on every
/// replica for the same input), not because it stopped reading.
fn closed_by_server(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    matches!(e.kind(), BrokenPipe | ConnectionReset | ConnectionAborted)
}

/// Reads a local connection's output to its end: hash it, and copy it to the client when this
/// replica serves that client.
fn output(
    mut r: TcpStream,
    conn: u64,
    sinks: &Sinks,
    digests: &Digests,
    max: usize,
    out: &AtomicU64,
) {
    let mut sink = sinks.get(conn);
    let mut d = Digest::default();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        out.fetch_add(n as u64, Ordering::Release);
        d.update(&buf[..n]);
        digests.put(conn, d, max);
        if let Some(s) = sink.as_mut() {
            if s.write_all(&buf[..n]).is_err() {
                // The client is gone or stopped reading: its connection is cut, the output
                // is still read (and hashed) here.
                sinks.shutdown(conn);
                sink = None;
            }
        }
    }
    d.ended = true;
    digests.put(conn, d, max);
    if sink.is_some() {
        sinks.shutdown(conn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_fnv1a_64_and_chunking_does_not_matter() {
        let mut d = Digest::default();
        d.update(b"a");
        assert_eq!(
            d.fnv, 0xaf63_dc4c_8601_ec8c,
            "the published FNV-1a 64 of \"a\""
        );
        let (mut whole, mut parts) = (Digest::default(), Digest::default());
        whole.update(b"+OK\r\n:1\r\n");
        parts.update(b"+OK\r");
        parts.update(b"\n:1\r\n");
        assert_eq!(whole, parts);
        assert_eq!(whole.bytes, 9);
    }

    #[test]
    fn digests_forget_the_oldest_connections_first() {
        let d = Digests::default();
        for conn in [5, 1, 9, 3] {
            d.put(conn, Digest::default(), 3);
        }
        assert_eq!(
            d.snapshot().keys().copied().collect::<Vec<_>>(),
            vec![3, 5, 9]
        );
    }
}
