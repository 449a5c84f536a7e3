//! The control plane of a lab of hosts on hosts of its own (`LabSpec::controllers`): etcd in a
//! namespace `<lab>-etcd` and controllers in `<lab>-c1`, `<lab>-c2`, … — each only on the
//! management network, each controller on a private view of the run directory
//! ([`crate::host::command_in`]) holding nothing but its own config, identity, etcd client
//! certificate and API socket. They elect a leader by an etcd lease (mutual TLS), reach the
//! replicas and the hosts' agents over TCP, and steer through the fabric host's agent
//! ([`crate::agents::steering_keys`]): nothing they do needs the fabric's kernel or a shared
//! file, as when they run on other machines.
//!
//! Addresses on the management network: etcd [`ETCD_ADDR`], controller `k` `10.254.0.<250+k>`.

use crate::error::{io_err, LabError, Result};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Controllers a lab may run (addresses .251 to .254; .254 is the bridge's own).
pub const MAX_CONTROLLERS: u8 = 3;
/// etcd's host name and address.
pub const ETCD_HOST: &str = "etcd";
pub const ETCD_ADDR: &str = "10.254.0.250";
pub const ETCD_CLIENT_PORT: u16 = 2379;
pub const ETCD_PEER_PORT: u16 = 2380;
/// Each controller's API on its management address (a standby probes the leader's: a refused
/// connection is a dead leader process, taken over at once instead of after the lease).
pub const API_PORT: u16 = 7500;
/// How long the first leader may take to be elected.
const LEADER_TIMEOUT: Duration = Duration::from_secs(20);

/// Controller `k`'s host name.
pub fn controller_host(k: u8) -> String {
    format!("c{k}")
}

/// Controller `k`'s management address.
pub fn controller_addr(k: u8) -> String {
    format!("10.254.0.{}", 250 + u16::from(k))
}

/// The control plane's hosts of a lab with `controllers` controllers (none: no etcd either).
pub fn hosts(controllers: u8) -> Vec<String> {
    match controllers {
        0 => Vec::new(),
        n => std::iter::once(ETCD_HOST.to_string())
            .chain((1..=n).map(controller_host))
            .collect(),
    }
}

/// The namespace of control host `host` of lab `lab`.
pub fn netns(lab: &str, host: &str) -> String {
    format!("{lab}-{host}")
}

/// Control host `host`'s directory (its private view of the run directory).
pub fn dir(run_dir: &Path, host: &str) -> PathBuf {
    run_dir.join("hosts").join(host)
}

fn addr_of(host: &str) -> Option<String> {
    match host {
        ETCD_HOST => Some(ETCD_ADDR.into()),
        _ => host
            .strip_prefix('c')
            .and_then(|k| k.parse::<u8>().ok())
            .filter(|k| (1..=MAX_CONTROLLERS).contains(k))
            .map(controller_addr),
    }
}

/// Connects control host `host` to the management bridge (its only link).
pub fn connect(fabric: &str, lab: &str, host: &str) -> Result<()> {
    let addr = addr_of(host).ok_or_else(|| LabError::Config(format!("no control host {host}")))?;
    crate::mgmt::connect_ns(fabric, &netns(lab, host), &format!("mg{host}"), &addr)
}

/// The etcd client URL of the lab's etcd.
pub fn etcd_url() -> String {
    format!("https://{ETCD_ADDR}:{ETCD_CLIENT_PORT}")
}

/// Starts the lab's etcd on its host (mutual TLS: the PKI in `<run>/hosts/etcd/pki`) and
/// returns its process. It outlives this call: the lab records it, stops it at teardown and
/// reaps it.
pub fn start_etcd(run_dir: &Path, lab: &str) -> Result<std::process::Child> {
    let d = dir(run_dir, ETCD_HOST);
    let addr: std::net::IpAddr = ETCD_ADDR
        .parse()
        .map_err(|e| LabError::Config(format!("{e}")))?;
    let spec = crate::etcd::EtcdSpec {
        dir: d.clone(),
        netns: Some(netns(lab, ETCD_HOST)),
        addr,
        client_port: ETCD_CLIENT_PORT,
        peer_port: ETCD_PEER_PORT,
        tls: Some(crate::etcd::EtcdPki::issue(&d.join("pki"), &[addr])?),
        fast_leases: true,
    };
    let server = crate::etcd::EtcdServer::start(spec)?;
    server
        .detach()
        .ok_or_else(|| LabError::Config("etcd did not start".into()))
}

/// Writes controller `k`'s host directory — its CONTROLLER identity `c<k>`, a copy of etcd's
/// client certificate, its config — and returns the config's path as the controller sees it.
pub fn prepare_controller(
    run_dir: &Path,
    lab: &str,
    k: u8,
    spec: &crate::LabSpec,
) -> Result<String> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let host = controller_host(k);
    let d = dir(run_dir, &host);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(d.join("etcd"))
        .map_err(io_err(&d))?;
    crate::ha::issue_identity_in(
        run_dir,
        &d.join("id").join(&host),
        &host,
        pliant_wire::role::CONTROLLER,
    )?;
    // etcd's client certificate, as the controller's host would hold its own copy.
    let pki = dir(run_dir, ETCD_HOST).join("pki");
    for f in ["ca.crt", "client.crt", "client.key"] {
        let bytes = std::fs::read(pki.join(f)).map_err(io_err(pki.join(f)))?;
        let to = d.join("etcd").join(f);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&to)
            .map_err(io_err(&to))?;
        out.write_all(&bytes).map_err(io_err(&to))?;
    }
    let p = d.join("ctl.toml");
    std::fs::write(&p, config_text(run_dir, lab, k, spec)).map_err(io_err(&p))?;
    Ok(run_dir.join("ctl.toml").display().to_string())
}

