//! Host agents in a lab (`LabSpec::agents`, a TCP lab): each replica namespace is a host with
//! its own `pliant agent`, which starts the host's replica (the lab asks it to at `up`, a
//! controller with `[hosts]` asks it later), reaps it and reports. The agent runs in the host's
//! private view of the run directory ([`crate::host`]) and listens on the management network
//! (`10.254.0.<n>:7410`, for the controller) and on a unix socket in its host directory (for
//! the lab itself, which lives outside the management network); both authenticated with the
//! lab's CA (the agent holds an AGENT identity `h<n>`).

use crate::error::{LabError, Result};
use pliant_proto::agent::{AgentRequest, AgentStatus};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The agents' port on the management network.
pub const AGENT_PORT: u16 = 7410;

/// Host `n`'s name (its agent's certificate name).
pub fn host_name(n: u8) -> String {
    format!("h{n}")
}

/// Host `n`'s agent endpoint on the management network.
pub fn endpoint(n: u8) -> String {
    format!("{}:{AGENT_PORT}", crate::mgmt::addr(n))
}

/// Host `n`'s agent unix socket, as the lab sees it.
pub fn socket(run_dir: &Path, n: u8) -> PathBuf {
    crate::host::dir(run_dir, n).join("agent.sock")
}

/// Replica `n`'s log as the lab sees it (the agent writes it inside the host's view).
pub fn replica_log(run_dir: &Path, n: u8) -> PathBuf {
    crate::host::dir(run_dir, n).join(format!("r{n}.log"))
}

/// Host `n`'s agent config (paths as the agent sees them: its host view of `run_dir`).
pub fn config_text(run_dir: &Path, n: u8, pliant_bin: &str) -> String {
    let run = run_dir.display();
    let mut agent = toml::Table::new();
    agent.insert("name".into(), host_name(n).into());
    agent.insert("listen".into(), endpoint(n).into());
    agent.insert("socket".into(), format!("{run}/agent.sock").into());
    agent.insert(
        "identity".into(),
        format!("{run}/id/{}", host_name(n)).into(),
    );
    agent.insert("state_dir".into(), format!("{run}/agent-state").into());
    let mut slot = toml::Table::new();
    slot.insert("name".into(), format!("r{n}").into());
    slot.insert(
        "command".into(),
        toml::Value::Array(
            [
                pliant_bin,
                "replica",
                "--config",
                &format!("{run}/r{n}.toml"),
            ]
            .iter()
            .map(|s| toml::Value::from(*s))
            .collect(),
        ),
    );
    slot.insert("control".into(), format!("{run}/r{n}.sock").into());
    slot.insert("log".into(), format!("{run}/r{n}.log").into());
    let mut t = toml::Table::new();
    t.insert("agent".into(), agent.into());
    t.insert(
        "replica".into(),
        toml::Value::Array(vec![toml::Value::Table(slot)]),
    );
    toml::to_string(&t).unwrap_or_default()
}

/// Writes host `n`'s agent config into its host directory and issues its AGENT identity.
/// Returns the config's path as the agent sees it.
pub fn prepare(run_dir: &Path, n: u8, pliant_bin: &str) -> Result<String> {
    let dir = crate::host::dir(run_dir, n);
    crate::ha::issue_identity_in(
        run_dir,
        &dir.join("id").join(host_name(n)),
        &host_name(n),
        pliant_wire::role::AGENT,
    )?;
    let p = dir.join("agent.toml");
    std::fs::write(&p, config_text(run_dir, n, pliant_bin)).map_err(crate::error::io_err(&p))?;
    Ok(run_dir.join("agent.toml").display().to_string())
}

/// A client of host `n`'s agent (its unix socket), as the lab's admin.
pub fn client(run_dir: &Path, n: u8) -> pliant_proto::Client {
    pliant_proto::Client::new(
        pliant_wire::Endpoint::Unix(socket(run_dir, n)),
        crate::ha::lab_security(run_dir, crate::ha::ADMIN),
    )
    .expecting(host_name(n))
    .expecting_role(pliant_wire::role::AGENT)
}

/// Waits until host `n`'s agent answers (its process `child` must not end meanwhile).
pub fn wait_agent(run_dir: &Path, n: u8, child: &mut std::process::Child) -> Result<()> {
    wait_answer(&client(run_dir, n), &host_name(n), child)
}

/// The fabric host's agent: its certified name.
pub const FABRIC_AGENT: &str = "fabric";

/// The fabric agent's endpoint on the management network (the bridge's address: it runs in
/// the fabric namespace's network stack).
pub fn fabric_endpoint() -> String {
    format!("{}:{AGENT_PORT}", crate::mgmt::CONTROLLER_ADDR)
}

/// The fabric agent's unix socket (for the lab itself).
pub fn fabric_socket(run_dir: &Path) -> PathBuf {
    run_dir.join("fabric-agent.sock")
}

