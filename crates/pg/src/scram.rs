//! SCRAM-SHA-256 (RFC 5802 with RFC 7677's hash) as PostgreSQL speaks it, both sides:
//! the proxy authenticates its clients with [`ServerExchange`], and [`ClientExchange`] logs
//! the proxy (and the controller's probes) into servers that store SCRAM secrets.
//!
//! PostgreSQL specifics: the user name inside the SCRAM messages is ignored (the startup
//! packet's user counts; libpq sends `n=`). Channel binding (SCRAM-SHA-256-PLUS,
//! `tls-server-end-point` only, as PostgreSQL) when the connection is TLS: the client-final
//! message must carry the GS2 header and the hash of the server certificate ([`Binding`]);
//! a client that says "I could bind but you did not offer it" (`y`) while PLUS was offered is
//! refused (a downgrade). SASLprep is not applied: for the ASCII passwords the proxy is
//! configured with it is the identity (PostgreSQL itself falls back to the raw bytes when
//! SASLprep fails).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

pub const MECHANISM: &str = "SCRAM-SHA-256";
/// The channel-binding variant (offered over TLS only).
pub const MECHANISM_PLUS: &str = "SCRAM-SHA-256-PLUS";
/// The only channel binding type PostgreSQL (and the proxy) supports.
pub const CB_TYPE: &str = "tls-server-end-point";
/// PostgreSQL's default `scram_iterations`.
pub const ITERATIONS: u32 = 4096;
/// Upper bound on iterations a server may ask of our client (CPU the server can make us burn).
pub const MAX_ITERATIONS: u32 = 1 << 20;

/// What was wrong with a SCRAM exchange.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    #[error("malformed SCRAM message: {0}")]
    Malformed(&'static str),
    #[error("channel binding requested but not offered")]
    ChannelBinding,
    #[error("SCRAM channel binding negotiation error: the client supports channel binding but thinks the server does not; this server does")]
    Downgrade,
    #[error("SCRAM-SHA-256-PLUS selected without channel binding data, or an unsupported channel binding type (only tls-server-end-point)")]
    BindingType,
    #[error("SCRAM channel binding check failed")]
    BindingMismatch,
    #[error("SCRAM nonce mismatch")]
    Nonce,
    #[error("SCRAM proof does not match (wrong password)")]
    Proof,
    #[error("server signature does not match")]
    ServerSignature,
}

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], msg: &[u8]) -> [u8; 32] {
    // new_from_slice only fails for fixed-size keys; HMAC takes keys of any length.
    let mut m = match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => return [0; 32],
    };
    m.update(msg);
    m.finalize().into_bytes().into()
}

fn salted_password(password: &str, salt: &[u8], iterations: u32) -> [u8; 32] {
    let mut out = [0u8; 32];
    pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), salt, iterations, &mut out);
    out
}

use crate::secrets::ct_eq;

/// The verifier a server keeps for one password (what `pg_authid` stores for SCRAM).
#[derive(Clone, Debug)]
pub struct Secret {
    pub salt: Vec<u8>,
    pub iterations: u32,
    pub stored_key: [u8; 32],
    pub server_key: [u8; 32],
}

impl Secret {
    pub fn new(password: &str, salt: &[u8], iterations: u32) -> Secret {
        let sp = salted_password(password, salt, iterations);
        let client_key = hmac(&sp, b"Client Key");
        Secret {
            salt: salt.to_vec(),
            iterations,
            stored_key: Sha256::digest(client_key).into(),
            server_key: hmac(&sp, b"Server Key"),
        }
    }
}

/// Splits `k=value` attributes of a SCRAM message.
fn attr(part: &str, key: char) -> Option<&str> {
    let mut ch = part.chars();
    (ch.next() == Some(key) && ch.next() == Some('=')).then(|| &part[2..])
}

fn valid_nonce(n: &str) -> bool {
    !n.is_empty() && n.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b',')
}

/// Channel binding as far as the server's offer and the client's choice of mechanism go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Binding {
    /// No TLS: only SCRAM-SHA-256 was offered.
    NotOffered,
    /// SCRAM-SHA-256-PLUS was offered, the client picked SCRAM-SHA-256.
    Declined,
    /// The client picked SCRAM-SHA-256-PLUS: the `tls-server-end-point` data it must bind.
    Plus(Vec<u8>),
}

