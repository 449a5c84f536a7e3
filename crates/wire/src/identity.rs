//! Per-node identities: an Ed25519 key per node, and a certificate binding the node's name and
//! roles to that key, signed by the deployment's CA key.
//!
//! Why certificates and not one shared secret: with a shared secret, anyone holding it (every
//! replica) can claim to be anyone. Here a replica holds only its own private key; a peer
//! believes a name only if the CA signed it for that key, and the CA's private key stays with
//! whoever provisions nodes (the lab, a host agent), never on the replicas. Why not X.509: the
//! certificate is four fields, and the only verifier is pliant itself; a 150-byte postcard
//! record signed with Ed25519 (ring) needs no ASN.1 parser on the connection path.
//!
//! Files of one node's identity directory (all hex, one line):
//! - `node.key`: the node's Ed25519 key (PKCS#8), mode 0600, owned by the node's user;
//! - `node.cert`: its certificate (public);
//! - `ca.pub`: the CA's public key (public), to verify peers' certificates.
//!
//! The CA's own directory holds `ca.key` (0600) and `ca.pub`.

use crate::keyfile::{self, KeyFileError};
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Roles a certificate grants; each channel checks the one it needs.
pub mod role {
    /// Runs NF replicas: may replicate, log and migrate as itself.
    pub const REPLICA: u32 = 1;
    /// Drives replicas (control commands).
    pub const CONTROLLER: u32 = 2;
    /// An operator's CLI: control and inspection.
    pub const ADMIN: u32 = 4;
    /// A host agent.
    pub const AGENT: u32 = 8;
    /// A shared-state hub (coherence) or FTMB logger service.
    pub const SERVICE: u32 = 16;
}

/// Longest node name a certificate may carry.
pub const MAX_NAME: usize = 255;
const CERT_LABEL: &str = "pliant-node-cert-v1";

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    File(#[from] KeyFileError),
    #[error("bad key: {0}")]
    BadKey(String),
    #[error("no randomness from the kernel")]
    Random,
    #[error("certificate for {name:?} is not signed by this deployment's CA")]
    NotSigned { name: String },
    #[error("certificate for {name:?} expired at unix time {not_after}")]
    Expired { name: String, not_after: u64 },
    #[error("certificate name {0:?} is empty, too long or not printable")]
    BadName(String),
    #[error("undecodable certificate: {0}")]
    Decode(String),
}

/// A node's certificate: `name` may act with `roles` using `key` until `not_after`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCert {
    pub name: String,
    pub roles: u32,
    pub key: [u8; 32],
    /// Unix seconds.
    pub not_after: u64,
    /// Ed25519 signature of the CA over the fields above.
    pub sig: Vec<u8>,
}

fn cert_tbs(name: &str, roles: u32, key: &[u8; 32], not_after: u64) -> Vec<u8> {
    postcard::to_allocvec(&(CERT_LABEL, name, roles, key, not_after))
        .unwrap_or_else(|_| unreachable!("postcard encodes these fields into a Vec"))
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= MAX_NAME && n.chars().all(|c| c.is_ascii_graphic())
}

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl NodeCert {
    /// Checks the CA's signature and the expiry.
    pub fn verify(&self, ca_pub: &[u8; 32], now: u64) -> Result<(), IdentityError> {
        if !valid_name(&self.name) {
            return Err(IdentityError::BadName(self.name.chars().take(64).collect()));
        }
        let tbs = cert_tbs(&self.name, self.roles, &self.key, self.not_after);
        UnparsedPublicKey::new(&ED25519, ca_pub)
            .verify(&tbs, &self.sig)
            .map_err(|_| IdentityError::NotSigned {
                name: self.name.clone(),
            })?;
        if now > self.not_after {
            return Err(IdentityError::Expired {
                name: self.name.clone(),
                not_after: self.not_after,
            });
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self)
            .unwrap_or_else(|_| unreachable!("postcard encodes a cert into a Vec"))
    }

    pub fn from_bytes(b: &[u8]) -> Result<NodeCert, IdentityError> {
        postcard::from_bytes(b).map_err(|e| IdentityError::Decode(e.to_string()))
    }
}

