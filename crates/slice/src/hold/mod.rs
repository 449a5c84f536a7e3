//! Holding a connection's packets while no socket owns it.
//!
//! During a move there is a moment when neither instance has a socket for the connection: the
//! kernel refuses a second socket with a live 4-tuple (the restored socket's `connect` fails
//! while the source's is open), so the source must close first. A segment from the client
//! arriving then would find no socket, or the listener, and either answers with a RST. Worse,
//! a segment reaching the source socket between its capture and its close would be
//! acknowledged and then lost with the socket. So from before the capture until the restored
//! socket is in place, the client's segments of that 4-tuple are kept from the TCP stack.
//!
//! Two ways, one chosen when the hold is created ([`HoldMode`]):
//! - [`queue`] (preferred): a tc-BPF program on the ingress of loopback and of every other
//!   interface present at creation diverts the held segments to a packet socket, and
//!   [`PacketHold::release`] writes them back in their order: the client loses nothing, so a
//!   move does not cost it a retransmission timeout.
//! - [`drop`] (fallback when the queue cannot be set up, or forced with
//!   `PLIANT_SLICE_HOLD=drop`): an nftables set dropping the held segments at prerouting on
//!   every interface; the client retransmits them after the release, about one move in a
//!   hundred after its 200 ms minimum retransmission timeout.

mod drop;
mod frames;
mod queue;

use std::net::SocketAddr;

pub(crate) use frames::seq_ge;
use frames::Key;
pub use queue::{CommitStats, Left, QueueBounds, QueueStats};

#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("running {cmd}: {source}")]
    Spawn {
        cmd: &'static str,
        source: std::io::Error,
    },
    #[error("nft {what} failed: {stderr}")]
    Nft { what: String, stderr: String },
    #[error("nf_tables netlink: {0}")]
    Netlink(std::io::Error),
    #[error("{what}: {stderr}")]
    Command { what: String, stderr: String },
    #[error("BPF: {0}")]
    Bpf(String),
    #[error("{op}: {source}")]
    Sys {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{0} is not held")]
    NotHeld(String),
    #[error("{0} is held already")]
    AlreadyHeld(String),
}

/// How this hold keeps the client's segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldMode {
    /// Queued and written back on release (tc-BPF on loopback + a packet socket).
    Queue,
    /// Dropped (nftables); the client retransmits them.
    Drop,
}

impl HoldMode {
    pub fn as_str(self) -> &'static str {
        match self {
            HoldMode::Queue => "queue",
            HoldMode::Drop => "drop",
        }
    }
}

#[derive(Debug)]
enum Imp {
    Queue(Box<queue::QueueHold>),
    Drop(drop::DropHold),
}

/// `(local, remote, covered_seq, covered_ack)` as the program keys the instance's output.
fn output_keys(conns: &[(SocketAddr, SocketAddr, u32, u32)]) -> Vec<(Key, u32, u32)> {
    conns
        .iter()
        .map(|(l, r, s, a)| (Key::output_of(l, r), *s, *a))
        .collect()
}

/// An instance's packet hold.
#[derive(Debug)]
pub struct PacketHold {
    imp: Imp,
    /// Why the queue is not used, when it is not.
    fallback: Option<String>,
}

/// Alphanumeric and `_` only, at most 32 characters: part of a table's name.
fn clean_tag(tag: &str) -> String {
    tag.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(32)
        .collect()
}

impl PacketHold {
    /// The queueing hold if it can be set up here, else the dropping one (the reason is kept:
    /// [`PacketHold::fallback_reason`]). `PLIANT_SLICE_HOLD=drop` asks for the dropping one.
    /// Both live in the calling thread's network namespace.
    pub fn create(tag: &str) -> Result<PacketHold, HoldError> {
        if std::env::var("PLIANT_SLICE_HOLD").as_deref() == Ok("drop") {
            let mut h = PacketHold::dropping(tag)?;
            h.fallback = Some("PLIANT_SLICE_HOLD=drop".into());
            return Ok(h);
        }
        match PacketHold::queueing(tag) {
            Ok(h) => Ok(h),
            Err(e) => {
                tracing::warn!(error = %e, "queueing packet hold unavailable: segments of moving connections will be dropped");
                let mut h = PacketHold::dropping(tag)?;
                h.fallback = Some(e.to_string());
                Ok(h)
            }
        }
    }

    /// The queueing hold, or why not.
    pub fn queueing(tag: &str) -> Result<PacketHold, HoldError> {
        PacketHold::queueing_bounded(tag, QueueBounds::default())
    }

    /// The queueing hold with other bounds than the default ones.
    pub fn queueing_bounded(tag: &str, bounds: QueueBounds) -> Result<PacketHold, HoldError> {
        Ok(PacketHold {
            imp: Imp::Queue(Box::new(queue::QueueHold::create(tag, bounds)?)),
            fallback: None,
        })
    }

