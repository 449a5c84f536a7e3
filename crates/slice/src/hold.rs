//! Holding a connection's packets while no socket owns it.
//!
//! During a move there is a moment when neither instance has a socket for the connection: the
//! kernel refuses a second socket with a live 4-tuple (the restored socket's `connect` fails
//! while the source's is open), so the source must close first. A segment from the client
//! arriving then would find no socket, or the listener, and either answers with a RST. Worse,
//! a segment reaching the source socket between its capture and its close would be
//! acknowledged and then lost with the socket. So from before the capture until the restored
//! socket is in place, the client's segments of that 4-tuple are dropped before the TCP stack
//! sees them; the client retransmits them (tail-loss probe, fast retransmit from the restored
//! socket's duplicate ACKs, or its retransmission timeout) once the hold is released.
//!
//! The hold is an nftables set of 4-tuples matched at prerouting, ahead of conntrack, in a
//! table of its own per instance (created at start with `nft`, deleted on drop): holding or
//! releasing a connection is adding or deleting one set element, which leaves every other rule
//! alone. Elements are added and deleted over the instance's own nf_tables netlink socket
//! ([`crate::nfnl`]), one batch each: starting an `nft` process per step cost about 6 ms on
//! this machine, several times the rest of a move.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("running nft: {0}")]
    Spawn(std::io::Error),
    #[error("nft {what} failed: {stderr}")]
    Nft { what: String, stderr: String },
    #[error("nf_tables netlink: {0}")]
    Netlink(std::io::Error),
}

/// An instance's packet-hold table.
#[derive(Debug)]
pub struct PacketHold {
    table: String,
    nl: std::sync::Mutex<crate::nfnl::NfTables>,
}

fn nft(args: &[&str], script: Option<&str>) -> Result<(), HoldError> {
    use std::io::Write;
    let mut cmd = Command::new("nft");
    cmd.args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().map_err(HoldError::Spawn)?;
    if let (Some(s), Some(mut stdin)) = (script, child.stdin.take()) {
        stdin.write_all(s.as_bytes()).map_err(HoldError::Spawn)?;
    }
    let out = child.wait_with_output().map_err(HoldError::Spawn)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(HoldError::Nft {
            what: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// The client's segments: from the remote end to the local one.
fn key(local: &SocketAddr, remote: &SocketAddr) -> (&'static str, Vec<u8>) {
    let set = if local.is_ipv4() { "held4" } else { "held6" };
    (set, crate::nfnl::tuple_key(remote, local))
}

impl PacketHold {
    /// Creates this instance's table (`tag` makes it recognisable in `nft list tables`).
    pub fn create(tag: &str) -> Result<PacketHold, HoldError> {
        static N: AtomicU64 = AtomicU64::new(0);
        let tag: String = tag
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .take(32)
            .collect();
        let table = format!(
            "pliant_slice_{}_{}_{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let script = format!(
            "add table inet {table}\n\
             add set inet {table} held4 {{ type ipv4_addr . inet_service . ipv4_addr . inet_service; }}\n\
             add set inet {table} held6 {{ type ipv6_addr . inet_service . ipv6_addr . inet_service; }}\n\
             add chain inet {table} hold {{ type filter hook prerouting priority -300; policy accept; }}\n\
             add rule inet {table} hold ip saddr . tcp sport . ip daddr . tcp dport @held4 counter drop\n\
             add rule inet {table} hold ip6 saddr . tcp sport . ip6 daddr . tcp dport @held6 counter drop\n"
        );
        let nl = crate::nfnl::NfTables::open().map_err(HoldError::Netlink)?;
        nft(&["-f", "-"], Some(&script))?;
        Ok(PacketHold {
            table,
            nl: std::sync::Mutex::new(nl),
        })
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    /// Drops the client's segments of this connection from now on.
    pub fn hold(&self, local: &SocketAddr, remote: &SocketAddr) -> Result<(), HoldError> {
        self.change(local, remote, true)
    }

    /// Lets them through again.
    pub fn release(&self, local: &SocketAddr, remote: &SocketAddr) -> Result<(), HoldError> {
        self.change(local, remote, false)
    }

    fn change(&self, local: &SocketAddr, remote: &SocketAddr, add: bool) -> Result<(), HoldError> {
        let (set, k) = key(local, remote);
        let mut nl = self
            .nl
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        nl.set_element(&self.table, set, &k, add)
            .map_err(HoldError::Netlink)
    }
}

impl Drop for PacketHold {
    fn drop(&mut self) {
        if let Err(e) = nft(&["delete", "table", "inet", &self.table], None) {
            tracing::warn!(table = %self.table, error = %e, "packet-hold table left behind");
        }
    }
}
