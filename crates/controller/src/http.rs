//! A deliberately small HTTP/1.1 server and client for the controller API.
//!
//! Why hand-written: the API is a handful of JSON endpoints on a unix socket, one request per
//! connection. A minimal parser whose every bound is visible here (head size, body size,
//! header count, timeouts, concurrent connections) is easier to audit for hostile input than a
//! general server, and costs no dependency; an async stack would buy nothing at this request
//! rate. Every request must carry the bearer token (checked before any routing); failures are
//! counted in [`HttpStats`].

use crate::auth;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Longest request line + headers.
pub const MAX_HEAD_BYTES: usize = 8 << 10;
/// Largest request body.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Headers per request at most.
pub const MAX_HEADERS: usize = 64;
/// Connections served at once; more get 503 (counted as `busy`).
pub const MAX_CONNECTIONS: usize = 32;
/// How long one read or write may block.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client may take to send its whole request (a slow-drip client cannot hold one of
/// the [`MAX_CONNECTIONS`] slots longer than this).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

/// A reader that fails once its deadline has passed.
struct DeadlineReader<R> {
    inner: R,
    deadline: std::time::Instant,
}

impl<R: Read> Read for DeadlineReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if std::time::Instant::now() >= self.deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "request deadline passed",
            ));
        }
        self.inner.read(buf)
    }
}

/// A parsed request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// Path without the query string.
    pub path: String,
    /// Decoded `k=v` pairs of the query string, in order.
    pub query: Vec<(String, String)>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A response: status and a JSON (or text) body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
    pub content_type: &'static str,
}

impl Response {
    pub fn json(status: u16, v: &serde_json::Value) -> Response {
        Response {
            status,
            body: v.to_string(),
            content_type: "application/json",
        }
    }
    /// Prometheus text exposition.
    pub fn metrics(body: String) -> Response {
        Response {
            status: 200,
            body,
            content_type: "text/plain; version=0.0.4",
        }
    }
    pub fn error(status: u16, msg: &str) -> Response {
        Response::json(status, &serde_json::json!({"ok": false, "error": msg}))
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// Why a request could not be parsed (each maps to a status code).
#[derive(Debug, PartialEq, Eq)]
pub enum ParseError {
    /// Connection closed or timed out before a full head.
    Incomplete,
    HeadTooLarge,
    BodyTooLarge,
    Malformed(&'static str),
}

fn pct_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .take(32)
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (pct_decode(k), pct_decode(v)),
            None => (pct_decode(p), String::new()),
        })
        .collect()
}

