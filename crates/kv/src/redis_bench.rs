//! `redis-benchmark` (Debian's, in cluster mode) against the cluster: the workload people
//! measure a Redis deployment with, next to pliant's own writers and the TPC-C-like mix.
//!
//! redis-benchmark takes a password only on its command line (`-a`), where any local user can
//! read it. So it never gets the cluster's password: for the run, every node gets a temporary
//! ACL user without a password (`nopass`) that may run only the benchmark's data commands on
//! the benchmark's own key names (`key:*`, `counter:*`, `my*`: see [`ACL_RULES`]) and
//! `CLUSTER NODES`/`SLOTS` to find the masters — no `CONFIG`, no `KEYS`, no other key. The user
//! is deleted from every node when the run ends, failed or not. Nothing listens outside the
//! cluster's namespaces, so only a process in the lab's fabric could use the user meanwhile.
//! A node a move starts during the run does not have the user: run it on a cluster at rest.

use crate::cluster::Kv;
use crate::node;
use serde::Serialize;
use std::process::Command;
use std::time::Duration;

/// What the temporary user may do: the commands of redis-benchmark's tests on the key names
/// they use (`key:{tag}:N`, `counter:{tag}:N`, `mylist:{tag}`, `myset:{tag}`, ...), and the
/// cluster topology.
pub const ACL_RULES: &[&str] = &[
    "on",
    "nopass",
    "resetkeys",
    "~key:*",
    "~counter:*",
    "~my*",
    "resetchannels",
    "-@all",
    "+ping",
    "+cluster|nodes",
    "+cluster|slots",
    "+set",
    "+get",
    "+incr",
    "+lpush",
    "+rpush",
    "+lpop",
    "+rpop",
    "+sadd",
    "+hset",
    "+spop",
    "+zadd",
    "+zpopmin",
    "+lrange",
    "+mset",
    "+xadd",
];

/// The tests redis-benchmark may be asked for here (those [`ACL_RULES`] allow).
pub const TESTS: &[&str] = &[
    "ping_inline",
    "ping_mbulk",
    "set",
    "get",
    "incr",
    "lpush",
    "rpush",
    "lpop",
    "rpop",
    "sadd",
    "hset",
    "spop",
    "zadd",
    "zpopmin",
    "lrange",
    "lrange_100",
    "lrange_300",
    "lrange_500",
    "lrange_600",
    "mset",
    "xadd",
];

#[derive(Clone, Debug)]
pub struct Opts {
    /// Requests per test.
    pub requests: u64,
    pub clients: u32,
    /// Requests per round trip (`-P`).
    pub pipeline: u32,
    /// Comma-separated, from [`TESTS`].
    pub tests: String,
    /// Random keys from this many (`-r`).
    pub keyspace: u64,
    /// The run is killed after this long.
    pub timeout: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            requests: 100_000,
            clients: 50,
            pipeline: 1,
            tests: "set,get".into(),
            keyspace: 100_000,
            timeout: Duration::from_secs(300),
        }
    }
}

/// One test's line of redis-benchmark's `--csv` output.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Row {
    pub test: String,
    pub rps: f64,
    pub avg_ms: f64,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Checks `o` before anything touches the cluster; errors name the option.
pub fn validate(o: &Opts) -> Result<(), String> {
    if o.requests == 0 || o.clients == 0 || o.pipeline == 0 || o.keyspace == 0 {
        return Err("--requests, --clients, --pipeline and --keyspace must be at least 1".into());
    }
    if o.clients > 10_000 {
        return Err(format!("--clients {}: at most 10000", o.clients));
    }
    for t in o.tests.split(',') {
        if !TESTS.contains(&t.trim().to_ascii_lowercase().as_str()) {
            return Err(format!("--tests: {t:?} is not one of {}", TESTS.join(", ")));
        }
    }
    Ok(())
}

/// Parses redis-benchmark's `--csv` output: a header line, then one quoted line per test (in
/// cluster mode after a list of the masters, which is skipped: not quoted).
pub fn parse_csv(text: &str) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| l.starts_with('"')) {
        let f: Vec<&str> = line.split(',').map(|x| x.trim_matches('"')).collect();
        if f.first() == Some(&"test") {
            continue;
        }
        if f.len() != 8 {
            return Err(format!("redis-benchmark: unexpected line {line:?}"));
        }
        let n = |i: usize| {
            f[i].parse::<f64>()
                .map_err(|_| format!("redis-benchmark: {:?} in {line:?} is not a number", f[i]))
        };
        rows.push(Row {
            test: f[0].to_string(),
            rps: n(1)?,
            avg_ms: n(2)?,
            min_ms: n(3)?,
            p50_ms: n(4)?,
            p95_ms: n(5)?,
            p99_ms: n(6)?,
            max_ms: n(7)?,
        });
    }
    if rows.is_empty() {
        return Err("redis-benchmark printed no result".into());
    }
    Ok(rows)
}

