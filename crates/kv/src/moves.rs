//! Moving one copy of a partition without losing data (VoltDB's rejoin, on Redis replication):
//! a new copy joins as a replica of the partition's master and catches up; if the copy leaving
//! is the master, a coordinated failover hands mastership to the new copy (writes pause, no
//! acknowledged write is lost); then the old copy is forgotten by every node and stopped. The
//! k+1 rule is checked on live replication state right before the drop.
//!
//! Moves of different partitions run at once ([`Shared`]); one partition's moves run in order,
//! so a partition never holds more than one extra copy.

use crate::cluster::Kv;
use crate::host;
use crate::invariant;
use crate::node::{self, wait_for};
use crate::planning::Step;
use crate::state::NodeRec;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Moves of different partitions running at once, by default: each mostly waits (for a sync,
/// for gossip, for an election), and `N` at once hold at most `N` extra copies.
pub const PARALLEL: usize = 4;

/// How long a new copy may take to join and catch up.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a coordinated failover may take (it is retried within this).
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(60);
/// One coordinated failover attempt: Redis gives up a manual failover after 5 s.
const FAILOVER_ATTEMPT: Duration = Duration::from_secs(6);
const GOSSIP_TIMEOUT: Duration = Duration::from_secs(30);
/// A node that has not taken in what a MEET told it after this long is sent another (a MEET can
/// miss: the receiver may not know the sender by its id yet, or a link was being replaced).
/// Gossip would take up to half the node timeout.
const NUDGE_AFTER: Duration = Duration::from_millis(300);

/// What one executed move did.
#[derive(Clone, Debug)]
pub struct MoveReport {
    pub step: Step,
    /// Host ids.
    pub from: Option<u32>,
    pub to: u32,
    pub was_master: bool,
    pub took: Duration,
    /// Where the time went, phase by phase, in order.
    pub phases: Vec<(&'static str, Duration)>,
    /// What went wrong on the way and was retried.
    pub notes: Vec<String>,
}

impl MoveReport {
    /// `join 0.12 s, sync 0.40 s, ...`
    pub fn phases_line(&self) -> String {
        self.phases
            .iter()
            .map(|(n, d)| format!("{n} {:.2} s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Times consecutive phases of a move.
struct Phases {
    at: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    fn new() -> Self {
        Phases {
            at: Instant::now(),
            done: Vec::new(),
        }
    }
    fn end(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.at));
        self.at = now;
    }
}

/// What moves running at once share. The record is locked only to read or change its node
/// list, never across a wait.
pub struct Shared<'a> {
    kv: Mutex<&'a mut Kv>,
    /// For connecting and starting nodes: host addresses, directories and the password, which
    /// no move changes (its node list goes stale; the record's is the live one).
    view: Kv,
    /// Nodes join and leave one at a time: a node joining while another is being forgotten
    /// could learn of it from a node that has not forgotten it yet, and spread it again after
    /// the others' one-minute ban.
    membership: Mutex<()>,
    /// Coordinated failovers one at a time: elections at once split the masters' votes within
    /// an epoch and time out.
    election: Mutex<()>,
}

impl<'a> Shared<'a> {
    pub fn new(kv: &'a mut Kv) -> Self {
        let view = Kv {
            state: kv.state.clone(),
            password: kv.password.clone(),
        };
        Shared {
            kv: Mutex::new(kv),
            view,
            membership: Mutex::new(()),
            election: Mutex::new(()),
        }
    }

    /// The record, for a short look or change (never held across a wait or a connection).
    pub fn with<T>(&self, f: impl FnOnce(&mut Kv) -> T) -> T {
        f(&mut self.kv.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn nodes(&self) -> Vec<NodeRec> {
        self.with(|kv| kv.state.nodes.clone())
    }

    /// Whether `n` is still a node of the cluster (a concurrent move may have dropped it).
    fn present(&self, n: &NodeRec) -> bool {
        self.with(|kv| kv.state.nodes.iter().any(|x| x.id == n.id))
    }

    /// The live master of partition `p` among its copies in the record.
    fn master_of(&self, p: usize) -> Result<NodeRec, String> {
        let copies: Vec<NodeRec> = self.with(|kv| kv.state.copies(p).cloned().collect());
        copies
            .into_iter()
            .find(|n| {
                role(&self.view, n)
                    .is_ok_and(|i| i.get("role").map(String::as_str) == Some("master"))
            })
            .ok_or_else(|| format!("partition {p}: no copy reports role:master"))
    }
}

fn role(kv: &Kv, n: &NodeRec) -> Result<std::collections::BTreeMap<String, String>, String> {
    let mut c = kv.connect(n)?;
    node::info(&mut c, "replication")
}

/// Live copies of a partition as its master sees them: itself plus the replicas whose
/// replication link it reports `online` (connected and past the initial sync).
pub fn live_copies(kv: &Kv, master: &NodeRec) -> Result<usize, String> {
    let i = role(kv, master)?;
    if i.get("role").map(String::as_str) != Some("master") {
        return Err(format!(
            "partition {}: {}:{} is not master",
            master.partition, master.host, master.port
        ));
    }
    Ok(1 + crate::parse::online_replicas(&i))
}

/// Waits until `replica` has everything `master` had when the wait began a round: link up and
/// its offset at least the master's offset read just before it.
fn wait_caught_up(kv: &Kv, master: &NodeRec, replica: &NodeRec) -> Result<(), String> {
    wait_for(
        &format!(
            "partition {} copy on host {} to catch up",
            replica.partition, replica.host
        ),
        CATCH_UP_TIMEOUT,
        || {
            let m = role(kv, master)?;
            let target = crate::parse::info_u64(&m, "master_repl_offset").unwrap_or(u64::MAX);
            let r = role(kv, replica)?;
            let up = r.get("master_link_status").map(String::as_str) == Some("up");
            let at = crate::parse::info_u64(&r, "slave_repl_offset").unwrap_or(0);
            Ok((up && at >= target).then_some(()))
        },
    )
}

/// Executes one step: copy to `to`, then (if it moves a copy off a host) drop the copy on
/// `from`. `to` and `from` are host ids. Other partitions' steps may run at the same time on
/// the same [`Shared`]; this partition's may not.
pub fn execute(sh: &Shared, step: Step, from: Option<u32>, to: u32) -> Result<MoveReport, String> {
    let t0 = Instant::now();
    let mut ph = Phases::new();
    let mut notes = Vec::new();
    let p = step.partition;
    let kv = &sh.view;
    if sh.with(|kv| kv.state.copies(p).any(|n| n.host == to)) {
        return Err(format!("partition {p} already has a copy on host {to}"));
    }
    let host = kv
        .state
        .host(to)
        .ok_or_else(|| format!("host {to} does not exist"))?
        .clone();
    let master = sh.master_of(p)?;

    // 1. The new copy: started, introduced to the cluster, made a replica of the master.
    let new = node::start(&kv.state, &host, p, &kv.password)?;
    {
        let _turn = sh.membership.lock().unwrap_or_else(|e| e.into_inner());
        let others = sh.with(|rec| {
            rec.state.nodes.push(new.clone());
            rec.state.save().map(|()| rec.state.nodes.clone())
        })?;
        // Every node meets the new one directly rather than waiting for gossip to spread it.
        for n in others.iter().filter(|n| n.id != new.id) {
            meet(kv, n, &new);
        }
    }
    wait_for(
        &format!("partition {p}: new copy on host {to} to know its master"),
        GOSSIP_TIMEOUT,
        || {
            let known = node::cluster_nodes(&mut kv.connect(&new)?)?;
            Ok(known.iter().any(|n| n.id == master.id).then_some(()))
        },
    )?;
    wait_for(
        &format!("partition {p}: new copy on host {to} to replicate"),
        GOSSIP_TIMEOUT,
        || {
            Ok(node::query_str(
                &mut kv.connect(&new)?,
                &["CLUSTER", "REPLICATE", &master.id],
            )
            .ok())
        },
    )?;
    ph.end("join");
    wait_caught_up(kv, &master, &new)?;
    ph.end("sync");
    // Every node must know the new copy as the master's replica before a failover to it: the
    // masters' votes elect it, and a master that has not heard of it yet does not vote.
    // Gossip carries a node's role to every other node within half the node timeout; a MEET
    // from the new copy carries it at once (the receiver reads the sender's role from the
    // header of any ping, and a MEET to a node already known only opens a handshake that its
    // answer closes again). The other way round, now that the new copy knows every node, a
    // MEET from each carries its slots and epoch to the new copy: a new node otherwise learns
    // a master's slots only from that master's own pings, and must know them all before it may
    // be promoted (see `failover`).
    let others = {
        let _turn = sh.membership.lock().unwrap_or_else(|e| e.into_inner());
        let others = sh.nodes();
        for n in others.iter().filter(|n| n.id != new.id) {
            meet(kv, &new, n);
        }
        for n in others.iter().filter(|n| n.id != new.id) {
            meet(kv, n, &new);
        }
        others
    };
    for n in others.iter().filter(|n| n.id != new.id) {
        let mut nudged = Instant::now();
        wait_for(
            &format!(
                "node {}:{} to learn of the new copy of partition {p}",
                n.host, n.port
            ),
            GOSSIP_TIMEOUT,
            || {
                // A node another move dropped meanwhile has nothing to learn.
                if !sh.present(n) {
                    return Ok(Some(()));
                }
                if nudged.elapsed() > NUDGE_AFTER {
                    nudged = Instant::now();
                    // Under the membership turn: never a MEET to a node being forgotten (its
                    // answer would make it known again after the FORGET).
                    let _turn = sh.membership.lock().unwrap_or_else(|e| e.into_inner());
                    if sh.present(n) {
                        meet(kv, &new, n);
                    }
                }
                let known = node::cluster_nodes(&mut kv.connect(n)?)?;
                Ok(known
                    .iter()
                    .any(|l| l.id == new.id && l.master.as_deref() == Some(master.id.as_str()))
                    .then_some(()))
            },
        )?;
    }
    ph.end("gossip");

    let Some(from) = from else {
        return Ok(MoveReport {
            step,
            from: None,
            to,
            was_master: false,
            took: t0.elapsed(),
            phases: ph.done,
            notes,
        });
    };
    let old = sh
        .with(|rec| rec.state.copies(p).find(|n| n.host == from).cloned())
        .ok_or_else(|| format!("partition {p} has no copy on host {from}"))?;

    // 2. Mastership, if it is leaving: a coordinated failover to the new, caught-up copy.
    let was_master = old.id == master.id;
    let master = if was_master {
        notes.extend(
            failover(sh, &new)?
                .into_iter()
                .map(|w| format!("failover retried: {w}")),
        );
        ph.end("failover");
        new.clone()
    } else {
        master
    };

    // 3. The k+1 rule on live state, then the drop. A master marks a replica `online` only at its
    // first acknowledgement after the sync (sent once a second), which can trail the replica's
    // own `link up`: wait a bounded time for the count, then check it.
    let k = kv.state.k;
    let live = wait_for(
        &format!("partition {p}: {} live copies before the drop", k + 2),
        CATCH_UP_TIMEOUT,
        || {
            let live = live_copies(kv, &master)?;
            Ok((live > k + 1).then_some(live))
        },
    )
    .or_else(|_| live_copies(kv, &master))?;
    ph.end("online");
    invariant::may_drop(p, live, k)?;
    {
        let _turn = sh.membership.lock().unwrap_or_else(|e| e.into_inner());
        let nodes = sh.nodes();
        if was_master {
            owner_seen_everywhere(sh, &nodes, &master)?;
            ph.end("owner");
        }
        forget_and_stop_timed(kv, &nodes, &old, &mut ph)?;
        sh.with(|rec| {
            rec.state.nodes.retain(|n| n.id != old.id);
            rec.state.save()
        })?;
    }
    let _ = std::fs::remove_dir_all(kv.state.node_dir(old.host, p));
    ph.end("sweep");
    Ok(MoveReport {
        step,
        from: Some(from),
        to,
        was_master,
        took: t0.elapsed(),
        phases: ph.done,
        notes,
    })
}

/// `CLUSTER FAILOVER` (coordinated: the master stops writes until the replica has its offset)
/// on `new`, until `new` is master and `old` and every other copy replicate from it.
/// Returns why each attempt before the successful one failed.
fn failover(sh: &Shared, new: &NodeRec) -> Result<Vec<String>, String> {
    let p = new.partition;
    let kv = &sh.view;
    let mut retried = Vec::new();
    {
        let _turn = sh.election.lock().unwrap_or_else(|e| e.into_inner());
        // The candidate serves the partition's clients as soon as it wins, so its own view must
        // place every slot first: one promoted before it had them all answered `CLUSTERDOWN`
        // for seconds (and, a master in a failed state, then waited out Redis's rejoin delay).
        // The MEETs after its sync brought them; this waited 3.4-3.5 s before they did.
        wait_for(
            &format!(
                "partition {p}: copy on host {} to see every slot served",
                new.host
            ),
            GOSSIP_TIMEOUT,
            || {
                let i = crate::parse::info(&node::query_str(
                    &mut kv.connect(new)?,
                    &["CLUSTER", "INFO"],
                )?);
                Ok((i.get("cluster_state").map(String::as_str) == Some("ok")).then_some(()))
            },
        )?;
        // The candidate asks for votes in its current epoch + 1. One that has not heard of the
        // cluster's latest epoch yet (the last election's, moments ago) asks in an epoch the
        // masters have voted in already, is refused, and waits out the manual failover: wait
        // for gossip to bring it the epoch. (Not a MEET, as for its role: see below.)
        let nodes = sh.nodes();
        wait_for(
            &format!(
                "partition {p}: copy on host {} to learn the cluster's epoch",
                new.host
            ),
            GOSSIP_TIMEOUT,
            || {
                let latest = nodes
                    .iter()
                    .filter(|n| sh.present(n))
                    .filter_map(|n| current_epoch(kv, n).ok())
                    .max()
                    .unwrap_or(0);
                Ok((current_epoch(kv, new)? >= latest).then_some(()))
            },
        )?;
        // Votes and their requests travel on cluster-bus links. A MEET between two nodes that
        // know each other replaces the receiver's inbound link from the sender, and the
        // handshake's end closes the new one: the sender's old link is dead until it notices
        // and reconnects (a cron tick, 100 ms), and a vote request sent on it is lost — the
        // election then fails without a word in any log. So the candidate and every master
        // must see each other connected first.
        wait_for(
            &format!(
                "partition {p}: cluster-bus links between the copy on host {} and every master",
                new.host
            ),
            GOSSIP_TIMEOUT,
            || {
                let view = node::cluster_nodes(&mut kv.connect(new)?)?;
                let masters: Vec<_> = view
                    .iter()
                    .filter(|l| l.is_master() && !l.slots.is_empty())
                    .collect();
                if masters.iter().any(|l| !l.connected) {
                    return Ok(None);
                }
                for m in masters {
                    let Some(rec) = nodes.iter().find(|n| n.id == m.id && sh.present(n)) else {
                        continue;
                    };
                    let theirs = node::cluster_nodes(&mut kv.connect(rec)?)?;
                    if !theirs.iter().any(|l| l.id == new.id && l.connected) {
                        return Ok(None);
                    }
                }
                Ok(Some(()))
            },
        )?;
        wait_for(
            &format!("partition {p}: failover to host {}", new.host),
            FAILOVER_TIMEOUT,
            || {
                node::query_str(&mut kv.connect(new)?, &["CLUSTER", "FAILOVER"])?;
                let attempt = Instant::now();
                while attempt.elapsed() < FAILOVER_ATTEMPT {
                    if role(kv, new)?.get("role").map(String::as_str) == Some("master") {
                        return Ok(Some(()));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                // Why, in the candidate's words: for the report, and the error if no attempt
                // succeeds.
                let why = failover_log(kv, new);
                retried.push(why.clone());
                Err(why)
            },
        )?;
    }
    let new_ip = kv.state.host_ip(new.host).to_string();
    let copies: Vec<NodeRec> = sh.with(|rec| rec.state.copies(p).cloned().collect());
    for n in copies.iter().filter(|n| n.id != new.id) {
        wait_for(
            &format!(
                "partition {p}: copy on host {} to follow the new master",
                n.host
            ),
            GOSSIP_TIMEOUT,
            || {
                let i = role(kv, n)?;
                Ok((i.get("master_host") == Some(&new_ip)
                    && i.get("master_link_status").map(String::as_str) == Some("up"))
                .then_some(()))
            },
        )?;
    }
    Ok(retried)
}

/// Waits until every node of `nodes` sees `master` own its partition's slots. Needed before a
/// former master is forgotten: a node that forgets the slots' owner in its view leaves them
/// unassigned there — it answers `CLUSTERDOWN`, and a client refreshing its slot map from it
/// loses the partition (redis-rs's sync client then kept retrying the removed address). Called
/// with node changes held back: a node that joined after a check over fewer nodes may have
/// learned the old owner and not heard from the new one yet (seen: `CLUSTERDOWN` for seconds
/// after a scale with moves at once).
fn owner_seen_everywhere(sh: &Shared, nodes: &[NodeRec], master: &NodeRec) -> Result<(), String> {
    let kv = &sh.view;
    let p = master.partition;
    let (first, _) = crate::slots::range(p, kv.state.partitions);
    for n in nodes.iter().filter(|n| n.id != master.id) {
        let mut nudged = Instant::now();
        wait_for(
            &format!(
                "node {}:{} to see host {} own partition {p}",
                n.host, n.port, master.host
            ),
            GOSSIP_TIMEOUT,
            || {
                if nudged.elapsed() > NUDGE_AFTER {
                    nudged = Instant::now();
                    // The MEET carries the master's slots and epoch; it breaks the master's
                    // link to `n` for a moment, which a vote of the master's in an election
                    // under way could be lost on: not while one runs.
                    let _vote = sh.election.lock().unwrap_or_else(|e| e.into_inner());
                    meet(kv, master, n);
                }
                let view = node::cluster_nodes(&mut kv.connect(n)?)?;
                Ok(view
                    .iter()
                    .any(|l| {
                        l.id == master.id
                            && l.is_master()
                            && l.slots.iter().any(|&(a, b)| (a..=b).contains(&first))
                    })
                    .then_some(()))
            },
        )?;
    }
    Ok(())
}

/// `CLUSTER MEET` from `from` to `to`. Between nodes that know each other the MEET only opens a
/// handshake that the answer closes again, but it carries `from`'s role, slots and epoch at
/// once instead of within half the node timeout; it also breaks the link between them for a
/// moment (see `failover`). Best effort: every MEET here only hastens what gossip does anyway,
/// the wait after it checks the outcome, and a node in the middle of a full sync refuses every
/// command for a moment (`LOADING`).
fn meet(kv: &Kv, from: &NodeRec, to: &NodeRec) {
    let [ip, port, bus] = node::meet_args(&kv.state, to);
    if let Ok(mut c) = kv.connect(from) {
        let _ = node::query_str(&mut c, &["CLUSTER", "MEET", &ip, &port, &bus]);
    }
}

/// A node's `cluster_current_epoch`.
fn current_epoch(kv: &Kv, n: &NodeRec) -> Result<u64, String> {
    let i = crate::parse::info(&node::query_str(&mut kv.connect(n)?, &["CLUSTER", "INFO"])?);
    crate::parse::info_u64(&i, "cluster_current_epoch")
        .ok_or_else(|| format!("{}:{}: no cluster_current_epoch", n.host, n.port))
}

/// The last lines of `n`'s log about failover (its reasons for not becoming master).
fn failover_log(kv: &Kv, n: &NodeRec) -> String {
    let path = kv.state.node_dir(n.host, n.partition).join("redis.log");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("ailover") || l.contains("election"))
        .collect();
    format!(
        "no master after {FAILOVER_ATTEMPT:?}; {}: {}",
        path.display(),
        lines[lines.len().saturating_sub(3)..].join(" | ")
    )
}

/// `CLUSTER FORGET` of `old` on every other node of `nodes` (each keeps it banned for a minute);
/// a replica refuses to forget its own master, so that is retried until gossip has moved it to
/// the new one. Then `old` is stopped, and the nodes asked again until none knows it.
pub(crate) fn forget_and_stop(kv: &Kv, nodes: &[NodeRec], old: &NodeRec) -> Result<(), String> {
    forget_and_stop_timed(kv, nodes, old, &mut Phases::new())
}

fn forget_and_stop_timed(
    kv: &Kv,
    nodes: &[NodeRec],
    old: &NodeRec,
    ph: &mut Phases,
) -> Result<(), String> {
    for n in nodes.iter().filter(|n| n.id != old.id) {
        wait_for(
            &format!("node {}:{} to forget {}", n.host, n.port, old.id),
            GOSSIP_TIMEOUT,
            || match node::query_str(&mut kv.connect(n)?, &["CLUSTER", "FORGET", &old.id]) {
                Ok(_) => Ok(Some(())),
                Err(e) if e.contains("Unknown node") => Ok(Some(())),
                Err(e) => Err(e),
            },
        )?;
    }
    // A node that did not know `old` by its id when asked is not banned from learning it: a new
    // node still completing its handshake with `old` (which has only a random name for it until
    // `old` answers), or one that hears of it afterwards from a peer asked after it. It would
    // keep the stopped node forever and spread it again once the others' bans end (seen: dead
    // replicas piling up as `fail` in every view). So `old` stops first — a handshake with it
    // can no longer complete — and the nodes are asked again until none knows it.
    ph.end("forget");
    node::stop(&kv.state, old);
    ph.end("stop");
    wait_for(
        &format!("every node to have forgotten {}", old.id),
        GOSSIP_TIMEOUT,
        || {
            let mut clean = true;
            for n in nodes.iter().filter(|n| n.id != old.id) {
                let mut c = kv.connect(n)?;
                if node::cluster_nodes(&mut c)?.iter().any(|l| l.id == old.id) {
                    clean = false;
                    let _ = node::query_str(&mut c, &["CLUSTER", "FORGET", &old.id]);
                }
            }
            Ok(clean.then_some(()))
        },
    )
}

/// Removes hosts that hold no copy any more (after a scale-in).
pub fn remove_empty_hosts(kv: &mut Kv) -> Result<Vec<u32>, String> {
    let empty: Vec<_> = kv
        .state
        .hosts
        .iter()
        .filter(|h| !kv.state.nodes.iter().any(|n| n.host == h.id))
        .cloned()
        .collect();
    for h in &empty {
        let problems = host::remove_host(&kv.state, h);
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        kv.state.hosts.retain(|x| x.id != h.id);
        kv.state.save()?;
        let _ = std::fs::remove_dir_all(kv.state.dir.join(format!("h{}", h.id)));
    }
    Ok(empty.iter().map(|h| h.id).collect())
}
