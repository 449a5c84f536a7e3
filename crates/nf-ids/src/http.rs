//! An incremental HTTP/1.x *request* parser fed with the client's reassembled byte stream.
//!
//! It only needs to find request boundaries and the parts worth scanning (the request target
//! and the body), so it is deliberately small: request line + headers up to the blank line,
//! then a body delimited by `Content-Length` or `Transfer-Encoding: chunked`, then the next
//! request (persistent and pipelined connections). The whole parser lives in the flow's state,
//! so a flow can be exported mid-request and resumed on another replica.
//!
//! States (`Phase`) and their named transitions:
//! ```text
//! Idle --non-CRLF byte--> Head --blank line--> Body | ChunkSize | (request done) Idle
//! Body --remaining 0--> Idle            ChunkSize --n>0--> ChunkData --0--> ChunkEnd --LF--> ChunkSize
//! ChunkSize --0--> Trailers --blank line--> Idle
//! any --malformed / too large / gap--> Resync --"<METHOD> " at a line start--> Head
//! first request malformed (from the start of the stream) --> NotHttp (ignore the flow)
//! ```

use crate::scan::Scanner;
use serde::{Deserialize, Serialize};

/// Methods recognised when looking for a request start after losing sync.
const METHODS: [&[u8]; 9] = [
    b"GET ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"HEAD ",
    b"OPTIONS ",
    b"PATCH ",
    b"CONNECT ",
    b"TRACE ",
];
/// A method token longer than this is not HTTP.
const MAX_METHOD_LEN: usize = 16;
/// Bound on a chunk-size or trailer line.
const MAX_LINE: usize = 1024;
/// Buffer capacity kept between requests.
const RETAIN_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Between requests (skips the stray CRLFs some clients send after a body).
    Idle,
    /// Accumulating the request line and headers.
    Head,
    Body {
        remaining: u64,
    },
    ChunkSize,
    ChunkData {
        remaining: u64,
    },
    /// Expecting the CRLF that ends a chunk's data.
    ChunkEnd,
    /// After the last chunk: trailer lines up to a blank one.
    Trailers,
    /// Lost sync: discarding bytes until a line starts with a known method.
    Resync {
        line_start: bool,
    },
    /// The stream did not start with an HTTP request: the rest is ignored.
    NotHttp,
}

/// Size bounds of one flow's parser.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Request line + headers.
    pub max_head_bytes: usize,
    /// Body bytes kept for scanning; the rest of a longer body is skipped, not scanned.
    pub max_body_scan_bytes: usize,
}

/// What one `feed` call found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Complete requests.
    pub requests: u64,
    /// Complete requests whose target or body matched a pattern.
    pub injections: u64,
    /// Times sync was lost on malformed input.
    pub desyncs: u64,
    /// Bodies longer than the scan bound (only their prefix was scanned).
    pub bodies_truncated: u64,
    /// The flow was classified as not HTTP.
    pub not_http: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpParser {
    phase: Phase,
    /// Head bytes, or the current chunk-size/trailer line, or a candidate method while resyncing.
    buf: Vec<u8>,
    /// The current request's target matched a pattern.
    target_hit: bool,
    /// The current request's body prefix (bounded by `Limits::max_body_scan_bytes`).
    body: Vec<u8>,
    body_truncated: bool,
    /// At least one request head parsed, or bytes were lost: from then on malformed input means
    /// "resync", not "this is not HTTP".
    committed: bool,
}

impl Default for HttpParser {
    fn default() -> Self {
        HttpParser {
            phase: Phase::Idle,
            buf: Vec::new(),
            target_hit: false,
            body: Vec::new(),
            body_truncated: false,
            committed: false,
        }
    }
}

/// Result of parsing a complete head.
struct Head {
    target: (usize, usize),
    body: BodyKind,
}

