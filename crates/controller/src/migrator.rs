//! Moving flows between replicas, behind a trait: the controller decides *what* moves where and
//! keeps steering consistent; the replicas' migration protocol (destination buffers, source
//! exports at refcount 0 and forwards stragglers) lives in `pliant_runtime::migrate_client`.

use crate::replica_client::FlowEntry;
use pliant_state::FlowKey;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
#[error("migration: {0}")]
pub struct MigrateError(pub String);

/// What one batch did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Outcome {
    pub moved: u64,
    /// Primary keys that stayed at the source (the caller steers them back there).
    pub failed: Vec<String>,
    /// Whatever the replicas reported (pause times, stragglers forwarded, ...).
    pub detail: serde_json::Value,
}

/// The steering update the migration calls at its switch-over point (after the destination
/// holds the flows, before the source exports them), so packets of a moving flow go to the
/// destination from then on. It gets the keys and aliases the migration knows of; the
/// controller adds the ones it listed itself.
pub type SteerUpdate<'a> = dyn FnMut(&[FlowKey]) -> Result<(), String> + 'a;

pub trait Migrator: Send + Sync {
    fn migrate(
        &self,
        src_socket: &Path,
        dst_socket: &Path,
        flows: &[FlowEntry],
        steer: &mut SteerUpdate<'_>,
    ) -> Result<Outcome, MigrateError>;
}

/// A migrator that only switches steering (tests of the orchestration).
pub struct SteerOnly;

impl Migrator for SteerOnly {
    fn migrate(
        &self,
        _src: &Path,
        _dst: &Path,
        flows: &[FlowEntry],
        steer: &mut SteerUpdate<'_>,
    ) -> Result<Outcome, MigrateError> {
        steer(&[]).map_err(MigrateError)?;
        Ok(Outcome {
            moved: flows.len() as u64,
            failed: Vec::new(),
            detail: serde_json::Value::Null,
        })
    }
}

/// The replica peer socket beside a control socket (`r1.sock` -> `r1.peer.sock`), the runtime's
/// default when a replica config has no `[migration] peer_socket`.
pub fn default_peer_path(control: &Path) -> String {
    let c = control.display().to_string();
    match c.strip_suffix(".sock") {
        Some(stem) => format!("{stem}.peer.sock"),
        None => format!("{c}.peer"),
    }
}

/// The real thing: `pliant_runtime::migrate_client::migrate` (migrate_in at the destination,
/// steering switch, migrate_out at the source, which answers once the move is complete).
pub struct RuntimeMigrator {
    /// Where each replica's peer channel is: a template with `{name}` for the control socket's
    /// stem (`[controller] peer_endpoint`); absent, the unix socket beside the control socket.
    pub peer_endpoint: Option<String>,
    /// How the replicas' control channels are reached.
    pub control: crate::replica_client::Dialer,
    /// Bound on the quick requests of a migration (the `migrate_out` itself may take longer).
    pub timeout: std::time::Duration,
}

impl Migrator for RuntimeMigrator {
    fn migrate(
        &self,
        src: &Path,
        dst: &Path,
        flows: &[FlowEntry],
        steer: &mut SteerUpdate<'_>,
    ) -> Result<Outcome, MigrateError> {
        let keys: Vec<FlowKey> = flows.iter().filter_map(|f| f.key.parse().ok()).collect();
        let peer = match &self.peer_endpoint {
            Some(t) => crate::ha::endpoint_of(Some(t), dst, "peer"),
            None => default_peer_path(dst),
        };
        let mut steer_err: Option<String> = None;
        let r = pliant_runtime::migrate_client::migrate(
            &self.control.client(src, self.timeout),
            &self.control.client(dst, self.timeout),
            &peer,
            &keys,
            |all| {
                if let Err(e) = steer(all) {
                    steer_err = Some(e);
                }
            },
        )
        .map_err(MigrateError)?;
        if let Some(e) = steer_err {
            // The flows moved but the fabric may still point at the source, which forwards
            // late packets: not lost, but the caller must know and retry the steering.
            return Err(MigrateError(format!(
                "flows moved but steering failed: {e}"
            )));
        }
        let out: pliant_proto::reply::MigrateOut =
            pliant_proto::reply::decode(&r).map_err(MigrateError)?;
        Ok(Outcome {
            moved: out.moved,
            failed: out.failed.into_iter().map(|f| f.key).collect(),
            detail: r,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_path_follows_the_runtime_default() {
        assert_eq!(
            default_peer_path(Path::new("/run/pliant/x/r2.sock")),
            "/run/pliant/x/r2.peer.sock"
        );
        assert_eq!(default_peer_path(Path::new("/tmp/ctl")), "/tmp/ctl.peer");
    }
}
