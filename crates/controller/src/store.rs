//! The controller's store: a small key/value space with revisions, behind the [`Store`] trait.
//!
//! The trait follows etcd's data model on purpose (string keys, opaque values, one global
//! revision that every write increments, per-key `mod_revision`, compare-and-swap on it, a watch
//! as "changes since revision R under prefix P"), so an etcd backend can implement it later
//! without touching the controller. [`FileStore`] is the embedded single-host backend: the whole
//! map in memory, persisted as one JSON file written to a temp file, fsynced and renamed over
//! the old one, so a crash leaves either the old or the new state, never half of one.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Longest key accepted.
pub const MAX_KEY_BYTES: usize = 256;
/// Largest value accepted (the replica set, ring summary, exceptions are far smaller).
pub const MAX_VALUE_BYTES: usize = 4 << 20;
/// Keys the store holds at most.
pub const MAX_KEYS: usize = 100_000;
/// Change events kept for watchers; older ones are compacted away.
pub const MAX_EVENTS: usize = 4096;

/// What went wrong, and with which key or file.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StoreError {
    #[error("key {0:?}: empty or longer than {MAX_KEY_BYTES} bytes")]
    BadKey(String),
    #[error("value of {key:?} is {len} bytes, more than {MAX_VALUE_BYTES}")]
    TooLarge { key: String, len: usize },
    #[error("store full: {MAX_KEYS} keys")]
    Full,
    #[error("store file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("watch from revision {asked}: compacted, oldest kept is {oldest}")]
    Compacted { asked: u64, oldest: u64 },
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A value with the revision of its last write.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versioned {
    pub value: String,
    pub mod_revision: u64,
}

/// One change, for watchers. `value: None` is a delete.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub key: String,
    pub value: Option<String>,
    pub revision: u64,
}

/// The controller's view of a store (etcd-shaped; see the module doc).
pub trait Store: Send {
    fn get(&self, key: &str) -> Result<Option<Versioned>>;
    /// Unconditional write; returns the new revision.
    fn put(&mut self, key: &str, value: &str) -> Result<u64>;
    /// Deletes `key`; `Ok(None)` if it was absent, else the new revision.
    fn delete(&mut self, key: &str) -> Result<Option<u64>>;
    /// Keys under `prefix`, in key order.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Versioned)>>;
    /// Writes only if `key`'s `mod_revision` equals `expected` (0 = key must be absent).
    /// `Ok(Err(current))` when the comparison failed, with the current revision (0 if absent).
    fn compare_and_swap(
        &mut self,
        key: &str,
        expected: u64,
        value: &str,
    ) -> Result<std::result::Result<u64, u64>>;
    /// Changes under `prefix` with revision > `since`, oldest first ("watch" as a poll; an etcd
    /// backend maps it onto a watch stream with start_revision = since + 1).
    fn changes_since(&self, prefix: &str, since: u64) -> Result<Vec<Event>>;
    /// The store's current revision.
    fn revision(&self) -> u64;
}

/// Typed helpers over any [`Store`]: values are JSON.
pub fn get_json<T: serde::de::DeserializeOwned>(s: &dyn Store, key: &str) -> Result<Option<T>> {
    match s.get(key)? {
        None => Ok(None),
        Some(v) => serde_json::from_str(&v.value)
            .map(Some)
            .map_err(|e| StoreError::File {
                path: PathBuf::from(key),
                reason: format!("undecodable value: {e}"),
            }),
    }
}

pub fn put_json<T: Serialize>(s: &mut dyn Store, key: &str, v: &T) -> Result<u64> {
    let text = serde_json::to_string(v).map_err(|e| StoreError::File {
        path: PathBuf::from(key),
        reason: format!("unencodable value: {e}"),
    })?;
    s.put(key, &text)
}

#[derive(Default, Serialize, Deserialize)]
struct Image {
    revision: u64,
    entries: BTreeMap<String, Versioned>,
}

/// The embedded backend (see the module doc). `path: None` keeps everything in memory (tests).
pub struct FileStore {
    path: Option<PathBuf>,
    image: Image,
    events: VecDeque<Event>,
    /// Revision of the oldest change dropped from `events` (watchers before it must re-list).
    compacted_through: u64,
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        Err(StoreError::BadKey(key.chars().take(64).collect()))
    } else {
        Ok(())
    }
}

