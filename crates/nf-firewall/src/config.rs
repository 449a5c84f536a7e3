//! The `[firewall]` section of the replica TOML. Rules live inline, as `[[firewall.rules]]`
//! tables, so one file describes a replica completely and is validated in one place.
//!
//! ```toml
//! [firewall]
//! default_inbound = "deny"      # outside -> inside, no rule matched (default: deny)
//! default_outbound = "allow"    # inside -> outside, no rule matched (default: allow)
//! tcp_established_timeout_s = 3600
//!
//! [[firewall.rules]]            # first match wins, in file order
//! name = "web-in"               # optional, shown in errors and `pliant query`
//! action = "allow"              # allow | deny
//! direction = "inbound"         # inbound (outside->inside) | outbound (inside->outside) | any
//! proto = "tcp"                 # any (default) | tcp | udp | icmp | a protocol number
//! dst = "10.77.1.0/24"          # CIDR or bare address; omitted or "any" = any
//! dst_ports = [80, "8000-8080"] # numbers or "lo-hi" ranges; tcp/udp only; empty = any
//! ```

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Deny,
}

/// Direction of the packet that *opens* a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Outside -> inside.
    #[serde(alias = "outside->inside")]
    Inbound,
    /// Inside -> outside.
    #[serde(alias = "inside->outside")]
    Outbound,
    Any,
}

/// A port or an inclusive range, as written in the file (`80` or `"1000-2000"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortSpec {
    Number(i64),
    Text(String),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: Action,
    pub direction: Direction,
    #[serde(default = "any")]
    pub proto: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub src_ports: Vec<PortSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dst_ports: Vec<PortSpec>,
}

fn any() -> String {
    "any".to_string()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Policy for outside->inside packets of unknown flows that match no rule.
    #[serde(default = "deny")]
    pub default_inbound: Action,
    /// Policy for inside->outside packets of unknown flows that match no rule.
    #[serde(default = "allow")]
    pub default_outbound: Action,
    /// Ordered rules; the first match decides.
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// A TCP flow whose opening SYN has not been answered yet.
    #[serde(default = "d_syn")]
    pub tcp_syn_timeout_s: u64,
    /// Idle timeout of an established TCP flow.
    #[serde(default = "d_est")]
    pub tcp_established_timeout_s: u64,
    /// After the first FIN (half-closed).
    #[serde(default = "d_closing")]
    pub tcp_closing_timeout_s: u64,
    /// After an RST or FINs from both sides: long enough for the last ACK and retransmissions.
    #[serde(default = "d_closed")]
    pub tcp_closed_timeout_s: u64,
    #[serde(default = "d_udp")]
    pub udp_timeout_s: u64,
    #[serde(default = "d_icmp")]
    pub icmp_timeout_s: u64,
    /// Any other IP protocol.
    #[serde(default = "d_udp")]
    pub other_timeout_s: u64,
}

fn deny() -> Action {
    Action::Deny
}
fn allow() -> Action {
    Action::Allow
}
fn d_syn() -> u64 {
    30
}
fn d_est() -> u64 {
    3600
}
fn d_closing() -> u64 {
    30
}
fn d_closed() -> u64 {
    5
}
fn d_udp() -> u64 {
    60
}
fn d_icmp() -> u64 {
    30
}

impl Default for Config {
    fn default() -> Self {
        Config {
            default_inbound: deny(),
            default_outbound: allow(),
            rules: Vec::new(),
            tcp_syn_timeout_s: d_syn(),
            tcp_established_timeout_s: d_est(),
            tcp_closing_timeout_s: d_closing(),
            tcp_closed_timeout_s: d_closed(),
            udp_timeout_s: d_udp(),
            icmp_timeout_s: d_icmp(),
            other_timeout_s: d_udp(),
        }
    }
}

/// Upper bound on any timeout: one week. Larger values are almost certainly unit mistakes
/// (milliseconds written as seconds) and would pin flows forever.
pub const MAX_TIMEOUT_S: u64 = 7 * 24 * 3600;

impl Config {
    /// Checks the timeouts (rules are checked by `rules::compile`).
    pub(crate) fn validate_timeouts(&self) -> Result<(), String> {
        let all = [
            ("tcp_syn_timeout_s", self.tcp_syn_timeout_s),
            ("tcp_established_timeout_s", self.tcp_established_timeout_s),
            ("tcp_closing_timeout_s", self.tcp_closing_timeout_s),
            ("tcp_closed_timeout_s", self.tcp_closed_timeout_s),
            ("udp_timeout_s", self.udp_timeout_s),
            ("icmp_timeout_s", self.icmp_timeout_s),
            ("other_timeout_s", self.other_timeout_s),
        ];
        for (name, v) in all {
            if v == 0 || v > MAX_TIMEOUT_S {
                return Err(format!(
                    "{name} = {v}: must be between 1 and {MAX_TIMEOUT_S} seconds"
                ));
            }
        }
        Ok(())
    }
}
