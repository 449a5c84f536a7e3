//! A replica that crashed in the middle of writing a batch (half a record after the last
//! synced one) restarts: the torn tail is cut, the intact prefix is replayed into a fresh
//! server, and the rest comes from the leader. Its server ends equal to the others.
//!
//! Only what was never synced may be torn: a synced record was acknowledged to the leader,
//! and Raft's safety rests on a replica keeping what it acknowledged (losing it is disk
//! corruption, which the leader detects by panicking the replica on a commit index past its
//! log). The unit tests in `log.rs` cut the file at every byte of its last record.

mod common;

use common::{have_redis, Group, Resp};
use pliant_smr::log::Log;
use std::io::Write;
use std::time::Duration;

fn write_some(g: &Group, from: u64, n: u64) {
    let leader = g.wait_leader(Duration::from_secs(10));
    let mut c = Resp::connect(&g.front_addr(leader)).unwrap();
    for i in from..from + n {
        assert_eq!(
            c.cmd(&["SET", &format!("key{i}"), &i.to_string()]).unwrap(),
            "OK"
        );
    }
}

#[test]
fn a_torn_log_tail_is_cut_and_the_replica_catches_up() {
    if !have_redis() {
        return;
    }
    let mut g = Group::start("torn", 3, false);
    write_some(&g, 0, 200);
    g.wait_converged(Duration::from_secs(10));
    let leader = g.wait_leader(Duration::from_secs(10));
    let victim = if leader == 3 { 2 } else { 3 };
    g.kill(victim);
    let path = g.dir.join(format!("r{victim}")).join("raft.log");
    let len = std::fs::metadata(&path).unwrap().len();
    let before = Log::open(&path, 1 << 20).unwrap().1;
    assert_eq!(before.truncated, 0);
    // A batch the crash interrupted: a record header announcing 64 bytes, then 3 of them.
    let torn = [0x40, 0, 0, 0, 1, 2, 3, 4, 1, 9, 9];
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&torn).unwrap();
    drop(f);
    // Read a copy, so the replica meets the torn tail itself at its restart.
    let copy = path.with_extension("copy");
    std::fs::copy(&path, &copy).unwrap();
    let (log, after) = Log::open(&copy, 1 << 20).unwrap();
    drop(log);
    assert_eq!(
        after.truncated,
        torn.len() as u64,
        "the torn batch and nothing else"
    );
    assert_eq!(after.entries.len(), before.entries.len());
    assert!(!after.entries.is_empty());
    write_some(&g, 200, 100);
    g.start_replica(victim);
    assert_eq!(g.replica(victim).torn, torn.len() as u64);
    assert_eq!(g.replica(victim).recovered, after.entries.len());
    let now = std::fs::metadata(&path).unwrap().len();
    assert!(now >= len, "the synced prefix is kept: {now} < {len}");
    write_some(&g, 300, 10);
    g.wait_converged(Duration::from_secs(20));
    let states = g.settled_states(Duration::from_secs(5));
    for (id, digest, dbsize) in &states {
        assert_eq!(dbsize, "310", "replica {id}");
        assert_eq!(digest, &states[0].1, "replica {id}");
    }
}
