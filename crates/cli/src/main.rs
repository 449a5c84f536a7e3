//! `pliant`: one binary, one subcommand per role. Each subcommand lives in its own module so
//! that the packet path (replica), the lab and the benchmarks can be read separately.

use clap::{Parser, Subcommand};

mod cmd_agent;
mod cmd_bench;
mod cmd_bench_elastic;
mod cmd_bench_ha;
mod cmd_bench_slice;
mod cmd_controller;
mod cmd_hub;
mod cmd_keys;
mod cmd_kv;
mod cmd_lab;
mod cmd_pg;
mod cmd_replica;
mod cmd_slice;
mod cmd_smr;
mod signals;

#[derive(Parser)]
#[command(
    name = "pliant",
    version,
    about = "Elasticity and high availability for stateful network functions"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one replica process (packet runtime + network function) from a TOML config.
    Replica(cmd_replica::ReplicaArgs),
    /// Ask a running replica for counters, flows or NF state over its control socket.
    Stats(cmd_replica::StatsArgs),
    /// Query NF-specific state of a running replica (e.g. IDS counts and alerts) as JSON.
    Query(cmd_replica::QueryArgs),
    /// Build, inspect and remove the namespace lab (client, fabric, replicas, server).
    Lab(cmd_lab::LabArgs),
    /// Benchmarks against kernel peers measured in the same run.
    Bench(cmd_bench::BenchArgs),
    /// PostgreSQL high availability (RemusDB at the service boundary): cluster, proxy, failover.
    Pg(cmd_pg::PgArgs),
    /// Elastic partitioned in-memory database on Redis Cluster: up, status, plan, scale, down.
    Kv(cmd_kv::KvArgs),
    /// The main demo: a lab with a pliant NAT and real traffic through it.
    Demo(cmd_lab::DemoArgs),
    /// Run the elasticity controller daemon (heartbeats, migrations, scaling, policies).
    Controller(cmd_controller::ControllerArgs),
    /// Controller view: replicas, load, counters, recent events.
    Status(cmd_controller::StatusArgs),
    /// Flows per replica, as the controller sees them.
    Flows(cmd_controller::FlowsArgs),
    /// Move flows between replicas through the controller.
    Migrate(cmd_controller::MigrateArgs),
    /// Scale out (add a replica) or in (merge one away) through the controller.
    Scale(cmd_controller::ScaleArgs),
    /// Show or change the controller's elasticity policy.
    Policy(cmd_controller::PolicyArgs),
    /// High availability through the controller: replication status, (re-)protection.
    Ha(cmd_controller::HaArgs),
    /// Run the host agent: starts, stops and watches this host's replicas for the controller.
    Agent(cmd_agent::AgentArgs),
    /// Run the coherence hub: shared state (combiners, SYNCH locks) across replica processes.
    Hub(cmd_hub::HubArgs),
    /// Provision identities: a deployment CA, and CA-signed node identities (replicas, the hub).
    Keys(cmd_keys::KeysArgs),
    /// State machine replication of an unmodified TCP server: its input ordered by Raft.
    Smr(cmd_smr::SmrArgs),
    /// Live TCP sessions moved between server instances: run the example server, list its
    /// sessions, read its counters, migrate sessions to another instance.
    Slice(cmd_slice::SliceArgs),
}

fn main() {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Replica(a) => cmd_replica::run(a),
        Cmd::Stats(a) => cmd_replica::stats(a),
        Cmd::Query(a) => cmd_replica::query(a),
        Cmd::Lab(a) => cmd_lab::run(a),
        Cmd::Bench(a) => cmd_bench::run(a),
        Cmd::Demo(a) => cmd_lab::demo(a),
        Cmd::Pg(a) => cmd_pg::run(a),
        Cmd::Kv(a) => cmd_kv::run(a),
        Cmd::Controller(a) => cmd_controller::run(a),
        Cmd::Status(a) => cmd_controller::status(a),
        Cmd::Flows(a) => cmd_controller::flows(a),
        Cmd::Migrate(a) => cmd_controller::migrate(a),
        Cmd::Scale(a) => cmd_controller::scale(a),
        Cmd::Policy(a) => cmd_controller::policy(a),
        Cmd::Ha(a) => cmd_controller::ha(a),
        Cmd::Agent(a) => cmd_agent::run(a),
        Cmd::Hub(a) => cmd_hub::run(a),
        Cmd::Keys(a) => cmd_keys::run(a),
        Cmd::Smr(a) => cmd_smr::run(a),
        Cmd::Slice(a) => cmd_slice::run(a),
    };
    if let Err(e) = res {
        eprintln!("pliant: error: {e}");
        std::process::exit(1);
    }
}
