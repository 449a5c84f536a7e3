//! What the listeners refuse: peers that are not members or lie about who sent a message,
//! clients over the bound, clients of a replica that does not lead, idle clients.

mod common;

use common::{have_redis, Resp};
use pliant_smr::child::{redis_argv, ServerChild};
use pliant_smr::group::free_port;
use pliant_smr::{Config, Limits, PeerSpec, Replica};
use pliant_wire::endpoint::Endpoint;
use pliant_wire::{kinds, role, Ca, Conn, Expect, Security};
use protobuf::Message as _;
use raft::prelude::{Message, MessageType};
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn wait(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

struct One {
    replica: Option<Replica>,
    _server: ServerChild,
    members: Vec<PeerSpec>,
    dir: std::path::PathBuf,
}

impl Drop for One {
    fn drop(&mut self) {
        if let Some(r) = self.replica.take() {
            r.stop();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Replica 1 of a group of `members` (the others are never started), with its own redis.
fn one(ca: &Ca, name: &str, members: u64, limits: Limits) -> One {
    let dir = std::env::temp_dir().join(format!("smr-bounds-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port().unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let server = ServerChild::spawn(
        &redis_argv("redis-server", port),
        addr,
        Duration::from_secs(10),
    )
    .unwrap();
    let members: Vec<PeerSpec> = (1..=members)
        .map(|id| PeerSpec {
            id,
            name: format!("smr-{id}"),
            endpoint: Endpoint::Unix(dir.join(format!("peer-{id}.sock"))),
        })
        .collect();
    let replica = Replica::start(Config {
        id: 1,
        members: members.clone(),
        front: Endpoint::Tcp("127.0.0.1:0".into()),
        server: addr,
        dir: dir.join("r1"),
        security: Security::new(ca.issue("smr-1", role::REPLICA, 3600).unwrap()),
        limits,
    })
    .unwrap();
    One {
        replica: Some(replica),
        _server: server,
        members,
        dir,
    }
}

impl One {
    fn r(&self) -> &Replica {
        self.replica.as_ref().unwrap()
    }
    fn front(&self) -> String {
        match self.r().front() {
            Some(Endpoint::Tcp(a)) => a,
            e => panic!("{e:?}"),
        }
    }
}

fn heartbeat(from: u64) -> Vec<u8> {
    let mut m = Message::default();
    m.set_msg_type(MessageType::MsgHeartbeat);
    m.from = from;
    m.to = 1;
    m.term = 1;
    m.write_to_bytes().unwrap()
}

/// Dials replica 1's peer endpoint as `id`'s identity and sends one message claiming `from`.
fn dial_and_send(g: &One, sec: &Security, from: u64) -> bool {
    let ep = &g.members[0].endpoint;
    let expect = Expect {
        name: Some("smr-1".into()),
        roles: role::REPLICA,
    };
    let opts = sec.options(ep, expect, 1 << 16);
    match Conn::connect(ep, &sec.identity, &opts, Duration::from_secs(2), &sec.tcp) {
        Ok(mut c) => c.writer.send_bytes(kinds::SMR, &heartbeat(from)).is_ok(),
        Err(_) => false,
    }
}

#[test]
fn peers_must_be_members_and_send_as_themselves() {
    if !have_redis() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let g = one(&ca, "peers", 3, Limits::default());
    let st = g.r().transport_stats();

    // A member, sending as itself: received.
    let member = Security::new(ca.issue("smr-2", role::REPLICA, 3600).unwrap());
    assert!(dial_and_send(&g, &member, 2));
    assert!(wait(Duration::from_secs(3), || st
        .received
        .load(Ordering::Relaxed)
        == 1));

    // A member claiming another member's id: dropped, connection closed.
    assert!(dial_and_send(&g, &member, 3));
    // A certified replica that is not a member: refused after the handshake.
    let stranger = Security::new(ca.issue("smr-9", role::REPLICA, 3600).unwrap());
    dial_and_send(&g, &stranger, 9);
    assert!(wait(Duration::from_secs(3), || st
        .auth_failures
        .load(Ordering::Relaxed)
        >= 1));
    // Another CA's identity with a member's name: the handshake fails.
    let rogue_ca = Ca::generate(None).unwrap();
    let rogue = Security::new(rogue_ca.issue("smr-2", role::REPLICA, 3600).unwrap());
    assert!(!dial_and_send(&g, &rogue, 2));
    // A member's name without the replica role: refused in the handshake.
    let admin = Security::new(ca.issue("smr-3", role::ADMIN, 3600).unwrap());
    dial_and_send(&g, &admin, 3);
    assert!(wait(Duration::from_secs(3), || st
        .auth_failures
        .load(Ordering::Relaxed)
        >= 2));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        st.received.load(Ordering::Relaxed),
        1,
        "only the honest member's message reached Raft"
    );
}

#[test]
fn a_replica_that_does_not_lead_closes_its_clients() {
    if !have_redis() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    // One of three members, alone: it can never be elected.
    let g = one(&ca, "follower", 3, Limits::default());
    let mut s = TcpStream::connect(g.front()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap_or(0), 0, "closed at once");
    assert_eq!(g.r().front_stats().not_leader.load(Ordering::Relaxed), 1);
}

#[test]
fn clients_over_the_bound_and_idle_clients_are_cut() {
    if !have_redis() {
        return;
    }
    let ca = Ca::generate(None).unwrap();
    let mut limits = Limits::default();
    limits.front.max_clients = 2;
    limits.front.idle = Duration::from_millis(500);
    // A group of one: it elects itself.
    let g = one(&ca, "clients", 1, limits);
    assert!(wait(Duration::from_secs(5), || g.r().is_leader()));
    let mut a = Resp::connect(&g.front()).unwrap();
    let mut b = Resp::connect(&g.front()).unwrap();
    assert_eq!(a.cmd(&["PING"]).unwrap(), "PONG");
    assert_eq!(b.cmd(&["SET", "k", "v"]).unwrap(), "OK");
    let mut c = TcpStream::connect(g.front()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(
        c.read(&mut buf).unwrap_or(0),
        0,
        "the third client is closed"
    );
    assert_eq!(g.r().front_stats().over_bound.load(Ordering::Relaxed), 1);
    // Both first clients fall silent: each is cut after the idle bound.
    let t0 = Instant::now();
    assert!(a.reply().is_err(), "an idle client is cut");
    assert!(t0.elapsed() >= Duration::from_millis(400));
    assert!(b.reply().is_err());
    // Their slots are free again.
    assert!(wait(Duration::from_secs(3), || {
        Resp::connect(&g.front())
            .and_then(|mut d| d.cmd(&["GET", "k"]))
            .map(|v| v == "v")
            .unwrap_or(false)
    }));
}
