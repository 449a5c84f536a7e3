//! The replication channel. CONTRACT (implemented by the ha-link helper):
//!
//! Unix stream sockets (mode 0600, peer uid checked with SO_PEERCRED) plus the HMAC handshake of
//! [`crate::auth`], then [`crate::wire`] frames. All socket I/O happens on threads owned here,
//! never on the packet thread, which talks to them only through bounded channels it polls and a
//! wake-up fd it can add to poll(2).
//!
//! Backup side:
//! ```ignore
//! pub struct ReplServer { .. }   // Drop stops the accept thread and closes connections, unlinks the socket
//! impl ReplServer {
//!     /// Listens at `path`; every authenticated connection gets a reader thread (bounded number)
//!     /// that applies checkpoints to `store` and answers `Ack` only after `apply` returned Ok
//!     /// (the checkpoint is in the backup's memory, as in Remus). Refusals answer `Refused`.
//!     pub fn start(path: &Path, secret: Secret, store: Arc<Mutex<StandbyStore>>) -> Result<ReplServer, TransportError>;
//!     pub fn stats(&self) -> ServerStats; // connections, auth_failures, frames, bytes_in, decode_errors, refused
//! }
//! ```
//! Primary side (one per backup destination):
//! ```ignore
//! pub struct ReplSender { .. }
//! impl ReplSender {
//!     /// Starts a sender thread that connects (retrying every `retry` until `dead_after` has
//!     /// passed without a live connection), authenticates, sends Hello{primary, token}, then
//!     /// ships queued checkpoints in order and sends a Heartbeat every `heartbeat` when idle.
//!     pub fn start(path: &Path, secret: Secret, primary: &str, token: u64, opts: SenderOptions) -> ReplSender;
//!     /// Non-blocking; Err(Full) when the bounded queue is full, Err(Dead) once the link is dead.
//!     pub fn send(&self, cp: Checkpoint) -> Result<(), SendError>;
//!     /// Non-blocking: acks received since the last call (cumulative per group).
//!     pub fn poll(&self, acks: &mut Vec<Ack>) -> LinkState;
//!     pub fn wake_fd(&self) -> RawFd;   // readable when acks or a state change are waiting
//!     pub fn drain_wake(&self);
//!     pub fn stats(&self) -> SenderStats; // bytes_sent, frames_sent, checkpoints, reconnects, rtt_us_last
//! }
//! pub enum LinkState { Connecting, Up { welcome: Vec<(GroupId, u64)> }, Dead { reason: String } }
//! pub struct SenderOptions { pub retry: Duration /*5 ms*/, pub dead_after: Duration /*60 ms: no ack/heartbeat answer for this long => Dead*/, pub heartbeat: Duration /*10 ms*/, pub max_queued: usize }
//! ```
//! Dead detection: the backup answers each Heartbeat with an `Ack` of its latest seq; no frame
//! from the backup for `dead_after` while something is outstanding (or EOF/reset) => Dead.