/// Deletes the temporary user from every node, whatever happened to the run.
struct UserGuard<'a> {
    kv: &'a Kv,
    name: String,
}

impl Drop for UserGuard<'_> {
    fn drop(&mut self) {
        for n in &self.kv.state.nodes {
            if let Ok(mut c) = self.kv.connect(n) {
                let _ = node::query_str(&mut c, &["ACL", "DELUSER", &self.name]);
            }
        }
    }
}

/// The temporary user's name: unique per run, so two runs never share or delete each other's.
fn user_name() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("pliant-bench-{}-{}", std::process::id(), t.subsec_nanos())
}

/// Runs `f` with a temporary user (named by its argument) that [`ACL_RULES`] allow on every
/// node; the user is deleted from every node afterwards, whatever `f` did.
pub fn with_user<T>(kv: &Kv, f: impl FnOnce(&str) -> Result<T, String>) -> Result<T, String> {
    let guard = UserGuard {
        kv,
        name: user_name(),
    };
    for n in &kv.state.nodes {
        let mut args = vec!["ACL", "SETUSER", guard.name.as_str()];
        args.extend_from_slice(ACL_RULES);
        node::query_str(&mut kv.connect(n)?, &args)?;
    }
    f(&guard.name)
}

/// Runs redis-benchmark in cluster mode against `kv` (the calling thread in the fabric
/// namespace, as for every admin connection) and returns its result per test.
pub fn run(kv: &Kv, o: &Opts) -> Result<Vec<Row>, String> {
    validate(o)?;
    let first = kv.state.nodes.first().ok_or("the cluster has no nodes")?;
    with_user(kv, |user| {
        let mut cmd = Command::new("redis-benchmark");
        cmd.args(["--cluster", "-h"])
            .arg(kv.state.host_ip(first.host).to_string())
            .arg("-p")
            .arg(first.port.to_string())
            // `--user` needs `-a`; a user without a password accepts any: this is no secret.
            .args(["--user", user, "-a", "nopass"])
            .arg("-n")
            .arg(o.requests.to_string())
            .arg("-c")
            .arg(o.clients.to_string())
            .arg("-P")
            .arg(o.pipeline.to_string())
            .arg("-r")
            .arg(o.keyspace.to_string())
            .args(["-t", &o.tests, "--csv"]);
        let run = pliant_lab::cmd::run_command(cmd, o.timeout).map_err(|e| e.to_string())?;
        let (out, err) = (run.stdout, run.stderr);
        if run.code != Some(0) {
            let status = run.code.map_or("a signal".into(), |c| format!("exit {c}"));
            let tail: Vec<&str> = err.lines().chain(out.lines()).rev().take(4).collect();
            return Err(format!(
                "redis-benchmark failed ({status}): {}",
                tail.join(" | ")
            ));
        }
        parse_csv(&out).map_err(|e| {
            format!(
                "{e}; stderr: {}",
                err.lines().take(4).collect::<Vec<_>>().join(" | ")
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_parse_and_bad_lines_are_errors() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                   \"SET\",\"41322.31\",\"1.112\",\"0.208\",\"1.031\",\"1.759\",\"2.375\",\"6.919\"\n\
                   \"GET\",\"45045.04\",\"1.019\",\"0.160\",\"0.959\",\"1.559\",\"2.087\",\"4.247\"\n";
        let out = format!("Cluster has 2 master nodes:\n\nMaster 0: 0123\n10.0.0.1:7000\n\n{out}");
        let rows = parse_csv(&out).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].test, "SET");
        assert_eq!(rows[1].rps, 45045.04);
        assert_eq!(rows[1].p99_ms, 2.087);
        assert!(parse_csv("").is_err());
        assert!(parse_csv("Cluster has 2 master nodes:").is_err());
        assert!(parse_csv("\"SET\",\"x\",\"1\",\"1\",\"1\",\"1\",\"1\",\"1\"").is_err());
        assert!(parse_csv("\"SET\",\"1\"").is_err());
    }

    #[test]
    fn options_are_checked_before_the_run() {
        assert!(validate(&Opts::default()).is_ok());
        let bad_test = Opts {
            tests: "set,flushall".into(),
            ..Opts::default()
        };
        assert!(validate(&bad_test).unwrap_err().contains("flushall"));
        let zero = Opts {
            clients: 0,
            ..Opts::default()
        };
        assert!(validate(&zero).is_err());
    }
}
