//! pliant-wire: how pliant processes talk to each other, on one host or across hosts.
//!
//! - [`frame`]: the one framing codec (length, protocol version, message kind).
//! - [`endpoint`]: unix path or TCP `host:port`, the streams and listeners behind them.
//! - [`identity`]: per-node keys and CA-signed certificates (name + roles).
//! - [`session`]: the mutual-authentication handshake and the per-direction sealing of frames
//!   (sequence-numbered AES-256-GCM, encrypted or authenticated only).
//! - [`conn`]: a connection after its handshake, typed send/receive, split into halves.
//! - [`server`]: bind, accept loop, bounded connection threads.
//! - [`security`]: a process's identity and encryption policy, handed to every channel.
//! - [`kinds`]: the message kind of each channel.
//! - [`keyfile`]: private files checked for mode and owner on the opened file.

pub mod conn;
pub mod endpoint;
pub mod frame;
pub mod identity;
pub mod keyfile;
pub mod security;
pub mod server;
pub mod session;

pub use conn::{Conn, ConnError, ConnReader, ConnWriter};
pub use endpoint::{BindError, Endpoint, Listener, Stream, TcpTuning};
pub use frame::{FrameError, FIRST_CHANNEL_KIND, PROTOCOL_VERSION};
pub use identity::{role, Ca, Identity, IdentityError, NodeCert};
pub use security::{Encrypt, Security};
pub use session::{Expect, Peer, Session, SessionError, SessionOptions};

/// Frame kinds of each channel (every frame of a channel carries its kind; a frame of another
/// channel's kind is refused, so a message cannot be replayed into the wrong protocol).
pub mod kinds {
    /// Pico replication: primary <-> backup.
    pub const REPL: u16 = 0x100;
    /// FTMB: master -> logger streams and their answers.
    pub const FTMB: u16 = 0x200;
    /// Migration peer channel: replica -> replica flow state and packets.
    pub const PEER: u16 = 0x300;
    /// Coherence hub: replica <-> hub.
    pub const HUB: u16 = 0x400;
    /// Replica control: controller/CLI -> replica.
    pub const CONTROL: u16 = 0x500;
    /// Slice moves: instance -> instance session capsules (pliant-slice).
    pub const SLICE: u16 = 0x600;
    /// State machine replication: Raft messages replica -> replica (pliant-smr).
    pub const SMR: u16 = 0x700;
}
