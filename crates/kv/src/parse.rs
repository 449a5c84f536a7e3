//! Parsers of what redis-server answers: `INFO` text and `CLUSTER NODES` lines. Pure, so the
//! monitor and the move executor read the same fields the same way.

use std::collections::BTreeMap;

/// `INFO` output as `field → value` (section headers and blank lines dropped).
pub fn info(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A numeric `INFO` field.
pub fn info_u64(info: &BTreeMap<String, String>, field: &str) -> Option<u64> {
    info.get(field)?.parse().ok()
}

/// Commands that are not the database's work: the monitor's own `INFO`, replication and
/// cluster traffic, connection set-up. Left out of a partition's ops/s.
const ADMIN_COMMANDS: &[&str] = &[
    "info",
    "ping",
    "replconf",
    "psync",
    "sync",
    "auth",
    "hello",
    "select",
    "wait",
    "readonly",
    "readwrite",
    "quit",
    "echo",
];

/// Calls of data commands in `INFO commandstats` (`cmdstat_set:calls=3,...`); subcommands of
/// admin containers (`cluster|nodes`, `config|get`, `client|setname`, `command|docs`) are admin.
pub fn data_calls(info: &BTreeMap<String, String>) -> u64 {
    info.iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("cmdstat_")?, v)))
        .filter(|(cmd, _)| {
            let base = cmd.split('|').next().unwrap_or(cmd);
            !ADMIN_COMMANDS.contains(cmd)
                && ![
                    "cluster", "config", "client", "command", "memory", "latency",
                ]
                .contains(&base)
        })
        .filter_map(|(_, v)| {
            v.split(',')
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

/// Replicas a master's `INFO replication` lists as `online` (`slaveN:ip=..,state=online,..`):
/// connected and past the initial sync.
pub fn online_replicas(info: &BTreeMap<String, String>) -> usize {
    info.iter()
        .filter(|(k, _)| {
            k.strip_prefix("slave")
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        })
        .filter(|(_, v)| v.split(',').any(|kv| kv == "state=online"))
        .count()
}

/// One line of `CLUSTER NODES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLine {
    pub id: String,
    pub ip: String,
    pub port: u16,
    pub flags: Vec<String>,
    /// The master's id for a replica; `None` for a master.
    pub master: Option<String>,
    /// `connected` or `disconnected`.
    pub connected: bool,
    /// Slot ranges served (masters), inclusive.
    pub slots: Vec<(u16, u16)>,
}

impl NodeLine {
    pub fn has_flag(&self, f: &str) -> bool {
        self.flags.iter().any(|x| x == f)
    }
    pub fn is_master(&self) -> bool {
        self.has_flag("master")
    }
    /// Not suspected or marked failed, and its links are up.
    pub fn healthy(&self) -> bool {
        self.connected && !self.has_flag("fail") && !self.has_flag("fail?")
    }
}

/// Parses `CLUSTER NODES` (`<id> <ip:port@cport[,hostname]> <flags> <master|-> <ping> <pong>
/// <epoch> <link> <slot>...`). Slot migration markers (`[...]`) are skipped: pliant never
/// migrates slots, partitions move by replication.
pub fn cluster_nodes(text: &str) -> Result<Vec<NodeLine>, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return Err(format!(
                    "CLUSTER NODES line with {} fields: {line}",
                    f.len()
                ));
            }
            let addr = f[1].split(['@', ',']).next().unwrap_or("");
            let (ip, port) = addr
                .rsplit_once(':')
                .ok_or_else(|| format!("CLUSTER NODES address {:?}", f[1]))?;
            let port = port
                .parse()
                .map_err(|_| format!("CLUSTER NODES port in {:?}", f[1]))?;
            let mut slots = Vec::new();
            for s in f[8..].iter().filter(|s| !s.starts_with('[')) {
                let (a, b) = s.split_once('-').unwrap_or((s, s));
                let parse = |x: &str| {
                    x.parse::<u16>()
                        .map_err(|_| format!("CLUSTER NODES slot {s:?}"))
                };
                slots.push((parse(a)?, parse(b)?));
            }
            Ok(NodeLine {
                id: f[0].to_string(),
                ip: ip.to_string(),
                port,
                flags: f[2].split(',').map(str::to_string).collect(),
                master: (f[3] != "-").then(|| f[3].to_string()),
                connected: f[7] == "connected",
                slots,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO_SAMPLE: &str = "# Replication\r\nrole:slave\r\nmaster_host:10.214.3.11\r\n\
        master_link_status:up\r\nslave_repl_offset:4242\r\n\r\n# Commandstats\r\n\
        cmdstat_set:calls=10,usec=50,usec_per_call=5.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_get:calls=5,usec=5,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_info:calls=99,usec=5,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_cluster|nodes:calls=7,usec=5,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n\
        cmdstat_wait:calls=10,usec=5,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n";

    #[test]
    fn info_fields_and_data_calls() {
        let i = info(INFO_SAMPLE);
        assert_eq!(i["role"], "slave");
        assert_eq!(i["master_link_status"], "up");
        assert_eq!(info_u64(&i, "slave_repl_offset"), Some(4242));
        assert_eq!(info_u64(&i, "role"), None);
        // set + get only: INFO, CLUSTER NODES and WAIT are not the database's work.
        assert_eq!(data_calls(&i), 15);
    }

    #[test]
    fn online_replicas_of_a_master() {
        let i = info(
            "# Replication\r\nrole:master\r\nconnected_slaves:3\r\n\
             slave0:ip=10.214.3.12,port=7001,state=online,offset=98,lag=0\r\n\
             slave1:ip=10.214.3.13,port=7001,state=wait_bgsave,offset=0,lag=0\r\n\
             slave2:ip=10.214.3.14,port=7001,state=online,offset=90,lag=1\r\n\
             slave_read_repl_offset:1\r\nmaster_repl_offset:98\r\n",
        );
        assert_eq!(online_replicas(&i), 2);
        assert_eq!(
            online_replicas(&info("role:master\r\nconnected_slaves:0\r\n")),
            0
        );
    }

    #[test]
    fn cluster_nodes_lines() {
        let text = "\
07c37dfeb235213a872192d90877d0cd55635b91 10.214.3.12:7001@17001 myself,slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 10.214.3.11:7001@17001,h1 master - 0 1426238316232 1 connected 0-5460 6000 [5461->-abc]
aaaa 10.214.3.13:7002@17002 master,fail? - 0 0 2 disconnected
";
        let n = cluster_nodes(text).unwrap();
        assert_eq!(n.len(), 3);
        assert!(!n[0].is_master() && n[0].has_flag("myself"));
        assert_eq!(
            n[0].master.as_deref(),
            Some("e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca")
        );
        assert_eq!((n[1].ip.as_str(), n[1].port), ("10.214.3.11", 7001));
        assert_eq!(n[1].slots, vec![(0, 5460), (6000, 6000)]);
        assert!(n[1].healthy() && n[1].master.is_none());
        assert!(!n[2].healthy());
        assert!(cluster_nodes("abc 1.2.3.4:1@2 master").is_err());
        assert!(cluster_nodes("a 1.2.3.4:x@2 master - 0 0 1 connected").is_err());
    }
}
