//! A real etcd server for labs and tests (Debian's `etcd-server`), one member, started like the
//! lab's other servers: optionally inside a namespace, its data directory and log under the
//! caller's directory, stopped (by PID) when dropped.
//!
//! It can be killed and restarted on the same data directory, which is how tests take etcd away
//! under load and bring it back with its history.

use crate::cmd;
use crate::error::{io_err, LabError, Result};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The binary Debian's `etcd-server` installs.
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// How long a start may take before it is an error (first start creates the WAL: ~1 s here).
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// An X.509 PKI for one etcd: a CA, etcd's server certificate (for its addresses) and one
/// client certificate (for the controllers), ECDSA P-256; keys mode 0600 from creation.
#[derive(Clone, Debug, PartialEq)]
pub struct EtcdPki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl EtcdPki {
    /// Issues the PKI into `dir` (created 0700) for a server reached at `ips`. The CA's key is
    /// never written: nothing else can be signed by it later.
    pub fn issue(dir: &Path, ips: &[IpAddr]) -> Result<EtcdPki> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
            KeyUsagePurpose, SanType,
        };
        use std::os::unix::fs::DirBuilderExt;
        let err = |e: rcgen::Error| LabError::Config(format!("etcd certificates: {e}"));
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err(dir))?;
        let ca_key = KeyPair::generate().map_err(err)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        ca.distinguished_name = rcgen::DistinguishedName::new();
        ca.distinguished_name.push(
            DnType::CommonName,
            format!("pliant etcd CA {}", dir.display()),
        );
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).map_err(err)?;
        let leaf = |cn: &str, sans: Vec<SanType>, usage: ExtendedKeyUsagePurpose| {
            let mut p = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
            p.distinguished_name = rcgen::DistinguishedName::new();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.subject_alt_names = sans;
            p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            p.extended_key_usages = vec![usage];
            let key = KeyPair::generate().map_err(err)?;
            let cert = p.signed_by(&key, &ca_cert, &ca_key).map_err(err)?;
            Ok::<_, LabError>((cert.pem(), key.serialize_pem()))
        };
        let mut sans: Vec<SanType> = ips.iter().map(|i| SanType::IpAddress(*i)).collect();
        sans.push(SanType::DnsName("localhost".try_into().map_err(err)?));
        let (server_pem, server_key) = leaf("etcd", sans, ExtendedKeyUsagePurpose::ServerAuth)?;
        let (client_pem, client_key) = leaf(
            "pliant controller",
            vec![],
            ExtendedKeyUsagePurpose::ClientAuth,
        )?;
        let pki = EtcdPki {
            ca: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
        };
        write_file(&pki.ca, ca_cert.pem().as_bytes(), false)?;
        write_file(&pki.server_cert, server_pem.as_bytes(), false)?;
        write_file(&pki.server_key, server_key.as_bytes(), true)?;
        write_file(&pki.client_cert, client_pem.as_bytes(), false)?;
        write_file(&pki.client_key, client_key.as_bytes(), true)?;
        Ok(pki)
    }
}

/// Writes a new file, mode 0600 from creation if `private` (a key is never briefly readable).
fn write_file(path: &Path, bytes: &[u8], private: bool) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))
}

/// Where and how to run one etcd member.
#[derive(Clone, Debug)]
pub struct EtcdSpec {
    /// Directory for the data dir (`<dir>/data`) and the log (`<dir>/etcd.log`).
    pub dir: PathBuf,
    /// Network namespace to run in (`None`: the caller's).
    pub netns: Option<String>,
    /// Address the client and peer listeners bind.
    pub addr: IpAddr,
    pub client_port: u16,
    pub peer_port: u16,
    /// Mutual TLS on the client port (`--client-cert-auth`: only clients the PKI's CA signed).
    pub tls: Option<EtcdPki>,
    /// Raft ticks of 25 ms (election 250 ms) instead of 100 ms (1 s): etcd then grants leases
    /// of 1 s (its least TTL is 1.5 election timeouts' worth of ticks, 2 s by default), so a
    /// standby controller takes over within about a second of a silent leader's last renewal.
    /// For one member, whose elections never wait on a peer.
    pub fast_leases: bool,
}

impl EtcdSpec {
    /// On loopback in the caller's namespace, on two ports free right now (tests).
    pub fn loopback(dir: &Path) -> Result<EtcdSpec> {
        Ok(EtcdSpec {
            dir: dir.to_path_buf(),
            netns: None,
            addr: IpAddr::from([127, 0, 0, 1]),
            client_port: free_port()?,
            peer_port: free_port()?,
            tls: None,
            fast_leases: false,
        })
    }

    pub fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!(
            "{scheme}://{}",
            SocketAddr::new(self.addr, self.client_port)
        )
    }

    fn peer_url(&self) -> String {
        format!("http://{}", SocketAddr::new(self.addr, self.peer_port))
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io_err("127.0.0.1:0"))?;
    Ok(l.local_addr().map_err(io_err("127.0.0.1:0"))?.port())
}

