//! Parsers for the tools' outputs (iperf3 JSON, ping text, nft JSON) and small statistics.
//! Pure functions, unit-tested on captured samples; bad input is an error, never a panic.

use crate::BenchError;

/// One iperf3 client run, from its `-J` output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IperfResult {
    /// Received throughput (`end.sum_received.bits_per_second`) in Gbit/s.
    pub gbps: f64,
    /// Sender-side TCP retransmissions (`end.sum_sent.retransmits`).
    pub retransmits: u64,
}

pub fn parse_iperf3_gbps(json: &str) -> Result<IperfResult, BenchError> {
    let v: serde_json::Value =
        serde_json::from_str(json.trim()).map_err(|e| BenchError::Parse {
            what: "iperf3 JSON",
            reason: e.to_string(),
        })?;
    if let Some(err) = v.get("error").and_then(|e| e.as_str()) {
        return Err(BenchError::Tool {
            tool: "iperf3",
            reason: err.to_string(),
        });
    }
    let end = v.get("end").ok_or(BenchError::Parse {
        what: "iperf3 JSON",
        reason: "no \"end\" section".into(),
    })?;
    let bps = end
        .get("sum_received")
        .and_then(|s| s.get("bits_per_second"))
        .and_then(|b| b.as_f64())
        .ok_or(BenchError::Parse {
            what: "iperf3 JSON",
            reason: "no end.sum_received.bits_per_second".into(),
        })?;
    let retransmits = end
        .get("sum_sent")
        .and_then(|s| s.get("retransmits"))
        .and_then(|r| r.as_u64())
        .unwrap_or(0);
    Ok(IperfResult {
        gbps: bps / 1e9,
        retransmits,
    })
}

/// Per-reply round-trip times in microseconds from `ping` output (`time=0.045 ms` lines).
pub fn parse_ping_rtts_us(text: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|l| {
            let rest = &l[l.find("time=")? + 5..];
            let num = rest.split_whitespace().next()?;
            let ms: f64 = num.parse().ok()?;
            // `time=` is in ms unless ping switched units (it does not for sub-second RTTs,
            // but be strict: only accept the "ms" unit).
            (rest.split_whitespace().nth(1) == Some("ms") && ms.is_finite() && ms >= 0.0)
                .then_some(ms * 1000.0)
        })
        .collect()
}

/// Nearest-rank percentile (p in 0..=100) of unsorted samples; `None` when empty.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let mut s: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    Some(s[rank.clamp(1, s.len()) - 1])
}

/// Packets of a named nft counter from `nft -j list counter ...`.
pub fn parse_nft_counter_packets(json: &str) -> Result<u64, BenchError> {
    let v: serde_json::Value =
        serde_json::from_str(json.trim()).map_err(|e| BenchError::Parse {
            what: "nft JSON",
            reason: e.to_string(),
        })?;
    v.get("nftables")
        .and_then(|a| a.as_array())
        .and_then(|a| {
            a.iter()
                .find_map(|o| o.get("counter")?.get("packets")?.as_u64())
        })
        .ok_or(BenchError::Parse {
            what: "nft JSON",
            reason: "no counter.packets".into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iperf3_end_section_is_read() {
        let j = r#"{"start":{},"end":{"sum_sent":{"bits_per_second":1.9e10,"retransmits":7},
                   "sum_received":{"bits_per_second":1.84e10}}}"#;
        let r = parse_iperf3_gbps(j).expect("parse");
        assert!((r.gbps - 18.4).abs() < 1e-9);
        assert_eq!(r.retransmits, 7);
    }

    #[test]
    fn iperf3_error_and_garbage_are_errors() {
        let e =
            parse_iperf3_gbps(r#"{"start":{},"end":{},"error":"unable to connect"}"#).unwrap_err();
        assert!(e.to_string().contains("unable to connect"), "{e}");
        assert!(parse_iperf3_gbps("").is_err());
        assert!(parse_iperf3_gbps(r#"{"end":{}}"#).is_err());
    }

    #[test]
    fn ping_lines_give_microseconds() {
        let t = "PING 10.77.2.2 (10.77.2.2) 56(84) bytes of data.\n\
                 64 bytes from 10.77.2.2: icmp_seq=1 ttl=63 time=0.045 ms\n\
                 64 bytes from 10.77.2.2: icmp_seq=2 ttl=63 time=1.50 ms\n\
                 From 10.77.1.1 icmp_seq=3 Destination Host Unreachable\n\
                 64 bytes from 10.77.2.2: icmp_seq=4 ttl=63 time=bogus ms\n\
                 rtt min/avg/max/mdev = 0.045/0.772/1.500/0.727 ms\n";
        let v = parse_ping_rtts_us(t);
        assert_eq!(v.len(), 2);
        assert!((v[0] - 45.0).abs() < 1e-9 && (v[1] - 1500.0).abs() < 1e-9);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&s, 50.0), Some(50.0));
        assert_eq!(percentile(&s, 99.0), Some(99.0));
        assert_eq!(percentile(&s, 100.0), Some(100.0));
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&s, 101.0), None);
    }

    #[test]
    fn nft_counter_json_is_read() {
        let j = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"counter": {"family": "netdev",
                   "name": "rx64", "table": "t", "handle": 2, "packets": 228096, "bytes": 10492416}}]}"#;
        assert_eq!(parse_nft_counter_packets(j).expect("parse"), 228096);
        assert!(parse_nft_counter_packets(r#"{"nftables": []}"#).is_err());
    }
}
