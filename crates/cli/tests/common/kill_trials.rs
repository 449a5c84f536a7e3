//! Long-lived traffic and controller checks for the kill-trial tests (`e2e_ha_trials`,
//! `e2e_ftmb`).
//!
//! Traffic comes in *generations*: before each kill the test starts one ([`Traffic::start_gen`]):
//! sequence-numbered UDP flows (flowgen's [`UdpFlows`], [`UDP_PER_MEMBER`] on every live replica,
//! placed by the controller's ring) and one byte-pattern TCP stream (flowgen's [`TcpStream`])
//! on every live replica. A generation lives through [`GEN_TRIALS`] kills, then it is stopped
//! and judged ([`Traffic::retire`]); so every kill has fresh flows on every replica, victim and
//! survivors alike.
//!
//! Loss is attributed to kills seq by seq. Before each kill [`Traffic::cut`] asks every live
//! replica which flows it holds (`flows` on its control socket) and notes how many datagrams
//! each UDP flow had sent: the seqs from that cut to the next one are the flow's *stretch* of
//! that trial. A stretch of a flow that was on the victim may lose datagrams (they were inside
//! the dead replica); every other stretch must lose none. The cut is taken before the random
//! delay that precedes the kill ([`KILL_DELAY_MIN`] at least), so a datagram sent before the
//! cut was through the victim long before it died. Nothing may be reordered or duplicated on
//! any flow, victim's or not, and no TCP stream may see a reset, a corrupted byte or an
//! incomplete transfer.
//!
//! [`Protections`] collects every protection the controller sent (its answers carry the
//! replicas the policy named and `sent_unix_ms`): from the failover records' re-protections,
//! the scale-out answers and the poll's `reprotect` events. [`Protections::check`] asserts that
//! none sent after the controller detected a death names the dead replica, independently of
//! the controller's own `protects_naming_unlive` counter.

use super::ha::{control, HaRun, Ring};
use pliant_bench::flowgen::{TcpStream, UdpFlows, UdpSpec};
use pliant_lab::{Role, CLIENT_IP, SERVER_IP};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

/// UDP flows each generation places on every live replica.
pub const UDP_PER_MEMBER: usize = 2;
/// Datagrams per second per UDP flow (one every 10 ms: a stall shows as missing seqs).
pub const UDP_PPS: f64 = 100.0;
/// TCP streams write this many pattern bytes every [`TCP_EVERY`].
pub const TCP_CHUNK: usize = 2048;
pub const TCP_EVERY: Duration = Duration::from_millis(10);
/// Kills a generation lives through before it is judged.
pub const GEN_TRIALS: usize = 3;
/// The random delay between the cut and the kill is at least this, at most this plus
/// [`KILL_DELAY_SPREAD_MS`].
pub const KILL_DELAY_MIN: Duration = Duration::from_millis(150);
pub const KILL_DELAY_SPREAD_MS: u64 = 1000;

/// A tiny deterministic generator (xorshift; the seed is printed so a run can be repeated).
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from `PLIANT_TRIAL_SEED` when set (to repeat a run), else from the clock.
    pub fn from_env_or_clock() -> Rng {
        let seed = std::env::var("PLIANT_TRIAL_SEED")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            })
            | 1;
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The delay before a kill: [`KILL_DELAY_MIN`] plus up to [`KILL_DELAY_SPREAD_MS`].
    pub fn kill_delay(&mut self) -> Duration {
        KILL_DELAY_MIN + Duration::from_millis(self.next() % KILL_DELAY_SPREAD_MS)
    }
}

/// The `key` of every flow a replica lists (`flows` on its control socket), and whether the
/// listing was complete.
fn listed_keys(run: &HaRun, r: u32) -> Result<(BTreeSet<String>, bool), String> {
    let sock = run.lab().control_socket_of(r as u8);
    let v = control(&sock, &pliant_proto::Request::Flows)?;
    if v["ok"] != true {
        return Err(format!("r{r} flows: {v}"));
    }
    let keys = v["flows"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|f| f["key"].as_str().map(str::to_string))
        .collect();
    Ok((keys, v["total"] == v["listed"]))
}