/// Reads one request from `r`, enforcing every bound above.
pub fn read_request<R: Read>(r: R) -> Result<Request, ParseError> {
    let mut r = BufReader::new(r);
    let mut head = Vec::new();
    // Read line by line so we stop exactly at the blank line and never over-read the body.
    loop {
        let before = head.len();
        let n = (&mut r)
            .take((MAX_HEAD_BYTES + 1 - head.len().min(MAX_HEAD_BYTES)) as u64)
            .read_until(b'\n', &mut head)
            .map_err(|_| ParseError::Incomplete)?;
        if head.len() > MAX_HEAD_BYTES {
            return Err(ParseError::HeadTooLarge);
        }
        if n == 0 {
            return Err(ParseError::Incomplete);
        }
        let line = &head[before..];
        if line == b"\r\n" || line == b"\n" {
            if before == 0 {
                // Tolerate a stray blank line before the request line (RFC 9112 2.2).
                head.clear();
                continue;
            }
            break;
        }
    }
    let text =
        std::str::from_utf8(&head).map_err(|_| ParseError::Malformed("head is not UTF-8"))?;
    let mut lines = text.split('\n').map(|l| l.trim_end_matches('\r'));
    let reqline = lines
        .next()
        .ok_or(ParseError::Malformed("no request line"))?;
    let mut parts = reqline.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ParseError::Malformed(
            "request line is not METHOD TARGET VERSION",
        ));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(ParseError::Malformed("only HTTP/1.x is spoken"));
    }
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(ParseError::Malformed("bad method"));
    }
    if !target.starts_with('/') {
        return Err(ParseError::Malformed("target must be an absolute path"));
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), parse_query(q)),
        None => (target.to_string(), Vec::new()),
    };
    let mut headers = Vec::new();
    for l in lines {
        if l.is_empty() {
            continue;
        }
        if headers.len() >= MAX_HEADERS {
            return Err(ParseError::HeadTooLarge);
        }
        let (k, v) = l
            .split_once(':')
            .ok_or(ParseError::Malformed("header without ':'"))?;
        if k.is_empty() || k.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(ParseError::Malformed("bad header name"));
        }
        headers.push((k.to_string(), v.trim().to_string()));
    }
    let mut req = Request {
        method: method.to_string(),
        path,
        query,
        headers,
        body: Vec::new(),
    };
    if req.header("transfer-encoding").is_some() {
        return Err(ParseError::Malformed(
            "chunked bodies are not accepted; send Content-Length",
        ));
    }
    if let Some(cl) = req.header("content-length") {
        let n: usize = cl
            .parse()
            .map_err(|_| ParseError::Malformed("bad Content-Length"))?;
        if n > MAX_BODY_BYTES {
            return Err(ParseError::BodyTooLarge);
        }
        let mut body = vec![0u8; n];
        r.read_exact(&mut body)
            .map_err(|_| ParseError::Incomplete)?;
        req.body = body;
    }
    Ok(req)
}

/// Writes `resp` (always `Connection: close`: one request per connection).
pub fn write_response<W: Write>(mut w: W, resp: &Response) -> std::io::Result<()> {
    write!(
        w,
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        resp.status,
        reason(resp.status),
        resp.content_type,
        resp.body.len()
    )?;
    w.write_all(resp.body.as_bytes())?;
    w.flush()
}

/// Counters of the API listener (exported by `GET /v1/status`).
#[derive(Debug, Default)]
pub struct HttpStats {
    pub requests: AtomicU64,
    pub unauthorized: AtomicU64,
    pub bad_requests: AtomicU64,
    pub too_large: AtomicU64,
    pub busy: AtomicU64,
}

impl HttpStats {
    pub fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "requests": g(&self.requests),
            "unauthorized": g(&self.unauthorized),
            "bad_requests": g(&self.bad_requests),
            "too_large": g(&self.too_large),
            "busy": g(&self.busy),
        })
    }
}

/// The application behind the server.
pub type Handler = dyn Fn(&Request) -> Response + Send + Sync;

/// A running server; [`Server::stop`] (or drop) ends its accept loops and removes the socket.
pub struct Server {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    unix_path: Option<PathBuf>,
    pub stats: Arc<HttpStats>,
    tcp_addr: Option<std::net::SocketAddr>,
}

struct Shared {
    token: String,
    handler: Box<Handler>,
    stats: Arc<HttpStats>,
    active: AtomicUsize,
}

fn serve_stream<S: Read + Write>(mut s: S, sh: &Shared) {
    let reader = DeadlineReader {
        inner: &mut s,
        deadline: std::time::Instant::now() + REQUEST_DEADLINE,
    };
    let resp = match read_request(reader) {
        Err(ParseError::Incomplete) => return,
        Err(ParseError::HeadTooLarge) => {
            sh.stats.too_large.fetch_add(1, Ordering::Relaxed);
            Response::error(431, "request head too large")
        }
        Err(ParseError::BodyTooLarge) => {
            sh.stats.too_large.fetch_add(1, Ordering::Relaxed);
            Response::error(413, &format!("body larger than {MAX_BODY_BYTES} bytes"))
        }
        Err(ParseError::Malformed(why)) => {
            sh.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            Response::error(400, why)
        }
        Ok(req) => {
            sh.stats.requests.fetch_add(1, Ordering::Relaxed);
            if !auth::authorized(req.header("authorization"), &sh.token) {
                sh.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
                Response::error(401, "missing or bad bearer token")
            } else {
                // A handler bug must not take the listener down with it.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (sh.handler)(&req)))
                {
                    Ok(r) => r,
                    Err(_) => Response::error(500, "internal error (handler panicked)"),
                }
            }
        }
    };
    let _ = write_response(&mut s, &resp);
}

