//! pliant-io: fast frame I/O on Linux interfaces for the replica runtime.
//!
//! One job: move Ethernet frames between an interface and the runtime's single polling thread in
//! batches, without blocking and without unbounded queues.
//!
//! - [`FramePort`] is the interface the runtime polls (one per port, "inside" and "outside").
//! - [`PacketPort`] implements it with AF_PACKET: a TPACKET_V3 RX ring (or a TPACKET_V2 RX ring
//!   when latency matters more than throughput), a TPACKET_V2 TX ring with qdisc bypass, and
//!   optional `virtio_net_hdr` offload metadata so GSO super-frames pass through as one unit.
//! - [`MemPort`] implements it in memory (inject RX frames, collect TX frames) for unit tests and
//!   deterministic harnesses.
//! - [`testlab`] builds throw-away network namespaces with a veth pair (tests and the pps example).
//!
//! See README.md for what was measured on this kernel (GSO, checksums, packets per second).

use std::fmt;

mod mem;
#[cfg(target_os = "linux")]
mod packet;
#[cfg(target_os = "linux")]
pub mod testlab;
pub mod vnet;

pub use mem::{MemPort, MemPortLimits, TxRecord};
#[cfg(target_os = "linux")]
pub use packet::{PacketPort, PortOptions, RxRing, TxMode};
pub use vnet::{CsumPartial, Gso, GsoKind, Offload};

/// Per-frame metadata delivered by [`FramePort::recv_batch_meta`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameMeta {
    /// Length of the frame as it was on the wire (may exceed the delivered slice when truncated).
    pub wire_len: u32,
    /// True when the kernel delivered fewer bytes than `wire_len` (ring slot or block too small).
    /// Such frames are counted in [`PortStats::rx_truncated`]; forwarding them would corrupt data.
    pub truncated: bool,
    /// Checksum and segmentation state from the frame's `virtio_net_hdr` (all empty unless the port
    /// was opened with `PortOptions::vnet_hdr`).
    pub offload: Offload,
    /// TP_STATUS_CSUMNOTREADY: the L4 checksum field holds only the pseudo-header sum
    /// (CHECKSUM_PARTIAL, typical for locally generated traffic crossing a veth). Without vnet_hdr
    /// the caller must compute the full checksum before sending the frame on, or the receiver
    /// drops it.
    pub csum_not_ready: bool,
    /// TP_STATUS_CSUM_VALID: the kernel already verified the checksum.
    pub csum_valid: bool,
    /// True when the kernel stripped an 802.1Q/802.1ad tag (VLAN offload) and this port put it back
    /// into the frame, so the caller always sees the frame as it was on the wire.
    pub vlan_reinserted: bool,
    /// When the frame entered the receive ring, in `CLOCK_REALTIME` nanoseconds, as the kernel
    /// stamped it there; 0 when unknown (a port without a ring, or a stamp the kernel copied
    /// from the packet instead of taking it at the ring). Lets a reader tell that every frame
    /// queued before some instant has been read without waiting for the ring to run empty.
    pub rx_ns: u64,
}

/// Counters of one port. All are totals since the port was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortStats {
    /// Frames handed to the caller.
    pub rx_frames: u64,
    /// Bytes handed to the caller.
    pub rx_bytes: u64,
    /// Frames the kernel dropped because the RX ring was full (PACKET_STATISTICS tp_drops).
    pub rx_kernel_drops: u64,
    /// Times the kernel froze the V3 ring because every block was owned by user space.
    pub rx_ring_freezes: u64,
    /// Frames delivered shorter than on the wire (slot/block too small for the frame).
    pub rx_truncated: u64,
    /// Frames larger than the MTU-sized limit (GSO super-frames or jumbo frames) received.
    pub rx_oversize: u64,
    /// Frames with a valid GSO descriptor (only with vnet_hdr).
    pub rx_gso_frames: u64,
    /// Frames whose L4 checksum is partial (CHECKSUM_PARTIAL: pseudo-header sum only).
    pub rx_csum_partial: u64,
    /// Frames received with malformed ring metadata (offsets outside the ring); skipped.
    pub rx_bad_descriptors: u64,
    /// Frames accepted into the TX queue and passed to the kernel.
    pub tx_frames: u64,
    /// Bytes accepted for transmission.
    pub tx_bytes: u64,
    /// Frames refused with WouldBlock because the TX ring was full.
    pub tx_dropped_full: u64,
    /// Frames refused because they were too large or malformed (e.g. > MTU without GSO), or the
    /// kernel reported an error for them.
    pub tx_errors: u64,
    /// Frames bigger than one TX ring slot that were sent with a direct `sendmsg` instead.
    pub tx_direct: u64,
    /// Frames with a GSO descriptor sent (only with vnet_hdr).
    pub tx_gso_frames: u64,
    /// Kernel kicks (`send(fd, NULL, 0)`) issued by flush.
    pub tx_kicks: u64,
    /// Kicks that returned ENOBUFS/EAGAIN (the device refused a frame; it stays queued and is
    /// retried at the next flush).
    pub tx_kick_retries: u64,
}

