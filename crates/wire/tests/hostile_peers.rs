//! The session and codec against hostile peers: wrong CA, wrong name or role, another
//! protocol version, a peer trickling its handshake, tampered/replayed/reordered/injected
//! frames, a man in the middle flipping any byte of the handshake, declared huge frames.

use pliant_testkit::XorShift;
use pliant_wire::frame::{self, Header, HEADER_LEN, PROTOCOL_VERSION};
use pliant_wire::session::{self, Expect, SessionError, SessionOptions};
use pliant_wire::{role, Ca, Conn, Endpoint, FrameError, Identity, Listener, Stream, TcpTuning};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

fn pair() -> (Stream, Stream) {
    let (a, b) = UnixStream::pair().unwrap();
    (Stream::Unix(a), Stream::Unix(b))
}

fn opts(encrypt: bool) -> SessionOptions {
    SessionOptions {
        encrypt,
        max_body: 1 << 16,
        handshake_timeout: Duration::from_secs(5),
        expect: Expect::default(),
    }
}

/// Runs both handshakes on `(c, s)` streams; returns both results.
fn handshake(
    c: Stream,
    s: Stream,
    cid: &Identity,
    sid: &Identity,
    co: SessionOptions,
    so: SessionOptions,
) -> (Result<Conn, SessionError>, Result<Conn, SessionError>) {
    let sid = sid.clone();
    let srv = std::thread::spawn(move || Conn::server(s, &sid, &so));
    let cr = Conn::client(c, cid, &co);
    (cr, srv.join().unwrap())
}

#[test]
fn mutual_authentication_names_the_peers_and_carries_typed_frames() {
    let ca = Ca::generate(None).unwrap();
    let r1 = ca.issue("r1", role::REPLICA, 3600).unwrap();
    let r2 = ca.issue("r2", role::REPLICA, 3600).unwrap();
    for encrypt in [true, false] {
        let (c, s) = pair();
        let (cr, sr) = handshake(c, s, &r1, &r2, opts(encrypt), opts(false));
        let (mut c, mut s) = (cr.unwrap(), sr.unwrap());
        assert_eq!(c.peer.name, "r2");
        assert_eq!(s.peer.name, "r1");
        assert!(s.peer.has_role(role::REPLICA) && !s.peer.has_role(role::CONTROLLER));
        assert_eq!(c.encrypted, encrypt);
        assert_eq!(s.encrypted, encrypt);
        for i in 0..50u32 {
            c.send(20, &(i, "checkpoint".to_string())).unwrap();
            let (k, (j, t)): (u16, (u32, String)) = s.recv().unwrap();
            assert_eq!((k, j, t.as_str()), (20, i, "checkpoint"));
            s.send(21, &i).unwrap();
            assert_eq!(c.recv::<u32>().unwrap(), (21, i));
        }
    }
    // And over TCP.
    let t = TcpTuning::default();
    let l = Listener::bind(&"127.0.0.1:0".parse().unwrap(), &t).unwrap();
    let ep = l.local_endpoint().unwrap();
    let r2b = r2.clone();
    let srv = std::thread::spawn(move || {
        let s = l.accept().unwrap();
        let mut c = Conn::server(s, &r2b, &opts(false)).unwrap();
        let (_, v): (u16, Vec<u8>) = c.recv().unwrap();
        c.send(30, &v.len()).unwrap();
    });
    let mut c = Conn::connect(&ep, &r1, &opts(true), Duration::from_secs(2), &t).unwrap();
    c.send(30, &vec![7u8; 40_000]).unwrap();
    assert_eq!(c.recv::<usize>().unwrap(), (30, 40_000));
    srv.join().unwrap();
}

#[test]
fn encrypted_frames_hide_the_body_and_authenticated_ones_only_sign_it() {
    let ca = Ca::generate(None).unwrap();
    let a = ca.issue("a", role::REPLICA, 3600).unwrap();
    let b = ca.issue("b", role::REPLICA, 3600).unwrap();
    let secret = b"flow-state-0123456789";
    for encrypt in [true, false] {
        let (c, s) = pair();
        let (cr, sr) = handshake(c, s, &a, &b, opts(encrypt), opts(false));
        let (mut c, s) = (cr.unwrap(), sr.unwrap());
        c.writer.send_bytes(40, secret).unwrap();
        // What went on the wire, read under the server's session.
        let mut raw = vec![0u8; 256];
        let n = s
            .reader
            .stream()
            .try_clone()
            .unwrap()
            .read(&mut raw)
            .unwrap();
        let visible = raw[..n].windows(secret.len()).any(|w| w == secret);
        assert_eq!(visible, !encrypt, "encrypt={encrypt}");
    }
}

