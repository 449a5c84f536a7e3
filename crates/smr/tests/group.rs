//! Three replicas with real redis-server children: the clients' writes reach every replica's
//! server in the same order, the leader's replies are right, and a leader's failure loses no
//! acknowledged write.

mod common;

use common::{have_redis, Group, Resp};
use std::time::{Duration, Instant};

const ELECTION: Duration = Duration::from_secs(10);

/// Several connections interleave SET and INCR through the leader; afterwards every replica's
/// redis holds the same data (DEBUG DIGEST, DBSIZE, values), the client saw every reply right,
/// and every replica's server said the same bytes on every connection.
#[test]
fn writes_through_the_leader_reach_every_replica_identically() {
    if !have_redis() {
        return;
    }
    let g = Group::start("same", 3, false);
    let leader = g.wait_leader(ELECTION);
    let front = g.front_addr(leader);
    let conns = 4;
    let per_conn = 150;
    let mut clients: Vec<Resp> = (0..conns).map(|_| Resp::connect(&front).unwrap()).collect();
    let mut last_incr = 0i64;
    for i in 0..per_conn {
        for (c, cl) in clients.iter_mut().enumerate() {
            let key = format!("k{c}-{i}");
            assert_eq!(cl.cmd(&["SET", &key, &format!("v{c}.{i}")]).unwrap(), "OK");
            let n: i64 = cl.cmd(&["INCR", "counter"]).unwrap().parse().unwrap();
            assert_eq!(n, last_incr + 1, "INCR replies count up across connections");
            last_incr = n;
        }
    }
    // A pipelined burst on one connection: many commands in one read, replies in order.
    let cl = &mut clients[0];
    for i in 0..100 {
        cl.send(&["RPUSH", "list", &i.to_string()]).unwrap();
    }
    for i in 0..100 {
        assert_eq!(cl.reply().unwrap(), (i + 1).to_string());
    }
    assert_eq!(cl.cmd(&["GET", "k3-7"]).unwrap(), "v3.7");
    // The server ending a connection ends the client's: QUIT answers, then the close.
    assert_eq!(clients[1].cmd(&["QUIT"]).unwrap(), "OK");
    assert!(clients[1].reply().is_err(), "closed after QUIT");
    drop(clients);

    g.wait_converged(Duration::from_secs(10));
    let states = g.settled_states(Duration::from_secs(5));
    let want_keys = (conns * per_conn + 2).to_string();
    for (id, digest, dbsize) in &states {
        assert_eq!(dbsize, &want_keys, "replica {id} DBSIZE");
        assert_eq!(digest, &states[0].1, "replica {id} DEBUG DIGEST");
    }
    for id in 1..=3 {
        let mut c = Resp::connect(&g.server_addr(id).to_string()).unwrap();
        assert_eq!(c.cmd(&["GET", "counter"]).unwrap(), last_incr.to_string());
        assert_eq!(c.cmd(&["LLEN", "list"]).unwrap(), "100");
    }

    // The servers' output per connection: equal everywhere once each connection has ended.
    let digests = g.ended_digests(conns, Duration::from_secs(10));
    for d in &digests[1..] {
        assert_eq!(
            d, &digests[0],
            "output of every connection equal on every replica"
        );
    }
    assert!(digests[0].values().all(|d| d.bytes > 0));
    let log_bytes: Vec<u64> = g
        .live()
        .map(|r| {
            r.status()
                .log_bytes
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .collect();
    eprintln!("log bytes per replica: {log_bytes:?}");
}

/// A client INCRs through the leader; the leader's server is SIGKILLed and its node stopped.
/// A new leader is elected, the client reconnects to it (connections do not survive a leader
/// change in this slice) and goes on. Every INCR whose reply the client got is in the counter.
/// The failed replica then restarts on its log with an empty server, replays, and catches up.
#[test]
fn a_leader_failure_loses_no_acknowledged_write() {
    if !have_redis() {
        return;
    }
    let mut g = Group::start("failover", 3, true);
    let first = g.wait_leader(ELECTION);
    let mut c = Resp::connect(&g.front_addr(first)).unwrap();
    let (mut acked, mut attempted) = (0u64, 0u64);
    while acked < 200 {
        attempted += 1;
        let n: u64 = c.cmd(&["INCR", "counter"]).unwrap().parse().unwrap();
        assert_eq!(n, attempted);
        acked = n;
    }
    // Writes in flight while the leader dies: a pipelined burst, then the kill.
    for _ in 0..50 {
        c.send(&["INCR", "counter"]).unwrap();
        attempted += 1;
    }
    let t_kill = Instant::now();
    g.kill(first);
    while let Ok(r) = c.reply() {
        acked = acked.max(r.parse().unwrap());
    }
    let second = g.wait_leader(ELECTION);
    let elected = t_kill.elapsed();
    assert_ne!(second, first);
    let mut c = g.serving_client(second, ELECTION);
    let after: u64 = c.cmd(&["GET", "counter"]).unwrap().parse().unwrap();
    assert!(
        acked <= after && after <= attempted,
        "acked {acked} <= counter {after} <= attempted {attempted}"
    );
    for _ in 0..100 {
        let n: u64 = c.cmd(&["INCR", "counter"]).unwrap().parse().unwrap();
        assert!(n > acked);
        acked = n;
    }
    eprintln!("failover: new leader {second} elected {elected:?} after the kill began");
    drop(c);

    g.start_replica(first);
    g.wait_converged(Duration::from_secs(20));
    let states = g.settled_states(Duration::from_secs(5));
    assert_eq!(states.len(), 3);
    for (id, digest, _) in &states {
        assert_eq!(
            digest, &states[0].1,
            "replica {id} DEBUG DIGEST after its restart"
        );
    }
    assert!(
        g.replica(first).recovered > 0,
        "the restarted replica read its log"
    );
    let mut direct = Resp::connect(&g.server_addr(first).to_string()).unwrap();
    assert_eq!(direct.cmd(&["GET", "counter"]).unwrap(), acked.to_string());
}

/// Three rounds of: clients INCR their own counters over several connections, the leader is
/// killed, the survivors elect a new one, the killed replica restarts on its log. After every
/// round each counter holds at least what its client saw acknowledged and at most what it
/// sent, and at the end the three servers are identical.
#[test]
fn repeated_leader_failures_with_concurrent_clients() {
    if !have_redis() {
        return;
    }
    let mut g = Group::start("rounds", 3, false);
    let clients = 4;
    let mut acked = vec![0u64; clients];
    let mut sent = vec![0u64; clients];
    for round in 0..3 {
        let leader = g.wait_leader(ELECTION);
        let front = g.front_addr(leader);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers: Vec<_> = (0..clients)
            .map(|i| {
                let (front, stop) = (front.clone(), stop.clone());
                let (mut a, mut s) = (acked[i], sent[i]);
                std::thread::spawn(move || {
                    let Ok(mut c) = Resp::connect(&front) else {
                        return (a, s);
                    };
                    let key = format!("c{i}");
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        s += 1;
                        match c.cmd(&["INCR", &key]) {
                            Ok(n) => a = n.parse().unwrap(),
                            Err(_) => break,
                        }
                    }
                    (a, s)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        g.kill(leader);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for (i, w) in workers.into_iter().enumerate() {
            (acked[i], sent[i]) = w.join().unwrap();
        }
        let next = g.wait_leader(ELECTION);
        let mut c = g.serving_client(next, ELECTION);
        for i in 0..clients {
            let v = c.cmd(&["GET", &format!("c{i}")]).unwrap();
            let v: u64 = if v == "(nil)" { 0 } else { v.parse().unwrap() };
            assert!(
                acked[i] <= v && v <= sent[i],
                "round {round} client {i}: acked {} <= {v} <= sent {}",
                acked[i],
                sent[i]
            );
            // The next round starts from what the log holds.
            (acked[i], sent[i]) = (v, v);
        }
        drop(c);
        g.start_replica(leader);
    }
    assert!(
        acked.iter().all(|&a| a > 0),
        "the clients made progress: {acked:?}"
    );
    g.wait_converged(Duration::from_secs(20));
    let states = g.settled_states(Duration::from_secs(5));
    assert_eq!(states.len(), 3);
    for (id, digest, _) in &states {
        assert_eq!(digest, &states[0].1, "replica {id} after three failovers");
    }
}

/// Four clients at once APPEND to one shared key through the leader (and INCR a shared
/// counter): the order in which their commands run is visible in the value. Every replica's
/// server must end with the same value and the same per-connection replies: the log's order
/// across connections, kept by the applier waiting for the server's answer before it writes
/// on another connection.
#[test]
fn concurrent_clients_on_one_key_leave_every_replica_equal() {
    if !have_redis() {
        return;
    }
    let g = Group::start("shared", 3, false);
    let leader = g.wait_leader(ELECTION);
    let front = g.front_addr(leader);
    let threads: Vec<_> = (0..4)
        .map(|c| {
            let front = front.clone();
            std::thread::spawn(move || {
                let mut cl = Resp::connect(&front).unwrap();
                for i in 0..100 {
                    cl.cmd(&["APPEND", "shared", &format!("{c}.{i},")]).unwrap();
                    cl.cmd(&["INCR", "counter"]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    g.wait_converged(Duration::from_secs(10));
    let states = g.settled_states(Duration::from_secs(5));
    for (id, digest, _) in &states {
        assert_eq!(digest, &states[0].1, "replica {id} DEBUG DIGEST");
    }
    let values: Vec<String> = (1..=3)
        .map(|id| {
            let mut c = Resp::connect(&g.server_addr(id).to_string()).unwrap();
            c.cmd(&["GET", "shared"]).unwrap()
        })
        .collect();
    assert_eq!(values[0].matches(',').count(), 400);
    assert!(values.iter().all(|v| v == &values[0]), "{values:?}");
    let digests = g.ended_digests(4, Duration::from_secs(10));
    for d in &digests[1..] {
        assert_eq!(
            d, &digests[0],
            "INCR replies per connection equal on every replica"
        );
    }
}
