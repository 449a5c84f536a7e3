//! The hub over a real unix socket: combiners (PUSH/PULL, merge on retire), SYNCH with leases
//! and fencing, authentication and malformed input.

mod common;

use common::*;
use pliant_coherence::wire::{self, Request};
use pliant_coherence::{HubClient, HubConfig};
use pliant_ha::auth::client_handshake;
use pliant_state::{
    Coherence, GetFlags, LockService, PutFlags, SharedConfig, SharedExport, StateError,
};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn u64_of(b: &[u8]) -> u64 {
    pliant_state::shared::decode_u64(b)
}

#[test]
fn push_pull_converges_across_threads_and_merge_withdraws_the_dying_copy() {
    let d = TempDir::new("combiner");
    let srv = hub(&d, HubConfig::default());
    let mode = std::fs::metadata(d.join("hub.sock"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // Each replica runs in its own thread with its own client and connection.
    let barrier = Arc::new(Barrier::new(2));
    let run = |replica: u32, adds: u64| {
        let d = d.0.clone();
        let barrier = barrier.clone();
        std::thread::spawn(move || {
            let dir = TempDirRef(d);
            let (mut s, _c) = dir.store(replica);
            s.create_counter("pkts").unwrap();
            for _ in 0..adds {
                s.counter_add("pkts", 1, PutFlags::Local).unwrap();
            }
            s.counter_add("pkts", 0, PutFlags::Push).unwrap();
            // Both contributions are published once both threads pass the barrier.
            barrier.wait();
            let pulled = s.counter_read("pkts", GetFlags::Pull).unwrap();
            (s, pulled)
        })
    };
    let a = run(1, 300);
    let b = run(2, 45);
    let (mut sa, pa) = a.join().unwrap();
    let (sb, pb) = b.join().unwrap();
    assert_eq!(pa, 345);
    assert_eq!(pb, 345);
    assert_eq!(
        srv.store().contribution("pkts", 2).map(|v| u64_of(&v)),
        Some(45)
    );
    // Replica 2 is destroyed: its export travels (as bytes) to replica 1, which merges it.
    let mut sb = sb;
    sb.counter_add("pkts", 5, PutFlags::Local).unwrap(); // unpublished, must not be lost
    let export = SharedExport::from_bytes(&sb.retire().unwrap().to_bytes().unwrap()).unwrap();
    let report = sa.merge_from(&export).unwrap();
    assert_eq!(report.merged, vec!["pkts".to_string()]);
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    assert_eq!(
        srv.store().contribution("pkts", 2),
        None,
        "dying copy withdrawn"
    );
    assert_eq!(
        srv.store().contribution("pkts", 1).map(|v| u64_of(&v)),
        Some(350)
    );
    assert_eq!(sa.counter_read("pkts", GetFlags::Pull).unwrap(), 350);
    // A retired replica cannot bring its contribution back.
    assert!(matches!(
        sb.counter_add("pkts", 1, PutFlags::Push),
        Err(StateError::SharedMode { .. })
    ));
    // A third replica joining later sees the total.
    let (mut sc, _) = store(&d, 3, SharedConfig::default());
    sc.create_counter("pkts").unwrap();
    assert_eq!(sc.counter_read("pkts", GetFlags::Pull).unwrap(), 350);
}

/// `TempDir` without the cleanup (the owning test keeps the real one).
struct TempDirRef(std::path::PathBuf);
impl TempDirRef {
    fn store(&self, replica: u32) -> (pliant_state::SharedStore, Arc<HubClient>) {
        let c = Arc::new(HubClient::new(
            &self.0.join("hub.sock"),
            secret(1),
            replica,
            &format!("r{replica}"),
            opts(),
        ));
        (
            pliant_state::SharedStore::new(replica, SharedConfig::default(), c.clone(), c.clone()),
            c,
        )
    }
}

/// Two replicas increment one strongly consistent counter under SYNCH: every increment is a
/// read-modify-write under the hub's lock, so none is lost.
#[test]
fn synch_counter_under_contention_loses_no_update() {
    let d = TempDir::new("synch");
    let srv = hub(&d, HubConfig::default());
    const N: u64 = 200;
    let spawn = |replica: u32| {
        let dir = TempDirRef(d.0.clone());
        std::thread::spawn(move || {
            let cfg = SharedConfig {
                // Long enough that no lease runs out in this test, even on a loaded machine.
                lock_lease: Duration::from_secs(30),
                ..Default::default()
            };
            let c = Arc::new(HubClient::new(
                &dir.0.join("hub.sock"),
                secret(1),
                replica,
                &format!("r{replica}"),
                opts(),
            ));
            let mut s = pliant_state::SharedStore::new(replica, cfg, c.clone(), c);
            s.create_shared("total", 0u64.to_le_bytes().to_vec(), None)
                .unwrap();
            let mut refused = 0u64;
            let mut done = 0;
            while done < N {
                s.set_now(Instant::now());
                let r = match s.get_shared("total", GetFlags::Synch) {
                    Ok(r) => r,
                    Err(StateError::Locked(_)) => {
                        refused += 1;
                        std::thread::yield_now();
                        continue;
                    }
                    Err(e) => panic!("replica {replica}: {e}"),
                };
                s.add_u64(&r, 1);
                s.put_shared(r, PutFlags::Synch).unwrap();
                done += 1;
            }
            (s.stats(), refused)
        })
    };
    let a = spawn(1);
    let b = spawn(2);
    let (sa, ra) = a.join().unwrap();
    let (sb, rb) = b.join().unwrap();
    assert_eq!(sa.synch_puts, N);
    assert_eq!(sb.synch_puts, N);
    assert_eq!(sa.lock_refused, ra);
    assert_eq!(sb.lock_refused, rb);
    let (version, bytes) = srv.store().latest("total").unwrap();
    assert_eq!(u64_of(&bytes), 2 * N, "lost update");
    assert_eq!(version, 2 * N);
    let st = srv.stats();
    assert_eq!(st.lock_grants, 2 * N);
    assert_eq!(st.lock_refused, ra + rb);
    assert_eq!(st.lease_lost, 0);
}

#[test]
fn an_expired_lease_lets_the_other_replica_in_and_fences_the_old_holder() {
    let d = TempDir::new("lease");
    let srv = hub(&d, HubConfig::default());
    // Leases far longer than any stall of this test: the hub's clock is moved past the slow
    // holder's lease instead of waiting for it.
    let lease = Duration::from_secs(30);
    let cfg = SharedConfig {
        lock_lease: lease,
        ..Default::default()
    };
    let (mut slow, slow_client) = store(&d, 1, cfg.clone());
    let (mut fast, fast_client) = store(&d, 2, cfg);
    for s in [&mut slow, &mut fast] {
        s.create_shared("cfg", b"v0".to_vec(), None).unwrap();
    }
    let r_slow = slow.get_shared("cfg", GetFlags::Synch).unwrap();
    // While the lease runs, the other replica is refused.
    assert_eq!(
        fast.get_shared("cfg", GetFlags::Synch).unwrap_err(),
        StateError::Locked("cfg".into())
    );
    // The hub's clock, not ours, decides: past the lease, the other replica gets the lock.
    srv.advance_clock(lease + Duration::from_secs(1));
    let r_fast = fast.get_shared("cfg", GetFlags::Synch).unwrap();
    fast.value_mut(&r_fast).clear();
    fast.value_mut(&r_fast).extend_from_slice(b"fast");
    fast.put_shared(r_fast, PutFlags::Synch).unwrap();
    // The old holder's write is fenced off.
    slow.value_mut(&r_slow).clear();
    slow.value_mut(&r_slow).extend_from_slice(b"slow");
    assert_eq!(
        slow.put_shared(r_slow, PutFlags::Synch).unwrap_err(),
        StateError::LeaseLost("cfg".into())
    );
    assert_eq!(slow.stats().fenced, 1);
    assert_eq!(srv.store().latest("cfg").unwrap().1, b"fast".to_vec());
    assert!(srv.stats().lease_lost >= 1);
    // The fenced replica's next transaction sees the newest copy.
    let r = slow.get_shared("cfg", GetFlags::Synch).unwrap();
    assert_eq!(slow.value(&r), b"fast");
    slow.put_shared(r, PutFlags::Synch).unwrap();
    // Every SYNCH get took its copy from the lock grant: no separate fetch round trip.
    assert_eq!(slow_client.stats().prefetch_hits, 2);
    assert_eq!(fast_client.stats().prefetch_hits, 1);
}

#[test]
fn the_copy_from_a_grant_is_not_used_after_unlock() {
    let d = TempDir::new("prefetch");
    let _srv = hub(&d, HubConfig::default());
    let a = client(&d, 1);
    let b = client(&d, 2);
    let lease = Duration::from_secs(30);
    let t = a.lock("k", 1, lease, Instant::now()).unwrap();
    a.publish_latest("k", &t, b"a1").unwrap();
    // After its own publish, a's fetch goes to the hub (the grant's copy is older).
    assert_eq!(a.fetch_latest("k").unwrap().unwrap().1, b"a1".to_vec());
    a.unlock("k", &t).unwrap();
    let t = a.lock("k", 1, lease, Instant::now()).unwrap();
    a.unlock("k", &t).unwrap();
    let tb = b.lock("k", 2, lease, Instant::now()).unwrap();
    b.publish_latest("k", &tb, b"b1").unwrap();
    b.unlock("k", &tb).unwrap();
    // a's last grant carried "a1"; since it unlocked, b published: a must see b's copy.
    assert_eq!(a.fetch_latest("k").unwrap().unwrap().1, b"b1".to_vec());
    assert_eq!(a.stats().prefetch_hits, 0);
}

#[test]
fn connections_over_the_bound_are_refused_and_counted() {
    let d = TempDir::new("conns");
    let srv = hub(
        &d,
        HubConfig {
            max_connections: 1,
            ..Default::default()
        },
    );
    let a = client(&d, 1);
    a.publish("k", 1, b"a").unwrap();
    let b = client(&d, 2);
    let e = b.publish("k", 2, b"b").unwrap_err();
    assert!(e.to_string().contains("authentication"), "{e}");
    assert_eq!(srv.stats().over_bound, 1);
    // The first connection is unaffected; once it closes, a new client gets in.
    a.publish("k", 1, b"a2").unwrap();
    drop(a);
    wait_until("the first connection closed", || srv.stats().active == 0);
    let c = client(&d, 3);
    c.publish("k", 3, b"c").unwrap();
}

#[test]
fn a_fence_from_another_hub_instance_is_refused() {
    let d = TempDir::new("fence");
    let _srv = hub(&d, HubConfig::default());
    let c = client(&d, 1);
    let t = c
        .lock("k", 1, Duration::from_secs(5), Instant::now())
        .unwrap();
    // Fences below the hub's base were never issued by it (e.g. by a previous instance).
    let mut old = t;
    old.fence = 3;
    assert_eq!(
        c.publish_latest("k", &old, b"x").unwrap_err(),
        StateError::LeaseLost("k".into())
    );
    assert_eq!(
        c.unlock("k", &old).unwrap_err(),
        StateError::LeaseLost("k".into())
    );
    c.publish_latest("k", &t, b"y").unwrap();
    c.unlock("k", &t).unwrap();
    // A client speaks only for its own replica.
    let e = c.publish("k2", 9, b"z").unwrap_err();
    assert!(e.to_string().contains("speaks for replica 1"), "{e}");
}

#[test]
fn wrong_secret_is_refused_and_counted() {
    let d = TempDir::new("auth");
    let srv = hub(&d, HubConfig::default());
    let bad = HubClient::new(&d.join("hub.sock"), secret(2), 5, "r5", opts());
    let e = bad.publish("k", 5, b"v").unwrap_err();
    assert!(e.to_string().contains("authentication"), "{e}");
    wait_until("auth failure counted", || srv.stats().auth_failures == 1);
    assert_eq!(srv.store().contribution("k", 5), None);
    // The backoff makes the next call fail at once, without a connection attempt.
    let e = bad.publish("k", 5, b"v").unwrap_err();
    assert!(e.to_string().contains("next attempt"), "{e}");
    assert_eq!(bad.stats().fast_failures, 1);
    assert_eq!(srv.stats().connections, 1);
    // A good client is unaffected.
    let good = client(&d, 6);
    good.publish("k", 6, b"v").unwrap();
    assert_eq!(srv.stats().auth_failures, 1);
}

fn raw(d: &TempDir) -> UnixStream {
    let mut s = UnixStream::connect(d.join("hub.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    client_handshake(&mut s, &secret(1)).unwrap();
    s
}

fn send_frame(s: &mut UnixStream, r: &Request<'_>) {
    let mut buf = Vec::new();
    wire::encode_into(r, &mut buf, 1 << 20).unwrap();
    s.write_all(&buf).unwrap();
}

/// Reads until EOF (the hub closed); bounded by the read timeout.
fn closed_by_hub(s: &mut UnixStream) -> bool {
    let mut sink = Vec::new();
    s.read_to_end(&mut sink).is_ok()
}

#[test]
fn malformed_frames_are_counted_and_the_hub_survives() {
    let d = TempDir::new("malformed");
    let srv = hub(&d, HubConfig::default());
    let hello = Request::Hello {
        version: wire::PROTOCOL_VERSION,
        replica: 7,
        name: "r7",
    };
    // 1. Garbage body after Hello: answered with a protocol error, then closed.
    let mut s = raw(&d);
    send_frame(&mut s, &hello);
    let mut body = Vec::new();
    assert!(wire::read_frame(&mut s, &mut body, 1 << 20).unwrap());
    s.write_all(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).unwrap();
    assert!(wire::read_frame(&mut s, &mut body, 1 << 20).unwrap());
    let r: wire::Response = wire::decode(&body).unwrap();
    assert!(
        matches!(&r, wire::Response::Error { error: wire::WireError::Protocol(m), .. } if m.contains("malformed")),
        "{r:?}"
    );
    assert!(closed_by_hub(&mut s));
    // 2. A length over the bound: closed.
    let mut s = raw(&d);
    send_frame(&mut s, &hello);
    assert!(wire::read_frame(&mut s, &mut body, 1 << 20).unwrap());
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(closed_by_hub(&mut s));
    // 3. No Hello first.
    let mut s = raw(&d);
    send_frame(&mut s, &Request::FetchLatest { key: "k" });
    assert!(wire::read_frame(&mut s, &mut body, 1 << 20).unwrap());
    assert!(closed_by_hub(&mut s));
    // 4. Garbage instead of the handshake answer.
    let mut s = UnixStream::connect(d.join("hub.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut nonce = [0u8; 32];
    s.read_exact(&mut nonce).unwrap();
    s.write_all(&[0x55; 64]).unwrap();
    assert!(closed_by_hub(&mut s));
    // 5. A truncated frame then EOF.
    let mut s = raw(&d);
    send_frame(&mut s, &hello);
    assert!(wire::read_frame(&mut s, &mut body, 1 << 20).unwrap());
    s.write_all(&[10, 0, 0, 0, 1, 2]).unwrap();
    drop(s);
    wait_until("all bad connections closed", || srv.stats().active == 0);
    let st = srv.stats();
    assert_eq!(st.decode_errors, 1, "{st:?}");
    assert_eq!(st.oversize_frames, 1, "{st:?}");
    assert_eq!(st.protocol_errors, 1, "{st:?}");
    assert_eq!(st.auth_failures, 1, "{st:?}");
    // The hub still serves.
    let c = client(&d, 8);
    c.publish("k", 8, b"ok").unwrap();
    assert_eq!(srv.store().contribution("k", 8), Some(b"ok".to_vec()));
}

#[test]
fn bounds_are_refused_with_typed_errors() {
    let d = TempDir::new("bounds");
    let cfg = HubConfig {
        limits: pliant_state::HubConfig {
            max_keys: 2,
            max_replicas_per_key: 8,
            max_value_bytes: 16,
        },
        max_frame_bytes: 256,
        ..Default::default()
    };
    let srv = hub(&d, cfg);
    let c = client(&d, 1);
    c.publish("a", 1, b"1").unwrap();
    c.publish("b", 1, b"1").unwrap();
    assert!(matches!(
        c.publish("c", 1, b"1"),
        Err(StateError::SharedLimit {
            what: "hub keys",
            max: 2,
            ..
        })
    ));
    assert!(matches!(
        c.publish("a", 1, &[0; 17]),
        Err(StateError::SharedLimit {
            what: "hub value bytes",
            max: 16,
            ..
        })
    ));
    // A request over the client's frame bound is refused before it is sent.
    let small = HubClient::new(
        &d.join("hub.sock"),
        secret(1),
        2,
        "r2",
        pliant_coherence::ClientOptions {
            max_frame_bytes: 64,
            ..opts()
        },
    );
    assert!(matches!(
        small.publish("a", 2, &[0; 100]),
        Err(StateError::SharedLimit {
            what: "hub request bytes",
            ..
        })
    ));
    // A second name claiming an id is refused.
    let twin = HubClient::new(&d.join("hub.sock"), secret(1), 1, "not-r1", opts());
    let e = twin.publish("a", 1, b"x").unwrap_err();
    assert!(e.to_string().contains("registered to \"r1\""), "{e}");
    assert_eq!(srv.stats().id_refused, 1);
    assert!(srv.stats().refused >= 2);
}

#[test]
fn a_restarted_hub_is_reconnected_to_and_its_versions_are_newer() {
    let d = TempDir::new("restart");
    let srv = hub(&d, HubConfig::default());
    let c = client(&d, 1);
    let t = c
        .lock("k", 1, Duration::from_secs(5), Instant::now())
        .unwrap();
    let v1 = c.publish_latest("k", &t, b"one").unwrap();
    c.unlock("k", &t).unwrap();
    drop(srv);
    // The client still holds the old connection; the first call after the restart finds it
    // dead and reconnects transparently (the write fails, so the request was not delivered).
    std::thread::sleep(Duration::from_millis(2));
    let srv = hub(&d, HubConfig::default());
    c.publish("p", 1, b"x").unwrap();
    assert_eq!(srv.store().contribution("p", 1), Some(b"x".to_vec()));
    assert!(c.stats().connects >= 2);
    let t2 = c
        .lock("k", 1, Duration::from_secs(5), Instant::now())
        .unwrap();
    assert!(t2.fence > t.fence, "fences grow across hub restarts");
    let v2 = c.publish_latest("k", &t2, b"two").unwrap();
    assert!(v2 > v1, "versions grow across hub restarts");
    // The old token is worthless on the new hub.
    assert_eq!(
        c.publish_latest("k", &t, b"stale").unwrap_err(),
        StateError::LeaseLost("k".into())
    );
    c.unlock("k", &t2).unwrap();
}

#[test]
fn no_hub_is_a_clear_error_not_a_hang() {
    let d = TempDir::new("nohub");
    let c = client(&d, 1);
    let e = c.fetch_latest("k").unwrap_err();
    assert!(
        matches!(&e, StateError::Coherence { reason, .. } if reason.contains("cannot connect")),
        "{e}"
    );
    assert_eq!(c.stats().connect_failures, 1);
}
