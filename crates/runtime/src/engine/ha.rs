//! The engine's side of high availability: the hooks of the packet loop into
//! [`crate::ha::HaPrimary`] (acks at the start of a round, output verdicts, checkpoints at the
//! end), and the control requests `protect`, `ha_status`, `activate`, `drop_standby`.
//!
//! Without a policy the only cost on the packet path is one `Option` check per packet (touch)
//! and one per round.

use super::Engine;
use crate::ha::{Decision, HaPrimary, Held, LinkFactory, OutStats, Route};
use crate::nf::{NetworkFunction, Output};
use pliant_ha::gate::Verdict;
use pliant_ha::policy::Policy;
use pliant_ha::standby::StandbyStore;
use pliant_ha::GroupId;
use pliant_io::FramePort;
use pliant_state::FlowKey;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What a replica with an `[ha]` section has: a way to open links to backups (primary role)
/// and the standby store its replication server fills (backup role).
pub struct HaBackend {
    pub factory: Box<dyn LinkFactory>,
    pub store: Option<Arc<Mutex<StandbyStore>>>,
    /// Replication server counters for `ha_status` (`None`: no listener).
    pub server_stats: Option<Box<dyn Fn() -> Value + Send>>,
}

/// HA state that outlives a policy.
#[derive(Default)]
pub(crate) struct HaSide {
    /// Ownership epoch (fencing token): raised by `protect` and `activate`.
    pub token: u64,
    pub backend: Option<HaBackend>,
    /// Next wire group id (ids are never reused within a process).
    pub next_wire_id: GroupId,
    /// Output counters of replaced policies.
    pub totals: OutStats,
    pub activated: u64,
    pub activate_failed: u64,
}

impl<N: NetworkFunction, P: FramePort> Engine<N, P> {
    /// Gives the engine its HA backend (the replica does it when `[ha]` is configured; tests
    /// with an in-memory link factory).
    pub fn set_ha_backend(&mut self, b: HaBackend) {
        self.ha_side.backend = Some(b);
    }

    /// The replica's fencing token.
    pub fn ha_token(&self) -> u64 {
        self.ha_side.token
    }

    /// Start of a round: acks release held output, link deaths make groups unprotected.
    pub(super) fn ha_poll(&mut self, now: Instant) {
        let Some(mut ha) = self.ha.take() else { return };
        let (mut released, mut dropped) = (Vec::new(), Vec::new());
        ha.poll_links(&mut released, &mut dropped);
        // Audited as they leave: nothing else happens on this thread before `route_one` hands
        // them to their port, so no ack can arrive in between.
        for h in &released {
            ha.audit_exit(&h.exit);
        }
        self.ha = Some(ha);
        for h in released {
            self.route_one(h.pkt, now);
        }
        for h in dropped {
            self.ctx.pkt_drop(h.pkt, "ha_fenced");
        }
    }

    /// End of a round: checkpoints that are due.
    pub(super) fn ha_step(&mut self, now: Instant) {
        let Some(ha) = self.ha.as_deref_mut() else {
            return;
        };
        ha.step(&mut self.ctx.flows, &self.ctx.shared, now);
    }