/// A running etcd member (killed when dropped).
pub struct EtcdServer {
    pub spec: EtcdSpec,
    child: Option<Child>,
    /// Remove `spec.dir` when dropped (a scratch server of a test).
    scratch: bool,
}

impl EtcdServer {
    /// Starts etcd and waits until it answers a health check.
    pub fn start(spec: EtcdSpec) -> Result<EtcdServer> {
        std::fs::create_dir_all(spec.dir.join("data")).map_err(io_err(&spec.dir))?;
        let mut s = EtcdServer {
            spec,
            child: None,
            scratch: false,
        };
        s.restart()?;
        Ok(s)
    }

    /// A throwaway member on loopback for a test: its directory under the temp dir, named by
    /// `tag` and the PID, removed with the server.
    pub fn scratch(tag: &str) -> Result<EtcdServer> {
        EtcdServer::scratch_with(tag, false)
    }

    /// [`EtcdServer::scratch`] serving mutual TLS (the PKI under its directory, `pki/`).
    pub fn scratch_tls(tag: &str) -> Result<EtcdServer> {
        EtcdServer::scratch_with(tag, true)
    }

    fn scratch_with(tag: &str, tls: bool) -> Result<EtcdServer> {
        let dir = std::env::temp_dir().join(format!("pliant-etcd-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut spec = EtcdSpec::loopback(&dir)?;
        if tls {
            spec.tls = Some(EtcdPki::issue(&dir.join("pki"), &[spec.addr])?);
        }
        let mut s = EtcdServer::start(spec)?;
        s.scratch = true;
        Ok(s)
    }

    /// Leaves the member running past this handle (a lab's etcd, stopped by the lab's
    /// teardown by PID); returns its process, for the caller to reap.
    pub fn detach(mut self) -> Option<Child> {
        self.scratch = false;
        self.child.take()
    }

    /// PID of the running member, if any.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILLs the member (what a crash or a lost host does to it); the data stays.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the member again on its data directory (a no-op if it runs) and waits until it is
    /// healthy.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let s = &self.spec;
        let data = s.dir.join("data");
        let log_path = s.dir.join("etcd.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let log2 = log.try_clone().map_err(io_err(&log_path))?;
        let (client, peer) = (s.client_url(), s.peer_url());
        let data_s = data.to_string_lossy().to_string();
        let initial = format!("p1={peer}");
        let tls_args: Vec<String> = match &s.tls {
            Some(p) => vec![
                "--cert-file".into(),
                p.server_cert.display().to_string(),
                "--key-file".into(),
                p.server_key.display().to_string(),
                "--trusted-ca-file".into(),
                p.ca.display().to_string(),
                "--client-cert-auth".into(),
            ],
            None => Vec::new(),
        };
        let mut args: Vec<&str> = vec![
            ETCD_BIN,
            "--name",
            "p1",
            "--data-dir",
            &data_s,
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &initial,
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn",
            "--logger",
            "zap",
        ];
        args.extend(tls_args.iter().map(String::as_str));
        if s.fast_leases {
            args.extend(["--heartbeat-interval", "25", "--election-timeout", "250"]);
        }
        let argv = match &s.netns {
            Some(ns) => cmd::in_ns(ns, &args),
            None => args.iter().map(|a| a.to_string()).collect(),
        };
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|source| LabError::Spawn {
                cmd: cmd::render(&argv),
                source,
            })?;
        self.child = Some(child);
        self.wait_healthy(START_TIMEOUT)
    }

    /// Waits until `etcdctl endpoint health` succeeds (a quorum read, not just an open port).
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        let url = self.spec.client_url();
        let mut last;
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    return Err(LabError::NotReady {
                        what: "etcd".into(),
                        waited_ms: t0.elapsed().as_millis() as u64,
                        detail: format!("exited ({st}); see {}", self.log().display()),
                    });
                }
            }
            let tls: Vec<String> = match &self.spec.tls {
                Some(p) => vec![
                    format!("--cacert={}", p.ca.display()),
                    format!("--cert={}", p.client_cert.display()),
                    format!("--key={}", p.client_key.display()),
                ],
                None => Vec::new(),
            };
            let mut args = vec![
                "etcdctl",
                "--endpoints",
                url.as_str(),
                "--dial-timeout",
                "1s",
                "--command-timeout",
                "1s",
            ];
            args.extend(tls.iter().map(String::as_str));
            args.extend(["endpoint", "health"]);
            let argv = match &self.spec.netns {
                Some(ns) => cmd::in_ns(ns, &args),
                None => args.iter().map(|a| a.to_string()).collect(),
            };
            match cmd::run(&argv, Duration::from_secs(5)) {
                Ok(o) if o.success() => return Ok(()),
                Ok(o) => last = o.stderr.trim().chars().take(200).collect(),
                Err(e) => last = e.to_string(),
            }
            if t0.elapsed() > timeout {
                return Err(LabError::NotReady {
                    what: "etcd".into(),
                    waited_ms: t0.elapsed().as_millis() as u64,
                    detail: last,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> PathBuf {
        self.spec.dir.join("etcd.log")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        if self.scratch {
            let _ = std::fs::remove_dir_all(&self.spec.dir);
        }
    }
}
