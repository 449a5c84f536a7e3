//! SQL-injection pattern matching on normalised text.
//!
//! Attackers and browsers encode the same bytes many ways, so both the scanned text and the
//! patterns are brought to one form first ([`normalise`]): `%XX` decoded (once), `+` read as a
//! space (form encoding), ASCII lower-cased, and every run of whitespace folded into one space.
//! A pattern then matches as a plain substring, so `union select` also catches `UNION%20%20Select`.

/// Bound on one pattern's length (after normalisation).
pub const MAX_PATTERN_BYTES: usize = 256;
/// Bound on the number of patterns: every completed request is scanned against all of them.
pub const MAX_PATTERNS: usize = 256;

/// The default list (case-insensitive after normalisation).
pub fn default_patterns() -> Vec<String> {
    [
        "' or 1=1",
        "' or '1'='1",
        "\" or \"1\"=\"1",
        "union select",
        "union all select",
        "; drop table",
        "'--",
        "' --",
        "sleep(",
        "benchmark(",
        "xp_cmdshell",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Appends the normalised form of `input` to `out`. With `decode`, `%XX` is decoded and `+` is
/// a space; an invalid escape is kept literally (servers differ, the bytes stay visible).
pub fn normalise(input: &[u8], decode: bool, out: &mut Vec<u8>) {
    let mut i = 0;
    let mut last_space = false;
    while i < input.len() {
        let mut b = input[i];
        i += 1;
        if decode {
            if b == b'+' {
                b = b' ';
            } else if b == b'%' {
                if let (Some(h), Some(l)) = (
                    input.get(i).copied().and_then(hex),
                    input.get(i + 1).copied().and_then(hex),
                ) {
                    b = h << 4 | l;
                    i += 2;
                }
            }
        }
        if b.is_ascii_whitespace() || b == 0x0b {
            if !last_space {
                out.push(b' ');
            }
            last_space = true;
            continue;
        }
        last_space = false;
        out.push(b.to_ascii_lowercase());
    }
}

/// A compiled, validated pattern set.
#[derive(Clone, Debug)]
pub struct Scanner {
    patterns: Vec<Vec<u8>>,
}

impl Scanner {
    /// Validates and normalises `patterns` (the error names the bad one).
    pub fn new(patterns: &[String]) -> Result<Scanner, String> {
        if patterns.is_empty() {
            return Err("patterns is empty: the IDS would never detect anything".into());
        }
        if patterns.len() > MAX_PATTERNS {
            return Err(format!(
                "{} patterns configured; at most {MAX_PATTERNS}",
                patterns.len()
            ));
        }
        let mut out = Vec::with_capacity(patterns.len());
        for (i, p) in patterns.iter().enumerate() {
            let mut n = Vec::new();
            // Patterns are written literally: no %-decoding, only case and whitespace folding.
            normalise(p.as_bytes(), false, &mut n);
            let trimmed = n.trim_ascii();
            if trimmed.is_empty() {
                return Err(format!(
                    "pattern #{} ({p:?}) is empty or only whitespace",
                    i + 1
                ));
            }
            if n.len() > MAX_PATTERN_BYTES {
                return Err(format!(
                    "pattern #{} is {} bytes; at most {MAX_PATTERN_BYTES}",
                    i + 1,
                    n.len()
                ));
            }
            out.push(n);
        }
        Ok(Scanner { patterns: out })
    }

    /// Whether any pattern occurs in `raw` after normalisation (`decode` as in [`normalise`]).
    /// `scratch` is reused between calls to avoid allocating per request.
    pub fn matches(&self, raw: &[u8], decode: bool, scratch: &mut Vec<u8>) -> bool {
        scratch.clear();
        normalise(raw, decode, scratch);
        self.patterns.iter().any(|p| contains(scratch, p))
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    if needle.is_empty() || needle.len() > hay.len() {
        return needle.is_empty();
    }
    let first = needle[0];
    hay.windows(needle.len())
        .any(|w| w[0] == first && w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        let mut v = Vec::new();
        normalise(s.as_bytes(), true, &mut v);
        String::from_utf8_lossy(&v).into_owned()
    }

    #[test]
    fn normalisation() {
        assert_eq!(norm("%27%20OR%201%3D1"), "' or 1=1");
        assert_eq!(norm("UNION++%09SeLeCt"), "union select");
        assert_eq!(norm("100%"), "100%");
        assert_eq!(norm("%zz%4"), "%zz%4");
        assert_eq!(norm("%"), "%");
    }

    #[test]
    fn scanner_matches_encoded_injections_only() {
        let s = Scanner::new(&default_patterns()).unwrap();
        let mut scratch = Vec::new();
        let mut m = |t: &str| s.matches(t.as_bytes(), true, &mut scratch);
        assert!(m("/item?id=1%27%20or%201%3D1"));
        assert!(m("/q?x=1+UNION+SELECT+password+FROM+users"));
        assert!(m("/q?x=a';%20DROP%20TABLE%20users"));
        assert!(m("/q?name=admin'--"));
        assert!(m("/q?id=1+and+sleep(5)"));
        assert!(!m("/index.html?page=2&sort=asc"));
        assert!(!m("/search?q=union+station+select+menu"));
        assert!(!m("/a?b=it's+fine"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(Scanner::new(&[]).unwrap_err().contains("empty"));
        assert!(Scanner::new(&["ok".into(), "  ".into()])
            .unwrap_err()
            .contains("pattern #2"));
        assert!(Scanner::new(&["x".repeat(300)])
            .unwrap_err()
            .contains("at most"));
    }
}
