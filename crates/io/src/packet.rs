//! AF_PACKET implementation of [`FramePort`].
//!
//! Two sockets per port, both bound to one interface:
//! - the **RX socket** owns a memory-mapped RX ring (TPACKET_V3 blocks or TPACKET_V2 slots),
//!   ignores outgoing frames (so the port never sees its own transmissions) and puts the interface
//!   in promiscuous mode (replicas share MACs, the fabric delivers frames for other MACs). Having
//!   no TX ring, it also serves as the `sendmsg` path for frames too big for a TX slot (GSO
//!   super-frames).
//! - the **TX socket** owns a TPACKET_V2 TX ring with qdisc bypass; `send` fills slots and `flush`
//!   issues one `send(fd, NULL, 0, MSG_DONTWAIT)` kick that makes the kernel transmit every filled
//!   slot. It is bound with protocol 0 so it receives nothing.
//!
//! Every ring is fixed-size; a full TX ring is reported as WouldBlock and counted, a full RX ring is
//! counted by the kernel (PACKET_STATISTICS) and surfaced in [`PortStats::rx_kernel_drops`].

use std::cell::Cell;
use std::ffi::CString;
use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::vnet::VNET_HDR_LEN;
use crate::{FrameMeta, FramePort, IoError, Offload, PortStats};

const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
/// Largest GSO super-frame accepted for transmission: an IPv4/IPv6 packet of 64 KiB plus L2
/// headers.
const MAX_GSO_FRAME: usize = 65_535 + ETH_HLEN + VLAN_HLEN;
/// Data offset inside a TPACKET_V2 TX slot: TPACKET_ALIGN(sizeof(struct tpacket2_hdr)).
const TX_DATA_OFFSET: usize = 32;
const V3_BLOCK_HDR_MIN: usize = size_of::<libc::tpacket_block_desc>();
const EINTR_RETRIES: usize = 8;

/// RX ring layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RxRing {
    /// TPACKET_V3: frames packed back to back in blocks; a block goes to user space when it is full
    /// or `block_timeout_ms` after its first frame. Best throughput (fewer wake-ups, no per-slot
    /// waste, 64 KiB GSO frames fit), but a lightly loaded port adds up to the timeout (rounded up
    /// to the kernel's timer tick) of latency.
    V3 {
        /// Bytes per block: a multiple of the page size. Must exceed the largest frame
        /// (64 KiB GSO frames need > 64 KiB).
        block_bytes: u32,
        /// Number of blocks.
        block_count: u32,
        /// Retire a partly filled block after this many milliseconds (>= 1).
        block_timeout_ms: u32,
    },
    /// TPACKET_V2: fixed slots, each frame visible to user space immediately. Lowest latency;
    /// frames longer than a slot are truncated (counted), so GSO needs 64 KiB slots.
    V2 {
        /// Bytes per slot (a multiple of 16; header + frame must fit).
        frame_bytes: u32,
        /// Number of slots.
        frame_count: u32,
    },
}

/// How frames are handed to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TxMode {
    /// TPACKET_V2 TX ring on a second socket; `flush` is one `send(fd, NULL, 0)` kick. The kernel
    /// attaches ring pages to the skb (no copy beyond the headers).
    Ring,
    /// Frames are copied into a bounded user-space queue and `flush` hands them over with
    /// `sendmmsg` on the RX socket (one copy into the skb).
    Sendmmsg,
}

/// Options of a [`PacketPort`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortOptions {
    /// RX ring layout and size.
    pub rx: RxRing,
    /// Bytes per TX slot (a multiple of 16, at least 32 + 10 + frame). Frames that do not fit are
    /// sent with a direct `sendmsg` (after the ring is kicked, so order is kept).
    pub tx_frame_bytes: u32,
    /// Number of TX slots: the most frames that can be queued before `send` returns WouldBlock.
    pub tx_frame_count: u32,
    /// TX mechanism (see README for the measured comparison).
    pub tx_mode: TxMode,
    /// Exchange a `virtio_net_hdr` with the kernel for every frame (PACKET_VNET_HDR): GSO
    /// super-frames and partial checksums pass through as one unit (see README).
    pub vnet_hdr: bool,
    /// Put the interface in promiscuous mode for the lifetime of the port.
    pub promiscuous: bool,
    /// Transmit straight to the driver (PACKET_QDISC_BYPASS): faster, but skips the qdisc (and tc
    /// egress hooks) of the interface.
    pub qdisc_bypass: bool,
    /// Put back VLAN tags the kernel stripped (VLAN offload) so frames are seen as on the wire.
    pub reinsert_vlan: bool,
}

impl Default for PortOptions {
    fn default() -> Self {
        Self {
            // Blocks are usually retired by the timeout long before they fill (a 4 ms tick at
            // HZ=250), so many medium blocks absorb a stalled reader better than a few big ones;
            // 256 KiB still holds three 64 KiB GSO frames.
            rx: RxRing::V3 {
                block_bytes: 256 << 10,
                block_count: 64,
                block_timeout_ms: 1,
            },
            tx_frame_bytes: 2048,
            tx_frame_count: 4096,
            tx_mode: TxMode::Ring,
            vnet_hdr: false,
            promiscuous: true,
            qdisc_bypass: true,
            reinsert_vlan: true,
        }
    }
}

/// A memory-mapped region, unmapped on drop.
struct Mmap {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mmap {
    fn map(fd: RawFd, len: usize) -> io::Result<Mmap> {
        // SAFETY: a fresh shared mapping of the socket's ring; the kernel validates len.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mmap { ptr, len })
    }

    /// Anonymous zeroed mapping (unit tests build fake rings in it).
    #[cfg(test)]
    fn anon(len: usize) -> io::Result<Mmap> {
        // SAFETY: fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mmap { ptr, len })
    }

    fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from a successful mmap and nothing references the ring any more.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The ring's receive stamp of a frame in `CLOCK_REALTIME` nanoseconds, or 0. Without
/// `PACKET_TIMESTAMP` the kernel takes the stamp as it writes the frame into the ring and sets
/// neither `TP_STATUS_TS_*` bit; with one of them set the stamp was copied from the packet
/// (taken earlier, possibly on another clock) and says nothing about the ring's order.
fn ring_stamp_ns(status: u32, sec: u32, nsec: u32) -> u64 {
    const TS_BITS: u32 = libc::TP_STATUS_TS_SOFTWARE | libc::TP_STATUS_TS_RAW_HARDWARE;
    if status & TS_BITS != 0 {
        return 0;
    }
    u64::from(sec) * 1_000_000_000 + u64::from(nsec)
}

/// Status word of a ring slot/block, shared with the kernel.
///
/// # Safety
/// `p` must be 4-byte aligned and inside a live ring mapping.
unsafe fn status_word<'a>(p: *mut u8) -> &'a AtomicU32 {
    &*(p.cast::<AtomicU32>())
}

enum RxState {
    V3 {
        block_bytes: usize,
        block_count: usize,
        /// Block being consumed.
        block: usize,
        /// Frames of the current block already delivered.
        done_in_block: u32,
        /// Offset of the next frame header inside the current block (0 = not started).
        next_off: usize,
    },
    V2 {
        frame_bytes: usize,
        frames_per_block: usize,
        block_bytes: usize,
        frame_count: usize,
        slot: usize,
    },
}

/// AF_PACKET port bound to one interface. See the module documentation.
pub struct PacketPort {
    ifname: String,
    mac: [u8; 6],
    mtu: usize,
    opts: PortOptions,
    // Field order matters for Drop: rings are unmapped before their sockets close.
    rx_ring: Mmap,
    tx_ring: Option<Mmap>,
    rx_fd: OwnedFd,
    tx_fd: Option<OwnedFd>,
    mmsg: Option<MmsgQueue>,
    rx: RxState,
    tx_slot: usize,
    tx_slots: usize,
    tx_frames_per_block: usize,
    tx_block_bytes: usize,
    /// Slots filled since the last successful kick.
    tx_unkicked: usize,
    /// Ring slots filled since open (slot = seq % tx_slots): the mark of `tx_settled`.
    tx_seq: u64,
    /// Every ring frame with a lower seq is known to be released by the kernel.
    tx_settled_seq: u64,
    /// A frame went out with sendmsg/sendmmsg on the RX socket (its skbs are charged there).
    sendmsg_used: bool,
    /// Scratch buffer for frames whose VLAN tag is re-inserted (bounded by the largest frame).
    scratch: Vec<u8>,
    stats: PortStats,
    // PACKET_STATISTICS is read-and-reset in the kernel, so totals accumulate here from `&self`.
    kernel_drops: Cell<u64>,
    kernel_freezes: Cell<u64>,
}

impl std::fmt::Debug for PacketPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketPort")
            .field("ifname", &self.ifname)
            .field("mac", &self.mac)
            .field("mtu", &self.mtu)
            .field("opts", &self.opts)
            .field("tx_unkicked", &self.tx_unkicked)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

// SAFETY: the raw ring pointers are owned exclusively by this port; moving the port to another
// thread moves that ownership. It is not Sync (Cell), so no concurrent access.
unsafe impl Send for PacketPort {}

fn setsockopt<T>(fd: RawFd, level: i32, name: i32, val: &T) -> io::Result<()> {
    // SAFETY: val points to a live T of the given size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (val as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn packet_socket(ifname: &str) -> Result<OwnedFd, IoError> {
    // Protocol 0: no frames are queued before the rings exist; bind() picks the protocol later.
    // SAFETY: plain syscall.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(IoError::last_os(ifname, "socket(AF_PACKET, SOCK_RAW)"));
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn bind(fd: RawFd, ifindex: i32, protocol: u16) -> io::Result<()> {
    // SAFETY: zeroed sockaddr_ll is valid; fields set below.
    let mut sll: libc::sockaddr_ll = unsafe { zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol.to_be();
    sll.sll_ifindex = ifindex;
    // SAFETY: sll is a valid sockaddr_ll.
    let r = unsafe {
        libc::bind(
            fd,
            (&sll as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn ifreq_for(ifname: &str) -> libc::ifreq {
    // SAFETY: zeroed ifreq is valid.
    let mut ifr: libc::ifreq = unsafe { zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(ifname.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr
}

fn is_page_multiple(v: u32) -> bool {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u32;
    v >= page && v % page == 0
}

impl PortOptions {
    /// The default: TPACKET_V3 RX ring (16 MiB), best for throughput; a lightly loaded port adds up
    /// to one kernel tick (4 ms at HZ=250) of latency per hop.
    pub fn throughput() -> Self {
        Self::default()
    }

    /// TPACKET_V2 RX ring with 64 KiB + 256 B slots (512 slots, 32 MiB): every frame is visible at
    /// once (no block timeout) and GSO super-frames still fit a slot.
    pub fn low_latency() -> Self {
        Self {
            rx: RxRing::V2 {
                frame_bytes: 65_536 + 256,
                frame_count: 512,
            },
            ..Self::default()
        }
    }
}

impl PacketPort {
    /// Opens a port on `ifname` (in the caller's network namespace).
    pub fn open(ifname: &str, opts: &PortOptions) -> Result<PacketPort, IoError> {
        if ifname.is_empty() || ifname.len() >= libc::IFNAMSIZ || ifname.contains('\0') {
            return Err(IoError::invalid(
                ifname,
                "validate interface name",
                "must be 1..15 bytes without NUL",
            ));
        }
        Self::check_options(ifname, opts)?;
        let cname = CString::new(ifname)
            .map_err(|_| IoError::invalid(ifname, "validate interface name", "contains NUL"))?;
        // SAFETY: cname is a valid C string.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            return Err(IoError::last_os(ifname, "if_nametoindex"));
        }
        let ifindex = i32::try_from(ifindex)
            .map_err(|_| IoError::invalid(ifname, "if_nametoindex", "index out of range"))?;

        let rx_fd = packet_socket(ifname)?;
        let rfd = rx_fd.as_raw_fd();
        let (mac, mtu) = Self::query_link(ifname, rfd)?;

        // --- RX socket -------------------------------------------------------------------------
        let version = match opts.rx {
            RxRing::V3 { .. } => libc::tpacket_versions::TPACKET_V3 as i32,
            RxRing::V2 { .. } => libc::tpacket_versions::TPACKET_V2 as i32,
        };
        setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_VERSION, &version)
            .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_VERSION)", e))?;
        if opts.vnet_hdr {
            // Must precede the ring: the kernel refuses it (EBUSY) once a ring exists.
            setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_VNET_HDR, &1i32)
                .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_VNET_HDR) rx", e))?;
        }
        let (rx_len, rx_state) = match opts.rx {
            RxRing::V3 {
                block_bytes,
                block_count,
                block_timeout_ms,
            } => {
                let req = libc::tpacket_req3 {
                    tp_block_size: block_bytes,
                    tp_block_nr: block_count,
                    // V3 packs frames; frame_size only has to divide the block.
                    tp_frame_size: 2048,
                    tp_frame_nr: (block_bytes / 2048) * block_count,
                    tp_retire_blk_tov: block_timeout_ms,
                    tp_sizeof_priv: 0,
                    tp_feature_req_word: 0,
                };
                setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)
                    .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_RX_RING v3)", e))?;
                (
                    block_bytes as usize * block_count as usize,
                    RxState::V3 {
                        block_bytes: block_bytes as usize,
                        block_count: block_count as usize,
                        block: 0,
                        done_in_block: 0,
                        next_off: 0,
                    },
                )
            }
            RxRing::V2 {
                frame_bytes,
                frame_count,
            } => {
                let (block_bytes, fpb) = Self::v2_blocks(frame_bytes);
                let blocks = frame_count.div_ceil(fpb);
                let req = libc::tpacket_req {
                    tp_block_size: block_bytes,
                    tp_block_nr: blocks,
                    tp_frame_size: frame_bytes,
                    tp_frame_nr: blocks * fpb,
                };
                setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)
                    .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_RX_RING v2)", e))?;
                (
                    block_bytes as usize * blocks as usize,
                    RxState::V2 {
                        frame_bytes: frame_bytes as usize,
                        frames_per_block: fpb as usize,
                        block_bytes: block_bytes as usize,
                        frame_count: (blocks * fpb) as usize,
                        slot: 0,
                    },
                )
            }
        };
        let rx_ring =
            Mmap::map(rfd, rx_len).map_err(|e| IoError::new(ifname, "mmap(rx ring)", e))?;
        setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &1i32)
            .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_IGNORE_OUTGOING)", e))?;
        if opts.qdisc_bypass {
            setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &1i32)
                .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_QDISC_BYPASS) rx", e))?;
        }
        // The RX socket also transmits (direct sends of big frames, all frames in Sendmmsg mode);
        // in-flight skbs are charged to it until the device frees them.
        let sndbuf = (opts.tx_frame_bytes as usize * opts.tx_frame_count as usize)
            .saturating_mul(2)
            .clamp(4 << 20, i32::MAX as usize) as i32;
        if setsockopt(rfd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &sndbuf).is_err() {
            let _ = setsockopt(rfd, libc::SOL_SOCKET, libc::SO_SNDBUF, &sndbuf);
        }
        bind(rfd, ifindex, libc::ETH_P_ALL as u16)
            .map_err(|e| IoError::new(ifname, "bind(rx, ETH_P_ALL)", e))?;
        if opts.promiscuous {
            // SAFETY: zeroed packet_mreq is valid.
            let mut mreq: libc::packet_mreq = unsafe { zeroed() };
            mreq.mr_ifindex = ifindex;
            mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
            // Membership ends (and promiscuity is dropped) when the socket closes.
            setsockopt(rfd, libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &mreq).map_err(|e| {
                IoError::new(ifname, "setsockopt(PACKET_ADD_MEMBERSHIP promisc)", e)
            })?;
        }

        // --- TX ------------------------------------------------------------------------------
        let (tx_fd, tx_ring, tx_slots, tx_fpb, tx_block_bytes, mmsg) = match opts.tx_mode {
            TxMode::Ring => {
                let (fd, ring, slots, fpb, bb) = Self::open_tx_ring(ifname, ifindex, opts)?;
                (Some(fd), Some(ring), slots, fpb, bb, None)
            }
            TxMode::Sendmmsg => (
                None,
                None,
                opts.tx_frame_count as usize,
                1,
                0,
                Some(MmsgQueue::new(
                    opts.tx_frame_bytes as usize,
                    opts.tx_frame_count as usize,
                )),
            ),
        };

        Ok(PacketPort {
            ifname: ifname.to_string(),
            mac,
            mtu,
            opts: *opts,
            rx_ring,
            tx_ring,
            rx_fd,
            tx_fd,
            rx: rx_state,
            mmsg,
            tx_slot: 0,
            tx_slots,
            tx_frames_per_block: tx_fpb,
            tx_block_bytes,
            tx_unkicked: 0,
            tx_seq: 0,
            tx_settled_seq: 0,
            sendmsg_used: false,
            scratch: Vec::new(),
            stats: PortStats::default(),
            kernel_drops: Cell::new(0),
            kernel_freezes: Cell::new(0),
        })
    }

    /// The TX socket with its TPACKET_V2 ring: (socket, ring, slots, slots per block, block bytes).
    fn open_tx_ring(
        ifname: &str,
        ifindex: i32,
        opts: &PortOptions,
    ) -> Result<(OwnedFd, Mmap, usize, usize, usize), IoError> {
        let tx_fd = packet_socket(ifname)?;
        let tfd = tx_fd.as_raw_fd();
        let v2 = libc::tpacket_versions::TPACKET_V2 as i32;
        setsockopt(tfd, libc::SOL_PACKET, libc::PACKET_VERSION, &v2)
            .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_VERSION) tx", e))?;
        if opts.vnet_hdr {
            setsockopt(tfd, libc::SOL_PACKET, libc::PACKET_VNET_HDR, &1i32)
                .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_VNET_HDR) tx", e))?;
        }
        // Without PACKET_LOSS a malformed slot stays WRONG_FORMAT at the ring head and wedges
        // the ring forever; with it the kernel skips the slot. We validate before queueing, so
        // this is a second line of defence.
        setsockopt(tfd, libc::SOL_PACKET, libc::PACKET_LOSS, &1i32)
            .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_LOSS)", e))?;
        if opts.qdisc_bypass {
            setsockopt(tfd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, &1i32)
                .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_QDISC_BYPASS) tx", e))?;
        }
        let (tx_block_bytes, tx_fpb) = Self::v2_blocks(opts.tx_frame_bytes);
        let tx_blocks = opts.tx_frame_count.div_ceil(tx_fpb);
        let treq = libc::tpacket_req {
            tp_block_size: tx_block_bytes,
            tp_block_nr: tx_blocks,
            tp_frame_size: opts.tx_frame_bytes,
            tp_frame_nr: tx_blocks * tx_fpb,
        };
        setsockopt(tfd, libc::SOL_PACKET, libc::PACKET_TX_RING, &treq)
            .map_err(|e| IoError::new(ifname, "setsockopt(PACKET_TX_RING)", e))?;
        let tx_len = tx_block_bytes as usize * tx_blocks as usize;
        let tx_ring =
            Mmap::map(tfd, tx_len).map_err(|e| IoError::new(ifname, "mmap(tx ring)", e))?;
        // Frames sent from the ring stay charged to the socket until the device frees them; make
        // the send buffer cover the whole ring so the ring, not sk_sndbuf, is the bound.
        let sndbuf = i32::try_from(tx_len.saturating_mul(2)).unwrap_or(i32::MAX);
        if setsockopt(tfd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &sndbuf).is_err() {
            // Unprivileged: best effort, capped by net.core.wmem_max.
            let _ = setsockopt(tfd, libc::SOL_SOCKET, libc::SO_SNDBUF, &sndbuf);
        }
        // Protocol 0: the TX socket joins no receive path.
        bind(tfd, ifindex, 0).map_err(|e| IoError::new(ifname, "bind(tx)", e))?;
        Ok((
            tx_fd,
            tx_ring,
            (tx_blocks * tx_fpb) as usize,
            tx_fpb as usize,
            tx_block_bytes as usize,
        ))
    }

    fn check_options(ifname: &str, o: &PortOptions) -> Result<(), IoError> {
        let bad = |why: &str| Err(IoError::invalid(ifname, "validate PortOptions", why));
        match o.rx {
            RxRing::V3 {
                block_bytes,
                block_count,
                block_timeout_ms,
            } => {
                if !is_page_multiple(block_bytes) || block_bytes % 2048 != 0 {
                    return bad("rx block_bytes must be a multiple of the page size");
                }
                if !(1..=4096).contains(&block_count)
                    || block_bytes as u64 * block_count as u64 > 1 << 30
                {
                    return bad("rx ring must have 1..=4096 blocks and at most 1 GiB");
                }
                if !(1..=1000).contains(&block_timeout_ms) {
                    return bad("rx block_timeout_ms must be 1..=1000");
                }
            }
            RxRing::V2 {
                frame_bytes,
                frame_count,
            } => {
                if frame_bytes % 16 != 0 || !(128..=(1 << 20)).contains(&frame_bytes) {
                    return bad("rx frame_bytes must be a multiple of 16 in 128..=1 MiB");
                }
                if !(1..=1 << 20).contains(&frame_count)
                    || frame_bytes as u64 * frame_count as u64 > 1 << 30
                {
                    return bad("rx ring must have 1..=1M slots and at most 1 GiB");
                }
            }
        }
        if o.tx_frame_bytes % 16 != 0 || !(128..=(1 << 20)).contains(&o.tx_frame_bytes) {
            return bad("tx_frame_bytes must be a multiple of 16 in 128..=1 MiB");
        }
        if !(1..=1 << 20).contains(&o.tx_frame_count)
            || o.tx_frame_bytes as u64 * o.tx_frame_count as u64 > 1 << 30
        {
            return bad("tx ring must have 1..=1M slots and at most 1 GiB");
        }
        Ok(())
    }

    /// Block size and frames per block for a V2 ring of `frame_bytes` slots: the smallest
    /// page-multiple block holding at least one slot, grown to 64 KiB when slots are small so the
    /// kernel allocates few blocks.
    fn v2_blocks(frame_bytes: u32) -> (u32, u32) {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u32;
        let mut block = frame_bytes.div_ceil(page) * page;
        while block < (1 << 16) && block * 2 / frame_bytes > block / frame_bytes {
            block *= 2;
        }
        (block, block / frame_bytes)
    }

    fn query_link(ifname: &str, fd: RawFd) -> Result<([u8; 6], usize), IoError> {
        let mut ifr = ifreq_for(ifname);
        // SAFETY: ifr is a valid ifreq with the name set.
        if unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut ifr) } < 0 {
            return Err(IoError::last_os(ifname, "ioctl(SIOCGIFHWADDR)"));
        }
        // SAFETY: SIOCGIFHWADDR filled ifru_hwaddr.
        let sa = unsafe { ifr.ifr_ifru.ifru_hwaddr };
        let mut mac = [0u8; 6];
        for (d, s) in mac.iter_mut().zip(sa.sa_data.iter()) {
            *d = *s as u8;
        }
        let mut ifr = ifreq_for(ifname);
        // SAFETY: as above.
        if unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut ifr) } < 0 {
            return Err(IoError::last_os(ifname, "ioctl(SIOCGIFMTU)"));
        }
        // SAFETY: SIOCGIFMTU filled ifru_mtu.
        let mtu = unsafe { ifr.ifr_ifru.ifru_mtu };
        Ok((mac, usize::try_from(mtu).unwrap_or(1500)))
    }

    /// Interface name.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    /// Interface MTU at open time.
    pub fn mtu(&self) -> usize {
        self.mtu
    }

    /// Options the port was opened with.
    pub fn options(&self) -> &PortOptions {
        &self.opts
    }

    /// Frames written to the TX ring but not yet accepted by the kernel (a kick failed with
    /// ENOBUFS/EAGAIN). Call `flush` again while this is non-zero.
    pub fn tx_unkicked(&self) -> usize {
        self.tx_unkicked
    }

    /// Largest frame `send` accepts without GSO metadata (VLAN-tagged; untagged frames may be 4
    /// bytes shorter, MTU + 14).
    pub fn max_frame_bytes(&self) -> usize {
        self.mtu + ETH_HLEN + VLAN_HLEN
    }

    fn refresh_kernel_stats(&self) {
        // SAFETY: zeroed tpacket_stats_v3 is valid.
        let mut st: libc::tpacket_stats_v3 = unsafe { zeroed() };
        let mut len = size_of::<libc::tpacket_stats_v3>() as libc::socklen_t;
        // SAFETY: st/len describe a valid buffer; V2 sockets fill only the first two fields.
        let r = unsafe {
            libc::getsockopt(
                self.rx_fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut st as *mut libc::tpacket_stats_v3).cast(),
                &mut len,
            )
        };
        if r == 0 {
            self.kernel_drops
                .set(self.kernel_drops.get() + u64::from(st.tp_drops));
            if len as usize >= size_of::<libc::tpacket_stats_v3>() {
                self.kernel_freezes
                    .set(self.kernel_freezes.get() + u64::from(st.tp_freeze_q_cnt));
            }
        }
    }

    /// Hands one frame (at `data`, `snaplen` bytes) to `f` with its metadata. Returns false if the
    /// descriptor is malformed (frame skipped and counted).
    #[allow(clippy::too_many_arguments)]
    fn deliver(
        &mut self,
        (slot_base, slot_len): (*const u8, usize),
        mac_off: usize,
        snaplen: usize,
        wire_len: usize,
        status: u32,
        (vlan_tci, vlan_tpid): (u16, u16),
        rx_ns: u64,
        f: &mut dyn FnMut(&[u8], &FrameMeta),
    ) -> bool {
        let vnet = if self.opts.vnet_hdr { VNET_HDR_LEN } else { 0 };
        let fits = mac_off
            .checked_add(snaplen)
            .map(|end| end <= slot_len)
            .unwrap_or(false);
        if mac_off < vnet || !fits {
            self.stats.rx_bad_descriptors += 1;
            return false;
        }
        // SAFETY: bounds checked against the slot/block above; the kernel does not write this
        // region until we hand the slot/block back.
        let frame = unsafe { std::slice::from_raw_parts(slot_base.add(mac_off), snaplen) };
        let mut meta = FrameMeta {
            wire_len: u32::try_from(wire_len).unwrap_or(u32::MAX),
            truncated: snaplen < wire_len,
            offload: Offload::NONE,
            csum_not_ready: status & libc::TP_STATUS_CSUMNOTREADY != 0,
            csum_valid: status & libc::TP_STATUS_CSUM_VALID != 0,
            vlan_reinserted: false,
            rx_ns,
        };
        if vnet > 0 {
            // SAFETY: mac_off >= 10 checked above; the header sits right before the frame.
            let h = unsafe { std::slice::from_raw_parts(slot_base.add(mac_off - vnet), vnet) };
            match Offload::decode(h) {
                Ok(o) => meta.offload = o,
                Err(_) => {
                    self.stats.rx_bad_descriptors += 1;
                    return false;
                }
            }
        }
        self.stats.rx_frames += 1;
        self.stats.rx_bytes += snaplen as u64;
        if meta.truncated {
            self.stats.rx_truncated += 1;
        }
        if wire_len > self.mtu + ETH_HLEN + VLAN_HLEN {
            self.stats.rx_oversize += 1;
        }
        if meta.offload.gso.is_some() {
            self.stats.rx_gso_frames += 1;
        }
        if meta.csum_not_ready {
            self.stats.rx_csum_partial += 1;
        }
        if self.opts.reinsert_vlan && status & libc::TP_STATUS_VLAN_VALID != 0 && frame.len() >= 12
        {
            let tpid = if status & libc::TP_STATUS_VLAN_TPID_VALID != 0 && vlan_tpid != 0 {
                vlan_tpid
            } else {
                0x8100
            };
            self.scratch.clear();
            self.scratch.extend_from_slice(&frame[..12]);
            self.scratch.extend_from_slice(&tpid.to_be_bytes());
            self.scratch.extend_from_slice(&vlan_tci.to_be_bytes());
            self.scratch.extend_from_slice(&frame[12..]);
            meta.vlan_reinserted = true;
            meta.wire_len = meta.wire_len.saturating_add(VLAN_HLEN as u32);
            // The kernel's offsets are relative to the untagged frame.
            if let Some(c) = meta.offload.csum_partial.as_mut() {
                c.start = c.start.saturating_add(VLAN_HLEN as u16);
            }
            if let Some(g) = meta.offload.gso.as_mut() {
                g.header_len = g.header_len.saturating_add(VLAN_HLEN as u16);
            }
            let buf = std::mem::take(&mut self.scratch);
            f(&buf, &meta);
            self.scratch = buf;
        } else {
            f(frame, &meta);
        }
        true
    }

    fn recv_v3(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &FrameMeta)) -> usize {
        let base = self.rx_ring.base();
        let mut n = 0;
        while n < max {
            let RxState::V3 {
                block_bytes,
                block_count,
                block,
                done_in_block,
                next_off,
            } = self.rx
            else {
                return n;
            };
            // SAFETY: block < block_count, so the block lies inside the mapping.
            let bd = unsafe { base.add(block * block_bytes) };
            // SAFETY: block_status is the 3rd u32 of the (8-aligned) block descriptor.
            let status = unsafe { status_word(bd.add(8)) };
            if status.load(Ordering::Acquire) & libc::TP_STATUS_USER == 0 {
                break;
            }
            // SAFETY: the kernel handed us this block (status USER); the descriptor is at its start.
            let hdr = unsafe { &(*bd.cast::<libc::tpacket_block_desc>()).hdr.bh1 };
            let num_pkts = hdr.num_pkts;
            let mut off = if next_off == 0 {
                hdr.offset_to_first_pkt as usize
            } else {
                next_off
            };
            let mut done = done_in_block;
            let mut abandon = false;
            while done < num_pkts && n < max {
                if off < V3_BLOCK_HDR_MIN
                    || off + size_of::<libc::tpacket3_hdr>() > block_bytes
                    || off % 4 != 0
                {
                    self.stats.rx_bad_descriptors += 1;
                    abandon = true;
                    break;
                }
                // SAFETY: header bounds checked above.
                let ph = unsafe { &*bd.add(off).cast::<libc::tpacket3_hdr>() };
                let (next, snap, len, st, mac) = (
                    ph.tp_next_offset as usize,
                    ph.tp_snaplen as usize,
                    ph.tp_len as usize,
                    ph.tp_status,
                    ph.tp_mac as usize,
                );
                let (tci, tpid) = (ph.hv1.tp_vlan_tci as u16, ph.hv1.tp_vlan_tpid);
                let at = ring_stamp_ns(st, ph.tp_sec, ph.tp_nsec);
                // SAFETY: off < block_bytes checked above.
                let pkt = unsafe { bd.add(off) };
                let slot = (pkt.cast_const(), block_bytes - off);
                if !self.deliver(slot, mac, snap, len, st, (tci, tpid), at, f) {
                    abandon = true;
                    break;
                }
                n += 1;
                done += 1;
                if next == 0 {
                    if done < num_pkts {
                        self.stats.rx_bad_descriptors += 1;
                        abandon = true;
                    }
                    break;
                }
                off += next;
            }
            if abandon || done >= num_pkts {
                // Hand the block back and move on.
                status.store(libc::TP_STATUS_KERNEL, Ordering::Release);
                self.rx = RxState::V3 {
                    block_bytes,
                    block_count,
                    block: (block + 1) % block_count,
                    done_in_block: 0,
                    next_off: 0,
                };
            } else {
                // `max` reached mid-block: remember where to resume.
                self.rx = RxState::V3 {
                    block_bytes,
                    block_count,
                    block,
                    done_in_block: done,
                    next_off: off,
                };
            }
        }
        n
    }

    fn recv_v2(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &FrameMeta)) -> usize {
        let base = self.rx_ring.base();
        let mut n = 0;
        while n < max {
            let RxState::V2 {
                frame_bytes,
                frames_per_block,
                block_bytes,
                frame_count,
                slot,
            } = self.rx
            else {
                return n;
            };
            let off =
                (slot / frames_per_block) * block_bytes + (slot % frames_per_block) * frame_bytes;
            // SAFETY: slot < frame_count, so the slot lies inside the mapping.
            let p = unsafe { base.add(off) };
            // SAFETY: tp_status is the first u32 of the 16-aligned slot.
            let status = unsafe { status_word(p) };
            let st = status.load(Ordering::Acquire);
            if st & libc::TP_STATUS_USER == 0 {
                break;
            }
            // SAFETY: slot owned by user space while status is USER.
            let h = unsafe { &*p.cast::<libc::tpacket2_hdr>() };
            let (mac, snap, len, tci, tpid) = (
                h.tp_mac as usize,
                h.tp_snaplen as usize,
                h.tp_len as usize,
                h.tp_vlan_tci,
                h.tp_vlan_tpid,
            );
            let at = ring_stamp_ns(st, h.tp_sec, h.tp_nsec);
            if self.deliver(
                (p.cast_const(), frame_bytes),
                mac,
                snap,
                len,
                st,
                (tci, tpid),
                at,
                f,
            ) {
                n += 1;
            }
            status.store(libc::TP_STATUS_KERNEL, Ordering::Release);
            if let RxState::V2 { slot, .. } = &mut self.rx {
                *slot = (*slot + 1) % frame_count;
            }
        }
        n
    }

    fn tx_slot_ptr(&self, slot: usize) -> *mut u8 {
        let off = (slot / self.tx_frames_per_block) * self.tx_block_bytes
            + (slot % self.tx_frames_per_block) * self.opts.tx_frame_bytes as usize;
        let base = self
            .tx_ring
            .as_ref()
            .map_or(std::ptr::null_mut(), |r| r.base());
        // SAFETY: only called in Ring mode (ring present) with slot < tx_slots, so the offset
        // lies inside the mapping.
        unsafe { base.add(off) }
    }

    /// Sends one frame with a direct sendmsg on the RX socket (frames too big for a TX slot).
    fn send_direct(&mut self, frame: &[u8], offload: &Offload) -> io::Result<()> {
        // Keep order: everything already in the ring must reach the kernel first.
        self.flush()?;
        if self.tx_unkicked > 0 {
            self.stats.tx_dropped_full += 1;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let hdr = offload.encode();
        let mut iov = [
            libc::iovec {
                iov_base: hdr.as_ptr() as *mut libc::c_void,
                iov_len: hdr.len(),
            },
            libc::iovec {
                iov_base: frame.as_ptr() as *mut libc::c_void,
                iov_len: frame.len(),
            },
        ];
        let skip = if self.opts.vnet_hdr { 0 } else { 1 };
        // SAFETY: zeroed msghdr is valid; iov outlives the call.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = iov[skip..].as_mut_ptr();
        msg.msg_iovlen = (iov.len() - skip) as _;
        for _ in 0..EINTR_RETRIES {
            // SAFETY: msg describes valid buffers.
            let r = unsafe { libc::sendmsg(self.rx_fd.as_raw_fd(), &msg, libc::MSG_DONTWAIT) };
            if r >= 0 {
                self.sendmsg_used = true;
                self.stats.tx_frames += 1;
                self.stats.tx_bytes += frame.len() as u64;
                self.stats.tx_direct += 1;
                if offload.gso.is_some() {
                    self.stats.tx_gso_frames += 1;
                }
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => {
                    self.stats.tx_dropped_full += 1;
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                _ => {
                    self.stats.tx_errors += 1;
                    return Err(e);
                }
            }
        }
        self.stats.tx_errors += 1;
        Err(io::ErrorKind::Interrupted.into())
    }
}

impl PacketPort {
    fn flush_mmsg(&mut self) -> io::Result<()> {
        let fd = self.rx_fd.as_raw_fd();
        let Some(q) = self.mmsg.as_mut() else {
            return Ok(());
        };
        let mut retries = 0;
        while q.len > 0 {
            let n = q.prepare();
            // SAFETY: prepare() pointed n headers at n iovecs over live queue slots.
            let r =
                unsafe { libc::sendmmsg(fd, q.hdrs.as_mut_ptr(), n as u32, libc::MSG_DONTWAIT) };
            if r > 0 {
                q.pop(r as usize);
                self.stats.tx_kicks += 1;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) if retries < EINTR_RETRIES => retries += 1,
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) => {
                    // The device is busy: frames stay queued for the next flush.
                    self.stats.tx_kick_retries += 1;
                    break;
                }
                _ => {
                    // The first frame was refused for good (e.g. EMSGSIZE): drop it, go on.
                    self.stats.tx_errors += 1;
                    q.pop(1);
                }
            }
        }
        self.tx_unkicked = q.len;
        Ok(())
    }
}

