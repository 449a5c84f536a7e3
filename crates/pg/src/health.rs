//! When the controller declares the primary dead ([`Detector`], pure: no clock, no I/O).
//!
//! A probe (`SELECT 1` on the controller's own connection, a fresh login when it has none)
//! ends in one of four ways ([`Probe`]). They do not weigh the same:
//!
//! - The kernel answers for a dead server: a SIGKILLed PostgreSQL's sockets are closed (EOF or
//!   reset on the open probe connection) and nothing listens any more (connection refused):
//!   [`Probe::Gone`].
//! - No TCP handshake within the connect timeout ([`Probe::Unreachable`]): a cut link or a
//!   vanished host (also a SIGKILL whose FIN was lost because the link was cut right after).
//!   The handshake is answered by the server's kernel, not by PostgreSQL, so it does not
//!   stretch with database load.
//!
//!   Both come from the kernel, which answers even on a saturated machine, so they are
//!   trusted at once: the primary is dead when a probe ends so right after any failed probe
//!   (one immediate retry on a fresh connection rules out a probe backend that died or was
//!   terminated on its own, or a single dropped SYN). That retry waits only a probe timeout
//!   for its answer: a login whose handshake a dying postmaster's kernel still completed
//!   just before the link was cut never gets one.
//! - The TCP handshake succeeded but PostgreSQL did not answer in time ([`Probe::Slow`]): a
//!   busy server looks exactly like this (under pgbench on two saturated CPUs a `SELECT 1`
//!   was seen taking over 2 s). A server that merely answers late is alive, so slowness alone
//!   makes the primary dead only once no probe has been answered for
//!   [`Policy::slow_dead_after_ms`]; meanwhile each probe may wait for the rest of that window
//!   ([`Verdict::Suspect::wait_ms`]), so a late answer counts.
//!
//! - Late as above, but the proxy's sessions received data from the primary while the probe
//!   waited ([`Probe::Busy`]): the primary is demonstrably alive and serving; the window
//!   starts again. (Load that does not pass through the proxy gives no such evidence: then
//!   only the window protects a busy primary.)
//!
//! - Late as above, but a session's connection to the primary was closed by the server side
//!   (EOF or reset, no FATAL message) since the last answered probe: its backend died without
//!   a word — what a SIGKILL does — while something still holds the listening port (a
//!   postmaster that has not died yet, stopped or stuck): [`Probe::Gone`] ([`refine`]).
//!
//! Any answered probe clears the suspicion. Failing over a live primary is safe (it is fenced
//! first) but costly: every session moves and protection is off until re-protection ends.

use crate::client::ClientError;
use crate::proto::ProtoError;

/// How one probe of the primary ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `SELECT 1` answered.
    Answered,
    /// Connected (TCP), but no answer within the probe's timeout: busy, or hung.
    Slow,
    /// [`Probe::Slow`], but sessions received data from the primary meanwhile: busy.
    Busy,
    /// No TCP handshake within the connect timeout: link cut, host gone.
    Unreachable,
    /// Connection refused, reset or closed, or a FATAL error: nothing serves on the port, or
    /// the server is shutting down or restarting after a crash.
    Gone,
}

/// The detection policy (from `ProxyConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Timeout of a probe while the primary is healthy (ms): after it the probe counts as
    /// [`Probe::Slow`] and the next one goes out on a fresh connection at once.
    pub probe_timeout_ms: u64,
    /// A primary that only answers late is declared dead once no probe has been answered for
    /// this long after the first late one (ms).
    pub slow_dead_after_ms: u64,
}

/// What the controller does after a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Probe again after the usual interval.
    Healthy,
    /// Probe again at once on a fresh connection, waiting up to `wait_ms` for an answer.
    Suspect { wait_ms: u64 },
    /// Fail over.
    Dead,
}

/// Failure detector of the primary: feed it every probe's outcome, in order.
#[derive(Clone, Debug)]
pub struct Detector {
    policy: Policy,
    /// When the first failed probe of the current streak was seen (ms, caller's clock).
    bad_since: Option<u64>,
    /// The previous probe's outcome, if it failed.
    last_bad: Option<Probe>,
}

impl Detector {
    pub fn new(policy: Policy) -> Detector {
        Detector {
            policy,
            bad_since: None,
            last_bad: None,
        }
    }