trait Conn: Read + Write + Send + 'static {
    fn timeouts(&self);
}
impl Conn for UnixStream {
    fn timeouts(&self) {
        let _ = self.set_read_timeout(Some(IO_TIMEOUT));
        let _ = self.set_write_timeout(Some(IO_TIMEOUT));
        let _ = self.set_nonblocking(false);
    }
}
impl Conn for TcpStream {
    fn timeouts(&self) {
        let _ = self.set_read_timeout(Some(IO_TIMEOUT));
        let _ = self.set_write_timeout(Some(IO_TIMEOUT));
        let _ = self.set_nonblocking(false);
    }
}

fn dispatch<C: Conn>(c: C, sh: &Arc<Shared>) {
    c.timeouts();
    if sh.active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
        sh.active.fetch_sub(1, Ordering::SeqCst);
        sh.stats.busy.fetch_add(1, Ordering::Relaxed);
        let mut c = c;
        let _ = write_response(&mut c, &Response::error(503, "too many connections"));
        return;
    }
    let sh2 = Arc::clone(sh);
    let spawned = std::thread::Builder::new()
        .name("ctl-api-conn".into())
        .spawn(move || {
            serve_stream(c, &sh2);
            sh2.active.fetch_sub(1, Ordering::SeqCst);
        });
    if spawned.is_err() {
        sh.active.fetch_sub(1, Ordering::SeqCst);
        sh.stats.busy.fetch_add(1, Ordering::Relaxed);
    }
}

/// Where the API listens.
#[derive(Clone, Debug, Default)]
pub struct Listen {
    /// Unix socket path (mode 0600).
    pub unix: Option<PathBuf>,
    /// Optional TCP address (e.g. "127.0.0.1:7400").
    pub tcp: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("API socket {path}: {source}")]
    Unix {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("API TCP listener {addr}: {source}")]
    Tcp {
        addr: String,
        source: std::io::Error,
    },
    #[error("nothing to listen on: configure a unix socket or a TCP address")]
    NoListener,
}