enum BodyKind {
    None,
    Length(u64),
    Chunked,
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Whether `buf` can still be the start of a request line (checked early so a binary stream is
/// classified after a few bytes instead of being buffered up to the head bound).
fn method_plausible(buf: &[u8]) -> bool {
    let n = buf.len().min(MAX_METHOD_LEN + 1);
    match buf[..n].iter().position(|&b| b == b' ') {
        Some(0) => false,
        Some(sp) => buf[..sp]
            .iter()
            .all(|b| b.is_ascii_uppercase() || *b == b'-' || *b == b'_'),
        None => {
            n <= MAX_METHOD_LEN
                && buf[..n]
                    .iter()
                    .all(|b| b.is_ascii_uppercase() || *b == b'-' || *b == b'_')
        }
    }
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Parses a complete head (`buf` ends with the blank line).
fn parse_head(buf: &[u8]) -> Result<Head, &'static str> {
    let mut lines = buf.split(|&b| b == b'\n');
    let first = trim_cr(lines.next().unwrap_or(&[]));
    let mut parts = first.split(|&b| b == b' ');
    let method = parts.next().unwrap_or(&[]);
    let target = parts.next().unwrap_or(&[]);
    let version = parts.next().unwrap_or(&[]);
    if method.is_empty()
        || method.len() > MAX_METHOD_LEN
        || !method.iter().all(|&b| is_token_byte(b))
    {
        return Err("bad_method");
    }
    if target.is_empty() || parts.next().is_some() || !version.starts_with(b"HTTP/1.") {
        return Err("bad_request_line");
    }
    // Offsets of the target inside `buf` (the first line starts at 0).
    let target_start = method.len() + 1;
    let mut content_length: Option<u64> = None;
    let mut chunked = false;
    for raw in lines {
        let line = trim_cr(raw);
        if line.is_empty() {
            break;
        }
        if line[0] == b' ' || line[0] == b'\t' {
            // Obsolete line folding: a continuation of the previous header, irrelevant here.
            continue;
        }
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            return Err("bad_header");
        };
        let name = &line[..colon];
        let value = line[colon + 1..].trim_ascii();
        if name.eq_ignore_ascii_case(b"content-length") {
            let s = std::str::from_utf8(value).map_err(|_| "bad_content_length")?;
            let n: u64 = s.parse().map_err(|_| "bad_content_length")?;
            // Two different lengths are a request-smuggling classic: refuse to guess.
            if content_length.is_some_and(|old| old != n) {
                return Err("conflicting_content_length");
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // Chunked is the final coding when present (RFC 9112 6.1).
            let last = value
                .rsplit(|&b| b == b',')
                .next()
                .unwrap_or(&[])
                .trim_ascii();
            chunked = last.eq_ignore_ascii_case(b"chunked");
        }
    }
    let body = if chunked {
        // Transfer-Encoding overrides Content-Length (RFC 9112 6.3).
        BodyKind::Chunked
    } else {
        match content_length {
            Some(n) if n > 0 => BodyKind::Length(n),
            _ => BodyKind::None,
        }
    };
    Ok(Head {
        target: (target_start, target.len()),
        body,
    })
}

fn parse_chunk_size(line: &[u8]) -> Option<u64> {
    let line = trim_cr(line);
    let size = line.split(|&b| b == b';').next()?.trim_ascii();
    if size.is_empty() || size.len() > 15 {
        return None;
    }
    let s = std::str::from_utf8(size).ok()?;
    u64::from_str_radix(s, 16).ok()
}

/// Position just past the first blank line (`\r\n\r\n` or `\n\n`) at or after `from`.
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some(i + 2);
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

/// Everything `feed` needs besides the parser's own state.
pub struct Env<'a> {
    pub limits: &'a Limits,
    pub scanner: &'a Scanner,
    /// Reused normalisation buffer.
    pub scratch: &'a mut Vec<u8>,
}

impl HttpParser {
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Bytes currently buffered (for state-size accounting and tests).
    pub fn buffered(&self) -> usize {
        self.buf.len() + self.body.len()
    }

    /// The next `bytes` of the stream were lost (`None`: unknown amount, e.g. a flow picked up
    /// mid-stream). Inside a known-length body the parser stays in sync; elsewhere it resyncs.
    pub fn gap(&mut self, bytes: Option<u64>) {
        self.committed = true;
        match (self.phase, bytes) {
            (Phase::NotHttp, _) => {}
            (Phase::Body { remaining }, Some(n)) if n < remaining => {
                self.phase = Phase::Body {
                    remaining: remaining - n,
                };
                // The scanned body is now incomplete; keep what we have.
                self.body_truncated = true;
            }
            (Phase::ChunkData { remaining }, Some(n)) if n < remaining => {
                self.phase = Phase::ChunkData {
                    remaining: remaining - n,
                };
                self.body_truncated = true;
            }
            (Phase::Resync { .. }, _) => {
                self.buf.clear();
                self.phase = Phase::Resync { line_start: true };
            }
            _ => self.lose_sync_at_boundary(),
        }
    }

    /// Drops the request in progress and looks for the next one. After a gap the next byte
    /// may well start a request (segments often begin at request boundaries), hence
    /// `line_start: true`.
    fn lose_sync_at_boundary(&mut self) {
        self.reset_request();
        self.phase = Phase::Resync { line_start: true };
    }

