//! TLS with rustls (ring provider), both directions of the proxy.
//!
//! - [`TlsServer`]: the proxy's certificate and key; [`accept`] runs the server side of a
//!   handshake after the proxy answered an SSLRequest with `S`.
//! - [`TlsClient`]: the CA the servers' certificates must chain to; [`connect`] sends an
//!   SSLRequest and runs the client side (certificate checked against the server's IP
//!   address, or a configured name, in its subject alternative names).
//! - [`Stream`]: a plain or TLS connection behind one `Read`/`Write`, plus what the proxy's
//!   poll loop needs (the socket's fd, whether decrypted bytes wait in a buffer, a read that
//!   touches the socket at most once).
//! - [`end_point_hash`]: the `tls-server-end-point` channel binding data (RFC 5929) of a
//!   certificate, for SCRAM-SHA-256-PLUS.
//! - [`make_demo_pki`]: a private CA and one server certificate (rcgen) for `pliant pg up
//!   --tls` and the tests; keys written 0600.
//!
//! Handshakes have one deadline for the whole exchange, so a client trickling bytes cannot
//! hold a login thread longer than the startup timeout.

use crate::proto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig};
use rustls::{ServerConnection, SupportedProtocolVersion};
use sha2::Digest;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// TLS 1.2 and 1.3 (libpq's default minimum is 1.2).
const VERSIONS: &[&SupportedProtocolVersion] = &[&rustls::version::TLS13, &rustls::version::TLS12];

