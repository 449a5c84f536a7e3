//! The replica's durable Raft log: one append-only file of framed records.
//!
//! Record: `[len u32 LE][crc32 u32 LE][tag u8][payload]`, `len` counting tag and payload, the
//! CRC covering them. Tags: an entry (protobuf `eraftpb.Entry`) or a hard state
//! (`eraftpb.HardState`). Raft may overwrite a suffix of uncommitted entries after a leader
//! change; the file is never rewritten for that: a later entry of index `i` supersedes every
//! earlier record of index `>= i` when the file is read back.
//!
//! Writes are buffered and reach the disk in [`Log::sync`], once per Raft `Ready` (every entry
//! and hard state of that round, then one `fdatasync`): the batched fsync. Raft sends the
//! messages that depend on them (votes, append acks) only after that sync.
//!
//! The file is extended ahead of the records in steps of [`PREALLOC`] zero bytes (written and
//! synced once per step), and records overwrite those zeros in place: the `fdatasync` of a
//! record then flushes data only, not the file size and its journal commit, which on this
//! project's disks halves its cost. Zeros read as the end of the log (a record's length is
//! never 0). A clean close and every open cut the file back to its records, so the zeros only
//! remain after a crash, where the next open cuts them with any torn record.
//!
//! Recovery reads records until the first that is short, over the size bound, or fails its
//! CRC, and truncates the file there: a crash mid-write leaves at most a torn tail, which held
//! nothing that was acknowledged (acknowledgement follows the sync).
//!
//! No compaction yet: the file grows with the service's input (a snapshot of the server is a
//! later step).

use protobuf::Message as _;
use raft::prelude::{Entry, HardState};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const TAG_ENTRY: u8 = 1;
const TAG_HARD_STATE: u8 = 2;
const FRAME: usize = 8;
/// Zero bytes the file is extended by ahead of its records.
pub const PREALLOC: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("log {path}: record at offset {offset} passed its CRC but does not decode: {why}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        why: String,
    },
    #[error("log {path}: entry {index} leaves a gap after {last}")]
    Gap {
        path: PathBuf,
        index: u64,
        last: u64,
    },
}

/// What was read back at open.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The surviving entries, contiguous, oldest first.
    pub entries: Vec<Entry>,
    /// The last hard state written, if any.
    pub hard_state: Option<HardState>,
    /// Bytes of torn tail cut off the file.
    pub truncated: u64,
}

pub struct Log {
    path: PathBuf,
    file: File,
    /// Records written since the last sync (appended to the file in one write).
    pending: Vec<u8>,
    /// Largest record accepted, written or read.
    max_record: usize,
    /// File length, synced or not.
    len: u64,
    /// Bytes of records in the file (written, synced or not): where the next write goes.
    written: u64,
    /// File size: records plus the zeros ahead of them.
    allocated: u64,
}

impl Log {
    /// Opens (creating) the log at `path`, reads it back, cuts a torn tail.
    pub fn open(path: &Path, max_record: usize) -> Result<(Log, Recovered), LogError> {
        let io_err = |source| LogError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err)?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io_err)?;
        let (rec, good) = read_records(path, &buf)?;
        let truncated = (buf.len() - good) as u64;
        if truncated > 0 {
            tracing::warn!(path = %path.display(), bytes = truncated, "log: torn tail cut");
            file.set_len(good as u64).map_err(io_err)?;
            file.sync_data().map_err(io_err)?;
        }
        let log = Log {
            path: path.to_path_buf(),
            file,
            pending: Vec::new(),
            max_record,
            len: good as u64,
            written: good as u64,
            allocated: good as u64,
        };
        Ok((log, Recovered { truncated, ..rec }))
    }

    /// Buffers `entries` (written at the next [`Log::sync`]).
    pub fn append_entries(&mut self, entries: &[Entry]) -> Result<(), LogError> {
        for e in entries {
            let b = e.write_to_bytes().map_err(|e| self.corrupt_w(e))?;
            self.push(TAG_ENTRY, &b)?;
        }
        Ok(())
    }

    /// Buffers a hard state (term, vote, commit).
    pub fn append_hard_state(&mut self, hs: &HardState) -> Result<(), LogError> {
        let b = hs.write_to_bytes().map_err(|e| self.corrupt_w(e))?;
        self.push(TAG_HARD_STATE, &b)
    }

    /// Writes what is buffered and makes it durable (nothing to do when nothing is).
    pub fn sync(&mut self) -> Result<(), LogError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let io_err = |source| LogError::Io {
            path: self.path.clone(),
            source,
        };
        let end = self.written + self.pending.len() as u64;
        if end > self.allocated {
            // Zeros up to the next step past the records, made durable with the records below
            // (this one sync also carries the new file size).
            let to = end.div_ceil(PREALLOC) * PREALLOC + PREALLOC;
            let zeros = vec![0u8; (to - self.allocated) as usize];
            self.file
                .write_all_at(&zeros, self.allocated)
                .map_err(io_err)?;
            self.allocated = to;
        }
        self.file
            .write_all_at(&self.pending, self.written)
            .map_err(io_err)?;
        self.file.sync_data().map_err(io_err)?;
        self.written = end;
        self.pending.clear();
        Ok(())
    }

    /// Bytes in the file once the buffer is synced.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, tag: u8, payload: &[u8]) -> Result<(), LogError> {
        let len = 1 + payload.len();
        if len > self.max_record {
            return Err(LogError::Io {
                path: self.path.clone(),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("record of {len} bytes over the bound {}", self.max_record),
                ),
            });
        }
        let mut crc = crc32fast::Hasher::new();
        crc.update(&[tag]);
        crc.update(payload);
        self.pending.extend_from_slice(&(len as u32).to_le_bytes());
        self.pending
            .extend_from_slice(&crc.finalize().to_le_bytes());
        self.pending.push(tag);
        self.pending.extend_from_slice(payload);
        self.len += (FRAME + len) as u64;
        Ok(())
    }

    fn corrupt_w(&self, e: protobuf::ProtobufError) -> LogError {
        LogError::Io {
            path: self.path.clone(),
            source: io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
        }
    }
}

