//! Leadership on a real etcd: one leader at a time, terms that only grow, takeover on lease
//! expiry and (fast) on proof of death, writes of a deposed leader refused by etcd.

use pliant_lab::etcd::EtcdServer;
use pliant_store::{Candidate, EtcdOptions, EtcdStore, Seen, Store, StoreError, Verdict};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

fn etcd(tag: &str) -> Option<EtcdServer> {
    if !pliant_testkit::require_tool("etcd", "etcd-server")
        || !pliant_testkit::require_tool("etcdctl", "etcd-client")
    {
        return None;
    }
    Some(EtcdServer::scratch(&format!("leader-{tag}")).expect("etcd"))
}

fn client(e: &EtcdServer) -> EtcdStore {
    let mut o = EtcdOptions::new(vec![e.spec.client_url()], "/pliant/lead/");
    o.request_timeout = Duration::from_millis(1000);
    o.connect_timeout = Duration::from_millis(500);
    EtcdStore::connect(&o).expect("client")
}

fn me(name: &str) -> Candidate {
    Candidate {
        name: name.into(),
        api: format!("127.0.0.1:1/{name}"),
    }
}

const TTL: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(20);

#[test]
fn one_leader_then_the_next_on_lease_expiry_with_a_higher_term() {
    let Some(e) = etcd("expiry") else { return };
    let (mut a, b) = (client(&e), client(&e));
    let stop = AtomicBool::new(false);
    let la = a
        .campaign(&me("a"), TTL, POLL, &stop, |_| Verdict::Wait)
        .unwrap()
        .expect("a leads an empty election");
    assert!(la.valid());
    let seen = b.leader().unwrap().expect("a leader");
    assert_eq!((seen.candidate.name.as_str(), seen.term), ("a", la.term));
    // b cannot lead while a's lease lives.
    let lease_b = b.grant_lease(TTL).unwrap();
    match b.try_lead(&me("b"), &lease_b).unwrap() {
        Err(l) => assert_eq!(l.term, la.term),
        Ok(_) => panic!("two leaders"),
    }
    a.fence_writes(la.term);
    a.put("placement", "by a").unwrap();
    let term_a = la.term;
    // a stops keeping its lease alive (a process frozen or gone without closing anything).
    drop(la);
    let t0 = Instant::now();
    let mut observed = 0;
    let lb = b
        .campaign(&me("b"), TTL, POLL, &stop, |seen| {
            match seen {
                Seen::Leader(l) => assert_eq!(l.candidate.name, "a"),
                Seen::Unavailable(e) => panic!("etcd runs: {e}"),
            }
            observed += 1;
            Verdict::Wait
        })
        .unwrap()
        .expect("b leads once a's lease ended");
    let waited = t0.elapsed();
    assert!(observed > 0, "b waited behind a");
    assert!(
        lb.term > term_a,
        "terms only grow: {} then {}",
        term_a,
        lb.term
    );
    // The lease outlives its TTL from a's last keep-alive, never much more (etcd checks
    // expiry every 500 ms).
    assert!(
        waited < TTL + Duration::from_secs(3),
        "takeover took {waited:?}"
    );
    // a's late write is refused by etcd; b's goes through.
    match a.put("placement", "late a") {
        Err(StoreError::Deposed { term, current }) => {
            assert_eq!((term, current), (term_a, lb.term))
        }
        other => panic!("a deposed leader's write: {other:?}"),
    }
    let mut b = b;
    b.fence_writes(lb.term);
    b.put("placement", "by b").unwrap();
    assert!(matches!(
        a.compare_and_swap("placement", 0, "x"),
        Err(StoreError::Deposed { .. })
    ));
    assert!(matches!(
        a.delete("placement"),
        Err(StoreError::Deposed { .. })
    ));
    assert_eq!(b.get("placement").unwrap().unwrap().value, "by b");
}

#[test]
fn proof_of_death_deposes_at_once_and_the_old_leader_learns_it_lost() {
    let Some(e) = etcd("depose") else { return };
    let (a, b) = (client(&e), client(&e));
    let stop = AtomicBool::new(false);
    let la = a
        .campaign(&me("a"), TTL, POLL, &stop, |_| Verdict::Wait)
        .unwrap()
        .unwrap();
    let t0 = Instant::now();
    let lb = b
        .campaign(&me("b"), TTL, POLL, &stop, |_| Verdict::Depose)
        .unwrap()
        .unwrap();
    let took = t0.elapsed();
    assert!(lb.term > la.term);
    assert!(took < TTL, "deposing does not wait for the TTL: {took:?}");
    // a's keep-alives now find its lease gone: its leadership ends within one keep-alive
    // period (a third of the TTL), never later than the TTL.
    let t1 = Instant::now();
    while la.valid() {
        assert!(
            t1.elapsed() < TTL + Duration::from_millis(500),
            "a still believes it leads"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_leader_cut_off_from_etcd_stops_counting_itself_leader_within_the_ttl() {
    let Some(mut e) = etcd("cutoff") else { return };
    let a = client(&e);
    let stop = AtomicBool::new(false);
    let la = a
        .campaign(&me("a"), TTL, POLL, &stop, |_| Verdict::Wait)
        .unwrap()
        .unwrap();
    let remaining = la.remaining();
    assert!(remaining <= TTL && remaining > Duration::ZERO);
    e.kill();
    let t0 = Instant::now();
    while la.valid() {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Valid for at most the TTL after the last acknowledged keep-alive.
    assert!(
        t0.elapsed() <= TTL + Duration::from_millis(200),
        "{:?}",
        t0.elapsed()
    );
    // A campaign while etcd is down waits (and can be stopped) instead of failing.
    let stop_now = AtomicBool::new(true);
    assert!(a
        .campaign(&me("a"), TTL, POLL, &stop_now, |_| Verdict::Wait)
        .unwrap()
        .is_none());
}