/// Refuses a private key file that others than its owner could read.
fn check_key_file(key: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(key).map_err(|e| format!("TLS key {}: {e}", key.display()))?;
    if m.mode() & 0o077 != 0 {
        return Err(format!(
            "TLS key {} is readable by group or others (mode {:o}); chmod 600 it",
            key.display(),
            m.mode() & 0o777
        ));
    }
    Ok(())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem =
        std::fs::read(path).map_err(|e| format!("TLS certificate {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("TLS certificate {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "TLS certificate {}: no certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

/// The proxy's side towards its clients: certificate chain, key, channel binding data.
#[derive(Clone)]
pub struct TlsServer {
    config: Arc<ServerConfig>,
    /// `tls-server-end-point` data of the proxy's certificate; None when its signature
    /// hash is not one RFC 5929 defines it for (then SCRAM-SHA-256-PLUS is not offered).
    pub end_point: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer").finish_non_exhaustive()
    }
}

impl TlsServer {
    /// Loads a PEM certificate chain (the proxy's certificate first) and its PEM key.
    pub fn load(cert: &Path, key: &Path) -> Result<TlsServer, String> {
        let certs = read_certs(cert)?;
        check_key_file(key)?;
        let pem = std::fs::read(key).map_err(|e| format!("TLS key {}: {e}", key.display()))?;
        let k = PrivateKeyDer::from_pem_slice(&pem)
            .map_err(|e| format!("TLS key {}: {e}", key.display()))?;
        let end_point = end_point_hash(&certs[0]);
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(certs, k)
            .map_err(|e| {
                format!(
                    "TLS certificate {} / key {}: {e}",
                    cert.display(),
                    key.display()
                )
            })?;
        Ok(TlsServer {
            config: Arc::new(config),
            end_point,
        })
    }
}

/// The proxy's (or a client's) side towards PostgreSQL servers.
#[derive(Clone)]
pub struct TlsClient {
    config: Arc<ClientConfig>,
    /// Name to verify instead of the server's IP address.
    name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// Trusts the PEM CA certificates in `ca`; `name` (a DNS name or IP address) is checked
    /// against the server certificate instead of the address connected to.
    pub fn load(ca: &Path, name: Option<&str>) -> Result<TlsClient, String> {
        let mut roots = RootCertStore::empty();
        for c in read_certs(ca)? {
            roots
                .add(c)
                .map_err(|e| format!("TLS CA {}: {e}", ca.display()))?;
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(VERSIONS)
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = name
            .map(|n| {
                ServerName::try_from(n.to_string())
                    .map_err(|e| format!("TLS server name {n:?}: {e}"))
            })
            .transpose()?;
        Ok(TlsClient {
            config: Arc::new(config),
            name,
        })
    }
}

/// Why a handshake failed.
#[derive(Debug)]
pub enum HandshakeError {
    /// The deadline passed.
    Timeout,
    /// The peer closed the connection.
    Closed,
    /// Not TLS, a failed certificate check, no common parameters, ...
    Tls(String),
    Io(io::Error),
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeError::Timeout => write!(f, "TLS handshake timed out"),
            HandshakeError::Closed => write!(f, "connection closed during the TLS handshake"),
            HandshakeError::Tls(e) => write!(f, "TLS handshake failed: {e}"),
            HandshakeError::Io(e) => write!(f, "TLS handshake: {e}"),
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Drives a handshake to its end; every socket read waits at most until `deadline`.
fn handshake(
    conn: &mut Connection,
    sock: &mut TcpStream,
    deadline: Instant,
) -> Result<(), HandshakeError> {
    let old = sock.read_timeout().ok().flatten();
    let r = (|| {
        loop {
            while conn.wants_write() {
                conn.write_tls(sock).map_err(HandshakeError::Io)?;
            }
            if !conn.is_handshaking() {
                return Ok(());
            }
            let left = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| *d >= Duration::from_millis(1))
                .ok_or(HandshakeError::Timeout)?;
            sock.set_read_timeout(Some(left))
                .map_err(HandshakeError::Io)?;
            match conn.read_tls(sock) {
                Ok(0) => return Err(HandshakeError::Closed),
                Ok(_) => {}
                Err(e) if is_timeout(&e) => return Err(HandshakeError::Timeout),
                Err(e) => return Err(HandshakeError::Io(e)),
            }
            if let Err(e) = conn.process_new_packets() {
                // Tell the peer why (an alert), best effort.
                let _ = conn.write_tls(sock);
                return Err(HandshakeError::Tls(e.to_string()));
            }
        }
    })();
    let _ = sock.set_read_timeout(old);
    r
}

/// Server side, after `S` was sent in answer to an SSLRequest.
pub fn accept(
    mut sock: TcpStream,
    tls: &TlsServer,
    deadline: Instant,
) -> Result<Stream, HandshakeError> {
    let conn = ServerConnection::new(tls.config.clone())
        .map_err(|e| HandshakeError::Tls(e.to_string()))?;
    let mut conn = Connection::Server(conn);
    handshake(&mut conn, &mut sock, deadline)?;
    Ok(Stream::Tls(Box::new(Tls { conn, sock })))
}

/// Client side: SSLRequest, then the handshake; the server's certificate must chain to the
/// configured CA and name `peer` (or the configured name).
pub fn connect(
    mut sock: TcpStream,
    tls: &TlsClient,
    peer: IpAddr,
    deadline: Instant,
) -> Result<Stream, HandshakeError> {
    let mut req = 8u32.to_be_bytes().to_vec();
    req.extend(proto::SSL_REQUEST.to_be_bytes());
    sock.write_all(&req).map_err(HandshakeError::Io)?;
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| *d >= Duration::from_millis(1))
        .ok_or(HandshakeError::Timeout)?;
    let old = sock.read_timeout().ok().flatten();
    sock.set_read_timeout(Some(left))
        .map_err(HandshakeError::Io)?;
    let mut b = [0u8; 1];
    let got = sock.read(&mut b);
    let _ = sock.set_read_timeout(old);
    match got {
        Ok(1) if b[0] == b'S' => {}
        Ok(1) if b[0] == b'N' => {
            return Err(HandshakeError::Tls(
                "the server does not accept TLS (answered N to SSLRequest)".into(),
            ))
        }
        Ok(1) => {
            return Err(HandshakeError::Tls(format!(
                "unexpected answer {:?} to SSLRequest",
                b[0] as char
            )))
        }
        Ok(_) => return Err(HandshakeError::Closed),
        Err(e) if is_timeout(&e) => return Err(HandshakeError::Timeout),
        Err(e) => return Err(HandshakeError::Io(e)),
    }
    let name = tls
        .name
        .clone()
        .unwrap_or_else(|| ServerName::IpAddress(peer.into()));
    let conn = ClientConnection::new(tls.config.clone(), name)
        .map_err(|e| HandshakeError::Tls(e.to_string()))?;
    let mut conn = Connection::Client(conn);
    handshake(&mut conn, &mut sock, deadline)?;
    Ok(Stream::Tls(Box::new(Tls { conn, sock })))
}

/// One end of an established TLS connection.
pub struct Tls {
    conn: Connection,
    sock: TcpStream,
}

impl Tls {
    fn flush_tls(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.sock)?;
        }
        Ok(())
    }

    /// One socket read, decrypted; returns what the socket read gave (0 = EOF).
    fn fill(&mut self) -> io::Result<usize> {
        let n = self.conn.read_tls(&mut self.sock)?;
        match self.conn.process_new_packets() {
            Ok(_) => {
                self.flush_tls()?;
                Ok(n)
            }
            Err(e) => {
                let _ = self.flush_tls();
                Err(io::Error::new(io::ErrorKind::InvalidData, e))
            }
        }
    }

    fn plaintext(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        match self.conn.reader().read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            r => Some(r),
        }
    }
}