/// Server side of one exchange, between the client-first and the client-final message.
#[derive(Debug)]
pub struct ServerExchange {
    stored_key: [u8; 32],
    server_key: [u8; 32],
    /// GS2 header followed by the channel binding data: what `c=` must encode.
    cbind_input: Vec<u8>,
    nonce: String,
    client_first_bare: String,
    server_first: String,
}

impl ServerExchange {
    /// Parses the client-first-message; returns the exchange and the server-first-message.
    /// `server_nonce` must be fresh random printable text without commas.
    pub fn start(
        secret: &Secret,
        client_first: &str,
        server_nonce: &str,
    ) -> Result<(ServerExchange, String), ScramError> {
        Self::start_bound(secret, client_first, server_nonce, &Binding::NotOffered)
    }

    /// Like `start`, given what was offered and picked (see [`Binding`]).
    pub fn start_bound(
        secret: &Secret,
        client_first: &str,
        server_nonce: &str,
        binding: &Binding,
    ) -> Result<(ServerExchange, String), ScramError> {
        let mut it = client_first.splitn(3, ',');
        let flag = it.next().ok_or(ScramError::Malformed("gs2 header"))?;
        let authzid = it.next().ok_or(ScramError::Malformed("gs2 header"))?;
        let bare = it
            .next()
            .ok_or(ScramError::Malformed("client-first-message"))?;
        let cb_data: &[u8] = match (flag, binding) {
            ("n", Binding::NotOffered | Binding::Declined) | ("y", Binding::NotOffered) => &[],
            ("y", Binding::Declined) => return Err(ScramError::Downgrade),
            (f, Binding::Plus(data)) if f.strip_prefix("p=") == Some(CB_TYPE) => data,
            ("n" | "y", Binding::Plus(_)) => return Err(ScramError::BindingType),
            (f, Binding::Plus(_)) if f.starts_with("p=") => return Err(ScramError::BindingType),
            (f, _) if f.starts_with("p=") => return Err(ScramError::ChannelBinding),
            _ => return Err(ScramError::Malformed("channel binding flag")),
        };
        if !authzid.is_empty() && attr(authzid, 'a').is_none() {
            return Err(ScramError::Malformed("authzid"));
        }
        let mut parts = bare.split(',');
        let user = parts.next().ok_or(ScramError::Malformed("user"))?;
        if attr(user, 'n').is_none() {
            // Also catches the mandatory-extension attribute `m=`, which nobody defines.
            return Err(ScramError::Malformed("user attribute"));
        }
        let cnonce = parts
            .next()
            .and_then(|p| attr(p, 'r'))
            .ok_or(ScramError::Malformed("client nonce"))?;
        if !valid_nonce(cnonce) || !valid_nonce(server_nonce) {
            return Err(ScramError::Malformed("nonce characters"));
        }
        let nonce = format!("{cnonce}{server_nonce}");
        let server_first = format!(
            "r={nonce},s={},i={}",
            B64.encode(&secret.salt),
            secret.iterations
        );
        Ok((
            ServerExchange {
                stored_key: secret.stored_key,
                server_key: secret.server_key,
                cbind_input: [format!("{flag},{authzid},").as_bytes(), cb_data].concat(),
                nonce,
                client_first_bare: bare.to_string(),
                server_first: server_first.clone(),
            },
            server_first,
        ))
    }

