//! A small PostgreSQL v3 wire-protocol codec: only the framing and the few messages the proxy
//! must build or inspect. Everything else is forwarded as opaque frames.
//!
//! Bounds: a frame body larger than [`MAX_FRAME_BYTES`] is refused (PostgreSQL allows 1 GB;
//! the proxy keeps every frame of an unfinished request cycle in memory, so it caps them).

use std::io::{self, Read, Write};

/// Largest frame body the proxy accepts, in bytes.
pub const MAX_FRAME_BYTES: usize = 16 << 20;
/// Largest startup packet (PostgreSQL itself caps it at 10000 bytes).
pub const MAX_STARTUP_BYTES: usize = 10_000;
pub const PROTOCOL_V3: u32 = 196_608;
pub const SSL_REQUEST: u32 = 80_877_103;
pub const GSSENC_REQUEST: u32 = 80_877_104;
pub const CANCEL_REQUEST: u32 = 80_877_102;

/// Errors of the codec, each saying what was wrong with the bytes.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error("invalid message length {0}")]
    BadLength(i64),
    #[error("malformed {0} message")]
    Malformed(&'static str),
    #[error("unsupported frontend protocol {0}.{1}")]
    Version(u32, u32),
}

/// One typed protocol message: type byte and body (without the length word).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub tag: u8,
    pub body: Vec<u8>,
}

impl Frame {
    pub fn new(tag: u8, body: Vec<u8>) -> Self {
        Frame { tag, body }
    }
    /// Serialised bytes (tag, length, body).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.body.len() + 5);
        self.encode_into(&mut v);
        v
    }
    pub fn encode_into(&self, v: &mut Vec<u8>) {
        v.push(self.tag);
        v.extend_from_slice(&((self.body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(&self.body);
    }
}

/// Reads one typed frame; `Ok(None)` on a clean EOF before the first byte.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, ProtoError> {
    let mut hdr = [0u8; 5];
    let mut got = 0;
    while got < 5 {
        // A signal (a handler, or a stop and continue of the process while the socket has a
        // read timeout) interrupts the read without anything being wrong with the stream.
        let n = match r.read(&mut hdr[got..]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            n => n?,
        };
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(ProtoError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
    }
    let len = i32::from_be_bytes([hdr[1], hdr[2], hdr[3], hdr[4]]) as i64;
    if len < 4 || (len as usize - 4) > MAX_FRAME_BYTES {
        return Err(ProtoError::BadLength(len));
    }
    let mut body = vec![0u8; len as usize - 4];
    r.read_exact(&mut body)?;
    Ok(Some(Frame { tag: hdr[0], body }))
}

/// Incremental frame parser over a byte buffer (for non-blocking pumps).
/// Returns the frame and the number of bytes it used, or `Ok(None)` if incomplete.
pub fn parse_frame(buf: &[u8]) -> Result<Option<(Frame, usize)>, ProtoError> {
    Ok(parse_frame_ref(buf)?.map(|(tag, body, used)| (Frame::new(tag, body.to_vec()), used)))
}

/// A frame where it lies in a buffer: (tag, body, bytes used); the whole frame is
/// `buf[..used]`.
pub type FrameRef<'a> = (u8, &'a [u8], usize);

/// `parse_frame` without copying, so a forwarded frame can be copied out as it came.
pub fn parse_frame_ref(buf: &[u8]) -> Result<Option<FrameRef<'_>>, ProtoError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as i64;
    if len < 4 || (len as usize - 4) > MAX_FRAME_BYTES {
        return Err(ProtoError::BadLength(len));
    }
    let total = 1 + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    Ok(Some((buf[0], &buf[5..total], total)))
}

/// The untyped first packet of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Startup {
    Ssl,
    GssEnc,
    Cancel {
        pid: u32,
        key: u32,
    },
    /// Protocol 3.0 startup with its (name, value) parameters in order.
    Params(Vec<(String, String)>),
}