/// Controller `k`'s config, paths as it sees them (its host directory over the run directory).
pub fn config_text(run_dir: &Path, lab: &str, k: u8, spec: &crate::LabSpec) -> String {
    let run = run_dir.display();
    let host = controller_host(k);
    let (ctl_keys, ha_keys) = crate::mgmt::controller_keys();
    let nat = matches!(&spec.mode, crate::ReplicaMode::Pliant { config } if config.kind == "nat");
    let nat_keys = match nat {
        true => format!("nat_addr = \"{}\"\n", crate::topology::OUTSIDE_GW_IP),
        false => String::new(),
    };
    // Blocks of 1000 ports: a failed-over replica's block stays quarantined while its flows
    // live on elsewhere, so many failovers need many blocks.
    let ports = match nat {
        true => "[ports]\nlo = 20000\nhi = 59999\nblock = 1000\nper_replica = 1\n",
        false => "",
    };
    // Scaling is asked for (`pliant scale out` lands on a spare host, `LabSpec::spare_hosts`),
    // not automatic: a policy's scale-in would stop replicas of a demo lab on its own.
    let policy = "[policy]\nauto = false\n";
    let ha = match spec.ha {
        true => format!(
            "[ha]\nmode = \"{}\"\nwatch_ms = 10\n{ha_keys}",
            spec.ha_mode.label()
        ),
        false => String::new(),
    };
    format!(
        "[controller]\nname = \"{host}\"\napi_socket = \"{run}/api.sock\"\n\
         api_tcp = \"{addr}:{API_PORT}\"\ntoken_file = \"{run}/token\"\n\
         identity = \"{run}/id/{host}\"\nheartbeat_ms = 100\ndead_after_missed = 5\n\
         leader_ttl_ms = 1000\n{ctl_keys}\
         [store]\nbackend = \"etcd\"\nendpoints = [\"{etcd}\"]\nprefix = \"/pliant/{lab}/\"\n\
         ca_file = \"{run}/etcd/ca.crt\"\ncert_file = \"{run}/etcd/client.crt\"\n\
         key_file = \"{run}/etcd/client.key\"\n\
         [lab]\nname = \"{lab}\"\n{steering}{nat_keys}\
         {ports}{policy}{ha}{hosts}",
        addr = controller_addr(k),
        etcd = etcd_url(),
        steering = crate::agents::steering_keys(),
        hosts = crate::agents::hosts_section(spec.hosts(), 20, 400),
    )
}

/// Controller `k`'s API socket and token, as the lab (and `pliant status --api`) sees them.
pub fn api_socket(run_dir: &Path, k: u8) -> PathBuf {
    dir(run_dir, &controller_host(k)).join("api.sock")
}

pub fn token_file(run_dir: &Path, k: u8) -> PathBuf {
    dir(run_dir, &controller_host(k)).join("token")
}