/// Bounded queue of frames for `sendmmsg`: `count` slots of `slot_bytes` (vnet header + frame).
struct MmsgQueue {
    buf: Vec<u8>,
    slot_bytes: usize,
    lens: Vec<usize>,
    start: usize,
    len: usize,
    iovs: Vec<libc::iovec>,
    hdrs: Vec<libc::mmsghdr>,
}

impl MmsgQueue {
    /// Most messages per sendmmsg call (the kernel caps at UIO_MAXIOV = 1024).
    const MAX_BATCH: usize = 1024;

    fn new(slot_bytes: usize, count: usize) -> Self {
        let batch = count.min(Self::MAX_BATCH);
        Self {
            buf: vec![0; slot_bytes * count],
            slot_bytes,
            lens: vec![0; count],
            start: 0,
            len: 0,
            iovs: Vec::with_capacity(batch),
            hdrs: Vec::with_capacity(batch),
        }
    }

    fn push(&mut self, vnet: usize, offload: &Offload, frame: &[u8]) -> bool {
        let count = self.lens.len();
        if self.len == count || vnet + frame.len() > self.slot_bytes {
            return false;
        }
        let i = (self.start + self.len) % count;
        let slot = &mut self.buf[i * self.slot_bytes..(i + 1) * self.slot_bytes];
        if vnet > 0 {
            slot[..vnet].copy_from_slice(&offload.encode());
        }
        slot[vnet..vnet + frame.len()].copy_from_slice(frame);
        self.lens[i] = vnet + frame.len();
        self.len += 1;
        true
    }