    /// Verifies the client-final-message; returns the server-final-message (`v=...`).
    pub fn finish(&self, client_final: &str) -> Result<String, ScramError> {
        let (without_proof, proof) = client_final
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("client proof"))?;
        let mut parts = without_proof.split(',');
        let cbind = parts
            .next()
            .and_then(|p| attr(p, 'c'))
            .ok_or(ScramError::Malformed("channel binding attribute"))?;
        if !ct_eq(cbind.as_bytes(), B64.encode(&self.cbind_input).as_bytes()) {
            return Err(ScramError::BindingMismatch);
        }
        let nonce = parts
            .next()
            .and_then(|p| attr(p, 'r'))
            .ok_or(ScramError::Malformed("nonce attribute"))?;
        if nonce != self.nonce {
            return Err(ScramError::Nonce);
        }
        let proof = B64
            .decode(proof)
            .map_err(|_| ScramError::Malformed("proof encoding"))?;
        if proof.len() != 32 {
            return Err(ScramError::Malformed("proof length"));
        }
        let auth_message = format!(
            "{},{},{without_proof}",
            self.client_first_bare, self.server_first
        );
        let client_sig = hmac(&self.stored_key, auth_message.as_bytes());
        let client_key: Vec<u8> = proof.iter().zip(client_sig).map(|(a, b)| a ^ b).collect();
        let stored: [u8; 32] = Sha256::digest(&client_key).into();
        if !ct_eq(&stored, &self.stored_key) {
            return Err(ScramError::Proof);
        }
        let server_sig = hmac(&self.server_key, auth_message.as_bytes());
        Ok(format!("v={}", B64.encode(server_sig)))
    }
}

/// What a client does about channel binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientBinding {
    /// Cannot bind (no TLS): `n`.
    None,
    /// Could bind, but the server did not offer SCRAM-SHA-256-PLUS: `y`.
    NotOffered,
    /// Binds to this `tls-server-end-point` data: SCRAM-SHA-256-PLUS.
    Plus(Vec<u8>),
}

impl ClientBinding {
    pub fn mechanism(&self) -> &'static str {
        match self {
            ClientBinding::Plus(_) => MECHANISM_PLUS,
            _ => MECHANISM,
        }
    }
}

/// Client side of one exchange.
#[derive(Debug)]
pub struct ClientExchange {
    password: String,
    client_first_bare: String,
    /// GS2 header and channel binding data (`c=` of the client-final message).
    cbind_input: Vec<u8>,
    client_nonce: String,
    expected_server_sig: Option<[u8; 32]>,
}

impl ClientExchange {
    /// Starts an exchange; returns it and the client-first-message (`n,,n=,r=<nonce>`).
    pub fn new(password: &str, client_nonce: &str) -> (ClientExchange, String) {
        Self::new_bound(password, client_nonce, &ClientBinding::None)
    }

    /// Starts an exchange with channel binding as given (the mechanism to name in the
    /// SASLInitialResponse is [`ClientBinding::mechanism`]).
    pub fn new_bound(
        password: &str,
        client_nonce: &str,
        cb: &ClientBinding,
    ) -> (ClientExchange, String) {
        let (gs2, data): (String, &[u8]) = match cb {
            ClientBinding::None => ("n,,".into(), &[]),
            ClientBinding::NotOffered => ("y,,".into(), &[]),
            ClientBinding::Plus(d) => (format!("p={CB_TYPE},,"), d),
        };
        let bare = format!("n=,r={client_nonce}");
        let first = format!("{gs2}{bare}");
        (
            ClientExchange {
                password: password.to_string(),
                client_first_bare: bare,
                cbind_input: [gs2.as_bytes(), data].concat(),
                client_nonce: client_nonce.to_string(),
                expected_server_sig: None,
            },
            first,
        )
    }

    /// Answers the server-first-message with the client-final-message.
    pub fn respond(&mut self, server_first: &str) -> Result<String, ScramError> {
        let mut parts = server_first.split(',');
        let nonce = parts
            .next()
            .and_then(|p| attr(p, 'r'))
            .ok_or(ScramError::Malformed("server nonce"))?;
        if !nonce.starts_with(&self.client_nonce) || nonce.len() == self.client_nonce.len() {
            return Err(ScramError::Nonce);
        }
        let salt = parts
            .next()
            .and_then(|p| attr(p, 's'))
            .and_then(|s| B64.decode(s).ok())
            .ok_or(ScramError::Malformed("salt"))?;
        let iterations: u32 = parts
            .next()
            .and_then(|p| attr(p, 'i'))
            .and_then(|s| s.parse().ok())
            .filter(|i| (1..=MAX_ITERATIONS).contains(i))
            .ok_or(ScramError::Malformed("iteration count"))?;
        let sp = salted_password(&self.password, &salt, iterations);
        let client_key = hmac(&sp, b"Client Key");
        let stored: [u8; 32] = Sha256::digest(client_key).into();
        // "biws" = base64("n,,") without channel binding.
        let without_proof = format!("c={},r={nonce}", B64.encode(&self.cbind_input));
        let auth_message = format!("{},{server_first},{without_proof}", self.client_first_bare);
        let client_sig = hmac(&stored, auth_message.as_bytes());
        let proof: Vec<u8> = client_key
            .iter()
            .zip(client_sig)
            .map(|(a, b)| a ^ b)
            .collect();
        self.expected_server_sig = Some(hmac(&hmac(&sp, b"Server Key"), auth_message.as_bytes()));
        Ok(format!("{without_proof},p={}", B64.encode(proof)))
    }

