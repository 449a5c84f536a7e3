//! The pure half of `pliant bench smr`: parsing what the tools print and assembling the JSON
//! report. No I/O here, so every rule is unit-tested.

use serde_json::{json, Map, Value};

/// One line of `redis-benchmark --csv`.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchLine {
    /// `SET`, `GET`, ... as redis-benchmark names the test.
    pub test: String,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Parses `redis-benchmark --csv` output: a header naming the columns (`"test","rps",...,
/// "p50_latency_ms",...,"p99_latency_ms",...`), then one line per test. Columns are found by
/// name, so their order does not matter; a missing column or a value that is not a number is
/// an error, not a zero.
pub fn parse_benchmark_csv(text: &str) -> Result<Vec<BenchLine>, String> {
    let unquote = |f: &str| f.trim().trim_matches('"').to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let header: Vec<String> = lines
        .by_ref()
        .find(|l| l.starts_with("\"test\""))
        .ok_or_else(|| format!("no CSV header in redis-benchmark output: {text:?}"))?
        .split(',')
        .map(unquote)
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| format!("redis-benchmark CSV without a {name:?} column: {header:?}"))
    };
    let (rps, p50, p99) = (col("rps")?, col("p50_latency_ms")?, col("p99_latency_ms")?);
    let mut out = Vec::new();
    for l in lines {
        let f: Vec<String> = l.split(',').map(unquote).collect();
        let num = |i: usize| -> Result<f64, String> {
            f.get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| format!("redis-benchmark CSV line {l:?}: column {i} not a number"))
        };
        out.push(BenchLine {
            test: f[0].clone(),
            rps: num(rps)?,
            p50_ms: num(p50)?,
            p99_ms: num(p99)?,
        });
    }
    if out.is_empty() {
        return Err(format!("no test lines in redis-benchmark output: {text:?}"));
    }
    Ok(out)
}

/// A numeric field of `INFO` output (`field:value` lines), e.g. `master_repl_offset`.
pub fn info_u64(info: &str, field: &str) -> Option<u64> {
    info.lines()
        .filter_map(|l| l.trim().split_once(':'))
        .find(|(k, _)| *k == field)
        .and_then(|(_, v)| v.trim().parse().ok())
}

/// Nearest-rank percentile (`q` in 0..=100) of ascending samples; `None` when there are none.
pub fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// One system at one client count.
#[derive(Debug, Clone, PartialEq)]
pub struct Measure {
    pub clients: u32,
    /// Requests of every test (writes and reads).
    pub ops: u64,
    pub secs: f64,
    /// Latency of the write test (SET; SET + WAIT for `redis_wait1`): what replication costs.
    pub p50_us: f64,
    pub p99_us: f64,
    /// Bytes the system replicated (log appended, replication offset moved) during the run;
    /// `None` for a system that replicates nothing.
    pub replicated: Option<u64>,
    /// Per test: name, requests per second, p50 and p99 in microseconds.
    pub by_test: Vec<(String, f64, f64, f64)>,
}