    /// Forgets the streak (after a failover: a new primary is watched).
    pub fn reset(&mut self) {
        self.bad_since = None;
        self.last_bad = None;
    }

    /// The probe that ended at `now_ms` (monotonic, the caller's clock) ended with `p`.
    pub fn observe(&mut self, now_ms: u64, p: Probe) -> Verdict {
        if p == Probe::Answered {
            self.reset();
            return Verdict::Healthy;
        }
        let prev = self.last_bad.replace(p);
        if p == Probe::Busy {
            // Alive as of now: the window restarts. Still suspect, so that a cut link or a
            // crash right after is confirmed by the next (immediate) probe's TCP handshake.
            self.bad_since = Some(now_ms);
        }
        let since = *self.bad_since.get_or_insert(now_ms);
        let dead = matches!(p, Probe::Gone | Probe::Unreachable) && prev.is_some();
        let waited = now_ms.saturating_sub(since);
        if dead || waited >= self.policy.slow_dead_after_ms {
            return Verdict::Dead;
        }
        let wait_ms = if matches!(p, Probe::Gone | Probe::Unreachable) {
            // The retry only has to confirm what the kernel said (a probe backend that died
            // alone, a dropped SYN): a healthy probe's wait. Waiting the rest of the window
            // here would let a login caught between a SIGKILL and a link cut (handshake
            // completed by the dying postmaster's kernel, answer never coming) hold the
            // verdict for the whole window; a late answer still earns the long wait next.
            self.policy.probe_timeout_ms
        } else {
            // The rest of the window, but never less than a healthy probe gets.
            (self.policy.slow_dead_after_ms - waited).max(self.policy.probe_timeout_ms)
        };
        Verdict::Suspect { wait_ms }
    }
}

/// A late probe in the light of what the proxy's sessions saw since the probe before it
/// (see the module documentation): a backend that closed its session without a word is
/// evidence of death, and outweighs data other sessions received; data alone is evidence of
/// life. Other outcomes speak for themselves.
pub fn refine(p: Probe, sessions_heard: bool, session_closed_by_server: bool) -> Probe {
    match p {
        Probe::Slow if session_closed_by_server => Probe::Gone,
        Probe::Slow if sessions_heard => Probe::Busy,
        p => p,
    }
}

