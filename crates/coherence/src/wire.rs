//! Messages between [`crate::HubClient`] and [`crate::HubServer`].
//!
//! They travel in pliant-wire frames of kind [`pliant_wire::kinds::HUB`], sealed by the
//! session the mutual handshake set up ([`pliant_wire::session`]): every frame authenticated
//! (and encrypted over TCP by default) with an implicit sequence number, so a frame injected
//! from another connection, replayed or reordered fails its tag and closes the connection.
//! The frame header is pliant-wire's (length, wire version, kind); its length is checked
//! against the receiver's bound before the body is read. The body is the postcard encoding of
//! one message.
//!
//! The client sends one [`Request`] and reads exactly one [`Response`] before sending the next,
//! so a connection never has more than one request outstanding and needs no request ids. The
//! first request on a connection must be [`Request::Hello`], naming the replica the client's
//! certificate names.
//!
//! Values travel as [`Bytes`] / [`Blob`], which postcard encodes as a length and the raw bytes
//! (the same bytes as a `Vec<u8>`, but decoded with one copy instead of one call per byte).

use pliant_state::{ReplicaId, StateError};
use pliant_wire::session::Opener;
use pliant_wire::{kinds, FrameError};
use serde::de::{Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;
use std::io::Read;
use std::ops::Range;

/// Bumped when a message changes incompatibly; `Hello` carries it and the hub refuses others.
/// (pliant-wire's own version, in every frame header, covers the framing and the handshake.)
pub const PROTOCOL_VERSION: u16 = 1;
/// Longest replica name accepted in `Hello`.
pub const MAX_NAME_BYTES: usize = 255;

/// A borrowed byte string (requests are encoded from and decoded into borrowed buffers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes<'a>(pub &'a [u8]);

/// An owned byte string (responses).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blob(pub Vec<u8>);

impl Serialize for Bytes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

struct BorrowedBytes;

impl<'de> Visitor<'de> for BorrowedBytes {
    type Value = Bytes<'de>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("borrowed bytes")
    }
    fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        Ok(Bytes(v))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Bytes<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_bytes(BorrowedBytes)
    }
}

struct OwnedBytes;

impl<'de> Visitor<'de> for OwnedBytes {
    type Value = Blob;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("bytes")
    }
    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        Ok(Blob(v.to_vec()))
    }
    fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Self::Value, E> {
        Ok(Blob(v))
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_bytes(OwnedBytes)
    }
}

/// Client -> hub. Field meanings follow [`pliant_state::Coherence`] and
/// [`pliant_state::LockService`]; `replica`/`holder` must be the id the connection registered
/// with `Hello` (a client speaks only for its own replica), except in `Withdraw`, which a
/// survivor sends for the replica it merged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request<'a> {
    Hello {
        version: u16,
        replica: ReplicaId,
        name: &'a str,
    },
    Publish {
        key: &'a str,
        replica: ReplicaId,
        #[serde(borrow)]
        value: Bytes<'a>,
    },
    FetchOthers {
        key: &'a str,
        replica: ReplicaId,
    },
    Withdraw {
        key: &'a str,
        replica: ReplicaId,
    },
    FetchLatest {
        key: &'a str,
    },
    PublishLatest {
        key: &'a str,
        holder: ReplicaId,
        fence: u64,
        #[serde(borrow)]
        value: Bytes<'a>,
    },
    /// The hub's own monotonic clock starts the lease when it grants: clocks of different
    /// processes (hosts, later) are never compared.
    Lock {
        key: &'a str,
        holder: ReplicaId,
        lease_us: u64,
    },
    Unlock {
        key: &'a str,
        holder: ReplicaId,
        fence: u64,
    },
    /// The hub's counters (operators, tests).
    Stats,
}

