//! pliant-proto: the replica control protocol, one definition for both ends.
//!
//! - [`request`]: what a controller, the CLI or a test may ask a replica ([`Request`]), with
//!   the bounds every request is checked against before it reaches the packet thread.
//! - [`reply`]: the typed answers clients read. Decoding is strict: a field a client relies on
//!   that is missing or of another type is an error naming it, never a silent zero.
//! - [`link`]: one request or answer per frame of the one framing codec (pliant-wire, kind
//!   [`pliant_wire::kinds::CONTROL`]), over a unix socket or TCP, sealed by a session
//!   handshake when the replica has an identity.
//! - [`client`]: connect, ask, decode.
//! - [`agent`]: the host agent's requests and status, on the same link.
//! - [`fence`]: the term fence every commanded process keeps against deposed controllers.
//!
//! Bodies are JSON inside the frames: the answers of `stats`, `query` and the status commands
//! carry free-form detail for people (the NF's own query, the loggers' nested status) next to
//! the typed fields programs read, and JSON keeps `pliant ctl` output readable as is.

pub mod agent;
pub mod client;
pub mod fence;
pub mod link;
pub mod reply;
pub mod request;

pub use agent::AgentRequest;
pub use client::{Client, ControlError, KeptLinks};
pub use fence::TermFence;
pub use link::Link;
pub use request::Request;

/// A request of one of the protocols on the control link (a replica's [`Request`], a host
/// agent's [`AgentRequest`]): JSON tagged by `"cmd"`.
pub trait Command: serde::Serialize {
    /// The command's name as on the wire (for messages and counters).
    fn name(&self) -> &'static str;
    /// Whether answering may take long (the client waits [`client::SLOW_TIMEOUT`]).
    fn is_slow(&self) -> bool {
        false
    }
}

impl Command for Request {
    fn name(&self) -> &'static str {
        Request::name(self)
    }
    fn is_slow(&self) -> bool {
        Request::is_slow(self)
    }
}