    fn reset_request(&mut self) {
        self.buf.clear();
        self.body.clear();
        // Give back memory after an unusually large request: many idle flows must stay small.
        if self.buf.capacity() > RETAIN_BYTES {
            self.buf = Vec::new();
        }
        if self.body.capacity() > RETAIN_BYTES {
            self.body = Vec::new();
        }
        self.target_hit = false;
        self.body_truncated = false;
    }

    fn desync(&mut self, tally: &mut Tally) {
        self.reset_request();
        if self.committed {
            tally.desyncs += 1;
            self.phase = Phase::Resync { line_start: false };
        } else {
            tally.not_http = true;
            self.phase = Phase::NotHttp;
        }
    }

    fn complete(&mut self, env: &mut Env<'_>, tally: &mut Tally) {
        let body_hit = !self.body.is_empty() && env.scanner.matches(&self.body, true, env.scratch);
        tally.requests += 1;
        if self.target_hit || body_hit {
            tally.injections += 1;
        }
        if self.body_truncated {
            tally.bodies_truncated += 1;
        }
        self.reset_request();
        self.phase = Phase::Idle;
    }

    fn keep_body(&mut self, data: &[u8], lim: &Limits) {
        let room = lim.max_body_scan_bytes.saturating_sub(self.body.len());
        let keep = data.len().min(room);
        self.body.extend_from_slice(&data[..keep]);
        if keep < data.len() {
            self.body_truncated = true;
        }
    }

    /// Consumes the next in-order bytes of the client's stream.
    pub fn feed(&mut self, data: &[u8], env: &mut Env<'_>, tally: &mut Tally) {
        let mut i = 0;
        while i < data.len() {
            let rest = &data[i..];
            match self.phase {
                Phase::NotHttp => return,
                Phase::Idle => match rest.iter().position(|&b| b != b'\r' && b != b'\n') {
                    Some(p) => {
                        i += p;
                        self.phase = Phase::Head;
                    }
                    None => return,
                },
                Phase::Head => i += self.feed_head(rest, env, tally),
                Phase::Body { remaining } => {
                    let n = rest
                        .len()
                        .min(usize::try_from(remaining).unwrap_or(usize::MAX));
                    self.keep_body(&rest[..n], env.limits);
                    i += n;
                    let left = remaining - n as u64;
                    self.phase = Phase::Body { remaining: left };
                    if left == 0 {
                        self.complete(env, tally);
                    }
                }
                Phase::ChunkSize => {
                    let line = self.take_line(rest, &mut i);
                    if self.buf.len() > MAX_LINE {
                        self.desync(tally);
                        continue;
                    }
                    if !line {
                        continue;
                    }
                    match parse_chunk_size(&self.buf) {
                        Some(0) => self.phase = Phase::Trailers,
                        Some(n) => self.phase = Phase::ChunkData { remaining: n },
                        None => {
                            self.desync(tally);
                            continue;
                        }
                    }
                    self.buf.clear();
                }
                Phase::ChunkData { remaining } => {
                    let n = rest
                        .len()
                        .min(usize::try_from(remaining).unwrap_or(usize::MAX));
                    self.keep_body(&rest[..n], env.limits);
                    i += n;
                    let left = remaining - n as u64;
                    self.phase = if left == 0 {
                        Phase::ChunkEnd
                    } else {
                        Phase::ChunkData { remaining: left }
                    };
                }
                Phase::ChunkEnd => {
                    i += 1;
                    match rest[0] {
                        b'\r' => {}
                        b'\n' => self.phase = Phase::ChunkSize,
                        _ => self.desync(tally),
                    }
                }
                Phase::Trailers => {
                    let line = self.take_line(rest, &mut i);
                    if self.buf.len() > MAX_LINE {
                        self.desync(tally);
                        continue;
                    }
                    if line {
                        let text = self.buf.strip_suffix(b"\n").unwrap_or(&self.buf);
                        if trim_cr(text).is_empty() {
                            // Only the "\n" of an empty line: the message ends here.
                            self.complete(env, tally);
                        } else {
                            self.buf.clear();
                        }
                    }
                }
                Phase::Resync { line_start } => i += self.feed_resync(rest, line_start),
            }
        }
    }