/// Reads the startup packet.
pub fn read_startup(r: &mut impl Read) -> Result<Option<Startup>, ProtoError> {
    let mut lenb = [0u8; 4];
    loop {
        match r.read(&mut lenb[..1]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Ok(0) => return Ok(None),
            Ok(_) => break r.read_exact(&mut lenb[1..])?,
            Err(e) => return Err(e.into()),
        }
    }
    let len = i32::from_be_bytes(lenb) as i64;
    if !(8..=MAX_STARTUP_BYTES as i64).contains(&len) {
        return Err(ProtoError::BadLength(len));
    }
    let mut body = vec![0u8; len as usize - 4];
    r.read_exact(&mut body)?;
    parse_startup_body(&body).map(Some)
}

pub fn parse_startup_body(body: &[u8]) -> Result<Startup, ProtoError> {
    if body.len() < 4 {
        return Err(ProtoError::Malformed("startup packet"));
    }
    let code = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
    match code {
        SSL_REQUEST => Ok(Startup::Ssl),
        GSSENC_REQUEST => Ok(Startup::GssEnc),
        CANCEL_REQUEST => {
            if body.len() != 12 {
                return Err(ProtoError::Malformed("CancelRequest"));
            }
            let pid = u32::from_be_bytes([body[4], body[5], body[6], body[7]]);
            let key = u32::from_be_bytes([body[8], body[9], body[10], body[11]]);
            Ok(Startup::Cancel { pid, key })
        }
        _ if code >> 16 != 3 => Err(ProtoError::Version(code >> 16, code & 0xffff)),
        _ => {
            let mut params = Vec::new();
            let mut rest = &body[4..];
            loop {
                let (name, r) = cstr(rest).ok_or(ProtoError::Malformed("StartupMessage"))?;
                if name.is_empty() {
                    break;
                }
                let (val, r) = cstr(r).ok_or(ProtoError::Malformed("StartupMessage"))?;
                params.push((name.to_string(), val.to_string()));
                rest = r;
            }
            Ok(Startup::Params(params))
        }
    }
}

/// Encodes a protocol 3.0 StartupMessage.
pub fn startup_message(params: &[(String, String)]) -> Vec<u8> {
    let mut body = PROTOCOL_V3.to_be_bytes().to_vec();
    for (k, v) in params {
        put_cstr(&mut body, k);
        put_cstr(&mut body, v);
    }
    body.push(0);
    let mut v = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    v.extend(body);
    v
}

/// Splits a NUL-terminated UTF-8 string off the front of `b`.
pub fn cstr(b: &[u8]) -> Option<(&str, &[u8])> {
    let end = b.iter().position(|&c| c == 0)?;
    let s = std::str::from_utf8(&b[..end]).ok()?;
    Some((s, &b[end + 1..]))
}

pub fn put_cstr(v: &mut Vec<u8>, s: &str) {
    v.extend_from_slice(s.as_bytes());
    v.push(0);
}

/// Severity and SQLSTATE of an ErrorResponse the proxy generates.
pub fn error_response(severity: &str, code: &str, message: &str) -> Frame {
    let mut b = Vec::new();
    for (t, s) in [
        (b'S', severity),
        (b'V', severity),
        (b'C', code),
        (b'M', message),
    ] {
        b.push(t);
        put_cstr(&mut b, s);
    }
    b.push(0);
    Frame::new(b'E', b)
}

/// Field of an ErrorResponse/NoticeResponse body by its one-byte code.
pub fn error_field(body: &[u8], field: u8) -> Option<String> {
    let mut rest = body;
    while let Some((&t, r)) = rest.split_first() {
        if t == 0 {
            return None;
        }
        let (s, r) = cstr(r)?;
        if t == field {
            return Some(s.to_string());
        }
        rest = r;
    }
    None
}

