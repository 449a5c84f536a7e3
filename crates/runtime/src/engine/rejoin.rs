//! `rejoin`: a replica that failed over while it was alive but cut off (a partition) becomes
//! an empty member again, without a restart.
//!
//! While it was cut off, the controller declared it dead, fenced it in the fabric and made
//! its backups' copies of its flows live elsewhere; its backups' owners re-protected
//! themselves elsewhere too. Everything it still holds is stale: flows that now live at
//! another replica, output it held for a backup's acknowledgement (or for a neighbour's
//! answer, or for a migration), standby copies of other replicas' flows. Releasing any of
//! that would emit packets of flows that failed over, which design invariant 1 (one owner per
//! flow) forbids; so all of it is dropped, counted, and nothing is sent. The NF rebuilds its
//! own accounting from the empty table (the NAT keeps the ports of the dropped mappings
//! reserved: they live on at the new owners). Then the replica takes the controller's new
//! token, under which its next `protect` makes it a primary (of new flows) and its
//! replication server a backup again.

use super::Engine;
use crate::nf::NetworkFunction;
use pliant_io::FramePort;
use pliant_proto::reply;
use serde_json::{json, Value};

impl<N: NetworkFunction, P: FramePort> Engine<N, P> {
    pub(super) fn rejoin(&mut self, token: u64) -> Value {
        if token <= self.ha_side.token {
            return json!({"ok": false, "error": format!(
                "stale token {token}: a rejoin needs a token newer than this replica's ({})",
                self.ha_side.token)});
        }
        let mut r = reply::Rejoin::default();
        // As a primary: output held for acknowledgements is discarded, never released.
        if let Some(mut p) = self.ha.take() {
            let mut held = Vec::new();
            r.groups_closed = p.discard_everything(&mut held) as u64;
            self.ha_side.totals.add(&p.out);
            r.packets_dropped += held.len() as u64;
            for h in held {
                self.ctx.pkt_drop(h.pkt, "rejoin_discarded");
            }
            // Dropping `p` closes its links to the backups.
        }
        // As a backup.
        if let Some(store) = self.ha_side.backend.as_ref().and_then(|b| b.store.clone()) {
            if let Ok(mut s) = store.lock() {
                r.standby_dropped = s.drop_all() as u64;
            }
        }
        // Migrations: held packets are dropped, outgoing moves answered, forwards forgotten.
        r.migrations_ended = (self.mig.holds.len() + self.mig.out.len()) as u64;
        self.mig.holds.clear();
        for (_, p) in std::mem::take(&mut self.mig.held) {
            r.packets_dropped += 1;
            self.ctx.pkt_drop(p, "rejoin_discarded");
        }
        for m in std::mem::take(&mut self.mig.out) {
            if let Some(reply) = m.reply {
                let _ = reply.try_send(json!({"ok": false,
                    "error": "the source failed over and rejoined: this move ended"}));
            }
        }
        self.mig.pending_in.clear();
        self.mig.forwards.clear();
        self.mig.forward_order.clear();
        // Frames routed but waiting for a neighbour's answer.
        for n in &mut self.neigh {
            let d = n.drop_queued();
            r.packets_dropped += d;
            self.ctx.count_drop("rejoin_discarded", d);
        }
        // The flows. Between rounds no transaction is open, so none is busy.
        for k in self.ctx.flows.keys() {
            if self.ctx.flows.delete_flow(&k).is_ok() {
                r.flows_dropped += 1;
            }
        }
        debug_assert!(self.ctx.flows.is_empty(), "rejoin left flows behind");
        self.nf.on_flows_dropped(&mut self.ctx);
        self.ha_side.token = token;
        r.token = token;
        tracing::warn!(
            token,
            flows = r.flows_dropped,
            packets = r.packets_dropped,
            standby = r.standby_dropped,
            "rejoined after a failover: everything this replica held is dropped"
        );
        let mut v = serde_json::to_value(&r).unwrap_or_else(|_| json!({}));
        v["ok"] = json!(true);
        v
    }
}
