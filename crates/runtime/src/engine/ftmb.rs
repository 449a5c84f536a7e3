//! The engine's side of the FTMB mode: the hooks of the packet loop into
//! [`crate::ftmb::FtmbMode`] (dispatch instead of the NF call, released output into the output
//! path, the wake fd) and the control requests `ftmb_protect`, `ftmb_status`, `ftmb_activate`.
//! In ftmb mode the requests that act on the engine's own flow table (migration, Pico
//! replication, port blocks) are refused with a clear error: the flows live on the workers.
//! `flows` is answered from the workers' flows (the coordinator's flow index, same shape as
//! the engine's own listing): the controller's exception GC and the retirement of a
//! failed-over replica need it.
//!
//! Without the mode the only cost on the packet path is one `Option` check per packet and
//! one per round.

use super::Engine;
use crate::control::Cmd;
use crate::ftmb::{FtmbCmd, FtmbMode};
use crate::nf::{NetworkFunction, Output, Packet};
use pliant_io::FramePort;
use serde_json::{json, Value};
use std::sync::mpsc::SyncSender;

impl<N: NetworkFunction, P: FramePort> Engine<N, P> {
    /// Puts the engine in FTMB mode (the replica does it for `[ha] mode = "ftmb"`).
    pub fn set_ftmb(&mut self, mode: Box<dyn FtmbMode>) {
        self.ftmb = Some(mode);
    }

    /// True in FTMB mode.
    pub fn is_ftmb(&self) -> bool {
        self.ftmb.is_some()
    }

    pub(super) fn ftmb_dispatch(&mut self, pkt: Packet) {
        let Some(f) = self.ftmb.as_mut() else {
            return self.ctx.pkt_drop(pkt, "ftmb_not_dispatched");
        };
        if let Some((p, why)) = f.dispatch(pkt) {
            self.ctx.pkt_drop(p, why);
        }
    }

    /// Released FTMB output joins this round's output (routed like any other packet).
    pub(super) fn ftmb_poll(&mut self, out: &mut Vec<Output>) {
        let Engine { ftmb, ctx, .. } = self;
        if let Some(f) = ftmb.as_mut() {
            f.poll(out, &mut |why, n| ctx.count_drop(why, n));
        }
    }

    pub(super) fn ftmb_drain_wake(&self) {
        if let Some(f) = &self.ftmb {
            f.drain_wake();
        }
    }

    /// Takes the FTMB commands (answered now or later on `reply`) and, in ftmb mode, refuses
    /// what does not apply; everything else comes back for the normal path.
    pub(super) fn ftmb_submit(
        &mut self,
        cmd: Cmd,
        reply: SyncSender<Value>,
    ) -> Option<(Cmd, SyncSender<Value>)> {
        let fcmd = match cmd {
            Cmd::FtmbProtect { logger, host } => FtmbCmd::Protect { logger, host },
            Cmd::FtmbStatus => FtmbCmd::Status,
            Cmd::FtmbActivate { primary } => FtmbCmd::Activate { primary },
            Cmd::FtmbHold { primary } => FtmbCmd::Hold { primary },
            // The engine's own table is empty in ftmb mode: the workers hold the flows.
            Cmd::Flows if self.ftmb.is_some() => FtmbCmd::Flows {
                max: self.opts.max_listed_flows,
            },
            other => {
                if let Some(v) = self.ftmb_refusal(&other) {
                    let _ = reply.try_send(v);
                    return None;
                }
                return Some((other, reply));
            }
        };
        match self.ftmb.as_mut() {
            Some(f) => f.command(fcmd, reply),
            None => {
                let _ = reply.try_send(json!({"ok": false, "error":
                    "not in ftmb mode: this replica runs without [ha] mode = \"ftmb\""}));
            }
        }
        None
    }

    /// In ftmb mode, the answer to a request that does not apply there.
    pub(super) fn ftmb_refusal(&self, cmd: &Cmd) -> Option<Value> {
        self.ftmb.as_ref()?;
        let what = refused_in_ftmb(cmd)?;
        Some(json!({"ok": false, "error": format!(
            "{what} is not supported in ftmb mode: flows live on the FTMB workers \
             (use ftmb_protect / ftmb_activate)")}))
    }