    /// Appends bytes up to and including the next `\n` to `buf`; advances `i`. Returns whether
    /// a whole line is in `buf` (false: more bytes are needed).
    fn take_line(&mut self, rest: &[u8], i: &mut usize) -> bool {
        match rest.iter().position(|&b| b == b'\n') {
            Some(p) => {
                self.buf.extend_from_slice(&rest[..=p]);
                *i += p + 1;
                true
            }
            None => {
                // Bounded: the caller refuses a line longer than MAX_LINE.
                let n = rest.len().min(MAX_LINE + 1);
                self.buf.extend_from_slice(&rest[..n]);
                *i += rest.len();
                false
            }
        }
    }

    /// Head accumulation; returns the bytes of `rest` consumed.
    fn feed_head(&mut self, rest: &[u8], env: &mut Env<'_>, tally: &mut Tally) -> usize {
        let lim = env.limits;
        // One byte beyond the bound is enough to know the head is too large.
        let room = (lim.max_head_bytes + 1).saturating_sub(self.buf.len());
        let take = rest.len().min(room);
        // A blank line may straddle the previous and the new bytes.
        let search_from = self.buf.len().saturating_sub(2);
        self.buf.extend_from_slice(&rest[..take]);
        if !method_plausible(&self.buf) {
            self.desync(tally);
            return take;
        }
        let Some(end) = head_end(&self.buf, search_from) else {
            if self.buf.len() > lim.max_head_bytes {
                self.desync(tally);
            }
            return take;
        };
        // Bytes after the blank line belong to the body or the next request.
        let unused = self.buf.len() - end;
        self.buf.truncate(end);
        match parse_head(&self.buf) {
            Ok(head) => {
                self.committed = true;
                let (s, n) = head.target;
                self.target_hit = env.scanner.matches(&self.buf[s..s + n], true, env.scratch);
                self.buf.clear();
                match head.body {
                    BodyKind::None => self.complete(env, tally),
                    BodyKind::Length(n) => self.phase = Phase::Body { remaining: n },
                    BodyKind::Chunked => self.phase = Phase::ChunkSize,
                }
            }
            Err(_) => self.desync(tally),
        }
        take - unused
    }