    /// Routes this round's NF output through the output rule.
    pub(super) fn route_output_ha(&mut self, out: &mut Vec<Output>, now: Instant) {
        let Some(mut ha) = self.ha.take() else {
            for o in out.drain(..) {
                self.route_one(o.pkt, now);
            }
            return;
        };
        // Keys of received packets and timers; output keys are noted by `decide` itself.
        ha.settle(&mut self.ctx.flows, now);
        let mut leave = Vec::with_capacity(out.len());
        // Every packet that leaves, whatever its verdict, is audited on the way out.
        let fault = ha.fault_release_early();
        for o in out.drain(..) {
            let (decision, exit) = ha.decide(&mut self.ctx.flows, o.kind);
            match decision {
                Decision::Now(Verdict::Direct) => {
                    ha.out.direct += 1;
                    ha.audit_exit(&exit);
                    leave.push(o.pkt);
                }
                Decision::Now(Verdict::Clean) => {
                    ha.out.bypassed_clean += 1;
                    ha.audit_exit(&exit);
                    leave.push(o.pkt);
                }
                Decision::Now(Verdict::Syncing) => {
                    ha.out.syncing += 1;
                    ha.audit_exit(&exit);
                    leave.push(o.pkt);
                }
                Decision::Now(_) => {
                    ha.out.unprotected += 1;
                    ha.audit_exit(&exit);
                    leave.push(o.pkt);
                }
                Decision::Hold(_) if fault => {
                    ha.audit_exit(&exit);
                    leave.push(o.pkt);
                }
                Decision::Hold(dep) => match ha.hold(dep, Held { pkt: o.pkt, exit }) {
                    None => {}
                    Some((h, Route::Now)) => {
                        ha.audit_exit(&h.exit);
                        leave.push(h.pkt);
                    }
                    Some((h, Route::Dropped)) => self.ctx.pkt_drop(h.pkt, "ha_hold_full"),
                },
                Decision::DropFenced => {
                    ha.out.dropped_fenced += 1;
                    self.ctx.pkt_drop(o.pkt, "ha_fenced");
                }
            }
        }
        self.ha = Some(ha);
        for p in leave {
            self.route_one(p, now);
        }
    }

    /// `protect`: replaces the policy under fencing token `token`.
    pub(super) fn protect(&mut self, token: u64, policy: Policy, now: Instant) -> Value {
        if token < self.ha_side.token {
            return json!({"ok": false, "error": format!(
                "stale token {token}: this replica's token is {}", self.ha_side.token)});
        }
        if let Err(e) = policy.validate() {
            return json!({"ok": false, "error": format!("bad policy: {e}")});
        }
        let Some(backend) = self.ha_side.backend.as_mut() else {
            return json!({"ok": false, "error":
                "no [ha] and [security] sections in this replica's config (no replication \
                 listener, no identity): cannot replicate"});
        };
        self.ha_side.token = token;
        if self.ha_side.next_wire_id == 0 {
            self.ha_side.next_wire_id = 1;
        }
        let prev = self.ha.take();
        if matches!(policy, Policy::Off) {
            let mut released = Vec::new();
            if let Some(mut p) = prev {
                p.release_everything(&mut released);
                self.ha_side.totals.add(&p.out);
            }
            for h in released {
                self.route_one(h.pkt, now);
            }
            return json!({"ok": true, "groups": []});
        }
        let ha = HaPrimary::new(
            policy,
            &self.name,
            token,
            backend.factory.as_mut(),
            &mut self.ctx.flows,
            now,
            &mut self.ha_side.next_wire_id,
            prev,
        );
        let groups = ha.groups_brief();
        let moved = {
            let mut ha = ha;
            let moved = ha.take_moved_out();
            for (h, route) in &moved {
                if matches!(route, Route::Now) {
                    ha.audit_exit(&h.exit);
                }
            }
            self.ha = Some(ha);
            moved
        };
        for (h, route) in moved {
            match route {
                Route::Now => self.route_one(h.pkt, now),
                Route::Dropped => self.ctx.pkt_drop(h.pkt, "ha_hold_full"),
            }
        }
        json!({"ok": true, "groups": groups})
    }

