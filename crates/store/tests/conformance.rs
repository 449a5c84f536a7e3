//! One suite, two backends: the embedded file store and a real etcd server (started per test on
//! loopback, killed and restarted where a test needs etcd gone). Both must answer alike.

use pliant_lab::etcd::EtcdServer;
use pliant_store::{
    etcd, EtcdOptions, EtcdStore, Event, FileStore, Store, StoreError, Watch, MAX_KEY_BYTES,
};
use std::time::{Duration, Instant};

fn etcd(tag: &str) -> Option<EtcdServer> {
    if !pliant_testkit::require_tool("etcd", "etcd-server")
        || !pliant_testkit::require_tool("etcdctl", "etcd-client")
    {
        return None;
    }
    Some(EtcdServer::scratch(&format!("store-{tag}")).expect("etcd"))
}

fn etcd_store(e: &EtcdServer, prefix: &str) -> EtcdStore {
    let mut o = EtcdOptions::new(vec![e.spec.client_url()], prefix);
    o.request_timeout = Duration::from_millis(1500);
    o.connect_timeout = Duration::from_millis(500);
    EtcdStore::connect(&o).expect("client")
}

/// Waits for `n` watch items (bounded); fewer means the watch lost some.
fn collect(w: &Watch, n: usize) -> Vec<Result<Event, StoreError>> {
    let mut out = Vec::new();
    let t0 = Instant::now();
    while out.len() < n && t0.elapsed() < Duration::from_secs(10) {
        if let Some(item) = w.next_timeout(Duration::from_millis(100)) {
            out.push(item);
        }
    }
    out
}

// ---- the suite: each check takes a fresh, empty store ----

fn kv_and_revisions(s: &mut dyn Store) {
    let r1 = s.put("replicas/1", "a").unwrap();
    assert_eq!(
        s.put("replicas/2", "b"),
        Ok(r1 + 1),
        "each write is one revision"
    );
    assert_eq!(s.put("policy", "p"), Ok(r1 + 2));
    assert_eq!(s.put("replicas/1", "a2"), Ok(r1 + 3));
    let v = s.get("replicas/1").unwrap().unwrap();
    assert_eq!(v.value, "a2");
    assert_eq!(v.mod_revision, r1 + 3);
    assert_eq!(s.get("replicas/9").unwrap(), None);
    let l = s.list("replicas/").unwrap();
    assert_eq!(
        l.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        vec!["replicas/1", "replicas/2"],
        "listing is in key order and only under the prefix"
    );
    assert_eq!(s.delete("replicas/2"), Ok(Some(r1 + 4)));
    assert_eq!(s.delete("replicas/2"), Ok(None), "deleting an absent key");
    assert_eq!(s.list("replicas/").unwrap().len(), 1);
    assert_eq!(s.revision(), r1 + 4);
    assert_eq!(s.health(), Ok(r1 + 4));
}

fn cas(s: &mut dyn Store) {
    let r = s
        .compare_and_swap("epoch", 0, "1")
        .unwrap()
        .expect("absent key, expected 0");
    // Key exists now: "must be absent" fails and reports the current revision.
    assert_eq!(s.compare_and_swap("epoch", 0, "x"), Ok(Err(r)));
    assert_eq!(s.compare_and_swap("epoch", r + 7, "x"), Ok(Err(r)));
    assert_eq!(s.compare_and_swap("epoch", r, "2"), Ok(Ok(r + 1)));
    assert_eq!(s.get("epoch").unwrap().unwrap().value, "2");
    s.delete("epoch").unwrap();
    assert!(
        s.compare_and_swap("epoch", 0, "3").unwrap().is_ok(),
        "absent again"
    );
}

fn bad_input(s: &mut dyn Store, max_value: usize) {
    let r0 = s.revision();
    assert!(matches!(s.put("", "v"), Err(StoreError::BadKey(_))));
    let long = "k".repeat(MAX_KEY_BYTES + 1);
    assert!(matches!(s.put(&long, "v"), Err(StoreError::BadKey(_))));
    assert!(matches!(s.get(&long), Err(StoreError::BadKey(_))));
    let big = "v".repeat(max_value + 1);
    match s.put("k", &big) {
        Err(StoreError::TooLarge { len, max, .. }) => {
            assert_eq!((len, max), (max_value + 1, max_value))
        }
        other => panic!("oversized value: {other:?}"),
    }
    assert!(matches!(
        s.compare_and_swap("k", 0, &big),
        Err(StoreError::TooLarge { .. })
    ));
    assert_eq!(s.revision(), r0, "refused writes change nothing");
    assert_eq!(s.get("k").unwrap(), None);
    // The largest accepted value goes through whole.
    let ok = "w".repeat(max_value);
    s.put("k", &ok).unwrap();
    assert_eq!(s.get("k").unwrap().unwrap().value.len(), max_value);
}