    /// Resync scanning; returns the bytes of `rest` consumed.
    fn feed_resync(&mut self, rest: &[u8], mut line_start: bool) -> usize {
        for (k, &b) in rest.iter().enumerate() {
            if line_start || !self.buf.is_empty() {
                self.buf.push(b);
                if METHODS.contains(&self.buf.as_slice()) {
                    // Found "<METHOD> " at a line start: the head continues from here.
                    self.phase = Phase::Head;
                    return k + 1;
                }
                if METHODS.iter().any(|m| m.starts_with(&self.buf)) {
                    line_start = false;
                    continue;
                }
                self.buf.clear();
            }
            line_start = b == b'\n';
        }
        self.phase = Phase::Resync { line_start };
        rest.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::default_patterns;

    struct T {
        p: HttpParser,
        lim: Limits,
        scanner: Scanner,
        scratch: Vec<u8>,
        tally: Tally,
    }

    impl T {
        fn new() -> T {
            T {
                p: HttpParser::default(),
                lim: Limits {
                    max_head_bytes: 1024,
                    max_body_scan_bytes: 4096,
                },
                scanner: Scanner::new(&default_patterns()).unwrap(),
                scratch: Vec::new(),
                tally: Tally::default(),
            }
        }
        fn feed(&mut self, b: &[u8]) {
            let mut env = Env {
                limits: &self.lim,
                scanner: &self.scanner,
                scratch: &mut self.scratch,
            };
            self.p.feed(b, &mut env, &mut self.tally);
        }
        /// Feeds `b` one byte at a time (every split point at once).
        fn feed_bytewise(&mut self, b: &[u8]) {
            for c in b.chunks(1) {
                self.feed(c);
            }
        }
    }

    const CLEAN: &[u8] = b"GET /index.html?a=1 HTTP/1.1\r\nHost: x\r\n\r\n";
    const BAD: &[u8] = b"GET /item?id=1%27%20OR%201%3D1 HTTP/1.1\r\nHost: x\r\n\r\n";

    fn post(body: &str) -> Vec<u8> {
        format!(
            "POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            body
        )
        .into_bytes()
    }

    #[test]
    fn persistent_mixed_requests_counted_exactly() {
        let mut stream = Vec::new();
        for i in 0..10 {
            stream.extend_from_slice(if i % 3 == 0 { BAD } else { CLEAN });
        }
        stream.extend_from_slice(&post("user=admin'--&pw=x"));
        stream.extend_from_slice(&post("user=bob&pw=secret"));
        for mode in 0..2 {
            let t = &mut T::new();
            if mode == 0 {
                t.feed(&stream);
            } else {
                t.feed_bytewise(&stream);
            }
            assert_eq!(t.tally.requests, 12, "mode {mode}");
            assert_eq!(t.tally.injections, 4 + 1, "mode {mode}");
            assert_eq!(t.p.phase(), Phase::Idle);
        }
    }

    #[test]
    fn body_with_request_text_is_not_a_request() {
        // A body that itself looks like a request must not be counted as one.
        let inner = std::str::from_utf8(BAD).unwrap();
        let mut t = T::new();
        t.feed(&post(inner));
        t.feed(CLEAN);
        assert_eq!(t.tally.requests, 2);
        assert_eq!(
            t.tally.injections, 1,
            "the body matched once, the inner text is no request"
        );
    }

    #[test]
    fn chunked_body_is_delimited_and_scanned() {
        let mut t = T::new();
        let req = b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n\
5\r\nq=1 U\r\n10;ext=1\r\nNION SELECT pw  \r\n0\r\nX-Trailer: y\r\n\r\n";
        t.feed_bytewise(req);
        t.feed(CLEAN);
        assert_eq!((t.tally.requests, t.tally.injections), (2, 1));
        assert_eq!(t.tally.desyncs, 0);
    }

    #[test]
    fn non_http_stream_is_classified_quickly() {
        let mut t = T::new();
        t.feed(&[0x16, 0x03, 0x01, 0x02, 0x00]);
        assert!(t.tally.not_http);
        assert_eq!(t.p.phase(), Phase::NotHttp);
        t.feed(BAD);
        assert_eq!(t.tally.requests, 0);
        assert_eq!(t.p.buffered(), 0);
    }

    #[test]
    fn oversized_head_is_bounded_and_resyncs() {
        let mut t = T::new();
        t.feed(CLEAN);
        let mut big = b"GET /".to_vec();
        big.extend_from_slice(&[b'a'; 5000]);
        t.feed(&big);
        assert!(t.p.buffered() <= t.lim.max_head_bytes + 1);
        assert_eq!(t.tally.desyncs, 1);
        t.feed(b" HTTP/1.1\r\n\r\n");
        t.feed(BAD);
        assert_eq!((t.tally.requests, t.tally.injections), (2, 1));
    }

    #[test]
    fn gap_inside_body_keeps_sync_elsewhere_resyncs() {
        let mut t = T::new();
        let p = post("a=1&b=2&c=3");
        t.feed(&p[..p.len() - 6]);
        t.p.gap(Some(3));
        t.feed(&p[p.len() - 3..]);
        t.feed(CLEAN);
        assert_eq!(
            t.tally.requests, 2,
            "a gap inside a body must not lose the boundary"
        );
        let mut t = T::new();
        t.feed(&CLEAN[..10]);
        t.p.gap(Some(5));
        t.feed(b"ng\r\n\r\n");
        t.feed(BAD);
        assert_eq!((t.tally.requests, t.tally.injections), (1, 1));
    }

    #[test]
    fn pickup_mid_stream_resyncs_on_next_request() {
        let mut t = T::new();
        t.p.gap(None);
        t.feed(b"tail of something\r\nHost: y\r\n\r\n");
        t.feed(BAD);
        t.feed(CLEAN);
        assert_eq!((t.tally.requests, t.tally.injections), (2, 1));
    }

    #[test]
    fn conflicting_lengths_and_garbage_never_panic() {
        let mut t = T::new();
        t.feed(CLEAN);
        t.feed(b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n");
        assert_eq!(t.tally.desyncs, 1);
        // Deterministic pseudo-random garbage in random-sized pieces.
        let mut x: u32 = 12345;
        let mut junk = Vec::new();
        for _ in 0..20000 {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            junk.push((x >> 16) as u8);
        }
        for piece in junk.chunks(37) {
            t.feed(piece);
            t.p.gap(Some(u64::from(piece[0])));
        }
        assert!(t.p.buffered() <= t.lim.max_head_bytes + t.lim.max_body_scan_bytes + MAX_LINE + 2);
    }

    #[test]
    fn huge_chunk_size_and_content_length_are_handled() {
        let mut t = T::new();
        t.feed(b"POST / HTTP/1.1\r\nContent-Length: 18446744073709551615\r\n\r\nabc");
        assert!(matches!(t.p.phase(), Phase::Body { .. }));
        let mut t = T::new();
        t.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFF\r\n");
        assert_eq!(t.p.phase(), Phase::Resync { line_start: false });
    }
}