impl Server {
    pub fn start(
        listen: &Listen,
        token: String,
        handler: Box<Handler>,
    ) -> Result<Server, ServeError> {
        if listen.unix.is_none() && listen.tcp.is_none() {
            return Err(ServeError::NoListener);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(HttpStats::default());
        let sh = Arc::new(Shared {
            token,
            handler,
            stats: Arc::clone(&stats),
            active: AtomicUsize::new(0),
        });
        let mut threads = Vec::new();
        let mut tcp_addr = None;
        if let Some(path) = &listen.unix {
            let uerr = |source| ServeError::Unix {
                path: path.clone(),
                source,
            };
            if let Ok(md) = std::fs::symlink_metadata(path) {
                use std::os::unix::fs::FileTypeExt;
                // Only ever remove a stale *socket*, never a file someone pointed us at.
                if md.file_type().is_socket() {
                    if UnixStream::connect(path).is_ok() {
                        return Err(uerr(std::io::Error::new(
                            std::io::ErrorKind::AddrInUse,
                            "another controller is answering on it",
                        )));
                    }
                    let _ = std::fs::remove_file(path);
                }
            }
            // Create under a restrictive umask so the socket is never briefly world-connectable.
            // SAFETY: umask(2) only changes this process's file-creation mask.
            let old = unsafe { libc::umask(0o177) };
            let l = UnixListener::bind(path);
            // SAFETY: as above, restores the previous mask.
            unsafe { libc::umask(old) };
            let l = l.map_err(uerr)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(uerr)?;
            l.set_nonblocking(true).map_err(uerr)?;
            let (st, sh) = (Arc::clone(&stop), Arc::clone(&sh));
            threads.push(std::thread::spawn(move || loop {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                match l.accept() {
                    Ok((c, _)) => dispatch(c, &sh),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }));
        }
        if let Some(addr) = &listen.tcp {
            let terr = |source| ServeError::Tcp {
                addr: addr.clone(),
                source,
            };
            let l = TcpListener::bind(addr).map_err(terr)?;
            tcp_addr = l.local_addr().ok();
            l.set_nonblocking(true).map_err(terr)?;
            let (st, sh) = (Arc::clone(&stop), Arc::clone(&sh));
            threads.push(std::thread::spawn(move || loop {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                match l.accept() {
                    Ok((c, _)) => dispatch(c, &sh),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }));
        }
        Ok(Server {
            stop,
            threads,
            unix_path: listen.unix.clone(),
            stats,
            tcp_addr,
        })
    }

    /// The bound TCP address (useful with port 0).
    pub fn tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.tcp_addr
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(p) = self.unix_path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Client errors, for the CLI.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the controller at {endpoint}: {source} (is `pliant controller` running?)"
    )]
    Connect {
        endpoint: String,
        source: std::io::Error,
    },
    #[error("talking to the controller at {endpoint}: {reason}")]
    Io { endpoint: String, reason: String },
}

/// Sends one request to `endpoint` (a unix socket path, or `tcp://host:port`) and returns the
/// status and body.
pub fn request(
    endpoint: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String), ClientError> {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: pliant\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.map_or(0, str::len)
    );
    let cerr = |source| ClientError::Connect {
        endpoint: endpoint.to_string(),
        source,
    };
    let ioerr = |reason: String| ClientError::Io {
        endpoint: endpoint.to_string(),
        reason,
    };
    let mut raw = Vec::new();
    if let Some(addr) = endpoint.strip_prefix("tcp://") {
        let mut s = TcpStream::connect(addr).map_err(cerr)?;
        let _ = s.set_read_timeout(Some(timeout));
        let _ = s.set_write_timeout(Some(timeout));
        s.write_all(head.as_bytes())
            .and_then(|_| s.write_all(body.unwrap_or("").as_bytes()))
            .map_err(|e| ioerr(e.to_string()))?;
        s.take(64 << 20)
            .read_to_end(&mut raw)
            .map_err(|e| ioerr(e.to_string()))?;
    } else {
        let mut s = UnixStream::connect(Path::new(endpoint)).map_err(cerr)?;
        let _ = s.set_read_timeout(Some(timeout));
        let _ = s.set_write_timeout(Some(timeout));
        s.write_all(head.as_bytes())
            .and_then(|_| s.write_all(body.unwrap_or("").as_bytes()))
            .map_err(|e| ioerr(e.to_string()))?;
        s.take(64 << 20)
            .read_to_end(&mut raw)
            .map_err(|e| ioerr(e.to_string()))?;
    }
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| ioerr("answer has no HTTP head".into()))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ioerr(format!("bad status line {:?}", head.lines().next())))?;
    Ok((status, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Request, ParseError> {
        read_request(s.as_bytes())
    }

    #[test]
    fn parses_a_request_with_query_and_body() {
        let r = parse("POST /v1/migrate?to=r2&flow=tcp%2010.0.0.1:1%20%3C-%3E%2010.0.0.2:2 HTTP/1.1\r\nAuthorization: Bearer x\r\nContent-Length: 4\r\n\r\nabcdEXTRA").unwrap();
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/v1/migrate");
        assert_eq!(r.query_param("to"), Some("r2"));
        assert_eq!(r.query_param("flow"), Some("tcp 10.0.0.1:1 <-> 10.0.0.2:2"));
        assert_eq!(r.header("AUTHORIZATION"), Some("Bearer x"));
        assert_eq!(r.body, b"abcd");
    }

    #[test]
    fn hostile_heads_are_refused_not_fatal() {
        assert_eq!(parse(""), Err(ParseError::Incomplete));
        assert_eq!(parse("GET / HTTP/1.1\r\n"), Err(ParseError::Incomplete));
        assert!(matches!(
            parse("GARBAGE\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse("get / HTTP/1.1\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse("GET x HTTP/1.1\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse("GET / SPDY/3\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse("GET / HTTP/1.1\r\nNoColon\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse("GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        assert!(matches!(
            parse("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Err(ParseError::Malformed(_))
        ));
        let big = format!(
            "GET / HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(parse(&big), Err(ParseError::HeadTooLarge));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("X{i}: y\r\n")).collect();
        assert_eq!(
            parse(&format!("GET / HTTP/1.1\r\n{many}\r\n")),
            Err(ParseError::HeadTooLarge)
        );
        let cl = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert_eq!(parse(&cl), Err(ParseError::BodyTooLarge));
        // Body shorter than announced.
        assert_eq!(
            parse("POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc"),
            Err(ParseError::Incomplete)
        );
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut x: u64 = 0x1234_5678_9abc_def0;
        for _ in 0..2000 {
            let mut buf = b"GET /v1/status?a=%zz&b=%4 HTTP/1.1\r\n".to_vec();
            let n = (x % 300) as usize;
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf.push((x & 0xff) as u8);
            }
            buf.extend_from_slice(b"\r\n\r\n");
            let _ = read_request(&buf[..]);
        }
    }

    #[test]
    fn a_passed_deadline_stops_reading() {
        let r = DeadlineReader {
            inner: &b"GET / HTTP/1.1\r\n\r\n"[..],
            deadline: std::time::Instant::now(),
        };
        assert_eq!(read_request(r), Err(ParseError::Incomplete));
    }

    #[test]
    fn percent_decoding_tolerates_bad_escapes() {
        assert_eq!(pct_decode("a%20b"), "a b");
        assert_eq!(pct_decode("%zz"), "%zz");
        assert_eq!(pct_decode("%4"), "%4");
        assert_eq!(pct_decode("%"), "%");
        assert_eq!(pct_decode("a+b"), "a b");
    }

    #[test]
    fn server_requires_the_token_and_counts_401s() {
        let dir = std::env::temp_dir().join(format!("pliant-ctl-http-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("api.sock");
        let token = "s3cret-token-0123456789".to_string();
        let mut srv = Server::start(
            &Listen {
                unix: Some(sock.clone()),
                tcp: Some("127.0.0.1:0".into()),
            },
            token.clone(),
            Box::new(|r: &Request| Response::json(200, &serde_json::json!({"path": r.path}))),
        )
        .unwrap();
        let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let ep = sock.display().to_string();
        let t = Duration::from_secs(5);
        let (st, body) = request(&ep, &token, "GET", "/v1/x", None, t).unwrap();
        assert_eq!(st, 200);
        assert!(body.contains("/v1/x"));
        let (st, _) = request(&ep, "wrong-token-0123456789", "GET", "/v1/x", None, t).unwrap();
        assert_eq!(st, 401);
        let (st, _) = request(&ep, "", "GET", "/v1/x", None, t).unwrap();
        assert_eq!(st, 401);
        // Over TCP too.
        let tcp = format!("tcp://{}", srv.tcp_addr().unwrap());
        assert_eq!(request(&tcp, &token, "GET", "/", None, t).unwrap().0, 200);
        assert_eq!(
            request(&tcp, "nope-nope-nope-nope", "GET", "/", None, t)
                .unwrap()
                .0,
            401
        );
        // No Authorization header at all, and garbage.
        let mut s = UnixStream::connect(&sock).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 401"), "{out}");
        let mut s = UnixStream::connect(&sock).unwrap();
        s.write_all(b"\x00\x01\x02 nonsense\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        assert_eq!(srv.stats.unauthorized.load(Ordering::Relaxed), 4);
        assert_eq!(srv.stats.bad_requests.load(Ordering::Relaxed), 1);
        srv.stop();
        assert!(!sock.exists(), "socket removed on stop");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
