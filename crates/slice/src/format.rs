//! The capsule format: one [`Slice`] as bytes.
//!
//! ```text
//!   header (20 bytes)
//!     magic     4   b"PSLC"
//!     version   u16 FORMAT_VERSION
//!     reserved  u16 0
//!     body_len  u32 bytes after the header
//!     checksum  u64 FNV-1a 64 of the body
//!   body
//!     session_id u64
//!     tcp: local addr, remote addr (family u8 4|6, address 4|16 bytes, port u16),
//!          send_seq u32, recv_seq u32, mss u32, flags u8 (1 sack, 2 timestamps, 4 wscale,
//!          8 nodelay), snd_wscale u8, rcv_wscale u8, timestamp u32,
//!          captured_at_ms u64, netns u64, window 5 x u32 (snd_wl1, snd_wnd, max_window, rcv_wnd, rcv_wup),
//!          unsent u32, send_queue (u32 len + bytes), recv_queue (u32 len + bytes)
//!     pending_out (u32 len + bytes)
//!     app         (u32 len + bytes)
//! ```
//! Integers are little-endian. Every length is checked against what is left before anything
//! is allocated, and the body must be consumed exactly.
//!
//! Version rule: a reader decodes only its own [`FORMAT_VERSION`]; a capsule of any other
//! version is refused with both versions named ([`FormatError::Version`]), never guessed at.
//! Any change to the body's layout or meaning bumps the version. A capsule moves between two
//! instances of the same build during a planned move, so there is no need to read old ones;
//! an instance of another version refuses the move and the source keeps its session.
//!
//! The checksum is not a security measure (capsules travel in authenticated frames); it tells
//! a damaged capsule from a valid one of the same length before any field is trusted.

use crate::capsule::{Slice, TcpCapsule, TcpOptions, TcpWindow};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub const MAGIC: [u8; 4] = *b"PSLC";
pub const FORMAT_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 20;
/// Bound on a capsule's body: both socket queues (a few MB at most with default buffers) and
/// the application state.
pub const MAX_BODY: usize = 64 << 20;

