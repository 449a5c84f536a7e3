//! Requests to a replica's control channel. On the wire, one JSON object per frame tagged by
//! `"cmd"`: `{"cmd":"stats"}`, `{"cmd":"migrate_out","to":"…","keys":["tcp …"]}`. Unknown
//! fields are ignored (an older replica can be asked by a newer client); unknown commands,
//! missing or mistyped fields and values out of bounds are refused with a message naming
//! them ([`Request::parse`]).

use pliant_ha::policy::Policy;
use pliant_state::FlowKey;
use serde::{Deserialize, Serialize};

/// Flow keys one migration request may name (a `migrate_in` of 20,000 keys is ~1 MiB).
pub const MAX_KEYS_PER_REQUEST: usize = 20_000;
/// Port blocks one `set_port_blocks` may name.
pub const MAX_PORT_BLOCKS: usize = 4096;
/// Longest error text echoed back for a refused request (a 1 MB command name is not).
const MAX_ERROR_TEXT: usize = 300;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    Stats,
    Metrics,
    Query,
    Flows,
    /// Whether this replica's flow table holds `key` (as a primary key or an alias), and if so
    /// its primary key and aliases: one index lookup, so a flow's owner is found at any table
    /// size (`flows` lists at most `max_listed_flows`).
    Flow {
        #[serde(with = "key_str")]
        key: FlowKey,
    },
    Shutdown,
    /// Destination side: hold packets of `keys` until their state arrives from `from`.
    MigrateIn {
        from: String,
        #[serde(with = "key_strs")]
        keys: Vec<FlowKey>,
    },
    /// Destination side: stop holding `keys`, for a migration that never switched over (its
    /// controller died before the steering switch and the successor rolls it back).
    MigrateAbort {
        #[serde(with = "key_strs")]
        keys: Vec<FlowKey>,
    },
    /// Source side: export `keys` and ship them to the peer endpoint `to` (answered when the
    /// destination acknowledged).
    MigrateOut {
        to: String,
        #[serde(with = "key_strs")]
        keys: Vec<FlowKey>,
    },
    /// Source side, ahead of a `migrate_out` to `to`: open (or confirm) the authenticated peer
    /// connection to that endpoint, answered once it is up. A move's source connects to its
    /// destination lazily; the first move to a destination would otherwise run the connect and
    /// the handshake while the destination holds the flows' packets (inside the pause).
    PeerConnect {
        to: String,
    },
    /// NAT: the external port blocks `[lo, hi]` this replica allocates from.
    SetPortBlocks {
        blocks: Vec<(u16, u16)>,
    },
    /// Export this replica's combiner contributions (retires them).
    SharedExport,
    /// Merge a dying replica's exported contributions (hex on the wire).
    SharedMerge {
        #[serde(with = "hex")]
        bytes: Vec<u8>,
    },
    /// HA: replace the replication policy under fencing token `token`.
    Protect {
        token: u64,
        policy: Box<Policy>,
    },
    /// HA: groups, held output, standby state held for others.
    HaStatus,
    /// HA (backup): make `primary`'s standby state live here.
    Activate {
        primary: String,
        token: u64,
    },
    /// HA (backup): forget `primary`'s standby state.
    DropStandby {
        primary: String,
    },
    /// HA: this replica failed over while it was alive but cut off (a partition). Its flows
    /// live on elsewhere now: it drops every flow, every held or queued packet and every HA
    /// group and standby copy, takes `token`, and is an empty member again (the controller
    /// then protects it and uses it as a backup). Refused with a token older than the
    /// replica's, and in FTMB mode.
    Rejoin {
        token: u64,
    },
    /// FTMB: log to the logger at `logger` (a unix path or TCP `host:port`). With `host` (the
    /// replica hosting it), the logger must prove that name in the handshake.
    FtmbProtect {
        logger: String,
        #[serde(default)]
        host: Option<String>,
    },
    /// FTMB: workers, logger, snapshots, hosted logs, recoveries.
    FtmbStatus,
    /// FTMB (logger host): recover `primary` by replay and import its flows.
    FtmbActivate {
        primary: String,
    },
    /// FTMB (logger host): hold arriving packets now, for `primary`'s activation to come.
    FtmbHold {
        primary: String,
    },
}

