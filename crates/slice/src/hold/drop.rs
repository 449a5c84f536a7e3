//! The dropping hold: an nftables set of 4-tuples matched at prerouting, ahead of conntrack,
//! in a table of its own per instance (created at start with `nft`, deleted on drop). Holding
//! or releasing connections is adding or deleting set elements, which leaves every other rule
//! alone. Elements are added and deleted over the instance's own nf_tables netlink socket
//! ([`crate::nfnl`]), one batch per call: starting an `nft` process per step cost about 6 ms on
//! this machine, several times the rest of a move.
//!
//! The client retransmits what this hold dropped (tail-loss probe, fast retransmit from the
//! restored socket's duplicate ACKs, or its retransmission timeout) once it is released: the
//! fallback when the queueing hold ([`super::queue`]) cannot be set up.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use super::HoldError;

/// An instance's packet-hold table.
#[derive(Debug)]
pub(super) struct DropHold {
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
    let mut child = cmd
        .spawn()
        .map_err(|source| HoldError::Spawn { cmd: "nft", source })?;
    if let (Some(s), Some(mut stdin)) = (script, child.stdin.take()) {
        stdin
            .write_all(s.as_bytes())
            .map_err(|source| HoldError::Spawn { cmd: "nft", source })?;
    }
    let out = child
        .wait_with_output()
        .map_err(|source| HoldError::Spawn { cmd: "nft", source })?;
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

impl DropHold {
    /// Creates this instance's table (`tag` makes it recognisable in `nft list tables`).
    pub(super) fn create(tag: &str) -> Result<DropHold, HoldError> {
        static N: AtomicU64 = AtomicU64::new(0);
        let tag = super::clean_tag(tag);
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
        Ok(DropHold {
            table,
            nl: std::sync::Mutex::new(nl),
        })
    }

    pub(super) fn table(&self) -> &str {
        &self.table
    }

    /// Adds (`add`: the client's segments are dropped from now on) or deletes the elements of
    /// these connections, `(local, remote)` each: one netlink batch per address family.
    pub(super) fn change(
        &self,
        conns: &[(SocketAddr, SocketAddr)],
        add: bool,
    ) -> Result<(), HoldError> {
        let mut nl = self
            .nl
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for family in ["held4", "held6"] {
            let keys: Vec<Vec<u8>> = conns
                .iter()
                .map(|(l, r)| key(l, r))
                .filter(|(set, _)| *set == family)
                .map(|(_, k)| k)
                .collect();
            // A netlink attribute's length is 16 bits: 512 IPv6 elements stay well below.
            for chunk in keys.chunks(512) {
                nl.set_elements(&self.table, family, chunk, add)
                    .map_err(HoldError::Netlink)?;
            }
        }
        Ok(())
    }
}

impl Drop for DropHold {
    fn drop(&mut self) {
        if let Err(e) = nft(&["delete", "table", "inet", &self.table], None) {
            tracing::warn!(table = %self.table, error = %e, "packet-hold table left behind");
        }
    }
}
