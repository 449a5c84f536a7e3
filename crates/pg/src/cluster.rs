//! A PostgreSQL 15 primary/standby pair in network namespaces of this host.
//!
//! Topology: one bridge in the root namespace (`pgbr<tag>`, 10.213.N.1/24, where the proxy
//! listens) and one namespace per server (`pg1-<tag>`, `pg2-<tag>`, 10.213.N.11 and .12) on a
//! veth each. Servers reach each other over the bridge (no forwarding needed). Cutting a
//! server's link = setting its host-side veth down. Everything is removed on drop.
//!
//! Per-server settings (address, socket directory, primary_conninfo) are given on the
//! postgres command line because pg_basebackup and pg_rewind copy the configuration files.

use crate::client::Client;
use crate::proxy::ClusterOps;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/postgresql/15/bin";
pub const PG_PORT: u16 = 5432;

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub user: String,
    pub password: String,
    /// fsync off makes kill trials fast; a process kill never loses the page cache, so the
    /// guarantees tested (no acked commit lost on primary death) are unaffected.
    pub fsync: bool,
    pub shared_buffers_mb: u32,
    /// Directory for data; a unique subdirectory is created in it.
    pub base: PathBuf,
    /// `max_connections` of both servers.
    pub max_connections: u32,
    /// Servers with `ssl = on` and `hostssl`-only network access (plaintext logins over the
    /// network refused); see [`Cluster::set_tls`] for certificates that name the nodes.
    pub tls: Option<ClusterTls>,
}

/// Certificate and key the servers present, and the CA that signed it (what clients,
/// including this crate's own, verify against).
#[derive(Clone, Debug)]
pub struct ClusterTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            user: "pliant".into(),
            password: "pliant-pw".into(),
            fsync: false,
            shared_buffers_mb: 64,
            base: PathBuf::from("/tmp"),
            max_connections: 120,
            tls: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub ns: String,
    pub ip: Ipv4Addr,
    pub host_veth: String,
    pub data: PathBuf,
    pub sock: PathBuf,
    pub log: PathBuf,
}

impl Node {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip, PG_PORT))
    }
}

pub struct Cluster {
    pub cfg: ClusterConfig,
    pub tag: String,
    pub dir: PathBuf,
    pub bridge: String,
    pub host_ip: Ipv4Addr,
    pub nodes: [Node; 2],
    children: Mutex<Vec<(usize, Child)>>,
    reprotect_lock: Mutex<()>,
    created_links: Mutex<bool>,
    /// Extra namespaces on the bridge (name, host-side veth), e.g. etcd for the Patroni peer.
    aux: Mutex<Vec<(String, String)>>,
    torn_down: std::sync::atomic::AtomicBool,
    /// This crate's clients (`client`) verify the servers with it when TLS is on.
    tls_client: Option<crate::tls::TlsClient>,
}

fn sh(cmd: &mut Command) -> Result<String, String> {
    sh_stdin(cmd, None)
}