/// The request body on the wire: the request's JSON object, with the sending controller's
/// leadership term as a `"term"` field when it has one.
pub fn encode<R: serde::Serialize>(req: &R, term: Option<u64>) -> Result<Vec<u8>, String> {
    let body = serde_json::to_vec(req).map_err(|e| format!("encode: {e}"))?;
    let Some(t) = term else { return Ok(body) };
    // An internally tagged enum always serialises as a non-empty object (`{"cmd":...}`), so
    // the term goes in as its first field without re-encoding the (maybe large) rest.
    debug_assert!(body.starts_with(b"{\"cmd\""));
    let mut out = Vec::with_capacity(body.len() + 32);
    out.extend_from_slice(format!("{{\"term\":{t},").as_bytes());
    out.extend_from_slice(&body[1..]);
    Ok(out)
}

/// The `"term"` of a request body, if it has one: the sender's leadership term. The replica
/// remembers the highest term it has seen and refuses requests of a lower one, so a controller
/// that lost its leadership (and may not know it yet) cannot act on replicas any more. A
/// second, skipping pass over the body: [`Request::parse`] ignores the field.
pub fn term_of(body: &[u8]) -> Result<Option<u64>, String> {
    #[derive(Deserialize)]
    struct TermOnly {
        #[serde(default)]
        term: Option<u64>,
    }
    serde_json::from_slice::<TermOnly>(body)
        .map(|t| t.term)
        .map_err(|_| "bad request: \"term\" must be a non-negative integer".to_string())
}

impl Request {
    /// Decodes and checks one request body.
    pub fn parse(body: &[u8]) -> Result<Request, String> {
        let r: Request = serde_json::from_slice(body).map_err(|e| {
            let mut m = e.to_string();
            if m.len() > MAX_ERROR_TEXT {
                let mut cut = MAX_ERROR_TEXT;
                while !m.is_char_boundary(cut) {
                    cut -= 1;
                }
                m.truncate(cut);
                m.push('…');
            }
            format!("bad request: {m}")
        })?;
        r.check()?;
        Ok(r)
    }

    /// The bounds serde does not express.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Request::MigrateIn { keys, .. }
            | Request::MigrateOut { keys, .. }
            | Request::MigrateAbort { keys }
                if keys.len() > MAX_KEYS_PER_REQUEST =>
            {
                Err(format!(
                    "{} keys exceed the bound of {MAX_KEYS_PER_REQUEST} per request",
                    keys.len()
                ))
            }
            Request::SetPortBlocks { blocks } => {
                if blocks.len() > MAX_PORT_BLOCKS {
                    return Err(format!("more than {MAX_PORT_BLOCKS} port blocks"));
                }
                match blocks.iter().find(|(lo, hi)| *lo == 0 || lo > hi) {
                    Some((lo, hi)) => {
                        Err(format!("bad port block [{lo}, {hi}]: need 1 <= lo <= hi"))
                    }
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    /// The command's name as on the wire (for messages and counters).
    pub fn name(&self) -> &'static str {
        match self {
            Request::Stats => "stats",
            Request::Metrics => "metrics",
            Request::Query => "query",
            Request::Flows => "flows",
            Request::Flow { .. } => "flow",
            Request::Shutdown => "shutdown",
            Request::MigrateIn { .. } => "migrate_in",
            Request::MigrateAbort { .. } => "migrate_abort",
            Request::MigrateOut { .. } => "migrate_out",
            Request::PeerConnect { .. } => "peer_connect",
            Request::SetPortBlocks { .. } => "set_port_blocks",
            Request::SharedExport => "shared_export",
            Request::SharedMerge { .. } => "shared_merge",
            Request::Protect { .. } => "protect",
            Request::HaStatus => "ha_status",
            Request::Activate { .. } => "activate",
            Request::DropStandby { .. } => "drop_standby",
            Request::Rejoin { .. } => "rejoin",
            Request::FtmbProtect { .. } => "ftmb_protect",
            Request::FtmbStatus => "ftmb_status",
            Request::FtmbActivate { .. } => "ftmb_activate",
            Request::FtmbHold { .. } => "ftmb_hold",
        }
    }

    /// Requests that may take seconds to answer (the client waits longer for them).
    pub fn is_slow(&self) -> bool {
        matches!(
            self,
            Request::MigrateOut { .. }
                | Request::PeerConnect { .. }
                | Request::FtmbProtect { .. }
                | Request::FtmbActivate { .. }
        )
    }
}

/// Decodes lowercase/uppercase hex; `None` on odd length or a non-hex digit.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A flow key as its text form (`tcp 10.0.0.1:1 <-> 10.0.0.2:2`).
pub mod key_str {
    use pliant_state::FlowKey;
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(k: &FlowKey, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(k)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<FlowKey, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(|e| D::Error::custom(format!("{e}")))
    }
}

/// A list of flow keys in text form, bounded while it is decoded.
pub mod key_strs {
    use pliant_state::FlowKey;
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::ser::SerializeSeq;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(keys: &[FlowKey], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(keys.len()))?;
        for k in keys {
            seq.serialize_element(&k.to_string())?;
        }
        seq.end()
    }