/// The deployment's certificate authority (only where nodes are provisioned).
pub struct Ca {
    pair: Ed25519KeyPair,
}

impl Ca {
    /// A fresh CA; `dir/ca.key` (0600) and `dir/ca.pub` are written when `dir` is given.
    pub fn generate(dir: Option<&Path>) -> Result<Ca, IdentityError> {
        let rng = SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| IdentityError::Random)?;
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
            .map_err(|e| IdentityError::BadKey(e.to_string()))?;
        if let Some(d) = dir {
            keyfile::write_new(&d.join("ca.key"), pkcs8.as_ref(), true)?;
            keyfile::write_new(&d.join("ca.pub"), pair.public_key().as_ref(), false)?;
        }
        Ok(Ca { pair })
    }

    pub fn load(dir: &Path) -> Result<Ca, IdentityError> {
        let k = keyfile::read_private(&dir.join("ca.key"))?;
        let pair =
            Ed25519KeyPair::from_pkcs8(&k).map_err(|e| IdentityError::BadKey(e.to_string()))?;
        Ok(Ca { pair })
    }

    pub fn public(&self) -> [u8; 32] {
        let mut p = [0u8; 32];
        p.copy_from_slice(self.pair.public_key().as_ref());
        p
    }

    /// A new identity for `name` with `roles`, valid for `valid_secs`, held in memory (tests,
    /// or a provisioner that ships it elsewhere).
    pub fn issue(
        &self,
        name: &str,
        roles: u32,
        valid_secs: u64,
    ) -> Result<Identity, IdentityError> {
        if !valid_name(name) {
            return Err(IdentityError::BadName(name.chars().take(64).collect()));
        }
        let rng = SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|_| IdentityError::Random)?;
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
            .map_err(|e| IdentityError::BadKey(e.to_string()))?;
        let mut key = [0u8; 32];
        key.copy_from_slice(pair.public_key().as_ref());
        let not_after = now_unix().saturating_add(valid_secs);
        let sig = self.pair.sign(&cert_tbs(name, roles, &key, not_after));
        Ok(Identity {
            cert: NodeCert {
                name: name.into(),
                roles,
                key,
                not_after,
                sig: sig.as_ref().to_vec(),
            },
            pair,
            pkcs8: pkcs8.as_ref().to_vec(),
            ca_pub: self.public(),
        })
    }

    /// [`Ca::issue`] and write the identity directory `dir` (created; `node.key` 0600).
    pub fn issue_to(
        &self,
        dir: &Path,
        name: &str,
        roles: u32,
        valid_secs: u64,
    ) -> Result<Identity, IdentityError> {
        let id = self.issue(name, roles, valid_secs)?;
        std::fs::create_dir_all(dir).map_err(|source| KeyFileError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        keyfile::write_new(&dir.join("node.key"), &id.pkcs8, true)?;
        keyfile::write_new(&dir.join("node.cert"), &id.cert.to_bytes(), false)?;
        keyfile::write_new(&dir.join("ca.pub"), &id.ca_pub, false)?;
        Ok(id)
    }
}

/// What a node proves itself with and verifies peers against.
pub struct Identity {
    pub cert: NodeCert,
    pair: Ed25519KeyPair,
    pkcs8: Vec<u8>,
    pub ca_pub: [u8; 32],
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Identity({:?}, roles {:#x})",
            self.cert.name, self.cert.roles
        )
    }
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            cert: self.cert.clone(),
            pair: Ed25519KeyPair::from_pkcs8(&self.pkcs8)
                .unwrap_or_else(|_| unreachable!("parsed once already")),
            pkcs8: self.pkcs8.clone(),
            ca_pub: self.ca_pub,
        }
    }
}