impl Drop for Log {
    /// A clean close: what is still buffered is written (not synced: nothing waits on it, Raft
    /// only buffers a commit index without a sync), and the zeros ahead are cut off.
    fn drop(&mut self) {
        if !self.pending.is_empty() && self.file.write_all_at(&self.pending, self.written).is_ok() {
            self.written += self.pending.len() as u64;
        }
        if self.allocated > self.written {
            let _ = self.file.set_len(self.written);
        }
    }
}

/// Parses `buf`; returns what it holds and the length of its intact prefix.
///
/// No size bound applies here: the file is this replica's own and already in memory, so a
/// length field that points past the end is simply a torn tail.
fn read_records(path: &Path, buf: &[u8]) -> Result<(Recovered, usize), LogError> {
    let mut rec = Recovered::default();
    let mut off = 0usize;
    while buf.len() - off >= FRAME {
        let len = u32::from_le_bytes(buf[off..off + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(buf[off + 4..off + 8].try_into().expect("4 bytes"));
        if len == 0 || buf.len() - off - FRAME < len {
            break;
        }
        let body = &buf[off + FRAME..off + FRAME + len];
        if crc32fast::hash(body) != crc {
            break;
        }
        let corrupt = |why: String| LogError::Corrupt {
            path: path.to_path_buf(),
            offset: off as u64,
            why,
        };
        match body[0] {
            TAG_ENTRY => {
                let e = Entry::parse_from_bytes(&body[1..]).map_err(|e| corrupt(e.to_string()))?;
                supersede(path, &mut rec.entries, e)?;
            }
            TAG_HARD_STATE => {
                let hs =
                    HardState::parse_from_bytes(&body[1..]).map_err(|e| corrupt(e.to_string()))?;
                rec.hard_state = Some(hs);
            }
            t => return Err(corrupt(format!("unknown tag {t}"))),
        }
        off += FRAME + len;
    }
    Ok((rec, off))
}

/// Appends `e`, dropping the entries it supersedes (a new leader's overwrite of a suffix).
fn supersede(path: &Path, entries: &mut Vec<Entry>, e: Entry) -> Result<(), LogError> {
    if let Some(first) = entries.first().map(|f| f.index) {
        let last = first + entries.len() as u64 - 1;
        if e.index > last + 1 {
            return Err(LogError::Gap {
                path: path.to_path_buf(),
                index: e.index,
                last,
            });
        }
        if e.index < first {
            entries.clear();
        } else {
            entries.truncate((e.index - first) as usize);
        }
    }
    entries.push(e);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(term: u64, index: u64, data: &[u8]) -> Entry {
        Entry {
            term,
            index,
            data: data.to_vec().into(),
            ..Default::default()
        }
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("smr-log-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    #[test]
    fn entries_and_hard_state_survive_reopen() {
        let p = tmp("reopen");
        let (mut log, rec) = Log::open(&p, 1 << 20).unwrap();
        assert!(rec.entries.is_empty() && rec.hard_state.is_none());
        log.append_entries(&[entry(1, 1, b"a"), entry(1, 2, b"b")])
            .unwrap();
        let hs = HardState {
            term: 1,
            vote: 2,
            commit: 2,
            ..Default::default()
        };
        log.append_hard_state(&hs).unwrap();
        log.sync().unwrap();
        let len = log.len();
        drop(log);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), len);
        let (_, rec) = Log::open(&p, 1 << 20).unwrap();
        assert_eq!(rec.entries.len(), 2);
        assert_eq!(&rec.entries[1].data[..], b"b");
        assert_eq!(rec.hard_state.unwrap().vote, 2);
        assert_eq!(rec.truncated, 0);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_later_entry_supersedes_the_suffix_it_overwrites() {
        let p = tmp("supersede");
        let (mut log, _) = Log::open(&p, 1 << 20).unwrap();
        log.append_entries(&[entry(1, 1, b"a"), entry(1, 2, b"b"), entry(1, 3, b"c")])
            .unwrap();
        log.append_entries(&[entry(2, 2, b"B")]).unwrap();
        log.sync().unwrap();
        drop(log);
        let (_, rec) = Log::open(&p, 1 << 20).unwrap();
        let got: Vec<(u64, u64, Vec<u8>)> = rec
            .entries
            .iter()
            .map(|e| (e.term, e.index, e.data.to_vec()))
            .collect();
        assert_eq!(got, vec![(1, 1, b"a".to_vec()), (2, 2, b"B".to_vec())]);
        let _ = std::fs::remove_file(&p);
    }

    /// Every cut of the last record (a crash mid-write), and a flipped byte in it, loses that
    /// record only; the file is truncated to the intact prefix and appends continue after it.
    #[test]
    fn a_torn_or_corrupt_tail_is_cut_and_the_prefix_kept() {
        let p = tmp("torn");
        let (mut log, _) = Log::open(&p, 1 << 20).unwrap();
        log.append_entries(&[entry(1, 1, b"first"), entry(1, 2, b"second")])
            .unwrap();
        log.sync().unwrap();
        let good = log.len();
        log.append_entries(&[entry(1, 3, b"third, torn")]).unwrap();
        log.sync().unwrap();
        let full = log.len();
        drop(log);
        let whole = std::fs::read(&p).unwrap();
        assert_eq!(whole.len() as u64, full);
        let mut cases: Vec<Vec<u8>> = (good as usize..full as usize)
            .map(|cut| whole[..cut].to_vec())
            .collect();
        for flip in good as usize..full as usize {
            let mut b = whole.clone();
            b[flip] ^= 0x40;
            cases.push(b);
        }
        for (i, bytes) in cases.iter().enumerate() {
            std::fs::write(&p, bytes).unwrap();
            let (mut log, rec) = Log::open(&p, 1 << 20).unwrap();
            assert_eq!(rec.entries.len(), 2, "case {i}");
            assert_eq!(rec.truncated, bytes.len() as u64 - good, "case {i}");
            assert_eq!(std::fs::metadata(&p).unwrap().len(), good, "case {i}");
            log.append_entries(&[entry(1, 3, b"again")]).unwrap();
            log.sync().unwrap();
            drop(log);
            let (_, rec) = Log::open(&p, 1 << 20).unwrap();
            assert_eq!(rec.entries.len(), 3, "case {i}");
            assert_eq!(&rec.entries[2].data[..], b"again", "case {i}");
        }
        let _ = std::fs::remove_file(&p);
    }

    /// While open the file runs ahead of the records with zeros; a crash leaves them, the next
    /// open reads them as the end and cuts them; a clean close cuts them itself.
    #[test]
    fn zeros_ahead_of_the_records_read_as_the_end() {
        let p = tmp("prealloc");
        let (mut log, _) = Log::open(&p, 1 << 20).unwrap();
        log.append_entries(&[entry(1, 1, b"a"), entry(1, 2, b"b")])
            .unwrap();
        log.sync().unwrap();
        let len = log.len();
        let size = std::fs::metadata(&p).unwrap().len();
        assert!(
            size > len && size.is_multiple_of(PREALLOC),
            "{size} ahead of {len}"
        );
        let on_disk = std::fs::read(&p).unwrap();
        assert!(on_disk[len as usize..].iter().all(|&b| b == 0));
        // A crash: no close, the zeros stay.
        std::mem::forget(log);
        let (mut log, rec) = Log::open(&p, 1 << 20).unwrap();
        assert_eq!(rec.entries.len(), 2);
        assert_eq!(rec.truncated, size - len, "the zeros are cut");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), len);
        log.append_entries(&[entry(1, 3, b"c")]).unwrap();
        log.sync().unwrap();
        let len = log.len();
        drop(log);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), len, "a clean close");
        let (_, rec) = Log::open(&p, 1 << 20).unwrap();
        assert_eq!((rec.entries.len(), rec.truncated), (3, 0));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_record_over_the_bound_is_refused_when_written() {
        let p = tmp("bound");
        let (mut log, _) = Log::open(&p, 64).unwrap();
        assert!(log.append_entries(&[entry(1, 1, &[0u8; 100])]).is_err());
        log.sync().unwrap();
        assert!(log.is_empty());
        let _ = std::fs::remove_file(&p);
    }
}