    /// `ha_status`, which reports `"mode": "ftmb"` (and the `ftmb_status` answer under
    /// `"ftmb"`) for an FTMB replica.
    pub(super) fn ha_status_any(&self) -> Value {
        let mut v = self.ha_status();
        if self.ftmb.is_some() {
            v["mode"] = json!("ftmb");
            v["ftmb"] = self.ftmb_status();
        }
        v
    }

    fn ftmb_status(&self) -> Value {
        self.ftmb.as_ref().map_or(Value::Null, |f| f.status())
    }

    /// Prometheus lines of the FTMB mode (none without it).
    pub(super) fn ftmb_metrics(&self, text: &mut String) {
        use std::fmt::Write as _;
        if self.ftmb.is_none() {
            return;
        }
        let st = self.ftmb_status();
        let r = self.name.clone();
        let num = |v: &Value| v.as_u64().unwrap_or(0);
        let counters = [
            ("snapshots", num(&st["snapshots"])),
            ("snapshot_failures", num(&st["snapshot_failures"])),
            ("barrier_failures", num(&st["barrier_failures"])),
            ("fallbacks", num(&st["fallbacks"])),
            ("dispatched", num(&st["dispatch"]["dispatched"])),
            ("queue_full", num(&st["dispatch"]["queue_full"])),
            ("held", num(&st["dispatch"]["held"])),
            ("hold_full", num(&st["dispatch"]["hold_full"])),
            ("released", num(&st["release"]["released"])),
            ("release_dropped", num(&st["release"]["dropped_full"])),
        ];
        for (name, v) in counters {
            let _ = writeln!(text, "# TYPE pliant_ftmb_{name}_total counter");
            let _ = writeln!(text, "pliant_ftmb_{name}_total{{replica=\"{r}\"}} {v}");
        }
        let _ = writeln!(text, "# TYPE pliant_ftmb_protected gauge");
        let _ = writeln!(
            text,
            "pliant_ftmb_protected{{replica=\"{r}\"}} {}",
            u8::from(st["protected"] == true)
        );
        let _ = writeln!(text, "# TYPE pliant_ftmb_snapshot_pause_us gauge");
        for (q, field) in [
            ("0.5", "snapshot_pause_us_p50"),
            ("0.99", "snapshot_pause_us_p99"),
        ] {
            if let Some(v) = st[field].as_u64() {
                let _ = writeln!(
                    text,
                    "pliant_ftmb_snapshot_pause_us{{replica=\"{r}\",quantile=\"{q}\"}} {v}"
                );
            }
        }
    }

    /// An FTMB command answered synchronously (tests and direct callers; the control socket
    /// goes through `submit`, which does not block the packet thread).
    pub(super) fn ftmb_answer(&mut self, cmd: Cmd) -> Value {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        if let Some((_, _)) = self.ftmb_submit(cmd, tx) {
            return json!({"ok": false, "error": "not an FTMB command"});
        }
        rx.recv_timeout(crate::control::FTMB_WAIT)
            .unwrap_or_else(|_| json!({"ok": false, "error": "ftmb: no answer in time"}))
    }
}

/// The requests that act on the engine's own flow table or Pico replication.
fn refused_in_ftmb(cmd: &Cmd) -> Option<&'static str> {
    Some(match cmd {
        // Looked up in the engine's own table, which is empty here; a flow is moved by key
        // only through migration, which does not apply either.
        Cmd::Flow { .. } => "flow",
        Cmd::MigrateIn { .. } => "migrate_in",
        Cmd::MigrateAbort { .. } => "migrate_abort",
        Cmd::MigrateOut { .. } => "migrate_out",
        Cmd::PeerConnect { .. } => "peer_connect",
        Cmd::SetPortBlocks { .. } => "set_port_blocks",
        Cmd::SharedExport => "shared_export",
        Cmd::SharedMerge { .. } => "shared_merge",
        Cmd::Protect { .. } => "protect (Pico/Remus)",
        Cmd::Activate { .. } => "activate (Pico/Remus)",
        Cmd::DropStandby { .. } => "drop_standby",
        Cmd::Rejoin { .. } => "rejoin (Pico/Remus)",
        _ => return None,
    })
}