/// The fabric agent's config: no replica slots, the lab's fabric namespace to steer.
pub fn fabric_config_text(run_dir: &Path, lab: &str) -> String {
    let mut agent = toml::Table::new();
    agent.insert("name".into(), FABRIC_AGENT.into());
    agent.insert("listen".into(), fabric_endpoint().into());
    agent.insert(
        "socket".into(),
        fabric_socket(run_dir).display().to_string().into(),
    );
    agent.insert(
        "identity".into(),
        crate::ha::identity_dir(run_dir, FABRIC_AGENT)
            .display()
            .to_string()
            .into(),
    );
    agent.insert(
        "state_dir".into(),
        run_dir
            .join("fabric-agent-state")
            .display()
            .to_string()
            .into(),
    );
    let mut fabric = toml::Table::new();
    fabric.insert(
        "netns".into(),
        format!("{lab}-{}", crate::topology::Role::Fabric.suffix()).into(),
    );
    let mut t = toml::Table::new();
    t.insert("agent".into(), agent.into());
    t.insert("fabric".into(), fabric.into());
    toml::to_string(&t).unwrap_or_default()
}

/// Issues the fabric agent's AGENT identity and writes its config; returns the config's path.
pub fn prepare_fabric(run_dir: &Path, lab: &str) -> Result<PathBuf> {
    crate::ha::issue_identity(run_dir, FABRIC_AGENT, pliant_wire::role::AGENT)?;
    let p = run_dir.join("fabric-agent.toml");
    std::fs::write(&p, fabric_config_text(run_dir, lab)).map_err(crate::error::io_err(&p))?;
    Ok(p)
}

/// A client of the fabric agent (its unix socket), as the lab's admin.
pub fn fabric_client(run_dir: &Path) -> pliant_proto::Client {
    pliant_proto::Client::new(
        pliant_wire::Endpoint::Unix(fabric_socket(run_dir)),
        crate::ha::lab_security(run_dir, crate::ha::ADMIN),
    )
    .expecting(FABRIC_AGENT)
    .expecting_role(pliant_wire::role::AGENT)
}

/// Waits until the fabric agent answers.
pub fn wait_fabric_agent(run_dir: &Path, child: &mut std::process::Child) -> Result<()> {
    wait_answer(&fabric_client(run_dir), FABRIC_AGENT, child)
}

/// The `[lab]` keys of a controller that steers through the fabric agent (any host's
/// controller: nothing of the fabric's kernel is needed where it runs).
pub fn steering_keys() -> String {
    format!(
        "steering = \"agent\"\nfabric_agent = \"{}\"\nfabric_agent_name = \"{FABRIC_AGENT}\"\n",
        fabric_endpoint()
    )
}

