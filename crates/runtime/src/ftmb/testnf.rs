//! A tiny NAT on the FTMB contract, for the runtime's own tests (the real one is
//! `pliant_nf_nat::ftmb::FtmbNat`). Inside -> outside: source address and port rewritten to
//! `EXT_IP:port`, the port allocated from a SHARED counter (one PAL) in the worker's residue
//! class, the mapping's creation time read through the logged clock (a value PAL), and a
//! shared packet counter bumped per packet (a PAL per packet: the workers contend). Outside ->
//! inside: by destination port; a reply whose payload starts with [`FIN`] deletes the mapping.

use super::nf::{FlowDelta, FlowRecord, FtmbNf};
use crate::nf::{Packet, Side};
use pliant_ftmb::{Determinants, FtmbError, Master, QueueId, SharedVar, Worker};
use pliant_net::{proto, FlowKey};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

pub const EXT_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);
pub const PORT_BASE: u16 = 20_000;
/// The payload of a reply that ends its flow.
pub const FIN: &[u8] = b"fin";

/// proto, client ip, client port, server ip, server port.
type Key = [u8; 13];

pub struct TestNat;

pub struct Shared {
    workers: usize,
    next: Arc<SharedVar<u32>>,
    packets: Arc<SharedVar<u64>>,
}

#[derive(Default)]
pub struct Local {
    by_flow: HashMap<Key, (u16, u64)>,
    by_port: HashMap<u16, Key>,
    changed: HashSet<Key>,
    no_mapping: u64,
    not_v4: u64,
}

