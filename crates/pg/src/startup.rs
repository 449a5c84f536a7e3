//! The first bytes of a client connection, as PostgreSQL handles them: an SSLRequest is
//! answered `S` (then the TLS handshake) when the proxy has a certificate, `N` otherwise; a
//! GSSENCRequest always `N`; each at most once, and neither inside TLS. Then the startup
//! packet or a CancelRequest. With TLS required, a startup packet in plaintext is refused
//! (a CancelRequest is not: libpq sends those unencrypted).
//!
//! Bytes sent right behind an SSLRequest, before the `S`, stay in the socket and are read as
//! the first TLS record: garbage, so the handshake fails (nothing unencrypted is ever taken
//! as part of an encrypted session).

use crate::proto::{self, ProtoError, Startup};
use crate::tls::{self, HandshakeError, Stream, TlsServer};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// What the client opened the connection for.
#[derive(Debug, PartialEq, Eq)]
pub enum Opening {
    Params(Vec<(String, String)>),
    Cancel {
        pid: u32,
        key: u32,
    },
    /// Closed before sending anything more.
    Closed,
}

/// Why the connection is not served.
#[derive(Debug)]
pub enum Refusal {
    /// The startup packet did not arrive within the timeout (the stream to say so on).
    Timeout(Stream),
    /// A malformed or unexpected packet: SQLSTATE and message to send.
    Invalid(Stream, &'static str, String),
    /// The TLS handshake failed or timed out (there is no channel left to answer on).
    Handshake(HandshakeError),
    /// A plaintext startup packet while TLS is required.
    PlaintextRefused(Stream),
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_tls() {
            "Stream::Tls"
        } else {
            "Stream::Plain"
        })
    }
}

/// How the proxy opens connections.
pub struct Policy<'a> {
    pub tls: Option<&'a TlsServer>,
    /// Refuse plaintext startup packets (only meaningful with `tls`).
    pub require_tls: bool,
    /// Per read of the startup packet; for the whole TLS handshake.
    pub timeout: Duration,
}

