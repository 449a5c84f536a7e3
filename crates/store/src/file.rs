//! The embedded single-host backend: the whole map in memory, persisted as one JSON file written
//! to a temp file, fsynced and renamed over the old one, so a crash leaves either the old or the
//! new state, never half of one. History (for watchers) is kept in memory only: a reopened store
//! starts its history at its current revision.

use crate::{
    check_key, watch_channel, Event, Result, Store, StoreError, Versioned, Watch, WatchSender,
    MAX_EVENTS, MAX_KEYS, MAX_VALUE_BYTES,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

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
    /// Live watches: (prefix, sender). Pruned when their watcher is gone.
    watchers: Mutex<Vec<(String, WatchSender)>>,
}

impl FileStore {
    pub fn in_memory() -> FileStore {
        FileStore {
            path: None,
            image: Image::default(),
            events: VecDeque::new(),
            compacted_through: 0,
            watchers: Mutex::new(Vec::new()),
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
            watchers: Mutex::new(Vec::new()),
        })
    }

    /// Changes under `prefix` with revision > `since` kept in this process's history, oldest
    /// first.
    pub fn changes_since(&self, prefix: &str, since: u64) -> Result<Vec<Event>> {
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
        let ev = Event {
            key: key.to_string(),
            value,
            revision,
        };
        let mut w = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        w.retain(|(prefix, tx)| !ev.key.starts_with(prefix.as_str()) || tx.send(Ok(ev.clone())));
        w.retain(|(_, tx)| !tx.is_closed());
        drop(w);
        self.events.push_back(ev);
    }

    fn write(&mut self, key: &str, value: &str) -> Result<u64> {
        check_key(key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(StoreError::TooLarge {
                key: key.to_string(),
                len: value.len(),
                max: MAX_VALUE_BYTES,
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
    fn backend(&self) -> &'static str {
        "file"
    }

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

    fn watch(&self, prefix: &str, since: u64) -> Result<Watch> {
        // History and registration under one borrow of self: no write can fall between them.
        let backlog = self.changes_since(prefix, since)?;
        let (tx, watch) = watch_channel();
        for ev in backlog {
            tx.send(Ok(ev));
        }
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((prefix.to_string(), tx));
        Ok(watch)
    }

    fn revision(&self) -> u64 {
        self.image.revision
    }

    fn health(&self) -> Result<u64> {
        Ok(self.image.revision)
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