fn key_of(p: &Packet) -> Option<Key> {
    let (IpAddr::V4(s), IpAddr::V4(d)) = (p.meta.src, p.meta.dst) else {
        return None;
    };
    let mut k = [0u8; 13];
    k[0] = p.meta.proto;
    k[1..5].copy_from_slice(&s.octets());
    k[5..7].copy_from_slice(&p.meta.sport.to_be_bytes());
    k[7..11].copy_from_slice(&d.octets());
    k[11..13].copy_from_slice(&p.meta.dport.to_be_bytes());
    Some(k)
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(*x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn ip_at(k: &[u8], i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(k[i], k[i + 1], k[i + 2], k[i + 3]))
}

fn port_at(k: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([k[i], k[i + 1]])
}

fn record_of(port: u16, created: u64) -> Vec<u8> {
    let mut r = port.to_le_bytes().to_vec();
    r.extend_from_slice(&created.to_le_bytes());
    r
}

fn parse_record(r: &FlowRecord) -> Option<(Key, u16, u64)> {
    let k: Key = r.0.as_slice().try_into().ok()?;
    let port = u16::from_le_bytes(r.1.get(..2)?.try_into().ok()?);
    let created = u64::from_le_bytes(r.1.get(2..10)?.try_into().ok()?);
    Some((k, port, created))
}

impl TestNat {
    /// The worker queue of an external port among `n` workers.
    pub fn queue_of_port(port: u16, n: usize) -> usize {
        usize::from(port.wrapping_sub(PORT_BASE)) % n
    }
}

impl FtmbNf for TestNat {
    const NAME: &'static str = "testnat";
    type Shared = Shared;
    type Local = Local;

    fn declare(&self, master: &Master, image: Option<&[u8]>) -> Result<Shared, String> {
        let (next, packets) = match image {
            None => (0, 0),
            Some(b) if b.len() == 12 => (
                u32::from_le_bytes(b[..4].try_into().map_err(|_| "image")?),
                u64::from_le_bytes(b[4..].try_into().map_err(|_| "image")?),
            ),
            Some(b) => return Err(format!("image of {} bytes, want 12", b.len())),
        };
        Ok(Shared {
            workers: master.workers(),
            next: master.shared_var(1, next).map_err(|e| e.to_string())?,
            packets: master.shared_var(2, packets).map_err(|e| e.to_string())?,
        })
    }

    fn new_local(&self, _queue: QueueId, records: &[FlowRecord]) -> Result<Local, String> {
        let mut l = Local::default();
        self.import(&mut l, records.to_vec())?;
        l.changed.clear();
        Ok(l)
    }

    fn queue_of(&self, pkt: &Packet, workers: usize) -> usize {
        match pkt.ingress {
            Side::Inside => key_of(pkt).map_or(0, |k| (fnv(&k) % workers as u64) as usize),
            Side::Outside => Self::queue_of_port(pkt.meta.dport, workers),
        }
    }

    fn process(
        &self,
        sh: &Shared,
        local: &mut Local,
        w: &mut Worker,
        mut pkt: Packet,
        out: &mut Vec<Packet>,
    ) -> Result<(), FtmbError> {
        if pkt.meta.proto != proto::UDP && pkt.meta.proto != proto::TCP {
            return Ok(());
        }
        let Some(k) = key_of(&pkt) else {
            local.not_v4 += 1;
            return Ok(());
        };
        w.access(&sh.packets, |c| *c += 1)?;
        match pkt.ingress {
            Side::Inside => {
                let port = match local.by_flow.get(&k) {
                    Some(&(p, _)) => p,
                    None => {
                        let n = sh.workers as u32;
                        let q = u32::from(w.queue());
                        let i = w.access(&sh.next, |c| {
                            let i = *c;
                            *c += 1;
                            i
                        })?;
                        let port = PORT_BASE + (i * n + q) as u16;
                        let created = w.now()?;
                        local.by_flow.insert(k, (port, created));
                        local.by_port.insert(port, k);
                        local.changed.insert(k);
                        port
                    }
                };
                let _ = pliant_net::rewrite::set_src_ip(&mut pkt.buf, &mut pkt.meta, EXT_IP.into());
                let _ = pliant_net::rewrite::set_src_port(&mut pkt.buf, &mut pkt.meta, port);
                out.push(pkt);
            }
            Side::Outside => {
                let ext = pkt.meta.dport;
                let Some(orig) = local.by_port.get(&ext).copied() else {
                    local.no_mapping += 1;
                    return Ok(());
                };
                // A reply starting with "fin" ends its flow (how the tests end one).
                let ends = pkt
                    .buf
                    .get(usize::from(pkt.meta.payload_off)..)
                    .is_some_and(|p| p.starts_with(FIN));
                let (ip, port) = (ip_at(&orig, 1), port_at(&orig, 5));
                let _ = pliant_net::rewrite::set_dst_ip(&mut pkt.buf, &mut pkt.meta, ip);
                let _ = pliant_net::rewrite::set_dst_port(&mut pkt.buf, &mut pkt.meta, port);
                out.push(pkt);
                if ends {
                    local.by_flow.remove(&orig);
                    local.by_port.remove(&ext);
                    local.changed.insert(orig);
                }
            }
        }
        Ok(())
    }

    fn save_shared(&self, sh: &Shared) -> Result<Vec<u8>, String> {
        let next = sh.next.read_quiesced(|v| *v).map_err(|e| e.to_string())?;
        let packets = sh
            .packets
            .read_quiesced(|v| *v)
            .map_err(|e| e.to_string())?;
        let mut b = next.to_le_bytes().to_vec();
        b.extend_from_slice(&packets.to_le_bytes());
        Ok(b)
    }

    fn take_delta(&self, local: &mut Local, full: bool) -> Vec<FlowDelta> {
        let keys: Vec<Key> = if full {
            local.by_flow.keys().copied().collect()
        } else {
            local.changed.iter().copied().collect()
        };
        local.changed.clear();
        keys.into_iter()
            .map(|k| {
                let rec = local.by_flow.get(&k).map(|&(p, c)| record_of(p, c));
                (k.to_vec(), rec)
            })
            .collect()
    }

    fn steering_keys(&self, record: &FlowRecord) -> Option<(FlowKey, Vec<FlowKey>)> {
        let (k, port, _) = parse_record(record)?;
        let (key, _) = FlowKey::new(
            k[0],
            ip_at(&k, 1),
            port_at(&k, 5),
            ip_at(&k, 7),
            port_at(&k, 11),
        );
        let (alias, _) = FlowKey::new(k[0], EXT_IP.into(), port, ip_at(&k, 7), port_at(&k, 11));
        Some((key, vec![alias]))
    }

    fn record_queue(&self, record: &FlowRecord, workers: usize) -> Option<usize> {
        let (_, port, _) = parse_record(record)?;
        Some(Self::queue_of_port(port, workers))
    }

    fn import(&self, local: &mut Local, records: Vec<FlowRecord>) -> Result<usize, String> {
        let n = records.len();
        for r in &records {
            let (k, port, created) = parse_record(r).ok_or("malformed record")?;
            local.by_flow.insert(k, (port, created));
            local.by_port.insert(port, k);
            local.changed.insert(k);
        }
        Ok(n)
    }

    fn local_stats(&self, local: &Local) -> serde_json::Value {
        json!({"flows": local.by_flow.len(), "no_mapping": local.no_mapping, "not_v4": local.not_v4})
    }
}
