//! Deterministic PRNG for tests (xorshift64*): one seed reproduces one run.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn next(&mut self) -> u32 {
        (self.next64() >> 32) as u32
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next64() % n.max(1) as u64) as usize
    }

    pub fn fill(&mut self, b: &mut [u8]) {
        for x in b {
            *x = self.next() as u8;
        }
    }
}

/// The parse result of an IP frame (panics on anything else).
pub fn parsed(f: &[u8]) -> crate::Parsed {
    match crate::parse(f) {
        Ok(crate::Frame::Ip(p)) => p,
        other => panic!("not IP: {other:?}"),
    }
}
