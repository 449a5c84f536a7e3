//! Helpers shared by the integration tests.
#![allow(dead_code)]

use pliant_coherence::{ClientOptions, HubClient, HubConfig, HubServer};
use pliant_state::{SharedConfig, SharedStore};
use pliant_wire::{role, Ca, Endpoint, Security};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A private directory removed on drop (also when the test fails).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let p = std::env::temp_dir().join(format!(
            "pliant-coh-{tag}-{}-{}-{nanos:x}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
        ));
        std::fs::create_dir(&p).unwrap();
        TempDir(p)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The deployment's CA, shared by the tests of one binary.
pub fn ca() -> &'static Ca {
    static CA: OnceLock<Ca> = OnceLock::new();
    CA.get_or_init(|| Ca::generate(None).unwrap())
}

/// An identity of the test CA named `name` with `roles`.
pub fn sec_with(name: &str, roles: u32) -> Security {
    Security::new(ca().issue(name, roles, 3600).unwrap())
}

/// A replica identity; a decimal name maps to that number as the replica id.
pub fn replica_sec(name: &str) -> Security {
    sec_with(name, role::REPLICA)
}

/// The hub's identity (service role).
pub fn hub_sec() -> Security {
    sec_with("hub", role::SERVICE)
}

/// The hub's unix endpoint in `d`.
pub fn hub_ep(d: &Path) -> Endpoint {
    Endpoint::Unix(d.join("hub.sock"))
}

pub fn hub(d: &TempDir, cfg: HubConfig) -> HubServer {
    HubServer::start(&hub_ep(&d.0), hub_sec(), cfg).unwrap()
}

/// Generous timeouts: the suite shares two cores with other builds; a hang still fails.
pub fn opts() -> ClientOptions {
    ClientOptions {
        request_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// A client of the hub in `d` certified as replica `replica` (named by its number, so its id
/// is `replica`).
pub fn client(d: &TempDir, replica: u32) -> Arc<HubClient> {
    let c = Arc::new(HubClient::new(
        &hub_ep(&d.0),
        replica_sec(&replica.to_string()),
        opts(),
    ));
    assert_eq!(c.replica(), replica);
    c
}

pub fn store(d: &TempDir, replica: u32, cfg: SharedConfig) -> (SharedStore, Arc<HubClient>) {
    let c = client(d, replica);
    (SharedStore::new(replica, cfg, c.clone(), c.clone()), c)
}

/// Polls `f` until it holds; panics after a bound far above what any step needs.
pub fn wait_until<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}