/// One cut of a generation: the trial it precedes, each UDP flow's sent count and whether the
/// flow was on that trial's victim.
struct Cut {
    trial: usize,
    sent: Vec<u64>,
    on_victim: Vec<bool>,
    /// FTMB: not on the victim, but on a replica whose logger host was the victim.
    via_victim_logger: Vec<bool>,
    holders: Vec<Vec<u32>>,
    /// FTMB: the logger hosts of the holders (for the failure messages).
    logs_to: Vec<Option<Vec<String>>>,
}

struct Tcp {
    sport: u16,
    dport: u16,
    /// The stream's key as the replicas list it.
    key: String,
    placed_on: u32,
    stream: TcpStream,
    /// Was on the victim at some cut (it went through a failover).
    through_victim: bool,
}

struct Gen {
    trial: usize,
    udp: UdpFlows,
    /// The UDP flows' keys as the replicas list them, by flow index.
    keys: Vec<String>,
    /// Where the ring placed each UDP flow.
    placed_on: Vec<u32>,
    tcp: Vec<Tcp>,
    cuts: Vec<Cut>,
}

/// Whether loss on flows off the victim fails the test.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum OffVictimLoss {
    /// Any datagram lost outside a victim's stretch fails the run (Pico).
    #[default]
    Judged,
    /// Counted and printed, not judged (FTMB: the recovering host can lose datagrams of its own
    /// flows while it recovers — an open defect of FTMB mode; reordering, duplication and every
    /// TCP check still fail the run). Loss on the flows of the replica that logged to the
    /// victim IS judged (must be 0): that replica keeps its output until its logger confirms
    /// it released it and sends the rest itself when the logger dies
    /// (`pliant_ftmb::HeldOutputs`); before that, the output in flight at the dying logger
    /// host died with it (~3 datagrams per kill).
    Measured,
}

/// What the retired generations showed, summed.
#[derive(Debug, Default, Clone)]
pub struct Totals {
    pub off_victim_loss: OffVictimLoss,
    pub generations: usize,
    pub udp_flows: u64,
    pub udp_sent: u64,
    pub udp_received: u64,
    pub udp_reordered: u64,
    pub udp_duplicated: u64,
    /// Stretches (one flow through one kill) of flows that were not on the victim.
    pub stretches_checked: u64,
    /// Datagrams sent in those stretches, and how many of them were lost (must be 0).
    pub seqs_checked: u64,
    pub lost_checked: u64,
    /// Stretches of flows that were on the victim, and their lost datagrams (allowed).
    pub stretches_exempt: u64,
    pub lost_exempt: u64,
    /// FTMB: stretches of flows on a replica that logged to the victim, and their lost
    /// datagrams (must be 0: the replica did not fail, and its output held for its dying
    /// logger is sent by itself; see [`OffVictimLoss::Measured`]).
    pub stretches_via_victim_logger: u64,
    pub lost_via_victim_logger: u64,
    pub tcp_streams: u64,
    pub tcp_streams_through_a_victim: u64,
    pub tcp_bytes: u64,
    pub tcp_resets: u64,
    pub tcp_corrupted: u64,
    pub tcp_incomplete: u64,
}

impl Totals {
    /// One summary line.
    pub fn line(&self) -> String {
        format!(
            "UDP: {} flows in {} generations, {} sent, {} received, {} reordered, {} \
             duplicated; {} flow-kills off the victim checked ({} datagrams, {} lost, {:?}), {} on the \
             victim ({} lost, allowed), {} logging to the victim ({} lost); TCP: {} \
             streams ({} through a failover), {} bytes, {} resets, {} corrupted bytes, {} \
             incomplete",
            self.udp_flows,
            self.generations,
            self.udp_sent,
            self.udp_received,
            self.udp_reordered,
            self.udp_duplicated,
            self.stretches_checked,
            self.seqs_checked,
            self.lost_checked,
            self.off_victim_loss,
            self.stretches_exempt,
            self.lost_exempt,
            self.stretches_via_victim_logger,
            self.lost_via_victim_logger,
            self.tcp_streams,
            self.tcp_streams_through_a_victim,
            self.tcp_bytes,
            self.tcp_resets,
            self.tcp_corrupted,
            self.tcp_incomplete
        )
    }