/// GET /v1/status of controller `k`: its HTTP status and body (a standby answers 503).
pub fn api_status(run_dir: &Path, k: u8) -> Result<(u16, String)> {
    let sock = api_socket(run_dir, k);
    let token_path = token_file(run_dir, k);
    let token = std::fs::read_to_string(&token_path).map_err(io_err(&token_path))?;
    let mut s = std::os::unix::net::UnixStream::connect(&sock).map_err(io_err(&sock))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .and_then(|_| s.set_write_timeout(Some(Duration::from_secs(5))))
        .map_err(io_err(&sock))?;
    write!(
        s,
        "GET /v1/status HTTP/1.1\r\nHost: pliant\r\nAuthorization: Bearer {}\r\n\
         Connection: close\r\n\r\n",
        token.trim()
    )
    .map_err(io_err(&sock))?;
    let mut text = String::new();
    s.take(4 << 20)
        .read_to_string(&mut text)
        .map_err(io_err(&sock))?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| LabError::Config(format!("controller c{k}: not an HTTP answer")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// The PID of controller `k`, as the lab started it.
pub fn controller_pid(lab: &crate::Lab, k: u8) -> Option<i32> {
    crate::agents::recorded_pid(lab, &format!("pliant-controller-{}", controller_host(k)))
}

/// Loses controller `k`'s host as a whole: its one link cut, then its controller SIGKILLed
/// (`at_cut` runs between the two, when the host falls silent).
pub fn kill_controller_host(lab: &crate::Lab, k: u8, at_cut: &mut dyn FnMut()) -> Result<String> {
    let host = controller_host(k);
    let ns = netns(lab.name(), &host);
    crate::cmd::run_ok(
        &crate::cmd::in_ns(&ns, &["ip", "link", "set", crate::mgmt::REPLICA_IF, "down"]),
        crate::cmd::SETUP_TIMEOUT,
    )?;
    at_cut();
    let killed =
        crate::agents::kill_recorded(&format!("controller {host}"), controller_pid(lab, k))?;
    Ok(format!("host {host} (link cut; {killed} SIGKILLed)"))
}

/// The controller among `1..=controllers` that leads now, if one answers as leader.
pub fn leader(run_dir: &Path, controllers: u8) -> Option<u8> {
    (1..=controllers).find(|k| matches!(api_status(run_dir, *k), Ok((200, _))))
}

/// Waits until one of the `controllers` leads; returns its host name.
pub fn wait_leader(run_dir: &Path, controllers: u8) -> Result<String> {
    let t0 = Instant::now();
    let mut last = String::new();
    loop {
        for k in 1..=controllers {
            match api_status(run_dir, k) {
                Ok((200, _)) => return Ok(controller_host(k)),
                Ok((code, body)) => last = format!("c{k}: {code} {}", body.trim()),
                Err(e) => last = format!("c{k}: {e}"),
            }
        }
        if t0.elapsed() > LEADER_TIMEOUT {
            return Err(LabError::NotReady {
                what: "a leading controller".into(),
                waited_ms: t0.elapsed().as_millis() as u64,
                detail: format!(
                    "{last}; log tail: {}",
                    crate::lab::log_tail(&dir(run_dir, "c1").join("controller.log"), 8)
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_hosts_have_their_own_addresses() {
        assert!(hosts(0).is_empty(), "no controllers, no etcd");
        assert_eq!(hosts(2), vec!["etcd", "c1", "c2"]);
        let addrs: Vec<String> = hosts(MAX_CONTROLLERS)
            .iter()
            .map(|h| addr_of(h).unwrap())
            .collect();
        let mut uniq = addrs.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), addrs.len(), "{addrs:?}");
        assert!(!addrs.contains(&crate::mgmt::CONTROLLER_ADDR.to_string()));
        assert_eq!(addr_of("c4"), None);
        assert_eq!(addr_of("x"), None);
    }

    #[test]
    fn a_controller_config_names_only_paths_in_its_host_view() {
        let run = Path::new("/run/pliant/lab7");
        let mut spec = crate::LabSpec::new(crate::ReplicaMode::Pliant {
            config: crate::PliantNf::nat(),
        });
        spec.ha = true;
        spec.replicas = 3;
        let t: toml::Table = toml::from_str(&config_text(run, "lab7", 2, &spec)).unwrap();
        let c = t["controller"].as_table().unwrap();
        assert_eq!(c["name"].as_str(), Some("c2"));
        assert_eq!(c["api_tcp"].as_str(), Some("10.254.0.252:7500"));
        assert_eq!(c["identity"].as_str(), Some("/run/pliant/lab7/id/c2"));
        assert_eq!(t["store"]["backend"].as_str(), Some("etcd"));
        assert_eq!(t["lab"]["steering"].as_str(), Some("agent"));
        assert_eq!(t["ha"]["mode"].as_str(), Some("pico"));
        assert_eq!(t["hosts"]["agent"].as_array().unwrap().len(), 3);
        let text = config_text(run, "lab7", 2, &spec);
        assert!(!text.contains("/hosts/"), "{text}");
    }
}