fn watch_backlog_then_live(s: &mut dyn Store) {
    let start = s.put("b/0", "before").unwrap();
    s.put("a/1", "x").unwrap();
    s.put("b/1", "y").unwrap();
    s.put("a/2", "z").unwrap();
    s.delete("a/1").unwrap();
    let w = s.watch("a/", start).unwrap();
    let got = collect(&w, 3);
    let got: Vec<Event> = got.into_iter().map(|e| e.unwrap()).collect();
    assert_eq!(
        got.iter()
            .map(|e| (e.key.as_str(), e.value.as_deref()))
            .collect::<Vec<_>>(),
        vec![("a/1", Some("x")), ("a/2", Some("z")), ("a/1", None)],
        "history after `since`, only under the prefix, deletes as None, in order"
    );
    assert!(got.windows(2).all(|p| p[0].revision < p[1].revision));
    // Live changes follow, the other prefix stays out.
    s.put("b/2", "no").unwrap();
    let r = s.put("a/3", "live").unwrap();
    let live = collect(&w, 1);
    assert_eq!(live.len(), 1);
    let e = live.into_iter().next().unwrap().unwrap();
    assert_eq!(
        (e.key.as_str(), e.value.as_deref(), e.revision),
        ("a/3", Some("live"), r)
    );
    // And nothing else arrives.
    assert!(w.next_timeout(Duration::from_millis(300)).is_none());
}

#[test]
fn file_store_conformance() {
    kv_and_revisions(&mut FileStore::in_memory());
    cas(&mut FileStore::in_memory());
    bad_input(&mut FileStore::in_memory(), pliant_store::MAX_VALUE_BYTES);
    watch_backlog_then_live(&mut FileStore::in_memory());
}

#[test]
fn etcd_store_conformance() {
    let Some(e) = etcd("conf") else { return };
    // A fresh prefix per check: the same "empty store" the file backend starts from.
    kv_and_revisions(&mut etcd_store(&e, "/t/kv/"));
    cas(&mut etcd_store(&e, "/t/cas/"));
    bad_input(&mut etcd_store(&e, "/t/bad/"), etcd::MAX_VALUE_BYTES);
    watch_backlog_then_live(&mut etcd_store(&e, "/t/watch/"));
}

#[test]
fn etcd_prefixes_isolate_clusters() {
    let Some(e) = etcd("prefix") else { return };
    let mut a = etcd_store(&e, "/pliant/a/");
    let mut b = etcd_store(&e, "/pliant/b/");
    a.put("policy", "A").unwrap();
    b.put("policy", "B").unwrap();
    assert_eq!(a.get("policy").unwrap().unwrap().value, "A");
    assert_eq!(a.list("").unwrap().len(), 1, "b's keys are not a's");
    assert_eq!(
        a.list("").unwrap()[0].0,
        "policy",
        "keys come back without the prefix"
    );
    assert!(EtcdStore::connect(&EtcdOptions::new(vec![e.spec.client_url()], "nodelim")).is_err());
    assert!(EtcdStore::connect(&EtcdOptions::new(vec![], "/x/")).is_err());
}

#[test]
fn compacted_history_ends_a_watch() {
    // File backend: history beyond MAX_EVENTS is dropped.
    let mut f = FileStore::in_memory();
    for i in 0..(pliant_store::MAX_EVENTS + 10) {
        f.put("k", &i.to_string()).unwrap();
    }
    assert!(matches!(f.watch("", 0), Err(StoreError::Compacted { .. })));
    let Some(e) = etcd("compact") else { return };
    let mut s = etcd_store(&e, "/t/compact/");
    let first = s.put("k", "0").unwrap();
    for i in 1..20 {
        s.put("k", &i.to_string()).unwrap();
    }
    s.compact(s.revision()).unwrap();
    let w = s.watch("", first).unwrap();
    match collect(&w, 1).pop() {
        Some(Err(StoreError::Compacted { asked, oldest })) => {
            assert_eq!(asked, first);
            assert!(oldest > first);
        }
        other => panic!("watch from a compacted revision: {other:?}"),
    }
    assert!(
        w.next_timeout(Duration::from_millis(300)).is_none(),
        "the watch ended"
    );
}