impl Request<'_> {
    /// The key a request is about ("" for none), for error messages.
    pub fn key(&self) -> &str {
        match self {
            Request::Publish { key, .. }
            | Request::FetchOthers { key, .. }
            | Request::Withdraw { key, .. }
            | Request::FetchLatest { key }
            | Request::PublishLatest { key, .. }
            | Request::Lock { key, .. }
            | Request::Unlock { key, .. } => key,
            Request::Hello { .. } | Request::Stats => "",
        }
    }

    /// Whether sending the request twice has the same effect as once, so a client may resend
    /// it when the connection died without an answer (the hub may or may not have applied it).
    pub fn idempotent(&self) -> bool {
        match self {
            Request::Publish { .. }
            | Request::FetchOthers { .. }
            | Request::Withdraw { .. }
            | Request::FetchLatest { .. }
            | Request::Stats
            | Request::Hello { .. } => true,
            // A second Lock is refused by our own grant; a second PublishLatest bumps the
            // version twice; a second Unlock answers LeaseLost.
            Request::PublishLatest { .. } | Request::Lock { .. } | Request::Unlock { .. } => false,
        }
    }
}

/// Hub -> client: exactly one per request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Welcome {
        version: u16,
    },
    Done,
    Others(Vec<Blob>),
    Latest(Option<(u64, Blob)>),
    Version(u64),
    /// `lease_us` is the lease actually granted (the hub caps it at its `max_lease`).
    /// `latest` is the key's newest strong copy as of the grant: nobody else can publish
    /// while the grant holds, so the client can answer the `fetch_latest` that
    /// `SharedStore` makes right after `lock` without another round trip.
    Granted {
        fence: u64,
        lease_us: u64,
        latest: Option<(u64, Blob)>,
    },
    Stats(crate::HubStats),
    Error {
        key: String,
        error: WireError,
    },
}

/// Why the hub refused a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum WireError {
    #[error("locked by another replica")]
    Locked,
    #[error("lock lease lost")]
    LeaseLost,
    #[error("not found")]
    NotFound,
    #[error("{what} over the bound of {max}")]
    Limit { what: String, max: u64 },
    /// The request broke the protocol (wrong replica id, no Hello, bad version...).
    #[error("{0}")]
    Protocol(String),
    /// Anything else the hub's store refused.
    #[error("{0}")]
    Refused(String),
}

impl WireError {
    /// The hub's answer for a `StateError` its store returned.
    pub fn from_state(e: &StateError) -> WireError {
        match e {
            StateError::Locked(_) => WireError::Locked,
            StateError::LeaseLost(_) => WireError::LeaseLost,
            StateError::SharedNotFound(_) => WireError::NotFound,
            StateError::SharedLimit { what, max, .. } => WireError::Limit {
                what: (*what).to_string(),
                max: *max as u64,
            },
            other => WireError::Refused(other.to_string()),
        }
    }

    /// The `StateError` a store sees for this answer about `key`.
    pub fn into_state(self, key: String, hub: &str) -> StateError {
        match self {
            WireError::Locked => StateError::Locked(key),
            WireError::LeaseLost => StateError::LeaseLost(key),
            WireError::NotFound => StateError::SharedNotFound(key),
            WireError::Limit { what, max } => StateError::SharedLimit {
                key,
                what: static_limit_name(&what),
                max: usize::try_from(max).unwrap_or(usize::MAX),
            },
            WireError::Protocol(reason) => StateError::Coherence {
                key,
                reason: format!("hub {hub} refused the request: {reason}"),
            },
            WireError::Refused(reason) => StateError::Coherence {
                key,
                reason: format!("hub {hub}: {reason}"),
            },
        }
    }
}

/// `StateError::SharedLimit::what` is `&'static str`: map the hub's bound names back to them
/// (an unknown name from a newer hub still reads as a hub bound).
fn static_limit_name(what: &str) -> &'static str {
    match what {
        "hub keys" => "hub keys",
        "hub value bytes" => "hub value bytes",
        "replicas per key" => "replicas per key",
        "hub response bytes" => "hub response bytes",
        "hub replicas" => "hub replicas",
        _ => "hub limit",
    }
}

/// Encodes `m` as a frame body into `body` (cleared first; its capacity is reused, so a steady
/// stream of small messages does not allocate). Refuses bodies over `max` bytes.
///
/// Measured before sealing, not after: a `Sealer` numbers every frame it seals, so a frame
/// sealed and then dropped for its size would make every later frame on the connection fail
/// its tag at the peer.
pub fn encode_body<T: Serialize>(m: &T, body: &mut Vec<u8>, max: usize) -> Result<(), FrameError> {
    body.clear();
    *body = pliant_wire::frame::encode_body(m, std::mem::take(body))?;
    if body.len() > max {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max,
        });
    }
    Ok(())
}

