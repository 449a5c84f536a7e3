//! The authenticated session every channel runs in, over unix and TCP alike.
//!
//! Handshake (SIGMA-style, three frames then a confirmation; both sides prove their
//! certificate's key over a transcript that includes both fresh ephemeral keys):
//! ```text
//!   client                                             server
//!   Hello { eph_c, nonce_c, encrypt }              ->
//!                                                  <-  ServerHello { eph_s, nonce_s, encrypt',
//!                                                        cert_s, sig_s(th) }
//!   [sealed c2s #0] ClientAuth { cert_c,
//!                      sig_c(th, cert_c) }          ->
//!                                                  <-  [sealed s2c #0] Accepted
//! ```
//! `th` = SHA-256 over a label, the Hello frame and the ServerHello fields before the signature.
//! Keys: HKDF-SHA256 (salt `th`, secret X25519(eph_c, eph_s)) expanded to one AES-256-GCM key
//! per direction. The ephemeral keys give forward secrecy; the signatures over `th` bind each
//! side's certified name to this very exchange (a recorded handshake replays to nothing, a
//! man in the middle cannot substitute its own ephemeral key without a CA-signed key to sign
//! with); the first sealed frame each way confirms both derived the same keys.
//!
//! After it, every frame is sealed with its direction's key and an implicit sequence number
//! as nonce: a frame dropped, replayed, reordered, or injected by someone without the key
//! fails its tag, and the connection is closed. `encrypt` = false still authenticates every
//! frame (the body is authenticated data of an empty AES-GCM message, i.e. GMAC) but leaves
//! it readable; either side asking for encryption gets it.
//!
//! Why this and not TLS 1.3 (rustls): the replication and logging channels read on one thread
//! and write on another, and a rustls connection is one state machine that both directions go
//! through (a lock on the packet path); the per-direction [`Sealer`] and [`Opener`] here split
//! freely. The primitives are ring's (the same ones rustls uses here); only the message
//! layout is ours, and it is the standard sign-the-transcript pattern.

use crate::endpoint::Stream;
use crate::frame::{self, FrameError, Header, HEADER_LEN, PROTOCOL_VERSION, TAG_LEN};
use crate::identity::{now_unix, Identity, IdentityError, NodeCert};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use ring::agreement::{agree_ephemeral, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::digest::{Context, SHA256};
use ring::hkdf::{Salt, HKDF_SHA256};
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{UnparsedPublicKey as SigKey, ED25519};
use serde::{Deserialize, Serialize};
use std::io::{self, Read};
use std::ops::Range;
use std::time::{Duration, Instant};

const KIND_HELLO: u16 = 1;
const KIND_SERVER_HELLO: u16 = 2;
const KIND_CLIENT_AUTH: u16 = 3;
const KIND_ACCEPTED: u16 = 4;
const KIND_REFUSED: u16 = 5;
/// Bound on a handshake frame (a certificate is ~150 bytes).
const MAX_HANDSHAKE_FRAME: usize = 4096;
const TRANSCRIPT_LABEL: &[u8] = b"pliant-wire-handshake-v1";

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("peer certificate refused: {0}")]
    Cert(IdentityError),
    #[error("peer's handshake signature does not verify (not the certificate's key, or a replay)")]
    BadSignature,
    #[error("peer is {got:?}, expected {expected:?}")]
    PeerName { expected: String, got: String },
    #[error("peer {name:?} holds roles {roles:#x}, none of {need:#x} this channel requires")]
    Role { name: String, roles: u32, need: u32 },
    #[error("peer refused the handshake: {0}")]
    Refused(String),
    #[error("handshake not finished within {0:?}")]
    TimedOut(Duration),
    #[error("no randomness from the kernel")]
    Random,
    #[error("handshake: {0}")]
    Protocol(&'static str),
}

