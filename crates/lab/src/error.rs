//! Typed errors: every variant says which step failed and why, so a failed `lab up` can be
//! diagnosed from the message alone.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("lab name {name:?} is invalid: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("lab {0:?} already exists (see `pliant lab status`)")]
    Exists(String),
    #[error("lab {0:?} not found (no state.json under the run root)")]
    NotFound(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not start `{cmd}`: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{cmd}` failed (exit {code:?}): {stderr}")]
    Command {
        cmd: String,
        code: Option<i32>,
        stderr: String,
    },
    #[error("`{cmd}` did not finish within {timeout_ms} ms (killed)")]
    Timeout { cmd: String, timeout_ms: u64 },
    #[error("{what} not ready after {waited_ms} ms: {detail}")]
    NotReady {
        what: String,
        waited_ms: u64,
        detail: String,
    },
    #[error("state file {path}: {reason}")]
    State { path: PathBuf, reason: String },
    #[error("mode needs the pliant binary path (LabSpec::pliant_bin), none was given")]
    NoPliantBinary,
    #[error("replica config could not be serialised: {0}")]
    Config(String),
    #[error("{asked} replicas asked for; this fabric supports 1..={max}")]
    Replicas { asked: u8, max: u8 },
    #[error("unknown role {0:?} (client, server, fabric, r1..rN)")]
    BadRole(String),
    #[error("fabric steering: {0}")]
    Steer(#[from] pliant_steer::SteerError),
}

pub type Result<T> = std::result::Result<T, LabError>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> LabError {
    let path = path.into();
    move |source| LabError::Io { path, source }
}
