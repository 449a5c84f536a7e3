//! `pliant agent`: the host agent (one per host). It runs the replicas its config lists when a
//! controller asks, watches them and answers the controller's polls. See
//! crates/agent/README.md.

use clap::Args;

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// The agent's config (agent.toml: [agent] name, listen, identity, state_dir; one
    /// [[replica]] per replica this host may run).
    #[arg(long)]
    pub config: String,
    /// Check the config (and load the identity), print a summary and exit.
    #[arg(long)]
    pub check: bool,
}

/// Runs the agent until SIGTERM/SIGINT. Its replicas keep running when it ends (a new agent
/// adopts them).
pub fn run(a: AgentArgs) -> Result<(), String> {
    let cfg = pliant_agent::config::AgentConfig::load(&a.config).map_err(|e| e.to_string())?;
    if a.check {
        if let Some(dir) = &cfg.agent.identity {
            pliant_wire::Security::load(dir, cfg.agent.encrypt.unwrap_or_default())
                .map_err(|e| format!("agent.identity {}: {e}", dir.display()))?;
        }
        println!(
            "agent {}: listen {}, {} replica slot(s): {}",
            cfg.agent.name,
            cfg.agent.listen,
            cfg.replica.len(),
            cfg.replica
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(());
    }
    pliant_agent::run_until_signal(&cfg, |ep| {
        eprintln!(
            "pliant agent {}: serving on {ep}; until SIGTERM/SIGINT",
            cfg.agent.name
        );
    })
}