    /// After `kills` kills with a generation started before each: the totals agree with the
    /// per-generation verdicts ([`Traffic::retire`] panics first), and the checks were not
    /// vacuous: every kill's own generation had [`UDP_PER_MEMBER`] UDP flows on the victim and
    /// on each of the two survivors, and a TCP stream on the victim.
    pub fn assert_clean_and_meaningful(&self, kills: usize) {
        if self.off_victim_loss == OffVictimLoss::Judged {
            assert_eq!(self.lost_checked, 0, "{self:?}");
        }
        assert_eq!(
            self.lost_via_victim_logger, 0,
            "flows of a replica that logged to a victim lost datagrams: {self:?}"
        );
        assert_eq!(
            (self.udp_reordered, self.udp_duplicated),
            (0, 0),
            "{self:?}"
        );
        assert_eq!(
            (self.tcp_resets, self.tcp_corrupted, self.tcp_incomplete),
            (0, 0, 0),
            "{self:?}"
        );
        // Off the victim: the two survivors' flows. Under FTMB one survivor logs to the victim
        // (its flows are counted apart), so only the third one's are strictly checked.
        assert!(
            self.stretches_checked + self.stretches_via_victim_logger
                >= (kills * 2 * UDP_PER_MEMBER) as u64,
            "too few UDP flow-kills off the victim: {self:?}"
        );
        assert!(
            self.stretches_checked >= (kills * UDP_PER_MEMBER) as u64,
            "too few UDP flow-kills off the victim were checked: {self:?}"
        );
        assert!(
            self.stretches_exempt >= (kills * UDP_PER_MEMBER) as u64,
            "too few UDP flows were on a victim: {self:?}"
        );
        assert!(
            self.tcp_streams_through_a_victim >= kills as u64,
            "too few TCP streams went through a failover: {self:?}"
        );
    }
}

/// What one cut found.
#[derive(Debug, Default)]
pub struct CutReport {
    /// UDP flows of live generations per live replica.
    pub udp_per_member: BTreeMap<u32, usize>,
    /// UDP flows on the victim (their stretch of this trial is exempt from the loss check).
    pub udp_on_victim: usize,
    pub udp_flows: usize,
    /// TCP streams of live generations on the victim.
    pub tcp_on_victim: usize,
}

/// The generations in flight and what the retired ones showed.
pub struct Traffic {
    client_ns: String,
    server_ns: String,
    gens: Vec<Gen>,
    next_udp_sport: u16,
    next_udp_dport: u16,
    next_tcp_sport: u16,
    next_tcp_dport: u16,
    pub totals: Totals,
}

impl Traffic {
    /// Resolves the client's gateway first (datagrams queued behind ARP in a fresh namespace
    /// can leave after later ones: a reordering no failover caused).
    pub fn new(run: &HaRun, off_victim_loss: OffVictimLoss) -> Traffic {
        pliant_bench::migrate::resolve_gateways(run.lab())
            .expect("the client resolves its gateway");
        Traffic {
            client_ns: run.lab().netns(Role::Client),
            server_ns: run.lab().netns(Role::Server),
            gens: Vec::new(),
            next_udp_sport: 20_000,
            next_udp_dport: 7_100,
            next_tcp_sport: 30_000,
            next_tcp_dport: 9_100,
            totals: Totals {
                off_victim_loss,
                ..Totals::default()
            },
        }
    }