impl Read for Tls {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(r) = self.plaintext(buf) {
                return r;
            }
            // After EOF the reader answers Ok(0) (close_notify) or UnexpectedEof.
            self.fill()?;
        }
    }
}

impl Write for Tls {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.conn.writer().write(buf)?;
        self.flush_tls()?;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.conn.writer().flush()?;
        self.flush_tls()
    }
}

/// A client or server connection, plain or TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<Tls>),
}

impl Stream {
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => &t.sock,
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp().set_read_timeout(t)
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.tcp().set_write_timeout(t)
    }

    /// Ends the connection (a TLS close_notify first).
    pub fn shutdown(&mut self) {
        if let Stream::Tls(t) = self {
            t.conn.send_close_notify();
            let _ = t.flush_tls();
        }
        let _ = self.tcp().shutdown(Shutdown::Both);
    }

    /// For a poll loop: reads at most once from the socket (call it when the socket is
    /// readable or [`Stream::buffered`] says so). `Err(WouldBlock)`: what arrived did not
    /// complete a TLS record yet.
    pub fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(t) => {
                if let Some(r) = t.plaintext(buf) {
                    return r;
                }
                t.fill()?;
                t.plaintext(buf)
                    .unwrap_or_else(|| Err(io::ErrorKind::WouldBlock.into()))
            }
        }
    }

    /// Switches the socket between blocking (login, failover: sequential steps with
    /// timeouts) and non-blocking (the relay's event loops).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp().set_nonblocking(on)
    }

    /// Non-blocking write for the relay: a plain socket writes what it takes now (`Ok(0)`
    /// never: a full socket is `WouldBlock`); TLS encrypts into the connection's own buffer
    /// (possibly 0 bytes when that is full) and sends nothing yet: [`Stream::flush_nb`] does.
    pub fn write_nb(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => match s.write(buf) {
                Ok(0) if !buf.is_empty() => Err(io::ErrorKind::WriteZero.into()),
                r => r,
            },
            Stream::Tls(t) => t.conn.writer().write(buf),
        }
    }

    /// Sends TLS records already encrypted, without blocking: `Ok(true)` when none is left.
    /// Plain sockets keep nothing back.
    pub fn flush_nb(&mut self) -> io::Result<bool> {
        let Stream::Tls(t) = self else {
            return Ok(true);
        };
        while t.conn.wants_write() {
            match t.conn.write_tls(&mut t.sock) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// TLS records wait to be sent (the socket was full).
    pub fn wants_write(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(t) => t.conn.wants_write(),
        }
    }

    /// Decrypted bytes are waiting that the socket's readiness would not announce.
    pub fn buffered(&mut self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(t) => t
                .conn
                .process_new_packets()
                .map(|s| s.plaintext_bytes_to_read() > 0)
                .unwrap_or(false),
        }
    }

    /// `tls-server-end-point` data of the peer's certificate (a client's view of its server).
    pub fn peer_end_point(&self) -> Option<Vec<u8>> {
        match self {
            Stream::Tls(t) => t
                .conn
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(end_point_hash),
            Stream::Plain(_) => None,
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        self.tcp().as_raw_fd()
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(t) => t.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(t) => t.flush(),
        }
    }
}

