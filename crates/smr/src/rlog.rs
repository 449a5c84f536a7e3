//! raft-rs logs through `slog`; the project reports through `tracing`. This drain forwards
//! raft's records (message and key-values) to `tracing` under the target `raft`, so raft's
//! warnings reach the same subscriber as everything else. Its info records (elections, term
//! changes) go out at debug: they come at every election and say what `Status` already does.

use slog::{Drain, Level, OwnedKVList, Record, KV};
use std::fmt::Write as _;

pub struct TracingDrain;

/// Collects a record's key-values as ` k=v` pairs.
struct Pairs(String);

impl slog::Serializer for Pairs {
    fn emit_arguments(&mut self, key: slog::Key, val: &std::fmt::Arguments) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record, values: &OwnedKVList) -> Result<(), slog::Never> {
        let mut kv = Pairs(String::new());
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        let msg = record.msg();
        match record.level() {
            Level::Critical | Level::Error => tracing::error!(target: "raft", "{msg}{}", kv.0),
            Level::Warning => tracing::warn!(target: "raft", "{msg}{}", kv.0),
            Level::Info => tracing::debug!(target: "raft", "{msg}{}", kv.0),
            Level::Debug | Level::Trace => tracing::trace!(target: "raft", "{msg}{}", kv.0),
        }
        Ok(())
    }
}

/// The logger handed to raft.
pub fn logger() -> slog::Logger {
    slog::Logger::root(TracingDrain.fuse(), slog::o!())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn raft_records_reach_tracing_with_their_values_and_levels() {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(sub, || {
            let log = super::logger().new(slog::o!("raft_id" => 2));
            slog::warn!(log, "rejected msgApp"; "index" => 7);
            slog::info!(log, "became leader"; "term" => 3);
        });
        let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(out.contains("WARN"), "{out}");
        assert!(out.contains("rejected msgApp index=7 raft_id=2"), "{out}");
        assert!(
            !out.contains("became leader"),
            "info goes out at debug: {out}"
        );
    }
}