/// A source and sink of Ethernet frames polled by one thread.
pub trait FramePort {
    /// Receives up to `max` frames, calling `f(frame)` for each (frame valid only during the call;
    /// the caller copies it). Non-blocking. Returns frames visited.
    fn recv_batch(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> std::io::Result<usize> {
        self.recv_batch_meta(max, &mut |frame, _meta| f(frame))
    }

    /// Like [`FramePort::recv_batch`], with per-frame metadata (length on the wire, checksum and
    /// GSO state).
    fn recv_batch_meta(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&[u8], &FrameMeta),
    ) -> std::io::Result<usize>;

    /// Queues one frame for transmission (copied). Err(WouldBlock) when the TX queue is full (the
    /// caller counts it as a drop) — never blocks.
    fn send(&mut self, frame: &[u8]) -> std::io::Result<()> {
        self.send_offload(frame, &Offload::NONE)
    }

    /// Queues one frame with offload metadata (checksum still to be completed, GSO segmentation
    /// by the kernel/peer). Ports that cannot carry offloads return `Unsupported` for anything but
    /// [`Offload::NONE`].
    fn send_offload(&mut self, frame: &[u8], offload: &Offload) -> std::io::Result<()>;

    /// Pushes queued frames to the kernel.
    fn flush(&mut self) -> std::io::Result<()>;

    /// A mark covering every frame queued so far, for [`FramePort::tx_settled`].
    fn tx_mark(&self) -> u64 {
        0
    }

    /// True once every frame queued before `mark` has left the kernel's queues: delivered to
    /// the receiving host's stack or socket (the kernel drops the sender's claim on a frame
    /// there) or dropped. "Flushed" is not enough: a flushed frame can still sit in a per-CPU
    /// backlog (veth) or a qdisc on the path while a frame sent later by another host passes it.
    /// Ports that cannot tell report true.
    fn tx_settled(&mut self, _mark: u64) -> bool {
        true
    }

    /// File descriptor to poll for readability (None for in-memory ports).
    fn poll_fd(&self) -> Option<std::os::fd::RawFd>;

    /// Counters since open.
    fn stats(&self) -> PortStats;

    /// The interface's MAC address.
    fn mac(&self) -> [u8; 6];

    /// The interface's MTU (largest IP packet it sends in one frame).
    fn mtu(&self) -> usize {
        1500
    }

    /// True when this port reports and accepts offload metadata (virtio_net_hdr). When false, the
    /// caller must finish checksums itself before sending and must not send frames above the MTU.
    fn offloads_enabled(&self) -> bool {
        false
    }
}

/// What went wrong opening or driving a port: the interface, the operation and the OS error.
#[derive(Debug, thiserror::Error)]
pub struct IoError {
    /// Interface name the port is (or was to be) attached to.
    pub ifname: String,
    /// The syscall or step that failed, e.g. "setsockopt(PACKET_RX_RING)".
    pub op: &'static str,
    /// Underlying error.
    #[source]
    pub source: std::io::Error,
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} failed: {}", self.ifname, self.op, self.source)
    }
}

impl IoError {
    pub(crate) fn new(ifname: &str, op: &'static str, source: std::io::Error) -> Self {
        Self {
            ifname: ifname.to_string(),
            op,
            source,
        }
    }

    pub(crate) fn last_os(ifname: &str, op: &'static str) -> Self {
        Self::new(ifname, op, std::io::Error::last_os_error())
    }

    pub(crate) fn invalid(ifname: &str, op: &'static str, why: &str) -> Self {
        Self::new(
            ifname,
            op,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string()),
        )
    }
}

impl From<IoError> for std::io::Error {
    fn from(e: IoError) -> Self {
        std::io::Error::new(e.source.kind(), e.to_string())
    }
}