pub fn ready_for_query(status: u8) -> Frame {
    Frame::new(b'Z', vec![status])
}
pub fn command_complete(tag: &str) -> Frame {
    let mut b = Vec::new();
    put_cstr(&mut b, tag);
    Frame::new(b'C', b)
}
pub fn query(sql: &str) -> Frame {
    let mut b = Vec::new();
    put_cstr(&mut b, sql);
    Frame::new(b'Q', b)
}
pub fn parameter_status(k: &str, v: &str) -> Frame {
    let mut b = Vec::new();
    put_cstr(&mut b, k);
    put_cstr(&mut b, v);
    Frame::new(b'S', b)
}
pub fn auth(code: u32, extra: &[u8]) -> Frame {
    let mut b = code.to_be_bytes().to_vec();
    b.extend_from_slice(extra);
    Frame::new(b'R', b)
}
pub fn password_message(pw: &str) -> Frame {
    let mut b = Vec::new();
    put_cstr(&mut b, pw);
    Frame::new(b'p', b)
}

/// SASLInitialResponse: mechanism, then the length-prefixed client-first-message.
pub fn sasl_initial_response(mechanism: &str, data: &[u8]) -> Frame {
    let mut b = Vec::new();
    put_cstr(&mut b, mechanism);
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    Frame::new(b'p', b)
}

/// Parses a SASLInitialResponse body into (mechanism, data).
pub fn parse_sasl_initial_response(body: &[u8]) -> Result<(&str, &[u8]), ProtoError> {
    let bad = ProtoError::Malformed("SASLInitialResponse");
    let (mech, rest) = cstr(body).ok_or(bad)?;
    let len = rest
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map(i32::from_be_bytes)
        .ok_or(ProtoError::Malformed("SASLInitialResponse"))?;
    let data = &rest[4..];
    if len < 0 || len as usize != data.len() {
        return Err(ProtoError::Malformed("SASLInitialResponse"));
    }
    Ok((mech, data))
}

