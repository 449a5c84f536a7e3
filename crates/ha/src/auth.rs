//! Authentication of the replication channel. CONTRACT (implemented by the ha-link helper):
//!
//! - The secret is a file of 32+ random bytes written hex (64+ hex chars, trailing newline
//!   allowed), mode 0600, owned by the user running the replicas. The lab/agent creates one per
//!   deployment (`/run/pliant/<lab>/repl.secret`); every replica's config names it
//!   (`[replica] repl_secret = "..."`). A file readable by group/other is refused.
//! - Handshake on each new connection, before any [`crate::wire::ReplMsg`]: the server sends a
//!   32-byte random nonce; the client answers HMAC-SHA256(secret, "pliant-repl-v1" || nonce_s ||
//!   nonce_c) || nonce_c; the server answers HMAC(secret, "pliant-repl-v1-server" || nonce_c ||
//!   nonce_s). Both compare in constant time. A failure closes the connection and is counted.
//!   (Unix sockets are also 0600 and SO_PEERCRED-checked; the HMAC makes the channel safe to
//!   carry over TCP between hosts.)
//!
//! Public API: `Secret::load(path) -> Result<Secret, AuthError>`, `Secret::generate(path)`,
//! `client_handshake(stream, &Secret)`, `server_handshake(stream, &Secret)`.
