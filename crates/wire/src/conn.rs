//! A connection after its handshake: a stream and a session, with typed send and receive, for
//! channels that use blocking I/O. [`Conn::split`] gives a reading half and a writing half for
//! channels that read on one thread and write on another.

use crate::endpoint::{self, Endpoint, Stream, TcpTuning};
use crate::frame::{self, FrameError};
use crate::identity::Identity;
use crate::session::{self, Opener, Peer, Sealer, SessionError, SessionOptions};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::{self, BufReader};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("connecting to {ep}: {source}")]
    Connect { ep: Endpoint, source: io::Error },
    #[error("handshake with {ep}: {source}")]
    Handshake { ep: Endpoint, source: SessionError },
}

/// The reading half.
pub struct ConnReader {
    r: BufReader<Stream>,
    rx: Opener,
    buf: Vec<u8>,
}

/// The writing half.
pub struct ConnWriter {
    s: Stream,
    tx: Sealer,
    out: Vec<u8>,
}

/// Both halves and the authenticated peer.
pub struct Conn {
    pub peer: Peer,
    pub encrypted: bool,
    pub reader: ConnReader,
    pub writer: ConnWriter,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Conn({:?}, encrypted {})", self.peer, self.encrypted)
    }
}

impl ConnReader {
    /// Receives one frame: its kind and decoded body.
    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<(u16, T), FrameError> {
        let (kind, body) = self.rx.read(&mut self.r, &mut self.buf)?;
        Ok((kind, frame::decode_body(&self.buf[body])?))
    }

    /// Receives one frame as raw bytes (valid until the next receive).
    pub fn recv_bytes(&mut self) -> Result<(u16, &[u8]), FrameError> {
        let (kind, body) = self.rx.read(&mut self.r, &mut self.buf)?;
        Ok((kind, &self.buf[body]))
    }

    pub fn stream(&self) -> &Stream {
        self.r.get_ref()
    }

    pub fn set_max_body(&mut self, max: usize) {
        self.rx.set_max_body(max);
    }
}

impl ConnWriter {
    /// Seals and sends one message (one `send(2)` for the whole frame).
    pub fn send<T: Serialize>(&mut self, kind: u16, m: &T) -> Result<(), FrameError> {
        self.out.clear();
        self.tx.seal_msg(kind, m, &mut self.out)?;
        self.s.send_all(&self.out)?;
        Ok(())
    }

    pub fn send_bytes(&mut self, kind: u16, body: &[u8]) -> Result<(), FrameError> {
        self.out.clear();
        self.tx.seal_bytes(kind, body, &mut self.out)?;
        self.s.send_all(&self.out)?;
        Ok(())
    }

    pub fn stream(&self) -> &Stream {
        &self.s
    }
}

impl Conn {
    fn from_session(s: Stream, sess: session::Session) -> io::Result<Conn> {
        let w = s.try_clone()?;
        Ok(Conn {
            peer: sess.peer,
            encrypted: sess.encrypted,
            reader: ConnReader {
                r: BufReader::with_capacity(64 << 10, s),
                rx: sess.rx,
                buf: Vec::new(),
            },
            writer: ConnWriter {
                s: w,
                tx: sess.tx,
                out: Vec::new(),
            },
        })
    }

    /// Connects to `ep` and runs the client handshake.
    pub fn connect(
        ep: &Endpoint,
        me: &Identity,
        o: &SessionOptions,
        connect_timeout: Duration,
        tcp: &TcpTuning,
    ) -> Result<Conn, ConnError> {
        let s =
            endpoint::connect(ep, connect_timeout, tcp).map_err(|source| ConnError::Connect {
                ep: ep.clone(),
                source,
            })?;
        Conn::client(s, me, o).map_err(|source| ConnError::Handshake {
            ep: ep.clone(),
            source,
        })
    }

    /// Runs the client handshake on a connected stream.
    pub fn client(s: Stream, me: &Identity, o: &SessionOptions) -> Result<Conn, SessionError> {
        let sess = session::client(&s, me, o)?;
        Conn::from_session(s, sess).map_err(|e| SessionError::Frame(FrameError::Io(e)))
    }

    /// Runs the server handshake on an accepted stream.
    pub fn server(s: Stream, me: &Identity, o: &SessionOptions) -> Result<Conn, SessionError> {
        let sess = session::server(&s, me, o)?;
        Conn::from_session(s, sess).map_err(|e| SessionError::Frame(FrameError::Io(e)))
    }

    pub fn send<T: Serialize>(&mut self, kind: u16, m: &T) -> Result<(), FrameError> {
        self.writer.send(kind, m)
    }

    pub fn recv<T: DeserializeOwned>(&mut self) -> Result<(u16, T), FrameError> {
        self.reader.recv()
    }

    /// One request, one answer.
    pub fn call<Q: Serialize, A: DeserializeOwned>(
        &mut self,
        kind: u16,
        q: &Q,
    ) -> Result<(u16, A), FrameError> {
        self.send(kind, q)?;
        self.recv()
    }

    pub fn split(self) -> (Peer, ConnReader, ConnWriter) {
        (self.peer, self.reader, self.writer)
    }
}