    /// Fills the header array for the longest contiguous run from `start`; returns its length.
    fn prepare(&mut self) -> usize {
        let count = self.lens.len();
        let n = self.len.min(count - self.start).min(Self::MAX_BATCH);
        self.iovs.clear();
        self.hdrs.clear();
        for k in 0..n {
            let i = self.start + k;
            self.iovs.push(libc::iovec {
                iov_base: self.buf[i * self.slot_bytes..].as_mut_ptr().cast(),
                iov_len: self.lens[i],
            });
        }
        for k in 0..n {
            // SAFETY: zeroed mmsghdr is valid; fields set below.
            let mut h: libc::mmsghdr = unsafe { zeroed() };
            h.msg_hdr.msg_iov = &mut self.iovs[k];
            h.msg_hdr.msg_iovlen = 1;
            self.hdrs.push(h);
        }
        n
    }

    fn pop(&mut self, n: usize) {
        let n = n.min(self.len);
        self.start = (self.start + n) % self.lens.len();
        self.len -= n;
    }
}

impl FramePort for PacketPort {
    fn mtu(&self) -> usize {
        self.mtu
    }

    fn recv_batch_meta(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&[u8], &FrameMeta),
    ) -> io::Result<usize> {
        Ok(match self.rx {
            RxState::V3 { .. } => self.recv_v3(max, f),
            RxState::V2 { .. } => self.recv_v2(max, f),
        })
    }

    fn send_offload(&mut self, frame: &[u8], offload: &Offload) -> io::Result<()> {
        let invalid = |s: &mut Self, why: &'static str| {
            s.stats.tx_errors += 1;
            Err(io::Error::new(io::ErrorKind::InvalidInput, why))
        };
        if !offload.is_none() && !self.opts.vnet_hdr {
            self.stats.tx_errors += 1;
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "offload metadata needs PortOptions::vnet_hdr",
            ));
        }
        // The kernel refuses frames without a full Ethernet header (EINVAL).
        if frame.len() < ETH_HLEN {
            return invalid(self, "frame shorter than an Ethernet header");
        }
        // Like the kernel (packet_extra_vlan_len_allowed): 4 extra bytes only for tagged frames.
        let tagged = matches!([frame[12], frame[13]], [0x81, 0x00] | [0x88, 0xa8]);
        let limit = if offload.gso.is_some() {
            MAX_GSO_FRAME
        } else if tagged {
            self.max_frame_bytes()
        } else {
            self.mtu + ETH_HLEN
        };
        if frame.len() > limit {
            return invalid(self, "frame larger than MTU (and no GSO metadata)");
        }
        if offload.validate(frame.len()).is_err() {
            return invalid(self, "offload metadata does not fit the frame");
        }
        let vnet = if self.opts.vnet_hdr { VNET_HDR_LEN } else { 0 };
        let total = vnet + frame.len();
        if TX_DATA_OFFSET + total > self.opts.tx_frame_bytes as usize {
            return self.send_direct(frame, offload);
        }
        if let Some(q) = self.mmsg.as_mut() {
            if !q.push(vnet, offload, frame) {
                self.stats.tx_dropped_full += 1;
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.tx_unkicked += 1;
            self.sendmsg_used = true;
            self.stats.tx_frames += 1;
            self.stats.tx_bytes += frame.len() as u64;
            if offload.gso.is_some() {
                self.stats.tx_gso_frames += 1;
            }
            return Ok(());
        }
        let p = self.tx_slot_ptr(self.tx_slot);
        // SAFETY: tp_status is the first u32 of the 16-aligned slot.
        let status = unsafe { status_word(p) };
        match status.load(Ordering::Acquire) {
            libc::TP_STATUS_AVAILABLE => {}
            libc::TP_STATUS_WRONG_FORMAT => {
                // Only without PACKET_LOSS; the slot is ours again.
                self.stats.tx_errors += 1;
            }
            _ => {
                // SEND_REQUEST or SENDING: the ring is full.
                self.stats.tx_dropped_full += 1;
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
        // SAFETY: the slot belongs to user space (AVAILABLE) and TX_DATA_OFFSET + total fits in
        // the slot (checked above).
        unsafe {
            let data = p.add(TX_DATA_OFFSET);
            if vnet > 0 {
                std::ptr::copy_nonoverlapping(offload.encode().as_ptr(), data, vnet);
            }
            std::ptr::copy_nonoverlapping(frame.as_ptr(), data.add(vnet), frame.len());
            let h = p.cast::<libc::tpacket2_hdr>();
            (*h).tp_len = total as u32;
            (*h).tp_snaplen = total as u32;
        }
        status.store(libc::TP_STATUS_SEND_REQUEST, Ordering::Release);
        self.tx_slot = (self.tx_slot + 1) % self.tx_slots;
        self.tx_seq += 1;
        self.tx_unkicked += 1;
        self.stats.tx_frames += 1;
        self.stats.tx_bytes += frame.len() as u64;
        if offload.gso.is_some() {
            self.stats.tx_gso_frames += 1;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.tx_unkicked == 0 {
            return Ok(());
        }
        if self.mmsg.is_some() {
            return self.flush_mmsg();
        }
        let Some(tx_fd) = self.tx_fd.as_ref().map(|f| f.as_raw_fd()) else {
            return Ok(());
        };
        for _ in 0..EINTR_RETRIES {
            self.stats.tx_kicks += 1;
            // SAFETY: a zero-length send on the TX socket only kicks the ring.
            let r = unsafe { libc::send(tx_fd, std::ptr::null(), 0, libc::MSG_DONTWAIT) };
            if r >= 0 {
                self.tx_unkicked = 0;
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // The device refused a frame: it is put back in the ring (SEND_REQUEST) and the
                // following ones stay queued; the next flush retries them.
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => {
                    self.stats.tx_kick_retries += 1;
                    return Ok(());
                }
                _ => {
                    self.stats.tx_errors += 1;
                    return Err(IoError::new(&self.ifname, "send(tx ring kick)", e).into());
                }
            }
        }
        Ok(())
    }

    fn tx_mark(&self) -> u64 {
        self.tx_seq
    }

    /// A TX-ring slot stays SEND_REQUEST/SENDING until the kernel releases its skb, which
    /// happens where the frame leaves the last queue on its way: the receiving host's IP layer
    /// orphans it (ip_rcv), an AF_PACKET receiver copies it into its ring and frees it, or it is
    /// dropped. veth and L2 forwarding (bridge, tc redirect) keep the claim, so a frame waiting
    /// in a per-CPU backlog or a qdisc downstream keeps its slot busy. Frames sent with
    /// sendmsg/sendmmsg are charged to the RX socket's send buffer the same way; for those only
    /// "none in flight" (SIOCOUTQ = 0) can be told, which is stricter than needed.
    fn tx_settled(&mut self, mark: u64) -> bool {
        if self.tx_ring.is_some() && self.tx_slots > 0 {
            let slots = self.tx_slots as u64;
            // Slots are refilled in order and only once released: a seq a whole ring behind
            // the newest has had its slot reused, so its frame was released.
            self.tx_settled_seq = self.tx_settled_seq.max(self.tx_seq.saturating_sub(slots));
            let upto = mark.min(self.tx_seq);
            while self.tx_settled_seq < upto {
                let slot = (self.tx_settled_seq % slots) as usize;
                // SAFETY: ring mode and slot < tx_slots; tp_status is the slot's first u32.
                let status = unsafe { status_word(self.tx_slot_ptr(slot)) }.load(Ordering::Acquire);
                if status & (libc::TP_STATUS_SEND_REQUEST | libc::TP_STATUS_SENDING) != 0 {
                    return false;
                }
                self.tx_settled_seq += 1;
            }
        }
        if self.mmsg.as_ref().is_some_and(|q| q.len > 0) {
            // Not even handed to the kernel yet (a flush was refused).
            return false;
        }
        if !self.sendmsg_used {
            return true;
        }
        let mut outq: libc::c_int = 0;
        // SAFETY: SIOCOUTQ (= TIOCOUTQ) writes one int: bytes still charged to the socket.
        let rc = unsafe { libc::ioctl(self.rx_fd.as_raw_fd(), libc::TIOCOUTQ, &mut outq) };
        rc == 0 && outq == 0
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.rx_fd.as_raw_fd())
    }

    fn stats(&self) -> PortStats {
        self.refresh_kernel_stats();
        PortStats {
            rx_kernel_drops: self.kernel_drops.get(),
            rx_ring_freezes: self.kernel_freezes.get(),
            ..self.stats
        }
    }

    fn mac(&self) -> [u8; 6] {
        self.mac
    }

    fn offloads_enabled(&self) -> bool {
        self.opts.vnet_hdr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: usize = 4096;

    /// A V3 port whose "ring" is anonymous memory the test fills like the kernel would.
    fn fake_v3(blocks: usize, vnet_hdr: bool) -> PacketPort {
        let devnull = || OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        PacketPort {
            ifname: "fake0".into(),
            mac: [2, 0, 0, 0, 0, 9],
            mtu: 1500,
            opts: PortOptions {
                vnet_hdr,
                ..PortOptions::default()
            },
            rx_ring: Mmap::anon(BLOCK * blocks).unwrap(),
            tx_ring: None,
            rx_fd: devnull(),
            tx_fd: None,
            mmsg: None,
            rx: RxState::V3 {
                block_bytes: BLOCK,
                block_count: blocks,
                block: 0,
                done_in_block: 0,
                next_off: 0,
            },
            tx_slot: 0,
            tx_slots: 0,
            tx_frames_per_block: 1,
            tx_block_bytes: 0,
            tx_unkicked: 0,
            tx_seq: 0,
            tx_settled_seq: 0,
            sendmsg_used: false,
            scratch: Vec::new(),
            stats: PortStats::default(),
            kernel_drops: Cell::new(0),
            kernel_freezes: Cell::new(0),
        }
    }

    fn put_u32(p: &PacketPort, off: usize, v: u32) {
        // SAFETY: test offsets lie inside the fake ring.
        unsafe { std::ptr::write_unaligned(p.rx_ring.base().add(off).cast::<u32>(), v) }
    }

    fn put_u16(p: &PacketPort, off: usize, v: u16) {
        // SAFETY: as above.
        unsafe { std::ptr::write_unaligned(p.rx_ring.base().add(off).cast::<u16>(), v) }
    }

    /// Writes a V3 block header: status USER, `n` packets, first at `first`.
    fn block(p: &PacketPort, b: usize, n: u32, first: u32) {
        put_u32(p, b * BLOCK + 8, libc::TP_STATUS_USER);
        put_u32(p, b * BLOCK + 12, n);
        put_u32(p, b * BLOCK + 16, first);
    }

    /// Writes a tpacket3_hdr at `off` in block `b` and a frame of `len` bytes filled with `fill`.
    fn pkt(p: &PacketPort, b: usize, off: usize, next: u32, mac: u16, len: u32, fill: u8) {
        let base = b * BLOCK + off;
        put_u32(p, base, next);
        put_u32(p, base + 12, len); // tp_snaplen
        put_u32(p, base + 16, len); // tp_len
        put_u32(p, base + 20, libc::TP_STATUS_USER);
        put_u16(p, base + 24, mac);
        for i in 0..len as usize {
            if base + usize::from(mac) + i < p.rx_ring.len {
                // SAFETY: bounds checked.
                unsafe { *p.rx_ring.base().add(base + usize::from(mac) + i) = fill };
            }
        }
    }

    fn block_status(p: &PacketPort, b: usize) -> u32 {
        // SAFETY: inside the ring.
        unsafe { status_word(p.rx_ring.base().add(b * BLOCK + 8)) }.load(Ordering::Acquire)
    }

    #[test]
    fn v3_reader_walks_blocks_resumes_mid_block_and_returns_them() {
        let mut p = fake_v3(2, false);
        block(&p, 0, 3, 48);
        pkt(&p, 0, 48, 128, 80, 60, 1);
        pkt(&p, 0, 176, 128, 80, 60, 2);
        pkt(&p, 0, 304, 0, 80, 60, 3);
        block(&p, 1, 1, 48);
        pkt(&p, 1, 48, 0, 80, 1514, 4);
        let mut seen = Vec::new();
        // max = 2 stops mid-block; the block stays ours.
        assert_eq!(
            p.recv_batch(2, &mut |f| seen.push((f[0], f.len())))
                .unwrap(),
            2
        );
        assert_eq!(block_status(&p, 0), libc::TP_STATUS_USER);
        assert_eq!(
            p.recv_batch(10, &mut |f| seen.push((f[0], f.len())))
                .unwrap(),
            2
        );
        assert_eq!(seen, vec![(1, 60), (2, 60), (3, 60), (4, 1514)]);
        // Both blocks were handed back; the reader wrapped to block 0, which is the kernel's.
        assert_eq!(block_status(&p, 0), libc::TP_STATUS_KERNEL);
        assert_eq!(block_status(&p, 1), libc::TP_STATUS_KERNEL);
        assert_eq!(
            p.recv_batch(10, &mut |_| panic!("no frame expected"))
                .unwrap(),
            0
        );
        let s = p.stats();
        assert_eq!(
            (s.rx_frames, s.rx_bytes, s.rx_bad_descriptors),
            (4, 1694, 0)
        );
    }

    #[test]
    fn v3_reader_counts_and_skips_malformed_descriptors() {
        let mut p = fake_v3(4, true);
        // Block 0: frame runs past the block end.
        block(&p, 0, 2, 48);
        pkt(&p, 0, 48, 128, 80, 5000, 1);
        // Block 1: next offset points outside the block.
        block(&p, 1, 2, 48);
        pkt(&p, 1, 48, 60_000, 80, 60, 2);
        // Block 2: first packet offset inside the block descriptor; then block 3 holds a frame
        // whose vnet header would start before the packet (mac offset < 10).
        block(&p, 2, 1, 4);
        block(&p, 3, 1, 48);
        pkt(&p, 3, 48, 0, 4, 60, 3);
        let mut seen = Vec::new();
        let n = p.recv_batch(64, &mut |f| seen.push(f[0])).unwrap();
        // Only block 1's first frame is well-formed; its successor pointer is not. (Its vnet
        // header is all zeroes = no offload.)
        assert_eq!(n, 1);
        assert_eq!(seen, vec![2]);
        assert_eq!(p.stats().rx_bad_descriptors, 4);
        for b in 0..4 {
            assert_eq!(block_status(&p, b), libc::TP_STATUS_KERNEL, "block {b}");
        }
    }

    #[test]
    fn v3_reader_decodes_vnet_header_and_counts_gso() {
        let mut p = fake_v3(1, true);
        block(&p, 0, 1, 48);
        pkt(&p, 0, 48, 0, 90, 3000, 7);
        let h = Offload {
            csum_partial: Some(crate::CsumPartial {
                start: 34,
                offset: 16,
            }),
            csum_valid: false,
            gso: Some(crate::Gso {
                kind: crate::GsoKind::TcpV4,
                segment_size: 1448,
                header_len: 66,
                ecn: false,
            }),
        }
        .encode();
        for (i, b) in h.iter().enumerate() {
            // SAFETY: inside the ring (header right before the frame at 48 + 90).
            unsafe { *p.rx_ring.base().add(48 + 90 - VNET_HDR_LEN + i) = *b };
        }
        let mut metas = Vec::new();
        p.recv_batch_meta(8, &mut |_, m| metas.push(*m)).unwrap();
        assert_eq!(metas.len(), 1);
        assert_eq!(metas[0].offload, Offload::decode(&h).unwrap());
        let s = p.stats();
        assert_eq!((s.rx_gso_frames, s.rx_oversize), (1, 1));
    }

    #[test]
    fn v2_blocks_are_page_multiples_holding_whole_slots() {
        for fb in [128u32, 2048, 2064, 4096, 10_000 / 16 * 16, 65_536 + 128] {
            let (b, fpb) = PacketPort::v2_blocks(fb);
            assert_eq!(b % 4096, 0, "frame {fb}");
            assert!(fpb >= 1);
            assert!(fpb * fb <= b);
        }
        assert_eq!(PacketPort::v2_blocks(2048), (65_536, 32));
    }

    #[test]
    fn bad_options_are_refused_with_reason() {
        let o = PortOptions {
            rx: RxRing::V3 {
                block_bytes: 1000,
                block_count: 4,
                block_timeout_ms: 1,
            },
            ..PortOptions::default()
        };
        let e = PacketPort::check_options("x", &o).unwrap_err();
        assert!(e.to_string().contains("block_bytes"), "{e}");
        let o = PortOptions {
            tx_frame_bytes: 100,
            ..PortOptions::default()
        };
        assert!(PacketPort::check_options("x", &o).is_err());
        assert!(PacketPort::check_options("x", &PortOptions::default()).is_ok());
        assert!(PacketPort::check_options("x", &PortOptions::low_latency()).is_ok());
    }

    #[test]
    fn open_fails_with_typed_error_on_missing_interface() {
        let e = PacketPort::open("pio-nosuchif0", &PortOptions::default()).expect_err("must fail");
        assert_eq!(e.ifname, "pio-nosuchif0");
        assert_eq!(e.op, "if_nametoindex");
        let e = PacketPort::open("this-name-is-far-too-long", &PortOptions::default())
            .expect_err("must fail");
        assert_eq!(e.op, "validate interface name");
    }
}