/// What a failed probe says about the server (see the module documentation).
pub fn classify(e: &ClientError) -> Probe {
    use std::io::ErrorKind::{HostUnreachable, NetworkUnreachable, TimedOut, WouldBlock};
    match e {
        ClientError::Connect(_, io) => match io.kind() {
            TimedOut | WouldBlock | HostUnreachable | NetworkUnreachable => Probe::Unreachable,
            // Refused, reset: nothing listens any more.
            _ => Probe::Gone,
        },
        ClientError::Proto(ProtoError::Io(io)) if matches!(io.kind(), TimedOut | WouldBlock) => {
            Probe::Slow
        }
        ClientError::TlsTimeout(_) => Probe::Slow,
        // Class 53 (too many connections, out of memory or disk): alive, but short of
        // resources right now; not a reason to move every session.
        ClientError::Server { code, .. } if code.starts_with("53") => Probe::Slow,
        // EOF, reset, shutting down or restarting (57P0x), and anything unexpected.
        _ => Probe::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_probe_refined_by_what_sessions_saw() {
        use Probe::*;
        assert_eq!(refine(Slow, false, false), Slow);
        assert_eq!(refine(Slow, true, false), Busy);
        assert_eq!(refine(Slow, false, true), Gone, "a silent close is death");
        assert_eq!(refine(Slow, true, true), Gone, "and outweighs data");
        for p in [Answered, Unreachable, Gone] {
            assert_eq!(refine(p, true, true), p, "{p:?} speaks for itself");
        }
        // A postmaster that still holds the port after its backends were killed: the
        // suspect's next probe is late again and a session saw its backend vanish: dead at
        // once, not after the slow window.
        let mut d = Detector::new(Policy {
            probe_timeout_ms: 250,
            slow_dead_after_ms: 5000,
        });
        assert!(matches!(
            d.observe(0, refine(Slow, false, false)),
            Verdict::Suspect { .. }
        ));
        assert_eq!(d.observe(300, refine(Slow, false, true)), Verdict::Dead);
    }

    use pliant_testkit::XorShift;
    use std::io;

    #[test]
    fn probe_errors_are_classified_by_what_the_kernel_and_server_said() {
        let a: std::net::SocketAddr = "10.213.1.11:5432".parse().unwrap();
        let io = |k: io::ErrorKind| io::Error::from(k);
        let server = |code: &str| ClientError::Server {
            code: code.into(),
            message: String::new(),
        };
        let cases = [
            (
                ClientError::Connect(a, io(io::ErrorKind::ConnectionRefused)),
                Probe::Gone,
            ),
            (
                ClientError::Connect(a, io(io::ErrorKind::TimedOut)),
                Probe::Unreachable,
            ),
            (
                ClientError::Connect(a, io(io::ErrorKind::HostUnreachable)),
                Probe::Unreachable,
            ),
            (
                ClientError::Proto(ProtoError::Io(io(io::ErrorKind::WouldBlock))),
                Probe::Slow,
            ),
            (
                ClientError::Proto(ProtoError::Io(io(io::ErrorKind::TimedOut))),
                Probe::Slow,
            ),
            (
                ClientError::Proto(ProtoError::Io(io(io::ErrorKind::ConnectionReset))),
                Probe::Gone,
            ),
            (
                ClientError::Proto(ProtoError::Io(io(io::ErrorKind::UnexpectedEof))),
                Probe::Gone,
            ),
            (ClientError::Closed, Probe::Gone),
            (ClientError::TlsTimeout(a), Probe::Slow),
            (server("53300"), Probe::Slow),
            (server("57P01"), Probe::Gone),
            (server("57P03"), Probe::Gone),
        ];
        for (e, want) in cases {
            assert_eq!(classify(&e), want, "{e}");
        }
    }

    const POLICY: Policy = Policy {
        probe_timeout_ms: 250,
        slow_dead_after_ms: 5000,
    };

    fn run(seq: &[(u64, Probe)]) -> Vec<Verdict> {
        let mut d = Detector::new(POLICY);
        seq.iter().map(|&(t, p)| d.observe(t, p)).collect()
    }

    #[test]
    fn a_killed_primary_is_dead_after_one_retry() {
        use Probe::*;
        // SIGKILL: EOF on the probe connection, then refused on the fresh one.
        let v = run(&[(0, Answered), (100, Gone), (101, Gone)]);
        assert_eq!(v[2], Verdict::Dead);
        assert!(matches!(v[1], Verdict::Suspect { .. }));
        // Killed while a probe waited on it (busy, then killed).
        assert_eq!(run(&[(250, Slow), (260, Gone)])[1], Verdict::Dead);
    }

    #[test]
    fn a_retry_after_the_kernel_spoke_waits_only_a_probe_timeout() {
        use Probe::*;
        // SIGKILL then link cut: the probe backend's EOF arrived, the fresh login reached a
        // postmaster that was still exiting (handshake done, no answer ever) and the link
        // was cut: late after a probe timeout, then no handshake. Dead in well under a second,
        // not after the slow window.
        let v = run(&[(0, Answered), (10, Gone), (260, Slow), (360, Unreachable)]);
        assert_eq!(v[1], Verdict::Suspect { wait_ms: 250 });
        assert_eq!(
            v[2],
            Verdict::Suspect { wait_ms: 4750 },
            "late earns the rest"
        );
        assert_eq!(v[3], Verdict::Dead);
        assert_eq!(
            run(&[(0, Unreachable)])[0],
            Verdict::Suspect { wait_ms: 250 }
        );
    }

    #[test]
    fn a_cut_link_is_dead_once_a_quiet_connection_is_followed_by_no_handshake() {
        use Probe::*;
        // The open probe connection just goes quiet, then no SYN-ACK on a fresh one.
        let v = run(&[(0, Answered), (250, Slow), (350, Unreachable)]);
        assert!(matches!(v[1], Verdict::Suspect { .. }));
        assert_eq!(v[2], Verdict::Dead);
        // A single lost SYN is retried, and forgotten once answered.
        let v = run(&[
            (0, Answered),
            (100, Unreachable),
            (150, Answered),
            (250, Unreachable),
        ]);
        assert!(matches!(v[1], Verdict::Suspect { .. }));
        assert_eq!(v[2], Verdict::Healthy);
        assert!(matches!(v[3], Verdict::Suspect { .. }));
    }

    #[test]
    fn a_busy_primary_gets_the_whole_window_to_answer() {
        use Probe::*;
        let v = run(&[(250, Slow), (2500, Slow), (3000, Answered), (3250, Slow)]);
        assert_eq!(
            v,
            vec![
                Verdict::Suspect { wait_ms: 5000 },
                Verdict::Suspect { wait_ms: 2750 },
                Verdict::Healthy,
                Verdict::Suspect { wait_ms: 5000 },
            ]
        );
        // Never answering within the window: dead exactly at its end, not before.
        let v = run(&[(250, Slow), (5249, Slow), (5250, Slow)]);
        assert_eq!(v[1], Verdict::Suspect { wait_ms: 250 });
        assert_eq!(v[2], Verdict::Dead);
    }

    #[test]
    fn a_primary_serving_sessions_is_never_dead_for_slowness() {
        use Probe::*;
        // Probes late for far longer than the window, but sessions got data during each.
        let mut d = Detector::new(POLICY);
        for k in 1..=20u64 {
            let v = d.observe(k * 4_000, Busy);
            assert_eq!(v, Verdict::Suspect { wait_ms: 5000 }, "probe {k}");
        }
        // Then silent: dead one window after the last sign of life, not before.
        assert!(matches!(d.observe(84_000, Slow), Verdict::Suspect { .. }));
        assert_eq!(d.observe(85_000, Slow), Verdict::Dead);
        // Busy, then no TCP handshake (link cut right after): dead at once.
        assert_eq!(run(&[(250, Busy), (350, Unreachable)])[1], Verdict::Dead);
    }

    #[test]
    fn the_old_policy_failure_is_not_a_failover() {
        use Probe::*;
        // What failed the bench: the probe query timed out, and so did the login on a fresh
        // connection (TCP accepted, PostgreSQL busy). The old policy failed over here.
        let v = run(&[(0, Answered), (350, Slow), (700, Slow)]);
        assert!(matches!(v[2], Verdict::Suspect { .. }));
    }

    /// Property: over random probe sequences, Dead comes exactly when a refused/reset/closed
    /// or unhandshaken probe follows a failed one, or when the primary gave no sign of life
    /// (an answer, or data to sessions) for the window; slowness never shortens the window.
    #[test]
    fn random_sequences_follow_the_policy() {
        use Probe::*;
        for seed in 1..=500u64 {
            let mut r = XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut d = Detector::new(POLICY);
            let (mut t, mut first_bad, mut prev) = (0u64, None::<u64>, Answered);
            for step in 0..200 {
                t += r.next() % 1500;
                let p = [Answered, Slow, Busy, Unreachable, Gone][(r.next() % 5) as usize];
                let v = d.observe(t, p);
                if p == Answered {
                    assert_eq!(v, Verdict::Healthy, "seed {seed} step {step}");
                    first_bad = None;
                    prev = p;
                    continue;
                }
                if p == Busy {
                    first_bad = Some(t);
                }
                let since = *first_bad.get_or_insert(t);
                let hard_pair = prev != Answered && matches!(p, Unreachable | Gone);
                let expired = t - since >= POLICY.slow_dead_after_ms;
                if hard_pair || expired {
                    assert_eq!(v, Verdict::Dead, "seed {seed} step {step}: {prev:?} {p:?}");
                    // The controller fails over; a new primary is watched afresh.
                    d.reset();
                    first_bad = None;
                    prev = Answered;
                } else {
                    let Verdict::Suspect { wait_ms } = v else {
                        panic!("seed {seed} step {step}: {prev:?} {p:?} -> {v:?}");
                    };
                    // The next probe may wait for the rest of the window, never less than a
                    // healthy probe would.
                    assert!(wait_ms >= POLICY.probe_timeout_ms, "seed {seed}");
                    assert!(
                        t + wait_ms <= since + POLICY.slow_dead_after_ms
                            || wait_ms == POLICY.probe_timeout_ms,
                        "seed {seed} step {step}"
                    );
                    // After the kernel spoke (refused, reset, no handshake) only a
                    // healthy probe's wait: the retry confirms, it does not wait out load.
                    if matches!(p, Unreachable | Gone) {
                        assert_eq!(wait_ms, POLICY.probe_timeout_ms, "seed {seed} step {step}");
                    }
                    prev = p;
                }
            }
        }
    }
}