    struct Keys;

    impl<'de> Visitor<'de> for Keys {
        type Value = Vec<FlowKey>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(
                f,
                "an array of at most {} flow keys",
                super::MAX_KEYS_PER_REQUEST
            )
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Vec<FlowKey>, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = a.next_element::<String>()? {
                if out.len() == super::MAX_KEYS_PER_REQUEST {
                    return Err(A::Error::custom(format!(
                        "more keys than the bound of {} per request",
                        super::MAX_KEYS_PER_REQUEST
                    )));
                }
                out.push(s.parse().map_err(|e| A::Error::custom(format!("{e}")))?);
            }
            Ok(out)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<FlowKey>, D::Error> {
        d.deserialize_seq(Keys)
    }
}

/// Bytes as a hex string.
pub mod hex {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::to_hex(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        super::from_hex(&s).ok_or_else(|| D::Error::custom("not hex"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Request, String> {
        Request::parse(s.as_bytes())
    }

    #[test]
    fn the_term_travels_beside_the_request_and_is_read_back() {
        let big = Request::MigrateIn {
            from: "r1".into(),
            keys: (0..500u16)
                .map(|p| {
                    format!("tcp 10.0.0.1:{} <-> 10.0.1.1:80", 1000 + p)
                        .parse()
                        .unwrap()
                })
                .collect(),
        };
        for req in [Request::Stats, big] {
            let plain = encode(&req, None).unwrap();
            assert_eq!(term_of(&plain), Ok(None));
            assert_eq!(Request::parse(&plain).unwrap(), req);
            for t in [0, 7, u64::MAX] {
                let with = encode(&req, Some(t)).unwrap();
                assert_eq!(term_of(&with), Ok(Some(t)));
                assert_eq!(
                    Request::parse(&with).unwrap(),
                    req,
                    "the term is not the request's"
                );
            }
        }
        for bad in [
            &br#"{"term":-1,"cmd":"stats"}"#[..],
            br#"{"term":"7","cmd":"stats"}"#,
            br#"{"term":1.5,"cmd":"stats"}"#,
        ] {
            assert!(term_of(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn parses_known_commands_and_refuses_the_rest() {
        assert_eq!(p(r#"{"cmd":"stats"}"#), Ok(Request::Stats));
        assert_eq!(p(r#"{"cmd":"flows","x":1}"#), Ok(Request::Flows));
        assert!(p(r#"{"cmd":"reboot"}"#)
            .unwrap_err()
            .contains("unknown variant"));
        assert!(p(r#"{"cmd":3}"#).is_err());
        let k = "tcp 10.0.0.1:1 <-> 10.0.0.2:2";
        assert_eq!(
            p(&format!(
                r#"{{"cmd":"migrate_out","to":"/p","keys":["{k}"]}}"#
            )),
            Ok(Request::MigrateOut {
                to: "/p".into(),
                keys: vec![k.parse().unwrap()]
            })
        );
        assert_eq!(
            p(&format!(r#"{{"cmd":"flow","key":"{k}"}}"#)),
            Ok(Request::Flow {
                key: k.parse().unwrap()
            })
        );
        assert!(p(r#"{"cmd":"flow"}"#).is_err());
        assert!(p(r#"{"cmd":"flow","key":"tcp nowhere"}"#).is_err());
        assert!(p(r#"{"cmd":"migrate_in","keys":[]}"#).is_err());
        assert!(p(r#"{"cmd":"migrate_in","from":"a","keys":["x"]}"#).is_err());
        assert!(p(r#"{"cmd":"migrate_in","from":"a","keys":[1]}"#).is_err());
        assert_eq!(
            p(r#"{"cmd":"set_port_blocks","blocks":[[1024,2047]]}"#),
            Ok(Request::SetPortBlocks {
                blocks: vec![(1024, 2047)]
            })
        );
        assert!(p(r#"{"cmd":"set_port_blocks","blocks":[[5,1]]}"#).is_err());
        assert!(p(r#"{"cmd":"set_port_blocks","blocks":[[0,1]]}"#).is_err());
        assert!(p(r#"{"cmd":"set_port_blocks","blocks":[[1,70000]]}"#).is_err());
        assert_eq!(
            p(r#"{"cmd":"shared_merge","bytes":"00ff"}"#),
            Ok(Request::SharedMerge {
                bytes: vec![0, 255]
            })
        );
        assert!(p(r#"{"cmd":"shared_merge","bytes":"0g"}"#).is_err());
        let r = p(r#"{"cmd":"protect","token":3,"policy":{"kind":"single","backup":{"name":"r2","socket":"/s"},"hz":1000}}"#)
            .unwrap();
        assert!(matches!(r, Request::Protect { token: 3, .. }));
        assert!(p(r#"{"cmd":"protect","token":3,"policy":{"kind":"nope"}}"#).is_err());
        assert!(p(r#"{"cmd":"protect","policy":{"kind":"off"}}"#).is_err());
        assert_eq!(p(r#"{"cmd":"ha_status"}"#), Ok(Request::HaStatus));
        assert_eq!(
            p(r#"{"cmd":"activate","primary":"r1","token":4}"#),
            Ok(Request::Activate {
                primary: "r1".into(),
                token: 4
            })
        );
        assert!(p(r#"{"cmd":"activate","primary":"r1","token":-1}"#).is_err());
        assert_eq!(
            p(r#"{"cmd":"ftmb_protect","logger":"/run/x/r2.ftmb.sock"}"#),
            Ok(Request::FtmbProtect {
                logger: "/run/x/r2.ftmb.sock".into(),
                host: None,
            })
        );
        assert_eq!(
            p(r#"{"cmd":"ftmb_protect","logger":"10.0.0.2:7400","host":"r2"}"#),
            Ok(Request::FtmbProtect {
                logger: "10.0.0.2:7400".into(),
                host: Some("r2".into()),
            })
        );
        assert!(p(r#"{"cmd":"ftmb_protect","logger":"/x","host":2}"#).is_err());
        assert!(p(r#"{"cmd":"ftmb_protect"}"#).is_err());
        assert!(p(r#"{"cmd":"ftmb_activate","primary":3}"#).is_err());
        assert!(p("not json").is_err());
        let long = p(&format!(r#"{{"cmd":"{}"}}"#, "x".repeat(1000))).unwrap_err();
        assert!(
            long.len() < 400,
            "the echoed command name is cut short: {long}"
        );
    }

    #[test]
    fn every_request_round_trips_through_its_wire_form() {
        let k: FlowKey = "udp 10.0.0.1:5 <-> 10.0.0.9:53".parse().unwrap();
        let all = vec![
            Request::Stats,
            Request::Metrics,
            Request::Query,
            Request::Flows,
            Request::Flow { key: k },
            Request::Shutdown,
            Request::MigrateIn {
                from: "r1".into(),
                keys: vec![k],
            },
            Request::MigrateOut {
                to: "10.254.0.2:7401".into(),
                keys: vec![k, k],
            },
            Request::PeerConnect {
                to: "10.254.0.2:7401".into(),
            },
            Request::SetPortBlocks {
                blocks: vec![(1024, 2047)],
            },
            Request::SharedExport,
            Request::SharedMerge {
                bytes: vec![1, 2, 255],
            },
            Request::Protect {
                token: 9,
                policy: Box::new(Policy::Off),
            },
            Request::HaStatus,
            Request::Activate {
                primary: "r2".into(),
                token: 3,
            },
            Request::DropStandby {
                primary: "r2".into(),
            },
            Request::Rejoin { token: 7 },
            Request::FtmbProtect {
                logger: "/run/l.sock".into(),
                host: Some("r3".into()),
            },
            Request::FtmbStatus,
            Request::FtmbActivate {
                primary: "r1".into(),
            },
            Request::FtmbHold {
                primary: "r1".into(),
            },
        ];
        for r in all {
            let body = serde_json::to_vec(&r).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["cmd"], r.name(), "{v}");
            assert_eq!(Request::parse(&body), Ok(r));
        }
    }

    #[test]
    fn key_lists_over_the_bound_are_refused_while_decoding() {
        let k = "tcp 10.0.0.1:1 <-> 10.0.0.2:2";
        let keys: Vec<&str> = vec![k; MAX_KEYS_PER_REQUEST + 1];
        let body = serde_json::json!({"cmd": "migrate_in", "from": "a", "keys": keys});
        let e = Request::parse(body.to_string().as_bytes()).unwrap_err();
        assert!(e.contains("bound"), "{e}");
    }
}