    /// The dropping hold (nftables).
    pub fn dropping(tag: &str) -> Result<PacketHold, HoldError> {
        Ok(PacketHold {
            imp: Imp::Drop(drop::DropHold::create(tag)?),
            fallback: None,
        })
    }

    pub fn mode(&self) -> HoldMode {
        match self.imp {
            Imp::Queue(_) => HoldMode::Queue,
            Imp::Drop(_) => HoldMode::Drop,
        }
    }

    /// Why this is the dropping hold, if it is one because the queue could not be set up.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// The name of what holds: the nftables table, or the queue's veth.
    pub fn table(&self) -> &str {
        match &self.imp {
            Imp::Queue(q) => q.name(),
            Imp::Drop(d) => d.table(),
        }
    }

    /// Keeps the client's segments of this connection from the stack from now on. Holding a
    /// held connection is an error.
    pub fn hold(&self, local: &SocketAddr, remote: &SocketAddr) -> Result<(), HoldError> {
        self.hold_many(&[(*local, *remote)])
    }

    /// Lets them through again (the queued ones first, in order). Releasing a connection not
    /// held is an error.
    pub fn release(&self, local: &SocketAddr, remote: &SocketAddr) -> Result<(), HoldError> {
        self.release_many(&[(*local, *remote)])
    }

    /// [`PacketHold::hold`] for many connections `(local, remote)` at once (one netlink batch
    /// for the dropping hold).
    pub fn hold_many(&self, conns: &[(SocketAddr, SocketAddr)]) -> Result<(), HoldError> {
        match &self.imp {
            Imp::Queue(q) => q.hold(conns),
            Imp::Drop(d) => d.change(conns, true),
        }
    }

    /// [`PacketHold::release`] for many connections at once.
    pub fn release_many(&self, conns: &[(SocketAddr, SocketAddr)]) -> Result<(), HoldError> {
        match &self.imp {
            Imp::Queue(q) => q.release(conns),
            Imp::Drop(d) => d.change(conns, false),
        }
    }

    fn queue_only(&self) -> Result<&queue::QueueHold, HoldError> {
        match &self.imp {
            Imp::Queue(q) => Ok(q),
            Imp::Drop(_) => Err(HoldError::Bpf(
                "output commit needs the queueing hold (this instance has the dropping one)".into(),
            )),
        }
    }

    /// Output commit: from now on the instance's segments of each connection `(local,
    /// remote, covered_seq, covered_ack)` leave only once covered (see
    /// `crate::replicate`). Queueing hold only.
    pub fn protect(&self, conns: &[(SocketAddr, SocketAddr, u32, u32)]) -> Result<(), HoldError> {
        self.queue_only()?.protect(&output_keys(conns))
    }

    /// Output commit with nothing covered yet: every segment of these connections `(local,
    /// remote)` is held until a [`PacketHold::cover`] sets their marks.
    pub fn guard(&self, conns: &[(SocketAddr, SocketAddr)]) -> Result<(), HoldError> {
        let keys: Vec<_> = conns
            .iter()
            .map(|(l, r)| (Key::output_of(l, r), 0, 0))
            .collect();
        self.queue_only()?.protect_with(&keys, true)
    }

    /// Moves protected connections' covered marks forward (a guarded connection's are set);
    /// what is covered now leaves.
    pub fn cover(&self, updates: &[(SocketAddr, SocketAddr, u32, u32)]) -> Result<(), HoldError> {
        self.queue_only()?.cover(&output_keys(updates))
    }

    /// Waits at most `t` for queued output, then writes back what is covered.
    pub fn sweep(&self, t: std::time::Duration) -> Result<(), HoldError> {
        let q = self.queue_only()?;
        q.wait_frames(t);
        q.sweep()
    }

    /// Ends output commit for these connections; `flush` sends their queued output,
    /// otherwise it is dropped. Per connection: how far the output that left went.
    pub fn unprotect(
        &self,
        conns: &[(SocketAddr, SocketAddr)],
        flush: bool,
    ) -> Result<Vec<Left>, HoldError> {
        let keys: Vec<_> = conns.iter().map(|(l, r)| Key::output_of(l, r)).collect();
        self.queue_only()?.unprotect(&keys, flush)
    }

    /// The highest acknowledgment in the client's queued segments of each held connection.
    pub fn held_acks(
        &self,
        conns: &[(SocketAddr, SocketAddr)],
    ) -> Result<Vec<Option<u32>>, HoldError> {
        let keys: Vec<_> = conns.iter().map(|(l, r)| Key::of(l, r)).collect();
        self.queue_only()?.held_acks(&keys)
    }

    /// What output commit did (`None` for the dropping hold).
    pub fn commit_stats(&self) -> Option<CommitStats> {
        self.queue_only().ok().map(queue::QueueHold::commit_stats)
    }

    /// What the queue did so far (`None` for the dropping hold).
    pub fn queue_stats(&self) -> Option<QueueStats> {
        match &self.imp {
            Imp::Queue(q) => Some(q.stats()),
            Imp::Drop(_) => None,
        }
    }
}