    /// `ha_status`.
    pub(super) fn ha_status(&self) -> Value {
        let mut out = self.ha_side.totals.clone();
        let policy = self.ha.as_ref().map_or(Value::Null, |h| {
            serde_json::to_value(h.policy()).unwrap_or(Value::Null)
        });
        let (mode, groups, held_now, repl, needs_backup, fenced) = match &self.ha {
            Some(ha) => {
                out.add(&ha.out);
                (
                    if ha.is_remus() { "remus" } else { "pico" },
                    ha.groups_json(self.ctx.flows.len()),
                    ha.held_now(),
                    serde_json::to_value(&ha.repl).unwrap_or(Value::Null),
                    ha.needs_backup(),
                    ha.fenced(),
                )
            }
            None => ("off", Vec::new(), 0, Value::Null, false, false),
        };
        let standby: Vec<Value> = self
            .ha_side
            .backend
            .as_ref()
            .and_then(|b| b.store.as_ref())
            .and_then(|s| s.lock().ok().map(|s| s.stats()))
            .map(|st| {
                st.primaries
                    .iter()
                    .map(|p| {
                        json!({"primary": p.primary, "flows": p.flows, "groups": p.groups,
                                    "checkpoints": p.checkpoints, "refused": p.refused,
                                    "fence": p.fence, "token": p.token})
                    })
                    .collect()
            })
            .unwrap_or_default();
        let server = self
            .ha_side
            .backend
            .as_ref()
            .and_then(|b| b.server_stats.as_ref())
            .map_or(Value::Null, |f| f());
        json!({
            "ok": true,
            "mode": mode,
            "token": self.ha_side.token,
            "policy": policy,
            "needs_backup": needs_backup,
            "fenced": fenced,
            "groups": groups,
            "standby": standby,
            "output": {
                "released": out.released,
                "released_unprotected": out.released_unprotected,
                "dropped_fenced": out.dropped_fenced,
                "held_now": held_now,
                "bypassed_clean": out.bypassed_clean,
                "direct": out.direct,
                "unprotected": out.unprotected,
                "syncing": out.syncing,
                "dropped_hold_full": out.dropped_hold_full,
                "audit_checked": out.audit_checked,
                "audit_violations": out.audit_violations,
                "audit_exempt": out.audit_exempt,
            },
            "replication": repl,
            "activations": {"flows": self.ha_side.activated, "failed": self.ha_side.activate_failed},
            "server": server,
        })
    }

    /// Prometheus lines for HA (only when a policy is or was set).
    pub(super) fn ha_metrics(&self, text: &mut String) {
        use std::fmt::Write as _;
        if self.ha.is_none() && self.ha_side.totals == OutStats::default() {
            return;
        }
        let mut out = self.ha_side.totals.clone();
        let (held, shipped, full, checkpoints) = match &self.ha {
            Some(ha) => {
                out.add(&ha.out);
                let (s, f, c) = ha.shipped_totals();
                (ha.held_now(), s, f, c)
            }
            None => (0, 0, 0, 0),
        };
        let r = &self.name;
        let counters = [
            ("released", out.released),
            ("released_unprotected", out.released_unprotected),
            ("bypassed_clean", out.bypassed_clean),
            ("direct", out.direct),
            ("unprotected", out.unprotected),
            ("syncing", out.syncing),
            ("dropped_hold_full", out.dropped_hold_full),
            ("dropped_fenced", out.dropped_fenced),
            ("audit_checked", out.audit_checked),
            ("audit_violations", out.audit_violations),
            ("checkpoints", checkpoints),
            ("bytes_shipped", shipped),
            ("bytes_full_equiv", full),
        ];
        for (name, v) in counters {
            let _ = writeln!(text, "# TYPE pliant_ha_{name}_total counter");
            let _ = writeln!(text, "pliant_ha_{name}_total{{replica=\"{r}\"}} {v}");
        }
        let _ = writeln!(text, "# TYPE pliant_ha_held_packets gauge");
        let _ = writeln!(text, "pliant_ha_held_packets{{replica=\"{r}\"}} {held}");
    }

    /// The most recent output-commit violations the audit saw (tests, debugging).
    pub fn ha_audit_violations(&self, max: usize) -> Vec<Value> {
        self.ha
            .as_ref()
            .map_or_else(Vec::new, |h| h.audit_json(max))
    }

    /// Test-only fault switch: with `on`, output that the output rule holds leaves at once
    /// instead (an early release), so tests can show the audit counts it. Nothing in the
    /// product calls it; it lasts until turned off or the policy is switched off.
    #[doc(hidden)]
    pub fn ha_fault_release_early(&mut self, on: bool) {
        if let Some(ha) = self.ha.as_deref_mut() {
            ha.set_fault_release_early(on);
        }
    }

