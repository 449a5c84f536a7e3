//! In-memory [`FramePort`]: frames are injected into a bounded RX queue and transmitted frames are
//! collected from a bounded TX queue. Deterministic, no syscalls: for unit tests and simulation.

use std::collections::VecDeque;
use std::io;

use crate::{FrameMeta, FramePort, Offload, PortStats};

/// Bounds of a [`MemPort`] (mirroring the ring sizes of a real port).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemPortLimits {
    /// Frames waiting to be received; injecting beyond this counts a kernel drop.
    pub rx_queue_frames: usize,
    /// Frames queued for transmission (sent but not yet collected with [`MemPort::take_tx`]);
    /// sending beyond this returns WouldBlock.
    pub tx_queue_frames: usize,
    /// Largest frame accepted for transmission without GSO (MTU + Ethernet + VLAN header).
    pub max_frame_bytes: usize,
    /// Largest frame accepted with GSO metadata.
    pub max_gso_frame_bytes: usize,
}

impl Default for MemPortLimits {
    fn default() -> Self {
        Self {
            rx_queue_frames: 4096,
            tx_queue_frames: 4096,
            max_frame_bytes: 1518,
            max_gso_frame_bytes: 65_550,
        }
    }
}

/// A frame the port transmitted, with its offload metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxRecord {
    /// Frame bytes.
    pub frame: Vec<u8>,
    /// Offload metadata given to `send_offload` ([`Offload::NONE`] for `send`).
    pub offload: Offload,
}

/// In-memory frame port.
#[derive(Debug)]
pub struct MemPort {
    mac: [u8; 6],
    limits: MemPortLimits,
    offloads: bool,
    rx: VecDeque<(Vec<u8>, FrameMeta)>,
    /// Sent, not yet flushed.
    pending: VecDeque<TxRecord>,
    /// Flushed ("on the wire"), waiting for the test to collect them.
    wire: VecDeque<TxRecord>,
    /// With [`MemPort::set_hold_tx`]: flushed but not yet delivered (a frame still in a kernel
    /// queue on its way); [`MemPort::complete_tx`] delivers them, oldest first.
    in_flight: VecDeque<TxRecord>,
    hold_tx: bool,
    /// Frames delivered to `wire` since creation (the [`FramePort::tx_settled`] count).
    delivered: u64,
    stats: PortStats,
}

impl MemPort {
    /// A port with default limits and offloads disabled.
    pub fn new(mac: [u8; 6]) -> Self {
        Self::with_limits(mac, MemPortLimits::default())
    }

    /// A port with the given limits.
    pub fn with_limits(mac: [u8; 6], limits: MemPortLimits) -> Self {
        Self {
            mac,
            limits,
            offloads: false,
            rx: VecDeque::new(),
            pending: VecDeque::new(),
            wire: VecDeque::new(),
            in_flight: VecDeque::new(),
            hold_tx: false,
            delivered: 0,
            stats: PortStats::default(),
        }
    }

    /// Makes the port report/accept offload metadata like a `vnet_hdr` PacketPort.
    pub fn set_offloads(&mut self, on: bool) {
        self.offloads = on;
    }

    /// Queues a frame for reception. Returns false (and counts a kernel drop) when the RX queue
    /// is full, like a full ring.
    pub fn inject(&mut self, frame: &[u8]) -> bool {
        let meta = FrameMeta {
            wire_len: u32::try_from(frame.len()).unwrap_or(u32::MAX),
            ..FrameMeta::default()
        };
        self.inject_meta(frame, meta)
    }

    /// Queues a frame with explicit metadata.
    pub fn inject_meta(&mut self, frame: &[u8], meta: FrameMeta) -> bool {
        if self.rx.len() >= self.limits.rx_queue_frames {
            self.stats.rx_kernel_drops += 1;
            return false;
        }
        self.rx.push_back((frame.to_vec(), meta));
        true
    }

    /// Frames waiting to be received.
    pub fn rx_pending(&self) -> usize {
        self.rx.len()
    }

    /// Frames sent but not yet flushed.
    pub fn tx_unflushed(&self) -> usize {
        self.pending.len()
    }

    /// While on, flushed frames stay in flight (not collectable, not settled) until
    /// [`MemPort::complete_tx`]: models a frame waiting in a kernel queue after the kick.
    /// Turning it off delivers everything in flight.
    pub fn set_hold_tx(&mut self, on: bool) {
        self.hold_tx = on;
        if !on {
            self.complete_tx(usize::MAX);
        }
    }

    /// Delivers up to `n` in-flight frames, oldest first; returns how many.
    pub fn complete_tx(&mut self, n: usize) -> usize {
        let k = n.min(self.in_flight.len());
        self.wire.extend(self.in_flight.drain(..k));
        self.delivered += k as u64;
        k
    }

