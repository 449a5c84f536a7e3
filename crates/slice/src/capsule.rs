//! The capsules of a Slice: what one client session is, layer by layer.
//!
//! - [`TcpCapsule`]: the kernel's socket and TCP state of the session's connection, as the
//!   TCP_REPAIR interface exposes it (see [`crate::repair`]).
//! - the session layer: bytes the server produced but had not yet handed to the kernel.
//! - the application capsule: opaque bytes the application serialised.
//!
//! A [`Slice`] chains them under one identity (the session id): they are captured, moved and
//! restored together or not at all.

use std::net::SocketAddr;

/// TCP options negotiated at the handshake; they cannot be renegotiated, so a restored socket
/// must be told them (TCP_REPAIR_OPTIONS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpOptions {
    /// Maximum segment size (the clamp the peer announced).
    pub mss: u32,
    /// Window scaling: `Some((snd_wscale, rcv_wscale))` when both ends agreed to it.
    pub wscale: Option<(u8, u8)>,
    pub sack: bool,
    pub timestamps: bool,
}

/// The windows TCP_REPAIR_WINDOW reads and writes (`struct tcp_repair_window`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TcpWindow {
    /// Sequence number of the segment that last updated the send window.
    pub snd_wl1: u32,
    /// The peer's advertised window.
    pub snd_wnd: u32,
    /// The largest window the peer ever advertised.
    pub max_window: u32,
    /// Our advertised receive window.
    pub rcv_wnd: u32,
    /// `rcv_nxt` when `rcv_wnd` was last advertised.
    pub rcv_wup: u32,
}

/// One established TCP connection's kernel state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpCapsule {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// Sequence number after the last byte the application wrote (`write_seq`).
    pub send_seq: u32,
    /// Sequence number after the last byte received in order (`rcv_nxt`).
    pub recv_seq: u32,
    /// Bytes written and not yet acknowledged by the peer, oldest first (sent or not).
    pub send_queue: Vec<u8>,
    /// How many bytes at the end of `send_queue` were never sent.
    pub unsent: u32,
    /// Bytes received and acknowledged that the application had not read yet.
    pub recv_queue: Vec<u8>,
    pub options: TcpOptions,
    pub window: TcpWindow,
    /// The socket's current TCP timestamp clock value (TCP_TIMESTAMP), so the restored
    /// socket's timestamps continue where the peer expects them (PAWS).
    pub timestamp: u32,
    /// CLOCK_MONOTONIC (the clock TCP timestamps count) in ms when `timestamp` was read: a
    /// restore on the same host advances the timestamp by the time since, so the restored
    /// socket's clock is the source's and never lags a value the peer has already seen from
    /// the source (the peer would drop such segments as old duplicates: PAWS).
    pub captured_at_ms: u64,
    /// The network namespace the connection lives in (its nsfs inode): the capsule's dependency
    /// on a kernel. A socket restored in another namespace would be created without an error
    /// and never see the connection's packets, so a restore elsewhere is refused.
    pub netns: u64,
    pub nodelay: bool,
}

impl TcpCapsule {
    /// The sequence number of the first unacknowledged byte (`snd_una`).
    pub fn send_una(&self) -> u32 {
        self.send_seq.wrapping_sub(self.send_queue.len() as u32)
    }

    /// The sequence number of the first byte the application had not read (`copied_seq`).
    pub fn recv_copied(&self) -> u32 {
        self.recv_seq.wrapping_sub(self.recv_queue.len() as u32)
    }

    /// Bytes of the send queue that were sent (and await their acknowledgement).
    pub fn sent_part(&self) -> &[u8] {
        &self.send_queue[..self.send_queue.len() - self.unsent as usize]
    }

    /// Bytes of the send queue that were never sent: written by the restored session after
    /// leaving repair mode, like any new output.
    pub fn unsent_part(&self) -> &[u8] {
        &self.send_queue[self.send_queue.len() - self.unsent as usize..]
    }
}

/// A client session across layers: identity, kernel capsule, session-layer output, application
/// capsule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    /// The session's identity, unique among the instances a session moves between.
    pub session_id: u64,
    pub tcp: TcpCapsule,
    /// Output the server produced and had not yet written to the socket.
    pub pending_out: Vec<u8>,
    /// The application's own serialisation of its per-session state.
    pub app: Vec<u8>,
}
