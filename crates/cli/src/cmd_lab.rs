//! `pliant lab up|down|status|exec` and `pliant demo`: thin front-ends over `pliant-lab`.

use clap::{Args, Subcommand};
use pliant_lab::{
    down_all, down_by_name, down_stale, status, Lab, LabSpec, ReplicaMode, Role, CLIENT_IP,
    OUTSIDE_GW_IP, SERVER_IP,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MODES: [&str; 7] = [
    "kernel-nat",
    "kernel-forward",
    "pliant-nat",
    "pliant-forward",
    "pliant-firewall",
    "pliant-ids",
    "pliant-mbserv",
];

#[derive(Args)]
pub struct LabArgs {
    #[command(subcommand)]
    cmd: LabCmd,
    /// Directory holding one run directory (and state.json) per lab.
    #[arg(long, global = true, default_value = pliant_lab::DEFAULT_RUN_ROOT)]
    run_root: PathBuf,
}

#[derive(Subcommand)]
enum LabCmd {
    /// Build a lab and leave it running; prints its namespaces, addresses and files.
    Up {
        /// What runs in the replica namespace: the kernel's NAT or router, or a pliant replica
        /// running the NF named (with its section's defaults; see --nf-config).
        #[arg(long, default_value = "kernel-nat", value_parser = MODES)]
        mode: String,
        /// pliant modes: a TOML file of the NF's own sections (e.g. `[firewall]` with its
        /// `[[firewall.rules]]`, `[ids]`, `[nat]`), merged over the defaults key by key.
        #[arg(long)]
        nf_config: Option<std::path::PathBuf>,
        /// Lab name (a-z, 0-9, '-'; at most 16); default pl<6 random hex>.
        #[arg(long)]
        name: Option<String>,
        /// Turn off checksum/segmentation offloads on all lab interfaces.
        #[arg(long)]
        disable_offloads: bool,
        /// Also serve a 100 MB file (generation takes a second or two).
        #[arg(long)]
        big_file: bool,
        /// Number of replicas (2+ are steered by pliant-steer's tc-BPF program; pliant NAT
        /// replicas then each get NAT port block 20000+(n-1)*1000..+999, steered back to them).
        #[arg(long, default_value_t = 1)]
        replicas: u8,
        /// High availability (pliant modes): a replication secret (repl.secret, 0600) and an
        /// [ha] section in every replica config, so replicas can protect each other.
        #[arg(long)]
        ha: bool,
        /// HA mode of the replicas (implies --ha): pico (default) or ftmb (FTMB rollback
        /// recovery: [ha] mode = "ftmb", 2 workers, a snapshot every 50 ms).
        #[arg(long, value_parser = ["pico", "ftmb"])]
        ha_mode: Option<String>,
        /// pliant modes: run every replica thread under SCHED_FIFO at this priority
        /// ([replica] realtime_priority; shorter migration pauses on a busy machine).
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=99))]
        realtime_priority: Option<u8>,
        /// Put each replica on a host of its own (pliant modes): its own network and mount
        /// namespace (private /run), a `pliant agent` that starts its replica, every channel
        /// over TCP on a management network. One replica per host: N replicas (--replicas,
        /// if given, must be N).
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=32))]
        hosts: Option<u8>,
        /// With --hosts: each host's replica ports reach the fabric through VXLAN tunnels over
        /// its management link (the host shares nothing else with the fabric) instead of veths.
        #[arg(long, requires = "hosts")]
        tunnels: bool,
        /// With --hosts: run this many controllers (default 2: a leader and a standby), each
        /// on a host of its own, electing a leader in an etcd on another host (mutual TLS);
        /// they steer through the fabric host's agent. 0: none, run your own controller.
        #[arg(long, requires = "hosts", value_parser = clap::value_parser!(u8).range(0..=3))]
        controllers: Option<u8>,
        /// With --hosts: this many more hosts with an agent but no replica running, for a
        /// controller to scale out onto (after a host's loss, say).
        #[arg(long, requires = "hosts", default_value_t = 0)]
        spare_hosts: u8,
    },
    /// Remove a lab (processes, namespaces, run directory), also after a crash.
    Down {
        /// The lab to remove.
        #[arg(long, required_unless_present_any = ["all_stale", "all"])]
        name: Option<String>,
        /// Remove every lab whose creating process (test, benchmark) is gone.
        #[arg(long)]
        all_stale: bool,
        /// Remove every lab under the run root.
        #[arg(long)]
        all: bool,
    },
    /// List labs with their namespaces and process liveness.
    Status {
        /// One JSON object per lab instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run a command inside a host of a lab, e.g. `pliant lab exec --name X client -- ping -c1 10.77.2.2`.
    Exec {
        #[arg(long)]
        name: String,
        /// client, server, fabric or rN.
        role: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
}

/// The hosts of a lab made with `--hosts` (one per replica namespace with an agent): name,
/// network namespace, agent endpoint and whether its agent process runs. Empty otherwise.
fn lab_hosts(s: &pliant_lab::LabStatus) -> Vec<serde_json::Value> {
    if !s.state.agents {
        return Vec::new();
    }
    s.procs
        .iter()
        .filter_map(|(p, alive)| {
            let host = p.role.strip_prefix("pliant-agent-")?;
            let n: u8 = host.strip_prefix('h')?.parse().ok()?;
            Some(serde_json::json!({
                "name": host,
                "netns": format!("{}-r{n}", s.state.name),
                "agent": pliant_lab::agents::endpoint(n),
                "management": pliant_lab::mgmt::addr(n),
                "agent_pid": p.pid,
                "agent_alive": alive,
            }))
        })
        .collect()
}

pub fn run(a: LabArgs) -> Result<(), String> {
    match a.cmd {
        LabCmd::Up {
            mode,
            nf_config,
            name,
            disable_offloads,
            big_file,
            replicas,
            ha,
            ha_mode,
            realtime_priority,
            hosts,
            tunnels,
            controllers,
            spare_hosts,
        } => {
            let mut mode = ReplicaMode::parse(&mode).ok_or(format!("unknown mode {mode}"))?;
            if let Some(f) = &nf_config {
                let ReplicaMode::Pliant { config } = &mut mode else {
                    return Err("--nf-config needs a pliant mode".into());
                };
                let text = std::fs::read_to_string(f)
                    .map_err(|e| format!("--nf-config {}: {e}", f.display()))?;
                config
                    .merge_sections(&text)
                    .map_err(|e| format!("--nf-config {}: {e}", f.display()))?;
            }
            let mut spec = LabSpec::new(mode);
            spec.name = name;
            spec.detached = true;
            spec.disable_offloads = disable_offloads;
            spec.replicas = replicas;
            if let Some(h) = hosts {
                if replicas != 1 && replicas != h {
                    return Err(format!(
                        "--hosts {h} --replicas {replicas}: one replica per host, give one of them"
                    ));
                }
                spec.replicas = h;
                spec.agents = true;
                spec.tunnels = tunnels;
                spec.controllers = controllers.unwrap_or(2);
                spec.spare_hosts = spare_hosts;
                spec.transport = pliant_lab::mgmt::Transport::Tcp;
            }
            spec.realtime_priority = realtime_priority;
            spec.ha = ha || ha_mode.is_some();
            if let Some(m) = ha_mode.as_deref() {
                spec.ha_mode = pliant_lab::LabHaMode::parse(m)
                    .ok_or_else(|| format!("unknown HA mode {m} (pico or ftmb)"))?;
            }
            spec.run_root = a.run_root;
            spec.pliant_bin = Some(self_exe()?);
            if big_file {
                spec = spec.with_file("100M.bin", 100 << 20);
            }
            let lab = Lab::up(spec).map_err(|e| e.to_string())?;
            print_lab(&lab);
            if let Some(k) = hosts.map(|_| controllers.unwrap_or(2)).filter(|k| *k > 0) {
                let run = &lab.state().run_dir;
                println!(
                    "controllers: c1..c{k} on hosts of their own (10.254.0.251..), etcd on {}; \
                     ask any of them (a standby names the leader):",
                    pliant_lab::control::etcd_url()
                );
                for c in 1..=k {
                    println!(
                        "  pliant status --api {} --token-file {}",
                        pliant_lab::control::api_socket(run, c).display(),
                        pliant_lab::control::token_file(run, c).display()
                    );
                }
            } else if let Some(h) = hosts {
                println!(
                    "hosts: h1..h{h} (agents on 10.254.0.N:{}), the fabric's agent on {}; a \
                     controller reaches them with, in ctl.toml's [lab] section:\n{}and the \
                     section:\n{}",
                    pliant_lab::agents::AGENT_PORT,
                    pliant_lab::agents::fabric_endpoint(),
                    pliant_lab::agents::steering_keys(),
                    pliant_lab::agents::hosts_section(h + spare_hosts, 50, 1000)
                );
            }
            let name = lab.name().to_string();
            lab.detach();
            println!("remove with: pliant lab down --name {name}");
            Ok(())
        }
        LabCmd::Down {
            name,
            all_stale,
            all,
        } => {
            let mut removed = Vec::new();
            if let Some(n) = name {
                let problems = down_by_name(&a.run_root, &n).map_err(|e| e.to_string())?;
                removed.push((n, problems));
            }
            if all {
                removed.extend(down_all(&a.run_root));
            } else if all_stale {
                removed.extend(down_stale(&a.run_root));
            }
            let mut failed = false;
            for (n, problems) in &removed {
                if problems.is_empty() {
                    println!("removed {n}");
                } else {
                    failed = true;
                    println!("removed {n} with problems: {}", problems.join("; "));
                }
            }
            if removed.is_empty() {
                println!("no lab to remove");
            }
            if failed {
                Err("some resources could not be removed".into())
            } else {
                Ok(())
            }
        }
        LabCmd::Status { json } => {
            let all = status(&a.run_root);
            if all.is_empty() && !json {
                println!("no labs under {}", a.run_root.display());
            }
            for r in all {
                match r {
                    Err(e) => println!("unreadable lab state: {e}"),
                    Ok(s) if json => {
                        let v = serde_json::json!({
                            "name": s.state.name,
                            "mode": s.state.mode,
                            "run_dir": s.state.run_dir,
                            "stale": s.stale,
                            "namespaces": s.namespaces.iter()
                                .map(|(n, up)| serde_json::json!({"name": n, "exists": up}))
                                .collect::<Vec<_>>(),
                            "processes": s.procs.iter()
                                .map(|(p, alive)| serde_json::json!({"pid": p.pid, "role": p.role, "alive": alive}))
                                .collect::<Vec<_>>(),
                            "hosts": lab_hosts(&s),
                        });
                        println!("{v}");
                    }
                    Ok(s) => {
                        let owner = match (&s.state.owner, s.stale) {
                            (None, _) => "detached".to_string(),
                            (Some(o), false) => format!("owned by pid {}", o.pid),
                            (Some(o), true) => format!("STALE (owner pid {} is gone)", o.pid),
                        };
                        println!(
                            "{}  mode={}  {owner}  dir={}",
                            s.state.name,
                            s.state.mode,
                            s.state.run_dir.display()
                        );
                        for (n, up) in &s.namespaces {
                            println!(
                                "  netns {n:<28} {}",
                                if *up { "present" } else { "MISSING" }
                            );
                        }
                        for (p, alive) in &s.procs {
                            println!(
                                "  pid {:<8} {:<10} {}",
                                p.pid,
                                p.role,
                                if *alive { "running" } else { "DEAD" }
                            );
                        }
                        for h in lab_hosts(&s) {
                            println!(
                                "  host {:<4} agent {:<20} {} ({}, netns {})",
                                h["name"].as_str().unwrap_or("?"),
                                h["agent"].as_str().unwrap_or("?"),
                                if h["agent_alive"] == true {
                                    "running"
                                } else {
                                    "DEAD"
                                },
                                h["management"].as_str().unwrap_or("?"),
                                h["netns"].as_str().unwrap_or("?"),
                            );
                        }
                    }
                }
            }
            Ok(())
        }
        LabCmd::Exec { name, role, cmd } => {
            let role = Role::parse(&role).map_err(|e| e.to_string())?;
            pliant_lab::validate_name(&name).map_err(|e| e.to_string())?;
            let ns = format!("{name}-{}", role.suffix());
            if !pliant_lab::state::netns_exists(&ns) {
                return Err(format!(
                    "namespace {ns} does not exist (see `pliant lab status`)"
                ));
            }
            let st = std::process::Command::new("ip")
                .args(["netns", "exec", &ns])
                .args(&cmd)
                .status()
                .map_err(|e| format!("ip netns exec {ns}: {e}"))?;
            if st.success() {
                Ok(())
            } else {
                Err(format!("command exited with {st}"))
            }
        }
    }
}

fn self_exe() -> Result<PathBuf, String> {
    std::env::current_exe().map_err(|e| format!("cannot locate the pliant binary: {e}"))
}

fn print_lab(lab: &Lab) {
    println!(
        "lab {}  mode={}  dir={}",
        lab.name(),
        lab.state().mode,
        lab.run_dir().display()
    );
    for ns in &lab.state().namespaces {
        println!("  netns  {ns}");
    }
    println!("  client {CLIENT_IP} -> server {SERVER_IP} (NAT/router address {OUTSIDE_GW_IP})");
    for f in lab.served_files() {
        println!(
            "  file   {} ({} bytes) sha256 {}",
            f.url, f.size_bytes, f.sha256
        );
    }
    if let Some(s) = lab.replica_socket(1) {
        println!("  replica r1 control socket {}", s.display());
    }
}

#[derive(Args)]
pub struct DemoArgs {
    /// Replica mode to demonstrate (pliant-nat is the point; kernel-nat shows the peer).
    #[arg(long, default_value = "pliant-nat", value_parser = MODES)]
    mode: String,
    /// Seconds of iperf3.
    #[arg(long, default_value_t = 3)]
    iperf_s: u32,
    #[arg(long, default_value = pliant_lab::DEFAULT_RUN_ROOT)]
    run_root: PathBuf,
    /// Turn off checksum/segmentation offloads on all lab interfaces.
    #[arg(long)]
    disable_offloads: bool,
}

fn step(title: &str) -> Result<(), String> {
    if pliant_lab::cmd::interrupted() {
        return Err("interrupted; the lab was torn down".into());
    }
    println!("\n== {title}");
    Ok(())
}

pub fn demo(a: DemoArgs) -> Result<(), String> {
    let mode = ReplicaMode::parse(&a.mode).ok_or(format!("unknown mode {}", a.mode))?;
    let is_pliant = matches!(mode, ReplicaMode::Pliant { .. });
    // Ctrl-C ends the step in progress; the lab is then torn down instead of left behind.
    pliant_lab::cmd::defer_interrupts();
    let mut spec = LabSpec::new(mode).with_file("100M.bin", 100 << 20);
    spec.run_root = a.run_root;
    spec.pliant_bin = Some(self_exe()?);
    spec.disable_offloads = a.disable_offloads;
    step(&format!(
        "bringing up a namespace lab with a {} replica",
        a.mode
    ))?;
    let lab = Lab::up(spec).map_err(|e| {
        if is_pliant {
            format!("the pliant replica did not come up: {e}\n(the lab was removed again)")
        } else {
            e.to_string()
        }
    })?;
    print_lab(&lab);
    // Everything after this point runs with the lab up; `lab` is dropped (torn down) on return.
    demo_traffic(&lab, a.iperf_s, is_pliant)?;
    step("tearing the lab down")?;
    lab.down().map_err(|e| e.to_string())?;
    println!("done: no namespace or process of the demo is left");
    Ok(())
}

fn demo_traffic(lab: &Lab, iperf_s: u32, is_pliant: bool) -> Result<(), String> {
    let e = |x: pliant_lab::LabError| x.to_string();
    step(&format!(
        "curl from the client ({CLIENT_IP}) to nginx on the server ({SERVER_IP})"
    ))?;
    for f in lab.served_files() {
        let dst = lab.run_dir().join(format!("client-{}", f.name));
        let d = dst.display().to_string();
        let t = Instant::now();
        let out = lab
            .exec(
                Role::Client,
                &["curl", "-sS", "--max-time", "60", "-o", &d, &f.url],
            )
            .map_err(e)?;
        let secs = t.elapsed().as_secs_f64();
        if !out.success() {
            return Err(format!("curl {} failed: {}", f.url, out.stderr.trim()));
        }
        let sum = lab.exec_ok(Role::Client, &["sha256sum", &d]).map_err(e)?;
        let got = sum.stdout.split_whitespace().next().unwrap_or("");
        let ok = got == f.sha256;
        println!(
            "  {:<9} {:>10} bytes in {:.2} s ({:.0} Mbit/s)  sha256 {}…  {}",
            f.name,
            f.size_bytes,
            secs,
            f.size_bytes as f64 * 8.0 / secs.max(1e-6) / 1e6,
            &f.sha256[..16.min(f.sha256.len())],
            if ok {
                "checksum OK"
            } else {
                "CHECKSUM MISMATCH"
            }
        );
        if !ok {
            return Err(format!(
                "{}: got sha256 {got}, expected {}",
                f.name, f.sha256
            ));
        }
        let _ = std::fs::remove_file(&dst);
    }

    step("what the server saw (nginx access log)")?;
    let log = lab.access_log().map_err(e)?;
    for entry in &log {
        println!(
            "  {}:{}  \"{}\" {} {} bytes",
            entry.remote_addr, entry.remote_port, entry.request, entry.status, entry.body_bytes
        );
    }
    let all_nat = !log.is_empty() && log.iter().all(|x| x.remote_addr == OUTSIDE_GW_IP);
    let any_client = log.iter().any(|x| x.remote_addr == CLIENT_IP);
    if all_nat {
        println!("  -> the client is {CLIENT_IP}, the server only ever saw the NAT address {OUTSIDE_GW_IP}");
    } else if any_client {
        println!("  -> the server saw the client's own address {CLIENT_IP} (no NAT in this mode)");
    }

    step(&format!("iperf3, one TCP stream for {iperf_s} s"))?;
    let t = iperf_s.to_string();
    let out = lab
        .exec_timeout(
            Role::Client,
            &["iperf3", "-c", SERVER_IP, "-t", &t, "-J"],
            Duration::from_secs(u64::from(iperf_s) + 20),
        )
        .map_err(e)?;
    match pliant_bench::parse_iperf3_gbps(&out.stdout) {
        Ok(r) => println!(
            "  {:.2} Gbit/s received, {} retransmits",
            r.gbps, r.retransmits
        ),
        Err(err) => println!("  iperf3 failed: {err} {}", out.stderr.trim()),
    }

    step("ping, 5 echo requests through the replica")?;
    let out = lab
        .exec(
            Role::Client,
            &["ping", "-c", "5", "-i", "0.2", "-W", "1", SERVER_IP],
        )
        .map_err(e)?;
    for line in out
        .stdout
        .lines()
        .filter(|l| l.contains("time=") || l.contains("packet loss") || l.starts_with("rtt"))
    {
        println!("  {line}");
    }

    if is_pliant {
        step("the replica's counters (pliant stats)")?;
        if let Some(sock) = lab.replica_socket(1) {
            print_stats(sock)?;
        }
    }
    Ok(())
}

fn print_stats(sock: &Path) -> Result<(), String> {
    let exe = self_exe()?;
    let out = std::process::Command::new(exe)
        .args(["stats", "--socket"])
        .arg(sock)
        .output()
        .map_err(|e| format!("pliant stats: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        println!("  {line}");
    }
    if !out.status.success() {
        println!(
            "  (pliant stats failed: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
