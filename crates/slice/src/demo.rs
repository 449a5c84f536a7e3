//! The example application: a line-protocol server with per-session state.
//!
//! Every byte a client sends goes into a running FNV-1a hash; every newline counts a line and
//! is answered with `"<lines> <hash>\n"` (the hash as 16 hex digits, over everything received
//! so far). A client computes the same from what it sent, so each reply checks the whole
//! stream in both directions, byte for byte, wherever the session has been moved meanwhile.

use crate::format::{fnv1a, FNV_OFFSET};
use crate::instance::{Config, Instance, SessionApp};
use pliant_wire::{role, Ca, Endpoint, Security};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineApp {
    pub lines: u64,
    /// Hash of every byte received.
    pub rx_hash: u64,
    /// Hash of every byte answered.
    pub tx_hash: u64,
}

const STATE_VERSION: u8 = 1;
const STATE_LEN: usize = 25;

/// The reply to the `lines`-th line when everything received so far hashes to `hash`.
pub fn reply(lines: u64, hash: u64) -> String {
    format!("{lines} {hash:016x}\n")
}

impl SessionApp for LineApp {
    fn new_session() -> Self {
        LineApp {
            lines: 0,
            rx_hash: FNV_OFFSET,
            tx_hash: FNV_OFFSET,
        }
    }

    fn on_input(&mut self, input: &[u8], out: &mut Vec<u8>) {
        let mut rest = input;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.rx_hash = fnv1a(self.rx_hash, &rest[..=i]);
            self.lines += 1;
            let r = reply(self.lines, self.rx_hash);
            self.tx_hash = fnv1a(self.tx_hash, r.as_bytes());
            out.extend_from_slice(r.as_bytes());
            rest = &rest[i + 1..];
        }
        self.rx_hash = fnv1a(self.rx_hash, rest);
    }

    fn save(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(STATE_LEN);
        b.push(STATE_VERSION);
        for v in [self.lines, self.rx_hash, self.tx_hash] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn load(b: &[u8]) -> Result<Self, String> {
        if b.len() != STATE_LEN || b[0] != STATE_VERSION {
            return Err(format!(
                "line-app state: {} bytes of version {:?}, expected {STATE_LEN} of version \
                 {STATE_VERSION}",
                b.len(),
                b.first()
            ));
        }
        let u =
            |i: usize| u64::from_le_bytes(b[1 + 8 * i..9 + 8 * i].try_into().unwrap_or_default());
        Ok(LineApp {
            lines: u(0),
            rx_hash: u(1),
            tx_hash: u(2),
        })
    }
}

/// How a demo server runs (`pliant-slice-demo serve`, `pliant slice serve`).
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The instance's name: the name its identity's certificate carries (peers dial it by it).
    #[arg(long)]
    pub name: String,
    /// The instance's identity directory (replica role), e.g. one `keys` made.
    #[arg(long)]
    pub identity: PathBuf,
    /// Where clients connect (TCP).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub clients: SocketAddr,
    /// Where peer instances send sessions (unix path or host:port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub peer: Endpoint,
    /// The control channel (unix path or host:port) for `pliant slice list | stats |
    /// migrate`; clients must prove the admin or controller role. None without it.
    #[arg(long)]
    pub control: Option<Endpoint>,
    /// Replicate every session to the backup instance at this peer endpoint (its `--peer`):
    /// if this instance dies, even by SIGKILL, its sessions continue there. Needs
    /// `--backup-name`.
    #[arg(long, requires = "backup_name")]
    pub backup: Option<Endpoint>,
    /// The backup instance's name (its certificate's).
    #[arg(long, requires = "backup")]
    pub backup_name: Option<String>,
}

/// Starts a [`LineApp`] instance as `a` says.
pub fn start(a: &ServeArgs) -> Result<Instance<LineApp>, String> {
    let security = Security::load(&a.identity, Default::default())
        .map_err(|e| format!("identity {}: {e}", a.identity.display()))?;
    Instance::start(Config {
        name: a.name.clone(),
        clients: a.clients,
        peer: a.peer.clone(),
        security,
        control: a.control.clone(),
        backup: a.backup.clone().zip(a.backup_name.clone()),
    })
    .map_err(|e| e.to_string())
}

/// The line a demo server prints once it listens: `ready clients=... peer=...` and, with a
/// control channel, ` control=...`.
pub fn ready_line(i: &Instance<LineApp>) -> String {
    let mut l = format!(
        "ready clients={} peer={}",
        i.client_endpoint(),
        i.peer_endpoint()
    );
    if let Some(c) = i.control_endpoint() {
        l.push_str(&format!(" control={c}"));
    }
    l
}

/// The endpoints a ready line names (see [`ready_line`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ready {
    /// Where clients connect, `host:port`.
    pub clients: String,
    /// The slice channel, as an endpoint (`tcp:host:port`, `unix:/path`).
    pub peer: String,
    /// The control channel, as an endpoint, if there is one.
    pub control: Option<String>,
}

/// Reads a [`ready_line`]; `None` if `line` is not one.
pub fn parse_ready(line: &str) -> Option<Ready> {
    let mut w = line.split_whitespace();
    if w.next() != Some("ready") {
        return None;
    }
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    };
    Some(Ready {
        clients: field("clients=tcp:")?,
        peer: field("peer=")?,
        control: field("control="),
    })
}

/// One year: a demo's identities outlive any run of it.
const VALID_SECS: u64 = 365 * 24 * 3600;

/// A CA in `dir` (`ca.key`, `ca.pub`, as `pliant keys ca` makes them, so `pliant keys issue
/// --ca DIR` issues more, an operator's admin identity say) and an identity directory
/// `dir/NAME` for each name, with the replica role.
pub fn keys(dir: &Path, names: &[String]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let ca = Ca::generate(Some(dir)).map_err(|e| e.to_string())?;
    for n in names {
        ca.issue_to(&dir.join(n), n, role::REPLICA, VALID_SECS)
            .map_err(|e| format!("{n}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_cover_everything_received_and_state_round_trips() {
        let mut a = LineApp::new_session();
        let mut out = Vec::new();
        a.on_input(b"one\ntw", &mut out);
        a.on_input(b"o\n", &mut out);
        let h1 = fnv1a(FNV_OFFSET, b"one\n");
        let h2 = fnv1a(h1, b"two\n");
        assert_eq!(
            out,
            format!("{}{}", reply(1, h1), reply(2, h2)).into_bytes()
        );
        assert_eq!(a.tx_hash, fnv1a(FNV_OFFSET, &out));
        assert_eq!(LineApp::load(&a.save()), Ok(a.clone()));
        assert!(LineApp::load(&a.save()[1..]).is_err());
        assert!(LineApp::load(&[]).is_err());
    }

    #[test]
    fn ready_lines_are_read_back() {
        let r = parse_ready("ready clients=tcp:127.0.0.1:7 peer=unix:/p control=tcp:[::1]:9");
        assert_eq!(
            r,
            Some(Ready {
                clients: "127.0.0.1:7".into(),
                peer: "unix:/p".into(),
                control: Some("tcp:[::1]:9".into()),
            })
        );
        let r = parse_ready("ready clients=tcp:127.0.0.1:7 peer=tcp:127.0.0.1:8").unwrap();
        assert_eq!(r.control, None);
        assert_eq!(parse_ready("sessions 1 2"), None);
        assert_eq!(parse_ready("ready peer=tcp:127.0.0.1:8"), None);
    }
}