impl SessionError {
    /// Whether the peer failed to prove an identity this side accepts (a certificate of
    /// another CA or expired, a signature that does not verify, another name or role than
    /// required), as opposed to a handshake that broke off (closed, stalled, garbage, timed
    /// out). Servers count the two apart: the first is someone knocking with the wrong key.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            SessionError::Cert(_)
                | SessionError::BadSignature
                | SessionError::Role { .. }
                | SessionError::PeerName { .. }
        )
    }
}

/// What a side requires of its peer.
#[derive(Debug, Clone, Default)]
pub struct Expect {
    /// The peer's certified name must be this one (a client dialling a known node).
    pub name: Option<String>,
    /// The peer must hold at least one of these roles (0: any).
    pub roles: u32,
}

/// Session parameters of one side.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Ask for encrypted frames (always granted if either side asks).
    pub encrypt: bool,
    /// Largest frame body this side accepts after the handshake.
    pub max_body: usize,
    /// The whole handshake must finish within this, however the peer trickles its bytes.
    pub handshake_timeout: Duration,
    pub expect: Expect,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            encrypt: true,
            max_body: 1 << 20,
            handshake_timeout: Duration::from_secs(5),
            expect: Expect::default(),
        }
    }
}

/// The authenticated peer of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub roles: u32,
}

impl Peer {
    pub fn has_role(&self, role: u32) -> bool {
        self.roles & role != 0
    }
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals the frames of one direction.
pub struct Sealer {
    key: LessSafeKey,
    seq: u64,
    encrypt: bool,
}

impl Sealer {
    /// Appends a sealed frame of `kind` with the postcard encoding of `m` to `out`.
    pub fn seal_msg<T: Serialize>(
        &mut self,
        kind: u16,
        m: &T,
        out: &mut Vec<u8>,
    ) -> Result<(), FrameError> {
        let start = out.len();
        out.extend_from_slice(&[0u8; HEADER_LEN]);
        let taken = std::mem::take(out);
        *out = match postcard::to_extend(m, taken) {
            Ok(v) => v,
            Err(e) => return Err(FrameError::Encode(e.to_string())),
        };
        self.seal_tail(kind, start, out)
    }

    /// Appends a sealed frame of `kind` carrying `body` to `out`.
    pub fn seal_bytes(
        &mut self,
        kind: u16,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), FrameError> {
        let start = out.len();
        out.extend_from_slice(&[0u8; HEADER_LEN]);
        out.extend_from_slice(body);
        self.seal_tail(kind, start, out)
    }

    /// `out[start..]` is a header placeholder and the body: fills the header, seals, appends
    /// the tag.
    fn seal_tail(&mut self, kind: u16, start: usize, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let body_len = out.len() - start - HEADER_LEN;
        let len = u32::try_from(body_len + TAG_LEN).map_err(|_| FrameError::TooLarge {
            len: body_len,
            max: u32::MAX as usize - TAG_LEN,
        })?;
        let h = Header {
            len,
            version: PROTOCOL_VERSION,
            kind,
        }
        .encode();
        out[start..start + HEADER_LEN].copy_from_slice(&h);
        // A nonce must never repeat under one key; 2^64 frames is not reachable, but refusing
        // is cheaper than reasoning about it.
        let seq = self.seq;
        self.seq = seq
            .checked_add(1)
            .ok_or(FrameError::Encode("sequence exhausted".into()))?;
        let tag = if self.encrypt {
            let (hdr, body) = out[start..].split_at_mut(HEADER_LEN);
            self.key
                .seal_in_place_separate_tag(nonce(seq), Aad::from(&*hdr), body)
        } else {
            self.key
                .seal_in_place_separate_tag(nonce(seq), Aad::from(&out[start..]), &mut [])
        }
        .map_err(|_| FrameError::Encode("seal failed".into()))?;
        out.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Frames sealed so far.
    pub fn sent(&self) -> u64 {
        self.seq
    }
}

/// Opens the frames of one direction, in order.
pub struct Opener {
    key: LessSafeKey,
    seq: u64,
    encrypt: bool,
    max_body: usize,
}

impl Opener {
    /// Bound on the header's length field (body plus tag).
    pub fn max_frame(&self) -> usize {
        self.max_body + TAG_LEN
    }