/// The md5 password response: "md5" + md5hex(md5hex(password + user) + salt).
pub fn md5_password(user: &str, password: &str, salt: &[u8; 4]) -> String {
    use md5::{Digest, Md5};
    let inner = hex(&Md5::digest(format!("{password}{user}").as_bytes()));
    let mut h = Md5::new();
    h.update(inner.as_bytes());
    h.update(salt);
    format!("md5{}", hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// First data column of each DataRow ('D') frame body, as text (None = SQL NULL).
pub fn data_row_columns(body: &[u8]) -> Option<Vec<Option<String>>> {
    if body.len() < 2 {
        return None;
    }
    let n = u16::from_be_bytes([body[0], body[1]]) as usize;
    let mut out = Vec::with_capacity(n);
    let mut p = 2;
    for _ in 0..n {
        let len = i32::from_be_bytes(body.get(p..p + 4)?.try_into().ok()?);
        p += 4;
        if len < 0 {
            out.push(None);
        } else {
            let l = len as usize;
            out.push(Some(
                String::from_utf8_lossy(body.get(p..p + l)?).into_owned(),
            ));
            p += l;
        }
    }
    Some(out)
}

/// Writes all frames in one syscall.
pub fn write_frames(w: &mut impl Write, frames: &[Frame]) -> io::Result<()> {
    let mut v = Vec::new();
    for f in frames {
        f.encode_into(&mut v);
    }
    w.write_all(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands out one byte per read and fails every other read with EINTR, as a socket with
    /// a read timeout does when the process is stopped and continued.
    struct Interrupting<'a> {
        data: &'a [u8],
        tick: bool,
    }

    impl Read for Interrupting<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.tick = !self.tick;
            if self.tick {
                return Err(io::ErrorKind::Interrupted.into());
            }
            if self.data.is_empty() || buf.is_empty() {
                return Ok(0);
            }
            buf[0] = self.data[0];
            self.data = &self.data[1..];
            Ok(1)
        }
    }

    #[test]
    fn an_interrupted_read_is_retried_not_an_error() {
        let mut wire = Vec::new();
        write_frames(&mut wire, &[Frame::new(b'Q', b"SELECT 1\0".to_vec())]).unwrap();
        let mut r = Interrupting {
            data: &wire,
            tick: false,
        };
        let f = read_frame(&mut r).expect("read").expect("a frame");
        assert_eq!((f.tag, &f.body[..]), (b'Q', &b"SELECT 1\0"[..]));
        assert!(read_frame(&mut r).expect("clean end").is_none());
    }

    #[test]
    fn frame_round_trip_and_incremental_parse() {
        let f = query("select 1");
        let bytes = f.encode();
        assert_eq!(parse_frame(&bytes[..3]).unwrap(), None);
        let (g, used) = parse_frame(&bytes).unwrap().unwrap();
        assert_eq!(g, f);
        assert_eq!(used, bytes.len());
        let mut cur = &bytes[..];
        assert_eq!(read_frame(&mut cur).unwrap().unwrap(), f);
    }

    #[test]
    fn bad_lengths_are_rejected() {
        let bad = [b'Q', 0, 0, 0, 2];
        assert!(matches!(parse_frame(&bad), Err(ProtoError::BadLength(2))));
        let huge = [b'Q', 0x7f, 0xff, 0xff, 0xff];
        assert!(matches!(parse_frame(&huge), Err(ProtoError::BadLength(_))));
        let neg = [0xffu8, 0xff, 0xff, 0xff];
        assert!(read_startup(&mut &neg[..]).is_err());
    }

    #[test]
    fn startup_round_trip() {
        let p = vec![
            ("user".to_string(), "bob".to_string()),
            ("database".into(), "db".into()),
        ];
        let bytes = startup_message(&p);
        assert_eq!(
            read_startup(&mut &bytes[..]).unwrap(),
            Some(Startup::Params(p))
        );
        let mut ssl = 8u32.to_be_bytes().to_vec();
        ssl.extend(SSL_REQUEST.to_be_bytes());
        assert_eq!(read_startup(&mut &ssl[..]).unwrap(), Some(Startup::Ssl));
        let mut v2 = 8u32.to_be_bytes().to_vec();
        v2.extend(0x0002_0000u32.to_be_bytes());
        assert!(matches!(
            read_startup(&mut &v2[..]),
            Err(ProtoError::Version(2, 0))
        ));
        // Unterminated parameter list.
        let mut bad = 10u32.to_be_bytes().to_vec();
        bad.extend(PROTOCOL_V3.to_be_bytes());
        bad.extend(b"ab");
        assert!(read_startup(&mut &bad[..]).is_err());
    }

    #[test]
    fn md5_matches_postgres_reference() {
        // md5("") is the classic test vector; the composite value was computed with
        // PostgreSQL's own algorithm by hand from it for user "u", password "p".
        use md5::{Digest, Md5};
        assert_eq!(hex(&Md5::digest(b"")), "d41d8cd98f00b204e9800998ecf8427e");
        let a = md5_password("u", "p", &[1, 2, 3, 4]);
        let b = md5_password("u", "p", &[1, 2, 3, 5]);
        assert!(a.starts_with("md5") && a.len() == 35);
        assert_ne!(a, b);
    }

    #[test]
    fn sasl_initial_response_round_trip() {
        let f = sasl_initial_response("SCRAM-SHA-256", b"n,,n=,r=abc");
        assert_eq!(
            parse_sasl_initial_response(&f.body).unwrap(),
            ("SCRAM-SHA-256", &b"n,,n=,r=abc"[..])
        );
        let mut short = f.body.clone();
        short.pop();
        assert!(parse_sasl_initial_response(&short).is_err());
        assert!(parse_sasl_initial_response(b"SCRAM").is_err());
        assert!(parse_sasl_initial_response(b"M\0\xff\xff\xff\xff").is_err());
    }

    #[test]
    fn error_fields_and_rows() {
        let e = error_response("FATAL", "28P01", "nope");
        assert_eq!(error_field(&e.body, b'C').as_deref(), Some("28P01"));
        assert_eq!(error_field(&e.body, b'M').as_deref(), Some("nope"));
        assert_eq!(error_field(&[1, 2], b'C'), None);
        let row = [0u8, 2, 0, 0, 0, 1, b'7', 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            data_row_columns(&row).unwrap(),
            vec![Some("7".into()), None]
        );
        assert_eq!(data_row_columns(&row[..6]), None);
    }
}
