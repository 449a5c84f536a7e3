//! One control connection: frames of kind [`kinds::CONTROL`] carrying one JSON request or
//! answer each, in one of two modes.
//!
//! - **Sealed**: after pliant-wire's mutual handshake, every frame authenticated (and
//!   encrypted by the replica's policy, always over TCP by default). A replica with a
//!   `[security]` identity serves only this mode, on its unix socket and on TCP alike, to
//!   clients holding the CONTROLLER or ADMIN role.
//! - **Local**: plain frames on a unix socket, for a replica run without an identity (one
//!   host, nothing to cross). The socket is mode 0600 and the kernel vouches for the peer's
//!   uid (SO_PEERCRED), which must be the replica's; TCP is refused in this mode by the
//!   replica's config check.

use pliant_wire::frame::{self, FrameError, HEADER_LEN};
use pliant_wire::{kinds, Conn, Stream};

/// Largest request body (a `migrate_in` of 20,000 keys is ~1 MiB).
pub const MAX_REQUEST: usize = 2 << 20;
/// Largest answer body (a `flows` listing of thousands of keys with aliases is well below).
pub const MAX_ANSWER: usize = 64 << 20;

pub enum Link {
    Local {
        stream: Stream,
        buf: Vec<u8>,
        max_body: usize,
    },
    Sealed(Box<Conn>),
}

impl Link {
    /// A plain link on a unix stream, accepting bodies up to `max_body`.
    pub fn local(stream: Stream, max_body: usize) -> Link {
        Link::Local {
            stream,
            buf: Vec::new(),
            max_body,
        }
    }

    pub fn send(&mut self, body: &[u8]) -> Result<(), FrameError> {
        match self {
            Link::Local { stream, .. } => {
                let mut out = Vec::with_capacity(HEADER_LEN + body.len());
                frame::push_plain(kinds::CONTROL, body, &mut out);
                stream.send_all(&out)?;
                Ok(())
            }
            Link::Sealed(c) => c.writer.send_bytes(kinds::CONTROL, body),
        }
    }

    /// The next body (a frame of another kind is refused).
    pub fn recv(&mut self) -> Result<&[u8], FrameError> {
        match self {
            Link::Local {
                stream,
                buf,
                max_body,
            } => {
                let h = frame::read_frame_into(&mut &*stream, *max_body, buf)?;
                if h.kind != kinds::CONTROL {
                    return Err(FrameError::UnexpectedKind(h.kind));
                }
                Ok(&buf[HEADER_LEN..])
            }
            Link::Sealed(c) => match c.reader.recv_bytes()? {
                (kinds::CONTROL, body) => Ok(body),
                (k, _) => Err(FrameError::UnexpectedKind(k)),
            },
        }
    }

    pub fn stream(&self) -> &Stream {
        match self {
            Link::Local { stream, .. } => stream,
            Link::Sealed(c) => c.reader.stream(),
        }
    }

    /// The authenticated peer's name (`None` on a local link).
    pub fn peer(&self) -> Option<&str> {
        match self {
            Link::Local { .. } => None,
            Link::Sealed(c) => Some(&c.peer.name),
        }
    }
}
