//! Helpers shared by the integration tests.
#![allow(dead_code)]

use pliant_coherence::{ClientOptions, HubClient, HubConfig, HubServer};
use pliant_ha::auth::Secret;
use pliant_state::{SharedConfig, SharedStore};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
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

pub fn secret(b: u8) -> Secret {
    Secret::from_bytes(&[b; 32]).unwrap()
}

pub fn hub(d: &TempDir, cfg: HubConfig) -> HubServer {
    HubServer::start(&d.join("hub.sock"), secret(1), cfg).unwrap()
}

/// Generous timeouts: the suite shares two cores with other builds; a hang still fails.
pub fn opts() -> ClientOptions {
    ClientOptions {
        request_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

pub fn client(d: &TempDir, replica: u32) -> Arc<HubClient> {
    Arc::new(HubClient::new(
        &d.join("hub.sock"),
        secret(1),
        replica,
        &format!("r{replica}"),
        opts(),
    ))
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