    /// Installs one export record in the live table, the path shared by migration imports and
    /// standby activation (tombstones of its keys are cleared by `import_flow`; the NF marks
    /// its resources in use).
    pub(crate) fn import_record(
        &mut self,
        rec: &[u8],
        now: Instant,
    ) -> Result<FlowKey, pliant_state::StateError> {
        let k = self.ctx.flows.import_flow(rec, now)?;
        for a in self.ctx.flows.keys_of(&k).unwrap_or_default() {
            self.mig.forwards.remove(&a);
        }
        self.nf.on_import(&mut self.ctx, k);
        Ok(k)
    }

    /// `activate`: the standby state of `primary` becomes live here.
    pub(super) fn activate(&mut self, primary: &str, token: u64, now: Instant) -> Value {
        let Some(store) = self.ha_side.backend.as_ref().and_then(|b| b.store.clone()) else {
            return json!({"ok": false, "error": "no [ha] section: this replica holds no standby state"});
        };
        let act = match store.lock() {
            Ok(mut s) => s.activate(primary, token),
            Err(_) => return json!({"ok": false, "error": "standby store poisoned"}),
        };
        let act = match act {
            Ok(a) => a,
            Err(e) => return json!({"ok": false, "error": format!("activate {primary}: {e}")}),
        };
        self.ha_side.token = self.ha_side.token.max(token);
        let mut flows = Vec::with_capacity(act.records.len());
        let mut failed = Vec::new();
        for rec in &act.records {
            match self.import_record(rec, now) {
                Ok(k) => {
                    let aliases: Vec<String> = self
                        .ctx
                        .flows
                        .keys_of(&k)
                        .unwrap_or_default()
                        .iter()
                        .filter(|a| **a != k)
                        .map(|a| a.to_string())
                        .collect();
                    flows.push(json!({"key": k.to_string(), "aliases": aliases}));
                }
                Err(e) => failed.push(e.to_string()),
            }
        }
        let mut shared = Value::Null;
        if let Some(b) = act.shared {
            shared = match pliant_state::SharedExport::from_bytes(&b)
                .and_then(|x| self.ctx.shared.merge_from(&x))
            {
                Ok(r) => json!(format!("{r:?}")),
                Err(e) => json!(format!("error: {e}")),
            };
        }
        self.ha_side.activated += flows.len() as u64;
        self.ha_side.activate_failed += failed.len() as u64;
        tracing::info!(
            primary,
            activated = flows.len(),
            failed = failed.len(),
            "standby state activated"
        );
        json!({
            "ok": true,
            "activated": flows.len(),
            "failed": failed.len(),
            "errors": failed.iter().take(16).collect::<Vec<_>>(),
            "flows": flows,
            "last_seq": act.last_seq,
            "shared": shared,
            "token": self.ha_side.token,
        })
    }

    /// `drop_standby`: forgets the standby state of `primary`.
    pub(super) fn drop_standby(&mut self, primary: &str) -> Value {
        let Some(store) = self.ha_side.backend.as_ref().and_then(|b| b.store.clone()) else {
            return json!({"ok": false, "error": "no [ha] section: this replica holds no standby state"});
        };
        let dropped = match store.lock() {
            Ok(mut s) => s.drop_primary(primary),
            Err(_) => return json!({"ok": false, "error": "standby store poisoned"}),
        };
        json!({"ok": true, "primary": primary, "dropped": dropped})
    }

    /// Poll timeout and wake fds of the HA links.
    pub(super) fn ha_sleep_params(
        &self,
        now: Instant,
        fds: &mut Vec<std::os::fd::RawFd>,
    ) -> Option<Instant> {
        let ha = self.ha.as_ref()?;
        ha.wake_fds(fds);
        ha.next_deadline(now)
    }

    pub(super) fn ha_drain_wakes(&self) {
        if let Some(ha) = &self.ha {
            ha.drain_wakes();
        }
    }
}
