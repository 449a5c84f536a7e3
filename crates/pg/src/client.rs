//! A minimal blocking PostgreSQL client (simple-query protocol; trust, cleartext, md5 and
//! SCRAM-SHA-256 authentication).
//! Used by the proxy's controller (probes, promotion), the cluster manager and the tests'
//! bank workload; clients of the proxy itself are ordinary libpq programs.

use crate::proto::{self, Frame, ProtoError};
use crate::scram::{self, ClientExchange, ScramError};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

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

/// Rows of text columns (None = NULL).
pub type Rows = Vec<Vec<Option<String>>>;

pub struct Client {
    s: TcpStream,
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
        let s = TcpStream::connect_timeout(&addr, connect_timeout)
            .map_err(|e| ClientError::Connect(addr, e))?;
        let _ = s.set_nodelay(true);
        s.set_read_timeout(Some(timeout))
            .map_err(|e| ClientError::Connect(addr, e))?;
        s.set_write_timeout(Some(timeout))
            .map_err(|e| ClientError::Connect(addr, e))?;
        let mut c = Client { s, status: b'I' };
        let params = vec![
            ("user".to_string(), user.to_string()),
            ("database".to_string(), database.to_string()),
            ("application_name".to_string(), "pliant".to_string()),
        ];
        use std::io::Write;
        c.s.write_all(&proto::startup_message(&params))
            .map_err(ProtoError::from)?;
        let mut auth = Authenticator::new(user, password);
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

/// Answers a server's authentication requests during startup: trust, cleartext, md5 and
/// SCRAM-SHA-256 (without channel binding: no TLS here).
pub struct Authenticator {
    user: String,
    password: String,
    scram: Option<ClientExchange>,
}

impl Authenticator {
    pub fn new(user: &str, password: &str) -> Self {
        Authenticator {
            user: user.to_string(),
            password: password.to_string(),
            scram: None,
        }
    }

    /// The message to send in answer to an Authentication ('R') body, if any.
    pub fn answer(&mut self, body: &[u8]) -> Result<Option<Frame>, ClientError> {
        let code = u32::from_be_bytes(
            body.get(..4)
                .and_then(|b| b.try_into().ok())
                .ok_or(ProtoError::Malformed("Authentication"))?,
        );
        let data = &body[4..];
        match code {
            0 => Ok(None),
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
                let mut offered = false;
                let mut rest = data;
                while let Some((m, r)) = proto::cstr(rest) {
                    if m.is_empty() {
                        break;
                    }
                    offered |= m == scram::MECHANISM;
                    rest = r;
                }
                if !offered {
                    return Err(ClientError::Auth(code));
                }
                let (ex, first) = ClientExchange::new(&self.password, &scram::new_nonce());
                self.scram = Some(ex);
                Ok(Some(proto::sasl_initial_response(
                    scram::MECHANISM,
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
                Ok(None)
            }
            other => Err(ClientError::Auth(other)),
        }
    }
}