fn wait_answer(
    c: &pliant_proto::Client,
    name: &str,
    child: &mut std::process::Child,
) -> Result<()> {
    let t0 = std::time::Instant::now();
    let c = c.clone().with_timeout(Duration::from_millis(500));
    loop {
        match c.ask::<AgentStatus, _>(&AgentRequest::AgentStatus) {
            Ok(_) => return Ok(()),
            Err(e) => {
                let waited_ms = t0.elapsed().as_millis() as u64;
                if let Ok(Some(st)) = child.try_wait() {
                    return Err(LabError::NotReady {
                        what: format!("agent {name}"),
                        waited_ms,
                        detail: format!("exited with {st}"),
                    });
                }
                if t0.elapsed() > Duration::from_secs(15) {
                    return Err(LabError::NotReady {
                        what: format!("agent {name}"),
                        waited_ms,
                        detail: e.to_string(),
                    });
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asks host `n`'s agent to start replica `r<n>`; returns its PID once it serves.
pub fn start_replica(run_dir: &Path, n: u8) -> Result<u32> {
    let st: AgentStatus = client(run_dir, n)
        .ask(&AgentRequest::Start {
            replica: format!("r{n}"),
        })
        .map_err(|e| LabError::NotReady {
            what: format!("replica r{n} (through agent {})", host_name(n)),
            waited_ms: 0,
            detail: format!(
                "{e}; log tail: {}",
                crate::lab::log_tail(&replica_log(run_dir, n), 12)
            ),
        })?;
    st.slot(&format!("r{n}"))
        .and_then(|s| s.pid)
        .ok_or_else(|| LabError::Config(format!("agent {} reported no pid", host_name(n))))
}

/// The PID of host `n`'s agent, as the lab started it.
pub fn agent_pid(lab: &crate::Lab, n: u8) -> Option<i32> {
    recorded_pid(lab, &format!("pliant-agent-{}", host_name(n)))
}

/// The PID the lab recorded for the process of `role` (its agents, fabric agent, controllers).
pub fn recorded_pid(lab: &crate::Lab, role: &str) -> Option<i32> {
    lab.state()
        .procs
        .iter()
        .find(|q| q.role == role)
        .map(|q| q.pid)
}

/// SIGKILLs `what`, a process this lab started, by its recorded `pid` (`None`: an error).
/// Returns `what (pid N)`.
pub fn kill_recorded(what: &str, pid: Option<i32>) -> Result<String> {
    let pid = pid.ok_or_else(|| LabError::Config(format!("{what}: no live process recorded")))?;
    // SAFETY: SIGKILL to a process this lab started, by its recorded PID.
    if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
        return Err(LabError::Config(format!(
            "kill {what} (pid {pid}): {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(format!("{what} (pid {pid})"))
}

/// Cuts (`up = false`) or restores host `n`'s three links — management, inside, outside —
/// at once (one `ip -batch` in the host's namespace), its processes left alone: a partition
/// of the host. The management link carries only its connected subnet, which the kernel
/// restores with the link.
pub fn set_host_links(lab: &crate::Lab, n: u8, up: bool) -> Result<()> {
    set_links(lab, n, &host_links(n), up)
}

/// Host `n`'s links: management first, then the replica's inside and outside ports.
pub fn host_links(n: u8) -> [String; 3] {
    use crate::topology::{replica_in_if, replica_out_if};
    [
        crate::mgmt::REPLICA_IF.to_string(),
        replica_in_if(n),
        replica_out_if(n),
    ]
}

/// Sets `links` of host `n` up or down at once (one `ip -batch` in the host's namespace).
pub fn set_links(lab: &crate::Lab, n: u8, links: &[String], up: bool) -> Result<()> {
    use crate::topology::Role;
    let state = if up { "up" } else { "down" };
    let batch = lab
        .run_dir()
        .join(format!("links-h{n}-{state}-{}.batch", links.len()));
    let lines: String = links
        .iter()
        .map(|ifn| format!("link set {ifn} {state}\n"))
        .collect();
    std::fs::write(&batch, lines).map_err(crate::error::io_err(&batch))?;
    let b = batch.display().to_string();
    lab.exec_ok(Role::Replica(n), &["ip", "-batch", &b])?;
    Ok(())
}

/// Loses host `n` of a lab with agents as a whole: its three links cut at once (one
/// `ip -batch`; so nothing its dying kernel says leaves it), `at_cut` called the moment that
/// returns (the failure instant: the host forwarded until then), then its replica and its
/// agent SIGKILLed by their recorded PIDs. Returns a description of what was done.
pub fn kill_host(lab: &crate::Lab, n: u8, at_cut: &mut dyn FnMut()) -> Result<String> {
    set_host_links(lab, n, false)?;
    at_cut();
    let agent_role = format!("pliant-agent-{}", host_name(n));
    let agent = agent_pid(lab, n);
    let mut done = Vec::new();
    for (what, pid) in [
        (format!("replica r{n}"), lab.replica_pid(n)),
        (agent_role, agent),
    ] {
        done.push(kill_recorded(&what, pid)?);
    }
    Ok(format!(
        "host {} (links cut; {} SIGKILLed)",
        host_name(n),
        done.join(", ")
    ))
}

/// The controller's `[hosts]` section for a lab of `hosts` hosts. A silent host is seen
/// about `dead_after_ms` + one poll bound after its last answer, so the bound is a quarter
/// of `dead_after_ms` (at most 250 ms).
pub fn hosts_section(hosts: u8, poll_ms: u64, dead_after_ms: u64) -> String {
    let bound = (dead_after_ms / 4).clamp(10, 250);
    let mut s = format!(
        "[hosts]\npoll_ms = {poll_ms}\ndead_after_ms = {dead_after_ms}\npoll_timeout_ms = {bound}\n"
    );
    for n in 1..=hosts {
        s.push_str(&format!(
            "[[hosts.agent]]\nname = \"{}\"\nendpoint = \"{}\"\n",
            host_name(n),
            endpoint(n)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_config_names_paths_in_the_hosts_view() {
        let run = Path::new("/run/pliant/lab1");
        let c: toml::Table = toml::from_str(&config_text(run, 2, "/bin/pliant")).unwrap();
        assert_eq!(c["agent"]["name"].as_str(), Some("h2"));
        assert_eq!(c["agent"]["listen"].as_str(), Some("10.254.0.2:7410"));
        assert_eq!(
            c["agent"]["socket"].as_str(),
            Some("/run/pliant/lab1/agent.sock")
        );
        let slot = &c["replica"][0];
        assert_eq!(slot["name"].as_str(), Some("r2"));
        assert_eq!(
            slot["control"].as_str(),
            Some("/run/pliant/lab1/r2.sock"),
            "the replica's own socket path, which its host view resolves"
        );
        assert_eq!(
            socket(run, 2),
            PathBuf::from("/run/pliant/lab1/hosts/r2/agent.sock")
        );
        let h: toml::Table = toml::from_str(&hosts_section(3, 20, 400)).unwrap();
        assert_eq!(h["hosts"]["agent"].as_array().unwrap().len(), 3);
    }
}