    /// Checks the server-final-message (the server proves it knew the password too).
    pub fn verify(&self, server_final: &str) -> Result<(), ScramError> {
        let v = attr(server_final, 'v').ok_or(ScramError::Malformed("server-final-message"))?;
        let got = B64
            .decode(v)
            .map_err(|_| ScramError::Malformed("server signature encoding"))?;
        match &self.expected_server_sig {
            Some(want) if ct_eq(want, &got) => Ok(()),
            _ => Err(ScramError::ServerSignature),
        }
    }
}

/// A fresh nonce: 18 random bytes, base64 (printable, no commas). An error, never a
/// predictable nonce, when the random source fails.
pub fn new_nonce() -> Result<String, crate::secrets::RandomError> {
    crate::secrets::random_bytes::<18>().map(|b| B64.encode(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    // RFC 7677 section 3: user "user", password "pencil".
    const CNONCE: &str = "rOprNGfwEbeRWgbNEkqO";
    const SNONCE: &str = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0";
    const SALT_B64: &str = "W22ZaJ0SNY7soEsUEjb6gQ==";
    const CLIENT_FINAL: &str = "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=";
    const SERVER_FINAL: &str = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=";

    fn rfc_secret() -> Secret {
        Secret::new("pencil", &B64.decode(SALT_B64).unwrap(), 4096)
    }

    #[test]
    fn rfc7677_vector_server_side() {
        let (ex, sf) =
            ServerExchange::start(&rfc_secret(), &format!("n,,n=user,r={CNONCE}"), SNONCE).unwrap();
        assert_eq!(sf, format!("r={CNONCE}{SNONCE},s={SALT_B64},i=4096"));
        assert_eq!(ex.finish(CLIENT_FINAL).unwrap(), SERVER_FINAL);
    }

    #[test]
    fn rfc7677_vector_client_side() {
        // The RFC's client sends n=user; ours sends n= (PostgreSQL ignores it), so rebuild
        // the bare message the RFC used to reproduce its proof.
        let (mut c, first) = ClientExchange::new("pencil", CNONCE);
        assert_eq!(first, format!("n,,n=,r={CNONCE}"));
        c.client_first_bare = format!("n=user,r={CNONCE}");
        let fin = c
            .respond(&format!("r={CNONCE}{SNONCE},s={SALT_B64},i=4096"))
            .unwrap();
        assert_eq!(fin, CLIENT_FINAL);
        c.verify(SERVER_FINAL).unwrap();
        assert_eq!(
            c.verify("v=AAAA6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="),
            Err(ScramError::ServerSignature)
        );
    }

    #[test]
    fn round_trip_and_wrong_password() {
        let secret = Secret::new("right", b"0123456789abcdef", ITERATIONS);
        for (pw, ok) in [("right", true), ("wrong", false)] {
            let (mut c, first) = ClientExchange::new(pw, &new_nonce().unwrap());
            let (s, sf) = ServerExchange::start(&secret, &first, &new_nonce().unwrap()).unwrap();
            let cf = c.respond(&sf).unwrap();
            match s.finish(&cf) {
                Ok(v) => {
                    assert!(ok);
                    c.verify(&v).unwrap();
                }
                Err(e) => {
                    assert!(!ok);
                    assert_eq!(e, ScramError::Proof);
                }
            }
        }
    }

    /// One exchange: the client binds as `cb`, the server checks against `sb`.
    fn bound(cb: &ClientBinding, sb: &Binding) -> Result<(), ScramError> {
        let secret = Secret::new("pw", b"0123456789abcdef", ITERATIONS);
        let (mut c, first) = ClientExchange::new_bound("pw", &new_nonce().unwrap(), cb);
        let (s, sf) = ServerExchange::start_bound(&secret, &first, &new_nonce().unwrap(), sb)?;
        let v = s.finish(&c.respond(&sf)?)?;
        c.verify(&v)
    }

    #[test]
    fn channel_binding_is_checked_against_the_certificate_hash() {
        let cert = vec![7u8; 32];
        let plus = |d: &[u8]| ClientBinding::Plus(d.to_vec());
        // PLUS with the server's own certificate hash: accepted.
        assert_eq!(bound(&plus(&cert), &Binding::Plus(cert.clone())), Ok(()));
        // A different hash (a man in the middle terminating TLS with another certificate).
        let mut other = cert.clone();
        other[31] ^= 1;
        assert_eq!(
            bound(&plus(&other), &Binding::Plus(cert.clone())),
            Err(ScramError::BindingMismatch)
        );
        // "y" while PLUS was offered: downgrade; fine where it was not offered.
        assert_eq!(
            bound(&ClientBinding::NotOffered, &Binding::Declined),
            Err(ScramError::Downgrade)
        );
        assert_eq!(
            bound(&ClientBinding::NotOffered, &Binding::NotOffered),
            Ok(())
        );
        // "n" is fine unless the client picked the PLUS mechanism.
        assert_eq!(bound(&ClientBinding::None, &Binding::Declined), Ok(()));
        assert_eq!(
            bound(&ClientBinding::None, &Binding::Plus(cert.clone())),
            Err(ScramError::BindingType)
        );
        // Binding data where none was offered.
        assert_eq!(
            bound(&plus(&cert), &Binding::NotOffered),
            Err(ScramError::ChannelBinding)
        );
        let s = Secret::new("pw", b"salt", ITERATIONS);
        assert_eq!(
            ServerExchange::start_bound(&s, "p=tls-unique,,n=,r=abc", SNONCE, &Binding::Plus(cert))
                .unwrap_err(),
            ScramError::BindingType
        );
    }

    #[test]
    fn client_final_message_encodes_the_gs2_header_and_binding_data() {
        let (mut c, first) =
            ClientExchange::new_bound("pencil", CNONCE, &ClientBinding::Plus(vec![1, 2, 3]));
        assert_eq!(first, format!("p=tls-server-end-point,,n=,r={CNONCE}"));
        let fin = c
            .respond(&format!("r={CNONCE}{SNONCE},s={SALT_B64},i=4096"))
            .unwrap();
        let want = B64.encode(b"p=tls-server-end-point,,\x01\x02\x03");
        assert!(fin.starts_with(&format!("c={want},")), "{fin}");
    }

    #[test]
    fn malformed_messages_are_errors() {
        let s = rfc_secret();
        for bad in [
            "",
            "n",
            "x,,n=,r=abc",
            "n,,r=abc",
            "n,,n=,",
            "n,,n=,r=a b",
            "n,,m=ext,n=,r=abc",
        ] {
            assert!(
                ServerExchange::start(&s, bad, SNONCE).is_err(),
                "accepted {bad:?}"
            );
        }
        assert_eq!(
            ServerExchange::start(&s, "p=tls-unique,,n=,r=abc", SNONCE).unwrap_err(),
            ScramError::ChannelBinding
        );
        let (ex, _) = ServerExchange::start(&s, &format!("n,,n=,r={CNONCE}"), SNONCE).unwrap();
        for bad in [
            "",
            "c=biws,r=x,p=AAAA",
            "c=eSws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=!!",
            "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=AAAA",
        ] {
            assert!(ex.finish(bad).is_err(), "accepted {bad:?}");
        }
        let (mut c, _) = ClientExchange::new("pw", "abc");
        assert_eq!(c.respond("r=xyz,s=AAAA,i=1"), Err(ScramError::Nonce));
        assert!(c.respond("r=abcd,s=AAAA,i=0").is_err());
        assert!(c.respond("r=abcd,s=AAAA,i=999999999").is_err());
        assert!(c.respond("r=abcd,s=@@,i=10").is_err());
    }
}