    /// Starts a generation for `trial`: [`UDP_PER_MEMBER`] UDP flows and one TCP stream on
    /// every live replica (by the controller's ring over the members), and waits until every
    /// flow reaches the server.
    pub fn start_gen(&mut self, run: &HaRun, trial: usize) {
        let members = run.members();
        let ring = Ring::of(&members).expect("maglev");
        let n = UDP_PER_MEMBER * members.len();
        let dport = self.next_udp_dport;
        self.next_udp_dport += 1;
        // A block of consecutive source ports the ring spreads evenly over the members.
        let udp_proto = pliant_state::key::proto::UDP;
        let base = ring
            .spread_block(
                &members,
                udp_proto,
                dport,
                UDP_PER_MEMBER,
                self.next_udp_sport,
                30_000,
            )
            .expect("ran out of UDP source ports");
        self.next_udp_sport = base + n as u16;
        let (c, s): (Ipv4Addr, Ipv4Addr) = (
            CLIENT_IP.parse().expect("ip"),
            SERVER_IP.parse().expect("ip"),
        );
        let udp = UdpFlows::start(&UdpSpec {
            client_ns: self.client_ns.clone(),
            server_ns: self.server_ns.clone(),
            client_ip: c,
            server_ip: s,
            sport_base: base,
            dport,
            flows: n,
            pps_per_flow: UDP_PPS,
            payload: 64,
        })
        .expect("start the UDP flows");
        let keys = (0..n as u16)
            .map(|i| super::migration::udp_key(base + i, dport).to_string())
            .collect();
        let placed_on = (0..n as u16)
            .map(|i| ring.owner(udp_proto, base + i, dport))
            .collect();
        let mut tcp = Vec::new();
        for m in &members {
            let dport = self.next_tcp_dport;
            self.next_tcp_dport += 1;
            let sport = run.sports_for(*m, dport, 1, &mut self.next_tcp_sport)[0];
            let stream = TcpStream::start(
                &self.client_ns,
                &self.server_ns,
                SocketAddrV4::new(c, sport),
                SocketAddrV4::new(s, dport),
                TCP_CHUNK,
                TCP_EVERY,
            )
            .expect("start a TCP stream");
            let (key, _) =
                pliant_state::FlowKey::v4(pliant_state::key::proto::TCP, c, sport, s, dport);
            tcp.push(Tcp {
                sport,
                dport,
                key: key.to_string(),
                placed_on: *m,
                stream,
                through_victim: false,
            });
        }
        let g = Gen {
            trial,
            udp,
            keys,
            placed_on,
            tcp,
            cuts: Vec::new(),
        };
        let t = Instant::now();
        loop {
            let udp_in = (0..n).all(|i| g.udp.seen_sport(i).is_some());
            let tcp_in = g.tcp.iter().all(|x| {
                x.stream
                    .counters()
                    .bytes_received
                    .load(std::sync::atomic::Ordering::Relaxed)
                    > 0
            });
            if udp_in && tcp_in {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "trial {trial}: the generation's flows never all reached the server (UDP \
                 {udp_in}, TCP {tcp_in})"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.gens.push(g);
    }

    /// Before the kill of `trial`: where every UDP flow of every live generation is (the
    /// replicas that list it) and how much each has sent. Waits until every flow is listed
    /// by some live replica (FTMB replicas list their workers' flows as of the last snapshot).
    pub fn cut(&mut self, run: &HaRun, trial: usize, victim: u32) -> CutReport {
        let members = run.members();
        let t = Instant::now();
        let holders: BTreeMap<String, Vec<u32>> = loop {
            let mut h: BTreeMap<String, Vec<u32>> = BTreeMap::new();
            let mut complete = true;
            for m in &members {
                let (keys, all) = listed_keys(run, *m)
                    .unwrap_or_else(|e| panic!("trial {trial}: r{m}'s flows: {e}"));
                complete &= all;
                for k in keys {
                    h.entry(k).or_default().push(*m);
                }
            }
            let missing: Vec<&String> = self
                .gens
                .iter()
                .flat_map(|g| g.keys.iter().chain(g.tcp.iter().map(|x| &x.key)))
                .filter(|k| !h.contains_key(*k))
                .collect();
            if missing.is_empty() {
                break h;
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "trial {trial}: flows {missing:?} listed by no live replica of \
                 {members:?} (listings complete: {complete})"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        // FTMB: where each replica logs (the controller's view), for the failure messages.
        let ha = run.ha();
        let logger_of: BTreeMap<u32, String> = ha["replicas"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[])
            .iter()
            .filter_map(|r| {
                let h = r["ftmb_logger_host"].as_str()?;
                Some((r["index"].as_u64()? as u32, h.to_string()))
            })
            .collect();
        let mut rep = CutReport::default();
        for m in &members {
            rep.udp_per_member.insert(*m, 0);
        }
        for g in &mut self.gens {
            let hs: Vec<Vec<u32>> = g.keys.iter().map(|k| holders[k].clone()).collect();
            let on_victim: Vec<bool> = hs.iter().map(|h| h.contains(&victim)).collect();
            let victim_name = format!("r{victim}");
            let via_victim_logger: Vec<bool> = hs
                .iter()
                .zip(&on_victim)
                .map(|(h, on)| !on && h.iter().any(|m| logger_of.get(m) == Some(&victim_name)))
                .collect();
            for h in &hs {
                for m in h {
                    *rep.udp_per_member.entry(*m).or_default() += 1;
                }
            }
            rep.udp_on_victim += on_victim.iter().filter(|v| **v).count();
            for x in &mut g.tcp {
                let on = holders[&x.key].contains(&victim);
                x.through_victim |= on;
                rep.tcp_on_victim += usize::from(on);
            }
            rep.udp_flows += g.keys.len();
            let sent = (0..g.keys.len()).map(|i| g.udp.sent(i)).collect();
            let logs_to = hs
                .iter()
                .map(|h| {
                    let l: Vec<String> =
                        h.iter().filter_map(|m| logger_of.get(m).cloned()).collect();
                    (!l.is_empty()).then_some(l)
                })
                .collect();
            g.cuts.push(Cut {
                trial,
                sent,
                on_victim,
                via_victim_logger,
                holders: hs,
                logs_to,
            });
        }
        rep
    }

    /// Stops and judges every generation started before `trial + 1 - GEN_TRIALS` (all of them
    /// with `all`). Panics naming the flow, the trial and the stretch on any loss outside a
    /// victim's stretch, any reordered or duplicated datagram, any TCP reset, corruption or
    /// incomplete stream. `victims`: trial -> the replica killed in it (for the messages).
    pub fn retire(&mut self, trial: usize, all: bool, victims: &BTreeMap<usize, u32>) {
        let (old, keep): (Vec<Gen>, Vec<Gen>) = std::mem::take(&mut self.gens)
            .into_iter()
            .partition(|g| all || g.trial + GEN_TRIALS <= trial + 1);
        self.gens = keep;
        for mut g in old {
            self.judge(&mut g, victims);
        }
    }

    fn judge(&mut self, g: &mut Gen, victims: &BTreeMap<usize, u32>) {
        // Every TCP stream first (they are closed cleanly; the server reads to EOF).
        for x in g.tcp.drain(..) {
            let through_victim = x.through_victim;
            let sum = x.stream.stop(Duration::from_secs(20));
            let t = &mut self.totals;
            t.tcp_streams += 1;
            t.tcp_streams_through_a_victim += u64::from(through_victim);
            t.tcp_bytes += sum.bytes_received;
            t.tcp_resets += sum.resets_seen;
            t.tcp_corrupted += sum.corrupted_bytes;
            t.tcp_incomplete += u64::from(!sum.complete);
            assert!(
                sum.resets_seen == 0 && sum.corrupted_bytes == 0 && sum.complete,
                "generation of trial {}: TCP stream {CLIENT_IP}:{} -> {SERVER_IP}:{} (placed \
                 on r{}, through a victim: {through_victim}) broke: {sum:?}",
                g.trial,
                x.sport,
                x.dport,
                x.placed_on
            );
        }
        let errors = g.udp.halt(Duration::from_millis(300));
        assert!(
            errors.is_empty(),
            "generation of trial {}: UDP generator errors {errors:?}",
            g.trial
        );
        let n = g.keys.len();
        let mut failures = Vec::new();
        for i in 0..n {
            let sent = g.udp.sent(i);
            let tot = g.udp.totals(i..i + 1);
            let t = &mut self.totals;
            t.udp_flows += 1;
            t.udp_sent += tot.sent;
            t.udp_received += tot.received;
            t.udp_reordered += tot.reordered;
            t.udp_duplicated += tot.duplicated;
            // Stretch k: from cut k to cut k+1 (the first from seq 0, the last to the end).
            let bounds: Vec<u64> = std::iter::once(0)
                .chain(g.cuts.iter().skip(1).map(|c| c.sent[i]))
                .chain(std::iter::once(sent))
                .collect();
            let mut report = Vec::new();
            let mut lost_checked = 0;
            let mut lost_via_logger = 0;
            for (k, c) in g.cuts.iter().enumerate() {
                let (lo, hi) = (bounds[k], bounds[k + 1]);
                let lost = g.udp.lost_in(i, lo, hi);
                report.push(format!(
                    "trial {} (victim r{}): seqs {lo}..{hi} on {:?}{}, lost {lost}",
                    c.trial,
                    victims.get(&c.trial).copied().unwrap_or(0),
                    c.holders[i],
                    c.logs_to[i]
                        .as_ref()
                        .map(|h| format!(" (logging to {h:?})"))
                        .unwrap_or_default()
                ));
                let t = &mut self.totals;
                if c.on_victim[i] {
                    t.stretches_exempt += 1;
                    t.lost_exempt += lost;
                } else if c.via_victim_logger[i] {
                    t.stretches_via_victim_logger += 1;
                    t.lost_via_victim_logger += lost;
                    lost_via_logger += lost;
                } else {
                    t.stretches_checked += 1;
                    t.seqs_checked += hi - lo;
                    t.lost_checked += lost;
                    lost_checked += lost;
                }
            }
            let judged_loss = lost_via_logger
                + match self.totals.off_victim_loss {
                    OffVictimLoss::Judged => lost_checked,
                    OffVictimLoss::Measured => 0,
                };
            if judged_loss != 0 || tot.reordered != 0 || tot.duplicated != 0 {
                failures.push(format!(
                    "UDP flow {} (placed on r{}) lost {lost_checked} datagrams outside a \
                     victim's stretch ({lost_via_logger} while logging to the victim), \
                     reordered {}, duplicated {}: {tot:?}; stretches: {report:#?}",
                    g.keys[i], g.placed_on[i], tot.reordered, tot.duplicated
                ));
            }
        }
        assert!(
            failures.is_empty(),
            "generation of trial {}: {} of {n} UDP flows failed: {failures:#?}",
            g.trial,
            failures.len()
        );
        self.totals.generations += 1;
    }
}

/// One protection the controller sent, as its answer reports it.
#[derive(Debug, Clone)]
pub struct Sent {
    pub replica: String,
    pub named: Vec<String>,
    pub backups: Vec<String>,
    pub sent_unix_ms: u64,
    pub via: &'static str,
}

/// A replica the test killed: the controller detected it at `detected_unix_ms`; its index
/// may name a new replica from `reused_unix_ms` on (a scale-out can reuse a retired index).
#[derive(Debug, Clone)]
pub struct Death {
    pub replica: u32,
    pub kill_unix_ms: f64,
    pub detected_unix_ms: u64,
    pub reused_unix_ms: Option<u64>,
}

/// Every protection the controller sent that the test could see (see the module docs), and
/// the deaths the test caused.
#[derive(Default)]
pub struct Protections {
    seen: BTreeSet<(String, u64, Vec<String>)>,
    pub sent: Vec<Sent>,
    /// In kill order.
    pub deaths: Vec<Death>,
    events_seen: BTreeSet<String>,
    /// Reads of the event list (the newest 20) that shared no event with what was seen before:
    /// events may have been missed in between.
    pub event_gaps: usize,
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect()
}

impl Protections {
    /// One answer of `replica` (only protections that were sent carry `sent_unix_ms`).
    fn add(&mut self, replica: &str, ans: &Value, via: &'static str) {
        let Some(sent) = ans["sent_unix_ms"].as_u64() else {
            return;
        };
        let named = names(&ans["named"]);
        if self.seen.insert((replica.to_string(), sent, named.clone())) {
            self.sent.push(Sent {
                replica: replica.to_string(),
                named,
                backups: names(&ans["backups"]),
                sent_unix_ms: sent,
                via,
            });
        }
    }

    /// The failover record `rec` of `replica`, killed at `kill_unix_ms`: its death (detected
    /// when the record says) and the re-protections the failover sent.
    pub fn failover(&mut self, replica: u32, kill_unix_ms: f64, rec: &Value) {
        self.deaths.push(Death {
            replica,
            kill_unix_ms,
            detected_unix_ms: rec["detected_unix_ms"].as_u64().expect("detected_unix_ms"),
            reused_unix_ms: None,
        });
        self.add_answers(&rec["reprotected"], "failover");
    }

    /// `pliant scale out` on `run`, noting the protections it sent and an index it reuses (a
    /// retired replica's: naming it is fine from then on). Returns the answer.
    pub fn scale_out(&mut self, run: &HaRun) -> Value {
        let at = super::ha::unix_ms() as u64;
        let added = run.cli(&["scale", "out"]);
        if let Some(idx) = added["replica"].as_u64() {
            for d in self
                .deaths
                .iter_mut()
                .filter(|d| u64::from(d.replica) == idx)
            {
                d.reused_unix_ms.get_or_insert(at);
            }
        }
        self.add_answers(&added["protect"], "scale_out");
        added
    }

    /// Answers keyed by replica name (a failover record's `reprotected`, a scale-out's
    /// `protect`).
    pub fn add_answers(&mut self, answers: &Value, via: &'static str) {
        if let Some(m) = answers.as_object() {
            for (r, a) in m {
                self.add(r, a, via);
            }
        }
    }

    /// The controller's recent events (`status`): the poll's `reprotect` answers and the
    /// failover records' re-protections.
    pub fn add_events(&mut self, run: &HaRun) {
        let st = run.cli(&["status"]);
        let evs = st["events"].as_array().cloned().unwrap_or_default();
        let fresh: Vec<&Value> = evs
            .iter()
            .filter(|e| !self.events_seen.contains(&e.to_string()))
            .collect();
        if !self.events_seen.is_empty() && !evs.is_empty() && fresh.len() == evs.len() {
            self.event_gaps += 1;
        }
        for e in fresh {
            self.events_seen.insert(e.to_string());
            let d = &e["detail"];
            match e["event"].as_str() {
                Some("reprotect") => {
                    let r = format!("r{}", d["replica"]);
                    self.add(&r, &d["answer"], "poll");
                }
                Some("failover") => self.add_answers(&d["reprotected"], "failover"),
                _ => {}
            }
        }
    }

    /// Protections sent after a death was detected (until its index is reused) that name the
    /// dead replica, in the policy or among the backups the replica answered with: must be
    /// none.
    pub fn check(&self) -> ProtectionCheck {
        let deaths = &self.deaths;
        let mut c = ProtectionCheck {
            after_each_death_min: usize::MAX,
            ..Default::default()
        };
        for (k, d) in deaths.iter().enumerate() {
            let name = format!("r{}", d.replica);
            let until = d.reused_unix_ms.unwrap_or(u64::MAX);
            let next_kill = deaths.get(k + 1).map_or(f64::INFINITY, |n| n.kill_unix_ms);
            let mut right_after = 0;
            for s in &self.sent {
                let names_it = s.named.contains(&name) || s.backups.contains(&name);
                if s.sent_unix_ms >= d.detected_unix_ms && s.sent_unix_ms < until {
                    c.pairs_checked += 1;
                    right_after += usize::from((s.sent_unix_ms as f64) < next_kill);
                    if names_it {
                        c.violations.push(format!(
                            "{} protected ({}) at {} naming {:?} / backups {:?}: {name} was \
                             detected dead at {}",
                            s.replica,
                            s.via,
                            s.sent_unix_ms,
                            s.named,
                            s.backups,
                            d.detected_unix_ms
                        ));
                    }
                } else if (s.sent_unix_ms as f64) >= d.kill_unix_ms
                    && s.sent_unix_ms < d.detected_unix_ms
                    && names_it
                {
                    c.before_detection += 1;
                }
            }
            c.after_each_death_min = c.after_each_death_min.min(right_after);
        }
        if deaths.is_empty() {
            c.after_each_death_min = 0;
        }
        c
    }
}

/// What [`Protections::check`] found.
#[derive(Debug, Default)]
pub struct ProtectionCheck {
    /// (protection, death) pairs in which the protection was sent after the death's detection.
    pub pairs_checked: usize,
    /// The fewest protections any death was followed by before the next kill (each failover
    /// re-protects; a check that saw none would prove nothing).
    pub after_each_death_min: usize,
    /// Protections sent between a kill and its detection that name the victim (the controller
    /// could not know yet): reported, not a violation.
    pub before_detection: usize,
    pub violations: Vec<String>,
}

impl Protections {
    /// Prints what the controller did and asserts it never named a dead replica: its own
    /// `protects_naming_unlive` counter (from `counters`, the HA summary's) is 0, and
    /// independently no protection sent after a death's detection names it ([`Self::check`]);
    /// no event was missed between reads, and every death was followed, before the next kill,
    /// by at least `min_after_each_death` protections the check saw. `extra`: more for the
    /// printed line.
    pub fn assert_none_named_the_dead(
        &self,
        counters: &Value,
        min_after_each_death: usize,
        extra: &str,
    ) -> ProtectionCheck {
        let pc = self.check();
        eprintln!(
            "controller: {} protections seen ({} (protection, death) pairs checked, {} naming \
             the victim between its kill and its detection), event gaps {}; counters \
             protects_naming_unlive {} duplicate_activations {} protects_deferred {} \
             backups_suspected {} ftmb_protect_unchanged {} protects {}; {extra}",
            self.sent.len(),
            pc.pairs_checked,
            pc.before_detection,
            self.event_gaps,
            counters["protects_naming_unlive"],
            counters["duplicate_activations"],
            counters["protects_deferred"],
            counters["backups_suspected"],
            counters["ftmb_protect_unchanged"],
            counters["protects"],
        );
        assert_eq!(
            counters["protects_naming_unlive"], 0,
            "the controller counted protections naming a replica that was not live: {counters}"
        );
        assert!(
            pc.violations.is_empty(),
            "protections named a dead replica: {:#?}",
            pc.violations
        );
        assert_eq!(
            self.event_gaps, 0,
            "controller events were missed between reads: the protection check is incomplete"
        );
        assert!(
            pc.after_each_death_min >= min_after_each_death,
            "a death followed by fewer than {min_after_each_death} protections before the next \
             kill: {pc:?}"
        );
        pc
    }
}

/// Checkpoints refused on a replica: every standby primary's `refused` plus the replication
/// server's `refused` answers, from its `ha_status`.
pub fn refused_checkpoints(ha_status: &Value) -> u64 {
    let standby: u64 = ha_status["standby"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .map(|p| p["refused"].as_u64().unwrap_or(0))
        .sum();
    standby + ha_status["server"]["refused"].as_u64().unwrap_or(0)
}

/// Samples of every live replica's `ha_status` (`ha status` through the controller), taken
/// before and after every kill: each asserts that no replica refused a checkpoint so far, and
/// they sum the held output re-protections moved from a retiring group to its flow's new group
/// (`replication.held_moved`, counted up to each replica's last sample before it died).
#[derive(Default)]
pub struct ReplicaSamples {
    /// Replica statuses checked.
    pub statuses: usize,
    pub held_moved: u64,
    last_held_moved: BTreeMap<u64, u64>,
}

impl ReplicaSamples {
    pub fn sample(&mut self, run: &HaRun, when: &str) {
        let v = run.ha();
        for r in v["replicas"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            let st = &r["ha_status"];
            if st["ok"] != true {
                continue;
            }
            self.statuses += 1;
            assert!(
                st["standby"].is_array() && st["server"].is_object(),
                "{when}: r{}'s ha_status lacks standby/server: {st}",
                r["index"]
            );
            assert_eq!(
                refused_checkpoints(st),
                0,
                "{when}: r{} refused checkpoints: standby {} server {}",
                r["index"],
                st["standby"],
                st["server"]
            );
            let (Some(i), Some(h)) = (
                r["index"].as_u64(),
                st["replication"]["held_moved"].as_u64(),
            ) else {
                continue;
            };
            let last = self.last_held_moved.insert(i, h).unwrap_or(0);
            // A smaller count is a new replica under a reused index.
            self.held_moved += if h >= last { h - last } else { h };
        }
    }
}
