//! One client event of the replicated service, as carried in a Raft log entry's data.
//!
//! The Raft entry supplies `term` and `index`; the data is `[conn u64 LE][kind u8][bytes]`.
//! A fixed little layout rather than serde: the bytes of a `Data` event are the bulk of the
//! log, and this costs nine bytes per event with no length prefix (the entry knows its size).

/// What happened on a client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The leader accepted the connection: each replica opens one to its server.
    Connect,
    /// Bytes the client sent, in order.
    Data,
    /// The client closed its side (FIN): the replicas half-close theirs.
    Close,
    /// The connection broke (reset, idle bound, leader lost it): the replicas drop theirs.
    Reset,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Connect => 1,
            Kind::Data => 2,
            Kind::Close => 3,
            Kind::Reset => 4,
        }
    }
    fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Connect,
            2 => Kind::Data,
            3 => Kind::Close,
            4 => Kind::Reset,
            _ => return None,
        })
    }
}

/// A decoded event; `bytes` is empty except for `Data`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub conn: u64,
    pub kind: Kind,
    pub bytes: Vec<u8>,
}

/// Bytes of the header before an event's payload.
pub const HEADER: usize = 9;

/// Encodes an event into the entry data the leader proposes.
pub fn encode(conn: u64, kind: Kind, bytes: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + bytes.len());
    v.extend_from_slice(&conn.to_le_bytes());
    v.push(kind.code());
    v.extend_from_slice(bytes);
    v
}

/// Decodes entry data; `None` for data that is not an event (an empty entry a new leader
/// appends, or garbage, which a replica skips the same way everywhere).
pub fn decode(data: &[u8]) -> Option<Event> {
    if data.len() < HEADER {
        return None;
    }
    let conn = u64::from_le_bytes(data[..8].try_into().ok()?);
    let kind = Kind::from_code(data[8])?;
    if kind != Kind::Data && data.len() != HEADER {
        return None;
    }
    Some(Event {
        conn,
        kind,
        bytes: data[HEADER..].to_vec(),
    })
}

/// A connection id no other leader can mint: the leader's term in the high 32 bits (one
/// leader per term) and its own counter in the low 32.
pub fn conn_id(term: u64, counter: u32) -> u64 {
    (term << 32) | u64::from(counter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        for (k, b) in [
            (Kind::Connect, &b""[..]),
            (Kind::Data, b"*1\r\n$4\r\nPING\r\n"),
            (Kind::Close, b""),
            (Kind::Reset, b""),
        ] {
            let e = decode(&encode(7, k, b)).unwrap();
            assert_eq!((e.conn, e.kind, &e.bytes[..]), (7, k, b));
        }
        assert!(decode(b"").is_none(), "a new leader's empty entry");
        assert!(
            decode(&encode(1, Kind::Close, b"x")).is_none(),
            "close with bytes"
        );
        let mut bad = encode(1, Kind::Data, b"x");
        bad[8] = 9;
        assert!(decode(&bad).is_none());
        assert_eq!(conn_id(3, 5), (3 << 32) | 5);
    }
}