impl Measure {
    pub fn ops_per_s(&self) -> f64 {
        if self.secs > 0.0 {
            self.ops as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Replicated bytes per request (0 for an unreplicated system).
    pub fn bytes_per_op(&self) -> f64 {
        match self.replicated {
            Some(b) if self.ops > 0 => b as f64 / self.ops as f64,
            _ => 0.0,
        }
    }

    /// A redis-benchmark run of `n` requests per test: the tests ran one after the other, so
    /// the run took the sum of `n / rps`; the latency is the write test's (`SET`, or the first
    /// test when there is no SET).
    pub fn from_benchmark(
        clients: u32,
        n: u64,
        lines: &[BenchLine],
        replicated: Option<u64>,
    ) -> Result<Measure, String> {
        let write = lines
            .iter()
            .find(|l| l.test == "SET")
            .or(lines.first())
            .ok_or("no redis-benchmark results")?;
        if lines.iter().any(|l| l.rps <= 0.0) {
            return Err(format!("a test without a rate: {lines:?}"));
        }
        Ok(Measure {
            clients,
            ops: n * lines.len() as u64,
            secs: lines.iter().map(|l| n as f64 / l.rps).sum(),
            p50_us: write.p50_ms * 1e3,
            p99_us: write.p99_ms * 1e3,
            replicated,
            by_test: lines
                .iter()
                .map(|l| (l.test.clone(), l.rps, l.p50_ms * 1e3, l.p99_ms * 1e3))
                .collect(),
        })
    }

    fn json(&self) -> Value {
        let tests: Map<String, Value> = self
            .by_test
            .iter()
            .map(|(t, rps, p50, p99)| {
                let v = json!({"ops_per_s": round(*rps, 1), "latency_us_p50": round(*p50, 1),
                               "latency_us_p99": round(*p99, 1)});
                (t.to_lowercase(), v)
            })
            .collect();
        json!({
            "clients": self.clients,
            "ops": self.ops,
            "ops_per_s": round(self.ops_per_s(), 1),
            "latency_us_p50": round(self.p50_us, 1),
            "latency_us_p99": round(self.p99_us, 1),
            "bytes_replicated_per_op": round(self.bytes_per_op(), 2),
            "by_test": tests,
        })
    }
}

/// A failover trial: a write load of unique keys, the leader/primary SIGKILLed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Failover {
    /// Kill to the first write acknowledged by the new leader/primary.
    pub failover_ms: Option<f64>,
    pub acked_writes: u64,
    /// Acknowledged writes missing on the new leader/primary afterwards.
    pub acked_writes_lost: u64,
    /// Connections that went on serving writes after the kill without reconnecting.
    pub connections_kept: u32,
    pub connections_total: u32,
    pub error: Option<String>,
}

impl Failover {
    fn json(&self) -> Value {
        json!({
            "failover_ms": self.failover_ms.map(|v| round(v, 1)),
            "acked_writes": self.acked_writes,
            "acked_writes_lost": self.acked_writes_lost,
            "connections_kept": self.connections_kept,
            "connections_total": self.connections_total,
            "failover_error": self.error,
        })
    }
}

/// A system's object: the figures at `headline` clients at the top (or the first measured
/// count when that one failed), every count under `by_clients`, the failover's fields when
/// it has one, and `errors` for whatever could not be measured.
pub fn system_json(
    runs: &[Measure],
    errors: &[String],
    failover: Option<&Failover>,
    headline: u32,
) -> Value {
    let mut o = Map::new();
    let top = runs.iter().find(|m| m.clients == headline).or(runs.first());
    match top.map(Measure::json) {
        Some(Value::Object(fields)) => o.extend(
            fields
                .into_iter()
                .filter(|(k, _)| k != "ops" && k != "by_test"),
        ),
        _ => {
            for k in [
                "clients",
                "ops_per_s",
                "latency_us_p50",
                "latency_us_p99",
                "bytes_replicated_per_op",
            ] {
                o.insert(k.into(), Value::Null);
            }
        }
    }
    let by: Map<String, Value> = runs
        .iter()
        .map(|m| (m.clients.to_string(), m.json()))
        .collect();
    o.insert("by_clients".into(), Value::Object(by));
    if let Some(Value::Object(f)) = failover.map(Failover::json) {
        o.extend(f);
    }
    o.insert("errors".into(), json!(errors));
    Value::Object(o)
}

/// `a / b` of a numeric field of two system objects, when both have it and `b` is not 0.
pub fn ratio(a: &Value, b: &Value, field: &str) -> Option<f64> {
    let (x, y) = (a.get(field)?.as_f64()?, b.get(field)?.as_f64()?);
    (y > 0.0).then(|| round(x / y, 3))
}

/// The whole report: the systems and pliant_smr's ratios against the unreplicated server.
pub fn report_json(systems: Map<String, Value>, meta: Value) -> Value {
    let unrep = systems.get("unreplicated").cloned().unwrap_or(Value::Null);
    let smr = systems.get("pliant_smr").cloned().unwrap_or(Value::Null);
    json!({
        "bench": "smr",
        "ratio_ops_vs_unreplicated": ratio(&smr, &unrep, "ops_per_s"),
        "ratio_latency_p50_vs_unreplicated": ratio(&smr, &unrep, "latency_us_p50"),
        "systems": systems,
        "meta": meta,
    })
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
        \"SET\",\"40000.00\",\"0.065\",\"0.024\",\"0.063\",\"0.111\",\"0.167\",\"0.263\"\n\
        \"GET\",\"50000.00\",\"0.060\",\"0.016\",\"0.055\",\"0.103\",\"0.127\",\"0.175\"\n";

    #[test]
    fn redis_benchmark_csv_is_read_by_column_name() {
        let l = parse_benchmark_csv(&format!("some noise\n{CSV}")).unwrap();
        assert_eq!(l.len(), 2);
        assert_eq!(
            l[0],
            BenchLine {
                test: "SET".into(),
                rps: 40000.0,
                p50_ms: 0.063,
                p99_ms: 0.167
            }
        );
        assert_eq!((l[1].test.as_str(), l[1].p50_ms), ("GET", 0.055));
    }

    #[test]
    fn bad_redis_benchmark_output_is_an_error() {
        assert!(parse_benchmark_csv("").is_err(), "empty");
        assert!(parse_benchmark_csv("\"test\",\"rps\"\n\"SET\",\"1\"\n")
            .unwrap_err()
            .contains("p50_latency_ms"));
        let bad = CSV.replace("\"40000.00\"", "\"fast\"");
        assert!(parse_benchmark_csv(&bad)
            .unwrap_err()
            .contains("not a number"));
        let header_only = CSV.lines().next().unwrap();
        assert!(parse_benchmark_csv(header_only)
            .unwrap_err()
            .contains("no test lines"));
    }

    #[test]
    fn info_fields_and_percentiles() {
        let info = "# Replication\r\nrole:master\r\nmaster_repl_offset:12345\r\n";
        assert_eq!(info_u64(info, "master_repl_offset"), Some(12345));
        assert_eq!(info_u64(info, "role"), None, "not a number");
        assert_eq!(info_u64(info, "missing"), None);
        let s: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&s, 50.0), Some(50));
        assert_eq!(percentile(&s, 99.0), Some(99));
        assert_eq!(percentile(&s, 0.0), Some(1));
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn a_benchmark_run_adds_up_its_tests() {
        let l = parse_benchmark_csv(CSV).unwrap();
        let m = Measure::from_benchmark(4, 1000, &l, Some(90_000)).unwrap();
        assert_eq!(m.ops, 2000);
        // 1000 SETs at 40k/s and 1000 GETs at 50k/s: 45 ms for 2000 requests.
        assert!((m.secs - 0.045).abs() < 1e-9);
        assert!((m.ops_per_s() - 2000.0 / 0.045).abs() < 1e-6);
        assert_eq!((m.p50_us, m.p99_us), (63.0, 167.0), "the SET's latency");
        assert_eq!(m.bytes_per_op(), 45.0);
        let none = Measure::from_benchmark(1, 10, &l, None).unwrap();
        assert_eq!(none.bytes_per_op(), 0.0);
        assert!(Measure::from_benchmark(1, 10, &[], None).is_err());
    }

