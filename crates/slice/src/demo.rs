//! The example application: a line-protocol server with per-session state.
//!
//! Every byte a client sends goes into a running FNV-1a hash; every newline counts a line and
//! is answered with `"<lines> <hash>\n"` (the hash as 16 hex digits, over everything received
//! so far). A client computes the same from what it sent, so each reply checks the whole
//! stream in both directions, byte for byte, wherever the session has been moved meanwhile.

use crate::format::{fnv1a, FNV_OFFSET};
use crate::instance::SessionApp;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineApp {
    pub lines: u64,
    /// Hash of every byte received.
    pub rx_hash: u64,
    /// Hash of every byte answered.
    pub tx_hash: u64,
}

const STATE_VERSION: u8 = 1;
const STATE_LEN: usize = 25;

/// The reply to the `lines`-th line when everything received so far hashes to `hash`.
pub fn reply(lines: u64, hash: u64) -> String {
    format!("{lines} {hash:016x}\n")
}

impl SessionApp for LineApp {
    fn new_session() -> Self {
        LineApp {
            lines: 0,
            rx_hash: FNV_OFFSET,
            tx_hash: FNV_OFFSET,
        }
    }

    fn on_input(&mut self, input: &[u8], out: &mut Vec<u8>) {
        let mut rest = input;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.rx_hash = fnv1a(self.rx_hash, &rest[..=i]);
            self.lines += 1;
            let r = reply(self.lines, self.rx_hash);
            self.tx_hash = fnv1a(self.tx_hash, r.as_bytes());
            out.extend_from_slice(r.as_bytes());
            rest = &rest[i + 1..];
        }
        self.rx_hash = fnv1a(self.rx_hash, rest);
    }

    fn save(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(STATE_LEN);
        b.push(STATE_VERSION);
        for v in [self.lines, self.rx_hash, self.tx_hash] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn load(b: &[u8]) -> Result<Self, String> {
        if b.len() != STATE_LEN || b[0] != STATE_VERSION {
            return Err(format!(
                "line-app state: {} bytes of version {:?}, expected {STATE_LEN} of version \
                 {STATE_VERSION}",
                b.len(),
                b.first()
            ));
        }
        let u =
            |i: usize| u64::from_le_bytes(b[1 + 8 * i..9 + 8 * i].try_into().unwrap_or_default());
        Ok(LineApp {
            lines: u(0),
            rx_hash: u(1),
            tx_hash: u(2),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_cover_everything_received_and_state_round_trips() {
        let mut a = LineApp::new_session();
        let mut out = Vec::new();
        a.on_input(b"one\ntw", &mut out);
        a.on_input(b"o\n", &mut out);
        let h1 = fnv1a(FNV_OFFSET, b"one\n");
        let h2 = fnv1a(h1, b"two\n");
        assert_eq!(
            out,
            format!("{}{}", reply(1, h1), reply(2, h2)).into_bytes()
        );
        assert_eq!(a.tx_hash, fnv1a(FNV_OFFSET, &out));
        assert_eq!(LineApp::load(&a.save()), Ok(a.clone()));
        assert!(LineApp::load(&a.save()[1..]).is_err());
        assert!(LineApp::load(&[]).is_err());
    }
}
