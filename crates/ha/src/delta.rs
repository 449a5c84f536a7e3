//! XOR + run-length deltas between two versions of a flow record (RemusDB's ASC idea, at flow
//! granularity). Flow records change in a few fields per packet (counters, sequence numbers,
//! timestamps), so `new XOR base` is mostly zero bytes; encoding only the non-zero stretches
//! makes a checkpoint of a busy flow a few dozen bytes instead of the whole record.
//!
//! Format (all integers unsigned LEB128 varints):
//! `new_len`, then pairs `(zero_run, literal_len, literal_len bytes of new XOR base)` until
//! `new_len` bytes are described. Bytes of `new` beyond `base.len()` are XORed with 0 (that is,
//! stored literally), so records that grew still encode; records that shrank simply end early.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DeltaError {
    #[error("delta truncated at byte {0}")]
    Truncated(usize),
    #[error("delta describes {described} bytes but declares {declared}")]
    LengthMismatch { described: usize, declared: usize },
    #[error("delta declares {0} bytes, over the {max}-byte record bound", max = MAX_RECORD)]
    TooLarge(usize),
}

/// Largest record a delta may describe (bounds the decoder's allocation on hostile input).
pub const MAX_RECORD: usize = 16 << 20;

/// Literal stretches are cut at this many bytes of zeros: shorter zero gaps stay inside the
/// literal, because a new pair costs two varints (two bytes at least).
const MIN_ZERO_GAP: usize = 3;

fn put_varint(out: &mut Vec<u8>, mut v: usize) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn get_varint(b: &[u8], pos: &mut usize) -> Result<usize, DeltaError> {
    let mut v: usize = 0;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*pos).ok_or(DeltaError::Truncated(*pos))?;
        *pos += 1;
        v |= usize::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(DeltaError::Truncated(*pos))
}

fn xor_at(base: &[u8], new: &[u8], i: usize) -> u8 {
    new[i] ^ base.get(i).copied().unwrap_or(0)
}

/// Encodes `new` relative to `base`.
pub fn encode(base: &[u8], new: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    put_varint(&mut out, new.len());
    let n = new.len();
    let mut i = 0;
    while i < n {
        let zstart = i;
        while i < n && xor_at(base, new, i) == 0 {
            i += 1;
        }
        let zeros = i - zstart;
        if i == n {
            // Trailing zeros: the declared length covers them.
            put_varint(&mut out, zeros);
            put_varint(&mut out, 0);
            break;
        }
        // Literal until a zero gap long enough to be worth a new pair; `lend` is one past the
        // last non-zero byte, so the literal never ends in zeros.
        let lstart = i;
        let mut lend = i;
        while i < n {
            if xor_at(base, new, i) != 0 {
                i += 1;
                lend = i;
            } else if i + 1 - lend >= MIN_ZERO_GAP {
                break;
            } else {
                i += 1;
            }
        }
        i = lend;
        put_varint(&mut out, zeros);
        put_varint(&mut out, lend - lstart);
        out.extend((lstart..lend).map(|j| xor_at(base, new, j)));
    }
    out
}

/// Rebuilds the record `delta` describes on top of `base`.
pub fn decode(base: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeltaError> {
    let mut pos = 0;
    let len = get_varint(delta, &mut pos)?;
    if len > MAX_RECORD {
        return Err(DeltaError::TooLarge(len));
    }
    let mut out: Vec<u8> = (0..len)
        .map(|i| base.get(i).copied().unwrap_or(0))
        .collect();
    let mut at = 0usize;
    while at < len {
        let zeros = get_varint(delta, &mut pos)?;
        let lit = get_varint(delta, &mut pos)?;
        at = at.saturating_add(zeros);
        if lit == 0 {
            break;
        }
        let end = at.saturating_add(lit);
        if end > len {
            return Err(DeltaError::LengthMismatch {
                described: end,
                declared: len,
            });
        }
        let src = delta
            .get(pos..pos + lit)
            .ok_or(DeltaError::Truncated(pos))?;
        for (o, x) in out[at..end].iter_mut().zip(src) {
            *o ^= x;
        }
        pos += lit;
        at = end;
    }
    if at > len {
        return Err(DeltaError::LengthMismatch {
            described: at,
            declared: len,
        });
    }
    if pos != delta.len() {
        return Err(DeltaError::LengthMismatch {
            described: pos,
            declared: delta.len(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt(base: &[u8], new: &[u8]) -> usize {
        let d = encode(base, new);
        assert_eq!(
            decode(base, &d).unwrap(),
            new,
            "base {base:?} new {new:?} delta {d:?}"
        );
        d.len()
    }

    #[test]
    fn round_trips_edge_cases() {
        rt(b"", b"");
        rt(b"", b"abc");
        rt(b"abc", b"");
        rt(b"abc", b"abc");
        rt(b"abcdef", b"abXdef");
        rt(b"abcdef", b"abcdefgh");
        rt(b"abcdefgh", b"abc");
        rt(&[0; 10], &[0; 10]);
        rt(&[1, 0, 0, 1, 0, 0, 0, 0, 1], &[0; 9]);
    }

    #[test]
    fn small_change_gives_small_delta() {
        let base: Vec<u8> = (0..200u8).collect();
        let mut new = base.clone();
        new[17] ^= 0xff;
        new[150] = 3;
        let n = rt(&base, &new);
        assert!(n < 12, "delta of two changed bytes in 200 is {n} bytes");
        assert!(
            rt(&base, &base) <= 5,
            "an unchanged record costs its length and one pair"
        );
    }

    #[test]
    fn random_pairs_round_trip() {
        // Deterministic xorshift so failures reproduce.
        let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..3000 {
            let blen = (next() % 64) as usize;
            let base: Vec<u8> = (0..blen).map(|_| (next() % 4) as u8).collect();
            let nlen = (next() % 64) as usize;
            let new: Vec<u8> = (0..nlen)
                .map(|i| {
                    if next() % 3 == 0 {
                        (next() % 4) as u8
                    } else {
                        base.get(i).copied().unwrap_or(0)
                    }
                })
                .collect();
            rt(&base, &new);
        }
    }

    #[test]
    fn hostile_deltas_are_errors_not_panics() {
        assert!(decode(b"", &[]).is_err());
        assert!(decode(b"", &[0xff; 12]).is_err());
        assert!(decode(b"abc", &[3, 0, 5, 1]).is_err());
        assert!(decode(b"abc", &[3, 5, 1, 9]).is_err());
        assert!(decode(b"", &[0x80, 0x80, 0x80, 0x80, 0x08]).is_err()); // 2 GiB declared
        assert!(decode(b"abc", &[3, 0, 0, 7]).is_err()); // trailing bytes
    }
}