/// One DER element at the start of `b`: (tag, contents, rest).
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&l0, b) = b.split_first()?;
    let (len, b) = if l0 < 0x80 {
        (l0 as usize, b)
    } else {
        let n = (l0 & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |a, x| (a << 8) | *x as usize);
        (len, &b[n..])
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

/// Hash of the certificate's signature algorithm, as RFC 5929 `tls-server-end-point` uses
/// it (MD5 and SHA-1 are replaced by SHA-256).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndPointHash {
    Sha256,
    Sha384,
    Sha512,
}

/// The hash `tls-server-end-point` uses for this DER certificate; None for signature
/// algorithms without a single hash (Ed25519, RSA-PSS) or an unreadable certificate.
pub fn end_point_hash_alg(cert: &[u8]) -> Option<EndPointHash> {
    let (0x30, cert, _) = der(cert)? else {
        return None;
    };
    let (0x30, _tbs, rest) = der(cert)? else {
        return None;
    };
    let (0x30, alg, _) = der(rest)? else {
        return None;
    };
    let (0x06, oid, _) = der(alg)? else {
        return None;
    };
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04];
    match oid {
        // md5WithRSA, sha1WithRSA, sha256WithRSA / 384 / 512
        [p @ .., 4 | 5 | 11] if p == RSA => Some(EndPointHash::Sha256),
        [p @ .., 12] if p == RSA => Some(EndPointHash::Sha384),
        [p @ .., 13] if p == RSA => Some(EndPointHash::Sha512),
        // ecdsa-with-SHA1, ecdsa-with-SHA256 / 384 / 512
        [p @ .., 1] if p == ECDSA => Some(EndPointHash::Sha256),
        [p @ .., 3, 2] if p == ECDSA => Some(EndPointHash::Sha256),
        [p @ .., 3, 3] if p == ECDSA => Some(EndPointHash::Sha384),
        [p @ .., 3, 4] if p == ECDSA => Some(EndPointHash::Sha512),
        _ => None,
    }
}

/// `tls-server-end-point` channel binding data of a DER certificate.
pub fn end_point_hash(cert: &CertificateDer<'_>) -> Option<Vec<u8>> {
    let der = cert.as_ref();
    Some(match end_point_hash_alg(der)? {
        EndPointHash::Sha256 => sha2::Sha256::digest(der).to_vec(),
        EndPointHash::Sha384 => sha2::Sha384::digest(der).to_vec(),
        EndPointHash::Sha512 => sha2::Sha512::digest(der).to_vec(),
    })
}

