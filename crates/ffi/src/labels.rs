//! Counter labels from C strings. The runtime's counters are keyed by `&'static str` (stable
//! labels, no allocation per increment); C passes transient strings, so each distinct label is
//! leaked once into a bounded process-wide set.

use std::sync::Mutex;

/// Distinct labels per process; later ones are counted under [`OVERFLOW_LABEL`].
pub const MAX_LABELS: usize = 256;
/// Longest label accepted; longer ones are refused by the callers (EINVAL).
pub const MAX_LABEL_LEN: usize = 64;
pub const OVERFLOW_LABEL: &str = "c_label_overflow";

static LABELS: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// The interned copy of `s` (or the overflow label once the set is full).
pub fn intern(s: &str) -> &'static str {
    let mut l = LABELS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(found) = l.iter().find(|x| **x == s) {
        return found;
    }
    if l.len() >= MAX_LABELS {
        return OVERFLOW_LABEL;
    }
    let leaked: &'static str = Box::leak(s.to_string().into_boxed_str());
    l.push(leaked);
    leaked
}

/// Labels must look like metric label parts: `[a-z0-9_]`, 1..=64 bytes.
pub fn valid(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_LABEL_LEN
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_returns_the_same_pointer() {
        let a = intern("quota_drop");
        let b = intern(&String::from("quota_drop"));
        assert!(std::ptr::eq(a, b));
        assert!(valid("quota_drop") && !valid("Bad Label") && !valid(""));
    }
}
