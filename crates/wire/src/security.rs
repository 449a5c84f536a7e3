//! What a process brings to every channel: its identity, the encryption policy, the
//! handshake deadline and the TCP tuning. Built once from the config (`[security]` in a
//! replica's config) and handed to each channel, which adds what it expects of its peer.

use crate::endpoint::{Endpoint, TcpTuning};
use crate::identity::{Identity, IdentityError};
use crate::session::{Expect, SessionOptions};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// When frames are encrypted (they are always authenticated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encrypt {
    /// Over TCP (between hosts); unix sockets only authenticate (the data never leaves the
    /// kernel of one machine).
    #[default]
    Auto,
    Always,
    Never,
}

impl std::str::FromStr for Encrypt {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Encrypt::Auto),
            "always" => Ok(Encrypt::Always),
            "never" => Ok(Encrypt::Never),
            _ => Err(format!("encrypt = {s:?}: expected auto, always or never")),
        }
    }
}

/// Default whole-handshake deadline: a LAN round trip is well under a millisecond, but a
/// handshake may meet a loaded peer; a trickling peer is cut at this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Clone, Debug)]
pub struct Security {
    pub identity: Arc<Identity>,
    pub encrypt: Encrypt,
    pub handshake_timeout: Duration,
    pub tcp: TcpTuning,
}

impl Security {
    pub fn new(identity: Identity) -> Security {
        Security {
            identity: Arc::new(identity),
            encrypt: Encrypt::Auto,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            tcp: TcpTuning::default(),
        }
    }

    /// Loads the identity directory `dir` (see [`crate::identity`]).
    pub fn load(dir: &Path, encrypt: Encrypt) -> Result<Security, IdentityError> {
        let mut s = Security::new(Identity::load(dir)?);
        s.encrypt = encrypt;
        Ok(s)
    }

    /// Whether frames on a channel over TCP (`tcp`) or a unix socket are encrypted by this
    /// side's policy.
    pub fn encrypts(&self, tcp: bool) -> bool {
        match self.encrypt {
            Encrypt::Auto => tcp,
            Encrypt::Always => true,
            Encrypt::Never => false,
        }
    }

    /// Session options for a channel over `ep` requiring `expect` of the peer.
    pub fn options(&self, ep: &Endpoint, expect: Expect, max_body: usize) -> SessionOptions {
        self.options_for(ep.is_tcp(), expect, max_body)
    }

    /// [`Security::options`] for an accepted stream (TCP or not).
    pub fn options_for(&self, tcp: bool, expect: Expect, max_body: usize) -> SessionOptions {
        SessionOptions {
            encrypt: self.encrypts(tcp),
            max_body,
            handshake_timeout: self.handshake_timeout,
            expect,
        }
    }

    pub fn name(&self) -> &str {
        self.identity.name()
    }
}
