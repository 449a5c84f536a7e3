//! The one framing codec of every channel between pliant processes.
//!
//! ```text
//!   0..4   len      u32 LE   bytes after this 8-byte header (body, plus the 16-byte tag of a
//!                            sealed frame)
//!   4..6   version  u16 LE   PROTOCOL_VERSION of the sender
//!   6..8   kind     u16 LE   message type (0..16 the handshake's, 16.. the channel's)
//!   8..    body
//! ```
//!
//! The length is checked against the channel's bound before a byte of the body is read or
//! allocated, so a peer that declares a 4 GiB frame costs nothing. Every frame carries the
//! version, so a peer built from another release is refused on its first frame with an error
//! naming both versions instead of failing later on an undecodable body.
//!
//! Plain frames are only exchanged during the handshake ([`crate::session`]); after it every
//! frame is sealed (the header is authenticated data, the body encrypted or only
//! authenticated, then a tag).

use std::io::{self, Read};

/// Version of the wire protocol spoken by this build. A peer speaking another one is refused at
/// connect ([`FrameError::Version`]).
pub const PROTOCOL_VERSION: u16 = 1;
/// Size of the frame header.
pub const HEADER_LEN: usize = 8;
/// Size of the authentication tag of a sealed frame.
pub const TAG_LEN: usize = 16;
/// Kinds below this one belong to the handshake; a channel's own messages use this and above.
pub const FIRST_CHANNEL_KIND: u16 = 16;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes is over this channel's {max}-byte bound")]
    TooLarge { len: usize, max: usize },
    #[error(
        "peer speaks wire protocol version {theirs}, this build speaks version {ours} \
         (upgrade both ends to the same release)"
    )]
    Version { ours: u16, theirs: u16 },
    #[error("frame authentication failed (tampered, replayed, reordered or injected frame)")]
    BadTag,
    #[error("frame of kind {0} was not expected here")]
    UnexpectedKind(u16),
    #[error("frame shorter than its tag")]
    Short,
    #[error("undecodable frame body: {0}")]
    Decode(String),
    #[error("could not encode a frame: {0}")]
    Encode(String),
    #[error("peer closed the connection")]
    Closed,
    #[error("i/o: {0}")]
    Io(io::Error),
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            FrameError::Io(e)
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub len: u32,
    pub version: u16,
    pub kind: u16,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&self.len.to_le_bytes());
        h[4..6].copy_from_slice(&self.version.to_le_bytes());
        h[6..8].copy_from_slice(&self.kind.to_le_bytes());
        h
    }

    pub fn decode(h: &[u8; HEADER_LEN]) -> Header {
        Header {
            len: u32::from_le_bytes([h[0], h[1], h[2], h[3]]),
            version: u16::from_le_bytes([h[4], h[5]]),
            kind: u16::from_le_bytes([h[6], h[7]]),
        }
    }

    /// Refuses another protocol version and a body over `max` (before anything is read).
    pub fn check(&self, max: usize) -> Result<(), FrameError> {
        if self.version != PROTOCOL_VERSION {
            return Err(FrameError::Version {
                ours: PROTOCOL_VERSION,
                theirs: self.version,
            });
        }
        if self.len as usize > max {
            return Err(FrameError::TooLarge {
                len: self.len as usize,
                max,
            });
        }
        Ok(())
    }
}

/// Appends a plain frame of `kind` carrying `body` to `out`.
pub fn push_plain(kind: u16, body: &[u8], out: &mut Vec<u8>) {
    let h = Header {
        len: body.len() as u32,
        version: PROTOCOL_VERSION,
        kind,
    };
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(body);
}

/// Where a frame's body lies in a buffer [`split_frame`] looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Located {
    pub header: Header,
    /// Bytes of the whole frame (header included) at the front of the buffer.
    pub total: usize,
}

/// Looks at the front of `buf`: `Ok(None)` while the frame is incomplete; an error as soon as
/// the header shows another version or a length over `max`.
pub fn split_frame(buf: &[u8], max: usize) -> Result<Option<Located>, FrameError> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = Header::decode(h);
    header.check(max)?;
    let total = HEADER_LEN + header.len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some(Located { header, total }))
}

/// Reads one whole frame (header included) from a blocking reader into `buf` (cleared first),
/// checking the header before the body is allocated.
pub fn read_frame_into<R: Read + ?Sized>(
    r: &mut R,
    max: usize,
    buf: &mut Vec<u8>,
) -> Result<Header, FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let header = Header::decode(&h);
    header.check(max)?;
    buf.clear();
    buf.extend_from_slice(&h);
    buf.resize(HEADER_LEN + header.len as usize, 0);
    r.read_exact(&mut buf[HEADER_LEN..])?;
    Ok(header)
}

/// Postcard encoding of a message body, appended to `out`.
pub fn encode_body<T: serde::Serialize>(m: &T, out: Vec<u8>) -> Result<Vec<u8>, FrameError> {
    postcard::to_extend(m, out).map_err(|e| FrameError::Encode(e.to_string()))
}

/// Postcard decoding of a message body.
pub fn decode_body<'a, T: serde::Deserialize<'a>>(b: &'a [u8]) -> Result<T, FrameError> {
    postcard::from_bytes(b).map_err(|e| FrameError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_checks_before_reading_the_body() {
        let mut f = Vec::new();
        push_plain(20, b"hello", &mut f);
        let loc = split_frame(&f, 5).unwrap().unwrap();
        assert_eq!(loc.header.kind, 20);
        assert_eq!(loc.total, f.len());
        assert_eq!(split_frame(&f[..7], 5).unwrap(), None);
        assert_eq!(split_frame(&f[..12], 5).unwrap(), None);
        assert!(matches!(
            split_frame(&f, 4),
            Err(FrameError::TooLarge { len: 5, max: 4 })
        ));
        // A 4 GiB declaration with no body: refused from the header alone.
        let huge = Header {
            len: u32::MAX,
            version: PROTOCOL_VERSION,
            kind: 20,
        }
        .encode();
        let mut buf = Vec::new();
        assert!(matches!(
            read_frame_into(&mut &huge[..], 1 << 20, &mut buf),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(buf.capacity() < 1 << 20);
        let mut r = &f[..];
        read_frame_into(&mut r, 5, &mut buf).unwrap();
        assert_eq!(&buf[HEADER_LEN..], b"hello");
    }

    #[test]
    fn another_version_is_refused_naming_both() {
        let h = Header {
            len: 0,
            version: PROTOCOL_VERSION + 1,
            kind: 1,
        }
        .encode();
        let e = split_frame(&h, 10).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&format!("version {}", PROTOCOL_VERSION + 1)),
            "{text}"
        );
        assert!(
            text.contains(&format!("version {PROTOCOL_VERSION}")),
            "{text}"
        );
    }

    #[test]
    fn a_cut_frame_is_closed_not_garbage() {
        let mut f = Vec::new();
        push_plain(20, b"hello", &mut f);
        let mut buf = Vec::new();
        assert!(matches!(
            read_frame_into(&mut &f[..10], 64, &mut buf),
            Err(FrameError::Closed)
        ));
    }
}