    pub fn set_max_body(&mut self, max: usize) {
        self.max_body = max;
    }

    /// Opens one whole frame in place (`frame` = header, body, tag): its kind and the body's
    /// range in `frame`. A frame that fails its tag is an error and the sequence does not
    /// advance (the caller closes the connection).
    pub fn open(&mut self, frame: &mut [u8]) -> Result<(u16, Range<usize>), FrameError> {
        let Some(h) = frame.first_chunk::<HEADER_LEN>() else {
            return Err(FrameError::Short);
        };
        let header = Header::decode(h);
        header.check(self.max_frame())?;
        if header.len as usize != frame.len() - HEADER_LEN {
            return Err(FrameError::Short);
        }
        if (header.len as usize) < TAG_LEN {
            return Err(FrameError::Short);
        }
        let body_end = frame.len() - TAG_LEN;
        let n = nonce(self.seq);
        if self.encrypt {
            let (hdr, rest) = frame.split_at_mut(HEADER_LEN);
            self.key
                .open_in_place(n, Aad::from(&*hdr), rest)
                .map_err(|_| FrameError::BadTag)?;
        } else {
            let (signed, tag) = frame.split_at_mut(body_end);
            self.key
                .open_in_place(n, Aad::from(&*signed), tag)
                .map_err(|_| FrameError::BadTag)?;
        }
        self.seq += 1;
        Ok((header.kind, HEADER_LEN..body_end))
    }

    /// Reads and opens one frame from a blocking reader into `buf`.
    pub fn read<R: Read + ?Sized>(
        &mut self,
        r: &mut R,
        buf: &mut Vec<u8>,
    ) -> Result<(u16, Range<usize>), FrameError> {
        frame::read_frame_into(r, self.max_frame(), buf)?;
        self.open(buf)
    }

    /// Opens the first frame in `buf` if it is complete (`Ok(None)` if not): kind, body range
    /// and bytes consumed. For readers that buffer a non-blocking socket.
    pub fn open_front(
        &mut self,
        buf: &mut [u8],
    ) -> Result<Option<(u16, Range<usize>, usize)>, FrameError> {
        let Some(loc) = frame::split_frame(buf, self.max_frame())? else {
            return Ok(None);
        };
        let (kind, body) = self.open(&mut buf[..loc.total])?;
        Ok(Some((kind, body, loc.total)))
    }

    /// Frames opened so far.
    pub fn received(&self) -> u64 {
        self.seq
    }
}

/// The result of a handshake: who the peer is, and the two directions' keys.
pub struct Session {
    pub peer: Peer,
    pub encrypted: bool,
    pub tx: Sealer,
    pub rx: Opener,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({:?}, encrypted {})", self.peer, self.encrypted)
    }
}

#[derive(Serialize, Deserialize)]
struct Hello {
    eph: [u8; 32],
    nonce: [u8; 32],
    encrypt: bool,
}

#[derive(Serialize, Deserialize, Clone)]
struct ServerHelloTbs {
    eph: [u8; 32],
    nonce: [u8; 32],
    encrypt: bool,
    cert: NodeCert,
}

#[derive(Serialize, Deserialize)]
struct ServerHello {
    tbs: ServerHelloTbs,
    sig: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
struct ClientAuth {
    cert: NodeCert,
    sig: Vec<u8>,
}

#[derive(Serialize, Deserialize)]
struct Refused {
    reason: String,
}

/// Reads with every `read` bounded by what is left until `deadline`, so a peer that trickles
/// one byte at a time cannot stretch the handshake past it.
struct DeadlineReader<'a> {
    s: &'a Stream,
    deadline: Instant,
    total: Duration,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("handshake deadline of {:?}", self.total),
            ));
        }
        self.s.set_read_timeout(Some(left))?;
        let mut s = self.s;
        s.read(buf)
    }
}

