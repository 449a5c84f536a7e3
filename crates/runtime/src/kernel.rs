//! Keeps the replica namespace's kernel away from the frames the runtime owns.
//!
//! The runtime reads frames with AF_PACKET taps, which see a frame *before* tc ingress. If the
//! kernel also processed them it would answer on its own: RSTs for TCP segments to ports it has
//! no socket for, ICMP unreachables, ARP replies, IPv6 router solicitations. So on start-up, for
//! each of its interfaces, the runtime
//! 1. disables IPv6 (no link-local address, no ND/MLD chatter),
//! 2. refuses to start if the interface has any IP address (the kernel would own them),
//! 3. adds a clsact qdisc with an ingress filter that drops everything (a direct-action BPF
//!    program, see [`tcdrop`]), so the kernel stack never sees a received frame,
//!
//! and [`KernelGuard`]'s `Drop` removes the filter (and the qdisc if it added it) again.

mod tcdrop;

use std::process::Command;

/// Preference of our tc filter, so shutdown removes exactly it.
const TC_PREF: u16 = 49001;
const TC_PREF_S: &str = "49001";

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {cmd}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{cmd} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ifindex(ifname: &str) -> Result<i32, String> {
    let c =
        std::ffi::CString::new(ifname).map_err(|_| format!("{ifname:?}: bad interface name"))?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(format!("{ifname}: no such interface"));
    }
    i32::try_from(i).map_err(|_| format!("{ifname}: interface index {i} out of range"))
}

/// Installed protections of one interface; undone on drop.
pub struct KernelGuard {
    ifname: String,
    added_qdisc: bool,
    added_filter: bool,
}

impl KernelGuard {
    /// Applies the protections to `ifname`. Errors say which step failed and why.
    pub fn install(ifname: &str) -> Result<KernelGuard, String> {
        let sysctl = format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6");
        // Absent when IPv6 is compiled out or disabled globally: nothing to do then.
        if std::path::Path::new(&sysctl).exists() {
            std::fs::write(&sysctl, "1")
                .map_err(|e| format!("{ifname}: disable IPv6 ({sysctl}): {e}"))?;
        }
        let addrs = run("ip", &["-o", "addr", "show", "dev", ifname])?;
        let owned: Vec<&str> = addrs
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                it.find(|w| *w == "inet" || *w == "inet6")
                    .and_then(|_| it.next())
            })
            .collect();
        if !owned.is_empty() {
            return Err(format!(
                "{ifname} has IP addresses {owned:?}: the kernel would answer for them; the runtime \
                 owns this interface (remove them: ip addr flush dev {ifname})"
            ));
        }
        let mut g = KernelGuard {
            ifname: ifname.to_string(),
            added_qdisc: false,
            added_filter: false,
        };
        let qdiscs = run("tc", &["qdisc", "show", "dev", ifname])?;
        if !qdiscs.contains("clsact") {
            run("tc", &["qdisc", "add", "dev", ifname, "clsact"])?;
            g.added_qdisc = true;
        }
        // A filter left behind by a crashed run would make the exclusive add fail.
        let _ = run(
            "tc",
            &["filter", "del", "dev", ifname, "ingress", "pref", TC_PREF_S],
        );
        let ifindex = ifindex(ifname)?;
        tcdrop::attach_ingress_drop(ifindex, TC_PREF)
            .map_err(|e| format!("{ifname}: attach tc ingress drop filter: {e}"))?;
        g.added_filter = true;
        Ok(g)
    }

    /// True if our drop filter is present on the interface (for tests and `stats`).
    pub fn filter_present(ifname: &str) -> bool {
        run("tc", &["filter", "show", "dev", ifname, "ingress"])
            .map(|s| s.contains("pliant_drop") && s.contains(&format!("pref {TC_PREF}")))
            .unwrap_or(false)
    }
}

impl Drop for KernelGuard {
    fn drop(&mut self) {
        if self.added_qdisc {
            // Deleting the qdisc removes our filter with it.
            let _ = run("tc", &["qdisc", "del", "dev", &self.ifname, "clsact"]);
        } else if self.added_filter {
            let _ = run(
                "tc",
                &[
                    "filter",
                    "del",
                    "dev",
                    &self.ifname,
                    "ingress",
                    "pref",
                    TC_PREF_S,
                ],
            );
        }
    }
}