/// Runs `cmd` to its end and returns its stdout; `input` goes to its stdin (for secrets,
/// which must stay off its command line).
fn sh_stdin(cmd: &mut Command, input: Option<&[u8]>) -> Result<String, String> {
    use std::io::Write;
    let (out, fed) = match input {
        None => (cmd.output(), true),
        Some(input) => {
            let mut child = cmd
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("{cmd:?}: {e}"))?;
            let fed = child.stdin.take().map(|mut i| i.write_all(input));
            (child.wait_with_output(), matches!(fed, Some(Ok(()))))
        }
    };
    let out = out.map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() || !fed {
        return Err(format!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<String, String> {
    sh(Command::new("ip").args(args))
}

/// A random byte (names and subnets of a new cluster); an error rather than a constant that
/// would make every cluster pick the same names.
fn rand_byte() -> Result<u8, String> {
    crate::secrets::random_bytes::<1>()
        .map(|[b]| b)
        .map_err(|e| e.to_string())
}

/// uid and gid of the postgres user.
pub fn postgres_ids() -> Result<(u32, u32), String> {
    let u = sh(Command::new("id").args(["-u", "postgres"]))?;
    let g = sh(Command::new("id").args(["-g", "postgres"]))?;
    Ok((
        u.trim().parse().map_err(|_| "bad uid")?,
        g.trim().parse().map_err(|_| "bad gid")?,
    ))
}

impl Cluster {
    /// Creates the namespaces and links (no servers yet).
    pub fn create(cfg: ClusterConfig) -> Result<Cluster, String> {
        let tag = format!("{:04x}{:02x}", std::process::id() & 0xffff, rand_byte()?);
        let addrs = ip(&["-4", "-o", "addr"])?;
        let mut n = 0u8;
        for _ in 0..64 {
            let cand = rand_byte()?.max(1);
            if cand < 255 && !addrs.contains(&format!("10.213.{cand}.")) {
                n = cand;
                break;
            }
        }
        if n == 0 {
            return Err("no free 10.213.N.0/24 subnet".into());
        }
        let c = Cluster::layout(cfg, tag, n);
        std::fs::create_dir_all(&c.dir).map_err(|e| format!("mkdir {}: {e}", c.dir.display()))?;
        // The servers' own libpq connections (pg_basebackup, pg_rewind, the walreceiver) and
        // the tools find the password here, never on a command line.
        crate::secrets::write_private_owned(
            &c.passfile(),
            crate::secrets::pgpass_line(&c.cfg.user, &c.cfg.password).as_bytes(),
            Some(postgres_ids()?),
        )?;
        c.setup_net()?;
        let mut c = c;
        if let Some(t) = c.cfg.tls.clone() {
            c.set_tls(t)?;
        }
        Ok(c)
    }

    /// Names, addresses and paths of a cluster with `tag` on subnet 10.213.`n`.0/24 (nothing
    /// is created).
    fn layout(cfg: ClusterConfig, tag: String, n: u8) -> Cluster {
        let dir = cfg.base.join(format!("pliant-pg-{tag}"));
        let mk = |i: usize| Node {
            name: format!("pg{}", i + 1),
            ns: format!("pg{}-{tag}", i + 1),
            ip: Ipv4Addr::new(10, 213, n, 11 + i as u8),
            host_veth: format!("pgv{}{tag}", i + 1),
            data: dir.join(format!("pg{}", i + 1)),
            sock: dir.join(format!("sock{}", i + 1)),
            log: dir.join(format!("pg{}.log", i + 1)),
        };
        Cluster {
            bridge: format!("pgbr{tag}"),
            host_ip: Ipv4Addr::new(10, 213, n, 1),
            nodes: [mk(0), mk(1)],
            dir,
            tag,
            cfg,
            children: Mutex::new(Vec::new()),
            reprotect_lock: Mutex::new(()),
            created_links: Mutex::new(true),
            aux: Mutex::new(Vec::new()),
            torn_down: std::sync::atomic::AtomicBool::new(false),
            tls_client: None,
        }
    }

    /// libpq password file (0600, owned by postgres) for the servers and tools.
    pub fn passfile(&self) -> PathBuf {
        self.dir.join("pgpass")
    }

    /// Addresses a certificate for this cluster must name: the bridge (where the proxy
    /// listens) and both servers.
    /// The client side of the servers' TLS ([`Cluster::set_tls`]), for clients of the cluster
    /// and of a proxy in front of it (the demo certificate names both).
    pub fn tls_client(&self) -> Option<&crate::tls::TlsClient> {
        self.tls_client.as_ref()
    }

    pub fn addresses(&self) -> Vec<std::net::IpAddr> {
        let mut v = vec![self.host_ip.into()];
        v.extend(self.nodes.iter().map(|n| std::net::IpAddr::from(n.ip)));
        v
    }

    /// Switches the servers to TLS (before `init_primary`): the certificate and key are
    /// copied into `<dir>/tls`, owned by postgres, 0600 (PostgreSQL refuses a key others
    /// can read).
    pub fn set_tls(&mut self, t: ClusterTls) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let (uid, gid) = postgres_ids()?;
        let d = self.dir.join("tls");
        std::fs::create_dir_all(&d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(&d, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        let cert = std::fs::read(&t.cert).map_err(|e| format!("{}: {e}", t.cert.display()))?;
        let key = std::fs::read(&t.key).map_err(|e| format!("{}: {e}", t.key.display()))?;
        let (c, k) = (d.join("server.crt"), d.join("server.key"));
        crate::secrets::write_private_owned(&c, &cert, Some((uid, gid)))?;
        crate::secrets::write_private_owned(&k, &key, Some((uid, gid)))?;
        self.tls_client = Some(crate::tls::TlsClient::load(&t.ca, None)?);
        self.cfg.tls = Some(ClusterTls {
            cert: c,
            key: k,
            ca: t.ca,
        });
        Ok(())
    }

    fn setup_net(&self) -> Result<(), String> {
        ip(&["link", "add", &self.bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", self.host_ip),
            "dev",
            &self.bridge,
        ])?;
        ip(&["link", "set", &self.bridge, "up"])?;
        for nd in &self.nodes {
            ip(&["netns", "add", &nd.ns])?;
            let inner = format!("{}n", nd.host_veth);
            ip(&[
                "link",
                "add",
                &nd.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                &inner,
                "netns",
                &nd.ns,
            ])?;
            ip(&["link", "set", &nd.host_veth, "master", &self.bridge, "up"])?;
            ip(&[
                "-n",
                &nd.ns,
                "addr",
                "add",
                &format!("{}/24", nd.ip),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &nd.ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &nd.ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// A further namespace `pgx<n>-<tag>` on the bridge with address 10.213.N.`octet`;
    /// removed (and its processes killed) by `teardown`.
    pub fn add_aux_namespace(&self, n: u8, octet: u8) -> Result<(String, Ipv4Addr), String> {
        let ns = format!("pgx{n}-{}", self.tag);
        let veth = format!("pgx{n}{}", self.tag);
        let addr = Ipv4Addr::new(10, 213, self.host_ip.octets()[2], octet);
        if let Ok(mut g) = self.aux.lock() {
            g.push((ns.clone(), veth.clone()));
        }
        ip(&["netns", "add", &ns])?;
        let inner = format!("{veth}n");
        ip(&[
            "link", "add", &veth, "type", "veth", "peer", "name", &inner, "netns", &ns,
        ])?;
        ip(&["link", "set", &veth, "master", &self.bridge, "up"])?;
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            &inner,
        ])?;
        ip(&["-n", &ns, "link", "set", &inner, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok((ns, addr))
    }

    /// `prog` in namespace `ns`, as the postgres user when `as_postgres` (PostgreSQL and
    /// Patroni refuse to run as root).
    pub fn command_in(&self, ns: &str, prog: &str, as_postgres: bool) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]);
        if as_postgres {
            c.args([
                "setpriv",
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
            ]);
        }
        c.arg(prog);
        c
    }

    fn in_ns(&self, i: usize, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            &self.nodes[i].ns,
            "setpriv",
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
        ]);
        c.arg(prog);
        // Not PGPASSWORD: a Command's Debug output (in this module's errors) shows its
        // environment.
        c.env("PGPASSFILE", self.passfile());
        // libpq (pg_basebackup, pg_rewind, the walreceiver) looks for a client certificate
        // under $HOME, root's here, which postgres may not read: none is used.
        let none = self.dir.join("no-client-certificate");
        c.env("PGSSLCERT", &none).env("PGSSLKEY", &none);
        c
    }

    /// With fsync off, the servers do not make their files durable either, so the tools
    /// skip their final sync of the data directory (seconds on this machine's disks).
    fn no_sync(&self) -> &'static [&'static str] {
        if self.cfg.fsync {
            &[]
        } else {
            &["--no-sync"]
        }
    }

    /// Empty data and socket directories of node `i`, owned by postgres, and an empty log.
    pub fn prep_dirs(&self, i: usize) -> Result<(), String> {
        if self.torn_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("cluster torn down".into());
        }
        let (uid, gid) = postgres_ids()?;
        let nd = &self.nodes[i];
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        for d in [&nd.data, &nd.sock] {
            let _ = std::fs::remove_dir_all(d);
            std::fs::create_dir_all(d).map_err(|e| format!("mkdir {}: {e}", d.display()))?;
            std::os::unix::fs::chown(d, Some(uid), Some(gid))
                .map_err(|e| format!("chown {}: {e}", d.display()))?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| e.to_string())?;
        }
        std::fs::write(&nd.log, b"").map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(&nd.log, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// initdb + start node 0 as the primary (no standby yet: unprotected).
    pub fn init_primary(&self) -> Result<(), String> {
        self.prep_dirs(0)?;
        let nd = &self.nodes[0];
        sh(self
            .in_ns(0, &format!("{BIN}/initdb"))
            .args([
                "-D",
                &nd.data.to_string_lossy(),
                "-U",
                &self.cfg.user,
                "--auth-local=trust",
                "--auth-host=md5",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .args(self.no_sync())
            .stdout(Stdio::null()))?;
        let conf = format!(
            "\n# pliant\nwal_level = replica\nmax_wal_senders = 6\nwal_log_hints = on\nwal_keep_size = '64MB'\nmin_wal_size = '32MB'\n\
             hot_standby = on\nsynchronous_commit = on\nfsync = {}\nshared_buffers = '{}MB'\nmax_connections = {}\n\
             password_encryption = md5\nwal_receiver_status_interval = '1s'\nwal_sender_timeout = '5s'\n\
             wal_receiver_timeout = '5s'\nwal_retrieve_retry_interval = '200ms'\nlogging_collector = off\n\
             log_min_messages = warning\nlog_min_error_statement = panic\n",
            if self.cfg.fsync { "on" } else { "off" },
            self.cfg.shared_buffers_mb,
            self.cfg.max_connections
        );
        append(&nd.data.join("postgresql.conf"), &conf)?;
        let net = format!("10.213.{}.0/24", self.host_ip.octets()[2]);
        append(
            &nd.data.join("pg_hba.conf"),
            &if self.cfg.tls.is_some() {
                format!("hostssl all all {net} md5\nhostssl replication all {net} md5\n")
            } else {
                format!("host all all {net} md5\nhost replication all {net} md5\n")
            },
        )?;
        self.start(0, None)?;
        // Set the password (stored as md5) over the local socket, once it accepts connections.
        let t0 = Instant::now();
        loop {
            let r = sh(self.in_ns(0, &format!("{BIN}/pg_isready")).args([
                "-h",
                &nd.sock.to_string_lossy(),
                "-q",
            ]));
            if r.is_ok() {
                break;
            }
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "{} did not start; log {}",
                    nd.name,
                    nd.log.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(30));
        }
        let (mut cmd, sql) = self.set_password_command();
        sh_stdin(&mut cmd, Some(sql.as_bytes()))?;
        self.wait_ready(0, false)
    }

    /// psql on the primary's socket setting the password, and the SQL to feed it on stdin
    /// (on its command line the password would be readable by every local user).
    fn set_password_command(&self) -> (Command, String) {
        let mut cmd = self.in_ns(0, &format!("{BIN}/psql"));
        cmd.args(["-h", &self.nodes[0].sock.to_string_lossy()])
            .args([
                "-U",
                &self.cfg.user,
                "-d",
                "postgres",
                "-qAt",
                "-v",
                "ON_ERROR_STOP=1",
            ]);
        let sql = format!(
            "ALTER USER \"{}\" PASSWORD '{}';\n",
            self.cfg.user.replace('"', "\"\""),
            self.cfg.password.replace('\'', "''")
        );
        (cmd, sql)
    }

    /// Starts the server of node `i`; `primary` = the node to stream from when a standby.
    pub fn start(&self, i: usize, primary: Option<usize>) -> Result<(), String> {
        let nd = &self.nodes[i];
        let mut cmd = self.server_command(i, primary);
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&nd.log)
            .map_err(|e| e.to_string())?;
        let log2 = log.try_clone().map_err(|e| e.to_string())?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| format!("start {}: {e}", nd.name))?;
        if let Ok(mut g) = self.children.lock() {
            g.push((i, child));
        }
        Ok(())
    }

    /// The command starting node `i`'s server (see [`Cluster::start`]).
    fn server_command(&self, i: usize, primary: Option<usize>) -> Command {
        let nd = &self.nodes[i];
        let mut cmd = self.in_ns(i, &format!("{BIN}/postgres"));
        cmd.args(["-D", &nd.data.to_string_lossy()]);
        for (k, v) in [
            ("listen_addresses", nd.ip.to_string()),
            ("port", PG_PORT.to_string()),
            (
                "unix_socket_directories",
                nd.sock.to_string_lossy().into_owned(),
            ),
            ("cluster_name", nd.name.clone()),
        ] {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        if let Some(t) = &self.cfg.tls {
            cmd.args(["-c", "ssl=on", "-c"])
                .arg(format!("ssl_cert_file={}", t.cert.display()))
                .arg("-c")
                .arg(format!("ssl_key_file={}", t.key.display()));
        }
        if let Some(p) = primary {
            // The walreceiver reads the password from the passfile: the server's command
            // line is world-readable.
            cmd.arg("-c").arg(format!(
                "primary_conninfo=host={} port={PG_PORT} user={} passfile='{}' application_name={}",
                self.nodes[p].ip,
                self.cfg.user,
                self.passfile().display(),
                nd.name
            ));
        }
        cmd
    }

    pub fn client(&self, i: usize, timeout: Duration) -> Result<Client, String> {
        Client::dial(&crate::client::Dial {
            addr: self.nodes[i].addr(),
            user: &self.cfg.user,
            password: &self.cfg.password,
            database: "postgres",
            connect_timeout: timeout,
            timeout,
            tls: self.tls_client.as_ref(),
        })
        .map_err(|e| format!("{}: {e}", self.nodes[i].name))
    }

    /// Waits until node `i` accepts connections in the expected role.
    pub fn wait_ready(&self, i: usize, standby: bool) -> Result<(), String> {
        let t0 = Instant::now();
        let mut last = String::new();
        while t0.elapsed() < Duration::from_secs(60) {
            match self.client(i, Duration::from_secs(2)).and_then(|mut c| {
                c.scalar("SELECT pg_is_in_recovery()")
                    .map_err(|e| e.to_string())
            }) {
                Ok(Some(r)) if (r == "t") == standby => return Ok(()),
                Ok(r) => last = format!("recovery={r:?}"),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "{} not ready: {last}; log {}",
            self.nodes[i].name,
            self.nodes[i].log.display()
        ))
    }

    /// pg_basebackup node `i` from `primary` and start it as a hot standby.
    pub fn add_standby(&self, i: usize, primary: usize) -> Result<(), String> {
        self.prep_dirs(i)?;
        let nd = &self.nodes[i];
        sh(self
            .in_ns(i, &format!("{BIN}/pg_basebackup"))
            .args([
                "-h",
                &self.nodes[primary].ip.to_string(),
                "-U",
                &self.cfg.user,
                "-D",
                &nd.data.to_string_lossy(),
                "-X",
                "stream",
                "-c",
                "fast",
            ])
            .args(self.no_sync()))?;
        self.make_standby(i, primary)
    }

    fn make_standby(&self, i: usize, primary: usize) -> Result<(), String> {
        let nd = &self.nodes[i];
        std::fs::write(nd.data.join("standby.signal"), b"").map_err(|e| e.to_string())?;
        let (uid, gid) = postgres_ids()?;
        let _ = std::os::unix::fs::chown(nd.data.join("standby.signal"), Some(uid), Some(gid));
        self.start(i, Some(primary))?;
        self.wait_ready(i, true)
    }

    /// Turns on commit protection on `primary` and waits until node `standby` streams as sync.
    pub fn protect(&self, primary: usize, standby: usize) -> Result<(), String> {
        let mut c = self.client(primary, Duration::from_secs(5))?;
        // Let the standby catch up asynchronously first: turned on earlier, every commit would
        // wait for the whole catch-up.
        let t0 = Instant::now();
        let caught_up = format!(
            "SELECT count(*) > 0 FROM pg_stat_replication WHERE application_name = '{}' AND state = 'streaming' \
             AND pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn) < 1048576",
            self.nodes[standby].name
        );
        while c.scalar(&caught_up).map_err(|e| e.to_string())?.as_deref() != Some("t") {
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(format!("{} did not catch up", self.nodes[standby].name));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        c.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
            .map_err(|e| e.to_string())?;
        c.query("SELECT pg_reload_conf()")
            .map_err(|e| e.to_string())?;
        let q = format!(
            "SELECT count(*) > 0 FROM pg_stat_replication WHERE application_name = '{}' AND state = 'streaming' AND sync_state = 'sync'",
            self.nodes[standby].name
        );
        while t0.elapsed() < Duration::from_secs(60) {
            if c.scalar(&q).map_err(|e| e.to_string())?.as_deref() == Some("t") {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "{} did not become a sync standby",
            self.nodes[standby].name
        ))
    }

    /// Turns commit protection off (the standby keeps streaming asynchronously).
    pub fn unprotect(&self, primary: usize) -> Result<(), String> {
        let mut c = self.client(primary, Duration::from_secs(5))?;
        c.query("ALTER SYSTEM SET synchronous_standby_names = ''")
            .map_err(|e| e.to_string())?;
        c.query("SELECT pg_reload_conf()")
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Failure injection for tests and benchmarks: SIGKILL node `i` and/or cut its link, as
    /// one step with respect to re-protection (which could otherwise restore the link between
    /// the kill and the cut).
    pub fn inject_failure(&self, i: usize, kill: bool, cut: bool) -> Result<(), String> {
        let _g = self.reprotect_lock.lock().map_err(|_| "lock poisoned")?;
        if kill {
            self.signal_all(i);
        }
        if cut {
            self.set_link(i, false)?;
        }
        // Reaping is left to `rejoin` (processes blocked in I/O die late; cut, they are inert).
        Ok(())
    }

    /// SIGSTOPs node `i`'s postmaster and SIGKILLs every other process of the node: the
    /// listening port stays open (the kernel accepts, nobody answers) while every backend is
    /// gone — what a postmaster that is slow to die (stuck in uninterruptible I/O when its
    /// SIGKILL came) looks like from outside.
    pub fn orphan_port(&self, i: usize) -> Result<(), String> {
        let f = self.nodes[i].data.join("postmaster.pid");
        let pm: i32 = std::fs::read_to_string(&f)
            .map_err(|e| format!("{}: {e}", f.display()))?
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .ok_or_else(|| format!("{}: no PID", f.display()))?;
        // SAFETY: plain syscalls on PIDs of processes of our own node.
        unsafe { libc::kill(pm, libc::SIGSTOP) };
        let pids = ip(&["netns", "pids", &self.nodes[i].ns]).unwrap_or_default();
        for p in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            if p != pm {
                // SAFETY: as above.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        Ok(())
    }

    /// SIGKILL every process of node `i` once, without waiting.
    pub fn signal_all(&self, i: usize) {
        self.signal_each(i, libc::SIGKILL);
    }

    /// SIGSTOP (`paused`) or SIGCONT every process of node `i`: a server that is alive but
    /// answers nothing (its kernel still completes TCP handshakes), as under extreme load.
    pub fn pause(&self, i: usize, paused: bool) {
        self.signal_each(i, if paused { libc::SIGSTOP } else { libc::SIGCONT });
    }

    /// Signals every process of node `i`, again for processes that appear meanwhile: a
    /// backend the postmaster forks between the listing and its own kill is a process of the
    /// node too (missed, it lives on as an orphan still holding the listening socket, and the
    /// node looks busy instead of dead). Rounds until one finds nothing new (at most 5).
    fn signal_each(&self, i: usize, sig: libc::c_int) {
        let mut done = std::collections::BTreeSet::new();
        for round in 0..5 {
            let pids = ip(&["netns", "pids", &self.nodes[i].ns]).unwrap_or_default();
            let new: Vec<i32> = pids
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .filter(|p| !done.contains(p))
                .collect();
            if new.is_empty() && round > 0 {
                break;
            }
            for p in new {
                // SAFETY: plain syscall on a PID of a process in our own namespace.
                unsafe { libc::kill(p, sig) };
                done.insert(p);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// SIGKILL every process of node `i` (all of them are servers this cluster started).
    pub fn kill(&self, i: usize) {
        for _ in 0..3 {
            let pids = ip(&["netns", "pids", &self.nodes[i].ns]).unwrap_or_default();
            let pids: Vec<i32> = pids
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                // SAFETY: plain syscall on a PID of a process in our own namespace.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Ok(mut g) = self.children.lock() {
            for (_, ch) in g.iter_mut().filter(|(n, _)| *n == i) {
                let _ = ch.wait();
            }
            g.retain(|(n, _)| *n != i);
        }
    }

    pub fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        ip(&[
            "link",
            "set",
            &self.nodes[i].host_veth,
            if up { "up" } else { "down" },
        ])
        .map(|_| ())
    }

    /// Stops node `i` cleanly (SIGTERM = smart... use fast shutdown: SIGINT).
    pub fn stop(&self, i: usize) {
        if let Ok(mut g) = self.children.lock() {
            for (_, ch) in g.iter_mut().filter(|(n, _)| *n == i) {
                // SAFETY: signal to a child we spawned.
                unsafe { libc::kill(ch.id() as i32, libc::SIGINT) };
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_secs(10) {
                    if let Ok(Some(_)) = ch.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        self.kill(i);
    }

    /// pg_rewind of `old` from `primary`; the password comes from the passfile.
    fn rewind_command(&self, old: usize, primary: usize) -> Command {
        let src = format!(
            "host={} port={PG_PORT} user={} dbname=postgres",
            self.nodes[primary].ip, self.cfg.user
        );
        let mut c = self.in_ns(old, &format!("{BIN}/pg_rewind"));
        c.args(["-D", &self.nodes[old].data.to_string_lossy()])
            .args(["--source-server", &src])
            .args(self.no_sync());
        c
    }

    /// Old primary `old` rejoins as synchronous standby of `primary` via pg_rewind.
    pub fn rejoin(&self, old: usize, primary: usize) -> Result<Duration, String> {
        let _g = self.reprotect_lock.lock().map_err(|_| "lock poisoned")?;
        let t0 = Instant::now();
        self.kill(old);
        self.set_link(old, true)?;
        let nd = &self.nodes[old];
        let _ = std::fs::remove_file(nd.data.join("postmaster.pid"));
        // pg_rewind reads the source's timeline from its control file, which a promotion
        // updates only at the next checkpoint: without this it may wrongly see no divergence.
        self.client(primary, Duration::from_secs(10))?
            .query("CHECKPOINT")
            .map_err(|e| format!("checkpoint: {e}"))?;
        let t_ckpt = t0.elapsed();
        // pg_rewind runs single-user crash recovery first when the target was killed.
        let rw = sh(&mut self.rewind_command(old, primary));
        let t_rw = t0.elapsed();
        append(
            &self.dir.join("rewind.log"),
            &format!(
                "rewind {} from {} checkpoint done at {t_ckpt:?}, rewind done at {:?}: {:?}\n",
                nd.name,
                self.nodes[primary].name,
                t_rw,
                rw.as_ref().map(|_| ())
            ),
        )?;
        if self.torn_down.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("cluster torn down".into());
        }
        if let Err(e) = rw {
            // Fall back to a full copy (e.g. the WAL needed for rewinding is gone).
            append(
                &self.dir.join("rewind.log"),
                &format!("pg_rewind failed, full copy: {e}\n"),
            )?;
            self.add_standby(old, primary)?;
        } else {
            let _ = std::fs::remove_file(nd.data.join("postmaster.pid"));
            self.make_standby(old, primary)?;
        }
        let t_up = t0.elapsed();
        self.protect(primary, old)?;
        append(
            &self.dir.join("rewind.log"),
            &format!("standby up at {t_up:?}, sync at {:?}\n", t0.elapsed()),
        )?;
        Ok(t0.elapsed())
    }

    /// A lost standby `sb` returns as the synchronous standby of `primary`: restarted on its
    /// own data (crash recovery, then streaming catches it up) when it was a standby, via
    /// `rejoin` (pg_rewind) when it had been a primary, and by a full copy when it cannot
    /// catch up (its WAL is gone from the primary).
    pub fn restore_standby(&self, sb: usize, primary: usize) -> Result<Duration, String> {
        let t0 = Instant::now();
        let nd = &self.nodes[sb];
        if !nd.data.join("standby.signal").exists() {
            return self.rejoin(sb, primary);
        }
        {
            let _g = self.reprotect_lock.lock().map_err(|_| "lock poisoned")?;
            if self.torn_down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err("cluster torn down".into());
            }
            self.kill(sb);
            self.set_link(sb, true)?;
            // A WAL sender of the dead standby may still look "streaming" (until
            // wal_sender_timeout): end it so that the sync standby is the live one.
            if let Ok(mut c) = self.client(primary, Duration::from_secs(5)) {
                let _ = c.query(&format!(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_replication WHERE application_name = '{}'",
                    nd.name
                ));
            }
            let _ = std::fs::remove_file(nd.data.join("postmaster.pid"));
            self.start(sb, Some(primary))?;
        }
        let restarted = self
            .wait_ready(sb, true)
            .and_then(|_| self.protect(primary, sb));
        if let Err(e) = restarted {
            append(
                &self.dir.join("rewind.log"),
                &format!("restart of standby {} failed, full copy: {e}\n", nd.name),
            )?;
            // protect() may have named a synchronous standby already: commits must not wait
            // for the copy.
            let _ = self.unprotect(primary);
            let _g = self.reprotect_lock.lock().map_err(|_| "lock poisoned")?;
            self.kill(sb);
            self.add_standby(sb, primary)?;
            self.protect(primary, sb)?;
        }
        append(
            &self.dir.join("rewind.log"),
            &format!("standby {} restored in {:?}\n", nd.name, t0.elapsed()),
        )?;
        Ok(t0.elapsed())
    }

    /// Replication lag of the standby in bytes, seen from `primary`.
    pub fn lag_bytes(&self, primary: usize) -> Option<i64> {
        let mut c = self.client(primary, Duration::from_millis(500)).ok()?;
        c.scalar("SELECT coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)), 0)::bigint FROM pg_stat_replication")
            .ok()
            .flatten()
            .and_then(|s| s.parse().ok())
    }

    pub fn teardown(&self) {
        self.torn_down
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for i in 0..2 {
            self.kill(i);
        }
        let aux = self.aux.lock().map(|g| g.clone()).unwrap_or_default();
        for (ns, _) in &aux {
            for _ in 0..3 {
                let pids = ip(&["netns", "pids", ns]).unwrap_or_default();
                if pids.trim().is_empty() {
                    break;
                }
                for p in pids
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: plain syscall on a PID of a process in our own namespace.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if let Ok(mut g) = self.created_links.lock() {
            if *g {
                for nd in &self.nodes {
                    let _ = ip(&["link", "del", &nd.host_veth]);
                    let _ = ip(&["netns", "del", &nd.ns]);
                }
                for (ns, veth) in &aux {
                    let _ = ip(&["link", "del", veth]);
                    let _ = ip(&["netns", "del", ns]);
                }
                let _ = ip(&["link", "del", &self.bridge]);
                *g = false;
            }
        }
        if std::env::var_os("PLIANT_PG_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

impl ClusterOps for Cluster {
    fn fence(&self, i: usize) {
        // Cut first (nothing it still sends can reach anyone), then kill without waiting:
        // processes blocked in fsync die only when their I/O completes, and once cut they
        // cannot reach anyone anyway. `rejoin` waits for them.
        let _ = self.set_link(i, false);
        self.signal_all(i);
    }
    fn reprotect(&self, old: usize, primary: usize) -> Result<(), String> {
        self.rejoin(old, primary).map(|_| ())
    }
    fn restore_standby(&self, standby: usize, primary: usize) -> Result<(), String> {
        Cluster::restore_standby(self, standby, primary).map(|_| ())
    }
}

fn append(p: &Path, s: &str) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    f.write_all(s.as_bytes()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PW: &str = "s3cret-pw-in-test";

    /// A cluster's layout only: nothing is created, and nothing is torn down on drop.
    fn layout(tls: bool) -> std::mem::ManuallyDrop<Cluster> {
        let cfg = ClusterConfig {
            password: PW.into(),
            tls: tls.then(|| ClusterTls {
                cert: "/x/server.crt".into(),
                key: "/x/server.key".into(),
                ca: "/x/ca.crt".into(),
            }),
            ..Default::default()
        };
        std::mem::ManuallyDrop::new(Cluster::layout(cfg, "t0".into(), 7))
    }

    /// Arguments and environment of `c`, with the environment as `NAME=value`.
    fn exposed(c: &Command) -> Vec<String> {
        let mut v: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        v.extend(c.get_envs().map(|(k, val)| {
            format!(
                "{}={}",
                k.to_string_lossy(),
                val.map(|x| x.to_string_lossy().into_owned())
                    .unwrap_or_default()
            )
        }));
        v.push(format!("{c:?}"));
        v
    }

    #[test]
    fn no_password_on_command_lines_or_in_their_environment() {
        for tls in [false, true] {
            let c = layout(tls);
            let (set_pw, sql) = c.set_password_command();
            let cmds = [
                c.server_command(0, None),
                c.server_command(1, Some(0)),
                c.rewind_command(0, 1),
                set_pw,
                c.in_ns(1, "pg_basebackup"),
            ];
            for cmd in &cmds {
                for a in exposed(cmd) {
                    assert!(!a.contains(PW), "password exposed in {a:?}");
                }
                let env: Vec<_> = exposed(cmd);
                let want = format!("PGPASSFILE={}", c.passfile().display());
                assert!(env.contains(&want), "{cmd:?} lacks {want}");
            }
            // The password goes to psql on stdin instead.
            assert!(sql.contains(PW) && sql.starts_with("ALTER USER \"pliant\" PASSWORD"));
            // The standby's walreceiver is pointed at the passfile.
            let standby = exposed(&c.server_command(1, Some(0)));
            let conninfo = standby
                .iter()
                .find(|a| a.starts_with("primary_conninfo="))
                .expect("primary_conninfo");
            assert!(conninfo.contains(&format!("passfile='{}'", c.passfile().display())));
        }
    }

    #[test]
    fn set_password_sql_quotes_the_password() {
        let mut c = layout(false);
        c.cfg.password = "it's".into();
        assert!(c.set_password_command().1.contains("PASSWORD 'it''s'"));
    }
}