impl FileStore {
    pub fn in_memory() -> FileStore {
        FileStore {
            path: None,
            image: Image::default(),
            events: VecDeque::new(),
            compacted_through: 0,
        }
    }

    /// Opens (or creates) the store at `path`; a leftover temp file from a crash is ignored.
    pub fn open(path: &Path) -> Result<FileStore> {
        let ferr = |reason: String| StoreError::File {
            path: path.to_path_buf(),
            reason,
        };
        let image = match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str::<Image>(&text).map_err(|e| ferr(e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Image::default(),
            Err(e) => return Err(ferr(e.to_string())),
        };
        let rev = image.revision;
        Ok(FileStore {
            path: Some(path.to_path_buf()),
            image,
            events: VecDeque::new(),
            // History before this process is not kept: watchers start from the current revision.
            compacted_through: rev,
        })
    }

    fn persist(&self) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let ferr = |reason: String| StoreError::File {
            path: path.clone(),
            reason,
        };
        let text = serde_json::to_vec(&self.image).map_err(|e| ferr(e.to_string()))?;
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode_0600()
            .open(&tmp)
            .map_err(|e| ferr(format!("create {}: {e}", tmp.display())))?;
        f.write_all(&text)
            .and_then(|_| f.sync_all())
            .map_err(|e| ferr(format!("write {}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(|e| ferr(format!("rename: {e}")))
    }

    fn record(&mut self, key: &str, value: Option<String>) {
        let revision = self.image.revision;
        if self.events.len() >= MAX_EVENTS {
            if let Some(old) = self.events.pop_front() {
                self.compacted_through = old.revision;
            }
        }
        self.events.push_back(Event {
            key: key.to_string(),
            value,
            revision,
        });
    }

    fn write(&mut self, key: &str, value: &str) -> Result<u64> {
        check_key(key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(StoreError::TooLarge {
                key: key.to_string(),
                len: value.len(),
            });
        }
        if !self.image.entries.contains_key(key) && self.image.entries.len() >= MAX_KEYS {
            return Err(StoreError::Full);
        }
        let prev_rev = self.image.revision;
        let prev = self.image.entries.get(key).cloned();
        self.image.revision += 1;
        let rev = self.image.revision;
        self.image.entries.insert(
            key.to_string(),
            Versioned {
                value: value.to_string(),
                mod_revision: rev,
            },
        );
        if let Err(e) = self.persist() {
            // Undo so memory never runs ahead of what is on disk.
            self.image.revision = prev_rev;
            match prev {
                Some(p) => self.image.entries.insert(key.to_string(), p),
                None => self.image.entries.remove(key),
            };
            return Err(e);
        }
        self.record(key, Some(value.to_string()));
        Ok(rev)
    }
}

/// `OpenOptions::mode` without importing the trait at every call site.
trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}
impl Mode0600 for std::fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

impl Store for FileStore {
    fn get(&self, key: &str) -> Result<Option<Versioned>> {
        check_key(key)?;
        Ok(self.image.entries.get(key).cloned())
    }

    fn put(&mut self, key: &str, value: &str) -> Result<u64> {
        self.write(key, value)
    }

    fn delete(&mut self, key: &str) -> Result<Option<u64>> {
        check_key(key)?;
        let Some(prev) = self.image.entries.remove(key) else {
            return Ok(None);
        };
        self.image.revision += 1;
        if let Err(e) = self.persist() {
            self.image.revision -= 1;
            self.image.entries.insert(key.to_string(), prev);
            return Err(e);
        }
        self.record(key, None);
        Ok(Some(self.image.revision))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Versioned)>> {
        Ok(self
            .image
            .entries
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    fn compare_and_swap(
        &mut self,
        key: &str,
        expected: u64,
        value: &str,
    ) -> Result<std::result::Result<u64, u64>> {
        check_key(key)?;
        let current = self.image.entries.get(key).map_or(0, |v| v.mod_revision);
        if current != expected {
            return Ok(Err(current));
        }
        self.write(key, value).map(Ok)
    }

    fn changes_since(&self, prefix: &str, since: u64) -> Result<Vec<Event>> {
        if since < self.compacted_through {
            return Err(StoreError::Compacted {
                asked: since,
                oldest: self.compacted_through,
            });
        }
        Ok(self
            .events
            .iter()
            .filter(|e| e.revision > since && e.key.starts_with(prefix))
            .cloned()
            .collect())
    }

    fn revision(&self) -> u64 {
        self.image.revision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pliant-ctl-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn put_get_list_delete_and_revisions() {
        let mut s = FileStore::in_memory();
        assert_eq!(s.put("replicas/1", "a"), Ok(1));
        assert_eq!(s.put("replicas/2", "b"), Ok(2));
        assert_eq!(s.put("policy", "p"), Ok(3));
        assert_eq!(s.put("replicas/1", "a2"), Ok(4));
        let v = s.get("replicas/1").unwrap().unwrap();
        assert_eq!(v.value, "a2");
        assert_eq!(v.mod_revision, 4);
        let l = s.list("replicas/").unwrap();
        assert_eq!(
            l.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            vec!["replicas/1", "replicas/2"]
        );
        assert_eq!(s.delete("replicas/2"), Ok(Some(5)));
        assert_eq!(s.delete("replicas/2"), Ok(None));
        assert_eq!(s.list("replicas/").unwrap().len(), 1);
        assert_eq!(s.revision(), 5);
    }

    #[test]
    fn compare_and_swap_only_on_matching_revision() {
        let mut s = FileStore::in_memory();
        assert_eq!(s.compare_and_swap("epoch", 0, "1"), Ok(Ok(1)));
        // Key exists now: "must be absent" fails and reports the current revision.
        assert_eq!(s.compare_and_swap("epoch", 0, "x"), Ok(Err(1)));
        assert_eq!(s.compare_and_swap("epoch", 7, "x"), Ok(Err(1)));
        assert_eq!(s.compare_and_swap("epoch", 1, "2"), Ok(Ok(2)));
        assert_eq!(s.get("epoch").unwrap().unwrap().value, "2");
    }

    #[test]
    fn bad_keys_and_values_are_refused() {
        let mut s = FileStore::in_memory();
        assert!(matches!(s.put("", "v"), Err(StoreError::BadKey(_))));
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(matches!(s.put(&long, "v"), Err(StoreError::BadKey(_))));
        let big = "v".repeat(MAX_VALUE_BYTES + 1);
        assert!(matches!(s.put("k", &big), Err(StoreError::TooLarge { .. })));
        assert_eq!(s.revision(), 0, "refused writes do not bump the revision");
    }

    #[test]
    fn changes_since_filters_by_prefix_and_revision() {
        let mut s = FileStore::in_memory();
        s.put("a/1", "x").unwrap();
        s.put("b/1", "y").unwrap();
        s.put("a/2", "z").unwrap();
        s.delete("a/1").unwrap();
        let ev = s.changes_since("a/", 1).unwrap();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].key, "a/2");
        assert_eq!(ev[1].value, None);
        assert_eq!(ev[1].revision, 4);
    }

    #[test]
    fn watch_reports_compaction() {
        let mut s = FileStore::in_memory();
        for i in 0..(MAX_EVENTS + 10) {
            s.put("k", &i.to_string()).unwrap();
        }
        assert!(matches!(
            s.changes_since("", 0),
            Err(StoreError::Compacted { .. })
        ));
        assert_eq!(s.changes_since("", s.revision() - 1).unwrap().len(), 1);
    }

    #[test]
    fn file_store_survives_reopen_and_is_private() {
        let d = tmpdir("reopen");
        let p = d.join("store.json");
        {
            let mut s = FileStore::open(&p).unwrap();
            s.put("policy", "{\"x\":1}").unwrap();
            s.put("epoch", "3").unwrap();
        }
        let s = FileStore::open(&p).unwrap();
        assert_eq!(s.get("epoch").unwrap().unwrap().value, "3");
        assert_eq!(s.revision(), 2);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Reopened stores do not pretend to have history.
        assert!(s.changes_since("", 0).is_err());
        assert!(s.changes_since("", 2).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn corrupt_file_is_a_typed_error() {
        let d = tmpdir("corrupt");
        let p = d.join("store.json");
        std::fs::write(&p, "{not json").unwrap();
        assert!(matches!(FileStore::open(&p), Err(StoreError::File { .. })));
        let _ = std::fs::remove_dir_all(&d);
    }
}