    /// Frames flushed but not delivered (see [`MemPort::set_hold_tx`]).
    pub fn tx_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Removes and returns every flushed frame, oldest first.
    pub fn take_tx(&mut self) -> Vec<TxRecord> {
        self.wire.drain(..).collect()
    }

    fn tx_error(&mut self, why: &str) -> io::Error {
        self.stats.tx_errors += 1;
        io::Error::new(io::ErrorKind::InvalidInput, why.to_string())
    }
}

impl FramePort for MemPort {
    fn recv_batch_meta(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&[u8], &FrameMeta),
    ) -> io::Result<usize> {
        let mut n = 0;
        while n < max {
            let Some((frame, meta)) = self.rx.pop_front() else {
                break;
            };
            let meta = if self.offloads {
                meta
            } else {
                // Without offloads a real port cannot see the virtio header.
                FrameMeta {
                    offload: Offload::NONE,
                    ..meta
                }
            };
            self.stats.rx_frames += 1;
            self.stats.rx_bytes += frame.len() as u64;
            if meta.truncated {
                self.stats.rx_truncated += 1;
            }
            if meta.offload.gso.is_some() {
                self.stats.rx_gso_frames += 1;
            }
            if meta.csum_not_ready || meta.offload.csum_partial.is_some() {
                self.stats.rx_csum_partial += 1;
            }
            if frame.len() > self.limits.max_frame_bytes {
                self.stats.rx_oversize += 1;
            }
            f(&frame, &meta);
            n += 1;
        }
        Ok(n)
    }

    fn send_offload(&mut self, frame: &[u8], offload: &Offload) -> io::Result<()> {
        if !offload.is_none() && !self.offloads {
            self.stats.tx_errors += 1;
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "offload metadata given but offloads are disabled on this port",
            ));
        }
        if frame.is_empty() {
            return Err(self.tx_error("empty frame"));
        }
        let limit = if offload.gso.is_some() {
            self.limits.max_gso_frame_bytes
        } else {
            self.limits.max_frame_bytes
        };
        if frame.len() > limit {
            return Err(self.tx_error("frame larger than the port's limit"));
        }
        if offload.validate(frame.len()).is_err() {
            return Err(self.tx_error("offload metadata does not fit the frame"));
        }
        if self.pending.len() + self.wire.len() + self.in_flight.len()
            >= self.limits.tx_queue_frames
        {
            self.stats.tx_dropped_full += 1;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.stats.tx_frames += 1;
        self.stats.tx_bytes += frame.len() as u64;
        if offload.gso.is_some() {
            self.stats.tx_gso_frames += 1;
        }
        self.pending.push_back(TxRecord {
            frame: frame.to_vec(),
            offload: *offload,
        });
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.pending.is_empty() {
            self.stats.tx_kicks += 1;
            if self.hold_tx {
                self.in_flight.extend(self.pending.drain(..));
            } else {
                self.delivered += self.pending.len() as u64;
                self.wire.extend(self.pending.drain(..));
            }
        }
        Ok(())
    }

    fn tx_mark(&self) -> u64 {
        self.stats.tx_frames
    }

    fn tx_settled(&mut self, mark: u64) -> bool {
        self.delivered >= mark
    }

    fn poll_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }

    fn stats(&self) -> PortStats {
        self.stats
    }

    fn mac(&self) -> [u8; 6] {
        self.mac
    }

    fn offloads_enabled(&self) -> bool {
        self.offloads
    }

    /// `max_frame_bytes` less the Ethernet and VLAN headers (1500 by default).
    fn mtu(&self) -> usize {
        self.limits.max_frame_bytes.saturating_sub(18)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CsumPartial, Gso, GsoKind};

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

    fn small_limits() -> MemPortLimits {
        MemPortLimits {
            rx_queue_frames: 3,
            tx_queue_frames: 2,
            max_frame_bytes: 100,
            max_gso_frame_bytes: 1000,
        }
    }

    #[test]
    fn recv_batch_respects_max_and_order() {
        let mut p = MemPort::new(MAC);
        for i in 0..5u8 {
            assert!(p.inject(&[i; 60]));
        }
        let mut seen = Vec::new();
        let n = p.recv_batch(3, &mut |f| seen.push(f[0])).unwrap();
        assert_eq!(n, 3);
        assert_eq!(seen, vec![0, 1, 2]);
        let n = p.recv_batch(10, &mut |f| seen.push(f[0])).unwrap();
        assert_eq!(n, 2);
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.recv_batch(10, &mut |_| panic!("empty")).unwrap(), 0);
        let s = p.stats();
        assert_eq!((s.rx_frames, s.rx_bytes), (5, 300));
        assert_eq!(p.mac(), MAC);
        assert_eq!(p.poll_fd(), None);
    }

    #[test]
    fn rx_queue_is_bounded_and_overflow_counted() {
        let mut p = MemPort::with_limits(MAC, small_limits());
        assert!(p.inject(&[1]));
        assert!(p.inject(&[2]));
        assert!(p.inject(&[3]));
        assert!(!p.inject(&[4]));
        assert_eq!(p.rx_pending(), 3);
        assert_eq!(p.stats().rx_kernel_drops, 1);
    }

    #[test]
    fn tx_is_visible_only_after_flush_and_bounded() {
        let mut p = MemPort::with_limits(MAC, small_limits());
        p.send(&[1; 60]).unwrap();
        assert!(p.take_tx().is_empty());
        assert_eq!(p.tx_unflushed(), 1);
        p.send(&[2; 60]).unwrap();
        let e = p.send(&[3; 60]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        p.flush().unwrap();
        let out = p.take_tx();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].frame, vec![1; 60]);
        assert_eq!(out[1].frame, vec![2; 60]);
        let s = p.stats();
        assert_eq!((s.tx_frames, s.tx_bytes, s.tx_dropped_full), (2, 120, 1));
        // Space is back once collected.
        p.send(&[4; 60]).unwrap();
    }

    #[test]
    fn held_tx_settles_only_when_delivered() {
        let mut p = MemPort::new(MAC);
        p.send(&[1; 60]).unwrap();
        p.flush().unwrap();
        let m1 = p.tx_mark();
        assert!(p.tx_settled(m1), "delivered at flush by default");
        p.set_hold_tx(true);
        p.send(&[2; 60]).unwrap();
        p.send(&[3; 60]).unwrap();
        let m3 = p.tx_mark();
        assert!(!p.tx_settled(m3), "not even flushed");
        p.flush().unwrap();
        assert!(!p.tx_settled(m3), "flushed but in flight");
        assert!(p.tx_settled(m1), "older frames stay settled");
        assert_eq!(p.take_tx().len(), 1);
        assert_eq!(p.complete_tx(1), 1);
        assert!(!p.tx_settled(m3));
        assert_eq!(p.take_tx()[0].frame, vec![2; 60]);
        p.set_hold_tx(false);
        assert!(p.tx_settled(m3));
        assert_eq!(p.take_tx()[0].frame, vec![3; 60]);
        assert_eq!(p.tx_in_flight(), 0);
    }

    #[test]
    fn oversize_and_empty_frames_are_refused_and_counted() {
        let mut p = MemPort::with_limits(MAC, small_limits());
        assert_eq!(
            p.send(&[0; 101]).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(p.send(&[]).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(p.stats().tx_errors, 2);
        assert_eq!(p.stats().tx_frames, 0);
    }

    #[test]
    fn offloads_need_opt_in_and_are_recorded() {
        let mut p = MemPort::with_limits(MAC, small_limits());
        let gso = Offload {
            csum_partial: Some(CsumPartial {
                start: 34,
                offset: 16,
            }),
            csum_valid: false,
            gso: Some(Gso {
                kind: GsoKind::TcpV4,
                segment_size: 100,
                header_len: 54,
                ecn: false,
            }),
        };
        assert_eq!(
            p.send_offload(&[0; 500], &gso).unwrap_err().kind(),
            io::ErrorKind::Unsupported
        );
        p.set_offloads(true);
        assert!(p.offloads_enabled());
        p.send_offload(&[0; 500], &gso).unwrap();
        // A checksum field outside the frame is refused.
        assert!(p.send_offload(&[0; 40], &gso).is_err());
        p.flush().unwrap();
        let out = p.take_tx();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].offload, gso);
        assert_eq!(p.stats().tx_gso_frames, 1);
    }

    #[test]
    fn rx_meta_is_delivered_only_with_offloads() {
        let mut p = MemPort::new(MAC);
        let meta = FrameMeta {
            wire_len: 3000,
            offload: Offload {
                gso: Some(Gso {
                    kind: GsoKind::TcpV6,
                    segment_size: 1440,
                    header_len: 74,
                    ecn: false,
                }),
                ..Offload::NONE
            },
            csum_not_ready: true,
            ..FrameMeta::default()
        };
        p.inject_meta(&[0; 3000], meta);
        p.inject_meta(&[0; 3000], meta);
        let mut got = Vec::new();
        p.recv_batch_meta(1, &mut |_, m| got.push(*m)).unwrap();
        assert_eq!(got[0].offload, Offload::NONE);
        assert!(got[0].csum_not_ready);
        p.set_offloads(true);
        p.recv_batch_meta(1, &mut |_, m| got.push(*m)).unwrap();
        assert_eq!(got[1], meta);
        let s = p.stats();
        assert_eq!(
            (s.rx_gso_frames, s.rx_csum_partial, s.rx_oversize),
            (1, 2, 2)
        );
    }
}