fn timed_out(e: &SessionError) -> bool {
    matches!(e, SessionError::Frame(FrameError::Io(io)) if matches!(io.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock))
}

fn send_by(s: &Stream, bytes: &[u8], deadline: Instant) -> Result<(), SessionError> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(FrameError::Io)?;
    s.send_all(bytes).map_err(FrameError::from)?;
    Ok(())
}

fn random32(rng: &SystemRandom) -> Result<[u8; 32], SessionError> {
    let mut b = [0u8; 32];
    rng.fill(&mut b).map_err(|_| SessionError::Random)?;
    Ok(b)
}

fn transcript(hello_frame: &[u8], tbs: &ServerHelloTbs) -> Result<[u8; 32], SessionError> {
    let mut c = Context::new(&SHA256);
    c.update(TRANSCRIPT_LABEL);
    c.update(&(hello_frame.len() as u64).to_le_bytes());
    c.update(hello_frame);
    c.update(&frame::encode_body(tbs, Vec::new())?);
    let mut th = [0u8; 32];
    th.copy_from_slice(c.finish().as_ref());
    Ok(th)
}

fn signed_by_server(th: &[u8; 32]) -> Vec<u8> {
    [b"server".as_slice(), th].concat()
}

fn signed_by_client(th: &[u8; 32], cert: &NodeCert) -> Vec<u8> {
    [b"client".as_slice(), th, &cert.to_bytes()].concat()
}

/// The peer's certificate is the CA's and what `o` expects, and its key signed `signed`.
fn verify_peer(
    cert: &NodeCert,
    me: &Identity,
    o: &SessionOptions,
    signed: &[u8],
    sig: &[u8],
) -> Result<Peer, SessionError> {
    let peer = check_peer(cert, &me.ca_pub, &o.expect)?;
    SigKey::new(&ED25519, &cert.key)
        .verify(signed, sig)
        .map_err(|_| SessionError::BadSignature)?;
    Ok(peer)
}

/// This side's two halves: sealing with `tx_key`, opening with `rx_key` (handshake-sized
/// frames until the caller raises the bound).
fn halves(tx_key: LessSafeKey, rx_key: LessSafeKey, encrypt: bool) -> (Sealer, Opener) {
    (
        Sealer {
            key: tx_key,
            seq: 0,
            encrypt,
        },
        Opener {
            key: rx_key,
            seq: 0,
            encrypt,
            max_body: MAX_HANDSHAKE_FRAME,
        },
    )
}

fn check_peer(cert: &NodeCert, ca_pub: &[u8; 32], expect: &Expect) -> Result<Peer, SessionError> {
    cert.verify(ca_pub, now_unix())
        .map_err(SessionError::Cert)?;
    if let Some(want) = &expect.name {
        if *want != cert.name {
            return Err(SessionError::PeerName {
                expected: want.clone(),
                got: cert.name.clone(),
            });
        }
    }
    if expect.roles != 0 && cert.roles & expect.roles == 0 {
        return Err(SessionError::Role {
            name: cert.name.clone(),
            roles: cert.roles,
            need: expect.roles,
        });
    }
    Ok(Peer {
        name: cert.name.clone(),
        roles: cert.roles,
    })
}

fn keys(
    eph: EphemeralPrivateKey,
    peer_eph: &[u8; 32],
    th: &[u8; 32],
) -> Result<(LessSafeKey, LessSafeKey), SessionError> {
    let derive = |shared: &[u8]| -> Result<(LessSafeKey, LessSafeKey), ring::error::Unspecified> {
        let prk = Salt::new(HKDF_SHA256, th).extract(shared);
        let c2s = UnboundKey::from(prk.expand(&[b"pliant-wire c2s"], &AES_256_GCM)?);
        let s2c = UnboundKey::from(prk.expand(&[b"pliant-wire s2c"], &AES_256_GCM)?);
        Ok((LessSafeKey::new(c2s), LessSafeKey::new(s2c)))
    };
    agree_ephemeral(eph, &UnparsedPublicKey::new(&X25519, peer_eph), derive)
        .map_err(|_| SessionError::Protocol("key agreement failed"))?
        .map_err(|_| SessionError::Protocol("key derivation failed"))
}