    #[test]
    fn the_report_has_every_system_and_the_ratios() {
        let l = parse_benchmark_csv(CSV).unwrap();
        let fast = Measure::from_benchmark(4, 1000, &l, None).unwrap();
        let mut slow = Measure::from_benchmark(4, 1000, &l, Some(140_000)).unwrap();
        slow.secs *= 4.0;
        slow.p50_us *= 2.0;
        let one = Measure {
            clients: 1,
            ..slow.clone()
        };
        let fo = Failover {
            failover_ms: Some(612.34),
            acked_writes: 900,
            acked_writes_lost: 0,
            connections_kept: 0,
            connections_total: 4,
            error: None,
        };
        let mut systems = Map::new();
        systems.insert("unreplicated".into(), system_json(&[fast], &[], None, 4));
        systems.insert(
            "pliant_smr".into(),
            system_json(&[one, slow], &[], Some(&fo), 4),
        );
        systems.insert(
            "redis_wait1".into(),
            system_json(&[], &["no replica".into()], None, 4),
        );
        let r = report_json(systems, json!({"load": "1.0"}));
        assert_eq!(r["ratio_ops_vs_unreplicated"], json!(0.25));
        assert_eq!(r["ratio_latency_p50_vs_unreplicated"], json!(2.0));
        let smr = &r["systems"]["pliant_smr"];
        assert_eq!(smr["clients"], json!(4), "the headline is the 4-client run");
        assert_eq!(smr["bytes_replicated_per_op"], json!(70.0));
        assert_eq!(smr["failover_ms"], json!(612.3));
        assert_eq!(smr["connections_total"], json!(4));
        assert_eq!(smr["by_clients"]["1"]["clients"], json!(1));
        assert_eq!(
            smr["by_clients"]["4"]["by_test"]["get"]["ops_per_s"],
            json!(50000.0)
        );
        let w = &r["systems"]["redis_wait1"];
        assert_eq!(w["ops_per_s"], Value::Null, "a failed system reports null");
        assert_eq!(w["errors"][0], json!("no replica"));
        assert!(w.get("failover_ms").is_none(), "no failover for it");
        // Without an unreplicated figure there is no ratio.
        let r = report_json(Map::new(), Value::Null);
        assert_eq!(r["ratio_ops_vs_unreplicated"], Value::Null);
    }
}