/// Reads and opens one sealed frame into `buf`; the range of its body. A frame of another
/// channel's kind is refused (it cannot be a hub message, whoever sealed it).
pub fn read_frame<R: Read + ?Sized>(
    rx: &mut Opener,
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Range<usize>, FrameError> {
    let (kind, body) = rx.read(r, buf)?;
    if kind != kinds::HUB {
        return Err(FrameError::UnexpectedKind(kind));
    }
    Ok(body)
}

/// Decodes a message body (pliant-wire's postcard decoding, named for this module's callers).
pub use pliant_wire::frame::decode_body as decode;

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(r: &Request<'_>) {
        let mut body = Vec::new();
        encode_body(r, &mut body, 1 << 20).unwrap();
        let back: Request<'_> = decode(&body).unwrap();
        assert_eq!(&back, r);
    }

    #[test]
    fn requests_round_trip_with_borrowed_values() {
        round_trip(&Request::Hello {
            version: PROTOCOL_VERSION,
            replica: 7,
            name: "r1",
        });
        round_trip(&Request::Publish {
            key: "pkts",
            replica: 7,
            value: Bytes(&[1, 2, 3, 0, 255]),
        });
        round_trip(&Request::PublishLatest {
            key: "cfg",
            holder: 7,
            fence: u64::MAX,
            value: Bytes(&[]),
        });
        round_trip(&Request::Lock {
            key: "cfg",
            holder: 1,
            lease_us: 1_000_000,
        });
        round_trip(&Request::Stats);
    }

    #[test]
    fn bytes_encode_like_a_vec_so_the_layout_is_plain() {
        let a = postcard::to_allocvec(&Bytes(&[9, 8, 7])).unwrap();
        let b = postcard::to_allocvec(&vec![9u8, 8, 7]).unwrap();
        assert_eq!(a, b);
        let blob: Blob = decode(&b).unwrap();
        assert_eq!(blob.0, vec![9, 8, 7]);
    }

    #[test]
    fn responses_round_trip() {
        let r = Response::Others(vec![Blob(vec![1]), Blob(vec![]), Blob(vec![2; 300])]);
        let mut buf = Vec::new();
        encode_body(&r, &mut buf, 1 << 20).unwrap();
        let back: Response = decode(&buf).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn bounds_and_garbage_are_errors_not_panics() {
        let mut buf = Vec::new();
        let big = vec![0u8; 100];
        assert!(matches!(
            encode_body(
                &Request::Publish {
                    key: "k",
                    replica: 0,
                    value: Bytes(&big)
                },
                &mut buf,
                64
            ),
            Err(FrameError::TooLarge { max: 64, .. })
        ));
        // Undecodable bodies, including every prefix of a valid one.
        assert!(decode::<Request<'_>>(&[200, 1, 2]).is_err());
        let mut ok = Vec::new();
        encode_body(
            &Request::Publish {
                key: "k",
                replica: 3,
                value: Bytes(&[1, 2]),
            },
            &mut ok,
            64,
        )
        .unwrap();
        for cut in 0..ok.len() {
            assert!(decode::<Request<'_>>(&ok[..cut]).is_err(), "prefix {cut}");
        }
    }

    #[test]
    fn state_errors_map_both_ways() {
        let cases = [
            StateError::Locked("k".into()),
            StateError::LeaseLost("k".into()),
            StateError::SharedNotFound("k".into()),
            StateError::SharedLimit {
                key: "k".into(),
                what: "hub keys",
                max: 9,
            },
        ];
        for e in cases {
            let back = WireError::from_state(&e).into_state("k".into(), "/h");
            assert_eq!(back, e);
        }
        let e = WireError::Protocol("no Hello".into()).into_state("k".into(), "/h");
        assert!(e.to_string().contains("no Hello"), "{e}");
        assert!(e.to_string().contains("/h"), "{e}");
    }
}
