//! A minimal blocking PostgreSQL client (simple-query protocol; trust, cleartext, md5 and
//! SCRAM-SHA-256[-PLUS] authentication; optional TLS with the server certificate verified).
//! Used by the proxy's controller (probes, promotion), the cluster manager and the tests'
//! bank workload; clients of the proxy itself are ordinary libpq programs.

use crate::proto::{self, Frame, ProtoError};
use crate::scram::{self, ClientBinding, ClientExchange, ScramError};
use crate::tls::{self, Stream, TlsClient};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// What a client call failed on.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect to {0}: {1}")]
    Connect(SocketAddr, std::io::Error),
    #[error("protocol: {0}")]
    Proto(#[from] ProtoError),
    #[error("connection closed by server")]
    Closed,
    #[error("server error {code}: {message}")]
    Server { code: String, message: String },
    #[error("unsupported authentication request {0}")]
    Auth(u32),
    #[error("SCRAM: {0}")]
    Scram(#[from] ScramError),
    #[error("TLS with {0}: {1}")]
    Tls(SocketAddr, String),
    /// The TLS handshake did not finish in time (a busy server, or a cut link).
    #[error("TLS with {0}: handshake timed out")]
    TlsTimeout(SocketAddr),
    #[error("authentication refused: {0}")]
    Refused(String),
    #[error(transparent)]
    Random(#[from] crate::secrets::RandomError),
}

impl ClientError {
    /// SQLSTATE if the server answered with an error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            ClientError::Server { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// Where and how [`Client::dial`] connects.
#[derive(Clone, Copy)]
pub struct Dial<'a> {
    pub addr: SocketAddr,
    pub user: &'a str,
    pub password: &'a str,
    pub database: &'a str,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Read/write timeout (and the limit for the TLS handshake).
    pub timeout: Duration,
    pub tls: Option<&'a TlsClient>,
}

/// Rows of text columns (None = NULL).
pub type Rows = Vec<Vec<Option<String>>>;

pub struct Client {
    s: Stream,
    /// Transaction status of the last ReadyForQuery.
    pub status: u8,
}

impl Client {
    pub fn connect(
        addr: SocketAddr,
        user: &str,
        password: &str,
        database: &str,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        Self::connect_with(addr, user, password, database, timeout, timeout)
    }

    /// Like `connect` with a separate TCP connect timeout.
    pub fn connect_with(
        addr: SocketAddr,
        user: &str,
        password: &str,
        database: &str,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Result<Client, ClientError> {
        Self::dial(&Dial {
            addr,
            user,
            password,
            database,
            connect_timeout,
            timeout,
            tls: None,
        })
    }

    /// Connects as `d` says (over TLS when `d.tls` is given: the server's certificate must
    /// chain to its CA and name the server's address; a cleartext password request is then
    /// still refused).
    pub fn dial(d: &Dial) -> Result<Client, ClientError> {
        let (addr, timeout) = (d.addr, d.timeout);
        let (user, password, database) = (d.user, d.password, d.database);
        let s = TcpStream::connect_timeout(&addr, d.connect_timeout)
            .map_err(|e| ClientError::Connect(addr, e))?;
        let _ = s.set_nodelay(true);
        s.set_read_timeout(Some(timeout))
            .map_err(|e| ClientError::Connect(addr, e))?;
        s.set_write_timeout(Some(timeout))
            .map_err(|e| ClientError::Connect(addr, e))?;
        let s = match d.tls {
            Some(t) => {
                tls::connect(s, t, addr.ip(), Instant::now() + timeout).map_err(|e| match e {
                    tls::HandshakeError::Timeout => ClientError::TlsTimeout(addr),
                    e => ClientError::Tls(addr, e.to_string()),
                })?
            }
            None => Stream::Plain(s),
        };
        let mut c = Client { s, status: b'I' };
        let params = vec![
            ("user".to_string(), user.to_string()),
            ("database".to_string(), database.to_string()),
            ("application_name".to_string(), "pliant".to_string()),
        ];
        use std::io::Write;
        c.s.write_all(&proto::startup_message(&params))
            .map_err(ProtoError::from)?;
        let mut auth = Authenticator::new(user, password).over(&c.s, false);
        loop {
            let f = c.read()?;
            match f.tag {
                b'R' => {
                    if let Some(reply) = auth.answer(&f.body)? {
                        c.send(&[reply])?;
                    }
                }
                b'E' => return Err(server_error(&f)),
                b'Z' => {
                    c.status = f.body.first().copied().unwrap_or(b'I');
                    return Ok(c);
                }
                _ => {}
            }
        }
    }

    /// Sets the read timeout for later calls.
    /// The connection itself, after login (to drive the protocol by hand: tests).
    pub fn stream(&mut self) -> &mut Stream {
        &mut self.s
    }

    pub fn set_timeout(&self, t: Duration) {
        let _ = self.s.set_read_timeout(Some(t));
    }

    fn read(&mut self) -> Result<Frame, ClientError> {
        proto::read_frame(&mut self.s)?.ok_or(ClientError::Closed)
    }

    fn send(&mut self, frames: &[Frame]) -> Result<(), ClientError> {
        proto::write_frames(&mut self.s, frames).map_err(|e| ClientError::Proto(e.into()))
    }

    /// Runs one simple query (may hold several statements); returns the rows of all of them
    /// and the last command tag. The first error is returned after ReadyForQuery.
    pub fn query(&mut self, sql: &str) -> Result<(Rows, String), ClientError> {
        self.send(&[proto::query(sql)])?;
        let mut rows = Vec::new();
        let mut tag = String::new();
        let mut err = None;
        loop {
            let f = match self.read() {
                Ok(f) => f,
                // A FATAL error is followed by the server closing: report the error.
                Err(e) => return Err(err.unwrap_or(e)),
            };
            match f.tag {
                b'D' => rows.push(
                    proto::data_row_columns(&f.body).ok_or(ProtoError::Malformed("DataRow"))?,
                ),
                b'C' => {
                    tag = proto::cstr(&f.body)
                        .map(|(s, _)| s.to_string())
                        .unwrap_or_default()
                }
                b'E' if err.is_none() => err = Some(server_error(&f)),
                b'Z' => {
                    self.status = f.body.first().copied().unwrap_or(b'I');
                    return match err {
                        Some(e) => Err(e),
                        None => Ok((rows, tag)),
                    };
                }
                _ => {}
            }
        }
    }

    /// First column of the first row of a query.
    pub fn scalar(&mut self, sql: &str) -> Result<Option<String>, ClientError> {
        let (rows, _) = self.query(sql)?;
        Ok(rows
            .into_iter()
            .next()
            .and_then(|r| r.into_iter().next())
            .flatten())
    }
}

pub fn server_error(f: &Frame) -> ClientError {
    ClientError::Server {
        code: proto::error_field(&f.body, b'C').unwrap_or_default(),
        message: proto::error_field(&f.body, b'M').unwrap_or_default(),
    }
}

/// Answers a server's authentication requests during startup: trust, md5, SCRAM-SHA-256
/// (SCRAM-SHA-256-PLUS over TLS when the server offers it) and cleartext (only over TLS and
/// when allowed). Steps out of order are refused: AuthenticationOk while a SCRAM exchange
/// has not been verified (a server, or someone in between, skipping the proof), and any
/// other request in the middle of one.
pub struct Authenticator {
    user: String,
    password: String,
    scram: Option<ClientExchange>,
    /// The SCRAM server signature was verified.
    scram_done: bool,
    tls: bool,
    /// `tls-server-end-point` data of the server's certificate (TLS only).
    end_point: Option<Vec<u8>>,
    allow_cleartext: bool,
}

impl Authenticator {
    /// For a connection without TLS: cleartext password requests are refused.
    pub fn new(user: &str, password: &str) -> Self {
        Authenticator {
            user: user.to_string(),
            password: password.to_string(),
            scram: None,
            scram_done: false,
            tls: false,
            end_point: None,
            allow_cleartext: false,
        }
    }

    /// Takes TLS and channel binding from the connection; `allow_cleartext`: answer a
    /// cleartext password request (over TLS only).
    pub fn over(mut self, s: &Stream, allow_cleartext: bool) -> Self {
        self.tls = s.is_tls();
        self.end_point = s.peer_end_point();
        self.allow_cleartext = allow_cleartext;
        self
    }

    /// The message to send in answer to an Authentication ('R') body, if any.
    pub fn answer(&mut self, body: &[u8]) -> Result<Option<Frame>, ClientError> {
        let code = u32::from_be_bytes(
            body.get(..4)
                .and_then(|b| b.try_into().ok())
                .ok_or(ProtoError::Malformed("Authentication"))?,
        );
        let data = &body[4..];
        if self.scram.is_some() && !matches!(code, 11 | 12) && !(code == 0 && self.scram_done) {
            return Err(ClientError::Refused(if code == 0 {
                "the server sent AuthenticationOk before the SCRAM exchange was complete (it never proved it knows the password)".into()
            } else {
                format!("authentication request {code} in the middle of a SCRAM exchange")
            }));
        }
        match code {
            0 => Ok(None),
            3 if !self.tls => Err(ClientError::Refused(
                "the server asked for the password in cleartext over a connection without TLS"
                    .into(),
            )),
            3 if !self.allow_cleartext => Err(ClientError::Refused(
                "the server asked for the password in cleartext (not allowed by the configuration)"
                    .into(),
            )),
            3 => Ok(Some(proto::password_message(&self.password))),
            5 => {
                let salt: [u8; 4] = data
                    .get(..4)
                    .and_then(|s| s.try_into().ok())
                    .ok_or(ProtoError::Malformed("AuthenticationMD5Password"))?;
                Ok(Some(proto::password_message(&proto::md5_password(
                    &self.user,
                    &self.password,
                    &salt,
                ))))
            }
            10 => {
                let (mut offered, mut plus) = (false, false);
                let mut rest = data;
                while let Some((m, r)) = proto::cstr(rest) {
                    if m.is_empty() {
                        break;
                    }
                    offered |= m == scram::MECHANISM;
                    plus |= m == scram::MECHANISM_PLUS;
                    rest = r;
                }
                let cb = match (&self.end_point, plus) {
                    (Some(d), true) => ClientBinding::Plus(d.clone()),
                    (Some(_), false) => ClientBinding::NotOffered,
                    (None, _) => ClientBinding::None,
                };
                if !offered && !matches!(cb, ClientBinding::Plus(_)) {
                    return Err(ClientError::Auth(code));
                }
                let (ex, first) =
                    ClientExchange::new_bound(&self.password, &scram::new_nonce()?, &cb);
                self.scram = Some(ex);
                Ok(Some(proto::sasl_initial_response(
                    cb.mechanism(),
                    first.as_bytes(),
                )))
            }
            11 => {
                let ex = self.scram.as_mut().ok_or(ProtoError::Malformed(
                    "unexpected AuthenticationSASLContinue",
                ))?;
                let sf = std::str::from_utf8(data)
                    .map_err(|_| ProtoError::Malformed("AuthenticationSASLContinue"))?;
                Ok(Some(Frame::new(b'p', ex.respond(sf)?.into_bytes())))
            }
            12 => {
                let ex = self
                    .scram
                    .as_ref()
                    .ok_or(ProtoError::Malformed("unexpected AuthenticationSASLFinal"))?;
                let v = std::str::from_utf8(data)
                    .map_err(|_| ProtoError::Malformed("AuthenticationSASLFinal"))?;
                ex.verify(v)?;
                self.scram_done = true;
                Ok(None)
            }
            other => Err(ClientError::Auth(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(code: u32, data: &[u8]) -> Vec<u8> {
        let mut v = code.to_be_bytes().to_vec();
        v.extend_from_slice(data);
        v
    }

    fn refused(r: Result<Option<Frame>, ClientError>) -> bool {
        matches!(r, Err(ClientError::Refused(_)))
    }

    #[test]
    fn cleartext_password_requests_are_refused_without_tls_or_permission() {
        let mut a = Authenticator::new("u", "pw");
        assert!(refused(a.answer(&req(3, &[]))));
        let mut a = Authenticator::new("u", "pw");
        a.tls = true;
        assert!(refused(a.answer(&req(3, &[]))), "TLS but not allowed");
        a.allow_cleartext = true;
        let f = a
            .answer(&req(3, &[]))
            .expect("allowed over TLS")
            .expect("frame");
        assert_eq!(f.tag, b'p');
        // md5 and trust stay as they were.
        let mut a = Authenticator::new("u", "pw");
        assert!(a.answer(&req(5, b"salt")).expect("md5").is_some());
        assert!(a.answer(&req(0, &[])).expect("ok after md5").is_none());
        assert!(Authenticator::new("u", "pw")
            .answer(&req(0, &[]))
            .expect("trust")
            .is_none());
    }

    #[test]
    fn no_scram_nonce_without_the_random_source() {
        let mut a = Authenticator::new("u", "pw");
        let r = crate::secrets::with_broken_random(|| a.answer(&req(10, b"SCRAM-SHA-256\0\0")));
        assert!(matches!(r, Err(ClientError::Random(_))), "{r:?}");
    }

    #[test]
    fn authentication_ok_before_the_scram_proof_is_refused() {
        let mut a = Authenticator::new("u", "pw");
        let first = a
            .answer(&req(10, b"SCRAM-SHA-256\0\0"))
            .expect("sasl")
            .expect("initial response");
        assert!(first.body.starts_with(b"SCRAM-SHA-256\0"));
        assert!(refused(a.answer(&req(0, &[]))), "Ok skipping the exchange");
        let mut a = Authenticator::new("u", "pw");
        a.answer(&req(10, b"SCRAM-SHA-256\0\0")).expect("sasl");
        assert!(refused(a.answer(&req(5, b"salt"))), "md5 in the middle");
        // Over TLS with PLUS offered, the client binds to the server certificate.
        let mut a = Authenticator::new("u", "pw");
        a.tls = true;
        a.end_point = Some(vec![1; 32]);
        let f = a
            .answer(&req(10, b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0"))
            .expect("sasl")
            .expect("frame");
        assert!(f.body.starts_with(b"SCRAM-SHA-256-PLUS\0"));
        // Without PLUS offered over TLS: "y" (so a server that does support it refuses).
        let mut a = Authenticator::new("u", "pw");
        a.end_point = Some(vec![1; 32]);
        let f = a
            .answer(&req(10, b"SCRAM-SHA-256\0\0"))
            .expect("sasl")
            .expect("frame");
        let (_, data) = proto::parse_sasl_initial_response(&f.body).expect("parse");
        assert!(
            data.starts_with(b"y,,"),
            "{:?}",
            String::from_utf8_lossy(data)
        );
    }
}