impl Drop for Identity {
    fn drop(&mut self) {
        for b in self.pkcs8.iter_mut() {
            // SAFETY: `b` is a valid, aligned &mut u8; volatile so the wipe is kept.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl Identity {
    /// Loads `dir/node.key` (mode and owner checked), `dir/node.cert` and `dir/ca.pub`, and
    /// checks that the certificate is the CA's, unexpired, and for this key.
    pub fn load(dir: &Path) -> Result<Identity, IdentityError> {
        let pkcs8 = keyfile::read_private(&dir.join("node.key"))?;
        let pair = Ed25519KeyPair::from_pkcs8(&pkcs8).map_err(|e| {
            IdentityError::BadKey(format!("{}: {e}", dir.join("node.key").display()))
        })?;
        let cert = NodeCert::from_bytes(&keyfile::read_public(&dir.join("node.cert"))?)?;
        let ca = keyfile::read_public(&dir.join("ca.pub"))?;
        let ca_pub: [u8; 32] = ca.as_slice().try_into().map_err(|_| {
            IdentityError::BadKey(format!("{}: not 32 bytes", dir.join("ca.pub").display()))
        })?;
        cert.verify(&ca_pub, now_unix())?;
        if pair.public_key().as_ref() != cert.key {
            return Err(IdentityError::BadKey(format!(
                "{}: node.key is not the key node.cert certifies",
                dir.display()
            )));
        }
        Ok(Identity {
            cert,
            pair,
            pkcs8,
            ca_pub,
        })
    }

    pub fn name(&self) -> &str {
        &self.cert.name
    }

    pub(crate) fn sign(&self, msg: &[u8]) -> Vec<u8> {
        self.pair.sign(msg).as_ref().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_bind_name_roles_and_key_to_the_ca() {
        let ca = Ca::generate(None).unwrap();
        let other = Ca::generate(None).unwrap();
        let id = ca.issue("r1", role::REPLICA, 3600).unwrap();
        id.cert.verify(&ca.public(), now_unix()).unwrap();
        assert!(matches!(
            id.cert.verify(&other.public(), now_unix()),
            Err(IdentityError::NotSigned { .. })
        ));
        let mut renamed = id.cert.clone();
        renamed.name = "r2".into();
        assert!(matches!(
            renamed.verify(&ca.public(), now_unix()),
            Err(IdentityError::NotSigned { .. })
        ));
        let mut promoted = id.cert.clone();
        promoted.roles |= role::CONTROLLER;
        assert!(promoted.verify(&ca.public(), now_unix()).is_err());
        assert!(matches!(
            id.cert.verify(&ca.public(), id.cert.not_after + 1),
            Err(IdentityError::Expired { .. })
        ));
        assert!(matches!(ca.issue("", 1, 1), Err(IdentityError::BadName(_))));
        assert!(matches!(
            ca.issue("a b", 1, 1),
            Err(IdentityError::BadName(_))
        ));
    }

    #[test]
    fn identity_directories_round_trip_and_refuse_mismatches() {
        let d = std::env::temp_dir().join(format!("pliant-wire-id-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let ca = Ca::generate(Some(&d)).unwrap();
        let again = Ca::load(&d).unwrap();
        assert_eq!(again.public(), ca.public());
        ca.issue_to(&d.join("r1"), "r1", role::REPLICA, 3600)
            .unwrap();
        let id = Identity::load(&d.join("r1")).unwrap();
        assert_eq!(id.name(), "r1");
        // Another node's key beside this node's cert is refused.
        ca.issue_to(&d.join("r2"), "r2", role::REPLICA, 3600)
            .unwrap();
        std::fs::remove_file(d.join("r2/node.key")).unwrap();
        std::fs::copy(d.join("r1/node.key"), d.join("r2/node.key")).unwrap();
        assert!(matches!(
            Identity::load(&d.join("r2")),
            Err(IdentityError::BadKey(_))
        ));
        let _ = std::fs::remove_dir_all(d);
    }
}