/// A read gave up because the peer sent nothing within the socket's read timeout.
pub fn timed_out(e: &ProtoError) -> bool {
    matches!(e, ProtoError::Io(io) if matches!(io.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}

/// Negotiates encryption and reads the startup packet.
pub fn open(c: TcpStream, p: &Policy) -> Result<(Stream, Opening), Refusal> {
    let _ = c.set_read_timeout(Some(p.timeout.max(Duration::from_millis(1))));
    let mut s = Stream::Plain(c);
    let (mut ssl_asked, mut gss_asked) = (false, false);
    loop {
        match proto::read_startup(&mut s) {
            Ok(Some(Startup::Ssl)) => {
                if ssl_asked || s.is_tls() {
                    return Err(renegotiation(s, "SSLRequest"));
                }
                ssl_asked = true;
                let Some(t) = p.tls else {
                    write_answer(&mut s, b'N')?;
                    continue;
                };
                write_answer(&mut s, b'S')?;
                let Stream::Plain(sock) = s else {
                    unreachable!("TLS is set up only once")
                };
                s = tls::accept(sock, t, Instant::now() + p.timeout).map_err(Refusal::Handshake)?;
            }
            Ok(Some(Startup::GssEnc)) => {
                if gss_asked || s.is_tls() {
                    return Err(renegotiation(s, "GSSENCRequest"));
                }
                gss_asked = true;
                write_answer(&mut s, b'N')?;
            }
            Ok(Some(Startup::Cancel { pid, key })) => return Ok((s, Opening::Cancel { pid, key })),
            Ok(None) => return Ok((s, Opening::Closed)),
            Ok(Some(Startup::Params(params))) => {
                if p.require_tls && !s.is_tls() {
                    return Err(Refusal::PlaintextRefused(s));
                }
                return Ok((s, Opening::Params(params)));
            }
            Err(e) if timed_out(&e) => return Err(Refusal::Timeout(s)),
            Err(e) => {
                let code = if matches!(e, ProtoError::Version(..)) {
                    "0A000"
                } else {
                    "08P01"
                };
                return Err(Refusal::Invalid(
                    s,
                    code,
                    format!("invalid startup packet: {e}"),
                ));
            }
        }
    }
}

/// A second SSLRequest/GSSENCRequest, or one inside TLS.
fn renegotiation(s: Stream, what: &str) -> Refusal {
    Refusal::Invalid(
        s,
        "08P01",
        format!("unsupported frontend protocol: {what} after the encryption negotiation"),
    )
}

fn write_answer(s: &mut Stream, b: u8) -> Result<(), Refusal> {
    s.write_all(&[b])
        .map_err(|e| Refusal::Handshake(HandshakeError::Io(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{make_demo_pki, TlsClient};
    use std::io::Read;
    use std::net::{IpAddr, Ipv4Addr, TcpListener};

    fn pki() -> (tempdir::Dir, TlsServer, TlsClient) {
        let d = tempdir::Dir::new();
        let p = make_demo_pki(&d.0, &[IpAddr::V4(Ipv4Addr::LOCALHOST)]).expect("pki");
        let s = TlsServer::load(&p.cert, &p.key).expect("server");
        let c = TlsClient::load(&p.ca, None).expect("client");
        (d, s, c)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Dir {
                let p = std::env::temp_dir().join(format!(
                    "pliant-pg-tls-test-{}-{}",
                    std::process::id(),
                    crate::scram::new_nonce()
                        .unwrap()
                        .replace(['/', '+', '='], "")
                ));
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    /// Runs `open` on the server end of a loopback connection while `client` drives the
    /// other end.
    fn run<T: Send + 'static>(
        p: Policy,
        client: impl FnOnce(TcpStream) -> T + Send + 'static,
    ) -> (Result<(Stream, Opening), Refusal>, T) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = l.local_addr().expect("addr");
        let h = std::thread::spawn(move || client(TcpStream::connect(a).expect("connect")));
        let (c, _) = l.accept().expect("accept");
        let r = open(c, &p);
        let t = h.join().expect("client thread");
        (r, t)
    }

    fn ssl_request() -> Vec<u8> {
        let mut v = 8u32.to_be_bytes().to_vec();
        v.extend(proto::SSL_REQUEST.to_be_bytes());
        v
    }

    fn gss_request() -> Vec<u8> {
        let mut v = 8u32.to_be_bytes().to_vec();
        v.extend(proto::GSSENC_REQUEST.to_be_bytes());
        v
    }

    fn startup() -> Vec<u8> {
        proto::startup_message(&[("user".into(), "u".into())])
    }

    fn answer(s: &mut TcpStream) -> u8 {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).expect("answer");
        b[0]
    }

    fn params() -> Opening {
        Opening::Params(vec![("user".into(), "u".into())])
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn without_tls_ssl_and_gss_requests_get_n_then_startup_in_plaintext() {
        let p = Policy {
            tls: None,
            require_tls: false,
            timeout: T,
        };
        let (r, answers) = run(p, |mut s| {
            s.write_all(&gss_request()).unwrap();
            let a = answer(&mut s);
            s.write_all(&ssl_request()).unwrap();
            let b = answer(&mut s);
            s.write_all(&startup()).unwrap();
            (a, b)
        });
        assert_eq!(answers, (b'N', b'N'));
        let (s, o) = r.expect("served");
        assert!(!s.is_tls());
        assert_eq!(o, params());
    }

    #[test]
    fn with_tls_ssl_request_gets_s_handshake_then_startup_inside_tls() {
        let (_d, srv, cli) = pki();
        let p = Policy {
            tls: Some(&srv),
            require_tls: true,
            timeout: T,
        };
        let (r, ok) = run(p, move |mut s| {
            // GSSENCRequest first, as libpq does with gssencmode=prefer: still N.
            s.write_all(&gss_request()).unwrap();
            assert_eq!(answer(&mut s), b'N');
            let mut t = tls::connect(s, &cli, IpAddr::V4(Ipv4Addr::LOCALHOST), Instant::now() + T)
                .expect("client handshake");
            t.write_all(&startup()).unwrap();
            t.peer_end_point()
        });
        let (s, o) = r.expect("served");
        assert!(s.is_tls());
        assert_eq!(o, params());
        assert_eq!(
            ok, srv.end_point,
            "client and server agree on the binding data"
        );
        assert_eq!(ok.map(|v| v.len()), Some(32), "ECDSA-SHA256: SHA-256");
    }

    #[test]
    fn plaintext_startup_is_refused_when_tls_is_required_but_cancel_is_not() {
        let (_d, srv, _) = pki();
        for required in [true, false] {
            let p = Policy {
                tls: Some(&srv),
                require_tls: required,
                timeout: T,
            };
            let (r, _) = run(p, |mut s| s.write_all(&startup()).unwrap());
            match (required, r) {
                (true, Err(Refusal::PlaintextRefused(s))) => assert!(!s.is_tls()),
                (false, Ok((s, o))) => {
                    assert!(!s.is_tls());
                    assert_eq!(o, params());
                }
                (_, other) => panic!("required={required}: {other:?}"),
            }
        }
        let p = Policy {
            tls: Some(&srv),
            require_tls: true,
            timeout: T,
        };
        let (r, _) = run(p, |mut s| {
            let mut pkt = 16u32.to_be_bytes().to_vec();
            pkt.extend(proto::CANCEL_REQUEST.to_be_bytes());
            pkt.extend(7u32.to_be_bytes());
            pkt.extend(9u32.to_be_bytes());
            s.write_all(&pkt).unwrap();
        });
        assert_eq!(r.expect("cancel").1, Opening::Cancel { pid: 7, key: 9 });
    }

    #[test]
    fn garbage_after_ssl_request_fails_the_handshake() {
        let (_d, srv, _) = pki();
        let p = Policy {
            tls: Some(&srv),
            require_tls: true,
            timeout: T,
        };
        // Plaintext sent right behind the SSLRequest (before the S) is not a ClientHello.
        let (r, _) = run(p, |mut s| {
            let mut v = ssl_request();
            v.extend(startup());
            s.write_all(&v).unwrap();
            let _ = s.read_to_end(&mut Vec::new());
        });
        match r {
            Err(Refusal::Handshake(HandshakeError::Tls(_))) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_second_ssl_request_or_one_inside_tls_is_a_protocol_error() {
        let p = Policy {
            tls: None,
            require_tls: false,
            timeout: T,
        };
        let (r, _) = run(p, |mut s| {
            s.write_all(&ssl_request()).unwrap();
            answer(&mut s);
            s.write_all(&ssl_request()).unwrap();
        });
        assert!(matches!(r, Err(Refusal::Invalid(_, "08P01", _))), "{r:?}");
        let (_d, srv, cli) = pki();
        let p = Policy {
            tls: Some(&srv),
            require_tls: true,
            timeout: T,
        };
        let (r, _) = run(p, move |s| {
            let mut t = tls::connect(s, &cli, IpAddr::V4(Ipv4Addr::LOCALHOST), Instant::now() + T)
                .expect("handshake");
            t.write_all(&gss_request()).unwrap();
            // The server keeps its end until `run` returns: just give it time to read.
            std::thread::sleep(Duration::from_millis(300));
        });
        match r {
            Err(Refusal::Invalid(s, "08P01", _)) => assert!(s.is_tls()),
            other => panic!("{other:?}"),
        }
    }

    /// Forwards between `from` and `to`, one byte every `gap` in the direction towards the
    /// proxy.
    fn trickle(from: TcpStream, to: TcpStream, gap: Duration) {
        let (mut a, mut b) = (from.try_clone().unwrap(), to.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = b.read(&mut buf) {
                if n == 0 || a.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = a.shutdown(std::net::Shutdown::Both);
        });
        let (mut a, mut b) = (from, to);
        let mut byte = [0u8; 1];
        while let Ok(1) = a.read(&mut byte) {
            if b.write_all(&byte).is_err() {
                break;
            }
            std::thread::sleep(gap);
        }
        let _ = b.shutdown(std::net::Shutdown::Both);
    }

    /// `open` with TLS while a client's bytes reach the proxy one every `gap`.
    fn trickled(
        gap: Duration,
        timeout: Duration,
    ) -> (Result<(Stream, Opening), Refusal>, Duration) {
        let (_d, srv, cli) = pki();
        let p = Policy {
            tls: Some(&srv),
            require_tls: true,
            timeout,
        };
        let t0 = Instant::now();
        let (r, _) = run(p, move |s| {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let a = l.local_addr().unwrap();
            let h = std::thread::spawn(move || {
                let c = TcpStream::connect(a).unwrap();
                if let Ok(mut t) =
                    tls::connect(c, &cli, IpAddr::V4(Ipv4Addr::LOCALHOST), Instant::now() + T)
                {
                    let _ = t.write_all(&startup());
                    std::thread::sleep(Duration::from_millis(300));
                }
            });
            let (inner, _) = l.accept().unwrap();
            trickle(inner, s, gap);
            let _ = h.join();
        });
        (r, t0.elapsed())
    }

    #[test]
    fn a_handshake_trickled_byte_by_byte_ends_at_the_startup_timeout() {
        // Each byte arrives well within the timeout; the whole ClientHello does not.
        let timeout = Duration::from_millis(600);
        let (r, took) = trickled(Duration::from_millis(25), timeout);
        match r {
            Err(Refusal::Handshake(HandshakeError::Timeout)) => {}
            other => panic!("{other:?}"),
        }
        assert!(took < timeout + Duration::from_secs(3), "took {took:?}");
        // Trickled, but within the timeout: served (so the deadline is what ended the first).
        let (r, _) = trickled(Duration::from_micros(200), Duration::from_secs(10));
        let (s, o) = r.expect("slow handshake within the timeout");
        assert!(s.is_tls());
        assert_eq!(o, params());
    }
}
