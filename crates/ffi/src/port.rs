//! One port type for both modes, so a context holds a single `Engine` type: AF_PACKET ports for
//! a real replica, in-memory ports for tests (`pliant_open_mem`).

use pliant_io::{FrameMeta, FramePort, MemPort, Offload, PacketPort, PortStats};
use std::os::fd::RawFd;

pub enum AnyPort {
    // Both boxed: the two differ a lot in size, and one pointer hop per batch is nothing.
    Mem(Box<MemPort>),
    Packet(Box<PacketPort>),
}

impl FramePort for AnyPort {
    fn recv_batch_meta(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&[u8], &FrameMeta),
    ) -> std::io::Result<usize> {
        match self {
            AnyPort::Mem(p) => p.recv_batch_meta(max, f),
            AnyPort::Packet(p) => p.recv_batch_meta(max, f),
        }
    }

    fn send_offload(&mut self, frame: &[u8], offload: &Offload) -> std::io::Result<()> {
        match self {
            AnyPort::Mem(p) => p.send_offload(frame, offload),
            AnyPort::Packet(p) => p.send_offload(frame, offload),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            AnyPort::Mem(p) => p.flush(),
            AnyPort::Packet(p) => p.flush(),
        }
    }

    fn tx_mark(&self) -> u64 {
        match self {
            AnyPort::Mem(p) => p.tx_mark(),
            AnyPort::Packet(p) => p.tx_mark(),
        }
    }

    fn tx_settled(&mut self, mark: u64) -> bool {
        match self {
            AnyPort::Mem(p) => p.tx_settled(mark),
            AnyPort::Packet(p) => p.tx_settled(mark),
        }
    }

    fn poll_fd(&self) -> Option<RawFd> {
        match self {
            AnyPort::Mem(p) => p.poll_fd(),
            AnyPort::Packet(p) => p.poll_fd(),
        }
    }

    fn stats(&self) -> PortStats {
        match self {
            AnyPort::Mem(p) => p.stats(),
            AnyPort::Packet(p) => p.stats(),
        }
    }

    fn mac(&self) -> [u8; 6] {
        match self {
            AnyPort::Mem(p) => p.mac(),
            AnyPort::Packet(p) => p.mac(),
        }
    }

    fn offloads_enabled(&self) -> bool {
        match self {
            AnyPort::Mem(p) => p.offloads_enabled(),
            AnyPort::Packet(p) => p.offloads_enabled(),
        }
    }
}