#[test]
fn strangers_wrong_names_and_missing_roles_are_refused_with_reasons() {
    let ca = Ca::generate(None).unwrap();
    let evil_ca = Ca::generate(None).unwrap();
    let r1 = ca.issue("r1", role::REPLICA, 3600).unwrap();
    let r2 = ca.issue("r2", role::REPLICA, 3600).unwrap();
    // A certificate from another CA, claiming a valid name.
    // (It trusts the right CA, so it gets as far as presenting its forged certificate.)
    let mut fake = evil_ca
        .issue("r1", role::REPLICA | role::CONTROLLER, 3600)
        .unwrap();
    fake.ca_pub = ca.public();
    let (c, s) = pair();
    let (cr, sr) = handshake(c, s, &fake, &r2, opts(true), opts(true));
    assert!(matches!(sr, Err(SessionError::Cert(_))), "{sr:?}");
    assert!(
        matches!(cr, Err(SessionError::Refused(_))),
        "{:?}",
        cr.err()
    );
    // The server is checked too: a client dialling r2 refuses r1 answering.
    let (c, s) = pair();
    let mut co = opts(true);
    co.expect.name = Some("r2".into());
    let (cr, _sr) = handshake(c, s, &r2, &r1, co, opts(true));
    assert!(
        matches!(cr, Err(SessionError::PeerName { .. })),
        "{:?}",
        cr.err()
    );
    // A replica cannot use a channel that requires the controller role.
    let (c, s) = pair();
    let mut so = opts(true);
    so.expect.roles = role::CONTROLLER | role::ADMIN;
    let (cr, sr) = handshake(c, s, &r1, &r2, opts(true), so);
    assert!(matches!(sr, Err(SessionError::Role { .. })), "{sr:?}");
    let e = cr.err().unwrap();
    assert!(
        matches!(e, SessionError::Refused(ref why) if why.contains("roles")),
        "{e}"
    );
    // An expired certificate.
    let old = ca.issue("old", role::REPLICA, 0).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let (c, s) = pair();
    let (_cr, sr) = handshake(c, s, &old, &r2, opts(true), opts(true));
    assert!(matches!(sr, Err(SessionError::Cert(_))), "{sr:?}");
}

#[test]
fn another_protocol_version_is_refused_naming_both() {
    let ca = Ca::generate(None).unwrap();
    let r2 = ca.issue("r2", role::REPLICA, 3600).unwrap();
    let (mut c, s) = pair();
    let srv = std::thread::spawn(move || Conn::server(s, &r2, &opts(true)).err().unwrap());
    let h = Header {
        len: 0,
        version: PROTOCOL_VERSION + 7,
        kind: 1,
    };
    c.write_all(&h.encode()).unwrap();
    let e = srv.join().unwrap();
    let text = e.to_string();
    assert!(
        text.contains(&format!("version {}", PROTOCOL_VERSION + 7)),
        "{text}"
    );
    assert!(
        text.contains(&format!("version {PROTOCOL_VERSION}")),
        "{text}"
    );
    // The client is told: the server's refusal frame carries the server's version.
    let mut buf = Vec::new();
    let got = frame::read_frame_into(&mut c, 4096, &mut buf).unwrap();
    assert_eq!(got.version, PROTOCOL_VERSION);
    assert!(String::from_utf8_lossy(&buf[HEADER_LEN..]).contains("version"));
}