fn ephemeral(rng: &SystemRandom) -> Result<(EphemeralPrivateKey, [u8; 32]), SessionError> {
    let k = EphemeralPrivateKey::generate(&X25519, rng).map_err(|_| SessionError::Random)?;
    let p = k.compute_public_key().map_err(|_| SessionError::Random)?;
    let mut pub_ = [0u8; 32];
    pub_.copy_from_slice(p.as_ref());
    Ok((k, pub_))
}

/// Reads one plain handshake frame; a `Refused` from the peer becomes its reason.
fn read_plain(
    r: &mut DeadlineReader<'_>,
    buf: &mut Vec<u8>,
    want: u16,
) -> Result<(), SessionError> {
    let h = frame::read_frame_into(r, MAX_HANDSHAKE_FRAME, buf)?;
    if h.kind == KIND_REFUSED {
        let Refused { reason } = frame::decode_body(&buf[HEADER_LEN..])?;
        return Err(SessionError::Refused(reason.chars().take(512).collect()));
    }
    if h.kind != want {
        return Err(FrameError::UnexpectedKind(h.kind).into());
    }
    Ok(())
}

/// Tells the peer why (best effort: it may already be gone), so its operator sees a reason.
fn refuse(s: &Stream, why: &SessionError, deadline: Instant) {
    let mut f = Vec::new();
    if let Ok(b) = frame::encode_body(
        &Refused {
            reason: why.to_string(),
        },
        Vec::new(),
    ) {
        frame::push_plain(KIND_REFUSED, &b, &mut f);
        let _ = send_by(s, &f, deadline);
    }
}

fn finish(
    s: &Stream,
    r: Result<Session, SessionError>,
    total: Duration,
) -> Result<Session, SessionError> {
    // Timeouts were the handshake's; the channel sets its own.
    let _ = s.set_read_timeout(None);
    let _ = s.set_write_timeout(None);
    r.map_err(|e| {
        if timed_out(&e) {
            SessionError::TimedOut(total)
        } else {
            e
        }
    })
}

/// Client side: runs the handshake on a freshly connected stream.
pub fn client(s: &Stream, me: &Identity, o: &SessionOptions) -> Result<Session, SessionError> {
    let deadline = Instant::now() + o.handshake_timeout;
    let r = client_inner(s, me, o, deadline);
    finish(s, r, o.handshake_timeout)
}

fn client_inner(
    s: &Stream,
    me: &Identity,
    o: &SessionOptions,
    deadline: Instant,
) -> Result<Session, SessionError> {
    let rng = SystemRandom::new();
    let (eph, eph_pub) = ephemeral(&rng)?;
    let hello = Hello {
        eph: eph_pub,
        nonce: random32(&rng)?,
        encrypt: o.encrypt,
    };
    let mut hello_frame = Vec::new();
    frame::push_plain(
        KIND_HELLO,
        &frame::encode_body(&hello, Vec::new())?,
        &mut hello_frame,
    );
    send_by(s, &hello_frame, deadline)?;
    let mut r = DeadlineReader {
        s,
        deadline,
        total: o.handshake_timeout,
    };
    let mut buf = Vec::new();
    read_plain(&mut r, &mut buf, KIND_SERVER_HELLO)?;
    let sh: ServerHello = frame::decode_body(&buf[HEADER_LEN..])?;
    if o.encrypt && !sh.tbs.encrypt {
        return Err(SessionError::Protocol(
            "server refused to encrypt though asked",
        ));
    }
    let th = transcript(&hello_frame, &sh.tbs)?;
    let peer = verify_peer(&sh.tbs.cert, me, o, &signed_by_server(&th), &sh.sig)?;
    let (c2s, s2c) = keys(eph, &sh.tbs.eph, &th)?;
    let encrypt = sh.tbs.encrypt;
    let (mut tx, mut rx) = halves(c2s, s2c, encrypt);
    let auth = ClientAuth {
        cert: me.cert.clone(),
        sig: me.sign(&signed_by_client(&th, &me.cert)),
    };
    let mut out = Vec::new();
    tx.seal_msg(KIND_CLIENT_AUTH, &auth, &mut out)?;
    send_by(s, &out, deadline)?;
    // The server's verdict: Accepted (sealed: proves it derived the same keys) or Refused.
    let h = frame::read_frame_into(&mut r, MAX_HANDSHAKE_FRAME, &mut buf)?;
    if h.kind == KIND_REFUSED {
        let Refused { reason } = frame::decode_body(&buf[HEADER_LEN..])?;
        return Err(SessionError::Refused(reason.chars().take(512).collect()));
    }
    let (kind, _) = rx.open(&mut buf)?;
    if kind != KIND_ACCEPTED {
        return Err(FrameError::UnexpectedKind(kind).into());
    }
    rx.max_body = o.max_body;
    Ok(Session {
        peer,
        encrypted: encrypt,
        tx,
        rx,
    })
}

