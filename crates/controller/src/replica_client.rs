//! Talking to replicas' control channels: pliant-proto's typed requests and answers over
//! pliant-wire. A replica is recorded by its control socket path; the [`Dialer`] decides how
//! it is reached — that unix socket, or a TCP endpoint from a template (a replica on another
//! host) — and with which identity (the controller's, CONTROLLER role).

use pliant_proto::{reply, Client, KeptLinks, Request};
use pliant_wire::{Endpoint, Security};
use std::path::Path;
use std::time::Duration;

pub use pliant_proto::reply::FlowEntry;
pub use pliant_proto::ControlError as ReplicaError;

/// How the controller reaches replicas' control channels.
#[derive(Clone, Debug, Default)]
pub struct Dialer {
    /// The controller's identity (needed by replicas that have one, which is every replica
    /// with a `[security]` section).
    pub security: Option<Security>,
    /// `[controller] control_endpoint`: where replica `{name}`/`{index}` serves control on
    /// TCP (see `ha::endpoint_of`); without it, the replica's unix socket.
    pub template: Option<String>,
    /// The leadership term this controller acts under (0: none, a controller without
    /// elections). Shared by clones, so the migrator's copy follows the daemon's.
    pub term: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Heartbeat links kept open between rounds, shared by clones.
    pub kept: KeptLinks,
}

impl Dialer {
    /// Where the replica whose control socket is `socket` serves control.
    pub fn endpoint(&self, socket: &Path) -> Endpoint {
        match &self.template {
            Some(t) => crate::ha::endpoint_of(Some(t), socket, "control")
                .parse()
                .unwrap_or_else(|_| Endpoint::Unix(socket.to_path_buf())),
            None => Endpoint::Unix(socket.to_path_buf()),
        }
    }

    /// Whether replicas are reached over TCP (their probes and answers may then take time).
    pub fn is_tcp(&self) -> bool {
        self.template.is_some()
    }

    /// Liveness probe of the replica at `socket` where its control is served: a non-blocking
    /// connect to its unix socket (never waits), or a TCP connect bounded by `tcp_timeout`
    /// (see [`crate::ha::connect_verdict`]).
    pub fn probe(&self, socket: &Path, tcp_timeout: Duration) -> crate::ha::Probe {
        match self.endpoint(socket) {
            Endpoint::Unix(p) => crate::ha::probe(&p),
            Endpoint::Tcp(a) => crate::ha::probe_tcp(&a, tcp_timeout),
        }
    }

    /// A client of the replica whose control socket is `socket`.
    /// Acts under leadership `term` from now on (every request carries it).
    pub fn set_term(&self, term: u64) {
        self.term.store(term, std::sync::atomic::Ordering::Release);
    }

    pub fn client(&self, socket: &Path, timeout: Duration) -> Client {
        let mut c = Client::new(self.endpoint(socket), self.security.clone()).with_timeout(timeout);
        let term = self.term.load(std::sync::atomic::Ordering::Acquire);
        if term > 0 {
            c = c.with_term(term);
        }
        // Over TCP the replica must prove it is the one the record names (its socket's stem,
        // as the templates use it); on its unix socket the path names it already.
        match (&self.template, socket.file_stem()) {
            (Some(_), Some(stem)) if self.security.is_some() => {
                c.expecting(stem.to_string_lossy().into_owned())
            }
            _ => c,
        }
    }

    /// Sends `req` to the replica at `socket` and returns the `ok` answer.
    pub fn call(
        &self,
        socket: &Path,
        req: &Request,
        timeout: Duration,
    ) -> Result<serde_json::Value, ReplicaError> {
        self.client(socket, timeout).call(req)
    }

    /// What a heartbeat learns: `stats`, decoded strictly.
    pub fn heartbeat(&self, socket: &Path, timeout: Duration) -> Result<Beat, ReplicaError> {
        let v = self.call_kept(socket, &Request::Stats, timeout)?;
        let s: reply::Stats = decode(socket, "stats", &v)?;
        Ok(Beat {
            flows: s.table.flows,
            rx_frames: s.rx_frames(),
        })
    }

    /// `ha_status`, on a kept link (asked with every heartbeat round under HA).
    pub fn ha_status(
        &self,
        socket: &Path,
        timeout: Duration,
    ) -> Result<reply::HaStatus, ReplicaError> {
        let v = self.call_kept(socket, &Request::HaStatus, timeout)?;
        decode(socket, "ha_status", &v)
    }

    /// `ftmb_status`, on a kept link (as `ha_status`).
    pub fn ftmb_status(
        &self,
        socket: &Path,
        timeout: Duration,
    ) -> Result<reply::FtmbStatus, ReplicaError> {
        let v = self.call_kept(socket, &Request::FtmbStatus, timeout)?;
        decode(socket, "ftmb_status", &v)
    }

    /// A short request of the rounds that poll every replica, on a link kept from an
    /// earlier round (see [`KeptLinks`]).
    fn call_kept(
        &self,
        socket: &Path,
        req: &Request,
        timeout: Duration,
    ) -> Result<serde_json::Value, ReplicaError> {
        let c = self.client(socket, timeout);
        self.kept.call(&socket.to_string_lossy(), &c, req)
    }

    /// `flows`: (total, the listed flows).
    pub fn flows(
        &self,
        socket: &Path,
        timeout: Duration,
    ) -> Result<(u64, Vec<FlowEntry>), ReplicaError> {
        let l = self.client(socket, timeout).flows()?;
        Ok((l.total, l.flows))
    }

    /// Whether the replica holds `key` (one index lookup there, any table size).
    pub fn flow(
        &self,
        socket: &Path,
        key: &pliant_state::FlowKey,
        timeout: Duration,
    ) -> Result<Option<FlowEntry>, ReplicaError> {
        self.client(socket, timeout).flow(key)
    }

    /// Waits until the replica answers `stats`, returning how long that took.
    pub fn wait_serving(&self, socket: &Path, limit: Duration) -> Result<Duration, ReplicaError> {
        self.client(socket, Duration::from_millis(500))
            .wait_serving(limit)
    }
}

/// What a heartbeat learns from `stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Beat {
    pub flows: u64,
    /// Frames received on both ports since start (for packet rates).
    pub rx_frames: u64,
}

/// Decodes the typed part of an answer for the controller's error paths.
pub fn decode<T: serde::de::DeserializeOwned>(
    socket: &Path,
    cmd: &str,
    v: &serde_json::Value,
) -> Result<T, ReplicaError> {
    reply::decode(v).map_err(|reason| ReplicaError::Malformed {
        ep: socket.display().to_string(),
        cmd: cmd.into(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_socket_is_an_io_error() {
        let e = Dialer::default().heartbeat(
            Path::new("/nonexistent/pliant.sock"),
            Duration::from_millis(100),
        );
        assert!(matches!(e, Err(ReplicaError::Io { .. })));
    }

    #[test]
    fn a_template_dials_tcp_and_expects_the_replica_by_name() {
        let d = Dialer {
            security: None,
            template: Some("10.254.0.{index}:7403".into()),
            ..Default::default()
        };
        let c = d.client(Path::new("/run/pliant/lab/r3.sock"), Duration::from_secs(1));
        assert_eq!(c.endpoint().to_string(), "tcp:10.254.0.3:7403");
        let c = Dialer::default().client(Path::new("/run/x/r3.sock"), Duration::from_secs(1));
        assert!(!c.endpoint().is_tcp());
    }
}