#[test]
fn a_peer_trickling_its_handshake_is_cut_at_the_whole_handshake_deadline() {
    let ca = Ca::generate(None).unwrap();
    let r1 = ca.issue("r1", role::REPLICA, 3600).unwrap();
    let r2 = ca.issue("r2", role::REPLICA, 3600).unwrap();
    // Record a genuine Hello, then send it one byte every 20 ms (each read completes well
    // within any per-read timeout; only a deadline over the whole handshake stops it).
    let (c, mut relay) = pair();
    let r1c = r1.clone();
    let client = std::thread::spawn(move || {
        let _ = Conn::client(c, &r1c, &opts(true));
    });
    let mut hello = [0u8; HEADER_LEN];
    relay.read_exact(&mut hello).unwrap();
    let len = Header::decode(&hello).len as usize;
    let mut body = vec![0u8; len];
    relay.read_exact(&mut body).unwrap();
    let all: Vec<u8> = hello.iter().chain(body.iter()).copied().collect();
    let (mut slow, s) = pair();
    let mut so = opts(true);
    so.handshake_timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let srv = std::thread::spawn(move || Conn::server(s, &r2, &so).err().unwrap());
    let trickle = std::thread::spawn(move || {
        for b in all {
            if slow.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let e = srv.join().unwrap();
    let took = t0.elapsed();
    assert!(matches!(e, SessionError::TimedOut(_)), "{e}");
    // The trickle needs 20 ms x ~80 bytes; the server gave up long before it could finish.
    assert!(took < Duration::from_millis(80 * 20), "held for {took:?}");
    drop(relay);
    trickle.join().unwrap();
    client.join().unwrap();
}

/// Sealed frames from one session, opened by the other side in orders an attacker could
/// produce: only the genuine order opens.
#[test]
fn tampered_replayed_reordered_and_injected_frames_fail_their_tag() {
    let ca = Ca::generate(None).unwrap();
    let a = ca.issue("a", role::REPLICA, 3600).unwrap();
    let b = ca.issue("b", role::REPLICA, 3600).unwrap();
    let mut rng = XorShift(0x5eed_1234);
    for encrypt in [true, false] {
        let (c, s) = pair();
        let cid = a.clone();
        let sid = b.clone();
        let so = opts(false);
        let srv = std::thread::spawn(move || session::server(&s, &sid, &so).unwrap());
        let mut cs = session::client(&c, &cid, &opts(encrypt)).unwrap();
        let mut ss = srv.join().unwrap();
        let frames: Vec<Vec<u8>> = (0..8u32)
            .map(|i| {
                let mut f = Vec::new();
                cs.tx.seal_msg(20, &(i, vec![i as u8; 30]), &mut f).unwrap();
                f
            })
            .collect();
        // Tamper: flip one random bit anywhere (header, body or tag) of frame 0.
        for _ in 0..200 {
            let mut f = frames[0].clone();
            let at = rng.below(f.len() as u64) as usize;
            f[at] ^= 1 << rng.below(8);
            assert!(ss.rx.open(&mut f).is_err(), "bit flip at {at} opened");
        }
        // Reorder: frame 1 before frame 0.
        assert!(matches!(
            ss.rx.open(&mut frames[1].clone()),
            Err(FrameError::BadTag)
        ));
        let mut f0 = frames[0].clone();
        let (k, body) = ss.rx.open(&mut f0).unwrap();
        assert_eq!(k, 20);
        let (i, _): (u32, Vec<u8>) = frame::decode_body(&f0[body]).unwrap();
        assert_eq!(i, 0);
        // Replay of frame 0.
        assert!(matches!(
            ss.rx.open(&mut frames[0].clone()),
            Err(FrameError::BadTag)
        ));
        // Injection: a frame sealed by another session (say, an Ack from another link).
        let (c2, s2) = pair();
        let (cid2, sid2) = (a.clone(), b.clone());
        let srv2 = std::thread::spawn(move || session::server(&s2, &sid2, &opts(false)).unwrap());
        let mut other = session::client(&c2, &cid2, &opts(encrypt)).unwrap();
        drop(srv2.join().unwrap());
        let mut injected = Vec::new();
        other
            .tx
            .seal_msg(20, &(1u32, vec![1u8; 30]), &mut injected)
            .unwrap();
        assert!(matches!(ss.rx.open(&mut injected), Err(FrameError::BadTag)));
        // The genuine next frame still opens: failures did not advance the sequence.
        assert!(ss.rx.open(&mut frames[1].clone()).is_ok());
        // A reflected frame (the server's own, sent back) does not open either.
        let mut mine = Vec::new();
        ss.tx
            .seal_msg(20, &(2u32, vec![2u8; 30]), &mut mine)
            .unwrap();
        assert!(ss.rx.open(&mut mine).is_err());
    }
}

/// A man in the middle flips one bit at a random offset of either direction during the
/// handshake: never do both sides end up with a session that works.
#[test]
fn a_bit_flipped_anywhere_in_the_handshake_fails_it() {
    let ca = Ca::generate(None).unwrap();
    let a = ca.issue("a", role::REPLICA, 3600).unwrap();
    let b = ca.issue("b", role::REPLICA, 3600).unwrap();
    let mut rng = XorShift(0xfeed_0042);
    // Handshake bytes: Hello ~75, ServerHello ~300, ClientAuth ~250, Accepted ~24.
    for trial in 0..40 {
        let c2s = rng.below(2) == 0;
        let at = rng.below(if c2s { 330 } else { 320 }) as usize;
        let bit = 1u8 << rng.below(8);
        let (c, mut cr) = pair();
        let (mut sr, s) = pair();
        let mut short = opts(true);
        short.handshake_timeout = Duration::from_secs(2);
        let (a2, b2) = (a.clone(), b.clone());
        let so = short.clone();
        let srv = std::thread::spawn(move || Conn::server(s, &b2, &so));
        let cli = std::thread::spawn(move || Conn::client(c, &a2, &short));
        // Relay both directions; flip the chosen bit.
        let (mut cr2, mut sr2) = (cr.try_clone().unwrap(), sr.try_clone().unwrap());
        let up = std::thread::spawn(move || {
            relay(&mut cr, &mut sr, if c2s { Some((at, bit)) } else { None })
        });
        let down = std::thread::spawn(move || {
            relay(&mut sr2, &mut cr2, if c2s { None } else { Some((at, bit)) })
        });
        let (sres, cres) = (srv.join().unwrap(), cli.join().unwrap());
        // If both sides think they succeeded, the first frame must still notice a flip.
        let worked = match (sres, cres) {
            (Ok(mut sc), Ok(mut cc)) => {
                cc.send(20, &1u8).is_ok() && matches!(sc.recv::<u8>(), Ok((20, 1)))
            }
            _ => false,
        };
        let flipped = up.join().unwrap() + down.join().unwrap();
        assert_eq!(
            worked,
            flipped == 0,
            "trial {trial}: flip at {at} (client->server: {c2s}) flipped={flipped}"
        );
    }
}

/// Copies `from` to `to` until EOF/error, flipping `bit` at byte `at`; returns 1 if it did.
fn relay(from: &mut Stream, to: &mut Stream, flip: Option<(usize, u8)>) -> usize {
    let mut seen = 0usize;
    let mut flipped = 0;
    let mut buf = [0u8; 4096];
    from.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((at, bit)) = flip {
            if at >= seen && at < seen + n {
                buf[at - seen] ^= bit;
                flipped = 1;
            }
        }
        seen += n;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
    flipped
}

#[test]
fn a_declared_huge_frame_is_refused_before_any_allocation() {
    let ca = Ca::generate(None).unwrap();
    let a = ca.issue("a", role::REPLICA, 3600).unwrap();
    let b = ca.issue("b", role::REPLICA, 3600).unwrap();
    let (c, s) = pair();
    let (cr, sr) = handshake(c, s, &a, &b, opts(true), opts(true));
    let (c, mut s) = (cr.unwrap(), sr.unwrap());
    let h = Header {
        len: u32::MAX,
        version: PROTOCOL_VERSION,
        kind: 20,
    };
    c.writer.stream().send_all(&h.encode()).unwrap();
    let e = s.recv::<u8>().unwrap_err();
    assert!(matches!(e, FrameError::TooLarge { .. }), "{e}");
}

#[test]
fn an_endpoint_string_round_trips_through_its_display() {
    for s in [
        "unix:/run/pliant/r1.sock",
        "tcp:10.1.2.3:7400",
        "tcp:node-a:1",
    ] {
        let ep: Endpoint = s.parse().unwrap();
        assert_eq!(ep.to_string(), s);
    }
}
