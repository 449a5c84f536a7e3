//! Loss-free migration checks shared by the migration e2e tests: a sequence-numbered UDP stream
//! through the moving flows (flowgen, the generator `bench migrate` uses), and the replicas'
//! drop counters checked over the whole map.
//!
//! Why UDP: the tests' TCP transfers complete even when pliant drops a segment mid-move (the
//! sender retransmits), so "the download finished" cannot show a loss-free move. A UDP datagram
//! dropped, overtaken or repeated by a move shows at the receiver as a missing, late or repeated
//! sequence number.

use pliant_bench::flowgen::{UdpFlows, UdpSpec, UdpTotals};
use pliant_lab::{Lab, Role, CLIENT_IP, SERVER_IP};
use pliant_proto::Request;
use pliant_state::FlowKey;
use serde_json::Value;
use std::time::{Duration, Instant};

/// The key of the UDP flow from the client's `sport` to the server's `dport` (to steer it
/// before its first datagram, and to find it in a replica's `flows` listing).
pub fn udp_key(sport: u16, dport: u16) -> FlowKey {
    let (c, s) = (
        CLIENT_IP.parse().expect("ip"),
        SERVER_IP.parse().expect("ip"),
    );
    FlowKey::v4(pliant_state::key::proto::UDP, c, sport, s, dport).0
}

/// One paced UDP flow from the client to the server through the NF, every datagram numbered.
pub struct SeqStream {
    flows: UdpFlows,
    /// The flow's (direction-normalised) key, as the replicas list it.
    pub key: FlowKey,
}

impl SeqStream {
    /// Starts the flow from the client's `sport` to the server's `dport` at `pps` datagrams/s.
    /// The client resolves its gateway first: datagrams queued behind ARP in a fresh namespace
    /// can leave after later ones, a reordering no migration caused (`bench migrate` does the
    /// same).
    pub fn start(lab: &Lab, sport: u16, dport: u16, pps: f64) -> SeqStream {
        pliant_bench::migrate::resolve_gateways(lab).expect("the client resolves its gateway");
        let (c, s) = (
            CLIENT_IP.parse().expect("ip"),
            SERVER_IP.parse().expect("ip"),
        );
        let flows = UdpFlows::start(&UdpSpec {
            client_ns: lab.netns(Role::Client),
            server_ns: lab.netns(Role::Server),
            client_ip: c,
            server_ip: s,
            sport_base: sport,
            dport,
            flows: 1,
            pps_per_flow: pps,
            payload: 100,
        })
        .expect("start the UDP stream");
        SeqStream {
            flows,
            key: udp_key(sport, dport),
        }
    }

    /// Waits until datagrams reach the server (the flow exists on a replica from then on).
    pub fn wait_arriving(&self, limit: Duration) {
        let t = Instant::now();
        while self.flows.seen_sport(0).is_none() {
            assert!(
                t.elapsed() < limit,
                "the UDP stream never reached the server"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Datagrams sent so far.
    pub fn sent(&self) -> u64 {
        self.flows.totals(0..1).sent
    }

    /// Stops the stream, lets datagrams in flight arrive, and asserts that none of those sent
    /// was lost, reordered or duplicated. Returns the totals for the test's report.
    pub fn finish_loss_free(self, what: &str) -> UdpTotals {
        let (t, errors) = self.flows.stop(Duration::from_millis(300));
        assert!(errors.is_empty(), "{what}: UDP stream errors: {errors:?}");
        assert!(t.received > 0, "{what}: nothing arrived: {t:?}");
        assert_eq!(
            (t.lost, t.reordered, t.duplicated),
            (0, 0, 0),
            "{what}: the UDP stream through the moves lost/reordered/duplicated datagrams: {t:?}"
        );
        t
    }
}

/// Asserts that a replica's `stats` answer shows no drop that could have been a moving flow's
/// packet: every reason in the whole `drops` map must be 0 except those that cannot be one
/// (`pliant_bench::migrate::DROPS_NOT_OF_MOVED_FLOWS`: non-IP, multicast, IPv6, addressed to
/// the router itself), and the migration counters of held, forwarded and exported packets must
/// be 0 as well.
pub fn assert_no_drops_of_moved_flows(who: &str, stats: &Value) {
    let drops = stats["drops"]
        .as_object()
        .unwrap_or_else(|| panic!("{who}: no drops map in {stats}"));
    let bad: Vec<(&String, &Value)> = drops
        .iter()
        .filter(|(k, v)| pliant_bench::migrate::drop_may_hit_moved_flow(k) && **v != 0)
        .collect();
    assert!(bad.is_empty(), "{who}: pliant dropped packets: {bad:?}");
    let m = &stats["migration"];
    for c in [
        "hold_overflow",
        "forward_failed",
        "late_after_release",
        "forward_loops",
        "peer_errors",
        "flows_import_failed",
        "tx_settle_timeouts",
    ] {
        assert_eq!(m[c], 0, "{who}: migration.{c}: {m}");
    }
}

/// One request to a lab replica (as the lab's admin): the `ok` answer.
pub fn ask(sock: &str, req: Request) -> Value {
    control_of(sock)
        .call(&req)
        .unwrap_or_else(|e| panic!("{sock}: {e}"))
}

pub fn control_of(sock: &str) -> pliant_proto::Client {
    pliant_lab::ha::control_client(std::path::Path::new(sock))
}