const F_SACK: u8 = 1;
const F_TS: u8 = 2;
const F_WSCALE: u8 = 4;
const F_NODELAY: u8 = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("capsule truncated: {have} bytes, the header alone is {HEADER_LEN}")]
    ShortHeader { have: usize },
    #[error("not a slice capsule (magic {0:02x?}, expected \"PSLC\")")]
    BadMagic([u8; 4]),
    #[error("capsule format version {found}, this build reads only version {supported}")]
    Version { found: u16, supported: u16 },
    #[error("capsule header: reserved field is {0:#x}, must be 0")]
    Reserved(u16),
    #[error("capsule body declared {declared} bytes, {actual} follow the header")]
    Length { declared: usize, actual: usize },
    #[error("capsule body of {0} bytes exceeds the bound of {MAX_BODY}")]
    TooLarge(usize),
    #[error("capsule checksum mismatch (damaged capsule)")]
    Checksum,
    #[error("capsule truncated in field {0}")]
    Truncated(&'static str),
    #[error("capsule field {field}: {why}")]
    Invalid { field: &'static str, why: String },
    #[error("capsule has {0} trailing bytes after its last field")]
    Trailing(usize),
}

/// FNV-1a 64: small, no dependency, good enough to tell damage from intent.
pub fn fnv1a(mut h: u64, data: &[u8]) -> u64 {
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Encodes `s` (never fails: every field has a fixed or length-prefixed encoding).
pub fn encode(s: &Slice) -> Vec<u8> {
    let mut b = Vec::with_capacity(
        160 + s.tcp.send_queue.len() + s.tcp.recv_queue.len() + s.pending_out.len() + s.app.len(),
    );
    b.extend_from_slice(&s.session_id.to_le_bytes());
    let t = &s.tcp;
    put_addr(&mut b, &t.local);
    put_addr(&mut b, &t.remote);
    put_u32(&mut b, t.send_seq);
    put_u32(&mut b, t.recv_seq);
    put_u32(&mut b, t.options.mss);
    let mut flags = 0;
    if t.options.sack {
        flags |= F_SACK;
    }
    if t.options.timestamps {
        flags |= F_TS;
    }
    if t.options.wscale.is_some() {
        flags |= F_WSCALE;
    }
    if t.nodelay {
        flags |= F_NODELAY;
    }
    let (sw, rw) = t.options.wscale.unwrap_or((0, 0));
    b.extend_from_slice(&[flags, sw, rw]);
    put_u32(&mut b, t.timestamp);
    b.extend_from_slice(&t.captured_at_ms.to_le_bytes());
    b.extend_from_slice(&t.netns.to_le_bytes());
    let w = &t.window;
    for v in [w.snd_wl1, w.snd_wnd, w.max_window, w.rcv_wnd, w.rcv_wup] {
        put_u32(&mut b, v);
    }
    put_u32(&mut b, t.unsent);
    put_bytes(&mut b, &t.send_queue);
    put_bytes(&mut b, &t.recv_queue);
    put_bytes(&mut b, &s.pending_out);
    put_bytes(&mut b, &s.app);

    let mut out = Vec::with_capacity(HEADER_LEN + b.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(&fnv1a(FNV_OFFSET, &b).to_le_bytes());
    out.extend_from_slice(&b);
    out
}

/// Decodes a capsule; any other version, truncation, damage or inconsistency is a typed error.
pub fn decode(bytes: &[u8]) -> Result<Slice, FormatError> {
    if bytes.len() < HEADER_LEN {
        // A short capsule of another format version is still named as such when the version
        // field is there: the more useful error.
        if bytes.len() >= 6 && bytes[..4] == MAGIC {
            check_version(u16::from_le_bytes([bytes[4], bytes[5]]))?;
        }
        return Err(FormatError::ShortHeader { have: bytes.len() });
    }
    let magic: [u8; 4] = bytes[..4].try_into().unwrap_or_default();
    if magic != MAGIC {
        return Err(FormatError::BadMagic(magic));
    }
    check_version(u16::from_le_bytes([bytes[4], bytes[5]]))?;
    let reserved = u16::from_le_bytes([bytes[6], bytes[7]]);
    if reserved != 0 {
        return Err(FormatError::Reserved(reserved));
    }
    let declared = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default()) as usize;
    if declared > MAX_BODY {
        return Err(FormatError::TooLarge(declared));
    }
    let body = &bytes[HEADER_LEN..];
    if declared != body.len() {
        return Err(FormatError::Length {
            declared,
            actual: body.len(),
        });
    }
    let sum = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    if fnv1a(FNV_OFFSET, body) != sum {
        return Err(FormatError::Checksum);
    }
    let mut r = Reader(body);
    let session_id = r.u64("session_id")?;
    let local = r.addr("tcp.local")?;
    let remote = r.addr("tcp.remote")?;
    if local.is_ipv4() != remote.is_ipv4() {
        return Err(FormatError::Invalid {
            field: "tcp.remote",
            why: "address family differs from the local address".into(),
        });
    }
    let send_seq = r.u32("tcp.send_seq")?;
    let recv_seq = r.u32("tcp.recv_seq")?;
    let mss = r.u32("tcp.mss")?;
    let flags = r.u8("tcp.flags")?;
    if flags & !(F_SACK | F_TS | F_WSCALE | F_NODELAY) != 0 {
        return Err(FormatError::Invalid {
            field: "tcp.flags",
            why: format!("unknown bits {flags:#x}"),
        });
    }
    let sw = r.u8("tcp.snd_wscale")?;
    let rw = r.u8("tcp.rcv_wscale")?;
    // RFC 7323: a shift count above 14 is not a valid window scale.
    if sw > 14 || rw > 14 {
        return Err(FormatError::Invalid {
            field: "tcp.wscale",
            why: format!("shift {sw}/{rw} above 14"),
        });
    }
    let timestamp = r.u32("tcp.timestamp")?;
    let captured_at_ms = r.u64("tcp.captured_at_ms")?;
    let netns = r.u64("tcp.netns")?;
    let window = TcpWindow {
        snd_wl1: r.u32("tcp.window")?,
        snd_wnd: r.u32("tcp.window")?,
        max_window: r.u32("tcp.window")?,
        rcv_wnd: r.u32("tcp.window")?,
        rcv_wup: r.u32("tcp.window")?,
    };
    let unsent = r.u32("tcp.unsent")?;
    let send_queue = r.bytes("tcp.send_queue")?;
    if unsent as usize > send_queue.len() {
        return Err(FormatError::Invalid {
            field: "tcp.unsent",
            why: format!(
                "{unsent} unsent bytes in a send queue of {}",
                send_queue.len()
            ),
        });
    }
    let recv_queue = r.bytes("tcp.recv_queue")?;
    let pending_out = r.bytes("pending_out")?;
    let app = r.bytes("app")?;
    if !r.0.is_empty() {
        return Err(FormatError::Trailing(r.0.len()));
    }
    Ok(Slice {
        session_id,
        tcp: TcpCapsule {
            local,
            remote,
            send_seq,
            recv_seq,
            send_queue,
            unsent,
            recv_queue,
            options: TcpOptions {
                mss,
                wscale: (flags & F_WSCALE != 0).then_some((sw, rw)),
                sack: flags & F_SACK != 0,
                timestamps: flags & F_TS != 0,
            },
            window,
            timestamp,
            captured_at_ms,
            netns,
            nodelay: flags & F_NODELAY != 0,
        },
        pending_out,
        app,
    })
}

fn check_version(found: u16) -> Result<(), FormatError> {
    if found == FORMAT_VERSION {
        Ok(())
    } else {
        Err(FormatError::Version {
            found,
            supported: FORMAT_VERSION,
        })
    }
}

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(b: &mut Vec<u8>, v: &[u8]) {
    put_u32(b, v.len() as u32);
    b.extend_from_slice(v);
}

fn put_addr(b: &mut Vec<u8>, a: &SocketAddr) {
    match a.ip() {
        IpAddr::V4(ip) => {
            b.push(4);
            b.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            b.push(6);
            b.extend_from_slice(&ip.octets());
        }
    }
    b.extend_from_slice(&a.port().to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], FormatError> {
        if self.0.len() < n {
            return Err(FormatError::Truncated(field));
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, FormatError> {
        Ok(self.take(1, field)?[0])
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, FormatError> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, FormatError> {
        let lo = self.u32(field)? as u64;
        let hi = self.u32(field)? as u64;
        Ok(lo | hi << 32)
    }

    fn bytes(&mut self, field: &'static str) -> Result<Vec<u8>, FormatError> {
        let n = self.u32(field)? as usize;
        // Checked against what is left before allocating: a garbage length cannot allocate.
        Ok(self.take(n, field)?.to_vec())
    }

    fn addr(&mut self, field: &'static str) -> Result<SocketAddr, FormatError> {
        let ip = match self.u8(field)? {
            4 => {
                let o: [u8; 4] = self.take(4, field)?.try_into().unwrap_or_default();
                IpAddr::V4(Ipv4Addr::from(o))
            }
            6 => {
                let o: [u8; 16] = self.take(16, field)?.try_into().unwrap_or_default();
                IpAddr::V6(Ipv6Addr::from(o))
            }
            f => {
                return Err(FormatError::Invalid {
                    field,
                    why: format!("address family {f}, expected 4 or 6"),
                })
            }
        };
        let p = self.take(2, field)?;
        Ok(SocketAddr::new(ip, u16::from_le_bytes([p[0], p[1]])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pliant_testkit::XorShift;

    fn sample(rng: &mut XorShift) -> Slice {
        let mut bytes = |n: u64| -> Vec<u8> {
            let n = rng.below(n);
            (0..n).map(|_| rng.next() as u8).collect()
        };
        let send_queue = bytes(300);
        let recv_queue = bytes(300);
        let pending_out = bytes(50);
        let app = bytes(100);
        let unsent = rng.below(send_queue.len() as u64 + 1) as u32;
        let v6 = rng.below(2) == 1;
        let addr = |rng: &mut XorShift| {
            if v6 {
                SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::from(
                        rng.next() as u128 | (rng.next() as u128) << 64,
                    )),
                    rng.next() as u16,
                )
            } else {
                SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::from(rng.next() as u32)),
                    rng.next() as u16,
                )
            }
        };
        Slice {
            session_id: rng.next(),
            tcp: TcpCapsule {
                local: addr(rng),
                remote: addr(rng),
                send_seq: rng.next() as u32,
                recv_seq: rng.next() as u32,
                send_queue,
                unsent,
                recv_queue,
                options: TcpOptions {
                    mss: rng.next() as u32,
                    wscale: (rng.below(2) == 1).then(|| (rng.below(15) as u8, rng.below(15) as u8)),
                    sack: rng.below(2) == 1,
                    timestamps: rng.below(2) == 1,
                },
                window: TcpWindow {
                    snd_wl1: rng.next() as u32,
                    snd_wnd: rng.next() as u32,
                    max_window: rng.next() as u32,
                    rcv_wnd: rng.next() as u32,
                    rcv_wup: rng.next() as u32,
                },
                timestamp: rng.next() as u32,
                captured_at_ms: rng.next(),
                netns: rng.next(),
                nodelay: rng.below(2) == 1,
            },
            pending_out,
            app,
        }
    }

    #[test]
    fn random_slices_round_trip() {
        let mut rng = XorShift(0x5eed_51ce);
        for _ in 0..2000 {
            let s = sample(&mut rng);
            assert_eq!(decode(&encode(&s)), Ok(s));
        }
    }

    #[test]
    fn another_version_is_refused_naming_both() {
        let mut b = encode(&sample(&mut XorShift(7)));
        b[4..6].copy_from_slice(&2u16.to_le_bytes());
        let e = decode(&b).unwrap_err();
        assert_eq!(
            e,
            FormatError::Version {
                found: 2,
                supported: 1
            }
        );
        assert!(e.to_string().contains("version 2") && e.to_string().contains("version 1"));
        // Named as such even when the rest of a capsule of the other version is cut off.
        assert!(matches!(decode(&b[..8]), Err(FormatError::Version { .. })));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = encode(&sample(&mut XorShift(11)));
        for n in 0..b.len() {
            assert!(decode(&b[..n]).is_err(), "prefix of {n} bytes decoded");
        }
    }

    #[test]
    fn garbage_and_bit_flips_never_panic_and_never_pass_silently() {
        let mut rng = XorShift(0xfeed);
        for _ in 0..20_000 {
            let n = rng.below(200) as usize;
            let g: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            assert!(decode(&g).is_err());
        }
        // A flipped bit anywhere: the checksum (body) or a header check (header) refuses it.
        for _ in 0..500 {
            let mut b = encode(&sample(&mut rng));
            let i = rng.below(b.len() as u64) as usize;
            b[i] ^= 1 << rng.below(8);
            assert!(decode(&b).is_err(), "flip at {i} accepted");
        }
    }

    #[test]
    fn a_valid_checksum_over_inconsistent_fields_is_still_refused() {
        // Re-seal a body whose field lengths lie: the length checks, not the checksum, catch it.
        let mut rng = XorShift(3);
        for _ in 0..2000 {
            let mut b = encode(&sample(&mut rng));
            let i = HEADER_LEN + rng.below((b.len() - HEADER_LEN) as u64) as usize;
            b[i] = rng.next() as u8;
            let sum = fnv1a(FNV_OFFSET, &b[HEADER_LEN..]);
            b[12..20].copy_from_slice(&sum.to_le_bytes());
            // Either it decodes to something (a changed value) or a typed error; never a panic.
            let _ = decode(&b);
        }
        let mut b = encode(&sample(&mut rng));
        b.push(0);
        let body_len = (b.len() - HEADER_LEN) as u32;
        b[8..12].copy_from_slice(&body_len.to_le_bytes());
        let sum = fnv1a(FNV_OFFSET, &b[HEADER_LEN..]);
        b[12..20].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(decode(&b), Err(FormatError::Trailing(1)));
    }
}