/// Server side: runs the handshake on an accepted stream. On failure the peer is told why
/// (when it is still there) and the caller closes the stream.
pub fn server(s: &Stream, me: &Identity, o: &SessionOptions) -> Result<Session, SessionError> {
    let deadline = Instant::now() + o.handshake_timeout;
    let r = server_inner(s, me, o, deadline);
    if let Err(e) = &r {
        if !timed_out(e) && !matches!(e, SessionError::Frame(FrameError::Closed)) {
            refuse(s, e, deadline);
        }
    }
    finish(s, r, o.handshake_timeout)
}

fn server_inner(
    s: &Stream,
    me: &Identity,
    o: &SessionOptions,
    deadline: Instant,
) -> Result<Session, SessionError> {
    let rng = SystemRandom::new();
    let mut r = DeadlineReader {
        s,
        deadline,
        total: o.handshake_timeout,
    };
    let mut hello_frame = Vec::new();
    read_plain(&mut r, &mut hello_frame, KIND_HELLO)?;
    let hello: Hello = frame::decode_body(&hello_frame[HEADER_LEN..])?;
    let (eph, eph_pub) = ephemeral(&rng)?;
    let encrypt = hello.encrypt || o.encrypt;
    let tbs = ServerHelloTbs {
        eph: eph_pub,
        nonce: random32(&rng)?,
        encrypt,
        cert: me.cert.clone(),
    };
    let th = transcript(&hello_frame, &tbs)?;
    let sh = ServerHello {
        sig: me.sign(&signed_by_server(&th)),
        tbs,
    };
    let mut out = Vec::new();
    frame::push_plain(
        KIND_SERVER_HELLO,
        &frame::encode_body(&sh, Vec::new())?,
        &mut out,
    );
    send_by(s, &out, deadline)?;
    let (c2s, s2c) = keys(eph, &hello.eph, &th)?;
    let (mut tx, mut rx) = halves(s2c, c2s, encrypt);
    let mut buf = Vec::new();
    let (kind, body) = rx.read(&mut r, &mut buf)?;
    if kind != KIND_CLIENT_AUTH {
        return Err(FrameError::UnexpectedKind(kind).into());
    }
    let auth: ClientAuth = frame::decode_body(&buf[body])?;
    let signed = signed_by_client(&th, &auth.cert);
    let peer = verify_peer(&auth.cert, me, o, &signed, &auth.sig)?;
    out.clear();
    tx.seal_bytes(KIND_ACCEPTED, &[], &mut out)?;
    send_by(s, &out, deadline)?;
    rx.max_body = o.max_body;
    Ok(Session {
        peer,
        encrypted: encrypt,
        tx,
        rx,
    })
}