/// Files of a demo PKI.
#[derive(Clone, Debug)]
pub struct DemoPki {
    /// The CA certificate (what clients pass as `sslrootcert`).
    pub ca: PathBuf,
    /// Server certificate (signed by the CA) and its key (0600).
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub use crate::secrets::write_private;

/// A private CA (its key is never written: nothing else gets signed) and a server
/// certificate for `ips` and `localhost`, ECDSA P-256 with SHA-256, in `dir` (created 0700):
/// `ca.crt`, `server.crt`, `server.key`.
pub fn make_demo_pki(dir: &Path, ips: &[IpAddr]) -> Result<DemoPki, String> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    use std::os::unix::fs::DirBuilderExt;
    let err = |e: rcgen::Error| format!("certificate generation: {e}");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.distinguished_name = rcgen::DistinguishedName::new();
    // A name of its own: a verifier finding another demo CA must not take it for this one.
    let tag: String = crate::scram::new_nonce()
        .map_err(|e| e.to_string())?
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    ca.distinguished_name
        .push(DnType::CommonName, format!("pliant pg demo CA {tag}"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).map_err(err)?;
    let mut names: Vec<String> = ips.iter().map(|i| i.to_string()).collect();
    names.push("localhost".into());
    let mut sp = CertificateParams::new(names).map_err(err)?;
    sp.distinguished_name = rcgen::DistinguishedName::new();
    sp.distinguished_name
        .push(DnType::CommonName, "pliant pg server");
    sp.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    sp.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().map_err(err)?;
    let cert = sp.signed_by(&key, &ca_cert, &ca_key).map_err(err)?;
    let pki = DemoPki {
        ca: dir.join("ca.crt"),
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
    };
    std::fs::write(&pki.ca, ca_cert.pem()).map_err(|e| format!("{}: {e}", pki.ca.display()))?;
    std::fs::write(&pki.cert, cert.pem()).map_err(|e| format!("{}: {e}", pki.cert.display()))?;
    write_private(&pki.key, key.serialize_pem().as_bytes())?;
    Ok(pki)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with(alg: &'static rcgen::SignatureAlgorithm) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate_for(alg).expect("key");
        let p = rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        p.self_signed(&key).expect("cert").der().clone()
    }

    #[test]
    fn end_point_hash_follows_the_certificate_signature_algorithm() {
        let c256 = cert_with(&rcgen::PKCS_ECDSA_P256_SHA256);
        assert_eq!(end_point_hash_alg(&c256), Some(EndPointHash::Sha256));
        assert_eq!(
            end_point_hash(&c256),
            Some(sha2::Sha256::digest(c256.as_ref()).to_vec())
        );
        let c384 = cert_with(&rcgen::PKCS_ECDSA_P384_SHA384);
        assert_eq!(end_point_hash_alg(&c384), Some(EndPointHash::Sha384));
        assert_eq!(end_point_hash(&c384).map(|h| h.len()), Some(48));
        // Ed25519 has no separate hash: no tls-server-end-point (PostgreSQL refuses it too).
        let ed = cert_with(&rcgen::PKCS_ED25519);
        assert_eq!(end_point_hash_alg(&ed), None);
        assert_eq!(end_point_hash_alg(b"\x30\x03\x02\x01\x01"), None);
        assert_eq!(end_point_hash_alg(&[]), None);
        // RSA with SHA-256 (OID 1.2.840.113549.1.1.11), a hand-built skeleton.
        let oid = [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b];
        let mut alg = vec![0x30, (oid.len() + 2) as u8, 0x06, oid.len() as u8];
        alg.extend(oid);
        let mut body = vec![0x30, 0x00];
        body.extend(&alg);
        body.extend([0x03, 0x01, 0x00]);
        let mut cert = vec![0x30, body.len() as u8];
        cert.extend(body);
        assert_eq!(end_point_hash_alg(&cert), Some(EndPointHash::Sha256));
    }

    #[test]
    fn demo_pki_key_is_private_and_a_world_readable_key_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("pliant-pg-pki-{}", std::process::id()));
        let p = make_demo_pki(&d, &["127.0.0.1".parse().unwrap()]).expect("pki");
        let mode = |f: &Path| std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&p.key), 0o600);
        assert_eq!(mode(&d), 0o700);
        TlsServer::load(&p.cert, &p.key).expect("loads");
        std::fs::set_permissions(&p.key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = TlsServer::load(&p.cert, &p.key).unwrap_err();
        assert!(e.contains("readable by group or others"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
