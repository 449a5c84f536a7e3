//! `agent.toml`: who the agent is, where it listens, and the replicas (slots) its host is
//! provisioned for.
//!
//! ```toml
//! [agent]
//! name = "h1"                      # the host's name; its certificate's, with an identity
//! listen = "10.254.0.1:7410"       # TCP needs `identity`; a unix path serves same-uid clients
//! identity = "/etc/pliant/id/h1"   # AGENT role (pliant keys issue --role agent)
//! socket = "/run/pliant/agent.sock" # optional: also on a unix socket (tools on the host)
//! state_dir = "/run/pliant/agent"  # pid files of the replicas it runs
//!
//! [fabric]                         # only on the fabric's (load balancer's) host
//! netns = "lab-fabric"             # where the steering program runs (its ports' namespace)
//!
//! [[replica]]
//! name = "r1"
//! command = ["/usr/bin/pliant", "replica", "--config", "/etc/pliant/r1.toml"]
//! control = "/run/pliant/r1.sock"  # the replica's control socket ([replica] socket)
//! log = "/var/log/pliant/r1.log"
//! ```

use pliant_wire::Endpoint;
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("agent config {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("agent config: {0}")]
    Invalid(String),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub agent: AgentSection,
    #[serde(default)]
    pub replica: Vec<SlotConfig>,
    /// The fabric's steering, held for the leading controller (the fabric's host only).
    #[serde(default)]
    pub fabric: Option<FabricSection>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FabricSection {
    /// The network namespace of the fabric's ports (the steering program attaches there).
    pub netns: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    pub name: String,
    pub listen: String,
    /// A unix socket served besides `listen` (same-uid clients; sealed with an identity),
    /// e.g. for tools on the host itself.
    #[serde(default)]
    pub socket: Option<PathBuf>,
    #[serde(default)]
    pub identity: Option<PathBuf>,
    #[serde(default)]
    pub encrypt: Option<pliant_wire::Encrypt>,
    pub state_dir: PathBuf,
    /// How often the agent checks its replicas' processes (waitpid) (1..=1000 ms).
    #[serde(default = "default_probe_ms")]
    pub probe_ms: u64,
    /// How often it probes their control sockets (connect), in process checks.
    #[serde(default = "default_serve_probe_every")]
    pub serve_probe_every: u32,
    /// How long a started replica has to serve its control socket.
    #[serde(default = "default_start_timeout_ms")]
    pub start_timeout_ms: u64,
    /// SIGTERM, then SIGKILL after this long.
    #[serde(default = "default_stop_grace_ms")]
    pub stop_grace_ms: u64,
}

fn default_probe_ms() -> u64 {
    5
}
fn default_serve_probe_every() -> u32 {
    20
}
fn default_start_timeout_ms() -> u64 {
    15_000
}
fn default_stop_grace_ms() -> u64 {
    3_000
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SlotConfig {
    pub name: String,
    pub command: Vec<String>,
    pub control: PathBuf,
    #[serde(default)]
    pub log: Option<PathBuf>,
}

impl AgentConfig {
    pub fn load(path: &str) -> Result<AgentConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let c: AgentConfig = toml::from_str(&text).map_err(|e| ConfigError::Read {
            path: path.into(),
            reason: e.to_string(),
        })?;
        c.check()?;
        Ok(c)
    }

    /// Every field checked, every problem named.
    pub fn check(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let a = &self.agent;
        pliant_proto::agent::check_slot_name(&a.name)
            .map_err(|e| ConfigError::Invalid(format!("agent.name: {e}")))?;
        let ep: Endpoint = a
            .listen
            .parse()
            .map_err(|e| ConfigError::Invalid(format!("agent.listen {:?}: {e}", a.listen)))?;
        if ep.is_tcp() && a.identity.is_none() {
            return bad(format!(
                "agent.listen = {:?} is TCP: it needs agent.identity (an AGENT certificate), \
                 every request authenticated",
                a.listen
            ));
        }
        if a.socket.as_ref().is_some_and(|p| !p.is_absolute()) {
            return bad("agent.socket must be an absolute path".into());
        }
        if !(1..=1000).contains(&a.probe_ms) {
            return bad(format!("agent.probe_ms = {}: need 1..=1000", a.probe_ms));
        }
        if !(1..=1000).contains(&a.serve_probe_every) {
            return bad(format!(
                "agent.serve_probe_every = {}: need 1..=1000",
                a.serve_probe_every
            ));
        }
        if !(100..=600_000).contains(&a.start_timeout_ms) {
            return bad(format!(
                "agent.start_timeout_ms = {}: need 100..=600000",
                a.start_timeout_ms
            ));
        }
        if a.stop_grace_ms > 600_000 {
            return bad(format!(
                "agent.stop_grace_ms = {}: need <= 600000",
                a.stop_grace_ms
            ));
        }
        if !a.state_dir.is_absolute() {
            return bad(format!(
                "agent.state_dir = {}: must be absolute",
                a.state_dir.display()
            ));
        }
        if let Some(f) = &self.fabric {
            let ok = !f.netns.is_empty()
                && f.netns.len() <= 64
                && f.netns
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
            if !ok {
                return bad(format!(
                    "fabric.netns = {:?}: a namespace name (1..=64 of A-Z a-z 0-9 _ . -)",
                    f.netns
                ));
            }
            if a.identity.is_none() {
                return bad(
                    "[fabric]: steering is commanded by controllers: it needs agent.identity"
                        .into(),
                );
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for s in &self.replica {
            pliant_proto::agent::check_slot_name(&s.name)
                .map_err(|e| ConfigError::Invalid(format!("replica.name: {e}")))?;
            if !seen.insert(s.name.clone()) {
                return bad(format!("replica {:?} is listed twice", s.name));
            }
            match s.command.first() {
                None => return bad(format!("replica {:?}: command is empty", s.name)),
                Some(p) if !p.starts_with('/') => {
                    return bad(format!(
                        "replica {:?}: command[0] = {p:?} must be an absolute path",
                        s.name
                    ))
                }
                _ => {}
            }
            if !s.control.is_absolute() {
                return bad(format!(
                    "replica {:?}: control = {} must be an absolute path",
                    s.name,
                    s.control.display()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<AgentConfig, ConfigError> {
        let c: AgentConfig = toml::from_str(t).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        c.check().map(|_| c)
    }

    const OK: &str = r#"
[agent]
name = "h1"
listen = "/run/pliant/h1-agent.sock"
state_dir = "/run/pliant/agent"
[[replica]]
name = "r1"
command = ["/usr/bin/pliant", "replica", "--config", "/etc/r1.toml"]
control = "/run/pliant/r1.sock"
"#;

    #[test]
    fn a_good_config_has_defaults_and_bad_ones_are_named() {
        let c = parse(OK).unwrap();
        assert_eq!(c.agent.probe_ms, 5);
        assert_eq!(c.replica[0].name, "r1");
        let cases: &[(&str, &str, &str)] = &[
            (
                "listen = \"/run/pliant/h1-agent.sock\"",
                "listen = \"10.0.0.1:7410\"",
                "needs agent.identity",
            ),
            ("name = \"h1\"", "name = \"h 1\"", "agent.name"),
            (
                "command = [\"/usr/bin/pliant\"",
                "command = [\"pliant\"",
                "absolute path",
            ),
            (
                "control = \"/run/pliant/r1.sock\"",
                "control = \"r1.sock\"",
                "control = r1.sock",
            ),
            (
                "state_dir = \"/run/pliant/agent\"",
                "state_dir = \"/run/pliant/agent\"\nprobe_ms = 0",
                "probe_ms = 0",
            ),
            (
                "state_dir = \"/run/pliant/agent\"",
                "state_dir = \"/run/pliant/agent\"\nbogus = 1",
                "bogus",
            ),
        ];
        for (from, to, want) in cases {
            let e = parse(&OK.replace(from, to)).unwrap_err().to_string();
            assert!(e.contains(want), "{to}: {e}");
        }
        let twice = format!("{OK}{}", &OK[OK.find("[[replica]]").unwrap()..]);
        let e = parse(&twice).unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
    }
}
