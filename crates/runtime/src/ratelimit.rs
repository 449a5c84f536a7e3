//! A token bucket for the router's own ICMP errors (time exceeded, fragmentation needed), so a
//! flood of expiring or oversized packets cannot turn the replica into a packet source
//! (RFC 1812 §4.3.2.8). Time comes from the caller (the round's `now`): deterministic in tests.

use std::time::Instant;

#[derive(Clone, Debug)]
pub struct TokenBucket {
    per_s: u32,
    burst: u32,
    /// Tokens in millis of a token (integer arithmetic, no drift).
    milli_tokens: u64,
    last: Option<Instant>,
}

impl TokenBucket {
    /// `per_s` tokens a second, at most `burst` saved up (starts full).
    pub fn new(per_s: u32, burst: u32) -> TokenBucket {
        TokenBucket {
            per_s,
            burst,
            milli_tokens: u64::from(burst) * 1000,
            last: None,
        }
    }

    /// Takes one token at `now`; false when none is left.
    pub fn take(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            let el = now.saturating_duration_since(last);
            // per_s tokens/s = per_s milli-tokens/ms.
            let add = el.as_millis().saturating_mul(u128::from(self.per_s));
            let add = u64::try_from(add).unwrap_or(u64::MAX);
            if add > 0 {
                self.milli_tokens = self
                    .milli_tokens
                    .saturating_add(add)
                    .min(u64::from(self.burst) * 1000);
                self.last = Some(now);
            }
        } else {
            self.last = Some(now);
        }
        if self.milli_tokens >= 1000 {
            self.milli_tokens -= 1000;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn burst_then_refill_by_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100, 5);
        assert_eq!((0..10).filter(|_| b.take(t0)).count(), 5);
        // 100/s: one token per 10 ms.
        assert!(!b.take(t0 + Duration::from_millis(5)));
        assert!(b.take(t0 + Duration::from_millis(10)));
        // A long pause refills only up to the burst.
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!((0..10).filter(|_| b.take(t1)).count(), 5);
    }
}