#[test]
fn etcd_outage_is_reported_and_the_watch_resumes_without_gaps() {
    let Some(mut e) = etcd("outage") else { return };
    let mut s = etcd_store(&e, "/t/outage/");
    let since = s.put("x/0", "a").unwrap();
    let w = s.watch("x/", since).unwrap();
    let r1 = s.put("x/1", "b").unwrap();
    assert_eq!(collect(&w, 1).pop().unwrap().unwrap().revision, r1);

    e.kill();
    let t0 = Instant::now();
    for (what, res) in [
        ("put", s.put("x/2", "c").map(|_| ())),
        ("get", s.get("x/1").map(|_| ())),
        ("health", s.health().map(|_| ())),
    ] {
        assert!(
            matches!(res, Err(StoreError::Unavailable { .. })),
            "{what} with etcd down: {res:?}"
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "each call is bounded by the request timeout"
    );
    assert!(w.next_timeout(Duration::from_millis(500)).is_none());

    e.restart().unwrap();
    // The same client works again, and the watch picks up where it was: the next change
    // arrives once, nothing from before the outage again.
    let t0 = Instant::now();
    let r2 = loop {
        match s.put("x/3", "d") {
            Ok(r) => break r,
            Err(err) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(err) => panic!("etcd back, put still fails: {err}"),
        }
    };
    let got = collect(&w, 1);
    let ev = got.into_iter().next().expect("watch resumed").unwrap();
    assert_eq!((ev.key.as_str(), ev.revision), ("x/3", r2));
    assert!(
        w.next_timeout(Duration::from_millis(500)).is_none(),
        "no duplicate"
    );
    assert!(s.health().is_ok());
}

#[test]
fn etcd_over_mutual_tls_serves_only_certified_clients() {
    if !pliant_testkit::require_tool("etcd", "etcd-server")
        || !pliant_testkit::require_tool("etcdctl", "etcd-client")
    {
        return;
    }
    let e = EtcdServer::scratch_tls("store-tls").expect("etcd over TLS");
    let pki = e.spec.tls.clone().expect("pki");
    let url = e.spec.client_url();
    assert!(url.starts_with("https://"), "{url}");
    let opts = |tls: Option<pliant_store::etcd::EtcdTls>| {
        let mut o = EtcdOptions::new(vec![url.clone()], "/t/tls/");
        o.request_timeout = Duration::from_millis(1500);
        o.connect_timeout = Duration::from_millis(500);
        o.tls = tls;
        o
    };
    let certified = pliant_store::etcd::EtcdTls {
        ca: pki.ca.clone(),
        cert: pki.client_cert.clone(),
        key: pki.client_key.clone(),
    };
    let mut s = EtcdStore::connect(&opts(Some(certified.clone()))).expect("client");
    let r = s.put("k", "over tls").unwrap();
    assert_eq!(s.get("k").unwrap().unwrap().mod_revision, r);
    // A client whose certificate etcd's CA did not sign (the server's own pair presented as a
    // client: wrong usage) is refused; so is one without any certificate (plain HTTP/2 on a
    // TLS port).
    let wrong = pliant_store::etcd::EtcdTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        ..certified.clone()
    };
    let s2 = EtcdStore::connect(&opts(Some(wrong))).expect("client");
    assert!(
        s2.get("k").is_err(),
        "a certificate without client usage is refused"
    );
    let mut plain = opts(None);
    plain.endpoints = vec![url.replace("https://", "http://")];
    let s3 = EtcdStore::connect(&plain).expect("client");
    assert!(s3.get("k").is_err(), "no certificate, no answer");
    // The key file must be private.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pki.client_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    match EtcdStore::connect(&opts(Some(certified))) {
        Err(StoreError::Backend { reason, .. }) => {
            assert!(reason.contains("client.key"), "{reason}")
        }
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("a world-readable key was used"),
    }
}
